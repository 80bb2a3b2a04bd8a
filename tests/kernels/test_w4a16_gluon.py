"""The register-operand int4 kernel (kernels/w4a16/register.py). On the CPU: it compiles for sm_90
(no GPU needed; catches a Gluon API break in CI), its K permutation is the same on the weight
and the activation side, and its PTX decode, emulated bit by bit, gives the reference's weights.
On a Hopper GPU: against the reference on fresh random inputs, odd shapes, every int4 format,
group and activation dtype, TP-cut weights, compiled, and chosen by the op."""

from __future__ import annotations

import pytest
import torch
from helpers import compile_for_sm90, relative_error

from qshard.kernels import int4, mxfp4, nvfp4
from qshard.kernels.gluon_api import GLUON_IMPORT_ERROR

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
# As test_w4a16_triton.py: the reference multiplies the same (bit-exact) weights and sums in
# float64; the kernel sums in fp32 and rounds once: a few units of the activation dtype.
MAX_RELATIVE_ERROR = {torch.float16: 1e-3, torch.bfloat16: 8e-3}
FORMATS = {
    "int4-asym": (0, False, False),
    "int4-sym": (1, True, False),
    "int4-fzero": (2, False, True),
}

COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from qshard.kernels.w4a16.register import _CONFIGS, _register_kernel
names = list(_register_kernel.arg_names)
for fmt, dtype, block_m, warps in ((0, "bf16", 8, 4), (0, "bf16", 16, 8), (1, "bf16", 128, 4),
                                   (2, "fp16", 32, 4), (3, "bf16", 8, 8), (3, "fp16", 16, 8),
                                   (4, "bf16", 16, 8), (4, "fp16", 8, 8)):
    steps, stages = _CONFIGS[block_m][:2]
    s_type = "*u8" if fmt >= 3 else "*bf16"  # MXFP4 / NVFP4: the e8m0 / e4m3 bytes
    z_type = "*fp32" if fmt == 4 else s_type  # NVFP4: the global scale in the zero's place
    types = [f"*{dtype}", "*i32", s_type, z_type, f"*{dtype}", f"*{dtype}", "*fp32", "*i32"]
    source = GluonASTSource(
        fn=_register_kernel, signature=dict(zip(names, types + ["i32"] * 6 + ["constexpr"] * 7)),
        constexprs={"FORMAT": fmt, "GROUP": {3: 32, 4: 16}.get(fmt, 128), "HAS_BIAS": True,
                    "SPLIT": True, "STEPS": steps, "STAGES": stages, "BLOCK_M": block_m},
        attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 10)})
    maxnreg = {"maxnreg": _CONFIGS[block_m][4]} if _CONFIGS[block_m][4] and warps == 8 else {}
    triton.compile(source, target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, **maxnreg})  # the op's register cap
