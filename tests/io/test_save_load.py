"""qshard.save / qshard.load on one process: round trips for every registered layout (invariant
5), sharded files, meta-device loading, tied weights, atomic writes, and every kind of bad input
raising QShardError with the model left as it was."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import zlib
from unittest import mock

import pytest
import torch
from helpers import LAYOUT_CASES, LAYOUT_IDS, assert_same_qtensor
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import qshard
from qshard import CheckpointError, QShardError
from qshard.io import saving as save_module
from qshard.io.format import CRC_KEY, METADATA_KEY

cases = pytest.mark.parametrize(("cls", "config"), LAYOUT_CASES, ids=LAYOUT_IDS)


class Model(nn.Module):
    """Odd shapes (partial edge blocks), a bias, a norm and an unquantized embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 160)
        self.up = nn.Linear(160, 336)
        self.down = nn.Linear(336, 96, bias=False)
        self.norm = nn.LayerNorm(96)

    def forward(self, tokens):
        return self.norm(self.down(torch.relu(self.up(self.embed(tokens)))))


def quantized_model(config, seed: int | None = None) -> Model:
    if seed is not None:
        torch.manual_seed(seed)
    model = Model()
    qshard.quantize_(model, config)
    return model


def meta_model() -> Model:
    with torch.device("meta"):
        return Model()


def assert_same_state(loaded, expected) -> None:
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        if isinstance(value, qshard.QTensor):
            assert_same_qtensor(loaded[key], value)
        else:
            assert type(loaded[key]) is torch.Tensor
            assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key


TOKENS = torch.tensor([[1, 7, 49, 3, 0]])


# ---- round trips ---------------------------------------------------------------------------


@cases
@pytest.mark.parametrize("max_shard_size", ["5GB", 40_000], ids=["one-file", "sharded"])
def test_round_trip_is_exact(cls, config, max_shard_size, tmp_path):
    model = quantized_model(config)
    written = qshard.save(model, tmp_path, max_shard_size=max_shard_size)
    names = sorted(p.name for p in written)
    if max_shard_size == "5GB":
        assert names == ["model.safetensors", "quantization_config.json"]
    else:
        assert "model.safetensors.index.json" in names and len(names) > 3
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        inner = {f"{w}.weight.{name}" for w in ("up", "down") for name in cls.inner_names}
        plain = {"embed.weight", "up.bias", "norm.weight", "norm.bias"}
        assert set(index["weight_map"]) == inner | plain
    state = qshard.load(tmp_path)
    assert_same_state(state, model.state_dict())
    assert isinstance(state["up.weight"], cls)
    loaded = qshard.load(tmp_path, meta_model())
    assert torch.equal(loaded(TOKENS), model(TOKENS))
    assert not loaded.up.weight.requires_grad and loaded.up.bias.requires_grad


@cases
def test_torch_save_and_weights_only_load_into_a_meta_model(cls, config, tmp_path):
    model = quantized_model(config)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert_same_state(state, model.state_dict())
    loaded = meta_model()
    loaded.load_state_dict(state, assign=True)
    qshard.repack_for_device(loaded)  # device forms (int4 tinygemm) are never pickled
    assert isinstance(loaded.up.weight, cls) and torch.equal(loaded(TOKENS), model(TOKENS))


def test_files_are_plain_safetensors_with_typed_metadata(tmp_path):
    model = quantized_model(qshard.Fp8BlockwiseConfig(block_size=(64, 32), scale_format="ue8m0"))
    qshard.save(model, tmp_path)
    plain = load_file(tmp_path / "model.safetensors")  # any safetensors reader can read it
    assert plain["up.weight.qdata"].dtype == torch.float8_e4m3fn
    assert torch.equal(plain["up.weight.scale"], model.up.weight.scale)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pt"
    assert metadata[CRC_KEY] == f"{zlib.crc32(metadata[METADATA_KEY].encode()):08x}"
    header = json.loads(metadata[METADATA_KEY])
    assert header["format_version"] == qshard.io.FORMAT_VERSION
    record = header["entries"]["up.weight"]
    assert record["layout"] == "Fp8BlockwiseTensor" and record["shape"] == [336, 160]
    assert record["attrs"]["block_size"] == [64, 32] and record["attrs"]["scale_format"] == "ue8m0"
    assert record["config"] == model.up.weight.config().to_dict()
    assert record["inner"]["scale"]["shape"] == [6, 5]  # ceil(336/64), ceil(160/32)
    config = json.loads((tmp_path / "quantization_config.json").read_text())
    (group,) = config["config_groups"].values()
    assert qshard.config_from_dict(group["config"]) == model.up.weight.config()
    assert group["targets"] == ["up.weight", "down.weight"]


