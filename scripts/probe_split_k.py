"""Would splitting K help a decode step's products? Hand-written Triton kernels for
`x @ w.T` at one row (gpt-fast's layer at width 2048 and its head), timed as a CUDA graph
replays them (launches back to back, each on another copy of the weight so that L2 holds
none of it), with cuBLAS (`F.linear`) beside them:

    PYTHONPATH=src python scripts/probe_split_k.py [--shapes w2,qkv]

Kernels: `dot` — a 16-row `tl.dot` tile per program over all of K (what tilefuse generates
today); `dot-split S` — S programs per column tile, each over K / S, whose fp32 partial sums
the last program of the tile to arrive adds up (an arrival counter per tile that counts on,
SPLIT a power of two: no second launch, no memset); `partials only` — the same kernel writing
its partial sums and no more (a consumer would add them up); `atomic S` — partial sums added with fp32 atomics
into a zeroed output (needs the zeroing launch; shown for reference, the memset not timed).
Prints µs per product and the weight's bandwidth.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"qkv": (3072, 2048), "out": (2048, 2048), "w13": (5632, 2048), "w2": (2048, 5632), "head": (32000, 2048)}
COPIES = 8  # weights replayed in turn: at least 8 × 8 MB, past the L2
LAUNCHES = 64


@triton.jit
def _row_sum(x_ptr, w_ptr, N, K, k_lo, K_PER, pid_n, BN: tl.constexpr, BK: tl.constexpr):
    """x's one row times columns `pid_n` of `w.T` over K in [k_lo, k_lo + K_PER): a 16-row
    `tl.dot` tile (rows 1..15 masked to zero) summed down to the row."""
    rm = tl.arange(0, 16)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([16, BN], tl.float32)
    for k in range(k_lo, k_lo + K_PER, BK):
        rk = k + tl.arange(0, BK)
        a = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < 1) & (rk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc = tl.dot(a, b, acc)
    return tl.sum(acc, axis=0)


@triton.jit
def _dot_split(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, N, K, K_PER,
               BN: tl.constexpr, BK: tl.constexpr, SPLIT: tl.constexpr, MERGE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    row = _row_sum(x_ptr, w_ptr, N, K, pid_s * K_PER, K_PER, pid_n, BN, BK)
    if SPLIT == 1:
        tl.store(out_ptr + rn, row.to(out_ptr.dtype.element_ty), mask=rn < N)
    else:
        tl.store(part_ptr + pid_s * N + rn, row, mask=rn < N)
    if SPLIT > 1 and MERGE:
        tl.debug_barrier()  # (every warp's partial sums stored before the release)
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        # (counters count on: no reset, SPLIT a power of 2)
        last = (tl.zeros([BN], tl.int32) + arrived % SPLIT) == SPLIT - 1
        total = tl.zeros([BN], tl.float32)
        for s in range(SPLIT):
            total += tl.load(part_ptr + s * N + rn, mask=(rn < N) & last, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=(rn < N) & last)


@triton.jit
def _dot_atomic(x_ptr, w_ptr, out_ptr, N, K, K_PER, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    row = _row_sum(x_ptr, w_ptr, N, K, pid_s * K_PER, K_PER, pid_n, BN, BK)
    tl.atomic_add(out_ptr + rn, row, mask=rn < N, sem="relaxed")


def _runs_right(launch, weight, result, want, label: str) -> bool:
    """One launch into a zeroed `result`, checked against the fp64 product; a schedule that does
    not compile, or computes the wrong product, is reported and left out."""
    result.zero_()
    try:
        launch(weight)
    except Exception as e:  # noqa: BLE001 - a schedule that does not compile is skipped
        print(f"  skip {label}: {type(e).__name__}")
        return False
    err = (result.double() - want).abs().max().item()
    if err > 2e-2:
        print(f"  WRONG {label}: {err:.3g}")
        return False
    return True


def _graph_time(launch, weights) -> float:
    """µs per launch, replayed in a CUDA graph of LAUNCHES launches over the weight copies."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in weights:
            launch(w)  # (compiles and warms up outside the capture)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            launch(weights[i % len(weights)])
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(4):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (4 * LAUNCHES))
    return best


def probe(name: str, n: int, k: int) -> None:
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
    want = F.linear(x.double(), weights[0].double())
    out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
    results = [("cuBLAS", _graph_time(lambda w: F.linear(x, w, out=None), weights))]
    for bn, bk, split, warps, stages in itertools.product((16, 32, 64), (256, 512), (1, 2, 4, 8),
                                                         (4,), (3, 4)):
        k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
        if k_per * (split - 1) >= k:
            continue
        tiles = triton.cdiv(n, bn)
        part = torch.empty(split, n, device="cuda", dtype=torch.float32)
        count = torch.zeros(tiles, device="cuda", dtype=torch.int32)

        def launch(w, bn=bn, bk=bk, split=split, warps=warps, stages=stages, k_per=k_per, part=part,
                   count=count, tiles=tiles):
            _dot_split[(tiles, split)](x, w, out, part, count, n, k, k_per, BN=bn, BK=bk, SPLIT=split,
                                       MERGE=True, num_warps=warps, num_stages=stages)

        def partials(w, bn=bn, bk=bk, split=split, warps=warps, stages=stages, k_per=k_per, part=part,
                     count=count, tiles=tiles):
            _dot_split[(tiles, split)](x, w, out, part, count, n, k, k_per, BN=bn, BK=bk, SPLIT=split,
                                       MERGE=False, num_warps=warps, num_stages=stages)

        label = f"bn{bn} bk{bk} s{split} w{warps} st{stages}"
        if not _runs_right(launch, weights[0], out, want, f"{name} dot-split {label}"):
            continue
        results.append((f"dot-split {label}", _graph_time(launch, weights)))
        if split > 1:
            results.append((f"partials only {label}", _graph_time(partials, weights)))
    for bn, bk, split in itertools.product((32, 64), (256,), (2, 4)):
        k_per = triton.cdiv(triton.cdiv(k, split), bk) * bk
        if k_per * (split - 1) >= k:
            continue
        acc = torch.zeros(1, n, device="cuda", dtype=torch.float32)

        def launch(w, bn=bn, bk=bk, split=split, k_per=k_per, acc=acc):
            _dot_atomic[(triton.cdiv(n, bn), split)](x, w, acc, n, k, k_per, BN=bn, BK=bk, num_warps=4, num_stages=4)

        if _runs_right(launch, weights[0], acc, want, f"{name} atomic bn{bn} bk{bk} s{split}"):
            results.append((f"atomic bn{bn} bk{bk} s{split} (no memset)", _graph_time(launch, weights)))
    weight = n * k * 2
    results.sort(key=lambda r: r[1])
    best_unsplit = min((t for label, t in results if " s1 " in label), default=float("nan"))
    print(f"== {name} ({n} x {k}, {weight / 1e6:.1f} MB): cuBLAS {dict(results)['cuBLAS']:.2f} us, "
          f"best unsplit {best_unsplit:.2f} us")
    for label, t in results[:12]:
        print(f"   {t:7.2f} us  {weight / t / 1e6:5.2f} TB/s  {label}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default=",".join(SHAPES))
    args = p.parse_args()
    print(torch.cuda.get_device_name(), "triton", triton.__version__)
    for name in args.shapes.split(","):
        probe(name, *SHAPES[name])


if __name__ == "__main__":
    main()
