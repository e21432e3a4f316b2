"""Fused decode with the tail's partials as self-validating words (run 14's LL protocol), its merge made small: one
column a round, rolled, the words of every member in registers, the output stored once a column.

Lab notebook (bench/DECODE_NOTES.md, run 21). Question: run 14's LL step (no release, no atomic, no signal: a word
carries its own validity) was 21-36 us slower than the library's atomic hand-off, and run 15 put the loss in cold
instruction fetch (43.6% of its warps' stall cycles; 226 KB of `.text` against the library fused kernel's 104 KB):
`foldkv_ll_merge` unrolled four walks of 34 words, each carrying the output store and the polls' inner spin. Run 17
showed the library's own tail is memory trips, not code. So: is the LL protocol's shorter chain worth its trips once
its code is the size of the library's merge?

The merge here (`source(wait)`, the same two functions decode_fused_ll.ll_tail calls): a rolled
loop over the member's columns (one column a thread a round: 4,096 / n columns, <= 128 for n >= 32); in a round the
thread loads the column's word from every member at once (unrolled over TAIL_MAX_MEMBERS, predicated: ~5 instructions a
word), re-loads every word still empty until none is (one pass: one trip to L2, all loads in flight), takes the maximum
LSE, the weighted sum, puts the empty mark back, and stores the output once. A word is valid only when neither half is
the empty mark: a word is empty between launches, so a read torn between the old and the new word shows one empty half
and is read again (no assumption that an 8-byte load is single-copy atomic). The store side maps a value or an LSE whose
bits are the mark to another NaN.

Prediction (before the run): the kernel's `.text` ~104 KB of the library's fused kernel less its ~15 KB merge plus
~10 KB here; the tail over the partial alone ~4.0 -> ~2.5-3.0 us (after the last member's stores: their trip to L2
and the readers' next pass, ~2 trips, against the atomic hand-off's release, atomic, poll and loads, ~4): folded
40,002 ~56.6 -> ~55.0-55.5 us (1.12-1.13x the plain read: issue 14's 1.15x met), 10,602 ~23.0 -> ~21.5-22 (~1.45x:
still out), 131,072 ~1.03x; uniform8 within ~1 us (its step waits for its longest partials either way); split the
same. If it is instead >= 1 us slower than the library, the readers' passes (33 CTAs x 128 threads x 33 words a
trip) crowd L2 while the last members stream.

Outcome (run 21, bench/DECODE_NOTES.md): the merge came to 21 KB (the kernel's `.text` 124 KB), and the step is
3.6-9 us slower than the library's at single requests; readers backing off between passes (`WAITS`, run 21b) take back
up to a third of it, not the rest. Not adopted.
"""

from __future__ import annotations

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import TAIL_MAX_MEMBERS
from foldkv.layout import KvFormat

from versions import decode_fused_ll  # bench/versions/