def test_transposed_views_tied_weights_and_empty_tensors(tmp_path):
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(96, 160))
    shared = torch.randn(50, 160)
    state = {
        "w": weight,
        "w_t": weight.t(),  # a different view of the same data: stored separately
        "w_again": weight.detach(),  # the same view of the same data: an alias
        "embed.weight": shared,
        "lm_head.weight": shared,
        "empty": torch.empty(0, 4),
        "row_slice": shared[10:20],  # shares storage with `shared`, saved as its own tensor
    }
    qshard.save(state, tmp_path)
    loaded = qshard.load(tmp_path)
    assert loaded["w_t"].transposed
    assert torch.equal(loaded["w_t"].dequantize(), weight.dequantize().t())
    assert loaded["w_again"] is loaded["w"] and loaded["lm_head.weight"] is loaded["embed.weight"]
    assert_same_qtensor(loaded["w"], weight)
    assert torch.equal(loaded["row_slice"], shared[10:20]) and loaded["empty"].shape == (0, 4)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    assert "lm_head.weight" not in stored and "w_again.qdata" not in stored


def test_tied_parameters_stay_tied_in_the_model(tmp_path):
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 128)
            self.body = nn.Linear(128, 128)
            self.lm_head = nn.Linear(128, 64, bias=False)
            self.lm_head.weight = self.embed.weight

    model = Tied()
    report = qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    assert [skipped.name for skipped in report.skipped] == ["lm_head"]  # shared with the embedding
    qshard.save(model, tmp_path)
    with torch.device("meta"):
        fresh = Tied()
    qshard.load(tmp_path, fresh)
    assert fresh.lm_head.weight is fresh.embed.weight
    assert torch.equal(fresh.lm_head.weight, model.embed.weight)


def test_saving_again_replaces_the_files_of_the_previous_save(tmp_path):
    model = quantized_model(qshard.Fp8BlockwiseConfig())
    qshard.save(model, tmp_path, max_shard_size=40_000)
    (tmp_path / "notes.txt").write_text("mine")
    qshard.save(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.safetensors",
        "notes.txt",
        "quantization_config.json",
    ]
    assert_same_state(qshard.load(tmp_path), model.state_dict())
    qshard.save(model, tmp_path, max_shard_size=40_000)
    assert not (tmp_path / "model.safetensors").exists()
    assert_same_state(qshard.load(tmp_path / "model.safetensors.index.json"), model.state_dict())


def test_max_shard_size_accepts_bytes_and_units():
    assert save_module.parse_size(123) == 123
    assert save_module.parse_size("5GB") == 5 * 10**9
    assert save_module.parse_size("500MiB") == 500 * 2**20
    assert save_module.parse_size("1.5 kb") == 1500
    for bad in ("5 parsecs", "", -1, 0, "0GB", True):
        with pytest.raises(QShardError, match="max_shard_size"):
            save_module.parse_size(bad)


# ---- atomic writes -------------------------------------------------------------------------


