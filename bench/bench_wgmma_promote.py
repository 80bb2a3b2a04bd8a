"""The wgmma kernel on native int4 codes with its sums scaled per chunk (PROMOTE, groups of 4
and 2 chunks) against the same kernel scaling the weights (as before session 28), per
Llama-3.1-8B linear and summed, with each result's relative error against the exact product
(the weight dequantized in fp32). Notes: docs/kernels/w4a16_register.md, "Session 28".

    PYTHONPATH=$PWD python bench/bench_wgmma_promote.py [--ms 2,8,16,32]

Timed as bench_fp8.py does (CUDA-graph median per call, weight copies rotated past the L2).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import relative_error, versions_line
from bench_register import add_to_layer, layer_weights, timed
from bench_register_ws import reference

from qshard.kernels.packing import native_codes
from qshard.kernels.w4a16_gluon_wgmma import wgmma_config, wgmma_launch

# (session 28's call also timed groups of 8 with PROMOTE: slower everywhere, and at 32 tokens
# the consumers spill; the launcher refuses it since)
VARIANTS = {"scaled weights": {}, "promote": {"PROMOTE": 1},
            "promote, groups of 2": {"PROMOTE": 1, "GROUP_CHUNKS": 2}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="2,8,16,32")
    args = parser.parse_args()
    print(versions_line([]))
    ms = [int(v) for v in args.ms.split(",")]
    sums: dict[tuple[int, str], float] = {}
    for name in ("qkv", "o", "gate_up", "down"):
        n, k, fmt, group, parts, weights, _ = layer_weights(name, "int4")
        exact = reference(fmt, *parts, group, k)
        held = [(native_codes(w[0]), *w[1:]) for w in weights]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ exact.T
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            base = {**wgmma_config(m, n, k, x.device), "NATIVE": 1}
            row, cells = {}, []
            for label, extra in VARIANTS.items():
                c = {**base, **extra}
                got = wgmma_launch(int(fmt), x, *held[0][:3], None, out.clone(), group, c,
                                   held[0][3])  # fmt: skip
                row[label] = timed(lambda q, s, z, gs, c=c, f=int(fmt), o=out, g=group: (
                    lambda a: wgmma_launch(f, a, q, s, z, None, o, g, c, gs)), held, x)
                cells.append(f"{label} {row[label]:.2f} us "
                             f"(error {relative_error(got, want):.2e})")  # fmt: skip
            print(f"{name} {n}x{k} M={m}: " + "  ".join(cells), flush=True)
            add_to_layer(sums, m, row, tuple(VARIANTS))
    for m in ms:
        print(f"layer M={m}: " + "  ".join(f"{label} {sums[m, label]:.1f}" for label in VARIANTS))


if __name__ == "__main__":
    main()
