"""bench/rebalance.py's arithmetic on hand-made progress records (the launches themselves
are measurements, run by the script, not by the tests): which steps count, the fresh plan's
split and its predicted throughput, and bad arguments."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "rebalance.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_rebalance", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _record(step: int, split: list[int], per_sample: list[float], rest: float,
            **extra: Any) -> dict[str, Any]:
    compute = [t * b for t, b in zip(per_sample, split, strict=True)]
    step_seconds = max(compute) + rest
    return {"step": step, "batch_sizes": split, "step_seconds": step_seconds,
            "samples_per_second": sum(split) / step_seconds,
            "ranks": [{"compute_seconds": c} for c in compute], **extra}


def test_rates_leave_out_the_first_step_and_each_change_s_landing(bench: ModuleType) -> None:
    records = [_record(1, [4, 4], [0.1, 0.1], 9.0),  # start-up: left out
               _record(2, [4, 4], [0.1, 0.1], 0.0),
               _record(3, [4, 4], [0.1, 0.6], 0.0,
                       rebalanced={"from": [4, 4], "to": [7, 1], "step": 3}),
               _record(4, [7, 1], [0.1, 0.6], 5.0),  # the first step under [7, 1]: out
               _record(5, [7, 1], [0.1, 0.6], 0.0)]
    launch = bench.Launch(records)
    assert launch.rate(1, 2) == pytest.approx(8 / 0.4)
    assert launch.rate(4, 5) == pytest.approx(8 / 0.7)
    assert launch.changes() == ["[4, 4]->[7, 1]@3"] and launch.settled(2) == 5
    assert launch.seconds_per_sample(5) == pytest.approx([0.1, 0.6])


def test_a_fresh_plan_balances_the_measured_speeds_and_keeps_the_rest_of_the_step(
        bench: ModuleType) -> None:
    # Rank 1 takes 6x as long per sample; 0.05 s of each step is not compute.
    records = [_record(s, [4, 4], [0.1, 0.6], 0.05) for s in range(1, 6)]
    launch = bench.Launch(records)
    assert bench.fresh_split(launch, 2, 8) == [7, 1]
    # max(0.7, 0.6) + 0.05 s for 8 samples, against the measured 2.4 + 0.05 s.
    assert bench.fresh_prediction(launch, 2, 8) == pytest.approx(8 / 0.75)


@pytest.mark.parametrize("args", [["--rounds", "0"], ["--dilation", "0.5"],
                                  ["--slow-from", "20", "--steps", "24"], ["--batch", "4"]])
def test_bad_arguments_are_one_line_and_exit_2(bench: ModuleType, args: list[str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("bench/rebalance.py: need")
