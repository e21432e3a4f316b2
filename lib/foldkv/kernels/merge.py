"""The two-level merge of split-KV decode partials (kernels/DECODE_SCHEDULE.md): level one (`merge_groups`) merges each
group into its first slot, in place (a `__syncthreads()` between the reads and the store, checked on the emitted CUDA
by `cuda_checks.check_in_place_merge`); level two (`merge_final`) merges each request's group slots into the output,
in head order with a natural-log LSE. With o_i normalised and lse_i base 2: m = max lse_i, w_i = 2^(lse_i - m),
o = sum w_i o_i / sum w_i, lse = log2(sum w_i) + m. Kernel arguments: the prim_funcs' (grids (G, Hq), (B, Hq)).
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations, which use closure values

from ..config import AttentionGeometry
from . import registry
from .cuda_checks import check_in_place_merge
from .macros import LN2
from .registry import hands_out
from .tl import compile_program, require_tilelang

MERGE_THREADS = registry.get("merge_groups").params["threads"]
UNROLL = 8  # partials loaded per round trip: a merge is a chain of memory latencies


def _cols_per_thread(geom: AttentionGeometry, threads: int) -> int:
    if geom.head_dim % threads:
        raise ValueError(f"head_dim {geom.head_dim} is not a multiple of the merge's {threads} threads")
    return geom.head_dim // threads


def merge_groups_program(geom: AttentionGeometry, *, threads: int = MERGE_THREADS, barrier: bool = True):
    """The TileLang prim_func of the in-place level-one merge. `barrier=False` drops the `__syncthreads()`: a broken
    kernel, for the barrier check's red test only."""
    require_tilelang()
    import tilelang.language as T

    hq, d = geom.num_q_heads, geom.head_dim
    vec = _cols_per_thread(geom, threads)
    num_slots, num_groups = T.dynamic("num_slots"), T.dynamic("num_groups")
    f32, i32 = "float32", "int32"
    merge_partials = _merge_partials_macro(vec, via_group_first=False)

    @T.prim_func
    def merge_groups(
        part_o: T.Tensor((num_slots, hq, d), f32),  # [S, Hq, D] partial outputs (normalised)
        part_lse: T.Tensor((num_slots, hq), f32),  # [S, Hq] base-2 LSE
        group_first: T.Tensor((num_groups,), i32),  # [G] first slot of each group (the merged slot)
        group_count: T.Tensor((num_groups,), i32),  # [G] members, consecutive slots from group_first
    ):
        with T.Kernel(num_groups, hq, threads=threads) as (g, h):
            tx = T.get_thread_binding(0)
            acc = T.alloc_local((vec,), f32)  # this thread's columns of the merged o (unnormalised)
            lse_blk = T.alloc_local((UNROLL,), f32)
            o_blk = T.alloc_local((UNROLL, vec), f32)
            state = T.alloc_local((2,), f32)  # running max, running weight sum
            first = group_first[g]
            count = group_count[g]
            # --- reads: every member's LSE and this thread's columns of every member's o ---
            merge_partials(part_o, part_lse, group_first, h, tx, first, count, acc, lse_blk, o_blk, state)
            # --- all reads of the group's slots are done before anyone stores into its first slot ---
            if barrier:
                T.sync_threads()
            # --- store: one writer per scalar (thread tx owns its columns, thread 0 the LSE) ---
            for j in T.vectorized(vec):
                part_o[first, h, tx * vec + j] = acc[j] / state[1]
            if tx == 0:
                part_lse[first, h] = T.log2(state[1]) + state[0]

    return merge_groups


