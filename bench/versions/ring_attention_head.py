"""A sliding layer's decode attention over its ring at batch, one Triton program a (sequence, KV head).

What it tries (MODEL_DECODE_NOTES "Run 25: prediction"; written before any GPU run): at 4K x 8 the step's overhead
over its bytes is 0.31 ms larger than at 4K x 1, and 6.7 of the 7.34 GB that batch 8 adds are the sliding rings
(50 layers x 8 sequences x 16 KV heads x 1,024 slots x 256 x K and V, bf16: 134 MB a layer, 30.3 us at 4.43 TB/s),
which `hf_graph.ring_attention` reads with two cuBLAS batched matmuls around `fused_step.masked_softmax`: three
launches a layer, none of which triggers programmatic dependent launch. At batch 8 the rings are B x Hkv = 128
(sequence, KV head) pairs of 1 MB: one wave of programs on the H200's 132 SMs, each streaming its own head. So one
program a pair needs no split of the window and no cross-program sum (run 15's three split-window kernels lost by
+0.44 ms at 4K x 8 on their extra launches; run 8's one kernel a head lost at batch 1, with 16 programs on 132 SMs
and K read in 32-byte row pieces). The route takes a call only when the pairs fill the SMs (`MIN_SM_SHARE`); at
batch 1 (16 pairs) the library's cuBLAS keeps it.

One program, three phases, ring_attention's rounding points kept exactly (run 15's kernels' formulas, in one program):
1. the scores: the GROUP query rows (heads kv * GROUP + r: transformers' repeat_kv order, ring_attention's reshape)
   padded to G_PAD = 16 rows for `tl.dot` against each 64-slot chunk's K [64, d] tile (one coalesced 32 KB load:
   rows of 512 contiguous bytes at d = 256, pipelined `STAGES` deep), accumulated in float32, rounded to the model
   dtype, times scaling rounded again, stored to a scratch [B x Hkv, GROUP, W] of the model dtype (4 KB a program:
   L2). A barrier (bar.sync orders the CTA's global stores before its loads) ends the phase.
2. the softmax's statistics: each score row's max and sum of exp over its live slots, as `masked_softmax_rows`
   computes them (the whole row as one 1-D block, one row at a time: the same formula, the same reduction).
3. P.V: per chunk P = round(exp(s - max) / sum) (bitwise what the whole row gives), P (padded) . V [64, d] by
   `tl.dot` into one float32 [G_PAD, d] accumulator carried across the chunks in order, rounded once at the end. V's
   dead slots are not read (their P is 0).
K and V are read once; the scores twice from L2 (4 KB). Not bitwise ring_attention (the float32 orders of the score's
sum over d, the softmax's sum and P.V's sum over W): within the bounds tests/test_ring_attention_split_gpu.py
derives, the same as run 15's kernels.

Described: what ring_attention_split.refusal describes (bf16 or fp16, rings [B, Hkv, W, d] contiguous, d a power of
two in [16, 256], GROUP <= 16, W <= 4,096, a RingMask [B, 1, 1, W] bool, CUDA with Triton), and B x Hkv >= MIN_SM_SHARE
of the device's SMs. Anything else is the library's ring_attention, the reason counted (`Installed.refusals`).

Prediction (run 25): a layer at batch 8 in ~34-38 us (its 134 MB at ~85-92% of the roof from one program an SM,
plus the phase barrier and a ramp) against the library's ~41 (arithmetic on notebook 05's record: the 0.31 ms a
step that batch 8 adds over its bytes, less ~0.1 for the projections, spread over 50 layers, plus batch 1's measured
10.8 us for 3.7 us of bytes); with its one PDL launch in place of three plain ones: **-0.05 to -0.30 ms a step at
batch 8** (central -0.15), at every context (the ring is the window), nothing at batch 1 (refused).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_ring_attention_split_gpu.py` (both versions: the float64 bounds, red twins,
   PDL bitwise plain, the synthetic model's step);
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:8 foldkv-folded:131072:8 foldkv-folded:4096:1
   --ring-head-ab` (label "ring per head"; the calls it took and its refusals are printed: 4K x 1 must be refused).

    from versions.ring_attention_head import installed   # bench/ on sys.path
    with installed() as route:                            # patches the library's ring attention for the block
        ...                                               # route.calls, route.refusals
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
MIN_SM_SHARE = 0.875  # B x Hkv programs at least this share of the SMs (batch 8 on the 31B: 128 of 132)
WARPS = 4
STAGES = 3  # K or V tiles in flight a program (3 x 32 KB of shared memory at d = 256)


def programs_refusal(batch: int, hkv: int, sms: int, min_programs: int | None = None) -> str | None:
    """None when B x Hkv programs fill the SMs (`MIN_SM_SHARE` of `sms`, or `min_programs` when given), else why
    not: fewer programs leave SMs idle, each streaming a whole head (run 8's loss at batch 1)."""
    need = -(-int(MIN_SM_SHARE * sms * 1000) // 1000) if min_programs is None else int(min_programs)
    if batch * hkv < need:
        return f"{batch} x {hkv} = {batch * hkv} programs, under the {need} that fill the SMs"
    return None


def refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask,
            min_programs: int | None = None) -> str | None:
    """None when `ring_attend` takes hf_graph.ring_attention's call, else why not (ring_attention_split's checks,
    then the programs against the SMs)."""
    why = split.refusal(query, key, value, mask)
    if why is not None:
        return why
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count
    return programs_refusal(query.shape[0], key.shape[1], sms, min_programs)


if triton is not None:
    from foldkv.fused_step_kernels import _chain, _rounded

    @triton.jit
    def ring_head(q_ptr, k_ptr, v_ptr, m_ptr, s_ptr, o_ptr, heads_kv, window, chunks, q_sb, q_sh, q_sd, scaling,
                  skip, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                  W_BLOCK: tl.constexpr, SCALE: tl.constexpr, STAGES: tl.constexpr, RED_NO_MASK: tl.constexpr = False,
                  GDC: tl.constexpr = False):
        """The ring attention of KV head bh = program_id(0) = b * heads_kv + kv (module docstring): its GROUP query
        rows (q[b, kv * GROUP + r, 0, :] at strides q_sb, q_sh, q_sd) against K/V [B, heads_kv, window, D] (packed),
        mask [B, window] (uint8, 1: attend); scores into s [B * heads_kv, GROUP, window] (model dtype), the output
        into o [B * heads_kv * GROUP, D]. Red twins (never for use): skip >= 0 leaves that chunk out of P.V;
        RED_NO_MASK attends every slot."""
        _chain(GDC)
        bh = tl.program_id(0).to(tl.int64)
        b = bh // heads_kv
        kv = bh % heads_kv
        out_ty = o_ptr.dtype.element_ty
        rows = tl.arange(0, G_PAD)
        row_ok = rows < GROUP
        dd = tl.arange(0, D)
        q = tl.load(q_ptr + b * q_sb + (kv * GROUP + rows)[:, None].to(tl.int64) * q_sh + dd[None, :] * q_sd,
                    mask=row_ok[:, None], other=0.0)
        s_rows = s_ptr + (bh * GROUP + rows)[:, None] * window
        # 1. the scores, a chunk at a time, into the scratch
        for c in tl.range(0, chunks, num_stages=STAGES):
            slots = c * CHUNK + tl.arange(0, CHUNK)
            slot_ok = slots < window
            k = tl.load(k_ptr + (bh * window + slots)[:, None] * D + dd[None, :], mask=slot_ok[:, None], other=0.0)
            s = _rounded(tl.dot(q, tl.trans(k)), out_ty)  # [G_PAD, CHUNK]: float32 over D, rounded
            if SCALE:
                s = _rounded(s * scaling, out_ty)
            tl.store(s_rows + slots[None, :], s.to(out_ty), mask=row_ok[:, None] & slot_ok[None, :])
        tl.debug_barrier()  # the CTA's score stores before its loads of them
        # 2. each row's max and sum of exp over its live slots (masked_softmax_rows' formula)
        cols = tl.arange(0, W_BLOCK)
        keep = cols < window
        live = tl.load(m_ptr + b * window + cols, mask=keep, other=0) != 0
        if RED_NO_MASK:
            live = keep
        big_m = tl.zeros([G_PAD], dtype=tl.float32)
        big_l = tl.full([G_PAD], 1.0, dtype=tl.float32)
        for r in tl.static_range(GROUP):
            x = tl.load(s_ptr + (bh * GROUP + r) * window + cols, mask=keep, other=0.0).to(tl.float32)
            x = tl.where(live & keep, x, float("-inf"))
            mx = tl.max(x, axis=0)
            big_m = tl.where(rows == r, mx, big_m)
            big_l = tl.where(rows == r, tl.sum(tl.exp(x - mx), axis=0), big_l)
        # 3. P.V, a chunk at a time, into one float32 accumulator
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        for c in tl.range(0, chunks, num_stages=STAGES):
            slots = c * CHUNK + tl.arange(0, CHUNK)
            slot_ok = slots < window
            live_c = tl.load(m_ptr + b * window + slots, mask=slot_ok, other=0) != 0
            if RED_NO_MASK:
                live_c = slot_ok
            sc = tl.load(s_rows + slots[None, :], mask=row_ok[:, None] & slot_ok[None, :], other=0.0).to(tl.float32)
            sc = tl.where((live_c & slot_ok)[None, :], sc, float("-inf"))
            p = _rounded(tl.exp(sc - big_m[:, None]) / big_l[:, None], out_ty)
            p = tl.where(row_ok[:, None] & (c != skip), p, 0.0).to(out_ty)
            v = tl.load(v_ptr + (bh * window + slots)[:, None] * D + dd[None, :], mask=(live_c & slot_ok)[:, None],
                        other=0.0)
            acc = tl.dot(p, v, acc)  # [G_PAD, D] float32
        tl.store(o_ptr + (bh * GROUP + rows)[:, None] * D + dd[None, :], _rounded(acc, out_ty).to(out_ty),
                 mask=row_ok[:, None])


def ring_attend(query: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, mask: torch.Tensor, scaling: float,
                *, pdl: bool | None = None, scratch: dict | None = None, _red: str | None = None) -> torch.Tensor:
    """hf_graph.ring_attention's output [B, 1, Hq, d] for query [B, Hq, 1, d] (any strides), rings [B, Hkv, W, d]
    packed, mask [B, 1, 1, W] bool (True: attend; every row has one), by the one kernel (module docstring). The
    caller has checked `refusal` (less the programs' share: any batch computes the same values). pdl None:
    `gemv.pdl_kw(query)` (the library's switch); False: a plain launch; True: PDL. scratch (a dict): gets "scores"
    [B, Hkv, GROUP, W]. _red (red twins, never for use): "no_mask" (every slot attended), "drop_chunk" (chunk 0 left
    out of P.V)."""
    b, hq, _, d = query.shape
    hkv, w = ring_k.shape[1], ring_k.shape[2]
    p = split.plan(b, hq, hkv, w, d, CHUNK)
    if pdl is None:
        kw = gemv.pdl_kw(query)
    else:
        kw = dict(GDC=True, launch_pdl=True) if pdl else {}
    m = mask.reshape(b, w).contiguous().view(torch.uint8)  # a view, no copy
    scores = torch.empty((b, hkv, p["GROUP"], w), dtype=query.dtype, device=query.device)
    out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=query.device)
    scaling = float(scaling)
    ring_head[(b * hkv,)](
        query, ring_k, ring_v, m, scores, out, hkv, w, p["chunks"], query.stride(0), query.stride(1),
        query.stride(3), scaling, 0 if _red == "drop_chunk" else -1, GROUP=p["GROUP"], G_PAD=p["G_PAD"], D=d,
        CHUNK=p["CHUNK"], W_BLOCK=p["W_BLOCK"], SCALE=scaling != 1.0, STAGES=STAGES, RED_NO_MASK=_red == "no_mask",
        num_warps=WARPS, **kw)
    if scratch is not None:
        scratch.update(scores=scores, plan=p)
    return out


def install(red: str | None = None, min_programs: int | None = None) -> split.Installed:
    """Patch the library's ring attention until `.uninstall()` (red: `ring_attend`'s red twins; min_programs: the
    least B x Hkv taken, the SMs' share when None; the tests' small models pass 1)."""
    return split.Installed(red, name="per-head",
                           attend=lambda q, k, v, m, scaling, red: ring_attend(q, k, v, m, scaling, _red=red),
                           refuse=lambda q, k, v, m: refusal(q, k, v, m, min_programs))


@contextlib.contextmanager
def installed(red: str | None = None, min_programs: int | None = None) -> Iterator[split.Installed]:
    """`install` for the block; the library's ring attention is back after it, whatever happens inside."""
    state = install(red, min_programs)
    try:
        yield state
    finally:
        state.uninstall()


__all__ = ["CHUNK", "MIN_SM_SHARE", "programs_refusal", "refusal", "ring_attend", "install", "installed"]
