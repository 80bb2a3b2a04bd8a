"""compressed-tensors checkpoints (llm-compressor; docs/design.md, "Formats") <-> Int4Tensor /
Nvfp4Tensor / Mxfp4Tensor / Fp8RowwiseTensor / Fp8BlockwiseTensor.

config.json `quantization_config`: quant_method "compressed-tensors", `config_groups` ({name:
{targets, weights, input_activations, format}}), the model's `format` (one format, or
"mixed-precision" when each group names its own), `ignore`. A quantized linear's scheme is the
first config group that targets it (by module name, "re:" regex, or "Linear") and whose format
stores the tensors it has, as compressed-tensors' own model-free dequantizer picks it
(entrypoints/convert/converters/ct_dequantizer.py); a group without a format gets the one
compressed-tensors infers from its args (compressors/format.py, `_inferred_format` here). Read
against compressed-tensors 0.20.0. Per quantized linear `<p>`, by format:

pack-quantized int4 (num_bits 4, type int, strategy group; W4A16): `weight_packed` int32
[N, ceil(K/8)], each value q in -8..7 stored as q + 8, element i of a word at bits 4i (LSB
first); `weight_scale` [N, G]; `weight_shape` int64 [2]; asymmetric: `weight_zero_point` int32
[ceil(N/8), G], zero points z in -8..7 stored the same way but packed along the *output* dim.
W = (q - z) * scale = (u - (z + 8)) * scale with u = q + 8: the int4 layout with code u and
zero code z + 8 (symmetric: zero code 8). On a little-endian machine the int32 words are the
layout's bytes (two codes per byte, the even index low), so the data maps as it is. The
layout keeps bf16 scales: fp16 scales load when each is exactly a bf16 value, else
CheckpointError (converting would re-quantize). compressed-tensors' group dequantization
refuses a K that is not a multiple of the group (forward_helpers._process_group), so export
refuses it too; load takes a partial last group (older writers).

nvfp4-pack-quantized (NVFP4A16; NVFP4 with activations): `weight_packed` uint8 [N, K/2] (the
NVFP4 layout's bytes), `weight_scale` float8_e4m3fn [N, K/16], `weight_global_scale` float32
[1], a *divisor*: W = e2m1 * (weight_scale / weight_global_scale). The layout's global scale is
a multiplier, 1 / weight_global_scale rounded to fp32, so its dequantized values are within one
fp32 ulp of the format's. x -> 1/x is not injective on fp32, so the divisor cannot be recovered
from the multiplier: the layout keeps it (Nvfp4Tensor.global_divisor, saved by qshard.save), and
export writes it back, so that load -> export gives the file's bytes. A weight without one
(quantized by qshard, or from another format) gets the fp32 neighbour of 1 / multiplier whose
reciprocal is nearest the multiplier: exactly it for about 83 % of fp32 values, else one ulp off.

int-quantized int4 (num_bits 4, type int; the W4A8 and W4AFP8 presets, or W4A16 saved
int-quantized): `weight` int8 [N, K], one value q in -8..7 per weight (compressors/
naive_quantized: quantize() cast to int8, no packing); `weight_scale` [N, G] (strategy group)
or [N, 1] (channel); asymmetric: `weight_zero_point` int8 (zp_dtype) of the scale's shape, z in
-8..7. Dequantization (forward_helpers._dequantize) is (q - z) * scale in the scale's dtype: the
int4 layout with codes u = q + 8 packed two per byte and zero code z + 8, as pack-quantized. A
per-channel scale is one group of K; the layout's groups are at most 256, so it is repeated
over ceil(K/g) groups of g, the largest of 32..256 dividing K (else 256, the last partial):
every group of a row has the same scale, the same weights. Values outside -8..7 are refused.

mxfp4-pack-quantized (MXFP4A16; MXFP4 with activations): `weight_packed` uint8 [N, K/2] (the
MXFP4 layout's bytes), `weight_scale` uint8 [N, K/32], e8m0 exponents: 2**(s - 127)
(compressors/mx_utils.py): the layout's scale bytes. Both map as they are.

float-quantized / naive-quantized FP8 (num_bits 8, type float; llm-compressor's FP8 and
FP8-Dynamic schemes): `weight` float8_e4m3fn [N, K] and `weight_scale` (fp32, bf16 or fp16, a
multiplier: W = weight * weight_scale): strategy "channel" [N, 1] -> Fp8RowwiseTensor; "tensor"
(one value) -> Fp8RowwiseTensor with that scale on every row; "block" [ceil(N/bn), ceil(K/bk)]
with the group's `block_structure` [bn, bk] -> Fp8BlockwiseTensor.

Activations: none -> weight-only. Float activation quantization is replaced by finer: FP8
dynamic (per token, or per group for blocks) -> qshard's dynamic activation quantization; FP8
static (an `input_scale` per tensor) -> dynamic per token (the input_scale is dropped); NVFP4 or
MXFP4 activations (W4A4; `input_global_scale` dropped) -> weight-only, activations in bf16/fp16.
int activation quantization with int4 weights (W4A8: int8 per token) -> weight-only W4A16, the
activations in bf16/fp16 (finer than int8; a static `input_scale` / `input_zero_point` is
dropped). Refused, naming the scheme (CheckpointError): int weights of other than 4 bits (W8A8,
W8A16: qshard has no int8 layout) or not per channel or in groups of 32..256 (pack-quantized:
groups only), int activations with float weights, MXFP6/MXFP8, the sparse formats, act-order
(`weight_g_idx`).
Export writes int4, NVFP4, MXFP4, and FP8 per channel or in blocks with dynamic activations.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys

import torch

from ..config import Backend, ScaleFormat
from ..errors import CheckpointError, QShardError
from ..kernels.packing import pack_nibbles, unpack_nibbles
from ..layouts import Fp8BlockwiseTensor, Fp8RowwiseTensor, Int4Tensor, Mxfp4Tensor, Nvfp4Tensor
from ..layouts.int4 import GROUP_SIZES
from ..qtensor import QTensor
from .configs import (
    MAX_SIZE,
    Fields,
    check_scalar,
    check_stored,
    quantization_config,
    unquantized_modules,
)
from .source import exact_bf16, fp8_block_attrs, fp8_rows

NAME = "compressed-tensors"
INT4_FORMAT, NVFP4_FORMAT = "pack-quantized", "nvfp4-pack-quantized"
MXFP4_FORMAT, FP8_FORMAT, NAIVE_FORMAT = (
    "mxfp4-pack-quantized",
    "float-quantized",
    "naive-quantized",
)
INT_FORMAT, MIXED = "int-quantized", "mixed-precision"
# Formats whose first tensor is `weight_packed` (the others store `weight` and `weight_scale`).
PACKED_FORMATS = (INT4_FORMAT, NVFP4_FORMAT, MXFP4_FORMAT, "mxfp6-pack-quantized")
NVFP4_GROUP, MX_GROUP = 16, 32
STRATEGIES = ("tensor", "channel", "group", "tensor_group", "block", "token", "attn_head")
SCALES = (torch.bfloat16, torch.float16, torch.float32)  # float scales as writers store them
INTS = (torch.int8, torch.int16, torch.int32, torch.int64)  # zp_dtype (int8 unless set)
INT4_RANGE = (-8, 7)  # the values of a 4-bit int (compressed-tensors' calculate_range)
# The tensors of one linear each format stores (compression_param_names in compressed-tensors'
# compressors); the input scales are dropped (activations run finer, the module docstring).
TENSORS = {
    INT4_FORMAT: ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point"),
    NVFP4_FORMAT: ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"),
    MXFP4_FORMAT: ("weight_packed", "weight_scale", "input_global_scale"),
    FP8_FORMAT: ("weight", "weight_scale", "input_scale"),
    NAIVE_FORMAT: ("weight", "weight_scale"),
    INT_FORMAT: ("weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point"),
}


def detect(config: dict, hf_quant: dict | None) -> bool:
    qc = quantization_config(config)
    return qc is not None and qc.raw("quant_method") == "compressed-tensors"


# ---- the config: one Scheme per config group --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Args:
    """A group's `weights` or `input_activations` (compressed-tensors' QuantizationArgs)."""

    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool
    strategy: str
    group_size: int | None
    block_structure: tuple[int, int] | None
    scale_dtype: str | None

    def describe(self) -> str:
        """E.g. "4-bit int in groups of 128"."""
        how = {
            "group": f" in groups of {self.group_size}",
            "tensor_group": f" in groups of {self.group_size} with a global scale",
            "block": " in {}x{} blocks".format(*(self.block_structure or (0, 0))),
        }.get(self.strategy, f" per {self.strategy.replace('attn_head', 'attention head')}")
        return f"{self.num_bits}-bit {self.type}{how}"


def _args(fields: Fields) -> Args:
    """QuantizationArgs read as compressed-tensors reads them (quant_args.py): enums in any
    case, the strategy inferred from group_size when absent (None: tensor, -1: channel, > 0:
    group)."""
    group = fields.get("group_size", int, None)
    if group is not None and group != -1 and not 1 <= group <= MAX_SIZE:
        rule = f"it must be -1 (per channel) or an integer in 1..{MAX_SIZE} (values along K)"
        raise fields.error("group_size", group, rule)
    inferred = "tensor" if group is None else "channel" if group == -1 else "group"
    strategy = fields.choice("strategy", STRATEGIES, inferred, casefold=True)
    if strategy in ("group", "tensor_group") and (group is None or group < 1):
        raise fields.error(
            "group_size", group, f"strategy {strategy!r} needs a positive group size"
        )
    block = fields.sizes("block_structure", 2, None)
    if strategy == "block" and block is None:
        raise fields.error("block_structure", None, "strategy 'block' needs [rows, cols]")
    dynamic = fields.raw("dynamic", False)
    if not isinstance(dynamic, bool) and not (
        isinstance(dynamic, str) and dynamic.lower() == "local"
    ):
        raise fields.error("dynamic", dynamic, 'it must be true, false or "local"')
    return Args(
        num_bits=fields.size("num_bits", 8, maximum=64),
        type=fields.choice("type", ("int", "float"), "int", casefold=True),
        symmetric=fields.get("symmetric", bool, True),
        strategy=strategy,
        group_size=group,
        block_structure=block,
        scale_dtype=(fields.get("scale_dtype", str, None) or "").removeprefix("torch.") or None,
    )


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One config group: its name, format, targets, weights' and input activations' args."""

    name: str
    format: str
    targets: tuple[str, ...]
    weights: Args
    inputs: Args | None

    def targets_module(self, module: str) -> bool:
        """compressed-tensors' model-free matching (utils/match.py: match_quantizable_tensors):
        no targets or "Linear" targets every module; "re:" targets are regexes (re.match);
        others are module names."""
        return (
            not self.targets
            or "Linear" in self.targets
            or any(
                re.match(t[3:], module) if t.startswith("re:") else t == module
                for t in self.targets
            )
        )

    def describe(self) -> str:
        acts = self.inputs
        label = f"W{self.weights.num_bits}A{acts.num_bits if acts else 16}"
        detail = f"{self.weights.describe()} weights"
        if acts:
            detail += f", {acts.describe()} activations"
        return f"compressed-tensors format {self.format!r} ({label}: {detail}; group {self.name!r})"


