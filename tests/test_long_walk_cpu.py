"""The long walk's host side, no kernels: `WalkScheduler` over the pool's allocator for 20,000 steps, every step
checked against a model of what each request was given and written; its check's red twins (pages taken from a
running request, a row edited) are caught."""

from __future__ import annotations

import foldkv as fk
from foldkv.lab.long_walk import WALK_MAX_BATCH, WALK_MAX_LEN, WALK_STEPS, WalkScheduler, walk_pool_pages


def meta_pool(max_batch=WALK_MAX_BATCH, max_len=WALK_MAX_LEN) -> fk.PagedKvPool:
    return fk.PagedKvPool(fk.PagedKvLayout(num_pages=walk_pool_pages(max_batch, max_len)), device="meta")


def test_scheduler_walk_keeps_every_page_accounted_for():
    pool = meta_pool()
    sched = WalkScheduler(pool, seed=3)
    page = pool.layout.page_size
    written = {s: sched.lens[s] for s in sched.live}  # the first step's prompts are written before step 0
    plans = grown = 0
    for _ in range(WALK_STEPS - 1):
        before = list(sched.live)
        ev = sched.step()
        assert ev.changed == bool(ev.joined or ev.left)
        assert set(ev.left) <= set(before) and not set(ev.joined) & (set(before) - set(ev.left))
        for s in ev.left:  # a slot may take a new request in the step its last one left
            assert s in ev.joined or (s not in sched.live and pool.pages_held(sched.table, s) == [])
            written.pop(s)
        for s in ev.joined:
            written[s] = 0
        for s, pos in ev.writes:  # each request's tokens written once each, in order
            assert pos == written.get(s, -1), (s, pos, written.get(s))
            written[s] = pos + 1
            assert pool.holder_of(int(sched.table.page_ids[s, pos // page])).request == s
        for s, col, pg in ev.grown:
            assert int(sched.table.page_ids[s, col]) == pg and col == (sched.lens[s] - 1) // page
        assert {s: sched.lens[s] for s in sched.live} == {s: written[s] for s in sched.live}
        assert 1 <= len(sched.live) <= WALK_MAX_BATCH and max(sched.batch_lens) <= WALK_MAX_LEN
        assert sched.check() == []
        plans += ev.changed
        grown += len(ev.grown)
    assert sched.joins > 50 and sched.leaves > 50 and grown > 500 and plans > 50
    assert sched.batch_page_ids().shape == (len(sched.live), pool.layout.pages_for(WALK_MAX_LEN))
    sched.drain()
    assert pool.free_pages == pool.layout.num_pages and pool.ownership() == {} and pool.held_tables() == []


def test_joins_wait_for_the_pages_of_a_whole_life():
    """A pool of little more than one request at max_len: joins wait, and no running request's growth is refused."""
    pool = fk.PagedKvPool(fk.PagedKvLayout(num_pages=160), device="meta")
    sched = WalkScheduler(pool, max_batch=8, max_len=8192, join_prob=0.5, seed=1)
    for _ in range(5000):
        sched.step()
        assert sched.promised() <= pool.free_pages and sched.check() == []
    assert sched.waits > 100


def test_check_catches_pages_taken_from_a_running_request():
    sched = WalkScheduler(meta_pool(), seed=0)
    s = sched.live[0]
    sched.pool.release(sched.table, s)  # the request still runs, its pages gone
    assert any(f"slot {s} holds 0 pages" in b for b in sched.check())


def test_check_catches_an_edited_row():
    sched = WalkScheduler(meta_pool(), seed=0)
    s = sched.live[0]
    sched.table.page_ids[s, 0] = (int(sched.table.page_ids[s, 0]) + 1) % sched.pool.layout.num_pages
    assert any(f"slot {s}'s row" in b for b in sched.check())
