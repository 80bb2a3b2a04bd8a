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


@pytest.mark.parametrize("m", [1, 3, 17, 257])  # GEMV at M = 1, the tl.dot GEMM above
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
