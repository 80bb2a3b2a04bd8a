"""`qshard.save`: a model or state_dict to safetensors files, quantized tensors included.

Writes into a directory, the Hugging Face way: `model.safetensors`, or above `max_shard_size`
`model-00001-of-0000N.safetensors` shards (`model-00001-of-0000N-<save id>.safetensors` where the
index being replaced lists those names) and `model.safetensors.index.json`; beside them
`quantization_config.json` (each config's `to_dict()` and the tensors it quantized). The file
layout is in `format.py`. A save into a directory that holds a checkpoint never destroys it:
whenever the save stops (an error, or a kill at any instant), the directory loads as the old
checkpoint or, once one atomic rename or deletion has committed the new one, as the new one
(the protocol is described above `_Writer`).

A tensor-parallel model (DTensor parameters) saves as one full checkpoint: every rank calls
`save`, sharded weights are gathered (quantized ones too, `qshard.tp.gather`), rank 0 writes,
and every rank returns once the files exist (or raises rank 0's error). A model without DTensors
is written by whichever process calls `save` (in a distributed job, usually rank 0 alone).

Size: about 530 lines: the atomic-replace protocol (`_Writer`) and the state-dict checks it
runs before writing, kept beside each other so the save's guarantees read in one file.
"""

from __future__ import annotations

import contextlib
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

from ..errors import CheckpointError, QShardError
from ..qtensor import QTensor
from ..qtensor.validation import check_qtensor
from ..shards import is_dtensor, local_tensor
from ..version import __version__
from .checkpoint import INDEX_NAME, SHARD_NAME, SINGLE_FILE_NAME, checkpoint_files
from .format import (
    CHUNK_BYTES,
    SAFETENSORS_DTYPES,
    StoredTensor,
    chunk_crcs,
    encode_metadata,
    qtensor_record,
)

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "QUANTIZATION_CONFIG_NAME", "parse_size", "save"]

DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default
QUANTIZATION_CONFIG_NAME = "quantization_config.json"
_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
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
        local = local_tensor(self.value)
        if not isinstance(local, QTensor):
            return self.value.numel() * local.element_size()
        *lead, n, k = self.value.shape
        shape = (*lead, k, n) if local.transposed else (*lead, n, k)
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
    state = checked_state_dict(model_or_state_dict)
    entries = _plan_entries(state)
    # A sharded model is saved by every rank (gathers are collectives) and written by rank 0;
    # anything else is written by whichever process calls save.
    distributed = any(is_dtensor(v) for v in state.values())
    invalid = _invalid_quantized(state)
    if distributed:  # every rank learns of a failure before any collective
        invalid = _agree(state, invalid)
    if invalid is not None:
        raise invalid
    groups = _split(entries, limit)
    writer = _Writer(directory, len(groups))
    writing = not distributed or dist.get_rank() == 0
    if writing:
        writer.run(writer.begin)
    for group in groups:
        # One file's worth gathered at a time; every rank takes part even after a failure on
        # rank 0, so that no rank waits forever in a collective.
        full = [dataclasses.replace(e, value=full_tensor(e.value)) for e in group]
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


def _invalid_quantized(state: Mapping[str, torch.Tensor]) -> QShardError | None:
    """What qshard.load would refuse in a quantized value (or this rank's shard of it), which is
    then not written (docs/design.md invariant 9), or None."""
    for key, value in state.items():
        local = local_tensor(value)
        if isinstance(local, QTensor):
            try:
                # (as a reader will see it: canonical storage)
                check_qtensor(local.canonical(), f"qshard.save: {key!r}", QShardError)
            except QShardError as e:
                return e
    return None


def _agree(state: Mapping[str, torch.Tensor], failure: QShardError | None) -> QShardError | None:
    """This rank's failure, or one saying that another rank's shard failed: every rank of a
    sharded save agrees (one all_reduce) before the gathers, so none is left waiting in one."""
    mesh = next(v.device_mesh for v in state.values() if is_dtensor(v))
    other = (
        "qshard.save: another rank's shard of a quantized weight failed its checks (that "
        "rank's error names it); nothing was written"
    )
    return agree_on_failure(mesh, failure, other)


def agree_on_failure(mesh, failure: Exception | None, other: str) -> Exception | None:
    """This rank's failure, or QShardError(`other`) if another rank of `mesh` failed, or None:
    every rank learns of any rank's failure (all-reduces of a flag), so that all raise
    together and none is left waiting in a later collective or half-changed."""
    device = torch.cuda.current_device() if mesh.device_type == "cuda" else "cpu"
    flag = torch.tensor([float(failure is not None)], device=device)
    for group in mesh.get_all_groups():  # a 2-D mesh (experts x their rows): along each dim
        dist.all_reduce(flag, dist.ReduceOp.MAX, group=group)
    if failure is None and flag.item():
        return QShardError(other)
    return failure


