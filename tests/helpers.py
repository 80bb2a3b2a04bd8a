"""Helpers shared by the tests (imported as `helpers`; tests/ is on sys.path via conftest)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zlib

import torch

import qshard
from qshard.layouts import registered_layouts

# Every (layout, config) the contract suite runs over: a layout is covered by registering.
LAYOUT_CASES = [(cls, config) for cls in registered_layouts() for config in cls.contract_configs()]


def gpu_dtype(config) -> torch.dtype:
    """The activation dtype a GPU run of `config` takes: float32, except for the backends that
    take only bfloat16 on CUDA (tinygemm, `aten._weight_int4pack_mm`)."""
    from qshard.config import Backend

    return torch.bfloat16 if getattr(config, "backend", None) == Backend.TINYGEMM else torch.float32


def nccl_worlds() -> list:
    """The world sizes of the NCCL tests (`pytest -m cuda tests/tp`), as pytest params: those
    in QSHARD_NCCL_WORLDS (e.g. "2,4"), else each of 2, 4 and 8 that the machine's GPUs hold
    (2 alone, skipped, on a machine with fewer than 2)."""
    import pytest

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    chosen = os.environ.get("QSHARD_NCCL_WORLDS")
    worlds = [int(w) for w in chosen.split(",")] if chosen else [w for w in (2, 4, 8) if w <= count]
    return [
        pytest.param(w, marks=pytest.mark.skipif(count < w, reason=f"needs {w} GPUs"))
        for w in worlds or [2]
    ]


LAYOUT_IDS = [
    f"{cls.__name__}-{i}"
    for cls in registered_layouts()
    for i, _ in enumerate(cls.contract_configs())
]


def gaussian(*shape: int, std: float = 0.02, dtype=torch.float32, seed: int | None = None):
    """N(0, std) values; a fresh seed each call unless one is given (never zeros). The fresh
    seed comes from the OS, not `torch.seed()`, which would reseed the global generator with
    it: the test's next `torch.randn` would then repeat these very values."""
    if seed is None:
        seed = random.SystemRandom().getrandbits(63)
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * std).to(dtype)


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """||out - expected|| / ||expected||, in fp32."""
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_qtensor(a: qshard.QTensor, b: qshard.QTensor) -> None:
    """Bit-for-bit equality of two quantized tensors: class, shape, attributes, inner bytes."""
    assert type(a) is type(b), (type(a), type(b))
    assert a.logical_shape == b.logical_shape, (a.logical_shape, b.logical_shape)
    assert (a.dtype, a.transposed) == (b.dtype, b.transposed)
    assert a.attr_values() == b.attr_values(), (a.attr_values(), b.attr_values())
    for name in a.inner_names:
        x, y = getattr(a, name), getattr(b, name)
        assert (x.dtype, x.shape) == (y.dtype, y.shape), (name, x.dtype, x.shape, y.dtype, y.shape)
        assert torch.equal(raw_bytes(x), raw_bytes(y)), f"inner tensor {name!r} differs"


def assert_same_device_form(a: qshard.QTensor, b: qshard.QTensor) -> None:
    """Both have no device form, or the same one (names, meta, bytes)."""
    assert a.device_names == b.device_names, (a.device_names, b.device_names)
    assert a.device_meta == b.device_meta, (a.device_meta, b.device_meta)
    for name in a.device_names:
        x, y = getattr(a, name), getattr(b, name)
        assert (x.dtype, x.shape, x.device) == (y.dtype, y.shape, y.device), name
        assert torch.equal(raw_bytes(x), raw_bytes(y)), f"device tensor {name!r} differs"


def compile_for_sm90(script: str) -> str:
    """Run a script that compiles Gluon kernels for sm_90 in a child process and return what it
    printed (a child: the compiles need no GPU, and Gluon ignores TRITON_INTERPRET, which the
    suite may set). The script's failure fails the test with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def crc_text(text: str) -> str:
    """The checksum qshard's header keeps of its metadata text (io/format.py)."""
    return f"{zlib.crc32(text.encode()):08x}"


def edit_metadata(path, change, tensors=None) -> None:
    """Rewrite a qshard file with `change(metadata JSON)` applied (its checksum recomputed) and
    its tensors, or `tensors` ({name: tensor}) where given."""
    from safetensors import safe_open

    from qshard.io import saving
    from qshard.io.checkpoint import read_header
    from qshard.io.format import CRC_KEY, METADATA_KEY

    data = json.loads(read_header(path).metadata[METADATA_KEY])
    change(data)
    if tensors is None:
        with safe_open(str(path), "pt") as f:
            tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    text = json.dumps(data)
    with open(path, "wb") as f:
        saving._write_safetensors(tensors, {METADATA_KEY: text, CRC_KEY: crc_text(text)}, f)
