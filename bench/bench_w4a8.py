"""W4A8 (int4 weights on FP8 tensor cores, kernels/w4a8.py) on one GPU: its correctness against
the float64 reference (odd shapes, experts, a TP-cut weight, compiled), the tile sweep, and the
op (the tile kernel below 128 tokens, cuBLAS from 128: kernels/w4a8_triton/) on the
Llama-3.1-8B layer (qkv, o, gate_up, down summed) beside bf16 `F.linear`, the int4
weight-only op (on the codes an Int4Tensor holds there, native on Hopper) and FP8 blockwise.

    PYTHONPATH=$PWD python bench/bench_w4a8.py [--ms 1,16,64,128,512,2048] [--sweep]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from harness import (
    LLAMA,
    add_to_layer,
    copies_for,
    print_layer,
    relative_error,
    timed,
    versions_line,
)

import qshard
from qshard.config import ScaleFormat
from qshard.kernels.availability import native_int4_problem
from qshard.kernels.fp8_blockwise import quantize_weight_blockwise
from qshard.kernels.int4 import quantize_int4
from qshard.kernels.loader import load_gpu_ops, load_w4a8_ops, load_w4a16_ops
from qshard.kernels.packing import native_codes
from qshard.kernels.w4a8 import ActivationQuant, w4a8_linear_reference
from qshard.qtensor.registry import layout_for

# Against the reference (fp32 per-block sums): the tensor cores' fp8 accumulation inside a block.
MAX_RELATIVE_ERROR = 2e-3
SWEEP = [  # BLOCK_N, BLOCK_M, warps, stages
    (64, 16, 4, 4),
    (128, 16, 4, 4),
    (128, 32, 4, 4),
    (64, 64, 4, 4),
    (128, 64, 4, 4),
    (128, 64, 8, 3),
    (128, 128, 4, 3),
    (128, 128, 8, 3),
    (128, 128, 8, 4),
    (256, 128, 8, 3),
    (128, 256, 8, 3),
]


def check() -> None:
    """The ops against the reference on the GPU: odd shapes, both modes, every group size."""
    torch.manual_seed(0)
    cases = [  # m, n, k, group, symmetric, mode
        (1, 4096, 4096, 128, False, "fp8_group"),
        (37, 1000, 1000, 64, True, "fp8_group"),
        (300, 777, 2048, 256, False, "fp8_token"),
        (2048, 512, 4096, 64, False, "fp8_group"),
        (7, 300, 301, 128, False, "fp8_token"),
        (5, 96, 300, 128, True, "fp8_token"),
    ]
    for m, n, k, group, symmetric, mode in cases:
        w = torch.randn(n, k, device="cuda") * 0.02
        q, s, z = quantize_int4(w, group, symmetric)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        want = w4a8_linear_reference(x, q, s, z, group, ActivationQuant(mode), bias)
        got = torch.ops.qshard.int4_w4a8_linear(x, q, s, z, bias, group, mode)
        err = relative_error(got, want)
        print(f"check {m}x{n}x{k} g{group} sym={symmetric} {mode}: rel. error {err:.2e}")
        assert err < MAX_RELATIVE_ERROR, err
    # experts, a model through quantize_, compiled, and a TP cut (64 columns: groups of 64)
    experts, n, k = 8, 384, 512
    w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    config = qshard.Int4WeightOnlyConfig(activations="fp8_group")
    weight = layout_for(config).from_float(w, config)
    counts = torch.tensor([0, 70, 1, 3, 0, 200, 17, 9], device="cuda")
    x = torch.randn(int(counts.sum()) + 5, k, device="cuda", dtype=torch.bfloat16)
    offs = counts.cumsum(0).int()
    got = weight.grouped_linear(x, offs)
    want = torch.zeros_like(got)
    start = 0
    for e, end in enumerate(offs.tolist()):
        q, s, z = weight.qdata[e], weight.scale[e], weight.zero[e]
        want[start:end] = w4a8_linear_reference(
            x[start:end], q, s, z, 128, ActivationQuant.FP8_GROUP
        )
        start = end
    err = relative_error(got, want)
    print(f"check experts {experts}x{n}x{k}: rel. error {err:.2e}, tail {got[start:].abs().max()}")
    assert err < MAX_RELATIVE_ERROR and not got[start:].any(), err
    model = torch.nn.Sequential(torch.nn.Linear(4096, 1024), torch.nn.Linear(1024, 512))
    model = model.cuda().to(torch.bfloat16)
    dense = [m.weight.detach().clone() for m in model]
    qshard.quantize_(model, config)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    compiled = torch.compile(model, fullgraph=True)(x)
    print(f"check compiled vs eager: max diff {(compiled - eager).abs().max().item():.3g}")
    assert torch.equal(compiled, eager)
    float_out = F.linear(F.linear(x, dense[0], model[0].bias), dense[1], model[1].bias)
    print(f"check model vs float: rel. error {relative_error(eager, float_out):.3f}")
    cut = model[0].weight[:, 64:1088]  # a row-parallel shard cut at 64 columns
    xs = x[:, 64:1088]
    want = w4a8_linear_reference(
        xs, cut.canonical().qdata, cut.scale, cut.zero, cut.group_size, ActivationQuant.FP8_GROUP
    )
    err = relative_error(F.linear(xs, cut), want)
    print(f"check TP cut (groups of {cut.group_size}): rel. error {err:.2e}")
    assert err < MAX_RELATIVE_ERROR, err


SCALE_FORMS = {
    "[N,G] N-contiguous": lambda s: s.t().contiguous().t(),
    "[N,G] G-contiguous": lambda s: s.contiguous(),
    "[G,N] N-contiguous": lambda s: s.t().contiguous(),
    "[G,N] G-contiguous": lambda s: s.t(),
}


def probe_cublas() -> bool:
    """Which layout of the weight's 1 x 128 scales `F.scaled_mm` takes (and gets right): the
    first that does stays `cublas.weight_scales` (the op's, from 128 tokens); False if none."""
    from qshard.kernels.w4a8_triton import cublas

    torch.manual_seed(0)
    n, k, m = 1024, 2048, 128  # (cuBLAS runs from CUBLAS_MIN_TOKENS)
    w = torch.randn(n, k, device="cuda") * 0.02
    q, s, z = quantize_int4(w, 128, False)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    want = w4a8_linear_reference(x, q, s, z, 128, ActivationQuant.FP8_GROUP)
    for label, form in SCALE_FORMS.items():
        cublas.weight_scales = form
        try:
            got = torch.ops.qshard.int4_w4a8_linear(x, q, s, z, None, 128, "fp8_group")
            err = relative_error(got, want)
        except Exception as e:
            print(f"cublas scales {label}: fails {type(e).__name__}: {str(e)[:150]}")
            continue
        print(f"cublas scales {label}: rel. error {err:.2e}")
        if err < MAX_RELATIVE_ERROR:
            return True
    return False


def layer_table(ms) -> None:
    torch.manual_seed(0)
    sums: dict = {}
    native = native_int4_problem(torch.device("cuda")) is None
    for name, (n, k) in LLAMA.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s, z = quantize_int4(w, 128, False)
        copies = copies_for(n * k // 2, 1)
        codes = native_codes(q) if native else q
        held = [(codes.clone(), s.clone(), z.clone()) for _ in range(copies)]
        canon = [(q.clone(), s.clone(), z.clone()) for _ in range(copies)]
        fp8 = [quantize_weight_blockwise(w, (128, 128), ScaleFormat.FP32) for _ in range(2)]
        dense = [(w.clone(),) for _ in range(2)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {
                "bf16": timed(lambda d: lambda a, d=d: F.linear(a, d), dense, x),
                "w4a16": timed(
                    lambda q, s, z: (
                        lambda a: torch.ops.qshard.int4_linear(a, q, s, z, None, 128, False, native)
                    ),
                    held,
                    x,
                ),
                "w4a8": timed(
                    lambda q, s, z: (
                        lambda a: torch.ops.qshard.int4_w4a8_linear(
                            a, q, s, z, None, 128, "fp8_group"
                        )
                    ),
                    canon,
                    x,
                ),
            }
            for label, backend in (("fp8", "auto"), ("fp8-triton", "triton")):
                row[label] = timed(
                    lambda q, s, b=backend: (
                        lambda a: torch.ops.qshard.fp8_blockwise_linear(
                            a, q, s, None, 128, 128, 128, False, b
                        )
                    ),
                    fp8,
                    x,
                )
            cells = "  ".join(f"{key} {v:.2f}" for key, v in row.items())
            print(f"{name} {n}x{k} M={m}: {cells}", flush=True)
            add_to_layer(sums, m, row, tuple(row))
    print_layer(sums)


def sweep(ms) -> None:
    from qshard.kernels.w4a8_triton.ops import w4a8_launch

    torch.manual_seed(0)
    totals: dict = {}
    for name, (n, k) in LLAMA.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s, z = quantize_int4(w, 128, False)
        canon = [(q[None].clone(), s[None].clone(), z[None].clone()) for _ in range(4)]
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for bn, bm, warps, stages in SWEEP:
                if bm > 2 * max(m, 16):
                    continue
                cfg = {"BLOCK_N": bn, "BLOCK_M": bm, "num_warps": warps, "num_stages": stages}
                try:
                    us = timed(
                        lambda q, s, z, cfg=cfg: (
                            lambda a: w4a8_launch(
                                a, None, q, s, z, None, 128, ActivationQuant.FP8_GROUP, cfg
                            )
                        ),
                        canon,
                        x,
                    )
                except Exception as e:  # e.g. out of shared memory
                    print(f"sweep {name} M={m} {cfg}: fails {type(e).__name__}")
                    continue
                key = (m, bn, bm, warps, stages)
                totals[key] = totals.get(key, 0.0) + us
    for m in ms:
        ranked = sorted((v, key[1:]) for key, v in totals.items() if key[0] == m)
        best = ", ".join(f"{c} {v:.1f}" for v, c in ranked[:4])
        print(f"sweep M={m} (BLOCK_N, BLOCK_M, warps, stages) layer us: {best}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ms", default="1,16,64,128,512,2048")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    print(versions_line([]))
    load_w4a8_ops()
    load_w4a16_ops()
    load_gpu_ops()
    ms = [int(v) for v in args.ms.split(",")]
    if not args.no_check:
        check()
    if args.sweep:
        sweep(ms)
    print(f"cuBLAS route: {probe_cublas()}")
    layer_table(ms)


if __name__ == "__main__":
    main()
