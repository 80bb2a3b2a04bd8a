"""Reading a compressed-tensors checkpoint into qshard's layouts (`load`): each quantized
linear's scheme (`schemes.py`), what qshard holds it as (`HOLDS`), and its tensors turned into
the layout's, checked as every reader checks them."""

from __future__ import annotations

import math
import sys

import torch

from ...config import Backend, ScaleFormat
from ...errors import CheckpointError, QShardError
from ...kernels.packing import pack_nibbles
from ...kernels.w4a8 import act_group
from ...layouts import Fp8BlockwiseTensor, Int4Tensor, Mxfp4Tensor, Nvfp4Tensor
from ...layouts.int4 import GROUP_SIZES, ActivationQuant
from ...qtensor import QTensor
from ..configs import (
    MAX_SIZE,
    check_scalar,
    check_stored,
)
from ..source import exact_bf16, fp8_block_attrs, fp8_rows
from .schemes import (
    FP8_FORMAT,
    INT4_FORMAT,
    INT4_RANGE,
    INT_FORMAT,
    INTS,
    MX_GROUP,
    MXFP4_FORMAT,
    NAIVE_FORMAT,
    NVFP4_FORMAT,
    NVFP4_GROUP,
    PACKED_FORMATS,
    SCALES,
    TENSORS,
    Scheme,
    schemes,
)


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    if sys.byteorder != "little":
        raise QShardError(
            "compressed-tensors: reading packed int32 words needs a little-endian machine"
        )
    act_order = [k for k in reader.names() if k.endswith(".weight_g_idx")]
    if act_order:
        raise CheckpointError(
            f"{reader.directory}: {act_order[0]!r}: an act-order (g_idx) checkpoint, whose "
            f"groups are permuted columns; the int4 layout's groups are contiguous"
        )
    groups = schemes(config, str(reader.directory / "config.json"))
    state, consumed = {}, set()
    for key in reader.names():
        if key.endswith(".weight_packed"):
            prefix, first = key.removesuffix(".weight_packed"), "weight_packed"
        elif key.endswith(".weight") and key + "_scale" in reader:
            prefix, first = key.removesuffix(".weight"), "weight"
        else:
            continue
        scheme = _scheme_of(reader, prefix, first, groups)
        state[prefix + ".weight"] = LOADERS[scheme.format](reader, prefix, scheme, dtype)
        consumed.update(f"{prefix}.{n}" for n in TENSORS[scheme.format])
    for key in reader.names():
        if key not in consumed:
            state[key] = reader.get(key)
    return state


def _scheme_of(reader, prefix: str, first: str, groups: list[Scheme]) -> Scheme:
    """The first group that targets `prefix` and whose format stores `first` first; refused
    with the reason if qshard cannot hold that format's weights."""
    packed = first == "weight_packed"
    fitting = [
        s for s in groups if s.targets_module(prefix) and (s.format in PACKED_FORMATS) == packed
    ]
    if not fitting:
        raise CheckpointError(
            f"{reader.directory}: {prefix}.{first} is stored, but no config group that targets "
            f"{prefix!r} has a format storing it (groups: "
            f"{[(s.name, s.format, list(s.targets)) for s in groups]}); the config does not "
            f"describe these tensors: fix config.json's quantization_config.config_groups"
        )
    scheme = fitting[0]
    why = _why_not(scheme)
    if why:
        raise CheckpointError(f"{reader.directory}: {prefix}: {scheme.describe()}: {why}")
    return scheme


