"""The gates' inputs: the cases (decode, prefill), one seed's raw projections prepped into a hostile pool (pages
scattered, unused pages of NaN and Inf, page-table padding of poison ids) and poisoned output buffers."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from ...config import GEMMA4_31B, AttentionGeometry
from ...layout import KvFormat
from ...pool import BlockTable, PagedKvLayout, PagedKvPool, check_pool_storage
from ...fp8 import check_finite_rows
from ...prep import FLOAT_TYPES, prep_query, prep_rows, store_rows
from ...validate import FoldKvInputError, check_tensor
from .geometry import gate_geometry
POISON_PAGE_IDS = (-(2**31), 2**31 - 1, -1)  # entries past the real ones in page tables and plans
OUT_POISON = float("nan")


def write_tokens(pool: PagedKvPool, table: BlockTable, request: torch.Tensor, positions: torch.Tensor,
                 rows: torch.Tensor) -> None:
    """Store already-prepped rows [T, Hkv, row_width] (pool.layout.row_dtype; an FP8 pool quantizes them) at the
    tokens' (request, position) slots."""
    geom = pool.geometry
    check_pool_storage(pool)
    check_tensor("rows", rows, dtype=pool.layout.row_dtype, device=pool.device,
                 shape=(positions.shape[0], geom.num_kv_heads, pool.layout.row_width))
    pages, offsets = pool.token_slots(table, request, positions)
    store_rows(pool, pages, offsets, rows)


def fill_sequences(pool: PagedKvPool, table: BlockTable, kv: list[torch.Tensor], k_norm_weight: torch.Tensor) -> None:
    """Prep and store whole sequences: kv[r] [seq_len_r, Hkv, D] raw projections (float32/bf16/fp16/float64, any
    device) at positions 0..seq_len_r-1, one per request of `table`, seq_len_r == table.seq_lens[r].
    k_norm_weight: [D] float, any device. Rows are prepped on kv[r]'s device and stored in the pool's dtype (an FP8
    pool's quantized by `foldkv.fp8.quantize_rows`). Shapes, and for an FP8 pool NaN/Inf inputs, are refused before
    the first write."""
    geom = pool.geometry
    if len(kv) != table.batch:
        raise FoldKvInputError(f"{len(kv)} sequences for a block table of {table.batch} requests")
    for r, x in enumerate(kv):
        if x.shape[0] != int(table.seq_lens[r]):
            raise FoldKvInputError(f"sequence {r} has {x.shape[0]} tokens, its block table says {int(table.seq_lens[r])}")
    check_tensor("k_norm_weight", k_norm_weight, dtype=FLOAT_TYPES, shape=(geom.head_dim,))
    for r, x in enumerate(kv):
        check_tensor(f"kv[{r}]", x, dtype=FLOAT_TYPES, shape=(None, geom.num_kv_heads, geom.head_dim))
        if pool.layout.quantized:
            check_finite_rows(x)
    for r, x in enumerate(kv):
        n = x.shape[0]
        pos = torch.arange(n, device=x.device)
        rows = prep_rows(geom, pool.format, x, k_norm_weight.to(x.device), pos, out_dtype=pool.layout.row_dtype)
        write_tokens(pool, table, torch.full((n,), r, dtype=torch.long), pos.cpu(), rows.to(pool.device))


@dataclass(frozen=True)
class Case:
    """One gate: a batch of requests (`seq_lens`), each with `q_lens` queries at its end (1 = decode).

    `score_scale` scales the q_norm weight: large gives peaked attention (large scores), small gives spread attention.
    """

    name: str
    seq_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None  # None: decode
    chunk_tokens: int | None = None  # decode chunking override (to put a length on a chunk boundary)
    merge_group: int | None = None  # decode merge-group override (more merge groups than the default plan makes)
    score_scale: float = 1.0
    scattered: bool = True

    @property
    def kind(self) -> str:
        return "decode" if self.q_lens is None else "prefill"

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    def as_dict(self) -> dict:
        return asdict(self)


def decode_cases(size: str = "full") -> list[Case]:
    """At least eight decode cases: lengths 1, 63, 64, 65, a chunk boundary +-1, 10,602, 163,336, ragged batches of 4,
    32, 64 and 128 requests (the last two with 1, 63, 64, 65 and 262,144 tokens among them), peaked and spread. `size="smoke"` keeps the shapes, shrinks the long lengths."""
    long_a, long_b = (10602, 163336) if size == "full" else (1000, 4097)
    g = torch.Generator().manual_seed(2026)
    ragged32 = tuple(int(x) for x in torch.randint(1, 20000 if size == "full" else 700, (32,), generator=g))
    # 64 and 128 requests: the edges (1, 63, 64, 65 tokens, the longest context) among random lengths
    edges = (1, 63, 64, 65, 262144 if size == "full" else 4097)
    ragged64, ragged128 = (edges + tuple(int(x) for x in torch.randint(1, 20000 if size == "full" else 700, (n - 5,),
                                                                        generator=g)) for n in (64, 128))
    return [
        Case("len1", (1,)),
        Case("len63", (63,)),
        Case("len64", (64,)),
        Case("len65", (65,)),
        Case("chunk-1", (255,), chunk_tokens=128),
        Case("chunk+0", (256,), chunk_tokens=128),
        Case("chunk+1", (257,), chunk_tokens=128),
        Case(f"len{long_a}", (long_a,)),
        Case(f"len{long_b}", (long_b,)),
        Case("ragged4", (1, 97, 16384 if size == "full" else 640, 54)),
        Case("ragged32", ragged32),
        Case("ragged64", ragged64),
        Case("ragged128", ragged128),
        Case("peaked", (4096 if size == "full" else 300,), score_scale=4.0),
        Case("spread", (4096 if size == "full" else 300,), score_scale=0.05),
    ]


