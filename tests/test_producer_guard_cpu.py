"""CPU tests of the producer guard (foldkv.kernels.producer_guard): on real generated source, the rewrite TileLang's
post-processing applied is there and checked, and each check has its red twin (the guard taken out, work the guard
would drop, code after it, an election over the wrong threads, an unguarded kernel handed out by a builder).

    python -m pytest tests/test_producer_guard_cpu.py -v
"""

from __future__ import annotations

import pytest
from conftest import require_tilelang

import foldkv
from foldkv import KvFormat
from foldkv.kernels import producer_guard as pg
from foldkv.kernels import registry

GEOM = foldkv.GEMMA4_31B


@pytest.fixture(scope="module")
def guarded() -> str:
    require_tilelang()
    from foldkv.kernels.decode_partial import build_decode_fused

    return build_decode_fused(GEOM, KvFormat.SPLIT).get_kernel_source()  # the registry's check already ran on it


def _unguarded(source: str) -> str:
    """The kernel as TileLang emits it without the rewrite: the guard's line and its closing brace taken out."""
    lines = source.split("\n")
    (at,) = [i for i, ln in enumerate(lines) if pg.GUARD in ln]
    indent = lines[at][:len(lines[at]) - len(lines[at].lstrip())]
    close = next(i for i in range(at + 1, len(lines)) if lines[i] == indent + "}" and lines[i + 1].strip() == "}")
    return "\n".join(lines[:at] + lines[at + 1:close] + lines[close + 1:])


def test_generated_kernel_is_guarded(guarded):
    assert pg.MARK in guarded
    assert pg.check_producer_guard("decode_fused_split", guarded) == {"producer_branches": 1}
    body = guarded[guarded.index(pg.GUARD):]
    assert body.index("mbarrier[2].wait(") < body.index("tl::tma_load(pool_desc")  # the loop is inside the guard


def test_rewrite_of_the_unguarded_kernel_is_what_tilelang_emitted(guarded):
    """The guard taken out and put back by the rewrite gives the generated source byte for byte; rewriting twice
    changes nothing."""
    raw = _unguarded(guarded)
    assert pg.GUARD not in raw
    assert pg.guard_producer_loops(raw) == guarded
    assert pg.guard_producer_loops(guarded) == guarded


def test_check_refuses_unguarded_kernel(guarded):
    with pytest.raises(pg.ProducerGuardError, match="without the guard"):
        pg.check_producer_guard("decode_fused_split", _unguarded(guarded))


@pytest.mark.parametrize("work", [
    "((int*)k_s)[threadIdx.x] = page;",  # a store by every producer thread
    "condval = atomicAdd(((int*)page_ids), 1);",  # an allowed shape (an assignment), but a call with a side effect
])
def test_rewrite_refuses_a_producer_that_does_more_than_wait(guarded, work):
    """Work by every producer thread outside the elected block: dropping warps 1-3 would drop their share."""
    raw = _unguarded(guarded)
    at = raw.index("      int page = condval;\n")
    broken = raw[:at] + "      " + work + "\n" + raw[at:]
    with pytest.raises(pg.ProducerGuardError, match="do more than wait"):
        pg.guard_producer_loops(broken, "decode_fused_split")


def test_rewrite_refuses_an_election_over_other_threads(guarded):
    raw = _unguarded(guarded)
    first = raw.index("if (tl::tl_shuffle_elect<128>()) {\n        mbarrier[0]")
    broken = raw[:first] + raw[first:].replace("tl_shuffle_elect<128>", "tl_shuffle_elect<64>", 1)
    with pytest.raises(pg.ProducerGuardError, match="elects among 64"):
        pg.guard_producer_loops(broken, "decode_fused_split")


def test_check_refuses_producer_code_after_the_guard(guarded):
    at = guarded.index(pg.GUARD)
    close = guarded.index("\n  } else {", at)
    broken = guarded[:close] + "\n    mbarrier[2].wait(0);" + guarded[close:]
    with pytest.raises(pg.ProducerGuardError, match="after the guarded loop"):
        pg.check_producer_guard("decode_fused_split", broken)


def test_postproc_rewrites_marked_sources_only(guarded):
    """A TileLang kernel of someone else's (no mark) passes through untouched; a callback registered before ours
    still runs, first."""
    raw = _unguarded(guarded)
    seen = []
    chained = pg._postproc(lambda code, target: seen.append(target) or code)
    assert chained(raw.replace(pg.MARK, "// another kernel"), "t1") == raw.replace(pg.MARK, "// another kernel")
    assert chained(raw, "t2") == guarded
    assert seen == ["t1", "t2"]


def test_registered_builder_refuses_an_unguarded_kernel(guarded):
    """A kernel whose source lacks the guard (one cached before the rewrite, or built with the callback replaced) is
    refused where every registered builder hands out its kernels."""
    class Kernel:
        def get_kernel_source(self):
            return _unguarded(guarded)

    @registry.hands_out("decode_fused_{fmt}")
    def build(geom, fmt: str):
        return Kernel()

    with pytest.raises(pg.ProducerGuardError, match="decode_fused_split: a warp-specialised producer loop without"):
        build(GEOM, "split")


def test_kernels_without_warp_specialisation_pass():
    assert pg.check_producer_guard("plain", "__global__ void k() { int x = 0; }") == {"producer_branches": 0}
    assert pg.guard_producer_loops("__global__ void k() {}") == "__global__ void k() {}"
