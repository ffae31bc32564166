"""`cephalo run` under `precision: auto` on emulated GPUs (issue 36): the CPU is profiled in
each precision the emulated GPUs compute in, each emulated GPU's profile is that one (so the
planner accepts it), and the plan gives each rank its GPU's fastest precision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli_helpers import run_cephalo

pytestmark = pytest.mark.slow


def test_auto_profiles_the_cpu_per_precision_and_plans_each_rank_in_its_own(
        tmp_path: Path, tiny_job) -> None:
    job = tiny_job(name="auto", steps=2)
    job.write_text(job.read_text().replace("  globalBatchSize:", "  precision: auto\n"
                                                                 "  globalBatchSize:"))
    done = run_cephalo(tmp_path, "run", str(job), "--emulate", "RTX-A6000,V100-16GB,P40")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "precision: auto: bf16 on 1 RTX-A6000, fp16 on 1 V100-16GB, fp32 on 1 P40" \
        in done.stdout, done.stdout
    (run_dir,) = sorted((tmp_path / "runs" / "auto").iterdir())
    profiles = run_dir / "profiles"
    measured = {name: json.loads((profiles / f"{name}.json").read_text())
                for name in ("measured-cpu", "measured-cpu-bf16", "measured-cpu-fp16")}
    # The CPU's own precision under auto is fp32; the others were measured for the GPUs.
    assert [p["precision"] for p in measured.values()] == ["fp32", "bf16", "fp16"]
    for gpu, source in (("RTX-A6000", "measured-cpu-bf16"), ("V100-16GB", "measured-cpu-fp16"),
                        ("P40", "measured-cpu")):
        emulated = json.loads((profiles / f"emulated-{gpu}.json").read_text())
        assert (emulated["precision"], emulated["model_key"]) == (
            measured[source]["precision"], measured[source]["model_key"]), gpu
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["precision"] == "auto"
    assert [(r["gpu"], r["precision"]) for r in plan["ranks"]] == [
        ("RTX-A6000", "bf16"), ("V100-16GB", "fp16"), ("P40", "fp32")]
