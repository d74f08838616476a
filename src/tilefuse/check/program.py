"""Random test programs for the differential fuzzer: a straight-line PyTorch function held as
source lines, with the inputs it takes.

A `Program` is plain data — input specs (shape, layout, dtype), statements `vK = <expr>` over
`torch` and `F`, output names, whether to compile with `dynamic=True` — so it can be run, shrunk
statement by statement and written out as a standalone script. `generate(rng)` builds one by
proposing random statements (pointwise, reductions, views, matmuls, cat, and dependent
reductions such as softmax, log-softmax, layer norm, RMSNorm, logsumexp and attention-like
chains) and keeping those that run on sample values: shapes are checked by PyTorch itself.
Programs run in float32, bfloat16 or float64, with rounding round trips (`x.half().to(x.dtype)`);
a statement may sit in an autocast region (`with torch.autocast("cpu", dtype=...): vK = <expr>`:
its product's operands are rounded to bf16/fp16).
"""
from __future__ import annotations

import random
import re
import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

SIZES = (1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33, 64, 65)
LAYOUTS = ("contiguous", "transposed", "strided")


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple
    layout: str = "contiguous"  # "transposed": a transposed view; "strided": every other column

    def source(self, dtype: str) -> str:
        """Python that builds this input from the generator `g` (for scripts and `make_inputs`)."""
        shape = list(self.shape)
        if self.layout == "transposed" and len(shape) >= 2:
            base = shape[:-2] + [shape[-1], shape[-2]]
            return f"torch.randn({base}, generator=g).to({dtype}).transpose(-1, -2)"
        if self.layout == "strided" and shape:
            base = shape[:-1] + [2 * shape[-1]]
            return f"torch.randn({base}, generator=g).to({dtype})[..., ::2]"
        return f"torch.randn({shape}, generator=g).to({dtype})"


@dataclass(frozen=True)
class Program:
    inputs: tuple  # InputSpec
    lines: tuple  # "vK = expr"
    outputs: tuple  # names
    dtype: str = "torch.float32"
    dynamic: bool = False

    @property
    def size(self) -> int:
        return len(self.lines)

    def function_source(self, name: str = "program") -> str:
        args = ", ".join(i.name for i in self.inputs)
        body = [f"    {line}" for line in self.lines] or ["    pass"]
        outs = ", ".join(self.outputs)
        return f"def {name}({args}):\n" + "\n".join(body) + f"\n    return ({outs},)\n"

    def inputs_source(self) -> str:
        items = ",\n        ".join(i.source(self.dtype) for i in self.inputs)
        return f"[\n        {items},\n    ]"

    def function(self):
        namespace = {"torch": torch, "F": F}
        exec(compile(self.function_source(), "<tilefuse-fuzz>", "exec"), namespace)
        return namespace["program"]

    def make_inputs(self, seed: int = 0) -> list:
        g = torch.Generator().manual_seed(seed)
        return eval(self.inputs_source(), {"torch": torch, "g": g})

    def with_(self, **changes) -> "Program":
        return replace(self, **changes)


# ------------------------------------------------------------------------------ generation

UNARY = ("torch.tanh({a})", "torch.sigmoid({a})", "torch.relu({a})", "-{a}", "{a}.abs()", "torch.sin({a})",
         "torch.exp({a}.clamp(max=8))", "torch.sqrt({a}.abs() + 1)", "torch.log({a}.abs() + 1)", "F.gelu({a})",
         "F.silu({a})", "{a} * {c}", "{a} + {c}", "torch.clamp({a}, -1.5, 2.0)", "torch.rsqrt({a} * {a} + 0.5)",
         "{a}.bfloat16().to({a}.dtype)", "{a}.half().to({a}.dtype)", "{a}.float().to({a}.dtype)")
BINARY = ("{a} + {b}", "{a} - {b}", "{a} * {b}", "torch.maximum({a}, {b})", "{a} / ({b}.abs() + 1)",
          "torch.where({a} > {b}, {a}, {b} * 2)")
REDUCE = ("{a}.sum({d}, keepdim={k})", "{a}.mean({d}, keepdim={k})", "{a}.amax({d}, keepdim={k})",
          "{a}.amin({d}, keepdim={k})", "{a}.var({d}, keepdim={k})", "{a}.sum()")
DEPENDENT = ("torch.softmax({a}, {d})", "torch.log_softmax({a}, {d})",
             "{a} - torch.logsumexp({a}, {d}, keepdim=True)", "F.layer_norm({a}, ({a}.shape[-1],))",
             "{a} * torch.rsqrt({a}.pow(2).mean(-1, keepdim=True) + 1e-6)",
             "({a} - {a}.mean({d}, keepdim=True)) / ({a}.var({d}, keepdim=True) + 1e-5).sqrt()",
             "torch.softmax({a} * 0.5, -1) @ {b}", "torch.softmax({a} @ {b}.transpose(-1, -2), -1)")
VIEW = ("{a}.transpose(-1, -2)", "{a}.permute({perm})", "{a}.reshape(-1, {a}.shape[-1])", "{a}.flatten()",
        "{a}.unsqueeze(0).expand(3, *{a}.shape)", "{a}[..., ::2]", "{a}[1:]", "{a}.flip(-1)",
        "{a}.narrow(-1, 1, {a}.shape[-1] - 1)", "{a}.unsqueeze(-1)", "{a}.squeeze()")
