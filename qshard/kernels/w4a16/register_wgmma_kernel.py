"""The wgmma register kernel's Gluon program (`wgmma_kernel`): its host side, the problem,
config and launch, and the design notes are `register_wgmma.py`'s. One program, its producer
and consumers and the helpers only they use: about 500 lines as the formatter lays it out."""

from __future__ import annotations

from ..gluon_api import (
    CHUNK,
    GLUON_IMPORT_ERROR,
    HALF_ROWS,
    TILE_ROWS,
    async_copy,
    cp_async,
    fence_async_shared,
    finish_half,
    gl,
    gluon,
    mbarrier,
    reinterpret,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from .register_parts import WORDS, chunk_scales, chunk_weights, codes_2d, codes_layout

__all__ = ["wgmma_kernel"]

wgmma_kernel = None  # the program, where Gluon imports (below)

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
    def wgmma_kernel(
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
