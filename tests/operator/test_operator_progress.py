"""Progress scrape of rank 0's /metrics against hostile pages served by a real HTTP server.

The page belongs to the user's image: these tests serve a huge body, a slow drip, garbage,
a gzip body and a valid page, and check that the operator's scrape reads a bounded number of
bytes, ends, and never raises. Bounds are on bytes, not on wall time (a loaded machine must
not make them flaky); timeouts below only keep a broken scrape from hanging the suite.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from kube_fixtures import job_body

from cephalo.api import parse_job
from cephalo.operator import progress as progress_module
from cephalo.operator import training
from cephalo.operator.config import OperatorConfig
from cephalo.operator.progress import (
    MAX_BODY_BYTES,
    ScrapeError,
    fetch_metrics_text,
    scrape_progress,
)

pytestmark = pytest.mark.asyncio
VALID = ('# HELP cephalo_step Optimizer steps done\n# TYPE cephalo_step gauge\n'
         'cephalo_step{rank="0"} 42\ncephalo_loss{rank="0"} 2.5\n'
         'cephalo_samples_per_second{rank="0"} 123.5\n')
HUGE_BYTES = 600 * 2**20  # what the user image served
LINE = b"# " + b"x" * 1020 + b"\n"  # a valid comment line: only its size is hostile
HANG_GUARD_SECONDS = 60.0


@dataclass
class Page:
    """What the test server serves at /metrics, and what it managed to send."""

    handler: Callable[[web.Request, Page], Awaitable[web.StreamResponse]]
    sent_bytes: int = 0
    finished: asyncio.Event = field(default_factory=asyncio.Event)


def _text(text: str | bytes, **headers: str) -> Callable[..., Awaitable[Any]]:
    body = text.encode() if isinstance(text, str) else text

    async def handler(request: web.Request, page: Page) -> web.StreamResponse:
        page.sent_bytes += len(body)
        return web.Response(body=body, headers={"Content-Type": "text/plain", **headers})
    return handler


async def _stream(request: web.Request, page: Page, total: int, pause: float) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    chunk = LINE * (64 if pause == 0 else 1)
    try:
        while page.sent_bytes < total:
            await resp.write(chunk)
            page.sent_bytes += len(chunk)
            await asyncio.sleep(pause)
    except (ConnectionError, RuntimeError):
        pass  # the scraper hung up: what we want
    finally:
        page.finished.set()
    return resp


async def huge(request: web.Request, page: Page) -> web.StreamResponse:
    return await _stream(request, page, HUGE_BYTES, 0)


async def drip(request: web.Request, page: Page) -> web.StreamResponse:
    return await _stream(request, page, HUGE_BYTES, 0.05)  # ~20 KiB/s, forever


@pytest.fixture(autouse=True)
def _fresh_warnings() -> None:
    progress_module._warned.clear()  # "logged once" is per job and per process


@pytest_asyncio.fixture()
async def server() -> AsyncIterator[Callable[[Any], Awaitable[tuple[str, Page]]]]:
    runners: list[web.AppRunner] = []

    async def serve(handler: Any) -> tuple[str, Page]:
        page = Page(handler)
        app = web.Application()

        async def route(request: web.Request) -> web.StreamResponse:
            return await page.handler(request, page)
        app.router.add_get("/metrics", route)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"127.0.0.1:{port}", page

    yield serve
    for runner in runners:
        await runner.cleanup()


def _ctx(address: str) -> SimpleNamespace:
    """What training's progress step reads from a reconcile pass's JobContext."""
    port = address.split(":")[1]
    return SimpleNamespace(status={}, now=time.time(), namespace="team-a", name="gpt",
                           config=OperatorConfig(trainer_metrics_port=int(port)),
                           job=parse_job(job_body("gpt", namespace="team-a")))


async def _progress(address: str, pod_uid: str | None = None) -> dict[str, Any] | None:
    """The operator's own progress step (training.py) against the server at `address`, for
    rank 0's pod `pod_uid`."""
    ctx = _ctx(address)
    return await asyncio.wait_for(training._progress(ctx, address.split(":")[0], pod_uid),
                                  HANG_GUARD_SECONDS)


async def test_a_huge_body_is_abandoned_after_the_byte_cap(server) -> None:
    address, page = await server(huge)
    assert await _progress(address) is None
    await asyncio.wait_for(page.finished.wait(), HANG_GUARD_SECONDS)
    # The server stops once the scraper hangs up; what it sent beyond the cap sat in socket
    # buffers (a few MiB on loopback), never in the operator.
    assert page.sent_bytes < 32 * 2**20, f"the scraper let the server send {page.sent_bytes} B"
    with pytest.raises(ScrapeError, match="over the 65536-byte limit") as err:
        await fetch_metrics_text(f"http://{address}/metrics", max_bytes=65536)
    assert 65536 < err.value.bytes_read <= 65536 + 64 * 1024


async def test_an_advertised_huge_length_is_refused_before_the_body(server) -> None:
    big = "# " + "x" * (MAX_BODY_BYTES + 10) + "\n"
    address, _ = await server(_text(big))
    with pytest.raises(ScrapeError, match=r"Content-Length \d+ is over") as err:
        await fetch_metrics_text(f"http://{address}/metrics")
    assert err.value.bytes_read == 0
    assert await _progress(address) is None