def test_a_failing_write_leaves_the_previous_checkpoint_and_no_temporary_file(
    tmp_path, monkeypatch
):
    model = quantized_model(qshard.Fp8BlockwiseConfig(), seed=0)
    qshard.save(model, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    real = save_module._write_safetensors

    def fail_halfway(tensors, metadata, f):
        real(tensors, metadata, f)
        f.truncate(f.tell() // 2)
        raise OSError("disk full")

    monkeypatch.setattr(save_module, "_write_safetensors", fail_halfway)
    with pytest.raises(OSError, match="disk full"):
        qshard.save(quantized_model(qshard.Fp8BlockwiseConfig(), seed=1), tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.safetensors",
        "quantization_config.json",
    ]


KILL_MID_WRITE = """
import os, signal, sys, torch, qshard
from qshard.io import saving as save_module
real = save_module._write_safetensors
def killed(tensors, metadata, f):
    real(tensors, metadata, f)
    f.flush()
    f.truncate(f.tell() // 2)
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no exception handler, no cleanup
save_module._write_safetensors = killed
model = torch.nn.Linear(256, 256)
qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
qshard.save(model, sys.argv[1])
"""


def test_a_crash_mid_save_never_leaves_a_partial_file_under_the_final_name(tmp_path):
    run = subprocess.run([sys.executable, "-c", KILL_MID_WRITE, str(tmp_path)], timeout=120)
    assert run.returncode == -signal.SIGKILL
    assert not (tmp_path / "model.safetensors").exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert all(name.startswith(".model.safetensors.") for name in leftovers), leftovers


# ---- bad input: save -----------------------------------------------------------------------


def test_save_refuses_what_it_cannot_store(tmp_path):
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(64, 64))

    class Unregistered(qshard.Fp8BlockwiseTensor):
        pass

    stray = Unregistered(
        weight.inner_tensors(), shape=(64, 64), dtype=torch.float32, **weight.attrs()
    )
    bad_states = [
        ({"w": stray}, "not a registered layout"),
        ({"w": torch.empty(4, 4, device="meta")}, "meta device"),
        ({"w": [1, 2]}, "maps names"),
        ({"w": torch.zeros(2, dtype=torch.complex64)}, "safetensors cannot store"),
        ({"w": weight, "w.qdata": torch.zeros(1)}, "would both be stored as 'w.qdata'"),
    ]
    for state, message in bad_states:
        with pytest.raises(QShardError, match=message):
            qshard.save(state, tmp_path / "out")
        assert not (tmp_path / "out" / "model.safetensors").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(QShardError, match="is a file"):
        qshard.save({"w": weight}, tmp_path / "file")


# ---- bad input: load -----------------------------------------------------------------------


def rewrite_metadata(path: pathlib.Path, edit) -> None:
    """Re-write a qshard file with `edit(header dict)` applied and a valid checksum, as a
    buggy or malicious writer would."""
    with safe_open(path, "pt") as f:
        metadata, tensors = f.metadata(), {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    header = json.loads(metadata[METADATA_KEY])
    edit(header)
    text = json.dumps(header)
    metadata = {**metadata, METADATA_KEY: text, CRC_KEY: f"{zlib.crc32(text.encode()):08x}"}
    with open(path, "wb") as f:
        save_module._write_safetensors(tensors, metadata, f)


def snapshot(model: nn.Module) -> dict:
    return {k: (id(v), v.device) for k, v in model.state_dict(keep_vars=True).items()}


def saved(tmp_path: pathlib.Path, state=None, invalid: bool = False) -> pathlib.Path:
    """A checkpoint of `state` (a small quantized model by default). `invalid`: the state holds
    a QTensor that qshard.save refuses (asserted); it is then written with that check switched
    off, as a damaged file or another writer would leave it, for the reader's checks to see."""
    model = quantized_model(qshard.Fp8BlockwiseConfig(), seed=0)
    if not invalid:
        qshard.save(state if state is not None else model, tmp_path)
        return tmp_path / "model.safetensors"
    with pytest.raises(QShardError, match=r"qshard\.save: 'up\.weight'"):
        qshard.save(state, tmp_path / "refused")
    assert not (tmp_path / "refused").exists(), "a refused save wrote files"
    with mock.patch.object(save_module, "check_qtensor", lambda *args: None):
        qshard.save(state, tmp_path)
    return tmp_path / "model.safetensors"


def expect_load_error(path, match: str, file_is_bad: bool = True) -> None:
    """Loading into a model raises and leaves the model as it was; so does loading the
    state_dict alone when the file itself is bad."""
    model = meta_model()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=match):
        qshard.load(path, model)
    assert snapshot(model) == before, "a failed load changed the model"
    if file_is_bad:
        with pytest.raises(CheckpointError, match=match):
            qshard.load(path)


def test_missing_unexpected_and_misshapen_keys(tmp_path):
    state = quantized_model(qshard.Fp8BlockwiseConfig()).state_dict()
    path = tmp_path / "model.safetensors"
    qshard.save(
        {k: v for k, v in state.items() if k != "norm.bias"} | {"extra": state["up.bias"]}, tmp_path
    )
    model = meta_model()
    before = snapshot(model)
    with pytest.raises(CheckpointError, match=r"missing keys \['norm.bias'\].*unexpected.*extra"):
        qshard.load(path, model)
    assert snapshot(model) == before
    # strict=False loads what both have, but not into a meta model it would leave half meta.
    with pytest.raises(CheckpointError, match=r"meta device.*: norm\.bias\."):
        qshard.load(tmp_path, model, strict=False)
    assert snapshot(model) == before
    real = quantized_model(qshard.Fp8BlockwiseConfig())
    with pytest.warns(UserWarning, match="missing keys"):
        qshard.load(tmp_path, real, strict=False)
    assert not real.norm.bias.is_meta and isinstance(real.up.weight, qshard.Fp8BlockwiseTensor)
    qshard.save(state | {"up.bias": torch.zeros(5)}, tmp_path)
    expect_load_error(
        tmp_path, r"'up.bias' is \[5\] in the checkpoint and \[336\] in the model", False
    )


def test_inner_tensors_that_do_not_fit_the_layout(tmp_path):
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(336, 160))
    for bad_scale, needs in [
        (torch.ones(2, 2), r"'scale' is float32\[2, 2\].*needs float32\[3, 2\]"),
        (weight.scale.half(), r"'scale' is float16\[3, 2\].*needs float32"),
    ]:
        bad = weight.with_changes({"scale": bad_scale})
        path = saved(tmp_path, {"up.weight": bad}, invalid=True)
        with pytest.raises(CheckpointError, match=needs):
            qshard.load(path)
    bad_qdata = weight.with_changes({"qdata": weight.qdata.view(torch.uint8)})
    with pytest.raises(CheckpointError, match=r"'qdata' is uint8"):
        qshard.load(saved(tmp_path, {"up.weight": bad_qdata}, invalid=True))


