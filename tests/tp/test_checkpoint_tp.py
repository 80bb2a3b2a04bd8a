"""Checkpoints and tensor parallelism on gloo: a checkpoint saved at TP 1 loads at TP 2 and 4
with each rank reading only its slices (and equals quantize -> parallelize bit for bit); a model
sharded at TP 2 saves as one full checkpoint that loads at TP 1."""

from __future__ import annotations

import pytest
import torch
from helpers import LAYOUT_CASES, assert_same_qtensor
from test_tensor_parallel import BLOCK_PLAN, Block, spawn
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

import qshard
import qshard.tp
from qshard import QShardError
from qshard.io import Checkpoint
from qshard.qtensor import spans_dim

# The DeepSeek-like case of test_tensor_parallel: 4 x 576 MLP rows, cut at TP 4 into 576-wide
# shards (4.5 x 128): the loaded shards must be re-blocked to 64 exactly as parallelize does.
UNEVEN_DIMS = {"dim": 256, "heads": 4, "head_dim": 64, "hidden": 4 * 576, "unit": 64}


class Model(nn.Module):
    """Embedding (float, row-wise), a quantized Llama-style block with biases, a norm that only
    the plan touches (SequenceParallel: replicated parameters) and a head."""

    def __init__(self, dims):
        super().__init__()
        self.embed = nn.Embedding(96, dims.get("dim", 256))
        self.block = Block(**dims, bias=True)
        self.norm = nn.LayerNorm(dims.get("dim", 256))
        self.head = nn.Linear(dims.get("dim", 256), 96)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)))


PLAN = {
    "embed": RowwiseParallel(input_layouts=Replicate()),
    **{f"block.{name}": style for name, style in BLOCK_PLAN.items()},
    "norm": SequenceParallel(),
    "head": PrepareModuleInput(
        input_layouts=Replicate(), desired_input_layouts=Replicate(), use_local_output=True
    ),
}
TOKENS = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]])


def quantized_model(dims, config, seed: int, dtype=torch.float32) -> Model:
    torch.manual_seed(seed)
    model = Model(dims).to(dtype)
    qshard.quantize_(model, config, include=["block.*"])
    return model


def meta_model(dims, dtype=torch.float32) -> Model:
    with torch.device("meta"):
        return Model(dims).to(dtype)


