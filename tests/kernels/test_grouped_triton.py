"""The grouped (experts) Triton kernels against the per-expert reference: under the Triton
interpreter on the CPU (float16 activations, docs/design.md, "PyTorch behaviour"), compiled on a
GPU. Fresh random
inputs each run; odd N and K (partial blocks and groups), experts with no tokens, token counts
that straddle the token block, rows past offs[-1] (zeros), a bias per expert, every format."""

from __future__ import annotations

import pytest
import torch
from helpers import relative_error

import qshard
from qshard.config import Backend
from qshard.kernels.availability import triton_unavailable_reason
from qshard.layouts import layout_for

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(
    triton_unavailable_reason(DEVICE, fp8=False) is not None,
    reason=str(triton_unavailable_reason(DEVICE, fp8=False)),
)
ACT_DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
# ||out - reference|| / ||reference||: the kernels sum each expert's products in fp32 in another
# order than the reference (which runs each expert's 2-D reference path). FP8: the activation
# quantization is exact in both (the same e4m3 codes and scales), so only the summation order
# and the output rounding differ; 4-bit: the weights are rounded to the activation dtype in
# both. A few units of the activation dtype's rounding (2**-11 fp16, 2**-8 bf16).
MAX_RELATIVE_ERROR = {torch.float16: 2e-3, torch.bfloat16: 8e-3}

CONFIGS = [
    qshard.Fp8BlockwiseConfig(block_size=(64, 64), backend="triton"),
    qshard.Fp8BlockwiseConfig(backend="triton", scale_format="ue8m0"),
    qshard.Int4WeightOnlyConfig(group_size=32, backend="triton"),
    qshard.Int4WeightOnlyConfig(group_size=64, symmetric=True, backend="triton"),
    qshard.Int4WeightOnlyConfig(group_size=32, zero_point_domain="float", backend="triton"),
    qshard.MXFP4WeightOnlyConfig(backend="triton"),
    qshard.NVFP4WeightOnlyConfig(backend="triton"),
]
IDS = ["fp8-64", "fp8-128-ue8m0", "int4-g32", "int4-sym-g64", "int4-fzero", "mxfp4", "nvfp4"]


def offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)


def check_against_reference(q, x, offs, bias=None):
    out = q.grouped_linear(x, offs, bias)
    reference = q.with_changes(backend=Backend.REFERENCE).grouped_linear(x, offs, bias)
    assert out.dtype == x.dtype and out.shape == reference.shape
    end = int(offs[-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:])), "rows past offs[-1]"
    error = relative_error(out[:end].float(), reference[:end].float())
    assert error <= MAX_RELATIVE_ERROR[x.dtype], f"relative error {error:.2e}"


COUNTS = {"mixed": [3, 0, 17, 1, 0], "decode": [1, 1, 0, 0, 2], "prefill": [40, 0, 0, 0, 9]}


@pytest.mark.parametrize("config", CONFIGS, ids=IDS)
@pytest.mark.parametrize("counts", list(COUNTS.values()), ids=list(COUNTS))
def test_grouped_kernel_matches_reference(config, counts):
    experts, n, k = len(counts), 80, 192  # N: a partial 64-row tile; K: a partial 128-block
    weight = torch.randn(experts, n, k, device=DEVICE) * 0.02
    q = layout_for(config).from_float(weight.to(ACT_DTYPE), config)
    tokens = sum(counts) + 2  # two rows past offs[-1] (expert-parallel sentinels)
    x = torch.randn(tokens, k, device=DEVICE, dtype=ACT_DTYPE)
    bias = torch.randn(experts, n, device=DEVICE, dtype=ACT_DTYPE) if counts[0] == 3 else None
    check_against_reference(q, x, offsets(counts), bias)


@pytest.mark.parametrize("config", CONFIGS[:1] + CONFIGS[2:3], ids=["fp8", "int4"])
def test_grouped_kernel_transposed_experts_and_grouped_mm(config):
    """The op transformers' grouped_mm calls on gpt-oss's transposed storage runs the kernel."""
    weight = torch.randn(4, 64, 128, device=DEVICE) * 0.02
    q = layout_for(config).from_float(weight.to(ACT_DTYPE), config)
    stored = q.transpose(-2, -1)  # [E, K, N], as gpt-oss keeps its experts
    x = torch.randn(9, 128, device=DEVICE, dtype=ACT_DTYPE)
    offs = offsets([2, 4, 0, 3])
    out = torch._grouped_mm(x, stored, offs=offs)
    expected = q.with_changes(backend=Backend.REFERENCE).grouped_linear(x, offs)
    assert relative_error(out.float(), expected.float()) <= MAX_RELATIVE_ERROR[x.dtype]


