"""Cold and warm compile latency, each in a fresh process.

`compile_latency(workload, backend, size, dtype, device)` makes empty cache directories
(tilefuse's TILEFUSE_CACHE_DIR, TorchInductor's TORCHINDUCTOR_CACHE_DIR, Triton's
TRITON_CACHE_DIR, JAX's persistent compilation cache), runs the workload's first call in a
new Python process with them (cold: nothing cached on disk, nothing in memory), then again in
a second new process with the same directories (warm: a cache hit). Each child reports the
first call's wall time, the compiles Dynamo (or jit) did, and Inductor's FX-graph cache
hits; the parent adds the bytes the cold run wrote (the artifact size of the compiled
result) and the bytes the warm run added (0 when everything came from the cache).

The child is `python -m tilefuse.bench.coldstart '<json spec>'`; it prints one line
`TILEFUSE_BENCH_RESULT {json}`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "TILEFUSE_BENCH_RESULT "
_SRC = str(Path(__file__).resolve().parents[2])  # the directory holding the package


def cache_env(root: str | os.PathLike) -> dict[str, str]:
    """Environment variables that point every compiler's on-disk cache under `root`. A root
    tilefuse refuses as a cache (another user's, or writable by others) is refused here too:
    the other compilers' caches (Triton's binaries among them) would be just as open."""
    from ..cache.admin import root_problem

    root = Path(root)
    problem = root_problem(root)
    if problem is not None:
        raise ValueError(f"{root} cannot hold compiler caches: {problem}")
    return {
        "TILEFUSE_CACHE_DIR": str(root / "tilefuse"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
        "JAX_COMPILATION_CACHE_DIR": str(root / "jax"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def _run_child(spec: dict, env: dict, timeout: float) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tilefuse.bench.coldstart", json.dumps(spec)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            out = json.loads(line[len(MARK):])
            out["process_s"] = wall
            return out
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"child process exited {proc.returncode}: {tail[:200]}", "process_s": wall}


def compile_latency(workload: str, backend: str, size, dtype: str, device: str,
                    timeout: float = 600.0, keep_dir: str | None = None) -> dict:
    """{"cold": child result, "warm": child result, "artifact_bytes", "artifact_files",
    "warm_new_bytes", "warm_new_files"}; a child's result has "first_call_s", "compiles",
    "import_s" and "process_s", or "error". `keep_dir`: use (and keep) this directory
    instead of a temporary one."""
    from .metrics import tree_snapshot

    root = Path(keep_dir) if keep_dir else Path(tempfile.mkdtemp(prefix="tilefuse-bench-"))
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in ("tilefuse", "inductor", "triton", "jax"):
            path = root / sub
            if path.exists() and any(path.iterdir()):
                raise ValueError(f"cache directory {path} is not empty: not a cold start")
        env = dict(os.environ)
        env.update(cache_env(root))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, env.get("PYTHONPATH")) if p)
        spec = {"workload": workload, "backend": backend, "size": list(size), "dtype": dtype,
                "device": device}
        cold = _run_child(spec, env, timeout)
        after_cold = tree_snapshot(root)
        warm = _run_child(spec, env, timeout) if "error" not in cold else {"error": "cold failed"}
        after_warm = tree_snapshot(root)
        new = {k: v for k, v in after_warm.items() if after_cold.get(k) != v}
        return {"cold": cold, "warm": warm, "artifact_files": len(after_cold),
                "artifact_bytes": sum(after_cold.values()), "warm_new_files": len(new),
                "warm_new_bytes": sum(new.values())}
    finally:
        if not keep_dir:
            shutil.rmtree(root, ignore_errors=True)


def _child(spec: dict) -> dict:
    t0 = time.perf_counter()
    import torch

    from . import backends, timing
    from .workload_base import DTYPES
    from .workloads import WORKLOADS

    try:
        import tilefuse  # noqa: F401  registers the Dynamo backend
    except Exception:
        pass
    import_s = time.perf_counter() - t0
    w = WORKLOADS[spec["workload"]]
    torch.manual_seed(0)
    inputs = w.make_inputs(tuple(spec["size"]), torch.device(spec["device"]),
                           DTYPES[spec["dtype"]])
    try:
        prepared = backends.prepare(spec["backend"], w, inputs, spec["device"])
        before = prepared.compiles() if prepared.compiles else 0
        t = time.perf_counter()
        with prepared.first_call():
            prepared.call(*prepared.args)
            timing.synchronize(spec["device"])
        first = time.perf_counter() - t
    except Exception as e:
        return {"error": backends.describe(e), "import_s": import_s}
    from torch._dynamo.utils import counters

    loaded = None
    if spec["backend"] in backends.TILEFUSE_MODES:  # graphs loaded from tilefuse's graph cache, of those compiled
        import tilefuse

        reports = tilefuse.last_compilations().reports
        loaded = f"{sum(1 for r in reports if r.cached)}/{len(reports)}"
    return {"first_call_s": first, "import_s": import_s, "graphs_loaded": loaded,
            "compiles": (prepared.compiles() - before) if prepared.compiles else None,
            "fxgraph_cache_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
            "fxgraph_cache_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
            **{k: v for k, v in prepared.info.items() if k in ("kernels", "externs")}}


if __name__ == "__main__":
    print(MARK + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