def assert_same_parameters(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert type(x) is type(y), name
        if isinstance(x, DTensor):
            assert x.placements == y.placements and x.shape == y.shape, name
            x, y = x.to_local(), y.to_local()
        if isinstance(x, qshard.QTensor):
            assert_same_qtensor(x, y)
        else:
            assert torch.equal(x, y), name


def save_every_case(directory, dims, dtype_of=lambda config: torch.float32) -> None:
    """Each LAYOUT_CASES config's model saved to directory / i, in `dtype_of(config)`."""
    for i, (_, config) in enumerate(LAYOUT_CASES):
        model = quantized_model(dims, config, seed=i, dtype=dtype_of(config))
        qshard.save(model, directory / str(i))


# ---- save at TP 1, load at TP 2 and 4 --------------------------------------------------------


def _record_reads() -> dict[str, list[str]]:
    """{"whole": [...], "slice": [...]}: the stored tensors this process reads, by kind."""
    reads = {"whole": [], "slice": []}
    whole, part = Checkpoint._read_stored, Checkpoint._read_slice

    def read_whole(self, header, stored):
        reads["whole"].append(stored.key)
        return whole(self, header, stored)

    def read_slice(self, header, stored, dim, start, end):
        reads["slice"].append(stored.key)
        return part(self, header, stored, dim, start, end)

    Checkpoint._read_stored, Checkpoint._read_slice = read_whole, read_slice
    return reads


def _load_sharded_worker(rank, world, mesh, directory, dims):
    reads = _record_reads()
    for i, (cls, config) in enumerate(LAYOUT_CASES):
        reads["whole"].clear(), reads["slice"].clear()
        loaded = qshard.load(directory / str(i), meta_model(dims), mesh=mesh, plan=PLAN)
        # Every sharded tensor is read by slices: the weights (their packed inner tensors; a
        # value every part shares along the cut dim, such as a whole-tensor or per-row scale,
        # is read whole), the column-parallel biases, the row-parallel embedding.
        packing = loaded.block.qkv.weight.to_local().packing()
        sharded = {
            f"block.{n}.weight.{inner}"
            for n, style in BLOCK_PLAN.items()
            for inner in cls.inner_names
            if not spans_dim(packing[inner], 0 if style == "colwise" else 1)
        }
        sharded |= {"block.qkv.bias", "block.gate_up.bias", "embed.weight"}
        assert set(reads["slice"]) == sharded and not sharded & set(reads["whole"])
        expected = quantized_model(dims, config, seed=i)
        qshard.tp.parallelize(expected, mesh, PLAN)
        assert_same_parameters(loaded, expected)
        assert isinstance(loaded.block.down.weight.to_local(), cls)
        assert loaded.norm.weight.placements == (Replicate(),)
        with torch.no_grad():
            assert torch.equal(loaded(TOKENS), expected(TOKENS))


# At TP 8 the block needs 8 heads; its 96-row qkv and 32-column o shards re-block to 32.
EIGHT_HEADS = {"dim": 256, "heads": 8, "head_dim": 32, "hidden": 1024}


@pytest.mark.parametrize(("world", "dims"), [(2, {}), (4, {}), (8, EIGHT_HEADS)])
def test_a_checkpoint_saved_at_tp1_loads_at_tp_n(world, dims, tmp_path):
    save_every_case(tmp_path, dims)
    spawn(_load_sharded_worker, world, tmp_path, dims)


def test_a_tp4_load_reblocks_cut_blocks_like_parallelize(tmp_path):
    qshard.save(quantized_model(UNEVEN_DIMS, qshard.Fp8BlockwiseConfig(), 0), tmp_path / "0")
    spawn(_load_uneven_worker, 4, tmp_path)


def _load_uneven_worker(rank, world, mesh, directory):
    loaded = qshard.load(directory / "0", meta_model(UNEVEN_DIMS), mesh=mesh, plan=PLAN)
    expected = quantized_model(UNEVEN_DIMS, qshard.Fp8BlockwiseConfig(), 0)
    qshard.tp.parallelize(expected, mesh, PLAN)
    down = loaded.block.down.weight.to_local()
    assert down.block_size == (128, 64) and down.act_group_size == 64
    assert_same_parameters(loaded, expected)
    with torch.no_grad():
        assert torch.equal(loaded(TOKENS), expected(TOKENS))


# ---- save at TP 2, load at TP 1 ----------------------------------------------------------------


def _save_sharded_worker(rank, world, mesh, directory, dims):
    for i, (_, config) in enumerate(LAYOUT_CASES):
        model = quantized_model(dims, config, seed=i)
        qshard.tp.parallelize(model, mesh, PLAN)
        written = qshard.save(model, directory / str(i), max_shard_size="200KB")
        assert (directory / str(i) / "model.safetensors.index.json").exists()  # on every rank
        assert bool(written) == (rank == 0)  # rank 0 wrote; the others waited for it


@pytest.mark.parametrize("dims", [{}, UNEVEN_DIMS], ids=["aligned", "reblocked"])
def test_a_tp2_model_saves_one_full_checkpoint_that_loads_at_tp1(dims, tmp_path):
    check_save_at_tp_n(tmp_path, 2, dims)


def check_save_at_tp_n(tmp_path, world: int, dims: dict) -> None:
    """Every layout's model saved at TP `world` (gathered, one checkpoint), loaded at TP 1:
    the same weights (re-blocked ones dequantize the same) and outputs (bench/gloo_world.py runs
    it at 8 ranks)."""
    spawn(_save_sharded_worker, world, tmp_path, dims)
    for i, (_, config) in enumerate(LAYOUT_CASES):
        expected = quantized_model(dims, config, seed=i)
        loaded = qshard.load(tmp_path / str(i), meta_model(dims))
        for name, module in expected.named_modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, qshard.QTensor):  # a re-blocked weight dequantizes the same
                got = loaded.get_submodule(name).weight
                assert torch.equal(got.dequantize(), weight.dequantize()), name
        # The originals in the TP-n packing (the originals themselves where every cut falls on
        # a block boundary), exactly.
        packed_like_tp(expected, loaded, world)
        assert_same_parameters(loaded, expected)
        with torch.no_grad():
            torch.testing.assert_close(loaded(TOKENS), expected(TOKENS), rtol=1e-5, atol=1e-6)


