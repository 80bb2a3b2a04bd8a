"""`qshard bench`: the time of a model's linear layers in each quantized layout against bf16,
at a few batch sizes (tokens M), on this machine's GPU (or its CPU: dequantize + BLAS,
docs/cpu.md).

The shapes come from a Hugging Face model directory (every 2-D `*.weight` that `qshard
quantize` would quantize, read from the safetensors headers, each distinct [N, K] once with its
count), from a built-in model name (`llama-3.1-8b`: one decoder layer's four fused linears), or
from "NxK" strings. A layout's time at M is the sum over shapes of count x time(F.linear).

Timing: on CUDA, CUDA graphs (`triton.testing.do_bench_cudagraph`), over enough
weight copies that their total exceeds the 50 MB L2 at small M, so a GEMV reads HBM; on the
CPU, 7 wall-clock runs. Each figure is reported with its spread (`Timing`: fastest, median,
slowest) and the table warns when the repeats spread widely: on a busy CPU a single median
can make a layout look ten times faster than it is. The activation quantization of W8A8 layouts
is included (it runs inside F.linear).
"""

from __future__ import annotations

import functools
import math
import operator
import os
import pathlib
import statistics
import sys
import time
from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..errors import QShardError
from ..formats.source import SafetensorsDir
from ..layouts import layout_for
from ..targets import KEEP_FLOAT
from .configs import CONFIG_NAMES, config_named
from .quantize import is_excluded

__all__ = [
    "MODEL_SHAPES",
    "WIDE_SPREAD",
    "Timing",
    "bench_linears",
    "model_shapes",
    "plot",
    "print_table",
]

# One decoder layer's linears (q/k/v and gate/up fused, as serving stacks run them).
MODEL_SHAPES = {
    "llama-3.1-8b": {(6144, 4096): 1, (4096, 4096): 1, (28672, 4096): 1, (4096, 14336): 1},
}
L2_BYTES = 50 * 2**20


def model_shapes(source: str) -> dict[tuple[int, int], int]:
    """{(N, K): count} of the linear weights of `source`: a built-in model name, a Hugging Face
    directory, or comma-separated "NxK" shapes."""
    if source in MODEL_SHAPES:
        return dict(MODEL_SHAPES[source])
    path = pathlib.Path(source)
    if path.is_dir():
        reader = SafetensorsDir(path)  # the checked headers; no tensor is read
        shapes: Counter = Counter()
        for name, header in reader.header_of.items():
            module = name.removesuffix(".weight")
            if not name.endswith(".weight") or is_excluded(module, KEEP_FLOAT):
                continue
            shape = header.stored[name].shape
            if len(shape) == 2:
                shapes[tuple(shape)] += 1
        if not shapes:
            raise QShardError(f"qshard bench: {path} has no 2-D linear weights")
        return dict(shapes)
    try:
        pairs = [tuple(int(v) for v in s.lower().split("x")) for s in source.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise QShardError(
            f"qshard bench: {source!r} is not a model directory, one of {list(MODEL_SHAPES)}, "
            f"or shapes like 4096x4096,14336x4096"
        )
    return dict(Counter(pairs))


class Timing(NamedTuple):
    """Microseconds of one call: the fastest, the median and the slowest of the repeats."""

    low: float
    median: float
    high: float

    @classmethod
    def of(cls, runs: list[float]) -> Timing:
        return cls(min(runs), statistics.median(runs), max(runs))

    def __add__(self, other: Timing) -> Timing:  # the sum of several shapes' times
        return Timing(*(a + b for a, b in zip(self, other, strict=True)))

    def scaled(self, factor: float) -> Timing:
        return Timing(*(v * factor for v in self))

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median: above WIDE_SPREAD the machine was busy."""
        return (self.high - self.low) / self.median if self.median else 0.0


# Repeats whose slowest and fastest differ by more than this fraction of the median were
# disturbed (another process, frequency changes): the table says so.
WIDE_SPREAD = 0.25


def _timer(device: torch.device):
    """fn -> Timing of one call."""
    if device.type == "cuda":
        import triton.testing  # Triton: a GPU-only dependency

        def cuda_time(fn) -> Timing:
            fn()
            torch.cuda.synchronize()
            runs = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="all")
            return Timing.of([t * 1e3 for t in runs])

        return cuda_time

    def cpu_time(fn) -> Timing:
        fn()
        runs = []
        for _ in range(7):
            start = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - start) * 1e6)
        return Timing.of(runs)

    return cpu_time


def _time_shape(weight_fn, n: int, k: int, m: int, device, dtype, timer) -> Timing:
    """Timing of F.linear at M = m for the weight `weight_fn(w)` makes from [n, k] floats,
    rotating over enough copies to exceed the L2 on a GPU."""
    w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
    count = 1
    if device.type == "cuda" and m < 2048:
        count = max(1, math.ceil(3 * L2_BYTES / (n * k)))  # >= 1 byte per weight
    weights = [weight_fn(w if i == 0 else w.clone()) for i in range(count)]
    x = torch.randn(m, k, device=device, dtype=dtype)
    with torch.no_grad():
        return timer(lambda: [F.linear(x, q) for q in weights]).scaled(1 / count)


def bench_linears(
    shapes: dict[tuple[int, int], int],
    configs: list[str],
    ms: list[int],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, dict[int, Timing | str]]:
    """{"bf16" or config name: {M: the Timing summed over the shapes, or the error that
    stopped it}}."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    unknown = [c for c in configs if c not in CONFIG_NAMES]
    if unknown:
        raise QShardError(f"qshard bench: configs {unknown} are not among {CONFIG_NAMES}")
    timer = _timer(device)
    makers = {"bf16": lambda w: w}
    for name in configs:
        config = config_named(name)
        makers[name] = lambda w, c=config: layout_for(c).from_float(w, c)
    results: dict[str, dict[int, Timing | str]] = {}
    for name, make in makers.items():
        results[name] = {}
        for m in ms:
            try:
                timings = [
                    _time_shape(make, n, k, m, device, dtype, timer).scaled(count)
                    for (n, k), count in shapes.items()
                ]
                results[name][m] = functools.reduce(operator.add, timings)
            except Exception as e:  # shown in the table (e.g. a backend that cannot run)
                results[name][m] = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:50]}"
    return results


