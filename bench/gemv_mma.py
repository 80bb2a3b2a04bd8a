"""An experiment, not shipped (no op runs it): a one-token int4 GEMV for Hopper in Gluon, on the
tensor cores (issue 24, Deliver 3). Measured slower than the Triton word GEMV that the op runs
at one token (`w4a16_triton._gemv_words_kernel`): docs/kernels/w4a16.md, "v10 (session 22)";
timed and checked against the reference by bench/bench_gemv.py.

The idea: the word GEMV multiplies on the CUDA cores, 4.5 instructions per weight (decode to
fp32, one FFMA, the scale and zero terms), and on the H100 it was latency- and issue-bound at
63-66 % of the copy bandwidth on the Llama-3.1-8B layer (v9). Here the tensor cores do the
multiply-add: each code is decoded to BIAS + u by one PRMT and one LOP3 per pair (bf16 BIAS
128, fp16 1024: exact), mma.sync multiplies it by x in fp32, and the zero point and scale are
applied once per chunk and row: s * (sum (BIAS + u) x - (BIAS + z) sum x), with sum x from one
more MMA against ones (the float zero point adds zero * sum x): 186 SASS instructions per
64 weights and thread (2.9 per weight) in the first build that measured.

**One token on an MMA built for 8.** mma.sync's B operand has 8 columns. A program takes 16 *
TILES weight rows over all of K; its WARPS warps split K, warp w taking the 128-column chunks
w, w + WARPS, ... So the warps need different activations: column n of B holds the chunk of warp
n (every warp loads the same B, as the MMA layout wants), and warp w reads its result in column
w, the other columns unused. At the end the warps' columns are added (one reduction through
shared memory) and the program writes its rows. No other synchronisation: each warp streams its
own codes by plain loads, four chunks ahead in registers.

The K permutation is qshard.kernels.w4a16_gluon's (each thread's 16-byte load of a row is its
fragments' columns; x read in the same order: its `_x_layout` and `_b_operand`, with tokens
read as K slices). A chunk's MMAs mix the four 32-column runs of its 128 columns, so the scale
applied after them must be one for the whole chunk: groups of 128 or 256 columns.

Accuracy: the products are exact, but the MMAs' fp32 sums carry BIAS * sum x, which the zero
term then removes: in bf16 within the tests' tolerance; in fp16 (BIAS 1024) activations of mean
4 gave a relative error of 7.3e-3 where 1e-3 is allowed (H100): the tensor cores' accumulation
is not exact enough to cancel it. A shipped form would subtract the zero in the decode (one
more instruction per pair).
"""

from __future__ import annotations

import torch
import triton

from qshard.kernels.gluon_api import GLUON_IMPORT_ERROR, gl, gluon, gluon_unavailable, mma_v2

__all__ = ["gluon_gemv_config", "gluon_gemv_launch", "gluon_gemv_problem"]

CHUNK = 128  # columns per MMA chunk: one scale per (row, chunk)
INT4_FORMATS = (0, 1, 2)  # w4a16_triton.Format.INT4_ASYM, INT4_SYM, INT4_FZERO
GEMV_GROUPS = (128, 256)  # a chunk never crosses a group


def gluon_gemv_problem(fmt: int, x: torch.Tensor, qdata: torch.Tensor, group: int) -> str | None:
    """Why the Gluon GEMV cannot run this matmul, or None if it can."""
    if gluon_unavailable() is not None:
        return gluon_unavailable()
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return "the Gluon GEMV is built and measured for Hopper (sm_90) only"
    m, k = x.shape
    if m != 1:
        return f"it multiplies one token, not {m}"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"it multiplies bf16 or fp16 activations, not {x.dtype}"
    if fmt not in INT4_FORMATS:
        return f"it covers the int4 formats, not {fmt} (the FP4 formats run the Triton GEMV)"
    if group not in GEMV_GROUPS:
        return f"it takes int4 groups of {list(GEMV_GROUPS)} columns, not {group}"
    if k % 32 or qdata.data_ptr() % 16 or x.data_ptr() % 16:
        return "it reads 16-byte runs of codes and activations: K % 32 == 0, 16-byte aligned"
    return None


