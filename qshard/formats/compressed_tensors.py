"""compressed-tensors checkpoints (llm-compressor; facts.md §5) <-> Int4Tensor / Nvfp4Tensor /
Fp8RowwiseTensor / Fp8BlockwiseTensor.

config.json `quantization_config`: quant_method "compressed-tensors", format (for the model or
per config group) "pack-quantized", "nvfp4-pack-quantized" or "float-quantized", config_groups
with the weights' and input activations' args, `ignore` (modules left unquantized). Per
quantized linear `<p>`:

pack-quantized int4 (num_bits 4, type int, strategy group): `weight_packed` int32
[N, ceil(K/8)], each value q in -8..7 stored as q + 8, element i of a word at bits 4i (LSB
first); `weight_scale` [N, G]; `weight_shape` int64 [2]; asymmetric: `weight_zero_point` int32
[ceil(N/8), G], zero points z in -8..7 stored the same way but packed along the *output* dim.
W = (q - z) * scale = (u - (z + 8)) * scale with u = q + 8: the int4 layout with code u and
zero code z + 8 (symmetric: zero code 8). On a little-endian machine the int32 words are the
layout's bytes (two codes per byte, the even index low), so the data maps as it is. The
layout keeps bf16 scales: fp16 scales load when each is exactly a bf16 value, else
CheckpointError (converting would re-quantize).

nvfp4-pack-quantized: `weight_packed` uint8 [N, K/2] (the NVFP4 layout's bytes),
`weight_scale` float8_e4m3fn [N, K/16], `weight_global_scale` float32, a *divisor*:
W = e2m1 * (weight_scale / weight_global_scale). The layout's global scale is a multiplier,
1 / weight_global_scale rounded to fp32, so its dequantized values are within one fp32 ulp of
the format's. Export picks, among the fp32 neighbours of 1 / multiplier, the divisor whose
reciprocal is nearest the multiplier: export -> load gives codes and block scales bit for bit,
and the global scale exactly where an fp32 divisor can (about 83 % of fp32 values; the
reciprocal skips the others) and within one fp32 ulp elsewhere.

float-quantized FP8 (num_bits 8, type float; llm-compressor's FP8 and FP8-Dynamic schemes):
`weight` float8_e4m3fn [N, K] and `weight_scale` (fp32 or bf16, a multiplier: W = weight *
weight_scale): strategy "channel" [N, 1] -> Fp8RowwiseTensor; "tensor" (one value) ->
Fp8RowwiseTensor with that scale on every row; "block" [ceil(N/bn), ceil(K/bk)] with the
group's `block_structure` [bn, bk] -> Fp8BlockwiseTensor. Input activations: none -> weight-only;
dynamic (per token, or per group for blocks) -> qshard's dynamic activation quantization; static
(an `input_scale` per tensor) -> dynamic per token too, which is finer (the input_scale is
dropped). Export writes channel (per-row) and block FP8 with dynamic activations.
"""

from __future__ import annotations

import sys

import torch

from ..config import Backend, ScaleFormat
from ..errors import CheckpointError, QShardError
from ..kernels.packing import unpack_nibbles
from ..layouts import Fp8BlockwiseTensor, Fp8RowwiseTensor, Int4Tensor, Nvfp4Tensor
from ..qtensor import QTensor
from .source import exact_bf16, fp8_rows

NAME = "compressed-tensors"
INT4_FORMAT, NVFP4_FORMAT, FP8_FORMAT = "pack-quantized", "nvfp4-pack-quantized", "float-quantized"
NVFP4_GROUP = 16


def detect(config: dict, hf_quant: dict | None) -> bool:
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "compressed-tensors"


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    if sys.byteorder != "little":
        raise QShardError("compressed-tensors: reading packed int32 words needs a little-endian "
                          "machine")  # fmt: skip
    act_order = [k for k in reader.names() if k.endswith(".weight_g_idx")]
    if act_order:
        raise CheckpointError(
            f"{reader.directory}: {act_order[0]!r}: an act-order (g_idx) checkpoint, whose "
            f"groups are permuted columns; the int4 layout's groups are contiguous"
        )
    state, consumed = {}, set()
    for key in reader.names():
        if key.endswith(".weight_packed"):
            prefix = key.removesuffix(".weight_packed")
            packed = reader.get(key)
            if packed.dtype == torch.int32:
                groups = _group_sizes(config)
                state[prefix + ".weight"] = _int4(reader, prefix, packed, dtype, groups)
            else:
                state[prefix + ".weight"] = _nvfp4(reader, prefix, packed, dtype)
            consumed.update(f"{prefix}.{n}" for n in (
                "weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
                "weight_global_scale", "input_global_scale"))  # fmt: skip
        elif key.endswith(".weight") and key.removesuffix("weight") + "weight_scale" in reader:
            prefix = key.removesuffix(".weight")
            qdata = reader.get(key)
            if qdata.dtype == torch.float8_e4m3fn:
                state[key] = _fp8(reader, prefix, qdata, config, dtype)
                consumed.update(f"{prefix}.{n}" for n in ("weight", "weight_scale", "input_scale"))
    for key in reader.names():
        if key not in consumed:
            state[key] = reader.get(key)
    return state


