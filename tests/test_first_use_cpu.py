"""What the prefill of generate() on a FoldKvCache does once per process or once per prompt length, on the CPU.

- A FoldKvCache with kernel attention resolves (builds or loads) the prefill kernels its global layers will launch at
  its creation (`FoldKvCache._load_kernels`), exactly those `prefill` resolves for its pool (bf16 folded and split,
  FP8 with its page gather), so a process's first prompt does not import TileLang and elaborate and load them inside
  its time to first token. Red twin: a `_load_kernels` that resolves nothing (what it did before) is caught.
- Building the decode step warms its prefill (`FoldKvCache` -> `DecodeStep.warm_prefill` ->
  `StepForward.warm_prefill`): every Triton glue kernel a prefill chunk launches, at every specialisation a chunk's
  launch takes (Triton's: dtypes and 16-byte alignment of pointers, ints == 1 and divisible by 16, constexprs), is
  launched by the warm-up, so a process's first prompt loads none; so is each GEMM shape a chunk launches, its
  projection groups merged or one GEMM a projection (`StepOptions.merge_prefill`). Traced on the CPU with
  `Tensor.is_cuda` made True and each kernel's launch recorded (no kernel runs: its outputs are filled). Red twins: a
  warm-up that skips one kernel (gelu_mul), one that reads q/k/v's head rows as a packed copy (another
  specialisation), one of merged GEMMs where the chunk runs them split, and one of two passes where the chunk norms
  and rotates q and k in one (`StepOptions.fuse_prefill_norm_rope`), and one whose LM head leaves out the model's
  softcap (its tanh's module, loaded at the first launch, cost a fresh process's first prompt ~0.1-0.2 s), are
  caught.
- The cache's creation on CUDA also runs one generate() of a two-token prompt through it and empties it again
  (`FoldKvCache.warm_generate`): every (op, dtypes) that a first prompt's generate() runs outside the model's modules
  (position ids, special tokens, the min-length processor's mask, the token's pick, the stopping checks) is run by
  it, recorded with a dispatch mode (their kernels' modules, loaded at a first launch, cost a fresh process's first
  prompt +28% on the H100 after the softcap's was warmed). Red twin: a warm-up of the forward alone is caught. The
  cache after it is as new and no random number was drawn.
- The TileLang prefill program bakes no length: every dim of its arguments that depends on the prompt (queries,
  pages, batch, tiles) is a dynamic variable, so one kernel serves every length. Red twin: a program with a static
  query count is caught by the same check.
"""

from __future__ import annotations

import pytest
import torch

from conftest import require_module, require_tilelang
from foldkv.kernels import prefill as prefill_launcher
from foldkv.kernels import resolve


@pytest.fixture(scope="module")
def model(checkpoint):
    import foldkv.hf  # noqa: F401  (registers "foldkv")
    from foldkv.lab.model import load_model

    return load_model(checkpoint, dtype=torch.float32, attn_implementation="foldkv")


def _recorded(monkeypatch) -> list:
    calls = []

    def record(name, geometry, params=None, backend="jit"):
        calls.append((name, geometry, dict(params or {}), backend))
        return lambda *args: None

    monkeypatch.setattr(resolve, "kernel", record)
    return calls


@pytest.mark.parametrize("fmt,dtype", [("folded", torch.bfloat16), ("split", torch.bfloat16),
                                       ("folded", torch.float8_e4m3fn)])
def test_cache_resolves_its_prefill_kernels_at_creation(model, monkeypatch, fmt, dtype):
    from foldkv.hf import FoldKvCache

    cache = FoldKvCache(model, max_batch=2, max_tokens=96, kv_format=fmt, dtype=dtype, attention="reference")
    pool = cache.global_layers[0].pool
    want = [(n, pool.geometry, p, "jit") for n, p in prefill_launcher.kernel_params(pool).items()]
    assert [w[0] for w in want] == list(prefill_launcher.launch_names(pool))
    calls = _recorded(monkeypatch)
    cache._load_kernels()  # what creation runs for attention="kernel" (on CUDA only)
    assert calls == want
    assert all(c[2]["page_size"] == pool.layout.page_size for c in calls)

    # red twin: the loader before, which only imported the launchers, resolves nothing at creation
    calls.clear()
    monkeypatch.setattr(FoldKvCache, "resolve_prefill_kernels", lambda self, pool: None)
    cache._load_kernels()
    assert calls != want


