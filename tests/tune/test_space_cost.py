"""Schedule spaces declared by the lowerings, the roofline cost model that ranks them, and the
tuner's selection (cache first, then a measured search) with a fake timer."""
import math

import pytest

from irgraphs import GraphBuilder
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels, schedule_space
from tilefuse.tile.target import Target
from tilefuse.tile.space import SMEM_PER_BLOCK
from tilefuse.tune.cost import NOMINAL, choose_without_measuring, predict, rank

GPU = LoweringOptions(target=Target.gpu(sm_count=132))


def _matmul(m, n, k, dtype=dt.bfloat16, out_dtype=dt.float32):
    g = GraphBuilder("mm")
    a, b = g.input("a", (m, k), dtype), g.input("b", (k, n), dtype)
    mm = g.ctx.reduce((m, n), (k,), "sum",
                      lambda i, r: cast(a.load((i[0], r[0])), dt.float32) * cast(b.load((r[0], i[1])), dt.float32),
                      out_dtype)
    graph = g.output(mm)
    (plan,) = plan_graph(graph).kernels
    assert plan.kind == "contraction"
    return graph, plan


def test_contraction_space_is_valid_and_starts_from_the_rules():
    graph, plan = _matmul(4096, 4096, 4096)
    space = schedule_space(graph, plan, GPU)
    configs = space.schedules()
    assert configs[0] == space.default == {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8,
                                           "warps": 8, "stages": 3}
    assert len(configs) > 20 and len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for c in configs[1:]:
        assert c["stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 <= SMEM_PER_BLOCK
        assert c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["warps"]) <= 128
    # a small problem never gets tiles larger than itself
    graph, plan = _matmul(40, 24, 1000)
    for c in schedule_space(graph, plan, GPU).schedules():
        assert c["BLOCK_M"] <= 64 and c["BLOCK_N"] <= 32


def test_a_tuned_schedule_reaches_the_generated_kernel():
    graph, plan = _matmul(256, 512, 128)
    chosen = {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 32, "GROUP_M": 8, "warps": 4, "stages": 4}
    (tk,) = lower_plan_kernels(graph, plan, LoweringOptions(schedule=chosen))
    assert tk.constexprs["BLOCK_M"] == 64 and tk.constexprs["BLOCK_N"] == 256 and tk.constexprs["BLOCK_K"] == 32
    assert (tk.num_warps, tk.num_stages) == (4, 4)


def test_cost_model_prefers_large_tiles_on_large_products_and_counts_waves():
    graph, plan = _matmul(8192, 8192, 8192)
    space = schedule_space(graph, plan, GPU)
    big = dict(space.default)
    small = dict(big, BLOCK_M=64, BLOCK_N=64, warps=4)
    assert predict(space, big) < predict(space, small)
    # the prediction is a time: at least the roofline of the useful work
    assert predict(space, big) >= 2 * 8192**3 / NOMINAL.matrix_flops
    # a product with few output tiles: a config filling more SMs is predicted faster
    graph, plan = _matmul(512, 512, 16384)
    space = schedule_space(graph, plan, GPU)
    few = dict(space.default, BLOCK_M=256, BLOCK_N=256, warps=8)
    many = dict(space.default, BLOCK_M=64, BLOCK_N=64, warps=4)
    assert predict(space, many) < predict(space, few)


def test_ranking_keeps_the_default_and_model_choice_defers_to_close_rules():
    graph, plan = _matmul(4096, 4096, 4096)
    space = schedule_space(graph, plan, GPU)
    ranked = rank(space, keep=4)
    assert len(ranked) == 4 and any(cfg == space.default for _, cfg in ranked)
    assert [t for t, _ in ranked] == sorted(t for t, _ in ranked) or ranked[-1][1] == space.default
    chosen = choose_without_measuring(space)
    best_t = rank(space)[0][0]
    assert chosen == space.default or predict(space, space.default) > 1.1 * best_t
    assert math.isfinite(predict(space, chosen))