def _inferred_format(w: Args, acts: Args | None) -> str:
    """The format compressed-tensors gives a Linear with these args (compressors/format.py:
    the first compressor, in its priority order, whose can_compress accepts them)."""
    if w.type == "float" and w.group_size == MX_GROUP and w.num_bits in (4, 6):
        return MXFP4_FORMAT if w.num_bits == 4 else "mxfp6-pack-quantized"
    if (
        w.type == "float"
        and w.num_bits == 8
        and w.group_size == MX_GROUP
        and w.scale_dtype == "uint8"
    ):
        return "mxfp8-quantized"
    if w.type == "float" and w.num_bits == 4 and w.group_size == NVFP4_GROUP:
        return NVFP4_FORMAT
    if w.type == "int":
        return INT_FORMAT if acts is not None else INT4_FORMAT
    return FP8_FORMAT if acts is not None else NAIVE_FORMAT


def schemes(config: dict, where: str) -> list[Scheme]:
    """The config groups that quantize weights, in the config's order."""
    qc = quantization_config(config, where)
    model_format = qc.get("format", str, None)
    out = []
    for name, group in qc.children("config_groups", {}).items():
        weights = group.child("weights", None)
        if weights is None:
            continue  # activations or the KV cache only: no weight tensors
        weights = _args(weights)
        acts = group.child("input_activations", None)
        acts = None if acts is None else _args(acts)
        fmt = group.get("format", str, None) or (model_format if model_format != MIXED else None)
        fmt = fmt or _inferred_format(weights, acts)
        targets = tuple(group.strings("targets", []))
        for target in (t for t in targets if t.startswith("re:")):
            try:
                re.compile(target[3:])
            except re.error as e:
                rule = f"{target!r} is not a regular expression ({e})"
                raise group.error("targets", list(targets), rule) from None
        out.append(Scheme(name, fmt, targets, weights, acts))
    return out


