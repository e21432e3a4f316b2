"""Peer arms for the benchmarks: what a user would pick instead of foldkv (FlashInfer's paged decode and prefill on a
split pool in FlashInfer's own layout, and a plain torch gather + matmul decode), each built as one callable per input
copy that the harness in `foldkv.bench` times.

FlashInfer is optional: it is imported only inside the builders, and a missing or failing import raises
`ArmUnavailable`, which the harness records as "not run: <reason>".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .layout import KvFormat, score_window, value_window, value_window_to_head
from .pool import BlockTable, PagedKvPool

# FlashInfer's recommended workspace is 128 MB; hd512 split-k partials for 32 heads x many chunks need more.
FLASHINFER_WORKSPACE_BYTES = 512 * 1024 * 1024


class ArmUnavailable(RuntimeError):
    """An arm cannot run on this machine (a missing package or device); the message is the reason recorded."""


@dataclass
class ArmImpl:
    """A built arm: `calls[c]()` runs one step on input copy c and writes `out` (head order, [tokens, Hq, D]).

    `graph` says whether the harness should try to capture the calls in a CUDA graph (it still falls back to eager
    timing, recording why, when the capture fails); `why_eager` is the reason when the builder already knows it cannot.
    `timed_calls`, when given, are what is timed (captured or looped): the same steps without the per-call input
    checks that read device memory back to the host (`calls`, checked, run first and are what the accuracy check
    uses).
    """

    calls: list[Callable[[], Any]]
    out: torch.Tensor
    graph: bool = True
    why_eager: str = ""
    info: dict = field(default_factory=dict)
    timed_calls: list[Callable[[], Any]] | None = None


def flashinfer_version() -> str | None:
    """FlashInfer's version, or None when it is not importable here (never raises)."""
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return None
    return getattr(flashinfer, "__version__", "unknown")


def _import_flashinfer():
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install raising at import
        raise ArmUnavailable(f"flashinfer is not importable ({type(exc).__name__}: {str(exc)[:200]})") from None
    return flashinfer


# --------------------------------------------------------------------------------------------------------------------
# FlashInfer's paged layout built from a foldkv split pool (same bytes, same page ids)
# --------------------------------------------------------------------------------------------------------------------
def flashinfer_kv_from_split(pool: PagedKvPool, kv_layout: str = "NHD") -> torch.Tensor:
    """The split pool's pages in FlashInfer's single-tensor layout: NHD [pages, 2, page, Hkv, D] or HND
    [pages, 2, Hkv, page, D]. Same page ids, so a block table addresses both."""
    if pool.format is not KvFormat.SPLIT:
        raise ValueError("FlashInfer's pool is built from a split pool (K and V in head order)")
    d = pool.geometry.head_dim
    k = pool.data[..., :d]  # [pages, Hkv, P, D]
    v = pool.data[..., d:]  # [pages, Hkv, P, D]
    if kv_layout == "HND":
        return torch.stack([k, v], dim=1).contiguous()  # [pages, 2, Hkv, P, D]
    if kv_layout == "NHD":
        return torch.stack([k.transpose(1, 2), v.transpose(1, 2)], dim=1).contiguous()  # [pages, 2, P, Hkv, D]
    raise ValueError(f"kv_layout {kv_layout!r}: expected 'NHD' or 'HND'")


def flashinfer_page_indices(table: BlockTable, page_size: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B+1], indices [sum pages], last_page_len [B]) int32 on `device`, from a foldkv block table."""
    lens = table.seq_lens.cpu().long()
    pages = (lens + page_size - 1) // page_size  # [B]
    ids = table.page_ids.cpu()
    indices = torch.cat([ids[r, : int(pages[r])] for r in range(table.batch)])  # [sum pages]
    indptr = torch.zeros(table.batch + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    last = (lens - (pages - 1) * page_size).to(torch.int32)  # [B], 1..page_size
    return indptr.to(device), indices.to(device, torch.int32), last.to(device)


def flashinfer_decode_arm(kv_copies: list[torch.Tensor], query_split: torch.Tensor, table: BlockTable, *,
                          num_kv_heads: int, page_size: int, use_tensor_cores: bool, kv_layout: str = "NHD") -> ArmImpl:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper (hd512, sm_scale 1.0) over FlashInfer-layout pools.

    Built in FlashInfer's CUDA-graph mode (fixed indptr/indices/last-page buffers), planned once outside any
    capture; `run` is what the harness captures and replays.
    """
    flashinfer = _import_flashinfer()
    if not query_split.is_cuda:
        raise ArmUnavailable("FlashInfer needs a CUDA device")
    dev = query_split.device
    batch, hq, d = query_split.shape
    indptr, indices, last = flashinfer_page_indices(table, page_size, dev)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
        paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
        paged_kv_last_page_len_buffer=last.clone())
    wrapper.plan(indptr, indices, last, hq, num_kv_heads, d, page_size, q_data_type=query_split.dtype,
                 kv_data_type=kv_copies[0].dtype, sm_scale=1.0)
    out = torch.empty_like(query_split)  # [B, Hq, D]
    calls = [lambda kv=kv: wrapper.run(query_split, kv, out=out) for kv in kv_copies]
    return ArmImpl(calls, out, graph=True, info={"flashinfer": flashinfer.__version__, "kv_layout": kv_layout,
                                                   "use_tensor_cores": use_tensor_cores, "_keep": (wrapper, workspace)})


