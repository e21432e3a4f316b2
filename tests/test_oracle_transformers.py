"""Our prep + references against transformers' Gemma4TextAttention (global layer, k_eq_v): the semantic oracle."""

from __future__ import annotations

import pytest
import torch

import foldkv as fk
from foldkv.lab import gates
from conftest import require_module

HIDDEN = 64


def _gemma4_global_attention(seed: int):
    require_module("transformers")
    from transformers.models.gemma4 import modeling_gemma4 as m
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    cfg = Gemma4TextConfig(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=2, head_dim=32,
        global_head_dim=512, num_global_key_value_heads=4, attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"], vocab_size=128, intermediate_size=64,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=128, rms_norm_eps=1e-6,
        max_position_embeddings=262_144,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    att = m.Gemma4TextAttention(cfg, layer_idx=1).eval()
    with torch.no_grad():
        for p in att.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else 0.2) + (1.0 if p.dim() == 1 else 0.0))
    return m, cfg, att


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("positions", [[0, 1, 2, 3, 4, 5, 6], [3, 64, 65, 1000, 10602, 40002, 163335]],
                         ids=["short", "scattered"])
def test_prep_and_references_match_gemma4_attention(seed, positions):
    m, cfg, att = _gemma4_global_attention(seed)
    geom = fk.geometry_from_config(cfg.to_dict())
    assert (geom.num_q_heads, geom.num_kv_heads, geom.head_dim, geom.rotary_width) == (32, 4, 512, 128)
    assert att.num_key_value_groups == 8 and att.v_proj is None

    t = len(positions)
    x = torch.randn(1, t, HIDDEN)
    pos = torch.tensor([positions])
    cos, sin = m.Gemma4TextRotaryEmbedding(cfg)(x, pos, "full_attention")
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # causal in token order (positions ascend)
    captured = {}
    att.o_proj.register_forward_pre_hook(lambda mod, args: captured.setdefault("attn", args[0].detach()))
    with torch.no_grad():
        att(x, (cos, sin), mask, shared_kv_states={})
    theirs = captured["attn"].view(t, 32, 512).double()  # [T, Hq, D] before o_proj

    with torch.no_grad():
        q = att.q_proj(x)[0].view(t, 32, 512)  # raw projections [T, Hq, D]
        kv = att.k_proj(x)[0].view(t, 4, 512)  # [T, Hkv, D]
    qw, kw = att.q_norm.weight.detach(), att.k_norm.weight.detach()
    p1 = pos[0]
    dense = gates.dense_attention_reference(geom, q, kv, qw, kw, p1)
    scale = theirs.abs().max()
    assert (dense - theirs).abs().max() / scale < 2e-5, "dense float64 reference vs transformers (float32)"

    for fmt in fk.KvFormat:
        # Rows prepped at the tokens' real positions, stored at slots 0..T-1 of a small pool: the rows carry their
        # RoPE, so attention over the slots equals attention over the positions transformers saw.
        pool = fk.PagedKvPool(fk.PagedKvLayout(geom, fmt, page_size=4, num_pages=8, dtype=torch.float32),
                              fill=float("nan"))
        table = pool.allocate([t], scatter_seed=seed)
        query, rows = fk.prep_rows_and_query(geom, fmt, q, kv, qw, kw, p1, out_dtype=torch.float32)
        gates.write_tokens(pool, table, torch.zeros(t, dtype=torch.long), torch.arange(t), rows)
        out, _ = fk.paged_attention_reference(pool, query, table, q_lens=torch.tensor([t]))
        err = (out - theirs).abs().max() / scale
        assert err < 2e-5, f"{fmt.value} paged reference vs transformers: {err:.2e}"
