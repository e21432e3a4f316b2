"""The bound of the FP8 tensor-core decode (`fp8_math="tensor_cores"`, kernels/decode_partial_fp8_tc.py), derived:
the bf16 gate's bound (checks.py) plus the roundings that partial adds. Not measured yet: `FP8_MMA_BITS_KEPT` is a
placeholder until the H200 characterises FP8 wgmma's accumulation (bench/FP8_NOTES.md, run 17).

What the tensor-core partial rounds that the exact one does not (per query head, per key j, scores s_j = q . k_j over
the D = 512 score-window columns; a_j = sum_d |q_d k_jd|, from the float64 reference's rows):
  1. The query as two e4m3 parts. x = q * 448 / max|q| (per head, float32), hi = e4m3(x), lo = e4m3(16 (x - hi)).
     e4m3 keeps 3 fraction bits: a normal value rounds within 2^-4 of itself, a subnormal one within 2^-10 (half of
     its spacing 2^-9). So |x - hi| <= 2^-4 |x| (or <= 2^-10 where hi is subnormal), lo rounds 16 (x - hi) within
     2^-4 of itself or 2^-10, and |x - hi - lo / 16| <= 2^-4 * 2^-4 |x| + 2^-10 / 16 = 2^-8 |x| + 2^-14: the two
     parts keep 2 x (1 + 3) = 8 significant bits (bf16's), with an absolute floor of 2^-14 x max|q| / 448 in q's
     units (TWO_PART_REL, TWO_PART_ABS; tests/test_fp8_tc_cpu.py checks it over e4m3's range). Summed over the 512
     columns as if every rounding had one sign, a score would move by up to 2^-8 a_j: ~0.3 at the gates' scores
     (a_j ~ 90), more than the outputs. The rounding is deterministic, so the bound carries its exact effect instead:
     the float64 reference over the query the kernel's scores see (`effective_query`: the kernel's float32 gain and
     e4m3 casts, round to nearest even) against the one over the bf16 query, output and LSE.
  2. The score gemm's accumulation in FP8 wgmma: 16 k32 steps (4 panels of 4) into one accumulator per column of N.
     Taking FP8 wgmma to keep b = FP8_MMA_BITS_KEPT bits of the running sum at each step's add, step t errs by
     <= 2^-b S_t(j), S_t(j) = sum of |q_d k_jd| over the first 32 t columns (the running |sum| is at most that): a
     score moves by <= 2^-b sum_t S_t(j), times (1 + 1/16) for the lo column's accumulator (its values are at most
     the hi column's, and it is added divided by 16).
  3. The float32 combination of the hi and lo columns with the token's and the query's scales:
     F32_COMBINE_ROUNDINGS roundings of 2^-24 of a value <= a_j.
  4. P as two e4m3 parts: P~ = p scale_j 256 / (the tile's largest scale) <= 256, rounded as in 1: relative 2^-8
     (the bf16 gate's P term, P_ROUNDING, already holds it) and an absolute floor of 2^-14 in P~'s units, i.e.
     2^-14 (tile max scale / 256) |e_jc| per key in the unnormalised output (e: the e4m3 value, v = e x scale), at
     most that after dividing by the denominator (>= 1: the largest key contributes exp(0)).
  5. The value gemm's accumulation: each 64-token tile into a fresh accumulator, 2 k32 steps, each erring by
     <= 2^-b (the running |sum| <= the tile's sum of p_j |v_jc|), then added in float32: <= 2 x 2^-b (1 + 1/16)
     (P |V|)_c over the tiles.
The score errors (2-3: delta_j >= 0 per key) move the LSE by at most L = log(sum_j p_j exp(delta_j)) (both ways, by
Jensen) and output column c by at most sum_j p_j (delta_j + L) exp(delta_j + L) |v_jc - o_c| (|p'_j - p_j| <=
p_j |exp(delta_j - log Z') - 1|, |log Z'| <= L), not only to first order; p and o over the effective query.
"""

from __future__ import annotations

import torch

from ...fp8 import FP8_DTYPE
from ...layout import score_window, value_window, value_window_to_head
from ...pool import BlockTable, PagedKvPool

# Placeholder: FP8 wgmma keeps about 14 bits of its accumulation (DeepSeek-V3 technical report, section 3.3.2), taken
# one bit lower. TO BE REPLACED by the characterisation measured on the H200 (bench/FP8_NOTES.md run 17).
FP8_MMA_BITS_KEPT = 13
E4M3_FRACTION_BITS = 3
E4M3_SUBNORMAL_HALF_SPACING = 2.0**-10  # e4m3's smallest subnormal is 2^-9
TWO_PART_LO = 16.0  # the lo part is stored times 16
TWO_PART_REL = 2.0 ** (-2 * (E4M3_FRACTION_BITS + 1))  # 2^-8: hi's 2^-4, then lo's 2^-4 of the residual
TWO_PART_ABS = E4M3_SUBNORMAL_HALF_SPACING / TWO_PART_LO  # 2^-14
Q_RANGE, P_RANGE = 448.0, 256.0  # the query's and P's gains: their largest value before e4m3
MMA_K, BLOCK_N = 32, 64  # FP8 wgmma's k step; the partial's tile of tokens
F32_COMBINE_ROUNDINGS = 8
KEY_BLOCK = 8192  # keys per block of the [g, keys, D] float64 differences (a few hundred MB)


