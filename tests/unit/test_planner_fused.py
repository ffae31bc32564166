"""The planner's fused-everything mode (GpuCostModel.fused_everything): every working rank
keeps all L blocks and the engine runs them all per microbatch with the head. Priced with the
engine's own memory figure (cephalo.api.memory.fused_tail_bytes) only where the engine does
fuse (memory.fused_tail_blocks), timed without recompute or a block's second gather, chosen
by `solve` where it is fastest, and honoured by the engine that a plan's layout builds: one
gather per block per step (the embedding is still gathered again for its recompute)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from cephalo.api import ClusterSpec, GpuGroup, memory
from cephalo.planner import solve
from cephalo.planner.outputs.report import format_plan
from cephalo.planner.search.problem import build_problem, fused_everything, without_recompute

from .planner_instances import MIB, job_spec
from .test_recompute_plan import _l4_profile

BATCH = 16


def _problem(mib: int, graph_bytes_per_sample: float | None = None):  # type: ignore[no-untyped-def]
    spec = job_spec(BATCH)
    model = spec.model.resolve()
    profile = _l4_profile(model, graph_bytes_per_sample)
    cluster = ClusterSpec(groups=[GpuGroup(product="L4", count=2, memory_bytes=mib * MIB)])
    return spec, cluster, {"L4": profile}, build_problem(spec, cluster, {"L4": profile})


@pytest.mark.parametrize("graph", [None, 12_345.5])
def test_the_memory_is_the_engines_fused_tail_where_the_engine_fuses(graph: float | None
                                                                     ) -> None:
    _, _, _, problem = _problem(64, graph)
    model, layers = problem.model, problem.model.num_layers
    dims = (model.tokens_per_sample, model.hidden_size, model.ffn_hidden_size)
    recompute = problem.classes[0].cost
    fused = fused_everything(problem).classes[0].cost
    for m, ell in [(1, 2), (2, 4), (4, 2), (3, 5), (1, 1), (4, 1), (0, 0)]:
        base = float(recompute.compute_memory_bytes(np.array([m]))[0])
        got = float(fused.compute_memory_bytes(np.array([m]), np.array([ell]))[0])
        engine_fuses = m == 0 or memory.fused_tail_blocks(
            [layers], [m * ell], [m], *dims, model.block_parameters(), [graph]) == layers
        if not engine_fuses:
            assert got == np.inf, (m, ell)  # one microbatch: nothing to save, never offered
        elif m == 0:
            assert got == base  # a rank without samples holds none of the tail
        else:
            assert got == base + memory.fused_tail_bytes(layers, m, *dims,
                                                         model.block_parameters(), graph)
    # Where only m is known (the search's lower bound): the fused figure, unchecked.
    assert float(fused.compute_memory_bytes(np.array([2]))[0]) < np.inf


def test_the_time_skips_recompute_and_the_blocks_second_gather() -> None:
    _, _, _, problem = _problem(64)
    comm = problem.unit_comm(uneven=True)
    layers = problem.model.num_layers
    ell, m = np.array([4]), np.array([2])
    recompute = problem.classes[0].cost
    fused = fused_everything(problem).classes[0].cost
    keep_all = without_recompute(problem).classes[0].cost
    kept_all = float(recompute.step_seconds(ell, m, comm, np.array([layers]))[0])
    got = float(fused.step_seconds(ell, m, comm)[0])
    # Keeping everything also skips the embedding's second gather; recompute mode keeping
    # every block's graph still gathers every block again.
    assert float(keep_all.step_seconds(ell, m, comm)[0]) <= got <= kept_all
    assert got < float(recompute.step_seconds(ell, m, comm)[0])


def test_solve_runs_every_block_per_microbatch_where_keeping_everything_does_not_fit(
        ) -> None:
    spec, cluster, profiles, problem = _problem(6)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    layers = problem.model.num_layers
    assert plan.recompute is None
    assert [r.kept_blocks for r in plan.ranks] == [layers] * 2
    (line,) = [t for t in format_plan(plan, "gpt-tiny").splitlines()
               if t.startswith("activations:")]
    # The README walk: 'recomputed in the backward; every block ... (no recompute, ...)'
    assert line == ("activations: not recomputed; every block (2) runs per microbatch with the "
                    "head on every rank that has samples (parameters gathered once: the fused "
                    "tail)"), line
    with pytest.raises(Exception, match="iB"):
        solve(spec, ClusterSpec(groups=[GpuGroup(product="L4", count=2, memory_bytes=2 * MIB)]),
              profiles, choose_gpus=False)


def _engine_worker(rank: int, world_size: int, plan_json: str) -> dict[str, Any]:
    from cephalo.api.job import DataSpec, SyntheticData, TrainingSpec
    from cephalo.api.plan import Plan
    from cephalo.trainer.data import DataSource
    from cephalo.trainer.engine import Engine
    from cephalo.trainer.env import layout_from_plan

    plan = Plan.model_validate_json(plan_json)
    layout = layout_from_plan(plan)
    config = job_spec(BATCH).model.resolve()
    engine = Engine(config, TrainingSpec(), layout)
    data = DataSource(config, DataSpec(synthetic=SyntheticData()), seed=0)
    start, end = layout.sample_range(rank)
    engine.comm.stats.reset()
    engine.step(data.micro_batches(0, start, end, layout.micro_batch_sizes[rank]))
    return {"fused": engine.fused_tail, "gathers": engine.comm.stats.calls["all_gather"],
            "units": len(engine.units)}


@pytest.mark.slow
def test_the_engine_runs_the_plans_fused_tail() -> None:
    from cephalo.trainer.spawn import spawn_ranks

    spec, cluster, profiles, problem = _problem(6)
    plan = solve(spec, cluster, profiles, choose_gpus=False)
    for got in spawn_ranks(_engine_worker, 2, plan.to_json(), timeout_seconds=120):
        assert got["fused"] == problem.model.num_layers
        # Every unit once, and the embedding again for its recompute.
        assert got["gathers"] == got["units"] + 1
