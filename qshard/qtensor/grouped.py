"""Matmuls on quantized experts: `torch._grouped_mm` / `F.grouped_mm` and `torch.bmm`.

transformers' experts implementations (docs/design.md, "Experts in transformers") multiply tokens
sorted by expert with the
[E, N, K] experts weight: `grouped_mm` calls `_grouped_mm(x, w.transpose(-2, -1), offs=offs)`
(or `_grouped_mm(x, w, offs)` for gpt-oss's transposed [E, K, N] storage), `batched_mm` calls
`bmm(w[ids], x[..., None])` (or `bmm(x[:, None], w[ids])`) on the experts gathered per token,
and `eager` calls `F.linear(x, w[e])` (`x @ w[e]`), which is the 2-D path. Every grouped form
becomes `QTensor.grouped_linear(x, offs, bias)`: rows offs[e-1]..offs[e] of x times expert e's
W.T. Rows past offs[-1] (expert-parallel sentinels in transformers) come back as zeros.

`grouped_linear` runs the op `qshard::experts_linear`, whose implementation (the reference,
for every layout and device) runs each expert's own 2-D matmul (`QTensor._linear`: the
layout's kernels where they run) on its rows. It is one custom op so that torch.compile sees
one node whatever the token counts (no graph break on the offsets' values, no recompile). A
layout with a fused grouped kernel overrides `grouped_linear`.
"""

from __future__ import annotations

import torch

from ..errors import InputMismatchError, UnsupportedOpError
from .attrs import op_args, rebuild
from .base import QTensor
from .validation import FLOAT_DTYPES

__all__ = ["check_offsets", "experts_linear_reference"]

aten = torch.ops.aten


