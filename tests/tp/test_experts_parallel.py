"""Expert parallelism and tensor parallelism of quantized experts (qshard.tp.ExpertParallel,
ExpertTensorParallel) on CPU with gloo, world sizes 2 and 4.

Each test spawns one group of processes and runs several cases in it (process start-up and
imports dominate on the 2-core CI machine). Every rank builds the same tiny transformers MoE
model, quantizes it, keeps an unsharded copy as the single-device reference, shards the other.
"""

from __future__ import annotations

import copy

import moe_models
import pytest
import torch
from test_tensor_parallel import spawn
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import qshard
import qshard.tp
from qshard.errors import InputMismatchError
from qshard.tp import ExpertParallel, ExpertParallelError, ExpertTensorParallel
from qshard.tp.experts import _gate_up_cuts, _gate_up_rows, local_experts

FP8 = qshard.Fp8BlockwiseConfig(block_size=(32, 32))
INT4 = qshard.Int4WeightOnlyConfig(group_size=32)
MXFP4 = qshard.MXFP4WeightOnlyConfig()
NVFP4 = qshard.NVFP4WeightOnlyConfig()  # a global scale per expert, sliced with its expert
FP8_ROW = qshard.Fp8RowwiseConfig()
EXPERTS = "model.layers.*.mlp.experts"
# A token's expert outputs are summed across ranks (EP) and a row-parallel down projection's
# K parts by the all-reduce (TP), not in one device's order: fp32 rounding (outputs are O(1)).
TOLERANCE = {"rtol": 1e-5, "atol": 2e-5}
TOKENS = 13


def qwen3_moe(intermediate: int = 32, experts: int = moe_models.EXPERTS) -> nn.Module:
    """moe_models.qwen3_moe with another expert intermediate size or expert count."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **moe_models.COMMON,
        head_dim=16,
        intermediate_size=64,
        moe_intermediate_size=intermediate,
        num_experts=experts,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return moe_models._seeded(lambda: Qwen3MoeForCausalLM(config), seed=5)


MODELS = {
    "qwen3_moe": moe_models.qwen3_moe,
    "qwen3_moe_i64": lambda: qwen3_moe(intermediate=64),
    "qwen3_moe_i1": lambda: qwen3_moe(intermediate=1),
    "gpt_oss": moe_models.gpt_oss,
    "deepseek_v3": moe_models.deepseek_v3,
}


def routing(tokens: int, experts: int = moe_models.EXPERTS, dtype=torch.float32, seed: int = 0):
    """(hidden, top_k_index, top_k_weights): an experts module's inputs, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, moe_models.HIDDEN, generator=gen).to(dtype)
    scores = torch.rand(tokens, experts, generator=gen)
    weights, ids = scores.topk(moe_models.TOP_K, dim=-1)
    return hidden, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def logits_tolerance(config) -> dict[str, float]:
    """Whole-model logits of a sharded model against one device's: the experts' outputs differ
    in fp32 summation order; under W8A8 (FP8 layouts quantize the next layer's activations) a
    difference of an ulp can move an activation across an FP8 rounding boundary, one step of
    2^-3 of that element, so the logits get a looser bound (measured: up to 3.7e-4 on logits
    of magnitude 3.8, FP8 blockwise, ExpertTensorParallel at world 2)."""
    if isinstance(config, (qshard.Fp8BlockwiseConfig, qshard.Fp8RowwiseConfig)):
        return {"rtol": 1e-3, "atol": 1e-3}
    return {"rtol": 1e-4, "atol": 1e-4}


def experts_of(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}


def realigned_reference(reference: nn.Module, world: int) -> None:
    """Give the unsharded reference the packing the TP shards got (FP8 re-blocked at a shard
    boundary inside a block), so that both quantize activations in the same groups."""
    for module in experts_of(reference).values():
        interleaved = not module.is_concatenated
        for name, dim in (("gate_up_proj", 1), ("down_proj", 2)):
            weight = getattr(module, name)
            if not isinstance(weight, qshard.QTensor):
                continue
            size = weight.logical_shape[dim]
            if name == "gate_up_proj":
                cuts = _gate_up_cuts(size, world, interleaved)
            else:
                cuts = qshard.tp.shard_cuts(size, world)
            setattr(module, name, nn.Parameter(weight.realign(dim, cuts), requires_grad=False))


