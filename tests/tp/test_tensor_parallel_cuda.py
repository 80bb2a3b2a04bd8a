"""Tensor parallelism on GPUs with NCCL, at each world size of `helpers.nccl_worlds()` (2, 4
and 8 as the machine's GPUs allow; marked `cuda`, skipped without the GPUs)."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYOUT_CASES, gpu_dtype, nccl_worlds
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


# bf16 cases (tinygemm takes only bf16 on CUDA): the row-parallel partial sums are rounded to
# bf16 before the all-reduce adds them, one rounding more than one device's output.
BF16_ROW_PARALLEL_SQNR_DB = 40
COMPILED_SQNR_DB = 60  # the compiled graph runs the same kernels: fp32 / bf16 rounding only
NCCL_WORLDS = nccl_worlds()


def block_dims(world: int) -> dict:
    """Block sizes that split over `world` ranks: whole heads and gate/up units per rank (the
    default block's 4 heads and 12 units of 64 serve 2 and 4 ranks)."""
    return {} if world <= 4 else {"heads": world, "hidden": 128 * world}


def _nccl_block_worker(rank, world, mesh):
    assert mesh.device_type == "cuda"
    for cls, config in LAYOUT_CASES:
        torch.manual_seed(7)
        dtype = gpu_dtype(config)
        block = Block(**block_dims(world)).to("cuda", dtype)
        reference, sharded = _two_quantized_copies(block, config)
        x = torch.randn(2, 9, 256, device="cuda", dtype=dtype)
        with torch.no_grad():
            qshard.tp.parallelize(sharded, mesh, BLOCK_PLAN)
            local = sharded.qkv.weight.to_local()
            assert isinstance(local, cls) and local.device.type == "cuda"
            _realigned_like(reference, sharded, world)
            got, want = sharded(x), reference(x)
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, **ROW_PARALLEL_TOLERANCE)
            else:
                sqnr = qshard.sqnr_db(want.float(), got.float())
                assert sqnr > BF16_ROW_PARALLEL_SQNR_DB, (config, sqnr)
            torch._dynamo.reset()  # each case compiles Block.forward anew (dynamo's limit: 8)
            compiled = torch.compile(sharded, fullgraph=True)
            sqnr = qshard.sqnr_db(got.float(), compiled(x).float())
            assert sqnr > COMPILED_SQNR_DB, (config, sqnr)


@pytest.mark.parametrize("world", NCCL_WORLDS)
def test_llama_block_on_gpus_with_nccl(world):
    spawn(_nccl_block_worker, world, backend="nccl")


def _nccl_checkpoint_worker(rank, world, mesh, directory):
    """Load the TP-1 checkpoint at TP `world` on the GPUs, then save the sharded model
    (gathering the quantized shards over NCCL) and check that it is the same checkpoint."""
    from test_checkpoint_tp import PLAN, TOKENS, assert_same_parameters, meta_model, quantized_model

    for i, (_, config) in enumerate(LAYOUT_CASES):
        dtype = gpu_dtype(config)
        dims = block_dims(world)
        loaded = qshard.load(directory / str(i), meta_model(dims, dtype), mesh=mesh, plan=PLAN)
        assert loaded.block.qkv.weight.to_local().device.type == "cuda"
        expected = quantized_model(dims, config, seed=i, dtype=dtype).cuda()
        qshard.tp.parallelize(expected, mesh, PLAN)
        assert_same_parameters(loaded, expected)
        with torch.no_grad():
            assert torch.equal(loaded(TOKENS.cuda()), expected(TOKENS.cuda()))
        qshard.save(loaded, directory / f"{i}-from-tp{world}")
        again = qshard.load(directory / f"{i}-from-tp{world}", meta_model(dims, dtype))
        # The same weights in the packing the sharded load gave them: at 4 ranks the 768 qkv
        # rows are cut inside 128-row FP8 blocks, re-blocked to 64 rows (the same values).
        original = quantized_model(dims, config, seed=i, dtype=dtype)
        _realigned_like(original, loaded, world)
        assert_same_parameters(again, original)


@pytest.mark.parametrize("world", NCCL_WORLDS)
def test_checkpoint_tp_load_and_save_on_gpus_with_nccl(world, tmp_path):
    from test_checkpoint_tp import save_every_case

    save_every_case(tmp_path, block_dims(world), gpu_dtype)
    spawn(_nccl_checkpoint_worker, world, tmp_path, backend="nccl")


def _nccl_experts_worker(rank, world, mesh):
    """Both ExpertParallel dispatches on CUDA tensors (each collective's inputs on the GPU):
    float experts equal one device's, int4 experts (the grouped kernels) within their SQNR."""
    import copy

    import moe_models
    from test_experts_parallel import EXPERTS, experts_of, routing

    for dispatch in ("all_reduce", "all_to_all"):
        for implementation, config in (
            ("grouped_mm", None),
            ("eager", None),
            ("grouped_mm", "int4"),
        ):
            model = moe_models.qwen3_moe().to("cuda", torch.bfloat16)
            if config:
                qshard.quantize_(model, qshard.Int4WeightOnlyConfig(group_size=32))
            model.set_experts_implementation(implementation)
            reference = copy.deepcopy(model)
            style = qshard.tp.ExpertParallel(dispatch=dispatch)
            qshard.tp.parallelize(model, mesh, {EXPERTS: style})
            # all_reduce: the same tokens on every rank; all_to_all: each rank its own
            seed = rank if dispatch == "all_to_all" else 0
            for name, module in experts_of(model).items():
                args = [t.cuda() for t in routing(9 + seed, dtype=torch.bfloat16, seed=seed)]
                with torch.no_grad():
                    got, want = module(*args), reference.get_submodule(name)(*args)
                assert got.device.type == "cuda"
                where = (dispatch, implementation, config)
                assert qshard.sqnr_db(want.float(), got.float()) > 40, where


@pytest.mark.parametrize("world", NCCL_WORLDS)
def test_expert_parallel_dispatches_on_gpus_with_nccl(world):
    spawn(_nccl_experts_worker, world, backend="nccl")
