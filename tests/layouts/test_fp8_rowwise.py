"""The FP8 per-row layout: its quantization convention, matmul paths and what it refuses.

Slicing, serialization, compile and TP run over it in the contract and TP suites."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import gaussian, relative_error

import qshard
from qshard import Fp8RowwiseConfig, Fp8RowwiseTensor
from qshard.errors import BackendUnavailableError, LayoutMismatchError

E4M3_MAX = 448.0


def test_each_row_is_scaled_by_its_amax_over_448():
    w = gaussian(48, 80)
    w[5] = 0.0  # an all-zero row: scale 1 (any scale is exact for zeros)
    q = Fp8RowwiseTensor.from_float(w)
    amax = w.abs().amax(dim=1, keepdim=True)
    expected_scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    assert torch.equal(q.scale, expected_scale)
    assert torch.equal(q.qdata, (w / expected_scale).to(torch.float8_e4m3fn))
    assert torch.equal(q.dequantize(), q.qdata.float() * expected_scale)
    assert q.qdata.float().abs().amax(dim=1)[:5].eq(E4M3_MAX).all()  # each row's amax -> 448


def test_w8a8_reference_quantizes_each_token_and_matches_the_float_formula():
    w, x = gaussian(40, 96), torch.randn(7, 96)
    bias = torch.randn(40)
    q = Fp8RowwiseTensor.from_float(w)
    x_scale = x.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    xq = (x / x_scale).to(torch.float8_e4m3fn).float()
    expected = (xq * x_scale) @ q.dequantize(torch.float32).t() + bias
    out = F.linear(x, q, bias)
    assert relative_error(out, expected) < 1e-6
    assert qshard.sqnr_db(x @ w.t() + bias, out) > 25


def test_weight_only_multiplies_the_dequantized_weight():
    """The reference: the float64 product rounded once; `auto` on the CPU: the BLAS on the
    dequantized weight, which sums in fp32 (equal to the reference up to summation order)."""
    w, x = gaussian(24, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16)
    config = Fp8RowwiseConfig(weight_only=True, backend="reference")
    reference = Fp8RowwiseTensor.from_float(w, config)
    expected = (x.double() @ reference.dequantize().double().t()).to(torch.bfloat16)
    assert torch.equal(F.linear(x, reference), expected)
    auto = Fp8RowwiseTensor.from_float(w, Fp8RowwiseConfig(weight_only=True))
    assert torch.equal(auto.dequantize(), reference.dequantize())
    assert torch.equal(F.linear(x, auto), F.linear(x, auto.dequantize()))


def test_a_column_part_keeps_its_rows_scales_and_refuses_other_ones():
    w = gaussian(32, 64)
    q = Fp8RowwiseTensor.from_float(w)
    part = q[:, 16:48]
    assert torch.equal(part.scale, q.scale) and torch.equal(
        part.dequantize(), q.dequantize()[:, 16:48]
    )
    with pytest.raises(LayoutMismatchError, match="quantize_like"):
        q.narrow(1, 16, 32).copy_(Fp8RowwiseTensor.from_float(w[:, 16:48] * 3))
    q.narrow(1, 16, 32).copy_(q.quantize_like(w[:, 16:48] * 0.5, at=(0, 16)))  # the row's: fine
    assert torch.equal(q.dequantize()[:, :16], Fp8RowwiseTensor.from_float(w).dequantize()[:, :16])
    with pytest.raises(LayoutMismatchError, match="shared"):
        torch.cat(
            [Fp8RowwiseTensor.from_float(w[:, :32]), Fp8RowwiseTensor.from_float(w[:, 32:])], 1
        )
    rows = torch.cat([Fp8RowwiseTensor.from_float(w[:8]), Fp8RowwiseTensor.from_float(w[8:])], 0)
    assert torch.equal(rows.dequantize(), Fp8RowwiseTensor.from_float(w).dequantize())


def test_quantize_like_names_rows_outside_the_weight():
    q = Fp8RowwiseTensor.from_float(gaussian(16, 32))
    with pytest.raises(qshard.ConfigError, match="offset"):
        q.quantize_like(gaussian(8, 32), at=(12, 0))


def test_backends_on_the_cpu():
    w, x = gaussian(32, 64), torch.randn(2, 64)
    assert Fp8RowwiseTensor.from_float(w).select_backend(x) is qshard.Backend.REFERENCE
    forced = Fp8RowwiseTensor.from_float(w, Fp8RowwiseConfig(backend="cublas"))
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        F.linear(x, forced)
    with pytest.raises(qshard.ConfigError, match="backend"):
        Fp8RowwiseConfig(backend="triton")
