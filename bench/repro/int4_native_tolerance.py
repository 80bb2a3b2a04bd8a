"""How far the Hopper kernels on native int4 codes are from the reference, to set the
tolerances of tests/layouts/test_int4_native.py's GPU tests from a measurement.

    python bench/repro/int4_native_tolerance.py [--draws 20] [--planted 0.005]

On one Hopper GPU, for each config of those tests and each token count (whose kernel the op
picks: the word GEMV at 1-2, the wgmma kernel at 3-128, dequantize + cuBLAS above), over fresh
weights and activations: the relative error norm of the bf16 output against a float64
reference of the same dequantized weight, the largest |diff| over the largest |reference|, and
the same with every scale multiplied by 1 + planted (a bug the tests must catch). Then the
test model's compiled step against eager, and a TP row shard against its float reference.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..", "..", "tests")]

from helpers import gaussian  # noqa: E402

import qshard  # noqa: E402
from qshard import Int4Tensor, Int4WeightOnlyConfig  # noqa: E402

CONFIGS = {
    "asym": Int4WeightOnlyConfig(),
    "sym": Int4WeightOnlyConfig(symmetric=True),
    "float-zero-g256": Int4WeightOnlyConfig(group_size=256, zero_point_domain="float"),
}
TOKENS = (1, 2, 3, 16, 33, 64, 128, 129, 300)


def errors(got: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    diff = got.double().cpu() - expected
    return (diff.norm() / expected.norm()).item(), (diff.abs().max() / expected.abs().max()).item()


def kernels(draws: int, planted: float) -> None:
    print("| config | tokens | rel. norm max | max|diff| / max|ref| | planted: rel. norm min |")
    print("|---|---|---|---|---|")
    for name, config in CONFIGS.items():
        worst = {m: [0.0, 0.0, float("inf")] for m in TOKENS}
        for _ in range(draws):
            w = gaussian(1000, 1024, dtype=torch.bfloat16)
            q = Int4Tensor.from_float(w.cuda(), config)
            wrong = Int4Tensor.from_float(w.cuda(), config)
            wrong.scale.mul_(1 + planted)
            reference = Int4Tensor.from_float(w, config).dequantize(torch.float64)
            for m in TOKENS:
                x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
                expected = F.linear(x.cpu().double(), reference)
                norm, peak = errors(F.linear(x, q), expected)
                bad, _ = errors(F.linear(x, wrong), expected)
                old = worst[m]
                worst[m] = [max(old[0], norm), max(old[1], peak), min(old[2], bad)]
        for m, (norm, peak, bad) in worst.items():
            print(f"| {name} | {m} | {norm:.2e} | {peak:.2e} | {bad:.2e} |")


def model_cases(draws: int, planted: float) -> None:
    from torch import nn

    compiled_worst, shard_worst, shard_bad = [0.0, 0.0], [0.0, 0.0], float("inf")
    for _ in range(draws):
        model = nn.Sequential(nn.Linear(512, 320, bias=True), nn.Linear(320, 256))
        model = model.bfloat16().cuda()
        qshard.quantize_(model, Int4WeightOnlyConfig())
        compiled = torch.compile(model, fullgraph=True)
        for m in (1, 16, 100):
            x = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
            eager = model(x).double().cpu()
            norm, peak = errors(compiled(x), eager)
            compiled_worst = [max(compiled_worst[0], norm), max(compiled_worst[1], peak)]
            half = model[0].weight[:, 256:]
            xs = x[:, 256:].contiguous()
            expected = F.linear(xs.cpu().double(), half.cpu().dequantize(torch.float64))
            norm, peak = errors(F.linear(xs, half), expected)
            shard_worst = [max(shard_worst[0], norm), max(shard_worst[1], peak)]
            wrong = model[0].weight.cpu()
            wrong.scale.mul_(1 + planted)
            bad, _ = errors(F.linear(xs, wrong.cuda()[:, 256:]), expected)
            shard_bad = min(shard_bad, bad)
        torch._dynamo.reset()
    print(
        f"compiled vs eager: rel. norm max {compiled_worst[0]:.2e}, "
        f"max|diff|/max|ref| {compiled_worst[1]:.2e}"
    )
    print(
        f"TP row shard vs float64: rel. norm max {shard_worst[0]:.2e}, max|diff|/max|ref| "
        f"{shard_worst[1]:.2e}; planted: rel. norm min {shard_bad:.2e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20)
    parser.add_argument("--planted", type=float, default=0.005)
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    kernels(args.draws, args.planted)
    model_cases(max(2, args.draws // 4), args.planted)


if __name__ == "__main__":
    main()
