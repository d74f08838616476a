"""Kernel planning: which graph nodes share a kernel, and how each kernel is structured."""
from .plan import ExternStep, KernelPlan, Schedule
from .planner import plan_graph

__all__ = ["ExternStep", "KernelPlan", "Schedule", "plan_graph"]
