"""`cephalo plan` previews what the operator would plan (issue 26 item 7): a job's own GPU
pools and network, and every example's preview command in its comments."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from cephalo.cli import main

REPO = Path(__file__).resolve().parents[2]
JOB = """\
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {name: pools}
spec:
  model: {preset: gpt-small}
  globalBatchSize: 24
  gpuPools:
    - {product: NVIDIA-L4, maxGpus: 2}
    - {product: Tesla-P40, maxGpus: 1}
  planner: {networkBandwidthGbps: 100}
"""


def test_a_jobs_pools_are_the_cluster_without_gpus(tmp_path, capsys) -> None:
    """`cephalo plan --job` required --gpus though the job lists gpuPools with maxGpus."""
    job = tmp_path / "j.yaml"
    job.write_text(JOB)
    assert main(["plan", "--job", str(job), "--gpus", "2xNVIDIA-L4,1xTesla-P40"]) == 0
    given = capsys.readouterr().out
    assert main(["plan", "--job", str(job)]) == 0
    assert capsys.readouterr().out == given
    # The job's 100 Gbit/s, priced at what NCCL reaches of a described link (0.96).
    assert "network 96 Gbit/s" in given and "0.96 of the described rate" in given


def test_without_gpus_or_pools_it_says_what_to_give(tmp_path, capsys) -> None:
    job = tmp_path / "j.yaml"
    job.write_text(JOB.replace("maxGpus: 1}", "}"))
    assert main(["plan", "--job", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["cephalo plan: error: --gpus is required: the job's gpuPools[1] "
                   "(Tesla-P40) gives no maxGpus to count its GPUs"], err


def _previews() -> list[tuple[str, str]]:
    found = []
    for example in sorted((REPO / "examples").glob("*.yaml")):
        for line in example.read_text().splitlines():
            match = re.match(r"#\s+(cephalo plan .*)$", line)
            if match:
                found.append((example.name, match.group(1)))
    return found


@pytest.mark.parametrize(("example", "command"), _previews(), ids=[e for e, _ in _previews()])
def test_every_examples_preview_plans_that_example(example: str, command: str,
                                                  monkeypatch, capsys) -> None:
    """The examples' 'preview the plan offline' commands named --model and --batch-size and
    so planned without the job's bandwidth (vit-e: 8 GPUs at 33.3 s/step, not 64 at 6.7 s)."""
    args = shlex.split(command)[1:]
    assert "--job" in args and args[args.index("--job") + 1] == f"examples/{example}", command
    monkeypatch.chdir(REPO)
    assert main(args) == 0
    assert "Plan for" in capsys.readouterr().out
