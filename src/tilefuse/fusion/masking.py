"""Block skipping: which key tiles a block of query rows can skip because the program's own
mask makes every score in them -inf — the analysis, done once when attention is fused
(`mask_facts`, recorded on the plan's `FlashInfo`); the flash lowering turns its bounds into
the kernel's loop range.

The score reduction's body (the running max's input) is inspected for the form
`where(cond(i, j), -inf, score)` (or a finite fill such as `finfo.min`, added or selected;
see `live_key_range` for when that may skip); each disjunct of `cond` that is linear in the query row `i`
and key position `j` with unit coefficients (`j > i + c`, `i − j > w`, ...) bounds the live
key range of a row block: causal masks end the loop at the diagonal, sliding windows also
start it late. Skipped tiles would contribute the reductions' identities, so the result is
unchanged; conditions of any other shape simply skip nothing.
"""
from __future__ import annotations

import random

import sympy

from ..ir import dtypes as dt
from ..ir.expr import Binary, Cast, Const, Expr, Index, Load, Unary, Var, Where, round_to, transform, walk
from ..ir.monoid import ANY, MAX, MIN, SUM, Monoid
from ..ir.symbolic import smax, smin

_REL = {"gt": sympy.StrictGreaterThan, "ge": sympy.GreaterThan, "lt": sympy.StrictLessThan, "le": sympy.LessThan}


def _strip(e: Expr) -> Expr:
    while isinstance(e, Cast) and e.dtype.is_float and e.x.dtype.is_float:
        e = e.x
    return e


#: a finite fill at or below this masks as -inf does for a row with a live score: exp(fill +
#: s − max) is 0 in fp32 unless the row's live scores are themselves below -1e30 (Hugging Face
#: fills with the dtype's `finfo.min`, -3.4e38 for fp32 and bf16; fp16's -65504 is not enough:
#: live scores may lie below it)
FILL_LIMIT = -1.0e30

#: a finite fill above FILL_LIMIT but at or below this one (-65504, which PyTorch's CUDA
#: attention makes of a boolean mask; -1e4 and -1e9, common in older code) masks only while the
#: scores stay far enough above it: a block summary may skip such tiles under a run-time bound
#: on the scores (`tile.score_guard`), and the mask may be dropped wherever it holds nowhere
SOFT_FILL_LIMIT = -1024.0


def _fill(e: Expr, limit: float = FILL_LIMIT):
    """The fill value of a masked branch (-inf, or a finite value at or below `limit`), or None."""
    e = _strip(e)
    if isinstance(e, Const) and e.dtype.is_float and e.value != "nan" and e.value <= limit:
        return float(e.value)
    return None


def _condition(e: Expr) -> Expr:
    """Look through bool casts of 0/1 selections: cast(where(c, 1, 0), bool) → c, and through
    comparisons of a selection between two constants with one of them: `where(c, 1, 0) == 0`
    (nanoGPT's `tril == 0` once the buffer is a formula, `frontend.index_constants`) → not c."""
    while True:
        if isinstance(e, Cast) and e.dtype.is_bool:
            e = e.x
        elif isinstance(e, Binary) and e.op == "ne" and isinstance(e.b, Const) and e.b.value == 0:
            e = e.a
        elif isinstance(e, Where) and isinstance(e.a, Const) and isinstance(e.b, Const) \
                and e.a.value not in (0, False) and e.b.value in (0, False):
            e = e.cond
        elif (picked := _selected(e)) is not None:
            e = picked
        else:
            return e