def _merge_partials_macro(vec: int, *, via_group_first: bool, per_trip: int = UNROLL):
    """Online merge of `count` partials, `per_trip` independent (predicated) loads a round trip. Member i is slot
    first + i (level one), or group_first[first + i] (level two, clamped to the request's last group so that no load
    past it is issued). Leaves (running max, weight sum) in `state` and the unnormalised columns in `acc`."""
    import tilelang.language as T

    f32 = "float32"

    def slot_of(group_first, first, count, member):
        return group_first[T.min(first + member, first + count - 1)] if via_group_first else first + member

    @T.macro
    def merge_partials(part_o, part_lse, group_first, h, tx, first, count, acc, lse_blk, o_blk, state):
        state[0] = -T.infinity(f32)
        state[1] = 0.0
        for j in T.serial(vec):
            acc[j] = 0.0
        for b in T.serial(T.ceildiv(count, per_trip)):
            for u in T.unroll(per_trip):
                live = b * per_trip + u < count
                slot = slot_of(group_first, first, count, b * per_trip + u)
                lse_blk[u] = T.if_then_else(live, part_lse[slot, h], -T.infinity(f32))
                for j in T.vectorized(vec):
                    o_blk[u, j] = T.if_then_else(live, part_o[slot, h, tx * vec + j], 0.0)
            block_max = T.alloc_var(f32)
            block_max = state[0]
            for u in T.unroll(per_trip):
                block_max = T.max(block_max, lse_blk[u])
            rescale = T.exp2(state[0] - block_max)  # 0 on the first block (state[0] = -inf)
            state[1] = state[1] * rescale
            for j in T.serial(vec):
                acc[j] = acc[j] * rescale
            for u in T.unroll(per_trip):
                weight = T.exp2(lse_blk[u] - block_max)  # 0 past count
                state[1] = state[1] + weight
                for j in T.vectorized(vec):
                    acc[j] = acc[j] + weight * o_blk[u, j]
            state[0] = block_max

    return merge_partials


def merge_final_program(geom: AttentionGeometry, *, threads: int = MERGE_THREADS, unroll: int = UNROLL):
    """The TileLang prim_func of the level-two merge, `unroll` group slots per round trip."""
    require_tilelang()
    import tilelang.language as T

    hq, d = geom.num_q_heads, geom.head_dim
    vec = _cols_per_thread(geom, threads)
    num_slots, num_groups, batch = T.dynamic("num_slots"), T.dynamic("num_groups"), T.dynamic("batch")
    f32, i32, bf16 = "float32", "int32", "bfloat16"
    merge_slots = _merge_partials_macro(vec, via_group_first=True, per_trip=unroll)

    @T.prim_func
    def merge_final(
        part_o: T.Tensor((num_slots, hq, d), f32),  # [S, Hq, D] after level one: each group's first slot merged
        part_lse: T.Tensor((num_slots, hq), f32),  # [S, Hq] base-2 LSE
        group_first: T.Tensor((num_groups,), i32),  # [G] merged slot of each group
        req_group_first: T.Tensor((batch,), i32),  # [B] first group of each request
        req_group_count: T.Tensor((batch,), i32),  # [B] groups of each request (consecutive)
        value_head_column: T.Tensor((d,), i32),  # [D] head column of value-window position p
        out: T.Tensor((batch, hq, d), bf16),  # [B, Hq, D] head order
        lse: T.Tensor((batch, hq), f32),  # [B, Hq] natural log
    ):
        with T.Kernel(batch, hq, threads=threads) as (r, h):
            tx = T.get_thread_binding(0)
            acc = T.alloc_local((vec,), f32)
            lse_blk = T.alloc_local((unroll,), f32)
            o_blk = T.alloc_local((unroll, vec), f32)
            state = T.alloc_local((2,), f32)
            merge_slots(part_o, part_lse, group_first, h, tx, req_group_first[r], req_group_count[r], acc, lse_blk,
                        o_blk, state)
            for j in T.serial(vec):
                out[r, h, value_head_column[tx * vec + j]] = T.cast(acc[j] / state[1], bf16)
            if tx == 0:
                lse[r, h] = (T.log2(state[1]) + state[0]) * LN2

    return merge_final


@hands_out("merge_groups")
def build_merge_groups(geom: AttentionGeometry, *, threads: int = MERGE_THREADS, barrier: bool = True,
                       check: bool = True):
    """Compile the level-one merge and run the emitted-source barrier check on it (raises if it fails)."""
    kernel = compile_program(merge_groups_program(geom, threads=threads, barrier=barrier))
    if check:
        check_in_place_merge("merge_groups", kernel.get_kernel_source())
    return kernel


@hands_out("merge_final")
def build_merge_final(geom: AttentionGeometry, *, threads: int = MERGE_THREADS, unroll: int = UNROLL):
    return compile_program(merge_final_program(geom, threads=threads, unroll=unroll))


__all__ = ["merge_groups_program", "merge_final_program", "build_merge_groups", "build_merge_final"]
