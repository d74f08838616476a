"""The `models` group of the benchmark: whole models written as their communities write them
(nanoGPT, gpt-fast, Hugging Face transformers from configs, ResNet-50), with random weights.

A model workload's inputs are the module followed by its tensors, so every backend compiles
the same call a user's loop makes (`torch.compile` of a function taking the model); its
reference is the same model in float32, eager (the model's own constants kept), beside which
the bf16 eager run's error is reported. Size tuples are `(batch, sequence or image size,
layers, width)`; `--layers` overrides the layer count. Throughput is in tokens (or images) per
second; flops are 2 per parameter per token (6 for a training step), attention not counted;
bytes are the parameters read once.

The training steps (nanoGPT, Hugging Face Llama and BERT; autocast to the benchmark dtype,
AdamW) run their optimizer with a learning rate of 0, so every timed step computes the same
loss and gradients (the accuracy check compares them) while doing all of an optimizer step's
work.
"""
from __future__ import annotations

import copy
import functools

import torch

from ..workload_base import Workload
from . import gptfast, hf, nanogpt, resnet


# ----------------------------------------------------------------------------- shared parts

def _params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _param_bytes(inputs) -> float:
    return float(sum(p.numel() * p.element_size() for p in inputs[0].parameters()))


def _tokens(inputs) -> float:
    """Tokens of one call: the first integer tensor among the inputs (the token ids)."""
    return float(next(x for x in inputs if isinstance(x, torch.Tensor)
                      and not x.is_floating_point()).numel())


def _images(inputs) -> float:
    return float(inputs[1].shape[0])


def _lm_flops(per_token: int):
    return lambda inputs: float(per_token * _params(inputs[0]) * _tokens(inputs))


def reference_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """float32 for a low-precision model (the issue's "fp32 eager reference"); float64 for a
    float32 one, so that eager's own error is measured too."""
    return torch.float64 if model_dtype == torch.float32 else torch.float32


def _widened(inputs, dtype: torch.dtype) -> list:
    """The model (a copy) and floating-point tensors in `dtype`, for the reference."""
    out = []
    for x in inputs:
        if isinstance(x, torch.nn.Module):
            out.append(copy.deepcopy(x).to(dtype))
        elif isinstance(x, torch.Tensor) and x.is_floating_point():
            out.append(x.to(dtype))
        else:
            out.append(x)
    return out


def _reference(forward):
    def ref(model, *tensors):
        dtype = reference_dtype(next(model.parameters()).dtype)
        with torch.no_grad():
            return forward(*_widened((model, *tensors), dtype))
    return ref


def _built(build, size, device, dtype, train: bool = False):
    """`build(size)` constructed on `device` in float32 (seeded by the runner), then cast to
    `dtype` for inference; training keeps float32 weights (autocast does the rest)."""
    with torch.device(device):
        model = build(size)
    _randomize_norm_stats(model)
    model.train(train)
    if train:
        return model
    return model.requires_grad_(False).to(dtype)  # inference: frozen, as under no_grad


