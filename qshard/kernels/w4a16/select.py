"""Which W4A16 kernel runs a matmul: one rule table, one `choose()`.

Every caller goes through `choose()`: the op (`ops.linear_launch`), the bench scripts (which
print its choice) and the tests. A rule names a kernel, the matmuls it applies to (`applies`),
the kernel's config there (`config`) and the measurement behind it; the first rule that applies
and whose kernel can run the matmul (the strategy module's `problem()` is None) wins.
The strategies, each a module with `problem()`, `config()` and `launch()`:

    GEMV            gemv.py            one token, any K (bytes)
    GEMV_WORDS      gemv_words.py      one token (and two on small weights), K % 1024 == 0
    SMALL_M         small_m.py         2..128 tokens, tensor cores, split K (Triton)
    REGISTER        register.py        2..12 tokens on Hopper (Gluon, mma.sync)
    REGISTER_WS     register_ws.py     8..16 tokens on Hopper, warp-specialized
    REGISTER_WGMMA  register_wgmma.py  2..128 tokens on Hopper, wgmma
    DEQUANTIZE      dequantize.py      the weight dequantized once, then cuBLAS

The thresholds were measured on an H100 against the kernels otherwise chosen, on the
Llama-3.1-8B linears (docs/kernels/w4a16.md, docs/kernels/w4a16_register.md); the reason of
each is in its rule; re-measured on an H200, they were within 3 % of the fastest kernel on 84 of
87 (linear, token bucket) pairs (docs/kernels/w4a16.md, "Tuned configs"). A tuned entry for this
GPU, shape and bucket (`tuning.py`, written by bench/tune_w4a16.py only where it beat these
rules) comes first.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch

from ...errors import ConfigError
from .. import tuning
from ..split_k import programs_of
from ..tuning import tuned_config
from . import dequantize, gemv, gemv_words, register, register_wgmma, register_ws, small_m
from .format import Format, tuned_format

__all__ = [
    "FUSED_MAX_M",
    "GEMV_MAX_M",
    "NATIVE_RULES",
    "RULES",
    "Choice",
    "Kernel",
    "Matmul",
    "Rule",
    "choose",
    "default_config",
    "kernel_for",
    "wgmma_chosen",
]


class Kernel(str, enum.Enum):
    """The kernels, by the name a config's "KERNEL" key gives."""

    GEMV = "gemv"
    GEMV_WORDS = "gemv_words"
    SMALL_M = "small_m"
    REGISTER = "register"
    REGISTER_WS = "register_ws"
    REGISTER_WGMMA = "register_wgmma"
    DEQUANTIZE = "dequantize"


STRATEGIES = {
    Kernel.GEMV: gemv,
    Kernel.GEMV_WORDS: gemv_words,
    Kernel.SMALL_M: small_m,
    Kernel.REGISTER: register,
    Kernel.REGISTER_WS: register_ws,
    Kernel.REGISTER_WGMMA: register_wgmma,
    Kernel.DEQUANTIZE: dequantize,
}
# the kernels that read int4 codes in `packing.native_codes`' order (with NATIVE = 1)
NATIVE_KERNELS = (Kernel.GEMV_WORDS, Kernel.REGISTER_WGMMA, Kernel.DEQUANTIZE)

GEMV_MAX_M = 1
FUSED_MAX_M = 128  # above, dequantize + cuBLAS: compute-bound there
# The register kernel runs up to 128 tokens, but measured on an H100 it beats the small-M kernel
# up to 12 (at 16 a tie; docs/kernels/w4a16_register.md, "The mma.sync register kernel
# (`w4a16/register.py`)"); its warp-specialized form (K % 128 == 0) beats both at 8..16 (at 4 a
# tie with the register kernel, at 2 slower: "The warp-specialized kernel
# (`w4a16/register_ws.py`)").
REGISTER_CHOICE_MAX_M = 12
WS_CHOICE_MIN_M, WS_CHOICE_MAX_M = 8, 16
# The wgmma register kernel (K % 128 == 0), measured on the H100 against the kernels above on the
# Llama-3.1-8B linears (docs/kernels/w4a16_register.md, "The wgmma kernel
# (`w4a16/register_wgmma.py`)"): int4 faster on all four from 9 tokens to 128; at 2..8 faster on
# gate_up (N x K = 117M), even on down (59M) and 1 us slower on qkv and o (25M, 17M). MXFP4 and
# NVFP4 faster on all four from 17 tokens; at 9..16 on gate_up and down, slower at 16 on qkv and
# o; not timed below 9.
WGMMA_CHOICE_MAX_M = 128
WGMMA_BIG_WEIGHTS = 40_000_000  # N x K: "big" above
# Two tokens on a small weight: the word GEMV with both tokens in each program (the codes
# decoded once for both) beat the kernels the op ran there, measured on the H100 on the
# Llama-3.1-8B linears (bench/README.md, "int4 on an H100, with tinygemm, gemlite and Marlin";
# docs/kernels/w4a16.md, "Two tokens: the pair GEMV"): int4 (native codes) on o (N x K = 17M;
# not on qkv, 25M), MXFP4 and NVFP4 (canonical) on qkv and o. On larger weights, and from 3
# tokens, the decode's cost per token makes it the slower.
PAIR_GEMV_MAX_WEIGHTS = {"int4": 20_000_000, "fp4": 30_000_000}


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One matmul to choose for: x [M, K] @ W.T, W [N, K] in `fmt` with groups of `group`;
    `native`: int4 codes in `packing.native_codes`' order."""

    fmt: Format
    x: torch.Tensor
    qdata: torch.Tensor
    group: int
    native: bool = False

    @property
    def m(self) -> int:
        return self.x.shape[0]

    @property
    def n(self) -> int:
        return self.qdata.shape[0]

    @property
    def k(self) -> int:
        return self.x.shape[1]


