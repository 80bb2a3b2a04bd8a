"""The host code of the GPU paths, on the CPU: what CI otherwise never runs, so that a broken
signature or size there is seen before a user's GPU sees it.

- The Gluon launches (the FP8 blockwise kernel, the int4 register kernel and its
  warp-specialized variant): each launcher runs to its kernel launch, the launch itself
  replaced by a stand-in that binds the arguments to the kernel's own signature; the test
  checks what each parameter receives against what the kernel reads (pointers, strides, the
  split-K workspaces, the grid, the constexprs), then compiles the kernel for sm_90 from
  exactly those arguments (in a child process, as the kernel tests do) and checks that its
  shared memory fits a Hopper SM as often as the config plans.
- The cuBLAS calls: `torch._scaled_mm` with row-wise scales runs on the CPU (checked for the
  layout cuBLAS takes as well); blockwise `F.scaled_mm` does not, and is emulated from torch's
  own scale layout checks (aten ScaledBlas.cpp, `is_blockwise_1x128_scaling` and
  `is_blockwise_128x128_scaling`). Both are compared against the references.
- gemlite (optional, and its import needs a GPU): a stand-in with gemlite 0.6's API.
- The SM count lookup, the op's choice of the Gluon kernel, and the fake implementations of
  the grouped ops (`opcheck`, as the 2-D ops have).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import json
import sys
import types

import pytest
import torch
import torch.nn.functional as F
import triton
from helpers import compile_for_sm90, relative_error

import qshard
from qshard.config import ScaleFormat
from qshard.kernels import fp8_blockwise as fp8_ref
from qshard.kernels import gpu, split_k
from qshard.kernels.availability import triton_unavailable_reason
from qshard.kernels.gluon_api import GLUON_IMPORT_ERROR
from qshard.kernels.gpu import smem_budget
from qshard.kernels.loader import load_gpu_ops, load_grouped_ops

CPU = torch.device("cpu")
# The launchers run here up to the launch, with the Triton kernels before it (activation
# quantization) in the interpreter; on a GPU the kernel tests run them whole.
on_the_cpu = pytest.mark.skipif(
    triton_unavailable_reason(CPU, fp8=False) is not None,
    reason="runs the launchers on the CPU, under the Triton interpreter",
)
with_gluon = pytest.mark.skipif(GLUON_IMPORT_ERROR is not None, reason=str(GLUON_IMPORT_ERROR))
H100_SMS = 132
# Hopper's shared memory: 227 KB for one block, 228 KB per SM, of which 1 KB is reserved per
# resident block (CUDA programming guide, compute capability 9.0)
MAX_SHARED_PER_BLOCK = 227 * 1024
SHARED_PER_SM, RESERVED_PER_BLOCK = 228 * 1024, 1024
REGISTERS_PER_SM = 64 * 1024
# keyword arguments of a launch that are compile options, not kernel parameters
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


# ---- the launch stand-in, and the compile from a recorded launch -------------------------------


@dataclasses.dataclass
class Launch:
    kernel: object  # the kernel the launcher would have launched
    grid: tuple
    args: dict  # every kernel parameter by name, as bound at the launch
    options: dict  # num_warps, maxnreg, ...


def stub_kernel(monkeypatch, module, name: str) -> list[Launch]:
    """Replace the kernel `module.name` by a stand-in that binds each launch's arguments to the
    kernel's signature (a TypeError for one missing, extra or misnamed) and records them; no
    kernel runs."""
    kernel = getattr(module, name)
    launches = []

    class Stub:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                options = {key: kwargs.pop(key) for key in LAUNCH_OPTIONS if key in kwargs}
                bound = kernel.signature.bind(*args, **kwargs)
                launches.append(Launch(kernel, tuple(grid), dict(bound.arguments), options))

            return launch

    monkeypatch.setattr(module, name, Stub())
    return launches


def stub_sm_count(monkeypatch, module, sms: int = H100_SMS) -> list[int]:
    """`module.sm_count` (a CUDA device query) answering `sms`; returns the indices asked.
    The module's shared memory budget, where it has one, is an sm_90 SM's (as on the CPU)."""
    asked = []
    monkeypatch.setattr(module, "sm_count", lambda index: asked.append(index) or sms)
    if hasattr(module, "smem_budget"):
        monkeypatch.setattr(module, "smem_budget", lambda device: smem_budget(CPU))
    return asked


def compile_spec(launch: Launch, module: str, name: str) -> dict:
    """What `triton.compile` needs to build the kernel from this launch, as Triton's launcher
    specializes it: each argument's type (`mangle_type`, as the kernel tests use), the
    constexprs, 16-divisibility where an address or an integer has it (an integer equal to 1,
    which the launcher would make a constant, stays a parameter), and the launch's options."""
    from triton.runtime.jit import mangle_type

    kernel = launch.kernel
    assert list(launch.args) == list(kernel.arg_names), "every parameter bound, in order"
    signature, constexprs, divisible = {}, {}, []
    for index, (param, value) in enumerate(launch.args.items()):
        if index in kernel.constexprs:
            signature[param], constexprs[param] = "constexpr", value
            continue
        signature[param] = mangle_type(value)
        if isinstance(value, torch.Tensor):
            divisible += [index] if value.data_ptr() % 16 == 0 else []
        elif isinstance(value, int) and not isinstance(value, bool):
            divisible += [index] if value % 16 == 0 else []
    return {
        "module": module,
        "name": name,
        "signature": signature,
        "constexprs": constexprs,
        "divisible": divisible,
        "options": launch.options,
    }


COMPILE_SPECS_FOR_SM90 = """
import importlib, json, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
for spec in json.loads({specs!r}):
    kernel = getattr(importlib.import_module(spec["module"]), spec["name"])
    source = GluonASTSource(kernel, spec["signature"], spec["constexprs"],
                            {{(i,): [["tt.divisibility", 16]] for i in spec["divisible"]}})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=spec["options"])
    print(json.dumps({{"shared": compiled.metadata.shared,
                      "num_warps": compiled.metadata.num_warps}}))
"""


