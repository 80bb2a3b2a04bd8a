"""Other producers' quantized checkpoints: load them into qshard layouts with no float round
trip, and export qshard-quantized models to them (docs/design.md, "Formats").

    state = qshard.load_pretrained("DeepSeek-V3-dir")              # state_dict of QTensors
    model = qshard.load_pretrained("dir", model=meta_model)        # into a model
    qshard.export(model, "out-dir", format="compressed-tensors")   # vLLM / SGLang can serve it

Formats, one file each (detect from config.json / hf_quant_config.json, load, export):
`deepseek-fp8` (DeepSeek-V3/R1, Qwen3-FP8 block FP8), `modelopt-nvfp4` (NVIDIA ModelOpt),
`compressed-tensors` (pack-quantized int4, nvfp4-pack-quantized, float-quantized FP8 per
channel, per tensor and in blocks), `fbgemm-fp8` (Meta's / Hugging Face's row-wise FP8),
`gpt-oss-mxfp4` and `torchao` (Float8Tensor per row, per tensor and in blocks; Int4Tensor;
load only).
Mixture-of-experts checkpoints load into transformers' fused 3-D experts (`...mlp.experts.
gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; gpt-oss's transposed [E, in, out]) as 3-D
QTensors, and export writes them back per expert as each format stores them (`experts.py`).
Each maps the stored codes and scales into the layout as they are (the tests check every
format's dequantization formula, written out from its spec, against the loaded layout).
"""

from __future__ import annotations

import os
import pathlib

import torch
from torch import nn

from ..errors import CheckpointError, NotQuantizedError, QShardError
from ..io.loading import load, load_into
from ..io.saving import QUANTIZATION_CONFIG_NAME, checked_state_dict, full_tensor
from ..qtensor import QTensor
from ..qtensor.validation import check_qtensor
from ..targets import quantization_targets
from . import (
    compressed_tensors,
    deepseek_fp8,
    experts,
    fbgemm_fp8,
    gpt_oss_mxfp4,
    modelopt_nvfp4,
    torchao,
)
from .source import MemorySource, SafetensorsDir, read_json, write_directory

__all__ = ["EXPORT_FORMATS", "FORMATS", "detect_format", "export", "load_pretrained"]