def checked_state_dict(obj: nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
        local = local_tensor(value)
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
    local = local_tensor(value)
    return [f"{key}.{n}" for n in local.inner_names] if isinstance(local, QTensor) else [key]


def _signature(value: torch.Tensor) -> tuple | None:
    """What makes two state_dict values the same tensor: the same class, shape and attributes
    over the same memory. None for tensors that cannot alias (empty or sharded)."""
    if is_dtensor(value) or value.numel() == 0:
        return None
    if isinstance(value, QTensor):
        inner = tuple(_signature(t) for t in value.inner_tensors().values())
        head = (type(value), value.logical_shape, value.dtype, value.transposed)
        return (*head, repr(value.attr_values()), inner)
    return (value.dtype, value.device, value.data_ptr(), tuple(value.shape), value.stride())


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    if not is_dtensor(value):
        return value
    from ..tp.gather import full_tensor  # imports torch.distributed.tensor

    return full_tensor(value)


# ---- writing ------------------------------------------------------------------------------
#
# The commit protocol (docs/checkpoints.md, "Atomic writes"). `qshard.load(directory)` gives the
# previous checkpoint until one atomic step, the commit, and the new one from then on:
#  1. Delete the temporary files of killed saves; note the files the directory loads from now.
#  2. Write every new file to a temporary name and fsync it: the weights, then
#     quantization_config.json and (with shards) the index.
#  3. Rename the shards to names the current checkpoint does not read: model-0000i-of-0000n, or
#     model-0000i-of-0000n-<save id> where the current index lists those names.
#  4. Commit: rename the index over the old one. One file: rename model.safetensors over the old
#     one, or, where an index is there (the reader prefers it), put model.safetensors in place
#     (the index does not list it) and delete the index.
#  5. Rename quantization_config.json into place, then delete the previous save's files.
# A failure before 4 deletes this save's files. A kill leaves temporary files (deleted by the next
# save's step 1) or shards no index lists (deleted by the next save's step 5).


class _Writer:
    """Writes the files of one save, one group of entries at a time; remembers the first
    failure (and then writes nothing more)."""

    def __init__(self, directory: pathlib.Path, count: int):
        self.directory, self.count, self.version = directory, count, __version__
        self.save_id = secrets.token_hex(8)
        self.names: list[str] = []  # of the weight files, chosen by `begin`
        self.files: list[tuple[pathlib.Path, pathlib.Path]] = []  # (temporary, final) per file
        self.temporary: set[pathlib.Path] = set()  # written, not yet renamed
        self.placed: list[pathlib.Path] = []  # renamed into place before the commit
        self.committed = False
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
                self._discard()
            except BaseException:  # an interrupt (Ctrl-C): no temporary file left behind
                self._discard()
                raise

    def begin(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        _remove_temporary(self.directory)
        in_use = _in_use(self.directory)
        stems = [f"model-{i + 1:05d}-of-{self.count:05d}" for i in range(self.count)]
        if self.count == 1 and not {SINGLE_FILE_NAME, INDEX_NAME} <= in_use:
            self.names = [SINGLE_FILE_NAME]
        elif in_use.isdisjoint(f"{stem}.safetensors" for stem in stems):
            self.names = [f"{stem}.safetensors" for stem in stems]
        else:  # the current index lists those names: these shards must not replace its files
            self.names = [f"{stem}-{self.save_id}.safetensors" for stem in stems]

    def write_file(self, group: list[_Entry]) -> None:
        name = self.names[len(self.files)]
        tensors, metadata = _file_contents(group, self.version, self.save_id)
        write = functools.partial(_write_safetensors, tensors, metadata)
        self.files.append((self._write(name, write), self.directory / name))
        self.weight_map.update(dict.fromkeys(tensors, name))
        for entry in group:
            if isinstance(entry.value, QTensor):
                config = entry.value.config().to_dict()
                text = json.dumps(config, sort_keys=True)
                group_ = self.configs.setdefault(text, {"config": config, "targets": []})
                group_["targets"].append(entry.key)

    def finish(self, entries: list[_Entry]) -> None:
        directory, index = self.directory, self.directory / INDEX_NAME
        groups = {f"group_{i}": g for i, g in enumerate(self.configs.values())}
        config = {"quant_method": "qshard", "qshard_version": self.version, "config_groups": groups}
        config_file = self._write(QUANTIZATION_CONFIG_NAME, _json_writer(config))
        if self.names != [SINGLE_FILE_NAME]:
            total = sum(entry.nbytes() for entry in entries)
            data = {"metadata": {"total_size": total}, "weight_map": self.weight_map}
            index_file = self._write(INDEX_NAME, _json_writer(data))
            for temporary, final in self.files:
                self._place(temporary, final)
            _fsync_directory(directory)  # the shards are there before the index names them
            self._rename(index_file, index)  # the commit
        elif index.is_file():  # read before model.safetensors, and does not list it
            self._place(*self.files[0])
            _fsync_directory(directory)
            os.unlink(index)  # the commit
        else:
            self._rename(*self.files[0])  # the commit
        self.committed = True
        _fsync_directory(directory)
        self._rename(config_file, directory / QUANTIZATION_CONFIG_NAME)
        self.written = [final for _, final in self.files]
        self.written += [index] * (self.names != [SINGLE_FILE_NAME])
        self.written.append(directory / QUANTIZATION_CONFIG_NAME)
        _remove_stale(directory, {path.name for path in self.written})
        _fsync_directory(directory)

    def _write(self, name: str, write) -> pathlib.Path:
        # (registered before the file exists: an interrupt at any point finds it in the set)
        return _write_temporary(self.directory / name, write, self.temporary.add)

    def _rename(self, temporary: pathlib.Path, final: pathlib.Path) -> None:
        os.replace(temporary, final)
        self.temporary.discard(temporary)

    def _place(self, temporary: pathlib.Path, final: pathlib.Path) -> None:
        self._rename(temporary, final)
        self.placed.append(final)

    def _discard(self) -> None:
        """After a failure: this save's temporary files, and before the commit the files it put
        in place (none of them one that the previous checkpoint reads)."""
        for path in [*self.temporary, *([] if self.committed else self.placed)]:
            with contextlib.suppress(OSError):  # the failure being reported matters more
                path.unlink(missing_ok=True)
        self.temporary.clear()


def _json_writer(data):
    text = (json.dumps(data, indent=2) + "\n").encode()
    return lambda f: f.write(text)


def _file_contents(group: list[_Entry], version: str, save_id: str):
    """({stored key: contiguous CPU tensor}, header metadata) of one file."""
    tensors, records = {}, {}
    for entry in group:
        if entry.alias_of is not None:
            records[entry.key] = {"kind": "alias", "of": entry.alias_of}
            continue
        if isinstance(entry.value, QTensor):  # files hold the canonical storage
            entry = dataclasses.replace(entry, value=entry.value.canonical())
        stored = {}  # {inner name (or the key of a plain tensor): StoredTensor}
        for part, (key, tensor) in zip(entry.parts(), entry.stored().items(), strict=True):
            tensors[key] = cpu = tensor.detach().to("cpu").contiguous()
            whole, chunks = chunk_crcs(cpu, CHUNK_BYTES)
            stored[part] = StoredTensor(
                key, cpu.dtype, tuple(cpu.shape), whole, CHUNK_BYTES, chunks
            )
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


def _write_temporary(final: pathlib.Path, write, register=None) -> pathlib.Path:
    """`write(file)` into a temporary file beside `final`, fsynced; returns its path (the caller
    renames it). `register(path)` is called before the file is created. A failed write deletes
    it."""
    temporary = final.with_name(f".{final.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    if register is not None:
        register(temporary)
    try:
        with open(temporary, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return temporary


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


def _in_use(directory: pathlib.Path) -> set[str]:
    """The names of the files `qshard.load(directory)` reads now, its index included; none where
    the directory holds no loadable checkpoint."""
    try:
        files, weight_map = checkpoint_files(directory)
    except CheckpointError:
        return set()
    return {file.name for file in files} | ({INDEX_NAME} if weight_map is not None else set())


def _is_ours(name: str) -> bool:
    """A name that qshard.save writes (and so may delete)."""
    names = (SINGLE_FILE_NAME, INDEX_NAME, QUANTIZATION_CONFIG_NAME)
    return name in names or SHARD_NAME.fullmatch(name) is not None


_TEMPORARY = re.compile(r"\.(.+)\.\d+-[0-9a-f]{8}\.tmp")  # `_write_temporary`'s names


def _remove_temporary(directory: pathlib.Path) -> None:
    """The temporary files of saves that were killed: `.<name>.<pid>-<hex>.tmp`, for names
    qshard writes. (Two saves into one directory at the same time are not supported.)"""
    for path in directory.iterdir():
        match = _TEMPORARY.fullmatch(path.name)
        if match and _is_ours(match.group(1)) and not path.is_dir():
            path.unlink(missing_ok=True)


def _remove_stale(directory: pathlib.Path, keep: set[str]) -> None:
    """Weight files and index of earlier saves into the same directory (or of killed ones) that
    this save did not write; called once this save is committed."""
    for path in directory.iterdir():
        if path.name not in keep and _is_ours(path.name) and not path.is_dir():
            path.unlink(missing_ok=True)
