"""What a device-side trap does on this machine: one tiny kernel whose single thread polls a flag nobody sets and
traps after POLLS polls (the fused tail's guard, bench/DECODE_NOTES.md run 18), timed from launch to the error the
host sees; then whether a fresh process can still use the GPU. Diagnosis only (cupy's NVRTC; no TileLang).

    python3 bench/trap_probe.py [POLLS]        # on the H200; prints one line per step, exits 0 if the trap surfaced
"""
import subprocess
import sys
import time

SOURCE = r"""
extern "C" __global__ void wait_then_trap(const unsigned* flag, long long polls) {
  long long n = 0;
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  while (v == 0) {
    if (++n == polls) __trap();
    __nanosleep(32);
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
  }
}
"""


def main(argv: list[str]) -> int:
    import cupy as cp

    polls = int(argv[0]) if argv else 1 << 22
    kernel = cp.RawKernel(SOURCE, "wait_then_trap")
    flag = cp.zeros(1, dtype=cp.uint32)
    t0 = time.perf_counter()
    kernel((1,), (32,), (flag, cp.int64(polls)))
    try:
        cp.cuda.runtime.deviceSynchronize()
        print(f"no error after {time.perf_counter() - t0:.2f} s: the trap did not surface")
        return 1
    except Exception as exc:  # what a trap looks like to the host
        print(f"trap surfaced after {time.perf_counter() - t0:.2f} s ({polls} polls): {type(exc).__name__}: {exc}")
    fresh = subprocess.run([sys.executable, "-c", "import torch; x = torch.ones(4, device='cuda'); print(float(x.sum()))"],
                           capture_output=True, text=True, timeout=120)
    print(f"a fresh process afterwards: rc={fresh.returncode} {fresh.stdout.strip()} {fresh.stderr.strip()[-200:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
