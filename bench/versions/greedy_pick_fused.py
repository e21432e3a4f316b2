"""Each token's greedy pick in two Triton launches: the processors' EOS mask, the argmax and the padding of finished
sequences, read from the model's bf16 logits.

What it tries (MODEL_DECODE_NOTES "Run 29: prediction"; written before any GPU run): between two replays of the step
the thin loop (`foldkv.hf_loop`) picks the next tokens in stream order, `hf_loop.pick_tokens` as `_sample` picks
them: the last position's logits copied to float32, the processors (the cells' min_new_tokens: a clone, an arange, an
isin and, below the minimum, a where, over the 262,144-column vocabulary), the argmax, the padding (a mul, a rsub, a
mul, an add): ~11 kernels before the ids exist, ~22-30 us at one row and ~40-50 at eight (the float32 copies are 8 MB
each there). Here a greedy call whose processors only set EOS columns to -inf (transformers' MinNewTokensLength and
MinLength: the processors a greedy generate() gets without penalties or bad words) is picked by two launches:
`pick_chunks` (B x ceil(V / 4,096) programs) reads the logits in their own dtype (bf16 to float32 is exact), sets the
active processors' EOS columns to -inf (which are active is the host's test on the prompt's length, as theirs is:
no sync), and writes each chunk's maximum and its first index (a NaN first: torch.argmax ranks NaN above every
number and takes the first); `pick_rows` (B programs) takes the first chunk holding the row's maximum, pads a finished
sequence with `_sample`'s formula and writes the int64 ids. The same tokens as the library's pick; any other call
(sampling, another processor, more than EOS_MAX EOS ids, logits off CUDA or strided in the vocabulary) goes to the
library's pick, the reason counted.

Prediction: **-0.015 to -0.025 ms of TPOT at 4K x 1 and 32K x 1, -0.03 to -0.04 at 4K x 8**, the device step
unchanged; with run 26's side-stream check (which calls `hf_loop.pick_tokens`, this version's patch point) -0.045 to
-0.09. What proves it wrong: TPOT - device step not down by >= 0.01 ms at 4K x 1 (the pick's kernels were shorter than
counted, or two launches over 64 programs cost what eleven small ones did); a token unlike the library pick's (the
tests: ties within and across chunks, a NaN, EOS the maximum below and at the minimum, rows all -inf, finished
sequences; red twins: EOS never masked, the last index of a tie).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_greedy_pick_fused_gpu.py`;
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --loop-tail-ab --greedy-pick-ab` (label "greedy pick in two launches"; its tokens and refusals are printed).
The interpreter runs both kernels on the CPU in CI (tests/test_triton_interpret_cpu.py), and they compile for sm_90a.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from typing import Any, Iterator

import torch

from foldkv import hf_loop

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install without Triton: every call is the library's
    triton = None

BLOCK = 4096  # columns a program of pick_chunks reads: 64 programs a row at the 31B's vocabulary
EOS_MAX = 8  # EOS ids the mask takes (Gemma 4's configs name 1-3)
RED = ("no_eos_mask", "last_of_a_tie")  # the tests' red twins, never for use

if triton is not None:
    @triton.jit
    def _first_of_max(x, at, ok, none, LAST: tl.constexpr):
        """The first index `at` among the `ok` ones where x (no NaN, -inf where not ok) holds its maximum (`none`
        larger than every index); LAST (red twin): the last."""
        hit = ok & (x == tl.max(x, axis=0))
        if LAST:
            return tl.max(tl.where(hit, at, -1), axis=0)
        return tl.min(tl.where(hit, at, none), axis=0)

    @triton.jit
    def pick_chunks(x_ptr, stride, eos_ptr, n_eos, val_ptr, idx_ptr, n, chunks, BLOCK: tl.constexpr,
                    EOS_MAX: tl.constexpr, NO_EOS: tl.constexpr = False, LAST: tl.constexpr = False):
        """Program (row, chunk): the chunk's maximum of x[row] with the first n_eos ids of eos set to -inf (as the
        processors' torch.where does), and its first index; a NaN in the chunk gives NaN and the first NaN's index."""
        row = tl.program_id(0)
        c = tl.program_id(1)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        inb = offs < n
        x = tl.load(x_ptr + row.to(tl.int64) * stride + offs, mask=inb, other=float("-inf")).to(tl.float32)
        if not NO_EOS:
            for e in tl.static_range(EOS_MAX):
                eid = tl.load(eos_ptr + e)
                x = tl.where((offs == eid) & (e < n_eos), float("-inf"), x)
        nan = x != x
        first_nan = tl.min(tl.where(nan, offs, n), axis=0)
        x = tl.where(nan, float("-inf"), x)
        at = _first_of_max(x, offs, inb, n, LAST)
        has_nan = first_nan < n
        tl.store(val_ptr + row * chunks + c, tl.where(has_nan, float("nan"), tl.max(x, axis=0)))
        tl.store(idx_ptr + row * chunks + c, tl.where(has_nan, first_nan, at))

    @triton.jit
    def pick_rows(val_ptr, idx_ptr, chunks, unfinished_ptr, pad_ptr, out_ptr, CHUNKS: tl.constexpr,
                  PAD: tl.constexpr, LAST: tl.constexpr = False):
        """Program row: the index of the first chunk holding the row's maximum (the first NaN chunk if any), padded
        where the sequence is finished (PAD: tokens * unfinished + pad * (1 - unfinished), `_sample`'s int64
        formula), into out[row]."""
        row = tl.program_id(0)
        c = tl.arange(0, CHUNKS)
        inb = c < chunks
        v = tl.load(val_ptr + row * chunks + c, mask=inb, other=float("-inf"))
        nan = v != v
        first_nan = tl.min(tl.where(nan, c, CHUNKS), axis=0)
        at = _first_of_max(tl.where(nan, float("-inf"), v), c, inb, CHUNKS, LAST)
        tok = tl.load(idx_ptr + row * chunks + tl.where(first_nan < CHUNKS, first_nan, at)).to(tl.int64)
        if PAD:
            u = tl.load(unfinished_ptr + row).to(tl.int64)
            tok = tok * u + tl.load(pad_ptr).to(tl.int64) * (1 - u)
        tl.store(out_ptr + row, tok)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fused_pick(logits: torch.Tensor, eos: torch.Tensor, n_eos: int, unfinished: torch.Tensor | None = None,
               pad: torch.Tensor | None = None, red: str | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] (any float dtype, the vocabulary contiguous), eos [EOS_MAX] int64 on their device (the first
    n_eos set to -inf), unfinished [B] int64 and pad (0-dim) together or neither -> the int64 ids [B] (into `out` when
    given): `pick_rows` of `pick_chunks`. Runs where Triton launches on logits' device (CUDA; the CPU under
    TRITON_INTERPRET=1)."""
    if red is not None and red not in RED:
        raise ValueError(f"red={red!r}: one of {RED}")
    b, n = logits.shape
    chunks = -(-n // BLOCK)
    val = torch.empty((b, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((b, chunks), dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device) if out is None else out
    last = red == "last_of_a_tie"
    pick_chunks[(b, chunks)](logits, logits.stride(0), eos, n_eos, val, idx, n, chunks, BLOCK=BLOCK, EOS_MAX=EOS_MAX,
                             NO_EOS=red == "no_eos_mask", LAST=last, num_warps=4)
    padded = unfinished is not None
    pick_rows[(b,)](val, idx, chunks, unfinished if padded else out, pad if padded else out, out,
                    CHUNKS=_pow2(chunks), PAD=padded, LAST=last, num_warps=1)
    return out


_EOS_IDS: dict[int, tuple[Any, tuple[int, ...]]] = {}  # id(processor) -> (the processor, its EOS ids): read once
_EOS_TABLES: dict[tuple, torch.Tensor] = {}  # (device, ids) -> [EOS_MAX] int64, -1 past the ids


def _eos_ids(processor: Any) -> tuple[int, ...]:
    held = _EOS_IDS.get(id(processor))
    if held is None or held[0] is not processor:
        ids = tuple(int(i) for i in processor.eos_token_id.reshape(-1).tolist())
        held = _EOS_IDS[id(processor)] = (processor, ids)
    return held[1]


def eos_table(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The [EOS_MAX] int64 table of `ids` on `device` (-1 past them), made once per (device, ids)."""
    key = (str(device), ids)
    if key not in _EOS_TABLES:
        _EOS_TABLES[key] = torch.tensor(list(ids) + [-1] * (EOS_MAX - len(ids)), dtype=torch.int64, device=device)
    return _EOS_TABLES[key]


def masked_eos(input_ids: torch.Tensor, logits_processor: Any) -> tuple[int, ...] | str:
    """The EOS ids the processors set to -inf for a prompt of input_ids' length (their own length tests), or why the
    fused pick does not describe them (a processor of another kind)."""
    from transformers.generation.logits_process import MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor

    active: set[int] = set()
    for p in logits_processor:
        if type(p) is MinNewTokensLengthLogitsProcessor:
            on = input_ids.shape[-1] - p.prompt_length_to_skip < p.min_new_tokens
        elif type(p) is MinLengthLogitsProcessor:
            on = input_ids.shape[-1] < p.min_length
        else:
            return f"processor {type(p).__name__}"
        if on:
            active.update(_eos_ids(p))
    return tuple(sorted(active))


_TOOK: dict = {"tokens": 0, "refusals": collections.Counter()}


def pick_tokens(input_ids: torch.Tensor, logits: torch.Tensor, logits_processor: Any, do_sample: bool,
                unfinished: torch.Tensor, pad_token_id: torch.Tensor | None, has_eos: bool, *, _library: Any = None,
                _red: str | None = None, _interpreted: bool = False) -> torch.Tensor:
    """`hf_loop.pick_tokens`' contract: the fused pick when it describes the call (module docstring), else the
    library's, the reason counted. `_interpreted`: CPU logits taken too (Triton's interpreter runs the kernels)."""
    eos = None
    if do_sample:
        why = "sampling"
    elif triton is None or not (logits.is_cuda or _interpreted) or logits.device != input_ids.device:
        why = "logits not on the ids' CUDA device"
    elif logits.dim() != 2 or logits.stride(1) != 1:
        why = "logits not [B, V] with the vocabulary contiguous"
    elif has_eos and pad_token_id is None:
        why = "an EOS stop without a pad id (the library's pick raises as _sample does)"
    else:
        eos = masked_eos(input_ids, logits_processor)
        why = eos if isinstance(eos, str) else f"{len(eos)} EOS ids (> {EOS_MAX})" if len(eos) > EOS_MAX else None
    if why is not None:
        _TOOK["refusals"][why] += 1
        return _library(input_ids, logits, logits_processor, do_sample, unfinished, pad_token_id, has_eos)
    _TOOK["tokens"] += 1
    return fused_pick(logits, eos_table(eos, logits.device), len(eos), unfinished if has_eos else None,
                      pad_token_id if has_eos else None, red=_red)


@contextlib.contextmanager
def installed(red: str | None = None, interpreted: bool = False) -> Iterator[dict]:
    """`hf_loop.pick_tokens` (the library loop's and run 26's version's pick, read at every token) replaced by this
    one for the block (bench/model_decode_probe.py --greedy-pick-ab); yields {"tokens": n, "refusals": Counter}.
    `interpreted`: CPU logits picked too, for a process under TRITON_INTERPRET=1 (the CPU tests)."""
    served = hf_loop.pick_tokens
    _TOOK["tokens"] = 0
    _TOOK["refusals"] = collections.Counter()
    hf_loop.pick_tokens = functools.partial(pick_tokens, _library=served, _red=red, _interpreted=interpreted)
    try:
        yield _TOOK
    finally:
        hf_loop.pick_tokens = served
        _EOS_IDS.clear()


__all__ = ["BLOCK", "EOS_MAX", "eos_table", "fused_pick", "installed", "masked_eos", "pick_tokens"]