def test_unknown_sizes_are_not_ranked():
    import sympy

    graph, plan = _matmul(sympy.Symbol("s0", integer=True, positive=True), 64, 64)
    space = schedule_space(graph, plan, GPU)
    assert space.sizes["M"] is None and math.isinf(predict(space, space.default))
    assert choose_without_measuring(space) == space.default


def test_selection_measures_once_then_hits_the_cache(tmp_path):
    pytest.importorskip("tilefuse.tune.search")
    from tilefuse.tune.cache import TuningCache
    from tilefuse.tune.cost import NOMINAL
    from tilefuse.tune.tuner import select_schedule

    graph, plan = _matmul(2048, 2048, 2048)
    space = schedule_space(graph, plan, GPU)
    best = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "warps": 8, "stages": 3}
    calls = []

    def fake_measure(cfg):  # the best configuration is fastest; the rest slower by their tile area
        calls.append(cfg)
        return 1e-3 if cfg == best else 1e-3 * (1.5 + 64 * 64 / (cfg["BLOCK_M"] * cfg["BLOCK_N"]))

    from tilefuse.config import config

    with config.patch(cache_dir=str(tmp_path)):
        first = select_schedule(space, "k1", "max", NOMINAL, fake_measure, TuningCache(), "kernel0")
        assert first.source == "measured" and first.measured == len(calls) > 0
        n = len(calls)
        again = select_schedule(space, "k1", "max", NOMINAL, fake_measure, TuningCache(), "kernel0")
        assert again.source == "cache" and len(calls) == n and again.schedule == first.schedule
    if any(c == best for c in calls):
        assert first.schedule == best


def _rmsnorm(rows, width):
    g = GraphBuilder("rms")
    x = g.input("x", (rows, width))
    ss = g.ctx.reduce((rows,), (width,), "sum", lambda i, r: x.load((i[0], r[0])) * x.load((i[0], r[0])), dt.float32)
    graph = g.output(ss)
    (plan,) = plan_graph(graph).kernels
    return graph, plan


@pytest.mark.parametrize("width,persistent", [(4096, True), (100000, False)])
def test_reduction_space_and_memory_model(width, persistent):
    graph, plan = _rmsnorm(1024, width)
    space = schedule_space(graph, plan, GPU)
    assert space.kind == "memory" and space.sizes["bytes"] == 1024 * width * 4 + 1024 * 4
    assert ("XBLOCK" in space.knobs) == persistent and "RBLOCK" in space.knobs
    # a row that fits may still be walked in tiles (two passes, the second from L2): measured
    if persistent:
        assert space.knobs["persistent"] == (True, False) and space.default["persistent"] is True
    else:
        assert "persistent" not in space.knobs
    ranked = rank(space, keep=6)
    if persistent:
        assert {cfg["persistent"] for _, cfg in ranked} == {True, False}
    assert len(ranked) <= 6 and any(cfg == space.default for _, cfg in ranked)
    # never faster than the bytes at full bandwidth
    assert all(t >= space.sizes["bytes"] / NOMINAL.bandwidth for t, _ in ranked)
    # a tuned schedule reaches the kernel
    (_, cfg), = [x for x in ranked if x[1] != space.default][:1] or [ranked[0]]
    (tk,) = lower_plan_kernels(graph, plan, LoweringOptions(schedule=cfg))
    assert tk.num_warps == cfg["warps"]
    for knob in ("XBLOCK", "RBLOCK"):
        if knob in cfg:
            assert tk.constexprs[knob] == cfg[knob]


def test_pointwise_space_and_too_few_programs():
    g = GraphBuilder("pw")
    x = g.input("x", (64, 1000))
    y = g.ctx.pointwise((64, 1000), dt.float32, lambda i: x.load(i) * 2.0)
    graph = g.output(y)
    (plan,) = plan_graph(graph).kernels
    space = schedule_space(graph, plan, GPU)
    big = dict(space.default, XBLOCK=4096)
    small = dict(space.default, XBLOCK=256)
    assert predict(space, small) <= predict(space, big)  # 64 000 elements: small blocks fill more SMs


