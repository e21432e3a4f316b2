"""The paged causal prefill launcher: checks, the tile plan, and the call of the kernel for the pool format.

`prefill(pool, query, table, q_lens)` runs request r's q_lens[r] queries (its last positions, bottom-right causal)
against its pages and returns (out [sum(q_lens), 32, 512] bf16 head order, lse [sum(q_lens), 32] float32 natural
log). The kernel ("prefill_split" or "prefill_folded"; argument order documented in prefill_attention.py) comes from
`foldkv.kernels.resolve.kernel(name, geometry, params, backend)` with the pool's page size among its params ("jit":
built here with TileLang; "aot": from the active AOT build, refused unless built with these params), or from
`kernels={name: callable}` (an experiment's variant); `prefill` shows its arguments, in order.
An FP8 folded pool is read one of two ways (`fp8_rows`):
  "gather" (default): the dequantizing page gather first (`dequant_pages.bf16_pages`: the pages the requests cover,
      each converted once into bf16 rows, `foldkv.fp8.dequantize_rows_bf16`), then "prefill_folded" over those rows.
      Prefill is compute-bound, so this runs at the bf16 prefill's rate plus one pass over the pages; it needs a
      scratch pool for the call, 1,280 bytes per token and KV head of the requests' pages.
  "in_kernel": "prefill_folded_fp8" converts the e4m3 rows itself (exactly, the scale applied in float32, as the
      decode does) and needs no scratch, but converts every key block once per query tile that reads it, on the
      warpgroups that run the gemms: 1.40-1.42x the bf16 prefill (bench/FP8_NOTES.md).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from ..layout import KvFormat
from ..pool import BlockTable, PagedKvPool, check_block_table
from ..validate import FoldKvInputError, check_tensor
from . import dequant_pages, resolve
from .decode import check_decode_pool, check_pool_dtype, check_query_out_lse, pool_operands

TOKENS_PER_TILE = 8  # query tokens per CTA: 8 tokens x 8 heads of one KV group = 64 MMA rows


def variant_name(fmt: KvFormat | str, quantized: bool = False) -> str:
    """The prefill kernel of `fmt` pages; `quantized`: the one that converts an FP8 pool's rows itself (folded only;
    registered and gated, not what `prefill` launches: see the module docstring)."""
    return f"prefill_{KvFormat.parse(fmt).value}" + ("_fp8" if quantized else "")


FP8_ROWS = ("gather", "in_kernel")  # how a prefill reads an FP8 pool (module docstring)


def launch_names(pool: PagedKvPool, fp8_rows: str = "gather") -> tuple[str, ...]:
    """The kernels `prefill` launches for `pool`, in order: the prefill of its format; for an FP8 pool the page gather
    then the bf16 prefill ("gather"), or the prefill that converts the rows itself ("in_kernel")."""
    if fp8_rows not in FP8_ROWS:
        raise FoldKvInputError(f"fp8_rows must be one of {FP8_ROWS}, got {fp8_rows!r}")
    if not pool.layout.quantized:
        return (variant_name(pool.format),)
    if fp8_rows == "in_kernel":
        return (variant_name(pool.format, quantized=True),)
    return (dequant_pages.NAME, variant_name(pool.format))


def kernel_params(pool: PagedKvPool, params: dict | None = None, fp8_rows: str = "gather") -> dict[str, dict]:
    """{name: the params it is built with} of every kernel `prefill` launches for `pool`, in launch order: the
    prefill's registered params overridden by `params`, the page size always the pool's; the gather's own."""
    names = launch_names(pool, fp8_rows)
    name = names[-1]
    p = resolve.kernel_params(name, {**(params or {}), "page_size": pool.layout.page_size})
    return {n: p if n == name else dequant_pages.kernel_params(pool) for n in names}


def resolve_kernels(pool: PagedKvPool, *, backend: str = "jit", params: dict | None = None, fp8_rows: str = "gather",
                    kernels: Mapping[str, Callable] | None = None) -> tuple[Callable, ...]:
    """The kernels `prefill` launches for `pool`, in launch order, resolved now (built or loaded: TileLang imported
    and each kernel's program elaborated on first use in a process, seconds). `prefill` gets its kernels here; a
    FoldKvCache calls it at creation, so a process's first prompt does not pay for it."""
    per_kernel = kernel_params(pool, params, fp8_rows)
    return resolve.launch_kernels(tuple(per_kernel), pool.geometry, per_kernel, backend, kernels)


