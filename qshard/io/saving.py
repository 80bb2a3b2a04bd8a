"""`qshard.save`: a model or state_dict to safetensors files, quantized tensors included.

Writes into a directory, the Hugging Face way: `model.safetensors`, or above `max_shard_size`
`model-00001-of-0000N.safetensors` shards and `model.safetensors.index.json`; beside them
`quantization_config.json` (each config's `to_dict()` and the tensors it quantized). The file
layout is in `format.py`. Every file is written to a temporary name, synced, then renamed, so
a crash never leaves a partial file under a final name.

A tensor-parallel model (DTensor parameters) saves as one full checkpoint: every rank calls
`save`, sharded weights are gathered (quantized ones too, `qshard.tp.gather`), rank 0 writes,
and every rank returns once the files exist (or raises rank 0's error). A model without DTensors
is written by whichever process calls `save` (in a distributed job, usually rank 0 alone).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import re
import secrets
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..api import _is_dtensor, _local
from ..errors import QShardError
from ..qtensor import QTensor
from .checkpoint import INDEX_NAME, SHARD_NAME, SINGLE_FILE_NAME
from .format import SAFETENSORS_DTYPES, StoredTensor, crc32, encode_metadata, qtensor_record

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "QUANTIZATION_CONFIG_NAME", "parse_size", "save"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
QUANTIZATION_CONFIG_NAME = "quantization_config.json"
_UNITS = {
    "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as "5GB" (10^9) or "500MiB" (2^20)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    text = size if isinstance(size, str) else ""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() or "B" if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise QShardError(
            f"qshard.save: max_shard_size={size!r} is not a positive size; pass bytes (an int) "
            f"or a string such as '5GB' or '500MiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


@dataclasses.dataclass
class _Entry:
    key: str
    value: torch.Tensor | None  # None for an alias
    alias_of: str | None = None

    def stored(self) -> dict[str, torch.Tensor]:
        if self.value is None:
            return {}
        if isinstance(self.value, QTensor):
            return {f"{self.key}.{n}": t for n, t in self.value.inner_tensors().items()}
        return {self.key: self.value}

    def parts(self) -> list[str]:
        if isinstance(self.value, QTensor):
            return list(self.value.inner_names)
        return [self.key]

    def nbytes(self) -> int:
        """Bytes on disk; for a sharded (DTensor) value, those of the full tensor."""
        if self.value is None:
            return 0
        local = _local(self.value)
        if not isinstance(local, QTensor):
            return self.value.numel() * local.element_size()
        n, k = self.value.shape
        shape = (k, n) if local.transposed else (n, k)
        specs = local.inner_specs(shape, local.attrs()).values()
        return sum(math.prod(size) * dtype.itemsize for size, dtype in specs)


def save(
    model_or_state_dict: nn.Module | Mapping[str, torch.Tensor],
    path: str | os.PathLike,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> list[pathlib.Path]:
    """Save a (quantized, possibly tensor-parallel) model or state_dict as safetensors into the
    directory `path`; returns the files written. See the module docstring."""
    limit = parse_size(max_shard_size)
    directory = pathlib.Path(path)
    if directory.exists() and not directory.is_dir():
        raise QShardError(f"qshard.save: {directory} is a file; pass a directory to save into")
    state = _state_dict(model_or_state_dict)
    entries = _plan_entries(state)
    # A sharded model is saved by every rank (gathers are collectives) and written by rank 0;
    # anything else is written by whichever process calls save.
    distributed = any(_is_dtensor(v) for v in state.values())
    groups = _split(entries, limit)
    writer = _Writer(directory, len(groups))
    writing = not distributed or dist.get_rank() == 0
    for group in groups:
        # One file's worth gathered at a time; every rank takes part even after a failure on
        # rank 0, so that no rank waits forever in a collective.
        full = [dataclasses.replace(e, value=_full(e.value)) for e in group]
        if writing:
            writer.run(writer.write_file, full)
    if writing:
        writer.run(writer.finish, entries)
    if distributed:
        failure = writer.failure
        message = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(message, src=0)
        dist.barrier()  # leave together, so that no rank races ahead into a teardown
        if failure is None and message[0] is not None:
            raise QShardError(f"qshard.save failed on rank 0: {message[0]}")
    if writer.failure is not None:
        raise writer.failure
    return writer.written


def _state_dict(obj: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = obj.state_dict() if isinstance(obj, nn.Module) else obj
    if not isinstance(state, Mapping):
        raise QShardError(
            f"qshard.save: got a {type(obj).__name__}; pass an nn.Module or a state_dict"
        )
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise QShardError(
                f"qshard.save: entry {key!r} is a {type(value).__name__}; a state_dict maps "
                f"names (str) to tensors"
            )
        if key == "__metadata__":
            raise QShardError(
                "qshard.save: the key '__metadata__' is reserved by the safetensors format; "
                "rename that entry"
            )
        local = _local(value)
        if local.device.type == "meta":
            raise QShardError(f"qshard.save: {key!r} is on the meta device and has no data")
        if isinstance(local, QTensor):  # checked before any file is written
            qtensor_record(key, local, {})
        inner = local.inner_tensors().values() if isinstance(local, QTensor) else [local]
        for t in inner:
            if t.dtype not in _SAFETENSORS_NAMES:
                raise QShardError(
                    f"qshard.save: {key!r} holds a {t.dtype} tensor, which safetensors cannot "
                    f"store; supported: {sorted(str(d) for d in _SAFETENSORS_NAMES)}"
                )
    return dict(state)


def _plan_entries(state: Mapping[str, torch.Tensor]) -> list[_Entry]:
    """One entry per key; a tensor that is the same view of the same memory as an earlier one
    (tied weights) becomes an alias, so it is stored once and stays tied after loading."""
    entries, first_key, stored_keys = [], {}, {}
    for key, value in state.items():
        signature = _signature(value)
        if signature is not None and signature in first_key:
            entries.append(_Entry(key, None, alias_of=first_key[signature]))
            continue
        if signature is not None:
            first_key[signature] = key
        entry = _Entry(key, value)
        for stored_key in _stored_names(key, value):
            if stored_key in stored_keys:
                raise QShardError(
                    f"qshard.save: entries {stored_keys[stored_key]!r} and {key!r} would both "
                    f"be stored as {stored_key!r}; rename one of them"
                )
            stored_keys[stored_key] = key
        entries.append(entry)
    return entries


def _stored_names(key: str, value: torch.Tensor) -> list[str]:
    local = _local(value)
    return [f"{key}.{n}" for n in local.inner_names] if isinstance(local, QTensor) else [key]


def _signature(value: torch.Tensor) -> tuple | None:
    """What makes two state_dict values the same tensor: the same class, shape and attributes
    over the same memory. None for tensors that cannot alias (empty or sharded)."""
    if _is_dtensor(value) or value.numel() == 0:
        return None
    if isinstance(value, QTensor):
        inner = tuple(_signature(t) for t in value.inner_tensors().values())
        head = (type(value), value.logical_shape, value.dtype, value.transposed)
        return (*head, repr(value.attr_values()), inner)
    return (value.dtype, value.device, value.data_ptr(), tuple(value.shape), value.stride())


def _full(value: torch.Tensor) -> torch.Tensor:
    if not _is_dtensor(value):
        return value
    from ..tp.gather import full_tensor

    return full_tensor(value)


# ---- writing ------------------------------------------------------------------------------


class _Writer:
    """Writes the files of one save, one group of entries at a time; remembers the first
    failure (and then writes nothing more)."""

    def __init__(self, directory: pathlib.Path, count: int):
        import qshard

        self.directory, self.version = directory, qshard.__version__
        self.names = (
            [SINGLE_FILE_NAME]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        self.save_id = secrets.token_hex(8)
        self.written: list[pathlib.Path] = []
        self.weight_map: dict[str, str] = {}
        self.configs: dict[str, dict] = {}
        self.failure: Exception | None = None

    def run(self, step, *args) -> None:
        if self.failure is None:
            try:
                step(*args)
            except Exception as e:  # re-raised by save, after the other ranks hear of it
                self.failure = e

    def write_file(self, group: list[_Entry]) -> None:
        name = self.names[len(self.written)]
        self.directory.mkdir(parents=True, exist_ok=True)
        tensors, metadata = _file_contents(group, self.version, self.save_id)
        _atomic_write(
            self.directory / name, functools.partial(_write_safetensors, tensors, metadata)
        )
        self.weight_map.update(dict.fromkeys(tensors, name))
        self.written.append(self.directory / name)
        for entry in group:
            if isinstance(entry.value, QTensor):
                config = entry.value.config().to_dict()
                text = json.dumps(config, sort_keys=True)
                group_ = self.configs.setdefault(text, {"config": config, "targets": []})
                group_["targets"].append(entry.key)

    def finish(self, entries: list[_Entry]) -> None:
        if len(self.names) > 1:
            total = sum(entry.nbytes() for entry in entries)
            index = {"metadata": {"total_size": total}, "weight_map": self.weight_map}
            self._write_json(INDEX_NAME, index)
        groups = {f"group_{i}": g for i, g in enumerate(self.configs.values())}
        config = {"quant_method": "qshard", "qshard_version": self.version, "config_groups": groups}
        self._write_json(QUANTIZATION_CONFIG_NAME, config)
        _remove_stale(self.directory, {p.name for p in self.written})

    def _write_json(self, name: str, data) -> None:
        text = (json.dumps(data, indent=2) + "\n").encode()
        _atomic_write(self.directory / name, lambda f: f.write(text))
        self.written.append(self.directory / name)


def _file_contents(group: list[_Entry], version: str, save_id: str):
    """({stored key: contiguous CPU tensor}, header metadata) of one file."""
    tensors, records = {}, {}
    for entry in group:
        if entry.alias_of is not None:
            records[entry.key] = {"kind": "alias", "of": entry.alias_of}
            continue
        stored = {}  # {inner name (or the key of a plain tensor): StoredTensor}
        for part, (key, tensor) in zip(entry.parts(), entry.stored().items(), strict=True):
            tensors[key] = cpu = tensor.detach().to("cpu").contiguous()
            stored[part] = StoredTensor(key, cpu.dtype, tuple(cpu.shape), crc32(cpu))
        if isinstance(entry.value, QTensor):
            records[entry.key] = qtensor_record(entry.key, entry.value, stored)
        else:
            records[entry.key] = {"kind": "tensor", "tensor": stored[entry.key].to_json()}
    return tensors, encode_metadata(records, version, save_id)


def _split(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Consecutive groups of at most `limit` bytes (an entry larger than that alone); a
    QTensor's inner tensors stay together, and an alias goes with its target."""
    groups: list[list[_Entry]] = [[]]
    size, group_of = 0, {}
    for entry in entries:
        if entry.alias_of is not None:
            groups[group_of[entry.alias_of]].append(entry)
            continue
        nbytes = entry.nbytes()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(entry)
        group_of[entry.key] = len(groups) - 1
        size += nbytes
    return groups


def _write_safetensors(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str], f) -> None:
    """The safetensors format: u64 header length, JSON header (padded with spaces to 8 bytes),
    then each tensor's bytes in header order."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    # Widest elements first (a stable sort): every tensor's data starts at a multiple of its
    # element size, as safetensors' own writer arranges, so that readers can view it in place.
    tensors = dict(sorted(tensors.items(), key=lambda item: -item[1].element_size()))
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _SAFETENSORS_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for tensor in tensors.values():
        if tensor.numel():
            f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def _atomic_write(final: pathlib.Path, write) -> None:
    """`write(file)` into a temporary file beside `final`, fsync, then rename over `final`."""
    temporary = final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(final.parent)


def _fsync_directory(directory: pathlib.Path) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale(directory: pathlib.Path, keep: set[str]) -> None:
    """Files of an earlier save into the same directory that this save did not replace."""
    for path in directory.iterdir():
        ours = path.name in (SINGLE_FILE_NAME, INDEX_NAME) or SHARD_NAME.fullmatch(path.name)
        if ours and path.name not in keep:
            path.unlink()
