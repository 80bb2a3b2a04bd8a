"""The Gluon FP8 blockwise kernel (qshard/kernels/fp8_blockwise_gluon.py) against what the op ran
before it (the Triton small-M kernel up to 64 tokens, cuBLAS above) and bf16 F.linear, on the
Llama-3.1-8B layer; with --sweep, its K split count per shape. Notes:
docs/kernels/fp8_blockwise.md ("Gluon kernel").

    PYTHONPATH=$PWD python bench/bench_fp8_gluon.py [--ms 2,4,8,16,32,64,96,128]
        [--sweep 16,128] [--splits 1,2,3,4,6,8]
    compute-sanitizer --tool racecheck python bench/bench_fp8_gluon.py --check

    ncu --clock-control none --set full -k regex:_fp8_kernel --launch-skip 1 --launch-count 1 \
        python bench/bench_fp8_gluon.py --launch gate_up 16 [SPLITS]

--launch runs 3 launches of one Llama shape (for Nsight Compute); --check runs a few small
launches (each token tile, split and not, partial tiles and groups) against the reference
instead of timing: short enough for compute-sanitizer.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import LLAMA, copies_for, time_us, versions_line

import qshard
from qshard.kernels import fp8_blockwise as ref
from qshard.kernels.fp8_blockwise_gluon import gluon_config, gluon_launch
from qshard.kernels.fp8_blockwise_triton import act_quant_launch
from qshard.kernels.loader import load_gpu_ops


def bf16_linear(w):
    return lambda x: F.linear(x, w)


def op_with(backend: str):
    op = torch.ops.qshard.fp8_blockwise_linear
    return lambda q, s: lambda x: op(x, q, s, None, 128, 128, 128, False, backend)


def gluon_with(config: dict | None):
    return lambda q, s: lambda x: gluon_launch(x, q, s, None, False, config)


def timed(make, weights, x) -> float:
    fns = [make(*w) for w in weights]
    return time_us(lambda: [f(x) for f in fns], len(fns))


def check() -> None:
    """Small launches against the reference (for compute-sanitizer), each printed."""
    for m, n, k, splits in ((2, 200, 400, 1), (16, 256, 1040, 3), (33, 130, 512, 2),
                            (64, 384, 256, 1), (128, 256, 640, 4), (100, 128, 128, 1)):
        qdata, scale = ref.quantize_weight_blockwise(
            torch.randn(n, k, device="cuda") * 0.02, (128, 128), qshard.ScaleFormat.FP32)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        config = {**gluon_config(m, n, k, x.device), "SPLITS": splits}
        out = gluon_launch(x, qdata, scale, bias, False, config)
        expected = ref.fp8_blockwise_linear_reference(
            x, qdata, scale, block_size=(128, 128), act_group_size=128,
            scale_format=qshard.ScaleFormat.FP32, weight_only=False, bias=bias)  # fmt: skip
        error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
        print(f"check M={m} N={n} K={k} {config}: relative error {error:.2e}", flush=True)
        assert error < 1e-2, error


def launch(shape: str, m: int, splits: int | None) -> None:
    n, k = LLAMA[shape]
    qdata, scale = ref.quantize_weight_blockwise(
        torch.randn(n, k, device="cuda") * 0.02, (128, 128), qshard.ScaleFormat.FP32)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    config = gluon_config(m, n, k, x.device)
    if splits:
        config["SPLITS"] = splits
    for _ in range(3):
        gluon_launch(x, qdata, scale, None, False, config)
    torch.cuda.synchronize()
    print(shape, m, config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--launch", nargs="+", metavar=("SHAPE", "M"))
    parser.add_argument("--ms", default="1,2,4,8,16,32,64,96,128")
    parser.add_argument("--sweep", default="", help="token counts to sweep the split count at")
    parser.add_argument("--splits", default="1,2,3,4,6,8")
    args = parser.parse_args()
    load_gpu_ops()
    if args.check:
        return check()
    if args.launch:
        shape, m, *splits = args.launch
        return launch(shape, int(m), int(splits[0]) if splits else None)
    print(versions_line([]))
    ms = [int(m) for m in args.ms.split(",")]
    sweep_ms = {int(m) for m in args.sweep.split(",") if m}
    totals: dict[int, dict[str, float]] = {m: {} for m in ms}
    for name, (n, k) in LLAMA.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        count = copies_for(n * k, 1)
        dense = [(w if i == 0 else w.clone(),) for i in range(count)]
        weights = [ref.quantize_weight_blockwise(d[0], (128, 128), qshard.ScaleFormat.FP32)
                   for d in dense]  # fmt: skip
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            backend = "triton" if m <= 64 else "cublas"
            row = {
                "bf16": timed(bf16_linear, dense, x),
                "auto (before)": timed(op_with(backend), weights, x),
                "gluon": timed(gluon_with(None), weights, x),
                "act quant": time_us(lambda x=x: act_quant_launch(x, 128, False), 1),
            }
            config = gluon_config(m, n, k, x.device)
            if m in sweep_ms:
                for splits in (int(s) for s in args.splits.split(",")):
                    c = {**config, "SPLITS": splits}
                    row[f"splits={splits}"] = timed(gluon_with(c), weights, x)
            print(f"{name:8s} M={m:4d} {config}  " + "  ".join(
                f"{key} {value:7.1f}" for key, value in row.items()), flush=True)  # fmt: skip
            for key in ("bf16", "auto (before)", "gluon"):
                totals[m][key] = totals[m].get(key, 0.0) + row[key]
        del weights, dense
    print("\nLlama-3.1-8B layer summed (us; speedup over bf16)")
    for m in ms:
        t = totals[m]
        print(f"M={m:4d}  " + "  ".join(
            f"{key} {value:7.1f} ({t['bf16'] / value:.2f}x)" for key, value in t.items()))


if __name__ == "__main__":
    main()