async def test_a_slow_drip_body_is_cut_by_the_overall_deadline(server) -> None:
    address, page = await server(drip)
    with pytest.raises(ScrapeError, match=r"no complete page within 0\.5 s") as err:
        await asyncio.wait_for(fetch_metrics_text(f"http://{address}/metrics",
                                                  deadline_seconds=0.5), HANG_GUARD_SECONDS)
    assert err.value.bytes_read < MAX_BODY_BYTES  # ended by time, not by the byte cap
    await asyncio.wait_for(page.finished.wait(), HANG_GUARD_SECONDS)  # and it hung up


@pytest.mark.parametrize("garbage", [
    b"this is not prometheus text\n",
    b'cephalo_step{rank="0" 42\n',
    b"cephalo_step NaN\n",  # a step must be an integer
    b"\xff\xfe\x00binary",
    b'cephalo_step{rank="0"} 1e400\n',
])
async def test_garbage_means_no_progress_and_one_warning(server, garbage, caplog) -> None:
    address, _ = await server(_text(garbage))
    caplog.set_level(logging.DEBUG, logger="cephalo.operator")
    assert await _progress(address) is None
    assert await _progress(address) is None
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "team-a/gpt: no progress" in warnings[0].getMessage()


async def test_a_gzip_body_is_refused_not_inflated(server) -> None:
    address, _ = await server(_text(gzip.compress(b"# " + b"0" * 2**20),
                                          **{"Content-Encoding": "gzip"}))
    with pytest.raises(ScrapeError, match="Content-Encoding gzip"):
        await fetch_metrics_text(f"http://{address}/metrics")


async def test_valid_page_gives_progress_and_drops_values_status_cannot_hold(server) -> None:
    address, _ = await server(_text(VALID))
    progress = await _progress(address)
    assert progress is not None
    assert {k: progress[k] for k in ("step", "loss", "samplesPerSecond", "totalSteps")} == {
        "step": 42, "loss": 2.5, "samplesPerSecond": 123.5, "totalSteps": 100}
    assert progress["lastUpdateTime"].endswith("Z")
    address, _ = await server(_text('cephalo_step{rank="0"} 7\ncephalo_loss 1e999\n'
                                          'cephalo_samples_per_second NaN\n'))
    assert await scrape_progress(f"http://{address}/metrics", "k") == {"step": 7}


async def test_unreachable_rank_is_no_progress_and_no_warning(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="cephalo.operator")
    assert await _progress("127.0.0.1:9") is None  # the discard port: nothing listens
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], \
        "rank 0 not listening yet is normal at start-up: no warning"


def _trainer_page(pod_uid: str | None, step: int) -> str:
    """What a trainer rank serves (its own TrainerMetrics registry) after `step`."""
    from prometheus_client import generate_latest

    from cephalo.trainer.metrics import TrainerMetrics

    metrics = TrainerMetrics(rank=0, port=0, predicted_step_seconds=1.0, pod_uid=pod_uid)
    metrics.observe(step=step, loss=2.0, step_seconds=0.5, samples_per_second=32.0,
                    tokens_per_second=1024.0, tflops=0.1, wait_seconds_by_op={}, local_rank=0)
    return generate_latest(metrics.registry).decode()


async def test_a_page_naming_another_pod_is_not_this_jobs_progress(server, caplog) -> None:
    """Pods that share an IP (hostNetwork, the realk8s process kubelet) or a pod IP reused by
    a newer pod: rank 0's address can serve another job's page. Its step must not become this
    job's: an elastic job once drained its fresh rank as if it had trained (realk8s)."""
    caplog.set_level(logging.WARNING, logger="cephalo.operator")
    address, _ = await server(_text(_trainer_page("uid-of-hold-rank-0", 14)))
    assert await _progress(address, pod_uid="uid-of-grow-rank-0") is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "pod uid-of-hold-rank-0's page, not rank 0's (uid-of-grow-rank-0)" in warning
    mine = await _progress(address, pod_uid="uid-of-hold-rank-0")
    assert mine is not None and mine["step"] == 14 and "servedBy" not in mine
    # A trainer too old to name its pod is taken at its word.
    address, _ = await server(_text(_trainer_page(None, 3)))
    older = await _progress(address, pod_uid="uid-of-grow-rank-0")
    assert older is not None and older["step"] == 3


@pytest.mark.parametrize(("message", "expected"), [
    ('{"step": 30, "loss": 4.3186, "samplesPerSecond": 812.5, "newerField": 1}',
     {"step": 30, "loss": 4.3186, "samplesPerSecond": 812.5}),
    ('{"step": 30}', {"step": 30}),
    ("Traceback (most recent call last): ...", None),  # not JSON: a user's image wrote it
    ('{"step": -1, "loss": 1.0}', None),
    ('{"step": 30, "loss": NaN}', None),
    ('{"step": "30"}', None),
    ('{"step": 30, "samplesPerSecond": -2}', None),
    ("", None),
    (None, None),
])
async def test_rank_0s_final_progress_is_checked_like_a_scrape(message, expected, caplog) -> None:
    """Issue 39 item 10: the termination message of a completed rank 0 (FinalProgress)."""
    found = progress_module.final_progress(_ctx("127.0.0.1:9400"), message)
    if expected is None:
        assert found is None
        assert bool(message) == any("not its final progress" in r.message
                                    for r in caplog.records)
        return
    assert found is not None
    assert found.pop("totalSteps") == 100 and found.pop("lastUpdateTime")
    assert found == expected
