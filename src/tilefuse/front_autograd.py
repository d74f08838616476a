"""A training graph served by the front cache: AOTAutograd's autograd function rebuilt from a
stored entry around the compiled forward and backward, without tracing the joint graph.

The function does what AOTAutograd's does for a graph whose entry `front_cache.plain_training`
accepted (no input mutations, no aliased outputs, no numbers saved, no random-state
bookkeeping):

* arguments whose gradient the backward graph never computes are detached before the call
  (as AOTAutograd's runtime wrapper detaches them: no edge into a graph the call cannot use);
* the forward runs the compiled forward graph under no-grad (as every `autograd.Function.forward`
  runs), saves the tensors it returns after the outputs (a view detached first, as AOTAutograd
  saves it), and marks the outputs that do not require grad as not differentiable;
* the backward hands the compiled backward the saved tensors and the gradients of the outputs
  that take one, each laid out as the backward was compiled for it (a gradient of another
  layout, or an unused output's materialised zeros, is copied into that layout), and returns
  one gradient per input. Run with deterministic algorithms on, a backward compiled with them
  off raises, as AOTAutograd's does. Under `create_graph=True` the gradients it returns require
  grad through a node whose backward raises: double backward is refused, as AOTAutograd refuses
  it, never silently cut.

A graph traced under autocast runs its compiled code with autocast off.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


def _laid_out(grad: torch.Tensor, sizes: tuple, strides: tuple, dtype: torch.dtype) -> torch.Tensor:
    """`grad` with the sizes, strides and dtype the backward was compiled for."""
    if grad.dtype == dtype and tuple(grad.stride()) == strides and tuple(grad.shape) == sizes:
        return grad
    out = torch.empty_strided(sizes, strides, dtype=dtype, device=grad.device)
    out.copy_(grad)
    return out


class _OnceDifferentiable(torch.autograd.Function):
    """The gradients a backward computes under `create_graph=True`: connected to the graph, with
    a backward that raises (a dummy input that requires grad makes them require grad)."""

    @staticmethod
    def forward(ctx, run, _dummy):
        return tuple(run())

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("torch.compile with tilefuse does not support double backward (AOTAutograd does not "
                           "either): differentiate the gradients of a compiled graph eagerly")


def autograd_runner(forward: Callable, backward: Callable, entry: dict) -> Callable:
    """A function of Dynamo's arguments returning the graph's outputs as AOTAutograd's compiled
    function would: `forward(*args)` returns the outputs then the saved tensors,
    `backward(*saved, *gradients)` one gradient (or None) per argument."""
    outputs = entry["outputs"]
    non_differentiable = list(entry["non_differentiable"])
    tangent_outputs = list(entry["tangent_outputs"])
    layouts = [(tuple(sizes), tuple(strides), getattr(torch, dtype)) for sizes, strides, dtype in entry["tangents"]]
    detached = frozenset(entry["no_gradient"])
    deterministic = entry["deterministic"]
    amp_off = torch._C._DisableAutocast if entry.get("autocast") else contextlib.nullcontext

    class CompiledGraphFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            with amp_off():
                results = forward(*args)
            ctx.save_for_backward(*(t.detach() if t._is_view() else t for t in results[outputs:]))
            returned = tuple(results[:outputs])
            ctx.mark_non_differentiable(*(returned[k] for k in non_differentiable))
            ctx._materialize_non_diff_grads = False  # (as AOTAutograd: no zeros made for them)
            return returned

        @staticmethod
        def backward(ctx, *grads):
            if not deterministic and torch.are_deterministic_algorithms_enabled():
                raise RuntimeError("this compiled backward runs with torch.use_deterministic_algorithms(True), but "
                                   "its forward was compiled with deterministic algorithms off")
            tangents = [_laid_out(grads[k], *layout) for k, layout in zip(tangent_outputs, layouts)]
            saved = ctx.saved_tensors

            def run():
                with amp_off():
                    return backward(*saved, *tangents)

            if torch.is_grad_enabled():  # create_graph=True
                return _OnceDifferentiable.apply(run, torch.empty(0, requires_grad=True))
            return tuple(run())

    def run(*args):
        if detached:
            args = [a.detach() if k in detached and isinstance(a, torch.Tensor) else a for k, a in enumerate(args)]
        return list(CompiledGraphFunction.apply(*args))

    return run


__all__ = ["autograd_runner"]
