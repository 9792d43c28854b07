"""A tiny float32 model of any transformers causal-LM family, from its default configuration.

Every integer field that sizes weights is lowered by name (through the configuration's own names,
sub-configurations included): hidden 64, 4 heads of 16, 2 layers, vocabulary 128, 4 experts
choosing 2. Per-layer lists keep the first layer of each ``layer_types`` entry, so hybrid families
keep one layer of each kind. Dropout and router noise are 0, so that a packed batch and the same
conversations alone run the same function. Sliding windows become 6 tokens, shorter than the
conversations. A family these rules cannot build raises :class:`NotBuilt` with the reason.
"""

from __future__ import annotations

import re

import torch

VOCAB = 128
MAX_PARAMETERS = 3_000_000  # more means a field the rules below do not know
HIDDEN = 64
LAYERS = frozenset({
    "num_hidden_layers", "decoder_layers", "encoder_layers", "n_layer", "n_layers", "num_layers",
    "num_encoder_layers", "num_decoder_layers",
})
# (pattern on the field name, its tiny value), the first match wins; a value is only lowered.
RULES = (
    (r"^(hidden_size|d_model|n_embd|embed_dim|embedding_size|emb_dim|lru_width|hidden_size_global|"
     r"attention_hidden_size|word_embed_proj_dim)$", HIDDEN),
    (r"vocab(?!_offset)", VOCAB),
    (r"experts_per_tok|^moe_topk$|^moe_k$", 2),
    (r"shared_experts|^n_group$|^topk_group$|n_groups$", 1),
    (r"experts", 4),
    (r"^qk_head_dim$", None),  # derived below
    (r"head_dim|dim_head|d_head|head_size|headdim", 16),
    (r"heads$|^n_head$", 4),
    (r"rank$", 16),
    (r"(moe|expert).*(intermediate|ffn)|(intermediate|ffn).*(moe|expert)", 32),
    (r"intermediate|ffn|^d_ff$|^dim_ff$|^n_inner$|^dff$|^d_inner$|^mlp_dim$|feed_forward_size", 128),
    (r"^rotary_dim$", 8),
    (r"^sliding_window(_size)?$|^attention_window_size$", 6),
    (r"^hidden_size_per_layer_input$", 16),
)


class NotBuilt(Exception):
    """The family cannot be built tiny from its configuration; the message says why."""


def tiny_overrides(config) -> dict:
    """The fields of ``config`` (a ``PretrainedConfig``) to set for a tiny model, recursively."""
    from transformers import PretrainedConfig

    values = config.to_dict()
    out: dict = {}
    for key, value in values.items():
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            out[key] = {"model_type": sub.model_type, **tiny_overrides(sub)}
        elif isinstance(value, float) and re.search(r"drop|jitter|noise", key):
            out[key] = 0.0
        elif isinstance(value, int) and not isinstance(value, bool) and key not in LAYERS:
            tiny = next((tiny for pattern, tiny in RULES if re.search(pattern, key)), None)
            if tiny is not None and value > tiny:
                out[key] = tiny
    counts = [values[key] for key in LAYERS if isinstance(values.get(key), int) and values[key] > 0]
    if counts:
        count = max(counts)
        kinds = values.get("layer_types")
        keep = [0, 1]
        if isinstance(kinds, (list, tuple)) and len(kinds) == count and len(set(kinds)) > 1:
            keep = sorted({kind: kinds.index(kind) for kind in kinds}.values())
        keep = [index for index in keep if index < count]
        for key, value in values.items():
            if key in LAYERS and isinstance(value, int) and value > len(keep):
                out[key] = len(keep)
            elif isinstance(value, (list, tuple, str)) and len(value) == count and key != "model_type":
                picked = [value[index] for index in keep]
                out[key] = "".join(picked) if isinstance(value, str) else type(value)(picked)
    if all(key in values for key in ("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim")):
        out["qk_head_dim"] = sum(out.get(key, values[key]) for key in ("qk_nope_head_dim", "qk_rope_head_dim"))
    for prefix in ("mamba_", ""):  # Mamba 2: heads * head size == expand * hidden
        heads = next((k for k in (f"{prefix}n_heads", f"{prefix}num_heads") if k in out), None)
        size = next((k for k in (f"{prefix}d_head", f"{prefix}head_dim") if k in values), None)
        if heads and size and isinstance(values.get(f"{prefix}expand"), int):
            out[size] = values[f"{prefix}expand"] * out.get("hidden_size", HIDDEN) // out[heads]
    if isinstance(values.get("pad_token_id"), int) and values["pad_token_id"] >= VOCAB:
        out["pad_token_id"] = 0
    return out


def supports(model_type: str, attn_implementation: str) -> bool:
    """Whether the family's causal-LM class declares ``attn_implementation`` (eager always)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    flag = {"eager": None, "sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}
    if flag[attn_implementation] is None:
        return True
    model_class = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    return bool(getattr(model_class, flag[attn_implementation], False))


# Fields the rules above cannot derive, per family: hybrids keep one layer of each kind (a default
# configuration of all-attention or all-Mamba layers would test neither the mixers nor the
# attention), and shapes their validation ties together.
HYBRIDS = {
    "lfm2": dict(layer_types=["conv", "full_attention"], full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "falcon_h1": dict(mamba_d_head=32, mamba_d_ssm=None),
    "zamba2": dict(mamba_headdim=32, layers_block_type=["linear_attention", "hybrid"],
                   attention_hidden_size=128, attention_head_dim=32),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["linear_attention", "hybrid", "hybrid"],
                  attention_hidden_size=128, attention_head_dim=32),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    # no layer sharing another's cache (its default shares the last 15 of 35), per-layer sizes
    "gemma3n_text": dict(num_kv_shared_layers=0, intermediate_size=[128, 128]),
    "bailing_hybrid": dict(n_group=1, topk_group=1),
    "qwen4_exp_text": dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4),
}


def tiny_family_model(model_type: str, attn_implementation: str, seed: int = 0, device: str = "cpu"):
    """A tiny ``model_type`` causal LM in training mode with random weights fixed by ``seed``, on
    ``device`` (its first call there: a family whose kernels run on CUDA only is checked on CUDA).

    Raises:
        NotBuilt: the configuration or the model cannot be built tiny, or its text-only forward
            gives no logits for every token.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        fields = {**tiny_overrides(AutoConfig.for_model(model_type)), **HYBRIDS.get(model_type, {})}
        config = AutoConfig.for_model(model_type, **fields)
        if hasattr(config, "is_decoder"):  # the BERT family's causal LM needs it
            config.is_decoder = True
        config._attn_implementation = attn_implementation
        with torch.device("meta"):
            count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if count > MAX_PARAMETERS:
            raise NotBuilt(f"{count / 1e6:.1f}M parameters after shrinking")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train().to(device)
        tokens = torch.arange(3, 8, device=device)[None]
        with torch.no_grad():  # with labels: GIT's loss needs image tokens
            logits = model(input_ids=tokens, labels=tokens, use_cache=False).logits
    except NotBuilt:
        raise
    except Exception as error:  # any failure of the family's own code: reported, not hidden
        raise NotBuilt(f"{type(error).__name__}: {str(error).splitlines()[0][:120]}") from error
    if tuple(logits.shape[:2]) != (1, 5):
        raise NotBuilt(f"a text-only forward gives logits of shape {tuple(logits.shape)}")
    return model
