"""The C++ toolchain's flags suit the host: chosen by machine and compiler family (checked
by name, no cross compiler needed), part of the kernel cache key, and a compiler without
OpenMP builds working single-threaded kernels instead of failing."""
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


@pytest.mark.skipif(cpu.find_compiler() is None or sys.platform == "win32", reason="no C++ compiler")
def test_compiler_without_openmp_builds_single_threaded_kernels(tmp_path, monkeypatch):
    """A compiler that refuses -fopenmp (as Apple clang does) still builds every kernel."""
    real = cpu.require_compiler()
    fake = tmp_path / "no-openmp-c++"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "clang version 99 (tilefuse test: no OpenMP)"; exit 0; fi\n'
        'for a in "$@"; do if [ "$a" = "-fopenmp" ]; then '
        "echo \"clang: error: unsupported option '-fopenmp'\" >&2; exit 1; fi; done\n"
        f'exec "{real}" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
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
