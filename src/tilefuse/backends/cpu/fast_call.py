"""Calling a C++ kernel without ctypes: one small CPython extension, `launch(fn, sizes, grid,
threads, *pointers)`, built once per environment and cached like the kernels.

Through ctypes a launch builds an array of the buffers' pointers and converts each argument:
about 2.5 µs of a 4 µs launch of a small kernel on a 2-core host, for every kernel of every
call (a nanoGPT training step on a CPU launches about a hundred). The extension takes the
pointers as Python integers (`tensor.data_ptr()`) through the vectorcall protocol, puts them
in an array on its stack and calls the kernel's function, releasing the GIL meanwhile as ctypes
does. Inductor's CPU kernels are Python extensions for the same reason.

It needs CPython's headers (`Python.h`, found through `sysconfig`) and a Python with a GIL;
where they are missing or the build fails, kernels launch through ctypes as before (logged
once on the `code` channel).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import threading

from ... import logs
from ...cache.disk import DiskCache, cache_key, environment_fingerprint
from ...config import config
from . import toolchain

#: most buffers one launch passes (the kernels' own limit is far below)
MAX_POINTERS = 1024

SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef void (*tilefuse_kernel)(void* const*, const int64_t*, const int64_t*, int32_t);

// launch(fn, sizes, grid, threads, *pointers): every argument an int (addresses as ints)
static PyObject* tilefuse_launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    void* pointers[MAX_POINTERS];
    if (nargs < 4 || nargs > 4 + MAX_POINTERS) {
        PyErr_SetString(PyExc_TypeError, "launch(fn, sizes, grid, threads, *pointers)");
        return NULL;
    }
    tilefuse_kernel fn = (tilefuse_kernel)PyLong_AsVoidPtr(args[0]);
    const int64_t* sizes = (const int64_t*)PyLong_AsVoidPtr(args[1]);
    const int64_t* grid = (const int64_t*)PyLong_AsVoidPtr(args[2]);
    long threads = PyLong_AsLong(args[3]);
    for (Py_ssize_t i = 4; i < nargs; ++i) pointers[i - 4] = PyLong_AsVoidPtr(args[i]);
    if (PyErr_Occurred()) return NULL;
    if (fn == NULL || grid == NULL) {
        PyErr_SetString(PyExc_ValueError, "launch: a null kernel or grid");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    fn(pointers, sizes, grid, (int32_t)threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))tilefuse_launch, METH_FASTCALL, "launch a tilefuse C++ kernel"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tilefuse_fast_call", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tilefuse_fast_call(void) { return PyModule_Create(&module); }
""".replace("MAX_POINTERS", str(MAX_POINTERS))

_lock = threading.Lock()
_state: dict = {}  # "launch": the function, or None once it is known to be unavailable


def launcher():
    """The extension's `launch`, built (or loaded from the cache) on first use; None where it
    cannot be had (not CPython, no headers, no compiler, a failed build)."""
    if "launch" in _state:
        return _state["launch"]
    with _lock:
        if "launch" not in _state:
            _state["launch"] = _load()
    return _state["launch"]


def _load():
    include = sysconfig.get_paths().get("include") or ""
    why = ""
    if sys.implementation.name != "cpython":
        why = f"{sys.implementation.name} is not CPython"
    elif sysconfig.get_config_var("Py_GIL_DISABLED"):  # (loading it would turn the GIL back on)
        why = "a free-threaded Python"
    elif not os.path.exists(os.path.join(include, "Python.h")):
        why = f"no Python.h under {include or 'sysconfig include path'}"
    if why:
        logs.log("code", "C++ kernels launch through ctypes: %s", why)
        return None
    try:
        cxx = toolchain.require_compiler()
        key = cache_key("cpu-fast-call", SOURCE, toolchain.compiler_version(cxx), toolchain.flags(cxx),
                        toolchain.cpu_id(), sys.version, sysconfig.get_config_var("EXT_SUFFIX") or "", include,
                        environment_fingerprint())
        cache = DiskCache("cpu", config.cache_dir)  # (the kernels' cache)
        files = cache.get_or_create(key, lambda: {"fast_call.so": toolchain.build(SOURCE, cxx, ("-I" + include,))})
        entry = cache.path_of(key)
        path = os.path.join(entry, "fast_call.so") if entry is not None else None
        if path is None or not os.path.exists(path):
            from ...cache import scratch

            with scratch.private_copy(files["fast_call.so"], ".so") as copy:
                return _module(copy).launch
        return _module(path).launch
    except Exception as err:  # noqa: BLE001 — an optimisation: ctypes launches the kernels
        logs.log("code", "C++ kernels launch through ctypes: the fast call did not build: %s: %s",
                 type(err).__name__, err)
        return None


def _module(path: str):
    spec = importlib.util.spec_from_file_location("tilefuse_fast_call", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


__all__ = ["launcher", "MAX_POINTERS"]
