"""TileLang parts shared by the kernels, each `*_macro` a `@T.macro` for the given constants.

Macro arguments are buffers or Python values: a TIR variable passed to a macro is renamed after the macro's parameter,
which would change the emitted CUDA, so a condition that reads the caller's variables comes in as a Python function of
the tile's indices instead.
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

import math
from dataclasses import dataclass
from typing import Any

LOG2E = math.log2(math.e)  # Gemma 4 global attention has scaling 1.0, so exp(s) = exp2(s * log2 e)
LN2 = math.log(2.0)


def online_softmax_macro(key_dim: int, *, scale: float = LOG2E, fold_scale: bool = False, reduce_batch: int = 1,
                         max_slack_log2: float | None = None):
    """One key tile of the online softmax in the exp2 domain, keys along `key_dim` of `scores` (0: S^T, the decode
    partial; 1: S, the prefill): the running max and denominator are updated, `rescale` gets the output's factor and
    the probabilities go to `p_shared` (None: left in `scores`), times `key_weight(key)` when given (after the sums).

    fold_scale: exp2(s * scale - max * scale), one FMA per score. reduce_batch: a thread's queries each cross-thread
    reduction carries at once (one barrier chain). max_slack_log2: the running max stands until the tile's passes it
    by more than this, so `rescale` is exactly 1 on most tiles (PREFILL_SCHEDULE.md, "The lazy max")."""
    import tilelang.language as T

    slack = None if max_slack_log2 is None else max_slack_log2 / scale  # in score units

    def query_of(i, j):  # which running max a score [i, j] is normalised by
        return j if key_dim == 0 else i

    @T.macro
    def online_softmax(scores, p_shared, run_max, run_max_prev, rescale, tile_sum, denom, key_weight=None):
        rows, cols = scores.shape
        T.copy(run_max, run_max_prev)
        T.reduce_max(scores, run_max, dim=key_dim, clear=False, batch=reduce_batch)
        for q in T.Parallel(run_max.shape[0]):
            if slack is not None:  # the first tile always moves it: run_max_prev is -inf there
                run_max[q] = T.if_then_else(run_max[q] - run_max_prev[q] > slack, run_max[q], run_max_prev[q])
            rescale[q] = T.exp2((run_max_prev[q] - run_max[q]) * scale)
        for i, j in T.Parallel(rows, cols):
            if fold_scale:
                scores[i, j] = T.exp2(scores[i, j] * scale - run_max[query_of(i, j)] * scale)
            else:
                scores[i, j] = T.exp2((scores[i, j] - run_max[query_of(i, j)]) * scale)
        T.reduce_sum(scores, tile_sum, dim=key_dim, batch=reduce_batch)
        for q in T.Parallel(run_max.shape[0]):
            denom[q] = denom[q] * rescale[q] + tile_sum[q]
        if key_weight is not None:  # P's column of key i times key_weight(i), after the sums (an FP8 row's scale)
            for i, j in T.Parallel(rows, cols):
                scores[i, j] *= key_weight(i if key_dim == 0 else j)
        if p_shared is not None:  # None: the caller stores P itself (another layout or dtype)
            T.copy(scores, p_shared)

    return online_softmax


def share_sm_registers_macro(ctas_per_sm: int, consumer_threads: int):
    """In a warp-specialised T.Kernel: let `ctas_per_sm` (> 1) CTAs share an SM's 65,536 registers, the producer
    warpgroup keeping 24 a thread after setmaxnreg, the `consumer_threads` the rest (at most 240)."""
    import tilelang.language as T

    per_thread = 65536 // ctas_per_sm // (consumer_threads + 128)
    consumer = (per_thread * (consumer_threads + 128) - 24 * 128) // consumer_threads // 8 * 8

    @T.macro
    def share_sm_registers():
        T.annotate_min_blocks_per_sm(ctas_per_sm)
        T.annotate_producer_reg_dealloc(24)
        T.annotate_consumer_reg_alloc(min(consumer, 240))

    return share_sm_registers


def tile_page(page_ids, req, tok, page_size: int):
    """(page, offset in it) of token `tok` of request `req`: expressions for a kernel's tile loads."""
    return page_ids[req, tok // page_size], tok % page_size


def mask_scores_macro():
    """Scores whose `keep(i, j)` is false become -inf (probability 0): keys past the sequence, or after the query."""
    import tilelang.language as T

    @T.macro
    def mask_scores(scores, keep):
        rows, cols = scores.shape
        for i, j in T.Parallel(rows, cols):
            scores[i, j] = T.if_then_else(keep(i, j), scores[i, j], -T.infinity("float32"))

    return mask_scores


def zero_rows_macro():
    """Rows of a shared key tile whose `keep(row)` is false become 0: slots past the sequence hold arbitrary bits and
    0 x NaN is NaN in P.V. A read-modify-write, so that the warp-specialised pipeline waits for the tile's TMA."""
    import tilelang.language as T

    @T.macro
    def zero_rows(tile, keep):
        rows, cols = tile.shape
        for i, j in T.Parallel(rows, cols):
            tile[i, j] = T.if_then_else(keep(i), tile[i, j], T.cast(0, tile.dtype))

    return zero_rows


def load_group_query_macro(group: int, block_h: int):
    """Decode: the KV head's `group` query heads into padded [block_h, cols] shared tiles, one TMA copy per piece
    of the score window. Rows >= group are the next KV head's (never stored): one TMA of block_h rows lets the
    producer's first pool load start without waiting for the query."""
    import tilelang.language as T

    @T.macro
    def load_query(query, req, kvh, pieces):
        for piece in pieces:
            T.copy(query[req, kvh * group:kvh * group + block_h, piece.lo:piece.hi], piece.tile)

    return load_query


# e4m3 -> bf16 by integer ops and one bf16x2 multiply, 8 values a call (DECODE_SCHEDULE.md, "The exact FP8 partial"):
# exact for every finite code, subnormals too (mul.bf16x2 has no flush-to-zero); the NaN codes would come out as +-480,
# which a pool never holds (foldkv.fp8 clamps to +-448 and refuses non-finite rows).
E4M3_TO_BF16_FN = "foldkv_e4m3x8_to_bf16"
E4M3_TO_BF16_SOURCE = r"""
// (inserted before the kernel's includes: plain CUDA types and PTX only)
__device__ __forceinline__ void foldkv_e4m3x8_to_bf16_one(const void* src, void* dst) {
  const uint2 in = *reinterpret_cast<const uint2*>(src);
  const unsigned int words[2] = {in.x, in.y};
  unsigned int out[4];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // bytes (b0, b1) (h = 0) or (b2, b3) (h = 1) into the high bytes of the two 16-bit halves
      const unsigned int x = __byte_perm(words[w], 0u, h ? 0x3424u : 0x1404u);
      const unsigned int bits = (x & 0x80008000u) | ((x >> 4) & 0x07F007F0u);
      asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(out[2 * w + h]) : "r"(bits), "r"(0x7B807B80u));
    }
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
}

// A thread's share of one panel (runs of 8 values: (source, destination) pointer pairs) in one call. The calls are
// opaque to TileLang, which therefore places no barrier or proxy fence for the tiles they write; the calls do it
// themselves, on their own named barrier over the converting threads: `first` waits until every thread is past the
// previous tile's gemms (they read the tiles about to be overwritten); `last` makes this thread's writes visible to
// the tensor cores' (async) proxy and waits until every thread has written, before the gemms read the tiles.
__device__ __forceinline__ void foldkv_e4m3_runs() {}
template <typename S, typename D, typename... Rest>
__device__ __forceinline__ void foldkv_e4m3_runs(S src, D dst, Rest... rest) {
  foldkv_e4m3x8_to_bf16_one(src, dst);
  foldkv_e4m3_runs(rest...);
}
template <typename... Pointers>
__device__ __forceinline__ void foldkv_e4m3x8_to_bf16(int first, int last, int barrier_id, int threads,
                                                      Pointers... pointers) {
  if (first) asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
  foldkv_e4m3_runs(pointers...);
  if (last) {
    asm volatile("fence.proxy.async.shared::cta;" : : : "memory");
    asm volatile("bar.sync %0, %1;" : : "r"(barrier_id), "r"(threads) : "memory");
  }
}
"""


# The hand-off of the fused decode's tail (decode_partial.merge_tail; its count, poll and trap: DECODE_SCHEDULE.md, "The
# fused step"): the leader's acquire, then the barrier, orders the consumers' reads (CUTLASS's semaphore pattern).
TAIL_STEP = 1 << 20  # > TAIL_MAX_MEMBERS, and a power of two: its multiples stay multiples modulo 2^32
TAIL_HAND_OFF_FN = "foldkv_tail_hand_off"
TAIL_SOURCE = r"""
// Called by every consumer thread once its share of the partial is stored; `member` is this CTA's place among the
// request-head's `members` chunks, `leader` the first consumer thread.
// (`counters` arrives const: TileLang sees the kernel write it nowhere else)
__device__ __forceinline__ void foldkv_tail_hand_off(const int* counters, int pair, int member, int members,
                                                     int leader, int barrier_id, int threads) {
  const unsigned step = %(step)du;
  unsigned* counter = reinterpret_cast<unsigned*>(const_cast<int*>(counters)) + pair;
  asm volatile("bar.sync %%0, %%1;" : : "r"(barrier_id), "r"(threads) : "memory");
  if ((int)threadIdx.x == leader) {
    const unsigned share = member == 0 ? step - (unsigned)(members - 1) : 1u;
    unsigned before;  // releases this CTA's partial (its threads' stores are ordered before the barrier)
    asm volatile("atom.add.acq_rel.gpu.global.u32 %%0, [%%1], %%2;" : "=r"(before) : "l"(counter), "r"(share)
                 : "memory");
    const unsigned done = (before & ~(step - 1u)) + step;
    if (before + share != done) {  // not the last member: wait for the others
      long long polls = 0;
      unsigned now;
      asm volatile("ld.acquire.gpu.global.u32 %%0, [%%1];" : "=r"(now) : "l"(counter) : "memory");
      while (now != done) {
        if (++polls == (1LL << 22)) __trap();
        __nanosleep(32);
        asm volatile("ld.acquire.gpu.global.u32 %%0, [%%1];" : "=r"(now) : "l"(counter) : "memory");
      }
    }
  }
  asm volatile("bar.sync %%0, %%1;" : : "r"(barrier_id), "r"(threads) : "memory");
}
""" % {"step": TAIL_STEP}


# Named barriers over the consumer threads only, ids nothing else uses (0 is __syncthreads, TileLang's pipelines use
# low ids): the tail's, and the conversion's (E4M3_TO_BF16_SOURCE; an FP8 kernel has both)
TAIL_BARRIER_ID = 8
CONVERT_BARRIER_ID = 7


@dataclass(frozen=True)
class Convert:
    """An e4m3 panel and the bf16 tile (from column `col`) it is converted into. Not a tuple: a loop bound to buffers
    would rename them after its variables, in no fixed order."""
    stored: Any
    tile: Any
    col: int


def convert_e4m3_macro(rows: int, cols: int, threads: int):
    """A tile's Converts (in load order), exactly, by `threads` threads; the first and the last panel's calls carry
    the barriers TileLang would otherwise place (DECODE_SCHEDULE.md, "Release and barriers")."""
    import tilelang.language as T

    runs_per_row = cols // 8
    per_thread = rows * runs_per_row // threads
    assert cols % 8 == 0 and rows % per_thread == 0 and per_thread * threads == rows * runs_per_row
    step = rows // per_thread  # a thread's runs are `step` rows apart

    @T.macro
    def convert_panel(stored, tile, col, first, last):
        for i, j in T.Parallel(step, runs_per_row):
            T.call_extern("handle", E4M3_TO_BF16_FN, int(first), int(last), CONVERT_BARRIER_ID, threads,
                          *[p for r in range(per_thread)  # (source, destination) of each run, as a list: a loop here
                            for p in (T.address_of(stored[i + r * step, j * 8]),  # would be a TIR loop
                                      T.address_of(tile[i + r * step, col + j * 8]))])

    @T.macro
    def convert_e4m3(converts):
        for n, conv in enumerate(converts):
            convert_panel(conv.stored, conv.tile, conv.col, n == 0, n == len(converts) - 1)

    return convert_e4m3

