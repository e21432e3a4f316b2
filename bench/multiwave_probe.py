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
folded partial at two CTAs an SM (one stage each, planned for 2 x SMs; run 11's `folded_2cta_w264`,
bench/versions/decode_partial_two_ctas.py); the folded partial prefetching the page tile 2 or 3 tiles ahead into L2
(bench/versions/decode_partial_l2_prefetch.py); the plain read
of each format's bytes; and a paged read (Triton, no attention) of exactly the page tiles the eager plan's chunks
read, in their chunks, from the scattered table and from the same pages in order.

    source .devsite/env.sh; export PYTHONPATH=$PWD/lib:$PYTHONPATH
    python3 bench/multiwave_probe.py --out $OUT                # on the device: every cell, in order, within --budget-s
    python3 bench/multiwave_probe.py --plans                   # CPU: the cells' lengths, plans, CTAs an SM, partials

The tile sweep (`--tile-sweep`, DECODE_NOTES run 24, ~1 minute): no attention and no TileLang; the same paged read,
over tables of tile slots in one pool-sized buffer (two copies), at tile sizes of 40-320 KB, one stream or a page's
four, page-major or head-major in groups of four pages, and today's tiles padded or at split's addresses, all in one
`run_cell` cell against the streaming read of the same bytes (`read_folded` of a 655,360-token folded pool).

    python3 bench/multiwave_probe.py --tile-sweep --out $OUT   # on the device
    python3 bench/multiwave_probe.py --tile-sweep --plans      # CPU: each layout's stride, programs, phases, extent
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
# the issue's batches, drawn anew (lengths no notebook uses): name -> (requests, ranges); a request takes
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
_TILE_SUM: list = []  # the Triton kernel, defined once (in the interpreter when TRITON_INTERPRET=1 is set then)


