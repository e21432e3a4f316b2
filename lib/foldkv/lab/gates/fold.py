"""The fold costs no accuracy: in float64 it is an identity (folded == split == dense attention from raw inputs,
`dense_attention_reference`: `fold_identity`); in bf16 each format's kernel output is measured against the unrounded
truth (`folded_vs_split`, per case and over a run)."""

from __future__ import annotations

import math

import torch

from ...config import GEMMA4_31B, AttentionGeometry
from ...layout import KvFormat
from ...pool import PagedKvLayout, PagedKvPool
from ...prep import apply_rope, prep_and_store, prep_query, rms_norm, rope_cos_sin
from ...reference import paged_attention_reference
from .inputs import GateInputs, case_q_lens, fill_sequences


def dense_attention_reference(geom: AttentionGeometry, q: torch.Tensor, kv: torch.Tensor, q_norm_weight: torch.Tensor,
                              k_norm_weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal global attention of one sequence in float64 from raw projections q [T, Hq, D], kv [T, Hkv, D] (RoPE
    angles in float32, as the model computes them) -> [T, Hq, D] head order. Unchecked."""
    eps = geom.rms_norm_eps
    cos, sin = (t.double() for t in rope_cos_sin(geom, positions))  # [T, D]
    qn = apply_rope(rms_norm(q.double(), eps, q_norm_weight.double()).double(), cos, sin)  # [T, Hq, D]
    k = apply_rope(rms_norm(kv.double(), eps, k_norm_weight.double()).double(), cos, sin)  # [T, Hkv, D]
    v = rms_norm(kv.double(), eps).double()  # [T, Hkv, D]
    g = geom.group_size
    k = k.repeat_interleave(g, dim=1)  # [T, Hq, D]
    v = v.repeat_interleave(g, dim=1)  # [T, Hq, D]
    scores = torch.einsum("qhd,khd->hqk", qn, k)  # [Hq, T, T]; scaling is 1.0 for Gemma 4
    mask = positions[None, :] > positions[:, None]  # [T, T] key after query
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [Hq, T, T]
    return torch.einsum("hqk,khd->qhd", probs, v)  # [T, Hq, D]


def unrounded_truth(inputs: GateInputs) -> torch.Tensor:
    """Attention of the gate's raw projections with no bf16 rounding anywhere (float64 prep into a float64 split
    pool): the common truth both formats are measured against, since their bf16 pools round different things."""
    case, geom = inputs.case, inputs.pool.geometry
    dev = inputs.pool.device
    lay = PagedKvLayout(geom, KvFormat.SPLIT, page_size=64, num_pages=sum(-(-n // 64) for n in case.seq_lens),
                        dtype=torch.float64)
    pool = PagedKvPool(lay, device=dev)
    table = pool.allocate(case.seq_lens).to(dev)
    fill_sequences(pool, table, [x.to(dev, torch.float64) for x in inputs.raw["kv"]],
                   inputs.raw["k_norm_weight"].to(dev, torch.float64))
    q_lens = case_q_lens(case)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(case.seq_lens, q_lens)]).to(dev)
    query = prep_query(geom, KvFormat.SPLIT, inputs.raw["q"].to(dev, torch.float64),
                       inputs.raw["q_norm_weight"].to(dev, torch.float64),
                       inputs.raw["k_norm_weight"].to(dev, torch.float64), positions, out_dtype=torch.float64)
    out, _ = paged_attention_reference(pool, query, table, inputs.q_lens)
    return out


# Folding moves the bf16 rounding (w_k into the query instead of into K); the two formats' rounding errors have the
# same statistics, so per case either can come out ahead, and a tight per-case rule such as "folded <= 1.25 x split
# + 1e-3" fails correct kernels: in the committed H200 records (papermill_runs/h200-20261129*/
# 02_correctness_gates.record.json, 20 cases) the peaked decode has folded 1.48e-2 against split 8.86e-3 (ratio 1.68,
# 3.8e-3 over that rule). Why a decode can: it has one query row per request, so the query-side rounding (where the
# fold puts w_k) is a sample of 32 x 512 numbers, against every key's in the split format. The same records show it:
# the log of the folded/split ratio has standard deviation 0.25 over the 13 decode cases and 0.035 over the 7 prefill
# cases (many query rows), mean 0.006 over all 20 (geometric mean ratio 1.006). Hence two rules:
#  - per case, ratio <= 2 (log 2 = 2.8 decode standard deviations): a broken fold is off by far more;
#  - over the run, geometric mean ratio <= 1.1 (log 1.1 = 2.1 standard errors of the mean log ratio, 0.20 / sqrt(20)):
#    "folding costs no accuracy" is a claim about the formats, tested where the per-case noise averages out.
FOLD_CASE_RATIO, FOLD_MEAN_RATIO = 2.0, 1.1


def folded_vs_split(folded_out: torch.Tensor, split_out: torch.Tensor, truth: torch.Tensor) -> dict:
    """Compare the two formats' outputs for the same raw inputs, each against the unrounded truth."""
    rel = lambda o: float((o.double() - truth).norm() / truth.norm())  # noqa: E731
    rf, rs = rel(folded_out), rel(split_out)
    return {"rel_folded_vs_truth": rf, "rel_split_vs_truth": rs, "ratio": rf / rs if rs > 0 else math.inf,
            "max_abs_folded_minus_split": float((folded_out.double() - split_out.double()).abs().max()),
            "passed": rf <= FOLD_CASE_RATIO * rs}


