"""The one-row GEMV of gemv_fma.py, launched with programmatic dependent launch (PDL), its first weight tiles loaded
before it waits for the kernel ahead of it.

What it tries: at 4K x 1 the 31B's step is ~17.9 ms where its byte floor is 14.1 (MODEL_DECODE_NOTES run 9). The 241
projection GEMVs read at 0.89 of the roof: each kernel loses its launch, its ramp (the first loads' latency before the
read is at full rate) and its tail (the last programs draining while SMs sit free); between them ~600 small kernels
(~2-2.5 us each in the graph) read no weights at all. A kernel launched with the programmatic-stream-serialization
attribute may start before the kernel ahead of it in the stream has finished; it must execute `griddepcontrol.wait`
before it reads what that kernel wrote. The weights are written by nobody during a step, so a GEMV's programs can issue
their first weight loads (to registers) before the wait: the next projection's bytes start streaming during the
previous kernel's tail and the small kernels between, and its programs are resident when the wait returns (no launch,
no ramp).
The kernel (`gemv_pdl_rows`; it served the step's one-row projections in foldkv.gemv until the tensor-core kernel
took one row too, MODEL_DECODE_NOTES run 16): gemv_fma's register loop
(ROWS whole rows a program, float32 partial products, `config` reused from gemv_fma), with HEAD = PREFETCH x BLOCK_K
columns loaded first; then `gdc_wait()`; then `gdc_launch_dependents()` (the kernel after this one may launch once
every program here has passed its wait: at most one kernel runs ahead); then the head's x load, the loop over the
remaining columns as gemv_fma's, the head's partial sum last (float32 throughout, rounded once; the head summed apart:
not bitwise gemv_fma's).
PREFETCH = 0 is gemv_fma's loop with the wait at the top (PDL's launch overlap without the prefetch). `head_norm_rows`
is the dependent small kernel of the probe's arms: the library's rms_norm_rows body (`_normed`, `_rounded` from
foldkv.fused_step_kernels) over one 256-wide head row a program, one warp, as fused_step launches q_norm/k_norm; with
GDC it triggers its dependents at its top (the next GEMV may launch and prefetch while the norm still waits) and waits
before its first load.
Prediction (bench/MODEL_DECODE_NOTES.md run 11, written before any run): the 411 projections with a dependent norm
between each (`fma_r4_norm`) ~17.4 ms; under PDL with one prefetched tile (`fma_r4_norm_pdl`) ~16.1 ms (15.8-16.6),
with no prefetch (`_nopf`) ~16.7; without norms `fma_r4_pdl` ~15.4 against `fma_r4`'s 16.54 (s21): ~3 us saved a GEMV
+ norm boundary, ~1 ms for the 31B's 4K x 1 step if the whole chain took PDL. Not measured yet.

PDL chain-wide: in the library since run 12 (`foldkv.gemv`: this kernel at ROWS=2, PREFETCH=1 for the step's
one-row projections until run 16, the tensor-core kernel since; fused_step's kernels entering through
`fused_step_kernels._chain`; the lab's checks in `foldkv.lab.pdl_checks`). Rules, from the CUDA programming guide
(4.5, Programmatic Dependent Launch) and the PTX ISA (griddepcontrol):
- every kernel launched with PDL must execute `gdc_wait()` before it reads anything a kernel of this step wrote, and
  before any store into a buffer a kernel ahead may still read or write; before the wait it may read only what no
  kernel of the step writes (weights, norm weights). The wait covers the prerequisite grid (the kernel ahead); that
  kernel's own predecessors are covered only because it waited for them in turn: a PDL-launched kernel that never
  waits could complete before its predecessor and break the ordering of every kernel after it. So every kernel of a
  PDL chain waits (unconditionally: the instruction is a no-op in a launch without the attribute).
- `gdc_launch_dependents()` carries no memory ordering; it only lets the dependent launch early, once every block of
  this kernel has executed it or exited. A kernel that never executes it triggers implicitly when all its blocks have
  exited (CUDA programming guide 4.5.2): its PDL dependent then starts only after the whole kernel has run, so it
  overlaps the launch and the primary's memory flush, never the primary's tail (hence its wait all the same). cuBLAS's
  GEMVs and torch's kernels never trigger: for the GEMVs' tails the chain's GEMVs must be a kernel like this one.
- stream capture records a PDL launch after a kernel as a programmatic edge (cudaGraphDependencyTypeProgrammatic,
  CUDA 12.3+ edge data). What capture records after a non-kernel node (a branch join's event wait, a memcpy) is not
  checked here: assume an ordinary edge (no overlap) until a graph dump says otherwise.
foldkv.fused_step_kernels, kernel by kernel (each reads only its arguments):
- `rms_norm_rows`: only its weight row may load before the wait (HAS_WEIGHT); x after it.
- `norm_add_rows`: weights w1/w2 and `scalar_ptr` (the layer scalar, a parameter) may load before; x and the residual
  after (the residual was written by an earlier tail: complete only through the chain of waits above).
- `rope_rows`: everything after the wait (cos/sin are this step's, written by the rotary embedding's kernels).
- `gelu_mul_rows`, `masked_softmax_rows`: everything after the wait (the softmax's mask is this step's too).
- `q_norm_rope_rows`: the q_norm weight may load before; x, cos, sin after.
- `kv_norm_rope_ring`: the k_norm weight may load before; `slot_ptr` (this step's slot, written by its advance), k,
  v, cos, sin after, and the ring stores after the wait too.
Each: `gdc_launch_dependents()` at its top, before its wait (one program or a few, each short: the dependents may
launch and stage their weights while these wait); `launch_pdl=True` (and GDC on) at the launch sites in
foldkv.fused_step. Whether the trigger is better after the wait (at most one kernel running ahead) is a knob to
measure, not settled here; this file's GEMV triggers after its wait, its norm before. No deadlock either way: a
kernel's dependents launch only once every program of it has triggered, i.e. is resident, so programs waiting early
never hold SM slots that the kernel they wait for still needs.

What must hold before any timing means something (bench/gemv_probe.py records each under "pdl_checks"):
- the import: `from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents` (HAS_GDC) and the launch
  keyword `launch_pdl` (the tutorial's spelling; a compile option, so PDL and plain launches are separate binaries);
- `ptx_order`: in the PTX no x load before `griddepcontrol.wait`; weight loads before it only with PREFETCH > 0 (the
  red twin shows what an x load there looks like). The wait is Triton's non-pure inline asm: LLVM keeps loads on
  their side of it, ptxas is trusted; triton-lang/triton issue 11905 (Triton 3.7.1) is a pipelined load hoisted above
  a wait *inside* a loop: here the wait is before the loop;
- `race_check`, eager and in a graph: ok True (the wait holds) and red_caught True (the dependent did launch during
  its producer: PDL is in effect). red_caught False in the graph means capture lost the programmatic edge and the
  arms measure plain launches.

    gemv(x, weight, rows_per_program=4, prefetch=1, pdl=True)     # x [..., K] of one row @ weight [N, K]^T
    config(n, k), installed()                                     # the served configuration; it, in foldkv.gemv
    head_norm(y, k, gamma, eps, pdl=True)                         # [1, k] from the head rows of y (see below)
    race_check(k, n), ptx_order(prefetch)                         # does the wait hold? does PDL overlap at all?
"""

