"""The list of generated kernel variants (`VARIANTS`, with why each one's params), and the record of the kernels this
process handed out (`note_kernel`, `hands_out`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import AttentionGeometry
from ..layout import KvFormat
from ..validate import FoldKvInputError


@dataclass(frozen=True)
class KernelVariant:
    """One generated kernel: `build(geom, **params)` calls builder(geom, fmt=format, **params) (no `fmt` for a
    format-independent variant) with the registered params overridden by name."""

    name: str  # unique, e.g. "decode_partial_folded"
    family: str  # decode_partial | decode_fused | merge_groups | merge_final | prefill | dequant_pages
    format: KvFormat | None  # None for format-independent kernels (the merges)
    builder: str | Callable[..., Any]  # "package.module:function", imported on first build (or the function itself)
    params: dict = field(default_factory=dict)  # tuning constants baked into the build (page size, tiles, ...)
    in_place_merge: bool = False  # the emitted-source barrier check applies

    def build_function(self) -> Callable[..., Any]:
        """The builder itself (its module imported now)."""
        if callable(self.builder):
            return self.builder
        module, _, function = self.builder.partition(":")
        return getattr(importlib.import_module(module), function)

    def arguments(self, params: dict | None = None) -> dict:
        """The registered params with `params` overriding them; a name the variant does not have is refused."""
        params = dict(params or {})
        unknown = sorted(set(params) - set(self.params))
        if unknown:
            raise FoldKvInputError(f"kernel {self.name} has no parameter {unknown}; its parameters are"
                                   f" {sorted(self.params)}")
        return {**self.params, **params}

    def build(self, geom: AttentionGeometry, **params: Any) -> Any:
        kwargs = self.arguments(params)
        if self.format is not None:
            kwargs["fmt"] = self.format
        return self.build_function()(geom, **kwargs)


_K = "foldkv.kernels."
# Decode partial: block_n = 64 tokens (the wgmma M). Folded: two stages of 80 KB fit in shared memory. Split: a
# 64-row tile is 128 KB, so one stage; K and V are separate buffers released separately (K after the score gemm, V
# after P V), so the next K load still overlaps the current softmax and P V. reduce_batch = the 4 queries a consumer
# thread holds: one barrier chain for all four instead of one each is the shorter tile (the same bits).
_DECODE_PARTIAL = {
    KvFormat.SPLIT: dict(page_size=64, block_n=64, num_stages=1, threads=128, block_h=16, reduce_batch=4),
    KvFormat.FOLDED: dict(page_size=64, block_n=64, num_stages=2, threads=128, block_h=16, reduce_batch=4),
}
# FP8 folded: two stages of the 40 KB e4m3 tiles and one set of their bf16 copies (80 KB) the gemms read. Two consumer
# warpgroups (threads=256): the conversion before each tile's gemms, not the bytes, sets the pace, and two convert a
# tile in half the time. reduce_batch = the 2 queries a consumer thread holds when two warpgroups split S's columns.
_DECODE_PARTIAL_FP8 = dict(page_size=64, block_n=64, num_stages=2, threads=256, block_h=16, reduce_batch=2)
# FP8 folded on FP8 tensor cores (decode_partial_fp8_tc.py): the value window transposed by the consumer ("t4x16":
# conflict-free), the query and P in two e4m3 parts (precise), two CTAs per SM with one stage of the 40 KB e4m3 tiles
# each (~99 KB of shared memory a CTA; two stages with two CTAs do not fit, ~245 KB). reduce_batch = the 4 query
# values a consumer thread holds.
_DECODE_PARTIAL_FP8_TC = dict(page_size=64, block_n=64, num_stages=1, block_h=16, reduce_batch=4, ctas_per_sm=2,
                              transpose="t4x16", precise=True)
_MERGE = dict(threads=128)
# Split prefill: its two 1,024-column windows (128 KiB) and the query (64 KiB) leave room for one stage. bf16 folded
# prefill: the seesaw with released halves and the lazy max (max_slack_log2): kernels/PREFILL_SCHEDULE.md.
_PREFILL_SPLIT = dict(page_size=64, block_N=64, num_stages=1, threads=256)
_PREFILL_FOLDED = dict(page_size=64, block_N=64, max_slack_log2=8.0)
# FP8 folded prefill: one stage of the row's five e4m3 panels (40 KiB) and its scales, the bf16 tiles the gemms read
# (80 KiB), the query (64 KiB) and P (8 KiB): 192.25 KiB of the 227 KiB; two stages of panels would take 232.5 KiB.
_PREFILL_FP8 = dict(page_size=64, block_N=64, num_stages=1, threads=256)
_DEQUANT_PAGES = dict(page_size=64, threads=128)  # memory-bound: one CTA per (page, KV head), 320 elements a thread

VARIANTS: tuple[KernelVariant, ...] = (
    *(KernelVariant(f"decode_partial_{f.value}", "decode_partial", f, _K + "decode_partial:build_decode_partial",
                    dict(_DECODE_PARTIAL[f])) for f in KvFormat),
    # the fused step of a one-wave plan is the partial with its tail merge: the partial's tiling
    *(KernelVariant(f"decode_fused_{f.value}", "decode_fused", f, _K + "decode_partial:build_decode_fused",
                    dict(_DECODE_PARTIAL[f])) for f in KvFormat),
    KernelVariant("decode_partial_folded_fp8", "decode_partial", KvFormat.FOLDED,
                  _K + "decode_partial:build_decode_partial_fp8", dict(_DECODE_PARTIAL_FP8)),
    KernelVariant("decode_partial_folded_fp8_tc", "decode_partial", KvFormat.FOLDED,
                  _K + "decode_partial_fp8_tc:build", dict(_DECODE_PARTIAL_FP8_TC)),
    KernelVariant("merge_groups", "merge_groups", None, _K + "merge:build_merge_groups", dict(_MERGE),
                  in_place_merge=True),
    KernelVariant("merge_final", "merge_final", None, _K + "merge:build_merge_final", dict(_MERGE)),
    KernelVariant("prefill_split", "prefill", KvFormat.SPLIT, _K + "prefill_attention:build", dict(_PREFILL_SPLIT)),
    KernelVariant("prefill_folded", "prefill", KvFormat.FOLDED, _K + "prefill_folded:build", dict(_PREFILL_FOLDED)),
    KernelVariant("prefill_folded_fp8", "prefill", KvFormat.FOLDED, _K + "prefill_attention:build_fp8",
                  dict(_PREFILL_FP8)),
    KernelVariant("dequant_pages_folded_fp8", "dequant_pages", KvFormat.FOLDED, _K + "dequant_pages:build",
                  dict(_DEQUANT_PAGES)),
)
_BY_NAME = {v.name: v for v in VARIANTS}
if len(_BY_NAME) != len(VARIANTS):
    raise ValueError(f"two kernel variants share a name: {[v.name for v in VARIANTS]}")


def all_variants() -> list[KernelVariant]:
    return list(VARIANTS)


def get(name: str) -> KernelVariant:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no kernel variant {name!r}; known: {sorted(_BY_NAME)}") from None


# --- the kernels this process handed out (for the provenance of the records it writes) ----------------------------
_HANDED_OUT: dict[tuple, dict] = {}


def note_kernel(name: str, backend: str, source_sha256: str, **details: Any) -> None:
    """Remember that this process built or loaded kernel `name` on `backend` from the CUDA source of that sha256
    (`details`: the cubin's sha256, the builder's arguments, ...), for the provenance of every record saved after."""
    key = (name, backend, source_sha256)
    entry = _HANDED_OUT.setdefault(key, {"name": name, "backend": backend, "source_sha256": source_sha256})
    entry.update({k: v for k, v in details.items() if v is not None})


def kernels_handed_out() -> list[dict]:
    """Every kernel noted so far, sorted by name and backend (copies)."""
    return [dict(_HANDED_OUT[key]) for key in sorted(_HANDED_OUT)]


def json_value(v: Any) -> Any:
    """A build argument as JSON data: a format or TVM scalar by its value, a geometry by its name, anything else
    unknown by its text."""
    if isinstance(v, KvFormat):
        return v.value
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, AttentionGeometry):
        return v.name
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    if isinstance(getattr(v, "value", None), (bool, int, float, str)):  # a tvm IntImm
        return v.value
    return str(v)


def hands_out(name: str) -> Callable:
    """Decorate a JIT builder so that every kernel it returns has its producer loops' guard checked
    (`producer_guard.check_producer_guard`) and is noted (`note_kernel`) under `name`, a template filled from the
    builder's arguments ("decode_partial_{fmt}")."""
    import functools
    import hashlib
    import inspect

    from .producer_guard import check_producer_guard

    def decorate(builder: Callable) -> Callable:
        sig = inspect.signature(builder)

        @functools.wraps(builder)
        def build(*args, **kwargs):
            kernel = builder(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            flat = {}
            for pname, value in bound.arguments.items():  # a **kwargs builder: its keywords, flattened
                if sig.parameters[pname].kind is inspect.Parameter.VAR_KEYWORD:
                    flat.update({k: json_value(v) for k, v in value.items()})
                else:
                    flat[pname] = json_value(value)
            kernel_name = name.format(**{k: v for k, v in flat.items() if isinstance(v, str)})
            source = kernel.get_kernel_source()
            check_producer_guard(kernel_name, source)  # a kernel cached or built without the rewrite never runs
            note_kernel(kernel_name, "jit", hashlib.sha256(source.encode()).hexdigest(),
                        builder=f"{builder.__module__}.{builder.__qualname__}", arguments=flat)
            return kernel

        build.hands_out = name  # lets a test check that every registered variant's builder is covered
        return build

    return decorate
