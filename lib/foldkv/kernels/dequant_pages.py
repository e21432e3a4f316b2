"""The dequantizing page gather: an FP8 folded pool's pages, as a batch's requests cover them, rounded to bf16 rows
(`foldkv.fp8.dequantize_rows_bf16`) in a scratch pool the bf16 prefill reads (prefill.py says why). `page_plan` plans
on the host, `convert_pages` launches (the gather alone and its torch definition: `foldkv.lab.page_gather`).

Kernel arguments, in order (the AOT loader relies on it): Pool [P, 4, page, 640] float8_e4m3, PoolScales [P, 4, page]
float32, SrcPages [N] int32, Out [N, 4, page, 640] bf16 (written). Grid (N, 4 KV heads): block (n, h) writes Out[n, h]
from page SrcPages[n] of KV head h.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from typing import Callable

import numpy as np
import torch

from ..config import GEMMA4_31B, AttentionGeometry
from ..layout import KvFormat
from ..pool import BlockTable, PagedKvLayout, PagedKvPool
from . import registry, resolve
from .tl import compile_program, require_tilelang

NAME = "dequant_pages_folded_fp8"
DEFAULTS = dict(registry.get(NAME).params)


@registry.hands_out("dequant_pages_{fmt}_fp8")
def build(geom: AttentionGeometry = GEMMA4_31B, fmt: KvFormat | str = KvFormat.FOLDED, *, page_size: int = 64,
          threads: int = 128):
    """Compile (JIT) the gather for an FP8 folded pool of `page_size`-token pages."""
    fmt = KvFormat.parse(fmt)
    if fmt is not KvFormat.FOLDED:
        raise NotImplementedError(f"an FP8 pool holds folded rows only (foldkv.fp8); asked for {fmt.value}")
    require_tilelang()
    import tilelang.language as T

    HKV, W = geom.num_kv_heads, geom.head_dim + geom.rotary_width
    f32 = "float32"
    NP, N = T.dynamic("NP, N")

    @T.prim_func
    def main(
        Pool: T.Tensor([NP, HKV, page_size, W], "float8_e4m3"),
        PoolScales: T.Tensor([NP, HKV, page_size], f32),
        SrcPages: T.Tensor([N], "int32"),
        Out: T.Tensor([N, HKV, page_size, W], "bfloat16"),
    ):
        with T.Kernel(N, HKV, threads=threads) as (bn, bh):
            # the launcher checked the page ids; the clamp (never taken) gives TileLang a page index it can bound,
            # and then it vectorizes (8-byte loads, 16-byte stores; without it, one byte per load)
            src = T.max(T.min(SrcPages[bn], NP - 1), 0)
            for t, c in T.Parallel(page_size, W):  # e4m3 -> float32 is exact; one rounded product, then bf16
                Out[bn, bh, t, c] = T.cast(T.cast(Pool[src, bh, t, c], f32) * PoolScales[src, bh, t], "bfloat16")

    return compile_program(main)


def page_plan(layout: PagedKvLayout, table: BlockTable) -> tuple[torch.Tensor, BlockTable]:
    """(src [N] int32: the pool page of each page to convert, request r's first ceil(seq_len / page) in order, a
    shared page converted once per request; the block table onto the converted pages, 0 in its padding), both on the
    CPU, for a checked table. Host work only (tens of microseconds): the prefill plans all before its first launch."""
    ids = table.page_ids.cpu().numpy()
    seq_lens = table.seq_lens.cpu().to(torch.int32)
    n = (seq_lens.numpy().astype(np.int64) + layout.page_size - 1) // layout.page_size  # [B] pages each request covers
    batch, max_pages = ids.shape
    req = np.repeat(np.arange(batch), n)  # [N] the request of each converted page
    col = np.arange(req.size) - (np.cumsum(n) - n)[req]  # [N] the page's column in its request's row
    compact = np.zeros((batch, max_pages), dtype=np.int32)
    compact[req, col] = np.arange(req.size, dtype=np.int32)
    return (torch.from_numpy(np.ascontiguousarray(ids[req, col], dtype=np.int32)),
            BlockTable(torch.from_numpy(compact), seq_lens.clone()))


def bf16_layout(pool: PagedKvPool, num_pages: int) -> PagedKvLayout:
    """The layout of the gather's output: `num_pages` bf16 folded pages of `pool`'s geometry and page size."""
    return PagedKvLayout(pool.geometry, KvFormat.FOLDED, pool.layout.page_size, num_pages, torch.bfloat16)


def kernel_params(pool: PagedKvPool) -> dict:
    """The gather's params for `pool` (the registered ones, the pool's page size)."""
    return resolve.kernel_params(NAME, {"page_size": pool.layout.page_size})


def convert_pages(pool: PagedKvPool, src: torch.Tensor, kernel: Callable) -> PagedKvPool:
    """One launch of `kernel` (the gather): the bf16 folded pool of pages `src` (from `page_plan`, on the pool's
    device) of `pool`, both checked by the caller; no host synchronisation."""
    lay = bf16_layout(pool, int(src.numel()))
    out = torch.empty(lay.shape, dtype=torch.bfloat16, device=pool.device)
    kernel(pool.data, pool.scales, src, out)
    return PagedKvPool(lay, data=out)
