"""Reading another producer's safetensors directory tensor by tensor, writing one, and serving a
converted state_dict to qshard.load's machinery (model assignment, dtypes, TP sharding)."""

from __future__ import annotations

import fnmatch
import json
import os
import pathlib
import re
import secrets
import shutil
from collections.abc import Callable, Iterable, Mapping

import torch
from safetensors.torch import save_file

from ..config import Backend, ScaleFormat
from ..errors import CheckpointError, QShardError
from ..io.checkpoint import (
    INDEX_NAME,
    FileHeader,
    check_index,
    checkpoint_files,
    read_header,
    read_tensor,
)
from ..layouts import Fp8BlockwiseTensor, Fp8RowwiseTensor
from ..qtensor import QTensor
from ..shards import chunk_bounds, shard_cuts
from ..strict_json import read_json_file

__all__ = [
    "MemorySource",
    "SafetensorsDir",
    "exact_bf16",
    "fp8_block_attrs",
    "fp8_rows",
    "matches_any",
    "read_json",
    "write_directory",
]


def read_json(path: pathlib.Path) -> dict | None:
    """The JSON object in `path`, None if there is no such file; CheckpointError if it is not a
    readable JSON object (nesting bombs and huge integers included: qshard/strict_json.py)."""
    if not path.exists():
        return None
    return read_json_file(path)