SOURCE_TEMPLATE = r"""
#include <cuda_bf16.h>
// One partial element at word `at` (chunk slot x Hq x D): its normalised output and its head's base-2 LSE. A half whose
// bits are the empty mark is stored as another NaN. (`words` arrives const: TileLang sees the kernel write it nowhere
// else.)
__device__ __forceinline__ void foldkv_ll_store(const float* words, long long at, float value, float lse) {
  unsigned v = __float_as_uint(value), l = __float_as_uint(lse);
  if (v == %(empty)du) v = 0x7FFFFFFFu;
  if (l == %(empty)du) l = 0x7FFFFFFFu;
  const unsigned long long w = ((unsigned long long)l << 32) | v;
  unsigned long long* p = reinterpret_cast<unsigned long long*>(const_cast<float*>(words)) + at;
  asm volatile("st.relaxed.gpu.global.b64 [%%0], %%1;" : : "l"(p), "l"(w) : "memory");
}
// valid only when neither half is the mark: a read torn between the empty word and the new one is read again
__device__ __forceinline__ bool foldkv_ll_empty(unsigned long long w) {
  return (unsigned)w == %(empty)du || (unsigned)(w >> 32) == %(empty)du;
}
// Member `member` of the request-head's `members` chunk slots [first, first + members) merges columns
// [member, member + 1) x (group x d) / members of its group x d into `out` (bf16, head order through
// value_head_column) and `lse` (natural log): thread `tid` of `threads` takes columns lo + tid + k x threads, one a
// round, the column's word of every member in registers. The words of a column are STRIDE apart (Hq x D of the 31B,
// a constant: each load is the column's address plus an immediate, not an address computed a word); the loads are
// volatile (a plain global load the compiler may neither cache nor merge), so no inline asm fences the addresses.
__device__ __noinline__ void foldkv_ll_merge(const float* words, int first, int members, int member, int req,
                                                int kvh, int hq, int d, int group, const int* value_head_column,
                                                const void* out, const float* lse, int tid, int threads) {
  constexpr int W = %(max_members)d;
  constexpr long long STRIDE = %(stride)d;
  if (members > W || (long long)hq * d != STRIDE) __trap();
  const unsigned long long empty = ((unsigned long long)%(empty)du << 32) | %(empty)du;
  volatile unsigned long long* base = reinterpret_cast<volatile unsigned long long*>(const_cast<float*>(words)) +
                                      ((long long)first * hq + kvh * group) * d;
  __nv_bfloat16* out_bf16 = reinterpret_cast<__nv_bfloat16*>(const_cast<void*>(out));
  float* lse_out = const_cast<float*>(lse);
  const int cols = group * d;
  const int lo = (int)((long long)member * cols / members);
  const int hi = (int)((long long)(member + 1) * cols / members);
  for (int col = lo + tid; col < hi; col += threads) {
    volatile unsigned long long* at = base + col;
    unsigned long long w[W];
#pragma unroll
    for (int s = 0; s < W; ++s) w[s] = empty;
    // a pass loads every word still empty, all in flight at once, until none is%(wait_comment)s
    const unsigned lanes = __activemask();  // the lanes with a column this round
    for (long long polls = 0;; ++polls) {
      volatile unsigned long long* waiting = nullptr;
#pragma unroll
      for (int s = 0; s < W; ++s)
        if (s < members && foldkv_ll_empty(w[s])) {
          waiting = at + s * STRIDE;
          w[s] = *waiting;
        }
      if (%(done)s) break;
      if (polls == (1LL << 22)) __trap();%(wait)s
    }
    float mx = -__int_as_float(0x7f800000);
#pragma unroll
    for (int s = 0; s < W; ++s)
      if (s < members) mx = fmaxf(mx, __uint_as_float((unsigned)(w[s] >> 32)));
    float sum = 0.f, acc = 0.f;
#pragma unroll
    for (int s = 0; s < W; ++s)
      if (s < members) {
        const float t = exp2f(__uint_as_float((unsigned)(w[s] >> 32)) - mx);
        sum += t;
        acc += t * __uint_as_float((unsigned)w[s]);
        at[s * STRIDE] = empty;
      }
    const int h = kvh * group + col / d, p = col %% d;
    out_bf16[((long long)req * hq + h) * d + value_head_column[p]] = __float2bfloat16_rn(acc / sum);
    if (p == 0) lse_out[(long long)req * hq + h] = (log2f(sum) + mx) * %(ln2).17gf;
  }
}
"""
# the readers' wait between passes (run 21b: 33 words a thread a trip from every waiting CTA may crowd L2 while the last
# members stream), as (its comment in the source, its code): none (every empty word re-loaded each trip); "spin", one
# load a thread at a time on the pass's last empty word, with a back-off; "spin_warp", one load a warp at a time (a warp
# leaves the passes together, by its lanes' vote, so its spinning lane is never alone)
WAITS = {None: ("", ""),
         "spin": ("; between passes a thread spins on its\n    // last empty word alone (one load at a time, backing"
                  " off)",
                  """
      long long spins = 0;
      while (foldkv_ll_empty(*waiting)) {
        if (++spins == (1LL << 22)) __trap();
        __nanosleep(64);
      }"""),
         "spin_warp": ("; between passes one lane of a warp spins\n    // on its last empty word alone (one load a warp"
                       " at a time, backing off), then the warp passes again",
                       """
      const unsigned pending = __ballot_sync(lanes, waiting != nullptr);
      if ((threadIdx.x & 31) == __ffs(pending) - 1) {
        long long spins = 0;
        while (foldkv_ll_empty(*waiting)) {
          if (++spins == (1LL << 22)) __trap();
          __nanosleep(64);
        }
      }
      __syncwarp(lanes);""")}


def source(wait: str | None = None) -> str:
    """The device code of the two LL functions, with `wait` (WAITS) between the readers' passes."""
    comment, code = WAITS[wait]
    return SOURCE_TEMPLATE % {"empty": decode_fused_ll.LL_EMPTY, "max_members": TAIL_MAX_MEMBERS, "ln2": macros.LN2,
                              "stride": GEMMA4_31B.num_q_heads * GEMMA4_31B.head_dim, "wait": code,
                              "done": "!__any_sync(lanes, waiting != nullptr)" if wait == "spin_warp" else "!waiting",
                              "wait_comment": comment}



def build(geom: AttentionGeometry, fmt: KvFormat | str, wait: str | None = None, **tiling):
    """Compile the compact LL fused kernel of `fmt` (decode_fused_ll.build with this file's source(wait))."""
    return decode_fused_ll.build(geom, fmt, source=source(wait), **tiling)


class CompactLLStep(decode_fused_ll.LLStep):
    """decode_fused_ll.LLStep with this file's merge: the library fused step's arguments, one empty word buffer per
    chunk count."""

    def __init__(self, geom: AttentionGeometry, fmt: KvFormat | str, wait: str | None = None, **tiling):
        super().__init__(geom, fmt, source=source(wait), **tiling)
