"""`qshard quantize` and `qshard inspect`: a Hugging Face safetensors model directory quantized
tensor by tensor into a qshard checkpoint, and a checkpoint's contents summarized.

Quantizing reads one float tensor at a time (an expert's gate and up together) and keeps only
the quantized results, so the whole float model is never in memory. Which tensors are quantized
is what `quantize_` would quantize on the model itself: where config.json names a transformers
architecture (and transformers is installed) that model is built on the meta device and
`quantize_`'s own selection runs on it (its nn.Linear weights and experts modules' 3-D weights,
less `--exclude` and `qshard.api.KEEP_FLOAT`: embeddings, output heads, poolers; routers,
which are no nn.Linear, stay float). Per-expert linears (`<m>.experts.{e}.gate_proj.weight`,
...) of an experts module the model holds fused are joined as transformers' loader joins them,
`<m>.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows) and
`<m>.experts.down_proj` [E, H, I]: each expert quantized alone and the experts stacked, which
is bit for bit `quantize_` of the 3-D weight (docs/design.md invariant 8). Without such a model,
every 2-D `*.weight` not excluded or kept float is quantized (by name and shape).
"""

from __future__ import annotations

import fnmatch
import json
import os
import pathlib
import shutil
import sys

import torch

from ..api import quantize_tensor
from ..errors import CheckpointError, QShardError
from ..formats import PACKED_SUFFIXES, QUANTIZATION_SUFFIXES, load_pretrained
from ..formats.experts import expert_count, expert_modules, rename_legacy_experts
from ..formats.source import SafetensorsDir
from ..io import load, save
from ..io.format import METADATA_KEY
from ..io.saving import QUANTIZATION_CONFIG_NAME
from ..qtensor import FLOAT_DTYPES, QTensor, stored_nbytes
from ..qtensor.registry import handler_for
from ..strict_json import read_json_file
from ..targets import KEEP_FLOAT, Target, check_patterns, selected_targets
from .configs import CONFIG_NAMES, config_named

__all__ = ["inspect_checkpoint", "quantize_directory"]


