"""End-to-end greedy decode with qshard.models.Llama (random weights, Llama-3.1-8B shapes):
tokens per second for bf16 and each qshard layout (and torchao's), compiled, at TP 1 or TP N.

    python bench/bench_decode.py [--layouts bf16,int4-g128,fp8-block,fp8-row,nvfp4,mxfp4,...]
        [--batches 1,32] [--prompt 1024] [--new 256] [--config llama-3.1-8b|tiny]
    python bench/bench_decode.py --tp 1,2 [--profile] ...   # TP 1 and TP 2 (torchrun, NCCL)
    python bench/bench_decode.py --config qwen3-30b-a3b [--layers 12] [--tp 2 --experts etp]
    python bench/bench_decode.py --config deepseek-v3 --layers 2 --tp 4 --experts ep-x-tp2 --check
    python bench/bench_decode.py --config llama-3.1-70b --layers 2 --tp 1,2,4 --results r.jsonl
    python bench/plot_tp.py r.jsonl --out bench/tp_scaling.png   # tokens/s by TP size

`--config deepseek-v3`: DeepSeek-V3's expert shapes (256 experts of 2048, top-8, hidden 7168)
under this model's grouped-query attention (`LlamaConfig.deepseek_v3_moe`); `llama-3.1-70b`:
Llama-3.1-70B's shapes; `--layers N` takes the first N layers of any config. `--check` (under
TP) also measures the sharded model against one GPU's on the same rank: the SQNR of its first
feed-forward on one input (whole experts under ExpertParallel's all-to-all equal it bit for
bit; cut experts and the all-reduce sums round bf16 partials once more) and of its logits.

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
batch 1 on an H100 gave 104 to 187 tok/s by order and decode length). Under TP a MoE
config's attention is tensor-parallel and its experts take `--experts` (ep: ExpertParallel,
ep-all-to-all, etp: ExpertTensorParallel). `--profile` prints where each step's GPU time goes
(kernels by kind) after the table. Each child runs under a deadline (`--timeout`): a stalled
one prints every rank's stacks, and its stderr is shown. Baselines where torchao is installed
(TP 1 only: torchao's tensors are not sharded by qshard's plan):
`torchao-int4` (Int4WeightOnlyConfig g128, tinygemm's tile-packed format), `torchao-fp8-row`
and `torchao-fp8-block` (Float8DynamicActivationFloat8WeightConfig, PerRow / PerBlock 1x128 x
128x128).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import qshard
import qshard.tp
from qshard.cli.configs import config_named
from qshard.models import EP_PLAN, TP_PLAN, Llama, LlamaConfig, decode_one_token, generate, prefill


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


EXPERT_STYLES = {
    "ep": lambda: qshard.tp.ExpertParallel(),
    # Under TP attention every rank holds the same tokens, so this sends every route once per
    # rank (measured for the comparison; the all-reduce dispatch is the one for this model).
    "ep-all-to-all": lambda: qshard.tp.ExpertParallel(dispatch="all_to_all"),
    "etp": lambda: qshard.tp.ExpertTensorParallel(),
    # EP x TP: world / 2 expert groups, each expert's intermediate dim cut over 2 ranks.
    "ep-x-tp2": lambda: qshard.tp.ExpertParallel(tensor_parallel=2),
}
# The ranks that cut each expert's intermediate dim, by style (1: whole experts).
EXPERT_CUT = {"etp": lambda world: world, "ep-x-tp2": lambda world: 2}


def build(config: LlamaConfig, layout: str, device: torch.device) -> Llama:
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
            qshard.quantize_(layer, config_named(layout))
        qshard.quantize_(model.output, config_named(layout))
    return model


def parallelize(model: Llama, mesh, experts: str) -> None:
    plan = TP_PLAN
    if model.config.n_experts:  # TP attention, the experts by the chosen style
        plan = {**EP_PLAN, "layers.*.feed_forward.experts": EXPERT_STYLES[experts]()}
    qshard.tp.parallelize(model, mesh, plan)


def realigned_experts(model: Llama, cut: int) -> None:
    """Give one GPU's model the packing that cutting each expert's intermediate dim over `cut`
    ranks gives the shards (FP8 blocks re-blocked at a cut inside a block), so that it computes
    with the shards' blocks: the reference a sharded model must equal up to summation order."""
    from qshard.tp.experts import _gate_up_cuts  # the cuts ExpertTensorParallel makes

    for layer in model.layers:
        experts = layer.feed_forward.experts
        size = experts.down_proj.shape[-1]
        # gate_up [E, 2I, dim]: the gate rows, then the up rows, each cut as I is
        for name, dim, cuts in (
            ("gate_up_proj", 1, _gate_up_cuts(2 * size, cut, False)),
            ("down_proj", 2, qshard.tp.shard_cuts(size, cut)),
        ):
            weight = getattr(experts, name)
            if isinstance(weight, qshard.QTensor):
                realigned = weight.realign(dim, cuts)
                setattr(experts, name, torch.nn.Parameter(realigned, requires_grad=False))


