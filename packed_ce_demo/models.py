"""The demo's models: a tiny causal LM from a configuration, with random weights.

Nothing here downloads weights: :func:`build_model` initialises from a configuration, so the
demo, the notebook and the tests run offline.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# The default model: the Llama of packed_ce.integrations.tiny_causal_lm (2 layers, hidden 64),
# small enough to train a few steps on a laptop CPU in seconds.
from packed_ce.integrations.model.tiny import TINY_FIELDS


def tiny_config(
    vocab_size: int,
    *,
    model_type: str = "llama",
    attn_implementation: str = "sdpa",
    **overrides,
):
    """A tiny causal-LM configuration (2 layers, hidden 64, 4 heads) for tests and the demo.

    Args:
        vocab_size: the tokenizer's vocabulary size.
        model_type: any decoder-only ``model_type`` of transformers ("llama", "qwen2", "mistral",
            "gemma2", ...).
        attn_implementation: "sdpa", "eager" or "flash_attention_2".
        **overrides: other configuration fields.

    Returns:
        ``transformers.PretrainedConfig`` with ``use_cache=False``.
    """
    from transformers import AutoConfig

    fields = {**TINY_FIELDS, "vocab_size": vocab_size, "use_cache": False, **overrides}
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = attn_implementation
    return config


def build_model(config, *, seed: int = 0, device: str | torch.device = "cpu"):
    """A causal LM with random float32 weights from ``config``, the same for the same ``seed``.

    Args:
        config: a ``transformers.PretrainedConfig``.
        seed: seeds the initialisation.
        device: where the model lives.

    Returns:
        ``transformers.PreTrainedModel`` in training mode.
    """
    from transformers import AutoModelForCausalLM

    # a private RNG state: the caller's random streams are left as they were
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device).train()


def load_model_config(spec: str | None, vocab_size: int, *, attn_implementation: str = "sdpa"):
    """The model configuration of ``--model-config``.

    Args:
        spec: None (the tiny Llama of :func:`tiny_config`), a JSON file with configuration fields
            (``model_type`` defaults to "llama", ``vocab_size`` to the tokenizer's), or a hub name
            (only its configuration is read; the weights are random).
        vocab_size: the tokenizer's vocabulary size.
        attn_implementation: the attention implementation to use.

    Returns:
        ``transformers.PretrainedConfig`` with ``use_cache=False``.

    Raises:
        ValueError: naming ``--model-config``, if it cannot be loaded or its vocabulary is
            smaller than the tokenizer's.
    """
    from transformers import AutoConfig

    from .data import naming_flag

    with naming_flag("--model-config", spec):
        if spec is None:
            config = tiny_config(vocab_size, attn_implementation=attn_implementation)
        elif Path(spec).is_file():
            fields = json.loads(Path(spec).read_text())
            fields.setdefault("vocab_size", vocab_size)
            config = tiny_config(
                fields.pop("vocab_size"),
                model_type=fields.pop("model_type", "llama"),
                attn_implementation=attn_implementation,
                **fields,
            )
        else:
            config = AutoConfig.from_pretrained(spec)
            config.use_cache = False
            config._attn_implementation = attn_implementation
    if config.vocab_size < vocab_size:
        raise ValueError(
            f"`--model-config` has vocab_size={config.vocab_size}, smaller than the tokenizer's "
            f"{vocab_size}"
        )
    return config
