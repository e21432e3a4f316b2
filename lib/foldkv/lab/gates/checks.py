"""The checks that hold a kernel arm against the float64 reference: the derived tolerances of the output and the LSE,
`compare`, `agree`, `compare_lse`, `run_case` (poisoned outputs, every row written, nothing past the plan touched),
the rows an arm's reference reads, and the arms under test (the launchers as launch(inputs, out, lse))."""

from __future__ import annotations

import math
from typing import Callable

import torch

from ...layout import KvFormat, value_window_to_head
from ...pool import BlockTable, PagedKvPool
from ...reference import paged_attention_reference
from .inputs import OUT_POISON, Case, GateInputs, bits, poisoned_outputs

# Tolerance. The specified bound is |d| <= ABS + REL * |ref| elementwise and relative Frobenius error <= FRO; it is
# reported as is (`specified_bound_ok`, and the count of elements over it). The gate holds the kernel to that bound plus
# the two roundings every bf16 flash kernel makes, derived rather than fitted:
#  - the output is bf16: a float32 result within float32 error of a rounding midpoint is stored one ulp from the
#    correctly rounded reference (2^-7 at |ref| in [1, 2)), which alone exceeds ABS + REL * |ref| for |ref| in
#    [1, 1.45) and [2, 3.4): a correct H200 kernel exceeds the specified bound there by 3e-4 (max |d| 0.0078, rel
#    1.7e-3);
#  - P is rounded to bf16 for the tensor-core P.V product: each probability moves by at most 2^-8 of itself, so an
#    output element moves by at most 2^-8 * sum_j p_j |v_j| (= 2^-8 * (P @ |V|), computed by the reference).
P_ROUNDING = 2.0**-8
P_SCALED_ROUNDING = 2.0**-8  # bf16 rounding of P x scale, relative (round to nearest, 8 significant bits: u = 2^-8)
ABS_TOL, REL_TOL, FRO_TOL = 2e-3, 4e-3, 3e-3

