"""The NCCL suite's workers that also run on the CPU, on gloo at a world size the CI does not
run (it runs 2 and 4): the dense Llama-style block at the dims the NCCL block worker takes at that
world (`test_tensor_parallel_cuda.block_dims`), the experts worker of
`test_experts_parallel_cuda.py` (every layout; EP with both dispatches, ETP, and EP x TP on a 2-D
mesh of world / 2 x 2; a per-rank EP load), and every layout's model at those dims saved at TP n
and loaded at TP 1 (`test_checkpoint_tp.check_save_at_tp_n`; a sharded load at TP 8 runs in
CI on gloo, test_checkpoint_tp.py). What an 8-GPU NCCL run checks, checked on 8 CPU processes
first.

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
    import test_checkpoint_tp as checkpoints
    import test_experts_parallel_cuda as experts
    import test_tensor_parallel as dense
    import test_tensor_parallel_cuda as dense_nccl

    world, deadline, failed = args.world, args.deadline, 0
    dims = dense_nccl.block_dims(world)
    checks = {
        "dense block": lambda: dense.spawn(dense._block_worker, world, dims, deadline_s=deadline),
        "experts, every layout and style": lambda: dense.spawn(
            experts._worker, world, scratch() / "ckpt", list(experts.CONFIGS), deadline_s=deadline
        ),
        "checkpoint saved at TP n, loaded at TP 1": lambda: checkpoints.check_save_at_tp_n(
            scratch(), world, dims
        ),
    }
    for name, check in checks.items():
        start = time.monotonic()
        try:
            check()
            print(f"PASS {name} at world {world} ({time.monotonic() - start:.0f} s)", flush=True)
        except Exception as error:  # a rank's failure: reported, and the run fails at the end
            failed += 1
            print(f"FAIL {name} at world {world}: {type(error).__name__}: {error}", flush=True)
    return 1 if failed else 0


def scratch() -> pathlib.Path:
    return pathlib.Path(tempfile.mkdtemp(prefix="gloo_world_"))


if __name__ == "__main__":
    sys.exit(main())