@dataclasses.dataclass(frozen=True)
class Rule:
    """`kernel` for the matmuls where `applies`, with `config` (None: the rule does not apply
    after all), where the kernel can run them; `kernel` None: the kernel `config` names."""

    kernel: Kernel | None
    applies: Callable[[Matmul], bool]
    config: Callable[[Matmul], dict | None]
    measured: str  # why: the measurement behind the rule


@dataclasses.dataclass(frozen=True)
class Choice:
    kernel: Kernel
    config: dict
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel.value} {self.config} ({self.reason})"


def wgmma_chosen(fmt: Format, m: int, n: int, k: int) -> bool:
    """Whether the wgmma register kernel is the faster for M tokens on an [N, K] weight (where
    it can run at all: `register_wgmma.problem`), as measured on the H100."""
    every_from, big_from = (9, 2) if Format(fmt).is_int4 else (17, 9)
    if m > WGMMA_CHOICE_MAX_M:
        return False
    return m >= every_from or (m >= big_from and n * k >= WGMMA_BIG_WEIGHTS)


def _pair_fits(p: Matmul) -> bool:
    family = "int4" if p.fmt.is_int4 else "fp4"
    return p.m == 2 and p.n * p.k <= PAIR_GEMV_MAX_WEIGHTS[family] and p.k % 1024 == 0


def _pair(p: Matmul) -> bool:
    # int4 was measured on the native codes only; FP4 on the canonical ones
    return _pair_fits(p) and (p.native or not p.fmt.is_int4)


def _wgmma(p: Matmul) -> dict:
    return {"KERNEL": "register_wgmma", **register_wgmma.config(p.m, p.n, p.k, p.x.device)}


def _native_wgmma(p: Matmul) -> dict:
    config = register_wgmma.config(p.m, p.n, p.k, p.x.device)
    promote = register_wgmma.promote_config(int(p.fmt), p.x, p.group, config["BLOCK_T"])
    return {"KERNEL": "register_wgmma", **config, "NATIVE": 1, **promote}


def _ws(p: Matmul) -> dict:
    return {"KERNEL": "register_ws", **register_ws.config(p.m, p.n, p.k, p.x.device, int(p.fmt))}


def _register(p: Matmul) -> dict:
    return {"KERNEL": "register", **register.config(p.m, p.n, p.k, p.x.device)}


def _tuned(p: Matmul) -> dict | None:
    """The tuned entry for this GPU, shape and token bucket (`tuning.py`), or None. An entry
    that names only its kernel (what a file measured on another GPU gives: `tuning.py`) runs
    that kernel with its own config for this device; dequantize takes the codes' order from
    the weight; the wgmma kernel's PROMOTE is dropped where x's dtype cannot take it (the tuner
    runs bf16)."""
    fmt = tuned_format(p.fmt, p.group, p.native)
    config = tuned_config("w4a16", fmt, p.n, p.k, p.m, p.x.device)
    if not config:  # (an empty entry is none)
        return None
    key = tuning.config_key("w4a16", fmt, p.n, p.k, p.m)
    kernel = _tuned_kernel(key, p, config)
    if kernel is Kernel.DEQUANTIZE:
        return dequantize.config(p.native)
    if set(config) == {"KERNEL"}:
        return _sized_here(kernel, p)
    promoted = kernel is Kernel.REGISTER_WGMMA and config.get("PROMOTE")
    block_t = config.get("BLOCK_T", 0)
    if promoted and not register_wgmma.promote_config(int(p.fmt), p.x, p.group, block_t):
        config = {**config, "PROMOTE": 0, "GROUP_CHUNKS": register_wgmma.GROUP_CHUNKS}
    return config


