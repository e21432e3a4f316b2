"""bench/versions/ring_attention_split.py and ring_attention_one_launch.py without a GPU: the plans (the split's
chunks partition the window once, the one launch's splits partition the chunks once; the 31B's geometry gives 256
programs at batch 1 and 8; a plan one chunk or split short is caught), the routes' refusals (each named, a CPU call
falling back to the library bitwise with its reason counted), installing patches both call sites and restores them
(on exit, on an exception; one version at a time), and the probe's --ring-ab and --ring-one-ab flags."""

from __future__ import annotations


import pytest
import torch

from conftest import bench_script, bench_version


@pytest.fixture(scope="module")
def ras():
    return bench_version("ring_attention_split")


def _covered_once(ras, p: dict, window: int) -> bool:
    seen = [s for r in ras.chunk_slots(p, window) for s in r]
    return sorted(seen) == list(range(window)) and len(seen) == window


@pytest.mark.parametrize("window", [1, 15, 16, 64, 100, 128, 1000, 1024, 4096])
def test_the_chunks_partition_the_window(ras, window):
    p = ras.plan(1, 32, 16, window, 256)
    assert _covered_once(ras, p, window)
    assert p["CHUNK"] >= 16 and p["CHUNK"] & (p["CHUNK"] - 1) == 0 and p["CHUNK"] <= ras.CHUNK
    assert p["S_BLOCK"] >= p["chunks"] and p["W_BLOCK"] >= window
    short = dict(p, chunks=p["chunks"] - 1)  # red twin: one chunk short of the window
    assert not _covered_once(ras, short, window)


def test_the_31b_geometry(ras):
    p = ras.plan(1, 32, 16, 1024, 256)
    assert (p["GROUP"], p["G_PAD"], p["CHUNK"], p["chunks"], p["programs"], p["sum_programs"]) == (2, 16, 64, 16,
                                                                                                 256, 32)
    assert ras.plan(8, 32, 16, 1024, 256)["programs"] == 2048
    synthetic = ras.plan(3, 32, 4, 128, 32)  # tests/test_fused_step_sliding_gpu.py's synthetic geometry
    assert (synthetic["GROUP"], synthetic["chunks"]) == (8, 2)
    assert ras.shape_refusal(1, 32, 16, 1024, 256, torch.bfloat16) is None
    assert ras.shape_refusal(3, 32, 4, 128, 32, torch.bfloat16) is None


@pytest.mark.parametrize("args,words", [
    ((1, 32, 16, 1024, 256, torch.float32), "bf16 or fp16"),
    ((1, 30, 16, 1024, 256, torch.bfloat16), "whole groups"),
    ((1, 64, 2, 1024, 256, torch.bfloat16), "group 32"),
    ((1, 32, 16, 1024, 512, torch.bfloat16), "head_dim 512"),
    ((1, 32, 16, 1024, 96, torch.bfloat16), "head_dim 96"),
    ((1, 32, 16, 8192, 256, torch.bfloat16), "window 8192"),
])
def test_shape_refusals_name_their_reason(ras, args, words):
    assert words in ras.shape_refusal(*args)


def _call(b=2, hq=8, hkv=4, w=40, d=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, w, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, w, d, generator=g).to(dtype)
    m = torch.rand(b, 1, 1, w, generator=g) < 0.7
    m[..., 0] = True
    return q, k, v, m


def test_route_refusals(ras):
    from foldkv.masks import RingMask

    q, k, v, m = _call()
    assert ras.refusal(q, k, v, m) == "not a RingMask"
    assert ras.refusal(q, k, v, RingMask(m)) == "not on CUDA"
    assert "rings" in ras.refusal(q, k[:, :, :-1], v, RingMask(m))
    assert "mask" in ras.refusal(q, k, v, RingMask(m[..., :-1]))
    assert "contiguous" in ras.refusal(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, RingMask(m))
    assert "dtypes" in ras.refusal(q, k.half(), v, RingMask(m))


@pytest.mark.parametrize("name,label,other", [("ring_attention_split", "split", "ring_attention_one_launch"),
                                              ("ring_attention_one_launch", "one-launch", "ring_attention_split")])
def test_install_patches_both_call_sites_and_falls_back_on_cpu(name, label, other):
    from foldkv import hf, ring
    from foldkv.masks import RingMask

    version = bench_version(name)
    library = ring.ring_attention
    q, k, v, m = _call()
    module = torch.nn.Module()
    module.scaling = 0.5
    want = library(module, q, k, v, RingMask(m))[0]
    with version.installed() as route:
        assert ring.ring_attention is not library and ring.ring_attention._ring_version == label
        assert hf.ring is ring  # foldkv's attention function reads the one name patched
        for again in (version, bench_version(other)):  # one version at a time
            with pytest.raises(RuntimeError, match=f"already has the {label} kernels"):
                again.install()
        got = ring.ring_attention(module, q, k, v, RingMask(m))[0]
        assert torch.equal(got, want)  # the CPU call is the library's
        assert route.report() == {"calls": 0, "refusals": {"not on CUDA": 1}}
    assert ring.ring_attention is library
    with pytest.raises(ValueError):
        with version.installed():
            raise ValueError("inside")
    assert ring.ring_attention is library


