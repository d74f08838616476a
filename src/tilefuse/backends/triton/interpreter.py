"""Running tilefuse's generated Triton kernels through the Triton interpreter, for this
process's launches only, without `TRITON_INTERPRET=1`.

Why this exists: Triton chooses between compiling and interpreting when a function is
decorated (`triton.jit` reads `triton.knobs.runtime.interpret`, i.e. `TRITON_INTERPRET`). Its
standard library (`tl.sum`, `tl.max`, `tl.sigmoid`, `tl.cdiv`, `tl.argmax`, `tl.cumsum`, ... in
`triton/language/standard.py`) is decorated when Triton is imported, so with the variable unset
those are compiled-mode `JITFunction`s, and an interpreted kernel that calls one fails with
"Cannot call @triton.jit'd outside of the scope of a kernel". Setting the variable for the whole
process would turn the user's own kernels (and those of their subprocesses) into interpreted
ones. Instead:

* a generated kernel's `@triton.jit` function becomes `InterpretedFunction(fn.fn)`
  (`launchable`); no global knob is touched;
* while one of those kernels runs (`running()`), compiled-mode `JITFunction`s behave as the
  interpreter's device functions: `JITFunction.__call__` runs the function's interpreted twin,
  the standard library's methods on `tl.tensor` (`x.sum(0)`, installed as bare `JITFunction`s
  that do not bind `self`) are bound wrappers, and `triton.language` is patched for the
  interpreter once for the whole launch. Everything is restored when the launch ends.

This is the same kind of change the interpreter itself makes for every launch (it patches
`triton.language` globally and restores it afterwards), so it has the same limit: the
interpreter's state is process-global. `running()` therefore holds one re-entrant lock for the
whole launch, so interpreted launches from several threads run one at a time (two at once would
corrupt each other's patches and the interpreter's grid index even under `TRITON_INTERPRET=1`);
a depth count restores the patches when the outermost launch leaves. Compiling a user's
compiled-mode kernel in another thread during an interpreted launch sees the patched language,
as it would with Triton's own interpreter.

When the standard library is already interpreted (the user set `TRITON_INTERPRET=1` before
importing Triton) nothing is patched: launches only take the lock.

Relies on Triton internals that 3.6 to 3.9 share (`triton.runtime.interpreter`'s
`InterpretedFunction` and `_patch_lang`; tested on 3.6 and 3.9); a Triton without them gets a
clear error naming the alternatives (`InterpreterUnavailable`).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types

_lock = threading.RLock()
_depth = 0  # launches inside the lock (re-entrant: one thread); the outermost restores
_undo: list = []  # how to restore what the outermost launch patched, applied in reverse
_twins: dict[int, tuple] = {}  # id(JITFunction) -> (the JITFunction, its InterpretedFunction)
_MISSING = object()


class InterpreterUnavailable(RuntimeError):
    """This Triton lacks the interpreter internals the scoped interpreter relies on."""


@functools.lru_cache(maxsize=None)
def _triton() -> types.SimpleNamespace:
    """The Triton classes and functions used here, or a clear error when this Triton lacks them."""
    advice = "set TRITON_INTERPRET=1 before starting Python, or use TILEFUSE_TARGET=cpu"
    try:
        import triton
    except ImportError as err:
        raise InterpreterUnavailable(f"the Triton interpreter needs Triton, which is not installed ({err})") from err
    try:
        import triton.language as tl
        from triton.runtime.errors import InterpreterError
        from triton.runtime.interpreter import InterpretedFunction, _patch_lang
        from triton.runtime.jit import JITFunction
    except ImportError as err:
        raise InterpreterUnavailable(
            f"the interpret backend needs Triton's interpreter internals, which this Triton lacks ({err}); "
            f"{advice}") from err
    if not isinstance(getattr(getattr(tl, "standard", None), "sum", None), (JITFunction, InterpretedFunction)):
        raise InterpreterUnavailable(
            f"Triton {getattr(triton, '__version__', '?')} lays out its standard library in a way tilefuse "
            f"does not know; {advice}")
    return types.SimpleNamespace(tl=tl, JITFunction=JITFunction, InterpretedFunction=InterpretedFunction,
                                 patch_lang=_patch_lang, InterpreterError=InterpreterError)


def require() -> None:
    """For `target="interpret"`: a `ConfigError` (the user's choice cannot run here) when this
    process has no usable Triton interpreter."""
    from ...config import ConfigError

    try:
        _triton()
    except InterpreterUnavailable as err:
        raise ConfigError(f"target='interpret' cannot run here: {err}") from err


def launchable(fn):
    """The interpreted form of a generated module's `@triton.jit` function, to launch with
    `fn[grid](...)` inside `running()`."""
    t = _triton()
    if isinstance(fn, t.JITFunction):
        return t.InterpretedFunction(fn.fn)
    return fn  # decorated while TRITON_INTERPRET=1 was set: already interpreted


def stdlib_interpreted() -> bool:
    """Whether Triton's standard library was decorated in interpreter mode (TRITON_INTERPRET=1
    before Triton's import): then interpreted kernels need no help."""
    t = _triton()
    return not isinstance(t.tl.standard.sum, t.JITFunction)


@contextlib.contextmanager
def running():
    """Held around every interpreted launch: one launch at a time, compiled-mode Triton
    functions callable from the interpreted kernel for its duration."""
    global _depth
    with _lock:
        if _depth == 0 and not stdlib_interpreted():
            _patch()
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                _restore()


def _patch() -> None:
    t = _triton()
    try:
        # the language as the interpreter patches it for a launch, here for the standard
        # library's globals (`core`) as well as the kernel's (`tl`), once: device functions then
        # run without patching it again on every call, as InterpretedFunction.__call__ does
        _undo.append(t.patch_lang(_Globals({"tl": t.tl, "core": t.tl.core})).restore)
        _set(t.JITFunction, "__call__", _call_interpreted)
        for name, member in list(vars(t.tl.tensor).items()):
            if isinstance(member, t.JITFunction):
                _set(t.tl.tensor, name, _method(member))
    except BaseException:
        _restore()
        raise


def _restore() -> None:
    while _undo:
        _undo.pop()()


def _set(obj, name: str, value) -> None:
    old = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)
    _undo.append(lambda: delattr(obj, name) if old is _MISSING else setattr(obj, name, old))