def _selected(e: Expr):
    """`sel == x` / `sel != x` for a selection `sel` between two constants (or a boolean, a
    selection between True and False) and a constant x matching one side only: the condition
    (or its negation) under which the comparison holds; else None."""
    if not (isinstance(e, Binary) and e.op in ("eq", "ne") and isinstance(e.b, Const) and e.b.value != "nan"):
        return None
    sel = e.a
    if isinstance(sel, Where) and isinstance(sel.a, Const) and isinstance(sel.b, Const):
        cond, on_true, on_false = sel.cond, sel.a.value, sel.b.value
    elif sel.dtype.is_bool:
        cond, on_true, on_false = sel, True, False
    else:
        return None
    if "nan" in (on_true, on_false):
        return None
    # the comparison's values as the program holds them: the selection's constants rounded to
    # its dtype, then both sides to the type they are compared in (1 + 1e-9 is 1.0 in fp32)
    common = dt.promote(sel.dtype, e.b.dtype)
    on_true, on_false = (_rounded(_rounded(v, sel.dtype), common) for v in (on_true, on_false))
    x = _rounded(_rounded(e.b.value, e.b.dtype), common)
    hit_true, hit_false = on_true == x, on_false == x
    if e.op == "ne":
        hit_true, hit_false = not hit_true, not hit_false
    if hit_true and not hit_false:
        return cond
    if hit_false and not hit_true:
        return _negate(cond)
    return None


def _rounded(v, dtype):
    return round_to(float(v), dtype) if dtype.is_float and not isinstance(v, bool) else v


def _disjuncts(c: Expr) -> list:
    if isinstance(c, Unary) and c.op == "logical_not":  # `~(i >= j)`: the flipped relation, when it is one
        flipped = _negate(c.x)
        if flipped is not None and not (isinstance(flipped, Unary) and flipped.op == "logical_not"):
            return _disjuncts(flipped)
    if isinstance(c, Binary) and c.op == "logical_or":
        return _disjuncts(c.a) + _disjuncts(c.b)
    if isinstance(c, Binary) and c.op == "logical_and":
        # `x && True` (a mask combined with an all-true tensor) is x; other conjunctions are
        # dead only where both parts are, which a single linear bound cannot express
        for x, y in ((c.a, c.b), (c.b, c.a)):
            if isinstance(_condition(y), Const) and _condition(y).value in (True, 1):
                return _disjuncts(_condition(x))
        return []
    if isinstance(c, Binary) and c.op == "logical_or" or isinstance(c, Const):
        return []
    return [c]


def _int_expr(e: Expr):
    """Integer index arithmetic as sympy (indices, integer constants, +, -, *), else None."""
    if isinstance(e, Index) and e.dtype.is_int:
        return e.expr
    if isinstance(e, Const) and (e.dtype.is_int or (e.dtype.is_float and float(e.value).is_integer())):
        return sympy.Integer(int(float(e.value)))
    if isinstance(e, Cast) and e.dtype.name in ("int64", "int32", "float32", "float64"):
        return _int_expr(e.x)  # value-preserving for index ranges (narrow types could wrap or round)
    if isinstance(e, Binary) and e.op in ("add", "sub", "mul"):
        a, b = _int_expr(e.a), _int_expr(e.b)
        if a is None or b is None:
            return None
        return a + b if e.op == "add" else a - b if e.op == "sub" else a * b
    return None


_FLIP = {"gt": "le", "ge": "lt", "lt": "ge", "le": "gt"}


def _negate(c: Expr):
    c = _condition(c)
    if isinstance(c, Binary) and c.op in _FLIP and not (c.a.dtype.is_float or c.b.dtype.is_float):
        # (a float comparison is false both ways on NaN: its negation is `not`, never the flip)
        return Binary(_FLIP[c.op], c.a, c.b, c.dtype)
    if isinstance(c, Binary) and c.op in ("logical_and", "logical_or"):
        a, b = _negate(c.a), _negate(c.b)
        if a is None or b is None:
            return None
        return Binary("logical_or" if c.op == "logical_and" else "logical_and", a, b, c.dtype)
    if isinstance(c, Const):
        return Const(not c.value, c.dtype)
    if isinstance(c, Unary) and c.op == "logical_not":  # (not not x is x)
        return _condition(c.x)
    if c.dtype.is_bool:  # (a comparison of loaded data, ...): no bound reads it, but it stays a disjunct
        return Unary("logical_not", c, c.dtype)
    return None