MATMUL = ("{a} @ {b}", "torch.matmul({a}, {b}.transpose(-1, -2))", "{a}.bfloat16().to({a}.dtype) @ {b}")
CAT = ("torch.cat([{a}, {b}], {d})",)
#: statements run in an autocast region: the products (and their neighbours) autocast rounds
AUTOCAST = MATMUL + ("F.linear({a}, {b})", "F.linear({a}, {b}, {b}[:, 0])", "torch.bmm({a}, {b}.transpose(-1, -2))",
                     "torch.softmax({a} @ {b}, -1)")
FAMILIES = (("unary", UNARY, 3), ("binary", BINARY, 3), ("reduce", REDUCE, 2), ("dependent", DEPENDENT, 2),
            ("view", VIEW, 2), ("matmul", MATMUL, 1), ("cat", CAT, 1), ("autocast", AUTOCAST, 1))
AUTOCAST_DTYPES = ("torch.bfloat16", "torch.float16")
DTYPES = ("torch.float32", "torch.bfloat16", "torch.float64")
MAX_NUMEL = 4096


def autocast_region(dtype: str) -> str:
    """The prefix that puts a statement in an autocast region of `dtype`."""
    return f'with torch.autocast("cpu", dtype={dtype}): '


def statement_name(line: str) -> str:
    """The name a statement defines (`vK`), inside an autocast region or not."""
    return line.split(" = ", 1)[0].split()[-1]


def without_region(line: str) -> str:
    """The statement outside any autocast region."""
    return line.split(": ", 1)[1] if line.startswith("with ") else line


def _random_shape(rng: random.Random, rank: int) -> tuple:
    while True:
        shape = tuple(rng.choice(SIZES) for _ in range(rank))
        n = 1
        for d in shape:
            n *= d
        if n <= 2048:
            return shape


def _fill(rng: random.Random, template: str, env: dict, names: list) -> str:
    r = rng.random()
    a = names[-1] if r < 0.5 else rng.choice(names[-4:] if r < 0.8 else names)
    nd = env[a].dim()
    others = [n for n in names if n != a]
    b = rng.choice(others) if others and rng.random() < 0.85 else a
    perm = list(range(nd))
    rng.shuffle(perm)
    return template.format(a=a, b=b, c=rng.choice((0.5, 2.0, -1.25, 3.0)), d=rng.randrange(-nd, nd) if nd else 0,
                           k=rng.random() < 0.5, perm=", ".join(map(str, perm)) or "")


def _runs(line: str, env: dict):
    namespace = {"torch": torch, "F": F, **env}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(line, namespace)
    except Exception:  # noqa: BLE001 - a proposal PyTorch rejects is simply not kept
        return None
    value = namespace.get(statement_name(line))
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return None
    if value.numel() == 0 or value.numel() > MAX_NUMEL or value.dim() > 4:
        return None
    if value.dim() == 0 and ".sum()" not in line:  # scalars only from full reductions
        return None
    return value


def generate(rng: random.Random, max_ops: int = 6) -> Program:
    """A random program of 1..`max_ops` statements over 1..3 inputs."""
    n_inputs = rng.randint(1, 3)
    base = _random_shape(rng, rng.randint(1, 3))
    inputs = []
    for k in range(n_inputs):
        if k == 0 or rng.random() < 0.4:
            shape = base
        elif rng.random() < 0.5:  # broadcasts against the first input
            shape = tuple(1 if rng.random() < 0.4 else d for d in base[rng.randint(0, len(base) - 1):])
        else:
            shape = _random_shape(rng, rng.randint(1, 3))
        layout = rng.choice(LAYOUTS) if rng.random() < 0.35 else "contiguous"
        if layout == "transposed" and len(shape) < 2:
            layout = "strided"
        inputs.append(InputSpec(f"x{k}", tuple(shape), layout))
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    env = {}
    for spec in inputs:
        env[spec.name] = eval(spec.source("torch.float32"), {"torch": torch, "g": g})
    names = [s.name for s in inputs]
    lines: list[str] = []
    target = rng.randint(1, max_ops)
    weights = [w for _, _, w in FAMILIES]
    attempts = 0
    while len(lines) < target and attempts < 40 * target:
        attempts += 1
        family, templates, _ = rng.choices(FAMILIES, weights)[0]
        name = f"v{len(lines)}"
        line = f"{name} = " + _fill(rng, rng.choice(templates), env, names)
        if family == "autocast":
            line = autocast_region(rng.choice(AUTOCAST_DTYPES)) + line
        value = _runs(line, env)
        if value is None:
            continue
        lines.append(line)
        env[name] = value
        names.append(name)
    if not lines:
        lines.append(f"v0 = {inputs[0].name} * 2")
        names.append("v0")
    used = set().union(*(used_names(line) for line in lines))
    leaves = [statement_name(line) for line in lines if statement_name(line) not in used]
    program = Program(tuple(inputs), tuple(lines), tuple(leaves[-3:]),
                      dtype=rng.choice(DTYPES), dynamic=rng.random() < 0.3)
    return prune(program)


def used_names(line: str) -> set:
    """Names `vK`/`xK` a statement's right-hand side reads."""
    return set(re.findall(r"\b([vx]\d+)\b", line.split(" = ", 1)[1]))


def prune(program: Program) -> Program:
    """Drop statements and inputs the outputs do not need."""
    live = set(program.outputs)
    kept = []
    for line in reversed(program.lines):
        name = statement_name(line)
        if name in live:
            kept.append(line)
            live |= used_names(line)
    inputs = tuple(i for i in program.inputs if i.name in live)
    return program.with_(lines=tuple(reversed(kept)), inputs=inputs)


__all__ = ["Program", "InputSpec", "generate", "prune", "used_names", "statement_name", "without_region",
           "autocast_region"]
