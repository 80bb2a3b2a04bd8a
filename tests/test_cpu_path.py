"""The CPU path of `backend="auto"` (issue 23, Deliver 4): dequantize, then the BLAS in the
activation dtype, against the reference that defines it (`backend="reference"`, float64 sums).

Every layout's eager dequantization (broadcast scales, in-place arithmetic, byte lookups, the
fp8-through-fp16 decode) must give the same bits as the compiled formulas (gathers and casts),
and the fast linear must be the reference's result up to the order of the sums.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from helpers import LAYOUT_CASES, LAYOUT_IDS, gaussian, relative_error

import qshard
from qshard.config import Backend
from qshard.kernels import fp8_blockwise, mxfp4, packing
from qshard.layouts import int4 as int4_layout

AUTO_CASES = [(c, cfg) for c, cfg in LAYOUT_CASES if cfg.backend is Backend.AUTO]
AUTO_IDS = [
    i for (_, cfg), i in zip(LAYOUT_CASES, LAYOUT_IDS, strict=True) if cfg.backend is Backend.AUTO
]

# ||auto - reference|| / ||reference||: fp32 sums in another order; for bf16 / fp16 outputs,
# the two roundings of the same sum to the output dtype (2**-8, 2**-11 apart at most).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}


def _compiled_formulas():
    """Run the dequantizations as they run under torch.compile (gathers and casts)."""
    return mock.patch.object(torch.compiler, "is_compiling", return_value=True)


def _weight(n: int, k: int) -> torch.Tensor:
    # Rows of different magnitudes, so that scales differ from group to group.
    return gaussian(n, k) * torch.logspace(-2, 1, n)[:, None]


@pytest.mark.parametrize("cls,config", AUTO_CASES, ids=AUTO_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_auto_on_cpu_is_the_reference_up_to_summation_order(cls, config, dtype):
    # Odd shapes: partial scale groups and blocks along N and K (208 = 13 NVFP4 groups).
    n, k = 72, 208
    weight = _weight(n, k).to(dtype)
    auto = cls.from_float(weight, config)
    reference = cls.from_float(weight, dataclasses.replace(config, backend=Backend.REFERENCE))
    bias = gaussian(n).to(dtype)
    for m in (1, 3, 17):
        x = gaussian(m, k, std=1.0).to(dtype)
        expected = torch.nn.functional.linear(x, reference, bias)
        out = torch.nn.functional.linear(x, auto, bias)
        assert out.dtype == expected.dtype == dtype
        assert relative_error(out, expected) <= TOLERANCE[dtype], (m, dtype)


@pytest.mark.parametrize("cls,config", AUTO_CASES, ids=AUTO_IDS)
@pytest.mark.parametrize("shape", [(72, 208), (128, 256)], ids=["partial", "whole"])
def test_eager_dequantization_equals_the_compiled_formulas_bit_for_bit(cls, config, shape):
    tensor = cls.from_float(_weight(*shape), config)
    for dtype in (torch.float32, torch.bfloat16):
        eager = tensor.dequantize_matrix(dtype)
        with _compiled_formulas():
            compiled = tensor.dequantize_matrix(dtype)
        assert torch.equal(eager, compiled), dtype


def test_backend_reference_still_runs_the_float64_reference():
    weight = _weight(64, 256)
    config = qshard.Int4WeightOnlyConfig(group_size=64, backend="reference")
    tensor = qshard.layouts.Int4Tensor.from_float(weight, config)
    x = gaussian(5, 256, std=1.0)
    fast = mock.patch.object(int4_layout, "linear_in_dtype", side_effect=AssertionError("fast"))
    with fast:
        out = torch.nn.functional.linear(x, tensor)
    exact = x.double() @ tensor.dequantize_matrix(torch.float32).double().t()
    assert torch.equal(out, exact.float())


def test_fp8_weight_decode_is_exact_for_every_finite_code():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = ~codes.float().isnan()
    decoded = fp8_blockwise.e4m3_weight_values(codes)
    assert torch.equal(decoded[finite], codes.float()[finite])
    assert torch.equal(fp8_blockwise.e4m3_to_float32(codes)[finite], codes.float()[finite])
    assert fp8_blockwise.e4m3_to_float32(codes)[~finite].isnan().all()  # activations: NaN kept


def test_byte_lookups_equal_per_code_unpacking():
    packed = torch.randint(0, 256, (5, 7), dtype=torch.uint8)
    for k in (13, 14):  # an odd K leaves the last byte's high nibble unused
        with _compiled_formulas():
            codes = packing.unpack_nibbles(packed, k)
            values = mxfp4.e2m1_values(packed, k)
            expanded = packing.expand_groups(torch.arange(10.0).view(5, 2), 8, k)
        assert torch.equal(packing.unpack_nibbles(packed, k), codes)
        assert torch.equal(mxfp4.e2m1_values(packed, k), values)
        assert torch.equal(packing.expand_groups(torch.arange(10.0).view(5, 2), 8, k), expanded)


def test_nonfinite_activations_stay_nonfinite_under_w8a8():
    tensor = qshard.layouts.Fp8BlockwiseTensor.from_float(_weight(128, 256))
    x = gaussian(2, 256, std=1.0)
    x[0, 3] = float("nan")
    out = torch.nn.functional.linear(x, tensor)
    assert out[0].isnan().all() and out[1].isfinite().all()


def test_fp8_dequantization_of_non_contiguous_codes():
    # Codes that are a transposed (dense, permuted) or sliced view: the same values as a cast.
    codes = gaussian(256, 384, std=50.0).to(torch.float8_e4m3fn)
    for q in (codes.t(), codes[:, 5:300]):
        n, k = q.shape
        scale = torch.rand(-(-n // 128), -(-k // 128)) + 0.5
        expected = q.float() * fp8_blockwise.expand_block_scales(scale, (128, 128), (n, k))
        dequantized = fp8_blockwise.dequantize_blockwise(q, scale, (128, 128), torch.float32)
        assert torch.equal(dequantized, expected)
