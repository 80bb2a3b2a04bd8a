"""qshard.tp.deadline / init_process_group / shutdown: a stalled rank says where it waits and
exits; a finished program exits (gloo, torchrun on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# A rank that never joins its peer's collective: rank 0 waits in a barrier, rank 1 sleeps.
_STALLED = textwrap.dedent(
    """
    import time
    import torch.distributed as dist
    import qshard.tp

    qshard.tp.deadline(6)
    qshard.tp.init_process_group("gloo", timeout_s=120)
    if dist.get_rank() == 0:
        dist.barrier()  # the peer never comes
    else:
        time.sleep(60)
    """
)
_FINISHED = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    import qshard.tp

    qshard.tp.deadline(60)
    qshard.tp.init_process_group("gloo", timeout_s=60)
    t = torch.ones(3)
    dist.all_reduce(t)
    step = torch.compile(lambda x: x * 2)
    print("RESULT", step(t).tolist(), flush=True)
    qshard.tp.shutdown()
    assert not dist.is_initialized()
    """
)


def _torchrun(tmp_path, script: str, timeout: float) -> subprocess.CompletedProcess:
    path = tmp_path / "program.py"
    path.write_text(script)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(path),
    ]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def test_a_stalled_rank_prints_where_it_waits_and_exits(tmp_path):
    done = _torchrun(tmp_path, _STALLED, timeout=90)
    assert done.returncode != 0
    assert "Timeout (0:00:06)!" in done.stderr, done.stderr[-3000:]
    assert "in barrier" in done.stderr and "program.py" in done.stderr, done.stderr[-3000:]


def test_a_finished_program_exits(tmp_path):
    done = _torchrun(tmp_path, _FINISHED, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("RESULT [4.0, 4.0, 4.0]") == 2


def test_the_deadline_as_a_block_is_cancelled_on_leaving_it():
    script = "import time, qshard.tp\nwith qshard.tp.deadline(1):\n    pass\ntime.sleep(2)\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "Timeout" not in done.stderr


def test_the_deadline_alone_holds_for_the_process():
    script = "import time, qshard.tp\nqshard.tp.deadline(1)\ntime.sleep(30)\n"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1 and "Timeout (0:00:01)!" in done.stderr
    assert "<string>" in done.stderr  # the stack names where it was
