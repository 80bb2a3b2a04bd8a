"""The word GEMV: one or a few tokens on K a multiple of its step, `_gemv_words_kernel` decoding
whole 32-bit words in place (8 codes each) and never rebuilding the K order: int4 codes as the
exact u - 8 (`int4_exact`: one LOP3 and one subtraction), e2m1 pairs as fp16 halves
(`word_pair`); the activations read as 32-bit pairs; each (row, group) keeps its scaled sum
across the steps; optionally K split over programs (SPLIT_K) and the codes loaded two steps
ahead or evict-first (the default loads them evict-first). It reads canonical codes and, with
NATIVE = 1, int4 codes in `packing.native_codes`' order.

It multiplies the exact weight, not the weight rounded to the activation dtype as the reference
does: within the activation dtype's rounding for bf16/fp16 (the tests' tolerance). On the H100
the Llama-3.1-8B layer at one token takes int4 58 us, MXFP4 61 us, NVFP4 68 us (63-66 % / 60 %
of the copy bandwidth; docs/kernels/w4a16.md, "The one-token word GEMV"); two tokens on a small
weight: `pair_config` (docs/kernels/w4a16.md, "Two tokens: the pair GEMV").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..packing import check_native_order
from ..split_k import finish_tile, workspace
from .decode import (
    FMT_INT4_FZERO,
    FMT_INT4_SYM,
    FMT_MXFP4,
    group_scale,
    halves_to_fp32,
    int4_exact,
    launch_args,
    load_global_scale,
    word_pair,
)
from .format import Format

__all__ = ["config", "launch", "native_config", "native_step", "pair_config", "problem"]

MIN_STEP_WORDS = 16  # the smallest step: one 128-column chunk (a native chunk's 16 words)


def problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """Why the word GEMV cannot run this matmul, or None: its steps are whole words, at least a
    128-column chunk (a config's step, BLOCK_W words, must divide K too)."""
    k = x.shape[1]
    if k % (8 * MIN_STEP_WORDS):
        return f"it reads steps of whole 128-column chunks: K % 128 == 0, not K = {k}"
    return None


@triton.jit
def _x_pair(x_ptr, pair):
    """x's 32-bit pairs `pair` (columns 2 pair and 2 pair + 1) as two fp32 tensors: 16-bit
    activations by one 32-bit load each (x 4-byte aligned, which the launcher ensures), widened
    in registers: bf16 by a shift and a mask (a bf16 is the top half of its fp32), fp16 by
    `halves_to_fp32`."""
    if x_ptr.dtype.element_ty == tl.float32:
        return tl.load(x_ptr + 2 * pair), tl.load(x_ptr + 2 * pair + 1)
    p = tl.load(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + pair)
    if x_ptr.dtype.element_ty == tl.bfloat16:
        return (p << 16).to(tl.float32, bitcast=True), (p & -65536).to(tl.float32, bitcast=True)
    return halves_to_fp32(p)


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
    if FORMAT >= FMT_MXFP4:  # planes (j, j + 4) decoded together, summed in the order 0 4 1 5 ..
        low, high = halves_to_fp32(word_pair(words, 0))
        products = _fma_plane((), low, xs, 0, True)
        products = _fma_plane(products, high, xs, 4, False)
        for j in tl.static_range(1, 4):
            low, high = halves_to_fp32(word_pair(words, j))
            products = _fma_plane(products, low, xs, j, False)
            products = _fma_plane(products, high, xs, j + 4, False)
        return products
    products = _fma_plane((), int4_exact(words, 0), xs, 0, True)
    for j in tl.static_range(1, 8):
        products = _fma_plane(products, int4_exact(words, j), xs, j, False)
    return products


@triton.jit
def _group_share(
    acc, products, x, scale, zero, FORMAT: tl.constexpr, G: tl.constexpr, WG: tl.constexpr
):
    """One token's acc [rows, G] + the step's share of each (row, group), from its products
    (`_word_products`) and its planes x. int4: s * (sum (u - 8) x - (z - 8) sum x) (a float
    zero point: s * sum (u - 8) x + zero * sum x; symmetric: no sum x); e2m1: s * sum v x, v
    the value * 2**-14 (`word_pair`)."""
    ROWS: tl.constexpr = products.shape[0]
    group_sum = tl.sum(tl.reshape(products, (ROWS, G, WG)), axis=2)
    if FORMAT >= FMT_MXFP4 or FORMAT == FMT_INT4_SYM:
        return acc + group_sum * scale
    x_word = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]))
    x_sum = tl.sum(tl.reshape(x_word, (G, WG)), axis=1)[None, :]
    if FORMAT == FMT_INT4_FZERO:
        return acc + group_sum * scale + zero * x_sum
    return acc + (group_sum - (zero - 8.0) * x_sum) * scale


