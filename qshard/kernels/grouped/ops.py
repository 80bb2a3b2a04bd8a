"""The grouped (experts) ops: `torch.ops.qshard.fp8_blockwise_grouped_linear` and
`.w4a16_grouped_linear`, with their fake implementations; each runs the kernel
`select.py` chooses (`common.py`: the layout of tokens and experts they share)."""

from __future__ import annotations

import torch

from ..w4a16.format import Format
from . import fp8, w4a16_gemv, w4a16_tiles
from .common import contiguous
from .select import Kernel, choose_fp8, choose_w4a16

__all__ = [
    "fp8_blockwise_grouped_linear",
    "fp8_grouped_launch",
    "w4a16_grouped_launch",
    "w4a16_grouped_linear",
]


def fp8_grouped_launch(
    x: torch.Tensor,
    offs: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    group: int,
    ue8m0: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, K] sorted by expert, offs int32 [E], FP8 blockwise experts (qdata [E, N, K], scale
    [E, ceil(N/bn), ceil(K/bk)]), bias [E, N] or None -> [T, N] in x's dtype."""
    choice = choose_fp8(x.shape[0], qdata.shape[0], config)
    return fp8.launch(x, offs, qdata, scale, bias, block_n, block_k, group, ue8m0, choice.config)


def w4a16_grouped_launch(
    fmt: Format,
    x: torch.Tensor,
    offs: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    k: int,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, k] sorted by expert, offs int32 [E], 4-bit experts (qdata [E, N, ceil(k/2)], scale
    and zero [E, N, groups], global_scale [E, 1, 1]: each read only by the formats that have
    it), bias [E, N] or None -> [T, N] in x's dtype, by the kernel `select.choose_w4a16` picks
    (or `config`'s)."""
    tokens = x.shape[0]
    experts, n, _ = qdata.shape
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)  # every row is written
    if tokens == 0 or n == 0 or experts == 0:
        return out.zero_()
    choice = choose_w4a16(int(fmt), tokens, experts, k, config)
    launch = w4a16_gemv.launch if choice.kernel is Kernel.W4A16_GEMV else w4a16_tiles.launch
    bias = bias.to(x.dtype) if bias is not None else None
    return launch(
        int(fmt), x, offs, qdata, scale, zero, global_scale, bias, out, group, k, choice.config
    )


# ---- torch.library ops -------------------------------------------------------------------------


@torch.library.custom_op("qshard::fp8_blockwise_grouped_linear", mutates_args=())
def fp8_blockwise_grouped_linear(
    x: torch.Tensor,
    offs: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    group: int,
    ue8m0: bool,
) -> torch.Tensor:
    """The grouped FP8 blockwise W8A8 matmul (module docstring)."""
    x, offs, qdata, scale, bias = contiguous(x, offs, qdata, scale, bias)
    return fp8_grouped_launch(x, offs, qdata, scale, bias, block_n, block_k, group, ue8m0)


@fp8_blockwise_grouped_linear.register_fake
def _(x, offs, qdata, scale, bias, block_n, block_k, group, ue8m0):
    return x.new_empty((x.shape[0], qdata.shape[1]))


@torch.library.custom_op("qshard::w4a16_grouped_linear", mutates_args=())
def w4a16_grouped_linear(
    x: torch.Tensor,
    offs: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    group: int,
    k: int,
) -> torch.Tensor:
    """The grouped 4-bit weight-only matmul (module docstring); fmt a `Format` name
    ("int4_asym", "int4_sym", "int4_fzero", "mxfp4", "nvfp4"); an empty `zero` or
    `global_scale` where the format has none."""
    x, offs, qdata, scale, zero, global_scale, bias = contiguous(
        x, offs, qdata, scale, zero, global_scale, bias
    )
    global_scale = global_scale if global_scale.numel() else qdata
    return w4a16_grouped_launch(
        Format[fmt.upper()], x, offs, qdata, scale, zero, global_scale, bias, group, k
    )


@w4a16_grouped_linear.register_fake
def _(x, offs, qdata, scale, zero, global_scale, bias, fmt, group, k):
    return x.new_empty((x.shape[0], qdata.shape[1]))