def test_empty_problems_are_predicted_not_divided_by_zero():
    graph, plan = _rmsnorm(0, 300)
    space = schedule_space(graph, plan, GPU)
    assert all(math.isfinite(predict(space, cfg)) for cfg in space.schedules())
    assert choose_without_measuring(space) is not None


def test_model_alone_never_switches_to_the_library():
    graph, plan = _matmul(4096, 4096, 4096, out_dtype=dt.bfloat16)
    space = schedule_space(graph, plan, GPU)
    assert "impl" in space.knobs
    assert choose_without_measuring(space)["impl"] == "generated"
    assert any(cfg.get("impl") == "aten" for _, cfg in rank(space, keep=8))  # but it is measured


@pytest.mark.parametrize("keep", [1, 2, 8])
def test_a_cut_keeps_the_default_and_each_implementation(keep):
    graph, plan = _matmul(4096, 4096, 4096, out_dtype=dt.bfloat16)
    space = schedule_space(graph, plan, GPU)
    kept = [cfg for _, cfg in rank(space, keep=keep)]
    assert space.default in kept
    assert any(cfg["impl"] == "aten" for cfg in kept)
    assert len(kept) == keep if keep >= 3 else 2 <= len(kept) <= 3  # default, best generated, the library
    times = [t for t, _ in rank(space, keep=keep)]
    assert times == sorted(times)


def test_skinny_products_get_narrow_tiles_that_keep_every_sm_streaming():
    """A decode step's product (8 rows against a 5632×2048 weight) is bound by reading the
    weight: the rules' 16×128 tiles give 16 programs for 132 SMs. The space offers narrow column
    tiles and the cost model prices the idle SMs, so a schedule with a program per SM ranks
    first; products of many rows keep the usual space."""
    graph, plan = _matmul(8, 2048, 5632, out_dtype=dt.bfloat16)
    space = schedule_space(graph, plan, GPU)
    assert {s["BLOCK_N"] for s in space.schedules()} >= {16, 32, 64, 128}
    assert all(s["BLOCK_M"] == 16 for s in space.schedules())  # no more rows than the product needs
    _, best = rank(space)[0]
    assert math.ceil(2048 / best["BLOCK_N"]) >= 64
    assert predict(space, best) < predict(space, space.default) / 2
    graph, plan = _matmul(256, 2048, 2048)
    assert min(s["BLOCK_M"] for s in schedule_space(graph, plan, GPU).schedules()) >= 64


def test_a_skinny_products_programs_keep_enough_bytes_in_flight():
    """A batch-1 decode product streams its weight through one program per SM: by Little's law
    each must keep enough of it loading. 16×64 weight tiles five stages deep (8 KB in flight a
    program) read gpt-fast's 2048×5632 weight at 1.2 TB/s on an H100, 256-deep ones at 2 TB/s
    (docs/benchmarks.md, forty-fifth section): the model ranks the deep tiles first, and
    prices the shallow ones by what they keep in flight, not by the bandwidth alone."""
    graph, plan = _matmul(1, 2048, 5632, out_dtype=dt.bfloat16)
    space = schedule_space(graph, plan, GPU)
    _, best = rank(space)[0]
    assert best["BLOCK_K"] >= 256
    shallow = best.replace(BLOCK_K=64, stages=5)
    deep = best.replace(BLOCK_K=256, stages=5)
    assert predict(space, shallow) > 1.5 * predict(space, deep)
    weight_s = 2048 * 5632 * 2 / NOMINAL.bandwidth
    assert predict(space, deep) < 1.6 * weight_s + 4e-6  # (a deep pipeline reaches the bandwidth)


