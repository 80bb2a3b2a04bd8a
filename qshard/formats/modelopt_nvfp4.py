"""NVIDIA ModelOpt NVFP4 checkpoints (docs/design.md, "Formats") <-> Nvfp4Tensor.

`hf_quant_config.json`: quantization.quant_algo "NVFP4" (W4A4) or "W4A16_NVFP4" (weight-only),
group_size 16, exclude_modules (fnmatch patterns of modules left unquantized); newer exports
put the same under config.json's quantization_config with quant_method "modelopt". A quantized
linear is `<p>.weight` uint8 [N, K/2] (two e2m1 codes per byte, the even index in the low
nibble), `<p>.weight_scale` float8_e4m3fn [N, K/16] and `<p>.weight_scale_2` float32 (a
scalar), a multiplier: W = e2m1 * weight_scale * weight_scale_2: the layout's own definition,
so every tensor maps as it is. `<p>.input_scale` (the static activation scale of ModelOpt's
W4A4 serving) is not used: qshard runs NVFP4 weight-only, and drops it, as it drops the FP8
KV-cache scales `k_scale` and `v_scale` (qshard keeps the KV cache in the activation dtype).
Export writes weight-only NVFP4 under ModelOpt's own label for it, "W4A16_NVFP4" (no
input_scale).
"""

from __future__ import annotations

import torch

from ..config import Backend
from ..errors import QShardError
from ..layouts import Nvfp4Tensor
from ..qtensor import QTensor
from .configs import Fields, check_scalar, check_stored, quantization_config, unquantized_modules

NAME = "modelopt-nvfp4"
GROUP = 16
HF_QUANT_CONFIG = "hf_quant_config.json"
# ModelOpt's quant_algo for NVFP4 weights with NVFP4 activations (W4A4: an input_scale per
# linear) and for weight-only NVFP4 (QUANTIZATION_W4A16_NVFP4 in modelopt/torch/export, read in
# nvidia-modelopt 0.47.0: the same weight tensors, no input_scale). qshard writes the latter.
QUANT_ALGOS = ("NVFP4", "W4A16_NVFP4")
WEIGHT_ONLY_ALGO = "W4A16_NVFP4"


def _quantization(config: dict, hf_quant: dict | None, directory=None) -> Fields | None:
    """The `quantization` object of hf_quant_config.json, or config.json's quantization_config
    when its quant_method is "modelopt" (newer exports); None if neither."""
    if hf_quant is not None and hf_quant.get("quantization") is not None:
        where = HF_QUANT_CONFIG if directory is None else str(directory / HF_QUANT_CONFIG)
        return Fields(hf_quant, where).child("quantization")
    where = "config.json" if directory is None else str(directory / "config.json")
    qc = quantization_config(config, where)
    return qc if qc is not None and qc.raw("quant_method") == "modelopt" else None


def detect(config: dict, hf_quant: dict | None) -> bool:
    quantization = _quantization(config, hf_quant)
    return quantization is not None and quantization.raw("quant_algo") in QUANT_ALGOS


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    quantization = _quantization(config, hf_quant, reader.directory)
    quantization.choice("quant_algo", QUANT_ALGOS)
    quantization.choice("group_size", (GROUP,), GROUP, note="NVFP4 blocks are 16 values")
    quantized = {
        k.removesuffix(".weight_scale_2") for k in reader.names() if k.endswith(".weight_scale_2")
    }
    state = {}
    for key in reader.names():
        prefix, _, name = key.rpartition(".")
        if prefix in quantized and name in ("weight_scale", "weight_scale_2", "input_scale"):
            continue  # the scales, read with their weight; input_scale dropped (docstring)
        if name in ("k_scale", "v_scale"):
            continue  # FP8 KV-cache scales (kv_cache_quant_algo): qshard's caches stay float
        if prefix in quantized and name == "weight":
            state[key] = _tensor(reader, prefix, dtype)
        else:
            state[key] = reader.get(key)
    return state


def _tensor(reader, prefix: str, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    packed = check_stored(
        where, "weight", reader.get(prefix + ".weight"), torch.uint8, (None, None)
    )
    n, k = packed.shape[0], packed.shape[1] * 2
    scale = check_stored(
        where,
        "weight_scale",
        reader.get(prefix + ".weight_scale"),
        torch.float8_e4m3fn,
        (n, -(-k // GROUP)),
    )
    global_scale = check_scalar(
        where, "weight_scale_2", reader.get(prefix + ".weight_scale_2"), torch.float32
    )
    if prefix + ".input_scale" in reader:  # dropped, but checked: it must be what it claims
        check_scalar(where, "input_scale", reader.get(prefix + ".input_scale"), torch.float32)
    inner = {"qdata": packed, "scale": scale, "global_scale": global_scale.float().reshape(1, 1)}
    tensor = Nvfp4Tensor(inner, shape=(n, k), dtype=dtype, backend=Backend.AUTO)
    tensor.validate()
    return tensor


def export(state: dict, linear_names: list[str]) -> tuple[dict, dict, dict]:
    tensors, quantized = {}, set()
    for key, value in state.items():
        if isinstance(value, Nvfp4Tensor):
            w = value.t() if value.transposed else value
            if w.logical_shape[1] % GROUP:
                raise QShardError(
                    f"qshard.export(format='{NAME}'): {key!r} has K = "
                    f"{w.logical_shape[1]}, not a multiple of 16"
                )
            prefix = key.removesuffix(".weight")
            tensors[prefix + ".weight"] = w.qdata
            tensors[prefix + ".weight_scale"] = w.scale
            tensors[prefix + ".weight_scale_2"] = w.global_scale.reshape(())
            quantized.add(prefix)
        elif isinstance(value, QTensor):
            raise QShardError(
                f"qshard.export(format='{NAME}'): {key!r} is a {type(value).__name__}; the "
                f"format holds NVFP4 weights"
            )
        else:
            tensors[key] = value
    excluded = unquantized_modules(state, linear_names, quantized)
    quantization = {
        "quant_algo": WEIGHT_ONLY_ALGO,
        "group_size": GROUP,
        "exclude_modules": excluded,
        "kv_cache_quant_algo": None,
    }
    hf_quant = {"producer": {"name": "qshard"}, "quantization": quantization}
    return tensors, {}, {HF_QUANT_CONFIG: hf_quant}
