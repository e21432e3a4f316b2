"""foldkv.gemv's route without a GPU: which projections take the PDL kernel (1..16 bf16 rows against a contiguous bf16
weight with a tile, on CUDA with Triton's grid dependency control: the tensor-core GEMM, every grid of the 31B's step
covering the SMs) and the reason each other call is F.linear; that F.linear is what they compute then (bitwise
nn.Linear); which of the step's projections the step's forward routes (the merged groups, o_proj, down_proj, the LM
head: `StepForward` reads their weights); that every fused_step kernel enters through the PDL chain entry and every
launch site passes the PDL keywords (a static check of the sources, with red twins: a
kernel without its entry, a launch without the keywords); and the probe's --pdl-ab, --tc-ab and --lab-ab flags.

Reproduce: pytest tests/test_gemv_cpu.py
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from conftest import bench_script, require_module
from foldkv.step_options import StepOptions, using

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
# the 31B's step projections [N, K] at batch 1 (merged: sliding q|k|v, global q|k, gate|up; o_proj sliding and
# global; down_proj; the LM head): 50 sliding + 10 global layers
STEP_SHAPES = {"sliding_qkv": ((16384, 5376), 50), "global_qk": ((18432, 5376), 10), "gate_up": ((43008, 5376), 60),
               "sliding_o": ((5376, 8192), 50), "global_o": ((5376, 16384), 10), "down": ((5376, 21504), 60),
               "lm_head": ((262144, 5376), 1)}


def test_the_31b_step_takes_the_kernel_at_1_to_16_rows():
    from foldkv import gemv

    assert sum(count for _, count in STEP_SHAPES.values()) == 241  # the step's GEMVs, merged
    for name, ((n, k), _) in STEP_SHAPES.items():
        for m in (1, 2, 8, 16):
            assert gemv.shape_refusal(m, n, k, BF16, BF16, True, False) is None, name
            tc = gemv.tc_config(n, k, m)
            programs = -(-n // tc["BLOCK_N"]) * tc["SPLIT"]
            assert programs >= gemv.SMS and k % (tc["SPLIT"] * tc["BLOCK_K"]) == 0, (name, m, tc)
            assert tc["PREFETCH"] == 1 and k // tc["SPLIT"] >= tc["BLOCK_K"], (name, m, tc)
        assert gemv.shape_refusal(17, n, k, BF16, BF16, True, False) == "17 rows, more than 16", name
    assert gemv.tc_config(5376, 21504, 1)["SPLIT"] == 2 and gemv.tc_config(43008, 5376, 1)["SPLIT"] == 1
    # red twins: what the kernel cannot describe is refused, each with its reason
    assert "no tile" in gemv.shape_refusal(1, 4096, 5376 + 32, BF16, BF16, True, False)  # K = 5,408: 32 | K only
    assert gemv.shape_refusal(0, 4096, 5376, BF16, BF16, True, False) == "no row"
    assert "not bf16" in gemv.shape_refusal(1, 4096, 5376, torch.float16, torch.float16, True, False)
    assert "not bf16" in gemv.shape_refusal(1, 4096, 5376, torch.float32, BF16, True, False)
    assert gemv.shape_refusal(1, 4096, 5376, BF16, BF16, False, False) == "the weight is not contiguous"
    assert gemv.shape_refusal(1, 4096, 5376, BF16, BF16, True, True) == "a bias"


def test_the_route_on_this_machine_and_its_fallback_is_f_linear():
    from foldkv import gemv
    from foldkv.lab.pdl_checks import gemv_routes

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).to(BF16)
    one = torch.randn(1, 1, 512, generator=g).to(BF16)
    cases = [(one, w, None, "not on CUDA"), (one.expand(17, 1, 512), w, None, "more than 16"),
             (one.float(), w.float(), None, "not bf16"), (one, w.t().contiguous().t()[:, :512], None, "not contig"),
             (one, w, torch.zeros(256, dtype=BF16), "a bias"), (one[..., :256], w, None, "not a projection")]
    for x, wi, b, why in cases:
        assert why in gemv.refusal(x, wi, b), why
    with gemv_routes() as routes:
        for x, wi, b, why in cases:
            if why != "not a projection":
                assert torch.equal(gemv.linear(x, wi, b), nn.functional.linear(x, wi, b)), why
    assert routes["kernel"] == 0 and sum(routes.values()) == len(cases) - 1
    with using(StepOptions(pdl=False)):
        assert gemv.refusal(one, w) == "StepOptions.pdl is off"
        assert gemv.pdl_kw(one) == {}


def test_pdl_kw_follows_the_options_triton_and_the_device(monkeypatch):
    from foldkv import gemv

    cuda = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(gemv, "HAS_GDC", True)
    assert gemv.pdl_kw(cuda) == {"GDC": True, "launch_pdl": True}  # the constexpr and the launch option together
    assert gemv.pdl_kw(torch.zeros(1)) == {}
    with using(StepOptions(pdl=False)):
        assert gemv.pdl_kw(cuda) == {}
    assert gemv.pdl_kw(cuda) == {"GDC": True, "launch_pdl": True}
    monkeypatch.setattr(gemv, "HAS_GDC", False)
    assert gemv.pdl_kw(cuda) == {}
    if gemv.triton is None:  # this machine: F.linear whatever the options
        assert gemv.refusal(torch.zeros(1, 512, dtype=BF16), torch.zeros(256, 512, dtype=BF16)) == "not on CUDA"


@pytest.fixture()
def model():
    require_module("transformers")
    from foldkv.lab import gemma31b

    return gemma31b.build_gemma4_31b("cpu", num_layers=6, dtype=BF16, vocab_size=512, vocab_size_per_layer_input=512,
                                     hidden_size=128, intermediate_size=256)


def test_the_step_routes_the_merged_groups_o_down_and_the_lm_head(model):
    from foldkv import fused_step as fs
    from foldkv.lab.pdl_checks import gemv_routes
    from foldkv.step_options import StepOptions

    layers = model.model.layers
    x = torch.randn(1, 1, 128, generator=torch.Generator().manual_seed(1)).to(BF16)
    assert fs.merge_projections(model) == 12
    step = fs.StepForward(model, StepOptions())
    singles = step.o_proj + step.down_proj + [step.lm_head]
    want = [layer.self_attn.o_proj for layer in layers] + [layer.mlp.down_proj for layer in layers] + [model.lm_head]
    assert [p.weight for p in singles] == [lin.weight for lin in want]
    assert all(g.merged is not None for g in step.qkv + step.gate_up)
    with torch.no_grad(), gemv_routes() as routes:
        attn, mlp = layers[0].self_attn, layers[0].mlp
        o_in = torch.randn(1, 1, attn.o_proj.in_features, generator=torch.Generator().manual_seed(2)).to(BF16)
        assert torch.equal(step.o_proj[0](o_in), nn.functional.linear(o_in, attn.o_proj.weight))
        assert torch.equal(step.lm_head(x), nn.functional.linear(x, model.lm_head.weight))
        qkv = step.qkv[0](x)
        assert torch.equal(qkv[0], nn.functional.linear(x, attn.q_proj.weight))
        gate, up = step.gate_up[0](x)
        assert torch.equal(up, nn.functional.linear(x, mlp.up_proj.weight))
        # every call went through gemv.linear, which on this machine says why it is F.linear
        assert routes == {"not on CUDA": 4}
        # red twin: an unmerged group calls its modules (nn.Linear's forward: nothing counted)
        unmerged = fs.StepForward(model, StepOptions(merge=False))
        assert unmerged.qkv[0].merged is None
        unmerged.qkv[0](x)
        assert sum(routes.values()) == 4


# --- every fused_step kernel is a link of the PDL chain: a static check of the two sources -------------------------
def entry_problems(kernels_src: str, names) -> list[str]:
    """Each kernel of `names` in fused_step_kernels' source that is not defined, has no `GDC: tl.constexpr = False`
    parameter, or whose first statement after its docstring is not `_chain(GDC)`."""
    problems = []
    defs = {n.name: n for n in ast.walk(ast.parse(kernels_src)) if isinstance(n, ast.FunctionDef)}
    for name in sorted(names):
        fn = defs.get(name)
        if fn is None:
            problems.append(f"{name}: not defined")
            continue
        args = fn.args.args
        defaults = dict(zip([a.arg for a in args][len(args) - len(fn.args.defaults):], fn.args.defaults))
        gdc = [a for a in args if a.arg == "GDC"]
        if not gdc or ast.unparse(gdc[0].annotation) != "tl.constexpr" or getattr(defaults.get("GDC"), "value",
                                                                                   None) is not False:
            problems.append(f"{name}: no GDC: tl.constexpr = False parameter")
        doc = isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant)
        body = fn.body[1:] if doc else fn.body
        if not body or ast.unparse(body[0]) != "_chain(GDC)":
            problems.append(f"{name}: its first statement is not _chain(GDC)")
    return problems


def chain_problems(kernels_src: str, step_src: str) -> list[str]:
    """What breaks the PDL chain in fused_step_kernels' source (`kernels_src`) and its launches' (fused_step_ops,
    `step_src`): a kernel launched there (a value of `_kernels()`'s dict) without a `GDC: tl.constexpr = False`
    parameter or whose first statement after its docstring is not `_chain(GDC)`; a launch `_kernels()[...][grid](...)`
    without `**_pdl(...)`."""
    problems = []
    step = ast.parse(step_src)
    launched = set()
    for node in ast.walk(step):
        if isinstance(node, ast.FunctionDef) and node.name == "_kernels":
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "dict":
                    launched |= {kw.value.attr for kw in call.keywords if isinstance(kw.value, ast.Attribute)}
    if not launched:
        problems.append("no kernels found in fused_step_ops._kernels")
    problems += entry_problems(kernels_src, launched)
    for node in ast.walk(step):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                and isinstance(node.func.value, ast.Subscript) and "_kernels()" in ast.unparse(node.func.value)):
            if not any(kw.arg is None and ast.unparse(kw.value).startswith("_pdl(") for kw in node.keywords):
                problems.append(f"line {node.lineno}: {ast.unparse(node.func)} launched without **_pdl(...)")
    return problems


def test_every_fused_step_kernel_is_a_link_of_the_pdl_chain():
    kernels = (ROOT / "lib/foldkv/fused_step_kernels.py").read_text()
    step = (ROOT / "lib/foldkv/fused_step_ops.py").read_text()
    assert chain_problems(kernels, step) == []
    assert step.count("**_pdl(") == 7  # the seven launch sites (the KV rows' own launch is tests/step_twins.py's)
    # red twins: a kernel without its entry, a launch without the keywords
    no_entry = kernels.replace("        _chain(GDC)\n        row = tl.program_id(0).to(tl.int64)\n        cols = "
                               "tl.arange(0, D)\n        half", "        row = tl.program_id(0).to(tl.int64)\n"
                               "        cols = tl.arange(0, D)\n        half", 1)
    assert no_entry != kernels
    assert chain_problems(no_entry, step) == ["rope_rows: its first statement is not _chain(GDC)"]
    no_kw = step.replace(", **_pdl(scores))", ")", 1)
    assert no_kw != step
    found = chain_problems(kernels, no_kw)
    assert len(found) == 1 and "launched without **_pdl" in found[0]


def pdl_launches(src: str) -> set[str]:
    """The kernels a module launches as `_kernels().NAME[grid](..., **_pdl(...))` (global_step's form)."""
    return {node.func.value.attr for node in ast.walk(ast.parse(src))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Attribute) and ast.unparse(node.func.value.value) == "_kernels()"
            and any(kw.arg is None and ast.unparse(kw.value).startswith("_pdl(") for kw in node.keywords)}


def test_the_global_prologue_kernels_are_links_of_the_pdl_chain():
    """global_step's two kernels that run inside the fused step's global forward are PDL links; its two kernels after
    the model's norms (DecodeStep.attend) are plain launches."""
    kernels = (ROOT / "lib/foldkv/fused_step_kernels.py").read_text()
    src = (ROOT / "lib/foldkv/global_step.py").read_text()
    linked = pdl_launches(src)
    assert linked == {"global_query_prologue", "global_row_prologue"}, linked
    assert entry_problems(kernels, linked) == []
    no_kw = src.replace("num_warps=_warps(d), **_pdl(k))", "num_warps=_warps(d))", 1)  # red twins
    assert no_kw != src and pdl_launches(no_kw) == {"global_query_prologue"}
    no_entry = kernels.replace("        _chain(GDC)\n        model_ty = cos_ptr", "        model_ty = cos_ptr", 1)
    assert no_entry != kernels
    assert entry_problems(no_entry, linked) == ["global_row_prologue: its first statement is not _chain(GDC)"]


def test_the_probe_parses_pdl_ab():
    probe = bench_script("model_decode_probe")
    args = probe.parser().parse_args(["--decode", "foldkv-folded:4096:1", "--pdl-ab"])
    assert args.pdl_ab and args.decode == ["foldkv-folded:4096:1"]
    assert not probe.parser().parse_args([]).pdl_ab
    assert probe.parser().parse_args(["--decode", "foldkv-folded:4096:8", "--tc-ab"]).tc_ab
    assert not probe.parser().parse_args([]).tc_ab
    assert probe.parser().parse_args(["--decode", "foldkv-folded:4096:8", "--lab-ab"]).lab_ab
    assert not probe.parser().parse_args([]).lab_ab


@pytest.mark.parametrize("shape,rows", [((4096, 5376), 1), ((300, 5376), 3), ((5376, 21504), 16)])
def test_the_labs_x_early_twin_is_the_library_kernel_with_x_loaded_before_the_wait(shape, rows):
    """The race check's red twin (`pdl_checks.gemv_tc_x_early`) is made from the library kernel's source, its x tile's
    load moved above the wait, so the library kernel carries no twin: compiled for sm_90a, the library kernel loads only
    its weight tile before its one wait, the twin its x tile too (more global loads before the wait), and nothing
    else differs in their sources."""
    import inspect
    import textwrap

    require_module("triton")
    from conftest import triton_sm90
    from foldkv import gemv
    from foldkv.lab import pdl_checks

    if not gemv.HAS_GDC:
        pytest.skip("no Triton with grid dependency control")
    twin = pdl_checks.gemv_tc_x_early()
    ours, theirs = (textwrap.dedent(inspect.getsource(f.fn)).splitlines() for f in (gemv.gemv_tc, twin))
    assert sorted(ours[2:]) == sorted(theirs[2:]) and ours[2:] != theirs[2:]  # the same body, one line moved
    n, k = shape
    cfg = gemv.tc_config(n, k, rows)
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "K_SPLIT": "i32"}
    const = {c: cfg[c] for c in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "PREFETCH", "SPLIT")}
    const.update(EVEN_N=n % cfg["BLOCK_N"] == 0, GDC=True)
    opts = dict(divisible=("x_ptr", "w_ptr", "y_ptr", "ws_ptr", "K", "K_SPLIT"), num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"])
    waits, before = pdl_checks.loads_before_wait(triton_sm90(gemv.gemv_tc, sig, const, **opts)["ptx"])
    red_waits, red_before = pdl_checks.loads_before_wait(triton_sm90(twin, sig, const, **opts)["ptx"])
    assert waits == red_waits == 1 and len(red_before) > len(before) > 0
