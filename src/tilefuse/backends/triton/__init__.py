"""The Triton backend: tile IR printed as Triton, loaded through the kernel cache."""
from .codegen import generate
from .launcher import TritonKernel, load_kernel

__all__ = ["generate", "TritonKernel", "load_kernel"]
