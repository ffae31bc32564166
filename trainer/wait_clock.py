"""How long compute waited on a collective, on the backend's own terms (issue 43, item 2).

gloo (and any CPU rank): `Work.wait()` blocks the host until the collective is done, so the
host's clock around it is the wait (`HostWaitClock`).

NCCL: `Work.wait()` only makes the current (compute) stream wait for NCCL's stream and
returns at once; the host runs ahead, and a host clock reads about zero however slow the
network. The wait happens on the stream, so it is timed there (`StreamWaitClock`): an event
recorded on the compute stream before the wait and one after it; the time between them on
the stream is how long compute stood still for the collective (and the copy-out after it,
as on gloo). Events are read only once the stream has passed them — `settle()`, which the
engine calls after the step's synchronisation (the one before its end-of-step all-reduce,
and the host copy of that all-reduce's result), so reading them costs no extra sync.

The event factory is injectable: the CPU tests drive `StreamWaitClock` with fake events on a
fake stream timeline (tests/trainer/test_wait_clock.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol


class TimingEvent(Protocol):
    """What `StreamWaitClock` uses of `torch.cuda.Event(enable_timing=True)`."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end_event: Any) -> float: ...  # milliseconds


class WaitClock(Protocol):
    def start(self) -> Any:
        """A token for the wait about to begin."""

    def stop(self, kind: str, token: Any, into: defaultdict[str, float]) -> None:
        """The wait begun at `token` is over: count it under `kind` (now or at settle)."""

    def settle(self, into: defaultdict[str, float]) -> None:
        """Count every wait stopped so far into `into` (blocks until they are timed)."""

    def discard(self) -> None:
        """Forget waits not counted yet (the stats were reset)."""


class HostWaitClock:
    """The host's clock: right where `Work.wait()` blocks until the transfer is done."""

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, kind: str, token: float, into: defaultdict[str, float]) -> None:
        into[kind] += time.perf_counter() - token

    def settle(self, into: defaultdict[str, float]) -> None:
        pass

    def discard(self) -> None:
        pass


class StreamWaitClock:
    """The compute stream's clock, through timing events recorded on it (NCCL)."""

    def __init__(self, new_event: Callable[[], TimingEvent]) -> None:
        self.new_event = new_event
        self.pending: list[tuple[str, TimingEvent, TimingEvent]] = []

    def start(self) -> TimingEvent:
        began = self.new_event()
        began.record()
        return began

    def stop(self, kind: str, token: TimingEvent, into: defaultdict[str, float]) -> None:
        ended = self.new_event()
        ended.record()
        self.pending.append((kind, token, ended))

    def settle(self, into: defaultdict[str, float]) -> None:
        for kind, began, ended in self.pending:
            ended.synchronize()  # free after the step's synchronisation: already passed
            into[kind] += began.elapsed_time(ended) / 1000.0
        self.pending.clear()

    def discard(self) -> None:
        self.pending.clear()


def cuda_wait_clock() -> StreamWaitClock:
    """A `StreamWaitClock` on CUDA's timing events (the current stream: the compute one)."""
    import torch

    return StreamWaitClock(lambda: torch.cuda.Event(enable_timing=True))
