"""Int4 weight-only layout (W4A16): 4-bit weights in groups along K, bf16 scales and zeros.

Inner tensors (logical weight [N, K], G = ceil(K / group_size)):
    qdata  uint8 [N, ceil(K/2)]   two 4-bit codes u per byte along K, the even index in the low
                                  nibble; W[n, k] = (u[n, k] - zero[n, k // g]) * scale[n, k // g]
    scale  bfloat16 [N, G]        one multiplier per row per group (the last group may be partial)
    zero   bfloat16 [N, G]        the code of 0.0 per row per group (asymmetric), or with a float
                                  zero point the value of code 8; an empty [0, 0] tensor when
                                  symmetric (every zero is 8: u = q + 8, q in -8..7)
Attributes:
    group_size  channels per group along K: 32, 64, 128 or 256 (finer after re-grouping)
    symmetric   False: W = (u - zero) * scale, u in 0..15; True: scale only
    zero_point_domain  INT (above) or FLOAT: W = (u - 8) * scale + zero, zero a float (torchao's
                Int4Tensor, HQQ, tinygemm's own convention); asymmetric only
    backend     AUTO (the Triton kernels on a CUDA GPU, dequantize + BLAS elsewhere), REFERENCE,
                TRITON (forced; BackendUnavailableError where it cannot run), TINYGEMM (torch's
                int4 kernels, CPU and CUDA) or GEMLITE (CUDA, gemlite installed)
    activations NONE (weight-only, W4A16) or W4A8 (opt-in): FP8_GROUP quantizes the activations
                to e4m3 per token per K block of min(group, 128), FP8_TOKEN per token, and the
                matmul runs on FP8 tensor cores (kernels/w4a8.py; integer zero points only)
    code_order  CANONICAL (above) or NATIVE: each 128-column chunk's codes permuted as
                `kernels/packing.native_codes` does, the order the Hopper register kernels
                read (the word GEMV, the wgmma kernel; docs/kernels/w4a16_register.md, "The
                native code order (int4 with groups of 128 on Hopper)")
Device form (TINYGEMM, GEMLITE; see qtensor/base.py): the kernel's own arrangement, made from the
canonical tensors by `repack_for_device()` (kernels/int4_tinygemm.py, kernels/int4_gemlite.py).
The canonical tensors stay: they are what is sliced and saved (the weight takes its memory twice).
Native code order (`repack_for_device()` on a Hopper GPU, `native_order_problem`): the weight
holds only the permuted codes, no second copy; the same values, so slices at multiples of 128
columns and any rows stay native; any other cut, a finer re-grouping, a cat of mixed orders, a
checkpoint, a pickle, a gather and every export see the canonical codes (`canonical()`).

Packing for the shape ops: qdata (1, 2), scale and zero (1, group_size). Rows slice anywhere;
columns at group boundaries. A cut at a multiple of a finer power-of-two group (>= 16) re-groups
exactly: each (scale, zero) is repeated over the finer groups it covers, so `dequantize()` is
unchanged (as FP8 re-blocks; a TP shard of 64 columns of 128-groups).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import warnings
from typing import ClassVar

import torch

from ..config import Backend, QuantConfig, as_int, parse_backend, parse_enum
from ..errors import BackendUnavailableError, ConfigError, MisalignedSliceError
from ..kernels.availability import native_int4_problem, triton_unavailable_reason
from ..kernels.int4 import SCALE_DTYPE, dequantize_int4, int4_linear_reference, quantize_int4
from ..kernels.int4_gemlite import gemlite_form, gemlite_linear, gemlite_problem
from ..kernels.int4_tinygemm import (
    TINYGEMM_GROUPS,
    tinygemm_form,
    tinygemm_linear,
    tinygemm_problem,
)
from ..kernels.loader import load_w4a8_ops, load_w4a16_ops
from ..kernels.packing import NATIVE_CHUNK, canonical_codes, linear_in_dtype, native_codes
from ..kernels.w4a8 import (
    ActivationQuant,
    kernel_problem,
    w4a8_linear_dequantized,
    w4a8_linear_reference,
)
from ..qtensor import DeviceForm, QTensor
from ..qtensor.registry import register_layout
from .checks import (
    abs_max,
    check_activation,
    check_float_weight,
    checked_config,
    quantized,
    rows_max,
    weight_only_backend,
    weight_only_grouped_linear,
)

__all__ = [
    "INT4_MIN_SQNR_DB",
    "ActivationQuant",
    "CodeOrder",
    "Int4Tensor",
    "Int4WeightOnlyConfig",
    "ZeroPointDomain",
]

GROUP_SIZES = (32, 64, 128, 256)
MIN_GROUP = 16  # the finest re-grouping of a TP cut
# F.linear vs float on Gaussian weights: asymmetric g128 gives ~20 dB (relative error 0.10,
# measured), finer groups more.
INT4_MIN_SQNR_DB = 17.0
AVAILABLE_BACKENDS = (
    Backend.AUTO,
    Backend.REFERENCE,
    Backend.TRITON,
    Backend.TINYGEMM,
    Backend.GEMLITE,
)
DEVICE_FORM_BACKENDS = (Backend.TINYGEMM, Backend.GEMLITE)


class ZeroPointDomain(str, enum.Enum):
    """What an asymmetric int4 zero point is (torchao's names)."""

    INT = "int"  # a code: W = (u - zero) * scale
    FLOAT = "float"  # a value: W = (u - 8) * scale + zero


@dataclasses.dataclass(frozen=True)
class Int4WeightOnlyConfig(QuantConfig):
    """4-bit weights per group of `group_size` input channels; activations stay bf16/fp16.

    `activations="fp8_group"` or `"fp8_token"` opts in to W4A8 (kernels/w4a8.py): the
    activations are quantized on the fly to FP8 e4m3, per token per K block of
    min(group_size, 128) or per token, and the matmul runs on FP8 tensor cores (sm_89+; on
    other devices the same numerics by dequantize-and-matmul). Its results differ from
    weight-only ones by the activations' rounding (e4m3 keeps 3 mantissa bits; 2.6 % relative
    L2 from W4A16 on a Gaussian 4096 x 4096 layer, whose W4A16 error is itself 10 %). Measured
    on an H200 it is the fastest 4-bit route for MoE experts at 16-128 tokens and slower than
    weight-only for 2-D weights (docs/kernels/w4a8.md). Integer zero points only, and qshard's
    kernels (backend auto, triton or reference); the GPU kernel takes groups of 64 or more
    (groups of 32 run the same numerics by dequantize-and-matmul, slow on a GPU)."""

    group_size: int = 128
    symmetric: bool = False
    backend: Backend = Backend.AUTO
    zero_point_domain: ZeroPointDomain = ZeroPointDomain.INT
    activations: ActivationQuant = ActivationQuant.NONE

    def __post_init__(self):
        name = type(self).__name__
        group = as_int(self.group_size)
        if not isinstance(group, int) or isinstance(group, bool) or group not in GROUP_SIZES:
            raise ConfigError(
                f"{name}: group_size={self.group_size!r} is not one of {list(GROUP_SIZES)} (an int)"
            )
        self._set("group_size", group)
        if not isinstance(self.symmetric, bool):
            raise ConfigError(f"{name}: symmetric={self.symmetric!r} must be True or False")
        self._set("backend", parse_backend(self.backend, AVAILABLE_BACKENDS, name))
        domain = parse_enum(ZeroPointDomain, self.zero_point_domain, "zero_point_domain", name)
        self._set("zero_point_domain", domain)
        if domain is ZeroPointDomain.FLOAT and self.symmetric:
            raise ConfigError(
                f"{name}: zero_point_domain='float' is for asymmetric weights; "
                f"use symmetric=False, or zero_point_domain='int'"
            )
        if domain is ZeroPointDomain.FLOAT and self.backend is Backend.GEMLITE:
            raise ConfigError(
                f"{name}: gemlite takes integer zero points ((u - z) * s); a float zero point "
                f"would have to be rounded into one. Use backend='auto' or 'tinygemm'"
            )
        acts = parse_enum(ActivationQuant, self.activations, "activations", name)
        self._set("activations", acts)
        if acts is not ActivationQuant.NONE:
            if domain is ZeroPointDomain.FLOAT:
                raise ConfigError(
                    f"{name}: activations={acts.value!r} (W4A8) multiplies the integer codes "
                    f"u - zero on FP8 tensor cores; a float zero point is not a code. Use "
                    f"zero_point_domain='int', or activations='none'"
                )
            if self.backend in DEVICE_FORM_BACKENDS:
                raise ConfigError(
                    f"{name}: activations={acts.value!r} (W4A8) runs qshard's kernels; backend "
                    f"{self.backend.value!r} is weight-only. Use backend='auto', or "
                    f"activations='none'"
                )


class CodeOrder(str, enum.Enum):
    """How an int4 weight's codes are ordered along K (module docstring)."""

    CANONICAL = "canonical"  # column k at nibble k % 2 of byte k // 2: checkpoints, the CPU
    NATIVE = "native"  # permuted per 128-column chunk for the Hopper register kernels


NATIVE_DTYPES = (torch.bfloat16, torch.float16)  # the wgmma kernel's activations


def _bad_zero_codes(zero: torch.Tensor) -> torch.Tensor:
    """A mask of the integer-domain zero points that are not codes 0..15."""
    zero = zero.float()
    return (zero < 0) | (zero > 15) | (zero != zero.round())


@register_layout(Int4WeightOnlyConfig, ZeroPointDomain, CodeOrder, ActivationQuant)
class Int4Tensor(QTensor):
    """A 4-bit weight with per-group bf16 scales (and zeros). See the module docstring."""

    inner_names = ("qdata", "scale", "zero")
    attr_names = (
        "group_size",
        "symmetric",
        "backend",
        "zero_point_domain",
        "code_order",
        "activations",
    )
    # Checkpoints written before the attributes existed hold integer zero points, canonical
    # codes and weight-only weights.
    attr_defaults: ClassVar[dict] = {
        "zero_point_domain": ZeroPointDomain.INT,
        "code_order": CodeOrder.CANONICAL,
        "activations": ActivationQuant.NONE,
    }
    storage_attrs = ("code_order",)
    min_linear_sqnr_db: ClassVar[float] = INT4_MIN_SQNR_DB

    qdata: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    group_size: int
    symmetric: bool
    backend: Backend
    zero_point_domain: ZeroPointDomain
    code_order: CodeOrder
    activations: ActivationQuant

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        try:  # a string names an order too; the comparisons below are of members
            self.code_order = CodeOrder(self.code_order)
        except ValueError:
            raise ConfigError(
                f"Int4Tensor: code_order {self.code_order!r} is not one of "
                f"{[o.value for o in CodeOrder]}"
            ) from None

    @classmethod
    def quantize_matrix(
        cls,
        weight: torch.Tensor,
        config: Int4WeightOnlyConfig | None = None,
        group_params: dict[str, torch.Tensor] | None = None,
    ) -> Int4Tensor:
        """Quantize `weight`; with `group_params` ({"scale", "zero"} as this layout stores them,
        e.g. chosen by `qshard.gptq_`) round with those instead of the groups' own."""
        config = checked_config(cls.__name__, Int4WeightOnlyConfig, config)
        check_float_weight(cls.__name__, weight)
        weight = weight.detach()
        float_zero = config.zero_point_domain is ZeroPointDomain.FLOAT
        params = (group_params["scale"], group_params["zero"]) if group_params else None
        qdata, scale, zero = quantize_int4(
            weight, config.group_size, config.symmetric, float_zero, params
        )
        return quantized(
            cls(
                {"qdata": qdata, "scale": scale, "zero": zero},
                shape=tuple(weight.shape),
                dtype=weight.dtype,
                group_size=config.group_size,
                symmetric=config.symmetric,
                backend=config.backend,
                zero_point_domain=config.zero_point_domain,
                activations=config.activations,
            )
        ).repack_for_device()

    @property
    def float_zero(self) -> bool:
        return self.zero_point_domain is ZeroPointDomain.FLOAT

    @property
    def w4a8(self) -> bool:
        """Whether the activations are quantized to FP8 (`ActivationQuant`)."""
        return self.activations is not ActivationQuant.NONE

    @classmethod
    def contract_configs(cls) -> list[Int4WeightOnlyConfig]:
        return [
            Int4WeightOnlyConfig(),
            Int4WeightOnlyConfig(group_size=32, symmetric=True),
            Int4WeightOnlyConfig(group_size=64),
            # The device form: every contract op on a tensor that carries one (CPU tinygemm).
            Int4WeightOnlyConfig(group_size=32, backend="tinygemm"),
            Int4WeightOnlyConfig(group_size=64, zero_point_domain="float"),
            Int4WeightOnlyConfig(group_size=64, activations="fp8_group"),
        ]

    def config(self) -> Int4WeightOnlyConfig:
        # A re-grouped tensor (finer than any config) reports the nearest config it came from.
        group = self.group_size if self.group_size in GROUP_SIZES else GROUP_SIZES[0]
        return Int4WeightOnlyConfig(
            group, self.symmetric, self.backend, self.zero_point_domain, self.activations
        )

    @classmethod
    def check_attrs(cls, attrs) -> None:
        group = attrs["group_size"]
        if not (MIN_GROUP <= group <= GROUP_SIZES[-1] and group & (group - 1) == 0):
            raise ConfigError(f"Int4Tensor: group_size {group} is not a power of two in 16..256")
        Int4WeightOnlyConfig(
            GROUP_SIZES[0],
            attrs["symmetric"],
            attrs["backend"],
            attrs["zero_point_domain"],
            attrs["activations"],
        )
        if CodeOrder(attrs["code_order"]) is not CodeOrder.CANONICAL:
            raise ConfigError(
                "Int4Tensor: code_order 'native' in outside data: checkpoints, pickles and "
                "formats hold the canonical order (qshard writes nothing else; the native "
                "order is made on a Hopper GPU by repack_for_device())"
            )

    # ---- hooks for the shared shape ops ---------------------------------------------------

    def packing(self) -> dict[str, tuple[int, int] | None]:
        group = (1, self.group_size)
        return {"qdata": (1, 2), "scale": group, "zero": None if self.symmetric else group}

    @classmethod
    def matrix_specs(cls, shape, attrs):
        (n, k), groups = shape, -(-shape[1] // attrs["group_size"])
        zero = (0, 0) if attrs["symmetric"] else (n, groups)
        return {
            "qdata": ((n, -(-k // 2)), torch.uint8),
            "scale": ((n, groups), SCALE_DTYPE),
            "zero": (zero, SCALE_DTYPE),
        }

    def _realign_misaligned(self, dim: int, offsets: list[int]) -> Int4Tensor:
        """Re-group K to the largest power-of-two group that divides every offset (native
        codes first become canonical: they are cut at multiples of 128 only)."""
        if self.code_order is CodeOrder.NATIVE:
            return self.canonical().realign(dim + self.lead, offsets)._copy_of_native()
        finer = math.gcd(self.group_size, *offsets) if dim == 1 else 0
        # tinygemm takes groups of 32 and more (kernels/int4_tinygemm.py), and so, to our
        # knowledge, does gemlite: a cut that needs finer groups is refused before any change.
        finest = MIN_GROUP if self.backend not in DEVICE_FORM_BACKENDS else TINYGEMM_GROUPS[0]
        if finer < finest:
            backend = f" for backend '{self.backend.value}'" if finest != MIN_GROUP else ""
            raise MisalignedSliceError(
                f"Int4Tensor: cutting {self._dim_text(dim)} (groups of {self.group_size}) at "
                f"offsets {offsets} falls on no group of {finest} or more{backend}; cut at "
                f"multiples of {self.group_size}, or of a power of two >= {finest} dividing it"
            )
        return self.regroup(finer)

    def regroup(self, group_size: int) -> Int4Tensor:
        """The same weight with finer groups; each scale and zero is repeated, exactly."""
        if group_size % NATIVE_CHUNK and self.code_order is CodeOrder.NATIVE:
            return self.canonical()._regroup(group_size)._copy_of_native()
        return self._regroup(group_size)

    def _copy_of_native(self) -> Int4Tensor:
        """Marks a canonical copy made of native codes (a cut off the chunks): a copy_ into it
        would not reach the weight it came from."""
        self.write_barrier = (
            "it is a canonical copy of a native-order weight's codes (cut off its 128-column "
            "chunks), so a copy would not reach that weight; copy into the original at "
            "multiples of 128 columns, or clone() this one first"
        )
        return self

    def _regroup(self, group_size: int) -> Int4Tensor:
        repeat, k = self.group_size // group_size, self.logical_shape[-1]
        groups = -(-k // group_size)

        def finer(t: torch.Tensor) -> torch.Tensor:
            # (a symmetric weight's zero is [0, 0]; a weight of no rows has [0, G] scales)
            return t.repeat_interleave(repeat, -1)[..., :groups] if t.shape[-1] else t

        out = self.with_changes(
            {"scale": finer(self.scale), "zero": finer(self.zero)}, group_size=group_size
        )
        out.write_barrier = (
            f"it shares its 4-bit data with a tensor of {self.group_size}-groups but has its own "
            f"re-grouped {group_size}-group scales, so a copy would update only the data; copy "
            f"into the original at multiples of its groups, or clone() this one first"
        )
        return out

    def matrix_max_magnitude(self) -> float:
        if self.symmetric:  # codes q = u - 8 in -8..7
            return 8.0 * abs_max(self.scale)
        return rows_max(self._group_ends, self.scale, self.zero)

    def _group_ends(self, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        """The largest |W| each group's (scale, zero) can dequantize, over codes 0..15."""
        scale, zero = scale.double().abs(), zero.double()
        if self.float_zero:  # (u - 8) * scale + zero: the ends of the range
            return torch.maximum((zero - 8.0 * scale).abs(), (zero + 7.0 * scale).abs())
        return torch.maximum(zero.abs(), (15.0 - zero).abs()) * scale  # (u - zero) * scale

    def matrix_value_problem(self) -> str | None:
        if self.symmetric or self.float_zero or not self.zero.numel():
            return None
        count = rows_max(lambda z: _bad_zero_codes(z).sum().reshape(1), self.zero)
        if count:
            first = [int(i) for i in _bad_zero_codes(self.zero).nonzero()[0]]
            return (
                f"some zero points are not integer codes in 0..15 (first at {first}: "
                f"{float(self.zero[tuple(first)])}); integer zero points "
                f"(zero_point_domain='int') are codes of the 4-bit range"
            )
        return None

    def dequantize_matrix(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        weight = dequantize_int4(
            self.canonical().qdata,
            self.scale,
            self.zero,
            self.group_size,
            self.logical_shape[-1],
            dtype or self.dtype,
            self.float_zero,
        )
        return weight.t() if self.transposed else weight

    # ---- the code order ---------------------------------------------------------------------

    def native_order_problem(self) -> str | None:
        """Why this weight does not hold its codes in the native order where it is, or None:
        a weight (not experts: the grouped kernels read the canonical order) run by qshard's
        kernels (backend auto or triton) in bf16 / fp16, K and the groups whole 128-column
        chunks, on a Hopper GPU (`native_int4_problem`)."""
        if self.experts is not None:
            return "experts: the grouped kernels read the canonical order"
        if self.w4a8:
            return "W4A8 (FP8 activations): its kernel reads the canonical order"
        if self.backend not in (Backend.AUTO, Backend.TRITON):
            return f"backend '{self.backend.value}' reads the canonical order"
        if self.dtype not in NATIVE_DTYPES:
            return f"the kernels that read it take bf16 / fp16 activations, not {self.dtype}"
        if self.logical_shape[-1] % NATIVE_CHUNK or self.group_size % NATIVE_CHUNK:
            return (
                f"it permutes whole {NATIVE_CHUNK}-column chunks within groups: K = "
                f"{self.logical_shape[-1]}, groups of {self.group_size}"
            )
        return native_int4_problem(self.device)

    def with_code_order(self, order: CodeOrder) -> Int4Tensor:
        """The same weight with its codes in `order` (a new tensor; self where they are)."""
        order = CodeOrder(order)
        if order is self.code_order:
            return self
        k = self.logical_shape[-1]
        if order is CodeOrder.NATIVE and (self.group_size % NATIVE_CHUNK or k % NATIVE_CHUNK):
            raise ConfigError(
                f"Int4Tensor {list(self.logical_shape)}: the native code order permutes whole "
                f"{NATIVE_CHUNK}-column chunks within groups; K = {k} with groups of "
                f"{self.group_size} are not (quantize with group_size 128 or 256 and K a "
                f"multiple of 128, or keep code_order 'canonical')"
            )
        convert = native_codes if order is CodeOrder.NATIVE else canonical_codes
        return self.with_changes({"qdata": convert(self.qdata)}, code_order=order, fresh=True)

    def canonical(self) -> Int4Tensor:
        return self.with_code_order(CodeOrder.CANONICAL)

    def stored_as(self, other: Int4Tensor) -> Int4Tensor:
        return self.with_code_order(other.code_order)

    def repack_for_device(self) -> Int4Tensor:
        """Also puts the codes in the order this weight's kernels read here, native where
        `native_order_problem` is None, else canonical: in place (this tensor, a model's
        Parameter, holds the converted codes) for a tensor that owns its inner tensors; a view
        of part of another weight (a slice, an expert) keeps its order, since its scales stay
        the other weight's (a copy_ into it must reach both)."""
        order = CodeOrder.CANONICAL if self.native_order_problem() else CodeOrder.NATIVE
        owns = not (self.cut_dims or self.expert_view or self.write_barrier)
        if order is not self.code_order and owns:
            self.qdata, self.code_order = self.with_code_order(order).qdata, order
        return super().repack_for_device()

    def slice_granularity(self, dim: int) -> int:
        step = super().slice_granularity(dim)
        if self.code_order is CodeOrder.NATIVE and dim == self.lead + 1:
            return math.lcm(step, NATIVE_CHUNK)  # the permutation stays within a chunk
        return step

    # ---- the device form (tinygemm, gemlite) ------------------------------------------------

    def device_form_problem(self, device: torch.device, x_dtype=None) -> str | None:
        """Why this weight's backend cannot run on `device` with `x_dtype` inputs, or None."""
        if self.backend is Backend.TINYGEMM:
            return tinygemm_problem(device, self.group_size, x_dtype)
        if self.backend is Backend.GEMLITE:
            return gemlite_problem(device, self.dtype, x_dtype)
        return None

    def make_device_form(self) -> DeviceForm | None:
        if self.backend not in DEVICE_FORM_BACKENDS or self.device_form_problem(self.device):
            return None
        qdata = self.canonical().qdata
        args = (qdata, self.scale, self.zero, self.group_size, self.logical_shape[-1])
        if self.backend is Backend.TINYGEMM:
            return DeviceForm(*tinygemm_form(*args, self.dtype, self.float_zero))
        return DeviceForm(*gemlite_form(*args, self.dtype))

    def _device_form_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        problem = self.device_form_problem(x.device, x.dtype)
        if problem:
            raise BackendUnavailableError(
                f"Int4Tensor {list(self.logical_shape)}: backend '{self.backend.value}' cannot "
                f"run here: {problem}; use backend='auto' (qshard's kernels) or 'reference'"
            )
        form = self.device_form
        if form is None:
            # A slice, a shard made outside qshard.tp, or a torch.load'ed tensor: made per
            # call, which is correct but repacks the whole weight every time.
            warnings.warn(
                f"Int4Tensor {list(self.logical_shape)} (backend '{self.backend.value}') has no "
                f"device form and repacks it on every call; call qshard.repack_for_device(model)"
                f" after loading or sharding it",
                stacklevel=2,
            )
            form = self.make_device_form()
        linear = tinygemm_linear if self.backend is Backend.TINYGEMM else gemlite_linear
        return linear(x, form.tensors, form.meta, bias)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        check_activation(self, x)
        if self.w4a8:
            return self._w4a8_linear(x, bias)
        if self.backend in DEVICE_FORM_BACKENDS:
            return self._device_form_linear(x, bias)
        if self.select_backend(x) is Backend.TRITON:
            load_w4a16_ops()
            native = self.code_order is CodeOrder.NATIVE
            return torch.ops.qshard.int4_linear(
                x,
                self.qdata,
                self.scale,
                self.zero,
                bias,
                self.group_size,
                self.float_zero,
                native,
            )
        qdata = self.canonical().qdata
        if self.backend is Backend.REFERENCE:
            return int4_linear_reference(
                x, qdata, self.scale, self.zero, self.group_size, bias, self.float_zero
            )
        # auto where no qshard kernel runs (the CPU): the reference's weight, the BLAS's sums.
        k = self.logical_shape[-1]
        weight = dequantize_int4(
            qdata, self.scale, self.zero, self.group_size, k, x.dtype, self.float_zero
        )
        return linear_in_dtype(x, weight, bias)

    # ---- W4A8 (FP8 activations) --------------------------------------------------------------

    def w4a8_backend(self, x: torch.Tensor) -> Backend:
        """TRITON where the W4A8 kernel runs for input x (a CUDA GPU of sm_89+, groups making
        K blocks of 64+), else REFERENCE (for `auto`, the dequantize-and-matmul route);
        BackendUnavailableError for backend 'triton' where it cannot run."""
        if self.backend is Backend.REFERENCE:
            return Backend.REFERENCE
        reason = triton_unavailable_reason(x.device, fp8=True) or kernel_problem(self.group_size)
        if self.backend is Backend.TRITON and reason:
            raise BackendUnavailableError(
                f"Int4Tensor {list(self.logical_shape)} (activations "
                f"'{self.activations.value}'): backend 'triton' cannot run here: {reason}; use "
                f"backend='auto' or 'reference'"
            )
        on_gpu = x.device.type == "cuda" or self.backend is Backend.TRITON
        return Backend.TRITON if on_gpu and reason is None else Backend.REFERENCE

    def _w4a8_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        args = (self.scale, self.zero, self.group_size, self.activations)
        if self.w4a8_backend(x) is Backend.TRITON:
            load_w4a8_ops()
            return torch.ops.qshard.int4_w4a8_linear(
                x, self.qdata, self.scale, self.zero, bias, self.group_size, self.activations.value
            )
        qdata = self.canonical().qdata
        if self.backend is Backend.REFERENCE:
            return w4a8_linear_reference(x, qdata, *args, bias)
        return w4a8_linear_dequantized(x, qdata, *args, bias)

    def _w4a8_grouped_linear(self, x, offs, bias):
        check_activation(self, x)
        if self.w4a8_backend(x) is not Backend.TRITON:
            return QTensor.grouped_linear(self, x, offs, bias)
        load_w4a8_ops()
        return torch.ops.qshard.int4_w4a8_grouped_linear(
            x,
            offs,
            self.qdata,
            self.scale,
            self.zero,
            bias,
            self.group_size,
            self.activations.value,
        )

    def grouped_linear(self, x, offs, bias=None):
        if self.w4a8:
            return self._w4a8_grouped_linear(x, offs, bias)
        if self.backend in DEVICE_FORM_BACKENDS:
            raise BackendUnavailableError(
                f"Int4Tensor experts: backend '{self.backend.value}' has no grouped matmul; "
                f"quantize experts with backend='auto' (qshard's grouped kernel) or 'reference'"
            )
        fmt = "int4_fzero" if self.float_zero else "int4_sym" if self.symmetric else "int4_asym"
        weight = self.canonical()  # (experts are never native: `native_order_problem`)
        return weight_only_grouped_linear(
            weight, x, offs, bias, fmt, self.group_size, zero=self.zero
        )

    def select_backend(self, x: torch.Tensor) -> Backend:
        return weight_only_backend(self, x)
