"""QTensor: the base class of every quantized weight.

A layout subclass *declares* its inner tensors (`inner_names`) and its attributes (`attr_names`);
from those this class derives `__tensor_flatten__`/`__tensor_unflatten__` (what torch.compile and
DTensor need), `__repr__`, and the shape ops in `ops.py` (slice, split, cat, t, view, detach, clone,
to, copy_, ...), which are written once here and driven by one hook per layout:

    packing() -> {inner name: (rows, cols) of the logical weight one element covers, or None}

Every inner tensor is 2-D with dim 0 along the weight's output dim N and dim 1 along its input dim
K (a tensor that covers the whole weight, such as a per-tensor scale, maps to None and is shared
by every slice). An element (i, j) of an inner tensor with packing (r, c) covers the logical rows
[i*r, (i+1)*r) and columns [j*c, (j+1)*c), clipped at the edge (partial edge blocks). A side
`WHOLE` spans the whole dim: a per-row scale [N, 1] is (1, WHOLE), shared by every part of its
row, as a None value is shared by every part of the weight.

A layout may also keep a *device form*: the same weight arranged for one backend's kernels on
one device (tinygemm's tiles, gemlite's packing), made from the canonical inner tensors by
`repack_for_device()`. It is a cache, not part of the layout: `inner_tensors()`, checkpoints and
the shape ops see only the canonical tensors; ops that keep the logical weight (detach, t, view,
clone, to, copy_) keep or re-make the form, ops that change it (slice, split, cat) drop it, and
pickling drops it (one canonical packing, repacked for the device after loading: docs/design.md
invariant 5).
Its tensors are attributes named in `device_names`, flattened after the inner tensors so that
torch.compile sees them as graph inputs; `device_meta` holds its non-tensor arguments.

The logical shape is the quantized weight's [N, K]; `transposed` flips the outer shape to [K, N]
without moving data (so `F.linear`'s decomposition `x @ w.t()` routes back to the layout). The
outer dtype is the float dtype that `dequantize()` returns and that activations are expected in.

Expert weights (docs/design.md invariant 8) are the same classes with a leading expert dim: logical
[E, N, K], every inner tensor [E, ...] of what one expert's [N, K] weight holds (a whole-tensor
value such as NVFP4's global scale becomes one per expert), outer [E, N, K] or, transposed,
[E, K, N]. The layouts write only the 2-D hooks (`quantize_matrix`, `matrix_specs`,
`dequantize_matrix`, ...); this class runs them per expert, and `packing()` sides apply to the
last two dims, so every shape op (slicing experts, N or K; `w[e]`, which is expert e's 2-D
tensor as a view) goes through the same code. Logical dims index `logical_shape`: 0 = N, 1 = K
for a weight, 0 = E, 1 = N, 2 = K for experts.

Size: one class, about 880 lines as the formatter lays it out; it stays in one file because
its methods are the one contract every layout implements (the hooks above, the shape-op
helpers, the device form, the experts view), read together when a layout is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch

from ..errors import (
    CheckpointError,
    InvalidDimError,
    LayoutMismatchError,
    MisalignedSliceError,
    UnsupportedOpError,
    UnsupportedWeightError,
)
from .attrs import op_args
from .validation import check_pickled_state, check_qtensor

__all__ = ["WHOLE", "DeviceForm", "QTensor", "spans_dim", "stored_nbytes"]

Handler = Callable[..., Any]
Packing = dict[str, tuple[int, int] | None]

# A packing side that spans the whole dim (see the module docstring).
WHOLE = -1
# Handlers of ops by name, for every QTensor (QTensor.implements_named).
_NAMED_OPS: dict[str, Handler] = {}


# Dtypes that CUDA stores but has few kernels for (torch 2.11 on an H200: "cat_cuda not
# implemented for 'Float8_e8m0fnu'"): the ops that only move bytes (cat, stack, index_select,
# equal) run on a uint8 view of them, the same bytes.
_BYTE_ONLY_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, name)
)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or a uint8 view of it for a dtype with byte-moving kernels only on the CPU."""
    return t.view(torch.uint8) if t.dtype in _BYTE_ONLY_DTYPES else t


def join_inner(parts: list[torch.Tensor], dim: int, stack: bool = False) -> torch.Tensor:
    """torch.cat (or torch.stack) of inner tensors of one dtype, on any device."""
    dtype = parts[0].dtype
    joined = (torch.stack if stack else torch.cat)([as_bytes(p) for p in parts], dim)
    return joined.view(dtype) if dtype in _BYTE_ONLY_DTYPES else joined


