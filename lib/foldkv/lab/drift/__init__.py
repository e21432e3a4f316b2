"""The drift study (what notebooks/03_drift_study.ipynb runs), one job a module, everything re-exported here
(`from foldkv.lab import drift`, `drift.X`): `study` (the model, the cells of (prompt, length), the walks per arm,
the JSON of results), `summary` (gaps, quantiles, argmax agreement, the drift line), `checks` (the checks below and
the run record's sections), `tables` (markdown) and `plots` (figures).

Definitions (per cell and step s = 0..steps; step 0 is the prefill's last position, step s >= 1 the s-th decode):
- gap[arm][s]      = max over the vocabulary of |logits_arm - logits_incumbent|, both teacher-forced on the same
                     tokens (the incumbent's greedy continuation), so every arm sees the same inputs.
- argmax_equal     = argmax(logits_arm) == argmax(logits_incumbent).
- neutral[s]       = max |walk - single pass| of the incumbent itself: its step-by-step logits against one prefill
                     over the same tokens. The size of gap the model's own arithmetic already produces by changing
                     nothing but the order of operations; an arm's gap is judged beside it.
- margin[s]        = top-1 minus top-2 logit of the incumbent: an argmax flip needs 2 * gap >= margin.
- pairs            = the same max |Δ| between two arms (folded vs split, kernel vs its torch reference).

The checks (`check_study`, per arm; a failed check fails the arm's section of the notebook's record):
- finite (every arm): every logit of every arm at every step is finite (and the incumbent's own logits, margins and
  neutral); a NaN or Inf anywhere fails, with the cell and step named.
- gap (kernel arms over bf16 pools, `gated_arms`): the arm's gap distribution is no worse than the neutral figure
  allows (see `GAP_FACTOR`).
- argmax (the same arms): the arm's argmax disagrees with the incumbent no more often than the incumbent's own single
  pass does, beyond what chance allows (see `ARGMAX_ALPHA`).
- the gated pairs (`gated_pairs`: each FP8 kernel arm, `folded-fp8` on the tensor-core partial and `folded-fp8-exact`,
  against `ref-folded-fp8`, the float64 reference over the same FP8 pool): gap and argmax with the same limits.
The FP8 arms against the incumbent get the same figures, reported, not gated (their format's drift).
The drift line (`drift_line`) is descriptive: it is placed above what was measured, so it is no check.
"""

from .study import (PAIRS, RESULTS_NAME, PARTIAL_NAME, resolve_device, resolve_dtype, prepare_model, prompt_token_ids,
                    run_cell, build_cells, DEFAULT_LENGTHS, default_lengths, run_study)
from .summary import QUANTILES, is_finite, finite_max, quantiles, gaps_of, summarize, drift_line
from .checks import (GAP_FACTOR, GAP_SLACK_ULPS, GAP_QUANTILES, ARGMAX_ALPHA, dtype_ulp, binomial_tail, gated_arms,
                     gated_pairs, pair_name, check_study, record_sections)
from .tables import (checks_table, cell_table, summary_table, model_summary, agreement_per_cell, drift_line_text,
                     checks_text)
from .plots import plot_gap_distribution, plot_gap_vs_step_and_length

__all__ = [
    "PAIRS", "RESULTS_NAME", "PARTIAL_NAME", "resolve_device", "resolve_dtype", "prepare_model", "prompt_token_ids",
    "run_cell", "build_cells", "DEFAULT_LENGTHS", "default_lengths", "run_study", "QUANTILES", "is_finite",
    "finite_max", "quantiles", "gaps_of", "summarize", "drift_line", "GAP_FACTOR", "GAP_SLACK_ULPS",
    "GAP_QUANTILES", "ARGMAX_ALPHA", "dtype_ulp", "binomial_tail", "gated_arms", "gated_pairs", "pair_name",
    "check_study", "record_sections",
    "checks_table", "cell_table", "summary_table", "model_summary", "agreement_per_cell", "drift_line_text",
    "checks_text", "plot_gap_distribution", "plot_gap_vs_step_and_length",
]
