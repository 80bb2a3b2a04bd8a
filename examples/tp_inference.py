"""Tensor-parallel inference on a quantized model: quantize, then shard, then compile.

    torchrun --standalone --nproc-per-node 2 examples/tp_inference.py

Runs on CPUs (gloo) and on GPUs (NCCL, one GPU per process).
"""

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import qshard
import qshard.tp

use_gpus = torch.cuda.is_available()
# A rank that stalls (a collective whose peer never comes) prints its Python stacks and exits
# after 300 s instead of hanging; a collective times out after 120 s.
qshard.tp.deadline(300)
local_rank = int(os.environ.get("LOCAL_RANK", 0))  # torchrun's: this process's GPU
device = torch.device(f"cuda:{local_rank}") if use_gpus else torch.device("cpu")
if use_gpus:
    torch.cuda.set_device(device)
qshard.tp.init_process_group("nccl" if use_gpus else "gloo", timeout_s=120)
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh(device.type, (world,))

torch.manual_seed(0)  # the same float weights and input on every rank
mlp = torch.nn.Sequential(
    torch.nn.Linear(1024, 4096), torch.nn.SiLU(), torch.nn.Linear(4096, 1024)
).to(device)
x = torch.randn(8, 1024, device=device)
with torch.no_grad():
    expected = mlp(x)  # the float model on one device

    qshard.quantize_(mlp, qshard.Fp8BlockwiseConfig())  # 1. quantize (every rank, full weights)
    qshard.tp.parallelize(mlp, mesh, {"0": "colwise", "2": "rowwise"})  # 2. keep this rank's slice
    compiled = torch.compile(mlp, fullgraph=True)  # 3. compile
    out = compiled(x)

local = mlp[0].weight.to_local()
if rank == 0:
    print(
        f"TP {world} on {device.type}: each rank holds a {type(local).__name__} "
        f"{list(local.shape)} of [4096, 1024]; SQNR vs float {qshard.sqnr_db(expected, out):.1f} dB"
    )
qshard.tp.shutdown()  # every rank done (a barrier), compiled graphs released, group destroyed
