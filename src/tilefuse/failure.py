"""What went wrong inside tilefuse, said so that a user can act on it.

`describe_failure(err)` reads the exception's traceback to find the compiler stage that raised
(the innermost tilefuse layer on the stack: frontend lowering, passes, fusion, tuning, tile
lowering, code generation, runtime) and the op being worked on there (the FX node a lowering
was called for, the kernel plan or IR node a later stage held). `write_reproducer` saves the
failing ATen graph as a standalone script that recompiles it through tilefuse with
`TILEFUSE_FALLBACK=error`, so the failure can be rerun outside the user's program.

The public API reports every failed compile or run with it, so it sits with the driver, below
the API.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import textwrap
from dataclasses import dataclass

import torch

#: tilefuse module prefix -> stage name (longest prefix wins)
STAGES = {
    "tilefuse.frontend": "lowering to graph IR (frontend)",
    "tilefuse.passes": "graph passes",
    "tilefuse.ir.verify": "graph IR verification",
    "tilefuse.fusion": "fusion planning",
    "tilefuse.tune": "tuning",
    "tilefuse.tile": "tile lowering",
    "tilefuse.backends.triton.codegen": "Triton code generation",
    "tilefuse.backends.triton.helpers": "Triton code generation",
    "tilefuse.backends.triton.launcher": "loading or launching a Triton kernel",
    "tilefuse.backends.cpu": "C++ code generation or build",
    "tilefuse.backends": "code generation",
    "tilefuse.runtime": "runtime",
    "tilefuse.cache": "runtime",  # the disk cache, as the runtime uses it
    "tilefuse.compiler": "compile driver",
}


#: correctness tooling, not a compiler stage: its frames never name the stage
_TOOLING = ("tilefuse.check", "tilefuse.verify_mode", "tilefuse.compare")


@dataclass
class Failure:
    stage: str
    op: str  # what was being compiled or run ("" when unknown)
    error: str

    def __str__(self) -> str:
        where = f" ({self.op})" if self.op else ""
        return f"{self.stage}{where}: {self.error}"


def _stage_of(module: str) -> str | None:
    best = None
    for prefix, stage in STAGES.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, stage)
    return best[1] if best else None


def _frames(err: BaseException):
    tb = err.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _describe_local(name: str, value) -> str | None:
    """A short description of a local variable that names what a stage was working on."""
    if isinstance(value, torch.fx.Node) and value.op == "call_function":
        return f"ATen op {value.target} (FX node {value.name})"
    members = getattr(value, "members", None)
    if name in ("step", "plan") and isinstance(members, list) and hasattr(value, "name"):
        lines = getattr(getattr(value, "origin", None), "lines", ())
        where = f" (from {'; '.join(lines[:2])})" if lines else ""
        return f"kernel {value.name} computing {', '.join(members)}{where}"
    if name in ("tk", "kernel") and hasattr(value, "name") and hasattr(value, "params"):
        return f"tile kernel {value.name}"
    if name == "step" and hasattr(value, "name") and hasattr(value, "reads"):
        return f"kernel {value.name}" if hasattr(value, "launch") else f"extern call {value.name}"
    if name == "node" and hasattr(value, "name") and hasattr(value, "dtype") and hasattr(value, "shape"):
        return f"IR node {value.name}"
    return None


def describe_failure(err: BaseException, phase: str = "compiling") -> Failure:
    """The stage that raised `err` and the op it was working on, from the traceback."""
    stage, op = None, ""
    for frame in _frames(err):
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("tilefuse.") or module.startswith(_TOOLING):
            continue
        s = _stage_of(module)
        if s is not None and (s != "compile driver" or stage is None):
            stage = s
        for name in ("node", "step", "plan", "tk", "kernel"):
            if name in frame.f_locals:
                found = _describe_local(name, frame.f_locals[name])
                if found:
                    op = found
    if stage is None:
        stage = "compile driver" if phase == "compiling" else "runtime"
    if phase == "running" and stage in ("runtime", "compile driver"):
        stage = "running the compiled graph"
    return Failure(stage, op, f"{type(err).__name__}: {err}")


# ------------------------------------------------------------------------------ reproducers


def _hint(x) -> int:
    if isinstance(x, torch.SymInt):
        node = x.node
        hint = getattr(node, "hint", None)
        if hint is not None:
            return int(hint)
        return int(node.shape_env.size_hint(node.expr))
    return int(x)


def _is_symbolic(x) -> bool:
    return isinstance(x, torch.SymInt) and not isinstance(getattr(x.node, "maybe_as_int", lambda: None)(), int)


def _input_spec(placeholder: torch.fx.Node, actual=None):
    """(kind, shape, stride, dtype, value, symbolic) of a graph input, from the real argument
    when given, else from the capture's metadata."""
    val = actual if actual is not None else placeholder.meta.get("val")
    if isinstance(val, torch.Tensor):
        shape = tuple(_hint(d) for d in val.shape)
        stride = tuple(_hint(s) for s in val.stride())
        symbolic = any(_is_symbolic(d) for d in val.shape) if actual is None else False
        return "tensor", shape, stride, val.dtype, None, symbolic
    if isinstance(val, (torch.SymInt, int)):
        return "int", (), (), None, _hint(val), isinstance(val, torch.SymInt)
    if isinstance(val, (torch.SymFloat, float)):
        return "float", (), (), None, float(val), False
    return "none", (), (), None, None, False


