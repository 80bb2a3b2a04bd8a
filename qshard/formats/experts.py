"""Mixture-of-experts weights: other producers' per-expert keys <-> transformers' fused experts.

DeepSeek-V3/R1, Qwen3-MoE and compressed-tensors MoE checkpoints store each expert as three linears
(docs/design.md, "Experts in transformers"): `<m>.{e}.gate_proj.weight` [I, H],
`<m>.{e}.up_proj.weight` [I, H] and `<m>.{e}.down_proj.weight` [H, I], with `<m>` =
`...mlp.experts`; transformers 5.x holds them as two 3-D parameters of the experts module,
`<m>.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up rows: the module's forward
chunks the output in two) and `<m>.down_proj` [E, H, I]. A format's loader maps each linear into its
layout (2-D QTensors); `fuse_experts` then joins them with the QTensor shape ops (cat along N, stack
over experts), which move packed bytes and never dequantize.

Gate and up are joined at row I. Where I is not a multiple of the layout's row packing, the
join would leave a partial block inside the weight: FP8 blockwise weights are then re-blocked
to the largest power-of-two row block dividing I (each 128-row scale repeated; the dequantized
weights are unchanged, docs/design.md invariant 2), as qshard.tp re-blocks a TP shard; the scale
memory of gate_up grows by 128 / that block. This is exact and keeps the checkpoint loadable
(refusing would leave such a model unloadable for no numerical reason). Other layouts, whose
packing along N is at most 2 rows, and FP8 where no block of at least 16 rows divides I, are
refused with a CheckpointError naming I and the packing.

Mixtral's checkpoints name the same linears the older way (transformers' conversion mapping for
"mixtral"): `...block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down) and the router
`...block_sparse_moe.gate`; `rename_legacy_experts` gives them transformers 5.x's names
(`...mlp.experts.{e}.gate_proj`, ..., `...mlp.gate`) before the join.

`split_experts` is the inverse, for export: each 3-D experts QTensor back to its per-expert
2-D linears under the checkpoint's keys; `coarsen_fp8` undoes a re-blocking where it is exact.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping

import torch

from ..errors import CheckpointError, QShardError
from ..layouts import Fp8BlockwiseTensor
from ..layouts.fp8_blockwise import MIN_BLOCK
from ..qtensor import QTensor

__all__ = [
    "PROJECTIONS",
    "coarsen_fp8",
    "coarsen_or_keep",
    "expert_count",
    "expert_modules",
    "fuse_experts",
    "rename_legacy_experts",
    "split_experts",
]

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
FUSED = ("gate_up_proj", "down_proj")
EXPERT_KEY = re.compile(
    r"(?P<module>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|"
    r"down_proj)\.weight"
)


LEGACY_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
LEGACY_EXPERT = re.compile(r"(?P<module>.+\.experts\.\d+)\.(?P<w>w[123])\.(?P<rest>.+)")


def rename_legacy_experts(
    state: Mapping[str, torch.Tensor], wanted: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """`state` with Mixtral's `block_sparse_moe` / `w1, w3, w2` names as transformers 5.x names
    them (`mlp`, `gate_proj, up_proj, down_proj`); other keys, and keys a model given by its
    keys `wanted` holds under the old names (an older model class), unchanged."""
    wanted = set(wanted) if wanted is not None else set()
    out = {}
    for key, value in state.items():
        if ".block_sparse_moe." in key and key not in wanted:
            key = key.replace(".block_sparse_moe.", ".mlp.")
            match = LEGACY_EXPERT.fullmatch(key)
            if match:
                key = f"{match['module']}.{LEGACY_PROJECTIONS[match['w']]}.{match['rest']}"
        out[key] = value
    return out


def expert_modules(keys: Collection[str]) -> dict[str, dict[str, dict[int, str]]]:
    """{experts module: {projection: {expert index: key}}} of the per-expert keys in `keys`."""
    modules: dict[str, dict[str, dict[int, str]]] = {}
    for key in keys:
        match = EXPERT_KEY.fullmatch(key)
        if match:
            projections = modules.setdefault(match["module"], {p: {} for p in PROJECTIONS})
            experts, e = projections[match["proj"]], int(match["e"])
            if e in experts:  # "experts.1." and "experts.01.": one would silently win
                first, second = sorted((experts[e], key))
                raise CheckpointError(
                    f"{first!r} and {second!r} both name expert {e} of {match['module']}; a "
                    f"checkpoint names each expert once. The checkpoint is damaged or crafted"
                )
            experts[e] = key
    return modules


def fuse_experts(
    state: Mapping[str, torch.Tensor], where: str, wanted: Collection[str] | None = None
) -> dict[str, torch.Tensor]:
    """`state` with each experts module's per-expert linears joined into `<m>.gate_up_proj`
    [E, 2I, H] and `<m>.down_proj` [E, H, I] (at the place of its first per-expert key).
    `wanted`: the keys a model holds; a module is fused only where the model holds its fused
    keys (a model with per-expert linears keeps them). None: every module is fused."""
    modules = expert_modules(state)
    if wanted is not None:
        wanted = set(wanted)
        modules = {m: p for m, p in modules.items() if f"{m}.gate_up_proj" in wanted}
    fused: dict[str, dict[str, torch.Tensor]] = {}
    for module, projections in modules.items():
        fused[module] = _fuse_module(state, module, projections, where)
    taken = {key for p in modules.values() for keys in p.values() for key in keys.values()}
    out = {}
    for key, value in state.items():
        if key not in taken:
            out[key] = value
            continue
        module = EXPERT_KEY.fullmatch(key)["module"]
        out.update(fused.pop(module, {}))  # at the first of the module's keys
    return out


def expert_count(module: str, projections: dict[str, dict[int, str]], where: str) -> int:
    """E, once every projection has a key for every expert 0..E-1 (`expert_modules`' result
    for one module); CheckpointError naming the missing experts otherwise."""
    counts = {p: len(keys) for p, keys in projections.items()}
    experts = max(counts.values())
    for projection, keys in projections.items():
        missing = sorted(set(range(experts)) - set(keys))
        if missing or max(keys, default=-1) >= experts:
            missing = missing or [e for e in range(max(keys) + 1) if e not in keys]
            raise CheckpointError(
                f"{where}: {module}: experts {missing[:8]} have no {projection}.weight (the "
                f"checkpoint holds {counts}); an experts module needs gate_proj, up_proj and "
                f"down_proj of every expert 0..E-1. The checkpoint is incomplete: download or "
                f"re-export it"
            )
    return experts


def _fuse_module(state, module: str, projections: dict[str, dict[int, str]], where: str) -> dict:
    experts = expert_count(module, projections, where)
    pieces = {p: [state[projections[p][e]] for e in range(experts)] for p in PROJECTIONS}
    _check_alike(module, pieces, where)
    try:
        gate_up = [
            _join_rows(g, u) for g, u in zip(pieces["gate_proj"], pieces["up_proj"], strict=True)
        ]
        return {
            f"{module}.gate_up_proj": _stack(gate_up),
            f"{module}.down_proj": _stack(pieces["down_proj"]),
        }
    except QShardError as e:
        raise CheckpointError(
            f"{where}: {module}: joining the per-expert linears into the model's 3-D experts: {e}"
        ) from None


def _check_alike(module: str, pieces: dict[str, list[torch.Tensor]], where: str) -> None:
    """Every expert's linears of one kind and shape, gate and up of one shape, down [H, I]."""
    for projection, tensors in pieces.items():
        for e, t in enumerate(tensors):
            first = tensors[0]
            kind = (type(t), t.dtype, tuple(t.shape))
            if t.dim() != 2 or kind != (type(first), first.dtype, tuple(first.shape)):
                raise CheckpointError(
                    f"{where}: {module}.{e}.{projection}.weight is a {_describe(t)}, expert 0's "
                    f"a {_describe(first)}; an experts module's linears share one layout and "
                    f"shape. The checkpoint mixes schemes inside one experts module"
                )
    gate, up, down = (pieces[p][0] for p in PROJECTIONS)
    i, h = gate.shape
    if tuple(up.shape) != (i, h) or tuple(down.shape) != (h, i) or type(gate) is not type(up):
        raise CheckpointError(
            f"{where}: {module}: expert 0's gate_proj is a {_describe(gate)}, up_proj a "
            f"{_describe(up)}, down_proj a {_describe(down)}; an expert's gate and up are "
            f"[I, H] of one layout and its down [H, I]"
        )


