"""FP8 blockwise layout: config rules, scales, re-blocking, and the DeepSeek TP-32 case."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import gaussian

import qshard
from qshard import ConfigError, Fp8BlockwiseConfig, Fp8BlockwiseTensor, QShardError
from qshard.errors import MisalignedSliceError, UnsupportedOpError


def test_defaults_are_deepseek_v3():
    config = Fp8BlockwiseConfig()
    assert config.block_size == (128, 128) and config.act_group_size == 128
    assert config.scale_format is qshard.ScaleFormat.FP32 and config.backend is qshard.Backend.AUTO
    assert Fp8BlockwiseConfig(block_size=(64, 64)).act_group_size == 64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": (100, 128)}, "power of two"),
        ({"block_size": (8, 8)}, "power of two"),
        ({"block_size": (128,)}, "block_size"),
        ({"act_group_size": 256}, "divides"),
        ({"act_group_size": 48}, "power of two"),
        ({"scale_format": "e5m2"}, "'fp32', 'ue8m0'"),
        ({"backend": "cuda"}, "not one of"),
        ({"backend": "gemlite"}, "not available"),
        ({"block_size": (64.0, 64)}, "power of two"),
        ({"act_group_size": 64.0}, "power of two"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Fp8BlockwiseConfig(**kwargs)


def test_config_takes_integers_of_any_integral_type_as_ints(tmp_path):
    """numpy integers (from a sweep, a JSON reader) become plain ints: the config then saves."""
    import numpy as np

    config = Fp8BlockwiseConfig(block_size=(np.int64(64), 64), act_group_size=np.int32(32))
    assert config == Fp8BlockwiseConfig((64, 64), 32)
    assert all(type(v) is int for v in (*config.block_size, config.act_group_size))
    model = torch.nn.Linear(128, 64)
    qshard.quantize_(model, config)
    qshard.save(model, tmp_path)


def test_config_dict_round_trip_and_versions():
    config = Fp8BlockwiseConfig(block_size=(64, 128), act_group_size=64, scale_format="ue8m0")
    data = config.to_dict()
    assert data["type"] == "Fp8BlockwiseConfig" and data["version"] == 1
    assert data["block_size"] == [64, 128] and data["scale_format"] == "ue8m0"
    assert Fp8BlockwiseConfig.from_dict(data) == config
    assert qshard.config_from_dict(config.to_json()) == config
    with pytest.raises(ConfigError, match="newer"):
        qshard.config_from_dict({**data, "version": 99})
    with pytest.raises(ConfigError, match="unknown fields"):
        qshard.config_from_dict({**data, "blocksize": 3})
    with pytest.raises(ConfigError, match="unknown"):
        qshard.config_from_dict({**data, "type": "Nope"})
    with pytest.raises(ConfigError, match="does not parse"):
        qshard.config_from_dict("{not json")
    with pytest.raises(ConfigError, match="'type'"):
        qshard.config_from_dict({**data, "type": ["x"]})


def test_scales_cover_partial_edge_blocks():
    w = gaussian(300, 520)
    q = Fp8BlockwiseTensor.from_float(w)
    assert q.qdata.dtype == torch.float8_e4m3fn and q.qdata.shape == (300, 520)
    assert q.scale.dtype == torch.float32 and q.scale.shape == (3, 5)
    # The scale of each block is its amax / 448 (the partial edge block [256:300, 512:520] too).
    torch.testing.assert_close(q.scale[2, 4], w[256:, 512:].abs().max() / 448, rtol=0, atol=0)


def test_all_zero_block_gets_a_positive_scale_and_no_nan():
    w = gaussian(256, 256)
    w[:128, 128:] = 0
    q = Fp8BlockwiseTensor.from_float(w)
    assert q.scale[0, 1] > 0 and torch.isfinite(q.dequantize()).all()
    assert (q.dequantize()[:128, 128:] == 0).all()
    x = torch.randn(3, 256)
    x[:, :128] = 0  # an all-zero activation group too
    assert torch.isfinite(F.linear(x, q)).all()


def test_weight_only_dequantizes_to_activation_dtype():
    w = gaussian(96, 160, dtype=torch.bfloat16)
    q = Fp8BlockwiseTensor.from_float(w, Fp8BlockwiseConfig(weight_only=True))
    x = torch.randn(5, 160, dtype=torch.bfloat16)
    expected = (x.double() @ q.dequantize().double().t()).to(torch.bfloat16)
    assert torch.equal(F.linear(x, q), expected)  # bf16 weights, one rounding at the end
    assert qshard.sqnr_db(F.linear(x.float(), w.float()), F.linear(x, q)) > 25


def test_reblock_is_exact_and_shrinks_activation_groups():
    q = Fp8BlockwiseTensor.from_float(gaussian(300, 520))
    fine = q.reblock((64, 64))
    assert fine.block_size == (64, 64) and fine.act_group_size == 64
    assert fine.scale.shape == (5, 9)
    assert torch.equal(fine.dequantize(), q.dequantize())
    assert fine.qdata.data_ptr() == q.qdata.data_ptr()  # weights are shared, only scales repeat
    with pytest.raises(ConfigError, match="divide"):
        q.reblock((96, 128))
    with pytest.raises(ConfigError, match="divide"):
        q.reblock((256, 128))


def test_slice_on_a_finer_block_reblocks_automatically():
    q = Fp8BlockwiseTensor.from_float(gaussian(256, 384))
    part = q[64:192]
    assert part.block_size == (64, 128) and part.act_group_size == 128
    assert torch.equal(part.dequantize(), q.dequantize()[64:192])
    cols = q[:, 32:96]
    assert cols.block_size == (128, 32) and cols.act_group_size == 32
    assert torch.equal(cols.dequantize(), q.dequantize()[:, 32:96])


def test_misaligned_slice_names_the_allowed_offsets():
    q = Fp8BlockwiseTensor.from_float(gaussian(256, 384))
    with pytest.raises(MisalignedSliceError, match="multiples of 128") as info:
        q[:, 100:200]
    assert "[100, 200]" in str(info.value) and isinstance(info.value, QShardError)


def test_copy_into_a_reblocked_slice_refuses_instead_of_losing_the_write():
    q = Fp8BlockwiseTensor.from_float(gaussian(256, 256))
    view = q.narrow(0, 64, 64)
    with pytest.raises(UnsupportedOpError, match="re-blocked"):
        view.copy_(Fp8BlockwiseTensor.from_float(gaussian(64, 256)).reblock((64, 128)))


def test_deepseek_tp32_shard_reblocks_to_64x64_and_reassembles():
    """docs/design.md, "Tensor parallelism and blocks": 18432 / 32 = 576 = 4.5 x 128 columns per
    shard (here 4 shards of 576)."""
    n, k, tp = 256, 4 * 576, 4
    w = gaussian(n, k)
    q = Fp8BlockwiseTensor.from_float(w)
    shards = [q[:, r * 576 : (r + 1) * 576] for r in range(tp)]
    assert {s.block_size for s in shards[1::2]} == {(128, 64)}
    assert all(s.act_group_size in (64, 128) for s in shards)
    odd = shards[1]
    assert odd.act_group_size == 64 and odd.scale.shape == (2, 9)
    assert torch.equal(torch.cat([s.dequantize() for s in shards], 1), q.dequantize())
    x = torch.randn(3, k)
    partial_sums = sum(F.linear(x[:, r * 576 : (r + 1) * 576], s) for r, s in enumerate(shards))
    assert qshard.sqnr_db(F.linear(x, w), partial_sums) > 25


def test_meta_weights_quantize_without_data():
    w = torch.empty(4096, 1024, device="meta", dtype=torch.bfloat16)
    q = Fp8BlockwiseTensor.from_float(w)
    assert q.device.type == "meta" and q.scale.shape == (32, 8)
    q.validate()


def test_cat_of_different_block_sizes_raises():
    a = Fp8BlockwiseTensor.from_float(gaussian(128, 128))
    b = Fp8BlockwiseTensor.from_float(gaussian(128, 128)).reblock((64, 64))
    with pytest.raises(QShardError, match="same quantized layout"):
        torch.cat([a, b])
    both = torch.cat([a, a])
    assert both.scale.shape == (2, 1) and torch.equal(
        both.dequantize(), a.dequantize().repeat(2, 1)
    )


def test_write_barrier_survives_every_view_of_a_reblocked_tensor():
    """A re-blocked tensor shares fp8 data with its source but not scales: writing into it, or
    into any view of it, would update half a weight. (Found by review: views dropped the flag.)"""
    q = Fp8BlockwiseTensor.from_float(gaussian(300, 520))
    before = q.dequantize().clone()
    src = Fp8BlockwiseTensor.from_float(gaussian(64, 520)).reblock((64, 128))
    views = [
        q.narrow(0, 64, 64).detach(),
        q.narrow(0, 64, 64).view(64, 520),
        q.narrow(0, 64, 64).t().t(),
        q.narrow(0, 64, 128).narrow(0, 0, 64),
    ]
    for view in views:
        with pytest.raises(UnsupportedOpError, match=r"\(128, 128\) blocks"):
            view.copy_(src)
    with pytest.raises(UnsupportedOpError, match="re-blocked"):
        q.reblock((64, 128))[64:128].copy_(src)
    assert torch.equal(q.dequantize(), before)
    fresh = q.narrow(0, 64, 64).clone()  # a copy owns its data: writing into it is fine
    fresh.copy_(src)
    assert torch.equal(fresh.dequantize(), src.dequantize())


def test_tiny_amax_gets_a_positive_scale_not_nan():
    """amax / 448 underflows to 0 below ~6e-43; such a block must behave like an all-zero one."""
    for scale_format in ("fp32", "ue8m0"):
        w = torch.zeros(128, 128)
        w[0, 0] = 1e-43
        q = Fp8BlockwiseTensor.from_float(w, Fp8BlockwiseConfig(scale_format=scale_format))
        assert q.scale.item() > 0 and torch.isfinite(q.dequantize()).all()
    x = torch.zeros(2, 128)
    x[0, 0] = 1e-43
    assert torch.isfinite(F.linear(x, Fp8BlockwiseTensor.from_float(gaussian(64, 128)))).all()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_size": 128}, "block_size"),
        ({"block_size": None}, "block_size"),
        ({"weight_only": "false"}, "True or False"),
    ],
)
def test_config_rejects_values_of_the_wrong_type(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Fp8BlockwiseConfig(**kwargs)


def test_from_float_checks_its_config_and_keeps_no_graph():
    linear = torch.nn.Linear(64, 32)
    for bad in (Fp8BlockwiseConfig, {"block_size": (64, 64)}):
        with pytest.raises(ConfigError, match="instance"):
            Fp8BlockwiseTensor.from_float(linear.weight, bad)
    q = Fp8BlockwiseTensor.from_float(linear.weight)  # a Parameter that requires grad
    assert q.scale.grad_fn is None and not q.qdata.requires_grad
    for bad in (64, (64,), (64, 64, 64)):
        with pytest.raises(ConfigError, match="divide"):
            q.reblock(bad)


def test_linear_with_empty_dims():
    q = Fp8BlockwiseTensor.from_float(gaussian(96, 160))
    bias = gaussian(96)
    assert torch.equal(F.linear(torch.randn(3, 0), q[:, 0:0], bias), bias.expand(3, 96))
    assert F.linear(torch.randn(3, 160), q[0:0]).shape == (3, 0)
    assert F.linear(torch.randn(0, 160), q).shape == (0, 96)
    assert F.linear(torch.randn(160), q).shape == (96,)
    with pytest.raises(QShardError, match="features"):
        F.linear(torch.tensor(1.0), q)
