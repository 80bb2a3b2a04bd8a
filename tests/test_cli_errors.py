"""The `qshard` command on bad input (issue 21, problems 3, 8, 17 and 19): one line,
`qshard: error: ...`, on stderr and a non-zero exit (2 for usage, 1 otherwise, 130 when
interrupted), never a traceback unless `--debug`; and nothing written or deleted."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

import qshard
import qshard.cli.quantize
from qshard_cli import main


def float_model(directory: pathlib.Path, shards: int = 1, extra=None) -> pathlib.Path:
    """A tiny Hugging Face-style float model: config.json and one or `shards` safetensors
    files (with an index), two 2-D linear weights and a norm."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tensors = {
        "layers.0.q_proj.weight": torch.randn(64, 128, dtype=torch.bfloat16),
        "layers.0.up_proj.weight": torch.randn(64, 128, dtype=torch.bfloat16),
        "norm.weight": torch.ones(128, dtype=torch.bfloat16),
        **(extra or {}),
    }
    if shards == 1:
        save_file(tensors, str(directory / "model.safetensors"))
        return directory
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        save_file(part, str(directory / file))
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def snapshot(root: pathlib.Path) -> dict[str, bytes]:
    """Every file under `root` (symlinks not followed) and its bytes."""
    files = {}
    for parent, _, names in os.walk(root):
        for name in names:
            path = pathlib.Path(parent, name)
            files[str(path.relative_to(root))] = b"" if path.is_symlink() else path.read_bytes()
    return files


def error_line(capsys, after_progress: bool = False) -> str:
    """The one line the command printed on stderr (after the progress bar's line, if it got
    that far), and nothing on stdout."""
    captured = capsys.readouterr()
    err = captured.err.split("\n", 1)[1] if after_progress else captured.err
    assert err.startswith("qshard: error: ") and captured.out == "", captured
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def quantize(model, out, *extra) -> int:
    return main(["quantize", str(model), "--config", "fp8-row", "--out", str(out), *extra])


def test_a_tiny_model_quantizes(tmp_path, capsys):
    model = float_model(tmp_path / "m", shards=2)
    assert quantize(model, tmp_path / "q") == 0
    out = capsys.readouterr().out
    assert "2 weights quantized (fp8-row, by name and shape (config.json names no " in out
    assert "), 1 tensors kept" in out
    assert isinstance(qshard.load(tmp_path / "q")["layers.0.q_proj.weight"], qshard.QTensor)
    assert quantize(model, tmp_path / "q") == 0  # a qshard checkpoint's directory: rewritten


# ---- problem 3: an --out that is, contains or lies inside the input -------------------------


@pytest.mark.parametrize("where", ["same", "symlink", "dot-dot", "inside", "contains"])
def test_quantize_refuses_an_out_that_overlaps_the_input(tmp_path, capsys, where):
    model = float_model(tmp_path / "m", shards=2)
    (tmp_path / "link").symlink_to(model, target_is_directory=True)
    out = {
        "same": model,
        "symlink": tmp_path / "link",
        "dot-dot": model / "sub" / ".." / ".." / "m",  # "sub" does not exist
        "inside": tmp_path / "link" / "q",
        "contains": tmp_path,
    }[where]
    before = snapshot(tmp_path)
    assert quantize(model, out) == 1
    assert "--out" in error_line(capsys)
    assert snapshot(tmp_path) == before  # the float shards and index are still there


# ---- problem 8: a checkpoint that is quantized already ------------------------------------


def qshard_checkpoint(directory: pathlib.Path, keep_config: bool = True) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(128, 64))
    qshard.quantize_(model, qshard.Fp8RowwiseConfig())
    qshard.save(model, directory)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if not keep_config:  # only the safetensors headers say it is qshard's
        (directory / "quantization_config.json").unlink()


QUANTIZED = {
    "qshard": lambda d: qshard_checkpoint(d),
    "qshard-headers": lambda d: qshard_checkpoint(d, keep_config=False),
    "config.json": lambda d: (d / "config.json").write_text(
        json.dumps({"quantization_config": {"quant_method": "fp8"}})
    ),
    "hf_quant_config": lambda d: (d / "hf_quant_config.json").write_text(
        json.dumps({"quantization": {"quant_algo": "NVFP4"}})
    ),
    "float8": lambda d: save_file(
        {"a.weight": torch.zeros(64, 128, dtype=torch.float8_e4m3fn)}, str(d / "x.safetensors")
    ),
    "weight_scale_inv": lambda d: save_file(
        {"a.weight_scale_inv": torch.ones(1, 1)}, str(d / "x.safetensors")
    ),
    "blocks": lambda d: save_file(
        {"experts.down_proj_blocks": torch.zeros(4, 4, dtype=torch.uint8)},
        str(d / "x.safetensors"),
    ),
}


@pytest.mark.parametrize("kind", sorted(QUANTIZED))
def test_quantize_refuses_a_checkpoint_that_is_quantized_already(tmp_path, capsys, kind):
    model = tmp_path / "m"
    if kind.startswith("qshard"):
        model.mkdir()
    else:  # a float model with one sign of quantization
        float_model(model)
    QUANTIZED[kind](model)
    assert quantize(model, tmp_path / "q") == 1
    line = error_line(capsys)
    assert "quantized already" in line and str(model) in line
    if kind.startswith("qshard"):
        assert "qshard.load(" in line and "a qshard checkpoint" in line
    else:
        assert "qshard.load_pretrained(" in line and "float checkpoint" in line
    assert not (tmp_path / "q").exists()