# What qshard holds, per format: weights' (type, bits), strategies, group sizes of the grouped
# strategies (None: any), whether they must be symmetric, and the rule a refusal states.
HOLDS = {
    INT4_FORMAT: (
        ("int", 4),
        ("group",),
        GROUP_SIZES,
        False,
        f"qshard's int layout holds 4-bit weights in groups of {list(GROUP_SIZES)} "
        f"along K (no int8 or other widths, no scale per channel or tensor)",
    ),
    NVFP4_FORMAT: (
        ("float", 4),
        ("tensor_group",),
        (NVFP4_GROUP,),
        True,
        "NVFP4 is symmetric 4-bit float in groups of 16 with a global scale",
    ),
    MXFP4_FORMAT: (
        ("float", 4),
        ("group",),
        (MX_GROUP,),
        True,
        "MXFP4 is symmetric 4-bit float in groups of 32",
    ),
    INT_FORMAT: (
        ("int", 4),
        ("group", "channel"),
        GROUP_SIZES,
        False,
        f"qshard's int layout holds 4-bit weights per channel or in groups of "
        f"{list(GROUP_SIZES)} along K (no int8 layout: it runs int4 as W4A16)",
    ),
    FP8_FORMAT: (
        ("float", 8),
        ("channel", "tensor", "block"),
        None,
        True,
        "qshard reads symmetric FP8 (e4m3) weights with a scale per channel, per "
        "tensor or per block from this format, and has no int8 layout",
    ),
}
HOLDS[NAIVE_FORMAT] = HOLDS[FP8_FORMAT]
INT_ACTIVATIONS = (
    "qshard has no int activation quantization: it runs int activations only with 4-bit int "
    "weights, as W4A16 (activations in bf16/fp16)"
)


def _why_not(s: Scheme) -> str | None:
    """Why qshard cannot hold the weights of scheme `s` as stored, or None if it can."""
    fix = "; use a checkpoint quantized so, or quantize the float model with qshard.quantize_"
    if s.inputs is not None and s.inputs.type == "int" and s.weights.type != "int":
        return INT_ACTIVATIONS + fix
    if s.format not in HOLDS:
        return f"qshard reads the formats {list(HOLDS)}" + fix
    kind, strategies, groups, symmetric_only, rule = HOLDS[s.format]
    w = s.weights
    ok = (w.type, w.num_bits) == kind and w.strategy in strategies
    grouped = w.strategy in ("group", "tensor_group")
    ok = ok and (groups is None or not grouped or w.group_size in groups)
    ok = ok and (w.symmetric or not symmetric_only)
    return None if ok else rule + fix


def _unpack_words(words: torch.Tensor, count: int) -> torch.Tensor:
    """int32 [R, W] of LSB-first nibbles -> uint8 codes [R, count]."""
    nibbles = words.contiguous().view(torch.uint8)
    codes = torch.stack([nibbles & 15, nibbles >> 4], dim=-1).reshape(words.shape[0], -1)
    return codes[:, :count]


def _weight_shape(reader, prefix: str) -> tuple[int, int]:
    where = f"{reader.directory}: {prefix}"
    shape = check_stored(
        where,
        "weight_shape",
        reader.get(prefix + ".weight_shape"),
        (torch.int64, torch.int32),
        (2,),
    )
    n, k = (int(v) for v in shape)
    if not (1 <= n <= MAX_SIZE and 1 <= k <= MAX_SIZE):
        raise CheckpointError(
            f"{where}: weight_shape is {[n, k]}; it must be two sizes in "
            f"1..{MAX_SIZE}. The file is damaged"
        )
    return n, k