def packed_like_tp(model: nn.Module, loaded: nn.Module, world: int) -> None:
    """Give `model`'s block weights the packing a TP `world` save wrote into `loaded` (FP8
    re-blocked where a cut fell inside a block: at 8 ranks o's and down's K too, which sets
    the activations' FP8 groups), so that both compute with the same blocks and groups."""
    for name, style in BLOCK_PLAN.items():
        module = model.block.get_submodule(name)
        weight = module.weight
        if isinstance(weight, qshard.QTensor):
            dim = 1 if style == "rowwise" else 0
            realigned = weight.realign(dim, qshard.tp.shard_cuts(weight.shape[dim], world))
            saved = loaded.block.get_submodule(name).weight
            assert realigned.attr_values() == saved.attr_values(), name
            module.weight = nn.Parameter(realigned.clone(), requires_grad=False)


# ---- errors ----------------------------------------------------------------------------------


class Custom(ParallelStyle):
    def _apply(self, module, device_mesh):
        return module


def _errors_worker(rank, world, mesh, directory):
    # qkv has 288 rows at TP 4: cuts at multiples of 72, on no block of 16 or more.
    dims = {"dim": 256, "heads": 2, "head_dim": 48, "hidden": 768}
    model = meta_model(dims)
    before = dict(model.named_parameters())
    with pytest.raises(QShardError, match=r"sizes that work for this model: \[1, 2, 3, 6\]"):
        qshard.load(directory / "0", model, mesh=mesh, plan=PLAN)
    with pytest.raises(QShardError, match="places parameters in a way qshard does not know"):
        qshard.load(directory / "0", model, mesh=mesh, plan={"norm": Custom()})
    assert dict(model.named_parameters()) == before  # nothing changed, nothing read
    sharded = quantized_model(dims, qshard.Fp8BlockwiseConfig(), 0)
    qshard.tp.parallelize(sharded, mesh, {"head": "colwise"})
    with pytest.raises(QShardError, match="sharded already"):
        qshard.load(directory / "0", sharded)


def test_sharded_load_errors_come_before_any_change(tmp_path):
    dims = {"dim": 256, "heads": 2, "head_dim": 48, "hidden": 768}
    qshard.save(quantized_model(dims, qshard.Fp8BlockwiseConfig(), 0), tmp_path / "0")
    spawn(_errors_worker, 4, tmp_path)


# ---- other producers' formats, loaded TP-sharded ----------------------------------------------

FORMAT_CASES = [
    ("deepseek-fp8", qshard.Fp8BlockwiseConfig()),
    ("modelopt-nvfp4", qshard.NVFP4WeightOnlyConfig()),
    ("compressed-tensors", qshard.Int4WeightOnlyConfig(group_size=64)),
]


def _load_pretrained_sharded_worker(rank, world, mesh, directory):
    for i, (fmt, config) in enumerate(FORMAT_CASES):
        loaded = qshard.load_pretrained(directory / fmt, model=meta_model({}), mesh=mesh, plan=PLAN)
        expected = quantized_model({}, config, seed=i)
        qshard.tp.parallelize(expected, mesh, PLAN)
        assert_same_parameters(loaded, expected)
        with torch.no_grad():
            assert torch.equal(loaded(TOKENS), expected(TOKENS))


def test_an_exported_checkpoint_loads_tp_sharded_like_parallelize(tmp_path):
    for i, (fmt, config) in enumerate(FORMAT_CASES):
        qshard.export(quantized_model({}, config, seed=i), tmp_path / fmt, format=fmt)
    spawn(_load_pretrained_sharded_worker, 2, tmp_path)


def _invalid_shard_save_worker(rank, world, mesh, directory):
    model = quantized_model({}, qshard.Fp8BlockwiseConfig(), seed=0)
    qshard.tp.parallelize(model, mesh, PLAN)
    if rank == 1:  # only rank 1's shard of one weight is damaged
        model.block.down.weight.to_local().scale.fill_(float("nan"))
    match = "NaN/Inf" if rank == 1 else "another rank's shard"
    with pytest.raises(QShardError, match=match):
        qshard.save(model, directory)
    assert not directory.exists()


def test_a_sharded_save_with_one_invalid_shard_fails_on_every_rank(tmp_path):
    """Every rank refuses together before any gather: none is left waiting in a collective."""
    spawn(_invalid_shard_save_worker, 2, tmp_path / "ckpt")
