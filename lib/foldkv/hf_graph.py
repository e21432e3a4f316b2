"""The decode step of `generate()` on a FoldKvCache as one CUDA graph: every layer of the model, replayed each step.

After the prompt's forward(s), a decode step feeds one token per sequence and its shape never changes, so the whole
forward (embedding, the 60 layers, the final norm and the LM head) is captured once and replayed: the host's work per
step is a few copies and counters, not 60 layers of Python. What makes the forward replayable:
- fixed addresses: the token ids, the positions, the sliding layers' K/V, the sliding mask and the global layers'
  decode workspace (`foldkv.kernels.workspace.DecodeWorkspace`) are allocated once, at the first decode step;
- no host read inside: the step's lengths, positions, ring slots and pool slots live on the device and are advanced
  by the graph itself (the prologue below), the masks are handed to the model ready-made (Gemma 4's forward accepts a
  {layer type: mask} dict and then builds none), and the global layers' store and decode read only device tensors.

Sliding layers become rings at the first decode step. Until then they are transformers' own
`DynamicSlidingWindowLayer` (the prompt's forwards, its masks). A decode token at column t attends over columns
(t - W, t] of its sequence (W = sliding_window), the ones that are not left padding; the ring holds column c in slot
c mod W, so after writing column t the ring's W slots hold exactly columns t - W + 1 .. t (those already made), and
slot s holds column c_s = t - ((t - s) mod W). The mask is c_s >= pad_b (pad_b: sequence b's padding columns; a
negative c_s, a slot never written, is masked too). The rows carry their RoPE, so the order inside the ring does not
matter. The grouped query heads of a KV head are laid out as that head's query rows (q [B, Hkv, group, d] against
K [B, Hkv, W, d]), so no K/V is repeated per query head.

Global layers keep their pools; the step stores each sequence's row at slot len_b - 1 (pages and offsets computed on
the device from the block table) and runs the workspace's decode step on the layer's pool (on CUDA with a bf16 pool,
the query and the row go there as two Triton kernels: `foldkv.global_step`). All global layers share one workspace and
one page order (the layers' pools are the same shape and their tables the same), advanced once a step (`advance()`,
one launch before the replay) and planned again every `REPLAN_STEPS` steps.

Modes: "graph" (CUDA, kernel attention) captures the step after running it once eagerly on the capture stream (its
warm-up); "static" runs the same fixed-address step eagerly every step (any device; with attention="reference" the
float64 reference reads the pool through the host table): the CPU tests hold the static step to the eager path, the GPU
tests the graph to both. Once a cache decodes through its step, it only decodes: a forward of more than one token per
sequence is refused until `reset()`, which keeps the step's fixed tensors (and its graph) for the next prompt.

The step's forward is its own (`foldkv.fused_step.StepForward`, built at its first use over the model's weights: on
CUDA its kernels); a model it does not describe (`fused_step.refusal`) runs the model's forward over the same fixed
tensors. Layers: this module imports the step's forward (`foldkv.fused_step`), the global layers' kernels
(`foldkv.global_step`), the masks (`foldkv.masks`) and nothing of the transformers adapter above it: the adapter
(`foldkv.hf`) makes the step with its cache, and `foldkv.hf_loop.install` routes the model's forward and generate()
through it. What the lower modules ask of the step they get from the step object the cache carries (`sliding_ring`,
`global_layer`, `serves_global_decode`).
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
    """The fixed-address decode step of one FoldKvCache (module docstring). Made by the cache; `takes` says whether a
    forward is one of its steps, calling it runs (or replays) the step and returns the forward's output."""

    def __init__(self, cache: Any, mode: str, options: StepOptions | None = None):
        if mode not in ("graph", "static"):
            raise FoldKvInputError(f"decode_step={mode!r}: a DecodeStep runs 'graph' or 'static'")
        if options is None:
            options = getattr(cache, "step_options", None) or StepOptions()
        if not isinstance(options, StepOptions):
            raise FoldKvInputError(f"options={options!r}: a DecodeStep takes a foldkv StepOptions")
        self.cache, self.mode = cache, mode
        self.options = options  # what the step fuses, merges, overlaps (in force while its forward runs)
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
        fused kernels serve: token ids on CUDA, the cache's global layers on its kernels. Its norms, RoPE, MLP
        activation and residual tails are then the decode step's kernels (`prefill`), whose row count is the grid's
        only: nothing is built per prompt length."""
        ids = kwargs.get("input_ids")
        return (self.options.fuse_prefill and not self.started and self.cache.attention == "kernel"
                and ids is not None and ids.is_cuda
                and ids.dim() == 2 and ids.shape[1] > 1 and kwargs.get("inputs_embeds") is None)

    def prefill(self, forward: Callable, kwargs: dict) -> Any:
        """A prefill forward through the step's own forward (`foldkv.fused_step.StepForward.prefill`): the model's
        norms, RoPE, MLP activation and residual tails as its kernels (at prefill's row counts each is one pass over
        its rows where transformers' modules take five to seven, in float32), the same formulas at the same rounding
        points; the masks, the cache's update and the attention the model's. A model or keywords it does not
        describe: the model's own forward."""
        step_forward = self.step_forward(forward.__self__, kwargs["input_ids"].device)
        if step_forward is None or not step_forward.takes(kwargs):
            return forward(**kwargs)
        with using(self.prefill_options()):
            return step_forward.prefill(self.cache, kwargs["input_ids"], kwargs.get("attention_mask"),
                                        kwargs.get("position_ids"), kwargs.get("logits_to_keep") or 0)

    def prefill_options(self) -> StepOptions:
        """The options in force inside a prefill: pdl off, so its projections are cuBLAS's at every row count
        (foldkv.gemv's kernels serve 1..16 rows: a chunk that short would build their Triton specializations inside a
        prompt) and its kernels launch plainly."""
        return dataclasses.replace(self.options, pdl=False)

    def warm_prefill(self, model: Any) -> int:
        """At the cache's creation, what a process's first prefill through `prefill` would do inside its time to first
        token: the step's forward built (the projections merged) and each of its kernels launched once
        (`fused_step.StepForward.warm_prefill`, under the prefill's options; its memory one chunk's activations at
        its rows, freed after). Returns the layer bodies run (0: no fused prefill for this cache or model, or a card
        too full for those activations, whose first prompt then loads its kernels itself)."""
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
        """The step's own forward over `model`, built once (on CUDA with `StepOptions.merge`, the model's projections
        merged first: their merged tensors are read when it is built); None when `fused_step.refusal` says the
        model's own forward runs (`forward_refusal` keeps why)."""
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
        """The host's part of a step, before the replay: the workspace's lengths one longer (a fresh plan every
        REPLAN_STEPS)."""
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
        """Ready for the cache's next generate() (`FoldKvCache.reset`): the next decode step starts again from that
        prompt's state. The fixed tensors stay where they are and are refilled in place (`_refill`), so a captured
        graph is replayed again rather than captured anew when the next batch has this one's shape and keywords."""
        self.started = False
        self.steps = 0
        self.host_s = []

    def room(self) -> int:
        """Decode steps the cache still holds columns for."""
        return self.cache.max_tokens - self.cache.global_layers[0].columns

    def rewind(self) -> None:
        """Undo the last step (one replay after the capture): `foldkv.hf_loop` runs a step ahead of the stop check and
        takes it back when generation stopped. The device counters (lengths, the ring column) step back on the
        current stream, after that replay; the host's lengths, the cache's columns and the plan step back with them.
        What the step wrote stays but is outside every length: the ring slot it wrote (column t) is read by no step
        before a step at column t rewrites it, and a global pool's row past a length is never read. A step taken
        again with the same token writes the same rows."""
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
        """The global layers' host counters after a step (+1) or its rewind (-1): their columns, and their lengths
        set to the step's (the pools' block tables keep the prompt's lengths)."""
        for layer in self.cache.global_layers:
            layer.columns += delta
            layer.lengths[:len(self.lens)] = self.lens

    # -- the global layers' attention (a lab arm may serve them through another library: `foldkv.lab`) ------------
    def _global_workspace(self, first: Any) -> Any:
        """The decode state the global layers share, planned for this step's lengths: foldkv's DecodeWorkspace with
        kernel attention, None with the reference."""
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
        """The first decode step: the fixed tensors, the rings from the sliding layers' caches, the plan; then the
        step runs eagerly (for "graph": on the capture stream, its warm-up) and is captured."""
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
        """Whether this step ran before (then `reset()`) for a batch of the same shape with the same keywords: its
        fixed tensors (and its graph, which read them) serve the new prompt once refilled."""
        held = getattr(self, "kwargs", None)
        if held is None or self.ids.shape != kwargs["input_ids"].shape:
            return False
        new = self._step_kwargs(kwargs)
        return held.keys() == new.keys() and all(
            a is b or (not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b)
            for a, b in ((held[k], new[k]) for k in new))

    def _refill(self, forward: Callable, kwargs: dict, lens0: list[int], cols: int) -> Any:
        """The first decode step after the cache's reset(), at the addresses `_start` made: the lengths, padding,
        column, token ids and rings of the new prompt copied in place, the global decode planned again (the page ids
        are the same: the cache's tables keep their pages), then the step run (static) or the graph replayed."""
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
        """Device-only: this step's lengths, positions, ring slot, sliding mask and pool slots."""
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
        """One decode step over the fixed tensors (what the graph records): the step's own forward
        (`foldkv.fused_step.StepForward`: on CUDA its kernels), or the model's for a model it does not describe."""
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
        """(ring K, ring V, slot) of a sliding layer while this step runs: where `update_sliding` stores the step's
        rows (slot: a device tensor [1], this step's) and what ring_attention reads; `foldkv.fused_step`'s fused
        sliding attention writes and reads them itself. None before the step starts, for a layer without a ring, or
        when a subclass stores sliding rows its own way (its update_sliding is not this one)."""
        if not self.started or type(self).update_sliding is not DecodeStep.update_sliding:
            return None
        ring = self.rings.get(layer_idx)
        return None if ring is None else (ring[0], ring[1], self.slot)

    def global_layer(self, layer_idx: int) -> Any:
        """The cache's FoldKvLayer at `layer_idx` (what `foldkv.fused_step`'s fused global forward stores into and
        decodes over), None for a sliding layer or an index past the cache's layers."""
        c = self.cache
        return c.layers[layer_idx] if layer_idx < len(c.layers) and not c.is_sliding_layer(layer_idx) else None

    def serves_global_decode(self) -> bool:
        """Whether the global layers' decode is DecodeStep's own (`_global_decode`: its workspace); False for a
        subclass that decodes them another way (a lab arm's other library): `global_step.global_route` asks."""
        return type(self)._global_decode is DecodeStep._global_decode

    def attend(self, layer: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor) -> torch.Tensor:
        """A global layer's step: store the new rows at slot len_b - 1, decode over the pool. query [B, Hq, 1, D],
        key/value [B, Hkv, 1, D]. Returns [B, 1, Hq, D] in query's dtype. On CUDA with a bf16 pool the query and the
        rows go to the workspace and the pool as two Triton kernels (`foldkv.global_step.fold_and_store`, bitwise the
        torch definition, which every other call takes)."""
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

    def report(self) -> dict:
        """Host time per step (median and max over the replays, seconds), the capture's time, the steps run, and those
        generate()'s decoding loop issued (`loop_steps`)."""
        replays = sorted(self.host_s[1:])
        mid = replays[len(replays) // 2] if replays else None
        return {"mode": self.mode, "steps": self.steps, "capture_s": self.capture_s,
                "host_s_median": mid, "host_s_max": replays[-1] if replays else None,
                "loop_steps": dict(self.loop_steps)}


def used_cache_error(columns: int) -> FoldKvInputError:
    """The refusal of a new prompt on a FoldKvCache that still holds an earlier generate()'s tokens."""
    return FoldKvInputError(f"this FoldKvCache holds {columns} tokens a sequence (padding included) from an earlier"
                            " generate(); call cache.reset() or make a new one")


_MOVED = {"ring_attention": "foldkv.ring.ring_attention", "install": "foldkv.hf_loop.install",
          "cache_keyword": "foldkv.transformers_compat.cache_keyword"}


__getattr__ = moved(__name__, _MOVED)


__all__ = ["DecodeStep", "RingMask", "STEP_MODES", "REPLAN_STEPS", "used_cache_error"]
