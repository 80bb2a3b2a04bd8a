"""QTensor base mechanics that do not depend on a layout's numerics."""

from __future__ import annotations

import pytest
import torch
from helpers import gaussian

import qshard
from qshard import Fp8BlockwiseTensor, QTensor
from qshard.errors import UnsupportedOpError


def test_transpose_is_a_flag_with_no_data_movement():
    q = Fp8BlockwiseTensor.from_float(gaussian(96, 160))
    t = q.t()
    assert t.shape == (160, 96) and t.transposed and t.stride() == (1, 160)
    assert t.qdata.data_ptr() == q.qdata.data_ptr()
    assert not t.t().transposed
    assert torch.equal(t.dequantize(), q.dequantize().t())
    assert q.transpose(0, 1).transposed and q.permute(1, 0).transposed
    assert not q.transpose(1, 1).transposed


def test_views_that_keep_the_shape_and_those_that_do_not():
    q = Fp8BlockwiseTensor.from_float(gaussian(64, 128))
    assert q.view(64, 128).shape == (64, 128) and q.reshape(-1, 128).shape == (64, 128)
    with pytest.raises(UnsupportedOpError, match="keeps its shape"):
        q.view(128, 64)


def test_as_strided_views_the_weight_as_itself_or_swapped():
    """What torch.compile's AOT autograd calls to re-make a graph output that aliases an input
    QTensor (tests/tp/test_transformers_ep.py): itself or the last two dims swapped, no copy."""
    q = Fp8BlockwiseTensor.from_float(gaussian(4, 64, 96))  # experts
    same = q.as_strided(q.shape, q.stride())
    assert not same.transposed and same.qdata.data_ptr() == q.qdata.data_ptr()
    swapped = q.as_strided((4, 96, 64), (64 * 96, 1, 96), 0)
    assert swapped.transposed and torch.equal(swapped.dequantize(), q.dequantize().mT)
    with pytest.raises(UnsupportedOpError, match="as itself or with its last two dims swapped"):
        q.as_strided((2, 64, 96), q.stride())
    with pytest.raises(UnsupportedOpError, match="as itself"):
        q.as_strided(q.shape, q.stride(), 64 * 96)


def test_chunk_and_negative_slices():
    q = Fp8BlockwiseTensor.from_float(gaussian(256, 256))
    _, bottom = q.chunk(2)
    assert torch.equal(bottom.dequantize(), q.dequantize()[128:])
    assert torch.equal(q[-128:].dequantize(), bottom.dequantize())
    assert torch.equal(q[:, -128:].dequantize(), q.dequantize()[:, 128:])
    empty = q[5:5]
    assert isinstance(empty, Fp8BlockwiseTensor) and empty.shape == (0, 256)
    empty.validate()
    with pytest.raises(UnsupportedOpError, match="step"):
        q[::2]


def test_narrow_aliases_the_parent_storage():
    q = Fp8BlockwiseTensor.from_float(gaussian(256, 128))
    view = q.narrow(0, 128, 128)
    assert view.qdata.data_ptr() == q.qdata[128:].data_ptr()
    assert view.scale.data_ptr() == q.scale[1:].data_ptr()


def test_shallow_copy_type_is_reported_incompatible():
    q = Fp8BlockwiseTensor.from_float(gaussian(32, 32))
    # nn.Module._apply must swap whole tensors: set_data would keep stale inner tensors.
    assert torch._has_compatible_shallow_copy_type(q, q.clone()) is False


def test_registry_lists_the_fp8_layout():
    assert Fp8BlockwiseTensor in qshard.registered_layouts()
    assert issubclass(Fp8BlockwiseTensor, QTensor)
    assert Fp8BlockwiseTensor.__mro__.index(QTensor) == 1  # two levels of inheritance at most


def test_bad_dims_and_split_sizes_raise_typed_errors():
    from qshard.errors import InvalidDimError, QShardError

    q = Fp8BlockwiseTensor.from_float(gaussian(256, 384))
    for bad in (lambda: q.transpose(0, 2), lambda: q.permute(1, 1), lambda: q.split(64, 2)):
        with pytest.raises(InvalidDimError):
            bad()
    for sizes in ([128, 64], [256, 128], [-128, 384]):
        with pytest.raises(QShardError, match="add up"):
            q.split(sizes)
    with pytest.raises(QShardError, match="> 0"):
        q.split(0)
    with pytest.raises(InvalidDimError):
        torch.cat([q, q], 2)


def test_cat_accepts_empty_pieces_anywhere():
    q = Fp8BlockwiseTensor.from_float(gaussian(100, 128))
    for pieces in ([q, q[0:0]], [q[0:0], q]):
        joined = torch.cat(pieces)
        assert joined.shape == (100, 128) and torch.equal(joined.dequantize(), q.dequantize())
