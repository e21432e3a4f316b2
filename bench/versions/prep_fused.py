"""The fused GPU prep as one TileLang kernel: q/k RMSNorm, v-norm, proportional RoPE on the rotated columns, the w_k
fold, and the row store. Not served: the runtime folds and stores through `foldkv.global_step.fold_and_store` (its
Triton pair, held to the torch definition `foldkv.prep.fold_and_store`), the one kernel path of prefill, eager decode
and the step; this kernel was the fused prep before it, and stays here as the prefill harness's fused-prep arm.

What it tried (bench/PREFILL_NOTES.md, "Fused prep"): one CTA per (token, head row), 128 threads each owning two
rotate_half pairs, bit agreement with the torch prep but for the RMSNorm sum order.
Prediction: ~200 us for an 8,192-token chunk against 3-5 ms for the torch prep.
Measured (H200): 1.06-1.35 ms fused against 5.4-7.1 ms torch, missed by 6x (launch and scheduling bound: 295k CTAs
of 2 elements a thread, 2-byte scalar stores); its agreement counts are in PREFILL_NOTES.md's gate table.
Check it: `FOLDKV_REQUIRE_GPU=1 python -m pytest -m gpu tests/test_prep_kernel_gpu.py` (against the torch prep);
time it: `python bench/prefill_harness.py` (`time_prep`). Built through TileLang's JIT only (no registry entry, no
AOT kernel).


`prep_and_store_gpu` does on the GPU, in one launch, what `foldkv.prep_and_store` does in torch: for T tokens (a
prefill chunk, or one decode token per request) it writes each token's page row (either format) into its page and
returns the query in the pool format's form. Same semantics, same checks, pool unchanged on a refusal.

Agreement with the torch prep (measured counts in bench/PREFILL_NOTES.md): every product and sum of the RoPE is done
with IEEE round-to-nearest intrinsics in the torch order (x*cos, rot*sin, then the add: no FMA contraction), the
angles use the same float32 inverse-frequency table and the same libdevice cosf/sinf, and 1/sqrt is `rsqrtf` as
torch's CUDA pow(x, -0.5) uses. The one place the float order differs is the sum of squares of the RMSNorm (a tree
over 128 threads instead of torch's reduction order): the mean, hence the norm scale, can differ in its last float32
bits. Where that moves a value across a bf16 rounding boundary the element differs; the bound is
|got - want| <= 2^-7 |want| + 2^-16 max|row| (one bf16 ulp, plus an absolute term for RoPE's a*c - b*s near 0, where
a last-bit change of the scale is many ulps of a tiny result). Measured: ~5e-6 of the elements differ.

An FP8 (e4m3) folded pool ("prep_folded_fp8", the same builder with its fp8 flag) gets the same float32 row,
quantized as `foldkv.fp8.quantize_rows` defines it: the row's amax over its 640 columns (a block-wide max over the 128
threads: exact, in any order), scale = amax / 448 by IEEE division (1 for a row of zeros), each element x / scale by
IEEE division (`__fdiv_rn`, as torch divides two tensors; not x * (1/scale), which can differ in the last bit),
clamped to +-448 and cast to e4m3 by `cvt.rn.satfinite.e4m3x2.f32` (round to nearest even: CUTLASS's float_e4m3_t
from float on sm_90, read in the PTX). So the one difference from the torch prep is still the RMSNorm sum order, now
seen through the quantization: the scale can differ in its last float32 bits, and an element whose x / scale sits
within that difference of an e4m3 rounding boundary lands on the neighbouring code (the derived bounds are in
tests/test_prep_kernel_gpu.py).

Kernel argument order (what the launcher passes):
  Qraw [T, 32, 512] (in dtype), KVraw [T, 4, 512] (in dtype), QNormW [512] f32, KNormW [512] f32,
  InvFreq [256] f32, Positions [T] int32, SlotPage [T] int32, SlotOffset [T] int32,
  Pool [P, 4, page, row_width] bf16 (written), QueryOut [T, 32, 512] bf16
The FP8 variant: Pool [P, 4, page, 640] float8_e4m3 (written), then PoolScales [P, 4, page] f32 (written), then
QueryOut (still bf16); the other arguments as above.
Grid (T, 32 + 4): block y < 32 preps query head y, block y >= 32 preps and stores KV head y - 32; 128 threads, each
owning two rotate_half pairs (d, d + 256).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

import functools

import torch

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.fp8 import E4M3_MAX, FP8_DTYPE, check_finite_rows
from foldkv.kernels import registry
from foldkv.kernels.decode import pool_operands
from foldkv.kernels.tl import pass_configs, prim_func, require_tilelang, target
from foldkv.layout import KvFormat
from foldkv.pool import BlockTable, PagedKvPool
from foldkv.prep import check_prep_and_store, rope_inv_freq
from foldkv.validate import FoldKvInputError, check_tensor

_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def rope_pair(lo, hi, ang):
    """RoPE of one rotate_half pair (x[d], x[d + D/2]) at angle `ang`: (lo cos - hi sin, hi cos + lo sin), each product
    and sum an IEEE round-to-nearest intrinsic in torch's order (no FMA contraction), so the kernel rounds as the
    torch prep does. An expression builder (not a macro): the pair's variables keep their names."""
    import tilelang.language as T

    c = T.cos(ang)
    s = T.sin(ang)
    return (T.ieee_add(T.ieee_mul(lo, c), T.ieee_mul(-hi, s)), T.ieee_add(T.ieee_mul(hi, c), T.ieee_mul(lo, s)))


