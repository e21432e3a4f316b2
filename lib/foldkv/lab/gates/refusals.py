"""Refusals: each invalid input of the decode, the prefill and the decode workspace, the FoldKvInputError it must get
(naming the fault) before anything launches, and that nothing was written; notebook 02's `refusals` section."""

from __future__ import annotations

from typing import Callable

import torch

from ...config import GEMMA4_31B, AttentionGeometry
from ...kernels.plan import MAX_BATCH  # no TileLang: the plan module is plain torch
from ...layout import KvFormat
from ...pool import BlockTable, PagedKvLayout, PagedKvPool
from .inputs import Case, GateInputs, bits, make_inputs, poisoned_outputs
from .sections import gpu_section


def _other(fmt: KvFormat) -> KvFormat:
    return KvFormat.SPLIT if fmt is KvFormat.FOLDED else KvFormat.FOLDED


def _table_with(inputs: GateInputs, page_ids=None, seq_lens=None) -> BlockTable:
    t = inputs.table
    return BlockTable(t.page_ids.clone() if page_ids is None else page_ids,
                      t.seq_lens.clone() if seq_lens is None else seq_lens)


def _set(t: torch.Tensor, index, value) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _many_requests(inputs: GateInputs, n: int) -> dict:
    t = inputs.table
    return {"table": BlockTable(t.page_ids[:1].repeat(n, 1).contiguous(), t.seq_lens[:1].repeat(n).contiguous()),
            "query": inputs.query[:1].repeat(n, 1, 1).contiguous()}


# name -> (what is wrong, make the call's overrides from valid inputs, expected message fragment)
DECODE_REFUSALS: dict[str, tuple[str, Callable[[GateInputs], dict], str]] = {
    "page-id-past-pool": ("a page id = num_pages", lambda i: {"table": _table_with(
        i, page_ids=_set(i.table.page_ids, (0, 0), i.pool.layout.num_pages))}, "page_ids"),
    "page-id-negative": ("a page id = -5", lambda i: {"table": _table_with(
        i, page_ids=_set(i.table.page_ids, (0, 0), -5))}, "holds -5"),
    "length-past-pages": ("seq_len beyond the pages its row holds", lambda i: {"table": _table_with(
        i, seq_lens=_set(i.table.seq_lens, 0, i.table.page_ids.shape[1] * 64 + 1))}, "pages"),
    "batch-above-limit": (f"{MAX_BATCH + 1} requests (limit {MAX_BATCH})", lambda i: _many_requests(i, MAX_BATCH + 1),
                          f"1 to {MAX_BATCH}"),
    "length-above-limit": ("a length of 262,145", lambda i: {"table": _table_with(
        i, page_ids=torch.zeros(1, 4097, dtype=torch.int32, device=i.pool.device),
        seq_lens=torch.tensor([262_145], dtype=torch.int32, device=i.pool.device)),
        "query": i.query[:1].contiguous()}, "262144"),
    "query-float32": ("query in float32", lambda i: {"query": i.query.float()}, "dtype"),
    "query-noncontiguous": ("query with a transposed layout", lambda i: {
        "query": i.query.transpose(0, 1).contiguous().transpose(0, 1)}, "contiguous"),
    "query-heads": ("16 query heads", lambda i: {"query": i.query[:, :16].contiguous()}, "shape"),
    "query-on-cpu": ("query on the CPU, pool on the GPU", lambda i: {"query": i.query.cpu()}, "cpu"),
    "pool-other-format": ("a pool of the other format than the kernel asked for",
                          lambda i: {"kv_format": _other(i.format)}, "pool"),
    "page-ids-int64": ("page ids in int64", lambda i: {"table": _table_with(
        i, page_ids=i.table.page_ids.long())}, "dtype"),
    "out-float32": ("an output buffer in float32", lambda i: {"out": torch.zeros(
        i.query.shape, dtype=torch.float32, device=i.pool.device)}, "out"),
    # fp8_math, parsed once at decode's boundary (kernels.decode.parse_fp8_math): "tensor_cores" is the FP8 pool's
    # default decode (FP8 wgmma, held to gates.fp8_tc's bound), "exact" the exact-conversion one (the bf16 gate's)
    "fp8-math-unknown": ('fp8_math="fast" (known: "tensor_cores", the FP8 default; "exact")',
                         lambda i: {"fp8_math": "fast"}, "fp8_math"),
    "fp8-math-tensor-cores-on-bf16": ('fp8_math="tensor_cores" on a bf16 pool (its decode is exact bf16)',
                                      lambda i: {"fp8_math": "tensor_cores"}, "needs an FP8 pool"),
}

PREFILL_REFUSALS: dict[str, tuple[str, Callable[[GateInputs], dict], str]] = {
    "page-id-past-pool": DECODE_REFUSALS["page-id-past-pool"],
    "page-id-negative": DECODE_REFUSALS["page-id-negative"],
    "length-past-pages": DECODE_REFUSALS["length-past-pages"],
    "query-float32": DECODE_REFUSALS["query-float32"],
    "query-on-cpu": DECODE_REFUSALS["query-on-cpu"],
    "query-heads": DECODE_REFUSALS["query-heads"],
    "q-len-above-seq-len": ("a chunk longer than its request", lambda i: {"q_lens": _set(
        i.q_lens, 0, int(i.table.seq_lens[0]) + 1)}, "q_len"),
    "q-len-zero": ("a request with no queries", lambda i: {"q_lens": _set(i.q_lens, 0, 0)}, "q_len"),
    "q-lens-sum": ("query rows not the sum of q_lens", lambda i: {"query": i.query[:-1].contiguous()}, "query"),
}


