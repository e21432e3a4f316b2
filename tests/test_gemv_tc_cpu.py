"""bench/versions/gemv_pdl_tc.py (the tensor-core PDL GEMM of 1..16 rows of x) without a GPU: which GEMVs its route
takes and the reason it gives for each other (a table of cases checked against the route, with red twins: the M-row
version's and the library's routes refuse what this one takes), its configuration for the 31B's step shapes (every
grid covers the H200's 132 SMs at every M, the split-K exactly where 64-row tiles would not; red twin: without the
split the hidden-size weights leave SMs idle), that F.linear is what it computes off the GPU; and bench/gemv_probe.py's
tensor-core arms (names, plain twins, variants, what each launches over the 31B's weights) and MODEL_DECODE_NOTES run
14's commands (their arms parse).

Reproduce: pytest tests/test_gemv_tc_cpu.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import bench_script, bench_version, probe_command_of_run
from test_gemv_cpu import STEP_SHAPES
from test_gemv_probe_cpu import _model_31b_shapes

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
F16 = torch.float16
# (m, n, k, x dtype, w dtype, weight contiguous, bias, expected: None or a part of the reason)
ROUTE_CASES = [
    (1, 43008, 5376, BF16, BF16, True, False, None),
    (2, 16384, 5376, BF16, BF16, True, False, None),
    (8, 5376, 21504, BF16, BF16, True, False, None),
    (9, 262144, 5376, BF16, BF16, True, False, None),
    (16, 5376, 16384, BF16, BF16, True, False, None),
    (3, 4097, 5376, BF16, BF16, True, False, None),  # odd N: the last tile's rows masked
    (8, 4096, 5376 + 64, BF16, BF16, True, False, None),  # K = 5,440 = 85 x 64: a 64-column tile
    (17, 16384, 5376, BF16, BF16, True, False, "17 rows, more than 16"),
    (0, 16384, 5376, BF16, BF16, True, False, "no row"),
    (8, 4096, 5376 + 32, BF16, BF16, True, False, "no tile"),  # K = 5,408: 32 | K only
    (8, 4096, 5376, F16, F16, True, False, "not bf16"),
    (8, 4096, 5376, torch.float32, BF16, True, False, "not bf16"),
    (8, 4096, 5376, BF16, BF16, False, False, "not contiguous"),
    (8, 4096, 5376, BF16, BF16, True, True, "a bias"),
]


def route_problems(route) -> list[str]:
    """Where `route(m, n, k, x_dtype, w_dtype, contiguous, bias)` disagrees with ROUTE_CASES."""
    problems = []
    for m, n, k, xd, wd, contig, bias, want in ROUTE_CASES:
        got = route(m, n, k, xd, wd, contig, bias)
        if (want is None) != (got is None) or (want is not None and want not in got):
            problems.append(f"m={m} [{n}, {k}]: {got!r}, want {want!r}")
    return problems


def unmerged_shapes() -> list[tuple[int, int]]:
    """The 31B's 411 projections' [N, K] in forward order (the probe's `pdl_tc` arms)."""
    probe = _probe()
    return [tuple(lin.weight.shape) for _, lin in probe.projections(_model_31b_shapes())]


def merged_shapes() -> list[tuple[int, int]]:
    """The step's 241 merged weights' [N, K] in forward order (the `_merged` arms, the step's GEMVs)."""
    probe = _probe()
    out = []
    for grp in probe.groups(probe.projections(_model_31b_shapes())):
        out.append((sum(lin.weight.shape[0] for _, lin in grp), grp[0][1].weight.shape[1]))
    return out


def grid_problems(config, shapes, ms=range(1, 17)) -> list[str]:
    """Where config(n, k, m) leaves the H200's 132 SMs without a program, or its tiles do not cover K."""
    problems = []
    for n, k in sorted(set(shapes)):
        for m in ms:
            cfg = config(n, k, m)
            if cfg is None:
                problems.append(f"[{n}, {k}] m={m}: no configuration")
                continue
            programs = -(-n // cfg["BLOCK_N"]) * cfg["SPLIT"]
            if programs < 132 or k % (cfg["SPLIT"] * cfg["BLOCK_K"]):
                problems.append(f"[{n}, {k}] m={m}: {programs} programs, SPLIT {cfg['SPLIT']}")
    return problems


def _probe():
    return bench_script("gemv_probe")


@pytest.fixture()
def tc():
    mod = bench_version("gemv_pdl_tc")
    mod.reset()
    return mod


def test_the_route_gives_each_case_its_reason(tc):
    assert route_problems(tc.shape_refusal) == []


def test_red_twins_of_the_route(tc):
    from foldkv import gemv

    rows_version = bench_version("gemv_pdl_rows")
    # the library's route is this kernel's: it takes every case this one does; the M-row version refuses every case
    # past 8 rows
    assert route_problems(gemv.shape_refusal) == []
    rows = route_problems(lambda m, n, k, xd, wd, c, b: rows_version.shape_refusal(m, n, k, xd, wd, c, b))
    assert any("m=9 [262144, 5376]" in p and "more than 8" in p for p in rows), rows
    assert any("m=16 [5376, 16384]" in p for p in rows), rows
    # a route without the rows limit takes seventeen rows
    unlimited = route_problems(lambda m, n, k, xd, wd, c, b: tc.shape_refusal(min(m, 16), n, k, xd, wd, c, b))
    assert unlimited == ["m=17 [16384, 5376]: None, want '17 rows, more than 16'"]


def test_every_31b_shape_covers_the_sms_at_every_m(tc):
    merged, unmerged = merged_shapes(), unmerged_shapes()
    assert len(merged) == 241 == sum(count for _, count in STEP_SHAPES.values()) and len(unmerged) == 411
    assert set(merged) == {shape for shape, _ in STEP_SHAPES.values()}
    assert grid_problems(tc.config, merged + unmerged) == []
    for n, k in set(merged + unmerged):
        for m in (1, 2, 8, 16):
            cfg = tc.config(n, k, m)
            assert cfg["BLOCK_M"] == 16 and cfg["BLOCK_N"] == 64 and cfg["BLOCK_K"] == 128, (n, k, cfg)
            assert cfg["PREFETCH"] == 1 and cfg["num_warps"] == 4 and cfg["num_stages"] == 4, (n, k, cfg)
            assert k // cfg["BLOCK_K"] // cfg["SPLIT"] >= tc.MIN_SPLIT_TILES, (n, k, cfg)
            assert tc.ctas_per_sm(cfg) == 2 and tc.smem_estimate(cfg) == 5 * (16384 + 4096), (n, k, cfg)
    # the split: exactly the weights whose 64-row tiles number under 132, each at the smallest split that covers
    splits = {(n, k): tc.config(n, k, 8)["SPLIT"] for n, k in set(merged + unmerged)}
    assert {s: v for s, v in splits.items() if v > 1} == {(5376, 8192): 2, (5376, 16384): 2, (5376, 21504): 2,
                                                          (8192, 5376): 2, (4096, 5376): 3, (2048, 5376): 6}
    assert sum(splits[s] > 1 for s in merged) == 120  # o_proj (50 + 10) and down_proj (60): a reduce each
    assert tc.programs(5376, tc.config(5376, 21504, 8)) == 168 and tc.launches(tc.config(5376, 21504, 8)) == 2
    assert tc.programs(43008, tc.config(43008, 5376, 8)) == 672 and tc.launches(tc.config(43008, 5376, 8)) == 1


def test_red_twin_without_the_split_the_hidden_size_weights_leave_sms_idle(tc):
    got = grid_problems(lambda n, k, m: tc.config(n, k, m, split=1), merged_shapes(), ms=(8,))
    assert got == [f"[5376, {k}] m=8: 84 programs, SPLIT 1" for k in (8192, 16384, 21504)], got
    # and a split the tiles do not divide is no configuration
    assert tc.config(5376, 21504, 8, split=5) is None and tc.config(6, 128, 8, split=2) is None


def test_the_probe_variants_cover_the_merged_step(tc):
    assert set(tc.VARIANTS) == {"", "_k256", "_s3", "_s2", "_tailfit", "_fixup", "_n128", "_nosplit"}
    for variant, over in tc.VARIANTS.items():
        got = grid_problems(lambda n, k, m: tc.config(n, k, m, **over), merged_shapes(), ms=(2, 8, 16))
        assert (got == []) == (variant != "_nosplit"), (variant, got)
        for n, k in set(merged_shapes()):
            cfg = tc.config(n, k, 8, **over)
            assert tc.ctas_per_sm(cfg) >= 1 and tc.smem_estimate(cfg) <= tc.SMEM_PER_CTA, (variant, n, k, cfg)
    assert tc.config(5376, 21504, 8, **tc.VARIANTS["_n128"])["num_warps"] == 8
    assert tc.ctas_per_sm(tc.config(18432, 5376, 8, **tc.VARIANTS["_s2"])) == 3


def test_tail_fit_changes_only_the_weight_with_a_small_last_wave(tc):
    # the merged step at 1..16 rows: only the global q|k (288 programs on 2 x 132 slots: a 24-program last wave) takes
    # two stages (three programs an SM: 396 slots, one wave); every other weight keeps the default
    for m in (1, 8, 16):
        for n, k in set(merged_shapes()):
            got, default = tc.config(n, k, m, tail_fit=True), tc.config(n, k, m)
            if (n, k) == (18432, 5376):
                assert default["num_stages"] == 4 and tc.programs(n, default) == 288, default
                assert got["num_stages"] == 2 and tc.programs(n, got) <= 132 * tc.ctas_per_sm(got), got
            else:
                assert got == default, (n, k, m, got)
    # red twin: with a fill threshold of 0 nothing is a tail, so the global q|k keeps its two waves
    saved = tc.TAIL_FILL
    try:
        tc.TAIL_FILL = 0.0
        assert tc.config(18432, 5376, 8, tail_fit=True)["num_stages"] == 4
    finally:
        tc.TAIL_FILL = saved
    assert tc.ctas_per_sm(tc.config(5376, 21504, 8, **tc.VARIANTS["_k256"])) == 1


def test_configuration_refusals(tc):
    assert tc.config(4096, 5376, 17) is None and tc.config(4096, 5376, 0) is None
    assert tc.config(4096, 5376, 8, block_n=32) is None  # under wgmma's 64 rows
    assert tc.config(4096, 5376, 8, prefetch=2) is None and tc.config(4096, 5376, 8, stages=0) is None
    assert tc.config(4096, 5376 + 32, 8) is None  # no 64-column tile divides K
    assert tc.config(6, 128, 8) == dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PREFETCH=1, SPLIT=1, num_warps=4,
                                        num_stages=4)  # one tile: the head, the loop runs no step
    assert tc.config(4096, 5376, 8, prefetch=0)["PREFETCH"] == 0


def test_off_the_gpu_it_is_f_linear_with_the_reason(tc):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).to(BF16)
    x = torch.randn(8, 1, 512, generator=g).to(BF16)
    assert tc.refusal(x, w) == "not on CUDA"
    assert torch.equal(tc.linear(x, w), nn.functional.linear(x, w))
    assert tc.refusal(torch.randn(17, 512).to(BF16), w) == "17 rows, more than 16"
    assert tc.refusal(x[..., :256], w) == "not a projection's shapes"
    assert tc.refusal(x, w, torch.zeros(256, dtype=BF16)) == "a bias"
    assert "no tile" in tc.refusal(x, w, block_n=32)
    assert tc.report() == {"kernel": 0, "refusals": {"not on CUDA": 1}}
    tc.reset()
    assert tc.report() == {"kernel": 0, "refusals": {}}