def paged_tile_sum_kernel():
    """The @triton.jit kernel of the paged read: one program per (chunk, KV head) sums every tile its chunk covers,
    tile `ids[req, page] * HKV + head` of TILE elements at PITCH elements a slot (the pool's tiles: PITCH = TILE),
    whole tiles as the partial's TMA loads them, into out[chunk * HKV + head] (float32). Raises ImportError without
    Triton."""
    global triton, tl  # Triton resolves a kernel's names through its function's globals
    import triton
    import triton.language as tl

    if not _TILE_SUM:
        @triton.jit
        def paged_tile_sum(pool_ptr, ids_ptr, req_ptr, start_ptr, len_ptr, out_ptr, max_pages, HKV: tl.constexpr,
                           PAGE_: tl.constexpr, TILE: tl.constexpr, PITCH: tl.constexpr, BLOCK: tl.constexpr):
            c = tl.program_id(0)
            h = tl.program_id(1)
            req = tl.load(req_ptr + c).to(tl.int64)
            first = tl.load(start_ptr + c) // PAGE_
            pages = (tl.load(len_ptr + c) + PAGE_ - 1) // PAGE_
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for p in range(0, pages):
                page = tl.load(ids_ptr + req * max_pages + first + p).to(tl.int64)
                base = (page * HKV + h) * PITCH
                for b in tl.static_range(TILE // BLOCK):  # the tile's blocks issued together: a tile in flight
                    acc += tl.load(pool_ptr + base + b * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
            tl.store(out_ptr + c * HKV + h, tl.sum(acc, axis=0))

        _TILE_SUM.append(paged_tile_sum)
    return _TILE_SUM[0]


def tile_block(tile: int) -> int:
    """Elements a load of the paged read takes: 4,096 (8 KB of bf16) where the tile is whole blocks of it, else
    2,048. Raises ValueError for a tile of neither."""
    for block in (4096, 2048):
        if tile % block == 0:
            return block
    raise ValueError(f"a tile of {tile} elements is not whole blocks of 2,048 elements (4 KB of bf16)")


def launch_tile_sum(flat: torch.Tensor, ids: torch.Tensor, chunk_req, chunk_start, chunk_len, out: torch.Tensor, *,
                    hkv: int, page: int, tile: int, pitch: int):
    """The paged read over `flat` (bf16 elements): grid (chunks, hkv), tiles of `tile` elements `pitch` apart.
    Returns what the launch returns (the compiled kernel on a GPU: its registers and spills)."""
    return paged_tile_sum_kernel()[(chunk_req.numel(), hkv)](
        flat, ids, chunk_req, chunk_start, chunk_len, out, ids.shape[1], HKV=hkv, PAGE_=page, TILE=tile, PITCH=pitch,
        BLOCK=tile_block(tile), num_warps=8)


def paged_read_kernel():
    """run(pool_data, page_ids, chunk_req, chunk_start, chunk_len, out): the paged read (`paged_tile_sum_kernel`)
    of a pool's page tiles (64 tokens x row, contiguous, one per (page, KV head)) over a plan's chunks into
    out[chunk, head]. Raises ImportError without Triton."""
    paged_tile_sum_kernel()

    def run(data: torch.Tensor, page_ids: torch.Tensor, chunk_req, chunk_start, chunk_len, out: torch.Tensor) -> None:
        pages, hkv, page, width = data.shape
        launch_tile_sum(data, page_ids, chunk_req, chunk_start, chunk_len, out, hkv=hkv, page=page,
                        tile=page * width, pitch=page * width)

    return run


def expected_tile_sums(flat: torch.Tensor, slots: torch.Tensor, tile: int, pitch: int) -> tuple[float, float]:
    """(sum, sum of |.|) in float64 of the tiles `slots` name in `flat` (bf16 elements): tile s is `tile` elements
    from s * pitch. What a paged read of those tiles must add up to."""
    listed = slots.reshape(-1).long().cpu()
    flat = flat.reshape(-1)
    n = int(listed.max()) + 1
    if int(listed.min()) < 0 or (n - 1) * pitch + tile > flat.numel():
        raise ValueError(f"slots {int(listed.min())}..{n - 1} of {tile} elements at a pitch of {pitch} leave a buffer "
                         f"of {flat.numel()} elements")
    slotted = flat.as_strided((n, tile), (pitch, 1))  # a view: no copy of the buffer
    total = absolute = 0.0
    for lo in range(0, listed.numel(), 1024):  # a block of tiles at a time: no float64 copy of the buffer
        rows = slotted[listed[lo:lo + 1024].to(flat.device)].double()
        total += float(rows.sum())
        absolute += float(rows.abs().sum())
    return total, absolute


def expected_page_sums(data: torch.Tensor, page_ids: torch.Tensor, chunks: Sequence[tuple[int, int, int]],
                       page: int = PAGE) -> tuple[float, float]:
    """(sum, sum of |.|) in float64 of every page tile (all KV heads) that `chunks` ((request, first token, tokens)
    each) cover through `page_ids`: what the paged read must add up to."""
    ids = page_ids.cpu()
    listed = torch.cat([ids[r, s // page:s // page + -(-n // page)] for r, s, n in chunks]).long()
    per_page = data[0].numel()
    return expected_tile_sums(data.reshape(-1), listed, per_page, per_page)


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
    "folded_2cta": ("versions.decode_partial_two_ctas:build", dict(fmt="folded")),  # bench/versions/
    **{f"folded_prefetch{d}": ("versions.decode_partial_l2_prefetch:build", dict(fmt="folded", distance=d))
       for d in PREFETCH_TILES},
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


# --- the tile sweep: a plain read of tiles at every size, pitch and order, nothing else (DECODE_NOTES run 24) --------
# Run 23 found the folded multi-wave loss in the read of its tiles alone: the paged read of exactly its page tiles is
# 1.21-1.24x the streaming read on the H100, split's 0.99-1.03x. The sweep reads one pool's bytes with that same
# kernel through tables of tile slots, each cell a tile size, a slot pitch, tiles a page and an order, so that which
# property of today's tile the card charges for is told apart.
KB = 1024
FOLDED_TILE = PagedKvLayout(G, KvFormat.FOLDED, PAGE, 0)  # today's folded page: [heads, 64 rows, 640 columns] bf16
SPLIT_TILE = PagedKvLayout(G, KvFormat.SPLIT, PAGE, 0)  # and split's: [heads, 64 rows, 1,024 columns]
SWEEP_TOKENS = 655_360  # every cell reads a folded pool of this many tokens: 10,240 pages, 3.36 GB (run 23's 2-8 GB)
SWEEP_PROGRAM_PAGES = 16  # pages one program reads, whatever the tile (run 23's uniform24: 15.7 pages a CTA; the plan
#                           counts pages, so folded and split read the same pages a CTA there)
SWEEP_COPIES = 2  # buffer copies the calls alternate over (5.37 GB each, 3.36 GB read: nothing left in the 50 MB L2)
SWEEP_WAVE = 5 * 132  # programs running at once: 5 an SM (43-48 registers, 8 warps) on 132 SMs
CAMP_PERIOD = 5 * 16 * KB  # hypothesis C's address period: 5 HBM stacks (the H100's) at 16 KB a stack


def page_tile_bytes(lay: PagedKvLayout) -> int:
    """Bytes of one (page, KV head) tile of a pool: page_size rows x row_width elements."""
    return lay.page_size * lay.row_width * lay.dtype.itemsize


class TileLayout(NamedTuple):
    """How the sweep lays a pool's tiles out: tile (page p, stream h) is `tile` bytes at slot
    ((p // group) * streams + h) * group + p % group, `pitch` bytes a slot. streams = the KV heads of a page (1: one
    stream, a program's tiles back to back); group = 1 is today's page-major order ([pages, heads, rows, row]),
    group > 1 head-major within groups of that many pages ([groups, heads, group, rows, row]); pitch > tile pads
    every tile."""
    tile: int
    pitch: int
    streams: int
    group: int = 1

    @property
    def name(self) -> str:
        return f"t{self.tile // KB}_p{self.pitch // KB}_k{self.streams}_g{self.group}"

    @property
    def stride(self) -> int:
        """Bytes between the starts of consecutive tiles one program reads, outside a group: streams x group x
        pitch (group x pitch apart inside one: the tiles of a group are back to back where pitch = tile)."""
        return self.streams * self.group * self.pitch


TODAY_FOLDED = TileLayout(page_tile_bytes(FOLDED_TILE), page_tile_bytes(FOLDED_TILE), G.num_kv_heads)  # 80 / 320 KB
TODAY_SPLIT = TileLayout(page_tile_bytes(SPLIT_TILE), page_tile_bytes(SPLIT_TILE), G.num_kv_heads)  # 128 / 512 KB
SWEEP_TILES_KB = (40, 80, 128, 160, 256, 320)
SWEEP_LAYOUTS = (
    *(TileLayout(t * KB, t * KB, G.num_kv_heads) for t in SWEEP_TILES_KB),  # page-major, as today: tile size
    *(TileLayout(t * KB, t * KB, 1) for t in SWEEP_TILES_KB),  # one stream: a program's tiles back to back
    *(TileLayout(t * KB, t * KB, G.num_kv_heads, 4) for t in SWEEP_TILES_KB),  # head-major in groups of 4 pages
    TileLayout(80 * KB, 128 * KB, G.num_kv_heads),  # today's 80 KB tile at split's addresses (stride 512 KB)
    TileLayout(80 * KB, 88 * KB, G.num_kv_heads),  # today's tile padded by 8 KB (stride 352 KB)
    TileLayout(128 * KB, 160 * KB, 2),  # split's tile at folded's stride (320 KB) and a 160 KB pitch
    TileLayout(128 * KB, 160 * KB, G.num_kv_heads),  # split's tile at a 160 KB pitch (stride 640 KB)
)


def sweep_read_bytes(tokens: int | None = None) -> int:
    """The bytes every cell of the sweep reads: a folded pool of `tokens` tokens (default SWEEP_TOKENS; whole
    pages), the same count the denominator (the case's `read_folded`) streams."""
    tokens = SWEEP_TOKENS if tokens is None else int(tokens)
    return -(-tokens // PAGE) * G.num_kv_heads * page_tile_bytes(FOLDED_TILE)


def sweep_slots(lay: TileLayout, read_bytes: int | None = None, program_pages: int | None = None) -> torch.Tensor:
    """int32 [programs, tiles a program]: the slot of every tile each program reads, a program one stream's run of
    `program_pages` (default SWEEP_PROGRAM_PAGES) consecutive pages, rows stream by stream (row h * chunks + c: the order run 23's
    grid (chunks, heads) launches its programs in). Raises ValueError, before anything is allocated, for a layout
    that cannot cover `read_bytes` (default `sweep_read_bytes()`) exactly in whole tiles, programs and groups, or a
    tile or pitch the kernel cannot read (whole 4 KB blocks; pitch >= tile, a multiple of 16 bytes)."""
    read_bytes = sweep_read_bytes() if read_bytes is None else int(read_bytes)
    program_pages = SWEEP_PROGRAM_PAGES if program_pages is None else int(program_pages)
    per_page = lay.streams * lay.tile
    problems = [why for bad, why in (
        (lay.tile <= 0 or lay.tile % (4 * KB), f"tile {lay.tile} B is not whole 4 KB blocks"),
        (lay.pitch < lay.tile or lay.pitch % 16, f"pitch {lay.pitch} B: need >= the tile and a multiple of 16 B"),
        (lay.streams < 1 or lay.group < 1, "streams and group must be >= 1"),
        (read_bytes % per_page, f"{read_bytes} B is not whole pages of {per_page} B"),
        (program_pages < 1, f"{program_pages} pages a program"),
    ) if bad]
    if not problems:
        pages = read_bytes // per_page
        problems = [why for bad, why in (
            (pages % program_pages, f"{pages} pages are not whole programs of {program_pages}"),
            (pages % lay.group, f"{pages} pages are not whole groups of {lay.group}"),
        ) if bad]
    if problems:
        raise ValueError(f"tile layout {lay}: " + "; ".join(problems))
    p = torch.arange(pages).view(-1, program_pages)  # [chunks, tiles a program]: a stream's pages in order
    h = torch.arange(lay.streams).view(-1, 1, 1)
    slots = ((p // lay.group) * lay.streams + h) * lay.group + p % lay.group  # [streams, chunks, tiles]
    return slots.reshape(-1, program_pages).to(torch.int32)


def tile_coverage(slots: torch.Tensor, lay: TileLayout) -> dict:
    """What the tiles of `slots` cover: {"tiles", "bytes" (tiles x tile, the bytes a read of them claims),
    "buffer_bytes" (the slots' extent), "tile_starts" (bytes, sorted)}; ValueError where two tiles share a byte (a
    slot listed twice, or a pitch below the tile) or a slot is negative."""
    listed = slots.reshape(-1).long()
    starts = torch.sort(listed * lay.pitch).values
    if listed.numel() == 0 or int(starts[0]) < 0:
        raise ValueError("no tiles, or a negative slot")
    gaps = starts[1:] - starts[:-1]
    if bool((gaps < lay.tile).any()):
        i = int(torch.nonzero(gaps < lay.tile)[0])
        raise ValueError(f"tiles at bytes {int(starts[i])} and {int(starts[i + 1])} overlap ({lay.tile} B a tile)")
    return {"tiles": listed.numel(), "bytes": listed.numel() * lay.tile,
            "buffer_bytes": int(starts[-1]) + lay.pitch, "tile_starts": starts}


def lockstep_phases(slots: torch.Tensor, lay: TileLayout, period: int = CAMP_PERIOD, wave: int = SWEEP_WAVE) -> int:
    """Hypothesis C's measure: programs of the first wave (the first `wave` rows, launched together) reading their
    k-th tiles at the same pace touch addresses that differ by their tile starts; the fewest distinct residues of
    those starts modulo `period` over k. 1: every program of the wave is at the same place in the period at once."""
    starts = slots[:wave].long() * lay.pitch % period  # [programs, tiles]
    return min(len(torch.unique(starts[:, k])) for k in range(starts.shape[1]))


def sweep_rows(layouts: Sequence[TileLayout] | None = None, read_bytes: int | None = None) -> list[dict]:
    """The sweep's cells (default SWEEP_LAYOUTS) as bookkeeping (CPU): name, tile, pitch, streams, group, stride, programs, tiles a program,
    the bytes read and the buffer they span, and `phases` (`lockstep_phases`)."""
    rows = []
    for lay in SWEEP_LAYOUTS if layouts is None else layouts:
        slots = sweep_slots(lay, read_bytes)
        cov = tile_coverage(slots, lay)
        rows.append({"cell": lay.name, "tile_kb": lay.tile / KB, "pitch_kb": lay.pitch / KB, "streams": lay.streams,
                     "group": lay.group, "stride_kb": lay.stride / KB, "programs": slots.shape[0],
                     "tiles_a_program": slots.shape[1], "read_bytes": cov["bytes"],
                     "buffer_bytes": cov["buffer_bytes"], "phases": lockstep_phases(slots, lay)})
    return rows


_SWEEP_BUFFERS: dict = {}


def sweep_buffers(device: torch.device, nbytes: int) -> list[torch.Tensor]:
    """SWEEP_COPIES buffers of `nbytes` (whole 8 KB blocks; values uniform in [0, 1), `roofs.stream_read_buffers`),
    made once a run and shared by every cell: the cells differ in which bytes they read, not in what is there."""
    from foldkv.lab.bench import stream_read_buffers

    key = (str(device), int(nbytes))
    if key not in _SWEEP_BUFFERS:
        _SWEEP_BUFFERS.clear()
        _SWEEP_BUFFERS[key] = stream_read_buffers(nbytes, device, SWEEP_COPIES, max_bytes=SWEEP_COPIES * nbytes)[0]
    return _SWEEP_BUFFERS[key]


def sweep_buffer_bytes(layouts: Sequence[TileLayout] | None = None) -> int:
    """The one buffer size every cell (default SWEEP_LAYOUTS) fits in: the largest extent, rounded up to whole 8 KB
    blocks."""
    layouts = SWEEP_LAYOUTS if layouts is None else layouts
    extent = max(tile_coverage(sweep_slots(lay), lay)["buffer_bytes"] for lay in layouts)
    return -(-extent // (8 * KB)) * (8 * KB)


def tile_read_arm(lay: TileLayout, buffer_bytes: int) -> ArmSpec:
    """The paged read (`paged_tile_sum_kernel`, run 23's) of the tiles `sweep_slots(lay)` names in the sweep's
    shared buffers (one program a row, grid (programs, 1)). Checked: its sums, poisoned first, add up to the float64
    sum of exactly those tiles. Its info: the layout and the compiled kernel's registers and spills."""
    slots_cpu = sweep_slots(lay)  # a bad layout is refused here, before any buffer or launch
    cov = tile_coverage(slots_cpu, lay)
    if cov["buffer_bytes"] > buffer_bytes:
        raise ValueError(f"{lay.name} spans {cov['buffer_bytes']} B, past the sweep's buffer of {buffer_bytes} B")

    def build(case: AttentionCase) -> ArmImpl:
        bufs = sweep_buffers(case.device, buffer_bytes)
        ids = slots_cpu.to(case.device)
        programs, tiles = ids.shape
        req = torch.arange(programs, dtype=torch.int32, device=case.device)
        start = torch.zeros(programs, dtype=torch.int32, device=case.device)
        lens = torch.full((programs,), tiles * PAGE, dtype=torch.int32, device=case.device)
        out = torch.empty(programs, dtype=torch.float32, device=case.device)
        tile, pitch = lay.tile // 2, lay.pitch // 2  # bf16 elements
        launched: list = []

        def call(b):
            k = launch_tile_sum(b, ids, req, start, lens, out, hkv=1, page=PAGE, tile=tile, pitch=pitch)
            if not launched:
                launched.append(k)

        calls = [lambda b=b: call(b) for b in bufs]

        def check() -> dict:
            out.fill_(float("nan"))
            calls[0]()
            torch.cuda.synchronize(case.device)
            total, absolute = expected_tile_sums(bufs[0], slots_cpu, tile, pitch)
            err = abs(float(out.double().sum()) - total) / max(1.0, absolute)
            written = bool(torch.isfinite(out).all())
            k = launched[0] if launched else None
            info.update(registers=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None))
            return {"written": written, "rel_err": err, "tol": PAGED_READ_TOL, "ok": written and err <= PAGED_READ_TOL,
                    "what": "program sums against the float64 sum of the tiles the slots name"}

        info = {"tile_kb": lay.tile / KB, "pitch_kb": lay.pitch / KB, "streams": lay.streams, "group": lay.group,
                "stride_kb": lay.stride / KB, "programs": programs, "tiles_a_program": tiles, "read_bytes": cov["bytes"],
                "phases": lockstep_phases(slots_cpu, lay)}
        return ArmImpl(calls, out, graph=True, keep=(ids, req, start, lens, bufs), check=check, info=info)

    return ArmSpec(lay.name, f"paged read of {lay.tile // KB} KB tiles at a {lay.pitch // KB} KB pitch, "
                   f"{lay.streams} a page, groups of {lay.group} page(s) (stride {lay.stride // KB} KB)", "folded",
                   False, build)


SWEEP_DENOMINATOR = "read_folded"  # the streaming read of the folded pool of SWEEP_TOKENS: run 23's denominator


def sweep_case(device: torch.device) -> AttentionCase:
    """The sweep's case: one request of SWEEP_TOKENS, whose folded bytes `read_folded` streams (its pools are never
    made: the cells read the sweep's own buffers)."""
    return AttentionCase([SWEEP_TOKENS], device=device, min_copies=1)


def denominator_bytes(case: AttentionCase) -> int:
    """The bytes the sweep's denominator streams for `case` (what `arms._stream_read` hands `stream_read_arm`)."""
    from foldkv.lab import byte_floor

    return byte_floor.step_bytes(case.geom, KvFormat.FOLDED, case.seq_lens)["kv"]


def sweep_table(cell: dict) -> list[dict]:
    """Each layout's median against the streaming read of the same bytes (`x_read`) and against the one-stream
    layout of the same tile (`x_one_stream`: the same kernel and tiles, back to back), with its paired ratio to the
    read (median of per-round ratios), its phases and the kernel's registers."""
    arms = {n: a for n, a in cell["arms"].items() if a["status"] == "ok"}
    read = arms.get(SWEEP_DENOMINATOR, {}).get("us", {}).get("median")
    rows = []
    for lay in SWEEP_LAYOUTS:
        a = arms.get(lay.name)
        if a is None:
            rows.append({"cell": lay.name, "status": cell["arms"].get(lay.name, {}).get("status", "absent")})
            continue
        us = a["us"]["median"]
        one = arms.get(TileLayout(lay.tile, lay.tile, 1).name, {}).get("us", {}).get("median")
        paired = (cell.get("speedup", {}).get(SWEEP_DENOMINATOR, {}).get(lay.name, {}).get("paired") or {})
        rows.append({"cell": lay.name, "status": "ok", "us": us, "x_read": us / read if read else None,
                     "x_read_paired": paired.get("median"), "x_one_stream": us / one if one else None,
                     "check": a["check"].get("ok"), **{k: a["info"].get(k) for k in (
                         "tile_kb", "pitch_kb", "streams", "group", "stride_kb", "phases", "registers", "spills")}})
    return rows


def sweep_lines(table: Sequence[dict]) -> list[str]:
    """`sweep_table`'s rows as the log's lines: a header, then one line a layout (n/a where a value is missing)."""
    f = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
    lines = [f"{'cell':<18} {'tile':>5} {'pitch':>5} {'k':>2} {'g':>2} {'stride':>6} {'phases':>6} {'regs':>4} "
             f"{'us':>9} {'x read':>7} {'paired':>7} {'x 1 stream':>10}  check"]
    for r in table:
        if r["status"] != "ok":
            lines.append(f"{r['cell']:<18} {r['status']}")
            continue
        lines.append(f"{r['cell']:<18} {r['tile_kb']:5.0f} {r['pitch_kb']:5.0f} {r['streams']:2d} {r['group']:2d} "
                     f"{r['stride_kb']:6.0f} {r['phases']:6d} {f(r['registers'], 'd'):>4} {r['us']:9.1f} "
                     f"{f(r['x_read'], '.3f'):>7} {f(r['x_read_paired'], '.3f'):>7} {f(r['x_one_stream'], '.3f'):>10}"
                     f"  {'ok' if r['check'] else 'FAILED'}")
    return lines


def run_tile_sweep(args, log) -> int:
    """The sweep on the device: the read roof, then one cell of every layout and the denominator, interleaved round
    by round (`run_cell`), the JSON written at the end."""
    from foldkv.lab.bench import measure_read_roof
    from foldkv.lab.checkout_stamp import provenance
    from foldkv.lab.report import environment

    device = torch.device("cuda")
    nbytes = sweep_buffer_bytes()
    arms = [SWEEP_DENOMINATOR] + [tile_read_arm(lay, nbytes) for lay in SWEEP_LAYOUTS]  # layouts checked here
    case = sweep_case(device)
    if denominator_bytes(case) != sweep_read_bytes():
        raise ValueError(f"the denominator streams {denominator_bytes(case)} B, the cells read {sweep_read_bytes()} B")
    record: dict = {"facts": device_facts(device), "layouts": [
        {k: v for k, v in r.items()} for r in sweep_rows()], "buffer_bytes": nbytes, "copies": SWEEP_COPIES}
    log(f"device: {record['facts']}")
    record["roof"] = roof = measure_read_roof(device)
    log(f"read roof {roof['gbps']:.0f} GB/s; {len(SWEEP_LAYOUTS)} layouts over {SWEEP_COPIES} buffers of "
        f"{nbytes / 1e9:.2f} GB, each cell reading {sweep_read_bytes() / 1e9:.3f} GB")
    cell = run_cell("tile_sweep", "decode", case, arms, rounds=args.rounds, warmup=3, roof=roof, log=log)
    record["cell"] = cell
    record["table"] = table = sweep_table(cell)
    record.update(env=environment(device), provenance=provenance())
    if args.out:
        save(os.path.join(args.out, "tile_sweep.json"), record)
    read = cell["arms"].get(SWEEP_DENOMINATOR, {})
    log(f"{SWEEP_DENOMINATOR}: {read.get('us', {}).get('median', float('nan')):.1f} us, "
        f"check {read.get('check', {}).get('ok')}")
    for line in sweep_lines(table):
        print(line, flush=True)
    case.release()
    return 0


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
    ap.add_argument("--tile-sweep", action="store_true",
                    help="instead of the cells: the plain read of tiles at every size, pitch and order "
                         "(SWEEP_LAYOUTS) against the streaming read of the same bytes; with --plans, their "
                         "bookkeeping (CPU)")
    args = ap.parse_args(argv)
    if args.tile_sweep:
        if args.plans:
            for row in sweep_rows():
                print("  ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            return 0
        if not torch.cuda.is_available():
            sys.exit("no CUDA device: --tile-sweep --plans runs on the CPU")
        t0 = time.perf_counter()
        return run_tile_sweep(args, lambda s: print(f"[{time.perf_counter() - t0:6.1f} s] {s}", flush=True))
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
    from foldkv.lab.checkout_stamp import provenance
    from foldkv.lab.report import environment

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
