"""Does programmatic dependent launch hold in the decode step's kernels? The lab's checks of `foldkv.gemv` (the PDL
projections) and of `foldkv.fused_step`'s kernels launched with PDL (`gemv.pdl_kw`), on the GPU.

- `race_check`: a producer (`late_copy`) that lets its dependent launch at once and writes x only `delay_ns` later,
  over x poisoned with NaN, then the consumer under PDL. `ok`: the consumer's output is bitwise its output on the
  clean x (the wait held); `red_caught`: its red twin is wrong (the consumer did launch during its producer: PDL is in
  effect). Eagerly the H200 did not overlap the launches at all (MODEL_DECODE_NOTES run 11: the red twin not caught
  eagerly), so only the graph's red_caught says something; the graph keeps the programmatic edge.
  Consumers: "gemv" (`gemv.linear` at one row; red twin: its first x tile loaded before the wait, made from the
  library kernel's source, `gemv_tc_x_early`; `tc_launch_twin` launches it and the other red twins)
  and "rms_norm" (`fused_step.rms_norm`, standing for every fused_step kernel: they enter through the same `_chain`;
  red twin: the kernel launched with PDL but built without its wait, GDC False); or a lab version's own, as a factory
  `make(k, n, red) -> consume(x)` over x of `rows` rows (bench/versions/gemv_pdl_rows.py's GEMV of 1..8 rows).
- `ptx_order`: the library kernel's (the tensor-core GEMM) global loads before its `griddepcontrol.wait` in the PTX:
  the prefetched weight tile only, BLOCK_N x BLOCK_K x 2 bytes / (16 bytes x threads) loads a thread, and no
  cp.async; more with the red twin (its x loads).
  `loads_before_wait(ptx)`: the scan itself, for a lab version's kernel.

    race_check("gemv", graph=True)        # {"ok": True, "red_caught": True, ...}
    race_check("rms_norm", graph=True)
    ptx_order(), ptx_order(8, red_x_early=True)

`gemv_routes()`: each `foldkv.gemv` call's route inside the block counted ("kernel" or the refusal's reason), what
bench/model_decode_probe.py prints and the tests read (the library keeps no counter).
"""

from __future__ import annotations

import contextlib
import pathlib
import re
from collections import Counter
from typing import Iterator
from unittest import mock

import torch

from ..step_options import in_force

@contextlib.contextmanager
def gemv_routes() -> Iterator[Counter]:
    """Each `foldkv.gemv.linear` / `linear_unsummed` call inside the block counted by its route: "kernel", or the reason
    `gemv.refusal` gave (a host count: a graph's replays call nothing; a captured step counts its warm-up and its
    capture). `gemv.refusal` is wrapped for the block: a direct call inside it counts too."""
    from .. import gemv

    calls: Counter = Counter()
    own = gemv.refusal

    def refusal(x, weight, bias=None):
        why = own(x, weight, bias)
        calls["kernel" if why is None else why] += 1
        return why

    with mock.patch.object(gemv, "refusal", refusal):
        yield calls


CONSUMERS = ("gemv", "rms_norm")
_LD_GLOBAL = re.compile(r"(@!?%p\d+\s+)?ld\.global")  # Triton's loads: inline asm, often predicated
_CP_ASYNC = re.compile(r"(@!?%p\d+\s+)?cp\.async")
_LATE_COPY = None


def _late_copy():
    """The producer kernel (built once): dst = src, written DELAY_NS after each program starts; its dependents may
    launch at once (the trigger first)."""
    global _LATE_COPY
    if _LATE_COPY is None:
        import triton
        import triton.language as tl
        from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

        @triton.jit
        def late_copy(src_ptr, dst_ptr, n, DELAY_NS: tl.constexpr, BLOCK: tl.constexpr):
            gdc_launch_dependents()
            t0 = globaltimer()
            t = t0
            while t - t0 < DELAY_NS:
                t = globaltimer()
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            keep = (offs < n) & (t - t0 >= DELAY_NS)  # the store's mask depends on the clock: it stays after it
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=keep), mask=keep)

        _LATE_COPY = late_copy
    return _LATE_COPY


_X_EARLY = None


