"""The decode step's own forward (`StepForward`): a Gemma 4 causal LM's layers over the model's modules and weights,
in transformers' order and rounding points (its forward stays the oracle); Triton kernels on CUDA, the modules' own
formulas elsewhere. A model it does not describe (`refusal`) runs its own forward.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from . import gemv, global_step, ring, window_attention
from . import transformers_compat as compat
from .fused_step_ops import (_norm_add, gelu_mul, head_dim_refusal, masked_softmax, norm_eps,  # noqa: F401
                             norm_rope, norm_rope_refusal, q_norm_rope, rms_norm, rope, sliding_prologue)  # (__all__)
from .masks import SLIDING_IMPLEMENTATION, RingMask
from .moved import moved
from .pool import PagedKvPool
from .step_options import StepOptions, in_force
from .validate import FoldKvInputError


# --- projections that read one input: one GEMV over their weights merged, else graph branches ----------------------
# (why: `StepOptions.merge`, bench/MODEL_DECODE_NOTES.md). The modules' weights become views of the merged tensor
# (`merge_projections`): no memory added, and every other forward computes what it did.
_MERGED = "_foldkv_merged"  # attribute of an attention module / MLP: (merged weight, names, row counts)


def foreign_projection(lin: nn.Module) -> bool:
    """A projection the step leaves to its own forward, since a merged or branched GEMV would skip its work: a weight
    that is not a plain tensor (a DTensor shard, a quantised weight), a forward replaced on the instance, or hooks."""
    w = getattr(lin, "weight", None)
    return ((isinstance(w, torch.Tensor) and type(w.data) is not torch.Tensor) or "forward" in lin.__dict__
            or compat.has_forward_hooks(lin))


def _mergeable(linears: list[nn.Module]) -> bool:
    ws = [lin.weight for lin in linears]
    return (all(type(lin) is nn.Linear and lin.bias is None and not foreign_projection(lin) for lin in linears)
            and all(type(w) is nn.Parameter and w.is_contiguous() for w in ws)
            and len({(w.dtype, w.device, w.shape[1]) for w in ws}) == 1)


def _merge(owner: nn.Module, names: tuple[str, ...]) -> bool:
    """Owner's `names` weights as row-block views of one new tensor; False (nothing changed) unless `_mergeable`."""
    if _merged_weight(owner) is not None:
        return True
    linears = [getattr(owner, n, None) for n in names]
    if any(lin is None for lin in linears) or not _mergeable(linears):
        return False
    ws = [lin.weight for lin in linears]
    with torch.no_grad():
        merged = torch.cat([w.detach() for w in ws])
        for lin, w, view in zip(linears, ws, merged.split([w.shape[0] for w in ws])):
            lin.weight = nn.Parameter(view, requires_grad=w.requires_grad)
    setattr(owner, _MERGED, (merged, names, tuple(w.shape[0] for w in ws)))
    del ws, linears, lin, w  # the old weights' last references
    if merged.is_cuda:  # the old weights' blocks go back to the driver: a model of 60 layers never holds two copies
        torch.cuda.empty_cache()
    return True


def _merged_weight(owner: nn.Module) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """(merged weight, row counts) while the modules' weights are still its views in order; else None."""
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
    """Merge each attention's q|k(|v) and each Gemma 4 MLP's gate|up weights; idempotent. Returns how many groups
    are merged (`split_projections` undoes it, e.g. for a checkpoint format that refuses shared storage)."""
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
    """How many of `model`'s projection groups are merged and still read through their merged tensor."""
    return sum(_merged_weight(m) is not None for m in model.modules())


@functools.lru_cache(maxsize=None)
def side_streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """Two streams of `device` for the branches (made once: a capture records them by identity)."""
    return torch.cuda.Stream(device=device), torch.cuda.Stream(device=device)


def fork(x: torch.Tensor, linears: list[nn.Module]) -> list[tuple[torch.Tensor, torch.cuda.Stream]]:
    """Each linear(x) issued on its own side stream; (output, stream) pairs to `join` before reading. Without CUDA or
    `StepOptions.branches`: (output, None)."""
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


