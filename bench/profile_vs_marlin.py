"""qshard's int4 op and Marlin on three Llama-3.1-8B linears at M tokens, each launched once
inside the profiler range, for Nsight Compute (docs/kernels/w4a16_register.md, "Session 25"):

    PYTHONPATH=$PWD:PATH/TO/marlin ncu --profile-from-start off \\
        --kernel-name regex:"Marlin|_wgmma_kernel" --section SpeedOfLight \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section LaunchStats --section ComputeWorkloadAnalysis \\
        python bench/profile_vs_marlin.py 16

Marlin built by bench/build_marlin.sh; both checked against the float linear first.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import relative_error
from bench_int4 import GROUP, marlin_method, quantized

from qshard.kernels.loader import load_w4a16_ops

SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MAX_ERROR = 0.15  # against the float linear (Marlin's symmetric codes: about 0.12)


def launches(op, x, int4_weight, marlin_layer) -> tuple:
    """(qshard's op on x, Marlin's layer on an fp16 copy of x), each a callable of nothing."""
    packed, scale, zero = int4_weight
    xh = x.half()
    return (lambda: op(x, packed, scale, zero, None, GROUP), lambda: marlin_layer(xh))


def main() -> None:
    load_w4a16_ops()
    m = int(sys.argv[1])
    op = torch.ops.qshard.int4_linear
    runs = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        packed, scale, zero = quantized(w)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        pair = launches(op, x, (packed, scale, zero), marlin_method(w))
        want = x.float() @ w.float().T
        for label, run in zip(("qshard", "marlin"), pair, strict=True):
            error = relative_error(run(), want)
            print(f"{name} M={m} {label}: relative error vs float {error:.4f}")
            assert error < MAX_ERROR, (name, label, error)
        runs.append(pair)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for pair in runs:
        for run in pair:
            run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
