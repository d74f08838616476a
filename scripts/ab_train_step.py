"""A small training step's forward and backward (no optimizer), backends alternating call by
call in one process: the per-call host work that the whole step's optimizer would dilute.

    PYTHONPATH=src:tests python scripts/ab_train_step.py [inductor,tilefuse] [B,T,layers,width]

nanoGPT at the benchmark's quick size by default; prints each backend's median call time and
the first backend's time over the last's. Run with a fresh `TILEFUSE_CACHE_DIR` for a cold
process (AOTAutograd traces the graphs), with the same one again for a warm one.
"""
import sys
import time

import torch

import tilefuse  # noqa: F401 - registers the backend
from tilefuse.bench.zoo import _LM_QUICK, _nanogpt_train_inputs, nanogpt_loss


def main() -> None:
    backends = sys.argv[1].split(",") if len(sys.argv) > 1 else ["inductor", "tilefuse"]
    size = tuple(int(x) for x in sys.argv[2].split(",")) if len(sys.argv) > 2 else _LM_QUICK
    torch.manual_seed(0)
    model, opt, idx, targets = _nanogpt_train_inputs(size, "cpu", torch.float32)
    steps = {}
    for backend in backends:
        torch._dynamo.reset()
        compiled = torch.compile(nanogpt_loss, backend=backend)

        def step(compiled=compiled):
            compiled(model, opt, idx, targets).backward()
            for p in model.parameters():
                p.grad = None

        for _ in range(3):
            step()
        steps[backend] = step
    for step in steps.values():  # (again: a later compile's Dynamo reset made the earlier ones compile again)
        for _ in range(3):
            step()
    times = {b: [] for b in backends}
    for _ in range(200):
        for backend, step in steps.items():
            start = time.perf_counter()
            step()
            times[backend].append(time.perf_counter() - start)
    medians = {b: sorted(ts)[len(ts) // 2] * 1e3 for b, ts in times.items()}
    print(size, {b: round(m, 3) for b, m in medians.items()},
          "ratio", round(medians[backends[0]] / medians[backends[-1]], 3))


if __name__ == "__main__":
    main()