# --- plan --------------------------------------------------------------------------------------------------------
def tile_plan(q_lens: torch.Tensor, tokens_per_tile: int = TOKENS_PER_TILE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_start [B], tile_req [NT], tile_tok [NT]) int32 on the CPU: request r's queries start at row q_start[r] of
    the query; tile t covers tokens tile_tok[t] .. +tokens_per_tile of request tile_req[t]."""
    q_lens = q_lens.to("cpu", torch.int64)
    q_start = torch.cumsum(q_lens, 0) - q_lens  # [B]
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile  # [B]
    tile_req = torch.repeat_interleave(torch.arange(q_lens.numel()), tiles)  # [NT]
    first = torch.cumsum(tiles, 0) - tiles  # [B] first tile of each request
    tile_tok = (torch.arange(int(tiles.sum())) - first[tile_req]) * tokens_per_tile  # [NT]
    return q_start.int(), tile_req.int(), tile_tok.int()


def _check(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, q_lens: torch.Tensor, out, lse, params,
           kv_dtype) -> tuple[int, BlockTable]:
    """Everything that can be refused, before any launch; the device comes last so the CPU tests reach the rest.
    Returns the query rows and the table on the host (read back once: the launcher plans from it)."""
    check_pool_dtype(pool, kv_dtype, op="prefill")
    check_decode_pool(pool, op="prefill")  # bf16 or FP8 rows, and an FP8 pool's scales, as its layout says
    if pool.layout.page_size % params["block_N"]:
        raise FoldKvInputError(
            f"page_size {pool.layout.page_size} is not a multiple of the kernel's key tile of {params['block_N']}"
        )
    table = check_block_table(pool.layout, table)  # on the host: a device table read back once, here
    check_tensor("q_lens", q_lens, dtype=(torch.int32, torch.int64), shape=(table.batch,))
    ql = q_lens.cpu()
    if bool((ql < 1).any()) or bool((ql > table.seq_lens).any()):
        r = int(torch.nonzero((ql < 1) | (ql > table.seq_lens))[0])
        raise FoldKvInputError(
            f"q_lens[{r}] = {int(ql[r])} must be in 1..seq_len = {int(table.seq_lens[r])} (queries are the request's"
            " last positions)"
        )
    total = int(ql.sum())
    check_query_out_lse(query, out, lse, total, pool.geometry, pool.device)
    if pool.device.type != "cuda":
        raise FoldKvInputError(f"prefill runs on CUDA; the pool is on {pool.device}")
    return total, table


def prefill(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, q_lens: torch.Tensor, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, backend: str = "jit",
            params: dict | None = None, kernels: Mapping[str, Callable] | None = None,
            kv_dtype: torch.dtype | None = None, fp8_rows: str = "gather") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal paged prefill for a ragged batch: request r's q_lens[r] queries are its last positions.

    pool: bf16 (either format) or FP8 e4m3 with its scales (folded), on a CUDA device (Hopper for the generated
    kernels), page_size a multiple of the kernel's key tile (64); `kv_dtype`, when given, must be the pool's stored
    dtype. fp8_rows: how an FP8 pool is read (module docstring): "gather" (its rows rounded to bf16 once, then the
    bf16 prefill) or "in_kernel" (converted exactly by the attention kernel, slower, no scratch). table: BlockTable,
    int32, any device (copied to the pool's). q_lens: [B] int32/int64, any device, 1 <= q_lens[r] <= seq_lens[r].
    query: [sum(q_lens), Hq, D] bf16, contiguous, on the pool's device, in the pool format's form (what
    prep_and_store returns), request by request. Returns (out [sum(q_lens), Hq, D] bf16 head
    order, lse [sum(q_lens), Hq] float32 natural log) on the pool's device; `out`/`lse` given (same shapes and
    dtypes, contiguous) are written in place. `params` overrides the variant's tuning constants (the benchmark uses
    it; the page size is always the pool's). backend: "jit" or "aot". kernels: {name: callable taking the kernel's
    arguments}, a name of `launch_names(pool, fp8_rows)`, replaces the backend's kernel (an experiment's variant
    built with `params`). Bad input raises FoldKvInputError before anything is built or launched.
    """
    resolve.check_backend(backend)
    if not isinstance(pool, PagedKvPool):
        raise FoldKvInputError(f"pool must be a PagedKvPool, got {type(pool).__name__}")
    names = launch_names(pool, fp8_rows)
    resolve.check_kernels(names, kernels)
    p = kernel_params(pool, params, fp8_rows)[names[-1]]
    total, table = _check(pool, query, table, q_lens, out, lse, p, kv_dtype)  # the table now on the host
    geom, dev = pool.geometry, pool.device
    *gather, kernel = resolve_kernels(pool, backend=backend, params=params, fp8_rows=fp8_rows, kernels=kernels)
    # Everything is planned on the host before the first launch and reaches the device in one asynchronous copy:
    # a copy from pageable memory waits for the stream, so a copy between the gather and the prefill would leave the
    # GPU idle for the host work after it (measured ~0.4 ms a call, bench/FP8_NOTES.md run 4).
    if gather:  # its covered pages as bf16 rows, once each (checked above: nothing refuses now)
        src, table = dequant_pages.page_plan(pool.layout, table)
    q_start, tile_req, tile_tok = tile_plan(q_lens)
    page_ids, seq_lens, q_start, q_lens, tile_req, tile_tok, *gather_src = upload(
        dev, table.page_ids, table.seq_lens, q_start, q_lens, tile_req, tile_tok, *([src] if gather else []))
    if out is None:
        out = torch.empty((total, geom.num_q_heads, geom.head_dim), dtype=torch.bfloat16, device=dev)
    if lse is None:
        lse = torch.empty((total, geom.num_q_heads), dtype=torch.float32, device=dev)
    operands = pool_operands(pool)
    if gather:
        operands = (dequant_pages.convert_pages(pool, gather_src[0], gather[0]).data,)
    kernel(query, *operands, page_ids, seq_lens, q_start, q_lens, tile_req, tile_tok, out, lse)
    return out, lse


def upload(device: torch.device, *arrays: torch.Tensor, dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """Integer tensors (host ones, or device ones copied to the host first) as `dtype` tensors of the same shapes on
    `device`, through one pinned host buffer and one asynchronous copy (no wait for the stream): views of one device
    buffer, in the order given (to a device other than CUDA: plain copies)."""
    if torch.device(device).type != "cuda":
        return [a.to(device, dtype) for a in arrays]
    flat = [a.reshape(-1).to("cpu", dtype) for a in arrays]
    host = torch.empty(sum(a.numel() for a in flat), dtype=dtype, pin_memory=True)
    torch.cat(flat, out=host)
    on_device = host.to(device, non_blocking=True)
    views, at = [], 0
    for a in arrays:
        views.append(on_device[at:at + a.numel()].view(a.shape))
        at += a.numel()
    return views
