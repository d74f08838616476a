"""No configuration crashes the process: a knob value that can never fit is a ConfigError
naming the knob and its limit; one that is valid but too large for a kernel on this target
(a C++ program's tile arrays over the stack its threads have) is replaced by a smaller one
with one warning; the tuner never compiles a candidate over the limits; and a tuning-cache
record over them (a valid checksum proves who wrote it, not that it is safe) is discarded
and tuned again. Cases that would crash run in a fresh interpreter, with a 1 MiB stack
where the stack is the limit: a regression fails the test instead of killing pytest."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import tilefuse
from tilefuse.config import ConfigError

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")

PRELUDE = '''
import math, warnings
import torch
import tilefuse

def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v

def chain(x):  # reductions whose rows are kept in arrays between loop nests
    out = x
    for i in range(6):
        y = torch.sin(out * (i + 1))
        out = y - y.mean(-1, keepdim=True) + out
    return out

def compiled(fn, *args, **options):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="tilefuse", dynamic=False, options=options)(*args)
    ours = [w for w in caught if issubclass(w.category, tilefuse.ConfigWarning)]
    return out, ours

def close(out, fn, *args):
    ref = fn(*[a.double() for a in args]).float()
    err = (out - ref).abs().max().item()
    eager = (fn(*args) - ref).abs().max().item()
    assert err <= 2 * eager + 1e-5 * (1 + ref.abs().max().item()), (err, eager)

torch.manual_seed(0)
'''


def _run(tmp_path, body: str, stack_kib: int | None = None, **env) -> str:
    """PRELUDE + `body` in a fresh Python (its stack limited to `stack_kib`); its stdout."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TILEFUSE_")}
    environ.update(TILEFUSE_CACHE_DIR=str(tmp_path / "cache"), TILEFUSE_AUTOTUNE="0", TILEFUSE_FALLBACK="error",
                   PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p), **env)

    def limit_stack():
        import resource

        resource.setrlimit(resource.RLIMIT_STACK, (stack_kib * 1024, resource.getrlimit(resource.RLIMIT_STACK)[1]))

    script = tmp_path / "case.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(script)], env=environ, capture_output=True, text=True, timeout=600,
                          cwd=str(tmp_path), preexec_fn=limit_stack if stack_kib else None)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


# ----------------------------------------------------------------------------- knobs
def test_flash_config_that_can_never_fit_is_a_config_error():
    with pytest.raises(ConfigError, match=r"flash_config='1024,1024,4,2'.*BLOCK_M=1024 .* from 16 to 256"):
        with tilefuse.config.patch(flash_config="1024,1024,4,2"):
            pass
    q = torch.randn(1, 1, 64, 32)
    torch._dynamo.reset()
    with pytest.raises(Exception) as err:  # torch.compile wraps its backend's errors
        torch.compile(lambda q: q * 2, backend="tilefuse", options={"flash_config": "1024,1024,4,2"})(q)
    assert isinstance(getattr(err.value, "inner_exception", err.value), ConfigError), repr(err.value)
    assert "flash_config" in str(err.value) and "256" in str(err.value)


