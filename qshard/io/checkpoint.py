"""Reading checkpoints: find the files, check every header, read entries whole or by TP shard.

A checkpoint is a directory holding `model.safetensors`, or shards listed by
`model.safetensors.index.json` (the Hugging Face convention), or a path to one of those files.
`Checkpoint.open` reads and checks only the headers; tensor data is read by `read` (a whole entry,
its checksums verified) and `read_shard` (one rank's slice: the checksum chunks around it, each
verified; `read_slice`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import re
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError
from ..qtensor.validation import check_qtensor
from ..shards import chunk_bounds, shard_cuts
from ..strict_json import parse_json, read_json_file
from .format import (
    METADATA_KEY,
    SAFETENSORS_DTYPES,
    Record,
    StoredTensor,
    crc32,
    decode_metadata,
    dtype_name,
)

__all__ = [
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "Checkpoint",
    "check_index",
    "decode_headers",
    "read_header",
    "read_tensor",
]

SINGLE_FILE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Shard i of n; `qshard.save` adds its save id where the index it replaces lists the plain names
SHARD_NAME = re.compile(r"model-(\d{5})-of-(\d{5})(?:-[0-9a-f]{16})?\.safetensors")
MAX_HEADER_BYTES = 100_000_000  # the limit safetensors itself enforces


@dataclasses.dataclass
class FileHeader:
    path: pathlib.Path
    stored: dict[str, StoredTensor]
    offsets: dict[str, int]  # absolute byte offset of each stored tensor's data
    metadata: dict[str, str] | None


def read_header(path: pathlib.Path) -> FileHeader:
    """Parse and check a safetensors header against the file it heads (the safetensors spec:
    8-byte little-endian length, JSON header, tensor data covering the rest with no gaps)."""
    where = str(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
                raise CheckpointError(
                    f"{where}: a {size}-byte file whose header length field reads {length}; "
                    f"the file is truncated or not safetensors"
                )
            text = f.read(length)
    except OSError as e:
        raise CheckpointError(f"{where}: cannot be read ({e.strerror or e})") from None
    header = parse_json(text, f"{where}: the safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: the safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise CheckpointError(f"{where}: __metadata__ is not a map of strings")
    data_start = 8 + length
    stored, offsets, spans = {}, {}, []
    for key, info in header.items():
        tensor, begin, end = _parse_entry(key, info, where)
        stored[key], offsets[key] = tensor, data_start + begin
        spans.append((begin, end, key))
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position:
            raise CheckpointError(
                f"{where}: tensor {key!r} starts at data byte {begin}, expected {position} (the "
                f"data must be packed with no gap or overlap)"
            )
        position = end
    if data_start + position != size:
        raise CheckpointError(
            f"{where}: the header describes {data_start + position} bytes, the file has {size}; "
            f"the file is truncated or damaged"
        )
    return FileHeader(path, stored, offsets, metadata)


def _parse_entry(key: str, info: Any, where: str) -> tuple[StoredTensor, int, int]:
    at = f"{where}: tensor {key!r}"
    dtype = info.get("dtype") if isinstance(info, dict) else None
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"{at}: dtype {dtype!r} is not one of the safetensors dtypes qshard reads "
            f"({sorted(SAFETENSORS_DTYPES)})"
        )
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not _ints(shape) or not (_ints(offsets) and len(offsets) == 2):
        raise CheckpointError(f"{at}: shape {shape!r} / data_offsets {offsets!r} are invalid")
    if any(size >= 2**62 or math.prod(shape[: i + 1]) >= 2**62 for i, size in enumerate(shape)):
        raise CheckpointError(f"{at}: shape {shape} is too large for any file")
    dtype = SAFETENSORS_DTYPES[dtype]
    begin, end = offsets
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise CheckpointError(
            f"{at}: data_offsets [{begin}, {end}] hold {end - begin} bytes; "
            f"{dtype_name(dtype)}{shape} needs {math.prod(shape) * dtype.itemsize}"
        )
    return StoredTensor(key, dtype, tuple(shape)), begin, end


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value
    )


def checkpoint_files(path: str | os.PathLike) -> tuple[list[pathlib.Path], dict[str, str] | None]:
    """The safetensors files of the checkpoint at `path`, and its index's weight map if any."""
    path = pathlib.Path(path)
    if path.is_dir():
        if (path / INDEX_NAME).is_file():
            path = path / INDEX_NAME
        elif (path / SINGLE_FILE_NAME).is_file():
            path = path / SINGLE_FILE_NAME
        else:
            found = sorted(path.glob("*.safetensors"))
            # Shards of n > 1 count only through an index, so that a lone file here still loads
            # while a save puts its shards in place (it commits by writing the index).
            alone = [f for f in found if not _one_of_several(f.name)] or found[:1]
            if len(alone) != 1:
                raise CheckpointError(
                    f"{path}: no {INDEX_NAME} or {SINGLE_FILE_NAME}, and {len(alone)} other "
                    f".safetensors files; pass the path of the file or index to load"
                )
            path = alone[0]  # shards without their index: refused below
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    if path.suffix != ".json":
        shard = SHARD_NAME.fullmatch(path.name)
        if shard and int(shard.group(2)) > 1:  # one shard alone is part of a checkpoint
            raise CheckpointError(
                f"{path}: one shard of {int(shard.group(2))}, without its {INDEX_NAME} (a save "
                f"that did not finish, or a missing file); load the checkpoint's index"
            )
        return [path], None
    index = read_json_file(path)
    weight_map = index.get("weight_map")
    valid = isinstance(weight_map, dict) and all(
        isinstance(f, str) and f == pathlib.PurePath(f).name and f.endswith(".safetensors")
        for f in weight_map.values()
    )
    if not valid or not all(isinstance(k, str) for k in weight_map):
        raise CheckpointError(
            f"{path}: 'weight_map' must map tensor names to .safetensors file names in the "
            f"index's directory"
        )
    files = [path.parent / name for name in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{path}: shard files {missing} listed in the index are missing")
    return files, weight_map


def _one_of_several(name: str) -> bool:
    """A shard i of n > 1 (which only its index makes part of a checkpoint)."""
    shard = SHARD_NAME.fullmatch(name)
    return shard is not None and int(shard.group(2)) > 1


def decode_headers(
    headers: list[FileHeader], where: str
) -> tuple[dict[str, Record], dict[str, FileHeader]]:
    """({entry key: Record}, {stored tensor key: the file holding it}) of one checkpoint's files.

    Two forms: qshard.save gives each file its own header, describing the entries it holds
    (their save ids must agree); transformers' save_pretrained of a qshard model repeats one
    header, describing every entry, in each of its files, and a weight's inner tensors may lie
    in different files. Every stored tensor is in one file only and described exactly once."""
    stored, holder = {}, {}
    for header in headers:
        for key in header.stored:
            if key in stored:
                raise CheckpointError(
                    f"{header.path}: tensor {key!r} is also in {holder[key].path}; the files "
                    f"come from different saves, save the model again"
                )
            stored[key], holder[key] = header.stored[key], header
    texts = {(h.metadata or {}).get(METADATA_KEY) for h in headers}
    if len(headers) > 1 and len(texts) == 1 and None not in texts:  # save_pretrained's form
        records, _ = decode_metadata(headers[0].metadata, stored, where)
        return records, holder
    records, entry_file, save_ids = {}, {}, {}
    mixed = len(texts - {None}) > 1  # several files, unlike headers
    for header in headers:
        try:
            found, save_ids[header.path.name] = decode_metadata(
                header.metadata, header.stored, str(header.path)
            )
        except CheckpointError as e:
            if not mixed:
                raise
            raise CheckpointError(
                f"{e}. The files' qshard headers differ: files of different saves, or an index "
                f"that lists files of another save; save the model again"
            ) from None
        for key, record in found.items():
            if key in records:
                raise CheckpointError(
                    f"{header.path}: entry {key!r} is also in {entry_file[key]}; the files come "
                    f"from different saves, save the model again"
                )
            records[key], entry_file[key] = record, header.path
    if len(set(save_ids.values())) > 1:
        raise CheckpointError(
            f"{where}: the files come from different saves (save ids {save_ids}); the index "
            f"and the shards are from different saves, save the model again"
        )
    return records, holder


class Checkpoint:
    """The entries of a checkpoint, with every header checked; tensor data is read on demand."""

    def __init__(self, path: str | os.PathLike):
        files, weight_map = checkpoint_files(path)
        self.headers = {file: read_header(file) for file in files}
        if weight_map is not None:
            for header in self.headers.values():
                check_index(weight_map, header)
        where = str(path)
        self.records, self.holder = decode_headers(list(self.headers.values()), where)
        for key, record in self.records.items():
            target = self.records.get(record.alias_of) if record.alias_of else record
            if target is None or target.alias_of is not None:
                raise CheckpointError(
                    f"{self.where(key)}: entry {key!r} is an alias of "
                    f"{record.alias_of!r}, which is not a stored entry of this checkpoint"
                )

    def where(self, key: str) -> pathlib.Path:
        """The file that holds entry `key` (its first stored tensor's), for messages."""
        stored = self.records[key].stored()
        return self.holder[stored[0].key].path if stored else next(iter(self.headers))

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def keys(self) -> list[str]:
        return list(self.records)

    def record(self, key: str) -> Record:
        """The record that holds `key`'s data (an alias's target)."""
        record = self.records[key]
        return self.records[record.alias_of] if record.alias_of else record

    def read(self, key: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """Entry `key`, whole, with its checksums verified."""
        record = self.record(key)
        if record.tensor is not None:
            return self._read_stored(self.holder[record.tensor.key], record.tensor).to(device)
        inner = {name: self._read_stored(self.holder[s.key], s) for name, s in record.inner.items()}
        check_qtensor(record.build(inner), f"{self.where(record.key)}: {record.key}")  # before .to
        return record.build({n: t.to(device) for n, t in inner.items()}).repack_for_device()

    def read_shard(
        self, key: str, dim: int, world: int, rank: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """Rank `rank`'s chunk (torch.chunk sizes) of entry `key` along outer `dim`, reading only
        that slice from disk. A quantized entry is first re-packed for all `world` shard
        boundaries (`QTensor.realign`), so every rank gets the packing `qshard.tp` would give.
        Along the experts dim of [E, N, K] experts a rank reads only its experts' bytes of every
        inner tensor (experts are cut anywhere)."""
        record = self.record(key)
        size = record.outer_shape()[dim]
        start, end = chunk_bounds(size, world, rank)
        if record.tensor is not None:
            header = self.holder[record.tensor.key]
            return self._read_slice(header, record.tensor, dim, start, end).to(device)
        meta = record.meta()
        logical = meta.logical_dim(dim)
        # The whole packed elements (blocks) that cover [start, end): a part of the stored
        # weight that starts and ends on its packing boundaries.
        step = meta.slice_granularity(logical)
        first, last = start - start % step, min(-(-end // step) * step, size)
        inner = {}
        for name, stored in record.inner.items():
            # Every inner tensor has the logical dims in order (a leading E for experts); one
            # index of it covers `p` of `logical`, or all of it (p None: read whole).
            header = self.holder[stored.key]
            p = meta.inner_step(name, logical)
            if p is None:
                tensor = self._read_stored(header, stored)
            else:
                tensor = self._read_slice(header, stored, logical, first // p, -(-last // p))
            inner[name] = tensor
        shape = list(record.shape)
        shape[logical] = last - first
        part = record.build(inner, shape=tuple(shape))
        what = ("experts", "rows", "columns")[logical - meta.lead + 1]
        check_qtensor(part, f"{self.where(record.key)}: {record.key} ({what} {first}..{last})")
        # Offsets of all the full weight's cuts, relative to this part: realign packs the part
        # exactly as it packs the whole weight for those cuts.
        part = part.realign(logical, [c - first for c in shard_cuts(size, world)])
        local = part.slice_logical(logical, start - first, end - first)
        return local.to(device, copy=True)  # a copy (the part is freed); _to_copy repacks

    # ---- raw reads ------------------------------------------------------------------------

    def _read_stored(self, header: FileHeader, stored: StoredTensor) -> torch.Tensor:
        return read_tensor(header, stored)

    def _read_slice(
        self, header: FileHeader, stored: StoredTensor, dim: int, start: int, end: int
    ) -> torch.Tensor:
        """Indices [start, end) of `dim` of a stored tensor, every byte read verified."""
        return read_slice(header, stored, dim, start, end)


def read_tensor(header: FileHeader, stored: StoredTensor) -> torch.Tensor:
    """A stored tensor, whole, by plain reads (no mmap: the tensor never changes with the file),
    its checksum verified where the file has one. The header checks bound its size by the
    file's."""
    buffer = torch.empty(stored.nbytes, dtype=torch.uint8)
    try:
        with open(header.path, "rb") as f:
            f.seek(header.offsets[stored.key])
            count = f.readinto(buffer.numpy()) if stored.nbytes else 0
    except OSError as e:
        raise CheckpointError(f"{header.path}: cannot read {stored.key!r} ({e})") from None
    if count != stored.nbytes:
        raise CheckpointError(
            f"{header.path}: tensor {stored.key!r} is cut short ({count} of "
            f"{stored.nbytes} bytes); the file changed while loading"
        )
    if stored.crc32 is not None and crc32(buffer) != stored.crc32:
        raise CheckpointError(
            f"{header.path}: tensor {stored.key!r} does not match its checksum; the file "
            f"is damaged, save it again"
        )
    return buffer.view(stored.dtype).reshape(stored.shape)


SLICE_STEP_BYTES = 16 << 20  # rows read and verified per step of a sliced read (peak memory)


def read_slice(
    header: FileHeader, stored: StoredTensor, dim: int, start: int, end: int
) -> torch.Tensor:
    """Indices [start, end) of `dim` of a stored tensor, by plain reads, every byte read
    verified (issue 21: a TP rank never loads a flipped byte).

    The tensor's bytes are a [rows, row_bytes] matrix: for dim 0 its rows are the tensor's, and
    [start, end) are rows; for dim d > 0 a row is everything from dim d on, and [start, end)
    is a range of columns. Rows are read in steps of about SLICE_STEP_BYTES, each step widened
    to whole checksum chunks (`chunk_crc32`) that are verified before their bytes are used. So
    a row shard reads its rows and at most a chunk either side; a column shard reads the whole
    tensor, a step at a time. A file without chunk checksums (written before them) is read
    whole and verified by its tensor checksum."""
    if stored.chunk_crc32 is None:
        return read_tensor(header, stored).narrow(dim, start, end - start).clone()
    shape, item = stored.shape, stored.dtype.itemsize
    inner = math.prod(shape[dim + 1 :]) * item  # bytes of one index of `dim`
    if dim == 0:
        rows, row_bytes, first_row, last_row = shape[0], inner, start, end
        columns = (0, inner)
    else:
        rows, row_bytes = math.prod(shape[:dim]), shape[dim] * inner
        first_row, last_row, columns = 0, rows, (start * inner, end * inner)
    out = torch.empty(last_row - first_row, columns[1] - columns[0], dtype=torch.uint8)
    step = max(1, SLICE_STEP_BYTES // max(row_bytes, 1))
    try:
        with open(header.path, "rb") as f:
            for row in range(first_row, last_row, step):
                stop = min(row + step, last_row)
                data = _verified_range(f, header, stored, row * row_bytes, stop * row_bytes)
                block = data.view(stop - row, row_bytes)[:, columns[0] : columns[1]]
                out[row - first_row : stop - first_row] = block
    except OSError as e:
        raise CheckpointError(f"{header.path}: cannot read {stored.key!r} ({e})") from None
    sliced = list(shape)
    sliced[dim] = end - start
    return out.reshape(-1).view(stored.dtype).reshape(sliced)


def _verified_range(f, header: FileHeader, stored: StoredTensor, begin: int, end: int):
    """Bytes [begin, end) of a stored tensor's data, read as the whole checksum chunks that
    cover them, each verified."""
    chunk, nbytes = stored.chunk_bytes, stored.nbytes
    first, last = begin // chunk, -(-end // chunk)
    low, high = first * chunk, min(last * chunk, nbytes)
    buffer = torch.empty(high - low, dtype=torch.uint8)
    f.seek(header.offsets[stored.key] + low)
    count = f.readinto(buffer.numpy()) if high > low else 0
    if count != high - low:
        raise CheckpointError(
            f"{header.path}: tensor {stored.key!r} is cut short; the file changed while loading"
        )
    data = buffer.numpy()
    for index in range(first, last):
        piece = data[index * chunk - low : (index + 1) * chunk - low]
        if zlib.crc32(piece) != stored.chunk_crc32[index]:
            raise CheckpointError(
                f"{header.path}: tensor {stored.key!r} does not match the checksum of its "
                f"bytes {index * chunk}..{index * chunk + len(piece)}; the file is damaged, "
                f"save it again"
            )
    return buffer[begin - low : end - low]


def check_index(weight_map: Mapping[str, str], header: FileHeader) -> None:
    listed = {k for k, f in weight_map.items() if f == header.path.name}
    if listed != set(header.stored):
        diff = sorted(listed ^ set(header.stored))[:5]
        raise CheckpointError(
            f"{header.path}: the index lists other tensors for this file than it holds "
            f"(e.g. {diff}); the index and the shards are from different saves"
        )