# ---- load -------------------------------------------------------------------------------------


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    if sys.byteorder != "little":
        raise QShardError(
            "compressed-tensors: reading packed int32 words needs a little-endian machine"
        )
    act_order = [k for k in reader.names() if k.endswith(".weight_g_idx")]
    if act_order:
        raise CheckpointError(
            f"{reader.directory}: {act_order[0]!r}: an act-order (g_idx) checkpoint, whose "
            f"groups are permuted columns; the int4 layout's groups are contiguous"
        )
    groups = schemes(config, str(reader.directory / "config.json"))
    state, consumed = {}, set()
    for key in reader.names():
        if key.endswith(".weight_packed"):
            prefix, first = key.removesuffix(".weight_packed"), "weight_packed"
        elif key.endswith(".weight") and key + "_scale" in reader:
            prefix, first = key.removesuffix(".weight"), "weight"
        else:
            continue
        scheme = _scheme_of(reader, prefix, first, groups)
        state[prefix + ".weight"] = LOADERS[scheme.format](reader, prefix, scheme, dtype)
        consumed.update(f"{prefix}.{n}" for n in TENSORS[scheme.format])
    for key in reader.names():
        if key not in consumed:
            state[key] = reader.get(key)
    return state


def _scheme_of(reader, prefix: str, first: str, groups: list[Scheme]) -> Scheme:
    """The first group that targets `prefix` and whose format stores `first` first; refused
    with the reason if qshard cannot hold that format's weights."""
    packed = first == "weight_packed"
    fitting = [
        s for s in groups if s.targets_module(prefix) and (s.format in PACKED_FORMATS) == packed
    ]
    if not fitting:
        raise CheckpointError(
            f"{reader.directory}: {prefix}.{first} is stored, but no config group that targets "
            f"{prefix!r} has a format storing it (groups: "
            f"{[(s.name, s.format, list(s.targets)) for s in groups]}); the config does not "
            f"describe these tensors: fix config.json's quantization_config.config_groups"
        )
    scheme = fitting[0]
    why = _why_not(scheme)
    if why:
        raise CheckpointError(f"{reader.directory}: {prefix}: {scheme.describe()}: {why}")
    return scheme