@pytest.mark.parametrize(
    ("inner", "value"),
    [("scale", float("nan")), ("scale", float("inf")), ("qdata", float("nan"))],
)  # e4m3fn has no Inf (a cast saturates to 448): its only non-finite value is NaN
def test_non_finite_quantized_values_are_refused(tmp_path, inner, value):
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(336, 160))
    tensor = getattr(weight, inner).float().clone()
    tensor[2, 1] = value
    bad = weight.with_changes({inner: tensor.to(getattr(weight, inner).dtype)})
    model = quantized_model(qshard.Fp8BlockwiseConfig())
    path = saved(tmp_path, model.state_dict() | {"up.weight": bad}, invalid=True)
    inner_text = rf"inner tensor {inner!r} holds 1 NaN/Inf values \(first at \[2, 1\]\)"
    expect_load_error(path, rf"up.weight: .*{inner_text}")


def test_damaged_files(tmp_path):
    path = saved(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    expect_load_error(path, "truncated")
    path.write_bytes(data[:5])
    expect_load_error(path, "truncated or not safetensors")
    damaged = bytearray(data)
    damaged[-10] ^= 0xFF  # a byte of the last tensor
    path.write_bytes(bytes(damaged))
    expect_load_error(path, "'[^']+' does not match its checksum")
    damaged = bytearray(data)
    damaged[data.index(b"save_id") + 20] ^= 0x01  # inside the qshard metadata text
    path.write_bytes(bytes(damaged))
    expect_load_error(path, "does not match its checksum|not JSON")
    path.write_text("not safetensors at all")
    expect_load_error(path, "truncated or not safetensors")
    expect_load_error(tmp_path / "nowhere", "no such checkpoint")


def test_header_metadata_that_does_not_parse_or_is_not_understood(tmp_path):
    path = saved(tmp_path)
    edits = {
        "newer format version": (lambda h: h.update(format_version=99), "upgrade qshard"),
        "unknown layout": (
            lambda h: h["entries"]["up.weight"].update(layout="Int3Tensor"),
            "'Int3Tensor' is not registered",
        ),
        "bad attribute": (
            lambda h: h["entries"]["up.weight"]["attrs"].update(block_size=[128, 100]),
            "attributes .* are invalid",
        ),
        "attribute of the wrong type": (
            lambda h: h["entries"]["up.weight"]["attrs"].update(weight_only="no"),
            "weight_only.* is not a bool",
        ),
        "unknown enum value": (
            lambda h: h["entries"]["up.weight"]["attrs"].update(scale_format="e5m3"),
            r"'e5m3' is not one of \['fp32', 'ue8m0'\]",
        ),
        "shape that does not fit": (
            lambda h: h["entries"]["up.weight"].update(shape=[336, 170]),
            "needs float8_e4m3fn",
        ),
        "alias of nothing": (
            lambda h: h["entries"].update({"x": {"kind": "alias", "of": "nothing"}}),
            "alias of 'nothing'",
        ),
        "entry missing": (lambda h: h["entries"].pop("norm.bias"), "described by no"),
        "outer dtype not a float": (
            lambda h: h["entries"]["up.weight"].update(dtype="int64"),
            "stands for a torch.int64",
        ),
    }
    original = path.read_bytes()
    for name, (edit, message) in edits.items():
        path.write_bytes(original)
        rewrite_metadata(path, edit)
        with pytest.raises(CheckpointError, match=message):
            qshard.load(path)
            pytest.fail(f"{name}: loaded")
    path.write_bytes(original)
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}  # noqa: SIM118
    with open(path, "wb") as f:
        metadata = {METADATA_KEY: "{", CRC_KEY: f"{zlib.crc32(b'{'):08x}"}
        save_module._write_safetensors(tensors, metadata, f)
    with pytest.raises(CheckpointError, match="not JSON"):
        qshard.load(path)


