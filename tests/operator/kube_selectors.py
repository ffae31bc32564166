"""Label/field selectors, merge patches and errors as the kube-apiserver has them (emulator)."""

from __future__ import annotations

import base64
import copy
import json
import re
from typing import Any

import kmock

ObjKey = tuple[str, str, str | None, str]  # (group, plural, namespace, name) of a stored object


def api_error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    """An error the emulator answers with a Kubernetes Status body."""
    return kmock.KubernetesError(status=status, reason=reason, message=message,
                                 details={"causes": [{"message": message}]})


_SET_RE = re.compile(r"^\s*([^\s!=]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_terms(selector: str) -> list[str]:
    """Split on commas that are not inside a set `( … )`."""
    terms, depth, current = [], 0, ""
    for ch in selector:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            terms.append(current)
            current = ""
        else:
            current += ch
    terms.append(current)
    return [t.strip() for t in terms if t.strip()]


def match_labels(selector: str, labels: dict[str, str]) -> bool:
    """Equality (`a=b`, `a==b`, `a!=b`), set (`a in (x,y)`, `a notin (x)`), `a`, `!a`."""
    for term in _split_terms(selector):
        if m := _SET_RE.match(term):
            key, op, values = m[1], m[2], {v.strip() for v in m[3].split(",") if v.strip()}
            ok = labels.get(key) in values if op == "in" else labels.get(key) not in values
        elif "!=" in term:
            key, value = (s.strip() for s in term.split("!=", 1))
            ok = labels.get(key) != value
        elif "=" in term:
            key, value = (s.strip() for s in term.replace("==", "=").split("=", 1))
            ok = labels.get(key) == value
        elif term.startswith("!"):
            ok = term[1:].strip() not in labels
        elif re.fullmatch(r"[A-Za-z0-9./_-]+", term):
            ok = term in labels
        else:
            raise ValueError(f"unable to parse requirement {term!r} in labelSelector {selector!r}")
        if not ok:
            return False
    return True


def _field(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


def match_fields(selector: str, obj: dict[str, Any]) -> bool:
    """Field selectors: `metadata.name=x`, `status.phase!=Running`, `involvedObject.uid=…`."""
    for term in _split_terms(selector):
        if "!=" in term:
            path, value = term.split("!=", 1)
            if _field(obj, path.strip()) == value.strip():
                return False
        elif "=" in term:
            path, value = term.replace("==", "=").split("=", 1)
            if _field(obj, path.strip()) != value.strip():
                return False
        else:
            raise ValueError(f"field selector {term!r} needs = or !=")
    return True


def _merge_objects(target: Any, patch: dict, merge: Any) -> dict:
    """Object-level merge shared by both patch kinds: null deletes, keys merge by `merge`."""
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge(result.get(key), value)
    return result


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (null deletes, objects merge, everything else replaces)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    return _merge_objects(target, patch, merge_patch)


_MERGE_KEYS = ("name", "type", "containerPort", "mountPath", "ip")


def strategic_merge(target: Any, patch: Any) -> Any:
    """Strategic merge patch, simplified: lists of objects merge by their merge key
    (`name`, `type`, …) the way Kubernetes merges containers, env, volumes, conditions."""
    if isinstance(patch, list) and isinstance(target, list):
        key = next((k for k in _MERGE_KEYS if patch and all(isinstance(p, dict) and k in p
                                                            for p in patch + target)), None)
        if key is None:
            return copy.deepcopy(patch)
        merged = [copy.deepcopy(t) for t in target]
        for item in patch:
            idx = next((i for i, t in enumerate(merged) if t[key] == item[key]), None)
            if item.get("$patch") == "delete":
                if idx is not None:
                    merged.pop(idx)
            elif idx is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[idx] = strategic_merge(merged[idx], item)
        return merged
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    return _merge_objects(target, patch, strategic_merge)


def paginate(items: list[dict[str, Any]], limit: str | None, token: str | None
             ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A LIST page as the kube-apiserver serves one with `limit` and `continue`: objects in
    storage-key order (namespace, then name), at most `limit` of them, and, when more remain,
    an opaque `continue` token and `remainingItemCount` in the list's metadata. (The real
    server pages one consistent snapshot; this one continues from the last key over the
    current objects, which a client cannot tell apart from objects changed after its LIST.)"""
    items = sorted(items, key=lambda o: (o["metadata"].get("namespace") or "",
                                         o["metadata"]["name"]))
    if token:
        try:
            after = tuple(json.loads(base64.urlsafe_b64decode(token.encode())))
        except ValueError:
            raise api_error(400, "BadRequest", "continue key is not valid") from None
        items = [o for o in items if (o["metadata"].get("namespace") or "",
                                      o["metadata"]["name"]) > after]
    if not limit or int(limit) <= 0 or len(items) <= int(limit):
        return items, {}
    page = items[:int(limit)]
    last = page[-1]["metadata"]
    token = base64.urlsafe_b64encode(json.dumps(
        [last.get("namespace") or "", last["name"]]).encode()).decode()
    return page, {"continue": token, "remainingItemCount": len(items) - len(page)}
