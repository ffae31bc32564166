"""The cluster commands against a real API server that cannot serve them: each is one line
naming what is wrong and how to fix it, exit code 2 (cephalo.client.errors), from the server's
own answers: no CRD, RBAC's verdict for a ServiceAccount without rights (which verb on which
resource), a job that is not there, a server that does not answer, a CA that does not
verify it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from cephalo.cli import main as cli_main

from .cluster import Cluster
from .controlplane import ISSUER, free_port
from .operator_run import JOBS, tiny_job


def one_line(rc: int, err: str) -> str:
    assert rc == 2, err
    assert "Traceback" not in err and err.strip() and "\n" not in err.strip(), err
    return err.strip()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    rc = cli_main(list(argv))
    return one_line(rc, capsys.readouterr().err)


def test_no_crd_is_one_line_naming_the_chart(before_chart: dict[str, tuple[int, str]],
                                             cluster: Cluster) -> None:
    for command in ("status", "submit"):
        line = one_line(*before_chart[command])
        assert line == (
            f"cephalo {command}: error: the cluster (context 'test', server "
            f"{cluster.plane.server}) has no CephaloJob resource (cephalojobs.cephalo.dev): "
            "install the chart: helm install cephalo charts/cephalo-operator -n "
            "cephalo-system --create-namespace"), line


def _token(cluster: Cluster, ns: str, account: str) -> str:
    cluster.rest.create(f"/api/v1/namespaces/{ns}/serviceaccounts",
                        {"metadata": {"name": account}})
    reply = cluster.rest.create(
        f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"audiences": [ISSUER], "expirationSeconds": 600}})
    return str(reply["status"]["token"])


def test_rbac_refusals_name_the_verb_and_the_resource(
        cluster: Cluster, crd: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns = cluster.namespace("rbac")
    # Suspended: an operator started by a later test leaves it alone (no GPUs taken).
    cluster.rest.create(JOBS.format(ns=ns), tiny_job("someone", ns, suspend=True))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(tiny_job("mine", ns)))
    # No rights at all (a fresh ServiceAccount): listing jobs, creating one.
    nobody = str(cluster.plane.token_kubeconfig("nobody.kubeconfig",
                                                _token(cluster, ns, "nobody")))
    user = f'User "system:serviceaccount:{ns}:nobody"'
    where = f"(context 'test', server {cluster.plane.server})"
    line = run(capsys, "status", "-n", ns, "--kubeconfig", nobody)
    assert line == (
        f"cephalo status: error: RBAC forbids list on cephalojobs.cephalo.dev in namespace {ns} "
        f'{where}: cephalojobs.cephalo.dev is forbidden: {user} cannot list resource '
        f'"cephalojobs" in API group "cephalo.dev" in the namespace "{ns}"; ask a cluster '
        "admin for a Role that grants list on cephalojobs.cephalo.dev"), line
    line = run(capsys, "submit", str(job), "--kubeconfig", nobody)
    assert line.startswith(f"cephalo submit: error: RBAC forbids create on "
                           f"cephalojobs.cephalo.dev in namespace {ns} {where}: "), line
    assert not cluster.rest.get(f"{JOBS.format(ns=ns)}/mine").ok  # nothing was created

    # A Role that lets it read jobs but not pods: `cephalo logs` is refused at the pods.
    reader = str(cluster.plane.token_kubeconfig("reader.kubeconfig",
                                                _token(cluster, ns, "reader")))
    cluster.rest.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles", {
        "metadata": {"name": "jobs-reader"}, "rules": [{
            "apiGroups": ["cephalo.dev"], "resources": ["cephalojobs"],
            "verbs": ["get", "list", "watch"]}]})
    cluster.rest.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings", {
        "metadata": {"name": "reader"}, "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "jobs-reader"},
        "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}]})
    capsys.readouterr()
    assert cli_main(["status", "-n", ns, "--kubeconfig", reader]) == 0  # RBAC is live at once
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "someone"
    line = run(capsys, "logs", "someone", "-n", ns, "--kubeconfig", reader)
    assert line.startswith(f"cephalo logs: error: RBAC forbids list on pods in namespace {ns} "
                           f'{where}: pods is forbidden: User "system:serviceaccount:{ns}:'
                           'reader" cannot list resource "pods"'), line
    assert line.endswith("ask a cluster admin for a Role that grants list on pods"), line
    cluster.rest.must("DELETE", f"{JOBS.format(ns=ns)}/someone")


def test_unknown_job_says_where_one_is(cluster: Cluster, crd: Any,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    here, there = cluster.namespace("here"), cluster.namespace("there")
    cluster.rest.create(JOBS.format(ns=there), tiny_job("elsewhere", there, suspend=True))
    admin = ["--kubeconfig", str(cluster.plane.kubeconfig)]
    where = f"(context 'test', server {cluster.plane.server})"
    assert run(capsys, "status", "nosuch", "-n", here, *admin) == (
        f"cephalo status: error: no CephaloJob 'nosuch' in namespace {here} {where}; "
        "`cephalo status` lists the jobs there")
    for command in (["logs", "elsewhere"], ["watch", "elsewhere"], ["suspend", "elsewhere"],
                    ["delete", "elsewhere"]):
        assert run(capsys, *command, "-n", here, *admin) == (
            f"cephalo {command[0]}: error: no CephaloJob 'elsewhere' in namespace {here}; "
            f"there is one in namespace {there}: add --namespace {there}")
    assert cluster.rest.get(f"{JOBS.format(ns=there)}/elsewhere").ok  # untouched
    cluster.rest.must("DELETE", f"{JOBS.format(ns=there)}/elsewhere")


def _kubeconfig(cluster: Cluster, path: Path, *, server: str, ca: Path) -> str:
    config = yaml.safe_load(cluster.plane.kubeconfig.read_text())
    config["clusters"][0]["cluster"].update({"server": server, "certificate-authority": str(ca)})
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_unreachable_server_and_an_unverified_ca(cluster: Cluster, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    closed = f"https://127.0.0.1:{free_port()}"  # nothing listens there
    down = _kubeconfig(cluster, tmp_path / "down", server=closed, ca=cluster.plane.pki.ca_cert)
    assert run(capsys, "status", "--kubeconfig", down) == (
        f"cephalo status: error: cannot reach the Kubernetes API server (context 'test', "
        f"server {closed}): connection refused; is the cluster up and the context right "
        "(kubectl config current-context)?")
    # The real server, but a CA that did not sign its certificate (another cluster's).
    other_ca = tmp_path / "other-ca.crt"
    other_ca.write_bytes(cluster.plane.pki.kubelet_cert.read_bytes())  # any other certificate
    wrong = _kubeconfig(cluster, tmp_path / "wrong", server=cluster.plane.server, ca=other_ca)
    line = run(capsys, "status", "--kubeconfig", wrong)
    assert line.startswith(f"cephalo status: error: cannot reach the Kubernetes API server "
                           f"(context 'test', server {cluster.plane.server}): "), line
    assert re.search(r"certificate verify failed", line), line
