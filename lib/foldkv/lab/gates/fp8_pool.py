"""The FP8 folded pool's gates: its format error against the bf16 truth on the CPU (rows and output, each within a
derived bound), its kernels against the float64 reference over the rows they read (`fp8_kernel_gate`), and the
needle (one token holding the attention, checked end to end)."""

from __future__ import annotations

import math

import torch

from ...config import GEMMA4_31B, AttentionGeometry
from ...layout import KvFormat, value_window_columns
from ...pool import BlockTable, PagedKvLayout, PagedKvPool
from ...reference import paged_attention_reference
from .checks import (ABS_TOL, P_ROUNDING, REL_TOL, bf16_ulp, compare, decode_arm, decode_extra, decode_fp8_math,
                     prefill_arm, reference_with_scales, run_case, summary_row)
from .inputs import Case, fill_sequences, make_inputs
from .sections import gpu_section


# |q*scale - x| <= ROW_REL * |x| + ROW_SUB * scale, elementwise, derived from `foldkv.fp8.quantize_rows`'s rounding:
#  - e4m3 has 3 fraction bits: round to nearest moves a normal value (|y| >= 2^-6) by <= 2^-4 |y|, a subnormal one by
#    <= 2^-10 (half the spacing 2^-9); so |q - y| <= 2^-4 |y| + 2^-10;
#  - y = x / scale in float32 is off by <= 2^-24 |y|, and the clamp, which only float32 rounding can reach, by as
#    much again; the float64 product q*scale is exact. Together ROW_REL = 2^-4 + 2^-21 (a margin over 2^-4 + 2^-22).
ROW_REL, ROW_SUB = 2.0**-4 + 2.0**-21, 2.0**-10
BF16_REL = 2.0**-8  # round to nearest bf16 (8 significant bits) moves a value by at most 2^-8 of itself
FP8_DELTA = 1e-12  # the output bound's failure probability per event (one per key and one per output element)


