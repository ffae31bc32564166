"""status.rebalance, the `Rebalanced` Event and the per-rank batch series from rank 0's scrape
(issue 45 item 3; docs/rebalancing.md). The trainer changes the split of the global batch on
its own, at a step boundary and without a restart; the operator only shows what it did.

Rank 0's page counts the changes of its own gang (a new gang starts from 0, under the split
its checkpoint recorded), so the job's count adds what each gang's count grew by since the
last scrape, keyed by the rank-0 pod that counted it. Changes made between two scrapes are
posted as one Event that says how many. When memory keeps the split short of the one the
ranks' speeds want (a rank would need more samples than its memory holds at its microbatch
size), rank 0's page says why; status.rebalance carries it while it lasts and an Event
`NotRebalanced` says it when it starts or its reason changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cephalo.operator import metrics
from cephalo.operator.status import now_iso

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

REBALANCED = "Rebalanced"  # the Event's reason
NOT_REBALANCED = "NotRebalanced"  # memory keeps the split short of the one wanted
HELD_FIELDS = ("heldStep", "heldReason")  # the trainer's current figures, not kept


def next_status(before: dict[str, Any] | None, scraped: dict[str, Any], pod_uid: str | None,
                now: str) -> tuple[dict[str, Any], int]:
    """(status.rebalance after this scrape, changes this scrape saw). Pure. `before`: the
    field as it was; `scraped`: parse_progress's REBALANCE figures of the pod `pod_uid`."""
    before = before or {}
    count = int(scraped.get("changes", 0))
    same_gang = pod_uid is not None and before.get("gangPod") == pod_uid
    counted = int(before.get("gangChanges") or 0) if same_gang else 0
    seen = max(0, count - counted)
    new: dict[str, Any] = {
        "batchSizes": scraped["batchSizes"], "microBatches": scraped["microBatches"],
        "changes": int(before.get("changes") or 0) + seen,
        "gangChanges": max(count, counted)}
    if pod_uid is not None:
        new["gangPod"] = pod_uid
    new.update({k: scraped[k] for k in HELD_FIELDS if scraped.get(k) is not None})
    for key in ("lastChangeStep", "lastChangeTime", "lastChangeReason"):
        if before.get(key) is not None:
            new[key] = before[key]
    if seen and scraped.get("lastChangeStep") is not None:
        new.update(lastChangeStep=scraped["lastChangeStep"], lastChangeTime=now,
                   lastChangeReason=scraped.get("lastChangeReason", ""))
    return new, seen


def observe(ctx: JobContext, scraped: dict[str, Any] | None, pod_uid: str | None) -> None:
    """Record rank 0's split in status.rebalance; an Event and the counter on a change, and
    an Event `NotRebalanced` when memory starts keeping the split short, or for another
    rank or split."""
    if not scraped:
        return
    before = ctx.decided("rebalance") or {}
    new, seen = next_status(before, scraped, pod_uid, now_iso(ctx.now))
    ctx.record(rebalance=new)
    held = new.get("heldReason")
    if held and held != before.get("heldReason"):
        ctx.event("Normal", NOT_REBALANCED, f"{held} (more needs a smaller microbatch or "
                  f"shard: a restart, i.e. re-planning)")
    if not seen:
        return
    metrics.REBALANCES.labels(ctx.namespace, ctx.name).inc(seen)
    several = f"{seen} changes since the last look; the last: " if seen > 1 else ""
    ctx.event("Normal", REBALANCED, f"{several}{new.get('lastChangeReason') or 'split '}"
              f" (now {new['batchSizes']}, microbatches {new['microBatches']}; no restart)")


__all__ = ["NOT_REBALANCED", "REBALANCED", "next_status", "observe"]
