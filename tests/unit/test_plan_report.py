"""The printed plan (`cephalo plan`, and `cephalo run` before training): the words and the
figures a newcomer reads (issue 26 items 4, 7 and 13)."""

from __future__ import annotations

import pytest

from cephalo.api.job import ModelSpec
from cephalo.api.plan import Plan
from cephalo.planner.outputs.report import format_plan, model_title


def _plan(world: int = 2, used_bytes: int = 40 * 2**20, cap_bytes: int = 3 * 2**30,
          gpu: str = "cpu", **extra: object) -> Plan:
    return Plan.model_validate({
        "global_batch_size": 4 * world, "world_size": world, "predicted_step_seconds": 0.1,
        "predicted_samples_per_second": 40.0 * world,
        "ranks": [{"rank": i, "gpu": gpu, "batch_size": 4, "micro_batch_size": 4,
                   "num_micro_batches": 1, "shard_ratio": 1 / world,
                   "predicted_memory_bytes": used_bytes, "memory_capacity_bytes": cap_bytes}
                  for i in range(world)], **extra})


def test_memory_shows_each_figure_in_a_unit_that_shows_it() -> None:
    """Issue 26 item 4: CPU ranks showed `0.0 / 2.9 GiB` (40 MiB used)."""
    row = format_plan(_plan(), "gpt-tiny").splitlines()[4]
    assert "40.0 MiB /   3.0 GiB" in row, row
    big = format_plan(_plan(used_bytes=5 * 2**30, cap_bytes=24 * 2**30), "x").splitlines()[4]
    assert "5.0 GiB /  24.0 GiB" in big, big


@pytest.mark.parametrize(("world", "gpu", "words"), [
    (1, "L4", "on 1 GPU ("), (2, "L4", "on 2 GPUs ("),
    (1, "cpu", "on 1 CPU rank ("), (3, "cpu", "on 3 CPU ranks ("),  # was 'on 3 GPUs'
    (2, "RTX-A6000", "on 2 GPUs (")])  # emulated GPUs are named by the GPU they stand for
def test_plural_words(world: int, gpu: str, words: str) -> None:
    """Issue 26 item 13: 'on 1 GPUs'; the README walk: 'on 3 GPUs' for CPU ranks."""
    assert words in format_plan(_plan(world, gpu=gpu), "gpt-tiny").splitlines()[0]


@pytest.mark.parametrize(("model", "title"), [
    ({"preset": "gpt-small"}, "gpt-small"),
    ({"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4}, "gpt"),
    ({"pretrained": "data/tiny-llama", "family": "llama"}, "tiny-llama (pretrained llama)"),
    ({"pretrained": "s3://bucket/models/llama-3/"}, "llama-3 (pretrained)"),
])
def test_the_model_is_named_as_the_job_names_it(model: dict, title: str) -> None:
    """'Plan for llama' for a pretrained model: its folder names it."""
    assert model_title(ModelSpec.model_validate(model)) == title


def test_one_note_for_ranks_that_share_it() -> None:
    """Issue 26 item 13: one offload note per rank (8 identical lines for vit-e's V100s)."""
    same = "offloads its boundary activations (917.1 MiB would not fit): 0.0007 s per step"
    notes = [f"rank {r} (V100-16GB) {same}" for r in range(2, 6)] + ["something else"]
    text = format_plan(_plan(6, notes=notes), "vit-e")
    lines = [line for line in text.splitlines() if line.startswith("note:")]
    assert lines == [f"note: ranks 2-5 (4 x V100-16GB): each {same}", "note: something else"]


def test_the_header_states_what_the_plan_assumed() -> None:
    """Issue 26 item 7: the plan never said which bandwidth it assumed (vit-e on Cluster B:
    8 of 64 GPUs at the 10 Gbit/s default, 64 at the job's 100 Gbit/s)."""
    plan = _plan(assumptions={"network_bandwidth_bytes_per_second": 12.5e9,
                              "network_latency_seconds": 5e-5, "state_bytes_per_parameter": 16})
    assert format_plan(plan, "vit-e").splitlines()[1] == (
        "assumes: network 100 Gbit/s per GPU for collectives, latency 50 us per hop, 16 bytes of "
        "training state per parameter")
    assert format_plan(_plan(), "x").splitlines()[1] == ""  # a hand-written plan: nothing
