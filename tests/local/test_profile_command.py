"""The profiler's command and visible GPUs (`cephalo run`, issue 43 item 1): under torchrun
every NCCL rank takes cuda:LOCAL_RANK, so every rank needs a visible GPU of its own, and rank 0
(which profiles its device) must see the profiled device as cuda:0."""

from __future__ import annotations

from pathlib import Path

import pytest

from cephalo.local.devices import LocalDevice
from cephalo.local.runner import profile_command


def _ranks(command: list[str]) -> int:
    [flag] = [a for a in command if a.startswith("--nproc-per-node=")]
    return int(flag.split("=", 1)[1])


@pytest.mark.parametrize("devices", [
    # A workstation with two different GPUs: the case Cephalo exists for.
    [LocalDevice("cuda", 0, "A6000"), LocalDevice("cuda", 1, "L4")],
    # Mixed, out of ordinal order, a product twice.
    [LocalDevice("cuda", 2, "L4"), LocalDevice("cuda", 0, "A10G"),
     LocalDevice("cuda", 1, "L4")],
])
def test_every_collectives_rank_has_a_gpu_of_its_own(devices: list[LocalDevice]) -> None:
    profiled = devices[0]
    command, visible = profile_command(profiled, devices, True, Path("job.yaml"),
                                       Path("out.json"))
    ordinals = [int(i) for i in visible.split(",")]
    assert "--collectives" in command
    assert _ranks(command) == len(devices)
    # One distinct visible GPU per rank, the profiled one first (rank 0's cuda:0).
    assert len(set(ordinals)) == len(ordinals) >= _ranks(command)
    assert ordinals[0] == profiled.index
    assert sorted(ordinals) == sorted(d.index for d in devices)


def test_a_single_device_profile_sees_only_its_gpu() -> None:
    devices = [LocalDevice("cuda", 0, "A6000"), LocalDevice("cuda", 1, "L4")]
    command, visible = profile_command(devices[1], devices, False, Path("job.yaml"),
                                       Path("out.json"))
    assert visible == "1" and "--collectives" not in command
    assert command[1:3] == ["-m", "cephalo.trainer.profile"]


def test_cpu_ranks_see_no_gpu() -> None:
    devices = [LocalDevice("cpu", i, "cpu") for i in range(2)]
    command, visible = profile_command(devices[0], devices, True, Path("job.yaml"),
                                       Path("out.json"))
    assert visible == "" and _ranks(command) == 2
