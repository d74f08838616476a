"""Index arithmetic printed for Triton keeps Python's (sympy's) floor semantics for every sign:
Triton's `//`, `%` and `tl.cdiv` truncate, so quotients, modulos and ceilings of numerators that
may be negative go through the floor helpers. Each expression runs in the Triton interpreter
over negative and positive values and is compared with `ir.symbolic.evaluate`."""
import importlib.util
import sys

import pytest
import sympy
import torch

pytest.importorskip("triton")

from tilefuse.backends.triton import interpreter  # noqa: E402
from tilefuse.backends.triton.helpers import HELPERS  # noqa: E402
from tilefuse.backends.triton.indexing import format_sympy  # noqa: E402
from tilefuse.ir.symbolic import Ceiling, Floor, evaluate, fold_mod_complement, mod  # noqa: E402

Z = sympy.Symbol("z", integer=True)
CASES = {
    "floor": Floor(Z / 4),
    "ceiling": Ceiling(Z / 4),
    "mod": mod(Z, 3),
    "rounded down to a multiple": fold_mod_complement(Z - mod(Z, 4)),
    "rounded up to a multiple": fold_mod_complement(-Z - mod(-Z, 4)),
    "padded": fold_mod_complement(Z + mod(-Z, 5)),
}


def _kernel(expr, tmp_path):
    helpers: set = set()
    text = format_sympy(expr, helpers)
    source = "import triton\nimport triton.language as tl\n" + "".join(HELPERS[h] for h in sorted(helpers)) + f"""
@triton.jit
def kernel(z_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    z = tl.load(z_ptr + i)
    tl.store(out_ptr + i, {text})
"""
    path = tmp_path / f"index_{abs(hash(text))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.kernel, text


@pytest.mark.parametrize("name", sorted(CASES))
def test_index_expressions_round_as_python_for_every_sign(name, tmp_path):
    expr = CASES[name]
    kernel, text = _kernel(expr, tmp_path)
    zs = torch.arange(-17, 15, dtype=torch.int64)
    out = torch.empty_like(zs)
    with interpreter.running():
        interpreter.launchable(kernel)[(1,)](zs, out, N=zs.numel())
    want = [int(evaluate(expr, {Z: int(z)})) for z in zs]
    assert out.tolist() == want, (name, text)