def test_persistent_reduction_limit_that_can_never_fit_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"persistent_reduction_limit=4194304 .*from 1 to 65536"):
        with tilefuse.config.patch(persistent_reduction_limit=4194304):
            pass
    # from the environment: the import fails with the variable's name, the process does not crash
    env = {k: v for k, v in os.environ.items() if not k.startswith("TILEFUSE_")}
    env.update(PYTHONPATH=SRC, TILEFUSE_PERSISTENT_REDUCTION_LIMIT="4194304")
    proc = subprocess.run([sys.executable, "-c", "import tilefuse"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and "TILEFUSE_PERSISTENT_REDUCTION_LIMIT=4194304" in proc.stderr, proc.stderr[-2000:]


def test_a_4m_row_compiles_at_the_largest_persistent_limit(tmp_path):
    # the brief's 4M-element row: 4194304 is refused, the largest limit the knob takes loops
    # over the row (it is longer), and the result is right — on a 1 MiB stack too
    out = _run(tmp_path, '''
        x = torch.randn(1, 4 << 20)
        fn = lambda x: torch.softmax(x, -1) * x
        try:
            compiled(fn, x, persistent_reduction_limit=4194304)
        except Exception as err:  # torch.compile wraps its backend's errors
            assert isinstance(getattr(err, "inner_exception", err), tilefuse.ConfigError), repr(err)
            assert "persistent_reduction_limit" in str(err) and "65536" in str(err), err
        else:
            raise AssertionError("no ConfigError")
        out, warned = compiled(fn, x, persistent_reduction_limit=65536)
        close(out, fn, x)
        print("ok")
    ''', stack_kib=1024)
    assert "ok" in out


def test_flash_config_too_large_for_the_stack_is_replaced_with_one_warning(tmp_path):
    # 256x256 tiles of a head dimension of 256 keep about 1 MiB of arrays per program: more
    # than a 1 MiB stack holds (a segmentation fault before); replaced by smaller tiles
    out = _run(tmp_path, '''
        q, k, v = (torch.randn(1, 2, 512, 256) for _ in range(3))
        out, warned = compiled(attention, q, k, v, flash_config="256,256,1,1")
        close(out, attention, q, k, v)
        assert len(warned) == 1, [str(w.message) for w in warned]
        text = str(warned[0].message)
        assert "flash_config='256,256,1,1'" in text and "stack" in text and "instead" in text, text
        print("ok")
    ''', stack_kib=1024)
    assert "ok" in out


def test_persistent_rows_too_large_for_the_stack_are_looped_with_one_warning(tmp_path):
    out = _run(tmp_path, '''
        x = torch.randn(2, 65536)  # (not split over the threads: rows held whole are the point)
        out, warned = compiled(chain, x, persistent_reduction_limit=65536, split_reductions=False)
        close(out, chain, x)
        assert len(warned) == 1, [str(w.message) for w in warned]
        assert "persistent_reduction_limit=65536" in str(warned[0].message), warned[0].message
        print("ok")
    ''', stack_kib=1024)
    assert "ok" in out


def test_ordinary_models_get_no_warning(tmp_path):
    out = _run(tmp_path, '''
        q, k, v = (torch.randn(1, 2, 300, 64) for _ in range(3))
        out, warned = compiled(attention, q, k, v)
        close(out, attention, q, k, v)
        x = torch.randn(4, 3000)
        out2, warned2 = compiled(chain, x)
        close(out2, chain, x)
        assert not warned and not warned2, [str(w.message) for w in warned + warned2]
        print("ok")
    ''', stack_kib=1024)
    assert "ok" in out


# ----------------------------------------------------------------------------- tuning
def test_tuning_cache_record_over_the_limits_is_discarded_and_tuned_again(tmp_path):
    # a record with XBLOCK=2**20 and a valid checksum (written through the cache itself) for a
    # C++ row reduction: its arrays would be 2**20 rows long (a segmentation fault before)
    out = _run(tmp_path, '''
        from tilefuse.tune import cache as tc
        planted = []
        lookup = tc.TuningCache.lookup

        def plant_then_lookup(self, key, *args, **kwargs):
            if not planted:
                planted.append(key)
                assert self.store(key, {"XBLOCK": 1 << 20, "warps": 1}, 1e-6)
            return lookup(self, key, *args, **kwargs)

        tc.TuningCache.lookup = plant_then_lookup
        x = torch.randn(4, 256)
        fn = lambda x: torch.softmax(x, -1) * 2
        out, warned = compiled(fn, x, autotune="max")
        close(out, fn, x)
        tc.TuningCache.lookup = lookup
        record = tc.TuningCache().lookup(planted[0])
        assert record is not None and record["schedule"]["XBLOCK"] in (1, 2, 4), record
        print("ok")
    ''')
    assert "ok" in out


def test_tuner_never_compiles_a_candidate_over_the_limits(monkeypatch):
    from tilefuse.backends.cpu import stack
    from tilefuse.tune import tuner

    measured, built, dropped = [], [], []
    measure, misfit, launchers = tuner._Bench.measure, tuner._Bench.misfit, tuner._Bench._launchers

    def record_measure(self, cfg):
        measured.append(dict(cfg))
        return measure(self, cfg)

    def record_launchers(self, cfg):  # every candidate's kernels are loaded (built) here
        built.append(dict(cfg))
        return launchers(self, cfg)

    def record_misfit(self, cfg):
        why = misfit(self, cfg)
        if why:
            dropped.append(dict(cfg))
        return why

    monkeypatch.setattr(tuner._Bench, "measure", record_measure)
    monkeypatch.setattr(tuner._Bench, "misfit", record_misfit)
    monkeypatch.setattr(tuner._Bench, "_launchers", record_launchers)
    # a budget that holds the row reduction's arrays for 1 or 2 rows per program, not 4
    monkeypatch.setattr(stack, "stack_budget", lambda: 3 * 4096 * 4)
    x = torch.randn(8, 4096)
    fn = lambda x: torch.softmax(x * 3, -1) * x
    torch._dynamo.reset()
    with tilefuse.config.patch(target="cpu", autotune="max", fallback="error"):
        out = torch.compile(fn, backend="tilefuse", dynamic=False)(x)
    torch.testing.assert_close(out, fn(x))
    assert measured and built and dropped, (measured, built, dropped)
    assert all(cfg["XBLOCK"] <= 2 for cfg in measured + built) and all(cfg["XBLOCK"] > 2 for cfg in dropped)
