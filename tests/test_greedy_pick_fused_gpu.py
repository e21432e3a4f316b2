"""bench/versions/greedy_pick_fused.py on the GPU: each token's greedy pick in two Triton launches, against the
library's pick (`foldkv.hf_loop.pick_tokens`) and the library's thin loop.

Bounds: the same token, exactly (bf16 to float32 is exact, -inf where the processors put it, the first index of the
maximum as torch.argmax, `_sample`'s padding formula in int64):
- the pick alone, on the logits of conftest.greedy_pick_case (ties within and across chunks, NaNs, EOS the maximum
  below and at min_new_tokens, rows all -inf, finished sequences) at 1, 3 and 8 rows and vocabularies of 1,000, 4,097
  and 262,144 columns (the 31B's): torch.equal the library's, into a poisoned output, taken by the fused path;
- generate() on the synthetic model (bf16, a left-padded batch of 8 whose rings wrap, a graph FoldKvCache): greedy
  with min_new_tokens (the cells' call), EOS ids from a free run so that one sequence, then all, finish (the padding,
  the stop, the step run ahead taken back), min_new_tokens that masks an EOS the free run picked: the same sequences
  and loop counts as without the version, every thin token picked by it; with run 26's side-stream check as well
  (the two compose); sampling goes to the library's pick, counted.
Red twins: EOS never masked, and the last index of a tie, each picks another token (alone and in generate()).

Reproduce: FOLDKV_REQUIRE_GPU=1 pytest tests/test_greedy_pick_fused_gpu.py -k eos
"""

from __future__ import annotations

import pytest
import torch

from conftest import (GREEDY_PICK_CASES, GREEDY_PICK_RED, THIN_LOOP_CALLS, THIN_LOOP_LENGTHS, THIN_LOOP_NEW,
                      THIN_LOOP_PAD, bench_version, free_run_tokens, greedy_pick_case, require_module,
                      synthetic_gpu_models, thin_loop_generate)

pytestmark = pytest.mark.gpu
LENGTHS, NEW, PAD = THIN_LOOP_LENGTHS, THIN_LOOP_NEW, THIN_LOOP_PAD


@pytest.fixture(scope="module")
def pick():
    require_module("triton")
    return bench_version("greedy_pick_fused")


@pytest.mark.parametrize("case", GREEDY_PICK_CASES)
@pytest.mark.parametrize("vocab", [1000, 4097, 262144])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_pick_is_the_library_pick(pick, case, vocab, batch):
    from foldkv import hf_loop

    kw = greedy_pick_case(case, batch, vocab, device="cuda", seed=vocab + batch)
    want = hf_loop.pick_tokens(**kw)
    with pick.installed() as took:
        got = hf_loop.pick_tokens(**kw)
    assert took["tokens"] == 1 and not took["refusals"], dict(took)
    assert torch.equal(got, want), f"{got.tolist()} where the library picks {want.tolist()}"
    eos = pick.masked_eos(kw["input_ids"], kw["logits_processor"])
    out = torch.full((batch,), -(1 << 40), dtype=torch.long, device="cuda")  # poisoned: every row written
    pick.fused_pick(kw["logits"], pick.eos_table(eos, "cuda"), len(eos), kw["unfinished"], kw["pad_token_id"], out=out)
    assert torch.equal(out, want)
    if case in GREEDY_PICK_RED:
        with pick.installed(red=GREEDY_PICK_RED[case]):
            twin = hf_loop.pick_tokens(**kw)
        assert not torch.equal(twin, want), f"red twin {GREEDY_PICK_RED[case]} picked the library's tokens"


@pytest.fixture(scope="module")
def synthetic_model(tmp_path_factory):
    return synthetic_gpu_models(tmp_path_factory, "foldkv", needs=("triton",))["foldkv"]


def _generate(model, seed=None, **kw):
    return thin_loop_generate(model, LENGTHS, NEW, seed=seed, **kw)


def _warm_up_picks(model, pick) -> int:
    """Tokens the version's pick takes while a FoldKvCache is made: its creation on CUDA runs one greedy generate()
    (`FoldKvCache.warm_generate`), inside any call that makes its cache under `pick.installed()`."""
    from foldkv.hf import FoldKvCache

    with pick.installed() as took:
        FoldKvCache(model, max_batch=len(LENGTHS), max_tokens=max(LENGTHS) + NEW, scatter_seed=3, decode_step="graph")
    return took["tokens"]


CALLS = {
    **THIN_LOOP_CALLS,
    # EOS = what sequence 0 picked at its 3rd token, masked until the 6th: the pick must take the runner-up there
    "eos_masked": lambda model: dict(do_sample=False, min_new_tokens=6, pad_token_id=PAD,
                                     eos_token_id=free_run_tokens(model, [(0, 2)])),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_generate_with_the_pick_in_two_launches(synthetic_model, pick, call):
    kw = CALLS[call](synthetic_model)
    want, want_steps = _generate(synthetic_model, seed=11, **kw)
    warm = _warm_up_picks(synthetic_model, pick)  # before the block: `installed` resets the one count it yields
    with pick.installed() as took:
        got, steps = _generate(synthetic_model, seed=11, **kw)
    assert want_steps["thin"] >= 1 and steps == want_steps, (steps, want_steps)
    assert got.shape == want.shape and torch.equal(got, want), f"{got} where the library's loop gives {want}"
    if call == "sampling":  # every sampled token refused; the fused pick took only the cache's greedy warm-up
        assert took["tokens"] == warm and took["refusals"]["sampling"] >= want_steps["thin"], (dict(took), warm)
    else:
        assert took["tokens"] >= want_steps["thin"] and not took["refusals"], dict(took)
    if call == "all_finish":
        assert want.shape[1] < NEW and steps["rewound"] == 1
    if call == "one_finishes":
        assert (want[0] == PAD).any()


def test_the_pick_and_the_side_stream_check_compose(synthetic_model, pick):
    side = bench_version("loop_tail_side_stream")
    kw = CALLS["one_finishes"](synthetic_model)
    want, want_steps = _generate(synthetic_model, **kw)
    with side.installed() as checked, pick.installed() as took:
        got, steps = _generate(synthetic_model, **kw)
    assert steps == want_steps and torch.equal(got, want), f"{got} where the library's loop gives {want}"
    assert checked["tokens"] >= want_steps["thin"] and took["tokens"] >= want_steps["thin"], (checked, dict(took))


def test_a_pick_that_does_not_mask_eos_is_seen(synthetic_model, pick):
    kw = CALLS["eos_masked"](synthetic_model)
    want, _ = _generate(synthetic_model, **kw)
    assert not (want[0, :6] == kw["eos_token_id"][0]).any()  # the library's pick masked it
    with pick.installed(red="no_eos_mask"):
        twin, _ = _generate(synthetic_model, **kw)
    assert not torch.equal(twin, want), "a pick that never masks EOS changed nothing"
