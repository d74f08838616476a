"""Complex values are carried between ATen calls (every op that reads or makes one is an
extern), so a graph with complex intermediates compiles; its real parts are still fused."""
import torch

import tilefuse


def _program(x, y):
    z = torch.complex(x, y)
    w = z * z + 1j
    return torch.view_as_real(w).pow(2).sum(-1), w.abs(), torch.fft.fft(x, dim=-1).real * 2


def test_complex_intermediates_run_in_aten_and_real_parts_are_generated():
    torch.manual_seed(0)
    x, y = torch.randn(5, 33), torch.randn(5, 33)
    torch._dynamo.reset()
    out = torch.compile(_program, backend="tilefuse", fullgraph=True)(x, y)
    ref = _program(x.double(), y.double())
    eager = _program(x, y)
    for o, r, e in zip(out, ref, eager):
        assert o.dtype == e.dtype
        assert (o.double() - r).abs().max() <= 3 * (e.double() - r).abs().max() + 1e-5
    torch._dynamo.reset()
    rep = tilefuse.explain(_program, x, y)
    assert rep.kernels  # the real-valued tail is generated
    reasons = {reason for _, _, reason in rep.externs}
    assert "complex values run in ATen" in reasons


def test_complex_graph_inputs_and_outputs_pass_through():
    torch.manual_seed(1)
    z = torch.randn(4, 9, dtype=torch.complex64)
    fn = lambda z: (z * z.conj()).real + z.abs()  # noqa: E731
    torch._dynamo.reset()
    out = torch.compile(fn, backend="tilefuse", fullgraph=True)(z)
    torch.testing.assert_close(out, fn(z))
