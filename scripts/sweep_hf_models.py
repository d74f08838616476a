"""Hugging Face architectures the benchmark's zoo does not hold, from tiny configs with random
weights, through tilefuse on this machine's default target: inference outputs and a training
step's gradients (dropout off) against the same model in fp64 (fp32 where an op has no fp64
kernel: grouped MoE products), each beside eager fp32's own error. A model that raises is a
FAIL with the error; one further from the reference than a few times eager's error is BAD.

    PYTHONPATH=src python scripts/sweep_hf_models.py [all|Name,Name,...] [infer,train] [--dynamic]

`--dynamic` compiles with `dynamic=True` and runs three sequence lengths (11, 7, 16) through
the one compiled model (image models: three batch sizes), each checked the same way.

Found on 2026-12-05: Swin's patch merging read wrong rows (sympy's Mod rewrite, fixed in
`ir.symbolic.Mod`); every other model here matched eager. On 2026-12-08: Longformer's
overlapping chunks (`as_strided` of a transposed view) were refused and the graph fell back;
now read from the view realised in its traced strides. Jamba's training step had wrong
gradients: one value returned in two layouts was stored in one (`frontend/to_ir.py`).
"""
import sys
import warnings

import torch
import transformers

import tilefuse
from model_check import compare, sweep

W = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=97)


_SEQ2SEQ = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=97)


def cfg(name, **kw):
    return getattr(transformers, name + "Config")(**{**W, **kw})


