"""The register-operand W4A16 kernel on wgmma (issue 24; notes and measurements:
docs/kernels/w4a16_register.md, "The wgmma kernel (`w4a16/register_wgmma.py`)"): the dequantized
weight is wgmma's register A operand, x's chunk its shared-memory B operand, the MMAs
asynchronous, so that a chunk's decode runs while the previous chunk's MMAs do. Read
`w4a16/register.py`'s docstring first (the K permutation, the decode, the scales) and
`w4a16/register_ws.py`'s (the warp-specialized ring).

**Why x must be permuted, and the two ways it is.** mma.sync (`register.py`, `register_ws.py`)
takes B from registers, so those kernels give x the canonical packing's K permutation on its way
into shared memory, 16 bytes at a time. wgmma reads B from shared memory in its own K order, in
which each thread's A fragment holds logical columns 2t, 2t + 1, 2t + 8, 2t + 9 of every 16: with
the weight decoded from the canonical packing in place, B's row for MMA column 32j + 8b + 2t + h
must hold x's actual column 32t + 8j + 2b + h of the chunk, a permutation of 4-byte pairs, finer
than a TMA box (16 bytes) can make. Below X_BY_TMA_MIN_T tokens (token tiles of 16 and 32) the
producer, four warps, copies x's chunk by 4-byte cp.async straight into that order (`_copy_x`); from
it (tiles of 64 and 128) the launcher writes x once in that order (`permute_x`, one M x K copy,
2.3-5.9 us on the Llama linears) and the producer copies it by TMA boxes: there the producer's
copies, 4-8 times as many as at 16 tokens, were slower than the copy made beforehand (H100: the
layer at 64 tokens 128.4 against 116.4 us). Either way the slots are 128-byte-swizzled and wgmma
reads them as they are.

**The native code order (config NATIVE = 1).** Codes repacked once by `packing.native_codes`
(per 128-column chunk, thread t's word j holds the 8 codes of MMA columns 32 j + 8 b + 2 t + h
with pair b as nibbles b and b + 4) decode into x's own columns: x needs no permutation and TMA
copies it at every tile, and each pair is one shift and one and-or
(`_DECODE_PAIRS_NATIVE`) instead of a byte permute and an and-or. Measured (H100, the Llama
layer, int4 g128): 77.7 / 83.0 / 98.7 us at 16 / 32 / 64 tokens against 85.2 / 94.9 / 115.2 on
the canonical codes (docs/kernels/w4a16_register.md, "The native code order (int4 with groups
of 128 on Hopper)"). An int4 weight with groups of 128 on Hopper holds its codes in that order
(layouts/int4.py), and the op runs this config on it (`w4a16/select.py's `choose``).

**Sums scaled per chunk (config PROMOTE = 1; int4 asymmetric / symmetric, groups of a multiple
of 128, bf16 x, token tiles up to 32).** A chunk lies in one group, so a row's scale is one
number per chunk: the weights are decoded unscaled (u - z: an integer of -15..15, exact in
bf16; `_DECODE_BF16_UNSCALED`, one bf16 multiply per pair fewer), each chunk's two wgmmas go
into a fresh accumulator, and once they are done (the wait the ring already makes for the
previous chunk) the accumulator is added to the tile's sums times its rows' fp32 scales: 8
FFMAs a chunk and thread at 16 tokens against 32 HMUL2. The weight is not rounded to bf16
before the product, so the sums are nearer the exact product. Measured (the Llama layer on
native codes, H100): 77.3 -> 75.0 us at 16 tokens, 73.4 with groups of 2 chunks
(`promote_config`, what the op runs on native int4 codes up to 32 tokens); at BLOCK_T 64 the
consumers spill.

The program: a 128-row tile of two 64-row halves, one consumer warpgroup each (wgmma's M is 64
per warpgroup), and the producer streaming each chunk (the tile's code words, x's chunk as
two 64-column halves) into a ring of STAGES slots. Per chunk a consumer waits for the slot
(then fences, where x came by cp.async: the generic proxy, which wgmma's async reads must
follow), reads its half's code words (LDS), decodes them into the A operand ([64 rows, 64
columns] twice), issues the two wgmmas asynchronously, then waits until only those two are in
flight: the previous chunk's are done, so its slot is released (a proxy fence first: the codes
were read by the generic proxy, and TMA refills the slot) and its A registers are free (they
are the wait's dependencies until then, so the compiler keeps them). The chunks run in unrolled
groups of GROUP_CHUNKS inside a loop, every MMA waited for at a group's end: ptxas serializes
all of the kernel's wgmmas if one with register operands is in flight across a loop's back
edge, and fully unrolled items of 16-32 chunks missed the instruction cache. The tile is
written as the FP8 Gluon kernel's halves are (`finish_half`: split K with fp32 partial sums, a
counter per half).

Measured (H100, int4 g128, bf16, Llama-3.1-8B layer; docs/kernels/w4a16_register.md, "The
wgmma kernel (`w4a16/register_wgmma.py`)"): 16 / 32 / 64 / 128 tokens 85.7 / 94.6 / 115.5 / 160.1
us against bf16's 167.7 / 167.9 / 169.3 / 178.6; the op runs it where it was the faster
(`w4a16/select.py's `wgmma_chosen``).

Scope: Hopper, bf16 / fp16 activations, the int4 formats with groups of 32..256, MXFP4, NVFP4,
K % 128 == 0 (x is permuted per 128-column chunk), 16-byte aligned codes.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..gluon_api import (
    CHUNK,
    GLUON_IMPORT_ERROR,
    HALF_ROWS,
    SMEM_BUDGET,
    TILE_ROWS,
    TensorDescriptor,
    async_copy,
    cp_async,
    fence_async_shared,
    finish_half,
    gl,
    gluon,
    half_tile_workspace,
    mbarrier,
    reinterpret,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ..packing import check_native_order, native_codes
from ..split_k import sm_count
from . import register
from .register import MXFP4, NVFP4
from .register_parts import chunk_scales, chunk_weights, codes_2d, codes_layout

__all__ = [
    "WGMMA_BLOCK_T",
    "config",
    "launch",
    "native_codes",
    "permute_x",
    "problem",
    "promote_config",
    "tma_ready",
]

WORDS = CHUNK // 8  # int32 code words per row and chunk
WGMMA_BLOCK_T = (16, 32, 64, 128)  # token tiles (wgmma's N); 128: 64 accumulator registers
X_BY_TMA_MIN_T = 64  # token tiles from which x is permuted beforehand and copied by TMA
GROUP_CHUNKS = 4  # chunks per unrolled group (`_chunk_group`); the MMAs drain between groups
PROMOTE_FORMATS = (0, 1)  # int4 asymmetric, symmetric: u - z is exact in bf16
# PROMOTE keeps a fresh accumulator per chunk: the consumers spill (sm_90 SASS) at BLOCK_T 64,
# and at BLOCK_T 32 with unrolled groups of 8 chunks
PROMOTE_MAX_T = 32
PROMOTE_MAX_GROUP_CHUNKS = 4


def problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """Why the wgmma kernel cannot run this matmul, or None if it can."""
    reason = register.problem(fmt, x, qdata, group)
    if reason is None and x.shape[1] % CHUNK:
        reason = f"it permutes x per 128-column chunk: K % 128 == 0, not K = {x.shape[1]}"
    if reason is None and x.shape[0] > WGMMA_BLOCK_T[-1]:
        reason = f"it takes up to {WGMMA_BLOCK_T[-1]} tokens, not {x.shape[0]}"
    return reason


def promote_config(fmt: int, x: torch.Tensor, group: int, block_t: int) -> dict:
    """PROMOTE (module docstring) where it runs, with the unrolled groups of 2 chunks measured
    fastest with it (H100, native int4 codes, the Llama layer at 2-32 tokens: 77.3 -> 73.4 us at
    16; docs/kernels/w4a16_register.md, "The wgmma kernel (`w4a16/register_wgmma.py`)"); else
    nothing."""
    if _promotes(fmt, group, x.dtype) and block_t <= PROMOTE_MAX_T:
        return {"PROMOTE": 1, "GROUP_CHUNKS": 2}
    return {}


def _promotes(fmt: int, group: int, dtype: torch.dtype) -> bool:
    """Whether a row's scale is one number per chunk and u - z is exact in x's dtype: int4
    (asymmetric, symmetric), whole groups of 128, bf16."""
    return (
        fmt in PROMOTE_FORMATS
        and group >= CHUNK
        and group % CHUNK == 0
        and (dtype == torch.bfloat16)
    )


def tma_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself where a TMA descriptor can take it (unit column stride, 16-byte aligned row
    stride and base), else a contiguous copy: a [1, K] row of a wider tensor counts as
    contiguous but keeps its parent's row stride."""
    aligned = x.stride(-1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0
    if aligned and x.data_ptr() % 16 == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 128-column chunk in wgmma's K order for the canonical packing: column
    32j + 8b + 2t + h of a chunk holds x's column 32t + 8j + 2b + h (module docstring; the order
    `_copy_x` writes a slot in, too)."""
    m, k = x.shape
    return x.view(m, k // CHUNK, 4, 4, 4, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, k)


def config(m: int, n: int, k: int, device: torch.device, sms: int | None = None) -> dict:
    """BLOCK_T tokens per tile (wgmma's N: 16, 32, 64 or 128); STEPS chunks per work item
    (tile x K split), the split count `split_for` models fastest; a ring of STAGES slots
    filling the shared memory; GROUP_CHUNKS chunks per unrolled group; X_BY_TMA: x permuted
    beforehand and copied by TMA (1) or permuted by the producer's cp.async copies (0): the
    faster at the token tile (module docstring)."""
    block_t = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, TILE_ROWS)
    chunks = triton.cdiv(k, CHUNK)
    splits = split_for(tiles, chunks, sms or sm_count(device.index or 0), block_t)
    return {
        "BLOCK_T": block_t,
        "STEPS": triton.cdiv(chunks, splits),
        "STAGES": _stages(block_t),
        "GROUP_CHUNKS": GROUP_CHUNKS,
        "X_BY_TMA": int(block_t >= X_BY_TMA_MIN_T),
    }


_config = config  # (`launch`'s parameter of that name hides the function)


@functools.lru_cache(maxsize=1024)
def split_for(tiles: int, chunks: int, programs: int, block_t: int) -> int:
    """The K split count with the shortest modelled time: the busiest program's chunks, plus
    per split item an epilogue of 2 + BLOCK_T / 32 chunks' time (its partial sums out and
    back); ties go to fewer splits, each split keeps >= 2 chunks. Cached: the search took
    0.1-0.3 ms of host time per call on the Llama shapes, against a 25 us kernel."""
    best, best_time = 1, None
    for splits in range(1, max(1, chunks // 2) + 1):
        steps = triton.cdiv(chunks, splits)
        items = tiles * triton.cdiv(chunks, steps)
        epilogue = 0 if splits == 1 else 2 + block_t // 32
        time = triton.cdiv(items, programs) * (steps + epilogue)
        if best_time is None or time < best_time:
            best, best_time = splits, time
    return best


def _stages(block_t: int) -> int:
    slot = TILE_ROWS * WORDS * 4 + block_t * CHUNK * 2  # codes + x (16-bit)
    return max(2, min(8, SMEM_BUDGET // slot))


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
    """out [M, N] = x [M, K] @ W.T + bias by the wgmma kernel (`problem` is None);
    arguments as `register.launch`; `config` as `config()` gives it."""
    m, k = x.shape
    n = qdata.shape[0]
    config = dict(config or _config(m, n, k, x.device))
    block_t, steps = config["BLOCK_T"], config["STEPS"]
    stages = config.get("STAGES") or _stages(block_t)
    group_chunks = config.get("GROUP_CHUNKS", GROUP_CHUNKS)
    native = bool(config.get("NATIVE", 0))  # qdata from `native_codes`; x as it is, by TMA
    x_by_tma = native or bool(config.get("X_BY_TMA", block_t >= X_BY_TMA_MIN_T))
    if native:
        check_native_order(fmt < MXFP4, group, f"format {fmt}")
    promote = bool(config.get("PROMOTE", 0))
    if promote and not _promotes(fmt, group, x.dtype):
        raise ValueError(
            f"wgmma W4A16 config {config} (format {fmt}, group {group}, {x.dtype}): PROMOTE "
            f"scales each chunk's sums by one scale per row, so it needs int4 (asymmetric or "
            f"symmetric) with groups of a multiple of 128 and bf16 x; drop PROMOTE"
        )
    if promote and (block_t > PROMOTE_MAX_T or group_chunks > PROMOTE_MAX_GROUP_CHUNKS):
        raise ValueError(
            f"wgmma W4A16 config {config}: with PROMOTE the consumers spill past BLOCK_T "
            f"{PROMOTE_MAX_T} or GROUP_CHUNKS {PROMOTE_MAX_GROUP_CHUNKS}; use those or fewer, "
            f"or drop PROMOTE"
        )
    if (
        block_t not in WGMMA_BLOCK_T
        or block_t < m
        or not 2 <= stages <= _stages(block_t)
        or steps < 1
        or group_chunks < 1
    ):
        raise ValueError(
            f"wgmma W4A16 config {config} for {m} tokens: BLOCK_T must be one of "
            f"{list(WGMMA_BLOCK_T)} and >= the tokens, STAGES 2..{_stages(block_t)} "
            f"(the ring fills the shared memory), STEPS and GROUP_CHUNKS >= 1"
        )
    tiles = triton.cdiv(n, TILE_ROWS)
    splits = triton.cdiv(k // CHUNK, steps)
    grid = min(tiles * splits, sm_count(x.device.index or 0))
    partials, arrived = half_tile_workspace(splits, tiles, block_t, out)
    if fmt == NVFP4:
        if global_scale is None:
            raise ValueError("NVFP4 needs its fp32 global scale: pass global_scale")
        zero = global_scale
    if fmt >= MXFP4:  # e8m0 / e4m3 bytes, decoded in-kernel
        scale = scale.view(torch.uint8)
    codes = qdata.view(torch.int32)  # [N, K / 8]
    q_desc = TensorDescriptor.from_tensor(
        codes, [TILE_ROWS, WORDS], gl.NVMMASharedLayout(0, 32, rank=2)
    )
    if x_by_tma:
        x_layout = gl.NVMMASharedLayout(128, 16, rank=2)  # 64 columns: one 128-byte swizzle row
        x_src = TensorDescriptor.from_tensor(
            tma_ready(x) if native else permute_x(x), [block_t, CHUNK // 2], x_layout
        )
    elif not x.is_contiguous() or x.data_ptr() % 16:  # the producer's 4-byte copies of rows
        x_src = x.clone(memory_format=torch.contiguous_format)
    else:
        x_src = x
    _wgmma_kernel[(grid,)](
        q_desc,
        x_src,
        scale,
        zero,
        bias if bias is not None else out,
        out,
        partials,
        arrived,
        m,
        n,
        k,
        scale.stride(0),
        splits,
        steps,
        FORMAT=fmt,
        GROUP=group,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        STAGES=stages,
        GROUP_CHUNKS=group_chunks,
        BLOCK_T=block_t,
        X_BY_TMA=x_by_tma,
        PRODUCER_WARPS=1 if x_by_tma else 4,
        NATIVE=native,
        PROMOTE=promote,
        num_warps=4,
    )
    return out


# ---- the kernel --------------------------------------------------------------------------------

if GLUON_IMPORT_ERROR is None:
    _CHUNK = gl.constexpr(CHUNK)
    _WORDS = gl.constexpr(WORDS)
    _TILE_ROWS = gl.constexpr(TILE_ROWS)
    _HALF_ROWS = gl.constexpr(HALF_ROWS)

    @gluon.jit
    def _a_operand(
        words,
        scale,
        zero,
        first: gl.constexpr,
        A: gl.constexpr,
        FORMAT: gl.constexpr,
        dtype: gl.constexpr,
        NATIVE: gl.constexpr,
        UNSCALED: gl.constexpr = False,
    ):
        """Words `first` and `first + 1` of each thread's runs decoded: the A operand [64 rows,
        64 MMA columns 32 jj + c] (c as `chunk_weights` orders a word's 32)."""
        lo = chunk_weights(words, scale, zero, first, FORMAT, dtype, NATIVE, UNSCALED)
        hi = chunk_weights(words, scale, zero, first + 1, FORMAT, dtype, NATIVE, UNSCALED)
        a = gl.reshape(gl.permute(gl.join(lo, hi), [0, 2, 1]), [_HALF_ROWS, 64])
        return gl.convert_layout(a, A, assert_trivial=True)

    @gluon.jit
    def _scales_of(
        s_ptr,
        z_ptr,
        at,
        step,
        K,
        stride_sn,
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        dtype: gl.constexpr,
        MMA: gl.constexpr,
        PROMOTE: gl.constexpr,
    ):
        """Chunk `step`'s scales and zeros in the decode's layout (`chunk_scales`); PROMOTE:
        also the scale of each of the half's 64 rows in the accumulator's layout (fp32), by
        which the chunk's sums are multiplied (one group a chunk: GROUP % 128 == 0)."""
        scales = chunk_scales(s_ptr, z_ptr, at, step, K, stride_sn, FORMAT, GROUP, dtype)
        if PROMOTE:
            row0, chunk0, n_live, _ = at
            rows = row0 + gl.arange(0, _HALF_ROWS, layout=gl.SliceLayout(1, MMA))
            col = (chunk0 + step) * _CHUNK
            ok = (rows < n_live) & (col < K)
            rows_scale = gl.load(s_ptr + rows * stride_sn + col // GROUP, mask=ok, other=0)
            scales = (scales[0], scales[1], rows_scale.to(gl.float32))
        return scales

    @gluon.jit
    def _item_chunks(item, tiles, chunks, steps):
        """Work item `item`'s first chunk and its chunk count (the last split's may be fewer)."""
        first = (item // tiles) * steps
        return first, gl.minimum(steps, chunks - first)

    @gluon.jit
    def _chunk_group(
        acc,
        codes_ring,
        x_ring,
        ready,
        empty,
        s_ptr,
        z_ptr,
        at,
        st0,
        chunk,
        ahead,
        later,
        K,
        stride_sn,
        half: gl.constexpr,
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_CHUNKS: gl.constexpr,
        BLOCK_T: gl.constexpr,
        X_BY_TMA: gl.constexpr,
        NATIVE: gl.constexpr,
        PROMOTE: gl.constexpr,
    ):
        """GROUP_CHUNKS chunks of the item at `at` from its chunk st0 (`chunk`: this consumer's
        running count, which names the ring slot and its phase): per chunk the scales two
        ahead, the wait for its slot, the decode, two asynchronous wgmmas, then the wait for
        the previous chunk's (its A operands are the wait's dependencies until then) and that
        chunk's slot released; at the group's end every MMA is waited for. ptxas serializes
        every wgmma of the kernel if one with a register operand is in flight across a loop's
        back edge ("insufficient register resources", C7512), so the groups are the unrolled
        body of the chunk loop and none crosses it. PROMOTE: the weights decoded unscaled
        (u - z, exact in bf16), each chunk's MMAs into a fresh accumulator, added to `acc`
        times its rows' scales once they are done (the previous chunk's, after the wait)."""
        MMA: gl.constexpr = acc.type.layout
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        dtype: gl.constexpr = x_ring.dtype
        for j in gl.static_range(GROUP_CHUNKS):
            scales = ahead
            ahead = later
            # (chunks past the item: loaded, not used; past K: masked)
            later = _scales_of(
                s_ptr, z_ptr, at, st0 + j + 2, K, stride_sn, FORMAT, GROUP, dtype, MMA, PROMOTE
            )
            slot = chunk % STAGES
            mbarrier.wait(ready.index(slot), (chunk // STAGES) & 1)
            if not X_BY_TMA:  # x came by cp.async (the generic proxy); wgmma reads it async
                fence_async_shared()
            words = codes_ring.index(slot).slice(half * _HALF_ROWS, _HALF_ROWS)
            words = gl.convert_layout(
                gl.reshape(words.load(codes_2d(4)), [_HALF_ROWS, 4, 4]),
                codes_layout(4),
                assert_trivial=True,
            )
            a0 = _a_operand(words, scales[0], scales[1], 0, A, FORMAT, dtype, NATIVE, PROMOTE)
            if PROMOTE:
                part = warpgroup_mma(
                    a0,
                    x_ring.index(2 * slot).permute((1, 0)),
                    gl.zeros_like(acc),
                    use_acc=False,
                    is_async=True,
                )
            else:
                acc = warpgroup_mma(a0, x_ring.index(2 * slot).permute((1, 0)), acc, is_async=True)
            a1 = _a_operand(words, scales[0], scales[1], 2, A, FORMAT, dtype, NATIVE, PROMOTE)
            if PROMOTE:
                part = warpgroup_mma(
                    a1, x_ring.index(2 * slot + 1).permute((1, 0)), part, is_async=True
                )
            else:
                acc = warpgroup_mma(
                    a1, x_ring.index(2 * slot + 1).permute((1, 0)), acc, is_async=True
                )
            if j > 0:  # the previous chunk's MMAs done: its A registers and its slot are free
                if PROMOTE:
                    done, _, _ = warpgroup_mma_wait(
                        num_outstanding=2,
                        deps=(last_part, last0, last1),  # noqa: F821
                    )
                    acc += done * last_scales[2][:, None]  # noqa: F821
                else:
                    acc, _, _ = warpgroup_mma_wait(num_outstanding=2, deps=(acc, last0, last1))  # noqa: F821 (j - 1)
                fence_async_shared()  # its codes were read by LDS; TMA refills the slot
                mbarrier.arrive(empty.index(last_slot), count=1)  # noqa: F821
            if PROMOTE:
                last_part, last_scales = part, scales
            last0, last1, last_slot = a0, a1, slot
            chunk += 1
        if PROMOTE:
            done, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(last_part, last0, last1))
            acc += done * last_scales[2][:, None]
        else:
            acc, _, _ = warpgroup_mma_wait(num_outstanding=0, deps=(acc, last0, last1))
        fence_async_shared()
        mbarrier.arrive(empty.index(last_slot), count=1)
        return acc, chunk, ahead, later

    @gluon.jit
    def _consume(
        codes_ring,
        x_ring,
        ready,
        empty,
        s_ptr,
        z_ptr,
        bias_ptr,
        out_ptr,
        part_ptr,
        cnt_ptr,
        M,
        N,
        K,
        stride_sn,
        splits,
        steps,
        half: gl.constexpr,
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_CHUNKS: gl.constexpr,
        BLOCK_T: gl.constexpr,
        X_BY_TMA: gl.constexpr,
        NATIVE: gl.constexpr,
        PROMOTE: gl.constexpr,
    ):
        """One consumer warpgroup, rows [64 half, 64 half + 64) of each tile (module
        docstring): each item's chunks in groups of GROUP_CHUNKS (`_chunk_group`), then one at
        a time; then the tile. (Unrolled over all of an item's 16-32 chunks instead, the two
        consumers' code missed the instruction cache: 28 % of the stall samples on qkv at 128
        tokens, and gate_up at 16 tokens took twice as long as in items of 8 chunks.)"""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 16]
        )
        dtype: gl.constexpr = x_ring.dtype
        tiles = gl.cdiv(N, _TILE_ROWS)
        chunks = K // 128
        if FORMAT == 4:  # noqa: SIM108 (a constexpr branch)
            times = gl.load(z_ptr).to(gl.float32)  # NVFP4's global scale, on the sums
        else:
            times = 1.0
        toks = gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, MMA))
        chunk = 0
        for item in range(gl.program_id(0), tiles * splits, gl.num_programs(0)):
            tile = item % tiles
            first, count = _item_chunks(item, tiles, chunks, steps)
            at = (tile * _TILE_ROWS + half * _HALF_ROWS, first, N, M)
            ahead = _scales_of(
                s_ptr, z_ptr, at, 0, K, stride_sn, FORMAT, GROUP, dtype, MMA, PROMOTE
            )
            later = _scales_of(
                s_ptr, z_ptr, at, 1, K, stride_sn, FORMAT, GROUP, dtype, MMA, PROMOTE
            )
            acc = gl.zeros([_HALF_ROWS, BLOCK_T], gl.float32, MMA)
            whole = count // GROUP_CHUNKS * GROUP_CHUNKS
            for st in range(0, whole, GROUP_CHUNKS):
                acc, chunk, ahead, later = _chunk_group(
                    acc,
                    codes_ring,
                    x_ring,
                    ready,
                    empty,
                    s_ptr,
                    z_ptr,
                    at,
                    st,
                    chunk,
                    ahead,
                    later,
                    K,
                    stride_sn,
                    half,
                    FORMAT,
                    GROUP,
                    STAGES,
                    GROUP_CHUNKS,
                    BLOCK_T,
                    X_BY_TMA,
                    NATIVE,
                    PROMOTE,
                )
            for st in range(whole, count):
                acc, chunk, ahead, later = _chunk_group(
                    acc,
                    codes_ring,
                    x_ring,
                    ready,
                    empty,
                    s_ptr,
                    z_ptr,
                    at,
                    st,
                    chunk,
                    ahead,
                    later,
                    K,
                    stride_sn,
                    half,
                    FORMAT,
                    GROUP,
                    STAGES,
                    1,
                    BLOCK_T,
                    X_BY_TMA,
                    NATIVE,
                    PROMOTE,
                )
            finish_half(
                acc * times,
                bias_ptr,
                out_ptr,
                part_ptr,
                cnt_ptr,
                tile,
                item // tiles,
                splits,
                half,
                tiles,
                M,
                N,
                toks,
                HAS_BIAS,
                SPLIT,
            )

    @gluon.jit
    def _copy_x(
        x_ptr, x_blocks, slot, col, M, K, BLOCK_T: gl.constexpr, PRODUCER_WARPS: gl.constexpr
    ):
        """x's chunk (columns col..col + 127, tokens < M) into the slot's two 64-column halves
        in wgmma's K order (module docstring): MMA column 32j + 8b + 2t + h of the chunk from
        x's column 32t + 8j + 2b + h, by 4-byte cp.async (a pair h is the largest unit the
        permutation keeps whole), 16 rows (two 128-byte swizzle atoms) per copy, spread over
        the producer's warps. Rows of the last block past M repeat row M - 1 and blocks past
        it are not copied: those tokens reach only output columns that are never stored."""
        XL: gl.constexpr = gl.BlockedLayout([1, 2], [1, 32], [PRODUCER_WARPS, 1], [1, 0])
        c = gl.arange(0, 64, layout=gl.SliceLayout(0, XL))  # MMA column in half 0 (j = c // 32)
        source = 32 * (c // 2 % 4) + 8 * (c // 32) + 2 * (c // 8 % 4) + c % 2
        r = gl.arange(0, 16, layout=gl.SliceLayout(1, XL))
        BLOCKS: gl.constexpr = BLOCK_T // 16
        for block in range(gl.cdiv(M, 16)):
            rows = gl.minimum(block * 16 + r, M - 1)
            at = x_ptr + (rows * K + col)[:, None] + source[None, :]
            for half in gl.static_range(2):  # half 1: j + 2, 16 columns on in x
                cp_async(x_blocks.index((2 * slot + half) * BLOCKS + block), at + 16 * half)

    @gluon.jit
    def _produce(
        q_desc,
        x_src,
        codes_ring,
        x_ring,
        ready,
        empty,
        M,
        N,
        K,
        splits,
        steps,
        STAGES: gl.constexpr,
        BLOCK_T: gl.constexpr,
        X_BY_TMA: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr,
    ):
        """The producer warps: for each chunk of this program's items, wait until both
        consumers released its slot, then copy x's chunk into it, either as two 64-column TMA
        boxes of the permuted x (X_BY_TMA) or permuting it (`_copy_x`; each lane's copies
        complete on `ready` by a no-increment cp.async arrival), and the tile's code words by
        TMA; `ready` also counts the TMA bytes. Rows past N: TMA's zero fill; tokens past M:
        TMA's zero fill, or by cp.async copies of row M - 1 and stale slots (`_copy_x`)."""
        if X_BY_TMA:
            nbytes: gl.constexpr = q_desc.block_type.nbytes + 2 * x_src.block_type.nbytes
        else:
            nbytes: gl.constexpr = q_desc.block_type.nbytes
            # the same bytes as [16, 64] blocks: 128-byte swizzling repeats every 8 rows (1 KB)
            x_blocks = reinterpret(x_ring, [2 * STAGES * (BLOCK_T // 16), 16, 64])
        tiles = gl.cdiv(N, _TILE_ROWS)
        chunks = K // 128
        chunk = 0
        for item in range(gl.program_id(0), tiles * splits, gl.num_programs(0)):
            row = (item % tiles) * _TILE_ROWS
            first, count = _item_chunks(item, tiles, chunks, steps)
            for st in range(count):
                slot = chunk % STAGES
                mbarrier.wait(empty.index(slot), ((chunk // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                col = (first + st) * 128
                if X_BY_TMA:
                    mbarrier.expect(bar, nbytes)
                    tma_load(x_src, [0, col], bar, x_ring.index(2 * slot))
                    tma_load(x_src, [0, col + 64], bar, x_ring.index(2 * slot + 1))
                else:
                    _copy_x(x_src, x_blocks, slot, col, M, K, BLOCK_T, PRODUCER_WARPS)
                    async_copy.mbarrier_arrive(bar, increment_count=False)
                    mbarrier.expect(bar, nbytes)
                tma_load(q_desc, [row, col // 8], bar, codes_ring.index(slot))
                chunk += 1

    @gluon.jit
    def _wgmma_kernel(
        q_desc,
        x_src,
        s_ptr,
        z_ptr,
        bias_ptr,
        out_ptr,
        part_ptr,
        cnt_ptr,
        M,
        N,
        K,
        stride_sn,
        splits,
        steps,
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_CHUNKS: gl.constexpr,
        BLOCK_T: gl.constexpr,
        X_BY_TMA: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr,
        NATIVE: gl.constexpr = False,
        PROMOTE: gl.constexpr = False,
    ):
        """The ring (STAGES slots of the tile's codes and x's chunk as two 64-column halves)
        and its barriers, then the two consumer warpgroups and the producer's warps."""
        codes_ring = gl.allocate_shared_memory(
            gl.int32, [STAGES, _TILE_ROWS, _WORDS], q_desc.layout
        )
        if X_BY_TMA:  # x_src: the permuted x's descriptor
            x_ring = gl.allocate_shared_memory(
                x_src.block_type.element_ty, [2 * STAGES, BLOCK_T, 64], x_src.layout
            )
        else:  # x_src: x; 64 columns of 16 bits, one 128-byte swizzle row
            x_ring = gl.allocate_shared_memory(
                x_src.dtype.element_ty,
                [2 * STAGES, BLOCK_T, 64],
                gl.NVMMASharedLayout(128, 16, rank=2),
            )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            # the producer's expect (and TMA's bytes); without X_BY_TMA also each producer
            # lane's arrival on its cp.async copies
            mbarrier.init(ready.index(s), count=1 if X_BY_TMA else 1 + 32 * PRODUCER_WARPS)
            mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        gl.warp_specialize(
            [
                (
                    _consume,
                    (
                        codes_ring,
                        x_ring,
                        ready,
                        empty,
                        s_ptr,
                        z_ptr,
                        bias_ptr,
                        out_ptr,
                        part_ptr,
                        cnt_ptr,
                        M,
                        N,
                        K,
                        stride_sn,
                        splits,
                        steps,
                        0,
                        FORMAT,
                        GROUP,
                        HAS_BIAS,
                        SPLIT,
                        STAGES,
                        GROUP_CHUNKS,
                        BLOCK_T,
                        X_BY_TMA,
                        NATIVE,
                        PROMOTE,
                    ),
                ),
                (
                    _consume,
                    (
                        codes_ring,
                        x_ring,
                        ready,
                        empty,
                        s_ptr,
                        z_ptr,
                        bias_ptr,
                        out_ptr,
                        part_ptr,
                        cnt_ptr,
                        M,
                        N,
                        K,
                        stride_sn,
                        splits,
                        steps,
                        1,
                        FORMAT,
                        GROUP,
                        HAS_BIAS,
                        SPLIT,
                        STAGES,
                        GROUP_CHUNKS,
                        BLOCK_T,
                        X_BY_TMA,
                        NATIVE,
                        PROMOTE,
                    ),
                ),
                (
                    _produce,
                    (
                        q_desc,
                        x_src,
                        codes_ring,
                        x_ring,
                        ready,
                        empty,
                        M,
                        N,
                        K,
                        splits,
                        steps,
                        STAGES,
                        BLOCK_T,
                        X_BY_TMA,
                        PRODUCER_WARPS,
                    ),
                ),
            ],
            [4, PRODUCER_WARPS],
            [232, 40],
        )
