"""Fused decode whose tail merges with other (columns a thread, members a round trip) paths than the library's: fewer
members a round trip (less merge code, more trips), or one path for any member count.

Lab notebook (bench/DECODE_NOTES.md, run 16). Question: how much of the fused tail is instruction fetch? The
library's many-members merge (merge.py's online merge over all 33 members a round trip, unrolled) is ~15 KB of the
fused kernel's code, fetched cold by every SM. Arms (bench/fp8_harness.py `<fmt>_tail_<name>`, PATHS below): `p8` (8
members a trip), `p4` (4 a trip), `one33` (the library's many-members path for every count: a control of code layout).

Prediction and outcome in the notes: p8 0.4-1.2 us and p4 0.8-2.0 us slower than the library (each extra trip costs
~0.1-0.3 us net of the code it saves); one33 the library's speed where the executed code is the same, 3.3 us slower
on uniform8. Fewer members a trip is not the way.
"""

from __future__ import annotations

import dataclasses

from foldkv.config import AttentionGeometry
from foldkv.kernels.decode_partial import (TAIL_FEW_MEMBERS, FusedTail, TailContext, build_decode_fused,
                                           hand_off_macro, merge_tail, tail_slice_macro)
from foldkv.kernels.merge import _merge_partials_macro
from foldkv.layout import KvFormat

# name -> ((columns a thread, members a round trip) for at most TAIL_FEW_MEMBERS members, then for more), or one path
# for any count
PATHS = {"p8": ((4, 8), (2, 8)), "p4": ((4, 4), (2, 4)), "one33": ((2, 33),)}


def paths_tail(paths: tuple):
    """The served tail (`decode_partial.merge_tail`: its arguments and atomic hand-off) merging through `paths`."""
    if not 1 <= len(paths) <= 2:
        raise ValueError(f"paths={paths!r}: one (vec, trip) path for any member count, or the few-members one and the"
                         " many-members one")

    def make(ctx: TailContext) -> FusedTail:
        import tilelang.language as T

        hand_off = hand_off_macro(ctx)
        tail_slice = tail_slice_macro(ctx)
        merges = [_merge_partials_macro(vec, via_group_first=False, per_trip=trip) for vec, trip in paths]

        @T.macro
        def finish(tail, part_o, part_lse, scratch, req, kvh, c, members, at):
            hand_off(tail, req, kvh, c, members, at)
            if len(paths) == 1 or members <= TAIL_FEW_MEMBERS:  # (one path: a static condition, only its code)
                tail_slice(tail, part_o, part_lse, req, kvh, c, at["first"], members, *paths[0], merges[0])
            else:
                tail_slice(tail, part_o, part_lse, req, kvh, c, at["first"], members, *paths[1], merges[1])

        return dataclasses.replace(merge_tail(ctx), finish=finish)

    return make


def build(geom: AttentionGeometry, fmt: KvFormat | str, paths: str | tuple, **tiling):
    """Compile the fused step of `fmt` with the tail merging through `paths` (a name of PATHS, or the pairs) (the
    library's builder: the registered partial tiling, overridden by `tiling`, and the hand-off check); the library
    fused step's arguments."""
    return build_decode_fused(geom, fmt, tail=paths_tail(PATHS.get(paths, paths)), **tiling)
