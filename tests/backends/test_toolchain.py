"""The C++ toolchain's flags suit the host: chosen by machine and compiler family (checked
by name, no cross compiler needed), part of the kernel cache key, and a compiler without
OpenMP builds working single-threaded kernels instead of failing."""
import math
import stat
import sys
import warnings

import pytest
import torch

import tilefuse
from tilefuse.backends import cpu
from tilefuse.backends.cpu import toolchain

NATIVE_X86 = {"-march=native", "-mprefer-vector-width=512"}


@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "amd64"])
@pytest.mark.parametrize("family", ["gcc", "clang", "unknown"])
def test_x86_64_flags(machine, family):
    fl = toolchain.host_flags(machine, family)
    assert NATIVE_X86 <= set(fl) and "-mcpu=native" not in fl
    assert "-O3" in fl and "-fopenmp" in fl


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ARM64"])
@pytest.mark.parametrize("family", ["gcc", "clang", "apple-clang"])
def test_arm64_flags(machine, family):
    fl = toolchain.host_flags(machine, family)
    assert "-mcpu=native" in fl
    assert not NATIVE_X86 & set(fl) and not any(f.startswith("-march") for f in fl)


@pytest.mark.parametrize("machine", ["ppc64le", "riscv64", "s390x", "armv7l", ""])
def test_other_machines_get_portable_flags(machine):
    fl = toolchain.host_flags(machine, "gcc")
    assert "-O3" in fl
    assert not any(f.startswith(("-march", "-mcpu", "-mtune", "-mprefer")) for f in fl)


def test_apple_clang_builds_without_openmp_runtime():
    fl = toolchain.host_flags("arm64", "apple-clang")
    assert "-fopenmp" not in fl and "-fopenmp-simd" in fl  # Apple's driver rejects -fopenmp
    assert "-fno-semantic-interposition" not in fl
    assert "-fopenmp" in toolchain.host_flags("arm64", "clang")


def test_openmp_levels_step_down():
    assert toolchain.host_flags("x86_64", "gcc", 1)[-1] == "-fopenmp-simd"
    assert not any("openmp" in f for f in toolchain.host_flags("x86_64", "gcc", 2))


def test_this_host_flags_are_in_the_cache_key(monkeypatch):
    cxx = cpu.require_compiler()
    key = toolchain.build_key("int x;", cxx)
    monkeypatch.setattr(toolchain, "host_flags", lambda *a, **k: ("-O2",))
    assert toolchain.build_key("int x;", cxx) != key


def _refusing_compiler(path, version: str, refused: str, message: str):
    """A script standing in for the system compiler: `--version` runs the shell commands
    `version`; a build given the flag `refused` fails with `message`; any other build runs the
    real compiler."""
    real = cpu.require_compiler()
    path.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "--version" ]; then {version}; exit 0; fi\n'
        f'for a in "$@"; do if [ "$a" = "{refused}" ]; then echo "{message}" >&2; exit 1; fi; done\n'
        f'exec "{real}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.mark.skipif(cpu.find_compiler() is None or sys.platform == "win32", reason="no C++ compiler")
