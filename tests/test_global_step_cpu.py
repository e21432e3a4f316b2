"""foldkv.global_step without a GPU: which calls of `DecodeStep.attend` its two kernels take (`global_route`), the pools
they describe, their column maps, and the probe's --global-ab flag. A call the kernels describe stops only at "not
CUDA" on the CPU; each thing they do not describe (the red twins: fuse_global off, no workspace, a subclass's own
global decode, an FP8 or float32 pool, other dtypes or shapes, the workspace's query, the slot tensors) answers its own
reason. A CPU generate() routes every global layer's step through `global_route` and takes the torch path (the kernels
themselves are tests/test_global_step_gpu.py's).

Reproduce: pytest tests/test_global_step_cpu.py -k route
"""

from __future__ import annotations

import types

import pytest
import torch

from conftest import TINY_SYNTHETIC, bench_script, bench_version, left_padded_batch, require_module

BF16 = torch.bfloat16


def test_the_probe_parses_global_ab():
    probe = bench_script("model_decode_probe")
    args = probe.parser().parse_args(["--decode", "foldkv-folded:4096:1", "foldkv-split:4096:1", "--global-ab"])
    assert args.global_ab and args.decode == ["foldkv-folded:4096:1", "foldkv-split:4096:1"]
    assert not probe.parser().parse_args([]).global_ab


def _pool(fmt="folded", dtype=BF16):
    from foldkv import GEMMA4_31B
    from foldkv.pool import PagedKvLayout, PagedKvPool

    return PagedKvPool(PagedKvLayout(GEMMA4_31B, fmt, page_size=16, num_pages=2, dtype=dtype))


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_the_pools_the_kernels_describe(fmt):
    from foldkv import global_step as gs
    from foldkv.fp8 import FP8_DTYPE

    assert gs.describe_pool(_pool(fmt)) is None
    why = gs.describe_pool(_pool(fmt, torch.float32))
    assert why is not None and "float32" in why
    assert gs.describe_pool(_pool("folded", FP8_DTYPE)) is None  # the row kernels quantize
    twin = gs.describe_pool(_unpacked_scales())
    assert twin is not None and "scales" in twin


def _unpacked_scales():
    """An FP8 pool whose scales are a transposed view: the shape the kernels index, not their strides."""
    from foldkv.fp8 import FP8_DTYPE

    pool = _pool("folded", FP8_DTYPE)
    pool.scales = torch.empty(tuple(reversed(pool.scales.shape))).permute(2, 1, 0)
    assert pool.scales.shape == pool.layout.scale_shape and not pool.scales.is_contiguous()
    return pool


def test_the_column_maps():
    from foldkv import GEMMA4_31B, global_step as gs
    from conftest import folded_row_sources
    from foldkv.layout import score_window_columns

    score, row, fold_from, key_cols = gs.column_maps(GEMMA4_31B, "folded", torch.device("cpu"))
    is_key, head_col = folded_row_sources(GEMMA4_31B)
    assert torch.equal(row.long(), head_col) and key_cols == int(is_key.sum()) == fold_from == 128
    assert torch.equal(score.long(), score_window_columns(GEMMA4_31B, "folded")) and score.dtype == torch.int32
    score, row, fold_from, key_cols = gs.column_maps(GEMMA4_31B, "split", torch.device("cpu"))
    d = GEMMA4_31B.head_dim
    assert torch.equal(score.long(), torch.arange(d)) and torch.equal(row.long(), torch.arange(2 * d) % d)
    assert fold_from == key_cols == d


def _heads(batch, heads, d, extra=3):
    """[B, heads, 1, D] bf16 strided as the model hands it over (a transposed head view of a wider output)."""
    full = torch.randn(batch, 1, (heads + extra) * d).to(BF16)
    return full[..., : heads * d].view(batch, 1, heads, d).transpose(1, 2)


def _described_call(batch=3, fmt="folded", cls=None):
    """(step, layer, module, query, key, value): a call of attend that the kernels describe, on the CPU."""
    from foldkv import GEMMA4_31B
    from foldkv.hf_graph import DecodeStep

    geom = GEMMA4_31B
    hq, hkv, d = geom.num_q_heads, geom.num_kv_heads, geom.head_dim
    step = object.__new__(cls or DecodeStep)
    step.ws = types.SimpleNamespace(query=torch.zeros(batch + 1, hq, d, dtype=BF16))
    step.store_pages = torch.zeros(batch + 1, dtype=torch.long)
    step.store_offsets = torch.zeros(batch + 1, dtype=torch.long)
    layer = types.SimpleNamespace(pool=_pool(fmt), geometry=geom)
    module = types.SimpleNamespace(k_norm=types.SimpleNamespace(weight=torch.ones(d, dtype=BF16)))
    return step, layer, module, _heads(batch, hq, d), _heads(batch, hkv, d), _heads(batch, hkv, d, extra=0)


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_route_of_a_described_call_stops_at_cuda(fmt):
    from foldkv import global_step as gs
    from foldkv.step_options import in_force

    assert in_force().fuse_global
    want = "not CUDA"
    assert gs.global_route(*_described_call(fmt=fmt)) == want
    assert gs.global_route(*_described_call(batch=1, fmt=fmt)) == want


