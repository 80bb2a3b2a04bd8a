"""Tensor-parallel inference on a quantized model: quantize, then shard, then compile.

    torchrun --standalone --nproc-per-node 2 examples/tp_inference.py

Runs on CPUs (gloo) and on GPUs (NCCL, one GPU per process).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import qshard
import qshard.tp

use_gpus = torch.cuda.is_available()
dist.init_process_group("nccl" if use_gpus else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device(f"cuda:{rank}") if use_gpus else torch.device("cpu")
if use_gpus:
    torch.cuda.set_device(device)
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
dist.barrier()  # gloo may abort a process that tears down while another is mid-collective
dist.destroy_process_group()
