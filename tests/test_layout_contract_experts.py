"""The layout contract over 3-D experts weights [E, N, K] (docs/design.md invariant 8), for every
registered layout, as tests/test_layout_contract.py runs it over 2-D weights.

Expert e of `from_float(W)` is bit for bit `from_float(W[e])`; slicing experts, N and K commutes
with the packing; split/chunk/cat/unbind/stack, copy_ into views, w[ids], serialization and the
one validation (invariant 9) work per expert; the grouped matmuls transformers' experts
implementations call equal each expert's own 2-D `F.linear`.
"""

from __future__ import annotations

import contextlib
import io
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import LAYOUT_CASES, LAYOUT_IDS, assert_same_qtensor, gaussian
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qshard
from qshard.errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    InputMismatchError,
    InvalidDimError,
    LayoutMismatchError,
    MisalignedSliceError,
    QShardError,
    UnsupportedOpError,
    UnsupportedWeightError,
)
from qshard.qtensor.validation import check_qtensor

# Fewer examples than the 2-D suite: every example quantizes several experts.
HYPOTHESIS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])

COMPILED_VS_EAGER_MIN_SQNR_DB = 60.0

cases = pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)

LAYOUT_CLASSES = sorted({c for c, _ in LAYOUT_CASES}, key=lambda c: c.__name__)


def granularity(cls, config) -> tuple[int, int]:
    """(rows, columns) step at which every expert's inner tensors can be cut."""
    probe = cls.from_float(gaussian(1, 8, 8), config)
    return probe.slice_granularity(1), probe.slice_granularity(2)


def quantize_like_per_expert(q, part: torch.Tensor, at: tuple[int, int, int]):
    """`part` (experts at[0]... of the float weight q came from, rows and columns from at[1:])
    quantized as q's experts quantized it, one expert at a time through the 2-D quantize_like:
    the reference for slices of experts that does not depend on the 3-D `quantize_like`."""
    e0, r0, c0 = at
    experts = [q[e0 + i].quantize_like(w, at=(r0, c0)) for i, w in enumerate(part.unbind(0))]
    return type(q).stack_experts(experts)


