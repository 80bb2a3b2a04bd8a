"""Issue 24, Deliver 2's first step: a small W4A16 kernel whose dequantized weight feeds the tensor
cores from registers, written with no install-time compiler in CUDA C++ (compiled at run time by
NVRTC through `torch.cuda._compile_kernel`) and in Gluon (`triton.experimental.gluon`), each
checked and timed on the Llama-3.1-8B layer's shapes against bf16 `F.linear` and qshard's Triton
int4 kernel. Notes and the measured tables: docs/kernels/w4a16_register.md.

    PYTHONPATH=$PWD python bench/register_operand_probe.py [--shapes o,qkv,gate_up,down]
        [--m 16] [--configs 2:0,4:0,4:2,4:4] [--check-ms 1,7]

Prints: versions (GPU, driver, torch, CUDA, triton); what Gluon's Hopper module and torch's
`_compile_kernel` offer; whether `_compile_kernel` works without a CUDA toolkit (CUDA_HOME None);
each kernel's compile time (first, then cached: the cubin's module load for NVRTC, Triton's disk
cache for Gluon), registers and shared memory; then per shape a table: CUDA-graph median per call
over weight copies rotated past the 50 MB L2 (bench_fp8.time_us), speedup over bf16, bytes moved
over time, the worst relative error vs `int4_linear_reference` over fresh random draws at M and
at the --check-ms token counts (masking), and the host time of an eager call.

int4 asymmetric, group 128 (qshard's canonical packing: two codes per byte along K, even index in
the low nibble; W = (u - zero) * scale). Every kernel computes out^T = W x^T with the weight rows
on the MMA's M side (swap AB, as Marlin): the weight is the A operand, in registers; x^T is B,
from shared memory. They share one device form, made by `device_form` from the canonical
tensors: codes int32 [N/16, K/128, 32 lanes, 8], word s of lane (g, t) of 16-row tile r and group
kb holding in nibble p = i + 4h the code of row 16r + g + 8(i & 1), column
128kb + 16s + 8(i >> 1) + 2t + h, i.e. thread (g, t)'s A fragment of m16n8k16 step s (mma.sync's
A fragment, which is also each warp's part of wgmma's register A operand), one 16-byte load per
thread per 64 columns. Nibbles i and i + 4 are 16 bits apart, so one lop3 makes the bf16 pair
(128 + u_i, 128 + u_{i+4}) (the codes in the low mantissa bits of 128.0); two bf16x2 FMAs then
give (v - (128 + zero)) * scale, the first exact, the second rounded once: the reference's bf16
weight bit for bit (about 2 instructions per weight). Scales and zeros: int32 [N, K/128], the
scale (bf16) low, -(128 + zero) (bf16) high.

A work item is a 64-row tile (4 warps x 16 rows) by STEPS groups of K; a program loops over items
(PER_SM 0: one program per item; else a persistent grid of PER_SM programs per SM), issuing the
next item's code loads (registers) and x slice (cp.async into the other of two shared buffers)
before decoding the current one. Split K: fp32 partials, the last program of a tile to arrive
sums them in split order (as qshard/kernels/split_k.py) and resets its counter.
- "NVRTC mma.sync": CUDA C++ with inline PTX (mma.sync.m16n8k16, ldmatrix, lop3, cp.async).
- "Gluon mma.sync": the same in Gluon (`mma_v2`): the same instruction, the other language.
- "Gluon wgmma": wgmma (`warpgroup_mma`) with the register A operand in the wgmma dot-operand
  layout, issued asynchronously: one group's MMA in flight while the next group decodes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

# Gluon's Hopper API as qshard's kernels import it (the renames after triton 3.6 looked up
# there); its absence is reported, not hidden
from qshard.kernels.gluon_api import GLUON_IMPORT_ERROR as GLUON_ERROR
from qshard.kernels.gluon_api import (
    async_copy,
    fence_async_shared,
    gl,
    gluon,
    mma_v2,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from qshard.kernels.gluon_api import barrier as _barrier
from qshard.kernels.gluon_api import cp_async as _async_load

GROUP = 128
ROWS = 64  # weight rows per program: 4 warps x 16

# ---- the device form ---------------------------------------------------------------------------


def device_form(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int):
    """qshard's canonical int4 (packed uint8 [N, K/2], bf16 scale and zero [N, K/128]) -> (codes
    int32 [N/16, K/128, 32, 8], scale and -(128 + zero) int32 [N, K/128]); see the docstring."""
    from qshard.kernels.int4 import unpack_nibbles

    n = packed.shape[0]
    assert n % 16 == 0 and k % GROUP == 0, "the probe takes N % 16 == 0 and K % 128 == 0"
    u = unpack_nibbles(packed, k).to(torch.int64)
    # row = 16 r + 8 r8 + g; column = 128 kb + 16 s + 8 c8 + 2 t + h
    u = u.view(n // 16, 2, 8, k // 128, 8, 2, 4, 2)  # r, r8, g, kb, s, c8, t, h
    u = u.permute(0, 3, 2, 6, 4, 7, 5, 1)  # r, kb, g, t, s, h, c8, r8: nibble p = r8 + 2 c8 + 4 h
    u = u.reshape(n // 16, k // 128, 32, 8, 8)
    words = (u << (4 * torch.arange(8, device=u.device))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    low = scale.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    neg_c = (-(128.0 + zero.float())).to(torch.bfloat16)  # exact: 128 + a code is 8 bits
    high = neg_c.view(torch.int16).to(torch.int32) << 16
    return words.contiguous(), (low | high).contiguous()


# ---- CUDA C++ through NVRTC --------------------------------------------------------------------

CUDA_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
#define DEV __device__ __forceinline__
#ifndef STEPS
#define STEPS 4            // 128-wide K groups per program
#endif
#define WARPS 4            // 16 weight rows per warp, 64 per program
#define XPAD 8             // bf16 padding per shared row of x: ldmatrix without bank conflicts
#define XROW (STEPS * 128 + XPAD)  // one buffer: 16 rows

DEV u32 lop_and_or(u32 a, u32 b, u32 c) {  // (a & b) | c in one instruction
  u32 d; asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
DEV u32 bfma2(u32 a, u32 b, u32 c) {
  u32 d; asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
DEV u32 prmt(u32 a, u32 sel) {
  u32 d; asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(a), "r"(sel)); return d;
}
DEV void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
DEV void ldmatrix_x4(u32 (&b)[4], const void* smem) {
  u32 addr = (u32)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]) : "r"(addr));
}
DEV u16 f32_to_bf16(float f) {
  u16 h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
// One device-form word -> thread (g, t)'s A fragment of one m16n8k16 step: pair i (nibbles i,
// i + 4) is A register i: rows g, g + 8, g, g + 8; columns 2t (+1), 2t (+1), 2t + 8 (+1), ...
DEV void dequant(u32 q, u32 s_lo, u32 nc_lo, u32 s_hi, u32 nc_hi, u32 (&a)[4]) {
  const u32 MASK = 0x000f000f, EXP = 0x43004300, ONE = 0x3f803f80, NEG0 = 0x80008000;
  a[0] = bfma2(bfma2(lop_and_or(q, MASK, EXP), ONE, nc_lo), s_lo, NEG0);
  a[1] = bfma2(bfma2(lop_and_or(q >> 4, MASK, EXP), ONE, nc_hi), s_hi, NEG0);
  a[2] = bfma2(bfma2(lop_and_or(q >> 8, MASK, EXP), ONE, nc_lo), s_lo, NEG0);
  a[3] = bfma2(bfma2(lop_and_or(q >> 12, MASK, EXP), ONE, nc_hi), s_hi, NEG0);
}

DEV void cp_async16(void* smem, const void* gmem, bool full) {  // zero-filled when !full
  u32 addr = (u32)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
               :: "r"(addr), "l"(gmem), "r"(full ? 16 : 0) : "memory");
}
DEV void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
DEV void cp_async_wait_1() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

struct Codes {  // one work item's code words and scale/zero words, per thread
  uint4 q[STEPS][2];
  u32 lo[STEPS], hi[STEPS];
};

// Issue the loads of item (tile, split): the codes and scales into registers, x's slice into
// shared memory by cp.async (tokens >= M zero-filled). Nothing waits here.
DEV void load_item(Codes& c, u16* xs, const uint4* q, const u32* sz, const u16* x, int item,
                   int tiles, int M, int K) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  const int KB = K / 128, tile = item % tiles, kb0 = (item / tiles) * STEPS;
  const int r16 = tile * WARPS + warp, row = r16 * 16 + g;
  const uint4* qp = q + ((size_t)(r16 * KB + kb0) * 32 + lane) * 2;
#pragma unroll
  for (int st = 0; st < STEPS; ++st) {
    c.q[st][0] = __ldg(qp + st * 64);
    c.q[st][1] = __ldg(qp + st * 64 + 1);
    c.lo[st] = __ldg(sz + (size_t)row * KB + kb0 + st);
    c.hi[st] = __ldg(sz + (size_t)(row + 8) * KB + kb0 + st);
  }
  constexpr int VECS = 16 * STEPS * 16;  // x's slice as 16-byte vectors
#pragma unroll
  for (int v = threadIdx.x; v < VECS; v += WARPS * 32) {
    const int tok = v / (STEPS * 16), col = (v % (STEPS * 16)) * 8;
    cp_async16(xs + tok * XROW + col, x + (size_t)(tok < M ? tok : 0) * K + kb0 * 128 + col,
               tok < M);
  }
}

// A persistent loop over work items (64-row tile, split of STEPS groups): the next item's loads
// are issued before the current item is decoded and multiplied. Launched with one program per
// item it is the one-shot kernel (nothing to prefetch). With more than one split per tile each
// item stores fp32 partials [splits, 16, N] and the last of a tile to arrive (counters[tile])
// sums them in split order and resets the counter.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
w4a16_mma_sync(const uint4* __restrict__ q, const u32* __restrict__ sz, const u16* __restrict__ x,
               u16* __restrict__ out, float* __restrict__ partials, int* __restrict__ counters,
               int M, int N, int K) {
  extern __shared__ __align__(16) u16 xs[];  // [2 buffers][16][XROW]
  __shared__ int last;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, warp = threadIdx.x / 32;
  const int tiles = N / 64, splits = K / (128 * STEPS), items = tiles * splits;
  int item = blockIdx.x;
  Codes cur;
  if (item < items) load_item(cur, xs, q, sz, x, item, tiles, M, K);
  cp_async_commit();
  for (int buf = 0; item < items; buf ^= 1) {
    const int next = item + gridDim.x;
    Codes nxt;
    if (next < items) load_item(nxt, xs + (buf ^ 1) * 16 * XROW, q, sz, x, next, tiles, M, K);
    cp_async_commit();
    cp_async_wait_1();  // this item's x is in shared memory (the next one's may be in flight)
    __syncthreads();
    float acc0[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};
    // ldmatrix.x4: lanes 8j..8j+7 give the rows of matrix j = (tokens 0-7 | 8-15) x (k 0-7 | 8-15)
    const u16* xrow = xs + buf * 16 * XROW + ((lane / 16) * 8 + lane % 8) * XROW
                      + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      const u32 s_lo = prmt(cur.lo[st], 0x1010), nc_lo = prmt(cur.lo[st], 0x3232);
      const u32 s_hi = prmt(cur.hi[st], 0x1010), nc_hi = prmt(cur.hi[st], 0x3232);
      const u32 words[8] = {cur.q[st][0].x, cur.q[st][0].y, cur.q[st][0].z, cur.q[st][0].w,
                            cur.q[st][1].x, cur.q[st][1].y, cur.q[st][1].z, cur.q[st][1].w};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        u32 a[4], b[4];
        dequant(words[s], s_lo, nc_lo, s_hi, nc_hi, a);
        ldmatrix_x4(b, xrow + st * 128 + s * 16);
        mma16816(acc0, a, b[0], b[1]);
        mma16816(acc1, a, b[2], b[3]);
      }
    }
    // C fragment: c0, c1 at (row g, tokens 2t, 2t + 1), c2, c3 at row g + 8; acc1: tokens + 8
    const float vals[8] = {acc0[0], acc0[1], acc0[2], acc0[3], acc1[0], acc1[1], acc1[2], acc1[3]};
    const int tile = item % tiles, split = item / tiles, row = (tile * WARPS + warp) * 16 + g;
    if (splits == 1) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int m = 2 * t + (e & 1) + (e >> 2) * 8, n = row + ((e >> 1) & 1) * 8;
        if (m < M) out[(size_t)m * N + n] = f32_to_bf16(vals[e]);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int m = 2 * t + (e & 1) + (e >> 2) * 8, n = row + ((e >> 1) & 1) * 8;
        partials[((size_t)split * 16 + m) * N + n] = vals[e];
      }
      __threadfence();
      __syncthreads();
      if (threadIdx.x == 0) last = atomicAdd(counters + tile, 1) == splits - 1;
      __syncthreads();
      if (last) {
        __threadfence();
        for (int e = threadIdx.x; e < 64 * 16; e += WARPS * 32) {  // the tile, in split order
          const int m = e / 64, n = tile * 64 + e % 64;
          float total = 0.f;
          for (int sp = 0; sp < splits; ++sp)
            total += __ldcg(partials + ((size_t)sp * 16 + m) * N + n);
          if (m < M) out[(size_t)m * N + n] = f32_to_bf16(total);
        }
        if (threadIdx.x == 0) counters[tile] = 0;  // ready for the next call: no memset
      }
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
    cur = nxt;
    item = next;
  }
}
"""


