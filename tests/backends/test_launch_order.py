"""`ProgramId.group` (backends/triton/helpers.py `_grouped_program`), run in the scoped Triton
interpreter: every launch position maps to one (block, batch element) and every pair is
launched once, a group's batch elements launch together, blocks within a group in order (from
the last with `reverse`), and a last group smaller than the rest is covered too."""
import importlib.util

import pytest
import torch

pytest.importorskip("triton")

from tilefuse.backends.triton import interpreter  # noqa: E402
from tilefuse.backends.triton.helpers import HELPERS  # noqa: E402

KERNEL = '''
@triton.jit
def launch_order(out_ptr, GROUP: tl.constexpr, REVERSE: tl.constexpr):
    pid = _grouped_program(0, GROUP, REVERSE)
    pid_b = _grouped_program(1, GROUP, False)
    launch = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(out_ptr + 2 * launch, pid)
    tl.store(out_ptr + 2 * launch + 1, pid_b)
'''


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    path = tmp_path_factory.mktemp("order") / "launch_order.py"
    path.write_text("import triton\nimport triton.language as tl\n" + HELPERS["grouped_program"] + KERNEL)
    spec = importlib.util.spec_from_file_location("launch_order", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.launch_order


@pytest.mark.parametrize("blocks,batch,group", [(5, 7, 3), (4, 6, 6), (3, 5, 1), (6, 2, 8)])
@pytest.mark.parametrize("reverse", [False, True])
def test_grouped_launch_order(kernel, blocks, batch, group, reverse):
    out = torch.full((blocks * batch, 2), -1, dtype=torch.int32)
    with interpreter.running():
        interpreter.launchable(kernel)[(blocks, batch)](out, GROUP=group, REVERSE=reverse)
    pairs = [tuple(p) for p in out.tolist()]
    assert sorted(pairs) == [(p, b) for p in range(blocks) for b in range(batch)]
    for start in range(0, batch, group):
        members = range(start, min(batch, start + group))
        launched = pairs[start * blocks:(start + len(members)) * blocks]
        assert {b for _, b in launched} == set(members)
        order = [p for p, _ in launched]
        assert order == sorted(order, reverse=reverse)
