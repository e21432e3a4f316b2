"""Correctness gates, one family a module; everything is re-exported here (`from foldkv.lab import gates`, `gates.X`).

- `geometry`: the geometry the gates run at (the 31B, or one tensor-parallel rank's share of it), refused before any
  work when the kernels are not generated for it;
- `inputs`: the cases, the hostile pool one seed makes (`fill_sequences`: whole sequences prepped into a pool; `write_tokens`: prepped rows stored),
  poisoned outputs;
- `checks`: the derived tolerances, the checks against the float64 reference (`compare`, `compare_lse`, `run_case`)
  and the arms under test (the launchers, and the decode through the workspace's CUDA graph);
- `fold`: folded against split (the float64 identity, both held to `dense_attention_reference` from raw inputs; each
  format's bf16 error against the unrounded truth);
- `refusals`: invalid inputs of the launchers and the workspace, refused with nothing written;
- `fp8_pool`: the FP8 folded pool's format error, its kernels against the reference, the needle;
- `fp8_tc`: the derived bound of the FP8 tensor-core decode (`fp8_math="tensor_cores"`, an FP8 pool's default): the
  terms it adds to the bf16 gate's, its accumulation term from FP8 wgmma's accumulation as measured on the H200
  (`foldkv.lab.fp8_accumulation`); `checks.run_case` adds them to a decode arm that resolves that partial;
- `fp8_wgmma`: notebook 02's FP8 wgmma accumulation section: the characterisation measured on the GPU (its rule, where
  promotion is needed, the accumulation bound against every cell), and the committed H200 characterisation read again;
- `graph_walk`: one CUDA graph of the decode workspace replayed while the requests grow;
- `build`: the emitted-CUDA barrier checks and the AOT build and verify;
- `sanitizer`: compute-sanitizer memcheck, racecheck and synccheck (side by side) over one case of every kernel;
- `sections`: notebook 02's bf16 kernel sections, their tables and figure, and the verdict over the record.

The gates notebook and the GPU tests both call these functions; nothing here imports TileLang (launchers do, lazily).
"""

from .geometry import KERNEL_HEAD, gate_geometry
from .inputs import (POISON_PAGE_IDS, OUT_POISON, Case, decode_cases, prefill_cases, GateInputs, case_q_lens,
                     make_inputs, poisoned_outputs, bits, fill_sequences, write_tokens)
from .checks import (P_ROUNDING, P_SCALED_ROUNDING, ABS_TOL, REL_TOL, FRO_TOL, LSE_ROUNDING, LSE_MMA_K, LSE_TILE_MAX,
                     LSE_TILE_MIN, LSE_MERGE_LEVELS, LSE_APPROX, bf16_ulp, compare, agree, lse_bound, row_key_counts,
                     reference_with_scales,
                     compare_lse, run_case, summary_row, decode_arm, prefill_arm, attended_rows, arm_for,
                     replay_workspace, graph_arm, decode_fp8_math, decode_extra)
from .fold import (dense_attention_reference, unrounded_truth, FOLD_CASE_RATIO, FOLD_MEAN_RATIO, folded_vs_split,
                   folded_vs_split_overall, sequence_pool_attention, fold_identity)
from .refusals import (DECODE_REFUSALS, PREFILL_REFUSALS, run_refusals, WORKSPACE_REFUSALS, run_workspace_refusals,
                       refusal_gate)
from .fp8_pool import (ROW_REL, ROW_SUB, rounding_bound, BF16_REL, FP8_DELTA, fp8_row_check, fp8_output_bound, fp8_format_error, fp8_cases,
                       fp8_format_gate, fp8_kernel_gate, NEEDLE_LENGTHS, NEEDLE_SCORE, needle, needle_gate)
from .fp8_tc import (FP8_MMA_BITS_KEPT, TWO_PART_REL, TWO_PART_ABS, effective_query, query_parts,
                     fp8_tc_extra_bounds, fp8_tc_extra)
from .fp8_wgmma import accumulation_gate, committed_section as fp8_wgmma_committed, plot_bound as plot_fp8_wgmma_bound, \
    rule_text as fp8_wgmma_rule_text
from .graph_walk import WALK_LENGTHS, WALK_STEPS, graph_walk, graph_walk_gate
from .build import barrier_check, aot_build_gate
from .sanitizer import sanitizer_gate
from .sections import gpu_section, run_kernel_gates, gates_tables, plot_errors, last_row_gate, record_verdict

__all__ = [
    "FP8_MMA_BITS_KEPT", "TWO_PART_REL", "TWO_PART_ABS", "effective_query", "query_parts", "fp8_tc_extra_bounds",
    "fp8_tc_extra", "accumulation_gate", "fp8_wgmma_committed", "plot_fp8_wgmma_bound", "fp8_wgmma_rule_text",
    "KERNEL_HEAD", "gate_geometry", "replay_workspace", "graph_arm", "decode_fp8_math", "decode_extra",
    "POISON_PAGE_IDS", "OUT_POISON", "Case", "decode_cases", "prefill_cases", "GateInputs", "case_q_lens",
    "make_inputs", "poisoned_outputs", "bits", "write_tokens", "P_ROUNDING", "P_SCALED_ROUNDING", "ABS_TOL", "REL_TOL", "FRO_TOL",
    "LSE_ROUNDING", "LSE_MMA_K", "LSE_TILE_MAX", "LSE_TILE_MIN", "LSE_MERGE_LEVELS", "LSE_APPROX", "bf16_ulp",
    "compare", "agree", "lse_bound", "row_key_counts", "compare_lse", "run_case", "summary_row", "decode_arm",
    "prefill_arm", "attended_rows", "arm_for", "unrounded_truth", "FOLD_CASE_RATIO", "FOLD_MEAN_RATIO",
    "folded_vs_split", "folded_vs_split_overall", "sequence_pool_attention", "fold_identity", "DECODE_REFUSALS",
    "PREFILL_REFUSALS", "run_refusals", "WORKSPACE_REFUSALS", "run_workspace_refusals", "refusal_gate", "BF16_REL",
    "FP8_DELTA", "fp8_row_check", "fp8_output_bound", "fp8_format_error", "fp8_cases", "fp8_format_gate",
    "fp8_kernel_gate", "NEEDLE_LENGTHS", "NEEDLE_SCORE", "needle", "needle_gate", "WALK_LENGTHS", "WALK_STEPS",
    "graph_walk", "graph_walk_gate", "barrier_check", "aot_build_gate", "sanitizer_gate", "gpu_section",
    "run_kernel_gates", "gates_tables", "plot_errors", "last_row_gate", "record_verdict",
]
