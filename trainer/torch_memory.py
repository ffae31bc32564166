"""Peak bytes a piece of torch code allocates on the CPU (net of frees): the CPU analogue of
CUDA's `max_memory_allocated`, which torch lacks. Used by `bench/fsdp2.py` (through
`bench/fsdp2_device.py`, next to peak RSS, which glibc's retained free memory blurs) and by
the memory-model tests."""

from __future__ import annotations

from collections.abc import Callable


def live_bytes_peak(step: Callable[[], object]) -> int:
    """Peak of the bytes allocated (net of frees) while `step` runs, from the allocation
    events torch's profiler records (frees of blocks allocated before it started are not
    recorded, so this counts only what the step itself allocates)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live_bytes = peak = 0
    for event in events:
        live_bytes += event.nbytes()
        peak = max(peak, live_bytes)
    return peak