def folded_vs_split_overall(rows: list[dict]) -> dict:
    """Over a run's cases: the geometric mean of folded/split error ratios must stay within FOLD_MEAN_RATIO."""
    ratios = [r["ratio"] for r in rows if math.isfinite(r["ratio"]) and r["ratio"] > 0]
    geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else math.nan
    return {"cases": len(ratios), "geomean_ratio": geo, "min_ratio": min(ratios, default=math.nan),
            "max_ratio": max(ratios, default=math.nan), "passed": bool(ratios) and geo <= FOLD_MEAN_RATIO}


def sequence_pool_attention(geom: AttentionGeometry, fmt: KvFormat | str, q: torch.Tensor, kv: torch.Tensor,
                            q_norm_weight: torch.Tensor, k_norm_weight: torch.Tensor, pool_dtype: torch.dtype,
                            page_size: int = 16, seed: int = 0):
    """One whole sequence (raw q [T, Hq, D], kv [T, Hkv, D] at positions 0..T-1) prepped into a NaN-filled pool of
    scattered pages, then attended causally by the paged reference: (out, lse, pool, table)."""
    t = q.shape[0]
    pool = PagedKvPool(PagedKvLayout(geom, fmt, page_size=page_size, num_pages=2 * (t // page_size + 1),
                                     dtype=pool_dtype), fill=float("nan"))
    table = pool.allocate([t], scatter_seed=seed)
    query = prep_and_store(pool, table, torch.zeros(t, dtype=torch.long), torch.arange(t), q, kv, q_norm_weight,
                           k_norm_weight)
    out, lse = paged_attention_reference(pool, query, table, q_lens=torch.tensor([t]))
    return out, lse, pool, table


def fold_identity(seed: int, tokens: tuple[int, ...] = (1, 54, 97), geom: AttentionGeometry = GEMMA4_31B) -> list[dict]:
    """In float64 the fold is an identity: folded-pool attention == split-pool attention == dense attention from raw
    inputs, up to float64 rounding. One row per sequence length (causal prefill of the whole sequence)."""
    rows = []
    for t in tokens:
        g = torch.Generator().manual_seed(seed + t)
        q = torch.randn(t, geom.num_q_heads, geom.head_dim, generator=g, dtype=torch.float64)
        kv = torch.randn(t, geom.num_kv_heads, geom.head_dim, generator=g, dtype=torch.float64)
        qw = torch.rand(geom.head_dim, generator=g, dtype=torch.float64) * 0.5 + 0.75
        kw = torch.rand(geom.head_dim, generator=g, dtype=torch.float64) * 0.5 + 0.75
        dense = dense_attention_reference(geom, q, kv, qw, kw, torch.arange(t))
        outs = {fmt: sequence_pool_attention(geom, fmt, q, kv, qw, kw, torch.float64, seed=seed)[0] for fmt in KvFormat}
        scale = float(dense.abs().max())
        row = {"tokens": t,
               "split_vs_dense": float((outs[KvFormat.SPLIT] - dense).abs().max()) / scale,
               "folded_vs_dense": float((outs[KvFormat.FOLDED] - dense).abs().max()) / scale,
               "folded_vs_split": float((outs[KvFormat.FOLDED] - outs[KvFormat.SPLIT]).abs().max()) / scale}
        row["passed"] = max(row["split_vs_dense"], row["folded_vs_dense"], row["folded_vs_split"]) < 1e-12
        rows.append(row)
    return rows
