"""`gptq_`: quantize a model's linears with GPTQ (Frantar et al., "GPTQ: Accurate Post-Training
Quantization for Generative Pre-trained Transformers", 2022) instead of rounding each weight to
its nearest code, for the 4-bit weight-only layouts (int4, MXFP4, NVFP4).

Each selected linear collects H = sum x^T x over the inputs it sees while `forward` runs the
calibration batches (float model, one pass; with `sequential=True` stage by stage, each on the
inputs through the stages before it already rounded). Its weight columns are then rounded one
at a time; each column's rounding error, weighted by H^-1 (Cholesky), is moved onto the
columns not yet rounded, so that the layer's output on inputs like the calibration's changes
least. Choices, each the common one in GPTQ implementations:
- Static groups: every group's scale (and zero) is fixed before the columns are rounded, from
  the unrounded weight, so the result is an ordinary layout tensor (contiguous groups).
  `scale_search=True` picks each group's scale among a few candidates (a clipped range for
  int4, the e8m0 exponent -1 / 0 / +1 for MXFP4, the e4m3 scale of 0.8x-1.2x the amax for
  NVFP4) by the squared error of its rounded weights weighted by diag(H), the inputs' second
  moments; otherwise the layout's own rule.
- Act-order: columns go in decreasing order of diag(H) (the most used inputs first, while
  there are columns left to absorb their error).
- Dampening: `damp` times the mean of diag(H) is added to the diagonal (0.1; 0.01 is the
  paper's, and was worse on MiniLM: bench/minilm_calibration.py).
The rounding of each column, the scales and the final tensor are the layout's own functions
(`quantize_int4` / `quantize_mxfp4` / `quantize_nvfp4` with given group parameters), so a
calibrated weight is stored, saved, loaded, sharded and multiplied like any other.

Experts ([E, N, K] weights of an experts module, `qshard.api.experts_params`) are calibrated
per expert, on the tokens routed to it: each expert's x^T x is its own, and its [N, K] weight is
rounded as a linear's. Their inputs are internal to the experts forward (the down projection's
are the gated activations), so they are read from the matmuls themselves (expert_inputs.py).
An expert no token reached is rounded to nearest.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..api import QuantizationReport, quantize_with
from ..errors import ConfigError, QShardError, UnsupportedWeightError
from ..kernels import int4, mxfp4, nvfp4
from ..kernels.packing import expand_groups, group_reduce
from ..layouts import (
    Int4Tensor,
    Int4WeightOnlyConfig,
    Mxfp4Tensor,
    MXFP4WeightOnlyConfig,
    Nvfp4Tensor,
    NVFP4WeightOnlyConfig,
)
from ..layouts.checks import check_float_weight
from ..layouts.int4 import ZeroPointDomain
from ..shards import is_dtensor
from ..targets import (
    KEEP_FLOAT,
    FilterFn,
    Target,
    check_patterns,
    quantization_targets,
    skip_reason,
)
from .expert_inputs import ExpertsInputs, ExpertsWeight

__all__ = ["gptq_"]

SUPPORTED = (Int4WeightOnlyConfig, MXFP4WeightOnlyConfig, NVFP4WeightOnlyConfig)
INT4_CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # int4: the group's range times these
NVFP4_AMAX_FACTORS = (1.0, 0.8, 0.85, 0.9, 0.95, 1.05, 1.1, 1.2)
BLOCK = 128  # columns rounded before their error is moved onto the rest at once (lazy batches)


@torch.no_grad()
def gptq_(
    model: nn.Module,
    config: Int4WeightOnlyConfig | MXFP4WeightOnlyConfig | NVFP4WeightOnlyConfig,
    calibration: Iterable[Any],
    forward: Callable[[nn.Module, Any], Any] | None = None,
    filter_fn: FilterFn | None = None,
    include: Sequence[str] | str | None = None,
    exclude: Sequence[str] | str | None = None,
    keep_float: Sequence[str] = KEEP_FLOAT,
    damp: float = 0.1,
    scale_search: bool = True,
    sequential: bool = False,
) -> QuantizationReport:
    """Quantize `model`'s nn.Linear weights and expert weights in place with GPTQ, calibrated
    on `calibration`; return `quantize_`'s report. Selection (filter_fn, include, exclude,
    keep_float; an expert weight is named `<experts module>.<param>`), tied weights and the
    all-or-nothing rule are `quantize_`'s. Each expert is calibrated on the tokens routed to
    it, under the experts implementation the model is set to (transformers' "eager",
    "grouped_mm" or "batched_mm").

    calibration: batches; each runs as `forward(model, batch)`, by default `model(*batch)` for
    a tuple and `model(batch)` otherwise: text like the model's use, and enough of it: with
    fewer tokens than a linear has inputs, its x^T x is rank-deficient (all-MiniLM-L6-v2's
    MXFP4 embedding cosine rose from 0.9668 with 305 tokens to 0.9733 with 1230, and to 0.9784
    with 2456 and `sequential`; bench/README.md). A selected linear or expert that no batch
    reaches is rounded to nearest (with a warning naming it). Run it before
    `qshard.tp.parallelize`.

    sequential: calibrate the linears in the order the model runs them, each on the inputs
    that reach it through the linears before it already rounded (their weights dequantized in
    place for the passes, then restored), instead of all on the float model's: one pass over
    the calibration per stage (linears that read the same input, such as q, k and v, are one
    stage; the batches are read into a list once), and each weight is copied once.
    Experts are calibrated on the float model's inputs either way. all-MiniLM-L6-v2 in MXFP4
    (bench/minilm_heldout.py): held-out min cosine 0.9704 sequential, with the demo's 191
    calibration sentences.
    """
    if isinstance(config, type):
        raise ConfigError(
            f"gptq_: got the class {config.__name__}, not a config; pass an instance, "
            f"e.g. {config.__name__}()"
        )
    if not isinstance(config, SUPPORTED):
        raise ConfigError(
            f"gptq_: got {type(config).__name__}; GPTQ here takes the 4-bit weight-only configs "
            f"({', '.join(c.__name__ for c in SUPPORTED)}). Use qshard.quantize_ for the others"
        )
    if not 0 < damp < 10:
        raise ConfigError(f"gptq_: damp={damp} must be in (0, 10); 0.1 is the default")
    linears, experts = _selected_targets(model, filter_fn, include, exclude, keep_float)
    registered = _format_class(config).tensor
    for name, weight in _matrices(linears, experts):  # before a NaN spreads into the hessians
        try:
            check_float_weight(registered.__name__, weight)
        except UnsupportedWeightError:
            continue  # quantize_ skips the module and reports why
        except QShardError as e:  # a non-finite weight: nothing is changed
            raise type(e)(f"gptq_: module {name!r}: {e}") from e
    forward = forward or _default_forward
    batches = list(calibration) if sequential else calibration
    hessians = _collect_hessians(model, linears, experts, batches, forward)
    unreached = [t.name for t in linears if _key(t.weight) not in hessians]
    for weight in experts:
        missing = [e for e in range(weight.experts) if e not in weight.hessians]
        if missing:
            whole = len(missing) == weight.experts
            unreached.append(weight.target.name if whole else f"{weight.target.name} {missing}")
    if unreached:
        warnings.warn(
            f"gptq_: no calibration input reached {unreached}; rounded to nearest (a name with "
            f"a list: those experts of it)",
            stacklevel=3,  # the caller's line (no_grad's wrapper is one frame)
        )
    calibrate = (_calibrate_sequentially if sequential else _calibrate_linears)(
        model, linears, hessians, batches, forward, config, damp, scale_search
    )
    calibrated = dict(calibrate)
    for weight in experts:
        matrices = weight.matrices()
        key = _key(matrices)
        if key in calibrated:
            continue
        try:
            calibrated[key] = registered.stack_experts(
                [
                    _calibrated(
                        f"{weight.target.name} expert {e}",
                        w,
                        weight.hessians.get(e),
                        config,
                        damp,
                        scale_search,
                    )
                    for e, w in enumerate(matrices.unbind(0))
                ]
            )
        except UnsupportedWeightError:
            continue  # as above

    def handler(weight: torch.Tensor, cfg) -> torch.Tensor:
        found = calibrated.get(_key(weight))
        return found if found is not None else registered.from_float(weight, cfg)

    return quantize_with(model, config, handler, filter_fn, include, exclude, keep_float)


def _calibrate_linears(model, linears, hessians, batches, forward, config, damp, scale_search):
    """{weight key: calibrated tensor} of the linears the calibration reached, each on the
    float model's inputs (`hessians`)."""
    calibrated = {}
    for target in linears:
        key = _key(target.weight)
        if key not in hessians or key in calibrated:
            continue
        try:
            calibrated[key] = _calibrated(
                target.name, target.weight.detach(), hessians[key], config, damp, scale_search
            )
        except UnsupportedWeightError:
            continue  # quantize_ skips the module and reports why
    return calibrated


