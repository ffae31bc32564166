"""Which failed rank to blame: the one whose log shows the real error, not a peer's echo.

When one rank dies (disk full, out of memory, a bug), the others fail a moment later inside a
collective with "Connection closed by peer" or a timeout. Whichever exit the launcher notices
first is an accident of polling, so the blame goes to the earliest-failing rank whose own
error is not a collective one; only when every failure is a collective echo does the first
one stand.

Shared by `cephalo run` (ranks' log tails) and the operator (rank pods' termination
messages, which fall back to the log tail on error), so both blame the same rank.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

# The last exception line of a Python traceback (torchrun prefixes `[rankN]: `), or the
# trainer's own one-line errors.
_ERROR_LINE = re.compile(
    r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*(?:Error|Exception|Exit)\b|cephalo trainer\b"
    r"[^:]*: error)[^\n]*)$", re.MULTILINE)

# Errors a rank gets because *another* rank went away or stalled (gloo, NCCL, c10d store),
# and the trainer's own pointers to another rank's log.
_COLLECTIVE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|gloo/transport|"
    r"DistBackendError|DistNetworkError|ProcessGroup(?:NCCL|Gloo)|NCCL (?:error|communicator)|"
    r"Watchdog caught collective operation timeout|collective operation timeout|"
    r"Socket Timeout|Timed out waiting|wait timeout|another rank|see its log", re.IGNORECASE)


@dataclass(frozen=True)
class RankFailure:
    rank: int
    exit_code: int | None  # None: still running when the launcher stopped it
    log_tail: str


def error_line(log_tail: str) -> str | None:
    """The last error a rank's log reports, or None."""
    found = _ERROR_LINE.findall(log_tail)
    return found[-1].strip() if found else None


def is_collective_echo(failure: RankFailure) -> bool:
    """True when this rank failed only because a peer did (its error names the transport)."""
    line = error_line(failure.log_tail)
    return line is not None and bool(_COLLECTIVE.search(line))


def describe(failure: RankFailure) -> str:
    """One line: the error in the log, or the signal that killed the rank."""
    line = error_line(failure.log_tail)
    if line:
        return line
    code = failure.exit_code
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (the out-of-memory killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return "no error in its log" if code is None else f"exit code {code}, no error in its log"


def root_cause(failures: list[RankFailure]) -> RankFailure:
    """`failures` in the order their exits were noticed (ranks still running at the end, with
    exit_code None, after them): the first whose own error is real, i.e. not a collective
    echo; ranks still running count only when their log shows such an error."""
    assert failures, "root_cause needs at least one failure"
    for f in failures:
        if f.exit_code is None:
            if error_line(f.log_tail) is not None and not is_collective_echo(f):
                return f
        elif not is_collective_echo(f):
            return f
    return next((f for f in failures if f.exit_code is not None), failures[0])
