"""FP8 blockwise W8A8 matmul for Hopper at 2..128 tokens, in Gluon (`triton.experimental.gluon`):
a warp-specialized, persistent kernel in which one warp streams the weight and activation tiles
by TMA into a ring of shared-memory slots while two warpgroups multiply them with wgmma and
promote each group's sums with its scales (notes and measurements:
docs/kernels/fp8_blockwise.md, "Gluon kernel: 2-64 tokens on Hopper").

Why (H100, Nsight Compute; docs/kernels/fp8_blockwise.md, "Gluon kernel: 2-64 tokens on Hopper" and
"Where the gaps are"): at 16 tokens the Triton small-M kernel streams gate_up at 74 % of DRAM peak
but the smaller linears at 39-61 %, and at 128 tokens it reaches 55 % against cuBLAS's persistent,
warp-specialized kernel's 75 %: its loads, MMAs and the fp32 promotion share the same warps, and
plain Triton 3.6 cannot specialize warps on pointer loops.

out^T = W xq^T with the weight rows on the MMA's M side ("swap AB"): a tile is 128 weight rows
(one weight block: one scale per tile and group) by BLOCK_T tokens (16..128, all of them), and
each consumer warpgroup owns 64 of its rows. A work item is (tile, K split): its groups of 128
columns are chunks of the ring. Per chunk a consumer waits for the slot, runs its
[64, 128] x [128, BLOCK_T] fp8 wgmma into a fresh fp32 accumulator, releases the slot and adds
the sums times x_scale[token] * w_scale[tile] to its tile (DeepSeek-V3 3.3.2's promotion, the
reference's order: `partial * (x_scale * w_scale)`). The producer warp runs ahead by the ring's
depth across items. Split K as in `split_k.py`: fp32 partial sums per split, the tile's last
program to arrive (per warpgroup half) sums them in split order and writes the tile.

The activations are quantized first by the act-quant kernel (`act_quant.py`, bit for
bit the reference's), so the GEMM reads e4m3 x by TMA like the weight.

Scope: sm_90, 128x128 weight blocks with 1x128 activation groups (DeepSeek-V3's layout), bf16,
fp16 or fp32 activations, 1..128 tokens, K a multiple of 16 (TMA's 16-byte row stride); partial
row tiles and a partial last group read zeros from TMA. Elsewhere the Triton kernels run, chosen
inside the same op (`select.py`). Gluon kernels do not run in the Triton interpreter:
CI compiles this one for sm_90 and tests its config; its numerics are tested on the GPU.
"""

from __future__ import annotations

import torch
import triton

