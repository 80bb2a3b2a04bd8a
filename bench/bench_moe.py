"""One MoE layer's experts on one GPU: qshard's grouped kernels vs bf16 and torch's FP8.

    python bench/bench_moe.py [--shapes deepseek-v3,qwen3-30b-a3b,gpt-oss-120b]
        [--tokens 1,16,128,1024,4096] [--methods bf16-grouped,bf16-loop,...]

Per shape (docs/design.md, "Experts in transformers") and number of tokens: each token routed to
top-k experts drawn uniformly
at random; the routed rows sorted by expert (as transformers' grouped_mm does; not timed), then
timed: gate_up grouped matmul -> SiLU(gate) * up -> down grouped matmul, activation
quantization included for every W8A8 method. CUDA graphs, median (`triton.testing`); for up to
16 tokens the replays rotate among 4 routings, so the experts hit change and the weights come
from HBM, not L2. Each cell: time, speedup over bf16 `torch._grouped_mm`. Last, the relative
error of each method's output vs bf16's on one routing.

Methods: bf16-grouped (torch._grouped_mm), bf16-loop (F.linear per expert with tokens, the
token counts known on the host), torch-fp8-rowwise (torch._scaled_grouped_mm, row-wise scales,
plain-torch activation quantization; where it runs), qshard-fp8 (blockwise 128x128, 1x128
activations), qshard-int4 (g128 asymmetric), qshard-mxfp4, qshard-nvfp4, and
qshard-int4-dequant (the int4 experts dequantized to bf16 by the 2-D dequantize kernel, then bf16
`torch._grouped_mm`; the dequantization timed: the prefill alternative of
docs/kernels/grouped.md). `--no-gemv` times the 4-bit methods without the decode GEMV (the
tensor-core kernel at every size: the kernels before it, for a before/after in one run).
`--sweep` times the FP8 and int4 gate_up configs; `--sweep-w4` the 4-bit configs of gate_up
and down (the GEMV's at up to 2 rows per expert), per format.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
import torch.nn.functional as F
import triton

import qshard
from qshard.layouts import layout_for

SHAPES = {  # E, hidden H, expert intermediate I, top-k
    "deepseek-v3": (256, 7168, 2048, 8),
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "gpt-oss-120b": (128, 2880, 2880, 4),
}
TOKENS = (1, 16, 128, 1024, 4096)
ROTATE_UP_TO = 16  # tokens: rotate routings so each replay hits other experts
QSHARD_CONFIGS = {
    "qshard-fp8": qshard.Fp8BlockwiseConfig(),
    "qshard-int4": qshard.Int4WeightOnlyConfig(group_size=128),
    "qshard-int4-w4a8": qshard.Int4WeightOnlyConfig(group_size=128, activations="fp8_group"),
    "qshard-mxfp4": qshard.MXFP4WeightOnlyConfig(),
    "qshard-nvfp4": qshard.NVFP4WeightOnlyConfig(),
}


def routing(tokens: int, experts: int, top_k: int, hidden: int, seed: int):
    """(routed rows x sorted by expert [T * k, H] bf16, offs int32 [E], counts on the host)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    chosen = torch.rand(tokens, experts, device="cuda", generator=g).topk(top_k).indices
    ids, order = chosen.reshape(-1).sort()
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = x[order // top_k].contiguous()
    counts = torch.bincount(ids, minlength=experts)
    return rows, counts.cumsum(0).to(torch.int32), counts.tolist()


def act(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_method(gate_up, down):
    """Any weights torch._grouped_mm takes: bf16 tensors, or qshard's quantized experts."""
    up_t, down_t = gate_up.transpose(-2, -1), down.transpose(-2, -1)

    def run(rows, offs, counts):
        h = torch._grouped_mm(rows, up_t, offs=offs)
        return torch._grouped_mm(act(h), down_t, offs=offs)

    return run


def loop_method(gate_up, down):
    def run(rows, offs, counts):
        out, start = [], 0
        for e, count in enumerate(counts):
            if count:
                part = rows[start : start + count]
                out.append(F.linear(act(F.linear(part, gate_up[e])), down[e]))
            start += count
        return torch.cat(out)

    return run


def fp8_rowwise_method(gate_up, down):
    """torch._scaled_grouped_mm with per-row scales: weights [E, K, N] column-major fp8."""

    def quantize(w):  # [E, N, K] -> fp8 [E, N, K] and scales [E, N], an expert at a time
        scale = torch.stack([e.float().abs().amax(-1) for e in w]).clamp(min=1e-12) / 448.0
        pairs = zip(w, scale, strict=True)
        q = torch.stack([(e.float() / s[:, None]).to(torch.float8_e4m3fn) for e, s in pairs])
        return q, scale

    (wu, su), (wd, sd) = quantize(gate_up), quantize(down)

    def matmul(x, w, s, offs):
        xs = x.float().abs().amax(-1).clamp(min=1e-12) / 448.0
        xq = (x.float() / xs[:, None]).to(torch.float8_e4m3fn)
        return torch._scaled_grouped_mm(
            xq, w.transpose(-2, -1), xs, s, offs=offs, out_dtype=torch.bfloat16
        )

    def run(rows, offs, counts):
        return matmul(act(matmul(rows, wu, su, offs)), wd, sd, offs)

    return run


def dequant_method(gate_up, down):
    """int4 g128 experts, all dequantized to bf16 (one 2-D dequantize launch per weight: the
    experts' rows stacked), then bf16 torch._grouped_mm."""
    from qshard.kernels.w4a16.dequantize import dequantize_weight as dequantize_launch
    from qshard.kernels.w4a16.format import Format

    config = QSHARD_CONFIGS["qshard-int4"]
    up_q, down_q = (qshard.Int4Tensor.from_float(w, config) for w in (gate_up, down))

    def dequantize(q):
        e, n, kh = q.qdata.shape
        rows = (t.reshape(e * n, -1) for t in (q.qdata, q.scale, q.zero))
        w = dequantize_launch(Format.INT4_ASYM, *rows, q.scale, 128, 2 * kh, torch.bfloat16)
        return w.view(e, n, 2 * kh)

    def run(rows, offs, counts):
        h = torch._grouped_mm(rows, dequantize(up_q).transpose(-2, -1), offs=offs)
        return torch._grouped_mm(act(h), dequantize(down_q).transpose(-2, -1), offs=offs)

    return run


def build(method: str, gate_up, down):
    if method == "bf16-grouped":
        return grouped_method(gate_up, down)
    if method == "qshard-int4-dequant":
        return dequant_method(gate_up, down)
    if method == "bf16-loop":
        return loop_method(gate_up, down)
    if method == "torch-fp8-rowwise":
        return fp8_rowwise_method(gate_up, down)
    config = QSHARD_CONFIGS[method]
    layout = layout_for(config)
    return grouped_method(layout.from_float(gate_up, config), layout.from_float(down, config))


def time_us(run, routings) -> float:
    def all_routings():
        for rows, offs, counts in routings:
            run(rows, offs, counts)

    all_routings()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(all_routings, rep=200, return_mode="median")
    return ms * 1e3 / len(routings)


def bench_shape(name: str, tokens_list, methods) -> None:
    experts, hidden, inter, top_k = SHAPES[name]
    torch.manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    down = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    results: dict[str, dict[int, str]] = {}
    errors: dict[str, str] = {}
    base: dict[int, float] = {}
    check = routing(64, experts, top_k, hidden, seed=99)
    expected = grouped_method(gate_up, down)(*check).float()
    for method in methods:
        try:
            run = build(method, gate_up, down)
        except Exception as e:  # a baseline that cannot run here is reported
            results[method] = {t: f"fails: {type(e).__name__}" for t in tokens_list}
            continue
        try:
            out = run(*check).float()
            errors[method] = f"{((out - expected).norm() / expected.norm()).item():.4f}"
        except Exception as e:
            errors[method] = f"fails: {type(e).__name__}: {str(e)[:80]}"
        results[method] = {}
        for tokens in tokens_list:
            count = 4 if tokens <= ROTATE_UP_TO else 1
            routings = [routing(tokens, experts, top_k, hidden, seed=s) for s in range(count)]
            try:
                us = time_us(run, routings)
            except Exception as e:
                results[method][tokens] = f"fails: {type(e).__name__}"
                continue
            if method == "bf16-grouped":
                base[tokens] = us
            speedup = f" ({base[tokens] / us:.2f}x)" if tokens in base else ""
            results[method][tokens] = f"{us:.0f} us{speedup}"
        del run
        gc.collect()
        torch.cuda.empty_cache()
    print(
        f"\n## {name}: E={experts}, H={hidden}, I={inter}, top-{top_k}; time of gate_up + act "
        f"+ down (speedup over bf16 torch._grouped_mm)\n"
    )
    print("| method | " + " | ".join(f"T={t}" for t in tokens_list) + " | rel. error |")
    print("|---|" + "---|" * (len(tokens_list) + 1))
    for method, cells in results.items():
        row = " | ".join(cells[t] for t in tokens_list)
        print(f"| {method} | {row} | {errors.get(method, '-')} |")
    from qshard.kernels.grouped.select import choose_w4a16  # (imports Triton)

    picks = [choose_w4a16(0, t * top_k, experts, hidden).kernel.value for t in tokens_list]
    print(
        "\n4-bit gate_up kernel (`kernels/grouped/select.py`): "
        + ", ".join(f"T={t} {k}" for t, k in zip(tokens_list, picks, strict=True))
    )
    sys.stdout.flush()


FP8_SWEEP = [  # (BLOCK_N, BLOCK_M or None: the launcher's, PREQUANT, warps, stages)
    (32, None, False, 4, 3),
    (64, None, False, 4, 3),
    (32, None, False, 4, 4),
    (64, None, True, 4, 3),
    (128, None, True, 8, 3),
    (128, None, True, 8, 4),
    (128, 64, True, 4, 4),
    (64, 128, True, 4, 4),
]
W4_SWEEP = [  # (BLOCK_N, BLOCK_M or None, BLOCK_K, warps, stages)
    (32, None, 128, 4, 3),
    (64, None, 128, 4, 3),
    (32, None, 256, 4, 3),
    (64, None, 256, 4, 2),
    (128, None, 128, 8, 3),
    (64, 64, 128, 4, 3),
]


def sweep(shape: str, tokens_list) -> None:
    """The gate_up grouped matmul alone under each candidate config (launchers called
    directly): the data for the launchers' defaults."""
    from qshard.kernels.grouped import ops as g
    from qshard.kernels.grouped.common import token_block
    from qshard.kernels.w4a16.format import Format

    experts, hidden, inter, top_k = SHAPES[shape]
    torch.manual_seed(0)
    w = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    fp8 = qshard.Fp8BlockwiseTensor.from_float(w)
    int4 = qshard.Int4Tensor.from_float(w, qshard.Int4WeightOnlyConfig(group_size=128))
    del w
    print(f"\n## sweep, {shape} gate_up [{experts}, {2 * inter}, {hidden}], us per call\n")
    for tokens in tokens_list:
        count = 4 if tokens <= ROTATE_UP_TO else 1
        routings = [routing(tokens, experts, top_k, hidden, seed=s) for s in range(count)]
        block_m = token_block(tokens * top_k, experts)
        cells = []
        for bn, bm, pre, warps, stages in FP8_SWEEP:
            config = {
                "BLOCK_N": bn,
                "BLOCK_M": bm or block_m,
                "PREQUANT": pre,
                "num_warps": warps,
                "num_stages": stages,
            }

            def run(rows, offs, counts, config=config):
                g.fp8_grouped_launch(
                    rows, offs, fp8.qdata, fp8.scale, None, 128, 128, 128, False, config
                )

            cells.append(
                f"fp8 {bn}x{bm or block_m}{'p' if pre else ''}w{warps}s{stages} "
                f"{time_us(run, routings):.0f}"
            )
        for bn, bm, bk, warps, stages in W4_SWEEP:
            config = {
                "BLOCK_N": bn,
                "BLOCK_M": bm or block_m,
                "BLOCK_K": bk,
                "num_warps": warps,
                "num_stages": stages,
            }

            def run(rows, offs, counts, config=config):
                g.w4a16_grouped_launch(
                    Format.INT4_ASYM,
                    rows,
                    offs,
                    int4.qdata,
                    int4.scale,
                    int4.zero,
                    int4.scale,
                    None,
                    128,
                    hidden,
                    config,
                )

            cells.append(
                f"int4 {bn}x{bm or block_m}k{bk}w{warps}s{stages} {time_us(run, routings):.0f}"
            )
        print(f"T={tokens}: " + "; ".join(cells))
        sys.stdout.flush()


W4_FORMATS = {  # name: (config, Format name)
    "int4": (qshard.Int4WeightOnlyConfig(group_size=128), "INT4_ASYM"),
    "mxfp4": (qshard.MXFP4WeightOnlyConfig(), "MXFP4"),
    "nvfp4": (qshard.NVFP4WeightOnlyConfig(), "NVFP4"),
}
GEMV_SWEEP = [  # (BLOCK_N, BLOCK_W, warps)
    (16, 64, 2),
    (32, 32, 2),
    (16, 32, 2),
    (16, 32, 1),
    (8, 32, 1),
    (32, 64, 2),
]


def sweep_w4(shape: str, tokens_list, formats=tuple(W4_FORMATS)) -> None:
    """Each 4-bit format's gate_up and down grouped matmuls alone (launchers called directly)
    under the default config and, at up to 2 rows per expert, each GEMV config."""
    from qshard.kernels.grouped import ops as g
    from qshard.kernels.grouped.select import GEMV_MAX_ROWS_PER_EXPERT
    from qshard.kernels.w4a16.format import Format

    experts, hidden, inter, top_k = SHAPES[shape]
    torch.manual_seed(0)
    weights = {
        "gate_up": torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16),
        "down": torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16),
    }
    print(f"\n## 4-bit sweep, {shape}, us per call\n")
    for fmt_name in formats:
        config, fmt = W4_FORMATS[fmt_name]
        layout = layout_for(config)
        for proj, w in weights.items():
            q = layout.from_float(w * 0.02, config)
            k = w.shape[-1]
            zero = getattr(q, "zero", q.scale)
            zero = zero if fmt == "INT4_ASYM" else zero.new_empty(0)
            gscale = getattr(q, "global_scale", q.qdata)
            group = 16 if fmt == "NVFP4" else q.group_size
            args = (Format[fmt], q.qdata, q.scale, zero, gscale, None, group, k)
            for tokens in tokens_list:
                count = 4 if tokens <= ROTATE_UP_TO else 1
                routings = [routing(tokens, experts, top_k, k, seed=s) for s in range(count)]
                rows = tokens * top_k
                configs = [("default", None)]
                if rows <= GEMV_MAX_ROWS_PER_EXPERT * experts:
                    configs.append(
                        (
                            "tc",
                            {
                                "BLOCK_N": 64,
                                "BLOCK_M": 16,
                                "BLOCK_K": 128,
                                "num_warps": 4,
                                "num_stages": 3,
                            },
                        )
                    )
                    configs += [
                        (
                            f"{bn}w{bw}n{nw}",
                            {"KERNEL": "gemv", "BLOCK_N": bn, "BLOCK_W": bw, "num_warps": nw},
                        )
                        for bn, bw, nw in GEMV_SWEEP
                    ]
                cells = []
                for name, cfg in configs:

                    def run(rows, offs, counts, cfg=cfg, args=args):
                        g.w4a16_grouped_launch(args[0], rows, offs, *args[1:], cfg)

                    cells.append(f"{name} {time_us(run, routings):.1f}")
                print(f"{fmt_name} {proj} T={tokens}: " + "; ".join(cells))
                sys.stdout.flush()
            del q
        gc.collect()
        torch.cuda.empty_cache()


