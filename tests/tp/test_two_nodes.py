"""EP across nodes, TP within them: a 2 x 2 job (two torchrun agents on this host, as two
nodes with a static rendezvous; gloo) runs tests/tp/two_nodes_program.py (docs/distributed.md)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

PROGRAM = os.path.join(os.path.dirname(__file__), "two_nodes_program.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node: int, port: int, env) -> subprocess.Popen:
    """One node's torchrun agent: 2 ranks, a static rendezvous at 127.0.0.1:port."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node}",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        PROGRAM,
    ]
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def test_expert_parallel_across_two_nodes_and_tensor_parallel_within():
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    agents = [_agent(node, port, env) for node in (0, 1)]
    outputs = []
    for agent in agents:
        try:
            out, err = agent.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in agents:
                other.kill()
            raise
        outputs.append(out)
        assert agent.returncode == 0, err[-4000:]
    lines = sorted(line for out in outputs for line in out.splitlines() if line.startswith("OK"))
    assert lines == [
        "OK rank 0 node 0: experts TP ranks [0, 1], EP ranks [0, 2]",
        "OK rank 1 node 0: experts TP ranks [0, 1], EP ranks [1, 3]",
        "OK rank 2 node 1: experts TP ranks [2, 3], EP ranks [0, 2]",
        "OK rank 3 node 1: experts TP ranks [2, 3], EP ranks [1, 3]",
    ], lines
