"""FP8 blockwise W8A8 linears vs bf16 and the alternatives, activation quantization included.

    python bench/bench_fp8.py            # the table (bench/README.md)
    python bench/bench_fp8.py --sweep    # also: Triton tile configs per (M, shape), best first

Shapes: the four linears of a Llama-3.1-8B layer (summed) and DeepSeek-V3's
24576x7168, 7168x2048, 18432x7168, 7168x18432; M in {1, 16, 128, 2048, 4096}. Each method is
timed with CUDA graphs (triton.testing.do_bench_cudagraph, median), over enough weight copies
that their total exceeds the 50 MB L2, so small-M numbers measure HBM, not cache.

Methods: bf16 F.linear (cuBLAS); qshard auto / triton / cublas; torch's cuBLAS blockwise
scaled_mm with the activation quantization in plain torch; torchao blockwise FP8
(Float8DynamicActivationFloat8WeightConfig, PerBlock 1x128 / 128x128); gemlite fp8 dynamic
(per-channel, A8W8_fp8_dynamic); and per-row FP8 (one scale per weight row, per-token
activations): qshard's Fp8RowwiseTensor eager and compiled, torchao PerRow. Missing optional
packages are reported, not silently skipped.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from harness import (
    DEEPSEEK,
    LLAMA,
    MS,
    best_four,
    bf16_method,
    copies_for,
    load_gemlite_config,
    measure,
    sweep_results,
    time_us,
    versions_line,
)

import qshard
from qshard.kernels import fp8_blockwise as ref
from qshard.kernels.loader import load_gpu_ops

# ---- methods: each builds per-weight state and returns a callable x -> y ----------------------


def qshard_method(backend):
    def build(w):
        qdata, scale = ref.quantize_weight_blockwise(w, (128, 128), qshard.ScaleFormat.FP32)
        op = torch.ops.qshard.fp8_blockwise_linear
        return lambda x: op(x, qdata, scale, None, 128, 128, 128, False, backend)

    return build


def torch_cublas_method(w):
    """cuBLAS blockwise with plain-torch activation quantization (the issue's baseline)."""
    qdata, scale = ref.quantize_weight_blockwise(w, (128, 128), qshard.ScaleFormat.FP32)

    def run(x):
        m = x.shape[0]
        pad = -m % 16
        xp = F.pad(x, (0, 0, 0, pad)) if pad else x
        q, s = ref.quantize_activation_groups(xp, 128, qshard.ScaleFormat.FP32)
        s = torch.empty_strided(s.shape, (1, s.shape[0]), device=s.device).copy_(s)
        out = F.scaled_mm(
            q,
            qdata.t(),
            s,
            F.ScalingType.BlockWise1x128,
            scale.t(),
            F.ScalingType.BlockWise128x128,
            output_dtype=x.dtype,
        )
        return out[:m]

    return run


def torchao_method(w):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerBlock
    from torchao.quantization import quantize_ as ao_quantize

    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
    linear.weight.data.copy_(w)
    granularity = [PerBlock([1, 128]), PerBlock([128, 128])]
    config = Float8DynamicActivationFloat8WeightConfig(granularity=granularity)
    ao_quantize(linear, config)
    return linear


def qshard_perrow_method(compiled: bool):
    """qshard's FP8 per-row layout through F.linear (cuBLAS row-wise scaled_mm; the per-token
    activation quantization is plain torch ops, fused into one kernel when compiled)."""

    linear = torch.compile(F.linear, fullgraph=True, dynamic=False) if compiled else F.linear

    def build(w):
        weight = qshard.Fp8RowwiseTensor.from_float(w)
        return lambda x: linear(x, weight)

    return build


def torchao_perrow_method(w):
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow
    from torchao.quantization import quantize_ as ao_quantize

    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
    linear.weight.data.copy_(w)
    ao_quantize(linear, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return linear


def gemlite_method(w):
    from gemlite.helper import A8W8_fp8_dynamic

    load_gemlite_config()
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
    linear.weight.data.copy_(w)
    return A8W8_fp8_dynamic(device="cuda", dtype=w.dtype).from_linear(linear)


METHODS = {
    "bf16": bf16_method,
    "qshard-auto": qshard_method("auto"),
    "qshard-triton": qshard_method("triton"),
    "qshard-cublas": qshard_method("cublas"),
    "torch-cublas-blockwise": torch_cublas_method,
    "torchao-blockwise": torchao_method,
    "gemlite-fp8-perchannel": gemlite_method,
    "qshard-perrow": qshard_perrow_method(compiled=False),
    "qshard-perrow-compiled": qshard_perrow_method(compiled=True),
    "torchao-perrow": torchao_perrow_method,
}


def table(shapes: dict, title: str, methods, ms=MS) -> None:
    print(f"\n### {title}\n")
    print("| method | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    base = {m: measure(bf16_method, shapes, m) for m in ms}
    for method in methods:
        cells = []
        for m in ms:
            t = base[m] if method == "bf16" else measure(METHODS[method], shapes, m)
            if isinstance(t, str):
                cells.append(t)
            else:
                flops = 2 * m * sum(n * k for n, k in shapes.values())
                cells.append(f"{t:.0f} us ({base[m] / t:.2f}x, {flops / t / 1e6:.0f} TF/s)")
        print(f"| {method} | " + " | ".join(cells) + " |", flush=True)
    print_choices(shapes, ms)


def print_choices(shapes: dict, ms) -> None:
    """The kernel the op runs at each M on each shape (`kernels/fp8/select.py`)."""
    from qshard.kernels.fp8.select import choose

    for name, (n, k) in shapes.items():
        q = torch.empty(n, k, device="cuda", dtype=torch.float8_e4m3fn)
        picks = [
            choose(torch.empty(m, k, device="cuda", dtype=torch.bfloat16), q, 128, 128, 128)
            for m in ms
        ]
        print(
            f"- the op's kernel on {name}: "
            + ", ".join(f"M={m} {c.kernel.value}" for m, c in zip(ms, picks, strict=True))
        )


GEMV_SWEEP = [
    dict(BLOCK_N=n, GROUPS_PER_STEP=g, num_warps=4, num_stages=3) for n, g in [(16, 8), (8, 8)]
]
SMALL_M_SWEEP = [  # (weight rows per tile, programs per SM, stages, warps, act quant apart, tokens)
    (128, 2, 4, 8, False, 64),
    (128, 2, 4, 8, True, 64),
    (64, 4, 4, 4, True, 64),
    (64, 4, 4, 4, False, 64),
    (128, 2, 3, 8, True, 64),
    (64, 2, 4, 4, False, 64),
    (128, 2, 3, 8, True, 128),
    (128, 1, 3, 8, True, 128),
    (64, 2, 3, 4, True, 128),
]
GEMM_SWEEP = [
    dict(BLOCK_M=64, BLOCK_N=64, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4),
]
SWEEP_MS = (1, 4, 16, 32, 64, 128, 256)


def sweep_candidates(m: int):
    """(name, config for one (n, k) shape or None for cuBLAS) to try at M = m."""
    from qshard.kernels.fp8.small_m import config as small_m_config

    device = torch.device("cuda", torch.cuda.current_device())
    yield "cublas", lambda n, k: None
    if m <= 2:
        for c in GEMV_SWEEP:
            yield f"gemv {c['BLOCK_N']}x{c['GROUPS_PER_STEP']}", lambda n, k, c=c: c
    if m <= 256:
        for bn, waves, stages, warps, prequant, max_m in SMALL_M_SWEEP:
            if max_m > 64 and m <= 64:
                continue
            name = f"small-m {bn}x{max_m} {waves} waves {stages} stages {warps} warps"
            name += " prequant" if prequant else " fused"
            args = dict(block_n=bn, waves=waves, num_stages=stages, num_warps=warps)
            args.update(prequant=prequant, max_block_m=max_m)
            yield name, lambda n, k, a=args: small_m_config(m, n, k, 128, device, **a)
    if m >= 128:
        for c in GEMM_SWEEP[1:2]:
            yield f"gemm {c['BLOCK_M']}x{c['BLOCK_N']}", lambda n, k, c=c: c


def sweep(shapes: dict, sweep_ms=SWEEP_MS) -> None:
    """Every kernel and config per M over the shapes (summed us), best first, with cuBLAS."""
    from qshard.kernels.fp8.cublas import launch as cublas_linear
    from qshard.kernels.fp8.ops import triton_linear_launch as linear_launch

    print("\n### Kernel and config sweep (Llama-3.1-8B layer, summed us)\n")
    weights = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        weights[name] = [ref.quantize_weight_blockwise(w, (128, 128), qshard.ScaleFormat.FP32)]

    def time_shape(name, n, k, m, config):
        count = copies_for(n * k, m)
        copies = weights[name]
        copies += [(q.clone(), s.clone()) for q, s in copies[:1] * (count - len(copies))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if config is None:
            fn = lambda c=copies[:count]: [cublas_linear(x, q, s, None, False) for q, s in c]  # noqa: E731
        else:
            fn = lambda c=copies[:count]: [  # noqa: E731
                linear_launch(x, q, s, None, 128, 128, 128, False, config) for q, s in c
            ]
        return time_us(fn, count)

    for m, results in sweep_results(sweep_ms, shapes, sweep_candidates, time_shape):
        cublas = next((f"{r[0]:.0f} us" for r in results if r[1] == "cublas"), "fails")
        print(f"- M={m}: cuBLAS {cublas}; best: {best_four(results)}", flush=True)


def act_quant_bandwidth() -> None:
    """The activation-quantization kernel alone at large M (part of every cuBLAS call)."""
    from qshard.kernels.fp8.act_quant import act_quant_launch

    print("\n### Activation quantization kernel alone\n")
    for m, k in ((4096, 7168), (8192, 4096), (4096, 14336)):  # each moves more than the L2
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        t = time_us(lambda x=x: act_quant_launch(x, 128, False), 1)
        moved = m * k * 2 + m * k + m * (k // 128) * 4
        print(f"- M={m}, K={k}: {t:.1f} us, {moved / t / 1e6:.2f} TB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--tables", default="llama,deepseek,deepseek-4096")  # "" for none
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--sweep-ms", default=",".join(map(str, SWEEP_MS)))
    args = parser.parse_args()
    load_gpu_ops()
    print(versions_line(("torchao", "gemlite")))
    methods = args.methods.split(",")
    ms = tuple(int(m) for m in args.ms.split(","))
    if args.sweep:
        sweep(LLAMA, tuple(int(m) for m in args.sweep_ms.split(",")))
        act_quant_bandwidth()
    tables = args.tables.split(",") if args.tables else []
    if "llama" in tables:
        table(LLAMA, "Llama-3.1-8B layer (qkv, o, gate_up, down summed)", methods, ms)
    if "deepseek" in tables:
        table(DEEPSEEK, "DeepSeek-V3 shapes (summed)", methods, ms)
    if "deepseek-4096" in tables:
        single = {"24576x7168": DEEPSEEK["24576x7168"]}
        table(single, "DeepSeek-V3 24576x7168", methods, (4096,))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
