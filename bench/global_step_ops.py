"""Count the aten ops one decode step of a global (k_eq_v) layer runs, per KV format, on the CPU (no GPU needed).

The tiny synthetic Gemma 4 (the global layers have the 31B's geometry: 32 q heads, 4 KV heads of 512, R = 128), bf16
(the dtype the 31B runs in, so the float32 round trips of `fold_query` show), a FoldKvCache with decode_step="static"
(what the CUDA graph records, run eagerly). The CPU's reference attention is swapped for a stand-in workspace whose
`query` / `out` buffers are DecodeWorkspace's (bf16 [B, Hq, D]) and whose `step` runs nothing, so `_global_decode`
takes CUDA's branch (the fold into `ws.query`, then `ws.step(...)`) verbatim; the decode kernel itself is counted as one.
What it counts is `DecodeStep.attend`'s torch path (on the CPU every call takes it; on CUDA an FP8 pool's, or any pool's
with `StepOptions(fuse_global=False)`): on CUDA a bf16 pool's query and row are `foldkv.global_step`'s two kernels.

A TorchDispatchMode records every aten op of the second decode step (steady state) with the phase it ran in (hooks on
the global layers' q_proj / q_norm / k_proj / k_norm / v_norm / o_proj and wrappers of attend's four calls) and the
innermost foldkv or transformers source line. Ops of the transformers-side norms and RoPE are listed as the one fused
kernel each is on CUDA (`fused_step`: rms_norm_rows, rope_rows); views are free.

    PYTHONPATH=lib python bench/global_step_ops.py [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
import tempfile
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "_unsafe_view", "select", "slice", "transpose", "unsqueeze", "squeeze", "expand", "as_strided",
         "t", "permute", "alias", "detach", "split", "split_with_sizes", "unbind", "_reshape_alias"}


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.phase = None
        self.on = False
        self.ops: list[tuple[str, str, str, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.on and self.phase is not None:
            name = func.overloadpacket.__name__
            where = ""
            for fr in reversed(traceback.extract_stack()[:-1]):
                if ("/foldkv/" in fr.filename or "modeling_gemma4" in fr.filename) and "global_step_ops" not in fr.filename:
                    where = f"{fr.filename.split('/')[-1]}:{fr.lineno} {fr.line.strip()[:90]}"
                    break
            self.ops.append((self.phase, f"{name}.{func._overloadname}", where, name in VIEWS))
        return out


class FakeWorkspace:
    """DecodeWorkspace's buffers and host calls, no kernel: `_global_decode` runs its CUDA branch."""

    def __init__(self, b, hq, d, rec):
        self.query = torch.zeros(b, hq, d, dtype=torch.bfloat16)
        self.out = torch.zeros(b, hq, d, dtype=torch.bfloat16)
        self.rec = rec

    def step(self, pool, backend=None, check=True):
        if self.rec.on:
            self.rec.ops.append((self.rec.phase, "<decode_fused_%s_kernel>" % pool.format.value,
                                 "hf_graph.py _global_decode: self.ws.step(...)", False))

    def plan(self, *a, **k):
        pass

    def advance(self):
        pass