def tp_shard(full: qshard.QTensor, name: str, module, world: int, rank: int) -> torch.Tensor:
    """The dequantized rows (gate_up: gate and up rows of this rank's units) or columns (down)
    that ExpertTensorParallel gives `rank`, cut from the full weight (logical [E, N, K])."""
    dense = full.dequantize()
    if full.transposed:
        dense = dense.transpose(-2, -1)
    if name == "gate_up_proj":
        rows = _gate_up_rows(dense.shape[1], world, rank, not module.is_concatenated)
        out = torch.cat([dense[:, a:b] for a, b in rows], dim=1)
    else:
        a, b = qshard.tp.chunk_bounds(dense.shape[2], world, rank)
        out = dense[:, :, a:b]
    return out.transpose(-2, -1) if full.transposed else out


def check_case(rank, world, mesh, name, config, style, implementation="grouped_mm") -> None:
    model = MODELS[name]()
    qshard.quantize_(model, config)
    model.set_experts_implementation(implementation)
    reference = copy.deepcopy(model)
    # The ranks that share each expert (cutting its intermediate dim), and the expert groups.
    tp = world if isinstance(style, ExpertTensorParallel) else style.tensor_parallel
    ep, tp_rank = world // tp, rank % tp
    if tp > 1:
        realigned_reference(reference, tp)
    qshard.tp.parallelize(model, mesh, {EXPERTS: style})
    where = f"{name} {type(config).__name__} {type(style).__name__} world {world} rank {rank}"

    for module_name, module in experts_of(model).items():
        for pname, param in module.named_parameters(recurse=False):
            assert isinstance(param, DTensor), (where, pname)
            local = param.to_local()
            full = getattr(reference.get_submodule(module_name), pname)
            assert param.shape == full.shape, (where, pname)
            if isinstance(style, ExpertParallel):
                assert param.placements[0] == Shard(0), (where, pname, param.placements)
                assert len(param.placements) == (1 if tp == 1 else 2)
                assert local.shape[0] == full.shape[0] // ep
                lo = rank // tp * local.shape[0]
                full = full[lo : lo + local.shape[0]]  # this rank's experts
            if isinstance(full, qshard.QTensor):  # a compact copy of this rank's part
                for t in local.inner_tensors().values():
                    assert t.untyped_storage().nbytes() == t.nbytes, (where, pname)
                if tp == 1:
                    assert torch.equal(local.dequantize(), full.dequantize()), (where, pname)
                else:  # the reference got the shards' packing
                    assert local.attrs() == full.attrs(), (where, pname, local.attrs())
                    expected = tp_shard(full, pname, module, tp, tp_rank)
                    assert torch.equal(local.dequantize(), expected), (where, pname)
        ref_module = reference.get_submodule(module_name)
        for seed in range(2):
            args = routing(TOKENS, seed=seed)
            with torch.no_grad():
                expected, got = ref_module(*args), module(*args)
            torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"{where}: {m}")
    # The whole model, on ids whose routing is identical (logits through two MoE layers).
    ids = torch.randint(0, moe_models.VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, reference(ids).logits, **logits_tolerance(config), msg=where
        )


def _cases_worker(rank, world, mesh, cases):
    for case in cases:
        check_case(rank, world, mesh, *case)


EP_CASES = [
    ("qwen3_moe", FP8, ExpertParallel()),
    ("qwen3_moe", INT4, ExpertParallel()),
    ("gpt_oss", MXFP4, ExpertParallel()),
]
# transformers' other experts implementations (world 2 only: the 2-core CI machine).
OTHER_IMPLEMENTATION_CASES = [
    ("qwen3_moe", FP8, ExpertParallel(), "eager"),
    ("gpt_oss", MXFP4, ExpertParallel(), "batched_mm"),
    ("gpt_oss", MXFP4, ExpertParallel(), "eager"),
    # Every other layout, at world 2.
    ("qwen3_moe", NVFP4, ExpertParallel()),
    ("qwen3_moe", FP8_ROW, ExpertParallel()),
]


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_equals_one_device(world):
    """Each rank holds E/world experts (Shard(0), compact copies); the experts' and the whole
    model's outputs equal the unsharded quantized model's."""
    spawn(_cases_worker, world, EP_CASES + (OTHER_IMPLEMENTATION_CASES if world == 2 else []))


