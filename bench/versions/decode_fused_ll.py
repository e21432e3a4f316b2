"""Fused decode with the tail's partials as self-validating words (NCCL's LL protocol inside one GPU): no counter, no
fence, no poll of a signal.

Lab notebook (bench/DECODE_NOTES.md, run 14). Question: run 13 took the fused tail's hand-off down to one atomic and
the tail over the partial alone went from ~5.0 to ~4.0 us; what is left is a chain of dependent trips to L2: the
release (the leader's atomic waits for the 16 KB partial's stores to be acknowledged), the atomic's own trip, the
waiters' poll, then the loads of the members' partials. Here each member stores its partial as 8-byte words {o, lse}
(`LL_TAIL_SOURCE` below: one single-copy-atomic store a word) and each word's one reader (the member whose slice holds
the column) polls the word itself until it is not the empty mark, merges, and empties it; between launches every
word is empty. So after the last member's stores, the chain is their trip to L2 and the readers' next poll: no
release, no atomic, no signal. `ll_tail` below is this hand-off as a `FusedTail` (the hook points of the library's
`decode_partial_program`): the library's fused program with this tail (the partial, the loop and the epilogue are
the same code).

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
from foldkv.kernels.decode_partial import DEFAULTS, FusedTail, TailContext, decode_partial_program, tail_args
from foldkv.kernels.tl import pass_configs, require_tilelang, target
from foldkv.layout import KvFormat

# The fused tail's other hand-off (`ll_tail`): no counter, no fence. Each member
# writes its partial as 8-byte words {o, lse} (one store each, single-copy atomic), and the word's reader (exactly one:
# the member whose slice holds that column) spins on it until it is not the empty mark, merges, and puts the mark back;
# so between launches every word is empty (the buffer starts so), and a word is valid exactly when this launch's
# writer stored it. The data carries its own validity (NCCL's LL protocol within one GPU): the chain after the last
# member's stores is their trip to L2 and the readers' next poll.
LL_STORE_FN = "foldkv_ll_store"  # the two device functions of a source (LL_TAIL_SOURCE's) the kernel calls
LL_MERGE_FN = "foldkv_ll_merge"
LL_EMPTY = 0xFFFFFFFF  # the empty mark, in each half of a word; a partial value with these bits is stored as another NaN
LL_MAX_WORDS = 34  # words a reader thread holds at once: (4096 / n / 128 + 1) x n <= 62 for the 31B's n <= 33
LL_TAIL_SOURCE = r"""
#include <cuda_bf16.h>
// One partial element of chunk slot `at` / (Hq x D): its normalised output and its head's base-2 LSE, as one word.
// (`words` arrives const: TileLang sees the kernel write it nowhere else)
__device__ __forceinline__ void foldkv_ll_store(const float* words, long long at, float value, float lse) {
  unsigned v = __float_as_uint(value);
  if (v == %(empty)du) v = 0x7FFFFFFFu;  // a NaN stays a NaN, and is not the empty mark
  const unsigned long long w = ((unsigned long long)__float_as_uint(lse) << 32) | v;
  unsigned long long* p = reinterpret_cast<unsigned long long*>(const_cast<float*>(words)) + at;
  asm volatile("st.relaxed.gpu.global.b64 [%%0], %%1;" : : "l"(p), "l"(w) : "memory");
}
__device__ __forceinline__ unsigned long long foldkv_ll_load(const unsigned long long* p) {
  unsigned long long w;
  asm volatile("ld.relaxed.gpu.global.b64 %%0, [%%1];" : "=l"(w) : "l"(p) : "memory");
  return w;
}
// Member `member` of the request-head's `members` chunk slots [first, first + members) merges columns
// [member, member + 1) x (group x d) / members of its group x d into `out` (bf16, head order through
// value_head_column) and `lse` (natural log), `tid` of `threads` threads: each thread's columns are tid + k x threads
// of the slice, at most %(max_words)d words loaded at once (all independent), polled until none is empty, merged
// (online, one exp2 a word), then emptied.
__device__ __noinline__ void foldkv_ll_merge(const float* words, int first, int members, int member, int req,
                                                int kvh, int hq, int d, int group, const int* value_head_column,
                                                const void* out, const float* lse, int tid, int threads) {
  constexpr int W = %(max_words)d;
  const unsigned long long empty = ((unsigned long long)%(empty)du << 32) | %(empty)du;
  unsigned long long* base = reinterpret_cast<unsigned long long*>(const_cast<float*>(words));
  __nv_bfloat16* out_bf16 = reinterpret_cast<__nv_bfloat16*>(const_cast<void*>(out));
  float* lse_out = const_cast<float*>(lse);
  if (members > W) __trap();  // one column's words must fit at once
  const int cols = group * d;
  const int lo = (int)((long long)member * cols / members);
  const int hi = (int)((long long)(member + 1) * cols / members);
  const int mine = hi - lo > tid ? (hi - lo - tid + threads - 1) / threads : 0;  // columns lo + tid + k x threads
  const int per_round = W / members;
  const long long member_stride = (long long)hq * d;  // words between two members' copies of a column
  // word s of a round: member s %% members of column k0 + s / members, at column lo + tid + (k0 + k) x threads of the
  // request-head's group x d, i.e. at start + m x member_stride + k x threads. Each pass walks the addresses again
  // from a laundered start (an add a word) rather than keeping W of them live: the words alone take 2 x W registers.
#define FOLDKV_LL_WALK(...)                                                                    \
    {                                                                                          \
      unsigned long long* at;                                                                  \
      asm volatile("mov.b64 %%0, %%1;" : "=l"(at) : "l"(start));                               \
      int k = 0, m = 0;                                                                        \
      _Pragma("unroll") for (int s = 0; s < W; ++s) {                                          \
        if (s < nw) { __VA_ARGS__ }                                                            \
        at += member_stride;                                                                   \
        if (++m == members) { m = 0; ++k; at += threads - members * member_stride; }          \
      }                                                                                        \
    }
  for (int k0 = 0; k0 < mine; k0 += per_round) {
    const int nw = min(per_round, mine - k0) * members;
    unsigned long long* start = base + ((long long)first * hq + kvh * group) * d + lo + tid + (long long)k0 * threads;
    unsigned long long w[W];
    FOLDKV_LL_WALK(w[s] = foldkv_ll_load(at);)
    // wait: spin on the first empty word alone (a load a thread in flight, not one a word: the members still
    // streaming share L2 with these polls), then load every word still empty again, until none is
    long long polls = 0;
    for (;;) {
      bool waiting = false;
#pragma unroll
      for (int s = 0; s < W; ++s) waiting |= s < nw && (unsigned)w[s] == %(empty)du;
      if (!waiting) break;
      bool spun = false;
      FOLDKV_LL_WALK(
        if (!spun && (unsigned)w[s] == %(empty)du) {
          spun = true;
          do {
            if (++polls == (1LL << 22)) __trap();
            __nanosleep(128);
            w[s] = foldkv_ll_load(at);
          } while ((unsigned)w[s] == %(empty)du);
        })
      FOLDKV_LL_WALK(if ((unsigned)w[s] == %(empty)du) w[s] = foldkv_ll_load(at);)
    }
    float run_max = -__int_as_float(0x7f800000), run_sum = 0.f, run_o = 0.f;
    FOLDKV_LL_WALK(
      const float v = __uint_as_float((unsigned)w[s]);
      const float l = __uint_as_float((unsigned)(w[s] >> 32));
      if (l > run_max) {  /* rescale what is there to the new max */
        const float t = exp2f(run_max - l);
        run_sum = run_sum * t + 1.f;
        run_o = run_o * t + v;
        run_max = l;
      } else {
        const float t = exp2f(l - run_max);
        run_sum += t;
        run_o += t * v;
      }
      asm volatile("st.relaxed.gpu.global.b64 [%%0], %%1;" : : "l"(at), "l"(empty) : "memory");
      if (m == members - 1) {
        const int col = lo + tid + (k0 + k) * threads;
        const int h = kvh * group + col / d, p = col %% d;
        out_bf16[((long long)req * hq + h) * d + value_head_column[p]] = __float2bfloat16_rn(run_o / run_sum);
        if (p == 0) lse_out[(long long)req * hq + h] = (log2f(run_sum) + run_max) * %(ln2).17gf;
        run_max = -__int_as_float(0x7f800000); run_sum = 0.f; run_o = 0.f;
      })
  }
#undef FOLDKV_LL_WALK
}
""" % {"empty": LL_EMPTY, "max_words": LL_MAX_WORDS, "ln2": macros.LN2}


def probe_source(probe: str | None) -> str:
    """LL_TAIL_SOURCE, or a timing probe of it: "inline" (the merge inlined into the kernel, which spills
    there), "no_wait" (each word read once, never polled: wrong output whenever a reader is early)."""
    src = LL_TAIL_SOURCE
    if probe == "inline":
        out = src.replace("__device__ __noinline__ void foldkv_ll_merge(", "__device__ __forceinline__ void foldkv_ll_merge(")
    elif probe == "no_wait":
        out = src.replace("      if (!waiting) break;", "      break;")
    else:
        return src
    assert out != src
    return out


def ll_tail(source: str):
    """The fused step's tail as self-validating words (`decode_partial_program(tail=...)`): a member stores its
    partial as words {o, lse} through LL_STORE_FN (padding chunks, with no members, store nothing: no reader would
    empty them), and merges its slice through LL_MERGE_FN; `source`: the device code defining both. Its partial is
    one argument, `part_ll` [C, Hq, D, 2] f32, in place of part_o, part_lse and the counters."""

    def make(ctx: TailContext) -> FusedTail:
        import tilelang.language as T

        hq, d, group, threads = ctx.geom.num_q_heads, ctx.geom.head_dim, ctx.geom.group_size, ctx.threads
        if threads != 128:
            raise ValueError(f"the LL tail: one consumer warpgroup (threads=128), not threads={threads}")
        scale = macros.LOG2E

        @T.macro
        def store(part_o, c, kvh, j, out, i, denom, head_max, members):
            if members > 1:  # padding chunks (no members) write nothing: no reader empties it
                T.call_extern("handle", LL_STORE_FN, part_o.data, (c * hq + kvh * group + j) * d + out.col + i,
                              out.other[i, j] / denom[j], T.log2(denom[j]) + head_max[j] * scale)

        @T.macro
        def finish(tail, part_o, part_lse, scratch, req, kvh, c, members, at):
            T.call_extern("handle", LL_MERGE_FN, part_o.data, at["first"], members, c - at["first"], req, kvh, hq, d,
                          group,
                          tail["value_head_column"].data, tail["out"].data, tail["lse"].data,
                          T.get_thread_binding(0), threads)

        words = T.Tensor((ctx.num_chunks, hq, d, 2), "float32")  # [C, Hq, D] words {o, lse}, empty between launches
        return FusedTail(args=tail_args(ctx, {"part_ll": words}), finish=finish, source=source,
                         partial=("part_ll", None), store=store)

    return make


def build(geom: AttentionGeometry, fmt: KvFormat | str, probe: str | None = None, source: str | None = None,
          **tiling):
    """Compile the LL fused kernel of `fmt` with the format's registered partial tiling, overridden by `tiling`
    (`probe`: probe_source's; `source`: another version's device code of the two LL functions, in place of this
    file's). Arguments: (query, pool, page_ids, chunk_req, chunk_start, chunk_len, merge_first, merge_count, part_ll,
    value_head_column, out, lse)."""
    tilelang = require_tilelang()
    fmt = KvFormat.parse(fmt)
    cfg = {**DEFAULTS[fmt], **tiling}
    return tilelang.compile(decode_partial_program(geom, fmt, tail_merge=True,
                                                   tail=ll_tail(source or probe_source(probe)), **cfg),
                            target=target(), pass_configs=pass_configs())


_EMPTY_INT32 = LL_EMPTY - (1 << 32)  # the empty mark as the int32 the buffer's halves are viewed as


def empty_words(num_chunks: int, geom: AttentionGeometry, device) -> torch.Tensor:
    """A word buffer [C, Hq, D, 2] float32 with every word empty (both halves LL_EMPTY)."""
    return torch.full((num_chunks, geom.num_q_heads, geom.head_dim, 2), _EMPTY_INT32,
                      dtype=torch.int32, device=device).view(torch.float32)


def all_empty(words: torch.Tensor) -> bool:
    """Whether every half of every word in `words` (empty_words' buffer) is the empty mark."""
    return bool((words.view(torch.int32) == _EMPTY_INT32).all())


class LLStep:
    """The LL fused kernel behind the library fused step's argument list (decode.launch_step's): part_o, part_lse
    and the counters are ignored, a word buffer per (chunk count, device) is made on first use (outside any capture:
    the harness checks each arm eagerly before it captures) and stays empty between launches."""

    def __init__(self, geom: AttentionGeometry, fmt: KvFormat | str, probe: str | None = None,
                 source: str | None = None, **tiling):
        self.geom, self.kernel = geom, build(geom, fmt, probe, source, **tiling)
        self.words: dict[tuple, torch.Tensor] = {}

    def __call__(self, query, pool, page_ids, chunk_req, chunk_start, chunk_len, merge_first, merge_count, part_o,
                 part_lse, counters, value_head_column, out, lse):
        key = (chunk_req.shape[0], query.device)
        if key not in self.words:
            self.words[key] = empty_words(chunk_req.shape[0], self.geom, query.device)
        self.kernel(query, pool, page_ids, chunk_req, chunk_start, chunk_len, merge_first, merge_count,
                    self.words[key], value_head_column, out, lse)