# ---- problem 17: a damaged safetensors file -----------------------------------------------


def damage(path: pathlib.Path) -> None:
    """A header length that runs past the end of the file."""
    path.write_bytes((10**6).to_bytes(8, "little") + b'{"a": ')


def test_quantize_reports_a_damaged_safetensors_file_in_one_line(tmp_path, capsys):
    model = float_model(tmp_path / "m")
    damage(model / "model.safetensors")
    assert quantize(model, tmp_path / "q") == 1
    line = error_line(capsys)
    assert "model.safetensors" in line and "internal error" not in line


def test_inspect_reports_a_damaged_safetensors_file_in_one_line(tmp_path, capsys):
    # Passes once qshard.formats.source.SafetensorsDir reads headers with qshard's checked
    # reader (CheckpointError); safetensors' own SafetensorError is an internal error here.
    model = float_model(tmp_path / "m")
    deepseek = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (model / "config.json").write_text(json.dumps({"quantization_config": deepseek}))
    damage(model / "model.safetensors")
    assert main(["inspect", str(model)]) == 1
    line = error_line(capsys)
    assert "model.safetensors" in line and "internal error" not in line


# ---- problem 19: user errors are one line and a non-zero exit -----------------------------


def test_quantize_checks_its_input_directory(tmp_path, capsys):
    assert quantize(tmp_path / "missing", tmp_path / "q") == 1
    assert "does not exist" in error_line(capsys)
    (tmp_path / "file.txt").write_text("x")
    assert quantize(tmp_path / "file.txt", tmp_path / "q") == 1
    assert "not a directory" in error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert quantize(tmp_path / "empty", tmp_path / "q") == 1
    assert "config.json" in error_line(capsys)
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "does not exist" in error_line(capsys)
    assert not (tmp_path / "q").exists()


def test_quantize_checks_its_out_before_reading_a_tensor(tmp_path, capsys, monkeypatch):
    model = float_model(tmp_path / "m")
    (tmp_path / "file.txt").write_text("x")
    monkeypatch.setattr(qshard.cli.quantize.SafetensorsDir, "get", lambda *a: pytest.fail("read"))
    assert quantize(model, tmp_path / "file.txt") == 1
    assert "file.txt" in error_line(capsys)
    assert quantize(model, tmp_path / "file.txt" / "q") == 1
    assert "file.txt" in error_line(capsys)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert quantize(model, tmp_path / "other") == 1
    assert "not empty" in error_line(capsys)
    monkeypatch.setattr(qshard.cli.quantize.os, "access", lambda *a, **k: False)
    assert quantize(model, tmp_path / "q") == 1  # (root may write anywhere: os.access mocked)
    assert "cannot write" in error_line(capsys)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            PermissionError(errno.EACCES, "Permission denied", "/ro/q/model.safetensors"),
            "/ro/q/model.safetensors: Permission denied",
        ),
        (OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
    ],
)
def test_a_failing_write_is_one_line(tmp_path, capsys, monkeypatch, error, expected):
    def save(*args, **kwargs):
        raise error

    monkeypatch.setattr(qshard.cli.quantize, "save", save)
    assert quantize(float_model(tmp_path / "m"), tmp_path / "q") == 1
    assert expected in error_line(capsys, after_progress=True)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--ms", "1,x"], "--ms"),
        (["--ms", "0"], "--ms"),
        (["--configs", "int4-g64,int3"], "int3"),
        (["--device", "tpu"], "--device"),
        (["--nonsense"], "--nonsense"),
    ],
)
def test_bench_refuses_bad_arguments_with_status_2(capsys, args, expected):
    assert main(["bench", "32x32", *args]) == 2
    assert expected in error_line(capsys)


def test_bench_on_cuda_without_a_gpu_fails_before_timing(capsys, monkeypatch):
    import qshard.cli
    import qshard.cli.bench

    monkeypatch.setattr(qshard.cli, "_has_cuda", lambda: False)
    monkeypatch.setattr(qshard.cli.bench, "bench_linears", lambda *a: pytest.fail("timed"))
    assert main(["bench", "32x32", "--device", "cuda"]) == 1
    assert "--device cpu" in error_line(capsys)


def test_debug_shows_the_exception_and_internal_errors_say_so(tmp_path, capsys, monkeypatch):
    with pytest.raises(qshard.QShardError, match="does not exist"):
        main(["--debug", "quantize", str(tmp_path / "m"), "--config", "nvfp4", "--out", "q"])

    def bug(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(qshard.cli.quantize, "quantize_directory", bug)
    assert quantize(tmp_path / "m", tmp_path / "q") == 1
    line = error_line(capsys)
    assert "internal error" in line and "ZeroDivisionError" in line and "--debug" in line

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(qshard.cli.quantize, "quantize_directory", interrupt)
    assert quantize(tmp_path / "m", tmp_path / "q") == 130
    assert "interrupted" in capsys.readouterr().err


def test_the_installed_command_prints_no_traceback(tmp_path):
    command = shutil.which("qshard", path=os.path.dirname(sys.executable))
    command = [command] if command else [sys.executable, "-m", "qshard"]
    run = subprocess.run(
        [*command, "quantize", str(tmp_path / "missing"), "--config", "nvfp4", "--out", "q"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("qshard: error: ") and run.stderr.count("\n") == 1, run.stderr
    assert not (tmp_path / "q").exists()