def gemv_tc_x_early():
    """The race check's red twin of `foldkv.gemv.gemv_tc` (made once; never for use): the library kernel's own source
    with the line that loads the prefetched x tile moved above the wait, what a kernel reading its input early would
    do. Made from that source (written to a file of its own, which Triton's JIT reads), the twin is the kernel in
    everything else and cannot drift from it; the library kernel carries no twin."""
    global _X_EARLY
    if _X_EARLY is None:
        import importlib.util
        import inspect
        import tempfile
        import textwrap

        from .. import gemv

        lines = textwrap.dedent(inspect.getsource(gemv.gemv_tc.fn)).splitlines()
        wait = next(i for i, ln in enumerate(lines) if ln.strip() == "if GDC:")
        load = next(i for i, ln in enumerate(lines) if i > wait and ln.strip().startswith("x_head = tl.load("))
        lines.insert(wait, lines.pop(load))  # into the prefetch block above the wait, at its indentation
        src = "\n".join(lines).replace("def gemv_tc(", "def gemv_tc_x_early(", 1)
        path = pathlib.Path(tempfile.mkdtemp(prefix="foldkv_twin_")) / "gemv_tc_x_early.py"
        path.write_text("import triton\nimport triton.language as tl\n"
                        "from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait\n\n\n" + src + "\n")
        spec = importlib.util.spec_from_file_location("foldkv_gemv_tc_x_early", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _X_EARLY = module.gemv_tc_x_early
    return _X_EARLY


def tc_launch_twin(xs: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, cfg: dict, pdl: bool = True, *,
                   red_x_early: bool = False, k_split: int | None = None, m: int | None = None,
                   reduce_splits: int | None = None, grid: tuple | None = None):
    """`foldkv.gemv.tc_launch` with its red twins (never for use): red_x_early (x's first tile before the wait: the
    kernel `gemv_tc_x_early`), k_split (the columns a program covers), m (rows of x the kernel is told), reduce_splits
    (partials split_sum adds), grid (those four: the library kernel launched wrong). Returns the GEMM's compiled
    kernel."""
    from .. import gemv

    n, k = weight.shape
    m = xs.shape[0] if m is None else m
    split = cfg["SPLIT"]
    ws = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=y.device)
    kw = dict(launch_pdl=True) if pdl else {}
    grid = (gemv._cdiv(n, cfg["BLOCK_N"]), split) if grid is None else grid
    kernel = gemv_tc_x_early() if red_x_early else gemv.gemv_tc
    compiled = kernel[grid](xs, weight, y, ws, m, n, k, k // split if k_split is None else k_split,
                            EVEN_N=n % cfg["BLOCK_N"] == 0, GDC=pdl, **cfg, **kw)
    if split > 1:
        sum_partials_twin(ws, y, reduce_splits, pdl)
    return compiled


def sum_partials_twin(ws: torch.Tensor, y: torch.Tensor, splits: int | None = None, pdl: bool = True) -> None:
    """`foldkv.gemv.sum_partials` adding `splits` partials (its red twin: one fewer or more than ws holds)."""
    from .. import gemv

    mn = ws.shape[1] * ws.shape[2]
    gemv.split_sum[(gemv._cdiv(mn, gemv.REDUCE_BLOCK),)](
        ws, y, mn, SPLIT=ws.shape[0] if splits is None else splits, BLOCK=gemv.REDUCE_BLOCK, GDC=pdl, num_warps=4,
        **(dict(launch_pdl=True) if pdl else {}))


def _require() -> None:
    from foldkv import gemv

    if not (torch.cuda.is_available() and gemv.HAS_GDC):
        raise RuntimeError("the PDL checks need CUDA and a Triton with triton.language.extra.cuda.gdc_wait")


