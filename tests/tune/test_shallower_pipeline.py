"""A tuning candidate that Triton refuses for want of shared memory is followed by the same
tiles with one pipeline stage fewer (`tuner.shallower_pipeline`, `_Bench.ready`), as the runtime
retries a refused launch: the limits check counts a product's pipelined operands, and a
persistent kernel whose epilogue loads tiles of its own (BERT's second FFN product: a residual
and a dropout mask) needs more than that — on the GPU its best-ranked tiles, 128×256 at five
stages, were dropped for 254 KB against the H100's 227, and the plan ran a slower candidate.
Any other failure, or a refusal at one stage, drops the candidate as before."""
from tilefuse.tile.schedule import Schedule
from tilefuse.tune import tuner


class OutOfResources(Exception):
    """Triton's refusal (the tuner matches it by name, as the runtime does)."""


def _refusal(required: int) -> OutOfResources:
    return OutOfResources(f"out of resource: shared memory, Required: {required}, Hardware limit: 232448")


def _bench(fits):
    """A `_Bench` whose candidates build when `fits(schedule)`, else Triton refuses them."""
    bench = object.__new__(tuner._Bench)
    bench.plan = type("Plan", (), {"name": "kernel0"})()
    bench.loaded, bench.compile_s, bench.left_out, bench.built = {}, {}, set(), []
    bench.schedules = None

    def kernels(schedule):
        if not fits(schedule):
            raise _refusal(40_000 * schedule["stages"] + 60_000)
        bench.built.append(schedule)

    bench._kernels = kernels
    return bench


WIDE = Schedule(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32, stages=5)
NARROW = Schedule(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, stages=3)


def test_a_refused_candidate_is_retried_with_fewer_stages_until_it_fits():
    bench = _bench(lambda s: 40_000 * s["stages"] + 60_000 <= 232_448)
    ok, failed = bench.ready([(1.0, WIDE), (2.0, NARROW)])
    assert [s for _, s in ok] == [WIDE.replace(stages=4), NARROW]
    assert [s for s, _ in failed] == [WIDE]
    assert bench.built == [WIDE.replace(stages=4), NARROW]  # (tried in its place, before the next)


def test_other_failures_and_single_stages_are_dropped():
    assert tuner.shallower_pipeline(WIDE, RuntimeError("shared memory")) is None  # not Triton's refusal
    assert tuner.shallower_pipeline(WIDE, OutOfResources("out of resource: registers")) is None
    assert tuner.shallower_pipeline(WIDE.replace(stages=1), _refusal(300_000)) is None
    assert tuner.shallower_pipeline(Schedule(XBLOCK=1024), _refusal(300_000)) is None  # no pipeline
    bench = _bench(lambda s: s["stages"] <= 0)  # never fits
    ok, failed = bench.ready([(1.0, NARROW)])
    assert ok == [] and [s["stages"] for s, _ in failed] == [3, 2, 1]


def test_a_shallower_schedule_already_ranked_is_not_tried_twice():
    shallower = WIDE.replace(stages=4)
    bench = _bench(lambda s: s["stages"] <= 4)
    ok, failed = bench.ready([(1.0, WIDE), (2.0, shallower)])
    assert [s for _, s in ok] == [shallower] and bench.built == [shallower]


def test_a_shallower_schedule_outside_the_space_is_not_tried():
    """The tuning cache accepts only the space's configurations: a winner at two stages from a
    space of three to five would be re-tuned at every compile, so it is not offered."""
    space = {WIDE.replace(stages=n) for n in (3, 4, 5)} | {NARROW}
    assert tuner.shallower_pipeline(WIDE, _refusal(300_000), space) == WIDE.replace(stages=4)
    assert tuner.shallower_pipeline(NARROW, _refusal(300_000), space) is None
    bench = _bench(lambda s: s["stages"] <= 2)
    bench.schedules = space
    ok, failed = bench.ready([(1.0, WIDE)])
    assert ok == [] and [s["stages"] for s, _ in failed] == [5, 4, 3]