# --- what the step's forward describes -----------------------------------------------------------------------------
def _rms_norm_module(n: nn.Module | None, scaled: bool | None = None) -> bool:
    return (type(n).__name__ == "Gemma4RMSNorm" and hasattr(n, "with_scale")
            and (hasattr(n, "eps") or hasattr(n, "variance_epsilon"))
            and (scaled is None or n.with_scale is scaled) and (not n.with_scale or n.weight.dim() == 1))


def _tanh_gelu(act: nn.Module) -> bool:
    fn = getattr(act, "act", None)
    return (type(act).__name__ == "GELUTanh" and isinstance(fn, functools.partial)
            and fn.func is torch.nn.functional.gelu and fn.keywords.get("approximate") == "tanh")


def branched_attention_modules(model: nn.Module) -> list[nn.Module]:
    """Attention modules whose q, k (and v) are plain nn.Linear, none a `foreign_projection`: mergeable groups."""
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextAttention"
            and isinstance(getattr(m, "q_proj", None), nn.Linear) and isinstance(getattr(m, "k_proj", None), nn.Linear)
            and not getattr(m, "is_kv_shared_layer", False)
            and not any(foreign_projection(getattr(m, n)) for n in _attention_names(m))]


def mlp_modules(model: nn.Module) -> list[nn.Module]:
    """Gemma 4 MLPs of tanh GELU (what `gelu_mul` computes)."""
    return [m for m in model.modules() if type(m).__name__ == "Gemma4TextMLP" and _tanh_gelu(m.act_fn)]


def _layer_refusal(layer: nn.Module) -> str | None:
    """Why `StepForward` does not describe this decoder layer (None: it does)."""
    if type(layer).__name__ != "Gemma4TextDecoderLayer":
        return f"a {type(layer).__name__}, not a Gemma4TextDecoderLayer"
    if getattr(layer, "enable_moe_block", True) or getattr(layer, "hidden_size_per_layer_input", 1):
        return "a MoE block or per-layer inputs"
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    if not all(_rms_norm_module(getattr(layer, n, None)) for n in norms):
        return "its norms are not Gemma 4 RMSNorms"
    if not (isinstance(getattr(layer, "layer_scalar", None), torch.Tensor) and layer.layer_scalar.numel() == 1):
        return "no one-element layer_scalar"
    mlp, attn = layer.mlp, layer.self_attn
    if not (type(mlp).__name__ == "Gemma4TextMLP" and _tanh_gelu(mlp.act_fn)):
        return "its MLP is not a tanh-GELU Gemma4TextMLP"
    # (a layer that stores its K/V for later layers, `store_full_length_kv`, hands them on in `shared_kv_states`,
    # which no layer of a model foldkv serves reads: a forward asked to return them is not taken, `takes`)
    if type(attn).__name__ != "Gemma4TextAttention" or getattr(attn, "is_kv_shared_layer", False):
        return "its attention is not a Gemma4TextAttention with its own K/V"
    if not (all(isinstance(getattr(attn, n, None), nn.Linear) for n in ("q_proj", "k_proj", "o_proj"))
            and (getattr(attn, "v_proj", None) is None or isinstance(attn.v_proj, nn.Linear))
            and all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))):
        return "its projections are not nn.Linear modules (q, k, o, v unless k_eq_v; gate, up, down)"
    if not (_rms_norm_module(attn.q_norm, True) and _rms_norm_module(attn.k_norm, True)
            and _rms_norm_module(attn.v_norm, False)):
        return "its attention's norms are not q_norm, k_norm with weights and v_norm without"
    return None


def text_model(model: nn.Module) -> nn.Module | None:
    """The Gemma 4 text model of a Gemma 4 causal LM or conditional generation model; None for another model."""
    outer = getattr(model, "model", None)
    for cand in (outer, getattr(outer, "language_model", None)):
        if isinstance(getattr(cand, "layers", None), nn.ModuleList) and hasattr(getattr(cand, "config", None),
                                                                                 "layer_types"):
            return cand
    return None


def _placeholder_ids(model: nn.Module, text: nn.Module) -> tuple[int, ...]:
    """The multimodal model's placeholder ids (image, video, audio), which its forward embeds as the pad token."""
    if text is getattr(model, "model", None):
        return ()
    ids = (getattr(model.config, f"{kind}_token_id", None) for kind in ("image", "video", "audio"))
    return tuple(int(t) for t in ids if t is not None)


