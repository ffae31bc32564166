"""The realk8s suite's session fixtures: one real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler), GPU nodes kept Ready, a process kubelet, and
namespaces that enforce Pod Security `restricted`.

Every test here is marked `realk8s`. Without the binaries (scripts/k8s-binaries.sh builds
them where Go is installed) the whole folder skips with one reason."""

from __future__ import annotations

import contextlib
import io
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cephalo.cli import main as cli_main

from .cluster import CHART, CRD, NODES, OPERATOR_NAMESPACE, RELEASE, Cluster, run_tool
from .controlplane import ControlPlane, binaries_or_reason, elapsed
from .kubelet import ProcessKubelet
from .kueue import Kueue, kueue_or_reason, private_etc_or_reason
from .nodes import NodeHeartbeat
from .operator_auth import operator_kubeconfig
from .operator_run import Operator, make_claim, tiny_job
from .rest import wait_until

BIN, SKIP_REASON = binaries_or_reason()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.realk8s)
            if BIN is None:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    assert BIN is not None, SKIP_REASON
    folder = tmp_path_factory.mktemp("realk8s")
    started = time.monotonic()
    plane = ControlPlane(BIN, folder)
    heartbeat: NodeHeartbeat | None = None
    kubelet: ProcessKubelet | None = None
    try:
        plane.start()
        rest = plane.admin()
        kubelet = ProcessKubelet(rest, folder / "kubelet", {n.name for n in NODES},
                                 plane.pki).start()
        heartbeat = NodeHeartbeat(rest, NODES, kubelet.ports).start()
        print(f"realk8s: control plane up in {elapsed(started)} ({folder})")
        yield Cluster(plane, heartbeat, kubelet)
    except BaseException:
        print(plane.logs())
        raise
    finally:
        if kubelet is not None:
            kubelet.stop()
        if heartbeat is not None:
            heartbeat.stop()
        if kubelet is not None:
            kubelet.join()
        plane.stop()


@pytest.fixture
def on_failure(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[
        Callable[[Callable[[], str]], None]]:
    """Register extra logs to print if the test fails (the control plane's always are)."""
    extra: list[Callable[[], str]] = []
    yield extra.append
    report: Any = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(cluster.logs())
        for more in extra:
            print(more())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


@pytest.fixture(scope="session")
def before_chart(cluster: Cluster) -> dict[str, tuple[int, str]]:
    """What `cephalo status` and `cephalo submit` said (exit code, stderr) on the real API
    server before the chart put the CRD there: taken before `installed_chart`, which needs
    this fixture, so it never depends on the order the tests run in."""
    job = cluster.plane.folder / "before-chart-job.yaml"
    job.write_text(yaml.safe_dump(tiny_job("early", "default")))
    where = ["--kubeconfig", str(cluster.plane.kubeconfig)]
    said = {}
    for name, argv in (("status", ["status", *where]), ("submit", ["submit", str(job), *where])):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = cli_main(argv)
        said[name] = (code, err.getvalue())
    return said


@pytest.fixture(scope="session")
def installed_chart(cluster: Cluster,
                    before_chart: object) -> subprocess.CompletedProcess[str]:
    """`helm install` of the chart (real Helm): the only thing that creates the CRD, so every
    test that needs the CRD gets the chart's copy. The operator image need not be pullable:
    no Deployment controller runs, the objects only have to be accepted."""
    done = run_tool(cluster, "helm", "install", RELEASE, str(CHART), "--namespace",
                    OPERATOR_NAMESPACE, "--create-namespace", "--wait=false")
    wait_until("CRD cephalojobs.cephalo.dev Established", lambda: any(
        c["type"] == "Established" and c["status"] == "True"
        for c in (cluster.rest.get(CRD).body.get("status") or {}).get("conditions") or []), 30)
    return done


@pytest.fixture(scope="session")
def crd(installed_chart: subprocess.CompletedProcess[str], cluster: Cluster) -> dict[str, Any]:
    return cluster.rest.must("GET", CRD)


@pytest.fixture(scope="session")
def operator_process(cluster: Cluster, installed_chart: object) -> Iterator[Operator]:
    """One operator for the session (its start-up is seconds of a shared CPU): a test after
    test_operator_faults also checks that it came through that test's API server restart."""
    proc = Operator(operator_kubeconfig(cluster), cluster.plane.folder / "operator.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def job_namespace(cluster: Cluster) -> str:
    """The operator tests' namespace, with the ReadWriteMany claim `ckpt`: shared, so the
    GPU profiles one test's job measured are the next one's cache (profiling is seconds of
    a shared CPU); each test's jobs have their own names and are gone when it ends."""
    ns = cluster.namespace("jobs")
    make_claim(cluster, ns, "ckpt")
    return ns


@pytest.fixture
def operator(operator_process: Operator, on_failure: Any, cluster: Cluster,
             request: pytest.FixtureRequest) -> Iterator[Operator]:
    assert operator_process.proc.poll() is None, operator_process.log()
    on_failure(operator_process.log)
    yield operator_process
    if "job_namespace" in request.fixturenames:
        _delete_jobs(cluster, request.getfixturevalue("job_namespace"))


def _delete_jobs(cluster: Cluster, ns: str) -> None:
    """A test that failed half-way leaves its job running, holding the GPU nodes every later
    test in the shared namespace waits for (a fresh-clone CI run: one faults-test job ran
    for 28 minutes while five tests after it sat Pending until they timed out). Delete what
    is left and wait until its pods are gone, so one failure stays one failure. Wait for the
    pods of a job the test deleted itself too: the garbage collector removes them after the
    job, and the next test planned on the GPUs they still held (a CI run: `optout` planned on
    one P40 while the job before it still had a pod on the other)."""
    jobs = f"/apis/cephalo.dev/v1alpha1/namespaces/{ns}/cephalojobs"
    left = [j["metadata"]["name"] for j in cluster.rest.must("GET", jobs)["items"]]
    for name in left:
        cluster.rest.request("DELETE", f"{jobs}/{name}")
    wait_until(f"the pods of the namespace's jobs ({left or 'deleted by the test'}) gone",
               lambda: not cluster.rest.must(
                   "GET", f"/api/v1/namespaces/{ns}/pods",
                   params={"labelSelector": "cephalo.dev/job"})["items"], 120.0, 0.5)


@pytest.fixture(scope="session")
def kueue(cluster: Cluster) -> Iterator[Kueue]:
    """Real Kueue for the session (scripts/kueue-binary.sh); its tests skip with one reason
    where it is not built."""
    home, reason = kueue_or_reason()
    if home is None or (reason := private_etc_or_reason()):
        pytest.skip(reason)
    manager = Kueue(cluster, cluster.plane.folder / "kueue", home)
    try:
        yield manager.start()
    except BaseException:
        print(manager.logs())
        raise
    finally:
        manager.stop()
