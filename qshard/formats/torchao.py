"""torchao's safetensors checkpoints (torchao >= 0.14, the `pytorch/*` models on the hub;
docs/design.md, "Formats") -> Fp8BlockwiseTensor, Fp8RowwiseTensor, Int4Tensor.

config.json `quantization_config.quant_method` "torchao". The safetensors header metadata holds
`tensor_names` (a JSON list of state_dict keys) and, per key, a JSON object: {"_type":
"Tensor"} for a plain tensor stored under its key, or {"_type": "<torchao class>", "_data":
{attributes}, "_tensor_data_names": [...]} for a tensor subclass whose tensors are stored as
`<module>._<param>_<name>` (e.g. `0._weight_qdata`, `0._weight_scale`). Checked against a file
torchao 0.18.0 wrote (tests/data/torchao).

Float8Tensor: qdata float8_e4m3fn [N, K], scale float32 with one value per `block_size` block,
a multiplier (torchao's `_dequantize_affine_float8`: qdata * scale), mapped as stored:
    block [1, K] (PerRow, scale [N, 1])          -> Fp8RowwiseTensor
    block [N, K] (PerTensor, one scale)          -> Fp8RowwiseTensor, the scale on every row
    power-of-two blocks >= 16 (PerBlock([128, 128])) -> Fp8BlockwiseTensor
`act_quant_kwargs` null (Float8WeightOnlyConfig) loads weight-only; otherwise activations are
quantized dynamically, per token (per-row) or per 1x128 group (blockwise), as qshard does;
torchao's per-tensor activation scaling becomes per-token, which is finer. Refused with the reason
(CheckpointError): other block shapes.

Int4Tensor (Int4WeightOnlyConfig, int4_packing_format "plain"; FBGEMM/mslk's
`int4_row_quantize_zp` and `pack_int4`): qdata int8 [N, K/2], two signed 4-bit values q in
-8..7 per byte (two's complement nibbles, the even index low); scale and zero_point [K/group, N]
in the weight's dtype; W = q * scale + zero_point. As the int4 layout with a float zero point,
W = (u - 8) * scale + zero: u = q + 8 is the nibble with its top bit flipped (byte ^ 0x88), and
scale and zero are transposed. They load when each is a bf16 value (the layout keeps bf16), as
torchao writes them for bf16 models. torchao's W4A8 variant (activation_dtype float8, zero
point 0) loads the same way and runs W4A16. Refused: an `act_pre_scale` (AWQ-style smoothing
torchao applies to the activations), and Int4TilePackedTo4dTensor (tinygemm's device packing).
"""

from __future__ import annotations

import torch

from ..config import Backend, ScaleFormat
from ..errors import CheckpointError
from ..layouts import Fp8BlockwiseTensor, Int4Tensor
from ..layouts.int4 import GROUP_SIZES, ZeroPointDomain
from ..strict_json import parse_json
from .configs import Fields, check_stored, quantization_config
from .source import exact_bf16, fp8_block_attrs, fp8_rows

NAME = "torchao"
SCALES = (torch.bfloat16, torch.float16, torch.float32)  # Int4Tensor: the weight's dtype
WHY_NOT = {
    "Int4TilePackedTo4dTensor": "it is tinygemm's device packing, which qshard makes from the "
    "plain packing (Int4Tensor) itself; save with int4_packing_format='plain'",
}


def detect(config: dict, hf_quant: dict | None) -> bool:
    qc = quantization_config(config)
    return qc is not None and qc.raw("quant_method") == "torchao"


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    metadata = reader.metadata()
    where = f"{reader.directory}: safetensors metadata"
    if "tensor_names" not in metadata:
        raise CheckpointError(
            f"{reader.directory}: a torchao checkpoint without 'tensor_names' "
            f"in its safetensors metadata (torchao < 0.14 pickles; re-save "
            f"it with torchao's safetensors support)"
        )
    names = parse_json(metadata["tensor_names"], f"{where} 'tensor_names'")
    state = {}
    for name in Fields({"tensor_names": names}, where).strings("tensor_names"):
        if name not in metadata:
            raise CheckpointError(
                f"{where}: no entry for {name!r}, which tensor_names lists; "
                f"the file is damaged, re-save it with torchao"
            )
        entry = Fields(parse_json(metadata[name], f"{where} {name!r}"), where, repr(name))
        kind = entry.get("_type", str)
        if kind == "Tensor":
            state[name] = reader.get(name)
        elif kind == "Float8Tensor":
            state[name] = _float8(reader, name, entry, dtype)
        elif kind == "Int4Tensor":
            state[name] = _int4(reader, name, entry, dtype)
        else:
            why = WHY_NOT.get(kind, "qshard reads Float8Tensor, Int4Tensor and plain tensors")
            raise CheckpointError(
                f"{reader.directory}: {name!r} is a torchao {kind}, which "
                f"qshard cannot load as stored: {why}"
            )
    return state


