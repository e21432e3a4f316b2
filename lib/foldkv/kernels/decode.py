"""The paged split-KV decode launcher: its checks, and one step's launches (the fused kernel of a one-wave plan, else
the partial, merge_groups and merge_final; kernels/DECODE_SCHEDULE.md), each kernel from `resolve`.

    plan = plan_decode(pool.layout, seq_lens, device=pool.device)       # host, once per step shape
    out, lse = decode(pool, query, table, plan=plan)                     # [B, 32, 512] bf16 head order, [B, 32] f32
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from ..layout import KvFormat
from ..fp8 import FP8_DTYPE
from ..pool import BlockTable, PagedKvPool, check_block_table, check_pool_storage
from ..validate import FoldKvInputError, check_tensor
from . import resolve
from .plan import MAX_BATCH, MAX_LEN, DecodePlan, device_sms, plan_decode


FP8_MATH = ("exact", "tensor_cores")  # how an FP8 pool's partial multiplies (`parse_fp8_math`)
DEFAULT_FP8_MATH = "tensor_cores"  # an FP8 pool's default partial (a bf16 pool's: "exact", `parse_fp8_math`)


def parse_fp8_math(fp8_math: str | None, quantized: bool) -> str:
    """`fp8_math` checked at the public boundary: None -> DEFAULT_FP8_MATH over an FP8 pool (`quantized`), "exact"
    over a bf16 one; refused when not in FP8_MATH, or "tensor_cores" on a bf16 pool."""
    if fp8_math is None:
        return DEFAULT_FP8_MATH if quantized else "exact"
    if not isinstance(fp8_math, str) or fp8_math not in FP8_MATH:
        raise FoldKvInputError(f"fp8_math={fp8_math!r}: expected one of {FP8_MATH} (\"exact\": e4m3 rows converted"
                               " exactly to bf16, bf16 MMA; \"tensor_cores\": FP8 MMA, query and P in two e4m3 parts)")
    if fp8_math == "tensor_cores" and not quantized:
        raise FoldKvInputError("fp8_math=\"tensor_cores\" needs an FP8 pool; this pool stores bf16 rows")
    return fp8_math


def partial_kernel_name(fmt: KvFormat | str, quantized: bool = False, fp8_math: str | None = None) -> str:
    """The partial kernel of `fmt` pages; over an FP8 pool (`quantized`) the one `fp8_math` picks."""
    tc = quantized and (fp8_math or DEFAULT_FP8_MATH) == "tensor_cores"
    return f"decode_partial_{KvFormat.parse(fmt).value}" + ("_fp8" if quantized else "") + ("_tc" if tc else "")


def kernel_names(fmt: KvFormat | str, quantized: bool = False, fused: bool = False,
                 fp8_math: str | None = None) -> tuple[str, ...]:
    """The kernels a decode step launches, in order; `fused`: the one kernel of a one-wave plan."""
    if fused:
        return (f"decode_fused_{KvFormat.parse(fmt).value}",)
    return (partial_kernel_name(fmt, quantized, fp8_math), "merge_groups", "merge_final")


def replaceable_kernels(fmt: KvFormat | str, quantized: bool = False, fp8_math: str | None = None) -> tuple[str, ...]:
    """Every kernel name a decode over `fmt` pages may launch (what `kernels=` may replace)."""
    fused = () if quantized else kernel_names(fmt, fused=True)
    return kernel_names(fmt, quantized, fp8_math=fp8_math) + fused


def partial_wave(layout, device, fp8_math: str | None = None) -> int:
    """CTAs of the decode partial that run at once on `device` (SMs x its `ctas_per_sm`): the wave the plan balances."""
    name = partial_kernel_name(layout.format, layout.quantized, fp8_math)
    return device_sms(device) * int(resolve.kernel_params(name).get("ctas_per_sm", 1))


def use_fused(plan_fused: bool, fmt: KvFormat | str, quantized: bool, fused: bool | None,
              kernels: Mapping[str, Callable] | None) -> bool:
    """Whether a step launches the fused kernel: `fused` None (auto) when the plan is one wave and `kernels=` replaces
    none of the three launches (an experiment's partial runs in the step it was written for); True asks for it
    (refused off a one-wave plan of bf16 rows). FP8 rows take three launches: the fused tail is written for one CTA
    an SM of bf16 rows, and its one-wave test counts SMs, not the tensor-core partial's 2 x SMs slots."""
    plan_fused = plan_fused and not quantized
    if fused is None:
        return plan_fused and not set(kernels or ()) & set(kernel_names(fmt, quantized))
    if fused and not plan_fused:
        raise FoldKvInputError("fused=True needs a one-wave plan of bf16 rows (plan.fused): every CTA of the step"
                               " resident at once")
    return bool(fused)


def pool_operands(pool: PagedKvPool) -> tuple[torch.Tensor, ...]:
    """What the partial kernel reads of the pool: its rows, and an FP8 pool's scales after them."""
    return (pool.data, pool.scales) if pool.layout.quantized else (pool.data,)


def check_decode_pool(pool: PagedKvPool, op: str = "decode", kv_dtype: torch.dtype | None = None) -> None:
    """Refuse a pool the `op` kernels cannot read: not a PagedKvPool, not storing `kv_dtype` (when given) or bf16 or
    e4m3, or whose tensors are not what its layout says."""
    if not isinstance(pool, PagedKvPool):
        raise FoldKvInputError(f"pool must be a PagedKvPool, got {type(pool).__name__}")
    if kv_dtype is not None and kv_dtype != pool.layout.dtype:
        raise FoldKvInputError(f"a {kv_dtype} {op} was asked of a pool that stores {pool.layout.dtype}")
    if pool.layout.dtype not in (torch.bfloat16, FP8_DTYPE):
        raise FoldKvInputError(f"the {op} kernels read bf16 or FP8 (e4m3) pools; this one stores {pool.layout.dtype}")
    check_pool_storage(pool)


def check_query_out_lse(query: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None, rows: int, geom,
                        device: torch.device) -> None:
    """Refuse a query or given out / lse not contiguous on `device`, bf16 [rows, Hq, D] (lse: float32 [rows, Hq])."""
    shape = (rows, geom.num_q_heads, geom.head_dim)
    check_tensor("query", query, dtype=torch.bfloat16, device=device, shape=shape, contiguous=True)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, device=device, shape=shape, contiguous=True)
    if lse is not None:
        check_tensor("lse", lse, dtype=torch.float32, device=device, shape=shape[:2], contiguous=True)


