"""spec.checkpoint: one target at most (a shared PVC, object storage, or explicitly none),
each mistake one line that says what to do."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from cephalo.api.job import CheckpointSpec


@pytest.mark.parametrize("wire", [
    {}, {"claimName": "ckpt"}, {"uri": "s3://bucket/prefix"}, {"uri": "gs://b"},
    {"uri": "az://container/p/q", "intervalSteps": 20}, {"ephemeral": True},
])
def test_accepted(wire: dict) -> None:
    assert CheckpointSpec.model_validate(wire).to_wire() == {
        "ephemeral": False, "intervalSteps": 100, "keep": 2, **wire}


@pytest.mark.parametrize(("wire", "message"), [
    ({"claimName": "c", "uri": "s3://b/p"}, "give only one of claimName, uri and ephemeral: "
                                            "true (got claimName and uri)"),
    ({"uri": "s3://b/p", "ephemeral": True}, "(got uri and ephemeral: true)"),
    ({"claimName": "c", "ephemeral": True}, "(got claimName and ephemeral: true)"),
    ({"uri": "/mnt/checkpoints"}, "checkpoint.uri '/mnt/checkpoints' is not a URL such as "
                                  "s3://bucket/prefix; for a volume use checkpoint.claimName"),
    ({"uri": "s3:///no-bucket"}, "is not a URL"),
])
def test_rejected_with_one_line(wire: dict, message: str) -> None:
    with pytest.raises(ValidationError) as err:
        CheckpointSpec.model_validate(wire)
    assert message in str(err.value)