FORMATS = {
    m.NAME: m
    for m in (deepseek_fp8, modelopt_nvfp4, compressed_tensors, fbgemm_fp8, gpt_oss_mxfp4, torchao)
}
EXPORT_FORMATS = (
    "deepseek-fp8",
    "modelopt-nvfp4",
    "compressed-tensors",
    "fbgemm-fp8",
    "gpt-oss-mxfp4",
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


QSHARD = "qshard"  # qshard's own checkpoints, for load_pretrained(format=...)


def _is_qshard(directory: pathlib.Path) -> bool:
    for path, key in (
        (directory / QUANTIZATION_CONFIG_NAME, None),
        (directory / "config.json", "quantization_config"),
    ):
        data = read_json(path)
        data = data.get(key) if isinstance(data, dict) and key else data
        if _names_qshard(data):
            return True
    return False


def _names_qshard(quantization_config) -> bool:
    return isinstance(quantization_config, dict) and (
        quantization_config.get("quant_method") == QSHARD
    )


def _format_of(directory: pathlib.Path, format: str | None) -> str:
    """The format `load_pretrained` reads `directory` as: `format` checked, or detected."""
    if format is None:
        return QSHARD if _is_qshard(directory) else detect_format(directory)
    if format not in (*FORMATS, QSHARD):
        raise QShardError(
            f"qshard.load_pretrained: format={format!r} is not one of {[*FORMATS, QSHARD]}"
        )
    is_qshard = _is_qshard(directory)
    if format == QSHARD:
        matches = is_qshard
    else:
        matches = not is_qshard and FORMATS[format].detect(*_configs(directory))
    if not matches:
        found = QSHARD if is_qshard else None
        try:
            found = found or detect_format(directory)
        except CheckpointError:
            found = "no format qshard reads"
        raise CheckpointError(
            f"{directory}: format={format!r} was asked for, and the "
            f"directory's config files say {found!r}; pass that format, or "
            f"leave format out to detect it"
        )
    return format


def detect_format(model_dir: str | os.PathLike) -> str:
    """The name of the quantized format of another tool's Hugging Face model directory."""
    directory = pathlib.Path(model_dir)
    config, hf_quant = _configs(directory)
    found = [name for name, fmt in FORMATS.items() if fmt.detect(config, hf_quant)]
    if not found:
        qc = config.get("quantization_config")
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise CheckpointError(
            f"{directory}: no quantized format qshard reads (config.json quant_method "
            f"{method!r}, hf_quant_config.json {'present' if hf_quant else 'absent'}); known: "
            f"{list(FORMATS)}. A float model is quantized with qshard.quantize_"
        )
    return found[0]


def _configs(directory: pathlib.Path) -> tuple[dict, dict | None]:
    config = read_json(directory / "config.json")
    if config is None:
        raise CheckpointError(f"{directory}: no config.json (a Hugging Face model directory)")
    return config, read_json(directory / modelopt_nvfp4.HF_QUANT_CONFIG)


def load_pretrained(
    model_dir: str | os.PathLike,
    model: nn.Module | None = None,
    device: torch.device | str | None = None,
    mesh=None,
    plan=None,
    format: str | None = None,
):
    """Load a quantized checkpoint another tool wrote (see `FORMATS`), its codes and scales
    mapped into qshard layouts bit for bit, or a qshard checkpoint (`qshard.save`,
    `qshard quantize`: read by `qshard.load`).

    Without `model`: a state_dict (QTensors for the quantized linears, the stored tensors for
    the rest) on `device` (default CPU). With `model` (built on the meta device, say): loaded
    into it, keys and shapes checked before anything changes, and returned; with `mesh` and
    `plan` as well, each rank keeps its slices (as qshard.load(mesh=, plan=) does).
    `format`: one of `FORMATS` or "qshard"; by default detected from the directory's config
    files. A directory that is not of the format given is refused (CheckpointError).
    """
    directory = pathlib.Path(model_dir)
    name = _format_of(directory, format)
    if name == QSHARD:
        return load(directory, model, device, mesh, plan)
    config, hf_quant = _configs(directory)
    dtype_name = config.get("torch_dtype") or config.get("dtype")
    # bf16 when config.json names none (or "auto"): the dtype quantized checkpoints run in
    dtype = torch.bfloat16 if dtype_name in (None, "auto") else None
    if isinstance(dtype_name, str) and dtype_name in DTYPES:
        dtype = DTYPES[dtype_name]
    if dtype is None:
        raise CheckpointError(
            f"{directory / 'config.json'}: torch_dtype {dtype_name!r} is not one of {list(DTYPES)}"
        )
    state = FORMATS[name].load(SafetensorsDir(directory), config, hf_quant, dtype)
    # Per-expert linears into the model's fused 3-D experts (all of them without a model)
    targets = None if model is None else model.state_dict(keep_vars=True)
    state = experts.rename_legacy_experts(state, targets)  # Mixtral's block_sparse_moe...w1
    state = experts.fuse_experts(state, str(directory), targets)
    check_state(state, directory, name)
    if targets is not None:
        experts.check_fit(state, targets, str(directory))
    if model is None:
        if mesh is not None or plan is not None:
            raise QShardError("qshard.load_pretrained: mesh and plan shard a model; pass model=")
        device = torch.device("cpu") if device is None else torch.device(device)
        return {k: v.to(device) if v.device != device else v for k, v in state.items()}
    if (mesh is None) != (plan is None):
        raise QShardError("qshard.load_pretrained: pass both mesh and plan, or neither")
    return load_into(MemorySource(state), model, device, mesh, plan, strict=True)


# Tensors a format stores beside its quantized weights: left in a loaded state_dict as plain
# tensors, they would be quantized codes or scales read as numbers (issue 21).
QUANTIZATION_SUFFIXES = (
    ".weight_scale",
    ".weight_scale_inv",
    ".weight_scale_2",
    ".weight_packed",
    ".weight_zero_point",
    ".weight_global_scale",
    ".weight_shape",
    ".weight_g_idx",
)
# Names other models may use for float tensors too: quantization data only when not float.
PACKED_SUFFIXES = (".qdata", "_blocks", "_scales")
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)