from __future__ import annotations

import collections
import contextlib
from unittest import mock

import torch
import triton
import triton.language as tl

from foldkv import gemv as _library
from foldkv.fused_step_kernels import _normed, _rounded
from foldkv.lab import pdl_checks
from versions import gemv_fma

HAS_GDC = _library.HAS_GDC  # Triton's grid dependency control; without it the module imports, gemv()/head_norm() refuse
# The configuration that served the step's one-row projections (in foldkv.gemv until the tensor-core kernel,
# bench/versions/gemv_pdl_tc.py, took one row too: 0.20 ms less a step at 4K x 1); the arms run other values.
ROWS = 2  # weight rows a program: under PDL two rows' shorter tail beat four (15.46 against 15.83 ms, the 411 GEMVs)
PREFETCH = 1  # weight tiles loaded before the wait: one beat none (the ramp) and two (registers cut residency)

if HAS_GDC:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def gemv_pdl_rows(x_ptr, w_ptr, y_ptr, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HEAD: tl.constexpr,
                      GDC: tl.constexpr, RED_X_EARLY: tl.constexpr = False):
        """y [N] = w [N, K] @ x [K] for this program's ROWS rows (N % ROWS == 0; HEAD and K - HEAD multiples of
        BLOCK_K). The first HEAD weight columns are loaded before the wait (GDC), consumed after it. RED_X_EARLY (a red
        twin for the lab's race check, never for use): the head's x loaded before the wait too."""
        rn = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        w_rows = w_ptr + rn[:, None] * K
        if HEAD > 0:
            rh = tl.arange(0, HEAD)
            w_head = tl.load(w_rows + rh[None, :], eviction_policy="evict_first")
            if RED_X_EARLY:
                x_head = tl.load(x_ptr + rh)
        if GDC:
            gdc_wait()
            gdc_launch_dependents()
        if HEAD > 0:
            if not RED_X_EARLY:
                x_head = tl.load(x_ptr + rh)  # issued before the loop, summed after it
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        for k0 in range(HEAD, K, BLOCK_K):
            w = tl.load(w_rows + k0 + rk[None, :], eviction_policy="evict_first").to(tl.float32)
            x = tl.load(x_ptr + k0 + rk).to(tl.float32)
            acc += w * x[None, :]
        y = tl.sum(acc, axis=1)
        if HEAD > 0:
            y += tl.sum(w_head.to(tl.float32) * x_head.to(tl.float32)[None, :], axis=1)
        tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty))
