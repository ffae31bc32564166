"""Rank 0's training progress, scraped from its `/metrics` without trusting what it serves.

The page is served by the user's image, so it may be huge, slow, compressed, not UTF-8 or not
Prometheus text at all. A scrape therefore reads at most `MAX_BODY_BYTES` (streamed: a bigger
body is abandoned, never buffered), finishes within one overall deadline that also bounds a
slow-drip body (a per-read timeout would not), parses in a worker thread (never on kopf's
event loop) and never raises: a bad page means no progress this pass, logged once per job
until a scrape succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any

import aiohttp
from pydantic import ValidationError

from cephalo.api.status import FinalProgress
from cephalo.operator import metrics, rebalance_status
from cephalo.operator.eta import with_estimate
from cephalo.operator.status import REBALANCE, SERVED_BY, now_iso, parse_progress, parse_time

if TYPE_CHECKING:
    from cephalo.operator.context import JobContext

log = logging.getLogger("cephalo.operator")

# A trainer's page is a few KiB (one rank's series); 1 MiB leaves room for user metrics.
MAX_BODY_BYTES = 1 << 20
SCRAPE_DEADLINE_SECONDS = 3.0  # connect + headers + body, all together
CHUNK_BYTES = 64 * 1024
MAX_STEP = 2**63 - 1  # the status field is an int64
_warned: set[str] = set()  # jobs whose last scrape failed and was already logged


class ScrapeError(Exception):
    """Why a page was rejected, and how much of its body had been read by then. `expected`:
    nothing is wrong with the page (rank 0 is not listening yet), so nothing to warn about."""

    def __init__(self, reason: str, bytes_read: int = 0, *, expected: bool = False) -> None:
        super().__init__(reason)
        self.bytes_read = bytes_read
        self.expected = expected


async def fetch_metrics_text(url: str, *, max_bytes: int = MAX_BODY_BYTES,
                             deadline_seconds: float = SCRAPE_DEADLINE_SECONDS) -> str:
    """GET `url` as text, at most `max_bytes` of body within `deadline_seconds` in all."""
    read = 0
    body = bytearray()

    async def fetch() -> None:
        nonlocal read
        # auto_decompress off and identity asked for: a small gzip body can inflate to GiB.
        async with aiohttp.ClientSession(auto_decompress=False) as session, session.get(
                url, headers={"Accept-Encoding": "identity"}) as resp:
            if resp.status != 200:
                raise ScrapeError(f"HTTP {resp.status}")
            encoding = resp.headers.get("Content-Encoding", "identity").lower()
            if encoding != "identity":
                raise ScrapeError(f"Content-Encoding {encoding} (asked for identity)")
            if resp.content_length is not None and resp.content_length > max_bytes:
                raise ScrapeError(f"Content-Length {resp.content_length} is over the "
                                  f"{max_bytes}-byte limit")
            while chunk := await resp.content.read(CHUNK_BYTES):
                read += len(chunk)
                if read > max_bytes:
                    raise ScrapeError(f"body over the {max_bytes}-byte limit", read)
                body.extend(chunk)

    try:
        # wait_for, not asyncio.timeout: that is Python 3.11+, and 3.10 is supported.
        await asyncio.wait_for(fetch(), deadline_seconds)
    except asyncio.TimeoutError:  # TimeoutError itself only from Python 3.11
        raise ScrapeError(f"no complete page within {deadline_seconds:g} s", read) from None
    except aiohttp.ClientConnectionError as err:  # refused, reset: not serving (yet)
        raise ScrapeError(f"{type(err).__name__}: {err}", read, expected=True) from None
    except aiohttp.ClientError as err:
        raise ScrapeError(f"{type(err).__name__}: {err}", read) from None
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise ScrapeError("body is not UTF-8", read) from None


def parse_progress_checked(text: str) -> dict[str, Any]:
    """`parse_progress`, keeping only values a status patch can carry (finite, int64 step).

    Raises ValueError (with what was wrong) on text that is not Prometheus exposition format.
    """
    try:
        found = parse_progress(text)
    except (ValueError, OverflowError, TypeError, IndexError) as err:
        raise ValueError(f"not Prometheus text: {err}") from None
    return {k: v for k, v in found.items() if k in (SERVED_BY, "timing", REBALANCE)  # checked
            or ((k != "step" or 0 <= v <= MAX_STEP) and math.isfinite(v))}


async def scrape_progress(url: str, key: str, *, pod_uid: str | None = None,
                          max_bytes: int = MAX_BODY_BYTES,
                          deadline_seconds: float = SCRAPE_DEADLINE_SECONDS) -> dict[str, Any]:
    """Progress fields from one scrape; {} when there is none. Never raises.

    `key` names the job in the log: the first failure is a warning, repeats are debug, until a
    scrape succeeds again. With `pod_uid`, a page that names another pod (cephalo_trainer_info)
    is none: its IP was reused by a newer pod or is shared (hostNetwork), and another job's
    step must not become this one's. A page naming no pod (an older trainer) is taken.
    """
    try:
        text = await fetch_metrics_text(url, max_bytes=max_bytes,
                                        deadline_seconds=deadline_seconds)
        # Parsing 1 MiB takes CPU-seconds at worst: a worker thread, not the event loop.
        progress = await asyncio.to_thread(parse_progress_checked, text)
    except (ScrapeError, ValueError) as err:
        if isinstance(err, ScrapeError) and err.expected:
            log.debug("%s: no progress from %s: %s", key, url, err)
            return {}
        level = logging.DEBUG if key in _warned else logging.WARNING
        _warned.add(key)
        log.log(level, "%s: no progress from %s: %s", key, url, err)
        return {}
    except Exception:  # never let a user's page take the reconcile pass down with it
        _warned.add(key)
        log.exception("%s: scraping %s failed unexpectedly", key, url)
        return {}
    served_by = progress.pop(SERVED_BY, None)
    if pod_uid is not None and served_by is not None and served_by != pod_uid:
        level = logging.DEBUG if key in _warned else logging.WARNING
        _warned.add(key)
        log.log(level, "%s: no progress from %s: it is pod %s's page, not rank 0's (%s); the "
                "IP is shared or was reused", key, url, served_by, pod_uid)
        return {}
    _warned.discard(key)
    return progress


def final_progress(ctx: JobContext, message: str | None,
                   pod_uid: str | None = None) -> dict[str, Any] | None:
    """status.progress from rank 0's termination message once it completed
    (cephalo.api.status.FinalProgress): its last step, loss and throughput, which the last
    scrape may have seen steps earlier, or never. None when it left none (a trainer image
    older than this contract) or something else (the image is the user's). The split in
    force it left goes to status.rebalance (`pod_uid`: rank 0's pod), as a scrape's would:
    a change after the last scrape is counted and posted too."""
    if not message:
        return None
    try:
        final = FinalProgress.model_validate_json(message)
    except ValidationError as err:
        log.warning("%s/%s: rank 0's termination message is not its final progress (%d "
                    "errors); keeping the last scraped progress", ctx.namespace, ctx.name,
                    err.error_count())
        return None
    # The last scrape's figures the final message does not carry (the per-rank timing sums
    # re-planning reads) stay; the final message's own replace the scrape's.
    if final.rebalance is not None:
        rebalance_status.observe(ctx, final.rebalance.to_wire(), pod_uid)
    scraped = ctx.status.get("progress") or {}
    progress = {**scraped, **final.model_copy(update={"rebalance": None}).to_wire(),
                "totalSteps": ctx.job.spec.training.steps, "lastUpdateTime": now_iso(ctx.now)}
    if final.samples_per_second is not None:
        metrics.MEASURED_SAMPLES.labels(ctx.namespace, ctx.name).set(final.samples_per_second)
    return progress


async def job_progress(ctx: JobContext, pod_ip: str | None,
                       pod_uid: str | None = None) -> dict[str, Any] | None:
    """Scrape rank 0 (its pod's IP and uid) when the last update is older than the progress
    interval."""
    last = parse_time((ctx.status.get("progress") or {}).get("lastUpdateTime"))
    if pod_ip is None or (last is not None
                          and ctx.now - last < ctx.config.progress_interval_seconds):
        return None
    url = f"http://{pod_ip}:{ctx.config.trainer_metrics_port}/metrics"
    progress = await scrape_progress(url, f"{ctx.namespace}/{ctx.name}", pod_uid=pod_uid)
    if not progress:
        return None  # rank 0 not serving yet, or serving garbage: try again next pass
    rebalance_status.observe(ctx, progress.pop(REBALANCE, None), pod_uid)
    progress["totalSteps"] = progress.get("totalSteps", ctx.job.spec.training.steps)
    progress["lastUpdateTime"] = now_iso(ctx.now)
    if "samplesPerSecond" in progress:
        metrics.MEASURED_SAMPLES.labels(ctx.namespace, ctx.name).set(progress["samplesPerSecond"])
    # This scrape's gang's own step time (its timing), never an earlier gang's: cephalo.operator.eta
    return with_estimate(progress, ctx.now)
