"""Pydantic-level behaviour of the CephaloJob API types: defaults, custom models, data on a
volume, status extras, and one clear message per mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from cephalo.api import CephaloJob, JobFileError, load_job, parse_job
from cephalo.api.job import CephaloJobSpec, CephaloJobStatus, TokenFileData

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def _job(**spec: object) -> dict:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": "t"},
            "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8, **spec}}


def test_minimal_job_gets_the_documented_defaults() -> None:
    spec = parse_job(_job()).spec
    assert spec.precision == "fp32"  # the paper's setting
    assert spec.planner.memory_fraction == 0.8
    assert spec.planner.profile_micro_batch_sizes == list(range(1, 9))
    assert spec.data.synthetic is not None and spec.data.token_file is None
    assert (spec.backoff_limit, spec.suspend, spec.gpu_pools) == (3, False, None)
    assert spec.training.gradient_clip_norm == 1.0


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_round_trips_through_the_wire_format(path: Path) -> None:
    job = load_job(str(path))
    again = parse_job(job.to_wire(), source="wire")
    assert again == job
    assert job.spec.model.resolve().total_parameters() > 0


def test_custom_model_fills_derived_dimensions() -> None:
    config = parse_job(_job(model={"family": "llama", "numLayers": 2, "hiddenSize": 64,
                                   "numHeads": 4, "vocabSize": 256})).spec.model.resolve()
    assert config.ffn_hidden_size == 4 * 64
    assert config.sequence_length == 512
    tiny = load_job(str(ROOT / "examples" / "custom-tiny-gpt.yaml")).spec.model
    assert tiny.preset is None
    assert tiny.resolve().ffn_hidden_size == 256 and tiny.resolve().sequence_length == 32


def test_fields_next_to_a_preset_override_it() -> None:
    token = load_job(str(ROOT / "examples" / "token-file.yaml")).spec
    config = token.model.resolve()
    assert (config.num_layers, config.sequence_length) == (24, 1024)


@pytest.mark.parametrize(("model", "message"), [
    ({"preset": "gpt-3"}, "unknown model preset 'gpt-3'; known presets: bert-large"),
    ({"family": "gpt"}, "custom model is missing numLayers, hiddenSize, numHeads"),
    ({"family": "gpt", "numLayers": 2, "hiddenSize": 65, "numHeads": 4, "vocabSize": 9},
     "hiddenSize 65 is not divisible by numHeads 4"),
    ({"family": "vit", "numLayers": 2, "hiddenSize": 64, "numHeads": 4},
     "a vit model needs imageSize, patchSize and numClasses"),
])
def test_bad_model_has_one_clear_message(model: dict, message: str) -> None:
    with pytest.raises(JobFileError, match=r"^job\.yaml: ") as info:
        parse_job(_job(model=model), source="job.yaml")
    assert message in str(info.value)


def test_unknown_field_names_the_field() -> None:
    with pytest.raises(JobFileError) as info:
        parse_job(_job(training={"stpes": 10}), source="j.yaml")
    assert str(info.value) == "j.yaml: spec.training.stpes: Extra inputs are not permitted"


def test_token_file_must_live_on_its_volume() -> None:
    assert TokenFileData(path="/data/a/train.bin", claimName="ds").mount_path == "/data"
    assert TokenFileData(path="relative.bin").claim_name is None  # no volume: any path
    for bad in ({"path": "/other/train.bin", "claimName": "ds"},
                {"path": "/data/../etc/train.bin", "claimName": "ds"},
                {"path": "/data/train.bin", "claimName": "ds", "mountPath": "data"}):
        with pytest.raises(JobFileError, match="is not inside mountPath"):
            parse_job(_job(data={"tokenFile": bad}))


def test_wrong_kind_or_version_is_refused() -> None:
    with pytest.raises(JobFileError, match=r"expected apiVersion cephalo\.dev/v1alpha1 kind"):
        parse_job({**_job(), "kind": "Job"})
    with pytest.raises(JobFileError, match="expected apiVersion"):
        parse_job({**_job(), "apiVersion": "cephalo.dev/v1"})


def test_status_keeps_kopf_bookkeeping() -> None:
    status = CephaloJobStatus.model_validate(
        {"phase": "Running", "kopf": {"progress": {}}, "plan": {"worldSize": 4}})
    wire = status.to_wire()
    assert wire["kopf"] == {"progress": {}} and wire["plan"] == {"worldSize": 4}
    with pytest.raises(ValueError, match="phase"):
        CephaloJobStatus.model_validate({"phase": "Exploded"})


def test_snake_case_names_work_in_python() -> None:
    spec = CephaloJobSpec(model={"preset": "gpt-tiny"}, global_batch_size=4)
    assert spec.to_wire()["globalBatchSize"] == 4
    assert CephaloJob(spec=spec).to_wire()["apiVersion"] == "cephalo.dev/v1alpha1"


def test_load_job_file_errors(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match="no such file"):
        load_job(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n", encoding="utf-8")
    with pytest.raises(JobFileError, match="not valid YAML"):
        load_job(str(broken))
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n", encoding="utf-8")
    with pytest.raises(JobFileError, match="expected a CephaloJob mapping, got list"):
        load_job(str(listing))
