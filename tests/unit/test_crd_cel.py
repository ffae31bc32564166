"""The CRD (OpenAPI schema + CEL `x-kubernetes-validations`, as the API server applies them)
and the pydantic models give the same verdict on every spec: what `kubectl apply` accepts,
the operator can run, and what pydantic refuses, `kubectl apply` refuses at once.

There is no API server here: the schema is checked by jsonschema (Draft 4, OpenAPI v3.0's
bounds) and the CEL rules by cel-python, an implementation we did not write. Unknown fields
are left out of the battery on purpose: the API server prunes them, pydantic refuses them
(test_crd_examples checks that difference)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from cephalo.api import JobFileError, parse_job
from cephalo.api.job import MAX_GLOBAL_BATCH_SIZE

from .crd_checks import cel_errors, crd_verdict, root_schema


def _job(spec: dict[str, Any] | None = None, name: str = "job",
         **fields: Any) -> dict[str, Any]:
    body = {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8}
    body.update(spec or {})
    body.update(fields)
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": name}, "spec": body}


def _model(**fields: Any) -> dict[str, Any]:
    return _job({"model": fields})


GPT = {"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4, "vocabSize": 256}
VIT = {"family": "vit", "numLayers": 2, "hiddenSize": 64, "numHeads": 4, "imageSize": 32,
       "patchSize": 8, "numClasses": 10}
LLAMA = {**GPT, "family": "llama", "numKvHeads": 2}
BERT = {**GPT, "family": "bert"}
TOKENS = {"path": "/data/train.bin", "claimName": "corpus"}

# (case id, object, whether it is valid)
BATTERY: list[tuple[str, dict[str, Any], bool]] = [
    ("preset", _job(), True),
    ("every-preset", _model(preset="vit-e"), True),
    ("unknown-preset", _model(preset="gpt-9000"), False),
    ("null-preset-and-no-family", _model(preset=None), False),
    ("custom-gpt", _model(**GPT), True),
    ("custom-gpt-no-vocab", _model(**{k: v for k, v in GPT.items() if k != "vocabSize"}),
     False),
    ("custom-gpt-heads-do-not-divide", _model(**{**GPT, "numHeads": 5}), False),
    ("custom-gpt-missing-layers", _model(**{k: v for k, v in GPT.items() if k != "numLayers"}),
     False),
    ("preset-override-heads-do-not-divide", _model(preset="gpt-tiny", numHeads=3), False),
    ("preset-override-heads-divide", _model(preset="gpt-tiny", numHeads=8), True),
    ("preset-override-family-needs-vocab", _model(preset="vit-tiny", family="gpt"), False),
    ("preset-override-family-vit-from-gpt", _model(preset="gpt-tiny", family="vit"), False),
    ("custom-vit", _model(**VIT), True),
    ("custom-vit-patch-does-not-divide", _model(**{**VIT, "patchSize": 7}), False),
    ("custom-vit-no-classes", _model(**{k: v for k, v in VIT.items() if k != "numClasses"}),
     False),
    ("custom-llama", _model(**LLAMA), True),
    ("custom-llama-kv-does-not-divide", _model(**{**LLAMA, "numKvHeads": 3}), False),
    ("custom-llama-odd-head-size", _model(**{**LLAMA, "hiddenSize": 60, "numHeads": 4,
                                             "numKvHeads": 4}), False),
    ("preset-llama-kv-override", _model(preset="llama-tiny", numKvHeads=3), False),
    ("gpt-ignores-kv-heads", _model(**{**GPT, "numKvHeads": 3}), True),
    ("custom-bert-default-classes", _model(**BERT), True),
    ("preset-vit-as-bert-has-classes", _model(preset="vit-tiny", family="bert", vocabSize=9),
     False),  # no sequenceLength: the vit preset has none, a preset gets no default
    ("layers-above-bound", _model(**{**GPT, "numLayers": 1025}), False),
    ("hidden-above-bound", _model(**{**GPT, "hiddenSize": 65_540, "numHeads": 4}), False),
    ("vocab-above-bound", _model(**{**GPT, "vocabSize": 4_194_305}), False),
    ("sequence-above-bound", _model(**{**GPT, "sequenceLength": 1_048_577}), False),
    ("batch-at-bound", _job(globalBatchSize=MAX_GLOBAL_BATCH_SIZE), True),
    ("batch-above-bound", _job(globalBatchSize=MAX_GLOBAL_BATCH_SIZE + 1), False),
    ("batch-1e9", _job(globalBatchSize=1_000_000_000), False),
    ("batch-string", _job(globalBatchSize="4"), False),
    ("batch-bool", _job(globalBatchSize=True), False),
    ("batch-null", _job(globalBatchSize=None), False),
    ("batch-float", _job(globalBatchSize=8.5), False),
    ("steps-string", _job(training={"steps": "10"}), False),
    ("steps-above-bound", _job(training={"steps": 100_000_001}), False),
    ("seed-above-numpy", _job(training={"seed": 2**32}), False),
    ("learning-rate-above-bound", _job(training={"learningRate": 100.0}), False),
    ("learning-rate-int", _job(training={"learningRate": 1}), True),
    ("clip-null-disables", _job(training={"gradientClipNorm": None}), True),
    # the API server prunes a null of a non-nullable field, then applies its default
    ("training-null", _job(training=None), True),
    ("suspend-string", _job(suspend="true"), False),
    ("suspend-int", _job(suspend=1), False),
    ("model-null", _job(model=None), False),
    ("profile-sizes-zero", _job(planner={"profileMicroBatchSizes": [0]}), False),
    ("profile-sizes-empty", _job(planner={"profileMicroBatchSizes": []}), False),
    ("profile-sizes-too-many", _job(planner={"profileMicroBatchSizes": list(range(1, 66))}),
     False),
    ("profile-sizes-too-big", _job(planner={"profileMicroBatchSizes": [4097]}), False),
    ("profile-sizes-ok", _job(planner={"profileMicroBatchSizes": [1, 2, 4, 4096]}), True),
    ("cost-objective", _job(planner={"objective": "cost",
                                     "gpuPricesPerHour": {"NVIDIA-L4": 0.8}}), True),
    ("cost-objective-with-floor", _job(planner={
        "objective": "cost", "gpuPricesPerHour": {"L4": 0.8, "T4": 0.35},
        "minSamplesPerSecond": 10, "deadlineSeconds": 3600}), True),
    # The operator's price list may supply them: refused at planning, not at apply.
    ("cost-objective-without-prices", _job(planner={"objective": "cost"}), True),
    ("unknown-objective", _job(planner={"objective": "cheapest"}), False),
    ("price-not-positive", _job(planner={"objective": "cost", "gpuPricesPerHour": {"L4": 0}}),
     False),
    ("prices-with-throughput", _job(planner={"gpuPricesPerHour": {"L4": 0.8}}), True),
    ("floor-without-cost", _job(planner={"minSamplesPerSecond": 10}), False),
    ("deadline-without-cost", _job(planner={"deadlineSeconds": 60}), False),
    ("min-gain-negative", _job(planner={"minGainToIdleGpus": -0.1}), False),
    ("min-gain-zero", _job(planner={"minGainToIdleGpus": 0}), True),
    ("pools-too-many", _job(gpuPools=[{"product": "Tesla-T4"}] * 65), False),
    ("pool-product-too-long", _job(gpuPools=[{"product": "T" * 64}]), False),
    ("pool-selector-too-many", _job(gpuPools=[{"nodeSelector": {
        f"k{i}": "v" for i in range(65)}}]), False),
    ("pool-max-gpus-string", _job(gpuPools=[{"maxGpus": "2"}]), False),
    ("backoff-above-bound", _job(backoffLimit=10_001), False),
    ("token-file-on-volume", _job(data={"tokenFile": TOKENS}), True),
    ("token-file-mount-with-slash", _job(data={"tokenFile": {**TOKENS, "mountPath": "/data/"}}),
     True),
    ("token-file-outside-volume", _job(data={"tokenFile": {**TOKENS, "path": "/etc/passwd"}}),
     False),
    ("token-file-escapes-volume", _job(data={"tokenFile": {
        **TOKENS, "path": "/data/../etc/passwd"}}), False),
    ("token-file-relative-mount", _job(data={"tokenFile": {
        **TOKENS, "mountPath": "data", "path": "data/x"}}), False),
    ("token-file-is-the-mount", _job(data={"tokenFile": {**TOKENS, "path": "/data/"}}), False),
    ("token-file-without-claim", _job(data={"tokenFile": {"path": "../x.bin"}}), True),
    ("token-file-empty-path", _job(data={"tokenFile": {"path": ""}}), False),
    # one checkpoint target, one source of the architecture (issue 39 item 3: the server
    # stored these, then the operator failed parsing them)
    ("checkpoint-claim-and-ephemeral", _job(checkpoint={"claimName": "c", "ephemeral": True}),
     False),
    ("checkpoint-claim-and-uri", _job(checkpoint={"claimName": "c", "uri": "s3://b/ck"}),
     False),
    ("checkpoint-uri-and-ephemeral", _job(checkpoint={"uri": "s3://b/ck", "ephemeral": True}),
     False),
    ("checkpoint-all-three", _job(checkpoint={"claimName": "c", "uri": "s3://b/ck",
                                              "ephemeral": True}), False),
    ("checkpoint-claim-not-ephemeral", _job(checkpoint={"claimName": "c", "ephemeral": False}),
     True),
    ("checkpoint-ephemeral", _job(checkpoint={"ephemeral": True}), True),
    ("checkpoint-uri", _job(checkpoint={"uri": "s3://b/ck", "keep": 3}), True),
    ("preset-and-pretrained", _model(preset="gpt-tiny", pretrained="gpt-1.3b"), False),
    ("name-47", _job(name="a" * 47), True),
    ("name-48", _job(name="a" * 48), False),
    ("name-digit-first", _job(name="2-gpt"), False),
    ("name-dots", _job(name="../x"), False),
    ("name-upper", _job(name="Gpt"), False),
]


def _pydantic_accepts(obj: dict[str, Any]) -> bool:
    try:
        parse_job(copy.deepcopy(obj))
    except JobFileError:
        return False
    return True


@pytest.mark.parametrize(("obj", "valid"), [c[1:] for c in BATTERY],
                         ids=[c[0] for c in BATTERY])
def test_crd_and_pydantic_agree(obj: dict[str, Any], valid: bool) -> None:
    crd = crd_verdict(obj)
    assert (crd == []) == valid, f"CRD (schema + CEL) verdict: {crd or 'accepted'}"
    assert _pydantic_accepts(obj) == valid


@pytest.mark.parametrize("case_id", ["checkpoint-claim-and-ephemeral", "preset-and-pretrained"])
def test_one_of_rules_say_what_pydantic_says(case_id: str) -> None:
    """`kubectl apply` refuses in pydantic's words (which go on to name what was given)."""
    obj = next(o for i, o, _ in BATTERY if i == case_id)
    [crd] = crd_verdict(obj)
    message = crd.split(": ", 1)[1]
    with pytest.raises(JobFileError) as err:
        parse_job(copy.deepcopy(obj))
    assert message in str(err.value)


