"""The paged causal prefill launcher: its checks, the tile plan and the launch. An FP8 pool is read as `fp8_rows`
says: "gather", the default, since the prefill is compute-bound and "in_kernel" converts each key block once per
query tile that reads it, on the warpgroups that run the gemms."""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from ..layout import KvFormat
from ..pool import BlockTable, PagedKvPool, check_block_table
from ..validate import FoldKvInputError, check_tensor
from . import dequant_pages, resolve
from .decode import check_decode_pool, check_query_out_lse, pool_operands

TOKENS_PER_TILE = 8  # query tokens per CTA: 8 tokens x 8 heads of one KV group = 64 MMA rows


def variant_name(fmt: KvFormat | str, quantized: bool = False) -> str:
    """The prefill kernel of `fmt` pages; `quantized`: the one that converts an FP8 pool's rows itself (folded only)."""
    return f"prefill_{KvFormat.parse(fmt).value}" + ("_fp8" if quantized else "")


FP8_ROWS = ("gather", "in_kernel")  # how a prefill reads an FP8 pool


def launch_names(pool: PagedKvPool, fp8_rows: str = "gather") -> tuple[str, ...]:
    """The kernels `prefill` launches for `pool`, in order."""
    if fp8_rows not in FP8_ROWS:
        raise FoldKvInputError(f"fp8_rows must be one of {FP8_ROWS}, got {fp8_rows!r}")
    if not pool.layout.quantized:
        return (variant_name(pool.format),)
    if fp8_rows == "in_kernel":
        return (variant_name(pool.format, quantized=True),)
    return (dequant_pages.NAME, variant_name(pool.format))


def kernel_params(pool: PagedKvPool, params: dict | None = None, fp8_rows: str = "gather") -> dict[str, dict]:
    """{name: params} of the kernels `prefill` launches for `pool`: the prefill's registered ones overridden by
    `params`, the page size always the pool's; the gather's own."""
    names = launch_names(pool, fp8_rows)
    name = names[-1]
    p = resolve.kernel_params(name, {**(params or {}), "page_size": pool.layout.page_size})
    return {n: p if n == name else dequant_pages.kernel_params(pool) for n in names}


def resolve_kernels(pool: PagedKvPool, *, backend: str = "jit", params: dict | None = None, fp8_rows: str = "gather",
                    kernels: Mapping[str, Callable] | None = None) -> tuple[Callable, ...]:
    """The kernels `prefill` launches for `pool`, resolved now (seconds on first use: a FoldKvCache calls it at
    creation, so its first prompt does not pay for it)."""
    per_kernel = kernel_params(pool, params, fp8_rows)
    return resolve.launch_kernels(tuple(per_kernel), pool.geometry, per_kernel, backend, kernels)