def compile_launches_for_sm90(specs: list[dict]) -> list[dict]:
    """Compile each spec for sm_90 in one child process; their metadata (shared, num_warps)."""
    out = compile_for_sm90(COMPILE_SPECS_FOR_SM90.format(specs=json.dumps(specs)))
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def assert_fits_the_sm(shared: int, per_sm: int) -> None:
    """`per_sm` resident blocks of `shared` bytes each fit one Hopper SM."""
    assert shared <= MAX_SHARED_PER_BLOCK, f"{shared} bytes of shared memory per block"
    assert per_sm * (shared + RESERVED_PER_BLOCK) <= SHARED_PER_SM, (per_sm, shared)


def assert_split_k_workspace(partials, arrived, m: int, n: int, splits: int, tiles: int):
    """split_k.py's workspace, as the kernels index it: a [splits, M, N] fp32 slice per split
    (read at split * M * N + token * N + row) and a zeroed int32 counter per tile."""
    assert partials.dtype == torch.float32 and partials.is_contiguous()
    assert partials.numel() == splits * m * n, f"partials {list(partials.shape)}"
    assert arrived.dtype == torch.int32 and arrived.shape == (tiles,)
    assert not arrived.any(), "the counters start at zero"


# ---- the SM count --------------------------------------------------------------------------


def test_the_sm_count_is_the_asked_devices_and_cached(monkeypatch):
    """`sm_count` sizes every persistent grid and split: it must ask the given device (not
    device 0 on a multi-GPU host) and ask it once (`gpu.traits`, cached); a CUDA device with no
    index is device 0."""
    asked = []

    def properties(index):
        asked.append(index)
        sms = {0: 132, 1: 78}[index]
        return types.SimpleNamespace(multi_processor_count=sms, major=9, minor=0)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    gpu.traits.cache_clear()
    try:
        assert (split_k.sm_count(0), split_k.sm_count(1), split_k.sm_count(1)) == (132, 78, 78)
        assert asked == [0, 1]
        # the split of the Triton small-M kernels on GPU 1 (78 SMs): 2 waves over 6 tiles
        assert split_k.split_count(6, 1024, 4, 2.0, torch.device("cuda", 1)) == round(2 * 78 / 6)
        assert split_k.split_count(6, 1024, 4, 2.0, torch.device("cuda")) == round(2 * 132 / 6)
    finally:
        gpu.traits.cache_clear()


# ---- the Gluon FP8 blockwise kernel ------------------------------------------------------------

# (M, N, K, activation dtype, bias): each token tile (16, 32, 64, 128), K split (at 16 and 64
# tokens: 3 and 8 splits on 132 SMs) and not, partial row tiles (N = 200, 130) and a partial
# last group (K = 400)
FP8_GLUON_CASES = [
    (5, 384, 896, torch.bfloat16, True),
    (20, 200, 400, torch.float16, False),
    (40, 256, 2048, torch.float32, True),
    (100, 130, 256, torch.bfloat16, False),
]


