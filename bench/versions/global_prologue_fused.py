"""A global layer's step before its decode as two PDL kernels: the norms and RoPE inside the query and row kernels.

What it tries (MODEL_DECODE_NOTES "Run 23: prediction"; written before any GPU run): inside the 31B's step each of the
10 global (k_eq_v) layers runs transformers' attention forward, which between the merged q|k GEMM and the workspace's
decode launches seven small kernels: q_norm, RoPE of q, k_norm, RoPE of k, v_norm (fused_step's `rms_norm` and
`rope`, PDL links), then `foldkv.global_step`'s `global_query_rows` and `global_row_store` (plain launches: full
boundaries). Here a forward swapped in for those layers (like fused_step's `_sliding_forward` for the sliding ones)
launches two:
- `global_query_fused` (grid B x Hq): q_norm and RoPE of the query row read in place from the GEMM's output, then the
  format's query (the score window's columns, the unrotated ones times w_k: fold_query's one rounding) written
  straight into the workspace's query;
- `global_row_fused` (grid B x Hkv): k_norm and RoPE of the key columns the row keeps and v_norm of the value columns
  (k_eq_v: the value is the key projection before its norm), the row stored at the step's page and offset.
Both are PDL links (`_chain`): they wait for the GEMM before their first load. The per-element formulas and rounding
points are rms_norm's, rope's and global_step's (the row's norm is reduced over the row loaded in its natural order,
as rms_norm_rows loads it; the output columns are then read again gathered by the library's `_roped_at`, which
`_norm_rope` calls too), so the query and the row are bitwise the seven kernels' (tests/test_triton_interpret_cpu.py
on the CPU, tests/test_global_prologue_fused_gpu.py on the H200). The layer's o_proj goes through fused_step's tail
projection (its split partials summed by the layer's norm, as a sliding layer's are), so the global layers' 10
`split_sum` links go too.

Prediction (per global layer, 10 a step): 7 launches -> 2, and the two that stay become PDL links. Five small-kernel
links at ~0.4-1 us (run 20: ~0.4 us a link between small kernels; these norms are one-row programs, 32 + 4 + 4 at batch
1), two full boundaries made PDL links (~1 us each: run 12's ~1.4 us against ~0.4), and the o_proj's split_sum link
(~0.4 us, run 20): ~4-8 us a layer, **-0.04 to -0.08 ms a step**, the same at every context (launches, not bytes).
With run 22 (-0.03 to -0.08), s25's record (7a22d9f) would move 4K x 1 1.155x -> ~1.14-1.15x, 32K x 1 1.151x ->
~1.14x, 4K x 8 1.160x -> ~1.15-1.155x. What proves it wrong: the probe's "fused global prologue" cell not below the
library's by >= 0.03 ms at 4K x 1 (the small links cost less than counted: they overlapped the GEMM's tail); the
route taking fewer than the 10 global layers a step; any output not bitwise (a bug, or a reduction order that is not
rms_norm_rows' on the GPU: then the row's norm is one ulp off somewhere and the test says where).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_global_prologue_fused_gpu.py`;
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --global-prologue-ab` (label "fused global prologue"; the calls it took and the refusals are printed).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Iterator
from unittest import mock

import torch
from torch import nn

from foldkv import fused_step, fused_step_ops, global_step
from foldkv.fused_step_kernels import triton
from foldkv.layout import KvFormat

if triton is not None:
    import triton.language as tl

    from foldkv.fused_step_kernels import _chain, _inverse_rms, _roped_at, _rounded

    @triton.jit
    def _inverse_norm(base, n, eps, D: tl.constexpr):
        """The inverse RMS of the head row at base, reduced over the row loaded in its natural order (rms_norm_rows'
        reduction)."""
        return _inverse_rms(tl.load(base + tl.arange(0, D)).to(tl.float32), n, eps)

    @triton.jit
    def global_query_fused(q_ptr, w_ptr, cos_ptr, sin_ptr, wk_ptr, cols_ptr, out_ptr, heads, q_stride, n, eps,
                           D: tl.constexpr, FOLD_FROM: tl.constexpr, FOLDED: tl.constexpr,
                           GDC: tl.constexpr = False):
        """Row (b, h): the format's query of RoPE(q_norm(q)) (q at b * q_stride + h * D) into out [rows, D] packed:
        column j is head column cols[j]; FOLDED, columns j >= FOLD_FROM times w_k, rounded once to out's dtype."""
        _chain(GDC)
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        base = q_ptr + b * q_stride + (row % heads) * D
        inv = _inverse_norm(base, n, eps, D)
        j = tl.arange(0, D)
        c = tl.load(cols_ptr + j).to(tl.int64)
        x = _roped_at(base, w_ptr, cos_ptr + b * D, sin_ptr + b * D, c, inv, cos_ptr.dtype.element_ty, D)
        if FOLDED:
            x = tl.where(j >= FOLD_FROM, x * tl.load(wk_ptr + c).to(tl.float32), x)
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_ptr + row * D + j, _rounded(x, out_ty).to(out_ty))

    @triton.jit
    def global_row_fused(k_ptr, v_ptr, w_ptr, cos_ptr, sin_ptr, cols_ptr, pages_ptr, offsets_ptr, pool_ptr, heads,
                         page_size, k_stride, v_stride, n, eps_k, eps_v, D: tl.constexpr, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr, KEY_COLS: tl.constexpr, GDC: tl.constexpr = False):
        """Row (b, h): column j < KEY_COLS is RoPE(k_norm(k))[cols[j]], the others v_norm(v)[cols[j]] (no weight), each
        rounded to the model's dtype (cos's), stored at pool[pages[b], h, offsets[b], j]; nothing else is written."""
        _chain(GDC)
        model_ty = cos_ptr.dtype.element_ty
        row = tl.program_id(0).to(tl.int64)
        b = row // heads
        h = row % heads
        k_base = k_ptr + b * k_stride + h * D
        v_base = v_ptr + b * v_stride + h * D
        inv_k = _inverse_norm(k_base, n, eps_k, D)
        inv_v = _inverse_norm(v_base, n, eps_v, D)
        j = tl.arange(0, BLOCK)
        keep = j < WIDTH
        c = tl.load(cols_ptr + j, mask=keep, other=0).to(tl.int64)
        key = _roped_at(k_base, w_ptr, cos_ptr + b * D, sin_ptr + b * D, c, inv_k, model_ty, D)
        value = _rounded(tl.load(v_base + c).to(tl.float32) * inv_v, model_ty)
        x = tl.where(j < KEY_COLS, key, value)
        page = tl.load(pages_ptr + b).to(tl.int64)
        offset = tl.load(offsets_ptr + b).to(tl.int64)
        out_ty = pool_ptr.dtype.element_ty
        tl.store(pool_ptr + ((page * heads + h) * page_size + offset) * WIDTH + j, x.to(out_ty), mask=keep)


