"""`cephalo run` measures the micro-batch sizes its plan assigns beyond the profiled ones
before it uses the plan (issue 46 item 3): one extra profiler pass, cached with the rest.
The job is ephemeral (`checkpoint.ephemeral: true`): its runs also show that such a job
writes no checkpoints (asserted here rather than in a launch of its own)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cephalo.api import GpuProfile
from cephalo.api.job import load_job
from cephalo.api.profile import ProfilePoint, model_key
from cephalo.trainer import profile as profiler

from .cli_helpers import run_cephalo

pytestmark = pytest.mark.slow

JOB = """\
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {name: sizes}
spec:
  model: {preset: gpt-tiny}
  globalBatchSize: 6
  training: {steps: 2, learningRate: 1.0e-2, seed: 3}
  planner: {profileMicroBatchSizes: [1, 2]}
  checkpoint: {ephemeral: true}
"""


def _seed_cache(tmp_path: Path, job: Path) -> Path:
    """The CPU's cached profile at sizes 1 and 2 with a microbatch of 2 costing what one of
    1 does: extrapolated, every larger size is as cheap, so the first plan takes the whole
    batch (6) as one microbatch whatever this machine's speed. Returns the cache file."""
    spec = load_job(str(job)).spec
    config = spec.model.resolve()
    points = [ProfilePoint(micro_batch_size=m, block_forward_seconds=1e-3,
                           block_backward_seconds=2e-3, other_forward_seconds=1e-3,
                           other_backward_seconds=2e-3, compute_memory_bytes=2**20)
              for m in (1, 2)]
    seeded = GpuProfile(product="cpu", memory_capacity_bytes=8 * 2**30, source="measured",
                        model_key=model_key(config.architecture_key(), "fp32"),
                        precision="fp32", points=points)
    path = profiler.cache_path(tmp_path / ".cache" / "cephalo" / "profiles", "cpu", config,
                               "fp32")
    path.parent.mkdir(parents=True)
    path.write_text(seeded.to_compact_json())
    return path


def test_a_plan_beyond_the_profiled_sizes_is_measured_once_then_runs(tmp_path: Path) -> None:
    job = tmp_path / "sizes.yaml"
    job.write_text(JOB)
    cache = _seed_cache(tmp_path, job)
    done = run_cephalo(tmp_path, "run", str(job), "--devices", "cpu:1")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "Measuring micro-batch size 6 of cpu (beyond the profiled 1-2)" in out, out
    passes = [line for line in out.splitlines() if line.startswith("  profiled cpu ")]
    assert len(passes) == 2, out  # the cached base profile, then the one extra pass
    assert "micro-batch sizes 1, 2, compute from the cache" in passes[0]
    assert "micro-batch sizes 6, measured in" in passes[1]
    # The cache holds both passes' sizes.
    sizes = [p.micro_batch_size for p in GpuProfile.model_validate_json(
        cache.read_text()).points]
    assert sizes == [1, 2, 6]
    (run_dir,) = sorted((tmp_path / "runs" / "sizes").iterdir())
    plan = json.loads((run_dir / "plan.json").read_text())
    # Nothing beyond the largest measured size; a size between measured ones (3, say,
    # where this machine's measured 6 makes two microbatches cheaper) is interpolated.
    assert all(r["micro_batch_size"] <= max(sizes) for r in plan["ranks"]), plan["ranks"]
    assert "extrapolated" not in json.dumps(plan)
    assert "~ = micro-batch size above the profiled ones" not in out
    assert (run_dir / "profiles" / "measured-cpu-mbs-6.json").is_file()
    # An ephemeral job: no checkpoint anywhere, and the summary says so.
    assert "checkpoints none (spec.checkpoint.ephemeral: true)" in out, out
    assert not (run_dir / "checkpoints").exists() or not any(
        (run_dir / "checkpoints").iterdir())
    # The next run finds every size it plans with in the cache: no extra pass.
    again = run_cephalo(tmp_path, "run", str(job), "--devices", "cpu:1")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Measuring micro-batch" not in again.stdout, again.stdout
