"""The Triton helper for `rand(seed, offset)` (`_philox_uniform`) on 2-D and 1-D tiles of
offsets in several layouts — rows, columns, a row stride that is no multiple of four,
scattered offsets, offsets across 2³² — equals `ir.philox`'s reference bit for bit:
interpreted on the CPU, compiled on a GPU when there is one."""
import importlib.util
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from tilefuse.backends.triton import interpreter  # noqa: E402
from tilefuse.backends.triton.helpers import HELPERS  # noqa: E402
from tilefuse.ir import philox  # noqa: E402

R, C = 8, 16

KERNELS = '''

@triton.jit
def rand_tile(seed_ptr, off_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    cols = tl.arange(0, C)[None, :]
    off = tl.load(off_ptr + rows * C + cols)
    tl.store(out_ptr + rows * C + cols, _philox_uniform(tl.load(seed_ptr), off))


@triton.jit
def rand_line(seed_ptr, off_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _philox_uniform(tl.load(seed_ptr), tl.load(off_ptr + i)))
'''


def _module(tmp_path, variant: str):
    path = tmp_path / f"philox_{variant}.py"
    path.write_text("import triton\nimport triton.language as tl\n" + HELPERS[variant] + KERNELS)
    spec = importlib.util.spec_from_file_location(f"philox_{variant}_{id(tmp_path)}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _layouts():
    gen = torch.Generator().manual_seed(4)
    r, c = torch.arange(R)[:, None], torch.arange(C)[None, :]
    return {
        "rows": 4096 + r * C + c,
        "columns": 2 ** 33 + c * R + r,
        "row stride 37": 1 + r * 37 + c,
        "scattered": torch.randint(0, 2 ** 40, (R, C), generator=gen),
        "across 2^32": 2 ** 32 - 8 + r * C + c,
    }


def _devices():
    devices = ["interpreted"]
    if torch.cuda.is_available():
        devices.append("cuda")
    return devices


@pytest.mark.parametrize("device", _devices())
def test_the_helper_equals_the_reference(tmp_path, device):
    module = _module(tmp_path, "philox_interp" if device == "interpreted" else "philox")
    dev = "cpu" if device == "interpreted" else "cuda"
    seed = torch.tensor([0x1234_5678_9ABC_DEF], dtype=torch.int64, device=dev)

    def launch(kernel, *args, **meta):
        if device == "interpreted":
            with interpreter.running():
                interpreter.launchable(kernel)[(1,)](*args, **meta)
        else:
            kernel[(1,)](*args, **meta)

    for name, offsets in _layouts().items():
        off = offsets.to(torch.int64).contiguous().to(dev)
        out = torch.empty(R, C, device=dev)
        launch(module.rand_tile, seed, off, out, R=R, C=C)
        torch.testing.assert_close(out.cpu(), philox.uniform(seed[0].cpu(), off.cpu()), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        line = off.flatten()
        out = torch.empty(R * C, device=dev)
        launch(module.rand_line, seed, line, out, N=R * C)
        torch.testing.assert_close(out.cpu(), philox.uniform(seed[0].cpu(), line.cpu()), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"1-D, {name}: {m}")
