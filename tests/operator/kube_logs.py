"""Pod logs in the API emulator: `GET /api/v1/namespaces/NS/pods/NAME/log`, as the real API
server proxies them from the kubelet (written from the API reference, not from our client):

* a log belongs to one pod object (its uid): a pod deleted and created again under the
  same name starts an empty log;
* `container` must name a container of the pod (400 otherwise); one that has not started
  yet answers 400 `container "X" in pod "Y" is waiting to start: ContainerCreating`;
* the body is `text/plain`, the lines so far (`tailLines` keeps the last N);
* `follow=true` streams (chunked) what is written from then on and ends when the container
  has terminated or the pod is gone.

A mixin of `kube_emulator.ApiEmulator`; the test (playing the kubelet) writes with
`write_log(namespace, pod, text)`.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

import aiohttp.web
from kmock._internal import rendering
from kube_selectors import api_error as _error

FOLLOW_POLL_SECONDS = 0.05  # how often a following stream looks at its pod's state


@dataclass
class PodLogs:
    lines: dict[str, list[str]] = field(default_factory=dict)  # pod uid → lines
    written: asyncio.Event = field(default_factory=asyncio.Event)


def _container_state(pod: dict[str, Any], container: str) -> dict[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return status.get("state") or {}
    return None


class LogVerbs:
    __slots__ = ()  # a mixin of an attrs-slotted class

    def write_log(self, namespace: str, pod: str, text: str) -> None:
        """The pod's container wrote `text` (one or more lines)."""
        obj = self._get(("", "pods", namespace, pod))
        uid = obj["metadata"]["uid"]
        self._logs.lines.setdefault(uid, []).extend(text.rstrip("\n").split("\n"))
        self._logs.written.set()
        self._logs.written = asyncio.Event()

    def _log_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._store.get(("", "pods", namespace, name))

    async def _serve_log(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        namespace, name = request.namespace, request.name
        pod = self._log_pod(namespace, name)
        if pod is None:
            raise _error(404, "NotFound", f'pods "{name}" not found')
        containers = [c.get("name") for c in (pod.get("spec") or {}).get("containers") or []]
        container = request.params.get("container") or (containers[0] if len(containers) == 1
                                                         else None)
        if container is None:
            raise _error(400, "BadRequest", f"a container name must be specified for pod "
                         f"{name}, choose one of: {containers}")
        if container not in containers:
            raise _error(400, "BadRequest", f"container {container} is not valid for pod {name}")
        state = _container_state(pod, container) or {}
        if not (state.get("running") or state.get("terminated")):
            why = (state.get("waiting") or {}).get("reason") or "ContainerCreating"
            raise _error(400, "BadRequest",
                         f'container "{container}" in pod "{name}" is waiting to start: {why}')
        uid = pod["metadata"]["uid"]
        lines = self._logs.lines.get(uid, [])
        tail = request.params.get("tailLines")
        start = max(0, len(lines) - int(tail)) if tail else 0
        raw = request._raw_request
        assert raw is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/plain"})
        response.enable_chunked_encoding()
        await response.prepare(raw)
        sent = start
        follow = request.params.get("follow") in ("true", "1")
        while True:
            current = self._log_pod(namespace, name)  # before sending: nothing written is lost
            ended = (current is None or current["metadata"]["uid"] != uid
                     or (_container_state(current, container) or {}).get("terminated"))
            lines = self._logs.lines.get(uid, [])
            if sent < len(lines):
                await response.write("".join(f"{line}\n" for line in lines[sent:]).encode())
                sent = len(lines)
            if not follow or ended:
                break
            written = self._logs.written
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(written.wait(), FOLLOW_POLL_SECONDS)
        await response.write_eof()
        return response