# What qshard holds, per format: weights' (type, bits), strategies, group sizes of the grouped
# strategies (None: any), whether they must be symmetric, and the rule a refusal states.
HOLDS = {
    INT4_FORMAT: (
        ("int", 4),
        ("group",),
        GROUP_SIZES,
        False,
        f"qshard's int layout holds 4-bit weights in groups of {list(GROUP_SIZES)} "
        f"along K (no int8 or other widths, no scale per channel or tensor)",
    ),
    NVFP4_FORMAT: (
        ("float", 4),
        ("tensor_group",),
        (NVFP4_GROUP,),
        True,
        "NVFP4 is symmetric 4-bit float in groups of 16 with a global scale",
    ),
    MXFP4_FORMAT: (
        ("float", 4),
        ("group",),
        (MX_GROUP,),
        True,
        "MXFP4 is symmetric 4-bit float in groups of 32",
    ),
    INT_FORMAT: (
        ("int", 4),
        ("group", "channel"),
        GROUP_SIZES,
        False,
        f"qshard's int layout holds 4-bit weights per channel or in groups of "
        f"{list(GROUP_SIZES)} along K (no int8 layout: it runs int4 as W4A16)",
    ),
    FP8_FORMAT: (
        ("float", 8),
        ("channel", "tensor", "block"),
        None,
        True,
        "qshard reads symmetric FP8 (e4m3) weights with a scale per channel, per "
        "tensor or per block from this format, and has no int8 layout",
    ),
}
HOLDS[NAIVE_FORMAT] = HOLDS[FP8_FORMAT]
INT_ACTIVATIONS = (
    "qshard has no int activation quantization: it runs int activations only with 4-bit int "
    "weights, as W4A16 (activations in bf16/fp16)"
)


