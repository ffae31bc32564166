"""What precision the profiler measures (issue 36): under a job's `auto` the one the planner
will assign the device's GPU, so the planner accepts the profile; `--precision` for the
local runner's emulated GPUs (the CPU measured in each precision they compute in)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cephalo.api import ClusterSpec, GpuGroup, GpuProfile, parse_job
from cephalo.api.profile import model_key
from cephalo.planner import solve
from cephalo.trainer import profile as profiler


def _job(preset: str = "gpt-tiny") -> dict:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": "prof"},
            "spec": {"model": {"preset": preset}, "globalBatchSize": 8, "precision": "auto"}}


def _auto():
    return parse_job(_job()).spec


@pytest.mark.parametrize("product,precision", [
    ("V100-16GB", "fp16"), ("Tesla-T4", "fp16"), ("NVIDIA-A10G", "bf16"), ("H200", "bf16"),
    ("P40", "fp32"), ("P100", "fp32"), ("cpu", "fp32"),
    ("NVIDIA-GeForce-RTX-4090", "fp32"),  # outside the catalog: the planner says fp32 too
])
def test_auto_is_measured_in_the_precision_the_planner_assigns(product: str,
                                                               precision: str) -> None:
    assert profiler.in_measured_precision(_auto(), product).precision == precision
    assert profiler.in_measured_precision(_auto(), product, "bf16").precision == "bf16"
    forced = _auto().model_copy(update={"precision": "bf16"})
    assert profiler.in_measured_precision(forced, product).precision == "bf16"


def test_the_command_line_profiles_auto_as_the_planner_expects(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_job("bert-tiny")))
    spec = parse_job(_job("bert-tiny")).spec
    arch = spec.model.resolve().architecture_key()
    written = {}
    for given in (None, "bf16"):
        out = tmp_path / f"{given}.json"
        args = ["--job", str(job), "--output", str(out), "--micro-batch-sizes", "1,2",
                "--repeats", "1", "--cache-dir", "none", "--device", "cpu"]
        assert profiler.main(args + (["--precision", given] if given else [])) == 0
        written[given] = GpuProfile.model_validate_json(out.read_text())
    # The CPU's fastest is fp32; --precision measures another one for emulated GPUs.
    assert (written[None].precision, written[None].model_key) == ("fp32",
                                                                  model_key(arch, "fp32"))
    assert (written["bf16"].precision, written["bf16"].model_key) == ("bf16",
                                                                      model_key(arch, "bf16"))
    # The planner takes the CPU's auto profile for CPU ranks (no ProfileMismatchError).
    plan = solve(spec, ClusterSpec(groups=[GpuGroup(product="cpu", count=2)]),
                 {"cpu": written[None]})
    assert [r.precision for r in plan.ranks] == ["fp32", "fp32"]