# --- the probe's tensor-core arms ------------------------------------------------------------------------------------
def test_the_tc_arms_and_their_plain_twins():
    probe = _probe()
    assert {"pdl_tc", "plain_tc", "pdl_tc_norm", "plain_tc_norm", "pdl_tc_merged", "plain_tc_merged"} <= \
        set(probe.TC_ARMS)
    assert len(set(probe.ARM_NAMES)) == len(probe.ARM_NAMES) and set(probe.TC_ARMS) <= set(probe.ARM_NAMES)
    tc = bench_version("gemv_pdl_tc")
    for name, spec in probe.TC_ARMS.items():
        assert set(spec) == {"pdl", "norm", "merged", "variant"}, name
        assert spec["variant"] in tc.VARIANTS, name
        assert name.startswith("pdl_" if spec["pdl"] else "plain_"), name
        assert name.endswith("_norm") == spec["norm"] and not (spec["norm"] and spec["merged"]), name
        if spec["variant"]:  # a variant: the merged step under PDL, against pdl_tc_merged
            assert spec["pdl"] and spec["merged"] and name == f"pdl_tc_merged{spec['variant']}", name
        elif spec["pdl"]:
            assert probe.TC_ARMS[name.replace("pdl_", "plain_", 1)] == dict(spec, pdl=False), name


