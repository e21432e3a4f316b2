"""One attention problem, built for every arm alike: the same raw projections prepped into each pool format, in
copies rotated past L2, with the query, the block table, its byte and FLOP counts and the float64 reference rows."""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch

from foldkv.lab import byte_floor as floor
from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.fp8 import FP8_DTYPE
from foldkv.layout import KvFormat
from foldkv.pool import BlockTable, PagedKvLayout, PagedKvPool
from foldkv.lab.gates.inputs import fill_sequences
from foldkv.prep import prep_query
from foldkv.reference import paged_attention_reference

from .peers import flashinfer_kv_from_split

L2_BYTES = 60 * 10**6  # the H200's L2
DEFAULT_ROTATE_BYTES = 4 * L2_BYTES
CHECK_ROWS = 192  # query rows the accuracy check compares at most (a spread sample of a long prefill chunk)


def ragged_lengths(batch: int, mean: int, seed: int = 0, spread: float = 0.75) -> list[int]:
    """`batch` request lengths drawn uniformly in mean x [1 - spread, 1 + spread], odd-sized (no page multiples)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=g, dtype=torch.float64)
    return [max(1, int(mean * (1 - spread + 2 * spread * float(x)))) | 1 for x in u]


SERVING_CASES = ("uniform8", "uniform32", "uniform64", "uniform128", "longtail64")
UNIFORM_TOKENS = (1024, 48 * 1024)  # a ragged batch's lengths, uniform in this range (inclusive)
LONGTAIL_SHORT, LONGTAIL_LONG = (1, 4096), (65536, 200_000)  # the long-tail mix: 9 short requests in 10, 1 long
LONGTAIL_EVERY = 10  # request i is long when i % LONGTAIL_EVERY == 0: exactly 10% of the batch, spread through it
SHORT_MANY_BATCH, SHORT_MANY_TOKENS = (100, 256), (1, 8192)  # "short_many": 100-256 requests of 1-8K
MIXED_BATCH, MIXED_TOKENS = (4, 8), (1, 150_000)  # "mixed": a handful of lengths spanning 1-150K (log strata)


def draw_shape(name: str, rng: random.Random) -> list[int]:
    """One batch of the named shape, drawn from `rng`: "uniform<B>" (B requests, lengths uniform in UNIFORM_TOKENS),
    "longtail<B>" (B requests; every LONGTAIL_EVERY-th uniform in LONGTAIL_LONG, the rest in LONGTAIL_SHORT),
    "short_many" (a batch size uniform in SHORT_MANY_BATCH, lengths in SHORT_MANY_TOKENS), "mixed" (a batch size n
    in MIXED_BATCH, one length log-uniform in each of n equal strata of log MIXED_TOKENS, in drawn order: the handful
    spans the range, its longest above MIXED_TOKENS[1] ** ((n - 1) / n), where independent draws could all be short).
    Raises ValueError for another name."""
    head = name.rstrip("0123456789")
    count = name[len(head):]
    if head == "uniform" and count:
        return [rng.randint(*UNIFORM_TOKENS) for _ in range(int(count))]
    if head == "longtail" and count:
        return [rng.randint(*(LONGTAIL_SHORT if i % LONGTAIL_EVERY else LONGTAIL_LONG)) for i in range(int(count))]
    if name == "short_many":
        return [rng.randint(*SHORT_MANY_TOKENS) for _ in range(rng.randint(*SHORT_MANY_BATCH))]
    if name == "mixed":
        lo, hi = (math.log(t) for t in MIXED_TOKENS)
        n = rng.randint(*MIXED_BATCH)
        width = (hi - lo) / n
        lens = [min(MIXED_TOKENS[1], max(1, round(math.exp(lo + width * (i + rng.random()))))) for i in range(n)]
        rng.shuffle(lens)
        return lens
    raise ValueError(f"unknown batch shape {name!r}: uniform<B>, longtail<B>, short_many or mixed")


def serving_cases(seed: int = 0, names: Sequence[str] | None = None, *, scale: float = 1.0) -> dict[str, list[int]]:
    """The fixed serving batches (kept for comparison across runs), by name (`draw_shape`). Every case is drawn from
    one seeded stream in SERVING_CASES order whatever `names` asks for, so a case's lengths depend on the seed only.
    `scale` < 1 shrinks every length (at least 1 token) for a pipeline check on the CPU; the batch sizes stay. Raises
    ValueError for an unknown name or a scale outside (0, 1]."""
    unknown = [n for n in (names or ()) if n not in SERVING_CASES]
    if unknown:
        raise ValueError(f"unknown serving case(s) {unknown}; expected some of {list(SERVING_CASES)}")
    rng = random.Random(seed)
    drawn = {name: draw_shape(name, rng) for name in SERVING_CASES}
    return {n: scaled(drawn[n], scale) for n in (names or SERVING_CASES)}


def scaled(lens: Sequence[int], scale: float) -> list[int]:
    """Lengths shrunk by `scale` in (0, 1] (at least 1 token each): a GPU-sized case made small for the CPU."""
    if not 0 < scale <= 1:
        raise ValueError(f"scale {scale}: expected 0 < scale <= 1")
    return [max(1, int(x * scale)) for x in lens]


def prefill_flops(chunk: int, context: int, geom: AttentionGeometry = GEMMA4_31B) -> int:
    """4 * C * (K - C/2) * Hq * D: scores and P.V (2 FLOPs per MAC each) over the causal triangle of a C-query chunk
    at the end of a K-token context."""
    if not 0 < chunk <= context:
        raise ValueError(f"chunk {chunk} must be in 1..context {context}")
    return int(4 * chunk * (context - chunk / 2) * geom.num_q_heads * geom.head_dim)


POOL_KINDS = ("split", "folded", "folded_fp8", "split_fp8")  # what an arm's bytes are counted in
KIND_ROWS = {"split": (KvFormat.SPLIT, torch.bfloat16), "folded": (KvFormat.FOLDED, torch.bfloat16),
             "folded_fp8": (KvFormat.FOLDED, FP8_DTYPE)}  # foldkv's pool kinds: (format, stored dtype)


def kind_bytes(geom: AttentionGeometry, kind: str, seq_lens: Sequence[int], q_lens: Sequence[int] | None = None) -> int:
    """`foldkv.lab.byte_floor.step_bytes` of a pool kind: "split" / "folded" (bf16), "folded_fp8" (foldkv's FP8 row with its
    scales), "split_fp8" (FlashInfer's e4m3 split pool, per-tensor scales: half the bf16 split pool's rows)."""
    if kind == "split_fp8":
        parts = floor.step_bytes(geom, KvFormat.SPLIT, seq_lens, q_lens=q_lens)
        return parts["total"] - parts["kv"] // 2
    if kind not in KIND_ROWS:
        raise ValueError(f"unknown pool kind {kind!r}: expected one of {list(POOL_KINDS)}")
    fmt, dtype = KIND_ROWS[kind]
    return floor.step_bytes(geom, fmt, seq_lens, q_lens=q_lens, dtype=dtype)["total"]


class AttentionCase:
    """One attention problem (requests of `seq_lens` tokens, `q_lens` queries each at their last positions) with its
    inputs built on demand per format: pool copies (same values, different memory), the query, the block table.
    Its methods take a `KvFormat` (parsed once by whoever took the format from a user: `generated_arm`,
    `workspace_arm`, a harness's command line), never a string."""

    def __init__(self, seq_lens: Sequence[int], *, device: torch.device | str, q_lens: Sequence[int] | None = None,
                 geom: AttentionGeometry = GEMMA4_31B, page_size: int = 64, seed: int = 0,
                 rotate_bytes: int = DEFAULT_ROTATE_BYTES, min_copies: int = 2, max_copies: int = 64,
                 fi_kv_layout: str = "NHD"):
        self.seq_lens = [int(n) for n in seq_lens]
        self.q_lens = [1] * len(self.seq_lens) if q_lens is None else [int(m) for m in q_lens]
        if len(self.q_lens) != len(self.seq_lens) or any(not 1 <= m <= n for m, n in zip(self.q_lens, self.seq_lens)):
            raise ValueError("q_lens must give 1 <= q_len <= seq_len for every request")
        self.device, self.geom, self.page_size, self.seed = torch.device(device), geom, page_size, seed
        self.rotate_bytes, self.min_copies, self.max_copies = rotate_bytes, min_copies, max_copies
        self.fi_kv_layout = fi_kv_layout
        g = torch.Generator(device="cpu").manual_seed(seed)
        d, hq = geom.head_dim, geom.num_q_heads
        # Norm weights near Gemma's scale, k small enough that scores have a std of a few units (a softmax that is
        # neither flat nor one-hot): the kernels' cost does not depend on it, the accuracy check does.
        self.q_norm_weight = (1 + 0.1 * torch.randn(d, generator=g)).to(self.device)
        self.k_norm_weight = (0.1 * (1 + 0.1 * torch.randn(d, generator=g))).to(self.device)
        tokens = sum(self.q_lens)
        self.raw_q = torch.randn(tokens, hq, d, generator=g).to(self.device, torch.bfloat16)  # [T, Hq, D]
        self.positions = torch.cat([torch.arange(n - m, n) for m, n in zip(self.q_lens, self.seq_lens)])  # [T]
        self._kv_seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
        self._pools: dict[KvFormat, list[PagedKvPool]] = {}
        self._fi: list[torch.Tensor] | None = None
        self._fi_fp8: tuple | None = None
        self._queries: dict[KvFormat, torch.Tensor] = {}
        self._table: BlockTable | None = None
        self._reference: dict[str, dict] = {}

    # --- sizes ---------------------------------------------------------------------------------------------------
    def layout(self, fmt: KvFormat, dtype: torch.dtype = torch.bfloat16) -> PagedKvLayout:
        pages = sum(-(-n // self.page_size) for n in self.seq_lens)
        return PagedKvLayout(self.geom, fmt, self.page_size, pages, dtype=dtype)

    def copies_for(self, fmt: KvFormat, dtype: torch.dtype = torch.bfloat16) -> int:
        """Copies so that a cycle through them reads at least rotate_bytes (so nothing is still in L2)."""
        return self._copies(self.layout(fmt, dtype))

    def _copies(self, lay: PagedKvLayout) -> int:
        one = max(1, lay.nbytes)
        return int(min(self.max_copies, max(self.min_copies, math.ceil(self.rotate_bytes / one))))

    def step_bytes(self, kind: str) -> int:
        """Bytes one step over this case moves at least in pool kind `kind` (`kind_bytes`: pool rows, query, output
        and LSE)."""
        return kind_bytes(self.geom, kind, self.seq_lens, self.q_lens)

    def flops(self) -> int:
        """The causal attention FLOPs of every request's query chunk (`prefill_flops`)."""
        return sum(prefill_flops(m, n, self.geom) for m, n in zip(self.q_lens, self.seq_lens))

    # --- inputs ----------------------------------------------------------------------------------------------------
    @property
    def table_cpu(self) -> BlockTable:
        if self._table is None:
            lay = self.layout(KvFormat.FOLDED)
            scratch = PagedKvPool(lay, device="meta")  # only the allocator: page ids, scattered
            self._table = scratch.allocate(self.seq_lens, scatter_seed=self.seed + 1, pad_pages=1)
        return self._table

    @property
    def table(self) -> BlockTable:
        return self.table_cpu.to(self.device)

    def pools(self, fmt: KvFormat, dtype: torch.dtype = torch.bfloat16) -> list[PagedKvPool]:
        """Pool copies of `fmt` stored as `dtype` (bf16; float8_e4m3fn for folded), the same raw projections."""
        key = fmt if dtype == torch.bfloat16 else (fmt, dtype)
        if key not in self._pools:
            lay = self.layout(fmt, dtype)
            first = PagedKvPool(lay, device=self.device)
            # Slots past a request's length hold finite garbage, as a reused page does in serving: an arm that reads
            # them into its softmax fails the check instead of passing on zeros.
            if lay.quantized:  # finite garbage: e4m3 values of a normal draw, scales around a row's
                tail = torch.Generator(device=self.device).manual_seed(self._kv_seed + 1)
                first.data.copy_(torch.randn(lay.shape, generator=tail, device=self.device).to(lay.dtype))
                first.scales.fill_(4.0 / 448)
            elif self.device.type == "cpu":  # its own generator: the raw kv below must not depend on the format
                tail = torch.Generator(device="cpu").manual_seed(self._kv_seed + 1)
                first.data.copy_(torch.randn(lay.shape, generator=tail).to(lay.dtype))
            else:
                first.data.normal_(generator=torch.Generator(device=self.device).manual_seed(self._kv_seed))
            g = torch.Generator(device=self.device).manual_seed(self._kv_seed)  # the same draws for every format
            kv = [torch.randn(n, self.geom.num_kv_heads, self.geom.head_dim, generator=g, device=self.device,
                              dtype=torch.bfloat16) for n in self.seq_lens]  # raw projections [n, Hkv, D]
            fill_sequences(first, self.table_cpu, kv, self.k_norm_weight)
            del kv
            copies = [first] + [PagedKvPool(lay, data=first.data.clone(),
                                            scales=None if first.scales is None else first.scales.clone())
                                for _ in range(self._copies(lay) - 1)]
            self._pools[key] = copies
        return self._pools[key]

    def query(self, fmt: KvFormat) -> torch.Tensor:
        """The prepped query [T, Hq, D] (bf16) in the format's form."""
        if fmt not in self._queries:
            self._queries[fmt] = prep_query(self.geom, fmt, self.raw_q, self.q_norm_weight, self.k_norm_weight,
                                            self.positions.to(self.device)).contiguous()
        return self._queries[fmt]

    def flashinfer_kv_fp8(self) -> tuple[list[torch.Tensor], float, float]:
        """FlashInfer's e4m3 split pool (per-tensor scales, as its FP8 decode takes them): (copies, k_scale,
        v_scale), each copy the bf16 FlashInfer pool divided by its K / V scale (amax / 448) and cast to e4m3."""
        if self._fi_fp8 is None:
            kv = self.flashinfer_kv()[0]
            ks, vs = (float(kv[:, i].abs().amax().float()) / 448.0 for i in (0, 1))
            first = torch.empty(kv.shape, dtype=FP8_DTYPE, device=kv.device)
            for lo in range(0, kv.shape[0], 1024):  # page blocks: no float32 copy of a pool that fills the card
                blk = kv[lo:lo + 1024].float()
                blk[:, 0] /= ks
                blk[:, 1] /= vs
                first[lo:lo + 1024] = blk.clamp_(-448, 448).to(FP8_DTYPE)
            self._fi_fp8 = ([first] + [first.clone() for _ in range(len(self.flashinfer_kv()) - 1)], ks, vs)
        return self._fi_fp8

    def flashinfer_kv(self) -> list[torch.Tensor]:
        """The split pool in FlashInfer's layout, one tensor per split copy."""
        if self._fi is None:
            split = self.pools(KvFormat.SPLIT)
            first = flashinfer_kv_from_split(split[0], self.fi_kv_layout)
            self._fi = [first] + [first.clone() for _ in range(len(split) - 1)]
        return self._fi

    def check_rows(self, max_rows: int = CHECK_ROWS) -> torch.Tensor:
        """Query rows the accuracy check compares: all of them for decode, a spread sample of a long chunk."""
        t = sum(self.q_lens)
        if t <= max_rows:
            return torch.arange(t)
        third = max_rows // 3
        g = torch.Generator().manual_seed(self.seed + 7)
        mid = torch.randperm(t - 2 * third, generator=g)[:third] + third
        return torch.cat([torch.arange(third), mid.sort().values, torch.arange(t - third, t)])

    def reference(self, kind: str = "split") -> dict:
        """`foldkv.paged_attention_reference` (float64) for the check rows: {"rows": idx [m], "out": [m, Hq, D]
        float64 head order, "lse": [m, Hq] float64 natural log}, over the pool of `kind`: "split" (bf16, the truth
        every bf16 arm is held to), "folded_fp8" (foldkv's FP8 pool, dequantized) or "split_fp8" (FlashInfer's e4m3
        pool, dequantized with its per-tensor scales). A checked row at position p of request r is asked as a one-query
        request over r's pages holding p + 1 tokens: the same causal answer, without the full chunk's score matrix."""
        if kind not in self._reference:
            table, rows = self.table_cpu, self.check_rows()
            request = torch.repeat_interleave(torch.arange(len(self.q_lens)), torch.tensor(self.q_lens))  # [T]
            sub = BlockTable(table.page_ids[request[rows]].contiguous(),
                             (self.positions[rows] + 1).to(torch.int32))
            fmt = KvFormat.FOLDED if kind == "folded_fp8" else KvFormat.SPLIT
            query = self.query(fmt)[rows.to(self.device)]  # [m, Hq, D]
            if kind == "split":
                pool = self.pools(KvFormat.SPLIT)[0]
            elif kind == "folded_fp8":
                pool = self.pools(KvFormat.FOLDED, FP8_DTYPE)[0]
            else:
                pool = self._split_from_fi_fp8()
            out, lse = paged_attention_reference(pool, query, sub, fmt=fmt)
            self._reference[kind] = {"rows": rows, "out": out, "lse": lse}
        return self._reference[kind]

    def _split_from_fi_fp8(self) -> PagedKvPool:
        """FlashInfer's e4m3 pool dequantized into a foldkv split pool of the same pages, in bf16 (each value's
        rounding, 2^-8 relative, is far inside the arm check's CHECK_REL_TOL), a block of pages at a time: a float32
        copy of a 128-request pool does not fit beside the case's other pools."""
        copies, ks, vs = self.flashinfer_kv_fp8()
        kv8 = copies[0]
        lay = self.layout(KvFormat.SPLIT)
        data = torch.empty(lay.shape, dtype=torch.bfloat16, device=kv8.device)  # [pages, Hkv, P, 2D]
        d = self.geom.head_dim
        for lo in range(0, kv8.shape[0], 1024):
            blk = kv8[lo:lo + 1024].float()
            if self.fi_kv_layout == "NHD":  # [pages, 2, P, Hkv, D] -> [pages, 2, Hkv, P, D]
                blk = blk.transpose(2, 3)
            data[lo:lo + 1024, ..., :d] = (blk[:, 0] * ks).to(torch.bfloat16)
            data[lo:lo + 1024, ..., d:] = (blk[:, 1] * vs).to(torch.bfloat16)
        return PagedKvPool(lay, data=data)

    def release(self) -> None:
        self._pools.clear()
        self._fi = None
        self._fi_fp8 = None
        self._queries.clear()
        self._reference = {}
