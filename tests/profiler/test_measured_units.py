"""The profiler builds only the units it measures (issue 43, item 7: gpt-1.3b's whole model
drawn on the CPU was most of a profile's time), and they are the model's own units."""

from __future__ import annotations

import torch

from cephalo.api import preset
from cephalo.trainer import models, profile_units
from cephalo.trainer.flat import FlatUnit
from cephalo.trainer.profile_units import UnitProfiler

CONFIG = preset("gpt-tiny").model_copy(update={"num_layers": 6})


def test_only_the_measured_units_are_built(monkeypatch) -> None:
    built: list[int] = []
    real = models.build_unit

    def counting(config, index, seed=None):
        built.append(index)
        return real(config, index, seed)

    monkeypatch.setattr(models, "build_unit", counting)
    monkeypatch.setattr(profile_units, "build_unit", counting, raising=False)
    UnitProfiler(CONFIG, "fp32", torch.device("cpu"), seed=3)
    assert sorted(built) == [0, 1, CONFIG.num_layers + 1]


def test_the_measured_units_are_the_models_own() -> None:
    profiler = UnitProfiler(CONFIG, "fp32", torch.device("cpu"), seed=3)
    model = models.build_model(CONFIG, seed=3)
    for index, full in zip((0, 1, CONFIG.num_layers + 1), profiler.fulls, strict=True):
        assert torch.equal(full, FlatUnit(index, model.units[index], [1.0], 0).flatten())
