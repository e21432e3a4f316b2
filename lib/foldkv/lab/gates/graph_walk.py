"""The graph walk: one CUDA graph of a decode workspace step replayed while every request grows by a token a step,
each step bit for bit against an eager twin and checked against the float64 reference; notebook 02's `graph_walk`
section, with its red twin (a stale plan)."""

from __future__ import annotations

import torch

from ...config import GEMMA4_31B, AttentionGeometry
from ...layout import KvFormat
from ...pool import BlockTable
from .checks import compare, compare_lse, decode_extra, lse_bound, reference_with_scales
from .geometry import gate_geometry
from .inputs import OUT_POISON, Case, bits, make_inputs, require_parsed
from .sections import gpu_section


WALK_LENGTHS = (1, 63, 64, 65, 4097, 10_602)  # the graph walk's batch at its first step: page edges and a long one
WALK_STEPS = 64


def graph_walk(fmt: KvFormat, seq_lens=WALK_LENGTHS, *, steps: int = WALK_STEPS, seed: int = 0,
               update: str = "advance", max_batch: int | None = None, check_every: int = 16, backend: str = "jit",
               stale: bool = False, device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
               geom: AttentionGeometry | str = GEMMA4_31B) -> dict:
    """One CUDA graph of a `DecodeWorkspace` step, captured once and replayed for `steps` decode steps while every
    request grows by one token a step (`update`: "advance", the device-side update, or "plan", a host plan each
    step). Rows past each request's current length hold NaN in the pool until the step that writes them (as a
    prep would), outputs are poisoned before every replay, and each step is compared bit for bit with an eager step
    of a twin workspace given the same inputs; every `check_every` steps (and the last) the graph's output is
    checked against the float64 reference of the current lengths (`compare`, `compare_lse`). `stale=True` skips
    the update after each step: a deliberately stale plan that the reference check must catch (the red twin).
    `geom`: the pool's geometry (`make_inputs`), e.g. one rank's "gemma-4-31b-tp2". Returns {"steps": [...],
    "passed": bool} and the workspace's shape."""
    from ...kernels.workspace import DecodeWorkspace

    require_parsed(fmt, dtype)
    device = torch.device(device)
    if update not in ("advance", "plan"):
        raise ValueError(f"update={update!r}: expected 'advance' or 'plan'")
    lens = [int(n) for n in seq_lens]
    final = [n + steps for n in lens]
    inputs = make_inputs(Case("graph-walk", tuple(final)), fmt, device, seed, dtype=dtype, geom=geom)
    pool, table, geom = inputs.pool, inputs.table, inputs.pool.geometry
    page = pool.layout.page_size
    truth = pool.data.clone()
    truth_scales = pool.scales.clone() if pool.scales is not None else None
    ids = table.page_ids.cpu()

    def rows_at(r: int, positions: range):
        for pos in positions:
            yield int(ids[r, pos // page]), pos % page

    for r, (n, m) in enumerate(zip(lens, final)):  # future tokens: NaN until their step writes them
        for pg, off in rows_at(r, range(n, m)):
            pool.data[pg, :, off] = float("nan")
            if truth_scales is not None:
                pool.scales[pg, :, off] = float("nan")
    width = pool.layout.pages_for(max(final))
    page_ids = table.page_ids[:, :width].contiguous()
    kw = dict(max_batch=max_batch or len(lens), max_len=max(final), device=device)
    graph_ws, eager_ws = DecodeWorkspace(pool.layout, **kw), DecodeWorkspace(pool.layout, **kw)
    for ws in (graph_ws, eager_ws):
        ws.plan(lens, page_ids)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    b, hq, d = len(lens), geom.num_q_heads, geom.head_dim
    graph = graph_ws.capture(pool, backend=backend)
    rows = []
    for step in range(steps):
        query = (torch.randn(b, hq, d, generator=gen, device=device) * 0.05).to(torch.bfloat16)
        for ws in (graph_ws, eager_ws):
            ws.query[:b].copy_(query)
            ws.out.fill_(OUT_POISON)
            ws.lse.fill_(OUT_POISON)
        graph.replay()
        eager_ws.step(pool, backend=backend, check=False)
        out, lse = graph_ws.output()
        e_out, e_lse = eager_ws.output()
        row = {"step": step, "max_len": max(lens), "bitwise_equal_to_eager": bool(
            torch.equal(bits(out), bits(e_out)) and torch.equal(bits(lse), bits(e_lse))),
            "all_written": bool(torch.isfinite(out).all() and torch.isfinite(lse).all())}
        if step % check_every == 0 or step == steps - 1:
            now = BlockTable(table.page_ids, torch.tensor(lens, dtype=torch.int32, device=device))
            ref, ref_lse, pv_abs, s_abs_p, s_abs_max = reference_with_scales(pool, query, now, score_abs=True)
            extra_out, extra_lse = decode_extra(pool, query, now, graph_ws.fp8_math)  # the partial's own terms
            row.update(compare(out, ref, pv_abs, p_scaled=pool.layout.quantized, extra=extra_out))
            row.update(compare_lse(lse, ref_lse,
                                   extra_lse + lse_bound(s_abs_p, s_abs_max, ref_lse, torch.tensor(lens), d)))
            row["checked"] = True
            row["passed"] = all(row[k] for k in ("bitwise_equal_to_eager", "all_written", "elementwise_ok", "rel_ok",
                                                 "lse_ok"))
        else:
            row["checked"] = False
            row["passed"] = row["bitwise_equal_to_eager"] and row["all_written"]
        rows.append(row)
        if step == steps - 1:
            break
        for r, n in enumerate(lens):  # the next token's row, as the step's prep would write it
            pg, off = next(rows_at(r, range(n, n + 1)))
            pool.data[pg, :, off] = truth[pg, :, off]
            if truth_scales is not None:
                pool.scales[pg, :, off] = truth_scales[pg, :, off]
        lens = [n + 1 for n in lens]
        if not stale:
            for ws in (graph_ws, eager_ws):
                ws.advance() if update == "advance" else ws.plan(lens)
    torch.cuda.synchronize(device)
    return {"format": fmt.value, "dtype": str(dtype).replace("torch.", ""), "update": update, "stale": stale,
            "batch": b, "max_batch": graph_ws.max_batch,
            "chunks": graph_ws.num_chunks, "groups": graph_ws.num_groups, "steps": rows,
            "passed": all(r["passed"] for r in rows)}


def graph_walk_gate(formats, seed: int, record, *, steps: int = WALK_STEPS,
                    geom: AttentionGeometry | str = GEMMA4_31B) -> list[dict]:
    """GPU gate: `graph_walk` per format and update mode (a batch with padding rows: max_batch one above the batch),
    plus its red twin (a stale plan, which must fail), at `geom`. Records `graph_walk` (not run without CUDA)."""
    geom = gate_geometry(geom)
    if not gpu_section(record, "graph_walk"):
        return []
    def row(res: dict, fmt: str, update: str, red_twin: bool = False) -> dict:
        checked = [r for r in res["steps"] if r["checked"]]
        return {"format": fmt, "update": update, "steps": len(res["steps"]), "chunks": res["chunks"],
                "bitwise_equal_steps": sum(r["bitwise_equal_to_eager"] for r in res["steps"]),
                "worst_rel_fro": max(r["rel_fro"] for r in checked),
                "worst_lse_fraction": max(r["lse_worst_fraction_of_bound"] for r in checked),
                "passed": not res["passed"] if red_twin else res["passed"]}  # a red twin passes when caught

    walk_kw = dict(steps=steps, seed=seed, max_batch=len(WALK_LENGTHS) + 1, geom=geom)
    fmts = [KvFormat.parse(f) for f in formats]
    rows = [row(graph_walk(fmt, update=update, **walk_kw), fmt.value, update)
            for fmt in fmts for update in ("advance", "plan")]
    if KvFormat.FOLDED in fmts:
        from ...fp8 import FP8_DTYPE

        rows.append(row(graph_walk(KvFormat.FOLDED, dtype=FP8_DTYPE, **walk_kw), "folded fp8", "advance"))
    stale = graph_walk(KvFormat.FOLDED, steps=4, seed=seed, stale=True, check_every=1, geom=geom)
    rows.append(row(stale, "folded", "none (red twin: stale plan)", red_twin=True))
    record.ran("graph_walk", rows=rows, passed=all(r["passed"] for r in rows))
    return rows