"""


@pytest.mark.skipif(HOPPER, reason="compiles for sm_90 without a GPU: done on the CPU")
def test_compiles_for_sm90():
    """Every format and activation dtype, the smallest and largest token tile: Gluon's API
    moves between Triton versions (two renames between 3.6 and 3.9), and this is where CI sees
    it. With no Gluon at all the op must say why and run the Triton kernels instead."""
    if GLUON_IMPORT_ERROR is not None:
        from qshard.kernels.w4a16.register import problem as register_problem

        x = torch.zeros(16, 128, dtype=torch.bfloat16)
        assert "Gluon is not available" in register_problem(0, x, x, 128)
        return
    compile_for_sm90(COMPILE_FOR_SM90)


def test_weight_and_activation_permutations_agree():
    """The module docstring's K permutation, from the kernel's index expressions: logical
    column k' = 8b + 2t + h of word j (the A operand after `_chunk_weights`, the B operand after
    `_b_operand`) must be the same actual column on both sides, and a bijection of the chunk."""
    k = torch.arange(32)
    b, t, h = k // 8, (k % 8) // 2, k % 2
    s0, c8 = k // 16, (k // 8) % 2  # the B side's names for the same bits
    for j in range(4):
        # weight: word 4t + j of the thread's run, byte b, nibble h -> canonical column
        weight_col = 2 * (4 * (4 * t + j) + b) + h
        # activation: `_copy_x` puts column 32t + 8j + e at [j][:, 8t + e], e = 4 s0 + 2 c8 + h
        x_col = 32 * t + 8 * j + (4 * s0 + 2 * c8 + h)
        assert torch.equal(weight_col, x_col)
    every = torch.cat([2 * (4 * (4 * t + j) + b) + h for j in range(4)])
    assert torch.equal(every.sort().values, torch.arange(128))


def test_a_config_the_kernel_cannot_build_is_refused():
    """Each chunk's ring slot is fixed at compile time, so an item's chunks must fill the ring
    exactly: a config that breaks it (or has a one-slot ring, an unknown tile or warp count, no
    programs, or fewer tile tokens than tokens, which would leave rows of the output unwritten)
    is a ValueError that says the rule, raised before anything is launched."""
    from qshard.kernels.w4a16.register import config as register_config
    from qshard.kernels.w4a16.register import launch as register_launch

    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    q = torch.zeros(64, 128, dtype=torch.uint8)
    good = register_config(4, 64, 256, x.device)
    assert good["STEPS"] % good["STAGES"] == 0
    bad_configs = (
        {"STEPS": 3, "STAGES": 2},
        {"STEPS": 1, "STAGES": 1},
        {"BLOCK_M": 12},
        {"WARPS": 2},
        {"PER_SM": 0},
        {"BLOCK_M": 8, "_tokens": 12},
    )
    for bad in bad_configs:
        x = torch.zeros(bad.pop("_tokens", 4), 256, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="STEPS must be a multiple of STAGES"):
            register_launch(0, x, q, x, x, None, x, 128, {**good, **bad})


def _bf16(bits: torch.Tensor) -> torch.Tensor:
    return (bits & 0xFFFF).to(torch.int16).view(torch.bfloat16).double()


def _decode_emulated(words: torch.Tensor, scale, zero, fmt: int, dtype) -> torch.Tensor:
    """The PTX of `_DECODE_BF16` / `_DECODE_FP32`, step by step on int64 words: [..] -> [.., 8]
    weights (byte b, nibble h at 2b + h)."""
    q = words.to(torch.int64) & 0xFFFFFFFF
    r = q >> 4
    neg_c = -136.0 if fmt == 2 else -(zero.double() + 128.0)
    out = []
    for b in range(4):
        # prmt(q, r, 0x(4+b)(4+b)bb): byte 0 = q's byte b, byte 2 = r's byte b
        v = ((q >> 8 * b) & 0xFF) | (((r >> 8 * b) & 0xFF) << 16)
        v = (v & 0x000F000F) | 0x43004300  # lop3 0xEA: (a & b) | c
        for half in (v, v >> 16):
            d = _bf16(half) + neg_c  # exact: 8-bit integers
            if dtype == torch.bfloat16 and fmt != 2:
                w = (d * scale.double()).to(torch.bfloat16)  # one rounding (exact product)
            else:
                add = zero.double() if fmt == 2 else 0.0
                w = (d * scale.double() + add).float().to(dtype)  # fp32 fma, then cvt.rn
            out.append(w)
    return torch.stack(out, -1)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_emulated_equals_the_reference(name, dtype):
    """Bit for bit the reference's weights (dequantize_int4 in the activation dtype), with
    scales over bf16's range and float zero points of both signs."""
    fmt, symmetric, float_zero = FORMATS[name]
    n, k, group = 8, 256, 32
    w = torch.randn(n, k) * torch.logspace(-6, 2, n)[:, None]
    qdata, scale, zero = int4.quantize_int4(w, group, symmetric, float_zero)
    expected = int4.dequantize_int4(qdata, scale, zero, group, k, dtype, float_zero)
    words = qdata.view(torch.int32)  # 8 codes per word, column 8i + 2b + h
    per_word = lambda t: t.repeat_interleave(group // 8, dim=1)  # noqa: E731
    zeros = per_word(zero) if zero.numel() else torch.full((n, k // 8), 8.0)
    got = _decode_emulated(words, per_word(scale), zeros, fmt, dtype).reshape(n, k)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def _decode_e2m1_emulated(words: torch.Tensor, power: torch.Tensor, dtype) -> torch.Tensor:
    """The PTX of `_DECODE_E2M1_BF16` / `_DECODE_E2M1_F16` on int64 words: [..] -> [.., 8];
    `power`: the group's multiplier (MXFP4's 2**(E - 127), NVFP4's e4m3 scale), float64."""
    q = words.to(torch.int64) & 0xFFFFFFFF
    r = q >> 4
    out = []
    for b in range(4):
        qb, rb = (q >> 8 * b) & 0xFF, (r >> 8 * b) & 0xFF
        v = qb | qb << 8 | rb << 16 | rb << 24  # prmt(q, r, 0x(4+b)(4+b)bb)
        a = ((v << 6) & 0xFFFFFFFF) & 0x01C001C0
        c = (v << 12) & 0xFFFFFFFF
        v = a | (c & 0x80008000)  # lop3 0xF8: a | (b & c)
        for half in (v, v >> 16):
            value = _bf16(half) * 2.0**126  # exact, 0.5 from the subnormal 2**-127
            if dtype == torch.bfloat16:
                out.append((value * power).to(torch.bfloat16))  # exact product
            else:
                out.append((value * power).float().to(dtype))  # fp32 products, cvt.rn
    return torch.stack(out, -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_e2m1_decode_emulated_equals_the_reference(dtype):
    """MXFP4: every code (both zeros, the subnormal 0.5) under e8m0 exponents from 0 (the
    subnormal 2**-127) to 254, bit for bit dequantize_mxfp4 in the activation dtype."""
    n, k = 16, 256
    codes = torch.arange(n * k) % 16  # every code in every position of a word
    qdata = (codes[0::2] | codes[1::2] << 4).to(torch.uint8).reshape(n, k // 2)
    exponents = torch.tensor(
        [0, 1, 2, 60, 100, 120, 126, 127, 128, 130, 140, 160, 200, 230, 250, 254], dtype=torch.uint8
    )
    e = exponents[:, None].expand(n, k // 32)
    scale = e.contiguous().view(torch.float8_e8m0fnu)
    expected = mxfp4.dequantize_mxfp4(qdata, scale, 32, k, dtype)
    words = qdata.view(torch.int32)
    power = torch.ldexp(torch.ones(n, k // 32, dtype=torch.float64), e.long() - 127)
    got = _decode_e2m1_emulated(words, power.repeat_interleave(4, dim=1), dtype).reshape(n, k)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nvfp4_decode_emulated_is_exact(dtype):
    """NVFP4: every code times every finite e4m3 scale is exact in bf16 and fp16 (2 and 4
    significant bits), so the decoded weight is e2m1 * scale exactly and the kernel applies
    the global scale to the sums (as the Triton kernels do); the reference rounds
    e2m1 * scale * global once per weight instead, within the tests' tolerance."""
    scales = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    scales = scales[scales.isfinite()]
    codes = torch.arange(len(scales) * 16) % 16
    qdata = (codes[0::2] | codes[1::2] << 4).to(torch.uint8).reshape(len(scales), 8)
    words = qdata.view(torch.int32)  # [scales, 2]: one scale per row
    got = _decode_e2m1_emulated(words, scales[:, None].expand(-1, 2), dtype).reshape(-1, 16)
    values = torch.tensor(mxfp4.E2M1_VALUES, dtype=torch.float64)[codes.reshape(-1, 16)]
    assert torch.equal(got.double(), values * scales[:, None])


# ---- on a Hopper GPU ---------------------------------------------------------------------------

hopper = pytest.mark.skipif(not HOPPER, reason="the register kernel runs on Hopper (sm_90)")

# (N, K, group): N not a multiple of the 64- or 128-row tile, K not of the 128-column chunk (2880:
# gpt-oss's hidden size), a single chunk, long K (split K), groups 32..256.
SHAPES = [(96, 2880, 32), (1000, 4096, 128), (64, 128, 64), (4160, 14336, 128), (200, 1024, 256)]


# bf16 on every shape, fp16 on one: each case compiles its own variants on the GPU
CASES = [(name, torch.bfloat16, shape) for name in FORMATS for shape in SHAPES] + [
    (name, torch.float16, SHAPES[0]) for name in FORMATS
]


@hopper
@pytest.mark.parametrize("name,dtype,shape", CASES, ids=str)
def test_matches_the_reference(name, dtype, shape):
    from qshard.kernels.w4a16.register import launch as register_launch
    from qshard.kernels.w4a16.register import problem as register_problem

    fmt, symmetric, float_zero = FORMATS[name]
    n, k, group = shape
    w = torch.randn(n, k, device="cuda") * 0.02
    qdata, scale, zero = int4.quantize_int4(w, group, symmetric, float_zero)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for m in (2, 12, 100):  # BLOCK_M 8, 16 and 128 (the configs test covers 32 and 64)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert register_problem(fmt, x, qdata, group) is None
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        zero_arg = zero if zero.numel() else qdata
        got = register_launch(fmt, x, qdata, scale, zero_arg, bias if m % 2 else None, out, group)
        want = int4.int4_linear_reference(
            x, qdata, scale, zero, group, bias if m % 2 else None, float_zero
        )
        err = relative_error(got, want)
        assert err <= MAX_RELATIVE_ERROR[dtype], f"M={m}: {err:.2e} > {MAX_RELATIVE_ERROR[dtype]}"


@hopper
def test_every_config_matches_the_reference():
    """Each (STEPS, STAGES, PER_SM, WARPS, MAXNREG, BLOCK_M) a config could name: one item per
    program, a persistent grid, partial last splits, a ring as deep as an item, 4 and 8 warps,
    a register cap, every token tile."""
    from qshard.kernels.w4a16.register import launch as register_launch

    n, k, group = 1000, 3200, 128
    w = torch.randn(n, k, device="cuda") * 0.02
    qdata, scale, zero = int4.quantize_int4(w, group, False)
    configs = ((2, 2, 4, 0), (3, 3, 4, 0), (8, 4, 8, 128), (16, 8, 8, 0))
    for steps, stages, warps, maxnreg in configs:
        for per_sm in (2, 0):
            for m, block_m in ((5, 8), (9, 16), (20, 32), (64, 64), (65, 128)):
                if (block_m * 256 + 1024 * warps) * stages > 200 * 1024:
                    continue  # the ring would not fit in shared memory
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                config = {
                    "BLOCK_M": block_m,
                    "STEPS": steps,
                    "STAGES": stages,
                    "WARPS": warps,
                    "MAXNREG": maxnreg,
                    "PER_SM": per_sm or 10**6,
                }
                got = register_launch(0, x, qdata, scale, zero, None, out, group, config)
                want = int4.int4_linear_reference(x, qdata, scale, zero, group)
                assert relative_error(got, want) <= MAX_RELATIVE_ERROR[torch.bfloat16], config


@hopper
def test_the_op_chooses_it_and_tp_cuts_run_on_it():
    """`qshard.ops.int4_linear` on Hopper at 2..7 tokens runs the register kernel (and the
    Triton kernels where it cannot: group 16, or more tokens); TP shards run on it unchanged
    (`assert_tp_cuts_run_on`)."""
    import qshard
    from qshard.kernels.w4a16.format import Format
    from qshard.kernels.w4a16.select import choose

    lin = torch.nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    qshard.quantize_(lin, qshard.Int4WeightOnlyConfig(group_size=128))
    # The canonical codes, which these kernels read (int4 weights with groups below 128, TP cuts
    # re-grouped; on Hopper a g128 weight holds the native order: tests/layouts/test_int4_native.py)
    lin.weight = torch.nn.Parameter(lin.weight.canonical(), requires_grad=False)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    w = lin.weight
    assert choose(Format.INT4_ASYM, x, w.qdata, 128).kernel == "register"
    # int4 at 9..128 tokens: the wgmma kernel (test_w4a16_gluon_wgmma.py); above: Triton
    x19 = torch.cat([x] * 6 + [x[:1]])
    assert choose(Format.INT4_ASYM, x19, w.qdata, 128).kernel == "register_wgmma"
    assert choose(Format.INT4_ASYM, torch.cat([x19] * 7), w.qdata, 128).kernel == "dequantize"
    assert choose(Format.MXFP4, x, w.qdata, 16).kernel == "small_m"  # MXFP4 groups are 32
    assert choose(Format.NVFP4, x, w.qdata, 32).kernel == "small_m"  # NVFP4 groups are 16
    assert choose(Format.NVFP4, x[:, :4080], w.qdata[:, :2040], 16).kernel == "small_m"  # K % 32
    want = int4.int4_linear_reference(x, w.qdata, w.scale, w.zero, 128)
    assert relative_error(lin(x), want) <= MAX_RELATIVE_ERROR[torch.bfloat16]
    assert_tp_cuts_run_on("register", w, x)
    fine = w[:, 16:2064]  # group 16: the Triton kernels
    assert choose(Format.INT4_ASYM, x[:, 16:2064], fine.qdata, 16).kernel == "small_m"


def assert_tp_cuts_run_on(kernel: str, w, x: torch.Tensor) -> None:
    """TP shards of the g128 int4 weight `w` [N, 4096] at x's tokens: a column shard cut at 64
    columns, inside a group (re-grouped to 64; K = 2048), runs on `kernel`; it and a 384-row
    shard (not a multiple of the 128-row tile) match the reference (shared with the other
    register kernels' tests)."""
    from qshard.kernels.w4a16.format import Format
    from qshard.kernels.w4a16.select import choose

    tolerance = MAX_RELATIVE_ERROR[torch.bfloat16]
    shard = w[:, 64:2112]
    assert shard.group_size == 64
    xs = x[:, 64:2112].contiguous()
    assert choose(Format.INT4_ASYM, xs, shard.qdata, 64).kernel == kernel
    want = int4.int4_linear_reference(xs, shard.qdata, shard.scale, shard.zero, 64)
    assert relative_error(torch.nn.functional.linear(xs, shard), want) <= tolerance
    rows = w[136:520]
    want = int4.int4_linear_reference(x, rows.qdata, rows.scale, rows.zero, 128)
    assert relative_error(torch.nn.functional.linear(x, rows), want) <= tolerance


def assert_compiled_and_graphed(compiled_tokens: tuple[int, ...], graph_tokens: int) -> None:
    """torch.compile (fullgraph, dynamic batch) of an int4 linear at each of `compiled_tokens`
    and a CUDA graph replay at `graph_tokens` equal eager bit for bit (shared with
    test_w4a16_gluon_ws.py: the token counts pick the kernel)."""
    import qshard

    lin = torch.nn.Linear(2048, 3072, bias=True, device="cuda", dtype=torch.bfloat16)
    qshard.quantize_(lin, qshard.Int4WeightOnlyConfig(group_size=64, symmetric=True))
    compiled = torch.compile(lin, fullgraph=True, dynamic=True)
    for m in compiled_tokens:
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x), lin(x), atol=0, rtol=0)
    x = torch.randn(graph_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    want = lin(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = lin(x)
    graph.replay()
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@hopper
def test_compiled_and_cuda_graphs():
    """At 2 and 4 tokens compiled, 3 graphed: the kernel is inside the op, so the compiler
    only sees the op."""
    assert_compiled_and_graphed((2, 4), 3)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_weights_are_exact(dtype):
    """x = rows of the identity picks columns of W: the kernel's decoded weights, bit for bit,
    for every code (the subnormal 0.5; both zeros read back as +0) under exponents from 0 to
    250 (to 140 for fp16, whose weights would be infinite past it, and 0 * inf is NaN)."""
    from qshard.kernels.w4a16.register import launch as register_launch

    n, k = 256, 512
    gen = torch.Generator(device="cuda").manual_seed(0)
    qdata = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
    top = 251 if dtype == torch.bfloat16 else 141
    e = torch.randint(0, top, (n, k // 32), device="cuda", dtype=torch.uint8, generator=gen)
    scale = e.view(torch.float8_e8m0fnu)
    weight = mxfp4.dequantize_mxfp4(qdata, scale, 32, k, dtype)
    for first in range(0, k, 12):
        cols = torch.arange(first, min(first + 12, k), device="cuda")
        x = torch.zeros(len(cols), k, device="cuda", dtype=dtype)
        x[torch.arange(len(cols)), cols] = 1
        out = torch.empty(len(cols), n, device="cuda", dtype=dtype)
        got = register_launch(3, x, qdata, scale, qdata, None, out, 32)
        want = weight[:, cols].T + 0.0  # a token's sum starts at +0: a -0 weight reads as +0
        bad = (got.view(torch.int16) != want.view(torch.int16)).nonzero().tolist()
        examples = [
            (got[i, j].item(), want[i, j].item(), e[j, cols[i] // 32].item()) for i, j in bad[:6]
        ]
        assert not bad, f"{len(bad)} weights differ, e.g. (got, want, E): {examples}"


def _fp4_weight(name: str, n: int, k: int) -> tuple:
    """A random [n, k] weight in MXFP4 or NVFP4: (the kernel's format number, group, codes,
    scale, global scale or None, the reference: (x, bias) -> x @ W.T + bias)."""
    w = torch.randn(n, k, device="cuda") * 0.02
    if name == "mxfp4":
        q, s = mxfp4.quantize_mxfp4(w)
        return 3, 32, q, s, None, lambda x, b: mxfp4.mxfp4_linear_reference(x, q, s, 32, b)
    g = nvfp4.global_scale_of(w)
    q, s = nvfp4.quantize_nvfp4(w, g)
    return 4, 16, q, s, g, lambda x, b: nvfp4.nvfp4_linear_reference(x, q, s, g, 16, b)


# (format, dtype, (N, K)): odd N and K, long K, and for NVFP4 one split (no split K)
FP4_CASES = [
    ("mxfp4", torch.bfloat16, (96, 2880)),
    ("mxfp4", torch.bfloat16, (4160, 14336)),
    ("mxfp4", torch.float16, (1000, 4096)),
    ("nvfp4", torch.bfloat16, (96, 2880)),
    ("nvfp4", torch.bfloat16, (200, 1024)),
    ("nvfp4", torch.float16, (1000, 4096)),
]


@hopper
@pytest.mark.parametrize("name,dtype,shape", FP4_CASES, ids=str)
def test_fp4_matches_the_reference(name, dtype, shape):
    from qshard.kernels.w4a16.register import launch as register_launch
    from qshard.kernels.w4a16.register import problem as register_problem

    n, k = shape
    fmt, group, qdata, scale, global_scale, reference = _fp4_weight(name, n, k)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for m in (2, 5, 12, 100):  # (M = 12: the 16-token tile)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert register_problem(fmt, x, qdata, group) is None
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        b = bias if m % 2 else None
        got = register_launch(fmt, x, qdata, scale, qdata, b, out, group, global_scale=global_scale)
        err = relative_error(got, reference(x, b))
        assert err <= MAX_RELATIVE_ERROR[dtype], f"M={m}: {err:.2e} > {MAX_RELATIVE_ERROR[dtype]}"


def assert_the_op_runs_fp4_on(kernel: str, name: str, tokens: int) -> None:
    """An MXFP4 / NVFP4 linear at `tokens` tokens: the op chooses `kernel` and matches the
    reference (shared with test_w4a16_gluon_ws.py)."""
    import qshard
    from qshard.kernels.w4a16.format import Format
    from qshard.kernels.w4a16.select import choose

    config, fmt, group = {
        "mxfp4": (qshard.MXFP4WeightOnlyConfig(), Format.MXFP4, 32),
        "nvfp4": (qshard.NVFP4WeightOnlyConfig(), Format.NVFP4, 16),
    }[name]
    lin = torch.nn.Linear(2048, 1536, bias=True, device="cuda", dtype=torch.bfloat16)
    qshard.quantize_(lin, config)
    w = lin.weight
    x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    assert choose(fmt, x, w.qdata, group).kernel == kernel
    if name == "mxfp4":
        want = mxfp4.mxfp4_linear_reference(x, w.qdata, w.scale, 32, lin.bias)
    else:
        want = nvfp4.nvfp4_linear_reference(x, w.qdata, w.scale, w.global_scale, 16, lin.bias)
    assert relative_error(lin(x), want) <= MAX_RELATIVE_ERROR[torch.bfloat16]


@hopper
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_the_op_chooses_it_for_fp4(name):
    assert_the_op_runs_fp4_on("register", name, 7)