def versions() -> str:
    gpu = torch.cuda.get_device_name()
    return f"{gpu}; torch {torch.__version__}, triton {triton.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    methods = ["bf16-grouped", "bf16-loop", "torch-fp8-rowwise", *QSHARD_CONFIGS]
    parser.add_argument("--methods", default=",".join(methods))
    parser.add_argument("--sweep", action="store_true", help="time the kernels' configs")
    parser.add_argument("--sweep-w4", action="store_true", help="time the 4-bit configs")
    parser.add_argument("--formats", default=",".join(W4_FORMATS), help="--sweep-w4's")
    parser.add_argument("--no-gemv", action="store_true", help="4-bit: no decode GEMV")
    args = parser.parse_args()
    print(versions())
    if args.no_gemv:
        from qshard.kernels.grouped import select

        select.GEMV_MAX_ROWS_PER_EXPERT = 0
        print("4-bit decode GEMV off (tensor-core kernel at every size)")
    tokens = [int(t) for t in args.tokens.split(",")]
    for shape in args.shapes.split(","):
        if args.sweep_w4:
            sweep_w4(shape, tokens, args.formats.split(","))
        elif args.sweep:
            sweep(shape, tokens)
        else:
            bench_shape(shape, tokens, args.methods.split(","))


if __name__ == "__main__":
    main()
