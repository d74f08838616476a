"""`import tilefuse` and compiling with it leave the process as they found it: no environment
variable set, the user's own Triton kernels still compiled-mode kernels, Triton not needed on
the CPU default, and the Triton interpreter scoped to tilefuse's own kernels (with or without
TRITON_INTERPRET=1 from the user). Each case runs in a fresh interpreter with a clean copy of
the environment and a private cache directory."""
import os
import subprocess
import sys
import textwrap

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")

# shared by the scripts: the fp64 reference rule (compiled no further from an fp64 reference
# than eager, plus a small tolerance), and which backend each compiled graph used
PRELUDE = '''
import os, sys
import torch

def to64(v):
    return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

def check(fn, *inputs, backend):
    import tilefuse
    torch._dynamo.reset()
    expected = fn(*inputs)
    ref = fn(*[to64(v) for v in inputs])
    with tilefuse.config.patch(target=backend, fallback="error"):
        ex = tilefuse.explain(fn, *inputs)
        torch._dynamo.reset()
        actual = torch.compile(fn, backend="tilefuse")(*inputs)
    assert ex.reports and all(r.backend == backend for r in ex.reports), [r.backend for r in ex.reports]
    outs = actual if isinstance(actual, tuple) else (actual,)
    exps = expected if isinstance(expected, tuple) else (expected,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for k, (a, e, r) in enumerate(zip(outs, exps, refs)):
        assert a.shape == e.shape and a.dtype == e.dtype, (k, a.shape, e.shape, a.dtype, e.dtype)
        if not e.is_floating_point():
            assert torch.equal(a, e), (k, a, e)
            continue
        r = r.double()
        err = (a.double() - r).abs().max().item()
        eager_err = (e.double() - r).abs().max().item()
        tol = 1e-5 * (1 + r.abs().max().item())
        assert err <= eager_err + tol, f"{fn.__name__} output {k}: error {err} > eager {eager_err} + {tol}"
    return "\\n".join(kr.source for r in ex.reports for kr in r.kernels)

def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

def softmax(x):
    return torch.softmax(x, -1)

def linear(a, b, bias):
    return a @ b + bias

torch.manual_seed(0)
'''


def run(tmp_path, body: str, triton_interpret: bool = False) -> str:
    """Run PRELUDE + `body` as a script in a fresh Python; returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("TILEFUSE_")}
    env.update(TILEFUSE_CACHE_DIR=str(tmp_path / "cache"), TILEFUSE_AUTOTUNE="0",
               PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    if triton_interpret:
        env["TRITON_INTERPRET"] = "1"
    script = tmp_path / "case.py"  # a file: triton.jit reads a kernel's source from it
    script.write_text(PRELUDE + textwrap.dedent(body))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=900, cwd=str(tmp_path))
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_import_and_compiles_leave_the_environment_unchanged(tmp_path):
    run(tmp_path, '''
        import torch._dynamo  # torch itself sets TORCHINDUCTOR_CACHE_DIR here: not ours to judge
        before = dict(os.environ)

        def changes():
            now = dict(os.environ)
            return {k: (before.get(k), now.get(k)) for k in set(before) | set(now) if before.get(k) != now.get(k)}

        import tilefuse
        assert not changes(), changes()
        x, w = torch.randn(7, 33), torch.randn(33)
        check(rmsnorm, x, w, backend="interpret")
        assert not changes(), changes()
        check(rmsnorm, x, w, backend="cpu")
        assert not changes(), changes()
        assert not os.path.exists(os.path.join(os.environ["TILEFUSE_CACHE_DIR"], "triton-bin"))
    ''')


def test_user_triton_kernels_stay_compiled_mode(tmp_path):
    run(tmp_path, '''
        import tilefuse
        import triton
        import triton.language as tl
        from triton.runtime.jit import JITFunction

        @triton.jit
        def before_compile(x_ptr):
            tl.store(x_ptr, tl.load(x_ptr) + 1)

        check(softmax, torch.randn(5, 19), backend="interpret")

        @triton.jit
        def after_compile(x_ptr):
            tl.store(x_ptr, tl.sum(tl.load(x_ptr + tl.arange(0, 4))))

        for k in (before_compile, after_compile, tl.sum, tl.max):
            assert isinstance(k, JITFunction), type(k)
        assert isinstance(after_compile.cache_key, str)  # Triton's language is left unpatched
        assert not triton.knobs.runtime.interpret
    ''')


def test_cpu_default_needs_no_triton(tmp_path):
    out = run(tmp_path, '''
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        import tilefuse
        check(rmsnorm, torch.randn(9, 45), torch.randn(45), backend="cpu")
        check(softmax, torch.randn(6, 131), backend="cpu")
        check(linear, torch.randn(13, 29), torch.randn(29, 17), torch.randn(17), backend="cpu")
        torch._dynamo.reset()
        x, w = torch.randn(3, 21), torch.randn(21)
        torch.testing.assert_close(torch.compile(rmsnorm, backend="tilefuse")(x, w), rmsnorm(x, w))  # "auto"
        print("triton:", sys.modules["triton"])
    ''')
    assert "triton: None" in out


@pytest.mark.parametrize("triton_interpret", [False, True], ids=["scoped", "TRITON_INTERPRET=1"])
def test_interpret_backend_matches_eager(tmp_path, triton_interpret):
    out = run(tmp_path, '''
        import tilefuse

        def reductions(x):
            return x.sum(-1), x.amax(0), x.argmax(-1), x.amin(-1)

        def sigmoid_exp(x, y):
            return torch.sigmoid(x) * torch.exp(y * 0.5) - 1

        def cumsum(x):
            return torch.cumsum(x, -1) * 2

        def attention_like(q, k, v):
            return torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v

        sources = ""
        x, y = torch.randn(11, 37), torch.randn(11, 37)
        sources += check(reductions, x, backend="interpret")
        sources += check(sigmoid_exp, x, y, backend="interpret")
        sources += check(cumsum, x, backend="interpret")
        sources += check(softmax, torch.randn(7, 45), backend="interpret")
        sources += check(softmax, torch.randn(3, 3001), backend="interpret")
        sources += check(rmsnorm, torch.randn(5, 77), torch.randn(77), backend="interpret")
        sources += check(linear, torch.randn(13, 29), torch.randn(29, 19), torch.randn(19), backend="interpret")
        sources += check(attention_like, torch.randn(2, 9, 16), torch.randn(2, 23, 16), torch.randn(2, 23, 16),
                         backend="interpret")
        print("STDLIB", sorted(f for f in ("tl.sum(", "tl.max(", "tl.dot(", "tl.cdiv(", "tl.reduce(")
                               if f in sources))
        assert ("TRITON_INTERPRET" in os.environ) == (os.environ.get("TRITON_INTERPRET") == "1")
    ''', triton_interpret=triton_interpret)
    used = out.split("STDLIB", 1)[1]
    assert "tl.sum(" in used and "tl.max(" in used and "tl.dot(" in used, used