def test_flashinfer_cache_resolves_no_foldkv_prefill(model, monkeypatch):
    from foldkv.lab.flashinfer_model import FlashInferCache

    cache = FlashInferCache(model, max_batch=1, max_tokens=64, attention="reference")
    calls = _recorded(monkeypatch)
    cache.resolve_prefill_kernels(cache.global_layers[0].pool)
    assert calls == []


def length_dims(func) -> dict[str, list[bool]]:
    """For each buffer argument of a TIR prim_func: which of its dims are dynamic (a variable, not a constant)."""
    from tvm import tirx

    return {str(p.name).removesuffix("_handle"): [not isinstance(d, tirx.IntImm) for d in func.buffer_map[p].shape]
            for p in func.params if p in func.buffer_map}


# the dims of the prefill's arguments a prompt sets: query rows, pages, batch, max pages, tiles
PROMPT_DIMS = {"Q": [True, False, False], "Pool": [True, False, False, False], "PageIds": [True, True],
               "SeqLens": [True], "QStart": [True], "QLens": [True], "TileReq": [True], "TileTok": [True],
               "Out": [True, False, False], "Lse": [True, False]}


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_prefill_program_bakes_no_length(fmt):
    require_tilelang()
    from foldkv.config import GEMMA4_31B
    from foldkv.kernels.prefill_attention import prefill_program
    from foldkv.kernels.prefill_folded import program

    assert length_dims(program(GEMMA4_31B) if fmt == "folded" else prefill_program(GEMMA4_31B, fmt)) == PROMPT_DIMS


def test_a_static_length_is_caught():
    require_tilelang()
    import tilelang.language as T

    @T.prim_func
    def static_rows(Q: T.Tensor((4096, 32, 512), "bfloat16"), QLens: T.Tensor((1,), "int32")):
        with T.Kernel(1, threads=32):
            T.evaluate(0)

    dims = length_dims(static_rows)
    assert dims["Q"] != PROMPT_DIMS["Q"]


# --- the decode step's prefill warmed at the cache's creation -------------------------------------------------------
def _key(kernel, args: tuple, kwargs: dict) -> tuple:
    """A launch as Triton's JIT specialises it: each parameter a pointer of its dtype (16-byte aligned or not), an int
    of its width (== 1, divisible by 16), a float, or a constexpr by value (defaults filled); the launch options."""
    import inspect

    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(params, args))
    bound.update({k: v for k, v in kwargs.items() if k in params})
    spec = []
    for name, p in params.items():
        value = bound.get(name, p.default)
        if "constexpr" in str(p.annotation):
            spec.append((name, "constexpr", value))
        elif isinstance(value, torch.Tensor):
            spec.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        elif isinstance(value, bool):
            spec.append((name, "i1"))
        elif isinstance(value, int):
            spec.append((name, "i32" if -2 ** 31 <= value < 2 ** 31 else "i64", value == 1, value % 16 == 0))
        else:
            spec.append((name, type(value).__name__))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in params))
    return kernel.fn.__name__, tuple(spec), options


_OUTPUTS = ("y_ptr", "h_ptr", "out_ptr", "pool_ptr")  # what the step's glue kernels write


class _Recorded:
    """A Triton kernel whose launches `kernel[grid](...)` are recorded (`_key`) into `log` instead of run; the
    tensors it would write are filled with a finite value, so the forward goes on."""

    def __init__(self, kernel, log: set):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        import inspect

        def launch(*args, **kwargs):
            self.log.add(_key(self.kernel, args, kwargs))
            for name, value in zip(inspect.signature(self.kernel.fn).parameters, args):
                if name in _OUTPUTS and value.is_floating_point():
                    value.fill_(0.25)
        return launch


