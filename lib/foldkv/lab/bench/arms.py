"""The arms a cell times side by side: foldkv's generated kernels through their public launchers (JIT or AOT), the
plain torch decode, and the registries by name (`DECODE_ARMS`, `PREFILL_ARMS`; what an arm is lives in `spec`,
FlashInfer's builders in `peers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from foldkv.fp8 import FP8_DTYPE
from foldkv.layout import KvFormat, score_window, value_window, value_window_to_head
from foldkv.pool import BlockTable, PagedKvPool

from ..arms import ArmUnavailable
from .spec import GUARD_VALUE, ArmImpl, ArmSpec

if TYPE_CHECKING:
    from .case import AttentionCase

EAGER_PREFILL = "prefill launches are milliseconds long: timed eagerly"


# --------------------------------------------------------------------------------------------------------------------
# foldkv's generated kernels, through the public launchers
# --------------------------------------------------------------------------------------------------------------------
def guarded_outputs(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list]:
    """out [T, Hq, D] bf16 and lse [T, Hq] float32 as contiguous views of buffers one row longer, whose last row
    holds GUARD_VALUE (checked after each run: nothing past the plan may be written)."""
    t, hq, d = query.shape
    out_full = torch.empty(t + 1, hq, d, dtype=torch.bfloat16, device=query.device)  # [T + 1, Hq, D]
    lse_full = torch.empty(t + 1, hq, dtype=torch.float32, device=query.device)  # [T + 1, Hq]
    out_full[t:].fill_(GUARD_VALUE)
    lse_full[t:].fill_(GUARD_VALUE)
    return out_full[:t], lse_full[:t], [out_full[t:], lse_full[t:]]


def aot_build_dir() -> str | None:
    """The active AOT build's folder, or None (never raises)."""
    try:
        from foldkv.aot import active_build

        b = active_build()
        return str(getattr(b, "path", None) or getattr(b, "root", None) or getattr(b, "dir", None) or b)
    except Exception:
        return None


def generated_arm(op: str, fmt: KvFormat | str, backend: str, params: dict | None = None,
                  kernels: Callable[["AttentionCase"], dict] | None = None,
                  plan_kw: Callable[["AttentionCase"], dict] | None = None,
                  dtype: torch.dtype = torch.bfloat16, fp8_rows: str | None = None,
                  fused: bool | None = None, fp8_math: str | None = None) -> Callable[["AttentionCase"], ArmImpl]:
    """The builder of a generated-kernel arm: `op` "decode" (foldkv.kernels.decode.decode over a plan made once,
    captured in a CUDA graph) or "prefill" (foldkv.kernels.prefill.prefill, timed eagerly), on the case's pools of
    format `fmt`, through launcher backend `backend` ("jit" or "aot") with kernel `params` (prefill tilings).
    `kernels(case)`, when given, returns the launcher's `kernels=` (an experiment's kernel in place of the library's,
    e.g. a variant from bench/versions/). `plan_kw(case)`, when given, are keyword arguments of `plan_decode` (an
    experiment's chunking). backend "aot" without an active build is "not run", not an error. `dtype`: the pool's
    stored dtype (float8_e4m3fn: the FP8 folded decode, checked against the reference over its dequantized pool).
    `fp8_rows`: the prefill's `fp8_rows` (how it reads an FP8 pool), the launcher's default when None. `fused`: the
    decode's (None: one fused launch when the plan is one wave; False: the three launches). `fp8_math`: the decode's
    FP8 partial (None: the default, tensor cores; "exact" to time or replace the converting one)."""
    fmt = KvFormat.parse(fmt)
    if op not in ("decode", "prefill"):
        raise ValueError(f"op {op!r}: expected 'decode' or 'prefill'")

    def build(case: "AttentionCase") -> ArmImpl:
        try:
            if op == "decode":
                from foldkv.kernels.decode import decode as launch, plan_decode
            else:
                from foldkv.kernels.prefill import prefill as launch
        except Exception as exc:
            raise ArmUnavailable(f"foldkv.kernels.{op} is not importable ({type(exc).__name__}: {str(exc)[:200]})") from None
        if backend == "aot":
            try:
                from foldkv.aot import active_build

                active_build()
            except Exception as exc:
                raise ArmUnavailable(f"no AOT build ({type(exc).__name__}: {str(exc)[:200]})") from None
        # A prefill gets the block table on the host, as the transformers cache hands it: the launcher then plans on
        # the host while the previous call's kernels run (it never waits for the stream), as FlashInfer's arm plans
        # once outside the timing. With a device table its checks read the table back, which waits for the stream,
        # and every call's host plan would sit in the timed loop with the GPU idle. A decode keeps the device table:
        # it is planned once and replayed in a graph.
        table = case.table if op == "decode" else case.table_cpu
        pools, query = case.pools(fmt, dtype), case.query(fmt)
        out, lse, guards = guarded_outputs(query)
        kw: dict[str, Any] = dict(out=out, lse=lse, backend=backend)
        info: dict[str, Any] = {"backend": backend, "kv_dtype": str(dtype).replace("torch.", "")}
        against = "folded_fp8" if dtype != torch.bfloat16 else "split"
        if params:
            kw["params"] = info["params"] = dict(params)
        if fp8_rows is not None:
            kw["fp8_rows"] = info["fp8_rows"] = fp8_rows
        if kernels is not None:
            kw["kernels"] = dict(kernels(case))
            info["kernels_replaced"] = sorted(kw["kernels"])
        if op == "decode":
            if fused is not None:
                kw["fused"] = info["fused"] = fused
            if fp8_math is not None:
                kw["fp8_math"] = info["fp8_math"] = fp8_math
            extra = decode_plan_kwargs(pools[0].layout, case.device, fp8_math,
                                       plan_kw(case) if plan_kw is not None else {})
            kw["plan"] = plan = plan_decode(pools[0].layout, case.table_cpu.seq_lens, device=case.device, **extra)
            info.update(chunks=plan.num_chunks, chunk_tokens=plan.chunk_tokens, plan_kw=extra,
                        one_launch=plan.fused if fused is None else fused)
            calls = [lambda p=p: launch(p, query, table, **kw) for p in pools]
            # timed: check=False skips the host read-back of the table (checked by `calls` first), as a graph needs
            timed = [lambda p=p: launch(p, query, table, check=False, **kw) for p in pools]
            return ArmImpl(calls, out, graph=True, timed_calls=timed, info=info, lse=lse, guards=guards, keep=plan,
                           reference_kind=against)
        q_lens = torch.tensor(case.q_lens, dtype=torch.int32)  # on the host, as the table
        calls = [lambda p=p: launch(p, query, table, q_lens, **kw) for p in pools]
        return ArmImpl(calls, out, graph=False, why_eager=EAGER_PREFILL, info=info, lse=lse, guards=guards,
                       reference_kind=against)

    return build