def _masking(body: Expr, limit: float = FILL_LIMIT):
    """(condition, fill): where the body is masked and the value it takes there at most (-inf,
    or a finite fill at or below `limit` plus the score), or (None, None)."""
    e = _strip(body)
    if isinstance(e, Where) and _fill(e.a, limit) is not None:
        return _condition(e.cond), _fill(e.a, limit)
    if isinstance(e, Where) and _fill(e.b, limit) is not None:
        cond = _negate(e.cond)
        return (cond, _fill(e.b, limit)) if cond is not None else (None, None)
    if isinstance(e, Where) and (_is_zero(e.a) or _is_zero(e.b)):
        # a mask bias selected in places, 0 elsewhere (padding: where(j < n, bias, 0)): masked
        # where it is selected and masked itself
        inner = e.b if _is_zero(e.a) else e.a
        cond, fill = _masking(inner, limit)
        guard = _condition(e.cond) if inner is e.a else _negate(e.cond)
        if cond is None or guard is None:
            return None, None
        return Binary("logical_and", guard, cond, cond.dtype), fill
    if isinstance(e, Binary) and e.op == "add":  # score + mask bias (where(keep, 0, fill))
        parts = [m for m in (_masking(e.a, limit), _masking(e.b, limit)) if m[0] is not None]
        if len(parts) == 2:
            return Binary("logical_or", parts[0][0], parts[1][0], parts[0][0].dtype), max(parts[0][1], parts[1][1])
        return parts[0] if parts else (None, None)
    if isinstance(e, Binary) and e.op == "mul" and isinstance(e.b, Const) and e.b.dtype.is_float and e.b.value > 0:
        cond, fill = _masking(e.a, limit)
        fill = fill * e.b.value if fill is not None else None
        return (cond, fill) if fill is not None and fill <= limit else (None, None)
    return None, None


def _is_zero(e: Expr) -> bool:
    e = _strip(e)
    return isinstance(e, Const) and e.dtype.is_float and e.value == 0


def masked_condition(body: Expr):
    """The condition under which the body is masked (-inf, or a fill at or below
    SOFT_FILL_LIMIT), or None: `where(c, -inf, s)` masks where c holds, `where(c, s, -inf)`
    (keep-masks, as PyTorch's SDPA builds) where it does not, `s + where(keep, 0, finfo.min)`
    (Hugging Face's masks) where `keep` does not. Where the condition holds for no element the
    mask may be dropped whatever its fill; only skipping needs the fill to be low enough."""
    return _masking(body, SOFT_FILL_LIMIT)[0]


def mask_and_fill(body: Expr, soft: bool = False):
    """(condition, fill) of a masked score expression — where it is masked, and the value
    (-inf, or a finite fill at or below FILL_LIMIT; with `soft`, at or below SOFT_FILL_LIMIT)
    it takes there — or (None, None)."""
    return _masking(body, SOFT_FILL_LIMIT if soft else FILL_LIMIT)


def score_scale(body: Expr, scores: str):
    """c where `body` without its mask is c·S for the score buffer `S` (up to casts between
    float types and additions of 0), else None: a bound on |S| is then a bound on every live
    score."""
    e, c = _strip(unmasked(body)), 1.0
    while True:
        if isinstance(e, Load) and e.buffer == scores:
            return c
        if isinstance(e, Binary) and e.op == "add" and (_is_zeros(e.a) or _is_zeros(e.b)):
            e = _strip(e.b if _is_zeros(e.a) else e.a)
        elif isinstance(e, Binary) and e.op in ("mul", "truediv") and _finite_const(e.b) is not None \
                and _finite_const(e.b) != 0:
            c = c * _finite_const(e.b) if e.op == "mul" else c / _finite_const(e.b)
            e = _strip(e.a)
        elif isinstance(e, Binary) and e.op == "mul" and _finite_const(e.a) is not None:
            c, e = c * _finite_const(e.a), _strip(e.b)
        else:
            return None


def _finite_const(e: Expr):
    e = _strip(e)
    if isinstance(e, Const) and e.dtype.is_float and e.value != "nan" and abs(float(e.value)) < float("inf"):
        return float(e.value)
    return None


def _is_zeros(e: Expr) -> bool:
    """0, or a selection between zeros (what `unmasked` leaves of a padded mask bias)."""
    e = _strip(e)
    return _is_zero(e) or (isinstance(e, Where) and _is_zeros(e.a) and _is_zeros(e.b))