def equal_inner(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal of inner tensors, on any device."""
    return a.dtype == b.dtype and torch.equal(as_bytes(a), as_bytes(b))


def spans_dim(packing: tuple[int, int] | None, dim: int) -> bool:
    """Whether an inner tensor with this packing is shared by every part cut along `dim`."""
    return packing is None or packing[dim] == WHOLE


@dataclasses.dataclass(frozen=True)
class DeviceForm:
    """A weight arranged for one backend's kernels on one device (see the module docstring):
    its tensors by attribute name, and the non-tensor arguments its kernels take."""

    tensors: dict[str, torch.Tensor]
    meta: tuple = ()

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> DeviceForm:
        return DeviceForm({n: fn(t) for n, t in self.tensors.items()}, self.meta)


class QTensor(torch.Tensor):
    """Base of the quantized weight tensors. See the module docstring for the contract."""

    inner_names: ClassVar[tuple[str, ...]] = ()
    attr_names: ClassVar[tuple[str, ...]] = ()
    # Values of attributes added after a layout's first release, for checkpoints and pickles
    # written before them.
    attr_defaults: ClassVar[dict[str, Any]] = {}
    # Attributes that choose how the same values are stored (int4's code order): tensors that
    # differ only in them are one layout; copy_ and cat convert (`stored_as`, `canonical`), and
    # checkpoints, pickles and exports hold the canonical form.
    storage_attrs: ClassVar[tuple[str, ...]] = ()
    # On a view of a part of a weight's (or each expert's) rows or columns: those matrix dims
    # (0 = N, 1 = K). A copy_ into it must not change values the rest of the weight shares.
    cut_dims: frozenset[int] = frozenset()
    # On `expert(e)` of experts (and views of it): its inner tensors are parts of theirs.
    expert_view: bool = False
    # Per-class op tables, filled by `implements` / `implements_torch_function`.
    _aten_ops: ClassVar[dict[Any, Handler]] = {}
    _torch_fn_ops: ClassVar[dict[Any, Handler]] = {}

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._aten_ops = {}
        cls._torch_fn_ops = {}

    @staticmethod
    def __new__(
        cls,
        inner: Mapping[str, torch.Tensor],
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        transposed: bool = False,
        device_form: DeviceForm | None = None,
        **attrs: Any,
    ):
        outer, strides = outer_layout(shape, transposed)
        device = inner[cls.inner_names[0]].device
        # Never an inference tensor: a view op's output under inference_mode gets its base's
        # version counter, which torch refuses to give an inference tensor ("Cannot set
        # version_counter for inference tensor"); a plain tensor's view there is normal too.
        with torch.inference_mode(False):
            return torch.Tensor._make_wrapper_subclass(
                cls, outer, strides=strides, dtype=dtype, device=device, requires_grad=False
            )

    def __init__(
        self,
        inner: Mapping[str, torch.Tensor],
        *,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        transposed: bool = False,
        device_form: DeviceForm | None = None,
        **attrs: Any,
    ):
        for name in self.inner_names:
            setattr(self, name, inner[name])
        self.device_names: tuple[str, ...] = ()
        self.device_meta: tuple = ()
        self.set_device_form(device_form)
        # On a view of a part of a tensor with a device form (a slice, narrow, split): that
        # tensor, whose form a copy_ into this part must refresh (the part has none).
        self.form_owner: QTensor | None = None
        attrs = {**self.attr_defaults, **attrs}
        missing = set(self.attr_names) - set(attrs)
        extra = set(attrs) - set(self.attr_names)
        assert not missing and not extra, f"{type(self).__name__}: attrs {missing=} {extra=}"
        for name in self.attr_names:
            setattr(self, name, attrs[name])
        assert len(shape) in (2, 3), shape
        self.logical_shape = tuple(int(n) for n in shape)
        self.transposed = bool(transposed)
        # Set on a view whose inner tensors are not all views of its base (an FP8 slice that
        # re-blocked its scales): copy_ into it would reach only part of the base, so it is
        # refused with this reason. Views inherit it; fresh tensors (clone, to, cat) do not.
        self.write_barrier: str | None = None

    # ---- hooks a layout implements (for one [N, K] weight) ----------------------------------

    def packing(self) -> Packing:
        """{inner name: (rows, cols) one element covers, or None for a whole-tensor value}."""
        raise NotImplementedError

    @classmethod
    def matrix_specs(
        cls, shape: tuple[int, int], attrs: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of every inner tensor for a logical [N, K] weight."""
        raise NotImplementedError

    @classmethod
    def quantize_matrix(cls, weight: torch.Tensor, config: Any = None, **kwargs: Any) -> QTensor:
        """Quantize one float [N, K] weight (`from_float` calls it, per expert for experts)."""
        raise NotImplementedError

    def config(self) -> Any:
        """The QuantConfig that gives this tensor's layout (recorded in checkpoints)."""
        raise NotImplementedError

    @classmethod
    def from_float_part(cls, part: torch.Tensor, whole: torch.Tensor, config: Any) -> QTensor:
        """Quantize `part` of the float weight `whole` (a rank's shard of a DTensor weight, and
        the DTensor) as `from_float(whole)` would quantize that part. Per-tensor state (NVFP4's
        global scale) is computed over `whole`: shard-then-quantize equals quantize-then-shard."""
        return cls.from_float(part, config)

    def quantize_matrix_like(self, weight: torch.Tensor, at: tuple[int, int] = (0, 0)) -> QTensor:
        """`quantize_like` for an [N, K] weight: a layout with state a part cannot recompute
        (NVFP4's global scale, the per-row FP8 scales of rows at[0]...) overrides it."""
        return type(self).from_float(weight, self.config())

    @classmethod
    def check_attrs(cls, attrs: Mapping[str, Any]) -> None:
        """Raise ConfigError if `attrs` (decoded from a checkpoint) are not a valid layout."""
        raise NotImplementedError

    def dequantize_matrix(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`dequantize()` of one [N, K] weight."""
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias for the untransposed [N, K] weight W."""
        raise NotImplementedError

    def grouped_linear(
        self, x: torch.Tensor, offs: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """For untransposed [E, N, K] experts: rows offs[e-1]..offs[e] of the tokens x [T, K]
        (sorted by expert) times W[e].T, + bias[e] ([E, N]); zeros past offs[-1]. The default
        runs each expert's `_linear` inside one custom op (qtensor/grouped.py); a layout with
        a fused grouped kernel overrides it."""
        inner, layout, attrs, dtype, shape = op_args(self)
        return torch.ops.qshard.experts_linear(x, offs, inner, bias, layout, attrs, dtype, shape)

    def matrix_max_magnitude(self) -> float:
        """`max_magnitude()` of one [N, K] weight."""
        raise NotImplementedError

    def matrix_value_problem(self) -> str | None:
        """`value_problem()` of one [N, K] weight."""
        return None

    # ---- what every layout gets from those hooks, for a weight or for experts -------------

    def quantize_like(self, weight: torch.Tensor, at: tuple[int, ...] = (0, 0)) -> QTensor:
        """`weight` (a part of the float weight this tensor came from, whose first element is
        logical element `at` of this one) quantized as this tensor quantized it: its config,
        and any state a part cannot recompute. Slicing commutes with this (docs/design.md
        invariant 1). For experts, `at` = (expert, row, column) and `weight` is a part of one
        expert ([n, k]) or of several ([e, n, k]), each quantized as its own expert was."""
        if self.experts is None:
            return self.quantize_matrix_like(weight, at)
        first, inner_at = at[0], tuple(at[1:])
        if weight.dim() == 2:
            return self.expert(first).quantize_matrix_like(weight, inner_at)
        if weight.dim() != 3 or not weight.shape[0]:
            return type(self).from_float(weight, self.config())  # its typed refusal
        parts = [
            self.expert(first + i).quantize_matrix_like(w, inner_at)
            for i, w in enumerate(weight.unbind(0))
        ]
        return self.stack_experts(parts)

    @classmethod
    def from_float(cls, weight: torch.Tensor, config: Any = None, **kwargs: Any) -> QTensor:
        """Quantize a float [N, K] weight, or [E, N, K] experts each exactly as its own [N, K]
        weight (invariant 8). For experts, a tensor keyword argument (NVFP4's `global_scale`,
        gptq's `group_params`) holds one per expert along a leading dim."""
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 3):
            return cls.quantize_matrix(weight, config, **kwargs)
        if weight.shape[0] == 0:
            raise UnsupportedWeightError(
                f"{cls.__name__}.from_float: experts weight {list(weight.shape)} holds no "
                f"expert; an experts weight is [E, N, K] with E >= 1"
            )
        experts = [
            cls.quantize_matrix(w, config, **_expert_kwargs(kwargs, e))
            for e, w in enumerate(weight.unbind(0))
        ]
        return cls.stack_experts(experts)

    @classmethod
    def inner_specs(
        cls, shape: tuple[int, ...], attrs: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of every inner tensor for a logical [N, K] weight or [E, N, K]
        experts (each inner tensor with a leading E)."""
        lead = tuple(shape[:-2])
        specs = cls.matrix_specs(tuple(shape[-2:]), attrs)
        return {name: (lead + tuple(s), dtype) for name, (s, dtype) in specs.items()}

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight this tensor stands for, in its outer (possibly transposed) shape."""
        if self.experts is None:
            return self.dequantize_matrix(dtype)
        if not self.experts:
            return torch.empty(self.shape, dtype=dtype or self.dtype, device=self.device)
        return torch.stack([w.dequantize_matrix(dtype) for w in self.expert_list()])

    def max_magnitude(self) -> float:
        """An upper bound of |W| over every code each group's scales can dequantize (not only
        the stored codes), in float64: the validation (qtensor/validation.py) refuses a tensor
        whose bound exceeds its dtype's largest finite value, so no code becomes Inf."""
        if self.experts is None:
            return self.matrix_max_magnitude()
        return max((w.matrix_max_magnitude() for w in self.expert_list()), default=0.0)

    def value_problem(self) -> str | None:
        """What breaks the layout's value rules beyond finiteness (e.g. an int4 zero code
        outside 0..15), or None. Run on every tensor a reader builds."""
        if self.experts is None:
            return self.matrix_value_problem()
        for e, w in enumerate(self.expert_list()):
            problem = w.matrix_value_problem()
            if problem:
                return f"expert {e}: {problem}"
        return None

    # ---- experts ----------------------------------------------------------------------------

    @property
    def experts(self) -> int | None:
        """E for [E, N, K] experts, None for an [N, K] weight."""
        return self.logical_shape[0] if len(self.logical_shape) == 3 else None

    @property
    def lead(self) -> int:
        """How many logical dims come before [N, K]: 1 for experts, else 0."""
        return len(self.logical_shape) - 2

    @property
    def matrix_shape(self) -> tuple[int, int]:
        """[N, K] of the weight, or of each expert."""
        return self.logical_shape[-2], self.logical_shape[-1]

    def expert(self, e: int) -> QTensor:
        """Expert e's [N, K] weight, a view (what `w[e]` gives)."""
        assert self.experts is not None and 0 <= e < self.experts, (self.logical_shape, e)
        inner = {name: t.select(0, e) for name, t in self.inner_tensors().items()}
        out = self.with_changes(inner, shape=self.matrix_shape)
        out.form_owner = self if self.device_names else self.form_owner
        out.expert_view = True
        return out

    def expert_list(self) -> list[QTensor]:
        return [self.expert(e) for e in range(self.experts or 0)]

    @classmethod
    def stack_experts(cls, experts: list[QTensor]) -> QTensor:
        """[E, N, K] experts from E [N, K] weights of one layout and shape (`torch.stack`)."""
        first = experts[0]
        for w in experts:
            difference = first.layout_difference(w) if isinstance(w, QTensor) else "plain"
            if difference or w.logical_shape != first.logical_shape or w.experts is not None:
                raise LayoutMismatchError(
                    f"stacking experts: {difference or 'shapes'} differ ({type(first).__name__}"
                    f" {list(first.logical_shape)} vs {type(w).__name__} "
                    f"{list(getattr(w, 'logical_shape', w.shape))}); every expert must be an "
                    f"[N, K] weight of one layout, config and shape"
                )
        experts = first.in_one_storage(experts)
        first = experts[0]
        inner = {
            name: join_inner([getattr(w, name) for w in experts], 0, stack=True)
            for name in first.inner_names
        }
        shape = (len(experts), *first.logical_shape)
        # in the storage experts take on this device (int4 on Hopper: each expert quantized
        # alone holds the native order, the grouped kernels read the canonical one)
        return first.with_changes(inner, shape=shape, fresh=True).repack_for_device()

    def activation_scale_spans_k(self) -> bool:
        """Whether the matmul quantizes activations with scales taken over the whole of K (per-row
        FP8 W8A8: one scale per token). A row-parallel shard then quantizes its own slice of K,
        so the TP output is the sum of the parts' products (as in vLLM's and torchao's TP), not
        the single-device product up to summation order; docs/design.md invariant 6 holds per
        part."""
        return False

    def canonical(self) -> QTensor:
        """This weight in the canonical storage of its layout (what checkpoints, pickles and
        third-party formats hold): self where it is already (every layout without
        `storage_attrs`)."""
        return self

    def in_one_storage(self, pieces: list[QTensor]) -> list[QTensor]:
        """`pieces` of this layout (cat, stack), or all of them canonical where their
        `storage_attrs` differ (int4's code orders): joined, they must be stored alike."""
        stored = {tuple(getattr(p, n) for n in self.storage_attrs) for p in pieces}
        return [p.canonical() for p in pieces] if len(stored) > 1 else pieces

    def stored_as(self, other: QTensor) -> QTensor:
        """This weight stored as `other` (of the same layout and shape) stores its values (its
        `storage_attrs`): self where it already is."""
        return self

    def make_device_form(self) -> DeviceForm | None:
        """This weight arranged for its backend's kernels on its device, or None where the
        backend runs on the canonical tensors (or cannot run on this device)."""
        return None

    def _realign_misaligned(self, dim: int, offsets: list[int]) -> QTensor:
        """The same weight re-packed so that `offsets` of matrix `dim` (0 = N, 1 = K; they now
        cut through a packed element or block) fall on packing boundaries, with `dequantize()`
        unchanged. For experts, every expert is re-packed alike (index tensors with dims -2, -1).

        A layout that can do this exactly (FP8 re-blocking) overrides it; the default raises an
        error that says which offsets are allowed.
        """
        step = self.slice_granularity(dim + self.lead)
        raise MisalignedSliceError(
            f"{type(self).__name__}: cutting {self._dim_text(dim)} at offsets {offsets} cuts "
            f"through the packing {self._packing_text()}; cut at multiples of {step} (the end "
            f"may also be {self.matrix_shape[dim]})"
        )

    # ---- derived machinery ----------------------------------------------------------------

    @classmethod
    def implements(cls, ops: Any | Iterable[Any]) -> Callable[[Handler], Handler]:
        """Register `handler(func, args, kwargs)` for aten ops on this class (and subclasses)."""
        return _register(cls._aten_ops, ops)

    @classmethod
    def implements_torch_function(cls, funcs: Any | Iterable[Any]) -> Callable[[Handler], Handler]:
        """Register `handler(func, types, args, kwargs)` at the `__torch_function__` level."""
        return _register(cls._torch_fn_ops, funcs)

    @classmethod
    def implements_named(cls, name: str) -> Callable[[Handler], Handler]:
        """Register an aten-level handler for the op called `name` ("namespace::op"), for ops
        of libraries that may not be imported yet (transformers' own custom ops)."""
        return _register(_NAMED_OPS, name)

    @classmethod
    def _lookup(cls, table_name: str, func: Any) -> Handler | None:
        for klass in cls.__mro__:
            table = klass.__dict__.get(table_name)
            if table is not None and func in table:
                return table[func]
        return None

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = cls._lookup("_torch_fn_ops", func)
        if handler is not None:
            return handler(func, types, args, kwargs)
        if func in _USES_OF_WEIGHTS and torch.is_grad_enabled():
            # A model's `w.transpose(-2, -1)` or `torch._grouped_mm(x, w, ...)` under grad mode
            # would keep the Parameter itself in the autograd graph (as a view's base or a saved
            # operand), and `model.half()` / `.to()` could not swap it while an output is alive
            # (torch's "Couldn't swap"): use a detached alias (the same inner tensors; no
            # gradient flows to a frozen weight). Not under no_grad, where no graph keeps it:
            # the detach doubles a view's cost (19 -> 37 us), paid per expert in eager MoE loops.
            args = tuple(a.detach() if is_frozen_parameter(a) else a for a in args)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = cls._lookup("_aten_ops", func) or _NAMED_OPS.get(func.name())
        if handler is None and func.namespace in ("c10d", "_c10d_functional"):
            raise UnsupportedOpError(
                f"{cls.__name__} cannot go through the collective {func}: shard quantized "
                f"weights with qshard.tp.parallelize (each rank slices its own copy), or pass "
                f"src_data_rank=None to torch's distribute_tensor / parallel styles"
            )
        if handler is None:
            raise UnsupportedOpError(
                f"{cls.__name__} does not implement {func}. Shape ops shared by every layout "
                f"live in qshard/qtensor/ops.py; an op for this layout alone is added with "
                f"@{cls.__name__}.implements(torch.ops.{func}) in {_source_file(cls)}"
            )
        return handler(func, args, kwargs)

    def __tensor_flatten__(self):
        ctx = (self.logical_shape, self.dtype, self.transposed, self.attr_values())
        ctx += (self.device_names, self.device_meta)
        return list(self.inner_names) + list(self.device_names), ctx

    @classmethod
    def __tensor_unflatten__(cls, inner_tensors, ctx, outer_size, outer_stride):
        shape, dtype, transposed, attr_values, device_names, device_meta = ctx
        attrs = dict(zip(cls.attr_names, attr_values, strict=True))
        form = None
        if device_names:
            form = DeviceForm({n: inner_tensors[n] for n in device_names}, device_meta)
        inner = {n: inner_tensors[n] for n in cls.inner_names}
        return cls(
            inner, shape=shape, dtype=dtype, transposed=transposed, device_form=form, **attrs
        )

    def __getstate__(self):
        # What torch.save pickles: the canonical storage, without the device form (it belongs
        # to one device and is re-made by repack_for_device() after loading; docs/design.md
        # invariant 5).
        state = {k: v for k, v in self.__dict__.items() if k not in self.device_names}
        source = self.canonical()
        if source is not self:
            state.update({n: getattr(source, n) for n in (*self.inner_names, *self.storage_attrs)})
        state.pop("cut_dims", None)  # a pickle is a whole weight of its own
        state.pop("expert_view", None)
        state["device_names"], state["device_meta"], state["form_owner"] = (), (), None
        return state

    def __setstate__(self, state):
        # What torch.load (weights_only=True included) calls on a rebuilt tensor: the state is
        # outside data, checked as every reader checks a QTensor (docs/design.md invariant 9), so a
        # crafted pickle cannot declare a shape its data does not hold, shadow a method, or
        # carry NaN scales. A tensor pickled before an attribute was added gets its default.
        where = f"torch.load: a pickled {type(self).__name__}"
        state = check_pickled_state(type(self), state, where)
        self.__dict__.update({**self.attr_defaults, **state})
        check_qtensor(self, where)
        # Kernels index inner tensors densely: a pickle's strides (a view's, or crafted ones
        # that overlap) are not trusted.
        for name in self.inner_names:
            setattr(self, name, getattr(self, name).contiguous())
        expected, strides = outer_layout(self.logical_shape, self.transposed)
        if tuple(self.shape) != expected or self.stride() != strides:
            raise CheckpointError(
                f"{where}: the pickled outer tensor is {list(self.shape)} with strides "
                f"{list(self.stride())}; its logical shape {list(self.logical_shape)} "
                f"(transposed={self.transposed}) makes it {list(expected)} with strides "
                f"{list(strides)}"
            )

    # ---- the device form --------------------------------------------------------------------

    @property
    def device_form(self) -> DeviceForm | None:
        if not self.device_names:
            return None
        return DeviceForm(self.device_form_tensors(), self.device_meta)

    def device_form_tensors(self) -> dict[str, torch.Tensor]:
        return {n: getattr(self, n) for n in self.device_names}

    def set_device_form(self, form: DeviceForm | None) -> None:
        for name in self.device_names:
            delattr(self, name)
        self.device_names, self.device_meta = (), ()
        if form is not None:
            for name, tensor in form.tensors.items():
                assert name not in self.inner_names and not hasattr(self, name), name
                setattr(self, name, tensor)
            self.device_names, self.device_meta = tuple(form.tensors), tuple(form.meta)

    def refresh_device_form(self) -> None:
        """Re-make the device form in place from the canonical tensors (after they changed in
        place: a copy_ into this tensor or into a part of it), so that tensors holding it, a
        compiled graph's inputs among them, see the new weights."""
        if self.device_names:
            for name, tensor in self.make_device_form().tensors.items():
                getattr(self, name).copy_(tensor)

    def repack_for_device(self) -> QTensor:
        """Make (or re-make) this weight's device form for its device and backend, in place
        (returns self). A no-op for a backend that runs on the canonical tensors, and for
        experts (the grouped kernels run on the canonical tensors); qshard calls it after
        quantizing, loading, sharding and `.to()`."""
        self.set_device_form(self.make_device_form() if self.experts is None else None)
        return self

    def _stable_hash_for_caching(self) -> str:
        """Cache key of compiled graphs (AOT autograd): the class, the flatten metadata and each
        inner tensor's metadata. Values are graph inputs, so they are not part of the key."""
        inner = [
            (name, str(t.dtype), tuple(t.shape), t.stride(), t.device.type)
            for name, t in {**self.inner_tensors(), **self.device_form_tensors()}.items()
        ]
        cls = type(self)
        payload = (cls.__module__, cls.__qualname__, tuple(self.shape), self.requires_grad)
        payload += (self.__tensor_flatten__()[1], inner)
        return hashlib.sha256(repr(payload).encode()).hexdigest()

    def attr_values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.attr_names)

    def attrs(self) -> dict[str, Any]:
        """{attribute name: value}, as the constructor and `inner_specs` take them."""
        return dict(zip(self.attr_names, self.attr_values(), strict=True))

    def inner_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.inner_names}

    def with_changes(
        self,
        inner: Mapping[str, torch.Tensor] | None = None,
        *,
        shape: tuple[int, int] | None = None,
        dtype: torch.dtype | None = None,
        transposed: bool | None = None,
        fresh: bool = False,
        **attrs: Any,
    ) -> QTensor:
        """A tensor of this class with some inner tensors or attributes replaced.

        `fresh=True` when the inner tensors are new storage (clone, to, cat): the result is not
        a view, so it does not inherit `write_barrier`.
        """
        new_inner = {**self.inner_tensors(), **(inner or {})}
        new_attrs = {**self.attrs(), **attrs}
        out = type(self)(
            new_inner,
            shape=self.logical_shape if shape is None else shape,
            dtype=self.dtype if dtype is None else dtype,
            transposed=self.transposed if transposed is None else transposed,
            **new_attrs,
        )
        if not fresh:
            out.write_barrier = self.write_barrier
            out.form_owner = self.form_owner
            if self.cut_dims:
                out.cut_dims = self.cut_dims
            if self.expert_view:
                out.expert_view = True
        same_weight = inner is None and shape is None and not attrs
        if same_weight and (dtype is None or dtype == self.dtype):
            # The same packed weight (t, view): a device form may depend on the dtype (gemlite).
            out.set_device_form(self.device_form)
        return out

    def map_inner(
        self,
        fn: Callable[[torch.Tensor], torch.Tensor],
        fresh: bool = False,
        keep_device_form: bool = False,
        **changes: Any,
    ) -> QTensor:
        """`fn` applied to every inner tensor, and to the device form's when `keep_device_form`
        (fn keeps the device: detach, clone); otherwise the result has no device form."""
        inner = {n: fn(t) for n, t in self.inner_tensors().items()}
        out = self.with_changes(inner, fresh=fresh, **changes)
        if keep_device_form and self.device_names:
            out.set_device_form(self.device_form.map(fn))
        return out

    def logical_dim(self, dim: int) -> int:
        """The logical dim (an index of `logical_shape`) that outer `dim` indexes."""
        ndim = len(self.logical_shape)
        if not isinstance(dim, int) or isinstance(dim, bool) or not -ndim <= dim < ndim:
            kind = "experts weight" if self.lead else "weight"
            raise InvalidDimError(
                f"{type(self).__name__} is a {ndim}-D {kind}: dim {dim!r} is out of range; use "
                f"{list(range(-ndim, ndim))}"
            )
        dim %= ndim
        if self.transposed and dim >= self.lead:  # the last two outer dims are [K, N]
            return 2 * self.lead + 1 - dim
        return dim

    def layout_difference(self, other: QTensor) -> str | None:
        """What keeps `other` from sharing this tensor's layout (copy_, cat), or None."""
        if type(other) is not type(self):
            return f"class {type(self).__name__} vs {type(other).__name__}"
        pairs = [
            ("dtype", self.dtype, other.dtype),
            ("transposed", self.transposed, other.transposed),
        ]
        pairs += zip(self.attr_names, self.attr_values(), other.attr_values(), strict=True)
        pairs = [(name, *values) for name, *values in pairs if name not in self.storage_attrs]
        for name, mine, theirs in pairs:
            if mine != theirs:
                return f"{name} {_short(mine)} vs {_short(theirs)}"
        return None

    def inner_step(self, name: str, dim: int) -> int | None:
        """How much of logical `dim` one element of inner tensor `name` covers along the same
        dim of that tensor, or None when the tensor is shared by every part cut along `dim` (a
        whole-tensor value, or a WHOLE side). Every inner tensor holds one expert per index."""
        if dim < self.lead:
            return 1
        packing = self.packing()[name]
        return None if spans_dim(packing, dim - self.lead) else packing[dim - self.lead]

    def slice_granularity(self, dim: int) -> int:
        """The smallest step of logical `dim` at which every inner tensor can be cut."""
        steps = [self.inner_step(name, dim) for name in self.inner_names]
        steps = [s for s in steps if s is not None]
        return math.lcm(*steps) if steps else 1

    def misaligned_offsets(self, dim: int, offsets: Iterable[int]) -> list[int]:
        """The offsets of logical `dim` that do not fall on a packing boundary (0 and the size
        always do)."""
        size, step = self.logical_shape[dim], self.slice_granularity(dim)
        return sorted({o for o in offsets if o % step and o != size})

    def realign(self, dim: int, offsets: Iterable[int]) -> QTensor:
        """This weight, re-packed if needed so that cutting logical `dim` at every offset in
        `offsets` keeps whole packed elements and blocks; raises MisalignedSliceError if the
        layout cannot. Tensor parallelism calls it once with every shard boundary, so that all
        ranks get the same packing.

        Offsets may lie outside [0, size]: on a part of a larger weight that starts and ends on
        packing boundaries, `realign` with the larger weight's cuts (relative to the part) packs
        the part exactly as it packs the whole (a sharded load reads only a rank's blocks)."""
        misaligned = self.misaligned_offsets(dim, offsets)
        if not misaligned:
            return self
        assert dim >= self.lead, "experts are cut anywhere"
        return self._realign_misaligned(dim - self.lead, misaligned)

    def slice_logical(self, dim: int, start: int, end: int) -> QTensor:
        """Indices [start, end) of logical `dim` (experts, rows or columns), as views."""
        size = self.logical_shape[dim]
        assert 0 <= start <= end <= size, (dim, start, end, size)
        if start < end and self.misaligned_offsets(dim, (start, end)):
            realigned = self.realign(dim, (start, end))
            assert not realigned.misaligned_offsets(dim, (start, end)), type(self).__name__
            return realigned.slice_logical(dim, start, end)
        inner = {}
        for name, tensor in self.inner_tensors().items():
            step = self.inner_step(name, dim)
            if step is None:
                inner[name] = tensor
                continue
            first = start // step
            stop = first if start == end else -(-end // step)
            inner[name] = tensor.narrow(dim, first, stop - first)
        shape = list(self.logical_shape)
        shape[dim] = end - start
        out = self.with_changes(inner, shape=tuple(shape))
        if self.device_names:
            out.form_owner = self
        if dim >= self.lead and (start, end) != (0, size):
            out.cut_dims = self.cut_dims | {dim - self.lead}
        return out

    def _dim_text(self, dim: int) -> str:
        """Matrix `dim` (0 = N, 1 = K) in words."""
        kind = "rows (N)" if dim == 0 else "columns (K)"
        weight = "experts weight" if self.lead else "weight"
        return f"the {kind} of a {list(self.logical_shape)} {weight}"

    def _packing_text(self) -> str:
        parts = []
        for name, p in self.packing().items():
            sides = ["all" if side == WHOLE else str(side) for side in p or ()]
            parts.append(f"{name}: whole tensor" if p is None else f"{name}: {'x'.join(sides)}")
        return "(" + ", ".join(parts) + ")"

    def validate(self) -> None:
        """Check every inner tensor against `inner_specs`; raise LayoutMismatchError if off."""
        attrs = self.attrs()
        for name, (shape, dtype) in self.inner_specs(self.logical_shape, attrs).items():
            tensor = getattr(self, name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise LayoutMismatchError(
                    f"{type(self).__name__} {self.logical_shape}: inner tensor {name!r} is "
                    f"{tensor.dtype}{list(tensor.shape)}, expected {dtype}{list(shape)}"
                )

    def __repr__(self) -> str:
        values = zip(self.attr_names, self.attr_values(), strict=True)
        attrs = ", ".join(f"{n}={_short(v)}" for n, v in values)
        inner = ", ".join(
            f"{n}={str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
            for n, t in self.inner_tensors().items()
        )
        flag = ", transposed=True" if self.transposed else ""
        return (
            f"{type(self).__name__}(shape={list(self.shape)}, dtype={self.dtype}{flag}, "
            f"{attrs}, {inner}, device={self.device})"
        )

    __str__ = __repr__


def outer_layout(shape: tuple[int, ...], transposed: bool) -> tuple[tuple, tuple]:
    """(outer shape, outer strides) of a QTensor of logical [N, K] or [E, N, K]: [..., K, N]
    viewed from [..., N, K] storage when transposed."""
    *lead, n, k = shape
    lead_strides = (n * k,) if lead else ()
    if transposed:
        return (*lead, k, n), (*lead_strides, 1, k)
    return (*lead, n, k), (*lead_strides, k, 1)


def _expert_kwargs(kwargs: Mapping[str, Any], e: int) -> dict[str, Any]:
    """Expert e's share of `from_float`'s keyword arguments: tensors (and dicts of tensors)
    carry one value per expert along dim 0; anything else is shared."""

    def pick(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value[e]
        if isinstance(value, dict):
            return {k: pick(v) for k, v in value.items()}
        return value

    return {name: pick(value) for name, value in kwargs.items()}


def stored_nbytes(t: torch.Tensor) -> int:
    """Bytes `t` stores: a QTensor's canonical inner tensors (not its device form), or the
    tensor's own."""
    if isinstance(t, QTensor):
        return sum(stored_nbytes(inner) for inner in t.inner_tensors().values())
    return t.numel() * t.element_size()


def _register(table: dict[Any, Handler], ops: Any) -> Callable[[Handler], Handler]:
    ops = list(ops) if isinstance(ops, list | tuple) else [ops]

    def decorator(handler: Handler) -> Handler:
        for op in ops:
            table[op] = handler
        return handler

    return decorator


def _short(value: Any) -> str:
    return repr(value.value) if hasattr(value, "value") else repr(value)


def _source_file(cls: type) -> str:
    module = cls.__module__.replace(".", "/")
    return f"{module}.py"


# What a model's forward does to a weight Parameter (QTensor.__torch_function__): views of it,
# and the matmuls that take it as it is (transformers' experts).
_USES_OF_WEIGHTS = frozenset(
    {
        torch.Tensor.t,
        torch.Tensor.transpose,
        torch.Tensor.__getitem__,
        torch.Tensor.view,
        torch.Tensor.permute,
        torch.Tensor.unbind,
        torch.Tensor.select,
        torch.Tensor.narrow,
        torch.t,
        torch.transpose,
        torch.permute,
        torch.unbind,
        torch.select,
        torch.narrow,
        torch.Tensor.T.__get__,
        torch.Tensor.mT.__get__,
        torch.Tensor.H.__get__,
        torch.Tensor.mH.__get__,
        torch.Tensor.swapaxes,
        torch.Tensor.swapdims,
        torch.swapaxes,
        torch.swapdims,
        torch.Tensor.movedim,
        torch.movedim,
        torch.adjoint,
        torch.Tensor.adjoint,
        torch._grouped_mm,
        torch.bmm,
        torch.matmul,
        torch.mm,
        torch.Tensor.__matmul__,
        torch.Tensor.__rmatmul__,
        torch.Tensor.matmul,
        torch.Tensor.mm,
        torch.Tensor.bmm,
        *([torch.nn.functional.grouped_mm] if hasattr(torch.nn.functional, "grouped_mm") else []),
    }
)


def is_frozen_parameter(t: Any) -> bool:
    return isinstance(t, torch.nn.Parameter) and isinstance(t, QTensor) and not t.requires_grad