@pytest.mark.parametrize("head", [64, 128])
def test_products_over_recomputed_scores_keep_tiles_that_fit_registers(head):
    """The attention backward's kernels hold two score tiles, the weights computed from them
    and (dKᵀ with dV) two accumulators: 128×128 tiles spill there (measured 2–3× slower on the
    H200, docs/benchmarks.md, twentieth section), so the space leaves them out, while the
    forward's flash kernel (one score tile, one accumulator) keeps them. 128×64 tiles of 8
    warps stay in (the fastest dK/dV kernel at head dim 128 on an H100, twenty-eighth section,
    which a count of three live score tiles and of separately staged Q and dO had left out)
    and are the rules' choice but for dK/dV at a narrow head (64×64, 4 warps)."""
    import torch

    import tilefuse
    from lowered_plans import recorded_lowerings
    from tilefuse.config import config

    def backward(q, k, v, o, do, lse):
        s = (q @ k.transpose(-1, -2)) * 0.125
        p = torch.exp(s.float() - lse)
        dv = p.to(q.dtype).transpose(-1, -2) @ do
        ds = (p * ((do @ v.transpose(-1, -2)).float() - (do.float() * o.float()).sum(-1, keepdim=True))).to(q.dtype)
        return ds @ k, ds.transpose(-1, -2) @ q, dv

    def forward(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v

    q, k, v, o, do = (torch.randn(1, 2, 256, head, dtype=torch.bfloat16) for _ in range(5))
    lse = torch.randn(1, 2, 256, 1)
    with config.patch(graph_cache=False), recorded_lowerings() as seen:
        torch._dynamo.reset()
        tilefuse.explain(backward, q, k, v, o, do, lse)
        torch._dynamo.reset()
        tilefuse.explain(forward, q, k, v)
    flash = [(graph, plan) for graph, plan, _ in seen if plan.kind == "flash"]
    assert sorted(len(plan.flash.siblings) for _, plan in flash) == [0, 0, 1]  # (forward, dQ, dKᵀ with dV)
    for graph, plan in flash:
        space = schedule_space(graph, plan, GPU)
        largest = max(s["BLOCK_M"] * s["BLOCK_N"] for s in space.schedules())
        assert largest == (128 * 128 if not plan.flash.scores else 128 * 64), (plan.name, largest)
        if plan.flash.scores:
            from tilefuse.tile.schedule import Schedule

            tiles = {"BLOCK_M": 128, "BLOCK_N": 64, "warps": 8, "stages": 3}
            assert space.valid(Schedule(tiles)), plan.name  # (schedules() lists the default anyway)
            assert not space.valid(Schedule(dict(tiles, BLOCK_N=128))), plan.name
            if plan.flash.siblings and head < 128:
                tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "warps": 4, "stages": 3}
            assert {k: space.default[k] for k in tiles} == tiles, (plan.name, space.default)


def test_programs_that_move_too_few_bytes_are_latency_bound():
    """One 64-element row per program leaves too few bytes in flight to reach the bandwidth
    (measured on the H200: 98304 such programs took 60 µs where 64 rows each took 8): the model
    no longer picks a single row per program for a short-row reduction."""
    g = GraphBuilder("rowsum")
    x = g.input("x", (98304, 64), dt.bfloat16)
    red = g.ctx.reduce((98304,), (64,), "sum", lambda i, r: cast(x.load((i[0], r[0])), dt.float32), dt.float32)
    graph = g.output(red)
    (plan,) = plan_graph(graph).kernels
    space = schedule_space(graph, plan, GPU)
    one_row = [s for s in space.schedules() if s.get("XBLOCK") == 1]
    assert one_row, "the space offers one row per program"
    best = rank(space, NOMINAL)[0]
    assert best[1].get("XBLOCK", 1) >= 4, best
    assert predict(space, one_row[0], NOMINAL) > 2 * best[0]
