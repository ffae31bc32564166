"""Write verbs of the API emulator: patch (merge, JSON, strategic), PUT.

A mixin of `kube_emulator.ApiEmulator`, split out to keep modules small (DELETE is in
`kube_faults.py`, with graceful deletion and garbage collection); it relies on the
emulator's store primitives (`_key`, `_get`, `_info`, `_bump`, `_publish`, `_remove`, `_delete`).
"""

from __future__ import annotations

import copy
from typing import Any

import jsonpatch
from kmock._internal import rendering
from kube_selectors import ObjKey, merge_patch, strategic_merge
from kube_selectors import api_error as _error


class WriteVerbs:
    __slots__ = ()  # a mixin of an attrs-slotted class

    async def _serve_update(self, request: rendering.Request) -> dict[str, Any]:
        key = self._key(request)
        old = self._get(key)
        ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
        body = request.data
        try:
            if ctype == "application/json-patch+json":
                new = jsonpatch.apply_patch(old, body)
            elif ctype == "application/strategic-merge-patch+json":
                new = strategic_merge(old, body)
            elif ctype in ("application/merge-patch+json", "application/json"):
                new = merge_patch(old, body)
            else:
                raise _error(415, "UnsupportedMediaType", f"unsupported patch type {ctype!r}")
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
            raise _error(422, "Invalid", f"JSON patch failed: {err}") from None
        if isinstance(body, dict):
            self._check_version(old, body)
        return self._commit(request, key, old, new)

    async def _serve_put(self, request: rendering.Request) -> dict[str, Any]:
        key = self._key(request)
        old = self._get(key)
        if not isinstance(request.data, dict):
            raise _error(400, "BadRequest", "PUT needs a JSON object body")
        self._check_version(old, request.data)
        return self._commit(request, key, old, copy.deepcopy(request.data))

    @staticmethod
    def _check_version(old: dict[str, Any], body: dict[str, Any]) -> None:
        wanted = (body.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != old["metadata"]["resourceVersion"]:
            raise _error(409, "Conflict", "the object has been modified; please apply your "
                         "changes to the latest version and try again")

    def _commit(self, request: rendering.Request, key: ObjKey, old: dict[str, Any],
                new: dict[str, Any]) -> dict[str, Any]:
        info = self._info(request)
        if request.subresource == "status":
            new = {**copy.deepcopy(old), "status": new.get("status")}
        elif request.subresource:
            raise _error(404, "NotFound", f"subresource {request.subresource!r} is not emulated")
        elif "status" in info.subresources:
            new["status"] = copy.deepcopy(old.get("status"))
        if new.get("status") is None:
            new.pop("status", None)
        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "name", "namespace", "deletionTimestamp",
                      "generation", "resourceVersion"):
            if field in old["metadata"]:
                meta[field] = old["metadata"][field]
            else:
                meta.pop(field, None)
        spec_changed = any(new.get(k) != old.get(k) for k in set(new) | set(old)
                           if k not in ("metadata", "status"))
        if spec_changed:
            meta["generation"] = old["metadata"].get("generation", 1) + 1
        if new == old:
            return copy.deepcopy(old)  # no-op writes keep the resourceVersion, like the real one
        self._bump(new)
        self._store[key] = new
        self._publish(key, "MODIFIED", new)
        left = meta.get("finalizers") or []
        if (meta.get("deletionTimestamp") and old["metadata"].get("finalizers") != left
                and left in ([], ["orphan"])):  # the last finalizer went: now it goes (the
            self._remove(key, orphan=left == ["orphan"])  # GC handles `orphan` itself)
        return copy.deepcopy(new)