def _tp_worker(rank, world, mesh):
    cases = [("qwen3_moe_i64", FP8, ExpertTensorParallel())]
    if world == 2:
        cases += [
            # I = 32 at TP 2: 16-row shards, half a 32x32 FP8 block, re-blocked exactly.
            ("qwen3_moe", FP8, ExpertTensorParallel()),
            ("qwen3_moe_i64", INT4, ExpertTensorParallel()),
            ("gpt_oss", FP8, ExpertTensorParallel()),  # interleaved gate/up, biases
            # DeepSeek-V3's moe_intermediate 2048 at TP 32 is 64 per rank, half a 128 block:
            # the same cut as I = 32 with 32x32 blocks at TP 2.
            ("deepseek_v3", FP8, ExpertTensorParallel()),
            # The FP4 layouts: down's K shards of 32 keep whole MXFP4 blocks, NVFP4 groups.
            ("qwen3_moe_i64", MXFP4, ExpertTensorParallel()),
            ("qwen3_moe_i64", NVFP4, ExpertTensorParallel()),
        ]
    for case in cases:
        check_case(rank, world, mesh, *case)


@pytest.mark.parametrize("world", [2, 4])
def test_expert_tensor_parallel_equals_one_device(world):
    """Every expert's intermediate dim split: gate_up paired column-parallel, down row-parallel
    with an all-reduce; FP8 shards of half a block re-blocked as dense shards are."""
    spawn(_tp_worker, world)


def _expert_and_tensor_parallel_worker(rank, world, mesh, directory):
    """world 4 = 2 expert groups x 2 ranks per expert: each rank holds E/2 experts' halves."""
    for case in [
        ("qwen3_moe_i64", FP8, ExpertParallel(tensor_parallel=2)),
        ("gpt_oss", FP8, ExpertParallel(tensor_parallel=2)),  # interleaved gate/up, biases
        ("qwen3_moe", INT4, ExpertParallel(tensor_parallel=2), "eager"),
    ]:
        check_case(rank, world, mesh, *case)
    # Saved from the 2-D mesh: gathered whole.
    check_sharded_save(
        rank, world, mesh, directory, "qwen3_moe_i64", FP8, ExpertParallel(tensor_parallel=2)
    )
    # Float experts go through DTensor for real: the 2-D placements gather back whole.
    for name in ("qwen3_moe", "gpt_oss"):
        model = MODELS[name]()
        reference = copy.deepcopy(model)
        qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertParallel(tensor_parallel=2)})
        for module_name, module in experts_of(model).items():
            ref = reference.get_submodule(module_name)
            for pname, param in module.named_parameters(recurse=False):
                assert param.device_mesh.shape == (2, 2), (name, pname)
                full = param.full_tensor()
                assert torch.equal(full, getattr(ref, pname)), (name, pname, param.placements)
            with torch.no_grad():
                torch.testing.assert_close(module(*routing(TOKENS)), ref(*routing(TOKENS)))
    # Refused before anything changes: 3 does not divide 4 ranks; 3 experts do not split over
    # 2 groups of 2 ranks.
    model = moe_models.qwen3_moe()
    with pytest.raises(ExpertParallelError, match=r"tensor_parallel=3 does not divide.*4 ranks"):
        qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertParallel(tensor_parallel=3)})
    model = qwen3_moe(experts=3)
    with pytest.raises(ExpertParallelError, match=r"3 experts.*2 expert-parallel groups"):
        qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertParallel(tensor_parallel=2)})
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    # 6 experts do not split over 4 ranks, but over 2 groups of 2 they do.
    model = qwen3_moe(experts=6)
    qshard.quantize_(model, FP8)
    qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertParallel(tensor_parallel=2)})
    assert all(m.num_experts == 3 for m in experts_of(model).values())


def test_expert_and_tensor_parallel_on_one_mesh_equals_one_device(tmp_path):
    """ExpertParallel(tensor_parallel=2) at world 4: experts split over 2 groups, each expert's
    intermediate dim over the 2 ranks of its group (a 2-D DTensor mesh), one all-reduce."""
    spawn(_expert_and_tensor_parallel_worker, 4, tmp_path)


