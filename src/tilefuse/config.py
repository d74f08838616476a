"""The configuration object: every knob is typed, documented, and overridable by an
environment variable `TILEFUSE_<NAME>` (read when the process starts) or by assignment
(`tilefuse.config.backend = "interpret"`) or temporarily with `config.patch(...)`.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tilefuse")


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TILEFUSE_{name.upper()}", default)


@dataclass
class Config:
    #: "auto" (triton for CUDA tensors, cpu otherwise), "triton", "cpu" (C++ kernels), or
    #: "interpret" (the Triton interpreter on CPU tensors: slow, for tests)
    backend: str = "auto"
    #: comma-separated log channels: graph, fusion, tile, code, tune, runtime (or "all")
    logs: str = ""
    #: where compiled kernels are cached (per user, created private)
    cache_dir: str = ""
    #: "0" no measurement (cost-model choice), "1" a few candidates measured (about 10 s per new
    #: kernel, cached), "max" a wide search (about 60 s per new kernel)
    autotune: str = "1"
    #: check every compiled graph against the reference interpreter on first run
    verify: bool = False
    #: on an internal failure: "eager" runs the graph eagerly with a warning, "error" raises
    fallback: str = "eager"
    #: largest reduction extent held whole in one tile (longer rows loop over tiles)
    persistent_reduction_limit: int = 8192
    #: attention kernels' "BLOCK_M,BLOCK_N,warps,stages" (empty: built-in choice); a manual
    #: override until the autotuner chooses it
    flash_config: str = ""
    #: plain matrix products (nothing fused into them): "auto" measures the generated kernel
    #: against ATen's matmul (cuBLAS) when tuning on a GPU, "generated" never uses ATen,
    #: "aten" always does (also on CPU: MKL/OpenBLAS instead of the interpreter)
    matmul: str = "auto"
    #: key ranges per block of query rows in attention kernels (split and merge): 0 chooses
    #: by occupancy (decode), 1 never splits, k > 1 forces k
    flash_split: int = 0
    #: check indices read from tensor data (gather, index_select, embedding, advanced indexing,
    #: scatter) against their bounds in generated kernels: an index out of range raises as in
    #: eager (IndexError / RuntimeError) instead of reading element 0. Triton kernels with
    #: checks are built in Triton's debug mode (device asserts on, overflow sanitiser off)
    index_checks: bool = True
    #: C++ kernels of one graph built at once (compiler processes); 0: one per CPU core
    compile_threads: int = 0

    def __post_init__(self):
        for f in fields(self):
            raw = os.environ.get(f"TILEFUSE_{f.name.upper()}")
            if raw is None:
                continue
            if f.type in ("bool", bool):
                setattr(self, f.name, raw.strip().lower() in ("1", "true", "yes", "on"))
            elif f.type in ("int", int):
                setattr(self, f.name, int(raw))
            else:
                setattr(self, f.name, raw)
        if not self.cache_dir:
            self.cache_dir = _default_cache_dir()
        self.validate()

    def validate(self) -> None:
        if self.backend not in ("auto", "triton", "cpu", "interpret"):
            raise ValueError(f"TILEFUSE_BACKEND must be auto, triton, cpu or interpret, not {self.backend!r}")
        if self.matmul not in ("auto", "generated", "aten"):
            raise ValueError(f"TILEFUSE_MATMUL must be auto, generated or aten, not {self.matmul!r}")
        if self.autotune not in ("0", "1", "max"):
            raise ValueError(f"TILEFUSE_AUTOTUNE must be 0, 1 or max, not {self.autotune!r}")
        if self.compile_threads < 0:
            raise ValueError(f"TILEFUSE_COMPILE_THREADS must be 0 (one per core) or more, not {self.compile_threads}")
        if self.fallback not in ("eager", "error"):
            raise ValueError(f"TILEFUSE_FALLBACK must be eager or error, not {self.fallback!r}")

    def log_channels(self) -> set[str]:
        return {c.strip() for c in self.logs.split(",") if c.strip()}

    @contextlib.contextmanager
    def patch(self, **changes):
        old = {k: getattr(self, k) for k in changes}
        for k, v in changes.items():
            if not hasattr(self, k):
                raise AttributeError(f"tilefuse.config has no knob {k!r}")
            setattr(self, k, v)
        try:
            self.validate()
            yield self
        finally:
            for k, v in old.items():
                setattr(self, k, v)


config = Config()
