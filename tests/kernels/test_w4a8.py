"""W4A8 (int4 weights with FP8 activations, kernels/w4a8.py): the definition, the CPU route,
the Triton kernel (under the interpreter on the CPU with float16 activations, docs/design.md,
"PyTorch behaviour"; compiled on a GPU, where from 128 tokens the cuBLAS route runs too) and
the layout's dispatch and errors. Fresh random inputs each run; odd N and K (partial blocks and
groups), experts with no tokens, rows past offs[-1], a bias."""

from __future__ import annotations

import pytest
import torch
from helpers import relative_error

import qshard
from qshard.config import Backend
from qshard.errors import BackendUnavailableError, ConfigError
from qshard.kernels.availability import triton_unavailable_reason
from qshard.kernels.fp8_blockwise import e4m3_to_float64
from qshard.kernels.int4 import dequantize_int4, quantize_int4
from qshard.kernels.w4a8 import (
    ActivationQuant,
    quantize_w4a8_activations,
    w4a8_linear_dequantized,
    w4a8_linear_reference,
)
from qshard.layouts import layout_for

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_PROBLEM = triton_unavailable_reason(DEVICE, fp8=True)
needs_kernel = pytest.mark.skipif(KERNEL_PROBLEM is not None, reason=str(KERNEL_PROBLEM))
ACT_DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float16
# The kernels against the reference: the same e4m3 codes and scales; the tensor cores' fp8 sums
# within a block and the fp32 order differ (measured <= 5e-4 on an H200, bench/bench_w4a8.py),
# and the cuBLAS route adds the bias to the rounded output (one more rounding of the output
# dtype, 2**-11 fp16, 2**-8 bf16).
MAX_KERNEL_ERROR = {torch.float16: 2e-3, torch.bfloat16: 8e-3}[ACT_DTYPE]
MODES = ["fp8_group", "fp8_token"]


def int4_weight(n: int, k: int, group: int, symmetric: bool, acts: str, backend="auto", e=None):
    shape = (n, k) if e is None else (e, n, k)
    w = torch.randn(shape, device=DEVICE, dtype=ACT_DTYPE) * 0.05
    config = qshard.Int4WeightOnlyConfig(group, symmetric, backend, activations=acts)
    return layout_for(config).from_float(w, config)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("symmetric", [False, True])
def test_the_reference_is_the_quantized_activations_times_the_weight(mode, symmetric):
    """The definition: e4m3 activations times their scales, times (u - z) * s, summed; the
    reference's per-block fp32 promotion is within fp32 rounding of that float64 product."""
    n, k, group = 24, 300, 64
    w = torch.randn(n, k)
    q, s, z = quantize_int4(w, group, symmetric)
    x = torch.randn(5, k, dtype=torch.float16) * 3
    xq, x_scale = quantize_w4a8_activations(x, group, ActivationQuant(mode))
    if mode == "fp8_token":  # one scale per token, amax / 448 of the whole row
        assert torch.equal(x_scale, x_scale[:, :1].expand_as(x_scale))
        assert torch.equal(x_scale[:, 0], x.float().abs().amax(1) / 448)
    x_values = e4m3_to_float64(xq) * x_scale.double().repeat_interleave(64, 1)[:, :k]
    weight = dequantize_int4(q, s, z, group, k, torch.float64)
    want = x_values @ weight.t()
    got = w4a8_linear_reference(x, q, s, z, group, ActivationQuant(mode))
    assert relative_error(got.double(), want) < 1e-3  # fp16 output rounding
    dequantized = w4a8_linear_dequantized(x, q, s, z, group, ActivationQuant(mode))
    assert relative_error(dequantized.double(), got.double()) < 1e-3


def test_w4a8_differs_from_weight_only_by_the_activation_rounding():
    """Opting in changes the numerics (the README says so): close to weight-only, not equal."""
    torch.manual_seed(0)
    w = torch.randn(64, 512)
    x = torch.randn(8, 512)
    outs = {}
    for acts in ("none", "fp8_group"):
        config = qshard.Int4WeightOnlyConfig(activations=acts)
        outs[acts] = torch.nn.functional.linear(x, layout_for(config).from_float(w, config))
    error = relative_error(outs["fp8_group"], outs["none"])
    assert 1e-4 < error < 5e-2, error


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("m", "n", "k", "group", "symmetric"),
    [(1, 40, 256, 128, False), (5, 33, 301, 64, True), (17, 70, 512, 256, False)]
    + ([(130, 256, 1024, 128, False), (200, 384, 512, 256, True)] if DEVICE.type == "cuda" else []),
)
def test_the_kernel_matches_the_reference(mode, m, n, k, group, symmetric):
    weight = int4_weight(n, k, group, symmetric, mode, backend="triton")
    x = torch.randn(m, k, device=DEVICE, dtype=ACT_DTYPE)
    bias = torch.randn(n, device=DEVICE, dtype=ACT_DTYPE)
    got = torch.nn.functional.linear(x, weight, bias)
    want = torch.nn.functional.linear(x, weight.with_changes(backend=Backend.REFERENCE), bias)
    assert got.dtype == x.dtype and got.shape == (m, n)
    assert relative_error(got.float(), want.float()) <= MAX_KERNEL_ERROR


