"""Code generators for tile IR and their launchers: `triton` (GPU, and CPU through the Triton
interpreter) and `cpu` (C++); beside them each target's limits (`limits`) and the launchers'
memo of what each set of sizes works out (`size_cache`)."""