def test_compiler_without_openmp_builds_single_threaded_kernels(tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp (as Apple clang does) still builds every kernel."""
    fake = _refusing_compiler(tmp_path / "no-openmp-c++", 'echo "clang version 99 (tilefuse test: no OpenMP)"',
                              "-fopenmp", "clang: error: unsupported option '-fopenmp'")
    monkeypatch.setenv("CXX", str(fake))

    def fn(x, w):
        return torch.softmax(x * w, -1) + x.sum(0)

    x, w = torch.randn(33, 33), torch.randn(33)
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error", cache_dir=str(tmp_path / "cache")), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "no OpenMP support", from a build thread
        out = torch.compile(fn, backend="tilefuse")(x, w)
    torch.testing.assert_close(out, fn(x, w))
    used = toolchain.flags(str(fake))
    assert "-fopenmp" not in used and "-fopenmp-simd" in used  # the next level down, from now on


@pytest.mark.parametrize("machine,family,glibc,expected", [
    ("x86_64", "gcc", (2, 36), True), ("x86_64", "gcc", (2, 22), True), ("x86_64", "gcc", (2, 21), False),
    ("x86_64", "clang", (2, 36), False), ("aarch64", "gcc", (2, 36), False), ("x86_64", "gcc", (), False)])
def test_vector_math_only_where_glibc_and_gcc_provide_it(machine, family, glibc, expected):
    assert toolchain.vector_math(machine, family, glibc) is expected
    assert ("-DTF_MVEC" in toolchain.host_flags(machine, family, mvec=expected)) is expected


@pytest.mark.skipif(cpu.find_compiler() is None or sys.platform == "win32", reason="no C++ compiler")
def test_a_compiler_that_cannot_link_libmvec_builds_without_it(tmp_path, monkeypatch):
    """A GCC whose C library has no libmvec to link: the build retries with the scalar functions."""
    fake = _refusing_compiler(tmp_path / "no-mvec-g++", 'echo "g++ (tilefuse test: no libmvec) 99"; '
                              'echo "Copyright (C) Free Software Foundation, Inc."',
                              "-l:libmvec.so.1", "ld: cannot find -l:libmvec.so.1")
    monkeypatch.setattr(toolchain, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(toolchain.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("CXX", str(fake))

    def fn(x):
        return torch.sin(x) * torch.cos(x) + torch.log(x.abs() + 1)

    x = torch.randn(100)
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error", cache_dir=str(tmp_path / "cache")):
        assert "-DTF_MVEC" in toolchain.flags(str(fake))
        out = torch.compile(fn, backend="tilefuse")(x)
    torch.testing.assert_close(out, fn(x))
    assert "-DTF_MVEC" not in toolchain.flags(str(fake))  # from now on, for this compiler


@pytest.mark.parametrize("op", [torch.sin, torch.cos, torch.log])
@pytest.mark.parametrize("scale", [1.0, 300.0, 1e6, 1e30])
def test_sin_cos_log_over_the_whole_range(op, scale):
    """Within eager's error (fp64 reference) from tiny to huge arguments, with NaN, ±inf, zero
    and (for log) negative values; vectorised through libmvec where the host has it."""
    x = (torch.rand(4099) * 2 - 1) * scale
    x[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30])
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error"):
        out = torch.compile(lambda x: op(x * 1.0), backend="tilefuse")(x)
    ref, eager = op(x.double()), op(x)
    assert torch.equal(torch.isnan(out), torch.isnan(eager))
    finite = torch.isfinite(ref)
    assert torch.equal(out[~finite & ~torch.isnan(ref)], eager[~finite & ~torch.isnan(ref)])  # ±inf
    err = ((out.double() - ref) / ref.abs().clamp_min(1e-30))[finite].abs().max().item()
    eager_err = ((eager.double() - ref) / ref.abs().clamp_min(1e-30))[finite].abs().max().item()
    assert err <= max(8 * eager_err, 5e-7), (err, eager_err)


_DOMAINS = {  # op -> inputs over its domain: (low, high) of a uniform draw, then log-spaced magnitudes
    torch.log2: (0, 1e30), torch.log10: (0, 1e30), torch.log1p: (-1, 1e30), torch.expm1: (-80, 80),
    torch.tan: (-1e4, 1e4), torch.asin: (-1, 1), torch.acos: (-1, 1), torch.atan: (-1e6, 1e6),
    torch.sinh: (-80, 80), torch.cosh: (-80, 80), torch.asinh: (-1e30, 1e30), torch.acosh: (1, 1e30),
    torch.atanh: (-1, 1)}


@pytest.mark.parametrize("op", list(_DOMAINS), ids=lambda op: op.__name__)
def test_inverse_hyperbolic_and_log_functions_over_their_domains(op):
    """The functions glibc 2.35 added to libmvec (scalar builtins elsewhere): within eager's
    error against fp64, relative, over uniform and log-spaced arguments, NaN and ±inf."""
    low, high = _DOMAINS[op]
    uniform = torch.rand(2048, dtype=torch.float64) * (min(high, 10.0) - low) + low
    sign = -1 if low < 0 else 1
    spread = torch.logspace(-30, math.log10(max(abs(low), high)), 2048, dtype=torch.float64)
    spread = torch.cat([spread, sign * spread]).clamp(low, high)
    x = torch.cat([uniform, spread, torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64)])
    x = x.float()
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", fallback="error"):
        out = torch.compile(lambda x: op(x * 1.0), backend="tilefuse")(x)
    ref, eager = op(x.double()), op(x)
    assert torch.equal(torch.isnan(out), torch.isnan(eager))
    fin = torch.isfinite(ref) & torch.isfinite(eager)
    assert torch.equal(out[~fin & ~torch.isnan(eager)], eager[~fin & ~torch.isnan(eager)])
    scale = ref.abs().clamp_min(torch.finfo(torch.float32).tiny)
    err = ((out.double() - ref) / scale)[fin].abs().max().item()
    eager_err = ((eager.double() - ref) / scale)[fin].abs().max().item()
    assert err <= max(8 * eager_err, 5e-7), (err, eager_err)
