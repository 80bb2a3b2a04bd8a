"""The W4A16 ops: `torch.ops.qshard.int4_linear`, `.mxfp4_linear` and `.nvfp4_linear` (fake
implementations beside them), one for every 4-bit layout (int4 asymmetric, symmetric and with a
float zero point, MXFP4, NVFP4). Each runs the kernel `select.choose` picks, inside the op, so
that torch.compile with a dynamic batch puts no guard on the token count. References:
`kernels/int4.py`, `mxfp4.py`, `nvfp4.py`.

Measured on an H200 (torch 2.11, triton 3.6): the Llama-3.1-8B layer at 2.21x / 1.73x / 1.30x /
1.00x / 0.91x of bf16 (int4 g128) at 1 / 16 / 64 / 128 / 2048 tokens; on an H100 2.93x / 2.22x /
1.71x / 1.26x / 0.87x (bench/README.md).
"""

from __future__ import annotations

import torch

from .format import Format
from .select import STRATEGIES, Kernel, choose

__all__ = ["int4_linear", "linear_launch", "mxfp4_linear", "nvfp4_linear"]


def linear_launch(
    fmt: Format,
    x,
    qdata,
    scale,
    zero,
    global_scale,
    bias,
    group: int,
    config: dict | None = None,
    native: bool = False,
) -> torch.Tensor:
    """x [M, K] -> x @ W.T + bias [M, N] in x's dtype, by the kernel `select.choose` picks (or
    `config`'s). `zero` and `global_scale` are read only by the formats that have them (pass
    any tensor). x, qdata, scale, zero and bias must be contiguous (the ops make them so).
    `native`: the codes are in `packing.native_codes`' order."""
    m, n = x.shape[0], qdata.shape[0]
    assert all(t is None or t.is_contiguous() for t in (x, qdata, scale, zero, bias)), "strides"
    choice = choose(fmt, x, qdata, group, native, config)
    # The reference adds the bias rounded to the activation dtype; the kernels add it in fp32.
    bias = bias.to(x.dtype) if bias is not None else None
    launch = STRATEGIES[choice.kernel].launch
    if choice.kernel is Kernel.DEQUANTIZE:  # cuBLAS writes its own output
        return launch(
            int(fmt), x, qdata, scale, zero, bias, None, group, choice.config, global_scale
        )
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    zero = zero if zero.numel() else qdata  # an empty tensor may have no address to pass
    return launch(int(fmt), x, qdata, scale, zero, bias, out, group, choice.config, global_scale)


# ---- torch.library ops -------------------------------------------------------------------------


def _run(fmt: Format, x, qdata, scale, zero, global_scale, bias, group, native=False):
    k, n = x.shape[-1], qdata.shape[0]
    x2d = x.reshape(x.shape[:-1].numel(), k).contiguous()  # (-1 is ambiguous at K = 0)
    bias = bias.contiguous() if bias is not None else None  # the kernels read it with stride 1
    out = linear_launch(
        fmt,
        x2d,
        qdata.contiguous(),
        scale.contiguous(),
        zero.contiguous(),
        global_scale,
        bias,
        group,
        native=native,
    )
    return out.reshape(*x.shape[:-1], n)


@torch.library.custom_op("qshard::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    float_zero: bool = False,
    native: bool = False,
) -> torch.Tensor:
    """y = x @ W.T + bias for the int4 weight (qdata, scale, zero; an empty zero: symmetric;
    `float_zero`: zero is a value, W = (u - 8) * scale + zero; `native`: qdata in
    `packing.native_codes`' order, groups of 128 or a multiple)."""
    fmt = Format.INT4_SYM if zero.numel() == 0 else Format.INT4_ASYM
    fmt = Format.INT4_FZERO if float_zero else fmt
    return _run(fmt, x, qdata, scale, zero, scale, bias, group, native)


@torch.library.custom_op("qshard::mxfp4_linear", mutates_args=())
def mxfp4_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """y = x @ W.T + bias for the MXFP4 weight (qdata, e8m0 scale)."""
    return _run(Format.MXFP4, x, qdata, scale, qdata, qdata, bias, group)


@torch.library.custom_op("qshard::nvfp4_linear", mutates_args=())
def nvfp4_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:
    """y = x @ W.T + bias for the NVFP4 weight (qdata, e4m3 scale, fp32 global scale)."""
    return _run(Format.NVFP4, x, qdata, scale, qdata, global_scale, bias, group)


@int4_linear.register_fake
def _(x, qdata, scale, zero, bias, group, float_zero=False, native=False):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@mxfp4_linear.register_fake
def _(x, qdata, scale, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@nvfp4_linear.register_fake
def _(x, qdata, scale, global_scale, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))
