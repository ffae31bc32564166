"""A job's pod logs, each line prefixed by who wrote it (rank, or profiler of a GPU product).

Rank pods keep their names across gang restarts (`<job>-rank-<i>`, cephalo.operator.render)
but each attempt's pod is a new object (new uid, label `cephalo.dev/attempt`). Following a
job therefore means following *pods*: every pod of the job that has started is streamed once
(`GET pods/<name>/log?follow=true`, ending when its container ends), and the pod list is
looked at again every `poll_seconds`, so the next attempt's pods, and profiler pods, are
picked up as they start (a pod that lives less than `poll_seconds` may be missed whole).
Following ends once the job has finished (or is gone) and every stream ended.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from cephalo.client.connection import Session
from cephalo.client.errors import ClientError
from cephalo.operator.discovery import PRODUCT_LABEL
from cephalo.operator.kube import core_path
from cephalo.operator.render import (
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_PRODUCT,
    LABEL_RANK,
    LABEL_RANKS_PER_POD,
    LABEL_ROLE,
)

CONTAINER = "trainer"  # the one container of rank and profiler pods (render.gpu_pod)


@dataclass(frozen=True)
class LogLine:
    source: str  # "rank 0", "ranks 4-7" (a pod of several), "profiler NVIDIA-L4"
    pod: str
    attempt: int
    text: str

    def __str__(self) -> str:
        return f"[{self.source}] {self.text}"


@dataclass(frozen=True)
class LogSource:
    """One pod whose log is read: what it is to the job."""

    pod: str
    uid: str
    role: str  # trainer | profiler
    first_rank: int | None
    num_ranks: int
    attempt: int
    product: str

    @property
    def label(self) -> str:
        if self.role == "profiler":
            return f"profiler {self.product}"
        assert self.first_rank is not None
        if self.num_ranks > 1:
            return f"ranks {self.first_rank}-{self.first_rank + self.num_ranks - 1}"
        return f"rank {self.first_rank}"

    def runs(self, rank: int) -> bool:
        return self.first_rank is not None and \
            self.first_rank <= rank < self.first_rank + self.num_ranks


def _int(text: Any, default: int = 0) -> int:
    try:
        return int(str(text))
    except (TypeError, ValueError):
        return default


def source_of(pod: dict[str, Any]) -> LogSource:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    role = labels.get(LABEL_ROLE, "")
    rank = _int(labels.get(LABEL_RANK), -1) if role == "trainer" else -1
    # The product as GPU Feature Discovery spells it (the label is lowercased, DNS-safe)
    product = ((pod.get("spec") or {}).get("nodeSelector") or {}).get(
        PRODUCT_LABEL) or labels.get(LABEL_PRODUCT, "")
    return LogSource(pod=str(meta.get("name")), uid=str(meta.get("uid") or ""), role=role,
                     first_rank=rank if rank >= 0 else None,
                     num_ranks=max(1, _int(labels.get(LABEL_RANKS_PER_POD), 1)),
                     attempt=_int(labels.get(LABEL_ATTEMPT)), product=product)


def started(pod: dict[str, Any]) -> bool:
    """Has the container started (running, or already ended)? Before that the log
    endpoint answers 400 ("waiting to start")."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        state = status.get("state") or {}
        if state.get("running") or state.get("terminated"):
            return True
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


class JobLogs:
    """Reads the logs of job `name`; see the module docstring."""

    def __init__(self, session: Session, namespace: str, name: str, *,
                 rank: int | None = None, profilers: bool = True,
                 poll_seconds: float = 1.0) -> None:
        self.session, self.namespace, self.name = session, namespace, name
        self.rank, self.profilers, self.poll_seconds = rank, profilers, poll_seconds

    def sources(self) -> list[LogSource]:
        """The job's pods that have a log, profilers first, then by rank and attempt."""
        selector = f"{LABEL_JOB}={self.name},{LABEL_ROLE} in (trainer,profiler)"
        pods = self.session.call("list", "pods", self.namespace, self.session.kube.list,
                                 core_path(self.namespace, "pods"), selector)
        found = []
        for pod in pods:
            if not started(pod):
                continue
            source = source_of(pod)
            if source.role == "profiler" and not (self.profilers and self.rank is None):
                continue
            if source.role == "trainer" and self.rank is not None and not source.runs(self.rank):
                continue
            found.append(source)
        return sorted(found, key=lambda s: (s.role != "profiler", s.first_rank or 0,
                                            s.attempt, s.product))

    def _lines(self, source: LogSource, follow: bool) -> Iterator[LogLine]:
        query = {"container": CONTAINER}
        if follow:
            query["follow"] = "true"
        path = core_path(self.namespace, "pods", source.pod, "log")
        for raw in self.session.stream(path, query, "get", "pods/log", self.namespace,
                                       read_timeout_seconds=None if follow else 60.0):
            yield LogLine(source.label, source.pod, source.attempt,
                          raw.decode(errors="replace").rstrip("\r"))

    def read(self) -> Iterator[LogLine]:
        """What the job's pods have logged so far."""
        for source in self.sources():
            try:
                yield from self._lines(source, follow=False)
            except ClientError as err:  # gone or not started since the listing: skip it
                if getattr(err, "status", 0) not in (400, 404):
                    raise

    def follow(self, job_finished: Any) -> Iterator[LogLine]:
        """Every line as it is written, into later attempts' pods, until the job finished
        (`job_finished()` says so) and every stream ended."""
        lines: queue.Queue[LogLine | str] = queue.Queue()
        seen: set[str] = set()
        first_attempt: dict[str, int] = {}
        running: dict[str, str] = {}  # uid → label of each pod being streamed

        def pump(source: LogSource) -> None:
            try:
                for line in self._lines(source, follow=True):
                    lines.put(line)
            except ClientError as err:
                if getattr(err, "status", 0) not in (400, 404):
                    lines.put(LogLine(source.label, source.pod, source.attempt,
                                      f"(log not readable: {err})"))
            finally:
                lines.put(source.uid)

        finished_seen = False
        while True:
            for source in self.sources():
                if source.uid in seen or source.label in running.values():
                    continue  # the earlier attempt's pod first: its lines, then the next's
                seen.add(source.uid)
                running[source.uid] = source.label
                first = first_attempt.setdefault(source.label, source.attempt)
                if source.attempt > first:
                    yield LogLine(source.label, source.pod, source.attempt,
                                  f"--- attempt {source.attempt}: pod {source.pod} (the gang "
                                  "restarted) ---")
                threading.Thread(target=pump, args=(source,), daemon=True,
                                 name=f"cephalo-logs-{source.pod}").start()
            if finished_seen and not running:
                return
            deadline = time.monotonic() + self.poll_seconds
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = lines.get(timeout=left)
                except queue.Empty:
                    break
                if isinstance(item, str):
                    running.pop(item, None)
                else:
                    yield item
            # One more look at the pods after the job finished: its last pods' streams.
            finished_seen = finished_seen or bool(job_finished())