def _gemm_key(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """A GEMM as cuBLAS picks its kernel, less the rows (the warm-up runs WARM_ROWS, a chunk its own): the weight's
    shape, dtype and layout, the input's dtype."""
    return "F.linear", tuple(weight.shape), str(weight.dtype), weight.is_contiguous(), str(x.dtype)


@pytest.fixture
def traced(monkeypatch):
    """(log, ...): every Triton launch of fused_step's ops and global_step's fold recorded into `log` (a set the
    test empties between runs), with `torch.Tensor.is_cuda` True so the step's forward takes its kernels' path; each
    GEMM (F.linear: a prefill's projections, `pdl` off) recorded too (`_gemm_key`) and run."""
    require_module("triton")
    from types import SimpleNamespace

    from foldkv import fused_step_kernels as k, fused_step_ops, global_step, window_attention

    log: set = set()
    linear = torch.nn.functional.linear

    def recorded_linear(x, weight, bias=None):
        log.add(_gemm_key(x, weight))
        return linear(x, weight, bias)

    monkeypatch.setattr(torch.nn.functional, "linear", recorded_linear)
    tanh = torch.tanh

    def recorded_tanh(x):  # the LM head's softcap (its kernel's module is loaded at its first launch)
        log.add(("torch.tanh", x.dtype))
        return tanh(x)

    monkeypatch.setattr(torch, "tanh", recorded_tanh)

    def recorded_window(query, key, value, *, window, scale):  # FlashAttention's window: recorded, not run on the CPU
        log.add(("window_attention", key.shape[2] > query.shape[2]))  # a first chunk's keys, or a later one's
        return torch.full((query.shape[0], query.shape[2], query.shape[1], query.shape[3]), 0.25, dtype=query.dtype)

    monkeypatch.setattr(window_attention, "window_attention", recorded_window)
    monkeypatch.setattr(fused_step_ops, "_KERNELS", {name: _Recorded(kern, log)
                                                     for name, kern in fused_step_ops._kernels().items()})
    monkeypatch.setattr(global_step, "_kernels", lambda: SimpleNamespace(
        triton=k.triton, global_query_rows=_Recorded(k.global_query_rows, log),
        global_row_store=_Recorded(k.global_row_store, log)))
    refusal = global_step.kernel_refusal
    monkeypatch.setattr(global_step, "kernel_refusal",
                        lambda *a, **kw: None if refusal(*a, **kw) == "not CUDA" else refusal(*a, **kw))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return log


@pytest.fixture(scope="module")
def bf16_step(checkpoint):
    """The synthetic model in bf16 (the kernels' dtype) with its projections merged, and its step's forward."""
    import foldkv.hf  # noqa: F401
    from foldkv.fused_step import StepForward, merge_projections
    from foldkv.lab.model import load_model
    from foldkv.step_options import StepOptions

    model = load_model(checkpoint, dtype=torch.bfloat16, attn_implementation="foldkv")
    assert merge_projections(model) > 0
    return model, StepForward(model, StepOptions())


PREFILL_OPTIONS = dict(pdl=False)  # what DecodeStep.prefill_options changes (checked below)


def _chunk_launches(model, step, log: set, lengths, **options) -> set:
    """The launch keys of real prefill chunks of `lengths` tokens (one prompt, chunk after chunk) through the step's
    forward into a FoldKvCache, under the prefill's options (and `options`)."""
    import dataclasses

    from foldkv.hf import FoldKvCache
    from foldkv.step_options import StepOptions, using

    cache = FoldKvCache(model, max_batch=1, max_tokens=sum(lengths) + 1, attention="reference",
                        decode_step="static")
    g = torch.Generator().manual_seed(5)
    log.clear()
    with using(dataclasses.replace(StepOptions(), **PREFILL_OPTIONS, **options)):
        for n in lengths:
            ids = torch.randint(3, int(model.config.vocab_size), (1, n), generator=g)
            step.prefill(cache, ids, None, None, 1)
    return set(log)


def _warm_launches(step, pool, log: set, rows: int, **options) -> set:
    import dataclasses

    from foldkv.step_options import StepOptions, using

    log.clear()
    with using(dataclasses.replace(StepOptions(), **PREFILL_OPTIONS, **options)):
        assert step.warm_prefill(pool, rows=rows) >= 2  # a sliding and a global body at least
    return set(log)


def test_the_prefill_options_are_the_warm_ups(bf16_step):
    import dataclasses

    from foldkv.hf import FoldKvCache
    from foldkv.step_options import StepOptions

    model, _ = bf16_step
    cache = FoldKvCache(model, max_batch=1, max_tokens=32, attention="reference", decode_step="static")
    assert cache.decode_step.prefill_options() == dataclasses.replace(StepOptions(), **PREFILL_OPTIONS)


def _merged_gemms(model) -> set:
    """The GEMM keys of the model's merged groups' weights (q|k(|v), gate|up as one tensor each)."""
    from foldkv.fused_step import _merged_weight

    return {_gemm_key(w, w) for w, _ in filter(None, map(_merged_weight, model.modules()))}


@pytest.mark.parametrize("merge_prefill,fuse_prefill_norm_rope", [(True, True), (False, True), (True, False)])
def test_the_warm_up_launches_what_a_prefill_chunk_launches(bf16_step, traced, merge_prefill, fuse_prefill_norm_rope):
    model, step = bf16_step
    log = traced
    options = dict(merge_prefill=merge_prefill, fuse_prefill_norm_rope=fuse_prefill_norm_rope)
    chunks = _chunk_launches(model, step, log, (13, 32, 7), **options)  # odd, a multiple of 16, a chunk at an offset
    names = {key[0] for key in chunks}
    assert {"rms_norm_rows", "gelu_mul_rows", "norm_add_rows", "global_query_rows", "global_row_store",
            "F.linear", "torch.tanh"} <= names, names
    # q's and k's norm and RoPE: one pass, or the norm and then rope_rows
    assert {"q_norm_rope_rows", "rope_rows"} & names == {"q_norm_rope_rows" if fuse_prefill_norm_rope else "rope_rows"}
    merged = _merged_gemms(model)
    assert merged and (merged <= chunks) == merge_prefill  # the option in force: merged GEMMs, or one a projection
    from foldkv.hf import FoldKvCache

    pool = FoldKvCache(model, max_batch=1, max_tokens=64, attention="reference",
                       decode_step="static").global_layers[0].pool
    warm = _warm_launches(step, pool, log, rows=24, **options)
    assert not chunks - warm, sorted(chunks - warm)


def test_a_warm_up_that_skips_a_kernel_or_takes_another_specialisation_is_caught(bf16_step, traced, monkeypatch):
    from foldkv import fused_step
    from foldkv.fused_step import StepForward
    from foldkv.hf import FoldKvCache

    model, step = bf16_step
    log = traced
    chunks = _chunk_launches(model, step, log, (13,))
    pool = FoldKvCache(model, max_batch=1, max_tokens=64, attention="reference",
                       decode_step="static").global_layers[0].pool
    with monkeypatch.context() as m:  # red twin 1: the MLP's activation not launched by the warm-up
        m.setattr(fused_step, "gelu_mul", lambda gate, up: torch.nn.functional.gelu(gate, approximate="tanh") * up)
        missing = chunks - _warm_launches(step, pool, log, rows=24)
    assert {key[0] for key in missing} == {"gelu_mul_rows"}
    norm = StepForward._norm
    with monkeypatch.context() as m:  # red twin 2: the head rows' norms read from a packed copy, not in place
        m.setattr(StepForward, "_norm", staticmethod(lambda module, x: norm(module, x.contiguous())))
        missing = chunks - _warm_launches(step, pool, log, rows=24)
    assert {key[0] for key in missing} == {"rms_norm_rows"}
    # red twin 3: a chunk's projections one GEMM each (merge_prefill off), a warm-up of the merged GEMMs: their
    # shapes missed, and the head norms' (a split projection's output is packed: rms_norm_rows' other specialisation)
    split = _chunk_launches(model, step, log, (13,), merge_prefill=False)
    missing = split - _warm_launches(step, pool, log, rows=24, merge_prefill=True)
    assert {key[0] for key in missing} == {"F.linear", "rms_norm_rows"}
    with monkeypatch.context() as m:  # red twin 5: the warm-up's LM head without the model's softcap
        m.setattr(StepForward, "_logits", lambda self, h: self.lm_head(h))
        missing = chunks - _warm_launches(step, pool, log, rows=24)
    assert {key[0] for key in missing} == {"torch.tanh"}
    # red twin 4: a warm-up of the two passes where the chunk normed and rotated q and k in one
    one_pass = _chunk_launches(model, step, log, (13,), fuse_prefill_norm_rope=True)
    missing = one_pass - _warm_launches(step, pool, log, rows=24, fuse_prefill_norm_rope=False)
    assert {key[0] for key in missing} == {"q_norm_rope_rows"}


def test_off_cuda_the_warm_up_launches_nothing(bf16_step, monkeypatch):
    from foldkv import fused_step_ops
    from foldkv.hf import FoldKvCache

    model, step = bf16_step
    monkeypatch.setattr(fused_step_ops, "_KERNELS", {})  # any launch would fail
    cache = FoldKvCache(model, max_batch=1, max_tokens=64, attention="reference", decode_step="static")
    assert step.warm_prefill(cache.global_layers[0].pool) == 0
    assert cache.decode_step.warm_prefill(model) == 0  # reference attention: no fused prefill to warm


def test_the_cache_warms_its_prefill_at_creation(model, monkeypatch):
    from foldkv.hf import FoldKvCache
    from foldkv.hf_graph import DecodeStep

    calls = []
    monkeypatch.setattr(DecodeStep, "warm_prefill", lambda self, m: calls.append((self, m)) or 0)
    cache = FoldKvCache(model, max_batch=1, max_tokens=32, attention="reference", decode_step="static")
    assert calls == [(cache.decode_step, model)]
    calls.clear()
    FoldKvCache(model, max_batch=1, max_tokens=32, attention="reference", decode_step="eager")
    assert calls == []  # no decode step: transformers' own prefill, nothing of the step's to warm


def test_warm_row_counts():
    """A full chunk, a balanced odd one (generate() splits a prompt into near-equal chunks), a short one, 15 for a
    hidden width no multiple of 16; none above the rows a cache can hold, none under 2."""
    from foldkv.fused_step import SHORT_ROWS, warm_row_counts

    assert warm_row_counts(4096, 5376) == (4096, 2049, SHORT_ROWS)
    assert warm_row_counts(24, 100) == (24, 15, 13, SHORT_ROWS)
    assert warm_row_counts(3, 64) == (3, 2)


def test_the_warm_up_runs_the_window_as_a_first_and_a_later_chunk(bf16_step, traced, monkeypatch):
    from foldkv import window_attention
    from foldkv.hf import FoldKvCache

    model, step = bf16_step
    pool = FoldKvCache(model, max_batch=1, max_tokens=64, attention="reference",
                       decode_step="static").global_layers[0].pool
    windows = {key for key in _warm_launches(step, pool, traced, rows=24) if key[0] == "window_attention"}
    assert windows == {("window_attention", False), ("window_attention", True)}, windows
    monkeypatch.setattr(window_attention, "refusal", lambda *a, **kw: "refused")  # red twin: the window skipped
    assert not {key for key in _warm_launches(step, pool, traced, rows=24) if key[0] == "window_attention"}


@pytest.mark.parametrize("itemsize", [4, 8])
def test_uploaded_arrays_start_16_byte_aligned(itemsize):
    """A global layer's pages and offsets (int64) and the prefill's plan (int32) share one uploaded buffer; each
    starts where a tensor of its own would (16-byte aligned), so a Triton kernel given one takes the build the warm-up
    made (a chunk of an odd length once put its offsets at 8 bytes past: another build inside the first prompt)."""
    from foldkv.kernels.prefill import UPLOAD_ALIGN, upload_starts

    def misaligned(starts, sizes):
        return [i for i, at in enumerate(starts[:-1]) if (at * itemsize) % UPLOAD_ALIGN or
                starts[i + 1] < at + sizes[i]]

    sizes = [1, 3, 301, 300, 4097, 2]
    assert not misaligned(upload_starts(sizes, itemsize), sizes)
    packed = [sum(sizes[:i]) for i in range(len(sizes) + 1)]  # red twin: the arrays end to end
    assert misaligned(packed, sizes)


# --- generate()'s own first launches ------------------------------------------------------------------------------
# What generate() runs around the model's forward (position ids, special tokens, the processors, the token's pick, the
# stopping checks), by (op, dtypes), recorded outside every nn.Module call. A CUDA kernel's module is loaded at its
# first launch in a process (~0.1 s of the first prompt on the H100 before the warm-up), so the cache's warm-up
# (`FoldKvCache.warm_generate`, run at its creation on CUDA) must run each of them once.

def _generate_ops(run) -> set:
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            in_module = any(f.name in ("_call_impl", "_wrapped_call_impl") and f.filename.endswith("module.py")
                            for f in traceback.extract_stack())
            if not in_module:
                dtypes = tuple(str(a.dtype) for a in args if isinstance(a, torch.Tensor))
                self.seen.add((func.overloadpacket.__name__, dtypes))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        run()
    return ops.seen


def _first_prompt(model, cache, ids=None):
    from foldkv.lab.model import cache_keyword

    ids = _prompt(model) if ids is None else ids
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, min_new_tokens=1,
                          do_sample=False, **{cache_keyword(model): cache})


