"""The FP8 blockwise W8A8 op, `torch.ops.qshard.fp8_blockwise_linear(x, qdata, scale, bias,
block_n, block_k, group, ue8m0, backend)` (fake implementation beside it): it runs the kernel
`select.choose` picks for the layer's backend, inside the op. Its definition is
`kernels/fp8_blockwise.py`'s reference; tests compare against it (within fp32 summation order).
"""

from __future__ import annotations

import torch

from . import cublas, gluon
from .act_quant import INTERPRETED
from .select import STRATEGIES, TRITON_KERNELS, Kernel, choose

__all__ = ["fp8_blockwise_linear", "triton_linear_launch"]


def triton_linear_launch(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    group: int,
    ue8m0: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] float -> x @ W.T + bias [M, N] in x's dtype by a Triton kernel: the one
    `select.choose` picks for backend "triton", or the one `config` names."""
    m, k = x.shape
    n = qdata.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.copy_(bias.expand(m, n) if bias is not None else out.zero_())
    choice = choose(x, qdata, block_n, block_k, group, "triton", config)
    if choice.kernel not in TRITON_KERNELS:
        raise ValueError(
            f"FP8 config {config} names the {choice.kernel.value} kernel: the Triton "
            f"launcher runs {[k.value for k in TRITON_KERNELS]}"
        )
    config = dict(choice.config)
    if INTERPRETED:  # the interpreter runs one program at a time, sequentially
        config.update(num_stages=1)
    return STRATEGIES[choice.kernel].launch(
        x, qdata, scale, bias, out, block_n, block_k, group, ue8m0, config
    )


@torch.library.custom_op("qshard::fp8_blockwise_linear", mutates_args=())
def fp8_blockwise_linear(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    block_n: int,
    block_k: int,
    group: int,
    ue8m0: bool,
    backend: str,
) -> torch.Tensor:
    """y = x @ W.T + bias for x [..., K] and the FP8 blockwise weight (qdata, scale)."""
    n, k = qdata.shape
    x2d = x.reshape(x.shape[:-1].numel(), k).contiguous()  # (-1 is ambiguous at K = 0)
    # The kernels read rows with unit stride along K (a TP shard is a compact copy already).
    qdata, scale = qdata.contiguous(), scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    if x2d.shape[0] == 0 or n == 0 or k == 0:  # nothing to multiply: the launcher's own answer
        out = triton_linear_launch(x2d, qdata, scale, bias, block_n, block_k, group, ue8m0)
        return out.reshape(*x.shape[:-1], n)
    choice = choose(x2d, qdata, block_n, block_k, group, backend)
    if choice.kernel is Kernel.GLUON:
        out = gluon.launch(x2d, qdata, scale, bias, ue8m0, choice.config)
    elif choice.kernel is Kernel.CUBLAS:
        out = cublas.launch(x2d, qdata, scale, bias, ue8m0)
    else:
        out = triton_linear_launch(
            x2d, qdata, scale, bias, block_n, block_k, group, ue8m0, choice.config
        )
    return out.reshape(*x.shape[:-1], n)


@fp8_blockwise_linear.register_fake
def _(x, qdata, scale, bias, block_n, block_k, group, ue8m0, backend):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))