def is_excluded(module: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def quantize_directory(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: str,
    exclude=(),
    progress: bool = True,
    keep_float=KEEP_FLOAT,
) -> dict[str, list[str]]:
    """Quantize the linear weights of a Hugging Face directory into a qshard checkpoint at
    `out_dir` (`qshard.save`'s files), with a progress bar on stderr. Returns {"quantized":
    [...], "kept": [...], "selection": how they were chosen} (the module docstring). Names
    matching `exclude` or `keep_float` (quantize_'s rule:
    embeddings, output heads and poolers) stay float; an `exclude` pattern that matches
    no weight's module name is refused (ConfigError, before anything is written).

    Everything is checked before the first tensor is read: the input is a model directory that
    is not quantized already (by its config files and safetensors headers), and `out_dir` is
    writable, is neither the input nor inside it nor around it, and is new, empty or a qshard
    checkpoint."""
    progress = sys.stderr if progress else None
    if config not in CONFIG_NAMES:
        raise QShardError(f"qshard quantize: --config {config!r} is not one of {CONFIG_NAMES}")
    quant_config = config_named(config)
    model_dir, out_dir = pathlib.Path(model_dir), pathlib.Path(out_dir)
    _check_model_dir(model_dir)
    _check_out_dir(out_dir, model_dir)
    _refuse_quantized(model_dir, *_quantized_by_config(model_dir))
    reader = SafetensorsDir(model_dir)  # every header read and checked
    _refuse_quantized(model_dir, *_quantized_by_headers(reader))
    plan = _Plan.of(model_dir, reader.names(), exclude, keep_float)
    handler = handler_for(quant_config, "qshard quantize")
    state, done = {}, {"quantized": [], "kept": []}
    names = reader.names()
    try:
        for i, name in enumerate(names, 1):
            if name in plan.fused_keys:  # an experts module, joined at its first key
                module = plan.fused_keys[name]
                if module not in plan.joined:
                    plan.joined.add(module)
                    for key, tensor, quantized in _joined_experts(
                        reader, plan, module, handler, quant_config
                    ):
                        state[key] = tensor
                        done["quantized" if quantized else "kept"].append(key)
            else:
                tensor, key = reader.get(name), plan.rename.get(name, name)
                target = plan.target_of(key, tensor)
                if target is not None:
                    tensor = _quantized(name, handler, tensor, quant_config, target.transposed)
                state[key] = tensor
                done["quantized" if target is not None else "kept"].append(key)
            if progress is not None:
                bar = "#" * (30 * i // len(names))
                progress.write(f"\r[{bar:<30}] {i}/{len(names)} {name[:60]:<60}")
                progress.flush()
    finally:  # end the bar's line, also before an error message
        if progress is not None:
            progress.write("\n")
    save(state, out_dir)
    _complete_model_directory(model_dir, out_dir)
    done["selection"] = plan.basis
    return done


class _Plan:
    """Which checkpoint tensors `qshard quantize` quantizes, and which per-expert keys it joins."""

    def __init__(self, targets: dict[str, Target] | None, exclude, fused: dict[str, dict]):
        self.targets = targets  # {target name: Target} (None: no model; by name and shape)
        self.exclude = exclude
        self.fused = fused  # {experts module: {projection: {expert: key}}}
        self.fused_keys = {k: m for m, p in fused.items() for ks in p.values() for k in ks.values()}
        self.joined: set[str] = set()
        self.basis = ""  # how the tensors were chosen, for the command's summary
        self.rename: dict[str, str] = {}  # {stored key: the model's name for it}

    @classmethod
    def of(cls, model_dir: pathlib.Path, names: list[str], exclude, keep_float) -> _Plan:
        model, why_not = _meta_model(model_dir)
        if model is None:
            plan = cls.of_names(names, exclude, keep_float)
            plan.basis = f"by name and shape ({why_not})"
            return plan
        chosen = selected_targets(model, exclude, keep_float, "qshard quantize", prefix="--")
        selected = {t.name: t for t in chosen}
        held = {name for name, _ in model.named_parameters()}
        # Mixtral's older names (block_sparse_moe, w1 / w3 / w2) as the model names them
        renamed = rename_legacy_experts({n: n for n in names}, wanted=held)  # {new: stored}
        modules = expert_modules(renamed)
        fused = {
            m: {proj: {e: renamed[k] for e, k in keys.items()} for proj, keys in p.items()}
            for m, p in modules.items()
            if f"{m}.gate_up_proj" in held
        }
        experts_of = {f"{m}.{w}" for m in fused for w in ("gate_up_proj", "down_proj")}
        missing = [
            t
            for t in selected
            if t not in experts_of and t not in renamed and f"{t}.weight" not in renamed
        ]
        if missing:  # the stored keys are not the model's names (another prefix, say)
            model_free = cls.of_names(names, exclude, keep_float)
            model_free.basis = (
                f"by name and shape (the checkpoint has no {missing[0]!r} of "
                f"{type(model).__name__}: its keys are not the model's names)"
            )
            return model_free
        plan = cls(selected, (), fused)
        plan.rename = {stored: new for new, stored in renamed.items() if new != stored}
        plan.basis = f"as quantize_ selects on {type(model).__name__}"
        return plan

    @classmethod
    def of_names(cls, names: list[str], exclude, keep_float) -> _Plan:
        """Without a model: every 2-D float `*.weight` not excluded or kept float."""
        modules = [n.removesuffix(".weight") for n in names if n.endswith(".weight")]
        check_patterns(modules, None, exclude, "qshard quantize", prefix="--")
        return cls(None, (*exclude, *keep_float), {})

    def target_of(self, key: str, tensor: torch.Tensor) -> Target | None:
        """The Target a stored tensor is quantized as, or None (kept as it is)."""
        if tensor.dtype not in FLOAT_DTYPES:
            return None
        if self.targets is None:
            module = key.removesuffix(".weight")
            linear = key.endswith(".weight") and tensor.dim() == 2
            return (
                Target(module, None, "weight")
                if linear and not is_excluded(module, self.exclude)
                else None
            )
        target = self.targets.get(key.removesuffix(".weight")) if key.endswith(".weight") else None
        if target is not None and target.param == "weight" and tensor.dim() == 2:
            return target
        target = self.targets.get(key)  # an experts module's 3-D weight, stored fused
        return target if target is not None and tensor.dim() == 3 else None


def _quantized(name: str, handler, tensor, config, transposed: bool = False):
    """quantize_tensor, its errors (a NaN weight, say) naming the checkpoint's tensor."""
    try:
        return quantize_tensor(handler, tensor, config, transposed)
    except QShardError as e:
        raise type(e)(f"qshard quantize: {name}: {e}") from None


def _meta_model(model_dir: pathlib.Path):
    """(the transformers model config.json describes, built on the meta device, None), or
    (None, why not: no config.json, no architecture transformers knows, no transformers)."""
    if not (model_dir / "config.json").is_file():
        return None, "no config.json"
    try:
        import transformers  # optional: for a model directory
    except ImportError:
        return None, "transformers is not installed: pip install transformers"
    # Any failure here (a model_type this transformers does not know, remote code, a config
    # its class refuses) leaves the name-and-shape rule, and the command's summary says why.
    try:
        config = transformers.AutoConfig.from_pretrained(model_dir)
        architectures = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, architectures[0], None) if architectures else None
        if model_class is None:
            return None, f"config.json names no architecture transformers has ({architectures})"
        with torch.device("meta"):
            return model_class(config), None
    except Exception as e:
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        return None, f"transformers {transformers.__version__} builds no model from it: {first}"


def _joined_experts(reader, plan: _Plan, module: str, handler, config):
    """(key, tensor, quantized?) of an experts module's joined weights, read an expert at a
    time: gate_up_proj [E, 2I, H] from each expert's [gate; up], down_proj [E, H, I]; each
    expert quantized alone (as quantize_ of the 3-D weight quantizes it) if its target is
    selected, then the experts stacked."""
    projections = plan.fused[module]
    experts = expert_count(module, projections, "qshard quantize")
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        target = plan.targets.get(f"{module}.{fused}")
        pieces = []
        for e in range(experts):
            keys = [projections[p][e] for p in parts]
            weight = torch.cat([reader.get(key) for key in keys])
            if target is not None:
                weight = _quantized(" + ".join(keys), handler, weight, config)
            pieces.append(weight)
        joined = QTensor.stack_experts(pieces) if target is not None else torch.stack(pieces)
        yield f"{module}.{fused}", joined, target is not None


# Files of a model directory that are weights or quantization configs: not copied to the output.
_NOT_COPIED = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.h5",
    "*.msgpack",
    "*.gguf",
    "*.onnx",
    ".*",
    "config.json",
    QUANTIZATION_CONFIG_NAME,
    "hf_quant_config.json",
)


