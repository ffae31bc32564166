"""The base of every CephaloJob wire type (Kubernetes camelCase on the wire)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
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

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
