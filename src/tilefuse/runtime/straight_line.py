"""A compiled graph's call for one set of sizes, generated as straight-line Python.

The general call (`CompiledGraph._run`) looks up, for every step, what it worked out for these
sizes (layouts, size arguments, grid), and each launcher builds its argument list and finds its
binary: about 15 µs of host time per kernel on an H200's host, more than most kernels of a
small model take on the GPU. So the second call of a set of sizes (a first one may never come
again) runs the general way and generates a function for those sizes, as Inductor's
generated wrapper is one: every
allocation with its shape and strides written out, every launch a direct call of what its
launcher answered (`backends.inline_call`: a Triton binary's own launcher with the sizes,
strides and grid in place, a C++ kernel's function with its sizes packed — through the fast
call where it was built (`backends.cpu.fast_call`) —, the library product with its views'
integers bound), every ATen call written out with its sizes as integers, every buffer dropped
after its last use, the outputs returned; dead buffers' memory goes to later buffers of as
many bytes of the same type (reinterpreted in their own layout).
`TILEFUSE_LOGS=runtime` prints each function; `generated_wrapper=False` turns them off.

What a function cannot know in advance, it checks as it goes:
- a buffer it did not allocate (an input, an ATen call's result) must have the strides and
  16-byte alignment its launch was built for; where it has not, that launch goes the general
  way;
- a launch hook (a profiler such as Proton) sends the whole call the general way, as does a
  profiled call or one that records its steps (verify mode): those never reach the function.
A graph whose ATen calls bind sizes (`nonzero`, `.item()`) is not generated: its later
allocations depend on values known only as it runs.
"""
from __future__ import annotations

import functools
import keyword
import math

import sympy
import torch

from .. import logs
from ..backends.inline_call import SKIP, STREAM, Buf, InlineCall
from ..ir.graph import Extern, ExternResult
from ..ir.interpret import output_value
from .allocate import fast_empty
from .aten_matmul import REINTERPRETS_AS_NEW, _reinterpret


def plannable(graph) -> bool:
    """Whether every allocation's sizes are known from the inputs' sizes (no ATen call binds a
    size as the graph runs)."""
    from ..ir.interpret import symbol_sources

    bound = {symbol for _, _, symbol in symbol_sources(graph)}
    for node in graph.nodes.values():
        if isinstance(node, Extern) and node.binds is not None:
            return False
        if isinstance(node, (Extern, ExternResult)):
            for d in node.shape:
                if not sympy.sympify(d).free_symbols <= bound:
                    return False
    return True


class _Source:
    """The function's lines and the values its names refer to."""

    def __init__(self):
        self.lines: list[str] = []
        self.names: dict = {}
        self._ids: dict = {}

    def emit(self, line: str, depth: int = 1) -> None:
        self.lines.append("    " * depth + line)

    def name_of(self, value, prefix: str) -> str:
        """A name in the function's namespace for `value` (one per distinct object)."""
        key = id(value)
        name = self._ids.get(key)
        if name is None:
            name = self._ids[key] = f"{prefix}{len(self.names)}"
            self.names[name] = value
        return name

    def literal(self, value) -> str:
        if value is None or type(value) in (bool, int) or (type(value) is float and math.isfinite(value)):
            return repr(value)
        return self.name_of(value, "v")


def _strides_of(shape: tuple, stride) -> tuple:
    if stride is not None:
        return tuple(stride)
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(out))


