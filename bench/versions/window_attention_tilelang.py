"""A sliding layer's prefill attention (`foldkv.window_attention.window_attention`'s contract) as one TileLang Hopper
kernel: both query heads of a KV head against one K/V tile load, only the key tiles of the band visited, the mask
only on the band's edge tiles.

What it tries (bench/PREFILL_NOTES.md, "Prediction: the sliding window as a TileLang kernel"): the 31B's 50 sliding
layers (head_dim 256, 32 query heads over 16 KV heads, window 1,024, bf16, no softcap) run through torch's
FlashAttention-2 (`flash_fwd_kernel<256, 64, 64>`), measured at ~25-28 ms a 4,096-token chunk on the H100 (~246
TFLOP/s of band work: 4 x 4,096 x 1,024 x 256 x 32 x 50 = 6.9 TFLOP a chunk; ~30% of the card's dense bf16 rate).
FlashAttention-2 keeps a 64-row query tile per head, so each K/V tile is loaded once per query head (twice per KV
head), with no TMA, no wgmma and no warp specialisation. This kernel, FA3's arrangement as far as TileLang carries it:
  - a CTA is 64 query tokens (`tokens_per_block`) x both query heads of one KV head (the GQA pair): 128 rows, rows [0, 64) head
    2 kv, [64, 128) head 2 kv + 1; each K/V tile is loaded once for both heads (half FlashAttention-2's K/V traffic),
    and each consumer warpgroup (FullRow) holds one head's 64 rows, so the softmax's row reductions stay inside a
    warpgroup (no cross-warpgroup exchange);
  - block_N = 64 keys (32 KiB of K and 32 of V a stage at head_dim 256), two stages by `T.Pipelined` (TileLang's
    producer warpgroup issues the TMA loads; wgmma through `T.gemm`): Q 64 KiB + 2 x 64 KiB + P 16 KiB = 208 KiB of
    the 227;
  - the key tiles visited are those that intersect the block's band [p_first - (W - 1), p_last] (`band_tiles`, one
    definition for the host's tests and the kernel's loop bounds): at W = 1,024 a full block visits 17 tiles of 64
    when the chunk's offset S - T is 0 or 63 mod 64 (a prompt's first chunk, S = T; a later chunk of a 4,096-token
    chunking, S = T + 1,023), 18 otherwise, for 16 tiles' worth of useful keys; a tile inside every row's band
    (`tile_needs_mask`) skips the mask;
  - keys past S (the last tile's tail) come from TMA's zero fill and are masked (every key of a visited tile past a
    row's own position is); rows past the chunk repeat the chunk's last position (computed, never stored);
  - the running max starts at a finite `NO_KEY_YET`, not -inf: a row's first visited tiles may hold none of its keys
    (the comment at `NO_KEY_YET` says why that would be NaN and why this is exact);
  - the producer loop is kept in the warp that issues the TMA copies (`producer_guard`, as every foldkv kernel);
  - the softmax is the library prefill's (`macros.online_softmax_macro`, exp2 with the scale folded in one FMA);
    `max_slack_log2` (the library's lazy max, FlashAttention-4's conditional rescale) is an option the probe times.
Memory layout (what the served path hands it without a copy): the query [B, T, H, D] (the projection's rows: the
contract's [B, H, T, D] query is its transposed view), K/V [B, Hkv, S, D] contiguous (the sliding cache's torch.cat,
every chunk but a prompt's first, whose K/V are transposed views: the launcher makes them contiguous, a copy the
probe times as the `tilelang_kv_copy` arm), the output [B, T, H, D] as the contract's.

Prediction (written before any GPU run; H100): 380-480 TFLOP/s of band work (6.9 TFLOP a chunk counted as above;
the kernel computes ~6% more, the edge tiles' masked keys), i.e. 14.4-18.2 ms of sliding attention a 4,096-token
chunk against FlashAttention-2's 25-28: -8 to -12 ms a chunk, TTFT -0.06 to -0.10 s at 32K (8 chunks), -0.26 to
-0.38 s at 128K (32 chunks). Both cells visit 17 tiles a full block; a chunk at another offset (18) ~5% slower.
What proves it wrong: under ~330 TFLOP/s (1.35x FlashAttention-2: not worth a second kernel path), which would say
TileLang's pipeline at head_dim 256 does not overlap the softmax with the gemms (one CTA an SM, 17-18 tiles: the
prologue's Q load and the epilogue are ~10% of a CTA); or the hostile cases off the float64 bound.

Resources (`--resources`: TileLang 0.1.15's CUDA through nvcc 13.0's ptxas for sm_90a on the CPU machine; plain and
lazy-max builds alike): 168 registers a thread at __launch_bounds__(384, 1) (64,512 of the 65,536; the producer
warpgroup gives back to 24 by setmaxnreg and the consumers take 240), 0 bytes of spills, 212,992 B of dynamic shared
memory (Q 64 KiB, K and V 2 x 2 x 32 KiB, P 16 KiB) + 1,024 static (the pipeline's barriers): one CTA an SM. Grid
ceil(T / 64) x 16 KV heads x B: 1,024 CTAs at a 4,096-query chunk, 7.8 waves of the H100's 132 SMs.
From the emitted CUDA: K and V by TMA (4 boxes of 64 x 64 a tile, 4-D descriptors: the rows past S zero-filled),
Q.K as `wgmma_ss m64n64k16` and P.V as `m64n256k16` per warpgroup, each waited at once (`warpgroup_wait<0>`): inside
a consumer the softmax does not overlap its own gemms (no FA3 ping-pong: TileLang's pipeline overlaps the loads only).
The query is loaded before the producer starts (4-byte loads by all 384 threads, then a __syncthreads): ~64 KiB a CTA
not overlapped with the first K/V tiles (`T.copy` of a head's rows into half of Q_shared lowers to 2-byte loads, not
TMA: tried, worse).
Per 64-key tile (cycles of one SM at 4,096 dense bf16 FLOP/clk, 128 B/clk of shared memory): 8.39 MFLOP = 2,048
clk of tensor work; Q.K reads 128 KiB of operands from shared memory (~1,024 clk: at the shared-memory limit), P.V 80
KiB (~1,024 clk, tensor-bound); the softmax and rescale between them (tensor cores idle; row reductions inside a warp,
no cross-warpgroup exchange) ~300-500 clk: a chain of ~2,450-2,600 clk, ~80% of the tensor rate in the loop. Times
16 / 17 (the band's tiles against those visited), ~0.85 (the query load and the epilogue of a 17-tile CTA), 0.97
(waves): ~0.6 of the in-run matmul rate (~790 on this H100), ~480 TFLOP/s of band work, less what TileLang's
pipeline loses: the predicted 380-480. K/V from L2 at that rate: 64 KiB a tile a CTA, ~5.9 TB/s over 132 SMs, near
L2's bandwidth (each tile is read by 17 neighbouring blocks, issued in order: the working set ~2 KV heads, ~10 MB).

    python bench/versions/window_attention_tilelang.py --resources   # CPU: build for sm_90a, ptxas's registers/spills
    PART=window_kernel bash scripts/lab_calls.sh                        # device: GPU test, then bench/window_kernel_probe.py
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

import argparse
import functools
import operator
import os
import re
import subprocess
import sys
import tempfile

import torch

from foldkv import window_attention as wa
from foldkv.kernels import macros, producer_guard
from foldkv.kernels.prefill_attention import Accumulator, lazy_rescale_macro
from foldkv.kernels.tl import pass_configs, prim_func, require_tilelang, target

ROWS = 128  # query rows a CTA: two consumer warpgroups of 64 (wgmma's M per warpgroup)
BLOCK_N = 64  # keys a tile: 2 stages of K and V at head_dim 256 fit beside Q (module docstring)
NUM_STAGES = 2
THREADS = 256  # consumer threads; TileLang adds the producer warpgroup
# The running max before a row has met a key of its band: finite, unlike the library prefill's -inf. A window's first
# visited tile can be wholly outside a row's band (the block's later rows start up to 63 keys after its first), and
# the softmax's exp2(s scale - max scale) and its rescale exp2((max_prev - max) scale) would be -inf + inf = NaN
# there with a -inf max. With this start the masked scores (-inf) still give 0, the rescale of such a tile is
# exp2(0) = 1 over an accumulator of 0, and the first tile with a key of the row rescales by exp2(-1e30 scale) = 0.
# (FlashAttention replaces a -inf max by 0 instead; the library's softmax is kept as it is.) It needs scale < ~1e8
# (-1e30 x scale x log2 e finite in float32) and scores above -1e30.
NO_KEY_YET = -1e30


def band_tiles(first_pos, last_pos, window: int, block_n: int, max_fn=max):
    """(first, last) key tile (of `block_n` keys from key 0) that the queries at positions first_pos..last_pos touch:
    query p sees keys p - (window - 1)..p. Python ints here (the tests), TIR expressions in the kernel (max_fn=T.max):
    one definition for both."""
    return max_fn(first_pos - (window - 1), 0) // block_n, last_pos // block_n


def tile_needs_mask(key0, first_pos, last_pos, window: int, block_n: int, or_fn=operator.or_):
    """Whether some key of key0..key0 + block_n - 1 is outside some query's band (else the tile is used unmasked):
    the last query's band starts after key0, or the tile ends after the first query's position (keys past S among
    them). Python bools here, TIR in the kernel (or_fn=T.Or)."""
    return or_fn(key0 < last_pos - (window - 1), key0 + block_n - 1 > first_pos)


def tokens_per_block(group: int) -> int:
    """Query tokens a CTA holds: its 128 rows over the GQA group's heads (64 for the 31B's pair)."""
    if ROWS % group:
        raise ValueError(f"a GQA group of {group} query heads does not divide the CTA's {ROWS} rows")
    return ROWS // group


def window_program(num_heads: int, num_kv_heads: int, head_dim: int, window: int, scale: float, *,
                   block_N: int = BLOCK_N, num_stages: int = NUM_STAGES, threads: int = THREADS,
                   max_slack_log2: float | None = None, band=band_tiles):
    """The TileLang prim_func: Q [B, T, H, D], K, V [B, Hkv, S, D], Out [B, T, H, D] (bf16; B, T, S dynamic; the T
    queries are the last T key positions). `band`: the key-tile bounds function (`band_tiles`'s signature; the tests'
    red twin passes a short one)."""
    require_tilelang()
    import tilelang.language as T

    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads")
    G = num_heads // num_kv_heads
    TOK = tokens_per_block(G)
    D = head_dim
    dtype, accum = "bfloat16", "float32"
    B, Tq, S = T.dynamic("B, Tq, S")
    online_softmax = macros.online_softmax_macro(key_dim=1, scale=scale * macros.LOG2E, fold_scale=True,
                                                 max_slack_log2=max_slack_log2)
    mask_scores = macros.mask_scores_macro()
    rescale = None if max_slack_log2 is None else lazy_rescale_macro()

    @T.macro
    def attention(Q, K, V, Out):
        with T.Kernel(T.ceildiv(Tq, TOK), num_kv_heads, B, threads=threads) as (bx, by, bz):
            T.import_source(producer_guard.imported_source())  # the producer loop in the warp that issues the copies
            Q_shared = T.alloc_shared([ROWS, D], dtype)
            K_shared = T.alloc_shared([block_N, D], dtype)
            V_shared = T.alloc_shared([block_N, D], dtype)
            P_shared = T.alloc_shared([ROWS, block_N], dtype)
            acc_s = T.alloc_fragment([ROWS, block_N], accum)
            acc_o = T.alloc_fragment([ROWS, D], accum)
            m = T.alloc_fragment([ROWS], accum)
            m_prev = T.alloc_fragment([ROWS], accum)
            alpha = T.alloc_fragment([ROWS], accum)
            row_sum = T.alloc_fragment([ROWS], accum)
            l = T.alloc_fragment([ROWS], accum)

            q0 = bx * TOK
            offset = S - Tq  # key position of query 0 (bottom-right aligned)
            first_pos = offset + q0
            last_pos = offset + T.min(q0 + TOK, Tq) - 1
            # row i: query token q0 + i % TOK of head by * G + i // TOK; tokens past the chunk repeat its last one
            # (computed, never stored), so every row has a key and no row is all -inf
            for i, d in T.Parallel(ROWS, D):
                Q_shared[i, d] = Q[bz, T.min(q0 + i % TOK, Tq - 1), by * G + i // TOK, d]
            T.fill(acc_o, 0)
            T.fill(l, 0)
            T.fill(m, NO_KEY_YET)

            lo, hi = band(first_pos, last_pos, window, block_N, T.max)
            for k in T.Pipelined(hi - lo + 1, num_stages=num_stages):
                key0 = (lo + k) * block_N
                T.copy(K[bz, by, key0:key0 + block_N, :], K_shared)
                T.copy(V[bz, by, key0:key0 + block_N, :], V_shared)
                T.clear(acc_s)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                if tile_needs_mask(key0, first_pos, last_pos, window, block_N, T.Or):
                    mask_scores(acc_s, lambda i, j: T.And(key0 + j <= offset + T.min(q0 + i % TOK, Tq - 1),
                                                          key0 + j > offset + T.min(q0 + i % TOK, Tq - 1) - window))
                online_softmax(acc_s, P_shared, m, m_prev, alpha, row_sum, l)
                if rescale is None:
                    for i, d in T.Parallel(ROWS, D):
                        acc_o[i, d] *= alpha[i]
                else:  # the library prefill's skipped rescale: a warp multiplies only if one of its rows' max moved
                    rescale((Accumulator(acc_o, V_shared, 0),), alpha)
                T.gemm(P_shared, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

            for i, d in T.Parallel(ROWS, D):
                if q0 + i % TOK < Tq:
                    Out[bz, q0 + i % TOK, by * G + i // TOK, d] = acc_o[i, d] / l[i]

    args = {
        "Q": T.Tensor([B, Tq, num_heads, D], dtype),
        "K": T.Tensor([B, num_kv_heads, S, D], dtype),
        "V": T.Tensor([B, num_kv_heads, S, D], dtype),
        "Out": T.Tensor([B, Tq, num_heads, D], dtype),
    }
    return prim_func("main", args, lambda b: attention(b["Q"], b["K"], b["V"], b["Out"]))


@functools.lru_cache(maxsize=None)
def build(num_heads: int = 32, num_kv_heads: int = 16, head_dim: int = 256, window: int = 1024,
          scale: float = 1.0, *, block_N: int = BLOCK_N, num_stages: int = NUM_STAGES, threads: int = THREADS,
          max_slack_log2: float | None = None, band=band_tiles, arch: str | None = None):
    """Compile (JIT) the kernel for one geometry, window and scale (both baked in); defaults: the 31B's sliding
    layers (Gemma 4's scaling is 1.0: its q_norm replaces the 1/sqrt(d)). `band`: `window_program`'s."""
    tilelang = require_tilelang()

    @tilelang.jit(target=target(arch) if arch else target(), pass_configs=pass_configs())
    def window_attention_tilelang(num_heads, num_kv_heads, head_dim, window, scale, block_N, num_stages, threads,
                                  max_slack_log2, band):
        return window_program(num_heads, num_kv_heads, head_dim, window, scale, block_N=block_N,
                              num_stages=num_stages, threads=threads, max_slack_log2=max_slack_log2, band=band)

    return window_attention_tilelang(num_heads, num_kv_heads, head_dim, window, float(scale), block_N, num_stages,
                                     threads, max_slack_log2, band)


def refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int | None, scale: float,
            out: torch.Tensor | None = None) -> str | None:
    """Why this kernel cannot serve the call (None: it can): the library's refusals, then its own (bf16 only, a GQA
    group that divides its 128 rows, a scale `NO_KEY_YET` allows, an `out` of the output's shape)."""
    why = wa.refusal(query, key, value, window=window)
    if why is not None:
        return why
    if query.dtype != torch.bfloat16:
        return f"dtype {query.dtype} (this kernel is bf16)"
    if ROWS % (query.shape[1] // key.shape[1]):
        return f"a GQA group of {query.shape[1] // key.shape[1]} does not divide {ROWS} rows"
    if not 0 < scale < 1e8:  # NO_KEY_YET x scale x log2 e must stay finite in float32
        return f"scale {scale} (this kernel takes 0 < scale < 1e8)"
    if query.shape[0] != key.shape[0] or key.shape != value.shape:
        return f"query {list(query.shape)}, key {list(key.shape)}, value {list(value.shape)}"
    want = (query.shape[0], query.shape[2], query.shape[1], query.shape[3])
    if out is not None and (tuple(out.shape) != want or out.dtype != query.dtype or not out.is_contiguous()
                            or out.device != query.device):
        return f"out {list(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}); wants {list(want)} {query.dtype}"
    return None


def window_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, window: int, scale: float,
                     out: torch.Tensor | None = None, **tiling) -> torch.Tensor:
    """`foldkv.window_attention.window_attention` through this kernel: query [B, H, T, D], key/value [B, Hkv, S, D]
    (S >= T) -> [B, T, H, D] bf16 (into `out` when given). Refused (ValueError, nothing launched) where `refusal`
    says so. A query that is the transposed view of [B, T, H, D] rows and K/V contiguous are read in place; other
    layouts are copied first."""
    why = refusal(query, key, value, window=window, scale=scale, out=out)
    if why is not None:
        raise ValueError(f"window_attention_tilelang cannot serve this call: {why}")
    B, H, Tq, D = query.shape
    kernel = build(H, key.shape[1], D, window, scale, **tiling)
    if out is None:
        out = torch.empty(B, Tq, H, D, dtype=query.dtype, device=query.device)
    kernel(query.transpose(1, 2).contiguous(), key.contiguous(), value.contiguous(), out)
    return out


def resource_report(**tiling) -> dict:
    """The 31B's kernel (`build(**tiling)`) compiled for sm_90a here by nvcc's ptxas (no GPU): {"registers",
    "spill_bytes", "static_shared" (ptxas's: the pipeline's barriers), "dynamic_shared" (what the host code launches
    with: the four launch words after the grid are the block's x, y, z and the dynamic shared memory), "shared" (both),
    "threads", "ptxas" (its lines)}."""
    from tilelang.contrib.nvcc import default_compile_options, get_nvcc_compiler

    kernel = build(**tiling)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.cu")
        with open(src, "w") as fh:
            fh.write(kernel.get_kernel_source())
        cmd = [get_nvcc_compiler(), "-cubin", "-O3", "-arch=sm_90a", "-Xptxas=-v", "-o", os.path.join(tmp, "k.cubin"),
               src] + default_compile_options()
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise RuntimeError(f"nvcc failed: {res.stderr[-2000:]}")
    lines = [ln.strip() for ln in res.stderr.splitlines() if "ptxas info    : Used" in ln or "spill" in ln]
    used = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", res.stderr)
    threads = int(re.search(r"__launch_bounds__\((\d+)", kernel.get_kernel_source()).group(1))
    launch = re.search(rf"\(\(int64_t\){threads}\);(?:.*?\(\(int64_t\)1\);){{2}}.*?\(\(int64_t\)(\d+)\);",
                       kernel.get_host_source(), re.S)
    dynamic = int(launch.group(1))
    return {"registers": int(used.group(1)), "spill_bytes": sum(int(n) for n in re.findall(r"(\d+) bytes spill",
                                                                                           res.stderr)),
            "static_shared": int(used.group(2)), "dynamic_shared": dynamic, "shared": dynamic + int(used.group(2)),
            "threads": threads, "ptxas": lines}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resources", action="store_true", help="ptxas's registers and spills (CPU, nvcc)")
    ap.add_argument("--max-slack-log2", type=float, default=None, help="the lazy max's slack (default: off)")
    args = ap.parse_args(argv)
    tiling = {"max_slack_log2": args.max_slack_log2}
    kernel = build(**tiling)
    print(f"window_attention_tilelang {tiling}: {len(kernel.get_kernel_source())} chars of CUDA")
    if args.resources:
        print(resource_report(**tiling))


if __name__ == "__main__":
    sys.exit(main())
