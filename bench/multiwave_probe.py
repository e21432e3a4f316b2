"""Multi-wave decode on one card: where the folded partial of a plan of several waves loses against a plain read of
its bytes (bench/DECODE_NOTES.md, "Run 23"). One device call of ~4-5 minutes: the kernels compiled side by side into
the TileLang cache first, every arm checked on a small ragged batch before any cell is timed, then the cells in order
of what they tell, each timed by `foldkv.lab.bench.run_cell` (outputs poisoned and checked against the float64
reference, CUDA-graph replays, arms interleaved round by round, pools rotated past L2), the JSON written after every
cell.

Cells:
  resident        one request of 163,336 tokens whose pages all map onto 32 pages (they stay in L2): a tile's chain
                  on this card, the DRAM stream out of the way (fp8_harness's ResidentCase)
  single262144    one request, one wave (the library's fused step) against the same request cut into a multi-wave
                  plan (pieces of 16 pages, ~8 CTAs an SM)
  short256        256 requests of 1-2K (the issue's worst batch), then
  short256_inorder  the same batch with every request's pages in order in the pool (no scatter), then
  <batch>         the other five ragged batches of several waves (BATCH_SHAPES, drawn from --seed)
Arms (VARIANTS): the library's folded and split decode (eager plan) and the graph workspace; the folded partial alone
(no merges); the folded decode cut at 4x the plan's cap (a quarter of the CTAs, the same largest-first layout); the
folded partial at two CTAs an SM (one stage each, planned for 2 x SMs; run 11's `folded_2cta_w264`); the folded
partial prefetching the page tile 2 or 3 tiles ahead into L2 (`prefetch_tiles`, off in the library); the plain read
of each format's bytes; and a paged read (Triton, no attention) of exactly the page tiles the eager plan's chunks
read, in their chunks, from the scattered table and from the same pages in order.

    source .devsite/env.sh; export PYTHONPATH=$PWD/lib:$PYTHONPATH
    python3 bench/multiwave_probe.py --out $OUT                # on the device: every cell, in order, within --budget-s
    python3 bench/multiwave_probe.py --plans                   # CPU: the cells' lengths, plans, CTAs an SM, partials
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import json
import multiprocessing
import os
import random
import sys
import time
from typing import Callable, NamedTuple, Sequence

import torch

import foldkv
from foldkv import KvFormat, PagedKvLayout
from foldkv.kernels import plan as plan_mod
from foldkv.lab.bench import ArmImpl, ArmSpec, AttentionCase, generated_arm, run_cell
from foldkv.pool import BlockTable, PagedKvPool

G = foldkv.GEMMA4_31B
PAGE = 64
DEFAULT_SEED = 20261205
# the batches, drawn anew (lengths no notebook uses): name -> (requests, ranges); a request takes
# ranges[i % len(ranges)] when there are several (the long tail: every tenth request long)
BATCH_SHAPES = {
    "short256": (256, [(1024, 2048)]),
    "uniform24": (24, [(1024, 48 * 1024)]),
    "short200": (200, [(1, 8192)]),
    "uniform12": (12, [(1024, 100_000)]),
    "uniform48": (48, [(512, 30_000)]),
    "longtail100": (100, [(65_536, 212_000)] + [(1, 4096)] * 9),
}
SINGLE = 262_144
RESIDENT_LEN, RESIDENT_PAGES = 163_336, 32
SMALL_CHECK = [1, 63, 65, 1000, 3000, 20_000]  # every arm checked on this ragged batch first (page edges, one token)
CELLS = ("resident", "single262144", "short256", "short256_inorder", *(b for b in BATCH_SHAPES if b != "short256"))
CAP_SCALE = 4  # the cap arm: pieces this many times the plan's cap
FORCED_CAP_PAGES = 16  # the single request cut into a multi-wave plan: pieces of this many pages
PREFETCH_TILES = (2, 3)  # the prefetch arms: the page tile this many tiles ahead prefetched into L2 by the consumer


def batches(seed: int = DEFAULT_SEED) -> dict[str, list[int]]:
    """BATCH_SHAPES drawn from one seeded stream, in order (a batch's lengths depend on the seed only)."""
    rng = random.Random(seed)
    return {name: [rng.randint(*ranges[i % len(ranges)]) for i in range(n)]
            for name, (n, ranges) in BATCH_SHAPES.items()}


def cell_lengths(seed: int = DEFAULT_SEED) -> dict[str, list[int]]:
    drawn = batches(seed)
    return {"resident": [RESIDENT_LEN], "single262144": [SINGLE], **drawn, "short256_inorder": drawn["short256"]}


# --- the paged read: the partial's page tiles, in its chunks, and nothing else --------------------------------------
def paged_read_kernel():
    """run(pool_data, page_ids, chunk_req, chunk_start, chunk_len, out): one Triton program per (chunk, KV head) sums
    every page tile (64 tokens x row, contiguous) its chunk covers, whole tiles as the partial's TMA loads them, into
    out[chunk, head] (float32). Raises ImportError without Triton."""
    global triton, tl  # Triton resolves a kernel's names through its function's globals
    import triton
    import triton.language as tl

    @triton.jit
    def paged_tile_sum(pool_ptr, ids_ptr, req_ptr, start_ptr, len_ptr, out_ptr, max_pages, HKV: tl.constexpr,
                       PAGE_: tl.constexpr, TILE: tl.constexpr, BLOCK: tl.constexpr):
        c = tl.program_id(0)
        h = tl.program_id(1)
        req = tl.load(req_ptr + c).to(tl.int64)
        first = tl.load(start_ptr + c) // PAGE_
        pages = (tl.load(len_ptr + c) + PAGE_ - 1) // PAGE_
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in range(0, pages):
            page = tl.load(ids_ptr + req * max_pages + first + p).to(tl.int64)
            base = (page * HKV + h) * TILE
            for b in tl.static_range(TILE // BLOCK):  # the tile's blocks issued together: a tile in flight
                acc += tl.load(pool_ptr + base + b * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
        tl.store(out_ptr + c * HKV + h, tl.sum(acc, axis=0))

    def run(data: torch.Tensor, page_ids: torch.Tensor, chunk_req, chunk_start, chunk_len, out: torch.Tensor) -> None:
        pages, hkv, page, width = data.shape
        tile = page * width
        block = 4096 if tile % 4096 == 0 else 2048
        paged_tile_sum[(chunk_req.numel(), hkv)](data, page_ids, chunk_req, chunk_start, chunk_len, out,
                                                 page_ids.shape[1], HKV=hkv, PAGE_=page, TILE=tile, BLOCK=block,
                                                 num_warps=8)

    return run


def expected_page_sums(data: torch.Tensor, page_ids: torch.Tensor, chunks: Sequence[tuple[int, int, int]],
                       page: int = PAGE) -> tuple[float, float]:
    """(sum, sum of |.|) in float64 of every page tile (all KV heads) that `chunks` ((request, first token, tokens)
    each) cover through `page_ids`: what the paged read must add up to."""
    ids = page_ids.cpu()
    listed = torch.cat([ids[r, s // page:s // page + -(-n // page)] for r, s, n in chunks]).long()
    flat = data.reshape(data.shape[0], -1)
    total = absolute = 0.0
    for lo in range(0, listed.numel(), 1024):  # a block of pages at a time: no float64 copy of the pool
        rows = flat[listed[lo:lo + 1024].to(data.device)].double()
        total += float(rows.sum())
        absolute += float(rows.abs().sum())
    return total, absolute


PAGED_READ_TOL = 1e-3  # float32 sums of bf16 values: ~1e-6 of the sum of |x|; a tile read twice or left out: >> this


def in_order_ids(seq_lens: Sequence[int], width: int, page: int = PAGE) -> torch.Tensor:
    """A block table [batch, width] int32 giving every request its pages in order, request after request (the same
    pool pages, no scatter); columns past a request's pages are 0 (never read)."""
    ids = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    first = 0
    for r, n in enumerate(seq_lens):
        k = -(-n // page)
        ids[r, :k] = torch.arange(first, first + k, dtype=torch.int32)
        first += k
    return ids


def paged_read_arm(fmt: KvFormat, in_order: bool = False, chunk_tokens: int | None = None) -> ArmSpec:
    """The paged read of `fmt`'s pool over the library's eager plan (or fixed chunks of `chunk_tokens`), from the
    case's scattered table or (`in_order`) from the same pages in order. Checked: its sums, poisoned first, add up
    to the float64 sum of exactly the tiles the chunks cover."""

    def build(case: AttentionCase) -> ArmImpl:
        pools = case.pools(fmt)
        lens = case.table_cpu.seq_lens.tolist()
        plan = plan_mod.plan_decode(pools[0].layout, lens, device=case.device, chunk_tokens=chunk_tokens)
        ids_cpu = in_order_ids(lens, case.table_cpu.page_ids.shape[1]) if in_order else case.table_cpu.page_ids
        ids = ids_cpu.to(case.device).contiguous()
        out = torch.empty(plan.num_chunks, G.num_kv_heads, dtype=torch.float32, device=case.device)
        run = paged_read_kernel()
        calls = [lambda p=p: run(p.data, ids, plan.chunk_req, plan.chunk_start, plan.chunk_len, out) for p in pools]

        def check() -> dict:
            out.fill_(float("nan"))
            calls[0]()
            torch.cuda.synchronize(case.device)
            total, absolute = expected_page_sums(pools[0].data, ids_cpu, plan.chunks)
            err = abs(float(out.double().sum()) - total) / max(1.0, absolute)
            written = bool(torch.isfinite(out).all())
            return {"written": written, "rel_err": err, "tol": PAGED_READ_TOL, "ok": written and err <= PAGED_READ_TOL,
                    "what": "chunk sums against the float64 sum of the tiles the chunks cover"}

        return ArmImpl(calls, out, graph=True, keep=(plan, ids), check=check,
                       info={"chunks": plan.num_chunks, "chunk_tokens": plan.chunk_tokens, "in_order": in_order})

    tag = f"paged_read_{fmt.value}" + ("_inorder" if in_order else "") + (f"_c{chunk_tokens // PAGE}" if chunk_tokens
                                                                           else "")
    return ArmSpec(tag, f"Triton read of the {fmt.value} page tiles the plan's chunks cover"
                   + (", pages in order" if in_order else ""), fmt.value, False, build)


# --- the folded partial's variants ----------------------------------------------------------------------------------
# Compiled side by side before the first cell (a fresh TileLang cache compiles ~20-60 s a kernel): name -> (builder
# path, keyword arguments). The library's kernels come from the resolver as in every launch; the variant through
# `kernels=` (DEVELOPERS.md, "One launch path").
KERNELS = {
    "decode_partial_folded": ("foldkv.kernels.registry:get", {}),
    "decode_partial_split": ("foldkv.kernels.registry:get", {}),
    "merge_groups": ("foldkv.kernels.registry:get", {}),
    "merge_final": ("foldkv.kernels.registry:get", {}),
    "decode_fused_folded": ("foldkv.kernels.registry:get", {}),
    "decode_fused_split": ("foldkv.kernels.registry:get", {}),
    "folded_2cta": ("foldkv.kernels.decode_partial:build_decode_partial",
                    dict(fmt="folded", num_stages=1, ctas_per_sm=2)),
    **{f"folded_prefetch{d}": ("foldkv.kernels.decode_partial:build_decode_partial",
                               dict(fmt="folded", prefetch_tiles=d)) for d in PREFETCH_TILES},
}


def build_kernel(name: str):
    """Compile (or load from the TileLang cache) kernel `name` of KERNELS for the 31B geometry."""
    import importlib

    path, kwargs = KERNELS[name]
    module, _, function = path.partition(":")
    target = getattr(importlib.import_module(module), function)
    if function == "get":  # a registered variant: its own builder and params
        return target(name).build(G)
    return target(G, **kwargs)


def _compile_one(name: str) -> tuple[str, float]:
    t0 = time.perf_counter()
    build_kernel(name)
    return name, time.perf_counter() - t0


def precompile(names: Sequence[str], workers: int, log: Callable[[str], None]) -> dict:
    """Every kernel of `names` compiled in its own spawned process (no CUDA, no TileLang state shared) into the
    TileLang cache the cells then load from; returns {name: seconds or the error}."""
    done: dict = {}
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=max(1, workers), mp_context=multiprocessing.get_context("spawn")) as ex:
        futures = {ex.submit(_compile_one, n): n for n in names}
        for f in cf.as_completed(futures):
            try:
                name, s = f.result()
                done[name] = round(s, 1)
                log(f"  compiled {name} in {s:.0f} s")
            except Exception as exc:  # recorded; the arm that needs it reports its own error later
                done[futures[f]] = f"{type(exc).__name__}: {str(exc)[:300]}"
                log(f"  {futures[f]}: {done[futures[f]]}")
    log(f"compiled {len(names)} kernels in {time.perf_counter() - t0:.0f} s")
    return done


_BUILT: dict[str, object] = {}


def _kernel(name: str):
    if name not in _BUILT:
        _BUILT[name] = build_kernel(name)
    return _BUILT[name]


@contextlib.contextmanager
def scaled_cap(scale: int):
    """plan_decode's byte-balanced cap times `scale` while a plan is made (the same largest-first layout, pieces
    `scale` times longer): the CTA count of a plan changed and nothing else."""
    original = plan_mod.balanced_chunk_pages
    plan_mod.balanced_chunk_pages = lambda *a, **k: original(*a, **k) * scale
    try:
        yield
    finally:
        plan_mod.balanced_chunk_pages = original


def cap_scaled_arm(scale: int) -> ArmSpec:
    inner = generated_arm("decode", KvFormat.FOLDED, "jit")

    def build(case):
        with scaled_cap(scale):
            return inner(case)

    return ArmSpec(f"folded_cap{scale}x", f"folded decode, pieces {scale}x the plan's cap (largest first)", "folded",
                   False, build, generated=True)


def two_cta_arm() -> ArmSpec:
    return ArmSpec("folded_2cta", "folded partial at two CTAs an SM (one stage each), planned for 2 x SMs", "folded",
                   False, generated_arm("decode", KvFormat.FOLDED, "jit",
                                        kernels=lambda case: {"decode_partial_folded": _kernel("folded_2cta")},
                                        plan_kw=lambda case: {"num_sms": 2 * plan_mod.device_sms(case.device)}),
                   generated=True)


def prefetch_arm(tiles: int) -> ArmSpec:
    return ArmSpec(f"folded_prefetch{tiles}", f"folded partial prefetching the page tile {tiles} tiles ahead into L2",
                   "folded", False, generated_arm("decode", KvFormat.FOLDED, "jit", kernels=lambda case: {
                       "decode_partial_folded": _kernel(f"folded_prefetch{tiles}")}), generated=True)


def forced_cap_arm(fmt: KvFormat, pages: int) -> ArmSpec:
    return ArmSpec(f"{fmt.value}_c{pages}", f"{fmt.value} decode cut into fixed pieces of {pages} pages", fmt.value,
                   False, generated_arm("decode", fmt, "jit", plan_kw=lambda case: {"chunk_tokens": pages * PAGE}),
                   generated=True)


def three_launch_arm() -> ArmSpec:
    return ArmSpec("folded_3launch", "folded decode, the three launches on a one-wave plan (no fused tail)", "folded",
                   False, generated_arm("decode", KvFormat.FOLDED, "jit", fused=False), generated=True)


def partial_only_arm(fmt: KvFormat) -> ArmSpec:
    """The library's partial alone over the eager plan (no merges): the step less its merges. Its check: every
    chunk's partial output and LSE, poisoned first, written."""
    from foldkv.kernels import resolve
    from foldkv.kernels.decode import partial_kernel_name

    def build(case: AttentionCase) -> ArmImpl:
        pools, query, table = case.pools(fmt), case.query(fmt), case.table
        plan = plan_mod.plan_decode(pools[0].layout, case.table_cpu.seq_lens, device=case.device)
        partial = resolve.kernel(partial_kernel_name(fmt), G)
        calls = [lambda p=p: partial(query, p.data, table.page_ids, plan.chunk_req, plan.chunk_start, plan.chunk_len,
                                     plan.part_o, plan.part_lse) for p in pools]

        def check() -> dict:
            plan.part_o.fill_(float("nan"))
            plan.part_lse.fill_(float("nan"))
            calls[0]()
            torch.cuda.synchronize(case.device)
            written = bool(torch.isfinite(plan.part_o).all()) and bool(torch.isfinite(plan.part_lse).all())
            return {"written": written, "ok": written, "what": "every chunk's partial output and LSE written"}

        return ArmImpl(calls, plan.part_o, graph=True, keep=(plan, table), check=check,
                       info={"chunks": plan.num_chunks, "chunk_tokens": plan.chunk_tokens})

    return ArmSpec(f"{fmt.value}_partial", f"the library's {fmt.value} partial alone (no merges)", fmt.value, False,
                   build)


# name -> builder of the ArmSpec (a registry name is the lab's own arm)
VARIANTS: dict[str, Callable[[], ArmSpec | str]] = {
    "read_folded": lambda: "read_folded",
    "read_split": lambda: "read_split",
    "folded_jit": lambda: "folded_jit",
    "split_jit": lambda: "split_jit",
    "folded_graph": lambda: "folded_graph",
    "split_graph": lambda: "split_graph",
    "folded_partial": lambda: partial_only_arm(KvFormat.FOLDED),
    "split_partial": lambda: partial_only_arm(KvFormat.SPLIT),
    f"folded_cap{CAP_SCALE}x": lambda: cap_scaled_arm(CAP_SCALE),
    "folded_2cta": two_cta_arm,
    "folded_3launch": three_launch_arm,
    **{f"folded_prefetch{d}": (lambda d=d: prefetch_arm(d)) for d in PREFETCH_TILES},
    f"folded_c{FORCED_CAP_PAGES}": lambda: forced_cap_arm(KvFormat.FOLDED, FORCED_CAP_PAGES),
    f"split_c{FORCED_CAP_PAGES}": lambda: forced_cap_arm(KvFormat.SPLIT, FORCED_CAP_PAGES),
    "paged_read_folded": lambda: paged_read_arm(KvFormat.FOLDED),
    "paged_read_split": lambda: paged_read_arm(KvFormat.SPLIT),
    "paged_read_folded_inorder": lambda: paged_read_arm(KvFormat.FOLDED, in_order=True),
    f"paged_read_folded_c{FORCED_CAP_PAGES}": lambda: paged_read_arm(KvFormat.FOLDED,
                                                                    chunk_tokens=FORCED_CAP_PAGES * PAGE),
}
BATCH_ARMS = ("read_folded", "read_split", "folded_jit", "split_jit", "folded_graph", "split_graph", "folded_partial",
              f"folded_cap{CAP_SCALE}x", "folded_2cta", *(f"folded_prefetch{d}" for d in PREFETCH_TILES),
              "paged_read_folded", "paged_read_split", "paged_read_folded_inorder")
CELL_ARMS = {
    "resident": ("folded_jit", "folded_3launch", "folded_2cta", "split_jit"),
    "single262144": ("read_folded", "read_split", "folded_jit", "folded_3launch", f"folded_c{FORCED_CAP_PAGES}",
                     "folded_2cta", *(f"folded_prefetch{d}" for d in PREFETCH_TILES), "split_jit",
                     f"split_c{FORCED_CAP_PAGES}", "paged_read_folded",
                     f"paged_read_folded_c{FORCED_CAP_PAGES}"),
    **{name: BATCH_ARMS for name in BATCH_SHAPES},
    "short256_inorder": ("read_folded", "read_split", "folded_jit", "split_jit", "folded_partial",
                         *(f"folded_prefetch{d}" for d in PREFETCH_TILES), "paged_read_folded"),
}
# the arms checked on SMALL_CHECK before any cell is timed (every kernel and plan of the cells, once)
CHECK_ARMS = tuple(dict.fromkeys(a for arms in CELL_ARMS.values() for a in arms))


class CellPlan(NamedTuple):
    """A cell to time: its name, lengths and arms."""
    name: str
    seq_lens: tuple[int, ...]
    arms: tuple[str, ...]


def probe_plan(cells: Sequence[str] | None = None, seed: int = DEFAULT_SEED,
               drop: Sequence[str] = ()) -> list[CellPlan]:
    """The cells to time, in order, with their lengths and arms (less `drop`). An unknown cell or arm raises
    ValueError, before anything touches a GPU."""
    cells = list(cells or CELLS)
    unknown = [c for c in cells if c not in CELL_ARMS]
    if unknown:
        raise ValueError(f"unknown cells {unknown}; known: {list(CELLS)}")
    bad = [a for a in drop if a not in VARIANTS]
    if bad:
        raise ValueError(f"unknown arms {bad}; known: {sorted(VARIANTS)}")
    lens = cell_lengths(seed)
    out = []
    for c in cells:
        arms = tuple(a for a in CELL_ARMS[c] if a not in drop)
        missing = [a for a in arms if a not in VARIANTS]
        if missing:
            raise ValueError(f"cell {c} names arms no variant builds: {missing}")
        out.append(CellPlan(c, tuple(lens[c]), arms))
    return out


def plan_rows(plans: Sequence[CellPlan], num_sms: int = plan_mod.DEFAULT_SMS) -> list[dict]:
    """What each cell's eager folded plan is (CPU): chunks, CTAs an SM, pages a CTA, the partials' bytes, the folded
    bytes, and the workspace's chunk count."""
    from foldkv.kernels.workspace import default_num_chunks

    lay = PagedKvLayout(G, KvFormat.FOLDED, PAGE, 0)
    rows = []
    for p in plans:
        lens = list(p.seq_lens)
        plan = plan_mod.plan_decode(lay, lens, device="cpu", num_sms=num_sms)
        pages = sum(lay.pages_for(n) for n in lens)
        ctas = plan.num_chunks * G.num_kv_heads
        rows.append({"cell": p.name, "requests": len(lens), "tokens": sum(lens), "pages": pages,
                     "cap_pages": plan.chunk_tokens // PAGE, "chunks": plan.num_chunks, "fused": plan.fused,
                     "ctas_per_sm": ctas / num_sms, "pages_per_cta": pages * G.num_kv_heads / ctas,
                     "partials_mb": plan.num_chunks * G.num_q_heads * (G.head_dim + 1) * 4 / 1e6,
                     "folded_gb": sum(lens) * G.num_kv_heads * 1280 / 1e9,
                     "workspace_chunks": default_num_chunks(len(lens), num_sms, G.num_kv_heads)})
    return rows


# --- the cases ------------------------------------------------------------------------------------------------------
class InOrderCase(AttentionCase):
    """The case with every request's pages in order in the pool (request after request, no scatter)."""

    @property
    def table_cpu(self) -> BlockTable:
        if self._table is None:
            lay = self.layout(KvFormat.FOLDED)
            self._table = PagedKvPool(lay, device="meta").allocate(self.seq_lens, pad_pages=1)
        return self._table


def make_case(cell: str, lens: Sequence[int], device: torch.device) -> AttentionCase:
    if cell == "resident":
        from fp8_harness import ResidentCase  # bench/

        return ResidentCase(lens, RESIDENT_PAGES, device=device)
    if cell.endswith("_inorder"):
        return InOrderCase(lens, device=device, min_copies=1)
    return AttentionCase(lens, device=device, min_copies=1)


def device_facts(device: torch.device) -> dict:
    """What the card is: the properties a per-card plan would key on, and its clocks before the run."""
    import subprocess

    p = torch.cuda.get_device_properties(device)
    facts = {"name": p.name, "sms": p.multi_processor_count, "l2_bytes": getattr(p, "L2_cache_size", None),
             "memory_bytes": p.total_memory, "cc": f"{p.major}.{p.minor}",
             "smem_per_sm": getattr(p, "shared_memory_per_multiprocessor", None)}
    try:
        facts["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,clocks.applications.graphics,"
             "power.limit,power.draw,temperature.gpu", "--format=csv"], capture_output=True, text=True,
            timeout=20).stdout.strip()
    except Exception as exc:
        facts["nvidia_smi"] = f"{type(exc).__name__}: {exc}"
    return facts


def arm_spec(name: str) -> ArmSpec | str:
    return VARIANTS[name]()


def small_check(device: torch.device, arms: Sequence[str], log) -> dict:
    """Every arm on SMALL_CHECK (one round: its check against the float64 reference, poisoned first, or its own);
    returns {arm: check dict or the error}. A failing arm is left out of the timed cells."""
    case = AttentionCase(SMALL_CHECK, device=device, min_copies=1)
    cell = run_cell("check/small", "decode", case, [arm_spec(a) for a in arms], rounds=1, warmup=0, log=log)
    case.release()
    torch.cuda.empty_cache()
    return {a: (cell["arms"][a].get("check") if cell["arms"][a]["status"] == "ok" else
                {"ok": False, "status": cell["arms"][a]["status"], "reason": cell["arms"][a].get("reason", "")})
            for a in arms}


def save(path: str, record: dict) -> None:
    from foldkv.lab.jsonsafe import jsonable

    with open(path, "w") as fh:
        json.dump(jsonable(record), fh, indent=1, allow_nan=False)


def summary_lines(cell: dict, num_sms: int) -> list[str]:
    """One line an arm: its median, against the plain read of its format, and per page tile of an SM (the case's
    page tiles over the SMs: what a tile's chain costs in the resident cell)."""
    tiles = sum(-(-n // PAGE) for n in cell["seq_lens"]) * G.num_kv_heads / num_sms
    arms = {n: a for n, a in cell["arms"].items() if a["status"] == "ok"}
    read = {f: arms.get(f"read_{f}", {}).get("us", {}).get("median") for f in ("folded", "split")}
    lines = []
    for n, a in cell["arms"].items():
        if a["status"] != "ok":
            lines.append(f"{cell['cell']:<24} {n:<28} {a['status']}: {a.get('reason', '')[:100]}")
            continue
        us = a["us"]["median"]
        r = read.get(a["format"])
        ok = a["check"].get("ok")
        lines.append(f"{cell['cell']:<24} {n:<28} {us:10.1f} us  x read {us / r if r else float('nan'):6.3f}  "
                     f"{us / tiles:5.2f} us a tile  chunks {str(a.get('info', {}).get('chunks', '')):>5}  "
                     f"check {'ok' if ok else 'FAILED'}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for multiwave_probe.json (written after every cell)")
    ap.add_argument("--cells", nargs="*", default=None, help=f"cells in order (default: all: {' '.join(CELLS)})")
    ap.add_argument("--drop", nargs="*", default=[], help="arms left out of every cell")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=240.0, help="no new cell starts after this many seconds")
    ap.add_argument("--workers", type=int, default=10, help="processes compiling the kernels side by side")
    ap.add_argument("--plans", action="store_true", help="print the cells' plans (CPU) and exit")
    args = ap.parse_args(argv)
    plans = probe_plan(args.cells, args.seed, args.drop)  # refuses unknown names before any GPU work
    if args.plans:
        for row in plan_rows(plans):
            print("  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
        return 0
    if not torch.cuda.is_available():
        sys.exit("no CUDA device: --plans runs on the CPU")
    t0 = time.perf_counter()
    log = lambda s: print(f"[{time.perf_counter() - t0:6.1f} s] {s}", flush=True)  # noqa: E731
    out_json = os.path.join(args.out, "multiwave_probe.json") if args.out else None
    device = torch.device("cuda")
    from foldkv.lab.bench import measure_read_roof
    from foldkv.lab.report import environment
    from foldkv.provenance import provenance

    record: dict = {"facts": device_facts(device), "seed": args.seed, "plans": plan_rows(
        plans, plan_mod.device_sms(device)), "cells": []}
    log(f"device: {record['facts']}")
    record["compile_s"] = precompile(list(KERNELS), args.workers, log)
    record["roof"] = roof = measure_read_roof(device)
    log(f"read roof {roof['gbps']:.0f} GB/s")
    arms = tuple(dict.fromkeys(a for p in plans for a in p.arms))
    try:
        record["small_check"] = checks = small_check(device, arms, log)
    except Exception as exc:  # a device fault: nothing after it can be trusted
        record["small_check_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        log(f"small-case check failed: {record['small_check_error']}")
        if out_json:
            save(out_json, record)
        return 1
    failed = sorted(a for a, c in checks.items() if not (c or {}).get("ok"))
    log(f"small-case check: {len(arms) - len(failed)} of {len(arms)} arms ok" + (f"; left out: {failed}" if failed
                                                                                else ""))
    if out_json:
        save(out_json, record)
    for p in plans:
        if time.perf_counter() - t0 > args.budget_s:
            log(f"{p.name}: not run (the budget of {args.budget_s:.0f} s is spent)")
            record.setdefault("not_run", []).append(p.name)
            continue
        log(f"cell {p.name}: {len(p.seq_lens)} requests, {sum(p.seq_lens)} tokens")
        case = None
        try:
            case = make_case(p.name, p.seq_lens, device)
            cell = run_cell(f"multiwave/{p.name}", "decode", case, [arm_spec(a) for a in p.arms if a not in failed],
                            rounds=args.rounds, warmup=3, roof=roof, log=log)
        except Exception as exc:  # out of memory, say: recorded, and the next cell is tried
            cell = {"cell": f"multiwave/{p.name}", "error": f"{type(exc).__name__}: {str(exc)[:500]}", "arms": {},
                    "seq_lens": list(p.seq_lens)}
            log(f"cell {p.name} failed: {cell['error']}")
        if case is not None:
            case.release()
        torch.cuda.empty_cache()
        record["cells"].append(cell)
        for line in summary_lines(cell, plan_mod.device_sms(device)):
            print(line, flush=True)
        if out_json:
            record.update(env=environment(device), provenance=provenance())
            save(out_json, record)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
