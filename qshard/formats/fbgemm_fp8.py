"""FBGEMM row-wise FP8 checkpoints (Meta's Llama-3.1-405B-FP8, Hugging Face's FbgemmFp8Config)
<-> Fp8RowwiseTensor.

config.json `quantization_config`: quant_method "fbgemm_fp8", activation_scale_ub (1200.0 by
default), modules_to_not_convert (left in float). A quantized linear is `<p>.weight`
float8_e4m3fn [N, K] with `<p>.weight_scale` [N, 1] (float32, or the model's dtype), a
multiplier: W = weight * weight_scale per row, the per-row layout's own definition, so both map
as they are. Activations are quantized per token (FBGEMM's `quantize_fp8_per_row`), as the
per-row layout does, except that FBGEMM clamps each token's amax at activation_scale_ub first;
qshard does not, so a token whose |max| exceeds it (1200 by default) is scaled to its own
amax: its outliers are kept, where FBGEMM saturates them. `input_scale_ub` is a buffer the
format does not save.
"""

from __future__ import annotations

import torch

from ..errors import QShardError
from ..layouts import Fp8RowwiseTensor
from ..qtensor import QTensor
from .configs import check_scalar, check_stored, quantization_config, unquantized_modules
from .source import fp8_rows

NAME = "fbgemm-fp8"
DEFAULT_SCALE_UB = 1200.0  # Hugging Face's FbgemmFp8Config default
SCALES = (torch.float32, torch.bfloat16, torch.float16)  # fp32, or the model's dtype


def detect(config: dict, hf_quant: dict | None) -> bool:
    qc = quantization_config(config)
    return qc is not None and qc.raw("quant_method") == "fbgemm_fp8"


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    scaled = {
        k.removesuffix(".weight_scale") for k in reader.names() if k.endswith(".weight_scale")
    }
    state = {}
    for key in reader.names():
        prefix, _, name = key.rpartition(".")
        if prefix in scaled and name in ("weight_scale", "input_scale_ub"):
            continue  # read with the weight; the bound is not used (docstring)
        quantized = prefix in scaled and name == "weight"
        state[key] = _weight(reader, prefix, dtype) if quantized else reader.get(key)
    return state


def _weight(reader, prefix: str, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    qdata = check_stored(
        where, "weight", reader.get(prefix + ".weight"), torch.float8_e4m3fn, (None, None)
    )
    n = qdata.shape[0]
    scale = reader.get(prefix + ".weight_scale")  # [N, 1] (HF), or [N]
    rows = (n, 1) if scale.dim() == 2 else (n,)
    scale = check_stored(where, "weight_scale", scale, SCALES, rows)
    if prefix + ".input_scale_ub" in reader:  # not used (module docstring), but checked
        check_scalar(where, "input_scale_ub", reader.get(prefix + ".input_scale_ub"), SCALES)
    return fp8_rows(qdata, scale, dtype, weight_only=False)


def export(state: dict, linear_names: list[str]) -> tuple[dict, dict, dict]:
    """(tensors, config.json entries, other JSON files) of a state_dict whose quantized weights
    are per-row FP8 with activation quantization (the format has no weight-only variant)."""
    tensors, quantized = {}, set()
    for key, value in state.items():
        if isinstance(value, Fp8RowwiseTensor) and not value.weight_only:
            untransposed = value.t() if value.transposed else value
            prefix = key.removesuffix(".weight")
            tensors[prefix + ".weight"] = untransposed.qdata
            tensors[prefix + ".weight_scale"] = untransposed.scale
            quantized.add(prefix)
        elif isinstance(value, QTensor):
            raise QShardError(
                f"qshard.export(format='{NAME}'): {key!r} is a {type(value).__name__}"
                f"{' (weight-only)' if isinstance(value, Fp8RowwiseTensor) else ''}; the format "
                f"holds per-row FP8 weights with dynamic activations (Fp8RowwiseConfig())"
            )
        else:
            tensors[key] = value
    skipped = unquantized_modules(state, linear_names, quantized)
    qc = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": DEFAULT_SCALE_UB,
        "modules_to_not_convert": skipped,
    }
    return tensors, {"quantization_config": qc}, {}