def flashinfer_prefill_arm(kv_copies: list[torch.Tensor], query_split: torch.Tensor, table: BlockTable,
                           q_lens: list[int], *, num_kv_heads: int, page_size: int, kv_layout: str = "NHD") -> ArmImpl:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper, causal (bottom-right: the chunk is the last q_len
    positions), hd512, sm_scale 1.0. Timed eagerly: one launch is milliseconds, so launch gaps do not matter."""
    flashinfer = _import_flashinfer()
    if not query_split.is_cuda:
        raise ArmUnavailable("FlashInfer needs a CUDA device")
    dev = query_split.device
    _, hq, d = query_split.shape
    indptr, indices, last = flashinfer_page_indices(table, page_size, dev)
    qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout)
    wrapper.plan(qo_indptr.to(dev), indptr, indices, last, hq, num_kv_heads, d, page_size, causal=True,
                 sm_scale=1.0, q_data_type=query_split.dtype, kv_data_type=kv_copies[0].dtype)
    out = torch.empty_like(query_split)  # [sum q_lens, Hq, D]
    calls = [lambda kv=kv: wrapper.run(query_split, kv, out=out) for kv in kv_copies]
    return ArmImpl(calls, out, graph=False, why_eager="prefill launches are milliseconds long: timed eagerly",
                   info={"flashinfer": flashinfer.__version__, "kv_layout": kv_layout, "_keep": (wrapper, workspace)})


# --------------------------------------------------------------------------------------------------------------------
# Plain torch decode: gather the pages, two matmuls, softmax in float32
# --------------------------------------------------------------------------------------------------------------------
def torch_decode_step(pool: PagedKvPool, query: torch.Tensor, page_index: list[torch.Tensor], seq_lens: list[int],
                      out: torch.Tensor, *, compute_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Decode attention as a user would write it in torch, for either pool format.

    query [B, Hq, D] in the pool format's form; page_index[r] the device page ids of request r (long); seq_lens on the
    host (so nothing syncs and the step is graph-capturable); out [B, Hq, D] head order. Matmuls in `compute_dtype`
    (bf16: the plain implementation; float32: the checking reference), softmax in float32.
    """
    geom, fmt = pool.geometry, pool.format
    hkv, g, d = geom.num_kv_heads, geom.group_size, geom.head_dim
    sw, vw = score_window(geom, fmt), value_window(geom, fmt)
    to_head = None if fmt is KvFormat.SPLIT else value_window_to_head(geom, fmt).to(pool.device)
    for r, n in enumerate(seq_lens):
        rows = pool.data[page_index[r]]  # [pages, Hkv, P, W] (a gather; no host sync, graph-capturable)
        rows = rows.transpose(0, 1).reshape(hkv, -1, rows.shape[-1])[:, :n]  # [Hkv, n, W]
        keys = rows[..., sw].to(compute_dtype)  # [Hkv, n, D]
        vals = rows[..., vw].to(compute_dtype)  # [Hkv, n, D] (value-window order)
        q = query[r].view(hkv, g, d).to(compute_dtype)  # [Hkv, G, D]
        scores = torch.bmm(q, keys.transpose(1, 2))  # [Hkv, G, n]; Gemma 4 scaling is 1.0
        probs = torch.softmax(scores.float(), dim=-1).to(compute_dtype)  # [Hkv, G, n]
        o = torch.bmm(probs, vals).reshape(hkv * g, d)  # [Hq, D] value-window order
        out[r] = o if to_head is None else o[:, to_head]
    return out


def torch_decode_arm(pool_copies: list[PagedKvPool], query: torch.Tensor, table: BlockTable) -> ArmImpl:
    """The plain torch decode (gather + bf16 matmuls) over each pool copy; graph-capturable (no host sync)."""
    page_size = pool_copies[0].layout.page_size
    seq_lens = [int(n) for n in table.seq_lens.cpu()]
    dev = pool_copies[0].device
    page_index = [table.pages_of(r, page_size).to(dev, torch.long) for r in range(table.batch)]
    out = torch.empty(query.shape, dtype=torch.bfloat16, device=dev)  # [B, Hq, D]
    calls = [lambda p=p: torch_decode_step(p, query, page_index, seq_lens, out) for p in pool_copies]
    return ArmImpl(calls, out, graph=dev.type == "cuda", why_eager="" if dev.type == "cuda" else "CPU: host timer",
                   info={"format": pool_copies[0].format.value})


def torch_attention_rows(pool: PagedKvPool, query: torch.Tensor, table: BlockTable, request: int, q_rows: torch.Tensor,
                         q_len: int) -> torch.Tensor:
    """Float32 attention of selected query rows of one request (for checking prefill arms without the T x n score
    matrix): query [q_len, Hq, D] of request `request`, q_rows the row indices to compute -> [len(q_rows), Hq, D]
    head order. Rows are its last q_len positions, causal."""
    geom, fmt = pool.geometry, pool.format
    hkv, g, d = geom.num_kv_heads, geom.group_size, geom.head_dim
    n = int(table.seq_lens[request])
    rows = pool.gather(table, request).float()  # [n, Hkv, W]
    keys = rows[..., score_window(geom, fmt)].transpose(0, 1)  # [Hkv, n, D]
    vals = rows[..., value_window(geom, fmt)].transpose(0, 1)  # [Hkv, n, D]
    q = query[q_rows.to(query.device)].float().view(-1, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)  # [Hkv, m*G, D]
    scores = torch.bmm(q, keys.transpose(1, 2)).view(hkv, -1, g, n)  # [Hkv, m, G, n]
    pos = (n - q_len + q_rows.to(pool.device)).view(1, -1, 1, 1)  # [1, m, 1, 1]
    scores = scores.masked_fill(torch.arange(n, device=pool.device).view(1, 1, 1, n) > pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(hkv, -1, n)  # [Hkv, m*G, n]
    o = torch.bmm(probs, vals).view(hkv, -1, g, d).permute(1, 0, 2, 3).reshape(-1, hkv * g, d)  # [m, Hq, D]
    return o[..., value_window_to_head(geom, fmt).to(pool.device)]
