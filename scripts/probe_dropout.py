"""Counter-based dropout on the GPU: the generated kernels reproduce `ir.philox` bit for bit,
and attention with dropout on its probabilities trains through one flash forward and the
derived backward (the mask regenerated from a saved seed), against SDPA's FlashAttention-2
with dropout and against eager's unfused chain, in one process.

    PYTHONPATH=src python scripts/probe_dropout.py [--shape 8,12,1024,64] [--p 0.1]

Prints: the bit check; the CUDA-graph replay check; the gradient check at a small size (tilefuse against eager with the
same mask, both against fp64); µs per forward+backward of causal attention from a `tril`
buffer with dropout for eager, tilefuse (with and without dropout) and SDPA `is_causal`
with `dropout_p`.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

import tilefuse  # noqa: F401 - registers the backend
from probe_attention_backward import timed  # (this directory is on the path when run as a script)
from tilefuse.frontend.lowerings.random import draw_seeds
from tilefuse.ir import philox


def bit_check(device) -> str:
    fn = torch.compile(lambda x: torch.rand_like(x) + x, backend="tilefuse")
    x = torch.zeros(1031, 517, device=device)
    fn(x)
    torch.manual_seed(3)
    (seed,) = draw_seeds(1, torch.device(device))
    torch.manual_seed(3)
    got = fn(x).cpu()
    want = philox.uniform_like(seed.cpu(), x.shape)
    return f"rand_like bits equal to ir.philox: {torch.equal(got, want)} (max diff {(got - want).abs().max().item():.3g})"


class Attention(torch.nn.Module):
    def __init__(self, t, p):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(t, t)).view(1, 1, t, t))
        self.p = p

    def forward(self, q, k, v):
        t = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), self.p, training=True)
        return att @ v


def fwd_bwd(fn, q, k, v, do):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(do)


def grad_check(device, p) -> str:
    torch.manual_seed(0)
    b, h, t, d = 2, 3, 77, 32
    q, k, v = (torch.randn(b, h, t, d, device=device, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, t, d, device=device)
    model = Attention(t, p).to(device)
    compiled = torch.compile(model, backend="tilefuse")
    fwd_bwd(compiled, q, k, v, do)
    torch.manual_seed(9)
    (seed,) = draw_seeds(1, torch.device(device))
    torch.manual_seed(9)
    fwd_bwd(compiled, q, k, v, do)
    got = [x.grad.clone() for x in (q, k, v)]

    def same_mask(q, k, v):
        tt = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(model.bias[:, :, :tt, :tt] == 0, float("-inf"))
        keep = torch.ops.tilefuse.philox_uniform(seed, list(att.shape)) >= p
        return (F.softmax(att, -1) * keep.to(att.dtype) / (1 - p)) @ v

    errs = []
    ref = None
    for dtype in (torch.float64, torch.float32):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        same_mask(*xs).backward(do.to(dtype))
        grads = [x.grad for x in xs]
        if ref is None:
            ref = grads
        else:
            errs = [((g.double() - r).abs().max().item(), (e.double() - r).abs().max().item())
                    for g, e, r in zip(got, grads, ref)]
    return "gradients vs fp64 (tilefuse, eager fp32): " + ", ".join(f"{n} {a:.2e} / {b:.2e}" for n, (a, b) in zip("qkv", errs))


def cuda_graph_check(device) -> str:
    """Under CUDA graphs (`mode="reduce-overhead"`) each replay draws fresh seeds, and
    `torch.manual_seed` repeats a replay's masks."""
    fn = torch.compile(lambda x: F.dropout(x, 0.5, training=True), backend="tilefuse", mode="reduce-overhead")
    x = torch.rand(4096, 256, device=device) + 1
    for _ in range(3):
        fn(x)
    a, b = fn(x) != 0, fn(x) != 0
    torch.manual_seed(11)
    c = fn(x) != 0
    torch.manual_seed(11)
    d = fn(x) != 0
    return (f"CUDA graphs: replays draw new masks {not torch.equal(a, b)}, manual_seed repeats a replay's "
            f"mask {torch.equal(c, d)}, kept {a.float().mean().item():.4f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8,12,1024,64")
    ap.add_argument("--p", type=float, default=0.1)
    args = ap.parse_args()
    device = "cuda"
    print(bit_check(device))
    print(cuda_graph_check(device))
    print(grad_check(device, args.p))
    b, h, t, d = (int(x) for x in args.shape.split(","))
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(b, h, t, d, device=device, dtype=torch.bfloat16)
    flops = 2.5 * 4 * b * h * t * t * d / 2  # causal: half the tiles; backward 2.5× the forward
    rows = []
    for name, p in (("eager (unfused, dropout)", args.p), ("tilefuse (dropout)", args.p), ("tilefuse (no dropout)", 0.0)):
        model = Attention(t, p).to(device)
        fn = model if name.startswith("eager") else torch.compile(model, backend="tilefuse")
        torch._dynamo.reset()
        rows.append((name, timed(fwd_bwd, fn, q, k, v, do)))
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=args.p)  # noqa: E731
    rows.append(("SDPA is_causal dropout_p (FlashAttention-2)", timed(fwd_bwd, sdpa, q, k, v, do)))
    for name, us in rows:
        print(f"{name:45s} {us:9.1f} µs  {flops / us / 1e6:7.1f} TFLOP/s (fwd+bwd, causal half)")


if __name__ == "__main__":
    main()
