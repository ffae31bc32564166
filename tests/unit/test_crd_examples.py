"""Examples and bad custom resources against the generated CephaloJob schema: every example is
accepted by the schema (as the API server applies it) and by pydantic, the two agree on
defaults, and each bad CR is refused by the schema itself and by pydantic with a clear message."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cephalo.api import JobFileError, load_job, parse_job
from cephalo.api.job import TrainingSpec
from cephalo.planner.cost.catalog import lookup_gpu

from .crd_checks import apply_defaults, as_draft4, root_schema, schema_errors

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted_by_schema_and_models(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# "), f"{path.name}: start with a comment saying what it shows"
    # Cluster examples say how to apply them; local ones (a file on this machine) how to run.
    assert f"kubectl apply -f examples/{path.name}" in text or \
        f"cephalo run examples/{path.name}" in text, f"{path.name}: say how to run it"
    obj = yaml.safe_load(text)
    assert schema_errors(obj, strict=True) == []
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"]["name"])
    job = load_job(str(path))
    # The API server's defaults and pydantic's agree: defaulting changes nothing pydantic sees.
    defaulted = apply_defaults(copy.deepcopy(obj), root_schema())
    assert schema_errors(defaulted, strict=True) == []
    assert parse_job(defaulted).spec == job.spec


def test_examples_cover_the_brief() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"gpt-2.7b-cluster-a.yaml", "llama-7b-cluster-b.yaml", "vit-e-cluster-b.yaml",
            "custom-tiny-gpt.yaml", "token-file.yaml"} <= names
    cluster_a = load_job(str(ROOT / "examples" / "gpt-2.7b-cluster-a.yaml")).spec
    assert [p.product for p in cluster_a.gpu_pools or []] == [
        "NVIDIA-L4", "NVIDIA-RTX-A6000", "Tesla-P40", "Tesla-P100-PCIE-16GB"]
    assert sum(p.max_gpus or 0 for p in cluster_a.gpu_pools or []) == 8
    cluster_b = load_job(str(ROOT / "examples" / "llama-7b-cluster-b.yaml")).spec
    assert [(p.product, p.max_gpus) for p in cluster_b.gpu_pools or []] == [
        ("Tesla-V100-SXM2-16GB", 16), ("NVIDIA-A10G", 16), ("Tesla-T4", 32)]
    assert (cluster_a.global_batch_size, cluster_b.global_batch_size) == (256, 1024)


def test_example_gpu_pools_use_discovery_labels_the_planner_knows() -> None:
    for path in EXAMPLES:
        for pool in load_job(str(path)).spec.gpu_pools or []:
            assert pool.product is not None
            assert pool.product in lookup_gpu(pool.product).labels, (path.name, pool.product)


def test_defaults_fill_a_minimal_job_like_pydantic() -> None:
    minimal = {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
               "metadata": {"name": "m"}, "spec": {"model": {"preset": "gpt-tiny"},
                                                    "globalBatchSize": 8}}
    defaulted = apply_defaults(copy.deepcopy(minimal), root_schema())
    assert defaulted["spec"]["training"]["steps"] == TrainingSpec().steps
    assert defaulted["spec"]["data"] == {"synthetic": {}}
    assert defaulted["spec"]["planner"]["profileMicroBatchSizes"] == list(range(1, 9))
    assert schema_errors(defaulted, strict=True) == []
    assert parse_job(defaulted).spec == parse_job(minimal).spec


def test_every_default_satisfies_its_own_schema() -> None:
    """The API server refuses a CRD whose defaults do not validate or would be pruned."""
    found: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if "default" in node:
            found.append(path)
            sub = {k: v for k, v in node.items() if k != "default"}
            errors = list(jsonschema.Draft4Validator(as_draft4(sub, strict=True)).iter_errors(
                node["default"]))
            assert errors == [], f"{path}: default {node['default']!r}: {errors[0].message}"
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(root_schema(), "")
    assert ".spec.data" in found and ".spec.training.steps" in found


# ---- bad custom resources: refused by the schema and by pydantic --------------------------------
def _good() -> dict[str, Any]:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob", "metadata": {"name": "x"},
            "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8,
                     "data": {"synthetic": {}}, "planner": {"memoryFraction": 0.8}}}


def _set(path: str, value: Any) -> dict[str, Any]:
    obj = _good()
    *parents, leaf = path.split(".")
    node = obj
    for part in parents:
        node = node.setdefault(part, {})
    if value is _DELETE:
        del node[leaf]
    else:
        node[leaf] = value
    return obj


_DELETE = object()
_CUSTOM = {"family": "gpt", "numLayers": 2, "hiddenSize": 64, "numHeads": 4,
           "vocabSize": 256, "sequenceLength": 32}

# (case id, bad object, where the schema complains, what pydantic's message says)
BAD_CRS = [
    ("batch-zero", _set("spec.globalBatchSize", 0), "spec.globalBatchSize",
     "spec.globalBatchSize: Input should be greater than or equal to 1"),
    ("batch-negative", _set("spec.globalBatchSize", -1), "spec.globalBatchSize",
     "spec.globalBatchSize: Input should be greater than or equal to 1"),
    ("unknown-family", _set("spec.model", {**_CUSTOM, "family": "mamba"}), "spec.model.family",
     "spec.model.family: Input should be 'gpt', 'llama', 'vit' or 'bert'"),
    ("unknown-precision", _set("spec.precision", "fp8"), "spec.precision",
     "spec.precision: Input should be 'fp32', 'bf16', 'fp16' or 'auto'"),
    ("memory-fraction-above-1", _set("spec.planner.memoryFraction", 1.5),
     "spec.planner.memoryFraction", "spec.planner.memoryFraction: Input should be less than"),
    ("memory-fraction-zero", _set("spec.planner.memoryFraction", 0),
     "spec.planner.memoryFraction", "spec.planner.memoryFraction: Input should be greater than 0"),
    ("missing-model", _set("spec.model", _DELETE), "spec", "spec.model: Field required"),
    ("model-neither-preset-nor-family", _set("spec.model", {"numLayers": 2}), "spec.model",
     "model needs a `preset` or a `family`"),
    ("data-both", _set("spec.data", {"synthetic": {}, "tokenFile": {"path": "/d/t.bin"}}),
     "spec.data", "data needs exactly one of"),
    ("data-neither", _set("spec.data", {}), "spec.data", "data needs exactly one of"),
    ("token-file-without-path", _set("spec.data", {"tokenFile": {"dtype": "uint16"}}),
     "spec.data.tokenFile", "spec.data.tokenFile.path: Field required"),
    ("negative-backoff", _set("spec.backoffLimit", -1), "spec.backoffLimit",
     "spec.backoffLimit: Input should be greater than or equal to 0"),
    ("zero-layers", _set("spec.model", {**_CUSTOM, "numLayers": 0}), "spec.model.numLayers",
     "spec.model.numLayers: Input should be greater than or equal to 1"),
    ("zero-max-gpus", _set("spec.gpuPools", [{"product": "Tesla-T4", "maxGpus": 0}]),
     "spec.gpuPools.0.maxGpus", "spec.gpuPools.0.maxGpus: Input should be greater than or"),
    ("zero-steps", _set("spec.training.steps", 0), "spec.training.steps",
     "spec.training.steps: Input should be greater than or equal to 1"),
]


def test_good_base_object_is_accepted() -> None:
    assert schema_errors(_good()) == []
    parse_job(_good())


@pytest.mark.parametrize(("bad", "schema_path", "message"),
                         [c[1:] for c in BAD_CRS], ids=[c[0] for c in BAD_CRS])
def test_bad_cr_is_refused_by_schema_and_pydantic(bad: dict[str, Any], schema_path: str,
                                                  message: str) -> None:
    errors = schema_errors(bad)  # Kubernetes semantics: no extra strictness
    assert errors, "the API server would accept this"
    assert any(e.startswith(f"{schema_path}: ") for e in errors), errors
    with pytest.raises(JobFileError) as info:
        parse_job(bad, source="bad.yaml")
    assert str(info.value).startswith("bad.yaml: ")
    assert message in str(info.value)


def test_unknown_spec_field_is_pruned_by_kubernetes_but_refused_by_pydantic() -> None:
    bad = _set("spec.globalBatchSzie", 256)
    assert schema_errors(bad) == []  # the API server keeps quiet and prunes it
    assert any("globalBatchSzie" in e for e in schema_errors(bad, strict=True))
    with pytest.raises(JobFileError, match=r"spec\.globalBatchSzie: Extra inputs are not"):
        parse_job(bad)


def test_status_accepts_kopf_keys_but_checks_known_fields() -> None:
    job = _good()
    job["status"] = {"phase": "Running", "kopf": {"progress": {"create": {"retries": 0}}},
                     "plan": {"worldSize": 8, "pools": {"NVIDIA-L4": 2}},
                     "conditions": [{"type": "Planned", "status": "True"}]}
    assert schema_errors(job) == []
    job["status"]["phase"] = "Exploded"
    assert [e.split(":")[0] for e in schema_errors(job)] == ["status.phase"]
