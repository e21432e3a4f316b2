"""The long walk: one captured decode-workspace graph replayed for thousands of steps while requests finish and new
ones join, their pages from the pool's allocator (grown page by page, freed one request at a time).

`WalkScheduler` is the host side, no kernels: which requests are in the batch, their lengths, the pages they hold
(`PagedKvPool.empty_table` slots, `grow`, `release(table, request)`) and what changed at each step.
`long_walk` (GPU) drives a `DecodeWorkspace` with it: `plan()` at each join or leave, `advance()` otherwise, each
new token's row written before the step that reads it (rows not written yet are NaN), and every `check_every`-th
step the graph's output is held bit for bit to an eager step of the same workspace and, with an eager `decode()`
of its own plan, to the float64 reference with the gates' derived bounds. GPU memory allocated after the first
step and at the end must be the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..layout import KvFormat
from ..pool import BlockTable, PagedKvLayout, PagedKvPool
from ..validate import FoldKvInputError

WALK_STEPS = 20_000
WALK_CHECK_EVERY = 500
WALK_MAX_BATCH = 8
WALK_MAX_LEN = 8192


@dataclass
class WalkStep:
    """What one scheduler step changed, for the device side to apply before the next decode step.

    writes: (slot, position) of each token whose row must be in the pool before the next step (each running
    request's new token; every prompt token of a request that joined). grown: (slot, column, page) of each page a
    running request was given. changed: a request joined or left (the workspace plans again; else it advances)."""

    writes: list[tuple[int, int]] = field(default_factory=list)
    grown: list[tuple[int, int, int]] = field(default_factory=list)
    joined: list[int] = field(default_factory=list)
    left: list[int] = field(default_factory=list)
    waited: int = 0  # joins put off: no free slot's worth of pages

    @property
    def changed(self) -> bool:
        return bool(self.joined or self.left)


class WalkScheduler:
    """Requests of a serving loop over `pool`'s allocator: up to `max_batch` at once (one slot each of an
    `empty_table`), each joining with a prompt of 1 to `max_prompt` tokens (page edges over-drawn) and leaving after
    1 to `max_life` generated tokens (never past `max_len`). Each `step()` is the host work between two decode
    steps: every running request's new token (a page grown when it starts one), the finished ones released, new
    ones joined with probability `join_prob` per step while a slot and the pages of its whole life are free beside
    those promised to the running ones (`promised`; always when none runs).
    `live` is the batch in the workspace's row order (order of joining)."""

    def __init__(self, pool: PagedKvPool, *, max_batch: int = WALK_MAX_BATCH, max_len: int = WALK_MAX_LEN,
                 max_prompt: int | None = None, max_life: int = 3000, join_prob: float = 0.02, seed: int = 0):
        if not 1 <= max_batch or max_len < 2:
            raise FoldKvInputError(f"max_batch={max_batch} must be >= 1 and max_len={max_len} >= 2")
        self.pool, self.page = pool, pool.layout.page_size
        self.max_batch, self.max_len = int(max_batch), int(max_len)
        self.max_prompt = int(max_prompt or max_len // 2)
        self.max_life, self.join_prob = int(max_life), float(join_prob)
        self.rng = np.random.default_rng(seed)
        self.table = pool.empty_table(self.max_batch, pool.layout.pages_for(self.max_len))
        self.lens = [0] * self.max_batch  # tokens in the pool per slot (0: empty slot)
        self.ends = [0] * self.max_batch  # the length at which the slot's request finishes
        self.live: list[int] = []
        self.joins = self.leaves = self.waits = 0
        self.step(first=True)

    # -- draws -------------------------------------------------------------------------------------------------------
    def _prompt(self) -> int:
        hi, rng = self.max_prompt, self.rng
        u = rng.random()
        if u < 0.4:  # a page edge: k pages, -1 / 0 / +1
            k = int(rng.integers(1, max(hi // self.page, 1) + 1))
            n = k * self.page + int(rng.integers(-1, 2))
        elif u < 0.5:
            n = int(rng.integers(1, 4))
        else:
            n = int(np.exp(rng.uniform(0, np.log(hi + 1))))
        return int(min(max(n, 1), hi))

    # -- the step ----------------------------------------------------------------------------------------------------
    def step(self, first: bool = False) -> WalkStep:
        """The host work after a decode step (`first`: before the first one: only joins)."""
        ev = WalkStep()
        if not first:
            done = [s for s in self.live if self.lens[s] + 1 >= self.ends[s]]  # its last token: nothing to store
            for s in self.live:
                pos = self.lens[s]
                if s in done:
                    continue
                if pos % self.page == 0:  # the new token starts a page
                    (page,) = self.pool.grow(self.table, s, pos + 1)
                    ev.grown.append((s, pos // self.page, page))
                ev.writes.append((s, pos))
                self.lens[s] = pos + 1
            for s in done:
                self.pool.release(self.table, s)
                self.live.remove(s)
                self.lens[s] = self.ends[s] = 0
                self.table.seq_lens[s] = 0
                ev.left.append(s)
                self.leaves += 1
        while len(self.live) < self.max_batch and (not self.live or self.rng.random() < self.join_prob):
            n = self._prompt()
            end = min(self.max_len, n + int(self.rng.integers(1, self.max_life + 1)))
            if self.pool.layout.pages_for(end) > self.pool.free_pages - self.promised():
                ev.waited += 1
                self.waits += 1
                if self.live:
                    break
                raise FoldKvInputError(f"the pool's {self.pool.layout.num_pages} pages cannot hold one prompt of {n}")
            s = next(i for i in range(self.max_batch) if i not in self.live)
            self.pool.grow(self.table, s, n)
            self.lens[s], self.ends[s] = n, end
            self.live.append(s)
            ev.joined.append(s)
            ev.writes += [(s, p) for p in range(n)]
            self.joins += 1
            if len(ev.joined) >= 2:  # at most two joins a step
                break
        for s in self.live:
            self.table.seq_lens[s] = self.lens[s]
        return ev

    def promised(self) -> int:
        """Pages the running requests will still be given before they finish: a request joins only when the pages
        for its whole life are free beside these, so a running request's growth is never refused."""
        return sum(self.pool.layout.pages_for(self.ends[s]) - len(self.pool.pages_held(self.table, s))
                   for s in self.live)

    # -- views -------------------------------------------------------------------------------------------------------
    @property
    def batch_lens(self) -> list[int]:
        """The running requests' lengths in the workspace's row order."""
        return [self.lens[s] for s in self.live]

    def batch_page_ids(self) -> torch.Tensor:
        """[batch, max_pages] int32 CPU: the running requests' block-table rows (padding past their pages)."""
        return self.table.page_ids[self.live].contiguous()

    def check(self) -> list[str]:
        """What is wrong now: a running request holding other than ceil(len / page) pages, a table row other than its
        pages, an empty slot holding pages, a page held twice or not accounted for."""
        bad, held = [], set()
        for s in range(self.max_batch):
            pages = self.pool.pages_held(self.table, s)
            want = self.pool.layout.pages_for(self.lens[s]) if s in self.live else 0
            if len(pages) != want:
                bad.append(f"slot {s} holds {len(pages)} pages for {self.lens[s]} tokens (wants {want})")
            if self.table.page_ids[s, :len(pages)].tolist() != pages:
                bad.append(f"slot {s}'s row {self.table.page_ids[s].tolist()} is not its pages {pages}")
            if held & set(pages):
                bad.append(f"pages {sorted(held & set(pages))} held twice")
            held |= set(pages)
        if len(held) + self.pool.free_pages != self.pool.layout.num_pages:
            bad.append(f"{len(held)} held + {self.pool.free_pages} free != {self.pool.layout.num_pages} pages")
        return bad

    def drain(self) -> None:
        """Every running request finishes; the table is released (the pool then holds nothing of it)."""
        self.pool.release(self.table)
        self.live.clear()


def walk_pool_pages(max_batch: int, max_len: int, page: int = 64, fill: float = 0.75) -> int:
    """A pool smaller than every slot at max_len (so joins sometimes wait for pages), but holding any one."""
    per = -(-max_len // page)
    return max(per, int(max_batch * per * fill))


def long_walk(fmt: KvFormat | str = KvFormat.FOLDED, *, steps: int = WALK_STEPS, check_every: int = WALK_CHECK_EVERY,
              max_batch: int = WALK_MAX_BATCH, max_len: int = WALK_MAX_LEN, seed: int = 0, backend: str = "jit",
              device: torch.device | str = "cuda", dtype: torch.dtype = torch.bfloat16,
              num_chunks: int | None = None, fused: bool | None = None, misplace_new_pages: bool = False) -> dict:
    """GPU: `steps` decode steps through one captured `DecodeWorkspace` graph while `WalkScheduler` joins and
    retires requests (module docstring). `misplace_new_pages` (the red twin): a page given between two plans
    reaches the workspace's block table as the pool's next page (a valid page holding other rows or NaN), which the
    checks must catch. Returns {"checks": [...], "passed", "joins", "leaves", "plans",
    "advances", "memory_first", "memory_end", "seconds" (the loop), "check_seconds" (its checks), ...}."""
    from ..kernels.decode import decode
    from ..kernels.workspace import DecodeWorkspace
    from .gates import OUT_POISON, bits as _bits, compare, compare_lse, decode_extra, lse_bound, reference_with_scales

    fmt, device = KvFormat.parse(fmt), torch.device(device)
    lay = PagedKvLayout(format=fmt, page_size=64, num_pages=walk_pool_pages(max_batch, max_len), dtype=dtype)
    pool = PagedKvPool(lay, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    # the rows every slot of every page will hold when written (random rows: the kernels attend over any rows)
    truth = torch.randn(lay.shape, generator=gen, device=device).to(dtype)
    truth_scales = None
    if lay.quantized:
        truth_scales = torch.rand(lay.scale_shape, generator=gen, device=device) * (4.0 / 448) + 1.0 / 448
        pool.scales.fill_(float("nan"))
    pool.data.fill_(float("nan"))
    sched = WalkScheduler(pool, max_batch=max_batch, max_len=max_len, seed=seed)
    geom, page = lay.geometry, lay.page_size
    # rows are moved as their bits (int16 / uint8 views: indexing works on every stored dtype)
    bits = torch.uint8 if lay.dtype.itemsize == 1 else torch.int16
    data_bits, truth_bits = pool.data.view(bits), truth.view(bits)
    nan_bits = int(torch.full((1,), float("nan"), dtype=dtype).view(bits)[0])

    def write(ev: WalkStep) -> None:
        fresh = [p for s in ev.joined for p in sched.pool.pages_held(sched.table, s)] + [p for _, _, p in ev.grown]
        if fresh:  # a page given now may hold an earlier request's rows: NaN until written
            pages = torch.tensor(fresh, dtype=torch.long, device=device)
            data_bits[pages] = nan_bits
            if truth_scales is not None:
                pool.scales[pages] = float("nan")
        if not ev.writes:
            return
        slot, pos = (torch.tensor(x, dtype=torch.long) for x in zip(*ev.writes))
        pg = sched.table.page_ids[slot, pos // page].long().to(device)
        off = (pos % page).to(device)
        data_bits[pg, :, off] = truth_bits[pg, :, off]
        if truth_scales is not None:
            pool.scales[pg, :, off] = truth_scales[pg, :, off]

    def plan(ws: DecodeWorkspace) -> None:
        ws.plan(sched.batch_lens, sched.batch_page_ids().to(device))

    write(WalkStep(writes=[(s, p) for s in sched.live for p in range(sched.lens[s])]))
    ws = DecodeWorkspace(lay, max_batch=max_batch, max_len=max_len, device=device, num_chunks=num_chunks)
    plan(ws)
    qgen = torch.Generator(device=device).manual_seed(seed + 1)
    ws.query.normal_(0.0, 0.05, generator=qgen)
    graph = ws.capture(pool, backend=backend, fused=fused)
    checks, plans, advances, memory_first, check_seconds = [], 1, 0, None, 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        ws.query.normal_(0.0, 0.05, generator=qgen)
        ws.out.fill_(OUT_POISON)
        ws.lse.fill_(OUT_POISON)
        graph.replay()
        if step % check_every == 0 or step == steps - 1:
            c0 = time.perf_counter()
            out, lse = (t.clone() for t in ws.output())
            e_out, e_lse = ws.step(pool, backend=backend, fused=fused)
            lens = sched.batch_lens
            now = BlockTable(sched.batch_page_ids().to(device), torch.tensor(lens, dtype=torch.int32, device=device))
            query = ws.query[:len(lens)].clone()
            d_out, d_lse = decode(pool, query, now, backend=backend)
            ref, ref_lse, pv_abs, s_abs_p, s_abs_max = reference_with_scales(pool, query, now, score_abs=True)
            extra_out, extra_lse = decode_extra(pool, query, now, ws.fp8_math)  # the partial's own terms
            bound = extra_lse + lse_bound(s_abs_p, s_abs_max, ref_lse, torch.tensor(lens), geom.head_dim)
            row = {"step": step, "batch": len(lens), "max_len": max(lens), "chunks_used": ws.chunks_used,
                   "bitwise_equal_to_eager": bool(torch.equal(_bits(out), _bits(e_out))
                                                  and torch.equal(_bits(lse), _bits(e_lse))),
                   "all_written": bool(torch.isfinite(out).all() and torch.isfinite(lse).all())}
            row.update(compare(out, ref, pv_abs, p_scaled=lay.quantized, extra=extra_out))
            row.update(compare_lse(lse, ref_lse, bound))
            eager = compare(d_out, ref, pv_abs, p_scaled=lay.quantized, extra=extra_out)
            eager.update(compare_lse(d_lse, ref_lse, bound))
            row["eager_decode_ok"] = all(eager[k] for k in ("elementwise_ok", "rel_ok", "lse_ok"))
            row["passed"] = all(row[k] for k in ("bitwise_equal_to_eager", "all_written", "elementwise_ok", "rel_ok",
                                                 "lse_ok", "eager_decode_ok"))
            checks.append(row)
            del out, lse, e_out, e_lse, now, query, d_out, d_lse, ref, ref_lse, pv_abs, s_abs_p, s_abs_max, bound
            del extra_out
            del eager
            torch.cuda.synchronize(device)
            check_seconds += time.perf_counter() - c0
        if step == 0:  # after the first step and its check (the check's first use of cuBLAS keeps its workspace)
            torch.cuda.synchronize(device)
            memory_first = torch.cuda.memory_allocated(device)
        if step == steps - 1:
            break
        ev = sched.step()
        write(ev)
        if ev.changed:
            plan(ws)
            plans += 1
        else:
            for s, col, pg in ev.grown:  # the new page in its request's workspace row
                ws.page_ids[sched.live.index(s), col].fill_((pg + 1) % lay.num_pages if misplace_new_pages else pg)
            ws.advance()
            advances += 1
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    memory_end = torch.cuda.memory_allocated(device)
    res = {"format": fmt.value, "dtype": str(dtype).replace("torch.", ""), "steps": steps, "max_batch": max_batch,
           "max_len": max_len, "pool_pages": lay.num_pages, "fused": ws.fused if fused is None else fused,
           "chunks": ws.num_chunks, "joins": sched.joins, "leaves": sched.leaves, "waits": sched.waits,
           "plans": plans, "advances": advances, "memory_first": memory_first, "memory_end": memory_end,
           "seconds": seconds, "check_seconds": check_seconds, "checks": checks}
    res["memory_same"] = memory_first == memory_end
    res["passed"] = res["memory_same"] and bool(checks) and all(r["passed"] for r in checks)
    return res


def long_walk_gate(seed: int, record, *, steps: int = WALK_STEPS) -> list[dict]:
    """GPU gate: `long_walk` on a folded bf16 pool with the fused one-wave step and with the three launches, and on
    an FP8 pool. Records `long_walk` (not run without CUDA) and returns one row per walk."""
    if not record.cuda_or_not_run("long_walk"):
        print(record.sections["long_walk"])
        return []
    from ..fp8 import FP8_DTYPE

    rows = []
    for label, kw in (("folded fused", dict(fused=None)), ("folded three-launch", dict(fused=False)),
                      ("folded fp8", dict(dtype=FP8_DTYPE))):
        res = long_walk(KvFormat.FOLDED, steps=steps, seed=seed, **kw)
        checks = res.pop("checks")
        rows.append({"walk": label, **res, "checked_steps": len(checks),
                     "worst_rel_fro": max(r["rel_fro"] for r in checks),
                     "worst_lse_fraction": max(r["lse_worst_fraction_of_bound"] for r in checks),
                     "failed_checks": [r["step"] for r in checks if not r["passed"]]})
    record.ran("long_walk", rows=rows, passed=all(r["passed"] for r in rows))
    return rows
