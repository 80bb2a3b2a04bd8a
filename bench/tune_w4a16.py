"""Tune the W4A16 op (int4, MXFP4, NVFP4) on this GPU: per shape and M bucket, time the op's own
choice (its rule tables, qshard/kernels/w4a16/select.py, with no tuned file) against every
kernel that can run the matmul, each with its built-in config and a few variants; where one is
faster by more than MIN_GAIN (the run-to-run spread of these timings), write it into this GPU's
tuned file (qshard/kernels/tuning.py) with the GPU's traits. Prints, per shape and M, the op's
choice and time beside the fastest candidate: the op's choice re-measured on this GPU.

    python bench/tune_w4a16.py [--formats int4,mxfp4,nvfp4] [--ms 1,2,4,8,16,32,64,128]
        [--shapes 6144x4096,4096x4096,...] [--out F]

--out defaults to the shipped file measured on a GPU of this one's traits, else a new
qshard/kernels/tuned/<device name>.json; a file measured on another GPU is refused. Each M is
tuned at its bucket's top (qshard/kernels/tuning.py), and an entry is kept only where it is also
no slower than the op's choice at the bucket's lowest M, since it runs over the whole bucket.

int4 runs on the codes as an Int4Tensor holds them on this GPU (the native order on Hopper,
keys "..._native"). Shapes default to the Llama-3.1-8B layer; bf16 activations. Each candidate
is checked against the op's output first and timed as bench_int4 times the op (CUDA graphs,
weight copies rotated past the L2). An existing file is extended: its other keys stay.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import triton
from bench_fp4 import mxfp4_weight, nvfp4_weight
from bench_int4 import int4_weight
from harness import LLAMA, copies_for, relative_error, time_us, versions_line

from qshard.kernels import tuning
from qshard.kernels.availability import native_int4_problem
from qshard.kernels.gpu import traits
from qshard.kernels.loader import load_w4a16_ops
from qshard.kernels.packing import native_codes
from qshard.kernels.w4a16 import (
    dequantize,
    gemv,
    gemv_words,
    register,
    register_wgmma,
    register_ws,
    select,
    small_m,
)
from qshard.kernels.w4a16.format import Format, tuned_format
from qshard.kernels.w4a16.ops import linear_launch
from qshard.kernels.w4a16.select import choose, kernel_for

MIN_GAIN = 0.03
MAX_DIFFERENCE = 0.01  # a candidate's output against the op's (both fp32-accumulated)
FORMATS = {"int4": int4_weight, "mxfp4": mxfp4_weight, "nvfp4": nvfp4_weight}
SPLITS = (1, 2, 3, 4, 6, 8)  # the wgmma kernel's K splits tried beside its model's
WORDS = (64, 128, 256)  # the one-token word GEMV's words (8 codes each) per step


def candidates(fmt: Format, x, qdata, group: int, native: bool):
    """(label, config) for each kernel that can run x @ W.T, and its variants."""
    m, k, n = x.shape[0], x.shape[1], qdata.shape[0]
    device = x.device
    found = []
    if m == 1:  # the word GEMV: rows, words a step, warps, codes loaded 1 or 2 steps ahead
        for rows, words, warps, prefetch in itertools.product((8, 16), WORDS, (4, 8), (1, 2)):
            if k % (8 * words) == 0:
                config = dict(
                    KERNEL="gemv_words",
                    BLOCK_N=rows,
                    BLOCK_W=words,
                    num_warps=warps,
                    PREFETCH=prefetch,
                    EVICT=1,
                    NATIVE=int(native),
                )
                found.append((f"words {rows}x{words}w {warps}w prefetch {prefetch}", config))
        if not native:
            found.append(("gemv", gemv.config(fmt)))
    if m == 2:
        found.append(("pair gemv", gemv_words.pair_config(native)))
    if m >= 2:
        base = register_wgmma.config(m, n, k, device)
        if native:
            promote = register_wgmma.promote_config(int(fmt), x, group, base["BLOCK_T"])
            base = {**base, "NATIVE": 1, **promote}
        chunks = triton.cdiv(k, 128)
        steps = sorted({base["STEPS"]} | {triton.cdiv(chunks, s) for s in SPLITS})
        for s in steps:
            config = {"KERNEL": "register_wgmma", **base, "STEPS": s}
            found.append((f"wgmma {triton.cdiv(chunks, s)} splits", config))
    if m >= 2 and not native:
        if m <= 16:
            found.append(("register", {"KERNEL": "register", **register.config(m, n, k, device)}))
            ws = register_ws.config(m, n, k, device, int(fmt))
            found.append(("register ws", {"KERNEL": "register_ws", **ws}))
        found.append(("small-m", small_m.config(m, n, k, device)))
    if m >= 16:
        found.append(("dequantize + cuBLAS", dequantize.config(native)))
    matmul = select.Matmul(fmt, x, qdata, group, native)
    return [(label, c) for label, c in found if select._runs(kernel_for(m, c), matmul)]


def time_config(copies, x, config, native: bool) -> float:
    """us per call of the op with `config` (None: its own choice) over the weight copies."""
    fn = lambda: [  # noqa: E731
        linear_launch(w.fmt, x, *w.inner, None, w.group, config, native=native) for w in copies
    ]
    return time_us(fn, len(copies))


def tune_shape(weight, native: bool, n: int, k: int, m: int):
    """At the bucket's top M: (best config or None where the op's choice stands, best us, the
    op's us, labels). A config is kept only where it beats the op's choice by MIN_GAIN at the
    top and is no slower than it at the bucket's lowest M (an entry runs over the bucket)."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    copies = [weight] + [weight.clone() for _ in range(copies_for(n * k // 2, m) - 1)]
    chosen, want, op_us = op_choice(copies, x, native)
    best, best_us, best_label = None, op_us, "the op's choice"
    for label, config in candidates(weight.fmt, x, weight.inner[0], weight.group, native):
        us = checked_time(copies, x, config, native, want, label)
        if us is not None and us < best_us:
            best, best_us, best_label = config, us, label
    op_label = f"op {chosen.kernel.value}"
    if best is not None and best_us > op_us * (1 - MIN_GAIN):
        return None, best_us, op_us, op_label, f"{best_label} (within 3 %: the op's choice stands)"
    low = bucket_low(m)
    if best is not None and low < m:
        x_low = torch.randn(low, k, device="cuda", dtype=torch.bfloat16)
        _, want_low, op_low = op_choice(copies, x_low, native)
        us_low = checked_time(copies, x_low, best, native, want_low, best_label)
        if us_low is None or us_low > op_low:
            return None, best_us, op_us, op_label, f"{best_label} (slower at M={low}: not kept)"
        best_label += f" (at M={low} {us_low:.2f} us against {op_low:.2f})"
    if best is not None:
        best = {"KERNEL": kernel_for(m, best).value, **best}
    return best, best_us, op_us, op_label, best_label


