"""transformers' own expert parallelism (its `ep_plan`, `apply_expert_parallelism`, and
`from_pretrained(distributed_config=...)`) on experts that qshard quantized, on CPU with gloo.

transformers 5.x shards an experts module with its model's `ep_plan`: the 3-D weights by
`MoEParamShard(Shard(0))` (`distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)`,
each rank slicing its own experts out of the QTensor) and the module by `ep_dispatch_experts`,
whose `EPImplementation` ("all_to_all", "all_reduce", "auto") brings each rank's experts their
tokens and runs the module's own forward on the local QTensors. The outputs must equal the
unsharded quantized model's (up to summation order) and qshard.tp.ExpertParallel's; the
comparison of the two is in docs/expert_parallel.md.

Each test spawns one group of processes and runs all its cases in it.
"""

from __future__ import annotations

import copy

import moe_models
import pytest
import torch
from helpers import assert_same_qtensor
from test_tensor_parallel import spawn
from torch import nn
from torch.distributed.tensor import DTensor, Shard

import qshard
import qshard.tp

FP8 = qshard.Fp8BlockwiseConfig(block_size=(32, 32))
INT4 = qshard.Int4WeightOnlyConfig(group_size=32)
MXFP4 = qshard.MXFP4WeightOnlyConfig()
NVFP4 = qshard.NVFP4WeightOnlyConfig()  # one global scale per expert
FP8_ROW = qshard.Fp8RowwiseConfig()
LAYOUTS = [FP8, INT4, MXFP4, NVFP4, FP8_ROW]
EXPERTS = "model.layers.*.mlp.experts"
# A token's top-k expert outputs are summed across ranks (all_reduce) or on the sender after
# the all-to-all, not in one device's order: fp32 rounding on O(1) outputs.
TOLERANCE = {"rtol": 1e-5, "atol": 2e-5}
LOGITS_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def routing(tokens: int, dtype=torch.float32, seed: int = 0):
    """(hidden, top_k_index, top_k_weights): an experts module's inputs, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, moe_models.HIDDEN, generator=gen).to(dtype)
    scores = torch.rand(tokens, moe_models.EXPERTS, generator=gen)
    weights, ids = scores.topk(moe_models.TOP_K, dim=-1)
    return hidden, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


def transformers_ep(model: nn.Module, mesh, implementation: str) -> nn.Module:
    """transformers' expert parallelism with the model's own ep_plan, as from_pretrained
    applies it (its `*` expanded to layer numbers; the EP group is the group sharing a batch)."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = model._expand_parallel_plan(model.ep_plan)
    return apply_expert_parallelism(model, mesh, mesh, plan, ep_implementation=implementation)


def token_ids(seed: int = 3) -> torch.Tensor:
    return torch.randint(0, moe_models.VOCAB, (2, 7), generator=torch.Generator().manual_seed(seed))


def check_local_experts(model, reference, rank, world, where) -> None:
    """Every 3-D weight (and gpt-oss bias) is a DTensor Shard(0) holding this rank's E/world
    experts, bit for bit the unsharded quantized weight's slice, in storage of its own."""
    for module_name, module in experts_of(model).items():
        assert module.num_experts == moe_models.EXPERTS // world, where
        for pname, param in module.named_parameters(recurse=False):
            full = getattr(reference.get_submodule(module_name), pname)
            assert isinstance(param, DTensor) and param.placements == (Shard(0),), (where, pname)
            assert param.shape == full.shape, (where, pname)
            local = param.to_local()
            n = full.shape[0] // world
            if isinstance(full, qshard.QTensor):
                assert_same_qtensor(local, full.slice_logical(0, rank * n, (rank + 1) * n))
                for t in local.inner_tensors().values():  # not a view of the full weight
                    assert t.untyped_storage().nbytes() == t.nbytes, (where, pname)
            else:
                assert torch.equal(local, full[rank * n : (rank + 1) * n]), (where, pname)


