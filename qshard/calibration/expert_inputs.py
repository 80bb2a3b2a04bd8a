"""Each expert's calibration inputs for `qshard.gptq_` (calibration.py), read from the
matmuls of the experts forward.

Experts' inputs are internal to the experts forward (the down projection's are the gated
activations), so while the calibration runs, a TorchFunctionMode (`ExpertsInputs`) follows the
tensors derived from each selected experts weight (`w[e]`, `w[ids]`, `w.transpose(-2, -1)`,
`.T`) into `F.linear`, `matmul`/`mm`, `bmm` and `_grouped_mm` (with its offsets), which is what
transformers' "eager", "batched_mm" and "grouped_mm" experts implementations call, and adds
each expert's inputs to that expert's own x^T x (`ExpertsWeight.hessians`).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..targets import Target

__all__ = ["ExpertsInputs", "ExpertsWeight"]


# ---- experts: each expert's inputs, read from the matmuls of the experts forward -------------


@dataclasses.dataclass
class ExpertsWeight:
    """A selected experts weight (stored [E, N, K], or [E, K, N] when `target.transposed`) and
    the sum of x^T x over each expert's calibration inputs."""

    target: Target
    hessians: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def experts(self) -> int:
        return self.target.weight.shape[0]

    @property
    def k(self) -> int:
        return self.target.weight.shape[1 if self.target.transposed else 2]

    def matrices(self) -> torch.Tensor:
        """The [E, N, K] view quantize_with hands the handler."""
        weight = self.target.weight.detach()
        return weight.transpose(-2, -1) if self.target.transposed else weight

    def add(self, expert: int, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.k).double()
        if x.shape[0]:
            self.hessians[expert] = self.hessians.get(expert, 0) + x.t() @ x


@dataclasses.dataclass(frozen=True)
class _Derived:
    """A tensor made from an experts weight: the experts it holds (`ids` 0-D: one expert's
    matrix; 1-D: a stack of matrices, one per entry) and whether its last two dims are swapped
    from the stored weight's."""

    weight: ExpertsWeight
    ids: torch.Tensor
    swapped: bool


_MATMULS = {"linear", "matmul", "__matmul__", "mm", "bmm"}
_GROUPED = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback"}  # (x, w [E, K, N], offs)


class ExpertsInputs(TorchFunctionMode):
    """Adds each expert's inputs to its x^T x while the experts forward runs (see the module
    docstring). Anything it does not recognise is left alone: an expert whose weight is used
    otherwise gets no hessian (rounded to nearest, with gptq_'s warning)."""

    def __init__(self, weights: list[ExpertsWeight]):
        super().__init__()
        self.derived: dict[int, tuple[weakref.ref, _Derived]] = {}
        for w in weights:
            param = w.target.weight
            self._track(param, _Derived(w, torch.arange(w.experts, device=param.device), False))

    def _track(self, t: torch.Tensor, derived: _Derived) -> None:
        self.derived[id(t)] = (weakref.ref(t), derived)

    def _of(self, t: Any) -> _Derived | None:
        found = self.derived.get(id(t)) if isinstance(t, torch.Tensor) else None
        return found[1] if found is not None and found[0]() is t else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # the mode is off inside its own __torch_function__
        name = getattr(func, "__name__", "")
        if name in _MATMULS and len(args) >= 2:
            self._matmul(name, args)
        elif name in _GROUPED and len(args) >= 2:
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            self._grouped(args[0], args[1], offs)
        elif args and isinstance(out, torch.Tensor):
            source = self._of(args[0])
            derived = source and _derive(func, name, args, kwargs, source, out)
            if derived:
                self._track(out, derived)
        return out

    def _matmul(self, name: str, args) -> None:
        # linear(x, w) contracts w's last dim; x @ w its dim -2; w @ x its last dim.
        if name != "linear" and self._of(args[0]) is not None:
            w, x, x_first = self._of(args[0]), args[1], False
        else:
            w, x, x_first = self._of(args[1]), args[0], True
        if w is None or not isinstance(x, torch.Tensor):
            return
        contracts_last = name == "linear" or not x_first
        if not _contracts_k(w, contracts_last):
            return
        if not x_first:  # w @ x: x [..., K, M]
            x = x.transpose(-2, -1)
        if x.shape[-1] != w.weight.k:
            return
        if w.ids.dim() == 0:
            w.weight.add(int(w.ids), x)
        elif x.dim() == 3 and x.shape[0] == w.ids.shape[0]:  # one matrix per entry
            for e in w.ids.unique().tolist():
                w.weight.add(e, x[w.ids == e])

    def _grouped(self, x: Any, w_tensor: Any, offs: Any) -> None:
        w = self._of(w_tensor)
        if w is None or not isinstance(offs, torch.Tensor) or w.ids.dim() != 1:
            return
        if not _contracts_k(w, contracts_last=False) or x.dim() != 2 or x.shape[1] != w.weight.k:
            return
        start = 0
        for group, end in enumerate(offs.tolist()):
            if end > start:
                w.weight.add(int(w.ids[group]), x[start:end])
            start = max(start, end)


def _contracts_k(w: _Derived, contracts_last: bool) -> bool:
    """Whether the matmul contracts the weight's K (not N): K is the stored last dim unless
    the weight is stored transposed."""
    stored_last = contracts_last != w.swapped
    return stored_last != w.weight.target.transposed


def _derive(func, name: str, args, kwargs, source: _Derived, out: torch.Tensor):
    """What `out = func(source tensor, ...)` holds: a selection of experts (`w[e]`, `w[ids]`),
    the same matrices with the last two dims swapped (`transpose(-2, -1)`, `.T`, `.mT`), or the
    same matrices otherwise (`contiguous`, `to`, ...); None when it cannot tell."""
    t = args[0]
    if name == "__getitem__":
        index = args[1]
        if isinstance(index, tuple):
            rest_whole = all(
                i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in index[1:]
            )
            if not index or not rest_whole:
                return None
            index = index[0]
        if source.ids.dim() == 0:
            return None
        try:
            ids = source.ids[index.to(source.ids.device) if torch.is_tensor(index) else index]
        except (IndexError, TypeError, RuntimeError):
            return None
        return _Derived(source.weight, ids, source.swapped) if out.dim() == ids.dim() + 2 else None
    if out.dim() != t.dim() or out.shape[:-2] != t.shape[:-2]:
        return None
    if _swaps_last_two(func, name, args, kwargs, t.dim()):
        if out.shape[-2:] != t.shape[-2:][::-1]:
            return None
        return _Derived(source.weight, source.ids, not source.swapped)
    return source if out.shape[-2:] == t.shape[-2:] else None


def _swaps_last_two(func, name: str, args, kwargs, ndim: int) -> bool:
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in ("T", "mT")
    if name == "t":
        return True
    if name == "transpose":
        dims = list(args[1:3]) + [kwargs[k] for k in ("dim0", "dim1") if k in kwargs]
        return len(dims) == 2 and {d % ndim for d in dims} == {ndim - 2, ndim - 1}
    return False
