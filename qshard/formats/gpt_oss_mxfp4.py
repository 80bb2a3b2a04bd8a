"""gpt-oss MXFP4 checkpoints (quant_method "mxfp4"; facts.md §5) -> Mxfp4Tensor per expert.

Only the MoE experts are quantized: `<p>_blocks` uint8 [E, rows, K/32, 16] (32 e2m1 codes per
16 bytes, the even index in the low nibble) and `<p>_scales` uint8 [E, rows, K/32] (e8m0
exponents, bias 127), for `<p>` = `...mlp.experts.gate_up_proj` (whose rows interleave gate and
up: row 2i is gate unit i, row 2i + 1 up unit i) and `...mlp.experts.down_proj`. Expert e's
blocks reshaped to [rows, K/2] are exactly the MXFP4 layout's bytes, its scales the layout's
e8m0 scales: each maps as it is, to `<p>.<e>.weight`, a [rows, K] Mxfp4Tensor (the linear
weight of one expert, out_features x in_features). Biases and every other tensor stay as
stored. Export to this format is not offered (gpt-oss checkpoints come from OpenAI's own
training; the issue lists export for the three other formats).
"""

from __future__ import annotations

import torch

from ..config import Backend
from ..layouts import Mxfp4Tensor
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
    blocks = check_stored(where, prefix + "_blocks", reader.get(prefix + "_blocks"), torch.uint8,
                          (None, None, None, GROUP // 2))  # fmt: skip
    experts, rows, groups = blocks.shape[:3]
    scales = check_stored(where, prefix + "_scales", reader.get(prefix + "_scales"), torch.uint8,
                          (experts, rows, groups))  # fmt: skip
    out = {}
    for e in range(experts):
        inner = {
            "qdata": blocks[e].reshape(rows, groups * GROUP // 2).contiguous(),
            "scale": scales[e].contiguous().view(torch.float8_e8m0fnu),
        }
        tensor = Mxfp4Tensor(inner, shape=(rows, groups * GROUP), dtype=dtype,
                             group_size=GROUP, backend=Backend.AUTO)  # fmt: skip
        tensor.validate()
        out[f"{prefix}.{e}.weight"] = tensor
    return out
