"""The FP8 blockwise M = 128 experiment of session 7 (bench/README.md, docs/kernels/
fp8_blockwise.md): variants of the swapped small-M kernel against cuBLAS on the Llama-3.1-8B
layer's shapes, each checked against cuBLAS (relative error) and timed like bench_fp8.py. None
beat cuBLAS, so none is in the library; kept to reproduce the numbers.

    python bench/fp8_m128_variants.py            # M=128 (env M=...), every variant, per shape
    SHAPE=gate_up M=16 ncu --clock-control none -k regex:_small_m_kernel \
        python bench/fp8_m128_variants.py --ncu auto   # one variant's launches, for Nsight
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench_fp8 import LLAMA, copies_for, time_us

import qshard
from qshard.kernels import fp8_blockwise as ref
from qshard.kernels.fp8_blockwise_gpu import cublas_linear
from qshard.kernels.fp8_blockwise_triton import act_quant_launch, linear_launch, small_m_config
from qshard.kernels.split_k import finish_tile, split_count, workspace


@triton.jit
def _k_unroll2(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    partials_ptr,
    arrived_ptr,
    M,
    N,
    K,
    groups_per_split,
    stride_wsn,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first = tl.program_id(1) * groups_per_split
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    offs_k = first * GROUP + tl.arange(0, GROUP)
    x_ptrs = x_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None] * K + offs_k[None, :]
    ws_ptrs = ws_ptr + (offs_n // 128) * stride_wsn
    last = tl.minimum(first + groups_per_split, tl.cdiv(K, GROUP))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in range(first, last, 2):
        x0 = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w0 = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        x1 = tl.load(x_ptrs + GROUP, mask=m_ok[:, None], other=0.0)
        w1 = tl.load(w_ptrs + GROUP, mask=n_ok[:, None], other=0.0)
        s0 = tl.load(xs_ptr + g * M + offs_m, mask=m_ok, other=0.0)
        s1 = tl.load(xs_ptr + (g + 1) * M + offs_m, mask=m_ok, other=0.0)
        v0 = tl.load(ws_ptrs + g, mask=n_ok, other=0.0)
        v1 = tl.load(ws_ptrs + g + 1, mask=n_ok, other=0.0)
        p0 = tl.dot(w0, tl.trans(x0))
        p1 = tl.dot(w1, tl.trans(x1))
        acc += p0 * (v0[:, None] * s0[None, :])
        acc += p1 * (v1[:, None] * s1[None, :])
        x_ptrs += 2 * GROUP
        w_ptrs += 2 * GROUP
    finish_tile(
        acc,
        partials_ptr,
        arrived_ptr,
        out_ptr,
        out_ptr,
        offs_n,
        offs_m,
        n_ok,
        m_ok,
        M,
        N,
        N,
        False,
        SPLIT,
    )


@triton.jit
def _k_tma(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    partials_ptr,
    arrived_ptr,
    M,
    N,
    K,
    groups_per_split,
    stride_wsn,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    GROUP: tl.constexpr,
    SPLIT: tl.constexpr,
    STAGES: tl.constexpr,
    WS: tl.constexpr,
):
    x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [K, 1], [BLOCK_M, GROUP])
    w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [K, 1], [BLOCK_N, GROUP])
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(2) * BLOCK_M
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    first = tl.program_id(1) * groups_per_split
    last = tl.minimum(first + groups_per_split, tl.cdiv(K, GROUP))
    ws_ptrs = ws_ptr + (offs_n // 128) * stride_wsn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for g in tl.range(first, last, num_stages=STAGES, warp_specialize=WS):
        w = w_desc.load([n0, g * GROUP])
        xq = x_desc.load([m0, g * GROUP])
        s = tl.load(xs_ptr + g * M + offs_m, mask=m_ok, other=0.0)
        v = tl.load(ws_ptrs + g, mask=n_ok, other=0.0)
        p = tl.dot(w, tl.trans(xq))
        acc += p * (v[:, None] * s[None, :])
    finish_tile(
        acc,
        partials_ptr,
        arrived_ptr,
        out_ptr,
        out_ptr,
        offs_n,
        offs_m,
        n_ok,
        m_ok,
        M,
        N,
        N,
        False,
        SPLIT,
    )


def launch(kernel, x, q, s, block_n, block_m, waves, warps, stages, **extra):
    m, k = x.shape
    n = q.shape[0]
    xq, xs = act_quant_launch(x, 128, False)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    groups = k // 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = split_count(tiles, groups, 4, waves, x.device)
    gps = triton.cdiv(groups, split)
    gps += gps % 2
    split = triton.cdiv(groups, gps)
    partials, arrived = workspace(m, n, split, tiles, x.device) if split > 1 else (out, out)
    grid = (triton.cdiv(n, block_n), split, triton.cdiv(m, block_m))
    kernel[grid](
        xq,
        xs,
        q,
        s,
        out,
        partials,
        arrived,
        m,
        n,
        k,
        gps,
        s.stride(0),
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        GROUP=128,
        SPLIT=split > 1,
        num_warps=warps,
        num_stages=stages,
        **extra,
    )
    return out


def main():
    triton.set_allocator(
        lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda")
    )
    device = torch.device("cuda")
    m = int(os.environ.get("M", 128))
    weights = {}
    for name, (n, k) in LLAMA.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        weights[name] = ref.quantize_weight_blockwise(w, (128, 128), qshard.ScaleFormat.FP32)
    ncu = "--ncu" in sys.argv
    variants = {
        "cublas": lambda x, q, s: cublas_linear(x, q, s, None, False),
        "auto": lambda x, q, s: linear_launch(x, q, s, None, 128, 128, 128, False),
    }
    for bn, mx, waves, stages, warps in [
        (128, 128, 1, 3, 8),
        (128, 128, 2, 3, 8),
        (64, 128, 2, 4, 4),
    ]:
        variants[f"small-m {bn}x{mx} w{waves} s{stages} {warps}warps"] = (
            lambda x, q, s, a=(bn, mx, waves, stages, warps): linear_launch(
                x,
                q,
                s,
                None,
                128,
                128,
                128,
                False,
                small_m_config(
                    m,
                    q.shape[0],
                    x.shape[1],
                    128,
                    device,
                    block_n=a[0],
                    waves=a[2],
                    num_stages=a[3],
                    num_warps=a[4],
                    prequant=True,
                    max_block_m=a[1],
                ),
            )
        )
    for bn, bm, waves, stages, warps in [
        (128, 128, 1, 3, 8),
        (128, 128, 2, 3, 8),
        (64, 128, 2, 4, 4),
        (128, 64, 2, 4, 4),
    ]:
        variants[f"unroll2 {bn}x{bm} w{waves} s{stages} {warps}warps"] = (
            lambda x, q, s, a=(bn, bm, waves, stages, warps): launch(_k_unroll2, x, q, s, *a)
        )
    for bn, bm, waves, stages, warps, ws in [
        (128, 128, 1, 4, 8, False),
        (128, 128, 2, 3, 8, False),
        (64, 128, 2, 4, 4, False),
        (128, 128, 1, 3, 8, True),
        (128, 128, 1, 4, 4, True),
        (64, 128, 2, 4, 4, True),
    ]:
        variants[f"tma {bn}x{bm} w{waves} s{stages} {warps}warps ws={ws}"] = (
            lambda x, q, s, a=(bn, bm, waves, 1, warps), st=stages, ws=ws: launch(
                _k_tma, x, q, s, *a, STAGES=st, WS=ws
            )
        )
    if ncu:
        shape = os.environ.get("SHAPE", "gate_up")
        x = torch.randn(m, LLAMA[shape][1], device="cuda", dtype=torch.bfloat16)
        q, s = weights[shape]
        for name in sys.argv[2:] or ["cublas"]:
            for _ in range(3):
                variants[name](x, q, s)
        torch.cuda.synchronize()
        return
    for name, fn in variants.items():
        per = []
        try:
            for shape, (n, k) in LLAMA.items():
                q, s = weights[shape]
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                want = cublas_linear(x, q, s, None, False).float()
                got = fn(x, q, s).float()
                err = ((got - want).norm() / want.norm()).item()
                count = copies_for(n * k, m)
                copies = [(q.clone(), s.clone()) for _ in range(count)]
                run = lambda f=fn, x=x, c=copies: [f(x, a, b) for a, b in c]  # noqa: E731
                per.append(time_us(run, count))
            print(
                f"M={m} {name}: {sum(per):.1f} us "
                f"({'/'.join(f'{p:.1f}' for p in per)}) err {err:.1e}",
                flush=True,
            )
        except Exception as e:
            print(f"M={m} {name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
