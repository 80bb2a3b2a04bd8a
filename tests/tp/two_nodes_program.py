"""One rank of a 2-node x 2-rank job (torchrun --nnodes 2, static rendezvous on this host; see
test_two_nodes.py): EP across the nodes, TP within each, for a quantized MoE and its attention.

torchrun numbers ranks node by node, so ExpertParallel(tensor_parallel=<ranks per node>) keeps
the ranks that share an expert's weights on one node and splits the experts across the nodes
(the outputs are still summed by one all-reduce over every rank, which crosses the nodes:
docs/distributed.md); dense TP runs on one node's ranks (a sub-mesh). Checked against the same
model on one process."""

import copy
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import moe_models  # noqa: E402
from test_experts_parallel import (  # noqa: E402
    EXPERTS,
    FP8,
    experts_of,
    logits_tolerance,
    realigned_reference,
)

import qshard  # noqa: E402
import qshard.tp  # noqa: E402

qshard.tp.deadline(240)
qshard.tp.init_process_group("gloo", timeout_s=120)
rank, world = dist.get_rank(), dist.get_world_size()
node, per_node = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
assert rank == node * per_node + int(os.environ["LOCAL_RANK"]), "torchrun ranks node by node"
nodes = world // per_node
# One mesh of the job; its rows are the nodes: dense TP on a node's ranks, EP x TP on all.
mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("node", "gpu"))

torch.manual_seed(1234)
model = moe_models.qwen3_moe()
qshard.quantize_(model, FP8)
model.set_experts_implementation("grouped_mm")
reference = copy.deepcopy(model)
realigned_reference(reference, per_node)
plan = {EXPERTS: qshard.tp.ExpertParallel(tensor_parallel=per_node)}
qshard.tp.parallelize(model, mesh._flatten(), plan)
attention = {f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"}
attention["model.layers.*.self_attn.o_proj"] = "rowwise"
# (q/k/v colwise and o rowwise within the node; Qwen3's q/k norms are per head, unaffected)
qshard.tp.parallelize(model, mesh["gpu"], attention)
for module in experts_of(model).values():
    weight_mesh = module.down_proj.device_mesh  # (expert groups, ranks sharing an expert)
    assert weight_mesh.shape == (nodes, per_node), weight_mesh
    tp_ranks = dist.get_process_group_ranks(weight_mesh.get_group(1))
    ep_ranks = dist.get_process_group_ranks(weight_mesh.get_group(0))
    assert tp_ranks == list(range(node * per_node, (node + 1) * per_node)), tp_ranks
    assert ep_ranks == [n * per_node + rank % per_node for n in range(nodes)], ep_ranks
for name in ("q_proj", "o_proj"):
    weight = model.model.layers[0].self_attn.get_submodule(name).weight
    group = dist.get_process_group_ranks(weight.device_mesh.get_group())
    assert group == list(range(node * per_node, (node + 1) * per_node)), (name, group)
ids = torch.randint(0, moe_models.VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
with torch.no_grad():
    got, want = model(ids).logits, reference(ids).logits
torch.testing.assert_close(got, want, **logits_tolerance(FP8))
print(f"OK rank {rank} node {node}: experts TP ranks {tp_ranks}, EP ranks {ep_ranks}", flush=True)
qshard.tp.shutdown()
