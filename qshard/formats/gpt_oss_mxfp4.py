"""gpt-oss MXFP4 checkpoints (quant_method "mxfp4"; docs/design.md, "Formats" and "Experts in
transformers") <-> 3-D Mxfp4Tensor experts.

Only the MoE experts are quantized: `<p>_blocks` uint8 [E, rows, K/32, 16] (32 e2m1 codes per
16 bytes, the even index in the low nibble) and `<p>_scales` uint8 [E, rows, K/32] (e8m0
exponents, bias 127), for `<p>` = `...mlp.experts.gate_up_proj` (rows = 2I, K = hidden; the rows
interleave gate and up: row 2i is gate unit i, row 2i + 1 up unit i) and
`...mlp.experts.down_proj` (rows = hidden, K = I). The blocks run along the contraction dim K:
reshaped to [E, rows, K/2] they are exactly the MXFP4 layout's bytes of [E, rows, K] experts
(each expert's [out, in] linear weight), and the scales the layout's e8m0 scales. transformers'
GptOssExperts holds the parameters transposed, `gate_up_proj` [E, H, 2I] and `down_proj`
[E, I, H] (in x out, `x @ w[e]`), so `<p>` loads as that Mxfp4Tensor's transpose(-2, -1): the
same bytes, the model's shape, gate and up interleaved as stored (the module's `_apply_gate`
takes `[..., ::2]` and `[..., 1::2]`). The biases `<p>_bias` [E, rows] and every other tensor
stay as stored.

Export writes such experts back: an Mxfp4Tensor [E, in, out] stored transposed (groups of 32
along `in`) under `...experts.gate_up_proj` / `down_proj` becomes `_blocks` / `_scales`; the
format holds nothing else quantized.
"""

from __future__ import annotations

import torch

from ..config import Backend
from ..errors import QShardError
from ..layouts import Mxfp4Tensor
from ..qtensor import QTensor
from .configs import check_stored, quantization_config

NAME = "gpt-oss-mxfp4"
GROUP = 32


def detect(config: dict, hf_quant: dict | None) -> bool:
    qc = quantization_config(config)
    return qc is not None and qc.raw("quant_method") == "mxfp4"


def load(reader, config: dict, hf_quant: dict | None, dtype: torch.dtype) -> dict:
    state = {}
    prefixes = {k.removesuffix("_blocks") for k in reader.names() if k.endswith("_blocks")}
    for key in reader.names():
        prefix = key.removesuffix("_blocks").removesuffix("_scales")
        if prefix in prefixes and key in (prefix + "_blocks", prefix + "_scales"):
            if key.endswith("_blocks"):
                state.update(_experts(reader, prefix, dtype))
            continue
        state[key] = reader.get(key)
    return state


def _experts(reader, prefix: str, dtype: torch.dtype) -> dict:
    where = str(reader.directory)
    blocks = check_stored(
        where,
        prefix + "_blocks",
        reader.get(prefix + "_blocks"),
        torch.uint8,
        (None, None, None, GROUP // 2),
    )
    experts, rows, groups = blocks.shape[:3]
    scales = check_stored(
        where,
        prefix + "_scales",
        reader.get(prefix + "_scales"),
        torch.uint8,
        (experts, rows, groups),
    )
    inner = {
        "qdata": blocks.reshape(experts, rows, groups * GROUP // 2),
        "scale": scales.view(torch.float8_e8m0fnu),
    }
    tensor = Mxfp4Tensor(
        inner,
        shape=(experts, rows, groups * GROUP),
        dtype=dtype,
        group_size=GROUP,
        backend=Backend.AUTO,
    )
    tensor.validate()
    return {prefix: tensor.transpose(-2, -1)}  # the model's [E, in, out]


def export(state: dict, linear_names: list[str]) -> tuple[dict, dict, dict]:
    """(tensors, config.json entries, other files): each experts Mxfp4Tensor (groups of 32)
    stored [E, in, out] as `<p>_blocks` / `<p>_scales`; plain tensors as they are."""
    tensors = {}
    for key, value in state.items():
        if not isinstance(value, QTensor):
            tensors[key] = value
            continue
        fits = (
            isinstance(value, Mxfp4Tensor)
            and value.group_size == GROUP
            and value.experts is not None
            and value.transposed
            and value.matrix_shape[1] % GROUP == 0
        )
        if not fits:
            raise QShardError(
                f"qshard.export(format='{NAME}'): {key!r} is a {type(value).__name__} "
                f"{list(value.shape)}{' (not transposed)' if not value.transposed else ''}; the "
                f"format holds only experts weights [E, in, out] (gpt-oss's transposed "
                f"parameters) in MXFP4 with groups of {GROUP} along `in` (a multiple of {GROUP})"
            )
        experts, rows, k = value.logical_shape
        tensors[key + "_blocks"] = value.qdata.reshape(experts, rows, k // GROUP, GROUP // 2)
        tensors[key + "_scales"] = value.scale.view(torch.uint8)
    skipped = sorted(
        k.removesuffix(".weight")
        for k, v in state.items()
        if not isinstance(v, QTensor) and k.endswith(".weight") and v.dim() == 2
    )
    qc = {"quant_method": "mxfp4", "modules_to_not_convert": skipped}
    return tensors, {"quantization_config": qc}, {}
