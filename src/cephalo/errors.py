"""The one base class of user-facing errors.

A `CephaloError` is a mistake in what the user gave (a file, a flag, a spec) or a condition
they can fix; its message is one line saying what is wrong and how to fix it. The `cephalo`
command prints it as `cephalo <command>: error: <message>` and exits with code 2. Any other
exception is a bug in Cephalo and keeps its traceback.
"""

from __future__ import annotations


class CephaloError(Exception):
    """A user-facing error: one line, what is wrong and how to fix it."""

    def __str__(self) -> str:
        # One line whatever the cause put in it: a pydantic dump or a multi-line OS message
        # would otherwise spill over several lines of stderr.
        return " ".join(super().__str__().split())


class Terminated(KeyboardInterrupt):
    """SIGTERM to the CLI (cephalo.cli), handled as Ctrl-C is (`cephalo run` stops its ranks
    and profilers and says how to resume) but answered with SIGTERM's exit code, 143."""
