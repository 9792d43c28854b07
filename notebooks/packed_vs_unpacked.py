# %% [markdown]
# # Packed vs unpacked: the same loss, the same training
#
# Supervised fine-tuning data is a pile of conversations of very different lengths. Padding
# each one to the longest of its batch wastes compute on padding tokens; **packing** puts
# several conversations back to back in one row, so that every position holds a real token.
#
# Packing changes nothing about what the model sees, as long as attention stays inside each
# conversation (transformers does this from the `position_ids` that restart at 0 for every
# conversation). It does change the loss, though, if the loss is what a causal LM computes by
# default: **the mean over all target tokens of the batch**. Unpacked fine-tuning usually
# averages per conversation first; in a packed row the token mean gives a 200-token answer 100
# times the weight of a 2-token answer.
#
# In this notebook:
#
# 1. load the conversations with `datasets` and pack them;
# 2. plug the collators into a `DataLoader`;
# 3. **the naive way**: transformers' token mean on a packed row, and the per-token weights it uses;
# 4. **the right way**: `packed_ce` with `is_packed=True`, which weighs every target token of
#    conversation $s$ by $1/n_s$ ($n_s$ = targets of $s$) and averages over conversations:
#
# $$\mathcal{L} = \frac{1}{S}\sum_{s=1}^{S} \frac{1}{n_s} \sum_{t \in s} \ell_t$$
#
# 5. **a check**: batch by batch, packed = padded = one conversation at a time;
# 6. **a short training run** three ways from the same weights, and plots;
# 7. **a loss per data source**, from the loss's own pass;
# 8. **a vision-language model**: conversations with images, packed against unpacked.
#
# Everything runs offline on a CPU in under a minute: the corpus (English dialogues of the
# `chatterbot-corpus` package) and a small ChatML tokenizer ship with `collators`, and the model
# is a tiny Llama with random weights.

# %%
import math
import warnings
from dataclasses import asdict

# tqdm warns at import when Jupyter widgets are missing; this notebook does not use them
warnings.filterwarnings("ignore", message="IProgress not found")

import datasets
import matplotlib.pyplot as plt
import torch
from IPython.display import display
from torch.utils.data import DataLoader
from transformers.loss.loss_utils import ForCausalLMLoss

import collators
import packed_ce
from packed_ce.integrations import apply_packed_loss
from packed_ce_demo import (
    TOLERANCE,
    build_model,
    padded_loss,
    per_sequence_mean_loss,
    plot_losses,
    split_rows,
    step_batches,
    tiny_config,
    train_runs,
)

torch.manual_seed(0)
datasets.disable_progress_bars()  # last: the cell shows no value (a Generator's address would change)

# %% [markdown]
# ## 1. Conversations, tokenized and packed
#
# `load_default_dataset()` is a `datasets.Dataset` with a `messages` column, the format every
# chat data set on the hub uses. `tokenize_dataset` applies the tokenizer's chat template and
# keeps labels on the assistant turns only (their closing `<|im_end|>` included); everything
# else is `-100`.

# %%
dataset = collators.load_default_dataset()
tokenizer = collators.load_default_tokenizer()
print(dataset)
print(dataset[3]["messages"])

tokenized = collators.tokenize_dataset(dataset, tokenizer)
example = tokenized[3]
trained = [t for t, label in zip(example["input_ids"], example["labels"]) if label != -100]
print("\nthe whole conversation:\n" + tokenizer.decode(example["input_ids"]))
print("the trained tokens:\n" + tokenizer.decode(trained))

# %% [markdown]
# `pack_dataset` packs all conversations with best-fit-decreasing into rows of at most
# `max_length` tokens and records where each conversation starts (`seq_lengths`).

# %%
MAX_LENGTH = 256
packed, stats = collators.pack_dataset(tokenized, MAX_LENGTH, return_stats=True)
# rows come longest conversations first; a fixed shuffle mixes long and short in every batch
packed = packed.shuffle(seed=0)
lengths = [len(ids) for ids in tokenized["input_ids"]]
print(
    f"conversation lengths: min {min(lengths)}, median {sorted(lengths)[len(lengths) // 2]}, max {max(lengths)}"
)

