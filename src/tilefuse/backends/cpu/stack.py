"""The stack a generated C++ kernel's programs run on, and what their tile arrays take of it.

A program's tiles that leave their loop nest are arrays declared inside the OpenMP loop:
they live on the stack of the thread that runs the program — the caller's (the main thread,
8 MiB by default, or a Python thread) or an OpenMP worker's (`OMP_STACKSIZE`, else the
threads library's default: on glibc the stack rlimit, 2 MiB when that is unlimited). A tile
too large for it is a segmentation fault, so kernels are kept to a budget: a quarter of the
smallest of those stacks (the rest is for the frames below the kernel), and never more than
2 MiB (tiles beyond that do not fit the caches either).
"""
from __future__ import annotations

import os
import re
import sys
import threading

#: the most a program's tile arrays may take, whatever the stacks are
STACK_CEILING = 2 << 20
#: the share of the smallest thread stack a program's tile arrays may take
STACK_SHARE = 4
_MIB = 1 << 20

_ARRAY = re.compile(r"^\s*(?:alignas\(\d+\)\s+)?([A-Za-z_]\w*)\s+\w+\[(\d+)\];", re.M)
_SIZES = {"float": 4, "double": 8, "int64_t": 8, "uint64_t": 8, "int32_t": 4, "uint32_t": 4, "int16_t": 2,
          "uint16_t": 2, "int8_t": 1, "uint8_t": 1, "bool": 1, "_Float16": 2}


def stack_bytes(source: str) -> int:
    """Bytes of the arrays a program of a generated kernel declares: the most any one function
    of the source declares (a kernel's range function holds its program's arrays; its size
    variants follow it, the largest usually last), each array counted once, as if every
    scope's arrays were live at the same time."""
    functions = source.split('extern "C" void ')[1:] or [source]  # (not the header's declarations)
    return max(sum(int(n) * _SIZES.get(t, 8) for t, n in _ARRAY.findall(body)) for body in functions)


def _openmp_stacksize() -> int | None:
    """Worker stack size set through the environment (OpenMP's form: a number with an optional
    B, K, M or G unit; no unit means KiB)."""
    for var in ("OMP_STACKSIZE", "GOMP_STACKSIZE", "KMP_STACKSIZE"):
        text = os.environ.get(var, "").strip().upper()
        m = re.fullmatch(r"(\d+)\s*([BKMG]?)", text)
        if m:
            scale = {"B": 1, "": 1024, "K": 1024, "M": _MIB, "G": 1 << 30}[m.group(2)]
            return int(m.group(1)) * scale
    return None


def thread_stacks() -> dict[str, int]:
    """The stacks a kernel's programs may run on, in bytes: the main thread's, an OpenMP
    worker's, and a Python thread's."""
    limit = None
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_STACK)[0]
        if soft != resource.RLIM_INFINITY and soft > 0:
            limit = soft
    except (ImportError, OSError, ValueError):
        pass
    # a thread created without a size: glibc takes the rlimit (2 MiB when unlimited); LLVM's
    # OpenMP gives its workers 4 MiB, and Python's threads on macOS get 16 MiB
    default = (limit or 2 * _MIB) if sys.platform.startswith("linux") else 4 * _MIB
    return {"main": limit or 8 * _MIB, "openmp": _openmp_stacksize() or default,
            "python": threading.stack_size() or default}


def stack_budget() -> int:
    """Bytes a program's tile arrays may take (see the module docstring)."""
    return min(STACK_CEILING, min(thread_stacks().values()) // STACK_SHARE)


__all__ = ["stack_bytes", "stack_budget", "thread_stacks", "STACK_CEILING", "STACK_SHARE"]