def generate(cg, env: dict, records: list):
    """The call of compiled graph `cg` for the sizes `env`, from `records` (per step: what its
    launcher's `inline` answered, None for the general launch or an ATen call). Returns
    `function(args, env, cg) -> outputs | None`, its source in `__tilefuse_source__`; a None
    from it means: run the general way (a check at entry failed, before anything ran). The
    graph is an argument, not part of the function's namespace, so that the graph holding its
    functions is no reference cycle."""
    src = _Source()
    inlined = [r for r in records if isinstance(r, InlineCall)]
    guards = _unique(r.guard for r in inlined)
    setups = _unique(r.setup for r in inlined)
    streams = _unique(r.stream for r in inlined)
    allocations = _allocations(cg, env)
    reuse = _reuse(cg, allocations)
    runs = _plan_runs(cg, records, allocations, reuse)
    if guards:
        src.emit("if not (" + " and ".join(f"{src.name_of(g, 'g')}()" for g in guards) + "):")
        src.emit("return None", 2)
    for s in setups:
        src.emit(f"{src.name_of(s, 'g')}()")
    stream_names = {}
    for k, s in enumerate(streams):
        stream_names[id(s)] = f"stream{k}"
        src.emit(f"stream{k} = {src.name_of(s, 'g')}()")
    src.emit("b = dict(constants)")
    src.names["constants"] = cg.constants
    for name, position, scalar in cg.input_slots:
        value = f"cg._on_device(args[{position}])" if scalar else f"args[{position}]"
        src.emit(f"b[{name!r}] = {value}")
    for name, target in cg.in_place.items():
        src.emit(f"b[{name!r}] = b[{target!r}]")
    src.names.update(empty_strided=torch.empty_strided, device=cg.device, Tensor=torch.Tensor,
                     num_threads=torch.get_num_threads, reinterpret=_reinterpret)
    empty = fast_empty(cg.device)
    if empty is not None:
        src.names["empty"] = empty

    def allocation(shape, strides, dtype) -> str:
        if empty is not None:
            return f"empty({shape!r}, {strides!r}, {src.name_of(dtype, 'd')})"
        return f"empty_strided({shape!r}, {strides!r}, dtype={src.name_of(dtype, 'd')}, device=device)"

    reused = set(reuse.values())  # popped where their memory is taken, not where they die
    layouts: dict = {}  # name -> strides, of what this function allocates
    for k, step in enumerate(cg.steps):
        record = records[k]
        run = runs.get(k)
        if run is not None and k == run.first and run.arena_bytes:
            src.emit(f"arena = {allocation((run.arena_bytes,), (1,), torch.uint8)}  "
                     f"# {len(run.internal)} buffers of the run below")
            src.emit("a = arena.data_ptr()")
        elif run is not None and k == run.first:
            src.emit("a = 0  # (no buffer of the run below lies in an arena)")
        if hasattr(step, "launch"):
            for name in step.writes:
                if run is not None and name in run.internal:
                    layouts[name] = allocations[name][1]
                    continue
                if name not in cg.inputs:
                    shape, strides, dtype = allocations[name]
                    layouts[name] = strides
                    if name in reuse:
                        old = reuse[name]
                        taken = f"b.pop({old!r})"
                        if allocations[old][:2] != (shape, strides):  # the same bytes, another layout
                            taken = f"reinterpret({taken}, {shape!r}, {strides!r}, 0)"
                        src.emit(f"b[{name!r}] = {taken}  # {step.name}: {old}'s memory")
                        continue
                    src.emit(f"b[{name!r}] = {allocation(shape, strides, dtype)}  # {step.name}")
            general = f"{src.name_of(step.launch, 'launch')}(b, env)"
            if record is SKIP:
                src.emit(f"# {step.name}: nothing to compute for these sizes")
            elif run is not None:
                run.add(src, record)
            elif isinstance(record, InlineCall):
                checks = _checks(record, layouts, cg.constants)
                call = _direct_call(record, src) or \
                    f"{src.name_of(record.call, 'f')}({', '.join(_argument(a, src, stream_names, record) for a in record.args)})"
                if checks:
                    src.emit(f"if {' and '.join(checks)}:")
                    src.emit(f"{call}  # {record.label or step.name}", 2)
                    src.emit("else:")
                    src.emit(general, 2)
                else:
                    src.emit(f"{call}  # {record.label or step.name}")
            else:
                src.emit(f"{general}  # {step.name}")
        elif not _emit_extern(src, cg, step, env):
            src.emit(f"cg._extern({src.name_of(step, 'step')}, b, env)  # {step.name}")
        if run is not None:  # a run's buffers live until it has run (their memory is not reused)
            run.dead.extend(name for name in cg.free_after[k] if name not in reused and name not in run.internal)
            if k == run.last:
                run.emit(src)
                if run.arena_bytes:
                    src.emit("del arena")
                for name in run.dead:
                    src.emit(f"b.pop({name!r}, None)")
            continue
        for name in cg.free_after[k]:
            if name not in reused:
                src.emit(f"b.pop({name!r}, None)")
    outputs = []
    for out in cg.graph.outputs:
        if isinstance(out, str):
            outputs.append(f"b[{out!r}]")
        elif isinstance(out, sympy.Basic):
            outputs.append(f"{src.name_of(functools.partial(output_value, out, {}), 'out')}(env)")
        else:
            outputs.append(src.literal(out))
    src.emit(f"return [{', '.join(outputs)}]")
    text = "def call(args, env, cg):\n" + "\n".join(src.lines) + "\n"
    namespace = dict(src.names)
    exec(compile(text, f"<tilefuse call {cg.graph.name}>", "exec"), namespace)  # noqa: S102 - our own source
    logs.log("runtime", "%s: generated call for sizes %s:\n%s", cg.graph.name, dict(_named(env)), text)
    call = namespace["call"]
    call.__tilefuse_source__ = text
    return call


