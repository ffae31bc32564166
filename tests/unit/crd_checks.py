"""Test helpers for the CephaloJob CRD: a structural-schema checker, the schema as
jsonschema's Draft4Validator sees it, and Kubernetes-style defaulting."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

from cephalo.api.crd import crd_manifest

K8S_TYPES = {"object", "array", "string", "integer", "number", "boolean"}
JUNCTORS = ("allOf", "anyOf", "oneOf", "not")


def root_schema() -> dict[str, Any]:
    return crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# ---- a checker for Kubernetes' structural-schema rules ----------------------------------------
def structural_problems(node: Any, path: str = "", in_junctor: bool = False) -> list[str]:
    """Every rule of https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
    custom-resource-definitions/#specifying-a-structural-schema this schema could break."""
    if not isinstance(node, dict):
        return [f"{path}: schema node is {type(node).__name__}, not a mapping"]
    problems: list[str] = []
    for key in ("$ref", "$defs", "definitions", "title", "const", "prefixItems", "$schema"):
        if key in node:
            problems.append(f"{path}: {key} is not allowed in a CRD schema")
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    int_or_string = node.get("x-kubernetes-int-or-string") is True
    if in_junctor:
        for key in ("type", "description", "default", "additionalProperties", "nullable"):
            if key in node:
                problems.append(f"{path}: {key} inside a junctor is not structural")
    elif not preserve and not int_or_string and node.get("type") not in K8S_TYPES:
        problems.append(f"{path}: needs a type, has {node.get('type')!r}")
    if "properties" in node and "additionalProperties" in node:
        problems.append(f"{path}: properties and additionalProperties together")
    if node.get("additionalProperties") is False:
        problems.append(f"{path}: additionalProperties: false is forbidden")
    if node.get("uniqueItems") is True:
        problems.append(f"{path}: uniqueItems: true is forbidden")
    for key in ("exclusiveMinimum", "exclusiveMaximum"):
        if key in node and not isinstance(node[key], bool):
            problems.append(f"{path}: {key} must be a boolean flag in OpenAPI v3.0")
    if "default" in node and node["default"] is None:
        problems.append(f"{path}: default null")
    for name, child in node.get("properties", {}).items():
        problems += structural_problems(child, f"{path}.{name}", in_junctor)
    if isinstance(node.get("additionalProperties"), dict):
        problems += structural_problems(node["additionalProperties"], f"{path}{{}}", in_junctor)
    if "items" in node:
        problems += structural_problems(node["items"], f"{path}[]", in_junctor)
    for junctor in JUNCTORS:
        branches = node.get(junctor)
        if branches is None:
            continue
        for i, branch in enumerate([branches] if junctor == "not" else branches):
            where = f"{path}.{junctor}[{i}]"
            problems += structural_problems(branch, where, in_junctor=True)
            # Fields a junctor talks about must be specified outside it too.
            outside = node.get("properties", {})
            for name in [*branch.get("properties", {}), *branch.get("required", [])]:
                if name not in outside:
                    problems.append(f"{where}: {name!r} is not specified outside the junctor")
    return problems


# ---- the schema as the API server applies it ----------------------------------------------------
def as_draft4(node: Any, strict: bool) -> Any:
    """The CRD schema for jsonschema's Draft4Validator (OpenAPI v3.0 bounds are Draft 4's).

    `nullable: true` becomes a `["X", "null"]` type. With `strict`, objects with properties
    refuse unknown keys: the API server would silently prune them, which in an example is a
    typo worth failing on; without it, the validator accepts exactly what the server keeps.
    """
    if isinstance(node, list):
        return [as_draft4(v, strict) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: as_draft4(v, strict) if k != "default" and k != "enum" else v
           for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if "properties" in node:  # property names are data, not keywords
        out["properties"] = {k: as_draft4(v, strict) for k, v in node["properties"].items()}
    if out.pop("nullable", False):
        out["type"] = [out["type"], "null"]
    preserve = node.get("x-kubernetes-preserve-unknown-fields") is True
    if strict and "properties" in node and not preserve:
        out["additionalProperties"] = False
    return out


def validator(strict: bool = False) -> jsonschema.Draft4Validator:
    schema = as_draft4(root_schema(), strict)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def schema_errors(obj: dict[str, Any], strict: bool = False) -> list[str]:
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
                  for e in validator(strict).iter_errors(obj))


def apply_defaults(value: Any, node: dict[str, Any]) -> Any:
    """Kubernetes' structural defaulting: fill absent fields, then recurse into them."""
    if isinstance(value, dict):
        for name, prop in node.get("properties", {}).items():
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
        for name, child in value.items():
            if name in node.get("properties", {}):
                apply_defaults(child, node["properties"][name])
            elif isinstance(node.get("additionalProperties"), dict):
                apply_defaults(child, node["additionalProperties"])
    elif isinstance(value, list) and "items" in node:
        for item in value:
            apply_defaults(item, node["items"])
    return value


# ---- CEL rules (x-kubernetes-validations), evaluated by an independent CEL implementation -----
def _cel_program(rule: str) -> Any:
    import celpy  # cel-python: a CEL interpreter we did not write

    if rule not in _CEL_CACHE:
        env = celpy.Environment()
        _CEL_CACHE[rule] = env.program(env.compile(rule))
    return _CEL_CACHE[rule]


_CEL_CACHE: dict[str, Any] = {}


def cel_errors(value: Any, node: dict[str, Any] | None = None, path: str = "") -> list[str]:
    """Every x-kubernetes-validations rule that fails (or cannot be evaluated) on `value`,
    as the API server runs them: on each node whose value is present, after defaulting.
    Pass a defaulted object (`apply_defaults`) for the API server's view."""
    import celpy

    node = root_schema() if node is None else node
    found: list[str] = []
    for rule in node.get("x-kubernetes-validations", []):
        try:
            result = _cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(value)})
        except Exception as err:  # the API server reports an evaluation error as invalid
            found.append(f"{path or '(root)'}: {rule['message']} (error: {err})")
            continue
        if isinstance(result, Exception) or not bool(result):
            found.append(f"{path or '(root)'}: {rule['message']}")
    if isinstance(value, dict):
        for name, child in value.items():
            prop = node.get("properties", {}).get(name)
            if prop is not None and child is not None:
                found += cel_errors(child, prop, f"{path}.{name}".lstrip("."))
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            found += cel_errors(item, node["items"], f"{path}.{i}")
    return found


def prune_nulls(value: Any, node: dict[str, Any]) -> Any:
    """Kubernetes drops a null given for a field whose schema is not `nullable` (before
    defaulting, so the default then applies)."""
    if isinstance(value, dict):
        props = node.get("properties", {})
        for name in [n for n, v in value.items() if v is None and n in props
                     and not props[n].get("nullable")]:
            del value[name]
        for name, child in value.items():
            if name in props:
                prune_nulls(child, props[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            prune_nulls(item, node["items"])
    return value


def crd_verdict(obj: dict[str, Any]) -> list[str]:
    """What the API server says to `kubectl apply` of obj: nulls of non-nullable fields
    pruned, then schema errors, else the CEL rules on the defaulted object (the server
    defaults before it validates)."""
    obj = prune_nulls(copy.deepcopy(obj), root_schema())
    errors = schema_errors(obj)
    if errors:
        return errors
    return cel_errors(apply_defaults(copy.deepcopy(obj), root_schema()))