def _diagonal_is_live(cond: Expr, row: sympy.Symbol, key: sympy.Symbol) -> bool:
    """Whether `cond` (the masked condition) is false for key j = i on every row i: then every
    row keeps a live score on its diagonal whatever the data, e.g. `i >= j` with `ids[i] ==
    ids[j]` for Hugging Face's packed-sequence masks."""
    def at_diagonal(e):
        if isinstance(e, Index):
            return Index(sympy.sympify(e.expr).subs(key, row), e.dtype)
        return None

    return _truth(transform(cond, at_diagonal)) is False


def _truth(c: Expr):
    """True / False where `c` is decided whatever the data, else None."""
    c = _condition(c)
    if isinstance(c, Const):
        return bool(c.value)
    if isinstance(c, Unary) and c.op == "logical_not":
        inner = _truth(c.x)
        return None if inner is None else not inner
    if isinstance(c, Binary) and c.op in ("logical_and", "logical_or"):
        a, b = _truth(c.a), _truth(c.b)
        if c.op == "logical_and":
            return False if False in (a, b) else (True if a is True and b is True else None)
        return True if True in (a, b) else (False if a is False and b is False else None)
    if isinstance(c, Binary) and c.op in ("eq", "ne", "lt", "le", "gt", "ge"):
        if c.a == c.b and not c.a.dtype.is_float:  # the same value (no NaN) on both sides
            return c.op in ("eq", "le", "ge")
        lhs, rhs = _int_expr(c.a), _int_expr(c.b)
        if lhs is not None and rhs is not None:
            rel = {"eq": sympy.Eq, "ne": sympy.Ne, **_REL}[c.op](sympy.expand(lhs - rhs), 0)
            return bool(rel) if rel in (sympy.true, sympy.false) else None
    return None


def live_key_range(body: Expr, row: sympy.Symbol, key: sympy.Symbol, diagonal_exists: bool = False):
    """(lower, upper) bounds of the live keys for rows [lo, hi] as functions
    `lower(lo)` / `upper(hi)` — sympy expressions over the symbols LO and HI — or None for no
    bound. A key j is dead for the whole block when j < lower or j > upper.

    A finite fill (`finfo.min`) is not -inf: a row masked everywhere averages every key in
    eager, so its keys may be skipped only when each row provably keeps a live score — its
    diagonal, where the mask is false whatever the data and key j = i exists
    (`diagonal_exists`: as many keys as rows at least)."""
    cond, fill = _masking(body)
    if cond is None:
        return None, None
    if fill != float("-inf") and not (diagonal_exists and _diagonal_is_live(cond, row, key)):
        return None, None
    lower = upper = None
    for d in _disjuncts(cond):
        if not (isinstance(d, Binary) and d.op in _REL):
            continue
        lhs, rhs = _int_expr(d.a), _int_expr(d.b)
        if lhs is None or rhs is None:
            continue
        diff = sympy.expand(lhs - rhs)  # d: diff OP 0
        cj, ci = diff.coeff(key), diff.coeff(row)
        rest = sympy.expand(diff - cj * key - ci * row)
        if rest.free_symbols or abs(cj) != 1 or ci != -cj:
            continue
        strict = d.op in ("gt", "lt")
        positive = (d.op in ("gt", "ge")) == (cj == 1)  # the masked side is j - i > -rest (after sign)
        c0 = -rest if cj == 1 else rest
        # masked where j - i > c0 (positive, strict) / >= c0, or j - i < c0 / <= c0
        if positive:
            first_dead = c0 + (1 if strict else 0)  # j >= i + first_dead is masked
            bound = HI + first_dead - 1  # the last live key of the block's last row
            upper = bound if upper is None else smin(upper, bound)
        else:
            last_dead = c0 - (1 if strict else 0)  # j <= i + last_dead is masked
            bound = LO + last_dead + 1
            lower = bound if lower is None else smax(lower, bound)
    return lower, upper