def check_state(state: dict, directory: pathlib.Path, name: str) -> None:
    """The one validation every reader runs (docs/design.md invariant 9) on a format's state_dict:
    each QTensor through `check_qtensor` (attributes, inner shapes and dtypes, finite scales and
    codes, zero points, finite dequantized values), and no plain tensor that is quantized data
    the format did not map to a layout (float8 or integer weights, scale or packed tensors)."""
    for key, value in state.items():
        where = f"{directory}: {key}"
        if isinstance(value, QTensor):  # (made for its device: checked as stored)
            check_qtensor(value.canonical(), where)
            continue
        if value.dtype in FLOAT8_DTYPES:
            why = f"a {value.dtype} tensor"
        elif key.endswith(".weight") and not value.dtype.is_floating_point:
            why = f"an integer ({value.dtype}) weight"
        elif key.endswith(QUANTIZATION_SUFFIXES) or (
            key.endswith(PACKED_SUFFIXES) and not value.dtype.is_floating_point
        ):
            why = f"a quantization tensor ({value.dtype}, by its name)"
        else:
            continue
        raise CheckpointError(
            f"{where}: {why} {list(value.shape)} that the {name} reader did not map to a qshard "
            f"layout, so it would load as raw codes or scales. The checkpoint uses a scheme "
            f"qshard does not read, or the tensors that go with it are missing"
        )


def export(
    model: nn.Module | dict,
    out_dir: str | os.PathLike,
    format: str,
    config: dict | None = None,
) -> pathlib.Path:
    """Write a qshard-quantized model (or state_dict) as a `format` checkpoint in `out_dir` (a
    new or empty directory): model.safetensors, config.json (`config`, or the model's own
    `config.to_dict()`, with the format's quantization_config) and the format's other files.
    Everything is checked before anything is written, and the directory appears whole."""
    if format not in EXPORT_FORMATS:
        raise QShardError(f"qshard.export: format {format!r} is not one of {list(EXPORT_FORMATS)}")
    state = {k: full_tensor(v) for k, v in checked_state_dict(model).items()}
    if not any(isinstance(v, QTensor) for v in state.values()):
        raise NotQuantizedError(
            f"qshard.export: the model holds no quantized weight ({len(state)} tensors, none a "
            f"QTensor), so the {format} checkpoint would be a float model labelled quantized. "
            f"Quantize it first, qshard.quantize_(model, config), and check the report: it "
            f"keeps embeddings and output heads in float and lists every skipped module"
        )
    if format != gpt_oss_mxfp4.NAME:  # its experts stay 3-D; the others store per-expert linears
        transposed = set()  # experts parameters stored [E, in, out] (float ones say it nowhere)
        if isinstance(model, nn.Module):
            transposed = {t.name for t in quantization_targets(model) if t.transposed}
        state = experts.split_experts(state, format, transposed)
    linear_names = []
    if isinstance(model, nn.Module):
        linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    tensors, config_update, files = FORMATS[format].export(state, linear_names)
    if config is None:
        own = getattr(model, "config", None)
        config = own.to_dict() if hasattr(own, "to_dict") else dict(own or {})
    # A model quantized by quantize_ carries qshard's own quantization_config (for
    # save_pretrained): the exported checkpoint is the format's, which its readers must not
    # mistake for qshard's (a format whose config.json has none would keep it otherwise).
    if _names_qshard(config.get("quantization_config")):
        config = {k: v for k, v in config.items() if k != "quantization_config"}
    return write_directory(out_dir, tensors, {"config.json": {**config, **config_update}, **files})
