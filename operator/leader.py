"""Leader election (I/O shell around cephalo.operator.lease): only the Lease holder reconciles.

The chart runs two or more operator replicas (`kopf run`, not --standalone's single pod).
kopf starts its watchers, daemons and handlers only after every startup handler returned, so
`cephalo.operator.handlers.startup` ends by awaiting `elect`: a standby waits there, running
nothing, until it holds the Lease. Then two threads keep the term:

* the renewer re-reads and renews the Lease every retry period (its own HTTP pool, with a
  request timeout below the retry period, so a stuck kopf loop or a full connection pool
  never delays it), and
* the watchdog ends the process (`os._exit(1)`, no graceful shutdown: handlers must not run
  a moment longer) when the Lease shows another holder or when no renewal succeeded for the
  renew deadline. The Deployment restarts the container, which comes back as a candidate.

On a clean shutdown (SIGTERM, a rollout) kopf stops its handlers first; then `release`
empties `holderIdentity`, so a standby takes over within one retry period instead of
waiting out the lease.

A small HTTP server answers the chart's probes: `/healthz` (alive: 200 while the election
runs; on the leader also while kopf's event loop turns) and `/readyz` (200 on the leader
only, once kopf's handlers run), so a Service or `kubectl get pods` shows which replica
works. The gauge `cephalo_operator_leader` is 1 on the leader.
"""

from __future__ import annotations

import asyncio
import http.server
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

from cephalo.operator import metrics
from cephalo.operator.kube import ApiError, Kube, load_api_client
from cephalo.operator.lease import (
    Action,
    ElectionTiming,
    Observation,
    Term,
    decide,
    lease_body,
    lease_path,
)

log = logging.getLogger("cephalo.operator.leader")
# A loop that has not turned for this long is stuck (the liveness probe fails then).
LOOP_STALL_SECONDS = 30.0


