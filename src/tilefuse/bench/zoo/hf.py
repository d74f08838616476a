"""Hugging Face transformers models built from configs with random weights (no hub access):
Llama, Gemma-2 (attention and final-logit soft-capping, sliding-window layers, eager
attention as Gemma-2 asks for), GPT-2, BERT with a padding mask (and with its masked-LM head
for training), T5 and ViT. Each builder
takes the size tuple's depth and width and returns the model; `available()` says why the
group cannot run when transformers is missing."""
from __future__ import annotations

import torch


def available() -> str | None:
    """None, or why these models cannot be built here."""
    try:
        import transformers  # noqa: F401
    except Exception as e:
        return f"transformers is not importable ({type(e).__name__}); pip install transformers"
    return None


def _heads(width: int) -> tuple[int, int]:
    """(heads, head dim): 64-wide heads at real sizes, 16-wide at test sizes."""
    head_dim = 64 if width >= 256 else 16
    return width // head_dim, head_dim


def llama(layers: int, width: int, seq: int):
    import transformers as T

    heads, hd = _heads(width)
    cfg = T.LlamaConfig(hidden_size=width, intermediate_size=int(width * 8 / 3) // 64 * 64 or 64,
                        num_hidden_layers=layers, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 4), vocab_size=32000,
                        max_position_embeddings=max(seq, 128), use_cache=False)
    return T.LlamaForCausalLM(cfg)


def gemma2(layers: int, width: int, seq: int):
    import transformers as T

    heads, hd = _heads(width)
    cfg = T.Gemma2Config(hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         head_dim=hd, vocab_size=32000, max_position_embeddings=max(seq, 128),
                         sliding_window=max(4, seq // 2), attn_logit_softcapping=50.0,
                         final_logit_softcapping=30.0, attn_implementation="eager",
                         use_cache=False)
    return T.Gemma2ForCausalLM(cfg)


def gpt2(layers: int, width: int, seq: int):
    import transformers as T

    heads, _ = _heads(width)
    cfg = T.GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=max(seq, 128),
                       vocab_size=50257, use_cache=False)
    return T.GPT2LMHeadModel(cfg)


def _bert_config(layers: int, width: int, seq: int):
    import transformers as T

    heads, _ = _heads(width)
    return T.BertConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=4 * width, vocab_size=30522,
                        max_position_embeddings=max(seq, 128))


def bert(layers: int, width: int, seq: int):
    import transformers as T

    return T.BertModel(_bert_config(layers, width, seq), add_pooling_layer=False)


def bert_mlm(layers: int, width: int, seq: int):
    """BERT with its masked-language-model head, for the training step."""
    import transformers as T

    return T.BertForMaskedLM(_bert_config(layers, width, seq))


def t5(layers: int, width: int, seq: int):
    import transformers as T

    heads, hd = _heads(width)
    cfg = T.T5Config(d_model=width, d_ff=4 * width, num_layers=layers, num_heads=heads, d_kv=hd,
                     vocab_size=32128, use_cache=False)
    return T.T5ForConditionalGeneration(cfg)


def vit(layers: int, width: int, image: int):
    import transformers as T

    heads, _ = _heads(width)
    cfg = T.ViTConfig(hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=4 * width, image_size=image,
                      patch_size=16 if image >= 64 else 8, num_labels=1000)
    return T.ViTForImageClassification(cfg)


# ----------------------------------------------------------------------------- calls
# Module-level functions (what the backends compile): the model and its tensors in, one tensor
# out, as a user's inference loop calls them.

def causal_lm_logits(model, input_ids):
    return model(input_ids=input_ids).logits


def encoder_states(model, input_ids, attention_mask):
    return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def seq2seq_logits(model, input_ids, attention_mask, decoder_input_ids):
    return model(input_ids=input_ids, attention_mask=attention_mask,
                 decoder_input_ids=decoder_input_ids).logits


def causal_lm_loss(model, opt, input_ids, labels):
    """A training step's loss (the model shifts the labels itself); `opt` rides along for the
    step around it."""
    return model(input_ids=input_ids, labels=labels).loss


def masked_lm_loss(model, opt, input_ids, attention_mask, labels):
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def masked_lm_labels(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """BERT's pre-training targets: 15% of the real tokens (at least one per row), -100
    (ignored) elsewhere and on padding."""
    picked = (torch.rand(input_ids.shape, device=input_ids.device) < 0.15) & attention_mask.bool()
    picked[:, 0] = True
    return torch.where(picked, input_ids, torch.full_like(input_ids, -100))


def image_logits(model, pixel_values):
    return model(pixel_values=pixel_values).logits


def padding_mask(batch: int, seq: int, device) -> torch.Tensor:
    """Right padding as a tokenizer makes it: row i keeps a random length in [seq/2, seq]
    (the first row full length), 1 for tokens, 0 for padding."""
    lengths = torch.randint(max(1, seq // 2), seq + 1, (batch,))
    lengths[0] = seq
    return (torch.arange(seq)[None, :] < lengths[:, None]).long().to(device)
