"""Does the quickstart show the point at any load? Runs `cephalo run examples/quickstart.yaml`
(two CPU ranks emulating an RTX A6000 and a P40) beside 0, 2, 4 ... busy CPU hogs and
reports, per run, what the planner chose from what it measured then:

* the GPUs the plan uses (the point: both, every time);
* predicted samples/s of that plan (the run's plan.json) and of the best one-GPU plan (the
  same planner, `cephalo.planner.solve`, on each emulated GPU alone with the profiles the
  run planned with), and their ratio, the margin;
* the collective latency the run measured (what load moves most), the measured samples/s,
  and the wall time of the whole `cephalo run` (profiling, planning, training, summary);
* /proc/loadavg before and after each run: the machine's background load, hogs included.

Loads are alternated between rounds (0,2,4 then 4,2,0 ...) so that a drift of the
machine's own background load does not line up with one load. By default each run profiles
compute afresh (an empty profile cache: as a first run on a new laptop does, and so the
compute profile is measured under the load too); `--cached` reuses the user's cache.

Run: `.venv/bin/python bench/quickstart_margin.py --loads 0,2,4 [--repeats 2]`. Target
(issue 39 item 5): both GPUs chosen in every run, the margin well above 1 at every load,
and the run about a minute.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cephalo.api.job import load_job
from cephalo.api.plan import load_plan
from cephalo.api.profile import GpuProfile
from cephalo.local.devices import select_devices
from cephalo.local.runner import EMULATE_ANNOTATION, build_cluster
from cephalo.planner import InfeasibleError, solve

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
HOG = "while 1: pass"


@dataclass
class Outcome:
    load: int
    used: list[str]
    predicted: float  # samples/s of the chosen plan
    one_gpu: float  # samples/s of the best one-GPU plan
    one_gpu_name: str
    latency_us: float
    measured: float | None
    wall_s: float
    loadavg_before: str
    loadavg_after: str

    @property
    def margin(self) -> float:
        return self.predicted / self.one_gpu


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def best_one_gpu(run_dir: Path, emulate: str) -> tuple[float, str]:
    """The best one-GPU plan's samples/s: the planner on each emulated GPU alone, with the
    emulated profiles the run planned with (same compute, memory caps and collectives)."""
    spec = load_job(str(run_dir / "job.yaml")).spec
    profiles = {p.stem.removeprefix("emulated-"): GpuProfile.model_validate_json(p.read_text())
                for p in (run_dir / "profiles").glob("emulated-*.json")}
    best, name = 0.0, "none fits"
    for device in select_devices(None, emulate):
        try:
            plan = solve(spec, build_cluster([device]), profiles)
        except InfeasibleError:
            continue  # this GPU alone cannot hold the job
        assert plan.predicted_step_seconds is not None
        rate = spec.global_batch_size / plan.predicted_step_seconds
        if rate > best:
            best, name = rate, device.product
    return best, name


def run_once(job: Path, load: int, emulate: str, cached: bool, steps: int | None,
             keep: Path | None) -> Outcome:
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(load)]
    try:
        time.sleep(1.0 if hogs else 0.0)  # let the hogs take their cores
        before = loadavg()
        with tempfile.TemporaryDirectory(prefix="quickstart-margin-") as tmp:
            run_dir = Path(tmp) / "run"
            if keep is not None:  # each run's directory and console output, to look into
                run_dir = keep / f"{time.strftime('%H%M%S')}-load{load}"
            env = dict(os.environ)
            if not cached:
                env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
            command = [str(Path(sys.executable).parent / "cephalo"), "run", str(job),
                       "--run-dir", str(run_dir)]
            if steps is not None:
                command += ["--steps", str(steps)]
            began = time.perf_counter()
            done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp)
            wall = time.perf_counter() - began
            after = loadavg()
            if keep is not None and run_dir.exists():
                (run_dir / "console.txt").write_text(done.stdout + done.stderr)
            if done.returncode != 0:
                raise SystemExit(f"cephalo run failed ({done.returncode}):\n"
                                 f"{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            plan = load_plan(str(run_dir / "plan.json"))
            assert plan.predicted_step_seconds is not None
            one_gpu, one_name = best_one_gpu(run_dir, emulate)
            measured_cpu = GpuProfile.model_validate_json(
                (run_dir / "profiles" / "measured-cpu.json").read_text())
            latency = measured_cpu.collectives.latency_seconds \
                if measured_cpu.collectives else float("nan")
            said = re.search(r"throughput\s+measured ([\d.]+) samples/s", done.stdout)
            return Outcome(load, [r.gpu for r in plan.ranks],
                           plan.global_batch_size / plan.predicted_step_seconds, one_gpu,
                           one_name, latency * 1e6, float(said.group(1)) if said else None,
                           wall, before, after)
    finally:
        for hog in hogs:
            hog.terminate()
        for hog in hogs:
            hog.wait()


def row(o: Outcome) -> str:
    measured = f"{o.measured:8.1f}" if o.measured is not None else "       -"
    return (f"{o.load:4d}  {'+'.join(o.used):<15} {o.predicted:8.2f}  {o.one_gpu:8.2f} "
            f"{o.one_gpu_name:<10} {o.margin:6.3f}x {o.latency_us:7.0f} {measured} "
            f"{o.wall_s:6.1f}  {o.loadavg_before:<15} {o.loadavg_after}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", default="0,2,4",
                        help="busy CPU hogs beside the run, comma-separated (default 0,2,4)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per load (default 2)")
    parser.add_argument("--job", type=Path, default=QUICKSTART)
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps per run (default: the job's)")
    parser.add_argument("--cached", action="store_true",
                        help="reuse the profile cache (default: profile compute afresh)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep each run's directory and console output under this folder")
    args = parser.parse_args(argv)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    loads = [int(x) for x in args.loads.split(",")]
    annotations = (load_job(str(args.job)).metadata.model_extra or {}).get("annotations") or {}
    emulate = annotations[EMULATE_ANNOTATION]
    print(f"{args.job.name}: emulating {emulate} on {os.cpu_count()} cores; loads {loads} x "
          f"{args.repeats}, {'cached' if args.cached else 'fresh'} compute profiles; "
          f"loadavg now {loadavg()}")
    print("load  GPUs used       pred s/s  1-GPU s/s  (which)   margin  lat us meas s/s "
          "wall s  loadavg before  after")
    outcomes: list[Outcome] = []
    for round_ in range(args.repeats):
        for load in (loads if round_ % 2 == 0 else loads[::-1]):
            outcomes.append(run_once(args.job, load, emulate, args.cached, args.steps,
                                     args.keep))
            print(row(outcomes[-1]), flush=True)
    print("\nper load: runs using both GPUs, margin min / median / max, wall median")
    every = len(emulate.split(","))
    for load in loads:
        mine = [o for o in outcomes if o.load == load]
        margins = [o.margin for o in mine]
        both = sum(len(o.used) == every for o in mine)
        print(f"  load {load}: {both}/{len(mine)} on all {every} GPUs; margin "
              f"{min(margins):.3f} / {statistics.median(margins):.3f} / {max(margins):.3f}x; "
              f"wall {statistics.median(o.wall_s for o in mine):.1f} s")
    print(f"loadavg at the end {loadavg()}")
    return 0 if all(len(o.used) == every for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
