"""Tuned kernel configs: keys, the file picked per GPU by its traits, loading, and that the W4A16
op takes a tuned entry first where one exists (and its rule tables elsewhere)."""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from qshard import ConfigError
from qshard.kernels import gpu, tuning
from qshard.kernels import int4 as ref
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
H200 = GpuTraits((9, 0), 132, 228, 4814)
A100 = GpuTraits((8, 0), 108, 164, 2039)


def test_the_file_for_a_gpu_is_picked_by_its_nearest_traits(tmp_path, monkeypatch):
    """Same compute capability, then the nearest SM count, shared memory and bandwidth: an
    H200 takes h200.json even though "h200" names no other file's tag; a Hopper GPU of its own
    (78 SMs, 4.6 TB/s) the nearest file; a GPU of another capability none."""
    for name, measured_on in (("h100", H100), ("h200", H200), ("a100", A100)):
        tuned_file(tmp_path / f"{name}.json", measured_on)
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
    # a count of 0 (whose logarithm the distance would take) or a NaN
    for bad in ({"sms": 0}, {"smem_kib": float("nan")}, {"bandwidth_gbs": -1}):
        path = tuned_file(tmp_path / "bad.json", H100)
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "traits": {**data["traits"], **bad}}))
        with pytest.raises(ConfigError, match="'traits' must hold"):
            tuning.shipped_file(H100)


def test_the_device_traits_and_the_shared_memory_the_rings_take(monkeypatch):
    """A device's traits come from its CUDA properties (bandwidth: two transfers per memory
    clock, in kHz, over the bus width; what an H200 reported); a torch without the memory
    fields gives bandwidth 0 (unknown) and sm_90's shared memory. On the CPU (recorded
    launches) the Gluon kernels size their rings for an sm_90 SM: 200 KiB of its 228 KiB."""
    h200 = types.SimpleNamespace(
        major=9,
        minor=0,
        multi_processor_count=132,
        memory_clock_rate=3_134_000,
        memory_bus_width=6144,
        shared_memory_per_multiprocessor=228 * 1024,
    )
    bare = types.SimpleNamespace(major=9, minor=0, multi_processor_count=114)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: (h200, bare)[i])
    gpu.traits.cache_clear()
    try:
        assert gpu.traits(0) == H200
        assert gpu.traits(1) == GpuTraits((9, 0), 114, 228, 0)
    finally:
        gpu.traits.cache_clear()
    assert smem_budget(torch.device("cpu")) == 200 * 1024
    assert GpuTraits.from_json(H200.to_json()) == H200


def test_ties_go_to_the_file_of_the_gpus_own_name(tmp_path, monkeypatch):
    """Without the bandwidth (a torch whose properties lack the memory clock) an H100 and an
    H200 are equally near: the file measured on a GPU of the device's name wins."""
    for name, gpu_traits in (("h100", H100), ("h200", H200)):
        path = tuned_file(tmp_path / f"{name}.json", gpu_traits)
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "gpu": f"NVIDIA {name.upper()}"}))
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    unknown = GpuTraits((9, 0), 132, 228, 0)
    assert tuning.shipped_file(unknown, "NVIDIA H200").stem == "h200"
    assert tuning.shipped_file(unknown, "NVIDIA H100").stem == "h100"
    assert tuning.shipped_file(unknown).stem == "h100"  # then by file name


def test_a_file_of_another_gpu_gives_only_its_kernel_choices(tmp_path, monkeypatch):
    """The nearest file measured on a GPU of other traits: each entry's kernel, not its sizes
    (fitted to that GPU's SMs and shared memory), and entries that name no kernel are left
    out; the GPU's own file is taken whole."""
    entries = {
        "w4a16/f/8x8/m16": {"KERNEL": "register_ws", "STEPS": 3, "PER_SM": 2},
        "w4a16/f/8x8/m32": {"BLOCK_N": 64, "SPLIT_K": 4},
    }
    tuned_file(tmp_path / "h200.json", H200, entries)
    monkeypatch.setattr(tuning, "TUNED_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H20")
    for device_traits, expected in (
        (GpuTraits((9, 0), 78, 228, 4000), {"w4a16/f/8x8/m16": {"KERNEL": "register_ws"}}),
        (H200, entries),
    ):
        monkeypatch.setattr(tuning, "traits", lambda index, t=device_traits: t)
        tuning._shipped.cache_clear()
        try:
            assert tuning._shipped(0) == expected
        finally:
            tuning._shipped.cache_clear()


