"""bench/prefill_kernel_probe.py on the CPU: its cells and its hostile gate case are what its docstring promises (a
4,096-query chunk at 8K and 32K; lengths 1, 63, 65 and 4,100, a partial last tile, a chunk starting mid-page), every
version it times is a file in bench/versions/ with its row in the index and its name in the prefill notes, and each
version's TileLang program takes exactly the library prefill's arguments (names, dtypes, which dims are a prompt's:
the launcher's `kernels=` contract). Red twins: a probe arm naming a version that is not there, and a program with
the split pool's row width, are each caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import bench_script, bench_version, require_tilelang
from test_versions_index import index_rows

ROOT = Path(__file__).resolve().parents[1]
PAGE = 64


@pytest.fixture(scope="module")
def probe():
    return bench_script("prefill_kernel_probe")


def test_cells_are_a_4096_chunk_at_8k_and_32k(probe):
    from foldkv.lab.bench.case import prefill_flops

    assert sorted(probe.CELLS) == [(4096, 8192), (4096, 32768)]
    assert all(0 < prefill_flops(chunk, ctx) for chunk, ctx in probe.CELLS)
    args = probe.parse_args(["--out", "/tmp/probe"])
    assert args.arms == list(probe.ARMS) and args.rounds >= 5


def test_hostile_case_has_the_awkward_lengths(probe):
    from foldkv.kernels.prefill import TOKENS_PER_TILE

    seq_lens, q_lens = probe.HOSTILE
    assert len(seq_lens) == len(q_lens) and all(1 <= q <= n for q, n in zip(q_lens, seq_lens))
    assert {1, 63, 65, 4100} <= set(seq_lens)
    assert any(q % TOKENS_PER_TILE for q in q_lens)  # a partial last tile of query tokens
    assert any((n - q) % PAGE for q, n in zip(q_lens, seq_lens) if q < n)  # a chunk starting mid-page
    assert any(n % PAGE for n in seq_lens)  # a partial last page (its tail rows hold NaN in the gate's pool)


def version_problems(arms: dict) -> list[str]:
    """Arms whose version is not a file of bench/versions/, has no index row, or is not named in the notes."""
    rows = index_rows((ROOT / "bench" / "versions" / "README.md").read_text())
    notes = (ROOT / "bench" / "PREFILL_NOTES.md").read_text()
    problems = []
    for arm, (_, version) in arms.items():
        if version is None:
            continue
        f = f"{version}.py"
        if not (ROOT / "bench" / "versions" / f).is_file():
            problems.append(f"{arm}: no file {f}")
        elif rows.get(f) != ["PREFILL_NOTES.md"]:
            problems.append(f"{arm}: {f} has no row in the prefill section of the index")
        elif f not in notes:
            problems.append(f"{arm}: {f} not named in bench/PREFILL_NOTES.md")
    return problems


def test_probe_arms_are_indexed_versions(probe):
    assert any(v for _, v in probe.ARMS.values()) and version_problems(probe.ARMS) == []
    gone = {**probe.ARMS, "gone": ("folded", "prefill_gone")}
    assert version_problems(gone) == ["gone: no file prefill_gone.py"]  # red twin


def signature(func) -> dict:
    """{argument: (dtype, [dim is a variable])} of a TIR prim_func's buffer arguments, in order."""
    from tvm import tirx

    return {str(p.name).removesuffix("_handle"): (str(func.buffer_map[p].dtype),
                                                   [d if isinstance(d, tirx.IntImm) else None
                                                    for d in func.buffer_map[p].shape])
            for p in func.params if p in func.buffer_map}


def as_comparable(sig: dict) -> dict:
    return {k: (dt, [None if d is None else int(d) for d in dims]) for k, (dt, dims) in sig.items()}


def test_versions_take_the_library_prefill_arguments(probe):
    require_tilelang()
    from foldkv import GEMMA4_31B
    from foldkv.kernels import prefill_folded
    from foldkv.kernels.prefill_attention import prefill_program
    from foldkv.kernels.resolve import kernel_params

    library = {"folded": as_comparable(signature(prefill_folded.program(GEMMA4_31B))),
               "split": as_comparable(signature(prefill_program(GEMMA4_31B, "split")))}
    versions = [(fmt, v) for fmt, v in probe.ARMS.values() if v]
    for fmt, version in versions:  # built as the probe builds them: the registered params passed through
        got = as_comparable(signature(bench_version(version).program(GEMMA4_31B, **kernel_params(f"prefill_{fmt}"))))
        assert list(got) == list(library[fmt]) and got == library[fmt], version
    assert library["split"] != library["folded"]  # red twin: the split pool's rows are 1,024 wide, the folded 640


def test_rates_are_the_cells_medians_against_the_matmul_rate(probe):
    def arm(median_us, ok=True):
        return {"status": "ok", "us": {"median": median_us, "p10": median_us, "p90": median_us},
                "check": {"ok": ok, "rel_err": 1e-3}}

    cell = {"cell": "prefill_4096_at_32768", "flops": 8e12,
            "arms": {"library_folded": arm(20_000), "two_stages": arm(16_000, ok=False),
                     "lazy_rescale": {"status": "error", "reason": "gate failed"}}}
    rows = {r["arm"]: r for r in probe.rates([cell], roof_tflops=800.0)}
    assert rows["library_folded"]["tflops"] == pytest.approx(400.0)
    assert rows["library_folded"]["pct_matmul"] == pytest.approx(50.0)
    assert rows["two_stages"]["speedup_vs_library_folded"] == pytest.approx(1.25)
    assert rows["two_stages"]["check_ok"] is False  # timed, but its failed check is carried to the table
    assert "tflops" not in rows["lazy_rescale"] and rows["lazy_rescale"]["reason"] == "gate failed"
