"""AOT vs JIT on the GPU: every gate case of decode and prefill, both formats, gives bit-identical outputs and LSE
through the AOT cubins (cuda-python driver launches) and the TileLang JIT; a cold process that imports only the AOT path (TileLang blocked) decodes correctly.

    FOLDKV_REQUIRE_GPU=1 python3 -m pytest tests/test_aot_gpu.py

The AOT build is made once per module (every registered kernel, `foldkv.aot.build.build`), or taken from
$FOLDKV_AOT_TEST_DIR when that folder holds a build (it is verified first). Gate inputs come from `foldkv.lab.gates`
(hostile pools: NaN/Inf in unused pages, poisoned page-table padding, NaN-poisoned outputs with rows past the plan).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import require_hopper, require_module, require_tilelang

from foldkv import GEMMA4_31B, KvFormat
from foldkv.kernels.workspace import capture_graph
from foldkv.lab import gates

pytestmark = pytest.mark.gpu
FORMATS = [KvFormat.SPLIT, KvFormat.FOLDED]
GATE_SIZE = os.environ.get("FOLDKV_GATE_CASES", "full")  # "smoke" shrinks the long lengths


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16}.get(t.element_size(), torch.int32))


@pytest.fixture(scope="module")
def aot_build(tmp_path_factory):
    """The AOT build every test here uses (made for sm_90a, the default geometry), made the active build."""
    require_hopper()
    require_tilelang()
    require_module("cuda.bindings")
    from foldkv import aot

    from tilelang.env import env as tl_env

    # With FOLDKV_AOT_TEST_DIR (the H200 run: cubins built on the CPU machine, the JIT compiled on the device from an
    # empty cache) the two arms are independent compilations. Without it the build is made here with TileLang's cache
    # off and the launchers' in-process caches emptied, so its fresh compiles fill the builders' caches (TileLang
    # lowering is not deterministic across processes: e.g. which of two reduction workspaces gets which name).
    cache_was_on = tl_env.is_cache_enabled()
    path = os.environ.get("FOLDKV_AOT_TEST_DIR")
    if not (path and os.path.exists(os.path.join(path, "manifest.json"))):
        tl_env.disable_cache()
        _clear_jit_caches()
        path = str(tmp_path_factory.mktemp("aot") / "build")
        aot.build(path, arch="sm_90a", log=None)
    b = aot.use_build(path)
    yield b
    aot.use_build(None)
    if cache_was_on:
        tl_env.enable_cache()


def _clear_jit_caches() -> None:
    """Forget every kernel the launchers hold from earlier tests of the session (they all resolve through one cache)."""
    from foldkv.kernels import resolve

    resolve.clear_cache()


def _aot_vs_jit(case: gates.Case, fmt: KvFormat, device, seed: int) -> dict:
    """Both arms on the same hostile inputs; each held to the float64 reference by gates.run_case (poisoned outputs,
    rows past the plan untouched, pool untouched); then their outputs and LSE compared bit for bit."""
    inp = gates.make_inputs(case, fmt, device, seed)
    jit = gates.run_case(inp, gates.arm_for(case, "jit"))
    aot = gates.run_case(inp, gates.arm_for(case, "aot"))
    (jo, jl), (ao, al) = jit["outputs"], aot["outputs"]
    row = {"case": case.name, "format": fmt.value, "jit_passed": jit["passed"], "aot_passed": aot["passed"],
           "out_bit_identical": torch.equal(bits(jo), bits(ao)), "lse_bit_identical": torch.equal(bits(jl), bits(al)),
           "out_mismatches": int((bits(jo) != bits(ao)).sum()), "lse_mismatches": int((bits(jl) != bits(al)).sum())}
    print(json.dumps(row))
    return row


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("case", gates.decode_cases(GATE_SIZE), ids=lambda c: c.name)
def test_decode_aot_bit_identical_to_jit(aot_build, cuda_device, case, fmt):
    row = _aot_vs_jit(case, fmt, cuda_device, seed=11)
    assert row["jit_passed"] and row["aot_passed"], row
    assert row["out_bit_identical"] and row["lse_bit_identical"], row


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("lens", [[10602], [54, 16384, 97]], ids=lambda n: f"B{len(n)}")
def test_decode_aot_steps_chained_in_a_graph_match_jit(aot_build, cuda_device, fmt, lens):
    """Four AOT decode steps sharing one plan, captured in one CUDA graph, each step's partial overwriting the slots
    the previous step's merge reads: every step's output equals the JIT decode of its query bit for bit, on every
    replay."""
    from foldkv.kernels.decode import decode, plan_decode

    case = gates.Case(name="graph-chain", seq_lens=tuple(lens))
    inp = gates.make_inputs(case, fmt, cuda_device, seed=17)
    g = torch.Generator(device=cuda_device).manual_seed(17)
    queries = [torch.randn(inp.query.shape, generator=g, device=cuda_device).to(torch.bfloat16) for _ in range(4)]
    plan = plan_decode(inp.pool.layout, lens, device=cuda_device)
    want = [decode(inp.pool, q, inp.table, plan=plan, backend="jit") for q in queries]
    decode(inp.pool, queries[0], inp.table, plan=plan, backend="aot")  # checked once, loads the cubins
    outs = [(torch.empty_like(o), torch.empty_like(l)) for o, l in want]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), capture_graph(graph, stream=stream):
        for q, (o, l) in zip(queries, outs):
            decode(inp.pool, q, inp.table, plan=plan, out=o, lse=l, backend="aot", check=False)
    for _ in range(3):
        for o, l in outs:
            o.fill_(float("nan"))
            l.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for (o, l), (wo, wl) in zip(outs, want):
            assert torch.equal(bits(o), bits(wo)) and torch.equal(bits(l), bits(wl))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("case", gates.prefill_cases(GATE_SIZE), ids=lambda c: c.name)
def test_prefill_aot_bit_identical_to_jit(aot_build, cuda_device, case, fmt):
    row = _aot_vs_jit(case, fmt, cuda_device, seed=13)
    assert row["jit_passed"] and row["aot_passed"], row
    assert row["out_bit_identical"] and row["lse_bit_identical"], row


@pytest.mark.parametrize("fp8_rows", ["gather", "in_kernel"])
def test_fp8_prefill_aot_bit_identical_to_jit(aot_build, cuda_device, fp8_rows):
    """A ragged prefill over a hostile FP8 pool through both backends, both ways of reading the rows ("gather": the
    page gather's cubin and the bf16 prefill's; "in_kernel": the FP8 prefill's): each passes its gate, and the two
    agree bit for bit; so does the gathered bf16 pool itself."""
    from foldkv.lab.page_gather import bf16_pages

    case = gates.Case("ragged_fp8", (97, 2113, 300, 1), q_lens=(97, 54, 1, 1))
    inp = gates.make_inputs(case, KvFormat.FOLDED, cuda_device, seed=17, dtype=torch.float8_e4m3fn)
    jit = gates.run_case(inp, gates.prefill_arm("jit", fp8_rows))
    aot = gates.run_case(inp, gates.prefill_arm("aot", fp8_rows))
    assert jit["passed"] and aot["passed"]
    for a, b in zip(jit["outputs"], aot["outputs"]):
        assert torch.equal(bits(a), bits(b))
    if fp8_rows == "gather":
        pools = [bf16_pages(inp.pool, inp.table, backend=b)[0] for b in ("jit", "aot")]
        torch.cuda.synchronize()
        assert torch.equal(bits(pools[0].data), bits(pools[1].data))


def test_aot_kernel_refuses_a_pool_of_another_geometry_on_device(aot_build, cuda_device):
    from foldkv import AttentionGeometry, FoldKvInputError
    from foldkv.aot import AotMismatchError, aot_kernel

    with pytest.raises(AotMismatchError):
        aot_kernel("decode_partial_folded", geometry=AttentionGeometry(num_q_heads=16, num_kv_heads=2),
                   fmt="folded")
    with pytest.raises(AotMismatchError):
        aot_kernel("decode_partial_split", geometry=GEMMA4_31B, fmt="folded")
    k = aot_kernel("merge_groups", geometry=GEMMA4_31B)
    part_o = torch.zeros(4, 16, 512, device=cuda_device)  # 16 heads: the build has 32
    with pytest.raises(FoldKvInputError, match="part_o has shape"):
        k(part_o, torch.zeros(4, 16, device=cuda_device), torch.zeros(1, dtype=torch.int32, device=cuda_device),
          torch.ones(1, dtype=torch.int32, device=cuda_device))


COLD_SCRIPT = r"""
import json, sys
class BlockTileLang:  # any TileLang / TVM import in this process is an error
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('tilelang', 'tvm'):
            raise ImportError('cold AOT process must not import ' + name)
sys.meta_path.insert(0, BlockTileLang())
import torch
import foldkv
from foldkv import KvFormat
from foldkv.lab import gates
from foldkv.kernels.decode import decode
fmt = KvFormat(sys.argv[1])
inp = gates.make_inputs(gates.Case("cold", (1000, 77, 4097)), fmt, "cuda", seed=21)
out_buf, lse_buf = gates.poisoned_outputs(3, inp.pool.geometry, inp.pool.device, pad_rows=0)
out, lse = decode(inp.pool, inp.query, inp.table, out=out_buf, lse=lse_buf, backend="aot")
torch.cuda.synchronize()
ref, ref_lse, pv_abs = gates.reference_with_scales(inp.pool, inp.query, inp.table)
res = gates.compare(out, ref, pv_abs)
res["lse_max_abs"] = float((lse.double() - ref_lse).abs().max())
res["tilelang_imported"] = any(m.split('.')[0] in ('tilelang', 'tvm') for m in sys.modules)
res["cuda_bindings_used"] = 'cuda.bindings.driver' in sys.modules
print(json.dumps(res))
"""


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.value)
def test_cold_process_decodes_through_aot_only(aot_build, cuda_device, fmt):
    env = dict(os.environ, FOLDKV_AOT_DIR=aot_build.dir)
    res = subprocess.run([sys.executable, "-c", COLD_SCRIPT, fmt.value], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    row = json.loads(res.stdout.strip().splitlines()[-1])
    print(json.dumps(row))
    assert not row["tilelang_imported"] and row["cuda_bindings_used"]
    assert row["elementwise_ok"] and row["rel_ok"] and row["lse_max_abs"] < 1e-2, row