def _why_not(s: Scheme) -> str | None:
    """Why qshard cannot hold the weights of scheme `s` as stored, or None if it can."""
    fix = "; use a checkpoint quantized so, or quantize the float model with qshard.quantize_"
    if s.inputs is not None and s.inputs.type == "int" and s.weights.type != "int":
        return INT_ACTIVATIONS + fix
    if s.format not in HOLDS:
        return f"qshard reads the formats {list(HOLDS)}" + fix
    kind, strategies, groups, symmetric_only, rule = HOLDS[s.format]
    w = s.weights
    ok = (w.type, w.num_bits) == kind and w.strategy in strategies
    grouped = w.strategy in ("group", "tensor_group")
    ok = ok and (groups is None or not grouped or w.group_size in groups)
    ok = ok and (w.symmetric or not symmetric_only)
    return None if ok else rule + fix


def _unpack_words(words: torch.Tensor, count: int) -> torch.Tensor:
    """int32 [R, W] of LSB-first nibbles -> uint8 codes [R, count]."""
    nibbles = words.contiguous().view(torch.uint8)
    codes = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(words.shape[0], -1)
    return codes[:, :count]


def _weight_shape(reader, prefix: str) -> tuple[int, int]:
    where = f"{reader.directory}: {prefix}"
    shape = check_stored(
        where,
        "weight_shape",
        reader.get(prefix + ".weight_shape"),
        (torch.int64, torch.int32),
        (2,),
    )
    n, k = (int(v) for v in shape)
    if not (1 <= n <= MAX_SIZE and 1 <= k <= MAX_SIZE):
        raise CheckpointError(
            f"{where}: weight_shape is {[n, k]}; it must be two sizes in "
            f"1..{MAX_SIZE}. The file is damaged"
        )
    return n, k