CASES = {
    "Mistral": lambda: (transformers.MistralForCausalLM, cfg("Mistral", num_key_value_heads=2, sliding_window=8)),
    "Qwen2": lambda: (transformers.Qwen2ForCausalLM, cfg("Qwen2", num_key_value_heads=2)),
    "Qwen3": lambda: (transformers.Qwen3ForCausalLM, cfg("Qwen3", num_key_value_heads=2, head_dim=8)),
    "Phi3": lambda: (transformers.Phi3ForCausalLM, cfg("Phi3", num_key_value_heads=2, pad_token_id=0)),
    "GPTNeoX": lambda: (transformers.GPTNeoXForCausalLM, cfg("GPTNeoX")),
    "OPT": lambda: (transformers.OPTForCausalLM, transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, vocab_size=97, word_embed_proj_dim=32)),
    "Bloom": lambda: (transformers.BloomForCausalLM, transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=97)),
    "GPTJ": lambda: (transformers.GPTJForCausalLM, transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=97, rotary_dim=4, n_positions=64)),
    "Falcon": lambda: (transformers.FalconForCausalLM, cfg("Falcon")),
    "Mixtral": lambda: (transformers.MixtralForCausalLM, cfg("Mixtral", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "Qwen2Moe": lambda: (transformers.Qwen2MoeForCausalLM, cfg("Qwen2Moe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=32)),
    "Phi": lambda: (transformers.PhiForCausalLM, cfg("Phi")),
    "StableLm": lambda: (transformers.StableLmForCausalLM, cfg("StableLm", num_key_value_heads=2)),
    "Olmo": lambda: (transformers.OlmoForCausalLM, cfg("Olmo")),
    "Cohere": lambda: (transformers.CohereForCausalLM, cfg("Cohere")),
    "Gemma": lambda: (transformers.GemmaForCausalLM, cfg("Gemma", num_key_value_heads=2, head_dim=8)),
    "Gemma3": lambda: (transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**W, num_key_value_heads=2, head_dim=8, sliding_window=8)),
    "DistilBert": lambda: (transformers.DistilBertForMaskedLM, transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=97)),
    "Roberta": lambda: (transformers.RobertaForMaskedLM, cfg("Roberta")),
    "Electra": lambda: (transformers.ElectraForMaskedLM, cfg("Electra", embedding_size=16)),
    "Albert": lambda: (transformers.AlbertForMaskedLM, cfg("Albert", embedding_size=16)),
    "DebertaV2": lambda: (transformers.DebertaV2ForMaskedLM, cfg("DebertaV2")),
    "MPNet": lambda: (transformers.MPNetForMaskedLM, cfg("MPNet")),
    "Bart": lambda: (transformers.BartForConditionalGeneration, transformers.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=97)),
    "Whisper": lambda: (transformers.WhisperForConditionalGeneration, transformers.WhisperConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=97, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)),
    "ConvNext": lambda: (transformers.ConvNextForImageClassification, transformers.ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=5)),
    "Swin": lambda: (transformers.SwinForImageClassification, transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, num_labels=5)),
    "ResNet": lambda: (transformers.ResNetForImageClassification, transformers.ResNetConfig(hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], embedding_size=8, num_labels=5)),
    "MobileViT": lambda: (transformers.MobileViTForImageClassification, transformers.MobileViTConfig(
        image_size=32, patch_size=2, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
        num_attention_heads=2, num_labels=5)),
    "CLIPText": lambda: (transformers.CLIPTextModel, transformers.CLIPTextConfig(**W)),
    "ModernBert": lambda: (transformers.ModernBertForMaskedLM, cfg("ModernBert", global_attn_every_n_layers=2, local_attention=4, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)),
    "GPTBigCode": lambda: (transformers.GPTBigCodeForCausalLM, transformers.GPTBigCodeConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=97, multi_query=True, bos_token_id=1, eos_token_id=2)),
    "CodeGen": lambda: (transformers.CodeGenForCausalLM, transformers.CodeGenConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=97, rotary_dim=4, n_positions=64)),
    "Starcoder2": lambda: (transformers.Starcoder2ForCausalLM, cfg("Starcoder2", num_key_value_heads=2)),
    "Granite": lambda: (transformers.GraniteForCausalLM, cfg("Granite", num_key_value_heads=2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0)),
    "Dinov2": lambda: (transformers.Dinov2Model, transformers.Dinov2Config(**W, image_size=32, patch_size=4)),
    "Beit": lambda: (transformers.BeitForImageClassification, transformers.BeitConfig(**W, image_size=32, patch_size=4, use_relative_position_bias=True, num_labels=5)),
    "Segformer": lambda: (transformers.SegformerForSemanticSegmentation, transformers.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
        num_attention_heads=[1, 2], mlp_ratios=[2, 2], decoder_hidden_size=32, num_labels=5)),
    "Wav2Vec2": lambda: (transformers.Wav2Vec2ForCTC, transformers.Wav2Vec2Config(
        **W, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, pad_token_id=0,
        mask_time_prob=0.0)),  # (SpecAugment masks at random in training: no reference to compare with)
    "Mamba": lambda: (transformers.MambaForCausalLM, transformers.MambaConfig(
        hidden_size=32, num_hidden_layers=2, vocab_size=97, state_size=4, expand=2, conv_kernel=3)),
    "Mpt": lambda: (transformers.MptForCausalLM, transformers.MptConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=97, expansion_ratio=2)),
    "XLNet": lambda: (transformers.XLNetLMHeadModel, transformers.XLNetConfig(d_model=32, n_layer=2, n_head=4, d_inner=64, vocab_size=97)),
    "Funnel": lambda: (transformers.FunnelForMaskedLM, transformers.FunnelConfig(d_model=32, n_head=4, d_head=8, d_inner=64, block_sizes=[1, 1], vocab_size=97)),
    "Longformer": lambda: (transformers.LongformerForMaskedLM, cfg("Longformer", attention_window=4, max_position_embeddings=64)),
    "BigBird": lambda: (transformers.BigBirdForMaskedLM, cfg("BigBird", attention_type="original_full")),
    "LongT5": lambda: (transformers.LongT5ForConditionalGeneration, transformers.LongT5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=97, local_radius=3, decoder_start_token_id=0)),
    "Pegasus": lambda: (transformers.PegasusForConditionalGeneration, transformers.PegasusConfig(**_SEQ2SEQ)),
    "MBart": lambda: (transformers.MBartForConditionalGeneration, transformers.MBartConfig(**_SEQ2SEQ)),
    "FNet": lambda: (transformers.FNetForMaskedLM, cfg("FNet", use_tpu_fourier_optimizations=False)),
    "Mamba2": lambda: (transformers.Mamba2ForCausalLM, transformers.Mamba2Config(
        hidden_size=32, num_hidden_layers=2, vocab_size=97, state_size=4, expand=2, conv_kernel=3, num_heads=8, head_dim=8,
        n_groups=1, chunk_size=4)),
    "RecurrentGemma": lambda: (transformers.RecurrentGemmaForCausalLM, transformers.RecurrentGemmaConfig(
        hidden_size=32, num_hidden_layers=3, vocab_size=97, num_attention_heads=4, num_key_value_heads=1,
        intermediate_size=64, lru_width=32, attention_window_size=8, head_dim=8)),
    "Jamba": lambda: (transformers.JambaForCausalLM, cfg(
        "Jamba", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=3, mamba_expand=2)),
    "GraniteMoe": lambda: (transformers.GraniteMoeForCausalLM, cfg("GraniteMoe", num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "Olmoe": lambda: (transformers.OlmoeForCausalLM, cfg("Olmoe", num_key_value_heads=2, num_experts=4, num_experts_per_tok=2)),
    "Qwen3Moe": lambda: (transformers.Qwen3MoeForCausalLM, cfg(
        "Qwen3Moe", num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    "DeepseekV3": lambda: (transformers.DeepseekV3ForCausalLM, cfg(
        "DeepseekV3", num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        n_group=1, topk_group=1)),
    "Nemotron": lambda: (transformers.NemotronForCausalLM, cfg("Nemotron", num_key_value_heads=2, head_dim=8)),
    "Persimmon": lambda: (transformers.PersimmonForCausalLM, cfg("Persimmon")),
    "Olmo2": lambda: (transformers.Olmo2ForCausalLM, cfg("Olmo2", num_key_value_heads=2)),
    "Exaone4": lambda: (transformers.Exaone4ForCausalLM, cfg("Exaone4", num_key_value_heads=2, head_dim=8)),
    "Lfm2": lambda: (transformers.Lfm2ForCausalLM, cfg("Lfm2", num_key_value_heads=2, layer_types=["conv", "full_attention"], conv_L_cache=3)),
    "ConvBert": lambda: (transformers.ConvBertForMaskedLM, cfg("ConvBert", embedding_size=32, conv_kernel_size=3)),
    "SqueezeBert": lambda: (transformers.SqueezeBertForMaskedLM, cfg("SqueezeBert", embedding_size=32)),
    "Hubert": lambda: (transformers.HubertForCTC, transformers.HubertConfig(
        **W, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_feat_extract_layers=2,
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4, pad_token_id=0, mask_time_prob=0.0)),
    "DeiT": lambda: (transformers.DeiTForImageClassification, transformers.DeiTConfig(**W, image_size=32, patch_size=4, num_labels=5)),
}

#: models whose attention mask pads the start of the second sequence
PADDED = ("Roberta", "DistilBert", "Electra", "Albert", "DebertaV2", "MPNet", "CLIPText", "ModernBert", "Longformer",
          "BigBird", "Funnel", "ConvBert", "SqueezeBert")
#: models of 32×32 images (their dynamic runs vary the batch)
IMAGES = ("ConvNext", "ResNet", "Swin", "MobileViT", "Dinov2", "Beit", "Segformer", "DeiT")


def inputs_for(name, B=2, T=11):
    """The model's inputs: B sequences of T tokens (the second padded at its start where the
    model takes a padding mask), B images of 32×32."""
    g = torch.Generator().manual_seed(0)
    if name in IMAGES:
        return {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}
    if name in ("Wav2Vec2", "Hubert"):
        return {"input_values": torch.randn(B, 40 * T, generator=g)}
    if name == "Whisper":
        return {"input_features": torch.randn(B, 8, 32, generator=g),
                "decoder_input_ids": torch.randint(3, 97, (B, 7), generator=g)}
    ids = torch.randint(3, 97, (B, T), generator=g)
    if name in ("Mamba", "Mamba2", "RecurrentGemma", "FNet"):
        return {"input_ids": ids}
    mask = torch.ones(B, T, dtype=torch.long)
    if name in PADDED:
        mask[1, :3] = 0
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name in ("Bart", "LongT5", "Pegasus", "MBart"):
        inputs["decoder_input_ids"] = torch.randint(3, 97, (B, 7), generator=g)
    return inputs


def first(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def build(name):
    """(model, its copy as the reference, the reference's dtype): dropout off, SDPA attention
    where the model has it."""
    cls, config = CASES[name]()
    for k, v in list(vars(config).items()):
        if ("dropout" in k or "layerdrop" in k or k.endswith("_pdrop") or k == "drop_path_rate") \
                and isinstance(v, float):
            setattr(config, k, 0.0)
    torch.manual_seed(0)
    try:
        config._attn_implementation = "sdpa"
        model = cls(config)
    except ValueError:
        config._attn_implementation = "eager"
        model = cls(config)
    ref = cls(config)
    ref.load_state_dict(model.state_dict())
    try:  # fp64 where every op has an fp64 kernel (tried in eval mode: a batch norm's statistics stay)
        with torch.no_grad():
            ref.double().eval()(**{k: (v.double() if v.is_floating_point() else v) for k, v in inputs_for(name).items()})
        return model, ref, torch.float64
    except RuntimeError:
        return model, ref.float(), torch.float32


def run(name, train, dynamic=False):
    model, ref, dtype = build(name)
    model.train(train)
    ref.train(train)
    torch._dynamo.reset()
    compiled = tilefuse.compile(model, fallback="error", dynamic=True if dynamic else None)
    sizes = [(2, 11), (2, 7), (2, 16)] if dynamic else [(2, 11)]
    if dynamic and name in IMAGES:
        sizes = [(2, 11), (3, 11), (5, 11)]
    messages, ok = [], True
    for B, T in sizes:
        size_ok, msg = compare(model, ref, dtype, compiled, train, inputs_for(name, B, T), first)
        ok = ok and size_ok
        messages.append((f"B{B} T{T}: " if dynamic else "") + msg)
    return ok, "; ".join(messages)


def main():
    dynamic = "--dynamic" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--dynamic"]
    names = args[0].split(",") if args and args[0] != "all" else list(CASES)
    modes = args[1].split(",") if len(args) > 1 else ["infer", "train"]
    warnings.simplefilter("ignore")
    sweep(names, modes, lambda name, train: run(name, train, dynamic))


if __name__ == "__main__":
    main()
