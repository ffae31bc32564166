"""The base of every CephaloJob wire type (Kubernetes camelCase on the wire)."""

from __future__ import annotations

import functools
import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic.alias_generators import to_camel


class CamelModel(BaseModel):
    """Base for every wire type: camelCase aliases, snake_case attributes, no unknown keys."""

    # strict: "4" and true are not integers, 1 is not a boolean (the API server's view of
    # the CRD schema, so that kubectl and pydantic give the same verdict); no inf/NaN, which
    # JSON and so a custom resource cannot carry either.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=False,
        strict=True, allow_inf_nan=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _nulls_as_absent(cls, data: Any) -> Any:
        # The API server prunes a null given for a field its CRD schema does not mark
        # `nullable` (then applies the field's default), so `family: null` means "not given"
        # to kubectl. Only a field whose null differs from its default is nullable in the
        # CRD (cephalo.api.crd): there null stays null, everywhere else it is dropped here.
        if isinstance(data, dict) and any(v is None for v in data.values()):
            keep = nullable_keys(cls)
            data = {k: v for k, v in data.items()
                    if v is not None or k in keep or k not in wire_keys(cls)}
        return data

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class StatusModel(CamelModel):
    """Base of the status types: written by the operator, not the user, so as lax as before
    (a measured loss may be NaN; an older operator may have written a float step)."""

    model_config = ConfigDict(strict=False, allow_inf_nan=True)


def _allows_none(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return type(None) in typing.get_args(annotation)
    return annotation is None or annotation is type(None)


def field_is_nullable(model: type[BaseModel], name: str) -> bool:
    """Null is a value of its own (not "absent"): the field takes None and defaults to
    something else (`gradientClipNorm: null` turns clipping off; absent means 1.0)."""
    info = model.model_fields[name]
    return (_allows_none(info.annotation) and not info.is_required()
            and info.default_factory is None and info.default is not None)


@functools.cache
def wire_keys(model: type[BaseModel]) -> frozenset[str]:
    """Every key a field answers to (alias and attribute name)."""
    return frozenset(k for n, f in model.model_fields.items() for k in (n, f.alias or n))


@functools.cache
def nullable_keys(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(k for n, f in model.model_fields.items() if field_is_nullable(model, n)
                     for k in (n, f.alias or n))
