"""Weight-only 4-bit (W4A16) kernels in Triton, one family for every 4-bit layout: int4
(asymmetric and symmetric), MXFP4 and NVFP4. They differ only in how a code and its group's
scale become a weight (`_decode`, `_group_scale`, `_dequantize`); the loops are shared.

Codes are packed two per byte along K, the even index in the low nibble (every layout's
canonical packing). `_decode` turns a tile of bytes into values in K order by bit placement
alone: int4 as 1 + u/16 (u in fp32's top mantissa bits), e2m1 as fp16 bits (value * 2**-14),
so no integer-to-float conversion and no table; with K a multiple of the step, the GEMV and the
small-M kernel decode whole 32-bit words in place instead (`_int4_nibble`, `_word_pair`). Every
step's codes and scales are loaded ahead by hand (one step, or two with the small-M kernel's
`PREFETCH` = 2), and so are the activations where they are carried (the GEMVs; the small-M
kernel with 1): Triton pipelines only loads that feed a dot.

- int4 codes in the native order (`native=True`: what an int4 weight with groups of 128 holds on
  Hopper, layouts/int4.py): `native_choice` picks the word GEMV at one token, the wgmma kernel at
  2..128 tokens and dequantize + cuBLAS otherwise, each reading that order (H100, Llama-3.1-8B
  layer at 1 / 16 / 32 / 64 / 128 tokens: 2.92x / 2.15x / 2.02x / 1.72x / 1.26x of bf16;
  docs/kernels/w4a16_register.md, "The native code order (int4 with groups of 128 on Hopper)").
  The bullets below are the canonical codes'.
- M = 1 (decode): a GEMV. With K a multiple of its step, `_gemv_words_kernel` (every format),
  which decodes whole 32-bit words in place and never rebuilds the K order: int4 codes as the
  exact u - 8 (`_int4_exact`: one LOP3 and one subtraction), e2m1 pairs as fp16 halves; the
  activations read as 32-bit pairs; each (row, group) keeps its scaled sum across the steps;
  optionally K split over programs (SPLIT_K) and the codes loaded two steps ahead or
  evict-first (the default loads them evict-first). Otherwise `_gemv_kernel` (bytes, BLOCK_K
  of K per step). Both multiply the exact weight, not the weight rounded to the activation
  dtype as the reference does: within the activation dtype's rounding for bf16/fp16 (the tests'
  tolerance). In `_gemv_kernel`, for fp32 activations, the int4 zero-point term, 16 * sum v x -
  (16 + z) * sum x, cancels and costs a few fp32 ulps of the group sums (up to ~1e-5 relative
  on activations with a large mean). On the H100 the Llama layer at M = 1 takes int4 58 us,
  MXFP4 61 us, NVFP4 68 us (63-66 % / 60 % of the copy bandwidth; docs/kernels/w4a16.md,
  "The one-token word GEMV").
- 2 <= M <= REGISTER_CHOICE_MAX_M on Hopper (int4 with groups >= 32, MXFP4, NVFP4; bf16/fp16;
  K % 32 == 0): the register-operand Gluon kernel (`w4a16_gluon.py`; H100, Llama-3.1-8B layer
  at M = 2..12: int4 1.57-1.95x of bf16 where the kernel below gives 1.39x; MXFP4 1.48-1.72x
  against 1.17-1.28x; NVFP4 1.43-1.64x against 0.99-1.03x), except where the next one runs.
- WS_CHOICE_MIN_M <= M <= WS_CHOICE_MAX_M on Hopper where K % 128 == 0 (the formats as above),
  except where the next one runs: the same kernel warp-specialized, a TMA producer feeding the
  compute warps (`w4a16_gluon_ws.py`; H100, Llama-3.1-8B layer at M = 8 / 16: int4 1.87x /
  1.62x of bf16, MXFP4 1.68x / 1.53x, NVFP4 1.57x / 1.42x, where the register kernel gives
  1.76x / 1.44x, 1.62x / 1.38x, 1.54x / 1.35x and the kernel below 1.35x / 1.37x, 1.18x,
  0.97x).
- where `wgmma_chosen` on Hopper and K % 128 == 0 (int4 from 9 tokens to 128 on every
  weight and from 2 on weights of >= WGMMA_BIG_WEIGHTS; MXFP4 / NVFP4 from 17 on every weight
  and from 9 on the big ones): the register operand on wgmma, asynchronous
  (`w4a16_gluon_wgmma.py`; H100, Llama-3.1-8B layer at M = 16 / 32 / 64 / 128: int4 1.96x /
  1.77x / 1.47x / 1.12x of bf16 where the kernels otherwise chosen give 1.62x / 1.29x / 0.96x /
  0.72x; MXFP4 at M = 32 / 128 1.48x / 1.10x where they give 1.16x / 0.66x;
  docs/kernels/w4a16_register.md, "The wgmma kernel (`w4a16_gluon_wgmma.py`)").
- 2 <= M <= FUSED_MAX_M otherwise: a tensor-core kernel, "swap AB" (weight rows on the MMA's M
  side, the tokens on its N side), K split over programs so a 4096-wide layer fills the GPU
  (`split_k.py`). The weight tile is dequantized in fp32 and rounded to the activation dtype,
  as the reference. On the H100, with the tuned configs, the Llama layer at M = 32 takes int4
  129 us, MXFP4 146 us, NVFP4 176 us (docs/kernels/w4a16.md, "The small-M tensor-core
  kernel").
- Above: the weight is dequantized once into the activation dtype (bit-exact vs the reference)
  and cuBLAS multiplies (`F.linear`): compute-bound there.
Configs: a tuned one for this GPU, shape and M bucket where a shipped (or loaded) tuned file has
one (`tuning.py`, written by bench/tune_w4a16.py), else the built-in `default_config`.

Formats (FORMAT, a constexpr), each weight exactly the reference's fp32 value:
    INT4_ASYM  W = (u - zero) * scale, bf16 scale and zero     (16 v - 16 - z) * s, v = 1 + u/16
    INT4_SYM   W = (u - 8) * scale                              the same with z = 8
    INT4_FZERO W = (u - 8) * scale + zero, zero a float value   fma(16 v - 24, s, zero)
    MXFP4      W = e2m1(c) * 2**(e - 127), e8m0 byte e           (v * 2**14) * 2**(e - 127)
    NVFP4      W = (e2m1(c) * e4m3 scale) * global_scale         the reference's order
Compiled kernels flush fp32 subnormal results to zero (weights below 1.2e-38; the reference
keeps them). Measured on an H200: the Llama-3.1-8B layer at 1.53x / 0.84x / 0.49x / 0.92x
of bf16 (int4 g128) at M = 1 / 16 / 128 / 2048; on an H100 with the word GEMV and tuned
configs 2.78x / 1.19x / 0.67x / 0.88x (M = 1: docs/kernels/w4a16.md, "The one-token word
GEMV").
Ops: `torch.ops.qshard.int4_linear`, `.mxfp4_linear`, `.nvfp4_linear` (fake implementations
beside them); references: `int4.py`, `mxfp4.py`, `nvfp4.py`.
"""

from __future__ import annotations

import enum
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .packing import check_native_order
from .split_k import _sm_count, finish_tile, split_count, workspace
from .tuning import tuned_config
from .w4a16_gluon import register_config, register_launch, register_problem
from .w4a16_gluon_wgmma import promote_config, wgmma_config, wgmma_launch, wgmma_problem
from .w4a16_gluon_ws import ws_config, ws_launch, ws_problem

__all__ = [
    "DEQUANTIZE",
    "Format",
    "default_config",
    "dequantize_launch",
    "gemv_config",
    "gemv_words_config",
    "kernel_for",
    "linear_launch",
    "native_choice",
    "native_gemv_step",
    "op_choice",
    "pair_gemv_choice",
    "small_m_config",
    "tuned_format",
]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETED)


class Format(enum.IntEnum):
    INT4_ASYM = 0
    INT4_SYM = 1
    INT4_FZERO = 2  # the int4 formats come first: `FORMAT >= _MXFP4` means e2m1
    MXFP4 = 3
    NVFP4 = 4


