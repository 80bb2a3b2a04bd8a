"""The ops every layout shares, written once on QTensor.

Shape ops map an outer dim to the logical [N, K] dim (through `transposed`) and cut each inner
tensor by its packing (`QTensor.packing`). View ops return views of the inner tensors and go
through `return_and_correct_aliasing`, so `w.narrow(0, a, n).copy_(src)` writes into `w` (the
vLLM loading pattern) and torch.compile sees the aliasing. Copies (clone, to, cat, empty_like)
get new storage. Matmuls route to the layout's `_linear`, for `F.linear(x, w)` and for the
`x @ w.t()` that `linear` decomposes into under autograd and DTensor (`t` + `mm` / `addmm`).

Size: about 560 lines, one handler table: every aten op a QTensor takes, each a few lines,
sharing the slicing and aliasing helpers at the top.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing

from ..errors import InvalidDimError, LayoutMismatchError, NonFiniteWeightError, UnsupportedOpError
from .base import QTensor, as_bytes, equal_inner, is_frozen_parameter, join_inner, outer_layout
from .validation import FLOAT_DTYPES, check_magnitude

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
    start, end = _clamp_range(start, end, q.shape[dim])
    return return_and_correct_aliasing(func, args, kwargs, _slice_outer(q, dim, start, end))


def _slice_args(q, dim=0, start=None, end=None, step=1):
    q.logical_dim(dim)  # validates dim
    return q, dim, start, end, step


@QTensor.implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(func, args, kwargs):
    q, sizes, dim = _split_args(*args, **kwargs)
    q.logical_dim(dim)
    size = q.shape[dim]
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
    ndim = q.dim()
    if func is aten.t.default:
        if ndim != 2:
            raise InvalidDimError(f"{type(q).__name__}.t(): experts are 3-D; use transpose(-2, -1)")
        dims = [1, 0]
    elif func is aten.transpose.int:
        q.logical_dim(args[1]), q.logical_dim(args[2])  # validates both
        a, b = args[1] % ndim, args[2] % ndim
        dims = list(range(ndim))
        dims[a], dims[b] = dims[b], dims[a]
    else:
        dims = [d % ndim if isinstance(d, int) and -ndim <= d < ndim else d for d in args[1]]
    lead = list(range(q.lead))
    if dims[: q.lead] != lead or sorted(dims) != list(range(ndim)):
        raise InvalidDimError(
            f"{type(q).__name__}.{func.__name__.split('.')[0]}{tuple(args[1:])}: a quantized "
            f"{'experts weight keeps experts first and ' if q.lead else ''}weight can only swap "
            f"its last two dims (transpose(-2, -1))"
        )
    flip = dims[-1] != ndim - 1
    out = q.with_changes(transposed=not q.transposed) if flip else q.with_changes()
    return return_and_correct_aliasing(func, args, kwargs, out)


@QTensor.implements(aten.narrow.default)
def _narrow(func, args, kwargs):
    """`w.narrow(dim, start, length)`: reaches dispatch under inference_mode only."""
    q, dim, start, length = args
    return _slice(aten.slice.Tensor, (q, dim, start, start + length), {})


_TRANSPOSE_ALIASES = [
    aten.numpy_T.default,
    aten.mT.default,
    aten.mH.default,
    aten.adjoint.default,
    aten.swapaxes.default,
    aten.swapdims.default,
]


@QTensor.implements(_TRANSPOSE_ALIASES)
def _transpose_alias(func, args, kwargs):
    """`w.T`, `w.mT`, `swapaxes`...: what reaches dispatch under inference_mode (outside it,
    autograd decomposes them into transpose / permute first)."""
    q = args[0]
    if func in (aten.swapaxes.default, aten.swapdims.default):
        return _transpose(aten.transpose.int, (q, args[1], args[2]), {})
    if func is aten.numpy_T.default:
        return _transpose(aten.permute.default, (q, list(range(q.dim()))[::-1]), {})
    return _transpose(aten.transpose.int, (q, -2, -1), {})


@QTensor.implements([aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default])
def _view(func, args, kwargs):
    q, size = args[0], list(args[1])
    if size.count(-1) == 1:
        rest = -torch.Size(size).numel()  # the product of the other entries
        size[size.index(-1)] = q.numel() // rest if rest else 0
    if tuple(size) != tuple(q.shape):
        raise UnsupportedOpError(
            f"{type(q).__name__}: view/reshape from {list(q.shape)} to {list(args[1])}; a "
            f"quantized weight keeps its shape (use transpose(-2, -1), index experts with w[e], or "
            f"dequantize() first)"
        )
    return return_and_correct_aliasing(func, args, kwargs, q.with_changes())


@QTensor.implements(aten.as_strided.default)
def _as_strided(func, args, kwargs):
    # torch.compile re-makes a graph output that aliases a graph input with as_strided on the
    # input (AOT autograd's gen_alias_from_base): e.g. a compiled frame that returns a
    # DTensor's local QTensor (transformers' `_use_local_dtensor_params` calls `to_local()`).
    # The aliases a quantized weight has are itself and its swap of the last two dims.
    q, size, stride, offset = _as_strided_args(*args, **kwargs)
    for transposed in (q.transposed, not q.transposed):
        shape, strides = outer_layout(q.logical_shape, transposed)
        if (tuple(size), tuple(stride)) == (shape, strides) and offset in (None, 0):
            out = q.with_changes(transposed=transposed)
            return return_and_correct_aliasing(func, args, kwargs, out)
    raise UnsupportedOpError(
        f"{type(q).__name__}.as_strided({list(size)}, {list(stride)}, {offset}) of a "
        f"{list(q.shape)} weight with strides {list(q.stride())}: a quantized weight can only be "
        f"viewed as itself or with its last two dims swapped; dequantize() first for other views"
    )


def _as_strided_args(q, size, stride, storage_offset=None):
    return q, size, stride, storage_offset


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
    if dtype != q.dtype:  # `.half()`: the packed data stays; its values must fit float16
        fix = (
            f"Keep this weight in {q.dtype} or bfloat16 (model.to(torch.bfloat16)), or "
            f"quantize the {dtype} model instead. In a model.half() / model.to(), the "
            f"modules converted before this one are {dtype} now: convert the model back "
            f"(e.g. model.to({q.dtype})) or reload it"
        )
        check_magnitude(out, f".to({dtype})", NonFiniteWeightError, fix)
    # A device form is made for one device: re-made there from the copied canonical tensors.
    return out.repack_for_device()


@QTensor.implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(src, QTensor) and not isinstance(dst, QTensor):
        # What model.load_state_dict(quantized_state) does to a float model's parameters.
        raise UnsupportedOpError(
            f"copy_ of a quantized {type(src).__name__} {list(src.shape)} into a plain "
            f"{dst.dtype} tensor: a float parameter cannot hold quantized data in place (this is "
            f"what model.load_state_dict(qshard_state_dict) does). Load it with "
            f"qshard.load(checkpoint_dir, model), or model.load_state_dict(state, assign=True) "
            f"followed by qshard.repack_for_device(model); or copy src.dequantize() for floats"
        )
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
    src = src.stored_as(dst)  # (int4: the same codes in dst's order)
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
    quantized model) but would rescale the rest of the parent when `dst` is a view of a part of
    its rows or columns (a narrow: `cut_dims`). The same holds for a value that spans whole rows
    (packing (r, WHOLE): per-row scales) when `dst` is a part of the columns. Such values are
    per expert: a copy into whole experts (w[e], w[a:b]) replaces theirs."""
    columns = dst.lead + 1
    shared = [n for n in dst.inner_names if dst.inner_step(n, columns) is None]
    for name in shared:
        # a whole-matrix value is shared by a part of the rows or columns, a whole-row value
        # by a part of the columns
        whole_matrix = dst.inner_step(name, dst.lead) is None
        part = dst.cut_dims if whole_matrix else dst.cut_dims & {1}
        if part and not equal_inner(getattr(dst, name), getattr(src, name)):
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
    if len(size) not in (2, 3):
        raise UnsupportedOpError(
            f"{type(q).__name__}.new_empty({list(size)}): quantized weights are 2-D [N, K] or "
            f"3-D experts [E, N, K]"
        )
    dtype = _float_dtype(q, kwargs.get("dtype"), "new_empty")
    shape = (*size[:-2], size[-1], size[-2]) if q.transposed else size
    device = kwargs.get("device") or q.device
    inner = {
        name: torch.empty(s, dtype=d, device=device)
        for name, (s, d) in q.inner_specs(shape, q.attrs()).items()
    }
    # (in the canonical storage: another shape may not take the other, int4's native order)
    canonical = {name: q.attr_defaults[name] for name in q.storage_attrs}
    return q.with_changes(inner, shape=shape, dtype=dtype, fresh=True, **canonical)


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
    tensors = first.in_one_storage(tensors)
    first = tensors[0]
    dim = first.logical_dim(dim)
    for t in tensors:
        others = [n for i, n in enumerate(t.logical_shape) if i != dim]
        if others != [n for i, n in enumerate(first.logical_shape) if i != dim]:
            raise LayoutMismatchError(
                f"cat on logical dim {dim}: shapes {first.logical_shape} and {t.logical_shape} "
                f"differ on another dim; only pieces that differ along the joined dim can be "
                f"joined"
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
    for name in first.inner_names:
        parts = [getattr(t, name) for t in tensors]
        if first.inner_step(name, dim) is None:
            if not all(equal_inner(parts[0], p) for p in parts[1:]):
                raise LayoutMismatchError(
                    f"cat: {name!r}, shared by every part along this dim, differs between "
                    f"pieces; quantize the pieces with a shared {name!r}"
                )
            inner[name] = parts[0].clone()
        else:
            inner[name] = join_inner(parts, dim)
    shape = list(first.logical_shape)
    shape[dim] = sum(t.logical_shape[dim] for t in tensors)
    return first.with_changes(inner, shape=tuple(shape), fresh=True)


def _cat_args(tensors, dim=0):
    return list(tensors), dim


# ---- experts: w[e], unbind, w[index], torch.stack ----------------------------------------


def _experts_of(q: QTensor, op: str) -> int:
    if q.experts is None:
        raise UnsupportedOpError(
            f"{type(q).__name__}.{op} on a 2-D weight {list(q.shape)}: indexing picks experts "
            f"of a 3-D experts weight; slice a weight with w[a:b] or narrow"
        )
    return q.experts


@QTensor.implements(aten.select.int)
def _select(func, args, kwargs):
    q, dim, index = args
    experts = _experts_of(q, "select")
    if q.logical_dim(dim) != 0:
        raise UnsupportedOpError(
            f"{type(q).__name__}.select(dim={dim}): only experts (dim 0) can be picked; "
            f"slice rows or columns with w[:, a:b] instead"
        )
    if not -experts <= index < experts:
        raise IndexError(f"expert {index} is out of range for {experts} experts")
    out = q.expert(index % experts)
    return return_and_correct_aliasing(func, args, kwargs, out)


@QTensor.implements(aten.unbind.int)
def _unbind(func, args, kwargs):
    q, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim", 0)
    _experts_of(q, "unbind")
    if q.logical_dim(dim) != 0:
        raise UnsupportedOpError(f"{type(q).__name__}.unbind(dim={dim}): unbind experts (dim 0)")
    return return_and_correct_aliasing(func, args, kwargs, tuple(q.expert_list()))


@QTensor.implements(aten.index.Tensor)
def _index(func, args, kwargs):
    """w[ids] with a tensor of expert ids (transformers' batched_mm gathers the experts each
    token uses): a copy holding those experts, in that order."""
    q, indices = args
    experts = _experts_of(q, "index")
    if len(indices) != 1 or indices[0] is None or indices[0].dtype.is_floating_point:
        raise UnsupportedOpError(
            f"{type(q).__name__}[...]: a quantized experts weight is indexed by one integer "
            f"tensor of expert ids along dim 0 (w[ids]); got {len(indices)} index tensors"
        )
    ids = indices[0]
    if ids.dtype == torch.bool:
        ids = ids.nonzero().squeeze(-1)
    if ids.dim() > 1:
        raise UnsupportedOpError(
            f"{type(q).__name__}[ids]: ids of shape {list(ids.shape)}; index experts with a "
            f"0-D or 1-D tensor of expert ids"
        )
    # No host sync (compiled graphs): index_select itself refuses ids out of range.
    flat = ids.reshape(-1).to(torch.long)
    flat = torch.where(flat < 0, flat + experts, flat)
    inner = {
        n: as_bytes(t).index_select(0, flat).view(t.dtype) for n, t in q.inner_tensors().items()
    }
    if ids.dim() == 0:  # w[tensor(e)]: the eager experts loop's index
        inner = {n: t.squeeze(0) for n, t in inner.items()}
        return q.with_changes(inner, shape=q.matrix_shape, fresh=True)
    return q.with_changes(inner, shape=(flat.shape[0], *q.matrix_shape), fresh=True)


@QTensor.implements(aten.stack.default)
def _stack(func, args, kwargs):
    tensors, dim = _cat_args(*args, **kwargs)
    first = tensors[0]
    if dim != 0 or not all(isinstance(t, QTensor) and t.experts is None for t in tensors):
        raise UnsupportedOpError(
            f"torch.stack of quantized weights (dim={dim}): stack 2-D weights of one layout "
            f"along a new dim 0 to make [E, N, K] experts"
        )
    return type(first).stack_experts(tensors)


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
    if w.experts is not None:
        raise UnsupportedOpError(
            f"F.linear with a {type(w).__name__} experts weight {list(w.shape)}: F.linear takes "
            f"one expert's weight (w[e]); run all experts with torch._grouped_mm or torch.bmm"
        )
    if w.transposed:
        raise UnsupportedOpError(
            f"F.linear(x, W) with a transposed {type(w).__name__} {list(w.shape)}; pass the "
            f"[out_features, in_features] weight (W.t())"
        )
    grads = x.requires_grad or w.requires_grad or (bias is not None and bias.requires_grad)
    if torch.is_grad_enabled() and grads:
        # Let linear decompose into t + mm/addmm on the QTensor: autograd records those (input
        # gradient through the dequantized weight, `_mm_grad_input`) and the layout's kernel runs
        # below autograd, so no quantization op is ever differentiated. A frozen Parameter goes
        # in as a detached alias (same inner tensors): the graph's saved `w.t()` must not be a
        # view of the Parameter itself, or `model.half()` / `.to()` cannot swap it while the
        # output is alive; a weight that requires grad keeps its gradient.
        weight = w.detach() if is_frozen_parameter(w) else w
        with torch._C.DisableTorchFunctionSubclass():
            return func(x, weight, bias)
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


@QTensor.implements(aten.matmul.default)
def _matmul(func, args, kwargs):
    """x @ W.t() with x of any leading dims: what `matmul` reaches dispatch as under
    inference_mode (outside it, autograd decomposes it into reshapes and `mm` first)."""
    x, w = args
    if isinstance(x, QTensor) or not isinstance(w, QTensor) or w.dim() != 2 or x.dim() < 1:
        raise UnsupportedOpError(
            f"matmul: {type(x).__name__} {list(x.shape)} @ {type(w).__name__} {list(w.shape)}; "
            f"qshard multiplies activations by a 2-D weight (x @ W.t(), F.linear(x, W))"
        )
    out = _mm(aten.mm.default, (x.reshape(-1, x.shape[-1]), w), {})
    return out.reshape(*x.shape[:-1], w.shape[-1])


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
