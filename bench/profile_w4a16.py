"""Where the W4A16 kernels spend their time: launches for Nsight Compute, and the dequantize
kernel of the large-M path timed alone.

    FORMAT=mxfp4 SHAPE=gate_up M=1 ncu --clock-control none --metrics ... \
        python bench/profile_w4a16.py --launch      # the auto kernel, 3 launches
    python bench/profile_w4a16.py --dequantize      # us per shape: dequantize, bf16 F.linear

FORMAT is int4, mxfp4 or nvfp4; SHAPE one of the Llama-3.1-8B layer's (bench_fp8.LLAMA). The
dequantize times say how much of the large-M path (dequantize + cuBLAS) is the dequantize: it
reads the codes and writes the bf16 weight (2 bytes per weight), which at M = 2048 is the whole
difference from bf16 (docs/kernels/w4a16.md).
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp4 import mxfp4_weight, nvfp4_weight
from bench_fp8 import LLAMA, time_us, versions_line
from bench_int4 import int4_weight

from qshard.kernels.loader import load_w4a16_ops

FORMATS = {"int4": int4_weight, "mxfp4": mxfp4_weight, "nvfp4": nvfp4_weight}


def launch() -> None:
    from qshard.kernels.w4a16_triton import linear_launch

    n, k = LLAMA[os.environ.get("SHAPE", "gate_up")]
    m = int(os.environ.get("M", "1"))
    weight = FORMATS[os.environ.get("FORMAT", "mxfp4")](torch.randn(n, k, device="cuda") * 0.02)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        linear_launch(weight.fmt, x, *weight.inner, None, weight.group)
    torch.cuda.synchronize()


def dequantize_table() -> None:
    from qshard.kernels.w4a16_triton import dequantize_launch

    print(versions_line(()))
    print("| format | shape | dequantize | bf16 F.linear, M = 2048 | moved by the dequantize |")
    print("|---|---|---|---|---|")
    for fmt_name in ("mxfp4", "nvfp4", "int4"):
        total = [0.0, 0.0]
        for name, (n, k) in LLAMA.items():
            w = torch.randn(n, k, device="cuda") * 0.02
            weight = FORMATS[fmt_name](w)
            deq = time_us(functools.partial(dequantize_launch, weight.fmt, *weight.inner,
                                            weight.group, k, torch.bfloat16), 1)  # fmt: skip
            x = torch.randn(2048, k, device="cuda", dtype=torch.bfloat16)
            gemm = time_us(functools.partial(F.linear, x, w.to(torch.bfloat16)), 1)
            read = {t.data_ptr(): t.numel() * t.element_size() for t in weight.inner[:3]}
            moved = sum(read.values()) + 2 * n * k  # the codes, scales (zeros), and bf16 out
            print(f"| {fmt_name} | {name} | {deq:.1f} us | {gemm:.1f} us | {moved / 1e6:.0f} MB "
                  f"({moved / deq / 1e6:.2f} TB/s) |")  # fmt: skip
            total[0] += deq
            total[1] += gemm
        print(f"| {fmt_name} | layer | {total[0]:.1f} us | {total[1]:.1f} us | |")


if __name__ == "__main__":
    torch.manual_seed(0)
    load_w4a16_ops()
    if "--dequantize" in sys.argv:
        dequantize_table()
    else:
        launch()
