"""The all-reduce of a row-parallel linear's partial sums, by the method measured fastest.

A tensor-parallel decode step all-reduces a few KB per row-parallel linear, two per layer: its
cost is the collective's latency, not bandwidth. On 2 H200s over NVLink (bench/README.md,
bench_all_reduce.py) NCCL's ring takes tens of microseconds per call inside a CUDA graph, while
torch's symmetric-memory one-shot all-reduce (each rank reads its peers' buffers over NVLink
and adds; no NVLink multicast, which these machines keep off) takes a few. So `all_reduce`
sends CUDA tensors of up to `ONE_SHOT_MAX_BYTES` through the op `qshard::all_reduce`: the
partial sums copied into a symmetric-memory buffer of the group (allocated and exchanged once,
outside any CUDA graph capture, grown by doubling) and reduced by
`torch.ops.symm_mem.one_shot_all_reduce`; larger ones, CPU tensors (gloo) and groups whose
buffer cannot be made go through NCCL / gloo's functional all-reduce.

The choice depends only on the tensor's size, dtype and device, which every rank shares, so the
ranks never take different paths. `set_method("nccl")` turns the one-shot path off.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

__all__ = ["ONE_SHOT_MAX_BYTES", "all_reduce", "all_reduce_symm_mem", "set_method"]

# Above this a one-shot all-reduce (every rank reads all of every peer's buffer) loses to
# NCCL's bandwidth-optimal algorithms (bench_all_reduce.py on 2 H200s, bench/README.md).
ONE_SHOT_MAX_BYTES = 512 * 1024
_INITIAL_BUFFER_BYTES = 4 * 1024 * 1024

_METHODS = ("auto", "nccl")
_method = "auto"
# (group name, device index) -> the rank's symmetric-memory buffer (uint8), exchanged.
_buffers: dict[tuple[str, int], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # kept alive: a captured CUDA graph may still read them


def set_method(method: str) -> None:
    """"auto" (the default: one-shot symmetric memory for small CUDA tensors, NCCL otherwise)
    or "nccl" (always the process group's own all-reduce). Set it before compiling: a compiled
    graph keeps the method it was traced with."""
    global _method
    if method not in _METHODS:
        from ..errors import ConfigError

        raise ConfigError(f"qshard.tp.collectives.set_method({method!r}): pass one of {_METHODS}")
    _method = method


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    """The sum of `x` over the ranks of the process group named `group` (a new tensor)."""
    if _method == "auto" and x.is_cuda and x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
        return torch.ops.qshard.all_reduce(x, group)
    return funcol.wait_tensor(funcol.all_reduce(x, "sum", group))


def all_reduce_symm_mem(x: torch.Tensor, group: str) -> torch.Tensor:
    """`x` summed over the group by torch's symmetric-memory one-shot all-reduce (CUDA)."""
    buffer = _buffer(group, x.device, x.numel() * x.element_size())
    staged = buffer[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
    staged.copy_(x)
    return torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group)


def _buffer(group: str, device: torch.device, nbytes: int) -> torch.Tensor:
    import torch.distributed._symmetric_memory as symm_mem

    key = (group, device.index if device.index is not None else torch.cuda.current_device())
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < nbytes:
        if torch.cuda.is_current_stream_capturing():
            # The exchange is a host-side collective: it cannot run inside a graph capture.
            from ..errors import QShardError

            raise QShardError(
                f"qshard.tp all-reduce: the symmetric-memory buffer of group {group!r} needs "
                f"{nbytes} bytes, first asked for inside a CUDA graph capture; run the step once "
                f"before capturing it (torch.compile's mode='reduce-overhead' warms up first)"
            )
        size = max(_INITIAL_BUFFER_BYTES, 1 << (nbytes - 1).bit_length())
        if buffer is not None:
            _outgrown.append(buffer)
        buffer = symm_mem.empty(size, dtype=torch.uint8, device=torch.device("cuda", key[1]))
        symm_mem.rendezvous(buffer, group)
        _buffers[key] = buffer
    return buffer


@torch.library.custom_op("qshard::all_reduce", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str) -> torch.Tensor:
    return all_reduce_symm_mem(x, group)


@_all_reduce_op.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)
