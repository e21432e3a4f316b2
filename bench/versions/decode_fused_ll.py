"""Fused decode with the tail's partials as self-validating words (NCCL's LL protocol inside one GPU): no counter, no
fence, no poll of a signal.

Lab notebook (bench/DECODE_NOTES.md, run 14). Question: run 13 took the fused tail's hand-off down to one atomic and
the tail over the partial alone went from ~5.0 to ~4.0 us; what is left is a chain of dependent trips to L2: the
release (the leader's atomic waits for the 16 KB partial's stores to be acknowledged), the atomic's own trip, the
waiters' poll, then the loads of the members' partials. Here each member stores its partial as 8-byte words {o, lse}
(`macros.LL_TAIL_SOURCE`: one single-copy-atomic store a word) and each word's one reader (the member whose slice holds
the column) polls the word itself until it is not the empty mark, merges, and empties it; between launches every
word is empty. So after the last member's stores, the chain is their trip to L2 and the readers' next poll: no
release, no atomic, no signal. `decode_partial_program(tail_merge=True, tail_protocol="ll")`: the library's fused
program with its other tail (the partial, the loop and the epilogue are the same code).

Prediction (before the run): the tail over the partial alone ~4.0 -> ~2.3-2.8 us (off the chain: the release's wait
for the acknowledgements, ~0.7-1 us, and the atomic's trip, ~0.6; the polls now load the data itself), so every
multi-chunk fused step ~1.2-1.7 us less than the library's (run 13): folded 10,602 ~23.2 -> ~21.7 (1.49x the read),
40,002 ~56.2 -> ~54.7 (1.13x: inside the 1.15x target), 131,072 ~157.2 -> ~155.7 (1.03x); split the same; uniform8
~1 us. Risk: the readers' polls (33 CTAs x 128 threads x 33 words a round) share L2 with the last members' streams.

The kernel's arguments differ from the library's fused step (part_ll [C, Hq, D, 2] f32 in place of part_o,
part_lse and the counters), so `LLStep` adapts: it takes the library's arguments (what `kernels=` passes) and keeps
one empty word buffer per chunk count.
"""

from __future__ import annotations

import torch

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import DEFAULTS, decode_partial_program
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat


def probe_source(probe: str | None) -> str:
    """macros.LL_TAIL_SOURCE, or a timing probe of it: "inline" (the merge inlined into the kernel, which spills
    there), "no_wait" (each word read once, never polled: wrong output whenever a reader is early)."""
    src = macros.LL_TAIL_SOURCE
    if probe == "inline":
        out = src.replace("__device__ __noinline__ void foldkv_ll_merge(", "__device__ __forceinline__ void foldkv_ll_merge(")
    elif probe == "no_wait":
        out = src.replace("      if (!waiting) break;", "      break;")
    else:
        return src
    assert out != src
    return out


def build(geom: AttentionGeometry, fmt: KvFormat | str, probe: str | None = None, **tiling):
    """Compile the LL fused kernel of `fmt` with the format's registered partial tiling, overridden by `tiling`
    (`probe`: probe_source's). Arguments: (query, pool, page_ids, chunk_req, chunk_start, chunk_len, merge_first,
    merge_count, part_ll, value_head_column, out, lse)."""
    tilelang = require_tilelang()
    fmt = KvFormat.parse(fmt)
    cfg = {**DEFAULTS[fmt], **tiling}
    return tilelang.compile(decode_partial_program(geom, fmt, tail_merge=True, tail_protocol="ll",
                                                   tail_source=probe_source(probe), **cfg),
                            target=target(), pass_configs=pass_configs())


def empty_words(num_chunks: int, geom: AttentionGeometry, device) -> torch.Tensor:
    """A word buffer [C, Hq, D, 2] float32 with every word empty (both halves macros.LL_EMPTY)."""
    return torch.full((num_chunks, geom.num_q_heads, geom.head_dim, 2), macros.LL_EMPTY - (1 << 32),
                      dtype=torch.int32, device=device).view(torch.float32)


class LLStep:
    """The LL fused kernel behind the library fused step's argument list (decode.launch_step's): part_o, part_lse
    and the counters are ignored, a word buffer per (chunk count, device) is made on first use (outside any capture:
    the harness checks each arm eagerly before it captures) and stays empty between launches."""

    def __init__(self, geom: AttentionGeometry, fmt: KvFormat | str, probe: str | None = None, **tiling):
        self.geom, self.kernel = geom, build(geom, fmt, probe, **tiling)
        self.words: dict[tuple, torch.Tensor] = {}

    def __call__(self, query, pool, page_ids, chunk_req, chunk_start, chunk_len, merge_first, merge_count, part_o,
                 part_lse, counters, value_head_column, out, lse):
        key = (chunk_req.shape[0], query.device)
        if key not in self.words:
            self.words[key] = empty_words(chunk_req.shape[0], self.geom, query.device)
        self.kernel(query, pool, page_ids, chunk_req, chunk_start, chunk_len, merge_first, merge_count,
                    self.words[key], value_head_column, out, lse)
