"""The page allocator: no page lost, none held by two requests, whatever sequence of allocate / grow / release a caller
makes; every misuse (a second release, another pool's table, a copy, edited page ids) refused with the pool unchanged.
The property test draws thousands of operations (hypothesis, derandomized); each invariant check has a red twin: the
old release (pages of the current seq_lens only, no record of what was given) run through the same checker."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

import foldkv as fk
from foldkv.pool import Allocation, PageHolder

PAGE = 16
NUM_PAGES = 48  # the property test's pool


def small_pool(num_pages: int = 8, page_size: int = 64) -> fk.PagedKvPool:
    """An allocator only: its tensor on the meta device (no memory)."""
    return fk.PagedKvPool(fk.PagedKvLayout(page_size=page_size, num_pages=num_pages), device="meta")


def state(pool: fk.PagedKvPool, *tables: fk.BlockTable) -> tuple:
    """Everything a refusal must leave as it was: the free list in order, every holder, and the tables' tensors."""
    return (list(pool._free), pool.ownership(), pool.held_tables(),
            [(t.page_ids.clone(), t.seq_lens.clone()) for t in tables])


def same_state(a: tuple, b: tuple) -> bool:
    return a[:3] == b[:3] and all(torch.equal(x, y) and torch.equal(u, v) for (x, u), (y, v) in zip(a[3], b[3]))


def violations(pool: fk.PagedKvPool, held: dict[Allocation, list[list[int]]],
               tables: dict[Allocation, fk.BlockTable]) -> list[str]:
    """What is wrong with the pool against the model `held` (allocation -> pages per request, as the caller was
    given them): a page on the free list twice, free and held at once, neither, held by another request than the
    model says, or a table's page ids other than its pages."""
    bad = []
    free = pool._free
    if len(set(free)) != len(free):
        bad.append(f"a page is on the free list twice: {sorted(free)}")
    want = {p: PageHolder(a, r) for a, rows in held.items() for r, pages in enumerate(rows) for p in pages}
    if sum(len(p) for rows in held.values() for p in rows) != len(want):
        bad.append("the model holds one page twice")
    if set(free) & set(want):
        bad.append(f"pages both free and held: {sorted(set(free) & set(want))}")
    if set(free) | set(want) != set(range(pool.layout.num_pages)):
        bad.append(f"pages neither free nor held: {sorted(set(range(pool.layout.num_pages)) - set(free) - set(want))}")
    if pool.ownership() != want:
        bad.append("the pool's ownership map differs from what the requests were given")
    if pool.free_pages != pool.layout.num_pages - len(want):
        bad.append(f"free_pages says {pool.free_pages}, {pool.layout.num_pages - len(want)} are free")
    for a, rows in held.items():
        t = tables[a]
        for r, pages in enumerate(rows):
            if t.page_ids[r, :len(pages)].tolist() != pages:
                bad.append(f"table {a} request {r}: page ids {t.page_ids[r].tolist()}, holds {pages}")
    return bad


# --- the misuses of a pool, each refused or served exactly ---------------------------------------------------------
def test_release_returns_the_capacity_not_the_current_length():
    """Red twin of the old leak: seq_lens zeroed before release freed none of the table's pages."""
    pool = small_pool()
    t = pool.allocate([100, 100])
    t.seq_lens.zero_()
    assert sorted(pool.release(t)) == [0, 1, 2, 3] and pool.free_pages == 8


def test_release_of_a_table_allocated_past_its_lengths_returns_every_page():
    pool = small_pool()
    t = pool.allocate([256, 256])  # room for 256 tokens each ...
    t.seq_lens.copy_(torch.tensor([3, 70], dtype=torch.int32))  # ... 3 and 70 written so far
    pool.release(t)
    assert pool.free_pages == 8 and pool.ownership() == {}


