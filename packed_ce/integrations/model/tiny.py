"""Tiny models with random weights, a causal LM and vision-language models: runnable examples and
tests on CPU in seconds.
"""

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


# The text model of tiny_vision_lm: tiny_causal_lm's, with heads of 8 (the multimodal rotary
# sections below split the 4 frequencies of a head: temporal 1, height 1, width 2).
_VISION_TEXT = dict(TINY_FIELDS, hidden_size=32, intermediate_size=64, head_dim=8)
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}
_QWEN_VISION = dict(
    depth=2,
    embed_dim=32,
    hidden_size=32,
    out_hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    mlp_ratio=2,
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    # Qwen2.5-VL: windows of one merged token on the first block, the whole image on the second
    window_size=28,
    fullatt_block_indexes=[1],
    # Qwen3-VL and Qwen3.5: an 8 x 8 table of learned positions, deep features from block 0
    num_position_embeddings=64,
    deepstack_visual_indexes=[0],
)
_MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    decoder_sparse_step=1,
)


def tiny_vision_lm(
    processor,
    model_type: str,
    *,
    attn_implementation: str = "sdpa",
    seed: int = 0,
    **model_kwargs,
):
    """A float32 tiny vision-language model of ``model_type`` matching ``processor``.

    Stands in for ``AutoModelForImageTextToText.from_pretrained(...)`` offline: the vocabulary
    and the image token ids of ``processor``'s tokenizer, its image sizes (one image token per
    ``processor``'s merged patch), 2 text layers of hidden size 32 (a gated delta rule and an
    attention layer for Qwen3.5, a sliding and a global layer for Gemma 3, experts for the MoE
    families) and a 1-2 layer vision tower. Every weight random (Gemma 3's image projection too,
    which transformers starts at zero), the same for the same ``seed``.

    Args:
        processor: the family's processor (``collators.load_default_processor(model_type)``).
        model_type: ``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"qwen3_vl"``, ``"qwen3_vl_moe"``,
            ``"qwen3_5"``, ``"qwen3_5_moe"``, ``"gemma3"`` or ``"llava"``.
        attn_implementation: for the text and the vision model.
        seed: seeds the initialisation.
        **model_kwargs: for ``from_config`` (``experts_implementation="eager"`` for a MoE in
            float64).

    Returns:
        ``transformers`` ``...ForConditionalGeneration`` in training mode, on the CPU.
    """
    from transformers import AutoConfig, AutoModelForImageTextToText

    tokenizer = processor.tokenizer
    special = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    text = dict(_VISION_TEXT, vocab_size=len(tokenizer), **special)
    if model_type == "gemma3":
        text.update(
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=8,
        )
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=processor.image_processor.size["height"],
            patch_size=7,
        )
        ids = dict(
            image_token_id=tokenizer.image_token_id,
            boi_token_id=tokenizer.boi_token_id,
            eoi_token_id=tokenizer.eoi_token_id,
            mm_tokens_per_image=processor.image_seq_length,
        )
    elif model_type == "llava":
        text["model_type"] = "llama"
        vision = dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=processor.image_processor.size["height"],
            patch_size=processor.patch_size,
            projection_dim=32,
        )
        ids = dict(
            image_token_id=processor.image_token_id,
            vision_feature_layer=-1,
            vision_feature_select_strategy=processor.vision_feature_select_strategy,
        )
    else:
        text["rope_parameters"] = dict(_MROPE)
        if model_type.startswith("qwen3_5"):
            text.update(
                layer_types=["linear_attention", "full_attention"],
                linear_num_key_heads=2,
                linear_num_value_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_conv_kernel_dim=4,
                partial_rotary_factor=1.0,
            )
            text["rope_parameters"]["mrope_interleaved"] = True
        if model_type.endswith("moe"):
            text.update(_MOE)
        vision = dict(_QWEN_VISION, patch_size=processor.image_processor.patch_size)
        ids = dict(
            image_token_id=processor.image_token_id,
            video_token_id=processor.video_token_id,
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        )
    config = AutoConfig.for_model(
        model_type, text_config=text, vision_config=vision, **ids, **special
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(
            config, dtype=torch.float32, attn_implementation=attn_implementation, **model_kwargs
        )
        projection = getattr(model.model, "multi_modal_projector", None)
        weight = getattr(projection, "mm_input_projection_weight", None)
        if weight is not None:  # zeros from transformers: the vision tower would get no gradient
            torch.nn.init.normal_(weight, std=weight.shape[0] ** -0.5)
    return model.train()