def _all_to_all_case(rank, world, mesh, name, config, implementation="grouped_mm") -> None:
    model = MODELS[name]()
    qshard.quantize_(model, config)
    model.set_experts_implementation(implementation)
    reference = copy.deepcopy(model)
    plan = {EXPERTS: ExpertParallel(dispatch="all_to_all")}
    qshard.tp.parallelize(model, mesh, plan)
    where = f"{name} {type(config).__name__} {implementation} world {world} rank {rank}"
    # Each rank routes its own tokens: other counts and routes per rank, none on the last.
    tokens = 0 if rank == world - 1 else 5 + 3 * rank
    for module_name, module in experts_of(model).items():
        assert all(isinstance(p, DTensor) for p in module.parameters()), where
        args = routing(tokens, seed=10 + rank)
        with torch.no_grad():
            got, expected = module(*args), reference.get_submodule(module_name)(*args)
        torch.testing.assert_close(got, expected, **TOLERANCE, msg=lambda m: f"{where}: {m}")
    # The whole model, each rank on its own ids (data-parallel everywhere but the experts).
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, moe_models.VOCAB, (2, 4 + rank), generator=generator)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, reference(ids).logits, **logits_tolerance(config), msg=where
        )


def _all_to_all_worker(rank, world, mesh):
    cases = [("qwen3_moe", FP8)]
    if world == 2:
        cases += [("gpt_oss", MXFP4, "eager"), ("qwen3_moe", INT4, "batched_mm")]
    for case in cases:
        _all_to_all_case(rank, world, mesh, *case)
    if world != 2:
        return
    # An expert id out of range on one rank: every rank raises (the counts exchange carries
    # it), before any token moves, and the group is not left waiting.
    model = moe_models.qwen3_moe()
    qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertParallel(dispatch="all_to_all")})
    experts = next(iter(experts_of(model).values()))
    hidden, ids, weights = routing(4, seed=1)
    bad = ids.clone()
    if rank == 0:
        bad[1, 0] = moe_models.EXPERTS
    with torch.no_grad():
        with pytest.raises(InputMismatchError, match=r"outside \[0, experts\).*\[1, 0\]"):
            experts(hidden, bad, weights)
        assert experts(hidden, ids, weights).shape == hidden.shape
    # The all-reduce dispatch (and ExpertTensorParallel's) with other tokens on each rank: every
    # rank raises instead of entering an all-reduce of unequal sizes (which hangs on NCCL).
    for style in (ExpertParallel(), ExpertTensorParallel()):
        model = moe_models.qwen3_moe()
        qshard.tp.parallelize(model, mesh, {EXPERTS: style})
        experts = next(iter(experts_of(model).values()))
        with torch.no_grad():
            with pytest.raises(InputMismatchError, match=r"different tokens.*all_to_all"):
                experts(*routing(4 + rank, seed=1))
            assert experts(*routing(4, seed=1)).shape == (4, moe_models.HIDDEN)
    # torch.compile with fullgraph: the split sizes read to the host become unbacked sizes
    # (capture_scalar_outputs; torch 2.13 traces them so with fullgraph=True even without it,
    # and breaks the graph there without fullgraph); one graph serves every token count.
    from torch._dynamo.testing import CompileCounterWithBackend

    model = moe_models.qwen3_moe().to(torch.bfloat16)
    qshard.quantize_(model, INT4, include="*.experts.*")
    qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertParallel(dispatch="all_to_all")})
    experts = next(iter(experts_of(model).values()))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        compiled = torch.compile(experts, backend=counter, fullgraph=True, dynamic=True)
        for tokens in (5, 11, 3):
            args = routing(tokens + rank, dtype=torch.bfloat16, seed=tokens)
            with torch.no_grad():
                got, expected = compiled(*args), experts(*args)
            assert qshard.sqnr_db(expected.float(), got.float()) > 30
    assert counter.frame_count == 1


@pytest.mark.parametrize("world", [2, 4])
def test_all_to_all_dispatch_equals_one_device(world):
    """ExpertParallel(dispatch='all_to_all'): each rank's own tokens (a rank with none too)
    reach every rank's experts and come back; outputs equal the unsharded model's on the same
    tokens; bad expert ids are refused on every rank; it compiles with fullgraph."""
    spawn(_all_to_all_worker, world)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel=0; pass 1 or more"),
        ({"tensor_parallel": True}, "pass a positive int"),
        ({"tensor_parallel": "2"}, "pass a positive int"),
        ({"dispatch": "alltoall"}, r"dispatch='alltoall'; pass one of"),
        ({"dispatch": "all_to_all", "tensor_parallel": 2}, "each expert must be whole"),
    ],
)
def test_expert_parallel_arguments_are_checked(kwargs, match):
    with pytest.raises(ExpertParallelError, match=match):
        ExpertParallel(**kwargs)


