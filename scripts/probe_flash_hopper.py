"""What the flash forward's inner loop costs on a Hopper GPU, part by part (issue #18's schedule
study).

    PYTHONPATH=src python scripts/probe_flash_hopper.py [--out DIR] [--shapes 4,32,4096,128;8,16,4096,64]

Times, at each shape (bf16, plain attention), in one process:
  * SDPA's cuDNN and FlashAttention-2 kernels (the peers);
  * tilefuse on the naive program with its own tuning, and with fixed tile configurations;
  * a minimal online-softmax kernel, and the same with each program's rows as two halves;
  * that minimal kernel written here, switched part by part to what tilefuse's
    derived kernel also computes: a NaN-propagating row max (`nan_check`), the accumulator's
    re-basing as a select per element rather than a product (`acc_select`); and the Hopper
    paths tilefuse does not take today: tensor-descriptor (TMA) loads of K and V, warp
    specialisation of the key loop.
Each variant is checked against SDPA before it is timed. Writes flash_hopper.json into DIR.
"""
from __future__ import annotations

import argparse
import json
import math
import traceback

import torch
import triton
import triton.language as tl

from tilefuse.bench.timing import measure


@triton.jit
def _online_softmax_fwd(Q, K, V, O, qk_scale, N_CTX: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, NAN_CHECK: tl.constexpr, ACC_SELECT: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * N_CTX * D
    rows = pid * BM + tl.arange(0, BM)
    keys = tl.arange(0, BN)
    dims = tl.arange(0, D)
    q = tl.load(Q + base + rows[:, None] * D + dims[None, :])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, N_CTX, BN, warp_specialize=WS):
        kt = tl.load(K + base + (start + keys)[None, :] * D + dims[:, None])
        s = tl.dot(q, kt)
        if NAN_CHECK:
            top = tl.where(tl.max((s != s).to(tl.int32), 1) > 0, float("nan"), tl.max(s, 1))
            m_new = tl.maximum(m_i, top * qk_scale, propagate_nan=tl.PropagateNan.ALL)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.where(m_i == m_new, 1.0, tl.exp2(m_i - m_new))
        l_i = l_i * alpha + tl.sum(p, 1)
        if ACC_SELECT:
            acc = tl.where((alpha == 0.0)[:, None], 0.0, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None]
        v = tl.load(V + base + (start + keys)[:, None] * D + dims[None, :])
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new
    tl.store(O + base + rows[:, None] * D + dims[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


@triton.jit
def _online_softmax_fwd_tma(desc_q, desc_k, desc_v, desc_o, qk_scale, N_CTX: tl.constexpr, D: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    row0 = tl.program_id(1) * N_CTX
    q = desc_q.load([row0 + pid * BM, 0])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, N_CTX, BN, warp_specialize=WS):
        k = desc_k.load([row0 + start, 0])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.where(m_i == m_new, 1.0, tl.exp2(m_i - m_new))
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = desc_v.load([row0 + start, 0])
        acc = tl.dot(p.to(tl.bfloat16), v, acc)
        m_i = m_new
    desc_o.store([row0 + pid * BM, 0], (acc / l_i[:, None]).to(tl.bfloat16))


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _online_softmax_fwd_halves(Q, K, V, O, qk_scale, N_CTX: tl.constexpr, D: tl.constexpr, BM: tl.constexpr,
                               BN: tl.constexpr, NAN_CHECK: tl.constexpr, ACC_SELECT: tl.constexpr):
    """BM rows as two independent halves sharing each K/V tile: one half's softmax can run
    while the other's products are in flight (FlashAttention-3's overlap, left to the
    compiler's scheduling of asynchronous products)."""
    HALF: tl.constexpr = BM // 2
    pid = tl.program_id(0)
    base = tl.program_id(1).to(tl.int64) * N_CTX * D
    rows_a = pid * BM + tl.arange(0, HALF)
    rows_b = rows_a + HALF
    keys = tl.arange(0, BN)
    dims = tl.arange(0, D)
    qa = tl.load(Q + base + rows_a[:, None] * D + dims[None, :])
    qb = tl.load(Q + base + rows_b[:, None] * D + dims[None, :])
    m_a = tl.full([HALF], float("-inf"), tl.float32)
    m_b = tl.full([HALF], float("-inf"), tl.float32)
    l_a = tl.zeros([HALF], tl.float32)
    l_b = tl.zeros([HALF], tl.float32)
    acc_a = tl.zeros([HALF, D], tl.float32)
    acc_b = tl.zeros([HALF, D], tl.float32)
    for start in range(0, N_CTX, BN):
        kt = tl.load(K + base + (start + keys)[None, :] * D + dims[:, None])
        sa = tl.dot(qa, kt)
        sb = tl.dot(qb, kt)
        if NAN_CHECK:
            new_a = tl.maximum(m_a, tl.reduce(sa, 1, _nan_max) * qk_scale, propagate_nan=tl.PropagateNan.ALL)
            new_b = tl.maximum(m_b, tl.reduce(sb, 1, _nan_max) * qk_scale, propagate_nan=tl.PropagateNan.ALL)
        else:
            new_a = tl.maximum(m_a, tl.max(sa, 1) * qk_scale)
            new_b = tl.maximum(m_b, tl.max(sb, 1) * qk_scale)
        pa = tl.exp2(sa * qk_scale - new_a[:, None])
        alpha_a = tl.where(m_a == new_a, 1.0, tl.exp2(m_a - new_a))
        l_a = l_a * alpha_a + tl.sum(pa, 1)
        pb = tl.exp2(sb * qk_scale - new_b[:, None])
        alpha_b = tl.where(m_b == new_b, 1.0, tl.exp2(m_b - new_b))
        l_b = l_b * alpha_b + tl.sum(pb, 1)
        v = tl.load(V + base + (start + keys)[:, None] * D + dims[None, :])
        if ACC_SELECT:
            acc_a = tl.where((alpha_a == 0.0)[:, None], 0.0, acc_a * alpha_a[:, None])
            acc_b = tl.where((alpha_b == 0.0)[:, None], 0.0, acc_b * alpha_b[:, None])
        else:
            acc_a = acc_a * alpha_a[:, None]
            acc_b = acc_b * alpha_b[:, None]
        acc_a = tl.dot(pa.to(tl.bfloat16), v, acc_a)
        acc_b = tl.dot(pb.to(tl.bfloat16), v, acc_b)
        m_a = new_a
        m_b = new_b
    tl.store(O + base + rows_a[:, None] * D + dims[None, :], (acc_a / l_a[:, None]).to(tl.bfloat16))
    tl.store(O + base + rows_b[:, None] * D + dims[None, :], (acc_b / l_b[:, None]).to(tl.bfloat16))


def _run_variant(kind, q, k, v, o, cfg, nan_check=False, acc_select=False, ws=False):  # noqa: PLR0913
    b, h, n, d = q.shape
    bm, bn, warps, stages = cfg
    scale = 1.4426950408889634 / math.sqrt(d)
    grid = (n // bm, b * h)
    if kind == "halves":
        def call():
            _online_softmax_fwd_halves[grid](q, k, v, o, scale, n, d, bm, bn, nan_check, acc_select,
                                             num_warps=warps, num_stages=stages)
        return call
    if kind == "pointers":
        def call():
            _online_softmax_fwd[grid](q, k, v, o, scale, n, d, bm, bn, nan_check, acc_select, ws,
                                      num_warps=warps, num_stages=stages)
        return call
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = [t.view(b * h * n, d) for t in (q, k, v, o)]
    dq = TensorDescriptor.from_tensor(flat[0], [bm, d])
    dk = TensorDescriptor.from_tensor(flat[1], [bn, d])
    dv = TensorDescriptor.from_tensor(flat[2], [bn, d])
    do = TensorDescriptor.from_tensor(flat[3], [bm, d])

    def call():
        _online_softmax_fwd_tma[grid](dq, dk, dv, do, scale, n, d, bm, bn, ws, num_warps=warps, num_stages=stages)
    return call


_REPORTED: set = set()


def _registers_of_launched_kernels() -> list:
    """(kernel, registers per thread, spilled registers) of the kernels tilefuse launched
    directly since the last call."""
    import gc

    from tilefuse.backends.triton.direct_launch import DirectLaunch

    found = []
    for obj in gc.get_objects():
        if type(obj) is DirectLaunch:  # (type(): a dead weak proxy among the objects raises on isinstance)
            for compiled, _tail, _launcher in list(obj._compiled.values()):
                if id(compiled) in _REPORTED:
                    continue
                _REPORTED.add(id(compiled))
                compiled._init_handles()
                found.append((compiled.name, compiled.n_regs, compiled.n_spills))
    return sorted(set(found))


def _naive_plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v


def _naive_causal(q, k, v):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    i = torch.arange(s.shape[-2], device=q.device)[:, None]
    j = torch.arange(s.shape[-1], device=q.device)[None, :]
    return torch.softmax(torch.where(j > i, float("-inf"), s), dim=-1) @ v


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    p.add_argument("--shapes", default="4,32,4096,128;8,16,4096,64")
    p.add_argument("--budget", type=float, default=0.3)
    p.add_argument("--skip-tilefuse", action="store_true")
    p.add_argument("--only-halves", action="store_true", help="the halved kernels and tilefuse only")
    p.add_argument("--causal", action="store_true",
                   help="causal attention (index formula): SDPA and tilefuse only, TFLOP/s of the live half")
    p.add_argument("--no-handwritten", action="store_true", help="the peers and tilefuse only")
    p.add_argument("--tilefuse-configs", default=";128,64,8,3;128,128,8,2;128,64,4,3;64,64,4,3",
                   help="flash_config values (empty: tuned), ';'-separated")
    args = p.parse_args()
    rows = []

    def record(row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    for spec in args.shapes.split(";"):
        b, h, n, d = (int(x) for x in spec.split(","))
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * n * n * d // (2 if args.causal else 1)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

        def timed(name, fn, **extra):
            row = {"shape": [b, h, n, d], "variant": name, **extra}
            try:
                out = fn()
                err = (out.float() - ref.float()).abs().max().item() if out is not None else None
                ms = measure(lambda *_: fn(), (), "cuda", budget_s=args.budget)["p50_ms"]
                row.update(ms=ms, tflops=flops / ms / 1e9, max_err=err)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                traceback.print_exc()
            record(row)

        from torch.nn.attention import SDPBackend, sdpa_kernel

        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            def sdpa(backend=backend):
                with sdpa_kernel([backend]):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
            timed(f"sdpa_{backend.name.lower()}", sdpa)

        o = torch.empty_like(q)
        for cfg in [] if args.causal or args.no_handwritten else [(256, 64, 8, 3), (256, 64, 8, 2), (256, 128, 8, 2), (128, 64, 4, 3), (128, 128, 4, 2),
                    (128, 64, 4, 2), (128, 128, 8, 2), (256, 32, 8, 3)]:
            for nan_check, acc_select in ((False, False), (True, False), (False, True), (True, True)):
                if (nan_check or acc_select) and cfg not in ((256, 64, 8, 3), (128, 128, 4, 2)):
                    continue
                call = _run_variant("halves", q, k, v, o, cfg, nan_check, acc_select)
                timed("halves", lambda call=call: (call(), o)[1], config=list(cfg), nan_check=nan_check,
                      acc_select=acc_select)
        if not args.skip_tilefuse:
            import tilefuse

            for cfg in args.tilefuse_configs.split(";"):
                torch._dynamo.reset()
                naive = _naive_causal if args.causal else _naive_plain
                f = tilefuse.compile(naive, flash_config=cfg) if cfg else tilefuse.compile(naive)
                timed("tilefuse", lambda f=f: f(q, k, v), config=cfg or "tuned")
                rows[-1]["registers"] = _registers_of_launched_kernels()
        if args.only_halves or args.causal or args.no_handwritten:
            continue
        configs = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                   (128, 64, 8, 4), (128, 32, 4, 4)]
        for cfg in configs:
            for nan_check, acc_select in ((False, False), (True, False), (False, True), (True, True)):
                if (nan_check or acc_select) and cfg not in configs[:3]:
                    continue
                call = _run_variant("pointers", q, k, v, o, cfg, nan_check, acc_select)
                timed("online_softmax", lambda call=call: (call(), o)[1], config=list(cfg),
                      nan_check=nan_check, acc_select=acc_select)
        for cfg in configs[:4]:
            for ws in (False, True):
                call = _run_variant("tma", q, k, v, o, cfg, ws=ws)
                timed("online_softmax_tma", lambda call=call: (call(), o)[1], config=list(cfg), warp_specialize=ws)
            call = _run_variant("pointers", q, k, v, o, cfg, ws=True)
            timed("online_softmax", lambda call=call: (call(), o)[1], config=list(cfg), warp_specialize=True)
    with open(f"{args.out}/flash_hopper.json", "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
