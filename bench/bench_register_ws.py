"""The warp-specialized register kernel (w4a16_gluon_ws.py) against the register kernel it
builds on (w4a16_gluon.py, "reg"), the Triton kernel ("triton": the op's default config), the
op's own choice ("op") and bf16 F.linear, on the Llama-3.1-8B layer; each result checked
against the reference first. Notes: docs/kernels/w4a16_register.md, "Session 19" and "Session
20".

    PYTHONPATH=$PWD python bench/bench_register_ws.py [--ms 2,4,8,16,32,64]
        [--shapes qkv,o,gate_up,down] [--format int4|mxfp4|nvfp4]
        [--configs STEPS:STAGES:PER_SM:WARPS:MAXNREG,...]

Timed as bench_fp8.py does (CUDA-graph median per call, weight copies rotated past the L2).
Prints per shape and M each method's time, then per M the layer's sums and speedups over bf16
("ws best": the best config per shape).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import LLAMA, versions_line
from bench_register import (
    FORMATS,
    add_to_layer,
    baseline_row,
    layer_weights,
    parse_config,
    print_layer,
    sweep_configs,
    timed,
)

from qshard.kernels import int4, mxfp4, nvfp4
from qshard.kernels.w4a16_gluon import register_launch
from qshard.kernels.w4a16_gluon_ws import ws_config, ws_launch
from qshard.kernels.w4a16_triton import Format


def reference(fmt: Format, q, s, z, g, group: int, k: int) -> torch.Tensor:
    """The format's dequantized weight (fp32), from its reference module."""
    if fmt == Format.MXFP4:
        return mxfp4.dequantize_mxfp4(q, s, group, k, torch.float32)
    if fmt == Format.NVFP4:
        return nvfp4.dequantize_nvfp4(q, s, g, group, k, torch.float32)
    return int4.dequantize_int4(q, s, z, group, k, torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="2,4,8,16,32,64")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--configs", default="8:4:1:8:0,4:6:1:8:0,16:8:1:8:0,8:8:1:8:0")
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    parser.add_argument("--launch", nargs=3, metavar=("SHAPE", "M", "CONFIG"),
                        help="only launch the kernel (twice: for Nsight Compute)")
    args = parser.parse_args()
    if args.launch:
        return launch(*args.launch, FORMATS[args.format])
    print(versions_line([]))
    configs = [parse_config(c, KEYS) for c in args.configs.split(",")]
    sums: dict[tuple[int, str], float] = {}
    for name in args.shapes.split(","):
        n, k, fmt, group, parts, weights, dense = layer_weights(name, args.format)
        exact = reference(fmt, *parts, group, k)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ exact.T
            row = baseline_row(fmt, group, n, k, weights, dense, x)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            row["reg"] = timed(lambda q, s, z, gs, f=fmt, gr=group, o=out: (
                lambda a: register_launch(int(f), a, q, s, z, None, o, gr, None, gs)),
                weights, x)  # fmt: skip
            sweep_configs(row, "ws", f"{name} M={m}", ws_config(m, n, k, x.device, int(fmt)),
                          configs, KEYS,
                          lambda a, q, s, z, gs, o, c, f=int(fmt), gr=group: ws_launch(
                              f, a, q, s, z, None, o, gr, c, gs),
                          want, weights, x)  # fmt: skip
            cells = "  ".join(f"{key} {v:.2f}" for key, v in row.items())
            print(f"{name} {n}x{k} M={m}: {cells}", flush=True)
            add_to_layer(sums, m, row, ("bf16", "op", "triton", "reg", "ws default", "ws best"))
    print_layer(sums)


KEYS = ("STEPS", "STAGES", "PER_SM", "WARPS", "MAXNREG")


def launch(shape: str, m: str, config: str, fmt_group_quantize) -> None:
    """Two launches of one config (for Nsight Compute and compute-sanitizer), each checked
    against the reference; SHAPE a Llama layer's name or NxK."""
    n, k = LLAMA[shape] if shape in LLAMA else map(int, shape.split("x"))
    fmt, group, quantize = fmt_group_quantize
    q, s, z, g = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    want = torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16)
    x, want = want, want.float() @ reference(fmt, q, s, z, g, group, k).T
    z, g = (q if t is None else t for t in (z, g))
    config = {**ws_config(int(m), n, k, x.device, int(fmt)), **parse_config(config, KEYS)}
    for _ in range(2):
        out = torch.empty(int(m), n, device="cuda", dtype=torch.bfloat16)
        ws_launch(int(fmt), x, q, s, z, None, out, group, config, g)
        err = ((out.float() - want).norm() / want.norm()).item()
        print(f"{shape} M={m} {config}: relative error {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
