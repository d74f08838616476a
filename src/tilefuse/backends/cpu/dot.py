"""The CPU backend's `dot`: the register-blocked micro-kernel, and two rewrites of the
statements around a dot that save whole passes over its tiles.

* **Accumulating into the carried state**: `R = f(acc)`; `X = dot(a, b)` from a zero tile;
  `acc = R + X` (the flash kernel's re-based accumulator plus P·V) becomes `acc = f(acc)` in
  place and a dot that accumulates into `acc` — no arrays for `R` and `X`, no separate pass
  adding them (the form of `acc = tl.dot(p, v, acc)` in Triton's flash kernels). Only when
  nothing else reads `R`, `X` or `acc` in between.
* **Operands read in place**: an fp32 tile load used only as a dot operand, whose rows (or, for
  a `b` of few rows, columns) are contiguous with a compile-time stride, is not copied: the
  micro-kernel reads the buffer with that leading dimension (the V tile of P·V; a MoE's
  gathered expert weights, whose base is an index loaded once per tile: `lanes.py`).
* **A `b` operand stored by columns** (`columns_first`): a tile its nest reads from memory
  along the rows (a MoE's gathered weights, `w1[experts]` read as Wᵀ), used only as the `b`
  of dots with few rows, is stored column by column as it is read, and the dot takes one
  dot product along K per element (`tf_dot_nt`) instead of the nest scattering every element
  into a row-major tile.

`plan_dot` is the dot's part of the loop plan (`loop_plan.py`): its register block and how it
reads each operand, as a `DotPlan`.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import dtypes as dt
from ...ir.expr import Binary, Index, Var
from ...tile.ir import Assign, DotTile, For, Let, LoadTile, StoreTile
from .exprs import CppUnsupported
from .shapes import reads, written as stmt_written


DOT_SOURCE = r"""
typedef float tf_v16 __attribute__((vector_size(64), aligned(4)));
/* the host's own vector of floats: a 16-lane vector wider than its registers is split by the
   compiler into pieces it keeps in memory, between general registers (AVX2: four times slower) */
#if defined(__AVX512F__)
#define TF_VL 16
#elif defined(__AVX__)
#define TF_VL 8
#else
#define TF_VL 4
#endif
typedef float tf_vn __attribute__((vector_size(4 * TF_VL), aligned(4)));
/* acc[R][16V] += a[R][K] @ b[K][16V] (leading dims LDA, LDB, LDC), fp32: the R x 16V block's
   accumulators, W native vectors per row, stay in registers for the whole K loop; one broadcast
   of `a` feeds W FMAs */
template <int R, int V, int K, int LDA, int LDB, int LDC, bool ZERO>
TF_INLINE void tf_dot_block(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ acc) {
  constexpr int W = V * (16 / TF_VL);
  tf_vn c[R][W];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) c[r][w] = ZERO ? (tf_vn){} : *(const tf_vn*)&acc[r * LDC + TF_VL * w];
  for (int k = 0; k < K; ++k) {
    tf_vn bv[W];
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) bv[w] = *(const tf_vn*)&b[k * LDB + TF_VL * w];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const float av = a[r * LDA + k];
#pragma GCC unroll 16
      for (int w = 0; w < W; ++w) c[r][w] += av * bv[w];
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int w = 0; w < W; ++w) *(tf_vn*)&acc[r * LDC + TF_VL * w] = c[r][w];
}
/* acc[M][N] (+)= a[M][K] @ b[K][N], dense row-major: column panels of 16V, R-row blocks;
   ZERO: acc starts at 0 (never read) */
template <int M, int N, int K, int R, int V, bool ZERO = false> TF_INLINE void tf_dot_rb(const float* __restrict__ a,
                                                                                         const float* __restrict__ b,
                                                                                         float* __restrict__ acc) {
  for (int j0 = 0; j0 < N; j0 += 16 * V)
    for (int i0 = 0; i0 < M; i0 += R) tf_dot_block<R, V, K, K, N, N, ZERO>(a + i0 * K, b + j0, acc + i0 * N + j0);
}
/* the same with the operands read in place: a[M][K] with row stride LDA, b[K][N] with LDB */
template <int M, int N, int K, int R, int V, int LDA, int LDB, bool ZERO = false>
TF_INLINE void tf_dot_rb_ld(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ acc) {
  for (int j0 = 0; j0 < N; j0 += 16 * V)
    for (int i0 = 0; i0 < M; i0 += R) tf_dot_block<R, V, K, LDA, LDB, N, ZERO>(a + i0 * LDA, b + j0, acc + i0 * N + j0);
}
/* dst[R][C] = src[i + j * ld] (a transposed tile): 16x16 blocks loaded as rows of the source,
   transposed in registers by four rounds of two-source shuffles, stored as rows of dst */
