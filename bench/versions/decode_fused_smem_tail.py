"""Fused decode whose tail loads its slice of every member's partial into shared memory by cp.async (a rolled loop:
all loads in flight at once, little code), then merges from there, in place of the library's merge unrolled over 33
members in registers.

Lab notebook (bench/DECODE_NOTES.md, run 17). Question: run 16 made the library's merge smaller by fewer members a
round trip (p8, p4) and lost 0.4-2 us: each extra trip costs more than the code it saves; run 15 put the LL step's
extra 30 us in cold instruction fetch. Here the code is small (two rolled copy loops, one rolled merge loop) and the
loads still take one round trip: each consumer thread issues its ~8 sixteen-byte copies of the members' columns and
LSEs, waits for them, and the 128 consumer threads meet on the tail's barrier; then thread t merges columns
lo + t + 128 k over the members from shared memory (a max pass, then the weighted sums).

Prediction (before the run): the merge's executed code ~15 KB -> ~2 KB; if the cold-fetch cost of run 15 (~0.24 us a
KB) holds, ~2-3 us less a step; if fetch is cheap (run 16's p8 lost only 0.4-0.8 us for 4 extra trips, so trips cost
~0.1-0.2 us net of the code they saved), within +-0.5 us of the library. Same error as the library (the same sums,
in another order).
"""

from __future__ import annotations

import dataclasses

from foldkv.config import AttentionGeometry
from foldkv.kernels import macros
from foldkv.kernels.decode_partial import (TAIL_MAX_MEMBERS, FusedTail, TailContext, build_decode_fused,
                                           hand_off_macro, merge_tail)
from foldkv.layout import KvFormat

COMBINE_FN = "foldkv_tail_merge_smem"
SOURCE = macros.TAIL_SOURCE + r"""
#include <cuda_bf16.h>
__device__ __forceinline__ void foldkv_cp_async16(float* smem, const float* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%%0], [%%1], 16;" : : "r"(s), "l"(gmem) : "memory");
}
// Member `member` of `members` merges columns [lo, hi) of its request-head's group x d (multiples of 4) from every
// member's partial (part_o [C, hq, d] f32, part_lse [C, hq] base 2) into out (bf16, head order) and lse (natural log).
__device__ __forceinline__ void foldkv_tail_merge_smem(const float* part_o, const float* part_lse, float* scratch,
                                                       int first, int members, int member, int req, int kvh, int hq,
                                                       int d, int group, const int* value_head_column,
                                                       const void* out, const float* lse, int tid, int threads,
                                                       int barrier_id) {
  if (members > %(max_members)d || group != 8) __trap();
  const int cols = group * d;
  const int lo = member * cols / members / 4 * 4, hi = (member + 1) * cols / members / 4 * 4;
  const int w = hi - lo, q = w / 4;
  float* lse_s = scratch;                // [members][8]
  float* o_s = scratch + members * 8;    // [members][w]
  const float* l_base = part_lse + (long long)first * hq + kvh * group;
  const float* o_base = part_o + ((long long)first * hq + kvh * group) * d + lo;
  for (int i = tid; i < members * 2; i += threads)
    foldkv_cp_async16(lse_s + i * 4, l_base + (long long)(i >> 1) * hq + (i & 1) * 4);
  for (int i = tid; i < members * q; i += threads) {
    const int m = i / q, k = i - m * q;
    foldkv_cp_async16(o_s + m * w + k * 4, o_base + (long long)m * hq * d + k * 4);
  }
  asm volatile("cp.async.wait_all;" : : : "memory");
  asm volatile("bar.sync %%0, %%1;" : : "r"(barrier_id), "r"(threads) : "memory");
  __nv_bfloat16* out_bf16 = reinterpret_cast<__nv_bfloat16*>(const_cast<void*>(out));
  float* lse_out = const_cast<float*>(lse);
  for (int j = tid; j < w; j += threads) {
    const int col = lo + j, h = col / d, p = col - h * d;
    float mx = -__int_as_float(0x7f800000);
    for (int m = 0; m < members; ++m) mx = fmaxf(mx, lse_s[m * 8 + h]);
    float sum = 0.f, acc = 0.f;
    for (int m = 0; m < members; ++m) {
      const float wgt = exp2f(lse_s[m * 8 + h] - mx);
      sum += wgt;
      acc += wgt * o_s[m * w + j];
    }
    const int head = kvh * group + h;
    out_bf16[((long long)req * hq + head) * d + value_head_column[p]] = __float2bfloat16_rn(acc / sum);
    if (p == 0) lse_out[(long long)req * hq + head] = (log2f(sum) + mx) * %(ln2).17gf;
  }
}
""" % {"max_members": TAIL_MAX_MEMBERS, "ln2": macros.LN2}


def smem_tail(ctx: TailContext) -> FusedTail:
    """The served tail (`decode_partial.merge_tail`: its arguments and atomic hand-off) with its merge replaced by
    COMBINE_FN, given a shared scratch of every member's slice of the group x D columns and, per member, its
    group's LSEs plus 4 columns of rounding slack."""
    import tilelang.language as T

    hq, d, group, threads = ctx.geom.num_q_heads, ctx.geom.head_dim, ctx.geom.group_size, ctx.threads
    if threads != 128:
        raise ValueError(f"the shared-memory tail: one consumer warpgroup (threads=128), not threads={threads}")
    hand_off = hand_off_macro(ctx)

    @T.macro
    def finish(tail, part_o, part_lse, scratch, req, kvh, c, members, at):
        hand_off(tail, req, kvh, c, members, at)
        T.call_extern("handle", COMBINE_FN, part_o.data, part_lse.data, T.address_of(scratch[0]), at["first"],
                      members, c - at["first"], req, kvh, hq, d, group, tail["value_head_column"].data,
                      tail["out"].data, tail["lse"].data, T.get_thread_binding(0), threads, macros.TAIL_BARRIER_ID)

    return dataclasses.replace(merge_tail(ctx), finish=finish, source=SOURCE,
                               scratch=group * d + (group + 4) * TAIL_MAX_MEMBERS)


def build(geom: AttentionGeometry, fmt: KvFormat | str, **tiling):
    """Compile the fused step of `fmt` with this tail (the library's builder: the format's registered partial tiling,
    overridden by `tiling`, and the hand-off check); the library fused step's arguments."""
    return build_decode_fused(geom, fmt, tail=smem_tail, **tiling)
