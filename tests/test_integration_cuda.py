"""The end-to-end equivalence on a GPU: compiled Triton kernel, bf16 and fp32, varlen attention.

Run on a CUDA machine without ``TRITON_INTERPRET`` (``pytest -m cuda``). Needs neither
``datasets`` nor a network: the conversations are synthetic. The data-parallel NCCL run lives in
``test_distributed.py`` (two GPUs).

Tolerances: float32 as on the CPU (loss 1e-5, gradients 1e-4 relative; TF32 is off for the
comparison). bfloat16 carries 8 significant bits: the packed and the unpacked forward passes
round differently in every matmul and attention kernel, so the same comparison holds to about
1e-2 on the loss and a few 1e-2 on the gradients.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from collators import PackedCollator, PaddedCollator
import packed_ce
from packed_ce.integrations import apply_packed_loss

from integration_utils import (
    assert_gradients_close,
    assert_loss_close,
    loss_and_gradients,
    one_at_a_time,
    synthetic_conversations,
    tiny_model,
)

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
        reason="needs a CUDA GPU and the compiled kernel",
    ),
]

VOCAB = 1000  # unaligned
LENGTHS = [300, 17, 1, 129, 64, 511, 40, 256, 3, 90]  # a long tail, a one-token conversation
# (dtype, loss tolerance, gradient tolerance)
DTYPES = [
    pytest.param(torch.float32, 1e-5, 1e-4, id="fp32"),
    pytest.param(torch.bfloat16, 1e-2, 5e-2, id="bf16"),
]
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None


@pytest.fixture(autouse=True)
def no_tf32():
    previous = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = previous


def cuda_model(arch, dtype, attn="sdpa", **loss_options):
    model = tiny_model(arch, VOCAB, attn=attn).to("cuda", dtype)
    return apply_packed_loss(model, is_packed=True, backend="triton", **loss_options)


def on_cuda(batch):
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


def model_loss(batch):
    return lambda model: model(**batch, use_cache=False).loss


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype, loss_tol, grad_tol", DTYPES)
def test_packed_equals_unpacked_with_the_kernel(arch, dtype, loss_tol, grad_tol):
    conversations = synthetic_conversations(LENGTHS, VOCAB)
    model = cuda_model(arch, dtype)
    packed = loss_and_gradients(model, model_loss(on_cuda(PackedCollator()(conversations))))
    padded = loss_and_gradients(model, model_loss(on_cuda(PaddedCollator()(conversations))))
    truth = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations))
    for loss, grads in (packed, padded):
        assert_loss_close(loss, truth[0], loss_tol)
        assert_gradients_close(grads, truth[1], grad_tol)


@pytest.mark.parametrize("dtype, loss_tol, grad_tol", DTYPES)
def test_fused_linear_on_cuda(dtype, loss_tol, grad_tol):
    conversations = synthetic_conversations(LENGTHS, VOCAB)
    batch = on_cuda(PackedCollator()(conversations))
    model = cuda_model("llama", dtype)
    expected = loss_and_gradients(model, model_loss(batch))
    # fp32 accumulation of the weight gradient, as the unfused matmul does
    apply_packed_loss(
        model,
        is_packed=True,
        backend="triton",
        fused_linear=True,
        fused_linear_options=packed_ce.ChunkOptions(grad_accumulation_dtype=torch.float32),
    )
    assert model(**batch, use_cache=False).logits is None
    actual = loss_and_gradients(model, model_loss(batch))
    assert_loss_close(actual[0], expected[0], loss_tol)
    assert_gradients_close(actual[1], expected[1], grad_tol)


@pytest.mark.skipif(not HAS_FLASH_ATTN, reason="flash_attn is not installed")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flash_attention_varlen_keywords(arch):
    """flash_attention_2 reads cu_seq_lens_q/k and max_length_q/k of the packed batch."""
    conversations = synthetic_conversations(LENGTHS, VOCAB)
    model = cuda_model(arch, torch.bfloat16, attn="flash_attention_2")
    packed = loss_and_gradients(model, model_loss(on_cuda(PackedCollator()(conversations))))
    padded = loss_and_gradients(model, model_loss(on_cuda(PaddedCollator()(conversations))))
    truth = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations))
    for loss, grads in (packed, padded):
        assert_loss_close(loss, truth[0], 1e-2)
        assert_gradients_close(grads, truth[1], 5e-2)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_flex_attention_packed_mask(arch):
    """flex_attention (PyTorch-native, compiled) builds a block mask from the packed position_ids.

    Compared with sdpa on the same packed batch, which the tests above tie to the unpacked
    truth; one shape only, so flex compiles once.
    """
    batch = on_cuda(PackedCollator()(synthetic_conversations(LENGTHS, VOCAB)))
    expected = loss_and_gradients(cuda_model(arch, torch.bfloat16), model_loss(batch))
    model = cuda_model(arch, torch.bfloat16, attn="flex_attention")
    actual = loss_and_gradients(model, model_loss(batch))
    assert_loss_close(actual[0], expected[0], 1e-2)
    assert_gradients_close(actual[1], expected[1], 5e-2)
