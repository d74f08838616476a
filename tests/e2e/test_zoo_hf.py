"""Code written the way Hugging Face transformers and research code write it: additive
`finfo.min` masks with left padding, position ids from `cumsum`, greedy generation with a KV
cache grown by `cat` (recompiles counted), logits processors, `torch.cond`,
activation checkpointing, hooks and shared weights, and the loss/numerics idioms — on the C++
backend and the Triton interpreter, judged by the fp64 rule, internal failures raised."""
import copy
import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import tilefuse
from tilefuse.compare import compare_outputs, to_fp64
from backends_on_cpu import CPU_BACKENDS


def _clone(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    if isinstance(a, (list, tuple)):
        return type(a)(_clone(x) for x in a)
    return a


def _check(fn, calls, backend, fn64=None, dynamic=None):
    """Every call's result (and in-place updates) passes the fp64 rule. Returns the number of
    graphs compiled."""
    fn64 = fn if fn64 is None else fn64
    torch._dynamo.reset()
    counters.clear()
    with tilefuse.config.patch(target=backend, fallback="error"):
        compiled = torch.compile(fn, backend="tilefuse", dynamic=dynamic)
        for args in calls:
            ours, theirs = _clone(args), _clone(args)
            out = compiled(*ours)
            eager = fn(*theirs)
            bad = compare_outputs((out, ours), (eager, theirs), (fn64(*to_fp64(list(args))), theirs))
            assert bad is None, str(bad)
    return counters["stats"]["unique_graphs"]


# ------------------------------------------------------------------ HF attention masks

def hf_masked_attention(q, k, v, attention_mask):
    """`_prepare_4d_causal_attention_mask` as HF writes it: a `finfo.min` causal mask from
    `triu(diagonal=1)`, the bool padding mask expanded to (B, 1, T, S) and `masked_fill`ed, added
    to the scores, clamped at `finfo.min` and softmaxed in fp32. A left-padded row's first
    queries see only `finfo.min` scores: eager gives them uniform weights."""
    dtype = q.dtype
    B, H, T, D = q.shape
    mn = torch.finfo(dtype).min
    causal = torch.full((T, T), mn, dtype=dtype).triu(diagonal=1)
    padding = ~attention_mask.bool()[:, None, None, :].expand(B, 1, T, T)
    mask = causal[None, None].masked_fill(padding, mn)
    scores = torch.matmul(q, k.transpose(2, 3)) * D ** -0.5 + mask
    scores = torch.max(scores, torch.tensor(mn, dtype=dtype))
    return F.softmax(scores, dim=-1, dtype=torch.float32).to(dtype) @ v


def hf_inverted_mask_attention(q, k, v, attention_mask):
    """The older spelling: `attention_mask[:, None, None, :]`, `(1 - mask) * finfo.min`
    combined with a causal mask built from `arange` comparisons."""
    dtype = q.dtype
    B, H, T, D = q.shape
    mn = torch.finfo(dtype).min
    i = torch.arange(T)
    causal = torch.full((T, T), mn, dtype=dtype).masked_fill(i < (i + 1).view(T, 1), 0)
    inverted = 1.0 - attention_mask[:, None, None, :].to(dtype)
    mask = causal[None, None] + inverted.masked_fill(inverted.to(torch.bool), mn)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D) + mask
    return F.softmax(scores, dim=-1) @ v


def _mask_calls(dtype, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    calls = []
    for B, H, T, D in sizes:
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))
        mask = torch.ones(B, T, dtype=torch.long)
        if B > 1:
            mask[1, :min(2, T - 1)] = 0  # left padding: the first query rows are fully masked
        if B > 2:
            mask[2, -2:] = 0  # right padding
        calls.append((q, k, v, mask))
    return calls


@pytest.mark.parametrize("backend, dtype", [("cpu", torch.float32), ("cpu", torch.bfloat16)] + [
    (b, torch.bfloat16) for b in CPU_BACKENDS if b != "cpu"])
def test_finfo_min_mask_with_left_padding(backend, dtype):
    # the attention kernel took exp(x - m) as exp2(x·log2e - m·log2e): finfo.min·log2e
    # overflows to -inf, and a row masked throughout gave -inf - -inf = NaN
    _check(hf_masked_attention, _mask_calls(dtype, [(3, 2, 9, 5), (1, 1, 1, 3)]), backend)


