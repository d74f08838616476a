"""Which Hopper GEMM paths pay off with this Triton? Hand-written probes of the three load and
scheduling styles the contraction lowering could emit — pointer loads with grouped ordering
(what it emits today), tensor descriptors (TMA) per tile, and TMA in a persistent kernel —
for a plain bf16 GEMM and one with a bias + GELU epilogue, next to cuBLAS.

    PYTHONPATH=src python scripts/probe_gemm_paths.py --out DIR
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _epilogue(acc, bias_ptr, rn, N, EPI: tl.constexpr):
    if EPI:
        out = acc.to(tl.bfloat16).to(tl.float32) + tl.load(bias_ptr + rn, rn < N, other=0).to(tl.float32)[None, :]
        out = 0.5 * out * (1.0 + tl.erf(out * 0.7071067811865476))
        return out.to(tl.bfloat16)
    return acc.to(tl.bfloat16)


@triton.jit
def _tile_of(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@triton.jit
def gemm_pointers(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, GROUP_M: tl.constexpr, EPI: tl.constexpr):
    pm, pn = _tile_of(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], _epilogue(acc, bias_ptr, rn, N, EPI))


@triton.jit
def gemm_persistent_pointers(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, GROUP_M: tl.constexpr, EPI: tl.constexpr,
                             NUM_SMS: tl.constexpr, STAGES: tl.constexpr):
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
        pm, pn = _tile_of(tile, M, N, BM, BN, GROUP_M)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros([BM, BN], tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
            b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
            acc = tl.dot(a, b, acc)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], _epilogue(acc, bias_ptr, rn, N, EPI))


@triton.jit
def gemm_tma(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GROUP_M: tl.constexpr, EPI: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    pm, pn = _tile_of(tl.program_id(0), M, N, BM, BN, GROUP_M)
    acc = tl.zeros([BM, BN], tl.float32)
    for k in range(0, K, BK):
        acc = tl.dot(a_desc.load([pm * BM, k]), b_desc.load([k, pn * BN]), acc)
    rn = pn * BN + tl.arange(0, BN)
    c_desc.store([pm * BM, pn * BN], _epilogue(acc, bias_ptr, rn, N, EPI))


@triton.jit
def gemm_tma_persistent(a_ptr, b_ptr, c_ptr, bias_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr, EPI: tl.constexpr,
                        NUM_SMS: tl.constexpr, STAGES: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BK, BN])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=True):
        pm, pn = _tile_of(tile, M, N, BM, BN, GROUP_M)
        acc = tl.zeros([BM, BN], tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            acc = tl.dot(a_desc.load([pm * BM, k]), b_desc.load([k, pn * BN]), acc)
        rn = pn * BN + tl.arange(0, BN)
        c_desc.store([pm * BM, pn * BN], _epilogue(acc, bias_ptr, rn, N, EPI))


def _alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    triton.set_allocator(_alloc)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    configs = [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (128, 256, 64, 8, 2)]
    for (m, n, k, epi) in [(4096, 4096, 4096, 0), (8192, 4096, 4096, 1)]:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        ref = F.gelu(a @ b + bias) if epi else a @ b
        flops = 2 * m * n * k
        peers = {"cuBLAS (eager)": (lambda: F.gelu(torch.addmm(bias, a, b))) if epi else (lambda: a @ b)}
        if epi:
            peers["cuBLAS mm, then bias+gelu"] = lambda: F.gelu(a @ b + bias)
        for name, fn in peers.items():
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            rows.append(dict(shape=[m, n, k], epi=epi, path=name, ms=ms, tflops=flops / ms / 1e9))
            print(json.dumps(rows[-1]), flush=True)
        for (bm, bn, bk, warps, stages) in configs:
            c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            common = dict(BM=bm, BN=bn, BK=bk, GROUP_M=8, EPI=epi, num_warps=warps)
            paths = {
                "pointers": lambda: gemm_pointers[(tiles,)](a, b, c, bias, m, n, k, num_stages=stages, **common),
                "tma": lambda: gemm_tma[(tiles,)](a, b, c, bias, m, n, k, num_stages=stages, **common),
                "persistent pointers": lambda: gemm_persistent_pointers[(min(sms, tiles),)](
                    a, b, c, bias, m, n, k, NUM_SMS=sms, STAGES=stages, **common),
                "tma persistent": lambda: gemm_tma_persistent[(min(sms, tiles),)](
                    a, b, c, bias, m, n, k, NUM_SMS=sms, STAGES=stages, **common),
            }
            for path, fn in paths.items():
                row = dict(shape=[m, n, k], epi=epi, path=path, config=[bm, bn, bk, warps, stages])
                try:
                    fn()
                    torch.cuda.synchronize()
                    row["max_err"] = (c.float() - ref.float()).abs().max().item()
                    row["ms"] = triton.testing.do_bench(fn, warmup=50, rep=300)
                    row["tflops"] = flops / row["ms"] / 1e9
                except Exception as e:  # a path this Triton cannot compile is a finding, not a crash
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(f"{args.out}/gemm_paths.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
