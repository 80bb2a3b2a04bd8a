"""The GPU entry point of the FP8 blockwise W8A8 matmul, and its cuBLAS backend.

`torch.ops.qshard.fp8_blockwise_linear(x, qdata, scale, bias, block_n, block_k, group, ue8m0,
backend)` runs `backend` "triton" or "cublas", or for "auto" picks by the number of tokens M at
run time (inside the op, so that torch.compile with a dynamic batch puts no guard on M):

    2 <= M <= 64 on sm_90 with 128x128 blocks, 1x128 groups  ->  the Gluon kernel
                                                               (fp8_blockwise_gluon.py)
    M <= SMALL_M_MAX (64), or cuBLAS cannot take the layout  ->  Triton (GEMV at M = 1,
                                                               the split-K small-M kernel)
    otherwise                                                ->  cuBLAS blockwise scaled_mm

On the H100 the Gluon kernel (warp-specialized, TMA) beat the Triton kernels at 2-64 tokens
and lost to cuBLAS at 128 (docs/kernels/fp8_blockwise.md, "Gluon kernel"); on H200 the Triton
kernels beat cuBLAS up to M = 64 and cuBLAS (with the Triton activation quantization) beat the
Triton tensor-core GEMM from M = 128 to 4096 (bench/README.md); Triton also serves the layouts
cuBLAS cannot take (re-blocked 64-blocks, partial edge blocks, sm_89).

cuBLAS: `F.scaled_mm` with BlockWise1x128 activations x BlockWise128x128 weights (torch >= 2.10,
CUDA >= 12.9, sm_90 only; docs/design.md, "PyTorch behaviour"): `a` fp8 [M, K] row-major with scales
[M, K/128] of strides (1, M) (exactly the group-major scales the Triton act-quant kernel writes),
`b` = W.t() with scales = the [N/128, K/128] block scales `.t()`. M is padded to a multiple of 16 (M
= 1 is refused by cuBLAS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .availability import cublas_unavailable_reason
from .fp8_blockwise_gluon import gluon_launch, gluon_problem
from .fp8_blockwise_triton import SMALL_M_MAX, act_quant_launch, linear_launch

__all__ = ["cublas_linear", "fp8_blockwise_linear", "gluon_chosen"]

CUBLAS_M_MULTIPLE = 16
# "auto" runs the Gluon kernel (fp8_blockwise_gluon.py) for this many tokens where it can run:
# where it beat both the Triton kernels and cuBLAS on the H100 (docs/kernels/fp8_blockwise.md)
GLUON_CHOICE_M = (2, 64)


def gluon_chosen(x2d: torch.Tensor, qdata: torch.Tensor, block_n: int, block_k: int,
                 group: int) -> bool:  # fmt: skip
    """Whether "auto" runs the Gluon kernel for this matmul (its token range, and it can run)."""
    low, high = GLUON_CHOICE_M
    return low <= x2d.shape[0] <= high and gluon_problem(x2d, qdata, block_n, block_k,
                                                         group) is None  # fmt: skip


def cublas_linear(
    x2d: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    ue8m0: bool,
) -> torch.Tensor:  # fmt: skip
    m = x2d.shape[0]
    pad = -m % CUBLAS_M_MULTIPLE
    if pad:
        x2d = F.pad(x2d, (0, 0, 0, pad))
    q, x_scale = act_quant_launch(x2d, 128, ue8m0)
    out = F.scaled_mm(
        q, qdata.t(), x_scale.t(), F.ScalingType.BlockWise1x128,
        scale.t(), F.ScalingType.BlockWise128x128, output_dtype=x2d.dtype,
    )  # fmt: skip
    out = out[:m]
    return out + bias.to(out.dtype) if bias is not None else out  # (a float32 bias stays bf16)


@torch.library.custom_op("qshard::fp8_blockwise_linear", mutates_args=())
def fp8_blockwise_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    block_n: int, block_k: int, group: int, ue8m0: bool, backend: str,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for x [..., K] and the FP8 blockwise weight (qdata, scale)."""
    n, k = qdata.shape
    x2d = x.reshape(-1, k).contiguous()
    # The kernels read rows with unit stride along K (a TP shard is a compact copy already).
    qdata, scale = qdata.contiguous(), scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if backend == "auto" and gluon_chosen(x2d, qdata, block_n, block_k, group):
        backend = "gluon"
    if backend == "auto":
        cublas_ok = cublas_unavailable_reason(x.device, n, k, block_n, block_k, group) is None
        backend = "cublas" if cublas_ok and x2d.shape[0] > SMALL_M_MAX else "triton"
    if backend == "gluon":  # chosen by "auto" only (not a config value)
        out = gluon_launch(x2d, qdata, scale, bias, ue8m0)
    elif backend == "cublas":
        out = cublas_linear(x2d, qdata, scale, bias, ue8m0)
    else:
        out = linear_launch(x2d, qdata, scale, bias, block_n, block_k, group, ue8m0)
    return out.reshape(*x.shape[:-1], n)


@fp8_blockwise_linear.register_fake
def _(x, qdata, scale, bias, block_n, block_k, group, ue8m0, backend):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))
