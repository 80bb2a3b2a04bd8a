"""The ops every layout shares, written once on QTensor.

Shape ops map an outer dim to the logical [N, K] dim (through `transposed`) and cut each inner
tensor by its packing (`QTensor.packing`). View ops return views of the inner tensors and go
through `return_and_correct_aliasing`, so `w.narrow(0, a, n).copy_(src)` writes into `w` (the
vLLM loading pattern) and torch.compile sees the aliasing. Copies (clone, to, cat, empty_like)
get new storage. Matmuls route to the layout's `_linear`, for `F.linear(x, w)` and for the
`x @ w.t()` that `linear` decomposes into under autograd and DTensor (`t` + `mm` / `addmm`).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..errors import InvalidDimError, LayoutMismatchError, UnsupportedOpError
from .base import FLOAT_DTYPES, WHOLE, QTensor, spans_dim

aten = torch.ops.aten


def _clamp_range(start: int | None, end: int | None, size: int) -> tuple[int, int]:
    start = 0 if start is None else start
    end = size if end is None or end >= sys.maxsize else end
    start = start + size if start < 0 else start
    end = end + size if end < 0 else end
    start = min(max(start, 0), size)
    return start, min(max(end, start), size)


def _slice_outer(q: QTensor, dim: int, start: int, end: int) -> QTensor:
    return q.slice_logical(q.logical_dim(dim), start, end)


def _float_dtype(q: QTensor, dtype: torch.dtype | None, op: str) -> torch.dtype:
    """The outer dtype for a copy: a quantized weight's dtype is the float dtype it stands for."""
    dtype = dtype or q.dtype
    if dtype not in FLOAT_DTYPES:
        raise UnsupportedOpError(
            f"{type(q).__name__}.{op}(dtype={dtype}): a quantized weight's dtype is the float "
            f"dtype it dequantizes to, one of {[str(d) for d in FLOAT_DTYPES]}; call "
            f"dequantize() first for a plain {dtype} tensor"
        )
    return dtype


# ---- views --------------------------------------------------------------------------------


@QTensor.implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    q, dim, start, end, step = _slice_args(*args, **kwargs)
    if step != 1:
        raise UnsupportedOpError(
            f"{type(q).__name__}: slicing with step {step} would cut every packed block; slice "
            f"with step 1, or dequantize() first (w.dequantize()[::{step}])"
        )
    start, end = _clamp_range(start, end, q.shape[dim % 2])
    return return_and_correct_aliasing(func, args, kwargs, _slice_outer(q, dim, start, end))


def _slice_args(q, dim=0, start=None, end=None, step=1):
    q.logical_dim(dim)  # validates dim
    return q, dim, start, end, step


@QTensor.implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func, args, kwargs):
    q, sizes, dim = _split_args(*args, **kwargs)
    q.logical_dim(dim)
    size = q.shape[dim % 2]
    if isinstance(sizes, int):
        if sizes <= 0:
            raise UnsupportedOpError(f"{type(q).__name__}.split({sizes}): the size must be > 0")
        sizes = [min(sizes, size - s) for s in range(0, size, sizes)] or [0]
    elif any(n < 0 for n in sizes) or sum(sizes) != size:
        raise UnsupportedOpError(
            f"{type(q).__name__}.split({list(sizes)}, dim={dim}): the sizes must be >= 0 and "
            f"add up to the dim's size {size}"
        )
    outs, start = [], 0
    for n in sizes:
        outs.append(_slice_outer(q, dim, start, start + n))
        start += n
    return return_and_correct_aliasing(func, args, kwargs, outs)


def _split_args(q, split_size, dim=0):
    return q, split_size, dim


