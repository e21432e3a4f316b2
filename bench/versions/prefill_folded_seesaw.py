"""The folded prefill with FlashMLA's seesaw schedule: the two consumer warpgroups take alternate key tiles for Q.K (each
a whole 64 x 64 score tile, no cross-warpgroup reduction inside a tile) and each keeps one half of the 512 output
columns, fed by both tiles' P. Same arguments and outputs as the library's prefill_folded.

What it tries (bench/PREFILL_NOTES.md, "Prediction: the seesaw schedule"): the library's kernel (FullCol: the two
warpgroups split every tile's 64 keys, 32 each) runs one serial chain a tile in both warpgroups at once: Q.K, four
cross-warpgroup reductions through shared memory and named barriers, the softmax, P.V, with the tensor cores idle
between the gemms. Its Q.K is wgmma m64n32 with the query re-read by both warpgroups (the shared-memory reads of a
tile ~1.3x the tensor-core time). Here, per pair of tiles (2i, 2i+1) held in the two stages:
  WG0: S0 = Q.K0 (m64n64k16, 512 deep) | max exchange | P0 = exp2(..) | O_L += P0.V0_L | O_L += P1.V1_L
  WG1: S1 = Q.K1                       | max exchange | P1 = exp2(..) | O_R += P1.V1_R | O_R += P0.V0_R
One exchange of the row max per pair (an mbarrier each way, no named-barrier round trips), the two warpgroups out of
step by design (one's softmax beside the other's gemms: the tensor cores see both), and the query read once a tile.
  - Shared memory: the query [64, 512] (score-window order q_rot | q_unrot * w_k) 64 KiB, two stages of the row [64,
    640] 160 KiB, P of stage s written over the first 64 columns of that stage's K_rot (row[0:128]), which only its
    own Q.K reads: 224 KiB + the row max / sum exchange (1 KiB) under the 227 KiB of an SM.
  - A producer warpgroup (setmaxnreg 40) loads each tile by TMA (one page of one KV head: 80 KiB contiguous), onto
    an mbarrier per stage; the consumers (setmaxnreg 232) release a stage after both P.Vs on it.
  - The lazy max (max_slack_log2, the library's): both warpgroups hold the same max after each exchange, so they
    decide alike and skip the output rescale alike.
  - A tile past the CTA's last causal key (the odd tile of a last pair): no load, all scores masked, no P.V on it.
    Keys past the sequence in the last real tile: their value rows zeroed by the tile's owner before it hands P over
    (0 x NaN is NaN in P.V).

    python bench/versions/prefill_folded_seesaw.py      # build here (sm_90a), print the CUDA size and ptxas resources
    python bench/prefill_kernel_probe.py --out $OUT      # on the device: gate, then time against the library
"""

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels.prefill_folded import prefill_folded_program as program
from foldkv.kernels.tl import pass_configs, require_tilelang, target


def build(geom: AttentionGeometry = GEMMA4_31B, *, arch: str | None = None, page_size: int = 64, block_N: int = 64,
          max_slack_log2: float | None = 8.0, **_library_tiling):
    """Compile the seesaw folded prefill, the library's `prefill_folded` program (the two-stage program's other tiling
    params, stages and threads, do not apply to it)."""
    tilelang = require_tilelang()
    prog = program(geom, page_size=page_size, block_N=block_N, max_slack_log2=max_slack_log2)
    return tilelang.compile(prog, target=target(arch) if arch else target(), pass_configs=pass_configs())


def main():
    kernel = build(GEMMA4_31B)
    print(f"prefill_folded seesaw: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
