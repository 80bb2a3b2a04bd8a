"""The FP8 blockwise reference (qshard/kernels/fp8_blockwise.py): the definition kernels match."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import gaussian

from qshard import Fp8BlockwiseConfig, Fp8BlockwiseTensor, ScaleFormat
from qshard.kernels.fp8_blockwise import (
    _to_e4m3,
    quantize_activation_groups,
    quantize_weight_blockwise,
    round_up_to_power_of_two,
)


def test_values_past_e4m3_range_saturate():
    out = _to_e4m3(torch.tensor([1e6, -1e6, 500.0, 448.0])).float()
    assert out.tolist() == [448.0, -448.0, 448.0, 448.0]
    huge = torch.full((128, 128), 3e38)  # near the fp32 limit still quantizes to finite values
    assert torch.isfinite(Fp8BlockwiseTensor.from_float(huge).dequantize()).all()


def test_ue8m0_scales_are_powers_of_two_rounded_up():
    w = gaussian(256, 384)
    q = Fp8BlockwiseTensor.from_float(w, Fp8BlockwiseConfig(scale_format="ue8m0"))
    exact = Fp8BlockwiseTensor.from_float(w).scale
    assert torch.equal(torch.exp2(torch.log2(q.scale).round()), q.scale)
    assert (q.scale >= exact).all() and (q.scale < 2 * exact).all()
    powers = torch.tensor([0.25, 1.0, 2.0**-20])
    assert torch.equal(round_up_to_power_of_two(powers), powers)
    just_above = torch.nextafter(powers, torch.tensor(10.0))
    assert torch.equal(round_up_to_power_of_two(just_above), 2 * powers)


def test_weight_quantization_round_trips_within_e4m3_precision():
    w = gaussian(200, 300)
    qdata, scale = quantize_weight_blockwise(w, (128, 128), ScaleFormat.FP32)
    assert scale.shape == (2, 3)
    rebuilt = (
        qdata.float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    )
    # e4m3 keeps 3 mantissa bits: a relative rounding error of at most 2**-4 per normal value.
    assert ((rebuilt - w).abs() <= w.abs() * 2**-4 + scale.max() * 2**-9).all()


def test_activation_groups_per_token_with_a_partial_tail():
    x = torch.randn(5, 300)
    x[2, 128:256] = 0  # an all-zero group
    q, scale = quantize_activation_groups(x, 128, ScaleFormat.FP32)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 300) and scale.shape == (5, 3)
    torch.testing.assert_close(scale[:, 2], x[:, 256:].abs().amax(1) / 448, rtol=0, atol=0)
    assert scale[2, 1] == 1.0 and (q[2, 128:256].float() == 0).all()
    rebuilt = q.float() * scale.repeat_interleave(128, 1)[:, :300]
    assert ((rebuilt - x).abs() <= x.abs() * 2**-4 + scale.max() * 2**-9).all()
    assert (q.float().abs().amax(1) == 448).all()  # each token's largest value maps to 448


def test_reference_matmul_matches_its_formula_written_out():
    """W8A8: per 1x128 activation group and 128x128 weight block, fp32 products rescaled."""
    n, k, m = 200, 300, 7
    w, x = gaussian(n, k), torch.randn(m, k)
    q = Fp8BlockwiseTensor.from_float(w)
    expected = torch.zeros(m, n, dtype=torch.float64)
    for g in range(0, k, 128):
        xs = x[:, g : g + 128]
        x_scale = xs.abs().amax(1, keepdim=True) / 448
        xq = (xs / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * x_scale.double()
        w_scale = q.scale[:, g // 128].repeat_interleave(128)[:n, None].double()
        expected += xq @ (q.qdata[:, g : g + 128].double() * w_scale).t()
    torch.testing.assert_close(F.linear(x, q).double(), expected, rtol=1e-5, atol=1e-6)


def test_e4m3_decoding_from_bits_is_exact_for_every_code():
    from qshard.kernels.fp8_blockwise import e4m3_to_float64

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    expected = codes.to(torch.float64)
    decoded = e4m3_to_float64(codes)
    assert torch.equal(decoded.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(decoded[finite], expected[finite])
    compiled = torch.compile(e4m3_to_float64, fullgraph=True)(codes.reshape(16, 16))
    assert torch.equal(compiled.flatten()[finite], expected[finite])
