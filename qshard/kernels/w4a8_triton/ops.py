"""The W4A8 ops: `torch.ops.qshard.int4_w4a8_linear` (a 2-D weight) and
`.int4_w4a8_grouped_linear` (experts), with their fake implementations. Each quantizes the
activations (the FP8 act-quant kernel per K block, or per token as the reference does), then
runs the tile kernel (`tiles.py`), or for a 2-D weight from 128 tokens cuBLAS on the codes
expanded to e4m3 (`cublas.py`). References: `kernels/w4a8.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fp8.act_quant import act_quant_launch
from ..grouped.common import contiguous
from ..w4a8 import ActivationQuant, act_group, quantize_w4a8_activations
from . import cublas, tiles

__all__ = ["int4_w4a8_grouped_linear", "int4_w4a8_linear", "w4a8_launch"]


def _quantized_activations(x: torch.Tensor, group: int, mode: ActivationQuant):
    """(e4m3 [T, blocks * KB] in the kernel's order: each K block's even columns, then its odd
    ones, zeros past K; scales [blocks, T] with a block's row at stride(0), 0 per token)."""
    block = act_group(group)
    if mode is ActivationQuant.FP8_TOKEN:
        xq, scale = quantize_w4a8_activations(x, group, mode)
        tokens, k = xq.shape
        blocks = -(-k // block)
        padded = torch.zeros((tokens, blocks * block), dtype=xq.dtype, device=xq.device)
        padded[:, :k] = xq
        halves = padded.view(tokens, blocks, block // 2, 2).transpose(2, 3)
        return halves.reshape(tokens, blocks * block), scale[:, :1].t().expand(blocks, -1)
    return act_quant_launch(x, block, False, split=True)


def w4a8_launch(
    x: torch.Tensor,
    offs: torch.Tensor | None,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    mode: ActivationQuant,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, K] (sorted by expert where offs is given), int4 weights qdata [E, N, ceil(K/2)]
    (E = 1 and offs None for a 2-D weight), scale / zero [E, N, groups], bias [E, N] or None
    -> [T, N] in x's dtype."""
    tokens, k = x.shape
    experts, n, _ = qdata.shape
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if tokens == 0 or n == 0 or experts == 0:
        return out.zero_()
    if k == 0:  # no K blocks: the bias alone
        return out.copy_(_bias_only(bias, offs, out))
    if offs is None and config is None and cublas.problem(x, n, k, group) is None:
        pad = -tokens % cublas.CUBLAS_M_MULTIPLE
        xq, x_scale = _quantized_activations(F.pad(x, (0, 0, 0, pad)) if pad else x, group, mode)
        return cublas.launch(
            xq, x_scale, qdata[0], scale[0], zero[0] if zero.numel() else zero, bias, group, x.dtype
        )[:tokens]
    xq, x_scale = _quantized_activations(x, group, mode)
    rows = tokens if offs is None else -(-tokens // experts)
    config = config or tiles.config(rows)
    bias = bias.to(x.dtype) if bias is not None else None
    return tiles.launch(xq, x_scale, offs, qdata, scale, zero, bias, out, group, k, config)


def _bias_only(bias, offs, out):
    """The output of an empty K: each row's (expert's) bias; zeros without one, and past
    offs[-1]."""
    if bias is None:
        return out.zero_()
    if offs is None:
        return bias.reshape(-1).expand_as(out)
    ends = offs.long()
    rows = torch.arange(out.shape[0], device=out.device)
    expert = torch.searchsorted(ends, rows, right=True)
    routed = expert < ends.numel()
    return torch.where(routed[:, None], bias[expert.clamp(max=ends.numel() - 1)], 0.0)


@torch.library.custom_op("qshard::int4_w4a8_linear", mutates_args=())
def int4_w4a8_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    mode: str,
) -> torch.Tensor:
    """y = x @ W.T + bias for an int4 weight [N, K] with FP8 activations; `mode` an
    `ActivationQuant` value ("fp8_group", "fp8_token"); an empty `zero`: symmetric."""
    k, n = x.shape[-1], qdata.shape[0]
    x2d = x.reshape(x.shape[:-1].numel(), k).contiguous()
    qdata, scale, zero, bias = contiguous(qdata, scale, zero, bias)
    zero = zero[None] if zero.numel() else zero
    out = w4a8_launch(x2d, None, qdata[None], scale[None], zero, bias, group, ActivationQuant(mode))
    return out.reshape(*x.shape[:-1], n)


@int4_w4a8_linear.register_fake
def _(x, qdata, scale, zero, bias, group, mode):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@torch.library.custom_op("qshard::int4_w4a8_grouped_linear", mutates_args=())
def int4_w4a8_grouped_linear(
    x: torch.Tensor,
    offs: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    mode: str,
) -> torch.Tensor:
    """The grouped W4A8 matmul: x [T, K] sorted by expert, offs int32 [E] the experts' end rows,
    int4 experts qdata [E, N, ceil(K/2)], scale / zero [E, N, groups] (zero empty: symmetric),
    bias [E, N] or None -> [T, N]; rows past offs[-1] are zeros."""
    x, offs, qdata, scale, zero, bias = contiguous(x, offs, qdata, scale, zero, bias)
    return w4a8_launch(x, offs, qdata, scale, zero, bias, group, ActivationQuant(mode))


@int4_w4a8_grouped_linear.register_fake
def _(x, offs, qdata, scale, zero, bias, group, mode):
    return x.new_empty((x.shape[0], qdata.shape[1]))