def _check_geometry(geom: AttentionGeometry) -> None:
    if geom.rotary_pairs * 2 > geom.head_dim // 2 or geom.head_dim % 256:
        raise NotImplementedError(f"prep kernel needs head_dim a multiple of 256 and rotary pairs <= D/4; got {geom}")


@registry.hands_out("prep_{fmt}")
def build(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, *, page_size: int = 64,
          in_dtype: str = "bfloat16", threads: int = 128, arch: str | None = None):
    """Compile (JIT) the fused prep for one bf16 pool format; returns a TileLang kernel taking the arguments above."""
    return _build(geom, fmt, page_size, in_dtype, threads, arch, fp8=False)


@registry.hands_out("prep_{fmt}_fp8")
def build_fp8(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, *, page_size: int = 64,
              in_dtype: str = "bfloat16", threads: int = 128, arch: str | None = None):
    """Compile (JIT) the fused prep for an FP8 (e4m3) folded pool: the same prep, each stored row quantized as
    `foldkv.fp8.quantize_rows` does; the kernel takes PoolScales right after Pool (module docstring)."""
    return _build(geom, fmt, page_size, in_dtype, threads, arch, fp8=True)


def _build(geom: AttentionGeometry, fmt: KvFormat | str, page_size: int, in_dtype: str, threads: int,
           arch: str | None, fp8: bool):
    _check_geometry(geom)
    fmt = KvFormat.parse(fmt)
    if fp8 and fmt is not KvFormat.FOLDED:
        raise NotImplementedError(f"an FP8 pool holds folded rows only (foldkv.fp8); asked for {fmt.value}")
    tilelang = require_tilelang()
    import tilelang.language as T

    D = geom.head_dim
    HALF = D // 2  # rotate_half pairs (d, d + HALF)
    PAIRS = geom.rotary_pairs  # pairs with a non-zero frequency (64): d < PAIRS
    R = 2 * PAIRS
    HQ, HKV = geom.num_q_heads, geom.num_kv_heads
    W = 2 * D if fmt is KvFormat.SPLIT else D + R
    EPS = float(geom.rms_norm_eps)
    folded = fmt is KvFormat.FOLDED
    out_dtype, f32 = "bfloat16", "float32"
    pool_dtype = "float8_e4m3" if fp8 else out_dtype  # TileLang's e4m3 is torch's float8_e4m3fn

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def prep_fused(page_size, in_dtype, threads):
        NT, NP = T.dynamic("NT, NP")

        @T.macro
        def normed_pair(Src, t, h, x_lo, x_hi, sq, ss):
            # row Src[t, h, :] as float32 pairs (d, d + HALF); ss[0] = (mean(x^2) + eps)^-0.5
            for z, j in T.Parallel(1, HALF):
                x_lo[z, j] = T.cast(Src[t, h, j], f32)
                x_hi[z, j] = T.cast(Src[t, h, j + HALF], f32)
                sq[z, j] = x_lo[z, j] * x_lo[z, j] + x_hi[z, j] * x_hi[z, j]
            T.reduce_sum(sq, ss, dim=1)
            for z in T.Parallel(1):
                ss[z] = T.rsqrt(ss[z] * T.float32(1.0 / D) + T.float32(EPS))

        def e4m3(x, scale):
            # foldkv.fp8.quantize_rows: x / scale as an IEEE round-to-nearest division (__fdiv_rn, not x * (1/scale),
            # so it equals torch's `x / scale` bit for bit), clamped to +-448, cast to e4m3 rounding to nearest even
            y = T.ieee_fdiv(x, scale)
            return T.cast(T.min(T.max(y, T.float32(-E4M3_MAX)), T.float32(E4M3_MAX)), pool_dtype)

        @T.macro
        def prep(Qraw, KVraw, QNormW, KNormW, InvFreq, Positions, SlotPage, SlotOffset, Pool, PoolScales, QueryOut):
            with T.Kernel(NT, HQ + HKV, threads=threads) as (bt, bh):
                x_lo = T.alloc_fragment([1, HALF], f32)
                x_hi = T.alloc_fragment([1, HALF], f32)
                sq = T.alloc_fragment([1, HALF], f32)
                ss = T.alloc_fragment([1], f32)
                if fp8:  # the FP8 row is kept in float32 until its scale is known
                    rot_lo = T.alloc_fragment([1, HALF], f32)  # RoPE'd K, pairs d < PAIRS (the rest unused)
                    rot_hi = T.alloc_fragment([1, HALF], f32)
                    abs_max = T.alloc_fragment([1, HALF], f32)  # per thread: max |x| over the row elements it owns
                    scale = T.alloc_fragment([1], f32)
                pos = T.cast(Positions[bt], f32)
                if bh < HQ:
                    normed_pair(Qraw, bt, bh, x_lo, x_hi, sq, ss)
                    for z, j in T.Parallel(1, HALF):
                        qn_lo = T.ieee_mul(T.ieee_mul(x_lo[z, j], ss[z]), QNormW[j])
                        qn_hi = T.ieee_mul(T.ieee_mul(x_hi[z, j], ss[z]), QNormW[j + HALF])
                        if j < PAIRS:
                            ang = T.ieee_mul(pos, InvFreq[j])
                            r_lo, r_hi = rope_pair(qn_lo, qn_hi, ang)
                            if folded:  # score-window order: [rot lo | rot hi | unrot ...]
                                QueryOut[bt, bh, j] = T.cast(r_lo, out_dtype)
                                QueryOut[bt, bh, PAIRS + j] = T.cast(r_hi, out_dtype)
                            else:
                                QueryOut[bt, bh, j] = T.cast(r_lo, out_dtype)
                                QueryOut[bt, bh, HALF + j] = T.cast(r_hi, out_dtype)
                        else:
                            if folded:  # the w_k fold: q_unrot * w_k[unrot]
                                QueryOut[bt, bh, PAIRS + j] = T.cast(T.ieee_mul(qn_lo, KNormW[j]), out_dtype)
                                QueryOut[bt, bh, HALF + j] = T.cast(T.ieee_mul(qn_hi, KNormW[j + HALF]), out_dtype)
                            else:  # zero frequency: RoPE is the identity
                                QueryOut[bt, bh, j] = T.cast(qn_lo, out_dtype)
                                QueryOut[bt, bh, HALF + j] = T.cast(qn_hi, out_dtype)
                elif fp8:
                    h = bh - HQ
                    page = SlotPage[bt]
                    off = SlotOffset[bt]
                    normed_pair(KVraw, bt, h, x_lo, x_hi, sq, ss)
                    for z, j in T.Parallel(1, HALF):  # the float32 row: V in x_lo/x_hi, K_rot in rot_lo/rot_hi
                        v_lo = T.ieee_mul(x_lo[z, j], ss[z])
                        v_hi = T.ieee_mul(x_hi[z, j], ss[z])
                        k_lo = T.ieee_mul(v_lo, KNormW[j])
                        k_hi = T.ieee_mul(v_hi, KNormW[j + HALF])
                        x_lo[z, j] = v_lo
                        x_hi[z, j] = v_hi
                        if j < PAIRS:
                            ang = T.ieee_mul(pos, InvFreq[j])
                            r_lo, r_hi = rope_pair(k_lo, k_hi, ang)
                            rot_lo[z, j] = r_lo
                            rot_hi[z, j] = r_hi
                            abs_max[z, j] = T.max(T.max(T.abs(v_lo), T.abs(v_hi)),
                                                  T.max(T.abs(rot_lo[z, j]), T.abs(rot_hi[z, j])))
                        else:
                            abs_max[z, j] = T.max(T.abs(v_lo), T.abs(v_hi))
                    T.reduce_max(abs_max, scale, dim=1)  # the row's amax over its 640 columns (a max: exact)
                    for z in T.Parallel(1):  # amax / 448 rounded once (IEEE division, as torch's tensor division)
                        scale[z] = T.if_then_else(scale[z] > T.float32(0), T.ieee_fdiv(scale[z], T.float32(E4M3_MAX)),
                                                  T.float32(1))
                    for z, j in T.Parallel(1, HALF):  # [K_rot lo | K_rot hi | V_unrot ... | V_rot lo | V_rot hi]
                        if j < PAIRS:
                            Pool[page, h, off, j] = e4m3(rot_lo[z, j], scale[z])
                            Pool[page, h, off, PAIRS + j] = e4m3(rot_hi[z, j], scale[z])
                            Pool[page, h, off, D + j] = e4m3(x_lo[z, j], scale[z])
                            Pool[page, h, off, D + PAIRS + j] = e4m3(x_hi[z, j], scale[z])
                        else:
                            Pool[page, h, off, PAIRS + j] = e4m3(x_lo[z, j], scale[z])
                            Pool[page, h, off, HALF + j] = e4m3(x_hi[z, j], scale[z])
                    for z in T.Parallel(1):
                        PoolScales[page, h, off] = scale[z]
                else:
                    h = bh - HQ
                    page = SlotPage[bt]
                    off = SlotOffset[bt]
                    normed_pair(KVraw, bt, h, x_lo, x_hi, sq, ss)
                    for z, j in T.Parallel(1, HALF):
                        v_lo = T.ieee_mul(x_lo[z, j], ss[z])
                        v_hi = T.ieee_mul(x_hi[z, j], ss[z])
                        k_lo = T.ieee_mul(v_lo, KNormW[j])
                        k_hi = T.ieee_mul(v_hi, KNormW[j + HALF])
                        if j < PAIRS:
                            ang = T.ieee_mul(pos, InvFreq[j])
                            r_lo, r_hi = rope_pair(k_lo, k_hi, ang)
                            if folded:  # [K_rot lo | K_rot hi | V_unrot ... | V_rot lo | V_rot hi]
                                Pool[page, h, off, j] = T.cast(r_lo, out_dtype)
                                Pool[page, h, off, PAIRS + j] = T.cast(r_hi, out_dtype)
                                Pool[page, h, off, D + j] = T.cast(v_lo, out_dtype)
                                Pool[page, h, off, D + PAIRS + j] = T.cast(v_hi, out_dtype)
                            else:
                                Pool[page, h, off, j] = T.cast(r_lo, out_dtype)
                                Pool[page, h, off, HALF + j] = T.cast(r_hi, out_dtype)
                                Pool[page, h, off, D + j] = T.cast(v_lo, out_dtype)
                                Pool[page, h, off, D + HALF + j] = T.cast(v_hi, out_dtype)
                        else:
                            if folded:
                                Pool[page, h, off, PAIRS + j] = T.cast(v_lo, out_dtype)
                                Pool[page, h, off, HALF + j] = T.cast(v_hi, out_dtype)
                            else:
                                Pool[page, h, off, j] = T.cast(k_lo, out_dtype)
                                Pool[page, h, off, HALF + j] = T.cast(k_hi, out_dtype)
                                Pool[page, h, off, D + j] = T.cast(v_lo, out_dtype)
                                Pool[page, h, off, D + HALF + j] = T.cast(v_hi, out_dtype)

        args = {
            "Qraw": T.Tensor([NT, HQ, D], in_dtype),
            "KVraw": T.Tensor([NT, HKV, D], in_dtype),
            "QNormW": T.Tensor([D], f32),
            "KNormW": T.Tensor([D], f32),
            "InvFreq": T.Tensor([HALF], f32),
            "Positions": T.Tensor([NT], "int32"),
            "SlotPage": T.Tensor([NT], "int32"),
            "SlotOffset": T.Tensor([NT], "int32"),
            "Pool": T.Tensor([NP, HKV, page_size, W], pool_dtype if fp8 else out_dtype),
            **({"PoolScales": T.Tensor([NP, HKV, page_size], f32)} if fp8 else {}),  # an FP8 row's scale per token
            "QueryOut": T.Tensor([NT, HQ, D], out_dtype),
        }
        return prim_func("main", args, lambda b: prep(*(b[n] for n in list(args)[:9]), b.get("PoolScales"),
                                                      b["QueryOut"]))

    return prep_fused(page_size, in_dtype, threads)


