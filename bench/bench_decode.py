"""End-to-end greedy decode with qshard.models.Llama (random weights, Llama-3.1-8B shapes):
tokens per second for bf16 and each qshard layout, compiled.

    python bench/bench_decode.py [--layouts bf16,int4-g128,fp8-block,nvfp4,mxfp4]
        [--batches 1,32] [--prompt 1024] [--new 256] [--config llama-3.1-8b|tiny]

Each layout: the model built on the GPU in bf16, every linear quantized (the output head
included), KV caches for prompt + new tokens; the prompt prefilled (eager), then `new` tokens
decoded by `decode_one_token` compiled with mode="reduce-overhead" (CUDA graphs), after a
warm-up that compiles it. Reported: decode tokens/s (batch x new / decode time), the speedup
over bf16 in the same run, and the peak GPU memory. TP 1 only (TP 2 through torchrun is the
next step: issue 9).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import qshard
from qshard.convert import CONFIGS
from qshard.models import Llama, LlamaConfig, decode_one_token, generate, prefill


def build(config: LlamaConfig, layout: str, device: torch.device) -> Llama:
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = Llama(config).eval()
    finally:
        torch.set_default_dtype(default)
    if layout != "bf16":
        qshard.quantize_(model, CONFIGS[layout]())
    return model


@torch.no_grad()
def tokens_per_second(model: Llama, batch: int, prompt_len: int, new: int, device) -> float:
    model.setup_caches(batch, prompt_len + new + 8)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device)
    mode = "reduce-overhead" if device.type == "cuda" else None
    step = torch.compile(decode_one_token, mode=mode, fullgraph=True)
    for _ in range(2):  # compiles, then records the CUDA graph
        generate(model, prompt, new_tokens=4, step=step)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    token = prefill(model, prompt)
    positions = [torch.tensor([prompt_len + i], device=device) for i in range(new)]
    sync()
    start = time.perf_counter()
    for position in positions:  # the decode loop alone, as `generate` runs it
        token = step(model, token, position).clone()
    sync()
    return batch * new / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="bf16,int4-g128,fp8-block,nvfp4,mxfp4")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--config", default="llama-3.1-8b", choices=["llama-3.1-8b", "tiny"])
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = LlamaConfig.llama_3_1_8b() if args.config == "llama-3.1-8b" else LlamaConfig.tiny()
    batches = [int(b) for b in args.batches.split(",")]
    if device.type == "cuda":
        import triton

        print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}, triton "
              f"{triton.__version__}")  # fmt: skip
    print(f"{args.config}, prompt {args.prompt}, {args.new} new tokens, greedy, compiled "
          f"decode step, TP 1\n")  # fmt: skip
    print("| layout | " + " | ".join(f"batch {b}" for b in batches) + " | peak memory |")
    print("|---|" + "---|" * (len(batches) + 1))
    base = {}
    for layout in args.layouts.split(","):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        model = build(config, layout, device)
        cells = []
        for b in batches:
            rate = tokens_per_second(model, b, args.prompt, args.new, device)
            base.setdefault(b, rate if layout == "bf16" else None)
            ratio = f", {rate / base[b]:.2f}x" if base.get(b) else ""
            cells.append(f"{rate:.0f} tok/s{ratio}")
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        print(f"| {layout} | " + " | ".join(cells) + f" | {peak:.1f} GiB |", flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
