"""FlexAttention programs compiled by Inductor (its flex template) and by tilefuse (the op
replaced by its definition, `frontend.flex_attention`), forward and forward + backward, in one
process. The same user code for both: `flex_attention(q, k, v, score_mod=..., block_mask=...)`.

    PYTHONPATH=src python scripts/bench_flex.py [--shape 4,16,4096,128] [--variants causal,alibi,...]
    PYTHONPATH=src python scripts/bench_flex.py --device cpu --shape 2,8,1024,64 --dtype float32

Prints per variant and backend the median time (CUDA events, or the host's clock on a CPU; 20
calls after warm-up; a CPU runs the forward only: eager FlexAttention has no CPU backward), the
dense-equivalent TFLOP/s (4·B·H·L·S·D forward, 2.5× that for forward + backward) and the
largest difference from eager's FlexAttention in fp32 beside eager bf16's own.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import tilefuse  # noqa: F401 - registers the "tilefuse" backend


def variants(B, H, S, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    slopes = torch.exp2(-torch.arange(1, H + 1, dtype=torch.float32) * 8 / H).to(device)
    doc = torch.randint(0, 8, (S,), generator=g).sort().values.to(device)
    return {
        "causal": (None, lambda b, h, i, j: i >= j),
        "alibi": (lambda s, b, h, i, j: s - slopes[h] * (i - j), lambda b, h, i, j: i >= j),
        "softcap": (lambda s, b, h, i, j: 30 * torch.tanh(s / 30), None),
        "window256": (None, lambda b, h, i, j: (i >= j) & (i - j < 256)),
        "document": (None, lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j)),
    }


_DEVICE = ["cuda"]


def _sync():
    if _DEVICE[0] == "cuda":
        torch.cuda.synchronize()


def timed(fn, calls=20):
    for _ in range(3):
        fn()
    if _DEVICE[0] != "cuda":
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _profile(fn, top):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4,16,4096,128")
    ap.add_argument("--variants", default="causal,alibi,softcap,window256,document")
    ap.add_argument("--backends", default="inductor,tilefuse")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="also print the TOP GPU kernels of one forward + backward per backend")
    args = ap.parse_args()
    B, H, S, D = (int(x) for x in args.shape.split(","))
    device = _DEVICE[0] = args.device
    dtype = getattr(torch, args.dtype)
    backward = not args.no_backward and device != "cpu"
    table = variants(B, H, S, device)
    name_of = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# {name_of}  torch {torch.__version__}  shape B={B} H={H} S={S} D={D} {args.dtype}")
    for name in args.variants.split(","):
        score_mod, mask_mod = table[name]
        block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=S, KV_LEN=S, device=device) \
            if mask_mod is not None else None

        def program(q, k, v):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

        g = torch.Generator(device=device).manual_seed(1)
        q, k, v = (torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g) for _ in range(3))
        do = torch.randn(B, H, S, D, device=device, dtype=dtype, generator=g)
        # The fp32 reference runs through Inductor's template: eager flex materialises S² scores.
        q32, k32, v32 = (t.float().requires_grad_(backward) for t in (q, k, v))
        ref = torch.compile(program)(q32, k32, v32)
        if backward:
            ref.backward(do.float())
            ref_grads = [t.grad for t in (q32, k32, v32)]
        ref = ref.detach()
        flops = 4 * B * H * S * S * D
        for backend in args.backends.split(","):
            torch._dynamo.reset()
            compiled = torch.compile(program, backend=backend)
            start = time.perf_counter()
            out = compiled(q, k, v)
            _sync()
            first = time.perf_counter() - start
            err = (out.float() - ref).abs().max().item()
            fwd = timed(lambda: compiled(q, k, v))
            line = (f"{name:10s} {backend:9s} fwd {fwd:7.3f} ms {flops / fwd / 1e9:7.1f} TFLOP/s  "
                    f"err {err:.1e}  first {first:.1f} s")
            if backward:
                torch._dynamo.reset()
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                trained = torch.compile(program, backend=backend)
                start = time.perf_counter()
                trained(qg, kg, vg).backward(do)
                _sync()
                first_train = time.perf_counter() - start

                def step():
                    trained(qg, kg, vg).backward(do)

                both = timed(step)
                for t in (qg, kg, vg):
                    t.grad = None
                step()
                grad_err = max(((t.grad.float() - r).abs().max() / r.abs().max()).item()
                               for t, r in zip((qg, kg, vg), ref_grads))
                line += (f"  | fwd+bwd {both:7.3f} ms {2.5 * flops / both / 1e9:7.1f} TFLOP/s  "
                         f"grad err {grad_err:.1e} (rel. to max)  first {first_train:.1f} s")
                if args.profile:
                    _profile(step, args.profile)
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