# --- launcher ---------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _kernel(geom: AttentionGeometry, fmt: KvFormat, fp8: bool, page_size: int, in_dtype: str):
    return (build_fp8 if fp8 else build)(geom, fmt, page_size=page_size, in_dtype=in_dtype)


def prep_and_store_gpu(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                       q: torch.Tensor, kv: torch.Tensor, q_norm_weight: torch.Tensor,
                       k_norm_weight: torch.Tensor) -> torch.Tensor:
    """`foldkv.prep_and_store` in one fused launch: store T tokens' rows, return the query [T, 32, 512] bf16.

    Everything is checked before the launch (same checks as the torch prep, plus: CUDA tensors, a bf16 or FP8 pool,
    q/kv of one dtype among bf16/fp16/fp32); on a refusal the pool is unchanged. The kernel (an FP8 pool's also
    writes pool.scales) is built for the pool's page size and q's dtype, once each."""
    geom = pool.geometry
    quantized = pool.layout.quantized
    if pool.layout.dtype not in (torch.bfloat16, FP8_DTYPE):
        raise FoldKvInputError(f"the fused prep stores bf16 or FP8 (e4m3) rows; the pool is {pool.layout.dtype}")
    if isinstance(q, torch.Tensor) and q.dtype in _TORCH_DTYPES:  # one input dtype: the kernel is built for it
        check_tensor("kv", kv, dtype=q.dtype)
    pages, offsets = check_prep_and_store(pool, table, request, positions, q, kv, q_norm_weight, k_norm_weight,
                                          q_dtypes=tuple(_TORCH_DTYPES))
    if quantized:
        check_rows_will_be_finite(geom, kv, k_norm_weight)
    if pool.device.type != "cuda":  # last, so the CPU tests reach every other refusal
        raise FoldKvInputError(f"the fused prep runs on CUDA; the pool is on {pool.device}")
    t = q.shape[0]
    query = torch.empty((t, geom.num_q_heads, geom.head_dim), dtype=torch.bfloat16, device=pool.device)
    if t == 0:
        return query
    kernel = _kernel(geom, pool.format, quantized, pool.layout.page_size, _TORCH_DTYPES[q.dtype])
    dev = pool.device
    kernel(q.contiguous(), kv.contiguous(), q_norm_weight.to(dev, torch.float32).contiguous(),
           k_norm_weight.to(dev, torch.float32).contiguous(), rope_inv_freq(geom, dev).contiguous(),
           positions.to(dev, torch.int32), pages.to(dev, torch.int32), offsets.to(dev, torch.int32),
           *pool_operands(pool), query)
    return query


def check_rows_will_be_finite(geom: AttentionGeometry, kv: torch.Tensor, k_norm_weight: torch.Tensor) -> None:
    """Refuse (FoldKvInputError) inputs whose FP8 rows could be non-finite, before the kernel writes any: the torch
    prep refuses non-finite rows (`foldkv.fp8.check_finite_rows`) after computing them, which a fused kernel cannot
    do before its store. A row is finite when kv and k_norm_weight are: each normed value is x / rms(x), at most
    sqrt(D) in magnitude (an overflowing sum of squares gives a norm scale of 0, hence zeros); K = V * w_k, and RoPE
    adds two such products, so |row| <= 2 sqrt(D) max|w_k|, which must stay below float32's largest (a factor 2 of
    margin for the roundings)."""
    check_finite_rows(kv)
    check_finite_rows(k_norm_weight)
    w_max = float(k_norm_weight.abs().max().double())
    limit = torch.finfo(torch.float32).max / (4.0 * geom.head_dim**0.5)
    if w_max > limit:
        raise FoldKvInputError(f"k_norm_weight reaches {w_max:.3g}: the FP8 rows (up to 2 sqrt(D) max|w_k|) could"
                               f" overflow float32 (max|w_k| must be <= {limit:.3g}); nothing was written")
