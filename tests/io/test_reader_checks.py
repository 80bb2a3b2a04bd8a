"""Every reader runs the same checks (docs/design.md invariant 9; issue 21): NaN/Inf codes and
scales
in every foreign format, index entries outside the directory, a tensor in two files, JSON
bombs, corrupt safetensors, a float64 model, attributes beyond their bounds, and sliced
(tensor-parallel) reads that verify every byte they read."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from helpers import assert_same_qtensor, crc_text, edit_metadata
from safetensors import safe_open
from safetensors.torch import save_file
from test_pretrained_formats import mlp, random_bytes, write_checkpoint
from torch import nn

import qshard
from qshard import CheckpointError
from qshard.io import Checkpoint
from qshard.io import saving as save_module
from qshard.io.checkpoint import read_header
from qshard.io.format import CRC_KEY, METADATA_KEY

TORCHAO_FIXTURE = pathlib.Path(__file__).parent.parent / "data" / "torchao"


def rewrite(path: pathlib.Path, change) -> None:
    """Rewrite the safetensors file `path` with `change(tensors)` applied (metadata kept)."""
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    change(tensors)
    save_file(tensors, str(path), metadata=metadata)


def exported(directory: pathlib.Path, fmt: str, config) -> pathlib.Path:
    model = mlp().to(torch.bfloat16)
    qshard.quantize_(model, config, exclude=["2"])
    return qshard.export(model, directory, format=fmt)


def gpt_oss(directory: pathlib.Path) -> pathlib.Path:
    g = torch.Generator().manual_seed(9)
    prefix = "model.layers.0.mlp.experts.down_proj"
    tensors = {
        prefix + "_blocks": random_bytes(2, 64, 4, 16, seed=8),
        prefix + "_scales": torch.randint(118, 134, (2, 64, 4), generator=g, dtype=torch.uint8),
    }
    return write_checkpoint(directory, tensors, {"quantization_config": {"quant_method": "mxfp4"}})


def torchao(directory: pathlib.Path) -> pathlib.Path:
    shutil.copytree(TORCHAO_FIXTURE, directory)
    return directory


def set_value(key: str, value: float):
    def change(tensors):
        tensor = tensors[key]
        flat = tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
        flat.view(-1)[min(3, flat.numel() - 1)] = value

    return change


# (a directory of the format, the tensor poisoned, its new value: a NaN/Inf scale, a NaN e4m3
# byte, the e8m0 NaN byte 255, a zero NVFP4 divisor)
POISONED = {
    "deepseek-scale-nan": (
        lambda d: exported(d, "deepseek-fp8", qshard.Fp8BlockwiseConfig()),
        "0.weight_scale_inv",
        float("nan"),
    ),
    "deepseek-e4m3-nan": (
        lambda d: exported(d, "deepseek-fp8", qshard.Fp8BlockwiseConfig()),
        "0.weight",
        0x7F,
    ),
    "modelopt-scale-nan": (
        lambda d: exported(d, "modelopt-nvfp4", qshard.NVFP4WeightOnlyConfig()),
        "0.weight_scale",
        0xFF,
    ),
    "modelopt-global-inf": (
        lambda d: exported(d, "modelopt-nvfp4", qshard.NVFP4WeightOnlyConfig()),
        "0.weight_scale_2",
        float("inf"),
    ),
    "ct-int4-scale-nan": (
        lambda d: exported(d, "compressed-tensors", qshard.Int4WeightOnlyConfig(64)),
        "0.weight_scale",
        float("nan"),
    ),
    "ct-nvfp4-zero-divisor": (
        lambda d: exported(d, "compressed-tensors", qshard.NVFP4WeightOnlyConfig()),
        "0.weight_global_scale",
        0.0,
    ),
    "ct-fp8-scale-inf": (
        lambda d: exported(d, "compressed-tensors", qshard.Fp8RowwiseConfig()),
        "0.weight_scale",
        float("inf"),
    ),
    "fbgemm-scale-nan": (
        lambda d: exported(d, "fbgemm-fp8", qshard.Fp8RowwiseConfig()),
        "0.weight_scale",
        float("nan"),
    ),
    "gpt-oss-e8m0-nan": (gpt_oss, "model.layers.0.mlp.experts.down_proj_scales", 255),
    "torchao-scale-nan": (torchao, "blocks._weight_scale", float("nan")),
    "torchao-int4-scale-inf": (torchao, "int4._weight_scale", float("inf")),
}


@pytest.mark.parametrize("case", list(POISONED))
def test_non_finite_codes_and_scales_are_refused_in_every_format(tmp_path, case):
    make, key, value = POISONED[case]
    directory = make(tmp_path / "ckpt")
    qshard.load_pretrained(directory)  # the clean checkpoint loads
    rewrite(directory / "model.safetensors", set_value(key, value))
    with pytest.raises(CheckpointError, match=r"NaN/Inf|not positive"):
        qshard.load_pretrained(directory)
    if case.startswith(("gpt-oss", "torchao")):
        return
    with torch.device("meta"):
        model = mlp().to(torch.bfloat16)
    before = dict(model.named_parameters())
    with pytest.raises(CheckpointError, match=r"NaN/Inf|not positive"):
        qshard.load_pretrained(directory, model=model)
    assert dict(model.named_parameters()) == before


def test_stray_quantized_tensors_are_refused(tmp_path):
    """A float8 weight whose scale is missing would load as raw codes in a plain tensor."""
    directory = exported(tmp_path / "ds", "deepseek-fp8", qshard.Fp8BlockwiseConfig())
    rewrite(directory / "model.safetensors", lambda t: t.pop("0.weight_scale_inv"))
    with pytest.raises(CheckpointError, match=r"0.weight: a torch.float8_e4m3fn tensor"):
        qshard.load_pretrained(directory)


# ---- where the files are -------------------------------------------------------------------


def sharded_foreign(directory: pathlib.Path) -> pathlib.Path:
    """A deepseek-fp8 directory whose tensors are split over two files and an index."""
    directory = exported(directory, "deepseek-fp8", qshard.Fp8BlockwiseConfig())
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    (directory / "model.safetensors").unlink()
    first = {k: v for k, v in tensors.items() if k.startswith("0.")}
    second = {k: v for k, v in tensors.items() if not k.startswith("0.")}
    save_file(first, str(directory / "a.safetensors"))
    save_file(second, str(directory / "b.safetensors"))
    weight_map = {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(second, "b.safetensors")}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return directory


def test_index_entries_outside_the_directory_are_refused(tmp_path):
    directory = sharded_foreign(tmp_path / "model")
    qshard.load_pretrained(directory)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(directory / "b.safetensors", outside)
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for target in ("../outside.safetensors", str(outside)):
        index["weight_map"]["2.weight"] = target
        index_path.write_text(json.dumps(index))
        with pytest.raises(CheckpointError, match="file names in the index's directory"):
            qshard.load_pretrained(directory)


def test_a_tensor_in_two_files_is_refused(tmp_path):
    directory = sharded_foreign(tmp_path / "model")
    (directory / "model.safetensors.index.json").unlink()
    qshard.load_pretrained(directory)  # no index: every *.safetensors, no key twice
    save_file({"2.weight": torch.zeros(256, 384)}, str(directory / "c.safetensors"))
    with pytest.raises(CheckpointError, match=r"'2.weight' is in both"):
        qshard.load_pretrained(directory)


def test_an_index_must_list_what_each_file_holds(tmp_path):
    directory = sharded_foreign(tmp_path / "model")
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"]["2.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="the index lists other tensors"):
        qshard.load_pretrained(directory)


def test_a_corrupt_safetensors_file_in_a_foreign_directory_is_a_checkpoint_error(tmp_path):
    directory = exported(tmp_path / "ds", "deepseek-fp8", qshard.Fp8BlockwiseConfig())
    path = directory / "model.safetensors"
    data = path.read_bytes()
    for damaged in (data[:-7], data[:20], b"\xff" * 8 + data[8:], data + b"x"):
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError):
            qshard.load_pretrained(directory)


# ---- JSON bombs -----------------------------------------------------------------------------

BOMBS = ["[" * 100_000, '{"a":' * 100_000, "1" * 5000]


@pytest.mark.parametrize("bomb", BOMBS, ids=["list-nesting", "object-nesting", "5000-digits"])
def test_json_bombs_are_checkpoint_errors_in_every_json_a_reader_parses(tmp_path, bomb):
    # config.json and hf_quant_config.json of a foreign directory
    directory = exported(tmp_path / "mo", "modelopt-nvfp4", qshard.NVFP4WeightOnlyConfig())
    for name in ("config.json", "hf_quant_config.json"):
        original = (directory / name).read_text()
        (directory / name).write_text(bomb)
        with pytest.raises(CheckpointError, match=name):
            qshard.load_pretrained(directory)
        (directory / name).write_text(original)
    # qshard's own: the safetensors header, the qshard metadata, the index
    model = nn.Sequential(nn.Linear(64, 64))
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(block_size=(32, 32)))
    qshard.save(model, tmp_path / "q", max_shard_size=5000)
    index_path = tmp_path / "q" / "model.safetensors.index.json"
    index_path.write_text(bomb)
    with pytest.raises(CheckpointError, match=r"index.json"):
        qshard.load(tmp_path / "q")
    qshard.save(model, tmp_path / "one")
    path = tmp_path / "one" / "model.safetensors"
    tensors = {
        k: v.contiguous() for k, v in qshard.load(path).items() if not isinstance(v, qshard.QTensor)
    }
    with open(path, "wb") as f:
        save_module._write_safetensors(tensors, {METADATA_KEY: bomb, CRC_KEY: crc_text(bomb)}, f)
    with pytest.raises(CheckpointError, match="qshard header metadata"):
        qshard.load(path)
    header = b'{"a":' + bomb.encode() + b"}"
    path.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match="safetensors header"):
        qshard.load(path)


# ---- attributes and dtypes --------------------------------------------------------------------


@pytest.mark.parametrize("block", [[2**100, 128], [0, 128], [-128, 128], [100, 100], [8, 8]])
def test_attributes_beyond_their_bounds_are_refused(tmp_path, block):
    model = nn.Sequential(nn.Linear(64, 64, bias=False))
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(block_size=(32, 32)))
    qshard.save(model, tmp_path)
    path = tmp_path / "model.safetensors"

    def change(data):
        data["entries"]["0.weight"]["attrs"]["block_size"] = block

    edit_metadata(path, change)
    with pytest.raises(CheckpointError, match="block_size"):
        qshard.load(path)


def test_a_quantized_checkpoint_into_a_float64_model_is_refused(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64))
    qshard.quantize_(model, qshard.Int4WeightOnlyConfig(32))
    qshard.save(model, tmp_path)
    target = nn.Sequential(nn.Linear(64, 64)).double()
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"float64.*quantized weights stand for one of"):
        qshard.load(tmp_path, target)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


# ---- sliced reads verify every byte they read --------------------------------------------------


def flip_byte(path: pathlib.Path, key: str, at: int) -> None:
    header = read_header(path)
    with open(path, "r+b") as f:
        f.seek(header.offsets[key] + at)
        byte = f.read(1)[0]
        f.seek(header.offsets[key] + at)
        f.write(bytes([byte ^ 0x40]))


@pytest.fixture
def big_checkpoint(tmp_path) -> pathlib.Path:
    """One FP8 weight of 4 MiB of codes (4 checksum chunks), saved."""
    model = nn.Sequential(nn.Linear(1024, 4096, bias=False))
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    qshard.save(model, tmp_path)
    return tmp_path


@pytest.mark.parametrize("dim", [0, 1])
def test_a_sliced_read_refuses_a_flipped_byte_in_what_it_reads(big_checkpoint, dim):
    path = big_checkpoint / "model.safetensors"
    with Checkpoint(big_checkpoint) as checkpoint:
        whole = checkpoint.read("0.weight")
        parts = [checkpoint.read_shard("0.weight", dim, 2, rank) for rank in (0, 1)]
    assert torch.equal(torch.cat([p.dequantize() for p in parts], dim), whole.dequantize())
    flip_byte(path, "0.weight.qdata", 4096 * 1024 - 5)  # in the last row (rank 1's rows)
    with Checkpoint(big_checkpoint) as checkpoint:
        with pytest.raises(CheckpointError, match="does not match the checksum of its bytes"):
            checkpoint.read_shard("0.weight", dim, 2, 1)
        if dim == 0:  # rank 0 reads rows 0..2047 only: four 1 MiB chunks, none flipped
            assert_same_qtensor(checkpoint.read_shard("0.weight", 0, 2, 0), parts[0])
        else:  # a column shard reads every row, so every chunk
            with pytest.raises(CheckpointError, match="checksum"):
                checkpoint.read_shard("0.weight", 1, 2, 0)


def test_a_sliced_read_of_a_file_without_chunk_checksums_verifies_the_whole_tensor(
    big_checkpoint,
):
    """Files written before the chunk checksums still load sliced, verified by the tensor's."""
    path = big_checkpoint / "model.safetensors"

    def strip(data):
        for record in data["entries"].values():
            for stored in record.get("inner", {}).values():
                stored.pop("chunk_bytes"), stored.pop("chunk_crc32")

    edit_metadata(path, strip)
    with Checkpoint(big_checkpoint) as checkpoint:
        part = checkpoint.read_shard("0.weight", 0, 2, 0)
        assert_same_qtensor(part, checkpoint.read("0.weight")[:2048])
    flip_byte(path, "0.weight.qdata", 4096 * 1024 - 5)  # outside rank 0's rows
    match = "does not match its checksum"
    with Checkpoint(big_checkpoint) as checkpoint, pytest.raises(CheckpointError, match=match):
        checkpoint.read_shard("0.weight", 0, 2, 0)


