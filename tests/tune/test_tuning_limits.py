"""The tuner and its cache against target limits, without compiling anything: candidates that
do not fit are never measured (the space is topped up with ones that do), and a cached record
that is not one of the space's configurations, or does not fit, is discarded and tuned again."""
import pytest

from irgraphs import GraphBuilder
from tilefuse.config import config
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast
from tilefuse.tile.lower import LoweringOptions, schedule_space
from tilefuse.tile.target import Target
from tilefuse.tune.cache import TuningCache, tuning_key
from tilefuse.tune.cost import NOMINAL
from tilefuse.tune.search import TuningError
from tilefuse.tune.tuner import select_schedule

GPU = LoweringOptions(target=Target.gpu(sm_count=132))
KEY = tuning_key("kernel source", {"M": 2048}, ["bfloat16"], {"name": "test"})


def _space():
    g = GraphBuilder("mm")
    a = g.input("a", (2048, 2048), dt.bfloat16, strides="contiguous")
    b = g.input("b", (2048, 2048), dt.bfloat16, strides="contiguous")
    mm = g.ctx.reduce((2048, 2048), (2048,), "sum",
                      lambda i, r: cast(a.load((i[0], r[0])), dt.float32) * cast(b.load((r[0], i[1])), dt.float32),
                      dt.float32)
    graph = g.output(mm)
    (plan,) = plan_graph(graph).kernels
    return schedule_space(graph, plan, GPU)


def _too_big(cfg):  # a stand-in for the target's limits
    return "over the limits" if cfg["BLOCK_M"] * cfg["BLOCK_N"] > 128 * 128 else None


def test_candidates_over_the_limits_are_never_measured(tmp_path):
    space = _space()
    measured = []

    def measure(cfg):
        measured.append(cfg)
        return 1e-3 * (1 + 64 * 64 / (cfg["BLOCK_M"] * cfg["BLOCK_N"]))

    with config.patch(cache_dir=str(tmp_path)):
        out = select_schedule(space, KEY, "1", NOMINAL, measure, TuningCache(), "kernel0", misfit=_too_big)
    assert measured and not any(_too_big(cfg) for cfg in measured)
    assert out.source == "measured" and _too_big(out.schedule) is None


def test_nothing_fits_is_a_tuning_error(tmp_path):
    with config.patch(cache_dir=str(tmp_path)):
        with pytest.raises(TuningError, match="no candidate fits"):
            select_schedule(_space(), KEY, "1", NOMINAL, lambda cfg: 1e-3, TuningCache(), "kernel0",
                          misfit=lambda cfg: "never")


@pytest.mark.parametrize("record", [
    {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "warps": 8, "stages": 3},  # over the limits
    {"BLOCK_M": 1 << 20, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "warps": 8, "stages": 3},  # not in the space
    {"BLOCK_M": 64},  # not in the space either
])
def test_cached_record_that_does_not_fit_is_discarded_and_tuned_again(tmp_path, record):
    space = _space()
    measured = []

    def measure(cfg):
        measured.append(cfg)
        return 1e-3

    with config.patch(cache_dir=str(tmp_path)):
        assert TuningCache().store(KEY, record, 1e-6)  # a valid entry: checksummed by the cache itself
        out = select_schedule(space, KEY, "1", NOMINAL, measure, TuningCache(), "kernel0", misfit=_too_big)
        assert out.source == "measured" and measured and out.schedule != record
        again = TuningCache().lookup(KEY)
        assert again is not None and again["schedule"] == out.schedule  # replaced by the new result


def test_lookup_misses_a_record_the_caller_does_not_accept(tmp_path):
    """A record that does not fit this process is a miss here, but stays on disk: whether it
    fits can depend on the process (stack limit, GPU), and a re-tune replaces it anyway."""
    with config.patch(cache_dir=str(tmp_path)):
        cache = TuningCache()
        assert cache.store(KEY, {"XBLOCK": 1 << 20}, 1e-6)
        assert cache.lookup(KEY, accept=lambda cfg: None)["schedule"] == {"XBLOCK": 1 << 20}
        assert cache.lookup(KEY, accept=lambda cfg: "too big") is None
        assert cache.misses == 1
        assert TuningCache().lookup(KEY)["schedule"] == {"XBLOCK": 1 << 20}
