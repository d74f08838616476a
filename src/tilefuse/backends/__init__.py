"""Code generators for tile IR: `triton` (GPU, and CPU through the Triton interpreter)."""
