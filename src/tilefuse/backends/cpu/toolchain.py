"""The system C++ compiler: finding it, its flags, and building one kernel's shared library.

The compiler is `$CXX`, else the first of `c++`, `g++`, `clang++` on the PATH. Kernels are
built with `-O3 -march=native` and OpenMP; when the compiler has no OpenMP (Apple clang
without libomp) kernels are built without it, single-threaded, and a message says so once.
Everything that changes the binary (the compiler's version, the flags, this CPU's ISA) is
part of `build_key`, the disk-cache key of a kernel.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

from ... import logs
from ...runtime.cache import cache_key, environment_fingerprint

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
         "-fwrapv", "-fno-semantic-interposition", "-mprefer-vector-width=512")
OPENMP = ("-fopenmp",)
_no_openmp: set[str] = set()  # compilers found to lack OpenMP in this process


class CompilerNotFound(RuntimeError):
    """No C++ compiler: the CPU backend cannot build kernels."""


class CompileError(RuntimeError):
    """The C++ compiler rejected a generated kernel (a bug in the CPU backend)."""


def find_compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx) or (cxx if os.path.isfile(cxx) else None)
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def require_compiler() -> str:
    cxx = find_compiler()
    if cxx is None:
        raise CompilerNotFound(
            "the CPU backend needs a C++ compiler and none was found (set CXX, or install g++ or clang++); "
            "TILEFUSE_BACKEND=interpret runs the kernels through the Triton interpreter instead")
    return cxx


@functools.lru_cache(maxsize=None)
def compiler_version(cxx: str) -> str:
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@functools.lru_cache(maxsize=None)
def cpu_id() -> str:
    """The ISA `-march=native` targets: a hash of the CPU's model and feature flags."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    text += line
                if line.strip() == "":
                    break
    except OSError:
        import platform

        text = platform.processor() + platform.machine()
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def flags(cxx: str) -> tuple:
    return FLAGS + (() if cxx in _no_openmp else OPENMP)


def build_key(source: str, cxx: str) -> str:
    return cache_key("cpu-kernel", source, compiler_version(cxx), flags(cxx), cpu_id(), environment_fingerprint())


def build(source: str, cxx: str) -> bytes:
    """Compile `source` to a shared library; returns its bytes."""
    with tempfile.TemporaryDirectory(prefix="tilefuse-cpp-") as tmp:
        src, lib = os.path.join(tmp, "kernel.cpp"), os.path.join(tmp, "kernel.so")
        with open(src, "w") as f:
            f.write(source)
        proc = _run(cxx, flags(cxx), src, lib)
        if proc.returncode != 0 and cxx not in _no_openmp and "openmp" in proc.stderr.lower() + proc.stdout.lower():
            _no_openmp.add(cxx)
            logs.log("code", "%s has no OpenMP: CPU kernels are built single-threaded", cxx)
            import warnings

            warnings.warn(f"{cxx} has no OpenMP support: tilefuse CPU kernels run on one thread", RuntimeWarning)
            proc = _run(cxx, flags(cxx), src, lib)
        if proc.returncode != 0:
            raise CompileError(f"{os.path.basename(cxx)} failed on a generated kernel:\n{proc.stderr[-4000:]}")
        with open(lib, "rb") as f:
            return f.read()


def _run(cxx: str, fl: tuple, src: str, lib: str):
    return subprocess.run([cxx, *fl, src, "-o", lib], capture_output=True, text=True, timeout=300)
