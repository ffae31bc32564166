"""One connection to one cluster: the user's kubeconfig and context, and every request's
failure turned into one line (`cephalo.client.errors`).

No global state but one warnings filter per insecure host (`_quiet_insecure_host`): the
`kubernetes` client's default configuration is never read or written
(`load_kube_config(client_configuration=...)`), and $KUBECONFIG is read when a client is
made, not when the module is imported, so a notebook can talk to two clusters at once.
JSON requests go through the operator's own thin client (`cephalo.operator.kube.Kube`: raw
JSON, LISTs in pages); streams (watch, logs) are read line by line here.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import kubernetes
import urllib3
import yaml

from cephalo.api import API_GROUP, API_VERSION, PLURAL
from cephalo.client.errors import (
    HELM_INSTALL,
    ApiRefused,
    CrdNotInstalled,
    Forbidden,
    KubeconfigError,
    Unreachable,
)
from cephalo.operator.kube import ApiError, Kube

T = TypeVar("T")
CONNECT_TIMEOUT_SECONDS = 10.0
REQUEST_TIMEOUT_SECONDS = 30.0
IN_CLUSTER_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
RESOURCE = f"{PLURAL}.{API_GROUP}"
USER_AGENT = "cephalo-client/0.1"


@dataclass(frozen=True)
class Target:
    """Where requests go, for messages: the context (None in a pod), server, namespace."""

    context: str | None
    server: str
    namespace: str
    kubeconfig: str | None

    def where(self) -> str:
        if self.context is None:
            return f"in-cluster service account, server {self.server}"
        return f"context {self.context!r}, server {self.server}"


def kubeconfig_path(explicit: str | None = None) -> str | None:
    """The kubeconfig to read: `explicit`, else $KUBECONFIG (may list several, ':'), else
    ~/.kube/config; None when none of those files exists."""
    if explicit:
        if not Path(explicit).expanduser().is_file():
            raise KubeconfigError(f"kubeconfig {explicit} does not exist")
        return str(Path(explicit).expanduser())
    env = os.environ.get("KUBECONFIG", "")
    if env:
        paths = [p for p in env.split(os.pathsep) if p and Path(p).expanduser().is_file()]
        return os.pathsep.join(paths) if paths else None
    default = Path("~/.kube/config").expanduser()
    return str(default) if default.is_file() else None


def connect(kubeconfig: str | None = None, context: str | None = None,
            namespace: str | None = None) -> tuple[kubernetes.client.ApiClient, Target]:
    """An API client for the context (default: the kubeconfig's current one), or the pod's
    service account when there is no kubeconfig inside a cluster."""
    cfg = kubernetes.client.Configuration()
    path = kubeconfig_path(kubeconfig)
    if path is None:
        if os.environ.get("KUBERNETES_SERVICE_HOST") and context is None:
            try:
                kubernetes.config.load_incluster_config(client_configuration=cfg)
            except kubernetes.config.ConfigException as err:
                raise KubeconfigError(f"in-cluster configuration: {err}") from None
            ns = namespace or (IN_CLUSTER_NAMESPACE.read_text().strip()
                               if IN_CLUSTER_NAMESPACE.is_file() else "default")
            return _client(cfg), Target(None, cfg.host, ns, None)
        where = (f"$KUBECONFIG ({os.environ['KUBECONFIG']}) names no existing file"
                 if os.environ.get("KUBECONFIG") else "~/.kube/config does not exist")
        raise KubeconfigError(f"no kubeconfig: {where}; point KUBECONFIG (or --kubeconfig) at "
                              "your cluster's kubeconfig")
    try:
        contexts, active = kubernetes.config.list_kube_config_contexts(config_file=path)
    except (kubernetes.config.ConfigException, OSError, ValueError, yaml.YAMLError,
            AttributeError, TypeError, KeyError) as err:  # malformed YAML or structure
        raise KubeconfigError(f"kubeconfig {path} is not a kubeconfig: {err}") from None
    names = [c["name"] for c in contexts or []]
    chosen = next((c for c in contexts or [] if c["name"] == context), None) if context \
        else active
    if chosen is None:
        if context:
            raise KubeconfigError(f"context {context!r} is not in kubeconfig {path}; its "
                                  f"contexts: {', '.join(names) or 'none'}")
        raise KubeconfigError(f"kubeconfig {path} has no current context; pass --context "
                              f"(one of: {', '.join(names) or 'none'})")
    try:
        kubernetes.config.load_kube_config(config_file=path, context=chosen["name"],
                                           client_configuration=cfg, persist_config=False)
    except (kubernetes.config.ConfigException, OSError, ValueError, yaml.YAMLError,
            AttributeError, TypeError, KeyError) as err:
        raise KubeconfigError(f"kubeconfig {path}, context {chosen['name']!r}: {err}") from None
    ns = namespace or (chosen.get("context") or {}).get("namespace") or "default"
    _quiet_insecure_host(cfg)
    return _client(cfg), Target(chosen["name"], cfg.host, ns, path)


def _quiet_insecure_host(cfg: kubernetes.client.Configuration) -> None:
    """`insecure-skip-tls-verify: true` is the kubeconfig owner's choice, made once (local and
    lab clusters); kubectl says nothing of it, urllib3 warned twice a command. Silence exactly
    that warning for exactly this host: the warnings module has only process-wide filters,
    so the filter names the host, and unverified requests to any other host still warn."""
    host = urlsplit(cfg.host).hostname
    if cfg.verify_ssl or not host:
        return
    # urllib3's words (1.26 and 2.x); a filter's message is matched at the start.
    warnings.filterwarnings(
        "ignore", message=f"Unverified HTTPS request is being made to host '{re.escape(host)}'",
        category=urllib3.exceptions.InsecureRequestWarning)


def _client(cfg: kubernetes.client.Configuration) -> kubernetes.client.ApiClient:
    cfg.retries = 1  # an unreachable server is said in seconds, not after urllib3's 3 tries
    api = kubernetes.client.ApiClient(cfg)
    api.user_agent = USER_AGENT  # audit logs (and the tests) tell it from the operator
    return api


class Session:
    """Requests to one cluster; every failure becomes a `ClientError` naming the context."""

    def __init__(self, api: kubernetes.client.ApiClient, target: Target) -> None:
        self.api, self.target = api, target
        self.kube = Kube(api)
        self._crd_checked = False

    # ---- errors -------------------------------------------------------------------------
    def call(self, verb: str, resource: str, namespace: str | None,
             fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (a Kube method) with its failure said in one line."""
        try:
            return fn(*args)
        except ApiError as err:
            raise self.refused(err.status, err.reason, str(err).split(": ", 1)[-1], verb,
                               resource, namespace) from None
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise self.unreachable(err) from None

    def unreachable(self, err: BaseException) -> Unreachable:
        reason = getattr(err, "reason", None) or err
        text = " ".join(str(reason).split())
        if "refused" in text.lower():
            text = "connection refused"
        return Unreachable(f"cannot reach the Kubernetes API server ({self.target.where()}): "
                           f"{text[:200]}; is the cluster up and the context right "
                           "(kubectl config current-context)?")

    def refused(self, status: int, reason: str, message: str, verb: str, resource: str,
                namespace: str | None) -> Exception:
        where = f" in namespace {namespace}" if namespace else " (cluster-wide)"
        if status == 401:
            return KubeconfigError(f"the API server ({self.target.where()}) rejected the "
                                   "kubeconfig's credentials (401 Unauthorized): log in again")
        if status == 403:
            return Forbidden(f"RBAC forbids {verb} on {resource}{where} ({self.target.where()})"
                             f": {message[:300]}; ask a cluster admin for a Role that grants "
                             f"{verb} on {resource}", verb, resource, namespace)
        return ApiRefused(f"{verb} {resource}{where}: HTTP {status} {reason}: {message[:300]}",
                          status)

    def check_crd(self) -> None:
        """Once per session: is the CephaloJob resource served here? (discovery, one GET)"""
        if self._crd_checked:
            return
        path = f"/apis/{API_GROUP}/{API_VERSION}"
        found = self.call("get", f"{API_GROUP}/{API_VERSION} (API discovery)", None,
                          self.kube.get, path)
        resources = [r.get("name") for r in (found or {}).get("resources") or []]
        if found is None or PLURAL not in resources:
            raise CrdNotInstalled(f"the cluster ({self.target.where()}) has no CephaloJob "
                                  f"resource ({RESOURCE}): install the chart: {HELM_INSTALL}")
        self._crd_checked = True

    # ---- streams ------------------------------------------------------------------------
    def stream(self, path: str, query: dict[str, str], verb: str, resource: str,
               namespace: str | None, read_timeout_seconds: float | None) -> Iterator[bytes]:
        """The lines of a streamed GET (watch events, a log); ends when the server ends it."""
        try:
            method, url, headers, _, _ = self.api.param_serialize(
                "GET", path, query_params=list(query.items()), header_params={
                    "Accept": "application/json, */*"}, auth_settings=["BearerToken"])
            response = self.api.call_api(
                method, url, header_params=headers,
                _request_timeout=(CONNECT_TIMEOUT_SECONDS, read_timeout_seconds))
        except (urllib3.exceptions.HTTPError, OSError) as err:
            raise self.unreachable(err) from None
        raw = response.response
        try:
            if response.status >= 400:
                text = raw.data.decode(errors="replace") if raw.data else ""
                try:
                    data = json.loads(text)
                except ValueError:
                    data = {"message": text[:200]}
                raise self.refused(response.status, str(data.get("reason", response.reason)),
                                   str(data.get("message", "")), verb, resource, namespace)
            pending = b""
            try:
                for chunk in raw.stream(64 * 1024, decode_content=True):
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    yield from lines
            except (urllib3.exceptions.ProtocolError, urllib3.exceptions.ReadTimeoutError,
                    OSError):
                pass  # the stream broke: the caller resumes (watch) or looks again (logs)
            if pending:
                yield pending
        finally:
            raw.release_conn()
