"""Where a decode step's time goes, per layout (GPU): the compiled step's time per token early
and late in the decode, whether inductor kept its CUDA graphs (and why not), recompiles, and a
kernel profile of the same step compiled without CUDA graphs (kernels per token, GPU time per
token, the top kernels).

    python bench/profile_decode.py [--layouts bf16,int4-g128,fp8-block] [--batch 1]
        [--prompt 1024] [--new 256] [--config llama-3.1-8b|tiny]

Each layout runs in this process one after the other; use it to find a cause, and
bench_decode.py (a fresh process per measurement) for the numbers to report.
"""

from __future__ import annotations

import argparse
import collections
import gc
import time

import torch
from bench_decode import build

from qshard.models import LlamaConfig, decode_one_token, generate, prefill


def step_times(model, step, prompt, new: int) -> list[float]:
    """Milliseconds of each decode step (synchronised per step)."""
    token = prefill(model, prompt)
    times = []
    for i in range(new):
        position = torch.tensor([prompt.shape[1] + i], device=prompt.device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        token = step(model, token, position).clone()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def kernel_profile(model, step, prompt, steps: int = 4, top: int = 14) -> None:
    from torch.profiler import ProfilerActivity, profile

    token = prefill(model, prompt)
    position = torch.tensor([prompt.shape[1]], device=prompt.device)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = step(model, token, position).clone()
        torch.cuda.synchronize()
    totals, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time_total
            counts[event.name] += 1
    total = sum(totals.values()) / steps
    kernels = sum(counts.values()) / steps
    print(
        f"  no CUDA graphs: {kernels:.0f} kernels per token, {total / 1e3:.2f} ms GPU time per "
        f"token"
    )
    for name, us in totals.most_common(top):
        print(f"    {us / steps:8.1f} us  x{counts[name] / steps:5.0f}  {name[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", default="bf16,int4-g128,fp8-block")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--config", default="llama-3.1-8b", choices=["llama-3.1-8b", "tiny"])
    parser.add_argument("--no-kernels", action="store_true", help="skip the kernel profile")
    parser.add_argument("--no-freezing", dest="freezing", action="store_false")
    args = parser.parse_args()
    torch._inductor.config.freezing = args.freezing
    import torch._dynamo.utils as dynamo_utils

    device = torch.device("cuda")
    config = LlamaConfig.llama_3_1_8b() if args.config == "llama-3.1-8b" else LlamaConfig.tiny()
    print(
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; batch {args.batch}, "
        f"prompt {args.prompt}, {args.new} new tokens, freezing {args.freezing}"
    )
    for layout in args.layouts.split(","):
        torch._dynamo.reset()
        dynamo_utils.counters.clear()
        model = build(config, layout, device)
        gc.collect()
        torch.cuda.empty_cache()
        model.setup_caches(args.batch, args.prompt + args.new + 8)
        generator = torch.Generator(device).manual_seed(1)
        prompt = torch.randint(
            0, config.vocab_size, (args.batch, args.prompt), device=device, generator=generator
        )
        with torch.no_grad():
            step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
            for _ in range(2):
                generate(model, prompt, new_tokens=4, step=step)
            times = step_times(model, step, prompt, args.new)
            stats = dict(dynamo_utils.counters["stats"])
            skips = dict(dynamo_utils.counters["inductor"])
            skips = {k: v for k, v in skips.items() if "cudagraph" in k}
            early, late = times[2:34], times[-32:]
            print(
                f"\n{layout}: step {sorted(early)[len(early) // 2]:.2f} ms (median of steps "
                f"2-33), {sorted(late)[len(late) // 2]:.2f} ms (last 32); "
                f"{1e3 * args.batch / (sum(times) / len(times)):.0f} tok/s synchronised per "
                f"step; dynamo {stats}; inductor cudagraph counters {skips}"
            )
            if not args.no_kernels:
                torch._dynamo.reset()
                plain = torch.compile(decode_one_token, fullgraph=True)
                generate(model, prompt, new_tokens=3, step=plain)
                kernel_profile(model, plain, prompt)
        del model, step
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