@torch.no_grad()
def check(model: Llama, reference: Llama, world: int, device) -> dict[str, float]:
    """SQNR (dB) against one GPU's model of the sharded model's first feed-forward (the experts
    with their router, or the MLP) on the same input, and of its logits on a 2 x 64 prompt.
    The feed-forward isolates the sharding: whole experts under the all-to-all dispatch equal
    one GPU's bit for bit (inf); the all-reduce dispatch sums each token's routes as per-rank
    bf16 partial sums, and cut experts (ETP) their down projection's partials, one rounding
    more; the logits add the attention's row-parallel sums and, in a MoE model, the routes
    those differences flip."""
    generator = torch.Generator(device).manual_seed(2)
    x = torch.randn(2, 64, model.config.dim, device=device, generator=generator)
    x = x.to(torch.bfloat16)
    ffn = model.layers[0].feed_forward, reference.layers[0].feed_forward
    out = {"ffn_sqnr_db": qshard.sqnr_db(ffn[1](x).float(), ffn[0](x).float())}
    prompt = torch.randint(0, model.config.vocab_size, (2, 64), device=device, generator=generator)
    positions = torch.arange(64, device=device)
    model.setup_caches(2, 64, tp_world=world)
    reference.setup_caches(2, 64)
    expected, got = reference(prompt, positions).float(), model(prompt, positions).float()
    return {**out, "logits_sqnr_db": qshard.sqnr_db(expected, got)}


@torch.no_grad()
def tokens_per_second(
    model: Llama,
    batch: int,
    prompt_len: int,
    new: int,
    device,
    world: int = 1,
    profile: bool = False,
    cuda_graphs: bool = True,
) -> float:
    model.setup_caches(batch, prompt_len + new + 8, tp_world=world)
    generator = torch.Generator(device).manual_seed(1)  # the same prompt on every rank
    prompt = torch.randint(
        0, model.config.vocab_size, (batch, prompt_len), device=device, generator=generator
    )
    mode = "reduce-overhead" if device.type == "cuda" and cuda_graphs else None
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
    rate = batch * new / (time.perf_counter() - start)
    if profile and device.type == "cuda":
        step_profile(model, step, token, positions[-1], batch / rate)
    return rate


# Kernel names by where a decode step's GPU time goes (bench/README.md's TP tables).
_KERNEL_KINDS = (
    (
        "collectives",
        ("nccl", "all_reduce", "allreduce", "all_to_all", "alltoall", "one_shot", "symm"),
    ),
    ("attention", ("flash", "attention", "sdpa", "fmha", "cudnn")),
    (
        "linears",
        (
            "gemv",
            "gemm",
            "sm90",
            "cutlass",
            "nvjet",
            "qshard",
            "w4a16",
            "fp8",
            "matmul",
            "mm_",
            "_mm",
            "wgmma",
            "splitk",
            "int4",
            "dot",
        ),
    ),
)


