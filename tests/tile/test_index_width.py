"""32-bit index arithmetic (`tile.index_width`): a kernel keeps 64-bit program ids unless every
integer its index arithmetic forms — with masked lanes past the last tile, partial sums and
products, values under a modulo — provably stays below 2**31; sizes it cannot bound (dynamic
shapes, integers read from memory, random-number counters) keep the kernel as it was."""
import math
from dataclasses import replace

import sympy
import torch

from lowered_plans import plans_of
from tilefuse.ir import dtypes as dt
from tilefuse.ir.expr import Binary, Index, Var, binary
from tilefuse.tile.common import tile_symbol
from tilefuse.tile.index_width import fits_int32, narrowed
from tilefuse.tile.ir import Arange, For, Let, LoadTile, Param, ProgramId, StoreTile, TileKernel
from tilefuse.tile.lower import lower_plan_kernels
from tilefuse.tile.target import Target

PID, PID_B, RM, RJ, BM, BN = (tile_symbol(n) for n in ("pid", "pid_b", "rm", "rj", "BLOCK_M", "BLOCK_N"))


def _kernel(rows, keys, batch, offset, *, extra=(), block_m=128):
    """One program per block of `rows` and batch element, a loop over `keys`, a load at
    `offset` (an Index over pid_b, rm and rj) inside the loop."""
    loop = For("joffset", Index(sympy.Integer(0)), Index(sympy.Integer(keys)), "BLOCK_N",
               body=[Arange("rj", Index(tile_symbol("joffset")), "BLOCK_N", 1, 2),
                     LoadTile("x", "buf", offset, None, dt.float32), *extra])
    body = [ProgramId("pid", 0, wide=True), ProgramId("pid_b", 1, wide=True),
            Arange("rm", Index(PID * BM), "BLOCK_M", 0, 2), loop,
            StoreTile("out", Index(RM), Var("x", dt.float32), None, dt.float32)]
    return TileKernel("k", [Param("buf", "buffer", dt.float32), Param("out", "buffer", dt.float32)],
                      {"BLOCK_M": block_m, "BLOCK_N": 64}, numel=rows * batch,
                      grid=(sympy.ceiling(rows / BM), batch), body=body)


def test_offsets_below_two_to_the_31_take_32_bit_program_ids():
    offset = Index(RJ + 4096 * RM + 4096 * 4096 * PID_B)
    small = _kernel(4096, 4096, 127, offset)  # largest offset 127·2²⁴ + 2²⁴ - 1
    assert fits_int32(small)
    assert not any(s.wide for s in narrowed(small).body if isinstance(s, ProgramId))
    # 128 batch elements: 2³¹ - 1 at the last element, and the bound (a loop variable at most
    # its stop, 4096, rather than the last tile's start) passes it: kept 64-bit
    big = _kernel(4096, 4096, 128, offset)
    assert not fits_int32(big)
    assert narrowed(big) is big


def test_a_quotient_is_bounded_as_printed_its_numerator_first():
    """`floor((4096·rm + rj)/6144)` prints as `(rj + 4096·rm) // 6144` (the printer's
    `as_numer_denom`): past 2¹⁹ rows the numerator passes 2³¹ though the quotient stays below 2²⁰."""
    offset = Index(sympy.floor((4096 * RM + RJ) / 6144))
    assert not fits_int32(_kernel(2**19 + 1, 64, 1, offset))
    assert fits_int32(_kernel(2**14, 64, 1, offset))


def test_masked_lanes_past_the_last_tile_count():
    # 4000 rows in tiles of 128: the last tile's lanes reach row 4095
    offset = Index(RJ + 530_000 * RM)
    assert 63 + 530_000 * 3999 < 2**31 <= 530_000 * 4095
    assert not fits_int32(_kernel(4000, 64, 1, offset))
    assert fits_int32(_kernel(4000, 64, 1, offset, block_m=32))  # (tiles of 32 rows end at row 3999)


def test_a_modulo_bounds_its_value_but_not_what_it_reads():
    assert fits_int32(_kernel(4096, 4096, 128, Index(RJ + 4096 * RM + 2**24 * sympy.Mod(PID_B, 32))))
    assert not fits_int32(_kernel(4096, 4096, 2**20, Index(sympy.Mod(PID_B * RM, 7))))


def test_sizes_it_cannot_bound_keep_64_bits():
    n = sympy.Symbol("s0", integer=True, positive=True)
    assert not fits_int32(_kernel(64, 64, 1, Index(RJ + n * RM)))
    # an integer read from memory in the offset's arithmetic; the same arithmetic on a value
    # computed from the ranges is bounded
    offset = binary("add", Index(RJ), binary("mul", Var("ix", dt.int32), Index(sympy.Integer(4))))
    k = _kernel(64, 64, 1, offset)
    k.body[3].body.insert(1, LoadTile("ix", "buf", Index(RJ), None, dt.int32))
    assert not fits_int32(k)
    k = _kernel(64, 64, 1, offset)
    k.body[3].body.insert(1, Let("ix", Index(2 * RJ, dt.int32)))
    assert fits_int32(k)
    # counter-based random numbers are left as lowered
    k = _kernel(64, 64, 1, Index(RJ))
    k.body[3].body.append(Let("r", Binary("rand", Index(RJ), Index(RM), dt.float32)))
    assert not fits_int32(k)


def _lowered_flash(shape):
    def attention(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v

    qkv = [torch.empty(*shape, dtype=torch.bfloat16) for _ in range(3)]
    graph, plan, options = next(x for x in plans_of(attention, *qkv) if x[1].kind == "flash")
    return lower_plan_kernels(graph, plan, replace(options, target=Target.gpu(sm_count=132)))


def test_a_long_attention_kernel_indexes_in_32_bits():
    """(4, 32, 4096, 128): the width rule's rows × keys × head dim × batch is 2³⁸, but no offset
    passes 2²⁶ (each operand holds 2²⁶ elements)."""
    (flash,) = _lowered_flash((4, 32, 4096, 128))
    assert [s.wide for s in flash.body if isinstance(s, ProgramId)] == [False, False]
