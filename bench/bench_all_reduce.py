"""The all-reduce a tensor-parallel decode step pays per row-parallel linear, by method and size.

    torchrun --nproc-per-node 2 bench/bench_all_reduce.py [--sizes 4096,131072,...]

bf16 vectors of `size` elements (4096: one token of Llama-3.1-8B's hidden size; 32 x 4096: a
batch of 32), summed over the ranks. Each method is captured in a CUDA graph of 64 calls and
the graph replayed (what a compiled decode step with mode="reduce-overhead" runs); median of
the replays per call, in microseconds, printed by rank 0:

- nccl: `torch.distributed.all_reduce` (NCCL; NVLink multicast off, NCCL_NVLS_ENABLE=0);
- symm-mem one-shot: qshard's `torch.ops.qshard.all_reduce` (the copy into a symmetric-memory
  buffer and torch's `symm_mem.one_shot_all_reduce`, no multicast), the op `qshard.tp.to_local`
  uses for small partial sums.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import qshard.tp
from qshard.tp import collectives

CALLS = 64  # per graph: launch overhead amortized as in a decode step's graph


def time_graph(fn, x: torch.Tensor, replays: int = 20) -> float:
    """Median microseconds per call of `fn(x)` captured CALLS times in one CUDA graph."""
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn(x)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="4096,32768,131072,524288,2097152")
    args = parser.parse_args()
    with qshard.tp.deadline(300):
        qshard.tp.init_process_group("nccl", timeout_s=120)
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.cuda.set_device(rank)
        group = dist.group.WORLD.group_name
        if rank == 0:
            print(f"{torch.cuda.get_device_name()} x {world}, torch {torch.__version__}")
            print("| elements (bf16) | nccl us | symm-mem one-shot us | check |")
            print("|---|---|---|---|")
        for size in (int(s) for s in args.sizes.split(",")):
            x = torch.randn(size, device="cuda", dtype=torch.bfloat16, generator=None)
            want = x.float().clone()
            dist.all_reduce(want)
            got = collectives.all_reduce_symm_mem(x, group).float()
            ok = torch.allclose(got, want, rtol=1e-2, atol=1e-2)

            def nccl(t):
                dist.all_reduce(t.clone())

            def symm(t):
                collectives.all_reduce_symm_mem(t, group)

            cells = [time_graph(nccl, x), time_graph(symm, x)]
            if rank == 0:
                print(f"| {size} | {cells[0]:.1f} | {cells[1]:.1f} | {'ok' if ok else 'WRONG'} |",
                      flush=True)  # fmt: skip
        qshard.tp.shutdown()


if __name__ == "__main__":
    main()
