"""`data.text` in the CephaloJob spec: exactly one data source, the CRD (schema + CEL, checked
by jsonschema and cel-python) and pydantic agree, and the operator mounts `claimName`
read-only in every rank pod like a token file's."""

from __future__ import annotations

import re
from typing import Any

import pytest

from cephalo.api import JobFileError, Plan, parse_job
from cephalo.operator.render import checkpoint_target, render
from tests.unit.crd_checks import crd_verdict

TEXT = {"path": "/data/corpus/", "claimName": "corpora"}


def _job(data: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "cephalo.dev/v1alpha1", "kind": "CephaloJob",
            "metadata": {"name": "text", "namespace": "ml", "uid": "u-1"},
            "spec": {"model": {"preset": "gpt-tiny"}, "globalBatchSize": 8, "data": data,
                     "checkpoint": {"claimName": "ckpt"}}}


def _pydantic_accepts(obj: dict[str, Any]) -> bool:
    try:
        parse_job(obj)
    except JobFileError:
        return False
    return True


@pytest.mark.parametrize("data,valid", [
    ({"text": {"path": "corpus.jsonl"}}, True),
    ({"text": {"uri": "s3://bucket/corpus/*.parquet", "tokenizer": "s3://bucket/tok/",
               "format": "parquet", "field": "content", "eosId": 2}}, True),
    ({"text": TEXT}, True),
    ({"text": {**TEXT, "mountPath": "/data/"}}, True),
    ({"text": {}}, False),
    ({"text": {"path": "a.txt", "uri": "s3://b/a.txt"}}, False),
    ({"text": {"uri": "/not/a/url"}}, False),
    ({"text": {"path": "a.txt", "format": "csv"}}, False),
    ({"text": {"uri": "s3://b/c/", "claimName": "corpora"}}, False),
    ({"text": {**TEXT, "path": "/etc/passwd"}}, False),
    ({"text": {**TEXT, "path": "/data/../etc"}}, False),
    ({"text": {**TEXT, "path": "/data/"}}, False),
    ({"text": {**TEXT, "mountPath": "data"}}, False),
    ({"text": {"path": "a.txt"}, "synthetic": {}}, False),
    ({"text": {"path": "a.txt"}, "tokenFile": {"path": "t.bin"}}, False),
])
def test_crd_and_pydantic_agree_on_text_data(data: dict[str, Any], valid: bool) -> None:
    obj = _job(data)
    crd = crd_verdict(obj)
    assert (crd == []) == valid, f"CRD verdict: {crd or 'accepted'}"
    assert _pydantic_accepts(obj) == valid


def test_pydantic_messages_say_what_to_fix() -> None:
    with pytest.raises(JobFileError, match=r"exactly one of path .* and uri"):
        parse_job(_job({"text": {}}))
    with pytest.raises(JobFileError, match="is not inside mountPath '/data'"):
        parse_job(_job({"text": {**TEXT, "path": "/srv/corpus"}}))
    with pytest.raises(JobFileError, match=re.escape("exactly one of `synthetic: {}`, `tokenFile")):
        parse_job(_job({"text": {"path": "a"}, "synthetic": {}}))


PLAN = Plan.model_validate({
    "global_batch_size": 8, "world_size": 2, "predicted_step_seconds": 0.5,
    "predicted_samples_per_second": 16.0,
    "ranks": [{"rank": r, "gpu": "L4", "pool": "NVIDIA-L4", "batch_size": 4,
               "micro_batch_size": 4, "num_micro_batches": 1, "shard_ratio": 0.5}
              for r in range(2)],
    "baselines": {}})


def test_text_claim_is_mounted_read_only_in_every_rank_pod() -> None:
    job = parse_job(_job({"text": {**TEXT, "mountPath": "/corpora", "path": "/corpora/en"}}))
    pods = [o for o in render(job, PLAN) if o["kind"] == "Pod"]
    assert len(pods) == 2
    for pod in pods:
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert volumes["dataset"]["persistentVolumeClaim"] == {"claimName": "corpora",
                                                               "readOnly": True}
        mounts = [m for c in pod["spec"]["containers"] for m in c.get("volumeMounts", [])]
        assert {"name": "dataset", "mountPath": "/corpora", "readOnly": True} in mounts
    clash = parse_job(_job({"text": {"path": "/tmp/corpus", "claimName": "c",
                                     "mountPath": "/tmp"}}))
    refusal = checkpoint_target(clash, 2).refusal or ""
    assert "spec.data.text.mountPath '/tmp' overlaps /tmp" in refusal
