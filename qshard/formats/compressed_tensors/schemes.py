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
FP8 activations with int4 weights (W4AFP8) -> the int4 layout's W4A8 (`activations`:
"fp8_token" for per-token or static ones, "fp8_group" for groups no finer than min(weight
group, 128); finer groups weight-only).
int activation quantization with int4 weights (W4A8: int8 per token) -> weight-only W4A16, the
activations in bf16/fp16 (finer than int8; a static `input_scale` / `input_zero_point` is
dropped). Refused, naming the scheme (CheckpointError): int weights of other than 4 bits (W8A8,
W8A16: qshard has no int8 layout) or not per channel or in groups of 32..256 (pack-quantized:
groups only), int activations with float weights, MXFP6/MXFP8, the sparse formats, act-order
(`weight_g_idx`).
Export writes int4 (W4A8 ones with their dynamic FP8 activations), NVFP4, MXFP4, and FP8 per
channel or in blocks with dynamic activations.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..configs import (
    MAX_SIZE,
    Fields,
    quantization_config,
)

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
