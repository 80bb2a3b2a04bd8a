"""The warp-specialized register kernel (kernels/w4a16/register_ws.py). On the CPU: it compiles for
sm_90 (no GPU needed; catches a Gluon API break in CI) with a proxy fence between every read of
a ring slot and the arrival that hands the slot back to the TMA producer, its config rule, its
refusals. On a Hopper GPU: against the reference on fresh random inputs, odd shapes, every
4-bit format, group and activation dtype; the same bits on every run with two programs per SM
(the race the fence closed); chosen by the op, TP-cut weights, compiled and graphed."""

from __future__ import annotations

import pytest
import torch
from helpers import compile_for_sm90, relative_error
from test_w4a16_gluon import (
    MAX_RELATIVE_ERROR,
    _fp4_weight,
    assert_compiled_and_graphed,
    assert_the_op_runs_fp4_on,
    assert_tp_cuts_run_on,
)

from qshard.kernels import int4
from qshard.kernels.gluon_api import GLUON_IMPORT_ERROR
from qshard.kernels.w4a16.register_ws import config as ws_config

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

COMPILE_FOR_SM90 = """
import sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from qshard.kernels.w4a16.register_ws import TensorDescriptor, _ws_kernel, gl
names = list(_ws_kernel.arg_names)
k = 1024
for fmt, dtype, block_m, split, steps in ((0, "bf16", 16, False, 8), (1, "fp16", 8, True, 3),
                                          (2, "bf16", 32, True, 4), (3, "bf16", 16, True, 5),
                                          (4, "fp16", 16, False, 8)):
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    codes = torch.empty(256, k // 8, dtype=torch.int32)
    x = torch.empty(block_m, k, dtype=tdtype).as_strided((k // 128, 4, block_m, 4, 8),
                                                          (128, 8, k, 32, 1))
    q_desc = TensorDescriptor.from_tensor(codes, [128, 16], gl.NVMMASharedLayout(0, 32, rank=2))
    x_desc = TensorDescriptor.from_tensor(x, [1, 4, block_m, 4, 8],
                                          gl.NVMMASharedLayout(0, 16, rank=5))
    s_type = "*u8" if fmt >= 3 else "*bf16"
    z_type = "*fp32" if fmt == 4 else s_type
    types = [mangle_type(q_desc), mangle_type(x_desc), s_type, z_type, f"*{dtype}", f"*{dtype}",
             "*fp32", "*i32"] + ["i32"] * 5 + ["constexpr"] * 7
    source = GluonASTSource(
        fn=_ws_kernel, signature=dict(zip(names, types)),
        constexprs={"FORMAT": fmt, "GROUP": {3: 32, 4: 16}.get(fmt, 128), "HAS_BIAS": True,
                    "SPLIT": split, "STEPS": steps, "STAGES": 4, "BLOCK_M": block_m},
        attrs={(i,): [["tt.divisibility", 16]] for i in (2, 3, 4, 5, 6, 7)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "maxnreg": 80})
    sys.stdout.write(f"=== {fmt} {dtype} {block_m} {split} {steps}\\n" + compiled.asm["ptx"])
"""


def _releases_without_fence(ptx: str) -> tuple[int, int]:
    """(slot releases, those with no `fence.proxy.async` since the last shared load): a
    release is an `mbarrier.arrive` with no transaction count and not on cp.async's
    completion (the producer's arrivals)."""
    releases = unfenced = 0
    loaded = fenced = False
    for line in ptx.splitlines():
        if "ld.shared" in line:
            loaded, fenced = True, False
        elif "fence.proxy.async" in line:
            fenced = True
        elif "mbarrier.arrive" in line and "expect_tx" not in line and "cp.async" not in line:
            releases += 1
            unfenced += loaded and not fenced
    return releases, unfenced


@pytest.mark.skipif(HOPPER, reason="compiles for sm_90 without a GPU: done on the CPU")
def test_compiles_for_sm90_with_a_fence_before_each_slot_release():
    """Every format, both activation dtypes, three token tiles, split and unsplit K. In each
    kernel the compute warps release a slot once per chunk (STEPS times, the loop unrolled) and
    each release follows a proxy fence: the TMA refill must not overtake the slot's reads."""
    if GLUON_IMPORT_ERROR is not None:
        from qshard.kernels.w4a16.register_ws import problem as ws_problem

        x = torch.zeros(16, 128, dtype=torch.bfloat16)
        assert "Gluon is not available" in ws_problem(0, x, x, 128)
        return
    kernels = compile_for_sm90(COMPILE_FOR_SM90).split("=== ")[1:]
    assert len(kernels) == 5
    for kernel in kernels:
        title, ptx = kernel.split("\n", 1)
        steps = int(title.split()[-1])
        assert "cp.async.bulk.tensor.5d" in ptx and "mma.sync" in ptx, title
        releases, unfenced = _releases_without_fence(ptx)
        assert releases == steps and unfenced == 0, (title, releases, unfenced)