_INT4_ASYM: tl.constexpr = tl.constexpr(int(Format.INT4_ASYM))
_INT4_SYM: tl.constexpr = tl.constexpr(int(Format.INT4_SYM))
_INT4_FZERO: tl.constexpr = tl.constexpr(int(Format.INT4_FZERO))
_MXFP4: tl.constexpr = tl.constexpr(int(Format.MXFP4))
_NVFP4: tl.constexpr = tl.constexpr(int(Format.NVFP4))

GEMV_MAX_M = 1
FUSED_MAX_M = 128
# The register kernel (w4a16_gluon.py) runs up to 128 tokens, but measured on an H100 it beats
# the small-M kernel below up to 12 (at 16 a tie; docs/kernels/w4a16_register.md, "The
# mma.sync register kernel (`w4a16_gluon.py`)"); its warp-specialized form (w4a16_gluon_ws.py,
# K % 128 == 0) beats both at 8..16 (at 4 a tie with the register kernel, at 2 slower: "The
# warp-specialized kernel (`w4a16_gluon_ws.py`)").
REGISTER_CHOICE_MAX_M = 12
WS_CHOICE_MIN_M, WS_CHOICE_MAX_M = 8, 16
# The wgmma register kernel (w4a16_gluon_wgmma.py, K % 128 == 0), measured on the H100 against
# the kernels above on the Llama-3.1-8B linears (docs/kernels/w4a16_register.md, "The wgmma
# kernel (`w4a16_gluon_wgmma.py`)"): int4 faster on all four from 9 tokens to 128; at 2..8
# faster on gate_up (N x K = 117M), even on down (59M) and 1 us slower on qkv and o (25M,
# 17M). MXFP4 and NVFP4 faster on all four from 17 tokens; at 9..16 on gate_up and down,
# slower at 16 on qkv and o; not timed below 9.
WGMMA_CHOICE_MAX_M = 128
WGMMA_BIG_WEIGHTS = 40_000_000  # N x K: "big" below


def wgmma_chosen(fmt: Format, m: int, n: int, k: int) -> bool:
    """Whether the wgmma register kernel is the faster for M tokens on an [N, K] weight (where
    it can run at all: `w4a16_gluon_wgmma.wgmma_problem`), as measured on the H100."""
    int4 = fmt in (Format.INT4_ASYM, Format.INT4_SYM, Format.INT4_FZERO)
    every_from, big_from = (9, 2) if int4 else (17, 9)
    if m > WGMMA_CHOICE_MAX_M:
        return False
    return m >= every_from or (m >= big_from and n * k >= WGMMA_BIG_WEIGHTS)


MIN_STEPS_PER_SPLIT = 4


# ---- decoding ----------------------------------------------------------------------------------


