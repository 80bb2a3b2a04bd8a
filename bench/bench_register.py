"""The register-operand 4-bit kernel (qshard/kernels/w4a16_gluon.py; --format int4, mxfp4 or
nvfp4) against the Triton small-M kernel it replaces, bf16 F.linear and (int4 at 16 tokens)
the toolchain probe's device-form Gluon wgmma kernel, on the Llama-3.1-8B layer; a sweep of
its configs. Notes: docs/kernels/w4a16_register.md.

    PYTHONPATH=$PWD python bench/bench_register.py [--ms 2,4,8,16,32,64,128]
        [--shapes qkv,o,gate_up,down] [--no-probe] [--format int4|mxfp4|nvfp4]
        [--configs STEPS:STAGES:PER_SM[:WARPS[:MAXNREG]],...]

Timed as bench_fp8.py does (CUDA-graph median per call, weight copies rotated past the L2).
Prints per shape and M the time of each method and of each register config, then per M the
layer's sum: bf16, Triton (the config the op chose before: tuned or default), the register
kernel with its default config and with the best config per shape, and speedups over bf16.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench_fp8 import LLAMA, copies_for, time_us, versions_line

from qshard.kernels import int4, mxfp4, nvfp4
from qshard.kernels.tuning import tuned_config
from qshard.kernels.w4a16_gluon import register_config, register_launch
from qshard.kernels.w4a16_triton import Format, default_config, linear_launch, tuned_format


def _nvfp4(w: torch.Tensor) -> tuple:
    g = nvfp4.global_scale_of(w)
    return (*nvfp4.quantize_nvfp4(w, g), None, g)


# --format: (Format, group, quantize: weight -> (codes, scale, zero or None, global or None))
FORMATS = {
    "int4": (Format.INT4_ASYM, 128,
             lambda w: (*int4.quantize_int4(w, 128, symmetric=False), None)),
    "mxfp4": (Format.MXFP4, 32, lambda w: (*mxfp4.quantize_mxfp4(w), None, None)),
    "nvfp4": (Format.NVFP4, 16, _nvfp4),
}  # fmt: skip


def triton_config(fmt: Format, group: int, n: int, k: int, m: int) -> dict:
    """What `linear_launch` chose before the register kernel: tuned, else the default."""
    device = torch.device("cuda")
    return tuned_config("w4a16", tuned_format(fmt, group), n, k, m, device) or default_config(
        fmt, m, n, k, device)  # fmt: skip


def layer_weights(name: str, format_name: str) -> tuple:
    """One Llama linear's random weight, quantized: (n, k, fmt, group, the quantized parts
    (codes, scale, zero or None, global scale or None), copies of them to rotate past the L2
    (a part the format has not: the codes, any tensor), copies of the dense weight)."""
    n, k = LLAMA[name]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    fmt, group, quantize = FORMATS[format_name]
    parts = quantize(w)
    args = tuple(parts[0] if t is None else t for t in parts)
    weights = [tuple(t.clone() for t in args) for _ in range(copies_for(n * k // 2, 1))]
    dense = [w.clone() for _ in range(copies_for(n * k * 2, 1))]
    return n, k, fmt, group, parts, weights, dense


def timed(make, weights, x) -> float:
    fns = [make(*w) for w in weights]
    return time_us(lambda: [f(x) for f in fns], len(fns))


def baseline_row(fmt: Format, group: int, n: int, k: int, weights, dense, x) -> dict:
    """The times (us) every experiment compares with: bf16 F.linear, the op's own choice
    ("op") and the Triton kernel with its default config ("triton")."""
    m = x.shape[0]
    row = {"bf16": timed(lambda d: (lambda a, d=d: F.linear(a, d)),
                         [(d,) for d in dense], x)}  # fmt: skip
    row["op"] = timed(lambda q, s, z, gs: (
        lambda a: linear_launch(fmt, a, q, s, z, gs, None, group)), weights, x)
    config = default_config(fmt, m, n, k, x.device)
    row["triton"] = timed(lambda q, s, z, gs: (
        lambda a: linear_launch(fmt, a, q, s, z, gs, None, group, config)), weights, x)
    return row


def parse_config(text: str, keys: tuple[str, ...]) -> dict:
    """A config written as its `keys`' values joined by ":"; a field "-" keeps the default's
    value."""
    values = text.split(":")
    if len(values) != len(keys):
        raise SystemExit(f"config {text!r}: want {':'.join(keys)}")
    return {key: int(v) for key, v in zip(keys, values, strict=True) if v != "-"}


def add_to_layer(sums: dict, m: int, row: dict, keys: tuple[str, ...]) -> None:
    """Adds `row`'s times under `keys` (those it has) to the layer's sums at M = m."""
    for key in keys:
        if key in row:
            sums[m, key] = sums.get((m, key), 0.0) + row[key]


def print_layer(sums: dict) -> None:
    """Per M, the layer's summed times (`add_to_layer`) and their speedups over bf16."""
    print("\nlayer (shapes summed), us, and speedup over bf16:")
    for m in sorted({mm for mm, _ in sums}):
        bf16 = sums[m, "bf16"]
        cells = "  ".join(f"{key} {v:.1f} ({bf16 / v:.2f}x)" for (mm, key), v in sums.items()
                          if mm == m)  # fmt: skip
        print(f"M={m}: {cells}")