def test_sharded_checkpoint_with_a_missing_or_foreign_shard(tmp_path):
    model = quantized_model(qshard.Fp8BlockwiseConfig(), seed=0)
    qshard.save(model, tmp_path / "a", max_shard_size=40_000)
    qshard.save(
        quantized_model(qshard.Fp8BlockwiseConfig(), seed=1), tmp_path / "b", max_shard_size=40_000
    )
    shards = sorted((tmp_path / "a").glob("model-*.safetensors"))
    os.replace(tmp_path / "b" / shards[0].name, shards[0])  # another save's shard
    expect_load_error(tmp_path / "a", "the index and the shards are from different saves")
    shards[0].unlink()
    expect_load_error(tmp_path / "a", "listed in the index are missing")


def test_load_argument_errors(tmp_path):
    path = saved(tmp_path)
    with pytest.raises(QShardError, match="both mesh and plan"):
        qshard.load(path, meta_model(), plan={"up": "colwise"})
    (tmp_path / "other.safetensors").write_bytes(path.read_bytes())
    path.unlink()
    (tmp_path / "third.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"2 other \.safetensors files"):
        qshard.load(tmp_path)


def write_raw(path: pathlib.Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)


def test_malformed_safetensors_headers(tmp_path):
    path = tmp_path / "model.safetensors"
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    for bad, message in [
        ({**entry, "dtype": ["F32"]}, "dtype .* is not one of"),
        ({**entry, "dtype": "F128"}, "dtype 'F128' is not one of"),
        ({**entry, "shape": [2**40, 2**40, 0]}, "too large"),
        ({**entry, "shape": [-2]}, "invalid"),
        ({**entry, "data_offsets": [0, 4]}, "hold 4 bytes"),
        ({**entry, "data_offsets": [8, 16]}, "starts at data byte 8"),
    ]:
        write_raw(path, {"x": bad}, bytes(8))
        with pytest.raises(CheckpointError, match=message):
            qshard.load(path)
    write_raw(path, {"x": entry}, bytes(8))
    assert torch.equal(qshard.load(path)["x"], torch.zeros(2))  # a plain safetensors file loads


def test_tensors_are_aligned_to_their_element_size(tmp_path):
    """Widest elements first, as safetensors' own writer does, so a reader can view in place."""
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(72, 40))
    qshard.save(
        {"flag": torch.ones(3, dtype=torch.bool), "w": weight, "i": torch.ones(3).long()}, tmp_path
    )
    data = (tmp_path / "model.safetensors").read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    assert start % 8 == 0
    header = json.loads(data[8:start])
    sizes = {"BOOL": 1, "F8_E4M3": 1, "F32": 4, "I64": 8}
    for key, info in header.items():
        if key != "__metadata__":
            assert (start + info["data_offsets"][0]) % sizes[info["dtype"]] == 0, key


