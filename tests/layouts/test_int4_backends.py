"""The int4 layout's alternative backends, tinygemm and gemlite, on their device forms.

tinygemm runs on the CPU too (`aten._weight_int4pack_mm_for_cpu`), so CI checks it there; on a
GPU the same tests run through `aten._weight_int4pack_mm`. gemlite runs on CUDA only.
"""

from __future__ import annotations

import importlib.util
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same_device_form, gaussian, relative_error
from torch import nn

import qshard
from qshard import BackendUnavailableError, Int4WeightOnlyConfig, MisalignedSliceError
from qshard.kernels import int4 as ref
from qshard.kernels.int4_tinygemm import tinygemm_problem

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# tinygemm on CUDA takes bf16 activations only; the CPU kernel takes all three.
TINYGEMM_DTYPES = (
    [torch.bfloat16]
    if DEVICE.type == "cuda"
    else [
        torch.float32,
        torch.bfloat16,
        torch.float16,
    ]
)
# Output vs the float64 product of the very weights tinygemm multiplies: its output is rounded
# once to the activation dtype and its bf16/fp16 paths may round partial sums (measured worst on
# the CPU, torch 2.13, 20 cases: fp32 4e-7, fp16 3.6e-4, bf16 2.9e-3).
TINYGEMM_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
GEMLITE_MISSING = DEVICE.type != "cuda" or importlib.util.find_spec("gemlite") is None
# gemlite's split-K kernels add partial sums into the fp16/bf16 output with atomics, rounding at
# each add in arrival order, so its results vary from run to run (measured on an H100, gemlite
# 0.6.0.post2: vs the reference up to 1.3e-2 in bf16; compiled vs eager 2.2e-3 fp16, 6.7e-3 bf16).
GEMLITE_TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2.5e-2}


