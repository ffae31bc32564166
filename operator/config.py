"""Operator settings, read once from the environment (kopf owns the command line).

Every knob is an environment variable so the Helm chart can set it; defaults suit a real
cluster, tests shorten the intervals.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from cephalo.api.tracking import MLFLOW_URI_PATTERN
from cephalo.operator.lease import ElectionTiming
from cephalo.operator.locality import DEFAULT_LOCALITY_LABELS
from cephalo.operator.policy import (
    RESTRICTED_VOLUME_TYPES,
    JobPolicy,
    parse_image_prefixes,
    parse_names,
    parse_tolerations,
    parse_volume_types,
    split_names,
)

# A Kubernetes label key: an optional DNS-subdomain prefix and '/', then a name of at most
# 63 characters (alphanumerics, '-', '_', '.', alphanumeric at both ends).
LABEL_KEY = r"([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?" \
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
DEFAULT_TRAINER_IMAGE = "ghcr.io/cephalo/cephalo-trainer:0.1.0"


@dataclass(frozen=True)
class OperatorConfig:
    trainer_image: str = DEFAULT_TRAINER_IMAGE  # CEPHALO_TRAINER_IMAGE
    metrics_port: int = 8080  # CEPHALO_OPERATOR_METRICS_PORT: operator /metrics; 0 = off
    trainer_metrics_port: int = 9400  # CEPHALO_TRAINER_METRICS_PORT: rank /metrics (scraped)
    master_port: int = 29500  # CEPHALO_MASTER_PORT: torch.distributed rendezvous
    recheck_seconds: float = 10.0  # CEPHALO_RECHECK_SECONDS: reconcile period per job
    progress_interval_seconds: float = 15.0  # CEPHALO_PROGRESS_INTERVAL_SECONDS (≤ 30 s)
    profile_timeout_seconds: float = 900.0  # CEPHALO_PROFILE_TIMEOUT_SECONDS per attempt
    profile_retries: int = 2  # CEPHALO_PROFILE_RETRIES: attempts after the first
    discovery_timeout_seconds: float = 3600.0  # CEPHALO_DISCOVERY_TIMEOUT_SECONDS
    watch_timeout_seconds: int = 300  # CEPHALO_WATCH_TIMEOUT_SECONDS (kopf server_timeout)
    run_as_user: int = 1000  # CEPHALO_RUN_AS_USER: non-root uid of trainer/profiler pods
    # CEPHALO_NODE_DEBOUNCE_SECONDS: node events within this window wake each job once.
    node_debounce_seconds: float = 1.0
    # CEPHALO_NODE_RESYNC_SECONDS: the node view (kept by the watch) is re-listed this often.
    node_resync_seconds: float = 300.0
    # CEPHALO_POD_GONE_GRACE_SECONDS: a running rank pod that a look finds gone is judged
    # (disrupted, or vanished: a failure) by its deletion event from the pod watch, which
    # can come after the look; it is awaited this long at most (0: judge at once).
    pod_gone_grace_seconds: float = 30.0
    # CEPHALO_PLANNING_TIMEOUT_SECONDS: a job whose planning takes longer fails
    # (PlanningFailed); the planner runs in a child process that is then killed.
    planning_timeout_seconds: float = 300.0
    # CEPHALO_PLANNING_MEMORY_BYTES: memory the planning child may allocate (RLIMIT_AS over
    # its start); the chart's memory limit must cover the operator plus this.
    planning_memory_bytes: int = 512 * 1024**2
    # CEPHALO_JOB_NETWORK_POLICIES (the chart's networkPolicy.enabled): give each job a
    # NetworkPolicy that admits only its own ranks (operator/netpol.py).
    job_network_policies: bool = False
    # CEPHALO_GPU_PRICES_PER_HOUR (the chart's gpuPricesPerHour, as JSON): price of one GPU
    # for an hour per GPU type, for jobs whose planner.gpuPricesPerHour is unset (the cost
    # objective, and the prices every plan states). "" or "{}": none.
    gpu_prices_per_hour: str = ""
    # The chart's jobPolicy (cephalo.operator.policy): what a job's podTemplate may ask of
    # the pods the operator creates. CEPHALO_ALLOWED_VOLUME_TYPES (comma-separated; default
    # the types Pod Security `restricted` allows), CEPHALO_ALLOW_SERVICE_ACCOUNT_NAME and
    # CEPHALO_ALLOWED_SERVICE_ACCOUNT_NAMES (comma-separated; empty: any, when allowed).
    allowed_volume_types: str = ",".join(RESTRICTED_VOLUME_TYPES)
    allow_service_account_name: bool = False
    allowed_service_account_names: str = ""
    # CEPHALO_ALLOWED_IMAGE_PREFIXES (registry hosts or repository paths),
    # CEPHALO_ALLOWED_PRIORITY_CLASS_NAMES and CEPHALO_ALLOWED_TOLERATIONS (key or
    # key:effect), each comma-separated; empty: no restriction.
    allowed_image_prefixes: str = ""
    allowed_priority_class_names: str = ""
    allowed_tolerations: str = ""

    # Leader election (cephalo.operator.leader; the chart sets these): CEPHALO_LEADER_
    # ELECTION_NAMESPACE names the namespace of the Lease (the operator's own); "" (kopf run
    # by hand, a single replica) means no election: this process reconciles at once.
    leader_election_namespace: str = ""
    leader_election_lease: str = "cephalo-operator"  # CEPHALO_LEADER_ELECTION_LEASE
    # CEPHALO_LEASE_DURATION_SECONDS, CEPHALO_RENEW_DEADLINE_SECONDS, CEPHALO_RETRY_PERIOD_
    # SECONDS: client-go's durations (a standby takes over within lease + retry).
    lease_duration_seconds: int = 15
    renew_deadline_seconds: float = 10.0
    retry_period_seconds: float = 2.0
    # CEPHALO_PROBE_PORT: /healthz and /readyz of a replica under election (0: none).
    probe_port: int = 0

    # The network probe (operator/netprobe.py; the chart's networkProbe): CEPHALO_NETWORK_
    # PROBE measures the links between the job's GPUs before it is planned (off: plan with
    # node labels or the default); a measurement is reused until CEPHALO_NETWORK_PROFILE_MAX_
    # AGE_SECONDS old; a probe not done within CEPHALO_NETWORK_PROBE_TIMEOUT_SECONDS of its
    # creation (pending, or a node that cannot reach the other) is given up: the job plans
    # without it and says so.
    network_probe: bool = True
    # CEPHALO_MEASURE_EXTRA_SIZES: a plan's micro-batch sizes beyond the profiled ones get
    # one more profiler pass per product before the plan is used (issue 46 item 3): a
    # rank's memory there is a linear extrapolation, which can put it out of memory on its
    # first step. Off: such a plan is used and says which sizes it extrapolated.
    measure_extra_sizes: bool = True
    # CEPHALO_OPERATOR_NAMESPACE (the chart: the pod's own namespace, by the downward API):
    # where the network measurements are cached, once for every namespace's jobs and
    # readable by the operator alone; "" (kopf run by hand): in each job's namespace.
    operator_namespace: str = ""
    network_profile_max_age_seconds: float = 7 * 86400.0
    network_probe_timeout_seconds: float = 300.0

    # CEPHALO_KUEUE_TOPOLOGY_LEVEL (the chart's placement.kueueTopologyLevel): a level of the
    # cluster's Kueue Topology (its node label, e.g. network.topology.nvidia.com/leaf or
    # topology.kubernetes.io/zone). Rank pods of a job queued through Kueue then request the
    # placement the plan assumes at that level (operator/placement.py); "": no request (a
    # level the Topology lacks would leave the job inadmissible, so it is never guessed).
    kueue_topology_level: str = ""
    # CEPHALO_LOCALITY_LABELS (the chart's placement.localityLabels, comma-separated,
    # innermost first): node labels that say which nodes share a switch or zone; the plan's
    # rank order and replica groups follow them (operator/locality.py). "": none.
    locality_labels: str = ",".join(DEFAULT_LOCALITY_LABELS)

    # CEPHALO_MLFLOW_URI (the chart's tracking.mlflowUri): the MLflow tracking server of jobs
    # whose spec.tracking.mlflow gives no trackingUri (rank pods get MLFLOW_TRACKING_URI).
    mlflow_uri: str = ""

    def job_policy(self) -> JobPolicy:
        """The job policy, parsed (checked at startup by `from_env`)."""
        return JobPolicy(parse_volume_types(self.allowed_volume_types),
                         self.allow_service_account_name,
                         frozenset(split_names(self.allowed_service_account_names)),
                         parse_image_prefixes(self.allowed_image_prefixes),
                         parse_names(self.allowed_priority_class_names),
                         parse_tolerations(self.allowed_tolerations))

    def locality_label_keys(self) -> tuple[str, ...]:
        return tuple(split_names(self.locality_labels))

    def election_timing(self) -> ElectionTiming:
        return ElectionTiming(self.lease_duration_seconds, self.renew_deadline_seconds,
                              self.retry_period_seconds)

    def prices(self) -> dict[str, float]:
        """The price list, parsed (checked at startup by `from_env`)."""
        return _parse_prices(self.gpu_prices_per_hour)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> OperatorConfig:
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = "CEPHALO_" + f.name.upper()
            if f.name == "metrics_port":
                name = "CEPHALO_OPERATOR_METRICS_PORT"
            if name not in env:
                continue
            raw = env[name]
            kind: type = type(f.default)  # every field has a default of its own type
            try:
                values[f.name] = _parse_bool(raw) if kind is bool else kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None
            problem = _out_of_range(f.name, values[f.name])
            if problem:
                raise ValueError(f"{name}={raw!r} {problem}")
        if "gpu_prices_per_hour" in values:
            try:
                _parse_prices(values["gpu_prices_per_hour"])
            except ValueError as err:
                raise ValueError(f"CEPHALO_GPU_PRICES_PER_HOUR: {err}") from None
        for field, parse in _POLICY_LISTS.items():
            if field in values:
                try:
                    parse(values[field])
                except ValueError as err:
                    raise ValueError(f"CEPHALO_{field.upper()}: {err}") from None
        uri = values.get("mlflow_uri", "")
        if uri and not re.fullmatch(MLFLOW_URI_PATTERN, uri):
            raise ValueError(f"CEPHALO_MLFLOW_URI={uri[:80]!r} must be an http(s) URL of an "
                             "MLflow tracking server (or databricks), without user:password@")
        level = values.get("kueue_topology_level", "")
        if level and not re.fullmatch(LABEL_KEY, level):
            raise ValueError(f"CEPHALO_KUEUE_TOPOLOGY_LEVEL={level[:80]!r} must be a node label "
                             "key such as topology.kubernetes.io/zone (a level of the cluster's "
                             "Kueue Topology), or empty for none")
        for key in split_names(values.get("locality_labels", "")):
            if not re.fullmatch(LABEL_KEY, key):
                raise ValueError(f"CEPHALO_LOCALITY_LABELS: {key[:80]!r} is not a node label "
                                 "key; give keys such as topology.kubernetes.io/zone, "
                                 "comma-separated, innermost first")
        config = cls(**values)
        if config.leader_election_namespace and (problem := config.election_timing().problem()):
            raise ValueError(f"leader election: {problem}")
        return config


# The jobPolicy lists whose every name is checked at start-up (a typo refused, not
# silently allowing nothing or everything).
_POLICY_LISTS: dict[str, Callable[[str], object]] = {
    "allowed_volume_types": parse_volume_types, "allowed_image_prefixes": parse_image_prefixes,
    "allowed_priority_class_names": parse_names, "allowed_tolerations": parse_tolerations}


def _parse_prices(raw: str) -> dict[str, float]:
    """A JSON object of GPU type -> positive finite price per hour (at most 64 types)."""
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise ValueError(f"{raw[:80]!r} is not a JSON object such as "
                         '{"NVIDIA-L4": 0.8}') from None
    if not isinstance(data, dict) or len(data) > 64:
        raise ValueError("must be a JSON object of at most 64 GPU types, e.g. "
                         '{"NVIDIA-L4": 0.8}')
    prices = {}
    for gpu, price in data.items():
        if isinstance(price, bool) or not isinstance(price, int | float) or \
                not math.isfinite(price) or not 0 < price <= 100_000:
            raise ValueError(f"the price of {str(gpu)[:64]!r} must be a number in (0, 100000], "
                             f"not {price!r}")
        prices[str(gpu)] = float(price)
    return prices


# What each number may be (minimum, whether the minimum itself is allowed, maximum; None: no
# bound). Out of range the operator refuses to start: a zero recheck period would be a busy
# loop against the API server, a negative retry count no profiling at all. The Helm chart's
# values.schema.json may be stricter, never looser (tests/chart checks).
BOUNDS: dict[str, tuple[float, bool, float | None]] = {
    "metrics_port": (0, True, 65535),  # 0: no operator /metrics
    "trainer_metrics_port": (1, True, 65535),
    "master_port": (1, True, 65535),
    "recheck_seconds": (0, False, None),
    "progress_interval_seconds": (0, False, 30),
    "profile_timeout_seconds": (0, False, None),
    "profile_retries": (0, True, None),
    "discovery_timeout_seconds": (0, False, None),
    "watch_timeout_seconds": (1, True, None),
    "run_as_user": (1, True, None),  # never root
    "node_debounce_seconds": (0, True, None),
    "node_resync_seconds": (0, False, None),
    "planning_timeout_seconds": (0, False, None),
    "pod_gone_grace_seconds": (0, True, None),
    "planning_memory_bytes": (1024**2, True, None),  # the chart asks 64 MiB or more
    "lease_duration_seconds": (1, True, 3600),
    "renew_deadline_seconds": (0, False, 3600),
    "retry_period_seconds": (0, False, 3600),
    "probe_port": (0, True, 65535),
    "network_profile_max_age_seconds": (0, False, None),
    "network_probe_timeout_seconds": (0, False, None),
}


def _out_of_range(field: str, value: Any) -> str | None:
    if field not in BOUNDS:
        return None
    low, inclusive, high = BOUNDS[field]
    if isinstance(value, float) and not math.isfinite(value):
        return "must be a finite number"
    if value < low or (value == low and not inclusive) or (high is not None and value > high):
        lower = f">= {low:g}" if inclusive else f"> {low:g}"
        return f"must be {lower}" + (f" and <= {high:g}" if high is not None else "")
    return None


def _parse_bool(raw: str) -> bool:
    """`bool("false")` is True: spell the accepted words out (as Helm renders a bool)."""
    word = raw.strip().lower()
    if word in ("1", "true", "yes"):
        return True
    if word in ("0", "false", "no", ""):
        return False
    raise ValueError(raw)