#define TF_T(k, hi) TF_T_##k##_##hi
#define TF_T_8_0 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define TF_T_8_1 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define TF_T_4_0 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define TF_T_4_1 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define TF_T_2_0 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define TF_T_2_1 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define TF_T_1_0 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define TF_T_1_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
typedef float tf_v16a __attribute__((vector_size(64)));
#define TF_T_ROUND(k) _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) if (!(i & k)) { \
    const tf_v16a a = v[i], b = v[i | k]; \
    v[i] = __builtin_shufflevector(a, b, TF_T(k, 0)); v[i | k] = __builtin_shufflevector(a, b, TF_T(k, 1)); }
#if defined(__AVX512F__) || !defined(__x86_64__)
template <int R, int C> TF_INLINE void tf_load_t(const float* __restrict__ src, int64_t ld, float* __restrict__ dst) {
  for (int j0 = 0; j0 < C; j0 += 16)
    for (int i0 = 0; i0 < R; i0 += 16) {
      tf_v16a v[16];
#pragma GCC unroll 16
      for (int jj = 0; jj < 16; ++jj) { tf_v16 t = *(const tf_v16*)&src[(j0 + jj) * ld + i0]; v[jj] = t; }
      TF_T_ROUND(8) TF_T_ROUND(4) TF_T_ROUND(2) TF_T_ROUND(1)
#pragma GCC unroll 16
      for (int ii = 0; ii < 16; ++ii) *(tf_v16*)&dst[(i0 + ii) * C + j0] = v[ii];
    }
}
#else
/* without AVX-512 the 16-lane shuffles above are split into moves through general registers:
   a plain transposing copy, 8x8 blocks at a time, vectorises better */
template <int R, int C> TF_INLINE void tf_load_t(const float* __restrict__ src, int64_t ld, float* __restrict__ dst) {
  for (int j0 = 0; j0 < C; j0 += 8)
    for (int i0 = 0; i0 < R; i0 += 8)
#pragma GCC unroll 8
      for (int ii = 0; ii < 8; ++ii)
#pragma omp simd
        for (int jj = 0; jj < 8; ++jj) dst[(i0 + ii) * C + j0 + jj] = src[(j0 + jj) * ld + i0 + ii];
}
#endif
/* acc[M][N] (+)= a[M][K] @ b[K][N] with b's tile stored by columns, bt[N][K] (a gathered
   weight read contiguously along K, stored as it was read): one dot product along K per
   element, four columns at a time in native vectors, LDB apart (K when stored; a tile read
   where it lies keeps its buffer's stride). For few rows M: each element pays a
   horizontal sum, which a transposing copy of b would save only over many rows */
