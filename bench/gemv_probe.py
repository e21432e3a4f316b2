"""Lab notebook: the 31B's decode-step projections alone, every GEMV of one step in one CUDA graph, per arrangement.

Question: cuBLAS's GEMVs take 16.3 ms of a 4K x 1 step whose whole floor is 14.1 ms (the weights alone: 13.9 ms at
the read roof); which arrangement of the same bytes reads nearer the roof?
Arms (each one graph of the step's 421 projections in forward order, the model's own weights, rows M = 1 or 8):
- `torch`: F.linear per projection (cuBLAS), what the step runs today;
- `torch_branches`: the same, a layer's q/k/v on three streams and gate/up on two (graph branches: the kernels' tails
  overlap);
- `stream`: the streaming GEMV of bench/versions/gemv_stream.py, every program resident at once (gemv_config);
- `stream_cN` / `stream_sN` / `stream_wN`: the same with N programs an SM / N stages / N warps;
- `stream_branches`: the stream GEMV on the branches above;
- `torch_merged`: one F.linear a group over its weights concatenated (q|k|v, gate|up; what vLLM's merged linears do:
  241 launches where the others have 411), the copies made for the arm and freed after;
- `fma_rN` (one row only): bench/versions/gemv_fma.py, the roof's register loop with one FMA a weight element, N
  whole rows a program; `fma_r4_branches` on the branches.
- the PDL experiment (one row only; bench/versions/gemv_pdl.py, MODEL_DECODE_NOTES run 11), `CHAIN_ARMS`: the same
  411 projections serial, each projection's input written by a dependent small kernel reading the previous one's
  output (`_norm`: gemv_pdl.head_norm, the library's rms_norm_rows formula over 256-wide head rows) or none:
  `fma_rN_norm` gemv_fma's kernel + the norm, plain launches; `fma_r4_norm_pf` gemv_pdl's kernel (one weight tile
  loaded first) + the norm, plain launches (the kernel's change alone); `fma_rN_norm_pdl` both launched with PDL, the
  GEMV's first tile loaded before its wait; `fma_r4_norm_pdl_nopf` PDL with the wait first (no prefetch);
  `fma_r4_norm_pdl_pf2` two tiles; `fma_rN_pdl` PDL GEMVs back to back, no norm (against `fma_rN`). Each PDL arm's
  outputs are compared bitwise with the same kernels' plain launches (`same_as_plain`); before the PDL arms,
  gemv_pdl's PTX order and race checks (`pdl_checks`).
- the PDL GEMV of a few rows (rows M = 1..8; bench/versions/gemv_pdl_rows.py, MODEL_DECODE_NOTES run 13),
  `ROWS_ARMS`: each weight row read once against all M rows of x, N weight rows a program (`_rN`): `pdl_m_rN` the
  411 projections serial under PDL (first weight tile before the wait), `plain_m_rN` the same kernel's plain build and
  launch; `_norm`: gemv_pdl.head_norm between consecutive projections over the M rows (the chain arms' dependent
  kernel); `_merged`: the 241 merged weights of `torch_merged` (q|k|v, gate|up) instead of the 411. Each arm first
  checks the kernel took every projection (no F.linear: `kernel_calls`, `refusals`), records the builds' registers
  and spills (`kernel_stats`), and each distinct weight shape against float64 (`bound`: the float32-accumulation
  bound); a PDL arm's outputs bitwise its plain twin's (`same_as_plain`), `finite`; before them the race check (in a
  graph and eager) and the PTX order of the M-row kernel (`pdl_checks_rows`).
- the tensor-core PDL GEMM of 1..16 rows (rows M = 1..16, padded to the MMA's 16; bench/versions/gemv_pdl_tc.py,
  MODEL_DECODE_NOTES run 14), `TC_ARMS`: each program 64 weight rows x 16 padded rows of x through tl.dot, the K range
  split (a float32 workspace and a small PDL reduce, `split_sum`) where N / 64 programs would not cover the SMs:
  `pdl_tc` the 411 projections serial under PDL (first weight tile before the wait), `plain_tc` the plain builds and
  launches; `_norm`: gemv_pdl.head_norm between consecutive projections (as the rows arms); `_merged`: the 241 merged
  weights; `pdl_tc_merged_<variant>` the merged step under another configuration (gemv_pdl_tc.VARIANTS: `_k256` 256
  columns a stage and 3 stages, `_s3` 3 stages, `_s2` 2 stages (three programs an SM), `_tailfit` 2 stages only where
  the default grid's last wave is a small tail (the global q|k: 288 programs on 264 slots), `_fixup` the split weights'
  partials summed by the last program of each row tile instead of split_sum, `_n128` 128 weight rows a program,
  `_nosplit` no split-K). Each arm
  records what the rows arms record (kernel_calls, refusals, the float64 bound per shape, same_as_plain, finite) and
  the builds' registers, spills, shared memory and MMA kind (`kernel_stats`), the grids (`grids`: programs a shape,
  the split, resident programs an SM) and its launches (GEMMs + split reduces + norms); before them, per M, the race
  check (graph and eager) and the PTX order of the tensor-core kernel (`pdl_checks_tc`).
Then, with --cells, notebook 05's decode cells through generate() with the step's projections on graph branches
(`StepOptions.branches`, the library's) and without; --no-arms skips the projections-only arms.
Prints one table; JSON to $OUT/gemv_probe.json.

    python3 bench/gemv_probe.py --cells foldkv-folded:4096:1 foldkv-folded:32768:8
    python3 bench/gemv_probe.py --rows 1          # the projections alone at one row, the fma_rN arms included
    python3 bench/gemv_probe.py --rows 1 --arms fma_r4 fma_r4_pdl fma_r4_norm fma_r4_norm_pdl   # PDL, run 11
    python3 bench/gemv_probe.py --rows 8 4 2 --arms torch_merged pdl_m_r2 plain_m_r2 pdl_m_r2_merged   # run 13
    python3 bench/gemv_probe.py --rows 8 --arms torch_merged pdl_tc_merged plain_tc_merged pdl_tc plain_tc   # run 14
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time

import torch
import torch.nn.functional as F


# The PDL experiment's arms (one row): rows a program; the GEMV ("fma": gemv_fma.gemv, "pdl": gemv_pdl.gemv); weight
# tiles loaded before the wait; PDL launches (GEMV and norm); a dependent norm between consecutive projections.
CHAIN_ARMS = {
    "fma_r4_norm": dict(rows=4, gemv="fma", prefetch=0, pdl=False, norm=True),
    "fma_r4_norm_pf": dict(rows=4, gemv="pdl", prefetch=1, pdl=False, norm=True),
    "fma_r4_norm_pdl": dict(rows=4, gemv="pdl", prefetch=1, pdl=True, norm=True),
    "fma_r4_norm_pdl_nopf": dict(rows=4, gemv="pdl", prefetch=0, pdl=True, norm=True),
    "fma_r4_norm_pdl_pf2": dict(rows=4, gemv="pdl", prefetch=2, pdl=True, norm=True),
    "fma_r4_pdl": dict(rows=4, gemv="pdl", prefetch=1, pdl=True, norm=False),
    "fma_r2_norm": dict(rows=2, gemv="fma", prefetch=0, pdl=False, norm=True),
    "fma_r2_norm_pdl": dict(rows=2, gemv="pdl", prefetch=1, pdl=True, norm=True),
    "fma_r2_pdl": dict(rows=2, gemv="pdl", prefetch=1, pdl=True, norm=False),
}
# The PDL GEMV of 1..8 rows (versions/gemv_pdl_rows.py): weight rows a program; launched with PDL (GEMV and norm);
# a dependent norm between consecutive projections; the merged weights (241 GEMVs) instead of the 411.
ROWS_ARMS = {f"{'pdl' if pdl else 'plain'}_m_r{r}{tail}": dict(rows=r, pdl=pdl, norm=tail == "_norm",
                                                               merged=tail == "_merged")
             for r, tails in ((2, ("", "_norm", "_merged")), (1, ("",)), (4, ("",))) for tail in tails
             for pdl in (True, False)}
# The tensor-core PDL GEMM of 1..16 rows (versions/gemv_pdl_tc.py): launched with PDL (GEMM, split reduce, norm); a
# dependent norm between consecutive projections; the merged weights; a configuration variant (gemv_pdl_tc.VARIANTS'
# keys, "" the default; merged and PDL only, against pdl_tc_merged).
TC_VARIANTS = ("_k256", "_s3", "_s2", "_tailfit", "_fixup", "_n128", "_nosplit")
TC_ARMS = {f"{'pdl' if pdl else 'plain'}_tc{tail}": dict(pdl=pdl, norm=tail == "_norm", merged=tail == "_merged",
                                                         variant="")
           for tail in ("", "_norm", "_merged") for pdl in (True, False)}
TC_ARMS.update({f"pdl_tc_merged{v}": dict(pdl=True, norm=False, merged=True, variant=v) for v in TC_VARIANTS})
# Every arm's name, for --arms (main checks its own tables against these).
BASE_ARMS = ("torch", "torch_branches", "stream", "stream_branches", "stream_c2", "stream_c8", "stream_s4", "stream_s2",
             "stream_w8")
ONE_ROW_ARMS = ("fma_r2", "fma_r4", "fma_r16", "fma_r4_branches")
ARM_NAMES = ("torch_merged",) + BASE_ARMS + ONE_ROW_ARMS + tuple(CHAIN_ARMS) + tuple(ROWS_ARMS) + tuple(TC_ARMS)
HEAD_D = 256  # the chain's norm row (gemv_pdl.HEAD_D; here for the CPU-side plan)


def norm_plan(shapes: list[tuple[int, int]], d: int = HEAD_D) -> list[dict]:
    """For consecutive weights [N, K] in forward order: the norm before each projection after the first, reading the
    previous output (n_prev) and writing the next input (k) as k / d head rows. Refuses dims that are not whole rows
    (the 31B's are all multiples of 256)."""
    plan = []
    for (n_prev, _), (_, k) in zip(shapes, shapes[1:]):
        if n_prev % d or k % d:
            raise ValueError(f"norm between an output of {n_prev} and an input of {k}: not multiples of {d}")
        plan.append(dict(n_prev=n_prev, k=k, programs=k // d, wraps=n_prev < k))
    return plan


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--cells", nargs="*", default=[])
    ap.add_argument("--new-tokens", type=int, default=40)
    ap.add_argument("--no-arms", action="store_true")
    ap.add_argument("--arms", nargs="*", default=None, help="only these arms (default: all)")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.arms or ()) - set(ARM_NAMES))
    if unknown:  # a misspelt arm would otherwise run nothing, silently, on a device session
        ap.error(f"unknown arms {unknown}; known: {' '.join(ARM_NAMES)}")
    return args


def projections(model) -> list[tuple[str, torch.nn.Linear]]:
    """The step's projections in forward order: per layer q, k, (v), o, gate, up, down; then the LM head."""
    out = []
    for i, layer in enumerate(model.model.layers):
        a, m = layer.self_attn, layer.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(a, name, None)
            if lin is not None:
                out.append((f"{i}.{name}", lin))
        out += [(f"{i}.gate_proj", m.gate_proj), (f"{i}.up_proj", m.up_proj), (f"{i}.down_proj", m.down_proj)]
    out.append(("lm_head", model.lm_head))
    return out


def groups(projs):
    """Consecutive projections that read the same input (q/k/v; gate/up) as one group; others alone."""
    out, cur = [], []
    for name, lin in projs:
        kind = name.split(".")[-1]
        together = kind in ("k_proj", "v_proj") and cur and cur[0][0].endswith("q_proj") or \
            kind == "up_proj" and cur and cur[0][0].endswith("gate_proj")
        if together:
            cur.append((name, lin))
        else:
            if cur:
                out.append(cur)
            cur = [(name, lin)]
    out.append(cur)
    return out


def _inputs(weights, m: int, dev, g: torch.Generator) -> dict:
    """{K: x [m, K]}: one random input (never zeros) per K of `weights`, drawn from g in the weights' order."""
    xs = {}
    for w in weights:
        if w.shape[1] not in xs:
            xs[w.shape[1]] = (torch.randn(m, w.shape[1], device=dev, generator=g) * 0.5).to(w.dtype)
    return xs


def make_step(projs, m: int, fn, branches: bool, dev):
    """A function running every projection of `projs` on [m, K] inputs (one random input per K, never zeros)."""
    g = torch.Generator(device=dev).manual_seed(0)
    xs = _inputs([lin.weight for _, lin in projs], m, dev, g)
    grouped = groups(projs)
    side = [torch.cuda.Stream(device=dev) for _ in range(2)]

    def run():
        outs = []
        for grp in grouped:
            if not branches or len(grp) == 1:
                for _, lin in grp:
                    outs.append(fn(xs[lin.weight.shape[1]], lin.weight))
                continue
            cur = torch.cuda.current_stream(dev)
            for s in side[:len(grp) - 1]:
                s.wait_stream(cur)
            for j, (_, lin) in enumerate(grp):
                if j == 0:
                    outs.append(fn(xs[lin.weight.shape[1]], lin.weight))
                else:
                    with torch.cuda.stream(side[j - 1]):
                        outs.append(fn(xs[lin.weight.shape[1]], lin.weight))
            for s in side[:len(grp) - 1]:
                cur.wait_stream(s)
        return outs
    return run


def merged_weights(projs) -> list[torch.Tensor]:
    """Each group of `groups(projs)` as one weight, concatenated along the output dim (a copy for a group of two or
    three; the projection's own weight alone)."""
    return [grp[0][1].weight if len(grp) == 1 else torch.cat([lin.weight for _, lin in grp]) for grp in groups(projs)]


def make_merged_step(projs, m: int, dev, fn=None, ws: list | None = None):
    """Every group of `groups(projs)` as one F.linear (or fn(x, w)) over its weights concatenated along the output
    dim (`ws`: those weights, already made)."""
    g = torch.Generator(device=dev).manual_seed(0)
    fn = F.linear if fn is None else fn
    ws = merged_weights(projs) if ws is None else ws
    xs = _inputs(ws, m, dev, g)

    def run():
        return [fn(xs[w.shape[1]], w) for w in ws]
    return run


def make_chain_step(projs, spec: dict, dev, gemv_fn, norm_fn, pdl: bool | None = None, m: int = 1):
    """Every projection of `projs` serially at m rows (one by default), in forward order: with spec["norm"], the input
    of each after the first is norm_fn(previous output, K, gamma, pdl) (a dependent kernel between every two
    projections); without, one fixed random input [m, K] per K (make_step's). gemv_fn(x, w, pdl). pdl: None for
    spec["pdl"]."""
    pdl = spec["pdl"] if pdl is None else pdl
    if spec["norm"]:
        norm_plan([tuple(lin.weight.shape) for _, lin in projs])
    g = torch.Generator(device=dev).manual_seed(0)
    xs = _inputs([lin.weight for _, lin in projs], m, dev, g)
    gamma = (1 + 0.1 * torch.randn(HEAD_D, device=dev, generator=g)).to(projs[0][1].weight.dtype)

    def run():
        outs, prev = [], None
        for _, lin in projs:
            k = lin.weight.shape[1]
            x = norm_fn(prev, k, gamma, pdl) if spec["norm"] and prev is not None else xs[k]
            prev = gemv_fn(x, lin.weight, pdl)
            outs.append(prev)
        return outs
    return run


def time_graph(run, dev, reps: int = 15) -> tuple[float, list]:
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(stream):
        run()
        run()
    torch.cuda.current_stream(dev).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = run()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times = sorted(times[3:])
    return times[len(times) // 2], outs


def check_shapes(projs, dev) -> list[dict]:
    """The stream GEMV against float64 and against F.linear on each distinct weight shape, M = 1, 7, 8, 16."""
    from versions.gemv_fma import gemv as gemv_fma
    from versions.gemv_stream import gemv

    rows, seen = [], set()
    for name, lin in projs:
        w = lin.weight
        if tuple(w.shape) in seen:
            continue
        seen.add(tuple(w.shape))
        for m in (1, 7, 8, 16):
            x = (torch.randn(m, w.shape[1], device=dev) * 0.5).to(w.dtype)
            ref = (x.double() @ w.double().T)
            got = torch.full((m, w.shape[0]), float("nan"), dtype=w.dtype, device=dev)
            got.copy_(gemv(x, w))
            lib = F.linear(x, w)
            rel = lambda y: float((y.double() - ref).norm() / ref.norm())  # noqa: E731
            row = {"shape": list(w.shape), "m": m, "finite": bool(torch.isfinite(got).all()),
                   "rel_stream": rel(got), "rel_torch": rel(lib)}
            if m == 1:
                fma = torch.full((1, w.shape[0]), float("nan"), dtype=w.dtype, device=dev)
                gemv_fma(x, w, 4, out=fma)
                row.update(rel_fma=rel(fma), fma_finite=bool(torch.isfinite(fma).all()))
            rows.append(row)
    return rows


def _recorded(checks) -> dict:
    """{name: fn()} for (name, fn) pairs, a check that raises recorded as {"error": ...}: the arms still run (and say
    so)."""
    out = {}
    for name, fn in checks:
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded, the arms still run (and say so)
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out


def pdl_checks(gp) -> dict:
    """gemv_pdl's preconditions (its header): the PTX order of loads and wait, the race check eager and in a graph."""
    return _recorded((("ptx_pf0", lambda: gp.ptx_order(0)), ("ptx_pf1", lambda: gp.ptx_order(1)),
                      ("ptx_pf1_red", lambda: gp.ptx_order(1, red_x_early=True)),
                      ("race_eager", lambda: gp.race_check()), ("race_graph", lambda: gp.race_check(graph=True)),
                      ("race_graph_pf0", lambda: gp.race_check(prefetch=0, graph=True)),
                      ("race_graph_r2", lambda: gp.race_check(rows_per_program=2, graph=True))))


def chain_arm(name: str, spec: dict, projs, dev, wbytes: float, roof_gbps: float, gf, gp) -> dict:
    """One CHAIN_ARMS arm timed as one graph; a PDL arm's outputs compared bitwise with its kernels' plain launches."""
    if spec["gemv"] == "fma":
        gemv_fn = lambda x, w, pdl: gf.gemv(x, w, spec["rows"])  # noqa: E731
    else:
        gemv_fn = lambda x, w, pdl: gp.gemv(x, w, spec["rows"], spec["prefetch"], pdl=pdl)  # noqa: E731
    norm_fn = lambda y, k, gamma, pdl: gp.head_norm(y, k, gamma, pdl=pdl)  # noqa: E731
    ms, outs = time_graph(make_chain_step(projs, spec, dev, gemv_fn, norm_fn), dev)
    row = {"arm": name, "rows": 1, "ms": ms, "gbps": wbytes / ms / 1e6, "of_roof": wbytes / ms / 1e6 / roof_gbps,
           "launches": len(projs) + (len(projs) - 1 if spec["norm"] else 0)}
    if spec["pdl"]:
        got = torch.cat([o.reshape(-1) for o in outs])
        plain = torch.cat([o.reshape(-1) for o in make_chain_step(projs, spec, dev, gemv_fn, norm_fn, pdl=False)()])
        torch.cuda.synchronize(dev)
        row["same_as_plain"] = bool(torch.equal(got, plain))
        row["finite"] = bool(torch.isfinite(got).all())
    return row


def rows_norm(gp):
    """The `_norm` arms' dependent kernel at m rows: gemv_pdl.head_norm over the previous output's m rows flattened
    (m K / 256 head rows, each the RMSNorm of 256 of the previous output's elements, wrapping), viewed [m, K]."""
    def norm_fn(y, k, gamma, pdl):
        m = y.shape[0]
        return gp.head_norm(y.reshape(1, -1), m * k, gamma, pdl=pdl).view(m, k)
    return norm_fn


def pdl_checks_rows(gr, m: int, rows_list) -> dict:
    """The M-row kernel's PDL preconditions at m rows: the race check in a graph (ok, red_caught) and eagerly (ok),
    the PTX order (no x load before the wait) and its red twin, per rows a program."""
    return _recorded(check for r in sorted(set(rows_list))
                     for check in ((f"race_graph_r{r}", lambda r=r: gr.race_check(m, r, graph=True)),
                                   (f"race_eager_r{r}", lambda r=r: gr.race_check(m, r)),
                                   (f"ptx_r{r}", lambda r=r: gr.ptx_order(m, r)),
                                   (f"ptx_r{r}_red", lambda r=r: gr.ptx_order(m, r, red_x_early=True))))


def _timed_kernel_arm(row: dict, spec: dict, projs, ws, m: int, dev, wbytes: float, roof_gbps: float, gemv_fn,
                      kernel, gp, **counts) -> dict:
    """What rows_arm and tc_arm share once their kernel takes every weight of `ws`: each distinct weight shape
    against float64 (`kernel.bound_check` of a plain launch), the arm timed as one graph (merged step or chain),
    F.linear inside it refused, a PDL arm's outputs bitwise its plain twin's. `counts` (launches, ...) go in the row."""
    g = torch.Generator(device=dev).manual_seed(1)
    bound = {}
    for w in ws:
        if tuple(w.shape) not in bound:
            x = (torch.randn(m, w.shape[1], device=dev, generator=g) * 0.5).to(w.dtype)
            bound[tuple(w.shape)] = kernel.bound_check(gemv_fn(x, w, False), x, w)
    row["bound"] = {"within": all(b["within"] for b in bound.values()),
                    "worst": max(b["worst"] for b in bound.values()), "shapes": len(bound)}
    kernel.reset()
    if spec["merged"]:
        step = make_merged_step(projs, m, dev, lambda x, w: gemv_fn(x, w, spec["pdl"]), ws=ws)
        plain = make_merged_step(projs, m, dev, lambda x, w: gemv_fn(x, w, False), ws=ws) if spec["pdl"] else None
    else:
        chain = dict(norm=spec["norm"], pdl=spec["pdl"])
        step = make_chain_step(projs, chain, dev, gemv_fn, rows_norm(gp), m=m)
        plain = make_chain_step(projs, chain, dev, gemv_fn, rows_norm(gp), pdl=False, m=m) if spec["pdl"] else None
    ms, outs = time_graph(step, dev)
    calls = kernel.report()
    if calls["refusals"]:
        raise RuntimeError(f"F.linear inside the arm: {calls['refusals']}")
    row.update(ms=ms, gbps=wbytes / ms / 1e6, of_roof=wbytes / ms / 1e6 / roof_gbps, kernel_calls=calls["kernel"],
               **counts)
    if plain is not None:
        got = torch.cat([o.reshape(-1) for o in outs])
        ref = torch.cat([o.reshape(-1) for o in plain()])
        torch.cuda.synchronize(dev)
        row["same_as_plain"] = bool(torch.equal(got, ref))
        row["finite"] = bool(torch.isfinite(got).all())
    return row


def rows_arm(name: str, spec: dict, projs, m: int, dev, wbytes: float, roof_gbps: float, gr, gp) -> dict:
    """One ROWS_ARMS arm at m rows timed as one graph: the kernel must take every projection (else an error row, never
    a timing of F.linear); the builds' registers and spills; each distinct weight shape against float64; a PDL arm's
    outputs bitwise its plain twin's."""
    rows = spec["rows"]
    ws = merged_weights(projs) if spec["merged"] else [lin.weight for _, lin in projs]
    why = {tuple(w.shape): gr.shape_refusal(m, *w.shape, w.dtype, w.dtype, w.is_contiguous(), False, rows)
           for w in ws}
    why = {s: r for s, r in why.items() if r is not None}
    if why:
        raise ValueError(f"the kernel refuses {why}")
    gemv_fn = lambda x, w, pdl: gr.linear(x, w, rows=rows, pdl=pdl)  # noqa: E731
    row = {"arm": name, "rows": m, "rows_a_program": rows,
           "kernel_stats": [gr.kernel_stats(k, m, rows, pdl=spec["pdl"]) for k in sorted({w.shape[1] for w in ws})]}
    return _timed_kernel_arm(row, spec, projs, ws, m, dev, wbytes, roof_gbps, gemv_fn, gr, gp,
                             launches=len(ws) + (len(ws) - 1 if spec["norm"] else 0))


def tc_plan(tc, shapes, m: int, variant: str = "", norm: bool = False) -> dict:
    """What a TC_ARMS arm launches over weights of `shapes` ([N, K] in order) at m rows, without a GPU: the kernel's
    refusals by shape (empty when it takes every one), its grid per distinct shape (programs, split, resident
    programs an SM by the shared-memory estimate) and the launches (GEMMs, split reduces, norms between)."""
    over = tc.VARIANTS[variant]
    why, grids, launches = {}, {}, 0
    for n, k in shapes:
        r = tc.shape_refusal(m, n, k, torch.bfloat16, torch.bfloat16, True, False, **over)
        if r is not None:
            why[(n, k)] = r
            continue
        cfg = tc.config(n, k, m, **over)
        launches += tc.launches(cfg)
        grids.setdefault(f"{n}x{k}", dict(programs=tc.programs(n, cfg), split=cfg["SPLIT"],
                                            ctas_per_sm=tc.ctas_per_sm(cfg), smem_estimate=tc.smem_estimate(cfg)))
    return dict(refusals=why, grids=grids, launches=launches + (len(shapes) - 1 if norm else 0),
                splits=sum(g["split"] > 1 for g in grids.values()))


def pdl_checks_tc(tc, m: int) -> dict:
    """The tensor-core kernel's PDL preconditions at m rows (its default configuration, a weight that splits K): the
    race check in a graph (ok, red_caught) and eagerly (ok), the PTX order (no x load, no cp.async before the wait)
    and its red twin."""
    return _recorded((("race_graph", lambda: tc.race_check(m, graph=True)), ("race_eager", lambda: tc.race_check(m)),
                      ("race_graph_nosplit", lambda: tc.race_check(m, graph=True, n=16384)),
                      ("ptx", lambda: tc.ptx_order(m)), ("ptx_red", lambda: tc.ptx_order(m, red_x_early=True))))


def tc_arm(name: str, spec: dict, projs, m: int, dev, wbytes: float, roof_gbps: float, tc, gp) -> dict:
    """One TC_ARMS arm at m rows timed as one graph: the kernel must take every projection (else an error row, never a
    timing of F.linear); the grids and launches (`tc_plan`), the builds' registers, spills, shared memory and MMA
    kind; each distinct weight shape against float64; a PDL arm's outputs bitwise its plain twin's."""
    over = tc.VARIANTS[spec["variant"]]
    ws = merged_weights(projs) if spec["merged"] else [lin.weight for _, lin in projs]
    plan = tc_plan(tc, [tuple(w.shape) for w in ws], m, spec["variant"], spec["norm"])
    if plan["refusals"]:
        raise ValueError(f"the kernel refuses {plan['refusals']}")
    gemv_fn = lambda x, w, pdl: tc.linear(x, w, pdl=pdl, **over)  # noqa: E731
    shapes = sorted({tuple(w.shape) for w in ws})
    row = {"arm": name, "rows": m, "variant": spec["variant"], "grids": plan["grids"],
           "kernel_stats": [tc.kernel_stats(n, k, m, pdl=spec["pdl"], **over) for n, k in shapes]}
    return _timed_kernel_arm(row, spec, projs, ws, m, dev, wbytes, roof_gbps, gemv_fn, tc, gp,
                             launches=plan["launches"], split_weights=plan["splits"])


def main(argv=None) -> int:
    args = parse_args(argv)
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_grad_enabled(False)  # the model's parameters require grad: nothing here records autograd
    import foldkv.hf  # noqa: F401
    from foldkv.step_options import StepOptions, using
    from versions import gemv_fma as gf
    from versions import gemv_stream as gs
    from foldkv.lab import gemma31b, model_decode as md
    from foldkv.lab.bench.roofs import measure_read_roof

    dev = torch.device("cuda")
    t0 = time.perf_counter()
    model = gemma31b.build_gemma4_31b(dev, seed=0)
    roof = measure_read_roof(dev)
    projs = projections(model)
    wbytes = sum(lin.weight.numel() * lin.weight.element_size() for _, lin in projs)
    print(f"built in {time.perf_counter() - t0:.1f} s; roof {roof['gbps']:.0f} GB/s; {len(projs)} projections,"
          f" {wbytes / 1e9:.2f} GB (at the roof {1e3 * wbytes / (roof['gbps'] * 1e9):.2f} ms)", flush=True)
    out = {"roof": roof, "weight_bytes": wbytes, "checks": [] if args.no_arms else check_shapes(projs, dev),
           "arms": [], "cells": []}
    worst = max(out["checks"], key=lambda r: r["rel_stream"], default={"rel_stream": 0.0, "rel_torch": 0.0})
    print(f"stream GEMV worst rel. error vs float64 {worst['rel_stream']:.2e} (torch {worst['rel_torch']:.2e}),"
          f" all finite: {all(r['finite'] for r in out['checks'])}", flush=True)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def stream_fn(ctas: int = gs.GEMV_CTAS_PER_SM, **over):
        def fn(x, w):
            cfg = gs.gemv_config(w.shape[0], w.shape[1], sms, ctas)
            return gs.gemv(x, w, None if cfg is None else {**cfg, **over})
        return fn

    arms = {"torch": (lambda x, w: F.linear(x, w), False), "torch_branches": (lambda x, w: F.linear(x, w), True),
            "stream": (stream_fn(), False), "stream_branches": (stream_fn(), True),
            "stream_c2": (stream_fn(2), False), "stream_c8": (stream_fn(8), False),
            "stream_s4": (stream_fn(num_stages=4), False), "stream_s2": (stream_fn(num_stages=2), False),
            "stream_w8": (stream_fn(num_warps=8), False)}
    one_row = {f"fma_r{r}": (lambda x, w, r=r: gf.gemv(x, w, r), False) for r in (2, 4, 16)}
    one_row["fma_r4_branches"] = (lambda x, w: gf.gemv(x, w, 4), True)
    assert tuple(arms) == BASE_ARMS and tuple(one_row) == ONE_ROW_ARMS  # --arms checks names against these
    chains = [n for n in CHAIN_ARMS if args.arms is None or n in args.arms]

    def pdl_version(name: str, asked: list):
        """(versions.<name>, versions.gemv_pdl: its norm) when asked and Triton has grid dependency control; else
        (None or why not, None): no PDL here, every arm of it an error row."""
        if not asked or args.no_arms:
            return None, None
        try:
            from versions import gemv_pdl
            mod = importlib.import_module(f"versions.{name}")
            if not mod.HAS_GDC:
                raise RuntimeError("no Triton with grid dependency control (gdc_wait)")
            return mod, gemv_pdl
        except Exception as e:  # noqa: BLE001 - no PDL here: every arm of this version is an error row
            return f"{type(e).__name__}: {e}"[:300], None

    def record(name: str, m: int, version, make_row) -> None:
        """One arm's row (an error row when its version did not load or the arm raised), printed and kept."""
        try:
            if isinstance(version, str) or version is None:
                raise RuntimeError(f"the version: {version}")
            row = make_row()
        except Exception as e:  # noqa: BLE001 - a config that does not build is a row, not the end of the probe
            row = {"arm": name, "rows": m, "error": f"{type(e).__name__}: {e}"[:300]}
        torch.cuda.empty_cache()
        out["arms"].append(row)
        print(row, flush=True)

    rows_arms = [n for n in ROWS_ARMS if args.arms is None or n in args.arms]
    gr, gp_rows = pdl_version("gemv_pdl_rows", rows_arms)
    tc_arms = [n for n in TC_ARMS if args.arms is None or n in args.arms]
    tc, gp_tc = pdl_version("gemv_pdl_tc", tc_arms)
    gp = None
    if 1 in args.rows and not args.no_arms and chains:
        try:
            from versions import gemv_pdl as gp
        except Exception as e:  # noqa: BLE001 - no PDL here: every chain arm is an error row
            gp = f"{type(e).__name__}: {e}"[:300]
        if not isinstance(gp, str) and any(CHAIN_ARMS[n]["pdl"] for n in chains):
            out["pdl_checks"] = pdl_checks(gp)
            print("pdl checks", json.dumps(out["pdl_checks"], default=str), flush=True)
    for m in [] if args.no_arms else args.rows:
        try:
            if args.arms is not None and "torch_merged" not in args.arms:
                raise LookupError("not asked for")
            ms, _ = time_graph(make_merged_step(projs, m, dev), dev)
            row = {"arm": "torch_merged", "rows": m, "ms": ms, "gbps": wbytes / ms / 1e6,
                   "of_roof": wbytes / ms / 1e6 / roof["gbps"]}
        except Exception as e:  # noqa: BLE001
            row = {"arm": "torch_merged", "rows": m, "error": f"{type(e).__name__}: {e}"[:300]}
        torch.cuda.empty_cache()
        if row.get("error") != "LookupError: not asked for":
            out["arms"].append(row)
            print(row, flush=True)
        for name, (fn, br) in {**arms, **(one_row if m == 1 else {})}.items():
            if args.arms is not None and name not in args.arms:
                continue
            try:
                ms, _ = time_graph(make_step(projs, m, fn, br, dev), dev)
                row = {"arm": name, "rows": m, "ms": ms, "gbps": wbytes / ms / 1e6,
                       "of_roof": wbytes / ms / 1e6 / roof["gbps"]}
            except Exception as e:  # noqa: BLE001 - a config that does not build is a row, not the end of the probe
                row = {"arm": name, "rows": m, "error": f"{type(e).__name__}: {e}"[:300]}
            out["arms"].append(row)
            print(row, flush=True)
        if rows_arms and not isinstance(gr, (str, type(None))) and 1 <= m <= gr.MAX_M \
                and any(ROWS_ARMS[n]["pdl"] for n in rows_arms):
            out.setdefault("pdl_checks_rows", {})[m] = pdl_checks_rows(gr, m, [ROWS_ARMS[n]["rows"] for n in rows_arms])
            print(f"pdl checks at {m} rows", json.dumps(out["pdl_checks_rows"][m], default=str), flush=True)
        for name in rows_arms:
            record(name, m, gr, lambda: rows_arm(name, ROWS_ARMS[name], projs, m, dev, wbytes, roof["gbps"], gr,
                                                 gp_rows))
        if tc_arms and not isinstance(tc, (str, type(None))) and 1 <= m <= tc.MAX_M \
                and any(TC_ARMS[n]["pdl"] for n in tc_arms):
            out.setdefault("pdl_checks_tc", {})[m] = pdl_checks_tc(tc, m)
            print(f"tensor-core pdl checks at {m} rows", json.dumps(out["pdl_checks_tc"][m], default=str), flush=True)
        for name in tc_arms:
            record(name, m, tc, lambda: tc_arm(name, TC_ARMS[name], projs, m, dev, wbytes, roof["gbps"], tc, gp_tc))
        for name in chains if m == 1 else []:
            record(name, m, gp, lambda: chain_arm(name, CHAIN_ARMS[name], projs, dev, wbytes, roof["gbps"], gf, gp))
    for spec in args.cells:
        arm, n, b = spec.split(":")
        for g in ("branches", "serial"):
            with using(StepOptions(branches=g == "branches")):  # the cell's cache takes these options
                r = md.run_cells(md.measure_decode, [dict(model=model, arm_name=arm, context=int(n), batch=int(b),
                                                          new_tokens=args.new_tokens, read_gbps=roof["gbps"])])[0]
            r.pop("tokens", None)
            r["projections"] = g
            out["cells"].append(r)
            print(g, {k: r.get(k) for k in ("arm", "context", "batch", "tpot_ms", "device_step_ms", "host_ms",
                                            "floor_ms", "tpot_over_floor", "status")}, flush=True)
    text = json.dumps(out, indent=1, default=str)
    if os.environ.get("OUT"):
        open(os.path.join(os.environ["OUT"], "gemv_probe.json"), "w").write(text)
    print(f"{'arm':18s} {'rows':>4s} {'ms':>8s} {'GB/s':>7s} {'roof':>6s}")
    for r in out["arms"]:
        if "ms" in r:
            print(f"{r['arm']:18s} {r['rows']:4d} {r['ms']:8.3f} {r['gbps']:7.0f} {r['of_roof']:6.3f}")
        else:
            print(f"{r['arm']:18s} {r['rows']:4d} {r['error'][:80]}")
    for r in out["cells"]:
        print(r.get("projections"), r.get("arm"), r.get("context"), r.get("batch"), r.get("tpot_ms"),
              r.get("tpot_over_floor"), r.get("host_share"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
