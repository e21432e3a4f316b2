"""A FoldKvCache's sliding layers: transformers' `DynamicSlidingWindowLayer` whose prefill chunk is assembled in one
scratch the cache's sliding layers share (`SlidingScratch`), instead of the [kept window | chunk] tensor transformers'
`torch.cat` makes a layer a chunk and holds alive through its window's view (on the 31B, 8.4 GB moved and 4.2 GB held
a 4,096-token chunk; bench/PREFILL_NOTES.md).

The scratch is token-major [B, W - 1 + C, H, D] (C the longest chunk seen; what FlashAttention reads and the step's
kernels write): a chunk of T tokens lands in rows [W - 1, W - 1 + T) (written there by the step's kernels through
`chunk_rows` at batch 1, `placed`; else copied by `update`), the kept window (n <= W - 1 rows) just before it;
`update` returns rows [W - 1 - n, W - 1 + T) as [B, H, n + T, D] views and copies the last min(W - 1, n + T) rows
into the layer's own new window. Those states are the scratch's until the next sliding layer's update (one stream):
only a forward that runs each layer's attention before the next layer's update may take this path (the step's own
forward and transformers' do). Everything else (no placed rows and no `StepOptions.sliding_scratch`, `record_past`, a
held window wider than W - 1) is transformers' update.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .step_options import in_force


class SlidingScratch:
    """The one K and V scratch of a cache's sliding layers (module docstring), made anew (larger) when a longer chunk
    or another batch, head count, dtype or device comes; kept for the cache's life (the next prompt's chunks too)."""

    def __init__(self, window: int):
        self.window = int(window)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def front(self) -> int:
        """Rows before the chunk's: the most a kept window holds (W - 1)."""
        return self.window - 1

    def tensors(self, batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) scratch of at least front + tokens rows for this batch, heads, width, dtype and device."""
        k = self.k
        if (k is None or k.shape[0] != batch or k.shape[1] < self.front + tokens or k.shape[2:] != (heads, head_dim)
                or k.dtype != dtype or k.device != torch.device(device)):
            self.k = self.v = None  # the old pair goes back before the new one is made
            shape = (batch, self.front + tokens, heads, head_dim)
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        return self.k, self.v

    def chunk(self, batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a chunk's K and V rows go: [B, T, H, D] views of rows [W - 1, W - 1 + T)."""
        k, v = self.tensors(batch, tokens, heads, head_dim, dtype, device)
        at = slice(self.front, self.front + tokens)
        return k[:, at], v[:, at]


def _is_view_of(rows: torch.Tensor, place: torch.Tensor) -> bool:
    """Whether rows [B, H, T, D] are exactly `place` [B, T, H, D] transposed (the same memory, shape and strides; a
    dimension of size 1 has no stride that matters: a kernel's packed output viewed back as [1, T, H, D] gets its own
    for the batch)."""
    want = place.transpose(1, 2)
    strides = all(a == b for a, b, n in zip(rows.stride(), want.stride(), want.shape) if n > 1)
    return (rows.data_ptr() == want.data_ptr() and rows.shape == want.shape and strides
            and rows.dtype == want.dtype and rows.device == want.device)


class ScratchSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding layer whose prefill chunks go through its cache's `SlidingScratch` (module docstring). `placed` and
    `copied` count the chunks whose rows the step's kernels wrote into the scratch and those `update` copied there."""

    def __init__(self, sliding_window: int, scratch: SlidingScratch, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        if scratch.window != int(sliding_window):
            raise ValueError(f"a scratch of window {scratch.window} for a layer of window {sliding_window}")
        self.scratch = scratch
        self.placed = 0
        self.copied = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """transformers' initialisation with the window size filled on the device, not copied there: `.to(device)`
        from pageable memory waits for the stream, so each sliding layer's first update of a prompt drained the GPU's
        queue (50 waits in a 31B prompt's first chunk). The empty keys and values are transformers' own."""
        DynamicLayer.lazy_initialization(self, key_states, value_states)
        self._sliding_window_tensor = torch.full((), self.sliding_window, dtype=torch.long, device=self.device)

    def chunk_rows(self, batch: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Where the step's forward writes this layer's next chunk's K and V rows ([B, T, H, D] packed, handed to
        `update` as their [B, H, T, D] transposes); (None, None) where no packed place exists (a batch > 1: one
        sequence's scratch rows are not next to the next one's), and the rows go to `update` as they are."""
        if batch != 1 or tokens < 1 or not self._takes_window():
            return None, None
        return self.scratch.chunk(batch, tokens, heads, head_dim, dtype, device)

    def _takes_window(self) -> bool:
        """Whether the held window fits the scratch's front (transformers' layer keeps at most W - 1 rows; with
        `record_past` it keeps more until `crop`; at a window of 1 its slice `[-W + 1:]` keeps every row)."""
        if getattr(self, "record_past", False) or self.scratch.front < 1:
            return False
        return not self.is_initialized or self.keys is None or self.keys.dim() != 4 or (
            self.keys.shape[-2] <= self.scratch.front)

    def _placed(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether the chunk's rows are already in the scratch's chunk rows (written there through `chunk_rows`)."""
        s, t = self.scratch, key_states.shape[-2]
        if s.k is None or s.k.shape[0] != key_states.shape[0] or s.k.shape[1] < s.front + t:
            return False
        at = slice(s.front, s.front + t)
        return _is_view_of(key_states, s.k[:, at]) and _is_view_of(value_states, s.v[:, at])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """transformers' update, through the scratch when the rows were placed there or the step's options say so
        (module docstring): the same returned states and kept window, value for value."""
        b, h, t, d = key_states.shape
        placed = self._placed(key_states, value_states)
        if not self._takes_window() or not (placed or in_force().sliding_scratch) or (
                value_states.shape != key_states.shape):
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.keys.shape[-2] if self.keys is not None and self.keys.dim() == 4 else 0
        if held and ((self.keys.shape[0], self.keys.shape[1], self.keys.shape[3]) != (b, h, d)
                     or self.keys.dtype != key_states.dtype):
            return super().update(key_states, value_states, *args, **kwargs)  # (transformers' cat refuses it)
        front = self.scratch.front
        if not placed:
            k_at, v_at = self.scratch.chunk(b, t, h, d, key_states.dtype, key_states.device)
            k_at.copy_(key_states.transpose(1, 2))
            v_at.copy_(value_states.transpose(1, 2))
            self.copied += 1
        else:
            self.placed += 1
        sk, sv = self.scratch.k, self.scratch.v
        if held:
            sk[:, front - held:front].copy_(self.keys.transpose(1, 2))
            sv[:, front - held:front].copy_(self.values.transpose(1, 2))
        self.cumulative_length += t
        self.keys, self.values = self._kept(sk, sv, front + t, min(front, held + t))
        return sk[:, front - held:front + t].transpose(1, 2), sv[:, front - held:front + t].transpose(1, 2)

    @staticmethod
    def _kept(sk: torch.Tensor, sv: torch.Tensor, end: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The new window: scratch rows [end - kept, end) copied into tensors of the layer's own, as [B, H, kept, D]
        views (a clone, never `.contiguous()`: at batch 1 the slice is contiguous and would stay a view of the
        scratch, which the next sliding layer overwrites)."""
        at = slice(end - kept, end)
        return (sk[:, at].clone(memory_format=torch.contiguous_format).transpose(1, 2),
                sv[:, at].clone(memory_format=torch.contiguous_format).transpose(1, 2))

    def reset(self) -> None:
        """Holds nothing: the window dropped (not zeroed in place), initialised again at the next update."""
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0


__all__ = ["ScratchSlidingLayer", "SlidingScratch"]
