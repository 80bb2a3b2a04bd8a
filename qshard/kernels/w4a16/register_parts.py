"""The Gluon pieces the three register-operand W4A16 kernels share (`register.py`,
`register_ws.py`, `register_wgmma.py`): the PTX decodes of a 32-bit code word into the MMA's A
operand (the K permutation and the decode: `register.py`'s docstring), the register layouts of
a chunk's code words and activations, a work item's place and scales, and the mma.sync tile
epilogue with split K (`split_k.py`'s scheme)."""

from __future__ import annotations

from ..gluon_api import CHUNK, GLUON_IMPORT_ERROR, barrier, gl, gluon, store_transposed

__all__ = [
    "ROWS_PER_WARP",
    "WORDS",
    "b_operand",
    "chunk_scales",
    "chunk_weights",
    "codes_2d",
    "codes_layout",
    "finish_tile",
    "item_at",
    "x_layout",
]

ROWS_PER_WARP = 16  # mma.sync's M: a program's tile is 16 x WARPS weight rows
WORDS = CHUNK // 8  # int32 code words per row and chunk

if GLUON_IMPORT_ERROR is None:
    _CHUNK = gl.constexpr(CHUNK)
    _ROWS_PER_WARP = gl.constexpr(ROWS_PER_WARP)
    _DECODE_PAIRS = """
    shr.u32 r, $8, 4;
    prmt.b32 v0, $8, r, 0x4400; lop3.b32 v0, v0, mask, bias, 0xEA;
    prmt.b32 v1, $8, r, 0x5511; lop3.b32 v1, v1, mask, bias, 0xEA;
    prmt.b32 v2, $8, r, 0x6622; lop3.b32 v2, v2, mask, bias, 0xEA;
    prmt.b32 v3, $8, r, 0x7733; lop3.b32 v3, v3, mask, bias, 0xEA;
    fma.rn.bf16x2 v0, v0, one, nz; fma.rn.bf16x2 v1, v1, one, nz;
    fma.rn.bf16x2 v2, v2, one, nz; fma.rn.bf16x2 v3, v3, one, nz;
    """
    # The native code order (`packing.native_codes`): pair b is nibbles b and b + 4
    # of the word, the word shifted right by 4b and one and-or (no byte permute): 3 shifts and
    # 4 and-ors per word where the canonical order takes a shift, 4 permutes and 4 and-ors.
    _DECODE_PAIRS_NATIVE = """
    lop3.b32 v0, $8, mask, bias, 0xEA;
    shr.u32 r, $8, 4; lop3.b32 v1, r, mask, bias, 0xEA;
    shr.u32 r, $8, 8; lop3.b32 v2, r, mask, bias, 0xEA;
    shr.u32 r, $8, 12; lop3.b32 v3, r, mask, bias, 0xEA;
    fma.rn.bf16x2 v0, v0, one, nz; fma.rn.bf16x2 v1, v1, one, nz;
    fma.rn.bf16x2 v2, v2, one, nz; fma.rn.bf16x2 v3, v3, one, nz;
    """
    # Word $8 -> bytes b = 0..3 as bf16 pairs (128 + low nibble, 128 + high nibble), then
    # (v - (128 + zero)) exactly ($10 = -(128 + zero), bf16); then * scale ($9, bf16).
    _DECODE_BF16 = gl.constexpr(
        "{\n.reg .b32 r, v0, v1, v2, v3, mask, bias, one, nz, s, neg0;\n"
        "mov.b32 mask, 0x000f000f; mov.b32 bias, 0x43004300; mov.b32 one, 0x3f803f80;\n"
        "mov.b32 nz, {$10, $10}; mov.b32 s, {$9, $9}; mov.b32 neg0, 0x80008000;\n"
        + _DECODE_PAIRS
        + "fma.rn.bf16x2 v0, v0, s, neg0; fma.rn.bf16x2 v1, v1, s, neg0;\n"
        "fma.rn.bf16x2 v2, v2, s, neg0; fma.rn.bf16x2 v3, v3, s, neg0;\n"
        "mov.b32 {$0, $1}, v0; mov.b32 {$2, $3}, v1; mov.b32 {$4, $5}, v2; mov.b32 {$6, $7}, v3;\n"
        "}"
    )
    # The pairs (u - z) alone, exact, unscaled ($9 = -(128 + zero), bf16): the wgmma kernel's
    # PROMOTE config multiplies the chunk's fp32 sums by the scale instead (one group a chunk).
    _DECODE_BF16_UNSCALED = gl.constexpr(
        "{\n.reg .b32 r, v0, v1, v2, v3, mask, bias, one, nz;\n"
        "mov.b32 mask, 0x000f000f; mov.b32 bias, 0x43004300; mov.b32 one, 0x3f803f80;\n"
        "mov.b32 nz, {$9, $9};\n" + _DECODE_PAIRS + "mov.b32 {$0, $1}, v0; mov.b32 {$2, $3}, v1;\n"
        "mov.b32 {$4, $5}, v2; mov.b32 {$6, $7}, v3;\n}"
    )
    # The same pairs (u - z) exact, then in fp32: (u - z) * scale + zero ($9 scale, $11 zero,
    # fp32; zero -0.0 for the integer formats), rounded once, converted by cvt.rn to `$CVT`.
    _DECODE_FP32 = (
        "{\n.reg .b32 r, v0, v1, v2, v3, mask, bias, one, nz, lo, hi, hmask;\n"
        "mov.b32 mask, 0x000f000f; mov.b32 bias, 0x43004300; mov.b32 one, 0x3f803f80;\n"
        "mov.b32 nz, {$10, $10}; mov.b32 hmask, 0xffff0000;\n"
        + _DECODE_PAIRS
        + "".join(
            f"shl.b32 lo, v{b}, 16; and.b32 hi, v{b}, hmask;\n"
            f"fma.rn.f32 lo, lo, $9, $11; fma.rn.f32 hi, hi, $9, $11;\n"
            f"cvt.rn.$CVT.f32 v{b}, hi, lo; mov.b32 {{${2 * b}, ${2 * b + 1}}}, v{b};\n"
            for b in range(4)
        )
        + "}"
    )
    _DECODE_FP32_BF16 = gl.constexpr(_DECODE_FP32.replace("$CVT", "bf16x2"))
    _DECODE_FP32_F16 = gl.constexpr(_DECODE_FP32.replace("$CVT", "f16x2"))

    def _with_native_pairs(decode: gl.constexpr) -> gl.constexpr:
        """`decode`'s PTX with the native order's pairs (the rest of it is the same)."""
        assert _DECODE_PAIRS in decode.value  # a changed template must not pass unchanged
        return gl.constexpr(decode.value.replace(_DECODE_PAIRS, _DECODE_PAIRS_NATIVE))

    _DECODE_BF16_NATIVE = _with_native_pairs(_DECODE_BF16)
    _DECODE_BF16_UNSCALED_NATIVE = _with_native_pairs(_DECODE_BF16_UNSCALED)
    _DECODE_FP32_BF16_NATIVE = _with_native_pairs(_DECODE_FP32_BF16)
    _DECODE_FP32_F16_NATIVE = _with_native_pairs(_DECODE_FP32_F16)
    # MXFP4 (e2m1 codes): byte b's two nibbles as above, each placed as bf16 bits
    # s << 15 | (e1 e0 m) << 6 (sign by a shift of 12, the rest by a shift of 6): the value
    # times 2**-126 exactly (0.5 is bf16's subnormal 2**-127); then times 2**126 and times the
    # group's 2**(E - 127), both exact, so the weight is the reference's e2m1 * 2**(E - 127).
    _E2M1_PAIRS = "".join(
        f"prmt.b32 v{b}, $8, r, {sel}; shl.b32 a, v{b}, 6; shl.b32 c, v{b}, 12;\n"
        f"and.b32 a, a, 0x01C001C0; lop3.b32 v{b}, a, c, 0x80008000, 0xF8;\n"
        for b, sel in enumerate(("0x4400", "0x5511", "0x6622", "0x7733"))
    )
    # $9: the group's 2**(E - 127) as bf16 (E = 0: the subnormal 2**-127)
    _DECODE_E2M1_BF16 = gl.constexpr(
        "{\n.reg .b32 r, a, c, v0, v1, v2, v3, s, big, neg0;\n"
        "mov.b32 s, {$9, $9}; mov.b32 big, 0x7E807E80; mov.b32 neg0, 0x80008000;\n"
        "shr.u32 r, $8, 4;\n"
        + _E2M1_PAIRS
        + "".join(
            f"fma.rn.bf16x2 v{b}, v{b}, big, neg0; fma.rn.bf16x2 v{b}, v{b}, s, neg0;\n"
            for b in range(4)
        )
        + "mov.b32 {$0, $1}, v0; mov.b32 {$2, $3}, v1;\n"
        "mov.b32 {$4, $5}, v2; mov.b32 {$6, $7}, v3;\n}"
    )
    # fp16 activations: each half widened to fp32 (value * 2**-126), times 2**126 and the
    # group's 2**(E - 127) ($9, fp32), exact; one rounding by cvt.rn to fp16, as the reference
    _DECODE_E2M1_F16 = gl.constexpr(
        "{\n.reg .b32 r, a, c, v0, v1, v2, v3, lo, hi;\n"
        "shr.u32 r, $8, 4;\n"
        + _E2M1_PAIRS
        + "".join(
            f"shl.b32 lo, v{b}, 16; and.b32 hi, v{b}, 0xffff0000;\n"
            f"mul.rn.f32 lo, lo, 0f7E800000; mul.rn.f32 hi, hi, 0f7E800000;\n"
            f"mul.rn.f32 lo, lo, $9; mul.rn.f32 hi, hi, $9;\n"
            f"cvt.rn.f16x2.f32 v{b}, hi, lo; mov.b32 {{${2 * b}, ${2 * b + 1}}}, v{b};\n"
            for b in range(4)
        )
        + "}"
    )

    @gluon.constexpr_function
    def codes_layout(warps):
        """One chunk's code words [16 warps rows m, 4 t, 4 j]: thread (warp w, lane 4g + t)
        holds words 4t .. 4t + 3 (one 16-byte load) of rows 16w + g and 16w + g + 8."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
            lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
            warp_bases=[[16 << i, 0, 0] for i in range(warps.bit_length() - 1)],
            block_bases=[],
            shape=[16 * warps, 4, 4],
        )

    @gluon.constexpr_function
    def x_layout(block_m, warps):
        """x's 32 columns [block_m tokens n, 32 (8t + e)] of one word j, as thread (g, t) reads
        them: tokens g, g + 8, ..., 8 contiguous columns; every warp holds all of them."""
        tiles = [[8 << i, 0] for i in range(block_m.bit_length() - 4)]
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], *tiles],
            lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[0, 0]] * (warps.bit_length() - 1),
            block_bases=[],
            shape=[block_m, 32],
        )

    @gluon.jit
    def item_at(item, items, tiles, N, M, STEPS: gl.constexpr):
        """Work item `item`'s first row, first chunk, and the rows and tokens that exist (none
        past the last item, so that its copies are empty): one division per item."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        live = item < items
        return (item % tiles) * TILE_ROWS, (item // tiles) * STEPS, N * live, M * live

    @gluon.jit
    def chunk_scales(
        s_ptr,
        z_ptr,
        at,
        step,
        K,
        stride_sn,
        FORMAT: gl.constexpr,
        GROUP: gl.constexpr,
        dtype: gl.constexpr,
    ):
        """The scales and zeros ([rows, 4], [rows, 4]: per row and 32-column run) of chunk
        `step` of the item at `at` (`item_at`): int4's scale and zero; MXFP4's power of two
        (twice); NVFP4's two 16-column scales. Zeros past the rows and K."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        RUNS: gl.constexpr = gl.SliceLayout(2, codes_layout(gl.num_warps()))
        row0, chunk0, n_live, _ = at
        m = gl.arange(0, TILE_ROWS, layout=gl.SliceLayout(1, RUNS))
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, RUNS))
        rows = row0 + m
        col = (chunk0 + step) * _CHUNK + 32 * t
        ok = (rows < n_live)[:, None] & (col < K)[None, :]
        at = rows[:, None] * stride_sn + (col // GROUP)[None, :]
        scale = gl.load(s_ptr + at, mask=ok, other=0)
        if FORMAT == 3:  # MXFP4: the e8m0 byte E, as 2**(E - 127); no zero
            scale = _e8m0_power(scale.to(gl.int32), dtype)
            zero = scale
        elif FORMAT == 4:  # NVFP4: the run's two e4m3 scales (words 0-1, words 2-3)
            second = gl.load(s_ptr + at + 1, mask=ok, other=0)  # e4m3 bytes
            scale = scale.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            zero = second.to(gl.float8e4nv, bitcast=True).to(gl.float32)
            if dtype == gl.bfloat16:  # exact: e4m3 has 4 significant bits
                scale = scale.to(gl.bfloat16)
                zero = zero.to(gl.bfloat16)
        elif FORMAT == 1:  # symmetric: every zero is 8 (not stored)
            zero = gl.full([TILE_ROWS, 4], 8.0, gl.bfloat16, RUNS)
        else:
            zero = gl.load(z_ptr + at, mask=ok, other=0)
        return scale, zero

    @gluon.jit
    def _e8m0_power(e, dtype: gl.constexpr):
        """The e8m0 exponent byte e (int32) as 2**(e - 127) in bf16, or in fp32 for fp16
        activations (their path multiplies in fp32): e = 0 is the subnormal 2**-127, 255 NaN."""
        if dtype == gl.bfloat16:
            bits = gl.where(e == 0, 0x40, gl.where(e == 255, 0x7FC0, e << 7))
            power = bits.to(gl.int16).to(gl.bfloat16, bitcast=True)
        else:
            bits = gl.where(e == 0, 0x400000, gl.where(e == 255, 0x7FC00000, e << 23))
            power = bits.to(gl.float32, bitcast=True)
        return power

    @gluon.jit
    def chunk_weights(
        words,
        scale,
        zero,
        j: gl.constexpr,
        FORMAT: gl.constexpr,
        dtype: gl.constexpr,
        NATIVE: gl.constexpr = False,
        UNSCALED: gl.constexpr = False,
    ):
        """Word j of each thread's runs decoded: the A operand [rows, 32] (logical columns
        32j + 8b + 2t + h of the chunk, see the module docstring), in `dtype`. NATIVE: the
        int4 codes in the native order (`_DECODE_PAIRS_NATIVE`). UNSCALED (int4 / symmetric
        int4, bf16): u - z only, the scale left to the caller (`_DECODE_BF16_UNSCALED`)."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        w = gl.reshape(words, [TILE_ROWS, 4, 2, 2])  # word j = 2 j1 + j0, in registers
        w = gl.split(gl.split(w)[j % 2])[j // 2]  # [rows, 4 runs]
        scale = gl.convert_layout(scale, w.type.layout, assert_trivial=True)  # the same
        zero = gl.convert_layout(zero, w.type.layout, assert_trivial=True)  # registers
        if FORMAT >= 3:  # MXFP4: the group's power of two; NVFP4: its e4m3 scale (exact)
            if FORMAT == 4 and j >= 2:  # NVFP4: words 2-3 are the run's second group
                scale = zero
            if dtype == gl.bfloat16:
                p = gl.inline_asm_elementwise(
                    _DECODE_E2M1_BF16,
                    "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                    [w, scale],
                    dtype=(gl.bfloat16,) * 8,
                    is_pure=True,
                    pack=1,
                )
            else:
                p = gl.inline_asm_elementwise(
                    _DECODE_E2M1_F16,
                    "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
                    [w, scale],
                    dtype=(gl.float16,) * 8,
                    is_pure=True,
                    pack=1,
                )
        else:
            p = _int4_planes(w, scale, zero, FORMAT, dtype, NATIVE, UNSCALED)
        return _fragments(p)

    @gluon.jit
    def _int4_planes(
        w,
        scale,
        zero,
        FORMAT: gl.constexpr,
        dtype: gl.constexpr,
        NATIVE: gl.constexpr,
        UNSCALED: gl.constexpr = False,
    ):
        """The int4 formats' 8 planes of word w (`_DECODE_BF16`, `_DECODE_FP32`; UNSCALED:
        `_DECODE_BF16_UNSCALED`)."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        if FORMAT == 2:  # float zero point: (u - 8) * s + zero
            neg_c = gl.full([TILE_ROWS, 4], -136.0, gl.bfloat16, w.type.layout)
        else:
            neg_c = (-(zero.to(gl.float32) + 128.0)).to(gl.bfloat16)  # exact: 8-bit integers
        if UNSCALED:
            gl.static_assert(
                dtype == gl.bfloat16 and FORMAT != 2,
                "unscaled planes: the integer int4 formats, bf16",
            )
            p = gl.inline_asm_elementwise(
                _DECODE_BF16_UNSCALED_NATIVE if NATIVE else _DECODE_BF16_UNSCALED,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h",
                [w, neg_c],
                dtype=(gl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
        elif dtype == gl.bfloat16 and FORMAT != 2:
            p = gl.inline_asm_elementwise(
                _DECODE_BF16_NATIVE if NATIVE else _DECODE_BF16,
                "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h",
                [w, scale, neg_c],
                dtype=(gl.bfloat16,) * 8,
                is_pure=True,
                pack=1,
            )
        else:
            if FORMAT == 2:
                add = zero.to(gl.float32)
            else:
                add = gl.full([TILE_ROWS, 4], -0.0, gl.float32, w.type.layout)
            args = [w, scale.to(gl.float32), neg_c, add]
            if dtype == gl.bfloat16:
                p = gl.inline_asm_elementwise(
                    _DECODE_FP32_BF16_NATIVE if NATIVE else _DECODE_FP32_BF16,
                    "=h,=h,=h,=h,=h,=h,=h,=h,r,r,h,r",
                    args,
                    dtype=(gl.bfloat16,) * 8,
                    is_pure=True,
                    pack=1,
                )
            else:
                p = gl.inline_asm_elementwise(
                    _DECODE_FP32_F16_NATIVE if NATIVE else _DECODE_FP32_F16,
                    "=h,=h,=h,=h,=h,=h,=h,=h,r,r,h,r",
                    args,
                    dtype=(gl.float16,) * 8,
                    is_pure=True,
                    pack=1,
                )
        return p

    @gluon.jit
    def _fragments(p):
        """The 8 decoded planes p[2b + h] ([rows, 4 t] each) as the A operand [rows, 32]: a
        relabelling, [m, 4 t, 2 h, 2 b0, 2 b1] -> [m, b1, b0, t, h] (no data moves)."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        a = gl.join(
            gl.join(gl.join(p[0], p[1]), gl.join(p[2], p[3])),
            gl.join(gl.join(p[4], p[5]), gl.join(p[6], p[7])),
        )
        return gl.reshape(gl.permute(a, [0, 4, 3, 1, 2]), [TILE_ROWS, 32])

    @gluon.jit
    def b_operand(x, BLOCK_M: gl.constexpr):
        """x's 32 columns of a word j [BLOCK_M, 32 at 8t + e] (e = 4 s0 + 2 c8 + h), as the B
        operand [32 logical columns 16 s0 + 8 c8 + 2t + h, BLOCK_M] (a relabelling)."""
        x = gl.reshape(x, [BLOCK_M, 4, 2, 2, 2])  # n, t, s0, c8, h
        return gl.reshape(gl.permute(x, [2, 3, 1, 4, 0]), [32, BLOCK_M])

    @gluon.jit
    def _store_tile(
        acc, bias_ptr, out_ptr, tile, M, N, times, HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr
    ):
        """out[n, rows] = acc^T * times + bias (fp32), cast to out's dtype (`times`: NVFP4's
        global scale, which its decoded weights leave out, as the Triton kernels do; else 1)."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        # rows fastest
        OUT: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [1, gl.num_warps()], [0, 1])
        acc = gl.convert_layout(acc, OUT) * times
        rows = tile * TILE_ROWS + gl.arange(0, TILE_ROWS, layout=gl.SliceLayout(1, OUT))
        toks = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, OUT))
        store_transposed(acc, bias_ptr, out_ptr, rows, toks, M, N, HAS_BIAS)

    @gluon.jit
    def finish_tile(
        acc,
        part_ptr,
        cnt_ptr,
        bias_ptr,
        out_ptr,
        tile,
        split,
        splits,
        M,
        N,
        times,
        HAS_BIAS: gl.constexpr,
        SPLIT: gl.constexpr,
        BLOCK_M: gl.constexpr,
    ):
        """Write the tile, or store this split's partial sums and, if this program is the
        tile's last to arrive, write their sum in split order (split_k.py's scheme)."""
        TILE_ROWS: gl.constexpr = _ROWS_PER_WARP * gl.num_warps()
        if SPLIT:
            MMA: gl.constexpr = acc.type.layout
            rows = tile * TILE_ROWS + gl.arange(0, TILE_ROWS, layout=gl.SliceLayout(1, MMA))
            toks = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
            mask = (rows < N)[:, None] & (toks < M)[None, :]
            at = toks[None, :] * N + rows[:, None]
            gl.store(part_ptr + split * M * N + at, acc, mask=mask)
            barrier()  # every thread's partial sums are stored before the program counts
            arrived = gl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if arrived == splits - 1:
                total = gl.zeros([TILE_ROWS, BLOCK_M], gl.float32, MMA)
                for sp in range(splits):
                    total += gl.load(
                        part_ptr + sp * M * N + at, mask=mask, other=0.0, cache_modifier=".cg"
                    )
                _store_tile(total, bias_ptr, out_ptr, tile, M, N, times, HAS_BIAS, BLOCK_M)
        else:
            _store_tile(acc, bias_ptr, out_ptr, tile, M, N, times, HAS_BIAS, BLOCK_M)

    @gluon.constexpr_function
    def codes_2d(warps):
        """`codes_layout` on the slot's [rows, 16 words]: thread (warp w, lane 4g + t) holds
        words 4t .. 4t + 3 of rows 16w + g and 16w + g + 8."""
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [8, 0]],
            lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16 << i, 0] for i in range(warps.bit_length() - 1)],
            block_bases=[],
            shape=[16 * warps, 16],
        )