from ..gluon_api import (
    CHUNK,
    GLUON_IMPORT_ERROR,
    HALF_ROWS,
    TILE_ROWS,
    TensorDescriptor,
    async_copy,
    cp_async,
    fence_async_shared,
    finish_half,
    gl,
    gluon,
    gluon_unavailable,
    half_tile_workspace,
    mbarrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from ..gpu import smem_budget
from ..split_k import sm_count
from .act_quant import act_quant_launch

__all__ = ["GLUON_MAX_M", "config", "launch", "problem"]

GLUON_MIN_M, GLUON_MAX_M = 1, 128


def problem(
    x: torch.Tensor, qdata: torch.Tensor, block_n: int, block_k: int, group: int
) -> str | None:
    """Why the Gluon kernel cannot run this matmul, or None if it can."""
    if gluon_unavailable() is not None:
        return gluon_unavailable()
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the Gluon FP8 kernel is built and measured for Hopper (sm_90) only"
    if (block_n, block_k, group) != (TILE_ROWS, CHUNK, CHUNK):
        return (
            f"it takes 128x128 weight blocks and 1x128 activation groups, not "
            f"{block_n}x{block_k} blocks with 1x{group} groups"
        )
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"it multiplies bf16, fp16 or fp32 activations, not {x.dtype}"
    m = x.shape[0]
    if not GLUON_MIN_M <= m <= GLUON_MAX_M:
        return f"it runs {GLUON_MIN_M}..{GLUON_MAX_M} tokens, not {m}"
    k = qdata.shape[1]
    if k % 16 or qdata.data_ptr() % 16:
        return (
            f"TMA reads rows of 16-byte multiples from a 16-byte aligned weight: K % 16 == 0"
            f" (K = {k}), base address % 16 == 0 ({qdata.data_ptr() % 16})"
        )
    return None


def config(m: int, n: int, k: int, device: torch.device) -> dict:
    """BLOCK_T tokens per tile (all of them), a ring of STAGES chunks, PER_SM programs per SM
    (persistent grid; one fits: 12 warps at 168 registers), SPLITS K splits per tile chosen by
    `split_for`."""
    block_t = max(16, triton.next_power_of_2(m))
    # a slot: the weight tile's group, x's group, and the two scale rows (fp32, >= 32 wide)
    stage_bytes = TILE_ROWS * CHUNK + block_t * CHUNK + 2 * 4 * max(32, block_t)
    stages = min(10, smem_budget(device) // stage_bytes)
    programs = sm_count(device.index or 0)
    tiles = triton.cdiv(n, TILE_ROWS)
    splits = split_for(tiles, triton.cdiv(k, CHUNK), programs, block_t)
    return {"BLOCK_T": block_t, "STAGES": stages, "PER_SM": 1, "SPLITS": splits}


_config = config  # (`launch`'s parameter of that name hides the function)


# Fitted to this kernel's split sweep on the H100 (docs/kernels/fp8_blockwise.md, "Gluon
# kernel"): how many programs' worth of chunks the whole GPU streams in the time one program
# streams one, by token tile (at 16 tokens 48 programs already read qkv at the DRAM's rate; at
# 128 a program is held back by its MMAs and promotions), and a split item's epilogue (partial
# sums out and back, the count) in chunks.
PROGRAMS_AT_DRAM_RATE = {16: 36, 32: 48, 64: 90, 128: 180}


def split_for(tiles: int, groups: int, programs: int, block_t: int) -> int:
    """The K split count with the shortest modelled time: the longer of the DRAM-bound time
    (all chunks over PROGRAMS_AT_DRAM_RATE programs) and the busiest program's chunks, plus,
    when split, 2 + BLOCK_T / 16 chunks per item for its epilogue. Ties go to fewer splits;
    splits keep >= 2 groups each."""
    dram_rate = PROGRAMS_AT_DRAM_RATE[block_t]
    best, best_time = 1, None
    for splits in range(1, max(1, groups // 2) + 1):
        per_split = triton.cdiv(groups, splits)
        items = tiles * triton.cdiv(groups, per_split)
        epilogue = 0 if splits == 1 else 2 + block_t // 16
        busiest = triton.cdiv(items, programs) * (per_split + epilogue)
        time = max(tiles * groups / dram_rate, busiest)
        if best_time is None or time < best_time:
            best, best_time = splits, time
    return best


def launch(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    ue8m0: bool,
    config: dict | None = None,
) -> torch.Tensor:
    """x [M, K] float -> x @ W.T + bias [M, N] in x's dtype (`problem` is None); qdata
    [N, K] e4m3 and scale [N/128, K/128] contiguous."""
    m, k = x.shape
    n = qdata.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    config = dict(config or _config(m, n, k, x.device))
    block_t, stages, per_sm = config["BLOCK_T"], config["STAGES"], config["PER_SM"]
    if block_t < m or block_t not in (16, 32, 64, 128) or stages < 2 or per_sm < 1:
        raise ValueError(
            f"Gluon FP8 config {config} for {m} tokens: BLOCK_T must be 16, 32, "
            f"64 or 128 and >= the tokens, STAGES >= 2, PER_SM >= 1"
        )
    groups = triton.cdiv(k, CHUNK)
    per_split = triton.cdiv(groups, min(config["SPLITS"], groups))
    splits = triton.cdiv(groups, per_split)  # no split without a group
    tiles = triton.cdiv(n, TILE_ROWS)
    xq, x_scale = act_quant_launch(x, CHUNK, ue8m0)
    w_layout = gl.NVMMASharedLayout.get_default_for([HALF_ROWS, CHUNK], gl.float8e4nv)
    x_layout = gl.NVMMASharedLayout.get_default_for([block_t, CHUNK], gl.float8e4nv)
    w_desc = TensorDescriptor.from_tensor(qdata, [HALF_ROWS, CHUNK], w_layout)
    x_desc = TensorDescriptor.from_tensor(xq, [block_t, CHUNK], x_layout)
    partials, arrived = half_tile_workspace(splits, tiles, block_t, out)
    grid = min(tiles * splits, per_sm * sm_count(x.device.index or 0))
    _fp8_kernel[(grid,)](
        w_desc,
        x_desc,
        scale,
        x_scale,
        bias if bias is not None else out,
        out,
        partials,
        arrived,
        m,
        n,
        tiles,
        groups,
        per_split,
        splits,
        scale.stride(0),
        BLOCK_T=block_t,
        STAGES=stages,
        HAS_BIAS=bias is not None,
        SPLIT=splits > 1,
        num_warps=4,
    )
    return out


# ---- the kernel --------------------------------------------------------------------------------

if GLUON_IMPORT_ERROR is None:
    _HALF_ROWS = gl.constexpr(HALF_ROWS)
    _TILE_ROWS = gl.constexpr(TILE_ROWS)
    _CHUNK = gl.constexpr(CHUNK)

    @gluon.jit
    def _item_groups(item, tiles, groups, per_split):
        """Work item `item`'s tile and its groups [g0, g1)."""
        tile = item % tiles
        g0 = (item // tiles) * per_split
        return tile, item // tiles, g0, gl.minimum(g0 + per_split, groups)

    @gluon.jit
    def _producer(
        w_desc,
        x_desc,
        ws_ptr,
        xs_ptr,
        w_ring,
        x_ring,
        xs_ring,
        ws_ring,
        ready,
        empty,
        M,
        tiles,
        groups,
        per_split,
        splits,
        stride_wsn,
        STAGES: gl.constexpr,
    ):
        """One warp: for each chunk of this program's items, wait for its slot to be free
        (both warpgroups released it), then fill it: the group's scales by cp.async (x_scale
        of each token, and w_scale[tile, group] repeated beside them), the tile's two 64-row
        halves of the weight group and x's group by TMA. `ready` completes when all of them
        have landed: each lane's cp.async arrive (.noinc) is one of the barrier's 33 expected
        arrivals, made when that lane's copies land; the expect is the 33rd, and counts TMA's
        bytes. (An arrive without .noinc, which adds its own pending arrival, gave the same
        results but compute-sanitizer's synccheck reported it as a barrier overflow.)"""
        nbytes: gl.constexpr = 2 * w_desc.block_type.nbytes + x_desc.block_type.nbytes
        WIDTH: gl.constexpr = xs_ring.type.shape[1]  # >= 32: no lane of the warp repeated
        SCALES: gl.constexpr = gl.BlockedLayout([WIDTH // 32], [32], [1], [0])
        toks = gl.arange(0, WIDTH, layout=SCALES)
        each = gl.zeros([WIDTH], gl.int32, SCALES)
        chunk = 0
        for item in range(gl.program_id(0), tiles * splits, gl.num_programs(0)):
            tile, _, g0, g1 = _item_groups(item, tiles, groups, per_split)
            for g in range(g0, g1):
                slot = chunk % STAGES
                mbarrier.wait(empty.index(slot), ((chunk // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                # x_scale[g, tokens] (zero past M), and w_scale[tile, g] repeated
                cp_async(xs_ring.index(slot), xs_ptr + g * M + toks, mask=toks < M)
                cp_async(ws_ring.index(slot), ws_ptr + (tile * stride_wsn + g) + each)
                async_copy.mbarrier_arrive(bar, increment_count=False)  # each lane's, .noinc
                mbarrier.expect(bar, nbytes)
                row, col = tile * _TILE_ROWS, g * _CHUNK
                tma_load(w_desc, [row, col], bar, w_ring.index(2 * slot))
                tma_load(w_desc, [row + _HALF_ROWS, col], bar, w_ring.index(2 * slot + 1))
                tma_load(x_desc, [0, col], bar, x_ring.index(slot))
                chunk += 1

    @gluon.jit
    def _consumer(
        w_ring,
        x_ring,
        xs_ring,
        ws_ring,
        ready,
        empty,
        bias_ptr,
        out_ptr,
        part_ptr,
        cnt_ptr,
        M,
        N,
        tiles,
        groups,
        per_split,
        splits,
        half,
        BLOCK_T: gl.constexpr,
        STAGES: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
    ):
        """One warpgroup, rows [64 half, 64 half + 64) of each tile: per chunk, the fp8 wgmma
        of its weight half and x's group into a fresh accumulator, the group's scales read
        from the slot, the slot released, and the sums promoted into the tile with
        x_scale[token] * w_scale[tile, group]. (Loaded from global memory here, even a chunk
        ahead, the scales put their latency on every chunk's path: 42 % of the stall samples on
        down at 16 tokens, H100; docs/kernels/fp8_blockwise.md, "Gluon kernel: 2-64 tokens on
        Hopper".)"""
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_T, 32]
        )
        PER_TOKEN: gl.constexpr = gl.SliceLayout(0, MMA)
        toks = gl.arange(0, BLOCK_T, layout=PER_TOKEN)
        zero = gl.zeros([_HALF_ROWS, BLOCK_T], gl.float32, MMA)
        chunk = 0
        for item in range(gl.program_id(0), tiles * splits, gl.num_programs(0)):
            tile, split, g0, g1 = _item_groups(item, tiles, groups, per_split)
            acc = zero
            for _g in range(g0, g1):
                slot = chunk % STAGES
                mbarrier.wait(ready.index(slot), (chunk // STAGES) & 1)
                part = warpgroup_mma(
                    w_ring.index(2 * slot + half),
                    x_ring.index(slot).permute((1, 0)),
                    zero,
                    use_acc=False,
                    is_async=True,
                )
                # the reference's order: x_scale * w_scale, then the sums times it
                scale = xs_ring.index(slot).slice(0, BLOCK_T).load(PER_TOKEN) * ws_ring.index(
                    slot
                ).slice(0, BLOCK_T).load(PER_TOKEN)
                part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
                mbarrier.arrive(empty.index(slot), count=1)
                acc += part * scale[None, :]
                chunk += 1
            finish_half(
                acc,
                bias_ptr,
                out_ptr,
                part_ptr,
                cnt_ptr,
                tile,
                split,
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
    def _fp8_kernel(
        w_desc,
        x_desc,
        ws_ptr,
        xs_ptr,
        bias_ptr,
        out_ptr,
        part_ptr,
        cnt_ptr,
        M,
        N,
        tiles,
        groups,
        per_split,
        splits,
        stride_wsn,
        BLOCK_T: gl.constexpr,
        STAGES: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
    ):
        """The ring (STAGES slots of two 64-row weight halves and x's group) and its barriers,
        then three partitions: the two consumer warpgroups (the default one and a worker) and
        the producer warp."""
        w_ring = gl.allocate_shared_memory(
            gl.float8e4nv, [2 * STAGES, _HALF_ROWS, _CHUNK], w_desc.layout
        )
        x_ring = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_T, _CHUNK], x_desc.layout)
        # per slot: x_scale of each token, and w_scale repeated as many times (`_producer`);
        # at least 32 wide, the producer warp's lanes
        SCALE_RING: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        WIDTH: gl.constexpr = 32 if BLOCK_T < 32 else BLOCK_T
        xs_ring = gl.allocate_shared_memory(gl.float32, [STAGES, WIDTH], SCALE_RING)
        ws_ring = gl.allocate_shared_memory(gl.float32, [STAGES, WIDTH], SCALE_RING)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            # the producer's expect, and the cp.async arrive of each of its warp's 32 lanes
            mbarrier.init(ready.index(s), count=33)
            mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
        fence_async_shared()
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        w_ring,
                        x_ring,
                        xs_ring,
                        ws_ring,
                        ready,
                        empty,
                        bias_ptr,
                        out_ptr,
                        part_ptr,
                        cnt_ptr,
                        M,
                        N,
                        tiles,
                        groups,
                        per_split,
                        splits,
                        0,
                        BLOCK_T,
                        STAGES,
                        HAS_BIAS,
                        SPLIT,
                    ),
                ),
                (
                    _consumer,
                    (
                        w_ring,
                        x_ring,
                        xs_ring,
                        ws_ring,
                        ready,
                        empty,
                        bias_ptr,
                        out_ptr,
                        part_ptr,
                        cnt_ptr,
                        M,
                        N,
                        tiles,
                        groups,
                        per_split,
                        splits,
                        1,
                        BLOCK_T,
                        STAGES,
                        HAS_BIAS,
                        SPLIT,
                    ),
                ),
                (
                    _producer,
                    (
                        w_desc,
                        x_desc,
                        ws_ptr,
                        xs_ptr,
                        w_ring,
                        x_ring,
                        xs_ring,
                        ws_ring,
                        ready,
                        empty,
                        M,
                        tiles,
                        groups,
                        per_split,
                        splits,
                        stride_wsn,
                        STAGES,
                    ),
                ),
            ],
            [4, 1],
            [232, 40],
        )
