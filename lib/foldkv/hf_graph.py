"""The decode step of `generate()` on a FoldKvCache at fixed addresses (`DecodeStep`), captured as one CUDA graph of
the whole forward ("graph") or run eagerly ("static"): token ids, positions, sliding rings, masks and the global
layers' `DecodeWorkspace` are allocated at the first decode step, and the step's lengths and slots advance on the
device, so the graph reads nothing from the host. The step's forward is `fused_step.StepForward` where it applies.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import torch

from . import fused_step, global_step
from .masks import NewTokens, RingMask
from .reference import paged_attention_reference
from .step_options import StepOptions, using
from .pool import BlockTable
from .validate import FoldKvInputError
from .moved import moved

STEP_MODES = ("graph", "static", "eager")
REPLAN_STEPS = 64  # advance() lengthens each request's last chunk; a fresh plan every 64 steps keeps the cut even


class DecodeStep:
    """The fixed-address decode step of one FoldKvCache. `takes` says whether a forward is one of its steps; calling
    it runs (or replays) the step and returns the forward's output."""

    def __init__(self, cache: Any, mode: str):
        if mode not in ("graph", "static"):
            raise FoldKvInputError(f"decode_step={mode!r}: a DecodeStep runs 'graph' or 'static'")
        self.cache, self.mode = cache, mode
        # what the step fuses, merges, overlaps (in force while its forward runs): the cache's, which it checked
        self.options = getattr(cache, "step_options", None) or StepOptions()
        self.started = False
        self.steps = 0  # decode steps run through this object
        # the steps foldkv.hf_loop's decoding loop issued on this step: thin (after the capture), through transformers'
        # own path (the prompt's output and the capturing step), and run ahead then taken back at a stop
        self.loop_steps = {"thin": 0, "transformers": 0, "rewound": 0}
        self.host_s: list[float] = []  # host time of each step's call (run or replay), seconds
        self.capture_s: float | None = None

    # -- which forwards are steps ----------------------------------------------------------------------------------
    def takes(self, kwargs: dict) -> bool:
        ids = kwargs.get("input_ids")
        if self.started:
            if ids is None or kwargs.get("inputs_embeds") is not None or ids.shape[1] != 1:
                raise used_cache_error(self.cache.global_layers[0].columns)
            return True
        c = self.cache
        if not (ids is not None and kwargs.get("inputs_embeds") is None and ids.dim() == 2 and ids.shape[1] == 1
                and c.batch is not None and ids.shape[0] == c.batch and c.global_layers[0].columns > 0):
            return False
        # the step's one column must be a real token of every sequence (a one-column chunk of a chunked prefill may
        # still be left padding): read once, before the first step; every later column is a generated token
        mask = kwargs.get("attention_mask")
        return mask is None or isinstance(mask, dict) or bool(mask[:, -1].bool().all())

    def fuses_prefill(self, kwargs: dict) -> bool:
        """Is this forward a prefill (more than one token a sequence, before the first decode step) that the step's
        kernels serve (`prefill`): token ids on CUDA, the global layers on the kernels."""
        ids = kwargs.get("input_ids")
        return (self.options.fuse_prefill and not self.started and self.cache.attention == "kernel"
                and ids is not None and ids.is_cuda
                and ids.dim() == 2 and ids.shape[1] > 1 and kwargs.get("inputs_embeds") is None)

    def prefill(self, forward: Callable, kwargs: dict) -> Any:
        """A prefill forward through the step's own forward where it describes the model and keywords."""
        step_forward = self.step_forward(forward.__self__, kwargs["input_ids"].device)
        if step_forward is None or not step_forward.takes(kwargs):
            return forward(**kwargs)
        with using(self.prefill_options()):
            return step_forward.prefill(self.cache, kwargs["input_ids"], kwargs.get("attention_mask"),
                                        kwargs.get("position_ids"), kwargs.get("logits_to_keep") or 0)

    def prefill_options(self) -> StepOptions:
        """The options in force inside a prefill: pdl off, so its projections are cuBLAS's at every row count (a short
        chunk builds no GEMV specialization inside a prompt)."""
        return dataclasses.replace(self.options, pdl=False)

    def warm_prefill(self, model: Any) -> int:
        """At the cache's creation, the first launches a first prefill would pay inside its TTFT
        (`StepForward.warm_prefill`). Returns the layer bodies run (0: no fused prefill, or no memory for a chunk)."""
        c = self.cache
        if not (self.options.fuse_prefill and c.attention == "kernel" and c.device.type == "cuda"):
            return 0
        step_forward = self.step_forward(model, c.device)
        if step_forward is None:
            return 0
        try:
            with using(self.prefill_options()):
                return step_forward.warm_prefill(c.global_layers[0].pool,
                                                 rows=min(fused_step.WARM_ROWS, c.max_batch * c.max_tokens))
        except torch.OutOfMemoryError:
            return 0

    def step_forward(self, model: Any, device: torch.device) -> fused_step.StepForward | None:
        """The step's own forward over `model`, built once (projections merged first on CUDA under `options.merge`);
        None when `fused_step.refusal` says the model's own forward runs (`forward_refusal` keeps why)."""
        if getattr(self, "_forward_of", (None,))[0] is not model:
            self.forward_refusal = None if model is None else fused_step.refusal(model)
            built = None
            if model is not None and self.forward_refusal is None:
                if device.type == "cuda" and self.options.merge:
                    fused_step.merge_projections(model)
                built = fused_step.StepForward(model, self.options)
            self._forward_of = (model, built)
        return self._forward_of[1]

    # -- the step --------------------------------------------------------------------------------------------------
    def __call__(self, forward: Callable, kwargs: dict) -> Any:
        t0 = time.perf_counter()
        c = self.cache
        if self.room() < 1:
            raise FoldKvInputError(f"this step takes the sequences to {c.global_layers[0].columns + 1} columns; the"
                                   f" FoldKvCache holds max_tokens={c.max_tokens}")
        if not self.started:
            out = self._start(forward, kwargs)
        else:
            self.ids.copy_(kwargs["input_ids"])
            self.host_advance()
            if self.mode == "graph":
                self.graph.replay()
                out = self.output
            else:
                out = self._body(forward)
        self._count_columns(+1)
        self.steps += 1
        self.host_s.append(time.perf_counter() - t0)
        return out

    def host_advance(self) -> None:
        """The host's part of a step: the workspace's lengths one longer (a fresh plan every REPLAN_STEPS)."""
        self.lens = [n + 1 for n in self.lens]
        if self.ws is None:
            return
        if (self.steps + 1) % REPLAN_STEPS == 0:
            self.ws.plan(self.lens)
        else:
            self.ws.advance()

    def host_replan(self) -> None:
        """A fresh plan for the lengths the host holds now (after `rewind`)."""
        if self.ws is not None:
            self.ws.plan(self.lens)

    def reset(self) -> None:
        """Ready for the cache's next generate(); the fixed tensors and graph stay for `_refill`."""
        self.started = False
        self.steps = 0
        self.host_s = []

    def room(self) -> int:
        """Decode steps the cache still holds columns for."""
        return self.cache.max_tokens - self.cache.global_layers[0].columns

    def rewind(self) -> None:
        """Undo the last replayed step (`foldkv.hf_loop` runs one ahead of the stop check): device and host counters
        step back. What it wrote stays outside every length: its ring slot is rewritten before any step reads it, and
        a pool row past a length is never read."""
        if not self.started or self.steps < 2:
            raise FoldKvInputError("rewind() takes back a replayed step; this decode step has run none")
        self.dev_lens.sub_(1)
        self.col.sub_(1)
        self.lens = [n - 1 for n in self.lens]
        self.steps -= 1
        self.host_s.pop()
        self._count_columns(-1)
        self.host_replan()

    def _count_columns(self, delta: int) -> None:
        """The global layers' host columns and lengths after a step (+1) or its rewind (-1)."""
        for layer in self.cache.global_layers:
            layer.columns += delta
            layer.lengths[:len(self.lens)] = self.lens

    # -- the global layers' attention (a lab arm may serve them through another library: `foldkv.lab`) ------------
    def _global_workspace(self, first: Any) -> Any:
        """The global layers' shared DecodeWorkspace, planned for this step's lengths (None with the reference)."""
        if self.cache.attention != "kernel":
            return None
        b = self.cache.batch
        ws = self.cache.decode_workspace(b)
        ws.plan(self.lens, first.device_table.page_ids[:b])
        return ws

    def _global_decode(self, layer: Any, folded: torch.Tensor) -> torch.Tensor:
        """One global layer's decode over its pool (this step's rows stored): [B, Hq, D] head order."""
        b = folded.shape[0]
        if self.ws is not None:
            self.ws.query[:b].copy_(folded)
            return self._workspace_decode(layer, b)
        # the float64 reference through the host table (static mode only: it reads the lengths on the host)
        table = BlockTable(layer.host_table.page_ids[:b], torch.tensor(self.lens, dtype=torch.int32))
        return paged_attention_reference(layer.pool, folded, table)[0]

    def _workspace_decode(self, layer: Any, b: int) -> torch.Tensor:
        """The workspace's decode step over the layer's pool, its query (ws.query[:b]) written: [B, Hq, D]."""
        self.ws.step(layer.pool, backend=self.cache.backend, check=False)
        return self.ws.out[:b]

    def _start(self, forward: Callable, kwargs: dict) -> Any:
        """The first decode step: the fixed tensors, the rings, the plan; then the step runs (and is captured)."""
        c = self.cache
        layers = c.global_layers
        first = layers[0]
        b, dev = c.batch, c.device
        for layer in layers[1:]:
            if layer.lengths[:b] != first.lengths[:b] or not torch.equal(layer.host_table.page_ids[:b],
                                                                          first.host_table.page_ids[:b]):
                raise FoldKvInputError("the global layers hold different lengths or page orders; the decode step"
                                       " shares one table among them")
        lens0 = list(first.lengths[:b])  # real tokens held before this step
        c.refuse_padding_only(lens0)
        cols = first.columns  # columns (padding included) before this step: the new token's column
        if self._refillable(kwargs):  # a step of this shape ran before the cache's reset(): its addresses serve
            return self._refill(forward, kwargs, lens0, cols)
        long = dict(dtype=torch.long, device=dev)
        self.lens = [n + 1 for n in lens0]
        self.dev_lens = torch.tensor(lens0, **long)
        self.pad = torch.tensor([cols - n for n in lens0], **long)
        self.col = torch.tensor([cols], **long)
        self.slot = torch.zeros(1, **long)
        self.pos = torch.zeros(b, 1, **long)
        self.store_pages = torch.zeros(b, **long)
        self.store_offsets = torch.zeros(b, **long)
        self.page_ids = first.device_table.page_ids[:b].long()
        self.ids = kwargs["input_ids"].clone()
        self.window = int(c.sliding_window)
        self.slots = torch.arange(self.window, **long)
        self.mask = torch.zeros(b, 1, 1, self.window, dtype=torch.bool, device=dev)
        self.rings = {i: self._ring(layer, cols) for i, layer in enumerate(c.layers) if c.is_sliding_layer(i)}
        self.ws = self._global_workspace(first)
        self.kwargs = self._step_kwargs(kwargs)
        # the global layers' "mask": one real token per sequence
        self.masks = {"full_attention": NewTokens(torch.ones(b, 1, dtype=torch.bool, device=dev), (1,) * b),
                      "sliding_attention": RingMask(self.mask)}
        self.started = True
        # before the warm-up: the merged weights are allocated once, on the current stream
        self.forward = self.step_forward(getattr(forward, "__self__", None), dev)
        if self.mode == "static":
            return self._body(forward)
        from .kernels.workspace import capture_after_warmup

        t0 = time.perf_counter()
        # the first step runs for real as the capture's warm-up (its output is this step's); the captured one is
        # recorded, not run: its output is what the replays write from the second step on
        self.graph, out, self.output = capture_after_warmup(lambda: self._body(forward), dev)
        self.capture_s = time.perf_counter() - t0
        return out

    def _step_kwargs(self, kwargs: dict) -> dict:
        """The forward's keywords the step passes on (the ones it replaces taken out, the cache's keyword its own)."""
        keyword = self.cache.cache_keyword
        out = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "position_ids",
                                                             "cache_position", keyword)}
        out[keyword] = self.cache
        return out

    def _refillable(self, kwargs: dict) -> bool:
        """Whether this step ran before `reset()` for a batch of the same shape and keywords (`_refill` serves it)."""
        held = getattr(self, "kwargs", None)
        if held is None or self.ids.shape != kwargs["input_ids"].shape:
            return False
        new = self._step_kwargs(kwargs)
        return held.keys() == new.keys() and all(
            a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
            for a, b in ((held[k], new[k]) for k in new))

    def _refill(self, forward: Callable, kwargs: dict, lens0: list[int], cols: int) -> Any:
        """The first decode step after reset(): the new prompt's state copied into `_start`'s tensors, then the step."""
        self.lens = [n + 1 for n in lens0]
        self.dev_lens.copy_(torch.tensor(lens0))
        self.pad.copy_(torch.tensor([cols - n for n in lens0]))
        self.col.fill_(cols)
        self.ids.copy_(kwargs["input_ids"])
        for i, (ring_k, ring_v) in self.rings.items():
            k, v = self._ring(self.cache.layers[i], cols)
            ring_k.copy_(k)
            ring_v.copy_(v)
        self.host_replan()
        self.started = True
        if self.mode == "static":
            return self._body(forward)
        self.graph.replay()
        return self.output

    def _ring(self, layer: Any, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sliding layer's (K, V) rings [B, Hkv, W, d] holding the columns its dynamic cache kept, column c in slot
        c mod W; the other slots hold zeros (finite: a masked score must stay finite before the mask)."""
        keys, values = layer.keys, layer.values  # [B, Hkv, n, d]: columns cols - n .. cols - 1
        b, hkv, n, d = keys.shape
        ring_k = keys.new_zeros(b, hkv, self.window, d)
        ring_v = values.new_zeros(b, hkv, self.window, d)
        if n:
            if n > self.window:
                keys, values, n = keys[:, :, -self.window:], values[:, :, -self.window:], self.window
            at = torch.arange(cols - n, cols, device=keys.device) % self.window
            ring_k[:, :, at] = keys
            ring_v[:, :, at] = values
        # the ring holds them now: the dynamic layer keeps empty tensors (its memory goes back)
        layer.keys, layer.values = keys[:, :, :0].clone(), values[:, :, :0].clone()
        return ring_k, ring_v

    def _prologue(self) -> None:
        """Device-only: this step's lengths, positions, ring slot, sliding mask and pool slots. The ring holds column c
        in slot c mod W, so after column t's write slot s holds t - ((t - s) mod W): masked below the padding."""
        self.dev_lens.add_(1)
        self.pos.copy_((self.dev_lens - 1)[:, None])
        t = self.col
        self.slot.copy_(torch.remainder(t, self.window))
        held = t - torch.remainder(t - self.slots, self.window)  # [W] the column each slot holds after the write
        self.mask.copy_((held[None, :] >= self.pad[:, None])[:, None, None, :])
        p = self.pos[:, 0]
        page = self.cache.page_size
        self.store_pages.copy_(self.page_ids.gather(1, torch.div(p, page, rounding_mode="floor")[:, None])[:, 0])
        self.store_offsets.copy_(torch.remainder(p, page))

    def _body(self, forward: Callable) -> Any:
        """One decode step over the fixed tensors (what the graph records)."""
        self._prologue()
        with using(self.options):
            if self.forward is not None and self.forward.takes(self.kwargs):
                out = self.forward.decode(self, self.ids, self.pos, self.masks)
            else:
                out = forward(input_ids=self.ids, attention_mask=self.masks, position_ids=self.pos, **self.kwargs)
        self.col.add_(1)
        return out

    # -- what the layers call --------------------------------------------------------------------------------------
    def update_sliding(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ring_k, ring_v = self.rings[layer_idx]
        ring_k.index_copy_(2, self.slot, key)
        ring_v.index_copy_(2, self.slot, value)
        return ring_k, ring_v

    def sliding_ring(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(ring K, ring V, slot [1] on the device) of a sliding layer while this step runs; None before the step
        starts, for a layer without a ring, or when a subclass stores sliding rows its own way."""
        if not self.started or type(self).update_sliding is not DecodeStep.update_sliding:
            return None
        ring = self.rings.get(layer_idx)
        return None if ring is None else (ring[0], ring[1], self.slot)

    def global_layer(self, layer_idx: int) -> Any:
        """The cache's FoldKvLayer at `layer_idx`, None for a sliding layer or past the cache's layers."""
        c = self.cache
        return c.layers[layer_idx] if layer_idx < len(c.layers) and not c.is_sliding_layer(layer_idx) else None

    def serves_global_decode(self) -> bool:
        """Whether the global layers' decode is DecodeStep's own (a subclass may decode them another way)."""
        return type(self)._global_decode is DecodeStep._global_decode

    def attend(self, layer: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> torch.Tensor:
        """A global layer's step: store the new rows at slot len_b - 1, decode over the pool. query [B, Hq, 1, D],
        key/value [B, Hkv, 1, D]. Returns [B, 1, Hq, D] in query's dtype."""
        pool = layer.pool
        b, hq, _, d = query.shape
        kernels = global_step.global_route(self, layer, module, query, key, value) is None
        out = self.ws.query if self.ws is not None and self.serves_global_decode() else None
        folded = global_step.fold_and_store(pool, self.store_pages, self.store_offsets, query[:, :, 0], key[:, :, 0],
                                            value[:, :, 0], module.k_norm.weight, out=out, check_finite=False,
                                            kernels=kernels)
        if out is not None:
            return self._workspace_decode(layer, b).to(query.dtype).view(b, 1, hq, d)
        return self._global_decode(layer, folded).to(query.dtype).view(b, 1, hq, d)


def used_cache_error(columns: int) -> FoldKvInputError:
    """The refusal of a new prompt on a FoldKvCache that still holds an earlier generate()'s tokens."""
    return FoldKvInputError(f"this FoldKvCache holds {columns} tokens a sequence (padding included) from an earlier"
                            " generate(); call cache.reset() or make a new one")


__getattr__ = moved(__name__, {"ring_attention": "foldkv.ring.ring_attention", "install": "foldkv.hf_loop.install",
                               "cache_keyword": "foldkv.transformers_compat.cache_keyword"})


__all__ = ["DecodeStep", "RingMask", "STEP_MODES", "REPLAN_STEPS", "used_cache_error"]
