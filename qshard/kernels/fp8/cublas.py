"""FP8 blockwise W8A8 by cuBLAS: `F.scaled_mm` with BlockWise1x128 activations x BlockWise128x128
weights (torch >= 2.10, CUDA >= 12.9, sm_90 only; docs/design.md, "PyTorch behaviour"): `a` fp8
[M, K] row-major with scales [M, K/128] of strides (1, M) (exactly the group-major scales the
act-quant kernel writes), `b` = W.t() with scales = the [N/128, K/128] block scales `.t()`. M is
padded to a multiple of 16 (M = 1 is refused by cuBLAS). On the H200 it beat the Triton
tensor-core GEMM from 128 tokens to 4096 (bench/README.md; `select.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..availability import cublas_unavailable_reason
from .act_quant import act_quant_launch

__all__ = ["CUBLAS_M_MULTIPLE", "launch", "problem"]

CUBLAS_M_MULTIPLE = 16


def problem(
    x: torch.Tensor, qdata: torch.Tensor, block_n: int, block_k: int, group: int
) -> str | None:
    """Why cuBLAS cannot run this matmul (its build, the GPU, the block layout), or None."""
    n, k = qdata.shape
    return cublas_unavailable_reason(x.device, n, k, block_n, block_k, group)


def launch(
    x2d: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    ue8m0: bool,
) -> torch.Tensor:
    """x [M, K] float -> x @ W.T + bias [M, N] in x's dtype."""
    m = x2d.shape[0]
    pad = -m % CUBLAS_M_MULTIPLE
    if pad:
        x2d = F.pad(x2d, (0, 0, 0, pad))
    q, x_scale = act_quant_launch(x2d, 128, ue8m0)
    out = F.scaled_mm(
        q,
        qdata.t(),
        x_scale.t(),
        F.ScalingType.BlockWise1x128,
        scale.t(),
        F.ScalingType.BlockWise128x128,
        output_dtype=x2d.dtype,
    )
    out = out[:m]
    return out + bias.to(out.dtype) if bias is not None else out  # (a float32 bias stays bf16)
