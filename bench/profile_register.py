"""The register-operand int4 kernel (qshard/kernels/w4a16_gluon.py) under the GPU's tools:
launches for Nsight Compute, and a correctness sweep small enough for compute-sanitizer.

    SHAPE=gate_up M=16 [CONFIG=8:4:3] ncu --clock-control none --set full \
        -k regex:register_kernel --launch-skip 1 --launch-count 1 \
        python bench/profile_register.py --launch          # 3 launches of one shape
    compute-sanitizer --tool memcheck python bench/profile_register.py --sanitize

SHAPE is one of the Llama-3.1-8B layer's (bench_fp8.LLAMA); CONFIG is STEPS:STAGES:PER_SM
(default: `register_config`). The sanitize sweep runs every int4 format, MXFP4 and NVFP4,
bf16 and fp16, each token tile (8 to 128 tokens), split K and not, odd N and K, one item per
program and a persistent grid, each against the reference; it exits 1 on a mismatch. Notes:
docs/kernels/w4a16_register.md.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import LLAMA, versions_line

from qshard.kernels import int4, mxfp4, nvfp4
from qshard.kernels.w4a16_gluon import register_config, register_launch

# (format, symmetric, float zero, N, K, group, M, dtype, STEPS:STAGES:PER_SM or None)
SWEEP = [
    (0, False, False, 96, 2880, 32, 2, torch.bfloat16, None),
    (0, False, False, 1000, 3200, 128, 20, torch.bfloat16, (4, 4, 1)),
    (1, True, False, 200, 1024, 256, 5, torch.bfloat16, (2, 2, 10**6)),
    (2, False, True, 130, 4096, 64, 65, torch.float16, (8, 4, 2)),
    (0, False, False, 64, 128, 64, 100, torch.bfloat16, None),
    (3, False, False, 96, 2880, 32, 7, torch.bfloat16, None),  # MXFP4
    (3, False, False, 200, 1024, 32, 65, torch.float16, (2, 2, 10**6)),
    (4, False, False, 1000, 3200, 16, 3, torch.bfloat16, None),  # NVFP4
    (4, False, False, 130, 4096, 16, 20, torch.float16, (8, 4, 2)),
    (4, False, False, 200, 1024, 16, 12, torch.bfloat16, None),  # 16-token tile, one split
    (1, True, False, 1000, 2048, 64, 12, torch.float16, None),  # 16-token tile
    (0, False, False, 300, 4096, 128, 40, torch.bfloat16, None),  # 64-token tile
]


def weight_and_reference(fmt: int, symmetric: bool, float_zero: bool, n: int, k: int,
                         group: int):  # fmt: skip
    """A random weight in format `fmt`: (codes, scale, zero or codes, global scale or None,
    reference: (x, bias) -> x @ W.T + bias)."""
    w = torch.randn(n, k, device="cuda") * 0.02
    if fmt == 3:
        q, s = mxfp4.quantize_mxfp4(w)
        return q, s, q, None, lambda x, b: mxfp4.mxfp4_linear_reference(x, q, s, 32, b)
    if fmt == 4:
        g = nvfp4.global_scale_of(w)
        q, s = nvfp4.quantize_nvfp4(w, g)
        return q, s, q, g, lambda x, b: nvfp4.nvfp4_linear_reference(x, q, s, g, 16, b)
    q, s, z = int4.quantize_int4(w, group, symmetric, float_zero)
    return q, s, z if z.numel() else q, None, lambda x, b: int4.int4_linear_reference(
        x, q, s, z, group, b, float_zero)  # fmt: skip


def launch() -> None:
    n, k = LLAMA[os.environ.get("SHAPE", "gate_up")]
    m = int(os.environ.get("M", "16"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    q, s, z = int4.quantize_int4(torch.randn(n, k, device="cuda") * 0.02, 128, False)
    config = register_config(m, n, k, x.device)
    if "CONFIG" in os.environ:
        steps, stages, per_sm = (int(v) for v in os.environ["CONFIG"].split(":"))
        config.update(STEPS=steps, STAGES=stages, PER_SM=per_sm)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    print(versions_line([]), f"{n}x{k} M={m}", config)
    for _ in range(3):
        register_launch(0, x, q, s, z, None, out, 128, config)
    torch.cuda.synchronize()


def sanitize() -> int:
    failed = 0
    for fmt, symmetric, float_zero, n, k, group, m, dtype, cfg in SWEEP:
        q, s, z, g, reference = weight_and_reference(fmt, symmetric, float_zero, n, k, group)
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        bias = torch.randn(n, device="cuda", dtype=dtype) if m % 2 else None
        config = register_config(m, n, k, x.device)
        if cfg:
            config.update(STEPS=cfg[0], STAGES=cfg[1], PER_SM=cfg[2])
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        got = register_launch(fmt, x, q, s, z, bias, out, group, config, g)
        want = reference(x, bias)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        ok = err < (8e-3 if dtype == torch.bfloat16 else 1e-3)  # the GPU tests
        failed += not ok
        print(f"format {fmt} {n}x{k} g{group} M={m} {dtype} {config}: rel err {err:.2e}",
              "ok" if ok else "MISMATCH", flush=True)  # fmt: skip
    return int(failed > 0)


if __name__ == "__main__":
    if "--sanitize" in sys.argv:
        sys.exit(sanitize())
    launch()
