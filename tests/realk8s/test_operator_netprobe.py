"""Issue 35 item 1 under the real control plane: the operator (the chart's ServiceAccount and
RBAC, its network probe on) measures the network between the cluster's two GPU nodes with a
real probe gang — two `python -m cephalo.trainer.netprobe` processes the real scheduler
placed on the two nodes (pod anti-affinity), gloo on this machine's loopback — caches it in a
ConfigMap, and plans with it; a second job reuses it (no probe), and `cephalo status` and
`cephalo plan --cluster` show it.

The session's operator runs with the probe off (every other realk8s test plans as soon as
profiled); this test stops it, runs one with the probe on, and starts it again after."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from cephalo.api.network_profile import MEASURED_SOURCE, NETWORK_PROFILE_KEY, NetworkProfile
from cephalo.cli import main as cli_main

from .cluster import OPERATOR_NAMESPACE, Cluster
from .operator_auth import operator_kubeconfig
from .operator_run import JOB_SECONDS, JOBS, Operator, phases_until, tiny_job
from .rest import wait_until


@pytest.fixture
def probing(cluster: Cluster, operator_process: Operator, tmp_path: Path,
            on_failure: Callable[[Callable[[], str]], None]) -> Iterator[Operator]:
    operator_process.stop()
    proc = Operator(operator_kubeconfig(cluster), tmp_path / "operator.log",
                    extra_env={"CEPHALO_NETWORK_PROBE": "true",
                               # as the chart's downward API says it: the cache's namespace
                               "CEPHALO_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE})
    on_failure(proc.log)
    try:
        yield proc
    finally:
        proc.stop()
        operator_process.restart()


def _network_config_maps(cluster: Cluster, ns: str = OPERATOR_NAMESPACE
                         ) -> dict[str, NetworkProfile]:
    items = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/configmaps", params={
        "labelSelector": "cephalo.dev/network-profile=true"})["items"]
    return {cm["metadata"]["name"]: NetworkProfile.model_validate_json(
        cm["data"][NETWORK_PROFILE_KEY]) for cm in items}


def _finished(cluster: Cluster, ns: str, job: dict[str, object]) -> dict[str, object]:
    meta = job["metadata"]
    assert isinstance(meta, dict)
    phases, status = phases_until(cluster, ns, meta["name"], meta["resourceVersion"],
                                  {"Succeeded", "Failed"}, JOB_SECONDS)
    assert phases[-1] == "Succeeded", f"{phases}: {status.get('message')}"
    return status


def test_the_network_is_measured_under_the_real_api_server(
        cluster: Cluster, probing: Operator, job_namespace: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    ns = job_namespace
    for name in _network_config_maps(cluster):  # another run's measurement: measure now
        cluster.rest.request("DELETE",
                             f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/configmaps/{name}")
    started = time.monotonic()
    first = cluster.rest.create(JOBS.format(ns=ns), tiny_job("netp", ns),
                                fieldValidation="Strict")
    status = _finished(cluster, ns, first)
    measured = _network_config_maps(cluster)
    assert not _network_config_maps(cluster, ns)  # the job's namespace holds none
    assert len(measured) == 1, measured  # one pair of pools; one GPU a node: nothing intra
    (profile,) = measured.values()
    assert profile.kind == "inter-node" and sorted(profile.pools) == [
        "NVIDIA-RTX-A6000", "Tesla-P40"]
    assert sorted(profile.nodes) == ["gpu-a6000", "gpu-p40"]  # one rank on each node
    assert profile.collectives.world_size == 2 and profile.bandwidth_bytes_per_second > 0
    assert profile.measured_for == first["metadata"]["uid"]  # type: ignore[index]
    plan = status["plan"]
    assert isinstance(plan, dict) and plan["networkSource"] == MEASURED_SOURCE, plan
    conditions = {c["type"]: c for c in status["conditions"]}  # type: ignore[union-attr]
    assert conditions["NetworkMeasured"]["status"] == "True", conditions
    assert "forbidden" not in probing.log_text().lower(), probing.log()  # the chart's RBAC
    print(f"realk8s: netp measured {profile.describe()} and trained in "
          f"{time.monotonic() - started:.0f} s")

    # The second job: the cached measurement, no probe pod; the client shows it.
    job_file = tmp_path / "netq.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job("netq", ns)))
    where = ["--namespace", ns, "--kubeconfig", str(cluster.plane.kubeconfig)]
    capsys.readouterr()
    assert cli_main(["plan", "--cluster", "--job", str(job_file), *where]) == 0
    preview = capsys.readouterr()
    shown = preview.out + preview.err
    assert f"network: inter-node {' <-> '.join(profile.pools)}" in shown, shown
    assert MEASURED_SOURCE in shown, shown
    second = cluster.rest.create(JOBS.format(ns=ns), tiny_job("netq", ns),
                                 fieldValidation="Strict")
    status = _finished(cluster, ns, second)
    assert status["plan"]["networkSource"] == MEASURED_SOURCE  # type: ignore[index]
    assert _network_config_maps(cluster) == measured  # not measured again
    assert "netq: network probe" not in probing.log_text(), probing.log()
    capsys.readouterr()
    assert cli_main(["status", "netq", *where]) == 0
    details = capsys.readouterr().out
    assert "NetworkMeasured" in details and MEASURED_SOURCE in details, details
    for name in ("netp", "netq"):
        cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/{name}")
    wait_until("the jobs gone", lambda: all(cluster.rest.get(
        f"{JOBS.format(ns=ns)}/{n}").status == 404 for n in ("netp", "netq")), JOB_SECONDS)