def _prompt(model):
    return torch.randint(3, model.config.get_text_config().vocab_size, (1, 13),
                         generator=torch.Generator().manual_seed(7))


def _fresh(model, max_tokens=32):
    from foldkv.hf import FoldKvCache

    return FoldKvCache(model, max_batch=1, max_tokens=max_tokens, attention="reference", decode_step="static")


def test_the_warm_up_runs_generates_own_first_launches(model):
    cache, ids = _fresh(model), _prompt(model)
    first = _generate_ops(lambda: _first_prompt(model, cache, ids))
    cache = _fresh(model)
    warm = _generate_ops(lambda: cache.warm_generate(model))
    assert {"argmax", "masked_fill", "where"} <= {op for op, _ in first}  # pick, position ids, min-length processor
    assert first - warm == set(), f"generate()'s first prompt launches what the warm-up does not: {first - warm}"


def test_a_warm_up_without_generate_is_caught(model):
    """Red twin: a warm-up of the forward alone (the step's, or the model called on the prompt) leaves generate()'s
    own launches to the first prompt."""
    cache, ids = _fresh(model), _prompt(model)
    first = _generate_ops(lambda: _first_prompt(model, cache, ids))
    cache = _fresh(model)
    ids = torch.tensor([cache.WARM_PROMPT])
    forward_only = _generate_ops(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                               **{cache.cache_keyword: cache}))
    missing = {op for op, _ in first - forward_only}
    assert {"argmax", "where"} <= missing


