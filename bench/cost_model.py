"""Cost-model accuracy on this CPU (issue 4): profile the tiny GPT and Llama presets, plan
1-3 rank runs with several batch / microbatch settings, run the real trainer processes (the
same launcher as `cephalo run`) and compare measured with predicted step time. Memory:
compute memory predicted by the linear model from microbatch sizes 1-4, against the bytes
counted in a real step at microbatch 8.

Targets: step time within 15%, memory within 10%. Run: python bench/cost_model.py
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from cephalo.api import (
    ClusterSpec,
    CollectiveProfile,
    GpuGroup,
    GpuProfile,
    Plan,
    RankPlan,
    parse_job,
)
from cephalo.local.devices import LocalDevice
from cephalo.local.launcher import RankEnv, launch
from cephalo.local.runner import (
    LOCAL_LATENCY_SECONDS,
    LOOPBACK_BANDWIDTH_BYTES_PER_SECOND,
    contention_factor,
    slowed,
)
from cephalo.planner.costmodel import GpuCostModel
from cephalo.planner.evaluate import score
from cephalo.planner.problem import build_problem
from cephalo.trainer.profile import UnitProfiler, profile_job

STEPS = 40
# (ranks' (micro_batch_size, num_micro_batches)) settings per model.
SETTINGS = [
    [(8, 1)], [(4, 2)], [(1, 8)],
    [(4, 1), (4, 1)], [(3, 2), (2, 1)], [(2, 3), (1, 2)],
    [(5, 1), (2, 1), (1, 1)],
]


def job_spec(preset: str, batch: int):
    return parse_job({"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
                      "metadata": {"name": "bench"},
                      "spec": {"model": {"preset": preset}, "globalBatchSize": batch,
                               "training": {"steps": STEPS, "learningRate": 1e-3},
                               "checkpoint": {"intervalSteps": 1000}}})


def measure_collectives(preset: str, world_size: int, work: Path) -> CollectiveProfile:
    """The run's collectives, measured as `cephalo run` does (torchrun, one process per rank)."""
    job_file = work / f"collectives-{preset}.yaml"
    job_file.write_text(yaml.safe_dump(job_spec(preset, 8).model_dump(
        by_alias=True, exclude_none=True, mode="json")))
    out = work / f"collectives-{preset}-{world_size}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", CEPHALO_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={world_size}", "-m", "cephalo.trainer.profile",
                    "--collectives", "--job", str(job_file), "--output", str(out),
                    "--micro-batch-sizes", "1", "--repeats", "15", "--cache-dir", "none"],
                   check=True, cwd=work, env=env, capture_output=True)
    collectives = GpuProfile.model_validate_json(out.read_text()).collectives
    assert collectives is not None
    return collectives


def measure(preset: str, setting: list[tuple[int, int]], profile: GpuProfile,
            work: Path) -> tuple[float, float]:
    """(predicted, measured) median step seconds of one setting."""
    batch = sum(m * n for m, n in setting)
    job = job_spec(preset, batch)
    devices = [LocalDevice("cpu", i, "cpu") for i in range(len(setting))]
    cluster = ClusterSpec(groups=[GpuGroup(product="cpu", count=len(setting),
                                           memory_bytes=2**30)],
                          network_bandwidth_bytes_per_second=LOOPBACK_BANDWIDTH_BYTES_PER_SECOND,
                          network_latency_seconds=LOCAL_LATENCY_SECONDS)
    problem = build_problem(job.spec, cluster, {"cpu": slowed(profile,
                                                              contention_factor(devices))})
    ev = score(problem, [m for m, _ in setting], [n for _, n in setting])
    plan = Plan(global_batch_size=batch, world_size=len(setting),
                predicted_step_seconds=ev.step_seconds,
                ranks=[RankPlan(rank=i, batch_size=m * n, micro_batch_size=m,
                                num_micro_batches=n, shard_ratio=ev.shard_ratios[i])
                       for i, (m, n) in enumerate(setting)])
    run_dir = Path(tempfile.mkdtemp(dir=work))
    job_file, plan_file = run_dir / "job.yaml", run_dir / "plan.json"
    job_file.write_text(yaml.safe_dump(job.model_dump(by_alias=True, exclude_none=True,
                                                      mode="json")))
    plan_file.write_text(plan.to_json())
    result = launch(plan, [RankEnv(d) for d in devices], run_dir, job_file, plan_file,
                    lambda records: None, threads_per_rank=1)
    if result.returncode != 0:
        raise RuntimeError(f"run failed: {result.error_tail}")
    # Wall-clock time between consecutive steps (data, engine, logging: what throughput
    # sees), skipping the warm-up steps.
    times = [r["time"] for r in result.records]
    steady = [b - a for a, b in itertools.pairwise(times[2:])]
    return ev.step_seconds, statistics.median(steady)


