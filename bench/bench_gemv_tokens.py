"""The word GEMV with several tokens per program (BLOCK_M 1-8, 8 or 16 rows) against the op's
own choice at 2-8 tokens on the Llama-3.1-8B layer: int4 g128 on the native codes (what an int4
weight holds on Hopper), MXFP4 and NVFP4; bf16 F.linear for the speedups. Each config is checked
against the reference first (a wrong or failing one is reported and not timed). Notes:
docs/kernels/w4a16.md, "v12 (session 27)".

    PYTHONPATH=$PWD python bench/bench_gemv_tokens.py [--ms 2,3,4,8] [--formats int4,mxfp4,nvfp4]

Timed as bench_fp8.py does (CUDA-graph median per call, weight copies rotated past the L2).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp4 import mxfp4_weight, nvfp4_weight
from bench_fp8 import LLAMA, copies_for, relative_error, time_us
from bench_int4 import Weight4, int4_weight
from bench_register_ws import reference

from qshard.kernels.packing import native_codes
from qshard.kernels.w4a16_triton import linear_launch, native_gemv_step

MAKERS = {"int4": int4_weight, "mxfp4": mxfp4_weight, "nvfp4": nvfp4_weight}
MAX_RELATIVE_ERROR = 1e-2


def candidates(m: int, k: int, native: bool):
    """(label, config or None for the op's own choice) at M tokens."""
    yield "op", None
    block_w = native_gemv_step(k) if native else 128  # the op's steps at M = 1
    for rows, tokens in itertools.product((8, 16), (1, 2, 4, 8)):
        if tokens > 2 * m or (tokens == 8 and rows == 16):
            continue
        yield f"words {rows} rows, {tokens} tokens", dict(
            KERNEL="gemv_words", BLOCK_N=rows, BLOCK_W=block_w, num_warps=4, EVICT=1,
            BLOCK_M=tokens, NATIVE=int(native))  # fmt: skip


def time_format(fmt_name: str, ms, sums: dict) -> None:
    """Each candidate per shape and M, into sums[(label, m)][shape]."""
    for shape, (n, k) in LLAMA.items():
        weight = MAKERS[fmt_name](torch.randn(n, k, device="cuda") * 0.02)
        exact = reference(weight.fmt, *weight.inner, weight.group, k)
        native = fmt_name == "int4"  # int4 g128 holds native codes on Hopper (layouts/int4.py)
        if native:
            q, *rest = weight.inner
            weight = Weight4(weight.fmt, (native_codes(q), *rest), weight.group)
        copies = [weight] + [weight.clone() for _ in range(copies_for(n * k // 2, 1) - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = x.float() @ exact.T
            for label, config in candidates(m, k, native):

                def call(w, x=x, config=config, native=native):
                    config = dict(config) if config else None
                    return linear_launch(w.fmt, x, *w.inner, None, w.group, config, native=native)

                try:
                    error = relative_error(call(weight), want)
                except Exception as e:  # a config the kernel refuses: reported, not timed
                    print(f"FAILED {fmt_name} {shape} M={m} {label}: {e!r:.200}", flush=True)
                    continue
                if error > MAX_RELATIVE_ERROR:
                    print(f"WRONG {fmt_name} {shape} M={m} {label}: {error:.2e}", flush=True)
                    continue
                us = time_us(lambda call=call, copies=copies: [call(w) for w in copies],
                             len(copies))  # fmt: skip
                sums.setdefault((f"{fmt_name} {label}", m), {})[shape] = us
        del copies
        torch.cuda.empty_cache()


def time_bf16(ms, sums: dict) -> None:
    for shape, (n, k) in LLAMA.items():
        w = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        copies = [w] + [w.clone() for _ in range(copies_for(n * k * 2, 1) - 1)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = time_us(lambda x=x, copies=copies: [F.linear(x, c) for c in copies], len(copies))
            sums.setdefault(("bf16", m), {})[shape] = us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="2,3,4,8")
    parser.add_argument("--formats", default="int4,mxfp4,nvfp4")
    args = parser.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)  # fmt: skip
    sums: dict[tuple[str, int], dict[str, float]] = {}
    time_bf16(ms, sums)
    for fmt_name in args.formats.split(","):
        time_format(fmt_name, ms, sums)
    print("\nlayer sums, us (speedup over bf16); then qkv, o, gate_up, down")
    for m in ms:
        base = sum(sums[("bf16", m)].values())
        rows = [(sum(d.values()), label, d) for (label, mm), d in sums.items()
                if mm == m and len(d) == len(LLAMA)]  # fmt: skip
        for total, label, d in sorted(rows, key=lambda r: (r[1].split()[0], r[0])):
            shapes = " ".join(f"{d[s]:6.2f}" for s in LLAMA)
            print(f"M={m} {label:28s} {total:7.2f} ({base / total:4.2f}x)  {shapes}")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