def _check_inputs(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, plan: DecodePlan | None,
                  out: torch.Tensor | None, lse: torch.Tensor | None, kv_format, kv_dtype, read_table: bool,
                  backend: str, kernels, fused: bool | None = None, fp8_math: str | None = None) -> str:
    """Every refusal, before anything is built, launched or written; returns `fp8_math` parsed."""
    check_decode_pool(pool, kv_dtype=kv_dtype)
    resolve.check_backend(backend)
    lay, geom, dev = pool.layout, pool.geometry, pool.device
    fp8_math = parse_fp8_math(fp8_math, lay.quantized)
    resolve.check_kernels(replaceable_kernels(pool.format, lay.quantized, fp8_math), kernels)
    if kv_format is not None and KvFormat.parse(kv_format) is not pool.format:
        raise FoldKvInputError(f"a {KvFormat.parse(kv_format).value} decode was asked of a {pool.format.value} pool")
    partial = partial_kernel_name(pool.format, lay.quantized, fp8_math)
    kernel_page = resolve.kernel_params(partial)["page_size"]
    if lay.page_size != kernel_page:  # the partial indexes pages with the page size baked into it
        raise FoldKvInputError(f"the pool's pages hold {lay.page_size} tokens; {partial} is built for pages of"
                               f" {kernel_page}")
    if not isinstance(table, BlockTable):
        raise FoldKvInputError(f"table must be a BlockTable, got {type(table).__name__}")
    batch = table.batch
    if not 1 <= batch <= MAX_BATCH:
        raise FoldKvInputError(f"batch of {batch} requests: decode takes 1 to {MAX_BATCH}")
    check_tensor("page_ids", table.page_ids, dtype=torch.int32, device=dev, contiguous=True)
    check_tensor("seq_lens", table.seq_lens, dtype=torch.int32, device=dev, contiguous=True)
    check_query_out_lse(query, out, lse, batch, geom, dev)
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise FoldKvInputError(f"plan must be a DecodePlan from plan_decode, got {type(plan).__name__}")
        if plan.layout.format is not pool.format or plan.layout.page_size != lay.page_size \
                or plan.layout.geometry != geom:
            raise FoldKvInputError(f"plan was made for {plan.layout.format.value} pages of {plan.layout.page_size},"
                                   f" the pool holds {pool.format.value} pages of {lay.page_size}")
        if plan.batch != batch:
            raise FoldKvInputError(f"plan covers {plan.batch} requests, the block table {batch}")
        if plan.device != dev and not (plan.device.type == dev.type and plan.device.index in (None, dev.index)):
            raise FoldKvInputError(f"plan tensors are on {plan.device}, the pool on {dev}")
        use_fused(plan.fused, pool.format, lay.quantized, fused, kernels)  # refuses fused=True off one wave
    if read_table:  # reads page ids and lengths back to the host: skipped inside a graph capture (check=False)
        check_block_table(lay, table, max_batch=MAX_BATCH, max_len=MAX_LEN, device=dev)
        if plan is not None and tuple(int(n) for n in table.seq_lens.cpu().tolist()) != plan.seq_lens:
            raise FoldKvInputError("plan was made for other sequence lengths than the block table's")
    if dev.type != "cuda":  # last, so that the checks above can be exercised on a CPU-only machine
        raise FoldKvInputError(f"pool is on {dev}; decode runs on a CUDA device")
    return fp8_math


