"""The one memory model (cephalo.api.memory) against the engine's real allocations: two gloo
ranks on CPU, every byte torch's CPU allocator hands out during a warm step recorded by
torch.profiler, and the peak compared with what the planner would predict for that rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cephalo.api import memory, preset
from cephalo.api.models import ModelConfig
from cephalo.trainer.spawn import spawn_ranks
from cephalo.trainer.torch_memory import live_bytes_peak

# More blocks than gpt-tiny's two, so that the largest unit is a block and a block's
# backward has a block both before (its gradient in flight) and after (prefetched) it.
CONFIG = preset("gpt-tiny").model_copy(update={"num_layers": 5})
BATCH, MICRO = 4, 2
# The model may overstate the peak by this share: it counts all five unit buffers at the
# largest unit's size (here the prefetched one is the smaller embedding) and the previous
# unit's gradient as still under its reduce-scatter, which it is only when the collective
# is slow (measured: 3.60 MB against 4.02 MB predicted, 10.5 % over). It must never
# understate it beyond allocator rounding: that is an out-of-memory error on a GPU.
OVERSTATE_TOLERANCE = 0.15
# Allocator rounding only. Session 8 once measured 4.4 % over (timing-dependent): gloo's
# worker threads held finished collectives, and with them gathered unit buffers and full
# gradients, past `wait()` and the last Python reference, into the next unit's peak. The
# engine now frees those buffers itself (trainer/passes.py `release`, `reduce_scatter`'s
# `consume`); test_freed_buffers_do_not_wait_for_gloo_threads keeps the mechanism covered.
UNDERSTATE_TOLERANCE = 0.02


def _rank(rank: int, world_size: int, config: ModelConfig, by_owner: bool
          ) -> dict[str, Any]:
    from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine, Layout

    layout = Layout(batch_sizes=[BATCH] * world_size, micro_batch_sizes=[MICRO] * world_size,
                    shard_ratios=[1 / world_size] * world_size)
    engine = Engine(config, TrainingSpec(), layout, precision="fp32")
    engine.comm.reduce_by_owner = by_owner  # NCCL's uneven reduce-scatter, run on gloo
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)

    def step() -> None:
        engine.step(data.micro_batches(engine.step_count, rank * BATCH, (rank + 1) * BATCH,
                                       MICRO))

    step()  # the first step allocates nothing the later ones do not
    return {"peak": live_bytes_peak(step), "owned": sum(u.shard_numel for u in engine.units),
            "estimate": engine.memory_estimate_bytes(), "offload": engine.store.offload}


@pytest.mark.slow
@pytest.mark.parametrize("by_owner", [False, True], ids=["all-reduce", "reduce-by-owner"])
def test_engine_peak_agrees_with_the_memory_model(by_owner: bool) -> None:
    from cephalo.trainer.profile_units import UnitProfiler

    torch.set_num_threads(1)
    # The profiler's compute memory for the microbatch size: gathered unit buffers plus one
    # unit's working set, the same figure the planner adds to the state.
    compute = UnitProfiler(CONFIG, "fp32", torch.device("cpu")).measure(
        [MICRO], repeats=1, warmup=0).points[0].compute_memory_bytes
    for r in spawn_ranks(_rank, 2, CONFIG, by_owner, timeout_seconds=180):
        # Master weights and both moments exist before the step; the gradient shards, the
        # unit buffers and the activations are allocated during it.
        measured = 3 * memory.FP32_BYTES * r["owned"] + r["peak"]
        kept = memory.kept_boundary_bytes(CONFIG.num_layers, BATCH, CONFIG.tokens_per_sample,
                                          CONFIG.hidden_size, r["offload"])
        predicted = memory.state_bytes(r["owned"]) + compute + kept
        assert measured <= predicted * (1 + UNDERSTATE_TOLERANCE), (measured, predicted)
        assert measured >= predicted * (1 - OVERSTATE_TOLERANCE), (measured, predicted)
        # The engine's own minimum is the same model without the working set.
        assert r["estimate"] == memory.state_bytes(r["owned"]) + memory.unit_buffer_bytes(
            max(CONFIG.unit_parameters())) + kept


def test_state_and_buffers_are_fp32_in_every_precision() -> None:
    # bf16 and fp16 autocast over fp32 master shards; gathers and gradients keep the shards'
    # dtype.
    assert memory.state_bytes_per_parameter("bf16") == memory.state_bytes_per_parameter(
        "fp16") == memory.state_bytes_per_parameter("fp32") == 16
    assert memory.unit_buffer_bytes(1000) == memory.UNIT_BUFFERS_AT_PEAK * 4 * 1000
    assert memory.kept_boundary_bytes(3, 2, 8, 16, offload=True) == 0
    assert memory.kept_boundary_bytes(3, 2, 8, 16, offload=False) == 5 * 2 * 8 * 16 * 4


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "auto"])
def test_hybrid_state_is_the_slice_plus_a_piece_of_the_state(precision: str) -> None:
    """4 n_j (the fp32 slice) + (master 4 + Adam 8 + gradient 4) n_j / G, in every
    precision; one group is flat sharding's state, the slice being the master."""
    n = 1_000_003.0
    assert memory.hybrid_state_bytes(n, 1, precision) == memory.state_bytes(n, precision)
    assert memory.hybrid_state_bytes(n, 2, precision) == pytest.approx(4 * n + 16 * n / 2)
    assert memory.hybrid_state_bytes(n, 8, precision) == pytest.approx(4 * n + 16 * n / 8)
    assert memory.hybrid_state_bytes(0.0, 4, precision) == 0.0
    with pytest.raises(ValueError, match="groups must be >= 1"):
        memory.hybrid_state_bytes(n, 0, precision)


def test_boundary_activations_stay_fp32_under_bf16_autocast() -> None:
    from cephalo.api.job import DataSpec, SyntheticData
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.models import build_model
    from cephalo.trainer.unit_ops import autocast

    for name in ("gpt-tiny", "llama-tiny"):
        config = preset(name)
        model = build_model(config, seed=0)
        inputs, _ = DataSource(config, DataSpec(synthetic=SyntheticData()), 0).batch(0, 0, 1)
        with torch.no_grad(), autocast(torch.device("cpu"), "bf16"):
            hidden = model.units[1](model.units[0](inputs))
        assert hidden.element_size() == memory.BOUNDARY_BYTES_PER_ELEMENT, name
