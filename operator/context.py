"""What one reconcile pass knows and decides: the job as read, and the status it will write.

Status discipline: a pass *decides* (`write_status`, `fail`, `event`, `after_write`) and
`flush` writes once at its end — one merge patch of status carrying everything decided —
and only when that write succeeded posts the pass's Events and runs the actions that follow
from the decision (deleting the pods of a restarted gang, counting metrics). When the write
fails nothing is announced and the next pass decides again from what the cluster shows, so
nothing is announced or counted twice. (A pass stopped by an API error still writes what it
decided before the error: every decision is taken after the action it records, so it is
true.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from cephalo.api import CephaloJob
from cephalo.operator import metrics
from cephalo.operator.config import OperatorConfig
from cephalo.operator.eta import for_phase
from cephalo.operator.kube import AsyncKube, job_path
from cephalo.operator.status import FAILED, JobPhase, merge_conditions, now_iso

log = logging.getLogger("cephalo.operator")


@dataclass
class JobContext:
    kube: AsyncKube
    config: OperatorConfig
    body: dict[str, Any]
    job: CephaloJob
    # The operator's own clock: every time it stores (startTime, completionTime, condition
    # transitions, progress) is from this clock and is only ever compared with it, never
    # with the API server's timestamps (creationTimestamp), whose clock may disagree.
    now: float = field(default_factory=time.time)
    next_check_seconds: float | None = None
    _decided: dict[str, Any] = field(default_factory=dict)
    _conditions: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    _events: list[tuple[str, str, str]] = field(default_factory=list)
    _after: list[Callable[[], Awaitable[Any]]] = field(default_factory=list)

    @property
    def namespace(self) -> str:
        return self.body["metadata"]["namespace"]

    @property
    def name(self) -> str:
        return self.body["metadata"]["name"]

    @property
    def uid(self) -> str:
        return str(self.body["metadata"].get("uid"))

    @property
    def status(self) -> dict[str, Any]:
        """Status as read at the start of the pass (or as written by its flush)."""
        return self.body.get("status") or {}

    @property
    def phase(self) -> str | None:
        """The phase this pass has decided so far, else the one it read."""
        return self._decided.get("phase", self.status.get("phase"))

    def wake_in(self, seconds: float) -> None:
        if self.next_check_seconds is None or seconds < self.next_check_seconds:
            self.next_check_seconds = seconds

    async def write_status(self, phase: JobPhase | str, message: str,
                           conditions: dict[str, tuple[str, str, str]] | None = None,
                           **fields: Any) -> None:
        """Decide phase, message, conditions and fields; `flush` writes them (later calls in
        the same pass win)."""
        self._decided.update(phase=str(JobPhase(phase)), message=message, **fields)
        self._conditions.update(conditions or {})

    def record(self, **fields: Any) -> None:
        """Decide status fields without a phase or message (`flush` writes them)."""
        self._decided.update(fields)

    def condition(self, type_: str, status: str, reason: str, message: str) -> None:
        """One condition, written with this pass's status (the phase left as it is)."""
        self._conditions[type_] = (status, reason, message)

    def has_condition(self, type_: str) -> bool:
        """This pass has decided condition `type_` already."""
        return type_ in self._conditions

    def decided(self, name: str) -> Any:
        """A status field as this pass has decided it so far, else as it read it."""
        return self._decided[name] if name in self._decided else self.status.get(name)

    async def fail(self, reason: str, message: str) -> None:
        self.event("Warning", reason, message)
        await self.write_status(JobPhase.FAILED, message, {FAILED: ("True", reason, message)},
                                completionTime=now_iso(self.now))

    async def _patch_status(self, patch: dict[str, Any],
                            new: dict[str, Any]) -> dict[str, Any] | None:
        """The merge patch; when its reply is an error, read the job back: a write that took
        effect although its reply was lost (a timeout, an apiserver restart) is a success,
        so the pass's Events and actions still happen, once."""
        try:
            return await self.kube.patch(job_path(self.namespace, self.name, "status"),
                                         {"status": patch})
        except Exception:
            try:
                current = await self.kube.get(job_path(self.namespace, self.name))
            except Exception:
                current = None
            status = (current or {}).get("status") or {}
            if current is None or any(status.get(k) != v for k, v in new.items()):
                raise
            return current

    def event(self, type_: str, reason: str, message: str) -> None:
        """Post a Kubernetes Event once this pass's status write has succeeded."""
        self._events.append((type_, reason, message))

    def after_write(self, action: Callable[[], Awaitable[Any]]) -> None:
        """Run `action` once this pass's status write has succeeded."""
        self._after.append(action)

    async def flush(self) -> None:
        """The pass's one status write (skipped when nothing changes), then its Events and
        follow-up actions."""
        old = self.status
        if self._decided or self._conditions:
            self._progress_for_phase(old)
            new: dict[str, Any] = {
                "observedGeneration": self.body["metadata"].get("generation"), **self._decided}
            if self._conditions:
                new["conditions"] = merge_conditions(old.get("conditions"), self._conditions,
                                                     now_iso(self.now))
            if any(old.get(k) != v for k, v in new.items()):
                patch = {k: _replacing(old.get(k), v) for k, v in new.items()}
                patched = await self._patch_status(patch, new)
                if patched is not None:
                    self.body = patched
                if old.get("phase") != new.get("phase", old.get("phase")):
                    log.info("%s/%s: %s -> %s (%s)", self.namespace, self.name, old.get("phase"),
                             new.get("phase"), new.get("message"))
        self._decided, self._conditions = {}, {}
        if self.status.get("phase"):
            metrics.set_phase(self.namespace, self.name, self.status["phase"])
            metrics.set_progress(self.namespace, self.name, self.status.get("progress"))
            metrics.set_split(self.namespace, self.name, self.status.get("rebalance"))
        events, self._events = self._events, []
        for type_, reason, message in events:
            # kopf types the object as its Body wrapper; a plain mapping is what it reads
            kopf.event(cast(Any, self.body), type=type_, reason=reason, message=message)
        actions, self._after = self._after, []
        for action in actions:
            await action()


    def _progress_for_phase(self, old: dict[str, Any]) -> None:
        """status.progress as the phase this pass writes shows it (eta.for_phase): here, in
        the one status write, so that no path out of Running (a gang restart, a rescale, a
        re-plan, a suspend, a failure) can leave the gone gang's estimated end behind."""
        progress = self._decided.get("progress", old.get("progress"))
        shown = for_phase(progress, self._decided.get("phase", old.get("phase")))
        if shown != progress:
            self._decided["progress"] = shown


def _replacing(old: Any, new: Any) -> Any:
    """A merge patch that replaces `old` by `new` (keys that disappear are nulled)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch = {k: _replacing(old.get(k), v) for k, v in new.items()}
    patch.update({k: None for k in old if k not in new})
    return patch


__all__ = ["JobContext"]