def refusal(model: nn.Module) -> str | None:
    """None when `StepForward` describes `model`, else why the model's own forward runs the step."""
    text = text_model(model)
    if text is None or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return (f"{type(model).__name__} is not a Gemma 4 causal LM (.model.layers or .model.language_model.layers,"
                " config.layer_types, .lm_head)")
    if type(getattr(text, "embed_tokens", None)).__name__ != "Gemma4TextScaledWordEmbedding":
        return "the text model's embedding is not a Gemma4TextScaledWordEmbedding"
    if not _rms_norm_module(getattr(text, "norm", None)) or not hasattr(text, "rotary_emb"):
        return "the text model has no Gemma 4 final norm or rotary embedding"
    for i, layer in enumerate(text.layers):
        if (why := _layer_refusal(layer)) is not None:
            return f"layer {i}: {why}"
    own = [text, text.norm] + [m for layer in text.layers for m in layer.modules() if not isinstance(m, nn.Linear)]
    if compat.has_forward_hooks(*own, global_hooks=True) or any("forward" in vars(m) for m in own):
        return "forward hooks, or another library's forward, on a module whose forward the step computes itself"
    return None


# --- the step's forward --------------------------------------------------------------------------------------------
class _Projection:
    """A projection the step calls alone (o_proj, down_proj, the LM head): `foldkv.gemv`, or a foreign module."""

    def __init__(self, lin: nn.Module):
        self.lin = lin
        plain = type(lin) is nn.Linear and not foreign_projection(lin)
        self.weight, self.bias = (lin.weight, lin.bias) if plain else (None, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) if self.weight is None else gemv.linear(x, self.weight, self.bias)

    def tail(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, None), or (y unwritten, its split partials) for the norm after it to sum (`StepOptions.tail_sums`)."""
        if self.weight is None or not in_force().tail_sums:
            return self(x), None
        return gemv.linear_unsummed(x, self.weight, self.bias)


class _Group:
    """Projections that read one input (q|k(|v), gate|up): one GEMV over their merged weight, else each module, the
    ones after the first as graph branches (`fork`) when none is foreign."""

    def __init__(self, owner: nn.Module, names: tuple[str, ...], merge: bool):
        self.linears = [getattr(owner, n) for n in names]
        held = _merged_weight(owner) if merge else None
        self.merged, self.rows = held if held is not None else (None, None)
        self.branch = not any(foreign_projection(lin) for lin in self.linears)

    def __call__(self, x: torch.Tensor, merged: bool = True) -> list[torch.Tensor]:
        """The group's outputs; `merged` False (`StepOptions.merge_prefill` off): one GEMM a projection."""
        if self.merged is not None:
            if not merged:
                return [gemv.linear(x, w) for w in self.merged.split(self.rows)]
            return list(gemv.linear(x, self.merged).split(self.rows, dim=-1))
        rest = fork(x, self.linears[1:]) if self.branch else [(lin(x), None) for lin in self.linears[1:]]
        first = self.linears[0](x)
        return [first] + [join(b) for b in rest]


_KEYWORDS = frozenset(("input_ids", "attention_mask", "position_ids", "cache", "past_key_values", "use_cache",
                       "logits_to_keep", "return_dict", "cache_position"))


WARM_ROWS = 4096  # `StepForward.warm_prefill`'s rows: a prefill chunk's (cuBLAS picks its kernels by shape)
SHORT_ROWS = 4  # a short chunk's: cuBLAS's small-M GEMMs and FlashAttention's split-key kernels (a chunk of <= 384
# queries over the window splits its keys), which no full chunk launches


