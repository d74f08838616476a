"""The typed vocabulary of plans and schedules: kinds that read as their names, and one
immutable schedule value."""
import dataclasses
import json

import pytest

from tilefuse.fusion.plan import KernelPlan, PlanKind, Stage, StageKind
from tilefuse.ir.expr import Const
from tilefuse.ir import dtypes as dt
from tilefuse.runtime.artifact import decode, encode
from tilefuse.cache.disk import cache_key
from tilefuse.tile.ir import KernelKind
from tilefuse.tile.schedule import Schedule, schedule_over
from tilefuse.tile.space import ScheduleSpace, describe, halved, shrink_dot_tiles


def test_kinds_read_as_their_names():
    k = PlanKind.REDUCTION
    assert k == "reduction" and hash(k) == hash("reduction") and {"reduction": 1}[k] == 1
    assert f"{k}" == str(k) == "reduction" and f"{k:>10}" == " reduction" and json.dumps(k) == '"reduction"'
    assert cache_key(k) == cache_key("reduction")
    assert KernelKind.FLASH_MERGE == "flash-merge" and StageKind.SCORE == "score"


def test_plans_take_plain_names_and_refuse_unknown_ones():
    plan = KernelPlan("k", "pointwise", 4, stages=[Stage("a", "scatter", Const(0, dt.int32))])
    assert plan.kind is PlanKind.POINTWISE and plan.stages[0].kind is StageKind.SCATTER
    with pytest.raises(ValueError):
        KernelPlan("k", "matmul", 4)


def test_stored_graphs_decode_kinds_typed():
    back = decode(encode([PlanKind.FLASH, StageKind.ROW, KernelKind.FLASH_MERGE, "flash"]))
    assert back[0] is PlanKind.FLASH and back[1] is StageKind.ROW and back[2] is KernelKind.FLASH_MERGE
    assert type(back[3]) is str


def test_schedule_is_an_immutable_mapping_equal_by_its_knobs():
    a = Schedule(BLOCK_M=64, BLOCK_N=32, warps=4)
    b = Schedule({"warps": 4, "BLOCK_N": 32, "BLOCK_M": 64})
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a == {"BLOCK_M": 64, "BLOCK_N": 32, "warps": 4} and a != {"BLOCK_M": 64}
    assert list(a) == ["BLOCK_M", "BLOCK_N", "warps"] and describe(a) == "BLOCK_M=64,BLOCK_N=32,warps=4"
    assert a["BLOCK_M"] == 64 and a.get("stages", 1) == 1 and "warps" in a and a.warps == 4 and a.stages == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.items_ = ()
    with pytest.raises(TypeError):
        a["warps"] = 8  # noqa — a mapping without item assignment


def test_schedule_changes_into_new_values():
    rules = Schedule(persistent=True, RBLOCK=1024, XBLOCK=4, warps=4)
    smaller = rules.replace(XBLOCK=2, persistent=False)
    assert rules["XBLOCK"] == 4 and smaller == {"persistent": False, "RBLOCK": 1024, "XBLOCK": 2, "warps": 4}
    assert list(smaller) == list(rules)  # a changed knob keeps its place; a new one goes last
    assert list(rules.replace(split=2))[-1] == "split"
    assert rules.pick(("XBLOCK", "warps")) == {"XBLOCK": 4, "warps": 4}
    assert rules.without("persistent", "warps").as_dict() == {"RBLOCK": 1024, "XBLOCK": 4}
    assert schedule_over(rules, None) is rules and schedule_over(rules, {"warps": 8})["warps"] == 8
    assert halved(Schedule(BLOCK_M=64, BLOCK_N=128), ("BLOCK_M", "BLOCK_N")) == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert shrink_dot_tiles(Schedule(BLOCK_M=64, stages=4), "shared memory", ("BLOCK_M",))["stages"] == 3


def test_a_space_declares_schedules():
    space = ScheduleSpace("memory", {"XBLOCK": (256, 512), "warps": (2, 4)}, {"XBLOCK": 512, "warps": 4},
                          valid=lambda s: s["XBLOCK"] >= 64 * s.warps)
    schedules = space.schedules()
    assert all(isinstance(s, Schedule) for s in schedules) and schedules[0] is space.default
    assert schedules == [{"XBLOCK": 512, "warps": 4}, {"XBLOCK": 256, "warps": 2}, {"XBLOCK": 256, "warps": 4},
                         {"XBLOCK": 512, "warps": 2}]
