"""Every reader of outside data, fuzzed (docs/design.md invariant 9, issue 21): `qshard.load` (with
and without a model, single file and sharded), `qshard.load_pretrained` for every format (with
and without a model) and `torch.load(weights_only=True)` of saved QTensors and state_dicts.

Each example takes a valid checkpoint, built once per session, mutates it (raw bytes: flips,
cuts, appends, inserts; structured JSON edits of config.json, hf_quant_config.json, the index,
the safetensors header and qshard's own metadata, with its checksums recomputed so that the
checks behind them are reached; tensor values: NaN/Inf/0/huge scales, e4m3 NaN bytes, e8m0
255, int4 zero codes out of range; file deletions and copies; QTensor pickle states with
changed entries) and reads it under three guards: a TorchDispatchMode that refuses any aten op
allocating more than the files' size + 1 MiB (checked before factory ops allocate), a wall-time
limit (SIGALRM), and a snapshot of the model passed in. What must hold, per mutation:

- "exact": the read gives the original tensors bit for bit (class, shape, dtype, attribute
  values and their types, inner bytes, aliases), or raises a `QShardError`. For mutations the
  file's checksums cover (qshard's CRC-32s of its metadata and of every tensor).
- "valid": as "exact", or the read gives other tensors that are well formed: each QTensor's
  inner tensors are plain, contiguous and of the layout's `inner_specs`, its attributes of
  their annotated types, and its dequantized values finite in its dtype. For mutations that
  may describe other valid weights (a foreign format's data or config has no checksum).
- "refuse": a `QShardError`. For values no valid checkpoint holds (NaN/Inf codes or scales of
  a quantized weight, e8m0 255, int4 zero codes outside 0..15, a zero NVFP4 divisor, pickled
  states with unknown or missing entries).

And always: a failed read leaves the model passed in unchanged (same parameter and buffer
objects, same values), no aten op returns (or is asked for) more than the files' bytes + 1 MiB,
and no read takes longer than QSHARD_FUZZ_TIMEOUT seconds.

Errors that are not `QShardError`, for torch.load only: torch's zip reader and weights-only
unpickler run before any qshard code, on bytes qshard never sees, and raise their own errors on
a damaged archive. These are accepted when the traceback holds no frame of the qshard package
(an error raised in or through qshard code must be a QShardError) and the mutation was of the
archive's bytes: RuntimeError (PytorchStreamReader: a damaged zip directory or record header,
record sizes that do not match the pickle, "Trying to resize storage"), pickle.UnpicklingError
(the weights-only unpickler refusing an opcode or a global), KeyError (a memo or `_get_layout`
lookup of a damaged name), UnicodeDecodeError (a damaged BINUNICODE string) and ValueError (an
enum, e.g. `Backend('quto')`, rebuilt from a damaged value by the unpickler). For structured
pickles only UnpicklingError (a global that is not allowed) and, for the wrapper tensor's own
arguments, the RuntimeError of torch's `_make_wrapper_subclass` are accepted. torch's archive
has no checksum of its records that torch.load verifies, so a flipped data byte loads other
values: raw archive mutations are checked as "valid".

QSHARD_FUZZ_EXAMPLES (default 100) sets the examples per test; QSHARD_FUZZ_COLLECT=1 records
escapes instead of failing on the first (for a long offline run) and writes them, one JSON per
line, to QSHARD_FUZZ_REPORT (default: fuzz_escapes.jsonl in pytest's base temp directory). One
summary line is printed at the end of the module: `fuzz: N mutated inputs, E escaped`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import io
import json
import math
import os
import pathlib
import pickle
import re
import shutil
import signal
import tempfile
import time
import traceback
import types
import typing
import zipfile
import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import LAYOUT_CASES, LAYOUT_IDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_pretrained_formats import (
    TORCHAO_FIXTURE,
    compressed_int4_checkpoint,
    deepseek_checkpoint,
    float8_entry,
    random_bytes,
    random_e4m3,
    torchao_checkpoint,
    write_checkpoint,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import qshard
from qshard import QShardError
from qshard.qtensor.registry import attr_types

EXAMPLES = int(os.environ.get("QSHARD_FUZZ_EXAMPLES", "100"))
TIMEOUT = float(os.environ.get("QSHARD_FUZZ_TIMEOUT", "20"))
COLLECT = os.environ.get("QSHARD_FUZZ_COLLECT", "") not in ("", "0")
SLACK = 1 << 20  # the small constant above the files' size that one allocation may take
QSHARD_DIR = str(pathlib.Path(qshard.__file__).parent)

# A damaged archive may declare any pickle protocol; torch warns before refusing or reading it.
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")

FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # the SIGALRM limit below guards each read instead (no flaky first runs)
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---- bookkeeping: inputs tried, escapes, the summary line ---------------------------------------

TRIED: collections.Counter[str] = collections.Counter()
OUTCOMES: collections.Counter[tuple[str, str]] = collections.Counter()
UNSAVABLE: collections.Counter[str] = collections.Counter()  # pickle edits torch.save refused
ESCAPES: dict[tuple, dict] = {}
VALID: dict[str, list[str]] = collections.defaultdict(list)  # samples of "other valid" loads


@pytest.fixture(scope="module", autouse=True)
def fuzz_summary(request, tmp_path_factory):
    yield
    total, escaped = sum(TRIED.values()), sum(e["count"] for e in ESCAPES.values())
    lines = [f"fuzz: {total} mutated inputs, {escaped} escaped ({len(ESCAPES)} distinct)"]
    for reader, n in sorted(TRIED.items()):
        counts = {o: k for (r, o), k in sorted(OUTCOMES.items()) if r == reader}
        lines.append(f"  {reader}: {n} ({', '.join(f'{o} {k}' for o, k in counts.items())})")
    if UNSAVABLE:
        lines.append(f"  (not counted: {dict(UNSAVABLE)} pickle edits torch.save refused)")
    report = os.environ.get("QSHARD_FUZZ_REPORT") or str(
        tmp_path_factory.getbasetemp() / "fuzz_escapes.jsonl"
    )
    with open(report, "w") as f:
        for escape in ESCAPES.values():
            f.write(json.dumps(escape) + "\n")
        for reader, samples in sorted(VALID.items()):
            f.write(json.dumps({"other valid": reader, "mutations": samples}) + "\n")
    lines.append(f"  escapes written to {report}")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(lines), flush=True)
    summary = tmp_path_factory.getbasetemp() / "fuzz_summary.txt"
    summary.write_text("\n".join(lines) + "\n")


class Escape(AssertionError):
    pass


def escape(reader: str, kind: str, description: str, detail: str, site: str = "") -> None:
    """Record an input that broke the property; fail now unless collecting."""
    message = re.sub(r"0x[0-9a-f]+|\d+", "#", detail)[:160]
    key = (reader.split("[")[0], kind, site or message)
    entry = ESCAPES.setdefault(
        key,
        {
            "reader": reader,
            "kind": kind,
            "site": site,
            "detail": detail[:2000],
            "mutation": description,
            "count": 0,
        },
    )
    entry["count"] += 1
    if not COLLECT:
        raise Escape(f"{reader}: {kind} after mutation [{description}]: {detail}")


# ---- guards: allocations, time, the model ------------------------------------------------------


class _Abort(BaseException):
    """Raised inside a read by a guard; a BaseException so that no `except Exception` in the
    reader turns it into a QShardError."""


FACTORIES = {
    "aten::empty": 0,
    "aten::empty_strided": 0,
    "aten::zeros": 0,
    "aten::ones": 0,
    "aten::full": 0,
    "aten::rand": 0,
    "aten::randn": 0,
    "aten::new_empty": 1,
    "aten::new_zeros": 1,
    "aten::new_ones": 1,
    "aten::new_full": 1,
    "aten::new_empty_strided": 1,
}


class LargestAllocation(TorchDispatchMode):
    """The largest numel * element_size of a plain tensor an aten op returns; a factory op
    asked for more than `limit` bytes is refused before it allocates."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.largest, self.largest_op, self.violation = limit, 0, None, None

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        position = FACTORIES.get(func._schema.name)
        if position is not None and len(args) > position:
            size = args[position]
            if isinstance(size, list | tuple) and all(isinstance(s, int) for s in size):
                dtype = kwargs.get("dtype")
                if dtype is None:
                    like = args[0] if position == 1 else None
                    dtype = like.dtype if isinstance(like, torch.Tensor) else torch.float32
                wanted = math.prod(size) * dtype.itemsize if all(s >= 0 for s in size) else 0
                meta = str(kwargs.get("device", "")) == "meta"
                if wanted > self.limit and not meta:
                    self.violation = f"{func} asked for {list(size)} {dtype}: {wanted} bytes"
                    raise _Abort(self.violation)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if type(t) in (torch.Tensor, nn.Parameter) and not t.is_meta:
                nbytes = t.numel() * t.element_size()
                if nbytes > self.largest:
                    self.largest, self.largest_op = nbytes, str(func)
        return out


