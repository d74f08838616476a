"""The configuration registry: every knob tilefuse reads, in one typed table.

Each `Knob` has a name, an environment variable (`TILEFUSE_<NAME>`), a type, its allowed values,
a default and a one-line doc. Everything else comes from this table: strict parsing of the
environment when the process starts (a bad value is an error naming the variable), validation
on assignment (`tilefuse.config.autotune = "max"`; an unknown name is an error with the closest
known one), `config.patch(...)`, torch.compile's `options={...}` and `mode=...`
(`resolve_options`), the `tilefuse config` listing and the README's knob table (a test keeps
the README in step with `knob_table()`). An unknown `TILEFUSE_*` variable is reported once.
"""
from __future__ import annotations

import contextlib
import contextvars
import difflib
import os
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

from .errors import ConfigError, ConfigWarning, UnknownOptionError

#: log channels (`TILEFUSE_LOGS`); each is a standard logger, see logs.py
LOG_CHANNELS = ("graph", "fusion", "tile", "code", "tune", "runtime", "cache", "compile_time")

#: `TILEFUSE_*` variables that are not knobs
OTHER_VARIABLES = {"TILEFUSE_TEST_DEVICE": "the test suite's device (tests/, not the library)"}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def closest_name(name: str, known) -> str | None:
    """The known name closest to a misspelt one (None when nothing is close): every "did you
    mean" of tilefuse's messages comes from here."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return match[0] if match else None


def _closest(name: str, known) -> str:
    match = closest_name(name, known)
    return f"; did you mean {match!r}?" if match else ""


def _check_flash_config(value: str) -> None:
    if value == "":
        return
    parts = value.split(",")
    try:
        bm, bn, warps, stages, *more = (int(p) for p in parts)
        if len(more) > 1:
            raise ValueError
    except ValueError:
        raise ConfigError("must be 'BLOCK_M,BLOCK_N,warps,stages[,row_tiles]' (four or five integers) "
                          "or empty") from None
    if more and more[0] not in (1, 2, 4):
        raise ConfigError(f"row_tiles={more[0]} must be 1, 2 or 4")
    for label, v, low, high in (("BLOCK_M", bm, 16, 256), ("BLOCK_N", bn, 16, 256), ("warps", warps, 1, 16)):
        if v < low or v > high or v & (v - 1):
            raise ConfigError(f"{label}={v} must be a power of two from {low} to {high}")
    if not 1 <= stages <= 8:
        raise ConfigError(f"stages={stages} must be from 1 to 8")


def _check_logs(value: str) -> None:
    for channel in (c.strip() for c in value.split(",")):
        if channel and channel != "all" and channel not in LOG_CHANNELS:
            raise ConfigError(f"unknown log channel {channel!r}{_closest(channel, LOG_CHANNELS)} "
                              f"(channels: {', '.join(LOG_CHANNELS)}, or all)")


@dataclass(frozen=True)
class Knob:
    name: str
    type: type  # bool, int or str
    default: Any
    doc: str
    choices: tuple = ()  # allowed values of a str knob (empty: any string that `check` accepts)
    minimum: int | None = None
    maximum: int | None = None
    check: Callable[[Any], None] | None = None  # raises ConfigError (message without the knob's name)
    aliases: tuple = ()  # older names, still accepted
    values: str = ""  # the allowed values in words, where `choices` and the type do not say it
    #: a setting of the process's machinery (logging, the disk cache, build workers) rather than
    #: of what a compile produces: read where it is used, not carried by `Options`' readers
    process: bool = False

    @property
    def env(self) -> str:
        return f"TILEFUSE_{self.name.upper()}"

    def allowed(self) -> str:
        if self.values:
            return self.values
        if self.type is bool:
            return "1/0, true/false, yes/no, on/off"
        if self.choices:
            return ", ".join(repr(c) for c in self.choices)
        if self.type is int:
            high = "" if self.maximum is None else f" to {self.maximum}"
            return f"an integer from {self.minimum}{high}" if self.minimum is not None else "an integer"
        return "text"

    def parse(self, value: Any, source: str) -> Any:
        """`value` (a string from the environment, or a Python value) as this knob's type;
        a `ConfigError` naming `source` (the variable or option) otherwise."""
        def bad(why: str = "") -> ConfigError:
            return ConfigError(f"{source}={value!r} is not valid{': ' + why if why else ''} "
                               f"(allowed: {self.allowed()})")

        if self.type is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, int) and value in (0, 1):
                return bool(value)
            text = str(value).strip().lower() if isinstance(value, str) else None
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise bad()
        if self.type is int:
            if isinstance(value, bool):
                raise bad()
            if isinstance(value, str):
                try:
                    value = int(value.strip(), 10)
                except ValueError:
                    raise bad("not an integer") from None
            if not isinstance(value, int):
                raise bad("not an integer")
            if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
                raise bad()
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool) and self.choices:
            value = str(value)  # autotune=0
        if not isinstance(value, str):
            raise bad("not a string")
        value = value.strip()
        if self.choices and value not in self.choices:
            raise bad(_closest(value, self.choices).lstrip("; "))
        if self.check is not None:
            try:
                self.check(value)
            except ConfigError as err:
                raise bad(str(err)) from None
        return value


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tilefuse")


KNOBS: dict[str, Knob] = {k.name: k for k in (
    Knob("target", str, "auto",
         "where kernels run: auto (Triton for CUDA tensors, C++ for CPU tensors), triton, cpu (C++ "
         "kernels), interpret (the Triton interpreter on CPU tensors: slow, for tests)",
         choices=("auto", "triton", "cpu", "interpret"), aliases=("backend",)),
    Knob("autotune", str, "1",
         "0: the cost model chooses each schedule; 1: a few candidates are measured (cached on disk); "
         "max: a wide search (mode='max-autotune')", choices=("0", "1", "max")),
    Knob("tuning_budget_ms", int, 2000,
         "autotune=1: milliseconds of measurement per graph, shared among its kernels by their "
         "predicted time, with fewer candidates for a smaller share (at least 20 ms and two "
         "candidates each; a kernel under 0.2% of the graph's predicted time takes the cost model's "
         "choice, measuring none of its candidates; with compile workers two of them were already "
         "compiling); 0: every kernel measures for its own budget",
         minimum=0, maximum=3_600_000),
    Knob("fallback", str, "eager",
         "on an internal failure: eager runs that graph eagerly with a warning and a reproducer; "
         "error raises TilefuseError", choices=("eager", "error")),
    Knob("verify", bool, False,
         "check every compiled graph against eager (fp64 rule) on its first run and name the first "
         "diverging kernel"),
    Knob("index_checks", bool, True,
         "check indices read from tensor data (gather, embedding, index_put_, ...) against their "
         "bounds, and integer divisors against zero on CPU tensors: out of range, or a division by "
         "zero, raises as in eager instead of reading element 0 or giving 0"),
    Knob("matmul", str, "auto",
         "plain matrix products (a bias per column included): auto (measure the generated kernel "
         "against ATen's, and a product with an epilogue fused against ATen's product followed by the "
         "epilogue's own kernel: on a CPU the rules' kernel against the library for static products of "
         "at least 32³ multiply-adds, with autotune=0 or symbolic sizes ATen for those), generated, aten",
         choices=("auto", "generated", "aten")),
    Knob("logs", str, "",
         f"comma-separated log channels printed to stderr: {', '.join(LOG_CHANNELS)}, or all "
         "(also TORCH_LOGS=+tilefuse)", check=_check_logs, values="channel names, comma-separated", process=True),
    Knob("debug_dir", str, "",
         "if set, every compiled graph's FX graph, graph IR, kernel plans, tile IR and sources are "
         "written under this directory", values="a directory (empty: off)"),
    Knob("cache_dir", str, "",
         "the kernel and tuning cache (per user, created private); empty: $XDG_CACHE_HOME/tilefuse "
         "or ~/.cache/tilefuse", values="a directory", process=True),
    Knob("cache_lock_timeout", int, 600,
         "seconds a process waits for another one building the same cache entry (it says so after "
         "a few) before building it too", minimum=0, maximum=86400, process=True),
    Knob("cache_max_bytes", int, 4 << 30,
         "the disk cache's size bound (4 GiB by default): past it the least recently used entries "
         "are removed; 0: no bound", minimum=0, process=True),
    Knob("cuda_graphs", bool, False,
         "replay each compiled inference graph on a GPU as CUDA graphs, one per input layout "
         "(mode='reduce-overhead' and 'max-autotune' turn it on): one launch per call instead of one "
         "per kernel"),
    Knob("generated_wrapper", bool, True,
         "from a compiled graph's second call with a set of sizes, calls with those sizes run a "
         "generated straight-line function (allocations, launches with their arguments in place); off: "
         "every call walks the graph's steps (TILEFUSE_LOGS=runtime prints each function)"),
    Knob("kernel_runs", bool, True,
         "on the CPU, a generated call launches consecutive C++ kernels with one native call, in one "
         "parallel region with a barrier between kernels (`fast_call.run_steps`); off: one call per kernel"),
    Knob("graph_cache", bool, True,
         "a graph compiled before (same FX graph, input layouts, knobs, versions, device) is loaded from "
         "the disk cache instead of compiled again"),
    Knob("compile_threads", int, 0, "kernels compiled at once: C++ builds, and Triton compiles in worker "
         "processes; 0: one per CPU core (Triton: at most 32); 1: Triton kernels compile in this process",
         minimum=0, maximum=1024, process=True),
    Knob("persistent_reduction_limit", int, 8192,
         "largest reduction extent held whole in one tile (longer rows loop over tiles, and so does a "
         "row too large for its kernel on the target, with a warning)",
         minimum=1, maximum=65536),
    Knob("split_reductions", bool, True,
         "a reduction of a long axis (4096 or more) into too few values to occupy the device (a "
         "bias gradient's sum over the tokens; on a CPU, a loss summed to one value over its threads) "
         "runs as partial reductions over ranges of the axis and a short final one; off: one program "
         "per block of outputs walks the whole axis"),
    Knob("column_tiles", bool, True,
         "a reduction that reads across its outputs (a bias gradient's sum over rows) walks a tile 64 "
         "outputs wide and a few rows deep, reading whole lines of memory (GPU and CPU); off: the row "
         "tiles of other reductions"),
    Knob("flash_config", str, "",
         "attention kernels' 'BLOCK_M,BLOCK_N,warps,stages[,row_tiles]' (empty: the tuner's choice; "
         "row_tiles: how many BLOCK_M-row tiles one program carries through its key loop, default 1; "
         "blocks too large for a kernel on the target are made smaller, with a warning)",
         check=_check_flash_config, values="'BLOCK_M,BLOCK_N,warps,stages[,row_tiles]' or empty"),
    Knob("flash_split", int, 0,
         "key ranges per block of query rows in attention kernels (split and merge): 0 chooses by "
         "occupancy, 1 never splits, k > 1 forces k", minimum=0, maximum=1024),
    Knob("flash_launch_groups", bool, False,
         "attention kernels whose blocks of rows visit unequal numbers of key tiles (causal) launch in "
         "groups of batch elements whose keys and values fit 8 MB of L2, every element's heaviest block "
         "first across the group (tested, not yet timed on a GPU); off: one batch element's blocks after "
         "another's, each element's heaviest first"),
    Knob("block_summary", bool, True,
         "attention whose mask is read from tensor data (a tril buffer, a padding mask): a small "
         "pre-kernel lists, per block of query rows, the key tiles that are partly or wholly live; the "
         "attention kernel visits only those and reads no mask on the wholly live ones; off: every key "
         "tile is visited and masked"),
    Knob("index_constants", bool, True,
         "tensors the compiled code captures rather than takes as arguments (a module's buffers, "
         "globals, closures) whose values follow an index formula — a tril or band mask, a distance or "
         "position table — are computed from the indices instead of read: attention then skips the "
         "masked tiles as for a mask written with indices, and reads no bias table. Each call checks that "
         "the tensor is the one verified and unwritten since (its version counter), else verifies it "
         "again; one that no longer follows its formula sends later calls to a compile that reads it"),
    Knob("attention_backward", bool, True,
         "training: each attention chain (softmax of a score function of q·kᵀ, times v) becomes one "
         "autograd function: the forward saves the softmax's row max and log-sum, never the probabilities, "
         "and the backward recomputes them (FlashAttention-2's derivation, the score function's "
         "derivative by autograd); off: the chain is differentiated as traced"),
    Knob("recompute", bool, True,
         "training: the forward saves for the backward what is costly to recompute (products, "
         "reductions) and the backward recomputes cheap elementwise work from it, as Inductor does "
         "(AOTAutograd's min-cut partition); off: every intermediate the backward reads is saved"),
)}
_BY_NAME: dict[str, Knob] = {**KNOBS, **{alias: k for k in KNOBS.values() for alias in k.aliases}}
_BY_ENV: dict[str, Knob] = {**{k.env: k for k in KNOBS.values()},
                            **{f"TILEFUSE_{a.upper()}": k for k in KNOBS.values() for a in k.aliases}}

#: torch.compile's modes, as knob settings
MODES: dict[str, dict] = {
    "default": {},
    "max-autotune": {"autotune": "max", "cuda_graphs": True},
    "max-autotune-no-cudagraphs": {"autotune": "max"},
    "reduce-overhead": {"cuda_graphs": True},
}
MODE_NOTES: dict[str, str] = {}


def knob(name: str) -> Knob:
    """The knob called `name` (or one of its older names)."""
    found = _BY_NAME.get(name)
    if found is None:
        raise UnknownOptionError(f"tilefuse has no option {name!r}{_closest(name, KNOBS)} "
                                 f"(options: {', '.join(KNOBS)})")
    return found


#: `Config.patch` overrides of the running thread (or task): {id(config): {knob: value}}.
#: A context variable, not the process's values: a patch in one thread (a compile with its
#: options) is never seen by, nor undone by, another.
_overrides: contextvars.ContextVar[dict] = contextvars.ContextVar("tilefuse_config_overrides", default={})


class _KnobAttribute:
    """`config.<knob>` (a data descriptor, so tools that patch attributes — pytest's
    monkeypatch — read and restore it like any attribute)."""

    def __init__(self, name: str, attribute: str):
        self.name, self.attribute = name, attribute

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        patched = _overrides.get().get(id(obj))
        if patched and self.name in patched:
            return patched[self.name]
        return obj._values[self.name]

    def __set__(self, obj, value) -> None:
        obj._set(self.name, value, f"tilefuse.config.{self.attribute}")


class Config:
    """The knob values: `tilefuse.config`. Defaults come from `KNOBS`, overridden by
    `TILEFUSE_*` variables when the process starts and by assignment (for the whole process),
    or by `patch` (for a block, in the thread that runs it)."""

    def __init__(self, environ: Mapping[str, str] | None = None):
        environ = os.environ if environ is None else environ
        values = {name: k.default for name, k in KNOBS.items()}
        sources = dict.fromkeys(KNOBS, "default")
        unknown = []
        for var, raw in environ.items():
            if not var.startswith("TILEFUSE_") or var in OTHER_VARIABLES:
                continue
            found = _BY_ENV.get(var)
            if found is None:
                unknown.append(var)
                continue
            values[found.name] = found.parse(raw, var)
            sources[found.name] = var
        if not values["cache_dir"]:
            values["cache_dir"] = _default_cache_dir()
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_sources", sources)
        object.__setattr__(self, "_listeners", [])
        if unknown:
            names = list(_BY_ENV) + list(OTHER_VARIABLES)
            warnings.warn("; ".join(f"unknown environment variable {v} ignored{_closest(v, names)}"
                                    for v in sorted(unknown)), stacklevel=3)

    def __getattr__(self, name: str) -> Any:  # only called for names that are not attributes
        raise AttributeError(f"tilefuse.config has no knob {name!r}{_closest(name, KNOBS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _BY_NAME:
            raise AttributeError(f"tilefuse.config has no knob {name!r}{_closest(name, KNOBS)}")
        object.__setattr__(self, name, value)  # the knob's descriptor checks and stores it

    def _set(self, name: str, value: Any, source: str) -> None:
        """Assignment: the process's value (and this block's, inside a patch of that knob)."""
        value = KNOBS[name].parse(value, source)
        if name == "cache_dir" and not value:
            value = _default_cache_dir()
        self._values[name] = value
        self._sources[name] = "assigned"
        current = _overrides.get()
        if name in current.get(id(self), {}):
            _overrides.set({**current, id(self): {**current[id(self)], name: value}})
        for listener in self._listeners:
            listener(name, value)

    def patched(self, name: str, default: Any = None) -> Any:
        """The value this thread's `patch` gives knob `name` (`default` outside any patch of it)."""
        return _overrides.get().get(id(self), {}).get(name, default)

    def __repr__(self) -> str:
        return "tilefuse.config(" + ", ".join(f"{n}={v!r}" for n, v in self._values.items()) + ")"

    def on_change(self, listener: Callable[[str, Any], None]) -> None:
        """Call `listener(name, value)` after every assignment (logs.py follows `logs` this way;
        a `patch` calls no listener: it is the running thread's, not the process's)."""
        self._listeners.append(listener)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in KNOBS}

    def non_defaults(self) -> dict:
        """Knobs whose value differs from the default (what a reproducer must set)."""
        return self.options().non_defaults()

    def options(self, settings: Mapping[str, Any] | None = None) -> "Options":
        """The immutable `Options` of a compile: this configuration's values as the running
        thread sees them (assignments, the environment, `patch`), overridden by `settings`
        (a compile's `mode=`/`options=`, as `resolve_options` returns them)."""
        return Options({**self.as_dict(), **(settings or {})})

    def source_of(self, name: str) -> str:
        """Where a knob's value comes from: "default", its environment variable, "assigned",
        or "patch" (this thread's `patch`, or the options of the compile that runs)."""
        k = knob(name)
        if k.name in _overrides.get().get(id(self), {}):
            return "patch"
        return self._sources[k.name]

    @contextlib.contextmanager
    def patch(self, **changes) -> Iterator["Config"]:
        """Set knobs for the block, in the thread (or task) that runs it: every value is checked
        before any is set, other threads keep seeing theirs, and leaving the block restores
        what it found. Nested patches stack."""
        parsed = {knob(k).name: knob(k).parse(v, k) for k, v in changes.items()}
        if "cache_dir" in parsed and not parsed["cache_dir"]:
            parsed["cache_dir"] = _default_cache_dir()
        current = _overrides.get()
        token = _overrides.set({**current, id(self): {**current.get(id(self), {}), **parsed}})
        try:
            yield self
        finally:
            _overrides.reset(token)