@triton.jit
def _gemv_words_step(
    accs,
    words,
    x_ptr,
    m0,
    M,
    stride_xm,
    s_ptr,
    z_ptr,
    offs_n,
    n_ok,
    w0,
    stride_sn,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NATIVE: tl.constexpr,
):
    """accs (per token of the program: [rows, G]) + this step's share of each (row, group):
    the step's words [rows, BLOCK_W] from word w0, decoded once for all the tokens, their
    activations and their groups' scales."""
    WG: tl.constexpr = GROUP // 8 if GROUP // 8 < BLOCK_W else BLOCK_W  # words per group
    G: tl.constexpr = BLOCK_W // WG
    xs = ()
    for t in tl.static_range(len(accs)):
        xs = xs + (_x_planes(_x_token(x_ptr, m0, t, M, stride_xm), w0, BLOCK_W, NATIVE),)
    group = (w0 + tl.arange(0, G) * WG) // (GROUP // 8)
    scale, zero = group_scale(
        s_ptr, z_ptr, offs_n[:, None] * stride_sn + group[None, :], n_ok[:, None], FORMAT
    )
    products = _word_products(words, xs, FORMAT)
    new = ()
    for t in tl.static_range(len(accs)):
        new = new + (_group_share(accs[t], products[t], xs[t], scale, zero, FORMAT, G, WG),)
    return new


@triton.jit
def _gemv_words_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    z_ptr,
    g_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    arrived_ptr,
    M,
    N,
    KW,
    steps_per_split,
    stride_xm,
    stride_qw,
    stride_sn,
    stride_om,
    FORMAT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,
    PREFETCH: tl.constexpr,
    EVICT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    NATIVE: tl.constexpr = False,
    BLOCK_M: tl.constexpr = 1,
):
    """The GEMV on 32-bit words (8 codes each; K a multiple of 8 * BLOCK_W): the codes are
    never split into bytes or put back in K order. Nibble j of every word in the tile is decoded
    in place and multiplies the activations x[8w + j] (`_x_planes`, shared by the tile's rows)
    of each of the program's BLOCK_M tokens (the decode shared by them: a few tokens cost one
    FFMA per weight and token more, not a decode each); each (row, group) keeps its own scaled
    sum across the steps, summed over the groups once at the end. int4 (`int4_exact`): one
    LOP3 and one subtraction per code, the exact u - 8; e2m1 (`word_pair`): nibbles j and
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
    words = tl.load(
        q_ptrs + w0, mask=(offs_n < N * (w0 < w_end))[:, None], other=0, eviction_policy=POLICY
    )
    if PREFETCH == 2:
        w1 = w0 + BLOCK_W
        words1 = tl.load(
            q_ptrs + w1, mask=(offs_n < N * (w1 < w_end))[:, None], other=0, eviction_policy=POLICY
        )
    for w0 in range(first_step * BLOCK_W, w_end, BLOCK_W):
        if PREFETCH == 2:
            w2 = w0 + 2 * BLOCK_W
            words2 = tl.load(
                q_ptrs + w2,
                mask=(offs_n < N * (w2 < w_end))[:, None],
                other=0,
                eviction_policy=POLICY,
            )
        else:
            w1 = w0 + BLOCK_W
            words1 = tl.load(
                q_ptrs + w1,
                mask=(offs_n < N * (w1 < w_end))[:, None],
                other=0,
                eviction_policy=POLICY,
            )
        accs = _gemv_words_step(
            accs,
            words,
            x_ptr,
            m0,
            M,
            stride_xm,
            s_ptr,
            z_ptr,
            offs_n,
            n_ok,
            w0,
            stride_sn,
            FORMAT,
            GROUP,
            BLOCK_W,
            NATIVE,
        )
        words = words1
        if PREFETCH == 2:
            words1 = words2
    token = tl.arange(0, BLOCK_M)
    tile = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for t in tl.static_range(BLOCK_M):
        tile = tl.where(token[None, :] == t, tl.sum(accs[t], axis=1)[:, None], tile)
    if FORMAT >= FMT_MXFP4:  # the decoded e2m1 values are value * 2**-14
        tile = tile * (load_global_scale(g_ptr, FORMAT) * 16384.0)
    offs_m = m0 + token
    finish_tile(
        tile,
        partials_ptr,
        arrived_ptr,
        bias_ptr,
        out_ptr,
        offs_n,
        offs_m,
        n_ok,
        offs_m < M,
        M,
        N,
        stride_om,
        HAS_BIAS,
        SPLIT,
    )


def config(fmt: Format, n: int, k: int, sms: int) -> dict:
    """The one-token config for an N x K weight on a GPU of `sms` SMs: 128 words (1024 K) per
    step on 4 warps, the codes loaded evict-first; 16 rows when there are at least 2.5 bands of
    16 rows per SM (Llama-3.1-8B's qkv and gate_up on an H100), else 8 (o, down: 16-row bands
    would leave half the SMs idle); int4 with 8 rows and a long K (>= 8192, a multiple of 2048:
    down) takes 256 words per step. NVFP4 always 8 x 128. On the H100 sweep each choice was
    its shape's fastest or within 3 % of it (6 % for MXFP4's down; docs/kernels/w4a16.md, "The
    one-token word GEMV")."""
    rows = 16 if fmt != Format.NVFP4 and triton.cdiv(n, 16) >= 2.5 * sms else 8
    long_k = fmt < Format.MXFP4 and rows == 8 and k >= 8192 and k % 2048 == 0
    return {
        "KERNEL": "gemv_words",
        "BLOCK_N": rows,
        "BLOCK_W": 256 if long_k else 128,
        "num_warps": 4,
        "EVICT": 1,
    }