def _tuned_kernel(key: str, p: Matmul, config: dict) -> Kernel:
    """The kernel a tuned entry names, checked against the codes' order: native codes only by
    the kernels that read them (NATIVE = 1), canonical codes never with NATIVE = 1."""
    sources = "the GPU's file in kernels/tuned/, QSHARD_TUNED_CONFIGS or load_tuned_configs"
    try:
        kernel = kernel_for(p.m, config)
        if p.native:
            _check_native(kernel, config)
        elif config.get("NATIVE"):
            raise ValueError(f"config {config} has NATIVE = 1 for codes in the canonical order")
    except ValueError as error:
        names = [k.value for k in Kernel]
        raise ConfigError(
            f"tuned config {key} (from {sources}): {error}; an entry names one of the kernels "
            f"{names}; re-run bench/tune_w4a16.py"
        ) from None
    return kernel


def _sized_here(kernel: Kernel, p: Matmul) -> dict | None:
    """`kernel`'s own config for this matmul on this device (as the rules size it)."""
    if kernel is Kernel.GEMV_WORDS:
        if p.m == 2:
            return gemv_words.pair_config(p.native)
        return gemv_words.native_config(p.k) if p.native else _words(p)
    sizing = {
        Kernel.GEMV: lambda: gemv.config(p.fmt),
        Kernel.SMALL_M: lambda: small_m.config(p.m, p.n, p.k, p.x.device),
        Kernel.REGISTER: lambda: _register(p),
        Kernel.REGISTER_WS: lambda: _ws(p),
        Kernel.REGISTER_WGMMA: lambda: _native_wgmma(p) if p.native else _wgmma(p),
    }
    return sizing[kernel]()


def _words(p: Matmul) -> dict | None:
    config = gemv_words.config(p.fmt, p.n, p.k, programs_of(p.x.device))
    return config if p.k % (8 * config["BLOCK_W"]) == 0 else None  # whole steps of words


def _one_token(p: Matmul) -> bool:
    return p.m <= GEMV_MAX_M


def _always(p: Matmul) -> bool:
    return True


# First in both tables: a tuned entry is kept only where it beat the rules below (tuning.py).
TUNED_RULE = Rule(
    None,
    _always,
    _tuned,
    "the tuned choice for this GPU, shape and token bucket: faster than the rules below by "
    "more than 3 % where the tuner measured it (tuning.py, bench/tune_w4a16.py)",
)

RULES = (
    TUNED_RULE,
    Rule(
        Kernel.GEMV_WORDS,
        _pair,
        lambda p: gemv_words.pair_config(p.native),
        "2 FP4 tokens on a weight of <= 30M: the pair GEMV beat the register kernels on qkv "
        'and o (H100; docs/kernels/w4a16.md, "Two tokens")',
    ),
    Rule(
        Kernel.REGISTER_WGMMA,
        lambda p: wgmma_chosen(p.fmt, p.m, p.n, p.k),
        _wgmma,
        "int4 from 9 tokens (from 2 on weights >= 40M), FP4 from 17 (9): faster than every "
        'other kernel there (H100; w4a16_register.md, "The wgmma kernel")',
    ),
    Rule(
        Kernel.REGISTER_WS,
        lambda p: WS_CHOICE_MIN_M <= p.m <= WS_CHOICE_MAX_M,
        _ws,
        "8..16 tokens: 1.87x / 1.62x of bf16 (int4) where the register kernel gives 1.76x / "
        '1.44x (H100; w4a16_register.md, "The warp-specialized kernel")',
    ),
    Rule(
        Kernel.REGISTER,
        lambda p: p.m <= REGISTER_CHOICE_MAX_M,
        _register,
        "2..12 tokens: int4 1.57-1.95x of bf16 where the small-M kernel gives 1.39x (H100; "
        'w4a16_register.md, "The mma.sync register kernel")',
    ),
    Rule(
        Kernel.GEMV_WORDS,
        _one_token,
        _words,
        "one token, K whole steps of words: 63-66 % of the copy bandwidth (H100; "
        'docs/kernels/w4a16.md, "The one-token word GEMV")',
    ),
    Rule(Kernel.GEMV, _one_token, lambda p: gemv.config(p.fmt), "one token on any other K"),
    Rule(
        Kernel.SMALL_M,
        lambda p: p.m <= FUSED_MAX_M,
        lambda p: small_m.config(p.m, p.n, p.k, p.x.device),
        "up to 128 tokens where no register kernel runs (not on Hopper, fp32 activations, "
        "K % 32 != 0)",
    ),
    Rule(
        Kernel.DEQUANTIZE,
        _always,
        lambda p: dequantize.config(),
        "above 128 tokens: compute-bound, cuBLAS on the weight dequantized once",
    ),
)

