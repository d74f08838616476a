"""PyTorch's transformer fast paths (`_transformer_encoder_layer_fwd`,
`_native_multi_head_attention`) compiled as the layers' ops: one flash kernel per attention, no
extern, the values of the native kernels (checked against eager and a float64 run of the same
module), masks read as the native kernels read them, and the ATen kernel kept for a cross-attention
or a mask of a shape not spelt out."""
import pytest
import torch

import tilefuse

E, H = 48, 4  # head dim 12: not a multiple of a tile


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(2024)


def _encoder(norm_first: bool, activation: str, layers: int = 2) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=72, dropout=0.1, activation=activation,
                                             batch_first=True, norm_first=norm_first)
    model = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False).eval()
    for p in model.parameters():  # not the initialiser's zero biases
        p.data.add_(0.05 * torch.randn_like(p))
    return model


def _check(model, *args, tol=3e-5):
    """Compiled output close to eager's, its error against float64 no worse than a few times
    eager's; returns the compiled output."""
    with torch.no_grad():
        eager = model(*args)
        ref = model.double()(*(a.double() if a.is_floating_point() else a for a in args))
        model.float()
        torch._dynamo.reset()
        got = torch.compile(model, backend="tilefuse")(*args)
    got0, eager0, ref0 = (t[0] if isinstance(t, tuple) else t for t in (got, eager, ref))
    torch.testing.assert_close(got0, eager0, rtol=1e-4, atol=1e-4)
    err, eager_err = (got0.double() - ref0).abs().max().item(), (eager0.double() - ref0).abs().max().item()
    assert err <= 4 * eager_err + tol, (err, eager_err)
    return got, eager


def _report(model, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        return tilefuse.explain(model, *args)


@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu"), (False, "gelu")])
def test_encoder_layer_fast_path_fuses(norm_first, activation):
    model = _encoder(norm_first, activation)
    x = torch.randn(3, 19, E)
    _check(model, x)
    report = _report(model, x)
    assert not report.externs, report.externs
    assert sum(k.kind == "flash" for k in report.kernels) == 2, report


def test_encoder_layer_fast_path_is_taken_by_eager():
    """The guard on this module's premise: eager and Dynamo call the fused ATen op."""
    model = _encoder(False, "relu", layers=1)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    with torch.no_grad():
        torch._dynamo.reset()
        torch.compile(model, backend=capture)(torch.randn(2, 5, E))
    assert any("_transformer_encoder_layer_fwd" in str(n.target) for n in graphs[0].graph.nodes)


def test_encoder_layer_on_a_non_contiguous_input_with_dynamic_batch():
    model = _encoder(True, "relu")
    base = torch.randn(21, 4, E)
    x = base.transpose(0, 1)  # (4, 21, E), batch inner
    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="tilefuse", dynamic=True)
        for batch in (4, 3):
            got, eager = compiled(x[:batch]), model(x[:batch])
            torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def _padding():
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    return pad


def _causal_float():
    mask = torch.triu(torch.full((9, 9), float("-inf")), 1)
    mask[4, 1] = 0.5  # the native kernels mask any non-zero entry
    return mask


@pytest.mark.parametrize("which", ["padding", "causal-float", "both"])  # (both: of one dtype, as PyTorch asks)
def test_encoder_layer_with_masks_fuses(which):
    layer = _encoder(False, "gelu", layers=1).layers[0]
    x = torch.randn(2, 9, E)
    pad = _padding() if which != "causal-float" else None
    causal = {"padding": None, "causal-float": _causal_float(), "both": _causal_float() != 0}[which]
    fn = lambda x: layer(x, src_mask=causal, src_key_padding_mask=pad)  # noqa: E731
    with torch.no_grad():
        eager = fn(x)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="tilefuse")(x)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
    report = _report(fn, x)
    assert not report.externs, report.externs
    assert [k.kind for k in report.kernels].count("flash") == 1, report


