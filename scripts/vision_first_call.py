"""The first call of one image model of `sweep_vision_models.py` under one backend: compile,
one forward (and, with `train`, one backward) of a batch of 4, timed from `torch.compile`.
Run each in a fresh process with empty caches to time a cold compile:

    TILEFUSE_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=src:scripts \
        python scripts/vision_first_call.py timm:densenet121 tilefuse train
"""
import sys
import time
import warnings

import torch

from sweep_vision_models import SIZES, _create, _prepared


def main():
    name, backend, mode = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "infer"
    warnings.simplefilter("ignore")
    size = SIZES[name]
    torch.manual_seed(0)
    model = _prepared(_create(name, size)).train(mode == "train")
    x = torch.randn(4, 3, size, size)
    if backend == "tilefuse":
        import tilefuse  # noqa: F401 - registers the backend
    start = time.perf_counter()
    out = torch.compile(model, backend=backend)(x)
    if mode == "train":
        out.square().mean().backward()
    print(f"{name} {backend} {mode} first call {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
