"""Check objects against a CRD's structural schema the way the API server would.

jsonschema catches wrong types, cel-python runs the CEL `x-kubernetes-validations` rules;
`pruned` lists the fields a real API server would silently
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
    """Schema errors, then (on a well-typed object) the CEL rules the API server runs."""
    validator = jsonschema.Draft7Validator(_nullable_to_jsonschema(schema))
    found = [f"{'.'.join(map(str, e.path)) or '(root)'}: {e.message}"
             for e in validator.iter_errors(obj)]
    return found or cel_errors(obj, schema)


def cel_errors(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """The x-kubernetes-validations rules that fail on obj, evaluated by cel-python (an
    independent CEL implementation) on every node where a value is present."""
    import celpy

    found: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        env = celpy.Environment()
        try:
            ok = env.program(env.compile(rule["rule"])).evaluate(
                {"self": celpy.json_to_cel(obj)})
        except Exception as err:  # an evaluation error makes the API server refuse too
            ok = err
        if isinstance(ok, Exception) or not bool(ok):
            found.append(f"{path or '(root)'}: {rule['message']}")
    if isinstance(obj, dict):
        for key, value in obj.items():
            child = schema.get("properties", {}).get(key)
            if child is not None and value is not None:
                found += cel_errors(value, child, f"{path}.{key}".lstrip("."))
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            found += cel_errors(item, schema["items"], f"{path}.{i}")
    return found


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
