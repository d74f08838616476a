"""Calling a C++ kernel without ctypes: one small CPython extension, `launch(fn, sizes, grid,
threads, *pointers)`, built once per environment and cached like the kernels.

Through ctypes a launch builds an array of the buffers' pointers and converts each argument:
about 2.5 µs of a 4 µs launch of a small kernel on a 2-core host, for every kernel of every
call (a nanoGPT training step on a CPU launches about a hundred). The extension takes the
pointers as Python integers (`tensor.data_ptr()`) through the vectorcall protocol, puts them
in an array on its stack and calls the kernel's function, releasing the GIL meanwhile as ctypes
does. Inductor's CPU kernels are Python extensions for the same reason.

The same extension runs a graph's consecutive kernels in one call (`run_steps(steps, count,
slots, threads, *pointers)`), as Inductor's C++ fuses a graph's loops into one function: one
crossing from Python, the GIL released once, and one OpenMP parallel region for all of them —
each kernel's programs shared out by a worksharing loop (or run by one thread where the kernel
is serial), the threads meeting at a barrier between kernels instead of being woken and joined
per kernel. A step is a kernel's range function (`<name>__programs`, `codegen.RANGE_SUFFIX`),
its packed sizes and grid, its program count, whether it runs on several threads, and where its
pointers start in the `slots` table, which maps each kernel's pointer positions to the
call's pointers (a buffer several kernels read is passed once).

It needs CPython's headers (`Python.h`, found through `sysconfig`) and a Python with a GIL;
where they are missing or the build fails, kernels launch through ctypes as before (logged
once on the `code` channel).
"""
from __future__ import annotations

import ctypes
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
#: most pointer positions of all the kernels one `run_steps` call runs
MAX_SLOTS = 4096

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

typedef void (*tilefuse_range)(void* const*, const int64_t*, const int64_t*, int64_t, int64_t);

// one kernel of a run: 8 words, as `fast_call.STEP` lays them out
typedef struct {
    tilefuse_range fn;      // the kernel's `<name>__programs`
    const int64_t* sizes;   // its packed size arguments
    const int64_t* grid;    // its grid (3 dims)
    int64_t programs;       // the grid's programs
    int64_t parallel;       // nonzero: shared out among the threads; zero: one thread runs them all
    int64_t first;          // its pointers start at slots[first]
    int64_t count;          // how many pointers it takes
    int64_t unused;
} tilefuse_step;

// run_steps(steps, count, slots, threads, *pointers): the kernels in order, in one parallel region
static PyObject* tilefuse_run_steps(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    void* given[MAX_POINTERS];
    void* ptrs[MAX_SLOTS];
    if (nargs < 4 || nargs > 4 + MAX_POINTERS) {
        PyErr_SetString(PyExc_TypeError, "run_steps(steps, count, slots, threads, *pointers)");
        return NULL;
    }
    const tilefuse_step* steps = (const tilefuse_step*)PyLong_AsVoidPtr(args[0]);
    long count = PyLong_AsLong(args[1]);
    const int64_t* slots = (const int64_t*)PyLong_AsVoidPtr(args[2]);
    long threads = PyLong_AsLong(args[3]);
    Py_ssize_t given_count = nargs - 4;
    for (Py_ssize_t i = 0; i < given_count; ++i) given[i] = PyLong_AsVoidPtr(args[4 + i]);
    if (PyErr_Occurred()) return NULL;
    if (steps == NULL || slots == NULL || count < 0) {
        PyErr_SetString(PyExc_ValueError, "run_steps: a null plan");
        return NULL;
    }
    int64_t total = 0;
    for (long s = 0; s < count; ++s) {
        int64_t end = steps[s].first + steps[s].count;
        if (steps[s].fn == NULL || steps[s].first < 0 || end > MAX_SLOTS) {
            PyErr_SetString(PyExc_ValueError, "run_steps: a step outside the slot table");
            return NULL;
        }
        if (end > total) total = end;
    }
    for (int64_t i = 0; i < total; ++i) {
        if (slots[i] < 0 || slots[i] >= given_count) {
            PyErr_SetString(PyExc_ValueError, "run_steps: a slot names no pointer");
            return NULL;
        }
        ptrs[i] = given[slots[i]];
    }
    Py_BEGIN_ALLOW_THREADS
    if (threads > 1) {
        #pragma omp parallel num_threads((int)threads)
        {
            for (long s = 0; s < count; ++s) {
                const tilefuse_step* st = &steps[s];
                void* const* p = ptrs + st->first;
                if (st->parallel) {  // chunks of programs, about 8 per thread (as a kernel's own entry)
                    const int64_t n = st->programs;
                    const int64_t chunk = n / (8 * threads) > 1 ? n / (8 * threads) : 1;
                    #pragma omp for schedule(dynamic)
                    for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c)
                        st->fn(p, st->sizes, st->grid, c * chunk, c * chunk + chunk < n ? c * chunk + chunk : n);
                } else {
                    #pragma omp single
                    st->fn(p, st->sizes, st->grid, 0, st->programs);
                }
            }
        }
    } else {
        for (long s = 0; s < count; ++s)
            steps[s].fn(ptrs + steps[s].first, steps[s].sizes, steps[s].grid, 0, steps[s].programs);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))tilefuse_launch, METH_FASTCALL, "launch a tilefuse C++ kernel"},
    {"run_steps", (PyCFunction)(void (*)(void))tilefuse_run_steps, METH_FASTCALL,
     "run a graph's consecutive tilefuse C++ kernels in one parallel region"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "tilefuse_fast_call", NULL, -1, methods};

PyMODINIT_FUNC PyInit_tilefuse_fast_call(void) { return PyModule_Create(&module); }
""".replace("MAX_POINTERS", str(MAX_POINTERS)).replace("MAX_SLOTS", str(MAX_SLOTS))

_lock = threading.Lock()
_state: dict = {}  # "module": the extension, or None once it is known to be unavailable


def _extension():
    """The extension module, built (or loaded from the cache) on first use; None where it
    cannot be had (not CPython, no headers, no compiler, a failed build)."""
    if "module" in _state:
        return _state["module"]
    with _lock:
        if "module" not in _state:
            _state["module"] = _load()
    return _state["module"]


def launcher():
    """The extension's `launch`; None where the extension cannot be had."""
    module = _extension()
    return None if module is None else module.launch


def steps_runner():
    """The extension's `run_steps`; None where the extension cannot be had."""
    module = _extension()
    return None if module is None else module.run_steps


class Step(ctypes.Structure):
    """One kernel of a `run_steps` call (the extension's `tilefuse_step`)."""

    _fields_ = [("fn", ctypes.c_void_p), ("sizes", ctypes.c_void_p), ("grid", ctypes.c_void_p),
                ("programs", ctypes.c_int64), ("parallel", ctypes.c_int64), ("first", ctypes.c_int64),
                ("count", ctypes.c_int64), ("unused", ctypes.c_int64)]


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
                return _module(copy)
        return _module(path)
    except Exception as err:  # noqa: BLE001 — an optimisation: ctypes launches the kernels
        logs.log("code", "C++ kernels launch through ctypes: the fast call did not build: %s: %s",
                 type(err).__name__, err)
        return None


def _module(path: str):
    spec = importlib.util.spec_from_file_location("tilefuse_fast_call", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


__all__ = ["launcher", "steps_runner", "Step", "MAX_POINTERS", "MAX_SLOTS"]