def print_table(results: dict, ms: list[int], out=None) -> None:
    """Each cell: the median us [fastest-slowest] (speedup of the medians over bf16); a note
    under the table when some cell's repeats spread wider than WIDE_SPREAD."""
    out = out or sys.stdout
    out.write("| layout | " + " | ".join(f"M={m}" for m in ms) + " |\n")
    out.write("|---|" + "---|" * len(ms) + "\n")
    wide = []
    for name, row in results.items():
        cells = []
        for m in ms:
            t, base = row[m], results["bf16"][m]
            if isinstance(t, str):
                cells.append(t)
                continue
            cell = f"{t.median:.0f} us [{t.low:.0f}-{t.high:.0f}]"
            if not isinstance(base, str):
                cell += f" ({base.median / t.median:.2f}x)"
            cells.append(cell)
            if t.spread > WIDE_SPREAD:
                wide.append(f"{name} M={m} ({t.spread:.0%})")
        out.write(f"| {name} | " + " | ".join(cells) + " |\n")
    out.write(
        "\n(median us of the repeats [fastest-slowest]; x: speedup of the medians over bf16)\n"
    )
    if wide:
        out.write(
            f"Warning: the repeats spread widely in {', '.join(wide)}: the machine was "
            f"busy or its clocks changed; rerun on a quiet machine before trusting these "
            f"speedups.\n"
        )


def plot(results: dict, ms: list[int], path: str | os.PathLike, title: str) -> None:
    """Speedup over bf16 per layout against M, as a PNG (needs matplotlib)."""
    try:
        import matplotlib  # optional: `qshard bench --plot` only

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional (as above)
    except ImportError:
        raise QShardError("qshard bench --plot needs matplotlib (pip install matplotlib)") from None
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, row in results.items():
        points = [
            (m, results["bf16"][m].median / row[m].median)
            for m in ms
            if not isinstance(row[m], str) and not isinstance(results["bf16"][m], str)
        ]
        if points:
            axes.plot(*zip(*points, strict=True), marker="o", label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("tokens (M)")
    axes.set_ylabel("speedup over bf16")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
