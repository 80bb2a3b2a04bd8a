"""The decoding shared by the W4A16 Triton kernels (the GEMVs, the small-M kernel, dequantize)
and the grouped expert kernels (`kernels/grouped/`): a code and its group's scale become the
reference's fp32 weight by bit placement alone, no integer-to-float conversion and no table.

Codes are packed two per byte along K, the even index in the low nibble (every layout's
canonical packing). `decode_bytes` turns a tile of bytes into values in K order: int4 as
1 + u/16 (u in fp32's top mantissa bits), e2m1 as fp16 bits (value * 2**-14). With K a multiple
of the step the kernels decode whole 32-bit words in place instead (`int4_nibble`, `word_pair`,
`int4_exact`). Each format's weight, exactly the reference's fp32 value (`format.py`):

    INT4_ASYM   (16 v - 16 - z) * s, v = 1 + u/16
    INT4_SYM    the same with z = 8
    INT4_FZERO  fma(16 v - 24, s, zero)
    MXFP4       (v * 2**14) * 2**(e - 127)
    NVFP4       the reference's order, (v * s) * global

Compiled kernels flush fp32 subnormal results to zero (weights below 1.2e-38; the reference
keeps them).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .format import Format

__all__ = [
    "FMT_INT4_ASYM",
    "FMT_INT4_FZERO",
    "FMT_INT4_SYM",
    "FMT_MXFP4",
    "FMT_NVFP4",
    "INTERPRETED",
    "decode_bytes",
    "dequantize_values",
    "fp16_bits_to_fp32",
    "group_scale",
    "group_terms",
    "group_to_words",
    "halves_to_fp32",
    "int4_exact",
    "int4_nibble",
    "launch_args",
    "load_global_scale",
    "scale_arg",
    "step_codes",
    "step_weights",
    "step_words",
    "word_pair",
    "word_pair_weights",
    "word_weights",
]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_INTERPRETED: tl.constexpr = tl.constexpr(INTERPRETED)

# The formats as constexprs, for the kernels' `FORMAT` comparisons.
FMT_INT4_ASYM: tl.constexpr = tl.constexpr(int(Format.INT4_ASYM))
FMT_INT4_SYM: tl.constexpr = tl.constexpr(int(Format.INT4_SYM))
FMT_INT4_FZERO: tl.constexpr = tl.constexpr(int(Format.INT4_FZERO))
FMT_MXFP4: tl.constexpr = tl.constexpr(int(Format.MXFP4))
FMT_NVFP4: tl.constexpr = tl.constexpr(int(Format.NVFP4))


@triton.jit
def fp16_bits_to_fp32(bits):
    """The low 16 bits of an int32 tensor read as an fp16, in fp32 (exact)."""
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def int4_nibble(words, j: tl.constexpr):
    """Nibble j of every word as `decode_bytes`'s int4 value 1 + u/16 (u in fp32's top mantissa
    bits): one shift and one and-or, exactly."""
    if 4 * j <= 19:  # noqa: SIM108 (a constexpr branch: one shift direction each)
        bits = (words << (19 - 4 * j)) & 0x780000
    else:
        bits = (words >> (4 * j - 19)) & 0x780000
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def word_pair(words, j: tl.constexpr):
    """Nibbles j and j + 4 (j < 4) of every 32-bit word as the two 16-bit halves of one int32,
    each placed in fp16 bits as `decode_bytes` places an e2m1 code (value * 2**-14): magnitude bits
    4j..4j+2 to 9..11, sign bit 4j+3 to 15. Both halves at once: one shift and one mask for the
    magnitudes, one shift and one and-or for the signs."""
    if 9 - 4 * j >= 0:  # noqa: SIM108 (a constexpr branch: one shift direction each)
        magnitude = (words << (9 - 4 * j)) & 0x0E000E00
    else:
        magnitude = (words >> (4 * j - 9)) & 0x0E000E00
    return magnitude | ((words << (12 - 4 * j)) & -0x7FFF8000)  # 0x80008000 as an int32


@triton.jit
def halves_to_fp32(pair):
    """The low and high 16 bits of an int32 tensor read as fp16, exactly, in fp32. Compiled,
    by PTX on each register: Triton's own conversion packs the halves of two registers
    together first (a PRMT per value; docs/kernels/w4a16.md, "Formats and decoding"). The
    interpreter, which runs no PTX, converts with Triton's casts (the same values)."""
    if _INTERPRETED:
        return fp16_bits_to_fp32(pair), fp16_bits_to_fp32(pair >> 16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }",
            "=r,=r,r",
            [pair],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )


@triton.jit
def int4_exact(words, J: tl.constexpr):
    """Nibble J of every word as the exact float u - 8, u the code: the nibble and-ed in place
    under an exponent that makes its lowest bit worth 1 (the float 2**(23 - p) + u, p its bit
    position), then 2**(23 - p) + 8 subtracted. Nibbles 5..7 (bits 20..31 reach fp32's
    exponent) are taken from the word shifted right by 12 (one shift per word). One and-or
    with both constants (a single LOP3, by PTX: Triton's own `&` then `|` compiles to two) and
    one subtraction, where `int4_nibble` (1 + u/16) takes a shift and two LOP3s."""
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
        bits = tl.inline_asm_elementwise(
            f"lop3.b32 $0, $1, {MASK}, {MAGIC}, 0xEA;",
            "=r,r",
            [src],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    magic = tl.full((), MAGIC, tl.int32).to(tl.float32, bitcast=True)
    return bits.to(tl.float32, bitcast=True) - (magic + 8.0)


@triton.jit
def decode_bytes(packed, FORMAT: tl.constexpr):
    """Code bytes [rows, H] -> fp32 [rows, 2H] in K order (each byte's low nibble first), by
    bit placement alone (no conversion of an integer, no table), exactly:
    int4: 1 + u/16, the fp32 with u as the top 4 mantissa bits (so u = 16 * v - 16);
    e2m1: value * 2**-14, the fp16 with e2m1's exponent and mantissa bits in fp16's low
    exponent bits and top mantissa bit (e2m1's subnormals are fp16 subnormals), and its sign."""
    b = packed.to(tl.int32)
    if FORMAT >= FMT_MXFP4:
        low = ((b << 9) & 0x0E00) | ((b << 12) & 0x8000)
        high = ((b << 5) & 0x0E00) | ((b << 8) & 0x8000)
        v = fp16_bits_to_fp32(tl.join(low, high))
    else:
        v = tl.join(int4_nibble(b, 0), int4_nibble(b, 1))
    return tl.reshape(v, (packed.shape[0], 2 * packed.shape[1]))


@triton.jit
def group_scale(s_ptr, z_ptr, offs, mask, FORMAT: tl.constexpr):
    """(scale, zero) per (row, group) in fp32: the int4 scale and zero point (8 if symmetric),
    or the FP4 block scale (zero unused)."""
    if FORMAT == FMT_MXFP4:  # e8m0: the byte e is 2**(e - 127); e = 0 is the subnormal 2**-127
        e = tl.load(s_ptr + offs, mask=mask, other=127).to(tl.int32)
        scale = tl.where(e == 0, 2.0**-127, (e << 23).to(tl.float32, bitcast=True))
        return scale, scale
    elif FORMAT == FMT_NVFP4:
        # e4m3 read as its byte, not as Triton's fp8e4nv (which needs sm_89): the kernels run on
        # sm_80 too. Decoded by bit placement as `decode_bytes` decodes e2m1: s eeee mmm (bias 7) in
        # fp16's sign, low exponent and top mantissa bits is the value * 2**-8 (e4m3's
        # subnormals are fp16 subnormals; NaN, e = 15 and m = 7, is never stored: the quantizer
        # clamps to 448 and loading refuses NaN), exactly, then * 2**8.
        b = tl.load(s_ptr + offs, mask=mask, other=0).to(tl.int32)
        bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        scale = fp16_bits_to_fp32(bits) * 256.0
        return scale, scale
    else:
        scale = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if FORMAT == FMT_INT4_ASYM or FORMAT == FMT_INT4_FZERO:  # noqa: SIM109 (constexprs)
            zero = tl.load(z_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            zero = tl.full(scale.shape, 8.0, tl.float32)
        return scale, zero


@triton.jit
def dequantize_values(v, scale, zero, FORMAT: tl.constexpr):
    """Decoded values (`decode_bytes`) [rows, G, n] and their groups' (scale, zero) [rows, G, 1] ->
    weights in fp32, exactly the reference's: int4 (16 v - 16 - z) * s = (u - z) * s (the FMA
    gives the exact integer u - z), e2m1 (v * 2**14) * s. NVFP4's global scale is left out."""
    if FORMAT >= FMT_MXFP4:
        return (v * 16384.0) * scale
    elif FORMAT == FMT_INT4_FZERO:  # one rounding, as the reference (an exact value, then fp32)
        return tl.fma(v * 16.0 - 24.0, scale, zero)
    else:
        return (v * 16.0 - (zero + 16.0)) * scale


@triton.jit
def group_terms(vx_sum, x_sum, scale, zero, FORMAT: tl.constexpr):
    """An int4 group's share of the GEMV sum from sum v x and sum x (v = 1 + u/16):
    sum (u - z) s x = s (16 sum v x - (16 + z) sum x); with a float zero point,
    sum ((u - 8) s + zero) x = s (16 sum v x - 24 sum x) + zero sum x."""
    if FORMAT == FMT_INT4_FZERO:
        return (vx_sum * 16.0 - 24.0 * x_sum) * scale + zero * x_sum
    else:
        return (vx_sum * 16.0 - (zero + 16.0) * x_sum) * scale


@triton.jit
def step_codes(
    q_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    k0,
    N,
    K,
    KH,
    stride_qn,
    stride_sn,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
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
    scale, zero = group_scale(
        s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :], g_ok, FORMAT
    )
    return packed, scale, zero


@triton.jit
def step_weights(
    packed,
    scale,
    zero,
    global_scale,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One step's weights [rows, BLOCK_K] in fp32, each exactly the reference's fp32 value."""
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    ROWS: tl.constexpr = packed.shape[0]
    v = tl.reshape(decode_bytes(packed, FORMAT), (ROWS, BLOCK_K // GK, GK))
    w = dequantize_values(v, scale[:, :, None], zero[:, :, None], FORMAT)
    return tl.reshape(w, (ROWS, BLOCK_K)) * global_scale


@triton.jit
def step_words(
    q_ptr,
    s_ptr,
    z_ptr,
    offs_n,
    k0,
    N,
    K,
    stride_qw,
    stride_sn,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`step_codes` with K a multiple of the step: the codes as 32-bit words [rows, BLOCK_K / 8]
    (q_ptr an int32 view; code 8w + j in bits 4j..4j+3 of word w) and each group's (scale,
    zero) [rows, G]."""
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    n_ok = offs_n < N * (k0 < K)  # (no rows at all past K)
    word = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(
        q_ptr + offs_n[:, None] * stride_qw + word[None, :], mask=n_ok[:, None], other=0
    )
    group = (k0 + tl.arange(0, BLOCK_K // GK) * GK) // GROUP
    scale, zero = group_scale(
        s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :], n_ok[:, None], FORMAT
    )
    return words, scale, zero


@triton.jit
def word_pair_weights(
    words,
    j: tl.constexpr,
    per_word,
    zero_word,
    global_scale,
    FORMAT: tl.constexpr,
    dtype: tl.constexpr,
):
    """Nibbles j and j + 4 of every word as weights [rows, words, 2] in `dtype`, each the
    reference's fp32 value rounded once. int4: `dequantize_values` of `int4_nibble`. e2m1: both
    nibbles decoded at once (`word_pair`), then two exact products and one rounded: MXFP4
    (value) * scale, the value being the decoded value * 2**-14 times 2**14 (a huge e8m0 scale
    times 2**14 could overflow); NVFP4 value * (2**14 scale) (at most 448 * 2**14: exact) *
    global."""
    if FORMAT < FMT_MXFP4:
        low = dequantize_values(int4_nibble(words, j), per_word, zero_word, FORMAT).to(dtype)
        high = dequantize_values(int4_nibble(words, j + 4), per_word, zero_word, FORMAT).to(dtype)
        return tl.join(low, high)
    low, high = halves_to_fp32(word_pair(words, j))
    if FORMAT == FMT_NVFP4:
        low = ((low * per_word) * global_scale).to(dtype)
        high = ((high * per_word) * global_scale).to(dtype)
    else:
        low = ((low * 16384.0) * per_word).to(dtype)
        high = ((high * 16384.0) * per_word).to(dtype)
    return tl.join(low, high)


@triton.jit
def group_to_words(group_values, BLOCK_K: tl.constexpr, GK: tl.constexpr):
    """[rows, G] per group -> [rows, BLOCK_K / 8] per word (GK values of a group in a step)."""
    ROWS: tl.constexpr = group_values.shape[0]
    return tl.reshape(
        tl.broadcast_to(group_values[:, :, None], (ROWS, BLOCK_K // GK, GK // 8)),
        (ROWS, BLOCK_K // 8),
    )


@triton.jit
def word_weights(
    words,
    scale,
    zero,
    global_scale,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    dtype: tl.constexpr,
):
    """One step's weights [rows, BLOCK_K] in `dtype`, in K order, from its words
    (`step_words`): each word's nibbles decoded in place (`word_pair_weights`), scaled in fp32
    (exactly the reference's fp32 value, as `step_weights`) and rounded once; the eight
    [rows, words] planes joined so that plane j lands at 8w + j. No byte is unpacked: a byte
    tensor carried from one step to the next costs a byte permute per code (SASS for sm_90)."""
    ROWS: tl.constexpr = words.shape[0]
    GK: tl.constexpr = GROUP if GROUP < BLOCK_K else BLOCK_K
    if FORMAT == FMT_NVFP4:
        scale = scale * 16384.0
    per_word = group_to_words(scale, BLOCK_K, GK)
    zero_word = group_to_words(zero, BLOCK_K, GK) if FORMAT < FMT_MXFP4 else per_word
    # tl.join adds a minor dimension, so the joins' leaves go in bit-reversed order of the
    # position in the word: the pair (j, j + 4) is one innermost join.
    w = tl.join(
        tl.join(
            word_pair_weights(words, 0, per_word, zero_word, global_scale, FORMAT, dtype),
            word_pair_weights(words, 2, per_word, zero_word, global_scale, FORMAT, dtype),
        ),
        tl.join(
            word_pair_weights(words, 1, per_word, zero_word, global_scale, FORMAT, dtype),
            word_pair_weights(words, 3, per_word, zero_word, global_scale, FORMAT, dtype),
        ),
    )
    return tl.reshape(w, (ROWS, BLOCK_K))


@triton.jit
def load_global_scale(g_ptr, FORMAT: tl.constexpr):
    if FORMAT == FMT_NVFP4:
        return tl.load(g_ptr).to(tl.float32)
    else:
        return 1.0


def scale_arg(scale: torch.Tensor) -> torch.Tensor:
    # FP8 scales (e8m0, e4m3) are read as their bytes and decoded in `group_scale`.
    fp8 = (torch.float8_e8m0fnu, torch.float8_e4m3fn)
    return scale.view(torch.uint8) if scale.dtype in fp8 else scale


def launch_args(fmt, x, qdata, scale, zero, global_scale, bias, out, group: int):
    """The pointer arguments every W4A16 Triton kernel takes first (x, codes, scales read as
    bytes where FP8, zero, global scale, bias or `out` in its place, out) and the constexprs
    they share (FORMAT, GROUP, HAS_BIAS). `zero` may be any tensor where the format has none."""
    args = (x, qdata, scale_arg(scale), zero, global_scale, bias if bias is not None else out, out)
    return args, dict(FORMAT=int(fmt), GROUP=group, HAS_BIAS=bias is not None)