def identity() -> str:
    """Unique per process: the pod name (the hostname in a pod) and a random suffix, so a
    restarted container is a new candidate and never mistakes the old term for its own."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


class Elector:
    """One candidate: `acquire` (blocking), then `keep` (threads), `release` at shutdown."""

    def __init__(self, kube: Kube, namespace: str, name: str, timing: ElectionTiming,
                 me: str | None = None) -> None:
        self.kube, self.namespace, self.name, self.timing = kube, namespace, name, timing
        self.me = me or identity()
        self.stopping = threading.Event()  # set at shutdown: a waiting candidate gives up
        self.leading = threading.Event()
        self.term: Term | None = None
        self._seen: Observation | None = None
        self._version: str | None = None  # resourceVersion of the Lease we last wrote
        self.tick: asyncio.Task[None] | None = None  # the probes' loop heartbeat

    def _timeout(self) -> float:
        return max(0.5, self.timing.retry_period_seconds)

    def try_once(self) -> Action:
        """Read the Lease, decide, write; the action taken (WAIT when the write lost)."""
        sent_at = time.monotonic()
        try:
            lease: dict[str, Any] | None = self.kube.request(
                "GET", lease_path(self.namespace, self.name), timeout_seconds=self._timeout())
        except ApiError as err:
            if err.status != 404:
                raise
            lease = None
        decision = decide(lease, self._seen, self.me, time.monotonic(),
                          datetime.now(timezone.utc), self.timing)
        self._seen = decision.observation
        if decision.action is Action.WAIT or decision.record is None:
            log.debug("lease %s/%s: %s", self.namespace, self.name, decision.reason)
            return Action.WAIT
        version = None if lease is None else lease["metadata"]["resourceVersion"]
        body = lease_body(self.namespace, self.name, decision.record, version)
        try:
            if decision.action is Action.CREATE:
                written = self.kube.request("POST", lease_path(self.namespace), body,
                                            timeout_seconds=self._timeout())
            else:
                written = self.kube.request("PUT", lease_path(self.namespace, self.name), body,
                                            timeout_seconds=self._timeout())
        except ApiError as err:
            if err.status == 409:  # another candidate wrote first (Conflict / AlreadyExists)
                log.info("lease %s/%s: lost the race (%s)", self.namespace, self.name, err)
                return Action.WAIT
            raise
        self._version = written["metadata"]["resourceVersion"]
        if self.term is None:
            self.term = Term(self.timing, sent_at)
        else:
            self.term.renewed(sent_at)
        if decision.action is not Action.RENEW:
            log.info("lease %s/%s acquired by %s (%s)", self.namespace, self.name, self.me,
                     decision.reason)
        return decision.action

    def acquire(self) -> bool:
        """Block until this candidate holds the Lease (True) or `stopping` is set (False)."""
        log.info("leader election: %s is a candidate for lease %s/%s", self.me,
                 self.namespace, self.name)
        while not self.stopping.is_set():
            try:
                if self.try_once() is not Action.WAIT:
                    self.leading.set()
                    metrics.LEADER.set(1)
                    return True
            except Exception as err:  # the API server away for a while: try again
                log.warning("leader election: %s", err)
            self.stopping.wait(self.timing.retry_period_seconds)
        return False

    def keep(self) -> None:
        """Renew in the background; end the process when the term cannot be kept."""
        threading.Thread(target=self._renew, name="lease-renewer", daemon=True).start()
        threading.Thread(target=self._watchdog, name="lease-watchdog", daemon=True).start()

    def _renew(self) -> None:
        while not self.stopping.is_set() and self.leading.is_set():
            started = time.monotonic()
            try:
                if self.try_once() is not Action.RENEW:
                    self._lose("the Lease names another holder")
                    return
            except Exception as err:  # keep trying until the deadline (the watchdog's)
                log.warning("lease %s/%s: renewal failed: %s", self.namespace, self.name, err)
            self.stopping.wait(max(0.0, self.timing.retry_period_seconds
                                   - (time.monotonic() - started)))

    def _watchdog(self) -> None:
        while not self.stopping.is_set():
            term = self.term
            if term is not None and term.must_stop(time.monotonic()):
                self._lose(f"no renewal succeeded for {self.timing.renew_deadline_seconds:g} s")
            time.sleep(min(0.1, self.timing.retry_period_seconds / 4))

    def _lose(self, why: str) -> None:
        if self.stopping.is_set():
            return  # a clean shutdown is under way (release)
        metrics.LEADER.set(0)
        log.error("leader election: %s lost lease %s/%s: %s; exiting so that the standby "
                  "takes over", self.me, self.namespace, self.name, why)
        logging.shutdown()
        os._exit(1)

    def release(self) -> None:
        """Give the Lease up at a clean shutdown (handlers already stopped): an empty
        holder, which a standby takes at its next retry."""
        self.stopping.set()
        if not self.leading.is_set():
            return
        self.leading.clear()
        metrics.LEADER.set(0)
        try:
            lease = self.kube.request("GET", lease_path(self.namespace, self.name),
                                      timeout_seconds=self._timeout())
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.me:
                return
            spec = {**spec, "holderIdentity": None, "leaseDurationSeconds": 1}
            self.kube.request("PUT", lease_path(self.namespace, self.name),
                              {**lease, "spec": spec}, timeout_seconds=self._timeout())
            log.info("lease %s/%s released by %s", self.namespace, self.name, self.me)
        except Exception as err:  # the standby waits out the lease instead
            log.warning("lease %s/%s: release failed: %s", self.namespace, self.name, err)


class Probes:
    """/healthz and /readyz for the chart's probes, on their own port (kopf's own liveness
    endpoint starts only after the startup handlers, that is never on a standby)."""

    def __init__(self, elector: Elector, port: int) -> None:
        self.elector = elector
        self.ready = threading.Event()  # set once kopf's handlers run on the leader
        self.loop_turned_at = time.monotonic()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                code, text = owner.answer(self.path)
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(text.encode())

            def log_message(self, *_: Any) -> None:  # probes every few seconds: no log lines
                pass

        self.server = http.server.ThreadingHTTPServer(("", port), Handler)
        self.port = int(self.server.server_address[1])
        threading.Thread(target=self.server.serve_forever, name="probes", daemon=True).start()

    def answer(self, path: str) -> tuple[int, str]:
        leading = self.elector.leading.is_set()
        if path == "/healthz":
            stalled = time.monotonic() - self.loop_turned_at
            if leading and self.ready.is_set() and stalled > LOOP_STALL_SECONDS:
                return 500, f"leader: kopf's event loop has not turned for {stalled:.0f} s\n"
            return 200, ("leader\n" if leading else "standby\n")
        if path == "/readyz":
            if leading and self.ready.is_set():
                return 200, "leader\n"
            return 503, "standby: another replica holds the lease\n"
        return 404, "not found\n"

    async def tick(self) -> None:
        """Runs on kopf's loop: proves to /healthz that the loop turns."""
        while True:
            self.loop_turned_at = time.monotonic()
            await asyncio.sleep(1.0)


async def elect(namespace: str, name: str, timing: ElectionTiming,
                probe_port: int) -> Elector:
    """Block (in a thread, kopf's loop stays free) until this replica leads; then keep the
    term in the background. Cancelled (SIGTERM while standby), the wait stops."""
    elector = Elector(Kube(await asyncio.to_thread(load_api_client)), namespace, name, timing)
    probes = Probes(elector, probe_port) if probe_port else None
    metrics.LEADER.set(0)
    try:
        acquired = await asyncio.shield(asyncio.to_thread(elector.acquire))
    except asyncio.CancelledError:
        elector.stopping.set()
        raise
    if not acquired:
        raise asyncio.CancelledError
    elector.keep()
    if probes is not None:
        elector.tick = asyncio.get_running_loop().create_task(probes.tick(), name="probe tick")
        probes.ready.set()
    return elector
