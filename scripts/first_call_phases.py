"""A benchmark workload's first call in this process, timed, with Dynamo's own compile phases
(tracing, AOTAutograd's metadata and joint graph, the backend) and, for tilefuse, the compile
workers' counts. Run it twice with the same cache directories for a cold and a warm start:

    C=$(mktemp -d); for phase in cold warm; do
      TILEFUSE_LOGS=compile_time TORCHINDUCTOR_CACHE_DIR=$C/ind TRITON_CACHE_DIR=$C/triton \
      TILEFUSE_CACHE_DIR=$C/tf PYTHONPATH=src python scripts/first_call_phases.py nanogpt tilefuse cuda
    done

Arguments: workload, backend (as in `tilefuse bench`), device; models run at 2 layers, full
sizes on a GPU (bf16), quick sizes on a CPU (fp32).
"""
import sys
import time

t0 = time.perf_counter()
import torch  # noqa: E402

import tilefuse  # noqa: E402,F401  registers the backend
from tilefuse.bench import backends, timing  # noqa: E402
from tilefuse.bench.workloads import WORKLOADS  # noqa: E402


def main(workload: str, backend: str, device: str) -> None:
    w = WORKLOADS[workload]
    size = list(w.sizes["full" if device == "cuda" else "quick"])
    if w.group == "models":
        size[2] = 2
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    inputs = w.make_inputs(tuple(size), torch.device(device), dtype)
    prepared = backends.prepare(backend, w, inputs, device)
    t = time.perf_counter()
    with prepared.first_call():
        prepared.call(*prepared.args)
        timing.synchronize(device)
    print(f"== {workload} {backend} first call {time.perf_counter() - t:.2f} s (set-up {t - t0:.2f} s)")
    from torch._dynamo.utils import compile_times

    print(compile_times(repr="str", aggregate=True))
    if backend == "tilefuse":
        from tilefuse.backends.triton import compile_pool

        print("compile workers:", compile_pool.stats())


if __name__ == "__main__":
    main(*sys.argv[1:4])
