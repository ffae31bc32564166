"""One profile cache key (cephalo.api.profile.profile_cache_key) for the operator's
ConfigMaps and the local profiler's files: every input that changes what a profile holds
changes the key, and both callers take their key from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cephalo.api import CephaloJob, preset
from cephalo.api import profile as profile_api
from cephalo.api.profile import profile_cache_key
from cephalo.operator.config import OperatorConfig
from cephalo.operator.render import profile_config_map_name

MODEL = preset("gpt-tiny")
BASE = dict(product="A10G", model=MODEL, precision="fp32", runtime="torch=2.13.0",
            micro_batch_sizes=[1, 2, 4])


def _key(**change: object) -> str:
    return profile_cache_key(**{**BASE, **change})  # type: ignore[arg-type]


def test_every_input_changes_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    base = _key()
    assert base == _key() and re.fullmatch(r"[a-z0-9-]{1,63}", base)
    variants = [
        _key(product="L4"),
        _key(model=MODEL.model_copy(update={"sequence_length": 64})),
        _key(model=preset("gpt-small")),
        _key(precision="bf16"),
        _key(runtime="torch=2.14.0"),
        _key(runtime="image=registry.example/cephalo-trainer:0.2.0"),
        _key(micro_batch_sizes=[1, 2]),
        _key(micro_batch_sizes=None),
    ]
    monkeypatch.setattr(profile_api, "PROFILE_FORMAT", profile_api.PROFILE_FORMAT + 1)
    variants.append(_key())  # a profiler that measures something new
    assert len({base, *variants}) == len(variants) + 1
    long_product = profile_cache_key("NVIDIA-" + "X" * 200, MODEL, "fp32", "torch=1")
    assert len(long_product) <= 63 and long_product.startswith("nvidia-x")


def test_the_operator_keys_by_its_profiler_image() -> None:
    job = CephaloJob.model_validate({
        "apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                 "planner": {"profileMicroBatchSizes": [1, 2, 4]}}})
    config = OperatorConfig(trainer_image="registry.example/trainer:1")
    name = profile_config_map_name("A10G", job, config)
    assert name == "cephalo-profile-" + _key(runtime="image=registry.example/trainer:1")
    # A new trainer image (another torch, another profiler) is profiled again ...
    assert name != profile_config_map_name(
        "A10G", job, OperatorConfig(trainer_image="registry.example/trainer:2"))
    # ... and so is a job that names its own image.
    own = job.model_copy(update={"spec": job.spec.model_copy(update={"image": "mine:3"})})
    assert profile_config_map_name("A10G", own, config) == \
        "cephalo-profile-" + _key(runtime="image=mine:3")


def test_the_local_profiler_keys_by_its_torch(tmp_path: Path) -> None:
    import torch

    from cephalo.trainer.profile import cache_path

    path = cache_path(tmp_path, "A10G", MODEL, "fp32")
    assert path == tmp_path / (_key(runtime=f"torch={torch.__version__}",
                                    micro_batch_sizes=None) + ".json")