def _unpack_words(words: torch.Tensor, count: int) -> torch.Tensor:
    """int32 [R, W] of LSB-first nibbles -> uint8 codes [R, count]."""
    nibbles = words.contiguous().view(torch.uint8)
    codes = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(words.shape[0], -1)
    return codes[:, :count]


def _group_sizes(config: dict) -> list[int]:
    """The group sizes the config groups name for their 4-bit int weights."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    sizes = {(g.get("weights") or {}).get("group_size") for g in groups.values()}
    return sorted(s for s in sizes if isinstance(s, int))


def _int4(reader, prefix: str, packed: torch.Tensor, dtype: torch.dtype,
          group_sizes: list[int]) -> QTensor:  # fmt: skip
    where = f"{reader.directory}: {prefix}"
    n, k = (int(v) for v in reader.get(prefix + ".weight_shape"))
    scale = exact_bf16(reader.get(prefix + ".weight_scale"), where + ".weight_scale")
    groups = scale.shape[1]
    if tuple(packed.shape) != (n, -(-k // 8)) or scale.shape[0] != n:
        raise CheckpointError(f"{where}: weight_packed {list(packed.shape)} / weight_scale "
                              f"{list(scale.shape)} do not fit weight_shape [{n}, {k}] in "
                              f"4 bits")  # fmt: skip
    # The config's group size that gives this many groups (the last may be partial).
    fitting = [g for g in group_sizes if -(-k // g) == groups]
    group = fitting[0] if fitting else -(-k // groups)
    if group not in (32, 64, 128, 256) or -(-k // group) != groups:
        raise CheckpointError(f"{where}: {groups} groups over K = {k} (config group sizes "
                              f"{group_sizes}); the int4 layout takes groups of 32, 64, 128 "
                              f"or 256")  # fmt: skip
    # Bytes of the words, little-endian: the layout's packing, cut to ceil(K/2) bytes.
    qdata = packed.contiguous().view(torch.uint8)[:, : -(-k // 2)].contiguous()
    if k % 2:
        qdata[:, -1] &= 15  # the layout leaves an odd K's last high nibble zero
    zero_key = prefix + ".weight_zero_point"
    symmetric = zero_key not in reader
    if symmetric:
        zero = torch.zeros(0, 0, dtype=torch.bfloat16)
    else:
        words = reader.get(zero_key)
        if tuple(words.shape) != (-(-n // 8), groups):
            raise CheckpointError(f"{where}: weight_zero_point {list(words.shape)}; expected "
                                  f"[{-(-n // 8)}, {groups}] (packed along N)")  # fmt: skip
        zero = _unpack_words(words.t(), n).t().to(torch.bfloat16)  # z + 8: the zero's code
    tensor = Int4Tensor(
        {"qdata": qdata, "scale": scale, "zero": zero.contiguous()},
        shape=(n, k), dtype=dtype, group_size=group, symmetric=symmetric, backend=Backend.AUTO,
    )  # fmt: skip
    tensor.validate()
    return tensor.repack_for_device()


def _nvfp4(reader, prefix: str, packed: torch.Tensor, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    scale = reader.get(prefix + ".weight_scale")
    divisor = reader.get(prefix + ".weight_global_scale").float().reshape(1, 1)
    n, k = packed.shape[0], packed.shape[1] * 2
    if packed.dtype != torch.uint8 or scale.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{where}: weight_packed {packed.dtype} / weight_scale "
                              f"{scale.dtype}; nvfp4-pack-quantized holds uint8 and "
                              f"float8_e4m3fn")  # fmt: skip
    inner = {"qdata": packed, "scale": scale, "global_scale": 1.0 / divisor}
    tensor = Nvfp4Tensor(inner, shape=(n, k), dtype=dtype, backend=Backend.AUTO)
    tensor.validate()
    return tensor


def _fp8_group(config: dict) -> dict:
    """The config group of the FP8 weights (type float, 8 bits): its weights' and input
    activations' args."""
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    for group in groups.values():
        weights = group.get("weights") or {}
        if weights.get("type") == "float" and weights.get("num_bits") == 8:
            return group
    return {}