def _exact_disjuncts(c: Expr):
    """The disjuncts of `c` when every one is a comparison (None otherwise: a conjunction or
    anything else that no unit-linear bound describes exactly)."""
    if isinstance(c, Binary) and c.op == "logical_or":
        a, b = _exact_disjuncts(c.a), _exact_disjuncts(c.b)
        return None if a is None or b is None else a + b
    if isinstance(c, Binary) and c.op == "logical_and":
        for x, y in ((c.a, c.b), (c.b, c.a)):
            if isinstance(_condition(y), Const) and _condition(y).value in (True, 1):
                return _exact_disjuncts(_condition(x))
        return None
    if isinstance(c, Binary) and c.op in _REL:
        return [c]
    return None


def _unit_bound(d: Expr, row, key):
    """`d` as (masks_above, c): masked where j − i ≥ c (masks_above) or j − i ≤ c, or None."""
    lhs, rhs = _int_expr(d.a), _int_expr(d.b)
    if lhs is None or rhs is None:
        return None
    diff = sympy.expand(lhs - rhs)
    cj, ci = diff.coeff(key), diff.coeff(row)
    rest = sympy.expand(diff - cj * key - ci * row)
    if rest.free_symbols or abs(cj) != 1 or ci != -cj:
        return None
    strict = d.op in ("gt", "lt")
    above = (d.op in ("gt", "ge")) == (cj == 1)
    c0 = -rest if cj == 1 else rest
    if above:
        return True, c0 + (1 if strict else 0)
    return False, c0 - (1 if strict else 0)


def full_key_range(body: Expr, row: sympy.Symbol, key: sympy.Symbol):
    """(lower, upper): keys live for *every* row of the block [LO, HI] — `lower(HI)` and
    `upper(LO)` over the symbols LO and HI, None for no bound — or None when the mask is not
    exactly a disjunction of unit-linear bounds (then every tile must evaluate it)."""
    cond = masked_condition(body)
    ds = _exact_disjuncts(cond) if cond is not None else None
    if not ds:
        return None
    lower = upper = None
    for d in ds:
        bound = _unit_bound(d, row, key)
        if bound is None:
            return None
        above, c = bound
        if above:  # dead where j >= i + c: live for all rows while j <= LO + c - 1
            upper = LO + c - 1 if upper is None else smin(upper, LO + c - 1)
        else:  # dead where j <= i + c: live for all rows from HI + c + 1
            lower = HI + c + 1 if lower is None else smax(lower, HI + c + 1)
    return lower, upper


def unmasked(body: Expr) -> Expr:
    """`body` with the mask that `masked_condition` reads removed (its live branch kept): the
    score expression of tiles where the mask holds nowhere."""
    e = _strip(body)
    if isinstance(e, Where) and _fill(e.a, SOFT_FILL_LIMIT) is not None:
        return _cast(e.b, body.dtype)
    if isinstance(e, Where) and _fill(e.b, SOFT_FILL_LIMIT) is not None:
        return _cast(e.a, body.dtype)
    if isinstance(e, Where) and (_is_zero(e.a) or _is_zero(e.b)) and masked_condition(e) is not None:
        return _cast(Where(e.cond, *(x if _is_zero(x) else unmasked(x) for x in (e.a, e.b)), e.dtype), body.dtype)
    if isinstance(e, Binary) and e.op == "add":
        a = unmasked(e.a) if masked_condition(e.a) is not None else e.a
        b = unmasked(e.b) if masked_condition(e.b) is not None else e.b
        if _is_zeros(b) or _is_zeros(a):  # (what is left of an additive mask: s + 0 is s, and
            # a bare scaled score keeps its scale foldable into exp2)
            return _cast(a if _is_zeros(b) else b, body.dtype)
        return _cast(Binary("add", a, b, e.dtype), body.dtype)
    if isinstance(e, Binary) and e.op == "mul" and isinstance(e.b, Const):
        return _cast(Binary("mul", unmasked(e.a), e.b, e.dtype), body.dtype)
    return body