def tinygemm_weight(q: qshard.Int4Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """The weight tinygemm multiplies, from its definition (docs/design.md, "PyTorch behaviour"):
    (q - 8) * scale + zero, q the 4-bit code, zero = (8 - z) * s rounded to the scale dtype."""
    n, k = q.logical_shape
    codes = torch.stack([q.qdata & 15, q.qdata >> 4], dim=-1).reshape(n, -1)[:, :k].double()
    s = q.scale.double()
    z = q.zero.double() if q.zero.numel() else torch.full_like(s, 8.0)
    # A float zero point is tinygemm's zero as it is.
    tinygemm_zero = (z if q.float_zero else (8.0 - z) * s).to(scale_dtype).double()
    per_column = torch.arange(k, device=q.device) // q.group_size
    return (codes - 8.0) * s[:, per_column] + tinygemm_zero[:, per_column]


@pytest.mark.parametrize("dtype", TINYGEMM_DTYPES)
@pytest.mark.parametrize(
    ("n", "k", "group", "symmetric", "domain"),
    [
        (48, 256, 64, False, "int"),
        (40, 100, 32, False, "int"),
        (32, 192, 128, True, "int"),
        (16, 512, 256, False, "int"),
        (40, 160, 32, False, "float"),
    ],
)  # N not a multiple of 16 and a partial last group (40 x 100) are padded by the form
def test_tinygemm_multiplies_the_weight_its_definition_gives(n, k, group, symmetric, domain, dtype):
    config = Int4WeightOnlyConfig(group, symmetric, backend="tinygemm", zero_point_domain=domain)
    q = qshard.Int4Tensor.from_float(gaussian(n, k).to(DEVICE), config).to(dtype)
    assert q.device_form is not None
    x = torch.randn(3, 5, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out = F.linear(x, q, bias)
    assert out.dtype == dtype and out.shape == (3, 5, n)
    scale_dtype = torch.bfloat16 if DEVICE.type == "cuda" else dtype
    weight = tinygemm_weight(q, scale_dtype)
    expected = F.linear(x.double(), weight, bias.double())
    assert relative_error(out, expected) <= TINYGEMM_TOLERANCE[dtype]
    # Nibbles read high-first would give another weight altogether (what this would catch).
    swapped = q.with_changes({"qdata": (q.qdata << 4) | (q.qdata >> 4)}).dequantize(torch.float64)
    assert relative_error(out, F.linear(x.double(), swapped, bias.double())) > 0.1
    # Against the canonical reference: equal for symmetric weights (zero 0 is exact), within
    # the zero's rounding (at most 8 * s * 2^-9 per weight in bf16) for asymmetric ones.
    reference = ref.int4_linear_reference(x, q.qdata, q.scale, q.zero, group, bias, q.float_zero)
    exact_zero = symmetric or (q.float_zero and DEVICE.type == "cuda")  # bf16 zero as stored
    bound = TINYGEMM_TOLERANCE[dtype] + (0 if exact_zero else 4e-3)
    assert relative_error(out, reference) <= bound


def test_tinygemm_zero_convention_is_checked_against_a_wrong_one():
    """The zero tinygemm adds is (8 - z) * s; reading the canonical zero point z as tinygemm's
    zero (a convention slip) gives another weight altogether."""
    config = Int4WeightOnlyConfig(64, backend="tinygemm")
    q = qshard.Int4Tensor.from_float(gaussian(32, 128).to(DEVICE), config).to(torch.bfloat16)
    x = torch.randn(4, 128, device=DEVICE, dtype=torch.bfloat16)
    out = F.linear(x, q)
    right = tinygemm_weight(q, torch.bfloat16)
    per_column = torch.arange(128, device=DEVICE) // 64
    codes = ref.unpack_nibbles(q.qdata, 128).double()
    slip = (codes - 8.0) * q.scale.double()[:, per_column] + q.zero.double()[:, per_column]
    assert relative_error(out, F.linear(x.double(), right)) <= TINYGEMM_TOLERANCE[torch.bfloat16]
    assert relative_error(out, F.linear(x.double(), slip)) > 0.5


def test_tinygemm_model_compiles_saves_loads_and_needs_no_repack_after_qshard_load(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 320), nn.SiLU(), nn.Linear(320, 128)).to(DEVICE)
    model = model.to(torch.bfloat16)
    qshard.quantize_(model, Int4WeightOnlyConfig(64, backend="tinygemm"))
    x = torch.randn(7, 256, device=DEVICE, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        # Every weight has its device form: no repacking warning.
        warnings.filterwarnings("error", message=".*repack_for_device")
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
        qshard.save(model, tmp_path / "ckpt")
        fresh = nn.Sequential(nn.Linear(256, 320), nn.SiLU(), nn.Linear(320, 128))
        loaded = qshard.load(tmp_path / "ckpt", fresh.to(torch.bfloat16), device=DEVICE)
        again = loaded(x)
    # bf16 activations: inductor keeps the SiLU output in fp32 where eager rounds it to bf16,
    # about 2^-9 relative (measured 48 dB on the CPU).
    assert qshard.sqnr_db(eager, compiled) >= 40.0
    assert torch.equal(again, eager)
    for mine, theirs in zip(model, loaded, strict=True):
        if isinstance(mine, nn.Linear):
            assert_same_device_form(mine.weight, theirs.weight)


def test_a_weight_without_its_device_form_warns_and_repacks_per_call():
    config = Int4WeightOnlyConfig(32, backend="tinygemm")
    q = qshard.Int4Tensor.from_float(gaussian(32, 64).to(DEVICE), config).to(torch.bfloat16)
    buffer = io.BytesIO()
    torch.save(q, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)  # the device form is never stored
    x = torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="repack_for_device"):
        slow = F.linear(x, loaded)
    assert torch.equal(slow, F.linear(x, q))
    model = nn.Linear(64, 32, bias=False)
    model.weight = nn.Parameter(loaded, requires_grad=False)
    qshard.repack_for_device(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*repack_for_device")
        assert torch.equal(model(x), slow)


def test_what_tinygemm_cannot_run_is_a_typed_error():
    config = Int4WeightOnlyConfig(32, backend="tinygemm")
    q = qshard.Int4Tensor.from_float(gaussian(32, 128).to(DEVICE), config)
    finer = q.regroup(16)  # what a 16-column cut would need: no tinygemm kernel for it
    assert finer.device_form is None
    with pytest.raises(BackendUnavailableError, match="groups of 16"):
        F.linear(torch.randn(2, 128, device=DEVICE), finer)
    with pytest.raises(MisalignedSliceError, match="tinygemm"):
        q[:, 48:]  # so slicing and TP refuse such cuts before anything changes
    assert q[:, 64:].device_form is None  # a slice drops the form; 32-groups still run
    assert "bfloat16" in tinygemm_problem(torch.device("cuda"), 32, torch.float16)
    assert "groups" in tinygemm_problem(torch.device("cpu"), 16, None)
    assert tinygemm_problem(torch.device("cpu"), 32, torch.float16) is None


def test_gemlite_backend_outside_cuda_is_a_typed_error_and_moves_to_a_gpu_later():
    model = nn.Linear(128, 64)
    qshard.quantize_(model, Int4WeightOnlyConfig(64, backend="gemlite"))  # quantize on the CPU
    assert model.weight.device_form is None
    with pytest.raises(BackendUnavailableError, match="gemlite runs on CUDA"):
        model(torch.randn(2, 128))


@pytest.mark.skipif(GEMLITE_MISSING, reason="gemlite runs on CUDA GPUs with gemlite installed")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_gemlite_multiplies_the_canonical_weight(m, dtype):
    config = Int4WeightOnlyConfig(128, backend="gemlite")
    cpu = nn.Linear(4096, 1024, bias=True).to(dtype)
    qshard.quantize_(cpu, config)
    layer = cpu.to(DEVICE)  # quantized on the CPU, its gemlite form made on the GPU by .to()
    assert layer.weight.device_form is not None
    x = torch.randn(m, 4096, device=DEVICE, dtype=dtype)
    out = layer(x)
    w = layer.weight
    expected = ref.int4_linear_reference(x, w.qdata, w.scale, w.zero, 128, layer.bias)
    # gemlite multiplies the same weights; its output rounding and split-K order remain.
    assert relative_error(out, expected) <= GEMLITE_TOLERANCE[dtype]
    compiled = torch.compile(layer, fullgraph=True)(x)
    assert relative_error(compiled, out) <= GEMLITE_TOLERANCE[dtype]


@pytest.mark.parametrize("part", ["rows", "columns", "split"])
def test_a_copy_into_a_part_refreshes_the_whole_weights_device_form(part):
    """The loading pattern of fused projections (copy_ into a narrow of the weight): the part
    has no device form of its own, so the copy must refresh its parent's (found in review: the
    parent kept multiplying the old weights)."""
    config = Int4WeightOnlyConfig(32, backend="tinygemm")
    q = qshard.Int4Tensor.from_float(gaussian(64, 256, seed=1).to(DEVICE), config)
    new = qshard.Int4Tensor.from_float(gaussian(64, 256, seed=2).to(DEVICE), config)
    q, new = q.to(torch.bfloat16), new.to(torch.bfloat16)
    if part == "rows":
        q.narrow(0, 0, 32).copy_(new.narrow(0, 0, 32))
    elif part == "columns":
        q[:, :64].copy_(new[:, :64])
    else:
        q.split(32, 0)[1].detach().copy_(new.split(32, 0)[1])
    x = torch.randn(3, 256, device=DEVICE, dtype=torch.bfloat16)
    fresh = q.clone()
    fresh.set_device_form(None)
    fresh.repack_for_device()  # the form made from the updated canonical tensors
    assert torch.equal(F.linear(x, q), F.linear(x, fresh))
    assert not torch.equal(
        q.dequantize(),
        qshard.Int4Tensor.from_float(gaussian(64, 256, seed=1).to(DEVICE), config)
        .to(torch.bfloat16)
        .dequantize(),
    )


def test_a_model_built_empty_gets_its_device_form_from_load_state_dict():
    config = Int4WeightOnlyConfig(64, backend="tinygemm")
    model = nn.Sequential(nn.Linear(256, 128)).to(DEVICE, torch.bfloat16)
    qshard.quantize_(model, config)
    with torch.device("meta"):
        empty = nn.Sequential(nn.Linear(256, 128)).to(torch.bfloat16)
    qshard.quantize_(empty, config)
    empty = empty.to_empty(device=DEVICE)
    assert empty[0].weight.device_form is None  # empty_like: nothing to arrange yet
    empty.load_state_dict(model.state_dict())
    assert_same_device_form(empty[0].weight, model[0].weight)
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*repack_for_device")
        assert torch.equal(empty(x), model(x))


def test_cpu_tinygemm_refuses_scales_fp16_cannot_hold():
    """The CPU kernel takes scales and zeros in the activation dtype: a bf16 weight whose scales
    pass fp16's 65504 is refused for fp16 activations, not run with inf scales."""
    w = gaussian(32, 64).to(torch.bfloat16) * 1e7
    q = qshard.Int4Tensor.from_float(w, Int4WeightOnlyConfig(32, backend="tinygemm"))
    x = torch.randn(2, 64)
    assert bool(torch.isfinite(F.linear(x.to(torch.bfloat16), q)).all())
    with pytest.raises(BackendUnavailableError, match="activation dtype"):
        F.linear(x.half(), q)


@pytest.mark.parametrize(
    ("in_features", "out_features", "rows"), [(0, 4, 3), (64, 0, 3), (64, 8, 0)]
)
def test_tinygemm_gives_empty_products_as_the_other_backends_do(in_features, out_features, rows):
    """A zero-size weight or input: the empty sums are zeros (plus the bias), the same result
    as the reference backend, not an error from tinygemm's kernels."""
    import copy

    torch.manual_seed(0)
    x = torch.randn(2, rows, in_features)
    float_layer = nn.Linear(in_features, out_features)
    nn.init.normal_(float_layer.bias)
    outputs = []
    for backend in ("tinygemm", "reference"):
        layer = copy.deepcopy(float_layer)
        qshard.quantize_(layer, Int4WeightOnlyConfig(group_size=32, backend=backend))
        outputs.append(layer(x))
    assert outputs[0].shape == (2, rows, out_features)
    torch.testing.assert_close(outputs[0], outputs[1])