@QTensor.implements([aten.t.default, aten.transpose.int, aten.permute.default])
def _transpose(func, args, kwargs):
    q = args[0]
    if func is aten.t.default:
        flip = True
    else:
        dims = [args[1], args[2]] if func is aten.transpose.int else list(args[1])
        logical = [q.logical_dim(d) for d in dims]
        if func is aten.permute.default and sorted(logical) != [0, 1]:
            raise InvalidDimError(
                f"{type(q).__name__}.permute({dims}): a 2-D tensor permutes (0, 1) or (1, 0)"
            )
        flip = logical[0] != logical[1] if func is aten.transpose.int else dims[0] % 2 == 1
    out = q.with_changes(transposed=not q.transposed) if flip else q.with_changes()
    return return_and_correct_aliasing(func, args, kwargs, out)


@QTensor.implements([aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default])
def _view(func, args, kwargs):
    q, size = args[0], list(args[1])
    if size.count(-1) == 1:
        rest = -torch.Size(size).numel()  # the product of the other entries
        size[size.index(-1)] = q.numel() // rest if rest else 0
    if tuple(size) != tuple(q.shape):
        raise UnsupportedOpError(
            f"{type(q).__name__}: view/reshape from {list(q.shape)} to {list(args[1])}; a "
            f"quantized weight keeps its 2-D shape (use .t() to transpose, or dequantize() first)"
        )
    return return_and_correct_aliasing(func, args, kwargs, q.with_changes())


@QTensor.implements([aten.detach.default, aten.alias.default])
def _detach(func, args, kwargs):
    q = args[0]
    out = q.map_inner(torch.Tensor.detach, keep_device_form=True)
    return return_and_correct_aliasing(func, args, kwargs, out)


# ---- copies and allocation ----------------------------------------------------------------


@QTensor.implements(aten.clone.default)
def _clone(func, args, kwargs):
    return args[0].map_inner(torch.Tensor.clone, fresh=True, keep_device_form=True)


@QTensor.implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    q = args[0]
    dtype = _float_dtype(q, kwargs.get("dtype"), "to")
    device = kwargs.get("device") or q.device
    non_blocking = kwargs.get("non_blocking", False)
    # _to_copy is a copy even when nothing changes (torch returns `self` before getting here).
    out = q.map_inner(
        lambda t: t.to(device, non_blocking=non_blocking, copy=True), fresh=True, dtype=dtype
    )
    # A device form is made for one device: re-made there from the copied canonical tensors.
    return out.repack_for_device()


@QTensor.implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if not isinstance(dst, QTensor) or not isinstance(src, QTensor):
        plain, quant = (dst, src) if isinstance(src, QTensor) else (src, dst)
        raise UnsupportedOpError(
            f"copy_ between a {type(quant).__name__} and a plain {plain.dtype} tensor: copy a "
            f"quantized tensor of the same layout, quantize the source first (from_float / "
            f"qshard.quantize_), or call dequantize() to get floats"
        )
    difference = dst.layout_difference(src)
    if difference or dst.shape != src.shape:
        raise LayoutMismatchError(
            f"copy_ into a {type(dst).__name__} {list(dst.shape)} from {list(src.shape)}: "
            f"{difference or 'the shapes differ'}; quantize the source with the destination's "
            f"config (and reblock() or .to(dtype) it to match)"
        )
    if dst.write_barrier is not None:
        raise UnsupportedOpError(f"copy_ into {type(dst).__name__}: {dst.write_barrier}")
    _check_whole_tensor_values(dst, src)
    for name in dst.inner_names:
        getattr(dst, name).copy_(getattr(src, name))
    # The device form of the tensor these canonical tensors belong to (dst, or the weight dst
    # is a part of), re-made in place so that a compiled graph holding it sees the copy.
    owner = dst if dst.device_names else dst.form_owner
    if owner is not None:
        owner.refresh_device_form()
    else:  # none yet (a model built on meta, then to_empty): made now if its backend wants one
        dst.repack_for_device()
    return return_and_correct_aliasing(func, args, kwargs, dst)


