"""Checkpoints of 3-D experts QTensors ([E, N, K], and gpt-oss's transposed [E, K, N]) for every
registered layout: exact round trips through qshard.save/load and torch.load(weights_only=True)
(invariant 5), per-rank sliced reads (a rank reads only its experts' bytes; N/K shards re-packed
as 2-D ones are), a transformers MoE model saved and loaded onto the meta device, and records
whose expert count disagrees with their inner tensors refused (invariant 9)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from helpers import LAYOUT_CASES, LAYOUT_IDS, assert_same_qtensor, edit_metadata, gaussian

import qshard
from qshard import CheckpointError
from qshard.io import Checkpoint
from qshard.io import checkpoint as checkpoint_module
from qshard.io import saving as save_module
from qshard.tp.styles import chunk_bounds, shard_cuts

cases = pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)
transposes = pytest.mark.parametrize("transposed", [False, True], ids=["ENK", "EKN"])

# E = 3 experts split 2 and 3 ways; N = 96 and K = 192 cut in half fall inside 128-blocks
# (FP8 re-blocks) but on every 4-bit layout's groups of 32.
E, N, K = 3, 96, 192


def experts(cls, config, transposed: bool, seed: int = 0) -> qshard.QTensor:
    w = cls.from_float(gaussian(E, N, K, seed=seed), config)
    return w.transpose(-2, -1) if transposed else w


@cases
@transposes
def test_round_trips_are_exact(cls, config, transposed, tmp_path):
    w = experts(cls, config, transposed)
    bias = gaussian(E, N, seed=1).to(torch.bfloat16)
    qshard.save({"experts.w": w, "experts.bias": bias}, tmp_path)
    state = qshard.load(tmp_path)
    assert_same_qtensor(state["experts.w"], w)
    assert state["experts.w"].shape == w.shape and state["experts.w"].stride() == w.stride()
    assert torch.equal(state["experts.bias"], bias)
    assert torch.equal(state["experts.w"].dequantize(), w.dequantize())
    torch.save({"w": w}, tmp_path / "w.pt")
    pickled = torch.load(tmp_path / "w.pt", weights_only=True)["w"]
    assert_same_qtensor(pickled, w)
    assert_same_qtensor(pickled[1], w[1])


@cases
@transposes
def test_per_rank_reads_equal_slicing_the_whole(cls, config, transposed, tmp_path):
    w = experts(cls, config, transposed)
    qshard.save({"w": w}, tmp_path)
    with Checkpoint(tmp_path) as checkpoint:
        for dim, world in [(0, 2), (0, 3), (1, 2), (2, 2)]:
            logical = w.logical_dim(dim)
            size = w.shape[dim]
            whole = w.realign(logical, shard_cuts(size, world))
            parts = []
            for rank in range(world):
                part = checkpoint.read_shard("w", dim, world, rank)
                start, end = chunk_bounds(size, world, rank)
                assert_same_qtensor(part, whole.slice_logical(logical, start, end))
                parts.append(part.dequantize())
            assert torch.equal(torch.cat(parts, dim), w.dequantize()), (dim, world)


@pytest.mark.parametrize("transposed", [False, True], ids=["ENK", "EKN"])
def test_a_rank_reads_only_its_experts_bytes(transposed, tmp_path, monkeypatch):
    """Tiny checksum chunks: the experts rank 1 holds are read (and verified) without a byte of
    rank 0's, so a flipped byte in expert 0 fails rank 0's read and not rank 1's."""
    monkeypatch.setattr(save_module, "CHUNK_BYTES", 64)
    w = experts(
        qshard.Fp8BlockwiseTensor, qshard.Fp8BlockwiseConfig(block_size=(32, 32)), transposed
    )
    qshard.save({"w": w}, tmp_path)
    reads = []
    original = checkpoint_module._verified_range

    def spy(f, header, stored, begin, end):
        reads.append((stored.key, begin, end))
        return original(f, header, stored, begin, end)

    monkeypatch.setattr(checkpoint_module, "_verified_range", spy)
    with Checkpoint(tmp_path) as checkpoint:
        part = checkpoint.read_shard("w", 0, 3, 1)  # expert 1 of 3
    assert_same_qtensor(part, w[1:2])
    for name in ("qdata", "scale"):
        per_expert = getattr(w, name)[0].numel() * getattr(w, name).element_size()
        spans = [(b, e) for key, b, e in reads if key == f"w.{name}"]
        assert spans and all(per_expert <= b and e <= 2 * per_expert for b, e in spans), spans
    path = tmp_path / "model.safetensors"
    flip_byte(path, "w.qdata", 3)  # inside expert 0
    with Checkpoint(tmp_path) as checkpoint:
        assert_same_qtensor(checkpoint.read_shard("w", 0, 3, 1), w[1:2])
        with pytest.raises(CheckpointError, match="checksum"):
            checkpoint.read_shard("w", 0, 3, 0)