def _calibrate_sequentially(model, linears, hessians, batches, forward, config, damp, search):
    """`_calibrate_linears`, stage by stage in the order the model runs its linears (`gptq_`'s
    `sequential`): a stage's x^T x comes from a pass over `batches` with every earlier stage's
    weights replaced in place by their calibrated values; the float weights are restored."""
    calibrated, originals = {}, {}
    try:
        for number, stage in enumerate(_stages(model, linears, batches[0], forward)):
            if number:  # the first stage's inputs are the float model's
                hessians = _collect_hessians(model, stage, [], batches, forward)
            reached = [
                t for t in stage if _key(t.weight) in hessians and _key(t.weight) not in calibrated
            ]
            calibrated.update(
                _calibrate_linears(model, reached, hessians, batches, forward, config, damp, search)
            )
            for target in reached:
                key = _key(target.weight)
                if key in calibrated and key not in originals:
                    originals[key] = (target.weight, target.weight.detach().clone())
                    target.weight.detach().copy_(calibrated[key].dequantize(target.weight.dtype))
    finally:
        for weight, original in originals.values():
            weight.detach().copy_(original)
    return calibrated


def _stages(model, linears, batch, forward) -> list[list[Target]]:
    """The selected linears in the order `batch`'s forward runs them, those reading the same
    input tensor one after another grouped into a stage; every module of a tied weight in the
    stage of its first call (its x^T x sums their inputs, as one-pass calibration's does); the
    linears `batch` does not reach together in a last stage."""
    by_key: dict[tuple, list[Target]] = {}
    for target in linears:
        by_key.setdefault(_key(target.weight), []).append(target)
    calls: list[tuple[tuple, bool]] = []  # (weight key, reads the previous call's input)
    previous: list[torch.Tensor] = []  # held, so that its memory is not another tensor's

    def record(module, inputs):
        x = inputs[0]
        same = bool(previous) and x.data_ptr() == previous[0].data_ptr()
        calls.append((_key(module.weight), same and x.shape == previous[0].shape))
        previous[:] = [x]

    hooks = [target.module.register_forward_pre_hook(record) for target in linears]
    try:
        forward(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
        previous.clear()
    stages: list[list[Target]] = []
    seen: set = set()
    for key, same_input in calls:
        if key in seen:
            continue
        seen.add(key)
        if stages and same_input:
            stages[-1].extend(by_key[key])
        else:
            stages.append(list(by_key[key]))
    unreached = [t for t in linears if _key(t.weight) not in seen]
    return stages + ([unreached] if unreached else [])


def _default_forward(model: nn.Module, batch: Any) -> Any:
    return model(*batch) if isinstance(batch, tuple) else model(batch)


def _key(weight: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    # quantize_ hands handlers `weight.detach()`: the same storage, another tensor object.
    return weight.data_ptr(), tuple(weight.shape)


def _matrices(linears: list[Target], experts: list[ExpertsWeight]):
    """(name, [N, K] weight) of every selected linear and expert."""
    for target in linears:
        yield target.name, target.weight.detach()
    for weight in experts:
        for e, matrix in enumerate(weight.matrices().unbind(0)):
            yield f"{weight.target.name} expert {e}", matrix


def _calibrated(name, weight, hessian, config, damp, scale_search) -> torch.Tensor:
    """The GPTQ layout tensor of one [N, K] weight (checked to be finite), rounded to nearest
    without a hessian; errors name the weight."""
    registered = _format_class(config).tensor
    try:
        check_float_weight(registered.__name__, weight)  # UnsupportedWeightError: skipped
        if hessian is None:
            return registered.from_float(weight, config)
        return _gptq_weight(weight, hessian, config, damp, scale_search)
    except UnsupportedWeightError:
        raise
    except QShardError as e:
        raise type(e)(f"gptq_: module {name!r}: {e}") from e
    except torch.linalg.LinAlgError as e:
        raise ConfigError(
            f"gptq_: module {name!r}: its inputs' x^T x + damp is not positive definite "
            f"({e}); raise damp (now {damp})"
        ) from e


def _selected_targets(model, filter_fn, include, exclude, keep_float=KEEP_FLOAT):
    """([Target of a selected nn.Linear], [ExpertsWeight of a selected experts weight])."""
    targets = quantization_targets(model)
    check_patterns([t.name for t in targets], include, exclude, "gptq_")
    linears, experts = [], []
    for target in targets:
        if skip_reason(target, include, exclude, filter_fn, keep_float) is not None:
            continue
        if is_dtensor(target.weight):
            raise ConfigError(
                f"gptq_: {target.name!r} is sharded (a DTensor weight); run gptq_ on the whole "
                f"model before qshard.tp.parallelize (the quantized weights shard like any other)"
            )
        if target.weight.dim() == 3:
            experts.append(ExpertsWeight(target))
        else:
            linears.append(target)
    return linears, experts


def _collect_hessians(model, linears, experts, calibration, forward) -> dict:
    """{weight key: sum over the calibration of x^T x [K, K] (float64)} per selected linear;
    each selected experts weight's per-expert sums go into its `hessians`."""
    hessians: dict = {}

    def record(module, inputs):
        x = inputs[0].detach().reshape(-1, module.in_features).double()
        key = _key(module.weight)
        hessians[key] = hessians.get(key, 0) + x.t() @ x

    hooks = [target.module.register_forward_pre_hook(record) for target in linears]
    batches = 0
    try:
        for batch in calibration:
            if experts:
                with ExpertsInputs(experts):
                    forward(model, batch)
            else:
                forward(model, batch)
            batches += 1
    finally:
        for hook in hooks:
            hook.remove()
    if batches == 0:
        raise ConfigError("gptq_: `calibration` gave no batch; pass an iterable of inputs")
    return hessians


# ---- the formats: group parameters, one column rounded, the finished tensor --------------------


class _Format:
    """What GPTQ needs of a layout, through the layout's reference functions; one subclass per
    layout (`_format_for`)."""

    group: int
    tensor: type  # the layout's tensor class

    def __init__(self, weight: torch.Tensor, config):
        self.config, self.k = config, weight.shape[1]

    def quantize(self, w: torch.Tensor, params: dict | None) -> tuple[torch.Tensor, dict]:
        """(packed codes, params) of w [N, k'] (params: the groups' of those columns; None: the
        layout's own rule)."""
        raise NotImplementedError

    def dequantize(self, q: torch.Tensor, params: dict, k: int) -> torch.Tensor:
        raise NotImplementedError

    def column_rounder(self, params: dict, dtype: torch.dtype):
        """round(column [N], group g) -> the column's values on group g's grid: the layout's
        rounding (`int4_codes`, `e2m1_codes`) without packing, for GPTQ's column loop. (The
        stored tensor is made by the layout's quantizer at the end, from these values.)"""
        raise NotImplementedError

    def candidates(self, w: torch.Tensor) -> list[dict]:
        """Group parameters to choose from, the layout's own rule first."""
        raise NotImplementedError

    def build(self, w: torch.Tensor, params: dict) -> torch.Tensor:
        """The layout tensor of w (on the groups' grid, in the weight's dtype: rounding it there
        moves no value by half a step, so the codes stay) with these group parameters."""
        return self.tensor.from_float(w, self.config, group_params=params)

    def rounded(self, w: torch.Tensor, params: dict) -> torch.Tensor:
        q, _ = self.quantize(w, params)
        return self.dequantize(q, params, w.shape[1]).to(w.dtype)

    def best_params(self, w: torch.Tensor, importance: torch.Tensor, search: bool) -> dict:
        """Per (row, group), the candidate whose rounded weights differ least from w, each
        column's squared error weighted by `importance`."""
        options = self.candidates(w) if search else [self.quantize(w, None)[1]]
        if len(options) == 1:
            return options[0]
        errors = torch.stack(
            [
                group_reduce((self.rounded(w, p) - w) ** 2 * importance, self.group, torch.sum)
                for p in options
            ]
        )
        best = errors.argmin(0)  # [N, G]
        return {name: _pick([p[name] for p in options], best) for name in options[0]}


class _Int4Format(_Format):
    tensor = Int4Tensor

    def __init__(self, weight: torch.Tensor, config: Int4WeightOnlyConfig):
        super().__init__(weight, config)
        self.group = config.group_size
        self.float_zero = config.zero_point_domain is ZeroPointDomain.FLOAT

    def quantize(self, w, params):
        given = (params["scale"], params["zero"]) if params else None
        q, scale, zero = int4.quantize_int4(
            w, self.group, self.config.symmetric, self.float_zero, given
        )
        return q, {"scale": scale, "zero": zero}

    def dequantize(self, q, params, k):
        return int4.dequantize_int4(
            q, params["scale"], params["zero"], self.group, k, torch.float32, self.float_zero
        )

    def column_rounder(self, params, dtype):
        scale, zero = params["scale"].to(dtype), params["zero"].to(dtype)
        symmetric, float_zero = self.config.symmetric, self.float_zero

        def int4_round(column: torch.Tensor, g: int) -> torch.Tensor:
            s = scale[:, g : g + 1]
            z = zero[:, g : g + 1] if zero.numel() else zero
            u = int4.int4_codes(column[:, None], s, z, self.group, symmetric, float_zero)
            u = u[:, 0].to(dtype)
            if symmetric:
                return (u - 8) * s[:, 0]
            if float_zero:
                return (u - 8) * s[:, 0] + z[:, 0]
            return (u - z[:, 0]) * s[:, 0]

        return int4_round

    def candidates(self, w):
        """The layout's range, then the range clipped to INT4_CLIPS of it."""
        high = expand_groups(group_reduce(w, self.group, torch.amax), self.group, self.k)
        low = expand_groups(group_reduce(w, self.group, torch.amin), self.group, self.k)
        high, low = high.clamp(min=0), low.clamp(max=0)
        amax = torch.maximum(high, -low)
        options = [self.quantize(w, None)[1]]
        for clip in INT4_CLIPS[1:]:
            if self.config.symmetric:
                clipped = w.clamp(-clip * amax, clip * amax)
            else:
                clipped = w.clamp(clip * low, clip * high)
            options.append(self.quantize(clipped, None)[1])
        return options


class _Fp4Format(_Format):
    """MXFP4 and NVFP4: e2m1 codes times a group scale (times NVFP4's global scale)."""

    def scales(self, params: dict, dtype: torch.dtype) -> torch.Tensor:
        """Each group's multiplier of its e2m1 values [N, G]."""
        raise NotImplementedError

    def column_rounder(self, params, dtype):
        scale = self.scales(params, dtype)
        table = torch.tensor(mxfp4.E2M1_VALUES, dtype=dtype, device=scale.device)

        def fp4_round(column: torch.Tensor, g: int) -> torch.Tensor:
            s = scale[:, g]
            return table[mxfp4.e2m1_codes((column / s).clamp(-6, 6).float()).long()] * s

        return fp4_round


class _Mxfp4Format(_Fp4Format):
    group, tensor = mxfp4.GROUP, Mxfp4Tensor

    def quantize(self, w, params):
        q, scale = mxfp4.quantize_mxfp4(w, self.group, params["scale"] if params else None)
        return q, {"scale": scale}

    def dequantize(self, q, params, k):
        return mxfp4.dequantize_mxfp4(q, params["scale"], self.group, k, torch.float32)

    def scales(self, params, dtype):
        return params["scale"].to(dtype)

    def candidates(self, w):
        """The spec's e8m0 exponent, and one lower and one higher."""
        own = self.quantize(w, None)[1]
        e = own["scale"].float()
        return [own] + [
            {"scale": (e * f).clamp(2.0**-127, 2.0**127).to(own["scale"].dtype)} for f in (0.5, 2.0)
        ]


class _Nvfp4Format(_Fp4Format):
    group, tensor = nvfp4.GROUP, Nvfp4Tensor

    def __init__(self, weight: torch.Tensor, config: NVFP4WeightOnlyConfig):
        super().__init__(weight, config)
        self.global_scale = nvfp4.global_scale_of(weight)  # the whole weight's, as from_float's

    def quantize(self, w, params):
        given = params["scale"] if params else None
        q, scale = nvfp4.quantize_nvfp4(w, self.global_scale, self.group, given)
        return q, {"scale": scale}

    def dequantize(self, q, params, k):
        return nvfp4.dequantize_nvfp4(
            q, params["scale"], self.global_scale, self.group, k, torch.float32
        )

    def scales(self, params, dtype):
        return params["scale"].to(dtype) * self.global_scale.to(dtype)

    def candidates(self, w):
        """The e4m3 scales of the group's amax times NVFP4_AMAX_FACTORS."""
        return [self.quantize(w * f, None)[1] for f in NVFP4_AMAX_FACTORS]

    def build(self, w, params):
        return self.tensor.from_float(
            w, self.config, global_scale=self.global_scale, group_params=params
        )


_FORMATS = {
    Int4WeightOnlyConfig: _Int4Format,
    MXFP4WeightOnlyConfig: _Mxfp4Format,
    NVFP4WeightOnlyConfig: _Nvfp4Format,
}


def _format_class(config) -> type[_Format]:
    return next(cls for kind, cls in _FORMATS.items() if isinstance(config, kind))


def _format_for(weight: torch.Tensor, config) -> _Format:
    return _format_class(config)(weight, config)


def _pick(options: list[torch.Tensor], best: torch.Tensor) -> torch.Tensor:
    """options[best[r, g]][r, g] for each (r, g); one-byte dtypes (e8m0, e4m3) as bytes."""
    if options[0].numel() == 0:  # a symmetric int4 weight's zero: empty
        return options[0]
    dtype = options[0].dtype
    stacked = torch.stack([o.view(torch.uint8) if dtype.itemsize == 1 else o for o in options])
    chosen = torch.gather(stacked, 0, best[None])[0]
    return chosen.view(dtype) if dtype.itemsize == 1 else chosen


def _gptq_weight(weight, hessian, config, damp: float, scale_search: bool) -> torch.Tensor:
    """The GPTQ-rounded layout tensor of one weight [N, K] given its inputs' x^T x."""
    dtype = weight.dtype
    w = weight.double() if weight.device.type == "cpu" else weight.float()
    h = hessian.to(w.device, w.dtype).clone()
    fmt = _format_for(w, config)
    k = w.shape[1]
    dead = torch.diag(h) == 0  # inputs the calibration never used: no error moves through them
    h[dead, dead] = 1
    params = fmt.best_params(w, torch.diag(h)[None, :], scale_search)
    order = torch.argsort(torch.diag(h), descending=True)
    group_of = order // fmt.group
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    upper = torch.linalg.cholesky(inverse, upper=True)
    round_column = fmt.column_rounder(params, w.dtype)
    rounded = torch.empty_like(w)
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        block, errors = w[:, start:end].clone(), torch.empty_like(w[:, start:end])
        for i in range(end - start):
            rounded[:, start + i] = round_column(block[:, i], int(group_of[start + i]))
            errors[:, i] = (block[:, i] - rounded[:, start + i]) / upper[start + i, start + i]
            block[:, i:] -= errors[:, i : i + 1] * upper[start + i, start + i : end][None, :]
        w[:, end:] -= errors @ upper[start:end, end:]
    result = torch.empty_like(rounded)
    result[:, order] = rounded
    return fmt.build(result.to(dtype), params)
