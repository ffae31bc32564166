"""Disruptions seen on the pod watch, for rank pods that are gone by the operator's next look.

The operator reads a job's rank pods by listing them. A pod that the scheduler preempts (a
`DisruptionTarget` condition, then deletion) or that an eviction removes at once can come
and go between two looks: the list then shows a rank pod missing without a word, which would
count as a failure toward backoffLimit (a CI run at load 8 failed a backoffLimit-0 job so).
The watch's events carry every state the pod had, the DELETED event its last one: the pod
handler notes here why each pod was taken away, and the train loop asks before it calls a
missing pod lost. Memory only (an operator restarted in that window counts a restart, as
before), bounded, and keyed by namespace and name with the pod's uid, so that a later pod
of the same name (the next attempt) is never taken for the disrupted one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from cephalo.operator.status import disruption

MAX_REMEMBERED_PODS = 4096  # far more rank pods than go missing between two looks


class DisruptionMemory:
    """Why recently seen pods were disrupted, by (namespace, name): (uid, reason)."""

    def __init__(self, limit: int = MAX_REMEMBERED_PODS) -> None:
        self._limit = limit
        self._seen: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()

    def note(self, pod: dict[str, Any]) -> None:
        """Remember the pod's disruption; a new pod of the same name forgets the old one's."""
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        uid = meta.get("uid") or ""
        why = disruption(pod)
        if why is not None:
            self._seen[key] = (uid, why)
            self._seen.move_to_end(key)
            while len(self._seen) > self._limit:
                self._seen.popitem(last=False)
        elif key in self._seen and self._seen[key][0] != uid:
            del self._seen[key]

    def reason(self, namespace: str, name: str) -> str | None:
        """Why the last pod seen by this name was disrupted, or None."""
        seen = self._seen.get((namespace, name))
        return seen[1] if seen else None


SEEN = DisruptionMemory()  # the operator process's one memory (handlers note, training asks)
