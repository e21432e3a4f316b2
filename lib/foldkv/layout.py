"""Page formats and column maps: which head columns a page row stores, in which order, and how to undo it.

A split row is [K (head order, D) | V (head order, D)]. A folded row is [K_rot (R) | V_unrot (D-R) | V_rot (R)], so the
score operand is row[0:D] (matched by the folded query [q_rot | q_unrot * w_k]) and the value operand is row[R:R+D],
whose output comes back in "value-window order" and is put back in head order by `value_window_to_head`.
"""

from __future__ import annotations

import enum

import torch

from .config import AttentionGeometry


class KvFormat(str, enum.Enum):
    """What a page row stores; fixed for a pool's life."""

    SPLIT = "split"
    FOLDED = "folded"

    @classmethod
    def parse(cls, value: "KvFormat | str") -> "KvFormat":
        if isinstance(value, KvFormat):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown KV format {value!r}: expected one of {[f.value for f in cls]}") from None


def rotated_columns(geom: AttentionGeometry) -> torch.Tensor:
    """Head columns proportional RoPE rotates, ascending: [0, R/2) and [D/2, D/2 + R/2) (128 of 512 for the 31B).
    [R] int64 on the CPU, as are all the column maps here."""
    half, pairs = geom.head_dim // 2, geom.rotary_pairs
    return torch.cat([torch.arange(pairs), torch.arange(half, half + pairs)])


def unrotated_columns(geom: AttentionGeometry) -> torch.Tensor:
    """Head columns RoPE leaves as they are (zero frequency), ascending: there K == V * w_k exactly. [D - R] int64."""
    mask = torch.ones(geom.head_dim, dtype=torch.bool)
    mask[rotated_columns(geom)] = False
    return torch.nonzero(mask).flatten()


def row_width(geom: AttentionGeometry, fmt: KvFormat | str) -> int:
    """Columns per token per KV head: 2D for split (1024), D + R for folded (640)."""
    fmt = KvFormat.parse(fmt)
    return 2 * geom.head_dim if fmt is KvFormat.SPLIT else geom.head_dim + geom.rotary_width


def score_window(geom: AttentionGeometry, fmt: KvFormat | str) -> slice:
    """Row columns the score (q.K) reads: a D-wide contiguous window."""
    return slice(0, geom.head_dim)


def value_window(geom: AttentionGeometry, fmt: KvFormat | str) -> slice:
    """Row columns the value (P.V) reads: a D-wide contiguous window."""
    fmt = KvFormat.parse(fmt)
    start = geom.head_dim if fmt is KvFormat.SPLIT else geom.rotary_width
    return slice(start, start + geom.head_dim)


def value_window_columns(geom: AttentionGeometry, fmt: KvFormat | str) -> torch.Tensor:
    """Head column at each position of the value window (identity for split; unrot then rot for folded): [D] int64."""
    if KvFormat.parse(fmt) is KvFormat.SPLIT:
        return torch.arange(geom.head_dim)
    return torch.cat([unrotated_columns(geom), rotated_columns(geom)])


def score_window_columns(geom: AttentionGeometry, fmt: KvFormat | str) -> torch.Tensor:
    """Head column at each position of the score window (identity for split; rot then unrot for folded): [D] int64."""
    if KvFormat.parse(fmt) is KvFormat.SPLIT:
        return torch.arange(geom.head_dim)
    return torch.cat([rotated_columns(geom), unrotated_columns(geom)])


def value_window_to_head(geom: AttentionGeometry, fmt: KvFormat | str) -> torch.Tensor:
    """Index `inv` [D] int64 with out_head = out_window[..., inv]: the inverse of `value_window_columns`."""
    cols = value_window_columns(geom, fmt)
    inv = torch.empty_like(cols)
    inv[cols] = torch.arange(cols.numel())
    return inv
