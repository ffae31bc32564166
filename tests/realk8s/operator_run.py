"""Helpers of the operator tests: the operator process (`kopf run`), a bound claim, the
tiny job."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cluster import OPERATOR_NAMESPACE, Cluster
from .controlplane import dies_with_its_starter, free_port
from .rest import wait_until

JOBS = "/apis/cephalo.dev/v1alpha1/namespaces/{ns}/cephalojobs"
JOB_SECONDS = 300.0  # profiling two tiny models and six steps on two shared cores


class Operator:
    """`kopf run -m cephalo.operator -A --standalone` against a kubeconfig."""

    def __init__(self, kubeconfig: Path, log_path: Path,
                 extra_env: dict[str, str] | None = None) -> None:
        self.kubeconfig, self.log_path, self.extra_env = kubeconfig, log_path, extra_env or {}
        # Its /metrics (what the chart's ServiceMonitor scrapes), on a port free on this
        # machine, the same across restart().
        self.metrics_port = int(self.extra_env.get("CEPHALO_OPERATOR_METRICS_PORT")
                                or free_port())
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        log_path = self.log_path
        # The ranks' /metrics port, free on this machine: every pod shares its loopback here,
        # and another session's rank 0 may hold the default 9400 (the scrape would read it).
        env = {"CEPHALO_OPERATOR_METRICS_PORT": str(self.metrics_port),
               "CEPHALO_TRAINER_METRICS_PORT": str(free_port()),
               "CEPHALO_RECHECK_SECONDS": "1", "CEPHALO_PROGRESS_INTERVAL_SECONDS": "1",
               "CEPHALO_WATCH_TIMEOUT_SECONDS": "60", "CEPHALO_NODE_DEBOUNCE_SECONDS": "0.2",
               # The network probe is its own test's (test_operator_netprobe): elsewhere a
               # job is planned as soon as profiled.
               "CEPHALO_NETWORK_PROBE": "false",
               # As the chart's Deployment sets it (the downward API): the network cache is
               # read in the operator's namespace, where the chart's Role lets it list.
               "CEPHALO_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
               "KUBECONFIG": str(self.kubeconfig), **self.extra_env}
        with log_path.open("ab") as log:
            return subprocess.Popen(dies_with_its_starter(
                [sys.executable, "-m", "kopf", "run", "-m", "cephalo.operator", "-A",
                 "--standalone", "--liveness", f"http://127.0.0.1:{free_port()}/healthz"]),
                env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)

    def restart(self) -> None:
        """Stopped (a test needed the cluster without it): start it again, same settings."""
        self.stop()
        self.proc = self._start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                self.proc.wait()

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path.exists() else 0

    def log_text(self, since: int = 0) -> str:
        """The log from byte `since` on (what one test's part of a session's operator said)."""
        with self.log_path.open("rb") as f:
            f.seek(since)
            return f.read().decode(errors="replace")

    def log(self) -> str:
        return f"--- operator ---\n{self.log_path.read_text(errors='replace')[-8000:]}"


def phases_until(cluster: Cluster, ns: str, name: str, since: str, until: set[str],
                 timeout_seconds: float, statuses: list[dict[str, Any]] | None = None,
                 reached: Callable[[dict[str, Any]], bool] | None = None
                 ) -> tuple[list[str], dict[str, Any]]:
    """Every phase the job went through after resourceVersion `since`, from a watch (no
    change is missed, however short), until one of `until` or a status `reached` accepts;
    and its status then. `statuses`: when given, every status the watch showed is appended
    to it, oldest first (for a verdict on what the job showed on its way, not only at the
    end)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_seconds
    version = since
    while time.monotonic() < deadline:
        for event in cluster.rest.watch(JOBS.format(ns=ns), version, lambda: False):
            obj = event.get("object") or {}
            if event.get("type") == "ERROR" or "metadata" not in obj:
                # The watch ended with an error (e.g. 410 Gone: `version` compacted away on
                # a busy server): watch again from now (the job's status still carries the
                # phase it reached; a phase passed in the gap is not seen).
                version = cluster.rest.must("GET", JOBS.format(ns=ns))["metadata"][
                    "resourceVersion"]
                break
            version = obj["metadata"].get("resourceVersion", version)
            if event["type"] not in ("ADDED", "MODIFIED") or obj["metadata"]["name"] != name:
                continue
            status = obj.get("status") or {}
            if statuses is not None:
                statuses.append(status)
            if (phase := status.get("phase")) and (not seen or seen[-1] != phase):
                seen.append(phase)
            if phase in until or (reached is not None and reached(status)):
                return seen, status
    raise AssertionError(f"timed out after {timeout_seconds:.0f} s waiting for job {name} in "
                         f"{sorted(until)}{' or the status awaited' if reached else ''} "
                         f"(phases so far: {seen})")


