"""Peak bytes a piece of torch code allocates on the CPU (net of frees): the CPU analogue of
CUDA's `max_memory_allocated`, which torch lacks. Used by `bench/fsdp2.py` (through
`bench/fsdp2_device.py`, next to peak RSS, which glibc's retained free memory blurs) and by
the memory-model tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


def live_bytes_peak(step: Callable[[], object]) -> int:
    """Peak of the bytes allocated (net of frees) while `step` runs.

    Read from the running total that torch's CPU allocator reports with every allocation
    and free it makes while the profiler records memory (blocks allocated before it started
    are not in it). The total is kept under the allocator's lock, so its maximum is exact
    even when other threads (gloo's workers) free memory: summing the events' sizes in
    timestamp order instead misorders a free on one thread and an allocation on another."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()

    def walk(events: list[Any]) -> Iterator[Any]:
        for event in events:
            yield event
            yield from walk(event.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()
    totals = [e.extra_fields.total_allocated for e in walk(tree)
              if e.tag == _EventType.Allocation]
    return max([0, *totals])