def _direct_call(record: InlineCall, src: _Source) -> str | None:
    """A C++ kernel's launch as one call of the fast call (`backends.cpu.fast_call`) with its
    buffers' pointers, where the launch offers it (`direct`); None: call the launch."""
    direct = getattr(record.call, "direct", None)
    found = direct() if direct is not None else None
    if found is None or not all(isinstance(a, Buf) for a in record.args):
        return None
    fn, leading, programs = found
    src.name_of(record.call, "keep")  # (holds the arrays whose addresses are written out)
    threads = "1" if programs <= 1 else f"min(num_threads(), {int(programs)})"
    pointers = [f"b[{a.name!r}].data_ptr()" for a in record.args]
    return f"{src.name_of(fn, 'launch')}({', '.join([*map(str, leading), threads, *pointers])})"


def _emit_extern(src: _Source, cg, step, env: dict) -> bool:
    """An ATen call written out (False: it goes the general way, `CompiledGraph._extern`): the
    op's binding the general calls settled on, its buffers by name and every size as the
    integer it is for these sizes — what `PreparedExtern` resolves at each call, resolved once.
    A result whose strides are not the ones its readers were compiled for is conformed."""
    prepared = cg.externs.get(step.name)
    node = cg.graph.nodes.get(step.name)
    if prepared is None or not isinstance(node, Extern) or node.binds is not None:
        return False
    if not all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in node.kwargs):
        return False
    try:
        args = [_extern_arg(a, src, env) for a in node.args]
        kwargs = [f"{k}={_extern_arg(v, src, env)}" for k, v in node.kwargs.items()]
    except (KeyError, TypeError, ValueError):  # a size these sizes do not fix
        return False
    # (the binding without `PreparedExtern`'s fallback to the overload: the general calls that
    # ran before this function was generated have settled which one parses these arguments)
    src.emit(f"r = {src.name_of(prepared._call, 'f')}({', '.join(args + kwargs)})  # {step.name}")
    _emit_conformed(src, cg, node.name, "r", env)
    for name, item in cg.extern_results.get(node.name, ()):
        _emit_conformed(src, cg, name, f"r[{item!r}]", env)
    return True