def _other_decode_step():
    from foldkv.hf_graph import DecodeStep

    class OwnDecode(DecodeStep):
        def _global_decode(self, layer, folded):
            raise AssertionError("not called")

    return OwnDecode


def _edit(call, what):
    """The described call with one thing it must not describe (the red twins)."""
    step, layer, module, q, k, v = call
    if what == "no workspace":
        step.ws = None
    elif what == "fp8 scales unpacked":
        layer.pool = _unpacked_scales()
    elif what == "float32 pool":
        layer.pool = _pool("folded", torch.float32)
    elif what == "float16 query":
        q = q.to(torch.float16)
    elif what == "one head short":
        k = k[:, 1:]
    elif what == "workspace too short":
        step.ws.query = step.ws.query[:1]
    elif what == "int32 pages":
        step.store_pages = step.store_pages.int()
    elif what == "k_norm weight too long":
        module.k_norm.weight = torch.ones(q.shape[-1] + 1, dtype=BF16)
    return step, layer, module, q, k, v


TWINS = {"no workspace": "no foldkv DecodeWorkspace", "fp8 scales unpacked": "scales", "float32 pool": "float32 pool",
         "float16 query": "dtypes", "one head short": "shapes", "workspace too short": "query out",
         "int32 pages": "pages", "k_norm weight too long": "k_norm weight"}


@pytest.mark.parametrize("what", sorted(TWINS))
def test_route_of_an_undescribed_call_says_why(what):
    from foldkv import global_step as gs

    why = gs.global_route(*_edit(_described_call(), what))
    assert why is not None and why != "not CUDA" and TWINS[what] in why, why


def test_route_refuses_a_subclass_that_decodes_its_own_way_and_the_option_off():
    from foldkv import global_step as gs
    from foldkv.step_options import StepOptions, using

    why = gs.global_route(*_described_call(cls=_other_decode_step()))
    assert why is not None and "OwnDecode decodes the global layers its own way" in why
    with using(StepOptions(fuse_global=False)):
        assert gs.global_route(*_described_call()) == "StepOptions.fuse_global is off"


LENGTHS = (5, 17, 11)
NEW = 4


def test_every_global_step_of_a_cpu_generate_takes_the_torch_path(tmp_path, monkeypatch):
    """A static decode step on the CPU (reference attention, float32): every global layer's route is asked,
    which answers (no workspace), and the kernels' launchers are never called; the tokens and logits equal those of a
    cache made with `StepOptions(fuse_global=False)`."""
    require_module("transformers")
    require_module("safetensors")
    import foldkv.hf  # noqa: F401
    from foldkv import global_step as gs
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword, load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint
    from foldkv.step_options import StepOptions

    ckpt = make_synthetic_checkpoint(tmp_path, seed=3, sliding_window=8, **TINY_SYNTHETIC)
    model = load_model(ckpt, dtype=torch.float32, attn_implementation="foldkv")
    ids, mask = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    routes = []
    route = gs.global_route
    monkeypatch.setattr(gs, "global_route", lambda *a: routes.append(route(*a)) or routes[-1])
    for name in ("query_into", "row_into_pool"):
        monkeypatch.setattr(gs, name, lambda *a, _n=name: pytest.fail(f"{_n} launched on the CPU"))

    def run(options=None):
        cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, scatter_seed=5, decode_step="static",
                            step_options=options)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             **{cache_keyword(model): cache})
        return out.sequences, torch.stack(out.logits), len(cache.global_layers)

    tokens, logits, layers = run()
    # each global layer of each step asks twice: the step's forward (its prologue), then DecodeStep.attend
    assert len(routes) == 2 * (NEW - 1) * layers and all(r.startswith("no foldkv DecodeWorkspace") for r in routes), \
        routes
    routes.clear()
    off = run(StepOptions(fuse_global=False))
    assert routes and set(routes) == {"StepOptions.fuse_global is off"}
    assert torch.equal(off[0], tokens) and torch.equal(off[1], logits)


