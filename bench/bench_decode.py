"""End-to-end greedy decode with qshard.models.Llama (random weights, Llama-3.1-8B shapes):
tokens per second for bf16 and each qshard layout (and torchao's), compiled, at TP 1 or TP N.

    python bench/bench_decode.py [--layouts bf16,int4-g128,fp8-block,fp8-row,nvfp4,mxfp4,...]
        [--batches 1,32] [--prompt 1024] [--new 256] [--config llama-3.1-8b|tiny]
    python bench/bench_decode.py --tp 2 ...     # TP 2: each measurement under torchrun (NCCL)
    python bench/bench_decode.py --config qwen3-30b-a3b [--layers 12]   # mixture of experts

`--config qwen3-30b-a3b`: Qwen3-30B-A3B's shapes (128 experts of 768, top-8, hidden 2048,
`qshard.models.moe`: grouped matmuls over the experts, qshard's grouped kernels once quantized),
with `--layers` of its 48 layers (tokens/s scale with the layers; the speedups do not depend
on them); quantized one layer at a time so the bf16 model and its quantized copy never both
fill the GPU.

Each layout: the model built on the GPU in bf16, every linear quantized (the output head
included), sharded by `qshard.models.TP_PLAN` under torchrun, KV caches for prompt + new tokens
(a rank's heads); the prompt prefilled (eager), then `new` tokens decoded by `decode_one_token`
compiled with mode="reduce-overhead" (CUDA graphs) and inductor freezing (the weights
constants of the graph; without it each call unwraps every quantized weight in Python and the
int4 decode was CPU-bound, docs/decode.md; under TP the sharded linears are made local first,
`qshard.tp.to_local`, since a graph over DTensor weights cannot be frozen), after a warm-up that
compiles it. Reported:
decode tokens/s (batch x new / decode time), the speedup over bf16 in the same run, and the
peak GPU memory of rank 0 while decoding. Each (layout, batch) runs in a fresh process, so no
measurement depends on what ran before it (before freezing, the CPU-bound int4 decode at
batch 1 on an H100 gave 104 to 187 tok/s by order and decode length). Baselines where
torchao is installed (TP 1 only: torchao's tensors are not sharded by qshard's plan):
`torchao-int4` (Int4WeightOnlyConfig g128, tinygemm's tile-packed format), `torchao-fp8-row`
and `torchao-fp8-block` (Float8DynamicActivationFloat8WeightConfig, PerRow / PerBlock 1x128 x
128x128).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import qshard
import qshard.tp
from qshard.convert import CONFIGS
from qshard.models import TP_PLAN, Llama, LlamaConfig, decode_one_token, generate, prefill


def torchao_config(layout: str):
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int4WeightOnlyConfig,
        PerBlock,
        PerRow,
    )

    if layout == "torchao-int4":
        return Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d")
    if layout == "torchao-fp8-row":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    return Float8DynamicActivationFloat8WeightConfig(
        granularity=[PerBlock([1, 128]), PerBlock([128, 128])]
    )


def build(config: LlamaConfig, layout: str, device: torch.device, mesh=None) -> Llama:
    torch.manual_seed(0)  # the same weights on every rank
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = Llama(config).eval()
    finally:
        torch.set_default_dtype(default)
    if layout.startswith("torchao-"):
        from torchao.quantization import quantize_ as torchao_quantize

        torchao_quantize(model, torchao_config(layout))
    elif layout != "bf16":
        for layer in model.layers:  # a layer at a time: the peak is the bf16 model + a layer
            qshard.quantize_(layer, CONFIGS[layout]())
        qshard.quantize_(model.output, CONFIGS[layout]())
    if mesh is not None:
        qshard.tp.parallelize(model, mesh, TP_PLAN)
    return model


@torch.no_grad()
def tokens_per_second(model: Llama, batch: int, prompt_len: int, new: int, device,
                      world: int = 1) -> float:  # fmt: skip
    model.setup_caches(batch, prompt_len + new + 8, tp_world=world)
    generator = torch.Generator(device).manual_seed(1)  # the same prompt on every rank
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=device,
                           generator=generator)  # fmt: skip
    mode = "reduce-overhead" if device.type == "cuda" else None
    step = torch.compile(decode_one_token, mode=mode, fullgraph=True)
    for _ in range(2):  # compiles, then records the CUDA graph
        generate(model, prompt, new_tokens=4, step=step)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        if world > 1:
            dist.barrier()

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
    parser.add_argument("--layouts", default="bf16,int4-g128,fp8-block,fp8-row,nvfp4,mxfp4,"
                        "torchao-int4,torchao-fp8-row,torchao-fp8-block")  # fmt: skip
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument(
        "--config",
        default="llama-3.1-8b",
        choices=["llama-3.1-8b", "tiny", "qwen3-30b-a3b", "tiny-moe"],
    )
    parser.add_argument("--layers", type=int, default=None, help="layers of a MoE config")
    parser.add_argument("--tp", type=int, default=1, help="processes (GPUs) through torchrun")
    parser.add_argument(
        "--no-freezing",
        dest="freezing",
        action="store_false",
        help="compile the step without inductor freezing (docs/decode.md)",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per measurement")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import triton

        print(f"GPU: {torch.cuda.get_device_name()} x {args.tp}; torch {torch.__version__}, "
              f"triton {triton.__version__}, torchao {_version('torchao')}")  # fmt: skip
    layers = f" ({args.layers} layers)" if args.layers else ""
    print(f"{args.config}{layers}, prompt {args.prompt}, {args.new} new tokens, greedy, compiled "
          f"decode step (inductor freezing {'on' if args.freezing else 'off'}), "
          f"TP {args.tp}; each (layout, batch) in a fresh process\n")  # fmt: skip
    batches = args.batches.split(",")
    print("| layout | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    base = {}
    for layout in args.layouts.split(","):
        cells = []
        for batch in batches:
            result = run_child(args, layout, batch)
            if isinstance(result, str):
                cells.append(result)
                continue
            rate, memory = result["rate"], result["memory_gib"]
            base.setdefault(batch, rate if layout == "bf16" else None)
            ratio = f", {rate / base[batch]:.2f}x" if base.get(batch) else ""
            cells.append(f"{rate:.0f} tok/s{ratio} ({memory:.1f} GiB)")
        print(f"| {layout} | " + " | ".join(cells) + " |", flush=True)
    print("\n(GiB: the peak GPU memory of rank 0 while decoding, weights and caches included)")


def run_child(args, layout: str, batch: str) -> dict | str:
    """One (layout, batch) measured in a fresh process (torchrun for TP): compiled graphs and
    CUDA graph pools of an earlier model slowed later ones in the same process (measured)."""
    if layout.startswith("torchao-") and args.tp > 1:
        return "n/a (torchao: TP 1 only)"
    script = [__file__, "--child", "--layouts", layout, "--batches", batch, "--prompt",
              str(args.prompt), "--new", str(args.new), "--config", args.config]  # fmt: skip
    script += ["--layers", str(args.layers)] if args.layers else []
    script += [] if args.freezing else ["--no-freezing"]
    launcher = [sys.executable]
    if args.tp > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.tp}"]
    try:
        done = subprocess.run(launcher + script, capture_output=True, text=True,
                              timeout=args.timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"no result in {args.timeout} s"
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line.removeprefix("RESULT "))
    errors = [line for line in done.stderr.splitlines() if "Error" in line] or ["no result"]
    return f"fails: {errors[-1].strip()[:80]}"


def model_config(name: str, layers: int | None) -> LlamaConfig:
    if name == "qwen3-30b-a3b":
        return LlamaConfig.qwen3_30b_a3b(layers or 48)
    if name == "tiny-moe":
        return LlamaConfig(vocab_size=512, dim=256, n_layers=layers or 2, n_heads=4,
                           n_kv_heads=2, hidden=256, n_experts=8, top_k=2,
                           expert_hidden=128)  # fmt: skip
    return LlamaConfig.llama_3_1_8b() if name == "llama-3.1-8b" else LlamaConfig.tiny()


def child(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mesh, world, rank = None, 1, 0
    if "RANK" in os.environ:  # under torchrun: tensor parallelism over its processes
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        mesh = init_device_mesh(device.type, (world,))
    # Frozen weights are constants of the compiled graph. Without freezing, every call of the
    # compiled step unwraps each quantized weight (a tensor subclass) in Python: that made the
    # int4 decode CPU-bound (docs/decode.md). Under TP the sharded linears are first made local
    # (`qshard.tp.to_local`): a graph over DTensor weights cannot be frozen (their DeviceMesh).
    torch._inductor.config.freezing = args.freezing
    config = model_config(args.config, args.layers)
    model = build(config, args.layouts, device, mesh)
    if mesh is not None:
        model = qshard.tp.to_local(model)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the float model quantize_ started from is gone
    rate = tokens_per_second(model, int(args.batches), args.prompt, args.new, device, world)
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    if rank == 0:
        print("RESULT " + json.dumps({"rate": rate, "memory_gib": memory}), flush=True)
    if world > 1:
        dist.destroy_process_group()


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except Exception:  # not installed, or broken: reported as such
        return None


if __name__ == "__main__":
    main()
