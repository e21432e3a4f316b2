"""The lab's figure palette: one colour, marker and line style per arm, the same arm the same style in every figure
of every notebook, and the check that no two arms of one figure share a colour.

Families read at a glance: foldkv folded in blues, folded over the FP8 pool in purples, split in greens, FlashInfer in
oranges and reds, plain reads and roofs in grey dashed lines, torch and transformers' own attention in black, limits
(targets, bounds, the drift line) in dark red dashed. The base hues are Okabe-Ito's colour-blind-safe set; an arm's
shade inside its family, with its marker, tells the arms of a family apart. A colour is unique among the arms that
can share a figure (one registry's, tests/test_palette.py); across registries that never meet, kin share one: notebook
04's plain torch and notebook 05's sdpa are both black.

A name an arm goes by elsewhere (notebook 05's `foldkv-folded`, the drift study's `folded`, a format's `split`) is
an alias of the entry whose kernel or format it is: it draws in that entry's style, and artists carry the entry's name
as their gid, so a figure that shows the format and its arm together is one series' colour, not a clash.

A name in no entry (a series that is no arm, such as notebook 02's operand spreads, or an arm added without an entry)
gets, inside one `Styles` (one figure), the next colour of `FALLBACK` that figure has not given out, in the order the
figure first asks for the names: no entry uses a `FALLBACK` colour, so a fallback never collides with an arm, and two
unknown names of one figure never collide with each other. The same names asked in the same order get the same
colours; past `len(FALLBACK)` unknown names in one figure `Styles` refuses with the names to add.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class ArmStyle:
    color: str  # "#rrggbb"
    marker: str = "o"
    linestyle: str = "-"
    linewidth: float = 1.6
    family: str = ""


def _family(family: str, linestyle: str = "-", **entries: tuple[str, str]) -> dict[str, ArmStyle]:
    return {name: ArmStyle(color, marker, linestyle, family=family) for name, (color, marker) in entries.items()}


ARM_STYLES: dict[str, ArmStyle] = {
    # foldkv folded over bf16 pools: blues (the served kernel the Okabe-Ito blue)
    **_family("folded", folded_jit=("#0072B2", "o"), folded_aot=("#56B4E9", "s"), folded_graph=("#08306B", "D")),
    "foldkv-folded-eager": ArmStyle("#7B9FCF", "v", "-.", family="folded"),
    "ref-folded": ArmStyle("#9ECAE1", "^", "--", family="folded"),
    # foldkv folded over the FP8 pool: purples
    **_family("folded_fp8", folded_fp8_jit=("#CC79A7", "o"), folded_fp8_aot=("#E7B5D0", "s"),
              folded_fp8_exact_jit=("#7A3E6E", "D"), folded_fp8_in_kernel_jit=("#A6509A", "^")),
    "ref-folded-fp8": ArmStyle("#D4A6C8", "v", "--", family="folded_fp8"),
    # foldkv split: greens
    **_family("split", split_jit=("#009E73", "o"), split_aot=("#66C2A5", "s"), split_graph=("#00573F", "D")),
    "ref-split": ArmStyle("#A1D99B", "^", "--", family="split"),
    # FlashInfer: oranges and reds
    **_family("flashinfer", fi_tc=("#D55E00", "o"), fi_cuda=("#E69F00", "s"), fi_tc_fp8=("#8C2D04", "D"),
              fi_prefill=("#F4A582", "^")),
    # plain reads of the pool's bytes and byte floors: greys, dashed
    **_family("read", "--", read_folded=("#7F7F7F", "."), read_split=("#BDBDBD", "."),
              read_folded_fp8=("#A58AA0", ".")),
    # plain torch and transformers' own attention: black
    "torch": ArmStyle("#000000", "o", "-", family="torch"),
    "torch_folded": ArmStyle("#525252", "x", ":", family="torch"),
    "sdpa": ArmStyle("#000000", "o", "-", family="torch"),
    "sdpa-static-compile": ArmStyle("#525252", "*", "-.", family="torch"),
    "neutral": ArmStyle("#000000", "o", "-", 2.5, family="torch"),
    # what a measurement is held to: a target, a bound, the drift line
    "limit": ArmStyle("#C00000", "_", "--", family="limit"),
}

ALIASES: dict[str, str] = {
    # formats (notebooks 01, 02, 04's pool panel, 05's cache bytes) and the drift study's kernel arms
    "folded": "folded_jit", "split": "split_jit", "folded-fp8": "folded_fp8_jit",
    "folded-fp8-exact": "folded_fp8_exact_jit",
    # notebook 05's and 06's model arms
    "foldkv-folded": "folded_jit", "foldkv-fp8": "folded_fp8_jit", "foldkv-split": "split_jit",
    "flashinfer": "fi_tc",  # the model's FlashInfer decode runs on tensor cores (flashinfer_model)
    # transformers' own attention and cache
    "incumbent": "sdpa", "dynamic-cache": "sdpa",
    # the byte floor of notebook 05's folded arm: the folded pool's bytes at the read roof
    "floor": "read_folded",
    "target": "limit", "bound": "limit", "drift line": "limit",
}

# Colours for names in no entry, strongest first: matplotlib's tab10, then tab20's light and tab20b's dark shades
# (none is an entry's colour: tests/test_palette.py).
FALLBACK: tuple[str, ...] = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
    "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#393b79",
    "#637939", "#8c6d31", "#843c39", "#7b4173", "#5254a3", "#8ca252", "#bd9e39", "#ad494a", "#a55194")
FALLBACK_MARKERS = ("o", "s", "D", "^", "v", "P", "X", "*", "h", "<", ">")


def canonical(name: str, table: Mapping[str, ArmStyle] | None = None) -> str | None:
    """The entry `name` draws in (itself or the entry it is an alias of), or None when it has none."""
    table = ARM_STYLES if table is None else table
    name = ALIASES.get(name, name)
    return name if name in table else None


class Styles:
    """The styles of one figure: `line`, `bar`, `scatter` and `step` give matplotlib keywords for a name (colour,
    marker, line style, and the gid the clash check reads), the entry's style for a known name, a fallback no other
    name of this figure has for an unknown one."""

    def __init__(self, table: Mapping[str, ArmStyle] | None = None):
        self.table = ARM_STYLES if table is None else table
        self._fallback: dict[str, ArmStyle] = {}

    def key(self, name: str) -> str:
        """The gid of `name`'s artists: its entry's name, or the name itself when it has none."""
        return canonical(name, self.table) or name

    def style(self, name: str) -> ArmStyle:
        known = canonical(name, self.table)
        if known is not None:
            return self.table[known]
        if name not in self._fallback:
            i = len(self._fallback)
            if i == len(FALLBACK):
                raise ValueError(f"more than {len(FALLBACK)} names without a palette entry in one figure: add entries "
                                 f"to foldkv.lab.palette.ARM_STYLES for {sorted(self._fallback) + [name]}")
            self._fallback[name] = ArmStyle(FALLBACK[i], FALLBACK_MARKERS[i % len(FALLBACK_MARKERS)],
                                            family="fallback")
        return self._fallback[name]

    def color(self, name: str) -> str:
        return self.style(name).color

    def line(self, name: str, **override: Any) -> dict:
        """Keywords of `ax.plot` (or `axhline`) for `name`; `override` replaces any of them."""
        s = self.style(name)
        return {"color": s.color, "marker": s.marker, "linestyle": s.linestyle, "linewidth": s.linewidth,
                "gid": self.key(name), **override}

    def step(self, name: str, **override: Any) -> dict:
        """Keywords of `ax.step` or a step histogram (`histtype="step"`): colour, line style and width, no marker."""
        s = self.style(name)
        return {"color": s.color, "linestyle": s.linestyle, "linewidth": s.linewidth, "gid": self.key(name),
                **override}

    def bar(self, name: str, **override: Any) -> dict:
        """Keywords of `ax.bar` / `ax.barh`: the fill colour, a hatch for a dashed (read or reference) entry."""
        s = self.style(name)
        return {"color": s.color, "hatch": "//" if s.linestyle == "--" else None, "edgecolor": "white",
                "linewidth": 0.3, "gid": self.key(name), **override}

    def scatter(self, name: str, **override: Any) -> dict:
        """Keywords of `ax.scatter`."""
        s = self.style(name)
        return {"color": s.color, "marker": s.marker, "gid": self.key(name), **override}


def legend_beside(fig: Any, axes: Iterable[Any] | None = None, loc: str = "outside right upper", **kw: Any) -> Any:
    """One legend for the figure outside every axes (`loc` one of constrained layout's "outside ..." places: the
    figure needs layout="constrained"): the labelled artists of `axes` (all the figure's by default), each label once,
    in drawing order. None when nothing is labelled."""
    seen: dict[str, Any] = {}
    for ax in fig.axes if axes is None else axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    if not seen:
        return None
    return fig.legend(list(seen.values()), list(seen), loc=loc, fontsize=8, **kw)


def finish_batch_panels(fig: Any, axes: Iterable[Any], batches: Iterable[Any], path: str | None = None) -> Any:
    """A figure of one panel a batch, finished: each panel titled by its batch and gridded, the legend beside them
    (`legend_beside`), saved at `path` when given. Returns the figure."""
    for ax, b in zip(axes, batches):
        ax.set_title(f"batch {b}")
        ax.grid(True, alpha=0.3)
    legend_beside(fig, axes)
    if path:
        fig.savefig(path, dpi=90)
    return fig


def legend_right_of(ax: Any, **kw: Any) -> Any:
    """The axes' own legend just right of it, outside its data (constrained layout makes the room); None when
    nothing is labelled."""
    if not ax.get_legend_handles_labels()[0]:
        return None
    return ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8, **kw)


# --- the check: artists' colours read back from a drawn figure ------------------------------------------------------
def _colours(artist: Any) -> list[str]:
    """The colours an artist shows, as "#rrggbb" (alpha dropped): a line's colour, a patch's face (its edge when
    unfilled, as a step histogram's), a collection's faces (or edges when it has none)."""
    from matplotlib import collections, colors, lines, patches

    if isinstance(artist, lines.Line2D):
        raw = [artist.get_color()]
    elif isinstance(artist, patches.Patch):
        raw = [artist.get_facecolor() if artist.get_fill() else artist.get_edgecolor()]
    elif isinstance(artist, collections.Collection):
        face = artist.get_facecolor()
        raw = list(face) if len(face) else list(artist.get_edgecolor())
    else:
        return []
    return sorted({colors.to_hex(c, keep_alpha=False) for c in raw if colors.to_rgba(c)[3] > 0})


def _artists(fig: Any) -> list[Any]:
    return [a for ax in fig.axes for a in (*ax.lines, *ax.patches, *ax.collections)]


def colour_clashes(fig: Any) -> dict[str, list[str]]:
    """{colour: the names} for every colour that artists of two or more names show in `fig` (names read from the
    artists' gids, set by `Styles`); empty when every name of the figure has a colour of its own."""
    names: dict[str, set[str]] = {}
    for a in _artists(fig):
        gid = a.get_gid()
        if gid is None:
            continue
        for c in _colours(a):
            names.setdefault(c, set()).add(gid)
    return {c: sorted(n) for c, n in names.items() if len(n) > 1}


def unstyled(fig: Any) -> list[str]:
    """Legend labels of `fig` whose artists no `Styles` drew (no gid): series whose colour the palette does not
    set, which `colour_clashes` cannot see."""
    return sorted({a.get_label() for a in _artists(fig)
                   if a.get_gid() is None and a.get_label() and not a.get_label().startswith("_")})


__all__ = ["ArmStyle", "ARM_STYLES", "ALIASES", "FALLBACK", "canonical", "Styles", "legend_beside", "finish_batch_panels",
           "legend_right_of",
           "colour_clashes", "unstyled"]