def test_what_each_tc_arm_launches_over_the_31b(tc):
    probe = _probe()
    merged, unmerged = merged_shapes(), unmerged_shapes()
    got = probe.tc_plan(tc, merged, 8)
    assert got["refusals"] == {} and got["launches"] == 241 + 120 and got["splits"] == 3, got
    assert got["grids"]["5376x21504"] == dict(programs=168, split=2, ctas_per_sm=2, smem_estimate=102400)
    # the 411: sliding q (2), k, v (3 each), o (2), down (2); global k (6), o (2), down (2): 280 reduces
    assert probe.tc_plan(tc, unmerged, 8)["launches"] == 411 + 50 * 5 + 10 * 3
    assert probe.tc_plan(tc, unmerged, 8, norm=True)["launches"] == 411 + 280 + 410
    assert probe.tc_plan(tc, merged, 8, "_nosplit")["launches"] == 241
    assert probe.tc_plan(tc, merged, 16, "_n128")["grids"]["5376x8192"]["split"] == 4
    # red twin: rows past the kernel's 16 are refusals, by shape
    assert len(probe.tc_plan(tc, merged, 17)["refusals"]) == len(set(merged))


def _probe_commands(run: int) -> list[list[str]]:
    """The gemv_probe commands of MODEL_DECODE_NOTES' "Run N: prediction" section (up to the next section)."""
    notes = (ROOT / "bench" / "MODEL_DECODE_NOTES.md").read_text()
    start = notes.index(f"## Run {run}: prediction")
    end = notes.find("\n## ", start + 1)
    section = notes[start:end if end >= 0 else None]
    found = re.findall(r"python3 bench/gemv_probe\.py (.*?)\n\n", section + "\n\n", re.S)
    assert found, f"no probe command in run {run}'s section"
    return [f.replace("\\\n", " ").split() for f in found]