def test_second_release_is_refused_and_changes_nothing():
    """Red twin of the old double release, which put each page on the free list twice (two later requests then
    shared pages)."""
    pool = small_pool()
    t = pool.allocate([100, 100])
    pool.release(t)
    before = state(pool, t)
    with pytest.raises(fk.FoldKvInputError, match="released already"):
        pool.release(t)
    assert same_state(before, state(pool, t))
    a, b = pool.allocate([256]), pool.allocate([256])
    assert not set(a.page_ids[0].tolist()) & set(b.page_ids[0].tolist())


@pytest.mark.parametrize("how", ["another pool", "by hand", "a .to() copy", "edited page id", "swapped rows",
                                 "wrong rows"])
def test_foreign_or_edited_tables_are_refused_and_change_nothing(how):
    pool, other = small_pool(), small_pool()
    t = pool.allocate([100, 30], pad_pages=1)
    mine = t
    if how == "another pool":
        t = other.allocate([100])
    elif how == "by hand":
        t = fk.BlockTable(t.page_ids.clone(), t.seq_lens.clone())
    elif how == "a .to() copy":
        t = t.to("cpu")
    elif how == "edited page id":
        t.page_ids[0, 1] = 7
    elif how == "swapped rows":
        t.page_ids[[0, 1], 0] = t.page_ids[[1, 0], 0]
    else:
        t = fk.BlockTable(t.page_ids[:1], t.seq_lens[:1], t.allocation)
    expect = {"another pool": "another pool", "by hand": "not made by", "a .to() copy": "not made by",
              "edited page id": "were changed", "swapped rows": "were changed", "wrong rows": "rows"}[how]
    before = state(pool, mine), state(other)
    for call in (lambda: pool.release(t), lambda: pool.release(t, 0), lambda: pool.grow(t, 0, 300)):
        with pytest.raises(fk.FoldKvInputError, match=expect):
            call()
        assert same_state(before[0], state(pool, mine)) and same_state(before[1], state(other))


def test_padding_columns_may_hold_poison():
    """Columns past a request's pages are never read (a gate writes poison there): release still accepts."""
    pool = small_pool()
    t = pool.allocate([10, 100], pad_pages=2)
    t.page_ids[0, 1:] = -(2**31)
    assert sorted(pool.release(t)) == [0, 1, 2] and pool.free_pages == 8


def test_slots_grow_page_by_page_and_free_one_at_a_time():
    pool = small_pool(num_pages=6, page_size=PAGE)
    t = pool.empty_table(3, max_pages=4)
    assert t.page_ids.eq(-1).all() and t.seq_lens.eq(0).all() and pool.free_pages == 6
    assert pool.grow(t, 0, 1) == [0] and pool.grow(t, 0, PAGE) == [] and pool.grow(t, 0, PAGE + 1) == [1]
    assert pool.grow(t, 2, 3 * PAGE) == [2, 3, 4]
    assert pool.holder_of(3) == PageHolder(t.allocation, 2) and pool.holder_of(5) is None
    before = state(pool, t)
    with pytest.raises(fk.FoldKvInputError, match="its block-table row holds 4"):
        pool.grow(t, 0, 5 * PAGE)
    with pytest.raises(fk.FoldKvInputError, match="2 pages needed"):
        pool.grow(t, 1, 2 * PAGE)
    with pytest.raises(fk.FoldKvInputError, match="outside the table"):
        pool.grow(t, 3, 1)
    assert same_state(before, state(pool, t))
    assert pool.release(t, 2) == [2, 3, 4] and t.page_ids[2].eq(-1).all() and pool.pages_held(t, 2) == []
    assert pool.grow(t, 2, 1) == [2]  # the emptied slot takes the next request
    assert pool.release(t, 2) == [2] and pool.release(t, 2) == []  # an empty slot frees nothing, and twice is harmless
    assert sorted(pool.release(t)) == [0, 1] and pool.free_pages == 6 and pool.held_tables() == []


