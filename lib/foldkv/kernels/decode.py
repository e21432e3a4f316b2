"""Paged split-KV decode for either page format: checks, the plan, and the launches (one fused kernel when the plan
is one wave, else the partial, merge_groups and merge_final), each kernel from the one resolver
(`foldkv.kernels.resolve`).

    plan = plan_decode(pool.layout, seq_lens, device=pool.device)       # host, once per step shape
    out, lse = decode(pool, query, table, plan=plan)                     # [B, 32, 512] bf16 head order, [B, 32] f32

A decode step launches on the current stream (no host synchronisation, so it can be captured in a CUDA graph once
its inputs have been checked; pass `check=False` inside the capture): when the plan is one wave of bf16 rows
(`plan.fused`: every CTA resident at once, e.g. any single request and up to 8 ragged ones on the H200) one kernel,
"decode_fused_<format>" (the partial, whose CTAs then merge their request-head's chunks themselves:
kernels/DECODE_SCHEDULE.md), otherwise the partial ("decode_partial_<format>", over an FP8 pool by `fp8_math`:
`partial_kernel_name`), "merge_groups" and "merge_final". `launch_step` passes each its arguments, in order (shapes
and dtypes in the docstrings of decode_partial.py and merge.py). The kernels come from
`foldkv.kernels.resolve.kernel(name, geometry, backend=backend)` with their registered params ("jit": built here with
TileLang; "aot": from the active AOT build), or from `kernels={name: callable}` for the names given there (an
experiment's partial, say); the pool's page size must be the partial's. FP8 pools take `fp8_math` (`parse_fp8_math`).
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
    """`fp8_math` checked once at the public boundary: None -> DEFAULT_FP8_MATH over an FP8 pool (`quantized`),
    "exact" over a bf16 one (its rows are exact already: a no-op there); a value not in FP8_MATH, or "tensor_cores"
    asked of a bf16 pool, raises FoldKvInputError.
    "tensor_cores" runs both gemms as FP8 MMA with the query and P in two e4m3 parts (decode_partial_fp8_tc.py: ~0.65x
    the bf16 folded decode, held to its own derived bound, foldkv.lab.gates.fp8_tc, whose accumulation term rests on
    FP8 wgmma's accumulation as measured on the H200); "exact" converts each e4m3 row to bf16 exactly and runs bf16
    MMA (decode_partial.py's FP8 partial: slower, held to the bf16 gate's bound)."""
    if fp8_math is None:
        return DEFAULT_FP8_MATH if quantized else "exact"
    if not isinstance(fp8_math, str) or fp8_math not in FP8_MATH:
        raise FoldKvInputError(f"fp8_math={fp8_math!r}: expected one of {FP8_MATH} (\"exact\": e4m3 rows converted"
                               " exactly to bf16, bf16 MMA; \"tensor_cores\": FP8 MMA, query and P in two e4m3 parts)")
    if fp8_math == "tensor_cores" and not quantized:
        raise FoldKvInputError("fp8_math=\"tensor_cores\" needs an FP8 pool; this pool stores bf16 rows")
    return fp8_math


def partial_kernel_name(fmt: KvFormat | str, quantized: bool = False, fp8_math: str | None = None) -> str:
    """The partial kernel of `fmt` pages; `quantized`: over an FP8 pool (folded only), whose `fp8_math` (as
    `parse_fp8_math` returned it at the public boundary; None: the default, the tensor-core one) picks the exact
    partial or the tensor-core one."""
    tc = quantized and (fp8_math or DEFAULT_FP8_MATH) == "tensor_cores"
    return f"decode_partial_{KvFormat.parse(fmt).value}" + ("_fp8" if quantized else "") + ("_tc" if tc else "")


def kernel_names(fmt: KvFormat | str, quantized: bool = False, fused: bool = False,
                 fp8_math: str | None = None) -> tuple[str, ...]:
    """The kernels a decode step over `fmt` pages (FP8 when `quantized`, by `fp8_math`) launches, in launch order;
    `fused`: the step of a one-wave plan (one kernel)."""
    if fused:
        return (f"decode_fused_{KvFormat.parse(fmt).value}",)
    return (partial_kernel_name(fmt, quantized, fp8_math), "merge_groups", "merge_final")


def replaceable_kernels(fmt: KvFormat | str, quantized: bool = False, fp8_math: str | None = None) -> tuple[str, ...]:
    """Every kernel name a decode over `fmt` pages may launch (what `kernels=` may replace)."""
    fused = () if quantized else kernel_names(fmt, fused=True)
    return kernel_names(fmt, quantized, fp8_math=fp8_math) + fused


def partial_wave(layout, device, fp8_math: str | None = None) -> int:
    """CTAs of the decode partial for pools of `layout` (by `fp8_math`) that run at once: the device's SMs
    (plan.DEFAULT_SMS off CUDA) times the CTAs an SM holds, the partial's registered `ctas_per_sm` (1; 2 for the FP8
    tensor-core partial: 264 on the H200). The wave the plan balances (`plan_decode(num_sms=...)`). The fused
    one-launch step never runs over FP8 rows (`use_fused`), so no one-wave fused path needs this count."""
    name = partial_kernel_name(layout.format, layout.quantized, fp8_math)
    return device_sms(device) * int(resolve.kernel_params(name).get("ctas_per_sm", 1))


def use_fused(plan_fused: bool, fmt: KvFormat | str, quantized: bool, fused: bool | None,
              kernels: Mapping[str, Callable] | None) -> bool:
    """Whether a step launches the fused kernel: `fused` None (auto) when the plan is one wave and `kernels=` replaces
    none of the three-launch kernels (an experiment's partial runs in the step it was written for); True asks for it
    (refused unless the plan is one wave of bf16 rows); False: the three launches."""
    # FP8 rows: the three launches (a bf16 plan over an FP8 pool too). The tensor-core FP8 partial (two CTAs an SM,
    # 264 a wave on the H200) has no fused step either: the fused tail is written for one CTA an SM of bf16 rows, and
    # its one-wave test counts SMs, not the 2 x SMs CTA slots that partial fills (`partial_wave`)
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


def check_decode_pool(pool: PagedKvPool, op: str = "decode") -> None:
    """Refuse a pool the `op` kernels (decode, or prefill: they read the same pools) cannot read: stored as anything
    but bf16 or FP8 (e4m3), or whose tensors are not what its layout says (`check_pool_storage`: rows of the
    layout's dtype and shape; an FP8 pool's scales)."""
    if pool.layout.dtype not in (torch.bfloat16, FP8_DTYPE):
        raise FoldKvInputError(f"the {op} kernels read bf16 or FP8 (e4m3) pools; this one stores {pool.layout.dtype}")
    check_pool_storage(pool)


def check_pool_dtype(pool: PagedKvPool, kv_dtype, op: str = "decode") -> None:
    """Refuse a pool whose stored dtype is not `kv_dtype` (when given): an `op` asked for one dtype of the other."""
    if kv_dtype is not None and kv_dtype != pool.layout.dtype:
        raise FoldKvInputError(f"a {kv_dtype} {op} was asked of a pool that stores {pool.layout.dtype}")


def check_query_out_lse(query: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None, rows: int, geom,
                        device: torch.device) -> None:
    """Refuse a query, or a given out / lse, that is not the kernels' (decode's and prefill's): bf16 [rows, Hq, D],
    float32 [rows, Hq] for lse, contiguous, on `device`."""
    shape = (rows, geom.num_q_heads, geom.head_dim)
    check_tensor("query", query, dtype=torch.bfloat16, device=device, shape=shape, contiguous=True)
    if out is not None:
        check_tensor("out", out, dtype=torch.bfloat16, device=device, shape=shape, contiguous=True)
    if lse is not None:
        check_tensor("lse", lse, dtype=torch.float32, device=device, shape=shape[:2], contiguous=True)


def _check_inputs(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, plan: DecodePlan | None,
                  out: torch.Tensor | None, lse: torch.Tensor | None, kv_format, kv_dtype, read_table: bool,
                  backend: str, kernels, fused: bool | None = None, fp8_math: str | None = None) -> str:
    """Every refusal happens here, before any kernel is built or launched and before any write; returns `fp8_math`
    parsed."""
    if not isinstance(pool, PagedKvPool):
        raise FoldKvInputError(f"pool must be a PagedKvPool, got {type(pool).__name__}")
    resolve.check_backend(backend)
    lay, geom, dev = pool.layout, pool.geometry, pool.device
    fp8_math = parse_fp8_math(fp8_math, lay.quantized)
    resolve.check_kernels(replaceable_kernels(pool.format, lay.quantized, fp8_math), kernels)
    if kv_format is not None and KvFormat.parse(kv_format) is not pool.format:
        raise FoldKvInputError(f"a {KvFormat.parse(kv_format).value} decode was asked of a {pool.format.value} pool")
    check_pool_dtype(pool, kv_dtype)
    partial = partial_kernel_name(pool.format, lay.quantized, fp8_math)
    kernel_page = resolve.kernel_params(partial)["page_size"]
    if lay.page_size != kernel_page:  # the partial indexes pages with the page size baked into it
        raise FoldKvInputError(f"the pool's pages hold {lay.page_size} tokens; {partial} is built for pages of"
                               f" {kernel_page}")
    check_decode_pool(pool)
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
            raise FoldKvInputError(
                f"plan was made for {plan.layout.format.value} pages of {plan.layout.page_size}, the pool holds"
                f" {pool.format.value} pages of {lay.page_size}"
            )
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
    """Decode attention of one query per request against the paged pool, in the pool's format.

    pool: bf16 (either format) or FP8 e4m3 with its scales (folded), contiguous, on a CUDA device (Hopper for the
    generated kernels); `kv_dtype`, when given, must be the pool's stored dtype. table: BlockTable whose page_ids
    [B, pages] and seq_lens [B] are int32, contiguous, on the pool's device; 1 <= B <= 256 (plan.MAX_BATCH) requests
    of 1 to 262,144 tokens. query: [B, Hq, D] bf16, contiguous, on the pool's device, in the format's form (what prep_and_store or
    prep_query returns). plan: from plan_decode(pool.layout, seq_lens, device=pool.device) for these lengths (made
    here when None). Returns (out [B, Hq, D] bf16 head order, lse [B, Hq] float32 natural log) on the pool's device,
    written into `out` / `lse` (same shapes and dtypes, contiguous) when given. Bad input raises FoldKvInputError
    before anything is launched. `check=False` skips only the checks that read device memory back to the host
    (page ids in range, lengths within the table, the plan's lengths): for use inside a CUDA-graph capture of a
    step whose inputs were checked once outside it. backend: "jit" or "aot". kernels: {kernel name: callable taking
    that kernel's arguments} replacing the backend's kernel of that name (an experiment's variant; names from
    `replaceable_kernels(pool.format)`). fused: None launches one fused kernel when the plan is one wave
    (`plan.fused`) and `kernels` replaces none of the three-launch kernels, else the three; True / False ask for
    one or the other (True refused for a plan that is not one wave). fp8_math (FP8 pools): `parse_fp8_math`; a plan
    made here balances that partial's wave (`partial_wave`: 2 x SMs for the tensor-core one).
    """
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
    """Launch one decode step on checked inputs (`fp8_math` parsed): the fused kernel or the three, as `use_fused`
    says. `plan` is a DecodePlan or a DecodeWorkspace: both hold the step's device tensors under the kernels' argument
    names, and `num_chunks` (the partial writes slots [0, num_chunks); a workspace's part_o holds a scratch slot past
    them, which level one's empty groups use)."""
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
           "check_pool_dtype", "check_decode_pool", "check_query_out_lse"]
