"""The int4 Triton kernels against the reference (interpreter on CPU, float16 activations;
compiled on a GPU). Fresh random inputs, odd shapes, partial groups, both zero-point modes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qshard
from qshard import Int4WeightOnlyConfig
from qshard.kernels import int4 as ref
from qshard.kernels.availability import load_int4_ops, triton_unavailable_reason

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_unavailable_reason(torch.device(DEVICE)) is not None,
    reason=str(triton_unavailable_reason(torch.device(DEVICE))),
)
# Both multiply the same weight rounded to the activation dtype and sum in fp32 (kernel) or
# float64 (reference); the difference is fp32 summation order plus the output rounding.
MAX_RELATIVE_ERROR = 1e-3


@pytest.mark.parametrize("m", [1, 3, 17, 257])  # fused (split K) up to 128, dequantize + mm above
@pytest.mark.parametrize(
    ("n", "k", "group", "symmetric"),
    [(96, 256, 128, False), (100, 200, 64, True), (72, 301, 32, False), (40, 96, 32, True)],
)
def test_triton_int4_linear_matches_the_reference(m, n, k, group, symmetric):
    load_int4_ops()
    qdata, scale, zero = ref.quantize_int4(torch.randn(n, k, device=DEVICE) * 0.02, group,
                                           symmetric)  # fmt: skip
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE) if m % 2 else None
    out = torch.ops.qshard.int4_linear(x, qdata, scale, zero, bias, group)
    expected = ref.int4_linear_reference(x, qdata, scale, zero, group, bias)
    assert out.shape == (m, n) and out.dtype == dtype
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error <= MAX_RELATIVE_ERROR, f"relative error {error:.2e} > {MAX_RELATIVE_ERROR}"


# The fused kernel forced by its config: one program per tile, K split over 3 programs (fp32
# atomics, the last program writes), several token tiles, and K steps narrower than a group.
FUSED_CONFIGS = {
    "whole-k": dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=1, num_warps=4),
    "split3": dict(BLOCK_N=64, BLOCK_M=16, BLOCK_K=128, SPLIT_K=3, num_warps=4),
    "token-tiles": dict(BLOCK_N=32, BLOCK_M=16, BLOCK_K=64, SPLIT_K=2, num_warps=4),
}


@pytest.mark.parametrize("config", FUSED_CONFIGS)
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "symmetric", "dtype"),
    [
        (5, 96, 768, 256, False, torch.float16),  # BLOCK_K < group: a step inside one group
        (37, 160, 544, 32, True, torch.float16),  # several groups per step, 3 token tiles
        (3, 72, 960, 64, False, torch.float32),  # fp32 activations: an IEEE fp32 dot
    ],
)
def test_the_fused_kernel_matches_the_reference_for_each_config(
    config, m, n, k, group, symmetric, dtype
):
    from qshard.kernels.int4_triton import linear_launch

    load_int4_ops()
    weight = torch.randn(n, k, device=DEVICE) * 0.02
    qdata, scale, zero = ref.quantize_int4(weight, group, symmetric)
    if DEVICE == "cuda" and dtype == torch.float16:
        dtype = torch.bfloat16
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    out = linear_launch(x, qdata, scale, zero, bias, group, FUSED_CONFIGS[config])
    expected = ref.int4_linear_reference(x, qdata, scale, zero, group, bias)
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert error <= MAX_RELATIVE_ERROR, f"relative error {error:.2e} > {MAX_RELATIVE_ERROR}"


@pytest.mark.parametrize(("group", "symmetric"), [(128, False), (32, True), (256, False)])
def test_the_dequantize_kernel_is_bit_exact(group, symmetric):
    from qshard.kernels.int4_triton import dequantize_launch

    load_int4_ops()
    n, k = 200, 3 * group + group // 2  # a partial last group
    qdata, scale, zero = ref.quantize_int4(torch.randn(n, k, device=DEVICE), group, symmetric)
    # The interpreter's fp32 -> bf16 cast truncates (triton 3.9: 1 + 2**-8 + 2**-12 -> 1.0, not
    # 1.0078125); compiled kernels round to nearest even, so bf16 is checked on a GPU only.
    dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if DEVICE == "cuda" else ())
    for dtype in dtypes:
        out = dequantize_launch(qdata, scale, zero, group, k, dtype)
        assert torch.equal(out, ref.dequantize_int4(qdata, scale, zero, group, k, dtype)), dtype


def test_the_layout_runs_triton_only_when_asked():
    weight = torch.randn(160, 256, device=DEVICE) * 0.02
    x = torch.randn(2, 5, 256, dtype=torch.float16, device=DEVICE)
    forced = qshard.Int4Tensor.from_float(weight, Int4WeightOnlyConfig(backend="triton"))
    auto = qshard.Int4Tensor.from_float(weight)
    assert forced.select_backend(x) is qshard.Backend.TRITON
    assert auto.select_backend(x) is qshard.Backend.REFERENCE  # until measured on a GPU
    out = F.linear(x, forced.to(torch.float16))
    expected = F.linear(x, auto.to(torch.float16))
    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
    assert out.shape == (2, 5, 160) and error <= MAX_RELATIVE_ERROR


def test_the_op_has_a_consistent_fake_implementation():
    load_int4_ops()
    qdata, scale, zero = ref.quantize_int4(torch.randn(64, 128, device=DEVICE), 32, False)
    x = torch.randn(3, 128, dtype=torch.float16, device=DEVICE)
    torch.library.opcheck(
        torch.ops.qshard.int4_linear.default, (x, qdata, scale, zero, None, 32),
        test_utils="test_faketensor",
    )  # fmt: skip
