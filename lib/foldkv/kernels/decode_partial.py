"""The split-KV decode partial for either page format (one CTA = one chunk of one request's pages x one KV head), and
the fused step of a one-wave plan: the partial with its tail merge (kernels/DECODE_SCHEDULE.md).

A format is its tiles and which window feeds which gemm (`format_parts_macro`). The gemms are token-major, S^T = K Q^T
and O^T = V^T P^T, so the MMA's M is a tile's 64 tokens and Hopper's wgmma applies (M >= 64), N = the 8 query heads
padded to 16; the softmax reduces over dim 0.

Kernel arguments, in order (what a backend's callable takes; grid (C, Hkv)): `partial_inputs` (an FP8 pool's scales
after the pool), then `partial_args` (decode_partial_<format>[_fp8]) or `merge_tail`'s (decode_fused_<format>).
"""

# no `from __future__ import annotations`: TileLang's T.macro reads the macros' own source and closures

from dataclasses import dataclass
from typing import Any

from ..config import AttentionGeometry
from ..layout import KvFormat, row_width
from . import macros, producer_guard, registry
from .cuda_checks import check_e4m3_conversion, check_tail_hand_off
from .macros import Convert
from .merge import _merge_partials_macro
from .registry import hands_out
from .tl import compile_program, prim_func, require_tilelang

# the fused tail merges 4 columns a thread, 8 members a round trip, for up to TAIL_FEW_MEMBERS members, else 2 and
# TAIL_MAX_MEMBERS (one wave of the H200's 132 SMs holds 132 / 4 KV heads = 33 chunks of a request)
TAIL_FEW_MEMBERS, TAIL_MAX_MEMBERS = 8, 33
PRODUCER_THREADS = 128  # TileLang's warp specialisation: the producer warpgroup is threads [0, 128), consumers after
FP8_PANEL = 128  # columns of an FP8 row loaded per shared tile: 128 bytes, the widest TMA box with 128-byte swizzle
# The registered tiling of each format (registry.py says why these).
DEFAULTS = {fmt: dict(registry.get(f"decode_partial_{fmt.value}").params) for fmt in KvFormat}


@dataclass(frozen=True)
class Run:
    """A shared tile holding columns [lo, hi) of the query or of a row."""
    tile: Any
    lo: int
    hi: int


@dataclass(frozen=True)
class Gemm:
    """`row_tile` against the query piece (scores) or into the accumulator (values: output columns from `col`)."""
    row_tile: Any
    other: Any
    col: int = 0


@dataclass(frozen=True)
class FoldedRow:
    """A folded row's tiles for a block of tokens: as loaded (Runs), the gemms' bf16 tiles, an FP8 row's Converts and
    scales."""
    row: tuple
    k_rot: Any
    v_unrot: Any
    v_rot: Any
    convert: tuple
    scale: Any


