"""The generated CephaloJob CRD: drift against crds/, Kubernetes validity, the structural-schema
rules, the translation of pydantic constructs, and the `cephalo crd` command."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from pydantic import BaseModel

from cephalo.api.crd import CrdSchemaError, crd_manifest, crd_yaml, openapi_schema
from cephalo.api.job import CephaloJobSpec
from cephalo.cli import main

from .crd_checks import root_schema, structural_problems

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "cephalojob.yaml"


def test_checker_catches_a_raw_pydantic_schema() -> None:
    """The checker can fail: pydantic's own output breaks several rules."""
    problems = structural_problems(CephaloJobSpec.model_json_schema(by_alias=True))
    joined = "\n".join(problems)
    assert "$ref" in joined and "$defs" in joined and "title" in joined
    assert "additionalProperties: false" in joined
    assert "needs a type" in joined  # anyOf [X, null] nodes have no type
    assert structural_problems({"type": "object", "anyOf": [{"type": "string"}]}) == [
        ".anyOf[0]: type inside a junctor is not structural"]


def test_schema_is_structural() -> None:
    schema = root_schema()
    assert structural_problems(schema) == []
    # metadata may not be restricted beyond name/generateName: we do not restrict it at all.
    assert schema["properties"]["metadata"] == {"type": "object"}