def check_offsets(x: torch.Tensor, offs: torch.Tensor, experts: int, values: bool) -> None:
    """`offs` are the ends of each expert's rows of x: int32 [E], non-decreasing, at most the
    number of rows. Reading the values (`values=True`) needs them on the host."""
    rows = x.shape[0]
    if offs.dim() != 1 or offs.shape[0] != experts or offs.dtype != torch.int32:
        raise InputMismatchError(
            f"grouped matmul: offs is {offs.dtype}{list(offs.shape)}; it must be int32 [{experts}]"
            f" (the end row of each of the {experts} experts' tokens, e.g. "
            f"torch.cumsum(tokens_per_expert, 0, dtype=torch.int32))"
        )
    if values and experts:
        ends = offs.tolist()
        steps = [b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        if min(steps) < 0 or ends[-1] > rows:
            raise InputMismatchError(
                f"grouped matmul: offs {ends[:8]}{'...' if experts > 8 else ''} must be "
                f"non-decreasing from 0 and end at most at the {rows} rows of the input (the "
                f"cumulative token counts per expert)"
            )


@torch.library.custom_op("qshard::experts_linear", mutates_args=())
def experts_linear(
    x: torch.Tensor,
    offs: torch.Tensor,
    inner: list[torch.Tensor],
    bias: torch.Tensor | None,
    layout: str,
    attrs: str,
    dtype: torch.dtype,
    shape: list[int],
) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ W[e].T (+ bias[e]) for the [E, N, K] experts (`shape`) of
    class `layout` with these inner tensors and JSON attributes (see the module docstring)."""
    weight = rebuild(inner, layout, attrs, dtype, shape)
    return experts_linear_reference(x, offs, weight, bias)


@experts_linear.register_fake
def _(x, offs, inner, bias, layout, attrs, dtype, shape):
    return x.new_empty(x.shape[0], shape[1])


def experts_linear_reference(
    x: torch.Tensor, offs: torch.Tensor, weight: QTensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Each expert's 2-D matmul on its rows; zeros past offs[-1]."""

    def linear(e: int, rows: torch.Tensor) -> torch.Tensor:
        return weight.expert(e)._linear(rows, None if bias is None else bias[e])

    return _each_experts_rows(x, offs, weight, weight.matrix_shape[0], linear)


def _each_experts_rows(x, offs, weight: QTensor, width: int, fn) -> torch.Tensor:
    """[T, width]: fn(e, rows of expert e) for each expert with rows, zeros past offs[-1]."""
    check_offsets(x, offs, weight.experts, values=True)
    out = x.new_zeros(x.shape[0], width)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = fn(e, x[start:end])
        start = end
    return out


# ---- the aten ops transformers' experts implementations call --------------------------------


def _experts_operand(op: str, x, w) -> QTensor:
    """w, checked to be quantized [E, N, K] experts multiplied with a plain float x."""
    if isinstance(x, QTensor) or not isinstance(w, QTensor) or w.experts is None:
        raise UnsupportedOpError(
            f"{op}: only a 3-D quantized experts weight can be the weight operand (got "
            f"{type(x).__name__} and {type(w).__name__} {list(w.shape)}); index one expert "
            f"(w[e]) for F.linear, or dequantize() it"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise InputMismatchError(
            f"{op}: input dtype {x.dtype} is not one of {[str(d) for d in FLOAT_DTYPES]}"
        )
    return w


@QTensor.implements(aten._grouped_mm.default)
def _grouped_mm(func, args, kwargs):
    x, w, offs, bias, out_dtype = _grouped_mm_args(*args, **kwargs)
    w = _experts_operand("torch._grouped_mm", x, w)
    if offs is None or x.dim() != 2:
        raise UnsupportedOpError(
            f"torch._grouped_mm(x {list(x.shape)}, {type(w).__name__} {list(w.shape)}, "
            f"offs={offs is not None}): quantized experts take a 2-D input of tokens sorted by "
            f"expert with offs (the end row of each expert's tokens)"
        )
    check_offsets(x, offs, w.experts, values=False)
    if w.transposed:  # x @ W[e].T: the forward of every experts implementation
        experts, n = w.experts, w.matrix_shape[0]
        if bias is not None and tuple(bias.shape) != (experts, n):
            raise InputMismatchError(
                f"torch._grouped_mm: bias {list(bias.shape)}; quantized experts take one bias "
                f"row per expert, [{experts}, {n}] (or none)"
            )
        out = w.with_changes(transposed=False).grouped_linear(x, offs, bias)
    else:  # x @ W[e]: the input gradient of the above, through the dequantized weight
        if bias is not None:
            raise UnsupportedOpError("torch._grouped_mm: x @ W[e] takes no bias")
        out = torch.ops.qshard.experts_times_weight(x, offs, *op_args(w))
    return out if out_dtype in (None, out.dtype) else out.to(out_dtype)


@QTensor.implements_named("transformers::grouped_mm_fallback")
def _transformers_grouped_mm(func, args, kwargs):
    """transformers' own grouped matmul op (`integrations/moe.py`: under torch.compile with
    weights other than bf16, and on old torch), `(x, w [E, K, N], offs)`: `_grouped_mm`."""
    return _grouped_mm(func, args, kwargs)


def _grouped_mm_args(self, mat2, offs=None, bias=None, out_dtype=None):
    return self, mat2, offs, bias, out_dtype


@torch.library.custom_op("qshard::experts_times_weight", mutates_args=())
def experts_times_weight(
    x: torch.Tensor,
    offs: torch.Tensor,
    inner: list[torch.Tensor],
    layout: str,
    attrs: str,
    dtype: torch.dtype,
    shape: list[int],
) -> torch.Tensor:
    """Rows of each expert times its [N, K] weight W[e] (not W[e].T), dequantized: what
    autograd asks for as the input gradient of a grouped linear (as `_mm_grad_input`). One
    op, as `experts_linear`, so that a compiled backward reads no offsets."""
    w = rebuild(inner, layout, attrs, dtype, shape)

    def times_weight(e: int, rows: torch.Tensor) -> torch.Tensor:
        return rows @ w.expert(e).dequantize(x.dtype)

    return _each_experts_rows(x, offs, w, w.matrix_shape[1], times_weight)


@experts_times_weight.register_fake
def _(x, offs, inner, layout, attrs, dtype, shape):
    return x.new_empty(x.shape[0], shape[2])


@QTensor.implements(aten.bmm.default)
def _bmm(func, args, kwargs):
    """transformers' batched_mm: bmm(W[ids], x[..., None]) (W [S, N, K] gathered per token) or,
    for transposed [E, K, N] storage, bmm(x[:, None], W[ids]). Each batch entry is one group
    of the grouped linear."""
    a, b = args
    if isinstance(a, QTensor) and not a.transposed:  # W[s] @ x[s], x [S, K, M]
        w = _experts_operand("torch.bmm", b, a)
        s, k, m = b.shape
        out = _per_entry(w, b.transpose(1, 2).reshape(s * m, k), m)
        return out.view(s, m, w.matrix_shape[0]).transpose(1, 2)
    if isinstance(b, QTensor) and b.transposed:  # x[s] @ W[s].T, x [S, M, K]
        w = _experts_operand("torch.bmm", a, b).with_changes(transposed=False)
        s, m, k = a.shape
        return _per_entry(w, a.reshape(s * m, k), m).view(s, m, w.matrix_shape[0])
    raise UnsupportedOpError(
        f"torch.bmm({type(a).__name__} {list(a.shape)}, {type(b).__name__} {list(b.shape)}): "
        f"quantized experts compute W[s] @ x[s] (bmm(w, x)) or x[s] @ W[s].T "
        f"(bmm(x, w.transpose(-2, -1))); dequantize() for other products"
    )


def _per_entry(w: QTensor, rows: torch.Tensor, m: int) -> torch.Tensor:
    if rows.shape[0] and rows.shape[0] != w.experts * m:
        raise InputMismatchError(f"torch.bmm: {w.experts} weights but {rows.shape[0] // m} inputs")
    ends = torch.arange(1, w.experts + 1, dtype=torch.int32, device=rows.device) * m
    return w.grouped_linear(rows.contiguous(), ends, None)
