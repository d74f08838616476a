"""NN lowerings: softmax / log_softmax, layer / group / batch norm, losses, and the backward
ops (traced without decompositions, since core ATen decomposes them)."""
import pytest
import torch
import torch.nn.functional as F
from lowering_harness import check, check_traced, rand

from tilefuse.ir import Reduce

F32, BF16 = torch.float32, torch.bfloat16
aten = torch.ops.aten


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax(dim, dtype):
    x = rand(5, 7, 13, dtype=dtype, low=-6, high=6)
    rec = check(lambda x: (torch.softmax(x, dim), torch.log_softmax(x, dim)), x)
    reds = [n for n in rec.graphs[0].nodes.values() if isinstance(n, Reduce)]
    assert sorted(r.combiner.name for r in reds) == ["max", "max", "sum", "sum"]


def test_softmax_variants():
    x = rand(7, 13, dtype=BF16)
    m = torch.rand(7, 13) > 0.3
    m[:, 0] = True
    check(lambda x, m: (torch.softmax(x, -1, dtype=torch.float32), aten._softmax(x, 1, False),
                        aten._log_softmax(x, 0, False), x.masked_fill(~m, float("-inf")).softmax(-1),
                        torch.softmax(noncontig_op(x), 0), torch.softmax(x[0, 0], 0)), x, m)


def noncontig_op(x):
    return x.t()[::2]


def test_softmax_all_masked_row_is_nan():
    x = rand(3, 5)
    check(lambda x: torch.where(torch.arange(5) < 2, x, float("-inf")).softmax(0), x)


def test_softmax_dynamic():
    check(lambda x: (x.softmax(-1), x.log_softmax(0)), rand(7, 13), dynamic=True)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm(affine, dtype):
    x = rand(3, 5, 33, dtype=dtype)
    w, b = rand(33, dtype=dtype), rand(33, dtype=dtype)
    if affine:
        check(lambda x, w, b: (F.layer_norm(x, (33,), w, b), aten.native_layer_norm(x, [33], w, b, 1e-5)), x, w, b)
    else:
        check(lambda x: (F.layer_norm(x, (33,)), aten.native_layer_norm(x, [33], None, None, 1e-3)), x)


def test_layer_norm_multi_dim_and_shapes():
    x = rand(3, 5, 7)
    w = rand(5, 7)
    out = aten.native_layer_norm(x, [5, 7], w, None, 1e-5)
    assert out[1].shape == (3, 1, 1) and out[2].shape == (3, 1, 1)
    check(lambda x, w: aten.native_layer_norm(x, [5, 7], w, None, 1e-5), x, w)
    check(lambda x, w: F.layer_norm(x.transpose(0, 2)[::2], (3,)), x, w)


def test_layer_norm_dynamic():
    check(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b), rand(4, 13), rand(13), rand(13))
    check(lambda x, w: F.layer_norm(x * 2, (13,), w, None), rand(4, 6, 13), rand(13), dynamic=True)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_group_and_batch_norm(dtype):
    x = rand(2, 6, 5, 3, dtype=dtype)
    w, b = rand(6, dtype=dtype), rand(6, dtype=dtype)
    rm, rv = rand(6, dtype=dtype), rand(6, dtype=dtype, low=0.5, high=2)
    check(lambda x, w, b: (F.group_norm(x, 3, w, b), F.group_norm(x, 1), F.group_norm(x, 6, w, b)), x, w, b)
    check(lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=False), x, w, b, rm, rv)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_losses(dtype):
    logits = rand(7, 13, dtype=dtype)
    target = torch.randint(0, 13, (7,))
    y = rand(7, 13, dtype=dtype)
    check(lambda lg, t, y: (F.cross_entropy(lg, t), F.cross_entropy(lg, t, reduction="none"),
                            F.nll_loss(lg.log_softmax(-1), t), F.mse_loss(lg, y), F.l1_loss(lg, y),
                            F.smooth_l1_loss(lg, y), F.binary_cross_entropy_with_logits(lg, y.sigmoid()),
                            F.kl_div(lg.log_softmax(-1), y.softmax(-1), reduction="batchmean")),
          logits, target, y)


def test_normalize_and_rmsnorm():
    x = rand(5, 33)
    w = rand(33)
    check(lambda x, w: (F.normalize(x, dim=-1), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
                        F.rms_norm(x, (33,), w)), x, w)


# ---------------------------------------------------------------- backward ops (no decomposition)

BACKWARD = [
    ("threshold_backward", lambda g, x: aten.threshold_backward(g, x, 0.1)),
    ("sigmoid_backward", lambda g, x: aten.sigmoid_backward(g, torch.sigmoid(x))),
    ("tanh_backward", lambda g, x: aten.tanh_backward(g, torch.tanh(x))),
    ("silu_backward", lambda g, x: aten.silu_backward(g, x)),
    ("gelu_backward", lambda g, x: aten.gelu_backward(g, x)),
    ("gelu_backward_tanh", lambda g, x: aten.gelu_backward(g, x, approximate="tanh")),
    ("hardtanh_backward", lambda g, x: aten.hardtanh_backward(g, x, -0.5, 0.5)),
    ("leaky_relu_backward", lambda g, x: aten.leaky_relu_backward(g, x, 0.2, False)),
    ("elu_backward", lambda g, x: aten.elu_backward(g, 1.0, 1.0, 1.0, False, x)),
    ("elu_backward_result", lambda g, x: aten.elu_backward(g, 0.5, 1.0, 1.0, True, F.elu(x, 0.5))),
    ("softplus_backward", lambda g, x: aten.softplus_backward(g, x, 1.0, 20.0)),
    ("softmax_backward", lambda g, x: aten._softmax_backward_data(g, torch.softmax(x, 1), 1, x.dtype)),
    ("log_softmax_backward", lambda g, x: aten._log_softmax_backward_data(g, torch.log_softmax(x, -1), -1, x.dtype)),
]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name,fn", BACKWARD, ids=[b[0] for b in BACKWARD])
def test_backward_op(name, fn, dtype):
    g, x = rand(7, 13, dtype=dtype), rand(7, 13, dtype=dtype)
    graph, gm = check_traced(fn, g, x)
    assert any(name.replace("_result", "").replace("_tanh", "") in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_native_layer_norm_backward(mask):
    x, g = rand(3, 5, 33), rand(3, 5, 33)
    w, b = rand(33), rand(33)

    def f(g, x, w, b):
        _, mean, rstd = aten.native_layer_norm(x, [33], w, b, 1e-5)
        return aten.native_layer_norm_backward(g, x, [33], mean, rstd, w, b, list(mask))

    check_traced(f, g, x, w, b)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_batch_norm_training_and_instance_norm(dtype):
    x = rand(4, 3, 5, 2, dtype=dtype)
    w, b = rand(3, dtype=dtype), rand(3, dtype=dtype)

    def f(x, w, b, rm, rv):
        rm, rv = rm.clone(), rv.clone()
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.2)
        return y, rm, rv, F.instance_norm(x), F.batch_norm(x, None, None, training=True)

    rm, rv = rand(3, dtype=dtype), rand(3, dtype=dtype, low=0.5, high=2.0)
    check(f, x, w, b, rm, rv)


def test_batchnorm_module_train_step():
    from lowering_harness import check_training

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(6)
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, x):
            return self.lin(self.bn(x)).square().mean()

    check_training(Net, rand(9, 6))