def test_int4_device_form_backends_refuse_experts():
    q = qshard.Int4Tensor.from_float(
        torch.randn(2, 32, 64), qshard.Int4WeightOnlyConfig(group_size=32, backend="tinygemm")
    )
    x = torch.randn(3, 64)
    with pytest.raises(qshard.errors.BackendUnavailableError, match="grouped"):
        q.grouped_linear(x, offsets([1, 2]).cpu())


@pytest.mark.parametrize("prequant", [False, True], ids=["fused-act-quant", "prequant"])
def test_fp8_grouped_kernel_both_activation_paths(prequant):
    """The kernel's two ways of quantizing activations (the default config takes one)."""
    from qshard.kernels.grouped.ops import fp8_grouped_launch

    q = qshard.Fp8BlockwiseTensor.from_float(
        (torch.randn(3, 96, 160, device=DEVICE) * 0.02).to(ACT_DTYPE),
        qshard.Fp8BlockwiseConfig(block_size=(32, 32)),
    )
    x = torch.randn(12, 160, device=DEVICE, dtype=ACT_DTYPE)
    offs = offsets([5, 0, 6])
    config = {"BLOCK_N": 64, "BLOCK_M": 16, "PREQUANT": prequant, "num_warps": 4, "num_stages": 2}
    out = fp8_grouped_launch(x, offs, q.qdata, q.scale, None, 32, 32, 32, False, config)
    expected = q.with_changes(backend=Backend.REFERENCE).grouped_linear(x, offs)
    assert torch.equal(out[11:], torch.zeros_like(out[11:]))
    assert relative_error(out[:11].float(), expected[:11].float()) <= MAX_RELATIVE_ERROR[x.dtype]


# The decode GEMV (`grouped/select.py` picks it up to 2 rows per expert) with steps of 128
# and 8 words, so that K = 176 (22 words, partial groups of 32 and 64) runs as a masked step
# alone and as whole steps plus a masked one.
GEMV_BLOCKS = [(16, 128), (8, 8)]  # BLOCK_N, BLOCK_W


@pytest.mark.parametrize("config", CONFIGS[2:], ids=IDS[2:])
@pytest.mark.parametrize("block", GEMV_BLOCKS, ids=["n16w128", "n8w8"])
def test_grouped_gemv_matches_reference(config, block, monkeypatch):
    from qshard.kernels.grouped import w4a16_gemv

    block_n, block_w = block
    gemv = {"KERNEL": "gemv", "BLOCK_N": block_n, "BLOCK_W": block_w, "num_warps": 4}
    monkeypatch.setattr(w4a16_gemv, "config", lambda *args: dict(gemv))
    counts = [2, 0, 5, 1, 0, 1]
    experts, n, k = len(counts), 40, 176
    weight = torch.randn(experts, n, k, device=DEVICE) * 0.02
    q = layout_for(config).from_float(weight.to(ACT_DTYPE), config)
    x = torch.randn(sum(counts) + 3, k, device=DEVICE, dtype=ACT_DTYPE)
    bias = torch.randn(experts, n, device=DEVICE, dtype=ACT_DTYPE) if block_w == 8 else None
    check_against_reference(q, x, offsets(counts), bias)


def test_grouped_config_picks_the_gemv_for_decode_only():
    from qshard.kernels.grouped.select import choose_w4a16
    from qshard.kernels.w4a16.format import Format

    def w4a16_grouped_config(fmt, tokens, experts, k):
        return choose_w4a16(fmt, tokens, experts, k).config

    assert w4a16_grouped_config(Format.MXFP4, 8, 128, 2048)["KERNEL"] == "gemv"  # 1 token
    assert w4a16_grouped_config(Format.INT4_ASYM, 128, 128, 2048)["KERNEL"] == "gemv"  # 16
    assert "KERNEL" not in w4a16_grouped_config(Format.INT4_ASYM, 129, 128, 2048)
    # 32 tokens (256 rows, 2 per expert): the tensor-core kernel (decode at batch 32, H100)
    assert "KERNEL" not in w4a16_grouped_config(Format.INT4_ASYM, 256, 128, 2048)
    assert "KERNEL" not in w4a16_grouped_config(Format.INT4_ASYM, 8, 128, 2044)  # K % 8


def test_grouped_decode_with_k_not_a_multiple_of_8():
    """Rows that are not whole words: decode takes the tensor-core kernel."""
    config = qshard.Int4WeightOnlyConfig(group_size=32, backend="triton")
    q = layout_for(config).from_float(
        (torch.randn(3, 48, 100, device=DEVICE) * 0.02).to(ACT_DTYPE), config
    )
    x = torch.randn(4, 100, device=DEVICE, dtype=ACT_DTYPE)
    check_against_reference(q, x, offsets([1, 0, 2]))
