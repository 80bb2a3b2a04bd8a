"""The wgmma register kernel (w4a16_gluon_wgmma.py, v8) against the warp-specialized mma.sync
kernel (w4a16_gluon_ws.py, v6, "ws": its default config), the Triton kernel ("triton": the op's
default config), the op's own choice ("op") and bf16 F.linear, on the Llama-3.1-8B layer; each
result checked against the reference first. Notes: docs/kernels/w4a16_register.md, "Session 23"
and "Session 24" (`--configs=-:-:-:1` copies x as v7 did: permuted beforehand, then by TMA).

    PYTHONPATH=$PWD python bench/bench_register_wgmma.py [--ms 16,32,64,128]
        [--shapes qkv,o,gate_up,down] [--format int4|mxfp4|nvfp4]
        [--configs=STEPS:STAGES:GROUP_CHUNKS:X_BY_TMA,...]

Timed as bench_fp8.py does (CUDA-graph median per call, weight copies rotated past the L2).
Prints per shape and M each method's time, then per M the layer's sums and speedups over bf16
("wgmma best": the best config per shape). `--launch SHAPE M
STEPS:STAGES:GROUP_CHUNKS:X_BY_TMA|default` only launches it twice (for Nsight Compute).
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
from bench_register_ws import reference

from qshard.kernels.w4a16_gluon_wgmma import wgmma_config, wgmma_launch
from qshard.kernels.w4a16_gluon_ws import ws_launch

KEYS = ("STEPS", "STAGES", "GROUP_CHUNKS", "X_BY_TMA")
LAYER_KEYS = ("bf16", "op", "triton", "ws", "wgmma default", "wgmma best")  # summed per M


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="16,32,64,128")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--configs", default="")
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    parser.add_argument("--launch", nargs=3, metavar=("SHAPE", "M", "CONFIG"))
    args = parser.parse_args()
    if args.launch:
        return launch(*args.launch, FORMATS[args.format])
    print(versions_line([]))
    configs = [parse_config(c, KEYS) for c in args.configs.split(",") if c]
    sums: dict[tuple[int, str], float] = {}
    for name in args.shapes.split(","):
        n, k, fmt, group, parts, weights, dense = layer_weights(name, args.format)
        exact = reference(fmt, *parts, group, k)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ exact.T
            row = baseline_row(fmt, group, n, k, weights, dense, x)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            row["ws"] = timed(lambda q, s, z, gs, f=fmt, gr=group, o=out: (
                lambda a: ws_launch(int(f), a, q, s, z, None, o, gr, None, gs)),
                weights, x)  # fmt: skip
            sweep_configs(row, "wgmma", f"{name} M={m}", wgmma_config(m, n, k, x.device),
                          configs, KEYS,
                          lambda a, q, s, z, gs, o, c, f=int(fmt), gr=group: wgmma_launch(
                              f, a, q, s, z, None, o, gr, c, gs),
                          want, weights, x)  # fmt: skip
            cells = "  ".join(f"{key} {v:.2f}" for key, v in row.items())
            print(f"{name} {n}x{k} M={m}: {cells}", flush=True)
            add_to_layer(sums, m, row, LAYER_KEYS)
    print_layer(sums)


def launch(shape: str, m: str, config: str, fmt_group_quantize) -> None:
    """Two launches of one config (for Nsight Compute and compute-sanitizer), each checked
    against the reference; SHAPE a Llama layer's name or NxK."""
    n, k = LLAMA[shape] if shape in LLAMA else map(int, shape.split("x"))
    fmt, group, quantize = fmt_group_quantize
    q, s, z, g = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
    x = torch.randn(int(m), k, device="cuda", dtype=torch.bfloat16)
    want = x.float() @ reference(fmt, q, s, z, g, group, k).T
    z, g = (q if t is None else t for t in (z, g))
    given = {} if config == "default" else parse_config(config, KEYS)
    config = {**wgmma_config(int(m), n, k, x.device), **given}
    for _ in range(2):
        out = torch.empty(int(m), n, device="cuda", dtype=torch.bfloat16)
        wgmma_launch(int(fmt), x, q, s, z, None, out, group, config, g)
        err = ((out.float() - want).norm() / want.norm()).item()
        print(f"{shape} M={m} {config}: relative error {err:.3g}", flush=True)


if __name__ == "__main__":
    main()
