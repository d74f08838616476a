"""DESIGN.md's layer table, enforced: no import up the layers and no import circle between files.

Every import is counted — at module level, inside functions, under `if TYPE_CHECKING`,
`from . import x` and relative imports resolved. An import of `a.b.c` is an edge to the file
that defines `a.b.c` (a module, or a package's `__init__` when the name is not a submodule);
the parent packages that Python runs first are not edges (else every file would sit in one
circle through `tilefuse/__init__`).

Run as a script (`python tests/test_layers.py`) to print every violation.
"""
from __future__ import annotations

import ast
import os
import sys

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PACKAGE = "tilefuse"

# The layer table, top of DESIGN's picture first. A module may import its own layer, the
# foundation, and the layers whose output it consumes (listed before it), never one after it.
# Keys are module prefixes; the longest matching prefix wins.
FOUNDATION = 0
LAYERS = {
    # foundation: "below every layer sit ir/, the config registry, logs, errors, the disk cache"
    "tilefuse.ir": FOUNDATION,
    "tilefuse.config": FOUNDATION,
    "tilefuse.logs": FOUNDATION,
    "tilefuse.errors": FOUNDATION,
    "tilefuse.cache": FOUNDATION,  # the disk cache, its locks, its trust rules and scratch files
    "tilefuse._version": FOUNDATION,  # DESIGN is silent: a constant, importable by anyone
    # the pipeline, in DESIGN's order
    "tilefuse.frontend": 1,
    "tilefuse.passes": 2,
    "tilefuse.fusion": 3,
    "tilefuse.tile": 4,
    "tilefuse.backends": 5,
    "tilefuse.tune": 6,
    "tilefuse.runtime": 7,
    # "one driver module (compiler.py) runs the stages in order"; DESIGN is silent on the
    # report value and the debug dump: they describe a compile, so they sit with the driver
    "tilefuse.compiler": 8,
    "tilefuse.explanation": 8,
    "tilefuse.debug_dump": 8,
    "tilefuse.dedupe": 8,  # the driver's sharing of identical kernels across plans and graphs
    "tilefuse.summary_sharing": 8,  # the driver's sharing of one mask's block summary across layers
    "tilefuse.compile_profile": 8,  # the driver's compile-time report
    "tilefuse.progress": 8,  # the driver's progress line
    "tilefuse.graph_cache": 8,  # the driver's store of whole compiled graphs
    "tilefuse.front_cache": 8,  # the driver's entry to stored graphs from Dynamo's graph, before AOTAutograd
    "tilefuse.front_autograd": 8,  # the autograd function of a training graph served by the front cache
    # what the API runs around a compile: below it, so they sit with the driver
    "tilefuse.failure": 8,  # a failed compile's stage, op and reproducer (TILEFUSE_FALLBACK)
    "tilefuse.verify_mode": 8,  # TILEFUSE_VERIFY: the graph against eager, the first wrong kernel
    "tilefuse.compare": 8,  # the fp64 rule, by which verify mode and check/ judge results
    "tilefuse.output_views": 8,  # a compiled graph's outputs that are views, made after the call
    # "the public API sits on top of the driver"; the package itself re-exports the API
    "tilefuse.api": 9,
    "tilefuse": 9,
    # "check/: correctness tooling on top of the API"
    "tilefuse.check": 10,
    "tilefuse.bench": 11,
    "tilefuse.cli": 12,
    "tilefuse.__main__": 12,
}

# Known violations still to remove (issue #20). Shrink only: a new one fails the test, and an
# entry that no longer occurs fails it too, so the list can't go stale.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


def _module_files() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of the package."""
    out = {}
    root = os.path.join(SRC, PACKAGE)
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), SRC)[:-3].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            out[".".join(rel)] = os.path.join(dirpath, f)
    return out


def _is_package(path: str) -> bool:
    return os.path.basename(path) == "__init__.py"


def _targets(node: ast.AST, module: str, is_pkg: bool, modules: dict[str, str]) -> list[str]:
    """The package's modules that one import statement reaches."""
    def known(name: str) -> str | None:
        while name and name not in modules:  # `import tilefuse.x.Y`-style: the defining module
            name = name.rpartition(".")[0]
        return name or None

    found = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(PACKAGE + "."):
                found.append(known(alias.name))
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            base = module if is_pkg else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = f"{base}.{node.module}" if node.module else base
        else:
            source = node.module or ""
        if source != PACKAGE and not source.startswith(PACKAGE + "."):
            return []
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            found.append(sub if sub in modules else known(source))
    return [t for t in found if t]


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (anywhere in the file)."""
    modules = _module_files()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(node, name, _is_package(path), modules))
        edges.discard(name)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return LAYERS[prefix]
    raise KeyError(f"{module} is in no layer: add it to LAYERS in tests/test_layers.py")


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets
            if layer_of(b) > layer_of(a) or (layer_of(a) == FOUNDATION and layer_of(b) != FOUNDATION)}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one file (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_no_import_runs_up_the_layers():
    found = upward_imports(import_graph())
    new = sorted(found - set(ALLOWED_UPWARD))
    assert not new, "imports up the layers (DESIGN.md):\n" + "\n".join(f"  {a} -> {b}" for a, b in new)
    gone = sorted(set(ALLOWED_UPWARD) - found)
    assert not gone, "fixed, so remove from ALLOWED_UPWARD:\n" + "\n".join(f"  {a} -> {b}" for a, b in gone)


def test_no_import_circle_between_files():
    found = set(cycles(import_graph()))
    new = [sorted(c) for c in found - set(ALLOWED_CYCLES)]
    assert not new, "import circles:\n" + "\n".join("  " + " <-> ".join(c) for c in new)
    gone = [sorted(c) for c in set(ALLOWED_CYCLES) - found]
    assert not gone, "fixed, so remove from ALLOWED_CYCLES:\n" + "\n".join("  " + ", ".join(c) for c in gone)


def test_the_checker_sees_a_circle_and_an_upward_import():
    graph = {"tilefuse.tile.a": {"tilefuse.tile.b"}, "tilefuse.tile.b": {"tilefuse.tile.a", "tilefuse.api"},
             "tilefuse.api": set(), "tilefuse.logs": {"tilefuse.tile.a"}}
    assert cycles(graph) == [frozenset({"tilefuse.tile.a", "tilefuse.tile.b"})]
    assert upward_imports(graph) == {("tilefuse.tile.b", "tilefuse.api"), ("tilefuse.logs", "tilefuse.tile.a")}


if __name__ == "__main__":
    g = import_graph()
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports")
    for a, b in sorted(upward_imports(g)):
        print(f"up: {a} -> {b}")
    for c in cycles(g):
        print(f"circle ({len(c)}): " + ", ".join(sorted(c)))
    sys.exit(0)