def masked_then_scaled_attention(q, k, v, attention_mask):
    """The mask filled in before the scale: the kernel's exp keeps the one multiply-add form
    (the scale folds into log2 e below 1, where no finite score overflows)."""
    B, H, T, D = q.shape
    padding = ~attention_mask.bool()[:, None, None, :]
    scores = (q @ k.transpose(-1, -2)).masked_fill(padding, torch.finfo(q.dtype).min) * D ** -0.5
    return torch.softmax(scores, -1) @ v


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_finfo_min_mask_before_the_scale_keeps_the_folded_exp(backend):
    from tilefuse.tile.score_rewrites import LOG2E

    calls = _mask_calls(torch.float32, [(3, 2, 9, 5)], seed=3)
    _check(masked_then_scaled_attention, calls, backend)
    with tilefuse.config.patch(target=backend, fallback="error"):
        ex = tilefuse.explain(masked_then_scaled_attention, *calls[0])
    flash = [k for k in ex.kernels if k.kind == "flash" and "exp2" in k.source]
    assert flash and repr(5 ** -0.5 * LOG2E) in flash[0].source  # x·(c·log2 e) − m·log2 e


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_sequence_masked_throughout_before_the_scale(backend):
    """(Once a known limit on the C++ backend — its compiler fused x·c − m into one multiply-add
    off by ~1e31 at finfo.min; this mask, read from data, now gets a block summary whose rows
    without a live key are walked whole and give eager's uniform weights.)"""
    calls = _mask_calls(torch.float32, [(3, 2, 9, 5)], seed=3)
    calls[0][3][2] = 0  # every key of one sequence masked: eager gives uniform weights
    _check(masked_then_scaled_attention, calls, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inverted_mask_and_position_ids_over_lengths(backend):
    calls = _mask_calls(torch.float32, [(3, 2, 5, 4), (3, 2, 8, 4), (3, 2, 11, 4)])
    assert _check(hf_inverted_mask_attention, calls, backend) <= 2  # one recompile: automatic dynamic

    def position_ids(attention_mask, table):
        pos = attention_mask.long().cumsum(-1) - 1
        pos.masked_fill_(attention_mask == 0, 1)
        return pos, table[pos] * attention_mask[..., None]

    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0]])
    _check(position_ids, [(mask, torch.randn(9, 5, generator=torch.Generator().manual_seed(1)))], backend)


# ------------------------------------------------------------------ generation

def _rotate_half(x):
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


class TinyLlama(nn.Module):
    """One Llama-style layer: RMSNorm, RoPE at position ids, a KV cache grown by `cat`, an HF
    additive mask over the cache, and the residual → RMSNorm → LM head (a sum of squares
    between two products: fused into one kernel that carries a plain sum through its loop,
    which the re-basing of carried sums did not expect)."""

    def __init__(self, vocab=31, d=12, heads=3):
        super().__init__()
        self.h = heads
        self.emb = nn.Embedding(vocab, d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.w = nn.Parameter(torch.rand(d) + 0.5)
        self.head = nn.Linear(d, vocab, bias=False)
        dh = d // heads
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dh, 2).float() / dh), persistent=False)

    def rms(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.w

    def forward(self, ids, attention_mask, position_ids, past_k=None, past_v=None):
        x = self.emb(ids)
        B, T, C = x.shape
        H, D = self.h, C // self.h
        h = self.rms(x)
        q, k, v = (lin(h).view(B, T, H, D).transpose(1, 2) for lin in (self.q, self.k, self.v))
        freqs = (position_ids[:, None, :].float() * self.inv_freq[None, :, None]).transpose(1, 2)
        emb = torch.cat([freqs, freqs], -1)
        cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past_k is not None:
            k, v = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        S = k.shape[2]
        mn = torch.finfo(x.dtype).min
        mask = torch.full((T, S), mn, dtype=x.dtype).triu(diagonal=S - T + 1)[None, None].expand(B, 1, T, S).clone()
        mask = mask.masked_fill(attention_mask[:, None, None, :S].eq(0), mn)
        att = F.softmax(q @ k.transpose(2, 3) / math.sqrt(D) + mask, dim=-1, dtype=torch.float32).to(x.dtype)
        x = x + self.o((att @ v).transpose(1, 2).reshape(B, T, C))
        return self.head(self.rms(x)).float(), k, v


def _generate(model, ids, attention_mask, steps):
    pos = attention_mask.long().cumsum(-1) - 1
    pos.masked_fill_(attention_mask == 0, 1)
    logits, k, v = model(ids, attention_mask, pos)
    tokens = []
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(nxt)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], -1)
        pos = pos[:, -1:] + 1
        logits, k, v = model(nxt, attention_mask, pos, k, v)
    return torch.cat(tokens, 1), logits


