"""The bound of the FP8 tensor-core decode (`fp8_math="tensor_cores"`, the FP8 pool's default decode;
kernels/decode_partial_fp8_tc.py), derived: the bf16 gate's bound (checks.py) plus the roundings that partial adds.
FP8 wgmma's accumulation enters through the rule measured on the H200 (papermill_runs/h200-20261204-s21/,
`foldkv.lab.fp8_accumulation`'s docstring): each k32 step is one add of the accumulator and 32 exact products, every
addend truncated to b = FP8_MMA_BITS_KEPT = 14 bits below the add's largest addend.

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
  2. The score gemm's accumulation in FP8 wgmma: 16 k32 steps (4 panels of 4) into one accumulator per column of N,
     the query's hi part in one column and its lo part in another (each its own accumulation, added after in
     float32). Per column (`fp8_accumulation.accumulation_bound`, worst case per addend): step t's add, whose largest
     |addend| M_t is at most max(|the exact partial sum of the first t - 1 steps| + the error so far, max_d|q_d| x
     max_d|k_jd| over the step's 32 columns), keeps a grid of <= 2^(1-b) M_t; each of the 32 products loses less than
     one grid step and at most itself (<= min(sum_d |q_d k_jd| over the step, 32 x 2^(1-b) M_t) for the step), the
     accumulator less than one grid step, and the float32 result rounds by <= 2^-23 of it; the error so far is
     carried into the next step's M. The partial sums and |products| come from the float64 reference over each part
     (`query_parts`, in q's units: the bound is relative to M, so the kernel's gains do not change it). The earlier
     term, 2^-b x the running sum of |q_d k_jd| per step (one rounding per add), is below the measured error on the
     characterisation's all-positive cells (0.079x on the worst, where the accumulator is the largest addend and
     every product is cut to its grid) and on its mixed spread-8 cells: the per-addend count is what the committed
     data requires. On the gates' inputs the new term is ~4-8x the old one at b = 13 (a median ~0.4-0.55 in the LSE
     at 65 and 1,000 tokens on the CPU, where the old one gave ~0.09); the rule's own model on the same inputs errs
     ~100x below it (worst case per addend against typical losses). The one-part red twin's query rounding moves
     the LSE by up to ~0.2 at 10,602 tokens on those inputs, ~0.3 of this bound: whether the GPU red twin still fails
     there is for the H200 to say (bench/FP8_NOTES.md, run 17: outcome).
  3. The float32 combination of the hi and lo columns with the token's and the query's scales:
     F32_COMBINE_ROUNDINGS roundings of 2^-24 of a value <= a_j.
  4. P as two e4m3 parts: P~ = p scale_j 256 / (the tile's largest scale) <= 256, rounded as in 1: relative 2^-8
     (the bf16 gate's P term, P_ROUNDING, already holds it) and an absolute floor of 2^-14 in P~'s units, i.e.
     2^-14 (tile max scale / 256) |e_jc| per key in the unnormalised output (e: the e4m3 value, v = e x scale), at
     most that after dividing by the denominator (>= 1: the largest key contributes exp(0)).
  5. The value gemm's accumulation: each 64-token tile into a fresh accumulator, 2 k32 steps (32 tokens each), per
     output column c and P column (hi, lo), then added into O in float32 (the bf16 gate's float32 terms). The same
     per-addend bound per tile, with an addend of the hi column <= (1 + 2^-4) p_j |v_jc| + 2^-10 (tile max scale /
     256) |e_jc| and of the lo column (divided by 16) <= 2^-4 (1 + 2^-4) p_j |v_jc| + 2^-9 (tile max scale / 256)
     |e_jc|, the partial sum's magnitude bounded by its addends' sum (P's parts are not computed), the largest addend
     by the chunk's max p times max |v| (and max |e| for the floor); summed over the tiles.
The score errors (2-3: delta_j >= 0 per key) move the LSE by at most L = log(sum_j p_j exp(delta_j)) (both ways, by
Jensen) and output column c by at most sum_j p_j (delta_j + L) exp(delta_j + L) |v_jc - o_c| (|p'_j - p_j| <=
p_j |exp(delta_j - log Z') - 1|, |log Z'| <= L), not only to first order; p and o over the effective query.
"""