def _emit_conformed(src: _Source, cg, name: str, value: str, env: dict) -> None:
    promised = cg.promised_layout(name, env)
    if promised is None:
        src.emit(f"b[{name!r}] = {value}")
        return
    src.emit(f"v = {value}")
    src.emit(f"b[{name!r}] = v if not isinstance(v, Tensor) or v.stride() == {tuple(promised)!r} "
             f"else cg._conform({name!r}, v, env)")


def _extern_arg(obj, src: _Source, env: dict) -> str:
    """An extern argument as an expression of the generated call."""
    from ..ir.graph import TensorArg
    from ..ir.symbolic import evaluate

    if isinstance(obj, TensorArg):
        return f"b[{obj.name!r}]"
    if isinstance(obj, sympy.Basic):
        value = evaluate(obj, env)
        if type(value) not in (int, float, bool):
            raise TypeError(f"{obj} is not a number for these sizes")
        return src.literal(value)
    if isinstance(obj, list):
        return "[" + ", ".join(_extern_arg(x, src, env) for x in obj) + "]"
    if isinstance(obj, tuple):
        items = [_extern_arg(x, src, env) for x in obj]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(obj, dict):
        if not all(type(k) is str for k in obj):
            raise TypeError("a dict argument keyed by other than strings")
        return "{" + ", ".join(f"{k!r}: {_extern_arg(v, src, env)}" for k, v in obj.items()) + "}"
    return src.literal(obj)


def _allocations(cg, env: dict) -> dict:
    """name -> (shape, strides, torch dtype) of every buffer the call allocates."""
    out = {}
    for step in cg.steps:
        if hasattr(step, "launch"):
            for name in step.writes:
                if name not in cg.inputs:
                    shape, stride, dtype = cg._layout(name, env)
                    out[name] = (shape, _strides_of(shape, stride), dtype)
    return out


def _reuse(cg, allocations: dict) -> dict:
    """new buffer -> a dead buffer of the same dtype and the same number of bytes whose memory
    it takes (in its own shape and strides where those differ), as Inductor's wrapper
    reuses buffers: an allocation saved per pair. Only buffers this call allocated and no ATen
    call read (its result may be a view of them) are reused. The memory is taken as a tensor of
    its own (Inductor's `reinterpret_tensor`); where PyTorch has no such call it would be a view
    (which could reach the caller as an output: autograd refuses in-place writes to a view made
    inside a custom function's forward), and then only a buffer of the same layout is reused."""
    seen_by_aten = {name for step in cg.steps if not hasattr(step, "launch") for name in step.reads}
    dead: dict = {}  # (bytes, dtype) -> buffers dead and not yet taken, in the order they died
    reuse = {}
    for k, step in enumerate(cg.steps):
        if hasattr(step, "launch"):
            for name in step.writes:
                if name in allocations:
                    spare = dead.get(_footprint(allocations[name]))
                    same = [s for s in spare or () if allocations[s] == allocations[name]]
                    if same or (spare and REINTERPRETS_AS_NEW):  # (the same layout first)
                        reuse[name] = same[-1] if same else spare[-1]
                        spare.remove(reuse[name])
        for name in cg.free_after[k]:
            if name in allocations and name not in seen_by_aten:
                dead.setdefault(_footprint(allocations[name]), []).append(name)
    return reuse


def _footprint(allocation) -> tuple:
    """(bytes an allocation spans, dtype): a buffer of another layout over as many bytes of the
    same type can take its memory."""
    shape, strides, dtype = allocation
    span = 0 if any(int(n) == 0 for n in shape) else 1 + sum((int(n) - 1) * int(st) for n, st in zip(shape, strides))
    return span * dtype.itemsize, dtype


def _named(env: dict):
    return ((k, v) for k, v in env.items() if isinstance(k, str))


def _unique(values) -> list:
    seen, out = set(), []
    for v in values:
        if v is not None and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def _argument(a, src: _Source, stream_names: dict, record: InlineCall) -> str:
    if isinstance(a, Buf):
        return f"b[{a.name!r}]"
    if a is STREAM:
        return stream_names[id(record.stream)]
    return src.literal(a)