def check_case(rank, world, mesh, name, config, implementation, experts_impl="grouped_mm"):
    """transformers' EP of `name` quantized with `config`: shards, experts outputs and logits
    equal the unsharded quantized model's and qshard.tp.ExpertParallel's."""
    model = moe_models.build(name)
    qshard.quantize_(model, config)
    model.set_experts_implementation(experts_impl)
    reference = copy.deepcopy(model)
    # qshard's ExpertParallel with the same token exchange (all_to_all or all_reduce).
    dispatch = "all_to_all" if implementation == "all_to_all" else "all_reduce"
    style = qshard.tp.ExpertParallel(dispatch=dispatch)
    ours = qshard.tp.parallelize(copy.deepcopy(model), mesh, {EXPERTS: style})
    transformers_ep(model, mesh, implementation)
    where = f"{name} {type(config).__name__} {implementation} {experts_impl} world {world}"

    check_local_experts(model, reference, rank, world, where)
    for module_name, module in experts_of(model).items():
        for seed in range(2):
            args = routing(13, seed=seed)
            with torch.no_grad():
                got = module(*args)
                expected = reference.get_submodule(module_name)(*args)
                qshard_ep = ours.get_submodule(module_name)(*args)
            assert got.abs().max() > 0.1, where  # the experts ran (outputs are O(1))
            for other in (expected, qshard_ep):
                torch.testing.assert_close(got, other, **TOLERANCE, msg=lambda m: f"{where}: {m}")
    with torch.no_grad():
        logits = model(token_ids()).logits
        torch.testing.assert_close(logits, reference(token_ids()).logits, **LOGITS_TOLERANCE)
        torch.testing.assert_close(logits, ours(token_ids()).logits, **LOGITS_TOLERANCE)


def check_shard_then_quantize(rank, world, mesh, name, config) -> None:
    """quantize_ of experts that transformers' EP sharded first (float, Shard(0)): each rank
    quantizes its own whole experts, bit for bit the quantize-then-shard model (NVFP4's
    per-expert global scales included), and runs as it does."""
    model, quantized_first = moe_models.build(name), moe_models.build(name)
    qshard.quantize_(quantized_first, config)
    reference = copy.deepcopy(quantized_first)
    transformers_ep(quantized_first, mesh, "all_to_all")
    transformers_ep(model, mesh, "all_to_all")
    report = qshard.quantize_(model, config, include="*.experts.*")
    assert {m.name for m in report.quantized} == {
        f"{n}.{p}" for n in experts_of(model) for p in ("gate_up_proj", "down_proj")
    }
    for module_name, module in experts_of(model).items():
        other = quantized_first.get_submodule(module_name)
        for pname, param in module.named_parameters(recurse=False):
            if isinstance(getattr(other, pname).to_local(), qshard.QTensor):
                assert (
                    param.placements == (Shard(0),) and param.shape == getattr(other, pname).shape
                )
                assert_same_qtensor(param.to_local(), getattr(other, pname).to_local())
    qshard.quantize_(model, config, exclude="*.experts.*")  # the rest, as quantized_first
    with torch.no_grad():
        torch.testing.assert_close(
            model(token_ids()).logits, reference(token_ids()).logits, **LOGITS_TOLERANCE
        )


def _world2_worker(rank, world, mesh):
    for config in LAYOUTS:  # every layout, both token exchanges
        for implementation in ("all_to_all", "all_reduce"):
            check_case(rank, world, mesh, "qwen3_moe", config, implementation)
    # gpt-oss: transposed experts, interleaved gate/up, per-expert biases sharded with them.
    for config in (MXFP4, NVFP4):
        for implementation in ("all_to_all", "auto"):  # auto = all_reduce at inference
            check_case(rank, world, mesh, "gpt_oss", config, implementation)
    check_case(rank, world, mesh, "deepseek_v3", FP8, "all_to_all")  # a shared expert beside
    # transformers' other experts implementations run on the local QTensors too.
    check_case(rank, world, mesh, "qwen3_moe", INT4, "all_reduce", "eager")
    check_case(rank, world, mesh, "qwen3_moe", FP8, "all_to_all", "batched_mm")
    check_case(rank, world, mesh, "gpt_oss", MXFP4, "all_to_all", "eager")
    check_case(rank, world, mesh, "gpt_oss", MXFP4, "all_reduce", "batched_mm")
    for config in (NVFP4, FP8):
        check_shard_then_quantize(rank, world, mesh, "qwen3_moe", config)
    check_shard_then_quantize(rank, world, mesh, "gpt_oss", MXFP4)

    # transformers 5.23's own limit, the same on float experts: gpt-oss's eager experts forward
    # one_hot-encodes the ids with num_experts classes, and AllReduceEP's sentinel id for routes
    # to other ranks is num_experts. (qshard's ExpertParallel sends them to expert 0 with weight
    # 0 under eager; check_case ran that above.)
    for config in (None, MXFP4):
        model = moe_models.gpt_oss()
        if config is not None:
            qshard.quantize_(model, config)
        model.set_experts_implementation("eager")
        transformers_ep(model, mesh, "all_reduce")
        message = "Class values must be smaller than num_classes"
        with pytest.raises(RuntimeError, match=message), torch.no_grad():
            model(token_ids())


