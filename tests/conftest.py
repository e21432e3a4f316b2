"""Shared test plumbing: named skip helpers for hardware and tools, and FOLDKV_REQUIRE_GPU turning skips into failures."""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

REQUIRE_GPU = os.environ.get("FOLDKV_REQUIRE_GPU", "") == "1"


def skip_or_fail(reason: str) -> None:
    """Skip, or fail when FOLDKV_REQUIRE_GPU=1 (on the H200 a skipped GPU test is a missing result)."""
    if REQUIRE_GPU:
        pytest.fail(f"FOLDKV_REQUIRE_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        skip_or_fail("no CUDA device")
    return torch.device("cuda")


def require_hopper() -> torch.device:
    dev = require_cuda()
    if torch.cuda.get_device_capability(dev) < (9, 0):
        skip_or_fail(f"needs sm_90 (Hopper), found {torch.cuda.get_device_name(dev)}")
    return dev


def require_tilelang() -> None:
    if importlib.util.find_spec("tilelang") is None:
        skip_or_fail("tilelang is not installed (pip install 'foldkv[kernels]')")


def require_module(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        skip_or_fail(f"{name} is not installed")


def synthetic_gpu_models(tmp_path_factory, *implementations: str, needs: tuple[str, ...] = (), seed: int = 2) -> dict:
    """The GPU model tests' model: the default synthetic Gemma 4 (`make_synthetic_checkpoint`, `seed`) in bf16 on the
    GPU, loaded once per attention implementation ({implementation: model}). Skips (fails under FOLDKV_REQUIRE_GPU)
    without a Hopper GPU, TileLang, transformers, safetensors or the modules in `needs`."""
    require_hopper()  # (a module fixture runs before the gpu mark's cuda_device check)
    require_tilelang()
    for name in ("transformers", "safetensors", *needs):
        require_module(name)
    import foldkv.hf  # noqa: F401  (registers "foldkv")
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic_gpu"), seed=seed)
    return {impl: load_model(ckpt, device="cuda", dtype=torch.bfloat16, attn_implementation=impl)
            for impl in implementations}


def graph_generate(model, lengths, new: int, **cache_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy `generate()` of a left-padded batch of `lengths` (seed 7) through a FoldKvCache whose decode step is one
    CUDA graph: (new tokens [B, new], logits [new, B, vocab] float32), both on the CPU. cache_kwargs go to the cache
    (kv_format=, dtype=, ...)."""
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    ids, mask = left_padded_batch(lengths, model.config.vocab_size, seed=7)
    cache = FoldKvCache(model, max_batch=len(lengths), max_tokens=max(lengths) + new, scatter_seed=3,
                        decode_step="graph", **cache_kwargs)
    out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                         **{cache_keyword(model): cache})
    return out.sequences[:, ids.shape[1]:].cpu(), torch.stack(out.logits).float().cpu()


# the loop versions' GPU tests (generate() on the synthetic model through a graph FoldKvCache): a left-padded batch of 8
# whose rings wrap, the new tokens, the pad id
THIN_LOOP_LENGTHS, THIN_LOOP_NEW, THIN_LOOP_PAD = (97, 300, 1000, 5, 64, 129, 700, 33), 12, 0


def free_run_tokens(model, picks) -> list[int]:
    """The tokens of the library's free greedy run (`thin_loop_generate` of THIN_LOOP_LENGTHS, min_new_tokens: no
    early stop) at (sequence, step) pairs, sorted, once each: EOS ids that end those sequences there."""
    free, _ = thin_loop_generate(model, THIN_LOOP_LENGTHS, THIN_LOOP_NEW, do_sample=False,
                                 min_new_tokens=THIN_LOOP_NEW)
    return sorted({int(free[b, s]) for b, s in picks})


# generate()'s keywords of the loop tests' calls (each a function of the model): the cells' greedy call, EOS ids from
# the free run so that one sequence (its 4th token), then all, finish early, sampling from a seed
THIN_LOOP_CALLS = {
    "greedy": lambda model: dict(do_sample=False, min_new_tokens=THIN_LOOP_NEW),
    "one_finishes": lambda model: dict(do_sample=False, eos_token_id=free_run_tokens(model, [(0, 3)]),
                                       pad_token_id=THIN_LOOP_PAD),
    "all_finish": lambda model: dict(do_sample=False, pad_token_id=THIN_LOOP_PAD, eos_token_id=free_run_tokens(
        model, [(b, 2 + b % 4) for b in range(len(THIN_LOOP_LENGTHS))])),
    "sampling": lambda model: dict(do_sample=True, top_k=50, min_new_tokens=THIN_LOOP_NEW),
}


def thin_loop_generate(model, lengths, new: int, seed: int | None = None, **generate_kw) -> tuple[torch.Tensor, dict]:
    """A plain `generate()` (no dict of outputs: the calls `foldkv.hf_loop`'s thin loop takes) of a left-padded batch of
    `lengths` (seed 7) through a FoldKvCache whose decode step is one CUDA graph, torch seeded with `seed` first:
    (new tokens [B, <= new] on the CPU, the steps the loop issued: the decode step's `loop_steps`). generate_kw go to
    generate()."""
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword

    ids, mask = left_padded_batch(lengths, model.config.vocab_size, seed=7)
    cache = FoldKvCache(model, max_batch=len(lengths), max_tokens=max(lengths) + new, scatter_seed=3,
                        decode_step="graph")
    if seed is not None:
        torch.manual_seed(seed)
    out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new,
                         **{cache_keyword(model): cache}, **generate_kw)
    return out[:, ids.shape[1]:].cpu(), dict(cache.decode_step.loop_steps)


def query_kernel_check(geom, fmt, batch: int, want: torch.Tensor, write) -> tuple[bool, bool]:
    """A kernel writing a global layer's format query, against `want` [batch, Hq, D]: `write(out)` fills out
    [batch + 2, Hq, D] on want's device, poisoned with NaN. Asserts no row past the batch is written, in either run.
    Returns (the batch's rows finite and equal to want; equal with the score map `global_step.column_maps` hands the
    kernel's launcher its two rotated halves exchanged: the red twin, False for a kernel that reads the map)."""
    from unittest import mock

    from foldkv import global_step

    hq, d, r = geom.num_q_heads, geom.head_dim, geom.rotary_width
    column_maps = global_step.column_maps

    def run(cols):
        out = torch.full((batch + 2, hq, d), float("nan"), dtype=want.dtype, device=want.device)
        if cols is None:
            write(out)
        else:
            with mock.patch.object(global_step, "column_maps", lambda *a: (cols, *column_maps(*a)[1:])):
                write(out)
        assert bool(out[batch:].isnan().all()), "a row past the batch was written"
        return bool(torch.isfinite(out[:batch]).all()) and torch.equal(out[:batch], want)

    score = column_maps(geom, fmt, want.device)[0]
    swapped = torch.cat([score[r // 2:r], score[: r // 2], score[r:]])  # the two rotated halves exchanged
    return run(None), run(swapped)


ROW_FORMATS = ("folded", "split", "fp8")  # the pools a global row kernel stores into; fp8: a folded FP8 pool


def pool_kind(fmt: str) -> tuple[str, torch.dtype | None]:
    """A ROW_FORMATS name -> (kv_format, dtype): "fp8" is the folded format in float8_e4m3fn (the row kernels quantize,
    the query is folded's); the others their format in the default dtype (None)."""
    from foldkv.fp8 import FP8_DTYPE

    return ("folded", FP8_DTYPE) if fmt == "fp8" else (fmt, None)


def row_store_check(geom, fmt, batch: int, device: str, seed: int, reference, store,
                    page_size: int = 16) -> tuple[bool, bool]:
    """A kernel storing a global layer's step rows: `reference(pool, pages, offsets)` and `store(pool, pages, offsets)`
    each into a fresh pool (fmt one of ROW_FORMATS, `pool_kind`; an FP8 pool's scales checked with its rows) of
    2 * batch + 3 pages of random rows whose step slots (a distinct page a sequence, an offset below page_size - 1)
    are poisoned with NaN. Asserts the reference wrote every slot. Returns (the store's pool equal to the reference's,
    bit for bit: the slots hold the rows and no other row changed; equal with the rows stored one offset off: the red
    twin, False for a right store)."""
    from foldkv.fp8 import FP8_DTYPE
    from foldkv.pool import PagedKvLayout, PagedKvPool

    kv_format, dtype = pool_kind(fmt)
    pages = 2 * batch + 3
    g = torch.Generator().manual_seed(seed)
    at_pages = torch.randperm(pages, generator=g)[:batch].to(device)
    at_offsets = torch.randint(0, page_size - 1, (batch,), generator=g).to(device)

    def pool():
        p = PagedKvPool(PagedKvLayout(geom, kv_format, page_size=page_size, num_pages=pages,
                                      dtype=dtype or torch.bfloat16), device=device)
        p.data.copy_(torch.randn(p.data.shape, generator=torch.Generator().manual_seed(seed + 1)).to(p.data.dtype))
        p.data[at_pages, :, at_offsets, :] = float("nan")
        if p.scales is not None:
            p.scales.copy_(torch.rand(p.scales.shape, generator=torch.Generator().manual_seed(seed + 2)) + 0.5)
            p.scales[at_pages, :, at_offsets] = float("nan")
        return p

    def parts(p):  # what a store writes, as bits (e4m3 has no torch.equal of its own)
        return [t.view(torch.uint8) if t.dtype == FP8_DTYPE else t for t in (p.data, p.scales) if t is not None]

    want = pool()
    reference(want, at_pages, at_offsets)
    assert all(bool(torch.isfinite(t.float()).all()) for t in (want.data, want.scales) if t is not None), \
        "the reference left a step slot unwritten"

    def run(offsets):
        p = pool()
        store(p, at_pages, offsets)
        return all(torch.equal(a, b) for a, b in zip(parts(p), parts(want)))

    return run(at_offsets), run(at_offsets + 1)


class NormStub(torch.nn.Module):
    """What foldkv's fused step ops read of a Gemma 4 RMSNorm: `weight` (bf16, exp of a seeded normal: positive,
    spread), `with_scale`, `eps`."""

    def __init__(self, d: int, seed: int, eps: float = 1e-6, scaled: bool = True, device: str = "cpu"):
        super().__init__()
        g = torch.Generator(device=device).manual_seed(seed)
        w = torch.exp(0.5 * torch.randn(d, generator=g, device=device)).to(torch.bfloat16)
        self.weight, self.with_scale, self.eps = torch.nn.Parameter(w), scaled, eps


def attention_norms(d: int, device: str = "cpu", seed: int = 1) -> torch.nn.Module:
    """What a layer's fused decode prologue reads of a Gemma 4 attention: q_norm and k_norm (weighted), v_norm (not)."""
    attn = torch.nn.Module()
    attn.q_norm, attn.k_norm = NormStub(d, seed, device=device), NormStub(d, seed + 1, device=device)
    attn.v_norm = NormStub(d, seed + 2, scaled=False, device=device)
    return attn


# The tiny synthetic Gemma 4 of the CPU model tests (test_hf_cpu, test_drift_cpu): hidden 64, vocab 128, the 31B global
# attention geometry; one checkpoint per session.
TINY_SYNTHETIC = dict(hidden_size=64, intermediate_size=128, vocab_size=128)

def tiny_synthetic_model(tmp_path_factory, name: str, sliding_window: int = 8):
    """The tiny synthetic Gemma 4 (TINY_SYNTHETIC, seed 3, `sliding_window`) in float32 under foldkv's attention: the
    CPU tests' model of the decode step, its options and the cache's reset."""
    require_module("transformers")
    require_module("safetensors")
    import foldkv.hf  # noqa: F401
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path_factory.mktemp(name), seed=3, sliding_window=sliding_window,
                                     **TINY_SYNTHETIC)
    return load_model(ckpt, dtype=torch.float32, attn_implementation="foldkv")



def left_padded_batch(lengths, vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids, attention_mask [len(lengths), max(lengths)] int64: each prompt of random ids in [3, vocab)
    right-aligned after padding (token 0), the way generate() takes a left-padded batch."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> str:
    """The TINY_SYNTHETIC checkpoint (seed 3) on disk, for from_pretrained."""
    require_module("transformers")
    require_module("safetensors")
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    return make_synthetic_checkpoint(tmp_path_factory.mktemp("synthetic"), seed=3, **TINY_SYNTHETIC)


def bench_version(name: str):
    """The module bench/versions/<name>.py (a kernel variant that lost), imported as the harnesses import it:
    `versions.<name>` with bench/ on the path."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    return importlib.import_module(f"versions.{name}")


_BENCH_SCRIPTS: dict = {}


def bench_script(name: str):
    """The script bench/<name>.py as a module, loaded once a session with bench/ on the path (as when it runs): the
    tests read its parsers, arm tables and CPU-side helpers."""
    if name not in _BENCH_SCRIPTS:
        bench = Path(__file__).resolve().parents[1] / "bench"
        if str(bench) not in sys.path:
            sys.path.insert(0, str(bench))
        spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _BENCH_SCRIPTS[name] = mod
    return _BENCH_SCRIPTS[name]


def probe_command_of_run(run: int):
    """The parsed arguments (bench/model_decode_probe.py's parser) of the first probe command written in
    bench/MODEL_DECODE_NOTES.md's "Run N: prediction" section (continuation lines joined): the command a prediction
    names is one the probe takes. Fails the test when the section names none."""
    notes = (Path(__file__).resolve().parents[1] / "bench" / "MODEL_DECODE_NOTES.md").read_text()
    start = notes.index(f"## Run {run}: prediction")
    end = notes.find("\n## ", start + 1)
    section = notes[start:end if end >= 0 else len(notes)] + "\n\n"
    found = re.findall(r"python3 bench/model_decode_probe\.py (.*?)\n\n", section, re.S)
    assert found, f"no step command in run {run}'s section"
    return bench_script("model_decode_probe").parser().parse_args(found[0].replace("\\\n", " ").split())


def pdl_bench_version(name: str):
    """A bench version built on `foldkv.gemv`'s programmatic dependent launch (`bench_version`), its call counts
    reset; skipped (failed under FOLDKV_REQUIRE_GPU=1) where Triton has no grid dependency control."""
    mod = bench_version(name)
    if not mod.HAS_GDC:
        skip_or_fail("Triton has no triton.language.extra.cuda.gdc_wait (PDL)")
    mod.reset()
    return mod


@pytest.fixture
def cuda_device() -> torch.device:
    """A Hopper CUDA device with TileLang, or skip (fail under FOLDKV_REQUIRE_GPU=1)."""
    dev = require_hopper()
    require_tilelang()
    return dev


def pytest_collection_modifyitems(config, items):
    # Every test marked gpu gets the cuda_device check even if it forgets to ask for the fixture.
    for item in items:
        if item.get_closest_marker("gpu") is not None and "cuda_device" not in getattr(item, "fixturenames", ()):
            item.fixturenames.append("cuda_device")


class Destructible:
    """Stands for a CUDA graph in the capture tests: its destruction is what a capture in progress does not survive."""

    def __init__(self, destroyed: list):
        self.destroyed = destroyed

    def __del__(self):
        self.destroyed.append(self)


@contextlib.contextmanager
def exact_projections() -> Iterator[None]:
    """Every projection (F.linear) computed in float64 from its bf16 operands and rounded once to bf16, and the step's
    options in force without PDL (`StepOptions.pdl`: a FoldKvCache or fused_step made inside takes them) so that
    every projection goes through it: the neutral figure's rounding. Beside cuBLAS's (float32
    accumulation, then one rounding) it is another legitimate rounding of the same products, so how far a model's
    logits move between the two is what the projections' rounding alone does to them."""
    from unittest import mock

    import dataclasses

    from foldkv.step_options import in_force, using

    def linear(x, weight, bias=None):
        y = x.double() @ weight.double().T
        return (y if bias is None else y + bias.double()).to(x.dtype)

    with mock.patch.object(torch.nn.functional, "linear", linear), using(dataclasses.replace(in_force(), pdl=False)):
        yield


def step_logits(model, ids: torch.Tensor, options=None) -> torch.Tensor:
    """The logits of `model` on `ids` (no cache before them: a transformers DynamicCache) through the decode step's
    own forward (`foldkv.fused_step.StepForward`, its projections merged first when the options merge), with
    `options` in force (None: those in force now): on CUDA, its kernels."""
    from transformers import DynamicCache

    from foldkv import fused_step as fs
    from foldkv.step_options import in_force, using

    options = in_force() if options is None else options
    if options.merge:
        fs.merge_projections(model)
    with torch.no_grad(), using(options):
        step = fs.StepForward(model, options)
        return step.prefill(DynamicCache(config=model.config), ids, None, None, 0).logits


def folded_row_sources(geom) -> tuple[torch.Tensor, torch.Tensor]:
    """For each folded-row column p: (is_key[p], head_column[p]), [D + R] bool and [D + R] int64 on the CPU.
    K_rot, then V_unrot, then V_rot: the folded row as the tests hold the column maps to it."""
    from foldkv.layout import rotated_columns, unrotated_columns

    rot, unrot = rotated_columns(geom), unrotated_columns(geom)
    head_col = torch.cat([rot, unrot, rot])
    is_key = torch.zeros(head_col.numel(), dtype=torch.bool)
    is_key[: rot.numel()] = True
    return is_key, head_col


def rounding_bound(neutral: torch.Tensor, incumbent: torch.Tensor) -> float:
    """What a projection rounding as good as the incumbent's may move logits by: each of the two sits within the
    neutral figure (max |exact-rounded logits - incumbent's|) of the exact-rounded logits, so by the triangle
    inequality the two are within twice it of each other. A rounding worse than the incumbent's (a row dropped, a
    reduction short) is not, which is what the red twins check."""
    return 2.0 * (neutral.float() - incumbent.float()).abs().max().item()


def triton_sm90(fn, signature: dict, constexprs: dict, divisible: tuple = (), num_warps: int = 4,
                num_stages: int | None = None) -> dict:
    """Compile a @triton.jit function for sm_90a without a GPU (Triton's own backend and the ptxas it ships), as its JIT
    would specialise it: `divisible` names the arguments known divisible by 16 (aligned pointers, strides). Returns
    the PTX's instruction counts ("ops": opcode -> count, predicates stripped), the shared memory and ptxas's
    registers and spill bytes, and the PTX ("ptx"). Skips where Triton or its nvidia backend is missing."""
    import collections
    import subprocess
    import tempfile

    require_module("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        skip_or_fail("this Triton has no nvidia backend")
    names = fn.arg_names
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in constexprs.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in divisible})
    options = dict(num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}))
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    ops = collections.Counter(re.findall(r"^\s+(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]+)", ptx, re.M))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        ptxas = get_ptxas(90)
        r = subprocess.run([getattr(ptxas, "path", ptxas), "-arch=sm_90a", "-v", str(path), "-o", str(path) + ".o"],
                           capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill", r.stderr)]
    assert regs, r.stderr[-2000:]
    return {"ops": ops, "shared": kernel.metadata.shared, "registers": int(regs.group(1)), "spill_bytes": sum(spills),
            "ptx": ptx}


# the FP8 tensor-core partial's versions (bench/versions/decode_partial_fp8_tc_*.py) gated in its place: the lengths
# and their ids, and the launch
FP8_TC_LENS = [(1,), (63,), (65,), (10_602,), (1, 97, 16_384, 54)]
FP8_TC_IDS = ["1", "63", "65", "10602", "ragged4"]


def fp8_tc_launch(kernel=None):
    """A `gates.run_case` launch: foldkv's decode over the case's FP8 pool with fp8_math="tensor_cores", planned for
    that partial's wave of 2 x SMs, its partial replaced by `kernel` (None: the library's)."""
    def launch(inp, out, lse):
        from foldkv.kernels.decode import decode, partial_wave, plan_decode

        plan = plan_decode(inp.pool.layout, inp.case.seq_lens, device=inp.pool.device,
                           num_sms=partial_wave(inp.pool.layout, inp.pool.device, "tensor_cores"))
        return decode(inp.pool, inp.query, inp.table, plan=plan, out=out, lse=lse, fp8_math="tensor_cores",
                      kernels=None if kernel is None else {"decode_partial_folded_fp8_tc": kernel})

    return launch


def two_launch_prologue(attn, q, k, v, cos, sin, ring_k, ring_v, slot):
    """A sliding layer's prologue as two launches, the library's `q_norm_rope` then step_twins' `kv_to_ring` (what
    `fused_step_ops.sliding_prologue` does in one, bitwise): the query rows returned, the rings' slot written."""
    from foldkv import fused_step_ops as ops
    from step_twins import kv_to_ring

    d = ring_k.shape[-1]
    out = ops.q_norm_rope(q, attn.q_norm.weight, ops.norm_eps(attn.q_norm), cos, sin, q.shape[-1] // d)
    kv_to_ring(k, v, attn.k_norm.weight, ops.norm_eps(attn.k_norm), ops.norm_eps(attn.v_norm), cos, sin, ring_k, ring_v,
               slot)
    return out


def sliding_prologue_without_kv(attn, q, k, v, cos, sin, ring_k, ring_v, slot):
    """The red twin of `fused_step_ops.sliding_prologue`: its one launch copied here with the grid holding the query
    rows only, so the rings' slot is not written (what a grid that forgot the KV rows would do)."""
    from foldkv import fused_step_ops as ops

    d = ring_k.shape[-1]
    out, q_args, dq = ops.q_rows_args(q, attn.q_norm.weight, ops.norm_eps(attn.q_norm), cos, sin, q.shape[-1] // d)
    _, kv_args, _ = ops.kv_rows_args(k, v, attn.k_norm.weight, ops.norm_eps(attn.k_norm), ops.norm_eps(attn.v_norm),
                                     cos, sin, ring_k, ring_v, slot)
    q_rows = out.shape[0] * out.shape[1]
    ops._kernels()["sliding_prologue"][(q_rows,)](*q_args, *kv_args, q_rows, D=dq, num_warps=ops._warps(dq),
                                                  **ops._pdl(q))
    return out


# the ring attention tests' geometries: the 31B's sliding layers and the synthetic model's (Hq, Hkv, d, W, scaling)
RING_GEOMETRIES = {"31b": (32, 16, 256, 1024, 1.0), "synthetic": (32, 4, 32, 128, 0.125)}


def scaled_module(scaling: float) -> torch.nn.Module:
    """A module with only `scaling`: what `ring.ring_attention` reads of its attention module."""
    module = torch.nn.Module()
    module.scaling = scaling
    return module


def ring_reference(scores: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                   rounded: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A sliding layer's ring attention in float64 from its rounded scores s [B, Hkv, G, W]: the softmax of the
    masked scores (mask [B, ..., W] bool, True: attend) rounded to v's dtype (P; float64 when not `rounded`), and
    P.V [B, Hkv, G, d] in float64."""
    b, w = mask.shape[0], mask.shape[-1]
    x = scores.double().masked_fill(~mask.reshape(b, 1, 1, w), float("-inf"))
    p = torch.softmax(x, dim=-1)
    p = p.to(v.dtype) if rounded else p
    return p, p.double() @ v.double()


def ring_output_bound(p: torch.Tensor, v: torch.Tensor, o: torch.Tensor, extra=None) -> torch.Tensor:
    """How far a ring attention's output may sit from `ring_reference`'s o given the same scores (u = 2^-24): P off
    by one ulp(p_j) (float32's exp and sum are far under a bf16 ulp), P.V's float32 sum over W slots off by at most
    W 2u sum_j |p_j v_j| (2u: tensor-core accumulation), the output's own rounding ulp(o), times 1.25 for the
    second-order terms; `extra` (a relative move of every p_j, e.g. from other scores) adds extra sum_j p_j |v_j|."""
    from foldkv.lab.gates.checks import bf16_ulp

    pv = p.double() @ v.double().abs()
    bound = bf16_ulp(o.double()) + bf16_ulp(p.double()) @ v.double().abs() + v.shape[2] * 2 * 2.0 ** -24 * pv
    if extra is not None:
        bound = bound + extra * pv
    return 1.25 * bound + 2.0 ** -133


GREEDY_PICK_CASES = ("ties", "nan", "eos_below_min", "eos_at_min", "all_neg_inf", "finished")
GREEDY_PICK_RED = {"ties": "last_of_a_tie", "eos_below_min": "no_eos_mask"}  # the case each red twin must fail


def greedy_pick_case(case: str, batch: int, vocab: int, device="cpu", seed: int = 0) -> dict:
    """`hf_loop.pick_tokens`' keywords for a greedy pick (bench/versions/greedy_pick_fused.py's tests): random bf16
    logits [B, V] with each row holding the case: "ties" (the maximum at two columns of the first chunk and one of the
    last), "nan" (a larger number, then two NaNs), "eos_below_min" / "eos_at_min" (an EOS id the maximum, the
    min_new_tokens processor one token short of its minimum / at it), "all_neg_inf" (the odd rows all -inf),
    "finished" (the even rows finished: padded with 7). Every row unfinished but in "finished"; EOS ids 2 and V - 3."""
    from transformers.generation.logits_process import LogitsProcessorList, MinNewTokensLengthLogitsProcessor

    if case not in GREEDY_PICK_CASES:
        raise ValueError(f"case {case!r}: one of {GREEDY_PICK_CASES}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, vocab, generator=g).to(torch.bfloat16)
    eos, last = [2, vocab - 3], vocab - 1
    for r in range(batch):
        if case == "ties":
            x[r, 1 + r] = x[r, 4 + r] = x[r, last - r] = 20.0
        elif case == "nan":
            x[r, last - r] = 40.0
            x[r, 7 + r] = x[r, last - 1 - r] = float("nan")
        elif case.startswith("eos"):
            x[r, eos[r % 2]], x[r, 11 + r] = 50.0, 30.0
        elif case == "all_neg_inf" and r % 2:
            x[r] = float("-inf")
        elif case == "finished":
            x[r, 13 + r] = 30.0
    new, prompt = (4 if case == "eos_below_min" else 5), 10
    unfinished = torch.ones(batch, dtype=torch.long)
    if case == "finished":
        unfinished[::2] = 0
    processors = LogitsProcessorList([MinNewTokensLengthLogitsProcessor(prompt, 5, eos, device=device)])
    return dict(input_ids=torch.zeros(batch, prompt + new, dtype=torch.long, device=device), logits=x.to(device),
                logits_processor=processors,
                do_sample=False, unfinished=unfinished.to(device), pad_token_id=torch.tensor(7, device=device),
                has_eos=True)


@contextlib.contextmanager
def collecting_at_every_allocation() -> Iterator[None]:
    """The cyclic collector's thresholds at 1 (an allocation may start a collection of every generation), restored
    after: what makes a capture test's garbage die mid-capture unless the collector is paused."""
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


def drop_into_garbage(held: list) -> None:
    """Put the held graph into a fresh reference cycle and drop it (garbage only the cyclic collector frees), then
    allocate: with the collector's threshold at 1, a collection follows unless it is paused."""
    cycle = [held.pop()]
    cycle.append(cycle)
    del cycle
    _ = [[i] for i in range(64)]


def merged_linear(owner, x: torch.Tensor):
    """The decode step's merged GEMV of `owner`'s projection group (`foldkv.fused_step._Group`, merge on) on x, split
    into each projection's output; None when the group is not merged (or a weight was replaced since)."""
    from foldkv import fused_step as fs

    names = fs._attention_names(owner) if hasattr(owner, "q_proj") else ("gate_proj", "up_proj")
    group = fs._Group(owner, names, merge=True)
    return None if group.merged is None else tuple(group(x))
