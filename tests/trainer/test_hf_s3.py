"""model.pretrained on object storage (a real S3 protocol server, moto, over HTTP): the
spec resolves from config.json read through fsspec, and the weights read from the URL give
transformers' logits."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: moto_s3

from moto_s3 import moto_server  # noqa: E402
from test_hf_parity import (  # noqa: E402
    RATIOS,
    SEQ,
    llama_config,
    load_cephalo,
    relative_error,
    save_random,
)

from cephalo.api.job import CephaloJobSpec  # noqa: E402

BUCKET = "models"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    with moto_server() as url:
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        client = boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                              aws_access_key_id="test", aws_secret_access_key="test")
        client.create_bucket(Bucket=BUCKET)
        yield client


def test_pretrained_from_object_storage(tmp_path: Path, s3) -> None:
    reference = save_random(llama_config(), tmp_path, shard_size="20KB")
    for path in tmp_path.iterdir():
        s3.upload_file(str(path), BUCKET, f"tiny/{path.name}")
    url = f"s3://{BUCKET}/tiny"
    spec = CephaloJobSpec.model_validate({"model": {"pretrained": url, "sequenceLength": SEQ},
                                          "globalBatchSize": 4})
    assert spec.model.resolve().num_kv_heads == 2
    ours = load_cephalo(url, RATIOS)
    tokens = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert relative_error(ours.logits(tokens), reference(tokens).logits) <= 1e-5
