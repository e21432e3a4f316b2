"""The emitted-CUDA barrier check for in-place merges: a store into a buffer the kernel also reads must be separated
from every read of that buffer by an unconditional `__syncthreads()`.

An in-place merge reads every member of a group (other threads read the slot it is about to overwrite) and then
stores into the group's first slot. Without a block-wide barrier between the last read and the first store, a fast
warp can overwrite the slot while a slow warp still reads it. The check works on the CUDA source TileLang emits (what
actually runs), not on the Python program, so a barrier dropped or moved by a compiler pass is caught too.

What it requires, for the kernel named in the call:
- "in-place buffers" are the kernel's non-const pointer parameters that the body both reads and stores;
- there is a `__syncthreads();` at the top level of the kernel body (brace depth 1: not inside an `if`, a loop or a
  nested block, so every thread reaches it);
- that barrier lies after the last read of every in-place buffer and before the first store to any of them.
Anything else raises `BarrierCheckError` naming the kernel.
"""

import re
from dataclasses import dataclass


class BarrierCheckError(RuntimeError):
    """An in-place kernel whose store is not separated from its reads by an unconditional __syncthreads()."""


@dataclass(frozen=True)
class BarrierReport:
    kernel: str
    in_place_buffers: tuple[str, ...]
    last_read: int  # character offsets in the kernel body
    barrier: int
    first_store: int


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
    names = []
    for p in params.split(","):
        p = p.strip()
        if "*" in p and not re.search(r"\bconst\b", p):
            names.append(re.findall(r"[A-Za-z_]\w*", p)[-1])
    return names


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


def _depth_at(body: str, pos: int) -> int:
    return body.count("{", 0, pos) - body.count("}", 0, pos)


def check_in_place_merge(kernel: str, source: str) -> BarrierReport:
    """Raise BarrierCheckError (naming `kernel`) unless every store to an in-place buffer of `kernel` is separated
    from all reads of those buffers by an unconditional `__syncthreads()`; return what was found otherwise."""
    params, body = kernel_definition(source, kernel)
    in_place, reads, stores = [], [], []
    for name in _mutable_pointer_params(params):
        r, s = _accesses(body, name)
        if r and s:
            in_place.append(name)
            reads += r
            stores += s
    if not in_place:
        raise BarrierCheckError(f"{kernel}: registered as an in-place merge but no buffer is both read and stored")
    last_read, first_store = max(reads), min(stores)
    if first_store < last_read:
        raise BarrierCheckError(
            f"{kernel}: a store to {in_place} comes before the last read of the group (store at {first_store}, read"
            f" at {last_read}): no barrier can order them"
        )
    barriers = [m.start() for m in re.finditer(re.escape(_SYNC), body) if last_read < m.start() < first_store]
    unconditional = [b for b in barriers if _depth_at(body, b) == 1]
    if not unconditional:
        where = "only inside a conditional or loop" if barriers else "none"
        raise BarrierCheckError(
            f"{kernel}: the store to the merged slot of {in_place} is not separated from the group's reads by an"
            f" unconditional __syncthreads() ({where} between them)"
        )
    return BarrierReport(kernel, tuple(in_place), last_read, unconditional[0], first_store)
