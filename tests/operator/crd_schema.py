"""Check objects against a CRD's structural schema the way the API server would.

jsonschema catches wrong types; `pruned` lists the fields a real API server would silently
drop (unknown to the schema and not under x-kubernetes-preserve-unknown-fields), which
jsonschema cannot see because OpenAPI schemas allow extra properties by default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "cephalojob.yaml"


def load_schema(path: Path = CRD_PATH) -> dict[str, Any]:
    crd = yaml.safe_load(path.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _nullable_to_jsonschema(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_nullable_to_jsonschema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _nullable_to_jsonschema(v) for k, v in schema.items() if k != "nullable"}
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if schema.get("nullable") and "enum" in out:
        out["enum"] = [*out["enum"], None]
    return out


def type_errors(obj: Any, schema: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft7Validator(_nullable_to_jsonschema(schema))
    return [f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}"
            for e in validator.iter_errors(obj)]


def pruned(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    if schema.get("x-kubernetes-preserve-unknown-fields") and "properties" not in schema:
        return []
    found: list[str] = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, value in obj.items():
            if props is not None and key in props:
                found += pruned(value, props[key], f"{path}.{key}")
            elif isinstance(extra, dict):
                found += pruned(value, extra, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{path}.{key}")
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += pruned(item, schema["items"], f"{path}[{i}]")
    return found
