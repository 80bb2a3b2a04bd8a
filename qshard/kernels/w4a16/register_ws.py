"""The register-operand W4A16 kernel, warp-specialized (notes and measurements:
docs/kernels/w4a16_register.md, "The warp-specialized kernel (`w4a16/register_ws.py`)"): a producer
partition streams the codes and the activations by TMA into a ring of shared-memory slots while
the compute warps decode and multiply, as `w4a16/register.py`'s kernel does (the same K
permutation, decode, MMAs, scales and split-K epilogue; read its docstring first). The producer
is a 4-warp partition (one thread issues the copies; Triton pads a 1-warp partition to a
warpgroup anyway).

Why: ablations of that kernel (H100; docs/kernels/w4a16_register.md, "The mma.sync register
kernel (`w4a16/register.py`)") found its parts adding up instead of overlapping: with the cp.async
copies cut out, the Llama-3.1-8B layer took 75.8 us at 16 tokens (115.4 us as shipped). Here
no compute warp issues a copy or waits for one: the producer waits for a slot to be free
(`empty`, one arrival per chunk from the compute warps), and the compute warps for its bytes
(`ready`, TMA's transaction count).

The copies, by TMA, into the layouts the compute warps read:
- codes: the tile's rows by the chunk's 16 words ([TILE_ROWS, 16] int32, unswizzled), so each
  thread reads back the 16-byte runs it decodes, as in `w4a16/register.py` (conflict-free:
  64-byte rows);
- x: the K permutation done by the copy itself, through a 5-D view of x with strides
  (128, 8, K, 32, 1) over (chunk, j, token, t, e): the box [1, 4, BLOCK_M, 4, 8] lands as
  x_slot[j][token][8t + e] = x[token, 128 chunk + 32t + 8j + e], the slot the other kernel
  builds with one cp.async per 16 bytes. Tokens past M and rows past N are TMA's zero fill; K
  must be a multiple of 128 (a view's bounds are per dimension: a partial chunk would read the
  next token's columns), else `w4a16/register.py`'s kernel runs.

**The proxy fence.** The compute warps read a slot with ordinary shared loads (the generic
proxy); TMA writes it (the async proxy). The PTX memory model orders the two only through a
`fence.proxy.async`: each compute thread fences after its reads of a slot and before the
arrival that releases it to the producer. Without the fence the refill overwrote slots still
being read: 30 of 30 launches gave different bits, up to 4 % off, with two programs per SM and
an 8-slot ring; with the fence 0 of 30 in every config tried (H100,
docs/kernels/w4a16_register.md, "The warp-specialized kernel (`w4a16/register_ws.py`)"). The FP8
Gluon kernel needs none: its consumers read the TMA-written slots with wgmma, itself in the
async proxy.

Scope: `w4a16/register.py`'s kernel's (Hopper, bf16 / fp16, the int4 formats with groups of
32..256, MXFP4, NVFP4), with K % 128 == 0. The op chooses it at
`w4a16/select.py's `WS_CHOICE_MIN_M``..`WS_CHOICE_MAX_M` tokens, where it was measured fastest.
"""

from __future__ import annotations

import torch
import triton

from ..gluon_api import (
    CHUNK,
    GLUON_IMPORT_ERROR,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    mma_v2,
    tma_load,
)
from ..gpu import smem_budget
from ..split_k import sm_count, workspace
from . import register
from .register import MXFP4, NVFP4
from .register_parts import (
    ROWS_PER_WARP,
    WORDS,
    b_operand,
    chunk_scales,
    chunk_weights,
    codes_2d,
    codes_layout,
    finish_tile,
    item_at,
    x_layout,
)

__all__ = ["WS_BLOCK_M", "WS_PLANS", "config", "launch", "problem"]

WS_BLOCK_M = (8, 16, 32, 64, 128)  # the token tiles
# Per format family: (the most chunks per work item, programs per SM, register cap). int4: a
# whole K of 4096 in one item, two programs per SM under 80 registers. MXFP4 / NVFP4: their
# longer decode, unrolled over 32 chunks, ran at half the speed of 16 (gate_up at 16 tokens:
# 118.8 against 54.8 us, MXFP4); at 16 the register cap for two programs per SM gained nothing
# (qkv 16.2 against 16.1 us): one program per SM, no cap (H100; docs/kernels/w4a16_register.md,
# "The warp-specialized kernel (`w4a16/register_ws.py`)").
WS_PLANS = {"int4": (32, 2, 80), "fp4": (16, 1, 0)}


def problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """Why the warp-specialized kernel cannot run this matmul, or None if it can."""
    reason = register.problem(fmt, x, qdata, group)
    if reason is None and x.shape[1] % CHUNK:
        reason = (
            f"its activation copy (a 5-D TMA view of x) needs K % 128 == 0, not K = {x.shape[1]}"
        )
    return reason


def config(
    m: int, n: int, k: int, device: torch.device, fmt: int = 0, sms: int | None = None
) -> dict:
    """BLOCK_M tokens per tile; PER_SM programs per SM (`WS_PLANS`), each of 8 compute warps (a
    128-row tile) and the producer; a ring of STAGES slots filling the shared memory left; K
    split in as few parts as leave at least half as many work items (tiles x splits) as SMs,
    trying splits of the plan's most chunks, then half as many, ..., then balanced (STEPS =
    chunks / splits, rounded up). Fitted to the H100 sweeps at 8 and 16 tokens
    (docs/kernels/w4a16_register.md, "The warp-specialized kernel (`w4a16/register_ws.py`)"): on
    the Llama-3.1-8B layer it gives each linear the best of the configs measured (int4: K in 2
    / 4 / 1 / 4 splits for qkv / o / gate_up / down; MXFP4, NVFP4: 16 / 8 / 16 / 16 chunks per
    item). `sms`: the device's SM count unless given."""
    block_m = 8 if m <= 8 else max(16, triton.next_power_of_2(m))
    most, per_sm, maxnreg = WS_PLANS["fp4" if fmt >= MXFP4 else "int4"]
    warps = 8
    tiles = triton.cdiv(n, ROWS_PER_WARP * warps)
    chunks = triton.cdiv(k, CHUNK)
    half = (sms or sm_count(device.index or 0)) // 2
    steps = most
    while steps > 1 and tiles * triton.cdiv(chunks, steps) < half:
        steps //= 2
    steps = triton.cdiv(chunks, triton.cdiv(chunks, steps))  # the splits balanced: none past K
    return {
        "BLOCK_M": block_m,
        "STEPS": steps,
        "STAGES": _stages(block_m, warps, per_sm, device),
        "PER_SM": per_sm,
        "WARPS": warps,
        "MAXNREG": maxnreg,
    }


_config = config  # (`launch`'s parameter of that name hides the function)