def compile_cuda(steps: int):
    """(kernel, seconds for NVRTC + module load, seconds to load the cubin alone: what a disk
    cache of the cubin would cost, registers). STEPS is #defined in the source."""
    import ctypes

    from torch.cuda._utils import _cuda_load_module, _get_gpu_runtime_library, _nvrtc_compile

    source = f"#define STEPS {steps}\n" + CUDA_SOURCE
    start = time.perf_counter()
    kernel = torch.cuda._compile_kernel(source, "w4a16_mma_sync", compute_capability="90a")
    first = time.perf_counter() - start
    cubin, name = _nvrtc_compile(source, "w4a16_mma_sync", compute_capability="90a")
    start = time.perf_counter()
    _cuda_load_module(cubin, [name])
    cached = time.perf_counter() - start
    regs = ctypes.c_int(-1)  # CU_FUNC_ATTRIBUTE_NUM_REGS = 4
    func = getattr(kernel, "func", None)
    if func is not None:
        _get_gpu_runtime_library().cuFuncGetAttribute(ctypes.byref(regs), 4, func)
    return kernel, first, cached, regs.value


def _grid(items: int, per_sm: int) -> int:
    """Programs: one per work item (per_sm 0), or a persistent grid of per_sm per SM."""
    if per_sm == 0:
        return items
    return min(items, per_sm * torch.cuda.get_device_properties().multi_processor_count)