def _check_whole_tensor_values(dst: QTensor, src: QTensor) -> None:
    """A value that covers the whole weight (packing None: NVFP4's global scale) is shared by
    every part of it. Copying another one is right for a whole weight (load_state_dict into a
    quantized model) but would rescale the rest of the parent when `dst` is a part of a larger
    weight (a narrow, a TP shard), seen as packed data that does not span its storage. The same
    holds for a value that spans whole rows (packing (r, WHOLE): per-row scales) when `dst` is
    a part of the columns, seen as packed data narrower than its row stride."""
    packing = dst.packing()
    shared = [n for n, p in packing.items() if spans_dim(p, 1)]
    if not shared:
        return
    packed = [getattr(dst, n) for n, p in packing.items() if p is not None and WHOLE not in p]
    is_part = any(t.untyped_storage().nbytes() > t.numel() * t.element_size() for t in packed)
    is_column_part = any(t.size(1) < t.stride(0) for t in packed)
    for name in shared:
        part = is_part if packing[name] is None else is_column_part
        if part and not torch.equal(getattr(dst, name), getattr(src, name)):
            raise LayoutMismatchError(
                f"copy_ into a part of a {type(dst).__name__}: the source's {name!r} differs "
                f"from the one the whole weight shares; quantize the source with the "
                f"destination's (dst.quantize_like(float_source))"
            )


@QTensor.implements(aten.empty_like.default)
def _empty_like(func, args, kwargs):
    q = args[0]
    dtype = _float_dtype(q, kwargs.get("dtype"), "empty_like")
    device = kwargs.get("device") or q.device
    return q.map_inner(lambda t: torch.empty_like(t, device=device), fresh=True, dtype=dtype)


@QTensor.implements(aten.new_empty.default)
def _new_empty(func, args, kwargs):
    q, size = args[0], tuple(args[1])
    if len(size) != 2:
        raise UnsupportedOpError(f"{type(q).__name__}.new_empty({list(size)}): weights are 2-D")
    dtype = _float_dtype(q, kwargs.get("dtype"), "new_empty")
    shape = (size[1], size[0]) if q.transposed else size
    device = kwargs.get("device") or q.device
    inner = {
        name: torch.empty(s, dtype=d, device=device)
        for name, (s, d) in q.inner_specs(shape, q.attrs()).items()
    }
    return q.with_changes(inner, shape=shape, dtype=dtype, fresh=True)


@QTensor.implements(aten.is_same_size.default)
def _is_same_size(func, args, kwargs):
    return args[0].shape == args[1].shape


@QTensor.implements(aten.cat.default)
def _cat(func, args, kwargs):
    tensors, dim = _cat_args(*args, **kwargs)
    first = tensors[0]
    for t in tensors:
        difference = first.layout_difference(t) if isinstance(t, QTensor) else "a plain tensor"
        if difference:
            raise LayoutMismatchError(
                f"cat of {type(first).__name__} pieces: {difference}; every piece must be the "
                f"same quantized layout (re-block or re-quantize to a common layout first)"
            )
    dim = first.logical_dim(dim)
    other = 1 - dim
    for t in tensors:
        if t.logical_shape[other] != first.logical_shape[other]:
            raise LayoutMismatchError(
                f"cat on logical dim {dim}: shapes {first.logical_shape} and {t.logical_shape} "
                f"differ on the other dim; only pieces of the same {'KN'[dim]} can be joined"
            )
    step = first.slice_granularity(dim)
    pieces = [t for t in tensors if t.logical_shape[dim] > 0]
    for t in pieces[:-1]:
        if t.logical_shape[dim] % step:
            raise LayoutMismatchError(
                f"cat on logical dim {dim}: a piece of size {t.logical_shape[dim]} that is not "
                f"last must be a multiple of {step} (it would leave a partial block inside); "
                f"put it last or re-quantize the joined weight"
            )
    inner = {}
    for name, packing in first.packing().items():
        parts = [getattr(t, name) for t in tensors]
        if spans_dim(packing, dim):
            if not all(torch.equal(parts[0], p) for p in parts[1:]):
                raise LayoutMismatchError(
                    f"cat: {name!r}, shared by every part along this dim, differs between "
                    f"pieces; quantize the pieces with a shared {name!r}"
                )
            inner[name] = parts[0].clone()
        else:
            inner[name] = torch.cat(parts, dim)
    shape = list(first.logical_shape)
    shape[dim] = sum(t.logical_shape[dim] for t in tensors)
    return first.with_changes(inner, shape=tuple(shape), fresh=True)