def _int4(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    n, k = _weight_shape(reader, prefix)
    group = scheme.weights.group_size
    groups = -(-k // group)
    packed = check_stored(
        where, "weight_packed", reader.get(prefix + ".weight_packed"), torch.int32, (n, -(-k // 8))
    )
    scale = check_stored(
        where, "weight_scale", reader.get(prefix + ".weight_scale"), SCALES, (n, groups)
    )
    scale = exact_bf16(scale, where + ".weight_scale")
    # Bytes of the words, little-endian: the layout's packing, cut to ceil(K/2) bytes.
    qdata = packed.contiguous().view(torch.uint8)[:, : -(-k // 2)].contiguous()
    if k % 2:
        qdata[:, -1] &= 15  # the layout leaves an odd K's last high nibble zero
    zero_key = prefix + ".weight_zero_point"
    symmetric = _symmetric(reader, where, zero_key, scheme)
    if symmetric:
        zero = torch.zeros(0, 0, dtype=torch.bfloat16)
    else:
        words = check_stored(
            where, "weight_zero_point", reader.get(zero_key), torch.int32, (-(-n // 8), groups)
        )
        zero = _unpack_words(words.t(), n).t().to(torch.bfloat16)  # z + 8: the zero's code
    _check_dropped(reader, prefix, "input_scale", SCALES)
    tensor = Int4Tensor(
        {"qdata": qdata, "scale": scale, "zero": zero.contiguous()},
        shape=(n, k),
        dtype=dtype,
        group_size=group,
        symmetric=symmetric,
        backend=Backend.AUTO,
        activations=_int4_activations(scheme),
    )
    tensor.validate()
    return tensor.repack_for_device()


def _int4_activations(scheme: Scheme) -> ActivationQuant:
    """What an int4 scheme's activations run as (the module docstring): FP8 ones as W4A8, per
    token (strategy "token", or a static scale, replaced by the dynamic per-token one) or per
    K block of min(weight group, 128) where the file's groups are no finer; none, int ones and
    finer FP8 groups weight-only (W4A16: finer than any)."""
    acts = scheme.inputs
    if acts is None or (acts.type, acts.num_bits) != ("float", 8):
        return ActivationQuant.NONE
    if acts.strategy != "group":
        return ActivationQuant.FP8_TOKEN
    ours = act_group(scheme.weights.group_size or GROUP_SIZES[-1])
    return ActivationQuant.FP8_GROUP if (acts.group_size or 0) >= ours else ActivationQuant.NONE


def _symmetric(reader, where: str, zero_key: str, scheme: Scheme) -> bool:
    """The config group's `symmetric`, which the file must agree with (a zero point or none)."""
    symmetric = scheme.weights.symmetric
    if (zero_key in reader) == symmetric:
        state = "has" if symmetric else "lacks"
        raise CheckpointError(
            f"{where}: config group {scheme.name!r} says symmetric="
            f"{symmetric} but the linear {state} a weight_zero_point; the "
            f"file and its config disagree"
        )
    return symmetric


def _int4_values(where: str, name: str, values: torch.Tensor) -> torch.Tensor:
    """`values` (an integer tensor) if each is a 4-bit int, -8..7, else CheckpointError."""
    low, high = INT4_RANGE
    bad = ((values < low) | (values > high)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        raise CheckpointError(
            f"{where}: {name}{list(at)} is {int(values[at])}; a 4-bit int "
            f"is in {low}..{high} (compressed-tensors clamps to that range). "
            f"The file is damaged, or its config's num_bits is not 4: "
            f"re-export the checkpoint"
        )
    return values


def _int4_unpacked(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    """int-quantized 4-bit weights, one int8 per weight (the module docstring)."""
    where = f"{reader.directory}: {prefix}"
    q = check_stored(where, "weight", reader.get(prefix + ".weight"), torch.int8, (None, None))
    n, k = q.shape
    _int4_values(where, "weight", q)
    per_channel = scheme.weights.strategy == "channel"
    if per_channel:  # one group of K, repeated over groups the layout takes (same weights)
        group = next((g for g in reversed(GROUP_SIZES) if k % g == 0), GROUP_SIZES[-1])
        stored = (n, 1)
    else:
        group = scheme.weights.group_size
        stored = (n, -(-k // group))
    groups = -(-k // group)
    scale = check_stored(
        where, "weight_scale", reader.get(prefix + ".weight_scale"), SCALES, stored
    )
    scale = exact_bf16(scale, where + ".weight_scale")
    zero_key = prefix + ".weight_zero_point"
    symmetric = _symmetric(reader, where, zero_key, scheme)
    if symmetric:
        zero = torch.zeros(0, 0, dtype=torch.bfloat16)
    else:
        z = check_stored(where, "weight_zero_point", reader.get(zero_key), INTS, stored)
        zero = (_int4_values(where, "weight_zero_point", z) + 8).to(torch.bfloat16)  # its code
        zero = zero.expand(n, groups) if per_channel else zero
    scale = scale.expand(n, groups) if per_channel else scale
    _check_dropped(reader, prefix, "input_scale", SCALES)
    _check_dropped(reader, prefix, "input_zero_point", INTS)
    qdata = pack_nibbles((q + 8).to(torch.uint8))  # codes u = q + 8, even index low
    tensor = Int4Tensor(
        {"qdata": qdata, "scale": scale.contiguous(), "zero": zero.contiguous()},
        shape=(n, k),
        dtype=dtype,
        group_size=group,
        symmetric=symmetric,
        backend=Backend.AUTO,
        activations=_int4_activations(scheme),
    )
    tensor.validate()
    return tensor.repack_for_device()


def _fp4_codes(reader, prefix: str, group: int, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight_packed` uint8 [N, K/2] and `weight_scale` [N, ceil(K/group)] of one of `scales`."""
    where = f"{reader.directory}: {prefix}"
    packed = check_stored(
        where, "weight_packed", reader.get(prefix + ".weight_packed"), torch.uint8, (None, None)
    )
    n, k = packed.shape[0], packed.shape[1] * 2
    scale = check_stored(
        where, "weight_scale", reader.get(prefix + ".weight_scale"), scales, (n, -(-k // group))
    )
    _check_dropped(reader, prefix, "input_global_scale", torch.float32)
    return packed, scale


def _check_dropped(reader, prefix: str, name: str, dtypes) -> None:
    """A static activation scale qshard does not use (the module docstring), still checked to
    be the one value the format stores."""
    if f"{prefix}.{name}" in reader:
        check_scalar(f"{reader.directory}: {prefix}", name, reader.get(f"{prefix}.{name}"), dtypes)


def _nvfp4(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    packed, scale = _fp4_codes(reader, prefix, NVFP4_GROUP, torch.float8_e4m3fn)
    divisor = reader.get(prefix + ".weight_global_scale")
    divisor = check_scalar(where, "weight_global_scale", divisor, torch.float32)
    d = float(divisor.reshape(()))
    if not (math.isfinite(d) and d > 0):
        raise CheckpointError(
            f"{where}: weight_global_scale {d} is not positive and finite; a "
            f"divisor must be. The file is damaged: re-export it"
        )
    inner = {"qdata": packed, "scale": scale, "global_scale": 1.0 / divisor.reshape(1, 1)}
    n, k = packed.shape[0], packed.shape[1] * 2
    tensor = Nvfp4Tensor(inner, shape=(n, k), dtype=dtype, backend=Backend.AUTO, global_divisor=d)
    tensor.validate()
    return tensor


def _mxfp4(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    packed, scale = _fp4_codes(reader, prefix, MX_GROUP, (torch.uint8, torch.float8_e8m0fnu))
    n, k = packed.shape[0], packed.shape[1] * 2
    inner = {"qdata": packed, "scale": scale.contiguous().view(torch.float8_e8m0fnu)}
    tensor = Mxfp4Tensor(
        inner, shape=(n, k), dtype=dtype, group_size=MX_GROUP, backend=Backend.AUTO
    )
    tensor.validate()
    return tensor


def _fp8(reader, prefix: str, scheme: Scheme, dtype: torch.dtype) -> QTensor:
    where = f"{reader.directory}: {prefix}"
    qdata = check_stored(
        where, "weight", reader.get(prefix + ".weight"), torch.float8_e4m3fn, (None, None)
    )
    n, k = qdata.shape
    _check_dropped(reader, prefix, "input_scale", SCALES)
    w = scheme.weights
    weight_only = scheme.inputs is None
    scale = reader.get(prefix + ".weight_scale")
    if w.strategy == "channel":  # one scale per row: [N, 1] (or [N])
        rows = (n, 1) if scale.dim() == 2 else (n,)
        return fp8_rows(
            qdata,
            check_stored(where, "weight_scale", scale, SCALES, rows).float(),
            dtype,
            weight_only,
        )
    if w.strategy == "tensor":  # one scale: [1] (or [])
        return fp8_rows(
            qdata, check_scalar(where, "weight_scale", scale, SCALES).float(), dtype, weight_only
        )
    attrs = fp8_block_attrs(
        w.block_structure,
        weight_only,
        ScaleFormat.FP32,
        lambda e: CheckpointError(
            f"{reader.directory / 'config.json'}: config group {scheme.name!r} "
            f"weights.block_structure {list(w.block_structure)}: {e}"
        ),
    )
    bn, bk = w.block_structure
    blocks = (-(-n // bn), -(-k // bk))
    scale = check_stored(where, "weight_scale", scale, SCALES, blocks).float()
    tensor = Fp8BlockwiseTensor(
        {"qdata": qdata, "scale": scale}, shape=(n, k), dtype=dtype, **attrs
    )
    tensor.validate()
    return tensor


# The reader of each format of HOLDS.
LOADERS = {
    INT4_FORMAT: _int4,
    NVFP4_FORMAT: _nvfp4,
    MXFP4_FORMAT: _mxfp4,
    FP8_FORMAT: _fp8,
    NAIVE_FORMAT: _fp8,
    INT_FORMAT: _int4_unpacked,
}


# ---- export -----------------------------------------------------------------------------------
