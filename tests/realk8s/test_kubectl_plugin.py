"""`kubectl cephalo ...` through the real kubectl (built with the control plane): kubectl finds
the installed `kubectl-cephalo` on PATH as a plugin, runs it with the words after `cephalo`
and its own environment (the KUBECONFIG it was given), and the plugin names itself as the
user typed it (`kubectl cephalo status: error: ...`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .cluster import Cluster
from .operator_run import JOBS, tiny_job

# pip puts the console scripts beside the interpreter (the venv's bin folder).
PLUGIN = Path(sys.executable).parent / "kubectl-cephalo"


def kubectl(cluster: Cluster, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**cluster.plane.tool_env(), "PATH": f"{PLUGIN.parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(cluster.bin / "kubectl"), *argv], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


def test_kubectl_runs_the_installed_plugin(cluster: Cluster, crd: Any) -> None:
    assert PLUGIN.is_file(), f"{PLUGIN}: not installed (pip install -e '.[client]')"
    listed = kubectl(cluster, "plugin", "list")
    assert str(PLUGIN) in listed.stdout, listed.stdout + listed.stderr
    ns = cluster.namespace("plugin")
    # Suspended: an operator started by another test leaves it alone (no GPUs taken).
    cluster.rest.create(JOBS.format(ns=ns), tiny_job("seen", ns, suspend=True))
    try:
        table = kubectl(cluster, "cephalo", "status", "-n", ns)
        assert table.returncode == 0, table.stdout + table.stderr
        rows = table.stdout.splitlines()
        assert rows[0].split()[:2] == ["NAME", "PHASE"] and rows[1].split()[0] == "seen", rows
        missing = kubectl(cluster, "cephalo", "status", "nope", "-n", ns)
        assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
        assert missing.stderr.startswith(
            f"kubectl cephalo status: error: no CephaloJob 'nope' in namespace {ns} ("), \
            missing.stderr
        version = kubectl(cluster, "cephalo", "--version")
        assert version.returncode == 0 and version.stdout.startswith("cephalo "), version
    finally:
        cluster.rest.request("DELETE", f"{JOBS.format(ns=ns)}/seen")
