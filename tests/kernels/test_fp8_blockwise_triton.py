"""The FP8 blockwise Triton kernels (and the cuBLAS backend on a GPU) against the reference.

Without a GPU these run under the Triton interpreter (conftest sets TRITON_INTERPRET=1), with
float16 activations where a bf16 dot would be involved (docs/design.md, "PyTorch behaviour"); on a
GPU they run the
compiled kernels. Fresh random inputs every run, odd shapes, partial edge blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import relative_error

import qshard
from qshard import BackendUnavailableError, Fp8BlockwiseConfig, ScaleFormat
from qshard.kernels import fp8_blockwise as ref
from qshard.kernels.availability import triton_unavailable_reason
from qshard.kernels.loader import load_gpu_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    triton_unavailable_reason(torch.device(DEVICE)) is not None,
    reason=str(triton_unavailable_reason(torch.device(DEVICE))),
)
# Output relative error vs the reference: the tensor cores sum each group's fp8 products in
# another order (and, on Hopper, with ~14-bit accumulation inside a group: DeepSeek-V3 §3.3.2),
# then the output is rounded to bf16/fp16. The bound.
MAX_RELATIVE_ERROR = 1e-2


def scale_format(ue8m0: bool) -> ScaleFormat:
    return ScaleFormat.UE8M0 if ue8m0 else ScaleFormat.FP32


@pytest.mark.parametrize(
    ("m", "k", "group", "ue8m0", "dtype"),
    [
        (1, 256, 128, False, torch.float16),
        (17, 200, 64, True, torch.float16),  # a partial last group
        (40, 384, 128, False, torch.float32),
        (3, 96, 32, True, torch.bfloat16),
    ],
)
def test_activation_quantization_is_bit_exact(m, k, group, ue8m0, dtype):
    load_gpu_ops()
    x = torch.randn(m, k, dtype=dtype, device=DEVICE) * 3
    x[0, :group] = 0  # an all-zero group gets scale 1.0
    q, scales = torch.ops.qshard.fp8_act_quant(x, group, ue8m0)
    expected_q, expected_scales = ref.quantize_activation_groups(x, group, scale_format(ue8m0))
    assert scales.shape == (-(-k // group), m)  # group-major, what the GEMM and cuBLAS read
    assert torch.equal(scales.t(), expected_scales)
    assert torch.equal(q.view(torch.uint8), expected_q.view(torch.uint8))


SHAPES = [  # (N, K, block_size, act_group_size)
    (96, 256, (128, 128), 128),
    (200, 200, (64, 128), 64),  # partial edge blocks in N and K, re-blocked-style 1x64 groups
    (130, 384, (128, 128), 128),
    (72, 96, (32, 64), 32),
    (40, 1100, (128, 128), 128),  # several GEMV steps of 512 and a partial group at the end
]


@pytest.mark.parametrize("m", [1, 3, 17, 257])  # GEMV, small-M (split K), tensor-core GEMM
@pytest.mark.parametrize(("n", "k", "block", "group"), SHAPES)
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_triton_gemm_matches_the_reference(m, n, k, block, group, ue8m0):
    load_gpu_ops()
    weight = torch.randn(n, k, device=DEVICE) * 0.02
    qdata, scale = ref.quantize_weight_blockwise(weight, block, scale_format(ue8m0))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE) if m % 2 else None
    out = torch.ops.qshard.fp8_blockwise_linear(
        x, qdata, scale, bias, *block, group, ue8m0, "triton"
    )
    expected = ref.fp8_blockwise_linear_reference(
        x,
        qdata,
        scale,
        block_size=block,
        act_group_size=group,
        scale_format=scale_format(ue8m0),
        weight_only=False,
        bias=bias,
    )
    assert out.dtype == dtype and out.shape == (m, n)
    measured = relative_error(out, expected)
    assert measured <= MAX_RELATIVE_ERROR, f"relative error {measured:.2e} > {MAX_RELATIVE_ERROR}"


# Each kernel forced by its config: the GEMV, the small-M kernel without and with split K (the
# atomic fp32 partial sums, then bias + cast), several token tiles, and the tensor-core GEMM.
KERNEL_CONFIGS = {
    "gemv": dict(BLOCK_N=16, GROUPS_PER_STEP=4, num_warps=4, num_stages=3),
    "small-m": dict(BLOCK_N=64, BLOCK_M=16, SPLIT_K=1, num_warps=4, num_stages=4),
    "small-m-split3": dict(BLOCK_N=64, BLOCK_M=16, SPLIT_K=3, num_warps=4, num_stages=4),
    "small-m-tiles": dict(BLOCK_N=64, BLOCK_M=32, SPLIT_K=2, num_warps=4, num_stages=4),
    "small-m-prequant": dict(BLOCK_N=64, BLOCK_M=16, SPLIT_K=2, PREQUANT=True, num_warps=4),
    "gemm": dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
}


@pytest.mark.parametrize("kernel", KERNEL_CONFIGS)
@pytest.mark.parametrize(
    ("m", "n", "k", "block", "group", "ue8m0"),
    [(5, 130, 1100, (128, 128), 128, False), (70, 72, 200, (32, 64), 32, True)],
)
def test_each_triton_kernel_matches_the_reference(kernel, m, n, k, block, group, ue8m0):
    from qshard.kernels.fp8.ops import triton_linear_launch as linear_launch

    load_gpu_ops()
    weight = torch.randn(n, k, device=DEVICE) * 0.02
    qdata, scale = ref.quantize_weight_blockwise(weight, block, scale_format(ue8m0))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    x = torch.randn(m, k, dtype=dtype, device=DEVICE)
    bias = torch.randn(n, dtype=dtype, device=DEVICE)
    out = linear_launch(x, qdata, scale, bias, *block, group, ue8m0, KERNEL_CONFIGS[kernel])
    expected = ref.fp8_blockwise_linear_reference(
        x,
        qdata,
        scale,
        block_size=block,
        act_group_size=group,
        scale_format=scale_format(ue8m0),
        weight_only=False,
        bias=bias,
    )
    measured = relative_error(out, expected)
    assert measured <= MAX_RELATIVE_ERROR, f"relative error {measured:.2e} > {MAX_RELATIVE_ERROR}"


@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
def test_fused_activation_quantization_gives_the_reference_codes(ue8m0):
    """The fused kernels quantize with a corrected reciprocal, not a division: the codes must
    still be the reference's, so the fused small-M kernel equals the same kernel reading the
    exact act-quant kernel's output bit for bit. bf16-valued activations land on e4m3 rounding
    midpoints often (an uncorrected reciprocal got 0.05 % of codes wrong, found in review); a
    group of values near 1e-38 has a subnormal scale, whose reciprocal overflows fp32."""
    from qshard.kernels.fp8.ops import triton_linear_launch as linear_launch

    m, n, k = 32, 64, 1024
    weight = torch.randn(n, k, device=DEVICE) * 0.02
    qdata, scale = ref.quantize_weight_blockwise(weight, (128, 128), scale_format(ue8m0))
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16).float()
    x[1, :128] = torch.randn(128, device=DEVICE) * 1e-38  # a subnormal group scale
    x[1, :128:2] = 0
    config = dict(BLOCK_N=64, BLOCK_M=32, SPLIT_K=1, num_warps=4)
    fused = linear_launch(x, qdata, scale, None, 128, 128, 128, ue8m0, config)
    exact = linear_launch(x, qdata, scale, None, 128, 128, 128, ue8m0, config | {"PREQUANT": True})
    assert torch.equal(fused, exact)
    gemv = dict(BLOCK_N=16, GROUPS_PER_STEP=4, num_warps=4)  # fused quantization too
    expected = ref.fp8_blockwise_linear_reference(
        x[1:2],
        qdata,
        scale,
        block_size=(128, 128),
        act_group_size=128,
        scale_format=scale_format(ue8m0),
        weight_only=False,
    )
    out = linear_launch(x[1:2], qdata, scale, None, 128, 128, 128, ue8m0, gemv)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.cuda
def test_split_k_gives_the_same_bits_on_every_run():
    from qshard.kernels.fp8.ops import triton_linear_launch as linear_launch

    weight = torch.randn(256, 4096, device="cuda") * 0.02
    qdata, scale = ref.quantize_weight_blockwise(weight, (128, 128), ScaleFormat.FP32)
    x = torch.randn(16, 4096, dtype=torch.bfloat16, device="cuda")
    config = KERNEL_CONFIGS["small-m-split3"]
    first = linear_launch(x, qdata, scale, None, 128, 128, 128, False, config)
    for _ in range(20):
        assert torch.equal(
            linear_launch(x, qdata, scale, None, 128, 128, 128, False, config), first
        )


def test_the_small_m_config_splits_k_to_fill_the_gpu():
    from qshard.kernels.fp8.select import triton_kernel_for
    from qshard.kernels.fp8.small_m import config as small_m_config

    assert [triton_kernel_for(m) for m in (1, 2, 64, 65)] == ["gemv", "small_m", "small_m", "gemm"]
    device = torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4
    few_tiles = small_m_config(16, 4096, 14336, 128, device, block_n=64, waves=2)  # 64 tiles
    assert few_tiles["BLOCK_M"] == 16 and few_tiles["SPLIT_K"] == max(1, round(2 * sms / 64))
    many_tiles = small_m_config(16, 28672, 4096, 128, device, block_n=64)  # 448 tiles
    assert many_tiles["SPLIT_K"] == 1
    short_k = small_m_config(100, 64, 256, 128, device)  # 2 groups: too few to split
    assert short_k["SPLIT_K"] == 1 and short_k["BLOCK_M"] == 64
    tuned = small_m_config(16, 4096, 4096, 128, device)  # the tuned row for M <= 16
    assert (tuned["BLOCK_N"], tuned["num_warps"], tuned["PREQUANT"]) == (128, 8, False)


@pytest.mark.parametrize("act_dtype", [torch.float16, torch.float32])
def test_the_layout_routes_to_triton_when_asked(act_dtype):
    linear = torch.nn.Linear(256, 160, bias=True, device=DEVICE)
    reference = torch.nn.Linear(256, 160, bias=True, device=DEVICE)
    reference.load_state_dict(linear.state_dict())
    qshard.quantize_(linear, Fp8BlockwiseConfig(backend="triton"))
    qshard.quantize_(reference, Fp8BlockwiseConfig(backend="reference"))
    assert linear.weight.select_backend(torch.empty(1, device=DEVICE)) is qshard.Backend.TRITON
    linear, reference = linear.to(act_dtype), reference.to(act_dtype)
    x = torch.randn(2, 5, 256, dtype=act_dtype, device=DEVICE)
    with torch.no_grad():
        out, expected = linear(x), reference(x)
    assert out.shape == (2, 5, 160) and out.dtype == act_dtype
    assert relative_error(out, expected) <= MAX_RELATIVE_ERROR


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize(("m", "n", "k"), [(0, 96, 128), (16, 0, 128), (16, 96, 0)])
def test_empty_matmuls_give_empty_or_bias_outputs(backend, m, n, k):
    """Zero tokens, rows or columns: no kernel runs (nor is one chosen: a split count over zero
    tiles divides by zero); the output is empty, or the bias where K = 0."""
    load_gpu_ops()
    qdata, scale = ref.quantize_weight_blockwise(
        torch.randn(n, k, device=DEVICE) * 0.02, (128, 128), ScaleFormat.FP32
    )
    x = torch.randn(m, k, dtype=torch.float16, device=DEVICE)
    bias = torch.randn(n, dtype=torch.float16, device=DEVICE)
    out = torch.ops.qshard.fp8_blockwise_linear(
        x, qdata, scale, bias, 128, 128, 128, False, backend
    )
    assert out.shape == (m, n)
    assert torch.equal(out, bias.expand(m, n))


def test_the_ops_have_consistent_fake_implementations():
    # (opcheck's test_schema compares outputs with allclose, which fp8 tensors lack on CPU.)
    load_gpu_ops()
    weight = torch.randn(96, 128, device=DEVICE) * 0.02
    qdata, scale = ref.quantize_weight_blockwise(weight, (128, 128), ScaleFormat.FP32)
    x = torch.randn(3, 128, dtype=torch.float16, device=DEVICE)
    torch.library.opcheck(
        torch.ops.qshard.fp8_blockwise_linear.default,
        (x, qdata, scale, None, 128, 128, 128, False, "triton"),
        test_utils="test_faketensor",
    )
    torch.library.opcheck(
        torch.ops.qshard.fp8_act_quant.default,
        (x, 128, False),
        test_utils="test_faketensor",
    )


@pytest.mark.skipif(DEVICE != "cpu", reason="what the CPU cannot run")
def test_unavailable_backends_are_reported_not_substituted():
    weight = torch.randn(128, 128) * 0.02
    x = torch.randn(2, 128)
    cublas = qshard.Fp8BlockwiseTensor.from_float(weight, Fp8BlockwiseConfig(backend="cublas"))
    with pytest.raises(BackendUnavailableError, match=r"'cublas' cannot run here: .*CUDA"):
        F.linear(x, cublas)
    weight_only = Fp8BlockwiseConfig(backend="triton", weight_only=True)
    with pytest.raises(BackendUnavailableError, match="weight-only"):
        F.linear(x, qshard.Fp8BlockwiseTensor.from_float(weight, weight_only))
    fine = Fp8BlockwiseConfig(block_size=(16, 16), backend="triton")
    with pytest.raises(BackendUnavailableError, match="groups of 32 or more, not 16"):
        F.linear(x, qshard.Fp8BlockwiseTensor.from_float(weight, fine))
    auto = qshard.Fp8BlockwiseTensor.from_float(weight)  # the interpreter is for tests only
    assert auto.select_backend(x) is qshard.Backend.REFERENCE


# ---- on a GPU: cuBLAS, auto, compile -----------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 16, 300])
def test_cublas_and_auto_match_the_reference_on_gpu(m):
    load_gpu_ops()
    n, k = 384, 512
    weight = torch.randn(n, k, device="cuda") * 0.02
    qdata, scale = ref.quantize_weight_blockwise(weight, (128, 128), ScaleFormat.FP32)
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    expected = ref.fp8_blockwise_linear_reference(
        x,
        qdata,
        scale,
        block_size=(128, 128),
        act_group_size=128,
        scale_format=ScaleFormat.FP32,
        weight_only=False,
        bias=bias,
    )
    for backend in ("cublas", "auto"):
        out = torch.ops.qshard.fp8_blockwise_linear(
            x, qdata, scale, bias, 128, 128, 128, False, backend
        )
        assert relative_error(out, expected) <= MAX_RELATIVE_ERROR, backend


@pytest.mark.cuda
def test_auto_is_the_default_on_gpu_and_compiles_once_with_a_dynamic_batch():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = (
        torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.SiLU(), torch.nn.Linear(1024, 512))
        .cuda()
        .to(torch.bfloat16)
    )
    qshard.quantize_(model, Fp8BlockwiseConfig())
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    assert model[0].weight.select_backend(x) is qshard.Backend.AUTO
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        # Across the GEMV / cuBLAS switch, which happens inside the op (no guard on M). M = 1
        # is left out: dynamo specializes size-1 dims, a compile of its own.
        for m in (2, 17, 300):
            x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            torch._dynamo.mark_dynamic(x, 0)
            measured = qshard.sqnr_db(model(x), compiled(x))
            assert measured > 40, f"M={m}: compiled vs eager {measured:.1f} dB"
    assert counter.frame_count == 1, f"{counter.frame_count} compiles"


COMPILE_FOR_SM89 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qshard.kernels.fp8 import act_quant, gemm, gemv, small_m
from qshard.kernels.w4a8_triton import cublas as w4a8_cublas, tiles as w4a8_tiles

def compile_for_sm89(fn, pointers, ints, constexprs):
    names = list(fn.arg_names)
    types = pointers + ["i32"] * ints + ["constexpr"] * len(constexprs)
    assert len(names) == len(types), (fn, names)
    triton.compile(ASTSource(fn=fn, signature=dict(zip(names, types)), constexprs=constexprs),
                   target=GPUTarget("cuda", 89, 32), options={"num_warps": 4, "num_stages": 3})

blocks = {"W_BLOCK_N": 128, "W_BLOCK_K": 128, "GROUP": 128}
for exact, split in ((False, False), (True, False), (False, True)):
    compile_for_sm89(act_quant._act_quant_kernel, ["*bf16", "*fp8e4nv", "*fp32"], 4,
                     {"GROUP": 128, "UE8M0": False, "EXACT_CAST": exact, "SPLIT": split,
                      "BLOCK_M": 16})
# W4A8 (kernels/w4a8_triton/): the tile kernel, dense and grouped, and the codes' expansion
for dense in (True, False):
    compile_for_sm89(w4a8_tiles._w4a8_kernel,
                     ["*fp8e4nv", "*fp32", "*u8", "*bf16", "*bf16", "*bf16", "*bf16", "*i32"], 12,
                     {"GROUP": 128, "KB": 128, "SYMMETRIC": not dense, "DENSE": dense,
                      "HAS_BIAS": True, "EVEN_K": False, "BLOCK_N": 128, "BLOCK_M": 64,
                      "E_POW2": 1 if dense else 8})
compile_for_sm89(w4a8_cublas._expand_kernel, ["*u8", "*bf16", "*fp8e4nv"], 3,
                 {"SYMMETRIC": False, "GROUP": 128, "BLOCK_N": 64})
compile_for_sm89(gemm._gemm_kernel, ["*fp8e4nv", "*fp32", "*fp8e4nv", "*fp32", "*bf16", "*bf16"], 7,
                 {**blocks, "HAS_BIAS": True, "EVEN_K": False, "BLOCK_M": 64, "BLOCK_N": 128,
                  "GROUP_M": 8})
compile_for_sm89(gemv._gemv_kernel, ["*bf16", "*fp8e4nv", "*fp32", "*bf16", "*bf16"], 7,
                 {**blocks, "UE8M0": False, "EXACT_CAST": False, "HAS_BIAS": True,
                  "EVEN_K": False, "BLOCK_N": 16, "GROUPS_PER_STEP": 8})
for prequant in (False, True):
    x = "*fp8e4nv" if prequant else "*bf16"
    compile_for_sm89(small_m._small_m_kernel,
                     [x, "*fp32", "*fp8e4nv", "*fp32", "*bf16", "*bf16", "*fp32", "*i32"], 8,
                     {**blocks, "UE8M0": False, "EXACT_CAST": False, "HAS_BIAS": True,
                      "EVEN_K": False, "BLOCK_N": 64, "BLOCK_M": 16, "SPLIT": True,
                      "PREQUANT": prequant})
"""


def test_the_fp8_kernels_compile_for_sm89():
    """The FP8 kernels are meant to run on Ada (sm_89) too, where Triton has an fp8 dot and
    cuBLAS blockwise does not run (issue 5): each compiles to a cubin for an sm_89 target, in a
    process without the interpreter; needs no GPU. (Run on one, it would compile for it.) The
    W4A8 kernels (int4 weights, FP8 activations) too."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_SM89],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
