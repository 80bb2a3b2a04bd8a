"""The qshard checkpoint format: safetensors files whose header describes every state_dict entry.

A state_dict entry is stored as plain safetensors tensors:

    plain tensor   one tensor under its own key
    QTensor        one tensor per inner tensor, in the layout's canonical packing, under
                   "<key>.<inner name>" (e.g. "layers.0.mlp.up.weight.qdata", "....scale")
    alias          nothing: an entry that is the same tensor as an earlier one (tied weights)

The header's `__metadata__` (string values only, by the safetensors spec) holds

    "format": "pt"                        the Hugging Face convention
    "qshard": JSON text                   {"format_version": 1, "qshard_version": "0.1.0",
                                           "save_id": "<hex, the same in every file of a save>",
                                           "entries": {key: record, ...}} for this file's entries
    "qshard_crc32": "<8 hex digits>"      CRC-32 of the "qshard" text

with one record per entry:

    {"kind": "tensor", "tensor": stored}
    {"kind": "qtensor", "layout": "Fp8BlockwiseTensor", "shape": [N, K], "dtype": "bfloat16",
     "transposed": false, "attrs": {...}, "config": {...}, "inner": {"qdata": stored, ...}}
                                          (experts: "shape": [E, N, K], every inner tensor with
                                           a leading E; transposed: stored [E, K, N] outer)
    {"kind": "alias", "of": other key}
    stored = {"key": safetensors key, "dtype": "float8_e4m3fn", "shape": [...], "crc32": int,
              "chunk_bytes": 1048576, "chunk_crc32": [int, ...]}

`chunk_crc32` holds the CRC-32 of each `chunk_bytes` piece of the tensor's data (the last may
be shorter), so that a tensor-parallel rank that reads only its slice verifies every byte it
reads (`Checkpoint.read_shard`). Files written before it existed have only the whole-tensor
`crc32`; a sliced read of them reads and verifies the whole tensor.

Attributes are JSON values decoded by the layout's type annotations (enums by value, tuples as
lists). Every stored tensor has its CRC-32 and the metadata has its own, so a corrupted byte
anywhere in a file raises `CheckpointError` instead of loading different numbers.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import zlib
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointError, QShardError
from ..qtensor import QTensor
from ..qtensor.attrs import attr_to_json, attrs_text, decode_attrs, expect
from ..qtensor.registry import layout_by_name, registered_layouts
from ..qtensor.validation import FLOAT_DTYPES, MAX_SIZE
from ..strict_json import parse_json

__all__ = [
    "FORMAT_VERSION",
    "Record",
    "StoredTensor",
    "chunk_crcs",
    "crc32",
    "decode_metadata",
    "encode_metadata",
]

FORMAT_VERSION = 1
METADATA_KEY = "qshard"
CRC_KEY = "qshard_crc32"

# safetensors dtype names (its spec) <-> torch dtypes.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
}


CHUNK_BYTES = 1 << 20  # the checksum granularity of sliced reads: 1 MiB
MAX_CHUNK_BYTES = 1 << 30


def crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy())


def chunk_crcs(tensor: torch.Tensor, chunk: int) -> tuple[int, tuple[int, ...]]:
    """(CRC-32 of a contiguous CPU tensor's bytes, CRC-32 of each `chunk` bytes of them), in one
    pass over the data."""
    data = tensor.reshape(-1).view(torch.uint8).numpy()
    whole, pieces = 0, []
    for start in range(0, data.size, chunk):
        piece = data[start : start + chunk]
        pieces.append(zlib.crc32(piece))
        whole = zlib.crc32(piece, whole)
    return whole, tuple(pieces)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor as stored in a safetensors file."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    crc32: int | None = None  # None in files qshard did not write
    chunk_bytes: int | None = None  # None in files qshard did not write, or wrote before them
    chunk_crc32: tuple[int, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "key": self.key,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "crc32": self.crc32,
        }
        if self.chunk_crc32 is not None:
            out.update(chunk_bytes=self.chunk_bytes, chunk_crc32=list(self.chunk_crc32))
        return out

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Record:
    """How one state_dict entry is stored: a plain tensor, a QTensor's inner tensors, or an
    alias of another entry."""

    key: str
    tensor: StoredTensor | None = None  # a plain tensor
    layout: type[QTensor] | None = None  # a QTensor: its class, logical shape, dtype, attrs
    shape: tuple[int, ...] = (0, 0)  # logical: [N, K], or [E, N, K] for experts
    dtype: torch.dtype = torch.float32
    transposed: bool = False
    attrs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    inner: Mapping[str, StoredTensor] = dataclasses.field(default_factory=dict)
    alias_of: str | None = None

    def stored(self) -> list[StoredTensor]:
        return [self.tensor] if self.tensor is not None else list(self.inner.values())

    def outer_dtype(self) -> torch.dtype:
        return self.tensor.dtype if self.tensor is not None else self.dtype

    def outer_shape(self) -> tuple[int, ...]:
        if self.tensor is not None:
            return self.tensor.shape
        *lead, n, k = self.shape
        return (*lead, k, n) if self.transposed else (*lead, n, k)

    def meta(self) -> torch.Tensor:
        """A meta-device tensor with this entry's class, shape, dtype and attributes."""
        if self.tensor is not None:
            return torch.empty(self.tensor.shape, dtype=self.tensor.dtype, device="meta")
        return self.build(
            {n: torch.empty(s.shape, dtype=s.dtype, device="meta") for n, s in self.inner.items()}
        )

    def build(
        self, inner: Mapping[str, torch.Tensor], shape: tuple[int, ...] | None = None
    ) -> QTensor:
        """This entry's QTensor over `inner` (of a part of the weight when `shape` is given)."""
        assert self.layout is not None
        shape = self.shape if shape is None else shape
        return self.layout(
            inner, shape=shape, dtype=self.dtype, transposed=self.transposed, **self.attrs
        )


# ---- encoding ---------------------------------------------------------------------------------


def qtensor_record(key: str, tensor: QTensor, inner: Mapping[str, StoredTensor]) -> dict:
    cls = type(tensor)
    if cls not in registered_layouts():
        raise QShardError(
            f"qshard.save: {key!r} is a {cls.__name__}, which is not a registered layout; "
            f"decorate the class with @qshard.register_layout(ItsConfig) so it can be loaded"
        )
    return {
        "kind": "qtensor",
        "layout": cls.__name__,
        "shape": list(tensor.logical_shape),
        "dtype": dtype_name(tensor.dtype),
        "transposed": tensor.transposed,
        "attrs": {name: attr_to_json(value) for name, value in tensor.attrs().items()},
        "config": tensor.config().to_dict(),
        "inner": {name: stored.to_json() for name, stored in inner.items()},
    }


def encode_metadata(
    records: Mapping[str, dict], qshard_version: str, save_id: str
) -> dict[str, str]:
    """The safetensors `__metadata__` of a file holding `records` ({key: record JSON});
    `save_id` is shared by the files of one save."""
    header = {
        "format_version": FORMAT_VERSION,
        "qshard_version": qshard_version,
        "save_id": save_id,
        "entries": records,
    }
    text = json.dumps(header, separators=(",", ":"))
    return {"format": "pt", METADATA_KEY: text, CRC_KEY: f"{zlib.crc32(text.encode()):08x}"}


# ---- decoding ---------------------------------------------------------------------------------


def decode_metadata(
    metadata: Mapping[str, str] | None, stored: Mapping[str, StoredTensor], where: str
) -> tuple[dict[str, Record], str | None]:
    """({entry key: Record}, save id) of one file, from its `__metadata__` and stored tensors.

    A file qshard did not write (no "qshard" metadata) holds plain tensors under their keys.
    """
    metadata = metadata or {}
    if METADATA_KEY not in metadata and CRC_KEY not in metadata:
        _refuse_orphan_inner_tensors(stored, where)
        return {key: Record(key, tensor=t) for key, t in stored.items()}, None
    text, crc = metadata.get(METADATA_KEY), metadata.get(CRC_KEY)
    if not isinstance(text, str) or not isinstance(crc, str):
        raise CheckpointError(
            f"{where}: header metadata has only one of {METADATA_KEY!r} and {CRC_KEY!r}; the "
            f"file is damaged, save it again"
        )
    # surrogatepass: a JSON "\udcff" escape decodes to a lone surrogate, which plain UTF-8
    # cannot encode; qshard never writes one, so such a text fails the checksum.
    if f"{zlib.crc32(text.encode('utf-8', 'surrogatepass')):08x}" != crc:
        raise CheckpointError(
            f"{where}: the qshard header metadata does not match its checksum {crc}; the file "
            f"is damaged, save it again"
        )
    data = parse_json(text, f"{where}: the qshard header metadata")
    _check_version(data, where)
    entries = expect(data.get("entries"), dict, "entries", where)
    records = {key: _decode_record(key, raw, stored, where) for key, raw in entries.items()}
    described = collections.Counter(s.key for r in records.values() for s in r.stored())
    extra = sorted(set(stored) - set(described))
    twice = sorted(k for k, count in described.items() if count > 1)
    if extra or twice:
        raise CheckpointError(
            f"{where}: stored tensors {extra or twice} are "
            f"{'described by no' if extra else 'claimed by more than one'} qshard entry; the "
            f"header does not describe this file"
        )
    return records, expect(data.get("save_id"), str, "save_id", where)


def _refuse_orphan_inner_tensors(stored: Mapping[str, StoredTensor], where: str) -> None:
    """A file without qshard metadata holds plain tensors; but one holding every inner tensor of
    a registered layout under one prefix (`w.qdata`, `w.scale`, ...) is a qshard file whose
    metadata was removed or damaged: loading it would give raw codes and scales as numbers."""
    # The layout with the most inner tensors first: FP8's (qdata, scale) are a part of NVFP4's.
    for layout in sorted(registered_layouts(), key=lambda cls: -len(cls.inner_names)):
        first = f".{layout.inner_names[0]}"
        for key in stored:
            prefix = key.removesuffix(first)
            if key.endswith(first) and all(f"{prefix}.{n}" in stored for n in layout.inner_names):
                raise CheckpointError(
                    f"{where}: tensors {[f'{prefix}.{n}' for n in layout.inner_names]} are the "
                    f"inner tensors of a quantized {layout.__name__}, but the file has no qshard "
                    f"metadata to say so (its header was damaged or rewritten); save it again "
                    f"with qshard.save"
                )


def _check_version(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise CheckpointError(f"{where}: qshard header metadata is {type(data).__name__}, not {{}}")
    version = data.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{where}: format_version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{where}: written by qshard {data.get('qshard_version')!r} in checkpoint format "
            f"{version}; this qshard reads formats <= {FORMAT_VERSION}; upgrade qshard"
        )


def _decode_record(key: str, raw: Any, stored: Mapping[str, StoredTensor], where: str) -> Record:
    at = f"{where}: entry {key!r}"
    raw = expect(raw, dict, "record", at)
    kind = raw.get("kind")
    if kind == "alias":
        return Record(key, alias_of=expect(raw.get("of"), str, "of", at))
    if kind == "tensor":
        return Record(key, tensor=_decode_stored(raw.get("tensor"), stored, at))
    if kind != "qtensor":
        raise CheckpointError(f"{at}: kind {kind!r} is not 'tensor', 'qtensor' or 'alias'")
    name = expect(raw.get("layout"), str, "layout", at)
    layout = layout_by_name(name)
    if layout is None:
        known = [c.__name__ for c in registered_layouts()]
        raise CheckpointError(
            f"{at}: layout {name!r} is not registered in this qshard (known: {known}); "
            f"upgrade qshard or import the package that registers it"
        )
    shape = _expect_ints(raw.get("shape"), None, "shape", at)
    if len(shape) not in (2, 3):
        raise CheckpointError(
            f"{at}: shape {list(shape)} has {len(shape)} dims; a quantized weight is [N, K] "
            f"or experts [E, N, K]"
        )
    if max(shape) > MAX_SIZE:
        raise CheckpointError(f"{at}: shape {list(shape)} has a size above {MAX_SIZE}")
    dtype = _decode_dtype(raw.get("dtype"), at)
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(
            f"{at}: a quantized weight stands for a {dtype}; expected one of "
            f"{[dtype_name(d) for d in FLOAT_DTYPES]}"
        )
    transposed = expect(raw.get("transposed"), bool, "transposed", at)
    attrs = decode_attrs(layout, expect(raw.get("attrs"), dict, "attrs", at), at)
    inner_raw = expect(raw.get("inner"), dict, "inner", at)
    if sorted(inner_raw) != sorted(layout.inner_names):
        raise CheckpointError(
            f"{at}: inner tensors {sorted(inner_raw)}; {name} has {list(layout.inner_names)}"
        )
    inner = {n: _decode_stored(inner_raw[n], stored, f"{at}.{n}") for n in layout.inner_names}
    specs = layout.inner_specs(shape, attrs)
    for n, s in inner.items():
        expected_shape, expected_dtype = specs[n]
        if s.shape != tuple(expected_shape) or s.dtype != expected_dtype:
            raise CheckpointError(
                f"{at}: inner tensor {n!r} is {dtype_name(s.dtype)}{list(s.shape)}; a {name} "
                f"of shape {list(shape)} with {attrs_text(attrs)} needs "
                f"{dtype_name(expected_dtype)}{list(expected_shape)}"
            )
    return Record(
        key,
        layout=layout,
        shape=shape,
        dtype=dtype,
        transposed=transposed,
        attrs=attrs,
        inner=inner,
    )


def _decode_stored(raw: Any, stored: Mapping[str, StoredTensor], at: str) -> StoredTensor:
    raw = expect(raw, dict, "stored tensor", at)
    key = expect(raw.get("key"), str, "key", at)
    dtype = _decode_dtype(raw.get("dtype"), at)
    shape = _expect_ints(raw.get("shape"), None, "shape", at)
    crc = expect(raw.get("crc32"), int, "crc32", at)
    chunk_bytes, chunks = raw.get("chunk_bytes"), raw.get("chunk_crc32")
    if chunk_bytes is not None or chunks is not None:
        chunk_bytes = expect(chunk_bytes, int, "chunk_bytes", at)
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise CheckpointError(f"{at}: chunk_bytes {chunk_bytes} is not in 1..{MAX_CHUNK_BYTES}")
        chunks = _expect_ints(chunks, None, "chunk_crc32", at)
        count = -(-math.prod(shape) * dtype.itemsize // chunk_bytes)
        if len(chunks) != count:
            raise CheckpointError(
                f"{at}: {len(chunks)} chunk checksums; {dtype_name(dtype)}{list(shape)} in "
                f"{chunk_bytes}-byte chunks has {count}"
            )
    actual = stored.get(key)
    if actual is None:
        raise CheckpointError(f"{at}: stored tensor {key!r} is not in the file")
    if (actual.dtype, actual.shape) != (dtype, shape):
        raise CheckpointError(
            f"{at}: stored tensor {key!r} is {dtype_name(actual.dtype)}{list(actual.shape)} in "
            f"the file, {dtype_name(dtype)}{list(shape)} in the qshard metadata"
        )
    return StoredTensor(key, dtype, shape, crc, chunk_bytes, chunks)


def _decode_dtype(raw: Any, at: str) -> torch.dtype:
    dtype = getattr(torch, raw, None) if isinstance(raw, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{at}: dtype {raw!r} is not a torch dtype name")
    return dtype


def _expect_ints(value: Any, length: int | None, what: str, at: str) -> tuple[int, ...]:
    ok = isinstance(value, list) and (length is None or len(value) == length)
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        size = f"{length} " if length else ""
        raise CheckpointError(f"{at}: {what} {value!r} is not a list of {size}sizes >= 0")
    return tuple(value)
