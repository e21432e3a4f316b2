"""Bad input to the prep and the readers: a clear FoldKvInputError before anything is written, pool unchanged."""

import pytest
import torch

import foldkv as fk

G = fk.GEMMA4_31B
T = 5


def _setup(fmt="folded"):
    pool = fk.PagedKvPool(fk.PagedKvLayout(G, fmt, page_size=16, num_pages=4), fill=float("nan"))
    pool.data.normal_()  # distinct bits everywhere, so any write shows
    table = pool.allocate([40])
    g = torch.Generator().manual_seed(11)
    args = dict(
        request=torch.zeros(T, dtype=torch.long),
        positions=torch.arange(30, 30 + T),
        q=torch.randn(T, 32, 512, generator=g),
        kv=torch.randn(T, 4, 512, generator=g),
        q_norm_weight=torch.randn(512, generator=g),
        k_norm_weight=torch.randn(512, generator=g),
    )
    return pool, table, args


def _bits(t):
    return t.view(torch.int16).clone()


CASES = {
    "q-dtype": (lambda a, t: a.update(q=a["q"].to(torch.int32)), "q has dtype"),
    "kv-device": (lambda a, t: a.update(kv=a["kv"].to("meta")), "kv is on meta"),
    "q-heads": (lambda a, t: a.update(q=a["q"][:, :16]), r"q has shape \[5, 16, 512\]"),
    "kv-heads": (lambda a, t: a.update(kv=torch.randn(T, 8, 512)), r"kv has shape \[5, 8, 512\]"),
    "head-dim": (lambda a, t: a.update(kv=torch.randn(T, 4, 256)), r"kv has shape"),
    "negative-position": (lambda a, t: a["positions"].__setitem__(2, -1), "positions holds -1"),
    "position-past-rope": (lambda a, t: a["positions"].__setitem__(2, 262_144), "positions holds 262144"),
    "position-past-request": (lambda a, t: a["positions"].__setitem__(4, 45), "past its request's length"),
    "page-id-out-of-range": (lambda a, t: t.page_ids.__setitem__((0, 1), 99), "page_ids of the written tokens holds 99"),
    "request-index": (lambda a, t: a["request"].__setitem__(0, 3), r"request index holds 3"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prep_refuses_and_leaves_pool_unchanged(case):
    pool, table, args = _setup()
    mutate, message = CASES[case]
    mutate(args, table)
    before = _bits(pool.data)
    with pytest.raises(fk.FoldKvInputError, match=message):
        fk.prep_and_store(pool, table, **args)
    assert torch.equal(_bits(pool.data), before)


def test_prep_accepts_the_unmutated_case():  # the control: the same setup without a mutation writes rows
    pool, table, args = _setup()
    before = _bits(pool.data)
    fk.prep_and_store(pool, table, **args)
    assert not torch.equal(_bits(pool.data), before)


def _reader_setup(fmt):
    pool = fk.PagedKvPool(fk.PagedKvLayout(G, fmt, page_size=16, num_pages=6), fill=0.25)
    table = pool.allocate([20, 33])
    query = torch.randn(2, 32, 512)
    return pool, table, query


READER_CASES = {
    "other-format": (lambda p, t, q: dict(fmt="split"), "folded pool was handed to a split reader"),
    "page-id-out-of-range": (lambda p, t, q: t.page_ids.__setitem__((1, 2), 6) or {}, r"page_ids .* holds 6"),
    "negative-page-id": (lambda p, t, q: t.page_ids.__setitem__((0, 0), -3) or {}, r"holds -3"),
    "request-longer-than-pages": (lambda p, t, q: t.seq_lens.__setitem__(0, 100) or {}, "holds only 3 pages"),
    "zero-length": (lambda p, t, q: t.seq_lens.__setitem__(0, 0) or {}, "at least one token"),
    "page-ids-dtype": (lambda p, t, q: setattr(t, "page_ids", t.page_ids.long()) or {}, "page_ids has dtype"),
    "query-heads": (lambda p, t, q: dict(query=q[:, :8]), r"query has shape"),
}


@pytest.mark.parametrize("case", list(READER_CASES))
def test_reader_refuses(case):
    pool, table, query = _reader_setup("folded")
    mutate, message = READER_CASES[case]
    kw = mutate(pool, table, query)
    query = kw.pop("query", query)
    before = _bits(pool.data)
    with pytest.raises(fk.FoldKvInputError, match=message):
        fk.paged_attention_reference(pool, query, table, **kw)
    assert torch.equal(_bits(pool.data), before)


def test_padding_past_the_plan_is_never_read():
    pool, table, query = _reader_setup("split")
    table.page_ids[:, 3:] = -(2**31)  # poison past each request's pages
    out, lse = fk.paged_attention_reference(pool, query, table)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
