"""The origin the frontend records for each IR node: the ATen op the program called (before
the core-ATen decompositions) and the innermost line of the user's code."""
import os

import torch

from tilefuse.frontend.origins import source_line
from tilefuse.ir.identifiers import short_op_name

TORCH_FILE = os.path.join(os.path.dirname(torch.__file__), "nn", "modules", "linear.py")


def test_the_innermost_user_frame_is_kept():
    trace = (f'  File "/somewhere/model.py", line 40, in forward\n    h = self.block(x)\n'
             f'  File "/somewhere/blocks.py", line 12, in forward\n    return x * torch.rsqrt(v + eps)\n'
             f'           ^^^^^^^^^^^^\n'
             f'  File "{TORCH_FILE}", line 134, in forward\n    return F.linear(input, self.weight, self.bias)\n')
    assert source_line(trace) == "blocks.py:12 in forward: return x * torch.rsqrt(v + eps)"


def test_frames_without_source_and_long_lines():
    trace = ('  File "<string>", line 3, in <lambda>\n'
             '  File "/x/m.py", line 9, in f\n    y = ' + "a + " * 40 + "b\n")
    line = source_line(trace)
    assert line.startswith("m.py:9 in f: y = a + a") and line.endswith("...") and len(line) < 90, line
    assert source_line('  File "<string>", line 3, in <lambda>\n') == "<string>:3 in <lambda>"
    assert source_line(None) is None and source_line("no frames here") is None


def test_short_op_names():
    aten = torch.ops.aten
    assert short_op_name(aten.mean.dim) == "mean"
    assert short_op_name(aten._softmax.default) == "softmax"
    assert short_op_name(aten._scaled_dot_product_flash_attention_for_cpu.default) == \
        "scaled_dot_product_flash_attention_for_cpu"
    assert short_op_name("aten.convolution.default") == "convolution"
    assert short_op_name(torch.ops.higher_order.cond) == "cond"
