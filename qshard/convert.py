"""`qshard quantize` and `qshard inspect`: a Hugging Face safetensors model directory quantized
tensor by tensor into a qshard checkpoint, and a checkpoint's contents summarized.

Quantizing reads one float tensor at a time and keeps only the quantized results, so the whole
float model is never in memory. Which tensors are linear weights is decided by name and shape,
as there is no model object: every 2-D `*.weight` except those matching `--exclude`
(embeddings, output heads and norms by default).
"""

from __future__ import annotations

import fnmatch
import os
import pathlib
import sys

from .errors import QShardError
from .formats.source import SafetensorsDir, read_json
from .io import save
from .layouts import (
    Fp8BlockwiseConfig,
    Fp8RowwiseConfig,
    Int4WeightOnlyConfig,
    MXFP4WeightOnlyConfig,
    NVFP4WeightOnlyConfig,
)
from .qtensor import FLOAT_DTYPES, QTensor, stored_nbytes

__all__ = ["CONFIGS", "DEFAULT_EXCLUDE", "inspect_checkpoint", "quantize_directory"]

CONFIGS = {
    "fp8-block": Fp8BlockwiseConfig,
    "fp8-row": Fp8RowwiseConfig,
    "int4-g128": Int4WeightOnlyConfig,
    "int4-g64": lambda: Int4WeightOnlyConfig(group_size=64),
    "nvfp4": NVFP4WeightOnlyConfig,
    "mxfp4": MXFP4WeightOnlyConfig,
}
# Module-name patterns left in float: embeddings, output heads, norms (as the checkpoints of
# facts.md §5 leave them).
DEFAULT_EXCLUDE = ("*embed*", "*lm_head*", "*norm*", "*LayerNorm*", "*pooler*")


def _is_excluded(module: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def quantize_directory(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: str,
    exclude=DEFAULT_EXCLUDE,
    progress: bool = True,
) -> dict[str, list[str]]:
    """Quantize the linear weights of a Hugging Face directory into a qshard checkpoint at
    `out_dir` (`qshard.save`'s files), with a progress bar on stderr. Returns {"quantized":
    [...], "kept": [...]}."""
    progress = sys.stderr if progress else None
    if config not in CONFIGS:
        raise QShardError(f"qshard quantize: --config {config!r} is not one of {list(CONFIGS)}")
    quant_config = CONFIGS[config]()
    config_json = read_json(pathlib.Path(model_dir) / "config.json") or {}
    if config_json.get("quantization_config"):
        method = config_json["quantization_config"].get("quant_method")
        raise QShardError(
            f"qshard quantize: {model_dir} is quantized already (quant_method {method!r}); "
            f"load it with qshard.load_pretrained, or quantize its float checkpoint"
        )
    reader = SafetensorsDir(model_dir)
    names = reader.names()
    state, done = {}, {"quantized": [], "kept": []}
    for i, name in enumerate(names, 1):
        tensor = reader.get(name)
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and tensor.dim() == 2 and tensor.dtype in FLOAT_DTYPES
        if linear and not _is_excluded(module, exclude):
            state[name] = _layout_for(quant_config).from_float(tensor, quant_config)
            done["quantized"].append(name)
        else:
            state[name] = tensor
            done["kept"].append(name)
        if progress is not None:
            bar = "#" * (30 * i // len(names))
            progress.write(f"\r[{bar:<30}] {i}/{len(names)} {name[:60]:<60}")
            progress.flush()
    if progress is not None:
        progress.write("\n")
    save(state, out_dir)
    return done


def _layout_for(config) -> type[QTensor]:
    from .layouts.registry import config_class_of, registered_layouts

    return next(c for c in registered_layouts() if config_class_of(c) is type(config))


def inspect_checkpoint(path: str | os.PathLike, out=None) -> dict:
    """Print each tensor of a checkpoint (qshard's, or a format `load_pretrained` reads): its
    layout, shape, bits per weight and bytes, then the totals and what was left unquantized."""
    from .formats import load_pretrained
    from .io import load

    out = out or sys.stdout
    directory = pathlib.Path(path)
    is_qshard = (directory / "quantization_config.json").exists() or directory.suffix in (
        ".safetensors", ".json")  # fmt: skip
    state = load(directory) if is_qshard else load_pretrained(directory)
    rows, totals = [], {"quantized": 0, "float": 0}
    for name, value in state.items():
        nbytes = stored_nbytes(value)
        if isinstance(value, QTensor):
            bits = 8 * nbytes / value.numel()
            attrs = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in value.attrs().items())
            rows.append((name, type(value).__name__, list(value.shape), f"{bits:.3f}", nbytes,
                         attrs))  # fmt: skip
            totals["quantized"] += nbytes
        else:
            rows.append((name, str(value.dtype).removeprefix("torch."), list(value.shape),
                         f"{8 * value.element_size()}", nbytes, ""))  # fmt: skip
            totals["float"] += nbytes
    out.write("| tensor | layout / dtype | shape | bits per weight | bytes | attributes |\n")
    out.write("|---|---|---|---|---|---|\n")
    for row in rows:
        out.write("| " + " | ".join(str(c) for c in row) + " |\n")
    kept = [r[0] for r in rows if not r[5] and r[0].endswith(".weight") and len(r[2]) == 2]
    out.write(
        f"\n{sum(1 for r in rows if r[5])} quantized tensors ({totals['quantized'] / 2**20:.1f} "
        f"MiB), {len(rows) - sum(1 for r in rows if r[5])} other tensors "
        f"({totals['float'] / 2**20:.1f} MiB)\n"
        f"2-D weights left unquantized: {kept if kept else 'none'}\n"
    )
    return {"rows": rows, "totals": totals, "unquantized": kept}
