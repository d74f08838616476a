"""The fp64 rule: compiled output is no further from an fp64 reference than eager is.

This is how PyTorch's own compiler tests judge a compiled result: compute the program in
fp64 (the reference), measure eager's error and the compiled error against it, and accept
when ``err_compiled <= 2 * err_eager + tol * (1 + max|ref|)``, ``tol`` being the dtype's
tolerance. Non-finite values must sit exactly where eager has them (same infinities, NaN for
NaN); integers and booleans must be equal.

Verify mode (`verify_mode`), which the public API runs, and the correctness tooling of `check/`
all judge by it, so it sits with the driver, below the API.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: tolerance per dtype, relative to the reference's magnitude (1 + max |ref|)
TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}


@dataclass
class Mismatch:
    """Why output `index` was rejected: `error` (max abs difference from the reference, or
    from eager when there is no reference) against `allowed`."""

    index: int
    what: str
    error: float = 0.0
    allowed: float = 0.0

    def __str__(self) -> str:
        if self.allowed:
            return f"output {self.index}: {self.what} (max error {self.error:.3g}, allowed {self.allowed:.3g})"
        return f"output {self.index}: {self.what}"


def flatten(value) -> list:
    """Tensors and scalars of a (nested) output, in order."""
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in flatten(v)]
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in flatten(value[k])]
    return [value]


def to_fp64(value):
    """`value` with every floating tensor upcast to float64 (for the reference run)."""
    if isinstance(value, torch.Tensor):
        return value.detach().double() if value.is_floating_point() else value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(to_fp64(v) for v in value)
    if isinstance(value, dict):
        return {k: to_fp64(v) for k, v in value.items()}
    return value


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 0.0)


def compare_tensor(out: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor | None, index: int = 0,
                   extra_tol: float = 0.0) -> Mismatch | None:
    """Check one compiled tensor against eager and the fp64 reference (None: compare with
    eager alone, within the dtype's tolerance)."""
    if tuple(out.shape) != tuple(eager.shape):
        return Mismatch(index, f"shape {tuple(out.shape)} != eager's {tuple(eager.shape)}")
    if out.dtype != eager.dtype:
        return Mismatch(index, f"dtype {out.dtype} != eager's {eager.dtype}")
    out, eager = out.detach().cpu(), eager.detach().cpu()
    if out.is_complex():  # (a conjugate view, as ifft may return, is resolved first)
        out, eager = torch.view_as_real(out.resolve_conj()), torch.view_as_real(eager.resolve_conj())
        ref = torch.view_as_real(ref.detach().cpu().resolve_conj()) if ref is not None and ref.is_complex() else None
    if not out.is_floating_point():
        if torch.equal(out, eager):
            return None
        bad = (out != eager).sum().item()
        return Mismatch(index, f"{bad} of {out.numel()} elements differ from eager ({out.dtype})")
    if out.numel() == 0:
        return None
    finite = torch.isfinite(eager)
    if not bool(finite.all()):
        same = (torch.isnan(out) & torch.isnan(eager)) | (out == eager)
        if not bool(same[~finite].all()):
            return Mismatch(index, "non-finite values differ from eager's")
    if not bool(torch.isfinite(out[finite]).all()):
        return Mismatch(index, "non-finite value where eager is finite")
    if not bool(finite.any()):
        return None
    o = out.double()[finite]
    e = eager.double()[finite]
    if ref is not None and tuple(ref.shape) == tuple(eager.shape):
        r = ref.detach().cpu().double()[finite]
        r_finite = torch.isfinite(r)
        if bool(r_finite.all()):
            tol = tolerance(out.dtype) + extra_tol
            err_c = (o - r).abs().max().item()
            err_e = (e - r).abs().max().item()
            allowed = 2 * err_e + tol * (1 + r.abs().max().item())
            if err_c <= allowed:
                return None
            return Mismatch(index, "further from the fp64 reference than eager", err_c, allowed)
    # no usable reference: eager is the reference, with the dtype's tolerance
    tol = 4 * tolerance(out.dtype) + extra_tol
    err = (o - e).abs().max().item()
    allowed = tol * (1 + e.abs().max().item())
    if err <= allowed:
        return None
    return Mismatch(index, "differs from eager", err, allowed)


def compare_outputs(compiled, eager, ref=None, extra_tol: float = 0.0) -> Mismatch | None:
    """The first output of `compiled` that breaks the fp64 rule, or None when all pass."""
    cs, es = flatten(compiled), flatten(eager)
    rs = flatten(ref) if ref is not None else [None] * len(es)
    if len(cs) != len(es):
        return Mismatch(-1, f"{len(cs)} outputs, eager has {len(es)}")
    for k, (c, e) in enumerate(zip(cs, es)):
        r = rs[k] if k < len(rs) else None
        if isinstance(e, torch.Tensor):
            if not isinstance(c, torch.Tensor):
                return Mismatch(k, f"{type(c).__name__} where eager gives a tensor")
            bad = compare_tensor(c, e, r if isinstance(r, torch.Tensor) else None, k, extra_tol)
            if bad is not None:
                return bad
        elif isinstance(e, float) and isinstance(c, (int, float)):
            if not (abs(c - e) <= 1e-6 * (1 + abs(e)) or (c != c and e != e)):
                return Mismatch(k, f"{c!r} != eager's {e!r}")
        elif c != e and not (isinstance(e, float) and e != e):
            return Mismatch(k, f"{c!r} != eager's {e!r}")
    return None