class SafetensorsDir:
    """The tensors of a Hugging Face model directory (`model.safetensors`, or the shards an
    index lists, or every `*.safetensors`), read one at a time.

    The same rules as `qshard.load` (io/checkpoint.py): every header is parsed and checked by
    qshard's own reader before any tensor is read; an index names plain `.safetensors` files in
    the directory (no `../x`, no absolute path) and lists exactly the tensors each file holds;
    without an index, a tensor name found in two files is refused (which one would load?).
    Reads are plain reads of the checked byte ranges (no mmap)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = pathlib.Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(
                f"{self.directory}: not a directory (a model directory holds "
                f"config.json and *.safetensors)"
            )
        index_path = self.directory / INDEX_NAME
        if index_path.exists():
            files, weight_map = checkpoint_files(index_path)
        else:
            files, weight_map = sorted(self.directory.glob("*.safetensors")), None
        if not files:
            raise CheckpointError(f"{self.directory}: no *.safetensors files")
        self.header_of: dict[str, FileHeader] = {}
        for path in files:
            header = read_header(path)
            if weight_map is not None:
                check_index(weight_map, header)
            for key in header.stored:
                if key in self.header_of:
                    raise CheckpointError(
                        f"{self.directory}: tensor {key!r} is in both "
                        f"{self.header_of[key].path.name} and {path.name}; remove the stale "
                        f"file (which copy is meant cannot be told)"
                    )
                self.header_of[key] = header

    def names(self) -> list[str]:
        return list(self.header_of)

    def metadata(self) -> dict[str, str]:
        """The safetensors header metadata of every file, merged."""
        merged: dict[str, str] = {}
        headers = {header.path: header for header in self.header_of.values()}
        for path in sorted(headers):
            merged.update(headers[path].metadata or {})
        return merged

    def __contains__(self, key: str) -> bool:
        return key in self.header_of

    def get(self, key: str) -> torch.Tensor:
        if key not in self.header_of:
            raise CheckpointError(f"{self.directory}: no tensor {key!r}")
        header = self.header_of[key]
        return read_tensor(header, header.stored[key])


def exact_bf16(values: torch.Tensor, where: str) -> torch.Tensor:
    """`values` (int4 scales or zero points stored in another float dtype) as bfloat16, the int4
    layout's dtype, or CheckpointError if a value is not a bf16 value (converting would
    re-quantize)."""
    widened = values.to(torch.bfloat16)
    back = widened.to(values.dtype)
    # NaN compares unequal to itself: it is left for the layout's finiteness check to name.
    same = (back == values) | (back.isnan() & values.isnan())
    if not values.dtype.is_floating_point or not bool(same.all()):
        raise CheckpointError(
            f"{where} is {values.dtype} and not every value is a bfloat16 value; the int4 "
            f"layout keeps bf16 scales and zero points, and converting them would re-quantize"
        )
    return widened


def fp8_rows(
    qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, weight_only: bool
) -> Fp8RowwiseTensor:
    """The per-row FP8 layout of e4m3 `qdata` [N, K] with one multiplier per row, or one for
    the whole tensor (then repeated on every row: the same weights)."""
    n, k = qdata.shape
    rows = scale.float().reshape(-1, 1).expand(n, 1).contiguous()
    tensor = Fp8RowwiseTensor(
        {"qdata": qdata, "scale": rows},
        shape=(n, k),
        dtype=dtype,
        weight_only=weight_only,
        backend=Backend.AUTO,
    )
    tensor.validate()
    return tensor


def fp8_block_attrs(
    block: tuple[int, ...],
    weight_only: bool,
    scale_format: ScaleFormat,
    refused: Callable[[QShardError], CheckpointError],
) -> dict:
    """The FP8 blockwise layout's attributes for a checkpoint's `block` (activation groups of
    1 x its K side), checked by the layout's own rules before any arithmetic with the block;
    else `refused(the layout's error)`, the reader's CheckpointError naming file and field."""
    attrs = {
        "block_size": tuple(block),
        "act_group_size": block[-1],
        "weight_only": weight_only,
        "scale_format": scale_format,
        "backend": Backend.AUTO,
    }
    try:
        Fp8BlockwiseTensor.check_attrs(attrs)
    except QShardError as e:
        raise refused(e) from None
    return attrs


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """fnmatch `name` (a module name) against any of `patterns`; compressed-tensors' "re:..."
    entries are regular expressions (matched in full)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def write_directory(
    out_dir: str | os.PathLike, tensors: Mapping[str, torch.Tensor], json_files: Mapping[str, dict]
) -> pathlib.Path:
    """model.safetensors and the JSON files, all or nothing: written into a temporary directory
    beside `out_dir`, then renamed to it. `out_dir` must not exist or be empty."""
    out = pathlib.Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise QShardError(f"qshard.export: {out} exists and is not an empty directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_name(f".{out.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    temporary.mkdir()
    try:
        plain, storages = {}, set()
        for key, value in tensors.items():
            value = value.detach().contiguous().cpu()
            storage = value.untyped_storage().data_ptr()
            # Parts of one weight (an expert's gate and up) may share a tensor (NVFP4's global
            # scale); safetensors stores each key's bytes of its own.
            plain[key] = value.clone() if storage in storages else value
            storages.add(storage)
        save_file(plain, str(temporary / "model.safetensors"), metadata={"format": "pt"})
        for name, content in json_files.items():
            (temporary / name).write_text(json.dumps(content, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(temporary, out)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return out


class _MemoryRecord:
    def __init__(self, key: str, value: torch.Tensor):
        self.key, self.value = key, value

    def outer_shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    def outer_dtype(self) -> torch.dtype:
        return self.value.dtype

    def meta(self) -> torch.Tensor:
        if isinstance(self.value, QTensor):
            return self.value.to("meta")
        return torch.empty(self.value.shape, dtype=self.value.dtype, device="meta")


class MemorySource:
    """A converted state_dict seen as a qshard checkpoint by `io.loading` (records, whole and
    per-rank reads), so that loading it into a model, with a mesh and plan or without, is
    qshard.load's own code path."""

    def __init__(self, state: Mapping[str, torch.Tensor]):
        self.records = {k: _MemoryRecord(k, v) for k, v in state.items()}

    def keys(self) -> list[str]:
        return list(self.records)

    def record(self, key: str) -> _MemoryRecord:
        return self.records[key]

    def read(self, key: str, device) -> torch.Tensor:
        value = self.records[key].value
        return value.to(device) if value.device != torch.device(device) else value

    def read_shard(self, key: str, dim: int, world: int, rank: int, device) -> torch.Tensor:
        value = self.records[key].value
        size = value.shape[dim]
        start, end = chunk_bounds(size, world, rank)
        if isinstance(value, QTensor):
            logical = value.logical_dim(dim)
            value = value.realign(logical, shard_cuts(size, world))
            return value.slice_logical(logical, start, end).to(device, copy=True)
        return value.narrow(dim, start, end - start).to(device, copy=True)