def test_the_global_route_of_the_step_forward_takes_only_a_started_step(tmp_path):
    """The step's forward sends a global layer to the prologue kernels only at a started decode step (and with
    fuse_global_prologue off, says that), so a prompt's forward takes the cache's update and the attention
    function."""
    require_module("transformers")
    require_module("safetensors")
    import foldkv.hf  # noqa: F401
    from foldkv import fused_step as fs
    from foldkv.lab.model import load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint
    from foldkv.step_options import StepOptions, using

    ckpt = make_synthetic_checkpoint(tmp_path, seed=3, sliding_window=8, **TINY_SYNTHETIC)
    model = load_model(ckpt, dtype=torch.float32, attn_implementation="foldkv")
    attn = next(layer.self_attn for layer in model.model.layers if not layer.self_attn.is_sliding)
    x = torch.randn(2, 1, model.config.hidden_size)

    class Started:
        started = True

        def global_layer(self, i):
            return None

    assert fs.StepForward.route(attn, x, None, None).startswith("not a decode step")
    assert fs.StepForward.route(attn, x, None, Started()) == "not a foldkv global layer"  # red twin: started
    with using(StepOptions(fuse_global_prologue=False)):
        assert fs.StepForward.route(attn, x, None, Started()) == "StepOptions.fuse_global_prologue is off"


def test_the_branch_leaves_a_cpu_step_alone(tmp_path):
    """bench/versions/step_glue_branch.py on the CPU (a static step, no fused step): the branch's body is DecodeStep's
    own: no step takes the branch and the tokens are the library's."""
    assert not bench_script("model_decode_probe").parser().parse_args([]).glue_ab
    require_module("transformers")
    require_module("safetensors")
    glue = bench_version("step_glue_branch")
    import foldkv.hf  # noqa: F401
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword, load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path, seed=3, sliding_window=8, **TINY_SYNTHETIC)
    model = load_model(ckpt, dtype=torch.float32, attn_implementation="foldkv")
    ids, mask = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])

    def run():
        cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, scatter_seed=5, decode_step="static")
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, **{cache_keyword(model): cache})

    plain = run()
    with glue.installed() as took:
        branched = run()
    assert took["steps"] == 0 and torch.equal(branched, plain)


# --- the one fold and store: its torch definition on the CPU, its destination, what its kernels describe -----------

def _fold_inputs(n=5, fmt="folded", dtype=BF16, seed=0):
    from foldkv import GEMMA4_31B

    geom = GEMMA4_31B
    g = torch.Generator().manual_seed(seed)
    pool = _pool(fmt, dtype)
    pool.data.fill_(float("nan"))
    q = torch.randn(n, geom.num_q_heads, geom.head_dim, generator=g).to(dtype)
    k = torch.randn(n, geom.num_kv_heads, geom.head_dim, generator=g).to(dtype)
    v = torch.randn(n, geom.num_kv_heads, geom.head_dim, generator=g).to(dtype)
    w = (torch.rand(geom.head_dim, generator=g) + 0.5).to(dtype)
    pages = torch.arange(n, dtype=torch.long) % 2
    offsets = torch.arange(n, dtype=torch.long) + 3
    return pool, pages, offsets, q, k, v, w


@pytest.mark.parametrize("fmt", ["folded", "split"])
def test_fold_and_store_is_the_torch_definition_with_its_destination(fmt):
    """global_step.fold_and_store on the CPU is prep.fold_and_store: the rows `rows_from_key_value` at their slots
    (nothing else written), the query `fold_query`, returned, or written into out[:N] (rows past N untouched)."""
    from foldkv import global_step as gs
    from foldkv.prep import fold_query, rows_from_key_value

    pool, pages, offsets, q, k, v, w = _fold_inputs(fmt=fmt)
    geom, n = pool.geometry, q.shape[0]
    assert gs.kernel_refusal(pool, q, k, v, w, pages, offsets, None) == "not CUDA"
    got = gs.fold_and_store(pool, pages, offsets, q, k, v, w)
    assert torch.equal(got, fold_query(geom, fmt, q, w, BF16))
    assert torch.equal(pool.data[pages, :, offsets], rows_from_key_value(geom, fmt, k, v, BF16))
    written = torch.zeros(pool.data.shape[:3], dtype=torch.bool)
    written[pages, :, offsets] = True
    assert bool(torch.isnan(pool.data[~written]).all())
    out = torch.full((n + 2, geom.num_q_heads, geom.head_dim), 7.0, dtype=BF16)
    placed = gs.fold_and_store(pool, pages, offsets, q, k, v, w, out=out)
    assert placed.data_ptr() == out.data_ptr() and torch.equal(out[:n], got) and bool((out[n:] == 7).all())
    # red twin: another weight folds another query (the split query reads no w_k)
    assert torch.equal(gs.fold_and_store(pool, pages, offsets, q, k, v, w * 2), got) == (fmt == "split")


GENERIC_TWINS = {"fp8 scales unpacked": "scales", "float16 query": "dtypes", "one head short": "shapes",
                 "out too short": "query out", "int32 offsets": "offsets", "cuda off": "fuse_global is off"}


