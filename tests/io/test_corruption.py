"""Damaged checkpoint files: whatever a single mutation does to a valid file (a changed byte in
the header or the data, a cut, appended bytes), `qshard.load` either returns exactly the saved
tensors or raises QShardError; never another exception, never different numbers."""

from __future__ import annotations

import functools
import pathlib
import tempfile

import pytest
import torch
from helpers import LAYOUT_CASES, LAYOUT_IDS, assert_same_qtensor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qshard
from qshard import QShardError


@functools.cache
def valid_file(case: int) -> tuple[bytes, dict]:
    """A small qshard file for LAYOUT_CASES[case]: a quantized weight with partial edge blocks,
    a plain tensor, and an alias."""
    cls, config = LAYOUT_CASES[case]
    torch.manual_seed(case)
    weight = cls.from_float(torch.randn(72, 96), config)
    state = {"w": weight, "bias": torch.randn(72), "tied": None}
    state["tied"] = state["bias"]
    with tempfile.TemporaryDirectory() as directory:
        qshard.save(state, directory)
        data = pathlib.Path(directory, "model.safetensors").read_bytes()
    return data, state


def header_length(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


@st.composite
def mutations(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["header byte", "data byte", "any byte", "cut", "append"]))
    end = header_length(data)
    if kind == "cut":
        return data[: draw(st.integers(0, len(data) - 1))]
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=16))
    low, high = {"header byte": (0, end - 1), "data byte": (end, len(data) - 1)}.get(
        kind, (0, len(data) - 1)
    )
    position = draw(st.integers(low, high))
    flip = draw(st.integers(1, 255))
    mutated = bytearray(data)
    mutated[position] ^= flip
    return bytes(mutated)


@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)), ids=LAYOUT_IDS)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_mutated_file_loads_identically_or_raises_qshard_error(case, data):
    original, state = valid_file(case)
    mutated = data.draw(mutations(original))
    with tempfile.TemporaryDirectory() as directory:
        path = f"{directory}/model.safetensors"
        with open(path, "wb") as f:
            f.write(mutated)
        try:
            loaded = qshard.load(path)
        except QShardError:
            return
    # Loaded: it must be the saved state, bit for bit (the mutation hit no meaningful byte,
    # e.g. the header's padding or a whitespace that stayed whitespace).
    assert list(loaded) == list(state)
    assert_same_qtensor(loaded["w"], state["w"])
    assert torch.equal(loaded["bias"], state["bias"]) and loaded["tied"] is loaded["bias"]
