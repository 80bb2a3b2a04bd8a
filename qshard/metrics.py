"""Accuracy measures shared by the tests, the demo and the benchmarks."""

from __future__ import annotations

import math

import torch

__all__ = ["cosine_similarity", "sqnr_db"]


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(|ref|^2 / |ref - approx|^2)."""
    ref = reference.detach().double()
    noise = (ref - approx.detach().double()).pow(2).sum().item()
    signal = ref.pow(2).sum().item()
    if not math.isfinite(noise):
        return -math.inf  # NaN/Inf in the approximation: no signal survives
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def cosine_similarity(reference: torch.Tensor, approx: torch.Tensor) -> float:
    a, b = reference.detach().double().flatten(), approx.detach().double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))