def warm_row_counts(rows: int, hidden: int) -> tuple[int, ...]:
    """The row counts `StepForward.warm_prefill` runs for chunks of up to `rows`: a full chunk, a balanced one of
    half as many plus one (odd: FlashAttention's kernels for rows that are no multiple of its tiles), a short one, and
    15 when the hidden width is no multiple of 16 (norm_add's rows x hidden then takes another specialisation)."""
    counts = (rows, rows // 2 + 1, SHORT_ROWS) + ((15,) if hidden % 16 else ())
    return tuple(sorted({t for t in counts if 2 <= t <= rows}, reverse=True))


class StepForward:
    """The Gemma 4 forward over the model's modules and weights, read once here: `decode` for DecodeStep's step,
    `prefill` for a prompt's forward. The one who builds it asks `refusal(model)` first."""

    def __init__(self, model: nn.Module, options: StepOptions):
        if (why := refusal(model)) is not None:
            raise FoldKvInputError(f"the step's forward does not describe this model: {why}")
        self.model, self.text = model, text_model(model)
        self.placeholders = _placeholder_ids(model, self.text)  # a multimodal model's: embedded as the pad token
        self.pad_id = int(getattr(self.text.config, "pad_token_id", 0) or 0)
        self.layers = list(self.text.layers)[:self.text.config.num_hidden_layers]
        self.types = list(self.text.config.layer_types)[:len(self.layers)]
        cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
        self.softcap = None if cap is None else float(cap)
        self.qkv = [_Group(m.self_attn, _attention_names(m.self_attn), options.merge) for m in self.layers]
        self.gate_up = [_Group(m.mlp, ("gate_proj", "up_proj"), options.merge) for m in self.layers]
        self.o_proj = [_Projection(m.self_attn.o_proj) for m in self.layers]
        self.down_proj = [_Projection(m.mlp.down_proj) for m in self.layers]
        self.lm_head = _Projection(model.lm_head)

    # -- the ops: foldkv's kernels on CUDA, the modules' own formulas elsewhere ------------------------------------
    @staticmethod
    def _norm(norm: nn.Module, x: torch.Tensor, **place) -> torch.Tensor:
        return rms_norm(x, norm.weight if norm.with_scale else None, norm_eps(norm), **place) if x.is_cuda else norm(x)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, **place) -> torch.Tensor:
        """transformers' apply_rotary_pos_emb at unsqueeze_dim 2 (x [B, T, H, D], cos/sin [B, T, D])."""
        d = x.shape[-1]
        if (x.is_cuda and cos.shape == sin.shape == (x.shape[0], x.shape[1], d) and x.dtype == cos.dtype == sin.dtype
                and d % 2 == 0 and d & (d - 1) == 0):  # (a table of one row for a batch broadcasts: torch's)
            return rope(x, cos, sin, **place)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        return (x * cos) + (torch.cat((-x[..., d // 2:], x[..., :d // 2]), dim=-1) * sin)  # rotate_half(x) * sin

    def _norm_rope(self, norm: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   fused: bool, **place) -> torch.Tensor:
        """RoPE(norm(x)) of head rows x [B, T, H, D]: one pass (`norm_rope`) when `fused` and its kernel takes the
        rows, else `_norm` then `_rope`, bitwise the same; `place`: their `out=`."""
        if fused and x.is_cuda and norm.with_scale and norm_rope_refusal(x, norm.weight, cos, sin) is None:
            return norm_rope(x, norm.weight, norm_eps(norm), cos, sin, **place)
        return self._rope(self._norm(norm, x), cos, sin, **place)

    def _norm_add(self, x, residual, first, second, scalar, parts):
        """(h, y): h = residual + first(x) [* scalar], y = second(h) (h without a second norm)."""
        if x.is_cuda:
            return _norm_add(x, residual, first, second, scalar, parts)
        h = residual + first(x)
        if scalar is not None:
            h *= scalar
        return h, (second(h) if second is not None else h)

    # -- the forward ---------------------------------------------------------------------------------------------
    def takes(self, kwargs: dict) -> bool:
        """Whether a forward's keywords are all ones this forward serves (any other one absent, None or False)."""
        return kwargs.get("return_dict") is not False and all(
            k in _KEYWORDS or v is None or v is False for k, v in kwargs.items())

    def decode(self, step: Any, ids: torch.Tensor, positions: torch.Tensor, masks: dict) -> Any:
        """One decode step of `step` (a DecodeStep): ids, positions [B, 1], masks {layer type: mask}."""
        return self._forward(ids, positions, masks, step.cache, step, 0)

    def prefill(self, cache: Any, ids: torch.Tensor, attention_mask: Any, positions: torch.Tensor | None,
                logits_to_keep: Any) -> Any:
        """A prompt's forward into `cache`; the logits of the last `logits_to_keep` positions (0: all)."""
        if positions is None:
            positions = (torch.arange(ids.shape[1], device=ids.device) + cache.get_seq_length())[None]
        return self._forward(ids, positions, attention_mask, cache, None, logits_to_keep)

    def _forward(self, ids, positions, masks, cache, step, logits_to_keep) -> Any:
        if self.placeholders:  # as the multimodal model's forward embeds a token of no image, video or audio input
            hit = functools.reduce(torch.logical_or, [ids == t for t in self.placeholders])
            ids = ids.masked_fill(hit, self.pad_id)
        h = self.text.embed_tokens(ids)
        if not isinstance(masks, dict):
            masks = compat.causal_masks(self.text, h, masks, cache, positions)
        tables = {t: self.text.rotary_emb(h, positions, t) for t in dict.fromkeys(self.types)}
        nxt_norm = in_force().tail_next_norm and h.is_cuda
        merged = step is not None or in_force().merge_prefill  # (a decode step's groups: always their merged GEMV)
        normed = None
        for i, layer in enumerate(self.layers):
            x = normed if normed is not None else self._norm(layer.input_layernorm, h)
            kind = self.types[i]
            out, parts = self._attention(i, x, tables[kind], masks[kind], cache, step, positions, merged)
            second = self.layers[i + 1].input_layernorm if nxt_norm and i + 1 < len(self.layers) else None
            h, normed = self._feed_forward(i, out, parts, h, second, merged)
            normed = normed if second is not None else None
        h = self._norm(self.text.norm, h)
        h = h[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else h[:, logits_to_keep]  # 0: h[:, 0:], all
        return compat.causal_lm_output(self._logits(h), cache)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed rows, softcapped as the model's own head is."""
        logits = self.lm_head(h)
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap

    def _feed_forward(self, i, out, parts, h, second, merged) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i after its attention (o_proj's output, partials): residuals, norms and MLP; (h, second(h) or h)."""
        layer = self.layers[i]
        h, x = self._norm_add(out, h, layer.post_attention_layernorm, layer.pre_feedforward_layernorm, None, parts)
        out, parts = self._mlp(i, x, merged)
        return self._norm_add(out, h, layer.post_feedforward_layernorm, second, layer.layer_scalar, parts)

    def _mlp(self, i: int, x: torch.Tensor, merged: bool = True) -> tuple[torch.Tensor, Any]:
        """Layer i's MLP from its pre-feedforward norm's output: (down_proj's output, its unsummed partials or None)."""
        gate, up = self.gate_up[i](x, merged)
        act = gelu_mul(gate, up) if x.is_cuda else self.layers[i].mlp.act_fn(gate) * up
        return self.down_proj[i].tail(act)

    def _project(self, i: int, x: torch.Tensor, merged: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's q, k, v projections [B, T, H * D] of its input norm's output x."""
        q, k, *v = self.qkv[i](x, merged)
        return q, k, v[0] if v else k  # attention_k_eq_v: the value is the key before its norm

    def _heads(self, attn, q, k, v, cos, sin, fused, k_at, v_at) -> tuple[torch.Tensor, ...]:
        """Head rows [B, T, H, D] of projections q, k, v: q, k normed and RoPE'd, v normed (k_at, v_at: `out=`)."""
        b, t, d = q.shape[0], q.shape[1], attn.head_dim
        q = self._norm_rope(attn.q_norm, q.view(b, t, -1, d), cos, sin, fused)
        k = self._norm_rope(attn.k_norm, k.view(b, t, -1, d), cos, sin, fused, **k_at)
        return q, k, self._norm(attn.v_norm, v.view(b, t, -1, d), **v_at)

    def _attention(self, i, x, table, mask, cache, step, positions, merged=True) -> tuple[torch.Tensor, Any]:
        """Layer i's attention from its input norm's output x: (o_proj's output, its unsummed partials or None)."""
        attn = self.layers[i].self_attn
        cos, sin = table
        q, k, v = self._project(i, x, merged)
        b, t = x.shape[:2]
        route = self.route(attn, x, mask, step)
        if route == "sliding":
            ring_k, ring_v, slot = step.sliding_ring(attn.layer_idx)
            q = sliding_prologue(attn, q, k, v, cos, sin, ring_k, ring_v, slot)
            out, _ = ring.ring_attention(attn, q[:, :, None], ring_k, ring_v, mask)
            return self.o_proj[i].tail(out.reshape(b, 1, -1))
        if not isinstance(route, str):  # a global layer of the step's workspace
            layer = route
            layer.check_module(attn)
            global_step.query_from_projection(layer.geometry, layer.pool.format, q, attn, cos, sin, step.ws.query)
            global_step.row_from_projection(layer.geometry, layer.pool, k, v, attn, cos, sin, step.store_pages,
                                            step.store_offsets)
            out = step._workspace_decode(layer, b).to(x.dtype).reshape(b, 1, -1)
            return self.o_proj[i].tail(out)
        fused = step is None and in_force().fuse_prefill_norm_rope  # a prefill's
        k_at, v_at = self._chunk_places(cache, attn, k, v, attn.head_dim) if step is None else ({}, {})
        q, k, v = (rows.transpose(1, 2) for rows in self._heads(attn, q, k, v, cos, sin, fused, k_at, v_at))
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = compat.attention_function(attn)(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                                                 sliding_window=attn.sliding_window, position_ids=positions)
        return self.o_proj[i].tail(out.reshape(b, t, -1).contiguous())

    @staticmethod
    def _chunk_places(cache: Any, attn: nn.Module, k: torch.Tensor, v: torch.Tensor, d: int) -> tuple[dict, dict]:
        """The `out=` of a prefill's sliding-layer K and V rows under `StepOptions.sliding_scratch`: the places its
        cache layer's `chunk_rows` hands out (foldkv.sliding_cache), which `update` then finds filled; else ({}, {})."""
        layers = getattr(cache, "layers", ())
        layer = layers[attn.layer_idx] if attn.is_sliding and attn.layer_idx < len(layers) else None
        if layer is None or not in_force().sliding_scratch or not hasattr(layer, "chunk_rows") or k.shape != v.shape:
            return {}, {}
        k_at, v_at = layer.chunk_rows(k.shape[0], k.shape[1], k.shape[-1] // d, d, k.dtype, k.device)
        return ({}, {}) if k_at is None else ({"out": k_at}, {"out": v_at})

    @torch.no_grad()
    def warm_prefill(self, pool: Any, rows: int = WARM_ROWS) -> int:
        """Launch once each kernel a prefill chunk launches, so a process's first prompt loads none inside its time
        to first token: each distinct layer body once over random rows at each of `warm_row_counts(rows)` (a sliding
        layer's window as a first and a later chunk; a global layer's store into a one-page scratch pool), then the
        final norm and the softcapped LM head. Returns the layer bodies run (0 on the CPU)."""
        w = self.text.embed_tokens.weight
        n = w.shape[-1]
        if not w.is_cuda or rows < 2:  # (a one-token forward is no prefill of the step's)
            return 0
        scratch = PagedKvPool(replace(pool.layout, num_pages=1), device=w.device)
        g = torch.Generator(device=w.device).manual_seed(0)
        merged = in_force().merge_prefill  # the GEMMs a chunk launches: merged, or one a projection
        fused = in_force().fuse_prefill_norm_rope  # its q and k norms and RoPE: one pass, or two
        bodies = 0
        for t in warm_row_counts(rows, n):
            h = torch.randn(1, t, n, generator=g, device=w.device).to(w.dtype)  # never zero
            positions = torch.arange(t, device=w.device)[None]
            tables = {k: self.text.rotary_emb(h, positions, k) for k in dict.fromkeys(self.types)}
            pages = torch.zeros(t, dtype=torch.long, device=w.device)
            offsets = torch.arange(t, device=w.device) % pool.layout.page_size
            seen = set()
            for i, layer in enumerate(self.layers):
                last = i + 1 == len(self.layers)
                body = (self.types[i], last, tuple((tuple(p.shape), p.dtype) for p in layer.parameters()))
                if body in seen:
                    continue
                seen.add(body)
                bodies += 1
                attn, d = layer.self_attn, layer.self_attn.head_dim
                q, k, v = self._project(i, self._norm(layer.input_layernorm, h), merged)
                q, k, v = self._heads(attn, q, k, v, *tables[self.types[i]], fused, {}, {})
                if not attn.is_sliding:  # FoldKvLayer.attend's fold and store, rows packed as its index_select's
                    global_step.fold_and_store(scratch, pages, offsets, q.reshape(t, -1, d), k.reshape(t, -1, d),
                                               v.reshape(t, -1, d), attn.k_norm.weight)
                else:  # the window as a prompt's first chunk (keys: its own) and as a later one (the window's too)
                    qh, kh = q.transpose(1, 2), k.transpose(1, 2)
                    later = torch.randn(1, kh.shape[1], attn.sliding_window - 1 + t, d, generator=g, device=w.device,
                                        dtype=kh.dtype)
                    for keys in (kh, later):
                        if window_attention.refusal(qh, keys, keys, window=attn.sliding_window, softcap=getattr(
                                attn.config, "attn_logit_softcapping", None)) is None:
                            window_attention.window_attention(qh, keys, keys, window=attn.sliding_window,
                                                              scale=attn.scaling)
                out, parts = self.o_proj[i].tail(torch.randn(q.reshape(1, t, -1).shape, generator=g, device=w.device,
                                                              dtype=w.dtype))
                second = None if last or not in_force().tail_next_norm else self.layers[i + 1].input_layernorm
                self._feed_forward(i, out, parts, h, second, merged)
            self._logits(self._norm(self.text.norm, h)[:, -1:])  # the softcap's tanh too: CUDA loads its module
            # lazily at the first launch, ~0.1-0.2 s, which would fall inside the first prompt
        return bodies

    @staticmethod
    def route(attn: nn.Module, x: torch.Tensor, mask: Any, step: Any) -> Any:
        """What serves this layer's attention: "sliding" (the ring's one-launch prologue and `ring.ring_attention`),
        a FoldKvLayer (the global prologue's kernels into the step's workspace), or, as any other string, why the
        layer takes the module's formulas, the cache's update and the model's attention function instead."""
        options = in_force()
        if step is None or not step.started:
            return "not a decode step of the cache's DecodeStep (a prompt's forward)"
        if getattr(attn.config, "_attn_implementation", None) not in SLIDING_IMPLEMENTATION:
            return "the model's attention is not foldkv's"
        if x.shape[1] != 1:
            return "not one token per sequence"
        if attn.is_sliding:
            if not options.fuse_sliding:
                return "StepOptions.fuse_sliding is off"
            if not isinstance(mask, RingMask):
                return "not a ring step (no RingMask)"
            if step.sliding_ring(attn.layer_idx) is None:
                return "the cache's decode step holds no ring of this layer it stores with DecodeStep.update_sliding"
            if (why := head_dim_refusal(attn.head_dim)) is not None:
                return why
            return "sliding" if x.is_cuda else "not on CUDA"
        if not options.fuse_global_prologue:
            return "StepOptions.fuse_global_prologue is off"
        layer = step.global_layer(attn.layer_idx)
        if layer is None:
            return "not a foldkv global layer"
        geom = layer.geometry
        q = x.new_empty(x.shape[0], geom.num_q_heads, 1, geom.head_dim)  # shapes and dtypes for the route only
        kv = x.new_empty(x.shape[0], geom.num_kv_heads, 1, geom.head_dim)
        why = global_step.global_route(step, layer, attn, q, kv, kv)
        return layer if why is None else why


_MOVED = {name: f"pass StepOptions({name.lower()}=...) (foldkv.step_options) where the step is made" for name in (
    "FUSE_SLIDING", "FUSE_GLOBAL_PROLOGUE", "MERGE", "BRANCHES", "TAIL_SUMS", "TAIL_NEXT_NORM")}
_MOVED["merged_linear"] = "the step reads a merged group through fused_step._Group (tests/conftest.merged_linear)"
_MOVED["fused_step"] = ("the decode step runs its own forward: foldkv.fused_step.StepForward(model, options), built by"
                        " foldkv.hf_graph.DecodeStep")
_MOVED.update({name: "only tests launch it: tests/step_twins.py" for name in ("norm_add_norm", "norm_add_scale",
                                                                               "kv_to_ring")})


__getattr__ = moved(__name__, _MOVED)


__all__ = ["StepForward", "refusal", "text_model", "norm_eps", "fork", "join", "side_streams",
           "branched_attention_modules", "merge_projections", "split_projections", "merged_groups", "mlp_modules",
           "rms_norm", "rope", "gelu_mul", "masked_softmax", "q_norm_rope", "norm_rope", "sliding_prologue",
           "foreign_projection", "StepOptions"]
