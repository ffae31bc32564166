"""Issue 35 item 5 end to end: a network probe that cannot finish is given up after its
timeout (never a hang): the job is planned on the assumed network and says so (condition,
Warning Events), and nothing is cached.

The kopf operator process runs against the API emulator with its network probe on; the
process kubelet reports the probe pods (and the ranks) Running and never ends them, as a
probe rank whose peer is unreachable would hang: a fault the real control plane's tests do
not stage. A probe that measures, its cache and its reuse are
tests/realk8s/test_operator_netprobe.py's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kube_emulator import ApiEmulator
from kube_fixtures import gpu_node, job_body
from kubelet import (
    WAIT_SECONDS,
    ExtraPassKubelet,
    OperatorProcess,
    Scheduler,
    apply_job,
    apply_nodes,
    finish_profilers,
    free_port,
    job_status,
    pods,
    wait_for,
)
from operator_harness import NS, events
from process_kubelet import ProcessKubelet

from cephalo.api.network_profile import NETWORK_PROFILE_KEY, NetworkProfile

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]  # a real operator process
OPERATOR_NS = "cephalo-system"  # the network cache's namespace (the chart's downward API)
TINY = {"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4,
        "ffnHiddenSize": 256, "vocabSize": 256, "sequenceLength": 32}


def _job(name: str) -> dict[str, Any]:
    return job_body(name, model=TINY, globalBatchSize=8,
                    gpuPools=[{"product": "L4"}, {"product": "A10G"}],
                    training={"steps": 3, "learningRate": 1e-3, "schedule": "constant"},
                    data={"synthetic": {}},
                    planner={"chooseGpus": False, "profileMicroBatchSizes": [1, 2],
                             "replan": {"enabled": False}},
                    checkpoint={"claimName": f"ckpt-{name}", "intervalSteps": 1000})


async def _cluster(api: ApiEmulator, tmp_path: Path,
                   **env: str) -> tuple[ProcessKubelet, OperatorProcess]:
    await apply_nodes(api, [gpu_node("l4-0", "NVIDIA-L4", 2, 23034),
                            gpu_node("a10g-0", "NVIDIA-A10G", 1, 23028),
                            gpu_node("cpu-0", None, 0)])
    Scheduler(api, run=False)
    # Real processes for no job: every rank and probe pod is reported Running, never ended.
    kubelet = ProcessKubelet(api, tmp_path / "kubelet", jobs=set(),
                             metrics_port=free_port()).start()
    operator = OperatorProcess(api.kubeconfig, tmp_path / "operator.log",
                               CEPHALO_TRAINER_METRICS_PORT=str(kubelet.metrics_port),
                               CEPHALO_NETWORK_PROBE="true",
                               CEPHALO_OPERATOR_NAMESPACE=OPERATOR_NS, **env).start()
    return kubelet, operator


def _network_profiles(api: ApiEmulator) -> dict[str, NetworkProfile]:
    return {key[3]: NetworkProfile.model_validate_json(cm["data"][NETWORK_PROFILE_KEY])
            for key, cm in list(api._store.items())
            if key[:3] == ("", "configmaps", OPERATOR_NS)
            and key[3].startswith("cephalo-network-")}


async def test_a_probe_that_cannot_finish_is_given_up_and_the_network_assumed(
        emulator: ApiEmulator, tmp_path: Path, extra_passes: ExtraPassKubelet) -> None:
    # The kubelet runs the job's ranks but not its probe pods (they stay Running, as a rank
    # whose peer is unreachable would): the probe is given up after its timeout.
    kubelet, operator = await _cluster(emulator, tmp_path,
                                       CEPHALO_NETWORK_PROBE_TIMEOUT_SECONDS="2")
    try:
        body = _job("g")
        await apply_job(emulator, body)
        await finish_profilers(emulator, NS, body, count=2)
        status = await wait_for("g planned", lambda: (
            s if (s := job_status(emulator, NS, "g")).get("plan") else None), WAIT_SECONDS)
        conditions = {c["type"]: c for c in status["conditions"]}
        measured = conditions["NetworkMeasured"]
        assert measured["status"] == "False" and measured["reason"] == "ProbeFailed", measured
        assert "not done within 2 s" in measured["message"], measured
        assert status["plan"]["networkSource"] == "assumed", status["plan"]
        def warned() -> list[tuple[str, str, str]] | None:
            posted = events(emulator, "g")
            wanted = {"NetworkProbeFailed", "NetworkAssumed"}
            return posted if wanted <= {r for _, r, _ in posted} else None

        posted = await wait_for("the Warning events", warned)
        assert all(t == "Warning" for t, r, _ in posted
                   if r in ("NetworkProbeFailed", "NetworkAssumed")), posted
        assert all(p["metadata"].get("deletionTimestamp")  # given up: being deleted
                   for p in pods(emulator, NS, "netprobe", "g"))
        assert not _network_profiles(emulator)  # nothing cached from a failure
    finally:
        await operator.stop()
        await kubelet.stop()
        print(operator.log()[-6000:])
