"""GPU checks of the plain-read arm (`read_folded`, `foldkv.lab.bench.stream_read_arm`): however many bytes it reads,
its memory stays within its cap (the case's pools already hold the card), and its check holds it to every byte."""

from __future__ import annotations

import pytest
import torch

from foldkv.lab import bench
from foldkv.lab.bench import roofs

pytestmark = pytest.mark.gpu


def test_stream_read_arm_stays_within_its_cap_and_reads_every_byte(cuda_device):
    cap = 64 << 20
    nbytes = 5 * cap + 12_345  # five and a bit passes over one capped buffer
    torch.cuda.synchronize(cuda_device)
    base = torch.cuda.memory_allocated(cuda_device)
    torch.cuda.reset_peak_memory_stats(cuda_device)
    impl = bench.stream_read_arm(nbytes, cuda_device, copies=4, max_bytes=cap)
    check = impl.check()
    peak = torch.cuda.max_memory_allocated(cuda_device) - base
    # the buffers, the check's float64 chunk and its |.| (SUM_CHUNK each), the partial sums (a few KiB) and the
    # allocator's rounding of each tensor to 512 bytes: under 1 MiB beyond the first two
    bound = cap + 2 * roofs.SUM_CHUNK * 8 + (1 << 20)
    assert peak <= bound, f"the arm allocated {peak} bytes, past {bound}"
    assert check["ok"] and check["written"], check
    assert impl.info["streamed_bytes"] >= nbytes and impl.info["buffers"] == 1
    impl.calls[0]()  # what is timed: the same read around the buffer
    torch.cuda.synchronize(cuda_device)
    bufs = impl.keep
    n_blocks = impl.info["streamed_bytes"] // (2 * roofs.STREAM_BLOCK)
    assert roofs._sum_error(impl.out, bufs[0], n_blocks) <= roofs.SUM_TOL
    roofs.stream_read_kernel()(bufs[0], impl.out)  # red twin: one pass over the buffer is not the byte count
    torch.cuda.synchronize(cuda_device)
    assert roofs._sum_error(impl.out, bufs[0], n_blocks) > roofs.SUM_TOL
