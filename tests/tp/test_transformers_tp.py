"""transformers' own tensor and expert parallelism loading a qshard checkpoint, on CPU with gloo:
`from_pretrained(qshard_dir, tp_plan="auto")` / `distributed_config=DistributedConfig(tp_size=,
ep_size=)` (qshard/integrations/_transformers_ops.py).

Every quantized weight must come out a DTensor placed as transformers places the float weight,
whose local tensor is the qshard layout holding exactly this rank's rows / columns / experts
(bit for bit the unsharded QTensor's slice, and dequantized what transformers' own
shard-on-read cuts from the dequantized weight); each sharded Linear, run alone through
transformers' hooks, and the logits must equal the unsharded model's up to the summation order
of the row-parallel all-reduce (W8A8 logits: see check_load). Styles, cuts and loads qshard
refuses raise a typed error on every rank, before or after loading, never a hang.

One spawn per world size; the checkpoints are written once by the test, every case of a world
size runs inside its worker.
"""

from __future__ import annotations

import os

import moe_models
import pytest
import torch
from helpers import assert_same_qtensor
from test_tensor_parallel import ROW_PARALLEL_TOLERANCE, spawn
from torch.distributed.tensor import DTensor

import qshard
from qshard import QShardError
from qshard.errors import MisalignedSliceError
from qshard.tp import chunk_bounds

# hidden 256, intermediate 512: at 2 ranks every cut is on a 128 boundary (FP8's default
# 128x128 blocks and 1x128 activation groups stay whole), at 4 ranks on a 64 boundary.
DENSE = dict(
    vocab_size=128,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
)
# intermediate 80: the down projection's 2-way cut (40) falls inside int4's packing (groups of
# 32, re-grouped down to 16 at least): refused.
MISALIGNED = dict(DENSE, hidden_size=64, intermediate_size=80, num_key_value_heads=2)
INT4 = qshard.Int4WeightOnlyConfig(group_size=32)
LAYOUTS = {
    2: {
        "int4": INT4,
        "fp8": qshard.Fp8BlockwiseConfig(),  # 128x128, W8A8
        "mxfp4": qshard.MXFP4WeightOnlyConfig(),
        "nvfp4": qshard.NVFP4WeightOnlyConfig(),  # a global scale every part keeps whole
        "fp8_row": qshard.Fp8RowwiseConfig(weight_only=True),
    },
    4: {
        "int4_g128": qshard.Int4WeightOnlyConfig(group_size=128),  # re-grouped to 64 exactly
        "fp8_w8a16": qshard.Fp8BlockwiseConfig(weight_only=True),  # re-blocked to 64x64
    },
}


def token_ids(vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(5))


def rank_part(full: qshard.QTensor, placement, world: int, rank: int) -> qshard.QTensor:
    """What a rank must hold: Shard(d) its torch.chunk piece of outer dim d; _StridedShard(d,
    split_factor=2) (packed [gate; up]) its piece of each half, gate then up."""
    dim = placement.dim % full.dim()
    halves = getattr(placement, "split_factor", 1)
    size = full.shape[dim] // halves
    start, end = chunk_bounds(size, world, rank)
    logical = full.logical_dim(dim)
    parts = [full.slice_logical(logical, h * size + start, h * size + end) for h in range(halves)]
    return torch.cat(parts, dim) if len(parts) > 1 else parts[0]


def check_shards(model, reference, rank: int, world: int, where: str) -> int:
    """Every quantized weight of `model` is this rank's part of `reference`'s; returns how many
    are sharded."""
    from transformers.distributed.sharding_utils import DtensorShardOperation

    sharded = 0
    for name, param in model.named_parameters():
        full = reference.get_parameter(name)
        if not isinstance(full, qshard.QTensor):
            continue
        at = f"{where}: {name}"
        assert isinstance(param, DTensor), at
        assert param.shape == full.shape and not param.requires_grad, at
        local = param.to_local()
        assert isinstance(local, qshard.QTensor), at
        (placement,) = param.placements
        if placement.is_replicate():
            assert_same_qtensor(local, full)
            continue
        sharded += 1
        assert_same_qtensor(local, rank_part(full, placement, world, rank))
        # transformers' own shard-on-read of the float weight cuts the same values
        expected = DtensorShardOperation(param).shard_tensor(full.dequantize())
        assert torch.equal(local.dequantize(), expected), at
        for t in local.inner_tensors().values():  # a copy, not a view of the whole weight
            assert t.untyped_storage().nbytes() == t.nbytes, at
    return sharded