@needs_kernel
@pytest.mark.parametrize("mode", MODES)
def test_the_grouped_kernel_matches_each_experts_reference(mode):
    counts = [3, 0, 17, 1, 0]
    weight = int4_weight(48, 320, 64, False, mode, backend="triton", e=len(counts))
    offs = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts) + 4, 320, device=DEVICE, dtype=ACT_DTYPE)
    bias = torch.randn(len(counts), 48, device=DEVICE, dtype=ACT_DTYPE)
    out = weight.grouped_linear(x, offs, bias)
    want = weight.with_changes(backend=Backend.REFERENCE).grouped_linear(x, offs, bias)
    end = int(offs[-1])
    assert not out[end:].any(), "rows past offs[-1] are zeros"
    assert relative_error(out[:end].float(), want[:end].float()) <= MAX_KERNEL_ERROR


@needs_kernel
def test_the_act_quant_kernels_split_order_is_each_blocks_even_then_odd_columns():
    from qshard.kernels.fp8.act_quant import act_quant_launch

    x = torch.randn(5, 300, device=DEVICE, dtype=ACT_DTYPE)
    plain, scales = act_quant_launch(x, 128, False)
    split, split_scales = act_quant_launch(x, 128, False, split=True)
    assert split.shape == (5, 384) and torch.equal(split_scales, scales)
    padded = torch.zeros(5, 384, device=DEVICE)
    padded[:, :300] = plain.float()
    want = padded.view(5, 3, 64, 2).transpose(2, 3).reshape(5, 384)
    assert torch.equal(split.float(), want)


@needs_kernel
@pytest.mark.parametrize(("group", "symmetric"), [(128, False), (256, True), (256, False)])
def test_the_expanded_codes_are_u_minus_z_in_the_split_order(group, symmetric):
    from qshard.kernels.w4a8_triton.cublas import expand_codes

    q, s, z = quantize_int4(torch.randn(70, 512, device=DEVICE), group, symmetric)
    codes = dequantize_int4(q, torch.ones_like(s), z, group, 512, torch.float32)
    want = codes.view(70, 4, 64, 2).transpose(2, 3).reshape(70, 512)
    assert torch.equal(expand_codes(q, z, group).float(), want)


def test_groups_the_kernel_cannot_take_run_the_dequantized_route_or_refuse():
    """Groups of 32 (K blocks of 32; the kernel takes 64+): `auto` computes the same numerics
    by dequantize-and-matmul; `triton` says why it cannot run (on every device)."""
    x = torch.randn(3, 256, device=DEVICE, dtype=ACT_DTYPE)
    auto = int4_weight(16, 256, 32, False, "fp8_group")
    want = torch.nn.functional.linear(x, auto.with_changes(backend=Backend.REFERENCE))
    got = torch.nn.functional.linear(x, auto)
    assert relative_error(got.float(), want.float()) < 1e-3
    forced = auto.with_changes(backend=Backend.TRITON)
    with pytest.raises(BackendUnavailableError, match="backend 'triton' cannot run here"):
        torch.nn.functional.linear(x, forced)


def test_a_row_parallel_cut_inside_a_group_regroups_and_keeps_the_definition():
    """A TP shard cut at 64 columns of 128-groups: groups of 64, activation blocks of 64 from
    the shard's start (as FP8 blockwise re-blocks); the shard's output is its reference's."""
    weight = int4_weight(32, 512, 128, False, "fp8_group")
    shard = weight[:, 64:320]
    assert shard.group_size == 64 and shard.activations is ActivationQuant.FP8_GROUP
    x = torch.randn(4, 256, device=DEVICE, dtype=ACT_DTYPE)
    canonical = shard.canonical()
    want = w4a8_linear_reference(
        x, canonical.qdata, shard.scale, shard.zero, 64, ActivationQuant.FP8_GROUP
    )
    got = torch.nn.functional.linear(x, shard)
    assert relative_error(got.float(), want.float()) < 1e-3


def test_the_config_refuses_what_w4a8_cannot_be():
    with pytest.raises(ConfigError, match="activations='fp8' is not one of"):
        qshard.Int4WeightOnlyConfig(activations="fp8")
    with pytest.raises(ConfigError, match="a float zero point is not a code"):
        qshard.Int4WeightOnlyConfig(activations="fp8_group", zero_point_domain="float")
    with pytest.raises(ConfigError, match="backend 'tinygemm' is weight-only"):
        qshard.Int4WeightOnlyConfig(activations="fp8_token", backend="tinygemm")


def test_the_activation_mode_survives_save_and_load(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(256, 64)).to(DEVICE, ACT_DTYPE)
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(activations="fp8_token"))
    x = torch.randn(3, 256, device=DEVICE, dtype=ACT_DTYPE)
    want = model(x)
    qshard.save(model, tmp_path / "w4a8")
    fresh = torch.nn.Sequential(torch.nn.Linear(256, 64)).to(DEVICE, ACT_DTYPE)
    qshard.load(tmp_path / "w4a8", fresh, device=DEVICE)
    assert fresh[0].weight.activations is ActivationQuant.FP8_TOKEN
    assert torch.equal(fresh(x), want)


def test_compiled_equals_eager():
    """One layer: between two, inductor may skip rounding the first output to fp16 before the
    second quantizes it (its default, emulate_precision_casts off), which moves e4m3 codes."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 128)).to(DEVICE, ACT_DTYPE)
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(activations="fp8_group"))
    x = torch.randn(6, 256, device=DEVICE, dtype=ACT_DTYPE)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    assert torch.equal(compiled, eager)