@pytest.mark.parametrize("backend, dtype", [("cpu", torch.float32)] + [
    (b, torch.bfloat16) for b in CPU_BACKENDS if b != "cpu"])
def test_greedy_generation_left_padded_kv_cache_cat(backend, dtype):
    torch.manual_seed(0)
    model = TinyLlama().to(dtype).eval()
    model64 = copy.deepcopy(model).double()
    ids = torch.randint(0, 31, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :1] = 0
    with torch.no_grad():
        want, eager_logits = _generate(model, ids, mask, 2)
        ref_logits = _generate(model64, ids, mask, 2)[1]
        torch._dynamo.reset()
        counters.clear()
        with tilefuse.config.patch(target=backend, fallback="error"):
            got, logits = _generate(torch.compile(model, backend="tilefuse"), ids, mask, 2)
    assert torch.equal(got, want)
    bad = compare_outputs(logits, eager_logits, ref_logits)
    assert bad is None, str(bad)
    # prefill, the first decode step, then one graph for every longer cache (as aot_eager)
    assert counters["stats"]["unique_graphs"] <= 3


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_residual_linear_rmsnorm_linear(backend):
    def fn(x, r, w1, g, w2):
        h = r + x @ w1.t()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g) @ w2.t()

    g = torch.Generator().manual_seed(2)
    args = (torch.randn(3, 6, 12, generator=g), torch.randn(3, 6, 12, generator=g), torch.randn(12, 12, generator=g),
            torch.rand(12, generator=g) + 0.5, torch.randn(31, 12, generator=g))
    _check(fn, [args], backend)


