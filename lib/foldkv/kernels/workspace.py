"""The decode workspace: every tensor a decode step reads or writes, allocated once at fixed addresses for a maximum
batch and length, so that one CUDA graph captured over `step` serves every later step of the batch.

    ws = DecodeWorkspace(pool.layout, max_batch=64, max_len=65536, device="cuda")
    ws.plan(seq_lens, table.page_ids)            # host: a plan for these lengths, copied asynchronously
    ws.query[:batch] = query                      # the step's queries (the format's form), or prep writes them here
    graph = ws.capture(pool)                      # once; then per step: graph.replay(), ws.advance() or ws.plan(...)
    out, lse = ws.output()                        # [batch, Hq, D] bf16 head order, [batch, Hq] f32 natural log

Why one graph serves every step: kernels/DECODE_SCHEDULE.md, "One graph for every step".
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..layout import value_window_columns
from ..pool import PagedKvLayout, PagedKvPool
from ..validate import FoldKvInputError, check_device, check_tensor
from . import resolve
from .decode import check_decode_pool, launch_step, parse_fp8_math, partial_wave, replaceable_kernels
from .plan import (DEFAULT_MERGE_GROUP, MAX_BATCH, MAX_LEN, check_lens, chunk_layout, fixed_count_pieces,
                   smallest_cap)

CHUNKS_PER_REQUEST = 4  # the default chunk count per request of the largest batch, in whole waves (DECODE_SCHEDULE.md)
_ALIGN = 32  # int32 entries: each plan array starts on a 128-byte boundary of the packed buffer


def default_num_chunks(max_batch: int, num_sms: int, num_kv_heads: int) -> int:
    """Whole waves of the partial kernel holding at least CHUNKS_PER_REQUEST x max_batch + 1 chunks."""
    wave = max(num_sms // num_kv_heads, 1)
    return wave * -(-(CHUNKS_PER_REQUEST * max_batch + 1) // wave)


class DecodeWorkspace:
    """Fixed-address tensors of decode steps for up to `max_batch` requests of up to `max_len` tokens on pools of
    `layout`. num_chunks: the partial's grid (>= max_batch); merge_group: slots per level-one group; fp8_math: fixed
    for the workspace and its graph; num_sms (default `decode.partial_wave`) sizes the waves."""

    def __init__(self, layout: PagedKvLayout, *, max_batch: int, max_len: int, device: torch.device | str,
                 num_chunks: int | None = None, merge_group: int = DEFAULT_MERGE_GROUP, num_sms: int | None = None,
                 fp8_math: str | None = None):
        if not isinstance(layout, PagedKvLayout):
            raise FoldKvInputError(f"layout must be a PagedKvLayout, got {type(layout).__name__}")
        self.fp8_math = parse_fp8_math(fp8_math, layout.quantized)
        device = check_device(device)
        max_batch, max_len, merge_group = int(max_batch), int(max_len), int(merge_group)
        if not 1 <= max_batch <= MAX_BATCH:
            raise FoldKvInputError(f"max_batch={max_batch}: decode takes 1 to {MAX_BATCH} requests")
        if not 1 <= max_len <= MAX_LEN:
            raise FoldKvInputError(f"max_len={max_len}: decode takes lengths 1 to {MAX_LEN}")
        if merge_group < 1:
            raise FoldKvInputError(f"merge_group={merge_group} must be >= 1")
        geom = layout.geometry
        num_sms = partial_wave(layout, device, self.fp8_math) if num_sms is None else num_sms
        if num_chunks is None:
            num_chunks = default_num_chunks(max_batch, num_sms, geom.num_kv_heads)
        num_chunks = int(num_chunks)
        if num_chunks < max_batch:
            raise FoldKvInputError(f"num_chunks={num_chunks} is below max_batch={max_batch}: every request needs"
                                   " a chunk")
        self.layout, self.device, self.merge_group = layout, device, merge_group
        self.max_batch, self.max_len, self.num_chunks = max_batch, max_len, num_chunks
        self.max_pages = layout.pages_for(max_len)
        self.one_wave = num_chunks * geom.num_kv_heads <= num_sms  # every CTA of the partial runs at once
        self.fused = self.one_wave and not layout.quantized  # one launch per step (decode_fused_<format>)
        # level-one groups: a request of k chunks has ceil(k / merge_group) <= 1 + (k - 1) // merge_group of them
        self.num_groups = max_batch + (num_chunks - 1) // merge_group
        c, g, b = num_chunks, self.num_groups, max_batch
        # the packed plan, one buffer (chunk_len's extra entry: the padding requests' scratch)
        sizes = {"chunk_req": c, "chunk_start": c, "chunk_len": c + 1, "group_first": g, "group_count": g,
                 "req_group_first": b, "req_group_count": b, "last_slot": b, "merge_first": c, "merge_count": c}
        self._offsets, at = {}, 0
        for name, n in sizes.items():
            self._offsets[name] = (at, n)
            at += -(-n // _ALIGN) * _ALIGN
        i32 = dict(dtype=torch.int32, device=device)
        self._plan_dev = torch.zeros(at, **i32)
        pinned = device.type == "cuda"
        self._staging = [torch.zeros(at, dtype=torch.int32, pin_memory=pinned) for _ in range(2)]
        # the event recorded after each staging buffer's last copy (made once: creating events costs host time)
        self._staged = [torch.cuda.Event() for _ in range(2)] if pinned else [None, None]
        self._in_flight = [False, False]
        self._next = 0
        hq, d = geom.num_q_heads, geom.head_dim
        self.query = torch.zeros(b, hq, d, dtype=torch.bfloat16, device=device)  # [max_batch, Hq, D] format's form
        self.page_ids = torch.zeros(b, self.max_pages, **i32)  # [max_batch, max_pages]
        self.part_o = torch.empty(c + 1, hq, d, dtype=torch.float32, device=device)  # slot c: scratch
        self.part_lse = torch.empty(c + 1, hq, dtype=torch.float32, device=device)
        self.out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=device)  # [max_batch, Hq, D] head order
        self.lse = torch.empty(b, hq, dtype=torch.float32, device=device)  # [max_batch, Hq] natural log
        self.value_head_column = value_window_columns(geom, layout.format).to(**i32)
        self.tail_counters = torch.zeros(b, geom.num_kv_heads, **i32)  # the fused tail's (macros.TAIL_SOURCE)
        self._one = torch.ones(b, **i32)
        self._chunk_len_all, self._last_slot = self._view("chunk_len"), self._view("last_slot")
        self._lens = np.zeros(0, dtype=np.int64)  # host copy of the lengths planned ...
        self._advanced = 0  # ... and the advance() calls since
        self.chunks_used = 0  # chunks of the plan holding real work (the rest read one token into unmerged slots)

    # -- views of the packed device plan ------------------------------------------------------------------------
    def _view(self, name: str) -> torch.Tensor:
        at, n = self._offsets[name]
        return self._plan_dev[at:at + n]

    def __getattr__(self, name: str) -> torch.Tensor:  # ws.chunk_req, ws.group_count, ...
        offsets = self.__dict__.get("_offsets", {})
        if name in offsets:
            view = self._view(name)
            return view[:self.num_chunks] if name == "chunk_len" else view
        raise AttributeError(name)

    @property
    def batch(self) -> int:
        return len(self._lens)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """The lengths the device plan is for now (host ints)."""
        return tuple((self._lens + self._advanced).tolist())

    # -- planning --------------------------------------------------------------------------------------------------
    def plan(self, seq_lens: Sequence[int] | np.ndarray | torch.Tensor, page_ids: torch.Tensor | None = None) -> None:
        """Plan a step for requests of `seq_lens` tokens (host ints), copied to the device asynchronously; `page_ids`
        [batch, pages] int32 on the workspace's device, when given, is copied into `page_ids` on the current stream.
        Refusals write nothing."""
        lens = check_lens(seq_lens, max_batch=self.max_batch, max_len=self.max_len, holder="this workspace",
                          host_only=True)
        page = self.layout.page_size
        pages = -(-lens // page)
        if page_ids is not None:
            check_tensor("page_ids", page_ids, dtype=torch.int32, device=self.device)
            if page_ids.dim() != 2 or page_ids.shape[0] != len(lens):
                raise FoldKvInputError(f"page_ids must be [batch={len(lens)}, pages], got {list(page_ids.shape)}")
            if not int(pages.max()) <= page_ids.shape[1] <= self.max_pages:
                raise FoldKvInputError(f"page_ids holds {page_ids.shape[1]} pages per request: the lengths need"
                                       f" {int(pages.max())}, the workspace holds {self.max_pages}")
        # one wave: as the eager plan, chunks of one cap in request order (measured faster)
        cap = smallest_cap(pages, self.num_chunks) if self.one_wave else None
        pieces = fixed_count_pieces(pages, self.num_chunks) if cap is None else -(-pages // cap)
        arrays = chunk_layout(lens, pieces, page=page, merge_group=self.merge_group, fixed_pages=cap)
        used, batch = len(arrays["chunk_req"]), len(lens)

        slot = self._next
        self._next ^= 1
        if self._in_flight[slot]:
            self._staged[slot].synchronize()  # the copy of two plans ago: long done in steady state
        host = self._staging[slot]
        pads = {"chunk_len": 1, "group_first": self.num_chunks}  # (real entries, padding value) of each array
        fill = {name: (arrays[name], pads.get(name, 0)) for name in self._offsets if name != "last_slot"}
        # each request's last slot (advance() lengthens it); padding requests add to chunk_len's scratch entry
        last = np.empty(batch, dtype=np.int64)
        ends = np.append(np.flatnonzero(np.diff(arrays["chunk_req"])), used - 1)
        last[arrays["chunk_req"][ends]] = ends
        fill["last_slot"] = (last, self.num_chunks)
        view = host.numpy()
        for name, (values, pad) in fill.items():
            at, n = self._offsets[name]
            view[at:at + len(values)] = values
            view[at + len(values):at + n] = pad
        if self.device.type == "cuda":
            self._plan_dev.copy_(host, non_blocking=True)
            self._staged[slot].record()
            self._in_flight[slot] = True
        else:
            self._plan_dev.copy_(host)
        if page_ids is not None:
            self.page_ids[:batch, :page_ids.shape[1]].copy_(page_ids)
        self._lens, self._advanced, self._longest, self.chunks_used = lens, 0, int(lens.max()), used

    def advance(self) -> None:
        """Every request one token longer: one device operation, no host planning, no sync (the pieces stay as
        planned: plan again when a request joins or leaves, or every few dozen steps). The new tokens' rows and pages
        must be in the pool and `page_ids` before the next step."""
        if not self.batch:
            raise FoldKvInputError("advance() before plan(): the workspace holds no batch")
        if self._longest + self._advanced >= self.max_len:
            raise FoldKvInputError(f"advance() past max_len={self.max_len}")
        self._chunk_len_all.index_add_(0, self._last_slot, self._one)
        self._advanced += 1

    # -- the step --------------------------------------------------------------------------------------------------
    def check_pool(self, pool: PagedKvPool) -> None:
        """Refuse a pool the workspace was not made for (host-side checks only; no device read)."""
        check_decode_pool(pool)
        lay = pool.layout
        if (lay.geometry, lay.format, lay.page_size, lay.dtype) != (self.layout.geometry, self.layout.format,
                                                                    self.layout.page_size, self.layout.dtype):
            raise FoldKvInputError(f"the workspace was made for {self.layout.format.value} pages of"
                                   f" {self.layout.page_size} ({self.layout.dtype}), the pool holds"
                                   f" {lay.format.value} pages of {lay.page_size} ({lay.dtype}; or another geometry)")
        if pool.device != self.device and not (pool.device.type == self.device.type
                                               and self.device.index in (None, pool.device.index)):
            raise FoldKvInputError(f"the pool is on {pool.device}, the workspace on {self.device}")
        if self.device.type != "cuda":
            raise FoldKvInputError(f"the workspace is on {self.device}; decode runs on a CUDA device")

    def step(self, pool: PagedKvPool, *, backend: str = "jit", kernels: Mapping[str, Callable] | None = None,
             check: bool = True, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Launch a decode step over the workspace's plan, queries and block table (capturable: no allocation, no
        host sync). Returns `output()`."""
        if check:
            self.check_pool(pool)
            resolve.check_backend(backend)
            resolve.check_kernels(replaceable_kernels(pool.format, pool.layout.quantized, self.fp8_math), kernels)
            if not self.batch:
                raise FoldKvInputError("step() before plan(): the workspace holds no batch")
        launch_step(pool, self.query, self.page_ids, self, self.out, self.lse, fused=fused, backend=backend,
                    kernels=kernels, fp8_math=self.fp8_math)
        return self.output()

    def output(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last step's (out [batch, Hq, D] bf16 head order, lse [batch, Hq] float32 natural log): views."""
        return self.out[:self.batch], self.lse[:self.batch]

    def capture(self, pool: PagedKvPool, *, backend: str = "jit", kernels: Mapping[str, Callable] | None = None,
                warmup: int = 1, fused: bool | None = None) -> torch.cuda.CUDAGraph:
        """A CUDA graph of one `step` (checked and run eagerly `warmup` times first, on a side stream)."""
        self.step(pool, backend=backend, kernels=kernels, fused=fused)  # checks, builds the kernels
        graph, _, _ = capture_after_warmup(
            lambda: self.step(pool, backend=backend, kernels=kernels, check=False, fused=fused), self.device, warmup)
        return graph


def capture_after_warmup(run: Callable[[], Any], device: torch.device,
                         warmup: int = 1) -> tuple[torch.cuda.CUDAGraph, Any, Any]:
    """`run()` `warmup` times on a side stream of `device`, then captured there. Returns (the graph, the last warm-up's
    output or None, the captured call's output)."""
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    warm = None
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            warm = run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capture_graph(graph, stream=stream):
        captured = run()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph, warm, captured


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
    """`torch.cuda.graph(graph, stream=stream)` with Python's cyclic garbage collector paused until the capture ends:
    a collection inside a capture that destroys an unreachable CUDA graph (an earlier cache's, in a reference cycle)
    fails the capture. A capture that fails leaves the device's random generators usable (`end_generator_capture`)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, stream=stream):
            yield
    except BaseException:
        end_generator_capture(stream.device if stream is not None else None)
        raise
    finally:
        if enabled:
            gc.enable()


def end_generator_capture(device: torch.device | int | None = None) -> None:
    """After a failed capture: torch's `CUDAGraph.capture_end` raises before it takes the CUDA random generators out
    of capture mode, and every later random op on that device raises ("Offset increment outside graph capture
    encountered unexpectedly"); one small clean capture runs their epilogue. Best effort."""
    try:
        with torch.cuda.device(device):
            side = torch.cuda.Stream()
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                torch.empty(1, device=side.device).fill_(0)
    except Exception:  # noqa: BLE001 (the failed capture's own error is the one raised)
        pass


__all__ = ["DecodeWorkspace", "capture_after_warmup", "capture_graph", "default_num_chunks", "end_generator_capture",
           "CHUNKS_PER_REQUEST"]