def step_profile(model, step, token, position, step_s: float, steps: int = 16) -> None:
    """Print (rank 0) where the GPU time of a compiled decode step goes: the kernels of
    `steps` steps under the profiler, by kind, per step, against the step's measured time (the
    rest of that time the GPU waits on the host, or idles between kernels)."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            token = step(model, token, position).clone()
        torch.cuda.synchronize()
    kinds, top = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        kind = next((k for k, keys in _KERNEL_KINDS if any(key in name for key in keys)), "other")
        kinds[kind] += event.device_time_total / steps
        top[event.name[:60]] += event.device_time_total / steps
    skips = torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0)
    if not dist.is_initialized() or dist.get_rank() == 0:
        busy = sum(kinds.values())
        parts = ", ".join(f"{k} {v:.0f}" for k, v in kinds.most_common())
        print(
            f"INFO step {step_s * 1e6:.0f} us, GPU kernels {busy:.0f} us ({parts}); "
            f"cudagraph skips {skips}",
            flush=True,
        )
        for name, us in top.most_common(8):
            print(f"INFO   {us:8.1f} us  {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--layouts",
        default="bf16,int4-g128,fp8-block,fp8-row,nvfp4,mxfp4,"
        "torchao-int4,torchao-fp8-row,torchao-fp8-block",
    )
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument(
        "--config",
        default="llama-3.1-8b",
        choices=[
            "llama-3.1-8b",
            "llama-3.1-70b",
            "tiny",
            "qwen3-30b-a3b",
            "deepseek-v3",
            "tiny-moe",
        ],
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="the model's first N layers (default: all of the config's)",
    )
    parser.add_argument(
        "--experts",
        default="ep",
        choices=list(EXPERT_STYLES),
        help="a MoE config's experts under TP: ExpertParallel (all-reduce or "
        "all-to-all dispatch) or ExpertTensorParallel",
    )
    parser.add_argument(
        "--tp",
        default="1",
        help="TP sizes, e.g. 1,2: processes (GPUs) through torchrun; a table column each",
    )
    parser.add_argument(
        "--no-freezing",
        dest="freezing",
        action="store_false",
        help="compile the step without inductor freezing (docs/decode.md)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=300,
        help="seconds per measurement: then every rank prints its stacks and exits",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="under TP: the SQNR of the sharded model's logits against one "
        "GPU's (experts re-blocked as the shards are), in dB",
    )
    parser.add_argument(
        "--results",
        default=None,
        help="append each measurement to this file (JSON lines; bench/plot_tp.py)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="print where each decode step's GPU time goes (kernels by kind)",
    )
    parser.add_argument(
        "--attention",
        default="kernel",
        choices=["kernel", "sdpa"],
        help="a decode step's attention: qshard's decode attention op (split-K, the filled "
        "positions only) or F.scaled_dot_product_attention with the causal mask row",
    )
    # "plain": dist.destroy_process_group() alone, to show the hang qshard.tp.shutdown avoids
    parser.add_argument(
        "--teardown", default="shutdown", choices=["shutdown", "plain"], help=argparse.SUPPRESS
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = [int(t) for t in str(args.tp).split(",")]
    if device == "cuda":
        import triton

        print(
            f"GPU: {torch.cuda.get_device_name()} x {torch.cuda.device_count()}; torch "
            f"{torch.__version__}, triton {triton.__version__}, torchao "
            f"{_version('torchao')}"
        )
    layers = f" ({args.layers} layers)" if args.layers else ""
    print(
        f"{args.config}{layers}, prompt {args.prompt}, {args.new} new tokens, greedy, compiled "
        f"decode step (inductor freezing {'on' if args.freezing else 'off'}), TP "
        f"{args.tp}, decode attention: {args.attention}; each (layout, batch) in a fresh "
        f"process\n"
    )
    batches = args.batches.split(",")
    columns = [(tp, b) for tp in sizes for b in batches]
    print("| layout | " + " | ".join(f"TP {tp} batch {b}" for tp, b in columns) + " |")
    print("|---|" + "---|" * len(columns))
    base, rates = {}, {}
    for layout in args.layouts.split(","):
        cells = []
        for tp, batch in columns:
            result = run_child(args, layout, batch, tp)
            if isinstance(result, str):
                cells.append(result)
                continue
            rate, memory = result["rate"], result["memory_gib"]
            rates[layout, tp, batch] = rate
            base.setdefault((tp, batch), rate if layout == "bf16" else None)
            ratio = f", {rate / base[tp, batch]:.2f}x" if base.get((tp, batch)) else ""
            note = f"; then {result['note']}" if "note" in result else ""
            sqnr = ""
            if "ffn_sqnr_db" in result:
                sqnr = f", {result['ffn_sqnr_db']:.1f} / {result['logits_sqnr_db']:.1f} dB"
            cells.append(f"{rate:.0f} tok/s{ratio} ({memory:.1f} GiB{sqnr}{note})")
            if args.results:
                with open(args.results, "a") as out:
                    out.write(
                        json.dumps(
                            {
                                "config": args.config,
                                "layers": args.layers,
                                "experts": args.experts,
                                "layout": layout,
                                "tp": tp,
                                "batch": int(batch),
                                **result,
                            }
                        )
                        + "\n"
                    )
        print(f"| {layout} | " + " | ".join(cells) + " |", flush=True)
    print(
        "\n(x: over bf16 at the same TP and batch; GiB: the peak GPU memory of rank 0 while "
        "decoding, weights and caches included; dB, with --check: the SQNR against one GPU's "
        "model of the first feed-forward / of the logits)"
    )
    if PROFILES:
        print("\nWhere a step's GPU time goes (us per step; --profile):\n")
        print("\n".join(PROFILES))
    if len(sizes) > 1:
        print("\nScaling over TP " + str(sizes[0]) + " (tokens/s ratio):\n")
        print("| layout | batch | " + " | ".join(f"TP {tp}" for tp in sizes[1:]) + " |")
        print("|---|---|" + "---|" * (len(sizes) - 1))
        for layout in args.layouts.split(","):
            for batch in batches:
                first = rates.get((layout, sizes[0], batch))
                cells = [
                    f"{rates[layout, tp, batch] / first:.2f}x"
                    if first and (layout, tp, batch) in rates
                    else "-"
                    for tp in sizes[1:]
                ]
                print(f"| {layout} | {batch} | " + " | ".join(cells) + " |")


def run_child(args, layout: str, batch: str, tp: int) -> dict | str:
    """One (layout, batch) measured in a fresh process (torchrun for TP): compiled graphs and
    CUDA graph pools of an earlier model slowed later ones in the same process (measured)."""
    if layout.startswith("torchao-") and tp > 1:
        return "n/a (torchao: TP 1 only)"
    script = [
        __file__,
        "--child",
        "--layouts",
        layout,
        "--batches",
        batch,
        "--prompt",
        str(args.prompt),
        "--new",
        str(args.new),
        "--config",
        args.config,
    ]
    script += ["--layers", str(args.layers)] if args.layers else []
    script += [] if args.freezing else ["--no-freezing"]
    script += ["--timeout", str(args.timeout), "--teardown", args.teardown]
    script += ["--experts", args.experts, "--attention", args.attention]
    script += ["--profile"] if args.profile else []
    script += ["--check"] if args.check else []
    launcher = [sys.executable]
    if tp > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}"]
    # Its own session: on the deadline the launcher and every rank it started are killed
    # together (a rank left behind would hold the pipes open and hang this process too).
    process = subprocess.Popen(
        launcher + script,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=args.timeout + CHILD_GRACE_S)
        failure = None if process.returncode == 0 else f"exit status {process.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        failure = f"no result in {args.timeout + CHILD_GRACE_S} s"
    result = next(
        (
            json.loads(line.removeprefix("RESULT "))
            for line in stdout.splitlines()
            if line.startswith("RESULT ")
        ),
        None,
    )
    for line in stdout.splitlines():
        if line.startswith("INFO "):  # --profile's breakdown
            PROFILES.append(f"({layout}, TP {tp}, batch {batch}) {line.removeprefix('INFO ')}")
    if result is not None and failure is None:
        return result
    # The child's stderr (each rank's stacks, if its deadline fired) says where it stopped.
    print(
        f"--- {layout} batch {batch}: {failure or 'no result'}; the child's stderr ends:\n"
        f"{stderr[-6000:]}\n---",
        file=sys.stderr,
        flush=True,
    )
    if result is not None:  # measured, then failed to exit
        return {**result, "note": failure}
    errors = [line for line in stderr.splitlines() if "Error" in line] or [failure or "no result"]
    return f"fails: {errors[-1].strip()[:80]}"


PROFILES: list[str] = []  # the children's --profile lines, printed after the table
CHILD_GRACE_S = 30  # past the child's own deadline: its ranks' stacks printed, then killed


def model_config(name: str, layers: int | None) -> LlamaConfig:
    if name == "qwen3-30b-a3b":
        return LlamaConfig.qwen3_30b_a3b(layers or 48)
    if name == "deepseek-v3":
        return LlamaConfig.deepseek_v3_moe(layers or 61)
    if name == "llama-3.1-70b":
        return LlamaConfig.llama_3_1_70b(layers or 80)
    if name == "tiny-moe":
        return LlamaConfig(
            vocab_size=512,
            dim=256,
            n_layers=layers or 2,
            n_heads=8,
            n_kv_heads=4,
            hidden=256,
            n_experts=8,
            top_k=2,
            expert_hidden=128,
        )
    config = LlamaConfig.llama_3_1_8b() if name == "llama-3.1-8b" else LlamaConfig.tiny()
    return dataclasses.replace(config, n_layers=layers) if layers else config


def child(args) -> None:
    # Each rank prints its Python stacks and exits at the deadline, before the parent's.
    with qshard.tp.deadline(args.timeout):
        measure(args)


def measure(args) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    mesh, world, rank = None, 1, 0
    if "RANK" in os.environ:  # under torchrun: tensor parallelism over its processes
        from torch.distributed.device_mesh import init_device_mesh

        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(device)
        qshard.tp.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout_s=120)
        world, rank = dist.get_world_size(), dist.get_rank()
        mesh = init_device_mesh(device.type, (world,))
    # Frozen weights are constants of the compiled graph. Without freezing, every call of the
    # compiled step unwraps each quantized weight (a tensor subclass) in Python: that made the
    # int4 decode CPU-bound (docs/decode.md). Under TP the sharded linears are first made local
    # (`qshard.tp.to_local`): a graph over DTensor weights cannot be frozen (their DeviceMesh).
    torch._inductor.config.freezing = args.freezing
    config = model_config(args.config, args.layers)
    config = dataclasses.replace(config, decode_kernel=args.attention == "kernel")
    model = build(config, args.layouts, device)
    checked = {}
    if mesh is not None:
        reference = copy.deepcopy(model) if args.check else None
        parallelize(model, mesh, args.experts)
        model = qshard.tp.to_local(model)
        if reference is not None:
            if config.n_experts and args.experts in EXPERT_CUT:
                realigned_experts(reference, EXPERT_CUT[args.experts](world))
            checked = check(model, reference, world, device)
            del reference
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()  # the float model quantize_ started from is gone
    # The all-to-all dispatch reads each step's split sizes to the host (unbacked sizes in the
    # graph): no CUDA graph can hold it, so its step runs compiled without one.
    all_to_all = mesh is not None and config.n_experts and args.experts == "ep-all-to-all"
    torch._dynamo.config.capture_scalar_outputs = bool(all_to_all)
    rate = tokens_per_second(
        model,
        int(args.batches),
        args.prompt,
        args.new,
        device,
        world,
        args.profile,
        cuda_graphs=not all_to_all,
    )
    memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    if rank == 0:
        result = {"rate": rate, "memory_gib": memory}
        result.update(checked)
        print("RESULT " + json.dumps(result), flush=True)
    if world > 1:
        qshard.tp.shutdown() if args.teardown == "shutdown" else dist.destroy_process_group()


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except Exception:  # not installed, or broken: reported as such
        return None


if __name__ == "__main__":
    main()
