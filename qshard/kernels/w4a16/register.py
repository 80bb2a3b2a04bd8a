"""Register-operand W4A16 kernel for Hopper, in Gluon (`triton.experimental.gluon`): the
dequantized 4-bit weight (int4, MXFP4, NVFP4) feeds the tensor cores from registers (mma.sync's
A operand), read straight from qshard's canonical packing, no device form (notes and
measurements: docs/kernels/w4a16_register.md).

out^T = W x^T with the weight rows on the MMA's M side ("swap AB", as Marlin): a program's tile
is 16 x WARPS weight rows (4 or 8 warps) by BLOCK_M tokens, over STEPS chunks of 128 columns.

**The K permutation that makes the canonical packing an MMA operand.** An MMA sums over K in any
order, as long as both operands use the same one. Thread (g, t) = (lane / 4, lane % 4) of a warp
loads 16 contiguous bytes of its rows g and g + 8 per chunk: columns 32t .. 32t + 31 (one
LDG.128 each). mma.sync's m16n8k16 A fragment gives that thread logical columns 2t, 2t + 1,
2t + 8, 2t + 9 of each 16, so logical column k = 32j + 8b + 2t + h of a chunk is taken to be
actual column a = 32t + 8j + 2b + h (j: the thread's word, b: the byte in it, h: the nibble):
every thread's fragments are exactly the bytes it loaded, decoded in place. The activations are
given the same permutation on their way into shared memory: 16-byte pieces of x (8 columns,
32t + 8j .. + 7) are copied by cp.async to [j][:, 8t] of the chunk's four 32-column shared
tiles, so that each thread reads its B fragments (tokens g, g + 8, ...; the same 8 columns)
with one conflict-free LDS.128 per 8 tokens and per 32 columns.
With the weight in qshard's own packing there is no device form: the kernel runs on any slice,
shard or loaded weight, and the weight's memory is not doubled.

**The decode** (per 32-bit word, 8 codes; PTX in `_DECODE_BF16`): byte b's two nibbles placed
16 bits apart by one PRMT (the word and the word >> 4) and masked into the low mantissa bits of
bf16 128.0 by one LOP3: the pair (128 + u, 128 + u'); then bf16x2 FMAs: (v - (128 + zero)),
exact, times the scale, rounded once: the reference's weight bit for bit. For fp16 activations
and float zero points the product is formed in fp32 ((u - z) * s exact, + zero rounded once)
and converted to the activation dtype: the reference's two roundings, also bit for bit.

**The pipeline.** A work item is (row tile, K split of STEPS chunks). Programs loop over items
(a persistent grid), streaming their chunks through a ring of STAGES shared-memory slots by
cp.async (each slot: the tile's codes, each thread copying the 16-byte runs it will decode, and
x's chunk in one copy), STAGES - 1 chunks in flight, across item boundaries and the epilogue;
the scales of the next item are loaded into registers an item ahead. STEPS is a multiple of
STAGES, so each chunk's slot is known at compile time and each slot is its own buffer: Triton's
shared-memory hazard analysis, which cannot tell slots of one buffer apart, then adds no
barrier of its own (with one shared x buffer it added four per chunk, the largest stall on the
H100: docs/kernels/w4a16_register.md, "The mma.sync register kernel (`w4a16/register.py`)").
Split K: fp32 partial sums, the last program of a tile to arrive sums them in split order and
writes the tile (`split_k.py`).

Scope: Hopper (sm_90; mma.sync would run on sm_80 too, but the configs and the choice against
the Triton kernels were measured on an H100 only), bf16 or fp16 activations, 2..128 tokens (the
op chooses it for 2..7, and for 8..12 where K % 128 != 0: w4a16/; its warp-specialized
form, w4a16/register_ws.py, runs 8..16 tokens),
int4 asymmetric / symmetric / float zero point with groups of 32..256, MXFP4 (groups of 32),
NVFP4 (groups of 16), K a multiple of 32. MXFP4's e2m1 * 2**E is formed exactly and rounded
once to the activation dtype (exact in bf16; in fp16 it can underflow or overflow), so its
weights are the reference's bit for bit; NVFP4's e2m1 * e4m3 is exact in both, and
its global scale multiplies the sums (as the Triton kernels do) where the reference rounds
each weight times it: equal within the tests' tolerance, not bit for bit. Elsewhere
the Triton kernels run, chosen inside the same `torch.library` op (`select.py`).
Gluon kernels do not run in the Triton interpreter: CI compiles them for sm_90 (no GPU needed)
and checks the permutation and the decode in PyTorch; their numerics are tested on the GPU.
"""

