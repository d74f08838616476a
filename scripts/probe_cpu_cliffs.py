"""Small programs of everyday shapes (norms, losses, pads, pools, gathers, transposes), each
timed eager / Inductor / tilefuse in one process, rounds interleaved (the best round's mean
call), with tilefuse's error against fp64 beside eager's. A ratio under 0.9x Inductor is
flagged `<<<`, an error more than 4x eager's `ERR`: a quick hunt for performance cliffs and
wrong results in programs no workload names.

    PYTHONPATH=src python scripts/probe_cpu_cliffs.py [name,name,...]

Runs on the CPU (the default device of the programs' inputs).
"""
import sys, time, math, torch, torch.nn.functional as F
import tilefuse
torch.manual_seed(0)
P = {}
def prog(name, *inputs):
    def deco(fn): P[name] = (fn, inputs); return fn
    return deco

@prog("groupnorm_silu", torch.randn(8, 64, 16, 16), torch.randn(64), torch.randn(64))
def _(x, w, b): return F.silu(F.group_norm(x, 8, w, b))
@prog("batchnorm_train", torch.randn(32, 64, 8, 8), torch.randn(64), torch.randn(64))
def _(x, w, b): return F.relu(F.batch_norm(x, None, None, w, b, training=True))
@prog("cross_entropy_ls", torch.randn(256, 1000), torch.randint(0, 1000, (256,)))
def _(x, t): return F.cross_entropy(x, t, label_smoothing=0.1)
@prog("kl_div", torch.randn(256, 512), torch.randn(256, 512))
def _(a, b): return F.kl_div(F.log_softmax(a, -1), F.log_softmax(b, -1), log_target=True, reduction="batchmean")
@prog("cumsum_softmax", torch.randn(64, 512))
def _(x): return torch.cumsum(torch.softmax(x, -1), -1)
@prog("topk_gather", torch.randn(128, 256))
def _(x):
    v, i = torch.topk(x, 8, -1)
    return torch.gather(x * 2, -1, i) + v
@prog("var_std", torch.randn(128, 1024))
def _(x): return (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-5) * x.var(-1, keepdim=True)
@prog("depthwise_silu", torch.randn(4, 32, 28, 28), torch.randn(32, 1, 3, 3))
def _(x, w): return F.silu(F.conv2d(x, w, padding=1, groups=32)) * x
@prog("l2norm_cos", torch.randn(512, 128), torch.randn(512, 128))
def _(a, b): return F.cosine_similarity(a, b, dim=-1)
@prog("rope_small", torch.randn(1, 8, 32, 64), torch.randn(32, 64), torch.randn(32, 64))
def _(q, c, s):
    q1, q2 = q.chunk(2, -1)
    return q * c + torch.cat((-q2, q1), -1) * s
@prog("embedding_mean", torch.randint(0, 1000, (64, 32)), torch.randn(1000, 128))
def _(i, w): return F.embedding(i, w).mean(1)
@prog("swiglu", torch.randn(64, 256), torch.randn(512, 256), torch.randn(512, 256), torch.randn(256, 512))
def _(x, a, b, c): return F.linear(F.silu(F.linear(x, a)) * F.linear(x, b), c)
@prog("where_clamp_chain", torch.randn(256, 256))
def _(x):
    y = torch.where(x > 0, x.exp(), x.clamp(min=-1) * 0.5)
    return (y.abs().sqrt() + y.sin()).amax(0)
@prog("transpose_add", torch.randn(256, 512), torch.randn(512, 256))
def _(a, b): return (a + b.t()).relu() * 2
@prog("mse_backwardlike", torch.randn(1024, 64), torch.randn(1024, 64))
def _(a, b): return ((a - b) ** 2).mean() + (a.abs() - b.abs()).sum() * 1e-3
@prog("logsumexp", torch.randn(128, 2048))
def _(x): return torch.logsumexp(x, -1)
@prog("argmax_onehot", torch.randn(256, 100))
def _(x): return F.one_hot(x.argmax(-1), 100).float() * x.softmax(-1)
@prog("layernorm_gelu_small", torch.randn(16, 384), torch.randn(384), torch.randn(384))
def _(x, w, b): return F.gelu(F.layer_norm(x, (384,), w, b))
@prog("avgpool_flatten", torch.randn(8, 256, 7, 7))
def _(x): return F.adaptive_avg_pool2d(x, 1).flatten(1) * 2
@prog("maxpool_relu", torch.randn(8, 64, 32, 32))
def _(x): return F.max_pool2d(F.relu(x), 3, 2, 1)
@prog("interp_bilinear", torch.randn(2, 16, 32, 32))
def _(x): return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
@prog("pad_conv_like", torch.randn(4, 16, 30, 30))
def _(x): return F.pad(x, (1, 1, 1, 1)) * 2 + 1