def decode_plan_kwargs(layout, device, fp8_math: str | None, extra: dict) -> dict:
    """plan_decode's keywords for a decode arm: the arm's own (`plan_kw`), with the wave the plan balances set to the
    partial's (`decode.partial_wave`: 2 x SMs for the FP8 tensor-core partial, which holds two CTAs an SM) where the
    arm sets none, as `decode()` plans when it is given no plan. A plan balanced for one CTA an SM leaves half of
    that partial's CTA slots empty on a single request."""
    from ...kernels.decode import parse_fp8_math, partial_wave

    if "num_sms" in extra:
        return dict(extra)
    return {**extra, "num_sms": partial_wave(layout, device, parse_fp8_math(fp8_math, layout.quantized))}


def workspace_arm(fmt: KvFormat | str, backend: str = "jit",
                  num_chunks: Callable[["AttentionCase"], int | None] | None = None) -> Callable[["AttentionCase"], ArmImpl]:
    """The builder of a decode arm through `foldkv.kernels.workspace.DecodeWorkspace` (sized for the case's batch and
    longest request, `num_chunks(case)` chunks or the default): what one CUDA graph per batch runs every step. The
    step is planned once (`plan`) and captured by the harness like any graph arm."""
    fmt = KvFormat.parse(fmt)

    def build(case: "AttentionCase") -> ArmImpl:
        try:
            from foldkv.kernels.workspace import DecodeWorkspace
        except Exception as exc:
            raise ArmUnavailable(f"foldkv.kernels.workspace is not importable ({type(exc).__name__}: {str(exc)[:200]})") from None
        pools, query, table = case.pools(fmt), case.query(fmt), case.table
        lens = case.table_cpu.seq_lens.tolist()
        ws = DecodeWorkspace(pools[0].layout, max_batch=len(lens), max_len=max(lens), device=case.device,
                             num_chunks=None if num_chunks is None else num_chunks(case))
        width = pools[0].layout.pages_for(max(lens))
        ws.plan(lens, table.page_ids[:, :width].contiguous())
        ws.query.copy_(query)
        calls = [lambda p=p: ws.step(p, backend=backend) for p in pools]
        timed = [lambda p=p: ws.step(p, backend=backend, check=False) for p in pools]
        info = {"backend": backend, "chunks": ws.num_chunks, "chunks_used": ws.chunks_used, "groups": ws.num_groups}
        return ArmImpl(calls, ws.out, graph=True, timed_calls=timed, info=info, lse=ws.lse, keep=ws)

    return build