def cached_profiles(cluster: Cluster, ns: str) -> list[str]:
    """The operator's cached GPU profiles (ConfigMaps) in namespace `ns`."""
    return [cm["metadata"]["name"] for cm in cluster.rest.must(
        "GET", f"/api/v1/namespaces/{ns}/configmaps")["items"]
        if cm["metadata"]["name"].startswith("cephalo-profile-")]


def profiles_cached_for(cluster: Cluster, ns: str, body: dict[str, Any]) -> bool:
    """Whether the operator holds a cached profile of `body`'s model for every product of the
    session's nodes: the job then plans without profiling. Not "any profile is cached":
    other tests seed profiles of their own models in the shared namespace (a faults test that
    went by any cached profile expected no Profiling phase after the hybrid test ran, and
    failed a fresh-clone CI run)."""
    from cephalo.api import parse_job
    from cephalo.operator.config import OperatorConfig
    from cephalo.operator.render import profile_config_map_name
    from cephalo.planner.cost.catalog import lookup_gpu

    from .cluster import NODES

    job = parse_job(body)
    wanted = {profile_config_map_name(lookup_gpu(n.product).name, job, OperatorConfig())
              for n in NODES}
    return wanted <= set(cached_profiles(cluster, ns))


def seed_estimated_profiles(cluster: Cluster, ns: str, body: dict[str, Any],
                            products: Sequence[str] = ()) -> list[str]:
    """Cache, as the operator caches a measured profile (its own ConfigMap name and key), the
    catalog's estimate of every node's GPU for `body`'s model: the job then plans with the
    real GPUs' figures, not a CPU's, and starts no profiler pod. Returns the names written.

    For tests whose verdict compares a job's measured speed with its prediction: a profile
    measured on this shared CPU is as fast as the machine was quiet (issue 46: one measured
    while another test's ranks ran at niceness -20 was ~30x slow and cached), while a
    GPU's estimate is orders of magnitude faster than any CPU rank, on any machine.
    `products`: these GPU products (a test's own nodes) instead of the session's nodes'."""
    from cephalo.api import parse_job
    from cephalo.planner import estimate_profile
    from cephalo.planner.cost.catalog import lookup_gpu, resolve_precision

    from .cluster import NODES

    job = parse_job(body)
    spec = job.spec
    names = []
    for product in sorted(set(products) or {n.product for n in NODES}):
        gpu = lookup_gpu(product)
        profile = estimate_profile(gpu.name, spec.model.resolve(),
                                   resolve_precision(spec.precision, gpu),
                                   spec.planner.profile_micro_batch_sizes)
        names.append(_cache_profile(cluster, ns, job, gpu.name, profile.to_compact_json()))
    return names


def _cache_profile(cluster: Cluster, ns: str, job: Any, product: str, profile_json: str) -> str:
    """Write `profile_json` where the operator caches `product`'s profile of `job`'s model
    (its own ConfigMap name, labels and key), replacing an entry already there; its name."""
    from cephalo.operator.config import OperatorConfig
    from cephalo.operator.render import (
        LABEL_PROFILE,
        LABEL_ROLE,
        PROFILE_KEY,
        profile_config_map_name,
    )

    name = profile_config_map_name(product, job, OperatorConfig())
    cluster.rest.request("DELETE", f"/api/v1/namespaces/{ns}/configmaps/{name}")
    cluster.rest.create(f"/api/v1/namespaces/{ns}/configmaps", {
        "metadata": {"name": name, "labels": {LABEL_PROFILE: "true",
                                              LABEL_ROLE: "profile-cache"}},
        "data": {PROFILE_KEY: profile_json, "product": product}})
    return name


# One CPU profile per (model, precision, sizes) for the session: measured once, by the
# profiler the operator's profiler pods run (`python -m cephalo.trainer.profile`).
_CPU_PROFILES: dict[str, str] = {}


def _straightened(profile_json: str) -> str:
    """The profile with each of its four compute times replaced by the least-squares line
    a + b·m through its measured points (a >= 0, b > 0: a microbatch costs a fixed part
    plus a part per sample), so that equal GPUs split a batch evenly whatever noise the
    measurement caught. Memory, fixed costs and the rest stay as measured."""
    import numpy as np

    from cephalo.api import GpuProfile

    profile = GpuProfile.model_validate_json(profile_json)
    sizes = np.array([p.micro_batch_size for p in profile.points], dtype=np.float64)
    times = ("block_forward_seconds", "block_backward_seconds", "other_forward_seconds",
             "other_backward_seconds")
    fitted: dict[str, np.ndarray] = {}
    for name in times:
        seconds = np.array([getattr(p, name) for p in profile.points], dtype=np.float64)
        slope, intercept = np.polyfit(sizes, seconds, 1) if sizes.size > 1 else (0.0, 0.0)
        slope = max(float(slope), float(np.mean(seconds / sizes)) * 1e-3)
        fitted[name] = max(float(intercept), 0.0) + slope * sizes
    points = [p.model_copy(update={name: float(fitted[name][i]) for name in times})
              for i, p in enumerate(profile.points)]
    return profile.model_copy(update={"points": points}).to_compact_json()


