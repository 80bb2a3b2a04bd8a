"""The one validation every reader runs (qshard/qtensor/validation.py; docs/design.md invariant 9):
crafted torch.load(weights_only=True) pickles, int4 zero points, values that dequantize to Inf
(quantize_ included), empty weights, NVFP4's global scale on every device (issue 21)."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import LAYOUT_CASES, LAYOUT_IDS, assert_same_qtensor
from torch import nn

import qshard
from qshard import CheckpointError, QShardError, UnsupportedWeightError
from qshard.kernels.nvfp4 import global_scale_of
from qshard.qtensor.validation import check_qtensor


def pickled(tensor: qshard.QTensor, **changes) -> io.BytesIO:
    """torch.save of `tensor` with its pickled state changed (a key set to a value, or removed
    with None as the value of a key prefixed "del_")."""
    cls = type(tensor)
    original = cls.__getstate__

    def crafted(self):
        state = original(self)
        for key, value in changes.items():
            if key.startswith("del_"):
                state.pop(key.removeprefix("del_"))
            else:
                state[key] = value
        return state

    buffer = io.BytesIO()
    cls.__getstate__ = crafted
    try:
        torch.save({"w": tensor}, buffer)
    finally:
        cls.__getstate__ = original
    buffer.seek(0)
    return buffer


def load_pickle(buffer: io.BytesIO):
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)
def test_an_unchanged_pickle_loads_exactly(cls, config):
    weight = cls.from_float(torch.randn(40, 96), config)
    assert_same_qtensor(load_pickle(pickled(weight))["w"], weight)


@pytest.mark.parametrize(
    ("cls", "config", "changes", "match"),
    [
        (qshard.Fp8BlockwiseTensor, None, {"block_size": (-128, 128)}, "block_size"),
        (qshard.Fp8BlockwiseTensor, None, {"block_size": (2**100, 128)}, "block_size"),
        (qshard.Fp8BlockwiseTensor, None, {"block_size": ("128", 128)}, "block_size"),
        (qshard.Int4Tensor, None, {"group_size": -32}, "group_size"),
        (qshard.Int4Tensor, None, {"group_size": True}, "group_size"),
        (qshard.Int4Tensor, None, {"symmetric": 1}, "symmetric"),
        (qshard.Fp8BlockwiseTensor, None, {"scale": torch.ones(2, 2)}, "'scale' is float32"),
        (qshard.Nvfp4Tensor, None, {"global_scale": torch.ones(2)}, "'global_scale'"),
        # A declared shape far larger than the stored data: the first dequantize would ask
        # for gigabytes.
        (qshard.Int4Tensor, None, {"logical_shape": (1, 10**9)}, "inner tensor 'qdata'"),
        (qshard.Int4Tensor, None, {"logical_shape": (1, 2**40)}, "logical shape"),
        (qshard.Int4Tensor, None, {"logical_shape": (-40, 96)}, "logical shape"),
        (qshard.Int4Tensor, None, {"del_scale": None}, "lacks \\['scale'\\]"),
        (qshard.Int4Tensor, None, {"dequantize": "x"}, "unknown keys \\['dequantize'\\]"),
        (qshard.Int4Tensor, None, {"__class__": "x"}, "unknown keys"),
        (qshard.Int4Tensor, None, {"device_names": ("qdata",)}, "'device_names'"),
        (qshard.Int4Tensor, None, {"transposed": "yes"}, "'transposed'"),
        (
            qshard.Mxfp4Tensor,
            None,
            {"scale": torch.full((40, 3), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)},
            "NaN/Inf",
        ),
        (qshard.Fp8RowwiseTensor, None, {"scale": torch.full((40, 1), float("inf"))}, "NaN/Inf"),
        # NaN scales, each layout's: a NaN would dequantize every value of its block to NaN.
        (qshard.Fp8RowwiseTensor, None, {"scale": torch.full((40, 1), float("nan"))}, "NaN/Inf"),
        (qshard.Fp8BlockwiseTensor, None, {"scale": torch.full((1, 1), float("nan"))}, "NaN/Inf"),
        (
            qshard.Int4Tensor,
            None,
            {"scale": torch.full((40, 1), float("nan"), dtype=torch.bfloat16)},
            "NaN/Inf",
        ),
        (
            qshard.Nvfp4Tensor,
            None,
            {"scale": torch.full((40, 6), float("nan")).to(torch.float8_e4m3fn)},
            "NaN/Inf",
        ),
        (qshard.Nvfp4Tensor, None, {"global_scale": torch.full((1, 1), float("nan"))}, "NaN/Inf"),
    ],
)
def test_a_crafted_pickle_is_a_checkpoint_error(cls, config, changes, match):
    weight = cls.from_float(torch.randn(40, 96), config)
    with pytest.raises(CheckpointError, match=match):
        load_pickle(pickled(weight, **changes))


def test_a_pickled_outer_shape_must_match_the_logical_shape():
    weight = qshard.Int4Tensor.from_float(torch.randn(40, 96))
    transposed = weight.t()
    buffer = pickled(transposed, transposed=False)  # outer [96, 40] says [40, 96]
    with pytest.raises(CheckpointError, match="outer tensor"):
        load_pickle(buffer)


def test_non_contiguous_inner_tensors_are_made_contiguous():
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(256, 256))
    part = weight[:, 128:]  # a view: qdata is not contiguous
    assert not part.qdata.is_contiguous()
    loaded = load_pickle(pickled(part))["w"]
    assert loaded.qdata.is_contiguous()
    assert torch.equal(loaded.dequantize(), part.dequantize())


@pytest.mark.parametrize("zero", [16.0, -1.0, 7.5, float("nan")])
def test_int4_zero_points_must_be_integer_codes(zero):
    weight = qshard.Int4Tensor.from_float(torch.randn(8, 64), qshard.Int4WeightOnlyConfig(32))
    bad_zero = weight.zero.clone()
    bad_zero[3, 1] = zero
    bad = weight.with_changes({"zero": bad_zero})
    with pytest.raises(CheckpointError, match=r"zero point|NaN"):
        check_qtensor(bad, "test")
    with pytest.raises(QShardError, match=r"zero point|NaN"):
        load_pickle(pickled(weight, zero=bad_zero))
    # A float zero point (zero_point_domain="float") is any finite value.
    float_zero = qshard.Int4WeightOnlyConfig(32, zero_point_domain="float")
    check_qtensor(qshard.Int4Tensor.from_float(torch.randn(8, 64) * 100, float_zero), "test")


# ---- values that dequantize beyond the dtype --------------------------------------------------

NEAR_MAX_CASES = [
    (qshard.Int4Tensor, qshard.Int4WeightOnlyConfig(32)),
    (qshard.Int4Tensor, qshard.Int4WeightOnlyConfig(32, symmetric=True)),
    (qshard.Int4Tensor, qshard.Int4WeightOnlyConfig(32, zero_point_domain="float")),
    (qshard.Int4Tensor, qshard.Int4WeightOnlyConfig(32, backend="tinygemm")),
    (qshard.Fp8BlockwiseTensor, qshard.Fp8BlockwiseConfig(scale_format="ue8m0")),
    (qshard.Fp8BlockwiseTensor, qshard.Fp8BlockwiseConfig()),
    (qshard.Fp8RowwiseTensor, None),
    (qshard.Nvfp4Tensor, None),
    (qshard.Mxfp4Tensor, None),
]


@pytest.mark.parametrize(("cls", "config"), NEAR_MAX_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_weights_near_the_dtype_maximum_never_dequantize_to_inf(cls, config, dtype):
    """Every code of a quantized weight dequantizes to a finite value, or the weight is refused
    with UnsupportedWeightError (quantize_ skips and reports it): never a silent Inf."""
    largest = torch.finfo(dtype).max
    weight = ((torch.rand(64, 128) * 2 - 1) * largest).to(dtype)
    weight[0, :2] = torch.tensor([largest, -largest], dtype=dtype)
    try:
        tensor = cls.from_float(weight, config)
    except UnsupportedWeightError as e:
        assert "dequantize to" in str(e) and "quantization step" in str(e)
        return
    assert bool(torch.isfinite(tensor.dequantize()).all())
    check_qtensor(tensor, "test")


def test_quantize_skips_and_reports_a_weight_that_would_dequantize_to_inf():
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)).half()
    with torch.no_grad():
        model[0].weight[0, 0] = 65504.0
    report = qshard.quantize_(model, qshard.Int4WeightOnlyConfig(32, symmetric=True))
    assert isinstance(model[1].weight, qshard.Int4Tensor)
    assert not isinstance(model[0].weight, qshard.QTensor)
    assert [s.name for s in report.skipped if "dequantize to" in s.reason] == ["0"]


def test_a_checkpoint_loaded_as_float16_must_fit_float16(tmp_path):
    """A float32 checkpoint whose scales exceed float16's range is refused when a float16
    model loads it, instead of computing Inf."""
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    with torch.no_grad():
        model[0].weight.mul_(1e6)
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(block_size=(32, 32)))
    qshard.save(model, tmp_path)
    with torch.device("meta"):
        half = nn.Sequential(nn.Linear(64, 64, bias=False)).half()
    before = half[0].weight
    with pytest.raises(CheckpointError, match="largest finite float16"):
        qshard.load(tmp_path, half)
    assert half[0].weight is before


@pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)
@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (0, 0)])
def test_empty_weights_quantize(cls, config, shape):
    tensor = cls.from_float(torch.randn(*shape), config)
    assert tensor.dequantize().shape == shape
    check_qtensor(tensor, "test")


def test_the_nvfp4_global_scale_is_a_correctly_rounded_division():
    """amax / 2688 by a tensor divisor (CUDA turns a Python-scalar divisor into a multiplication
    by its reciprocal, one ulp off for some amax): the same bits on every device."""
    amax = torch.rand(10_000, dtype=torch.float64) * 10.0 ** torch.randint(-30, 30, (10_000,))
    for value in amax.float().tolist():
        expected = torch.tensor(value, dtype=torch.float64) / (6 * 448)  # exact, then rounded
        got = global_scale_of(torch.tensor([[value, -value / 2]]))
        assert got.item() == expected.float().item()


# ---- what the validation must not break --------------------------------------------------------


@pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)
def test_a_transposed_non_square_weight_pickles(cls, config):
    weight = cls.from_float(torch.randn(96, 160), config).t()
    assert_same_qtensor(load_pickle(pickled(weight))["w"], weight)


def test_whole_models_pickle_with_their_quantized_parameters():
    """torch.save(model) and multiprocessing pickle nn.Parameter(QTensor), whose state has
    nn.Parameter's `_is_param` flag."""
    from multiprocessing.reduction import ForkingPickler

    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64))
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(32))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copy in (
        torch.load(buffer, weights_only=False),
        ForkingPickler.loads(ForkingPickler.dumps(model)),
    ):
        assert_same_qtensor(copy[0].weight, model[0].weight)
        x = torch.randn(3, 64)
        assert torch.equal(copy(x), model(x))


def test_save_checks_without_changing_the_callers_tensors(tmp_path):
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(256, 512))
    view = weight[:, 128:256]
    pointer = view.qdata.data_ptr()
    qshard.save({"w": view}, tmp_path)
    assert view.qdata.data_ptr() == pointer  # still a view of weight's data
    assert_same_qtensor(qshard.load(tmp_path)["w"], view)