def _before_wait(ptx: str) -> tuple[int, list[str]]:
    """(the `griddepcontrol.wait` instructions in a kernel's PTX, its lines before the first of them: all without)."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    return len(waits), lines[:waits[0]] if waits else lines


def loads_before_wait(ptx: str) -> tuple[int, list[str]]:
    """(the `griddepcontrol.wait` instructions in a kernel's PTX, its global loads before the first of them)."""
    waits, head = _before_wait(ptx)
    return waits, [ln for ln in head if _LD_GLOBAL.match(ln)] if waits else []


def _linear_x_early(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The race check's red twin of `gemv.linear` (its kernel route, one row): the same launch with the first x tile
    loaded before the wait (`gemv_tc_x_early`), what a kernel reading its input early would do."""
    from foldkv import gemv

    k = w.shape[1]
    xs = x.reshape(-1, k).contiguous()
    y = torch.empty(xs.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    tc_launch_twin(xs, w, y, gemv.tc_config(w.shape[0], k, xs.shape[0]), red_x_early=True)
    return y.view(*x.shape[:-1], w.shape[0])


def _consumer(name, k: int, n: int, red: bool):
    """consume(x) -> output for a consumer (a name of CONSUMERS, or a factory make(k, n, red)); red: its red twin."""
    from foldkv import fused_step as fs
    from foldkv import gemv

    if callable(name):
        return name(k, n, red)
    g = torch.Generator(device="cuda").manual_seed(7)
    if name == "gemv":
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(torch.bfloat16)
        return (lambda x: _linear_x_early(x, w)) if red else (lambda x: gemv.linear(x, w))
    if name == "rms_norm":
        gamma = (1 + 0.1 * torch.randn(256, device="cuda", generator=g)).to(torch.bfloat16)
        if not red:
            return lambda x: fs.rms_norm(x.view(-1, 256), gamma, 1e-6)

        def no_wait(x):  # launched with PDL, built without the wait: what a kernel missing its _chain does
            with mock.patch.object(gemv, "pdl_kw", lambda t: dict(GDC=False, launch_pdl=True)):
                return fs.rms_norm(x.view(-1, 256), gamma, 1e-6)
        return no_wait
    raise ValueError(f"consumer {name!r}: one of {CONSUMERS}")


def race_check(consumer="gemv", k: int = 5376, n: int = 4096, delay_ns: int = 20_000, graph: bool = False,
               rows: int = 1) -> dict:
    """{"ok": the consumer under PDL after the late producer is bitwise itself on the clean x, "red_caught": its red
    twin is not} (module docstring); graph: captured in one CUDA graph and replayed. consumer: a name of CONSUMERS or
    a factory make(k, n, red) -> consume(x); x is [rows, k] (the named consumers take one row)."""
    import triton

    from foldkv import gemv

    _require()
    if not in_force().pdl:
        raise RuntimeError("the step options in force launch without PDL (StepOptions.pdl): nothing would")
    dev = torch.device("cuda")
    src = (torch.randn(rows, k, device=dev, generator=torch.Generator(device=dev).manual_seed(3)) * 0.5).to(
        torch.bfloat16)
    dst = torch.empty_like(src)
    block = 1024
    producer = _late_copy()
    name = consumer if isinstance(consumer, str) else getattr(consumer, "__name__", repr(consumer))
    result = dict(consumer=name, graph=graph, delay_ns=delay_ns)
    for red in (False, True):
        consume = _consumer(consumer, k, n, red)
        ref = _consumer(consumer, k, n, False)(src)

        def once():
            dst.fill_(float("nan"))
            producer[(triton.cdiv(rows * k, block),)](src, dst, rows * k, DELAY_NS=delay_ns, BLOCK=block)
            return consume(dst)

        if graph:
            once()  # compiled and warmed before the capture
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                y = once()
            cg.replay()
        else:
            y = once()
        torch.cuda.synchronize()
        same = bool(torch.equal(y, ref))
        result["red_caught" if red else "ok"] = (not same) if red else same
    return result


def ptx_order(m: int = 1, k: int = 5376, n: int = 4096, red_x_early: bool = False, cfg: dict | None = None) -> dict:
    """The library kernel's (foldkv.gemv.gemv_tc, m rows of x; `cfg`: a lab variant's launch, default
    gemv.tc_config's) global loads before its first `griddepcontrol.wait` in the PTX of one launch on a [n, k] weight:
    the prefetched weight tile only (BLOCK_N x BLOCK_K x 2 bytes / (16 bytes x threads) loads a thread), no cp.async
    (the pipeline's copies, x's among them) before it; more loads with the red twin (its x tile)."""
    from foldkv import gemv

    _require()
    dev = torch.device("cuda")
    cfg = gemv.tc_config(n, k, m) if cfg is None else cfg
    x = torch.ones(m, k, dtype=torch.bfloat16, device=dev)
    w = torch.ones(n, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    launch = tc_launch_twin if red_x_early else gemv.tc_launch
    ptx = launch(x, w, y, cfg, True, **(dict(red_x_early=True) if red_x_early else {})).asm["ptx"]
    waits, head = _before_wait(ptx)
    before = [ln for ln in head if _LD_GLOBAL.match(ln)] if waits else []
    return dict(m=m, red_x_early=red_x_early, waits=waits, loads_before_wait=len(before),
                cp_async_before_wait=sum(bool(_CP_ASYNC.match(ln)) for ln in head),
                weight_loads_expected=cfg["BLOCK_N"] * cfg["BLOCK_K"] * 2 // (32 * cfg["num_warps"] * 16),
                loads=before[:8])


__all__ = ["CONSUMERS", "race_check", "ptx_order", "loads_before_wait", "gemv_tc_x_early", "tc_launch_twin",
           "sum_partials_twin"]
