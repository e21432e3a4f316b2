"""The kernels at one tensor-parallel rank's geometry (preset gemma-4-31b-tp2: 16 query heads over 2 KV heads of 512,
what a FoldKvCache holds on each of 2 ranks under transformers' tp_plan="auto"): the decode gate (folded and split
pools; eager, fused or three launches, and through the workspace's CUDA graph), the prefill gate and the graph walk,
each against the float64 reference on the gates' hostile inputs, through the JIT and through the AOT build made for
that geometry (bit for bit equal to the JIT). Red twins: a stale plan in the graph walk is caught; the rank's build
is refused for a 31B pool (tests/test_gates_cpu.py: a query of the 31B's 32 heads refused on a rank's pool, geometries
no kernel serves refused by the gates).

    FOLDKV_REQUIRE_GPU=1 FOLDKV_AOT_TP2_TEST_DIR=build/aot-tp2 python3 -m pytest tests/test_per_rank_geometry_gpu.py

The AOT build: `python -m foldkv aot build --arch sm_90a --geometry gemma-4-31b-tp2 --out build/aot-tp2`
(scripts/prepare_device_run.sh makes it); without $FOLDKV_AOT_TP2_TEST_DIR the AOT tests skip (fail under
FOLDKV_REQUIRE_GPU=1).
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import require_hopper, require_module, require_tilelang, skip_or_fail

import foldkv as fk
from foldkv.lab import gates

pytestmark = pytest.mark.gpu

GEOM = fk.PRESETS["gemma-4-31b-tp2"]
FORMATS = list(fk.KvFormat)  # parsed: the gates below the sections take a KvFormat
FORMAT_IDS = [f.value for f in FORMATS]
# the smoke set's shapes (edges 1, 63, 64, 65, chunk boundaries, ragged batches up to 128, peaked, spread) and the
# long single request of the full set: every decode gate case at the sizes that keep this file short on an H200
DECODE = {c.name: c for c in gates.decode_cases("smoke")} | {"len10602": gates.Case("len10602", (10602,))}
GRAPH_CASES = ["len1", "len63", "len64", "len65", "len10602", "ragged4", "ragged128"]
PREFILL = {c.name: c for c in gates.prefill_cases("smoke")}
STEPS = {"auto": None, "three-launch": False}  # the decode's fused argument: one launch within a wave, or three
AOT_DIR_ENV = "FOLDKV_AOT_TP2_TEST_DIR"


def _check(res):
    assert res["passed"], {k: v for k, v in res.items() if k != "outputs"}


def _inputs(case, fmt, device):
    inputs = gates.make_inputs(case, fmt, device, seed=len(case.name), geom="gemma-4-31b-tp2")
    assert inputs.pool.geometry == GEOM and inputs.query.shape[1:] == (16, 512)
    assert inputs.pool.data.shape[1] == 2  # the rank's 2 KV heads
    return inputs


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("name", list(DECODE))
def test_decode_gate_eager(cuda_device, name, fmt, step):
    _check(gates.run_case(_inputs(DECODE[name], fmt, cuda_device), gates.decode_arm("jit", fused=STEPS[step])))


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("name", GRAPH_CASES)
def test_decode_gate_workspace_graph(cuda_device, name, fmt, step):
    _check(gates.run_case(_inputs(DECODE[name], fmt, cuda_device), gates.graph_arm("jit", fused=STEPS[step])))


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_gate(cuda_device, name, fmt):
    _check(gates.run_case(_inputs(PREFILL[name], fmt, cuda_device), gates.prefill_arm("jit")))


@pytest.mark.parametrize("update", ["advance", "plan"])
@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_graph_walk(cuda_device, fmt, update):
    res = gates.graph_walk(fmt, update=update, max_batch=len(gates.WALK_LENGTHS) + 1, steps=32, device=cuda_device,
                           geom="gemma-4-31b-tp2")
    assert res["passed"], [r for r in res["steps"] if not r["passed"]][:3]
    assert res["chunks"] >= len(gates.WALK_LENGTHS)


def test_graph_walk_red_twin_stale_plan_is_caught(cuda_device):
    res = gates.graph_walk(fk.KvFormat.FOLDED, steps=4, stale=True, check_every=1, device=cuda_device,
                           geom="gemma-4-31b-tp2")
    assert not res["passed"]


def test_prefill_last_row_equals_decode(cuda_device, tmp_path):
    from foldkv.lab.report import RunRecord

    rows = gates.last_row_gate(FORMATS, 3, RunRecord("02_correctness_gates", tmp_path), geom="gemma-4-31b-tp2")
    assert len(rows) == 2 and all(r["passed"] for r in rows), rows


# --- AOT: the build made for the rank's geometry ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp2_build():
    require_hopper()
    require_tilelang()
    require_module("cuda.bindings")
    from foldkv import aot

    path = os.environ.get(AOT_DIR_ENV)
    if not (path and os.path.exists(os.path.join(path, "manifest.json"))):
        skip_or_fail(f"${AOT_DIR_ENV} names no AOT build (make one: python -m foldkv aot build --arch sm_90a"
                     " --geometry gemma-4-31b-tp2 --out build/aot-tp2)")
    b = aot.use_build(path)
    assert b.manifest["geometry_name"] == "gemma-4-31b-tp2"
    yield b
    aot.use_build(None)


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _aot_equals_jit(inputs, jit_arm, aot_arm):
    jit, aot = gates.run_case(inputs, jit_arm), gates.run_case(inputs, aot_arm)
    _check(jit)
    _check(aot)
    for a, b in zip(jit["outputs"], aot["outputs"]):
        assert torch.equal(_bits(a), _bits(b)), "AOT and JIT outputs differ"


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("name", ["len1", "len63", "len65", "chunk+1", "len10602", "ragged128", "peaked"])
def test_aot_decode_gate(tp2_build, cuda_device, name, fmt):
    inputs = _inputs(DECODE[name], fmt, cuda_device)
    _aot_equals_jit(inputs, gates.decode_arm("jit"), gates.decode_arm("aot"))
    if name in GRAPH_CASES:
        _aot_equals_jit(inputs, gates.graph_arm("jit", fused=False), gates.graph_arm("aot", fused=False))


def test_notebook_sections_at_the_ranks_geometry(tp2_build, cuda_device, tmp_path):
    """Notebook 02's decode and prefill sections at the rank's geometry: every prefill case and the graph cases of the
    decode, both formats, JIT against the reference, AOT == JIT bit for bit, folded against split; the verdict."""
    from foldkv.lab.report import RunRecord

    rec = RunRecord("02_correctness_gates", tmp_path)
    for cases, section in (([DECODE[n] for n in GRAPH_CASES], "decode_gates"), (list(PREFILL.values()),
                                                                                 "prefill_gates")):
        gates.run_kernel_gates(cases, FORMATS, ["jit", "aot"], 0, tp2_build.dir, rec, section, geom="gemma-4-31b-tp2")
    rows = rec.results["gates"]
    assert len(rows) == 2 * (len(GRAPH_CASES) + len(PREFILL))
    assert all(r["passed"] and r["aot_bit_identical"] for r in rows), [r for r in rows if not r["passed"]
                                                                     or not r["aot_bit_identical"]]
    verdict = gates.record_verdict(rec)
    assert [v["status"] for v in verdict] == ["pass", "pass"], verdict


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_aot_graph_walk(tp2_build, cuda_device, fmt):
    res = gates.graph_walk(fmt, steps=16, max_batch=len(gates.WALK_LENGTHS) + 1, backend="aot", device=cuda_device,
                           geom="gemma-4-31b-tp2")
    assert res["passed"], [r for r in res["steps"] if not r["passed"]][:3]


def test_red_twin_the_ranks_build_is_refused_for_a_31b_pool(tp2_build, cuda_device):
    """The rank's build is the active one: a decode of the 31B's pool through backend="aot" is refused by the
    resolver (the manifest's geometry differs) with nothing written."""
    from foldkv.aot import AotMismatchError

    inputs = gates.make_inputs(DECODE["len65"], fk.KvFormat.FOLDED, cuda_device, seed=1)  # the 31B: 32 over 4 heads
    out, lse = gates.poisoned_outputs(1, fk.GEMMA4_31B, cuda_device, pad_rows=0)
    with pytest.raises(AotMismatchError, match="geometry differs"):
        gates.decode_arm("aot")(inputs, out, lse)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
