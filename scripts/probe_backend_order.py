"""Whether a training step's result depends on what was compiled before it in the process.

    PYTHONPATH=src python scripts/probe_backend_order.py [--workload hf_llama_train] [--layers 2]
        [--device cuda] [--dtype bfloat16]

Builds one workload of the models group, then runs its step: the float32 reference, tilefuse,
Inductor, tilefuse again (each after `torch._dynamo.reset()`, same model and inputs), eager;
prints each step's output (the loss and two gradient norms) and whether any parameter or
buffer changed in between. On the H200 (2026-12-04) the second compiled backend of a process
computed a wrong gradient for Hugging Face Llama's embedding — Inductor here, tilefuse when
Inductor ran first (docs/bench/2026-12-04-h200-dkdv/order_probe.txt).
"""
from __future__ import annotations

import argparse

import torch

import tilefuse  # noqa: F401 - registers the backend
from tilefuse.bench.workloads import WORKLOADS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="hf_llama_train")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]
    size = list(w.size("full" if args.device == "cuda" else "quick", args.layers))
    torch.manual_seed(0)
    inputs = w.make_inputs(tuple(size), torch.device(args.device), getattr(torch, args.dtype))
    model = inputs[0]

    def sums() -> list:
        return [float(t.double().sum()) for t in list(model.parameters()) + list(model.buffers())]

    print("ref", w.ref_fn(*inputs).tolist())
    before = sums()
    for label, backend in (("tilefuse", "tilefuse"), ("inductor", "inductor"), ("tilefuse again", "tilefuse")):
        torch._dynamo.reset()
        step = w.program(torch.compile(w.fn, backend=backend))
        print(label, step(*inputs).tolist(), step(*inputs).tolist())
    print("parameters or buffers changed:", [i for i, (a, b) in enumerate(zip(before, sums())) if a != b][:10])
    print("eager", w.program(w.fn)(*inputs).tolist())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
