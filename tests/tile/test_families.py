"""Kernel families (`tile.family`, `tile.registry`): every plan kind the planner makes has one
family, reached by its kind; the spaces they declare are priced by their own cost; a kind
without a family is an error naming it; families share helpers only through public names."""
import ast
import os

import pytest

from irgraphs import GraphBuilder
from tilefuse.fusion import plan_graph
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import cast
from tilefuse.tile import contraction, flash, pointwise, reduction
from tilefuse.tile.family import KernelFamily
from tilefuse.tile.fit import current_schedule
from tilefuse.tile.lower import LoweringOptions, lower_plan_kernels, schedule_space
from tilefuse.tile.target import Target
from tilefuse.tile.registry import FAMILIES, UnknownKind, family
from tilefuse.tune.cost import NOMINAL, predict

TILE = os.path.dirname(os.path.abspath(pointwise.__file__))
FAMILY_MODULES = {"pointwise": pointwise, "reduction": reduction, "contraction": contraction, "flash": flash}


def test_every_family_module_is_registered_under_its_kind():
    assert set(FAMILIES) == set(FAMILY_MODULES)
    for kind, module in FAMILY_MODULES.items():
        assert isinstance(module.FAMILY, KernelFamily) and module.FAMILY.kind == kind
        assert family(kind) is module.FAMILY


def test_a_kind_without_a_family_is_an_error_naming_it():
    with pytest.raises(UnknownKind, match="'gather'"):
        family("gather")


def _plans():
    g = GraphBuilder("fam")
    a, b = g.input("a", (64, 32)), g.input("b", (32, 48))
    mm = g.ctx.reduce((64, 48), (32,), "sum", lambda i, r: a.load((i[0], r[0])) * b.load((r[0], i[1])), dt.float32)
    row = g.ctx.reduce((64,), (32,), "max", lambda i, r: a.load((i[0], r[0])), dt.float32)
    pw = g.ctx.pointwise((64, 32), dt.float32, lambda i: cast(a.load(i) * 2.0, dt.float32))
    graph = g.output(mm, row, pw)
    return graph, plan_graph(graph).kernels


def test_spaces_are_declared_and_priced_by_the_plans_family():
    graph, plans = _plans()
    kinds = set()
    for plan in plans:
        kinds.add(plan.kind)
        options = LoweringOptions(target=Target.gpu(sm_count=132))
        space = schedule_space(graph, plan, options)
        assert space.plan_kind == plan.kind
        assert predict(space, space.default) == family(plan.kind).cost(space, space.default, NOMINAL)
        assert current_schedule(graph, plan, options) == family(plan.kind).schedule(graph, plan, options)
        assert [k.name for k in lower_plan_kernels(graph, plan, options)] == [plan.name]
    assert {"contraction", "reduction", "pointwise"} <= kinds


def test_no_module_imports_a_private_name_of_another_tile_module():
    for name in os.listdir(TILE):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(TILE, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"tile/{name} imports {private} from .{node.module}"