def check_modules(model, reference, world: int, where: str) -> None:
    """Each sharded quantized Linear, called alone through transformers' hooks: a column-
    parallel one gives this rank's columns of the unsharded output, a row-parallel one, given
    this rank's columns of the input, the whole output after its all-reduce (up to the
    summation order: CPU BLAS blocks a product by its shape)."""
    from torch.distributed.tensor import Shard

    gen = torch.Generator().manual_seed(7)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, DTensor) or not isinstance(weight.to_local(), qshard.QTensor):
            continue
        rank = weight.device_mesh.get_local_rank()
        x = torch.randn(3, module.in_features, generator=gen)
        with torch.no_grad():
            expected = reference.get_submodule(name)(x)
            if weight.placements == (Shard(0),):
                got, expected = module(x), torch.tensor_split(expected, world, dim=-1)[rank]
            else:
                got = module(torch.tensor_split(x, world, dim=-1)[rank].contiguous())
        at = f"{where}: {name}"
        torch.testing.assert_close(
            got, expected, **ROW_PARALLEL_TOLERANCE, msg=lambda m, at=at: f"{at}: {m}"
        )


def check_load(directory: str, rank: int, world: int, where: str, w8a8=False, **distributed):
    """from_pretrained with `distributed` (DistributedConfig's fields): shards, modules and logits
    equal the unsharded load's."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    config = DistributedConfig(**distributed)
    model = AutoModelForCausalLM.from_pretrained(directory, distributed_config=config).eval()
    where = f"{where} {distributed}"
    assert check_shards(model, reference, rank, world, where) > 0, where
    check_modules(model, reference, world, where)
    ids = token_ids(reference.config.vocab_size)
    with torch.no_grad():
        expected, logits = reference(ids).logits, model(ids).logits
    assert expected.abs().max() > 0.1, where
    if w8a8:
        # Activations are quantized again in every layer: a last-bit difference of the first
        # all-reduce flips an FP8 rounding here and there (layer by layer, check_modules holds
        # it to the summation order): 47 dB measured.
        assert qshard.sqnr_db(expected, logits) > 40, where
    else:
        torch.testing.assert_close(
            logits, expected, **ROW_PARALLEL_TOLERANCE, msg=lambda m: f"{where}: {m}"
        )


def check_refusals(rank: int, world: int, directories: dict[str, str]) -> None:
    """Each refusal is a typed error on every rank, and the group goes on working after it."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    def load(name, **kwargs):
        return AutoModelForCausalLM.from_pretrained(directories[name], **kwargs)

    # A cut inside the packing (found while loading, raised once loading ends).
    with pytest.raises(MisalignedSliceError, match=r"down_proj.*style 'rowwise'.*sizes that work"):
        load("misaligned", distributed_config=DistributedConfig(tp_size=world))
    # A style qshard does not apply to a quantized weight (before anything is read).
    plan = {"model.layers.*.mlp.down_proj": "sequence_parallel"}
    with pytest.raises(QShardError, match=r"'model.layers.0.mlp.down_proj.weight'.*'sequence_pa"):
        load("int4", distributed_config=DistributedConfig(tp_size=world, tp_plan=plan))
    # FSDP all-gathers parameters through collectives.
    with pytest.raises(QShardError, match="FSDP"):
        load("int4", distributed_config=DistributedConfig(fsdp_size=world))
    # Quantizing a float checkpoint while transformers shards it.
    from qshard.integrations.transformers import QShardConfig

    config = QShardConfig(config=INT4)
    with pytest.raises(QShardError, match="quantizing while loading a sharded model"):
        load(
            "float", quantization_config=config, distributed_config=DistributedConfig(tp_size=world)
        )
    torch.distributed.barrier()


