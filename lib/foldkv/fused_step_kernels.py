"""The Triton kernels of `foldkv.fused_step_ops` and `foldkv.global_step` (defined where Triton is installed); a PDL
link takes a constexpr GDC (`_chain`), its outputs bitwise the plain launch's."""

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton: nothing here, and nothing imports these names
    triton = None

if triton is not None:
    try:  # Triton's grid dependency control (triton-lang/triton PR 6394)
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:  # an older Triton: GDC is never set (foldkv.gemv.HAS_GDC is False); these keep _chain valid

        @triton.jit
        def gdc_wait():
            pass

        @triton.jit
        def gdc_launch_dependents():
            pass

    @triton.jit
    def _chain(GDC: tl.constexpr):
        """A PDL-launched kernel's entry (GDC): its dependents may launch now (they wait in turn), then it waits for
        the kernel ahead to complete and its writes to be visible. Nothing for a plain launch (GDC False)."""
        if GDC:
            gdc_launch_dependents()
            gdc_wait()

    @triton.jit
    def _rounded(x, OUT: tl.constexpr):
        """float32 x rounded to OUT's precision and back to float32, to nearest even, as torch rounds a bf16 op's
        result. Done on the bits for bf16: the compiler may fold a bf16 round trip of an intermediate away."""
        if OUT == tl.bfloat16:
            u = x.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            return u.to(tl.float32, bitcast=True)
        elif OUT == tl.float32:
            return x
        else:
            return x.to(OUT).to(tl.float32)

    @triton.jit
    def _inverse_rms(x, n, eps):
        """(mean(x^2) + eps)^-0.5 of a float32 row x of n columns: every norm's one reduction here."""
        return 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n + eps)

    @triton.jit
    def _normed(x, w_ptr, cols, keep, n, eps, HAS_WEIGHT: tl.constexpr):
        """x (float32 row) * (mean(x^2) + eps)^-0.5 [* weight], float32."""
        y = x * _inverse_rms(x, n, eps)
        if HAS_WEIGHT:
            y = y * tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def rms_norm_rows(x_ptr, w_ptr, y_ptr, n, inner_rows, outer_stride, eps, HAS_WEIGHT: tl.constexpr,
                      BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        """Row r of x at (r // inner_rows) * outer_stride + (r % inner_rows) * n (a [outer, inner_rows, n] view whose
        inner rows are packed: a head-split slice of a merged projection's output); y [rows, n] packed."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < n
        at = (row // inner_rows) * outer_stride + (row % inner_rows) * n
        x = tl.load(x_ptr + at + cols, mask=keep, other=0.0).to(tl.float32)
        y = _normed(x, w_ptr, cols, keep, n, eps, HAS_WEIGHT)
        tl.store(y_ptr + row * n + cols, _rounded(y, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=keep)

    @triton.jit
    def norm_add_rows(x_ptr, res_ptr, w1_ptr, w2_ptr, h_ptr, y_ptr, scalar_ptr, n, eps1, eps2, part_stride,
                      HAS_W1: tl.constexpr, HAS_W2: tl.constexpr, SECOND: tl.constexpr, SCALE: tl.constexpr,
                      BLOCK: tl.constexpr, PARTS: tl.constexpr = 0, GDC: tl.constexpr = False):
        """h = round(res + round(norm1(x))); SCALE: h = round(h * scalar); SECOND: y = round(norm2(h)). PARTS > 0: x
        is the sum of PARTS float32 partials part_stride apart (a split GEMM's [PARTS, rows, n] workspace), added in
        the order 0, 1, ... and rounded once to h's dtype: gemv.split_sum's arithmetic, so the same x."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < n
        out_ty = h_ptr.dtype.element_ty
        if PARTS > 0:
            x = tl.load(x_ptr + row * n + cols, mask=keep, other=0.0)
            for s in tl.static_range(1, PARTS):
                x += tl.load(x_ptr + s * part_stride + row * n + cols, mask=keep, other=0.0)
            x = _rounded(x, out_ty)
        else:
            x = tl.load(x_ptr + row * n + cols, mask=keep, other=0.0).to(tl.float32)
        a = _rounded(_normed(x, w1_ptr, cols, keep, n, eps1, HAS_W1), out_ty)
        r = tl.load(res_ptr + row * n + cols, mask=keep, other=0.0).to(tl.float32)
        h = _rounded(r + a, out_ty)
        if SCALE:
            h = _rounded(h * tl.load(scalar_ptr).to(tl.float32), out_ty)
        tl.store(h_ptr + row * n + cols, h.to(out_ty), mask=keep)
        if SECOND:
            y = _normed(h, w2_ptr, cols, keep, n, eps2, HAS_W2)
            tl.store(y_ptr + row * n + cols, _rounded(y, out_ty).to(out_ty), mask=keep)

    @triton.jit
    def rope_rows(x_ptr, cos_ptr, sin_ptr, y_ptr, heads, D: tl.constexpr, GDC: tl.constexpr = False):
        """Row r of x [rows, D] (rows = B*T*heads) with cos/sin row r // heads: x*cos + rotate_half(x)*sin."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, D)
        half: tl.constexpr = D // 2
        x = tl.load(x_ptr + row * D + cols).to(tl.float32)
        partner = tl.load(x_ptr + row * D + (cols + half) % D).to(tl.float32)
        rot = tl.where(cols < half, -partner, partner)
        at = (row // heads) * D + cols
        c = tl.load(cos_ptr + at).to(tl.float32)
        s = tl.load(sin_ptr + at).to(tl.float32)
        out_ty = y_ptr.dtype.element_ty
        y = _rounded(_rounded(x * c, out_ty) + _rounded(rot * s, out_ty), out_ty)
        tl.store(y_ptr + row * D + cols, y.to(out_ty))

    @triton.jit
    def gelu_mul_rows(g_ptr, u_ptr, y_ptr, n, g_stride, u_stride, BLOCK: tl.constexpr, GDC: tl.constexpr = False):
        """round(round(gelu_tanh(g)) * u): torch's tanh GELU (0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))); row
        program_id(0) of g and u at its own row stride (the halves of a merged gate|up output), y [rows, n] packed."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        at = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = at < n
        out_ty = y_ptr.dtype.element_ty
        g = tl.load(g_ptr + row * g_stride + at, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_stride + at, mask=keep, other=0.0).to(tl.float32)
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0  # tanh(inner), saturating to +-1 without overflow
        act = _rounded(0.5 * g * (1.0 + t), out_ty)
        tl.store(y_ptr + row * n + at, _rounded(act * u, out_ty).to(out_ty), mask=keep)

    @triton.jit
    def masked_softmax_rows(s_ptr, m_ptr, p_ptr, n, rows_per_mask, BLOCK: tl.constexpr,
                            GDC: tl.constexpr = False):
        """Row r of scores [rows, n]: softmax over the columns whose mask (row r // rows_per_mask) is True, float32."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < n
        live = tl.load(m_ptr + (row // rows_per_mask) * n + cols, mask=keep, other=0) != 0
        s = tl.load(s_ptr + row * n + cols, mask=keep, other=0.0).to(tl.float32)
        s = tl.where(live & keep, s, float("-inf"))
        e = tl.exp(s - tl.max(s, axis=0))
        p = e / tl.sum(e, axis=0)
        tl.store(p_ptr + row * n + cols, _rounded(p, p_ptr.dtype.element_ty).to(p_ptr.dtype.element_ty), mask=keep)

    # --- a sliding layer's decode step before its ring attention: the query's and the ring's kernels ---------------
    @triton.jit
    def _roped_at(x_ptr, w_ptr, cos_ptr, sin_ptr, c, inv, OUT: tl.constexpr, D: tl.constexpr):
        """Column(s) c of RoPE(norm(x)) for the head row at x_ptr whose inverse RMS is inv: the norm x * inv * w
        rounded once (rms_norm_rows' formula), then rope_rows' three roundings against the cos/sin row; float32 values
        of OUT precision. The partner column (c + D/2) mod D is normed from its own load (the same per-element
        formula), so any column set is bitwise the two kernels' at those columns."""
        half: tl.constexpr = D // 2
        p = (c + half) % D
        y = _rounded(tl.load(x_ptr + c).to(tl.float32) * inv * tl.load(w_ptr + c).to(tl.float32), OUT)
        yp = _rounded(tl.load(x_ptr + p).to(tl.float32) * inv * tl.load(w_ptr + p).to(tl.float32), OUT)
        rot = tl.where(c < half, -yp, yp)
        cs = tl.load(cos_ptr + c).to(tl.float32)
        sn = tl.load(sin_ptr + c).to(tl.float32)
        return _rounded(_rounded(y * cs, OUT) + _rounded(rot * sn, OUT), OUT)

    @triton.jit
    def _inverse_norm(base, n, eps, D: tl.constexpr):
        """The inverse RMS of the head row at base, reduced over the row loaded in its natural order (rms_norm_rows'
        reduction)."""
        return _inverse_rms(tl.load(base + tl.arange(0, D)).to(tl.float32), n, eps)

    @triton.jit
    def _norm_rope(x_ptr, w_ptr, cos_ptr, sin_ptr, n, eps, OUT: tl.constexpr, D: tl.constexpr):
        """One head row at x_ptr: RMSNorm with weight (`_inverse_norm`), then RoPE: `_roped_at` of every column,
        bitwise the two kernels."""
        return _roped_at(x_ptr, w_ptr, cos_ptr, sin_ptr, tl.arange(0, D), _inverse_norm(x_ptr, n, eps, D), OUT, D)

    @triton.jit
    def _q_row(row, x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, heads, x_stride, n, eps, D: tl.constexpr):
        """Query row `row` = (b, h): RoPE(q_norm(x)) from x at b * x_stride + h * D into y [B * heads, D] packed."""
        b = row // heads
        at = b * x_stride + (row % heads) * D
        out_ty = y_ptr.dtype.element_ty
        y = _norm_rope(x_ptr + at, w_ptr, cos_ptr + b * D, sin_ptr + b * D, n, eps, out_ty, D)
        tl.store(y_ptr + row * D + tl.arange(0, D), y.to(out_ty))

    @triton.jit
    def _kv_row(row, k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, ring_k_ptr, ring_v_ptr, slot_ptr, heads, k_stride,
                v_stride, window, n, eps_k, eps_v, D: tl.constexpr):
        """KV head row `row` = (b, h): RoPE(k_norm(k)) into ring_k[b, h, slot], v_norm(v) into ring_v[b, h, slot]."""
        b = row // heads
        h = row % heads
        cols = tl.arange(0, D)
        slot = tl.load(slot_ptr).to(tl.int64)
        dst = (row * window + slot) * D + cols
        out_ty = ring_k_ptr.dtype.element_ty
        k = _norm_rope(k_ptr + b * k_stride + h * D, w_ptr, cos_ptr + b * D, sin_ptr + b * D, n, eps_k, out_ty, D)
        tl.store(ring_k_ptr + dst, k.to(out_ty))
        v = tl.load(v_ptr + b * v_stride + h * D + cols).to(tl.float32)
        v = _normed(v, w_ptr, cols, cols < D, n, eps_v, False)  # v_norm has no weight: w_ptr is not read
        tl.store(ring_v_ptr + dst, _rounded(v, out_ty).to(out_ty))

    @triton.jit
    def q_norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, heads, x_stride, n, eps, D: tl.constexpr,
                         GDC: tl.constexpr = False):
        """Row r = (b, h) of the query: x at b * x_stride + h * D (a merged q|k|v output's q columns, read in place),
        cos/sin [B, D] row b; y [B * heads, D] packed: RoPE(q_norm(x))."""
        _chain(GDC)
        _q_row(tl.program_id(0).to(tl.int64), x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, heads, x_stride, n, eps, D)

    @triton.jit
    def sliding_prologue_rows(x_ptr, q_w_ptr, q_cos_ptr, q_sin_ptr, y_ptr, q_heads, x_stride, q_n, q_eps,
                              k_ptr, v_ptr, k_w_ptr, k_cos_ptr, k_sin_ptr, ring_k_ptr, ring_v_ptr, slot_ptr, kv_heads,
                              k_stride, v_stride, window, kv_n, eps_k, eps_v, q_rows, D: tl.constexpr,
                              GDC: tl.constexpr = False):
        """A sliding layer's prologue in one launch: program r < q_rows is query row r (`q_norm_rope_rows`' body),
        the others KV row r - q_rows (`_kv_row`): the two row kinds run side by side, not one kernel after the
        other."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        if row < q_rows:
            _q_row(row, x_ptr, q_w_ptr, q_cos_ptr, q_sin_ptr, y_ptr, q_heads, x_stride, q_n, q_eps, D)
        else:
            _kv_row(row - q_rows, k_ptr, v_ptr, k_w_ptr, k_cos_ptr, k_sin_ptr, ring_k_ptr, ring_v_ptr, slot_ptr,
                    kv_heads, k_stride, v_stride, window, kv_n, eps_k, eps_v, D)

    # --- a global layer's decode step after its norms and RoPE: the format's query and the page row ---------------
    @triton.jit
    def _store_row(pool_ptr, scales_ptr, slot, x, j, keep, WIDTH: tl.constexpr, QUANTIZED: tl.constexpr):
        """A page row's values x [BLOCK] (columns j, those past WIDTH masked off by keep) at pool row `slot` (pool
        [.., WIDTH] packed), in the pool's dtype. QUANTIZED (an FP8 pool): `foldkv.fp8.quantize_rows`' arithmetic, the
        row's float32 scale at scales[slot]: scale = amax / 448 (1 for a row of zeros), x / scale clamped to +-448,
        then e4m3 to nearest (cvt.rn); both divisions correctly rounded (div_rn), as torch's tensor divisions are."""
        out_ty = pool_ptr.dtype.element_ty
        if QUANTIZED:
            x = x.to(tl.float32)
            amax = tl.max(tl.where(keep, tl.abs(x), 0.0), axis=0)
            scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
            x = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
            tl.store(scales_ptr + slot, scale)
        tl.store(pool_ptr + slot * WIDTH + j, x.to(out_ty), mask=keep)

    @triton.jit
    def global_query_rows(q_ptr, w_ptr, cols_ptr, out_ptr, heads, q_sb, q_sh, q_sd, D: tl.constexpr,
                          BLOCK: tl.constexpr, FOLD_FROM: tl.constexpr, FOLDED: tl.constexpr):
        """Row (b, h) = program_id(0) of the format's query into out [rows, D] packed: column j holds the head
        column cols[j] of q [B, heads, 1, D] (strides q_sb, q_sh, q_sd); FOLDED, columns j >= FOLD_FROM are
        fp32(q) * fp32(w[cols[j]]) rounded once to out's dtype (fold_query's arithmetic)."""
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        h = row % heads
        j = tl.arange(0, BLOCK)
        keep = j < D
        src = tl.load(cols_ptr + j, mask=keep, other=0).to(tl.int64)
        x = tl.load(q_ptr + b * q_sb + h * q_sh + src * q_sd, mask=keep, other=0.0).to(tl.float32)
        if FOLDED:
            w = tl.load(w_ptr + src, mask=keep, other=0.0).to(tl.float32)
            x = tl.where(j >= FOLD_FROM, x * w, x)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * D + j, _rounded(x, out_ty).to(out_ty), mask=keep)

    @triton.jit
    def global_row_store(k_ptr, v_ptr, cols_ptr, pages_ptr, offsets_ptr, pool_ptr, scales_ptr, heads, page_size,
                         k_sb, k_sh, k_sd, v_sb, v_sh, v_sd, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                         KEY_COLS: tl.constexpr, QUANTIZED: tl.constexpr):
        """Row (b, h) = program_id(0): column j < KEY_COLS is key[b, h, 0, cols[j]], the others value[b, h, 0,
        cols[j]] (key/value [B, heads, 1, D] strided; a bf16 pool's dtype: moved, not converted), stored at
        pool[pages[b], h, offsets[b], j] (pool [pages, heads, page_size, WIDTH] packed; pages/offsets int64 read on
        the device); QUANTIZED, as e4m3 with its scale at scales[pages[b], h, offsets[b]] (`_store_row`). Nothing
        else is written."""
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        h = row % heads
        j = tl.arange(0, BLOCK)
        keep = j < WIDTH
        is_key = j < KEY_COLS
        src = tl.load(cols_ptr + j, mask=keep, other=0).to(tl.int64)
        kx = tl.load(k_ptr + b * k_sb + h * k_sh + src * k_sd, mask=keep & is_key, other=0.0)
        vx = tl.load(v_ptr + b * v_sb + h * v_sh + src * v_sd, mask=keep & (j >= KEY_COLS), other=0.0)
        x = tl.where(is_key, kx, vx)
        page = tl.load(pages_ptr + b).to(tl.int64)
        offset = tl.load(offsets_ptr + b).to(tl.int64)
        _store_row(pool_ptr, scales_ptr, (page * heads + h) * page_size + offset, x, j, keep, WIDTH, QUANTIZED)

    # --- a global layer's decode step from its projections' outputs: the norms and RoPE inside the two kernels above
    @triton.jit
    def global_query_prologue(q_ptr, w_ptr, cos_ptr, sin_ptr, wk_ptr, cols_ptr, out_ptr, heads, q_stride, n, eps,
                              D: tl.constexpr, FOLD_FROM: tl.constexpr, FOLDED: tl.constexpr,
                              GDC: tl.constexpr = False):
        """Row (b, h): the format's query of RoPE(q_norm(q)) (q at b * q_stride + h * D, read in place) into out
        [rows, D] packed: column j is head column cols[j] (`_roped_at`: rms_norm_rows' and rope_rows' roundings);
        FOLDED, columns j >= FOLD_FROM times w_k, rounded once to out's dtype (`global_query_rows`' arithmetic)."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        base = q_ptr + b * q_stride + (row % heads) * D
        inv = _inverse_norm(base, n, eps, D)
        j = tl.arange(0, D)
        c = tl.load(cols_ptr + j).to(tl.int64)
        x = _roped_at(base, w_ptr, cos_ptr + b * D, sin_ptr + b * D, c, inv, cos_ptr.dtype.element_ty, D)
        if FOLDED:
            x = tl.where(j >= FOLD_FROM, x * tl.load(wk_ptr + c).to(tl.float32), x)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * D + j, _rounded(x, out_ty).to(out_ty))

    @triton.jit
    def global_row_prologue(k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, cols_ptr, pages_ptr, offsets_ptr, pool_ptr,
                            scales_ptr, heads, page_size, k_stride, v_stride, n, eps_k, eps_v, D: tl.constexpr,
                            WIDTH: tl.constexpr, BLOCK: tl.constexpr, KEY_COLS: tl.constexpr, QUANTIZED: tl.constexpr,
                            GDC: tl.constexpr = False):
        """Row (b, h): column j < KEY_COLS is RoPE(k_norm(k))[cols[j]], the others v_norm(v)[cols[j]] (no weight), each
        rounded to the model's dtype (cos's), stored at pool[pages[b], h, offsets[b], j] (`global_row_store`'s
        addressing; QUANTIZED, as e4m3 with its scale, `_store_row`); nothing else is written."""
        _chain(GDC)
        model_ty = cos_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        h = row % heads
        k_base = k_ptr + b * k_stride + h * D
        v_base = v_ptr + b * v_stride + h * D
        inv_k = _inverse_norm(k_base, n, eps_k, D)
        inv_v = _inverse_norm(v_base, n, eps_v, D)
        j = tl.arange(0, BLOCK)
        keep = j < WIDTH
        c = tl.load(cols_ptr + j, mask=keep, other=0).to(tl.int64)
        key = _roped_at(k_base, w_ptr, cos_ptr + b * D, sin_ptr + b * D, c, inv_k, model_ty, D)
        value = _rounded(tl.load(v_base + c).to(tl.float32) * inv_v, model_ty)
        x = tl.where(j < KEY_COLS, key, value)
        page = tl.load(pages_ptr + b).to(tl.int64)
        offset = tl.load(offsets_ptr + b).to(tl.int64)
        _store_row(pool_ptr, scales_ptr, (page * heads + h) * page_size + offset, x, j, keep, WIDTH, QUANTIZED)
