"""`cephalo watch NAME`: follow a job to its end; exit 0 when it Succeeded, 1 when it Failed.

On a terminal, one live line (a progress bar, step/total, loss, samples/s measured and
predicted, ETA) is redrawn in place and phase changes are printed above it; piped, every
change is one plain line (no escape codes, no carriage returns)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

from cephalo.commands.cluster_args import add_cluster_arguments, client_from
from cephalo.commands.jobview import duration, progress_text

if TYPE_CHECKING:  # the kubernetes client only when a command connects (not for --help)
    from cephalo.client import CephaloClient, Job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="the CephaloJob")
    add_cluster_arguments(parser)


def follow(client: CephaloClient, name: str, namespace: str | None = None,
           out: TextIO | None = None) -> int:
    """Watch until the job ends; the exit code (0 Succeeded, 1 Failed)."""
    out = out or sys.stdout
    live = out.isatty()
    started = time.monotonic()
    phase: str | None = None
    message: str | None = None
    shown = ""
    plan_shown = False
    last: Job | None = None
    for job in client.watch(name, namespace=namespace):
        last = job
        if job.finished:
            break
        if job.phase != phase or (job.status.message != message and job.phase != "Running"):
            line = f"{job.phase}: {job.status.message or ''}".rstrip(": ")
            _say(out, line, live, bool(shown))
            shown = ""
            phase, message = job.phase, job.status.message
        if job.status.plan and job.status.plan.world_size and not plan_shown:
            plan = client.plan(job)
            if plan is not None:
                from cephalo.planner.outputs.report import format_plan
                model = job.spec.model.preset or job.spec.model.family if job.spec else None
                _say(out, format_plan(plan, model or "model"), live, bool(shown))
                shown = ""
                plan_shown = True
        if job.phase in ("Running", "Restarting") or job.status.progress:
            text = progress_text(job, bar=live)
            if text != shown:
                if live:
                    out.write("\r\x1b[2K" + text)
                else:
                    out.write(text + "\n")
                out.flush()
                shown = text
    if live and shown:
        out.write("\n")
    assert last is not None
    took = duration(time.monotonic() - started)
    if last.phase == "Succeeded":
        final = last.status.progress
        trained = (f"; step {final.step}, loss {final.loss:.4f}" if final and final.step
                   is not None and final.loss is not None else "")
        out.write(f"Succeeded: {last.status.message or ''}{trained} (watched {took})\n")
        out.flush()
        return 0
    out.flush()
    print(f"Failed: {last.failure_reason}", file=sys.stderr)
    return 1


def _say(out: TextIO, text: str, live: bool, over_bar: bool) -> None:
    if live and over_bar:
        out.write("\r\x1b[2K")
    out.write(text + "\n")
    out.flush()


def run(args: argparse.Namespace) -> int:
    return follow(client_from(args), args.name)
