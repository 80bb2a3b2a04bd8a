"""Int4 weight-only linears (asymmetric, group 128) vs bf16, tinygemm, gemlite and Marlin; the W4A16
kernel sweep (also used by bench_fp4.py).

    python bench/bench_int4.py [--sweep] [--methods bf16,qshard-triton,qshard-tinygemm,...]
        [--ms 1,16,128,2048]

The four linears of a Llama-3.1-8B layer (summed), timed as bench_fp8.py does (CUDA graphs,
weight copies rotated past the L2). Each cell: time, speedup over bf16 F.linear, and the
fraction of the roofline, max(bytes moved / measured copy bandwidth, flops / measured bf16
matmul peak). Also the output's relative error vs the float linear, per method, on one shape.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from harness import (
    LLAMA,
    best_four,
    bf16_method,
    copies_for,
    load_gemlite_config,
    measure,
    sweep_results,
    time_us,
    versions_line,
)

from qshard.kernels import int4 as ref
from qshard.kernels.loader import load_w4a16_ops

GROUP = 128


def quantized(w):
    """qshard's asymmetric g128 quantization; every method below starts from these codes."""
    packed, scale, zero = ref.quantize_int4(w, GROUP, symmetric=False)
    return packed, scale, zero


def qshard_triton_method(w):
    """The op on the codes as an Int4Tensor holds them on this GPU: in the native order on
    Hopper (layouts/int4.py, `native_order_problem`), else canonical."""
    from qshard.kernels.availability import native_int4_problem
    from qshard.kernels.packing import native_codes

    packed, scale, zero = quantized(w)
    native = w.shape[1] % 128 == 0 and native_int4_problem(w.device) is None
    packed = native_codes(packed) if native else packed
    op = torch.ops.qshard.int4_linear
    return lambda x: op(x, packed, scale, zero, None, GROUP, False, native)


def tinygemm_method(w):
    """aten._weight_int4pack_mm: (u - 8) * s + z' with z' = (8 - zero) * s (docs/design.md,
    "PyTorch behaviour"), the even element in the high nibble."""
    packed, scale, zero = quantized(w)
    u = ref.unpack_nibbles(packed, w.shape[1])
    tiny_packed = (u[:, 0::2] << 4) | u[:, 1::2]
    weight = torch.ops.aten._convert_weight_to_int4pack(tiny_packed.contiguous(), 8)
    shifted_zero = (8 - zero.float()) * scale.float()
    scale_and_zero = torch.stack([scale.float(), shifted_zero], -1).transpose(0, 1)
    scale_and_zero = scale_and_zero.contiguous().to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, weight, GROUP, scale_and_zero)


def gemlite_method(w):
    from gemlite.helper import A16Wn

    load_gemlite_config()
    packed, scale, zero = quantized(w)
    u = ref.unpack_nibbles(packed, w.shape[1])
    layer = A16Wn(device="cuda", dtype=torch.bfloat16).from_weights(
        u, scale, zero, W_nbits=4, group_size=GROUP
    )
    return layer


def fp16_method(w):
    """F.linear in fp16: the baseline beside Marlin, which takes fp16 activations only."""
    w16 = w.half()
    return lambda x: F.linear(x, w16)


fp16_method.x_dtype = torch.half

_last_marlin = {}  # the last weight Marlin packed and its layer: measure() times copies of one


def marlin_method(w):
    """Marlin (IST-DASLab/marlin at 2f6d7c1, its setup.py's 0.1.1; built by build_marlin.sh):
    symmetric int4 g128 (codes -8..7, scale = group amax / 7), fp16 activations only, so
    `measure` hands it an fp16 x. Its weight form comes from its own `Layer.pack`."""
    import marlin

    last = _last_marlin.get("w")
    if last is not None and last.shape == w.shape and torch.equal(last, w):
        layer = _last_marlin["layer"]
        copy = marlin.Layer(w.shape[1], w.shape[0], groupsize=GROUP).cuda()
        copy.B.copy_(layer.B)
        copy.s.copy_(layer.s)
        return copy
    n, k = w.shape
    groups = w.float().reshape(n, k // GROUP, GROUP)
    scale = (groups.abs().amax(-1, keepdim=True) / 7).half()  # the codes from Marlin's scale
    fake = (torch.clamp(torch.round(groups / scale.float()), -8, 7) * scale.float()).reshape(n, k)
    linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.half)
    linear.weight.data.copy_(fake)
    layer = marlin.Layer(k, n, groupsize=GROUP).cuda()
    layer.pack(linear, scale[..., 0])
    _last_marlin.update(w=w, layer=layer)
    return layer


marlin_method.x_dtype = torch.half


def layout_method(backend: str):
    """The Int4Tensor layout with `backend`, through F.linear: what a user of the library runs
    (qshard-tinygemm and qshard-gemlite against the bare tinygemm and gemlite rows)."""

    def build(w):
        import qshard

        config = qshard.Int4WeightOnlyConfig(GROUP, backend=backend)
        weight = qshard.Int4Tensor.from_float(w, config)
        return lambda x: F.linear(x, weight)

    return build


