"""FlashInfer as the global layers' attention of a whole Gemma 4 (notebook 05's peer arm): what a FlashInfer serving
backend does, on foldkv's split pool, in the same one-graph decode step. Lab code, not runtime.

`FlashInferCache` is a FoldKvCache of the split format whose global layers attend through FlashInfer:
- the pool: the split pool's pages, K and V as strided views ([pages, Hkv, page, D] each, FlashInfer's HND layout;
  the same page ids, so the cache's block tables address both);
- prefill: `BatchPrefillWithPagedKVCacheWrapper`, causal (bottom-right: a chunk is its sequences' last tokens),
  planned once per forward (the global layers share the lengths) and run per layer;
- decode: `BatchDecodeWithPagedKVCacheWrapper` in CUDA-graph mode (fixed indptr / indices / last-page buffers),
  tensor cores on (eight query heads a KV head), inside foldkv's decode step (`foldkv.hf_graph.DecodeStep`: the
  sliding rings, the fixed addresses, one graph for the whole forward); the host plans it before every replay (in
  vLLM's FlashInfer backend the same plan runs per step), so its time is the arm's host time.
Everything else (the rows stored, the sliding layers, the fused step) is foldkv's, so the arm differs from
foldkv-split only in the global layers' attention kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from ..hf import FoldKvCache, global_layer_indices, text_model_of
from ..hf_graph import DecodeStep
from ..layout import KvFormat
from .bench.peers import FLASHINFER_WORKSPACE_BYTES, import_flashinfer


def _kv_views(pool) -> tuple[torch.Tensor, torch.Tensor]:
    d = pool.geometry.head_dim
    return pool.data[..., :d], pool.data[..., d:]  # [pages, Hkv, P, D] each, HND


def _page_indices(page_ids: torch.Tensor, lens, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host (indptr [B+1], indices [sum pages], last_page_len [B]) int32 for sequences of `lens` tokens."""
    pages = [(n + page - 1) // page for n in lens]
    indices = torch.cat([page_ids[r, :p] for r, p in enumerate(pages)]).to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages), 0)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], dtype=torch.int32)
    return indptr, indices, last


class FlashInferStep(DecodeStep):
    """foldkv's decode step with the global layers' decode through FlashInfer (module docstring)."""

    def _global_workspace(self, first: Any) -> Any:
        fi = import_flashinfer()
        c = self.cache
        b, dev, geom = c.batch, c.device, first.geometry
        self.fi_page_ids = first.host_table.page_ids[:b].clone()
        max_pages = first.host_table.page_ids.shape[1]
        i32 = dict(dtype=torch.int32, device=dev)
        self.fi_buffers = (torch.zeros(b + 1, **i32), torch.zeros(b * max_pages, **i32), torch.zeros(b, **i32))
        self.fi_workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self.fi = fi.BatchDecodeWithPagedKVCacheWrapper(
            self.fi_workspace, "HND", use_cuda_graph=True, use_tensor_cores=True,
            paged_kv_indptr_buffer=self.fi_buffers[0], paged_kv_indices_buffer=self.fi_buffers[1],
            paged_kv_last_page_len_buffer=self.fi_buffers[2])
        self.fi_out = torch.empty(b, geom.num_q_heads, geom.head_dim, dtype=torch.bfloat16, device=dev)
        self.fi_geometry = geom
        self._fi_plan()
        return None

    def _fi_plan(self) -> None:
        g, c = self.fi_geometry, self.cache
        indptr, indices, last = _page_indices(self.fi_page_ids, self.lens, c.page_size)
        self.fi.plan(indptr, indices, last, g.num_q_heads, g.num_kv_heads, g.head_dim, c.page_size,
                     q_data_type=torch.bfloat16, kv_data_type=c.global_layers[0].pool.data.dtype, sm_scale=1.0)

    def host_advance(self) -> None:
        self.lens = [n + 1 for n in self.lens]
        self._fi_plan()

    def host_replan(self) -> None:
        self._fi_plan()

    def _global_decode(self, layer: Any, folded: torch.Tensor) -> torch.Tensor:
        b = folded.shape[0]
        self.fi.run(folded.contiguous(), _kv_views(layer.pool), out=self.fi_out[:b])
        return self.fi_out[:b]


class FlashInferCache(FoldKvCache):
    """A split FoldKvCache whose global layers' prefill and decode are FlashInfer's (module docstring)."""

    step_class = FlashInferStep

    def __init__(self, model, **kwargs):
        if KvFormat.parse(kwargs.get("kv_format", "split")) is not KvFormat.SPLIT:
            raise ValueError("FlashInfer's pool is the split pool (K and V in head order)")
        kwargs["kv_format"] = KvFormat.SPLIT
        text = text_model_of(model)
        scales = {float(text.layers[i].self_attn.scaling) for i in global_layer_indices(text)}
        if scales != {1.0}:  # FlashInfer is planned with sm_scale 1.0, Gemma 4's (its q_norm replaces the scale)
            raise ValueError(f"the global layers' attention scaling is {sorted(scales)}; this arm plans sm_scale 1.0")
        self._fi_prefill: tuple | None = None  # before the base's creation, whose warm-up prefills through it
        super().__init__(model, **kwargs)

    def resolve_prefill_kernels(self, pool) -> None:
        pass  # the prefill is FlashInfer's: foldkv's prefill kernels are never launched

    def pool_attention(self, layer, query: torch.Tensor, table, counts: tuple[int, ...]) -> torch.Tensor:
        if self.attention != "kernel" or max(counts) == 1:
            return super().pool_attention(layer, query, table, counts)
        lens = [int(n) for n in table.seq_lens.tolist()]
        key = (tuple(lens), tuple(counts), tuple(table.page_ids[:, 0].tolist()))
        if self._fi_prefill is None or self._fi_prefill[0] != key:
            fi = import_flashinfer()
            g, dev = layer.geometry, layer.pool.device
            workspace = (self._fi_prefill[2] if self._fi_prefill is not None else
                         torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev))
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "HND")
            qo = torch.zeros(len(counts) + 1, dtype=torch.int32)
            qo[1:] = torch.cumsum(torch.tensor(counts), 0)
            indptr, indices, last = _page_indices(table.page_ids, lens, self.page_size)
            wrapper.plan(qo.to(dev), indptr.to(dev), indices.to(dev), last.to(dev), g.num_q_heads, g.num_kv_heads,
                         g.head_dim, self.page_size, causal=True, q_data_type=torch.bfloat16,
                         kv_data_type=layer.pool.data.dtype, sm_scale=1.0)
            self._fi_prefill = (key, wrapper, workspace)
        return self._fi_prefill[1].run(query.contiguous(), _kv_views(layer.pool))


__all__ = ["FlashInferCache", "FlashInferStep"]