@contextlib.contextmanager
def time_limit(seconds: float):
    def expire(signum, frame):
        raise _Abort(f"the read took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclasses.dataclass
class Outcome:
    value: Any = None
    error: BaseException | None = None
    trace: list = dataclasses.field(default_factory=list)
    largest: int = 0
    largest_op: str | None = None
    aborted: str | None = None
    seconds: float = 0.0


def guarded(read: Callable[[], Any], nbytes: int) -> Outcome:
    mode = LargestAllocation(nbytes + SLACK)
    outcome, start = Outcome(), time.perf_counter()
    try:
        with time_limit(TIMEOUT), mode:
            outcome.value = read()
    except _Abort as e:
        outcome.aborted = str(e)
    except Exception as e:
        outcome.error, outcome.trace = e, traceback.extract_tb(e.__traceback__)
    outcome.seconds = time.perf_counter() - start
    outcome.largest, outcome.largest_op = mode.largest, mode.largest_op
    if mode.violation and not outcome.aborted:  # a reader that swallowed the abort
        outcome.aborted = mode.violation
    return outcome


def snapshot(model: nn.Module | None) -> list | None:
    if model is None:
        return None
    entries = [(n, t) for n, t in model.named_parameters(remove_duplicate=False)]
    entries += [(n, t) for n, t in model.named_buffers(remove_duplicate=False)]
    return [(n, t, t.detach().clone() if not t.is_meta else None) for n, t in entries]


def unchanged_problem(model: nn.Module, before: list) -> str | None:
    after = snapshot(model)
    if [n for n, *_ in after] != [n for n, *_ in before]:
        return f"the model's tensors changed: {[n for n, *_ in before]} -> {[n for n, *_ in after]}"
    for (name, old, copy), (_, new, _) in zip(before, after, strict=True):
        if new is not old:
            return f"{name!r} was replaced by a {type(new).__name__} {tuple(new.shape)}"
        if copy is not None and not same_tensor(new, copy):
            return f"{name!r} changed in place"
    return None


# ---- comparisons ------------------------------------------------------------------------------


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`, whatever its strides (a damaged pickle may give a size-1 dim stride 0)."""
    flat = torch.empty(t.numel(), dtype=t.dtype, device=t.device)
    return flat.copy_(t.detach().reshape(-1)).view(torch.uint8)


def strictly_equal(a: Any, b: Any) -> bool:
    """Equal values of the same types (128 and 128.0 or True and 1 are not the same attr)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple | list):
        return len(a) == len(b) and all(map(strictly_equal, a, b))
    return a == b


def same_tensor(a: Any, b: torch.Tensor) -> bool:
    if isinstance(b, qshard.QTensor):
        if type(a) is not type(b) or not strictly_equal(a.logical_shape, b.logical_shape):
            return False
        if (a.dtype, a.transposed, tuple(a.shape)) != (b.dtype, b.transposed, tuple(b.shape)):
            return False
        if not all(
            strictly_equal(x, y) for x, y in zip(a.attr_values(), b.attr_values(), strict=True)
        ):
            return False
        for name in b.inner_names:
            x, y = getattr(a, name, None), getattr(b, name)
            if not isinstance(x, torch.Tensor) or (x.dtype, x.shape) != (y.dtype, y.shape):
                return False
            if not torch.equal(raw(x), raw(y)):
                return False
        return True
    if not isinstance(a, torch.Tensor) or isinstance(a, qshard.QTensor):
        return False
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(raw(a), raw(b))


def same_state(loaded: Any, expected: dict) -> bool:
    if not isinstance(loaded, dict) or list(loaded) != list(expected):
        return False
    if not all(same_tensor(loaded[k], v) for k, v in expected.items()):
        return False
    return aliases(loaded) == aliases(expected)


def aliases(state: dict) -> list[list[str]]:
    groups = collections.defaultdict(list)
    for key, value in state.items():
        groups[id(value)].append(key)
    return sorted(g for g in groups.values() if len(g) > 1)


def model_state(model: nn.Module) -> dict:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers(remove_duplicate=False))
    return {k: state[k] for k in sorted(state)}


def has_type(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if args and args[-1] is Ellipsis:
            return all(has_type(v, args[0]) for v in value)
        return len(value) == len(args) and all(map(has_type, value, args))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return isinstance(value, hint)
    if hint in (bool, int, str):
        return type(value) is hint
    if hint is float:
        return type(value) in (float, int)
    return True


def qtensor_problem(q: qshard.QTensor) -> str | None:
    """Why `q` is not a well-formed quantized weight (independently of the library's checks,
    apart from the layout's declarations: inner_specs and the attribute annotations)."""
    cls = type(q)
    shape = getattr(q, "logical_shape", None)
    sizes = isinstance(shape, tuple) and len(shape) in (2, 3)
    if not (sizes and all(type(s) is int for s in shape)):
        return f"logical_shape {shape!r}"
    if not all(0 <= s < 2**31 for s in shape) or type(q.transposed) is not bool:
        return f"logical_shape {shape!r}, transposed {q.transposed!r}"
    outer = (*shape[:-2], shape[-1], shape[-2]) if q.transposed else shape
    if tuple(q.shape) != outer or q.requires_grad:
        return f"outer shape {tuple(q.shape)} for logical {shape} (requires_grad={q.requires_grad})"
    for name, hint in attr_types(cls).items():
        if not has_type(getattr(q, name, None), hint):
            return f"attribute {name}={getattr(q, name, None)!r} is not a {hint}"
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"stands for {q.dtype}"
    extra = set(vars(q)) - {
        *cls.inner_names,
        *cls.attr_names,
        "logical_shape",
        "transposed",
        "write_barrier",
        "device_names",
        "device_meta",
        "form_owner",
        "_is_param",  # set by nn.Parameter on the tensor it wraps
    }
    extra -= set(q.device_names)  # a device form (tinygemm's packing) is made after loading
    if extra:
        return f"extra instance state {sorted(extra)}"
    specs = cls.inner_specs(shape, q.attrs())
    for name, (spec_shape, spec_dtype) in specs.items():
        inner = getattr(q, name, None)
        if type(inner) is not torch.Tensor:
            return f"inner {name!r} is a {type(inner).__name__}"
        if (tuple(inner.shape), inner.dtype) != (tuple(spec_shape), spec_dtype):
            return (
                f"inner {name!r} {inner.dtype}{list(inner.shape)} vs spec {spec_dtype}{spec_shape}"
            )
        if not inner.is_contiguous() or inner.device != q.device:
            return f"inner {name!r} not contiguous or on {inner.device}"
    try:
        values = q.dequantize(torch.float32)
    except Exception as e:
        return f"dequantize raised {type(e).__name__}: {e}"
    if not bool(torch.isfinite(values).all()):
        return "dequantizes to NaN/Inf"
    if values.numel() and values.abs().max().item() > torch.finfo(q.dtype).max:
        return f"dequantizes beyond the largest finite {q.dtype}"
    return None


def state_problem(state: Any) -> str | None:
    if not isinstance(state, dict):
        return f"a {type(state).__name__}, not a state_dict"
    for key, value in state.items():
        if isinstance(value, qshard.QTensor):
            problem = qtensor_problem(value)
            if problem:
                return f"{key!r}: {problem}"
        elif not isinstance(value, torch.Tensor):
            return f"{key!r} is a {type(value).__name__}"
        elif value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
            return f"{key!r} is a plain {value.dtype} tensor (raw codes or scales)"
    return None


def pickled_problem(obj: Any, path: str = "") -> str | None:
    """What torch.load gives back from an archive whose pickle may now describe any object:
    every QTensor in it, however deep, is well formed (plain tensors and other values are the
    archive's own business: torch.load of float8 or int tensors is ordinary)."""
    if isinstance(obj, qshard.QTensor):
        problem = qtensor_problem(obj)
        return f"{path or '<root>'}: {problem}" if problem else None
    children = []
    if isinstance(obj, dict):
        children = list(obj.items())
    elif isinstance(obj, list | tuple):
        children = list(enumerate(obj))
    for key, child in children:
        problem = pickled_problem(child, f"{path}[{key!r}]")
        if problem:
            return problem
    return None


def qshard_site(trace: list) -> str:
    frames = [f for f in trace if f.filename.startswith(QSHARD_DIR)]
    frame = (frames or trace or [None])[-1]
    if frame is None:
        return ""
    return f"{pathlib.Path(frame.filename).name}:{frame.lineno} {frame.name}"


def judge(
    reader: str,
    description: str,
    expect: str,
    outcome: Outcome,
    expected: Any,
    loaded_of: Callable[[Any], Any],
    nbytes: int,
    model=None,
    before=None,
    torch_errors: tuple = (),
    problem_of: Callable[[Any], str | None] | None = None,
) -> None:
    """The property of the module docstring for one read."""
    TRIED[reader.split("[")[0]] += 1
    name = reader.split("[")[0]
    if outcome.aborted:
        OUTCOMES[(name, "guard")] += 1
        escape(reader, "guard", description, outcome.aborted)
        return
    if outcome.largest > nbytes + SLACK:
        escape(
            reader,
            "allocation",
            description,
            f"{outcome.largest_op} returned {outcome.largest} bytes; files {nbytes}",
        )
    error = outcome.error
    if error is not None:
        if model is not None:
            problem = unchanged_problem(model, before)
            if problem:
                escape(reader, "model changed", description, problem)
        if isinstance(error, QShardError):
            OUTCOMES[(name, "QShardError")] += 1
            return
        in_qshard = any(f.filename.startswith(QSHARD_DIR) for f in outcome.trace)
        if not in_qshard and isinstance(error, torch_errors):
            OUTCOMES[(name, f"torch {type(error).__name__}")] += 1
            return
        site = qshard_site(outcome.trace)
        escape(
            reader,
            f"raw {type(error).__name__}",
            description,
            f"{type(error).__name__}: {error} (at {site})",
            site=f"{type(error).__name__} {site}",
        )
        return
    loaded = loaded_of(outcome.value)
    if same_state(loaded, expected):
        OUTCOMES[(name, "exact")] += 1
        return
    if expect == "refuse":
        escape(reader, "accepted invalid values", description, state_summary(loaded))
        return
    if expect == "exact":
        escape(reader, "silent wrong load", description, state_summary(loaded))
        return
    problem = (problem_of or state_problem)(loaded)
    if problem:
        escape(
            reader,
            "loaded a malformed tensor",
            description,
            problem,
            site=re.sub(r"'[^']*'|\d+", "#", problem)[:80],
        )
        return
    OUTCOMES[(name, "other valid")] += 1
    if len(VALID[reader]) < 100:
        VALID[reader].append(description)


def state_summary(state: Any) -> str:
    if not isinstance(state, dict):
        return repr(state)[:300]
    parts = []
    for key, value in state.items():
        if isinstance(value, qshard.QTensor):
            parts.append(
                f"{key}: {type(value).__name__}{list(value.logical_shape)} "
                f"{value.dtype} {value.attrs()}"
            )
        else:
            parts.append(
                f"{key}: {getattr(value, 'dtype', type(value))}{list(getattr(value, 'shape', []))}"
            )
    return "; ".join(parts)[:1500]


# ---- models built from a state_dict -------------------------------------------------------------


def build_model(state: dict, device: str, seed: int = 0, floating=None) -> nn.Module:
    """A module tree with a parameter (float) or buffer per key of `state`, of the outer shape
    and dtype (`floating` for the floating ones, if given); keys that alias one tensor are tied.
    Real values are random (not the state's)."""
    g = torch.Generator().manual_seed(seed)
    root, made = nn.Module(), {}
    for key, value in state.items():
        *path, attr = key.split(".")
        owner = root
        for part in path:
            if part not in owner._modules:
                owner.add_module(part, nn.Module())
            owner = owner._modules[part]
        if id(value) not in made:
            shape, dtype = tuple(value.shape), value.dtype
            if floating is not None and dtype.is_floating_point:
                dtype = floating
            if device == "meta":
                tensor = torch.empty(shape, dtype=dtype, device="meta")
            elif dtype.is_floating_point:
                tensor = torch.randn(shape, generator=g).to(dtype)
            else:
                tensor = torch.randint(0, 100, shape, generator=g).to(dtype)
            made[id(value)] = nn.Parameter(tensor) if dtype.is_floating_point else tensor
        tensor = made[id(value)]
        if isinstance(tensor, nn.Parameter):
            owner.register_parameter(attr, tensor)
        else:
            owner.register_buffer(attr, tensor)
    return root


# ---- mutations ----------------------------------------------------------------------------------

DEEP, HUGE = "@@deep@@", "@@huge@@"
SPECIAL_STRINGS = [
    "",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int8",
    "float8_e4m3fn",
    "auto",
    "fp8",
    "e4m3",
    "e5m2",
    "ue8m0",
    "fp32",
    "float",
    "int",
    "group",
    "tensor",
    "channel",
    "block",
    "tensor_group",
    "token",
    "dynamic",
    "static",
    "Linear",
    "re:.*",
    "*",
    "../model.safetensors",
    "/etc/passwd",
    "model.safetensors",
    "model-00001-of-00002.safetensors",
    "F8_E4M3",
    "U8",
    "I32",
    "F32",
    "BF16",
    "F64",
    "qtensor",
    "tensor",
    "alias",
    "Fp8BlockwiseTensor",
    "Int4Tensor",
    "Nvfp4Tensor",
    "Mxfp4Tensor",
    "Fp8RowwiseTensor",
    "QTensor",
    "NVFP4",
    "FP8",
    "MXFP4",
    "pack-quantized",
    "float-quantized",
    "nvfp4-pack-quantized",
    "compressed-tensors",
    "torchao",
    "mxfp4",
    "fbgemm_fp8",
    "modelopt",
    "Float8Tensor",
    "Int4Tensor",
    "PerRow",
    "PerTensor",
    "PerBlock",
    "\x00",
    "\udcff",
    "é" * 3,
]
KEY_NAMES = [
    "quantization_config",
    "quant_method",
    "weight_block_size",
    "scale_fmt",
    "fmt",
    "activation_scheme",
    "torch_dtype",
    "dtype",
    "config_groups",
    "weights",
    "num_bits",
    "group_size",
    "symmetric",
    "strategy",
    "block_structure",
    "targets",
    "ignore",
    "input_activations",
    "format",
    "quantization",
    "quant_algo",
    "exclude_modules",
    "modules_to_not_convert",
    "activation_scale_ub",
    "weight_map",
    "metadata",
    "total_size",
    "__metadata__",
    "shape",
    "data_offsets",
    "entries",
    "kind",
    "layout",
    "attrs",
    "inner",
    "key",
    "crc32",
    "of",
    "transposed",
    "config",
    "format_version",
    "save_id",
    "block_size",
    "group_size",
    "_type",
    "_data",
    "_tensor_data_names",
    "act_quant_kwargs",
    "kv_cache_scheme",
    "dequantize",
    "__class__",
    "tensor_names",
]
NUMBERS = [
    0,
    -1,
    1,
    2,
    7,
    8,
    15,
    16,
    17,
    31,
    32,
    63,
    64,
    100,
    127,
    128,
    129,
    255,
    256,
    257,
    2**31 - 1,
    2**31,
    2**32 + 128,
    2**53 + 1,
    2**63,
    2**64,
    10**30,
    -(2**63),
    16.5,
    128.0,
    0.5,
    -0.0,
    1e308,
    5e-324,
    float("nan"),
    float("inf"),
    -float("inf"),
    True,
    False,
]

json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(NUMBERS),
    st.floats(),
    st.text(max_size=8),
    st.sampled_from(SPECIAL_STRINGS),
    st.sampled_from([DEEP, HUGE]),
)
json_values = st.recursive(
    json_leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(KEY_NAMES) | st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=8,
)


def dump_json(tree: Any, draw) -> str:
    text = json.dumps(tree, allow_nan=True, ensure_ascii=draw(st.booleans()))
    if f'"{DEEP}"' in text:
        depth = draw(st.sampled_from([40, 900, 1100, 5000, 100_000]))
        brackets = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        text = text.replace(f'"{DEEP}"', brackets[0] * depth + "1" + brackets[1] * depth)
    if f'"{HUGE}"' in text:
        digits = draw(st.sampled_from([19, 20, 40, 400, 4000, 4301, 6000]))
        sign = draw(st.sampled_from(["", "-"]))
        text = text.replace(f'"{HUGE}"', sign + "9" * digits)
    return text


def json_paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += json_paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += json_paths(v, (*prefix, i))
    return out


def swapped_type(value: Any) -> list:
    """The same value in other JSON types: 128 -> 128.0, "128", true, [128]."""
    out = [[value], {"value": value}, str(value)]
    if isinstance(value, bool):
        out += [int(value), float(value)]
    elif isinstance(value, int | float):
        out += [float(value), -value, value + 0.5, bool(value)]
        if isinstance(value, float) and value.is_integer():
            out.append(int(value))
    elif isinstance(value, str):
        out += [value.upper(), value + " ", " " + value, value[:-1], value * 2]
    return out


@st.composite
def json_edit(draw, tree: Any) -> tuple[Any, str]:
    """A structured change of a JSON tree: one value replaced (by a random value or the same
    value in another type), a key deleted, renamed or added, a list shortened or extended."""
    import copy

    tree = copy.deepcopy(tree)
    paths = json_paths(tree)
    path = draw(st.sampled_from(paths))
    parent = tree
    for part in path[:-1]:
        parent = parent[part]
    current = parent[path[-1]] if path else tree
    kinds = ["replace", "swap type"]
    if path:
        kinds += ["delete"]
    if isinstance(current, dict):
        kinds += ["add key", "rename key"] if current else ["add key"]
    if isinstance(current, list):
        kinds += ["append", "truncate"]
    kind = draw(st.sampled_from(kinds))
    where = ".".join(map(str, path)) or "<root>"
    if kind in ("replace", "swap type"):
        if kind == "replace":
            new = draw(json_values)
        else:
            new = draw(st.sampled_from(swapped_type(current)))
        if not path:
            return new, f"root = {new!r}"[:300]
        parent[path[-1]] = new
        return tree, f"{where} = {new!r}"[:300]
    if kind == "delete":
        del parent[path[-1]]
        return tree, f"delete {where}"
    if kind == "add key":
        key = draw(st.sampled_from(KEY_NAMES) | st.text(max_size=5))
        value = draw(json_values)
        current[key] = value
        return tree, f"{where}[{key!r}] = {value!r}"[:300]
    if kind == "rename key":
        old = draw(st.sampled_from(sorted(current)))
        new_key = draw(st.sampled_from(KEY_NAMES) | st.text(max_size=5))
        current[new_key] = current.pop(old)
        return tree, f"{where}: rename {old!r} -> {new_key!r}"
    if kind == "append":
        value = draw(json_values | st.sampled_from(current or [0]))
        current.append(value)
        return tree, f"{where}.append({value!r})"[:300]
    cut = draw(st.integers(0, max(len(current) - 1, 0)))
    del current[cut:]
    return tree, f"{where}: truncate to {cut}"


@st.composite
def byte_edit(draw, data: bytes, low: int = 0, high: int | None = None) -> tuple[bytes, str]:
    """A raw change in data[low:high]: a byte xor-ed, a cut, bytes appended, inserted or
    deleted."""
    high = len(data) if high is None else high
    kind = draw(st.sampled_from(["flip", "flip", "flip", "cut", "append", "insert", "delete"]))
    if kind == "cut" or not data:
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        return data[:at], f"cut to {at} bytes"
    if kind == "append":
        extra = draw(st.binary(min_size=1, max_size=16))
        return data + extra, f"append {extra!r}"
    at = draw(st.integers(low, max(low, high - 1)))
    if kind == "insert":
        extra = draw(st.binary(min_size=1, max_size=8))
        return data[:at] + extra + data[at:], f"insert {extra!r} at {at}"
    if kind == "delete":
        count = draw(st.integers(1, 8))
        return data[:at] + data[at + count :], f"delete {count} bytes at {at}"
    flip = draw(st.integers(1, 255))
    mutated = bytearray(data)
    mutated[at] ^= flip
    return bytes(mutated), f"byte {at} ^= {flip:#04x}"


# ---- safetensors files --------------------------------------------------------------------------

ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join_safetensors(header: Any, body: bytes, text: str | None = None) -> bytes:
    text = json.dumps(header, separators=(",", ":")) if text is None else text
    encoded = text.encode("utf-8", "surrogatepass")
    encoded += b" " * (-len(encoded) % 8)
    return len(encoded).to_bytes(8, "little") + encoded + body


def is_safetensors(name: str) -> bool:
    return name.endswith(".safetensors")


def tensor_entries(header: dict) -> list[str]:
    return sorted(k for k in header if k != "__metadata__")


def recompute_qshard_crcs(header: dict, body: bytes, stored_key: str | None) -> None:
    """After `stored_key`'s bytes changed: its crc32 in qshard's metadata, then the metadata's
    own CRC (qshard/io/format.py), so that the checks behind the checksums are reached."""
    metadata = header.get("__metadata__") or {}
    if "qshard" not in metadata:
        return
    meta = json.loads(metadata["qshard"])
    if stored_key is not None:
        info = header[stored_key]
        start, end = info["data_offsets"]
        crc = zlib.crc32(body[start:end])
        for entry in meta.get("entries", {}).values():
            described = [entry.get("tensor"), *(entry.get("inner") or {}).values()]
            for stored in described:
                if isinstance(stored, dict) and stored.get("key") == stored_key:
                    stored["crc32"] = crc
    text = json.dumps(meta, separators=(",", ":"))
    metadata["qshard"] = text
    metadata["qshard_crc32"] = f"{zlib.crc32(text.encode()):08x}"


def quantized_role(name: str, header: dict) -> str | None:
    """What a stored tensor is to a quantized weight, or None for a plain tensor (a norm, a
    bias, an unquantized linear, a dropped activation scale)."""
    metadata = header.get("__metadata__") or {}
    if "qshard" in metadata:
        for entry in json.loads(metadata["qshard"]).get("entries", {}).values():
            for inner, stored in (entry.get("inner") or {}).items():
                if stored.get("key") == name:
                    attrs = entry.get("attrs") or {}
                    if inner == "zero" and attrs.get("zero_point_domain") == "int":
                        return "int zero"
                    if entry.get("layout") == "Mxfp4Tensor" and inner == "scale":
                        return "e8m0 scale"
                    return "scale" if inner != "qdata" else "codes"
        return None
    if name.endswith(("input_scale", "k_scale", "v_scale")):
        return None
    if name.endswith("weight_global_scale"):
        return "divisor"
    if name.endswith("_scales"):
        return "e8m0 scale"
    if name.endswith(("weight_scale", "weight_scale_inv", "weight_scale_2", "_weight_scale")):
        return "scale"
    if name.endswith(("_weight_zero_point", "weight_zero_point")):
        return "zero"
    if name.endswith(("weight_packed", "_blocks", "_weight_qdata", "weight_shape")):
        return "codes"
    if header[name]["dtype"] in ("F8_E4M3", "F8_E5M2"):
        return "codes"
    return None


def special_values(dtype: torch.dtype, role: str | None) -> list[tuple[Any, bool]]:
    """(value, must be refused) for an element of a `dtype` tensor with `role`."""
    part_of_weight = role is not None
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        nan = [0x7F, 0xFF] if dtype == torch.float8_e4m3fn else [0x7C, 0xFE, 0xFF]
        return [(("byte", b), part_of_weight) for b in nan] + [
            (("byte", b), False) for b in (0x00, 0x80, 0x7E, 0xFE, 0x01)
        ]
    if dtype == torch.float8_e8m0fnu or role == "e8m0 scale":
        return [(("byte", 0xFF), part_of_weight), (("byte", 0x00), False), (("byte", 0xFE), False)]
    if dtype.is_floating_point:
        finfo = torch.finfo(dtype)
        values = [
            (float("nan"), part_of_weight),
            (float("inf"), part_of_weight),
            (-float("inf"), part_of_weight),
            (0.0, role == "divisor"),
            (-0.0, role == "divisor"),
            (finfo.max, False),
            (-finfo.max, False),
            (finfo.tiny, False),
            (finfo.smallest_normal / 4, False),
            (-1.0, False),
            (1e4, False),
        ]
        if role == "int zero":
            values += [(16.0, True), (-1.0, True), (0.5, True), (15.5, True), (1e4, True)]
        return values
    if dtype == torch.bool:
        return [(True, False), (False, False)]
    info = torch.iinfo(dtype)
    return [
        (v, False)
        for v in (info.max, info.min, 0, -1 if info.min < 0 else 1, 2**20)
        if info.min <= v <= info.max
    ]


@st.composite
def value_edit(draw, data: bytes) -> tuple[bytes, str, bool]:
    """A tensor of a safetensors file gets special values (NaN, Inf, 0, the largest, e4m3 NaN
    bytes, e8m0 255, int4 zero codes out of range) at one element, one row or everywhere;
    qshard's checksums are recomputed. Returns (file, description, must be refused)."""
    header, body = split_safetensors(data)
    names = [
        n
        for n in tensor_entries(header)
        if header[n]["data_offsets"][1] > header[n]["data_offsets"][0]
    ]
    name = draw(st.sampled_from(names))
    info = header[name]
    dtype, shape = ST_DTYPES[info["dtype"]], info["shape"]
    start, end = info["data_offsets"]
    role = quantized_role(name, header)
    value, refuse = draw(st.sampled_from(special_values(dtype, role)))
    tensor = torch.frombuffer(bytearray(body[start:end]), dtype=torch.uint8).view(dtype)
    count = tensor.numel()
    where = draw(st.sampled_from(["one", "row", "all"]))
    if where == "one":
        index = draw(st.integers(0, count - 1))
        chosen = slice(index, index + 1)
    elif where == "row" and len(shape) >= 1 and shape[0] > 0:
        row = count // shape[0]
        index = draw(st.integers(0, shape[0] - 1))
        chosen = slice(index * row, (index + 1) * row)
    else:
        chosen = slice(0, count)
    if isinstance(value, tuple):
        tensor.view(torch.uint8)[chosen] = value[1]
    else:
        tensor[chosen] = value
    new_body = body[:start] + bytes(tensor.view(torch.uint8).numpy()) + body[end:]
    recompute_qshard_crcs(header, new_body, name)
    text = f"{name} ({info['dtype']}, {role or 'plain'})[{chosen.start}:{chosen.stop}] = {value}"
    return join_safetensors(header, new_body), text, refuse


@st.composite
def header_edit(draw, data: bytes) -> tuple[bytes, str]:
    """A structured change of a safetensors header (its JSON, re-encoded with a right length),
    or of the JSON inside one of its metadata strings (qshard's, torchao's), with qshard's
    metadata CRC recomputed when it is qshard's."""
    header, body = split_safetensors(data)
    metadata = header.get("__metadata__") or {}
    nested = [k for k, v in metadata.items() if v[:1] in ("{", "[")]
    if nested and draw(st.booleans()):
        key = draw(st.sampled_from(nested))
        tree, text = draw(json_edit(json.loads(metadata[key])))
        metadata[key] = dump_json(tree, draw)
        if key == "qshard" and draw(st.integers(0, 9)) > 0:
            crc = zlib.crc32(metadata[key].encode("utf-8", "surrogatepass"))
            metadata["qshard_crc32"] = f"{crc:08x}"
            text += " (metadata CRC recomputed)"
        return join_safetensors(header, body), f"__metadata__[{key!r}]: {text}"
    tree, text = draw(json_edit(header))
    return join_safetensors(None, body, dump_json(tree, draw)), f"header: {text}"


@st.composite
def file_edit(draw, files: dict[str, bytes], json_names: list[str]) -> tuple[dict, str, str]:
    """One change to a checkpoint directory; returns (files, description, expect) where expect
    is what the file's checks allow ("exact", "valid" or "refuse") for a checksummed (qshard)
    directory; the caller relaxes it for formats without checksums."""
    files = dict(files)
    names = sorted(files)
    family = draw(
        st.sampled_from(["bytes", "bytes", "json", "header", "values", "values", "files"])
    )
    if family == "json" and json_names:
        name = draw(st.sampled_from(json_names))
        tree, text = draw(json_edit(json.loads(files[name])))
        files[name] = dump_json(tree, draw).encode("utf-8", "surrogatepass")
        return files, f"{name}: {text}", "valid"
    tensors = [n for n in names if is_safetensors(n)]
    if family == "header":
        name = draw(st.sampled_from(tensors))
        files[name], text = draw(header_edit(files[name]))
        return files, f"{name}: {text}", "valid"
    if family == "values":
        name = draw(st.sampled_from(tensors))
        files[name], text, refuse = draw(value_edit(files[name]))
        return files, f"{name}: {text}", "refuse" if refuse else "valid"
    if family == "files" and len(names) > 1:
        kind = draw(st.sampled_from(["delete", "copy", "swap"]))
        name = draw(st.sampled_from(names))
        if kind == "delete":
            del files[name]
            return files, f"delete {name}", "valid"
        other = draw(st.sampled_from(names))
        if kind == "swap":
            files[name], files[other] = files[other], files[name]
            return files, f"swap the contents of {name} and {other}", "valid"
        target = draw(
            st.sampled_from(
                [
                    *names,
                    "model.safetensors",
                    "extra.safetensors",
                    "model-00002-of-00002.safetensors",
                ]
            )
        )
        files[target] = files[name]
        return files, f"copy {name} over {target}", "valid"
    name = draw(st.sampled_from(names))
    data = files[name]
    region = (0, len(data))
    if is_safetensors(name) and len(data) > 8:
        end = 8 + int.from_bytes(data[:8], "little")
        region = draw(st.sampled_from([(0, 8), (8, end), (end, len(data)), (0, len(data))]))
    files[name], text = draw(byte_edit(data, *region))
    return files, f"{name}: {text}", "exact"


class Drawn(tuple):
    """A drawn mutation, shown by hypothesis as its description (not as kilobytes of file)."""

    def __repr__(self) -> str:
        return next((x for x in self if isinstance(x, str)), "<mutation>")

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis' printer of draws
        printer.text(repr(self))


def quiet(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return strategy.map(Drawn)


def write_files(directory: pathlib.Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (directory / name).write_bytes(data)


def read_files(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# ---- (a) qshard.load ----------------------------------------------------------------------------


@dataclasses.dataclass
class Built:
    files: dict[str, bytes]
    state: dict
    json_names: list[str]


@functools.cache
def qshard_checkpoint(case: int, sharded: bool) -> Built:
    """LAYOUT_CASES[case] as a quantized weight with partial edge blocks, a float bias, a tied
    embedding and an integer buffer; one file, or shards with an index."""
    cls, config = LAYOUT_CASES[case]
    g = torch.Generator().manual_seed(case)
    embed = torch.randn(40, 24, generator=g)
    state = {
        "up.weight": cls.from_float(torch.randn(72, 96, generator=g), config),
        "up.bias": torch.randn(72, generator=g),
        "embed.weight": embed,
        "head.weight": embed,
        "steps": torch.tensor([7, -3], dtype=torch.int64),
    }
    with tempfile.TemporaryDirectory() as directory:
        qshard.save(state, directory, max_shard_size=2048 if sharded else "5GB")
        files = read_files(pathlib.Path(directory))
    assert (len(files) > 2) == sharded, sorted(files)
    json_names = [n for n in files if n.endswith(".json")]
    return Built(files, state, json_names)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)), ids=LAYOUT_IDS)
@FUZZ
@given(data=st.data())
def test_qshard_load_of_a_mutated_checkpoint(case, sharded, data):
    built = qshard_checkpoint(case, sharded)
    mutated, description, expect = data.draw(quiet(file_edit(built.files, built.json_names)))
    into = data.draw(st.sampled_from(QSHARD_LOAD_MODELS))
    read_directory(
        "qshard.load",
        LAYOUT_IDS[case],
        (case, sharded),
        built,
        mutated,
        description,
        expect,
        into,
        lambda directory, model: qshard.load(directory, model),
    )


# Where a read puts the tensors: a state_dict (None), a model on the meta device or with real
# CPU tensors, or a meta model of another float dtype (qshard.load casts plain tensors to it
# and re-checks the quantized weights' magnitudes for it).
QSHARD_LOAD_MODELS = [None, "meta", "cpu", "meta bfloat16"]
PRETRAINED_MODELS = [None, "meta", "cpu", "meta float32"]


def make_model(built: Built, into: str | None, seed: int) -> nn.Module | None:
    if into is None:
        return None
    device, _, dtype = into.partition(" ")
    return build_model(built.state, device, seed, getattr(torch, dtype) if dtype else None)


@functools.cache
def expected_in_model(reader: str, key: tuple, into: str) -> dict:
    """What the reader puts into a fresh `into` model from the unmutated files."""
    built = qshard_checkpoint(*key) if reader == "qshard.load" else format_checkpoint(*key)
    model = make_model(built, into, seed=0)
    with tempfile.TemporaryDirectory() as directory:
        write_files(pathlib.Path(directory), built.files)
        if reader == "qshard.load":
            qshard.load(directory, model)
        else:
            qshard.load_pretrained(directory, model=model)
    return model_state(model)


def read_directory(
    reader: str,
    case_id: str,
    key: tuple,
    built: Built,
    files: dict,
    description: str,
    expect: str,
    into: str | None,
    read: Callable,
) -> None:
    """Write the mutated files, read them (into a model if `into`) under the guards, judge."""
    name = f"{reader}{'' if into is None else ' into a ' + into + ' model'}[{case_id}]"
    model = make_model(built, into, seed=len(description))
    before = snapshot(model)
    nbytes = sum(map(len, files.values()))
    with tempfile.TemporaryDirectory() as directory:
        write_files(pathlib.Path(directory), files)
        outcome = guarded(lambda: read(directory, model), nbytes)
    if model is None:
        expected, loaded_of = built.state, (lambda v: v)
    else:
        expected, loaded_of = expected_in_model(reader, key, into), model_state
    judge(name, description, expect, outcome, expected, loaded_of, nbytes, model, before)


# ---- (b) qshard.load_pretrained ------------------------------------------------------------------


def modelopt_nvfp4(directory: pathlib.Path) -> None:
    n, k = 64, 96
    tensors = {
        "proj.weight": random_bytes(n, k // 2, seed=3),
        "proj.weight_scale": random_e4m3(n, k // 16, seed=4),
        "proj.weight_scale_2": torch.tensor(3.5e-4),
        "proj.input_scale": torch.tensor(0.01),
        "head.weight": torch.randn(8, k, generator=torch.Generator().manual_seed(1)),
        "attn.k_proj.k_scale": torch.tensor(0.02),
    }
    hf_quant = {
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {
            "quant_algo": "NVFP4",
            "group_size": 16,
            "exclude_modules": ["head"],
            "kv_cache_quant_algo": "FP8",
        },
    }
    write_checkpoint(directory, tensors, {"torch_dtype": "float16"}, hf_quant)


def compressed_nvfp4(directory: pathlib.Path) -> None:
    n, k = 32, 64
    weights = {
        "num_bits": 4,
        "type": "float",
        "strategy": "tensor_group",
        "group_size": 16,
        "symmetric": True,
        "dynamic": False,
    }
    qc = {
        "quant_method": "compressed-tensors",
        "format": "nvfp4-pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }
    tensors = {
        "fc.weight_packed": random_bytes(n, k // 2, seed=6),
        "fc.weight_scale": random_e4m3(n, k // 16, seed=7),
        "fc.weight_global_scale": torch.tensor([2.9e3]),
        "lm_head.weight": torch.randn(4, k, dtype=torch.bfloat16),
    }
    write_checkpoint(directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})


def compressed_fp8(strategy: str, acts: str | None) -> Callable[[pathlib.Path], None]:
    def write(directory: pathlib.Path) -> None:
        n, k = 200, 300
        shape, blocks = {
            "channel": ((n, 1), None),
            "tensor": ((1,), None),
            "block": ((2, 3), [128, 128]),
        }[strategy]
        g = torch.Generator().manual_seed(4)
        scale = ((torch.rand(shape, generator=g) + 0.5) / 448).to(torch.bfloat16)
        weights = {
            "num_bits": 8,
            "type": "float",
            "symmetric": True,
            "strategy": strategy,
            "block_structure": blocks,
            "dynamic": False,
        }
        activations = None
        if acts is not None:
            activations = {
                "num_bits": 8,
                "type": "float",
                "dynamic": acts == "dynamic",
                "strategy": "token" if acts == "dynamic" else "tensor",
            }
        tensors = {
            "fc.weight": random_e4m3(n, k, seed=3),
            "fc.weight_scale": scale,
            "fc.bias": torch.randn(n, dtype=torch.bfloat16),
        }
        if acts == "static":
            tensors["fc.input_scale"] = torch.tensor([0.01])
        group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
        qc = {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": group},
            "ignore": [],
        }
        write_checkpoint(directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})

    return write


def fbgemm_fp8(directory: pathlib.Path) -> None:
    n, k = 96, 160
    scale = (torch.rand(n, 1, generator=torch.Generator().manual_seed(9)) + 0.5) / 448
    qc = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["lm_head"],
    }
    tensors = {
        "fc.weight": random_e4m3(n, k, seed=8),
        "fc.weight_scale": scale,
        "lm_head.weight": torch.randn(16, k, dtype=torch.bfloat16),
    }
    write_checkpoint(directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})


def gpt_oss_mxfp4(directory: pathlib.Path) -> None:
    experts, rows, k = 2, 64, 128
    g = torch.Generator().manual_seed(9)
    prefix = "model.layers.0.mlp.experts.down_proj"
    tensors = {
        prefix + "_blocks": random_bytes(experts, rows, k // 32, 16, seed=8),
        prefix + "_scales": torch.randint(
            118, 134, (experts, rows, k // 32), generator=g, dtype=torch.uint8
        ),
        prefix + "_bias": torch.randn(experts, rows, dtype=torch.bfloat16),
    }
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    write_checkpoint(directory, tensors, {"torch_dtype": "bfloat16", "quantization_config": qc})


def torchao_float8_blocks(directory: pathlib.Path) -> None:
    codes = random_bytes(256, 384, seed=10)
    codes[(codes & 0x7F) == 0x7F] = 0x20
    scale = torch.rand(2, 3, generator=torch.Generator().manual_seed(11)) + 0.5
    entries = {"0.weight": float8_entry([128, 128]), "0.bias": {"_type": "Tensor"}}
    tensors = {
        "0._weight_qdata": codes.view(torch.float8_e4m3fn),
        "0._weight_scale": scale,
        "0.bias": torch.randn(256, dtype=torch.bfloat16),
    }
    torchao_checkpoint(directory, entries, tensors)


def torchao_fixture(directory: pathlib.Path) -> None:
    """The checkpoint torchao 0.18.0 itself wrote (per-row, per-tensor, block FP8, Int4)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(TORCHAO_FIXTURE / name, directory / name)


FORMAT_CASES: dict[str, Callable[[pathlib.Path], Any]] = {
    "deepseek-fp8": lambda d: deepseek_checkpoint(d),
    "deepseek-fp8-ue8m0": lambda d: deepseek_checkpoint(d, scale_fmt="ue8m0"),
    "modelopt-nvfp4": modelopt_nvfp4,
    "ct-int4-asym": lambda d: compressed_int4_checkpoint(d, False),
    "ct-int4-sym": lambda d: compressed_int4_checkpoint(d, True, group=64),
    "ct-nvfp4": compressed_nvfp4,
    "ct-fp8-channel-static": compressed_fp8("channel", "static"),
    "ct-fp8-tensor-weight-only": compressed_fp8("tensor", None),
    "ct-fp8-block-dynamic": compressed_fp8("block", "dynamic"),
    "fbgemm-fp8": fbgemm_fp8,
    "gpt-oss-mxfp4": gpt_oss_mxfp4,
    "torchao-float8-blocks": torchao_float8_blocks,
    "torchao-fixture": torchao_fixture,
}


@functools.cache
def format_checkpoint(name: str) -> Built:
    with tempfile.TemporaryDirectory() as directory:
        path = pathlib.Path(directory) / "ckpt"
        FORMAT_CASES[name](path)
        files = read_files(path)
        state = qshard.load_pretrained(path)
    json_names = [n for n in files if n.endswith(".json")]
    return Built(files, state, json_names)


@pytest.mark.parametrize("fmt", list(FORMAT_CASES))
@FUZZ
@given(data=st.data())
def test_load_pretrained_of_a_mutated_checkpoint(fmt, data):
    built = format_checkpoint(fmt)
    mutated, description, expect = data.draw(quiet(file_edit(built.files, built.json_names)))
    if expect == "exact":
        expect = "valid"  # no checksums in other producers' files: the bytes may be other weights
    into = data.draw(st.sampled_from(PRETRAINED_MODELS))
    read_directory(
        "load_pretrained",
        fmt,
        (fmt,),
        built,
        mutated,
        description,
        expect,
        into,
        lambda directory, model: qshard.load_pretrained(directory, model=model),
    )


# ---- (c) torch.load(weights_only=True) -------------------------------------------------------

ARCHIVE_ERRORS = (
    RuntimeError,  # PytorchStreamReader: zip directory, record headers and sizes
    pickle.UnpicklingError,  # the weights-only unpickler refusing an opcode, global or protocol
    KeyError,  # a memo index or `_get_layout` name that the damage changed
    UnicodeDecodeError,  # a damaged BINUNICODE string
    ValueError,  # an enum rebuilt from a damaged value, e.g. Backend('quto')
    IndexError,  # the unpickler popping an empty stack ("pop from empty list")
    EOFError,  # the pickle stream ends early
    # torch's allow-listed rebuild functions called with the arguments a damaged pickle gives:
    # _rebuild_tensor's set_(), _rebuild_wrapper_subclass / _rebuild_tensor_v3 missing or
    # mistyped arguments, persistent_load's `saved_id must be a tuple` assert and its
    # `'str' object has no attribute 'dtype'`
    TypeError,
    AttributeError,
    AssertionError,
)


@functools.cache
def pickled(case: int, container: str) -> tuple[bytes, Any]:
    cls, config = LAYOUT_CASES[case]
    g = torch.Generator().manual_seed(100 + case)
    weight = cls.from_float(torch.randn(72, 96, generator=g), config)
    bias = torch.randn(72, generator=g)
    obj = weight if container == "tensor" else {"w": weight, "bias": bias, "tied": bias}
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue(), obj


def as_state(obj: Any) -> Any:
    return {"": obj} if isinstance(obj, torch.Tensor) else obj


@contextlib.contextmanager
def pickled_as(target: qshard.QTensor, args: tuple, state: dict):
    """torch.save writes `target` with these `_rebuild_wrapper_subclass` arguments and this
    state (what its __reduce_ex__ would give, changed), during the save only."""
    cls = type(target)
    original = cls.__dict__.get("__reduce_ex__")
    inherited = cls.__reduce_ex__

    def reduce(self, protocol):
        if self is not target:
            return inherited(self, protocol)
        rebuild, (func, new_type, _, _) = inherited(self, protocol)
        return rebuild, (func, new_type, args, state)

    cls.__reduce_ex__ = reduce
    try:
        yield
    finally:
        if original is None:
            del cls.__reduce_ex__
        else:
            cls.__reduce_ex__ = original


EXTRA_KEYS = [
    "dequantize",
    "_linear",
    "__class__",
    "__dict__",
    "shape",
    "inner_names",
    "attr_names",
    "device_form",
    "scale_extra",
    "foo",
    "__torch_dispatch__",
]


def state_values(q: qshard.QTensor) -> st.SearchStrategy:
    """Values a pickled state entry may be given: numbers, strings, tuples and lists of them,
    tensors of other shapes and dtypes, enums of every layout, another QTensor."""
    from qshard.config import Backend, ScaleFormat
    from qshard.layouts.int4 import ZeroPointDomain

    tensors = st.sampled_from(
        [
            torch.zeros(0),
            torch.zeros(3, 4),
            torch.full((72, 96), float("nan")),
            torch.zeros(1, 1),
            torch.ones(72, 1) * float("inf"),
            torch.zeros(72, 96, dtype=torch.uint8),
            torch.zeros(72, 48, dtype=torch.uint8),
            torch.zeros(72, 96).to(torch.float8_e4m3fn),
            torch.zeros(72, 96, 1),
            torch.zeros(10**6, dtype=torch.uint8)[:4],
            torch.zeros(72, 96).t(),
            torch.zeros(72, 96, dtype=torch.bfloat16),
        ]
    )
    numbers = st.sampled_from(NUMBERS) | st.integers()
    scalars = (
        numbers
        | st.none()
        | st.text(max_size=6)
        | st.sampled_from([*Backend, *ScaleFormat, *ZeroPointDomain])
    )
    return st.one_of(
        scalars,
        st.tuples(numbers, numbers),
        st.tuples(numbers),
        st.tuples(numbers, numbers, numbers),
        st.lists(numbers, max_size=3),
        tensors,
        st.just(q.detach().clone()),
        st.dictionaries(st.text(max_size=4), scalars, max_size=2),
    )


@st.composite
def pickle_edit(draw, q: qshard.QTensor) -> tuple[tuple, dict, str, str, bool]:
    """(wrapper args, state, description, expect, the change is to the wrapper's arguments)."""
    _, (_, _, args, state) = type(q).__reduce_ex__(q, 2)
    state = dict(state)
    kind = draw(st.sampled_from(["replace", "replace", "delete", "add", "inner", "args"]))
    if kind == "args":
        args = list(args)
        position = draw(st.sampled_from([1, 2, 3, 7]))  # dtype, size, stride, requires_grad
        if position == 1:
            new = draw(
                st.sampled_from(
                    [
                        torch.float16,
                        torch.bfloat16,
                        torch.float64,
                        torch.int8,
                        torch.float8_e4m3fn,
                        torch.complex64,
                        torch.bool,
                    ]
                )
            )
        elif position in (2, 3):
            sizes = st.sampled_from([0, 1, 72, 96, 48, 10**9, 2**31, 2**40, -1])
            new = tuple(draw(st.lists(sizes, min_size=1, max_size=3)))
        else:
            new = True
        args[position] = new
        return tuple(args), state, f"wrapper argument {position} = {new!r}", "valid", True
    if kind == "delete":
        key = draw(st.sampled_from(sorted(state)))
        del state[key]
        optional = key in ("write_barrier", "device_names", "device_meta", "form_owner")
        optional = optional or key in type(q).attr_defaults
        return args, state, f"delete state[{key!r}]", "valid" if optional else "refuse", False
    if kind == "add":
        key = draw(st.sampled_from(EXTRA_KEYS))
        value = draw(state_values(q) | st.just(print))
        state[key] = value
        return args, state, f"state[{key!r}] = {value!r}"[:300], "refuse", False
    if kind == "inner":
        name = draw(st.sampled_from(list(type(q).inner_names)))
        inner = state[name].clone()
        if inner.numel() == 0:
            return args, state, "no change (empty inner tensor)", "exact", False
        values = special_values(inner.dtype, "scale" if name != "qdata" else "codes")
        value, refuse = draw(st.sampled_from(values))
        flat = inner.view(-1)
        index = draw(st.integers(0, flat.numel() - 1))
        if isinstance(value, tuple):
            flat.view(torch.uint8)[index] = value[1]
        else:
            flat[index] = value
        zero_int = name == "zero" and getattr(q, "zero_point_domain", None) is not None
        zero_int = zero_int and q.zero_point_domain.value == "int" and not q.symmetric
        if zero_int and not isinstance(value, tuple) and not (0 <= value <= 15 and value % 1 == 0):
            refuse = True
        state[name] = inner
        return args, state, f"{name}[{index}] = {value}", "refuse" if refuse else "valid", False
    key = draw(st.sampled_from(sorted(state)))
    value = draw(state_values(q) | st.sampled_from(swapped_type(state[key])))
    state[key] = value
    return args, state, f"state[{key!r}] = {value!r}"[:300], "valid", False


@pytest.mark.parametrize("container", ["tensor", "state_dict"])
@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)), ids=LAYOUT_IDS)
@FUZZ
@given(data=st.data())
def test_torch_load_weights_only_of_a_mutated_pickle(case, container, data):
    original, obj = pickled(case, container)
    reader = f"torch.load[{LAYOUT_IDS[case]}-{container}]"
    if data.draw(st.booleans()):
        # The archive's bytes: torch's zip reader and unpickler see them first.
        pkl_start = original.index(zipfile.ZipFile(io.BytesIO(original)).read("archive/data.pkl"))
        region = data.draw(st.sampled_from([(0, len(original)), (pkl_start, pkl_start + 900)]))
        mutated, description = data.draw(quiet(byte_edit(original, *region)))
        expect, accepted, reader = "valid", ARCHIVE_ERRORS, reader.replace("[", "(archive)[")
    else:
        q = obj if container == "tensor" else obj["w"]
        args, state, description, expect, outer = data.draw(quiet(pickle_edit(q)))
        buffer = io.BytesIO()
        try:
            with pickled_as(q, args, state):
                torch.save(obj, buffer)
        except Exception as e:  # e.g. a value torch.save cannot pickle: not an input
            UNSAVABLE[type(e).__name__] += 1
            return
        mutated = buffer.getvalue()
        accepted = (pickle.UnpicklingError, RuntimeError) if outer else (pickle.UnpicklingError,)
        reader = reader.replace("[", "(state)[")
    outcome = guarded(lambda: torch.load(io.BytesIO(mutated), weights_only=True), len(mutated))
    judge(
        reader,
        description,
        expect,
        outcome,
        as_state(obj),
        as_state,
        len(mutated),
        torch_errors=accepted,
        problem_of=pickled_problem,
    )


def test_the_guards_catch_an_oversized_allocation_and_a_slow_read():
    """The allocation guard refuses a factory op before it allocates and records what ops
    return; the time limit interrupts a read that does not end."""
    outcome = guarded(lambda: torch.empty(2**40, dtype=torch.uint8), 1000)
    assert outcome.aborted and "bytes" in outcome.aborted
    outcome = guarded(lambda: torch.ones(1000).repeat(1000), 1000)
    assert outcome.largest == 4 * 10**6 and outcome.aborted is None
    global TIMEOUT
    saved, TIMEOUT = TIMEOUT, 0.2
    try:
        outcome = guarded(lambda: time.sleep(5), 0)
    finally:
        TIMEOUT = saved
    assert outcome.aborted and "took more than" in outcome.aborted and outcome.seconds < 2
