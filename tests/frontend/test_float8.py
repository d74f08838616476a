"""Float8 tensors (the inputs of scaled GEMMs) pass between ATen calls: every op on them is an
extern, the real-valued code around them is still generated, results equal eager's."""
import pytest
import torch

import tilefuse
from tilefuse.config import config
from backends_on_cpu import CPU_BACKENDS

F8 = [d for d in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, d)]


def fake_quant(x, scale):
    q = (x / scale).clamp(-400, 400).to(FP8)
    return q.to(torch.float32) * scale + 1.0


@pytest.mark.parametrize("name", F8)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_float8_round_trip_is_extern_and_the_rest_generated(name, backend):
    global FP8
    FP8 = getattr(torch, name)
    x = torch.randn(7, 13) * 3
    scale = torch.tensor(0.05)
    with config.patch(target=backend):
        torch._dynamo.reset()
        report = tilefuse.explain(fake_quant, x, scale)
        assert report.externs and report.kernels, str(report)
        assert all(why == "float8 values run in ATen" for _, _, why in report.externs), report.externs
        torch._dynamo.reset()
        out = torch.compile(fake_quant, backend="tilefuse")(x, scale)
    torch.testing.assert_close(out, fake_quant(x, scale))


def test_float8_inputs_are_accepted():
    def dequant(q, s):
        return q.to(torch.bfloat16) * s

    q = (torch.randn(5, 8) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(8).bfloat16()
    torch._dynamo.reset()
    out = torch.compile(dequant, backend="tilefuse")(q, s)
    torch.testing.assert_close(out, dequant(q, s))
