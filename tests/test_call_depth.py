"""The path from ``PackedTrainer.compute_loss`` to the launch of the Triton cross-entropy kernel
stays short: at most ``MAX_HOPS`` Python frames of ``packed_ce/`` and ``collators/``; and a
batch's ``seq_weights`` is read in at most ``MAX_FILES`` library files on its way, none of them
twice.

Counted on a real call: a tiny Llama with :func:`apply_packed_loss` (``backend="triton"``), a
:class:`collators.PackedCollator` batch, ``PackedTrainer.compute_loss``. The kernel object is
replaced by a recorder whose ``__getitem__`` (the ``kernel[grid]`` of the launch) takes
``traceback.extract_stack()``; from the innermost ``compute_loss`` frame down to the launching
frame, every frame whose file lies in ``packed_ce/`` or ``collators/`` is one hop (frames of
torch, transformers and the test are not counted). On CPU the kernel runs through the Triton
interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

import packed_ce
from collators import PackedCollator
from packed_ce.integrations import PackedTrainer, apply_packed_loss
from packed_ce.kernels import cross_entropy as kernel_module
from packed_ce.runtime import interpreting

from integration_utils import synthetic_conversations, tiny_model

MAX_HOPS = 8
MAX_FILES = 8
VOCAB = 96
ROOT = Path(packed_ce.__file__).resolve().parent.parent
LIBRARY = (ROOT / "packed_ce", ROOT / "collators")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not interpreting(), reason="the kernel on CPU needs TRITON_INTERPRET=1"
)


class LaunchRecorder:
    """Stands in for a Triton kernel: records the Python stack of every ``kernel[grid](...)``."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.stacks: list[traceback.StackSummary] = []

    def __getitem__(self, grid):
        self.stacks.append(traceback.extract_stack()[:-1])  # without this frame
        return self.kernel[grid]


def library_hops(stack: traceback.StackSummary, entry: str) -> list[str]:
    """``file:function`` of each library frame from the innermost ``entry`` frame to the last."""
    start = max(i for i, frame in enumerate(stack) if frame.name == entry)
    hops = []
    for frame in stack[start:]:
        path = Path(frame.filename).resolve()
        if any(path.is_relative_to(folder) for folder in LIBRARY):
            hops.append(f"{path.relative_to(ROOT)}:{frame.name}")
    return hops


def test_compute_loss_reaches_the_kernel_in_at_most_eight_hops(tmp_path, monkeypatch):
    recorder = LaunchRecorder(kernel_module._cross_entropy_kernel)
    monkeypatch.setattr(kernel_module, "_cross_entropy_kernel", recorder)
    model = apply_packed_loss(tiny_model("llama", VOCAB).to(DEVICE), backend="triton")
    conversations = synthetic_conversations([9, 14, 5, 11], VOCAB, seed=5)
    batch = PackedCollator()([{**c, "seq_lengths": [len(c["input_ids"])]} for c in conversations])
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=DEVICE == "cpu"
    )
    trainer = PackedTrainer(model=model, args=args, train_dataset=conversations,
                            data_collator=PackedCollator())
    batch = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in batch.items()}

    loss = trainer.compute_loss(model, batch)

    assert torch.isfinite(loss)
    assert len(recorder.stacks) == 1  # one launch: loss and gradient in one pass
    hops = library_hops(recorder.stacks[0], "compute_loss")
    assert len(hops) <= MAX_HOPS, "\n".join(hops)
    assert hops[0] == "packed_ce/integrations/trainers/transformers_trainer.py:compute_loss"
    assert hops[-1] == "packed_ce/kernels/cross_entropy.py:launch"


class Watched(torch.Tensor):
    """A tensor that records, for every torch operation on it, the innermost library frame's
    ``file:function``; its moved and cast copies are watched too (the same values, elsewhere).
    """

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = Path(frame.filename).resolve()
            if any(path.is_relative_to(folder) for folder in LIBRARY):
                cls.reads.append(f"{path.relative_to(ROOT)}:{frame.name}")
                break
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if getattr(func, "__name__", "") in ("to", "detach", "contiguous") and torch.is_tensor(out):
            return out.as_subclass(Watched)
        return out


def test_seq_weights_is_read_in_at_most_eight_files_none_twice(tmp_path):
    """The files that read the batch's ``seq_weights`` (operations on it or its moved copies, in
    call order): the layout takes it from the batch, the model's loss moves it to the logits'
    device, validation checks its metadata, targets turn it into the coefficients the kernel
    reads, records check its values; the trainer, the forward, the guard, the front door and the
    pending checks carry it untouched."""
    model = apply_packed_loss(tiny_model("llama", VOCAB).to(DEVICE), backend="triton")
    conversations = synthetic_conversations([9, 14, 5, 11], VOCAB, seed=5)
    examples = [{**c, "seq_lengths": [len(c["input_ids"])], "weight": 1.0 + i}
                for i, c in enumerate(conversations)]
    batch = {k: v.to(DEVICE) if torch.is_tensor(v) else v
             for k, v in PackedCollator()(examples).items()}
    batch["seq_weights"] = batch["seq_weights"].as_subclass(Watched)
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], save_strategy="no", use_cpu=DEVICE == "cpu"
    )
    trainer = PackedTrainer(model=model, args=args, train_dataset=conversations,
                            data_collator=PackedCollator())
    Watched.reads = []

    loss = trainer.compute_loss(model, batch)

    assert torch.isfinite(loss)
    files = [read.split(":")[0] for read in Watched.reads]
    walk = [f for i, f in enumerate(files) if i == 0 or f != files[i - 1]]
    assert len(walk) == len(set(walk)), " -> ".join(walk)  # no file read it twice
    assert len(walk) <= MAX_FILES, " -> ".join(walk)
    assert walk[0] == "packed_ce/layout.py" and "packed_ce/targets.py" in walk, " -> ".join(walk)