@pytest.mark.parametrize("what", sorted(GENERIC_TWINS))
def test_kernel_refusal_of_a_fold_and_store_says_why(what):
    """A prefill's call (N tokens, a new query or a destination): described up to "not CUDA"; each thing the kernels
    do not describe answers its own reason."""
    from foldkv import global_step as gs
    from foldkv.step_options import StepOptions, using

    pool, pages, offsets, q, k, v, w = _fold_inputs()
    out = torch.zeros(q.shape, dtype=BF16)
    assert gs.kernel_refusal(pool, q, k, v, w, pages, offsets, out) == "not CUDA"
    options = StepOptions()
    if what == "fp8 scales unpacked":
        pool = _unpacked_scales()
    elif what == "float16 query":
        q = q.to(torch.float16)
    elif what == "one head short":
        k = k[:, 1:]
    elif what == "out too short":
        out = out[:1]
    elif what == "int32 offsets":
        offsets = offsets.int()
    else:
        options = StepOptions(fuse_global=False)
    with using(options):
        why = gs.kernel_refusal(pool, q, k, v, w, pages, offsets, out)
    assert why is not None and why != "not CUDA" and GENERIC_TWINS[what] in why, why


@pytest.mark.parametrize("check_finite", [False, True])
def test_an_fp8_fold_and_store_takes_the_kernels_unless_its_rows_are_checked(check_finite, monkeypatch):
    """An FP8 pool is the kernels' (they quantize): a described call launches them, but one that asks for the
    finiteness check (a host read the kernels do not make) takes the torch definition, which refuses a NaN row and
    writes nothing. Red twin: the unchecked call, the same NaN row, goes to the kernels."""
    from foldkv import global_step as gs
    from foldkv.fp8 import FP8_DTYPE
    from foldkv.validate import FoldKvInputError

    pool, pages, offsets, q, k, v, w = _fold_inputs()
    pool = _pool("folded", FP8_DTYPE)
    pool.data.view(torch.uint8).fill_(0x7F)  # e4m3's NaN
    pool.scales.fill_(float("inf"))
    k[1, 2, 7] = float("nan")
    launched = []
    monkeypatch.setattr(gs, "kernel_refusal", lambda *a: None)  # described, as on CUDA
    monkeypatch.setattr(gs, "query_into", lambda *a: launched.append("query"))
    monkeypatch.setattr(gs, "row_into_pool", lambda *a: launched.append("row"))
    before = (pool.data.view(torch.uint8).clone(), pool.scales.clone())
    if check_finite:
        with pytest.raises(FoldKvInputError, match="finite"):
            gs.fold_and_store(pool, pages, offsets, q, k, v, w, check_finite=True)
        assert not launched
        assert torch.equal(pool.data.view(torch.uint8), before[0]) and torch.equal(pool.scales, before[1])
    else:
        gs.fold_and_store(pool, pages, offsets, q, k, v, w, check_finite=False)
        assert launched == ["query", "row"]


def test_every_global_layer_of_an_eager_cpu_generate_folds_and_stores_through_the_one_path(tmp_path, monkeypatch):
    """decode_step="eager": the prompt's and every decode step's global layers fold and store through
    global_step.fold_and_store (the torch definition on the CPU, no kernel launched); a cache asked for the per-layer
    graphs that are gone (cuda_graphs=) is refused, saying where the capture went."""
    require_module("transformers")
    require_module("safetensors")
    import foldkv.hf  # noqa: F401
    from foldkv import FoldKvInputError, global_step as gs
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword, load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    ckpt = make_synthetic_checkpoint(tmp_path, seed=3, sliding_window=8, **TINY_SYNTHETIC)
    model = load_model(ckpt, dtype=torch.float32, attn_implementation="foldkv")
    ids, mask = left_padded_batch(LENGTHS, TINY_SYNTHETIC["vocab_size"])
    calls = []
    real = gs.fold_and_store
    monkeypatch.setattr(gs, "fold_and_store", lambda *a, **k: calls.append(a[3].shape[0]) or real(*a, **k))
    for name in ("query_into", "row_into_pool"):
        monkeypatch.setattr(gs, name, lambda *a, _n=name: pytest.fail(f"{_n} launched on the CPU"))
    cache = FoldKvCache(model, max_batch=4, max_tokens=max(LENGTHS) + NEW, scatter_seed=5, decode_step="eager")
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                   **{cache_keyword(model): cache})
    layers = len(cache.global_layers)
    assert calls == [sum(LENGTHS)] * layers + [len(LENGTHS)] * ((NEW - 1) * layers), calls
    with pytest.raises(FoldKvInputError, match="cuda_graphs= is gone: decode_step='graph'"):
        FoldKvCache(model, max_batch=4, max_tokens=32, cuda_graphs=True)
