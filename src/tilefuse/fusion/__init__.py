"""Kernel planning: which graph nodes share a kernel, and how each kernel is structured."""
from .plan import ExternStep, KernelPlan, PlanKind, Schedule, StageKind
from .planner import plan_graph

__all__ = ["ExternStep", "KernelPlan", "PlanKind", "Schedule", "StageKind", "plan_graph"]