def test_the_fence_check_sees_a_missing_fence():
    ptx = "ld.shared.v4.b32 {...}\nbar.sync 0, 256;\n@%p mbarrier.arrive.shared::cta.b64 _, [r];"
    assert _releases_without_fence(ptx) == (1, 1)
    fenced = ptx.replace("bar.sync", "fence.proxy.async.shared::cta;\nbar.sync")
    assert _releases_without_fence(fenced) == (1, 0)


# Llama-3.1-8B's linears (N, K) on an H100 (132 SMs): the best of the configs measured at 8 and
# 16 tokens (docs/kernels/w4a16_register.md, "The warp-specialized kernel
# (`w4a16/register_ws.py`)"): int4 in K splits, MXFP4 / NVFP4 in chunks per work item
LLAMA_BEST = {
    (6144, 4096): (2, 16),
    (4096, 4096): (4, 8),
    (28672, 4096): (1, 16),
    (4096, 14336): (4, 16),
}


@pytest.mark.parametrize("nk,best", LLAMA_BEST.items(), ids=str)
def test_config_gives_the_best_measured(nk, best):
    n, k = nk
    splits, fp4_steps = best
    for m in (8, 9, 16):
        config = ws_config(m, n, k, torch.device("cuda"), 0, sms=132)
        assert (config["PER_SM"], config["MAXNREG"]) == (2, 80)
        assert -(-(k // 128) // config["STEPS"]) == splits, config
        for fmt in (3, 4):
            config = ws_config(m, n, k, torch.device("cuda"), fmt, sms=132)
            assert (config["PER_SM"], config["MAXNREG"], config["STEPS"]) == (1, 0, fp4_steps)


@pytest.mark.parametrize("fmt", [0, 3])
@pytest.mark.parametrize("n", [64, 256, 1000, 6144, 28672])
@pytest.mark.parametrize("k", [128, 384, 2048, 7168, 18432])
def test_config_splits_are_balanced(n, k, fmt):
    """Each split holds STEPS chunks but the last, which holds at least one: no work item
    copies chunks past K only to multiply TMA's zero fill."""
    chunks = k // 128
    config = ws_config(12, n, k, torch.device("cuda"), fmt, sms=132)
    steps = config["STEPS"]
    splits = -(-chunks // steps)
    assert 1 <= steps <= (16 if fmt else 32) and (splits - 1) * steps < chunks <= splits * steps
    assert -(-chunks // (steps - 1 or 1)) > splits or steps == 1  # the fewest chunks per split


def test_a_config_it_cannot_run_is_refused():
    from qshard.kernels.w4a16.register_ws import launch as ws_launch

    x = torch.zeros(9, 256, dtype=torch.bfloat16)
    config = {"BLOCK_M": 8, "STEPS": 2, "PER_SM": 2}
    with pytest.raises(ValueError, match="BLOCK_M must be one of"):
        ws_launch(0, x, x, x, x, None, x, 128, config)


def test_it_runs_on_hopper_only_and_needs_whole_chunks():
    from qshard.kernels.w4a16.register_ws import problem as ws_problem

    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    assert ws_problem(0, x, x, 128) is not None  # a CPU tensor: the register kernels' rules


# ---- on a Hopper GPU ---------------------------------------------------------------------------

hopper = pytest.mark.skipif(not HOPPER, reason="the register kernel runs on Hopper (sm_90)")

# (format, group, N, K): N not a multiple of the 128-row tile, one chunk, K split in balanced
# parts (14336: 4 x 28 chunks), groups 32..256; MXFP4 / NVFP4 with their own groups
CASES = [
    ("int4-asym", 128, 1000, 4096),
    ("int4-sym", 64, 200, 1024),
    ("int4-fzero", 32, 96, 128),
    ("int4-asym", 256, 4160, 14336),
    ("mxfp4", 32, 1000, 2048),
    ("nvfp4", 16, 200, 1024),
]


def _weight(name: str, group: int, n: int, k: int):
    """(format number, codes, scale, zero or codes, global scale or None, reference(x, bias))."""
    if name in ("mxfp4", "nvfp4"):
        fmt, _, q, s, g, reference = _fp4_weight(name, n, k)
        return fmt, q, s, q, g, reference
    w = torch.randn(n, k, device="cuda") * 0.02
    fmt = {"int4-asym": 0, "int4-sym": 1, "int4-fzero": 2}[name]
    q, s, z = int4.quantize_int4(w, group, fmt == 1, fmt == 2)
    return (
        fmt,
        q,
        s,
        z if z.numel() else q,
        None,
        (lambda x, b: int4.int4_linear_reference(x, q, s, z, group, b, fmt == 2)),
    )


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,group,n,k", CASES, ids=str)
def test_matches_the_reference(name, group, n, k, dtype):
    from qshard.kernels.w4a16.register_ws import launch as ws_launch
    from qshard.kernels.w4a16.register_ws import problem as ws_problem

    fmt, q, s, z, g, reference = _weight(name, group, n, k)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for m in (3, 9, 13, 16, 20):  # token tiles of 8, 16 and 32; partial tiles
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert ws_problem(fmt, x, q, group) is None
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        b = bias if m % 2 else None
        got = ws_launch(fmt, x, q, s, z, b, out, group, global_scale=g)
        err = relative_error(got, reference(x, b))
        assert err <= MAX_RELATIVE_ERROR[dtype], f"M={m}: {err:.2e} > {MAX_RELATIVE_ERROR[dtype]}"


@hopper
@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336)], ids=str)
def test_the_same_bits_on_every_run(n, k):
    """Two programs per SM, an 8-slot ring wrapped four times per item (gate_up) and a split K
    (down), 16 tokens: without the proxy fence 30 of 30 launches differed here."""
    from qshard.kernels.w4a16.register_ws import launch as ws_launch

    fmt, q, s, z, _, reference = _weight("int4-asym", 128, n, k)
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    config = ws_config(16, n, k, x.device)
    assert config["PER_SM"] == 2 and config["STAGES"] == 8
    first = ws_launch(
        fmt, x, q, s, z, None, torch.empty(16, n, device="cuda", dtype=torch.bfloat16), 128
    )
    assert relative_error(first, reference(x, None)) <= MAX_RELATIVE_ERROR[torch.bfloat16]
    for run in range(20):
        out = torch.full((16, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        assert torch.equal(ws_launch(fmt, x, q, s, z, None, out, 128), first), f"run {run}"


@hopper
def test_the_op_chooses_it_and_tp_cuts_run_on_it():
    """`qshard.ops.int4_linear` on Hopper at WS_CHOICE_MIN_M..WS_CHOICE_MAX_M tokens runs the
    warp-specialized kernel where K % 128 == 0 and the wgmma kernel is not chosen (int4: 8
    tokens on a small weight), else the other register kernels (up to REGISTER_CHOICE_MAX_M
    tokens) or the Triton kernels; TP shards run on it (`assert_tp_cuts_run_on`, at 8 tokens)."""
    import qshard
    from qshard.kernels.w4a16.format import Format
    from qshard.kernels.w4a16.select import (
        REGISTER_CHOICE_MAX_M,
        WS_CHOICE_MAX_M,
        WS_CHOICE_MIN_M,
        choose,
        wgmma_chosen,
    )

    lin = torch.nn.Linear(4096, 1024, bias=True, device="cuda", dtype=torch.bfloat16)
    qshard.quantize_(lin, qshard.Int4WeightOnlyConfig(group_size=128))
    # The canonical codes, which these kernels read (int4 weights with groups below 128, TP cuts
    # re-grouped; on Hopper a g128 weight holds the native order: tests/layouts/test_int4_native.py)
    lin.weight = torch.nn.Parameter(lin.weight.canonical(), requires_grad=False)
    w = lin.weight
    for m in (WS_CHOICE_MIN_M - 1, WS_CHOICE_MIN_M, WS_CHOICE_MAX_M, WS_CHOICE_MAX_M + 1):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        kernel = choose(Format.INT4_ASYM, x, w.qdata, 128).kernel
        ws = WS_CHOICE_MIN_M <= m <= WS_CHOICE_MAX_M
        assert kernel == (
            "register_wgmma"
            if wgmma_chosen(Format.INT4_ASYM, m, 1024, 4096)
            else "register_ws"
            if ws
            else "register"
            if m <= REGISTER_CHOICE_MAX_M
            else "small_m"
        ), (m, kernel)
        want = int4.int4_linear_reference(x, w.qdata, w.scale, w.zero, 128, lin.bias)
        assert relative_error(lin(x), want) <= MAX_RELATIVE_ERROR[torch.bfloat16]
    x = torch.randn(WS_CHOICE_MAX_M, 4096, device="cuda", dtype=torch.bfloat16)
    odd = x[:, :4064]  # K % 128 != 0: the Triton kernel at 16 tokens, the register one at 9..12
    assert choose(Format.INT4_ASYM, odd, w.qdata[:, :2032], 32).kernel == "small_m"
    kernel = choose(Format.INT4_ASYM, odd[:9], w.qdata[:, :2032], 32).kernel
    assert kernel == "register"
    assert_tp_cuts_run_on("register_ws", w, x[:WS_CHOICE_MIN_M])


@hopper
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_the_op_chooses_it_for_fp4(name):
    assert_the_op_runs_fp4_on("register_ws", name, 14)


@hopper
def test_compiled_and_cuda_graphs():
    """At 10 and 16 tokens compiled, 12 graphed: the kernel's descriptors are made per call."""
    assert_compiled_and_graphed((10, 16), 12)
