"""`qshard.load`: a checkpoint into a state_dict, a model, or a tensor-parallel model.

Loading into a model follows `load_state_dict(assign=True)`: each parameter and buffer is
replaced by the loaded tensor (a QTensor where the checkpoint holds one), so a model built on
the meta device is loaded without ever allocating its float weights. Everything is checked
(keys, shapes, headers, checksums, finite scales) and every tensor read before the model is
touched: a load that fails leaves the model as it was.

With a `mesh` and a TP `plan` (the table `qshard.tp.parallelize` takes), each rank reads only its
own slice of every sharded parameter from disk and the model comes out as `parallelize` would
leave it: DTensor parameters and the styles' input/output hooks. The checkpoint is always the
full model, so one saved at any TP size loads at any other that its blocks allow.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping

import torch
from torch import nn

from ..errors import CheckpointError, QShardError
from ..hooks import run_model_hooks
from ..qtensor import FLOAT_DTYPES, QTensor
from ..qtensor.validation import check_magnitude
from ..shards import is_dtensor, local_tensor
from .checkpoint import Checkpoint
from .saving import agree_on_failure

__all__ = ["empty_weights", "load"]


def load(
    path: str | os.PathLike,
    model: nn.Module | None = None,
    device: torch.device | str | None = None,
    mesh=None,
    plan=None,
    strict: bool = True,
):
    """Load the checkpoint at `path` (a directory written by `qshard.save`, a `.safetensors`
    file, or a `model.safetensors.index.json`).

    Without `model`: returns the state_dict (QTensors rebuilt) on `device` (default CPU).
    With `model`: loads into it and returns it. `strict=False` loads the keys both have and
    warns about the rest. With `mesh` (a 1-D DeviceMesh) and `plan`: a tensor-parallel load.
    """
    if (mesh is None) != (plan is None):
        raise QShardError("qshard.load: pass both mesh and plan for a tensor-parallel load")
    with Checkpoint(path) as checkpoint:
        if model is None:
            if mesh is not None:
                raise QShardError("qshard.load: mesh and plan shard a model; pass model=")
            device = torch.device("cpu") if device is None else torch.device(device)
            return _read_all(checkpoint, checkpoint.keys(), {}, device, None, {})
        return load_into(checkpoint, model, device, mesh, plan, strict)


def load_into(checkpoint: Checkpoint, model: nn.Module, device, mesh, plan, strict: bool):
    state = model.state_dict(keep_vars=True)
    targets = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    if any(is_dtensor(t) for t in targets.values()):
        raise QShardError(
            "qshard.load: the model is sharded already; load into the unsharded model (built on "
            "the meta device) and pass mesh= and plan= to shard it while loading"
        )
    missing = [k for k in targets if k not in checkpoint.records]
    unexpected = [k for k in checkpoint.records if k not in targets]
    _check_no_codes_as_floats(checkpoint, targets)  # first: strict=False would not help
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"qshard.load into {type(model).__name__}: missing keys {_few(missing)}, unexpected "
            f"keys {_few(unexpected)}; pass strict=False to load the keys both have"
        )
    keys = [k for k in targets if k in checkpoint.records]
    _check_nothing_left_on_meta(model, targets, keys)
    for key in keys:
        stored = tuple(checkpoint.record(key).outer_shape())
        if stored != tuple(targets[key].shape):
            raise CheckpointError(
                f"qshard.load: {key!r} is {list(stored)} in the checkpoint and "
                f"{list(targets[key].shape)} in the model"
            )
    metas = {k: checkpoint.record(k).meta() for k in keys}  # class, shape, dtype: no data
    dtypes = {}  # the model's dtype where a floating checkpoint tensor is converted to it
    for key in keys:
        stored, wanted = checkpoint.record(key).outer_dtype(), targets[key].dtype
        if stored != wanted and not (stored.is_floating_point and wanted.is_floating_point):
            raise CheckpointError(
                f"qshard.load: {key!r} is {stored} in the checkpoint and {wanted} in the model"
            )
        if isinstance(metas[key], QTensor) and wanted not in FLOAT_DTYPES:
            raise CheckpointError(
                f"qshard.load into {type(model).__name__}: {key!r} is a quantized weight, and "
                f"the model's {key!r} is {wanted}; quantized weights stand for one of "
                f"{[str(d) for d in FLOAT_DTYPES]}. Build the model in one of those dtypes "
                f"(e.g. model.to(torch.bfloat16)) before loading"
            )
        dtypes[key] = wanted
    placements, resolved = {}, None
    if mesh is not None:
        from ..tp.plan import checked_placements  # imports torch.distributed.tensor

        resolved, placements = checked_placements(model, mesh, plan, metas)
    device = _target_device(device, mesh, targets)
    if mesh is None:
        values = _read_all(checkpoint, keys, placements, device, mesh, dtypes)
    else:  # each rank reads (and checks) other bytes: all raise, or none changes the model
        values, failure = None, None
        try:
            values = _read_all(checkpoint, keys, placements, device, mesh, dtypes)
        except Exception as e:  # re-raised below, on every rank
            failure = e
        other = (
            "qshard.load: another rank's part of the checkpoint failed its checks (that "
            "rank's error names it); no rank's model was changed"
        )
        failure = agree_on_failure(mesh, failure, other)
        if failure is not None:
            raise failure
    _assign(model, targets, values)
    if any(isinstance(local_tensor(v), QTensor) for v in values.values()):
        run_model_hooks(model)  # transformers: save_pretrained then writes qshard's format
    if resolved is not None:
        from ..tp.plan import apply_styles  # imports torch.distributed.tensor

        apply_styles(model, mesh, resolved, loaded=True)
    if missing or unexpected:
        warnings.warn(
            f"qshard.load (strict=False): missing keys {_few(missing)}, unexpected keys "
            f"{_few(unexpected)}",
            stacklevel=3,
        )
    return model


def _check_no_codes_as_floats(checkpoint: Checkpoint, targets: Mapping) -> None:
    """CheckpointError for a plain float8 or float4 checkpoint tensor bound for a model tensor
    of another dtype: such bytes are quantized codes (another format's `weight` beside its
    `weight_scale`), which cast to floats are the codes themselves, not the weights."""
    for key, target in targets.items():
        if key not in checkpoint.records:
            continue
        record = checkpoint.record(key)
        stored = record.outer_dtype()
        code = stored.is_floating_point and stored.itemsize == 1
        if code and stored != target.dtype and not isinstance(record.meta(), QTensor):
            raise CheckpointError(
                f"qshard.load: {key!r} is a plain {stored} tensor in the checkpoint and "
                f"{target.dtype} in the model: 8- and 4-bit floats are quantized codes, which "
                "mean nothing without their scales (another tool's quantized checkpoint). Load "
                "FP8/FP4/int4 checkpoints of other formats with qshard.load_pretrained(path), "
                f"or build the model's {key!r} as {stored} to load the codes as they are"
            )


def _check_nothing_left_on_meta(model: nn.Module, targets: Mapping, keys: list[str]) -> None:
    """CheckpointError naming every tensor of `model` on the meta device that this load would
    not fill (a missing key under strict=False, or a buffer no state_dict holds, such as a
    rotary embedding's inv_freq): the model would come out half real, half meta."""
    loaded = set(keys)
    left = [k for k, t in targets.items() if t.is_meta and k not in loaded]
    # Non-persistent buffers are in no state_dict, so no checkpoint can fill them.
    persistent = set(targets)
    left += [k for k, b in model.named_buffers() if b.is_meta and k not in persistent]
    if left:
        raise CheckpointError(
            f"qshard.load into {type(model).__name__}: {len(left)} tensors are on the meta "
            f"device and the checkpoint does not fill them: {', '.join(left)}. Build the model "
            f"under `with qshard.empty_weights():` (parameters on meta, buffers computed) "
            f"instead of torch.device('meta'), or load a checkpoint that holds them"
        )


@contextlib.contextmanager
def empty_weights():
    """Build models whose parameters are on the meta device (no memory, no random init)
    while buffers are real: `qshard.load` / `load_pretrained` then fill every parameter, and
    the buffers no checkpoint holds (a rotary embedding's inv_freq) are already computed.
    As accelerate's init_empty_weights(include_buffers=False)::

        with qshard.empty_weights():
            model = AutoModelForCausalLM.from_config(config)
        qshard.load(directory, model)
    """
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            kind = type(param)
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _read_all(checkpoint: Checkpoint, keys, placements: Mapping, device, mesh, dtypes) -> dict:
    """{key: tensor}, floating ones in `dtypes[key]` where given; an alias gets the very tensor
    of its target, read once."""
    values, cache = {}, {}
    for key in keys:
        placement, dtype = placements.get(key), dtypes.get(key)
        cache_key = (checkpoint.record(key).key, repr(placement), dtype)
        if cache_key not in cache:
            if placement is None:
                value = _as_dtype(checkpoint.read(key, device), dtype)
            else:
                from torch.distributed.tensor import DTensor, Shard  # only for a mesh

                world, rank = mesh.size(), mesh.get_local_rank()
                record = checkpoint.record(key)
                if isinstance(placement, Shard):
                    local = checkpoint.read_shard(key, placement.dim, world, rank, device)
                else:
                    local = checkpoint.read(key, device)
                local = _as_dtype(local, dtype)
                shape = record.outer_shape()
                stride = torch.empty(shape, device="meta").stride()
                value = DTensor.from_local(
                    local, mesh, [placement], run_check=False, shape=shape, stride=stride
                )
            cache[cache_key] = value
        values[key] = cache[cache_key]
    return values


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`tensor` as the model's floating `dtype`: a plain tensor is cast, a quantized one only
    changes the float dtype it stands for (its packed data is unchanged)."""
    if dtype is None or tensor.dtype == dtype:
        return tensor
    if isinstance(tensor, QTensor):
        changed = tensor.with_changes(dtype=dtype, fresh=True)
        # e.g. a float32 checkpoint's scales may dequantize beyond float16's range
        check_magnitude(changed, f"qshard.load as {dtype}")
        return changed.repack_for_device()
    return tensor.to(dtype)


def _assign(model: nn.Module, targets: Mapping[str, torch.Tensor], values: Mapping) -> None:
    """Replace each parameter and buffer; parameters tied in the model stay tied. Every new
    Parameter is made before the first one is assigned, so that nothing is half-done."""
    new_params: dict[tuple, nn.Parameter] = {}
    changes = []
    for key, value in values.items():
        module_name, _, attr = key.rpartition(".")
        owner = model.get_submodule(module_name)
        old = targets[key]
        if attr in owner._parameters:
            tie = (id(old), id(value))
            if tie not in new_params:
                grad = old.requires_grad and not isinstance(local_tensor(value), QTensor)
                new_params[tie] = nn.Parameter(value, requires_grad=grad)
            changes.append((owner._parameters, attr, new_params[tie]))
        else:
            changes.append((owner._buffers, attr, value))
    for table, attr, value in changes:
        table[attr] = value


def _target_device(device, mesh, targets: Mapping[str, torch.Tensor]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if mesh is not None:
        if mesh.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(mesh.device_type)
    real = [t.device for t in targets.values() if t.device.type != "meta"]
    return real[0] if real else torch.device("cpu")


def _few(keys: list[str], count: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:count])
    more = f" and {len(keys) - count} more" if len(keys) > count else ""
    return f"[{shown}{more}]"
