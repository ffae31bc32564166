"""The operator as a local process (`kopf run`), authenticated as the chart's ServiceAccount
with a real token (so the chart's RBAC decides every request), runs a small job under the
real control plane: real profiler and trainer processes (CPU, gloo) started by the process
kubelet on GPU-labelled nodes the real scheduler picked; Profiling -> Planning -> Running ->
Succeeded; the checkpoint the ranks wrote on the shared claim exports; the TTL deletes the
finished job (its pods garbage-collected) and a job of the same name, submitted and watched
through `cephalo submit --watch` (the client), runs again. `cephalo logs` reads the ranks'
logs through the real API server, and `cephalo plan --cluster` previews exactly the plan the
operator then chooses."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from cephalo.cli import main as cli_main

from .cluster import Cluster
from .operator_run import JOB_SECONDS, JOBS, Operator, phases_until, profiles_cached_for, tiny_job
from .rest import wait_until

# Short: the checks that need the finished job's pods run on the re-created job (no TTL);
# the phases are read from a watch, so the job's deletion cannot hide its last status.
TTL_SECONDS = 2
PHASE_ORDER = {p: i for i, p in enumerate(
    ("Profiling", "Planning", "Pending", "Running", "Succeeded"))}


def test_job_trains_under_the_real_api_server_and_exports(
        cluster: Cluster, operator: Operator, job_namespace: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    log_from = operator.log_size()  # one operator for the session: this test's part of its log
    ns = job_namespace
    # The namespace is the faults test's too: in the suite its job profiled both GPU products
    # already, and then this job must plan from the cached profiles, never profiling.
    body = tiny_job("tiny", ns, ttlSecondsAfterFinished=TTL_SECONDS)
    cached = profiles_cached_for(cluster, ns, body)
    started = time.monotonic()
    first = cluster.rest.create(JOBS.format(ns=ns), body, fieldValidation="Strict")
    phases, status = phases_until(cluster, ns, "tiny", first["metadata"]["resourceVersion"],
                                  {"Succeeded", "Failed"}, JOB_SECONDS)
    assert phases[-1] == "Succeeded", f"{phases}: {status.get('message')}"
    # In order; Running only where a pass of the operator saw both ranks running: six tiny
    # steps take milliseconds, and on a loaded machine the ranks may have finished by its
    # next look (the faults test's long job checks Running).
    order = [p for p in ("Profiling", "Planning", "Running", "Succeeded") if p in phases]
    expected = ([] if cached else ["Profiling"]) + ["Planning", "Running", "Succeeded"]
    assert order in (expected, [p for p in expected if p != "Running"]), (cached, phases)
    assert phases == sorted(phases, key=lambda p: PHASE_ORDER.get(p, -1)), phases
    print(f"realk8s: job tiny {' -> '.join(phases)} in {time.monotonic() - started:.0f} s")
    # Its last step, not the last one a scrape saw (issue 39 item 10: rank 0's termination
    # message, through the real API server's pod status).
    steps = first["spec"]["training"]["steps"]
    assert (status["progress"]["step"], status["progress"]["totalSteps"]) == (steps, steps), \
        status
    # The chart's RBAC sufficed: the real authorizer refused the operator nothing.
    assert "forbidden" not in operator.log_text(log_from).lower(), operator.log()
    # The checkpoint the ranks wrote on the shared claim is a model that exports.
    folder = cluster.kubelet.claim_folder(ns, "ckpt") / "tiny"
    out = tmp_path / "model.pt"
    started = time.monotonic()
    # in-process: torch is loaded once
    assert cli_main(["export", str(folder), "--output", str(out)]) == 0
    print(f"realk8s: export in {time.monotonic() - started:.1f} s")
    state = torch.load(out, weights_only=True)
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())

    # TTL: the finished job deletes itself and the garbage collector takes its pods.
    path = f"{JOBS.format(ns=ns)}/tiny"
    wait_until("the TTL deleting the job", lambda: cluster.rest.get(path).status == 404,
               JOB_SECONDS)
    wait_until("the job's pods collected", lambda: not cluster.rest.must(
        "GET", f"/api/v1/namespaces/{ns}/pods",
        params={"labelSelector": "cephalo.dev/job=tiny"})["items"], JOB_SECONDS)
    # Re-created with the same name: a new object, planned and run again.
    # This time through the client, as a user would (issue 27): `cephalo submit --watch`
    # follows it to Succeeded (exit 0), then `cephalo status` lists it.
    job_file = tmp_path / "tiny.yaml"
    job_file.write_text(yaml.safe_dump(tiny_job("tiny", ns)))
    where = ["--namespace", ns, "--kubeconfig", str(cluster.plane.kubeconfig)]
    # First the preview: `cephalo plan --cluster` runs the operator's own discovery and planner
    # on what it reads from the real API server (nodes, pods, jobs, the profiles the first job
    # cached); the operator's plan for the job, below, must be exactly this one.
    capsys.readouterr()
    assert cli_main(["plan", "--cluster", "--job", str(job_file), "--json", *where]) == 0
    preview = capsys.readouterr()
    assert "profile RTX-A6000: cached ConfigMap cephalo-profile-" in preview.err, preview.err
    assert "profile P40: cached ConfigMap cephalo-profile-" in preview.err, preview.err
    assert cli_main(["submit", str(job_file), "--watch", *where]) == 0
    watched = capsys.readouterr().out
    assert "created" in watched and "Succeeded" in watched.splitlines()[-1], watched
    second = cluster.rest.must("GET", f"{JOBS.format(ns=ns)}/tiny")
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    assert second["status"]["phase"] == "Succeeded"
    # resumed at its last step: it trained none, and still says where it ended
    assert second["status"]["progress"]["step"] == steps, second["status"]
    plan_map = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/configmaps/tiny-plan")
    assert json.loads(preview.out) == json.loads(plan_map["data"]["plan.json"])
    assert cli_main(["status", *where]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:2] == ["NAME", "PHASE"]
    assert table[1].split()[:2] == ["tiny", "Succeeded"], table
    # `cephalo logs --all` through the real API server and the kubelet's log endpoint: each
    # rank pod's log as the kubelet kept it, every line prefixed by its rank; --rank 1 alone.
    capsys.readouterr()
    assert cli_main(["logs", "tiny", "--all", *where]) == 0
    shown = capsys.readouterr().out.splitlines()
    kept = {f"rank {r}": cluster.kubelet.log_of(ns, f"tiny-rank-{r}").splitlines()
            for r in (0, 1)}
    assert [line for line in shown if not line.startswith("[profiler ")] == [
        f"[{label}] {line}" for label, lines in kept.items() for line in lines], shown
    # (it resumed from the first job's final checkpoint: same name, same claim)
    assert any(line.startswith("[rank 0] cephalo trainer: resumed from ") for line in shown)
    assert cli_main(["logs", "tiny", "--rank", "1", *where]) == 0
    assert capsys.readouterr().out.splitlines() == [f"[rank 1] {x}" for x in kept["rank 1"]]
    # Real pods ran where the real scheduler put them: one rank on each GPU node.
    pods = cluster.rest.must("GET", f"/api/v1/namespaces/{ns}/pods",
                             params={"labelSelector": "cephalo.dev/role=trainer"})["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == ["gpu-a6000", "gpu-p40"], pods
    assert all(p["status"]["phase"] == "Succeeded" for p in pods)