def _cat_args(tensors, dim=0):
    return list(tensors), dim


# ---- matmul: everything becomes x @ W.T (+ bias) on the untransposed weight ----------------


def _untransposed_weight(w: QTensor) -> QTensor:
    """The [N, K] weight W of `x @ w`, where w is W.t() (the form `linear` decomposes into)."""
    return w.with_changes(transposed=False)


def _check_operands(op: str, x, w, bias=None) -> None:
    if isinstance(x, QTensor) or isinstance(bias, QTensor) or not isinstance(w, QTensor):
        raise UnsupportedOpError(
            f"{op}: only the weight operand may be quantized (got input {type(x).__name__}, "
            f"weight {type(w).__name__}, bias {type(bias).__name__}); pass the quantized weight "
            f"as F.linear's second argument, or dequantize() it"
        )


@QTensor.implements_torch_function(F.linear)
def _linear_fn(func, types, args, kwargs):
    x, w, bias = _linear_args(*args, **kwargs)
    _check_operands("F.linear", x, w, bias)
    if w.transposed:
        raise UnsupportedOpError(
            f"F.linear(x, W) with a transposed {type(w).__name__} {list(w.shape)}; pass the "
            f"[out_features, in_features] weight (W.t())"
        )
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        # Let linear decompose into t + mm/addmm on the QTensor: autograd records those (input
        # gradient through the dequantized weight, `_mm_grad_input`) and the layout's kernel runs
        # below autograd, so no quantization op is ever differentiated.
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return w._linear(x, bias)


def _linear_args(input, weight, bias=None):
    return input, weight, bias


@QTensor.implements(aten.linear.default)
def _linear_aten(func, args, kwargs):
    return _linear_fn(F.linear, (), args, kwargs)


@QTensor.implements(aten.mm.default)
def _mm(func, args, kwargs):
    x, w = args
    _check_operands("mm", x, w)
    if not w.transposed:
        return _mm_grad_input(x, w)
    return _untransposed_weight(w)._linear(x, None)


def _mm_grad_input(grad: torch.Tensor, w: QTensor) -> torch.Tensor:
    """grad @ W for an [N, K] weight W: the input gradient of x @ W.t(), which autograd asks for.

    Through the dequantized weight, as for any frozen quantized weight (QLoRA); a layer's
    forward never comes here, since a linear multiplies by W.t().
    """
    return torch.mm(grad, w.dequantize(grad.dtype))


@QTensor.implements(aten.addmm.default)
def _addmm(func, args, kwargs):
    bias, x, w = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    _check_operands("addmm", x, w, bias)
    if not w.transposed:
        raise UnsupportedOpError(
            f"addmm: x @ W with a {type(w).__name__} W of shape {list(w.shape)} is not a linear "
            f"layer's matmul; qshard computes x @ W.t() (F.linear(x, W))"
        )
    weight = _untransposed_weight(w)
    if beta == 1 and alpha == 1 and bias.dim() == 1:
        return weight._linear(x, bias)
    return beta * bias + alpha * weight._linear(x, None)


# ---- torch-level helpers ------------------------------------------------------------------


@QTensor.implements_torch_function(torch._has_compatible_shallow_copy_type)
def _shallow_copy_type(func, types, args, kwargs):
    # `param.data = new` (set_data) would keep the old inner tensors in the Python object, so
    # report "incompatible"; nn.Module._apply then swaps whole tensors (swap_tensors).
    return False