def _randomize_norm_stats(model: torch.nn.Module) -> None:
    """BatchNorm statistics and affine weights away from their 0/1 defaults."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                if m.weight is not None:
                    m.weight.normal_(1.0, 0.1)
                    m.bias.normal_(0.0, 0.1)


def _ids(vocab: int, size, device) -> torch.Tensor:
    return torch.randint(0, vocab, (size[0], size[1]), device=device)


def _model_workload(name: str, make_inputs, fn, sizes, description: str, *, items=_tokens,
                    unit: str = "tokens/s", flops=None, requires=None, **kw) -> Workload:
    return Workload(name, make_inputs, fn, flops or _lm_flops(2), _param_bytes, sizes,
                    "compute", description, dynamic_axis=None,
                    ref_fn=kw.pop("ref_fn", None) or _reference(fn), requires=requires,
                    size_names=kw.pop("size_names", "B,T,layers,width"), group="models",
                    items=items, item_unit=unit, **kw)


# ----------------------------------------------------------------------------- nanoGPT

def _gpt(size, dropout: float = 0.0) -> nanogpt.GPT:
    b, t, layers, width = size
    heads = width // (64 if width >= 256 else 16)
    return nanogpt.GPT(nanogpt.GPTConfig(block_size=t, vocab_size=50304 if width >= 256 else 512,
                                         n_layer=layers, n_head=heads, n_embd=width, dropout=dropout))


def _gpt_dropout(size) -> nanogpt.GPT:
    """nanoGPT as its fine-tuning configurations train it: dropout 0.1 on the attention
    probabilities, the residual branches and the embeddings."""
    return _gpt(size, dropout=0.1)


def nanogpt_logits(model, idx):
    return model(idx)[0]


def nanogpt_loss(model, opt, idx, targets):
    return model(idx, targets)[1]


def _nanogpt_inputs(size, device, dtype):
    model = _built(_gpt, size, device, dtype)
    return model, _ids(model.config.vocab_size, size, device)


def _trained(model, dtype, device):
    """(model, AdamW at lr 0) for a training step that autocasts to `dtype` (weights stay fp32)."""
    model._bench_autocast = dtype
    fused = {"fused": True} if torch.device(device).type == "cuda" else {}
    return model, torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.1, **fused)


def _nanogpt_train_inputs(size, device, dtype, build=_gpt):
    model, opt = _trained(_built(build, size, device, dtype, train=True), dtype, device)
    vocab = model.config.vocab_size
    return model, opt, _ids(vocab, size, device), _ids(vocab, size, device)


def train_step(run, model, opt, *tensors, autocast_dtype=None):
    """One training step: the loss under autocast, backward, AdamW, zero_grad. Returns the loss
    and the gradient norms of the first and last parameters, for the accuracy check."""
    device = tensors[0].device.type
    dtype = autocast_dtype if autocast_dtype is not None else _autocast_dtype(model)
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        loss = run(model, opt, *tensors)
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    out = torch.stack([loss.detach(), params[0].grad.norm(), params[-1].grad.norm()])
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def _autocast_dtype(model) -> torch.dtype:
    return getattr(model, "_bench_autocast", torch.float32)


def _train_reference(loss):
    """The step in float32 (float64 for a float32 benchmark), without autocast."""
    def ref(model, opt, *tensors):
        dtype = reference_dtype(_autocast_dtype(model))
        m = copy.deepcopy(model).to(dtype)
        o = torch.optim.AdamW(m.parameters(), lr=0.0, weight_decay=0.1)
        return train_step(loss, m, o, *tensors, autocast_dtype=torch.float32)
    return ref


_nanogpt_train_reference = _train_reference(nanogpt_loss)


# ----------------------------------------------------------------------------- gpt-fast

def _llama_args(size) -> gptfast.ModelArgs:
    b, t, layers, width = size
    hd = 64 if width >= 256 else 16
    heads = width // hd
    hidden = int(2 * 4 * width / 3)
    hidden = (hidden + 255) // 256 * 256 if width >= 256 else 4 * width
    return gptfast.ModelArgs(block_size=t, vocab_size=32000 if width >= 256 else 512,
                             n_layer=layers, n_head=heads, n_local_heads=max(1, heads // 4),
                             dim=width, intermediate_size=hidden)


def gptfast_forward(model, idx, input_pos):
    return model(idx, input_pos)


def _gptfast_inputs(decode: bool):
    def make(size, device, dtype):
        b, t = size[0], size[1]
        model = _built(lambda s: gptfast.Transformer(_llama_args(s)), size, device, dtype)
        with torch.device(device):
            model.setup_caches(b, t)
        vocab = model.config.vocab_size
        if decode:  # a cache filled by an earlier prefill, the next token at the last slot
            for layer in model.layers:
                layer.attention.kv_cache.k_cache.normal_()
                layer.attention.kv_cache.v_cache.normal_()
            return (model, torch.randint(0, vocab, (b, 1), device=device),
                    torch.tensor([t - 1], device=device))
        return model, _ids(vocab, size, device), torch.arange(t, device=device)
    return make


# ----------------------------------------------------------------------------- Hugging Face

def _hf(builder, train: bool = False):
    def make(size, device, dtype):
        return _built(lambda s: builder(s[2], s[3], s[1]), size, device, dtype, train=train)
    return make


def _hf_causal(builder):
    def make(size, device, dtype):
        model = _hf(builder)(size, device, dtype)
        return model, _ids(model.config.vocab_size, size, device)
    return make


def _hf_bert_inputs(size, device, dtype):
    model = _hf(hf.bert)(size, device, dtype)
    return (model, _ids(model.config.vocab_size, size, device),
            hf.padding_mask(size[0], size[1], device))


def _hf_llama_train_inputs(size, device, dtype):
    model, opt = _trained(_hf(hf.llama, train=True)(size, device, dtype), dtype, device)
    return model, opt, _ids(model.config.vocab_size, size, device), _ids(model.config.vocab_size, size, device)


def _hf_bert_train_inputs(size, device, dtype):
    model, opt = _trained(_hf(hf.bert_mlm, train=True)(size, device, dtype), dtype, device)
    ids = _ids(model.config.vocab_size, size, device)
    mask = hf.padding_mask(size[0], size[1], device)
    return model, opt, ids, mask, hf.masked_lm_labels(ids, mask)


def _hf_t5_inputs(size, device, dtype):
    model = _hf(hf.t5)(size, device, dtype)
    dec = (size[0], max(1, size[1] // 4))
    return (model, _ids(model.config.vocab_size, size, device),
            hf.padding_mask(size[0], size[1], device), _ids(model.config.vocab_size, dec, device))


def _hf_vit_inputs(size, device, dtype):
    model = _hf(hf.vit)(size, device, dtype)
    return model, torch.randn(size[0], 3, size[1], size[1], device=device).to(dtype)


def _hf_requires(device) -> str | None:
    return hf.available()


# ----------------------------------------------------------------------------- ResNet-50

def _resnet_inputs(size, device, dtype):
    b, res, width = size[0], size[1], size[3]
    layers = (3, 4, 6, 3) if width == 64 else (1, 1, 1, 1)
    model = _built(lambda s: resnet.resnet50(width, layers)[0], size, device, dtype)
    x = torch.randn(b, 3, res, res, device=device).to(dtype)
    return model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)


def image_logits(model, x):
    return model(x)


def _vision_flops(inputs) -> float:
    return float(2 * _params(inputs[0]) * inputs[1].shape[0])  # a floor: convs reuse weights


# ----------------------------------------------------------------------------- the group

_LM_QUICK = (2, 32, 2, 64)

MODEL_WORKLOADS: list[Workload] = [
    _model_workload("nanogpt", _nanogpt_inputs, nanogpt_logits,
                    {"quick": _LM_QUICK, "full": (8, 1024, 12, 768)},
                    "nanoGPT GPT-2 small inference (tril buffer + masked_fill attention)"),
    _model_workload("nanogpt_train", _nanogpt_train_inputs, nanogpt_loss,
                    {"quick": _LM_QUICK, "full": (8, 1024, 6, 768)},
                    "nanoGPT training step: autocast, backward, AdamW (lr 0)",
                    flops=_lm_flops(6), ref_fn=_nanogpt_train_reference,
                    step=train_step),
    _model_workload("nanogpt_train_dropout", functools.partial(_nanogpt_train_inputs, build=_gpt_dropout),
                    nanogpt_loss, {"quick": _LM_QUICK, "full": (8, 1024, 6, 768)},
                    "nanoGPT training step with dropout 0.1 (attention, residual, embedding); the "
                    "accuracy column compares steps that drew different masks",
                    flops=_lm_flops(6), ref_fn=_nanogpt_train_reference, step=train_step),
    _model_workload("gptfast_prefill", _gptfast_inputs(False), gptfast_forward,
                    {"quick": _LM_QUICK, "full": (4, 2048, 8, 2048)},
                    "gpt-fast Llama prefill: RoPE, GQA, static KV cache, SDPA"),
    _model_workload("gptfast_decode", _gptfast_inputs(True), gptfast_forward,
                    {"quick": _LM_QUICK, "full": (8, 2048, 8, 2048)},
                    "gpt-fast Llama one-token decode against a full static KV cache"),
    _model_workload("hf_llama", _hf_causal(hf.llama), hf.causal_lm_logits,
                    {"quick": _LM_QUICK, "full": (4, 1024, 8, 2048)},
                    "Hugging Face LlamaForCausalLM", requires=_hf_requires),
    _model_workload("hf_gemma2", _hf_causal(hf.gemma2), hf.causal_lm_logits,
                    {"quick": _LM_QUICK, "full": (4, 1024, 8, 2048)},
                    "Hugging Face Gemma2ForCausalLM: soft-capping, sliding window",
                    requires=_hf_requires),
    _model_workload("hf_gpt2", _hf_causal(hf.gpt2), hf.causal_lm_logits,
                    {"quick": _LM_QUICK, "full": (8, 1024, 12, 768)},
                    "Hugging Face GPT2LMHeadModel", requires=_hf_requires),
    _model_workload("hf_bert", _hf_bert_inputs, hf.encoder_states,
                    {"quick": _LM_QUICK, "full": (16, 512, 12, 768)},
                    "Hugging Face BertModel with a right-padding attention mask",
                    requires=_hf_requires),
    _model_workload("hf_llama_train", _hf_llama_train_inputs, hf.causal_lm_loss,
                    {"quick": _LM_QUICK, "full": (4, 1024, 8, 2048)},
                    "Hugging Face LlamaForCausalLM training step: autocast, backward, AdamW (lr 0)",
                    flops=_lm_flops(6), ref_fn=_train_reference(hf.causal_lm_loss), step=train_step,
                    requires=_hf_requires),
    _model_workload("hf_bert_train", _hf_bert_train_inputs, hf.masked_lm_loss,
                    {"quick": _LM_QUICK, "full": (16, 512, 12, 768)},
                    "Hugging Face BertForMaskedLM training step (15% of tokens masked, right "
                    "padding, the configuration's dropout 0.1): autocast, backward, AdamW (lr 0); "
                    "the accuracy column compares steps that drew different masks",
                    flops=_lm_flops(6), ref_fn=_train_reference(hf.masked_lm_loss), step=train_step,
                    requires=_hf_requires),
    _model_workload("hf_t5", _hf_t5_inputs, hf.seq2seq_logits,
                    {"quick": _LM_QUICK, "full": (8, 512, 6, 512)},
                    "Hugging Face T5ForConditionalGeneration (decoder 1/4 the length)",
                    requires=_hf_requires),
    _model_workload("hf_vit", _hf_vit_inputs, hf.image_logits,
                    {"quick": (2, 32, 2, 64), "full": (32, 224, 12, 768)},
                    "Hugging Face ViTForImageClassification", items=_images,
                    size_names="B,res,layers,width",
                    unit="images/s", flops=_vision_flops, requires=_hf_requires),
    _model_workload("resnet50", _resnet_inputs, image_logits,
                    {"quick": (2, 32, 0, 8), "full": (32, 224, 0, 64)},
                    "ResNet-50 inference, channels_last (torchvision's when installed; at "
                    "test sizes one block per stage)", items=_images, unit="images/s",
                    flops=_vision_flops, size_names="B,res,-,width"),
]

__all__ = ["MODEL_WORKLOADS", "train_step"]