def query_fused(geom: Any, fmt: KvFormat | str, q: torch.Tensor, attn: nn.Module, cos: torch.Tensor,
                sin: torch.Tensor, out: torch.Tensor, score_cols: torch.Tensor | None = None) -> None:
    """q [B, 1, Hq * D] (the q projection's output or the q columns of a merged one, read in place) -> the format's
    query of RoPE(q_norm(q)) in out[:B] (out [>= B, Hq, D] packed): bitwise rms_norm, rope, then
    `global_step.query_into`. score_cols: another column map (the tests' red twin)."""
    fmt = KvFormat.parse(fmt)
    hq, d = geom.num_q_heads, geom.head_dim
    b = q.shape[0]
    stride = fused_step_ops._head_rows(q, hq, d, "q")
    cos = fused_step_ops._rope_table(cos, b, d, q.dtype, "cos")
    sin = fused_step_ops._rope_table(sin, b, d, q.dtype, "sin")
    score, _, fold_from, _ = global_step.column_maps(geom, fmt, q.device)
    score = score if score_cols is None else score_cols
    global_query_fused[(b * hq,)](q, attn.q_norm.weight, cos, sin, attn.k_norm.weight, score, out, hq, stride, d,
                                  fused_step_ops.norm_eps(attn.q_norm), D=d, FOLD_FROM=fold_from,
                                  FOLDED=fmt is KvFormat.FOLDED, num_warps=fused_step_ops._warps(d),
                                  **fused_step_ops._pdl(q))


def row_fused(geom: Any, pool: Any, k: torch.Tensor, v: torch.Tensor, attn: nn.Module, cos: torch.Tensor,
              sin: torch.Tensor, pages: torch.Tensor, offsets: torch.Tensor) -> None:
    """k, v [B, 1, Hkv * D] (the key projection's output, and the value's: the same tensor for k_eq_v) -> one row
    per (b, h) at pool.data[pages[b], h, offsets[b]]: bitwise rms_norm / rope of the key, rms_norm of the value, then
    `global_step.row_into_pool`."""
    hkv, d = geom.num_kv_heads, geom.head_dim
    b = k.shape[0]
    ks, vs = fused_step_ops._head_rows(k, hkv, d, "k"), fused_step_ops._head_rows(v, hkv, d, "v")
    cos = fused_step_ops._rope_table(cos, b, d, k.dtype, "cos")
    sin = fused_step_ops._rope_table(sin, b, d, k.dtype, "sin")
    _, row, _, key_cols = global_step.column_maps(geom, pool.format, k.device)
    width = pool.layout.row_width
    global_row_fused[(b * hkv,)](k, v, attn.k_norm.weight, cos, sin, row, pages, offsets, pool.data, hkv,
                                 pool.layout.page_size, ks, vs, d, fused_step_ops.norm_eps(attn.k_norm),
                                 fused_step_ops.norm_eps(attn.v_norm), D=d, WIDTH=width,
                                 BLOCK=fused_step_ops._block(width), KEY_COLS=key_cols,
                                 num_warps=fused_step_ops._warps(d), **fused_step_ops._pdl(k))