def rounding_bound(rows: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The most `foldkv.fp8.quantize_rows` may move each element of `rows`: ROW_REL * |x| + ROW_SUB * scale, float64."""
    return ROW_REL * rows.to(torch.float32).double().abs() + ROW_SUB * scale.double()[..., None]


def fp8_row_check(pool: PagedKvPool, table: BlockTable, rows: list[torch.Tensor]) -> dict:
    """Format gate on the rows: an FP8 pool's dequantized rows against the float32 rows it was given (`rows[r]`
    [seq_len_r, Hkv, W] per request of `table`), element by element within the quantizer's derived bound
    (`rounding_bound`), with the scales recomputed from those rows (amax / 448), so a stored value or scale that is
    off is caught.
    Returns max |x^ - x| / bound ("max_ratio", <= 1 passes), the count of elements over it, and the relative
    Frobenius error."""
    from ...fp8 import quantize_rows

    worst, over, err2, ref2 = 0.0, 0, 0.0, 0.0
    for r, x in enumerate(rows):
        deq = pool.gather_values(table, r, torch.float64).cpu()
        x = x.to("cpu", torch.float32)
        bound = rounding_bound(x, quantize_rows(x)[1])
        err = (deq - x.double()).abs()
        ratio = err / bound
        worst = max(worst, float(ratio.nan_to_num(math.inf).max()))
        over += int((~(err <= bound)).sum())
        err2, ref2 = err2 + float(err.pow(2).sum()), ref2 + float(x.double().pow(2).sum())
    return {"max_ratio": worst, "over_bound": over, "rel_fro": math.sqrt(err2 / ref2), "passed": over == 0}


def fp8_output_bound(query: torch.Tensor, truth_rows: torch.Tensor, fp8_rows: torch.Tensor, scales: torch.Tensor,
                     geom: AttentionGeometry = GEMMA4_31B, delta: float = FP8_DELTA) -> torch.Tensor:
    """The derived bound on |o_fp8 - o_bf16| for one decode query [Hq, D] (folded form) over one request's folded
    rows: the bf16 truth [n, Hkv, W] and the FP8 pool's dequantized rows [n, Hkv, W] (float64), scales [n, Hkv].
    Returns [Hq, D] float64 in value-window order.

    Model: each element's error e = x^ - x_bf16 is a rounding, |e| <= b = (ROW_REL + 2^-8)|x| + ROW_SUB s (the FP8
    rounding of the float32 row and the bf16 rounding of the truth), zero-mean and independent across elements (the
    standard model of rounding data that does not sit on the grid). The score error of key j is
    eps_j = sum_c q_c e_jc; eta_j = eps_j - sum_i p_i eps_i. To first order o^ - o = sum_j p_j (eta_j (v_j - o) + e^V_j)
    = sum_j p_j (eps_j (v_j - o) + e^V_j), a sum of independent bounded terms: Hoeffding gives |first| <=
    sqrt(2 ln(2/delta) sum c^2) with c = |coefficient| b (the V_unrot elements sit in both windows: one coefficient).
    The rest is bounded with |eta_j| <= E = 2 max_j sqrt(2 ln(2/delta) sum_c q_c^2 b_jc^2) and
    r = E^2 e^E / 2 >= |e^eta - 1 - eta|: the exact softmax o^ - o = (L1 + N1 + N2) / (1 + rho) + L2 gives
    |o^ - o| <= first + (r (first + P b^V) + E P b^V + 2 r P|v^ - o|) / (1 - r) (infinite when r >= 1). Holds with
    probability >= 1 - delta (n + D) per KV head."""
    hkv, grp, d, rw = geom.num_kv_heads, geom.group_size, geom.head_dim, geom.rotary_width
    z = math.sqrt(2 * math.log(2 / delta))
    out = torch.empty(geom.num_q_heads, d, dtype=torch.float64)
    for h in range(hkv):
        x, xh = truth_rows[:, h].double(), fp8_rows[:, h].double()
        b = (ROW_REL + BF16_REL) * x.abs() * (1 + BF16_REL) + ROW_SUB * scales[:, h].double()[:, None]  # [n, W]
        q = query[h * grp:(h + 1) * grp].double()  # [g, D] score-window order
        s = q @ x[:, :d].T  # [g, n]
        p = torch.softmax(s, -1)
        v, vh, bv = x[:, rw:], xh[:, rw:], b[:, rw:]  # [n, D] value window
        o = p @ v  # [g, D]
        p2 = p * p
        sj = (q * q) @ (b[:, :d] ** 2).T  # [g, n]: sum_c q_c^2 b_jc^2
        w = p2 * sj
        var = w @ (v * v) - 2 * o * (w @ v) + o * o * w.sum(-1, keepdim=True)  # score part
        var = var + p2 @ (bv * bv)  # value part
        shared = d - rw  # value-window positions [0, D - R) are row columns [R, D): in the score window too
        qs = q[:, rw:d]  # [g, D - R]: the query column of each shared element
        cross = 2 * qs * (p2 @ (bv[:, :shared] ** 2 * v[:, :shared]) - o[:, :shared] * (p2 @ bv[:, :shared] ** 2))
        var[:, :shared] += cross
        first = z * var.clamp_min(0).sqrt()
        e_max = 2 * z * float(sj.max().sqrt())
        r = e_max**2 * math.exp(e_max) / 2 if e_max < 50 else math.inf
        pbv = p @ bv
        spread = torch.einsum("gn,gnd->gd", p, (vh[None] - o[:, None]).abs())  # P |v^ - o|
        rest = (r * (first + pbv) + e_max * pbv + 2 * r * spread) / (1 - r) if r < 1 else torch.full_like(first, math.inf)
        out[h * grp:(h + 1) * grp] = first + rest
    return out


def fp8_format_error(case: Case, seed: int, geom: AttentionGeometry = GEMMA4_31B) -> dict:
    """Format error of the FP8 folded pool, CPU: the case's raw projections (decode) prepped into a bf16 folded pool
    (the truth) and an FP8 one; the float64 reference over each; the rows against `fp8_row_check` and the output
    against `fp8_output_bound`, per element. One row: errors, bound ratios and whether both hold. Where scores are
    large the output bound's second-order term is infinite (`out_bound_finite` < 1): there only the row gate and the
    measured error speak."""
    from ...fp8 import FP8_DTYPE
    from ...prep import prep_rows

    inputs = make_inputs(case, KvFormat.FOLDED, "cpu", seed, geom=geom)
    lay = PagedKvLayout(geom, KvFormat.FOLDED, page_size=64, num_pages=inputs.pool.layout.num_pages, dtype=FP8_DTYPE)
    pool8 = PagedKvPool(lay, fill=float("nan"))
    table8 = pool8.allocate(case.seq_lens, scatter_seed=seed + 1)
    fill_sequences(pool8, table8, inputs.raw["kv"], inputs.raw["k_norm_weight"])
    rows32 = [prep_rows(geom, KvFormat.FOLDED, x, inputs.raw["k_norm_weight"], torch.arange(x.shape[0]),
                        out_dtype=torch.float32) for x in inputs.raw["kv"]]
    rows = fp8_row_check(pool8, table8, rows32)
    out_t, lse_t = paged_attention_reference(inputs.pool, inputs.query, inputs.table)
    out_8, lse_8 = paged_attention_reference(pool8, inputs.query, table8)
    to_window = value_window_columns(geom, KvFormat.FOLDED)  # head column at each value-window position
    worst, over, finite, total = 0.0, 0, 0, 0
    for r in range(table8.batch):
        bound = fp8_output_bound(inputs.query[r], inputs.pool.gather_values(inputs.table, r),
                                 pool8.gather_values(table8, r), pool8.gather_scales(table8, r), geom)
        err = (out_8[r] - out_t[r]).abs()[:, to_window]  # value-window order, as the bound is
        held = torch.isfinite(bound)
        finite, total = finite + int(held.sum()), total + bound.numel()
        if bool(held.any()):
            worst = max(worst, float((err[held] / bound[held]).max()))
        over += int((~(err <= bound)).sum())
    return {"case": case.name, "seq_lens": list(case.seq_lens), "score_scale": case.score_scale,
            "row_rel_fro": rows["rel_fro"], "row_max_over_bound": rows["max_ratio"], "rows_passed": rows["passed"],
            "out_rel_fro": float((out_8 - out_t).norm() / out_t.norm()),
            "out_max_abs": float((out_8 - out_t).abs().max()),
            "lse_max_abs": float((lse_8 - lse_t).abs().max()),
            "out_bound_finite": finite / total, "out_max_over_finite_bound": worst, "out_over_bound": over,
            "passed": rows["passed"] and over == 0}


def fp8_cases(size: str = "full") -> list[Case]:
    """The FP8 format-error cases (decode, CPU float64): a long request, a ragged batch with the 1- and 54-token
    edges, peaked and spread attention. `size="smoke"` shrinks the long lengths."""
    n = 4096 if size == "full" else 1000
    return [Case(f"len{n}", (n,)), Case("ragged4", (1, 97, 640, 54)), Case("peaked", (n,), score_scale=4.0),
            Case("spread", (n,), score_scale=0.05)]


def fp8_format_gate(size: str, seed: int, record) -> list[dict]:
    """CPU gate: the FP8 folded pool's format error against the bf16 truth, per case of `fp8_cases` (rows within
    the derived rounding bound; the output within its derived bound wherever that bound is finite). Records
    `fp8_format_error` and returns its rows."""
    rows = [fp8_format_error(case, seed) for case in fp8_cases(size)]
    record.ran("fp8_format_error", rows=rows, passed=all(r["passed"] for r in rows))
    return rows


def fp8_kernel_gate(cases: list[Case], backends, seed: int, build_dir: str | None, record,
                    kind: str = "decode") -> list[dict]:
    """GPU gate: every `kind` case ("decode" or "prefill") over an FP8 folded pool (hostile as `make_inputs` makes
    it, NaN/Inf scales on the unused pages) against the float64 reference over the rows the kernel attends over
    (`run_case` with `attended_rows`: the decode and the prefill's "in_kernel" rows read the dequantized rows, with the
    derived P x scale term; the prefill's "gather" rows are the FP8 rows rounded to bf16, with the bf16 bound; the
    decode runs both FP8 partials, the default tensor-core one with its own terms, `fp8_tc`, and "exact"), AOT
    against JIT bit for bit when "aot" is in `backends` and `build_dir` holds a build. A prefill case runs both ways
    of reading the rows. Records `fp8_<kind>_gates` (not run without CUDA) and returns its rows."""
    from ...aot import use_build
    from ...fp8 import FP8_DTYPE

    section = f"fp8_{kind}_gates"
    if not gpu_section(record, section):
        return []
    with_aot = "aot" in backends and build_dir is not None
    if with_aot:
        use_build(build_dir)
    # the decode's two FP8 partials: the default (tensor cores, held to its own bound: `run_case` adds it) and "exact"
    arms = ({"fp8": decode_arm, "fp8 exact": lambda backend: decode_arm(backend, fp8_math="exact")}
            if kind == "decode" else
            {f"fp8 {rows}": lambda backend, rows=rows: prefill_arm(backend, rows) for rows in ("gather", "in_kernel")})
    rows = []
    for case in [c for c in cases if c.kind == kind]:
        inputs = make_inputs(case, KvFormat.FOLDED, "cuda", seed, dtype=FP8_DTYPE)
        for label, arm in arms.items():
            res = run_case(inputs, arm("jit"))
            row = dict(summary_row(case, KvFormat.FOLDED, "jit", res), format=f"folded {label}")
            if with_aot:
                res_aot = run_case(inputs, arm("aot"))
                row["aot_passed"] = res_aot["passed"]
                row["aot_bit_identical"] = (torch.equal(res_aot["outputs"][0], res["outputs"][0])
                                            and torch.equal(res_aot["outputs"][1], res["outputs"][1]))
            rows.append(row)
            del res
        del inputs
        torch.cuda.empty_cache()
    record.ran(section, rows=rows, passed=all(r["passed"] and r.get("aot_bit_identical", True) for r in rows))
    return rows


NEEDLE_LENGTHS = (4096, 65_536, 200_000)
NEEDLE_SCORE = 2.0  # the folded query is this times the needle key's unit vector, per head: its score ~2 x 22


def needle(length: int, position: int, *, seed: int = 0, device: torch.device | str = "cuda",
           dtype: torch.dtype | None = None, backend: str = "jit", drop_needle: bool = False,
           fp8_math: str | None = None) -> dict:
    """Kernel-level needle over an FP8 folded pool (bf16 with `dtype=torch.bfloat16`): `length` random keys (raw
    projections through the prep), the query of every head set to NEEDLE_SCORE x the unit key of the token at
    `position`, so that token holds nearly all the attention. Three checks, each with a derived bound:
    - kernel: the decode against the float64 reference over the same pool (`compare`: the gates' bound, plus the
      tensor-core partial's own terms when `fp8_math` resolves to it, the FP8 default: `checks.decode_extra`);
    - leak: the reference against the needle's own value (dequantized), |ref - v| <= w (max|v_j| + |v|) per head,
      w = sum_{j != p} e^(s_j - s_p) / (1 + that sum), from the float32 scores of every key (+1% for their rounding);
    - end to end: the decode against the needle's true value (the float32 row both a bf16 and an FP8 pool round
      from): ROW_REL |v| + ROW_SUB scale (the quantization, foldkv.fp8) + the leak + the kernel's bound.
    `drop_needle=True` (the red twin) overwrites the needle row with another token's after the query and the leak
    bound are made (from the intact pool): the end-to-end check must fail. `fp8_math`: the FP8 decode partial (None:
    the FP8 pool's default, the tensor-core one); the row's "partial" names the one that ran ("bf16" on a bf16 pool)."""
    from ...fp8 import FP8_DTYPE
    from ...kernels.decode import decode
    from ...layout import value_window, value_window_to_head
    from ...prep import prep_rows

    dtype = FP8_DTYPE if dtype is None else dtype
    geom, device, fmt = GEMMA4_31B, torch.device(device), KvFormat.FOLDED
    lay = PagedKvLayout(geom, fmt, 64, -(-length // 64), dtype=dtype)
    pool = PagedKvPool(lay, device=device)
    table = pool.allocate([length], scatter_seed=seed).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randn(length, geom.num_kv_heads, geom.head_dim, generator=g, device=device)
    k_norm = (torch.rand(geom.head_dim, generator=g, device=device) * 0.5 + 0.75)
    fill_sequences(pool, table.to("cpu"), [raw], k_norm)
    page, off = int(table.page_ids[0, position // 64]), position % 64
    stored = pool.data[page, :, off].double()  # [Hkv, W]
    row = stored * pool.scales[page, :, off].double()[:, None] if lay.quantized else stored
    truth = prep_rows(geom, fmt, raw[position:position + 1], k_norm, torch.tensor([position], device=device),
                      out_dtype=torch.float32)[0].double()  # [Hkv, W] the float32 row both pools round from
    d, group = geom.head_dim, geom.group_size
    key = row[:, :d]  # [Hkv, D] score window
    query = (NEEDLE_SCORE * key / key.norm(dim=1, keepdim=True)).repeat_interleave(group, 0).to(torch.bfloat16)[None]
    vw, to_head = value_window(geom, fmt), value_window_to_head(geom, fmt).to(device)
    v_need = row[:, vw][:, to_head].repeat_interleave(group, 0)  # [Hq, D] head order
    v_truth = truth[:, vw][:, to_head].repeat_interleave(group, 0)
    scale = (pool.scales[page, :, off].double() if lay.quantized else torch.zeros(geom.num_kv_heads, device=device,
                                                                                    dtype=torch.float64))
    # every key's score per head (float32, chunked) and the largest value magnitude, for the leak bound
    q32 = query[0].float()  # [Hq, D]
    leak_sum = torch.zeros(geom.num_q_heads, device=device, dtype=torch.float64)
    s_need = torch.zeros(geom.num_q_heads, device=device, dtype=torch.float64)
    vmax = torch.zeros(geom.num_q_heads, device=device, dtype=torch.float64)
    ids = table.page_ids[0, :lay.pages_for(length)].long()
    rows_all = pool.data[ids].float()  # [pages, Hkv, 64, W]
    if lay.quantized:
        rows_all = rows_all * pool.scales[ids].float()[..., None]
    rows_all = rows_all.transpose(0, 1).reshape(geom.num_kv_heads, -1, lay.row_width)[:, :length]  # [Hkv, n, W]
    for h in range(geom.num_q_heads):
        kv_h = rows_all[h // group]
        sc = (kv_h[:, :d] @ q32[h]).double()  # [n]
        s_need[h] = sc[position]
        others = torch.cat([sc[:position], sc[position + 1:]])
        leak_sum[h] = torch.exp(others - sc[position]).sum() * 1.01
        vmax[h] = kv_h[:, vw].abs().max().double()
    w = leak_sum / (1 + leak_sum)  # [Hq] the weight off the needle
    leak_bound = w[:, None] * (vmax[:, None] + v_need.abs())
    del rows_all
    if drop_needle:  # the red twin: the token the query looks for is gone
        other = (position + length // 2) % length
        p2, o2 = int(table.page_ids[0, other // 64]), other % 64
        pool.data[page, :, off] = pool.data[p2, :, o2]
        if lay.quantized:
            pool.scales[page, :, off] = pool.scales[p2, :, o2]
    out, _ = decode(pool, query, table, backend=backend, fp8_math=fp8_math)
    torch.cuda.synchronize(device)
    ref, _, pv_abs = reference_with_scales(pool, query, table)
    extra, _ = decode_extra(pool, query, table, fp8_math)  # the partial's own terms (None: exact or bf16)
    kernel = compare(out, ref, pv_abs, p_scaled=lay.quantized, extra=extra)

    ref_err = (ref[0] - v_need).abs()
    quant = (ROW_REL * v_truth.abs() + ROW_SUB * scale.repeat_interleave(group, 0)[:, None] if lay.quantized
             else P_ROUNDING * v_truth.abs())  # the row's own rounding from float32: foldkv.fp8's bound, or bf16's
    kernel_bound = ABS_TOL + REL_TOL * ref[0].abs() + bf16_ulp(ref[0]) + P_ROUNDING * pv_abs[0]
    if extra is not None:
        kernel_bound = kernel_bound + extra[0]
    e2e = (out[0].double() - v_truth).abs()
    e2e_bound = quant + leak_bound + kernel_bound
    res = {"length": length, "position": position, "dtype": str(dtype).replace("torch.", ""),
           "partial": decode_fp8_math(pool, fp8_math) if lay.quantized else "bf16",
           "needle_weight_min": float((1 - w).min()), "kernel_max_abs": kernel["max_abs"],
           "kernel_ok": kernel["elementwise_ok"] and kernel["rel_ok"],
           "leak_max_over_bound": float((ref_err / leak_bound.clamp_min(1e-300)).max()),
           "leak_ok": bool((ref_err <= leak_bound + 1e-12).all()),
           "e2e_max_abs": float(e2e.max()), "e2e_max_over_bound": float((e2e / e2e_bound).max()),
           "e2e_ok": bool(torch.isfinite(out).all()) and bool((e2e <= e2e_bound).all()), "red_twin": drop_needle}
    res["passed"] = res["kernel_ok"] and res["leak_ok"] and res["e2e_ok"]
    del pool
    return res


NEEDLE_FP8_MATH = "tensor_cores"  # the notebook's needle runs the FP8 pool's default decode, named


def needle_gate(seed: int, record, lengths=NEEDLE_LENGTHS, fp8_math: str = NEEDLE_FP8_MATH) -> list[dict]:
    """GPU gate: `needle` at the start, middle and end of each length, FP8 folded, through the `fp8_math` decode
    partial (the tensor-core one, the FP8 default; tests/test_fp8_gpu.py runs "exact" and a bf16 pool too), plus its
    red twin (the needle dropped, which must fail). Records `fp8_needle` (not run without CUDA)."""
    if not gpu_section(record, "fp8_needle"):
        return []
    rows = [needle(n, p, seed=seed, fp8_math=fp8_math) for n in lengths for p in (0, n // 2, n - 1)]
    twin = needle(lengths[0], lengths[0] // 2, seed=seed, drop_needle=True, fp8_math=fp8_math)
    rows.append(dict(twin, passed=not twin["passed"]))  # the red twin passes when the needle check fails
    record.ran("fp8_needle", rows=rows, passed=all(r["passed"] for r in rows))
    return rows
