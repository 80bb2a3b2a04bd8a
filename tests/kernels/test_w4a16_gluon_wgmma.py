"""The wgmma register kernel (kernels/w4a16/register_wgmma.py). On the CPU: it compiles for sm_90
(no GPU needed; catches a Gluon API break in CI) with asynchronous wgmmas on register A
operands and a proxy fence before every slot release; x's permutation against the canonical
packing's K order (the product of the permuted operands is the matmul, exactly); its split
rule; its refusals. On a Hopper GPU: against the reference on fresh random inputs, odd shapes,
every 4-bit format, group and activation dtype; the same bits on every run."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from helpers import compile_for_sm90, relative_error
from test_w4a16_gluon import (
    assert_compiled_and_graphed,
    assert_the_op_runs_fp4_on,
    assert_tp_cuts_run_on,
)
from test_w4a16_gluon_ws import (  # the same cases and weights as the warp-specialized kernel's
    CASES,
    HOPPER,
    MAX_RELATIVE_ERROR,
    _releases_without_fence,
    _weight,
)

from qshard.kernels import int4
from qshard.kernels.gluon_api import GLUON_IMPORT_ERROR
from qshard.kernels.packing import pack_nibbles
from qshard.kernels.w4a16.register_wgmma import config as wgmma_config
from qshard.kernels.w4a16.register_wgmma import native_codes, permute_x, split_for, tma_ready
from qshard.kernels.w4a16.register_wgmma import problem as wgmma_problem

COMPILE_FOR_SM90 = """
import sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from qshard.kernels.gluon_api import TensorDescriptor, gl
from qshard.kernels.w4a16.register_wgmma import X_BY_TMA_MIN_T
from qshard.kernels.w4a16.register_wgmma_kernel import wgmma_kernel as _wgmma_kernel
names = list(_wgmma_kernel.arg_names)
k = 1024
for fmt, dtype, block_t, split, native, promote, group_chunks in (
        (0, "bf16", 128, True, 0, 0, 4), (1, "fp16", 32, True, 0, 0, 4),
        (2, "bf16", 64, False, 0, 0, 4), (3, "bf16", 16, True, 0, 0, 4),
        (4, "fp16", 64, False, 0, 0, 4), (0, "bf16", 16, True, 1, 0, 4),
        (2, "fp16", 32, True, 1, 0, 4), (0, "bf16", 16, True, 1, 1, 2),
        (1, "bf16", 32, False, 0, 1, 2)):
    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    codes = torch.empty(256, k // 8, dtype=torch.int32)
    q_desc = TensorDescriptor.from_tensor(codes, [128, 16], gl.NVMMASharedLayout(0, 32, rank=2))
    by_tma = block_t >= X_BY_TMA_MIN_T or bool(native)
    x_type = (mangle_type(TensorDescriptor.from_tensor(
        torch.empty(block_t, k, dtype=tdtype), [block_t, 64], gl.NVMMASharedLayout(128, 16,
        rank=2))) if by_tma else f"*{dtype}")
    s_type = "*u8" if fmt >= 3 else "*bf16"
    z_type = "*fp32" if fmt == 4 else s_type
    types = [mangle_type(q_desc), x_type, s_type, z_type, f"*{dtype}", f"*{dtype}",
             "*fp32", "*i32"] + ["i32"] * 6 + ["constexpr"] * 11
    source = GluonASTSource(
        fn=_wgmma_kernel, signature=dict(zip(names, types)),
        constexprs={"FORMAT": fmt, "GROUP": {3: 32, 4: 16}.get(fmt, 128), "HAS_BIAS": True,
                    "SPLIT": split, "STAGES": 4, "GROUP_CHUNKS": group_chunks, "BLOCK_T": block_t,
                    "X_BY_TMA": by_tma, "PRODUCER_WARPS": 1 if by_tma else 4,
                    "NATIVE": bool(native), "PROMOTE": bool(promote)},
        attrs={(i,): [["tt.divisibility", 16]] for i in (1, 2, 3, 4, 5, 6, 7, 10)})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    title = f"{fmt} {dtype} {block_t} {int(by_tma)} {native} {promote} {group_chunks}"
    sys.stdout.write(f"=== {title}\\n" + compiled.asm["ptx"])
"""


def _wgmmas_after_unfenced_waits(ptx: str) -> int:
    """wgmmas issued after an mbarrier wait with no `fence.proxy.async` between: x came into
    the slot by cp.async (the generic proxy) and wgmma reads it through the async proxy."""
    unfenced = 0
    waited = False
    for line in ptx.splitlines():
        if "mbarrier.try_wait" in line:
            waited = True
        elif "fence.proxy.async" in line:
            waited = False
        elif "wgmma.mma_async" in line:
            unfenced += waited
    return unfenced


def test_the_wgmma_fence_check_sees_a_missing_fence():
    ptx = "mbarrier.try_wait.parity.shared::cta.b64 p, [r], 0;\nwgmma.mma_async.sync.aligned"
    assert _wgmmas_after_unfenced_waits(ptx) == 1
    fenced = ptx.replace("\nwgmma", "\nfence.proxy.async.shared::cta;\nwgmma")
    assert _wgmmas_after_unfenced_waits(fenced) == 0


@pytest.mark.skipif(HOPPER, reason="compiles for sm_90 without a GPU: done on the CPU")
def test_compiles_for_sm90_with_async_register_wgmma():
    """Every format, both activation dtypes, four token tiles, split and unsplit K. Per chunk
    and consumer: 8 wgmmas (128 columns in steps of 16) with the A operand in registers; in a
    group of GROUP_CHUNKS chunks one wait per chunk after the first leaves that chunk's two
    groups in flight; one fenced slot release per chunk. The consumer's code holds a group
    and a single chunk (the remainder), for each of the two consumers. The producer copies x
    in 4-byte cp.async pieces (its permutation's unit) that complete on the slot's barrier
    (one no-increment arrival per lane), and the consumers fence before their wgmmas read it;
    from X_BY_TMA_MIN_T tokens TMA copies the permuted x instead. PROMOTE: the weights decoded
    unscaled (no bf16 multiply by the scale), each chunk's first wgmma into a fresh
    accumulator, the sums scaled in fp32."""
    if GLUON_IMPORT_ERROR is not None:
        x = torch.zeros(16, 128, dtype=torch.bfloat16)
        assert "Gluon is not available" in wgmma_problem(0, x, x, 128)
        return
    kernels = compile_for_sm90(COMPILE_FOR_SM90).split("=== ")[1:]
    assert len(kernels) == 9
    for kernel in kernels:
        title, ptx = kernel.split("\n", 1)
        fmt, dtype, block_t, by_tma, native, promote, group_chunks = title.split()
        group_chunks = int(group_chunks)
        bodies = 2 * (group_chunks + 1)  # chunk bodies: two consumers, a group and one chunk each
        kind = {"bf16": "bf16.bf16", "fp16": "f16.f16"}[dtype]
        mma = f"wgmma.mma_async.sync.aligned.m64n{block_t}k16.f32.{kind}"
        assert ptx.count(mma) == 8 * bodies, title
        assert ptx.count("wgmma.wait_group.sync.aligned 2;") == 2 * (group_chunks - 1), title
        scaled = "mov.b32 s, {"  # the scale's register in the bf16 decodes (not the fp32 ones)
        assert (scaled in ptx) == (promote == "0" and dtype == "bf16" and fmt != "2"), title
        if promote == "1":  # per chunk body: a fresh accumulator, then its sums scaled in fp32
            fresh = [line for line in ptx.splitlines() if mma in line and ", 0, 1, 1, 0;" in line]
            assert len(fresh) == bodies, title  # the chunk's first wgmma: scale-d 0
            assert ptx.count("fma.rn.f32") == bodies * int(block_t) // 2, title
        releases, unfenced = _releases_without_fence(ptx)
        assert releases == bodies and unfenced == 0, (title, releases, unfenced)
        copies = [line for line in ptx.splitlines() if "cp.async.ca.shared.global" in line]
        if native == "1":  # pairs by shifts (`_DECODE_PAIRS_NATIVE`), no byte permutes
            assert "prmt.b32" not in ptx and ptx.count("shr.u32") >= 3 * 8 * bodies, title
        if by_tma == "1":
            assert not copies and "cp.async.mbarrier" not in ptx, title
            assert ptx.count("cp.async.bulk.tensor.2d") == 3, title  # x's two boxes, the codes
            continue
        assert copies and all(", 0x4," in line for line in copies), title
        assert ptx.count("cp.async.mbarrier.arrive.noinc") == 1, title
        assert "mbarrier.init.shared::cta.b64" in ptx and ", 129;" in ptx, title  # 1 + 4 x 32
        assert ptx.count("cp.async.bulk.tensor.2d") == 1, title  # the codes
        assert _wgmmas_after_unfenced_waits(ptx) == 0, title


def _decoded_columns(k: int) -> torch.Tensor:
    """For each MMA column of a K-long row, the actual column whose code a thread decodes into
    it: thread t's word j, byte b, nibble h is column 32t + 8j + 2b + h of the chunk, and
    `_chunk_weights` places it at 32j + 16 s0 + 8 c8 + 2t + h (b = 2 s0 + c8) of the chunk."""
    j, b, t, h = torch.meshgrid(*(torch.arange(n) for n in (4, 4, 4, 2)), indexing="ij")
    actual = torch.empty(128, dtype=torch.long)
    actual[(32 * j + 8 * b + 2 * t + h).flatten()] = (32 * t + 8 * j + 2 * b + h).flatten()
    return (torch.arange(0, k, 128)[:, None] + actual).flatten()


def test_permuted_x_meets_the_decoded_weight_column_for_column():
    """The kernel multiplies the weight decoded in MMA column order by permute_x(x): column for
    column the same actual K index, so the product is x @ W.T (exactly, in integers)."""
    k = 512
    columns = _decoded_columns(k)
    assert sorted(columns.tolist()) == list(range(k))
    x = torch.arange(3 * k, dtype=torch.float64).reshape(3, k)
    assert torch.equal(permute_x(x), x[:, columns])
    w = torch.randint(-8, 8, (5, k), dtype=torch.float64)
    assert torch.equal(permute_x(x) @ w[:, columns].T, x @ w.T)


def _native_pairs(word: torch.Tensor) -> list[torch.Tensor]:
    """`_DECODE_PAIRS_NATIVE`'s and-ors run on int64 `word`s as its PTX says (the shift before
    each, mask 0x000f000f, bias 0x43004300): pair v0..v3, each as 32-bit values."""
    from qshard.kernels.w4a16.register_parts import _DECODE_PAIRS_NATIVE

    pairs, r = {}, None
    for statement in (s.strip() for s in _DECODE_PAIRS_NATIVE.split(";")):
        if shift := re.fullmatch(r"shr\.u32 r, \$8, (\d+)", statement):
            r = word >> int(shift.group(1))
        elif lop := re.fullmatch(r"lop3\.b32 v(\d), (\$8|r), mask, bias, 0xEA", statement):
            source = word if lop.group(2) == "$8" else r
            pairs[int(lop.group(1))] = (source & 0x000F000F) | 0x43004300
    return [pairs[b] for b in range(4)]


@pytest.mark.skipif(GLUON_IMPORT_ERROR is not None, reason="the decode's PTX needs Gluon")
def test_native_codes_decode_to_x_own_columns():
    """`native_codes`' order through the kernel's own decode PTX (`_native_pairs`): thread t's
    word j (of 4) in a 128-column chunk, its pair b's half h (bf16 128 + code), must be the
    code of MMA column 32 j + 8 b + 2 t + h, which with NATIVE is x's own column."""
    n, k = 5, 384
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    words = native_codes(pack_nibbles(codes)).view(torch.int32).view(n, k // 128, 16)
    for t, j in itertools.product(range(4), range(4)):
        pairs = _native_pairs(words[:, :, 4 * t + j].to(torch.int64) & 0xFFFFFFFF)
        for b, h in itertools.product(range(4), range(2)):
            code = (pairs[b] >> (16 * h)) & 0xFFFF
            assert torch.all(code >> 4 == 0x430), (t, j, b, h)  # bf16 128 + code: 0x4300 | code
            column = torch.arange(k // 128) * 128 + 32 * j + 8 * b + 2 * t + h
            assert torch.equal((code & 0xF).to(torch.uint8), codes[:, column]), (t, j, b, h)


def test_tma_ready_copies_x_only_where_a_descriptor_cannot_take_it():
    x = torch.randn(4, 1032, dtype=torch.bfloat16)
    assert tma_ready(x[:, :1024]).data_ptr() == x.data_ptr()  # row stride 2064 bytes: kept
    for bad in (x[:1, 1:1025], x.t(), torch.randn(3, 1028, dtype=torch.bfloat16)[:1, :1024]):
        ready = tma_ready(bad)  # offset 2 bytes; column-major; a [1, K] row of stride 2056 bytes
        assert ready.stride() == (bad.shape[1], 1) and torch.equal(ready, bad)


@pytest.mark.parametrize("m,block_t", [(2, 16), (16, 16), (17, 32), (33, 64), (100, 128)])
def test_config_tiles_and_splits(m, block_t):
    """The token tile; K in the split count `split_for` models fastest, balanced so that no
    split is empty; the ring as deep as the shared memory allows (8 slots at 16-64 tokens, 5 at
    128: 40 KB each)."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (200, 128)):
        config = wgmma_config(m, n, k, torch.device("cuda"), sms=132)
        chunks = k // 128
        splits = split_for(-(-n // 128), chunks, 132, block_t)
        assert config["BLOCK_T"] == block_t
        assert config["STEPS"] == -(-chunks // splits)
        assert -(-chunks // config["STEPS"]) == splits  # every split holds chunks
        assert config["STAGES"] == {16: 8, 32: 8, 64: 8, 128: 5}[block_t]


def test_split_rule_fills_the_gpu_and_keeps_whole_tiles():
    assert split_for(224, 32, 132, 16) == 1  # gate_up: 224 tiles already fill 132 SMs
    assert split_for(32, 32, 132, 128) == 4  # o: 32 tiles x 4 splits = 128 items
    assert split_for(1, 1, 132, 16) == 1


@pytest.mark.parametrize("m", [1, 2, 8, 9, 16, 17, 32, 128, 129])
def test_the_op_chooses_it_where_it_was_measured_faster(m):
    """int4 from 9 tokens to 128 on every weight, from 2 on weights as large as gate_up and
    down; MXFP4 / NVFP4 from 17 on every weight, from 9 on the large ones (the H100's Llama
    layer; docs/kernels/w4a16_register.md, "The wgmma kernel (`w4a16/register_wgmma.py`)")."""
    from qshard.kernels.w4a16.format import Format
    from qshard.kernels.w4a16.select import wgmma_chosen

    llama = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    }
    for name, (n, k) in llama.items():
        big = name in ("gate_up", "down")
        int4 = 9 <= m <= 128 or (2 <= m <= 128 and big)
        fp4 = 17 <= m <= 128 or (9 <= m <= 128 and big)
        for fmt in (Format.INT4_ASYM, Format.INT4_SYM, Format.INT4_FZERO):
            assert wgmma_chosen(fmt, m, n, k) == int4, (name, fmt)
        for fmt in (Format.MXFP4, Format.NVFP4):
            assert wgmma_chosen(fmt, m, n, k) == fp4, (name, fmt)


@pytest.mark.parametrize(
    "config",
    [
        {"BLOCK_T": 32, "STEPS": 2},
        {"BLOCK_T": 64, "STEPS": 0},
        {"BLOCK_T": 64, "STEPS": 2, "STAGES": 9},
        {"BLOCK_T": 64, "STEPS": 2, "GROUP_CHUNKS": 0},
    ],
)
def test_a_config_it_cannot_run_is_refused(config):
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch

    x = torch.zeros(40, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="BLOCK_T must be one of"):
        wgmma_launch(0, x, x, x, x, None, x, 128, config)


@pytest.mark.parametrize(
    "fmt,dtype,group,block_t",
    [
        (3, torch.bfloat16, 128, 16),
        (2, torch.bfloat16, 128, 16),
        (0, torch.float16, 128, 16),
        (0, torch.bfloat16, 64, 16),
        (0, torch.bfloat16, 0, 16),
        (0, torch.bfloat16, 128, 64),
    ],
)
def test_promote_where_it_cannot_run_is_refused(fmt, dtype, group, block_t):
    """PROMOTE scales a chunk's sums by one scale per row: int4 with whole groups of 128, bf16
    x (u - z exact), token tiles up to 32 (registers); elsewhere a ValueError naming the fix,
    and `promote_config` does not offer it."""
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch
    from qshard.kernels.w4a16.register_wgmma import promote_config

    x = torch.zeros(16, 256, dtype=dtype)
    config = {"BLOCK_T": block_t, "STEPS": 1, "PROMOTE": 1}
    with pytest.raises(ValueError, match="drop PROMOTE"):
        wgmma_launch(fmt, x, x, x, x, None, x, group, config)
    assert promote_config(fmt, x, group, block_t) == {}


def test_promote_is_offered_where_it_runs_and_refused_with_long_groups():
    """`promote_config`: int4 (asymmetric, symmetric), groups of 128 and 256, bf16, up to 32
    tokens, with unrolled groups of 2 chunks; groups of 8 chunks spill: refused."""
    from qshard.kernels.w4a16.register_wgmma import PROMOTE_MAX_T, promote_config
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch

    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    for fmt, group in ((0, 128), (1, 256)):
        assert promote_config(fmt, x, group, PROMOTE_MAX_T) == {"PROMOTE": 1, "GROUP_CHUNKS": 2}
    config = {"BLOCK_T": 32, "STEPS": 1, "PROMOTE": 1, "GROUP_CHUNKS": 8}
    with pytest.raises(ValueError, match="GROUP_CHUNKS 4"):
        wgmma_launch(0, x, x, x, x, None, x, 128, config)


def test_where_it_cannot_run_it_says_why(monkeypatch):
    """The register kernels' rules first (a CPU tensor here), then its own: whole 128-column
    chunks (its permuted x and boxes) and at most 128 tokens."""
    from qshard.kernels.w4a16 import register

    x = torch.zeros(16, 256, dtype=torch.bfloat16)
    assert wgmma_problem(0, x, x, 128) is not None
    monkeypatch.setattr(register, "problem", lambda *args: None)
    assert wgmma_problem(0, x, x, 128) is None
    assert "K % 128 == 0" in wgmma_problem(0, x[:, :224], x, 32)
    assert "up to 128 tokens" in wgmma_problem(0, torch.zeros(129, 256), x, 128)


# ---- on a Hopper GPU ---------------------------------------------------------------------------

hopper = pytest.mark.skipif(not HOPPER, reason="the register kernel runs on Hopper (sm_90)")


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,group,n,k", CASES, ids=str)
def test_matches_the_reference(name, group, n, k, dtype):
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch

    fmt, q, s, z, g, reference = _weight(name, group, n, k)
    bias = torch.randn(n, device="cuda", dtype=dtype)
    for m in (3, 16, 20, 33, 64, 100, 128):  # token tiles 16..128; partial tiles
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        assert wgmma_problem(fmt, x, q, group) is None
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        b = bias if m % 2 else None
        got = wgmma_launch(fmt, x, q, s, z, b, out, group, global_scale=g)
        err = relative_error(got, reference(x, b))
        assert err <= MAX_RELATIVE_ERROR[dtype], f"M={m}: {err:.2e} > {MAX_RELATIVE_ERROR[dtype]}"


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name,group,n,k",
    [
        ("int4-asym", 128, 1000, 4096),
        ("int4-sym", 128, 200, 1024),
        ("int4-fzero", 128, 96, 128),
        ("int4-asym", 256, 4160, 14336),
    ],
    ids=str,
)
def test_native_codes_match_the_reference(name, group, n, k, dtype):
    """NATIVE = 1: the codes in `native_codes`' order, x unpermuted by TMA at every tile."""
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch

    fmt, q, s, z, g, reference = _weight(name, group, n, k)
    native = native_codes(q)
    for m in (1, 3, 16, 20, 33, 64, 128):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        config = {**wgmma_config(m, n, k, x.device), "NATIVE": 1}
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        got = wgmma_launch(fmt, x, native, s, z, None, out, group, config, g)
        err = relative_error(got, reference(x, None))
        assert err <= MAX_RELATIVE_ERROR[dtype], f"M={m}: {err:.2e} > {MAX_RELATIVE_ERROR[dtype]}"


@hopper
@pytest.mark.parametrize(
    "name,group,n,k",
    [("int4-asym", 128, 1000, 4096), ("int4-sym", 256, 200, 1024), ("int4-asym", 256, 333, 768)],
    ids=str,
)
def test_promoted_sums_match_the_reference(name, group, n, k):
    """PROMOTE (the weights decoded unscaled, each chunk's sums times its rows' scales in
    fp32), canonical and native codes, 1-32 tokens (partial token tiles), a bias, partial
    row tiles, items of 1 to all chunks: against the reference (the weight rounded to bf16),
    different from the scaled weights' sums, and nearer the exact product (the weight in
    fp32) than they are over the cases (one rounding less; measured 1.66e-3 against 2.2e-3 on
    the Llama shapes)."""
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch
    from qshard.kernels.w4a16.register_wgmma import promote_config

    fmt, q, s, z, _, reference = _weight(name, group, n, k)
    zero = z if fmt == 0 else z[:0]  # symmetric: no zeros (z is a placeholder)
    exact_weight = int4.dequantize_int4(q, s, zero, group, k, torch.float32).double()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    chunks = k // 128
    errors = {"promoted": 0.0, "scaled weights": 0.0}
    for native, codes in ((0, q), (1, native_codes(q))):
        # the default split (items of one group of 2 chunks on these shapes), K unsplit (several
        # groups per item, the scales handed on between groups, SPLIT off), and items of 3 and
        # 1 chunks (a group and the one-chunk remainder; the remainder alone)
        for m, steps in ((1, None), (2, chunks), (7, 3), (16, None), (17, 1), (32, chunks)):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            plain = {**wgmma_config(m, n, k, x.device), "NATIVE": native}
            if steps is not None:
                plain["STEPS"] = steps
            promoted = {**plain, **promote_config(fmt, x, group, plain["BLOCK_T"])}
            assert promoted["PROMOTE"] == 1
            got, base = (
                wgmma_launch(
                    fmt,
                    x,
                    codes,
                    s,
                    z,
                    bias,
                    torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
                    group,
                    c,
                )
                for c in (promoted, plain)
            )
            assert not torch.equal(got, base), (native, m)  # PROMOTE did run
            err = relative_error(got, reference(x, bias))
            assert err <= MAX_RELATIVE_ERROR[torch.bfloat16], (native, m, err)
            exact = x.double() @ exact_weight.T + bias.double()
            errors["promoted"] += relative_error(got, exact)
            errors["scaled weights"] += relative_error(base, exact)
    assert errors["promoted"] <= 0.95 * errors["scaled weights"], errors


@hopper
@pytest.mark.parametrize("by_tma", [0, 1])
def test_x_strided_or_offset(by_tma):
    """The producer copies x's rows in 4-byte pieces from a contiguous, 16-byte aligned x (a
    column slice, strided, and a view one element in, 2 bytes off, are copied first); by TMA
    from the permuted copy, made from any x."""
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch

    fmt, q, s, z, _, reference = _weight("int4-sym", 128, 520, 1024)
    wide = torch.randn(24, 1152, device="cuda", dtype=torch.bfloat16)
    flat = torch.randn(24 * 1024 + 1, device="cuda", dtype=torch.bfloat16)
    config = {**wgmma_config(24, 520, 1024, wide.device), "X_BY_TMA": by_tma}
    for x in (wide[:, 128:], flat[1:].view(24, 1024)):
        assert not x.is_contiguous() or x.data_ptr() % 16
        out = torch.empty(24, 520, device="cuda", dtype=torch.bfloat16)
        got = wgmma_launch(fmt, x, q, s, z, None, out, 128, config)
        assert relative_error(got, reference(x, None)) <= MAX_RELATIVE_ERROR[torch.bfloat16]


@hopper
@pytest.mark.parametrize("steps", [1, 2, 3, 5, 32])
def test_every_split_and_ring_wrap(steps):
    """Items of 1..32 chunks (split K, and a ring of STAGES slots wrapped within an item)."""
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch

    fmt, q, s, z, _, reference = _weight("int4-asym", 128, 1000, 4096)
    for m, stages in ((24, 2), (64, 3), (128, 5)):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        config = {**wgmma_config(m, 1000, 4096, x.device), "STEPS": steps, "STAGES": stages}
        out = torch.empty(m, 1000, device="cuda", dtype=torch.bfloat16)
        got = wgmma_launch(fmt, x, q, s, z, None, out, 128, config)
        assert relative_error(got, reference(x, None)) <= MAX_RELATIVE_ERROR[torch.bfloat16]


@hopper
@pytest.mark.parametrize(
    "n,k,m", [(28672, 4096, 16), (4096, 14336, 32), (28672, 4096, 64), (4096, 14336, 128)], ids=str
)
def test_the_same_bits_on_every_run(n, k, m):
    """20 launches equal the first bit for bit: x copied by the producer's cp.async (16, 32
    tokens) and by TMA (64, 128), on the Llama shapes that fill the GPU."""
    from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch

    fmt, q, s, z, _, reference = _weight("int4-asym", 128, n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    first = wgmma_launch(
        fmt, x, q, s, z, None, torch.empty(m, n, device="cuda", dtype=torch.bfloat16), 128
    )
    assert relative_error(first, reference(x, None)) <= MAX_RELATIVE_ERROR[torch.bfloat16]
    for run in range(20):
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        assert torch.equal(wgmma_launch(fmt, x, q, s, z, None, out, 128), first), f"run {run}"


@hopper
def test_the_op_chooses_it_and_tp_cuts_run_on_it():
    """`qshard.ops.int4_linear` on Hopper runs the wgmma kernel where `wgmma_chosen` (on this
    4M-element weight 9..128 tokens) and K % 128 == 0, else the other kernels; TP shards run on
    it (`assert_tp_cuts_run_on`)."""
    import qshard
    from qshard.kernels.w4a16.format import Format
    from qshard.kernels.w4a16.select import WGMMA_CHOICE_MAX_M, choose

    lin = torch.nn.Linear(4096, 1024, bias=True, device="cuda", dtype=torch.bfloat16)
    qshard.quantize_(lin, qshard.Int4WeightOnlyConfig(group_size=128))
    # The canonical codes, which these kernels read (int4 weights with groups below 128, TP cuts
    # re-grouped; on Hopper a g128 weight holds the native order: tests/layouts/test_int4_native.py)
    lin.weight = torch.nn.Parameter(lin.weight.canonical(), requires_grad=False)
    w = lin.weight
    for m, want in (
        (8, "register_ws"),
        (9, "register_wgmma"),
        (64, "register_wgmma"),
        (WGMMA_CHOICE_MAX_M, "register_wgmma"),
        (WGMMA_CHOICE_MAX_M + 1, "dequantize"),
    ):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        kernel = choose(Format.INT4_ASYM, x, w.qdata, 128).kernel
        assert kernel == want, (m, kernel)
        ref = int4.int4_linear_reference(x, w.qdata, w.scale, w.zero, 128, lin.bias)
        assert relative_error(lin(x), ref) <= MAX_RELATIVE_ERROR[torch.bfloat16]
    x = torch.randn(48, 4096, device="cuda", dtype=torch.bfloat16)
    odd = x[:, :4064]  # K % 128 != 0: the Triton kernel
    assert choose(Format.INT4_ASYM, odd, w.qdata[:, :2032], 32).kernel == "small_m"
    assert_tp_cuts_run_on("register_wgmma", w, x)


@hopper
@pytest.mark.parametrize("name", ["mxfp4", "nvfp4"])
def test_the_op_runs_fp4_on_it(name):
    assert_the_op_runs_fp4_on("register_wgmma", name, 40)


@hopper
def test_compiled_and_cuda_graphs():
    """At 20 and 100 tokens compiled, 24 graphed: the codes' descriptor, the split-K buffers
    (and from 64 tokens the permuted x) are made per call, inside the op."""
    assert_compiled_and_graphed((20, 100), 24)