def _checks(record: InlineCall, layouts: dict, constants: dict) -> list:
    """The conditions under which `record`'s call is valid, for the buffers this function
    cannot vouch for."""
    checks = []
    for name, expect in record.expects.items():
        if name in layouts:  # allocated here: its strides are written out, its base aligned
            if expect.strides is None or tuple(expect.strides) == layouts[name]:
                continue
        elif name in constants:  # the same tensor every call
            continue
        if expect.strides is not None:
            checks.append(f"b[{name!r}].stride() == {tuple(expect.strides)!r}")
        if expect.aligned:
            checks.append(f"b[{name!r}].data_ptr() % 16 == 0")
    return checks


#: most bytes of buffers a run of kernels keeps alive past their last use (they die at its end)
RUN_HELD_MAX_BYTES = 4 << 20


class _Run:
    """Consecutive C++ kernels launched by one `fast_call.run_steps` call: each launch adds its
    step and takes its buffers' pointers where it stands (a buffer may die or lend its memory
    to a later one before the run ends); the call comes after the last, then the buffers that
    died within it are dropped."""

    def __init__(self, runner, first: int, last: int):
        self.runner, self.first, self.last = runner, first, last
        self.internal: dict = {}  # buffer only the run's kernels use -> its offset in the run's arena
        self.arena_bytes = 0
        self.steps: list = []  # (its launch's `RunStep`, its first slot, its pointer count)
        self.slots: list = []
        self.pointers: dict = {}  # buffer name -> its position among the call's pointers
        self.dead: list = []
        self.labels: list = []

    def add(self, src: _Source, record: InlineCall) -> None:
        step = record.call.step()
        src.name_of(record.call, "keep")  # (holds the arrays whose addresses are in the steps)
        first = len(self.slots)
        for a in record.args:
            position = self.pointers.get(a.name)
            if position is None:
                position = self.pointers[a.name] = len(self.pointers)
                if a.name in self.internal:
                    offset = self.internal[a.name]
                    src.emit(f"p{position} = a + {offset}" if offset else f"p{position} = a")
                else:
                    src.emit(f"p{position} = b[{a.name!r}].data_ptr()")
            self.slots.append(position)
        self.steps.append((step, first, len(record.args)))
        self.labels.append(record.label)

    def emit(self, src: _Source) -> None:
        """The run's call. Its threads are woken once: where any kernel would spread over
        threads on its own, or all of them together touch more than a serial kernel may
        (`SERIAL_MAX_BYTES`), every kernel of more than one program shares its programs out
        (the barrier after each is paid either way); else the run stays on the calling thread."""
        import ctypes

        from ..backends.cpu.fast_call import Step
        from ..backends.cpu.launcher import SERIAL_MAX_BYTES

        threaded = any(step.threaded for step, _, _ in self.steps) or \
            sum(step.nbytes for step, _, _ in self.steps) > SERIAL_MAX_BYTES
        table = (Step * len(self.steps))(*[
            Step(step.fn, step.sizes, step.grid, step.programs, threaded and step.programs > 1, first, count, 0)
            for step, first, count in self.steps])
        slots = (ctypes.c_int64 * len(self.slots))(*self.slots)
        src.name_of(table, "keep")
        src.name_of(slots, "keep")
        widest = max((step.programs for step, _, _ in self.steps), default=1) if threaded else 1
        threads = "1" if widest <= 1 else f"min(num_threads(), {int(widest)})"
        pointers = ", ".join(f"p{k}" for k in range(len(self.pointers)))
        src.emit(f"{src.name_of(self.runner, 'run')}({ctypes.addressof(table)}, {len(self.steps)}, "
                 f"{ctypes.addressof(slots)}, {threads}, {pointers})  # {', '.join(self.labels)}")


