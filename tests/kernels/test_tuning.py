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
from qshard.kernels.gpu import GpuTraits, smem_budget


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


def tuned_file(path, gpu: GpuTraits, configs=None):
    data = {"version": 2, "gpu": path.stem, "traits": gpu.to_json(), "configs": configs or {}}
    path.write_text(json.dumps(data))
    return path


H100 = GpuTraits((9, 0), 132, 228, 3352)
H200 = GpuTraits((9, 0), 132, 228, 4917)
A100 = GpuTraits((8, 0), 108, 164, 2039)


def test_the_file_for_a_gpu_is_picked_by_its_nearest_traits(tmp_path, monkeypatch):
    """Same compute capability, then the nearest SM count, shared memory and bandwidth: an
    H200 takes h200.json even though "h200" names no other file's tag; a Hopper GPU of its own
    (78 SMs, 4.6 TB/s) the nearest file; a GPU of another capability none."""
    for name, gpu in (("h100", H100), ("h200", H200), ("a100", A100)):
        tuned_file(tmp_path / f"{name}.json", gpu)
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    assert tuning.shipped_file(H100).stem == "h100"
    assert tuning.shipped_file(H200).stem == "h200"
    assert tuning.shipped_file(GpuTraits((9, 0), 78, 228, 4600)).stem == "h200"
    assert tuning.shipped_file(GpuTraits((9, 0), 114, 228, 2039)).stem == "h100"  # H100 PCIe
    assert tuning.shipped_file(GpuTraits((8, 0), 108, 164, 1555)).stem == "a100"
    assert tuning.shipped_file(GpuTraits((12, 0), 188, 100, 1792)) is None
    # A bandwidth the properties did not give (0) is left out of the distance.
    assert H100.distance(GpuTraits((9, 0), 132, 228, 0)) == 0.0
    assert H100.distance(A100) is None


def test_a_tuned_file_without_the_gpus_traits_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({"version": 2, "configs": {}}))
    with pytest.raises(ConfigError, match="'traits' must hold"):
        tuning.shipped_file(H100)


def test_the_device_traits_and_the_shared_memory_the_rings_take():
    """On the CPU (recorded launches) the Gluon kernels size their rings for an sm_90 SM: 200
    KiB of its 228 KiB; a device's traits come from its CUDA properties."""
    assert smem_budget(torch.device("cpu")) == 200 * 1024
    assert GpuTraits.from_json(H200.to_json()) == H200


def test_no_tuned_config_inside_ignored(monkeypatch, tmp_path):
    """`tuning.ignored()` (the tuner's baseline) hides every tuned entry, and only inside."""
    path = tuned_file(tmp_path / "mine.json", H100, {"w4a16/f/8x8/m1": {"KERNEL": "dequantize"}})
    monkeypatch.setattr(tuning, "_EXTRA", {})
    tuning.load_tuned_configs(path)
    cuda = torch.device("cuda", 0)
    assert tuning.tuned_config("w4a16", "f", 8, 8, 1, cuda) == {"KERNEL": "dequantize"}
    with tuning.ignored():
        assert tuning.tuned_config("w4a16", "f", 8, 8, 1, cuda) is None
    assert tuning.tuned_config("w4a16", "f", 8, 8, 1, cuda) == {"KERNEL": "dequantize"}


def test_a_tuned_entry_comes_before_every_rule_and_native_entries_are_checked(monkeypatch):
    """The tuned rule is the first of both rule tables (the tuner keeps an entry only where
    it beat the rules' choice); an entry for native int4 codes must name a kernel that reads
    them (with NATIVE = 1), else a ConfigError naming the key."""
    from qshard.kernels.w4a16 import select
    from qshard.kernels.w4a16.format import Format

    assert select.RULES[0].config is select._tuned
    assert select.NATIVE_RULES[0].config is select._tuned
    entries = {}
    monkeypatch.setattr(select, "tuned_config", lambda family, fmt, *shape: entries.get(fmt))
    x = torch.zeros(16, 256, dtype=torch.float16)
    qdata = torch.zeros(48, 128, dtype=torch.uint8)
    assert select.choose(Format.MXFP4, x, qdata, 32).kernel is select.Kernel.SMALL_M
    entries["mxfp4_g32"] = {"KERNEL": "dequantize"}
    assert select.choose(Format.MXFP4, x, qdata, 32).kernel is select.Kernel.DEQUANTIZE
    entries["int4_asym_g128_native"] = {"KERNEL": "gemv_words", "BLOCK_N": 16, "BLOCK_W": 16}
    with pytest.raises(ConfigError, match="int4_asym_g128_native/48x256/m16"):
        select.choose(Format.INT4_ASYM, x, qdata, 128, native=True)


def test_every_shipped_file_loads():
    paths = sorted(tuning.TUNED_DIR.glob("*.json"))
    assert paths, f"no tuned file in {tuning.TUNED_DIR} (the H100's is shipped)"
    for path in paths:
        configs = tuning._read(path)
        assert all(key.count("/") == 3 for key in configs), path
        assert tuning.file_traits(path).capability == (9, 0), path
    # The shipped files' GPUs pick their own file.
    for path in paths:
        assert tuning.shipped_file(tuning.file_traits(path)) == path


def test_a_tuned_file_of_another_version_or_shape_is_a_config_error(tmp_path):
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({"version": 0, "configs": {}}))
    with pytest.raises(ConfigError, match="version 0"):
        tuning.load_tuned_configs(bad)
    bad.write_text(json.dumps({"version": 2, "configs": {"a/b/1x1/m1": 3}}))
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
