"""`cephalo.client` and the cluster commands against the API emulator and the real operator
process (cluster_sim.TrainingSim plays the kubelet and the trainer).

`submit --watch` (piped and on a pseudo-terminal) and the first bad-input case run as the
installed `cephalo` console script in a subprocess, the way a user runs them: the console
script, the exit status and a terminal are what those check. The other commands run
`cephalo.cli.main` in this process (cli_in_process.py: the same parser, handlers and
one-line errors, ~1 CPU-second less each than a fresh interpreter importing the
kubernetes client). Both, and the client's own calls, run in a worker thread (the emulator
serves from this test's event loop).
"""

from __future__ import annotations

import asyncio
import json
import os
import pty
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio
import yaml
from cli_in_process import cephalo_in_process
from cluster_sim import TrainingSim, operator_env
from conftest import write_kubeconfig
from kube_emulator import ApiEmulator
from kube_fixtures import job_body
from kubelet import apply_job, call, free_port, set_pod, wait_for
from operator_harness import (  # noqa: F401 (fixtures)
    NS,
    cond,
    extra_passes_asked,
    plan_of,
    start_operator_fixture,
    wait_phase,
)

from cephalo.client import CephaloClient, WaitTimeout

pytestmark = pytest.mark.asyncio
CEPHALO = str(Path(sys.executable).parent / "cephalo")
TINY = {"model": {"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4,
                  "ffnHiddenSize": 256, "vocabSize": 256, "sequenceLength": 32},
        "globalBatchSize": 16, "training": {"steps": 20}, "checkpoint": {"ephemeral": True},
        "gpuPools": [{"product": "L4"}, {"product": "RTX-A6000"}],
        "planner": {"profileMicroBatchSizes": [1, 2, 4, 8, 16]}}


def job_file(tmp_path: Path, name: str, **spec: Any) -> Path:
    body = job_body(name, **{**TINY, **spec})
    del body["metadata"]["namespace"]  # as a user writes it: the context's namespace
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


