"""Inference of real-model code under the inputs users pass: several sizes with
`dynamic=True` (recompiles counted), padding masks, buffers sliced to the sequence length,
BatchNorm in eval on channels_last inputs, interpolation by non-integer scales, KV caches
written in place, sampling and greedy heads, embedding bags, bf16/fp16 and autocast — on the
C++ backend and the Triton interpreter, judged by the fp64 rule, with internal failures raised
(`fallback="error"`), never run eagerly in silence."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import tilefuse
from tilefuse.compare import compare_outputs, to_fp64
from backends_on_cpu import CPU_BACKENDS


def _graphs(fn, calls, backend, dynamic):
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic)
    for args in calls:
        compiled(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    return counters["stats"]["unique_graphs"]


def _check(fn, fn64, calls, backend, dynamic=None, count_graphs=False):
    """Run `fn` compiled on each argument tuple of `calls`; every result must pass the fp64 rule
    (`fn64` runs the same program in fp64). With `count_graphs`, tilefuse must compile no more
    graphs than Dynamo's own `aot_eager` backend does for the same calls (Dynamo specialises
    some sizes itself). Tensors are cloned per run: in-place updates are compared too."""
    torch._dynamo.reset()
    counters.clear()
    with tilefuse.config.patch(target=backend, fallback="error"):
        compiled = torch.compile(fn, backend="tilefuse", dynamic=dynamic)
        for args in calls:
            ours = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            theirs = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            out = compiled(*ours)
            eager = fn(*theirs)
            bad = compare_outputs((out, ours), (eager, theirs), (fn64(*to_fp64(list(args))), theirs))
            assert bad is None, str(bad)
    if count_graphs:
        ours = counters["stats"]["unique_graphs"]
        assert ours <= _graphs(fn, calls, "aot_eager", dynamic), ours


def _eval_pair(module):
    module = module.eval()
    return module, copy.deepcopy(module).double()


# --------------------------------------------------------------------- attention with masks

class GPT2Attention(nn.Module):
    """nanoGPT's attention: the causal mask is a tril buffer sliced to the sequence length."""

    def __init__(self, d=16, h=2, n=32):
        super().__init__()
        self.h = h
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gpt2_attention_tril_buffer_every_length(backend):
    # T = 1 reads one element of the buffer: a scalar mask, which the interpreter typed as
    # float data and refused as a load mask ("mask has unsupported dtype")
    torch.manual_seed(0)
    m, m64 = _eval_pair(GPT2Attention())
    with torch.no_grad():
        _check(m, m64, [(torch.randn(b, t, 16),) for b, t in [(2, 7), (3, 13), (2, 16)]], backend,
               dynamic=True, count_graphs=True)
        _check(m, m64, [(torch.randn(1, 1, 16),)], backend)


