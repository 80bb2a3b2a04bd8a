"""The register-operand W4A16 kernel on wgmma (notes and measurements:
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
    TILE_ROWS,
    TensorDescriptor,
    gl,
    half_tile_workspace,
)
from ..gpu import smem_budget
from ..packing import check_native_order, native_codes
from ..split_k import sm_count
from . import register
from .register import MXFP4, NVFP4
from .register_parts import WORDS
from .register_wgmma_kernel import wgmma_kernel

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
        "STAGES": _stages(block_t, device),
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


def _stages(block_t: int, device: torch.device) -> int:
    slot = TILE_ROWS * WORDS * 4 + block_t * CHUNK * 2  # codes + x (16-bit)
    return max(2, min(8, smem_budget(device) // slot))


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
    stages = config.get("STAGES") or _stages(block_t, x.device)
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
        or not 2 <= stages <= _stages(block_t, x.device)
        or steps < 1
        or group_chunks < 1
    ):
        raise ValueError(
            f"wgmma W4A16 config {config} for {m} tokens: BLOCK_T must be one of "
            f"{list(WGMMA_BLOCK_T)} and >= the tokens, STAGES 2..{_stages(block_t, x.device)} "
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
    wgmma_kernel[(grid,)](
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