def gluon_gemv_config(n: int, k: int) -> dict:
    """WARPS warps (K slices) per program of 16 * TILES rows: 8 K slices of one tile, the best
    measured on o and down (gate_up: 2, qkv: 4; docs/kernels/w4a16.md, "v10")."""
    return {"WARPS": 8, "TILES": 1}


def gluon_gemv_launch(fmt: int, x, qdata, scale, zero, bias, out, group: int,
                      config: dict | None = None) -> torch.Tensor:  # fmt: skip
    """out [1, N] = x [1, K] @ W.T + bias by the Gluon GEMV (`gluon_gemv_problem` is None); x,
    qdata, scale, zero, bias contiguous; `zero` any tensor for the symmetric format."""
    k = x.shape[1]
    n = qdata.shape[0]
    config = dict(config or gluon_gemv_config(n, k))
    warps, tiles = config["WARPS"], config["TILES"]
    if warps not in (1, 2, 4, 8) or tiles not in (1, 2, 4):
        raise ValueError(f"Gluon GEMV config {config}: WARPS must be 1, 2, 4 or 8 (the K "
                         f"slices, one per column of the MMA) and TILES 1, 2 or 4")  # fmt: skip
    _gemv_kernel[(triton.cdiv(n, 16 * tiles),)](
        x.view(torch.int32), qdata.view(torch.int32), scale, zero,
        bias if bias is not None else out, out, n, k,
        k // 32, scale.stride(0), FORMAT=fmt, GROUP=group, HAS_BIAS=bias is not None, TILES=tiles,
        num_warps=warps,
    )  # fmt: skip
    return out


# ---- the kernel --------------------------------------------------------------------------------