class Block(nn.Module):
    """A pre-norm transformer block with a key-padding mask (True = padding)."""

    def __init__(self, d=12, h=2):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, pad):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(D, -1))
        att = (q @ k.transpose(-1, -2) / math.sqrt(D // self.h)).masked_fill(pad[:, None, None, :], float("-inf"))
        x = x + self.o((att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, D))
        return x + self.ff(self.ln2(x))


def _padded(b, t, d=12):
    pad = torch.arange(t)[None, :] >= torch.randint(1, t + 1, (b, 1))
    return torch.randn(b, t, d), pad


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_transformer_block_padding_mask_dynamic(backend):
    torch.manual_seed(1)
    m, m64 = _eval_pair(Block())
    with torch.no_grad():
        _check(m, m64, [_padded(b, t) for b, t in [(2, 7), (5, 11)]], backend, dynamic=True, count_graphs=True)


class T5Attention(nn.Module):
    """T5's bucketed relative-position bias (an embedding of computed buckets) plus an additive
    padding mask, softmax in fp32."""

    def __init__(self, d=8, h=2, buckets=8, max_distance=20):
        super().__init__()
        self.h, self.nb, self.md = h, buckets, max_distance
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.rel = nn.Embedding(buckets, h)

    def bucket(self, rp):
        nb = self.nb // 2
        ret = (rp > 0).to(torch.long) * nb
        rp = torch.abs(rp)
        exact = nb // 2
        large = exact + (torch.log(rp.float() / exact) / math.log(self.md / exact) * (nb - exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, nb - 1))
        return ret + torch.where(rp < exact, rp, large)

    def forward(self, x, mask):
        B, T, D = x.shape
        rp = torch.arange(T)[None, :] - torch.arange(T)[:, None]
        bias = self.rel(self.bucket(rp)).permute(2, 0, 1).unsqueeze(0)
        bias = bias + (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        q, k, v = (f(x).view(B, T, self.h, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = q @ k.transpose(3, 2) + bias
        w = F.softmax(scores.float(), dim=-1).type_as(scores)
        return self.o((w @ v).transpose(1, 2).reshape(B, T, D))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_t5_relative_position_bias_dynamic(backend):
    torch.manual_seed(2)
    m, m64 = _eval_pair(T5Attention())

    def inputs(b, t):
        mask = (torch.arange(t)[None, :] < torch.randint(1, t + 1, (b, 1))).long()
        return torch.randn(b, t, 8), mask
    with torch.no_grad():
        _check(m, m64, [inputs(2, 7), inputs(3, 13)], backend, dynamic=True, count_graphs=True)


class GQA(nn.Module):
    def __init__(self, d=16, h=4, kv_heads=2, expand=False):
        super().__init__()
        self.h, self.kvh, self.hd, self.expand = h, kv_heads, d // h, expand
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * kv_heads * (d // h)), nn.Linear(d, d)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = (t.transpose(1, 2) for t in self.kv(x).view(B, T, 2, self.kvh, self.hd).unbind(2))
        r = self.h // self.kvh
        if self.expand:
            k, v = (t[:, :, None].expand(B, self.kvh, r, T, self.hd).reshape(B, self.h, T, self.hd) for t in (k, v))
        else:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_gqa_attention_dynamic(backend):
    torch.manual_seed(3)
    m, m64 = _eval_pair(GQA(expand=backend == "cpu"))  # expand on one backend, repeat_interleave on the other
    with torch.no_grad():
        _check(m, m64, [(torch.randn(b, t, 16),) for b, t in [(2, 5), (3, 11)]], backend, dynamic=True, count_graphs=True)


# --------------------------------------------------------------------- convolutions, resampling

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.b2 = nn.Conv2d(6, 6, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(6)
        for b in (self.b1, self.b2):
            b.running_mean.uniform_(-1, 1)
            b.running_var.uniform_(0.5, 2)
            b.weight.data.uniform_(0.5, 1.5)
            b.bias.data.uniform_(-0.5, 0.5)

    def forward(self, x):
        y = F.relu(self.b1(self.c1(x)))
        y = F.interpolate(y, scale_factor=2, mode="nearest")
        y = F.relu(self.b2(self.c2(y)))
        return y + F.interpolate(F.avg_pool2d(y, 2), size=y.shape[-2:], mode="bilinear")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_convnet_batchnorm_eval_channels_last(backend):
    torch.manual_seed(4)
    m, m64 = _eval_pair(ConvNet())
    with torch.no_grad():
        _check(m, m64, [(torch.randn(2, 3, 9, 7).to(memory_format=torch.channels_last),)], backend)
        _check(m, m64, [(torch.randn(0, 3, 9, 7),)], backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode,scale", [("nearest", 1.5), ("nearest", 0.7), ("bilinear", (1.5, 2.0))])
def test_interpolate_non_integer_scale_dynamic(backend, mode, scale):
    # the output size floor(1.5 * s) is computed in floats: it was printed as an integer
    # division of a double (C++: a double array index, or a mask one row too long that wrote
    # past the output: heap corruption), and math.trunc of a SymFloat did not lower at all
    torch.manual_seed(5)

    def f(x):
        return F.interpolate(x, scale_factor=scale, mode=mode, align_corners=True if mode == "bilinear" else None)
    _check(f, f, [(torch.randn(2, 3, h, w),) for h, w in [(7, 5), (10, 10), (13, 11)]], backend,
           dynamic=True, count_graphs=True)


# --------------------------------------------------------------------- decoding

def _decode_step(x, wq, wk, wv, k_cache, v_cache, pos):
    B, H = x.shape[0], 2
    q, k, v = ((x @ w).view(B, 1, H, -1).transpose(1, 2) for w in (wq, wk, wv))
    k_cache.index_copy_(2, pos, k)
    v_cache[:, :, pos] = v
    att = (q @ k_cache.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    att = att.masked_fill(torch.arange(k_cache.shape[2]) > pos[0], float("-inf"))
    return (att.softmax(-1) @ v_cache).transpose(1, 2).reshape(B, 1, -1)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_decode_step_kv_cache_written_in_place(backend):
    torch.manual_seed(6)

    def inputs(b, length, p, d=8):
        return (torch.randn(b, 1, d), torch.randn(d, d), torch.randn(d, d), torch.randn(d, d),
                torch.randn(b, 2, length, d // 2), torch.randn(b, 2, length, d // 2), torch.tensor([p]))
    _check(_decode_step, _decode_step, [inputs(2, 11, 3), inputs(2, 17, 0)], backend,
           dynamic=True, count_graphs=True)


def _sampling_head(logits, temperature, top_k: int, u):
    logits = logits[:, -1, :] / temperature
    v, _ = torch.topk(logits, top_k)
    logits = logits.masked_fill(logits < v[:, [-1]], float("-inf"))
    probs = F.softmax(logits, dim=-1)
    sp, si = torch.sort(probs, descending=True)
    sp = sp * ((sp.cumsum(-1) - sp) < 0.9)
    sp = sp / sp.sum(-1, keepdim=True)
    choice = torch.searchsorted(sp.cumsum(-1), u[:, None]).clamp(max=sp.shape[-1] - 1)
    return si.gather(-1, choice), probs.argmax(-1), probs


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_top_k_top_p_sampling_head(backend):
    torch.manual_seed(7)
    _check(_sampling_head, _sampling_head,
           [(torch.randn(2, 3, 37), 0.8, 5, torch.rand(2)), (torch.randn(3, 2, 41), 1.3, 5, torch.rand(3))],
           backend, dynamic=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_greedy_decoding_and_embedding_bag(backend):
    torch.manual_seed(8)
    emb, lm = nn.Embedding(31, 8), nn.Linear(8, 31, bias=False)
    bag = nn.EmbeddingBag(31, 8, mode="mean")

    def model(emb, lm, bag):
        def f(ids, offsets):
            x = emb(ids).cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]
            logits = lm(torch.tanh(x) + bag(ids.flatten(), offsets)[:, None, :])
            return logits.argmax(-1), logits.log_softmax(-1).gather(-1, ids[..., None])
        return f
    f = model(emb, lm, bag)
    f64 = model(*(copy.deepcopy(m).double() for m in (emb, lm, bag)))
    with torch.no_grad():
        _check(f, f64, [(torch.randint(0, 31, (2, 5)), torch.tensor([0, 4])),
                        (torch.randint(0, 31, (2, 7), dtype=torch.int32), torch.tensor([0, 9], dtype=torch.int32))],
               backend)


# --------------------------------------------------------------------- dtypes

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_block_with_padding_mask(backend, dtype):
    torch.manual_seed(9)
    m, m64 = _eval_pair(Block())
    m = m.to(dtype)
    x, pad = _padded(3, 7)
    with torch.no_grad():
        _check(m, m64, [(x.to(dtype), pad)], backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_autocast_bf16_region(backend):
    torch.manual_seed(10)
    mlp = nn.Sequential(nn.Linear(9, 16), nn.GELU(), nn.Linear(16, 8))
    mlp64 = copy.deepcopy(mlp).double()

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mlp(x)
            p = y.softmax(-1)
        return p.float().sum(-1), y

    def f64(x):
        y = mlp64(x)
        return y.softmax(-1).sum(-1), y
    with torch.no_grad():
        _check(f, f64, [(torch.randn(5, 9),), (torch.randn(7, 9),)], backend, dynamic=True, count_graphs=True)
