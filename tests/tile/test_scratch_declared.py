"""Every tile kernel declares the temporaries outside the graph it reads or writes
(`TileKernel.scratch`): the tuner allocates a candidate's buffers kernel by kernel, and a
merge kernel that read its partial states without declaring them could not be measured (a
split attention in T5's decoder lost its tuning to a KeyError on the GPU)."""
from dataclasses import replace

import pytest
import torch

import tilefuse
from lowered_plans import recorded_lowerings
from tilefuse.tile.lower import lower_plan_kernels
from tilefuse.tile.target import Target


def _flash_plans(fn, *args):
    """(graph, plan, options) of each flash plan compiling `fn` lowers (C++ backend)."""
    torch._dynamo.reset()
    with recorded_lowerings() as seen, tilefuse.config.patch(target="cpu", fallback="error"):
        torch.compile(fn, backend="tilefuse", dynamic=False)(*args)
    found = [x for x in seen if x[1].kind == "flash"]
    assert found, "attention did not compile to a flash kernel"
    return found


def _plain(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.125, -1) @ v


def _padded(q, k, v, keep):
    s = (q @ k.transpose(-1, -2) * 0.125).masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s, -1) @ v


def _inputs(rows, keys):
    q = torch.randn(2, 4, rows, 32)
    k, v = (torch.randn(2, 4, keys, 32) for _ in range(2))
    keep = torch.rand(2, keys) > 0.3
    return q, k, v, keep


@pytest.mark.parametrize("fn,rows,keys,splits", [
    (_plain, 1, 2050, 0),  # decode-shaped: the rules split the keys on a 132-SM device
    (_plain, 37, 211, 3),  # a split the schedule asks for, odd sizes
    (_padded, 1, 2050, 0),  # split, with a block summary of the mask read from data
    (_padded, 45, 130, 2),
], ids=["decode", "forced", "decode-mask", "forced-mask"])
def test_each_kernel_declares_the_scratch_it_touches(fn, rows, keys, splits):
    q, k, v, keep = _inputs(rows, keys)
    args = (q, k, v) if fn is _plain else (q, k, v, keep)
    gpu = Target.gpu(sm_count=132)
    split_seen = False
    for graph, plan, options in _flash_plans(fn, *args):
        gpu_options = replace(options, target=gpu, flash_split=splits)
        kernels = lower_plan_kernels(graph, plan, gpu_options)
        split_seen |= len(kernels) > 1 and any(tk.name.endswith("_merge") for tk in kernels)
        for tk in kernels:
            outside = (set(tk.reads) | set(tk.writes)) - set(graph.nodes)
            assert outside <= set(tk.scratch), (tk.name, sorted(outside - set(tk.scratch)))
    assert split_seen, "no split-and-merge attention was lowered: the test tests nothing"
