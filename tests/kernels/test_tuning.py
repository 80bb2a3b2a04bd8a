"""Tuned kernel configs: keys, the file picked per GPU, loading, and that the W4A16 launcher uses
a tuned config where one exists (and the built-in default elsewhere)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from qshard import ConfigError
from qshard.kernels import int4 as ref
from qshard.kernels import tuning
from qshard.kernels.availability import triton_unavailable_reason


def test_m_buckets_and_keys():
    assert [tuning.m_bucket(m) for m in (1, 2, 3, 16, 17, 128, 129, 5000)] == [
        1,
        2,
        4,
        16,
        32,
        128,
        256,
        4096,
    ]
    assert tuning.config_key("w4a16", "int4_asym_g128", 6144, 4096, 9) == (
        "w4a16/int4_asym_g128/6144x4096/m16"
    )


def test_the_file_for_a_gpu_is_picked_by_its_longest_matching_tag(tmp_path, monkeypatch):
    for tag in ("h100", "h100_nvl", "a100"):
        (tmp_path / f"{tag}.json").write_text("{}")
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    assert tuning.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert tuning.gpu_tag("NVIDIA H100 NVL") == "h100_nvl"
    assert tuning.gpu_tag("NVIDIA H200") is None  # no file: the built-in defaults


def test_every_shipped_file_loads():
    paths = sorted(tuning.TUNED_DIR.glob("*.json"))
    assert paths, f"no tuned file in {tuning.TUNED_DIR} (the H100's is shipped)"
    for path in paths:
        configs = tuning._read(path)
        assert all(key.count("/") == 3 for key in configs), path


def test_a_tuned_file_of_another_version_or_shape_is_a_config_error(tmp_path):
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"version": 0, "configs": {}}))
    with pytest.raises(ConfigError, match="version 0"):
        tuning.load_tuned_configs(bad)
    bad.write_text(json.dumps({"version": 1, "configs": {"a/b/1x1/m1": 3}}))
    with pytest.raises(ConfigError, match="'configs'"):
        tuning.load_tuned_configs(bad)
    with pytest.raises(ConfigError, match="cannot be read"):
        tuning.load_tuned_configs(tmp_path / "missing.json")


@pytest.mark.skipif(
    triton_unavailable_reason(torch.device("cpu"), fp8=False) is not None,
    reason=str(triton_unavailable_reason(torch.device("cpu"), fp8=False)),
)  # the Triton interpreter on the CPU (tests/conftest.py)
def test_the_launcher_asks_for_a_tuned_config_and_runs_it(monkeypatch):
    from qshard.kernels.w4a16 import dequantize, ops, select
    from qshard.kernels.w4a16.format import Format

    asked = []

    def tuned(family, fmt, n, k, m, device):
        asked.append((family, fmt, n, k, m))
        return dequantize.config() if m == 1 else None

    monkeypatch.setattr(select, "tuned_config", tuned)
    qdata, scale, zero = ref.quantize_int4(torch.randn(48, 256) * 0.02, 128, False)
    x = torch.randn(1, 256, dtype=torch.float16)
    out = ops.linear_launch(Format.INT4_ASYM, x, qdata, scale, zero, scale, None, 128)
    assert asked == [("w4a16", "int4_asym_g128", 48, 256, 1)]
    # The tuned config named dequantize + F.linear: exactly that product, not the GEMV's.
    weight = ref.dequantize_int4(qdata, scale, zero, 128, 256, torch.float16)
    assert torch.equal(out, F.linear(x, weight))
    two = torch.randn(2, 256, dtype=torch.float16)  # no tuned config: the default kernel
    out = ops.linear_launch(Format.INT4_ASYM, two, qdata, scale, zero, scale, None, 128)
    assert asked[-1] == ("w4a16", "int4_asym_g128", 48, 256, 2)
    expected = ref.int4_linear_reference(two, qdata, scale, zero, 128)
    torch.testing.assert_close(out, expected, rtol=1e-3, atol=1e-3)
