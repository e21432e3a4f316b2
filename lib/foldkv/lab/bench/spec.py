"""What an arm is: `ArmSpec` (a named arm and the builder that makes it for a case) and `ArmImpl` (the built arm the
harness checks and times), with the guard value past every output. At run time it imports nothing else of the bench:
every module that builds or times arms imports this one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

GUARD_VALUE = 7.0  # sentinel in the row past each output: a kernel writing past its plan changes it


@dataclass
class ArmImpl:
    """A built arm: `calls[c]()` runs one step on input copy c and writes `out` (head order, [tokens, Hq, D]).

    `graph` says whether the harness should try to capture the calls in a CUDA graph (it still falls back to eager
    timing, recording why, when the capture fails); `why_eager` is the reason when the builder already knows it cannot.
    `timed_calls`, when given, are what is timed (captured or looped): the same steps without the per-call input
    checks that read device memory back to the host (`calls`, checked, run first and are what the accuracy check
    uses). `info` is recorded with the results (plain values); `lse` is poisoned and must be written like `out`;
    `guards` are views that must still hold GUARD_VALUE after a call; `keep` holds objects the calls need alive.
    `check`, for an arm whose output is not attention (a kernel part alone, a streaming read), replaces the
    comparison with the reference: it poisons, runs copy 0 and returns {"ok": bool, ...}. `reference_kind` names the
    pool the reference reads ("split": the bf16 truth; an FP8 arm is held to its own dequantized pool).
    """

    calls: list[Callable[[], Any]]
    out: torch.Tensor
    graph: bool = True
    why_eager: str = ""
    info: dict = field(default_factory=dict)
    timed_calls: list[Callable[[], Any]] | None = None
    lse: torch.Tensor | None = None
    guards: list[torch.Tensor] = field(default_factory=list)
    keep: Any = None
    check: Callable[[], dict] | None = None
    reference_kind: str = "split"  # which float64 reference the check uses (`AttentionCase.reference`)


@dataclass(frozen=True)
class ArmSpec:
    """A named arm: what it is, which pool format its bytes are counted in, whether it is a peer (what a user would
    pick instead of foldkv), whether it runs without CUDA and whether it is one of foldkv's generated kernels."""

    name: str
    label: str
    format: str  # split | folded
    peer: bool
    build: Callable[["AttentionCase"], ArmImpl]
    cpu_ok: bool = False
    generated: bool = False
