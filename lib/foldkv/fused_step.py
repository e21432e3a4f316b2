"""The decode step's small elementwise work as a few Triton kernels, swapped in for the step's forward only.

At batch 1 a Gemma 4 decode step is GEMVs plus ~30 small kernels a layer, each a few microseconds: an RMSNorm is seven
torch kernels, RoPE five (rotate_half's slice, negate, cat, two multiplies, an add), the residual tails three or four,
GELU x up two, the sliding ring's softmax four. `fused_step(model)` swaps, on the instances and for the duration of
the block (the step `foldkv.hf_graph` runs and captures), each of them for one kernel computing the same formula:
- `rms_norm`: Gemma4RMSNorm, y = x * (mean(x^2) + eps)^-0.5 [* weight] in float32, rounded once;
- `rope`: transformers' `apply_rotary_pos_emb` (unsqueeze_dim 2), x * cos + rotate_half(x) * sin with torch's three
  roundings (each product, then the sum) kept;
- `gelu_mul`: the MLP's act(gate) * up (tanh GELU), the activation rounded before the product as torch rounds it;
- the decoder layer's tails, `norm_add_norm` (post-attention norm, the residual add, the pre-feedforward norm: one
  pass over the row, two outputs) and `norm_add_scale` (post-feedforward norm, the residual add, the layer scalar);
- the layer's tail links (`StepOptions` tail_sums, tail_next_norm): a split projection's float32 partials summed by
  the norm that reads them, and the next decoder layer's input norm made by this layer's last kernel, bitwise the
  step without;
- `masked_softmax`: the ring attention's float32 softmax of masked scores, rounded to the model dtype;
- a sliding layer's attention inside DecodeStep's step (`sliding_route`: a RingMask, the step's ring, CUDA), between
  the q|k|v GEMV and o_proj, with its seven small launches before the ring attention as one (`StepOptions.fuse_sliding`;
  `sliding_prologue`): what `q_norm_rope` (q_norm then RoPE of each query head, read in place from the GEMV's output)
  and `kv_to_ring` (k_norm + RoPE and v_norm written straight into the rings' slot for this step, read on the device:
  update_sliding's two index_copy_) compute, their row bodies side by side in one kernel; the ring attention itself
  stays `ring.ring_attention`.
- a global (k_eq_v) layer's attention inside DecodeStep's step (`global_forward_route`: a bf16 pool the workspace
  decodes; `StepOptions.fuse_global_prologue`), between the q|k GEMV and o_proj: its five norm and RoPE launches and
  `foldkv.global_step`'s query and row kernels as two PDL kernels (`global_step.query_from_projection`,
  `row_from_projection`), then the workspace's decode.
- the step's projections at 1..16 rows (`foldkv.gemv`, StepOptions.pdl): the merged q|k|v and gate|up GEMVs
  (`merged_linear`), o_proj, down_proj and the LM head (`projection_modules`) as a tensor-core skinny GEMM under
  programmatic dependent launch, and the kernels above launched with PDL too (`gemv.pdl_kw`): each waits for the
  kernel ahead before its first load, so their outputs are bitwise their plain launches'; the GEMM is within its
  float32 accumulation bound of float64, not bitwise cuBLAS.
Rounding points are torch's, so most outputs are bitwise the modules'; a sum (of squares, of exponentials) reduced in
another order, or the tanh of another formula, may move a bf16 output by one ulp (the GPU tests bound each op).
Layers these formulas do not describe (a MoE block, per-layer inputs, another activation) keep their own forwards.
The ops' launches are `foldkv.fused_step_ops`' (the public ones named here too); this module is the swap.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import MutableMapping
from typing import Iterator

import torch
from torch import nn

from . import gemv, global_step, ring
from .fused_step_ops import (_norm_add, gelu_mul, kv_to_ring, masked_softmax, norm_add_norm,  # noqa: F401
                             norm_add_scale, norm_eps, q_norm_rope, rms_norm, rope,  # (the public ones: __all__)
                             sliding_prologue)
from .masks import SLIDING_IMPLEMENTATION, RingMask
from .step_options import StepOptions, in_force, using
from .transformers_compat import cache_of, has_forward_hooks
from .moved import moved




# --- the swapped forwards -------------------------------------------------------------------------------------------

def _norm_forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, module.weight if module.with_scale else None, norm_eps(module))


# --- projections that read one input: one GEMV over their weights merged, else graph branches ----------------------
# A step's GEMVs are ~85% of the read roof each, the rest of each one its ramp and its tail. Projections that read the
# same input (a layer's q, k and v; gate and up) read their weights as one matrix when `merge_projections` has laid
# them out as row blocks of one tensor: one GEMV of 16,384 x 5,376 instead of three, 241 launches a step of the 31B
# instead of 411, and cuBLAS reads a larger matrix nearer the roof (the 31B's projections alone: 14.6 ms at one row
# against 15.2 on branches and 16.3 serial; bench/MODEL_DECODE_NOTES.md). The modules' weights become views of that
# tensor, so the model holds no more memory and every other forward computes what it did. The merged GEMV's outputs
# are column slices of one [rows, q + k + v] output; the norms after them read those slices in place.
_MERGED = "_foldkv_merged"  # attribute of an attention module / MLP: (merged weight, names, row counts)


def foreign_projection(lin: nn.Module) -> bool:
    """A projection the step leaves to its own forward: its weight not a plain tensor (a DTensor shard of transformers'
    tensor parallelism, which reduces or gathers around the module's forward; a quantised weight), its forward
    already replaced on the instance by another library (transformers' tensor parallelism installs its forward there),
    or hooks around its forward (torch's `parallelize_module` puts its redistribution there). A merged or branched GEMV
    would skip that work, so such a projection is neither merged, branched nor swapped."""
    w = getattr(lin, "weight", None)
    return ((isinstance(w, torch.Tensor) and type(w.data) is not torch.Tensor) or "forward" in lin.__dict__
            or has_forward_hooks(lin))


def _mergeable(linears: list[nn.Module]) -> bool:
    ws = [lin.weight for lin in linears]
    return (all(type(lin) is nn.Linear and lin.bias is None and not foreign_projection(lin) for lin in linears)
            and all(type(w) is nn.Parameter and w.is_contiguous() for w in ws)
            and len({(w.dtype, w.device, w.shape[1]) for w in ws}) == 1)


def _merge(owner: nn.Module, names: tuple[str, ...]) -> bool:
    """Lay owner's `names` projections' weights out as row blocks of one new tensor; the modules' weights become
    views of it (Parameters, requires_grad kept). False (nothing changed) when they are not plain bias-free Linears
    of one dtype, device and input width (a DTensor shard, a quantised weight)."""
    if _merged_weight(owner) is not None:
        return True
    linears = [getattr(owner, n, None) for n in names]
    if any(lin is None for lin in linears) or not _mergeable(linears):
        return False
    ws = [lin.weight for lin in linears]
    with torch.no_grad():
        merged = torch.cat([w.detach() for w in ws])
        start = 0
        for lin, w in zip(linears, ws):
            rows = w.shape[0]
            lin.weight = nn.Parameter(merged[start:start + rows], requires_grad=w.requires_grad)
            start += rows
    setattr(owner, _MERGED, (merged, names, tuple(w.shape[0] for w in ws)))
    del ws, linears, lin, w  # the old weights' last references
    if merged.is_cuda:  # the old weights' blocks go back to the driver: a model of 60 layers never holds two copies
        torch.cuda.empty_cache()
    return True


def _merged_weight(owner: nn.Module) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(merged weight, row counts) while the modules' weights are still its views in order; else None (a weight
    replaced since the merge: the projections run as their own)."""
    held = getattr(owner, _MERGED, None)
    if held is None:
        return None
    merged, names, rows = held
    start = 0
    for name, n in zip(names, rows):
        w = getattr(getattr(owner, name, None), "weight", None)
        if (w is None or w.data_ptr() != merged.data_ptr() + start * merged.stride(0) * merged.element_size()
                or w.shape[0] != n or w.untyped_storage().data_ptr() != merged.untyped_storage().data_ptr()):
            return None
        start += n
    return merged, rows


def _attention_names(attn: nn.Module) -> tuple[str, ...]:
    return ("q_proj",) + tuple(n for n in ("k_proj", "v_proj") if isinstance(getattr(attn, n, None), nn.Linear))


def merge_projections(model: nn.Module) -> int:
    """Merge each attention's q|k(|v) and each Gemma 4 MLP's gate|up weights (module comment above); idempotent.
    Returns how many groups are merged. The model's parameters stay what they were, as views: `split_projections`
    gives each its own tensor again (for a checkpoint format that refuses shared storage)."""
    done = 0
    for attn in branched_attention_modules(model):
        done += _merge(attn, _attention_names(attn))
    for mlp in mlp_modules(model):
        done += _merge(mlp, ("gate_proj", "up_proj"))
    return done


def split_projections(model: nn.Module) -> int:
    """Undo `merge_projections`: every merged group's weights copied into tensors of their own. Returns how many."""
    done = 0
    for owner in model.modules():
        held = getattr(owner, _MERGED, None)
        if held is None:
            continue
        for name in held[1]:
            lin = getattr(owner, name)
            lin.weight = nn.Parameter(lin.weight.detach().clone(), requires_grad=lin.weight.requires_grad)
        delattr(owner, _MERGED)
        done += 1
    return done


def merged_groups(model: nn.Module) -> int:
    """How many of `model`'s projection groups are merged (`merge_projections`) and still read through their merged
    tensor."""
    return sum(_merged_weight(m) is not None for m in model.modules())


def merged_linear(owner: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """The owner's merged projections of x as one GEMV, split into each projection's output (column slices of one
    output); None when the owner is not merged (or no longer is)."""
    held = _merged_weight(owner) if in_force().merge else None
    if held is None:
        return None
    merged, rows = held
    return gemv.linear(x, merged).split(rows, dim=-1)  # 1..16 rows on CUDA: foldkv.gemv's PDL kernels, else F.linear


# --- the step's projections that read their own input: the PDL kernels at 1..16 rows (foldkv.gemv) ----------------
# The merged groups go through `merged_linear`; each attention's o_proj, each MLP's down_proj and the LM head are plain
# nn.Linear modules called inside transformers' forwards (and `_sliding_forward`): within fused_step their forwards are
# `gemv.linear` over their own weight (F.linear past 16 rows or off CUDA: what nn.Linear.forward computes).
# Unmerged q/k/v and gate/up projections (StepOptions.merge off, graph branches) keep nn.Linear's forward.
def projection_modules(model: nn.Module) -> list[nn.Module]:
    """The plain nn.Linear o_proj of every Gemma4TextAttention, down_proj of every Gemma4TextMLP, and the model's
    lm_head: the single projections fused_step routes through `foldkv.gemv.linear`."""
    found = []
    for m in model.modules():
        kind = type(m).__name__
        if kind == "Gemma4TextAttention":
            found.append(getattr(m, "o_proj", None))
        elif kind == "Gemma4TextMLP":
            found.append(getattr(m, "down_proj", None))
    found.append(getattr(model, "lm_head", None))
    return [lin for lin in dict.fromkeys(found) if type(lin) is nn.Linear and not foreign_projection(lin)]


def _projection_forward(lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return gemv.linear(x, lin.weight, lin.bias)


# --- projections that read one input, as graph branches ------------------------------------------------------------
# A step's GEMVs are ~85% of the read roof each, the rest of each one its ramp and its tail. Projections that read the
# same input (a layer's q, k and v; gate and up) are issued on separate streams, so that under capture they are
# branches of the graph and one's tail overlaps another's body: cuBLAS's 421 GEMVs of the 31B's step take 15.2 ms
# at one row instead of 16.0 (bench/MODEL_DECODE_NOTES.md). Outputs and arithmetic are the same kernels'.


@functools.lru_cache(maxsize=None)
def side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """Two streams of `device` for the branches (made once: a capture records them by identity)."""
    return torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)


def fork(x: torch.Tensor, linears: list[nn.Module]) -> list[tuple[torch.Tensor, torch.cuda.Stream]]:
    """Each linear(x) issued on its own side stream after the work issued so far; (output, stream) pairs: `join`
    one before its output is read. Without CUDA or `StepOptions.branches`, computed in place ((output, None))."""
    if not (x.is_cuda and in_force().branches):
        return [(lin(x), None) for lin in linears]
    cur = torch.cuda.current_stream(x.device)
    out = []
    for lin, side in zip(linears, side_streams(x.device)):
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            out.append((lin(x), side))
    return out


def join(branch: tuple[torch.Tensor, torch.cuda.Stream | None]) -> torch.Tensor:
    """The branch's output, the current stream made to wait for its stream."""
    y, side = branch
    if side is not None:
        torch.cuda.current_stream(y.device).wait_stream(side)
    return y


class _BranchedProjections:
    """A layer's k (and v) projections issued as branches when its q projection is called (transformers' attention
    calls q_proj, then k_proj and v_proj on the same hidden states); k_proj / v_proj then join and return their
    branch. Called with another input, they compute as their own forward would. `join_all` (the decoder layer's
    forward, after the attention) joins what was not taken, so no branch outlives its layer."""

    def __init__(self, attn: nn.Module):
        self.attn = attn
        self.names = [n for n in ("k_proj", "v_proj") if isinstance(getattr(attn, n, None), nn.Linear)]
        self.pending: dict[str, tuple] = {}
        self.input: torch.Tensor | None = None

    def q(self, x: torch.Tensor) -> torch.Tensor:
        self.join_all()
        self.input = x
        outs = merged_linear(self.attn, x)
        if outs is not None:
            self.pending = {n: (y, None) for n, y in zip(self.names, outs[1:])}
            return outs[0]
        self.pending = dict(zip(self.names, fork(x, [getattr(self.attn, n) for n in self.names])))
        return nn.Linear.forward(self.attn.q_proj, x)

    def take(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if x is self.input and name in self.pending:
            return join(self.pending.pop(name))
        return nn.Linear.forward(getattr(self.attn, name), x)

    def join_all(self) -> None:
        for branch in self.pending.values():
            join(branch)
        self.pending, self.input = {}, None


def branched_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Attention modules whose q, k (and v) projections are plain nn.Linear (a layer sharing another's KV has none),
    none of them a `foreign_projection` (the branches call nn.Linear.forward)."""
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"
            and isinstance(getattr(m, "q_proj", None), nn.Linear) and isinstance(getattr(m, "k_proj", None), nn.Linear)
            and not getattr(m, "is_kv_shared_layer", False)
            and not any(foreign_projection(getattr(m, n)) for n in ("q_proj", "k_proj", "v_proj")
                        if isinstance(getattr(m, n, None), nn.Linear))]


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    outs = merged_linear(mlp, x)
    if outs is not None:
        gate, up = outs
    else:
        branch = fork(x, [mlp.gate_proj])[0]
        up = mlp.up_proj(x)
        gate = join(branch)
    return _tail_projection(mlp, mlp.down_proj, gelu_mul(gate, up))


# --- a layer's tail links ---------------------------------------------------------------------------------------------
# A sliding layer's o_proj and every down_proj (N = 5,376: K split in 2) have one reader, the layer's norm_add_rows,
# which adds their float32 partials itself (`gemv.linear_unsummed`, PARTS): split_sum's link goes. The layer's last
# norm_add_rows also makes the next decoder layer's input_layernorm of its output (SECOND), which that layer takes
# when its input is that output: rms_norm_rows' link goes. The same formulas at the same rounding points: bitwise
# the step without them (bench/MODEL_DECODE_NOTES.md, run 20).
_TAIL_MARKS = ("_foldkv_next", "_foldkv_input_normed", "_foldkv_tail", "_foldkv_unsummed")  # fused_step's, on exit gone


def _tail_projection(owner: nn.Module, lin: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """lin(x), whose partials are left to the layer's norm (held on the owner for `_unsummed`) when the owner's output
    is read by `_layer_forward` alone (marked on entry, no hooks) and the kernel splits K."""
    ours = getattr(lin.__dict__.get("forward"), "func", None) is _projection_forward
    if not (in_force().tail_sums and ours and owner.__dict__.get("_foldkv_tail")
            and not has_forward_hooks(owner, lin, pre=False, global_hooks=True)):
        return lin(x)
    y, parts = gemv.linear_unsummed(x, lin.weight, lin.bias)
    if parts is not None:
        owner.__dict__["_foldkv_unsummed"] = (y, parts)
    return y


def _unsummed(owner: nn.Module, y: torch.Tensor) -> torch.Tensor | None:
    """The partials of the owner's output y that `_tail_projection` left (y unwritten), else None."""
    held = owner.__dict__.pop("_foldkv_unsummed", None)
    if held is not None and held[0] is not y:
        raise RuntimeError(f"{type(owner).__name__} returned another tensor than its projection's unsummed output")
    return None if held is None else held[1]


def _layer_forward(layer: nn.Module, hidden_states: torch.Tensor, per_layer_input=None, **kwargs) -> torch.Tensor:
    """Gemma4TextDecoderLayer.forward without a MoE block or per-layer inputs, its tails fused. Every keyword the
    model passes the layer (masks, positions, cache, shared KV states) goes on to self_attn, as the layer passes it."""
    made = layer.__dict__.pop("_foldkv_input_normed", None)
    x = made[1] if made is not None and made[0] is hidden_states else layer.input_layernorm(hidden_states)
    x, _ = layer.self_attn(hidden_states=x, **kwargs)
    branched = getattr(layer.self_attn, "_foldkv_branches", None)
    if branched is not None:
        branched.join_all()
    h, x = _norm_add(x, hidden_states, layer.post_attention_layernorm, layer.pre_feedforward_layernorm, None,
                     _unsummed(layer.self_attn, x))
    x = layer.mlp(x)
    nxt = layer.__dict__.get("_foldkv_next") if in_force().tail_next_norm else None
    out, normed = _norm_add(x, h, layer.post_feedforward_layernorm, None if nxt is None else nxt.input_layernorm,
                            layer.layer_scalar, _unsummed(layer.mlp, x))
    if nxt is not None:
        nxt.__dict__["_foldkv_input_normed"] = (out, normed)
    return out


def _attention_norms(m: nn.Module) -> bool:
    """The attention's norms are the formula the fused kernels compute: Gemma 4 RMSNorms with an epsilon, q_norm and
    k_norm with a one-dimensional weight, v_norm without."""
    def norm(name, scaled):
        n = getattr(m, name, None)
        return (type(n).__name__ == "Gemma4RMSNorm" and getattr(n, "with_scale", None) is scaled
                and (hasattr(n, "eps") or hasattr(n, "variance_epsilon")) and (not scaled or n.weight.dim() == 1))

    return norm("q_norm", True) and norm("k_norm", True) and norm("v_norm", False)


def sliding_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Sliding Gemma4TextAttention modules the fused ring attention describes: their own K/V (not a layer reusing
    another's; one that stores its K/V for later layers, `store_full_length_kv`, hands on the rings as its forward
    does), q/k/v/o projections, q_norm and k_norm with weights, v_norm without, a power-of-two
    head_dim >= 16. The global (k_eq_v) layers are not among them (they fold into foldkv's pool)."""
    d = lambda m: int(getattr(m, "head_dim", 0) or 0)  # noqa: E731
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"
            and getattr(m, "is_sliding", False) is True and not getattr(m, "is_kv_shared_layer", False)
            and all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
            and _attention_norms(m) and d(m) >= 16 and d(m) & (d(m) - 1) == 0]


def sliding_route(attn: nn.Module, kwargs: dict) -> tuple | str:
    """Where a sliding attention call goes: (ring K, ring V, slot, mask [B, 1, 1, W]) when it is a decode step of
    `foldkv.hf_graph.DecodeStep` that the fused ring attention computes (the mask a RingMask: the cache's started step
    made it; the step holds this layer's ring and stores sliding rows with DecodeStep.update_sliding; the model's
    attention is foldkv's, which sends a RingMask to ring.ring_attention; one token per sequence on CUDA), else
    the reason it keeps transformers' forward (prefill, eager decode, CPU, `StepOptions.fuse_sliding` off)."""
    if not in_force().fuse_sliding:
        return "StepOptions.fuse_sliding is off"
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, RingMask):
        return "not a ring step (no RingMask: prefill or eager decode)"
    step = getattr(cache_of(kwargs), "decode_step", None)  # the cache's DecodeStep (foldkv.hf_graph), or None
    ring = step.sliding_ring(attn.layer_idx) if step is not None else None
    if ring is None:
        return "the cache's decode step holds no ring of this layer it stores with DecodeStep.update_sliding"
    if getattr(attn.config, "_attn_implementation", None) not in SLIDING_IMPLEMENTATION:
        return "the model's attention is not foldkv's"
    x, pe = kwargs.get("hidden_states"), kwargs.get("position_embeddings")
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == 1 and isinstance(pe, (tuple, list))
            and len(pe) == 2):
        return "not one token per sequence with (cos, sin)"
    if getattr(attn, "store_full_length_kv", False) and not isinstance(kwargs.get("shared_kv_states"),
                                                                                  MutableMapping):
        return "a layer storing its K/V for later layers called without shared_kv_states"
    if not x.is_cuda:
        return "not on CUDA"
    return (*ring, mask.mask)


def _sliding_forward(attn: nn.Module, *args, **kwargs):
    """Gemma4TextAttention.forward of a sliding layer inside DecodeStep's step (`sliding_route`) as the q|k|v
    projections (merged or branched: the swapped q_proj / k_proj / v_proj), `sliding_prologue` (`q_norm_rope`, and
    `kv_to_ring`: the step's rows into the rings at the step's slot, what update_sliding stores),
    `ring.ring_attention` and o_proj; every other call is the class's forward."""
    route = "positional arguments" if args else sliding_route(attn, kwargs)
    if isinstance(route, str):
        return type(attn).forward(attn, *args, **kwargs)
    ring_k, ring_v, slot, mask = route
    x = kwargs["hidden_states"]
    cos, sin = kwargs["position_embeddings"]
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    q = sliding_prologue(attn, q, k, v, cos, sin, ring_k, ring_v, slot)
    if getattr(attn, "store_full_length_kv", False):  # what the class's forward hands on: update_sliding's rings
        kwargs["shared_kv_states"][attn.layer_type] = ring_k, ring_v
    out, _ = ring.ring_attention(attn, q[:, :, None], ring_k, ring_v, RingMask(mask))
    return _tail_projection(attn, attn.o_proj, out.reshape(x.shape[0], 1, -1)), None


def global_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Global Gemma4TextAttention modules `_global_forward` describes: not sliding, their own K/V (not shared, not
    stored for later layers), q/k/o projections (v_proj, when there is one: k_eq_v has none), the norms the kernels
    compute (`_attention_norms`)."""
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"
            and getattr(m, "is_sliding", True) is False and not getattr(m, "is_kv_shared_layer", False)
            and not getattr(m, "store_full_length_kv", False)
            and all(isinstance(getattr(m, n, None), nn.Linear) for n in ("q_proj", "k_proj", "o_proj"))
            and (getattr(m, "v_proj", None) is None or isinstance(m.v_proj, nn.Linear)) and _attention_norms(m)]


def global_forward_route(attn: nn.Module, kwargs: dict) -> tuple | str:
    """(step, layer) when this global attention call is a decode step of the cache's started DecodeStep whose layer
    `global_step.global_route` takes to its kernels (asked on the projections' shapes and dtypes), the model's
    attention foldkv's; else why it keeps transformers' forward (prefill, eager decode, an FP8 pool, CPU, a switch
    off)."""
    if not in_force().fuse_global_prologue:
        return "StepOptions.fuse_global_prologue is off"
    step = getattr(cache_of(kwargs), "decode_step", None)  # the cache's DecodeStep (foldkv.hf_graph), or None
    if not (step is not None and step.started):
        return "not a started decode step"
    if getattr(attn.config, "_attn_implementation", None) not in SLIDING_IMPLEMENTATION:
        return "the model's attention is not foldkv's"
    layer = step.global_layer(attn.layer_idx)
    if layer is None:
        return "not a foldkv global layer"
    geom = layer.geometry
    x, pe = kwargs.get("hidden_states"), kwargs.get("position_embeddings")
    if not (isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] == 1 and isinstance(pe, (tuple, list))
            and len(pe) == 2):
        return "not one token per sequence with (cos, sin)"
    b, d = x.shape[0], geom.head_dim
    q = x.new_empty(b, geom.num_q_heads, 1, d)  # shapes and dtypes for the route; nothing is read from them
    kv = x.new_empty(b, geom.num_kv_heads, 1, d)
    why = global_step.global_route(step, layer, attn, q, kv, kv)
    return why if why is not None else (step, layer)


def _global_forward(attn: nn.Module, *args, **kwargs):
    """Gemma4TextAttention.forward of a global layer inside DecodeStep's step (`global_forward_route`) as its
    projections (merged or branched: the swapped q_proj / k_proj), `global_step.query_from_projection` into the
    workspace's query and `row_from_projection` into the pool (what the forward's norms and RoPE, then
    DecodeStep.attend, compute), the workspace's decode and o_proj (its split partials left to the layer's norm, as
    a sliding layer's are); every other call is the class's forward."""
    route = "positional arguments" if args else global_forward_route(attn, kwargs)
    if isinstance(route, str):
        return type(attn).forward(attn, *args, **kwargs)
    step, layer = route
    layer.check_module(attn)
    x = kwargs["hidden_states"]
    cos, sin = kwargs["position_embeddings"]
    b = x.shape[0]
    q, k = attn.q_proj(x), attn.k_proj(x)
    v = attn.v_proj(x) if attn.v_proj is not None else k  # attention_k_eq_v: the value is the key before its norm
    global_step.query_from_projection(layer.geometry, layer.pool.format, q, attn, cos, sin, step.ws.query)
    global_step.row_from_projection(layer.geometry, layer.pool, k, v, attn, cos, sin, step.store_pages,
                                    step.store_offsets)
    out = step._workspace_decode(layer, b).to(x.dtype).reshape(b, 1, -1)
    return _tail_projection(attn, attn.o_proj, out), None


def _rope_function(own):
    @functools.wraps(own)
    def apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim: int = 1):
        if (unsqueeze_dim == 2 and x.dim() == 4 and cos.shape == sin.shape == (x.shape[0], x.shape[1], x.shape[3])
                and x.dtype == cos.dtype == sin.dtype and x.shape[3] % 2 == 0 and x.shape[3] & (x.shape[3] - 1) == 0):
            return rope(x, cos, sin)
        return own(x, cos, sin, unsqueeze_dim)
    return apply_rotary_pos_emb


def norm_modules(model: nn.Module) -> list[nn.Module]:
    """The model's Gemma 4 RMSNorm modules (their class's name and the attributes the formula reads)."""
    return [m for m in model.modules()
            if type(m).__name__ == "Gemma4RMSNorm" and hasattr(m, "with_scale")
            and (hasattr(m, "eps") or hasattr(m, "variance_epsilon"))]


def _tanh_gelu(act: nn.Module) -> bool:
    fn = getattr(act, "act", None)
    return (type(act).__name__ == "GELUTanh" and isinstance(fn, functools.partial)
            and fn.func is torch.nn.functional.gelu and fn.keywords.get("approximate") == "tanh")


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextMLP" and _tanh_gelu(m.act_fn)]


def layer_modules(model: nn.Module) -> list[nn.Module]:
    """Decoder layers `_layer_forward` describes: no MoE block, no per-layer inputs, the four norms."""
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextDecoderLayer"
            and not getattr(m, "enable_moe_block", True) and not getattr(m, "hidden_size_per_layer_input", 1)
            and all(type(getattr(m, n, None)).__name__ == "Gemma4RMSNorm" for n in names)
            and isinstance(getattr(m, "layer_scalar", None), torch.Tensor) and m.layer_scalar.numel() == 1]


def _mark_tails(model: nn.Module, layers: list[nn.Module]) -> dict:
    """Marks, for `_layer_forward`, each layer's attention and MLP (their outputs read by its norms alone) and each
    layer's next decoder layer when both are fused (consecutive in a ModuleList). Plain attributes (not submodules)."""
    ours = set(layers)
    for m in layers:
        m.self_attn.__dict__["_foldkv_tail"] = m.mlp.__dict__["_foldkv_tail"] = True
    pairs = [(a, b) for seq in model.modules() if isinstance(seq, nn.ModuleList)
             for a, b in zip(list(seq), list(seq)[1:]) if a in ours and b in ours]
    for a, b in pairs:
        a.__dict__["_foldkv_next"] = b
    return {"tail_owners": 2 * len(layers), "next_norms": len(pairs)}


@contextlib.contextmanager
def fused_step(model: nn.Module, options: StepOptions | None = None) -> Iterator[dict]:
    """Within the block, `model`'s RMSNorms, MLPs, decoder layers and its attention's RoPE run the kernels above
    (forwards replaced on the instances; `apply_rotary_pos_emb` in the attention classes' modules); yields how many
    of each. `options` (`foldkv.step_options`; None: those in force, the served ones outside a step) choose what is
    swapped and are in force inside the block, where the swapped forwards read them. Outside it, every forward is as
    it was; the projections merged on entry (`merge_projections`, `StepOptions.merge`) stay merged: the same values,
    laid out as views of one tensor a group."""
    options = in_force() if options is None else options
    with using(options):
        with _swapped(model, options) as counts:
            yield counts


@contextlib.contextmanager
def _swapped(model: nn.Module, options: StepOptions) -> Iterator[dict]:
    merged = merge_projections(model) if options.merge else 0
    swapped: list[tuple[nn.Module, object]] = []
    for m in norm_modules(model):
        swapped.append((m, functools.partial(_norm_forward, m)))
    for m in mlp_modules(model):
        swapped.append((m, functools.partial(_mlp_forward, m)))
    layers = layer_modules(model)
    for m in layers:
        swapped.append((m, functools.partial(_layer_forward, m)))
    tails = _mark_tails(model, layers)
    branched = branched_attention_modules(model) if options.branches or options.merge else []
    for attn in branched:
        proj = attn._foldkv_branches = _BranchedProjections(attn)
        swapped.append((attn.q_proj, proj.q))
        for name in proj.names:
            swapped.append((getattr(attn, name), functools.partial(proj.take, name)))
    sliding = sliding_attention_modules(model) if options.fuse_sliding else []
    for attn in sliding:
        swapped.append((attn, functools.partial(_sliding_forward, attn)))
    global_ = global_attention_modules(model) if options.fuse_global_prologue else []
    for attn in global_:
        swapped.append((attn, functools.partial(_global_forward, attn)))
    projections = projection_modules(model)
    for lin in projections:
        swapped.append((lin, functools.partial(_projection_forward, lin)))
    modules = {type(m).__module__ for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"}
    ropes = [(sys.modules[name], sys.modules[name].apply_rotary_pos_emb) for name in sorted(modules)
             if hasattr(sys.modules.get(name), "apply_rotary_pos_emb")]
    prior = [m.__dict__.get("forward") for m, _ in swapped]  # another library's forward on an instance stays its
    for m, forward in swapped:
        m.forward = forward
    for mod, own in ropes:
        mod.apply_rotary_pos_emb = _rope_function(own)
    counts = {"norms": sum(type(m).__name__ == "Gemma4RMSNorm" for m, _ in swapped),
              "mlps": sum(type(m).__name__ == "Gemma4TextMLP" for m, _ in swapped), "layers": len(layers),
              "rope": len(ropes), "branched_attention": len(branched), "merged": merged,
              "sliding_attention": len(sliding), "global_attention": len(global_), "projections": len(projections),
              **tails}
    try:
        yield counts
    finally:
        for (m, _), own in zip(swapped, prior):
            if own is None:
                del m.forward
            else:
                m.forward = own
        for owner in (o for m in layers for o in (m, m.self_attn, m.mlp)):
            for name in _TAIL_MARKS:
                owner.__dict__.pop(name, None)
        for attn in branched:
            attn._foldkv_branches.join_all()
            del attn._foldkv_branches
        for mod, own in ropes:
            mod.apply_rotary_pos_emb = own


_MOVED = {name: f"pass StepOptions({field}=...) (foldkv.step_options) where the step is made" for name, field in (
    ("FUSE_SLIDING", "fuse_sliding"), ("FUSE_GLOBAL_PROLOGUE", "fuse_global_prologue"), ("MERGE", "merge"),
    ("BRANCHES", "branches"), ("TAIL_SUMS", "tail_sums"), ("TAIL_NEXT_NORM", "tail_next_norm"))}


__getattr__ = moved(__name__, _MOVED)


__all__ = ["fused_step", "norm_eps", "fork", "join", "side_streams", "branched_attention_modules",
           "merge_projections", "split_projections", "merged_linear", "merged_groups",
           "rms_norm", "rope", "gelu_mul", "norm_add_norm", "norm_add_scale", "masked_softmax", "norm_modules",
           "mlp_modules", "layer_modules", "q_norm_rope", "kv_to_ring", "sliding_prologue",
           "sliding_attention_modules", "sliding_route", "global_attention_modules",
           "global_forward_route", "projection_modules", "foreign_projection", "StepOptions"]