METHODS = {
    "bf16": bf16_method,
    "qshard-triton": qshard_triton_method,
    "qshard-tinygemm": layout_method("tinygemm"),
    "qshard-gemlite": layout_method("gemlite"),
    "tinygemm": tinygemm_method,
    "gemlite": gemlite_method,
    "fp16": fp16_method,
    "marlin": marlin_method,
}


def roofline_us(m: int, bandwidth: float, peak: float) -> float:
    total = 0.0
    for n, k in LLAMA.values():
        moved = n * k / 2 + 2 * 2 * n * (k // GROUP) + 2 * m * (k + n)
        total += max(moved / bandwidth, 2 * m * n * k / peak)
    return total * 1e6


def machine_limits() -> tuple[float, float]:
    """(copy bandwidth in bytes/s, bf16 matmul peak in flop/s), measured here."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    bandwidth = 2 * a.numel() / (triton.testing.do_bench(lambda: b.copy_(a)) * 1e-3)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192**3 / (triton.testing.do_bench(lambda: x @ x) * 1e-3)
    return bandwidth, peak


def accuracy(methods: dict, names) -> None:
    """Each method's output relative error vs the float linear on o_proj, M = 16."""
    n, k = LLAMA["o"]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    expected = F.linear(x.float(), w.float())
    print("\n### Accuracy (o_proj 4096x4096, M = 16, N(0, 0.02) weights)\n")
    for name in names:
        try:
            build = methods[name]
            out = build(w)(x.to(getattr(build, "x_dtype", x.dtype))).float()
            error = ((out - expected).norm() / expected.norm()).item()
            print(f"- {name}: output relative error vs float {error:.4f}")
        except Exception as e:
            print(f"- {name}: fails: {type(e).__name__}: {str(e).splitlines()[0][:80]}")


def weight_only_table(title: str, methods: dict, names, ms, roofline) -> None:
    """A markdown table: per method and M the Llama layer's summed time, speedup over bf16 and
    fraction of `roofline(method name, m)` (us); then each method's accuracy."""
    print(f"\n### {title}\n")
    print("| method | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    base = {m: measure(bf16_method, LLAMA, m, 0.5) for m in ms}
    for name in names:
        cells = []
        for m in ms:
            t = base[m] if name == "bf16" else measure(methods[name], LLAMA, m, 0.5)
            if isinstance(t, str):
                cells.append(t)
            else:
                roof = roofline(name, m)
                cells.append(f"{t:.0f} us ({base[m] / t:.2f}x, {roof / t:.0%} of roofline)")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    accuracy(methods, [name for name in names if name != "bf16"])


GEMV_SWEEP = [  # (weight rows, K per step, warps)
    (16, 1024, 4),
    (8, 1024, 4),
    (16, 512, 4),
    (32, 512, 8),
    (16, 2048, 8),
    (32, 256, 4),
    (8, 512, 2),
]
WORDS_SWEEP = [  # (weight rows, 32-bit words (8 codes) per step, warps, codes evict-first)
    (8, 128, 4, 1),
    (16, 128, 4, 1),
    (16, 256, 4, 1),
    (16, 64, 2, 1),
    (8, 256, 4, 1),
    (16, 256, 8, 1),
    (8, 128, 4, 0),
    (16, 128, 4, 0),
]
FUSED_SWEEP = [  # (weight rows, K per step, programs per SM, warps, stages, prefetch depths)
    # Depth 2 (codes loaded two steps ahead; docs/kernels/w4a16.md, "The small-M tensor-core
    # kernel") on the configs that are the fastest with depth 1.
    (64, 128, 2, 4, 3, (1, 2)),
    (128, 128, 2, 8, 3, (1,)),
    (64, 256, 2, 4, 3, (1,)),
    (64, 128, 4, 4, 4, (1, 2)),
    (128, 256, 2, 8, 3, (1,)),
    (64, 64, 4, 4, 4, (1, 2)),
    # 8 programs per SM: the only ones that split K for gate_up (448 tiles of 64 rows) at 16-64
    # tokens, where the kernel waits on latency (H100, 32 tokens, ~3.4 programs per SM: a 128-K
    # step of gate_up took 2.4 us, its instructions issuing in ~1.0 us).
    (64, 128, 8, 4, 3, (1, 2)),
    (64, 64, 8, 4, 4, (1,)),
]


def sweep_candidates(m: int):
    """(label, config or None for dequantize + cuBLAS, as linear_launch takes it)."""
    from qshard.kernels.split_k import split_count

    device = torch.device("cuda", torch.cuda.current_device())
    if m <= 4:
        for bn, bw, warps, evict in WORDS_SWEEP:  # every format, e2m1 included
            label = f"gemv-words {bn}x{bw}w {warps}w" + (" evict-first" if evict else "")
            yield (
                label,
                lambda n, k, c=(bn, bw, warps, evict): dict(
                    KERNEL="gemv_words", BLOCK_N=c[0], BLOCK_W=c[1], num_warps=c[2], EVICT=c[3]
                ),
            )
        for bn, bk, warps in GEMV_SWEEP:
            yield (
                f"gemv {bn}x{bk} {warps}w",
                lambda n, k, c=(bn, bk, warps): dict(BLOCK_N=c[0], BLOCK_K=c[1], num_warps=c[2]),
            )
    if m <= 256:
        fused = [(*c[:5], depth) for c in FUSED_SWEEP for depth in c[5]]
        for bn, bk, waves, warps, stages, prefetch in fused:

            def config(
                n, k, bn=bn, bk=bk, waves=waves, warps=warps, stages=stages, prefetch=prefetch
            ):
                block_m = min(128, max(16, triton.next_power_of_2(m)))
                tiles = triton.cdiv(n, bn) * triton.cdiv(m, block_m)
                split = split_count(tiles, triton.cdiv(k, bk), 4, waves, device)
                return dict(
                    BLOCK_N=bn,
                    BLOCK_M=block_m,
                    BLOCK_K=bk,
                    SPLIT_K=split,
                    PREFETCH=prefetch,
                    num_warps=warps,
                    num_stages=stages,
                )

            depth = f" prefetch {prefetch}" if prefetch > 1 else ""
            yield f"small-m {bn}x{bk} {waves}/SM {warps}w {stages}s{depth}", config
    if m >= 16:
        from qshard.kernels.w4a16 import dequantize

        yield "dequantize + cuBLAS", lambda n, k: dequantize.config()


def time_launch(copies: list, k: int, m: int, config) -> float:
    """us per call of `linear_launch` with `config` on M tokens, over the weight `copies`
    (`Weight4`s of one shape, enough of them to pass the L2: `copies_for`)."""
    from qshard.kernels.w4a16.ops import linear_launch

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    fn = lambda: [linear_launch(w.fmt, x, *w.inner, None, w.group, config) for w in copies]  # noqa: E731
    return time_us(fn, len(copies))


def sweep(ms, formats=None) -> None:
    """Each kernel and config per M and format (Llama layer summed us), best first."""
    formats = formats or {"int4 asym g128": int4_weight}
    for label_fmt, make in formats.items():
        print(f"\n### W4A16 kernel sweep: {label_fmt} (Llama-3.1-8B layer, summed us)\n")
        weights = {
            name: [make(torch.randn(n, k, device="cuda") * 0.02)] for name, (n, k) in LLAMA.items()
        }

        def time_shape(name, n, k, m, config, weights=weights):
            count = copies_for(n * k // 2, m)
            copies = weights[name]
            copies += [copies[0].clone() for _ in range(count - len(copies))]
            return time_launch(copies[:count], k, m, config)

        for m, results in sweep_results(ms, LLAMA, sweep_candidates, time_shape):
            print(f"- M={m}: {best_four(results)}", flush=True)


class Weight4:
    """A weight in one 4-bit format, as `linear_launch` takes it."""

    def __init__(self, fmt, inner, group):
        self.fmt, self.inner, self.group = fmt, inner, group

    def clone(self):
        return Weight4(self.fmt, tuple(t.clone() for t in self.inner), self.group)


def int4_weight(w):
    from qshard.kernels.w4a16.format import Format

    packed, scale, zero = quantized(w)
    return Weight4(Format.INT4_ASYM, (packed, scale, zero, scale), GROUP)


def weight_only_args(methods: dict) -> tuple[argparse.Namespace, list[str], list[int]]:
    """The options of the weight-only benchmarks (this one and bench_fp4.py): (args, method
    names, token counts)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--methods", default=",".join(methods))
    parser.add_argument("--ms", default="1,16,128,2048")
    parser.add_argument("--sweep", action="store_true", help="the kernel configs first")
    parser.add_argument("--no-tables", action="store_true", help="the sweep only")
    args = parser.parse_args()
    return args, args.methods.split(","), [int(m) for m in args.ms.split(",")]


def machine_header(optional_packages) -> tuple[float, float]:
    """Load the kernels, measure the machine and print the versions line and the limits;
    (copy bandwidth in bytes/s, bf16 matmul peak in flop/s)."""
    load_w4a16_ops()
    bandwidth, peak = machine_limits()
    print(versions_line(optional_packages))
    print(f"measured: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s")
    return bandwidth, peak


def main() -> None:
    args, methods, ms = weight_only_args(METHODS)
    bandwidth, peak = machine_header(("gemlite",) if "gemlite" in methods else ())
    if args.sweep:
        sweep(ms)
    if args.no_tables:
        return
    title = "Int4 asymmetric g128, Llama-3.1-8B layer (summed)"
    weight_only_table(title, METHODS, methods, ms, lambda _, m: roofline_us(m, bandwidth, peak))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
