"""The Gluon FP8 blockwise kernel (kernels/fp8/gluon.py). On the CPU: it compiles for
sm_90 (no GPU needed; catches a Gluon API break in CI), its config and split choice, and where
it cannot run, the reason. On a Hopper GPU: against the reference on fresh random inputs, odd
shapes (partial row tiles, a partial last group), every activation dtype, both scale formats,
split and unsplit, the same bits on every run, TP-cut weights, and chosen by the op."""

from __future__ import annotations

import pytest
import torch
from helpers import compile_for_sm90, relative_error

import qshard
from qshard.kernels import fp8_blockwise as ref
from qshard.kernels.fp8.gluon import GLUON_IMPORT_ERROR, split_for
from qshard.kernels.fp8.gluon import problem as gluon_problem

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# as test_fp8_blockwise_triton.py: the tensor cores sum each group's fp8 products in another
# order (with ~14-bit accumulation inside a group on Hopper), the output rounded to its dtype
MAX_RELATIVE_ERROR = 1e-2

COMPILE_FOR_SM90 = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from qshard.kernels.fp8.gluon import _fp8_kernel, TensorDescriptor
names = list(_fp8_kernel.arg_names)
for block_t, stages, split, dtype in ((16, 10, True, "bf16"), (32, 8, False, "fp16"),
                                      (64, 6, True, "fp32"), (128, 6, True, "bf16")):
    descs = [TensorDescriptor.from_tensor(
        torch.empty(rows, 256, dtype=torch.float8_e4m3fn), [rows, 128],
        gl.NVMMASharedLayout.get_default_for([rows, 128], gl.float8e4nv)) for rows in (64, block_t)]
    types = [mangle_type(d) for d in descs] + ["*fp32", "*fp32", f"*{dtype}", f"*{dtype}",
                                               "*fp32", "*i32"] + ["i32"] * 7
    source = GluonASTSource(
        fn=_fp8_kernel, signature=dict(zip(names, types + ["constexpr"] * 4)),
        constexprs={"BLOCK_T": block_t, "STAGES": stages, "HAS_BIAS": True, "SPLIT": split},
        attrs={(i,): [["tt.divisibility", 16]] for i in range(2, 8)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    assert f"wgmma.mma_async.sync.aligned.m64n{block_t}k32.f32.e4m3.e4m3" in ptx, block_t
    assert "cp.async.bulk.tensor.2d" in ptx and "setmaxnreg" in ptx  # TMA, specialized warps
"""


@pytest.mark.skipif(HOPPER, reason="compiles for sm_90 without a GPU: done on the CPU")
def test_compiles_for_sm90():
    """Each token tile, activation dtype, split and unsplit: Gluon's API moves between Triton
    versions (the TMA copy was renamed between 3.6 and 3.9), and this is where CI sees it. With
    no Gluon at all the op must say why and run the Triton kernels instead."""
    if GLUON_IMPORT_ERROR is not None:
        x = torch.zeros(16, 128, dtype=torch.bfloat16)
        assert "Gluon is not available" in gluon_problem(x, x, 128, 128, 128)
        return
    compile_for_sm90(COMPILE_FOR_SM90)


@pytest.mark.skipif(HOPPER, reason="the CPU's reasons")
def test_where_it_cannot_run_it_says_why():
    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    reason = gluon_problem(x, x, 128, 128, 128)
    assert reason is not None and ("Hopper" in reason or "Gluon is not available" in reason)


@pytest.mark.parametrize(
    ("tiles", "groups", "programs", "block_t"),
    [
        (224, 32, 132, 16),
        (32, 32, 132, 16),
        (48, 32, 132, 128),
        (32, 112, 132, 64),
        (1, 2, 132, 16),
        (7, 1, 132, 16),
    ],
)
def test_the_split_count_keeps_groups_in_every_split(tiles, groups, programs, block_t):
    """Every split has groups (>= 2 where there are 2), and a layer too small to fill the GPU
    is split: the o_proj-sized layer (32 tiles on 132 SMs) is not left on 32 programs."""
    splits = split_for(tiles, groups, programs, block_t)
    per_split = -(-groups // splits)
    assert 1 <= splits <= max(1, groups // 2)
    assert per_split * (splits - 1) < groups  # the last split is not empty
    if tiles * 2 <= programs and groups >= 8:
        assert splits > 1


gpu = pytest.mark.skipif(not HOPPER, reason="the Gluon FP8 kernel runs on Hopper (sm_90)")


def _weight(n: int, k: int, ue8m0: bool):
    w = torch.randn(n, k, device="cuda") * 0.02
    fmt = qshard.ScaleFormat.UE8M0 if ue8m0 else qshard.ScaleFormat.FP32
    return ref.quantize_weight_blockwise(w, (128, 128), fmt)


def _expected(x, qdata, scale, bias, ue8m0):
    fmt = qshard.ScaleFormat.UE8M0 if ue8m0 else qshard.ScaleFormat.FP32
    return ref.fp8_blockwise_linear_reference(
        x,
        qdata,
        scale,
        block_size=(128, 128),
        act_group_size=128,
        scale_format=fmt,
        weight_only=False,
        bias=bias,
    )


@gpu
@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 33, 64, 100, 128])
@pytest.mark.parametrize(("n", "k"), [(256, 512), (200, 400), (4096, 1040), (130, 128)])
def test_matches_the_reference(m, n, k):
    """Partial row tiles (N = 200, 130), a partial last group (K = 400, 1040), one group (K =
    128), each token tile; bf16 with a bias, the default config (split where it splits)."""
    from qshard.kernels.fp8.gluon import launch as gluon_launch

    qdata, scale = _weight(n, k, False)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    out = gluon_launch(x, qdata, scale, bias, False)
    assert relative_error(out, _expected(x, qdata, scale, bias, False)) < MAX_RELATIVE_ERROR


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("ue8m0", [False, True], ids=["fp32-scales", "ue8m0"])
@pytest.mark.parametrize("splits", [1, 3])
def test_every_dtype_scale_format_and_split(dtype, ue8m0, splits):
    from qshard.kernels.fp8.gluon import config as gluon_config
    from qshard.kernels.fp8.gluon import launch as gluon_launch

    m, n, k = 24, 384, 896
    qdata, scale = _weight(n, k, ue8m0)
    x = torch.randn(m, k, device="cuda", dtype=dtype) * 3
    config = {**gluon_config(m, n, k, x.device), "SPLITS": splits}
    out = gluon_launch(x, qdata, scale, None, ue8m0, config)
    assert out.dtype == dtype
    assert relative_error(out, _expected(x, qdata, scale, None, ue8m0)) < MAX_RELATIVE_ERROR


@gpu
def test_split_k_gives_the_same_bits_on_every_run():
    from qshard.kernels.fp8.gluon import config as gluon_config
    from qshard.kernels.fp8.gluon import launch as gluon_launch

    m, n, k = 16, 1024, 4096
    qdata, scale = _weight(n, k, False)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    config = {**gluon_config(m, n, k, x.device), "SPLITS": 8}
    first = gluon_launch(x, qdata, scale, None, False, config)
    for _ in range(20):
        assert torch.equal(gluon_launch(x, qdata, scale, None, False, config), first)


@gpu
def test_a_column_parallel_shard_matches_the_whole_weight():
    """A TP shard (rows 256..767 of the weight, its scale rows) computes those outputs."""
    from qshard.kernels.fp8.gluon import launch as gluon_launch

    qdata, scale = _weight(1024, 2048, False)
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    whole = gluon_launch(x, qdata, scale, None, False)
    shard = gluon_launch(x, qdata[256:768].contiguous(), scale[2:6].contiguous(), None, False)
    torch.testing.assert_close(shard, whole[:, 256:768], atol=2e-2, rtol=2e-2)


@gpu
def test_auto_runs_it_and_compiles_once():
    """The op chooses the kernel in its token range (and the layout runs the op), compiled
    with a dynamic batch, equal to eager."""
    from qshard.kernels.fp8.select import GLUON_CHOICE_M, choose

    def gluon_chosen(x, qdata, block_n, block_k, group):
        return choose(x, qdata, block_n, block_k, group).kernel == "gluon"

    lin = torch.nn.Linear(512, 384, bias=True, device="cuda", dtype=torch.bfloat16)
    qshard.quantize_(lin, qshard.Fp8BlockwiseConfig())
    low, high = GLUON_CHOICE_M
    x = torch.randn(high, 512, device="cuda", dtype=torch.bfloat16)
    assert gluon_chosen(x, lin.weight.qdata, 128, 128, 128)
    assert not gluon_chosen(x[: low - 1], lin.weight.qdata, 128, 128, 128) or low == 1
    compiled = torch.compile(lin, fullgraph=True, dynamic=True)
    for m in (low, 16, high):
        expected = _expected(x[:m], lin.weight.qdata, lin.weight.scale, lin.bias, False)
        assert relative_error(lin(x[:m]), expected) < MAX_RELATIVE_ERROR
        torch.testing.assert_close(compiled(x[:m]), lin(x[:m]), atol=0, rtol=0)


@gpu
def test_cuda_graphs_of_torch_compile_run_it_with_split_k():
    """mode="reduce-overhead" (CUDA graph trees) at tokens where the kernel splits K: the
    split-K counters must not be a tensor kept from the graph's pool, where the warm-up and the
    capture allocate (they were: "Detected 1 tensor(s) in the cudagraph pool not tracked as
    outputs", Llama decode at batch 32; this test failed so on the H100 before the fix)."""
    from qshard.kernels.fp8.gluon import config as gluon_config

    lin = torch.nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    qshard.quantize_(lin, qshard.Fp8BlockwiseConfig())
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    assert gluon_config(32, 1024, 4096, x.device)["SPLITS"] > 1
    eager = lin(x)
    graphed = torch.compile(lin, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, capture, replay
        torch.testing.assert_close(graphed(x.clone()), eager, atol=0, rtol=0)