class Options:
    """The knob values one compile runs with: an immutable value, made once by the API from the
    configuration's current values and the compile's own options (`Config.options`), and handed
    from stage to stage (`options.autotune`, `options.matmul`, ...). The global `config` only
    supplies the defaults; no stage reads it for a compile's knob.

    Process settings (`Knob.process`: logs, the disk cache's place and bounds, build workers)
    are in the value too, for the record, but the modules that own them read the configuration
    where they work (the API applies a compile's own process settings while that graph compiles)."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any] | None = None):
        base = {name: k.default for name, k in KNOBS.items()}
        base["cache_dir"] = _default_cache_dir()
        for name, value in (values or {}).items():
            k = knob(name)
            base[k.name] = k.parse(value, name)
        if not base["cache_dir"]:
            base["cache_dir"] = _default_cache_dir()
        object.__setattr__(self, "_values", MappingProxyType(base))

    def __getattr__(self, name: str) -> Any:  # only called for names that are not attributes
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in _BY_NAME:
            return values[_BY_NAME[name].name]
        raise AttributeError(f"tilefuse options have no knob {name!r}{_closest(name, KNOBS)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"tilefuse options are immutable: use options.replace({name}=...)")

    def replace(self, **changes: Any) -> "Options":
        """A copy with `changes` (checked as any option is)."""
        return Options({**self._values, **changes})

    def as_dict(self) -> dict:
        return dict(self._values)

    def non_defaults(self) -> dict:
        """Knobs whose value differs from the default (what a reproducer must set)."""
        default_dir = _default_cache_dir()
        return {n: v for n, v in self._values.items()
                if v != KNOBS[n].default and not (n == "cache_dir" and v == default_dir)}

    def process_settings(self) -> dict:
        """The process settings among these values (`Knob.process`)."""
        return {n: v for n, v in self._values.items() if KNOBS[n].process}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and self._values == other._values

    def __hash__(self) -> int:
        return hash(tuple(self._values.items()))

    def __reduce__(self):
        return (Options, (dict(self._values),))

    def __repr__(self) -> str:
        changed = self.non_defaults()
        return "tilefuse.Options(" + ", ".join(f"{n}={v!r}" for n, v in changed.items()) + ")"


for _name, _knob in _BY_NAME.items():
    setattr(Config, _name, _KnobAttribute(_knob.name, _name))


def resolve_options(mode: str | None = None, options: Mapping[str, Any] | None = None,
                    **knobs: Any) -> dict:
    """The knob settings torch.compile's `mode=` and `options={...}` (and keyword knobs) ask
    for, checked: an unknown name is an `UnknownOptionError` (a TypeError), a bad value a
    `ConfigError` (a ValueError), each naming the option and what it takes."""
    settings: dict = {}
    if mode is not None:
        if not isinstance(mode, str) or mode not in MODES:
            raise ConfigError(f"mode={mode!r} is not a torch.compile mode tilefuse takes "
                              f"(modes: {', '.join(repr(m) for m in MODES)})")
        if mode in MODE_NOTES:
            warnings.warn(MODE_NOTES[mode], stacklevel=3)
        settings.update(MODES[mode])
    if options is not None and not isinstance(options, Mapping):
        raise UnknownOptionError(f"options must be a dict of tilefuse option names, not {type(options).__name__}")
    for name, value in {**(options or {}), **knobs}.items():
        if not isinstance(name, str):
            raise UnknownOptionError(f"option names are strings, not {name!r}")
        k = knob(name)
        settings[k.name] = k.parse(value, f"options[{name!r}]" if name in (options or {}) else name)
    return settings


def knob_table() -> str:
    """The knobs as a Markdown table (the README's, and `tilefuse config --markdown`)."""
    rows = ["| knob | environment variable | default | values | what it does |", "|---|---|---|---|---|"]
    for k in KNOBS.values():
        default = "(see text)" if k.name == "cache_dir" else repr(k.default)
        rows.append(f"| `{k.name}` | `{k.env}` | `{default}` | {k.allowed()} | {k.doc} |")
    return "\n".join(rows)


config = Config()