async def cephalo(kubeconfig: Path | None, *args: str, tty: bool = False,
                  env: dict[str, str] | None = None,
                  timeout: float = 120.0) -> tuple[int, str, str]:
    """Run the `cephalo` command: (exit code, stdout, stderr)."""
    environ = {**os.environ, **(env or {})}
    if kubeconfig is not None:
        environ["KUBECONFIG"] = str(kubeconfig)
    if not tty:
        proc = await asyncio.create_subprocess_exec(
            CEPHALO, *args, env=environ, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
        return int(proc.returncode or 0), out.decode(), err.decode()
    master, slave = pty.openpty()
    proc = await asyncio.create_subprocess_exec(CEPHALO, *args, env=environ, stdout=slave,
                                                stderr=asyncio.subprocess.PIPE)
    os.close(slave)

    def read_all() -> bytes:
        data = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                return data
            if not chunk:
                return data
            data += chunk

    try:
        out, (_, err) = await asyncio.wait_for(asyncio.gather(
            asyncio.to_thread(read_all), proc.communicate()), timeout)
    finally:
        os.close(master)
    return int(proc.returncode or 0), out.decode(), err.decode()


@pytest_asyncio.fixture()
async def cluster(emulator: ApiEmulator, start_operator) -> AsyncIterator[TrainingSim]:
    """Cluster A, the operator, and the sim playing kubelet and trainer."""
    sim = await TrainingSim(emulator).start()
    start_operator(**operator_env(sim))
    try:
        yield sim
    finally:
        await sim.stop()


def one_line_error(rc: int, err: str, code: int = 2) -> str:
    print(f"exit {rc}: {err.strip()}")  # shown with -s (the README's and report's lines)
    assert rc == code, err
    assert "Traceback" not in err and err.strip() and "\n" not in err.strip(), err
    return err.strip()


async def test_submit_watch_to_succeeded_piped_and_on_a_terminal(
        emulator: ApiEmulator, cluster: TrainingSim, tmp_path: Path) -> None:
    rc, out, err = await cephalo(emulator.kubeconfig, "submit",
                                 str(job_file(tmp_path, "tiny")), "--watch")
    assert rc == 0, out + err
    assert "\r" not in out and "\x1b" not in out  # piped: plain lines only
    lines = out.splitlines()
    assert lines[0].startswith("cephalojob default/tiny created (context 'emulator'")
    assert any(line.startswith("Profiling: profiling NVIDIA-L4") for line in lines), out
    assert any(line.startswith("rank  GPU") for line in lines), out  # the plan, once decided
    progress = [line for line in lines if line.startswith("Running  step")]
    assert progress and "ETA" in progress[-1] and "samples/s" in progress[-1]
    assert progress[-1].startswith("Running  step 20/20 (100%)  loss "), out
    assert lines[-1].startswith("Succeeded: 1 rank completed; step 20, loss "), out
    # On a terminal: one line redrawn in place, with a bar (profiles are cached by now).
    rc, out, err = await cephalo(emulator.kubeconfig, "submit",
                                 str(job_file(tmp_path, "tiny-tty")), "--watch", tty=True)
    assert rc == 0, out + err
    assert "\r\x1b[2K" in out and "█" * 24 + "]  step 20/20 (100%)" in out, out
    assert "Succeeded: 1 rank completed" in out.splitlines()[-1]  # was "all 1 ranks"
    rc, out, _ = await cephalo_in_process(emulator.kubeconfig, "status")
    table = out.splitlines()
    assert rc == 0 and table[0].split()[:3] == ["NAME", "PHASE", "GPUS"], out
    assert any(r.split()[:4] == ["tiny", "Succeeded", "1xNVIDIA-L4", "20/20"] for r in table)
    # One job in full: its phase, the plan per rank and the conditions.
    rc, out, _ = await cephalo_in_process(emulator.kubeconfig, "status", "tiny")
    lines = out.splitlines()
    assert rc == 0 and lines[1].startswith("Phase:       Succeeded"), out
    assert [row.split()[:2] for row in lines if row.split()[1:2] == ["L4"]] == [["0", "L4"]], out
    conditions = [row.split()[:2] for row in lines[lines.index("Conditions:") + 1:]]
    assert ["Planned", "True"] in conditions and ["Succeeded", "True"] in conditions, out


async def test_logs_follow_rank_into_the_next_attempt_and_a_failed_job_exits_1(
        emulator: ApiEmulator, cluster: TrainingSim, tmp_path: Path) -> None:
    cluster.hold_profilers_until_read = True
    cluster.fail_at[("gr", 0)] = (1, 6)  # rank 1 crashes at step 6 of the first attempt
    client = await asyncio.to_thread(CephaloClient, kubeconfig=str(emulator.kubeconfig))
    spec = {"checkpoint": {"claimName": "ckpt"}, "planner": {"chooseGpus": False},
            "gpuPools": [{"product": "L4"}], "backoffLimit": 2}
    await asyncio.to_thread(client.submit, str(job_file(tmp_path, "gr", **spec)))
    everything = await asyncio.to_thread(lambda: [str(line) for line in client.logs(
        "gr", follow=True, rank=None, poll_seconds=0.1)])
    assert any(line.startswith("[profiler NVIDIA-L4] profiling") for line in everything), \
        everything
    rank1 = [line for line in everything if line.startswith("[rank 1]")]
    crash = rank1.index("[rank 1] RuntimeError: CUDA error: an illegal memory access was "
                        "encountered")
    assert rank1[crash + 1] == "[rank 1] --- attempt 1: pod gr-rank-1 (the gang restarted) ---"
    assert rank1[crash + 2].startswith("[rank 1] rank 1: attempt 1 started")
    assert rank1[-1] == "[rank 1] training done; final checkpoint written"
    assert (await asyncio.to_thread(client.get, "gr")).status.restarts == 1
    rc, out, _ = await cephalo_in_process(emulator.kubeconfig, "logs", "gr", "--rank", "1")
    assert rc == 0 and out.splitlines()[-1] == "[rank 1] training done; final checkpoint written"
    # A job that fails: `cephalo watch` exits 1 with the blamed rank and its reason.
    cluster.fail_at[("doomed", 0)] = (0, 4)
    await asyncio.to_thread(client.submit, str(job_file(tmp_path, "doomed", **{
        **spec, "backoffLimit": 0})))
    rc, out, err = await cephalo_in_process(emulator.kubeconfig, "watch", "doomed")
    assert one_line_error(rc, err, code=1).startswith(
        "Failed: BackoffLimitExceeded: rank 0 (pool NVIDIA-L4, pod doomed-rank-0) failed with "
        "exit code 1"), err
    rc, out, _ = await cephalo_in_process(emulator.kubeconfig, "status", "doomed")
    assert rc == 1 and "Blamed rank: rank 0 (pool NVIDIA-L4" in out and "Recent events:" in out


async def test_logs_follow_ends_quietly_when_the_job_is_deleted(
        emulator: ApiEmulator, cluster: TrainingSim, tmp_path: Path) -> None:
    # It raised JobNotFound ('no CephaloJob', exit 2) once the followed job was gone, and the
    # lines still queued were lost (found under tests/realk8s).
    client = await asyncio.to_thread(CephaloClient, kubeconfig=str(emulator.kubeconfig))
    spec = {"checkpoint": {"claimName": "ckpt"}, "planner": {"chooseGpus": False},
            "gpuPools": [{"product": "L4"}], "training": {"steps": 10**6}}
    await asyncio.to_thread(client.submit, str(job_file(tmp_path, "gone", **spec)))
    lines: list[str] = []

    def follow() -> None:
        lines.extend(str(line) for line in client.logs("gone", rank=0, follow=True,
                                                      poll_seconds=0.1))
    follower = asyncio.ensure_future(asyncio.to_thread(follow))
    await wait_for("rank 0 lines followed", lambda: any(
        line.startswith("[rank 0] ") for line in lines), timeout=120)
    await asyncio.to_thread(client.delete, "gone")
    await asyncio.wait_for(follower, 120)  # ends, and without an exception
    assert all(line.startswith("[rank 0] ") for line in lines), lines


async def test_plan_on_cluster_equals_the_operators_plan(
        emulator: ApiEmulator, cluster: TrainingSim, tmp_path: Path) -> None:
    # Taken: a foreign pod holds one L4; a running job reserves the A6000 (its rank pod is
    # not bound: planned, not on a node yet); the P100 node's taint is not tolerated.
    await call(emulator, "POST", "/api/v1/namespaces/other/pods", {
        "metadata": {"name": "foreign"}, "spec": {"nodeName": "a-l4", "containers": [{
            "name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}},
        "application/json")
    await set_pod(emulator, "other", "foreign", "Running")
    await call(emulator, "PATCH", "/api/v1/nodes/b-p100", {"spec": {"taints": [
        {"key": "team", "value": "ml", "effect": "NoSchedule"}]}})
    holder = job_file(tmp_path, "holder", training={"steps": 10**6},
                      gpuPools=[{"product": "RTX-A6000"}])
    # `submit` without --watch or --detach returns once planned
    rc, out, err = await cephalo_in_process(emulator.kubeconfig, "submit", str(holder))
    assert rc == 0 and "\n   0  RTX-A6000 " in out, out + err
    assert out.splitlines()[-1] == ("follow it: cephalo watch holder -n default; logs: cephalo "
                                    "logs holder -n default -f"), out
    await wait_phase(emulator, "holder", "Running", timeout=60)
    target = job_file(tmp_path, "target", gpuPools=None, checkpoint={"claimName": "ckpt"},
                      planner={"chooseGpus": False, "profileMicroBatchSizes": [1, 2, 4, 8]},
                      globalBatchSize=64)
    rc, out, err = await cephalo_in_process(emulator.kubeconfig, "submit", str(target), "--detach")
    assert rc == 0, err
    await wait_for("target planned", lambda: cond(emulator, "target", "Planned").get(
        "status") == "True", timeout=120)
    chosen = plan_of(emulator, "target")
    rc, out, err = await cephalo_in_process(emulator.kubeconfig, "plan", "--cluster", "--job",
                                            str(target), "--json")
    assert rc == 0, err
    assert json.loads(out) == json.loads(chosen.to_json())
    assert {r.pool for r in chosen.ranks} == {"NVIDIA-L4", "Tesla-P40"}  # what was free
    assert sum(r.pool == "NVIDIA-L4" for r in chosen.ranks) == 1
    said = err.splitlines()
    assert any("taken a-l4" in s and "1 GPU(s) by pod other/foreign" in s for s in said), err
    assert any("taken pool NVIDIA-RTX-A6000" in s and "CephaloJob default/holder (planned, "
               "not on a node yet)" in s for s in said), err
    assert any("not usable: b-p100: tainted team:NoSchedule" in s for s in said), err
    assert any("profile L4: cached ConfigMap cephalo-profile-l4-" in s for s in said), err
    # gpt-small at batch 64 on two GPUs takes microbatches above 8: the operator measured
    # them first (issue 46 item 3), and the preview planned with that pass's cached profile.
    assert extra_passes_asked(emulator, "target")["rounds"] >= 1
    assert any("+ ConfigMap cephalo-profile-" in s and "(sizes " in s for s in said), err
    assert not any(r.extrapolated for r in chosen.ranks), chosen.to_json()


async def test_bad_input_and_bad_clusters_are_one_line_each(
        emulator: ApiEmulator, tmp_path: Path) -> None:
    home = {"HOME": str(tmp_path)}
    ok = str(job_file(tmp_path, "ok"))
    rc, _, err = await cephalo(None, "status", env={**home, "KUBECONFIG": ""})
    assert one_line_error(rc, err) == (
        "cephalo status: error: no kubeconfig: ~/.kube/config does not exist; point "
        "KUBECONFIG (or --kubeconfig) at your cluster's kubeconfig")
    garbage = tmp_path / "garbage"
    garbage.write_text("clusters: [\n")
    rc, _, err = await cephalo_in_process(garbage, "status", env=home)
    assert one_line_error(rc, err).startswith(f"cephalo status: error: kubeconfig {garbage} is "
                                              "not a kubeconfig: "), err
    dead = write_kubeconfig(tmp_path / "dead", f"http://127.0.0.1:{free_port()}")
    rc, _, err = await cephalo_in_process(dead, "status", env=home)
    assert "cannot reach the Kubernetes API server (context 'emulator', server http://127.0.0.1:" \
        in one_line_error(rc, err) and "connection refused" in err, err
    async with ApiEmulator() as bare, kmock.Server(bare) as server:
        no_crd = write_kubeconfig(tmp_path / "bare", str(server.url).rstrip("/"))
        rc, _, err = await cephalo_in_process(no_crd, "submit", ok, env=home)
    assert one_line_error(rc, err).endswith(
        "has no CephaloJob resource (cephalojobs.cephalo.dev): install the chart: helm install "
        "cephalo charts/cephalo-operator -n cephalo-system --create-namespace"), err
    emulator.forbidden.add(("create", "cephalojobs"))
    rc, _, err = await cephalo_in_process(emulator.kubeconfig, "submit", ok, env=home)
    assert one_line_error(rc, err).startswith(
        "cephalo submit: error: RBAC forbids create on cephalojobs.cephalo.dev in namespace "
        "default (context 'emulator', server http"), err
    emulator.forbidden.clear()
    rc, _, err = await cephalo_in_process(emulator.kubeconfig, "status", "nope", env=home)
    assert one_line_error(rc, err).startswith(
        "cephalo status: error: no CephaloJob 'nope' in namespace default"), err
    await apply_job(emulator, job_body("elsewhere", namespace="team-a"))
    rc, _, err = await cephalo_in_process(emulator.kubeconfig, "logs", "elsewhere", env=home)
    assert one_line_error(rc, err) == (
        "cephalo logs: error: no CephaloJob 'elsewhere' in namespace default; there is one in "
        "namespace team-a: add --namespace team-a")
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(ok).read_text().replace("globalBatchSize: 16", "globalBatchSize: 0"))
    posts = len([c for c in emulator.calls if c.verb == "create"])
    rc, _, err = await cephalo_in_process(emulator.kubeconfig, "submit", str(bad), env=home)
    assert one_line_error(rc, err) == (
        f"cephalo submit: error: {bad}: spec.globalBatchSize: Input should be greater than or "
        "equal to 1")
    assert len([c for c in emulator.calls if c.verb == "create"]) == posts  # nothing sent
    assert NS == "default"


async def test_watch_survives_dropped_streams_and_410_then_suspend_resume_delete(
        emulator: ApiEmulator, tmp_path: Path) -> None:
    """No operator: the test writes the job's status, as the operator would."""
    emulator.faults.watch_drop_seconds = 0.3  # every watch stream ends after 0.3 s
    await apply_job(emulator, job_body("w"))
    client = await asyncio.to_thread(CephaloClient, kubeconfig=str(emulator.kubeconfig))
    watching = asyncio.create_task(asyncio.to_thread(
        lambda: [(j.phase, j.status.progress.step if j.status.progress else None)
                 for j in client.watch("w", timeout_seconds=60)]))
    path = "/apis/cephalo.dev/v1alpha1/namespaces/default/cephalojobs/w/status"
    watches = lambda: len([c for c in emulator.calls if c.verb == "watch"])  # noqa: E731
    for step in (1, 2, 3):
        # After a 410 the client reads the job again: changes made before that read are seen
        # as one. So each change waits for a watch started after any 410 was served.
        await wait_for("the 410 served", lambda: emulator.faults.expire_watches == 0)
        seen = watches()
        await wait_for("the watch resumed", lambda n=seen: watches() > n)  # type: ignore[misc]
        if step == 2:
            emulator.faults.expire_watches = 1  # the next resume gets 410 Gone
        await call(emulator, "PATCH", path, {"status": {"phase": "Running",
                                                        "progress": {"step": step}}})
    await call(emulator, "PATCH", path, {"status": {"phase": "Succeeded"}})
    seen_updates = await asyncio.wait_for(watching, 60)
    assert ("Running", 3) in seen_updates and seen_updates[-1][0] == "Succeeded", seen_updates
    assert [s for p, s in seen_updates if p == "Running" and s] == [1, 2, 3]  # once, in order
    assert emulator.faults.expire_watches == 0  # the 410 was served (and survived)
    assert (await asyncio.to_thread(client.wait, "w", timeout_seconds=5)).phase == "Succeeded"
    await apply_job(emulator, job_body("slow"))  # no operator here: it stays Pending
    with pytest.raises(WaitTimeout, match=r"CephaloJob 'slow' is still Pending after 0\.5 s"):
        await asyncio.to_thread(client.wait, "slow", timeout_seconds=0.5)
    for command, suspended in (("suspend", True), ("resume", False)):
        rc, out, err = await cephalo_in_process(emulator.kubeconfig, command, "w")
        assert rc == 0 and out.startswith(f"cephalojob default/w {command.rstrip('e')}ed"), err
        job = await asyncio.to_thread(client.get, "w")
        assert job.spec is not None and job.spec.suspend is suspended
    rc, out, err = await cephalo_in_process(emulator.kubeconfig, "delete", "w")
    assert rc == 0 and out == "cephalojob default/w deleted\n", err
    rc, _, err = await cephalo_in_process(emulator.kubeconfig, "delete", "w")
    assert one_line_error(rc, err).startswith("cephalo delete: error: no CephaloJob 'w'")
