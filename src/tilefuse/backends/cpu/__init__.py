"""The CPU backend: tile IR printed as C++ (OpenMP over programs, vectorisable tile loops),
compiled by the system C++ compiler, cached on disk and loaded with ctypes."""
from .codegen import generate
from .exprs import CppUnsupported
from .launcher import CppKernel, load_kernel
from .toolchain import CompileError, CompilerNotFound, find_compiler, require_compiler

__all__ = ["generate", "load_kernel", "CppKernel", "CppUnsupported", "CompilerNotFound", "CompileError",
           "find_compiler", "require_compiler"]