if GLUON_IMPORT_ERROR is None:
    from qshard.kernels.w4a16_gluon import _b_operand, _x_layout

    _CHUNK = gl.constexpr(CHUNK)
    # Word $4 -> bytes b = 0..3 as 16-bit pairs $b (BIAS + low nibble, BIAS + high nibble):
    # the byte's nibbles placed 16 bits apart by one PRMT, masked under the bits of BIAS (bf16
    # 128, fp16 1024: the values whose lowest mantissa bit is worth 1) by one LOP3. Exact.
    _BIASED = (
        "{\n.reg .b32 r;\nshr.u32 r, $4, 4;\n"
        + "".join(f"prmt.b32 ${b}, $4, r, {sel}; lop3.b32 ${b}, ${b}, 0x000f000f, $MAGIC, 0xEA;\n"
                  for b, sel in enumerate(("0x4400", "0x5511", "0x6622", "0x7733")))
        + "}"
    )  # fmt: skip
    _BIASED_BF16 = gl.constexpr(_BIASED.replace("$MAGIC", "0x43004300"))
    _BIASED_F16 = gl.constexpr(_BIASED.replace("$MAGIC", "0x64006400"))
    _BIASED_CONSTRAINTS = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 8))

    @gluon.constexpr_function
    def _codes_layout(warps, tiles):
        """A chunk's code words [16 * warps * tiles virtual rows, 4 t, 4 j]: thread (warp w,
        lane 4g + t) holds words 4t .. 4t + 3 (one 16-byte load) of virtual rows 16w + g and
        16w + g + 8 of each tile (virtual row 16 (warps * tile + w) + r: weight row
        16 tile + r, in warp w's K slice)."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0],
                       *[[16 * warps << i, 0, 0] for i in range(tiles.bit_length() - 1)]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)],
            block_bases=[], shape=[16 * warps * tiles, 4, 4],
        )  # fmt: skip

    @gluon.constexpr_function
    def _values_layout(warps, tiles):
        """`_codes_layout` with word j taken out and 8 values per word in registers: [virtual
        rows, 4 t, 8 (byte b, nibble h)], value 2b + h; pairs (h = 0, 1) share a register."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [8, 0, 0],
                       *[[16 * warps << i, 0, 0] for i in range(tiles.bit_length() - 1)]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)],
            block_bases=[], shape=[16 * warps * tiles, 4, 8],
        )  # fmt: skip

    @gluon.jit
    def _a_operand(words, j: gl.constexpr, dtype: gl.constexpr, TILES: gl.constexpr):
        """Word j of each thread's runs as the A operand [virtual rows, 32] of BIAS + u
        (`_BIASED`: 8 values per word, packed two per register as the MMA reads them), in
        the K order of w4a16_gluon.py's permutation (a relabelling)."""
        VROWS: gl.constexpr = words.shape[0]
        VALUES: gl.constexpr = _values_layout(gl.num_warps(), TILES)
        w = gl.reshape(words, [VROWS, 4, 2, 2])  # word j = 2 j1 + j0, in registers
        w = gl.split(gl.split(w)[j % 2])[j // 2]  # [rows, 4 runs]
        w = gl.convert_layout(w, gl.SliceLayout(2, VALUES), assert_trivial=True)
        w, _ = gl.broadcast(w[:, :, None], gl.zeros([VROWS, 4, 8], gl.int32, VALUES))
        # (one asm per word, its 8 values: the word passed 8 times, the same register)
        if dtype == gl.bfloat16:
            p = gl.inline_asm_elementwise(_BIASED_BF16, _BIASED_CONSTRAINTS, [w],
                                          dtype=gl.bfloat16, is_pure=True, pack=8)
        else:
            p = gl.inline_asm_elementwise(_BIASED_F16, _BIASED_CONSTRAINTS, [w],
                                          dtype=gl.float16, is_pure=True, pack=8)
        p = gl.reshape(p, [VROWS, 4, 2, 2, 2])  # t, b1, b0, h
        return gl.reshape(gl.permute(p, [0, 2, 3, 1, 4]), [VROWS, 32])

    @gluon.jit
    def _load_codes(codes_at, it):
        """Iteration `it`'s code words [virtual rows, 4, 4]: chunk it * WARPS + w of each
        virtual row's weight row (zeros past N and K). `codes_at`: the kernel's (q_ptr,
        word0, warp, live, chunks)."""
        q_ptr, word0, chunk_of_row, live, chunks = codes_at
        chunk = it * gl.num_warps() + chunk_of_row
        ok = (live & (chunk < chunks))[:, :, None]
        return gl.load(q_ptr + word0 + (chunk * 16)[:, :, None], mask=ok, other=0)

    @gluon.constexpr_function
    def _x_pairs_layout(warps, halves):
        """`_x_layout(8, warps)` as 32-bit pairs [8 n, 4 t, 4 p] (halves 0), or as their
        halves [8 n, 4 t, 4 p, 2 h] (halves 2): thread (g, t) holds slice g's 8 contiguous
        columns 8t .. 8t + 7 of a word (one 16-byte load)."""
        regs = [[0, 0, 1], [0, 0, 2]]
        lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        if halves:
            regs = [[0, 0, 0, 1], *[[*r, 0] for r in regs]]
            lanes = [[*b, 0] for b in lanes]
        return gl.DistributedLinearLayout(
            reg_bases=regs, lane_bases=lanes,
            warp_bases=[[0] * len(regs[0])] * (warps.bit_length() - 1), block_bases=[],
            shape=[8, 4, 4, 2] if halves else [8, 4, 4],
        )  # fmt: skip

    @gluon.jit
    def _load_x(x_ptr, it, K):
        """Iteration `it`'s activations for the chunk's 4 words, as 32-bit pairs ([8, 4, 4]
        each, `_x_pairs_layout`; carried across the loop as such: 16-bit values carried one by
        one come back repacked by PRMTs): column n of B holds warp n's chunk it * WARPS + n
        (columns past WARPS and K zeros)."""
        X: gl.constexpr = _x_pairs_layout(gl.num_warps(), 0)
        n = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, X)))[:, None, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, X)))[None, :, None]
        p = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, X)))[None, None, :]
        col = (it * gl.num_warps() + n) * _CHUNK + 32 * t  # the word's first column
        ok = (n < gl.num_warps()) & (col < K)
        pair = (it * gl.num_warps() + n) * (_CHUNK // 2) + 16 * t  # its first pair
        out = ()
        for j in gl.static_range(4):
            x = gl.load(x_ptr + (pair + 4 * j) + p, mask=ok, other=0)
            out = out + (x,)  # noqa: RUF005 (Triton builds tuples so)
        return out

    @gluon.jit
    def _b_data(pairs, dtype: gl.constexpr):
        """32-bit pairs [8, 4, 4] as the activations [8 n, 32 (8t + e)] in `_x_layout`: each
        register read as its two 16-bit halves, packed as the MMA reads them (a move: no
        instruction; 16-bit values unpacked one by one came back repacked by PRMTs)."""
        HALVES: gl.constexpr = _x_pairs_layout(gl.num_warps(), 2)
        pairs = gl.convert_layout(pairs, gl.SliceLayout(3, HALVES), assert_trivial=True)
        pairs = pairs[:, :, :, None] + gl.zeros([8, 4, 4, 2], gl.int32, HALVES)  # (folded)
        if dtype == gl.bfloat16:
            x = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [pairs],
                                          dtype=gl.bfloat16, is_pure=True, pack=2)
        else:
            x = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r", [pairs],
                                          dtype=gl.float16, is_pure=True, pack=2)
        return gl.convert_layout(gl.reshape(x, [8, 32]), _x_layout(8, gl.num_warps()),
                                 assert_trivial=True)  # fmt: skip

    @gluon.jit
    def _load_scales(scales_at, it, FORMAT: gl.constexpr, GROUP: gl.constexpr):
        """(scale, zero) per virtual row for iteration `it`'s chunk, as stored (converted
        where used, so that the prefetch does not wait for them): int4's scale and zero point
        (the symmetric format's zero unused: the scale again). `scales_at`: the kernel's
        (s_ptr, z_ptr, v_rows, v_warp, v_live, stride_sn, K)."""
        s_ptr, z_ptr, rows, chunk_of_row, live, stride_sn, K = scales_at
        chunk = it * gl.num_warps() + chunk_of_row
        ok = live & (chunk * _CHUNK < K)
        at = rows * stride_sn + (chunk * _CHUNK) // GROUP
        scale = gl.load(s_ptr + at, mask=ok, other=0.0)
        if FORMAT == 1:  # noqa: SIM108 (a constexpr branch)
            zero = scale
        else:
            zero = gl.load(z_ptr + at, mask=ok, other=0.0)
        return scale, zero

    @gluon.jit
    def _chunk_total(total, words, x_pairs, scales, FORMAT: gl.constexpr, TILES: gl.constexpr,
                     dtype: gl.constexpr):  # fmt: skip
        """total + one chunk of each warp's K slice: the 4 words' MMAs (BIAS + u against x,
        ones against x), then s * (sum (BIAS + u) x - (BIAS + z) sum x) per virtual row
        (symmetric and float zero points: z = 8, and the float zero point adds zero * sum x)."""
        VROWS: gl.constexpr = total.shape[0]
        MMA: gl.constexpr = total.type.layout
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        BIAS: gl.constexpr = 128.0 if dtype == gl.bfloat16 else 1024.0
        ones = gl.full([VROWS, 32], 1.0, dtype, A)
        dot = gl.zeros([VROWS, 8], gl.float32, MMA)
        x_sum = gl.zeros([VROWS, 8], gl.float32, MMA)
        for j in gl.static_range(4):
            a = gl.convert_layout(_a_operand(words, j, dtype, TILES), A, assert_trivial=True)
            b = gl.convert_layout(_b_operand(_b_data(x_pairs[j], dtype), 8), B,
                                  assert_trivial=True)  # fmt: skip
            dot = mma_v2(a, b, dot)
            x_sum = mma_v2(ones, b, x_sum)
        scale = scales[0].to(gl.float32)[:, None]
        if FORMAT == 0:
            total += (dot - (scales[1].to(gl.float32) + BIAS)[:, None] * x_sum) * scale
        else:
            total += (dot - (BIAS + 8.0) * x_sum) * scale
        if FORMAT == 2:
            total += scales[1].to(gl.float32)[:, None] * x_sum
        return total

    @gluon.jit
    def _step(total, words, x_pairs, scales, it, codes_at, scales_at, x_ptr, K,
              FORMAT: gl.constexpr, GROUP: gl.constexpr, TILES: gl.constexpr,
              dtype: gl.constexpr):  # fmt: skip
        """Iteration `it`: its chunk added to total, then its registers refilled with the codes
        and scales of iteration it + 4 and the activations of it + 2 (the loop's prefetch)."""
        total = _chunk_total(total, words, x_pairs, scales, FORMAT, TILES, dtype)
        words = _load_codes(codes_at, it + 4)
        scales = _load_scales(scales_at, it + 4, FORMAT, GROUP)
        x_pairs = _load_x(x_ptr, it + 2, K)
        return total, words, x_pairs, scales

    @gluon.jit
    def _gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, N, K, KW4, stride_sn,
                     FORMAT: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
                     TILES: gl.constexpr):  # fmt: skip
        """One program: 16 * TILES weight rows; warp w takes chunks w, w + WARPS, ... of K.
        Each warp's loop runs 4 iterations (chunks) at a time, the codes and scales of the
        next 4 in flight (each loaded into the registers its chunk just freed) and the
        activations 2 ahead: no register moves between iterations."""
        W: gl.constexpr = gl.num_warps()
        VROWS: gl.constexpr = 16 * W * TILES
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[W, 1], instr_shape=[16, 8])
        CODES: gl.constexpr = _codes_layout(W, TILES)
        RUNS: gl.constexpr = gl.SliceLayout(2, CODES)
        VROW: gl.constexpr = gl.SliceLayout(1, MMA)
        dtype: gl.constexpr = out_ptr.dtype.element_ty  # the activations'
        row0 = gl.program_id(0) * (16 * TILES)
        chunks = gl.cdiv(K, _CHUNK)
        # the code loads' per-thread offsets (codes layout)
        vr = gl.arange(0, VROWS, layout=gl.SliceLayout(1, RUNS))[:, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, RUNS))[None, :]
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, CODES)))[None, None, :]
        rows = row0 + 16 * (vr // (16 * W)) + vr % 16
        live = rows < N
        warp = (vr // 16) % W
        word0 = (rows * (KW4 * 4) + 4 * t)[:, :, None] + j  # KW4 = K / 32
        # the same per virtual row in the MMA layout (scales, the result)
        v = gl.arange(0, VROWS, layout=VROW)
        v_rows = row0 + 16 * (v // (16 * W)) + v % 16
        v_live = v_rows < N
        v_warp = (v // 16) % W
        iters = gl.cdiv(chunks, W)
        codes_at = (q_ptr, word0, warp, live, chunks)
        scales_at = (s_ptr, z_ptr, v_rows, v_warp, v_live, stride_sn, K)
        w0 = _load_codes(codes_at, 0)
        w1 = _load_codes(codes_at, 1)
        w2 = _load_codes(codes_at, 2)
        w3 = _load_codes(codes_at, 3)
        s0 = _load_scales(scales_at, 0, FORMAT, GROUP)
        s1 = _load_scales(scales_at, 1, FORMAT, GROUP)
        s2 = _load_scales(scales_at, 2, FORMAT, GROUP)
        s3 = _load_scales(scales_at, 3, FORMAT, GROUP)
        xa = _load_x(x_ptr, 0, K)
        xb = _load_x(x_ptr, 1, K)
        total = gl.zeros([VROWS, 8], gl.float32, MMA)
        for it in range(0, iters, 4):  # unrolled by hand: each chunk keeps its registers
            total, w0, xa, s0 = _step(total, w0, xa, s0, it, codes_at, scales_at, x_ptr, K,
                                      FORMAT, GROUP, TILES, dtype)  # fmt: skip
            if it + 1 < iters:
                total, w1, xb, s1 = _step(total, w1, xb, s1, it + 1, codes_at, scales_at,
                                          x_ptr, K, FORMAT, GROUP, TILES, dtype)  # fmt: skip
            if it + 2 < iters:
                total, w2, xa, s2 = _step(total, w2, xa, s2, it + 2, codes_at, scales_at,
                                          x_ptr, K, FORMAT, GROUP, TILES, dtype)  # fmt: skip
            if it + 3 < iters:
                total, w3, xb, s3 = _step(total, w3, xb, s3, it + 3, codes_at, scales_at,
                                          x_ptr, K, FORMAT, GROUP, TILES, dtype)  # fmt: skip
        # column n of warp w's virtual rows is its K slice's sum where n == w; the warps' sums
        cols = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        mine = gl.sum(gl.where(cols[None, :] == v_warp[:, None], total, 0.0), axis=1)
        result = gl.sum(gl.reshape(mine, [TILES, W, 16]), axis=1)
        out_rows = gl.max(gl.reshape(v_rows, [TILES, W, 16]), axis=1)
        ok = out_rows < N
        if HAS_BIAS:
            result += gl.load(bias_ptr + out_rows, mask=ok, other=0.0).to(gl.float32)
        gl.store(out_ptr + out_rows, result.to(out_ptr.dtype.element_ty), mask=ok)
