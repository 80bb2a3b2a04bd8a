"""Which FP8 blockwise kernel runs a matmul: one rule table, one `choose()`.

    GLUON     gluon.py     2..64 tokens on Hopper with 128x128 blocks and 1x128 groups
    CUBLAS    cublas.py    above 64 tokens where cuBLAS takes the layout
    GEMV      gemv.py      one token (Triton)
    SMALL_M   small_m.py   up to 64 tokens (Triton, split K)
    GEMM      gemm.py      above (Triton): where cuBLAS cannot take the layout

The layer's backend ("auto", "triton", "cublas") narrows the rules: "triton" keeps the three
Triton kernels, "cublas" runs cuBLAS. The choice is made inside the op at run time, so that
torch.compile with a dynamic batch puts no guard on the token count.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable

import torch

from . import cublas, gemm, gemv, gluon, small_m

__all__ = [
    "GLUON_CHOICE_M",
    "RULES",
    "SMALL_M_MAX",
    "Choice",
    "Kernel",
    "choose",
    "kernel_config",
    "kernel_named_by",
    "triton_kernel_for",
]


class Kernel(str, enum.Enum):
    GLUON = "gluon"
    CUBLAS = "cublas"
    GEMV = "gemv"
    SMALL_M = "small_m"
    GEMM = "gemm"


TRITON_KERNELS = (Kernel.GEMV, Kernel.SMALL_M, Kernel.GEMM)
# The Gluon kernel for this many tokens where it can run: where it beat both the Triton kernels
# and cuBLAS on the H100 (docs/kernels/fp8_blockwise.md, "Gluon kernel")
GLUON_CHOICE_M = (2, 64)
# Up to this many tokens the GEMV-like kernel: each token re-reads the weights (from L2); on an
# H200 the Llama layer took 73 us at one token but 169 us at 4, where cuBLAS takes ~100.
GEMV_MAX_M = 1
# Up to this many tokens the small-M kernel; above, cuBLAS where it takes the layout (on the H200
# cuBLAS beat the Triton tensor-core GEMM from 128 tokens to 4096: bench/README.md), else the
# Triton GEMM.
SMALL_M_MAX = 64


@dataclasses.dataclass(frozen=True)
class Rule:
    kernel: Kernel
    applies: Callable[[int], bool]  # on the token count
    measured: str


@dataclasses.dataclass(frozen=True)
class Choice:
    kernel: Kernel
    config: dict | None  # None: the kernel's launch takes its own
    reason: str

    def __str__(self) -> str:
        return f"{self.kernel.value} {self.config or ''} ({self.reason})"


RULES = (
    Rule(
        Kernel.GLUON,
        lambda m: GLUON_CHOICE_M[0] <= m <= GLUON_CHOICE_M[1],
        "2..64 tokens: beat the Triton kernels and cuBLAS (H100; docs/kernels/fp8_blockwise.md,"
        ' "Gluon kernel")',
    ),
    Rule(
        Kernel.CUBLAS,
        lambda m: m > SMALL_M_MAX,
        "above 64 tokens: cuBLAS beat the Triton "
        "GEMM from 128 to 4096 tokens (H200; bench/README.md)",
    ),
    Rule(
        Kernel.GEMV,
        lambda m: m <= GEMV_MAX_M,
        "one token: the GEMV streams the weights at "
        "HBM speed, the activation row quantized in registers",
    ),
    Rule(
        Kernel.SMALL_M,
        lambda m: m <= SMALL_M_MAX,
        "up to 64 tokens: split K fills the GPU (H200 sweep, docs/kernels/fp8_blockwise.md)",
    ),
    Rule(Kernel.GEMM, lambda m: True, "above 64 tokens where cuBLAS cannot take the layout"),
)
STRATEGIES = {
    Kernel.GLUON: gluon,
    Kernel.CUBLAS: cublas,
    Kernel.GEMV: gemv,
    Kernel.SMALL_M: small_m,
    Kernel.GEMM: gemm,
}


def triton_kernel_for(m: int) -> Kernel:
    """Which Triton kernel serves M tokens (H200 sweep, docs/kernels/fp8_blockwise.md)."""
    return next(r.kernel for r in RULES if r.kernel in TRITON_KERNELS and r.applies(m))


def kernel_config(kernel: Kernel, x: torch.Tensor, n: int, group: int) -> dict | None:
    """The built-in config of `kernel` for x [M, K] @ W.T, W [N, K]."""
    m, k = x.shape
    if kernel is Kernel.GEMV:
        return gemv.config(m, n, k, group)
    if kernel is Kernel.SMALL_M:
        return small_m.config(m, n, k, group, x.device)
    if kernel is Kernel.GEMM:
        return gemm.config(m, n, k)
    return None  # Gluon and cuBLAS: their launch's own (Gluon's `config()`)


def kernel_named_by(config: dict) -> Kernel:
    """The kernel a config is for, by its keys."""
    for key, kernel in (
        ("GROUPS_PER_STEP", Kernel.GEMV),
        ("SPLIT_K", Kernel.SMALL_M),
        ("GROUP_M", Kernel.GEMM),
        ("BLOCK_T", Kernel.GLUON),
    ):
        if key in config:
            return kernel
    raise ValueError(
        f"FP8 config {config}: name a kernel by its keys (GROUPS_PER_STEP: the "
        f"GEMV, SPLIT_K: small-M, GROUP_M: the GEMM, BLOCK_T: Gluon)"
    )


def choose(
    x: torch.Tensor,
    qdata: torch.Tensor,
    block_n: int,
    block_k: int,
    group: int,
    backend: str = "auto",
    config: dict | None = None,
) -> Choice:
    """The kernel and config for x [M, K] @ W.T (W [N, K] e4m3 in block_n x block_k blocks,
    activation groups of `group`): `config`'s kernel where given; cuBLAS for backend "cublas",
    Gluon for "gluon"; else the first rule that applies, that the backend allows ("auto": all,
    "triton": the Triton kernels) and whose kernel can run the matmul (its module's `problem()`
    is None)."""
    if config is not None:
        return Choice(kernel_named_by(config), config, "given")
    if backend == "cublas":
        return Choice(Kernel.CUBLAS, None, "the layer's backend")
    if backend == "gluon":
        return Choice(Kernel.GLUON, None, "the op's backend")
    for rule in RULES:
        if backend != "auto" and rule.kernel not in TRITON_KERNELS:
            continue
        if not rule.applies(x.shape[0]):
            continue
        if STRATEGIES[rule.kernel].problem(x, qdata, block_n, block_k, group) is None:
            return Choice(
                rule.kernel, kernel_config(rule.kernel, x, qdata.shape[0], group), rule.measured
            )
    raise AssertionError("the last rule (the Triton GEMM) always applies")
