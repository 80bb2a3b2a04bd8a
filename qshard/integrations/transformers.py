"""qshard models in Hugging Face transformers: `quant_method: "qshard"`.

transformers' extension points, as its own tensor-subclass quantizers (torchao) use them:

    QShardConfig          a QuantizationConfigMixin: the `quantization_config` in config.json,
                          `{"quant_method": "qshard", "qshard_version": ..., "config_groups":
                          {"group_0": {"config": <QuantConfig.to_dict()>, "targets": [...]}}}`
                          (what qshard.save writes to quantization_config.json)
    QShardHfQuantizer     an HfQuantizer: `save_pretrained` stores each QTensor as its inner
                          tensors under "<param>.<inner>" with qshard's typed header metadata
                          (`get_state_dict_and_metadata`, the format of qshard/io/format.py);
                          `from_pretrained` reads that header before loading (the model is on the
                          meta device) and rebuilds each QTensor from its inner tensors
                          (`serialized_names`, `get_load_operations`): no float weight is made.

Both are registered with `register_quantization_config` / `register_quantizer` when this module
is imported: `import qshard` imports it once transformers loads its quantizers (qshard/__init__.py),
so that `import qshard` alone never imports transformers. `qshard.quantize_` of a transformers
model attaches the quantizer (`attach`), as `from_pretrained` does, so `save_pretrained` works.

Every read goes through qshard's checks: the safetensors headers and the qshard metadata
(checksums, layouts, attributes, shapes) before anything loads, then each inner tensor's CRC-32
and `check_qtensor` (finite scales, codes, magnitudes) as it arrives. A failure is kept and
raised, typed, when loading ends (transformers would log an op's error and raise a RuntimeError
after its report), so a bad checkpoint never gives a model.

Checkpoints keep the model's own parameter names: a transformers MoE's fused 3-D experts stay
`experts.gate_up_proj.*` (transformers' per-expert renaming is not applied on save).

Size: about 550 lines: transformers' two extension points (the config and the quantizer) and
the hooks they call, which share the quantizer's state; one file per integration.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import warnings

import torch
from safetensors import safe_open
from torch import nn
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..api import quantize_, quantize_tensor
from ..config import config_from_dict
from ..errors import CheckpointError, ConfigError, QShardError, UnsupportedWeightError
from ..io import saving
from ..io.checkpoint import decode_headers, read_header
from ..io.format import Record, crc32, dtype_name
from ..qtensor import FLOAT_DTYPES, QTensor
from ..qtensor.registry import handler_for
from ..qtensor.validation import check_magnitude, check_qtensor
from ..shards import is_dtensor
from ..targets import KEEP_FLOAT, check_patterns, quantization_targets, skip_reason
from ..version import __version__

__all__ = ["QUANT_METHOD", "QShardConfig", "QShardHfQuantizer", "attach", "read_records"]

QUANT_METHOD = "qshard"


class QShardConfig(QuantizationConfigMixin):
    """The `quantization_config` of a qshard model.

    Of a checkpoint (config.json): `config_groups`, which qshard config quantized which tensors
    ({"group_i": {"config": QuantConfig.to_dict(), "targets": [names]}}), for people and tools
    reading config.json; loading reads the checkpoint's own header.

    To quantize a float checkpoint while loading it, `from_pretrained(float_dir,
    quantization_config=QShardConfig(config=qshard.Int4WeightOnlyConfig(), include=...,
    exclude=..., keep_float=...))`: each weight is quantized as it is read, selected as
    `qshard.quantize_(model, config, include=, exclude=, keep_float=)` selects it.
    """

    def __init__(
        self,
        config_groups: dict | None = None,
        qshard_version: str | None = None,
        quant_method: str = QUANT_METHOD,
        config=None,
        include: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        keep_float: list[str] | None = None,
        **unknown,
    ):
        if quant_method != QUANT_METHOD:
            raise ConfigError(f"QShardConfig: quant_method {quant_method!r} is not 'qshard'")
        if unknown:
            raise ConfigError(
                f"QShardConfig: unknown fields {sorted(unknown)} in the quantization_config "
                f"(written by qshard {qshard_version!r}?); upgrade qshard to read it"
            )
        groups = {} if config_groups is None else config_groups
        for name, group in groups.items() if isinstance(groups, dict) else [(None, None)]:
            ok = isinstance(group, dict) and isinstance(group.get("targets"), list)
            if not ok or not all(isinstance(t, str) for t in group["targets"]):
                raise ConfigError(
                    f"QShardConfig: config_groups[{name!r}] is {group!r}; expected "
                    f"{{'config': QuantConfig.to_dict(), 'targets': [tensor names]}}"
                )
            config_from_dict(group.get("config"))  # a ConfigError names what is wrong
        if isinstance(config, dict):
            config = config_from_dict(config)
        if config is not None:
            handler_for(config, "QShardConfig")  # a ConfigError for a class or unknown config
        self.quant_method = QUANT_METHOD
        self.qshard_version = qshard_version
        self.config_groups = groups
        self.config = config
        self.include, self.exclude = include, exclude
        for field, value in (
            ("include", include),
            ("exclude", exclude),
            ("keep_float", keep_float),
        ):
            patterns = [value] if isinstance(value, str) else value
            if value is not None and not (
                isinstance(patterns, list | tuple) and all(isinstance(p, str) for p in patterns)
            ):
                raise ConfigError(
                    f"QShardConfig: {field}={value!r}; pass a fnmatch pattern or a list of them, "
                    f"e.g. ['*.mlp.*']"
                )
        self.keep_float = (
            list(KEEP_FLOAT)
            if keep_float is None
            else ([keep_float] if isinstance(keep_float, str) else list(keep_float))
        )

    @classmethod
    def of_model(cls, model: nn.Module) -> QShardConfig:
        """The config groups of `model`'s QTensors (as qshard.save groups them)."""

        groups: dict[str, dict] = {}
        for name, value in model.state_dict().items():
            if isinstance(value, QTensor):
                config = value.config().to_dict()
                text = json.dumps(config, sort_keys=True)
                groups.setdefault(text, {"config": config, "targets": []})["targets"].append(name)
        named = {f"group_{i}": group for i, group in enumerate(groups.values())}
        return cls(config_groups=named, qshard_version=__version__)

    def to_dict(self) -> dict:
        out = {
            "quant_method": self.quant_method,
            "qshard_version": self.qshard_version,
            "config_groups": self.config_groups,
        }
        if self.config is not None:  # a request to quantize while loading
            out.update(
                config=self.config.to_dict(),
                include=self.include,
                exclude=self.exclude,
                keep_float=self.keep_float,
            )
        return out


