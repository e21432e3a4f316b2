"""bench/versions/gemv_pdl_rows.py (the PDL GEMV of 1..8 rows of x) without a GPU: which GEMVs its route takes and
the reason it gives for each other (a table of cases checked against the route, with red twins: the library's one-row
route, a route without the rows limit), its tiles for the 31B's step shapes at every M and rows a program, that
F.linear is what it computes off the GPU; and bench/gemv_probe.py's rows arms (names, their plain twins, the chain and
merged steps at M rows with stand-in kernels) and MODEL_DECODE_NOTES run 13's command (its arms parse).

Reproduce: pytest tests/test_gemv_rows_cpu.py
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import bench_script, bench_version
from test_gemv_cpu import STEP_SHAPES
from test_gemv_probe_cpu import _model_31b_shapes

ROOT = Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16
F16 = torch.float16
# (m, n, k, x dtype, w dtype, weight contiguous, bias, rows a program, expected: None or a part of the reason)
ROUTE_CASES = [
    (1, 43008, 5376, BF16, BF16, True, False, 2, None),
    (2, 16384, 5376, BF16, BF16, True, False, 2, None),
    (3, 5376, 21504, BF16, BF16, True, False, 2, None),
    (8, 262144, 5376, BF16, BF16, True, False, 2, None),
    (8, 5376, 16384, BF16, BF16, True, False, 4, None),
    (7, 4097, 5376, BF16, BF16, True, False, 1, None),
    (9, 16384, 5376, BF16, BF16, True, False, 2, "9 rows, more than 8"),
    (0, 16384, 5376, BF16, BF16, True, False, 2, "no row"),
    (8, 4097, 5376, BF16, BF16, True, False, 2, "no tile"),  # 2 rows a program do not divide N
    (8, 4096, 5376 + 128, BF16, BF16, True, False, 2, "no tile"),  # K = 5,504: 128 | K only
    (8, 4096, 5376, BF16, BF16, True, False, 3, "no tile"),  # rows a program not a power of two
    (8, 4096, 5376, F16, F16, True, False, 2, "not bf16"),
    (8, 4096, 5376, torch.float32, BF16, True, False, 2, "not bf16"),
    (8, 4096, 5376, BF16, BF16, False, False, 2, "not contiguous"),
    (8, 4096, 5376, BF16, BF16, True, True, 2, "a bias"),
]


def route_problems(route) -> list[str]:
    """Where `route(m, n, k, x_dtype, w_dtype, contiguous, bias, rows)` disagrees with ROUTE_CASES."""
    problems = []
    for m, n, k, xd, wd, contig, bias, rows, want in ROUTE_CASES:
        got = route(m, n, k, xd, wd, contig, bias, rows)
        if (want is None) != (got is None) or (want is not None and want not in got):
            problems.append(f"m={m} [{n}, {k}] rows={rows}: {got!r}, want {want!r}")
    return problems


@pytest.fixture()
def gr():
    mod = bench_version("gemv_pdl_rows")
    mod.reset()
    return mod


def test_the_route_gives_each_case_its_reason(gr):
    assert route_problems(gr.shape_refusal) == []


def test_red_twins_of_the_route(gr):
    from foldkv import gemv

    # the library's route (the tensor-core kernel, up to 16 rows) takes the nine rows this one refuses
    lib = route_problems(lambda m, n, k, xd, wd, c, b, rows: gemv.shape_refusal(m, n, k, xd, wd, c, b))
    assert any(p.startswith("m=9 [16384, 5376]") and "more than 8" in p for p in lib), lib
    # a route without the rows limit takes nine rows
    unlimited = route_problems(lambda m, n, k, xd, wd, c, b, rows: gr.shape_refusal(min(m, 8), n, k, xd, wd, c, b,
                                                                                       rows))
    assert unlimited == ["m=9 [16384, 5376] rows=2: None, want '9 rows, more than 8'"]


def test_every_step_shape_has_a_tile_at_every_m(gr):
    assert sum(count for _, count in STEP_SHAPES.values()) == 241
    for name, ((n, k), _) in STEP_SHAPES.items():
        for m in range(1, 9):
            for rows in (1, 2, 4):
                cfg = gr.config(n, k, m, rows)
                assert gr.shape_refusal(m, n, k, BF16, BF16, True, False, rows) is None, (name, m, rows)
                assert cfg["M"] == m and cfg["ROWS"] == rows and cfg["PREFETCH"] == 1, (name, m)
                assert k % cfg["BLOCK_K"] == 0 and cfg["BLOCK_K"] == 256 * cfg["num_warps"], (name, m)
                assert cfg["BLOCK_K"] <= (2048 if m <= 2 else 512), (name, m)
    assert gr.config(5376, 21504, 2)["BLOCK_K"] == 1024 and gr.config(5376, 21504, 8)["BLOCK_K"] == 512
    assert gr.config(43008, 5376, 8)["BLOCK_K"] == 256  # 5,376 = 21 x 256: one warp a program
    assert gr.config(5376, 8192, 1) == dict(M=1, ROWS=2, BLOCK_K=2048, PREFETCH=1, num_warps=8)  # gemv_pdl.config's
    assert gr.config(16384, 5376, 8, prefetch=0)["PREFETCH"] == 0 and gr.config(16384, 5376, 8, prefetch=2) is None
    # the register argument: 8 columns x ROWS x M float32 accumulators a thread; 4 rows at M = 8 pass the 255
    assert gr.accumulator_registers(8, 2) == 128 and gr.accumulator_registers(8, 4) == 256 > 255
    assert gr.accumulator_registers(2, 2) == 32


def test_off_the_gpu_it_is_f_linear_with_the_reason(gr):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g).to(BF16)
    x = torch.randn(8, 1, 512, generator=g).to(BF16)
    assert gr.refusal(x, w) == "not on CUDA"
    assert torch.equal(gr.linear(x, w), nn.functional.linear(x, w))
    assert gr.refusal(torch.randn(9, 512).to(BF16), w) == "9 rows, more than 8"
    assert gr.refusal(x[..., :256], w) == "not a projection's shapes"
    assert gr.refusal(x, w, torch.zeros(256, dtype=BF16)) == "a bias"
    assert gr.report() == {"kernel": 0, "refusals": {"not on CUDA": 1}}
    gr.reset()
    assert gr.report() == {"kernel": 0, "refusals": {}}


# --- the probe's rows arms -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def probe():
    return bench_script("gemv_probe")


def test_the_rows_arms_and_their_plain_twins(probe):
    assert {"pdl_m_r1", "pdl_m_r2", "pdl_m_r4", "pdl_m_r2_norm", "pdl_m_r2_merged"} <= set(probe.ROWS_ARMS)
    assert len(set(probe.ARM_NAMES)) == len(probe.ARM_NAMES) and set(probe.ROWS_ARMS) <= set(probe.ARM_NAMES)
    for name, spec in probe.ROWS_ARMS.items():
        assert set(spec) == {"rows", "pdl", "norm", "merged"}, name
        assert name.startswith("pdl_" if spec["pdl"] else "plain_"), name
        assert f"_m_r{spec['rows']}" in name and name.endswith("_norm") == spec["norm"], name
        assert not (spec["norm"] and spec["merged"]), name
        if spec["pdl"]:
            assert probe.ROWS_ARMS[name.replace("pdl_", "plain_", 1)] == dict(spec, pdl=False), name


def test_the_chain_and_merged_steps_at_m_rows(probe):
    lins = [nn.Linear(512, 768, bias=False), nn.Linear(512, 256, bias=False), nn.Linear(256, 512, bias=False)]
    projs = [(f"0.p{i}", lin) for i, lin in enumerate(lins)]
    calls = []

    class FakeGp:  # gemv_pdl.head_norm's contract: y [1, n] -> [1, k] head rows
        @staticmethod
        def head_norm(y, k, gamma, pdl):
            calls.append((tuple(y.shape), k, pdl))
            return torch.full((1, k), float(y.numel()))

    gemv_fn = lambda x, w, pdl: x @ w.T  # noqa: E731
    with torch.no_grad():
        outs = probe.make_chain_step(projs, dict(norm=True, pdl=True), torch.device("cpu"), gemv_fn,
                                     probe.rows_norm(FakeGp), m=8)()
        flat = probe.make_chain_step(projs, dict(norm=False, pdl=True), torch.device("cpu"), gemv_fn,
                                     probe.rows_norm(FakeGp), m=8)()
    assert [tuple(o.shape) for o in outs] == [(8, 768), (8, 256), (8, 512)] == [tuple(o.shape) for o in flat]
    assert calls == [((1, 8 * 768), 8 * 512, True), ((1, 8 * 256), 8 * 256, True)]  # the m rows flattened
    assert torch.equal(outs[1], torch.full((8, 512), 8.0 * 768) @ lins[1].weight.T)

    model = _model_31b_shapes()
    projs = probe.projections(model)
    ws = probe.merged_weights(projs)
    assert len(ws) == 241 and sum(w.numel() for w in ws) == sum(lin.weight.numel() for _, lin in projs)
    small = [(f"0.{p}", nn.Linear(k, n, bias=False)) for p, k, n in
             (("q_proj", 64, 128), ("k_proj", 64, 32), ("v_proj", 64, 32), ("o_proj", 128, 64))]
    seen = []
    with torch.no_grad():
        got = probe.make_merged_step(small, 8, torch.device("cpu"), lambda x, w: seen.append(
            (tuple(x.shape), tuple(w.shape))) or x @ w.T)()
    assert seen == [((8, 64), (192, 64)), ((8, 128), (64, 128))]  # q|k|v merged, o alone, at 8 rows
    assert [tuple(y.shape) for y in got] == [(8, 192), (8, 64)]


def _run13_command() -> list[str]:
    notes = (ROOT / "bench" / "MODEL_DECODE_NOTES.md").read_text()
    section = notes[notes.index("## Run 13: prediction"):]
    found = re.search(r"python3 bench/gemv_probe\.py (.*?)\n\n", section, re.S)
    assert found, "no probe command in run 13's section"
    return found.group(1).replace("\\\n", " ").split()


def test_run_13s_command_parses(probe):
    argv = _run13_command()
    args = probe.parse_args(argv)
    assert args.rows == [8, 4, 2] and "torch_merged" in args.arms
    assert set(probe.ROWS_ARMS) <= set(args.arms)
    # red twin: a misspelt arm in the command is refused before any GPU work
    with pytest.raises(SystemExit):
        probe.parse_args([a.replace("pdl_m_r2_norm", "pdl_m_r2_nrom") for a in argv])
