"""torchao's safetensors checkpoints (torchao >= 0.14, the `pytorch/*` models on the hub;
facts.md §5) -> Fp8BlockwiseTensor.

config.json `quantization_config.quant_method` "torchao". The safetensors header metadata holds
`tensor_names` (a JSON list of state_dict keys) and, per key, a JSON object: {"_type":
"Tensor"} for a plain tensor stored under its key, or {"_type": "<torchao class>", "_data":
{attributes}, "_tensor_data_names": [...]} for a tensor subclass whose tensors are stored as
`<module>._<param>_<name>` (e.g. `0._weight_qdata`, `0._weight_scale`).

Float8Tensor: qdata float8_e4m3fn [N, K], scale float32 with one value per `block_size` block,
a multiplier (torchao's `_dequantize_affine_float8`: qdata * scale): with power-of-two blocks
of 16 or more (torchao's PerBlock([128, 128]) config), the FP8 blockwise layout itself, mapped
as stored. Refused with the reason (CheckpointError): per-row Float8Tensor (block [1, K]: qshard
has no per-row FP8 layout) and Int4Tensor (its zero point is a float added after scaling,
W = (q - 8) * scale + zero, which the int4 layout's integer zero code cannot hold exactly).
"""

from __future__ import annotations

import json

import torch

from ..config import Backend, ScaleFormat
from ..errors import CheckpointError
from ..layouts import Fp8BlockwiseTensor
from ..layouts.fp8_blockwise import MIN_BLOCK

NAME = "torchao"
WHY_NOT = {
    "Int4Tensor": "its zero point is a float added after scaling ((q - 8) * scale + zero), which "
    "the int4 layout's integer zero code cannot hold exactly",
    "Int4TilePackedTo4dTensor": "it is tinygemm's device packing with float zero points; "
    "qshard's int4 layout keeps integer zero codes",
}


def detect(config: dict, hf_quant: dict | None) -> bool:
    qc = config.get("quantization_config") or {}
    return qc.get("quant_method") == "torchao"


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    metadata = reader.metadata()
    if "tensor_names" not in metadata:
        raise CheckpointError(f"{reader.directory}: a torchao checkpoint without 'tensor_names' "
                              f"in its safetensors metadata (torchao < 0.14 pickles; re-save "
                              f"it with torchao's safetensors support)")  # fmt: skip
    state = {}
    for name in json.loads(metadata["tensor_names"]):
        entry = json.loads(metadata[name])
        kind = entry.get("_type")
        if kind == "Tensor":
            state[name] = reader.get(name)
        elif kind == "Float8Tensor":
            state[name] = _float8(reader, name, entry, dtype)
        else:
            why = WHY_NOT.get(kind, "qshard reads Float8Tensor and plain tensors from torchao")
            raise CheckpointError(f"{reader.directory}: {name!r} is a torchao {kind}, which "
                                  f"qshard cannot load as stored: {why}")  # fmt: skip
    return state


def _float8(reader, name: str, entry: dict, dtype: torch.dtype) -> Fp8BlockwiseTensor:
    module, _, param = name.rpartition(".")
    prefix = f"{module}._{param}_" if module else f"_{param}_"
    qdata, scale = reader.get(prefix + "qdata"), reader.get(prefix + "scale")
    block = tuple((entry.get("_data") or {}).get("block_size") or ())
    where = f"{reader.directory}: {name}"
    if qdata.dtype != torch.float8_e4m3fn or qdata.dim() != 2:
        raise CheckpointError(f"{where}: qdata {qdata.dtype}{list(qdata.shape)}; qshard reads "
                              f"2-D float8_e4m3fn weights")  # fmt: skip
    n, k = qdata.shape
    if len(block) != 2 or any(b < MIN_BLOCK or b & (b - 1) for b in block):
        kind = "per-row" if block[:1] == (1,) else f"block {list(block)}"
        raise CheckpointError(
            f"{where}: a {kind} Float8Tensor; qshard's FP8 layout takes blocks whose sides are "
            f"powers of two >= {MIN_BLOCK} (torchao's PerBlock([128, 128])); qshard has no "
            f"per-row FP8 layout"
        )
    blocks = (-(-n // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != blocks:
        raise CheckpointError(f"{where}: scale {list(scale.shape)}; {block[0]}x{block[1]} "
                              f"blocks of [{n}, {k}] need {list(blocks)}")  # fmt: skip
    tensor = Fp8BlockwiseTensor(
        {"qdata": qdata, "scale": scale.float()},
        shape=(n, k), dtype=dtype, block_size=block, act_group_size=block[1],
        weight_only=False, scale_format=ScaleFormat.FP32, backend=Backend.AUTO,
    )  # fmt: skip
    tensor.validate()
    return tensor