def pair_config(native: bool) -> dict:
    """Two tokens per program (the codes decoded once for both): 16 rows, 128 words per step
    (K a multiple of 1024)."""
    return {
        "KERNEL": "gemv_words",
        "BLOCK_N": 16,
        "BLOCK_W": 128,
        "BLOCK_M": 2,
        "num_warps": 4,
        "EVICT": 1,
        "NATIVE": int(native),
    }


def native_step(k: int) -> int:
    """Code words per step of the one-token word GEMV on native codes: 256 on a long K (down's,
    the fastest in the H100 sweep of the native read), else 128, halved until a step divides K
    (K % 128 == 0: a step of 16 words always does)."""
    block_w = 256 if k >= 8192 and k % 2048 == 0 else 128
    while k % (8 * block_w):
        block_w //= 2
    return block_w


def native_config(k: int) -> dict:
    """One token on native codes: 16 rows on every Llama-3.1-8B linear (o and down too, where
    the canonical codes take 8), the fastest of the H100 sweep of the native read (bench/README.md,
    "int4 on an H100, with tinygemm, gemlite and Marlin"), `native_step` words per step."""
    return {
        "KERNEL": "gemv_words",
        "BLOCK_N": 16,
        "BLOCK_W": native_step(k),
        "num_warps": 4,
        "EVICT": 1,
        "NATIVE": 1,
    }


def launch(
    fmt: int, x, qdata, scale, zero, bias, out, group: int, config: dict, global_scale
) -> torch.Tensor:
    """out [M, N] = x [M, K] @ W.T + bias by the word GEMV with `config` (BLOCK_N, BLOCK_W,
    num_warps and optionally SPLIT_K, PREFETCH, EVICT, NATIVE, BLOCK_M)."""
    m, k = x.shape
    n = qdata.shape[0]
    config = {
        "SPLIT_K": 1,
        "PREFETCH": 1,
        "EVICT": 0,
        "NATIVE": 0,
        "BLOCK_M": 1,
        **{key: v for key, v in config.items() if key != "KERNEL"},
    }
    if config["NATIVE"]:
        check_native_order(Format(fmt).is_int4, group, Format(fmt).name)
        if config["BLOCK_W"] % MIN_STEP_WORDS:
            raise ValueError(
                f"word GEMV config BLOCK_W={config['BLOCK_W']} on native codes: "
                f"a step holds whole 128-column chunks (16 words)"
            )
    assert k % (8 * config["BLOCK_W"]) == 0, "the word GEMV needs K a multiple of its step"
    if config["PREFETCH"] not in (1, 2):
        raise ValueError(
            f"word GEMV config PREFETCH={config['PREFETCH']!r}: the codes are "
            "loaded 1 or 2 steps ahead; give 1 or 2 (or leave it out for 1)"
        )
    if config["BLOCK_M"] not in (1, 2, 4, 8):
        raise ValueError(
            f"word GEMV config BLOCK_M={config['BLOCK_M']!r}: the tokens per "
            "program are 1, 2, 4 or 8 (or leave it out for 1)"
        )
    if x.dtype != torch.float32 and x.data_ptr() % 4:
        x = x.clone()  # 16-bit activations are read as 32-bit pairs (`_x_planes`)
    args, common = launch_args(fmt, x, qdata, scale, zero, global_scale, bias, out, group)
    words = qdata.view(torch.int32)  # 8 codes per word, element 8w + j at bits 4j
    steps = words.shape[1] // config["BLOCK_W"]
    steps_per_split = triton.cdiv(steps, min(config.pop("SPLIT_K"), max(steps, 1)))
    split = triton.cdiv(steps, steps_per_split) if steps else 1
    grid = (triton.cdiv(n, config["BLOCK_N"]) * triton.cdiv(m, config["BLOCK_M"]), split)
    partials, arrived = workspace(m, n, split, grid[0], x.device) if split > 1 else (out, out)
    _gemv_words_kernel[grid](
        x,
        words,
        *args[2:],
        partials,
        arrived,
        m,
        n,
        words.shape[1],
        steps_per_split,
        x.stride(0),
        words.stride(0),
        args[2].stride(0),
        out.stride(0),
        SPLIT=split > 1,
        **common,
        **config,
    )
    return out
