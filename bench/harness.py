"""What the benchmark scripts share: the shapes they time, CUDA-graph timing over enough weight
copies that small-M figures measure HBM rather than L2, the machine line every table starts
with, and the bf16 baseline. Run the scripts as `python bench/<script>.py`: Python puts bench/
on the path, so they import this module by name."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
import triton
import triton.testing

from qshard.kernels import int4, mxfp4, nvfp4
from qshard.kernels.w4a16.format import Format

__all__ = [
    "DEEPSEEK",
    "FORMATS",
    "L2_BYTES",
    "LLAMA",
    "MS",
    "add_to_layer",
    "best_four",
    "bf16_method",
    "copies_for",
    "layer_weights",
    "load_gemlite_config",
    "measure",
    "print_layer",
    "reference",
    "relative_error",
    "sweep_results",
    "time_us",
    "timed",
    "versions_line",
]

LLAMA = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DEEPSEEK = {
    "24576x7168": (24576, 7168),
    "7168x2048": (7168, 2048),
    "18432x7168": (18432, 7168),
    "7168x18432": (7168, 18432),
}
MS = (1, 16, 128, 2048, 4096)
L2_BYTES = 50 * 2**20


def copies_for(bytes_per_weight: int, m: int) -> int:
    """Enough weight copies that one pass over them does not fit in L2 (small M only)."""
    return 1 if m >= 2048 else max(1, math.ceil(3 * L2_BYTES / bytes_per_weight))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp32."""
    want = want.float()
    return ((got.float() - want).norm() / want.norm()).item()


def time_us(fn, count: int) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3 / count


def bf16_method(w):
    return lambda x: F.linear(x, w)


def load_gemlite_config() -> None:
    import gemlite

    config = os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json")
    # The H200 has no shipped config (docs/design.md, "PyTorch behaviour").
    gemlite.core.GemLiteLinear.load_config(config)


def measure(build, shapes: dict, m: int, bytes_per_weight: float = 1.0) -> float | str:
    """Summed time (us) over `shapes` at M = m of the callables `build(weight)` returns (one
    per weight copy, `bytes_per_weight` sizing the copies), or the error that stopped it. x is
    bf16 unless `build.x_dtype` names another (a baseline that takes fp16 only)."""
    x_dtype = getattr(build, "x_dtype", torch.bfloat16)
    total = 0.0
    for n, k in shapes.values():
        try:
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            count = copies_for(int(n * k * bytes_per_weight), m)
            fns = [build(w if i == 0 else w.clone()) for i in range(count)]
            x = torch.randn(m, k, device="cuda", dtype=x_dtype)
            total += time_us(lambda fns=fns, x=x: [f(x) for f in fns], count)
            del fns
        except Exception as e:  # reported in the table, e.g. a baseline that cannot run
            return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
    return total


def versions_line(optional) -> str:
    """The line GPU: <name>; torch <v>, triton <v>, each optional package <v or why not>."""
    versions = {"torch": torch.__version__, "triton": triton.__version__}
    for name in optional:
        try:
            versions[name] = __import__(name).__version__
        except Exception as e:  # reported, not hidden
            versions[name] = f"unavailable ({type(e).__name__})"
    listed = ", ".join(f"{k} {v}" for k, v in versions.items())
    return f"GPU: {torch.cuda.get_device_name()}; {listed}"


def sweep_results(ms, shapes: dict, candidates, time_shape):
    """For each M: (M, [(summed us, label, per-shape us)] best first) over `candidates(m)`,
    (label, config_for(n, k)) pairs, each shape timed by `time_shape(name, n, k, m, config)`.
    A candidate that fails (e.g. does not compile) is printed and left out."""
    for m in ms:
        results = []
        for label, config_for in candidates(m):
            try:
                per_shape = [
                    time_shape(name, n, k, m, config_for(n, k)) for name, (n, k) in shapes.items()
                ]
            except Exception as e:  # a config that does not compile: shown, not fatal
                print(f"  (M={m} {label}: {type(e).__name__}: {str(e).splitlines()[0][:80]})")
                continue
            results.append((sum(per_shape), label, per_shape))
        yield m, sorted(results, key=lambda r: r[0])


def best_four(results) -> str:
    return "; ".join(
        f"{t:.0f} us {label} ({'/'.join(f'{p:.0f}' for p in per)})" for t, label, per in results[:4]
    )


# ---- the 4-bit formats on a Llama layer (bench_op_layer.py, tune_w4a16.py) ----------------


def _nvfp4(w: torch.Tensor) -> tuple:
    g = nvfp4.global_scale_of(w)
    return (*nvfp4.quantize_nvfp4(w, g), None, g)


# --format: (Format, group, quantize: weight -> (codes, scale, zero or None, global or None))
FORMATS = {
    "int4": (Format.INT4_ASYM, 128, lambda w: (*int4.quantize_int4(w, 128, symmetric=False), None)),
    "mxfp4": (Format.MXFP4, 32, lambda w: (*mxfp4.quantize_mxfp4(w), None, None)),
    "nvfp4": (Format.NVFP4, 16, _nvfp4),
}


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
        cells = "  ".join(
            f"{key} {v:.1f} ({bf16 / v:.2f}x)" for (mm, key), v in sums.items() if mm == m
        )
        print(f"M={m}: {cells}")


def reference(fmt: Format, q, s, z, g, group: int, k: int) -> torch.Tensor:
    """The format's dequantized weight (fp32), from its reference module."""
    if fmt == Format.MXFP4:
        return mxfp4.dequantize_mxfp4(q, s, group, k, torch.float32)
    if fmt == Format.NVFP4:
        return nvfp4.dequantize_nvfp4(q, s, g, group, k, torch.float32)
    return int4.dequantize_int4(q, s, z, group, k, torch.float32)
