"""`tilefuse::cudnn_attention_backward`: ATen's cuDNN attention backward, called with the
output's gradient laid out as the output is.

`aten._scaled_dot_product_cudnn_attention_backward` (PyTorch 2.11, cuDNN 9 on an H200) gives
wrong gradients, with no error, when `grad_out`'s strides differ from `out`'s: relative errors
near 1 in dq, dk and dv for a [4, 16, 1024, 128] causal attention whose gradient is stored
[B, S, H, D] while the output is [B, H, S, D] (`scripts/probe_cudnn_sdpa_layouts.py`; the
layout of q, k and v does not matter). In eager PyTorch the two usually agree, since both
come out of the same transposes; in a compiled training step they need not — each compiler
lays its buffers out its own way — and Hugging Face Llama's step trained on wrong q/k
gradients under tilefuse or Inductor alike, depending on which compiled first in the process.
This op copies `grad_out` into `out`'s strides when they differ (one pass over it) and calls
ATen; the schema is ATen's own, read from the installed PyTorch.
"""
from __future__ import annotations

import torch

_ATEN = getattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward", None)
_NAME = "cudnn_attention_backward"

_LIB = torch.library.Library("tilefuse", "FRAGMENT")


def _backward(grad_out, query, key, value, out, *args, **kwargs):
    if grad_out.stride() != out.stride():
        grad_out = torch.empty_strided(out.shape, out.stride(), dtype=grad_out.dtype,
                                       device=grad_out.device).copy_(grad_out)
    return _ATEN.default(grad_out, query, key, value, out, *args, **kwargs)


if _ATEN is not None:
    _schema = str(_ATEN.default._schema)
    _LIB.define(_NAME + _schema[_schema.index("("):])
    _LIB.impl(_NAME, _backward, "CompositeExplicitAutograd")
    cudnn_attention_backward = getattr(torch.ops.tilefuse, _NAME).default
    #: ATen op -> the op the graph calls instead
    REPLACEMENTS = {_ATEN.default: cudnn_attention_backward}
else:  # (a PyTorch without cuDNN attention)
    cudnn_attention_backward = None
    REPLACEMENTS = {}

__all__ = ["cudnn_attention_backward", "REPLACEMENTS"]