def test_the_probe_parses_ring_ab():
    probe = bench_script("model_decode_probe")
    args = probe.parser().parse_args(["--decode", "foldkv-folded:4096:1", "--ring-ab"])
    assert args.ring_ab and args.decode == ["foldkv-folded:4096:1"]
    assert not probe.parser().parse_args([]).ring_ab


# --- ring_attention_one_launch.py ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def one():
    return bench_version("ring_attention_one_launch")


@pytest.mark.parametrize("splits", [None, 1, 2, 3, 5, 16, 40])
@pytest.mark.parametrize("window", [1, 64, 65, 200, 1000, 1024])
def test_the_one_launch_splits_partition_the_chunks(one, window, splits):
    p = one.plan(3, 32, 4, window, 64, sms=132, splits=splits)
    parts = one.split_chunks(p)
    assert [c for r in parts for c in r] == list(range(p["chunks"])) and all(len(r) for r in parts)
    assert len(parts) == p["splits"] <= p["S_BLOCK"] and p["programs"] == p["pairs"] * p["splits"]
    short = dict(p, splits=p["splits"] - 1)  # red twin: one split short
    assert [c for r in one.split_chunks(short) for c in r] != list(range(p["chunks"]))


def test_the_one_launch_plan_on_the_31b(one):
    """On the H200's 132 SMs: batch 1, 16 KV heads x 16 one-chunk splits (about two programs an SM); batch 4, 64 pairs
    x 4 splits of four chunks; batch 8 and more (128 pairs and up: 7/8 of the SMs), the whole window a program,
    nothing combined."""
    got = {b: one.plan(b, 32, 16, 1024, 256, sms=132) for b in (1, 4, 8, 16)}
    assert [(got[b]["splits"], got[b]["CPS"], got[b]["programs"]) for b in (1, 4, 8, 16)] == [
        (16, 1, 256), (4, 4, 256), (1, 16, 128), (1, 16, 256)]
    assert one.plan(8, 32, 16, 1024, 256, sms=132, splits=2)["programs"] == 256


def test_a_wrong_out_is_refused_before_the_launch(one):
    q, k, v, m = _call()
    with pytest.raises(ValueError, match="packed"):
        one.ring_attend(q, k, v, m, 1.0, out=torch.empty(2, 1, 8, 17, dtype=torch.bfloat16))


def test_the_probe_parses_ring_one_ab():
    probe = bench_script("model_decode_probe")
    args = probe.parser().parse_args(["--decode", "foldkv-folded:4096:8", "--ring-one-ab"])
    assert args.ring_one_ab and not args.ring_ab
    assert not probe.parser().parse_args([]).ring_one_ab


def test_run_25s_step_command_parses():
    from conftest import probe_command_of_run

    args = probe_command_of_run(25)
    assert args.ring_one_ab and "foldkv-folded:4096:8" in args.decode and "foldkv-folded:4096:1" in args.decode, args
    assert args.profile and args.profile_lab and args.profile_at == (4096, 8), args


ONE_LAUNCH_SIGNATURE = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "m_ptr": "*u8", "o_ptr": "*bf16",
                        "part_ptr": "*fp32", "stat_ptr": "*fp32", "count_ptr": "*i32", "heads_kv": "i32",
                        "window": "i32", "chunks": "i32", "cps": "i32", "splits": "i32", "q_sb": "i32", "q_sh": "i32",
                        "q_sd": "i32", "scaling": "fp32", "skip": "i32"}


def _one_launch_sm90(one, p: dict, stages: int) -> dict:
    from conftest import triton_sm90

    consts = dict(GROUP=2, G_PAD=16, D=256, CHUNK=64, S_BLOCK=p["S_BLOCK"], SCALE=False, ONE=p["splits"] == 1,
                  STAGES=stages, RED_NO_MASK=False, RED_NO_RESET=False, GDC=True)
    return triton_sm90(one.ring_one_launch, ONE_LAUNCH_SIGNATURE, consts, num_warps=one.WARPS,
                       divisible=("q_ptr", "k_ptr", "v_ptr", "m_ptr", "o_ptr", "part_ptr", "stat_ptr", "count_ptr",
                                  "heads_kv", "window", "q_sb", "q_sh"))