# %% [markdown]
# The packing layout of a few rows: one colour per conversation, the trained (assistant) tokens
# dark, the untrained ones (system and user turns, template) light.


# %%
def layout_image(rows):
    """RGBA pixels: one colour per conversation, trained tokens opaque, untrained ones faded."""
    colours = torch.tensor(plt.get_cmap("tab10").colors)
    image = torch.ones(len(rows), MAX_LENGTH, 4)  # white: empty positions
    for y, row in enumerate(rows):
        labels = torch.tensor(row["labels"])
        start = 0
        for s, length in enumerate(row["seq_lengths"]):
            image[y, start : start + length, :3] = colours[s % len(colours)]
            image[y, start : start + length, 3] = torch.where(
                labels[start : start + length] != -100, 1.0, 0.3
            )
            start += length
    return image


layout_rows = [packed[i] for i in range(8)]
fig, ax = plt.subplots(figsize=(10, 3))
ax.imshow(layout_image(layout_rows), aspect="auto", interpolation="nearest")
ax.set(
    xlabel="token position in the packed row",
    ylabel="row",
    title=f"Packing layout ({stats.efficiency:.1%} of all positions hold a token)",
)
plt.show()

# %% [markdown]
# ## 2. DataLoaders: packed and padded, same conversations
#
# `PackedCollator` concatenates the rows of a batch into one row with `position_ids` restarting
# at every conversation, `cu_seqlens` (the conversation boundaries) and transformers' varlen
# keywords; it emits no `attention_mask`, so transformers builds a block-diagonal causal mask.
# For the unpacked baseline the same rows are split back into conversations and padded, one per
# row, by `PaddedCollator`. Both loaders read the rows in the same order, so batch `k` of one
# holds exactly the conversations of batch `k` of the other.

# %%
ROWS_PER_BATCH = 2
packed_loader = DataLoader(
    packed, batch_size=ROWS_PER_BATCH, shuffle=False, collate_fn=collators.PackedCollator()
)
padded_collator = collators.PaddedCollator(pad_token_id=tokenizer.pad_token_id)
padded_loader = DataLoader(
    packed,
    batch_size=ROWS_PER_BATCH,
    shuffle=False,
    collate_fn=lambda rows: padded_collator(split_rows(rows)),
)
packed_batch, padded_batch = next(iter(packed_loader)), next(iter(padded_loader))
for name, batch in (("packed", packed_batch), ("padded", padded_batch)):
    shapes = {k: tuple(v.shape) if torch.is_tensor(v) else v for k, v in batch.items()}
    print(f"{name}: {shapes}")

# %% [markdown]
# ## 3. The naive way: a token mean over the packed row
#
# A transformers causal LM called with `labels` computes `ForCausalLMLoss`: the sum of the
# target tokens' losses divided by their number, over the whole row. Each target token of the
# row weighs $1/N$, whichever conversation it belongs to. Per-sequence averaging weighs a
# target token of conversation $s$ by $1 / (S \cdot n_s)$ instead: every conversation counts
# the same, however long its answers.

# %%
config = tiny_config(len(tokenizer))
model = build_model(config, seed=0)


def answer_lengths(batch):
    """Trained tokens of each conversation of a packed batch."""
    bounds = batch["cu_seqlens"].tolist()
    return [int((batch["labels"][0, a:b] != -100).sum()) for a, b in zip(bounds[:-1], bounds[1:])]


# of the first 50 batches, the one whose answers differ most in length shows the effect best
example_batch = max(
    (batch for _, batch in zip(range(50), packed_loader)),
    key=lambda batch: max(answer_lengths(batch)) / max(min(answer_lengths(batch)), 1),
)
labels = example_batch["labels"][0]
cu_seqlens = example_batch["cu_seqlens"].tolist()
is_target = torch.zeros_like(labels, dtype=torch.bool)
is_target[:-1] = labels[1:] != -100  # logits[t] predicts labels[t + 1]
for end in cu_seqlens[1:]:
    is_target[end - 1] = False  # never across a conversation boundary