class _Globals:
    """A stand-in function for `_patch_lang`, which patches the language modules it finds in a
    function's globals."""

    def __init__(self, globals_: dict):
        self.__globals__ = globals_


def _twin(jit_fn):
    """The InterpretedFunction of a compiled-mode JITFunction, made once. Keyed by id: hashing a
    JITFunction computes its cache key, which fails while the interpreter has patched the
    language; the stored JITFunction guards against a reused id."""
    entry = _twins.get(id(jit_fn))
    if entry is None or entry[0] is not jit_fn:
        entry = _twins[id(jit_fn)] = (jit_fn, _triton().InterpretedFunction(jit_fn.fn))
    return entry[1]


def _call_interpreted(self, *args, **kwargs):
    """`JITFunction.__call__` during an interpreted launch: a device-function call."""
    try:
        return _twin(self).rewrite()(*args, **kwargs)
    except Exception as err:  # reported as InterpretedFunction.__call__ reports it
        if isinstance(err, _triton().InterpreterError):
            raise
        raise _triton().InterpreterError(repr(err)) from err


def _method(jit_fn):
    """A standard-library function as a bound method of `tl.tensor` (`x.sum(0)`)."""
    def method(self, *args, **kwargs):
        return _call_interpreted(jit_fn, self, *args, **kwargs)

    method.__name__ = jit_fn.__name__
    return method


__all__ = ["launchable", "require", "running", "stdlib_interpreted", "InterpreterUnavailable"]
