"""The bench's two leaf helpers: the time of one callable (CUDA events, or the host clock) and the one-line record of an
exception. Imports nothing of the bench."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable

import torch


def time_events(fn: Callable[[], Any], reps: int, warmup: int, cuda: bool = True) -> list[float]:
    """µs per call of fn, one sample per call: CUDA events, or the host clock when `cuda` is False."""
    for _ in range(warmup):
        fn()
    if not cuda:
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 for a, b in ev]


def err_text(exc: BaseException) -> str:
    """An exception as recorded: its type, text and the place it was raised."""
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {str(exc)[:400]}{where}"
