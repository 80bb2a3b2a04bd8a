"""The README's promises: its example runs as written, and `qshard demo` works."""

from __future__ import annotations

import pathlib
import re

from qshard.cli import main

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# Logits of the demo's random 4-layer stack vs float; measured 19.0 dB / cosine 0.9936.
DEMO_MIN_SQNR_DB = 15.0
DEMO_MIN_COSINE = 0.99


def test_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})
    out = capsys.readouterr().out
    assert "2 quantized, 0 skipped" in out and "SQNR vs float" in out


def test_readme_names_the_two_commands():
    text = README.read_text()
    assert "pip install . && qshard demo" in text
    assert 'pip install ".[test]" && pytest' in text
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install ".[test]" && pytest' in ci


def test_demo_prints_report_and_accuracy(capsys, monkeypatch):
    import qshard.demo

    results = []
    real = qshard.demo.run_demo
    monkeypatch.setattr(qshard.demo, "run_demo", lambda **kw: results.append(real(**kw)))
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "8 quantized, 1 skipped" in out and "excluded by pattern 'lm_head'" in out
    (result,) = results
    assert result["sqnr_db"] >= DEMO_MIN_SQNR_DB and result["cosine"] >= DEMO_MIN_COSINE
    assert qshard.__version__


def test_readme_tp_example_is_the_example_file_and_runs_under_torchrun():
    import subprocess
    import sys

    example = README.parent / "examples" / "tp_inference.py"
    assert f"```python examples/tp_inference.py\n{example.read_text()}```" in README.read_text()
    assert "torchrun --standalone --nproc-per-node 2 examples/tp_inference.py" in README.read_text()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(example),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=README.parent,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("TP 2"))
    assert "Fp8BlockwiseTensor [2048, 1024] of [4096, 1024]" in line
    assert float(line.rsplit("SQNR vs float ", 1)[1].split()[0]) > 20
