"""generate()'s thin decoding loop with each token's stop check on a side stream, off the path to the next step.

What it tries (MODEL_DECODE_NOTES "Run 26: prediction"; written before any GPU run): a token's TPOT is the step's graph
replay plus the loop's device work between two replays, which runs in stream order on the one stream, one small
kernel after another: the logits to float32, the processors (the cells' min_new_tokens: an arange, an isin, a clone
and a where over the vocabulary), the argmax, the padding of finished sequences, the ids into the graph's buffer,
then the stop check (the prompt grown by a column, each criterion: max length, EOS, the cells' clock; their or, the
finished flags, their max, the flag to the host). On the 31B the cells measure TPOT - device step = 0.09-0.14 ms
(notebook 05 and run 22-25's cells), and the CPU count of the ops the loop runs outside the forward is ~25-30
kernels a token. The next step needs the token ids only; the stop check needs them too, but nothing of the step
needs the check before the host reads the flag. Here the check (the cat, the criteria, the finished flags, the flag's
copy) is issued on a side stream that waits for the ids, so it runs beside the next replay; the main stream waits for
the side stream at the top of the next token (the processors read the grown prompt, the padding the finished flags),
when the replay has long finished it. The kernels and their inputs are `hf_loop.decode_loop`'s, so the tokens are
its tokens; the first tokens (the prompt's and the capturing step's, transformers' bookkeeping) run as it runs them.

Prediction: ~12 of the ~25-30 kernels a token leave the critical path (cat 1, the criteria ~5, the finished flags 2,
max and compare 2, the copy to the host 1), at ~2.5-4 us each back to back: **-0.03 to -0.05 ms of TPOT in every
cell** (not of the device step, which this does not touch; at batch 8 the same count). With runs 22 and 23 in the
library that puts 32K x 1 under 1.15x and leaves 4K x 1 and 4K x 8 over by ~0.03-0.08 ms. What proves it wrong:
TPOT - device step not down by >= 0.02 ms at 4K x 1 (the check's kernels were shorter than counted, or a second
stream's launches delay the replay's first kernels), or the tokens not the library loop's (a stream dependency
missing: the red twin drops the side stream's wait for the ids, so the check reads them before the argmax wrote them).

Check first on the GPU, in this order:
1. `FOLDKV_REQUIRE_GPU=1 pytest tests/test_loop_tail_side_stream_gpu.py`;
2. `python3 bench/model_decode_probe.py --decode foldkv-folded:4096:1 foldkv-folded:4096:8 foldkv-folded:32768:1
   --loop-tail-ab` (label "stop check on a side stream").
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch

from foldkv import hf_loop
from foldkv import transformers_compat as compat


@functools.lru_cache(maxsize=None)
def check_stream(device: torch.device) -> torch.cuda.Stream:
    """The check's stream, its own: not fused_step's side streams, which become branches of the step's graph while it
    is captured (the loop's check runs outside the graph, and may still be queued when the capture starts)."""
    return torch.cuda.Stream(device=device)


_TOOK = {"tokens": 0}


def decode_loop(model: torch.nn.Module, input_ids: torch.LongTensor, logits_processor: Any, stopping_criteria: Any,
                generation_config: Any, synced_gpus: bool = False, streamer: Any = None, *, _served: Any = None,
                _red_no_ids_wait: bool = False, **model_kwargs) -> torch.LongTensor:
    """`hf_loop.decode_loop` with the stop check of each thin step's token on `check_stream` (module docstring);
    what it does not cover, and a CPU loop, go to the served loop unchanged. `_red_no_ids_wait` (the tests' red twin,
    never for use): the side stream does not wait for the token ids before the check reads them (and the main stream
    is held back before the ids, so that the check always runs first)."""
    cache = compat.cache_of(model_kwargs)
    if not (hf_loop.covers(model, generation_config, synced_gpus, streamer, cache) and input_ids.is_cuda):
        return _served(model, input_ids, logits_processor, stopping_criteria, generation_config,
                       synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
    step, cache_kw, pad_token_id, has_eos_stopping_criteria, unfinished, flag = hf_loop.loop_state(
        input_ids, stopping_criteria, generation_config, model_kwargs)
    do_sample = generation_config.do_sample
    max_length = generation_config.max_length
    main, side = torch.cuda.current_stream(input_ids.device), check_stream(input_ids.device)

    outputs = model._prefill(input_ids, generation_config, model_kwargs, is_first_iteration=True)
    while True:
        if not step.started:
            model_kwargs = model._update_model_kwargs_for_generation(outputs, model_kwargs, is_encoder_decoder=False)
        main.wait_stream(side)  # the last token's check: the grown prompt and the finished flags
        if _red_no_ids_wait and step.started:
            torch.cuda._sleep(20_000_000)  # the main stream held back ~10 ms, so the race is lost every token
        next_tokens = hf_loop.pick_tokens(input_ids, outputs.logits[:, -1], logits_processor, do_sample, unfinished,
                                          pad_token_id, has_eos_stopping_criteria)
        del outputs
        step_ids = next_tokens[:, None]
        ahead = step.started and (max_length is None or input_ids.shape[-1] + 1 < max_length) and step.room() > 0
        checked = side if step.started else main  # the first tokens: in stream order, as the served loop
        if checked is side:
            _TOOK["tokens"] += 1
            if not _red_no_ids_wait:
                side.wait_stream(main)  # the ids
            for t in (input_ids, step_ids, unfinished):  # made on main, read on side: not reused before
                t.record_stream(side)
        with torch.cuda.stream(checked):
            input_ids = torch.cat([input_ids, step_ids], dim=-1)
            unfinished = unfinished & ~stopping_criteria(input_ids, None)
            flag.copy(unfinished.max() == 0)
        if ahead:
            outputs = model(input_ids=step_ids, **{cache_kw: cache})
        if flag.read():
            main.wait_stream(side)
            if ahead:
                step.rewind()
                step.loop_steps["rewound"] += 1
            return input_ids
        if step.started:
            step.loop_steps["thin"] += 1
            if not ahead:
                outputs = model(input_ids=step_ids, **{cache_kw: cache})
        else:
            step.loop_steps["transformers"] += 1
            model_inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=1, **model_kwargs)
            outputs = model(**model_inputs, return_dict=True)


@contextlib.contextmanager
def installed(red_no_ids_wait: bool = False) -> Iterator[dict]:
    """generate()'s thin loop replaced by this one for the block (`hf_loop.install` reads `hf_loop.decode_loop` at
    every call; bench/model_decode_probe.py --loop-tail-ab); yields {"tokens": n}, the tokens whose check ran on the
    side stream."""
    served = hf_loop.decode_loop
    _TOOK["tokens"] = 0
    hf_loop.decode_loop = functools.partial(decode_loop, _served=served, _red_no_ids_wait=red_no_ids_wait)
    try:
        yield _TOOK
    finally:
        hf_loop.decode_loop = served


__all__ = ["check_stream", "decode_loop", "installed"]
