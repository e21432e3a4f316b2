"""The paired benchmarks: arms (foldkv's generated kernels and their peers) timed side by side in one process.

How a cell is timed (notes for whoever reads the numbers):
- Every arm gets the same logical inputs (`case`): one set of raw projections, prepped into a split pool, a folded
  pool and FlashInfer's layout of the split pool, with the same page ids. Each pool exists in several copies
  (different memory, same values) so that consecutive calls never find their pages in the 60 MB L2: copies are added
  until they hold at least `rotate_bytes` (4 x L2 by default), and a sample cycles through all of them.
- Each arm (`arms`, `peers`) is warmed up eagerly (JIT builds, plans, first-use allocations), checked against
  `foldkv.paged_attention_reference` (float64; outputs poisoned with NaN first, so an unwritten element fails),
  then captured in a CUDA graph that calls it `inner` times per copy, enough for a sample to last
  `target_sample_us`. A graph replay is timed with CUDA events; an arm that cannot be captured is timed eagerly
  between the same events, and says so (`timing`).
- Rounds interleave the arms, the order alternating (forward, then backward), so clock and thermal drift land on
  every arm alike. Each round gives one sample per arm; the figures are the median across rounds with p10/p90 and
  the IQR, plus paired per-round ratios between arms (`stats`).
- The read roof is measured in the same process by a streaming-read kernel (Triton grid-stride sum, and a torch
  sum; the faster is the roof), at the start and end of the run (`roofs`). GB/s means 1e9 bytes/s.
- Byte model: `foldkv.lab.byte_floor.step_bytes`, the pool bytes of the context in the arm's format plus the query read and
  the output (bf16) and LSE (float32) written. % of roof = those bytes / time / roof. Prefill FLOPs:
  4 * C * (K - C/2) * Hq * D for a chunk of C queries at the end of a K-token context (causal).

Arms whose import fails (FlashInfer absent, no AOT build) are recorded "not run: <reason>"; an arm that raises is
recorded "error: <text>"; neither stops the others. A run's document (`run.BenchRun`) is saved as strict JSON
(`results`), read back into tables, verdicts and conclusions (`tables`) and figures (`plots`).
"""

from . import drawn, plots
from .arms import (DECODE_ARMS, DEFAULT_DECODE_ARMS, DEFAULT_PREFILL_ARMS, PREFILL_ARMS, READ_FOLDED, READ_FOLDED_FP8,
                   generated_arm, torch_decode_arm, workspace_arm)
from .host_time import host_time_markdown, plan_host_times
from .clock import time_events
from .case import (DEFAULT_ROTATE_BYTES, L2_BYTES, SERVING_CASES, AttentionCase, prefill_flops, ragged_lengths,
                   serving_cases)
from .drawn import (DRAWN_SHAPES, DRAWN_TARGETS, draw_batches, draw_singles, drawn_targets_markdown, fresh_seed,
                    plan_model_markdown, plan_model_rows)
from .results import (RESULTS_GLOB, RESULTS_NAME, RUNS_INDEX, SCHEMA, find_results, load_results, open_results,
                      notebook_record, record_results, redraw_banner, resolve_mode, results_path, run_name, run_of_record,
                      runs_of_record, save_results)
from .roofs import (STREAM_READ_MAX_BYTES, committed_read_roof, measure_matmul_roof, measure_read_roof,
                    stream_read_arm, stream_read_buffers)
from .plots import mark_redrawn
from .run import BenchRun
from .spec import ArmImpl, ArmSpec
from .stats import paired_ratios, pct_of_roof, summarize
from .tables import (FP8_DECODE_TARGETS, Fp8Target, fp8_prefill_rows, fp8_target_rows, fp8_targets_markdown)
from .tables import (DECODE_TARGETS, DecodeTarget, arm_cell_text, arm_names, best_folded, best_split, cells_of,
                     conclusions, markdown_table, prediction_table, series, target_conclusions, target_rows,
                     targets_markdown, verdicts)
from .timing import CHECK_REL_TOL, check_arm, run_cell

__all__ = [
    "DRAWN_SHAPES", "DRAWN_TARGETS", "draw_batches", "draw_singles", "drawn", "drawn_targets_markdown", "fresh_seed",
    "plan_model_markdown", "plan_model_rows",
    "host_time_markdown", "plan_host_times", "workspace_arm", "fp8_prefill_rows", "fp8_target_rows", "fp8_targets_markdown",
    "FP8_DECODE_TARGETS", "Fp8Target", "READ_FOLDED_FP8",
    "DECODE_TARGETS", "READ_FOLDED", "SERVING_CASES", "STREAM_READ_MAX_BYTES", "DecodeTarget", "best_split",
    "serving_cases", "stream_read_buffers", "target_conclusions", "target_rows", "targets_markdown",
    "ArmImpl", "ArmSpec", "AttentionCase", "BenchRun", "CHECK_REL_TOL", "DECODE_ARMS", "DEFAULT_DECODE_ARMS",
    "DEFAULT_PREFILL_ARMS", "DEFAULT_ROTATE_BYTES", "L2_BYTES", "PREFILL_ARMS", "RESULTS_GLOB", "RESULTS_NAME", "RUNS_INDEX",
    "SCHEMA", "arm_cell_text", "arm_names", "best_folded", "cells_of", "check_arm", "committed_read_roof",
    "conclusions", "find_results", "generated_arm", "load_results", "mark_redrawn", "markdown_table", "measure_matmul_roof",
    "measure_read_roof", "open_results", "paired_ratios", "pct_of_roof", "plots", "prediction_table", "prefill_flops",
    "notebook_record", "ragged_lengths", "record_results", "redraw_banner", "resolve_mode", "results_path", "run_cell", "run_name",
    "run_of_record", "runs_of_record", "save_results",
    "series", "stream_read_arm", "summarize", "time_events", "torch_decode_arm", "verdicts",
]