def test_a_qwen3_moe_model_saves_and_loads_onto_the_meta_device(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(block_size=(32, 32)))
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, qshard.Fp8BlockwiseTensor)
    qshard.save(model, tmp_path)
    # Parameters on meta; RoPE's inv_freq, a non-persistent buffer (in no state_dict), computed
    with qshard.empty_weights():
        loaded = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    qshard.load(tmp_path, loaded)
    for name in ("gate_up_proj", "down_proj"):
        assert_same_qtensor(
            getattr(loaded.model.layers[0].mlp.experts, name), getattr(experts, name)
        )
    tokens = torch.tensor([[1, 5, 9, 77, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)


# ---- bad records ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ([4, N, K], r"inner tensor 'qdata' is float8_e4m3fn\[3, 96, 192\].*needs.*\[4, 96, 192\]"),
        ([N, K], r"inner tensor 'qdata' is float8_e4m3fn\[3, 96, 192\].*needs.*\[96, 192\]"),
        ([3, N, 160], r"inner tensor 'qdata' .* needs float8_e4m3fn\[3, 96, 160\]"),
        ([1, 3, N, K], r"shape \[1, 3, 96, 192\] has 4 dims; a quantized weight is \[N, K\]"),
    ],
    ids=["more-experts", "no-experts-dim", "other-K", "4-D"],
)
def test_a_record_whose_shape_disagrees_with_its_inner_tensors_is_refused(shape, match, tmp_path):
    w = experts(qshard.Fp8BlockwiseTensor, qshard.Fp8BlockwiseConfig(), transposed=False)
    qshard.save({"w": w}, tmp_path)
    edit_metadata(tmp_path / "model.safetensors", lambda d: d["entries"]["w"].update(shape=shape))
    with pytest.raises(CheckpointError, match=match):
        qshard.load(tmp_path)


def test_a_pickle_whose_expert_count_disagrees_with_its_inner_tensors_is_refused(tmp_path):
    w = experts(qshard.Nvfp4Tensor, qshard.NVFP4WeightOnlyConfig(), transposed=False)
    w.global_scale = w.global_scale[:2]  # one per expert: 2 for 3 experts
    torch.save({"w": w}, tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match=r"'global_scale' is float32\[2, 1, 1\].*\[3, 1, 1\]"):
        torch.load(tmp_path / "w.pt", weights_only=True)


def test_loading_experts_of_another_shape_leaves_the_model_unchanged(tmp_path):
    w = experts(qshard.Mxfp4Tensor, qshard.MXFP4WeightOnlyConfig(), transposed=True)
    qshard.save({"w": w}, tmp_path)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(E + 1, K, N))
    with pytest.raises(
        CheckpointError,
        match=r"'w' is \[3, 192, 96\] in the checkpoint and "
        r"\[4, 192, 96\] in the model",
    ):
        qshard.load(tmp_path, model)
    assert type(model.w.data) is torch.Tensor and model.w.shape == (E + 1, K, N)


# ---- file editing helpers ------------------------------------------------------------------


def _header(path: pathlib.Path) -> tuple[bytes, dict]:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    return data, json.loads(data[8 : 8 + length])


def flip_byte(path: pathlib.Path, key: str, offset: int) -> None:
    data, header = _header(path)
    start = 8 + int.from_bytes(data[:8], "little") + header[key]["data_offsets"][0] + offset
    data = bytearray(data)
    data[start] ^= 0x01
    path.write_bytes(bytes(data))