def _prefix(name: str) -> str:
    """Where torchao stores a subclass's tensors: `<module>._<param>_<tensor name>`."""
    module, _, param = name.rpartition(".")
    return f"{module}._{param}_" if module else f"_{param}_"


def _int4(reader, name: str, entry: Fields, dtype: torch.dtype) -> Int4Tensor:
    data, prefix = entry.child("_data"), _prefix(name)
    where = f"{reader.directory}: {name}"
    if "act_pre_scale" in entry.strings("_tensor_data_names", []):
        raise CheckpointError(
            f"{where}: an Int4Tensor with act_pre_scale (activations "
            f"scaled before the matmul, AWQ-style); qshard has none"
        )
    (n, k), block = data.sizes("shape", 2), data.sizes("block_size", 2)
    group = block[-1] if block[0] == 1 else 0
    if group not in GROUP_SIZES:
        raise data.error(
            "block_size",
            list(block),
            f"qshard reads Int4Tensors in groups of {list(GROUP_SIZES)}: [1, group]",
        )
    groups = -(-k // group)
    qdata = check_stored(where, "qdata", reader.get(prefix + "qdata"), torch.int8, (n, -(-k // 2)))
    scale, zero = (
        exact_bf16(
            check_stored(where, t, reader.get(prefix + t), SCALES, (groups, n)), f"{where} {t}"
        )
        for t in ("scale", "zero_point")
    )
    # q in -8..7 as two's complement nibbles -> the code u = q + 8: flip each nibble's top bit.
    codes = qdata.view(torch.uint8) ^ 0x88
    if k % 2:
        codes[:, -1] &= 15  # the layout leaves an odd K's last high nibble zero
    tensor = Int4Tensor(
        {"qdata": codes, "scale": scale.t().contiguous(), "zero": zero.t().contiguous()},
        shape=(n, k),
        dtype=dtype,
        group_size=group,
        symmetric=False,
        backend=Backend.AUTO,
        zero_point_domain=ZeroPointDomain.FLOAT,
    )
    tensor.validate()
    return tensor.repack_for_device()


def _float8(reader, name: str, entry: Fields, dtype: torch.dtype):
    prefix, where = _prefix(name), f"{reader.directory}: {name}"
    data = entry.child("_data")
    block = data.sizes("block_size", 2, note="qshard reads 2-D Float8Tensors")
    weight_only = data.child("act_quant_kwargs", None) is None
    qdata = check_stored(
        where, "qdata", reader.get(prefix + "qdata"), torch.float8_e4m3fn, (None, None)
    )
    n, k = qdata.shape
    scale = reader.get(prefix + "scale")  # fp32 (torchao's _choose_scale_float8)
    if block in ((1, k), (n, k)):  # per row ([N, 1]), or one scale for the whole tensor
        shape = (n, 1) if block[0] == 1 else (1,) * min(scale.dim(), 2)
        scale = check_stored(where, "scale", scale, torch.float32, shape)
        return fp8_rows(qdata, scale, dtype, weight_only)
    attrs = fp8_block_attrs(
        block,
        weight_only,
        ScaleFormat.FP32,
        lambda e: CheckpointError(
            f"{where}: a Float8Tensor with block_size {list(block)}; qshard's FP8 layouts take "
            f"rows ([1, K]), the whole tensor, or blocks the blockwise layout accepts "
            f"(torchao's PerBlock([128, 128])): {e}"
        ),
    )
    blocks = (-(-n // block[0]), -(-k // block[1]))
    scale = check_stored(where, "scale", scale, torch.float32, blocks)
    tensor = Fp8BlockwiseTensor(
        {"qdata": qdata, "scale": scale}, shape=(n, k), dtype=dtype, **attrs
    )
    tensor.validate()
    return tensor