def op_choice(copies, x, native: bool):
    """The op's own choice with no tuned entry (the rule tables): (choice, output, us)."""
    w = copies[0]
    with tuning.ignored():
        chosen = choose(w.fmt, x, w.inner[0], w.group, native)
        out = linear_launch(w.fmt, x, *w.inner, None, w.group, native=native)
        return chosen, out, time_config(copies, x, None, native)


def checked_time(copies, x, config, native: bool, want, label: str) -> float | None:
    """The op's us with `config`, after its output is checked against `want`; None (and why,
    printed) where it differs or does not build here."""
    w = copies[0]
    try:
        got = linear_launch(w.fmt, x, *w.inner, None, w.group, config, native)
        error = relative_error(got, want)
        if error > MAX_DIFFERENCE:
            print(f"  ({label}: differs from the op by {error:.2e}; skipped)")
            return None
        return time_config(copies, x, config, native)
    except Exception as e:  # a config that does not build here: shown, not fatal
        print(f"  ({label}: {type(e).__name__}: {str(e)[:120]})")
        return None


def bucket_low(m: int) -> int:
    """The lowest M of the bucket whose top is m: one past the bucket below."""
    below = [b for b in tuning.M_BUCKETS if b < m]
    return below[-1] + 1 if below else m


def held(weight, fmt_name: str):
    """The weight as an Int4Tensor holds it on this GPU: int4 codes in the native order on
    Hopper; (weight, native)."""
    native = fmt_name == "int4" and native_int4_problem(weight.inner[0].device) is None
    if native:
        weight.inner = (native_codes(weight.inner[0]), *weight.inner[1:])
    return weight, native


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--ms", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in LLAMA.values()))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    load_w4a16_ops()
    name = torch.cuda.get_device_name()
    gpu = traits(torch.cuda.current_device())
    out = args.out or default_out(gpu, name)
    data = {"version": tuning.TUNED_FORMAT_VERSION, "configs": {}}
    if os.path.exists(out):
        measured_on = tuning.file_traits(out)
        if measured_on != gpu:
            raise SystemExit(
                f"{out} was measured on a GPU of {measured_on}, this one is {gpu}: its entries "
                f"would be relabelled; give a new file with --out"
            )
        with open(out) as f:
            data = json.load(f)
    data.update(version=tuning.TUNED_FORMAT_VERSION, gpu=name, traits=gpu.to_json())
    data["triton"] = triton.__version__
    data.pop("note", None)  # a shipped file's words on how it was made
    print(versions_line(()), gpu)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for fmt_name in args.formats.split(","):
        for n, k in shapes:
            made = FORMATS[fmt_name](torch.randn(n, k, device="cuda") * 0.02)
            weight, native = held(made, fmt_name)
            for m in sorted({tuning.m_bucket(int(v)) for v in args.ms.split(",")}):
                config, us, op_us, op_label, label = tune_shape(weight, native, n, k, m)
                fmt = tuned_format(weight.fmt, weight.group, native)
                key = tuning.config_key("w4a16", fmt, n, k, m)
                print(
                    f"- {key}: {op_label} {op_us:.2f} us; best {label} {us:.2f} us "
                    f"({op_us / us:.2f}x)",
                    flush=True,
                )
                if config is not None:
                    data["configs"][key] = config
                else:
                    data["configs"].pop(key, None)
            write(data, out)  # after every shape: a run cut short keeps what it measured
    print(f"wrote {len(data['configs'])} tuned configs to {out}")


def default_out(gpu, name: str) -> str:
    """The shipped file measured on a GPU of these traits (it is extended), else a new one."""
    shipped = tuning.shipped_file(gpu, name)
    if shipped is not None and tuning.file_traits(shipped) == gpu:
        return str(shipped)
    return str(tuning.TUNED_DIR / f"{name.lower().replace(' ', '_')}.json")


def write(data: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