def _fp8(reader, prefix: str, qdata: torch.Tensor, config: dict, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    scale = reader.get(prefix + ".weight_scale").float()
    n, k = qdata.shape
    group = _fp8_group(config)
    weight_only = not group.get("input_activations")
    if scale.numel() == 1 or tuple(scale.shape) in ((n, 1), (n,)):  # tensor or channel
        return fp8_rows(qdata, scale, dtype, weight_only)
    bn, bk = (group.get("weights") or {}).get("block_structure") or (128, 128)
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise CheckpointError(f"{where}: weight_scale {list(scale.shape)} fits neither a "
                              f"scale per row ([{n}, 1]), one per tensor, nor {bn}x{bk} "
                              f"blocks of [{n}, {k}]")  # fmt: skip
    tensor = Fp8BlockwiseTensor(
        {"qdata": qdata, "scale": scale}, shape=(n, k), dtype=dtype,
        block_size=(bn, bk), act_group_size=bk, weight_only=weight_only,
        scale_format=ScaleFormat.FP32, backend=Backend.AUTO,
    )  # fmt: skip
    try:
        tensor.check_attrs(tensor.attrs())
    except QShardError as e:  # e.g. a block_structure qshard's FP8 layout cannot take
        raise CheckpointError(f"{where}: {e}") from None
    tensor.validate()
    return tensor


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


def _divisor(multiplier: torch.Tensor) -> torch.Tensor:
    """The float32 d, among the neighbours of 1 / multiplier, whose reciprocal comes nearest to
    the multiplier: equal to it where such a d exists (about 83 % of random fp32 values,
    measured), else one fp32 ulp away (x -> 1/x skips some fp32 values), so that loading the
    export gives the multiplier back exactly or within one ulp."""
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
    return {"targets": sorted(targets), "weights": weights, "input_activations": inputs,
            "output_activations": None, "format": fmt}  # fmt: skip


def export(state: dict, linear_names: list[str]) -> tuple[dict, dict, dict]:
    tensors, groups = {}, {}

    def add(fmt: str, args: dict, inputs: dict | None, prefix: str) -> None:
        group_key = (fmt, repr(sorted(args.items())), repr(sorted((inputs or {}).items())))
        groups.setdefault(group_key, ((args, inputs), []))[1].append(prefix)

    for key, value in state.items():
        if not isinstance(value, QTensor):
            tensors[key] = value
            continue
        w = value.t() if value.transposed else value
        prefix = key.removesuffix(".weight")
        n, k = w.logical_shape
        if isinstance(w, Int4Tensor) and w.float_zero:
            raise QShardError(
                f"qshard.export(format='{NAME}'): {key!r} has float zero points "
                f"(zero_point_domain='float'); compressed-tensors int4 zero points are integers"
            )
        if isinstance(w, Fp8BlockwiseTensor | Fp8RowwiseTensor):
            add(FP8_FORMAT, *_fp8_export(w, prefix, tensors), prefix)
        elif isinstance(w, Int4Tensor) and w.group_size in (32, 64, 128, 256):
            tensors[prefix + ".weight_packed"] = _pack_words(unpack_nibbles(w.qdata, k))
            tensors[prefix + ".weight_scale"] = w.scale
            tensors[prefix + ".weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
            if not w.symmetric:
                zero_codes = w.zero.to(torch.uint8)  # z + 8 in compressed-tensors' terms
                packed_zero = _pack_words(zero_codes.t()).t().contiguous()  # along N
                tensors[prefix + ".weight_zero_point"] = packed_zero
            args = {"num_bits": 4, "type": "int", "symmetric": w.symmetric, "strategy": "group",
                    "group_size": w.group_size, "dynamic": False}  # fmt: skip
            add(INT4_FORMAT, args, None, prefix)
        elif isinstance(w, Nvfp4Tensor) and k % NVFP4_GROUP == 0:
            tensors[prefix + ".weight_packed"] = w.qdata
            tensors[prefix + ".weight_scale"] = w.scale
            tensors[prefix + ".weight_global_scale"] = _divisor(w.global_scale).reshape(1)
            args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                    "group_size": NVFP4_GROUP, "dynamic": False}  # fmt: skip
            add(NVFP4_FORMAT, args, None, prefix)
        else:
            raise QShardError(
                f"qshard.export(format='{NAME}'): {key!r} is a {type(value).__name__} the "
                f"format cannot hold (it holds FP8 per row or in blocks, int4 in groups of "
                f"32..256 and NVFP4 with K a multiple of 16)"
            )
    config_groups = {
        f"group_{i}": _group_config(args, fmt, targets)
        for i, ((fmt, *_), (args, targets)) in enumerate(sorted(groups.items()))
    }
    formats = {fmt for fmt, *_ in groups}
    quantized = {t for _, targets in groups.values() for t in targets}
    qc = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": config_groups,
        "ignore": [name for name in linear_names if name not in quantized],
    }
    return tensors, {"quantization_config": qc}, {}