def test_every_cel_rule_compiles_and_has_a_message() -> None:
    found = 0

    def walk(node: dict[str, Any]) -> None:
        nonlocal found
        for rule in node.get("x-kubernetes-validations", []):
            assert set(rule) == {"rule", "message"} and rule["message"]
            assert cel_errors({}, {"x-kubernetes-validations": [rule]}) is not None
            found += 1
        for child in node.get("properties", {}).values():
            walk(child)
        if "items" in node:
            walk(node["items"])

    walk(root_schema())
    assert found >= 11  # name, token file, checkpoint, eight model rules


def test_cel_rules_can_fail() -> None:
    """The evaluator is not vacuous: a rule that is false, or errors, is reported."""
    node = {"x-kubernetes-validations": [{"rule": "self.x > 1", "message": "x small"}]}
    assert cel_errors({"x": 2}, node) == []
    assert cel_errors({"x": 1}, node) == ["(root): x small"]
    assert cel_errors({}, node)[0].startswith("(root): x small (error:")


def test_operator_tests_schema_check_runs_the_committed_crds_cel_rules() -> None:
    """tests/operator/crd_schema.py (used by the operator tests on the committed CRD) refuses
    what only a CEL rule refuses."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "operator" / "crd_schema.py"
    spec = importlib.util.spec_from_file_location("operator_crd_schema", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    schema = module.load_schema()
    assert module.type_errors(_job(), schema) == []
    assert module.type_errors(_job(name="a" * 48), schema) == [
        "(root): " + root_schema()["x-kubernetes-validations"][0]["message"]]
    bad_heads = _model(**{**GPT, "numHeads": 5})
    assert module.type_errors(bad_heads, schema) == [
        "spec.model: hiddenSize must be divisible by numHeads"]


def test_model_config_has_the_specs_bounds() -> None:
    """A ModelConfig (also read back from checkpoints) is bounded exactly like the spec."""
    from cephalo.api.models import ModelConfig

    spec = root_schema()["properties"]["spec"]["properties"]["model"]["properties"]
    config = ModelConfig.model_json_schema(by_alias=False)["properties"]
    checked = []
    for snake, prop in config.items():
        camel = "".join(w.capitalize() if i else w for i, w in enumerate(snake.split("_")))
        if camel not in spec or "maximum" not in spec[camel]:
            continue
        bounds = prop.get("anyOf", [prop])[0]
        assert (bounds.get("minimum"), bounds.get("maximum")) == (
            spec[camel].get("minimum"), spec[camel]["maximum"]), snake
        checked.append(snake)
    assert len(checked) == 10, checked