from __future__ import annotations

import torch
import triton

from ..gluon_api import (
    CHUNK,
    GLUON_IMPORT_ERROR,
    async_copy,
    barrier,
    cp_async,
    gl,
    gluon,
    gluon_unavailable,
    mma_v2,
)
from ..split_k import sm_count, workspace
from .register_parts import (
    ROWS_PER_WARP,
    b_operand,
    chunk_scales,
    chunk_weights,
    codes_layout,
    finish_tile,
    item_at,
    x_layout,
)

__all__ = ["REGISTER_MAX_M", "config", "launch", "problem"]

REGISTER_MIN_M, REGISTER_MAX_M = 2, 128
REGISTER_GROUPS = (32, 64, 128, 256)  # a 32-column word run never crosses a group
INT4_FORMATS = (0, 1, 2)  # Format.INT4_ASYM, INT4_SYM, INT4_FZERO (w4a16/format.py's `Format`)
MXFP4 = 3  # Format.MXFP4: e2m1 codes, an e8m0 scale per 32 columns
NVFP4 = 4  # Format.NVFP4: e2m1 codes, an e4m3 scale per 16 columns, one fp32 global scale
FP4_GROUPS = {MXFP4: 32, NVFP4: 16}  # each format's own group (a TP cut keeps it)


def problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """Why the register kernel cannot run this matmul, or None if it can."""
    if gluon_unavailable() is not None:
        return gluon_unavailable()
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the register kernel is built and measured for Hopper (sm_90) only"
    m, k = x.shape
    if fmt not in (*INT4_FORMATS, MXFP4, NVFP4):
        return f"the register kernel covers the int4, MXFP4 and NVFP4 formats, not {fmt}"
    if fmt in FP4_GROUPS and group != FP4_GROUPS[fmt]:
        return f"MXFP4 has groups of 32 columns and NVFP4 of 16, not {group}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"it multiplies bf16 or fp16 activations, not {x.dtype}"
    if not REGISTER_MIN_M <= m <= REGISTER_MAX_M:
        return f"it runs {REGISTER_MIN_M}..{REGISTER_MAX_M} tokens, not {m}"
    if fmt in INT4_FORMATS and group not in REGISTER_GROUPS:
        return f"it takes groups of {list(REGISTER_GROUPS)} columns, not {group}"
    if k % 32 or qdata.data_ptr() % 16 or x.data_ptr() % 16:
        return "it reads 16-byte runs of codes and activations: K % 32 == 0, 16-byte aligned"
    return None


def config(m: int, n: int, k: int, device: torch.device) -> dict:
    """BLOCK_M tokens per tile, STEPS chunks of 128 columns per work item, a ring of STAGES
    chunks, PER_SM programs per SM (persistent grid) of WARPS warps (16 weight rows each),
    registers capped at MAXNREG (0: no cap) so that PER_SM programs fit. Up to 16 tokens:
    8 / 4 / 2 programs of 8 warps under 128 registers, the best single config of an H100 sweep
    of 8-warp configs on the Llama-3.1-8B layer (docs/kernels/w4a16_register.md, "The mma.sync
    register kernel (`w4a16/register.py`)"). 32 and 64 tokens: the best of that sweep; 128: 8 / 2
    / 1 of 4 warps, the best of the three configs that fit in shared memory in an H100 sweep of
    4-warp programs (the 8-warp sweep stopped at 64). The op does not choose them (the Triton
    kernel is faster there)."""
    block_m = 8 if m <= 8 else max(16, triton.next_power_of_2(m))
    steps, stages, per_sm, warps, maxnreg = _CONFIGS[block_m]
    return {
        "BLOCK_M": block_m,
        "STEPS": steps,
        "STAGES": stages,
        "PER_SM": per_sm,
        "WARPS": warps,
        "MAXNREG": maxnreg,
    }