from __future__ import annotations

import torch

from ...fp8 import FP8_DTYPE
from ..fp8_accumulation import BITS_KEPT, accumulation_bound
from ...layout import score_window, value_window, value_window_to_head
from ...pool import BlockTable, PagedKvPool

# Measured: FP8 wgmma truncates every addend of a k32 step's add (the accumulator and the 32 products) to 14 bits below
# the add's largest addend (papermill_runs/h200-20261204-s21/, fitted and checked cell by cell in
# fp8_accumulation's docstring)
FP8_MMA_BITS_KEPT = BITS_KEPT
E4M3_FRACTION_BITS = 3
E4M3_SUBNORMAL_HALF_SPACING = 2.0**-10  # e4m3's smallest subnormal is 2^-9
TWO_PART_LO = 16.0  # the lo part is stored times 16
TWO_PART_REL = 2.0 ** (-2 * (E4M3_FRACTION_BITS + 1))  # 2^-8: hi's 2^-4, then lo's 2^-4 of the residual
TWO_PART_ABS = E4M3_SUBNORMAL_HALF_SPACING / TWO_PART_LO  # 2^-14
Q_RANGE, P_RANGE = 448.0, 256.0  # the query's and P's gains: their largest value before e4m3
MMA_K, BLOCK_N = 32, 64  # FP8 wgmma's k step; the partial's tile of tokens
F32_COMBINE_ROUNDINGS = 8
KEY_BLOCK = 8192  # keys per block of the [g, keys, D] float64 differences (a few hundred MB)


