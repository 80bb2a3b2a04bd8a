"""DeepSeek-V3/R1 and Qwen3-FP8 block FP8 checkpoints (docs/design.md, "Formats") <->
Fp8BlockwiseTensor.

config.json `quantization_config`: quant_method "fp8", fmt "e4m3", activation_scheme "dynamic",
weight_block_size [bn, bk], optionally scale_fmt "ue8m0" (power-of-two scales). A quantized
linear is `<p>.weight` float8_e4m3fn [N, K] with `<p>.weight_scale_inv` [ceil(N/bn),
ceil(K/bk)] (float32, or bfloat16 in some Qwen3 files), a *multiplier* despite its name:
W = weight * weight_scale_inv per block, partial edge blocks included. That is the layout's own
definition, so both tensors map as they are (a bf16 scale widens to fp32 exactly).
Every other tensor (embeddings, norms, lm_head, the MoE router) stays as stored.
"""

from __future__ import annotations

import torch

from ..config import ScaleFormat
from ..errors import CheckpointError, QShardError
from ..layouts import Fp8BlockwiseTensor
from ..qtensor import QTensor
from .configs import check_stored, quantization_config, unquantized_modules
from .experts import coarsen_or_keep
from .source import fp8_block_attrs

NAME = "deepseek-fp8"
SCALE_SUFFIX = ".weight_scale_inv"


def detect(config: dict, hf_quant: dict | None) -> bool:
    qc = quantization_config(config)
    return qc is not None and qc.raw("quant_method") == "fp8"


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    qc = quantization_config(config, str(reader.directory / "config.json"))
    qc.choice("fmt", ("e4m3",), "e4m3", note="qshard reads e4m3 weights (DeepSeek-V3, Qwen3-FP8)")
    dynamic = "qshard quantizes activations dynamically and reads no static activation scales"
    qc.choice("activation_scheme", ("dynamic",), "dynamic", note=dynamic)
    blocks = "qshard reads FP8 in blocks, e.g. [128, 128] (DeepSeek-V3); not one scale per tensor"
    block = qc.sizes("weight_block_size", 2, note=blocks)
    ue8m0 = qc.choice("scale_fmt", ("float", "ue8m0"), "float") == "ue8m0"
    scale_format = ScaleFormat.UE8M0 if ue8m0 else ScaleFormat.FP32
    attrs = fp8_block_attrs(
        block,
        False,
        scale_format,
        lambda e: qc.error("weight_block_size", list(block), f"the FP8 layout refuses it: {e}"),
    )
    state = {}
    scaled = {k[: -len(SCALE_SUFFIX)] for k in reader.names() if k.endswith(SCALE_SUFFIX)}
    orphans = sorted(p + SCALE_SUFFIX for p in scaled if p + ".weight" not in reader)
    if orphans:
        raise CheckpointError(
            f"{reader.directory}: {orphans[0]!r} has no weight beside it "
            f"({orphans[0].removesuffix(SCALE_SUFFIX)}.weight); the file is "
            f"damaged or incomplete: re-export the checkpoint"
        )
    for key in reader.names():
        prefix = key.removesuffix(".weight")
        if key.endswith(SCALE_SUFFIX):
            continue
        if key.endswith(".weight") and prefix in scaled:
            state[key] = _tensor(reader, prefix, attrs, dtype)
        else:
            state[key] = reader.get(key)
    return state


def _tensor(reader, prefix: str, attrs: dict, dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    block, ue8m0 = attrs["block_size"], attrs["scale_format"] is ScaleFormat.UE8M0
    weight = check_stored(
        where, "weight", reader.get(prefix + ".weight"), torch.float8_e4m3fn, (None, None)
    )
    n, k = weight.shape
    blocks = (-(-n // block[0]), -(-k // block[1]))
    # fp32, or bf16 (some Qwen3 files); e8m0 bytes with scale_fmt "ue8m0" (transformers' V4
    # convention). Each widens to fp32 exactly.
    scales = (torch.float32, torch.bfloat16, *((torch.float8_e8m0fnu,) if ue8m0 else ()))
    scale = check_stored(where, SCALE_SUFFIX[1:], reader.get(prefix + SCALE_SUFFIX), scales, blocks)
    # Scales must be powers of two under ue8m0: the layout's own value rule, which
    # load_pretrained's validation (check_state) runs on every tensor.
    scale = scale.float()
    tensor = Fp8BlockwiseTensor(
        {"qdata": weight, "scale": scale}, shape=(n, k), dtype=dtype, **attrs
    )
    tensor.validate()
    return tensor


def export(state: dict, linear_names: list[str]) -> tuple[dict, dict, dict]:
    """(tensors, config.json entries, other JSON files) of a state_dict whose quantized
    weights are FP8 blockwise, all with one block size (the format has one
    `weight_block_size`)."""
    tensors, quantized = {}, set()
    fp8 = [v for v in state.values() if isinstance(v, Fp8BlockwiseTensor)]
    # Weights re-blocked along N (an experts gate/up join at I, not a multiple of the block)
    # go back to the model's coarsest block where that is exact (experts.coarsen_fp8).
    coarsest = tuple(max(v.block_size[d] for v in fp8) for d in (0, 1)) if fp8 else None
    state = {
        key: coarsen_or_keep(value, coarsest)
        if isinstance(value, Fp8BlockwiseTensor) and not value.transposed
        else value
        for key, value in state.items()
    }
    for key, value in state.items():
        if isinstance(value, Fp8BlockwiseTensor):
            untransposed = value.t() if value.transposed else value
            prefix = key.removesuffix(".weight")
            tensors[prefix + ".weight"] = untransposed.qdata
            tensors[prefix + SCALE_SUFFIX] = untransposed.scale
            quantized.add(prefix)
        elif isinstance(value, QTensor):
            raise QShardError(
                f"qshard.export(format='{NAME}'): {key!r} is a {type(value).__name__}; the "
                f"format holds FP8 blockwise weights"
            )
        else:
            tensors[key] = value
    blocks = {v.block_size for v in state.values() if isinstance(v, Fp8BlockwiseTensor)}
    formats = {v.scale_format for v in state.values() if isinstance(v, Fp8BlockwiseTensor)}
    if len(blocks) != 1 or len(formats) != 1:
        raise QShardError(
            f"qshard.export(format='{NAME}'): the format has one block size and scale format "
            f"per model; this model's FP8 weights have {sorted(blocks)} / "
            f"{sorted(f.value for f in formats)} (none means no FP8 blockwise weight)"
        )
    # The linears left in float, under transformers' key (FineGrainedFP8Config): without it,
    # transformers skips only its defaults (lm_head) and makes every other nn.Linear an FP8
    # linear that expects a weight_scale_inv.
    skipped = unquantized_modules(state, linear_names, quantized)
    qc = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(blocks.pop()),
        "modules_to_not_convert": skipped,
    }
    if formats.pop() is ScaleFormat.UE8M0:
        qc["scale_fmt"] = "ue8m0"
    return tensors, {"quantization_config": qc}, {}