def _complete_model_directory(model_dir: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Make `out_dir` a model directory transformers loads (`from_pretrained`, which reads it
    through qshard's quantizer, integrations/transformers.py): the input's config.json with
    `quantization_config` (qshard's, as save wrote it), and the input's other files
    (tokenizer, generation config, chat template) copied. Each file is written under a
    temporary name and renamed, so none is ever half there."""
    config_path = model_dir / "config.json"
    if config_path.is_file():
        config = read_json_file(config_path)
        config["quantization_config"] = read_json_file(out_dir / QUANTIZATION_CONFIG_NAME)
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        _replace(out_dir / "config.json", lambda tmp: tmp.write_text(text))
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and not any(fnmatch.fnmatch(path.name, p) for p in _NOT_COPIED):
            _replace(out_dir / path.name, lambda tmp, src=path: shutil.copyfile(src, tmp))


def _replace(final: pathlib.Path, write) -> None:
    temporary = final.with_name(f".{final.name}.qshard-tmp")
    try:
        write(temporary)
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)


def _check_model_dir(model_dir: pathlib.Path) -> None:
    """`model_dir` is a directory holding config.json or *.safetensors."""
    if not model_dir.exists():
        raise QShardError(
            f"qshard quantize: {model_dir} does not exist; pass a Hugging Face "
            f"model directory (config.json and *.safetensors)"
        )
    if not model_dir.is_dir():
        raise QShardError(
            f"qshard quantize: {model_dir} is not a directory; pass the model "
            f"directory that holds it"
        )
    if not (model_dir / "config.json").is_file() and not any(model_dir.glob("*.safetensors")):
        raise QShardError(
            f"qshard quantize: {model_dir} holds neither config.json nor "
            f"*.safetensors; pass a Hugging Face model directory"
        )


def _check_out_dir(out_dir: pathlib.Path, model_dir: pathlib.Path) -> None:
    """`out_dir` can be written, does not overlap `model_dir` (saving into the input would
    replace or delete its float files), and holds nothing but an earlier qshard checkpoint."""
    out, model = out_dir.resolve(), model_dir.resolve()  # symlinks and ".." followed
    where = None
    if out == model or _same_dir(out, model):
        where = "is the input directory"
    elif out.is_relative_to(model) or any(_same_dir(p, model) for p in out.parents):
        where = "lies inside the input directory"
    elif model.is_relative_to(out) or any(_same_dir(out, p) for p in model.parents):
        where = "contains the input directory"
    if where:
        raise QShardError(
            f"qshard quantize: --out {out_dir} {where} {model_dir}; writing "
            f"there would replace or delete the files being read. Choose an "
            f"--out outside it"
        )
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise QShardError(
            f"qshard quantize: --out {out_dir}: {existing} is a file, not a "
            f"directory; choose a new directory for --out"
        )
    if existing == out and any(out.iterdir()) and not (out / QUANTIZATION_CONFIG_NAME).exists():
        raise QShardError(
            f"qshard quantize: --out {out_dir} is not empty and is not a qshard "
            f"checkpoint; choose a new or empty directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise QShardError(
            f"qshard quantize: cannot write to {existing} (permission denied) "
            f"for --out {out_dir}; choose a directory you can write to"
        )


def _same_dir(a: pathlib.Path, b: pathlib.Path) -> bool:
    """The same directory by device and inode (bind mounts, case-insensitive file systems)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


# Names of the stored parts of quantized weights: those of the formats load_pretrained reads
# (docs/design.md, "Formats"), and of static input scales, torchao's `_weight_qdata`, GPTQ / AWQ and
# bitsandbytes. A float model has none of them, in any dtype.
QUANTIZED_SUFFIXES = (
    *QUANTIZATION_SUFFIXES,
    *PACKED_SUFFIXES,
    ".input_scale",
    "_qdata",
    ".qweight",
    ".qzeros",
    ".absmax",
    ".quant_map",
    ".SCB",
)


def _refuse_quantized(model_dir: pathlib.Path, own: bool, reason: str | None) -> None:
    """CheckpointError if `reason` says `model_dir` holds a quantized checkpoint (qshard's own,
    or another producer's): its codes and scales quantized as if they were float weights would
    be garbage."""
    if reason is None:
        return
    if own:
        how = f"a qshard checkpoint ({reason}); load it with qshard.load('{model_dir}', model)"
    else:
        how = f"({reason}); load it with qshard.load_pretrained('{model_dir}')"
    raise CheckpointError(
        f"qshard quantize: {model_dir} is quantized already, {how}, or "
        f"quantize the float checkpoint it was made from"
    )


def _is_float_model(directory: pathlib.Path) -> bool:
    """Neither its config files nor its safetensors headers say it is quantized."""
    if _quantized_by_config(directory)[1] is not None:
        return False
    try:
        reader = SafetensorsDir(directory)
    except CheckpointError:  # no safetensors here: let the reader say what is wrong
        return False
    return _quantized_by_headers(reader)[1] is None


def _quantized_by_config(model_dir: pathlib.Path) -> tuple[bool, str | None]:
    """(qshard's own?, why it is quantized, or None) from the directory's JSON files."""
    if (model_dir / QUANTIZATION_CONFIG_NAME).exists():
        method = read_json_file(model_dir / QUANTIZATION_CONFIG_NAME).get("quant_method")
        return method == "qshard", f"{QUANTIZATION_CONFIG_NAME} has quant_method {method!r}"
    if (model_dir / "config.json").exists():
        quantization = read_json_file(model_dir / "config.json").get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else None
            return False, f"config.json has a quantization_config, quant_method {method!r}"
    if (model_dir / "hf_quant_config.json").exists():
        return False, "it holds hf_quant_config.json (NVIDIA ModelOpt)"
    return False, None


def _quantized_by_headers(reader: SafetensorsDir) -> tuple[bool, str | None]:
    """(qshard's own?, why it is quantized, or None) from the safetensors headers: qshard's
    metadata, a float8 / float4 tensor, or a quantized weight part's name."""
    if METADATA_KEY in reader.metadata():
        return True, f"the safetensors header metadata has a {METADATA_KEY!r} entry"
    for key, header in reader.header_of.items():
        dtype = str(header.stored[key].dtype).removeprefix("torch.")
        if dtype.startswith(("float8", "float4")):
            return False, f"{header.path.name} holds {key!r} as {dtype}"
        if key.endswith(QUANTIZED_SUFFIXES):
            return False, f"{header.path.name} holds {key!r}, the part of a quantized weight"
    return False, None


def inspect_checkpoint(path: str | os.PathLike, out=None) -> dict:
    """Print each tensor of a checkpoint (qshard's, or a format `load_pretrained` reads): its
    layout, shape, bits per weight and bytes, then the totals and what was left unquantized."""
    out = out or sys.stdout
    directory = pathlib.Path(path)
    if not directory.exists():
        raise QShardError(
            f"qshard inspect: {directory} does not exist; pass a qshard checkpoint "
            f"or a quantized Hugging Face model directory"
        )
    is_qshard = (directory / "quantization_config.json").exists() or directory.suffix in (
        ".safetensors",
        ".json",
    )
    if not is_qshard and directory.is_dir() and _is_float_model(directory):
        raise QShardError(
            f"qshard inspect: {directory} is a float model (no quantization "
            f"config, no quantized tensor); quantize it first: qshard quantize "
            f"{directory} --config fp8-block --out OUT, then qshard inspect "
            f"OUT"
        )
    state = load(directory) if is_qshard else load_pretrained(directory)
    rows, totals = [], {"quantized": 0, "float": 0}
    for name, value in state.items():
        nbytes = stored_nbytes(value)
        if isinstance(value, QTensor):
            bits = 8 * nbytes / value.numel()
            attrs = ", ".join(f"{k}={getattr(v, 'value', v)}" for k, v in value.attrs().items())
            rows.append(
                (name, type(value).__name__, list(value.shape), f"{bits:.3f}", nbytes, attrs)
            )
            totals["quantized"] += nbytes
        else:
            rows.append(
                (
                    name,
                    str(value.dtype).removeprefix("torch."),
                    list(value.shape),
                    f"{8 * value.element_size()}",
                    nbytes,
                    "",
                )
            )
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
