"""Tensor parallelism on 2 GPUs with NCCL (marked; skipped without 2 GPUs)."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYOUT_CASES
from test_tensor_parallel import (
    BLOCK_PLAN,
    ROW_PARALLEL_TOLERANCE,
    Block,
    _realigned_like,
    _two_quantized_copies,
    spawn,
)

import qshard
import qshard.tp

pytestmark = pytest.mark.cuda


def _nccl_block_worker(rank, world, mesh):
    assert mesh.device_type == "cuda"
    for cls, config in LAYOUT_CASES:
        torch.manual_seed(7)
        reference, sharded = _two_quantized_copies(Block().cuda(), config)
        x = torch.randn(2, 9, 256, device="cuda")
        with torch.no_grad():
            qshard.tp.parallelize(sharded, mesh, BLOCK_PLAN)
            local = sharded.qkv.weight.to_local()
            assert isinstance(local, cls) and local.device.type == "cuda"
            _realigned_like(reference, sharded, world)
            torch.testing.assert_close(sharded(x), reference(x), **ROW_PARALLEL_TOLERANCE)
            compiled = torch.compile(sharded, fullgraph=True)
            assert qshard.sqnr_db(sharded(x), compiled(x)) > 60


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_llama_block_on_two_gpus_with_nccl():
    spawn(_nccl_block_worker, 2, backend="nccl")
