"""Save a quantized model once, load it at any tensor-parallel size.

    torchrun --standalone --nproc-per-node 2 examples/tp_checkpoint.py

Rank 0 quantizes and saves the full checkpoint (this could be done once, offline, on any
machine); then every rank builds the model on the meta device and reads only its own slices.
Runs on CPUs (gloo) and on GPUs (NCCL, one GPU per process).
"""

import os
import tempfile

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
path = os.path.join(tempfile.gettempdir(), "qshard-example-checkpoint")
plan = {"0": "colwise", "2": "rowwise"}


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.SiLU(), torch.nn.Linear(4096, 1024)
    )


if rank == 0:  # 1. once: quantize the float model and save the full checkpoint
    torch.manual_seed(0)
    model = mlp()
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    qshard.save(model, path)
dist.barrier()

with torch.device("meta"):  # 2. every rank: models with no memory behind them
    model, single = mlp(), mlp()
qshard.load(path, model, mesh=mesh, plan=plan)  # reads only this rank's slices from disk
qshard.load(path, single, device=device)  # the same checkpoint at TP 1, to compare

torch.manual_seed(1)
x = torch.randn(8, 1024, device=device)
with torch.no_grad():
    difference = (model(x) - single(x)).abs().max().item()

qshard.save(model, path + "-resaved")  # 3. a sharded model saves one full checkpoint again
local = model[0].weight.to_local()
if rank == 0:
    print(
        f"TP {world}: rank 0 read a {type(local).__name__} {list(local.shape)} of [4096, 1024]; "
        f"max difference vs TP 1: {difference:.1e}; re-saved: "
        f"{sorted(os.listdir(path + '-resaved'))}"
    )
qshard.tp.shutdown()  # every rank done (a barrier), compiled graphs released, group destroyed
