"""Check that a refactoring of the printers leaves every generated kernel source unchanged.

Two steps. `capture` runs pytest (any test paths and options after `--`) and records every
tile kernel handed to a backend's `generate` (deduplicated, pickled without its fusion plan);
`print` prints each recorded kernel with the C++ printer, the Triton printer and the Triton
printer for the interpreter of the tilefuse on `PYTHONPATH`, one file per source (a refusal is
written as its error message: refusing is behaviour too). Print with the old tree and the new
one, then compare the two directories:

    PYTHONHASHSEED=0 PYTHONPATH=src python scripts/printer_identity.py capture k.pkl -- tests/backends -q
    PYTHONHASHSEED=0 PYTHONPATH=<old checkout>/src python scripts/printer_identity.py print k.pkl old
    PYTHONHASHSEED=0 PYTHONPATH=src python scripts/printer_identity.py print k.pkl new
    diff -r old new

`capture` appends to an existing file, so several runs (other targets: `TILEFUSE_TARGET=interpret`,
the fuzzer's programs, other test paths) build one corpus. The tile IR must be the same in both
trees (the kernels are unpickled by the printing tree).
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pickle
import sys


class _Recorder:
    """A pytest plugin: wraps both backends' `generate` wherever tilefuse imported it."""

    def __init__(self):
        self.kernels: dict[str, bytes] = {}

    def record(self, kernel) -> None:
        try:
            blob = pickle.dumps(dataclasses.replace(kernel, plan=None))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"printer_identity: cannot record {getattr(kernel, 'name', kernel)}: {e}", file=sys.stderr)
            return
        self.kernels.setdefault(hashlib.sha1(blob).hexdigest(), blob)

    def pytest_configure(self, config) -> None:
        import tilefuse.backends.cpu.codegen as cpp
        import tilefuse.backends.triton.codegen as triton
        import tilefuse.compiler  # noqa: F401 - every importer of `generate` is loaded first
        import tilefuse.tune.tuner  # noqa: F401

        def wrap(f):
            def generate(kernel, *args, **kwargs):
                self.record(kernel)
                return f(kernel, *args, **kwargs)
            return generate

        wrapped = {f: wrap(f) for f in (cpp.generate, triton.generate)}
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("tilefuse"):
                for attr, value in list(vars(mod).items()):
                    if callable(value) and value in wrapped:
                        setattr(mod, attr, wrapped[value])


def capture(out: str, pytest_args: list[str]) -> int:
    import pytest

    recorder = _Recorder()
    code = pytest.main(pytest_args, plugins=[recorder])
    kernels = {}
    if os.path.exists(out):
        with open(out, "rb") as f:
            kernels = pickle.load(f)
    kernels.update(recorder.kernels)
    with open(out, "wb") as f:
        pickle.dump(kernels, f)
    print(f"{len(recorder.kernels)} kernels recorded, {len(kernels)} in {out}")
    return int(code)


def print_sources(src: str, out: str) -> None:
    from tilefuse.backends.cpu.codegen import generate as cpp
    from tilefuse.backends.triton.codegen import generate as triton

    os.makedirs(out, exist_ok=True)
    with open(src, "rb") as f:
        kernels = pickle.load(f)
    printers = (("cpp", cpp), ("triton", lambda k: triton(k, interpret=False)),
                ("interp", lambda k: triton(k, interpret=True)))
    for key in sorted(kernels):
        kernel = pickle.loads(kernels[key])
        for tag, generate in printers:
            try:
                text = generate(kernel)
            except Exception as e:  # noqa: BLE001 - the refusal is compared too
                text = f"!! {type(e).__name__}: {e}\n"
            with open(os.path.join(out, f"{key}.{tag}"), "w") as f:
                f.write(text)
    print(f"{len(kernels)} tile kernels, {len(kernels) * len(printers)} sources written to {out}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture", help="run pytest and record the tile kernels it prints")
    c.add_argument("out")
    c.add_argument("pytest_args", nargs=argparse.REMAINDER)
    p = sub.add_parser("print", help="print recorded kernels with the tilefuse on PYTHONPATH")
    p.add_argument("kernels")
    p.add_argument("out")
    args = parser.parse_args()
    if args.cmd == "capture":
        return capture(args.out, [a for a in args.pytest_args if a != "--"])
    print_sources(args.kernels, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
