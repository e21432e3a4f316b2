"""Column maps, the fold identity (folded == split == dense), the pool's bytes, allocator and block tables."""

import pytest
import torch

import foldkv as fk
from conftest import folded_row_sources
from foldkv.lab import byte_floor
from foldkv.lab.gates.fold import dense_attention_reference

G = fk.GEMMA4_31B


def test_rotated_columns_are_the_rope_pairs():
    rot = fk.rotated_columns(G)
    assert rot.tolist() == list(range(64)) + list(range(256, 320))
    inv = fk.prep.rope_inv_freq(G)
    assert (inv[:64] > 0).all() and (inv[64:] == 0).all()  # exactly the first 64 pairs rotate
    assert sorted(fk.unrotated_columns(G).tolist() + rot.tolist()) == list(range(512))


def test_folded_row_order_and_windows():
    is_key, head_col = folded_row_sources(G)
    assert head_col.numel() == fk.row_width(G, "folded") == 640
    assert is_key[:128].all() and not is_key[128:].any()
    # score window = K_rot + V_unrot covers every head column once; value window = V_unrot + V_rot likewise
    sw, vw = fk.score_window(G, "folded"), fk.value_window(G, "folded")
    assert (sw.start, sw.stop, vw.start, vw.stop) == (0, 512, 128, 640)
    assert sorted(head_col[sw].tolist()) == list(range(512)) == sorted(head_col[vw].tolist())
    assert torch.equal(head_col[sw], fk.score_window_columns(G, "folded"))
    assert torch.equal(head_col[vw], fk.value_window_columns(G, "folded"))


@pytest.mark.parametrize("fmt", list(fk.KvFormat))
def test_value_permutation_round_trips(fmt):
    x = torch.randn(3, 512)
    window = x[:, fk.value_window_columns(G, fmt)]  # head order -> window order
    assert torch.equal(window[:, fk.value_window_to_head(G, fmt)], x)


def _random_inputs(t, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 32, 512, generator=g, dtype=dtype)
    kv = torch.randn(t, 4, 512, generator=g, dtype=dtype)
    qw = (torch.randn(512, generator=g) * 0.5 + 1).to(dtype)
    kw = (torch.randn(512, generator=g) * 0.5 + 1).to(dtype)
    return q, kv, qw, kw


def _pool_attention(fmt, q, kv, qw, kw, pool_dtype, page_size=16, seed=0):
    from foldkv.lab import gates

    return gates.sequence_pool_attention(G, fmt, q, kv, qw, kw, pool_dtype, page_size=page_size, seed=seed)


def test_fold_identity_float64():
    from foldkv.lab import gates

    rows = gates.fold_identity(seed=0, tokens=(1, 54, 97))
    assert [r["tokens"] for r in rows] == [1, 54, 97]
    for r in rows:
        assert r["passed"] and r["folded_vs_split"] < 1e-12 and r["folded_vs_dense"] < 1e-12, r


def test_fold_within_bf16_tolerance():
    # Scores of std ~3 (q_norm weights ~0.15): the spread a trained model's heads show, not a one-hot softmax where
    # bf16 rounding of a single score decides the output.
    t = 97
    q, kv, qw, kw = _random_inputs(t, seed=7, dtype=torch.float32)
    qw = qw * 0.15
    dense = dense_attention_reference(G, q, kv, qw, kw, torch.arange(t))
    rel = {}
    for fmt in fk.KvFormat:
        out, *_ = _pool_attention(fmt, q, kv, qw, kw, torch.bfloat16)
        rel[fmt] = float((out - dense).norm() / dense.norm())
        assert rel[fmt] < 1e-2, f"{fmt.value}: relative error {rel[fmt]:.2e} with a bf16 pool"
    # folding moves the rounding (w_k into q instead of into K) but must not make it worse than split's
    assert rel[fk.KvFormat.FOLDED] < 2 * rel[fk.KvFormat.SPLIT] + 1e-4, rel