def decode(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, *, plan: DecodePlan | None = None,
           out: torch.Tensor | None = None, lse: torch.Tensor | None = None, backend: str = "jit",
           kv_format: KvFormat | str | None = None, kv_dtype: torch.dtype | None = None, check: bool = True,
           kernels: Mapping[str, Callable] | None = None,
           fused: bool | None = None, fp8_math: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query per request against the paged pool (DEVELOPERS.md's contracts); returns (out,
    lse), written into `out` / `lse` when given. 1 to plan.MAX_BATCH requests of 1 to plan.MAX_LEN tokens. plan: from
    plan_decode for these lengths (made here when None). `check=False` skips only the checks that read device memory,
    for a CUDA-graph capture of a step checked outside it. kernels: {name of `replaceable_kernels`: callable}.
    fused: None (auto), True or False (`use_fused`)."""
    fp8_math = _check_inputs(pool, query, table, plan, out, lse, kv_format, kv_dtype, read_table=check,
                             backend=backend, kernels=kernels, fused=fused, fp8_math=fp8_math)
    geom = pool.geometry
    if plan is None:
        if not check:
            raise FoldKvInputError("check=False needs a plan (making one reads the lengths on the host)")
        plan = plan_decode(pool.layout, table.seq_lens, device=pool.device,
                           num_sms=partial_wave(pool.layout, pool.device, fp8_math))
    if out is None:
        out = torch.empty(table.batch, geom.num_q_heads, geom.head_dim, dtype=torch.bfloat16, device=pool.device)
    if lse is None:
        lse = torch.empty(table.batch, geom.num_q_heads, dtype=torch.float32, device=pool.device)
    launch_step(pool, query, table.page_ids, plan, out, lse, fused=fused, backend=backend, kernels=kernels,
                fp8_math=fp8_math)
    return out, lse


def launch_step(pool: PagedKvPool, query: torch.Tensor, page_ids: torch.Tensor, plan, out: torch.Tensor,
                lse: torch.Tensor, *, fused: bool | None, backend: str, kernels: Mapping[str, Callable] | None,
                fp8_math: str | None = None) -> None:
    """Launch one decode step on checked inputs, fused or not (`use_fused`). `plan`: a DecodePlan or DecodeWorkspace
    (tensors under the kernels' argument names; a workspace's scratch slot past num_chunks is level one's)."""
    geom, c = pool.geometry, plan.num_chunks
    if use_fused(plan.fused, pool.format, pool.layout.quantized, fused, kernels):
        (step,) = resolve.launch_kernels(kernel_names(pool.format, fused=True), geom, backend=backend, kernels=kernels)
        step(query, pool.data, page_ids, plan.chunk_req, plan.chunk_start, plan.chunk_len, plan.merge_first,
             plan.merge_count, plan.part_o[:c], plan.part_lse[:c], plan.tail_counters, plan.value_head_column, out,
             lse)
        return
    partial, merge_groups, merge_final = resolve.launch_kernels(
        kernel_names(pool.format, pool.layout.quantized, fp8_math=fp8_math), geom, backend=backend, kernels=kernels)
    partial(query, *pool_operands(pool), page_ids, plan.chunk_req, plan.chunk_start, plan.chunk_len,
            plan.part_o[:c], plan.part_lse[:c])
    merge_groups(plan.part_o, plan.part_lse, plan.group_first, plan.group_count)
    merge_final(plan.part_o, plan.part_lse, plan.group_first, plan.req_group_first, plan.req_group_count,
                plan.value_head_column, out, lse)


__all__ = ["DecodePlan", "plan_decode", "decode", "launch_step", "kernel_names", "replaceable_kernels", "use_fused",
           "partial_kernel_name", "pool_operands", "parse_fp8_math", "partial_wave", "FP8_MATH", "DEFAULT_FP8_MATH",
           "check_decode_pool", "check_query_out_lse"]