@st.composite
def sizes_and_ranges(draw, step: int, most: int = 2):
    """A dim size with a partial edge block sometimes, and an aligned [start, end) in it."""
    size = draw(st.integers(1, most)) * step + draw(st.sampled_from([0, step // 2, 1]))
    cuts = sorted({*draw(st.lists(st.integers(0, size // step), min_size=2, max_size=2))})
    start = cuts[0] * step
    end = cuts[-1] * step if len(cuts) > 1 and draw(st.booleans()) else size
    return size, start, max(start, end)


@st.composite
def experts_and_range(draw):
    """E and any [start, end) of experts (experts are cut anywhere)."""
    experts = draw(st.integers(1, 3))
    start = draw(st.integers(0, experts - 1))
    return experts, start, draw(st.integers(start + 1, experts))


# ---- expert e is that expert quantized alone (invariant 8) ----------------------------------


@cases
@HYPOTHESIS
@given(data=st.data())
def test_expert_view_is_the_expert_quantized_alone(cls, config, data):
    gn, gk = granularity(cls, config)
    n, _, _ = data.draw(sizes_and_ranges(gn), label="rows")
    k, _, _ = data.draw(sizes_and_ranges(gk), label="cols")
    e = data.draw(st.integers(1, 3), label="experts")
    w = gaussian(e, n, k, seed=data.draw(st.integers(0, 2**31)))
    q = cls.from_float(w, config)
    assert q.shape == (e, n, k) and q.logical_shape == (e, n, k) and q.experts == e
    q.validate()
    alone = [cls.from_float(w[i], config) for i in range(e)]
    for i in range(e):
        assert_same_qtensor(q[i], alone[i])
        assert q[i].shape == (n, k) and q[i].experts is None
    assert_same_qtensor(q[-1], alone[-1])
    for got, expected in zip(q.unbind(0), alone, strict=True):
        assert_same_qtensor(got, expected)
    assert torch.equal(q.dequantize(), torch.stack([a.dequantize() for a in alone]))
    # The transposed [E, K, N] storage (gpt-oss): the same packing, blocks along K.
    q_t = q.transpose(-2, -1)
    assert q_t.shape == (e, k, n) and q_t.logical_shape == (e, n, k) and q_t.transposed
    for i in range(e):
        assert_same_qtensor(q_t[i], alone[i].t())
    assert torch.equal(q_t.dequantize(), torch.stack([a.dequantize().t() for a in alone]))
    assert_same_qtensor(q_t.transpose(-2, -1), q)
    assert_same_qtensor(q.transpose(1, 2), q_t)


# ---- packing commutes with slicing (invariants 1 and 8) ---------------------------------------


@cases
@HYPOTHESIS
@given(data=st.data())
def test_slicing_experts_rows_and_columns_commutes_with_packing(cls, config, data):
    gn, gk = granularity(cls, config)
    e, e0, e1 = data.draw(experts_and_range(), label="experts")
    n, r0, r1 = data.draw(sizes_and_ranges(gn), label="rows")
    k, c0, c1 = data.draw(sizes_and_ranges(gk), label="cols")
    w = gaussian(e, n, k, seed=data.draw(st.integers(0, 2**31)))
    q = cls.from_float(w, config)
    sliced = q[e0:e1, r0:r1, c0:c1]
    assert sliced.shape == (e1 - e0, r1 - r0, c1 - c0)
    part = w[e0:e1, r0:r1, c0:c1]
    if r1 > r0 and c1 > c0:
        assert_same_qtensor(sliced, quantize_like_per_expert(q, part, (e0, r0, c0)))
    assert torch.equal(sliced.dequantize(), q.dequantize()[e0:e1, r0:r1, c0:c1])
    # Each dim alone, through slice_logical (logical dims 0 = E, 1 = N, 2 = K) and indexing.
    assert_same_qtensor(q.slice_logical(0, e0, e1), q[e0:e1])
    assert_same_qtensor(q.slice_logical(1, r0, r1), q[:, r0:r1])
    assert_same_qtensor(q.slice_logical(2, c0, c1), q[:, :, c0:c1])
    if r1 > r0 and c1 > c0:
        for i in range(e1 - e0):  # a slice of experts' expert i is expert e0 + i sliced
            assert_same_qtensor(sliced[i], q[e0 + i][r0:r1, c0:c1])
    # The same through the transposed [E, K, N] view.
    q_t = q.transpose(-2, -1)
    assert_same_qtensor(q_t[e0:e1, c0:c1, r0:r1], sliced.transpose(-2, -1))
    assert torch.equal(q_t[e0:e1, c0:c1, r0:r1].dequantize(), sliced.dequantize().transpose(1, 2))


@pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)
def test_quantize_like_takes_an_experts_offset(cls, config):
    """`q.quantize_like(W[e0:e1, r0:r1, c0:c1], at=(e0, r0, c0))` equals the slice: per-expert
    state (NVFP4's global scale, FP8 per-row scales) is that of experts e0..e1, rows r0..r1."""
    gn, gk = granularity(cls, config)
    w = gaussian(4, 3 * gn + 1, 3 * gk + 1)
    q = cls.from_float(w, config)
    e0, e1, r0, r1, c0, c1 = 1, 3, gn, 2 * gn, gk, 3 * gk
    expected = q[e0:e1, r0:r1, c0:c1]
    assert_same_qtensor(q.quantize_like(w[e0:e1, r0:r1, c0:c1], at=(e0, r0, c0)), expected)
    assert_same_qtensor(q.quantize_like(w[e0:e1], at=(e0, 0, 0)), q[e0:e1])
    # A 2-D part of one expert: that expert's per-expert state, its rows'.
    part = q.quantize_like(w[e1, r0:r1, c0:c1], at=(e1, r0, c0))
    assert_same_qtensor(part, q[e1, r0:r1, c0:c1])
    assert_same_qtensor(q.quantize_like(w), q)


@cases
def test_from_float_part_of_experts_equals_the_part_of_from_float(cls, config):
    """Shard-then-quantize equals quantize-then-shard for experts (a TP shard of every expert's
    rows, given the whole float experts)."""
    gn, _ = granularity(cls, config)
    w = gaussian(3, 2 * gn + 1, 96)
    q = cls.from_float(w, config)
    assert_same_qtensor(cls.from_float_part(w[:, gn:], w, config), q[:, gn:])
    assert_same_qtensor(cls.from_float_part(w, w, config), q)


def test_a_per_row_fp8_part_that_cuts_rows_of_a_plain_tensor_is_a_config_error():
    """Its scales need the whole rows' amax, which a plain part and whole cannot place (a
    DTensor's placements can: tests/tp)."""
    w = gaussian(3, 64, 96)
    with pytest.raises(ConfigError, match=r"cuts its rows.*whole rows, or the DTensor"):
        qshard.Fp8RowwiseTensor.from_float_part(w[..., 32:], w, qshard.Fp8RowwiseConfig())


@cases
@HYPOTHESIS
@given(data=st.data())
def test_split_chunk_and_cat_commute_on_every_dim(cls, config, data):
    gn, gk = granularity(cls, config)
    dim = data.draw(st.sampled_from([0, 1, 2]), label="dim")
    step = (1, gn, gk)[dim]
    pieces = data.draw(st.integers(1, 3), label="pieces")
    tail = 0 if dim == 0 else data.draw(st.sampled_from([0, step // 2 or 1]), label="tail")
    shape = [2, gn + 1, gk + 1]
    shape[dim] = pieces * step + tail
    w = gaussian(*shape, seed=data.draw(st.integers(0, 2**31)))
    q = cls.from_float(w, config)

    def like(pieces_of_w):  # each float piece quantized as q's experts, at its offset along dim
        offsets = [0, *itertools.accumulate(p.shape[dim] for p in pieces_of_w)]
        out = []
        for p, o in zip(pieces_of_w, offsets, strict=False):
            at = [0, 0, 0]
            at[dim] = o
            out.append(quantize_like_per_expert(q, p, tuple(at)))
        return out

    parts = q.split(step, dim)
    assert len(parts) == len(w.split(step, dim))
    for part, negative in zip(parts, q.split(step, dim - 3), strict=True):
        assert_same_qtensor(part, negative)
    for part, expected in zip(parts, like(w.split(step, dim)), strict=True):
        assert_same_qtensor(part, expected)
    assert_same_qtensor(torch.cat(parts, dim), q)
    sizes = [step] * (pieces - 1) + [step + tail]
    for part, expected in zip(q.split(sizes, dim), like(w.split(sizes, dim)), strict=True):
        assert_same_qtensor(part, expected)
    if tail == 0:
        for part, expected in zip(q.chunk(pieces, dim), like(w.chunk(pieces, dim)), strict=True):
            assert_same_qtensor(part, expected)
    outer = dim if dim == 0 else 3 - dim  # the same logical dim of the transposed view
    for part, expected in zip(
        q.transpose(-2, -1).split(step, outer), like(w.split(step, dim)), strict=True
    ):
        assert_same_qtensor(part.transpose(-2, -1), expected)
    if dim == 0:  # whole experts quantized on their own are pieces of the whole
        alone = [cls.from_float(p, config) for p in w.split(1, 0)]
        assert_same_qtensor(torch.cat(alone, 0), q)
        for part, expected in zip(q.narrow(0, 0, pieces).unbind(0), alone, strict=True):
            assert_same_qtensor(part, expected[0])
    halves = like(w.chunk(2, dim))
    if halves[0].logical_shape[dim] % step == 0:
        assert_same_qtensor(torch.cat(halves, dim), q)
    else:
        with pytest.raises(QShardError, match="multiple"):
            torch.cat(halves, dim)


@cases
def test_stack_of_2d_weights_makes_experts(cls, config):
    w = gaussian(3, 70, 96)
    alone = [cls.from_float(w[i], config) for i in range(3)]
    stacked = torch.stack(alone)
    assert_same_qtensor(stacked, cls.from_float(w, config))
    assert stacked.shape == (3, 70, 96)
    with pytest.raises(UnsupportedOpError):
        torch.stack(alone, dim=1)
    with pytest.raises(LayoutMismatchError):
        torch.stack([alone[0], alone[1][:, :64]])
    with pytest.raises(LayoutMismatchError):
        torch.stack([alone[0], alone[1].to(torch.float16)])


# ---- misaligned slices are exact or refused (invariants 2 and 8) -----------------------------


@cases
@HYPOTHESIS
@given(data=st.data())
def test_misaligned_slice_of_experts_is_exact_or_raises(cls, config, data):
    n, k = 2 * 64 + 5, 2 * 64 + 7
    q = cls.from_float(gaussian(2, n, k, seed=data.draw(st.integers(0, 2**31))), config)
    dim = data.draw(st.sampled_from([1, 2]), label="dim")
    size = (n, k)[dim - 1]
    start = data.draw(st.integers(0, size - 1), label="start")
    end = data.draw(st.integers(start, size), label="end")
    index = [slice(None)] * 3
    index[dim] = slice(start, end)
    index = tuple(index)
    try:
        sliced = q[index]
    except MisalignedSliceError as e:
        assert str(q.misaligned_offsets(dim, (start, end))) in str(e) and "multiples" in str(e)
        assert "experts weight" in str(e)
        return
    expected = q.dequantize()[index]
    assert torch.equal(sliced.dequantize(), expected)
    for i in range(2):  # every expert re-packed alike: expert i is its own slice
        assert torch.equal(sliced[i].dequantize(), q[i].dequantize()[index[1:]])


@cases
@HYPOTHESIS
@given(data=st.data())
def test_realign_of_experts_packs_each_expert_as_alone(cls, config, data):
    """realign(dim, offsets) of experts re-packs every expert as its own 2-D realign would."""
    n, k = 2 * 64 + 5, 2 * 64 + 7
    q = cls.from_float(gaussian(2, n, k, seed=data.draw(st.integers(0, 2**31))), config)
    dim = data.draw(st.sampled_from([1, 2]), label="dim")
    size, step = (n, k)[dim - 1], q.slice_granularity(dim)
    unit = max(data.draw(st.sampled_from([step // 2, step // 4, 16, 1])), 1)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, (size - 1) // unit), max_size=2))))
    cuts = [c * unit for c in cuts]
    try:
        whole = q.realign(dim, cuts)
    except MisalignedSliceError:
        with pytest.raises(MisalignedSliceError):
            q[0].realign(dim - 1, cuts)
        return
    for i in range(2):
        assert_same_qtensor(whole[i].clone(), q[i].realign(dim - 1, cuts).clone())
    assert torch.equal(whole.dequantize(), q.dequantize())
    assert not whole.misaligned_offsets(dim, cuts)


# ---- copy_ into views writes into the parent ---------------------------------------------------


def shared_inner_names(q) -> list[str]:
    """Inner tensors one value of which covers a whole expert (NVFP4's global scale)."""
    return [name for name, p in q.packing().items() if p is None]


@cases
def test_copy_into_experts_writes_into_parent(cls, config):
    gn, gk = granularity(cls, config)
    w = gaussian(4, 2 * gn + 1, 2 * gk + 1)
    q = cls.from_float(w, config)
    expected = w.clone()
    # Whole experts (narrow of dim 0, w[e]): their own values, global scales included.
    update = gaussian(2, *w.shape[1:], std=0.05)
    q.narrow(0, 1, 2).copy_(cls.from_float(update, config))
    expected[1:3] = update
    assert_same_qtensor(q, cls.from_float(expected, config))
    single = gaussian(*w.shape[1:], std=0.005)
    q[3].copy_(cls.from_float(single, config))
    expected[3] = single
    assert_same_qtensor(q, cls.from_float(expected, config))
    q[:1].copy_(cls.from_float(expected[:1].clone(), config))  # the same values: no change
    assert_same_qtensor(q, cls.from_float(expected, config))
    for name in shared_inner_names(q):  # replacing experts replaced their whole-expert values
        assert torch.equal(getattr(q, name)[3], getattr(cls.from_float(single, config), name))
    # A part of an expert's rows, quantized as that expert: written through.
    rows = gaussian(gn, w.shape[2], std=0.02)
    q[2].narrow(0, gn, gn).copy_(q[2].quantize_like(rows, at=(gn, 0)))
    expected[2, gn : 2 * gn] = rows
    assert torch.equal(q[2].dequantize(), q[2].quantize_like(expected[2]).dequantize())
    for e in (0, 1, 3):
        assert_same_qtensor(q[e], cls.from_float(expected[e], config))
    # Through the transposed [E, K, N] view (gpt-oss storage): q_t[e] is expert e transposed.
    again = gaussian(*w.shape[1:], std=0.01)
    q.transpose(-2, -1)[0].copy_(cls.from_float(again, config).t())
    expected[0] = again
    assert_same_qtensor(q[0], cls.from_float(again, config))
    # The same rows of every expert at once (a TP shard of N inside all experts).
    rows3 = gaussian(4, gn, w.shape[2], std=0.02)
    q.narrow(1, 0, gn).copy_(quantize_like_per_expert(q, rows3, (0, 0, 0)))
    expected[:, :gn] = rows3
    assert_same_qtensor(q, quantize_like_per_expert(q, expected, (0, 0, 0)))
    # The same columns of every expert (a TP shard of K), with each expert's row scales.
    cols3 = gaussian(4, w.shape[1], gk, std=0.02)
    q.narrow(2, gk, gk).copy_(quantize_like_per_expert(q, cols3, (0, 0, gk)))
    expected[:, :, gk : 2 * gk] = cols3
    assert_same_qtensor(q, quantize_like_per_expert(q, expected, (0, 0, 0)))


@cases
def test_copy_into_part_of_an_expert_with_other_shared_values_is_refused(cls, config):
    gn, gk = granularity(cls, config)
    w = gaussian(3, 2 * gn + 1, 2 * gk + 1)
    q = cls.from_float(w, config)
    rows = gaussian(gn, w.shape[2], std=0.5)  # its own global scale differs from expert 1's
    source = cls.from_float(rows, config)
    before = {n: t.clone() for n, t in q.inner_tensors().items()}
    shared = [
        n for n in shared_inner_names(q) if not torch.equal(getattr(q[1], n), getattr(source, n))
    ]
    if not shared:  # no whole-expert value: a part of the rows carries all of its own scales
        q[1].narrow(0, gn, gn).copy_(source)
        assert torch.equal(q[1].dequantize()[gn : 2 * gn], source.dequantize())
        return
    with pytest.raises(LayoutMismatchError, match=shared[0]):
        q[1].narrow(0, gn, gn).copy_(source)
    with pytest.raises(LayoutMismatchError, match=shared[0]):
        q.narrow(1, gn, gn)[1].copy_(source)
    with pytest.raises(LayoutMismatchError, match=shared[0]):
        q[1:2, gn : 2 * gn].copy_(cls.from_float(rows[None], config))
    for name, tensor in before.items():  # nothing was written
        assert torch.equal(getattr(q, name), tensor), name


@cases
def test_copy_into_part_of_an_experts_columns_with_other_row_values_is_refused(cls, config):
    """A value shared by the parts of a row's columns (FP8 per-row scales, NVFP4's global
    scale) is refused from a source quantized on its own, as in 2-D."""
    gn, gk = granularity(cls, config)
    w = gaussian(3, 2 * gn + 1, 2 * gk + 1)
    q = cls.from_float(w, config)
    cols = gaussian(w.shape[1], gk, std=0.5)
    source = cls.from_float(cols, config)
    view = q[1].narrow(1, gk, gk)
    shared = [
        n
        for n in cls.inner_names
        if view.inner_step(n, 1) is None and not torch.equal(getattr(view, n), getattr(source, n))
    ]
    before = {n: t.clone() for n, t in q.inner_tensors().items()}
    if not shared:
        view.copy_(source)
        assert torch.equal(q[1].dequantize()[:, gk : 2 * gk], source.dequantize())
        return
    with pytest.raises(LayoutMismatchError, match=shared[0]):
        view.copy_(source)
    with pytest.raises(LayoutMismatchError, match=shared[0]):
        q[1:2, :, gk : 2 * gk].copy_(cls.from_float(cols[None], config))
    for name, tensor in before.items():
        assert torch.equal(getattr(q, name), tensor), name
    # Quantized as expert 1's columns, the same copy is written through.
    view.copy_(q[1].quantize_like(cols, at=(0, gk)))
    assert torch.equal(view.dequantize(), q[1].quantize_like(cols, at=(0, gk)).dequantize())


@cases
def test_copy_between_experts_of_other_layouts_raises(cls, config):
    q = cls.from_float(gaussian(2, 64, 64), config)
    with pytest.raises(QShardError):
        q.copy_(torch.zeros(2, 64, 64))
    with pytest.raises(QShardError):
        q.copy_(cls.from_float(gaussian(2, 64, 64), config).to(torch.float16))
    with pytest.raises(LayoutMismatchError):
        q.copy_(cls.from_float(gaussian(3, 64, 64), config))
    with pytest.raises(LayoutMismatchError):
        q.copy_(cls.from_float(gaussian(2, 64, 64), config).transpose(-2, -1))


# ---- w[ids] --------------------------------------------------------------------------------


@cases
def test_index_with_expert_ids_gathers(cls, config):
    w = gaussian(4, 70, 96)
    q = cls.from_float(w, config)
    ids = torch.tensor([3, 0, 3])
    gathered = q[ids]
    assert gathered.shape == (3, 70, 96)
    assert_same_qtensor(gathered, cls.from_float(w[ids], config))
    assert_same_qtensor(gathered, torch.stack([q[3], q[0], q[3]]))
    stored = [n for n in cls.inner_names if getattr(q, n).numel()]
    for name in stored:  # a copy, not a view
        assert getattr(gathered, name).data_ptr() != getattr(q, name).data_ptr()
    assert_same_qtensor(q[torch.tensor([-1, 1])], torch.stack([q[3], q[1]]))
    assert_same_qtensor(q[torch.tensor(2)], q[2])  # the eager experts loop's index
    assert_same_qtensor(q[torch.tensor([False, True, False, True])], torch.stack([q[1], q[3]]))
    q_t = q.transpose(-2, -1)
    assert_same_qtensor(q_t[ids], gathered.transpose(-2, -1))
    for bad in ([4], [0, -5], [7, 1]):  # what torch does for a plain tensor
        with pytest.raises(IndexError):
            w[torch.tensor(bad)]
        with pytest.raises(IndexError):
            q[torch.tensor(bad)]
    for bad in (4, -5):
        with pytest.raises(IndexError):
            q[bad]


# ---- flatten, copies, allocation, serialization ------------------------------------------------


@cases
@pytest.mark.parametrize("transposed", [False, True], ids=["ENK", "EKN"])
def test_flatten_unflatten_round_trip(cls, config, transposed):
    q = cls.from_float(gaussian(3, 70, 96), config)
    q = q.transpose(-2, -1) if transposed else q
    names, ctx = q.__tensor_flatten__()
    assert names == list(cls.inner_names) + list(q.device_names)
    again = cls.__tensor_unflatten__({n: getattr(q, n) for n in names}, ctx, q.shape, q.stride())
    assert_same_qtensor(q, again)
    assert again.shape == q.shape and again.stride() == q.stride()
    again.validate()


@cases
def test_clone_detach_to(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    clone = q.clone()
    assert_same_qtensor(q, clone)
    stored = [n for n in cls.inner_names if getattr(q, n).numel()]
    for name in stored:
        assert getattr(clone, name).data_ptr() != getattr(q, name).data_ptr()
        assert getattr(q.detach(), name).data_ptr() == getattr(q, name).data_ptr()
    assert_same_qtensor(q.detach(), q)
    half = q.to(torch.float16)
    assert isinstance(half, cls) and half.dtype == torch.float16 and half.shape == q.shape
    assert torch.equal(half.dequantize(), q.dequantize(torch.float16))
    assert torch.equal(half[1].dequantize(), q[1].dequantize(torch.float16))
    for name in stored:
        assert getattr(half, name).data_ptr() != getattr(q, name).data_ptr()
    meta = q.to("meta")
    assert isinstance(meta, cls) and meta.shape == q.shape
    assert all(t.is_meta for t in meta.inner_tensors().values())
    with pytest.raises(UnsupportedOpError, match="dequantize"):
        q.to(torch.int8)
    assert cls.__name__ in repr(q) and str(list(q.shape)) in repr(q)


@cases
def test_empty_like_and_new_empty_with_experts_sizes(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    empty = torch.empty_like(q)
    assert isinstance(empty, cls) and empty.shape == q.shape and empty.experts == 3
    empty.validate()
    other = q.new_empty((5, 32, 64))
    assert isinstance(other, cls) and other.shape == (5, 32, 64) and other.experts == 5
    other.validate()
    flat = q.new_empty((32, 64))  # a 2-D weight of the same layout
    assert flat.experts is None and flat.shape == (32, 64)
    flat.validate()
    assert q.new_empty((2, 32, 64), dtype=torch.bfloat16).dtype == torch.bfloat16
    transposed = q.transpose(-2, -1).new_empty((2, 64, 32))  # outer [E, K, N]
    assert transposed.transposed and transposed.logical_shape == (2, 32, 64)
    transposed.validate()
    with pytest.raises(UnsupportedOpError):
        q.new_empty((2, 2, 32, 64))


def _save_load(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@cases
def test_torch_save_load_weights_only_is_exact(cls, config):
    q = cls.from_float(gaussian(3, 70, 96), config)
    loaded = _save_load({"w": q, "w_t": q.transpose(-2, -1), "part": q[1:3], "e": q[2]})
    assert_same_qtensor(loaded["w"], q)
    assert_same_qtensor(loaded["w_t"], q.transpose(-2, -1))
    assert loaded["w_t"].shape == (3, 96, 70)
    assert_same_qtensor(loaded["part"], q[1:3])
    assert_same_qtensor(loaded["e"], q[2])
    if not has_grouped_matmul(cls, config):
        return
    # A loaded tensor runs as the saved one.
    x = torch.randn(5, 96)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    assert torch.equal(
        torch._grouped_mm(x, loaded["w"].transpose(-2, -1), offs=offs),
        torch._grouped_mm(x, q.transpose(-2, -1), offs=offs),
    )


@cases
def test_pickled_experts_whose_inner_tensor_lost_its_expert_dim_are_refused(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    name = cls.inner_names[0]
    crafted = q.clone()
    setattr(crafted, name, getattr(q, name)[0].clone())  # expert 0's alone: no leading E
    with pytest.raises(CheckpointError, match=name):
        _save_load(crafted)
    crafted = q.clone()
    setattr(crafted, name, getattr(q, name)[:2].clone())  # 2 experts' for a 3-expert weight
    with pytest.raises(CheckpointError, match=name):
        _save_load(crafted)


# ---- the one validation (invariant 9) ----------------------------------------------------------


def _break_one_expert(q, expert: int) -> tuple[str, str] | None:
    """Set a value in `expert` that only the layout's value rule refuses; (what, message)."""
    name = type(q).__name__
    if name == "Nvfp4Tensor":
        q.global_scale[expert] = 0.0
        return "global_scale 0", "global_scale"
    if name == "Int4Tensor" and not q.symmetric and not q.float_zero:
        q.zero[expert, 0, 0] = 20.0
        return "zero code 20", "zero point"
    return None


@cases
def test_check_qtensor_names_the_expert_that_breaks_the_rules(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    check_qtensor(q, "test")
    check_qtensor(q.transpose(-2, -1), "test")
    check_qtensor(q[1:], "test")
    # A NaN in one expert's scales, for every layout.
    nan = q.clone()
    scale = nan.scale[2]
    scale.view(-1)[0] = float("nan")
    with pytest.raises(CheckpointError, match="NaN"):
        check_qtensor(nan, "test")
    check_qtensor(nan[:2], "test")  # the other experts are fine
    broken = q.clone()
    rule = _break_one_expert(broken, 1)
    if rule is None:
        return
    with pytest.raises(CheckpointError, match=f"expert 1: .*{rule[1]}"):
        check_qtensor(broken, "test")
    check_qtensor(broken[2:], "test")
    with pytest.raises(CheckpointError):
        _save_load(broken)


# ---- matmuls against per-expert references -------------------------------------------------------

N_EXPERTS, N, K = 4, 200, 3 * 64 + 32  # partial blocks on both dims
# A layout's matmul vs x @ its own dequantized weight: only W8A8's activation rounding (~30 dB
# for e4m3) separates them; weight-only layouts differ by fp32 summation order (> 100 dB).
DEQUANTIZED_MIN_SQNR_DB = 25.0


def has_grouped_matmul(cls, config) -> bool:
    """A backend that runs on a device form (int4 tinygemm/gemlite: 2-D tiles) has no grouped
    matmul; experts quantized for it refuse one with BackendUnavailableError (invariant 4)."""
    return cls.from_float(gaussian(8, 64), config).device_form is None


def assert_grouped_refused(q) -> None:
    x, offs = torch.randn(3, q.shape[2]), offsets([1] * (q.experts - 1) + [3])
    with pytest.raises(BackendUnavailableError, match="grouped"):
        torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    with pytest.raises(BackendUnavailableError, match="grouped"):
        torch.bmm(q[torch.tensor([0])], x[:1, :, None])


def per_expert_linear(x, q, offs, bias=None):
    """Each expert's own 2-D F.linear on its rows (tokens sorted by expert); zeros past the end."""
    out = x.new_zeros(x.shape[0], q.shape[1] if not q.transposed else q.shape[2])
    start = 0
    for e, end in enumerate(offs.tolist()):
        w = q[e].t() if q.transposed else q[e]
        out[start:end] = F.linear(x[start:end], w, None if bias is None else bias[e])
        start = end
    return out


def offsets(counts: list[int]) -> torch.Tensor:
    return torch.cumsum(torch.tensor(counts), 0, dtype=torch.int32)


ACT_DTYPES = pytest.mark.parametrize(
    "act_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"]
)


@cases
@ACT_DTYPES
def test_grouped_mm_equals_each_experts_linear(cls, config, act_dtype):
    w = gaussian(N_EXPERTS, N, K, dtype=act_dtype)
    q = cls.from_float(w, config)
    if not has_grouped_matmul(cls, config):
        assert_grouped_refused(q)
        return
    counts = [5, 0, 9, 3]  # an expert with no tokens; offs[-1] = 17 < 19 rows
    offs = offsets(counts)
    x = torch.randn(19, K).to(act_dtype)
    expected = per_expert_linear(x, q, offs)
    out = torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    assert out.dtype == act_dtype and out.shape == (19, N)
    assert torch.equal(out, expected)
    assert torch.equal(out[17:], torch.zeros(2, N, dtype=act_dtype))
    assert torch.equal(F.grouped_mm(x, q.transpose(-2, -1), offs=offs), expected)
    # Transposed [E, K, N] storage (gpt-oss): _grouped_mm(x, w, offs) without a transpose.
    q_t = cls.from_float(w.transpose(-2, -1).contiguous().transpose(-2, -1), config)
    stored_t = q_t.transpose(-2, -1)
    assert stored_t.shape == (N_EXPERTS, K, N)
    assert torch.equal(torch._grouped_mm(x, stored_t, offs=offs), expected)
    # Against the float experts: the layout's accuracy.
    reference = torch.zeros(19, N)
    start = 0
    for e, end in enumerate(offs.tolist()):
        reference[start:end] = F.linear(x[start:end].float(), w[e].float())
        start = end
    measured = qshard.sqnr_db(reference[:17], out[:17])
    assert measured >= cls.min_linear_sqnr_db, f"SQNR {measured:.1f} dB < {cls.min_linear_sqnr_db}"


@cases
def test_grouped_mm_with_bias(cls, config):
    w = gaussian(N_EXPERTS, N, K)
    q = cls.from_float(w, config)
    if not has_grouped_matmul(cls, config):
        assert_grouped_refused(q)
        return
    bias = gaussian(N_EXPERTS, N, std=1.0)
    offs = offsets([4, 7, 0, 2])
    x = torch.randn(15, K)
    out = torch._grouped_mm(x, q.transpose(-2, -1), offs=offs, bias=bias)
    assert torch.equal(out, per_expert_linear(x, q, offs, bias))
    assert torch.equal(out[13:], torch.zeros(2, N))


@cases
def test_grouped_mm_with_no_tokens(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    if not has_grouped_matmul(cls, config):
        assert_grouped_refused(q)
        return
    for rows in (0, 4):  # no rows at all; rows that no expert takes (offs all 0)
        out = torch._grouped_mm(torch.randn(rows, 96), q.transpose(-2, -1), offs=offsets([0] * 3))
        assert torch.equal(out, torch.zeros(rows, 64))


@pytest.mark.parametrize(
    ("cls", "config"), [LAYOUT_CASES[0], LAYOUT_CASES[-1]], ids=LAYOUT_IDS[::11]
)
def test_grouped_mm_refuses_a_bias_that_is_not_one_row_per_expert(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    x, offs = torch.randn(6, 96), offsets([1, 1, 4])
    for bias in (torch.arange(64.0), torch.zeros(3, 63), torch.zeros(2, 64)):
        with pytest.raises(InputMismatchError, match="bias"):
            torch._grouped_mm(x, q.transpose(-2, -1), offs=offs, bias=bias)


@cases
@ACT_DTYPES
def test_bmm_of_gathered_experts_equals_each_experts_linear(cls, config, act_dtype):
    w = gaussian(N_EXPERTS, N, K, dtype=act_dtype)
    q = cls.from_float(w, config)
    if not has_grouped_matmul(cls, config):
        assert_grouped_refused(q)
        return
    ids = torch.tensor([3, 0, 3, 1, 2, 0])
    x = torch.randn(len(ids), K).to(act_dtype)
    expected = torch.stack([F.linear(x[s : s + 1], q[e])[0] for s, e in enumerate(ids.tolist())])
    out = torch.bmm(q[ids], x[:, :, None])  # batched_mm: [S, N, K] @ [S, K, 1]
    assert out.shape == (len(ids), N, 1) and out.dtype == act_dtype
    assert torch.equal(out[:, :, 0], expected)
    out_t = torch.bmm(x[:, None, :], q.transpose(-2, -1)[ids])  # transposed storage
    assert out_t.shape == (len(ids), 1, N)
    assert torch.equal(out_t[:, 0], expected)


@cases
def test_grouped_mm_input_gradient_uses_the_dequantized_experts(cls, config):
    w = gaussian(N_EXPERTS, N, K)
    q = cls.from_float(w, config)
    if not has_grouped_matmul(cls, config):
        assert_grouped_refused(q)
        return
    offs = offsets([3, 0, 6, 4])
    x = torch.randn(15, K, requires_grad=True)
    out = torch._grouped_mm(x, q.transpose(-2, -1), offs=offs)
    assert torch.equal(out.detach(), per_expert_linear(x.detach(), q, offs))
    grad = torch.randn_like(out)
    out.backward(grad)
    expected = torch.zeros(15, K)
    start = 0
    for e, end in enumerate(offs.tolist()):
        expected[start:end] = grad[start:end] @ q[e].dequantize()
        start = end
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(x.grad[13:], torch.zeros(2, K))  # rows past offs[-1] get no gradient


@cases
def test_grouped_mm_on_views_of_experts(cls, config):
    """Slices of experts, of N and of K (TP / EP shards, non-contiguous inner tensors), a
    misaligned K slice (re-blocked or re-grouped) and gathered experts multiply as the same
    experts quantized fresh."""
    gn, gk = granularity(cls, config)
    # Two whole steps plus a partial one, and at least 35 x 37 per expert: a per-row layout
    # (steps of 1) on 5 x 7 experts gave too few outputs for a stable SQNR (24.8 dB in 1 of 300).
    w = gaussian(4, 2 * max(gn, 16) + 3, 2 * max(gk, 16) + 5)
    q = cls.from_float(w, config)
    if not has_grouped_matmul(cls, config):
        assert_grouped_refused(q)
        return
    views = {
        "experts": (q[1:3], quantize_like_per_expert(q, w[1:3], (1, 0, 0))),
        "rows": (q[:, gn:], quantize_like_per_expert(q, w[:, gn:], (0, gn, 0))),
        "cols": (q[:, :, gk:], quantize_like_per_expert(q, w[:, :, gk:], (0, 0, gk))),
        "gathered": (q[torch.tensor([3, 1])], cls.from_float(w[[3, 1]], config)),
    }
    with contextlib.suppress(MisalignedSliceError):  # exact (re-packed) or refused
        views["misaligned cols"] = (q[:, :, 16:], None)
    for name, (view, fresh) in views.items():
        offs = offsets([9, 0, 12, 6][: view.experts])
        x = torch.randn(int(offs[-1]) + 1, view.shape[2])
        out = torch._grouped_mm(x, view.transpose(-2, -1), offs=offs)
        assert torch.equal(out, per_expert_linear(x, view, offs)), name
        if fresh is not None:
            assert torch.equal(out, torch._grouped_mm(x, fresh.transpose(-2, -1), offs=offs)), name
        reference = torch.zeros_like(out)
        start, dense = 0, view.dequantize()
        for e, end in enumerate(offs.tolist()):
            reference[start:end] = x[start:end] @ dense[e].t()
            start = end
        measured = qshard.sqnr_db(reference, out)
        assert measured >= DEQUANTIZED_MIN_SQNR_DB, f"{name}: {measured:.1f} dB"


# ---- errors ----------------------------------------------------------------------------------


@cases
def test_experts_misuse_raises_typed_errors(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    with pytest.raises(UnsupportedOpError, match="grouped_mm"):
        F.linear(torch.randn(2, 96), q)
    with pytest.raises(InvalidDimError):
        q.transpose(0, 1)
    with pytest.raises(InvalidDimError):
        q.transpose(0, 2)
    with pytest.raises(InvalidDimError):
        q.t()
    with pytest.raises(IndexError):  # torch's own dim check, before dispatch
        q.narrow(3, 0, 1)
    with pytest.raises(UnsupportedWeightError, match="no expert"):
        cls.from_float(torch.randn(0, 64, 96), config)
    with pytest.raises(QShardError):
        cls.from_float(torch.randn(2, 2, 64, 96), config)
    for bad_index in (lambda: q[:, 1], lambda: q[..., 0], lambda: q[torch.tensor([[0, 1]])]):
        with pytest.raises(UnsupportedOpError):
            bad_index()
    with pytest.raises(UnsupportedOpError):  # experts keep their shape
        q.reshape(3 * 64, 96)
    with pytest.raises(InvalidDimError):
        q.permute(1, 0, 2)
    with pytest.raises(LayoutMismatchError):  # experts and a 2-D weight do not join
        torch.cat([q, q[0]])
    with pytest.raises(UnsupportedOpError):
        torch.stack([q, q])


@cases
def test_grouped_matmul_bad_input_raises_typed_errors(cls, config):
    q = cls.from_float(gaussian(3, 64, 96), config)
    if not has_grouped_matmul(cls, config):
        assert_grouped_refused(q)
        return
    with pytest.raises(QShardError):  # offs that are not int32 [E]
        torch._grouped_mm(torch.randn(4, 96), q.transpose(-2, -1), offs=torch.tensor([1, 2, 4]))
    with pytest.raises(InputMismatchError):  # offs that decrease
        torch._grouped_mm(
            torch.randn(6, 96), q.transpose(-2, -1), offs=torch.tensor([3, 2, 5]).int()
        )
    with pytest.raises(InputMismatchError):  # inputs of another width
        torch._grouped_mm(torch.randn(6, 95), q.transpose(-2, -1), offs=offsets([1, 1, 4]))
    with pytest.raises(UnsupportedOpError):  # a grouped matmul needs offs
        torch._grouped_mm(torch.randn(6, 96), q.transpose(-2, -1))
    with pytest.raises(InputMismatchError):  # bmm: one input per gathered expert
        torch.bmm(q, torch.randn(2, 96, 1))
    with pytest.raises(QShardError):  # offs past the rows
        torch._grouped_mm(torch.randn(4, 96), q.transpose(-2, -1), offs=offsets([1, 2, 4]))


# ---- torch.compile (invariant 7) -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("cls", LAYOUT_CLASSES, ids=[c.__name__ for c in LAYOUT_CLASSES])
def test_compile_grouped_mm_dynamic_tokens_compiles_once(cls):
    """transformers' grouped_mm experts forward, compiled: one graph for every token count."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    q = cls.from_float(gaussian(3, 96, 64), cls.contract_configs()[0])

    def experts_forward(x, w, offs):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(experts_forward, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (5, 9, 13):
            x = torch.randn(tokens, 64)
            offs = offsets([tokens // 3, 0, tokens - tokens // 3 - 1])  # the last row unrouted
            expected = experts_forward(x, q, offs)
            out = compiled(x, q, offs)
            assert torch.equal(out[-1], torch.zeros(96))
            measured = qshard.sqnr_db(expected, out)
            assert measured >= COMPILED_VS_EAGER_MIN_SQNR_DB, f"{tokens}: {measured:.1f} dB"
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for 3 token counts"


@pytest.mark.slow
@pytest.mark.parametrize("cls", LAYOUT_CLASSES, ids=[c.__name__ for c in LAYOUT_CLASSES])
def test_compile_grouped_mm_with_autograd(cls):
    """Grad enabled (an input that needs a gradient: LoRA on the experts' inputs), static
    shapes, as the 2-D suite's test_compile_fullgraph_with_autograd."""
    torch._dynamo.reset()
    q = cls.from_float(gaussian(3, 96, 64), cls.contract_configs()[0])

    def experts_forward(x, w, offs):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    compiled = torch.compile(experts_forward, fullgraph=True, dynamic=False)
    offs = offsets([2, 0, 4])
    x = torch.randn(7, 64, requires_grad=True)
    out = compiled(x, q, offs)
    grad = torch.randn_like(out)
    out.backward(grad)
    eager_x = x.detach().requires_grad_()
    expected = experts_forward(eager_x, q, offs)
    expected.backward(grad)
    measured = qshard.sqnr_db(expected, out)
    assert measured >= COMPILED_VS_EAGER_MIN_SQNR_DB, f"{measured:.1f} dB"
    torch.testing.assert_close(x.grad, eager_x.grad, rtol=1e-5, atol=1e-6)
