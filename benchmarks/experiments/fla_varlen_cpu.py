"""fla's gated delta rule and short convolution with ``cu_seqlens`` against each sequence alone,
on the CPU under the Triton interpreter, in float32, and with float32 dots rounded to TF32 as
Triton's default precision does on Hopper (``EMULATE_TF32=1``).

The question it answers: on an H200, packed-ce's fla route was 1.0e-3 from every conversation
alone in float32 (``benchmarks/README.md``, hybrid families), 1.6e-5 on the PyTorch route. Is
that a leak between conversations or TF32 rounding? Here fla's kernels run the same arithmetic
on both sides (its varlen kernels restart their chunks at each sequence): varlen against alone
is 0, each against an exact float64 recurrence ~1e-6, and ~5e-4 to 2e-3 with TF32 emulated;
the same row without ``cu_seqlens`` is 0.1-0.4 from alone (the check can fail). Results:
``benchmarks/results/fla_varlen_cpu_interpreter.log``.

Set-up (fla 0.6.0 and einops in a folder of their own, not the project's environment; the
interpreter needs ``tl.cast`` where fla calls ``.to`` on a loop index):

    mkdir -p /tmp/flasite && cd /tmp/flasite
    unzip -qo fla_core-0.6.0-py3-none-any.whl && unzip -qo flash_linear_attention-0.6.0-py3-none-any.whl
    pip install --target /tmp/flasite --no-deps einops
    sed -i 's/i_t.to(tl.int64)/tl.cast(i_t, tl.int64)/' fla/ops/common/{chunk_delta_h,chunk_h_split,fused_chunk,chunk_h}.py
    PYTHONPATH=/tmp/flasite TRITON_INTERPRET=1 python benchmarks/experiments/fla_varlen_cpu.py 37,64,91 16
    EMULATE_TF32=1 PYTHONPATH=/tmp/flasite TRITON_INTERPRET=1 python benchmarks/experiments/fla_varlen_cpu.py 37,64,91 16

Arguments: the sequence lengths (comma-separated) and the head dimension; 2 heads.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from triton.runtime.autotuner import Autotuner

# Workaround: under TRITON_INTERPRET the autotuner's benchmarker asks for an active GPU driver
# ("0 active drivers"); give every config the same time so the first one is used, unbenchmarked.
Autotuner.do_bench = lambda self, fn, quantiles=None: [0.0, 0.0, 0.0]

if os.environ.get("EMULATE_TF32") == "1":
    # Emulate Hopper: float32 tl.dot inputs rounded to TF32 (10-bit mantissa) unless the kernel
    # asked for 'ieee' (allow_tf32=False); fla's own flag then picks tf32 in its fused solve_tril.
    import numpy as np
    import triton.runtime.interpreter as ti
    from triton._C.libtriton import ir

    import fla.utils

    fla.utils.IS_TF32_SUPPORTED = True
    own_dot = ti.InterpreterBuilder.create_dot

    def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if input_precision == ir.INPUT_PRECISION.TF32 and a.data.dtype == np.float32:
            a = ti.TensorHandle(ti._round_f32_to_tf32(a.data), a.dtype)
            b = ti.TensorHandle(ti._round_f32_to_tf32(b.data), b.dtype)
        return own_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    ti.InterpreterBuilder.create_dot = tf32_dot
    print("EMULATE_TF32=1: float32 dots rounded to TF32 unless 'ieee'")

from fla.modules.causal_conv1d import causal_conv1d
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as hub

# transformers' decorator (use_kernel_func_from_hub_with_fallback) swaps in fla's own function
# whenever fla imports; __wrapped__ is the PyTorch chunked path. It computes in float32 inside.
torch_chunk_gated_delta_rule = hub.__wrapped__
assert "fla" not in torch_chunk_gated_delta_rule.__module__
print("transformers name resolves to:", hub.__module__ if hasattr(hub, "__module__") else hub)

LENS = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "37,64,91").split(",")]
H, D = 2, int(sys.argv[2]) if len(sys.argv) > 2 else 16
torch.manual_seed(0)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def naive64(q, k, v, g, beta):
    """Exact step-by-step gated delta rule in float64; [1, T, H, D] like fla; l2norm on q, k."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = F.normalize(q, dim=-1, eps=1e-6) * q.shape[-1] ** -0.5
    k = F.normalize(k, dim=-1, eps=1e-6)
    S = q.new_zeros(q.shape[0], q.shape[2], q.shape[3], v.shape[3])  # [B, H, K, V]
    outs = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        kt, vt = k[:, t], v[:, t]  # [B, H, K], [B, H, V]
        vnew = (vt - torch.einsum("bhk,bhkv->bhv", kt, S)) * beta[:, t][..., None]
        S = S + kt[..., None] * vnew[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1)


