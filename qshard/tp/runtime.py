"""Running a distributed qshard program so that it never hangs silently and always exits.

- `deadline(seconds)`: past it, this process prints every thread's Python stack to stderr and
  exits (`faulthandler.dump_traceback_later`); `SIGUSR1` prints the stacks at any time, so a
  supervisor (the test harness, `bench/bench_decode.py`) asks every rank where it is before it
  kills them. A rank stuck in a collective says which one.
- `init_process_group(...)`: torch's, with a collective timeout (a rank waiting for a peer
  that never comes raises after `timeout_s` instead of waiting forever) and NCCL's asynchronous
  error handling on (the watchdog aborts the communicator and the process on such a timeout).
- `shutdown()`: the tear-down that returns on NCCL with CUDA graphs and compiled collectives
  (docs/distributed.md): every rank's queued work finished and graphs released first, then the
  group destroyed.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import signal
import sys

import torch
import torch.distributed as dist

from ..errors import ConfigError

__all__ = ["deadline", "init_process_group", "shutdown"]

# The watchdog's error handling: 1 = tear down the communicator and the process on a timed-out
# or failed collective (torch's NCCL process group, TORCH_NCCL_ASYNC_ERROR_HANDLING).
_NCCL_ASYNC_ERROR_HANDLING = "1"


class deadline:  # lower case: called like a function, `qshard.tp.deadline(300)`
    """Arm a deadline of `seconds`: a process still running then prints all its threads' Python
    stacks to stderr and exits with status 1; SIGUSR1 prints them at any time without exiting
    (where the platform has it). Called alone it holds for the rest of the process; as a
    context manager (`with qshard.tp.deadline(300):`) leaving the block cancels it. A process
    has one deadline (faulthandler's): a new one replaces the one before."""

    def __init__(self, seconds: float):
        if not seconds > 0:
            raise ConfigError(f"qshard.tp.deadline({seconds!r}): pass a positive number of seconds")
        try:
            sys.stderr.fileno()
            stream = sys.stderr
        except (AttributeError, OSError, ValueError):  # a notebook's stderr: no descriptor
            stream = sys.__stderr__
        faulthandler.enable(file=stream, all_threads=True)
        self._usr1 = getattr(signal, "SIGUSR1", None)
        if self._usr1 is not None:
            faulthandler.register(self._usr1, file=stream, all_threads=True, chain=False)
        faulthandler.dump_traceback_later(seconds, exit=True, file=stream)

    def cancel(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self._usr1 is not None:
            faulthandler.unregister(self._usr1)

    def __enter__(self) -> deadline:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def init_process_group(backend: str | None = None, *, timeout_s: float = 300, **kwargs) -> None:
    """`torch.distributed.init_process_group` with a collective timeout of `timeout_s` seconds
    and NCCL's asynchronous error handling on (unless the environment sets its own)."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", _NCCL_ASYNC_ERROR_HANDLING)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, timeout=timeout, **kwargs)


def shutdown() -> None:
    """Destroy the default process group so that the process can exit, on gloo and on NCCL.

    Every rank first finishes its queued GPU work and meets the others at a barrier (no rank
    tears down while a peer still waits in a collective), then drops the compiled graphs and
    their CUDA graph pools, which hold work enqueued on the communicator."""
    if not dist.is_initialized():
        return
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier()
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.destroy_process_group()