@pytest.mark.parametrize("shape", [(5,), (7, 3), (4, 6, 5), (3, 0), (0, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_sliced_reads_equal_narrow_across_chunks_and_steps(tmp_path, monkeypatch, shape, dtype):
    """Tiny checksum chunks (7 bytes) and read steps (13 bytes) so that every slice crosses
    chunk and step boundaries: plain tensors of any rank, every dim, every rank of 1..4."""
    import qshard.io.checkpoint as checkpoint_module

    monkeypatch.setattr(save_module, "CHUNK_BYTES", 7)
    monkeypatch.setattr(checkpoint_module, "SLICE_STEP_BYTES", 13)
    value = (torch.arange(max(1, torch.Size(shape).numel())) % 251)[: torch.Size(shape).numel()]
    value = value.reshape(shape).to(dtype)
    qshard.save({"t": value}, tmp_path)
    with Checkpoint(tmp_path) as checkpoint:
        assert checkpoint.record("t").tensor.chunk_bytes == 7
        for dim in range(len(shape)):
            for world in range(1, 5):
                parts = [checkpoint.read_shard("t", dim, world, r) for r in range(world)]
                expected = torch.chunk(value, world, dim) if shape[dim] else ()
                for rank, part in enumerate(parts):
                    if rank < len(expected):
                        assert torch.equal(part, expected[rank]), (dim, world, rank)
                    else:
                        assert part.numel() == 0


def _edit_header(path: pathlib.Path, change) -> None:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])


def test_a_lone_surrogate_in_the_qshard_metadata_is_a_checkpoint_error(tmp_path):
    """Found by tests/io/test_fuzz_readers.py: a JSON "\\udcff" escape cannot be encoded to
    UTF-8 for the checksum (a raw UnicodeEncodeError before)."""
    qshard.save({"w": torch.randn(4)}, tmp_path)

    def change(header):
        header["__metadata__"][METADATA_KEY] += "\udcff"

    _edit_header(tmp_path / "model.safetensors", change)
    with pytest.raises(CheckpointError, match="checksum"):
        qshard.load(tmp_path)


def test_a_qshard_file_without_its_metadata_does_not_load_raw_codes(tmp_path):
    """Found by the fuzz test: with the header's metadata removed, the file read as a plain one
    gave the codes and scales back as plain tensors."""
    qshard.save({"w": qshard.Nvfp4Tensor.from_float(torch.randn(64, 64))}, tmp_path)
    _edit_header(tmp_path / "model.safetensors", lambda header: header.pop("__metadata__"))
    with pytest.raises(CheckpointError, match="inner tensors of a quantized Nvfp4Tensor"):
        qshard.load(tmp_path)


@pytest.mark.parametrize("dtype", ["float64", "int8", "float16 ", 16])
def test_a_torch_dtype_qshard_cannot_stand_for_is_refused(tmp_path, dtype):
    directory = exported(tmp_path / "ds", "deepseek-fp8", qshard.Fp8BlockwiseConfig())
    config = json.loads((directory / "config.json").read_text())
    config["torch_dtype"] = dtype
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="torch_dtype"):
        qshard.load_pretrained(directory)