def leaves(T):
    q = torch.randn(1, T, H, D)
    k = torch.randn(1, T, H, D)
    v = torch.randn(1, T, H, D)
    g = -F.softplus(torch.randn(1, T, H))
    beta = torch.sigmoid(torch.randn(1, T, H))
    return [x.requires_grad_() for x in (q, k, v, g, beta)]


def run(fn, xs, do):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    o = fn(*xs)
    (o * do).sum().backward()
    return [o.detach()] + [x.grad for x in xs]


NAMES = ["o", "dq", "dk", "dv", "dg", "dbeta"]
cu = torch.tensor([0] + list(torch.tensor(LENS).cumsum(0)), dtype=torch.long)
T = int(cu[-1])
xs = leaves(T)
do = torch.randn(1, T, H, D)

t0 = time.time()
packed = run(
    lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)[0], xs, do
)
print(f"fla varlen fwd+bwd T={T}: {time.time() - t0:.1f}s")
alone, tf32ref, ref64 = [], [], []
t0 = time.time()
for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
    part = [x[:, s:e] for x in xs]
    alone.append(
        run(lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True)[0], part, do[:, s:e])
    )
    tf32ref.append(
        run(
            lambda *a: torch_chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True)[0],
            part,
            do[:, s:e],
        )
    )
    ref64.append(run(naive64, [x.double() for x in part], do[:, s:e].double()))
print(f"per-sequence fla + references: {time.time() - t0:.1f}s")
cat = [torch.cat([r[i] for r in rs], 1) for rs in (alone, tf32ref, ref64) for i in range(6)]
alone_c, torch_c, ref_c = cat[:6], cat[6:12], cat[12:]
print(f"lens={LENS} H={H} D={D} float32; rel = max|a-b|/max|b|")
print(f"{'':6} {'varlen/alone':>13} {'varlen/f64':>11} {'alone/f64':>10} {'hf32/f64':>10}")
for i, n in enumerate(NAMES):
    r = ref_c[i]
    print(
        f"{n:6} {rel(packed[i], alone_c[i]):13.2e} {rel(packed[i].double(), r):11.2e} "
        f"{rel(alone_c[i].double(), r):10.2e} {rel(torch_c[i].double(), r):10.2e}"
    )

# fla varlen short convolution, as packed-ce calls it: x (1, T, C), weight (C, W), silu
C, W = 8, 4
x = torch.randn(1, T, C)
w = torch.randn(C, W)
b = torch.randn(C)
dy = torch.randn(1, T, C)


def conv_ref(x, w, b):  # (1, T, C) causal depthwise conv, float64 reference
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), w[:, None], b, groups=C)
    return F.silu(y).transpose(1, 2)


def conv_fla(cs):
    return lambda x, w, b: causal_conv1d(x, w, b, activation="silu", cu_seqlens=cs)[0]


packed = run(conv_fla(cu), [x, w, b], dy)
pieces = []
for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
    al = run(conv_fla(None), [x[:, s:e], w, b], dy[:, s:e])
    rf = run(conv_ref, [x[:, s:e].double(), w.double(), b.double()], dy[:, s:e].double())
    pieces.append((al, rf))
yc = [torch.cat([p[j][0] for p in pieces], 1) for j in (0, 1)]
dxc = [torch.cat([p[j][1] for p in pieces], 1) for j in (0, 1)]
dwc = [sum(p[j][2] for p in pieces) for j in (0, 1)]
dbc = [sum(p[j][3] for p in pieces) for j in (0, 1)]
print("conv1d (C=8, W=4, silu)   varlen/alone  varlen/f64  alone/f64")
for n, pv, (al, rf) in zip(["y", "dx", "dw", "db"], packed, [yc, dxc, dwc, dbc]):
    print(
        f"{n:6} {rel(pv, al):24.2e} {rel(pv.double(), rf):11.2e} {rel(al.double(), rf):10.2e}"
    )

# fla (alone) vs transformers' float32 torch path directly: are they the same arithmetic?
for i, n in enumerate(NAMES):
    print(f"fla-alone vs hf-torch-f32 {n}: {rel(alone_c[i], torch_c[i]):.2e}")

# Teeth: the same row without cu_seqlens (state carried across sequences) must differ widely.
leaky = run(lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True)[0], xs, do)
print("no-cu_seqlens (leaking) vs alone:", ", ".join(
    f"{n} {rel(leaky[i], alone_c[i]):.2e}" for i, n in enumerate(NAMES)))