def _world2_worker(rank, world, mesh, directories):
    for name, config in LAYOUTS[world].items():
        w8a8 = not getattr(config, "weight_only", True)
        check_load(directories[name], rank, world, name, w8a8, tp_size=world)
    # transformers' plan for Qwen3-MoE experts: gate_up "packed_colwise" (_StridedShard, gate
    # and up rows paired), down "rowwise" (cut at 16 inside int4's 32-groups: re-grouped), the
    # module "moe_tp_experts"; and its expert parallelism ("grouped_gemm": whole experts).
    check_load(directories["moe"], rank, world, "moe", tp_size=world)
    for implementation in ("all_reduce", "all_to_all"):
        check_load(
            directories["moe"],
            rank,
            world,
            "moe",
            tp_size=world,
            ep_size=world,
            ep_implementation=implementation,
        )

    # The issue's own call: tp_plan="auto" (world size from the environment, as torchrun sets
    # it), and the forward with gradients enabled (transformers' autograd hooks).
    from transformers import AutoModelForCausalLM

    os.environ["WORLD_SIZE"] = str(world)
    model = AutoModelForCausalLM.from_pretrained(directories["int4"], tp_plan="auto")
    reference = AutoModelForCausalLM.from_pretrained(directories["int4"])
    assert check_shards(model, reference, rank, world, "tp_plan='auto'") == 14
    ids = token_ids()
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, **ROW_PARALLEL_TOLERANCE)
    # dtype=: every part stands for bfloat16, its codes unchanged.
    model = AutoModelForCausalLM.from_pretrained(
        directories["fp8"], tp_plan="auto", dtype=torch.bfloat16
    )
    reference = AutoModelForCausalLM.from_pretrained(directories["fp8"], dtype=torch.bfloat16)
    assert check_shards(model, reference, rank, world, "dtype=torch.bfloat16") == 14
    assert model.model.layers[0].mlp.down_proj.weight.to_local().dtype == torch.bfloat16
    # "packed_colwise" on a 2-D weight (a fused gate_up Linear, as Phi-3's): each half of the
    # rows cut world ways. Only the parts are checked: gate_proj is no fused weight.
    from transformers.distributed import DistributedConfig

    plan = {"model.layers.*.mlp.gate_proj": "packed_colwise"}
    config = DistributedConfig(tp_size=world, tp_plan=plan)
    model = AutoModelForCausalLM.from_pretrained(directories["fp8"], distributed_config=config)
    reference = AutoModelForCausalLM.from_pretrained(directories["fp8"])
    assert check_shards(model, reference, rank, world, "packed_colwise") == 14
    (placement,) = model.model.layers[0].mlp.gate_proj.weight.placements
    assert getattr(placement, "split_factor", 1) == 2, placement

    check_refusals(rank, world, directories)


def _world4_worker(rank, world, mesh, directories):
    for name, config in LAYOUTS[world].items():
        w8a8 = not getattr(config, "weight_only", True)
        check_load(directories[name], rank, world, name, w8a8, tp_size=world)
    check_load(
        directories["moe"],
        rank,
        world,
        "moe",
        tp_size=world,
        ep_size=world,
        ep_implementation="all_to_all",
    )
    # transformers' tensor parallelism of these experts cuts each one's 32 intermediate
    # columns at 8: no int4 group is that small.
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(tp_size=world)
    message = r"experts.down_proj.*sizes that work for this weight: \[1, 2\]"
    with pytest.raises(MisalignedSliceError, match=message):
        AutoModelForCausalLM.from_pretrained(directories["moe"], distributed_config=config)
    torch.distributed.barrier()


def _save(model, config, directory) -> str:
    if config is not None:
        qshard.quantize_(model, config)
    model.save_pretrained(directory)
    return str(directory)


def _llama(sizes: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**sizes)).eval()


def _qwen3_moe():
    """moe_models' Qwen3-MoE with 4 KV heads (transformers' tp_plan splits them at 4 ranks)."""
    from transformers import Qwen3MoeForCausalLM

    config = moe_models.qwen3_moe().config
    config.num_key_value_heads = 4
    torch.manual_seed(1)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("world", [2, 4])
def test_from_pretrained_with_transformers_tp_plan(tmp_path, world):
    """transformers' tp_plan / ep_plan on a qshard checkpoint: each rank holds its part of every
    quantized weight in qshard's layout, and the model computes as one process does."""
    directories = {
        name: _save(_llama(DENSE), config, tmp_path / name)
        for name, config in LAYOUTS[world].items()
    }
    directories["moe"] = _save(_qwen3_moe(), INT4, tmp_path / "moe")
    if world == 2:
        directories["misaligned"] = _save(_llama(MISALIGNED), INT4, tmp_path / "misaligned")
        directories["float"] = _save(_llama(MISALIGNED), None, tmp_path / "float")
    spawn(_world2_worker if world == 2 else _world4_worker, world, directories)