def record_fp8_gluon_launch(monkeypatch, m, n, k, dtype, with_bias):
    from qshard.kernels.fp8 import gluon

    launches = stub_kernel(monkeypatch, gluon, "_fp8_kernel")
    stub_sm_count(monkeypatch, gluon)
    weight = torch.randn(n, k) * 0.02
    qdata, scale = fp8_ref.quantize_weight_blockwise(weight, (128, 128), ScaleFormat.FP32)
    x = torch.randn(m, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    out = gluon.launch(x, qdata, scale, bias, False)
    assert len(launches) == 1
    return launches[0], (x, qdata, scale, bias, out)


@on_the_cpu
@with_gluon
@pytest.mark.parametrize(("m", "n", "k", "dtype", "with_bias"), FP8_GLUON_CASES)
def test_gluon_fp8_launch_passes_what_the_kernel_reads(monkeypatch, m, n, k, dtype, with_bias):
    """Each parameter of `_fp8_kernel` against what the kernel does with it: the TMA boxes its
    rings take, the activations quantized as the reference does with group-major scales (read
    at g * M + token), the weight scales' row stride, the split-K buffers as `_finish_half`
    indexes them (a split's partial sums at split * 2 * tiles * 64 * BLOCK_T, a counter per
    half tile), the persistent grid, the constexprs and one warpgroup per partition."""
    from qshard.kernels.fp8.gluon import config as gluon_config

    launch, (x, qdata, scale, bias, out) = record_fp8_gluon_launch(
        monkeypatch, m, n, k, dtype, with_bias
    )
    config = gluon_config(m, n, k, x.device)
    a = launch.args
    tiles, groups, block_t = triton.cdiv(n, 128), triton.cdiv(k, 128), config["BLOCK_T"]
    assert a["w_desc"].base is qdata and a["w_desc"].block_shape == [64, 128]
    xq, x_scale = a["x_desc"].base, a["xs_ptr"]
    assert a["x_desc"].block_shape == [block_t, 128] and xq.shape == (m, k)
    expected_q, expected_scale = fp8_ref.quantize_activation_groups(x, 128, ScaleFormat.FP32)
    assert torch.equal(xq.view(torch.uint8), expected_q.view(torch.uint8))
    assert x_scale.is_contiguous() and torch.equal(x_scale, expected_scale.t()), "xs_ptr"
    assert a["ws_ptr"] is scale and a["stride_wsn"] == scale.stride(0), "ws_ptr, stride_wsn"
    assert scale.shape == (tiles, groups)
    assert a["bias_ptr"] is (bias if with_bias else out) and a["out_ptr"] is out
    assert out.shape == (m, n) and out.dtype == dtype
    assert (a["M"], a["N"], a["tiles"], a["groups"]) == (m, n, tiles, groups)
    splits, per_split = a["splits"], a["per_split"]
    assert per_split * (splits - 1) < groups <= per_split * splits, "no split without groups"
    assert m <= block_t and (block_t == 16 or block_t // 2 < m), "the smallest tile"
    assert (a["BLOCK_T"], a["STAGES"], a["HAS_BIAS"], a["SPLIT"]) == (
        block_t,
        config["STAGES"],
        with_bias,
        splits > 1,
    )
    if splits > 1:
        assert a["part_ptr"].dtype == torch.float32
        assert a["part_ptr"].numel() == splits * (2 * tiles * 64 * block_t), "part_ptr size"
        assert a["cnt_ptr"].dtype == torch.int32 and a["cnt_ptr"].shape == (2 * tiles,)
        assert not a["cnt_ptr"].any()
    assert launch.grid == (min(tiles * splits, config["PER_SM"] * H100_SMS),)
    assert launch.options == {"num_warps": 4}  # the consumer partitions are warpgroups


@on_the_cpu
@with_gluon
def test_gluon_fp8_launches_compile_for_sm90_and_fit_the_sm(monkeypatch):
    """The kernel compiled from each launch above (every token tile): its argument types and
    constexprs are ones it builds with, and the ring `gluon_config` sizes (STAGES) fits the
    shared memory of a Hopper SM with PER_SM programs on it."""
    from qshard.kernels.fp8.gluon import config as gluon_config

    specs, configs = [], []
    for m, n, k, dtype, with_bias in FP8_GLUON_CASES:
        with monkeypatch.context() as patch:
            launch, _ = record_fp8_gluon_launch(patch, m, n, k, dtype, with_bias)
            configs.append(gluon_config(m, n, k, CPU))
        specs.append(compile_spec(launch, "qshard.kernels.fp8.gluon", "_fp8_kernel"))
    compiled = compile_launches_for_sm90(specs)
    assert len(compiled) == len(specs)
    for config, metadata in zip(configs, compiled, strict=True):
        assert_fits_the_sm(metadata["shared"], config["PER_SM"])


def test_the_gluon_fp8_config_uses_the_devices_sm_count(monkeypatch):
    """The split choice runs on the SM count of the activations' device."""
    from qshard.kernels.fp8 import gluon

    asked = stub_sm_count(monkeypatch, gluon, sms=78)
    config = gluon.config(16, 1024, 4096, torch.device("cuda", 1))
    assert asked == [1]
    assert config["SPLITS"] == gluon.split_for(8, 32, 78, 16) and config["BLOCK_T"] == 16


def test_a_gluon_fp8_config_the_kernel_cannot_build_is_refused_before_the_launch(monkeypatch):
    """A token tile the kernel has no wgmma for, or smaller than the tokens (rows of the output
    left unwritten), a one-slot ring or no programs: a ValueError, and nothing launched; no
    tokens: an empty output, and nothing launched."""
    from qshard.kernels.fp8 import gluon

    launches = stub_kernel(monkeypatch, gluon, "_fp8_kernel")
    qdata = torch.zeros(256, 512, dtype=torch.float8_e4m3fn)
    scale = torch.ones(2, 4)
    x = torch.zeros(20, 512, dtype=torch.bfloat16)
    good = {"BLOCK_T": 32, "STAGES": 4, "PER_SM": 1, "SPLITS": 1}
    for bad in ({"BLOCK_T": 8}, {"BLOCK_T": 16}, {"STAGES": 1}, {"PER_SM": 0}):
        with pytest.raises(ValueError, match="BLOCK_T must be 16, 32, 64 or 128"):
            gluon.launch(x, qdata, scale, None, False, {**good, **bad})
    assert gluon.launch(x[:0], qdata, scale, None, False).shape == (0, 256)
    assert not launches


@pytest.mark.parametrize("splits", [1, 3])
def test_the_gluon_fp8_workspace(splits):
    """`half_tile_workspace`: unsplit, nothing (out in both places, never read); split, the fp32
    partial sums of every split's half tiles and a zeroed counter per half tile, on out's
    device."""
    from qshard.kernels.gluon_api import half_tile_workspace

    out = torch.empty(20, 300, dtype=torch.bfloat16)
    partials, arrived = half_tile_workspace(splits, 3, 32, out)
    if splits == 1:
        assert partials is out and arrived is out
        return
    assert partials.dtype == torch.float32 and partials.numel() == splits * 3 * 128 * 32
    assert arrived.dtype == torch.int32 and arrived.shape == (2 * 3,) and not arrived.any()
    assert partials.device == arrived.device == out.device


# ---- the op's choice of it, and cuBLAS blockwise -----------------------------------------------


@on_the_cpu
def test_auto_runs_the_gluon_kernel_in_its_token_range_only(monkeypatch):
    """The FP8 choice (`fp8/select.py`) takes the Gluon kernel where it can run (its reason
    check stubbed to "none"): 2..64 tokens and nothing else; never where it cannot. The op's
    "auto" then launches it with x flattened to 2-D and returns [..., N]."""
    from qshard.kernels.fp8 import gluon
    from qshard.kernels.fp8 import select as gpu

    asked = []
    monkeypatch.setattr(gluon, "problem", lambda *args: asked.append(args) or None)

    def gluon_chosen(x, qdata, block_n, block_k, group):
        return gpu.choose(x, qdata, block_n, block_k, group).kernel == "gluon"

    qdata, scale = fp8_ref.quantize_weight_blockwise(
        torch.randn(256, 512) * 0.02, (128, 128), ScaleFormat.FP32
    )
    x = torch.randn(130, 512, dtype=torch.bfloat16)
    low, high = gpu.GLUON_CHOICE_M
    for m in (0, 1, low, 16, high, high + 1, 128):
        assert gluon_chosen(x[:m], qdata, 128, 128, 128) == (low <= m <= high), m
    assert asked and all(args[1] is qdata and args[2:] == (128, 128, 128) for args in asked)
    launches = stub_kernel(monkeypatch, gluon, "_fp8_kernel")
    stub_sm_count(monkeypatch, gluon)
    load_gpu_ops()
    out = torch.ops.qshard.fp8_blockwise_linear(
        x[:24].reshape(2, 12, 512), qdata, scale, None, 128, 128, 128, False, "auto"
    )
    assert out.shape == (2, 12, 256) and len(launches) == 1 and launches[0].args["M"] == 24
    monkeypatch.setattr(gluon, "problem", lambda *args: "not on this GPU")
    assert not any(gluon_chosen(x[:m], qdata, 128, 128, 128) for m in (low, 16, high))


def emulated_blockwise_scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, *args, **kwargs):
    """`F.scaled_mm` with 1x128 activation and 128x128 weight scales, which torch runs on CUDA
    only: the argument checks torch makes there (aten ScaledBlas.cpp: scale_a [M, K/128] of
    strides (1, M); scale_b.t() [N/128, K/128] of strides (K/128 rounded up to 4, 1)),
    cuBLASLt's fp8 operand layouts (a row-major, b column-major, M, N, K multiples of 16), then
    each 128-column group's fp8 products in float64, times both scales."""
    assert not args and set(kwargs) <= {"output_dtype"}, (args, kwargs)
    assert (recipe_a, recipe_b) == (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)
    (m, k), n = a.shape, b.shape[1]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and b.shape[0] == k
    assert a.stride(1) == 1 and b.stride(0) == 1, "cuBLASLt fp8: a row-major, b column-major"
    assert m % 16 == 0 and n % 16 == 0 and k % 16 == 0, f"M, N, K = {m}, {n}, {k}: not x16"
    groups, row_blocks = triton.cdiv(k, 128), triton.cdiv(n, 128)
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert scale_a.shape == (m, groups) and scale_a.stride() == (1, m), "scale_a's layout"
    weight_scale = scale_b.t()
    assert weight_scale.shape == (row_blocks, groups), "scale_b's shape"
    assert weight_scale.stride() == (-(-groups // 4) * 4, 1), "scale_b's layout"
    a64, b64 = fp8_ref.e4m3_to_float64(a), fp8_ref.e4m3_to_float64(b)
    out = torch.zeros(m, n, dtype=torch.float64)
    for g in range(groups):
        cols = slice(128 * g, 128 * g + 128)
        sums = a64[:, cols] @ b64[cols, :]
        out += sums * scale_a[:, g, None].double() * scale_b[g].double().repeat_interleave(128)[:n]
    return out.to(kwargs.get("output_dtype", torch.bfloat16))


@on_the_cpu
@pytest.mark.parametrize(("m", "with_bias"), [(1, True), (24, False), (80, True)])
def test_cublas_blockwise_call_matches_the_reference(monkeypatch, m, with_bias):
    """`fp8/cublas.py` (through the op's "cublas" backend): M padded to cuBLAS's multiple of
    16 and cut back, the weight and its scales transposed into the layout scaled_mm checks, the
    activation scales group-major, the bias added in the output dtype."""
    monkeypatch.setattr(F, "scaled_mm", emulated_blockwise_scaled_mm)
    n, k = 256, 512
    qdata, scale = fp8_ref.quantize_weight_blockwise(
        torch.randn(n, k) * 0.02, (128, 128), ScaleFormat.FP32
    )
    x = torch.randn(m, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    load_gpu_ops()
    out = torch.ops.qshard.fp8_blockwise_linear(
        x.reshape(1, m, k), qdata, scale, bias, 128, 128, 128, False, "cublas"
    )
    expected = fp8_ref.fp8_blockwise_linear_reference(
        x,
        qdata,
        scale,
        block_size=(128, 128),
        act_group_size=128,
        scale_format=ScaleFormat.FP32,
        weight_only=False,
        bias=bias,
    )
    assert out.shape == (1, m, n) and out.dtype == torch.bfloat16
    assert relative_error(out[0], expected) < 1e-2


# ---- cuBLAS row-wise ---------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False])
def test_cublas_rowwise_call_matches_the_reference(monkeypatch, with_bias):
    """`fp8_rowwise_linear_cublas`: torch's `_scaled_mm` runs it (cuBLAS on a GPU; on the CPU
    torch's own, which takes row-wise scales from torch 2.13); what reaches it must also be what
    the CUDA one takes (a row-major, b column-major, fp32 scales [M, 1] and [1, N] contiguous, a
    bias of the output dtype) and the result the reference's."""
    from qshard.kernels import fp8_rowwise

    scaled_mm, calls = torch._scaled_mm, []

    def checked_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype=None):
        m, n = a.shape[0], b.shape[1]
        assert a.stride(1) == 1 and b.stride(0) == 1, "cuBLASLt fp8: a row-major, b column-major"
        assert scale_a.shape == (m, 1) and scale_b.shape == (1, n), "row-wise scale shapes"
        assert scale_a.is_contiguous() and scale_b.is_contiguous(), "row-wise scale layout"
        assert scale_a.dtype == scale_b.dtype == torch.float32, "row-wise scale dtypes"
        assert bias is None or (bias.dtype == out_dtype and bias.shape == (n,)), "the bias"
        calls.append(m)
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", checked_scaled_mm)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = torch.randn(96, 160, device=device) * 0.02
    scale = fp8_rowwise.row_scales(weight)
    qdata = fp8_rowwise.quantize_rows(weight, scale)
    x = torch.randn(2, 3, 160, dtype=torch.bfloat16, device=device)
    bias = torch.randn(96, dtype=torch.bfloat16, device=device) if with_bias else None
    out = fp8_rowwise.fp8_rowwise_linear_cublas(x, qdata, scale, bias)
    expected = fp8_rowwise.fp8_rowwise_linear_reference(
        x, qdata, scale, weight_only=False, bias=bias
    )
    assert calls == [6] and out.shape == (2, 3, 96) and out.dtype == torch.bfloat16
    assert relative_error(out, expected) < 1e-2


# ---- the int4 register kernel and its warp-specialized variant ---------------------------------

# (format, activation dtype, M, N, K, bias): the two token tiles the op runs it at (up to
# w4a16/select.py's REGISTER_CHOICE_MAX_M = 12 tokens; 8 warps, capped registers, 2 programs per
# SM): int4 with K in 2 splits, NVFP4 unsplit with a partial row tile
REGISTER_CASES = [
    (0, torch.bfloat16, 5, 256, 2048, True),
    (4, torch.float16, 12, 200, 1024, False),
]
# (format, activation dtype, M, N, K, SMs): int4 (2 programs per SM) split into one chunk per
# item; MXFP4 on a 16-SM GPU, 8 chunks per item in 2 splits
WS_CASES = [(1, torch.bfloat16, 12, 256, 1024, H100_SMS), (3, torch.float16, 8, 512, 2048, 16)]


def four_bit_weight(fmt: int, n: int, k: int, dtype: torch.dtype):
    """(qdata, scale, zero, global_scale, group) of a fresh weight in format `fmt` (an empty
    zero where the format has none; the launchers take any tensor there)."""
    weight = (torch.randn(n, k) * 0.02).to(dtype)
    if fmt in (0, 1):
        config = qshard.Int4WeightOnlyConfig(group_size=128, symmetric=fmt == 1)
        q = qshard.Int4Tensor.from_float(weight, config)
        return q.qdata, q.scale, q.zero, None, 128
    if fmt == 3:
        q = qshard.Mxfp4Tensor.from_float(weight, qshard.MXFP4WeightOnlyConfig())
        return q.qdata, q.scale, q.qdata, None, 32
    q = qshard.Nvfp4Tensor.from_float(weight, qshard.NVFP4WeightOnlyConfig())
    return q.qdata, q.scale, q.qdata, q.global_scale, 16


def assert_four_bit_arguments(a, fmt, x, qdata, scale, zero, global_scale, bias, out, group):
    """The parameters both register kernels share, against what they read: e8m0 / e4m3 scale
    bytes for MXFP4 / NVFP4 with the scale's row stride, NVFP4's global scale in the zero's
    place, the format and group constexprs."""
    m, k = x.shape
    scale_bytes = scale.view(torch.uint8) if fmt >= 3 else scale
    assert a["s_ptr"].dtype == scale_bytes.dtype and a["s_ptr"].data_ptr() == scale.data_ptr()
    assert a["stride_sn"] == scale.stride(0) and scale.shape[1] * group == k
    assert a["z_ptr"] is (global_scale if fmt == 4 else zero)
    assert a["bias_ptr"] is (bias if bias is not None else out) and a["out_ptr"] is out
    assert (a["M"], a["N"], a["K"]) == (m, qdata.shape[0], k)
    assert (a["FORMAT"], a["GROUP"], a["HAS_BIAS"]) == (fmt, group, bias is not None)


def record_register_launch(monkeypatch, fmt, dtype, m, n, k, with_bias):
    from qshard.kernels.w4a16 import register

    launches = stub_kernel(monkeypatch, register, "_register_kernel")
    stub_sm_count(monkeypatch, register)
    qdata, scale, zero, global_scale, group = four_bit_weight(fmt, n, k, dtype)
    x = torch.randn(m, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    out = torch.empty(m, n, dtype=dtype)
    register.launch(fmt, x, qdata, scale, zero, bias, out, group, None, global_scale)
    assert len(launches) == 1
    return launches[0], (x, qdata, scale, zero, global_scale, bias, out, group)


@on_the_cpu
@with_gluon
@pytest.mark.parametrize(("fmt", "dtype", "m", "n", "k", "with_bias"), REGISTER_CASES)
def test_register_launch_passes_what_the_kernel_reads(monkeypatch, fmt, dtype, m, n, k, with_bias):
    """`_register_kernel`'s parameters: the codes as int32 words (4 * KW4 of them per row, the
    kernel's row stride), split_k's workspace for its splits of STEPS chunks, and the config
    `register.config` gives (tile, ring, warps, register cap) in the constexprs, options and
    persistent grid."""
    from qshard.kernels.w4a16.register import config as register_config

    launch, (x, qdata, scale, zero, global_scale, bias, out, group) = record_register_launch(
        monkeypatch, fmt, dtype, m, n, k, with_bias
    )
    config = register_config(m, n, k, CPU)
    a = launch.args
    assert_four_bit_arguments(a, fmt, x, qdata, scale, zero, global_scale, bias, out, group)
    assert a["x_ptr"] is x
    codes = a["q_ptr"]
    assert codes.dtype == torch.int32 and codes.data_ptr() == qdata.data_ptr()
    assert codes.shape == (n, k // 8) and codes.stride(0) == 4 * a["KW4"], "q_ptr, KW4"
    tiles, steps = triton.cdiv(n, 16 * config["WARPS"]), config["STEPS"]
    splits = a["splits"]
    assert (splits - 1) * steps * 128 < k <= splits * steps * 128, "every split has chunks"
    assert (a["SPLIT"], a["STEPS"], a["STAGES"], a["BLOCK_M"]) == (
        splits > 1,
        steps,
        config["STAGES"],
        config["BLOCK_M"],
    )
    if splits > 1:
        assert_split_k_workspace(a["part_ptr"], a["cnt_ptr"], m, n, splits, tiles)
    assert launch.grid == (min(tiles * splits, config["PER_SM"] * H100_SMS),)
    cap = {"maxnreg": config["MAXNREG"]} if config["MAXNREG"] else {}
    assert launch.options == {"num_warps": config["WARPS"], **cap}


def record_ws_launch(monkeypatch, fmt, dtype, m, n, k, sms):
    from qshard.kernels.w4a16 import register_ws

    launches = stub_kernel(monkeypatch, register_ws, "_ws_kernel")
    asked = stub_sm_count(monkeypatch, register_ws, sms)
    qdata, scale, zero, global_scale, group = four_bit_weight(fmt, n, k, dtype)
    x = torch.randn(m, k, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)
    register_ws.launch(fmt, x, qdata, scale, zero, None, out, group, None, global_scale)
    assert len(launches) == 1 and set(asked) == {0}
    return launches[0], (x, qdata, scale, zero, global_scale, None, out, group)


@on_the_cpu
@with_gluon
@pytest.mark.parametrize(("fmt", "dtype", "m", "n", "k", "sms"), WS_CASES)
def test_ws_launch_passes_what_the_kernel_reads(monkeypatch, fmt, dtype, m, n, k, sms):
    """`_ws_kernel`'s parameters: the codes' TMA box (a tile's rows by a chunk's 16 words), the
    5-D view of x whose box lands the module docstring's permutation (x_slot[j][token][8t + e]
    = x[token, 128 chunk + 32t + 8j + e], the same as the cp.async kernel's `_copy_x`), split_k's
    workspace, and `register_ws.config`'s tile, ring and register cap."""
    from qshard.kernels.w4a16.register_ws import config as ws_config

    launch, (x, qdata, scale, zero, global_scale, bias, out, group) = record_ws_launch(
        monkeypatch, fmt, dtype, m, n, k, sms
    )
    config = ws_config(m, n, k, CPU, fmt, sms=sms)
    a = launch.args
    assert_four_bit_arguments(a, fmt, x, qdata, scale, zero, global_scale, bias, out, group)
    tile_rows = 16 * config["WARPS"]
    q_desc, x_desc = a["q_desc"], a["x_desc"]
    assert q_desc.base.dtype == torch.int32 and q_desc.base.data_ptr() == qdata.data_ptr()
    assert list(q_desc.shape) == [n, k // 8] and q_desc.block_shape == [tile_rows, 16]
    view = x_desc.base
    assert view.data_ptr() == x.data_ptr() and x_desc.block_shape == [1, 4, config["BLOCK_M"], 4, 8]
    chunk, j, token, t, e = torch.meshgrid(*(torch.arange(s) for s in view.shape), indexing="ij")
    assert torch.equal(view, x[token, 128 * chunk + 32 * t + 8 * j + e]), "x's 5-D view"
    splits, steps = a["splits"], config["STEPS"]
    assert splits * steps * 128 >= k > (splits - 1) * steps * 128
    assert (a["SPLIT"], a["STEPS"], a["STAGES"], a["BLOCK_M"]) == (
        splits > 1,
        steps,
        config["STAGES"],
        config["BLOCK_M"],
    )
    if splits > 1:
        tiles = triton.cdiv(n, tile_rows)
        assert_split_k_workspace(a["part_ptr"], a["cnt_ptr"], m, n, splits, tiles)
    assert launch.grid == (min(triton.cdiv(n, tile_rows) * splits, config["PER_SM"] * sms),)
    cap = {"maxnreg": config["MAXNREG"]} if config["MAXNREG"] else {}
    assert launch.options == {"num_warps": config["WARPS"], **cap}


@on_the_cpu
@with_gluon
def test_register_launches_compile_for_sm90_and_fit_the_sm(monkeypatch):
    """Both register kernels compiled from the launches above: their argument types and
    constexprs build, and the shared memory of their rings (and the register cap) fits PER_SM
    programs on a Hopper SM, as their configs plan."""
    from qshard.kernels.w4a16.register import config as register_config
    from qshard.kernels.w4a16.register_ws import config as ws_config

    specs, configs = [], []
    for fmt, dtype, m, n, k, with_bias in REGISTER_CASES:
        with monkeypatch.context() as patch:
            launch, _ = record_register_launch(patch, fmt, dtype, m, n, k, with_bias)
        specs.append(compile_spec(launch, "qshard.kernels.w4a16.register", "_register_kernel"))
        configs.append(register_config(m, n, k, CPU))
    for fmt, dtype, m, n, k, sms in WS_CASES:
        with monkeypatch.context() as patch:
            launch, _ = record_ws_launch(patch, fmt, dtype, m, n, k, sms)
        specs.append(compile_spec(launch, "qshard.kernels.w4a16.register_ws", "_ws_kernel"))
        configs.append(ws_config(m, n, k, CPU, fmt, sms=sms))
    compiled = compile_launches_for_sm90(specs)
    assert len(compiled) == len(specs)
    for config, metadata in zip(configs, compiled, strict=True):
        assert_fits_the_sm(metadata["shared"], config["PER_SM"])
        if config["MAXNREG"]:
            threads = 32 * metadata["num_warps"]
            assert config["PER_SM"] * threads * config["MAXNREG"] <= REGISTERS_PER_SM


def linear_layout_map(layout, shape):
    """Each hardware index (register, lane, warp) of a DistributedLinearLayout -> its tensor
    coordinate: the XOR of the bases of its set bits."""
    bases = [layout.reg_bases, layout.lane_bases, layout.warp_bases]
    coords = []
    for reg in range(1 << len(bases[0])):
        for lane in range(1 << len(bases[1])):
            for warp in range(1 << len(bases[2])):
                at = [0] * len(shape)
                for index, group in zip((reg, lane, warp), bases, strict=True):
                    for bit, base in enumerate(group):
                        if index >> bit & 1:
                            at = [c ^ b for c, b in zip(at, base, strict=True)]
                coords.append(tuple(at))
    return coords


@with_gluon
@pytest.mark.parametrize("warps", [4, 8])
def test_the_register_layouts_cover_each_element_as_documented(warps):
    """The layouts the register kernels load their slots with (compile-time host functions):
    `_codes_layout` gives each element of a chunk's [16 warps, 4, 4] code words to exactly one
    thread register, and `_codes_2d` (the warp-specialized kernel's [rows, 16 words] view) the
    same word to the same thread (word 4t + j); `_x_layout` gives each of x's [BLOCK_M, 32]
    columns to one register of every warp, and `_x_5d` the same to the same (8t + e). The
    kernels' trivial layout conversions between them hold only so."""
    from qshard.kernels.w4a16.register_parts import codes_2d as _codes_2d
    from qshard.kernels.w4a16.register_parts import codes_layout as _codes_layout
    from qshard.kernels.w4a16.register_parts import x_layout as _x_layout
    from qshard.kernels.w4a16.register_ws import _x_5d

    codes = linear_layout_map(_codes_layout(warps), [16 * warps, 4, 4])
    assert sorted(codes) == [
        (r, t, j) for r in range(16 * warps) for t in range(4) for j in range(4)
    ]
    assert linear_layout_map(_codes_2d(warps), [16 * warps, 16]) == [
        (r, 4 * t + j) for r, t, j in codes
    ]
    for block_m in (8, 16, 128):
        x = linear_layout_map(_x_layout(block_m, warps), [block_m, 32])
        per_warp = len(x) // warps
        assert all(x[w::warps] == x[0::warps] for w in range(warps)), "every warp holds all"
        assert sorted(x[0::warps]) == [(n, c) for n in range(block_m) for c in range(32)]
        assert per_warp == block_m * 32
        x5 = linear_layout_map(_x_5d(block_m, warps), [1, 1, block_m, 4, 8])
        assert x5 == [(0, 0, n, c // 8, c % 8) for n, c in x]


# ---- gemlite (a stand-in with gemlite 0.6's API) -----------------------------------------------


class FakeGemliteLinear:
    def __init__(self, codes, scales, zeros, group):
        self.codes, self.scales, self.zeros, self.group = codes, scales, zeros, group

    def get_tensor_args(self):
        # gemlite keeps W_q transposed ([K, N] packed): forward_functional reads N as shape[1]
        return [self.codes.t(), self.scales, self.zeros, torch.tensor(1.0)]

    def get_meta_args(self):
        return [0, 4, self.group, 15, 8, 1, 1, 0, 1, 0, 2, 1]  # 12 ints, as gemlite's


class FakeA16Wn:
    """gemlite.helper.A16Wn's signatures (gemlite 0.6), and what its INT path takes: W_q uint8
    [N, K] codes, scales and zeros of the given dtype, one per row and group."""

    made = []

    def __init__(self, device="cuda:0", dtype=None, packing_bitwidth=None, post_scale=False):
        self.device, self.dtype = device, dtype

    def from_weights(self, W_q, scales, zeros, W_nbits, group_size, bias=None, quant_type="INT"):
        assert quant_type == "INT" and W_nbits == 4 and bias is None
        n, k = W_q.shape
        assert W_q.dtype == torch.uint8 and W_q.is_contiguous() and int(W_q.max()) <= 15
        assert k % group_size == 0
        assert scales.shape == zeros.shape == (n, k // group_size)
        assert scales.dtype == zeros.dtype == self.dtype
        FakeA16Wn.made.append((W_q, scales, zeros, group_size))
        return FakeGemliteLinear(W_q, scales, zeros, group_size)


def fake_forward_functional(x, bias, tensor_args, meta_args, matmul_type=-1):
    """gemlite's op's signature; x @ ((W_q - zeros) * scales).T + bias, per group."""
    codes_t, scales, zeros, _meta_scale = tensor_args
    assert len(meta_args) == 12 and x.shape[1] == codes_t.shape[0] and x.dim() == 2
    group = meta_args[2]

    def per_column(t):
        return t.float().repeat_interleave(group, dim=1)

    weight = ((codes_t.t().float() - per_column(zeros)) * per_column(scales)).to(x.dtype)
    out = x.double() @ weight.double().t()
    return (out + bias.double() if bias is not None else out).to(x.dtype)


@pytest.fixture
def fake_gemlite(monkeypatch, tmp_path):
    """A `gemlite` module (its import on a machine without a GPU raises) with a config folder
    holding the H100's config only, the op `torch.ops.gemlite.forward_functional`, and its
    `load_config` calls recorded."""
    from qshard.kernels import int4_gemlite

    module = types.ModuleType("gemlite")
    module.__spec__ = importlib.machinery.ModuleSpec("gemlite", None)
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "h100.json").write_text("{}")
    module.__file__ = str(tmp_path / "__init__.py")
    loaded = []
    module.core = types.SimpleNamespace(
        GemLiteLinear=types.SimpleNamespace(load_config=loaded.append)
    )
    module.helper = types.SimpleNamespace(A16Wn=FakeA16Wn)
    monkeypatch.setitem(sys.modules, "gemlite", module)
    ops = types.SimpleNamespace(forward_functional=fake_forward_functional)
    monkeypatch.setattr(torch.ops, "gemlite", ops, raising=False)
    FakeA16Wn.made.clear()
    int4_gemlite._load_gemlite.cache_clear()
    yield types.SimpleNamespace(loaded=loaded, configs=tmp_path / "configs")
    int4_gemlite._load_gemlite.cache_clear()


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_gemlite_on_an_h200_loads_the_h100_config(fake_gemlite, monkeypatch, gpu):
    """gemlite ships no H200 config and would autotune for minutes per shape: the H100's is
    loaded there, and nothing elsewhere."""
    from qshard.kernels.int4_gemlite import _load_gemlite

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(name=gpu)
    )
    assert _load_gemlite() is sys.modules["gemlite"]
    h100 = str(fake_gemlite.configs / "h100.json")
    assert fake_gemlite.loaded == ([h100] if "H200" in gpu else [])


@pytest.mark.parametrize("symmetric", [False, True], ids=["asymmetric", "symmetric"])
def test_gemlite_form_and_call_multiply_the_canonical_weight(fake_gemlite, monkeypatch, symmetric):
    """`gemlite_form` hands gemlite the codes, scales and zeros of the canonical weight (the
    symmetric zero point 8 written out, a partial last group padded with the zero point's code:
    zero weights) in the form's dtype; `gemlite_linear` pads x's K to match and calls its op:
    the reference's result."""
    from qshard.kernels.int4 import int4_linear_reference
    from qshard.kernels.int4_gemlite import gemlite_form, gemlite_linear

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(name="NVIDIA H100")
    )
    n, k, group, dtype = 48, 200, 64, torch.float16
    config = qshard.Int4WeightOnlyConfig(group_size=group, symmetric=symmetric)
    q = qshard.Int4Tensor.from_float((torch.randn(n, k) * 0.02).to(dtype), config)
    tensors, meta = gemlite_form(q.qdata, q.scale, q.zero, group, k, dtype)
    ((codes, scales, zeros, group_size),) = FakeA16Wn.made
    assert meta[:3] == (k, 256, n) and len(meta) == 3 + 12 and group_size == group
    zero_codes = zeros[:, -1:].to(torch.uint8).expand(-1, 256 - k)
    assert torch.equal(codes[:, k:], zero_codes), "padding columns weigh zero"
    assert torch.equal(scales, q.scale) and scales.dtype == dtype
    assert not symmetric or torch.equal(zeros, torch.full_like(zeros, 8))
    assert set(tensors) == {"gemlite_w", "gemlite_scales", "gemlite_zeros", "gemlite_meta_scale"}
    x = torch.randn(2, 3, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype)
    out = gemlite_linear(x, tensors, meta, bias)
    expected = int4_linear_reference(x, q.qdata, q.scale, q.zero, group, bias)
    assert out.shape == (2, 3, n) and relative_error(out, expected) < 2e-3


def test_gemlite_problems_on_a_cuda_device(monkeypatch, fake_gemlite):
    """What the layout reports before it packs for gemlite on a GPU: not installed, a weight
    dtype gemlite does not take, activations of another dtype than the form's."""
    from qshard.kernels.int4_gemlite import gemlite_problem

    cuda = torch.device("cuda")
    assert gemlite_problem(cuda, torch.bfloat16, None) is None
    assert gemlite_problem(cuda, torch.float16, torch.float16) is None
    assert "float16 or bfloat16" in gemlite_problem(cuda, torch.float32, None)
    assert "cast the input" in gemlite_problem(cuda, torch.bfloat16, torch.float16)
    monkeypatch.setitem(sys.modules, "gemlite", None)  # as if not installed
    assert "not installed" in gemlite_problem(cuda, torch.bfloat16, None)


# ---- the grouped ops' fake implementations ----------------------------------------------------

GROUPED_COUNTS = [3, 0, 4]  # an expert with no tokens, and 2 rows past offs[-1]


def grouped_inputs(dtype=torch.float16):
    offs = torch.tensor(GROUPED_COUNTS).cumsum(0).to(torch.int32)
    x = torch.randn(sum(GROUPED_COUNTS) + 2, 192, dtype=dtype)
    return x, offs, torch.randn(3, 80, 192) * 0.02


@on_the_cpu
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_fp8_grouped_op_has_a_consistent_fake(with_bias):
    """The fake of `qshard::fp8_blockwise_grouped_linear` (what torch.compile traces) against
    the op: shapes, dtypes and strides, under dynamic shapes too. (Not test_schema: it compares
    the fp8 inputs with an op the CPU lacks for fp8, as the 2-D op's test notes.)"""
    load_grouped_ops()
    x, offs, weight = grouped_inputs()
    q = qshard.Fp8BlockwiseTensor.from_float(
        weight.half(), qshard.Fp8BlockwiseConfig(block_size=(64, 64))
    )
    bias = torch.randn(3, 80, dtype=x.dtype) if with_bias else None
    torch.library.opcheck(
        torch.ops.qshard.fp8_blockwise_grouped_linear.default,
        (x, offs, q.qdata, q.scale, bias, 64, 64, 64, False),
        test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"),
    )


@on_the_cpu
@pytest.mark.parametrize("fmt", ["int4_asym", "int4_sym", "mxfp4", "nvfp4"])
def test_the_w4a16_grouped_op_has_a_consistent_fake(fmt):
    """The fake of `qshard::w4a16_grouped_linear` against the op for every format (the empty
    zero and global scale of the formats without them, as the layouts pass them), dynamic
    shapes included; test_schema too where no input is an fp8 tensor (MXFP4's and NVFP4's
    scales are, as the FP8 op's weight)."""
    load_grouped_ops()
    x, offs, weight = grouped_inputs()
    weight = weight.half()
    empty = torch.empty(0, dtype=torch.uint8)
    if fmt.startswith("int4"):
        config = qshard.Int4WeightOnlyConfig(group_size=64, symmetric=fmt == "int4_sym")
        q = qshard.Int4Tensor.from_float(weight, config)
        zero, global_scale, group = q.zero, empty, 64
    elif fmt == "mxfp4":
        q = qshard.Mxfp4Tensor.from_float(weight, qshard.MXFP4WeightOnlyConfig())
        zero, global_scale, group = empty, empty, 32
    else:
        q = qshard.Nvfp4Tensor.from_float(weight, qshard.NVFP4WeightOnlyConfig())
        zero, global_scale, group = empty, q.global_scale, 16
    bias = torch.randn(3, 80, dtype=x.dtype) if fmt == "int4_asym" else None
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(
        torch.ops.qshard.w4a16_grouped_linear.default,
        (x, offs, q.qdata, q.scale, zero, global_scale, bias, fmt, group, 192),
        test_utils=checks if q.scale.element_size() == 1 else ("test_schema", *checks),
    )
