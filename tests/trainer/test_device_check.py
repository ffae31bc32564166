"""`scripts/device-check.sh` (issue 43, item 7) cannot break unseen: its dry run on the CPU
(`--cpu`: the same plumbing over gloo with tiny sizes) runs its cheapest step here, the NCCL
step's script (`bench/nccl_check.py`) on gloo, and what reads its figures
(`scripts/device_check_summary.py`) is held to the trainer's own output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from cephalo.trainer.run import TrainOutcome, memory_report
from tests.load_file import load_file

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "device-check.sh"
summary_module = load_file(ROOT / "scripts" / "device_check_summary.py",
                           "device_check_summary")
nccl_check = load_file(ROOT / "bench" / "nccl_check.py", "nccl_check")
# What the device tool brings back from $OUT (/work/.library/device/README.md).
MAX_FILES_BACK = 8


def _dry_run(out: Path, only: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=600,
        env={**os.environ, "OUT": str(out), "CEPHALO_DEVICE_CHECK_PYTHON": sys.executable,
             "CEPHALO_DEVICE_CHECK_ONLY": only, **env})


def test_dry_run_of_the_nccl_step_writes_its_figures_as_json(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "nccl")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "preflight: the trainer, the profiler and the probe import" in done.stdout
    lines = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == ["nccl"]  # every other step skipped by name
    [record] = lines
    assert record["exit"] == 0 and not record["timed_out"]
    figures = record["figures"]
    assert figures["failed"] == [] and figures["device"] == "cpu"
    single = figures["single_rank"]
    assert single["backend"] == "gloo"
    assert set(single["backend_calls"]) == {"all_gather_into_tensor", "reduce_scatter_tensor",
                                            "broadcast", "reduce", "all_reduce", "barrier"}
    assert all(c["ok"] and c["seconds"] > 0 for c in single["backend_calls"].values())
    uneven = single["uneven_collectives"]
    # At world size 1 the trainer's collectives make no backend call; its gather does.
    assert uneven["backend_calls_at_world_size_1"] == {}
    assert uneven["gather_into"]["backend_calls"] == 1
    assert uneven["gather_into"]["wait_seconds"] > 0
    two = figures["two_ranks_gloo"]
    assert two["ok"] and two["max_relative_loss_difference"] == 0.0  # CPU against CPU
    assert len(two["cpu"]["losses"]) == nccl_check.ENGINE_STEPS
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["logs.tar.gz", "summary.jsonl", "summary.log"]
    assert len(files) <= MAX_FILES_BACK
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert "./nccl.log" in tar.getnames()


def test_an_unknown_device_is_a_one_line_error(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "OUT": str(tmp_path),
                               "CEPHALO_DEVICE_CHECK_DEVICE": "tpu"})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("device-check.sh: error: CEPHALO_DEVICE_CHECK_DEVICE=tpu: "
                                   "give cuda or cpu")


def test_run_memory_reads_the_trainers_own_lines(tmp_path: Path) -> None:
    outcome = TrainOutcome(first_step=0, last_step=3, memory_estimate_bytes=3 * 2**30,
                           peak_memory_bytes=4 * 2**30)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "rank-0.log").write_text(
        "cephalo trainer: step 3\n"
        f"cephalo trainer (rank 0): {memory_report(outcome, 5 * 2**30)}\n")
    (logs / "rank-1.log").write_text(
        f"cephalo trainer (rank 1): {memory_report(outcome, None)}\n")
    ranks = summary_module.run_memory(tmp_path)["ranks"]
    assert ranks == [
        {"rank": 0, "peak_memory_bytes": 4 * 2**30, "memory_estimate_bytes": 3 * 2**30,
         "predicted_memory_bytes": 5 * 2**30, "peak_over_estimate": 4 / 3},
        {"rank": 1, "peak_memory_bytes": 4 * 2**30, "memory_estimate_bytes": 3 * 2**30,
         "predicted_memory_bytes": None, "peak_over_estimate": 4 / 3}]


def test_no_memory_report_on_a_cpu_rank() -> None:
    assert memory_report(TrainOutcome(first_step=0, last_step=1, memory_estimate_bytes=10),
                         20) is None


def test_a_step_without_its_figures_says_so(tmp_path: Path) -> None:
    record = summary_module.step_record("profile", "profile", 124, 60.0, 60,
                                        tmp_path / "profile.json")
    assert record["timed_out"] and record["figures"] is None
    assert record["figures_missing"].startswith("profile.json: FileNotFoundError")


@pytest.mark.parametrize("tree, failed", [
    ({"a": {"ok": True}, "b": {"c": {"ok": False, "error": "x"}}}, ["/b/c"]),
    ({"ok": False, "a": {"ok": True}}, ["."]),
    ({"a": {"ok": True, "first": {"ok": True}}}, []),
])
def test_nccl_check_reports_every_failed_check(tree: dict, failed: list[str]) -> None:
    assert nccl_check.failures(tree) == failed