def _describe(t: torch.Tensor) -> str:
    return f"{type(t).__name__} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _join_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[gate; up] along N: gate rows then up rows (one expert's gate_up_proj)."""
    if not isinstance(gate, QTensor):
        return torch.cat([gate, up])
    rows = gate.logical_shape[0]
    step = gate.slice_granularity(0)
    if rows % step and isinstance(gate, Fp8BlockwiseTensor):
        block = math.gcd(rows, gate.block_size[0])
        if block >= MIN_BLOCK:
            block_size = (block, gate.block_size[1])
            gate, up = gate.reblock(block_size), up.reblock(block_size)
            step = block
    if rows % step:
        reblock = (
            f" (re-blocking finds no power-of-two block of {MIN_BLOCK} rows or more "
            f"dividing {rows})"
            if isinstance(gate, Fp8BlockwiseTensor)
            else ""
        )
        raise CheckpointError(
            f"gate_proj and up_proj have I = {rows} rows, and {type(gate).__name__} packs rows "
            f"in steps of {step} {gate._packing_text()}: gate_up_proj would hold a partial "
            f"block inside{reblock}. Re-quantize the experts with qshard.quantize_ (whose "
            f"blocks of the fused weight need no join), or use a checkpoint whose I is a "
            f"multiple of {step}"
        )
    return torch.cat([gate, up])


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    if isinstance(tensors[0], QTensor):
        return QTensor.stack_experts(tensors)
    return torch.stack(tensors)