def test_run_14s_commands_parse():
    probe = _probe()
    commands = _probe_commands(14)
    assert len(commands) == 2
    asked = set()
    for argv in commands:
        args = probe.parse_args(argv)
        assert "torch_merged" in args.arms and all(1 <= m <= 16 for m in args.rows), argv
        asked |= set(args.arms)
    assert probe.parse_args(commands[0]).rows == [8]
    assert sorted(probe.parse_args(commands[1]).rows) == [2, 4, 16]
    later = {"pdl_tc_merged_s2", "pdl_tc_merged_tailfit", "pdl_tc_merged_fixup"}  # runs 17-18's
    assert set(probe.TC_ARMS) - later <= asked
    # red twin: a misspelt arm in the command is refused before any GPU work
    with pytest.raises(SystemExit):
        probe.parse_args([a.replace("pdl_tc_merged_k256", "pdl_tc_merged_k265") for a in commands[0]])


@pytest.mark.parametrize("run, arms", [(17, {"pdl_tc_merged_s2", "pdl_tc_merged_tailfit"}),
                                       (18, {"pdl_tc_merged_fixup"})])
def test_prepared_runs_commands_parse(run, arms):
    probe = _probe()
    asked = set()
    for argv in _probe_commands(run):
        args = probe.parse_args(argv)
        assert "torch_merged" in args.arms and "pdl_tc_merged" in args.arms, argv
        asked |= set(args.arms)
    assert arms <= asked, (run, asked)


def test_fixup_takes_the_split_weights_only_and_launches_no_reduce(tc):
    merged = merged_shapes()
    for m in (1, 8, 16):
        plain = [tc.config(n, k, m) for n, k in merged]
        fixed = [tc.config(n, k, m, fixup=True) for n, k in merged]
        for cfg, fix in zip(plain, fixed):
            assert {k: v for k, v in fix.items() if k != "FIXUP"} == cfg  # the same tiles, grid and split
            assert fix.get("FIXUP", False) == (cfg["SPLIT"] > 1)
        assert sum(tc.launches(c) for c in plain) == 241 + 120 and sum(tc.launches(c) for c in fixed) == 241
    # red twin: a weight that does not split has nothing to fix up (and launches as the library's)
    assert "FIXUP" not in tc.config(43008, 5376, 8, fixup=True)


def test_linear_gelu_off_the_gpu_is_the_library_s_two_steps(tc):
    from foldkv import gemv

    g = torch.Generator().manual_seed(3)
    both = torch.randn(3, 1, 2 * 512, generator=g).to(BF16)
    gate, up = both.split(512, dim=-1)  # the halves of a merged gate|up output: one row stride
    w = torch.randn(256, 512, generator=g).to(BF16)
    tc.reset()
    got = tc.linear_gelu(gate, up, w)
    assert torch.equal(got, gemv.linear(nn.functional.gelu(gate, approximate="tanh") * up, w))
    assert tc.report() == {"kernel": 0, "refusals": {"not on CUDA": 1}}


def test_installed_patches_only_what_it_is_asked_and_puts_it_back(tc):
    from foldkv import fused_step, gemv

    linear, mlp = gemv.linear, fused_step.StepForward._mlp
    with tc.installed(gelu=True) as took:
        assert gemv.linear is linear and fused_step.StepForward._mlp is not mlp and took == {}
    with tc.installed(fixup=True):
        assert gemv.linear is not linear and fused_step.StepForward._mlp is mlp
    with tc.installed(fixup=True, gelu=True):
        assert gemv.linear is not linear and fused_step.StepForward._mlp is not mlp
    with tc.installed(tail_fit=True):
        assert gemv.linear is not linear and fused_step.StepForward._mlp is mlp
    assert gemv.linear is linear and fused_step.StepForward._mlp is mlp
    # off the GPU the patched route is the library's: F.linear with its reason
    x, w = torch.ones(1, 512, dtype=BF16), torch.ones(256, 512, dtype=BF16)
    with tc.installed(fixup=True) as took:
        assert torch.equal(gemv.linear(x, w), nn.functional.linear(x, w)) and took == {}


def test_run_19s_step_command_parses():
    args = probe_command_of_run(19)
    assert args.lab_ab and args.decode and all(int(c.split(":")[2]) <= 16 for c in args.decode), args