def global_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Global Gemma4TextAttention modules the forward describes: not sliding, own K/V (not shared, not stored for
    later layers), q/k/o projections (v_proj, when there is one), q_norm and k_norm with weights, v_norm without."""
    def norm(m, name, scaled):
        n = getattr(m, name, None)
        return type(n).__name__ == "Gemma4RMSNorm" and getattr(n, "with_scale", None) is scaled

    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"
            and getattr(m, "is_sliding", True) is False and not getattr(m, "is_kv_shared_layer", False)
            and not getattr(m, "store_full_length_kv", False)
            and all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "o_proj"))
            and norm(m, "q_norm", True) and norm(m, "k_norm", True) and norm(m, "v_norm", False)]


def route(attn: nn.Module, kwargs: dict) -> tuple | str:
    """(step, layer) when this call is a decode step of the cache's started DecodeStep whose global layer the two
    kernels describe (`global_step.global_route`, asked on the projections' shapes), else why not."""
    from foldkv.hf_graph import DecodeStep

    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    step = getattr(cache, "decode_step", None)
    if not (isinstance(step, DecodeStep) and step.started):
        return "not a started decode step"
    layer = cache.layers[attn.layer_idx]
    x, pe = kwargs.get("hidden_states"), kwargs.get("position_embeddings")
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == 1 and isinstance(pe, (tuple, list))):
        return "not one token per sequence with (cos, sin)"
    geom = getattr(layer, "geometry", None)
    if geom is None:
        return "not a foldkv global layer"
    b, d = x.shape[0], geom.head_dim
    q = x.new_empty(b, geom.num_q_heads, 1, d)  # shapes and dtypes for the route; nothing is read from them
    kv = x.new_empty(b, geom.num_kv_heads, 1, d)
    why = global_step.global_route(step, layer, attn, q, kv, kv)
    return why if why is not None else (step, layer)


_CALLS: collections.Counter = collections.Counter()


def _forward(attn: nn.Module, *args, **kwargs):
    """Gemma4TextAttention.forward of a global layer inside DecodeStep's step (`route`) as its projections, the two
    kernels, the workspace's decode and o_proj (fused_step's tail projection); every other call is the class's."""
    why = "positional arguments" if args else route(attn, kwargs)
    if isinstance(why, str):
        _CALLS[why] += 1
        return type(attn).forward(attn, *args, **kwargs)
    _CALLS["kernels"] += 1
    step, layer = why
    x = kwargs["hidden_states"]
    cos, sin = kwargs["position_embeddings"]
    b = x.shape[0]
    q = attn.q_proj(x)
    k = attn.k_proj(x)
    v = attn.v_proj(x) if attn.v_proj is not None else k  # attention_k_eq_v: the value is the key before its norm
    layer.check_module(attn)
    query_fused(layer.geometry, layer.pool.format, q, attn, cos, sin, step.ws.query)
    row_fused(layer.geometry, layer.pool, k, v, attn, cos, sin, step.store_pages, step.store_offsets)
    out = step._workspace_decode(layer, b).to(x.dtype).reshape(b, 1, -1)
    return fused_step._tail_projection(attn, attn.o_proj, out), None


@contextlib.contextmanager
def installed() -> Iterator[collections.Counter]:
    """fused_step with the global layers' forward swapped for `_forward` too, for the block
    (bench/model_decode_probe.py --global-prologue-ab); yields the calls' count by route answer ("kernels" or why)."""
    if triton is None:
        raise RuntimeError("global_prologue_fused needs Triton")
    served = fused_step.fused_step
    _CALLS.clear()

    @contextlib.contextmanager
    def with_globals(model):
        with served(model) as counts:
            mods = global_attention_modules(model)
            for m in mods:
                m.forward = functools.partial(_forward, m)
            try:
                yield dict(counts, global_attention=len(mods))
            finally:
                for m in mods:
                    del m.forward

    with mock.patch.object(fused_step, "fused_step", with_globals):
        yield _CALLS


__all__ = ["query_fused", "row_fused", "global_attention_modules", "route", "installed"]
