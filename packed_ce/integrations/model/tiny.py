"""A tiny causal LM with random weights: runnable examples and tests on CPU in seconds."""

from __future__ import annotations

import torch

# 2 layers, hidden 64, 4 query heads sharing 2 key/value heads (grouped-query attention, as in
# the models people fine-tune): about 0.1M parameters besides the embeddings.
TINY_FIELDS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def tiny_causal_lm(
    vocab_size: int,
    *,
    model_type: str = "llama",
    attn_implementation: str = "sdpa",
    seed: int = 0,
    **config_fields,
):
    """A float32 transformers causal LM with random weights, the same for the same ``seed``.

    Stands in for ``AutoModelForCausalLM.from_pretrained(...)`` offline; transformers' defaults
    otherwise (``use_cache=True``).

    Args:
        vocab_size: the tokenizer's vocabulary size.
        model_type: any decoder-only ``model_type`` of transformers ("llama", "qwen2",
            "mistral", "gemma2", ...).
        attn_implementation: "sdpa", "eager", "flex_attention" or "flash_attention_2".
        seed: seeds the initialisation (the caller's random state is left as it was).
        **config_fields: other configuration fields (e.g. ``final_logit_softcapping``).

    Returns:
        ``transformers.PreTrainedModel`` in training mode, on the CPU.

    Example:
        >>> model = tiny_causal_lm(vocab_size=128)
        >>> model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape
        torch.Size([1, 3, 128])
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, **{**TINY_FIELDS, "vocab_size": vocab_size, **config_fields}
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()
