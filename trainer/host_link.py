"""The host link's copy bandwidth: what offloading boundary activations to host costs.

The engine's activation store (`cephalo.trainer.unit_ops.ActivationStore`) copies between
pinned host memory and the device with `non_blocking=True` on a side stream; this measures
the same kind of copy, in both directions, so that the planner (`cephalo.planner.search.offload`)
can tell whether a rank's transfers hide under its compute. The profiler records the result
as `GpuProfile.host_link_bytes_per_second`.
"""

from __future__ import annotations

import statistics

import torch

# Large enough that the copy runs at the link's rate (launch latency is a few µs, 64 MiB
# takes ~1-5 ms on PCIe 3.0-5.0), small enough for any GPU and any host.
DEFAULT_COPY_BYTES = 64 * 1024**2


def measure_host_link_bytes_per_second(device: torch.device, num_bytes: int = DEFAULT_COPY_BYTES,
                                       repeats: int = 5, warmup: int = 1) -> float | None:
    """Median bandwidth of pinned host -> device and device -> host copies of `num_bytes`,
    the slower direction (the store's copies share one stream, so each transfer runs at its
    own direction's rate and the slower one bounds what hides). None off CUDA: a CPU rank's
    host memory is its memory, nothing is transferred."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if num_bytes < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"num_bytes, repeats must be >= 1 and warmup >= 0, got "
                         f"{num_bytes}, {repeats}, {warmup}")
    with torch.cuda.device(device):
        host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
        on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        to_device = _median_seconds(on_device, host, repeats, warmup)
        to_host = _median_seconds(host, on_device, repeats, warmup)
        del host, on_device
    return num_bytes / max(to_device, to_host)


def _median_seconds(dst: torch.Tensor, src: torch.Tensor, repeats: int, warmup: int) -> float:
    """Median seconds of `dst.copy_(src)`, timed with CUDA events on the current stream
    (the copy is asynchronous from pinned memory: a host clock would time its launch)."""
    stream = torch.cuda.current_stream()
    times = []
    for i in range(warmup + repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end) / 1000.0)  # milliseconds
    # A zero reading (a timer tick coarser than the copy) would be an infinite bandwidth.
    return max(statistics.median(times), 1e-9)
