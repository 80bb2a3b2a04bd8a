"""Which grouped (experts) kernel runs: one rule table, one `choose()` per weight family.

    FP8_TILES    fp8.py           FP8 blockwise W8A8 experts, every token count
    W4A16_GEMV   w4a16_gemv.py    4-bit experts at decode: about one routed row per expert
    W4A16_TILES  w4a16_tiles.py   4-bit experts otherwise (tensor cores)

The 4-bit rule, measured on the H100 on the Qwen3-30B-A3B, DeepSeek-V3 and gpt-oss-120b expert
shapes (bench/bench_moe.py; docs/kernels/grouped.md): the GEMV while the mean routed rows per
expert, T / E, is at most GEMV_MAX_ROWS_PER_EXPERT (decode: 1-16 tokens of every shape
measured) and K takes whole 32-bit words; the tensor-core kernel above.
"""

from __future__ import annotations

import dataclasses
import enum

from . import fp8, w4a16_gemv, w4a16_tiles
from .common import token_block

__all__ = ["GEMV_MAX_ROWS_PER_EXPERT", "Choice", "Kernel", "choose_fp8", "choose_w4a16"]

GEMV_MAX_ROWS_PER_EXPERT = 1  # mean routed rows per expert up to which the 4-bit GEMV runs


class Kernel(str, enum.Enum):
    FP8_TILES = "fp8_tiles"
    W4A16_GEMV = "gemv"  # (the name a config's "KERNEL" key gives)
    W4A16_TILES = "tiles"


@dataclasses.dataclass(frozen=True)
class Choice:
    kernel: Kernel
    config: dict
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel.value} {self.config} ({self.reason})"


def choose_w4a16(fmt: int, tokens: int, experts: int, k: int, config: dict | None = None) -> Choice:
    """The 4-bit kernel for `tokens` routed rows over `experts` (module docstring); `config`
    where given (its "KERNEL" key "gemv" names the GEMV)."""
    if config:  # (an empty config is none)
        gemv = config.get("KERNEL") == Kernel.W4A16_GEMV.value
        return Choice(Kernel.W4A16_GEMV if gemv else Kernel.W4A16_TILES, config, "given")
    if tokens <= GEMV_MAX_ROWS_PER_EXPERT * experts and w4a16_gemv.problem(fmt, k) is None:
        reason = f"decode: at most {GEMV_MAX_ROWS_PER_EXPERT} routed row per expert"
        return Choice(Kernel.W4A16_GEMV, w4a16_gemv.config(k), reason)
    return Choice(
        Kernel.W4A16_TILES,
        w4a16_tiles.config(tokens, experts),
        "more routed rows per expert than the GEMV's rule",
    )


def choose_fp8(tokens: int, experts: int, config: dict | None = None) -> Choice:
    """The FP8 kernel's config (one kernel; its tile by the token block)."""
    if config is not None:
        return Choice(Kernel.FP8_TILES, config, "given")
    return Choice(
        Kernel.FP8_TILES,
        fp8.config(token_block(tokens, experts)),
        "the token block's tile (H100 sweep, docs/kernels/grouped.md)",
    )