NATIVE_RULES = (
    TUNED_RULE,
    Rule(
        Kernel.GEMV_WORDS,
        _one_token,
        lambda p: gemv_words.native_config(p.k),
        "one token: the word GEMV reads the native order at the copy bandwidth's rate (H100; "
        'bench/README.md, "int4 on an H100")',
    ),
    Rule(
        Kernel.GEMV_WORDS,
        _pair,
        lambda p: gemv_words.pair_config(native=True),
        "2 tokens on a weight of <= 20M (o): the pair GEMV beat the wgmma kernel (H100; "
        'docs/kernels/w4a16.md, "Two tokens")',
    ),
    Rule(
        Kernel.REGISTER_WGMMA,
        _always,
        _native_wgmma,
        "2..128 tokens: the native order decodes into x's own columns (H100: 77.7 / 83.0 / "
        "98.7 us at 16 / 32 / 64 tokens against 85.2 / 94.9 / 115.2 on canonical codes; sums "
        "scaled per chunk up to 32 tokens)",
    ),
    Rule(
        Kernel.DEQUANTIZE,
        _always,
        lambda p: dequantize.config(native=True),
        "elsewhere: dequantize un-permutes the codes, then cuBLAS",
    ),
)


def kernel_for(m: int, config: dict | None) -> Kernel:
    """The kernel a config names: its "KERNEL" key, else by its keys (SPLIT_K: small-M, else a
    byte GEMV config); without a config, the built-in default's kernel for M tokens."""
    if config is not None:
        if "KERNEL" in config:
            return Kernel(config["KERNEL"])
        return Kernel.SMALL_M if "SPLIT_K" in config else Kernel.GEMV
    if m <= GEMV_MAX_M:
        return Kernel.GEMV
    return Kernel.SMALL_M if m <= FUSED_MAX_M else Kernel.DEQUANTIZE


def default_config(fmt: Format, m: int, n: int, k: int, device: torch.device) -> dict:
    """The built-in config for M tokens (no tuning, no register kernel): the word GEMV at one
    token where K takes whole steps (else the byte GEMV), small-M up to 128, else dequantize."""
    if m <= GEMV_MAX_M:
        words = gemv_words.config(Format(fmt), n, k, programs_of(device))
        return words if k % (8 * words["BLOCK_W"]) == 0 else gemv.config(Format(fmt))
    return small_m.config(m, n, k, device) if m <= FUSED_MAX_M else dequantize.config()


def choose(
    fmt: Format,
    x: torch.Tensor,
    qdata: torch.Tensor,
    group: int,
    native: bool = False,
    config: dict | None = None,
) -> Choice:
    """The kernel and config for x [M, K] @ W.T (W's codes `qdata`, groups of `group`; `native`:
    int4 codes in the native order): `config` where given (tests, tuning sweeps), else the first
    rule of `RULES` (`NATIVE_RULES`) that applies and whose kernel can run the matmul."""
    fmt = Format(fmt)
    if config:  # (an empty config is none)
        kernel = kernel_for(x.shape[0], config)
        if native:
            _check_native(kernel, config)
        if kernel is Kernel.DEQUANTIZE:  # the codes' order is the op's flag, not the config's
            config = dequantize.config(native)
        return Choice(kernel, config, "given")
    p = Matmul(fmt, x, qdata, group, native)
    for rule in NATIVE_RULES if native else RULES:
        if not rule.applies(p):
            continue
        if rule.kernel is not None and not _runs(rule.kernel, p):
            continue
        found = rule.config(p)
        if found is None:
            continue
        kernel = rule.kernel or kernel_for(p.m, found)
        if rule.kernel is not None or _runs(kernel, p):
            return Choice(kernel, found, rule.measured)
    raise AssertionError("the last rule (dequantize) always applies")


def _runs(kernel: Kernel, p: Matmul) -> bool:
    return STRATEGIES[kernel].problem(int(p.fmt), p.x, p.qdata, p.group) is None


def _check_native(kernel: Kernel, config: dict) -> None:
    if kernel not in NATIVE_KERNELS or (
        kernel is not Kernel.DEQUANTIZE and not config.get("NATIVE")
    ):
        names = [k.value for k in NATIVE_KERNELS]
        raise ValueError(
            f"config {config} for codes in the native order: only {names} read it, with NATIVE = 1"
        )