def reproducer_source(gm: torch.fx.GraphModule, args=None, title: str = "", knobs: dict | None = None) -> str:
    """A standalone script that recompiles `gm` (an ATen graph) through tilefuse on inputs of
    the same shapes, strides and dtypes (`args`, when given, supplies them), with the knobs
    that were set (`knobs`: name -> value; where logs and caches go is left out)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    specs = [_input_spec(p, args[k] if args is not None and k < len(args) else None)
             for k, p in enumerate(placeholders)]
    dynamic = any(s[5] for s in specs)
    for p in placeholders:  # symbolic sizes of the capture also count
        val = p.meta.get("val")
        if isinstance(val, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in val.shape):
            dynamic = True
    code = gm.graph.python_code(root_module="self").src.strip("\n")
    consts = []
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        value = getattr(gm, n.target, None)
        if isinstance(value, torch.Tensor):
            v = value.detach().cpu()
            if v.numel() <= 256:
                init = f"torch.tensor({v.tolist()!r}, dtype={v.dtype})"
            else:
                init = f"torch.randn({tuple(v.shape)}).to({v.dtype})  # the original constant was too large to inline"
            consts.append(f"        self.register_buffer({n.target!r}, {init})")
    lines = [f'"""tilefuse reproducer{": " + title if title else ""}.', "",
             "Run it with `python <this file>`: it compiles the captured ATen graph through tilefuse",
             'with TILEFUSE_FALLBACK=error, so the failure is raised rather than hidden."""',
             "import math", "import operator", "", "import torch", "from torch import device", "",
             "import tilefuse", "", "inf, nan = float('inf'), float('nan')", "", "",
             "class Repro(torch.nn.Module):", "    def __init__(self):", "        super().__init__()"]
    lines += consts
    lines += [""] + textwrap.indent(code, "    ").splitlines() + ["", ""]
    lines += ["def make(shape, stride, dtype):",
              "    if dtype.is_floating_point or dtype.is_complex:",
              "        data = torch.randn(shape).to(dtype)",
              "    elif dtype == torch.bool:",
              "        data = torch.rand(shape) > 0.5",
              "    else:",
              "        data = torch.zeros(shape, dtype=dtype)  # integer inputs may be indices: zeros are always valid",
              "    return torch.empty_strided(shape, stride, dtype=dtype).copy_(data)", "", "",
              "def main():", "    torch.manual_seed(0)", "    args = ["]
    for kind, shape, stride, dtype, value, _ in specs:
        if kind == "tensor":
            lines.append(f"        make({shape}, {stride}, {dtype}),")
        else:
            lines.append(f"        {value!r},")
    lines += ["    ]",
              f"    with tilefuse.config.patch({_patch_arguments(knobs)}):",
              f"        out = torch.compile(Repro(), backend='tilefuse', fullgraph=True, dynamic={dynamic})(*args)",
              "    print('compiled and ran:', [tuple(o.shape) if isinstance(o, torch.Tensor) else o for o in out])",
              "", "", 'if __name__ == "__main__":', "    main()", ""]
    return "\n".join(lines)


_fallback_dir: tuple[int, str] | None = None  # (pid, path) of this process's private fallback


def repro_dir() -> str:
    """Where reproducers go: `<cache dir>/repro` where the cache's policy allows (the root and
    `repro/` this user's, writable by no one else, `repro/` not a link), else a new private
    directory in the temporary directory (one per process), never a shared one."""
    global _fallback_dir
    from .config import config
    from .cache import trust
    from .cache.admin import root_path, root_problem

    root = root_path(config.cache_dir)
    try:
        if not os.path.lexists(root):
            trust.private_makedirs(root)
    except OSError:
        pass
    if root.is_dir() and root_problem(root) is None:
        path = trust.private_dir(root / "repro")
        if path is not None:
            return path
    if _fallback_dir is None or _fallback_dir[0] != os.getpid() or not os.path.isdir(_fallback_dir[1]):
        _fallback_dir = (os.getpid(), tempfile.mkdtemp(prefix="tilefuse-repro-"))
    return _fallback_dir[1]


def _patch_arguments(knobs: dict | None) -> str:
    kept = {k: v for k, v in (knobs or {}).items()
            if k not in ("cache_dir", "cache_lock_timeout", "cache_max_bytes", "logs", "debug_dir", "fallback")}
    return ", ".join(f"{k}={v!r}" for k, v in {**kept, "fallback": "error"}.items())


def write_reproducer(gm: torch.fx.GraphModule, args=None, title: str = "", name: str = "graph",
                     knobs: dict | None = None) -> str | None:
    """Write `reproducer_source(...)` to a new file in `repro_dir()` and return its path (None
    if that failed too: the report must never itself raise). The file is created exclusively
    and never through a link: an existing file is reused only when it is this user's and holds
    the same script, else the script gets a new name."""
    try:
        from .cache import trust

        data = reproducer_source(gm, args, title, knobs).encode()
        directory = repro_dir()
        stem = f"repro_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:64]}_{hashlib.sha256(data).hexdigest()[:10]}"
        path = os.path.join(directory, stem + ".py")
        try:
            trust.create(path, data)
        except FileExistsError:
            try:
                if trust.read(path) == data:
                    return path
            except OSError:
                pass
            path = trust.create_unique(directory, stem + "_", ".py", data)
        return path
    except Exception:  # noqa: BLE001 - a reproducer is a courtesy, never a second failure
        return None