@prog("batchnorm_train_28", torch.randn(16, 32, 28, 28), torch.randn(32), torch.randn(32))
def _(x, w, b): return F.relu(F.batch_norm(x, None, None, w, b, training=True))
@prog("batchnorm_train_7", torch.randn(8, 256, 7, 7), torch.randn(256), torch.randn(256))
def _(x, w, b): return F.relu(F.batch_norm(x, None, None, w, b, training=True))
@prog("batchnorm_eval_28", torch.randn(16, 32, 28, 28), torch.randn(32), torch.rand(32) + 0.5, torch.randn(32),
      torch.randn(32))
def _(x, m, v, w, b): return F.relu(F.batch_norm(x, m, v, w, b, training=False))
@prog("var_nchw_56", torch.randn(4, 64, 56, 56))
def _(x): return torch.var(x, dim=(0, 2, 3))
@prog("bias_gelu_1000", torch.randn(512, 1000), torch.randn(1000))
def _(x, b): return F.gelu(x + b)
@prog("swiglu_8rows", torch.randn(8, 256), torch.randn(512, 256), torch.randn(512, 256), torch.randn(256, 512))
def _(x, a, b, c): return F.linear(F.silu(F.linear(x, a)) * F.linear(x, b), c)
@prog("channel_bias_3x3", torch.randn(64, 128, 3, 3), torch.randn(128))
def _(x, b): return F.silu(x + b[:, None, None])
@prog("strided_window_max", torch.randn(8, 64, 32, 32))
def _(x):
    """A 3×3 stride-2 maximum written with a pad and strided slices (no pooling op)."""
    p = F.pad(torch.relu(x), (1, 1, 1, 1), value=float("-inf"))
    out = p[..., 0:32:2, 0:32:2]
    for dy in range(3):
        for dx in range(3):
            out = torch.maximum(out, p[..., dy:dy + 32:2, dx:dx + 32:2])
    return out
@prog("onehot_float", torch.randint(0, 512, (4096,)), torch.randn(4096, 512))
def _(i, x): return (F.one_hot(i, 512).float() * x).sum(-1)

@prog("alternating_chain", torch.randn(64, 64))
def _(x):
    """20 steps, each read by a reduction (a column sum or a row mean) and by the next step."""
    for i in range(20):
        x = torch.relu(x - x.sum(0, keepdim=True) * 0.01) if i % 2 == 0 else torch.tanh(x - x.mean(1, keepdim=True))
    return x

names = sys.argv[1].split(",") if len(sys.argv) > 1 else list(P)
for name in names:
    fn, inputs = P[name]
    fns = {"eager": fn, "inductor": torch.compile(fn), "tilefuse": torch.compile(fn, backend="tilefuse")}
    try:
        with torch.no_grad():
            ref = fn(*[t.double() if t.is_floating_point() else t for t in inputs])
            out = fns["tilefuse"](*inputs)
            err = (out.double() - ref).abs().max().item()
            eerr = (fn(*inputs).double() - ref).abs().max().item()
            for f in fns.values(): f(*inputs); f(*inputs)
            best = {k: 1e9 for k in fns}
            n = 20
            for r in range(15):
                for k, f in fns.items():
                    t = time.perf_counter()
                    for _ in range(n): f(*inputs)
                    best[k] = min(best[k], (time.perf_counter() - t) / n * 1e6)
        flag = "  <<<" if best["inductor"] / best["tilefuse"] < 0.9 else ""
        bad = "  ERR" if err > 4 * eerr + 1e-5 else ""
        print(f"{name:22s} eager {best['eager']:8.1f}  ind {best['inductor']:8.1f}  tf {best['tilefuse']:8.1f} us  "
              f"tf/ind {best['inductor']/best['tilefuse']:.2f}x  err {err:.1e} (eager {eerr:.1e}){flag}{bad}", flush=True)
    except Exception as e:
        print(f"{name:22s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    torch._dynamo.reset()