def test_the_warm_up_leaves_the_cache_as_new_and_draws_nothing(model):
    cache, fresh = _fresh(model), _fresh(model)
    rng = torch.get_rng_state()
    assert cache.warm_generate(model) is True
    assert torch.equal(torch.get_rng_state(), rng)
    assert cache.get_seq_length() == 0 and cache.batch is None and not cache.decode_step.started
    assert all(n == 0 for n in cache.decode_step.loop_steps.values())
    for layer in cache.global_layers:
        assert torch.isnan(layer.pool.data).all()  # poisoned again
    assert torch.equal(_first_prompt(model, cache), _first_prompt(model, fresh))


def test_a_sampling_config_warm_up_draws_nothing(model, monkeypatch):
    """Under a generation config that samples (as Gemma's published ones do), the warm-up's token is drawn and the
    random state put back: a caller's seed gives the same draws after the cache's creation as before it."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.top_k, config.top_p, config.temperature = True, 0, 1.0, 1.0
    monkeypatch.setattr(model, "generation_config", config)
    torch.manual_seed(5)
    want = torch.rand(4)
    torch.manual_seed(5)
    cache = _fresh(model)
    draws = []
    own = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: draws.append(1) or own(*a, **k))
    assert cache.warm_generate(model) is True
    assert draws, "the warm-up did not sample: this case tests nothing"
    assert torch.equal(torch.rand(4), want)
    # red twin: a warm-up that keeps the random state it drew from moves the caller's draws
    import contextlib

    monkeypatch.setattr(torch.random, "fork_rng", lambda *a, **k: contextlib.nullcontext())
    torch.manual_seed(5)
    cache.warm_generate(model)
    assert not torch.equal(torch.rand(4), want)


def test_a_beam_config_warm_up_runs_one_sequence(model, monkeypatch):
    """A model whose generation config asks for beams and several sequences: the warm-up runs one sequence (a cache of
    one holds it) instead of refusing the cache's creation."""
    import copy

    config = copy.deepcopy(model.generation_config)
    config.num_beams, config.num_return_sequences = 2, 2
    monkeypatch.setattr(model, "generation_config", config)
    cache = _fresh(model)
    assert cache.max_batch == 1 and cache.warm_generate(model) is True
    assert cache.get_seq_length() == 0
    # red twin: the config's own beams and sequences are four rows, past the cache's one
    ids = torch.tensor([cache.WARM_PROMPT])
    with pytest.raises(Exception, match="max_batch=1"):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                       **{cache.cache_keyword: cache})


def test_no_room_no_warm_up(model):
    cache = _fresh(model, max_tokens=2)  # two prompt tokens and one new one do not fit
    assert cache.warm_generate(model) is False
    assert cache.get_seq_length() == 0


def test_the_cache_warms_generate_at_creation_on_cuda_only(model, monkeypatch):
    from foldkv.hf import FoldKvCache

    calls = []
    monkeypatch.setattr(FoldKvCache, "warm_generate", lambda self, m: calls.append(m) or True)
    _fresh(model)
    assert calls == []  # off CUDA: nothing is loaded lazily, and the CPU tests stay quick
