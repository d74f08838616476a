"""Readable text of tile IR (`TILEFUSE_LOGS=tile`, `explain`)."""
from __future__ import annotations

from ..ir.expr import Index
from ..ir.printer import format_expr
from .ir import (Arange, ArgReduceTile, Assign, BroadcastTile, Check, Comment, DescriptorLoad, DotTile, For, Full, Let,
                 LoadTile, MakeDescriptor, ProgramId, ReduceTile, StoreTile, TileKernel, check_message)


def _stmt(s, pad: str, out: list) -> None:
    if isinstance(s, ProgramId):
        out.append(f"{pad}{s.name} = program_id({s.axis})")
    elif isinstance(s, Arange):
        out.append(f"{pad}{s.name} = {format_expr(s.start)} + range({s.block}) @axis{s.axis}/{s.ndim}")
    elif isinstance(s, (Let, Assign)):
        out.append(f"{pad}{s.name} {'=' if isinstance(s, Let) else '<-'} {format_expr(s.value)}")
    elif isinstance(s, BroadcastTile):
        out.append(f"{pad}{s.name} = broadcast({format_expr(s.value)}, {list(s.shape)})")
    elif isinstance(s, Full):
        out.append(f"{pad}{s.name} = full({list(s.shape)}, {s.value}, {s.dtype})")
    elif isinstance(s, LoadTile):
        mask = f" if {format_expr(s.mask)}" if s.mask is not None else ""
        hint = f" (evict {s.eviction})" if s.eviction else ""
        out.append(f"{pad}{s.name} = load {s.buffer}[{format_expr(s.offset)}]{mask}{hint}")
    elif isinstance(s, StoreTile):
        mask = f" if {format_expr(s.mask)}" if s.mask is not None else ""
        out.append(f"{pad}store {s.buffer}[{format_expr(s.offset)}] = {format_expr(s.value)}{mask}")
    elif isinstance(s, ReduceTile):
        out.append(f"{pad}{s.name} = reduce_{s.combiner}({format_expr(s.value)}, axis={s.axis})")
    elif isinstance(s, ArgReduceTile):
        out.append(f"{pad}{s.name} = {s.combiner}({format_expr(s.value)}, axis={s.axis})")
    elif isinstance(s, DotTile):
        operands = f" in {s.input_dtype.name}" if s.input_dtype is not None else ""
        out.append(f"{pad}{s.name} = dot({format_expr(s.a)}, {format_expr(s.b)}){operands} + {format_expr(s.acc)}")
    elif isinstance(s, MakeDescriptor):
        dims = ", ".join(format_expr(d) for d in s.shape)
        strides = ", ".join(format_expr(d) for d in s.strides)
        out.append(f"{pad}{s.name} = descriptor {s.buffer}[{format_expr(s.base)} + view({dims}) strides ({strides})] "
                   f"blocks {s.block[0]}×{s.block[1]}")
    elif isinstance(s, DescriptorLoad):
        at = ", ".join(format_expr(o) for o in s.offsets)
        out.append(f"{pad}{s.name} = block {s.descriptor}[{at}]{'.T' if s.transpose else ''}")
    elif isinstance(s, For):
        flat = " (flattened with the inner loop)" if s.flatten else ""
        out.append(f"{pad}for {s.var} in range({format_expr(s.start)}, {format_expr(s.stop)}, {s.step}):{flat}")
        for t in s.body:
            _stmt(t, pad + "  ", out)
    elif isinstance(s, Check):
        out.append(f"{pad}check {format_expr(s.ok)} else {s.error}: {check_message(s)}")
    elif isinstance(s, Comment):
        out.append(f"{pad}# {s.text}")


def format_tile_kernel(k: TileKernel) -> str:
    params = ", ".join(p.name for p in k.params)
    blocks = ", ".join(f"{n}={v}" for n, v in k.constexprs.items())
    out = [f"tile kernel {k.name}({params}) grid={tuple(str(g) for g in k.grid)} {blocks} warps={k.num_warps}"]
    for s in k.body:
        _stmt(s, "  ", out)
    if k.variants is not None:
        v = k.variants
        for bound, alt in zip(v.bounds, v.kernels):
            out.append(f"for {format_expr(Index(v.extent))} <= {bound} (chosen at launch):")
            out.append(format_tile_kernel(alt))
    return "\n".join(out)