naive_weight = is_target.float() / is_target.sum()
per_sequence_weight = torch.zeros_like(naive_weight)
for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
    per_sequence_weight[start:end] = is_target[start:end].float() / is_target[
        start:end
    ].sum().clamp(min=1)
num_sequences = example_batch["num_sequences"]
per_sequence_weight /= num_sequences

# The same weights from the library: with uniform logits every target's loss is log V, and
# reduction="none" returns each token's weighted loss.
vocab = len(tokenizer)
uniform = torch.zeros(len(labels), vocab)
from_library = packed_ce.cross_entropy(
    uniform,
    labels,
    cu_seqlens=example_batch["cu_seqlens"],
    is_packed=True,
    shift=True,
    reduction="none",
) / (math.log(vocab) * num_sequences)
torch.testing.assert_close(from_library, per_sequence_weight)

fig, ax = plt.subplots(figsize=(10, 3))
ax.step(range(len(labels)), per_sequence_weight, where="post", label="per sequence: 1 / (S n_s)")
ax.step(range(len(labels)), naive_weight, where="post", label="naive token mean: 1 / N")
for boundary in cu_seqlens[1:-1]:
    ax.axvline(boundary, color="gray", lw=0.5)
ax.set(
    xlabel="token position in the packed batch (grey: conversation boundaries)",
    ylabel="weight in the loss",
    title="Per-token weights across a pack",
)
ax.legend()
plt.show()
print(f"{num_sequences} conversations with {answer_lengths(example_batch)} trained tokens")

# %% [markdown]
# ## 4. The right way: `apply_packed_loss(model, is_packed=True)`
#
# `apply_packed_loss` replaces the loss function of this one model instance (transformers'
# loss hook, undone by `remove_packed_loss`). The model's forward passes the extra batch keys
# (`cu_seqlens`, ...) to it, so `model(**batch)` now returns the per-sequence mean. For the
# padded batch the same loss reads the rows as the conversations.

# %%
apply_packed_loss(model, is_packed=True)
with torch.no_grad():
    packed_batch_loss = model(**packed_batch).loss
    padded_batch_loss = model(**padded_batch).loss
# three decimals: float32 sums differ in the last digits from one CPU to another (~1e-6)
print(f"packed, is_packed=True : {packed_batch_loss:.3f}")
print(f"padded, is_packed=True : {padded_batch_loss:.3f}")

# %% [markdown]
# ## 5. The check, batch by batch
#
# The ground truth does not know about packing at all: every conversation alone through the
# model, its mean token loss (`per_sequence_mean_loss` of `packed_ce_demo`, plain PyTorch),
# averaged over the conversations. Against it, for the first batches: the packed row with
# `is_packed=True`, the padded batch with the same per-sequence mean, and the naive token mean
# over the packed row.


# %%
def one_at_a_time(model, conversations):
    """Each conversation alone (a batch of one row, no padding), averaged over conversations."""
    losses = [
        per_sequence_mean_loss(
            model(input_ids=torch.tensor([c["input_ids"]])).logits, torch.tensor([c["labels"]])
        )
        for c in conversations
        if any(label != -100 for label in c["labels"][1:])  # nothing to learn from the others
    ]
    return torch.stack(losses).mean()


