"""qshard's ExpertParallel against transformers' own expert parallelism on qshard experts.

    python bench/ep_vs_transformers.py [--world 2]

Runs on CPU with gloo (no GPU needed): one tiny Qwen3-MoE experts layer (E=8, H=64, I=32, top-2),
int4 g32 experts, sharded four ways: qshard.tp.ExpertParallel(dispatch="all_reduce" /
"all_to_all") and transformers' apply_expert_parallelism with the model's ep_plan and
ep_implementation "all_reduce" / "all_to_all". Prints a markdown table of what can be measured
without a GPU: the largest difference from the unsharded layer (fp32), host syncs per layer
beyond the unsharded layer's, torch.compile (fullgraph, recompiles as the token count changes),
experts weight bytes per rank, and the rows each rank's experts compute. docs/expert_parallel.md
records one run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

import qshard
import qshard.tp

TOKENS = (5, 11, 3, 17, 64)  # batches the compiled layer sees, in this order
METHODS = (
    "qshard all_reduce",
    "qshard all_to_all",
    "transformers all_reduce",
    "transformers all_to_all",
)


def qwen3_moe(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval().to(dtype)
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32), include="*.experts.*")
    model.set_experts_implementation("grouped_mm")
    return model


def shard(model: torch.nn.Module, method: str, mesh) -> torch.nn.Module:
    owner, implementation = method.split()
    if owner == "qshard":
        style = qshard.tp.ExpertParallel(dispatch=implementation)
        qshard.tp.parallelize(model, mesh, {"model.layers.*.mlp.experts": style})
    else:
        from transformers.distributed.expert_parallel import apply_expert_parallelism

        plan = model._expand_parallel_plan(model.ep_plan)
        apply_expert_parallelism(model, mesh, mesh, plan, ep_implementation=implementation)
    return model.model.layers[0].mlp.experts


def routing(tokens: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, 64, generator=gen).to(dtype)
    weights, ids = torch.rand(tokens, 8, generator=gen).topk(2, dim=-1)
    return hidden, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


class _SyncOps(TorchDispatchMode):
    """Ops that read a tensor's values back to the host or size an output by them."""

    OPS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def host_syncs():
    """The host reads in the block: Tensor.tolist / item (tolist does not go through the
    dispatcher) and the sync ops above."""
    seen: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item")}

    def counted(name):
        def method(self, *args, **kwargs):
            seen.append(name)
            return originals[name](self, *args, **kwargs)

        return method

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        with _SyncOps(seen):
            yield seen
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)


@contextlib.contextmanager
def rows_computed():
    """The rows each grouped matmul of the experts computes (offs[-1]) and is handed (x)."""
    seen: list[tuple[int, int]] = []
    original = qshard.QTensor.grouped_linear

    def grouped_linear(self, x, offs, bias=None):
        seen.append((int(offs[-1]), x.shape[0]))
        return original(self, x, offs, bias)

    qshard.QTensor.grouped_linear = grouped_linear
    try:
        yield seen
    finally:
        qshard.QTensor.grouped_linear = original


def local_bytes(experts: torch.nn.Module) -> int:
    total = 0
    for param in experts.parameters(recurse=False):
        local = param.to_local() if hasattr(param, "to_local") else param
        inner = local.inner_tensors().values() if isinstance(local, qshard.QTensor) else [local]
        total += sum(t.untyped_storage().nbytes() for t in inner)
    return total


def compile_counts(experts, dtype, capture_scalars: bool, fullgraph: bool) -> str:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(experts, backend=counter, fullgraph=fullgraph, dynamic=True)
    counts = []
    try:
        with torch._dynamo.config.patch(capture_scalar_outputs=capture_scalars):
            for tokens in TOKENS:
                args = routing(tokens, dtype, seed=tokens)
                with torch.no_grad():
                    got, expected = compiled(*args), experts(*args)
                assert qshard.sqnr_db(expected.float(), got.float()) > 30
                counts.append(counter.frame_count)
    except Exception as e:  # the failure is the measurement
        return f"fails: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    return f"frames after each batch {counts}"


def measure(rank: int, world: int, mesh) -> dict[str, dict[str, str]]:
    results = {}
    base32 = qwen3_moe(torch.float32)
    one = base32.model.layers[0].mlp.experts
    full_bytes = local_bytes(one)
    with torch.no_grad(), host_syncs() as baseline:
        one(*routing(64, torch.float32, 0))
    for method in METHODS:
        row = {}
        experts = shard(copy.deepcopy(base32), method, mesh)
        diff = 0.0
        for seed, tokens in enumerate(TOKENS):
            args = routing(tokens, torch.float32, seed)
            with torch.no_grad():
                diff = max(diff, (experts(*args) - one(*args)).abs().max().item())
        row["max |out - one device| (fp32)"] = f"{diff:.1e}"
        with torch.no_grad(), host_syncs() as seen, rows_computed() as rows:
            experts(*routing(64, torch.float32, 0))
        row["host syncs per layer (beyond one device's)"] = str(len(seen) - len(baseline))
        computed, handed = rows[0]
        row["rows the rank's experts are handed / compute (T=64, top-2)"] = f"{handed} / {computed}"
        row["experts bytes per rank (of the whole)"] = f"{local_bytes(experts)} ({full_bytes})"
        bf16 = shard(qwen3_moe(torch.bfloat16), method, mesh)
        row["compile fullgraph, dynamic"] = compile_counts(bf16, torch.bfloat16, False, True)
        if method.endswith("all_to_all"):
            row["... with capture_scalar_outputs"] = compile_counts(
                bf16, torch.bfloat16, True, True
            )
            row["... not fullgraph"] = compile_counts(bf16, torch.bfloat16, False, False)
        results[method] = row
    return results


def _entry(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        results = measure(rank, world, init_device_mesh("cpu", (world,)))
        dist.barrier()
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    world = parser.parse_args().world
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        torch.multiprocessing.spawn(_entry, args=(world, f"file://{tmp}/rdzv", out), nprocs=world)
        results = torch.load(out)
    print(
        f"world {world} (gloo, CPU); torch {torch.__version__}, transformers "
        f"{transformers.__version__}; Qwen3-MoE experts E=8 H=64 I=32 top-2, int4 g32\n"
    )
    keys = list(dict.fromkeys(k for row in results.values() for k in row))
    print("| | " + " | ".join(METHODS) + " |")
    print("|---" * (len(METHODS) + 1) + "|")
    for key in keys:
        print(f"| {key} | " + " | ".join(results[m].get(key, "-") for m in METHODS) + " |")


if __name__ == "__main__":
    main()
