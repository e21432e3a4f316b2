"""FlashInfer's arms: what a user would pick instead of foldkv (its paged decode and prefill), run on a split pool
rewritten into FlashInfer's layout with the same page ids, each built as one callable per input copy.

FlashInfer is optional: it is imported only inside the builders, and a missing or failing import raises
`ArmUnavailable`, which the harness records as "not run: <reason>".
"""

from __future__ import annotations

import torch

from foldkv.layout import KvFormat
from foldkv.pool import BlockTable, PagedKvPool

from ..arms import ArmUnavailable
from .spec import ArmImpl

# FlashInfer's recommended workspace is 128 MB; hd512 split-k partials for 32 heads x many chunks need more.
FLASHINFER_WORKSPACE_BYTES = 512 * 1024 * 1024


def import_flashinfer():
    """The flashinfer module, or ArmUnavailable saying why it cannot be imported."""
    try:
        import flashinfer
    except Exception as exc:  # ImportError, or a broken install raising at import
        raise ArmUnavailable(f"flashinfer is not importable ({type(exc).__name__}: {str(exc)[:200]})") from None
    return flashinfer


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


def _flashinfer_arm(kind: str, kv_copies: list[torch.Tensor], query_split: torch.Tensor, table: BlockTable,
                    q_lens: list[int] | None, *, num_kv_heads: int, page_size: int, kv_layout: str,
                    use_tensor_cores: bool = False, k_scale: float | None = None,
                    v_scale: float | None = None) -> ArmImpl:
    """One FlashInfer wrapper (decode or prefill), planned once outside any capture, its `run` called per copy."""
    flashinfer = import_flashinfer()
    if not query_split.is_cuda:
        raise ArmUnavailable("FlashInfer needs a CUDA device")
    dev = query_split.device
    _, hq, d = query_split.shape
    indptr, indices, last = flashinfer_page_indices(table, page_size, dev)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    plan_kw = dict(q_data_type=query_split.dtype, kv_data_type=kv_copies[0].dtype, sm_scale=1.0)
    info = {"flashinfer": flashinfer.__version__, "kv_layout": kv_layout}
    if kind == "decode":
        # CUDA-graph mode: fixed indptr/indices/last-page buffers, so the harness can capture `run`
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
            paged_kv_last_page_len_buffer=last.clone())
        wrapper.plan(indptr, indices, last, hq, num_kv_heads, d, page_size, **plan_kw)
        info["use_tensor_cores"] = use_tensor_cores
    else:
        qo_indptr = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(q_lens), 0)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout)
        wrapper.plan(qo_indptr.to(dev), indptr, indices, last, hq, num_kv_heads, d, page_size, causal=True,
                     **plan_kw)
    out = torch.empty_like(query_split)  # [T, Hq, D]
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}  # an e4m3 pool's per-tensor scales
    if scales:
        info.update(kv_dtype=str(kv_copies[0].dtype).replace("torch.", ""), **scales)
    calls = [lambda kv=kv: wrapper.run(query_split, kv, out=out, **scales) for kv in kv_copies]
    if kind == "decode":
        return ArmImpl(calls, out, graph=True, info=info, keep=(wrapper, workspace))
    return ArmImpl(calls, out, graph=False, why_eager="prefill launches are milliseconds long: timed eagerly",
                   info=info, keep=(wrapper, workspace))


def flashinfer_decode_arm(kv_copies: list[torch.Tensor], query_split: torch.Tensor, table: BlockTable, *,
                          num_kv_heads: int, page_size: int, use_tensor_cores: bool, kv_layout: str = "NHD",
                          k_scale: float | None = None, v_scale: float | None = None) -> ArmImpl:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper (hd512, sm_scale 1.0) over FlashInfer-layout pools, in its
    CUDA-graph mode; `run` is what the harness captures and replays. e4m3 pools (kv_copies of float8_e4m3fn) take
    their per-tensor `k_scale` / `v_scale` (FlashInfer folds k_scale into sm_scale and multiplies the output by
    v_scale after the kernel)."""
    return _flashinfer_arm("decode", kv_copies, query_split, table, None, num_kv_heads=num_kv_heads,
                           page_size=page_size, kv_layout=kv_layout, use_tensor_cores=use_tensor_cores,
                           k_scale=k_scale, v_scale=v_scale)


def flashinfer_prefill_arm(kv_copies: list[torch.Tensor], query_split: torch.Tensor, table: BlockTable,
                           q_lens: list[int], *, num_kv_heads: int, page_size: int, kv_layout: str = "NHD") -> ArmImpl:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper, causal (bottom-right: the chunk is the last q_len
    positions), hd512, sm_scale 1.0. Timed eagerly: one launch is milliseconds, so launch gaps do not matter."""
    return _flashinfer_arm("prefill", kv_copies, query_split, table, q_lens, num_kv_heads=num_kv_heads,
                           page_size=page_size, kv_layout=kv_layout)