def _int4(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    n, k = _weight_shape(reader, prefix)
    group = scheme.weights.group_size
    groups = -(-k // group)
    packed = check_stored(
        where, "weight_packed", reader.get(prefix + ".weight_packed"), torch.int32, (n, -(-k // 8))
    )
    scale = check_stored(
        where, "weight_scale", reader.get(prefix + ".weight_scale"), SCALES, (n, groups)
    )
    scale = exact_bf16(scale, where + ".weight_scale")
    # Bytes of the words, little-endian: the layout's packing, cut to ceil(K/2) bytes.
    qdata = packed.contiguous().view(torch.uint8)[:, : -(-k // 2)].contiguous()
    if k % 2:
        qdata[:, -1] &= 15  # the layout leaves an odd K's last high nibble zero
    zero_key = prefix + ".weight_zero_point"
    symmetric = _symmetric(reader, where, zero_key, scheme)
    if symmetric:
        zero = torch.zeros(0, 0, dtype=torch.bfloat16)
    else:
        words = check_stored(
            where, "weight_zero_point", reader.get(zero_key), torch.int32, (-(-n // 8), groups)
        )
        zero = _unpack_words(words.t(), n).t().to(torch.bfloat16)  # z + 8: the zero's code
    tensor = Int4Tensor(
        {"qdata": qdata, "scale": scale, "zero": zero.contiguous()},
        shape=(n, k),
        dtype=dtype,
        group_size=group,
        symmetric=symmetric,
        backend=Backend.AUTO,
    )
    tensor.validate()
    return tensor.repack_for_device()


def _symmetric(reader, where: str, zero_key: str, scheme: Scheme) -> bool:
    """The config group's `symmetric`, which the file must agree with (a zero point or none)."""
    symmetric = scheme.weights.symmetric
    if (zero_key in reader) == symmetric:
        state = "has" if symmetric else "lacks"
        raise CheckpointError(
            f"{where}: config group {scheme.name!r} says symmetric="
            f"{symmetric} but the linear {state} a weight_zero_point; the "
            f"file and its config disagree"
        )
    return symmetric


def _int4_values(where: str, name: str, values: torch.Tensor) -> torch.Tensor:
    """`values` (an integer tensor) if each is a 4-bit int, -8..7, else CheckpointError."""
    low, high = INT4_RANGE
    bad = ((values < low) | (values > high)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        raise CheckpointError(
            f"{where}: {name}{list(at)} is {int(values[at])}; a 4-bit int "
            f"is in {low}..{high} (compressed-tensors clamps to that range). "
            f"The file is damaged, or its config's num_bits is not 4: "
            f"re-export the checkpoint"
        )
    return values


def _int4_unpacked(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    """int-quantized 4-bit weights, one int8 per weight (the module docstring)."""
    where = f"{reader.directory}: {prefix}"
    q = check_stored(where, "weight", reader.get(prefix + ".weight"), torch.int8, (None, None))
    n, k = q.shape
    _int4_values(where, "weight", q)
    per_channel = scheme.weights.strategy == "channel"
    if per_channel:  # one group of K, repeated over groups the layout takes (same weights)
        group = next((g for g in reversed(GROUP_SIZES) if k % g == 0), GROUP_SIZES[-1])
        stored = (n, 1)
    else:
        group = scheme.weights.group_size
        stored = (n, -(-k // group))
    groups = -(-k // group)
    scale = check_stored(
        where, "weight_scale", reader.get(prefix + ".weight_scale"), SCALES, stored
    )
    scale = exact_bf16(scale, where + ".weight_scale")
    zero_key = prefix + ".weight_zero_point"
    symmetric = _symmetric(reader, where, zero_key, scheme)
    if symmetric:
        zero = torch.zeros(0, 0, dtype=torch.bfloat16)
    else:
        z = check_stored(where, "weight_zero_point", reader.get(zero_key), INTS, stored)
        zero = (_int4_values(where, "weight_zero_point", z) + 8).to(torch.bfloat16)  # its code
        zero = zero.expand(n, groups) if per_channel else zero
    scale = scale.expand(n, groups) if per_channel else scale
    _check_dropped(reader, prefix, "input_scale", SCALES)
    _check_dropped(reader, prefix, "input_zero_point", INTS)
    qdata = pack_nibbles((q + 8).to(torch.uint8))  # codes u = q + 8, even index low
    tensor = Int4Tensor(
        {"qdata": qdata, "scale": scale.contiguous(), "zero": zero.contiguous()},
        shape=(n, k),
        dtype=dtype,
        group_size=group,
        symmetric=symmetric,
        backend=Backend.AUTO,
    )
    tensor.validate()
    return tensor.repack_for_device()


def _fp4_codes(reader, prefix: str, group: int, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight_packed` uint8 [N, K/2] and `weight_scale` [N, ceil(K/group)] of one of `scales`."""
    where = f"{reader.directory}: {prefix}"
    packed = check_stored(
        where, "weight_packed", reader.get(prefix + ".weight_packed"), torch.uint8, (None, None)
    )
    n, k = packed.shape[0], packed.shape[1] * 2
    scale = check_stored(
        where, "weight_scale", reader.get(prefix + ".weight_scale"), scales, (n, -(-k // group))
    )
    _check_dropped(reader, prefix, "input_global_scale", torch.float32)
    return packed, scale


def _check_dropped(reader, prefix: str, name: str, dtypes) -> None:
    """A static activation scale qshard does not use (the module docstring), still checked to
    be the one value the format stores."""
    if f"{prefix}.{name}" in reader:
        check_scalar(f"{reader.directory}: {prefix}", name, reader.get(f"{prefix}.{name}"), dtypes)


def _nvfp4(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    packed, scale = _fp4_codes(reader, prefix, NVFP4_GROUP, torch.float8_e4m3fn)
    divisor = reader.get(prefix + ".weight_global_scale")
    divisor = check_scalar(where, "weight_global_scale", divisor, torch.float32)
    d = float(divisor.reshape(()))
    if not (math.isfinite(d) and d > 0):
        raise CheckpointError(
            f"{where}: weight_global_scale {d} is not positive and finite; a "
            f"divisor must be. The file is damaged: re-export it"
        )
    inner = {"qdata": packed, "scale": scale, "global_scale": 1.0 / divisor.reshape(1, 1)}
    n, k = packed.shape[0], packed.shape[1] * 2
    tensor = Nvfp4Tensor(inner, shape=(n, k), dtype=dtype, backend=Backend.AUTO, global_divisor=d)
    tensor.validate()
    return tensor


def _mxfp4(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    packed, scale = _fp4_codes(reader, prefix, MX_GROUP, (torch.uint8, torch.float8_e8m0fnu))
    n, k = packed.shape[0], packed.shape[1] * 2
    inner = {"qdata": packed, "scale": scale.contiguous().view(torch.float8_e8m0fnu)}
    tensor = Mxfp4Tensor(
        inner, shape=(n, k), dtype=dtype, group_size=MX_GROUP, backend=Backend.AUTO
    )
    tensor.validate()
    return tensor


def _fp8(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    qdata = check_stored(
        where, "weight", reader.get(prefix + ".weight"), torch.float8_e4m3fn, (None, None)
    )
    n, k = qdata.shape
    _check_dropped(reader, prefix, "input_scale", SCALES)
    w = scheme.weights
    weight_only = scheme.inputs is None
    scale = reader.get(prefix + ".weight_scale")
    if w.strategy == "channel":  # one scale per row: [N, 1] (or [N])
        rows = (n, 1) if scale.dim() == 2 else (n,)
        return fp8_rows(
            qdata,
            check_stored(where, "weight_scale", scale, SCALES, rows).float(),
            dtype,
            weight_only,
        )
    if w.strategy == "tensor":  # one scale: [1] (or [])
        return fp8_rows(
            qdata, check_scalar(where, "weight_scale", scale, SCALES).float(), dtype, weight_only
        )
    attrs = fp8_block_attrs(
        w.block_structure,
        weight_only,
        ScaleFormat.FP32,
        lambda e: CheckpointError(
            f"{reader.directory / 'config.json'}: config group {scheme.name!r} "
            f"weights.block_structure {list(w.block_structure)}: {e}"
        ),
    )
    bn, bk = w.block_structure
    blocks = (-(-n // bn), -(-k // bk))
    scale = check_stored(where, "weight_scale", scale, SCALES, blocks).float()
    tensor = Fp8BlockwiseTensor(
        {"qdata": qdata, "scale": scale}, shape=(n, k), dtype=dtype, **attrs
    )
    tensor.validate()
    return tensor


# The reader of each format of HOLDS.
LOADERS = {
    INT4_FORMAT: _int4,
    NVFP4_FORMAT: _nvfp4,
    MXFP4_FORMAT: _mxfp4,
    FP8_FORMAT: _fp8,
    NAIVE_FORMAT: _fp8,
    INT_FORMAT: _int4_unpacked,
}


# ---- export -----------------------------------------------------------------------------------


def _fp8_export(w: QTensor, prefix: str, tensors: dict) -> tuple[dict, dict | None]:
    """(weights args, input activations args) of an FP8 weight, its tensors added."""
    tensors[prefix + ".weight"] = w.qdata
    tensors[prefix + ".weight_scale"] = w.scale
    args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
    if isinstance(w, Fp8RowwiseTensor):
        args["strategy"], acts["strategy"] = "channel", "token"
    else:
        args.update(strategy="block", block_structure=list(w.block_size))
        acts.update(strategy="group", group_size=w.act_group_size)
    return args, None if w.weight_only else acts


def _pack_words(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [R, C] -> int32 [R, ceil(C/8)], LSB first (pack_to_int32's order)."""
    rows, count = codes.shape
    padded = torch.zeros(rows, -(-count // 8) * 8, dtype=torch.uint8, device=codes.device)
    padded[:, :count] = codes
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).contiguous().view(torch.int32)


def _divisor(w: Nvfp4Tensor) -> torch.Tensor:
    """The fp32 divisor d to store for `w`'s multiplier global_scale: the one its checkpoint
    stored (global_divisor) while fl(1/d) is still global_scale, so that load -> export gives
    the file's bytes back; otherwise, among the fp32 neighbours of 1 / global_scale, the d
    whose reciprocal comes nearest to it: equal to it where such a d exists (about 83 % of
    random fp32 values, measured), else one fp32 ulp away (x -> 1/x skips some fp32 values)."""
    multiplier = w.global_scale
    if w.global_divisor is not None:
        kept = torch.full_like(multiplier, w.global_divisor)
        if torch.equal(1.0 / kept, multiplier):
            return kept
    first = (1.0 / multiplier).float()
    best, best_error = first, None
    for step in (0, 1, -1, 2, -2, 3, -3):
        candidate = first
        direction = torch.full_like(first, float("inf") if step > 0 else 0.0)
        for _ in range(abs(step)):
            candidate = torch.nextafter(candidate, direction)
        error = float(((1.0 / candidate) - multiplier).abs().max())
        if best_error is None or error < best_error:
            best, best_error = candidate, error
    return best


def _group_config(args: tuple[dict, dict | None], fmt: str, targets: list[str]) -> dict:
    weights, inputs = args
    return {
        "targets": sorted(targets),
        "weights": weights,
        "input_activations": inputs,
        "output_activations": None,
        "format": fmt,
    }


def _refuse(key: str, value: QTensor, why: str) -> QShardError:
    return QShardError(
        f"qshard.export(format='{NAME}'): {key!r} is a {type(value).__name__} "
        f"{list(value.shape)}; {why}"
    )


def export(state: dict, linear_names: list[str]) -> tuple[dict, dict, dict]:
    tensors, groups = {}, {}

    def add(fmt: str, args: dict, inputs: dict | None, prefix: str) -> None:
        group_key = (fmt, repr(sorted(args.items())), repr(sorted((inputs or {}).items())))
        groups.setdefault(group_key, ((args, inputs), []))[1].append(prefix)

    for key, value in state.items():
        if not isinstance(value, QTensor):
            tensors[key] = value
            continue
        w = (value.t() if value.transposed else value).canonical()
        prefix = key.removesuffix(".weight")
        n, k = w.logical_shape
        if isinstance(w, Fp8BlockwiseTensor | Fp8RowwiseTensor):
            add(FP8_FORMAT, *_fp8_export(w, prefix, tensors), prefix)
        elif isinstance(w, Int4Tensor):
            if w.float_zero:
                raise _refuse(
                    key,
                    value,
                    "it has float zero points (zero_point_domain='float'); "
                    "compressed-tensors int4 zero points are integers",
                )
            if w.group_size not in GROUP_SIZES or k % w.group_size:
                raise _refuse(
                    key,
                    value,
                    f"K = {k} in groups of {w.group_size}: compressed-"
                    f"tensors reads int4 groups that divide K exactly (its group "
                    f"dequantization refuses a partial last group); quantize with a "
                    f"group size of {list(GROUP_SIZES)} that divides {k}, or leave "
                    f"this linear unquantized",
                )
            tensors[prefix + ".weight_packed"] = _pack_words(unpack_nibbles(w.qdata, k))
            tensors[prefix + ".weight_scale"] = w.scale
            tensors[prefix + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not w.symmetric:
                zero_codes = w.zero.to(torch.uint8)  # z + 8 in compressed-tensors' terms
                packed_zero = _pack_words(zero_codes.t()).t().contiguous()  # along N
                tensors[prefix + ".weight_zero_point"] = packed_zero
            args = {
                "num_bits": 4,
                "type": "int",
                "symmetric": w.symmetric,
                "strategy": "group",
                "group_size": w.group_size,
                "dynamic": False,
            }
            add(INT4_FORMAT, args, None, prefix)
        elif isinstance(w, Nvfp4Tensor) and k % NVFP4_GROUP == 0:
            tensors[prefix + ".weight_packed"] = w.qdata
            tensors[prefix + ".weight_scale"] = w.scale
            tensors[prefix + ".weight_global_scale"] = _divisor(w).reshape(1)
            args = {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "tensor_group",
                "group_size": NVFP4_GROUP,
                "dynamic": False,
            }
            add(NVFP4_FORMAT, args, None, prefix)
        elif isinstance(w, Mxfp4Tensor) and w.group_size == MX_GROUP and k % MX_GROUP == 0:
            tensors[prefix + ".weight_packed"] = w.qdata
            tensors[prefix + ".weight_scale"] = w.scale.view(torch.uint8)
            args = {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "group_size": MX_GROUP,
                "dynamic": False,
                "scale_dtype": "torch.uint8",
            }
            add(MXFP4_FORMAT, args, None, prefix)
        else:
            raise _refuse(
                key,
                value,
                "the format holds FP8 per row or in blocks, int4 in "
                "groups of 32..256 dividing K, and NVFP4 / MXFP4 (32-blocks) with K a "
                "multiple of 16 / 32",
            )
    config_groups = {
        f"group_{i}": _group_config(args, fmt, targets)
        for i, ((fmt, *_), (args, targets)) in enumerate(sorted(groups.items()))
    }
    formats = {fmt for fmt, *_ in groups}
    quantized = {t for _, targets in groups.values() for t in targets}
    qc = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else MIXED,
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": unquantized_modules(state, linear_names, quantized),
    }
    update = {"quantization_config": qc}
    if any(fmt == NVFP4_FORMAT for fmt, *_ in groups):
        # compressed-tensors 0.20 unpacks NVFP4 weights to bf16 whatever the model's dtype:
        # a checkpoint that names float32 (or float16) loads in transformers but fails in its
        # first matmul (float activations, bf16 weights), so the export names bf16.
        update |= {"dtype": "bfloat16", "torch_dtype": "bfloat16"}
    return tensors, update, {}