class QShardHfQuantizer(HfQuantizer):
    """transformers' quantizer for qshard checkpoints (see the module docstring)."""

    requires_calibration = False

    def __init__(self, quantization_config: QShardConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.records: dict[str, Record] = {}  # model key -> its checkpoint record (pre-quantized)
        self.where: dict[str, str] = {}  # model key -> the file that holds it, for messages
        self.failures: list[Exception] = []  # raised by postprocess_model

    # ---- from_pretrained -------------------------------------------------------------------

    def validate_environment(self, device_map=None, **kwargs):
        if not self.pre_quantized and self.quantization_config.config is None:
            raise ConfigError(
                "from_pretrained(..., quantization_config=QShardConfig()) of a float checkpoint "
                "names no qshard config to quantize with; pass e.g. "
                "QShardConfig(config=qshard.Int4WeightOnlyConfig())"
            )
        places = set(device_map.values()) if isinstance(device_map, dict) else set()
        if "disk" in places:
            raise QShardError(
                "from_pretrained of a qshard checkpoint: device_map puts modules on 'disk'; "
                "qshard weights cannot be offloaded to disk. Use a device_map of devices and "
                "'cpu' only"
            )

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        """Read and check every header, and match the quantized entries with the model (still
        on the meta device): a mismatch fails here, before any tensor is read. For a float
        checkpoint, select the weights to quantize while loading."""
        if not self.pre_quantized:
            self._select_for_quantization(model)
            return
        if not checkpoint_files or not all(
            str(f).endswith(".safetensors") for f in checkpoint_files
        ):
            raise CheckpointError(
                f"from_pretrained of a qshard checkpoint: files {checkpoint_files}; qshard "
                f"checkpoints are safetensors files (model.safetensors or an index), written by "
                f"save_pretrained or qshard.save"
            )
        _check_files_inside(checkpoint_files, model)
        records, where, self.file_of_stored = read_records(checkpoint_files)
        params = dict(model.named_parameters())
        quantized = {k: r for k, r in records.items() if r.layout is not None}
        if not quantized:
            raise CheckpointError(
                f"{pathlib.Path(checkpoint_files[0]).parent}: config.json says quant_method "
                f"'qshard', but the checkpoint holds no qshard-quantized tensor (no qshard "
                f"header metadata); remove quantization_config from config.json to load it as "
                f"float, or quantize it with qshard"
            )
        prefix = f"{model.base_model_prefix}."
        for key, record in quantized.items():
            target = next(
                (k for k in (key, prefix + key, key.removeprefix(prefix)) if k in params), None
            )
            if target is None:
                raise CheckpointError(
                    f"{where[key]}: quantized entry {key!r} is no parameter of "
                    f"{type(model).__name__} (e.g. {list(params)[:3]}); the checkpoint is of "
                    f"another model class"
                )
            param = params[target]
            if tuple(record.outer_shape()) != tuple(param.shape):
                raise CheckpointError(
                    f"{where[key]}: {key!r} is {list(record.outer_shape())} in the checkpoint "
                    f"and {list(param.shape)} in {type(model).__name__}; config.json does not "
                    f"describe this checkpoint"
                )
            if param.dtype not in FLOAT_DTYPES:
                raise CheckpointError(
                    f"from_pretrained: {target!r} is {param.dtype}; a quantized weight stands for "
                    f"one of {[dtype_name(d) for d in FLOAT_DTYPES]}: pass dtype=torch.bfloat16"
                )
            self.records[target], self.where[target] = record, where[key]
        # Tensors transformers ties (tie_word_embeddings) are stored once, as qshard aliases.
        self.aliases = {k: r.alias_of for k, r in records.items() if r.alias_of in quantized}
        _check_float_tensors(records, where)

    def update_parallel_plan(self, model, plan):
        """transformers' hook before it shards the model for a tp_plan / ep_plan (preprocess_model):
        a QShardError, before any weight is read, for a style qshard does not apply to a
        quantized weight (qshard/integrations/_transformers_ops.py, `check_parallel_plans`)."""
        # transformers' loading internals (and DTensor): imported when transformers loads
        from ._transformers_ops import check_parallel_plans

        super().update_parallel_plan(model, plan)
        check_parallel_plans(self, model)

    def read_whole(self, key: str) -> dict[str, torch.Tensor]:
        """{inner name: tensor} of quantized parameter `key`, whole, from the checkpoint files:
        for a parameter transformers shards, whose inner tensors it reads cut as if they were
        the float weight (QShardDeserialize cuts the checked QTensor itself)."""

        inner = {}
        for name, stored in self.records[key].inner.items():
            with safe_open(self.file_of_stored[stored.key], "pt") as f:
                inner[name] = f.get_tensor(stored.key)
        return inner

    @property
    def serialized_names(self) -> dict[str, list[str]]:
        """{parameter name: its stored names}: "weight" -> ["weight\\.qdata", "weight\\.scale",
        ...] (regex patterns, as transformers compiles them) for every quantized parameter name
        of the checkpoint (Linear "weight", experts "gate_up_proj", ...)."""
        inner: dict[str, set[str]] = {}
        for key, record in self.records.items():
            inner.setdefault(key.rpartition(".")[2], set()).update(record.inner)
        return {p: [rf"{re.escape(p)}\.{n}" for n in sorted(names)] for p, names in inner.items()}

    def get_load_operations(self) -> dict:
        # transformers' loading internals (and DTensor): imported when transformers loads
        from ._transformers_ops import QShardDeserialize

        return {"deserialize": QShardDeserialize}

    def build(self, key: str, inner: dict[str, torch.Tensor], dtype: torch.dtype) -> QTensor:
        """The QTensor of model parameter `key` from its inner tensors as transformers read them,
        checked as qshard.load checks (stored dtype and shape, CRC-32, `check_qtensor`), standing
        for `dtype` (the model's)."""
        record, where = self.records[key], f"{self.where[key]}: {self.records[key].key}"
        if sorted(inner) != sorted(record.inner):
            raise CheckpointError(
                f"{where}: transformers read inner tensors {sorted(inner)}; the qshard header "
                f"lists {sorted(record.inner)}"
            )
        for name, tensor in inner.items():
            stored = record.inner[name]
            if (tensor.dtype, tuple(tensor.shape)) != (stored.dtype, tuple(stored.shape)):
                raise CheckpointError(
                    f"{where}.{name}: read as {dtype_name(tensor.dtype)}{list(tensor.shape)}; "
                    f"stored as {dtype_name(stored.dtype)}{list(stored.shape)}"
                )
            data = tensor.detach().to("cpu").contiguous()
            if stored.crc32 is not None and crc32(data) != stored.crc32:
                raise CheckpointError(
                    f"{where}.{name}: tensor {stored.key!r} does not match its checksum; the "
                    f"file is damaged, save it again"
                )
        weight = record.build({n: t.contiguous() for n, t in inner.items()})
        check_qtensor(weight, where)
        if dtype != weight.dtype:  # the model's dtype (from_pretrained's dtype=): codes unchanged
            weight = weight.with_changes(dtype=dtype, fresh=True)
            check_magnitude(weight, f"{where} as {dtype_name(dtype)}")
        return weight.repack_for_device()

    # ---- from_pretrained of a float checkpoint: quantized while loading ---------------------

    def _select_for_quantization(self, model) -> None:
        """{parameter name: its Target} of the weights quantize_ would quantize, by the same
        rule (include / exclude / keep_float; a pattern matching nothing raises ConfigError).
        Tied parameters are left to `_finish_quantization`: quantize_ decides for them once
        transformers has tied them (it refuses a weight tied to one it does not quantize)."""
        qc = self.quantization_config
        self.handler = handler_for(qc.config, "from_pretrained")
        self.skipped: dict[str, str] = {}  # weight name -> why it stayed float
        targets = quantization_targets(model)
        check_patterns([t.name for t in targets], qc.include, qc.exclude, "from_pretrained")
        tied = getattr(model, "all_tied_weights_keys", None) or {}
        tied = set(tied) | set(tied.values())
        self.selected, self.tied = {}, {}
        for target in targets:
            if skip_reason(target, qc.include, qc.exclude, None, qc.keep_float) is not None:
                continue
            # A Linear's weight is "<module>.weight"; an experts target is named by its param.
            linear = isinstance(target.module, nn.Linear)
            key = f"{target.name}.{target.param}".lstrip(".") if linear else target.name
            (self.tied if key in tied else self.selected)[key] = target

    def param_needs_quantization(self, model, param_name: str, **kwargs) -> bool:
        return not self.pre_quantized and param_name in getattr(self, "selected", {})

    def get_quantize_ops(self):
        # transformers' loading internals (and DTensor): imported when transformers loads
        from ._transformers_ops import QShardQuantize

        return QShardQuantize(self)

    def quantize(self, key: str, value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The checkpoint's float tensor of parameter `key`, as the model's dtype (`target` is
        its meta parameter), quantized as quantize_ quantizes it; the float tensor itself when
        the layout cannot take this weight (UnsupportedWeightError: kept in `skipped`, warned
        about once loading ends, as quantize_ reports it)."""
        if tuple(value.shape) != tuple(target.shape):  # transformers skips its own check here
            raise CheckpointError(
                f"from_pretrained: {key!r} is {list(value.shape)} in the checkpoint and "
                f"{list(target.shape)} in the model; config.json does not describe this "
                f"checkpoint"
            )
        selected = self.selected[key]
        weight = value.to(target.dtype)
        try:
            return quantize_tensor(
                self.handler, weight, self.quantization_config.config, selected.transposed
            )
        except UnsupportedWeightError as e:
            self.skipped[selected.name] = str(e)
            return weight
        except QShardError as e:
            raise type(e)(f"from_pretrained: quantizing {key!r}: {e}") from e

    def _finish_quantization(self, model) -> None:
        """Quantize what loading left in float (tied weights, or one the checkpoint lacks and
        transformers initialized) with quantize_ itself, say which weights stayed float and
        why, then describe the model as a qshard checkpoint, so save_pretrained writes one."""

        qc = self.quantization_config
        left = {**self.selected, **self.tied}
        names = {t.name for k, t in left.items() if not isinstance(model.get_parameter(k), QTensor)}
        names -= set(self.skipped)
        if names:
            report = quantize_(model, qc.config, include=sorted(names), keep_float=qc.keep_float)
            self.skipped.update({s.name: s.reason for s in report.skipped if s.name in names})
        if self.skipped:
            lines = "; ".join(f"{name}: {why}" for name, why in sorted(self.skipped.items()))
            warnings.warn(
                f"from_pretrained with a QShardConfig: {len(self.skipped)} selected "
                f"weights stayed float: {lines}",
                stacklevel=2,
            )
        self.pre_quantized = True
        self.quantization_config = QShardConfig.of_model(model)
        model.config.quantization_config = self.quantization_config

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.failures:  # kept by QShardDeserialize / QShardQuantize: the first, typed
            raise self.failures[0]
        if not self.pre_quantized:
            self._finish_quantization(model)
            return model
        params = dict(model.named_parameters(remove_duplicate=False))
        expected = list(self.records) + [k for k in getattr(self, "aliases", {}) if k in params]
        # under a tp_plan, a sharded weight is a DTensor of this rank's QTensor
        local = {k: p.to_local() if is_dtensor(p) else p for k, p in params.items()}
        left = [k for k in expected if not isinstance(local.get(k), QTensor)]
        if left:
            raise CheckpointError(
                f"from_pretrained of a qshard checkpoint: {left[:5]} ({len(left)} in all) were "
                f"not loaded as quantized weights; the checkpoint and the model class disagree"
            )
        return model

    # ---- save_pretrained -------------------------------------------------------------------

    def get_state_dict_and_metadata(self, model):
        """({stored name: plain tensor}, safetensors metadata): each QTensor as its inner tensors
        "<param>.<inner>", with qshard's header (checksums, layouts, attributes; tied weights as
        aliases), the very format qshard.save writes (qshard/io/format.py)."""
        state = model.state_dict()
        if any(is_dtensor(v) for v in state.values()):
            raise QShardError(
                f"save_pretrained of {type(model).__name__}: its weights are sharded (DTensor); "
                f"qshard saves sharded models with qshard.save(model, directory), which gathers "
                f"them (config.json: model.config.save_pretrained(directory))"
            )
        state = saving.checked_state_dict(state)  # meta, dtypes, reserved keys, registered layouts
        failure = saving._invalid_quantized(state)  # what a reader would refuse is not written
        if failure is not None:
            raise failure
        entries = saving._plan_entries(state)
        tensors, metadata = saving._file_contents(entries, __version__, secrets.token_hex(8))
        # config.json (written after this call) describes the weights being saved.
        self.quantization_config = QShardConfig.of_model(model)
        model.config.quantization_config = self.quantization_config
        # Keep the model's names: reverting transformers' load-time conversions would split
        # fused experts per expert, for which no qshard record exists.
        model._weight_conversions = []
        return tensors, metadata

    def is_serializable(self, safe_serialization=None) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def _check_float_tensors(records: dict[str, Record], where: dict[str, str]) -> None:
    """CheckpointError if a float tensor of the checkpoint does not match its CRC-32 in the
    qshard header: transformers loads the float tensors itself, so they are verified here,
    before any is read into the model, as qshard.load verifies every tensor (docs/design.md,
    invariant 9). Costs one more read of the float tensors (the page cache usually has it)."""

    by_file: dict[str, list] = {}
    for key, record in records.items():
        if record.layout is None and record.tensor is not None and record.tensor.crc32 is not None:
            by_file.setdefault(where[key], []).append(record.tensor)
    for path, stored in by_file.items():
        with safe_open(path, "pt") as f:
            for tensor in stored:
                if crc32(f.get_tensor(tensor.key).contiguous()) != tensor.crc32:
                    raise CheckpointError(
                        f"{path}: tensor {tensor.key!r} does not match its checksum; the file is "
                        f"damaged, save it again"
                    )


def _check_files_inside(files, model: nn.Module) -> None:
    """CheckpointError unless every file lies in one directory, the checkpoint's own, as
    qshard.load reads only there: transformers opens what the index names, `../x` and absolute
    paths too. Where from_pretrained was given a local directory (config._name_or_path), that
    directory must hold it (itself or a subfolder=)."""
    parents = [os.path.dirname(os.path.abspath(f)) for f in files]
    home = parents[0] if len(set(parents)) == 1 else None  # one directory, as an index's files
    named = getattr(getattr(model, "config", None), "_name_or_path", None)
    if home is not None and named and os.path.isdir(named):  # inside it (a subfolder= too)
        root = os.path.abspath(named)
        home = home if home == root or home.startswith(root + os.sep) else None
    if home is None:
        where = os.path.abspath(named) if named else parents[0]
        outside = ", ".join(str(f) for f in files[:3])
        raise CheckpointError(
            f"from_pretrained of a qshard checkpoint in {where}: its index names files outside "
            f"that directory (among {outside}); a checkpoint's shards are plain file "
            f"names in its own directory. The index is damaged or crafted: re-save the model"
        )


def read_records(files) -> tuple[dict[str, Record], dict[str, str], dict[str, str]]:
    """({entry key: Record}, {entry key: the file that holds it}, {stored tensor key: its file})
    of the safetensors `files` of one checkpoint, every header checked
    (`qshard.io.checkpoint.decode_headers`: one header repeated in every file by save_pretrained,
    or one per file by qshard.save)."""
    headers = [read_header(pathlib.Path(f)) for f in files]
    where = str(headers[0].path.parent if len(headers) > 1 else headers[0].path)
    records, holder = decode_headers(headers, where)
    places = {
        key: str(holder[r.stored()[0].key].path) if r.stored() else where
        for key, r in records.items()
    }
    return records, places, {key: str(header.path) for key, header in holder.items()}


def attach(model: nn.Module) -> None:
    """Make a transformers model that qshard.quantize_ quantized a qshard model for transformers,
    as from_pretrained leaves one: `model.hf_quantizer` (so that save_pretrained writes qshard's
    format), `config.quantization_config`, and `is_quantized`, which transformers' quantizers
    set (its `.half()` / `.float()` then refuse the model whichever way it was quantized;
    `model.to(dtype)` casts it either way)."""
    quantizer = QShardHfQuantizer(QShardConfig.of_model(model), pre_quantized=True)
    model.hf_quantizer = quantizer
    model.quantization_method = QUANT_METHOD
    model.is_quantized = True
    model.config.quantization_config = quantizer.quantization_config


# The oldest transformers the integration is tested with. 5.17 (the GPU image's) loads no qshard
# checkpoint: its loader never hands the quantizer's deserialize op the inner tensors (every
# quantized weight is left unloaded; 20 of the integration tests fail there, measured).
MIN_TRANSFORMERS = (5, 23)


def register() -> None:
    """Register quant_method "qshard" with transformers (once). An older transformers (whose
    loader has no conversion ops) is not registered with: qshard/__init__.py warns instead."""
    # Imported here: the transformers in sys.modules now, whose version this checks.
    import transformers

    version = tuple(int(part) for part in re.findall(r"\d+", transformers.__version__)[:2])
    if version < MIN_TRANSFORMERS:
        raise ImportError(
            f"transformers {transformers.__version__} is older than "
            f"{'.'.join(map(str, MIN_TRANSFORMERS))}, the oldest qshard's from_pretrained / "
            f"save_pretrained integration supports; upgrade transformers (qshard.save / "
            f"qshard.load work without it)"
        )
    if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
        register_quantization_config(QUANT_METHOD)(QShardConfig)
    if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
        register_quantizer(QUANT_METHOD)(QShardHfQuantizer)


register()