# --------------------------------------------------------------------------------------------------------------------
# Plain torch decode: gather the pages, two matmuls, softmax in float32
# --------------------------------------------------------------------------------------------------------------------
def torch_decode_step(pool: PagedKvPool, query: torch.Tensor, page_index: list[torch.Tensor], seq_lens: list[int],
                      out: torch.Tensor) -> torch.Tensor:
    """Decode attention as a user would write it in torch, for either pool format: bf16 matmuls, float32 softmax.

    query [B, Hq, D] in the pool format's form; page_index[r] the device page ids of request r (long); seq_lens on the
    host (so nothing syncs and the step is graph-capturable); out [B, Hq, D] head order.
    """
    geom, fmt = pool.geometry, pool.format
    hkv, g, d = geom.num_kv_heads, geom.group_size, geom.head_dim
    sw, vw = score_window(geom, fmt), value_window(geom, fmt)
    to_head = None if fmt is KvFormat.SPLIT else value_window_to_head(geom, fmt).to(pool.device)
    for r, n in enumerate(seq_lens):
        rows = pool.data[page_index[r]]  # [pages, Hkv, P, W] (a gather; no host sync, graph-capturable)
        rows = rows.transpose(0, 1).reshape(hkv, -1, rows.shape[-1])[:, :n]  # [Hkv, n, W]
        keys, vals = rows[..., sw], rows[..., vw]  # [Hkv, n, D] each (values in value-window order)
        q = query[r].view(hkv, g, d)  # [Hkv, G, D]
        scores = torch.bmm(q, keys.transpose(1, 2))  # [Hkv, G, n]; Gemma 4 scaling is 1.0
        probs = torch.softmax(scores.float(), dim=-1).to(rows.dtype)  # [Hkv, G, n]
        o = torch.bmm(probs, vals).reshape(hkv * g, d)  # [Hq, D] value-window order
        out[r] = o if to_head is None else o[:, to_head]
    return out


def torch_decode_arm(pool_copies: list[PagedKvPool], query: torch.Tensor, table: BlockTable) -> ArmImpl:
    """The plain torch decode (gather + bf16 matmuls) over each pool copy; graph-capturable (no host sync)."""
    page_size = pool_copies[0].layout.page_size
    seq_lens = [int(n) for n in table.seq_lens.cpu()]
    dev = pool_copies[0].device
    page_index = [table.pages_of(r, page_size).to(dev, torch.long) for r in range(table.batch)]
    out = torch.empty(query.shape, dtype=torch.bfloat16, device=dev)  # [B, Hq, D]
    calls = [lambda p=p: torch_decode_step(p, query, page_index, seq_lens, out) for p in pool_copies]
    return ArmImpl(calls, out, graph=dev.type == "cuda", why_eager="" if dev.type == "cuda" else "CPU: host timer",
                   info={"format": pool_copies[0].format.value})


# --------------------------------------------------------------------------------------------------------------------
# The registries
# --------------------------------------------------------------------------------------------------------------------
def _torch_decode(fmt: KvFormat) -> Callable[["AttentionCase"], ArmImpl]:
    def build(case: "AttentionCase") -> ArmImpl:
        return torch_decode_arm(case.pools(fmt), case.query(fmt), case.table_cpu)

    return build


def _flashinfer(kind: str, tc: bool = False, fp8: bool = False) -> Callable[["AttentionCase"], ArmImpl]:
    def build(case: "AttentionCase") -> ArmImpl:
        from . import peers

        peers.import_flashinfer()  # "not run" before any pool is built when FlashInfer is absent
        kw = dict(num_kv_heads=case.geom.num_kv_heads, page_size=case.page_size, kv_layout=case.fi_kv_layout)
        if fp8:
            copies, k_scale, v_scale = case.flashinfer_kv_fp8()
            impl = peers.flashinfer_decode_arm(copies, case.query(KvFormat.SPLIT), case.table_cpu,
                                               use_tensor_cores=tc, k_scale=k_scale, v_scale=v_scale, **kw)
            impl.reference_kind = "split_fp8"
            return impl
        args = (case.flashinfer_kv(), case.query(KvFormat.SPLIT), case.table_cpu)
        if kind == "decode":
            return peers.flashinfer_decode_arm(*args, use_tensor_cores=tc, **kw)
        return peers.flashinfer_prefill_arm(*args, case.q_lens, **kw)

    return build


READ_FOLDED = "read_folded"  # the floor of every decode cell: a plain read of the folded pool's bytes, same run
READ_FOLDED_FP8 = "read_folded_fp8"  # the floor of the FP8 folded decode: a plain read of its pool's bytes
READ_SPLIT = "read_split"  # the floor of a split-only case (a geometry without folding: bench/ring_probe.py)


