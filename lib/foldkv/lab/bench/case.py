"""One attention problem, built for every arm alike: the same raw projections prepped into each pool format, in
copies rotated past L2, with the query, the block table, its byte and FLOP counts and the float64 reference rows."""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch

from foldkv import floor
from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.layout import KvFormat
from foldkv.pool import BlockTable, PagedKvLayout, PagedKvPool
from foldkv.prep import fill_sequences, prep_query
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


def serving_cases(seed: int = 0, names: Sequence[str] | None = None, *, scale: float = 1.0) -> dict[str, list[int]]:
    """The batches a server sees (issue 14's decode cases), by name: "uniform<B>" (B requests, lengths uniform in
    UNIFORM_TOKENS) and "longtail64" (64 requests; every LONGTAIL_EVERY-th uniform in LONGTAIL_LONG, the rest in
    LONGTAIL_SHORT). Every case is drawn from one seeded stream in SERVING_CASES order whatever `names` asks for, so a
    case's lengths depend on the seed only. `scale` < 1 shrinks every length (at least 1 token) for a pipeline check
    on the CPU; the batch sizes stay. Raises ValueError for an unknown name or a scale outside (0, 1]."""
    unknown = [n for n in (names or ()) if n not in SERVING_CASES]
    if unknown:
        raise ValueError(f"unknown serving case(s) {unknown}; expected some of {list(SERVING_CASES)}")
    if not 0 < scale <= 1:
        raise ValueError(f"scale {scale}: expected 0 < scale <= 1")
    rng = random.Random(seed)
    drawn: dict[str, list[int]] = {}
    for name in SERVING_CASES:
        if name.startswith("uniform"):
            drawn[name] = [rng.randint(*UNIFORM_TOKENS) for _ in range(int(name[len("uniform"):]))]
        else:
            batch = int(name[len("longtail"):])
            drawn[name] = [rng.randint(*(LONGTAIL_SHORT if i % LONGTAIL_EVERY else LONGTAIL_LONG))
                           for i in range(batch)]
    return {n: [max(1, int(x * scale)) for x in drawn[n]] for n in (names or SERVING_CASES)}


def prefill_flops(chunk: int, context: int, geom: AttentionGeometry = GEMMA4_31B) -> int:
    """4 * C * (K - C/2) * Hq * D: scores and P.V (2 FLOPs per MAC each) over the causal triangle of a C-query chunk
    at the end of a K-token context."""
    if not 0 < chunk <= context:
        raise ValueError(f"chunk {chunk} must be in 1..context {context}")
    return int(4 * chunk * (context - chunk / 2) * geom.num_q_heads * geom.head_dim)


class AttentionCase:
    """One attention problem (requests of `seq_lens` tokens, `q_lens` queries each at their last positions) with its
    inputs built on demand per format: pool copies (same values, different memory), the query, the block table."""

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
        self._queries: dict[KvFormat, torch.Tensor] = {}
        self._table: BlockTable | None = None
        self._reference: dict | None = None

    # --- sizes ---------------------------------------------------------------------------------------------------
    def layout(self, fmt: KvFormat | str) -> PagedKvLayout:
        pages = sum(-(-n // self.page_size) for n in self.seq_lens)
        return PagedKvLayout(self.geom, KvFormat.parse(fmt), self.page_size, pages)

    def copies_for(self, fmt: KvFormat | str) -> int:
        """Copies so that a cycle through them reads at least rotate_bytes (so nothing is still in L2)."""
        one = max(1, self.layout(fmt).nbytes)
        return int(min(self.max_copies, max(self.min_copies, math.ceil(self.rotate_bytes / one))))

    def step_bytes(self, fmt: KvFormat | str) -> int:
        """Bytes one step over this case moves at least in `fmt` (`foldkv.floor.step_bytes`: pool rows, query,
        output and LSE)."""
        return floor.step_bytes(self.geom, fmt, self.seq_lens, q_lens=self.q_lens)["total"]

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

    def pools(self, fmt: KvFormat | str) -> list[PagedKvPool]:
        fmt = KvFormat.parse(fmt)
        if fmt not in self._pools:
            lay = self.layout(fmt)
            first = PagedKvPool(lay, device=self.device)
            # Slots past a request's length hold finite garbage, as a reused page does in serving: an arm that reads
            # them into its softmax fails the check instead of passing on zeros.
            if self.device.type == "cpu":  # its own generator: the raw kv below must not depend on the format
                tail = torch.Generator(device="cpu").manual_seed(self._kv_seed + 1)
                first.data.copy_(torch.randn(lay.shape, generator=tail).to(lay.dtype))
            else:
                first.data.normal_(generator=torch.Generator(device=self.device).manual_seed(self._kv_seed))
            g = torch.Generator(device=self.device).manual_seed(self._kv_seed)  # the same draws for every format
            kv = [torch.randn(n, self.geom.num_kv_heads, self.geom.head_dim, generator=g, device=self.device,
                              dtype=torch.bfloat16) for n in self.seq_lens]  # raw projections [n, Hkv, D]
            fill_sequences(first, self.table_cpu, kv, self.k_norm_weight)
            del kv
            copies = [first] + [PagedKvPool(lay, data=first.data.clone()) for _ in range(self.copies_for(fmt) - 1)]
            self._pools[fmt] = copies
        return self._pools[fmt]

    def query(self, fmt: KvFormat | str) -> torch.Tensor:
        """The prepped query [T, Hq, D] (bf16) in the format's form."""
        fmt = KvFormat.parse(fmt)
        if fmt not in self._queries:
            self._queries[fmt] = prep_query(self.geom, fmt, self.raw_q, self.q_norm_weight, self.k_norm_weight,
                                            self.positions.to(self.device)).contiguous()
        return self._queries[fmt]

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

    def reference(self) -> dict:
        """`foldkv.paged_attention_reference` (float64) on the split pool for the check rows: {"rows": idx [m],
        "out": [m, Hq, D] float64 head order}. A checked row at position p of request r is asked as a one-query
        request over r's pages holding p + 1 tokens: the same causal answer, without the full chunk's score matrix."""
        if self._reference is None:
            table, rows = self.table_cpu, self.check_rows()
            request = torch.repeat_interleave(torch.arange(len(self.q_lens)), torch.tensor(self.q_lens))  # [T]
            sub = BlockTable(table.page_ids[request[rows]].contiguous(),
                             (self.positions[rows] + 1).to(torch.int32))
            query = self.query(KvFormat.SPLIT)[rows.to(self.device)]  # [m, Hq, D]
            out, _ = paged_attention_reference(self.pools(KvFormat.SPLIT)[0], query, sub, fmt=KvFormat.SPLIT)
            self._reference = {"rows": rows, "out": out}
        return self._reference

    def release(self) -> None:
        self._pools.clear()
        self._fi = None
        self._queries.clear()
        self._reference = None