def test_one_shard_without_its_index_is_refused(tmp_path):
    model = quantized_model(qshard.Fp8BlockwiseConfig())
    qshard.save(model, tmp_path, max_shard_size=40_000)
    for path in sorted(tmp_path.glob("model-*.safetensors"))[1:]:
        path.unlink()
    (tmp_path / "model.safetensors.index.json").unlink()  # as after a crash mid-save
    expect_load_error(tmp_path, "one shard of .* without its model.safetensors.index.json")


def test_an_unregistered_layout_is_refused_before_any_file_is_written(tmp_path):
    weight = qshard.Fp8BlockwiseTensor.from_float(torch.randn(64, 64))

    class Unregistered(qshard.Fp8BlockwiseTensor):
        pass

    stray = Unregistered(
        weight.inner_tensors(), shape=(64, 64), dtype=torch.float32, **weight.attrs()
    )
    with pytest.raises(QShardError, match="not a registered layout"):
        qshard.save({"a": weight, "b": stray}, tmp_path / "out", max_shard_size=1)
    assert not (tmp_path / "out").exists()
    with pytest.raises(QShardError, match="__metadata__"):
        qshard.save({"__metadata__": torch.zeros(1)}, tmp_path / "out")


def test_dtypes_follow_the_model_and_non_float_mismatches_are_refused(tmp_path):
    model = quantized_model(qshard.Fp8BlockwiseConfig())
    qshard.save(model, tmp_path)
    with torch.device("meta"):
        bf16 = Model().to(torch.bfloat16)
    qshard.load(tmp_path, bf16)
    assert bf16.up.weight.dtype == torch.bfloat16 and bf16.up.bias.dtype == torch.bfloat16
    assert_same_qtensor(bf16.up.weight.to(torch.float32), model.up.weight)  # same packed data
    qshard.save(model.state_dict() | {"up.bias": torch.arange(336, dtype=torch.int32)}, tmp_path)
    expect_load_error(
        tmp_path, "'up.bias' is torch.int32 in the checkpoint and torch.float32", file_is_bad=False
    )


def test_sliced_reads_are_copies_not_views_of_the_file(tmp_path):
    state = {"w": torch.randn(6, 4), "q": qshard.Fp8BlockwiseTensor.from_float(torch.randn(64, 64))}
    qshard.save(state, tmp_path)
    with qshard.io.Checkpoint(tmp_path) as checkpoint:
        rows = checkpoint.read_shard("w", 0, 2, 1)
        cols = checkpoint.read_shard("w", 1, 2, 0)
    (tmp_path / "model.safetensors").write_bytes(b"")  # the file changes under the tensors
    assert torch.equal(rows, state["w"][3:]) and torch.equal(cols, state["w"][:, :2])


@pytest.mark.parametrize(
    "fmt,config",
    [
        ("fbgemm-fp8", qshard.Fp8RowwiseConfig()),
        ("deepseek-fp8", qshard.Fp8BlockwiseConfig((64, 64))),
    ],
)
def test_another_formats_fp8_codes_never_load_as_float_weights(tmp_path, fmt, config):
    """An FP8 checkpoint of another format holds `weight` as e4m3 codes beside its scales:
    qshard.load refuses to cast them into a float model's weights, strict or not (read as
    floats they are the codes, up to 448), and names load_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1)
    sizes |= dict(num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    qshard.quantize_(model, config)
    qshard.export(model, tmp_path / "out", format=fmt)
    fresh = LlamaForCausalLM(LlamaConfig(**sizes)).eval()
    before = snapshot(fresh)
    for strict in (True, False):
        with pytest.raises(CheckpointError, match=r"float8_e4m3fn tensor.*load_pretrained"):
            qshard.load(tmp_path / "out", fresh, strict=strict)
        assert snapshot(fresh) == before
