"""Whether cuDNN's attention backward gives the right gradients when the same shapes come back
in other memory layouts later in a process.

    PYTHONPATH=src python scripts/probe_cudnn_sdpa_layouts.py [--shape 4,16,1024,128] [--causal]

The order-dependent training gradients of `scripts/probe_backend_order.py` (right alone in a
process, wrong when another compiler ran the same model before) come from a graph whose
attention is `aten._scaled_dot_product_cudnn_attention` and its backward, called by each
compiler with its own layouts of q, k, v, the output and its gradient. This calls that
backward through `scaled_dot_product_attention` under `sdpa_kernel(CUDNN_ATTENTION)` with the
same values in several layouts, one after another in one process, and prints each call's
largest gradient error against an fp32 reference next to the error of the call's layout
when it comes first. A layout that is right first and wrong later points at state kept
between calls (a plan cache keyed without the strides), not at any compiler.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# a layout: how q/k/v and dO are laid out in memory, as a permutation of [B, H, S, D]
LAYOUTS = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}


def laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """`t` ([B, H, S, D]) with the same values, stored in `layout`'s order."""
    perm = LAYOUTS[layout]
    inverse = [perm.index(i) for i in range(4)]
    return t.permute(perm).contiguous().permute(inverse)


def grads(q, k, v, do, causal: bool, backend) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(backend):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(do)
    return [t.grad.float() for t in (q, k, v)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,16,1024,128")
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    B, H, S, D = map(int, args.shape.split(","))
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda") for _ in range(4))
    ref = grads(q, k, v, do, args.causal, SDPBackend.MATH)
    scale = max(float(g.abs().max()) for g in ref)
    print(f"shape {args.shape} causal {args.causal}; fp32 reference from the math backend", flush=True)
    combos = list(itertools.product(("bhsd", "bshd"), ("bhsd", "bshd", "sbhd")))
    for qkv_layout, do_layout in combos + combos[:2]:  # (the first layouts again at the end)
        lq, lk, lv, ldo = (laid_out(t.bfloat16(), lay) for t, lay in
                           ((q, qkv_layout), (k, qkv_layout), (v, qkv_layout), (do, do_layout)))
        got = grads(lq, lk, lv, ldo, args.causal, SDPBackend.CUDNN_ATTENTION)
        errs = [float((g - r).abs().max()) / scale for g, r in zip(got, ref)]
        print(f"q/k/v {qkv_layout} dO {do_layout} strides {tuple(ldo.stride())}: "
              f"relative max error dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