def _stream_read(dtype: torch.dtype, fmt: KvFormat = KvFormat.FOLDED) -> Callable[["AttentionCase"], ArmImpl]:
    def build(case: "AttentionCase") -> ArmImpl:
        """The streaming read (`roofs.stream_read_arm`) of the bytes a `fmt` decode reads from its pool of `dtype`
        (an FP8 pool's scales included), over as many rotated copies as the case's pools of that format (its buffers
        capped: the case's pools already hold the memory)."""
        from foldkv.lab import byte_floor as floor

        from .roofs import stream_read_arm

        kv = floor.step_bytes(case.geom, fmt, case.seq_lens, dtype=dtype)["kv"]
        return stream_read_arm(kv, case.device, copies=case.copies_for(fmt, dtype))

    return build


def _generated_specs(op: str) -> list[ArmSpec]:
    """The generated `op` arms: both formats over bf16 pools, then the folded format over the FP8 pool, each through
    both backends."""
    what = "" if op == "decode" else " prefill"
    bf16 = [ArmSpec(f"{fmt.value}_{backend}", f"generated {fmt.value}{what} ({backend.upper()})", fmt.value, False,
                    generated_arm(op, fmt, backend), generated=True)
            for fmt in (KvFormat.SPLIT, KvFormat.FOLDED) for backend in ("jit", "aot")]
    fp8 = [ArmSpec(f"folded_fp8_{backend}", f"generated folded {op} over the FP8 (e4m3) pool ({backend.upper()})"
                   + (", the default partial: FP8 tensor cores" if op == "decode" else ""),
                   "folded_fp8", False, generated_arm(op, KvFormat.FOLDED, backend, dtype=FP8_DTYPE), generated=True)
           for backend in ("jit", "aot")]
    return bf16 + fp8


DECODE_ARMS: dict[str, ArmSpec] = {a.name: a for a in [
    ArmSpec("fi_cuda", "FlashInfer decode, CUDA cores (use_tensor_cores=False)", "split", True,
            _flashinfer("decode", tc=False)),
    ArmSpec("fi_tc", "FlashInfer decode, tensor cores (use_tensor_cores=True)", "split", True,
            _flashinfer("decode", tc=True)),
    ArmSpec("torch", "plain torch (gather + bf16 matmul), split pool", "split", True, _torch_decode(KvFormat.SPLIT),
            cpu_ok=True),
    ArmSpec("torch_folded", "plain torch (gather + bf16 matmul), folded pool", "folded", False,
            _torch_decode(KvFormat.FOLDED), cpu_ok=True),
    ArmSpec(READ_FOLDED, "plain streaming read of the folded pool's bytes (no attention: the floor)", "folded", False,
            _stream_read(torch.bfloat16)),
    ArmSpec(READ_FOLDED_FP8, "plain streaming read of the FP8 folded pool's bytes (rows and scales: its floor)",
            "folded_fp8", False, _stream_read(FP8_DTYPE)),
    ArmSpec(READ_SPLIT, "plain streaming read of the split pool's bytes (no attention: a split-only case's floor)",
            "split", False, _stream_read(torch.bfloat16, KvFormat.SPLIT)),
    ArmSpec("fi_tc_fp8", "FlashInfer decode, tensor cores, e4m3 split pool (per-tensor scales)", "split_fp8", True,
            _flashinfer("decode", tc=True, fp8=True)),
] + _generated_specs("decode") + [
    ArmSpec("folded_fp8_exact_jit", "generated folded decode over the FP8 (e4m3) pool, fp8_math='exact' (rows"
            " converted exactly to bf16, bf16 MMA; JIT)", "folded_fp8", False,
            generated_arm("decode", KvFormat.FOLDED, "jit", dtype=FP8_DTYPE, fp8_math="exact"), generated=True)] + [
    ArmSpec(f"{fmt.value}_graph", f"generated {fmt.value}, graph workspace (JIT): fixed grids, exact-count plan",
            fmt.value, False, workspace_arm(fmt), generated=True) for fmt in (KvFormat.SPLIT, KvFormat.FOLDED)]}
PREFILL_ARMS: dict[str, ArmSpec] = {a.name: a for a in [
    ArmSpec("fi_prefill", "FlashInfer paged prefill (causal, hd512)", "split", True, _flashinfer("prefill")),
] + _generated_specs("prefill") + [
    ArmSpec("folded_fp8_in_kernel_jit", "generated folded prefill over the FP8 pool, rows converted in the attention"
            " kernel (fp8_rows='in_kernel', JIT)", "folded_fp8", False,
            generated_arm("prefill", KvFormat.FOLDED, "jit", dtype=FP8_DTYPE, fp8_rows="in_kernel"), generated=True)]}
DEFAULT_DECODE_ARMS = ("fi_cuda", "fi_tc", "torch", "split_jit", "folded_jit", "folded_aot", READ_FOLDED)
DEFAULT_PREFILL_ARMS = ("fi_prefill", "split_jit", "folded_jit", "folded_aot")
