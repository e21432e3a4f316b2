"""The library's folded prefill (kernels/prefill_folded.py, the seesaw with released halves) with its P.Vs left in
flight, as FlashMLA's sparse prefill leaves them: warpgroup 0 issues P0.V0 and, while it runs, waits for m1 and
rescales and stores P0 for warpgroup 1 (the library waits for P0.V0 first); warpgroup 1 issues P1.V1 and P0.V0 back to
back (`T.wgmma_gemm`, no wait between) and releases each stage part as its gemm retires (`T.wait_wgmma(1)`, then 0).
Everything else is the library's program (its `values` hook point). Same arguments and outputs.

Prediction (bench/PREFILL_NOTES.md, "Prediction: the P.Vs left in flight"), then the outcome when it has run.

    python bench/versions/prefill_folded_seesaw_async.py      # build here (sm_90a), print the CUDA size
    python bench/prefill_kernel_probe.py --arms library_folded seesaw_async --out $OUT   # on the device
"""

# no `from __future__ import annotations`: TileLang evaluates the prim_func annotations

from foldkv.config import GEMMA4_31B, AttentionGeometry
from foldkv.kernels import prefill_folded
from foldkv.kernels.prefill_folded import FREE, P_READY, X0, X1, Y0, ValueSchedule
from foldkv.kernels.tl import compile_program
from foldkv.layout import KvFormat, row_width


def in_flight_values(geom: AttentionGeometry, block_N: int) -> ValueSchedule:
    """The P.Vs issued with `T.wgmma_gemm` and retired with `T.wait_wgmma`, the accumulators fenced after each wait
    (a thread's 128 output registers, warpgroup 0's 16 of P) so that nvcc reads none of them early."""
    import tilelang.language as T

    R, H = geom.rotary_width, geom.head_dim // 2
    W = row_width(geom, KvFormat.FOLDED)

    @T.macro
    def own(acc_p, KV, acc_o, mbarrier):
        T.wgmma_gemm(acc_p, KV[0, :, R:R + H], acc_o)  # P0 on m0, from registers, left in flight

    @T.macro
    def own_retired(acc_o, acc_p, mbarrier):
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_o, num_regs=H // 2)
        T.warpgroup_fence_operand(acc_p, num_regs=block_N // 4)
        T.barrier_arrive(mbarrier[FREE + X0])

    @T.macro
    def pair(KV, acc_o, mbarrier, i, num_blocks):
        if 2 * i + 1 < num_blocks:
            T.wgmma_gemm(KV[1, :, 0:block_N], KV[1, :, R + H:W], acc_o)
        T.barrier_wait(mbarrier[P_READY + 0], i & 1)
        T.wgmma_gemm(KV[0, :, 0:block_N], KV[0, :, R + H:W], acc_o)  # P0, already on m1, behind P1.V1
        T.wait_wgmma(1)
        T.barrier_arrive(mbarrier[FREE + X1])
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(acc_o, num_regs=H // 2)
        T.barrier_arrive(mbarrier[FREE + Y0])

    return ValueSchedule(own, own_retired, pair)


def program(geom: AttentionGeometry, *, page_size: int = 64, block_N: int = 64, max_slack_log2: float | None = 8.0,
            **_library_tiling):
    """The library's program with `in_flight_values` (the library prefill's other tiling params do not apply)."""
    return prefill_folded.program(geom, page_size=page_size, block_N=block_N, max_slack_log2=max_slack_log2,
                                  values=in_flight_values)


def build(geom: AttentionGeometry = GEMMA4_31B, *, page_size: int = 64, block_N: int = 64,
          max_slack_log2: float | None = 8.0, **_library_tiling):
    """Compile the version with the library prefill's params."""
    return compile_program(program(geom, page_size=page_size, block_N=block_N, max_slack_log2=max_slack_log2))


def main():
    kernel = build(GEMMA4_31B)
    print(f"prefill_folded with the P.Vs in flight: {len(kernel.get_kernel_source())} chars of CUDA")


if __name__ == "__main__":
    main()
