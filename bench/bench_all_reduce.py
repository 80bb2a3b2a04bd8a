"""The all-reduce a tensor-parallel decode step pays per row-parallel linear, by method and size.

    torchrun --nproc-per-node 2 bench/bench_all_reduce.py [--sizes 4096,131072,...]

bf16 vectors of `size` elements (4096: one token of Llama-3.1-8B's hidden size; 32 x 4096: a
batch of 32), summed over the ranks. Each method is captured in a CUDA graph of 64 calls and
the graph replayed (what a compiled decode step with mode="reduce-overhead" runs); median of
the replays per call, in microseconds, printed by rank 0:

- nccl: `torch.distributed.all_reduce` (NCCL; NVLink multicast off, NCCL_NVLS_ENABLE=0);
- symm-mem one-shot: the sums copied into a symmetric-memory buffer (allocated and exchanged
  once) and torch's `symm_mem.one_shot_all_reduce` (each rank reads its peer's buffer over
  NVLink; no multicast, which these machines keep off).

The check column: the symmetric-memory sums against NCCL's over 64 calls of distinct inputs in
one graph (a buffer reused before a peer finished reading it would show here).
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

import qshard.tp

CALLS = 64  # per graph: launch overhead amortized as in a decode step's graph


_BUFFERS: dict[str, torch.Tensor] = {}


def all_reduce_symm_mem(x: torch.Tensor, group: str) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    nbytes = x.numel() * x.element_size()
    if group not in _BUFFERS:  # one buffer for every size measured (the largest is 4 MiB)
        _BUFFERS[group] = symm_mem.empty(16 << 20, dtype=torch.uint8, device=x.device)
        symm_mem.rendezvous(_BUFFERS[group], group)
    staged = _BUFFERS[group][:nbytes].view(x.dtype).view(x.shape)
    staged.copy_(x)
    return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group)


def check_in_graph(x: torch.Tensor, group: str) -> bool:
    """The symmetric-memory sums of CALLS distinct inputs, all in one graph, equal NCCL's."""
    inputs = [x * (i + 1) for i in range(CALLS)]
    all_reduce_symm_mem(x, group)  # the buffer exchanged before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [all_reduce_symm_mem(t, group) for t in inputs]
    graph.replay()
    torch.cuda.synchronize()
    ok = True
    for t, out in zip(inputs, outs, strict=True):
        want = t.clone()
        dist.all_reduce(want)
        ok &= torch.equal(out, want) or torch.allclose(out.float(), want.float(), rtol=1e-2)
    return ok


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
            x = torch.randn(size, device="cuda", dtype=torch.bfloat16)
            ok = check_in_graph(x, group)

            def nccl(t):
                dist.all_reduce(t.clone())

            def symm(t):
                all_reduce_symm_mem(t, group)

            cells = [time_graph(nccl, x), time_graph(symm, x)]
            if rank == 0:
                print(
                    f"| {size} | {cells[0]:.1f} | {cells[1]:.1f} | {'ok' if ok else 'WRONG'} |",
                    flush=True,
                )
        qshard.tp.shutdown()


if __name__ == "__main__":
    main()