def static_cache_step(x, pos, k_cache, v_cache, w):
    B, T, C = x.shape
    q, k, v = (t.view(B, T, 2, C // 2).transpose(1, 2) for t in (x @ w).split(C, -1))
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    seen = torch.arange(k_cache.shape[2])[None, :] <= pos[:, None]
    att = (q @ k_cache.transpose(-1, -2) / math.sqrt(C // 2)).masked_fill(~seen, float("-inf"))
    return att.softmax(-1) @ v_cache


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_static_cache_index_copy_decode(backend):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(10, 30, generator=g) / 3
    caches = [torch.zeros(2, 2, 11, 5) for _ in range(2)], [torch.zeros(2, 2, 11, 5) for _ in range(2)], \
        [torch.zeros(2, 2, 11, 5, dtype=torch.float64) for _ in range(2)]
    steps = [(torch.randn(2, 4, 10, generator=g), torch.arange(4))] + \
        [(torch.randn(2, 1, 10, generator=g), torch.tensor([p])) for p in range(4, 7)]
    torch._dynamo.reset()
    counters.clear()
    with tilefuse.config.patch(target=backend, fallback="error"):
        compiled = torch.compile(static_cache_step, backend="tilefuse")
        for x, pos in steps:
            out = compiled(x, pos, *caches[0], w)
            eager = static_cache_step(x, pos, *caches[1], w)
            ref = static_cache_step(x.double(), pos, *caches[2], w.double())
            bad = compare_outputs((out, *caches[0]), (eager, *caches[1]), (ref, *caches[2]))
            assert bad is None, str(bad)
    assert counters["stats"]["unique_graphs"] <= 2  # prefill and decode


def logits_processors(input_ids, scores, temperature: float = 0.7, top_k: int = 5, top_p: float = 0.9):
    """Repetition penalty, temperature, top-k (`topk` + `scatter`), top-p (`sort` + `cumsum` +
    `masked_fill`) and the softmax a sampler draws from."""
    picked = torch.gather(scores, 1, input_ids)
    scores = scores.scatter(1, input_ids, torch.where(picked < 0, picked * 1.3, picked / 1.3))
    scores = scores / temperature
    values, idx = torch.topk(scores, top_k)
    scores = torch.full_like(scores, float("-inf")).scatter(-1, idx, values)
    ordered, order = torch.sort(scores, descending=False)
    cumulative = ordered.softmax(-1).cumsum(-1)
    remove = cumulative <= (1 - top_p)
    remove[..., -1:] = 0
    scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    probs = F.softmax(scores, -1)
    return probs, torch.multinomial(probs.float(), 1, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("backend, dtype", [("cpu", torch.float32)] + [
    (b, torch.bfloat16) for b in CPU_BACKENDS if b != "cpu"])
def test_logits_processors_and_sampling(backend, dtype):
    g = torch.Generator().manual_seed(4)
    ids, scores = torch.randint(0, 29, (3, 6), generator=g), (torch.randn(3, 29, generator=g) * 2).to(dtype)
    # the reference samples from eager's own float32 probabilities (a draw is not a float)
    _check(logits_processors, [(ids, scores)], backend,
           fn64=lambda i, s: (logits_processors(i, s.to(dtype))[0].double(), logits_processors(i, s.to(dtype))[1]))


def alibi_attention(q, k, v, attention_mask):
    """BLOOM's ALiBi: slopes `pow(base, arange)`, positions from `cumsum`, `baddbmm` into the
    scores, a bool mask filled with `finfo.min`."""
    B, H, T, D = q.shape
    base = torch.tensor(2 ** (-(2 ** -(math.log2(H) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + H, dtype=torch.int32))
    positions = ((attention_mask.cumsum(-1) - 1) * attention_mask)[:, None, :]
    alibi = (slopes[..., None] * positions).reshape(B * H, 1, T).to(q.dtype)
    scores = alibi.baddbmm(q.reshape(B * H, T, D), k.reshape(B * H, T, D).transpose(1, 2), beta=1.0,
                           alpha=1 / math.sqrt(D)).view(B, H, T, T)
    masked = torch.ones(T, T, dtype=torch.bool).triu(1)[None, None] | ~attention_mask.bool()[:, None, None, :]
    scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
    return F.softmax(scores, -1, dtype=torch.float32).to(q.dtype) @ v


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_alibi_attention(backend):
    # the attention kernel raises each head's slope to a per-program exponent: under the
    # interpreter that scalar comparison is float-typed and the pow helper's `&` was refused
    _check(alibi_attention, _mask_calls(torch.float32, [(3, 4, 7, 6)]), backend)


# ------------------------------------------------------------------ bf16 comparisons, NaN checks

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bf16_comparisons_nan_to_num_and_max(backend):
    # under the Triton interpreter bf16 data is uint16: `x != x`, `a < b` and `maximum`
    # compared bit patterns (NaN never found, -1 < -2, -0 != 0)
    def fn(x, y):
        return (torch.nan_to_num(x), torch.nan_to_num(torch.log(x), nan=0.5, neginf=-7.0), x < y, x == y,
                torch.maximum(x, y), torch.where(x.isnan(), y, x))

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 11, generator=g).to(torch.bfloat16)
    y = torch.randn(3, 11, generator=g).to(torch.bfloat16)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0])
    x[1, :2], y[1, :2] = torch.tensor([-0.0, -1.0]), torch.tensor([0.0, -2.0])
    _check(fn, [(x, y)], backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_pow_special_values(backend):
    # pow(1, nan) is 1 (C's pow, eager); the interpreter's pow gave NaN
    a = torch.tensor([-2.0, -1.5, 0.0, 0.0, 0.0, 2.0, 3.0, -0.0, 1.0, -1.0, float("nan"), -3.0])
    b = torch.tensor([3.0, 2.0, 0.0, -1.0, 2.0, 0.5, -2.0, 3.0, float("nan"), 2.5, 0.0, -3.0])
    _check(lambda a, b: (torch.pow(a, b), torch.pow(a, 3.0), torch.pow(2.0, b)), [(a, b)], backend)


# ------------------------------------------------------------------ higher-order ops, wrappers

@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torch_cond_data_dependent_predicate(backend):
    # the branches reach the backend as GraphModule attributes: lowering refused them
    def fn(x, w):
        return torch.cond(x.sum() > 0, lambda x, w: (x @ w).relu(), lambda x, w: (x @ w).sigmoid() - x.sum(), (x, w))

    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 7, generator=g), torch.randn(7, 7, generator=g)
    _check(fn, [(x.abs(), w), (-x.abs(), w)], backend)


class _Block(nn.Module):
    def __init__(self, d=10):
        super().__init__()
        self.ln, self.l1, self.l2 = nn.LayerNorm(d), nn.Linear(d, 2 * d + 1), nn.Linear(2 * d + 1, d)

    def forward(self, x):
        return x + self.l2(F.gelu(self.l1(self.ln(x))))


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False).pow(2).mean()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_checkpointed_training_step_gradients(backend):
    torch.manual_seed(8)
    model = _Checkpointed()
    model64 = copy.deepcopy(model).double()
    x = torch.randn(3, 7, 10)

    def step(m, x, compiled=False):
        m.zero_grad()
        loss = (torch.compile(m, backend="tilefuse") if compiled else m)(x)
        loss.backward()
        return [loss] + [p.grad.clone() for p in m.parameters()]

    torch._dynamo.reset()
    with tilefuse.config.patch(target=backend, fallback="error"):
        ours = step(model, x, compiled=True)
    bad = compare_outputs(ours, step(model, x), step(model64, x.double()))
    assert bad is None, str(bad)


class _Shared(nn.Module):
    """A layer called twice, with a forward hook and a pre-hook, and a compiled method."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(9, 9), nn.LayerNorm(9)
        self.lin.register_forward_hook(lambda mod, i, o: o * 2)
        self.norm.register_forward_pre_hook(lambda mod, i: (i[0] - 1,))

    def forward(self, x):
        return self.norm(self.lin(self.lin(x).relu()))

    def score(self, x, y):
        with torch.no_grad():
            gate = torch.func.vmap(lambda r: r.softmax(-1).amax() * r.sin())(y)
        return (self(x) * gate).sum(-1).log_softmax(-1)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_hooks_shared_weights_method_partial_vmap(backend):
    torch.manual_seed(9)
    m = _Shared()
    m64 = copy.deepcopy(m).double()
    x, y = torch.randn(4, 5, 9), torch.randn(4, 5, 9)
    _check(m, [(x,)], backend, fn64=m64)
    _check(m.score, [(x, y)], backend, fn64=m64.score)

    def base(x, w, alpha=1.0, beta=2.0):
        with torch.inference_mode():
            return ((x * alpha + beta) @ w).softmax(-1)

    _check(functools.partial(base, alpha=0.5, beta=-1.5), [(x, torch.randn(9, 9))], backend)


# ------------------------------------------------------------------ losses and numerics

def lm_losses(logits, labels):
    shifted, targets = logits[..., :-1, :].contiguous(), labels[..., 1:].contiguous()
    flat = shifted.view(-1, shifted.size(-1))
    return (F.nll_loss(F.log_softmax(flat, -1), targets.view(-1), ignore_index=-100),
            F.cross_entropy(flat, targets.view(-1), ignore_index=-100, reduction="sum"),
            torch.logsumexp(logits, -1))


@pytest.mark.parametrize("backend, dtype", [("cpu", torch.float32)] + [
    (b, torch.bfloat16) for b in CPU_BACKENDS if b != "cpu"])
def test_lm_loss_ignore_index_and_masked_softmax_nans(backend, dtype):
    g = torch.Generator().manual_seed(10)
    logits = (torch.randn(3, 7, 11, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 11, (3, 7), generator=g)
    labels[0, 2:5] = -100
    labels[2] = -100
    _check(lm_losses, [(logits, labels), (logits, torch.full((3, 7), -100))], backend)  # all ignored: NaN

    def masked(x, keep):
        y = torch.where(keep, x, float("-inf"))
        normalised = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return F.softmax(y, -1), torch.logsumexp(y, -1), normalised  # fully masked rows: NaN, -inf

    x = (torch.randn(5, 13, generator=g) * 4).to(dtype)
    keep = torch.rand(5, 13, generator=g) > 0.5
    keep[1], keep[0, 0] = False, True
    x[3] = 0
    _check(masked, [(x, keep)], backend)
