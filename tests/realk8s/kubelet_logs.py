"""The process kubelet's container logs, kept and served as a real kubelet keeps and serves
them, so that `GET pods/{name}/log` through the real API server (`kubectl logs`, `cephalo
logs`) works.

* Kept: each container's stdout and stderr are read from pipes and appended to its log file
  in the CRI logging format that containerd and CRI-O write and the kubelet reads
  (`<RFC 3339 nano timestamp> <stdout|stderr> <F|P> <content>`, P for a partial line).
* Served: one HTTPS server per node, at the node's InternalIP and the port the node reports in
  `status.daemonEndpoints.kubeletEndpoint.Port`, with a serving certificate from the test CA
  (the API server is started with `--kubelet-certificate-authority`, so it verifies it) and
  client certificates required (the API server's `--kubelet-client-certificate`). Path
  `/containerLogs/{namespace}/{pod}/{container}` with the query the API server forwards
  (pkg/registry/core/pod/strategy.go LogLocation): `follow` (stream until the container has
  exited and its log is read to the end), `tailLines`, `sinceSeconds`, `sinceTime`,
  `timestamps`, `limitBytes`, `previous` (containers are never restarted here: 400, as the
  kubelet answers when there is no previous container) and `stream` (All, Stdout, Stderr).
  A container not started yet is 400 "waiting to start", as the kubelet says.

Not emulated: the kubelet's SubjectAccessReview of the caller (any client certificate the test
CA signed is let in) and log rotation.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.server
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, unquote, urlsplit

FOLLOW_WAKE_SECONDS = 1.0  # a follower re-checks the container this often without new lines


def _timestamp(ns: int) -> str:
    """RFC 3339 with nanoseconds, trailing zeros trimmed (Go's time.RFC3339Nano)."""
    seconds, nanos = divmod(ns, 1_000_000_000)
    base = dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{nanos:09d}".rstrip("0")
    return f"{base}{'.' + fraction if fraction else ''}Z"


def _parse_timestamp(text: str) -> float:
    """Seconds since the epoch of an RFC 3339 time (any number of fraction digits)."""
    head, _, rest = text.rstrip("Z").partition(".")
    base = dt.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=dt.timezone.utc)
    return base.timestamp() + (float(f"0.{rest}") if rest else 0.0)


@dataclass(frozen=True)
class Entry:
    timestamp: str
    stream: str  # stdout | stderr
    content: bytes  # with its newline unless the line is partial

    @property
    def seconds(self) -> float:
        return _parse_timestamp(self.timestamp)


def parse_line(line: bytes) -> Entry | None:
    parts = line.rstrip(b"\n").split(b" ", 3)
    if len(parts) < 3:
        return None
    timestamp, stream, tag = (p.decode() for p in parts[:3])
    content = parts[3] if len(parts) == 4 else b""
    return Entry(timestamp, stream, content + (b"" if tag == "P" else b"\n"))


