"""CPU forward of a quantized transformers Llama against its float model, in one process
(issue 23's target: hidden 1024, 2 layers, 64 tokens; docs/cpu.md).

    python bench/cpu_forward.py [--dtype float32 bfloat16] [--tokens 64] [--repeats 10]

Prints, per float dtype, the float forward's median wall-clock time and each layout's under
`backend="auto"` (dequantize, then the BLAS) and `backend="reference"` (float64 sums), as
milliseconds and as a ratio to float. The output head and embeddings stay float (qshard's
default selection), as in a real quantized checkpoint.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import qshard
from qshard.config import Backend

LAYOUTS = {
    "int4 g128": qshard.Int4WeightOnlyConfig(),
    "fp8 blockwise": qshard.Fp8BlockwiseConfig(),
    "fp8 per-row": qshard.Fp8RowwiseConfig(),
    "mxfp4": qshard.MXFP4WeightOnlyConfig(),
    "nvfp4": qshard.NVFP4WeightOnlyConfig(),
}


def median_ms(model, ids, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        model(ids)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            model(ids)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--reference", action="store_true", help="also time backend='reference'")
    args = parser.parse_args()
    config = LlamaConfig(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{torch.backends.cpu.get_cpu_capability()}; Llama hidden 1024, 2 layers, "
        f"{args.tokens} tokens"
    )
    print("| float dtype | layout | auto ms | auto / float | reference / float |")
    print("|---|---|---|---|---|")
    for dtype_name in args.dtype:
        base = LlamaForCausalLM(config).to(getattr(torch, dtype_name)).eval()
        float_ms = median_ms(base, ids, args.repeats)
        print(f"| {dtype_name} | float | {float_ms:.1f} | 1.00x | |")
        for name, layout in LAYOUTS.items():
            model = copy.deepcopy(base)
            qshard.quantize_(model, layout)
            auto_ms = median_ms(model, ids, args.repeats)
            reference = ""
            if args.reference:
                model = copy.deepcopy(base)
                qshard.quantize_(model, dataclasses.replace(layout, backend=Backend.REFERENCE))
                reference = f"{median_ms(model, ids, max(2, args.repeats // 4)) / float_ms:.2f}x"
            print(
                f"| {dtype_name} | {name} | {auto_ms:.1f} | {auto_ms / float_ms:.2f}x | "
                f"{reference} |"
            )


if __name__ == "__main__":
    main()