def seed_one_cpu_profile(cluster: Cluster, ns: str, body: dict[str, Any],
                         micro_batch_sizes: Sequence[int], tmp_dir: Path) -> list[str]:
    """Cache ONE profile of this CPU, measured at `micro_batch_sizes` by the real profiler,
    as every session node's GPU's profile of `body`'s model: the job plans its two GPUs as
    the equals they are (both are this CPU) and starts no profiler pod. Returns the names
    written.

    For tests whose verdict needs the plan a symmetric cluster gets (an even split, both GPUs
    used). Two profiler pods measuring the same CPU at once on a loaded machine measure it
    differently (a fresh-clone CI run at load 7 planned [0, 16] for two such GPUs: one
    rank idle, nothing to rebalance from, and two re-plan tests on one GPU from the start),
    and a plan extrapolates microbatch sizes beyond those measured from two noisy points;
    `micro_batch_sizes` should cover every size the job's plan may take. The measured
    times are then replaced by their straight-line fit over the sizes (`_straightened`):
    one size measured during a load spike made a larger microbatch look cheaper per sample,
    and the plan put all 16 samples on one GPU (a run beside a loaded machine, load 7)."""
    import json

    import yaml

    from cephalo.api import parse_job
    from cephalo.planner.cost.catalog import lookup_gpu

    from .cluster import NODES

    job = parse_job(body)
    key = json.dumps([body["spec"]["model"], job.spec.precision, sorted(micro_batch_sizes)],
                     sort_keys=True)
    if key not in _CPU_PROFILES:
        job_file, out = tmp_dir / "profiled-job.yaml", tmp_dir / "cpu-profile.json"
        job_file.write_text(yaml.safe_dump(body))
        run = subprocess.run(
            [sys.executable, "-m", "cephalo.trainer.profile", "--job", str(job_file),
             "--device", "cpu", "--cache-dir", "none", "--output", str(out),
             "--micro-batch-sizes", ",".join(map(str, sorted(micro_batch_sizes)))],
            capture_output=True, text=True, timeout=JOB_SECONDS)
        assert run.returncode == 0, run.stderr
        _CPU_PROFILES[key] = _straightened(out.read_text())
    return [_cache_profile(cluster, ns, job, lookup_gpu(product).name, _CPU_PROFILES[key])
            for product in sorted({n.product for n in NODES})]


def make_claim(cluster: Cluster, ns: str, name: str) -> None:
    """A ReadWriteMany claim bound to a PersistentVolume by the real PV controller (the
    process kubelet maps the claim to one local folder for every pod)."""
    pv = f"{ns}-{name}"
    cluster.rest.create("/api/v1/persistentvolumes", {"metadata": {"name": pv}, "spec": {
        "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
        "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "",
        "hostPath": {"path": f"/nonexistent/{pv}"},
        "claimRef": {"namespace": ns, "name": name}}})
    cluster.rest.create(f"/api/v1/namespaces/{ns}/persistentvolumeclaims", {
        "metadata": {"name": name}, "spec": {"accessModes": ["ReadWriteMany"],
                                             "storageClassName": "", "volumeName": pv,
                                             "resources": {"requests": {"storage": "1Gi"}}}})
    wait_until(f"claim {ns}/{name} Bound", lambda: cluster.rest.get(
        f"/api/v1/namespaces/{ns}/persistentvolumeclaims/{name}").body.get(
        "status", {}).get("phase") == "Bound", 60)


def tiny_job(name: str, ns: str, **spec: Any) -> dict[str, Any]:
    """examples/custom-tiny-gpt.yaml, scaled down: six steps, two ranks (one a GPU node).

    Profiled at 1, 2 and the global batch: no rank's microbatch (at most its batch) lies
    above the profiled sizes, so the operator never makes its extra profiler pass for sizes
    beyond them (issue 46 item 3; a real profiler pod per product, and a Profiling phase
    after Planning). The emulator's tests cover that pass."""
    batch = int(spec.get("globalBatchSize", 8))
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"model": {"family": "gpt", "numLayers": 2, "hiddenSize": 64,
                               "numHeads": 4, "ffnHiddenSize": 256, "vocabSize": 256,
                               "sequenceLength": 32},
                     "globalBatchSize": batch, "training": {"steps": 6, "learningRate": 1.0e-3,
                                                            "schedule": "constant", "seed": 1},
                     "data": {"synthetic": {}},
                     # CPU ranks planned as GPUs: calibrated and reported, never re-planned
                     # (a re-plan restarts both trainers; tests/realk8s/test_operator_replan
                     # is re-planning's test)
                     "planner": {"profileMicroBatchSizes": sorted({1, 2, batch}),
                                 "chooseGpus": False, "replan": {"maxReplans": 0}},
                     "ranksPerPod": 1, "checkpoint": {"claimName": "ckpt", "intervalSteps": 3},
                     "backoffLimit": 1, **spec}}
