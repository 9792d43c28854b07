"""What packed-ce knows of transformers' model families, in one place.

A family is exact packed when every path by which it mixes tokens keeps each conversation to
itself. Attention masks are read on the first packed call (``audit.py``) and the whole
model is probed there; what no mask shows is listed here:

- :data:`MIXERS`: the token-mixing modules that are not attention (short convolutions, gated delta
  rules, state-space scans, linear attention), each with what lets a packed row run whole
  (``mixers.py``);
- :data:`LEAKY_FAMILIES`, :data:`LEAKY_IMPLEMENTATIONS`: families packed-ce cannot keep apart,
  refused by name with the reason;
- :data:`ZERO_EMBEDDING_FAMILIES`: families without a finite gradient at a zero embedding;
- :data:`UNFUSABLE_CONFIG_FIELDS`: what the fused head cannot reproduce;
- :data:`EXACT_LAYER_TYPES`, :data:`DROPOUT_FIELDS`: what context parallelism reproduces of an
  attention layer, and the fields of the dropout it refuses.

``tests/test_families.py`` runs every causal-LM family of transformers and fails when a table and
what a family does disagree. A new family that mixes tokens another way is caught by the probe of
its first packed call (``audit.py``) before it trains; teach it here.
"""

from __future__ import annotations

from dataclasses import dataclass

_STATE = "the state of the conversation before"


@dataclass(frozen=True)
class Mixer:
    """How a token mixer's packed row can run whole instead of one conversation at a time.

    Attributes:
        kernels: the packages whose CUDA kernels keep a row's conversations apart given the
            boundaries transformers hands them (``seq_idx``, ``cu_seq_lens_q``); with all of them
            installed one row runs whole on CUDA, else each conversation alone (a warning names
            them). ``()``: no package needed (runs whole on any device); None: no kernel takes a
            boundary, always per conversation.
        conv: the family's module-level short convolution that packed-ce keeps within each
            conversation itself (``convolution.py``), so that ``causal-conv1d`` is not needed.
        boundary_keyword: the keyword that carries the row's ``cu_seqlens`` to the family's
            kernel through the mixer's ``**kwargs`` (transformers' gated delta rules take
            ``cu_seq_lens_q`` themselves: None).
    """

    kernels: tuple[str, ...] | None
    conv: str | None = None
    boundary_keyword: str | None = None


# Token mixers by class name.
_GATED_DELTA_RULE = Mixer(("fla",), conv="causal_conv1d_fn")
MIXERS: dict[str, Mixer] = {
    # a short convolution, then the gated delta rule (fla, cu_seqlens from cu_seq_lens_q)
    **dict.fromkeys(
        (
            "Qwen3_5GatedDeltaNet",
            "Qwen3_5MoeGatedDeltaNet",
            "Qwen3NextGatedDeltaNet",
            "Qwen4ExpTextGatedDeltaNet",
            "OlmoHybridGatedDeltaNet",
            "LaraMiniGatedDeltaNet",
        ),
        _GATED_DELTA_RULE,
    ),
    # Kimi delta attention: fla's chunk_kda takes the cu_seqlens the mixer's **kwargs carry
    **dict.fromkeys(
        ("KimiLinearDeltaAttention", "BailingHybridDeltaAttention"),
        Mixer(("fla",), conv="causal_conv1d_fn", boundary_keyword="cu_seqlens"),
    ),
    # Mamba 2: seq_idx into mamba_ssm's fused kernel (its PyTorch scan takes no boundary)
    **dict.fromkeys(
        (
            "NemotronHMamba2Mixer",
            "GraniteMoeHybridMambaLayer",
            "BambaMixer",
            "FalconH1Mixer",
            "Zamba2MambaMixer",
        ),
        Mixer(("causal_conv1d", "mamba_ssm")),
    ),
    # short convolutions: packed-ce's own, on any device
    **dict.fromkeys(
        ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv"), Mixer((), conv="causal_conv1d_fn")
    ),
    # Mamba 1's selective scan, linear attention, recurrences: no kernel takes a boundary
    **dict.fromkeys(
        (
            "JambaMambaMixer",
            "ZambaMambaMixer",
            "MiniMaxLightningAttention",
            "RecurrentGemmaRecurrentBlock",
            "Inkling2ShortConvolution",
            "Inkling2DynamicShortConvolution",
            "Inkling2LoopShortConvolution",
            "Inkling2LoopDynamicShortConvolution",
        ),
        Mixer(None),
    ),
}

# Families whose packed conversations see the one before for a reason packed-ce cannot remove:
# model_type -> why (tests/test_families.py fails when one becomes exact or another one leaks).
LEAKY_FAMILIES: dict[str, str] = {
    "mamba": f"its Mamba layers start each conversation from {_STATE} in the row (its forward "
    "passes them no boundary)",
    "falcon_mamba": f"its Mamba layers start each conversation from {_STATE} in the row (its "
    "forward passes them no boundary)",
    "mamba2": f"its Mamba 2 layers start each conversation from {_STATE} in the row "
    "(Mamba2ForCausalLM passes them no boundary)",
    "rwkv": f"its RWKV time mixing starts each conversation from {_STATE} in the row",
    "xlstm": f"its mLSTM layers start each conversation from {_STATE} in the row",
    "deepseek_v4": "its compressed attention pools blocks of tokens across conversations",
    "zaya": "its query and key convolutions (CCA) read the conversation before in the row",
    "inkling_text": "its short convolutions read the conversation before in the row (its layers "
    "pass them no boundary)",
}
# (family, implementation) pairs whose attention does not get the mask its layers do.
LEAKY_IMPLEMENTATIONS: dict[tuple[str, str], str] = {
    ("doge", "flex_attention"): "its attention builds its dynamic mask without the flex "
    "BlockMask, so flex attention gets no conversation boundary (eager and sdpa are exact)",
    ("gpt_oss", "flex_attention"): "its mask lets a conversation see the one before it",
}

# Families whose forward has no finite gradient at a token whose embedding is 0 (the embedding's
# padding_idx, which nn.Embedding keeps at 0): text model_type -> why. Such a token (a padding
# segment of PackedCollator's default pad_token_id=0) is refused (guards.py).
ZERO_EMBEDDING_FAMILIES: dict[str, str] = {
    "gemma3n_text": "AltUp scales each token by sqrt(mean(x**2)) of its embedding, whose gradient "
    "at 0 is 0 * inf",
}

# Configuration fields with which a causal LM's forward does more than ``lm_head`` (plus the final
# softcap) between the hidden states and the loss: the fused forward would silently drop it.
UNFUSABLE_CONFIG_FIELDS = {
    "logit_scale": "the logits are multiplied by config.logit_scale",
    "logits_scaling": "the logits are divided by config.logits_scaling",
}
# Layer types whose attention the context-parallel mask reproduces (a mixer's layers gather their
# inputs instead, MIXERS).
EXACT_LAYER_TYPES = {"full_attention", "sliding_attention"}
# Configuration fields holding a family's attention dropout (context parallelism refuses it in
# training, naming the field).
DROPOUT_FIELDS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
