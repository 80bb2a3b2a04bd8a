"""The 4-bit op (`linear_launch` with its own choice of kernel, on the codes as the layout
holds them on this GPU) against bf16 F.linear on the Llama-3.1-8B layer, per linear and summed;
each result checked against the reference first. Prints which kernel the op chose (how each
works: docs/kernels/w4a16_register.md).

    PYTHONPATH=$PWD python bench/bench_op_layer.py [--format int4|mxfp4|nvfp4]
        [--ms 1,2,8,16,32,64,128] [--shapes qkv,o,gate_up,down] [--canonical] [--marlin]

int4 with groups of 128 on a Hopper GPU: the op reads the codes in the native order
(`packing.native_codes`, what an Int4Tensor holds there: layouts/int4.py). --canonical: also
the op and the wgmma kernel on the canonical codes (what other int4 weights run).
--marlin: also Marlin (fp16 x; built by bench/build_marlin.sh, on PYTHONPATH), checked against
the float linear.

Timed as bench_fp8.py does (CUDA-graph median per call, weight copies rotated past the L2).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from harness import (
    FORMATS,
    add_to_layer,
    layer_weights,
    print_layer,
    reference,
    relative_error,
    timed,
    versions_line,
)

from qshard.kernels.availability import native_int4_problem
from qshard.kernels.packing import native_codes
from qshard.kernels.w4a16.format import Format
from qshard.kernels.w4a16.ops import linear_launch
from qshard.kernels.w4a16.register_wgmma import launch as wgmma_launch
from qshard.kernels.w4a16.select import choose

LAYER_KEYS = ("bf16", "op", "canonical", "wgmma", "marlin")
MAX_RELATIVE_ERROR = 0.03
MARLIN_MAX_ERROR = 0.15  # against the float linear: symmetric codes, amax / 7 (bench_int4)


def marlin_layers(w, copies: int) -> list:
    """`copies` Marlin layers of weight w (bench_int4.marlin_method), as many as the 4-bit
    weights rotated (their bytes, not bf16's, sized past the L2)."""
    from bench_int4 import marlin_method

    return [marlin_method(w) for _ in range(copies)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    parser.add_argument("--ms", default="1,2,8,16,32,64,128")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--canonical", action="store_true")
    parser.add_argument("--marlin", action="store_true")
    args = parser.parse_args()
    print(versions_line([]), args.format)
    sums: dict[tuple[int, str], float] = {}
    for name in args.shapes.split(","):
        n, k, fmt, group, parts, weights, dense = layer_weights(name, args.format)
        exact = reference(fmt, *parts, group, k)
        q, s, z, gs = weights[0]
        # what an Int4Tensor holds on this GPU (layouts/int4.py, `native_order_problem`)
        native = (
            fmt < Format.MXFP4
            and group % 128 == 0
            and k % 128 == 0
            and native_int4_problem(q.device) is None
        )
        held = [(native_codes(w[0]), *w[1:]) for w in weights] if native else weights
        marlins = marlin_layers(dense[0], len(weights)) if args.marlin else []
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ exact.T
            choice = choose(fmt, x, held[0][0], group, native)
            chosen = choice.kernel.value + (" native" if native else "")
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            checked = [linear_launch(fmt, x, held[0][0], s, z, gs, None, group, native=native)]
            if args.canonical:
                checked += [
                    linear_launch(fmt, x, q, s, z, gs, None, group),
                    wgmma_launch(int(fmt), x, q, s, z, None, out, group, None, gs),
                ]
            for got in checked:
                err = relative_error(got, want)
                assert err < MAX_RELATIVE_ERROR, (name, m, err)
            row = {"bf16": timed(lambda d: lambda a, d=d: F.linear(a, d), [(d,) for d in dense], x)}
            row["op"] = timed(
                lambda q, s, z, gs, f=fmt, g=group, n=native: (
                    lambda a: linear_launch(f, a, q, s, z, gs, None, g, native=n)
                ),
                held,
                x,
            )
            if args.canonical:
                row["canonical"] = timed(
                    lambda q, s, z, gs, f=fmt, g=group: (
                        lambda a: linear_launch(f, a, q, s, z, gs, None, g)
                    ),
                    weights,
                    x,
                )
                row["wgmma"] = timed(
                    lambda q, s, z, gs, o=out, f=int(fmt), g=group: (
                        lambda a: wgmma_launch(f, a, q, s, z, None, o, g, None, gs)
                    ),
                    weights,
                    x,
                )
            if marlins:
                xh = x.half()
                err = relative_error(marlins[0](xh), x.float() @ dense[0].float().T)
                assert err < MARLIN_MAX_ERROR, (name, m, "marlin", err)
                row["marlin"] = timed(lambda layer: layer, [(layer,) for layer in marlins], xh)
            cells = "  ".join(f"{key} {v:.2f}" for key, v in row.items())
            print(f"{name} {n}x{k} M={m} (op: {chosen}): {cells}", flush=True)
            add_to_layer(sums, m, row, LAYER_KEYS)
    print_layer(sums)


if __name__ == "__main__":
    main()
