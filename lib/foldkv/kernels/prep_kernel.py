"""The fused GPU prep: q/k RMSNorm, v-norm, proportional RoPE on the rotated columns, the w_k fold, and the row store.

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

Kernel argument order (the AOT loader relies on it):
  Qraw [T, 32, 512] (in dtype), KVraw [T, 4, 512] (in dtype), QNormW [512] f32, KNormW [512] f32,
  InvFreq [256] f32, Positions [T] int32, SlotPage [T] int32, SlotOffset [T] int32,
  Pool [P, 4, page, row_width] bf16 (written), QueryOut [T, 32, 512] bf16
Grid (T, 32 + 4): block y < 32 preps query head y, block y >= 32 preps and stores KV head y - 32; 128 threads, each
owning two rotate_half pairs (d, d + 256).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from typing import Callable, Mapping

import torch

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat
from ..pool import BlockTable, PagedKvPool
from ..prep import _check_prep_inputs, rope_inv_freq
from ..validate import FoldKvInputError, check_tensor
from . import registry, resolve
from .macros import rope_pair
from .tl import pass_configs, require_tilelang, target

DEFAULTS = dict(registry.get("prep_folded").params)  # the registered params (the same for both formats)
_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def _check_geometry(geom: AttentionGeometry) -> None:
    if geom.rotary_pairs * 2 > geom.head_dim // 2 or geom.head_dim % 256:
        raise NotImplementedError(f"prep kernel needs head_dim a multiple of 256 and rotary pairs <= D/4; got {geom}")


@registry.hands_out("prep_{fmt}")
def build(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, *, page_size: int = 64,
          in_dtype: str = "bfloat16", threads: int = 128, arch: str | None = None):
    """Compile (JIT) the fused prep for one pool format; returns a TileLang kernel taking the arguments above."""
    _check_geometry(geom)
    fmt = KvFormat.parse(fmt)
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

        @T.prim_func
        def main(
            Qraw: T.Tensor([NT, HQ, D], in_dtype),
            KVraw: T.Tensor([NT, HKV, D], in_dtype),
            QNormW: T.Tensor([D], f32),
            KNormW: T.Tensor([D], f32),
            InvFreq: T.Tensor([HALF], f32),
            Positions: T.Tensor([NT], "int32"),
            SlotPage: T.Tensor([NT], "int32"),
            SlotOffset: T.Tensor([NT], "int32"),
            Pool: T.Tensor([NP, HKV, page_size, W], out_dtype),
            QueryOut: T.Tensor([NT, HQ, D], out_dtype),
        ):
            with T.Kernel(NT, HQ + HKV, threads=threads) as (bt, bh):
                x_lo = T.alloc_fragment([1, HALF], f32)
                x_hi = T.alloc_fragment([1, HALF], f32)
                sq = T.alloc_fragment([1, HALF], f32)
                ss = T.alloc_fragment([1], f32)
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

        return main

    return prep_fused(page_size, in_dtype, threads)


# --- launcher ---------------------------------------------------------------------------------------------------
def prep_and_store_gpu(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                       q: torch.Tensor, kv: torch.Tensor, q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                       *, backend: str = "jit", kernels: Mapping[str, Callable] | None = None) -> torch.Tensor:
    """`foldkv.prep_and_store` in one fused launch: store T tokens' rows, return the query [T, 32, 512] bf16.

    Everything is checked before the launch (same checks as the torch prep, plus: CUDA tensors, bf16 pool,
    q/kv of one dtype among bf16/fp16/fp32); on a refusal the pool is unchanged. The kernel "prep_<format>" comes from
    `foldkv.kernels.resolve.kernel` with the pool's page size and q's dtype among its params (backend "jit" or "aot"),
    or from `kernels={"prep_<format>": callable}` (an experiment's variant).
    """
    geom = pool.geometry
    resolve.check_backend(backend)
    name = f"prep_{pool.format.value}"
    resolve.check_kernels((name,), kernels)
    if pool.layout.dtype != torch.bfloat16:
        raise FoldKvInputError(f"the fused prep stores bf16 rows; the pool is {pool.layout.dtype}")
    check_tensor("q", q, dtype=tuple(_TORCH_DTYPES), device=pool.device,
                 shape=(None, geom.num_q_heads, geom.head_dim))
    check_tensor("kv", kv, dtype=q.dtype, device=pool.device, shape=(q.shape[0], geom.num_kv_heads, geom.head_dim))
    check_tensor("request", request, dtype=(torch.int32, torch.int64), shape=(q.shape[0],))
    # positions may live on either device, as for the torch prep_and_store
    _check_prep_inputs(geom, q, kv, q_norm_weight, k_norm_weight, positions.to(q.device))
    pages, offsets = pool.token_slots(table, request, positions)  # refuses positions past a request's pages
    if pool.device.type != "cuda":  # last, so the CPU tests reach every other refusal
        raise FoldKvInputError(f"the fused prep runs on CUDA; the pool is on {pool.device}")
    t = q.shape[0]
    query = torch.empty((t, geom.num_q_heads, geom.head_dim), dtype=torch.bfloat16, device=pool.device)
    if t == 0:
        return query
    params = {"page_size": pool.layout.page_size, "in_dtype": _TORCH_DTYPES[q.dtype]}
    (kernel,) = resolve.launch_kernels((name,), geom, {name: params}, backend, kernels)
    dev = pool.device
    kernel(q.contiguous(), kv.contiguous(), q_norm_weight.to(dev, torch.float32).contiguous(),
           k_norm_weight.to(dev, torch.float32).contiguous(), rope_inv_freq(geom, dev).contiguous(),
           positions.to(dev, torch.int32), pages.to(dev, torch.int32), offsets.to(dev, torch.int32),
           pool.data, query)
    return query


def main(fmt: KvFormat | str = KvFormat.FOLDED, tokens: int = 8192):
    """Build the prep for `fmt`; on a GPU, prep `tokens` tokens of one request with it and with the torch prep,
    count the elements that differ (the bound is in the module docstring), then time it."""
    fmt = KvFormat.parse(fmt)
    geom = GEMMA4_31B
    print(f"prep_{fmt.value} {DEFAULTS}: {len(build(geom, fmt, **DEFAULTS).get_kernel_source())} chars of CUDA")
    if not torch.cuda.is_available():
        print("no CUDA device: built, not checked or timed")
        return
    from ..pool import PagedKvLayout
    from ..prep import prep_and_store

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    pools = [PagedKvPool(PagedKvLayout(geom, fmt, 64, tokens // 64 + 1), device=dev, fill=0.0) for _ in range(2)]
    table = pools[0].allocate([tokens]).to(dev)
    request = torch.zeros(tokens, dtype=torch.int32, device=dev)
    positions = torch.arange(tokens, dtype=torch.int32, device=dev)
    q = torch.randn(tokens, geom.num_q_heads, geom.head_dim, generator=gen, device=dev).bfloat16()
    kv = torch.randn(tokens, geom.num_kv_heads, geom.head_dim, generator=gen, device=dev).bfloat16()
    w = torch.rand(geom.head_dim, generator=gen, device=dev) + 0.5
    got = prep_and_store_gpu(pools[0], table, request, positions, q, kv, w, w)
    want = prep_and_store(pools[1], table, request, positions, q, kv, w, w)
    print(f"query: {int((got != want).sum())} of {got.numel()} elements differ; "
          f"pool: {int((pools[0].data != pools[1].data).sum())} of {pools[0].data.numel()}")
    from tilelang.profiler import do_bench  # TileLang's timer, in ms
    us = do_bench(lambda: prep_and_store_gpu(pools[0], table, request, positions, q, kv, w, w)) * 1e3
    print(f"{us:.1f} us per {tokens}-token prep")


if __name__ == "__main__":
    main()