def test_transformers_ep_on_quantized_experts_world_2():
    """apply_expert_parallelism with each model's ep_plan on qshard experts of every layout:
    Shard(0) local QTensors, outputs equal one device's and qshard's ExpertParallel's."""
    spawn(_world2_worker, 2)


def _world4_worker(rank, world, mesh):
    check_case(rank, world, mesh, "qwen3_moe", FP8, "all_to_all")
    check_case(rank, world, mesh, "gpt_oss", MXFP4, "all_reduce")
    check_case(rank, world, mesh, "qwen3_moe", NVFP4, "auto")


def test_transformers_ep_on_quantized_experts_world_4():
    spawn(_world4_worker, 4)


# ---- from_pretrained(distributed_config=...) -------------------------------------------------


def _from_pretrained_worker(rank, world, mesh, directory):
    """transformers loads a float checkpoint sharded (attention by its tp_plan, experts by its
    ep_plan: each rank reads only its experts), then quantize_ quantizes each rank's shards; the
    model equals the unsharded checkpoint loaded and quantized, its experts bit for bit."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    # int4 g32: every TP shard of the attention (16 rows, 32 columns) keeps whole groups.
    qshard.quantize_(reference, INT4)
    for implementation in ("all_to_all", "all_reduce"):
        config = DistributedConfig(tp_size=world, ep_size=world, ep_implementation=implementation)
        model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=config).eval()
        attention = model.model.layers[0].self_attn.q_proj.weight
        assert isinstance(attention, DTensor) and attention.placements == (Shard(0),)
        report = qshard.quantize_(model, INT4)
        assert [s.name for s in report.skipped] == ["lm_head"], report  # kept float by default
        check_local_experts(model, reference, rank, world, f"from_pretrained {implementation}")
        with torch.no_grad():
            torch.testing.assert_close(
                model(token_ids()).logits, reference(token_ids()).logits, **LOGITS_TOLERANCE
            )

    # transformers' tensor parallelism of the experts (its tp_plan without EP: gate_up
    # "packed_colwise", down "rowwise") cuts inside every expert: quantize_ after it skips them
    # and says why (quantize first, then shard with qshard.tp.ExpertTensorParallel).
    config = DistributedConfig(tp_size=world)
    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=config).eval()
    report = qshard.quantize_(model, INT4)
    skipped = {s.name: s.reason for s in report.skipped if s.name != "lm_head"}
    assert set(skipped) == {
        f"{n}.{p}" for n in experts_of(model) for p in ("gate_up_proj", "down_proj")
    }
    assert all("sharded inside its experts" in reason for reason in skipped.values()), skipped


def test_from_pretrained_with_a_distributed_config_then_quantize(tmp_path):
    moe_models.qwen3_moe().save_pretrained(tmp_path)
    spawn(_from_pretrained_worker, 2, str(tmp_path))


# ---- torch.compile -------------------------------------------------------------------------


def _compile_worker(rank, world, mesh):
    from torch._dynamo.testing import CompileCounterWithBackend

    def experts_with(implementation: str) -> nn.Module:
        model = moe_models.qwen3_moe().to(torch.bfloat16)
        qshard.quantize_(model, INT4, include="*.experts.*")
        transformers_ep(model, mesh, implementation)
        return next(iter(experts_of(model).values()))

    def run(compiled, experts, tokens):
        args = routing(tokens, dtype=torch.bfloat16, seed=tokens)
        with torch.no_grad():
            got, expected = compiled(*args), experts(*args)
        # bf16: inductor computes the gate's elementwise ops in fp32 and rounds once.
        assert qshard.sqnr_db(expected.float(), got.float()) > 30

    # AllReduceEP: no split size read back; one graph for every token count.
    experts = experts_with("all_reduce")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(experts, backend=counter, fullgraph=True, dynamic=True)
    for tokens in (5, 11, 3):
        run(compiled, experts, tokens)
    assert counter.frame_count == 1, counter.frame_count

    # AllToAllEP reads its split sizes back to the host and branches on the received count:
    # no full graph (transformers 5.23's code, the same for float experts) ...
    experts = experts_with("all_to_all")
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.UserError, match="data-dependent"):
        run(torch.compile(experts, backend="aot_eager", fullgraph=True, dynamic=True), experts, 5)
    # ... but it compiles in pieces. A piece that returns a DTensor's local QTensor (its
    # `_use_local_dtensor_params` calls to_local()) is re-made by as_strided of that QTensor.
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(experts, backend=counter, dynamic=True)
    for tokens in (5, 11):
        run(compiled, experts, tokens)
    assert counter.frame_count > 1, counter.frame_count  # graph breaks


@pytest.mark.slow
def test_transformers_ep_under_torch_compile():
    spawn(_compile_worker, 2)