class ContainerLog:
    """One container's CRI log file: pumps append, readers wait on `changed`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.changed = threading.Condition()
        self.closed = False  # every writer has ended (the process exited, pipes drained)
        self.followers = 0  # `follow` streams being served now (tests wait for a reader)
        self._pumps: list[threading.Thread] = []
        path.touch()

    def pump(self, pipe: IO[bytes], stream: str) -> None:
        """Read `pipe` line by line into the log (a thread per stream)."""
        def run() -> None:
            with pipe:
                for chunk in iter(pipe.readline, b""):
                    tag, body = ("F", chunk[:-1]) if chunk.endswith(b"\n") else ("P", chunk)
                    with self.changed:  # stamped under the lock: file order is time order
                        record = f"{_timestamp(time.time_ns())} {stream} {tag} ".encode() + body
                        with self.path.open("ab") as f:
                            f.write(record + b"\n")
                        self.changed.notify_all()
        thread = threading.Thread(target=run, daemon=True, name=f"log-{stream}")
        self._pumps.append(thread)
        thread.start()

    def reading(self, follow: bool, delta: int) -> None:
        if follow:
            with self.changed:
                self.followers += delta

    def close(self, timeout_seconds: float = 10.0) -> None:
        """The process exited: wait for the pipes to drain (a child that kept them open is
        killed with its process group), then tell followers the log is complete."""
        for thread in self._pumps:
            thread.join(timeout_seconds)
        with self.changed:
            self.closed = True
            self.changed.notify_all()

    def entries(self) -> list[Entry]:
        lines = self.path.read_bytes().splitlines(keepends=True)
        return [e for e in map(parse_line, lines) if e is not None]

    def text(self) -> str:
        return b"".join(e.content for e in self.entries()).decode(errors="replace")


@dataclass(frozen=True)
class LogQuery:
    follow: bool = False
    tail_lines: int | None = None
    since_seconds: float | None = None  # an absolute time, from sinceSeconds or sinceTime
    timestamps: bool = False
    limit_bytes: int | None = None
    previous: bool = False
    stream: str = "All"

    @classmethod
    def parse(cls, query: str) -> LogQuery:
        q = {k: v[-1] for k, v in parse_qs(query).items()}
        truthy = {"true", "1"}
        since = None
        if "sinceSeconds" in q:
            since = time.time() - int(q["sinceSeconds"])
        elif "sinceTime" in q:
            since = _parse_timestamp(q["sinceTime"].replace("+00:00", "Z"))
        return cls(follow=q.get("follow") in truthy,
                   tail_lines=int(q["tailLines"]) if "tailLines" in q else None,
                   since_seconds=since, timestamps=q.get("timestamps") in truthy,
                   limit_bytes=int(q["limitBytes"]) if "limitBytes" in q else None,
                   previous=q.get("previous") in truthy, stream=q.get("stream", "All"))

    def wants(self, entry: Entry) -> bool:
        if self.stream != "All" and entry.stream != self.stream.lower():
            return False
        return self.since_seconds is None or entry.seconds >= self.since_seconds

    def render(self, entry: Entry) -> bytes:
        return (f"{entry.timestamp} ".encode() if self.timestamps else b"") + entry.content


def read_log(log: ContainerLog, query: LogQuery, stopped: Callable[[], bool]) -> Iterator[bytes]:
    """What the kubelet writes for `query`: the tail, then (follow) each new line until the
    container's log is closed and read to the end."""
    offset, pending = 0, b""
    first = True
    while True:
        with log.changed:
            closed = log.closed
            with log.path.open("rb") as f:
                f.seek(offset)
                data = f.read()
            offset += len(data)
            if not data and not closed and query.follow and not stopped():
                log.changed.wait(FOLLOW_WAKE_SECONDS)
                continue
        pending += data
        *lines, pending = pending.split(b"\n")
        entries = [e for e in (parse_line(line) for line in lines) if e and query.wants(e)]
        if first and query.tail_lines is not None:
            entries = entries[-query.tail_lines:] if query.tail_lines else []
        first = False
        for entry in entries:
            yield query.render(entry)
        if not query.follow or (closed and not data) or stopped():
            return


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: LogServer

    def setup(self) -> None:
        # The TLS handshake here, in the request's thread, not in the accepting one.
        self.request.do_handshake()
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the API server's log has the requests

    def _error(self, status: int, message: str) -> None:
        body = message.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/healthz":
            return self._error(200, "ok")
        parts = [unquote(p) for p in url.path.split("/")]
        if len(parts) != 5 or parts[1] != "containerLogs":
            return self._error(404, f"404 page not found: {url.path}")
        _, _, namespace, pod, container = parts
        try:
            query = LogQuery.parse(url.query)
        except ValueError as err:
            return self._error(400, f"invalid log query {url.query!r}: {err}")
        found = self.server.lookup(namespace, pod, container)
        if isinstance(found, tuple):
            return self._error(*found)
        if query.previous:
            return self._error(400, f'previous terminated container "{container}" in pod '
                                    f'"{pod}" not found')
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        left = query.limit_bytes
        found.reading(query.follow, +1)
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, ssl.SSLError):
                for chunk in read_log(found, query, self.server.stopped.is_set):
                    if left is not None:
                        chunk, left = chunk[:left], left - len(chunk[:left])
                    if chunk:
                        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                        self.wfile.flush()
                    if left == 0:
                        break
                self.wfile.write(b"0\r\n\r\n")
        finally:
            found.reading(query.follow, -1)
        self.close_connection = True


Lookup = Callable[[str, str, str], "ContainerLog | tuple[int, str]"]


class LogServer(http.server.ThreadingHTTPServer):
    """One node's kubelet HTTPS endpoint (logs only) on 127.0.0.1 and a free port."""

    daemon_threads = True

    def __init__(self, lookup: Lookup, cert: Path, key: Path, ca: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED  # the API server's kubelet client certificate
        context.set_alpn_protocols(["http/1.1"])
        self.socket = context.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)
        self.lookup = lookup
        self.stopped = threading.Event()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True,
                                        name="kubelet-logs")

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLError, TimeoutError)):
            super().handle_error(request, client_address)  # a defect here: say so

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> LogServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.shutdown()
        self.server_close()