def naive_loss(model, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    return ForCausalLMLoss(logits, batch["labels"], logits.shape[-1])


print(
    f"{'batch':>5} {'convs':>5} {'one at a time':>14} {'packed':>8} {'padded':>8} {'naive':>8}"
)
worst = 0.0
with torch.no_grad():
    for k, (rows, p_batch, u_batch) in enumerate(
        zip(
            DataLoader(packed, batch_size=ROWS_PER_BATCH, collate_fn=list),
            packed_loader,
            padded_loader,
        )
    ):
        if k == 6:
            break
        conversations = split_rows(rows)
        truth = one_at_a_time(model, conversations)
        p, u, n = model(**p_batch).loss, padded_loss(model, u_batch), naive_loss(model, p_batch)
        worst = max(worst, abs(p - truth).item(), abs(u - truth).item())
        print(f"{k:>5} {len(conversations):>5} {truth:>14.3f} {p:>8.3f} {u:>8.3f} {n:>8.3f}")
# the bound, not the measured value: that changes in its digits from one CPU to another
print(f"largest |difference| to the ground truth: {'below' if worst <= 1e-5 else 'ABOVE'} 1e-5")
assert worst <= 1e-5

# %% [markdown]
# At random initialisation every token's loss is close to $\log V$, so any average of them is
# nearly the same number and the naive column is only a little off. The weights differ a lot,
# though, and so do the gradients; training shows it.
#
# ## 6. A short training run, three ways
#
# The same initial weights, the same batches, AdamW, float32: packed with `is_packed=True`,
# padded with the per-sequence mean, and packed with the naive token mean. This is what
# `packed-ce demo` runs (`train_runs` of `packed_ce_demo`), here on the rows of this notebook.

# %%
STEPS = 16
steps = step_batches(
    [packed[i] for i in range(STEPS * ROWS_PER_BATCH)],
    ROWS_PER_BATCH,
    pad_token_id=tokenizer.pad_token_id,
)
runs = train_runs(build_model(config, seed=0), steps, learning_rate=2e-3, progress=False)
gap = max(abs(a - b) for a, b in zip(runs["packed"].losses, runs["padded"].losses))
print(f"max |packed - padded| over {STEPS} steps: {'below' if gap <= TOLERANCE else 'ABOVE'} {TOLERANCE:g}")
assert gap <= TOLERANCE

# %%
display(plot_losses({name: asdict(run) for name, run in runs.items()}, TOLERANCE))

# %% [markdown]
# The packed run with `is_packed=True` is the unpacked per-sequence run, step for step, to
# float32 round-off; the naive token mean trains a different model. In a training script:
#
# ```python
# from collators import PackedCollator, pack_dataset
# from packed_ce.integrations import apply_packed_loss
#
# apply_packed_loss(model, is_packed=True)
# loader = DataLoader(pack_dataset(tokenized, 4096), batch_size=2, collate_fn=PackedCollator())
# for batch in loader:
#     model(**batch, use_cache=False).loss.backward()
# ```
#
# With gradient accumulation or several processes, `PackedTrainer` (or `count_num_items` in a
# custom loop) divides by the number of conversations of the whole optimiser step.

# %% [markdown]
# ## 7. A loss per data source
#
# Mixing data sources, one wants a loss curve per source. The loss kernel already computes every
# target's loss; with `return_seq_losses=True` it also returns each sequence's share of the loss
# and of the weight from that same pass (`packed_ce.SequenceLosses`), and a sum per source is all
# that is left: no second pass over the logits. `pack_dataset` carries a `source` column to every
# piece of a row (`seq_sources`), and `PackedCollator` hands it on. `PackedTrainer` and
# `PackedSFTTrainer` log `loss/<source>` this way, summed over their logging window.

# %%
assert tokenized.num_rows == dataset.num_rows  # every conversation has an assistant turn
sourced = collators.pack_dataset(tokenized.add_column("source", dataset["category"]), MAX_LENGTH)
sourced = sourced.shuffle(seed=0)
SOURCES = ["tech support", "trivia", "coding"]  # the corpus's three largest categories
ROWS, WINDOW = 8, 2  # rows per step, steps per point (a source is not in every batch)

model = build_model(config, seed=0)
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
collate = collators.PackedCollator()
sums = torch.zeros(len(SOURCES), 2)  # per source: sum of sequence losses, sum of weights
curves = {name: [] for name in SOURCES}
for step in range(2 * STEPS):
    batch = collate([sourced[i] for i in range(step * ROWS, (step + 1) * ROWS)])
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss, shares = packed_ce.cross_entropy(
        logits, batch["labels"], cu_seqlens=batch["cu_seqlens"], is_packed=True, shift=True,
        return_seq_losses=True,
    )
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    # the shares are divided by this batch's D (its conversations with a target): times D they
    # are each conversation's mean loss and weight 1, which add up over the window's batches
    scale = batch["num_sequences"]
    for k, name in enumerate(SOURCES):
        mine = torch.tensor([source == name for source in batch["seq_sources"]])
        sums[k] += torch.stack([shares.loss[mine].sum(), shares.weight[mine].sum()]) * scale
    if (step + 1) % WINDOW == 0:
        for k, name in enumerate(SOURCES):
            curves[name].append(float(sums[k, 0] / sums[k, 1]) if sums[k, 1] > 0 else math.nan)
        sums.zero_()
print({name: [round(v, 1) for v in values[-2:]] for name, values in curves.items()})  # after training: one decimal

# %%
fig, ax = plt.subplots(figsize=(10, 3))
for name, values in curves.items():
    ax.plot([(i + 1) * WINDOW for i in range(len(values))], values, marker="o", label=f"loss/{name}")
ax.set_xlabel("step")
ax.set_ylabel("mean over the source's conversations")
ax.set_title("per-source loss, from the loss kernel's per-sequence sums")
ax.legend()
plt.show()

# %% [markdown]
# ## 8. A vision-language model: images in the packed row
#
# A packed row of a vision-language model holds its conversations' images too. Each conversation
# must still be alone: Qwen2-VL gives every image token a temporal, height and width position
# from the image's grid (its own rope index over a packed row would run on from the conversation
# before), its vision tower must see each image alone, and the image tokens are no targets.
# `tokenize_dataset` with the model's processor expands each image to its tokens,
# `pack_dataset` keeps every row's images, `collators.VisionCollator` adds the processor's
# pixel values and grids, and the model with the packed loss builds each conversation's
# positions as alone. Below, a tiny Qwen2-VL on conversations about generated images: the packed
# rows against one padded row per conversation, loss and every gradient (the vision tower's
# included). `PackedSFTTrainer(processing_class=processor, ...)` does the same with trl's data.

# %%
from packed_ce.integrations import tiny_vision_lm

processor = collators.load_default_processor("qwen2_vl")  # or AutoProcessor.from_pretrained(...)
pictures = collators.load_default_image_dataset(12)  # messages with image parts, and images
with_images = collators.tokenize_dataset(pictures, processor)
packed_pictures = collators.pack_dataset(with_images, MAX_LENGTH)
print(
    f"{with_images.num_rows} conversations, {sum(len(i) for i in pictures['images'])} images: "
    f"{packed_pictures.num_rows} packed rows of up to {MAX_LENGTH} tokens, "
    f"images per row {[len(row) for row in packed_pictures['images']]}"
)

vlm = apply_packed_loss(tiny_vision_lm(processor, "qwen2_vl"))
results = {}
for name, collate in (
    ("packed", collators.VisionCollator(processor)),
    ("padded", collators.VisionCollator(processor, packed=False)),
):
    rows = packed_pictures if name == "packed" else with_images
    batch = collate(list(rows))  # every conversation in one batch: the mean over all of them
    vlm.zero_grad()
    loss = vlm(**batch).loss
    loss.backward()
    results[name] = (loss.item(), {n: p.grad.clone() for n, p in vlm.named_parameters()})
    print(f"{name}: input_ids {tuple(batch['input_ids'].shape)}, loss {loss.item():.3f}")
(packed_loss, packed_grads), (padded_loss, padded_grads) = results["packed"], results["padded"]
# every gradient as one vector: |g_packed - g_padded| / |g_padded|
difference = torch.cat([(packed_grads[n] - g).flatten() for n, g in padded_grads.items()])
worst = (difference.norm() / torch.cat([g.flatten() for g in padded_grads.values()]).norm()).item()
print(f"packed vs padded: loss and gradients {'below' if worst <= TOLERANCE else 'ABOVE'} {TOLERANCE:g}")
assert abs(packed_loss - padded_loss) <= TOLERANCE * abs(padded_loss) and worst <= TOLERANCE