def _gradients_worker(rank, world, mesh):
    """With gradients enabled, the shared inputs' gradients equal one device's for every
    dispatch and style (each rank's are partial sums, all-reduced in the backward)."""
    for style in (ExpertParallel(), ExpertTensorParallel(), ExpertParallel(dispatch="all_to_all")):
        model = moe_models.qwen3_moe()
        reference = copy.deepcopy(model)
        qshard.tp.parallelize(model, mesh, {EXPERTS: style})
        name, module = next(iter(experts_of(model).items()))
        grads = []
        for experts in (module, reference.get_submodule(name)):
            hidden, ids, weights = routing(TOKENS, seed=4)
            hidden.requires_grad_(True), weights.requires_grad_(True)
            experts(hidden, ids, weights).pow(2).sum().backward()
            grads.append((hidden.grad, weights.grad))
        for got, want in zip(*grads, strict=True):
            torch.testing.assert_close(got, want, **TOLERANCE, msg=lambda m, s=style: f"{s}: {m}")


def test_input_gradients_equal_one_device():
    spawn(_gradients_worker, 2)


def _refusals_worker(rank, world, mesh):
    # 6 experts over 4 ranks: refused with the sizes that work, nothing changed (the attention
    # entry of the same plan is not applied either).
    model = qwen3_moe(experts=6)
    qshard.quantize_(model, FP8)
    before = {n: p for n, p in model.named_parameters()}
    plan = {"model.layers.*.self_attn.q_proj": "colwise", EXPERTS: ExpertParallel()}
    with pytest.raises(ExpertParallelError, match=r"6 experts.*4 ranks.*\[1, 2, 3, 6\]"):
        qshard.tp.parallelize(model, mesh, plan)
    after = dict(model.named_parameters())
    assert all(after[n] is p and not isinstance(p, DTensor) for n, p in before.items())
    assert all(m.num_experts == 6 for m in experts_of(model).values())
    # int4 g32 with I = 32 at TP 4: down's K shards of 8 cut its groups (TP 2 re-groups to 16).
    model = moe_models.qwen3_moe()
    qshard.quantize_(model, INT4)
    with pytest.raises(ExpertParallelError, match=r"size 4 cuts.*Sizes that work: \[1, 2\]"):
        qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertTensorParallel()})
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    # Not an experts module.
    with pytest.raises(ExpertParallelError, match="not a transformers experts module"):
        qshard.tp.parallelize(model, mesh, {"model.layers.0.self_attn": ExpertParallel()})
    # EP x TP on an unnamed mesh of part of the world: refused before the plan's other entry
    # (the attention) is applied.
    part = torch.distributed.device_mesh.DeviceMesh("cpu", [0, 1])  # every rank makes it
    plan = {
        "model.layers.*.self_attn.q_proj": "colwise",
        EXPERTS: ExpertParallel(tensor_parallel=2),
    }
    if rank < 2:
        with pytest.raises(ExpertParallelError, match="an unnamed mesh of 2 of the 4 ranks"):
            qshard.tp.parallelize(model, part, plan)
    assert not any(isinstance(p, DTensor) for p in model.parameters())


def test_uneven_experts_and_misaligned_shards_are_refused():
    spawn(_refusals_worker, 4)


def _placements_worker(rank, world, mesh):
    """Float experts (plain tensors go through DTensor for real): the paired gate/up placement
    gathers back to the full weight, and the float TP/EP outputs equal one device's."""
    for name, style in (("qwen3_moe", ExpertTensorParallel()), ("gpt_oss", ExpertParallel())):
        model = MODELS[name]()
        reference = copy.deepcopy(model)
        qshard.tp.parallelize(model, mesh, {EXPERTS: style})
        for module_name, module in experts_of(model).items():
            ref = reference.get_submodule(module_name)
            for pname, param in module.named_parameters(recurse=False):
                full = param.redistribute(mesh, [Replicate()]).to_local()
                assert torch.equal(full, getattr(ref, pname)), (name, pname, param.placements)
            args = routing(TOKENS)
            with torch.no_grad():
                torch.testing.assert_close(module(*args), ref(*args), **TOLERANCE)
            assert local_experts(module) is not None