def cuda_launcher(kernel, steps: int, n: int, k: int, m: int, per_sm: int = 0):
    split = k // (GROUP * steps)
    partials = torch.empty((split, 16, n), dtype=torch.float32, device="cuda")
    counters = torch.zeros(n // ROWS, dtype=torch.int32, device="cuda")
    smem = 2 * 16 * (steps * 128 + 8) * 2
    grid = _grid(n // ROWS * split, per_sm)

    def run(x, words, sz):
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        kernel(grid=(grid, 1, 1), block=(128, 1, 1),
               args=[words, sz, x, out, partials, counters, m, n, k], shared_mem=smem)  # fmt: skip
        return out

    return run


# ---- Gluon -------------------------------------------------------------------------------------

if GLUON_ERROR is None:
    _DEQUANT_ASM = gl.constexpr("""{
    .reg .b32 v, d, one, nz, m, e;
    mov.b32 m, 0x000f000f; mov.b32 e, 0x43004300; mov.b32 one, 0x3f803f80; mov.b32 nz, 0x80008000;
    lop3.b32 v, $8, m, e, 0xEA;
    fma.rn.bf16x2 d, v, one, $10; fma.rn.bf16x2 d, d, $9, nz; mov.b32 {$0, $1}, d;
    shr.u32 v, $8, 4; lop3.b32 v, v, m, e, 0xEA;
    fma.rn.bf16x2 d, v, one, $12; fma.rn.bf16x2 d, d, $11, nz; mov.b32 {$2, $3}, d;
    shr.u32 v, $8, 8; lop3.b32 v, v, m, e, 0xEA;
    fma.rn.bf16x2 d, v, one, $10; fma.rn.bf16x2 d, d, $9, nz; mov.b32 {$4, $5}, d;
    shr.u32 v, $8, 12; lop3.b32 v, v, m, e, 0xEA;
    fma.rn.bf16x2 d, v, one, $12; fma.rn.bf16x2 d, d, $11, nz; mov.b32 {$6, $7}, d;
    }""")

    @gluon.jit
    def _pair(sz, SEL: gl.constexpr):
        """A bf16 of each int32 twice: SEL 0x1010 the low half (scale), 0x3232 the high half."""
        return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, 0, {SEL};", "=r,r", [sz],
                                         dtype=gl.int32, is_pure=True, pack=1)  # fmt: skip

    @gluon.jit
    def _load_group(q_ptr, sz_ptr, r16, lane, kb, KB, ok):
        """Group kb's code words of 64 rows [128 = (warp, lane), 8] (two 16-byte loads per
        thread) and the scale/zero words of the rows g and g + 8 of each thread (if ok)."""
        WORDS: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
        s = gl.arange(0, 8, layout=gl.SliceLayout(0, WORDS))
        words = gl.load(q_ptr + (((r16 * KB + kb) * 32 + lane) * 8)[:, None] + s[None, :],
                        mask=ok, other=0)  # fmt: skip
        row = r16 * 16 + lane // 4
        sz_lo = gl.load(sz_ptr + row * KB + kb, mask=ok, other=0)
        return words, sz_lo, gl.load(sz_ptr + (row + 8) * KB + kb, mask=ok, other=0)

    @gluon.jit
    def _load_item(q_ptr, sz_ptr, x_ptr, x_smem, base, item, tiles, M, K,
                   STEPS: gl.constexpr):  # fmt: skip
        """Issue the loads of work item (64-row tile, split of STEPS groups): codes and scales
        into registers (a tuple of STEPS groups), x's slice into x_smem[base:base + STEPS] by
        cp.async (tokens >= M zero-filled, one commit group). Nothing waits; an item past the
        end loads nothing."""
        WORDS: gl.constexpr = gl.BlockedLayout([1, 8], [32, 1], [4, 1], [1, 0])
        XL: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        KB = K // 128
        ok = item < tiles * (KB // STEPS)
        tile = item % tiles
        kb0 = (item // tiles) * STEPS
        idx = gl.arange(0, 128, layout=gl.SliceLayout(1, WORDS))
        r16 = tile * 4 + idx // 32
        lane = idx % 32
        g0 = _load_group(q_ptr, sz_ptr, r16, lane, kb0, KB, ok)
        groups = (g0,)
        if STEPS >= 2:
            g1 = _load_group(q_ptr, sz_ptr, r16, lane, kb0 + 1, KB, ok)
            groups = (g0, g1)
        if STEPS >= 4:
            g2 = _load_group(q_ptr, sz_ptr, r16, lane, kb0 + 2, KB, ok)
            g3 = _load_group(q_ptr, sz_ptr, r16, lane, kb0 + 3, KB, ok)
            groups = (g0, g1, g2, g3)
        # after the codes: else ptxas hoists the cp.async wait above the code loads
        tok = gl.arange(0, 16, layout=gl.SliceLayout(1, XL))
        col = gl.arange(0, 128, layout=gl.SliceLayout(0, XL))
        for st in gl.static_range(STEPS):
            _async_load(x_smem.index(base + st),
                        x_ptr + tok[:, None] * K + ((kb0 + st) * 128 + col)[None, :],
                        mask=((tok < M) & ok)[:, None])  # fmt: skip
        async_copy.commit_group()
        return groups

    @gluon.jit
    def _group_weights(group, A: gl.constexpr):
        """A group's weights as the wgmma A operand [64, 128] bf16, decoded in registers."""
        words, sz_lo, sz_hi = group
        words, s_lo = gl.broadcast(words, _pair(sz_lo, 0x1010)[:, None])
        words, nc_lo = gl.broadcast(words, _pair(sz_lo, 0x3232)[:, None])
        words, s_hi = gl.broadcast(words, _pair(sz_hi, 0x1010)[:, None])
        words, nc_hi = gl.broadcast(words, _pair(sz_hi, 0x3232)[:, None])
        p = gl.inline_asm_elementwise(
            _DEQUANT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r", [words, s_lo, nc_lo, s_hi, nc_hi],
            dtype=(gl.bfloat16,) * 8, is_pure=True, pack=1,
        )  # fmt: skip
        # planes p[2i + h] [128 = (warp, g, t), 8 = s] -> [64 rows, 128 columns]:
        # row = 16 warp + 8 (i & 1) + g, column = 16 s + 8 (i >> 1) + 2 t + h. Only registers
        # are renamed: the layouts below are the A operand's (no shared memory, no shuffles).
        w = gl.join(gl.join(gl.join(p[0], p[1]), gl.join(p[2], p[3])),
                    gl.join(gl.join(p[4], p[5]), gl.join(p[6], p[7])))  # [128, 8, h, r8, c8]
        w = gl.reshape(w, [4, 8, 4, 8, 2, 2, 2])  # warp, g, t, s, h, r8, c8
        w = gl.permute(w, [0, 5, 1, 3, 6, 2, 4])  # warp, r8, g, s, c8, t, h
        return gl.convert_layout(gl.reshape(w, [64, 128]), A)

    @gluon.jit
    def _group_mma(acc, a_prev, group, x_tile, A: gl.constexpr):
        """Decode a group and issue its MMA; wait for the previous group's (whose A registers
        are then free): one MMA in flight while the next group decodes."""
        a = _group_weights(group, A)
        acc = warpgroup_mma(a, x_tile.permute((1, 0)), acc, is_async=True)
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
        return acc, a

    @gluon.jit
    def _group_mma_sync(acc, group, x_tile, A: gl.constexpr, B: gl.constexpr):
        """The same with mma.sync (mma_v2): x^T's fragments by ldmatrix, synchronous."""
        b = x_tile.permute((1, 0)).load(B)
        return mma_v2(_group_weights(group, A), b, acc)

    @gluon.jit
    def gluon_w4a16_wgmma(q_ptr, sz_ptr, x_ptr, out_ptr, part_ptr, cnt_ptr, M, N, K,
                          STEPS: gl.constexpr, SPLIT: gl.constexpr,
                          WGMMA: gl.constexpr):  # fmt: skip
        """The CUDA kernel's persistent loop over work items, in Gluon with wgmma (or, with
        WGMMA False, mma.sync as the CUDA kernel: the two languages on one instruction)."""
        gl.static_assert(STEPS == 1 or STEPS == 2 or STEPS == 4, "STEPS: 1, 2 or 4 groups")
        if WGMMA:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(
                version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
        else:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(
                version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        XS: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                rank=2)  # fmt: skip
        tiles = N // 64
        items = tiles * SPLIT
        item = gl.program_id(0)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STEPS, 16, 128], XS)
        cur = _load_item(q_ptr, sz_ptr, x_ptr, x_smem, 0, item, tiles, M, K, STEPS)
        buf = 0
        while item < items:
            nxt_item = item + gl.num_programs(0)
            nxt = _load_item(q_ptr, sz_ptr, x_ptr, x_smem, (1 - buf) * STEPS, nxt_item, tiles,
                             M, K, STEPS)  # fmt: skip
            async_copy.wait_group(1)  # this item's x has landed; the next item's may not
            fence_async_shared()
            _barrier()
            acc = gl.zeros([64, 16], gl.float32, MMA)
            if WGMMA:
                a_prev = gl.zeros([64, 128], gl.bfloat16, A)
                for st in gl.static_range(STEPS):
                    acc, a_prev = _group_mma(acc, a_prev, cur[st],
                                             x_smem.index(buf * STEPS + st), A)  # fmt: skip
                acc, a_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_prev))
            else:
                for st in gl.static_range(STEPS):
                    acc = _group_mma_sync(acc, cur[st], x_smem.index(buf * STEPS + st), A, B)
            tile = item % tiles
            rows = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
            toks = gl.arange(0, 16, layout=gl.SliceLayout(0, MMA))
            out_ptrs = out_ptr + toks[None, :] * N + rows[:, None]
            mask = (toks < M)[None, :] & (rows < N)[:, None]
            if SPLIT == 1:
                gl.store(out_ptrs, acc.to(gl.bfloat16), mask=mask)
            else:
                tile_ptrs = part_ptr + toks[None, :] * N + rows[:, None]
                gl.store(tile_ptrs + (item // tiles) * 16 * N, acc)
                _barrier()
                arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if arrived == SPLIT - 1:
                    total = gl.zeros([64, 16], gl.float32, MMA)
                    for sp in range(SPLIT):
                        total += gl.load(tile_ptrs + sp * 16 * N, cache_modifier=".cg")
                    gl.store(out_ptrs, total.to(gl.bfloat16), mask=mask)
                    gl.store(cnt_ptr + tile, 0)
            _barrier()  # every warp is done with this buffer before it is refilled
            cur = nxt
            item = nxt_item
            buf = 1 - buf


def gluon_launcher(steps: int, n: int, k: int, m: int, per_sm: int = 0, wgmma: bool = True):
    split = k // (GROUP * steps)
    partials = torch.empty((split, 16, n), dtype=torch.float32, device="cuda")
    counters = torch.zeros(n // ROWS, dtype=torch.int32, device="cuda")
    grid = _grid(n // ROWS * split, per_sm)

    def run(x, words, sz):
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        gluon_w4a16_wgmma[(grid,)](words, sz, x, out, partials, counters, m, n, k,
                                   STEPS=steps, SPLIT=split, WGMMA=wgmma,
                                   num_warps=4)  # fmt: skip
        return out

    return run


# ---- checks and timing -------------------------------------------------------------------------


def versions() -> str:
    import subprocess

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    cap = torch.cuda.get_device_capability()
    return (f"GPU: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}); driver {driver}; "
            f"torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"triton {triton.__version__}")  # fmt: skip


def capabilities() -> None:
    import inspect

    if GLUON_ERROR is not None:
        print(f"gluon: import failed: {GLUON_ERROR}")
    else:
        from triton.experimental.gluon.language.nvidia import hopper

        print("gluon hopper:", ", ".join(hopper.__all__))
        print("gluon layouts:", ", ".join(n for n in dir(gl) if n.endswith("Layout")))
    fn = getattr(torch.cuda, "_compile_kernel", None)
    print("torch.cuda._compile_kernel:", inspect.signature(fn) if fn else "missing")


def weight(n: int, k: int):
    from qshard.kernels.int4 import quantize_int4

    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed, scale, zero = quantize_int4(w, GROUP, symmetric=False)
    return packed, scale, zero


def timed(build, n: int, k: int, m: int) -> float:
    """Median us of one call, CUDA graphs, over weight copies that together exceed the L2."""
    from bench_fp8 import copies_for, time_us

    count = copies_for(n * k // 2, m)
    calls = [build(*weight(n, k)) for _ in range(count)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return time_us(lambda: [c(x) for c in calls], count)


def compile_gluon(steps: int, n: int, k: int, m: int, wgmma: bool):
    """(launcher, seconds of the first call (compile + load), seconds of a call after the
    in-memory cache is dropped (Triton's disk cache), registers, shared bytes)."""
    run = gluon_launcher(steps, n, k, m, wgmma=wgmma)
    words, sz = device_form(*weight(n, k), k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    times = []
    for drop in (False, True):
        if drop:
            gluon_w4a16_wgmma.device_caches.clear()
        start = time.perf_counter()
        run(x, words, sz)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    compiled = next(iter(next(iter(gluon_w4a16_wgmma.device_caches.values()))[0].values()))
    return run, times[0], times[1], compiled.n_regs, compiled.metadata.shared


def host_us(build, n: int, k: int, m: int) -> float:
    """Host time per eager call (no graph, the GPU never the bottleneck at this size): what the
    launch path costs a decode step that does not use CUDA graphs."""
    f = build(*weight(n, k))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        f(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(200):
        f(x)
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / 200 * 1e6


def nvrtc_without_toolkit() -> str:
    """torch's _compile_kernel on a machine with no CUDA toolkit (CUDA_HOME None, as after
    `pip install torch` alone): run in a child process with cpp_extension.CUDA_HOME = None."""
    import subprocess

    kernel = 'extern "C" __global__ void k(int* p) { *p = 1; }'
    code = ("import torch, torch.utils.cpp_extension as c; c.CUDA_HOME = None; "
            f"torch.cuda._compile_kernel({kernel!r}, 'k'); print('ok')")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return lines[-1][:160] if lines else f"exit {done.returncode}"


SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="o", help=f"comma-separated, of {list(SHAPES)}")
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--configs", default="2:0,4:0,4:2,4:4",
                        help="STEPS:PER_SM, STEPS 128-wide groups per work item, PER_SM programs "
                        "per SM of the persistent grid (0: one program per item)")  # fmt: skip
    parser.add_argument("--check-ms", default="1,7", help="token counts checked, not timed")
    args = parser.parse_args()
    m = args.m
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    print(versions())
    capabilities()
    print("NVRTC with CUDA_HOME = None:", nvrtc_without_toolkit())
    from qshard.kernels.int4 import dequantize_int4
    from qshard.kernels.loader import load_w4a16_ops

    load_w4a16_ops()
    cuda = {}
    for steps in sorted({steps for steps, _ in configs}):
        try:
            kernel, first, cached, regs = compile_cuda(steps)
            cuda[steps] = kernel
            print(f"compile nvrtc STEPS={steps}: first {first:.3f} s (NVRTC + load), "
                  f"cubin load {cached * 1e3:.2f} ms, {regs} registers")  # fmt: skip
        except Exception as e:
            print(f"compile nvrtc STEPS={steps}: fails: {type(e).__name__}: {e}"[:400])
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]

        def bf16_build(packed, scale, zero, k=k):
            w = dequantize_int4(packed, scale, zero, GROUP, k, torch.bfloat16)
            return lambda x: F.linear(x, w)

        def triton_build(packed, scale, zero):
            return lambda x: torch.ops.qshard.int4_linear(x, packed, scale, zero, None, GROUP)

        results = {}
        for name, build in {"bf16 F.linear (cuBLAS)": bf16_build,
                            "qshard Triton int4 (v8)": triton_build}.items():  # fmt: skip
            results[name] = (timed(build, n, k, m), None, host_us(build, n, k, m))
        launchers = {}
        for steps in sorted({steps for steps, _ in configs}):
            for wgmma in (False, True):
                if GLUON_ERROR is not None or k % (GROUP * steps):
                    continue
                kind = "wgmma" if wgmma else "mma.sync"
                try:
                    _, first, cached, regs, shared = compile_gluon(steps, n, k, m, wgmma)
                    print(f"compile gluon {kind} {shape} STEPS={steps}: first {first:.2f} s, "
                          f"from the disk cache {cached * 1e3:.0f} ms, {regs} registers, "
                          f"{shared} B shared")  # fmt: skip
                except Exception as e:
                    print(f"compile gluon {kind} STEPS={steps}: fails: {type(e).__name__}: {e}"[
                        :600])  # fmt: skip
        for steps, per_sm in configs:
            if k % (GROUP * steps):
                continue
            where = "one per item" if per_sm == 0 else f"persistent {per_sm}/SM"
            if steps in cuda:
                launchers[f"NVRTC mma.sync, STEPS={steps}, {where}"] = (
                    lambda mm, s=steps, p=per_sm, n=n, k=k: cuda_launcher(cuda[s], s, n, k, mm, p))
            if GLUON_ERROR is None:
                for wgmma in (False, True):
                    kind = "wgmma" if wgmma else "mma.sync"
                    launchers[f"Gluon {kind}, STEPS={steps}, {where}"] = (
                        lambda mm, s=steps, p=per_sm, n=n, k=k, w=wgmma: gluon_launcher(
                            s, n, k, mm, p, w))  # fmt: skip
        for name, make in launchers.items():
            run = make(m)

            def build(packed, scale, zero, run=run, k=k):
                words, sz = device_form(packed, scale, zero, k)
                return lambda x: run(x, words, sz)

            try:
                err = check(run, n, k, m)
                for extra_m in [int(v) for v in args.check_ms.split(",") if v]:
                    err = max(err, check(make(extra_m), n, k, extra_m))  # masking, not timed
                results[name] = (timed(build, n, k, m), err, host_us(build, n, k, m))
            except Exception as e:  # reported in the table
                results[name] = (f"fails: {type(e).__name__}: {e}"[:300], None)
        print_table(results, n, k, m)


def check(run, n: int, k: int, m: int) -> float:
    """Worst relative error vs the reference over two fresh draws (weights and inputs; the
    output poisoned by torch.empty's reuse; the second draw catches a split-K counter left
    behind). NaN or inf is inf."""
    from qshard.kernels.int4 import int4_linear_reference

    worst = 0.0
    for _ in range(2):
        packed, scale, zero = weight(n, k)
        words, sz = device_form(packed, scale, zero, k)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = int4_linear_reference(x, packed, scale, zero, GROUP).float()
        out = run(x, words, sz).float()
        bad = not torch.isfinite(out).all()
        worst = max(worst, float("inf") if bad else ((out - ref).norm() / ref.norm()).item())
    return worst


def print_table(results: dict, n: int, k: int, m: int) -> None:
    moved = n * k / 2 + n * (k // GROUP) * 4 + m * k * 2 + m * n * 2
    base = results["bf16 F.linear (cuBLAS)"][0]
    print(f"\n### int4 g128, N={n}, K={k}, M={m} (int4: {moved / 1e6:.2f} MB moved at least)\n")
    print("| kernel | us (graph) | vs bf16 | TB/s | rel err | host us/call |")
    print("|---|---|---|---|---|---|")
    for name, (t, err, *host) in results.items():
        if isinstance(t, str):
            print(f"| {name} | {t} | | | | |")
            continue
        bytes_ = n * k * 2 if name.startswith("bf16") else moved
        err_s = "" if err is None else f"{err:.1e}" + (" ok" if err < 1e-2 else " WRONG")
        host_s = f"{host[0]:.0f}" if host else ""
        print(f"| {name} | {t:.2f} | {base / t:.2f}x | {bytes_ / t / 1e6:.2f} | {err_s} | "
              f"{host_s} |")  # fmt: skip


if __name__ == "__main__":
    main()
