"""Pod logs through the real API server: the process kubelet's log endpoint answers what the
API server forwards, so the real `kubectl logs` works: the whole log, --tail, --timestamps,
--since, --limit-bytes, stdout and stderr both (each in its write order: they are two pipes,
as under a CRI runtime), --previous refused as a kubelet refuses it, and -f streaming until
the container exits."""

from __future__ import annotations

import datetime as dt
import re
import subprocess
import textwrap
from pathlib import Path

from .cluster import NODES, Cluster, run_tool
from .rest import wait_until

SCRIPT = textwrap.dedent("""
    import os, sys, time
    for i in range(3):
        print(f"err {i}", file=sys.stderr, flush=True)
    for i in range(3):
        print(f"out {i}", flush=True)
    gate = sys.argv[1]
    while not os.path.exists(gate):  # the test lets it finish (a follower is attached)
        time.sleep(0.05)
    print("after the gate", flush=True)
    sys.stdout.write("no newline at the end")
""")
RFC3339_NANO = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?Z"


def _seconds(stamp: str) -> float:
    head, _, fraction = stamp.rstrip("Z").partition(".")
    return dt.datetime.fromisoformat(head + "+00:00").timestamp() + float(f"0.{fraction or 0}")


def test_kubectl_logs_through_the_api_server(cluster: Cluster, tmp_path: Path,
                                             on_failure: object) -> None:
    ns, pod = cluster.namespace("logs", level="baseline"), "talker"
    gate = tmp_path / "gate"
    cluster.rest.create(f"/api/v1/namespaces/{ns}/pods", {
        "metadata": {"name": pod}, "spec": {
            "nodeName": NODES[0].name, "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "python:3",
                            "command": ["python", "-c", SCRIPT, str(gate)]}]}})
    key = f"{ns}/{pod}"
    wait_until("the first lines written", lambda: "out 2" in "".join(
        c.log.text() for c in cluster.kubelet.containers.values()
        if c.key == key and c.log is not None), 60)

    def logs(*flags: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run_tool(cluster, "kubectl", "logs", "-n", ns, pod, *flags, check=check)

    lines = logs().stdout.splitlines()
    assert sorted(lines) == ["err 0", "err 1", "err 2", "out 0", "out 1", "out 2"], lines
    assert [x for x in lines if x.startswith("out")] == ["out 0", "out 1", "out 2"]
    assert [x for x in lines if x.startswith("err")] == ["err 0", "err 1", "err 2"]
    assert logs("--tail=2").stdout.splitlines() == lines[-2:]
    assert logs("--tail=0").stdout == ""
    stamped = logs("--timestamps", "--tail=1").stdout
    assert re.fullmatch(rf"{RFC3339_NANO} {lines[-1]}\n", stamped), stamped
    times = [t.split()[0] for t in logs("--timestamps").stdout.splitlines()]
    assert times == sorted(times, key=_seconds)  # one clock, appended in order
    # The API server forwards sinceTime in whole seconds (RFC 3339).
    def whole(seconds: float) -> str:
        return dt.datetime.fromtimestamp(seconds, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert logs(f"--since-time={whole(_seconds(times[0]) // 1)}").stdout.count("\n") == 6
    assert logs(f"--since-time={whole(_seconds(times[-1]) // 1 + 1)}").stdout == ""
    assert logs("--since=1h").stdout.count("\n") == 6
    assert logs("--limit-bytes=8").stdout == "\n".join(lines)[:8]
    refused = logs("--previous", check=False)
    assert refused.returncode == 1
    assert 'previous terminated container "main" in pod "talker" not found' in refused.stderr

    # -f: the lines so far, then each new one, until the container exits (then kubectl does).
    follower = subprocess.Popen(
        [str(cluster.bin / "kubectl"), "logs", "-f", "-n", ns, pod],
        env=cluster.plane.tool_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None
        head = [follower.stdout.readline() for _ in range(6)]
        assert [h.rstrip("\n") for h in head] == lines, head
        assert follower.poll() is None, "kubectl logs -f ended before the container did"
        gate.touch()
        out, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err
    assert out == "after the gate\nno newline at the end", out
    wait_until(f"pod {pod} Succeeded", lambda: cluster.rest.get(
        f"/api/v1/namespaces/{ns}/pods/{pod}").body.get("status", {}).get("phase")
        == "Succeeded", 60)
    # A finished container's log is still served (until the pod is deleted).
    assert logs("--tail=1").stdout == "no newline at the end"
