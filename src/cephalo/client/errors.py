"""What can go wrong between a user and a cluster, each as one line that says how to fix it.

Every error is a `cephalo.errors.CephaloError` (the `cephalo` command prints it as one line
and exits 2); `JobFailed` is the one a *job* causes, and the commands exit 1 on it. From a
notebook, catch `ClientError` for everything this package raises on purpose.
"""

from __future__ import annotations

from cephalo.errors import CephaloError

HELM_INSTALL = ("helm install cephalo charts/cephalo-operator -n cephalo-system "
                "--create-namespace")


class ClientError(CephaloError):
    """Base of the client's errors."""


class KubeconfigError(ClientError):
    """No usable kubeconfig (missing file, unknown context, bad credentials section)."""


class Unreachable(ClientError):
    """The API server named by the context did not answer (or its TLS did not verify)."""


class CrdNotInstalled(ClientError):
    """The cluster has no CephaloJob resource: the chart (or `cephalo crd`) is not applied."""


class Forbidden(ClientError):
    """RBAC refused one verb on one resource."""

    def __init__(self, message: str, verb: str = "", resource: str = "",
                 namespace: str | None = None) -> None:
        super().__init__(message)
        self.verb, self.resource, self.namespace = verb, resource, namespace


class JobNotFound(ClientError):
    """No CephaloJob of that name in the namespace (the message says where one is, if any)."""


class ApiRefused(ClientError):
    """The API server refused a request for another reason (a 4xx/5xx with its message)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class WaitTimeout(ClientError):
    """`wait` gave up before the job finished."""


class JobFailed(ClientError):
    """The job ended Failed; the message is its reason (blamed rank, exit code)."""