def test_status_keeps_unknown_fields_but_types_known_ones() -> None:
    status = root_schema()["properties"]["status"]
    assert status["x-kubernetes-preserve-unknown-fields"] is True
    assert status["properties"]["phase"]["type"] == "string"
    assert status["properties"]["plan"]["properties"]["worldSize"]["type"] == "integer"
    conditions = status["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["items"]["required"][:1] == ["type"]  # a list-map key must be required
    # No other node preserves unknown fields: the spec is pruned, pydantic rejects typos;
    # only the Kubernetes objects podTemplate passes through to pods are kept as given.
    kept: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if node.get("x-kubernetes-preserve-unknown-fields"):
            kept.append(path)
        for name, child in node.get("properties", {}).items():
            walk(child, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    walk(root_schema()["properties"]["spec"], "spec")
    assert sorted(kept) == [f"spec.podTemplate.{p}" for p in (
        "affinity", "env[].valueFrom", "volumes[]")]


def test_crd_is_a_valid_kubernetes_object() -> None:
    manifest = crd_manifest()
    for version in ("1.30", kubernetes_validate.latest_version()):
        assert kubernetes_validate.validate(manifest, version, strict=True)
    # Strict validation has teeth: an unknown JSONSchemaProps key is refused.
    broken = copy.deepcopy(manifest)
    broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "$defs"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


def test_crd_contract() -> None:
    crd = crd_manifest()
    assert crd["metadata"]["name"] == "cephalojobs.cephalo.dev"
    spec = crd["spec"]
    assert (spec["group"], spec["scope"]) == ("cephalo.dev", "Namespaced")
    assert spec["names"]["kind"] == "CephaloJob"
    assert spec["names"]["plural"] == "cephalojobs"
    assert spec["names"]["shortNames"] == ["cjob"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}


def _schema_at(json_path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = root_schema()
    for part in json_path.strip(".").split("."):
        node = (node or {}).get("properties", {}).get(part)
    return node


def test_printer_columns_point_at_typed_fields() -> None:
    columns = crd_manifest()["spec"]["versions"][0]["additionalPrinterColumns"]
    paths = [c["jsonPath"] for c in columns]
    assert paths == [".status.phase", ".status.plan.worldSize", ".spec.globalBatchSize",
                     ".status.plan.predictedSamplesPerSecond",
                     ".status.progress.samplesPerSecond", ".status.progress.step",
                     ".status.progress.percent", ".status.progress.estimatedEndTime",
                     ".metadata.creationTimestamp"]
    # Issue 46 item 4: the share done and the end, as Kubeflow Trainer's TrainJob shows them.
    # The end is a string column: kubectl prints a future `date` as "<invalid>".
    named = {c["name"]: c for c in columns}
    assert (named["Progress"]["type"], named["ETA"]["type"]) == ("integer", "string")
    for column in columns:
        if column["jsonPath"].startswith(".metadata."):
            assert column["type"] == "date"
            continue
        field = _schema_at(column["jsonPath"])
        assert field is not None, f"printer column {column['name']}: no field {column['jsonPath']}"
        assert field["type"] == column["type"], column


def test_every_spec_field_is_described_for_kubectl_explain() -> None:
    missing: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        for name, child in node.get("properties", {}).items():
            if not child.get("description"):
                missing.append(f"{path}.{name}")
            walk(child, f"{path}.{name}")
        if "items" in node:
            walk(node["items"], f"{path}[]")

    spec = root_schema()["properties"]["spec"]
    assert spec["description"]
    walk(spec, "spec")
    assert missing == []


def test_pydantic_bounds_translate_to_openapi_v3() -> None:
    spec = root_schema()["properties"]["spec"]["properties"]
    fraction = spec["planner"]["properties"]["memoryFraction"]
    assert (fraction["minimum"], fraction["exclusiveMinimum"], fraction["maximum"]) == (0, True, 1)
    assert "exclusiveMaximum" not in fraction  # le=1 is inclusive
    clip = spec["training"]["properties"]["gradientClipNorm"]
    assert clip["nullable"] is True and clip["default"] == 1.0 and clip["type"] == "number"
    pools = spec["gpuPools"]["items"]["properties"]["nodeSelector"]
    assert pools["additionalProperties"] == {"type": "string"} and "properties" not in pools
    assert spec["precision"]["enum"] == ["fp32", "bf16", "fp16", "auto"]
    assert spec["precision"]["default"] == "fp32"


def test_unsupported_pydantic_constructs_fail_loudly() -> None:
    class TwoTypes(BaseModel):
        value: int | str

    with pytest.raises(CrdSchemaError, match=r"x\.value: anyOf branch uses \['type'\]"):
        openapi_schema(TwoTypes, "x")

    class TwoTypesOrNull(BaseModel):
        value: int | str | None = None

    with pytest.raises(CrdSchemaError, match=r"x\.value: a union of 2 types"):
        openapi_schema(TwoTypesOrNull, "x")

    class Tuple(BaseModel):
        pair: tuple[int, int]

    with pytest.raises(CrdSchemaError, match="prefixItems"):
        openapi_schema(Tuple, "x")


# ---- drift and the command ---------------------------------------------------------------------
def test_committed_crd_matches_the_models() -> None:
    committed = CRD_FILE.read_text(encoding="utf-8")
    assert crd_yaml() == committed, (
        "crds/cephalojob.yaml is out of date with the pydantic models in cephalo.api.job; "
        "regenerate it with: cephalo crd > crds/cephalojob.yaml")


def test_cephalo_crd_prints_the_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["crd"]) == 0
    out, _ = capsys.readouterr()
    assert out == crd_yaml()
    assert yaml.safe_load(out) == crd_manifest()


def test_cephalo_crd_output_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "crd.yaml"
    assert main(["crd", "--output", str(target)]) == 0
    assert target.read_text(encoding="utf-8") == crd_yaml()
    assert capsys.readouterr().out == ""  # nothing but the file
    assert main(["crd", "--output", str(tmp_path / "missing" / "crd.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cephalo_crd_is_deterministic_and_torch_free() -> None:
    """A fresh interpreter with another hash seed prints the same bytes, importing no torch."""
    code = ("import sys; from cephalo.cli import main; rc = main(['crd']); "
            "bad = [m for m in ('torch', 'kubernetes', 'kopf') if m in sys.modules]; "
            "sys.exit(f'imported {bad}') if bad else sys.exit(rc)")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == CRD_FILE.read_text(encoding="utf-8")
