"""On a GPU: a new process that loads a stored graph launches its kernels from the binary
records an earlier process wrote (`backends.triton.binaries`), without Triton's JIT — shown by
making Triton's `triton_key` (the hash every JIT compile or cache lookup needs first) raise in
the second process — and computes the same result. Skipped without CUDA."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_PROGRAM = textwrap.dedent("""
    import sys
    import torch
    import tilefuse

    if sys.argv[1] == "warm":
        import triton.runtime.cache as triton_cache

        def refuse():
            raise AssertionError("Triton's JIT was asked for a kernel a record names")
        triton_cache.triton_key = refuse
        triton_cache.triton_key.cache_clear = lambda: None
    from tilefuse.backends.triton import launcher
    launcher.prefetch_triton_key = lambda: None

    def f(x, w, b):
        return torch.softmax(x @ w + b, dim=-1) * 2.0

    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(67, 96, device="cuda", generator=gen)
    w = torch.randn(96, 80, device="cuda", generator=gen)
    b = torch.randn(80, device="cuda", generator=gen)
    out = torch.compile(f, backend="tilefuse")(x, w, b)
    ref = f(x.double(), w.double(), b.double())
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)
    from tilefuse.backends.triton.binaries import binary_cache
    from tilefuse.config import config
    from tilefuse.backends.triton.binaries import launched
    print("records", binary_cache(config.cache_dir).hits, binary_cache(config.cache_dir).misses, launched[0])
""")


def test_a_warm_process_launches_recorded_binaries_without_the_jit(tmp_path):
    env = dict(os.environ, TILEFUSE_CACHE_DIR=str(tmp_path / "tf"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    script = tmp_path / "program.py"
    script.write_text(_PROGRAM)
    cold = subprocess.run([sys.executable, str(script), "cold"], env=env, capture_output=True, text=True, timeout=600)
    assert cold.returncode == 0, cold.stderr[-3000:]
    warm = subprocess.run([sys.executable, str(script), "warm"], env=env, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr[-3000:]
    hits, misses, launched = (int(v) for v in warm.stdout.split("records")[-1].split()[:3])
    assert hits >= 1 and misses == 0 and launched >= hits  # every kernel ran its recorded binary
