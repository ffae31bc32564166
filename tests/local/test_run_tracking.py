"""Following a real `cephalo run` (issue 38): spec.tracking.tensorboard (rank 0's event files,
read back with TensorBoard's own EventAccumulator, agree with the run's progress file and
plan) and --metrics-port (every rank's Prometheus page, read while it trains)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.ports import free_listen_ports

from .cli_helpers import cephalo_cmd, run_cephalo, run_without_module

pytestmark = pytest.mark.slow

POLL_SECONDS = 0.05  # far below how long a rank serves its page (seconds)


def _read_pages_while(proc: subprocess.Popen, ports: list[int]) -> list[str]:
    """Each port's /metrics page, read while `proc` runs (polled every POLL_SECONDS: the
    ranks serve from start-up to exit, seconds on end); "" for a port never read."""
    pages = dict.fromkeys(ports, "")
    while proc.poll() is None and not all(pages.values()):
        # A pause between rounds: a refused connection returns at once, and without it this
        # loop spun a core for the whole start-up of the ranks it waits for.
        time.sleep(POLL_SECONDS)
        for port in ports:
            if not pages[port]:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                                timeout=2) as resp:
                        pages[port] = resp.read().decode()
                except OSError:
                    pass
    return [pages[p] for p in ports]


def test_rank_0_writes_event_files_tensorboard_reads_back(tmp_path: Path, tiny_job) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = tiny_job(steps=4)
    job.write_text(job.read_text().replace("seed: 3}", "seed: 3, evalIntervalSteps: 2}")
                   + "  tracking: {tensorboard: true}\n")
    # A given plan (no profiling: the test stays short); its prediction is what TensorBoard
    # must show next to the measured throughput.
    (tmp_path / "plan.json").write_text(json.dumps({
        "global_batch_size": 6, "world_size": 2, "predicted_step_seconds": 0.5,
        "predicted_samples_per_second": 12.0,
        "ranks": [{"rank": i, "batch_size": 3, "micro_batch_size": 3, "num_micro_batches": 1,
                   "shard_ratio": 0.5} for i in range(2)]}))
    # --metrics-port: each rank serves its /metrics page while it trains (read as it runs).
    port = free_listen_ports(2)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / ".cache"))
    proc = subprocess.Popen(cephalo_cmd("run", str(job), "--devices", "cpu:2", "--plan",
                                        "plan.json", "--metrics-port", str(port)),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    pages = _read_pages_while(proc, [port, port + 1])
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stdout + stderr
    assert f"Prometheus /metrics: http://127.0.0.1:{port}/metrics (rank 0) to :{port + 1} " \
           "(rank 1)" in stdout
    for rank, page in enumerate(pages):  # the series a rank pod serves, by rank
        assert f'cephalo_predicted_step_seconds{{rank="{rank}"}} 0.5' in page, page
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    (run_dir,) = (tmp_path / "runs" / "tiny").iterdir()
    assert f"tensorboard --logdir {run_dir / 'tensorboard'}" in done.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    plan = json.loads((run_dir / "plan.json").read_text())

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    for key, tag in (("loss", "loss/train"), ("samples_per_second",
                                              "throughput/samples_per_second"),
                     ("learning_rate", "optimizer/learning_rate")):
        assert scalars(tag) == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records]
    assert [s for s, _ in scalars("loss/validation")] == [2, 4]
    assert scalars("loss/validation") == [
        (r["step"], pytest.approx(r["validation_loss"], rel=1e-6)) for r in records
        if "validation_loss" in r]
    assert scalars("throughput/predicted_samples_per_second") == [(r["step"], 12.0)
                                                                   for r in records]
    for rank in range(plan["world_size"]):  # every rank's compute and wait, from rank 0
        assert [s for s, _ in scalars(f"ranks/compute_seconds/rank{rank}")] == [1, 2, 3, 4]
    (text,) = events.Tensors("plan/text_summary")
    assert f'"world_size": {plan["world_size"]}' in text.tensor_proto.string_val[0].decode()


def test_without_tracking_no_event_files_and_missing_package_is_refused(tmp_path: Path,
                                                                       tiny_job) -> None:
    """No tracking: nothing written (the same run as every other local test, which asserts
    its files); asked for without the package: one line before anything starts."""
    job = tiny_job(steps=1)
    job.write_text(job.read_text() + "  tracking: {tensorboard: true}\n")
    done = run_without_module(tmp_path, "tensorboard", job)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "spec.tracking.tensorboard: the tensorboard package is not installed" in done.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("rank-*.log"))


def test_metrics_port_out_of_range_or_taken_is_one_line_before_any_rank(tmp_path: Path,
                                                                        tiny_job) -> None:
    job = tiny_job(steps=1)
    (tmp_path / "plan.json").write_text(json.dumps({
        "global_batch_size": 6, "world_size": 2,
        "ranks": [{"rank": i, "batch_size": 3, "micro_batch_size": 3, "num_micro_batches": 1,
                   "shard_ratio": 0.5} for i in range(2)]}))
    args = ("run", str(job), "--devices", "cpu:2", "--plan", "plan.json", "--metrics-port")
    done = run_cephalo(tmp_path, *args, "70000")
    assert done.returncode == 2 and "--metrics-port 70000: give a TCP port" in done.stderr
    done = run_cephalo(tmp_path, *args, "65535")
    assert done.returncode == 2 and "2 ranks need ports 65535 to 65536" in done.stderr
    port = free_listen_ports(2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        done = run_cephalo(tmp_path, *args, str(port))
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"port {port + 1} (rank 1) is taken" in done.stderr
    assert not list(tmp_path.glob("runs/tiny/*/logs/rank-*.log"))  # no rank started
