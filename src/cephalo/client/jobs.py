"""A CephaloJob as read from the cluster, typed with the API models (pure)."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cephalo.api import CephaloJobSpec, CephaloJobStatus, Condition
from cephalo.api.job import format_validation_error

TERMINAL = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True)
class Job:
    """One version of a CephaloJob. `spec` is None (and `spec_error` says why) when the
    object on the server does not validate (the operator then marks it Failed, InvalidSpec)."""

    name: str
    namespace: str
    uid: str
    resource_version: str
    created: datetime.datetime | None
    spec: CephaloJobSpec | None
    status: CephaloJobStatus
    raw: dict[str, Any] = field(repr=False, compare=False)
    spec_error: str | None = None

    @property
    def phase(self) -> str:
        return self.status.phase or "Pending"

    @property
    def unseen(self) -> bool:
        """No operator has written this job's status yet (no phase at all): none runs, it
        does not watch this namespace (chart value watchNamespaces), or it is starting."""
        return not (self.raw.get("status") or {}).get("phase")

    @property
    def finished(self) -> bool:
        return self.phase in TERMINAL

    def condition(self, ctype: str) -> Condition | None:
        return next((c for c in self.status.conditions or [] if c.type == ctype), None)

    @property
    def failure_reason(self) -> str | None:
        """Why it failed ("BackoffLimitExceeded: rank 2 (pool …) failed with exit code 1 …"),
        None unless Failed."""
        if self.phase != "Failed":
            return None
        failed = self.condition("Failed")
        reason = failed.reason if failed and failed.reason else "Failed"
        return f"{reason}: {self.status.message or (failed.message if failed else '')}"

    @property
    def total_steps(self) -> int | None:
        progress = self.status.progress
        if progress and progress.total_steps:
            return progress.total_steps
        return self.spec.training.steps if self.spec else None


def parse_time(text: str | None) -> datetime.datetime | None:
    if not text:
        return None
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def job_from(obj: dict[str, Any]) -> Job:
    """The typed view of a CephaloJob dict from the API server."""
    meta = obj.get("metadata") or {}
    spec: CephaloJobSpec | None = None
    problem = None
    try:
        spec = CephaloJobSpec.model_validate(obj.get("spec") or {})
    except ValidationError as err:
        problem = format_validation_error(err)
    try:
        status = CephaloJobStatus.model_validate(obj.get("status") or {})
    except ValidationError:  # an operator of another version: keep what is readable
        status = CephaloJobStatus.model_construct(**{
            k: v for k, v in (obj.get("status") or {}).items() if k in ("phase", "message")})
    return Job(name=str(meta.get("name")), namespace=str(meta.get("namespace")),
               uid=str(meta.get("uid") or ""),
               resource_version=str(meta.get("resourceVersion") or ""),
               created=parse_time(meta.get("creationTimestamp")), spec=spec, status=status,
               raw=obj, spec_error=problem)
