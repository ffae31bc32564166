"""The trainer environment contract (docs/architecture.md, "Trainer environment"): every
variable name, one writer (`to_environ`) and one reader (`read_env`).

The operator (rank and profiler pods), `cephalo run` (local ranks) and the trainer all go
through here, so a name is spelled once and a value is formatted and parsed one way. Like
torchrun's, the variables are flat strings; this module turns them into typed values and
rejects malformed ones with a one-line `EnvError`. Whether a set of values makes sense for
a job (the plan's world size, this rank's batch size) is the trainer's check
(`cephalo.trainer.env`), which needs the plan and job files. Torch-free and
Kubernetes-free: the operator image and the trainer both import it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from cephalo.errors import CephaloError

# torchrun's own names (torch.distributed reads these).
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
# Cephalo's: files, this rank's share of the plan (for humans and checks), where things go.
JOB = "CEPHALO_JOB"  # path of a CephaloJob YAML
PLAN = "CEPHALO_PLAN"  # path of the plan JSON (every rank needs all ranks' batches/ratios)
BATCH_SIZE = "CEPHALO_BATCH_SIZE"
MICRO_BATCH_SIZE = "CEPHALO_MICRO_BATCH_SIZE"
NUM_MICRO_BATCHES = "CEPHALO_NUM_MICRO_BATCHES"
SHARD_RATIO = "CEPHALO_SHARD_RATIO"
# A shared folder or an fsspec URL; set and empty = this job keeps no checkpoints.
CHECKPOINT_DIR = "CEPHALO_CHECKPOINT_DIR"
METRICS_PORT = "CEPHALO_METRICS_PORT"  # rank /metrics port (+ LOCAL_RANK); 0 = off
# The address rank /metrics listens on; unset: every interface. E.g. 127.0.0.1 behind an
# authenticating sidecar (kube-rbac-proxy), or the pod's own IP where pods share a network.
METRICS_ADDRESS = "CEPHALO_METRICS_ADDRESS"
RESTART_ATTEMPT = "CEPHALO_RESTART_ATTEMPT"  # the operator's gang-restart counter
METRICS_FILE = "CEPHALO_METRICS_FILE"  # rank 0's JSON-lines progress file (local runs)
NUM_THREADS = "CEPHALO_NUM_THREADS"  # torch intra-op threads (local ranks share the CPU)
TIME_DILATION = "CEPHALO_TIME_DILATION"  # emulate a device this much slower (>= 1)
# The dilation applies from this step (0-based) on, real speed before it: a device that slows
# down mid-run (live rebalancing's tests, docs/rebalancing.md). Unset or 0: from the start.
TIME_DILATION_FROM_STEP = "CEPHALO_TIME_DILATION_FROM_STEP"
# Emulate a slow network (tests, docs/replanning.md): every collective also crosses one
# serial link of this many bytes/s.
LINK_BYTES_PER_SECOND = "CEPHALO_LINK_BYTES_PER_SECOND"
MEMORY_LIMIT_BYTES = "CEPHALO_MEMORY_LIMIT_BYTES"  # emulated device capacity
COLLECTIVE_TIMEOUT_SECONDS = "CEPHALO_COLLECTIVE_TIMEOUT_SECONDS"
STOP_AFTER_STEP = "CEPHALO_STOP_AFTER_STEP"  # leave after this step (tests, --stop-after)
DATA_CACHE = "CEPHALO_DATA_CACHE"  # folder of tokenized text streams (data.text)
TOKENIZE_WORKERS = "CEPHALO_TOKENIZE_WORKERS"  # processes that tokenize a text corpus
# A pod running several ranks (one per GPU of a node): RANK is its first rank, and the
# trainer's pod launcher starts this many processes, RANK+i with LOCAL_RANK i (pod_process_environ).
RANKS_PER_POD = "CEPHALO_RANKS_PER_POD"
# The rank pod's metadata.uid (the downward API): rank 0's /metrics says whose page it is, so
# the operator never takes another pod's progress for its job's (a reused pod IP, pods that
# share a network namespace).
POD_UID = "CEPHALO_POD_UID"
# The container's terminationMessagePath: rank 0 writes its final progress there when it
# completes (cephalo.api.status.FinalProgress), so the operator records the last step even
# when its last /metrics scrape was steps earlier or never got through.
TERMINATION_LOG = "CEPHALO_TERMINATION_LOG"

DEFAULT_COLLECTIVE_TIMEOUT_SECONDS = 600.0
# What a trainer rank cannot start without (the profiler needs only JOB).
REQUIRED = (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, PLAN, JOB)

# What the operator sets on every rank pod (a pod template may not override these; the
# other variables, e.g. the collective timeout, are the team's to set).
OPERATOR_SET = (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, JOB, PLAN, BATCH_SIZE,
                MICRO_BATCH_SIZE, NUM_MICRO_BATCHES, SHARD_RATIO, CHECKPOINT_DIR, METRICS_PORT,
                RESTART_ATTEMPT, RANKS_PER_POD, POD_UID, TERMINATION_LOG)


class EnvError(CephaloError, ValueError):
    """A trainer environment that cannot work; the message says what to set."""


@dataclass(frozen=True)
class TrainerVars:
    """The contract's values, typed; None = the variable is not set. Field order is the
    order `to_environ` writes them in (the operator's rendered pods keep it)."""

    rank: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    job: str | None = None
    plan: str | None = None
    batch_size: int | None = None
    micro_batch_size: int | None = None
    num_micro_batches: int | None = None
    shard_ratio: float | None = None
    checkpoint_dir: str | None = None  # "" is kept: set and empty means "no checkpoints"
    metrics_port: int | None = None
    restart_attempt: int | None = None
    metrics_file: str | None = None
    num_threads: int | None = None
    time_dilation: float | None = None
    memory_limit_bytes: int | None = None
    collective_timeout_seconds: float | None = None
    stop_after_step: int | None = None
    data_cache: str | None = None
    tokenize_workers: int | None = None
    ranks_per_pod: int | None = None
    pod_uid: str | None = None
    metrics_address: str | None = None
    termination_log: str | None = None
    link_bytes_per_second: float | None = None
    time_dilation_from_step: int | None = None


# field name -> variable name, in writing order.
NAMES: dict[str, str] = {
    "rank": RANK, "world_size": WORLD_SIZE, "local_rank": LOCAL_RANK,
    "master_addr": MASTER_ADDR, "master_port": MASTER_PORT, "job": JOB, "plan": PLAN,
    "batch_size": BATCH_SIZE, "micro_batch_size": MICRO_BATCH_SIZE,
    "num_micro_batches": NUM_MICRO_BATCHES, "shard_ratio": SHARD_RATIO,
    "checkpoint_dir": CHECKPOINT_DIR, "metrics_port": METRICS_PORT,
    "restart_attempt": RESTART_ATTEMPT, "metrics_file": METRICS_FILE,
    "num_threads": NUM_THREADS, "time_dilation": TIME_DILATION,
    "memory_limit_bytes": MEMORY_LIMIT_BYTES,
    "collective_timeout_seconds": COLLECTIVE_TIMEOUT_SECONDS,
    "stop_after_step": STOP_AFTER_STEP, "data_cache": DATA_CACHE,
    "tokenize_workers": TOKENIZE_WORKERS, "ranks_per_pod": RANKS_PER_POD,
    "pod_uid": POD_UID, "metrics_address": METRICS_ADDRESS,
    "termination_log": TERMINATION_LOG,
    "link_bytes_per_second": LINK_BYTES_PER_SECOND,
    "time_dilation_from_step": TIME_DILATION_FROM_STEP,
}
assert list(NAMES) == [f.name for f in fields(TrainerVars)], "NAMES must follow TrainerVars"
ALL_NAMES = frozenset(NAMES.values())
# Variables whose empty value means something (others: empty = unset).
_EMPTY_IS_A_VALUE = frozenset({CHECKPOINT_DIR})


def _format(value: int | float | str) -> str:
    # repr keeps every bit of a float (a shard ratio must read back equal to the plan's).
    return repr(value) if isinstance(value, float) else str(value)


def to_environ(values: TrainerVars) -> dict[str, str]:
    """The one writer: the set variables, formatted, in TrainerVars' field order."""
    out: dict[str, str] = {}
    for field_name, name in NAMES.items():
        value = getattr(values, field_name)
        if value is not None:
            out[name] = _format(value)
    return out


def missing(values: TrainerVars, required: tuple[str, ...] = REQUIRED) -> list[str]:
    """The `required` variables that `values` lacks."""
    unset = {name for field_name, name in NAMES.items() if getattr(values, field_name) is None}
    return [name for name in required if name in unset]


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer") from None


def _float(name: str, raw: str) -> float:
    try:
        return float(raw)  # nan and inf parse; the range checks refuse them
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a number") from None


def _str(name: str, raw: str) -> str:
    return raw


_PARSERS: dict[str, Callable[[str, str], int | float | str]] = {
    "int | None": _int, "float | None": _float, "str | None": _str}


def read_env(env: Mapping[str, str] | None = None) -> TrainerVars:
    """The one reader: parse what is set (default: this process's environment); raises
    EnvError on a malformed or out-of-range value. Missing variables stay None: what a
    process needs depends on the process (REQUIRED: a trainer rank)."""
    env = os.environ if env is None else env
    values: dict[str, int | float | str] = {}
    for f in fields(TrainerVars):
        name = NAMES[f.name]
        raw = env.get(name)
        if raw is None:
            continue
        raw = raw.strip()
        if raw == "" and name not in _EMPTY_IS_A_VALUE:
            continue
        values[f.name] = _PARSERS[str(f.type)](name, raw)
    parsed = TrainerVars(**values)  # type: ignore[arg-type]
    _check_ranges(parsed)
    return parsed


def _check_ranges(v: TrainerVars) -> None:
    if v.world_size is not None and v.world_size < 1:
        raise EnvError(f"{WORLD_SIZE}={v.world_size} must be >= 1")
    if v.rank is not None and v.world_size is not None and not 0 <= v.rank < v.world_size:
        raise EnvError(f"{RANK}={v.rank} must be in [0, {WORLD_SIZE}={v.world_size})")
    for name, port in ((MASTER_PORT, v.master_port), (METRICS_PORT, v.metrics_port)):
        if port is not None and not 0 <= port < 65536:
            raise EnvError(f"{name}={port} is not a port" +
                           (" (0 disables metrics)" if name == METRICS_PORT else ""))
    if v.time_dilation is not None and not 1.0 <= v.time_dilation < math.inf:
        raise EnvError(f"{TIME_DILATION}={v.time_dilation} must be >= 1 (1 = real speed)")
    link = v.link_bytes_per_second
    if link is not None and not 0 < link < math.inf:
        raise EnvError(f"{LINK_BYTES_PER_SECOND}={link} must be a bandwidth in bytes/s > 0")
    if v.shard_ratio is not None and not 0.0 <= v.shard_ratio <= 1.0:
        raise EnvError(f"{SHARD_RATIO}={v.shard_ratio} must be in [0, 1]")
    timeout = v.collective_timeout_seconds
    if timeout is not None and not 0 < timeout < 10**7:  # also nan, inf: timedelta can't
        raise EnvError(f"{COLLECTIVE_TIMEOUT_SECONDS}={timeout} must be a number of "
                       f"seconds > 0 (default {DEFAULT_COLLECTIVE_TIMEOUT_SECONDS:.0f})")
    if v.ranks_per_pod is not None:
        if v.ranks_per_pod < 1:
            raise EnvError(f"{RANKS_PER_POD}={v.ranks_per_pod} must be >= 1")
        if v.rank is not None and v.world_size is not None and \
                v.rank + v.ranks_per_pod > v.world_size:
            raise EnvError(f"{RANKS_PER_POD}={v.ranks_per_pod} from {RANK}={v.rank} runs past "
                           f"{WORLD_SIZE}={v.world_size}")
    for name, count in ((LOCAL_RANK, v.local_rank), (NUM_THREADS, v.num_threads),
                        (MEMORY_LIMIT_BYTES, v.memory_limit_bytes),
                        (BATCH_SIZE, v.batch_size), (MICRO_BATCH_SIZE, v.micro_batch_size),
                        (NUM_MICRO_BATCHES, v.num_micro_batches),
                        (RESTART_ATTEMPT, v.restart_attempt),
                        (STOP_AFTER_STEP, v.stop_after_step),
                        (TIME_DILATION_FROM_STEP, v.time_dilation_from_step),
                        (TOKENIZE_WORKERS, v.tokenize_workers)):
        if count is not None and count < 0:
            raise EnvError(f"{name}={count} must be >= 0")


def pod_process_environ(env: Mapping[str, str], local_rank: int) -> dict[str, str]:
    """The environment of process `local_rank` of a pod that runs RANKS_PER_POD ranks: the
    pod's, with RANK = the pod's first rank + local_rank, LOCAL_RANK = local_rank (its GPU)
    and RANKS_PER_POD removed (the process is one rank). Written through `to_environ`."""
    pod = read_env(env)
    count = pod.ranks_per_pod or 1
    if pod.rank is None:
        raise EnvError(f"{RANKS_PER_POD}={count} needs {RANK} (the pod's first rank)")
    if not 0 <= local_rank < count:
        raise EnvError(f"local rank {local_rank} is outside the pod's {count} rank(s)")
    mine = to_environ(TrainerVars(rank=pod.rank + local_rank, local_rank=local_rank))
    out = {k: v for k, v in env.items() if k != RANKS_PER_POD}
    out.update(mine)
    return out