def fp8_row_macro(geom: AttentionGeometry, block_n: int):
    """A macro returning the FoldedRow of an FP8 row's `block_n` tokens (the decode partial's and the prefill's)."""
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    d, rot = geom.head_dim, geom.rotary_width
    unrot = d - rot

    @T.macro
    def fp8_row():
        # one TMA box a panel, each named: TileLang would give nameless buffers suffixes in no fixed order
        stored = [IRBuilder.name(f"stored_{p}", T.alloc_shared((block_n, FP8_PANEL), "float8_e4m3"))
                  for p in range((d + rot) // FP8_PANEL)]
        k_rot = T.alloc_shared((block_n, rot), "bfloat16")  # the row's windows in bf16 (exact: 3 fraction bits)
        v_unrot = T.alloc_shared((block_n, unrot), "bfloat16")  # a key column and a value column
        v_rot = T.alloc_shared((block_n, rot), "bfloat16")
        scale_s = T.alloc_shared((block_n,), "float32")  # [N] the tokens' scales
        windows = ((k_rot, 0), (v_unrot, rot), (v_rot, d))  # (bf16 tile, first row column)
        convert = tuple(Convert(stored[p], tile, p * FP8_PANEL - lo) for p in range(len(stored))
                        for tile, lo in windows if lo <= p * FP8_PANEL < lo + tile.shape[1])
        return FoldedRow(row=tuple(Run(t, p * FP8_PANEL, (p + 1) * FP8_PANEL) for p, t in enumerate(stored)),
                         k_rot=k_rot, v_unrot=v_unrot, v_rot=v_rot, convert=convert, scale=scale_s)

    return fp8_row


@dataclass(frozen=True)
class FormatParts:
    query: tuple  # Runs of the query's score window
    row: tuple  # Runs of the row: how a tile is loaded, one TMA copy each, in load order
    scores: tuple  # Gemms: S^T += row_tile other^T, summed over the score window
    values: tuple  # Gemms: acc (other) += row_tile^T P^T over the value window
    convert: tuple = ()  # Converts: an FP8 row's e4m3 panels, converted (exactly) to the bf16 tiles of the gemms
    token_scale: Any = None  # [N] float32 shared: an FP8 row's scale per token (None: bf16 rows)


def format_parts_macro(geom: AttentionGeometry, fmt: KvFormat, block_n: int, block_h: int, fp8: bool = False):
    """A macro allocating the format's tiles (under the emitted CUDA's names) and returning its FormatParts; `fp8`:
    the FP8 folded row, whose e4m3 panels are converted to the gemms' bf16 tiles."""
    import tilelang.language as T

    d, rot = geom.head_dim, geom.rotary_width
    unrot = d - rot
    bf16, f32 = "bfloat16", "float32"

    @T.macro
    def split_parts():
        q_s = T.alloc_shared((block_h, d), bf16)  # [16, D]  rows >= 8: see macros.load_group_query_macro
        k_s = T.alloc_shared((block_n, d), bf16)  # [N, D]   row[0:D]
        v_s = T.alloc_shared((block_n, d), bf16)  # [N, D]   row[D:2D]
        acc_o = T.alloc_fragment((d, block_h), f32)  # O^T [D, 16]
        return FormatParts(query=(Run(q_s, 0, d),), row=(Run(k_s, 0, d), Run(v_s, d, 2 * d)),
                           scores=(Gemm(k_s, q_s),), values=(Gemm(v_s, acc_o),))

    @T.macro
    def bf16_row():
        k_rot = T.alloc_shared((block_n, rot), bf16)  # [N, R]   row[0:R]
        v_unrot = T.alloc_shared((block_n, unrot), bf16)  # [N, D-R] row[R:D]: a key column and a value column
        v_rot = T.alloc_shared((block_n, rot), bf16)  # [N, R]   row[D:D+R]
        return FoldedRow(row=(Run(k_rot, 0, rot), Run(v_unrot, rot, d), Run(v_rot, d, d + rot)), k_rot=k_rot,
                         v_unrot=v_unrot, v_rot=v_rot, convert=(), scale=None)

    folded_row = fp8_row_macro(geom, block_n) if fp8 else bf16_row

    @T.macro
    def folded_parts():
        q_rot = T.alloc_shared((block_h, rot), bf16)  # [16, R]   rows >= 8: see macros.load_group_query_macro
        q_unrot = T.alloc_shared((block_h, unrot), bf16)  # [16, D-R]
        row = folded_row()  # its tiles used as row.<name>: bound to another name, a buffer would be renamed after it
        acc_o_unrot = T.alloc_fragment((unrot, block_h), f32)  # O^T [D-R, 16]
        acc_o_rot = T.alloc_fragment((rot, block_h), f32)  # O^T [R, 16]
        return FormatParts(query=(Run(q_rot, 0, rot), Run(q_unrot, rot, d)), row=row.row,
                           scores=(Gemm(row.k_rot, q_rot), Gemm(row.v_unrot, q_unrot)),
                           values=(Gemm(row.v_unrot, acc_o_unrot), Gemm(row.v_rot, acc_o_rot, unrot)),
                           convert=row.convert, token_scale=row.scale)

    if fp8 and fmt is not KvFormat.FOLDED:
        raise ValueError("FP8 rows are folded only (foldkv.pool.PagedKvLayout refuses an FP8 split pool)")
    return {KvFormat.SPLIT: split_parts, KvFormat.FOLDED: folded_parts}[fmt]


@dataclass(frozen=True)
class TailContext:
    """What a fused tail is built for: the geometry, the consumer threads, the dynamic batch and chunk slots."""
    geom: AttentionGeometry
    threads: int
    batch: Any
    num_chunks: Any


@dataclass(frozen=True)
class FusedTail:
    """How the chunks (members) of a request-head of several merge their partials into `out` / `lse` (one chunk
    writes its output from the epilogue): the served `merge_tail`, or a version's in bench/versions/. Its hooks are
    called with the kernel's own names (a buffer passed under another name would be renamed after it)."""
    args: dict  # the kernel's arguments after chunk_len (name -> T.Tensor; `tail_args`)
    # T.macro(tail, part_o, part_lse, scratch, req, kvh, c, members, at), after the epilogue when members > 1: `tail`
    # the arguments by name, `at["first"]` the first slot (a macro argument would be copied into a new variable)
    finish: Any
    source: str = ""  # the device code the kernel imports
    partial: tuple = ("part_o", "part_lse")  # the arguments the partial goes to (LSE None: the output carries it)
    scratch: int = 0  # float32 words of shared memory allocated before the loop as `scratch`
    # T.macro(part_o, c, kvh, j, out, i, denom, head_max, members): one element of a member's partial (None: the
    # partial's own store)
    store: Any = None


def tail_args(ctx: TailContext, partial: dict) -> dict:
    """A fused kernel's arguments after chunk_len: the merge slots, `partial` (where members leave their partials),
    the value-window map and the outputs."""
    import tilelang.language as T

    hq, d = ctx.geom.num_q_heads, ctx.geom.head_dim
    return {
        "merge_first": T.Tensor((ctx.num_chunks,), "int32"),  # [C] first slot of chunk c's request (consecutive)
        "merge_count": T.Tensor((ctx.num_chunks,), "int32"),  # [C] chunks of that request
        **partial,
        "value_head_column": T.Tensor((d,), "int32"),  # [D] head column of value-window position p
        "out": T.Tensor((ctx.batch, hq, d), "bfloat16"),  # [B, Hq, D] head order
        "lse": T.Tensor((ctx.batch, hq), "float32"),  # [B, Hq] natural log
    }


def partial_inputs(ctx: TailContext, num_pages, max_pages, page_size: int, width: int, fp8: bool) -> dict:
    """A partial's arguments up to chunk_len; over an FP8 pool its scales after the pool."""
    import tilelang.language as T

    hq, hkv, d, i32 = ctx.geom.num_q_heads, ctx.geom.num_kv_heads, ctx.geom.head_dim, "int32"
    return {
        "query": T.Tensor((ctx.batch, hq, d), "bfloat16"),  # [B, Hq, D] query in the format's form
        "pool": T.Tensor((num_pages, hkv, page_size, width), "float8_e4m3" if fp8 else "bfloat16"),  # [P, Hkv, page, W]
        **({"scales": T.Tensor((num_pages, hkv, page_size), "float32")} if fp8 else {}),  # [P, Hkv, page] row scales
        "page_ids": T.Tensor((ctx.batch, max_pages), i32),  # [B, MP]
        "chunk_req": T.Tensor((ctx.num_chunks,), i32),  # [C] request of chunk c
        "chunk_start": T.Tensor((ctx.num_chunks,), i32),  # [C] first token (multiple of page_size)
        "chunk_len": T.Tensor((ctx.num_chunks,), i32),  # [C] tokens in the chunk (>= 1)
    }


def partial_args(ctx: TailContext) -> dict:
    """The partial's outputs: its normalised output (value-window order) and base-2 LSE per chunk slot."""
    import tilelang.language as T

    hq, d = ctx.geom.num_q_heads, ctx.geom.head_dim
    return {"part_o": T.Tensor((ctx.num_chunks, hq, d), "float32"),  # [C, Hq, D] value-window order
            "part_lse": T.Tensor((ctx.num_chunks, hq), "float32")}  # [C, Hq] base 2


def hand_off_macro(ctx: TailContext):
    """The atomic hand-off (macros.TAIL_SOURCE): each member waits until all have stored their partials."""
    import tilelang.language as T

    hkv, threads = ctx.geom.num_kv_heads, ctx.threads

    @T.macro
    def hand_off(tail, req, kvh, c, members, at):
        T.call_extern("handle", macros.TAIL_HAND_OFF_FN, tail["counters"].data, req * hkv + kvh, c - at["first"],
                      members, PRODUCER_THREADS, macros.TAIL_BARRIER_ID, threads)

    return hand_off


def tail_slice_macro(tc: TailContext):
    """A member's slice of its request-head's group x D columns merged from every member's partial into out / lse:
    `vec` columns a thread, `trip` members a round trip (`merge_members`: merge.py's online merge built for them)."""
    import tilelang.language as T

    group, d, threads = tc.geom.group_size, tc.geom.head_dim, tc.threads
    i32, f32 = "int32", "float32"

    @T.macro
    def tail_slice(tail, part_o, part_lse, req, kvh, c, first, members, vec, trip, merge_members):
        """This CTA's columns [lo, hi) of its request-head's group x D (multiples of `vec`), `vec` per thread."""
        lo, hi, col, h, p = (T.alloc_var(i32) for _ in range(5))
        lo = (c - first) * (group * d) // members // vec * vec
        hi = (c - first + 1) * (group * d) // members // vec * vec
        ctx = T.get_thread_binding(0)  # consumer-relative: the warp specialisation rebases it
        acc = T.alloc_local((vec,), f32)
        lse_blk = T.alloc_local((trip,), f32)
        o_blk = T.alloc_local((trip, vec), f32)
        state = T.alloc_local((2,), f32)
        for s in T.serial(T.ceildiv(hi - lo, threads * vec)):
            col = lo + (s * threads + ctx) * vec
            if col < hi:
                h = kvh * group + col // d
                p = col % d
                merge_members(part_o, part_lse, None, h, p // vec, first, members, acc, lse_blk, o_blk, state)
                for j in T.serial(vec):
                    tail["out"][req, h, tail["value_head_column"][p + j]] = T.cast(acc[j] / state[1], "bfloat16")
                if p == 0:
                    tail["lse"][req, h] = (T.log2(state[1]) + state[0]) * macros.LN2

    return tail_slice


def merge_tail(ctx: TailContext, *, hand_off: bool = True) -> FusedTail:
    """The served tail: the hand-off, then each member's slice (`tail_slice_macro`). `hand_off=False` leaves the
    hand-off out: the hand-off check's red twin."""
    import tilelang.language as T

    counters = T.Tensor((ctx.batch, ctx.geom.num_kv_heads), "int32")  # [B, Hkv] multiples of TAIL_STEP
    hand_off_ = hand_off_macro(ctx)
    tail_slice = tail_slice_macro(ctx)
    (few_vec, few_trip), (many_vec, many_trip) = (4, TAIL_FEW_MEMBERS), (2, TAIL_MAX_MEMBERS)
    few = _merge_partials_macro(few_vec, via_group_first=False, per_trip=few_trip)
    many = _merge_partials_macro(many_vec, via_group_first=False, per_trip=many_trip)

    @T.macro
    def finish(tail, part_o, part_lse, scratch, req, kvh, c, members, at):
        if hand_off:
            hand_off_(tail, req, kvh, c, members, at)
        if members <= TAIL_FEW_MEMBERS:
            tail_slice(tail, part_o, part_lse, req, kvh, c, at["first"], members, few_vec, few_trip, few)
        else:
            tail_slice(tail, part_o, part_lse, req, kvh, c, at["first"], members, many_vec, many_trip, many)

    return FusedTail(args=tail_args(ctx, {**partial_args(ctx), "counters": counters}), finish=finish,
                     source=macros.TAIL_SOURCE)


def decode_partial_program(geom: AttentionGeometry, fmt: KvFormat | str, *, page_size: int = 64, block_n: int = 64,
                           num_stages: int = 1, threads: int = 128, block_h: int = 16, fp8: bool = False,
                           reduce_batch: int = 1, tail_merge: bool = False, tail=None, convert=None, prologue=None,
                           loaded=None, source=None):
    """The TileLang prim_func of the partial kernel. `fp8`: over an FP8 folded pool, its rows converted exactly
    (`macros.convert_e4m3_macro`); `reduce_batch`: the softmax's queries per cross-warp reduction; `tail_merge`: the
    fused step, its tail `tail(TailContext) -> FusedTail` (default `merge_tail`). A version's hook points (None: the
    library's, or none), called with the kernel's own names: `convert(convert)` an FP8 tile's conversion,
    `prologue()` first in the kernel, `loaded(pool, page_ids, req, kvh, tok, k, n_tok)` after a tile's copies, and
    `source` the device code they import."""
    require_tilelang()
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    fmt = KvFormat.parse(fmt)
    hkv, group = geom.num_kv_heads, geom.group_size
    width = row_width(geom, fmt)
    assert page_size % block_n == 0 and block_h >= group
    batch, num_pages, max_pages, num_chunks = T.dynamic("batch, num_pages, max_pages, num_chunks")
    bf16, f32, i32 = "bfloat16", "float32", "int32"
    scale = macros.LOG2E
    format_parts = format_parts_macro(geom, fmt, block_n, block_h, fp8=fp8)
    load_query = macros.load_group_query_macro(group, block_h)
    # wgmma's accumulator layout gives a consumer thread a quarter of its warpgroup's query columns
    thread_queries = block_h // 4 // (threads // 128)
    if reduce_batch < 1 or thread_queries % reduce_batch:
        raise ValueError(f"reduce_batch={reduce_batch} must divide the {thread_queries} queries a consumer thread"
                         f" holds at block_h={block_h}, threads={threads}")
    online_softmax = macros.online_softmax_macro(key_dim=0, reduce_batch=reduce_batch)
    mask_scores = macros.mask_scores_macro()
    zero_rows = macros.zero_rows_macro()
    convert_e4m3 = convert or macros.convert_e4m3_macro(block_n, FP8_PANEL, threads)
    if tail_merge and fp8:
        raise ValueError("tail_merge: bf16 pools only")
    ctx = TailContext(geom, threads, batch, num_chunks)
    fused = (tail or merge_tail)(ctx) if tail_merge else None
    # two consumer warpgroups: each takes half of S^T's 16 query columns, and half of O^T's rows
    split_heads = threads > 128
    score_policy = T.GemmWarpPolicy.FullCol if split_heads else T.GemmWarpPolicy.Square
    value_policy = T.GemmWarpPolicy.FullRow if split_heads else T.GemmWarpPolicy.Square

    @T.macro
    def partial(query, pool, scales, page_ids, chunk_req, chunk_start, chunk_len, part_o, part_lse, tail=None):
        with T.Kernel(num_chunks, hkv, threads=threads) as (c, kvh):
            T.import_source(producer_guard.imported_source(
                macros.E4M3_TO_BF16_SOURCE if fp8 and convert is None else None,
                fused.source if tail_merge else None, source))
            if prologue is not None:
                prologue()
            parts = format_parts()
            p_shared = T.alloc_shared((block_n, block_h), bf16)  # P^T [N, 16], the B operand of O^T += V^T P^T
            acc_s = T.alloc_fragment((block_n, block_h), f32)  # S^T [N, 16] scores, then probabilities
            head_max = T.alloc_fragment((block_h,), f32)
            head_max_prev = T.alloc_fragment((block_h,), f32)
            rescale = T.alloc_fragment((block_h,), f32)
            head_sum = T.alloc_fragment((block_h,), f32)
            denom = T.alloc_fragment((block_h,), f32)
            # two consumer warpgroups each hold every column of O: the per-query factors reach O through shared
            # memory (in a dict: a buffer bound to another name would be renamed after it)
            for_o = {"rescale": rescale, "denom": denom}
            if split_heads:
                for name in for_o:
                    for_o[name] = IRBuilder.name(f"{name}_o", T.alloc_shared((block_h,), f32))

            scratch = T.alloc_shared((fused.scratch,), f32) if tail_merge and fused.scratch else None
            req = chunk_req[c]
            start = chunk_start[c]
            n_tok = chunk_len[c]
            load_query(query, req, kvh, parts.query)
            for out in parts.values:
                T.fill(out.other, 0)
            T.fill(denom, 0)
            T.fill(head_max, -T.infinity(f32))

            for k in T.Pipelined(T.ceildiv(n_tok, block_n), num_stages=num_stages):
                tok = start + k * block_n
                page = page_ids[req, tok // page_size]
                off = tok % page_size
                for run in parts.row:
                    T.copy(pool[page, kvh, off:off + block_n, run.lo:run.hi], run.tile)
                if parts.token_scale is not None:
                    T.copy(scales[page, kvh, off:off + block_n], parts.token_scale)
                if loaded is not None:
                    loaded(pool, page_ids, req, kvh, tok, k, n_tok)
                convert_e4m3(parts.convert)  # e4m3 -> bf16 is exact
                T.clear(acc_s)
                for score in parts.scores:  # S^T [N, 16] += K Q^T
                    T.gemm(score.row_tile, score.other, acc_s, transpose_B=True, policy=score_policy)
                if parts.token_scale is not None:  # a token's row is its e4m3 values times its scale
                    for i, j in T.Parallel(block_n, block_h):
                        acc_s[i, j] *= parts.token_scale[i]
                mask_scores(acc_s, lambda i, j: k * block_n + i < n_tok)  # tokens past the chunk: probability 0
                # P.V over scaled rows: the scale goes on P's column (tokens past the chunk: 0, whatever it holds)
                key_weight = None if parts.token_scale is None else (
                    lambda i: T.if_then_else(k * block_n + i < n_tok, parts.token_scale[i], 0.0))
                online_softmax(acc_s, p_shared, head_max, head_max_prev, rescale, head_sum, denom, key_weight)
                if split_heads:
                    T.copy(rescale, for_o["rescale"])
                for out in parts.values:
                    for i, j in T.Parallel(out.other.shape[0], block_h):
                        out.other[i, j] *= for_o["rescale"][j]
                if (k + 1) * block_n > n_tok:
                    for out in parts.values:
                        zero_rows(out.row_tile, lambda i: k * block_n + i < n_tok)
                for out in parts.values:  # O^T [cols, 16] += V^T P^T
                    T.gemm(out.row_tile, p_shared, out.other, transpose_A=True, policy=value_policy)

            if split_heads:
                T.copy(denom, for_o["denom"])
            if tail_merge:  # a request-head of one chunk: the output itself, no partial, no hand-off
                members = tail["merge_count"][c]
            for out in parts.values:
                for i, j in T.Parallel(out.other.shape[0], block_h):
                    if j < group:
                        if tail_merge and members == 1:
                            tail["out"][req, kvh * group + j, tail["value_head_column"][out.col + i]] = T.cast(
                                out.other[i, j] / for_o["denom"][j], bf16)
                        elif tail_merge and fused.store is not None:
                            fused.store(part_o, c, kvh, j, out, i, denom, head_max, members)
                        else:
                            part_o[c, kvh * group + j, out.col + i] = out.other[i, j] / for_o["denom"][j]
            for j in T.Parallel(block_h):
                if j < group:
                    if tail_merge and members == 1:
                        tail["lse"][req, kvh * group + j] = (T.log2(denom[j]) + head_max[j] * scale) * macros.LN2
                    elif part_lse is not None:  # (None: the tail's partial carries its LSE)
                        part_lse[c, kvh * group + j] = T.log2(denom[j]) + head_max[j] * scale
            if tail_merge:
                if members > 1:
                    first = T.alloc_var(i32)
                    first = tail["merge_first"][c]
                    fused.finish(tail, part_o, part_lse, scratch, req, kvh, c, members, {"first": first})

    args = partial_inputs(ctx, num_pages, max_pages, page_size, width, fp8)
    head = list(args)
    args.update(fused.args if tail_merge else partial_args(ctx))
    out_names = fused.partial if tail_merge else ("part_o", "part_lse")

    def body(b):
        outs = [b[n] if n else None for n in out_names]
        partial(*(b[n] for n in head[:2]), b.get("scales"), *(b[n] for n in head[-4:]), *outs,
                {n: b[n] for n in args if n not in head and n not in out_names} if tail_merge else None)

    kind = "fused" if tail_merge else "partial"
    return prim_func(f"decode_{kind}", args, body).with_attr(
        "global_symbol", f"decode_{kind}_{fmt.value}" + ("_fp8" if fp8 else ""))


@hands_out("decode_partial_{fmt}")
def build_decode_partial(geom: AttentionGeometry, fmt: KvFormat | str, **tiling):
    """Compile (JIT) the partial kernel for `geom` and `fmt` with the format's DEFAULTS, overridden by `tiling`."""
    fmt = KvFormat.parse(fmt)
    return compile_program(decode_partial_program(geom, fmt, **{**DEFAULTS[fmt], **tiling}))


@hands_out("decode_fused_{fmt}")
def build_decode_fused(geom: AttentionGeometry, fmt: KvFormat | str, *, tail_hand_off: bool = True, tail=None,
                       **tiling):
    """Compile (JIT) the fused step with the format's DEFAULTS, overridden by `tiling`, and check its hand-off on
    the emitted CUDA. `tail_hand_off=False`: the check's red twin; `tail`: a version's tail for `merge_tail`."""
    fmt = KvFormat.parse(fmt)
    cfg = {**DEFAULTS[fmt], **tiling}
    kernel = compile_program(decode_partial_program(
        geom, fmt, **cfg, tail_merge=True, tail=tail or (lambda ctx: merge_tail(ctx, hand_off=tail_hand_off))))
    check_tail_hand_off(f"decode_fused_{fmt.value}", kernel.get_kernel_source(), threads=cfg["threads"])
    return kernel


@hands_out("decode_partial_{fmt}_fp8")
def build_decode_partial_fp8(geom: AttentionGeometry, fmt: KvFormat | str, **tiling):
    """Compile (JIT) the partial kernel over an FP8 folded pool with its registered params, overridden by `tiling`."""
    fmt = KvFormat.parse(fmt)
    cfg = {**registry.get(f"decode_partial_{fmt.value}_fp8").params, **tiling}
    kernel = compile_program(decode_partial_program(geom, fmt, **cfg, fp8=True))
    check_e4m3_conversion(f"decode_partial_{fmt.value}_fp8", kernel.get_kernel_source(), macros.CONVERT_BARRIER_ID)
    return kernel