def count(fmt: str, batch: int) -> list:
    import foldkv.hf  # noqa: F401
    from foldkv import hf_graph, prep
    from foldkv.hf import FoldKvCache
    from foldkv.lab.model import cache_keyword, load_model
    from foldkv.lab.synthetic import make_synthetic_checkpoint

    tmp = tempfile.mkdtemp()
    ckpt = make_synthetic_checkpoint(tmp, seed=3, sliding_window=8, hidden_size=64, intermediate_size=128,
                                     vocab_size=128)
    model = load_model(ckpt, dtype=torch.bfloat16, attn_implementation="foldkv")
    rec = Recorder()
    cache = FoldKvCache(model, max_batch=batch, max_tokens=32, kv_format=fmt, decode_step="static")
    step = cache.decode_step
    geom = cache.global_layers[0].geometry
    step._global_workspace = lambda first: FakeWorkspace(batch, geom.num_q_heads, geom.head_dim, rec)

    def phase(name):
        def hook(*_):
            rec.phase = name
        return hook

    globals_ = [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention" and not m.is_sliding]
    for attn in globals_:
        attn.q_proj.register_forward_hook(phase("q_norm"))  # after q_proj: q_norm, then RoPE(q)
        attn.q_norm.register_forward_hook(phase("rope_q"))
        attn.k_proj.register_forward_pre_hook(phase(None))
        attn.k_proj.register_forward_hook(phase("k_norm"))
        attn.k_norm.register_forward_hook(phase("rope_k"))
        attn.v_norm.register_forward_pre_hook(phase("v_norm"))
        attn.v_norm.register_forward_hook(phase("between"))
        attn.o_proj.register_forward_pre_hook(phase(None))
        attn.q_proj.register_forward_pre_hook(phase(None))

    def wrap(name, fn):
        def inner(*a, **k):
            prev, rec.phase = rec.phase, name
            try:
                return fn(*a, **k)
            finally:
                rec.phase = "attend"
        return inner

    for fn in ("rows_from_key_value", "fold_query", "store_rows"):
        setattr(prep, fn, wrap(fn, getattr(prep, fn)))  # the torch definition's steps (prep.fold_and_store)
    own_decode = hf_graph.DecodeStep._global_decode
    step._global_decode = wrap("_global_decode", own_decode.__get__(step))
    own_attend = hf_graph.DecodeStep.attend

    def attend(self, *a, **k):
        rec.phase = "attend"
        out = own_attend(self, *a, **k)
        rec.phase = "after_attend"
        return out
    step.attend = attend.__get__(step)

    own_call = hf_graph.DecodeStep.__call__
    calls = [0]

    def call(forward, kwargs):
        calls[0] += 1
        rec.on = calls[0] == 2  # the second decode step: steady state
        try:
            return own_call(step, forward, kwargs)
        finally:
            rec.on = False
    step.__class__ = type("CountingStep", (type(step),), {"__call__": lambda self, f, kw: call(f, kw)})

    ids = torch.randint(3, 128, (batch, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), rec:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                       do_sample=False, **{cache_keyword(model): cache})
    assert calls[0] >= 2, calls
    return rec.ops, len(globals_)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    for fmt in ("folded", "split"):
        ops, layers = count(fmt, args.batch)
        per = collections.Counter()
        print(f"== {fmt}: {layers} global layers, batch {args.batch}; ops of one global layer (the first), step 2")
        seq = ops
        # split the sequence by layer: each layer's ops begin in phase q_norm after a None phase
        layers_ops, cur = [], []
        last = None
        for item in seq:
            if item[0] == "q_norm" and last not in ("q_norm",):
                if cur:
                    layers_ops.append(cur)
                cur = []
            cur.append(item)
            last = item[0]
        if cur:
            layers_ops.append(cur)
        assert len(layers_ops) == layers, (len(layers_ops), layers)
        for ph, op, where, view in layers_ops[0]:
            print(f"  {'view' if view else 'OP  '} {ph:20s} {op:28s} {where}")
        for lo in layers_ops:
            per[tuple((ph, op) for ph, op, _, v in lo if not v)] += 1
        print(f"  layers with the same non-view op sequence: {list(per.values())}")
        print(f"  non-view ops per layer by phase: "
              f"{dict(collections.Counter(ph for ph, _, _, v in layers_ops[0] if not v))}")
        phases = collections.Counter(ph for ph, _, _, v in layers_ops[0] if not v)
        fused = {"q_norm", "rope_q", "k_norm", "rope_k", "v_norm"}  # one rms_norm_rows / rope_rows each on CUDA
        cuda = len(fused & set(phases)) + sum(n for ph, n in phases.items() if ph not in fused)
        print(f"  CUDA launches per global layer (fused_step's norms and RoPE one kernel each): {cuda}, of them"
              f" {cuda - 1} besides the decode kernel; a step of the 31B's 10 global layers: {10 * cuda}"
              f" ({10 * (cuda - 1)} besides the decode)")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
