"""The system C++ compiler: finding it, its flags, and building one kernel's shared library.

The compiler is `$CXX`, else the first of `c++`, `g++`, `clang++` on the PATH. Flags suit the
host (`host_flags`): `-O3` and fast-but-exact math everywhere; on x86-64 `-march=native` and
512-bit vectors; on 64-bit Arm `-mcpu=native`; on any other machine portable flags only.
Kernels use OpenMP (threads across programs, `omp simd` inner loops). A compiler without it
(Apple clang, which has no `-fopenmp`; a clang without libomp) builds kernels single-threaded:
with `-fopenmp-simd` if it has that, else with none; a message says so once. Apple clang is
known to lack OpenMP up front; any other compiler is found out by its first failed build.
With GCC on x86-64 glibc (2.22 or later), `sin`, `cos` and `log` of floats come from glibc's
vector math library, libmvec (`vector_math`): vectorised loops call its 8- or 16-lane variants
instead of the scalar function lane by lane (a build that cannot link it retries without it).
Everything that changes the binary (the compiler's version, the flags, this CPU's ISA) is
part of `build_key`, the disk-cache key of a kernel.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings

from ... import logs
from ...cache.disk import cache_key, environment_fingerprint

FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math", "-fwrapv")
X86_64 = ("-march=native", "-mprefer-vector-width=512")
ARM64 = ("-mcpu=native",)
# OpenMP as far as the compiler has it: threads and simd, simd pragmas only, nothing
OPENMP_LEVELS = (("-fopenmp",), ("-fopenmp-simd",), ())
_openmp_level: dict[str, int] = {}  # compilers found to lack (some) OpenMP in this process
#: glibc's vector math: the kernel's prelude declares its functions `simd` (`runtime.HEADER`)
MVEC_DEFINE = ("-DTF_MVEC",)
MVEC_235_DEFINE = ("-DTF_MVEC235",)
MVEC_LIBS = ("-l:libmvec.so.1",)
_no_mvec: set[str] = set()  # compilers whose builds failed to link libmvec in this process
_told_single_threaded: set[str] = set()
_lock = threading.Lock()  # builds run in a thread pool


class CompilerNotFound(RuntimeError):
    """No C++ compiler: the CPU backend cannot build kernels."""


class CompileError(RuntimeError):
    """The C++ compiler rejected a generated kernel (a bug in the CPU backend)."""


def find_compiler() -> str | None:
    """The C++ compiler: `CXX`, else the first of c++, g++, clang++ on the PATH (looked up once
    per value of the two: a stored graph's kernels each ask when they load)."""
    return _compiler_on(os.environ.get("CXX"), os.environ.get("PATH"))


@functools.lru_cache(maxsize=8)
def _compiler_on(cxx: str | None, path: str | None) -> str | None:
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
            "TILEFUSE_TARGET=interpret runs the kernels through the Triton interpreter instead")
    return cxx