def test_allocate_draws_pages_as_before():
    """The pages allocate hands out are the ones it always did (the gates' records depend on them): in order without
    a seed; the seeded scatter a permutation of the free list."""
    pool = small_pool(num_pages=20, page_size=PAGE)
    t = pool.allocate([1, 16, 17, 54], pad_pages=2, pad_value=-7)
    assert t.page_ids.tolist() == [[0, -7, -7, -7, -7, -7], [1, -7, -7, -7, -7, -7], [2, 3, -7, -7, -7, -7],
                                   [4, 5, 6, 7, -7, -7]]
    s = small_pool(num_pages=20, page_size=PAGE).allocate([54], scatter_seed=5)
    free = list(range(19, -1, -1))
    order = torch.randperm(20, generator=torch.Generator().manual_seed(5)).tolist()
    free = [free[i] for i in order]
    assert s.page_ids[0].tolist() == [free.pop() for _ in range(4)]


def test_hf_cache_use_still_works():
    """foldkv.hf allocates every slot at capacity and zeroes the lengths (it never releases)."""
    pool = small_pool()
    t = pool.allocate([128] * 4, scatter_seed=1)
    t.seq_lens.zero_()
    assert pool.free_pages == 0 and len(set(t.page_ids.flatten().tolist())) == 8


# --- the checker's red twins: the old release, through the same invariant check --------------------------------
def old_release(pool: fk.PagedKvPool, table: fk.BlockTable) -> None:
    """The release this module replaced: each request's pages as its current seq_len covers them, no record."""
    for r in range(table.batch):
        pool._free.extend(int(p) for p in table.pages_of(r, pool.layout.page_size))


@pytest.mark.parametrize("misuse", ["zeroed seq_lens", "double release"])
def test_checker_catches_the_old_release(misuse):
    pool = small_pool()
    t = pool.allocate([100, 100])
    if misuse == "zeroed seq_lens":
        t.seq_lens.zero_()
        old_release(pool, t)
    else:
        old_release(pool, t)
        old_release(pool, t)
    assert violations(pool, {}, {}), "the invariant check must fail on the old release"


def test_checker_passes_the_same_use_of_this_release():
    pool = small_pool()
    t = pool.allocate([100, 100])
    held = {t.allocation: [pool.pages_held(t, 0), pool.pages_held(t, 1)]}
    assert violations(pool, held, {t.allocation: t}) == []
    t.seq_lens.zero_()
    pool.release(t)
    assert violations(pool, {}, {}) == []


