"""`qshard demo`: quantize a small model, print the report, compare outputs with float.

The model is a small random Llama-style MLP stack built here (no download). It grows into the
real-model demo of later versions.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from .api import quantize_
from .layouts import Fp8BlockwiseConfig
from .metrics import cosine_similarity, sqnr_db

__all__ = ["TinyMLPStack", "run_demo"]


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class TinyMLPStack(nn.Module):
    """Embedding, `layers` pre-norm SwiGLU blocks, and an output head."""

    def __init__(self, vocab: int = 512, dim: int = 320, hidden: int = 864, layers: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.RMSNorm(dim) for _ in range(layers))
        self.mlps = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(layers))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens):
        h = self.embed(tokens)
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            h = h + mlp(norm(h))
        return self.lm_head(h)


def _time_ms(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


@torch.no_grad()
def run_demo(seed: int = 0) -> dict[str, float]:
    torch.manual_seed(seed)
    model = TinyMLPStack()
    tokens = torch.randint(0, 512, (2, 64))
    reference = model(tokens)
    float_ms = _time_ms(lambda: model(tokens))
    # The output head stays in float, as DeepSeek-V3's FP8 checkpoints keep it.
    report = quantize_(model, Fp8BlockwiseConfig(), exclude=["lm_head"])
    print(report)
    quantized = model(tokens)
    quant_ms = _time_ms(lambda: model(tokens))
    result = {
        "sqnr_db": sqnr_db(reference, quantized),
        "cosine": cosine_similarity(reference, quantized),
        "float_ms": float_ms,
        "quantized_ms": quant_ms,
    }
    print(
        f"\nlogits vs float: SQNR {result['sqnr_db']:.1f} dB, cosine {result['cosine']:.5f}\n"
        f"forward on {tokens.numel()} tokens ({quantized.device}, reference path): "
        f"float {float_ms:.1f} ms, fp8 {quant_ms:.1f} ms"
    )
    return result
