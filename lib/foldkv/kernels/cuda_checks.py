"""Checks on the emitted CUDA (what runs, so a barrier a compiler pass dropped or moved is caught too) of the barriers
a kernel's correctness rests on: the in-place merges (`check_in_place_merge`), the FP8 kernels' e4m3 conversion
(`check_e4m3_conversion`) and the fused decode's hand-off (`check_tail_hand_off`).

The in-place rule: every store into, and every read of, a buffer the kernel both reads and stores (a non-const pointer
parameter) are separated in source order by a `__syncthreads();` at the top level of the body (brace depth 1, so every
thread reaches it). The rule reads the body as straight-line code, which the merges are (their loops hold reads only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class BarrierCheckError(RuntimeError):
    """An in-place kernel whose store is not separated from its reads by an unconditional __syncthreads()."""


@dataclass(frozen=True)
class BarrierReport:
    kernel: str
    in_place_buffers: tuple[str, ...]
    last_read: int | None  # character offsets in the kernel body: the last read before the first store (None: the
    barrier: int | None  # kernel stores before it reads), the first unconditional barrier between them,
    first_store: int  # the first store
    pairs_checked: int  # (read, store) pairs of one buffer found separated by an unconditional barrier


_SYNC = "__syncthreads();"


def _match(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket that closes the one at text[start]."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i + 1
    raise BarrierCheckError(f"unbalanced {open_ch}{close_ch} in the emitted source")


def kernel_definition(source: str, kernel: str) -> tuple[str, str]:
    """(parameter list, body) of the `__global__` definition of `kernel` (TileLang names it `<name>_kernel`)."""
    pattern = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(" + re.escape(kernel)
                         + r"(?:_kernel)?)\s*\(")
    for m in pattern.finditer(source):
        params_end = _match(source, m.end() - 1, "(", ")")
        rest = source[params_end:].lstrip()
        if rest.startswith("{"):
            body_start = source.index("{", params_end)
            body_end = _match(source, body_start, "{", "}")
            return source[m.end():params_end - 1], source[body_start:body_end]
    raise BarrierCheckError(f"{kernel}: no __global__ definition of it in the emitted source")


def _mutable_pointer_params(params: str) -> list[str]:
    return [re.findall(r"[A-Za-z_]\w*", p)[-1] for p in params.split(",")
            if "*" in p and not re.search(r"\bconst\b", p)]


def _accesses(body: str, name: str) -> tuple[list[int], list[int]]:
    """Offsets of the reads and of the stores of buffer `name` in `body`."""
    reads, stores = [], []
    for m in re.finditer(r"\b" + re.escape(name) + r"\b", body):
        i = m.end()
        end = None
        if body[i:].lstrip().startswith("["):  # name[idx] = ...
            end = _match(body, body.index("[", i), "[", "]")
        else:  # *(float4*)(name + off) = ...
            cast = re.search(r"\*\s*\(\s*[\w:]+\s*\*\s*\)\s*\(\s*$", body[max(0, m.start() - 64):m.start()])
            if cast:
                end = _match(body, body.rindex("(", 0, m.start()), "(", ")")
        if end is not None:
            after = body[end:].lstrip()
            if after.startswith("=") and not after.startswith("=="):
                stores.append(m.start())
                continue
        reads.append(m.start())
    return reads, stores


def check_in_place_merge(kernel: str, source: str) -> BarrierReport:
    """Raise BarrierCheckError (naming `kernel`) unless every store to an in-place buffer of `kernel` is separated
    from every read of that buffer by an unconditional `__syncthreads()`; return what was found otherwise."""
    params, body = kernel_definition(source, kernel)
    found = {name: _accesses(body, name) for name in _mutable_pointer_params(params)}
    accesses = {name: (r, s) for name, (r, s) in found.items() if r and s}
    if not accesses:
        raise BarrierCheckError(f"{kernel}: registered as an in-place merge but no buffer is both read and stored")
    barriers = [m.start() for m in re.finditer(re.escape(_SYNC), body)]
    unconditional = [b for b in barriers if body.count("{", 0, b) - body.count("}", 0, b) == 1]  # brace depth 1
    pairs = 0
    for name, (reads, stores) in accesses.items():
        for s in stores:
            for r in reads:
                lo, hi = min(r, s), max(r, s)
                if any(lo < b < hi for b in unconditional):
                    pairs += 1
                    continue
                where = "only inside a conditional or loop" if any(lo < b < hi for b in barriers) else "none"
                order = "after a read of it" if r < s else "before a read of it"
                raise BarrierCheckError(
                    f"{kernel}: the store to {name} at {s} is {order} at {r} with no unconditional"
                    f" __syncthreads() between them ({where} between them)"
                )
    in_place = tuple(accesses)
    first_store = min(s for _, stores in accesses.values() for s in stores)
    last_read = max((r for reads, _ in accesses.values() for r in reads if r < first_store), default=None)
    barrier = None if last_read is None else min(b for b in unconditional if last_read < b < first_store)
    return BarrierReport(kernel, in_place, last_read, barrier, first_store, pairs)


# --- the e4m3 conversion's barriers (FP8 partial and prefill) -------------------------------------------------------
class ConversionCheckError(RuntimeError):
    """An FP8 kernel whose e4m3 conversion calls do not carry the barriers the tiles they write need."""


_OTHER_BARRIERS = (re.compile(r"__sync_thread_partial\(\s*(\d+)"), re.compile(r"bar\.(?:sync|arrive)\s+(\d+)"),
                   re.compile(r"named_barrier_arrive\(\s*(\d+)"), re.compile(r"NamedBarrier<[^>]*>::sync<(\d+)>"))


def _tilelang_barrier_ids(body: str) -> set[int]:
    """The named-barrier ids the barriers TileLang placed in a kernel body use."""
    taken = {int(m.group(1)) for pattern in _OTHER_BARRIERS for m in pattern.finditer(body)}
    if "NamedBarrier<" in body:  # TileLang's block reductions sync on phase 1 unless told otherwise
        taken.add(1)
    return taken


def check_e4m3_conversion(kernel: str, source: str, barrier_id: int,
                          calls: tuple[str, ...] = ("foldkv_e4m3x8_to_bf16",)) -> dict:
    """Raise ConversionCheckError (naming `kernel`) unless its e4m3 -> bf16 calls (or the opaque shared-memory writers
    named in `calls`, whose first four arguments are the same) carry the tile's barriers: exactly one call opens a
    tile and exactly one closes it, all on named barrier `barrier_id`, which no barrier TileLang placed uses, over
    the consumer threads (the launch's less the producer warpgroup)."""
    _, body = kernel_definition(source, kernel)
    calls = [tuple(int(g) for g in m.groups()) for name in calls
             for m in re.finditer(rf"\b{re.escape(name)}\(\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*,", body)]
    if not calls:
        raise ConversionCheckError(f"{kernel}: no e4m3 conversion call in the emitted source")
    firsts, lasts = sum(c[0] for c in calls), sum(c[1] for c in calls)
    if firsts != 1 or lasts != 1:
        raise ConversionCheckError(f"{kernel}: {firsts} conversion calls open a tile and {lasts} close it; one each "
                                   "is what keeps the gemms and the conversion apart")
    ids = {c[2] for c in calls}
    if ids != {barrier_id}:
        raise ConversionCheckError(f"{kernel}: conversion calls on barriers {sorted(ids)}, expected {barrier_id}")
    taken = _tilelang_barrier_ids(body)
    if barrier_id in taken:
        raise ConversionCheckError(f"{kernel}: named barrier {barrier_id} is also used by a barrier TileLang placed")
    bounds = re.search(r"__launch_bounds__\((\d+)", source[:source.find(body)])
    consumers = {c[3] for c in calls}
    if bounds is None or consumers != {int(bounds.group(1)) - 128}:
        raise ConversionCheckError(f"{kernel}: conversion barriers count {sorted(consumers)} threads; the consumer "
                                   f"warpgroups hold {int(bounds.group(1)) - 128 if bounds else '?'}")
    return {"kernel": kernel, "calls": len(calls), "barrier_id": barrier_id, "threads": consumers.pop(),
            "other_barrier_ids": sorted(taken)}


# --- the fused decode's hand-off (decode_fused_<format>) -------------------------------------------------------------
class HandOffCheckError(RuntimeError):
    """A fused decode whose tail merge could read a partial before every member has written it."""


_HAND_OFF_CALL = re.compile(r"\bfoldkv_tail_hand_off\(\s*(\w+)\s*,[^;]*?,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)\s*;")
# a warp-specialised producer branch as TileLang 0.1.15 emits it: threads [0, P) deallocate registers, then loop (also
# what producer_guard rewrites)
PRODUCER_BRANCH = re.compile(r"if \(\(\(int\)threadIdx\.x\) < (\d+)\) \{\n\s*tl::warpgroup_reg_dealloc<\d+>\(\);\n")


def check_tail_hand_off(kernel: str, source: str, threads: int) -> dict:
    """Raise HandOffCheckError (naming `kernel`) unless it hands off as `macros.TAIL_SOURCE` needs: exactly one call,
    in the consumer branch, led by thread 128, after every store into the partials and before every read of them,
    over the `threads` consumer threads on a named barrier no barrier TileLang placed uses."""
    _, body = kernel_definition(source, kernel)
    calls = list(_HAND_OFF_CALL.finditer(body))
    if len(calls) != 1:
        raise HandOffCheckError(f"{kernel}: {len(calls)} hand-off calls in the emitted source; the tail merge needs"
                                " exactly one between the partials' stores and their reads")
    call = calls[0]
    leader, barrier_id, count = (int(g) for g in call.groups()[1:])
    producer = PRODUCER_BRANCH.search(body)
    if producer is None or producer.group(1) != "128" or leader != 128:
        raise HandOffCheckError(f"{kernel}: the leader is thread {leader}, but the first consumer thread is 128 only"
                                " when the producer warpgroup is threads [0, 128), which the source does not show")
    branch_end = _match(body, body.index("{", producer.start()), "{", "}")
    if call.start() < branch_end:
        raise HandOffCheckError(f"{kernel}: the hand-off is in the producer branch")
    if count != threads:
        raise HandOffCheckError(f"{kernel}: the hand-off's barrier counts {count} threads; the consumers are"
                                f" {threads}")
    taken = _tilelang_barrier_ids(body)
    if barrier_id in taken or barrier_id == 0:
        raise HandOffCheckError(f"{kernel}: named barrier {barrier_id} is also used by a barrier TileLang placed")
    for name in ("part_o", "part_lse"):
        reads, stores = _accesses(body, name)
        late = [s for s in stores if s > call.start()]
        early = [r for r in reads if r < call.start()]
        if late or early or not stores or not reads:
            raise HandOffCheckError(f"{kernel}: {name} has {len(stores)} stores ({len(late)} after the hand-off) and"
                                    f" {len(reads)} reads ({len(early)} before it); every store must come before it"
                                    " and every read after it")
    return {"kernel": kernel, "barrier_id": barrier_id, "threads": count, "leader": leader,
            "other_barrier_ids": sorted(taken)}
