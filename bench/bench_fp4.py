"""FP4 weight-only linears (MXFP4, NVFP4) vs bf16, gemlite and torchao, on one GPU, one run.

    python bench/bench_fp4.py [--sweep] [--methods ...] [--ms 1,16,128,2048]

The four linears of a Llama-3.1-8B layer (summed), timed as bench_int4.py (CUDA graphs, weight
copies rotated past the L2): time, speedup over bf16 F.linear, fraction of the roofline
(max(bytes / measured copy bandwidth, flops / measured bf16 peak); MXFP4 4.25 bits per weight,
NVFP4 4.5). Then each method's output relative error vs the float linear on one shape. Hopper
has no FP4 tensor cores: every method here dequantizes to bf16 (in registers or in memory).
Missing optional packages are reported, not silently skipped.
"""

from __future__ import annotations

import torch
from bench_int4 import Weight4, machine_header, sweep, weight_only_args, weight_only_table
from harness import LLAMA, bf16_method, load_gemlite_config

from qshard.kernels import mxfp4, nvfp4


def mxfp4_weight(w):
    from qshard.kernels.w4a16.format import Format

    packed, scale = mxfp4.quantize_mxfp4(w, 32)
    return Weight4(Format.MXFP4, (packed, scale, packed, packed), 32)


def nvfp4_weight(w):
    from qshard.kernels.w4a16.format import Format

    global_scale = nvfp4.global_scale_of(w)
    packed, scale = nvfp4.quantize_nvfp4(w, global_scale)
    return Weight4(Format.NVFP4, (packed, scale, packed, global_scale), 16)


def qshard_method(make):
    def build(w):
        from qshard.kernels.w4a16.ops import linear_launch

        weight = make(w)
        return lambda x: linear_launch(weight.fmt, x, *weight.inner, None, weight.group)

    return build


def _linear(w):
    linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=w.dtype)
    linear.weight.data.copy_(w)
    return linear


def gemlite_mxfp4_method(w):
    from gemlite.helper import A16W4_MXFP

    load_gemlite_config()
    return A16W4_MXFP(device="cuda", dtype=w.dtype).from_linear(_linear(w))


def gemlite_nvfp4_method(w):
    from gemlite.helper import A16W4_NVFP

    load_gemlite_config()
    return A16W4_NVFP(device="cuda", dtype=w.dtype).from_linear(_linear(w))


def torchao_nvfp4_method(w):
    from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig
    from torchao.quantization import quantize_

    linear = _linear(w)
    quantize_(linear, NVFP4WeightOnlyConfig())
    return linear


METHODS = {
    "bf16": bf16_method,
    "qshard-mxfp4": qshard_method(mxfp4_weight),
    "qshard-nvfp4": qshard_method(nvfp4_weight),
    "gemlite-mxfp4": gemlite_mxfp4_method,
    "gemlite-nvfp4": gemlite_nvfp4_method,
    "torchao-nvfp4": torchao_nvfp4_method,
}
BITS = {"mxfp4": 4.25, "nvfp4": 4.5}


def roofline_us(m: int, bits: float, bandwidth: float, peak: float) -> float:
    total = 0.0
    for n, k in LLAMA.values():
        moved = n * k * bits / 8 + 2 * m * (k + n)
        total += max(moved / bandwidth, 2 * m * n * k / peak)
    return total * 1e6


def main() -> None:
    args, methods, ms = weight_only_args(METHODS)
    bandwidth, peak = machine_header(("gemlite", "torchao"))
    if args.sweep:
        sweep(ms, {"MXFP4": mxfp4_weight, "NVFP4": nvfp4_weight})
    if args.no_tables:
        return

    def roofline(name, m):
        return roofline_us(m, BITS.get(name.split("-")[-1], 16), bandwidth, peak)

    weight_only_table(
        "FP4 weight-only, Llama-3.1-8B layer (summed)", METHODS, methods, ms, roofline
    )


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