def effective_query(query: torch.Tensor, parts: int = 2) -> torch.Tensor:
    """The query [..., D] the tensor-core partial's scores see, float64: per head x = q * (448 / max|q|) in float32,
    hi = e4m3(x), lo = e4m3(16 (x - hi)) (round to nearest even, as the kernel's casts), times max|q| * (1 / 448) in
    float32; `parts=1`: hi alone (the one-part red twin's rounding, at the two-part kernel's gain)."""
    q = query.float()
    amax = q.abs().amax(-1).clamp_min(1e-30)
    x = q * (torch.full_like(amax, Q_RANGE) / amax)[..., None]
    hi = x.to(FP8_DTYPE).float()
    two = hi.double() + (((x - hi) * TWO_PART_LO).to(FP8_DTYPE).double() / TWO_PART_LO if parts == 2 else 0.0)
    inv = amax * torch.tensor(1.0 / Q_RANGE, dtype=torch.float32, device=q.device)
    return two * inv.double()[..., None]


def _tiles_max_scale(scales: torch.Tensor, block: int = BLOCK_N) -> torch.Tensor:
    """[n] the largest scale of each token's 64-token tile (chunks start on page boundaries, pages are 64 tokens, so
    a tile is an aligned block of the request's tokens)."""
    n = scales.shape[0]
    pad = -n % block
    padded = torch.cat([scales, scales.new_zeros(pad)]) if pad else scales
    return padded.reshape(-1, block).amax(-1).repeat_interleave(block)[:n]


def fp8_tc_extra_bounds(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, *,
                        bits_kept: int = FP8_MMA_BITS_KEPT, parts: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The terms the tensor-core partial adds to the bf16 gate's bound (module docstring), per decode row:
    (out [B, Hq, D] float64 head order: added to the elementwise bound, and its norm over the reference's to the
    Frobenius one; lse [B, Hq] float64 natural log: added to `checks.lse_bound`). `pool`: the FP8 pool the kernel
    read; `query` [B, Hq, D] its bf16 query (one row per request). `parts`: the query's e4m3 parts the kernel under
    test carries (2; 1 only to show that a bound made for it would differ)."""
    geom, fmt = pool.geometry, pool.format
    hkv, g, d = geom.num_kv_heads, geom.group_size, geom.head_dim
    dev = pool.device
    sw, vw = score_window(geom, fmt), value_window(geom, fmt)
    to_head = value_window_to_head(geom, fmt).to(dev)
    out_extra = torch.zeros(query.shape, dtype=torch.float64, device=dev)
    lse_extra = torch.zeros(query.shape[:2], dtype=torch.float64, device=dev)
    acc = 2.0**-bits_kept * (1 + 1 / TWO_PART_LO)
    for r in range(table.batch):
        rows = pool.gather_values(table, r, torch.float64)  # [n, Hkv, W] exact
        scale = pool.gather_scales(table, r).double()  # [n, Hkv]
        for h in range(hkv):
            k, v = rows[:, h, sw], rows[:, h, vw]  # [n, D] each; v in value-window order
            q_bf16 = query[r, h * g:(h + 1) * g]  # [g, D]
            q = effective_query(q_bf16, parts)  # [g, D] float64
            s = q @ k.T  # [g, n]
            lse = torch.logsumexp(s, -1)  # [g]
            p = torch.exp(s - lse[:, None])  # [g, n]
            o = p @ v  # [g, D]
            s_ref = q_bf16.double() @ k.T  # 1. the query's two parts, exactly: against the bf16 query's reference
            lse_ref = torch.logsumexp(s_ref, -1)
            o_q = ((torch.exp(s_ref - lse_ref[:, None]) @ v) - o).abs()  # [g, D]
            lse_q = (lse_ref - lse).abs()  # [g]
            steps = torch.einsum("gtc,ntc->gnt", q.abs().view(g, -1, MMA_K), k.abs().view(-1, d // MMA_K, MMA_K))
            running = steps.cumsum(-1)  # [g, n, 16]: S_t
            a = running[..., -1]  # [g, n]
            delta = (acc * running.sum(-1)  # 2. the score gemm's accumulation
                     + F32_COMBINE_ROUNDINGS * 2.0**-24 * a)  # 3. float32 combination
            big_l = torch.log((p * torch.exp(delta)).sum(-1))  # [g]: the LSE's move
            lse_extra[r, h * g:(h + 1) * g] = lse_q + big_l
            weight = p * (delta + big_l[:, None]) * torch.exp(delta + big_l[:, None])  # [g, n]
            scores_term = sum(torch.einsum("gn,gnc->gc", weight[:, j:j + KEY_BLOCK],
                                           (v[None, j:j + KEY_BLOCK, :] - o[:, None, :]).abs())
                              for j in range(0, k.shape[0], KEY_BLOCK))  # [g, D]
            e_abs = v.abs() / scale[:, h, None]  # [n, D]: |e4m3 value| (scales are > 0: fp8.quantize_rows)
            floor = TWO_PART_ABS * (_tiles_max_scale(scale[:, h]) / P_RANGE) @ e_abs  # [D]: 4. P's floor
            value_acc = 2 * acc * (p @ v.abs())  # [g, D]: 5. the value gemm's accumulation
            out_extra[r, h * g:(h + 1) * g] = (o_q + scores_term + floor[None, :] + value_acc)[..., to_head]
    return out_extra, lse_extra


def fp8_tc_extra(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_tc_extra_bounds` of a decode gate's inputs: what `checks.run_case(..., extra=...)` adds to its bounds."""
    return fp8_tc_extra_bounds(inputs.pool, inputs.query, inputs.table)


__all__ = ["effective_query", "FP8_MMA_BITS_KEPT", "E4M3_FRACTION_BITS", "E4M3_SUBNORMAL_HALF_SPACING", "TWO_PART_LO",
           "TWO_PART_REL", "TWO_PART_ABS", "Q_RANGE", "P_RANGE", "MMA_K", "BLOCK_N", "F32_COMBINE_ROUNDINGS", "fp8_tc_extra_bounds",
           "fp8_tc_extra"]
