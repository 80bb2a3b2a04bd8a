"""The NCCL suite's workers that also run on the CPU, on gloo at a world size the CI does not
run (it runs 2 and 4): the dense Llama-style block at the dims the NCCL block worker takes at that
world (`test_tensor_parallel_cuda.block_dims`), and the experts worker of
`test_experts_parallel_cuda.py` (every layout; EP with both dispatches, ETP, and EP x TP on a 2-D
mesh of world / 2 x 2; a per-rank EP load). What an 8-GPU NCCL run checks, checked on 8 CPU
processes first.

    python bench/gloo_world.py [--world 8]

Each rank prints its SQNR lines; a failing rank fails the run (exit 1). Every rank has a
deadline that prints its stacks instead of hanging (tests/tp/test_tensor_parallel.py, `spawn`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

TESTS = pathlib.Path(__file__).resolve().parent.parent / "tests"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--deadline", type=float, default=1500, help="seconds per worker")
    args = parser.parse_args()
    sys.path[:0] = [str(TESTS), str(TESTS / "tp")]
    # The test modules are imported here, not at the top: they live in tests/, put on the path
    # just above (this script runs from a checkout, not from an installed package).
    import test_experts_parallel_cuda as experts
    import test_tensor_parallel as dense
    import test_tensor_parallel_cuda as dense_nccl

    world, failed = args.world, 0
    checkpoint = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    workers = {
        "dense block": (dense._block_worker, dense_nccl.block_dims(world)),
        "experts, every layout and style": (experts._worker, checkpoint, list(experts.CONFIGS)),
    }
    for name, (worker, *worker_args) in workers.items():
        start = time.monotonic()
        try:
            dense.spawn(worker, world, *worker_args, deadline_s=args.deadline)
            print(f"PASS {name} at world {world} ({time.monotonic() - start:.0f} s)", flush=True)
        except Exception as error:  # a rank's failure: reported, and the run fails at the end
            failed += 1
            print(f"FAIL {name} at world {world}: {type(error).__name__}: {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