def _fits(got: dict, per_sm: int, warps: int) -> bool:
    """`per_sm` programs within an H200 SM's 65,536 registers and 227 KB of shared memory."""
    return per_sm * got["registers"] * 32 * warps <= 65536 and per_sm * got["shared"] <= 227 * 1024


@pytest.mark.parametrize("batch", [1, 8])
def test_the_one_launch_compiles_for_the_h200_as_planned(one, batch):
    """The kernel at the 31B's geometry compiled for sm_90a on the CPU (Triton's backend and ptxas), as the plan
    launches it at batch 1 (16 one-chunk splits and a combine) and 8 (the whole window a program): no spill; the K and
    V loads asynchronous (cp.async, `STAGES` deep); the programs an SM the plan counts on fit its registers and shared
    memory; PDL's two instructions and, split, the counter's atomic. Red twin: three stages would not fit two programs
    an SM."""
    p = one.plan(batch, 32, 16, 1024, 256, sms=132)
    got = _one_launch_sm90(one, p, one.STAGES)
    ops, per_sm = got["ops"], -(-p["programs"] // 132)
    assert got["spill_bytes"] == 0 and _fits(got, per_sm, one.WARPS), (per_sm, got)
    assert ops["griddepcontrol.launch_dependents"] == ops["griddepcontrol.wait"] == 1
    assert ops["cp.async.cg.shared.global"] > 0, ops
    assert (sum(n for k, n in ops.items() if k.startswith("atom.")) > 0) == (p["splits"] > 1), ops
    if per_sm > 1:
        assert not _fits(_one_launch_sm90(one, p, 3), per_sm, one.WARPS), "red twin: three stages fit as well"


def test_the_two_branch_ring_attention_refuses_what_it_does_not_describe_and_goes_back():
    """bench/versions/ring_attention_branched.py without a GPU (its kernels are the library's; its GPU test holds them
    bitwise): a CPU call, an odd batch of 3 and unpacked rings refused with their reasons; installed, the library's
    ring attention is patched in both places foldkv calls it and put back after; the probe parses --ring-branch-ab."""
    from foldkv import ring
    from foldkv.masks import RingMask

    branched = bench_version("ring_attention_branched")
    q, k, v, m = _call()
    assert branched.refusal(q, k, v, RingMask(m)) == "not on CUDA"  # described: only the device is missing
    q3, k3, v3, m3 = _call(b=3)
    assert "odd" in branched.refusal(q3, k3, v3, RingMask(m3))
    assert branched.refusal(*_call(b=1, hkv=4)[:3], RingMask(_call(b=1)[3])) == "not on CUDA"
    assert branched.refusal(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, RingMask(m)) == "rings not packed"
    library = ring.ring_attention
    with branched.installed() as state:
        assert ring.ring_attention is not library
        assert state.report() == {"calls": 0, "refusals": {}}
    assert ring.ring_attention is library
    probe = bench_script("model_decode_probe").parser()
    assert probe.parse_args(["--ring-branch-ab"]).ring_branch_ab and not probe.parse_args([]).ring_branch_ab
    # what each half calls: the library's ring attention writing P.V into a slice of one output (its `out=`)
    from conftest import scaled_module

    b, hq, hkv, d = q.shape[0], q.shape[1], k.shape[1], q.shape[-1]
    whole = library(scaled_module(0.5), q, k, v, RingMask(m))[0]
    out = torch.full((b, hkv, hq // hkv, d), float("nan"), dtype=v.dtype)
    library(scaled_module(0.5), q[1:], k[1:], v[1:], RingMask(m[1:]), out=out[1:])
    assert out[0].isnan().all() and torch.equal(out[1:].reshape(b - 1, 1, hq, d), whole[1:])


def test_the_l2_prefetch_refuses_what_it_does_not_describe_and_goes_back():
    """bench/versions/oproj_l2_prefetch.py without a GPU (its ring attention is the library's; its GPU test holds the
    step's tokens and the read's sum): batch 2, a float32 or strided o_proj weight and a CPU call refused with their
    reasons; the prefix is whole stream blocks of the weight (24 MB of the 31B's sliding o_proj: its first 1,536 rows;
    a prefix past the weight is the weight); installed, the library's ring attention is wrapped (a CPU call falls
    back to it bitwise, counted) and put back after; the probe parses --l2-prefetch-ab and the notes' run 27 command."""
    from conftest import probe_command_of_run, scaled_module
    from foldkv import ring
    from foldkv.masks import RingMask
    from foldkv.lab.bench.roofs import STREAM_BLOCK

    pre = bench_version("oproj_l2_prefetch")
    module = scaled_module(0.5)
    module.o_proj = torch.nn.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    q, k, v, m = _call(b=1)
    assert pre.refusal(module, q) == "not on CUDA"  # described: only the device is missing
    assert "batch 2" in pre.refusal(module, _call(b=2)[0])
    module.o_proj.weight.data = module.o_proj.weight.data.float()
    assert "contiguous bf16" in pre.refusal(module, q)
    module.o_proj.weight.data = torch.randn(64, 128).to(torch.bfloat16).t().contiguous().t()
    assert "contiguous bf16" in pre.refusal(module, q)
    sliding_o_proj = torch.empty(5376, 8192, dtype=torch.bfloat16, device="meta")
    blocks = pre.prefix_blocks(sliding_o_proj)
    assert blocks * STREAM_BLOCK == 1536 * 8192 and pre.prefix_blocks(sliding_o_proj, 1 << 20) == 5376 * 8192 // 4096
    module.o_proj.weight.data = torch.randn(64, 128).to(torch.bfloat16)
    library = ring.ring_attention
    want = library(module, q, k, v, RingMask(m))[0]
    with pre.installed() as state:
        assert ring.ring_attention is not library
        got = ring.ring_attention(module, q, k, v, RingMask(m))[0]
        assert state.report() == {"calls": 0, "refusals": {"not on CUDA": 1}}
    assert ring.ring_attention is library and torch.equal(got, want)
    probe = bench_script("model_decode_probe").parser()
    assert probe.parse_args(["--l2-prefetch-ab"]).l2_prefetch_ab and not probe.parse_args([]).l2_prefetch_ab
    noted = probe_command_of_run(27)
    assert noted.l2_prefetch_ab and noted.ring_branch_ab and "foldkv-folded:4096:1" in noted.decode


def _tiny_ring_case():
    """bench/ring_probe.py's case at a tiny geometry on the CPU: 2 requests of a 64-token window, 16-token pages."""
    from foldkv.config import AttentionGeometry
    from foldkv.lab.bench.case import AttentionCase

    geom = AttentionGeometry(num_q_heads=8, num_kv_heads=4, head_dim=32, name="tiny ring")
    return AttentionCase([64, 64], device="cpu", geom=geom, page_size=16, min_copies=1, max_copies=1)


def test_the_ring_probe_times_the_library_ring_attention_as_a_harness_arm():
    """bench/ring_probe.py on the CPU: its ring arm runs in the lab's decode harness (`_tiny_ring_case`): rings made
    from the split pool's pages hold exactly those rows, the library's ring attention over them passes the harness's
    check against the float64 reference (poisoned output, written whole, its guard row untouched) as the plain torch
    decode does (its red twin: the next test). A batch of 0 is refused before anything is allocated; the split read
    is a registered arm; the notes' run 30 command parses."""
    import re
    from pathlib import Path

    from foldkv.layout import KvFormat
    from foldkv.lab.bench import run_cell
    from foldkv.lab.bench.arms import DECODE_ARMS, READ_SPLIT

    rp = bench_script("ring_probe")
    case = _tiny_ring_case()
    pool = case.pools(KvFormat.SPLIT)[0]
    k, v = rp.rings_from_pool(pool, case.table_cpu.page_ids, 64)
    assert k.shape == v.shape == (2, 4, 64, 32) and k.is_contiguous()
    page, slot = case.table_cpu.page_ids[1, 2], 5  # request 1's token 2 * 16 + 5
    assert torch.equal(k[1, :, 37], pool.data[page, :, slot, :32])
    assert torch.equal(v[1, :, 37], pool.data[page, :, slot, 32:])
    cell = run_cell("ring/x2", "decode", case, [rp.ring_arm(), "torch"], rounds=1, warmup=1, log=lambda s: None)
    ring = cell["arms"]["ring_cublas"]
    assert ring["status"] == "ok" and ring["check"]["ok"] and ring["check"]["no_overrun"], ring["check"]
    assert cell["arms"]["torch"]["check"]["ok"]
    with pytest.raises(ValueError, match="batches"):
        rp.cases([1, 0], "cpu")
    assert READ_SPLIT in DECODE_ARMS and DECODE_ARMS[READ_SPLIT].format == "split"
    notes = (Path(__file__).resolve().parents[1] / "bench" / "MODEL_DECODE_NOTES.md").read_text()
    section = notes[notes.index("## Run 30: first measurement"):]
    cmd = re.search(r"python3 bench/ring_probe\.py (.*)", section).group(1).split()
    assert rp.parser().parse_args(cmd).batches == [1, 8]


def test_the_ring_probe_red_twin_fails_the_check():
    """The same harness cell with each request given the next request's ring: outside the tolerance."""
    from foldkv.lab.bench import run_cell

    rp = bench_script("ring_probe")
    twin = run_cell("ring/x2", "decode", _tiny_ring_case(), [rp.ring_arm("other_request")], rounds=1, warmup=1,
                    log=lambda s: None)["arms"]["ring_cublas"]
    assert not twin["check"]["ok"], twin["check"]