def memory_check(preset: str) -> tuple[int, int]:
    """(predicted, counted) compute bytes at microbatch 8 from a 1-4 profile."""
    spec = job_spec(preset, 8).spec
    small = profile_job(spec, device=torch.device("cpu"), micro_batch_sizes=[1, 2, 3, 4],
                        repeats=1, warmup=0)
    model = spec.model.resolve()
    from cephalo.planner.catalog import lookup_gpu

    cost = GpuCostModel(lookup_gpu("cpu"), small, 2**30, model.num_layers)
    predicted = int(cost.compute_memory_bytes([8])[0])
    profiler = UnitProfiler(model, "fp32", torch.device("cpu"))
    inputs, targets = profiler.data.batch(0, 0, 8)
    from cephalo.trainer.unit_ops import forward_unit

    (hidden,) = forward_unit(profiler.units[0], profiler.fulls[0], [inputs],
                             torch.device("cpu"), "fp32")
    counted = profiler.compute_memory_bytes(8, inputs, targets, hidden)
    return predicted, counted


def main() -> int:
    torch.set_num_threads(1)
    worst_time = worst_memory = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for preset in ("gpt-tiny", "llama-tiny"):
            spec = job_spec(preset, 8).spec
            print(f"\n{preset}: wall time per step, predicted vs measured (median, steps "
                  f"4-{STEPS}); "
                  "each setting profiled right before it runs, so that a shared machine's "
                  "drift between profile and run does not count as model error")
            print(f"  {'ranks: m x l':<28}{'predicted s':>12}{'measured s':>12}{'error':>8}"
                  "  collectives")
            for setting in SETTINGS:
                sizes = sorted({m for m, _ in setting} | {1, 8})
                profile = profile_job(spec, device=torch.device("cpu"), micro_batch_sizes=sizes,
                                      repeats=15, warmup=3)
                comm = measure_collectives(preset, len(setting), work) \
                    if len(setting) > 1 else None
                with_comm = profile.model_copy(update={"collectives": comm})
                predicted, measured = measure(preset, setting, with_comm, work)
                error = measured / predicted - 1
                worst_time = max(worst_time, abs(error))
                label = ", ".join(f"{m}x{n}" for m, n in setting)
                links = (f"  {comm.bandwidth_bytes_per_second / 1e6:.0f} MB/s, "
                         f"{comm.latency_seconds * 1e3:.2f} ms, overlap "
                         f"{comm.overlap_fraction:.2f}") if comm else ""
                print(f"  {label:<28}{predicted:>12.4f}{measured:>12.4f}{error:>+8.1%}{links}")
            predicted_mem, counted_mem = memory_check(preset)
            mem_error = predicted_mem / counted_mem - 1
            worst_memory = max(worst_memory, abs(mem_error))
            print(f"  compute memory at microbatch 8: predicted {predicted_mem} B from sizes "
                  f"1-4, counted {counted_mem} B ({mem_error:+.1%})")
    print(f"\nworst step-time error {worst_time:.1%} (target 15%: "
          f"{'met' if worst_time <= 0.15 else 'MISSED'}); worst memory error "
          f"{worst_memory:.1%} (target 10%: {'met' if worst_memory <= 0.10 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
