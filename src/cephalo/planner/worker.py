"""`solve` in a child process with its own memory and CPU-time limits (the operator's side is
`cephalo.operator.planning`). Whatever the spec makes the planner do, the child reports one
of three outcomes through a pipe, and the parent never shares its fate:

* `("ok", plan_json)`;
* `("error", reason, message)` — reason `Infeasible` (no plan fits: the user's numbers),
  `InvalidSpec` (a ValueError about the input, e.g. an unknown GPU product) or
  `PlanningFailed` (out of memory, or any other exception: a bug to report);
* nothing (the child was killed: time-out, OOM-kill, crash) — the parent says which.

This module imports only the planner and the API types, so a forkserver can preload it and
fork a planning child in milliseconds.
"""

from __future__ import annotations

import json
import os
import resource
from typing import Any

from cephalo.api import ClusterSpec, GpuProfile
from cephalo.api.job import CephaloJobSpec
from cephalo.planner import InfeasibleError, solve


def encode_request(spec: CephaloJobSpec, cluster: ClusterSpec,
                   profiles: dict[str, GpuProfile] | None) -> str:
    """The inputs as JSON (what crosses the pipe: no pickled objects)."""
    return json.dumps({
        "spec": spec.model_dump(by_alias=True, exclude_none=True, mode="json"),
        "cluster": cluster.model_dump(mode="json"),
        "profiles": {k: p.model_dump(mode="json") for k, p in (profiles or {}).items()},
    })


def _virtual_bytes() -> int:
    """This process's address-space size now (Linux); 0 where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def limit_resources(memory_bytes: int, cpu_seconds: int) -> None:
    """Cap the address space at what the process has now + memory_bytes (a forked child
    already maps the interpreter and numpy: the allowance is for planning), and CPU time."""
    limit = _virtual_bytes() + memory_bytes
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 5))


def one_line(text: str, limit_chars: int = 500) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit_chars else line[: limit_chars - 1] + "…"


def run_request(request: str, memory_bytes: int) -> tuple[Any, ...]:
    """Solve one encoded request; the outcome tuple (see the module docstring)."""
    try:
        data = json.loads(request)
        spec = CephaloJobSpec.model_validate(data["spec"])
        cluster = ClusterSpec.model_validate(data["cluster"])
        profiles = {k: GpuProfile.model_validate(v) for k, v in data["profiles"].items()}
        return ("ok", solve(spec, cluster, profiles or None).to_json())
    except MemoryError:
        return ("error", "PlanningFailed",
                f"planning needed more than its {memory_bytes // 2**20} MiB memory allowance "
                "(CEPHALO_PLANNING_MEMORY_BYTES); lower globalBatchSize or use fewer GPU pools")
    except InfeasibleError as err:
        return ("error", "Infeasible", one_line(str(err)))
    except ValueError as err:
        return ("error", "InvalidSpec", one_line(str(err)))
    except Exception as err:  # a planner bug: fail this job, keep the operator
        return ("error", "PlanningFailed",
                one_line(f"the planner failed: {type(err).__name__}: {err}"))


def child_main(conn: Any, request: str, memory_bytes: int, cpu_seconds: int) -> None:
    """Entry point of the planning child: limits, solve, send the outcome, exit."""
    try:
        limit_resources(memory_bytes, cpu_seconds)
        outcome = run_request(request, memory_bytes)
        try:
            conn.send(outcome)
        except MemoryError:
            conn.send(("error", "PlanningFailed",
                       "the plan is too large to return within the memory allowance"))
    finally:
        conn.close()