def without_mask(body: Expr):
    """The rewrite of a kernel body for tiles where the masked score expression `body` is
    masked nowhere: `body` becomes `unmasked(body)`, and every other selection on the mask's
    condition, a disjunct of it or its negation (the backward's `where(c, 0, dS)`, the gradient
    of the masking itself) keeps its live branch: those tiles evaluate none of them."""
    live = unmasked(body)
    cond = masked_condition(body)
    false = [] if cond is None else [cond, *_disjuncts(cond)]  # (c false: each disjunct of c false)
    true = [t for t in (_negate(f) for f in false) if t is not None]

    def fold(n):
        if not isinstance(n, Where):
            return None
        c = _condition(n.cond)
        if isinstance(c, Const) and not c.dtype.is_float:
            return _cast(n.a if c.value else n.b, n.dtype)
        if any(c == f for f in false):
            return _cast(n.b, n.dtype)
        if any(c == t for t in true):
            return _cast(n.a, n.dtype)
        return None

    return lambda e: transform(transform(e, lambda n: live if n == body else None), fold)


def _cast(e: Expr, dtype):
    from ..ir.expr import cast

    return cast(e, dtype)


LO = sympy.Symbol("LO", integer=True)
HI = sympy.Symbol("HI", integer=True)

#: `vanishes_when_masked` by the shape of its question: every layer of a model asks the same
#: one with other buffer names (the answer costs tens of ms of reference evaluation)
_VANISHES_MEMO: dict = {}
_MEMO_LIMIT = 512


def vanishes_when_masked(body: Expr, masked: Expr, m: Monoid) -> bool:
    """A skipped key tile must contribute the combiner's identity to `body`: the body reads the
    scores only through the masked score expression, and where that is masked — -inf, and the
    mask's finite fill when it has one — it evaluates to the identity (checked on random values
    of everything else, e.g. exp(-inf - m) == 0).

    Under a finite fill an idempotent combiner (any, max, min) may instead take the same value
    at a masked key as at any live one: `any(s != -inf)`, PyTorch's safe-softmax test, is true
    at both. Skipping such keys changes nothing for a row that keeps a live key, and a row
    without one is visited whole wherever a finite fill skips (`diagonal_keeps_rows_live`, the
    block summary's per-row liveness).

    The answer depends on the expressions' structure only, so it is remembered by their shape
    with buffers named in order of appearance (`_renamed`)."""
    names: dict = {}
    key = (_renamed(masked, names), _renamed(body, names), m)
    answer = _VANISHES_MEMO.get(key)
    if answer is None:
        if len(_VANISHES_MEMO) >= _MEMO_LIMIT:
            _VANISHES_MEMO.clear()
        answer = _VANISHES_MEMO[key] = _vanishes_when_masked(body, masked, m)
    return answer


def _renamed(e: Expr, names: dict) -> Expr:
    """`e` with each buffer it loads named by its order of first appearance (shared through
    `names` by the expressions of one question); no buffer is named with a NUL."""
    def fn(n):
        if isinstance(n, Load):
            return Load(names.setdefault(n.buffer, f"\0{len(names)}"), n.index, n.dtype)
        return None

    return transform(e, fn)


def _vanishes_when_masked(body: Expr, masked: Expr, m: Monoid) -> bool:
    scores = {e.buffer for e in walk(masked) if isinstance(e, Load)}
    placeholder = Var("__masked__", masked.dtype)
    hidden = transform(body, lambda e: placeholder if e == masked else None)
    # the mask's own condition may select elsewhere in the body too (`where(¬keep, 0, ds)` in
    # a backward's weights): at a masked key its value is known, so it is substituted
    hidden = _at_masked_keys(hidden, masked)
    if any(isinstance(e, Load) and e.buffer in scores for e in walk(hidden)):
        return False
    if m not in (SUM, ANY, MAX, MIN):  # (prod, all and the arg-reductions are not checked)
        return False
    ident = float(m.identity(body.dtype))
    rng = random.Random(0)
    fill = _masking(masked, SOFT_FILL_LIMIT)[1]
    for value_masked in (float("-inf"), fill) if fill not in (None, float("-inf")) else (float("-inf"),):
        if _vanishes_at(hidden, placeholder, value_masked, ident, rng):
            continue
        if value_masked == float("-inf") or m not in (ANY, MAX, MIN) \
                or not _same_as_live(hidden, placeholder, value_masked, rng):
            return False
    return True


