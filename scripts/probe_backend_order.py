"""Whether a training step's gradients depend on what was compiled before it in the process.

    PYTHONPATH=src python scripts/probe_backend_order.py [--workload hf_llama_train] [--layers 2]
        [--sequence inductor,tilefuse] [--empty-cache] [--device cuda] [--dtype bfloat16] [--no-cudnn-sdp]
    PYTHONPATH=src python scripts/probe_backend_order.py --all     # each sequence in its own process

Builds one workload of the models group, takes eager's gradients under autocast, then for each
backend of `--sequence` (after `torch._dynamo.reset()`, same model and inputs) runs the loss and
its backward twice and prints, per call, the loss, the parameters whose gradient is furthest
from eager's (relative max error), and for an embedding the rows that must be zero (tokens
that no input holds) but are not. On the H200 (2026-12-04) the second compiled backend of a
process computed a wrong gradient for Hugging Face Llama's embedding
(docs/bench/2026-12-04-h200-dkdv/order_probe.txt). The cause, found on 2026-12-05 with
`--no-cudnn-sdp` and `scripts/probe_cudnn_sdpa_layouts.py`: PyTorch's cuDNN attention backward
is wrong whenever the output's gradient is laid out unlike the output, whichever compiler
produced it; tilefuse's graphs now lay it out as the output (`frontend/cudnn_attention_grad.py`).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

import tilefuse  # noqa: F401 - registers the backend
from tilefuse.bench.workloads import WORKLOADS

SEQUENCES = ["inductor", "tilefuse", "inductor,tilefuse", "tilefuse,inductor", "inductor,inductor",
             "tilefuse,tilefuse", "aot_eager,inductor"]
EMPTIED = {"inductor,tilefuse", "tilefuse,inductor"}  # also run with the allocator's cache emptied between


def _grads(model) -> dict:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _call(fn, inputs, model) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    dtype = getattr(model, "_bench_autocast", torch.float32)
    with torch.autocast(inputs[2].device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss = fn(*inputs)
    loss.backward()
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


def _report(label: str, loss: float, grads: dict, eager: dict, ids: list) -> None:
    errs = []
    for name, g in eager.items():
        got = grads.get(name)
        if got is None:
            errs.append((float("inf"), name))
            continue
        errs.append((float((got - g).abs().max() / g.abs().max().clamp_min(1e-30)), name))
    errs.sort(reverse=True)
    worst = ", ".join(f"{n} {e:.2e}" for e, n in errs[:4])
    line = f"{label}: loss {loss:.6f}; worst grads: {worst}"
    for name, g in grads.items():
        if g.dim() == 2 and "emb" in name:
            unused = torch.ones(g.shape[0], dtype=torch.bool, device=g.device)
            for t in ids:
                unused[t.flatten()] = False
            bad = int((g[unused].abs().amax(-1) > 0).sum())
            line += f"; {name}: {bad} unused rows nonzero of {int(unused.sum())}"
    print(line, flush=True)


def run_sequence(args) -> None:
    w = WORKLOADS[args.workload]
    size = list(w.size("full" if args.device == "cuda" else "quick", args.layers))
    torch.manual_seed(0)
    inputs = w.make_inputs(tuple(size), torch.device(args.device), getattr(torch, args.dtype))
    model = inputs[0]
    ids = [inputs[2]]  # the token ids the embedding reads
    loss, eager = _call(w.fn, inputs, model)
    _report("eager", loss, eager, eager, ids)
    for backend in args.sequence.split(","):
        torch._dynamo.reset()
        if args.empty_cache and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        fn = torch.compile(w.fn, backend=backend)
        for i in range(2):
            loss, grads = _call(fn, inputs, model)
            _report(f"{backend} call {i}", loss, grads, eager, ids)
    loss, grads = _call(w.fn, inputs, model)
    _report("eager after", loss, grads, eager, ids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="hf_llama_train")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sequence", default="tilefuse,inductor,tilefuse")
    ap.add_argument("--empty-cache", action="store_true", help="empty CUDA's allocator cache between backends")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="turn off cuDNN's attention (SDPA) backend")
    ap.add_argument("--all", action="store_true", help="run each of SEQUENCES in its own process")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if not args.all:
        run_sequence(args)
        return 0
    for seq in SEQUENCES:
        for empty in ((False, True) if seq in EMPTIED else (False,)):
            print(f"## {seq}{' (empty cache between)' if empty else ''}", flush=True)
            cmd = [sys.executable, __file__, "--workload", args.workload, "--layers", str(args.layers),
                   "--sequence", seq, "--device", args.device, "--dtype", args.dtype]
            subprocess.run(cmd + (["--empty-cache"] if empty else []), env=os.environ, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