# --- the property test ---------------------------------------------------------------------------------------------
class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / empty_table / grow / release (whole or one request) and refused misuses on a pool of NUM_PAGES
    pages of PAGE tokens; after every step the pool must agree with the model of who was given what."""

    tables = Bundle("tables")

    def __init__(self):
        super().__init__()
        self.pool = small_pool(num_pages=NUM_PAGES, page_size=PAGE)
        self.held: dict[Allocation, list[list[int]]] = {}
        self.live: dict[Allocation, fk.BlockTable] = {}
        self.released: list[fk.BlockTable] = []

    def _refused(self, call, *tables) -> None:
        before = state(self.pool, *tables)
        with pytest.raises(fk.FoldKvInputError):
            call()
        assert same_state(before, state(self.pool, *tables)), "a refusal changed the pool"

    @rule(target=tables, lens=st.lists(st.integers(1, 3 * PAGE), min_size=1, max_size=4),
          pad=st.integers(0, 3), scatter=st.one_of(st.none(), st.integers(0, 1000)))
    def allocate(self, lens, pad, scatter):
        need = sum(-(-n // PAGE) for n in lens)
        if need > self.pool.free_pages:
            self._refused(lambda: self.pool.allocate(lens, pad_pages=pad, scatter_seed=scatter))
            return None  # no table: the rules that draw it skip None
        t = self.pool.allocate(lens, pad_pages=pad, scatter_seed=scatter)
        self.held[t.allocation] = [t.page_ids[r, :-(-n // PAGE)].tolist() for r, n in enumerate(lens)]
        self.live[t.allocation] = t
        return t

    @rule(target=tables, batch=st.integers(1, 4), width=st.integers(1, 8))
    def empty_table(self, batch, width):
        t = self.pool.empty_table(batch, width)
        self.held[t.allocation] = [[] for _ in range(batch)]
        self.live[t.allocation] = t
        return t

    @rule(t=tables, request=st.integers(0, 3), extra=st.integers(-PAGE, 2 * PAGE), far=st.booleans())
    def grow(self, t, request, extra, far):
        self._grow(t, request, extra, far)

    @rule(t=tables, request=st.integers(0, 3), extra=st.integers(1, PAGE))
    def grow_by_a_page(self, t, request, extra):
        self._grow(t, request, extra, False)

    def _grow(self, t, request, extra, far):
        """A request lengthens: about a page past what it holds (page by page), or `far` past its row."""
        if t is None or t.allocation not in self.live:
            return
        rows = self.held[t.allocation]
        held = len(rows[request]) if request < len(rows) else 0
        tokens = max(0, (held + (8 if far else 0)) * PAGE + extra)
        if request >= len(rows):
            self._refused(lambda: self.pool.grow(t, request, tokens), t)
            return
        need = -(-tokens // PAGE) - len(rows[request])
        if need > 0 and (len(rows[request]) + need > t.page_ids.shape[1] or need > self.pool.free_pages):
            self._refused(lambda: self.pool.grow(t, request, tokens), t)
            return
        new = self.pool.grow(t, request, tokens)
        assert len(new) == max(need, 0)
        rows[request] += new

    @rule(t=tables, request=st.integers(0, 3), zero_lens=st.booleans())
    def release_request(self, t, request, zero_lens):
        if t is None or t.allocation not in self.live or request >= t.batch:
            return
        if zero_lens:
            t.seq_lens[request] = 0
        freed = self.pool.release(t, request)
        assert freed == self.held[t.allocation][request]
        self.held[t.allocation][request] = []

    @rule(t=consumes(tables), zero_lens=st.booleans())
    def release(self, t, zero_lens):
        if t is None or t.allocation not in self.live:
            return
        if zero_lens:
            t.seq_lens.zero_()
        freed = self.pool.release(t)
        assert sorted(freed) == sorted(p for row in self.held.pop(t.allocation) for p in row)
        del self.live[t.allocation]
        self.released.append(t)

    @precondition(lambda self: self.released)
    @rule(i=st.integers(0, 100))
    def release_again(self, i):
        t = self.released[i % len(self.released)]
        self._refused(lambda: self.pool.release(t), *self.live.values())

    @rule(t=tables, request=st.integers(0, 3), delta=st.integers(1, NUM_PAGES - 1))  # another page
    def release_edited(self, t, request, delta):
        if t is None or t.allocation not in self.live or request >= t.batch:
            return
        pages = self.held[t.allocation][request]
        if not pages:
            return
        old = int(t.page_ids[request, len(pages) - 1])
        t.page_ids[request, len(pages) - 1] = (old + delta) % self.pool.layout.num_pages
        self._refused(lambda: self.pool.release(t), *self.live.values())
        self._refused(lambda: self.pool.grow(t, request, 100 * PAGE), *self.live.values())
        t.page_ids[request, len(pages) - 1] = old

    @invariant()
    def every_page_free_or_held_once(self):
        assert violations(self.pool, self.held, self.live) == []

    def teardown(self):
        for t in list(self.live.values()):
            self.pool.release(t)
        assert self.pool.free_pages == self.pool.layout.num_pages and self.pool.ownership() == {}


AllocatorMachine.TestCase.settings = settings(max_examples=250, stateful_step_count=40, derandomize=True,
                                              deadline=None, database=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_allocator_property = AllocatorMachine.TestCase
