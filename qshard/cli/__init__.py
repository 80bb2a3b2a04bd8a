"""The `qshard` command's work: `run` runs a parsed command line. The arguments are parsed in
the top-level module `qshard_cli` (the entry point; it imports no torch, so `qshard --help` is
quick), which calls `run` and prints its error line. The commands: `quantize` and `inspect`
(quantize.py), `bench` (bench.py), `demo` (demo.py, demo_tp.py); the `--config` names are
configs.json's (`config_named`).

An error prints one line on stderr, `qshard: error: <what, which file, what to do>`, and exits
with status 2 for a usage error (an unknown option, a bad argument value), 1 for any other (a
missing, unreadable or damaged file, a checkpoint qshard refuses, a failed write, `bench
--device cuda` without a GPU; an unexpected exception is reported as an internal error), 130
when interrupted. `qshard --debug <command>` raises instead, with the traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import sys

import torch

from ..errors import QShardError
from .configs import CONFIG_NAMES, config_named

__all__ = ["CONFIG_NAMES", "config_named", "run"]

# What to do about an OSError, by errno.
_OS_ERROR_HINTS = {
    errno.ENOENT: "check the path",
    errno.EACCES: "check its permissions, or choose another path",
    errno.EPERM: "check its permissions, or choose another path",
    errno.EROFS: "choose a path on a writable file system",
    errno.ENOSPC: "free some space, or choose an --out on another disk",
    errno.EDQUOT: "free some space, or choose an --out on another disk",
    errno.EISDIR: "it is a directory where a file was expected; check the path",
    errno.ENOTDIR: "a part of it is a file where a directory was expected; check the path",
}


def run(args: argparse.Namespace) -> tuple[int, str | None]:
    """Run the parsed command line (qshard_cli.main parsed it): (exit status, the error line to
    print, or None)."""
    try:
        _run(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("qshard: interrupted", file=sys.stderr)
        return 130, None
    except Exception as e:
        if args.debug:
            raise
        return 1, _describe(e)
    return 0, None


def _describe(e: Exception) -> str:
    """The error line of an exception: a user error's own message; otherwise an internal
    error, named so that it is not mistaken for a problem with the input."""
    if isinstance(e, QShardError):
        return str(e).removeprefix("qshard ")  # "quantize: ...", not "qshard: error: qshard ..."
    if isinstance(e, OSError):
        what = e.strerror or str(e)
        files = [str(f) for f in (e.filename, e.filename2) if f is not None]
        hint = _OS_ERROR_HINTS.get(e.errno)
        return " -> ".join(files) + (": " if files else "") + what + (f"; {hint}" if hint else "")
    if isinstance(e, ModuleNotFoundError) and e.name and not e.name.startswith("qshard"):
        return f"this needs the module {e.name!r}, which is not installed; pip install it"
    return (
        f"internal error, {type(e).__name__}: {str(e).strip()[:200]} (a bug in qshard, not "
        f"in the input; rerun with --debug for the traceback)"
    )


def _run(args: argparse.Namespace) -> None:
    if args.command == "demo":
        from . import demo as demos  # each command's modules on use: `qshard --help` stays fast

        if args.tp > 1:
            from .demo_tp import run_tp_demo  # on use (as above)

            run_tp_demo(args.tp, args.model)
        elif args.model == "minilm" or (args.model == "auto" and demos.minilm_available()):
            demos.run_minilm_demo()
        else:
            demos.run_demo(seed=args.seed)
    elif args.command == "quantize":
        from .quantize import quantize_directory  # on use (as above)

        done = quantize_directory(args.model_dir, args.out, args.config, args.exclude or ())
        print(
            f"{len(done['quantized'])} weights quantized ({args.config}, "
            f"{done['selection']}), {len(done['kept'])} tensors kept; wrote "
            f"{args.out}"
        )
    elif args.command == "bench":
        if args.device == "cuda" and not _has_cuda():
            raise QShardError(
                "qshard bench: --device cuda, but torch sees no CUDA GPU here "
                "(torch.cuda.is_available() is False); pass --device cpu, or run "
                "on a machine with a GPU"
            )
        if args.plot:
            _check_plot(args.plot)
        from .bench import bench_linears, model_shapes, plot, print_table  # on use

        shapes = model_shapes(args.source)
        where = args.device or ("cuda" if _has_cuda() else "cpu")
        results = bench_linears(shapes, args.configs, args.ms, where)
        print(f"{args.source}: {sum(shapes.values())} linears, {len(shapes)} shapes, on {where}")
        print_table(results, args.ms)
        if args.plot:
            plot(results, args.ms, args.plot, f"{args.source} linears")
            print(f"wrote {args.plot}")
    elif args.command == "inspect":
        from .quantize import inspect_checkpoint  # on use (as above)

        inspect_checkpoint(args.path)


def _check_plot(path: str) -> None:
    """`bench --plot` can be written, checked before the benchmark runs."""
    if importlib.util.find_spec("matplotlib") is None:
        raise QShardError("qshard bench --plot needs matplotlib (pip install matplotlib)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise QShardError(
            f"qshard bench: --plot {path}: {parent} is not a directory; create it "
            f"or choose another path"
        )
    if os.path.isdir(path) or not os.access(parent, os.W_OK | os.X_OK):
        raise QShardError(
            f"qshard bench: cannot write --plot {path}; choose a file path in a "
            f"directory you can write to"
        )


def _has_cuda() -> bool:
    return torch.cuda.is_available()
