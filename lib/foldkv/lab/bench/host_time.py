"""Host time of updating a decode step for new lengths: foldkv's workspace (`DecodeWorkspace.plan`, a full host plan
copied asynchronously, and `advance`, every length one longer on the device) against FlashInfer's decode `plan()`
for the same batch, each the median of many calls timed with the host clock (the device is not waited for: what is
measured is the CPU time a serving loop spends per step before it can replay its graph)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.layout import KvFormat
from foldkv.pool import PagedKvLayout

from ..arms import ArmUnavailable
from .case import ragged_lengths


def _median_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    fn()  # first call: imports, kernel builds
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
        if device.type == "cuda" and len(samples) % 32 == 0:
            torch.cuda.synchronize(device)  # keep the queue short: time the host, not a full launch queue
    return statistics.median(samples)


def _flashinfer_plan(lens: list[int], page: int, geom: AttentionGeometry, device: torch.device) -> Callable:
    from .peers import FLASHINFER_WORKSPACE_BYTES, import_flashinfer

    flashinfer = import_flashinfer()
    pages = [-(-n // page) for n in lens]
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages), 0)
    indices = torch.arange(int(indptr[-1]), dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
    ws = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    dev = [t.to(device) for t in (indptr, indices, last)]
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=dev[0].clone(),
        paged_kv_indices_buffer=dev[1].clone(), paged_kv_last_page_len_buffer=dev[2].clone())
    # host index arrays, as a serving loop that keeps its block tables on the host passes them
    return lambda: wrapper.plan(indptr, indices, last, geom.num_q_heads, geom.num_kv_heads, geom.head_dim, page,
                                q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=1.0)


def plan_host_times(batches: list[int], *, device: torch.device | str, mean_len: int = 24_000, calls: int = 300,
                    seed: int = 0, geom: AttentionGeometry = GEMMA4_31B, page: int = 64) -> list[dict]:
    """One row per batch size (ragged lengths of mean `mean_len`): median host microseconds of the workspace's
    `plan` and `advance` and of FlashInfer's `plan()` (None with the reason when FlashInfer or CUDA is missing)."""
    from foldkv.kernels.workspace import DecodeWorkspace

    device = torch.device(device)
    rows = []
    for b in batches:
        lens = ragged_lengths(b, mean_len, seed=seed)
        lay = PagedKvLayout(geom, KvFormat.FOLDED, page, 0)
        ws = DecodeWorkspace(lay, max_batch=b, max_len=max(lens) + calls + 2, device=device)
        row = {"batch": b, "tokens": sum(lens), "chunks": ws.num_chunks,
               "ws_plan_us": _median_us(lambda: ws.plan(lens), calls, device)}
        row["ws_advance_us"] = _median_us(ws.advance, calls, device)
        try:
            if device.type != "cuda":
                raise ArmUnavailable("FlashInfer needs a CUDA device")
            row["fi_plan_us"] = _median_us(_flashinfer_plan(lens, page, geom, device), calls, device)
        except ArmUnavailable as exc:
            row["fi_plan_us"], row["fi_why"] = None, str(exc)
        rows.append(row)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return rows


def host_time_markdown(rows: list[dict]) -> str:
    lines = ["| batch | tokens | chunks | workspace plan() us | workspace advance() us | FlashInfer plan() us |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        fi = f"{r['fi_plan_us']:.1f}" if r.get("fi_plan_us") is not None else f"not run: {r.get('fi_why', '')}"
        lines.append(f"| {r['batch']} | {r['tokens']:,} | {r['chunks']} | {r['ws_plan_us']:.1f} |"
                     f" {r['ws_advance_us']:.1f} | {fi} |")
    return "\n".join(lines)