def _plan_runs(cg, records: list, allocations: dict, reuse: dict) -> dict:
    """step index -> its `_Run`, for the runs of at least two consecutive C++ launches that can
    be steps (`_InlineLaunch.step`); an ATen call, a kernel that launches another way, a launch
    with a check (a buffer's strides read at run time: a failed check sends only that launch
    the general way, as outside runs) or the run's limits (pointers, slots, bytes held past
    their last use) end a run."""
    from ..backends.cpu.fast_call import MAX_POINTERS, MAX_SLOTS, steps_runner

    if not getattr(cg, "kernel_runs", True):
        return {}
    runner = steps_runner() if any(_step_of(r) is not None for r in records) else None
    if runner is None:
        return {}
    layouts = {name: allocation[1] for name, allocation in allocations.items()}
    users: dict = {}  # buffer -> the steps that read or write it
    for k, step in enumerate(cg.steps):
        for name in (*getattr(step, "writes", ()), *step.reads):
            users.setdefault(name, set()).add(k)
    runs: dict = {}
    current: list = []  # step indices of the run being gathered
    state = {"names": set(), "slots": 0, "held": 0, "launches": 0}

    def close():
        if state["launches"] >= 2:
            run = _Run(runner, current[0], current[-1])
            _place_internal(run, cg, current, allocations, reuse, users)
            for k in current:
                runs[k] = run
        current.clear()
        state.update(names=set(), slots=0, held=0, launches=0)

    for k, step in enumerate(cg.steps):
        record = records[k]
        if hasattr(step, "launch") and record is SKIP:
            if current:
                current.append(k)
            continue
        found = _step_of(record) if hasattr(step, "launch") else None
        if found is None or _checks(record, layouts, cg.constants):
            close()
            continue
        names = {a.name for a in record.args}
        if (len(state["names"] | names) > MAX_POINTERS or state["slots"] + len(record.args) > MAX_SLOTS):
            close()
        current.append(k)
        state["names"] |= names
        state["slots"] += len(record.args)
        state["launches"] += 1
        state["held"] += sum(_bytes(allocations[name]) for name in cg.free_after[k] if name in allocations)
        if state["held"] > RUN_HELD_MAX_BYTES:
            close()
    close()
    return runs


#: most bytes of one run's arena (`_place_internal`)
RUN_ARENA_MAX_BYTES = 4 << 20
#: an arena's buffers start at multiples of this (the allocator's own alignment)
ARENA_ALIGN = 64


def _place_internal(run: _Run, cg, steps: list, allocations: dict, reuse: dict, users: dict) -> None:
    """The buffers only the run's kernels use (allocated here, no output, no memory lent or
    borrowed) go into one allocation for the run, the arena, each at its own offset: one
    allocation per run instead of one per buffer, and no tensor object for them at all."""
    inside = set(steps)
    shared = set(reuse) | set(reuse.values()) | set(cg.in_place) | set(cg.in_place.values())
    outputs = {out for out in cg.graph.outputs if isinstance(out, str)}
    offset = 0
    for k in steps:
        for name in getattr(cg.steps[k], "writes", ()):
            if (name in run.internal or name not in allocations or name in shared or name in outputs
                    or not users.get(name, set()) <= inside):
                continue
            size = -(-_bytes(allocations[name]) // ARENA_ALIGN) * ARENA_ALIGN
            if size == 0 or offset + size > RUN_ARENA_MAX_BYTES:  # (an empty buffer keeps its own)
                continue
            run.internal[name] = offset
            offset += size
    run.arena_bytes = offset


def _step_of(record):
    """What `record`'s launch offers as a step of a run (`_InlineLaunch.step`), or None."""
    if not isinstance(record, InlineCall) or not all(isinstance(a, Buf) for a in record.args):
        return None
    step = getattr(record.call, "step", None)
    return step() if step is not None else None


def _bytes(allocation) -> int:
    return _footprint(allocation)[0]


__all__ = ["generate", "plannable"]