def prefill_cases(size: str = "full") -> list[Case]:
    """At least six prefill cases: a chunk starting mid-page, a one-token chunk, an 8,192 chunk ending at 163,336,
    a ragged batch, peaked and spread."""
    big_ctx, big_chunk = (163336, 8192) if size == "full" else (3000, 256)
    return [
        Case("mid-page", (1000,), q_lens=(77,)),  # starts at 923 = page 14 + 27
        Case("one-token", (4097,), q_lens=(1,)),
        Case("whole-seq", (300,), q_lens=(300,)),
        Case(f"chunk{big_chunk}@{big_ctx}", (big_ctx,), q_lens=(big_chunk,)),
        Case("ragged", (97, 2000, 64, 513), q_lens=(54, 129, 64, 1)),
        Case("peaked", (1500,), q_lens=(200,), score_scale=4.0),
        Case("spread", (1500,), q_lens=(200,), score_scale=0.05),
    ]


@dataclass
class GateInputs:
    """Everything a gate needs, made from one seed: raw projections through the torch prep into a hostile pool."""

    case: Case
    format: KvFormat
    pool: PagedKvPool
    table: BlockTable  # on the pool's device; padded past each request's pages with poison
    query: torch.Tensor  # [sum(q_lens), Hq, D] in the format's form
    q_lens: torch.Tensor | None
    raw: dict = field(repr=False, default_factory=dict)  # the raw projections (to build the other format)


def require_parsed(fmt: KvFormat, dtype: torch.dtype) -> None:
    """Refuse a format or dtype still in its text form: the gates take them parsed (at their public boundary)."""
    if not isinstance(fmt, KvFormat):
        raise TypeError(f"fmt={fmt!r}: a KvFormat (KvFormat.parse it where it comes in)")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r}: a torch.dtype")


def case_q_lens(case: Case) -> list[int]:
    return list(case.q_lens) if case.q_lens is not None else [1] * len(case.seq_lens)


def make_inputs(case: Case, fmt: KvFormat, device: torch.device | str, seed: int,
                geom: AttentionGeometry | str = GEMMA4_31B, raw: dict | None = None, spare_pages: int = 3,
                dtype: torch.dtype = torch.bfloat16) -> GateInputs:
    """A hostile pool for `case`: pages scattered, unused pages holding NaN and Inf (an FP8 pool: NaN rows, and NaN
    and Inf scales), page-table padding holding out-of-range and huge negative ids. `raw` reuses another format's
    raw projections (folded vs split). `fmt` and `dtype` (the pool's stored dtype: bf16, or float8_e4m3fn for
    folded) as parsed at the gates' public boundary (`KvFormat.parse` of a notebook's format names). `geom`: a
    geometry or preset name the kernels serve (`gate_geometry`), e.g. one rank's "gemma-4-31b-tp2"."""
    require_parsed(fmt, dtype)
    geom = gate_geometry(geom)
    device = torch.device(device)
    lay = PagedKvLayout(geom, fmt, page_size=64, num_pages=sum(-(-n // 64) for n in case.seq_lens) + spare_pages,
                        dtype=dtype)
    pool = PagedKvPool(lay, device=device)
    pool.data.fill_(float("nan"))
    if lay.quantized:
        pool.scales.fill_(float("nan"))
    table = pool.allocate(case.seq_lens, scatter_seed=seed if case.scattered else None, pad_pages=len(POISON_PAGE_IDS))
    last_unused = pool.unused_page_ids()[-1]
    if lay.quantized:  # e4m3fn has no Inf: an unused page of NaN rows with Inf scales
        pool.scales[last_unused].fill_(float("inf"))
    else:
        pool.data[last_unused].fill_(float("inf"))  # an unused page of Inf beside the NaN ones
    for r in range(table.batch):  # poison past each request's real pages
        n = -(-int(table.seq_lens[r]) // 64)
        for i, v in enumerate(POISON_PAGE_IDS):
            table.page_ids[r, n + i] = v
        table.page_ids[r, n + len(POISON_PAGE_IDS):] = POISON_PAGE_IDS[0]
    q_lens = case_q_lens(case)
    if raw is None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        raw = {
            "kv": [torch.randn(n, geom.num_kv_heads, geom.head_dim, generator=g) for n in case.seq_lens],
            "q": torch.randn(sum(q_lens), geom.num_q_heads, geom.head_dim, generator=g),
            "q_norm_weight": (torch.rand(geom.head_dim, generator=g) * 0.5 + 0.75) * case.score_scale * 0.25,
            "k_norm_weight": torch.rand(geom.head_dim, generator=g) * 0.5 + 0.75,
        }
    fill_sequences(pool, table, [x.to(device) for x in raw["kv"]], raw["k_norm_weight"].to(device))
    positions = torch.cat([torch.arange(n - m, n) for n, m in zip(case.seq_lens, q_lens)]).to(device)
    query = prep_query(geom, fmt, raw["q"].to(device), raw["q_norm_weight"].to(device),
                       raw["k_norm_weight"].to(device), positions).contiguous()
    return GateInputs(case, fmt, pool, table.to(device), query,
                      None if case.q_lens is None else torch.tensor(q_lens, dtype=torch.int32), raw)


def poisoned_outputs(tokens: int, geom: AttentionGeometry, device, pad_rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Output buffers with `pad_rows` extra rows past the plan; everything starts as NaN."""
    out = torch.full((tokens + pad_rows, geom.num_q_heads, geom.head_dim), OUT_POISON, dtype=torch.bfloat16, device=device)
    lse = torch.full((tokens + pad_rows, geom.num_q_heads), OUT_POISON, dtype=torch.float32, device=device)
    return out, lse


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)
