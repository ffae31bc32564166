"""`bench/paper_figures.py`, which README's benchmark table lists: the README walk found it
ending in a ProfileMismatchError traceback at its first Llama row (the job it built lost the
Llama presets' norm_epsilon, so the authors' profiles, keyed for the preset, were refused)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cephalo.planner.cost.authors_profiles import AUTHORS_MODELS

BENCH = Path(__file__).resolve().parents[2] / "bench" / "paper_figures.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("paper_figures_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("model", sorted(AUTHORS_MODELS))
def test_the_bench_job_is_the_model_the_authors_profiles_are_keyed_for(bench, model) -> None:
    assert bench.job(AUTHORS_MODELS[model], 128).model.resolve() == AUTHORS_MODELS[model]


def test_a_llama_row_plans_from_the_authors_profiles(bench) -> None:
    got = bench.plans("deepspeedllama_3b", bench.CLUSTER_A, 50.0, 128, "A")
    assert not isinstance(got["authors"], str) and got["authors"].world_size >= 1, got
