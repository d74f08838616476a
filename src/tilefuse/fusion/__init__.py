"""Kernel planning: which graph nodes share a kernel, and how each kernel is structured."""
from .plan import ExternStep, KernelPlan, PlanKind, GraphPlan, StageKind
from .planner import plan_graph

__all__ = ["ExternStep", "KernelPlan", "PlanKind", "GraphPlan", "StageKind", "plan_graph"]