# ---- export -----------------------------------------------------------------------------------


def split_experts(
    state: Mapping[str, torch.Tensor], fmt: str, transposed: Collection[str] = ()
) -> dict[str, torch.Tensor]:
    """`state` with each experts module's `<m>.gate_up_proj` [E, 2I, H] and `<m>.down_proj`
    [E, H, I] (quantized or float) replaced by the per-expert linears the checkpoints store,
    `<m>.{e}.gate_proj.weight` ...; every other entry as it is. `transposed`: the keys of
    experts weights stored [E, in, out] (gpt-oss; a float one cannot say so itself): refused."""
    modules = {
        key.removesuffix(".gate_up_proj")
        for key, value in state.items()
        if key.endswith(".experts.gate_up_proj") and f"{key[:-13]}.down_proj" in state
    }
    out = {}
    for key, value in state.items():
        module, _, name = key.rpartition(".")
        if module not in modules or name not in FUSED:
            out[key] = value
            continue
        if value.dim() != 3 or getattr(value, "transposed", False) or key in transposed:
            raise QShardError(
                f"qshard.export(format='{fmt}'): {key!r} is a {_describe(value)}"
                f"{' stored transposed [E, in, out] (gpt-oss)' if value.dim() == 3 else ''}; "
                f"the format stores experts [E, out, in] as per-expert linears (gpt-oss "
                f"experts are exported with format='gpt-oss-mxfp4')"
            )
        for e in range(value.shape[0]):
            expert = value[e]
            if name == "down_proj":
                out[f"{module}.{e}.down_proj.weight"] = expert
                continue
            rows = expert.shape[0] // 2
            gate, up = expert[:rows], expert[rows:]
            if isinstance(expert, Fp8BlockwiseTensor):  # undo the cut's re-blocking if exact
                gate, up = (coarsen_or_keep(part, expert.block_size) for part in (gate, up))
            out[f"{module}.{e}.gate_proj.weight"] = gate
            out[f"{module}.{e}.up_proj.weight"] = up
    return out


def coarsen_or_keep(w: Fp8BlockwiseTensor, block_size: tuple[int, int]) -> Fp8BlockwiseTensor:
    coarse = coarsen_fp8(w, block_size)
    return w if coarse is None else coarse


def coarsen_fp8(w: Fp8BlockwiseTensor, block_size: tuple[int, int]) -> Fp8BlockwiseTensor | None:
    """The 2-D FP8 weight `w` with the coarser row block of `block_size` (a multiple of w's;
    the same column block), when every coarse block's fine scales are one value (as `reblock`
    left them, or a part of at most one block); else None. Dequantized weights are unchanged."""
    (fn, fk), (cn, ck) = w.block_size, block_size
    if (fn, fk) == (cn, ck):
        return w
    # Only rows: re-blocking N is what joining gate and up (and cutting them apart) does.
    if w.experts is not None or cn % fn or ck != fk:
        return None
    ratio = cn // fn
    scale = w.scale[::ratio]
    if not torch.equal(scale.repeat_interleave(ratio, 0)[: w.scale.shape[0]], w.scale):
        return None
    return w.with_changes({"scale": scale.contiguous()}, fresh=True, block_size=(cn, ck))


def check_fit(
    state: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], where: str
) -> None:
    """CheckpointError if an experts weight of `state` (3-D) has another expert count or shape
    than the model's tensor under its key (`targets`), naming both, before anything is loaded."""
    for key, value in state.items():
        target = targets.get(key)
        if value.dim() != 3 or target is None or tuple(target.shape) == tuple(value.shape):
            continue
        ours, theirs = list(value.shape), list(target.shape)
        what = (
            f"{ours[0]} experts in the checkpoint and {theirs[0]} in the model"
            if ours[0] != theirs[0]
            else "experts of another shape"
        )
        raise CheckpointError(
            f"{where}: {key!r} is {ours} in the checkpoint and {theirs} in the model ({what}); "
            f"build the model from the checkpoint's own config.json (its expert count and "
            f"hidden / moe_intermediate sizes)"
        )