try:
    from triton.language.extra.cuda import globaltimer
except ImportError:
    globaltimer = None

HEAD_D = 256  # the dependent norm's row: a sliding head (fused_step's q_norm/k_norm rows at D = 256)


@triton.jit
def head_norm_rows(y_ptr, n_y, g_ptr, x_ptr, eps, D: tl.constexpr, GDC: tl.constexpr):
    """x[h*D : (h+1)*D] = rms_norm(y[(h*D) % n_y :][:D]) * g, one program a head row h (rms_norm_rows' formula): the
    next projection's input from the previous one's output (n_y % D == 0; wrapping when the input is the longer)."""
    h = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, D)
    keep = cols < D
    if GDC:
        gdc_launch_dependents()
        gdc_wait()
    v = tl.load(y_ptr + (h * D) % n_y + cols).to(tl.float32)
    out = _normed(v, g_ptr, cols, keep, D, eps, True)
    tl.store(x_ptr + h * D + cols, _rounded(out, x_ptr.dtype.element_ty).to(x_ptr.dtype.element_ty))


def _require_gdc() -> None:
    if not HAS_GDC:
        raise RuntimeError(f"Triton {triton.__version__} has no triton.language.extra.cuda.gdc_wait (needs the PDL "
                           "support of triton-lang/triton PR 6394)")


def _launch_kw(pdl: bool) -> dict:
    return dict(launch_pdl=True) if pdl else {}  # only passed when set: a Triton without PDL never sees the option


