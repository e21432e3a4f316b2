"""A sliding layer's decode attention over its ring in one launch: the window split over programs, an online softmax in
each, the last program of a (sequence, KV head) combining the splits.

What it tries (MODEL_DECODE_NOTES "Run 25: prediction"; written before any GPU run): `ring.ring_attention` is
cuBLAS q.K^T, `fused_step.masked_softmax`, cuBLAS P.V: three launches a sliding layer, none of which triggers
programmatic dependent launch, so the kernel after each starts at its exit. At 4K x 1 they take ~10.8 us a layer
(4.7 + 1.6 + 4.5, s23's profile) for 16.8 MB of ring (3.7 us at the roof): ~0.35 ms a step over 50 layers, the
largest block of the step's remaining overhead at batch 1. At batch 8 the rings are 134 MB a layer (30.3 us at the
roof) and the step's overhead over its bytes grows by 0.31 ms from batch 1, ~0.2 of it plausibly the rings' reading
(MODEL_DECODE_NOTES "Where 4K x 8's extra overhead may be"). Run 15's three split-window kernels kept ring_attention's
rounding points (an exact softmax needs every chunk's scores before any P) and lost: +0.12 ms at 4K x 1, +0.44 at
4K x 8, three launches with their own ramps and two more boundaries a layer. Run 8's one kernel a KV head lost at
batch 1 (16 programs on 132 SMs, K read in 32-byte row pieces).

Here one launch does it all, flash-decoding's way:
- grid (B x Hkv, S): program (bh, s) takes chunks [s CPS, (s + 1) CPS) of the window's 64-slot chunks (`plan`):
  when the (sequence, KV head) pairs fill the SMs (batch 8 on the 31B: 128 pairs on 132 SMs) S = 1, one program a
  pair streaming the whole window with the next chunk's K and V tiles in flight (`STAGES`); with fewer pairs the
  window is split for about two programs an SM (batch 1: 16 pairs x 16 splits of one chunk);
- per chunk: the GROUP query rows (padded to 16 for `tl.dot`) against K [64, d] (one coalesced 32 KB tile), the
  scores rounded as ring_attention rounds them (to the model dtype, times scaling rounded again),
  the dead slots at -inf, the running max and sum in float32 (online softmax), P = exp(s - max) rounded to the model
  dtype for `tl.dot` with V [64, d] (V's tile loaded beside K's: nothing orders them), one float32 accumulator;
- S = 1: the program divides by its sum and stores the rounded output. S > 1: it stores its accumulator, max and sum
  (float32, [B x Hkv, S, GROUP, d] and [.., 2]), a barrier, one acq_rel atomic add on its pair's counter; the program
  that brings it to S reads the S partials (L2, `.cg`) and combines them: M = max m_s, L = sum e^(m_s - M) l_s,
  o = sum e^(m_s - M) acc_s / L, rounded once; it then sets the counter back to 0 (so a graph's replays need no
  memset). The counters are one int32 tensor a device and size, made zero once (outside any capture: the first call
  is the step's warm-up) and left zero by every call.
Not ring_attention's rounding points: P is unnormalised when it is rounded (the same relative rounding, at most 2^-8
of p_j, which is under ulp(p_j)) and the sums run in other orders. The bound (tests/test_ring_attention_split_gpu.py,
`test_one_launch_against_float64_and_ring_attention`) is the loose one there: the float64 softmax of the exact
scores, each score within its bf16 rounding and float32 slack, P within ulp(p_j), plus the rescales' float32 roundings.

Described: what ring_attention_split.refusal describes (bf16 or fp16, rings [B, Hkv, W, d] contiguous, d a power of
two in [16, 256], GROUP <= 16, W <= 4,096, a RingMask [B, 1, 1, W] bool, CUDA with Triton). Anything else is the
library's ring_attention, the reason counted (`Installed.refusals`).

Prediction (run 25, MODEL_DECODE_NOTES): a layer at 4K x 1 in ~4-6 us against ~10.8 plus two boundaries fewer:
**-0.15 to -0.35 ms a step at batch 1**; at batch 8 ~33-38 us against ~41: **-0.05 to -0.30 ms**.

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_ring_attention_split_gpu.py` (both versions: the float64 bounds, red twins,
   PDL bitwise plain, a rerun bitwise (the counters left zero), the synthetic model's step);
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --ring-one-ab --profile --profile-at 4096:8 --profile-lab --profile-top 30` (label "ring in one launch"; the calls
   it took and its refusals are printed; the library's profile at 4K x 8 and the same with the version installed).

    from versions.ring_attention_one_launch import installed   # bench/ on sys.path
    with installed() as route:                                  # patches the library's ring attention for the block
        ...                                                     # route.calls, route.refusals
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from foldkv import gemv
from versions import ring_attention_split as split  # bench/versions/: its refusal, plan and installation

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the route refuses ("no Triton")
    triton = None

CHUNK = 64  # ring slots a tile: 32 KB of K or V at d = 256
WHOLE_WINDOW_SHARE = 0.875  # (sequence, KV head) pairs >= this share of the SMs: one program a pair, no split
PROGRAMS_PER_SM = 2  # fewer pairs: the window split so that there are about this many programs an SM
WARPS = 4
# K and V tiles in flight a program: at two stages the 31B's kernel takes 75,776 B of shared memory and 168 registers
# a thread (compiled for sm_90a on the CPU: tests/test_ring_attention_split_cpu.py), so three programs fit an SM; one
# stage takes 43,008 B but 212 registers (the tiles pass through registers); three stages, 141,312 B: one an SM
STAGES = 2
_COUNTERS: dict = {}  # (device, pairs) -> int32 [pairs], zero between calls


def plan(batch: int, hq: int, hkv: int, window: int, d: int, sms: int, splits: int | None = None) -> dict:
    """ring_attention_split.plan's geometry at 64-slot chunks, and the split: S programs a (sequence, KV head) of CPS
    chunks each (no split empty). When the pairs fill the SMs (WHOLE_WINDOW_SHARE: batch 8 on the 31B, 128 pairs on
    132 SMs) one program a pair streams the whole window, its next chunk's K and V in flight, and nothing is combined;
    with fewer pairs the window is split for about PROGRAMS_PER_SM programs an SM. `splits` forces S."""
    p = split.plan(batch, hq, hkv, window, d, CHUNK)
    pairs = batch * hkv
    if splits is not None:
        want = int(splits)
    elif pairs >= WHOLE_WINDOW_SHARE * sms:
        want = 1
    else:
        want = -(-PROGRAMS_PER_SM * int(sms) // pairs)
    want = max(1, min(want, p["chunks"]))
    cps = -(-p["chunks"] // want)
    s = -(-p["chunks"] // cps)
    return dict(p, pairs=pairs, splits=s, CPS=cps, S_BLOCK=max(2, 1 << (s - 1).bit_length()), programs=pairs * s)


def split_chunks(p: dict) -> list[range]:
    """The chunks each of p's splits reads: they partition range(p["chunks"])."""
    return [range(s * p["CPS"], min((s + 1) * p["CPS"], p["chunks"])) for s in range(p["splits"])]


def refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> str | None:
    """None when `ring_attend` takes ring.ring_attention's call, else why not (ring_attention_split's checks)."""
    return split.refusal(query, key, value, mask)


def _counters(device: torch.device, pairs: int) -> torch.Tensor:
    key = (str(device), pairs)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(pairs, dtype=torch.int32, device=device)
    return _COUNTERS[key]


if triton is not None:
    from foldkv.fused_step_kernels import _chain, _rounded
    from versions.ring_attention_split import group_query

    @triton.jit
    def ring_one_launch(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, part_ptr, stat_ptr, count_ptr, heads_kv, window, chunks,
                        cps, splits, q_sb, q_sh, q_sd, scaling, skip, GROUP: tl.constexpr, G_PAD: tl.constexpr,
                        D: tl.constexpr, CHUNK: tl.constexpr, S_BLOCK: tl.constexpr, SCALE: tl.constexpr,
                        ONE: tl.constexpr, STAGES: tl.constexpr, RED_NO_MASK: tl.constexpr = False,
                        RED_NO_RESET: tl.constexpr = False, GDC: tl.constexpr = False):
        """The ring attention of KV head bh = program_id(0) = b * heads_kv + kv over chunks [s cps, (s + 1) cps) of
        the window, s = program_id(1) (module docstring): its GROUP query rows (q[b, kv * GROUP + r, 0, :] at strides
        q_sb, q_sh, q_sd) against K/V [B, heads_kv, window, D] (packed), mask [B, window] (uint8, 1: attend); the
        output into o [B * heads_kv * GROUP, D]. ONE (splits == 1): no partials. Else the partials into
        part [B * heads_kv, splits, GROUP, D] and stat [B * heads_kv, splits, GROUP, 2] (max, sum) and the last
        program of bh combines them. Red twins (never for use): skip >= 0 leaves that chunk out; RED_NO_MASK attends
        every slot; RED_NO_RESET leaves the counter where the combine found it."""
        _chain(GDC)
        bh = tl.program_id(0).to(tl.int64)
        sp = tl.program_id(1)
        b = bh // heads_kv
        out_ty = o_ptr.dtype.element_ty
        rows = tl.arange(0, G_PAD)
        row_ok = rows < GROUP
        dd = tl.arange(0, D)
        q = group_query(q_ptr, bh, heads_kv, q_sb, q_sh, q_sd, GROUP, G_PAD, D)
        m_i = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        c_end = tl.minimum(sp * cps + cps, chunks)
        for c in tl.range(sp * cps, c_end, num_stages=STAGES):
            slots = c * CHUNK + tl.arange(0, CHUNK)
            slot_ok = slots < window
            live = tl.load(m_ptr + b * window + slots, mask=slot_ok, other=0) != 0
            if RED_NO_MASK:
                live = slot_ok
            live = live & slot_ok & (c != skip)
            rings = (bh * window + slots)[:, None] * D + dd[None, :]
            k = tl.load(k_ptr + rings, mask=slot_ok[:, None], other=0.0)
            v = tl.load(v_ptr + rings, mask=live[:, None], other=0.0)  # dead slots not read: their P is 0
            s = _rounded(tl.dot(q, tl.trans(k)), out_ty)  # [G_PAD, CHUNK]: float32 over D, rounded
            if SCALE:
                s = _rounded(s * scaling, out_ty)
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no live slot yet: nothing to rescale
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(out_ty), v)
            m_i = m_new
        outs = o_ptr + (bh * GROUP + rows)[:, None] * D + dd[None, :]
        if ONE:
            l_i = tl.where(row_ok, l_i, 1.0)  # the padding rows: nothing to divide
            tl.store(outs, _rounded(acc / l_i[:, None], out_ty).to(out_ty), mask=row_ok[:, None])
        else:
            here = bh * splits + sp
            tl.store(part_ptr + (here * GROUP + rows)[:, None] * D + dd[None, :], acc, mask=row_ok[:, None])
            tl.store(stat_ptr + (here * GROUP + rows) * 2, m_i, mask=row_ok)
            tl.store(stat_ptr + (here * GROUP + rows) * 2 + 1, l_i, mask=row_ok)
            tl.debug_barrier()  # every thread's partial stores before the release below
            arrived = tl.atomic_add(count_ptr + bh, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:  # the last of bh's programs: every partial is visible
                ss = tl.arange(0, S_BLOCK)
                s_ok = ss < splits
                for r in tl.static_range(GROUP):
                    at = (bh * splits + ss) * GROUP + r
                    m_s = tl.load(stat_ptr + at * 2, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                    l_s = tl.load(stat_ptr + at * 2 + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
                    big_m = tl.max(m_s, axis=0)  # finite: every row has a live slot
                    w = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - big_m))
                    a_s = tl.load(part_ptr + at[:, None] * D + dd[None, :], mask=s_ok[:, None], other=0.0,
                                  cache_modifier=".cg")
                    o = tl.sum(a_s * w[:, None], axis=0) / tl.sum(w * l_s, axis=0)
                    tl.store(o_ptr + (bh * GROUP + r) * D + dd, _rounded(o, out_ty).to(out_ty))
                if not RED_NO_RESET:
                    tl.store(count_ptr + bh, 0)


def ring_attend(query: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, mask: torch.Tensor, scaling: float,
                *, splits: int | None = None, pdl: bool | None = None, out: torch.Tensor | None = None,
                scratch: dict | None = None, _red: str | None = None) -> torch.Tensor:
    """ring.ring_attention's output [B, 1, Hq, d] for query [B, Hq, 1, d] (any strides), rings [B, Hkv, W, d]
    packed, mask [B, 1, 1, W] bool (True: attend; every row has one), in one launch (module docstring). The caller
    has checked `refusal`. splits: S (None: `plan`'s from the device's SMs; 132 off CUDA). pdl None:
    `gemv.pdl_kw(query)` (the library's switch); False: a plain launch; True: PDL. out: [B, 1, Hq, d] packed of the
    query's dtype to write (the tests poison it), else a new one. scratch (a dict): gets "plan" and
    "counters". _red (red twins, never for use): "no_mask" (every slot attended), "drop_chunk" (chunk 0 left out),
    "no_reset" (the counters left where the combines found them)."""
    b, hq, _, d = query.shape
    hkv, w = ring_k.shape[1], ring_k.shape[2]
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 132
    p = plan(b, hq, hkv, w, d, sms, splits)
    if pdl is None:
        kw = gemv.pdl_kw(query)
    else:
        kw = dict(GDC=True, launch_pdl=True) if pdl else {}
    m = mask.reshape(b, w).contiguous().view(torch.uint8)  # a view, no copy
    f32 = dict(dtype=torch.float32, device=query.device)
    one = p["splits"] == 1
    part = torch.empty((1,) if one else (p["pairs"], p["splits"], p["GROUP"], d), **f32)
    stat = torch.empty((1,) if one else (p["pairs"], p["splits"], p["GROUP"], 2), **f32)
    counters = _counters(query.device, p["pairs"])
    if out is None:
        out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=query.device)
    elif out.shape != (b, 1, hq, d) or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out {tuple(out.shape)} {out.dtype}: not [{b}, 1, {hq}, {d}] {query.dtype} packed")
    scaling = float(scaling)
    ring_one_launch[(p["pairs"], p["splits"])](
        query, ring_k, ring_v, m, out, part, stat, counters, hkv, w, p["chunks"], p["CPS"], p["splits"],
        query.stride(0), query.stride(1), query.stride(3), scaling, 0 if _red == "drop_chunk" else -1,
        GROUP=p["GROUP"], G_PAD=p["G_PAD"], D=d, CHUNK=p["CHUNK"], S_BLOCK=p["S_BLOCK"], SCALE=scaling != 1.0,
        ONE=one, STAGES=STAGES, RED_NO_MASK=_red == "no_mask", RED_NO_RESET=_red == "no_reset", num_warps=WARPS,
        **kw)
    if scratch is not None:
        scratch.update(plan=p, counters=counters)
    return out


def install(red: str | None = None, splits: int | None = None) -> split.Installed:
    """Patch the library's ring attention until `.uninstall()` (red: `ring_attend`'s red twins; splits: S for every
    call, `plan`'s when None)."""
    return split.Installed(red, name="one-launch", refuse=refusal,
                           attend=lambda q, k, v, m, scaling, red: ring_attend(q, k, v, m, scaling, splits=splits,
                                                                               _red=red))


@contextlib.contextmanager
def installed(red: str | None = None, splits: int | None = None) -> Iterator[split.Installed]:
    """`install` for the block; the library's ring attention is back after it, whatever happens inside."""
    state = install(red, splits)
    try:
        yield state
    finally:
        state.uninstall()


__all__ = ["CHUNK", "plan", "split_chunks", "refusal", "ring_attend", "install", "installed"]