def rows_to_head_order(rows: torch.Tensor, geom, fmt) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) [..., D] each, in head order, from page rows [..., row_width] (split: views of the rows). A folded row
    cannot give K's unrotated columns without w_k: they come back NaN (K there is V * w_k)."""
    fmt = fk.KvFormat.parse(fmt)
    d = geom.head_dim
    if fmt is fk.KvFormat.SPLIT:
        return rows[..., :d], rows[..., d:]
    v = rows[..., fk.value_window(geom, fmt)][..., fk.value_window_to_head(geom, fmt).to(rows.device)]
    k = torch.full_like(v, float("nan"))
    k[..., fk.rotated_columns(geom).to(rows.device)] = rows[..., : geom.rotary_width]
    return k, v


def test_folded_rows_hold_v_and_rotated_k():
    t = 33
    q, kv, qw, kw = _random_inputs(t, seed=3)
    _, _, split_pool, st = _pool_attention("split", q, kv, qw, kw, torch.float64)
    _, _, fold_pool, ft = _pool_attention("folded", q, kv, qw, kw, torch.float64)
    k_s, v_s = rows_to_head_order(split_pool.gather(st, 0), G, "split")
    k_f, v_f = rows_to_head_order(fold_pool.gather(ft, 0), G, "folded")
    assert torch.equal(v_s, v_f)
    rot, unrot = fk.rotated_columns(G), fk.unrotated_columns(G)
    assert torch.allclose(k_s[..., rot], k_f[..., rot], rtol=0, atol=1e-14)
    assert torch.isnan(k_f[..., unrot]).all()
    # outside the rotated columns K is exactly V * w_k
    assert torch.allclose(k_s[..., unrot], v_s[..., unrot] * kw[unrot], rtol=0, atol=1e-14)


@pytest.mark.parametrize("fmt, row, per_token", [("split", 1024, 8192), ("folded", 640, 5120)])
def test_layout_bytes(fmt, row, per_token):
    lay = fk.PagedKvLayout.for_tokens(163336, format=fmt)
    assert lay.row_width == row and lay.bytes_per_token == per_token
    assert lay.num_pages == 2553 and lay.shape == (2553, 4, 64, row)
    assert lay.nbytes == 2553 * 64 * per_token


def test_allocator_and_block_tables():
    pool = fk.PagedKvPool(fk.PagedKvLayout(G, "folded", page_size=16, num_pages=20), fill=0.5)
    table = pool.allocate([1, 16, 17, 54], scatter_seed=5, pad_pages=2, pad_value=-7)
    assert table.page_ids.dtype == torch.int32 and table.page_ids.shape == (4, 4 + 2)
    used = [table.pages_of(r, 16).tolist() for r in range(4)]
    assert [len(u) for u in used] == [1, 1, 2, 4]
    flat = sum(used, [])
    assert len(set(flat)) == len(flat) and all(0 <= p < 20 for p in flat)
    assert (table.page_ids[:, 4:] == -7).all()  # padding past the plan
    assert pool.free_pages == 12
    with pytest.raises(fk.FoldKvInputError, match="pages needed"):
        pool.allocate([16 * 13])
    pool.release(table)
    assert pool.free_pages == 20
    rep = pool.report()
    assert rep["row_width"] == 640 and rep["pool_bytes"] == 20 * 16 * 5120


def test_floor_numbers():
    rows = byte_floor.floor_table(G, [163336], bandwidth_gbps=4469)
    split, folded = rows
    assert split["pool_bytes_per_layer"] == 163336 * 8192
    assert folded["pool_bytes_per_layer"] == 163336 * 5120
    assert folded["folded_over_split"] == pytest.approx(0.625, abs=1e-4)
    assert folded["floor_us_per_layer"] == pytest.approx(187.1, abs=0.1)
    assert split["floor_us_per_layer"] == pytest.approx(299.4, abs=0.1)
    assert byte_floor.tokens_in_budget(G, "folded", 1.0) == (1 << 30) // (64 * 5120 * 10) * 64


def test_the_moved_byte_floor_says_where_it_went():
    with pytest.raises(AttributeError, match="foldkv.lab.byte_floor"):
        fk.floor
    with pytest.raises(AttributeError, match="has no attribute"):  # red twin: a name that never was says nothing more
        fk.no_such_module