template <int M, int N, int K, int LDA, bool ZERO = false, int LDB = K>
TF_INLINE void tf_dot_nt(const float* __restrict__ a, const float* __restrict__ bt, float* __restrict__ acc) {
  for (int i = 0; i < M; ++i) {
    const float* __restrict__ ar = a + i * LDA;
    if constexpr (K % TF_VL == 0 && N % 4 == 0) {
      for (int j = 0; j < N; j += 4) {
        tf_vn c0 = {}, c1 = {}, c2 = {}, c3 = {};
#pragma GCC unroll 8
        for (int k = 0; k < K; k += TF_VL) {
          const tf_vn av = *(const tf_vn*)&ar[k];
          c0 += av * *(const tf_vn*)&bt[(j + 0) * LDB + k];
          c1 += av * *(const tf_vn*)&bt[(j + 1) * LDB + k];
          c2 += av * *(const tf_vn*)&bt[(j + 2) * LDB + k];
          c3 += av * *(const tf_vn*)&bt[(j + 3) * LDB + k];
        }
        float s[4][TF_VL];  /* the four horizontal sums by halving steps (vector adds), not lane by lane */
        *(tf_vn*)s[0] = c0; *(tf_vn*)s[1] = c1; *(tf_vn*)s[2] = c2; *(tf_vn*)s[3] = c3;
#pragma GCC unroll 8
        for (int w = TF_VL / 2; w > 0; w >>= 1)
#pragma GCC unroll 4
          for (int q = 0; q < 4; ++q)
#pragma GCC unroll 8
            for (int l = 0; l < w; ++l) s[q][l] += s[q][l + w];
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) acc[i * N + j + q] = ZERO ? s[q][0] : acc[i * N + j + q] + s[q][0];
      }
    } else {
      for (int j = 0; j < N; ++j) {
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int k = 0; k < K; ++k) s += ar[k] * bt[j * LDB + k];
        acc[i * N + j] = ZERO ? s : acc[i * N + j] + s;
      }
    }
  }
}
/* the plain loop, in the accumulator's type T (float, or double for fp64 products) */
template <int M, int N, int K, typename T> TF_INLINE void tf_dot_ikj(const T* __restrict__ a, const T* __restrict__ b,
                                                                     T* __restrict__ acc) {
  for (int i = 0; i < M; ++i)
    for (int k = 0; k < K; ++k) {
      const T av = a[i * K + k];
      #pragma omp simd
      for (int j = 0; j < N; ++j) acc[i * N + j] += av * b[k * N + j];
    }
}
"""


@dataclass(frozen=True)
class Operand:
    """A dot operand as a row-major array of `shape`. `kind`: "in_place" (the buffer read at
    `load`'s offset, spelt out as `expr`, with leading dimension `ld`), "in_place_t" (`b`
    only: the same, read by columns `ld` apart), "array" (the tile value `name` itself),
    "array_t" (the tile value `name` stored by columns: `b` only, see `columns_first`),
    "copy_load" (a dense copy from `load`'s buffer), "copy" (a dense copy of `expr`)."""

    kind: str
    shape: tuple
    ld: int
    name: str = ""
    load: object = None
    expr: object = None


@dataclass(frozen=True)
class DotPlan:
    """`stmt` as `out (+)= a @ b` of extents (m, n, k), in `acc_dtype`; `block`: the register
    block (rows, 16-lane vectors) or None for the plain i-k-j loop; `zero`: the accumulator
    starts at 0 (no fill); `init`: the accumulator is first set from `stmt.acc`."""

    stmt: DotTile
    m: int
    n: int
    k: int
    acc_dtype: object
    block: tuple | None
    a: Operand
    b: Operand
    zero: bool
    init: bool
    out: str


def plan_dot(s: DotTile, sh, local, inplace: dict, zero: bool, out: str) -> DotPlan:
    """The plan of `s` given the values that never leave their nest (`local`), the loads read
    in place (`inplace_operands`), whether its accumulator starts at zero unfilled and the
    array it accumulates into."""
    (m, n) = sh.shape[s.name]
    k = sh.of(s.a)[1]
    if sh.of(s.b)[0] not in (1, k):
        raise CppUnsupported("dot operands of mismatched inner extents")
    acc_t = sh.dtype[s.name]  # fp32, or fp64 for double operands (the plain loop only)
    block = register_block(m, n) if acc_t == dt.float32 else None
    return DotPlan(stmt=s, m=m, n=n, k=k, acc_dtype=acc_t, block=block,
                   a=_operand(s.a, (m, k), block, acc_t, sh, local, inplace),
                   b=_operand(s.b, (k, n), block, acc_t, sh, local, inplace),
                   zero=zero, init=not (isinstance(s.acc, Var) and s.acc.name == s.name), out=out)


def _operand(e, shape, block, acc_t, sh, local, inplace) -> Operand:
    """The buffer itself for a load read in place (with a register block), the tile's own
    array when it already has the accumulator's type, else a dense copy."""
    held = (dt.float32, dt.bfloat16, dt.float16) if acc_t == dt.float32 else (acc_t,)  # arrays of that type
    if isinstance(e, Var) and e.name in inplace:  # (its load is not printed)
        found = inplace[e.name]
        if found.transposed:  # (`_takes_in_place`: always the `b` of a dot with few rows)
            return Operand("in_place_t", shape, found.ld, load=found.load, expr=found.offset)
        if (block is not None or shape[0] == 1) and sh.shape.get(e.name) == shape:  # (one row: any ld)
            return Operand("in_place", shape, found.ld, load=found.load, expr=found.offset)
        return Operand("copy_load", shape, shape[1], load=found.load)
    if isinstance(e, Var) and e.name not in local and sh.shape.get(e.name) == shape \
            and sh.dtype[e.name] in held and e.name not in sh.aranges:
        return Operand("array", shape, shape[1], name=e.name)
    return Operand("copy", shape, shape[1], expr=e)


#: register blocks (rows, 16-lane vectors) by the host's vector registers, in 16-float units:
#: AVX-512's 32 zmm hold 16 accumulators (8x2 or 4x4), else 8 (4x2, 8x1); AVX2's and NEON's
#: 16-float equivalents are 8 (a 16-lane vector is two ymm or four q registers), so at most 4
#: accumulators: more spill every FMA's operands to the stack (measured on a Zen 4 without
#: AVX-512 enabled: 4 GFLOP/s in the flash kernel's 8x2 blocks)
BLOCKS_BY_REGISTERS = {32: ((8, 2), (4, 4), (4, 2), (8, 1), (4, 1)), 8: ((4, 1), (2, 2), (2, 1))}


def register_block(m: int, n: int, registers: int | None = None):
    """(rows, 16-lane vectors) of the dot's register block for a host with `registers` 16-float
    vector registers (None: this host's, `toolchain.vector_registers`), else None (the plain
    i-k-j loop)."""
    if registers is None:
        from .toolchain import vector_registers

        registers = vector_registers()
    for r, v in BLOCKS_BY_REGISTERS[32 if registers >= 32 else 8]:
        if m % r == 0 and n % (16 * v) == 0:
            return r, v
    return None


#: dots with at most this many rows take a `b` stored by columns (`tf_dot_nt`)
NT_MAX_ROWS = 4


def columns_first(dots, rows_inner: dict, stmt_readers: dict, sh) -> dict:
    """{tile name: its row extent} of the tiles to store by columns: written by a nest that
    walks rows innermost (`rows_inner`: name -> its nest's shape), read by nothing but dots,
    as their `b` array, each with at most `NT_MAX_ROWS` rows, in fp32."""
    out = {}
    for name, shape in rows_inner.items():
        users = stmt_readers.get(name, [])
        uses = [d for d in dots if d.b.kind == "array" and d.b.name == name]
        if not users or len(uses) != len(users) or not all(isinstance(u, DotTile) for u in users):
            continue
        if any(d.m > NT_MAX_ROWS or d.acc_dtype != dt.float32 or d.a.kind == "array" and d.a.name == name
               or d.b.shape != shape for d in uses) or sh.dtype.get(name) != dt.float32:
            continue
        out[name] = shape[0]
    return out


def stmt_readers(stmts, out=None) -> dict:
    """name -> the statements that read it (loop headers count as their loop)."""
    out = {} if out is None else out
    for s in stmts:
        if isinstance(s, For):
            from ...tile.ir import expr_names

            for name in expr_names(s.start) | expr_names(s.stop):
                out.setdefault(name, []).append(s)
            stmt_readers(s.body, out)
            continue
        for name in reads(s):
            out.setdefault(name, []).append(s)
    return out


def fold_accumulator(stmts, k: int, readers: dict, sh):
    """For the zero-started dot `stmts[k]`: (index of `R = f(acc)`, the `acc = R + X` Assign)
    when the rewrite described above applies, else None."""
    d = stmts[k]
    x = d.name
    users = [u for u in readers.get(x, []) if u is not d]  # (the dot reads its own zero start)
    if len(users) != 1 or not isinstance(users[0], Assign):
        return None
    a = users[0]
    pos = next((i for i in range(k + 1, len(stmts)) if stmts[i] is a), None)
    v = a.value
    if pos is None or not (isinstance(v, Binary) and v.op == "add"):
        return None
    if isinstance(v.b, Var) and v.b.name == x and isinstance(v.a, Var):
        r = v.a.name
    elif isinstance(v.a, Var) and v.a.name == x and isinstance(v.b, Var):
        r = v.b.name
    else:
        return None
    acc = a.name
    j = next((i for i in range(k - 1, -1, -1) if isinstance(stmts[i], Let) and stmts[i].name == r), None)
    if j is None or len(readers.get(r, [])) != 1 or r == acc:
        return None
    shape = sh.shape.get(acc)
    if not (shape == sh.shape.get(r) == sh.shape.get(x)) or any(sh.dtype.get(n) != dt.float32 for n in (acc, r, x)):
        return None
    if d.input_dtype not in (None, dt.float32):
        return None
    for t in stmts[j + 1:pos]:  # nothing between reads or changes acc (the dot included)
        if acc in reads(t) or acc in stmt_written(t) or r in stmt_written(t):
            return None
    return j, a


@dataclass(frozen=True)
class InPlace:
    """A tile load a dot reads where it lies: rows `ld` apart (`transposed`: the tile's
    columns are, its rows contiguous: a `b` the dot takes by columns, `tf_dot_nt`). A `mask`
    is the same in every lane (a gather's index check): where it fails, the dot reads zeros."""

    load: LoadTile
    ld: int
    transposed: bool = False
    #: the load's offset with the lane-dependent values it names spelt out (`Lanes.inline`)
    offset: object = None


def inplace_operands(kernel, sh, lanes, readers: dict) -> dict:
    """name -> `InPlace` of the tile loads a dot may read in place: fp32, of a buffer the
    kernel does not write, at an offset affine in the lanes (`lanes.Lanes.strides`: index
    arithmetic plus values equal in every lane, such as a gathered row's base), unmasked or
    under a mask equal in every lane with zeros in its place."""
    stored = set()
    assigned = set()
    loads = []
    path: dict[int, tuple] = {}  # id(statement) -> the loops around it, outermost first

    def walk(stmts, loops):
        for s in stmts:
            path[id(s)] = loops
            if isinstance(s, For):
                walk(s.body, loops + (id(s),))
            elif isinstance(s, StoreTile):
                stored.add(s.buffer)
            elif isinstance(s, Assign):
                assigned.add(s.name)
            elif isinstance(s, LoadTile):
                loads.append(s)

    walk(kernel.body, ())
    out = {}
    for s in loads:
        if s.dtype != dt.float32 or s.buffer in stored or s.name in sh.aranges:
            continue
        if s.mask is not None and not (s.other == 0 and lanes.lane_free(s.mask)):
            continue
        users = readers.get(s.name, [])
        here = path[id(s)]
        if not users or not all(isinstance(u, DotTile) and u.input_dtype in (None, dt.float32)
                                and s.name not in reads_acc(u) and path[id(u)][:len(here)] == here for u in users):
            continue  # (a dot in the load's block or a loop inside it: the offset still means the same)
        if any(n in assigned for n in reads(s)):
            continue
        st = lanes.strides(s.offset)
        if st is None or not (st[0].is_Integer and st[1].is_Integer):
            continue
        rows, cols = sh.shape[s.name]
        si, sj = int(st[0]), int(st[1])
        if sj == 1 and (si > 0 or rows == 1):
            found = InPlace(s, si if rows > 1 else cols, offset=lanes.inline(s.offset))
        elif si == 1 and sj > 0 and rows > 1 and cols > 1:
            found = InPlace(s, sj, transposed=True, offset=lanes.inline(s.offset))
        else:
            continue
        if s.mask is not None and zeros_extent(found.transposed, found.ld, rows, cols) > MAX_ZEROS:
            continue  # (the tile of zeros read where the mask fails would be larger than worth it)
        plain = not found.transposed and s.mask is None and isinstance(s.offset, Index)
        # (anything else is read in place or not at all: its copy would lose the mask, and a
        # transposed tile needs the by-columns dot)
        if plain or all(_takes_in_place(u, s.name, found, sh) for u in users):
            out[s.name] = found
    return out


#: the most floats of the static tile of zeros a masked operand read in place falls back to
MAX_ZEROS = 1 << 16


def zeros_extent(transposed: bool, ld: int, rows: int, cols: int) -> int:
    """The floats a (rows, cols) tile read in place spans, its rows (or, `transposed`, its
    columns) `ld` apart: what its tile of zeros must cover."""
    return (cols - 1) * ld + rows if transposed else (rows - 1) * ld + cols


def _takes_in_place(d: DotTile, name: str, found: InPlace, sh) -> bool:
    (m, n) = sh.shape[d.name]
    k = sh.of(d.a)[1]
    if sh.dtype[d.name] != dt.float32:
        return False
    if found.transposed:
        return isinstance(d.b, Var) and d.b.name == name and not (isinstance(d.a, Var) and d.a.name == name) \
            and m <= NT_MAX_ROWS and sh.shape.get(name) == (k, n)
    shape_a, shape_b = (m, k), (k, n)
    uses = [shape_a] if isinstance(d.a, Var) and d.a.name == name else []
    uses += [shape_b] if isinstance(d.b, Var) and d.b.name == name else []
    return bool(uses) and register_block(m, n) is not None and all(sh.shape.get(name) == u for u in uses)


def reads_acc(d: DotTile) -> set:
    from ...tile.ir import expr_names

    return expr_names(d.acc) if d.acc is not None else set()
