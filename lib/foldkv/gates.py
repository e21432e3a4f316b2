"""Correctness gates: the cases, the hostile set-up (poisoned padding, NaN/Inf pages, poisoned outputs) and the checks
that hold a kernel against the float64 reference, AOT against JIT and folded against split.

The gates notebook and the GPU tests both call these functions; nothing here imports TileLang (launchers do, lazily).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from .config import GEMMA4_31B, AttentionGeometry
from .layout import KvFormat
from .pool import BlockTable, PagedKvLayout, PagedKvPool
from .prep import fill_sequences, prep_query
from .reference import paged_attention_reference

# Tolerance of the issue: |d| <= ABS + REL * |ref| elementwise and relative Frobenius error <= FRO.
ABS_TOL, REL_TOL, FRO_TOL = 2e-3, 4e-3, 3e-3
POISON_PAGE_IDS = (-(2**31), 2**31 - 1, -1)  # entries past the real ones in page tables and plans
OUT_POISON = float("nan")


@dataclass(frozen=True)
class Case:
    """One gate: a batch of requests (`seq_lens`), each with `q_lens` queries at its end (1 = decode).

    `score_scale` scales the q_norm weight: large gives peaked attention (large scores), small gives spread attention.
    """

    name: str
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None  # None: decode
    chunk_tokens: int | None = None  # decode chunking override (to put a length on a chunk boundary)
    score_scale: float = 1.0
    scattered: bool = True

    @property
    def kind(self) -> str:
        return "decode" if self.q_lens is None else "prefill"

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    def as_dict(self) -> dict:
        return asdict(self)


def decode_cases(size: str = "full") -> list[Case]:
    """At least eight decode cases: lengths 1, 63, 64, 65, a chunk boundary +-1, 10,602, 163,336, ragged batches up to
    32 requests, peaked and spread attention. `size="smoke"` keeps the shapes, shrinks the long lengths."""
    long_a, long_b = (10602, 163336) if size == "full" else (1000, 4097)
    g = torch.Generator().manual_seed(2026)
    ragged32 = tuple(int(x) for x in torch.randint(1, 20000 if size == "full" else 700, (32,), generator=g))
    return [
        Case("len1", (1,)),
        Case("len63", (63,)),
        Case("len64", (64,)),
        Case("len65", (65,)),
        Case("chunk-1", (255,), chunk_tokens=128),
        Case("chunk+0", (256,), chunk_tokens=128),
        Case("chunk+1", (257,), chunk_tokens=128),
        Case(f"len{long_a}", (long_a,)),
        Case(f"len{long_b}", (long_b,)),
        Case("ragged4", (1, 97, 16384 if size == "full" else 640, 54)),
        Case("ragged32", ragged32),
        Case("peaked", (4096 if size == "full" else 300,), score_scale=4.0),
        Case("spread", (4096 if size == "full" else 300,), score_scale=0.05),
    ]


def prefill_cases(size: str = "full") -> list[Case]:
    """At least six prefill cases: a chunk starting mid-page, a one-token chunk, an 8,192 chunk ending at 163,336,
    a ragged batch, peaked and spread."""
    big_ctx, big_chunk = (163336, 8192) if size == "full" else (3000, 256)
    return [
        Case("mid-page", (1000,), q_lens=(77,)),  # starts at 923 = page 14 + 27
        Case("one-token", (4097,), q_lens=(1,)),
        Case("whole-seq", (300,), q_lens=(300,)),
        Case(f"chunk{big_chunk}@{big_ctx}", (big_ctx,), q_lens=(big_chunk,)),
        Case("ragged", (97, 2000, 64, 513), q_lens=(54, 129, 64, 1)),
        Case("peaked", (1500,), q_lens=(200,), score_scale=4.0),
        Case("spread", (1500,), q_lens=(200,), score_scale=0.05),
    ]


@dataclass
class GateInputs:
    """Everything a gate needs, made from one seed: raw projections through the torch prep into a hostile pool."""

    case: Case
    format: KvFormat
    pool: PagedKvPool
    table: BlockTable  # on the pool's device; padded past each request's pages with poison
    query: torch.Tensor  # [sum(q_lens), Hq, D] in the format's form
    q_lens: torch.Tensor | None
    raw: dict = field(repr=False, default_factory=dict)  # the raw projections (to build the other format)


def _case_q_lens(case: Case) -> list[int]:
    return list(case.q_lens) if case.q_lens is not None else [1] * len(case.seq_lens)


def make_inputs(case: Case, fmt: KvFormat | str, device: torch.device | str, seed: int,
                geom: AttentionGeometry = GEMMA4_31B, raw: dict | None = None, spare_pages: int = 3) -> GateInputs:
    """A hostile pool for `case`: pages scattered, unused pages holding NaN and Inf, page-table padding holding
    out-of-range and huge negative ids. `raw` reuses another format's raw projections (folded vs split)."""
    fmt = KvFormat.parse(fmt)
    device = torch.device(device)
    lay = PagedKvLayout(geom, fmt, page_size=64, num_pages=sum(-(-n // 64) for n in case.seq_lens) + spare_pages)
    pool = PagedKvPool(lay, device=device)
    pool.data.fill_(float("nan"))
    table = pool.allocate(case.seq_lens, scatter_seed=seed if case.scattered else None, pad_pages=len(POISON_PAGE_IDS))
    pool.data[pool.unused_page_ids()[-1]].fill_(float("inf"))  # an unused page of Inf beside the NaN ones
    for r in range(table.batch):  # poison past each request's real pages
        n = -(-int(table.seq_lens[r]) // 64)
        for i, v in enumerate(POISON_PAGE_IDS):
            table.page_ids[r, n + i] = v
        table.page_ids[r, n + len(POISON_PAGE_IDS):] = POISON_PAGE_IDS[0]
    q_lens = _case_q_lens(case)
    if raw is None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        raw = {
            "kv": [torch.randn(n, geom.num_kv_heads, geom.head_dim, generator=g) for n in case.seq_lens],
            "q": torch.randn(sum(q_lens), geom.num_q_heads, geom.head_dim, generator=g),
            "q_norm_weight": (torch.rand(geom.head_dim, generator=g) * 0.5 + 0.75) * case.score_scale * 0.25,
            "k_norm_weight": torch.rand(geom.head_dim, generator=g) * 0.5 + 0.75,
        }
    fill_sequences(pool, table, [x.to(device) for x in raw["kv"]], raw["k_norm_weight"].to(device))
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(case.seq_lens, q_lens)]).to(device)
    query = prep_query(geom, fmt, raw["q"].to(device), raw["q_norm_weight"].to(device),
                       raw["k_norm_weight"].to(device), positions).contiguous()
    return GateInputs(case, fmt, pool, table.to(device), query,
                      None if case.q_lens is None else torch.tensor(q_lens, dtype=torch.int32), raw)


def poisoned_outputs(tokens: int, geom: AttentionGeometry, device, pad_rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Output buffers with `pad_rows` extra rows past the plan; everything starts as NaN."""
    out = torch.full((tokens + pad_rows, geom.num_q_heads, geom.head_dim), OUT_POISON, dtype=torch.bfloat16, device=device)
    lse = torch.full((tokens + pad_rows, geom.num_q_heads), OUT_POISON, dtype=torch.float32, device=device)
    return out, lse


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Elementwise bound and relative Frobenius error of a kernel output against a float64 reference."""
    o, r = out.double(), ref.double()
    diff = (o - r).abs()
    bound = ABS_TOL + REL_TOL * r.abs()
    finite = bool(torch.isfinite(o).all())
    rel = float((o - r).norm() / r.norm().clamp_min(1e-300))
    worst = float((diff - bound).max()) if finite else math.inf
    return {
        "max_abs": float(diff.max()) if finite else math.inf,
        "rel_fro": rel if finite else math.inf,
        "elementwise_ok": finite and worst <= 0,
        "rel_ok": finite and rel <= FRO_TOL,
        "worst_margin": worst,
    }


def run_case(inputs: GateInputs, launch: Callable, pad_rows: int = 3) -> dict:
    """Launch one kernel arm on a gate's inputs with poisoned outputs; check it against the float64 reference, that
    every planned row is written and finite, and that every row past the plan is bit-for-bit untouched."""
    geom = inputs.pool.geometry
    tokens = inputs.query.shape[0]
    out_buf, lse_buf = poisoned_outputs(tokens, geom, inputs.pool.device, pad_rows)
    tail_out, tail_lse = _bits(out_buf[tokens:]).clone(), _bits(lse_buf[tokens:]).clone()
    pool_before = _bits(inputs.pool.data).clone()
    out, lse = launch(inputs, out_buf[:tokens], lse_buf[:tokens])
    torch.cuda.synchronize() if inputs.pool.device.type == "cuda" else None
    ref, ref_lse = paged_attention_reference(inputs.pool, inputs.query, inputs.table, inputs.q_lens)
    res = compare(out, ref)
    res["lse_max_abs"] = float((lse.double() - ref_lse).abs().max()) if bool(torch.isfinite(lse).all()) else math.inf
    res["all_written"] = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    res["past_plan_untouched"] = (torch.equal(_bits(out_buf[tokens:]), tail_out)
                                  and torch.equal(_bits(lse_buf[tokens:]), tail_lse))
    res["pool_untouched"] = torch.equal(_bits(inputs.pool.data), pool_before)
    res["passed"] = all(res[k] for k in ("elementwise_ok", "rel_ok", "all_written", "past_plan_untouched",
                                         "pool_untouched")) and res["lse_max_abs"] < 1e-2
    res["outputs"] = (out.detach().clone(), lse.detach().clone())
    return res


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
    q_lens = _case_q_lens(case)
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(case.seq_lens, q_lens)]).to(dev)
    query = prep_query(geom, KvFormat.SPLIT, inputs.raw["q"].to(dev, torch.float64),
                       inputs.raw["q_norm_weight"].to(dev, torch.float64),
                       inputs.raw["k_norm_weight"].to(dev, torch.float64), positions, out_dtype=torch.float64)
    out, _ = paged_attention_reference(pool, query, table, inputs.q_lens)
    return out


# Folding moves the bf16 rounding (w_k into the query instead of into K); it must not cost accuracy:
# rel(folded, truth) <= FOLD_RATIO * rel(split, truth) + FOLD_SLACK.
FOLD_RATIO, FOLD_SLACK = 1.25, 1e-3


def folded_vs_split(folded_out: torch.Tensor, split_out: torch.Tensor, truth: torch.Tensor) -> dict:
    """Compare the two formats' outputs for the same raw inputs, each against the unrounded truth."""
    rel = lambda o: float((o.double() - truth).norm() / truth.norm())  # noqa: E731
    rf, rs = rel(folded_out), rel(split_out)
    return {"rel_folded_vs_truth": rf, "rel_split_vs_truth": rs,
            "max_abs_folded_minus_split": float((folded_out.double() - split_out.double()).abs().max()),
            "bound": FOLD_RATIO * rs + FOLD_SLACK, "passed": rf <= FOLD_RATIO * rs + FOLD_SLACK}


def summary_row(case: Case, fmt: KvFormat, arm: str, res: dict) -> dict:
    """A JSON-able row for tables and records (drops the tensors)."""
    row = {"case": case.name, "kind": case.kind, "format": fmt.value, "arm": arm, "tokens": case.tokens,
           "batch": len(case.seq_lens)}
    row.update({k: v for k, v in res.items() if k != "outputs"})
    return row