def _at_masked_keys(hidden: Expr, masked: Expr) -> Expr:
    """`hidden` with each copy of the masked selection's own condition (and its negation)
    replaced by the value it has where the score is masked: `where(c, -inf, s)` is masked
    where c holds, `where(c, s, -inf)` where it does not."""
    e = _strip(masked)
    if not isinstance(e, Where):
        return hidden
    if _fill(e.a, SOFT_FILL_LIMIT) is not None:
        value = True
    elif _fill(e.b, SOFT_FILL_LIMIT) is not None:
        value = False
    else:
        return hidden
    cond = e.cond

    def fn(n):
        if n == cond:
            return Const(value, n.dtype)
        if isinstance(n, Unary) and n.op == "logical_not" and n.x == cond:
            return Const(not value, n.dtype)
        return None

    return transform(hidden, fn)


def _same_as_live(hidden: Expr, placeholder: Var, value_masked: float, rng) -> bool:
    """`hidden` takes the same value with the score at `value_masked` as at live (finite)
    scores, on random values of everything else."""
    for _ in range(3):
        leaves = {}
        masked = _evaluated(hidden, placeholder, value_masked, leaves, rng)
        for score in (rng.uniform(-30, 30), *_EXTREME_SCORES):  # (live scores may be any finite value)
            if _evaluated(hidden, placeholder, score, leaves, rng) != masked:
                return False
    return True


def _evaluated(hidden: Expr, placeholder: Var, score: float, leaves: dict, rng) -> float:
    """`hidden` with the score at `score` and every other load or index at a random value
    (drawn once per leaf into `leaves`)."""
    import torch

    from ..ir.interpret import Evaluator

    def leaf(e):
        if e is placeholder or e == placeholder:
            return Const(score, e.dtype)
        if isinstance(e, (Load, Index)) and not isinstance(e, Var):
            if e not in leaves:
                v = rng.uniform(-4, 4)
                leaves[e] = Const(v if e.dtype.is_float else int(v), e.dtype) if not e.dtype.is_bool \
                    else Const(v > 0, e.dtype)
            return leaves[e]
        return None

    return float(torch.as_tensor(Evaluator({}, {})(transform(hidden, leaf))).double())


#: live scores a finite fill allows: up to |fill| / 4 under a bound, any finite value beyond
_EXTREME_SCORES = (-3.0e38, -1.0e9, -16000.0, -256.0, 256.0, 16000.0, 1.0e9, 3.0e38)


def _vanishes_at(hidden: Expr, placeholder: Var, value_masked: float, ident: float, rng) -> bool:
    return all(_evaluated(hidden, placeholder, value_masked, {}, rng) == ident for _ in range(3))


def mask_facts(reduce_bodies: dict, weights: Expr, graph) -> tuple[Expr | None, bool]:
    """(masked, skippable) of an attention-shaped kernel: `masked` is the score expression the
    running max reduces (the first max reduction's body, where the program's mask writes -inf;
    None without a max), and `skippable` whether a key tile where it is -inf everywhere may be
    skipped: every other reduction's body and the output's `weights` contribute their identity
    there (`vanishes_when_masked`)."""
    maxes = [node for node in reduce_bodies if graph[node].combiner == MAX]
    if not maxes:
        return None, False
    masked = reduce_bodies[maxes[0]]
    others = [(body, graph[node].combiner) for node, body in reduce_bodies.items() if node != maxes[0]]
    return masked, all(vanishes_when_masked(body, masked, m) for body, m in others + [(weights, SUM)])


def diagonal_keeps_rows_live(body: Expr, row: sympy.Symbol, key: sympy.Symbol, diagonal_exists: bool) -> bool:
    """Every row keeps a live score whatever the data: the mask is -inf-filled (a row masked
    everywhere is NaN in eager either way), or its diagonal key exists and is never masked."""
    cond, fill = _masking(body, SOFT_FILL_LIMIT)
    if cond is None or fill == float("-inf"):
        return True
    return diagonal_exists and _diagonal_is_live(cond, row, key)


__all__ = ["mask_facts", "mask_and_fill", "score_scale", "SOFT_FILL_LIMIT", "diagonal_keeps_rows_live", "vanishes_when_masked", "live_key_range", "full_key_range", "unmasked", "without_mask", "masked_condition", "LO", "HI"]