def test_float_experts_placements_gather_back():
    spawn(_placements_worker, 2)


def _compile_worker(rank, world, mesh):
    from torch._dynamo.testing import CompileCounterWithBackend

    model = moe_models.qwen3_moe().to(torch.bfloat16)
    qshard.quantize_(model, INT4, include="*.experts.*")
    model.set_experts_implementation("grouped_mm")
    qshard.tp.parallelize(model, mesh, {EXPERTS: ExpertParallel()})
    experts = next(iter(experts_of(model).values()))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(experts, backend=counter, fullgraph=True, dynamic=True)
    counts = []
    for tokens in (5, 11, 3):
        args = routing(tokens, dtype=torch.bfloat16, seed=tokens)
        with torch.no_grad():
            got, expected = compiled(*args), experts(*args)
        counts.append(counter.frame_count)
        # bf16: inductor computes the gate's elementwise ops in fp32 and rounds once.
        assert qshard.sqnr_db(expected.float(), got.float()) > 30
    assert counts == [1, 1, 1], counts
    # Frozen (weights constants of the graph), after the experts and then every sharded linear
    # are made local: the graph holds no DTensor and no process group, only the group's name.
    qshard.tp.to_local(model)  # experts too (experts_to_local)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    torch._dynamo.reset()
    args = routing(7, dtype=torch.bfloat16, seed=7)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        frozen = torch.compile(experts, fullgraph=True)(*args)
        assert qshard.sqnr_db(experts(*args).float(), frozen.float()) > 30


def test_expert_parallel_compiles_fullgraph_once():
    spawn(_compile_worker, 2)


def check_sharded_save(rank, world, mesh, directory, name, config, style) -> None:
    """qshard.save of a model whose experts `style` sharded gathers them whole and loads back
    as the unsharded quantized model (with the packing the shards got: FP8 re-blocked where a
    cut fell inside a block)."""
    model = MODELS[name]()
    if config is not None:
        qshard.quantize_(model, config)
    reference = copy.deepcopy(model)
    tp = world if isinstance(style, ExpertTensorParallel) else style.tensor_parallel
    if tp > 1:
        realigned_reference(reference, tp)
    qshard.tp.parallelize(model, mesh, {EXPERTS: style})
    where = (name, type(config).__name__, repr(style))
    path = directory / "-".join(where)
    qshard.save(model, path)
    loaded = qshard.load(path, MODELS[name]())
    for pname, expected in reference.named_parameters():
        got = loaded.get_parameter(pname)
        if isinstance(expected, qshard.QTensor):
            assert got.attrs() == expected.attrs(), (*where, pname)
            for inner, tensor in expected.inner_tensors().items():
                assert torch.equal(getattr(got, inner), tensor), (*where, pname, inner)
        else:
            assert torch.equal(got, expected), (*where, pname)


def _sharded_save_worker(rank, world, mesh, directory):
    # NVFP4 EP: every rank's own per-expert global scales; TP: gate/up paired shards
    # (_StridedShard) and a half-block FP8 cut; gpt-oss: interleaved gate/up, biases, float.
    for case in (
        ("qwen3_moe", NVFP4, ExpertParallel()),
        ("qwen3_moe", FP8, ExpertTensorParallel()),
        ("gpt_oss", MXFP4, ExpertTensorParallel()),
        ("gpt_oss", None, ExpertTensorParallel()),  # float experts
        ("qwen3_moe", None, ExpertTensorParallel()),  # float _StridedShard, gathered by qshard
        ("qwen3_moe_i1", None, ExpertTensorParallel()),  # I = 1: rank 1 holds no units
    ):
        check_sharded_save(rank, world, mesh, directory, *case)


def test_a_sharded_save_of_experts_gathers_them_whole(tmp_path):
    spawn(_sharded_save_worker, 2, tmp_path / "ckpt")


