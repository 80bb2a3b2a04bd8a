"""Tune the W4A16 kernels (int4, MXFP4, NVFP4) per shape and M bucket on this GPU; write the
configs that beat the built-in default into a tuned file (qshard/kernels/tuning.py).

    python bench/tune_w4a16.py [--formats int4,mxfp4,nvfp4] [--ms 1,16,64,128]
        [--shapes 6144x4096,4096x4096,...] [--out qshard/kernels/tuned/<gpu tag>.json]

Shapes default to the Llama-3.1-8B layer. Each candidate (bench_int4.sweep_candidates: GEMV,
small-M and dequantize + cuBLAS configs) is timed per shape as bench_int4 times them (CUDA
graphs, weight copies rotated past the L2). A shape keeps the default unless its best config is
faster by more than MIN_GAIN, the run-to-run spread of these timings (docs/kernels/w4a16.md).
An existing file is extended: its other keys stay.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
from bench_fp4 import mxfp4_weight, nvfp4_weight
from bench_int4 import int4_weight, sweep_candidates, time_launch
from harness import LLAMA, copies_for, versions_line

from qshard.kernels import tuning
from qshard.kernels.loader import load_w4a16_ops

MIN_GAIN = 0.03
FORMATS = {"int4": int4_weight, "mxfp4": mxfp4_weight, "nvfp4": nvfp4_weight}


def tune_shape(weight, n: int, k: int, m: int) -> tuple[dict | None, float, float, str]:
    """(best config or None when the default is as good, its us, the default's us, label)."""
    from qshard.kernels.w4a16.select import default_config

    # One set of weight copies per shape and M, shared by every candidate.
    copies = [weight] + [weight.clone() for _ in range(copies_for(n * k // 2, m) - 1)]
    default = default_config(weight.fmt, m, n, k, torch.device("cuda"))
    default_us = time_launch(copies, k, m, default)
    best, best_us, best_label = None, default_us, "default"
    for label, config_for in sweep_candidates(m):
        config = config_for(n, k)
        try:
            us = time_launch(copies, k, m, config)
        except Exception as e:  # a config that does not compile here: shown, not fatal
            print(f"  ({n}x{k} M={m} {label}: {type(e).__name__})")
            continue
        if us < best_us:
            best, best_us, best_label = config, us, label
    if best is not None and best_us > default_us * (1 - MIN_GAIN):
        return None, default_us, default_us, "default (no config beats it by 3%)"
    return best, best_us, default_us, best_label


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--ms", default="1,16,64,128")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in LLAMA.values()))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_w4a16_ops()
    name = torch.cuda.get_device_name()
    tag = tuning.gpu_tag(name) or name.lower().replace(" ", "_")
    out = args.out or str(tuning.TUNED_DIR / f"{tag}.json")
    data = {"version": tuning.TUNED_FORMAT_VERSION, "configs": {}}
    if os.path.exists(out):
        with open(out) as f:
            data = json.load(f)
    data.update(gpu=name, triton=triton.__version__)
    print(versions_line(()))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    from qshard.kernels.w4a16.format import tuned_format

    for fmt_name in args.formats.split(","):
        for n, k in shapes:
            weight = FORMATS[fmt_name](torch.randn(n, k, device="cuda") * 0.02)
            for m in (int(v) for v in args.ms.split(",")):
                config, us, default_us, label = tune_shape(weight, n, k, m)
                key = tuning.config_key("w4a16", tuned_format(weight.fmt, weight.group), n, k, m)
                gain = default_us / us
                print(
                    f"- {key}: {label} {us:.1f} us vs default {default_us:.1f} ({gain:.2f}x)",
                    flush=True,
                )
                if config is not None:
                    data["configs"][key] = config
                else:
                    data["configs"].pop(key, None)
            write(data, out)  # after every shape: a run cut short keeps what it measured
    print(f"wrote {len(data['configs'])} tuned configs to {out}")


def write(data: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