def gemv(x: torch.Tensor, weight: torch.Tensor, rows_per_program: int = 4, prefetch: int = 1, pdl: bool = True,
         out: torch.Tensor | None = None, _red_x_early: bool = False) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T for one row of x on CUDA in bf16/fp16, gemv_fma's kernel with `prefetch` weight
    tiles (BLOCK_K columns each) loaded before the PDL wait; pdl: launched with launch_pdl and waiting (GDC), else
    neither (the same code without the instructions). Shapes gemv_fma does not run: F.linear (a launch without PDL:
    correct, it only breaks the overlap). `out` ([1, N], contiguous): written in place."""
    _require_gdc()
    n, k = weight.shape
    cfg = gemv_fma.config(n, k, rows_per_program)
    if (cfg is None or x.numel() != k or not x.is_cuda or x.dtype != weight.dtype
            or x.dtype not in (torch.bfloat16, torch.float16) or not weight.is_contiguous()):
        return torch.nn.functional.linear(x, weight)
    head = prefetch * cfg["BLOCK_K"]
    if prefetch < 0 or head > k:
        raise ValueError(f"prefetch {prefetch} tiles of {cfg['BLOCK_K']} columns: past K = {k}")
    row = x.reshape(k).contiguous()
    y = torch.empty(1, n, dtype=x.dtype, device=x.device) if out is None else out
    gemv_pdl_rows[(n // cfg["ROWS"],)](row, weight, y, k, HEAD=head, GDC=pdl, RED_X_EARLY=_red_x_early, **cfg,
                                       **_launch_kw(pdl))
    return y.view(*x.shape[:-1], n)


def config(n: int, k: int, rows: int = ROWS, prefetch: int = PREFETCH) -> dict | None:
    """The served configuration's launch for a weight [n, k] (gemv_fma.config's ROWS, BLOCK_K and warps, and HEAD =
    prefetch x BLOCK_K); None without a tile or with the head past k."""
    cfg = gemv_fma.config(n, k, rows)
    if cfg is None or prefetch * cfg["BLOCK_K"] > k:
        return None
    return dict(cfg, HEAD=prefetch * cfg["BLOCK_K"])


@contextlib.contextmanager
def installed():
    """foldkv.gemv.linear with its one-row calls (those the library's kernel would take) on this kernel at ROWS and
    PREFETCH under PDL, as the library served them before the tensor-core kernel: bench/model_decode_probe.py --tc-ab.
    Yields the count of calls it took."""
    _require_gdc()
    served = _library.linear
    took = collections.Counter()

    def linear(x, weight, bias=None, **kw):
        if x.numel() == weight.shape[-1] and _library.refusal(x, weight, bias) is None and config(*weight.shape):
            took["one-row GEMV"] += 1
            return gemv(x, weight, ROWS, PREFETCH, pdl=True, out=kw.get("out"))
        return served(x, weight, bias, **kw)

    with mock.patch.object(_library, "linear", linear):
        yield took


def head_norm(y: torch.Tensor, k: int, gamma: torch.Tensor, eps: float = 1e-6, pdl: bool = True) -> torch.Tensor:
    """[1, k]: k / HEAD_D head rows, row h the RMSNorm (weight gamma [HEAD_D]) of y's elements (h*D) % n .. + D."""
    _require_gdc()
    n = y.numel()
    if n % HEAD_D or k % HEAD_D or gamma.numel() != HEAD_D:
        raise ValueError(f"head_norm: y of {n} and k = {k} must be multiples of {HEAD_D}, gamma of {HEAD_D}")
    x = torch.empty(1, k, dtype=y.dtype, device=y.device)
    head_norm_rows[(k // HEAD_D,)](y, n, gamma, x, float(eps), D=HEAD_D, GDC=pdl, num_warps=1, **_launch_kw(pdl))
    return x


# --- does the wait hold, and does PDL overlap at all? ----------------------------------------------------------------
def race_check(k: int = 5376, n: int = 4096, prefetch: int = 1, rows_per_program: int = 4,
               delay_ns: int = 20_000, graph: bool = False) -> dict:
    """A producer that lets its dependent launch at once and writes x only `delay_ns` later, over x poisoned with NaN,
    then this GEMV under PDL: `ok` when y is bitwise the same kernel's without PDL on the clean x (the wait held);
    `red_caught` when the red twin (one prefetched tile whatever `prefetch`, the head's x loaded before the wait) is
    wrong: PDL did launch the GEMV early. red_caught False means the dependent did not overlap its producer here (PDL
    not in effect: the arms measure nothing of it). graph: the same, captured in one CUDA graph and replayed."""
    _require_gdc()
    if globaltimer is None:
        raise RuntimeError("no triton.language.extra.cuda.globaltimer")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    src = (torch.randn(1, k, device=dev, generator=g) * 0.5).to(torch.bfloat16)
    w = (torch.randn(n, k, device=dev, generator=g) * k ** -0.5).to(torch.bfloat16)
    dst = torch.empty_like(src)
    block = 1024

    def once(pf: int, red: bool) -> torch.Tensor:
        dst.fill_(float("nan"))
        pdl_checks._late_copy()[(triton.cdiv(k, block),)](src, dst, k, DELAY_NS=delay_ns, BLOCK=block)
        return gemv(dst, w, rows_per_program, pf, pdl=True, _red_x_early=red)

    result = dict(prefetch=prefetch, rows=rows_per_program, graph=graph)
    for red in (False, True):
        pf = max(prefetch, 1) if red else prefetch  # the red twin's early x is the head's: it needs a head
        ref = gemv(src, w, rows_per_program, pf, pdl=False)
        if graph:
            once(pf, red)
            torch.cuda.synchronize()
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg):
                y = once(pf, red)
            cg.replay()
        else:
            y = once(pf, red)
        torch.cuda.synchronize()
        same = bool(torch.equal(y, ref))
        if red:
            result["red_caught"] = not same
        else:
            result["ok"] = same
    return result


def ptx_order(prefetch: int = 1, rows_per_program: int = 4, k: int = 5376, n: int = 4096,
              red_x_early: bool = False) -> dict:
    """The PDL build's global loads before its first `griddepcontrol.wait` in the PTX (one launch on a [n, k] weight):
    none with prefetch 0; weight loads only (gemv_fma's 16-byte loads: ROWS x HEAD x 2 / (32 x warps x 16) of them a
    thread) with prefetch > 0; more with the red twin (its x loads)."""
    _require_gdc()
    dev = torch.device("cuda")
    x = torch.ones(k, dtype=torch.bfloat16, device=dev)
    w = torch.ones(n, k, dtype=torch.bfloat16, device=dev)
    y = torch.empty(1, n, dtype=torch.bfloat16, device=dev)
    cfg = gemv_fma.config(n, k, rows_per_program)
    head = prefetch * cfg["BLOCK_K"]
    compiled = gemv_pdl_rows[(n // cfg["ROWS"],)](x, w, y, k, HEAD=head, GDC=True, RED_X_EARLY=red_x_early, **cfg,
                                                  launch_pdl=True)
    waits, before = pdl_checks.loads_before_wait(compiled.asm["ptx"])
    return dict(prefetch=prefetch, red_x_early=red_x_early, waits=waits, loads_before_wait=len(before),
                weight_loads_expected=rows_per_program * head * 2 // (32 * cfg["num_warps"] * 16),
                loads=before[:8])