@triton.jit
def _fp16_bits_to_fp32(bits):
    """The low 16 bits of an int32 tensor read as an fp16, in fp32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int4_nibble(words, j: tl.constexpr):
    """Nibble j of every word as `_decode`'s int4 value 1 + u/16 (u in fp32's top mantissa
    bits): one shift and one and-or, exactly."""
    if 4 * j <= 19:  # noqa: SIM108 (a constexpr branch: one shift direction each)
        bits = (words << (19 - 4 * j)) & 0x780000
    else:
        bits = (words >> (4 * j - 19)) & 0x780000
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _decode(packed, FORMAT: tl.constexpr):
    """Code bytes [rows, H] -> fp32 [rows, 2H] in K order (each byte's low nibble first), by
    bit placement alone (no conversion of an integer, no table), exactly:
    int4: 1 + u/16, the fp32 with u as the top 4 mantissa bits (so u = 16 * v - 16);
    e2m1: value * 2**-14, the fp16 with e2m1's exponent and mantissa bits in fp16's low
    exponent bits and top mantissa bit (e2m1's subnormals are fp16 subnormals), and its sign."""
    b = packed.to(tl.int32)
    if FORMAT >= _MXFP4:
        low = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
        high = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
        v = _fp16_bits_to_fp32(tl.join(low, high))
    else:
        v = tl.join(_int4_nibble(b, 0), _int4_nibble(b, 1))
    return tl.reshape(v, (packed.shape[0], 2 * packed.shape[1]))


@triton.jit
def _group_scale(s_ptr, z_ptr, offs, mask, FORMAT: tl.constexpr):
    """(scale, zero) per (row, group) in fp32: the int4 scale and zero point (8 if symmetric),
    or the FP4 block scale (zero unused)."""
    if FORMAT == _MXFP4:  # e8m0: the byte e is 2**(e - 127); e = 0 is the subnormal 2**-127
        e = tl.load(s_ptr + offs, mask=mask, other=127).to(tl.int32)
        scale = tl.where(e == 0, 2.0**-127, (e << 23).to(tl.float32, bitcast=True))
        return scale, scale
    elif FORMAT == _NVFP4:
        # e4m3 read as its byte, not as Triton's fp8e4nv (which needs sm_89): the kernels run on
        # sm_80 too. Decoded by bit placement as `_decode` decodes e2m1: s eeee mmm (bias 7) in
        # fp16's sign, low exponent and top mantissa bits is the value * 2**-8 (e4m3's
        # subnormals are fp16 subnormals; NaN, e = 15 and m = 7, is never stored: the quantizer
        # clamps to 448 and loading refuses NaN), exactly, then * 2**8.
        b = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.int32)
        bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        scale = _fp16_bits_to_fp32(bits) * 256.0
        return scale, scale
    else:
        scale = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if FORMAT == _INT4_ASYM or FORMAT == _INT4_FZERO:  # noqa: SIM109 (constexprs)
            zero = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            zero = tl.full(scale.shape, 8.0, tl.float32)
        return scale, zero


@triton.jit
def _dequantize(v, scale, zero, FORMAT: tl.constexpr):
    """Decoded values (`_decode`) [rows, G, n] and their groups' (scale, zero) [rows, G, 1] ->
    weights in fp32, exactly the reference's: int4 (16 v - 16 - z) * s = (u - z) * s (the FMA
    gives the exact integer u - z), e2m1 (v * 2**14) * s. NVFP4's global scale is left out."""
    if FORMAT >= _MXFP4:
        return (v * 16384.0) * scale
    elif FORMAT == _INT4_FZERO:  # one rounding, as the reference (an exact value, then fp32)
        return tl.fma(v * 16.0 - 24.0, scale, zero)
    else:
        return (v * 16.0 - (zero + 16.0)) * scale


@triton.jit
def _group_terms(vx_sum, x_sum, scale, zero, FORMAT: tl.constexpr):
    """An int4 group's share of the GEMV sum from sum v x and sum x (v = 1 + u/16):
    sum (u - z) s x = s (16 sum v x - (16 + z) sum x); with a float zero point,
    sum ((u - 8) s + zero) x = s (16 sum v x - 24 sum x) + zero sum x."""
    if FORMAT == _INT4_FZERO:
        return (vx_sum * 16.0 - 24.0 * x_sum) * scale + zero * x_sum
    else:
        return (vx_sum * 16.0 - (zero + 16.0) * x_sum) * scale


@triton.jit
def _step_codes(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn, stride_sn,
                FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr):  # fmt: skip
    """The loads of the K step at k0: code bytes [rows, BLOCK_K / 2] (KH per row) and each
    group's (scale, zero) [rows, G]. Issued one or two steps ahead of their use (Triton
    pipelines only loads that feed a dot, and these feed the decoding); a step at k0 >= K loads
    nothing.
    EVEN_K (K a multiple of BLOCK_K): no mask along K, so the loads stay 16 bytes wide."""
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # values of one group in a step
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    n_ok = offs_n < N * (k0 < K)  # (no rows at all past K)
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + byte[None, :]
    if EVEN_K:
        packed = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
    else:
        packed = tl.load(q_ptrs, mask=n_ok[:, None] & (byte < KH)[None, :], other=0)
    group = (k0 + tl.arange(0, BLOCK_K // GK) * GK) // GROUP
    g_ok = n_ok[:, None] & (group < tl.cdiv(K, GROUP))[None, :]
    scale, zero = _group_scale(s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :],
                               g_ok, FORMAT)  # fmt: skip
    return packed, scale, zero


@triton.jit
def _step_weights(packed, scale, zero, global_scale, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_K: tl.constexpr):  # fmt: skip
    """One step's weights [rows, BLOCK_K] in fp32, each exactly the reference's fp32 value."""
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    ROWS: tl.constexpr = packed.shape[0]
    v = tl.reshape(_decode(packed, FORMAT), (ROWS, BLOCK_K // GK, GK))
    w = _dequantize(v, scale[:, :, None], zero[:, :, None], FORMAT)
    return tl.reshape(w, (ROWS, BLOCK_K)) * global_scale


@triton.jit
def _step_words(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, stride_qw, stride_sn,
                FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """`_step_codes` with K a multiple of the step: the codes as 32-bit words [rows, BLOCK_K / 8]
    (q_ptr an int32 view; code 8w + j in bits 4j..4j+3 of word w) and each group's (scale,
    zero) [rows, G]."""
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    n_ok = offs_n < N * (k0 < K)  # (no rows at all past K)
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(q_ptr + offs_n[:, None] * stride_qw + word[None, :], mask=n_ok[:, None],
                    other=0)  # fmt: skip
    group = (k0 + tl.arange(0, BLOCK_K // GK) * GK) // GROUP
    scale, zero = _group_scale(s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :],
                               n_ok[:, None], FORMAT)  # fmt: skip
    return words, scale, zero


@triton.jit
def _word_pair_weights(words, j: tl.constexpr, per_word, zero_word, global_scale,
                       FORMAT: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """Nibbles j and j + 4 of every word as weights [rows, words, 2] in `dtype`, each the
    reference's fp32 value rounded once. int4: `_dequantize` of `_int4_nibble`. e2m1: both
    nibbles decoded at once (`_word_pair`), then two exact products and one rounded: MXFP4
    (value) * scale, the value being the decoded value * 2**-14 times 2**14 (a huge e8m0 scale
    times 2**14 could overflow); NVFP4 value * (2**14 scale) (at most 448 * 2**14: exact) *
    global."""
    if FORMAT < _MXFP4:
        low = _dequantize(_int4_nibble(words, j), per_word, zero_word, FORMAT).to(dtype)
        high = _dequantize(_int4_nibble(words, j + 4), per_word, zero_word, FORMAT).to(dtype)
        return tl.join(low, high)
    low, high = _halves_to_fp32(_word_pair(words, j))
    if FORMAT == _NVFP4:
        low = ((low * per_word) * global_scale).to(dtype)
        high = ((high * per_word) * global_scale).to(dtype)
    else:
        low = ((low * 16384.0) * per_word).to(dtype)
        high = ((high * 16384.0) * per_word).to(dtype)
    return tl.join(low, high)


@triton.jit
def _per_word(group_values, BLOCK_K: tl.constexpr, GK: tl.constexpr):
    """[rows, G] per group -> [rows, BLOCK_K / 8] per word (GK values of a group in a step)."""
    ROWS: tl.constexpr = group_values.shape[0]
    return tl.reshape(tl.broadcast_to(group_values[:, :, None], (ROWS, BLOCK_K // GK, GK // 8)),
                      (ROWS, BLOCK_K // 8))  # fmt: skip


@triton.jit
def _word_weights(words, scale, zero, global_scale, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                  BLOCK_K: tl.constexpr, dtype: tl.constexpr):  # fmt: skip
    """One step's weights [rows, BLOCK_K] in `dtype`, in K order, from its words
    (`_step_words`): each word's nibbles decoded in place (`_word_pair_weights`), scaled in fp32
    (exactly the reference's fp32 value, as `_step_weights`) and rounded once; the eight
    [rows, words] planes joined so that plane j lands at 8w + j. No byte is unpacked: a byte
    tensor carried from one step to the next costs a byte permute per code (SASS for sm_90)."""
    ROWS: tl.constexpr = words.shape[0]
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    if FORMAT == _NVFP4:
        scale = scale * 16384.0
    per_word = _per_word(scale, BLOCK_K, GK)
    zero_word = _per_word(zero, BLOCK_K, GK) if FORMAT < _MXFP4 else per_word
    # tl.join adds a minor dimension, so the joins' leaves go in bit-reversed order of the
    # position in the word: the pair (j, j + 4) is one innermost join.
    w = tl.join(
        tl.join(_word_pair_weights(words, 0, per_word, zero_word, global_scale, FORMAT, dtype),
                _word_pair_weights(words, 2, per_word, zero_word, global_scale, FORMAT, dtype)),
        tl.join(_word_pair_weights(words, 1, per_word, zero_word, global_scale, FORMAT, dtype),
                _word_pair_weights(words, 3, per_word, zero_word, global_scale, FORMAT, dtype)),
    )  # fmt: skip
    return tl.reshape(w, (ROWS, BLOCK_K))


@triton.jit
def _small_m_step(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn, stride_sn,
                  FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr):  # fmt: skip
    """The small-M kernel's loads of one step (N: the rows to load, 0 for none): the codes as
    words when K is a multiple of the step (`_step_words`, decoded by `_word_weights`), else as
    bytes (`_step_codes`)."""
    if EVEN_K:
        return _step_words(q_ptr.to(tl.pointer_type(tl.int32)), s_ptr, z_ptr, offs_n, k0, N, K,
                           stride_qn // 4, stride_sn, FORMAT, GROUP, BLOCK_K)  # fmt: skip
    else:
        return _step_codes(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn, stride_sn,
                           FORMAT, GROUP, BLOCK_K, False)  # fmt: skip


@triton.jit
def _global_scale(g_ptr, FORMAT: tl.constexpr):
    if FORMAT == _NVFP4:
        return tl.load(g_ptr).to(tl.float32)
    else:
        return 1.0


# ---- kernels -----------------------------------------------------------------------------------


@triton.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr,
    M, N, K, KH, stride_xm, stride_qn, stride_sn, stride_om,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, n-band] for one token m, streaming the band's codes BLOCK_K values at a time.

    Each group's scale is applied to the group's sum, not to each weight (as the FP8 GEMV
    does), so a weight costs its decoding (`_decode`: a shift and a mask or two) and one FMA:
    int4 sum (u - z) s x = s * (16 * sum v x - (16 + z) * sum x) with v = 1 + u/16;
    e2m1 sum v' s x * 2**14 with v' = value * 2**-14."""
    pid = tl.program_id(0)
    m = pid % M  # the programs of one weight band run together and share it through L2
    offs_n = (pid // M) * BLOCK_N + tl.arange(0, BLOCK_N)
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K  # values of one group in a step
    G: tl.constexpr = BLOCK_K // GK
    x_ptr += m * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    packed, scale, zero = _step_codes(q_ptr, s_ptr, z_ptr, offs_n, 0, N, K, KH, stride_qn,
                                      stride_sn, FORMAT, GROUP, BLOCK_K, EVEN_K)  # fmt: skip
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    for k0 in range(0, K, BLOCK_K):
        next_packed, next_scale, next_zero = _step_codes(
            q_ptr, s_ptr, z_ptr, offs_n, k0 + BLOCK_K, N, K, KH, stride_qn, stride_sn,
            FORMAT, GROUP, BLOCK_K, EVEN_K,
        )  # fmt: skip
        next_x = tl.load(x_ptr + k0 + BLOCK_K + offs_k, mask=k0 + BLOCK_K + offs_k < K, other=0.0)
        xf = x.to(tl.float32)
        products = _decode(packed, FORMAT) * xf[None, :]
        partial = tl.sum(tl.reshape(products, (BLOCK_N, G, GK)), axis=2)  # [BLOCK_N, G]
        if FORMAT >= _MXFP4:
            acc += tl.sum(partial * scale, axis=1)
        else:
            x_sum = tl.sum(tl.reshape(xf, (G, GK)), axis=1)[None, :]
            acc += tl.sum(_group_terms(partial, x_sum, scale, zero, FORMAT), axis=1)
        packed, scale, zero, x = next_packed, next_scale, next_zero, next_x
    total = acc * _global_scale(g_ptr, FORMAT)
    if FORMAT >= _MXFP4:
        total = total * 16384.0  # the decoded e2m1 values are value * 2**-14
    n_ok = offs_n < N
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _word_pair(words, j: tl.constexpr):
    """Nibbles j and j + 4 (j < 4) of every 32-bit word as the two 16-bit halves of one int32,
    each placed in fp16 bits as `_decode` places an e2m1 code (value * 2**-14): magnitude bits
    4j..4j+2 to 9..11, sign bit 4j+3 to 15. Both halves at once: one shift and one mask for the
    magnitudes, one shift and one and-or for the signs."""
    if 9 - 4 * j >= 0:  # noqa: SIM108 (a constexpr branch: one shift direction each)
        magnitude = (words << (9 - 4 * j)) & 0x0E000E00
    else:
        magnitude = (words >> (4 * j - 9)) & 0x0E000E00
    return magnitude | ((words << (12 - 4 * j)) & -0x7FFF8000)  # 0x80008000 as an int32


@triton.jit
def _halves_to_fp32(pair):
    """The low and high 16 bits of an int32 tensor read as fp16, exactly, in fp32. Compiled,
    by PTX on each register: Triton's own conversion packs the halves of two registers
    together first (a PRMT per value; docs/kernels/w4a16.md, "Formats and decoding"). The
    interpreter, which runs no PTX, converts with Triton's casts (the same values)."""
    if _INTERPRETED:
        return _fp16_bits_to_fp32(pair), _fp16_bits_to_fp32(pair >> 16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=r,=r,r", [pair], dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
        )  # fmt: skip


@triton.jit
def _int4_exact(words, J: tl.constexpr):
    """Nibble J of every word as the exact float u - 8, u the code: the nibble and-ed in place
    under an exponent that makes its lowest bit worth 1 (the float 2**(23 - p) + u, p its bit
    position), then 2**(23 - p) + 8 subtracted. Nibbles 5..7 (bits 20..31 reach fp32's
    exponent) are taken from the word shifted right by 12 (one shift per word). One and-or
    with both constants (a single LOP3, by PTX: Triton's own `&` then `|` compiles to two) and
    one subtraction, where `_int4_nibble` (1 + u/16) takes a shift and two LOP3s."""
    if J >= 5:
        src = words >> 12
        POS: tl.constexpr = 4 * J - 12
    else:
        src = words
        POS: tl.constexpr = 4 * J
    MAGIC: tl.constexpr = (150 - POS) << 23  # the exponent of 2**(23 - POS)
    MASK: tl.constexpr = 15 << POS
    if _INTERPRETED:
        bits = (src & MASK) | MAGIC
    else:
        bits = tl.inline_asm_elementwise(f"lop3.b32 $0, $1, {MASK}, {MAGIC}, 0xEA;", "=r,r",
                                         [src], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    magic = tl.full((), MAGIC, tl.int32).to(tl.float32, bitcast=True)
    return bits.to(tl.float32, bitcast=True) - (magic + 8.0)


@triton.jit
def _x_pair(x_ptr, pair):
    """x's 32-bit pairs `pair` (columns 2 pair and 2 pair + 1) as two fp32 tensors: 16-bit
    activations by one 32-bit load each (x 4-byte aligned, which the launcher ensures), widened
    in registers: bf16 by a shift and a mask (a bf16 is the top half of its fp32), fp16 by
    `_halves_to_fp32`."""
    if x_ptr.dtype.element_ty == tl.float32:
        return tl.load(x_ptr + 2 * pair), tl.load(x_ptr + 2 * pair + 1)
    p = tl.load(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + pair)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)
    return _halves_to_fp32(p)


@triton.jit
def _x_planes(x_ptr, w0, BLOCK_W: tl.constexpr, NATIVE: tl.constexpr = False):
    """The activations of the step's words w0 .. w0 + BLOCK_W - 1 (w0 a multiple of 16) as
    eight fp32 planes [BLOCK_W] (plane j: x[8w + j]), four pairs (`_x_pair`) per word: pairs
    4w .. 4w + 3 holding planes (0, 1) .. (6, 7).
    NATIVE (codes in `packing.native_codes`' order): nibbles j and j + 4 of word w are x's
    columns c and c + 1, c = 128 (w // 16) + 32 (w % 4) + 2 (w % 16 // 4) + 8 j, so the pairs
    c / 2 + 4 j hold planes (j, j + 4). Both start at pair 4 w0 plus an offset of the word's
    place in the step, which the compiler keeps out of the loop."""
    w = tl.arange(0, BLOCK_W)
    if NATIVE:
        first = 4 * w0 + 64 * (w // 16) + 16 * (w % 4) + w % 16 // 4
        STEP: tl.constexpr = 4
    else:
        first = 4 * w0 + 4 * w
        STEP: tl.constexpr = 1
    a0, b0 = _x_pair(x_ptr, first)
    a1, b1 = _x_pair(x_ptr, first + STEP)
    a2, b2 = _x_pair(x_ptr, first + 2 * STEP)
    a3, b3 = _x_pair(x_ptr, first + 3 * STEP)
    if NATIVE:
        return a0, a1, a2, a3, b0, b1, b2, b3
    return a0, b0, a1, b1, a2, b2, a3, b3


@triton.jit
def _x_token(x_ptr, m0, t: tl.constexpr, M, stride_xm):
    """x's row for the program's token t: the last token's where m0 + t is past M (a tile's
    padding: loaded, never stored), so that no load needs a mask."""
    return x_ptr + tl.minimum(m0 + t, M - 1) * stride_xm


@triton.jit
def _fma_plane(products, weights, xs, j: tl.constexpr, FIRST: tl.constexpr):
    """Each token's products + weights * its plane j (one FFMA per weight and token)."""
    new = ()
    for t in tl.static_range(len(xs)):
        if FIRST:
            new = new + (weights * xs[t][j][None, :],)
        else:
            new = new + (products[t] + weights * xs[t][j][None, :],)
    return new


@triton.jit
def _word_products(words, xs, FORMAT: tl.constexpr):
    """Per token, the step's products [rows, BLOCK_W] summed over each word's 8 codes: every
    plane of codes decoded once and multiplied by each token's plane (xs[t], `_x_planes`)."""
    if FORMAT >= _MXFP4:  # planes (j, j + 4) decoded together, summed in the order 0 4 1 5 ..
        low, high = _halves_to_fp32(_word_pair(words, 0))
        products = _fma_plane((), low, xs, 0, True)
        products = _fma_plane(products, high, xs, 4, False)
        for j in tl.static_range(1, 4):
            low, high = _halves_to_fp32(_word_pair(words, j))
            products = _fma_plane(products, low, xs, j, False)
            products = _fma_plane(products, high, xs, j + 4, False)
        return products
    products = _fma_plane((), _int4_exact(words, 0), xs, 0, True)
    for j in tl.static_range(1, 8):
        products = _fma_plane(products, _int4_exact(words, j), xs, j, False)
    return products


@triton.jit
def _group_share(acc, products, x, scale, zero, FORMAT: tl.constexpr, G: tl.constexpr,
                 WG: tl.constexpr):  # fmt: skip
    """One token's acc [rows, G] + the step's share of each (row, group), from its products
    (`_word_products`) and its planes x. int4: s * (sum (u - 8) x - (z - 8) sum x) (a float
    zero point: s * sum (u - 8) x + zero * sum x; symmetric: no sum x); e2m1: s * sum v x, v
    the value * 2**-14 (`_word_pair`)."""
    ROWS: tl.constexpr = products.shape[0]
    group_sum = tl.sum(tl.reshape(products, (ROWS, G, WG)), axis=2)
    if FORMAT >= _MXFP4 or FORMAT == _INT4_SYM:
        return acc + group_sum * scale
    x_word = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))
    x_sum = tl.sum(tl.reshape(x_word, (G, WG)), axis=1)[None, :]
    if FORMAT == _INT4_FZERO:
        return acc + group_sum * scale + zero * x_sum
    return acc + (group_sum - (zero - 8.0) * x_sum) * scale


@triton.jit
def _gemv_words_step(accs, words, x_ptr, m0, M, stride_xm, s_ptr, z_ptr, offs_n, n_ok, w0,
                     stride_sn, FORMAT: tl.constexpr, GROUP: tl.constexpr,
                     BLOCK_W: tl.constexpr, NATIVE: tl.constexpr):  # fmt: skip
    """accs (per token of the program: [rows, G]) + this step's share of each (row, group):
    the step's words [rows, BLOCK_W] from word w0, decoded once for all the tokens, their
    activations and their groups' scales."""
    WG: tl.constexpr = GROUP // 8 if GROUP // 8 < BLOCK_W else BLOCK_W  # words per group
    G: tl.constexpr = BLOCK_W // WG
    xs = ()
    for t in tl.static_range(len(accs)):
        xs = xs + (_x_planes(_x_token(x_ptr, m0, t, M, stride_xm), w0, BLOCK_W, NATIVE),)
    group = (w0 + tl.arange(0, G) * WG) // (GROUP // 8)
    scale, zero = _group_scale(s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :],
                               n_ok[:, None], FORMAT)  # fmt: skip
    products = _word_products(words, xs, FORMAT)
    new = ()
    for t in tl.static_range(len(accs)):
        new = new + (_group_share(accs[t], products[t], xs[t], scale, zero, FORMAT, G, WG),)
    return new


@triton.jit
def _gemv_words_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, partials_ptr, arrived_ptr,
    M, N, KW, steps_per_split, stride_xm, stride_qw, stride_sn, stride_om,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr, EVICT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    NATIVE: tl.constexpr = False, BLOCK_M: tl.constexpr = 1,
):  # fmt: skip
    """The GEMV on 32-bit words (8 codes each; K a multiple of 8 * BLOCK_W): the codes are
    never split into bytes or put back in K order. Nibble j of every word in the tile is decoded
    in place and multiplies the activations x[8w + j] (`_x_planes`, shared by the tile's rows)
    of each of the program's BLOCK_M tokens (the decode shared by them: a few tokens cost one
    FFMA per weight and token more, not a decode each); each (row, group) keeps its own scaled
    sum across the steps, summed over the groups once at the end. int4 (`_int4_exact`): one
    LOP3 and one subtraction per code, the exact u - 8; e2m1 (`_word_pair`): nibbles j and
    j + 4 placed as the fp16 halves of one register by two shifts and two masks, each half read
    as fp32 by one conversion.
    Grid (row bands x token tiles, splits of K): with SPLIT, each program takes steps_per_split
    steps and the last of a band's splits to finish sums their partial sums (`finish_tile`), so
    that a layer with few rows (o, down) still fills the GPU. The codes are loaded PREFETCH (1
    or 2) steps ahead of their use; EVICT loads them evict-first (each is read once)."""
    pid = tl.program_id(0)
    token_tiles = tl.cdiv(M, BLOCK_M)
    m0 = (pid % token_tiles) * BLOCK_M  # a band's programs run together, sharing it through L2
    offs_n = (pid // token_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    WG: tl.constexpr = GROUP // 8 if GROUP // 8 < BLOCK_W else BLOCK_W  # words per group
    G: tl.constexpr = BLOCK_W // WG  # groups per step
    POLICY: tl.constexpr = "evict_first" if EVICT else ""
    first_step = tl.program_id(1) * steps_per_split
    w_end = tl.minimum(first_step + steps_per_split, KW // BLOCK_W) * BLOCK_W
    q_ptrs = q_ptr + offs_n[:, None] * stride_qw + tl.arange(0, BLOCK_W)[None, :]
    accs = ()
    for _ in tl.static_range(BLOCK_M):
        accs = accs + (tl.zeros((BLOCK_N, G), dtype=tl.float32),)
    w0 = first_step * BLOCK_W
    # (`N * (w < w_end)` rows: nothing is loaded past this program's last step)
    words = tl.load(q_ptrs + w0, mask=(offs_n < N * (w0 < w_end))[:, None], other=0,
                    eviction_policy=POLICY)  # fmt: skip
    if PREFETCH == 2:
        w1 = w0 + BLOCK_W
        words1 = tl.load(q_ptrs + w1, mask=(offs_n < N * (w1 < w_end))[:, None], other=0,
                         eviction_policy=POLICY)  # fmt: skip
    for w0 in range(first_step * BLOCK_W, w_end, BLOCK_W):
        if PREFETCH == 2:
            w2 = w0 + 2 * BLOCK_W
            words2 = tl.load(q_ptrs + w2, mask=(offs_n < N * (w2 < w_end))[:, None], other=0,
                             eviction_policy=POLICY)  # fmt: skip
        else:
            w1 = w0 + BLOCK_W
            words1 = tl.load(q_ptrs + w1, mask=(offs_n < N * (w1 < w_end))[:, None], other=0,
                             eviction_policy=POLICY)  # fmt: skip
        accs = _gemv_words_step(accs, words, x_ptr, m0, M, stride_xm, s_ptr, z_ptr, offs_n,
                                n_ok, w0, stride_sn, FORMAT, GROUP, BLOCK_W, NATIVE)  # fmt: skip
        words = words1
        if PREFETCH == 2:
            words1 = words2
    token = tl.arange(0, BLOCK_M)
    tile = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in tl.static_range(BLOCK_M):
        tile = tl.where(token[None, :] == t, tl.sum(accs[t], axis=1)[:, None], tile)
    if FORMAT >= _MXFP4:  # the decoded e2m1 values are value * 2**-14
        tile = tile * (_global_scale(g_ptr, FORMAT) * 16384.0)
    offs_m = m0 + token
    finish_tile(tile, partials_ptr, arrived_ptr, bias_ptr, out_ptr, offs_n, offs_m, n_ok,
                offs_m < M, M, N, stride_om, HAS_BIAS, SPLIT)  # fmt: skip


@triton.jit
def _small_m_mma(acc, codes, scale, zero, x, global_scale, FORMAT: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 X_FP32: tl.constexpr):  # fmt: skip
    """acc + one step's weights (rounded to the activation dtype, as the reference) @ x."""
    if EVEN_K:
        w = _word_weights(codes, scale, zero, global_scale, FORMAT, GROUP, BLOCK_K, x.dtype)
    else:
        w = _step_weights(codes, scale, zero, global_scale, FORMAT, GROUP, BLOCK_K).to(x.dtype)
    if X_FP32:  # fp32 activations: a true fp32 product, not TF32
        return tl.dot(w, x, acc, input_precision="ieee")
    return tl.dot(w, x, acc)


@triton.jit
def _small_m_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, g_ptr, bias_ptr, out_ptr, partials_ptr, arrived_ptr,
    M, N, K, KH, steps_per_split, stride_xm, stride_qn, stride_sn, stride_om,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    X_FP32: tl.constexpr, SPLIT: tl.constexpr, PREFETCH: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out.T[n-tile, m-tile] = W[n-tile] @ x[m-tile].T over this program's K steps.

    The codes and scales are loaded PREFETCH (1 or 2, a tuned choice) steps ahead of their
    decoding. The compiler places a load whose value the next iteration uses at the end of the
    loop body, next to the MMA (SASS for sm_90), so one step ahead leaves the loads only the MMA's
    time; two steps ahead costs registers and moves. Neither wins everywhere (measured:
    docs/kernels/w4a16.md, "The small-M tensor-core kernel"). With 1 the activations are loaded
    by hand a step ahead too; with 2 at the top of their step (hidden behind the decoding). A
    load past this program's last step loads nothing with 2, and the next split's first step
    (not used) with 1."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_step = tl.program_id(1) * steps_per_split
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    last_step = tl.minimum(first_step + steps_per_split, tl.cdiv(K, BLOCK_K))
    global_scale = _global_scale(g_ptr, FORMAT)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # x.T: [BLOCK_K, BLOCK_M]
    m_ok = (offs_m < M)[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k0 = first_step * BLOCK_K
    codes, scale, zero = _small_m_step(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn,
                                       stride_sn, FORMAT, GROUP, BLOCK_K, EVEN_K)  # fmt: skip
    if PREFETCH == 2:
        k_end = last_step * BLOCK_K  # (`N * (k < k_end)` rows: none past the last step)
        k1 = k0 + BLOCK_K
        codes1, scale1, zero1 = _small_m_step(q_ptr, s_ptr, z_ptr, offs_n, k1, N * (k1 < k_end),
                                              K, KH, stride_qn, stride_sn, FORMAT, GROUP,
                                              BLOCK_K, EVEN_K)  # fmt: skip
        for step in range(first_step, last_step):
            k2 = (step + 2) * BLOCK_K
            codes2, scale2, zero2 = _small_m_step(
                q_ptr, s_ptr, z_ptr, offs_n, k2, N * (k2 < k_end), K, KH, stride_qn, stride_sn,
                FORMAT, GROUP, BLOCK_K, EVEN_K,
            )  # fmt: skip
            k0 = step * BLOCK_K
            x = tl.load(x_ptrs + k0, mask=m_ok & (k0 + offs_k < K)[:, None], other=0.0)
            acc = _small_m_mma(acc, codes, scale, zero, x, global_scale, FORMAT, GROUP, BLOCK_K,
                               EVEN_K, X_FP32)  # fmt: skip
            codes, scale, zero = codes1, scale1, zero1
            codes1, scale1, zero1 = codes2, scale2, zero2
    else:
        x = tl.load(x_ptrs + k0, mask=m_ok & (k0 + offs_k < K)[:, None], other=0.0)
        for step in range(first_step, last_step):
            k1 = (step + 1) * BLOCK_K
            next_codes, next_scale, next_zero = _small_m_step(
                q_ptr, s_ptr, z_ptr, offs_n, k1, N, K, KH, stride_qn, stride_sn, FORMAT, GROUP,
                BLOCK_K, EVEN_K,
            )  # fmt: skip
            next_x = tl.load(x_ptrs + k1, mask=m_ok & (k1 + offs_k < K)[:, None], other=0.0)
            acc = _small_m_mma(acc, codes, scale, zero, x, global_scale, FORMAT, GROUP, BLOCK_K,
                               EVEN_K, X_FP32)  # fmt: skip
            codes, scale, zero, x = next_codes, next_scale, next_zero, next_x
    finish_tile(acc, partials_ptr, arrived_ptr, bias_ptr, out_ptr, offs_n, offs_m, offs_n < N,
                offs_m < M, M, N, stride_om, HAS_BIAS, SPLIT)  # fmt: skip


@triton.jit
def _native_bytes(q_ptr, offs_n, k0, n_ok, stride_qn):
    """The codes of the 128-column chunk at k0, stored in `packing.native_codes`' order, as the
    canonical bytes [rows, 64] (byte j: columns 2j and 2j + 1). Native position
    d = 32 w_hi + 8 w_lo + 4 n_hi + n_lo (word w = 4 w_hi + w_lo, nibble n = 4 n_hi + n_lo)
    holds column c = 32 w_lo + 8 n_lo + 2 w_hi + n_hi (`packing.native_codes`), so the chunk's
    nibbles, loaded as they lie (64 contiguous bytes a row: whole 16-byte loads), reach the
    canonical order by one reshape and permute of their index digits. (Gathering each byte twice
    at its permuted offset instead made dequantize + cuBLAS at 2048 tokens take 2110 us for the
    Llama layer against 1491 us on canonical codes, H100.)"""
    rows = q_ptr + offs_n[:, None] * stride_qn + k0 // 2
    raw = tl.load(rows + tl.arange(0, 64)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
    ROWS: tl.constexpr = raw.shape[0]
    nibbles = tl.reshape(tl.join(raw & 0xF, raw >> 4), (ROWS, 4, 4, 2, 4))  # [w_hi, w_lo, n]
    nibbles = tl.permute(nibbles, (0, 2, 4, 1, 3))  # [w_lo, n_lo, w_hi, n_hi]: column order
    low, high = tl.split(tl.reshape(nibbles, (ROWS, 64, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, z_ptr, g_ptr, w_ptr, N, K, KH, stride_qn, stride_sn, stride_wn,
    FORMAT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NATIVE: tl.constexpr = False,
):  # fmt: skip
    """W [N, K] in w's dtype, each value rounded once from fp32 (bit-exact vs the reference).
    NATIVE: the codes in `packing.native_codes`' order (BLOCK_K is its 128-column chunk)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    packed, scale, zero = _step_codes(q_ptr, s_ptr, z_ptr, offs_n, k0, N, K, KH, stride_qn,
                                      stride_sn, FORMAT, GROUP, BLOCK_K, False)  # fmt: skip
    if NATIVE:
        packed = _native_bytes(q_ptr, offs_n, k0, offs_n < N, stride_qn)
    w = _step_weights(packed, scale, zero, _global_scale(g_ptr, FORMAT), FORMAT, GROUP, BLOCK_K)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    rows = offs_n.to(tl.int64)[:, None] * stride_wn  # N * K may pass 2**31 (a large lm_head)
    tl.store(w_ptr + rows + offs_k[None, :],
             w.to(w_ptr.dtype.element_ty), mask=mask)  # fmt: skip


# ---- configs and launchers ---------------------------------------------------------------------


def gemv_words_config(fmt: Format, n: int, k: int, sms: int) -> dict:
    """The word GEMV's config for an N x K weight on a GPU of `sms` SMs: 128 words (1024 K) per
    step on 4 warps, the codes loaded evict-first; 16 rows when there are at least 2.5 bands of
    16 rows per SM (Llama-3.1-8B's qkv and gate_up on an H100), else 8 (o, down: 16-row bands
    would leave half the SMs idle); int4 with 8 rows and a long K (>= 8192, a multiple of 2048:
    down) takes 256 words per step. NVFP4 always 8 x 128. On the H100 sweep each choice was
    its shape's fastest or within 3 % of it (6 % for MXFP4's down; docs/kernels/w4a16.md, "The
    one-token word GEMV")."""
    rows = 16 if fmt != Format.NVFP4 and triton.cdiv(n, 16) >= 2.5 * sms else 8
    long_k = fmt < Format.MXFP4 and rows == 8 and k >= 8192 and k % 2048 == 0
    return {"KERNEL": "gemv_words", "BLOCK_N": rows, "BLOCK_W": 256 if long_k else 128,
            "num_warps": 4, "EVICT": 1}  # fmt: skip


def gemv_config(fmt: Format) -> dict:
    """1024 K (a 512-byte strip per row) per step; 16 rows (8 for NVFP4, whose 16-groups load
    twice the scales). The best of the H200 sweep (docs/kernels/w4a16.md): 77 / 90 / 101 us
    for the Llama-3.1-8B layer in int4 g128 / MXFP4 / NVFP4 at M = 1."""
    rows = 8 if fmt == Format.NVFP4 else 16
    return {"BLOCK_N": rows, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1}


def small_m_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """64 weight rows x the tokens (16..128) x 128 K per step, K split so that ~4 programs run
    per SM up to 64 tokens (~2 above): the best of the H200 sweep at M = 16 and 128. The codes
    are loaded two steps ahead for 128-token tiles: with PREFETCH 2 this config took 11-19 %
    less time than with 1 on the H100 on each shape where both were timed (o and down at
    M = 128, every format; docs/kernels/w4a16.md, "The small-M tensor-core kernel"); at 16-64
    tokens neither depth wins everywhere."""
    block_n, block_m, block_k = 64, min(128, max(16, triton.next_power_of_2(m))), 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    waves = 4 if m <= 64 else 2
    split = split_count(tiles, triton.cdiv(k, block_k), MIN_STEPS_PER_SPLIT, waves, device)
    return {"BLOCK_N": block_n, "BLOCK_M": block_m, "BLOCK_K": block_k, "SPLIT_K": split,
            "PREFETCH": 2 if block_m == 128 else 1, "num_warps": 4, "num_stages": 3}  # fmt: skip


DEQUANTIZE = {"KERNEL": "dequantize"}  # a config that forces dequantize + cuBLAS


def default_config(fmt: Format, m: int, n: int, k: int, device: torch.device) -> dict:
    """The built-in config for M tokens (no tuning needed): the kernel `kernel_for` picks by M
    and its config."""
    kernel = kernel_for(m, None)
    if kernel == "gemv":
        sms = 4 if device.type == "cpu" else _sm_count(device.index or 0)  # (as split_count)
        words = gemv_words_config(fmt, n, k, sms)  # K a multiple of a step: whole words
        return words if k % (8 * words["BLOCK_W"]) == 0 else gemv_config(fmt)
    return small_m_config(m, n, k, device) if kernel == "small_m" else DEQUANTIZE


def tuned_format(fmt: Format, group: int) -> str:
    """The format part of a tuned config's key: "int4_asym_g128", "mxfp4_g32", ... A float zero
    point moves the same bytes as an integer one and takes its configs."""
    fmt = Format.INT4_ASYM if fmt == Format.INT4_FZERO else fmt
    return f"{fmt.name.lower()}_g{group}"


def kernel_for(m: int, config: dict | None) -> str:
    """Which kernel runs M tokens: "gemv", "small_m" or "dequantize" (+ cuBLAS); a config
    names its kernel by its keys (SPLIT_K: small-M, KERNEL: dequantize, register, register_ws,
    register_wgmma or gemv_words, else a GEMV config)."""
    if config is not None:
        if "KERNEL" in config:
            return config["KERNEL"]
        return "small_m" if "SPLIT_K" in config else "gemv"
    if m <= GEMV_MAX_M:
        return "gemv"
    return "small_m" if m <= FUSED_MAX_M else "dequantize"


# Two tokens on a small weight: the word GEMV with both tokens in each program (the codes
# decoded once for both) beat the kernels the op ran there, measured on the H100 on the
# Llama-3.1-8B linears (bench/README.md, "int4 on an H100, with tinygemm, gemlite and Marlin";
# docs/kernels/w4a16.md, "Two tokens: the pair GEMV"): int4 (native codes) on o (N x K = 17M;
# not on qkv, 25M), MXFP4 and NVFP4 (canonical) on qkv and o. On larger weights, and from 3
# tokens, the decode's cost per token makes it the slower.
PAIR_GEMV_MAX_WEIGHTS = {"int4": 20_000_000, "fp4": 30_000_000}


def pair_gemv_choice(fmt: Format, m: int, n: int, k: int, native: bool) -> dict | None:
    """The word GEMV's config for M = 2 where it is the faster (above), else None: 16 rows,
    both tokens per program, 128 words per step (K a multiple of 1024)."""
    family = "fp4" if fmt >= Format.MXFP4 else "int4"
    if m != 2 or n * k > PAIR_GEMV_MAX_WEIGHTS[family] or k % 1024:
        return None
    if family == "int4" and not native:  # measured on the native codes only
        return None
    return {"KERNEL": "gemv_words", "BLOCK_N": 16, "BLOCK_W": 128, "BLOCK_M": 2,
            "num_warps": 4, "EVICT": 1, "NATIVE": int(native)}  # fmt: skip


def register_choice(fmt: Format, x, qdata, group: int) -> dict | None:
    """The config of a register kernel where one runs this matmul and is the faster kernel for
    its token count on this GPU (the wgmma one, w4a16_gluon_wgmma.py, where `wgmma_chosen`;
    else the warp-specialized one, w4a16_gluon_ws.py, at WS_CHOICE_MIN_M..WS_CHOICE_MAX_M
    tokens; else w4a16_gluon.py's up to REGISTER_CHOICE_MAX_M), else None (the Triton kernels
    run)."""
    m, k = x.shape
    n = qdata.shape[0]
    if wgmma_chosen(fmt, m, n, k) and wgmma_problem(int(fmt), x, qdata, group) is None:
        return {"KERNEL": "register_wgmma", **wgmma_config(m, n, k, x.device)}
    if WS_CHOICE_MIN_M <= m <= WS_CHOICE_MAX_M and ws_problem(int(fmt), x, qdata, group) is None:
        return {"KERNEL": "register_ws", **ws_config(m, n, k, x.device, int(fmt))}
    if m > REGISTER_CHOICE_MAX_M or register_problem(int(fmt), x, qdata, group) is not None:
        return None
    return {"KERNEL": "register", **register_config(m, qdata.shape[0], k, x.device)}


def native_gemv_step(k: int) -> int:
    """Code words per step of the one-token word GEMV on native codes: 256 on a long K (down's,
    the fastest in the H100 sweep of the native read), else 128, halved until a step divides K
    (K % 128 == 0: a step of 16 words always does)."""
    block_w = 256 if k >= 8192 and k % 2048 == 0 else 128
    while k % (8 * block_w):
        block_w //= 2
    return block_w


def native_choice(fmt: Format, x, qdata, group: int) -> dict:
    """The kernel for int4 codes in `packing.native_codes`' order (what an int4 weight holds on
    Hopper, layouts/int4.py): the word GEMV at one token (its step the largest power of two of
    words up to 128 or 256 that divides K) and at two on a small weight (`pair_gemv_choice`),
    the wgmma kernel up to 128 tokens where it runs (its sums scaled per chunk up to 32 tokens:
    `promote_config`), else dequantize (un-permuting the codes) + cuBLAS. Measured on the
    H100: bench/README.md, "int4 on an H100, with tinygemm, gemlite and Marlin"."""
    m, k = x.shape
    n = qdata.shape[0]
    if m <= GEMV_MAX_M:
        # 16 rows on every Llama-3.1-8B linear (o and down too, where the canonical codes take
        # 8): the fastest of the H100 sweep of the native read (bench/bench_gemv.py --native, in
        # git at 22781c1; bench/README.md, "int4 on an H100, with tinygemm, gemlite and Marlin")
        return {"KERNEL": "gemv_words", "BLOCK_N": 16, "BLOCK_W": native_gemv_step(k),
                "num_warps": 4, "EVICT": 1, "NATIVE": 1}  # fmt: skip
    pair = pair_gemv_choice(fmt, m, n, k, native=True)
    if pair is not None:
        return pair
    if wgmma_problem(int(fmt), x, qdata, group) is None:
        config = wgmma_config(m, n, k, x.device)
        return {"KERNEL": "register_wgmma", **config, "NATIVE": 1,
                **promote_config(int(fmt), x, group, config["BLOCK_T"])}  # fmt: skip
    return DEQUANTIZE


NATIVE_KERNELS = ("gemv_words", "register_wgmma", "dequantize")  # the kernels that read it


def op_choice(fmt: Format, x, qdata, group: int, native: bool = False) -> dict | None:
    """The config the op picks by measurement for this matmul, if any (else `linear_launch`
    takes a tuned config or the built-in default): `native_choice` for native codes; else the
    word GEMV for two FP4 tokens on a small weight (`pair_gemv_choice`), else a register
    kernel's (`register_choice`)."""
    if native:
        return native_choice(fmt, x, qdata, group)
    if fmt >= Format.MXFP4:
        pair = pair_gemv_choice(fmt, x.shape[0], qdata.shape[0], x.shape[1], native=False)
        if pair is not None:
            return pair
    return register_choice(fmt, x, qdata, group)


def _scale_arg(scale: torch.Tensor) -> torch.Tensor:
    # FP8 scales (e8m0, e4m3) are read as their bytes and decoded in `_group_scale`.
    fp8 = (torch.float8_e8m0fnu, torch.float8_e4m3fn)
    return scale.view(torch.uint8) if scale.dtype in fp8 else scale


def dequantize_launch(fmt: Format, qdata, scale, zero, global_scale, group: int, k: int,
                      dtype: torch.dtype, native: bool = False) -> torch.Tensor:  # fmt: skip
    """W [N, K] in `dtype`; `native`: the codes in `packing.native_codes`' order."""
    if native:
        check_native_order(fmt < Format.MXFP4, group, fmt.name)
    n = qdata.shape[0]
    w = torch.empty((n, k), dtype=dtype, device=qdata.device)
    if n == 0 or k == 0:
        return w
    block_n, block_k = 32, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _dequantize_kernel[grid](
        qdata, _scale_arg(scale), zero if zero.numel() else qdata, global_scale, w, n, k,
        qdata.shape[1], qdata.stride(0), scale.stride(0), w.stride(0),
        FORMAT=int(fmt), GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, NATIVE=native,
        num_warps=4,
    )  # fmt: skip
    return w


def _gemv_words_launch(config: dict, x, qdata, args, out, common) -> torch.Tensor:
    """The word GEMV (`_gemv_words_kernel`) with `config` (BLOCK_N, BLOCK_W, num_warps and
    optionally SPLIT_K, PREFETCH, EVICT); `args` as `linear_launch` passes them."""
    m, k = x.shape
    n = qdata.shape[0]
    config = {"SPLIT_K": 1, "PREFETCH": 1, "EVICT": 0, "NATIVE": 0, "BLOCK_M": 1,
              **{key: v for key, v in config.items() if key != "KERNEL"}}  # fmt: skip
    if config["NATIVE"]:
        fmt = Format(common["FORMAT"])
        check_native_order(fmt < Format.MXFP4, common["GROUP"], fmt.name)
        if config["BLOCK_W"] % 16:
            raise ValueError(f"word GEMV config BLOCK_W={config['BLOCK_W']} on native codes: "
                             f"a step holds whole 128-column chunks (16 words)")  # fmt: skip
    assert k % (8 * config["BLOCK_W"]) == 0, "the word GEMV needs K a multiple of its step"
    if config["PREFETCH"] not in (1, 2):
        raise ValueError(
            f"word GEMV config PREFETCH={config['PREFETCH']!r}: the codes are "
            "loaded 1 or 2 steps ahead; give 1 or 2 (or leave it out for 1)"
        )
    if config["BLOCK_M"] not in (1, 2, 4, 8):
        raise ValueError(f"word GEMV config BLOCK_M={config['BLOCK_M']!r}: the tokens per "
                         "program are 1, 2, 4 or 8 (or leave it out for 1)")  # fmt: skip
    if x.dtype != torch.float32 and x.data_ptr() % 4:
        x = x.clone()  # 16-bit activations are read as 32-bit pairs (`_x_planes`)
    words = qdata.view(torch.int32)  # 8 codes per word, element 8w + j at bits 4j
    steps = words.shape[1] // config["BLOCK_W"]
    steps_per_split = triton.cdiv(steps, min(config.pop("SPLIT_K"), max(steps, 1)))
    split = triton.cdiv(steps, steps_per_split) if steps else 1
    grid = (triton.cdiv(n, config["BLOCK_N"]) * triton.cdiv(m, config["BLOCK_M"]), split)
    partials, arrived = workspace(m, n, split, grid[0], x.device) if split > 1 else (out, out)
    _gemv_words_kernel[grid](
        x, words, *args[2:], partials, arrived, m, n, words.shape[1], steps_per_split,
        x.stride(0), words.stride(0), args[2].stride(0), out.stride(0), SPLIT=split > 1,
        **common, **config,
    )  # fmt: skip
    return out


def linear_launch(fmt: Format, x, qdata, scale, zero, global_scale, bias, group: int,
                  config: dict | None = None, native: bool = False) -> torch.Tensor:  # fmt: skip
    """x [M, K] -> x @ W.T + bias [M, N] in x's dtype, by the kernel `kernel_for` picks.
    `zero` and `global_scale` are read only by the formats that have them (pass any tensor).
    x, qdata, scale, zero and bias must be contiguous (the ops make them so). `native`: the
    codes are in `packing.native_codes`' order (`native_choice` picks among the kernels that
    read it)."""
    m, k = x.shape
    n = qdata.shape[0]
    assert all(t is None or t.is_contiguous() for t in (x, qdata, scale, zero, bias)), "strides"
    if native:  # (each kernel's launcher checks the format and group: check_native_order)
        config = config or native_choice(fmt, x, qdata, group)
        if kernel_for(m, config) not in NATIVE_KERNELS or (
                config.get("KERNEL") != "dequantize" and not config.get("NATIVE")):  # fmt: skip
            raise ValueError(f"config {config} for codes in the native order: only "
                             f"{list(NATIVE_KERNELS)} read it, with NATIVE = 1")  # fmt: skip
    if config is None:
        config = op_choice(fmt, x, qdata, group)
    if config is None:
        config = tuned_config("w4a16", tuned_format(fmt, group), n, k, m, x.device)
        config = config or default_config(fmt, m, n, k, x.device)
    kernel = kernel_for(m, config)
    # The reference adds the bias rounded to the activation dtype; the kernels add it in fp32.
    bias = bias.to(x.dtype) if bias is not None else None
    if kernel == "dequantize":
        weight = dequantize_launch(fmt, qdata, scale, zero, global_scale, group, k, x.dtype,
                                   native)  # fmt: skip
        return F.linear(x, weight, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    common = dict(FORMAT=int(fmt), GROUP=group, HAS_BIAS=bias is not None)
    zero = zero if zero.numel() else qdata  # an empty tensor may have no address to pass
    args = (x, qdata, _scale_arg(scale), zero, global_scale, bias if bias is not None else out, out)
    if kernel == "register_ws":
        return ws_launch(int(fmt), x, qdata, scale, zero, bias, out, group, config, global_scale)
    if kernel == "register_wgmma":
        return wgmma_launch(int(fmt), x, qdata, scale, zero, bias, out, group, config,
                            global_scale)  # fmt: skip
    if kernel == "register":
        return register_launch(int(fmt), x, qdata, scale, zero, bias, out, group, config,
                               global_scale)  # fmt: skip
    if kernel == "gemv_words":
        return _gemv_words_launch(config, x, qdata, args, out, common)
    if kernel == "gemv":
        config = dict(config)
        grid = (triton.cdiv(n, config["BLOCK_N"]) * m,)
        _gemv_kernel[grid](*args, m, n, k, qdata.shape[1], x.stride(0), qdata.stride(0),
                           scale.stride(0), out.stride(0), EVEN_K=k % config["BLOCK_K"] == 0,
                           **common, **config)  # fmt: skip
        return out
    config = {"PREFETCH": 1, **config}  # a tuned entry without PREFETCH loads one step ahead
    if config["PREFETCH"] not in (1, 2):
        raise ValueError(f"small-M config PREFETCH={config['PREFETCH']!r}: the codes are loaded "
                         "1 or 2 steps ahead; give 1 or 2 (or leave it out for 1)")  # fmt: skip
    if INTERPRETED:  # the interpreter runs one program at a time, sequentially
        config.update(num_stages=1)
    steps = triton.cdiv(k, config["BLOCK_K"])
    steps_per_split = triton.cdiv(steps, min(config.pop("SPLIT_K"), max(steps, 1)))
    split = triton.cdiv(steps, steps_per_split) if steps else 1
    grid = (triton.cdiv(n, config["BLOCK_N"]), split, triton.cdiv(m, config["BLOCK_M"]))
    partials, arrived = workspace(m, n, split, grid[0] * grid[2], x.device) if split > 1 else (
        out, out)  # fmt: skip
    _small_m_kernel[grid](
        *args, partials, arrived, m, n, k, qdata.shape[1], steps_per_split,
        x.stride(0), qdata.stride(0), scale.stride(0), out.stride(0),
        X_FP32=x.dtype == torch.float32, SPLIT=split > 1, EVEN_K=k % config["BLOCK_K"] == 0,
        **common, **config,
    )  # fmt: skip
    return out


# ---- torch.library ops -------------------------------------------------------------------------


def _run(fmt: Format, x, qdata, scale, zero, global_scale, bias, group, native=False):
    k, n = x.shape[-1], qdata.shape[0]
    x2d = x.reshape(-1, k).contiguous()
    bias = bias.contiguous() if bias is not None else None  # the kernels read it with stride 1
    out = linear_launch(fmt, x2d, qdata.contiguous(), scale.contiguous(), zero.contiguous(),
                        global_scale, bias, group, native=native)  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


@torch.library.custom_op("qshard::int4_linear", mutates_args=())
def int4_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
    bias: torch.Tensor | None, group: int, float_zero: bool = False, native: bool = False,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for the int4 weight (qdata, scale, zero; an empty zero: symmetric;
    `float_zero`: zero is a value, W = (u - 8) * scale + zero; `native`: qdata in
    `packing.native_codes`' order, groups of 128 or a multiple)."""
    fmt = Format.INT4_SYM if zero.numel() == 0 else Format.INT4_ASYM
    fmt = Format.INT4_FZERO if float_zero else fmt
    return _run(fmt, x, qdata, scale, zero, scale, bias, group, native)


@torch.library.custom_op("qshard::mxfp4_linear", mutates_args=())
def mxfp4_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
    group: int,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for the MXFP4 weight (qdata, e8m0 scale)."""
    return _run(Format.MXFP4, x, qdata, scale, qdata, qdata, bias, group)


@torch.library.custom_op("qshard::nvfp4_linear", mutates_args=())
def nvfp4_linear(
    x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
    bias: torch.Tensor | None, group: int,
) -> torch.Tensor:  # fmt: skip
    """y = x @ W.T + bias for the NVFP4 weight (qdata, e4m3 scale, fp32 global scale)."""
    return _run(Format.NVFP4, x, qdata, scale, qdata, global_scale, bias, group)


@int4_linear.register_fake
def _(x, qdata, scale, zero, bias, group, float_zero=False, native=False):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@mxfp4_linear.register_fake
def _(x, qdata, scale, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))


@nvfp4_linear.register_fake
def _(x, qdata, scale, global_scale, bias, group):
    return x.new_empty((*x.shape[:-1], qdata.shape[0]))
