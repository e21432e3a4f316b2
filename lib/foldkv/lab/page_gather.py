"""The dequantizing page gather alone (`bf16_pages`: an FP8 folded pool's covered pages through the kernel into a bf16
pool of just those pages) and its torch definition (`bf16_pages_reference`, which the kernel is held to bit for bit
and whose rows the float64 reference of a "gather" prefill reads). The served prefill plans and launches the gather
itself (`kernels.dequant_pages.page_plan`, `convert_pages`)."""

from __future__ import annotations

from typing import Callable, Mapping

from ..fp8 import dequantize_rows_bf16
from ..kernels import resolve
from ..kernels.decode import check_decode_pool
from ..kernels.dequant_pages import NAME, bf16_layout, convert_pages, kernel_params, page_plan
from ..pool import BlockTable, PagedKvPool, check_block_table
from ..validate import FoldKvInputError


def _check(pool: PagedKvPool, table: BlockTable) -> None:
    if not isinstance(pool, PagedKvPool) or not pool.layout.quantized:
        raise FoldKvInputError("the dequantizing page gather reads an FP8 (e4m3) folded pool")
    check_decode_pool(pool, op="the page gather")  # rows and scales as the layout says
    check_block_table(pool.layout, table)


def bf16_pages_reference(pool: PagedKvPool, table: BlockTable) -> tuple[PagedKvPool, BlockTable]:
    """The torch definition of `bf16_pages`, on the pool's device: the same pages and table, each converted page
    `foldkv.fp8.dequantize_rows_bf16(data[page], scales[page])`."""
    _check(pool, table)
    src, compact = page_plan(pool.layout, table)
    src = src.to(pool.device).long()
    out = dequantize_rows_bf16(pool.data[src], pool.scales[src])
    return PagedKvPool(bf16_layout(pool, int(src.numel())), data=out), compact.to(pool.device)


def bf16_pages(pool: PagedKvPool, table: BlockTable, *, backend: str = "jit",
               kernels: Mapping[str, Callable] | None = None) -> tuple[PagedKvPool, BlockTable]:
    """The pages of an FP8 folded pool that `table`'s requests cover, converted by the kernel into a new bf16 folded
    pool [N, 4, page, 640] of just those pages (N = sum of ceil(seq_len / page)), with a block table onto it (int32,
    on the pool's device, seq_lens as given). pool: FP8 folded, with its scales, on CUDA; table: BlockTable, any
    device. The kernel comes from `resolve.kernel` with the pool's page size ("jit" or "aot"), or from
    `kernels={"dequant_pages_folded_fp8": callable}`. Bad input raises FoldKvInputError before anything is launched;
    the FP8 pool is only read."""
    resolve.check_backend(backend)
    resolve.check_kernels((NAME,), kernels)
    _check(pool, table)
    if pool.device.type != "cuda":
        raise FoldKvInputError(f"the page gather runs on CUDA; the pool is on {pool.device}")
    (kernel,) = resolve.launch_kernels((NAME,), pool.geometry, {NAME: kernel_params(pool)}, backend, kernels)
    src, compact = page_plan(pool.layout, table)
    return convert_pages(pool, src.to(pool.device), kernel), compact.to(pool.device)
