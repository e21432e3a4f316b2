"""Keep the producer loop of TileLang's warp-specialised kernels in the one warp that issues its copies: a rewrite of
the emitted CUDA (`guard_producer_loops`) and its check (`check_producer_guard`); why: kernels/DECODE_SCHEDULE.md, "The
producer warpgroup". A kernel opts in by carrying `MARK` in its imported source (`imported_source`): every other
TileLang kernel of the process is left alone, and a kernel cached before the rewrite existed has another cache key."""

from __future__ import annotations

import functools
import re

from .cuda_checks import PRODUCER_BRANCH, _match

MARK = "// foldkv.kernels.producer_guard: the producer loop runs in the warp that issues its copies"
POSTPROC = "tilelang_callback_cuda_postproc"
GUARD = "if (((int)threadIdx.x) < 32) {  // producer_guard: warps 1-3 of the producer do not wait"

_ELECT = re.compile(r"^if \(tl::tl_shuffle_elect<(\d+)>\(\)\) \{$")
# what warps 1-3 may do outside the elected thread's block: control flow, local integers, reads, waits, a fence
_ALLOWED = [re.compile(p) for p in (
    r"^#pragma unroll$",
    r"^for \(int \w+ = [^;]*; [^;]*; \+\+\w+\) \{$",
    r"^if \(.*\) \{$",
    r"^\} else \{$",
    r"^\}$",
    r"^int \w+( = [^;]*)?;$",
    r"^\w+ = [^;]*;$",
)]
_WAIT_OR_FENCE = [re.compile(p) for p in (r"^mbarrier\[[^;]*\]\.wait\([^;]*\);$", r"^tl::fence_proxy_async\(\);$")]
# a call in any other line (a side effect the guard would drop): a name followed by "(", but the keywords and the pure
# min / max of TileLang's loop bounds
_CALL = re.compile(r"\b(?!(?:if|for|min|max)\b)[A-Za-z_]\w*\s*\(")


class ProducerGuardError(RuntimeError):
    """A warp-specialised producer branch the guard cannot keep in one warp (it does more than wait), or a kernel
    whose producer loop is not guarded."""


def imported_source(*sources: str | None) -> str:
    """The one text a foldkv kernel passes to `T.import_source`: the mark, then the kernel's own device code (each of
    TileLang's imports is one block attribute, so a kernel imports once). It ends in a newline: TileLang puts the
    text straight before its own first line."""
    return "\n".join([MARK, *[s.rstrip("\n") for s in sources if s]]) + "\n"


def _producer_branches(source: str):
    """(threads, body start, body end) of every producer branch: the body is what follows the register dealloc, up
    to the '}' that closes the branch."""
    found = [(int(m.group(1)), m.end(), _match(source, m.start() + m.group(0).index("{"), "{", "}") - 1)
             for m in PRODUCER_BRANCH.finditer(source)]
    if len(found) != source.count("tl::warpgroup_reg_dealloc<"):
        raise ProducerGuardError("a register dealloc outside the producer branch this guard knows (threadIdx.x < P,"
                                 " then the dealloc): TileLang's warp specialisation changed; see producer_guard.py")
    return found


def _check_body(kernel: str, threads: int, body: str) -> None:
    lines = [ln.strip() for ln in body.split("\n") if ln.strip()]
    skip = 0  # depth inside the elected thread's block
    for ln in lines:
        if skip:
            skip += ln.count("{") - ln.count("}")
            continue
        elect = _ELECT.match(ln)
        if elect:
            if int(elect.group(1)) != threads:
                raise ProducerGuardError(f"{kernel}: the producer of {threads} threads elects among {elect.group(1)}")
            skip = 1
            continue
        if any(p.match(ln) for p in _WAIT_OR_FENCE):
            continue
        if not any(p.match(ln) for p in _ALLOWED) or _CALL.search(ln.split("//")[0]):
            raise ProducerGuardError(f"{kernel}: the producer's warps 1-3 do more than wait, outside the elected"
                                     f" thread's block: {ln!r}; keeping them out of the loop would drop that work")


def guard_producer_loops(source: str, kernel: str = "kernel") -> str:
    """`source` with every warp-specialised producer loop run by warp 0 alone (DECODE_SCHEDULE.md says why); raises
    ProducerGuardError if a producer branch does more than wait outside its elected thread's block."""
    out, last = [], 0
    for threads, start, end in _producer_branches(source):
        body = source[start:end]
        if body.lstrip().startswith(GUARD):
            continue  # already guarded
        _check_body(kernel, threads, body)
        indent = re.match(r"\s*", body).group(0)
        out += [source[last:start], f"{indent}{GUARD}\n", body.rstrip() + "\n", f"{indent}}}", body[len(body.rstrip()):]]
        last = end
    return "".join(out) + source[last:]


def check_producer_guard(kernel: str, source: str) -> dict:
    """Every warp-specialised producer branch of `source` runs its loop under the guard, and nothing after it: raises
    ProducerGuardError otherwise. Returns {"producer_branches": n}."""
    branches = _producer_branches(source)
    for _, start, end in branches:
        body = source[start:end]
        if not body.lstrip().startswith(GUARD):
            raise ProducerGuardError(f"{kernel}: a warp-specialised producer loop without the guard (all four warps wait"
                                     " on its barriers; producer_guard.py). Built without the mark, or with TileLang's"
                                     f" {POSTPROC} replaced after foldkv installed its own?")
        guard_brace = start + body.index(GUARD) + GUARD.index("{")
        if source[_match(source, guard_brace, "{", "}"):end].strip():
            raise ProducerGuardError(f"{kernel}: producer code after the guarded loop")
    return {"producer_branches": len(branches)}


_KERNEL_NAME = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")


def _postproc(previous):
    def postproc(code, target):
        if previous is not None:
            code = previous(code, target)
        if MARK not in code:
            return code
        name = _KERNEL_NAME.search(code)  # for the error, should the rewrite refuse
        return guard_producer_loops(code, name.group(1) if name else "kernel")
    return postproc


@functools.lru_cache(maxsize=None)
def install() -> None:
    """Register the rewrite as TileLang's CUDA post-processing callback (once a process), after any callback already
    registered, which it calls first."""
    import tvm_ffi

    previous = tvm_ffi.get_global_func(POSTPROC, allow_missing=True)
    tvm_ffi.register_global_func(POSTPROC, f=_postproc(previous), override=True)