@functools.lru_cache(maxsize=None)
def _version_text(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def compiler_version(cxx: str) -> str:
    text = _version_text(cxx)
    return text.splitlines()[0] if text else "unknown"


def compiler_family(cxx: str) -> str:
    """"gcc", "clang", "apple-clang", or "unknown" (then treated as GCC-compatible, as every
    compiler found under the names above is)."""
    text = _version_text(cxx)
    if "Apple" in text and "clang" in text:
        return "apple-clang"
    if "clang" in text:
        return "clang"
    if "Free Software Foundation" in text or "gcc" in text.lower() or "g++" in text:
        return "gcc"
    return "unknown"


@functools.lru_cache(maxsize=None)
def cpu_id() -> str:
    """The ISA `-march=native`/`-mcpu=native` targets: a hash of the CPU's model and features."""
    text = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")):
                    text += line
                if line.strip() == "":
                    break
    except OSError:  # no /proc (macOS): the CPU's name where sysctl has it
        text = platform.processor() + platform.machine()
        try:
            text += subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                   text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            pass
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def vector_registers() -> int:
    """How many 16-float vector registers the code `-march=native` builds for has: 32 with
    AVX-512 (32 zmm), else 8 (16 ymm under AVX2, 32 q registers on Arm: 8 of 16 floats)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return 8
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return 32 if "avx512f" in line.split() else 8
    except OSError:  # no /proc: assume the smaller register file (correct either way, maybe slower)
        pass
    return 8


def glibc_version() -> tuple:
    """(major, minor) of the C library when it is glibc, else ()."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        return tuple(int(p) for p in version.split(".")[:2]) if name == "glibc" else ()
    except (AttributeError, ValueError, OSError):
        return ()


def vector_math(machine: str, family: str, glibc: tuple) -> bool:
    """Whether kernels call libmvec: GCC (which reads the `simd` declarations as the x86-64
    vector ABI) on x86-64 with glibc 2.22 or later."""
    return family == "gcc" and machine.lower() in ("x86_64", "amd64") and glibc >= (2, 22)


def _mvec_defines(mvec) -> tuple:
    """`mvec`: False, or glibc's (major, minor) version (True: the 2.22 set only)."""
    if not mvec:
        return ()
    return MVEC_DEFINE + (MVEC_235_DEFINE if mvec is not True and mvec >= (2, 35) else ())


def host_flags(machine: str, family: str, openmp_level: int = 0, mvec=False) -> tuple:
    """The flags for a host (`platform.machine()`) and compiler family; `openmp_level` indexes
    `OPENMP_LEVELS`; `mvec`: the prelude declares libmvec's functions (glibc's version, or
    True for those of 2.22: sin, cos, log; 2.35 added log2, log10, log1p, expm1, tan, the
    inverse and hyperbolic functions)."""
    machine = machine.lower()
    if machine in ("x86_64", "amd64"):
        target = X86_64
    elif machine in ("aarch64", "arm64"):
        target = ARM64
    else:
        target = ()
    openmp_level = max(openmp_level, _first_openmp_level(family))
    # GCC and LLVM on ELF: calls between a library's own functions need not go through the PLT
    interposition = () if family == "apple-clang" else ("-fno-semantic-interposition",)
    return FLAGS + interposition + target + OPENMP_LEVELS[openmp_level] + _mvec_defines(mvec)


def _first_openmp_level(family: str) -> int:
    return 1 if family == "apple-clang" else 0  # Apple's driver rejects -fopenmp outright


def _openmp_level_of(cxx: str) -> int:
    return max(_openmp_level.get(cxx, 0), _first_openmp_level(compiler_family(cxx)))


def _uses_mvec(cxx: str) -> bool:
    return cxx not in _no_mvec and vector_math(platform.machine(), compiler_family(cxx), glibc_version())


def flags(cxx: str, openmp_level: int | None = None) -> tuple:
    level = _openmp_level_of(cxx) if openmp_level is None else openmp_level
    return host_flags(platform.machine(), compiler_family(cxx), level, _uses_mvec(cxx) and glibc_version())


def _libs(cxx: str) -> tuple:
    """Libraries a kernel links, after its source (a linker with --as-needed drops a library
    named before the objects that use it)."""
    return MVEC_LIBS if _uses_mvec(cxx) else ()


def build_key(source: str, cxx: str) -> str:
    return cache_key("cpu-kernel", source, compiler_version(cxx), flags(cxx), cpu_id(), environment_fingerprint())


def build(source: str, cxx: str, extra: tuple = ()) -> bytes:
    """Compile `source` to a shared library (`extra`: more flags); returns its bytes. The work
    happens in a private temporary directory named after this process (`tilefuse-cpp-<pid>-*`),
    removed when the build ends; a process killed meanwhile leaves it to `cache.scratch.sweep`."""
    with tempfile.TemporaryDirectory(prefix=f"tilefuse-cpp-{os.getpid()}-") as tmp:
        src, lib = os.path.join(tmp, "kernel.cpp"), os.path.join(tmp, "kernel.so")
        with open(src, "w") as f:
            f.write(source)
        level = _openmp_level_of(cxx)
        proc = _run(cxx, flags(cxx, level) + extra, src, lib, _libs(cxx))
        if proc.returncode != 0 and _uses_mvec(cxx) and any(sign in proc.stderr + proc.stdout
                                                             for sign in ("mvec", "_ZGV")):
            with _lock:  # from now on for this compiler: the scalar functions
                _no_mvec.add(cxx)
            logs.log("code", "%s cannot link libmvec: sin, cos and log run lane by lane", cxx)
            proc = _run(cxx, flags(cxx, level) + extra, src, lib, _libs(cxx))
        while proc.returncode != 0 and level < len(OPENMP_LEVELS) - 1 and _rejects_openmp(proc):
            level += 1  # from now on for this compiler
            with _lock:
                _openmp_level[cxx] = max(_openmp_level.get(cxx, 0), level)
            proc = _run(cxx, flags(cxx, level) + extra, src, lib, _libs(cxx))
        if level > 0 and cxx not in _told_single_threaded:
            _told_single_threaded.add(cxx)
            logs.log("code", "%s has no OpenMP: CPU kernels are built single-threaded", cxx)
            warnings.warn(f"{cxx} has no OpenMP support: tilefuse CPU kernels run on one thread", RuntimeWarning)
        if proc.returncode != 0:
            raise CompileError(f"{os.path.basename(cxx)} failed on a generated kernel:\n{proc.stderr[-4000:]}")
        with open(lib, "rb") as f:
            return f.read()


# what a compiler without OpenMP says: the flag refused, or the runtime library missing
_NO_OPENMP_SIGNS = ("-fopenmp", "omp.h", "lgomp", "lomp", "libgomp", "libomp", "libiomp")


def _rejects_openmp(proc) -> bool:
    return any(sign in proc.stderr + proc.stdout for sign in _NO_OPENMP_SIGNS)


def _run(cxx: str, fl: tuple, src: str, lib: str, libs: tuple = ()):
    return subprocess.run([cxx, *fl, src, "-o", lib, *libs], capture_output=True, text=True, timeout=300)