@pytest.mark.parametrize("mask_type", [0, 1, 2])
def test_masked_weights_match_the_native_kernel(mask_type):
    """Every mask type against the ATen kernel itself; a row masked throughout gives 0 (the
    CPU kernel gives NaN there, its CUDA kernel and SDPA 0)."""
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    x = torch.randn(2, 9, E)
    if mask_type == 0:
        mask = _causal_float() != 0
        mask[3] = True  # a row masked throughout
    elif mask_type == 1:
        mask = _padding()
    else:
        mask = torch.rand(2, H, 9, 9) < 0.3
        mask[1, 2, 5] = True
    args = (E, H, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias)
    fn = lambda x, m: torch._native_multi_head_attention(x, x, x, *args, m, True, False, mask_type)  # noqa: E731
    with torch.no_grad():
        out, weights = fn(x, mask)
        torch._dynamo.reset()
        got_out, got_weights = torch.compile(fn, backend="tilefuse")(x, mask)
    dead = torch.isnan(weights).any(-1)  # (B, H, L) rows the CPU kernel leaves NaN
    assert bool(dead.any()) == (mask_type != 1)
    live = ~dead
    torch.testing.assert_close(got_weights[live], weights[live], rtol=1e-4, atol=1e-5)
    assert got_weights[dead].abs().max() == 0 if dead.any() else True
    rows = live.all(1)  # (B, L) query rows live in every head
    torch.testing.assert_close(got_out[rows], out[rows], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_native_self_attention_op_fuses(need_weights, average):
    """`_native_multi_head_attention` where a program calls it (Dynamo takes
    `nn.MultiheadAttention`'s slow path, so the op itself is called here): no extern, one flash
    kernel, the op's values and weights."""
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    for p in mha.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    params = (E, H, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias)

    def fn(x):
        out, weights = torch._native_multi_head_attention(x, x, x, *params, None, need_weights, average)
        return (out, weights) if need_weights else out

    x = torch.randn(2, 13, E)
    with torch.no_grad():
        eager = fn(x)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="tilefuse")(x)
    got, eager = (got, eager) if need_weights else ((got,), (eager,))
    torch.testing.assert_close(got[0], eager[0], rtol=1e-4, atol=1e-4)
    if need_weights:
        torch.testing.assert_close(got[1], eager[1], rtol=1e-4, atol=1e-5)
        assert got[1].shape == ((2, 13, 13) if average else (2, H, 13, 13))
    report = _report(fn, x)
    assert not report.externs, report.externs
    if not need_weights:
        assert [k.kind for k in report.kernels].count("flash") == 1, report


def test_cross_attention_keeps_its_own_path():
    mha = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    q, kv = torch.randn(2, 7, E), torch.randn(2, 11, E)
    fn = lambda q, kv: mha(q, kv, kv, need_weights=False)[0]  # noqa: E731
    with torch.no_grad():
        eager = fn(q, kv)
        torch._dynamo.reset()
        got = torch.compile(fn, backend="tilefuse")(q, kv)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)


def test_decompositions_decline_what_they_do_not_spell_out():
    from tilefuse.frontend import fast_path_layers as fp

    x = torch.randn(2, 5, E)
    w, b = torch.randn(3 * E, E), torch.randn(3 * E)
    pw, pb = torch.randn(E, E), torch.randn(E)
    odd_mask = torch.zeros(5, 4, dtype=torch.bool)  # not (L, L)
    assert fp.native_multi_head_attention(x, x, x, E, H, w, b, pw, pb, odd_mask, True, True, 0) is NotImplemented
    assert fp.native_multi_head_attention(x, x, x, E, H, w, b, pw, pb, odd_mask[:1], True, True, 3) is NotImplemented
    assert fp.native_multi_head_attention(x, x.clone(), x, E, H, w, b, pw, pb) is NotImplemented
    assert fp.native_multi_head_attention(x[0], x[0], x[0], E, H, w, b, pw, pb) is NotImplemented
    out, weights = fp.native_multi_head_attention(x, x, x, E, H, w, b, pw, pb, None, False)
    ref, _ = torch._native_multi_head_attention(x, x, x, E, H, w, b, pw, pb, None, False)
    assert weights is None
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_encoder_layer_with_a_padding_mask_on_the_interpreter():
    layer = _encoder(True, "gelu", layers=1).layers[0]
    x = torch.randn(2, 9, E)
    pad = _padding()
    fn = lambda x, pad: layer(x, src_key_padding_mask=pad)  # noqa: E731
    with torch.no_grad():
        eager = fn(x, pad)
        torch._dynamo.reset()
        got = tilefuse.compile(fn, target="interpret")(x, pad)
    torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
