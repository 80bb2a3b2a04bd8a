"""The one-token int4 GEMVs on the Llama-3.1-8B layer: the Gluon tensor-core GEMV (gemv_mma.py,
an experiment: its default and the configs given) against the Triton word GEMV the op runs
("triton", also "op") and bf16 F.linear; each result checked against the reference first (a
wrong one is reported and not timed). Notes: docs/kernels/w4a16.md, "v10 (session 22)".

    PYTHONPATH=$PWD python bench/bench_gemv.py [--shapes qkv,o,gate_up,down]
        [--configs WARPS:TILES,...] [--native BLOCK_N:BLOCK_W:SPLIT_K:PREFETCH,...] [--no-gluon]

--native: the word GEMV on the codes in the native order (what an int4 g128 weight holds on
Hopper, layouts/int4.py): the op's config for them (`native_choice`), then each config given
("native default", "native best"); "op" and "triton" are the canonical codes'.

Timed as bench_fp8.py does (CUDA-graph median per call, weight copies rotated past the L2).
Prints per shape each method's time, then the layer's sums, speedups over bf16 and fractions
of the copy bandwidth measured here (the bytes of the codes, scales, zeros and the activations:
the floor any GEMV has to move).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import versions_line
from bench_int4 import machine_limits
from bench_register import baseline_row, layer_weights, parse_config, sweep_configs
from bench_register_ws import reference
from gemv_mma import gluon_gemv_config, gluon_gemv_launch

from qshard.kernels.packing import native_codes
from qshard.kernels.w4a16_triton import linear_launch, native_choice

KEYS = ("WARPS", "TILES")
WORD_KEYS = ("BLOCK_N", "BLOCK_W", "SPLIT_K", "PREFETCH")


def moved_bytes(parts, x: torch.Tensor) -> int:
    """What one call must read and write: the quantized parts, x and the output."""
    tensors = [t for t in parts if isinstance(t, torch.Tensor)]
    n = parts[0].shape[0]
    return sum(t.numel() * t.element_size() for t in tensors) + x.numel() * 2 + n * 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--configs", default="")
    parser.add_argument("--native", default=None)
    parser.add_argument("--no-gluon", action="store_true")
    args = parser.parse_args()
    bandwidth, _ = machine_limits()
    print(versions_line([]) + f"; copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    configs = [parse_config(c, KEYS) for c in args.configs.split(",") if c]
    format_name = "int4"
    sums: dict[str, float] = {}
    moved = 0
    for name in args.shapes.split(","):
        n, k, fmt, group, parts, weights, dense = layer_weights(name, format_name)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = x.float() @ reference(fmt, *parts, group, k).T
        moved += moved_bytes(parts, x)
        row = baseline_row(fmt, group, n, k, weights, dense, x)
        if args.native is not None:
            natives = [(native_codes(q), s, z, gs) for q, s, z, gs in weights]
            default = {"SPLIT_K": 1, "PREFETCH": 1,
                       **native_choice(fmt, x, natives[0][0], group)}  # fmt: skip
            sweep_configs(row, "native", f"{format_name} {name}", default,
                          [parse_config(c, WORD_KEYS) for c in args.native.split(",") if c],
                          WORD_KEYS,
                          lambda a, q, s, z, gs, o, c, f=fmt, gr=group: linear_launch(
                              f, a, q, s, z, gs, None, gr, c, native=True),
                          want, natives, x)  # fmt: skip
        if not args.no_gluon:
            sweep_configs(row, "gluon", f"{format_name} {name}", gluon_gemv_config(n, k),
                          configs, KEYS,
                          lambda a, q, s, z, gs, o, c, f=int(fmt), gr=group: gluon_gemv_launch(
                              f, a, q, s, z, None, o, gr, c),
                          want, weights, x)  # fmt: skip
        cells = "  ".join(f"{key} {v:.2f}" for key, v in row.items())
        print(f"{format_name} {name} {n}x{k}: {cells}", flush=True)
        for key in ("bf16", "op", "triton", "native default", "native best", "gluon default",
                    "gluon best"):  # fmt: skip
            if key in row:
                sums[key] = sums.get(key, 0.0) + row[key]
    floor = moved / bandwidth * 1e6
    cells = "  ".join(f"{key} {v:.1f} us ({sums['bf16'] / v:.2f}x, {floor / v:.0%})"
                      for key, v in sums.items())  # fmt: skip
    print(f"{format_name} layer (copy-bandwidth floor {floor:.1f} us): {cells}\n", flush=True)


if __name__ == "__main__":
    main()