def _stages(block_m: int, warps: int, per_sm: int, device: torch.device) -> int:
    slot = ROWS_PER_WARP * warps * WORDS * 4 + block_m * CHUNK * 2  # codes + x (16-bit)
    return max(2, min(8, smem_budget(device) // per_sm // slot))


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
    """out [M, N] = x [M, K] @ W.T + bias by the warp-specialized kernel (`problem` is
    None); arguments as `register.launch`; `config` as `config()` gives it (STAGES
    0 or absent: as many as fit)."""
    m, k = x.shape
    n = qdata.shape[0]
    config = dict(config or _config(m, n, k, x.device, fmt))
    block_m, steps, per_sm = config["BLOCK_M"], config["STEPS"], config["PER_SM"]
    warps = config.get("WARPS", 8)
    most = _stages(block_m, warps, per_sm, x.device) if per_sm >= 1 else 0
    stages = config.get("STAGES") or most
    if (
        block_m not in WS_BLOCK_M
        or block_m < m
        or not 2 <= stages <= most
        or per_sm < 1
        or steps < 1
        or warps not in (4, 8, 16)
    ):
        raise ValueError(
            f"warp-specialized W4A16 config {config} for {m} tokens: BLOCK_M must "
            f"be one of {list(WS_BLOCK_M)} and >= the tokens, STAGES 2..{most} (PER_SM rings "
            f"fill the shared memory), STEPS and PER_SM >= 1, WARPS 4, 8 or 16"
        )
    tile_rows = ROWS_PER_WARP * warps
    tiles = triton.cdiv(n, tile_rows)
    splits = triton.cdiv(k // CHUNK, steps)
    grid = min(tiles * splits, per_sm * sm_count(x.device.index or 0))
    partials, arrived = workspace(m, n, splits, tiles, x.device) if splits > 1 else (out, out)
    if fmt == NVFP4:
        if global_scale is None:
            raise ValueError("NVFP4 needs its fp32 global scale: pass global_scale")
        zero = global_scale
    if fmt >= 3:  # MXFP4 / NVFP4: e8m0 / e4m3 bytes, decoded in-kernel
        scale = scale.view(torch.uint8)
    codes = qdata.view(torch.int32)  # [N, K / 8]
    q_desc = TensorDescriptor.from_tensor(
        codes, [tile_rows, WORDS], gl.NVMMASharedLayout(0, 32, rank=2)
    )
    x_view = x.as_strided((k // CHUNK, 4, m, 4, 8), (CHUNK, 8, k, 32, 1))
    x_desc = TensorDescriptor.from_tensor(
        x_view, [1, 4, block_m, 4, 8], gl.NVMMASharedLayout(0, 16, rank=5)
    )
    _ws_kernel[(grid,)](
        q_desc,
        x_desc,
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
    _ROWS_PER_WARP = gl.constexpr(ROWS_PER_WARP)

    _WORDS = gl.constexpr(WORDS)

    @gluon.constexpr_function
    def _x_5d(block_m, warps):
        """`x_layout` on one word j of the slot, [1, 1, block_m tokens, 4 t, 8 e]."""
        tiles = [[0, 0, 8 << i, 0, 0] for i in range(block_m.bit_length() - 4)]
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4], *tiles],
            lane_bases=[
                [0, 0, 0, 1, 0],
                [0, 0, 0, 2, 0],
                [0, 0, 1, 0, 0],
                [0, 0, 2, 0, 0],
                [0, 0, 4, 0, 0],
            ],
            warp_bases=[[0, 0, 0, 0, 0]] * (warps.bit_length() - 1),
            block_bases=[],
            shape=[1, 1, block_m, 4, 8],
        )

    @gluon.jit
    def _slot_mma(
        acc,
        codes,
        x_slot,
        scale,
        zero,
        FORMAT: gl.constexpr,
        BLOCK_M: gl.constexpr,
        dtype: gl.constexpr,
    ):
        """acc + one chunk: the slot's codes decoded in registers (the A operand) times x's
        chunk (the B operand, one word j of columns at a time), as `_chunk_mma`."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        MMA: gl.constexpr = acc.type.layout
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        words = codes.load(codes_2d(gl.num_warps()))
        words = gl.convert_layout(
            gl.reshape(words, [TILE_ROWS, 4, 4]), codes_layout(gl.num_warps()), assert_trivial=True
        )
        for j in gl.static_range(4):
            a = gl.convert_layout(
                chunk_weights(words, scale, zero, j, FORMAT, dtype), A, assert_trivial=True
            )
            x = x_slot.slice(j, 1, dim=1).load(_x_5d(BLOCK_M, gl.num_warps()))
            x = gl.convert_layout(
                gl.reshape(x, [BLOCK_M, 32]), x_layout(BLOCK_M, gl.num_warps()), assert_trivial=True
            )
            b = gl.convert_layout(b_operand(x, BLOCK_M), B, assert_trivial=True)
            acc = mma_v2(a, b, acc)
        return acc

    @gluon.jit
    def _compute(
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
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
        STEPS: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        """The compute warps (the default partition): per chunk, its scales loaded two chunks
        ahead, then: wait for the slot's bytes, decode and multiply, release the slot (a proxy
        fence, then the arrival, before which Triton puts a barrier of these warps: every
        warp's reads are done and ordered before the refill), then the tile written or its
        partial sums counted (`finish_tile`)."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, 8]
        )
        dtype: gl.constexpr = x_ring.dtype
        tiles = gl.cdiv(N, TILE_ROWS)
        items = tiles * splits
        pid = gl.program_id(0)
        programs = gl.num_programs(0)
        if FORMAT == 4:  # noqa: SIM108 (a constexpr branch)
            times = gl.load(z_ptr).to(gl.float32)  # NVFP4's global scale, on the sums
        else:
            times = 1.0
        # the scales two chunks ahead (`ahead`, then `later`), across items: a few registers
        # where a whole item's would hold 4 * STEPS per item and its successor
        here = item_at(pid, items, tiles, N, M, STEPS)
        after = item_at(pid + programs, items, tiles, N, M, STEPS)
        ahead = chunk_scales(s_ptr, z_ptr, here, 0, K, stride_sn, FORMAT, GROUP, dtype)
        later = chunk_scales(
            s_ptr,
            z_ptr,
            here if STEPS > 1 else after,
            1 % STEPS,
            K,
            stride_sn,
            FORMAT,
            GROUP,
            dtype,
        )
        chunk = 0
        for item in range(pid, items, programs):
            after = item_at(item + programs, items, tiles, N, M, STEPS)
            acc = gl.zeros([TILE_ROWS, BLOCK_M], gl.float32, MMA)
            for st in gl.static_range(STEPS):
                scale, zero = ahead
                ahead = later
                later = chunk_scales(
                    s_ptr,
                    z_ptr,
                    here if st + 2 < STEPS else after,
                    (st + 2) % STEPS,
                    K,
                    stride_sn,
                    FORMAT,
                    GROUP,
                    dtype,
                )
                slot = chunk % STAGES
                mbarrier.wait(ready.index(slot), (chunk // STAGES) & 1)
                acc = _slot_mma(
                    acc,
                    codes_ring.index(slot),
                    x_ring.index(slot),
                    scale,
                    zero,
                    FORMAT,
                    BLOCK_M,
                    dtype,
                )
                # the slot's reads (generic proxy) ordered before the TMA (async proxy) that
                # refills it: without this fence the refill overwrote slots still being read
                # (30 of 30 launches differed with two programs per SM; measured on the H100)
                fence_async_shared()
                mbarrier.arrive(empty.index(slot), count=1)
                chunk += 1
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
            here = after

    @gluon.jit
    def _produce(
        q_desc,
        x_desc,
        codes_ring,
        x_ring,
        ready,
        empty,
        N,
        splits,
        STEPS: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """The producer warp: for each chunk of this program's items, wait for its slot to be
        released, then copy the tile's codes and x's chunk into it; `ready` completes when
        both have landed (TMA's byte count). Chunks past K are zeros (TMA's fill)."""
        TILE_ROWS: gl.constexpr = q_desc.block_type.shape[0]
        nbytes: gl.constexpr = q_desc.block_type.nbytes + x_desc.block_type.nbytes
        tiles = gl.cdiv(N, TILE_ROWS)
        chunk = 0
        for item in range(gl.program_id(0), tiles * splits, gl.num_programs(0)):
            row = (item % tiles) * TILE_ROWS
            first = (item // tiles) * STEPS
            for st in range(STEPS):
                slot = chunk % STAGES
                mbarrier.wait(empty.index(slot), ((chunk // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, nbytes)
                tma_load(q_desc, [row, (first + st) * _WORDS], bar, codes_ring.index(slot))
                tma_load(x_desc, [first + st, 0, 0, 0, 0], bar, x_ring.index(slot))
                chunk += 1

    @gluon.jit
    def _ws_kernel(
        q_desc,
        x_desc,
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
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
        STEPS: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        """The ring (STAGES slots of the tile's codes and x's chunk) and its barriers, then the
        compute warps (default partition) and the producer warp."""
        codes_ring = gl.allocate_shared_memory(
            gl.int32, [STAGES, _ROWS_PER_WARP * gl.num_warps(), _WORDS], q_desc.layout
        )
        x_ring = gl.allocate_shared_memory(
            x_desc.block_type.element_ty, [STAGES, 1, 4, BLOCK_M, 4, 8], x_desc.layout
        )
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)  # the producer's expect (and TMA's bytes)
            mbarrier.init(empty.index(s), count=1)  # the compute warps' one arrival
        fence_async_shared()
        gl.warp_specialize(
            [
                (
                    _compute,
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
                        FORMAT,
                        GROUP,
                        HAS_BIAS,
                        SPLIT,
                        STEPS,
                        STAGES,
                        BLOCK_M,
                    ),
                ),
                (
                    _produce,
                    (q_desc, x_desc, codes_ring, x_ring, ready, empty, N, splits, STEPS, STAGES),
                ),
            ],
            [4],
            [40],
        )