def run_refusals(inputs: GateInputs, backend: str = "jit") -> list[dict]:
    """Try each invalid input of the inputs' kind on its launcher: each must raise FoldKvInputError naming the fault
    before anything is launched, leaving the pool and the (poisoned) outputs bit-for-bit unchanged."""
    from ...validate import FoldKvInputError

    kind = inputs.case.kind
    table = DECODE_REFUSALS if kind == "decode" else PREFILL_REFUSALS
    geom, dev = inputs.pool.geometry, inputs.pool.device
    rows = []
    for name, (what, make, expect) in table.items():
        out, lse = poisoned_outputs(inputs.query.shape[0], geom, dev, pad_rows=0)
        args = {"pool": inputs.pool, "query": inputs.query, "table": inputs.table, "out": out, "lse": lse}
        if kind == "prefill":
            args["q_lens"] = inputs.q_lens
        args.update(make(inputs))
        if kind == "decode" and args["table"].batch != inputs.table.batch:  # other batch: outputs to match
            args["out"], args["lse"] = poisoned_outputs(args["table"].batch, geom, dev, pad_rows=0)
        out_before, lse_before = bits(args["out"]).clone(), bits(args["lse"]).clone()
        pool_before = bits(inputs.pool.data).clone()
        try:
            if kind == "decode":
                from ...kernels.decode import decode

                decode(**args, backend=backend)
            else:
                from ...kernels.prefill import prefill

                prefill(**args, backend=backend)
            refused, message = False, "accepted"
        except FoldKvInputError as exc:
            refused, message = True, str(exc)
        untouched = (torch.equal(bits(inputs.pool.data), pool_before) and torch.equal(bits(args["out"]), out_before)
                     and torch.equal(bits(args["lse"]), lse_before))
        rows.append({"kind": kind, "refusal": name, "input": what, "message": message, "refused": refused,
                     "names_the_fault": expect.lower() in message.lower(), "nothing_written": untouched,
                     "passed": refused and untouched and expect.lower() in message.lower()})
    return rows


WORKSPACE_REFUSALS = {  # name: (what, the call on a workspace of max_batch 4 / max_len 512 planned for [300, 17])
    "workspace-batch": ("a batch of 5 on a workspace of 4", lambda ws, pool, pages: ws.plan([5] * 5), "batch of 5"),
    "workspace-length": ("a length of 513 on a workspace of 512", lambda ws, pool, pages: ws.plan([513, 5]),
                         "seq_lens holds 513"),
    "workspace-table": ("a block table narrower than the lengths",
                        lambda ws, pool, pages: ws.plan([300, 17], pages[:, :4].contiguous()), "the lengths need 5"),
    "workspace-pool": ("a split pool on a folded workspace", lambda ws, pool, pages: ws.step(PagedKvPool(
        PagedKvLayout(pool.geometry, KvFormat.SPLIT, 64, 16), device=pool.device)), "made for folded pages"),
}


def run_workspace_refusals(device: torch.device | str, geom: AttentionGeometry = GEMMA4_31B) -> list[dict]:
    """Each WORKSPACE_REFUSALS input on a planned, stepped workspace: refused (FoldKvInputError naming the fault)
    with the device plan, block table, outputs and pool bit-for-bit unchanged."""
    from ...kernels.workspace import DecodeWorkspace
    from ...validate import FoldKvInputError

    rows = []
    for name, (what, call, expect) in WORKSPACE_REFUSALS.items():
        lay = PagedKvLayout(geom, KvFormat.FOLDED, 64, 16)
        pool = PagedKvPool(lay, device=device)
        pool.data.normal_()
        ws = DecodeWorkspace(lay, max_batch=4, max_len=512, device=device)
        pages = torch.arange(16, dtype=torch.int32, device=device).view(2, 8)
        ws.plan([300, 17], pages)
        ws.step(pool)
        watched = (ws._plan_dev, ws.page_ids, ws.out, ws.lse, pool.data)
        before = [bits(t).clone() if t.is_floating_point() else t.clone() for t in watched]
        try:
            call(ws, pool, pages)
            refused, message = False, "accepted"
        except FoldKvInputError as exc:
            refused, message = True, str(exc)
        torch.cuda.synchronize(device)
        untouched = all(torch.equal(bits(t) if t.is_floating_point() else t, b) for t, b in zip(watched, before))
        rows.append({"kind": "workspace", "refusal": name, "input": what, "message": message, "refused": refused,
                     "names_the_fault": expect.lower() in message.lower(), "nothing_written": untouched,
                     "passed": refused and untouched and expect.lower() in message.lower()})
    return rows


def refusal_gate(formats, seed: int, record) -> list[dict]:
    """GPU gate: every refusal of `DECODE_REFUSALS` / `PREFILL_REFUSALS` per format (`run_refusals`) and of the decode
    workspace (`run_workspace_refusals`). Records
    `refusals` (not run without CUDA) and returns its rows."""
    if not gpu_section(record, "refusals"):
        return []
    rows = []
    for fmt in map(KvFormat.parse, formats):
        for case in (Case("refuse-decode", (97, 300)), Case("refuse-prefill", (97, 300), q_lens=(54, 65))):
            rows += [dict(r, format=fmt.value) for r in run_refusals(make_inputs(case, fmt, "cuda", seed))]
    rows += [dict(r, format="folded") for r in run_workspace_refusals("cuda")]
    record.ran("refusals", rows=rows, passed=all(r["passed"] for r in rows))
    return rows