_config = config  # (`launch`'s parameter of that name hides the function)

# BLOCK_M -> (STEPS, STAGES, PER_SM, WARPS, MAXNREG); see `config`
_CONFIGS = {
    8: (8, 4, 2, 8, 128),
    16: (8, 4, 2, 8, 128),
    32: (16, 4, 1, 8, 0),
    64: (16, 4, 1, 8, 0),
    128: (8, 2, 1, 4, 0),
}


def launch(
    fmt: int,
    x,
    qdata,
    scale,
    zero,
    bias,
    out,
    group: int,
    config: dict | None = None,
    global_scale=None,
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ W.T + bias by the register kernel (`problem` is None);
    x, qdata, scale, zero, bias contiguous; `zero` any tensor for the symmetric and FP4
    formats; `global_scale` NVFP4's fp32 scalar (read in the zero's place)."""
    m, k = x.shape
    n = qdata.shape[0]
    config = dict(config or _config(m, n, k, x.device))
    block_m, steps, per_sm = config["BLOCK_M"], config["STEPS"], config["PER_SM"]
    warps, stages = config.get("WARPS", 4), config["STAGES"]
    if (
        steps % stages
        or stages < 2
        or block_m not in _CONFIGS
        or block_m < m
        or per_sm < 1
        or warps not in (4, 8)
    ):
        raise ValueError(
            f"register kernel config {config} for {m} tokens: STEPS must be a "
            f"multiple of STAGES >= 2 (each chunk's ring slot is fixed at compile "
            f"time), BLOCK_M one of {sorted(_CONFIGS)} and >= the tokens, PER_SM "
            f">= 1, WARPS 4 or 8"
        )
    tiles = triton.cdiv(n, ROWS_PER_WARP * warps)
    splits = triton.cdiv(triton.cdiv(k, CHUNK), steps)
    items = tiles * splits
    grid = min(items, per_sm * sm_count(x.device.index or 0))
    partials, arrived = workspace(m, n, splits, tiles, x.device) if splits > 1 else (out, out)
    if fmt in (MXFP4, NVFP4):  # e8m0 / e4m3 bytes, read as such in-kernel (a masked load of
        scale = scale.view(torch.uint8)  # fp8 cannot take a default value)
    if fmt == NVFP4:
        if global_scale is None:
            raise ValueError("NVFP4 needs its fp32 global scale: pass global_scale")
        zero = global_scale
    _register_kernel[(grid,)](
        x,
        qdata.view(torch.int32),
        scale,
        zero,
        bias if bias is not None else out,
        out,
        partials,
        arrived,
        m,
        n,
        k,
        k // 32,
        scale.stride(0),
        splits,
        FORMAT=fmt,
        GROUP=group,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        STEPS=steps,
        STAGES=stages,
        BLOCK_M=block_m,
        num_warps=warps,
        **({"maxnreg": config["MAXNREG"]} if config.get("MAXNREG") else {}),
    )
    return out


# ---- the kernel --------------------------------------------------------------------------------

if GLUON_IMPORT_ERROR is None:
    _CHUNK = gl.constexpr(CHUNK)
    _ROWS_PER_WARP = gl.constexpr(ROWS_PER_WARP)

    @gluon.jit
    def _issue_chunk(
        q_ptr, x_ptr, codes, x_slot, at, step: gl.constexpr, K, KW4, BLOCK_M: gl.constexpr
    ):
        """cp.async of chunk `step` of the item at `at` (`item_at`) into one ring slot
        (`codes` [rows, 4, 4], `x_slot` [4 BLOCK_M, 32]): the tile's code words (each thread
        copies the 16 bytes it will decode) and x's chunk; one commit group."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        CODES: gl.constexpr = codes_layout(gl.num_warps())
        RUNS: gl.constexpr = gl.SliceLayout(2, CODES)
        row0, chunk0, n_live, m_live = at
        chunk = chunk0 + step
        m = gl.arange(0, TILE_ROWS, layout=gl.SliceLayout(1, RUNS))
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, RUNS))
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, CODES)))
        rows = row0 + m
        col = chunk * _CHUNK + 32 * t  # each thread's 32-column run
        ok = (rows < n_live)[:, None] & (col < K)[None, :]
        run = rows[:, None] * (KW4 * 4) + (col // 8)[None, :]  # the run's first word
        cp_async(codes, q_ptr + run[:, :, None] + j[None, None, :], mask=ok[:, :, None])
        _copy_x(x_ptr, x_slot, chunk, m_live, K, BLOCK_M)
        async_copy.commit_group()

    @gluon.jit
    def _item_scales(
        s_ptr,
        z_ptr,
        at,
        K,
        stride_sn,
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        STEPS: gl.constexpr,
        dtype: gl.constexpr,
    ):
        """The scales and zeros of the item at `at` (`item_at`), a tuple of STEPS
        `chunk_scales` (loaded an item ahead)."""
        out = ()
        for st in gl.static_range(STEPS):
            scales = chunk_scales(s_ptr, z_ptr, at, st, K, stride_sn, FORMAT, GROUP, dtype)
            out = out + (scales,)  # noqa: RUF005 (Triton builds tuples so)
        return out

    @gluon.jit
    def _copy_x(x_ptr, x_slot, chunk, M, K, BLOCK_M: gl.constexpr):
        """cp.async of x[:, chunk] into x_slot [4 j, BLOCK_M, 32], in one copy (separate
        copies into one buffer would each get a barrier from Triton's hazard analysis): the
        8-column piece 32t + 8j of the chunk goes to [j][:, 8t] (tokens >= M, columns >= K
        zero-filled)."""
        XC: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [gl.num_warps(), 1, 1], [2, 1, 0])
        r = gl.arange(0, 4 * BLOCK_M, layout=gl.SliceLayout(1, gl.SliceLayout(2, XC)))[:, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, XC)))[None, :]
        e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, XC)))[None, None, :]
        j, n = r // BLOCK_M, r % BLOCK_M  # [4 j x BLOCK_M n] rows of the slot
        col = chunk * _CHUNK + 8 * j + 32 * t  # the piece's first column
        ok = (n < M) & (col < K)
        src = x_ptr + (n * K + col)[:, :, None] + e
        cp_async(x_slot.reshape([4 * BLOCK_M, 4, 8]), src, mask=ok[:, :, None])

    @gluon.jit
    def _chunk_mma(
        acc,
        codes,
        x_slot,
        scale,
        zero,
        FORMAT: gl.constexpr,
        BLOCK_M: gl.constexpr,
        dtype: gl.constexpr,
    ):
        """acc + one chunk of the weight (decoded from its ring slot) @ x's chunk."""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, 8]
        )
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        words = codes.load(codes_layout(gl.num_warps()))  # the 16 bytes this thread copied
        for j in gl.static_range(4):
            a = gl.convert_layout(
                chunk_weights(words, scale, zero, j, FORMAT, dtype), A, assert_trivial=True
            )
            x = x_slot.slice(j * BLOCK_M, BLOCK_M).load(x_layout(BLOCK_M, gl.num_warps()))
            b = gl.convert_layout(b_operand(x, BLOCK_M), B, assert_trivial=True)
            acc = mma_v2(a, b, acc)
        return acc

    @gluon.jit
    def _register_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        z_ptr,
        bias_ptr,
        out_ptr,
        part_ptr,
        cnt_ptr,
        M,
        N,
        K,
        KW4,
        stride_sn,
        splits,
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
        STEPS: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        """A persistent loop over this program's work items, their chunks streamed through a
        ring of STAGES shared-memory slots by cp.async, STAGES - 1 chunks in flight (module
        docstring). STEPS is a multiple of STAGES, so every chunk's slot is known at compile
        time: each slot is its own buffer, and Triton's hazard analysis, which cannot tell
        slots of one buffer apart, adds no barrier between a copy into one slot and the reads
        of another (the one explicit barrier per chunk orders them)."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, 8]
        )
        # x: [j] x [BLOCK_M, 32]: 64-byte rows, so lanes 0-7 of a B read (tokens g and g + 1,
        # 16 bytes at 8t) cover 128 bytes: no bank conflict, no swizzle needed; the codes:
        # each thread reads back the 16-byte runs it copied (512 contiguous per warp)
        XS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        CS: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
        dtype: gl.constexpr = x_ptr.dtype.element_ty
        gl.static_assert(STEPS % STAGES == 0, "a work item's chunks fill the ring exactly")
        tiles = gl.cdiv(N, TILE_ROWS)
        items = tiles * splits
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        my_items = gl.cdiv(items - pid, programs)
        codes = ()
        xs = ()
        for _slot in gl.static_range(STAGES):
            codes = codes + (gl.allocate_shared_memory(gl.int32, [TILE_ROWS, 4, 4], CS),)  # noqa: RUF005
            xs = xs + (gl.allocate_shared_memory(dtype, [4 * BLOCK_M, 32], XS),)  # noqa: RUF005
        if FORMAT == 4:  # noqa: SIM108 (a constexpr branch: no load for the other formats)
            # NVFP4's global scale (in the zero's place), applied to the sums
            times = gl.load(z_ptr).to(gl.float32)
        else:
            times = 1.0
        here = item_at(pid, items, tiles, N, M, STEPS)
        for first in gl.static_range(STAGES - 1):
            _issue_chunk(q_ptr, x_ptr, codes[first], xs[first], here, first, K, KW4, BLOCK_M)
        scales = _item_scales(s_ptr, z_ptr, here, K, stride_sn, FORMAT, GROUP, STEPS, dtype)
        for it in range(my_items):
            item = pid + it * programs
            after = item_at(item + programs, items, tiles, N, M, STEPS)
            next_scales = _item_scales(
                s_ptr, z_ptr, after, K, stride_sn, FORMAT, GROUP, STEPS, dtype
            )
            acc = gl.zeros([TILE_ROWS, BLOCK_M], gl.float32, MMA)
            for st in gl.static_range(STEPS):
                async_copy.wait_group(STAGES - 2)  # chunk st's copies have landed (this thread's)
                barrier()  # everyone's have; and everyone is done with the slot refilled next
                # the chunk to issue: st + STAGES - 1 of this item, or of the next one
                _issue_chunk(
                    q_ptr,
                    x_ptr,
                    codes[(st + STAGES - 1) % STAGES],
                    xs[(st + STAGES - 1) % STAGES],
                    here if st + STAGES - 1 < STEPS else after,
                    (st + STAGES - 1) % STEPS,
                    K,
                    KW4,
                    BLOCK_M,
                )
                scale, zero = scales[st]
                acc = _chunk_mma(
                    acc, codes[st % STAGES], xs[st % STAGES], scale, zero, FORMAT, BLOCK_M, dtype
                )
            finish_tile(
                acc,
                part_ptr,
                cnt_ptr,
                bias_ptr,
                out_ptr,
                item % tiles,
                item // tiles,
                splits,
                M,
                N,
                times,
                HAS_BIAS,
                SPLIT,
                BLOCK_M,
            )
            scales = next_scales
            here = after