def test_no_tuned_config_inside_ignored(monkeypatch, tmp_path):
    """`tuning.ignored()` (the tuner's baseline) hides every tuned entry, and only inside."""
    path = tuned_file(tmp_path / "mine.json", H100, {"w4a16/f/8x8/m1": {"KERNEL": "dequantize"}})
    monkeypatch.setattr(tuning, "_EXTRA", {})
    tuning.load_tuned_configs(path)
    cuda = torch.device("cuda", 0)
    assert tuning.tuned_config("w4a16", "f", 8, 8, 1, cuda) == {"KERNEL": "dequantize"}
    with tuning.ignored():
        with tuning.ignored():  # nested: still off when the inner one ends
            pass
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
    # A kernel that cannot run here (the wgmma kernel off Hopper): the rules' choice.
    entries["mxfp4_g32"] = {"KERNEL": "register_wgmma", "BLOCK_T": 16, "STEPS": 2}
    assert select.choose(Format.MXFP4, x, qdata, 32).kernel is select.Kernel.SMALL_M
    # An entry naming only its kernel runs it with its own config for this device.
    entries["mxfp4_g32"] = {"KERNEL": "small_m"}
    expected = select.small_m.config(16, 48, 256, x.device)
    assert select.choose(Format.MXFP4, x, qdata, 32).config == expected
    entries["int4_asym_g128_native"] = {"KERNEL": "gemv_words", "BLOCK_N": 16, "BLOCK_W": 16}
    with pytest.raises(ConfigError, match="int4_asym_g128_native/48x256/m16"):
        select.choose(Format.INT4_ASYM, x, qdata, 128, native=True)
    # dequantize reads the codes in the weight's order, whatever the entry says
    entries["int4_asym_g128_native"] = {"KERNEL": "dequantize"}
    choice = select.choose(Format.INT4_ASYM, x, qdata, 128, native=True)
    assert choice.config == select.dequantize.config(native=True)
    # canonical codes with a native config, and a kernel of no name: errors naming the key
    entries["int4_asym_g128"] = {"KERNEL": "gemv_words", "BLOCK_N": 8, "BLOCK_W": 16, "NATIVE": 1}
    with pytest.raises(ConfigError, match=r"int4_asym_g128/48x256/m16.*canonical"):
        select.choose(Format.INT4_ASYM, x, qdata, 128)
    entries["int4_asym_g128"] = {"KERNEL": "fastest"}
    with pytest.raises(ConfigError, match=r"'fastest' is not a valid Kernel.*'register_wgmma'"):
        select.choose(Format.INT4_ASYM, x, qdata, 128)


def test_a_tuned_promote_follows_the_activations_dtype(monkeypatch):
    """A wgmma entry tuned with PROMOTE (bf16 activations): kept as tuned for bf16 x; for fp16
    x, which PROMOTE cannot take, PROMOTE off and the default unrolled group."""
    from qshard.kernels.w4a16 import register_wgmma, select
    from qshard.kernels.w4a16.format import Format

    entry = {"KERNEL": "register_wgmma", "BLOCK_T": 16, "STEPS": 4, "PROMOTE": 1, "NATIVE": 1}
    entry["GROUP_CHUNKS"] = 2
    monkeypatch.setattr(select, "tuned_config", lambda *args: dict(entry))
    qdata = torch.zeros(128, 128, dtype=torch.uint8)
    for dtype, expected in (
        (torch.bfloat16, entry),
        (torch.float16, {**entry, "PROMOTE": 0, "GROUP_CHUNKS": register_wgmma.GROUP_CHUNKS}),
    ):
        p = select.Matmul(Format.INT4_ASYM, torch.zeros(16, 256, dtype=dtype), qdata, 128, True)
        assert select._tuned(p) == expected


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
