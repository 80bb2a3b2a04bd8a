"""Writing a compressed-tensors checkpoint (`export`): each quantized linear as the format's
tensors and one quantization group per scheme in config.json, read back by compressed-tensors,
vLLM and SGLang (the format's notes are `reading.py`'s docstring)."""

from __future__ import annotations

import torch

from ...errors import QShardError
from ...kernels.packing import unpack_nibbles
from ...kernels.w4a8 import act_group
from ...layouts import Fp8BlockwiseTensor, Fp8RowwiseTensor, Int4Tensor, Mxfp4Tensor, Nvfp4Tensor
from ...layouts.int4 import GROUP_SIZES, ActivationQuant
from ...qtensor import QTensor
from ..configs import unquantized_modules
from .schemes import (
    FP8_FORMAT,
    INT4_FORMAT,
    MIXED,
    MX_GROUP,
    MXFP4_FORMAT,
    NAME,
    NVFP4_FORMAT,
    NVFP4_GROUP,
)

__all__ = ["export"]


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


def _int4_inputs(w: Int4Tensor) -> dict | None:
    """An int4 weight's `input_activations`: None (W4A16), or W4A8's dynamic FP8 activations,
    per token (compressed-tensors' W4AFP8 preset) or per group of min(weight group, 128)."""
    if w.activations is ActivationQuant.NONE:
        return None
    args = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
    if w.activations is ActivationQuant.FP8_TOKEN:
        return {**args, "strategy": "token"}
    return {**args, "strategy": "group", "group_size": act_group(w.group_size)}


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
            add(INT4_FORMAT, args, _int4_inputs(w), prefix)
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