def _sharded_load_worker(rank, world, mesh, directory):
    """qshard.load(mesh=, plan=) with ExpertParallel: each rank reads only its experts (every
    experts inner tensor by slices along E), and the loaded model equals the unsharded one
    sharded after loading, with either dispatch."""
    from test_checkpoint_tp import _record_reads

    reads = _record_reads()
    for config, style in ((NVFP4, ExpertParallel()), (FP8, ExpertParallel(dispatch="all_to_all"))):
        model = MODELS["qwen3_moe"]()
        qshard.quantize_(model, config)
        reference = copy.deepcopy(model)
        path = directory / f"{rank}-{type(config).__name__}"
        qshard.save(model, path)
        reads["whole"].clear(), reads["slice"].clear()
        plan = {EXPERTS: style}
        loaded = qshard.load(path, MODELS["qwen3_moe"](), mesh=mesh, plan=plan)
        experts_keys = {k for k in reads["slice"] + reads["whole"] if ".mlp.experts." in k}
        assert experts_keys and experts_keys <= set(reads["slice"]), reads
        qshard.tp.parallelize(reference, mesh, plan)
        for module_name, module in experts_of(loaded).items():
            ref = reference.get_submodule(module_name)
            assert module.num_experts == ref.num_experts == moe_models.EXPERTS // world
            for pname, param in module.named_parameters(recurse=False):
                expected = getattr(ref, pname)
                assert param.placements == expected.placements == (Shard(0),)
                got, want = param.to_local(), expected.to_local()
                for inner, tensor in want.inner_tensors().items():
                    assert torch.equal(getattr(got, inner), tensor), (pname, inner)
        tokens = 0 if rank == world - 1 and style.dispatch == "all_to_all" else 7
        args = routing(tokens, seed=rank)
        ids = torch.randint(0, moe_models.VOCAB, (2, 5), generator=torch.Generator())
        with torch.no_grad():
            for module_name, module in experts_of(loaded).items():
                ref = reference.get_submodule(module_name)
                torch.testing.assert_close(module(*args), ref(*args), **TOLERANCE)
            torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, **TOLERANCE)
    # One rank's experts fail their checks (a NaN scale in expert 6, checksums recomputed):
    # every rank raises, and no rank's model changes (none is left sharded, waiting in a
    # collective for the failed one).
    shared = directory / f"0-{type(FP8).__name__}"  # rank 0's checkpoint, for both
    if rank == 0:
        nan_scale_in_expert(shared, "model.layers.0.mlp.experts.gate_up_proj", 6)
    torch.distributed.barrier()
    model = MODELS["qwen3_moe"]()
    before = dict(model.named_parameters())
    match = "NaN" if rank == 1 else "another rank's part of the checkpoint failed"
    with pytest.raises(qshard.QShardError, match=match):
        qshard.load(shared, model, mesh=mesh, plan={EXPERTS: ExpertParallel()})
    assert dict(model.named_parameters()) == before
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    # Cutting each expert while loading is not done: refused before anything is read.
    model = MODELS["qwen3_moe"]()
    for style in (ExpertTensorParallel(), ExpertParallel(tensor_parallel=2)):
        with pytest.raises(qshard.QShardError, match=r"not applied while loading.*parallelize"):
            qshard.load(path, model, mesh=mesh, plan={EXPERTS: style})
        assert not any(isinstance(p, DTensor) for p in model.parameters())


def nan_scale_in_expert(directory, key: str, expert: int) -> None:
    """Give `expert` of the saved weight `key` NaN scales, its checksums recomputed (so that
    only the value checks of the rank that reads that expert can refuse it)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from qshard.io.format import METADATA_KEY, chunk_crcs, encode_metadata

    (path,) = directory.glob("*.safetensors")
    with safe_open(str(path), "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    header = json.loads(metadata[METADATA_KEY])
    stored = header["entries"][key]["inner"]["scale"]
    scale = tensors[stored["key"]].clone()
    scale[expert] = float("nan")
    tensors[stored["key"]] = scale
    stored["crc32"], chunks = chunk_crcs(scale.contiguous(), stored["chunk_bytes"])
    stored["chunk_crc32"] = list(chunks)
    entries, version, save_id = header["entries"], header["qshard_version"], header["save_id"]
    save_file(tensors, str(path), encode_metadata(entries, version, save_id))


def test_a_sharded_load_reads_each_ranks_experts(tmp_path):
    spawn(_sharded_load_worker, 2, tmp_path)
