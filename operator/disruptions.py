"""What the pod watch saw of rank pods that are gone by the operator's next look.

The operator reads a job's rank pods by listing them. A pod that the scheduler preempts (a
`DisruptionTarget` condition, then deletion) or that an eviction removes at once can come
and go between two looks, and the list can show it gone *before* the watch has delivered
the events that say why: the list reads the store, the watch follows it. Counted on the
list alone, a preempted rank looked like a pod gone without a trace, a failure toward
backoffLimit (a CI run at load 8 failed a backoffLimit-0 job so).

So the pod handler notes every rank pod's events here, and the train loop asks before it
calls a missing pod anything:

* the watch delivered the pod's deletion (its DELETED event carries its last state): the
  pod was disrupted if that state, or any earlier one, says so, else it vanished;
* the watch has not delivered it yet: wait for it (the handler wakes the job when it comes),
  at most `pod_gone_grace_seconds` from the first look that missed the pod; past that (a
  watch that re-listed, an operator restarted in between) it counts as vanished, as before.

A pod is identified by its job's uid, attempt label and config hash (its *launch*) as well
as its name, so that an earlier attempt's pod of the same name is never taken for it.
Memory only, bounded.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from cephalo.operator.kube import controller_uid
from cephalo.operator.render import ANNOTATION_CONFIG_HASH, LABEL_ATTEMPT
from cephalo.operator.status import disruption

MAX_REMEMBERED_PODS = 4096  # far more rank pods than go missing between two looks

# Which gang a rank pod belongs to: (job uid, attempt label, config hash).
Launch = tuple[str, str, str]


def launch_of(pod: dict[str, Any]) -> Launch:
    meta = pod.get("metadata") or {}
    return (controller_uid(pod) or "", (meta.get("labels") or {}).get(LABEL_ATTEMPT) or "",
            (meta.get("annotations") or {}).get(ANNOTATION_CONFIG_HASH) or "")


@dataclass(frozen=True)
class Seen:
    """One pod as its watch events showed it."""

    uid: str
    launch: Launch
    disruption: str | None  # why it was taken away, if any event said so
    deleted: bool  # its DELETED event was delivered


@dataclass(frozen=True)
class Verdict:
    """What a missing rank pod is: `waiting` for its deletion event (else concluded), and
    its disruption (None: it vanished, or nothing seen yet)."""

    waiting: bool
    disruption: str | None


class PodFates:
    """Rank pods' watch events, by (namespace, name), and when each missing one was first
    missed."""

    def __init__(self, limit: int = MAX_REMEMBERED_PODS) -> None:
        self._limit = limit
        self._seen: OrderedDict[tuple[str, str], Seen] = OrderedDict()
        self._missed: OrderedDict[tuple[str, str, Launch], float] = OrderedDict()

    def note(self, event_type: str | None, pod: dict[str, Any]) -> None:
        """One watch event of a pod (a new pod of the same name replaces the older one's)."""
        meta = pod.get("metadata") or {}
        key = (meta.get("namespace") or "", meta.get("name") or "")
        uid = meta.get("uid") or ""
        known = self._seen.get(key)
        earlier = known.disruption if known is not None and known.uid == uid else None
        self._seen[key] = Seen(uid, launch_of(pod), disruption(pod) or earlier,
                               event_type == "DELETED")
        self._seen.move_to_end(key)
        _trim(self._seen, self._limit)

    def missing(self, namespace: str, name: str, launch: Launch, now: float,
                grace_seconds: float) -> Verdict:
        """The verdict on a pod of `launch` the operator's look did not find, at `now`."""
        seen = self._seen.get((namespace, name))
        mine = seen if seen is not None and seen.launch == launch else None
        if mine is not None and (mine.deleted or mine.disruption):
            self._missed.pop((namespace, name, launch), None)
            return Verdict(False, mine.disruption)
        # Kept once the grace is over: a pass that then fails to restart the gang (a write
        # lost) concludes at once the next time rather than waiting again.
        first = self._missed.setdefault((namespace, name, launch), now)
        _trim(self._missed, self._limit)
        return Verdict(now - first < grace_seconds, None)


def _trim(memory: OrderedDict[Any, Any], limit: int) -> None:
    while len(memory) > limit:
        memory.popitem(last=False)


SEEN = PodFates()  # the operator process's one memory (handlers note, training asks)