def tile_plan(q_lens: torch.Tensor,
              tokens_per_tile: int = TOKENS_PER_TILE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_start [B], tile_req [NT], tile_tok [NT]) int32 on the CPU: request r's queries start at row q_start[r] of
    the query; tile t covers tokens tile_tok[t] .. +tokens_per_tile of request tile_req[t]."""
    q_lens = q_lens.to("cpu", torch.int64)
    q_start = torch.cumsum(q_lens, 0) - q_lens  # [B]
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile  # [B]
    tile_req = torch.repeat_interleave(torch.arange(q_lens.numel()), tiles)  # [NT]
    first = torch.cumsum(tiles, 0) - tiles  # [B] first tile of each request
    tile_tok = (torch.arange(int(tiles.sum())) - first[tile_req]) * tokens_per_tile  # [NT]
    return q_start.int(), tile_req.int(), tile_tok.int()


def _check(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, q_lens: torch.Tensor, out, lse,
           params) -> tuple[int, BlockTable]:
    """The refusals after the pool's and the kernels' (the device last, so the CPU tests reach the rest). Returns the
    query rows and the table on the host."""
    if pool.layout.page_size % params["block_N"]:
        raise FoldKvInputError(f"page_size {pool.layout.page_size} is not a multiple of the kernel's key tile of"
                               f" {params['block_N']}")
    table = check_block_table(pool.layout, table)  # on the host: a device table read back once, here
    check_tensor("q_lens", q_lens, dtype=(torch.int32, torch.int64), shape=(table.batch,))
    ql = q_lens.cpu()
    if bool((ql < 1).any()) or bool((ql > table.seq_lens).any()):
        r = int(torch.nonzero((ql < 1) | (ql > table.seq_lens))[0])
        raise FoldKvInputError(f"q_lens[{r}] = {int(ql[r])} must be in 1..seq_len = {int(table.seq_lens[r])}"
                               " (queries are the request's last positions)")
    total = int(ql.sum())
    check_query_out_lse(query, out, lse, total, pool.geometry, pool.device)
    if pool.device.type != "cuda":
        raise FoldKvInputError(f"prefill runs on CUDA; the pool is on {pool.device}")
    return total, table


def prefill(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, q_lens: torch.Tensor, *,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None, backend: str = "jit",
            params: dict | None = None, kernels: Mapping[str, Callable] | None = None,
            kv_dtype: torch.dtype | None = None, fp8_rows: str = "gather") -> tuple[torch.Tensor, torch.Tensor]:
    """Causal paged prefill for a ragged batch (DEVELOPERS.md's contracts): request r's q_lens[r] queries (1 to
    seq_lens[r]; [B] int32/int64, any device) are its last positions, their rows of `query` ([sum(q_lens), Hq, D])
    request by request. Returns (out, lse), written into `out` / `lse` when given. `params` overrides the prefill's
    tuning constants; kernels: {name of `launch_names(pool, fp8_rows)`: callable}."""
    resolve.check_backend(backend)
    check_decode_pool(pool, op="prefill", kv_dtype=kv_dtype)  # rows and an FP8 pool's scales as its layout says
    names = launch_names(pool, fp8_rows)
    resolve.check_kernels(names, kernels)
    p = kernel_params(pool, params, fp8_rows)[names[-1]]
    total, table = _check(pool, query, table, q_lens, out, lse, p)  # the table now on the host
    geom, dev = pool.geometry, pool.device
    *gather, kernel = resolve_kernels(pool, backend=backend, params=params, fp8_rows=fp8_rows, kernels=kernels)
    # All planned on the host before the first launch, one asynchronous copy: a copy from pageable memory waits for
    # the stream, so one between the gather and the prefill would leave the GPU idle for the host work after it.
    if gather:  # its covered pages as bf16 rows, once each (checked above: nothing refuses now)
        src, table = dequant_pages.page_plan(pool.layout, table)
    q_start, tile_req, tile_tok = tile_plan(q_lens)
    page_ids, seq_lens, q_start, q_lens, tile_req, tile_tok, *gather_src = upload(
        dev, table.page_ids, table.seq_lens, q_start, q_lens, tile_req, tile_tok, *([src] if gather else []))
    if out is None:
        out = torch.empty((total, geom.num_q_heads, geom.head_dim), dtype=torch.bfloat16, device=dev)
    if lse is None:
        lse = torch.empty((total, geom.num_q_heads), dtype=torch.float32, device=dev)
    operands = (dequant_pages.convert_pages(pool, gather_src[0], gather[0]).data,) if gather else pool_operands(pool)
    kernel(query, *operands, page_ids, seq_lens, q_start, q_lens, tile_req, tile_tok, out, lse)
    return out, lse


UPLOAD_ALIGN = 16  # bytes, as a tensor of its own (Triton specialises a kernel on 16-byte aligned pointers)


def upload_starts(sizes: list[int], itemsize: int) -> list[int]:
    """Where arrays of `sizes` elements start in `upload`'s buffer, at multiples of UPLOAD_ALIGN bytes (elements;
    the last entry its length)."""
    step = max(1, UPLOAD_ALIGN // itemsize)
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += -(-n // step) * step
    return starts + [at]


def upload(device: torch.device, *arrays: torch.Tensor, dtype: torch.dtype = torch.int32) -> list[torch.Tensor]:
    """Integer tensors as `dtype` views of one buffer on `device`, each 16-byte aligned, through one pinned host
    buffer and one asynchronous copy (no wait for the stream); off CUDA, plain copies."""
    if torch.device(device).type != "cuda":
        return [a.to(device, dtype) for a in arrays]
    flat = [a.reshape(-1).to("cpu", dtype) for a in arrays]
    starts = upload_starts([a.numel() for a in flat], dtype.itemsize)
    host = torch.zeros(starts[-1], dtype=dtype, pin_memory=True)
    for a, at in zip(flat, starts):
        host[at:at + a.numel()] = a
    on_device = host.to(device, non_blocking=True)
    return [on_device[at:at + a.numel()].view(a.shape) for a, at in zip(arrays, starts)]
