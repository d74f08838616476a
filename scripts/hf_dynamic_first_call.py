"""The first call of a Hugging Face model from `sweep_hf_models.py` compiled with
`dynamic=True`, in this process: inference (no grad) or a training step (forward + backward),
timed, with Dynamo's compile phases. Run each backend in a fresh process with fresh caches:

    C=$(mktemp -d); TORCHINDUCTOR_CACHE_DIR=$C/ind TILEFUSE_CACHE_DIR=$C/tf TILEFUSE_LOGS=compile_time \
      PYTHONPATH=src python scripts/hf_dynamic_first_call.py Swin tilefuse infer
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tilefuse  # noqa: E402,F401  registers the backend
from sweep_hf_models import build, first, inputs_for  # noqa: E402


def main(name: str, backend: str, mode: str) -> None:
    model, _, _ = build(name)
    model.train(mode == "train")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    t = time.perf_counter()
    if mode == "train":
        first(compiled(**inputs_for(name, B=2))).sum().backward()
    else:
        with torch.no_grad():
            compiled(**inputs_for(name, B=2))
    print(f"{name} {backend} {mode} first call {time.perf_counter() - t:.1f} s")
    from torch._dynamo.utils import compile_times

    print(compile_times(repr="str", aggregate=True))


if __name__ == "__main__":
    main(*sys.argv[1:4])
