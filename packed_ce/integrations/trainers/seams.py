"""Where packed-ce depends on other libraries beyond their public API, and what it changes
globally, each in one place.

The trainers and the model integration override a private method or read a private attribute
only where no public hook serves; :data:`PRIVATE_SEAMS` lists every such name (trl,
transformers, datasets, accelerate, torch), with the parameters of each method, checked against
:data:`CHECKED`.
:data:`GLOBAL_STATE` lists every process-wide change and why it stays.
``tests/test_integration_guards.py`` fails when a name is gone or a method's parameters changed in
the installed version (an override of a method that is no longer called, or called otherwise,
would silently do nothing) and when a guard that refuses another objective stops firing:

- a ``transformers.Trainer`` other than the packed ones (trl's ``SFTTrainer`` included) refuses
  at ``train()`` a model with the packed loss (``model/other_trainers.py``);
- a wrapper of the installed forward that runs the decoder itself (trl's ``fused_lm_head=True``)
  is refused by the decoder's pre-hook (:func:`refuse_bypass`);
- trl's ``fused_lm_head=True`` reaching the installed forward is refused (:func:`checked_call`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet

# The trl versions PackedSFTTrainer was tested with: the ``trl`` extra of pyproject.toml (a test
# keeps the two equal).
TRL_TESTED = ">=1.16,<1.17"
CHECKED = "trl 1.16, transformers 5.24"


@dataclass(frozen=True)
class Seam:
    """A private name of another library packed-ce relies on."""

    owner: str  # the class or module holding it, as imported
    name: str
    why: str  # what it does here, and why no public hook serves
    parameters: tuple[str, ...] | None = None  # a method's, after self; None: an attribute


# accelerate's mark of a prepared model (Accelerator.prepare_model): set on the bare model when an
# evaluation prepares it, it kept the training's prepare from wrapping it in DDP.
ACCELERATE_PREPARED = "_is_accelerate_prepared"

PRIVATE_SEAMS = (
    Seam(
        "trl.SFTTrainer",
        "_prepare_dataset",
        "overridden: trl tokenises, then PackedSFTTrainer "
        "packs (bfd / bfd_split keeping weight and source) and builds assistant labels for "
        "templates without generation markers; trl has no public step between the two",
        ("dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"),
    ),
    Seam(
        "trl.SFTConfig",
        "assistant_only_loss",
        "set to False around SFTTrainer.__init__ for a "
        "template without generation markers, which trl refuses or replaces; the labels come "
        "from collators.tokenize_conversation instead",
    ),
    Seam("trl.SFTTrainer", "_metrics", "trl's logged metrics, appended to as trl does"),
    Seam("trl.SFTTrainer", "_total_train_tokens", "trl's num_tokens, counted as trl counts it"),
    Seam("trl.SFTTrainer", "_tp_size", "trl's tensor-parallel divisor of num_tokens"),
    Seam(
        "transformers.Trainer",
        "_get_num_items_in_batch",
        "overridden: the step's normaliser "
        "(sequences, not tokens), counted over all micro-batches before the first forward",
        ("batch_samples", "device"),
    ),
    Seam(
        "transformers.Trainer",
        "_set_signature_columns_if_needed",
        "overridden: keeps the "
        "packed rows' columns (seq_lengths, weights, sources) for the collator",
        (),
    ),
    Seam("transformers.Trainer", "_signature_columns", "the kept columns, extended"),
    Seam(
        "transformers.Trainer",
        "_prepare_inputs",
        "overridden: seq_weights move to the device "
        "in their own dtype; under DeepSpeed the Trainer casts every floating tensor of a batch "
        "to the engine's dtype (bf16 would round each weight, the normaliser would not)",
        ("inputs",),
    ),
    Seam(
        "transformers.Trainer",
        "_prepare_context_parallel_inputs",
        "overridden: under "
        "ParallelismConfig(cp_size) each rank gets its shard of the packed row "
        "(enable_context_parallel) instead of accelerate's ring attention, which is causal over "
        "the whole row; training_step calls it after counting num_items_in_batch",
        ("model", "inputs"),
    ),
    Seam(
        "transformers.trainer",
        "DEFAULT_CALLBACKS",
        "the callbacks of every Trainer: "
        "RefuseOtherTrainers joins them, the one way to reach a stock Trainer",
    ),
    Seam(
        "transformers.PreTrainedModel",
        "_loss_function",
        "where the loss_function property's "
        "setter stores a model's own loss: read and restored by apply_packed_loss / "
        "remove_packed_loss, which change one instance, not its class",
    ),
    Seam(
        "transformers.PretrainedConfig",
        "_attn_implementation",
        "the attention a model runs, "
        "read before enable_context_parallel switches it (set_attn_implementation) and restored "
        "by disable_context_parallel",
    ),
    Seam(
        "accelerate.Accelerator",
        ACCELERATE_PREPARED,
        "the mark Accelerator.prepare_model leaves on a model it prepared (an attribute of the "
        "model): taken off a bare model that evaluate() prepared, so that train() wraps it in "
        "DDP (the trainers' train); accelerate has no public way to prepare it again",
    ),
    Seam(
        "accelerate.data_loader.BatchSamplerShard",
        "process_index",
        "with num_processes, batch_size, split_batches, drop_last and even_batches (checked "
        "alike): where accelerate completes an epoch's last batch with copies of its first "
        "examples, left out of the step and of eval_loss (copies.py); accelerate says where "
        "nowhere else",
    ),
    *(
        Seam("accelerate.data_loader.BatchSamplerShard", name, "as process_index")
        for name in ("num_processes", "batch_size", "split_batches", "drop_last", "even_batches")
    ),
    Seam(
        "accelerate.state.GradientState",
        "remainder",
        "the real examples of the last batch, read with end_of_dataloader when the loader hands "
        "that batch over (copies.py)",
    ),
    Seam("accelerate.state.GradientState", "end_of_dataloader", "as remainder"),
    Seam(
        "torch._dynamo._trace_wrapped_higher_order_op",
        "TransformGetItemToIndex",
        "how flex attention itself evaluates a mask_mod on index tensors; the audit reads a "
        "BlockMask's partial blocks through it (model/audit.py)",
    ),
    *(
        Seam(
            "torch.nn.attention.flex_attention.BlockMask",
            name,
            "the blocks of a flex-attention mask, read by the audit pair by pair",
        )
        for name in (
            "kv_num_blocks",
            "kv_indices",
            "full_kv_num_blocks",
            "full_kv_indices",
            "BLOCK_SIZE",
            "mask_mod",
        )
    ),
    Seam(
        "transformers.modeling_layers.GradientCheckpointingLayer",
        "_gradient_checkpointing_func",
        "a checkpointed decoder layer's checkpointing function, which transformers sets when "
        "checkpointing is enabled: wrapped (model/mixers.py, Replayed) so that its recomputation "
        "records the layer's keywords for a mixer the layer calls without them (Jamba's); the "
        "recomputation runs past the layer's hooks",
    ),
    Seam(
        "transformers.models.qwen3_5.modeling_qwen3_5",
        "causal_conv1d_fn",
        "a hybrid family's module-level short convolution (each family of families.MIXERS with a "
        "conv: tests/test_mixers.py checks them all), replaced by model/convolution.py's, which "
        "keeps each packed conversation apart without the causal-conv1d package",
    ),
    Seam(
        "datasets.Dataset",
        "_fingerprint",
        "the data's identity in the keys of the pack and "
        "tokenize caches (collators/cache.py): datasets has no public accessor",
    ),
    Seam(
        "datasets.Dataset",
        "_indices",
        "a select/shuffle view's indices mapping: pack_dataset "
        "flattens it so that the tokens are read in place, in order",
    ),
)

# Every process-wide change packed-ce makes, and why it stays: nothing else outlives a call, a
# remove_packed_loss or a disable_context_parallel (tests/test_integration_guards.py).
GLOBAL_STATE = (
    (
        "transformers.trainer.DEFAULT_CALLBACKS",
        "RefuseOtherTrainers appended by the first apply_packed_loss",
        "the one way to reach a stock Trainer created later; it does nothing "
        "for a model without the packed loss, and removing it would need a registry of models",
    ),
    (
        "transformers.AttentionInterface",
        "packed_ce_context_parallel registered by the first enable_context_parallel",
        "stateless (each call brings its row layout); a model uses it "
        "only while context parallelism is enabled on it",
    ),
    (
        "context_parallel.blocks._compiled_flex_attention",
        "flex_attention compiled on the first long row",
        "compiling costs seconds, and transformers keeps its own compiled copy the same way",
    ),
    (
        "forward._running",
        "a thread-local count of packed forwards running",
        "0 outside a "
        "forward: the decoder's pre-hook tells a call through the packed forward from one past it",
    ),
    (
        "model.mixers._layers",
        "a thread-local stack of the decoder layer calls running",
        "empty outside a forward and a recomputation: a mixer its layer calls without keywords "
        "finds the call's layout in its layer's call",
    ),
    (
        "transformers.models.<family>.modeling_<family>.causal_conv1d_fn",
        "replaced by model/convolution.py's WithinConversations when a model with such a mixer "
        "gets the packed loss",
        "the family's forward looks the name up at each call; a call without seq_idx, or with "
        "causal-conv1d installed, runs the family's own function: other models run as before",
    ),
    (
        "pending",
        "the queue of value checks made on the device",
        "emptied by each loss call's check and check_pending(); discard_pending() clears it",
    ),
)


def warn_if_untested_trl() -> None:
    """Warns (once per calling line) when the installed trl is outside :data:`TRL_TESTED`."""
    import trl

    if not SpecifierSet(TRL_TESTED).contains(trl.__version__, prereleases=True):
        warnings.warn(
            f"PackedSFTTrainer is tested with trl{TRL_TESTED} (pip install 'packed-ce[trl]'), "
            f"this is trl {trl.__version__}: it relies on private trl methods "
            "(packed_ce/integrations/trainers/seams.py) that may have changed",
            UserWarning,
            stacklevel=3,
        )