def sweep_configs(row: dict, prefix: str, title: str, default: dict, configs, keys, run,
                  want, weights, x) -> None:  # fmt: skip
    """Each config (`default`, then `default` updated by each of `configs`) checked against
    `want` (fp32; relative error < 1e-2, else reported and not timed) and timed:
    `run(x, codes, scale, zero, global_scale, out, config)`. Adds to `row` "<prefix> <label>"
    per config, "<prefix> default" and "<prefix> best"; failures are printed under `title`,
    not hidden."""
    out = torch.empty(x.shape[0], weights[0][0].shape[0], device="cuda", dtype=x.dtype)
    best = None
    for config in [default, *({**default, **c} for c in configs)]:
        label = ":".join(str(config[key]) for key in keys if key in config)
        if f"{prefix} {label}" in row:
            continue
        try:
            got = run(x, *weights[0], out.clone(), config)
            err = ((got.float() - want).norm() / want.norm()).item()
            if not err < 1e-2:
                print(f"{title} {prefix} {label}: WRONG, relative error {err:.3g}")
                continue
            t = timed(lambda q, s, z, gs, c=config: (
                lambda a: run(a, q, s, z, gs, out, c)), weights, x)  # fmt: skip
        except Exception as e:  # reported per config, not hidden
            print(f"{title} {prefix} {label}: {type(e).__name__}: {str(e)[:300]}")
            continue
        row[f"{prefix} {label}"] = t
        if config is default:
            row[f"{prefix} default"] = t
        if best is None or t < best[0]:
            best = (t, label)
    if best is not None:
        row[f"{prefix} best"] = best[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="2,4,8,16,32,64,128")
    parser.add_argument("--shapes", default="qkv,o,gate_up,down")
    parser.add_argument("--configs", default="4:4:3,4:4:4,8:4:2,8:4:4,8:8:2,12:6:2,16:4:2,16:8:2")
    parser.add_argument("--no-probe", action="store_true")
    parser.add_argument("--format", default="int4", choices=sorted(FORMATS))
    args = parser.parse_args()
    print(versions_line([]))
    ms = [int(m) for m in args.ms.split(",")]
    configs = [tuple(int(v) for v in c.split(":")) + (4, 0)[len(c.split(":")) - 3:]
               for c in args.configs.split(",")]  # STEPS:STAGES:PER_SM[:WARPS[:MAXNREG]]
    sums: dict[tuple[int, str], float] = {}
    for name in args.shapes.split(","):
        n, k, fmt, group, _, weights, dense = layer_weights(name, args.format)
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"bf16": timed(lambda d: (lambda a, d=d: F.linear(a, d)),
                                 [(d,) for d in dense], x)}  # fmt: skip
            cfg = triton_config(fmt, group, n, k, m)
            row["triton"] = timed(lambda q, s, z, gs, c=cfg, f=fmt, g=group: (
                lambda a: linear_launch(f, a, q, s, z, gs, None, g, c)), weights, x)
            default = register_config(m, n, k, x.device)
            best = None
            mine = (default["STEPS"], default["STAGES"], default["PER_SM"], default["WARPS"],
                    default.get("MAXNREG", 0))  # fmt: skip
            for steps, stages, per_sm, warps, maxnreg in dict.fromkeys([*configs, mine]):
                config = {**default, "STEPS": steps, "STAGES": stages, "PER_SM": per_sm,
                          "WARPS": warps, "MAXNREG": maxnreg}  # fmt: skip
                ring = (config["BLOCK_M"] * 256 + 1024 * warps) * stages
                if ring > 200 * 1024 or steps % stages:
                    continue  # the ring must fit in shared memory, an item fill it exactly
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                t = timed(lambda q, s, z, gs, c=config, o=out, f=int(fmt), g=group: (
                    lambda a: register_launch(f, a, q, s, z, None, o, g, c, gs)), weights, x)
                label = ":".join(str(v) for v in (steps, stages, per_sm, warps, maxnreg))
                row[f"reg {label}"] = t
                if (steps, stages, per_sm, warps, maxnreg) == mine:
                    row["reg default"] = t
                if best is None or t < best[0]:
                    best = (t, label)
            row["reg best"] = best[0]
            if m == 16 and not args.no_probe and args.format == "int4":
                row.update(probe(weights, n, k, x))
            cells = "  ".join(f"{key} {v:.2f}" for key, v in row.items())
            print(f"{name} {n}x{k} M={m}: {cells}  (best reg {best[1]})", flush=True)
            for key, v in row.items():
                sums[m, key] = sums.get((m, key), 0.0) + v
    print("\nlayer (shapes summed), us, and speedup over bf16:")
    for m in ms:
        bf16 = sums[m, "bf16"]
        cells = "  ".join(f"{key} {v:.1f} ({bf16 / v:.2f}x)" for (mm, key), v in sums.items()
                          if (mm == m and not key.startswith("reg ")) or (key in (
                              "reg default", "reg best") and mm == m))  # fmt: skip
        print(f"M={m}: {cells}")


def probe(weights, n, k, x) -> dict:
    """The toolchain probe's best kernel (device form, Gluon wgmma, STEPS 4, 2 per SM)."""
    try:
        import register_operand_probe as rp

        forms = [rp.device_form(q, s, z, k) for q, s, z, _ in weights]
        run = rp.gluon_launcher(4, n, k, x.shape[0], per_sm=2, wgmma=True)
        return {"probe": timed(lambda *f: (lambda a: run(a, *f)), forms, x)}
    except Exception as e:  # reported, not hidden
        print(f"probe: {type(e).__name__}: {e}")
        return {}


if __name__ == "__main__":
    main()