def query_parts(query: torch.Tensor, parts: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The query's e4m3 parts as the tensor-core partial's score gemm sees them, each in q's units, float64 [..., D]:
    (hi x max|q| / 448, lo / 16 x max|q| / 448) with x = q * (448 / max|q|) in float32, hi = e4m3(x),
    lo = e4m3(16 (x - hi)); `parts=1`: lo is zero. Each part is its own accumulator column of the score gemm."""
    q = query.float()
    amax = q.abs().amax(-1).clamp_min(1e-30)
    x = q * (torch.full_like(amax, Q_RANGE) / amax)[..., None]
    hi = x.to(FP8_DTYPE).float()
    inv = (amax * torch.tensor(1.0 / Q_RANGE, dtype=torch.float32, device=q.device)).double()[..., None]
    lo = (((x - hi) * TWO_PART_LO).to(FP8_DTYPE).double() / TWO_PART_LO if parts == 2
          else torch.zeros_like(hi, dtype=torch.float64))
    return hi.double() * inv, lo * inv


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


def _value_accumulation(p: torch.Tensor, v: torch.Tensor, e_abs: torch.Tensor, scale: torch.Tensor,
                        bits: int) -> torch.Tensor:
    """Term 5 (module docstring), [g, D] float64: the value gemm's accumulation bound summed over the 64-token tiles,
    each tile one accumulator of two k32 steps, for P's hi column and its lo column. p [g, n] (normalised), v [n, D]
    (value-window order), e_abs [n, D] its |e4m3 value|, scale [n] the tokens' scales. An addend of the hi column is
    <= (1 + 2^-4) p_j |v_jc| + 2^-10 (tile max scale / 256) |e_jc|, of the lo column (P~'s residual, divided by 16)
    <= 2^-4 (1 + 2^-4) p_j |v_jc| + 2^-9 (tile max scale / 256) |e_jc|; the partial sums' magnitude is bounded by the
    sum of the addends' (P's parts are not computed here)."""
    g, n = p.shape
    pad = -n % BLOCK_N
    c = _tiles_max_scale(scale) / P_RANGE  # [n]: a P~ unit of each token's tile, in the output's units
    if pad:  # tokens past the request: zero addends
        p = torch.cat([p, p.new_zeros(g, pad)], -1)
        v, e_abs, c = (torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) for x in (v, e_abs, c))
    chunks = (n + pad) // MMA_K
    pc, vc = p.view(g, chunks, MMA_K), v.abs().view(chunks, MMA_K, -1)  # [g, C, 32], [C, 32, D]
    ec, cc = e_abs.view(chunks, MMA_K, -1), c.view(chunks, MMA_K)
    pv_sum = torch.einsum("gct,ctd->gcd", pc, vc)  # [g, C, D]
    pv_max = pc.amax(-1)[..., None] * vc.amax(1)[None]  # >= the chunk's largest p_j |v_jc|
    floor_sum = torch.einsum("ct,ctd->cd", cc, ec)[None]  # [1, C, D]
    floor_max = (cc.amax(-1)[..., None] * ec.amax(1))[None]
    total = 0.0
    for rel, floor in ((1 + 2.0**-4, 2.0**-10), (2.0**-4 * (1 + 2.0**-4), 2.0**-9)):
        abs_sums = rel * pv_sum + floor * floor_sum  # [g, C, D]
        largest = rel * pv_max + floor * floor_max

        def tiles(x):  # [g, C, D] -> [g, tiles, D, 2 steps]
            return x.expand(g, -1, -1).reshape(g, chunks // 2, 2, -1).transpose(2, 3)

        total = total + accumulation_bound(tiles(abs_sums), tiles(abs_sums), tiles(largest), bits).sum(1)
    return total


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
            steps = d // MMA_K
            k_steps = k.view(-1, steps, MMA_K)  # [n, 16, 32]
            score_acc = 0.0
            for part in query_parts(q_bf16, parts):  # 2. the score gemm's accumulation: hi's column and lo's
                q_steps = part.view(g, steps, MMA_K)
                score_acc = score_acc + accumulation_bound(
                    torch.einsum("gtc,ntc->gnt", q_steps, k_steps),
                    torch.einsum("gtc,ntc->gnt", q_steps.abs(), k_steps.abs()),
                    q_steps.abs().amax(-1)[:, None, :] * k_steps.abs().amax(-1)[None, :, :], bits_kept)  # [g, n]
            a = (q.abs() @ k.abs().T)  # [g, n]
            delta = (score_acc
                     + F32_COMBINE_ROUNDINGS * 2.0**-24 * a)  # 3. float32 combination
            big_l = torch.log((p * torch.exp(delta)).sum(-1))  # [g]: the LSE's move
            lse_extra[r, h * g:(h + 1) * g] = lse_q + big_l
            weight = p * (delta + big_l[:, None]) * torch.exp(delta + big_l[:, None])  # [g, n]
            scores_term = sum(torch.einsum("gn,gnc->gc", weight[:, j:j + KEY_BLOCK],
                                           (v[None, j:j + KEY_BLOCK, :] - o[:, None, :]).abs())
                              for j in range(0, k.shape[0], KEY_BLOCK))  # [g, D]
            e_abs = v.abs() / scale[:, h, None]  # [n, D]: |e4m3 value| (scales are > 0: fp8.quantize_rows)
            floor = TWO_PART_ABS * (_tiles_max_scale(scale[:, h]) / P_RANGE) @ e_abs  # [D]: 4. P's floor
            value_acc = _value_accumulation(p, v, e_abs, scale[:, h], bits_kept)  # [g, D]: 5. the value gemm's
            out_extra[r, h * g:(h + 1) * g] = (o_q + scores_term + floor[None, :] + value_acc)[..., to_head]
    return out_extra, lse_extra


def fp8_tc_extra(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8_tc_extra_bounds` of a decode gate's inputs: what `checks.run_case(..., extra=...)` adds to its bounds."""
    return fp8_tc_extra_bounds(inputs.pool, inputs.query, inputs.table)


__all__ = ["effective_query", "query_parts", "FP8_MMA_BITS_KEPT", "E4M3_FRACTION_BITS", "E4M3_SUBNORMAL_HALF_SPACING",
           "TWO_PART_LO", "TWO_PART_REL", "TWO_PART_ABS", "Q_RANGE", "P_RANGE", "MMA_K", "BLOCK_N",
           "F32_COMBINE_ROUNDINGS", "fp8_tc_extra_bounds", "fp8_tc_extra"]