# LSE bound, derived per row like the output's (`lse_bound`). The kernels compute the LSE in float32 from the same bf16
# q and k the float64 reference reads (products of two bf16 are exact in float32), so only their arithmetic errs. With
# r = 2^-23 the most one float32 rounding moves a value, relative to it (one ulp, so adders that truncate are covered):
#  - scores: the tensor cores add the D = 512 products in MMA steps of K = 16 columns into a float32 accumulator, at
#    most two roundings per step (the step's own sum, its add into the accumulator), each of a partial sum bounded by
#    a_j = sum_d |q_d k_jd|; so |score error_j| <= (2 D / 16) r a_j, and the LSE, a p-weighted mean in its scores to
#    first order, moves by <= (2 D / 16) r sum_j p_j a_j (`score_abs_p` from the reference);
#  - the exp2 domain: scaling by log2 e, subtracting the running max, adding the max back, the final x ln 2: at most
#    six roundings of values bounded by 2 (max_j a_j + |lse|) (`score_abs_max`);
#  - the sum of exps: n positive terms, summed in tiles of at most 128 (a reduction of depth <= 128), carried across
#    tiles of at least 32 keys by `denom * rescale + tile_sum` (three roundings and one exp2 per tile), then three
#    merge levels; each exp2 / log2 is the hardware approximation (relative / absolute error <= 2^-22). A relative
#    error rho in the sum moves the log by <= rho.
# A worst case: typical gate rows get 7e-4 to 1e-3 (peaked 3e-3, spread 1e-4; 3.8e-3 at 163,336 keys, from the carry
# across tiles), where the committed H200 gates measured at most 9e-5; a decode missing one of 65 keys exceeds it.
LSE_ROUNDING = 2.0**-23
LSE_MMA_K, LSE_TILE_MAX, LSE_TILE_MIN, LSE_MERGE_LEVELS = 16, 128, 32, 3
LSE_APPROX = 2.0**-22


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (8 significant bits): 2^(e-7) for |x| in [2^e, 2^(e+1)); 0 at x == 0."""
    _, e = torch.frexp(x.abs())  # |x| = m * 2^e, m in [0.5, 1)
    return torch.where(x != 0, torch.ldexp(torch.ones_like(x), e - 8), torch.zeros_like(x))


def compare(out: torch.Tensor, ref: torch.Tensor, pv_abs: torch.Tensor | None = None, *,
            p_scaled: bool = False, extra: torch.Tensor | None = None) -> dict:
    """Elementwise bound and relative Frobenius error of a kernel output against a float64 reference. `pv_abs`
    (P @ |V| from the reference) adds the derived bf16 terms; without it only the specified bound is applied.

    p_scaled (an FP8 pool's decode): the kernel rounds P times each token's scale to bf16, so no probability is exact
    any more (a bf16 kernel's P of 1 is): a relative error up to 2^-8 on every key's weight, all of one sign when
    one key holds the attention. The Frobenius bound then gains that term, 2^-8 ||P|V| || / ||ref||, derived; the
    data that showed it needed: papermill_runs/h200-20261130-s4, notebook 02's needle at 200,000 / 100,000.

    extra: a kernel's own derived terms (elementwise, e.g. `fp8_tc.fp8_tc_extra_bounds`), added to the elementwise
    bound and, as ||extra|| / ||ref||, to the Frobenius one."""
    o, r = out.double(), ref.double()
    diff = (o - r).abs()
    specified_bound = ABS_TOL + REL_TOL * r.abs()
    bound = specified_bound if pv_abs is None else specified_bound + bf16_ulp(r) + P_ROUNDING * pv_abs.double()
    if extra is not None:
        bound = bound + extra.double()
    finite = bool(torch.isfinite(o).all())
    rel = float((o - r).norm() / r.norm().clamp_min(1e-300))
    fro_tol = FRO_TOL
    if p_scaled and pv_abs is not None:
        fro_tol += P_SCALED_ROUNDING * float(pv_abs.double().norm() / r.norm().clamp_min(1e-300))
    if extra is not None:
        fro_tol += float(extra.double().norm() / r.norm().clamp_min(1e-300))
    worst = float((diff - bound).max()) if finite else math.inf
    over_specified = int((diff > specified_bound).sum()) if finite else o.numel()
    return {
        "max_abs": float(diff.max()) if finite else math.inf,
        "rel_fro": rel if finite else math.inf,
        "elementwise_ok": finite and worst <= 0,
        "rel_ok": finite and rel <= fro_tol,
        "rel_bound": fro_tol,
        "worst_margin": worst,
        "specified_bound_ok": finite and over_specified == 0,
        "over_specified_bound": over_specified,
        "elements": o.numel(),
    }


def agree(a: torch.Tensor, b: torch.Tensor, ref: torch.Tensor, pv_abs: torch.Tensor) -> dict:
    """Two bf16 kernel outputs of the same attention (e.g. a prefill's last row and a decode of that token): each
    within the derived bound of the float64 reference, and so their difference within the sum of the two bounds
    (each may be an ulp off on either side: comparing them with one bound would hold two roundings to one)."""
    ca, cb = compare(a, ref, pv_abs), compare(b, ref, pv_abs)
    r = ref.double()
    bound = ABS_TOL + REL_TOL * r.abs() + bf16_ulp(r) + P_ROUNDING * pv_abs.double()
    diff = (a.double() - b.double()).abs()
    both_ok = ca["elementwise_ok"] and cb["elementwise_ok"] and ca["rel_ok"] and cb["rel_ok"]
    return {"max_abs": float(diff.max()), "rel": float(diff.norm() / r.norm()), "a_vs_ref": ca["max_abs"],
            "b_vs_ref": cb["max_abs"], "passed": both_ok and bool((diff <= 2 * bound).all())}


def reference_with_scales(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, q_lens: torch.Tensor | None = None,
                          *, abs_weighted: bool = True, score_abs: bool = False) -> tuple[torch.Tensor, ...]:
    """`paged_attention_reference`'s (out, lse), then the scales of a kernel's rounding errors from the same float64
    probabilities: `abs_weighted` P @ |V| [Tq, Hq, D] (head order); `score_abs` score_abs_p = sum_j p_j sum_d
    |q_d k_jd| and score_abs_max = max_j sum_d |q_d k_jd| [Tq, Hq] (`lse_bound`)."""
    to_head = value_window_to_head(pool.geometry, pool.format).to(pool.device)
    pv_abs = torch.empty(query.shape, dtype=torch.float64, device=pool.device)
    s_abs_p, s_abs_max = (torch.empty(query.shape[:2], dtype=torch.float64, device=pool.device) for _ in range(2))

    def per_block(rows, qb, keys, vals, probs, mask):  # probs [Hkv, g, b, n]
        hq, b = probs.shape[0] * probs.shape[1], probs.shape[2]
        if abs_weighted:
            pv_abs[rows] = torch.einsum("hgqk,khd->qhgd", probs, vals.abs()).reshape(b, hq, -1)[..., to_head]
        if score_abs:
            sa = torch.einsum("qhgd,khd->hgqk", qb.abs(), keys.abs()).masked_fill(mask, 0.0)  # [Hkv, g, b, n]
            s_abs_p[rows] = (probs * sa).sum(-1).reshape(hq, b).transpose(0, 1)
            s_abs_max[rows] = sa.amax(-1).reshape(hq, b).transpose(0, 1)

    out, lse = paged_attention_reference(pool, query, table, q_lens, per_block=per_block)
    return (out, lse) + ((pv_abs,) if abs_weighted else ()) + ((s_abs_p, s_abs_max) if score_abs else ())


def lse_bound(score_abs_p: torch.Tensor, score_abs_max: torch.Tensor, lse_ref: torch.Tensor, n_keys: torch.Tensor,
              head_dim: int) -> torch.Tensor:
    """The derived bound [Tq, Hq] on |kernel LSE - reference LSE| (natural log) for each row, from the reference's
    score_abs_p / score_abs_max / lse [Tq, Hq] and the keys each row sees, n_keys [Tq]. See LSE_ROUNDING above."""
    r = LSE_ROUNDING
    scores = (2 * head_dim / LSE_MMA_K) * r * score_abs_p.double()
    shift = 6 * r * 2 * (score_abs_max.double() + lse_ref.double().abs())
    tiles = torch.ceil(n_keys.double().to(lse_ref.device) / LSE_TILE_MIN)[:, None]  # [Tq, 1]
    sums = (LSE_TILE_MAX + 3 * tiles + 3 * LSE_MERGE_LEVELS) * r + (tiles + 2 * LSE_MERGE_LEVELS + 1) * LSE_APPROX
    return scores + shift + sums


def row_key_counts(table: BlockTable, q_lens: torch.Tensor | None) -> torch.Tensor:
    """[Tq] the number of keys each query row sees: its request's length for a decode; causal for a prefill chunk."""
    seq = table.seq_lens.cpu().long()
    if q_lens is None:
        return seq
    return torch.cat([torch.arange(n - m + 1, n + 1) for n, m in zip(seq.tolist(), q_lens.cpu().long().tolist())])


def compare_lse(lse: torch.Tensor, ref_lse: torch.Tensor, bound: torch.Tensor) -> dict:
    """A kernel's LSE against the reference's, row by row within `bound` (lse_bound)."""
    if not bool(torch.isfinite(lse).all()):
        return {"lse_max_abs": math.inf, "lse_worst_fraction_of_bound": math.inf, "lse_ok": False}
    diff = (lse.double() - ref_lse.double()).abs()
    frac = float((diff / bound).max())
    return {"lse_max_abs": float(diff.max()), "lse_bound_min": float(bound.min()), "lse_worst_fraction_of_bound": frac,
            "lse_ok": frac <= 1.0}


def decode_fp8_math(pool: PagedKvPool, fp8_math: str | None) -> str:
    """The FP8 decode partial a decode over `pool` with `fp8_math` (None: the default) runs, as `decode` resolves
    it: "tensor_cores" or "exact" ("exact" for a bf16 pool, whose rows need no conversion)."""
    from ...kernels.decode import parse_fp8_math

    return parse_fp8_math(fp8_math, pool.layout.quantized)


def decode_extra(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, fp8_math: str | None):
    """The terms a decode's kernel adds to the bf16 gate's bound, by the partial it resolves: the FP8 tensor-core
    partial's (`fp8_tc.fp8_tc_extra_bounds`: (out [B, Hq, D], lse [B, Hq]) float64), or (None, 0.0) for the exact
    FP8 partial and a bf16 pool (the bf16 gate's bound, with `compare(p_scaled=...)`, is the whole bound)."""
    if decode_fp8_math(pool, fp8_math) != "tensor_cores":
        return None, 0.0
    from .fp8_tc import fp8_tc_extra_bounds

    return fp8_tc_extra_bounds(pool, query, table)


def run_case(inputs: GateInputs, launch: Callable, pad_rows: int = 3,
             extra: Callable[[GateInputs], tuple] | None = None) -> dict:
    """Launch one kernel arm on a gate's inputs with poisoned outputs; check it against the float64 reference, that
    every planned row is written and finite, and that every row past the plan is bit-for-bit untouched. `extra`:
    extra(inputs) -> (output terms [Tq, Hq, D], LSE terms [Tq, Hq]) a kernel's own roundings add to the derived
    bounds (the FP8 tensor-core decode's: `fp8_tc.fp8_tc_extra`). None: a decode arm that names its `fp8_math`
    (`launch.fp8_math`: `decode_arm`, `graph_arm`; None there is the default) over an FP8 pool gets the terms of the
    partial it resolves (`decode_extra`: the tensor-core one's by default, none for "exact")."""
    geom = inputs.pool.geometry
    tokens = inputs.query.shape[0]
    out_buf, lse_buf = poisoned_outputs(tokens, geom, inputs.pool.device, pad_rows)
    tail_out, tail_lse = bits(out_buf[tokens:]).clone(), bits(lse_buf[tokens:]).clone()
    pool_before = bits(inputs.pool.data).clone()
    out, lse = launch(inputs, out_buf[:tokens], lse_buf[:tokens])
    torch.cuda.synchronize() if inputs.pool.device.type == "cuda" else None
    ref_pool, ref_table, p_scaled = attended_rows(inputs, getattr(launch, "fp8_rows", "gather"))
    ref, ref_lse, pv_abs, s_abs_p, s_abs_max = reference_with_scales(ref_pool, inputs.query, ref_table, inputs.q_lens,
                                                                     score_abs=True)
    del ref_pool
    if extra is not None:
        extra_out, extra_lse = extra(inputs)
    elif hasattr(launch, "fp8_math") and inputs.q_lens is None:  # a decode arm: its partial's own terms
        extra_out, extra_lse = decode_extra(inputs.pool, inputs.query, inputs.table, launch.fp8_math)
    else:
        extra_out, extra_lse = None, 0.0
    res = compare(out, ref, pv_abs, p_scaled=p_scaled, extra=extra_out)
    res.update(compare_lse(lse, ref_lse, extra_lse + lse_bound(s_abs_p, s_abs_max, ref_lse,
                                                               row_key_counts(inputs.table, inputs.q_lens),
                                                               geom.head_dim)))
    res["all_written"] = bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    res["past_plan_untouched"] = (torch.equal(bits(out_buf[tokens:]), tail_out)
                                  and torch.equal(bits(lse_buf[tokens:]), tail_lse))
    res["pool_untouched"] = torch.equal(bits(inputs.pool.data), pool_before)
    res["passed"] = all(res[k] for k in ("elementwise_ok", "rel_ok", "all_written", "past_plan_untouched",
                                         "pool_untouched", "lse_ok"))
    res["outputs"] = (out.detach().clone(), lse.detach().clone())
    return res


def summary_row(case: Case, fmt: KvFormat, arm: str, res: dict) -> dict:
    """A JSON-able row for tables and records (drops the tensors)."""
    row = {"case": case.name, "kind": case.kind, "format": fmt.value, "arm": arm, "tokens": case.tokens,
           "batch": len(case.seq_lens)}
    row.update({k: v for k, v in res.items() if k != "outputs"})
    return row


def decode_arm(backend: str = "jit", fused: bool | None = None, fp8_math: str | None = None) -> Callable:
    """The decode launcher (`fused`: as `decode`'s, None = one fused launch when the plan is one wave; `fp8_math`: as
    `decode`'s, None the default: the tensor-core partial over an FP8 pool; the plan balanced for that partial's
    wave, `decode.partial_wave`). `launch.fp8_math` tells `run_case` which partial's bound applies."""
    def launch(inputs: GateInputs, out: torch.Tensor, lse: torch.Tensor):
        from ...kernels.decode import decode, partial_wave, plan_decode

        lay = inputs.pool.layout
        plan = plan_decode(lay, inputs.case.seq_lens, device=inputs.pool.device,
                           chunk_tokens=inputs.case.chunk_tokens, merge_group=inputs.case.merge_group,
                           num_sms=partial_wave(lay, inputs.pool.device, fp8_math if lay.quantized else None))
        return decode(inputs.pool, inputs.query, inputs.table, plan=plan, out=out, lse=lse, backend=backend,
                      fused=fused, fp8_math=fp8_math)

    launch.fp8_math = fp8_math  # run_case picks the bound of the partial it resolves
    return launch


def prefill_arm(backend: str = "jit", fp8_rows: str = "gather") -> Callable:
    """The prefill launcher; over an FP8 pool it reads the rows as `fp8_rows` says (foldkv.kernels.prefill), and
    `launch.fp8_rows` tells `run_case` which rows the float64 reference must read."""
    def launch(inputs: GateInputs, out: torch.Tensor, lse: torch.Tensor):
        from ...kernels.prefill import prefill

        return prefill(inputs.pool, inputs.query, inputs.table, inputs.q_lens, out=out, lse=lse, backend=backend,
                       fp8_rows=fp8_rows)

    launch.fp8_rows = fp8_rows
    return launch


def attended_rows(inputs: GateInputs, fp8_rows: str | None) -> tuple[PagedKvPool, BlockTable, bool]:
    """(pool, table, p_scaled): what the float64 reference of a kernel arm reads. A bf16 pool, or an FP8 pool read by
    the decode or by the prefill's "in_kernel" rows, is read as stored (an FP8 pool's rows dequantized exactly; the
    kernel rounds P x scale to bf16: `compare(p_scaled=True)`); a prefill over an FP8 pool with "gather" rows attends
    over those rows rounded to bf16 (`page_gather.bf16_pages_reference`, the rows the kernel reads), and then the
    bf16 bound is the whole bound."""
    quantized = inputs.pool.layout.quantized
    if quantized and inputs.q_lens is not None and fp8_rows == "gather":
        from ..page_gather import bf16_pages_reference

        return (*bf16_pages_reference(inputs.pool, inputs.table), False)
    return inputs.pool, inputs.table, quantized


def replay_workspace(ws, inputs: GateInputs, out: torch.Tensor, lse: torch.Tensor, *, backend: str = "jit",
                     fused: bool | None = None, advance: int = 0):
    """A planned `DecodeWorkspace` run as the decode step of `generate()` runs it: the inputs' queries copied in, the
    step captured as one CUDA graph, `advance` advance() calls, the outputs poisoned, the graph replayed; its rows
    copied into run_case's (poisoned) `out` and `lse`."""
    ws.query[:inputs.query.shape[0]].copy_(inputs.query)
    graph = ws.capture(inputs.pool, backend=backend, fused=fused)
    for _ in range(advance):
        ws.advance()
    ws.out.fill_(OUT_POISON)
    ws.lse.fill_(OUT_POISON)
    graph.replay()
    o, l = ws.output()
    out.copy_(o)
    lse.copy_(l)
    return out, lse


def graph_arm(backend: str = "jit", fused: bool | None = None, fp8_math: str | None = None) -> Callable:
    """The decode through the workspace's CUDA graph (`replay_workspace`): a workspace of the case's batch and
    longest length with its default chunks, planned for the case's lengths with the gate's poisoned block table.
    `fused`: as the workspace's step (None: one fused launch when its plan is one wave); `fp8_math`: the
    workspace's."""
    def launch(inputs: GateInputs, out: torch.Tensor, lse: torch.Tensor):
        from ...kernels.workspace import DecodeWorkspace

        lens, lay = list(inputs.case.seq_lens), inputs.pool.layout
        ws = DecodeWorkspace(lay, max_batch=len(lens), max_len=max(lens), device=inputs.pool.device,
                             fp8_math=fp8_math)
        ws.plan(lens, inputs.table.page_ids[:, :lay.pages_for(max(lens))].contiguous())
        return replay_workspace(ws, inputs, out, lse, backend=backend, fused=fused)

    launch.fp8_math = fp8_math  # run_case picks the bound of the partial it resolves
    return launch


def arm_for(case: Case, backend: str = "jit") -> Callable:
    return decode_arm(backend) if case.kind == "decode" else prefill_arm(backend)
