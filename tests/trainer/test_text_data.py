"""`data.text`: documents tokenized once (cached by content) and then sampled with exactly the
token-file contract, so every plan and world size sees the same global batches; inputs on a
real S3-compatible server (moto over HTTP, started here) tokenize to the same stream, and a
token file there reads like a local one."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from cephalo.api.job import DataSpec, TextData, TokenFileData
from cephalo.api.models import preset
from cephalo.corpus import CorpusError, check_remote_file, open_corpus
from cephalo.tokenfile import tokenize_corpus
from cephalo.tokenizer import byte_tokenizer
from cephalo.trainer import text_data
from cephalo.trainer.data import DataSource
from cephalo.trainer.spawn import spawn_ranks

CONFIG = preset("gpt-tiny")  # sequence length 32, vocabulary 256: byte-level ids fit
STEPS = 3


def _write_docs(folder: Path, count: int = 40) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    words = ["data", "token", "stream", "plan", "rank", "shard", "batch", "step", "seed"]
    with open(folder / "part-0.jsonl", "w") as f:
        for i in range(count):
            text = " ".join(rng.choice(words, size=int(rng.integers(3, 30))))
            f.write(json.dumps({"text": f"doc {i}: {text}"}) + "\n")
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(text_data.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_text_samples_exactly_like_the_token_file_it_becomes(tmp_path: Path, cache: Path
                                                               ) -> None:
    docs = _write_docs(tmp_path / "docs")
    text = DataSpec(text=TextData(path=str(docs)))
    source = DataSource(CONFIG, text, seed=7)
    ref = tmp_path / "ref.bin"
    tokenize_corpus(open_corpus(str(docs)), byte_tokenizer(), ref)
    file_source = DataSource(CONFIG, DataSpec(token_file=TokenFileData(path=str(ref))), seed=7)
    for step in range(STEPS):
        got, want = source.batch(step, 0, 6), file_source.batch(step, 0, 6)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    stream = np.fromfile(ref, dtype=np.uint16)
    assert (stream == 10).sum() >= 40  # a newline byte (EOS) after every document
    (cached,) = cache.glob("*.bin")
    assert cached.read_bytes() == ref.read_bytes()


def test_the_cache_is_reused_and_keyed_by_content(tmp_path: Path, cache: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    docs = _write_docs(tmp_path / "docs")
    spec = TextData(path=str(docs))
    first, _ = text_data.token_stream(spec)
    calls: list[Path] = []
    real = text_data.tokenize_corpus
    monkeypatch.setattr(text_data, "tokenize_corpus",
                        lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    assert text_data.token_stream(spec)[0] == first and calls == []  # a restart: reused
    with open(docs / "part-0.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    second, _ = text_data.token_stream(spec)
    assert second != first and calls == [second]
    assert text_data.token_stream(TextData(path=str(docs), eosId=0))[0] not in (first, second)


def _rank_batches(rank: int, world_size: int, docs: str, cache_root: str,
                  layout: list[tuple[int, int]]) -> list[list[torch.Tensor]]:
    # Each rank derives the stream on its own (own cache unless told to share one).
    os.environ[text_data.CACHE_ENV] = os.path.join(cache_root, f"rank-{rank}") \
        if cache_root.endswith("own") else cache_root
    source = DataSource(CONFIG, DataSpec(text=TextData(path=docs)), seed=11, verbose=False)
    start = sum(b for b, _ in layout[:rank])
    batch, micro = layout[rank]
    return [[mb[0] for mb in source.micro_batches(step, start, start + batch, micro)]
            for step in range(STEPS)]


@pytest.mark.slow
def test_every_plan_and_world_size_sees_the_same_global_batches(tmp_path: Path) -> None:
    docs = str(_write_docs(tmp_path / "docs", count=60))
    plans = {"one rank": [(8, 4)], "two uneven": [(5, 1), (3, 3)],
             "three, one idle": [(2, 2), (0, 1), (6, 3)]}
    global_batches = {}
    for i, (name, layout) in enumerate(plans.items()):
        # The three-rank plan shares one cache (ranks race for its lock); the others do not.
        cache_root = str(tmp_path / f"cache-{i}" / ("shared" if i == 2 else "own"))
        per_rank = spawn_ranks(_rank_batches, len(layout), docs, cache_root, layout)
        global_batches[name] = [torch.cat([mb for rank in per_rank for mb in rank[step]])
                                for step in range(STEPS)]
    reference = global_batches.pop("one rank")
    assert reference[0].shape == (8, 32)
    assert not torch.equal(reference[0], reference[1])
    for name, batches in global_batches.items():
        for step in range(STEPS):
            assert torch.equal(batches[step], reference[step]), (name, step)


def test_text_data_errors(tmp_path: Path, cache: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    docs = _write_docs(tmp_path / "docs")
    wide = tmp_path / "wide.json"  # 300 ids: more than gpt-tiny's vocabulary of 256
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(299)} | {"</s>": 299},
                                     unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(wide))
    with pytest.raises(ValueError, match=r"tokenizer of 300 ids, more than model.vocabSize 256"):
        DataSource(CONFIG, DataSpec(text=TextData(path=str(docs), tokenizer=str(wide))), 0)
    with pytest.raises(ValueError, match="text data needs a language model"):
        DataSource(preset("vit-tiny"), DataSpec(text=TextData(path=str(docs))), 0)
    with pytest.raises(CorpusError, match="no such file or folder"):
        DataSource(CONFIG, DataSpec(text=TextData(path=str(tmp_path / "none"))), 0)
    short = tmp_path / "short"
    short.mkdir()
    (short / "a.txt").write_text("too short")
    with pytest.raises(ValueError, match="a sample needs 33"):
        DataSource(CONFIG, DataSpec(text=TextData(path=str(short))), 0)


# --- object storage -----------------------------------------------------------------------

BUCKET = "corpora"


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    boto3 = pytest.importorskip("boto3")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from tests.moto_s3 import moto_server

    with moto_server() as url:
        env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
        boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                     aws_access_key_id="test", aws_secret_access_key="test"
                     ).create_bucket(Bucket=BUCKET)
        yield env


@pytest.mark.slow
def test_jsonl_and_parquet_from_object_storage(tmp_path: Path, cache: Path,
                                               s3: dict[str, str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets
    import s3fs

    for name, value in s3.items():
        monkeypatch.setenv(name, value)
    docs = _write_docs(tmp_path / "docs")
    rows = [json.loads(line) for line in (docs / "part-0.jsonl").read_text().splitlines()]
    datasets.Dataset.from_list(rows[:25]).to_parquet(str(tmp_path / "a.parquet"))
    datasets.Dataset.from_list(rows[25:]).to_parquet(str(tmp_path / "b.parquet"))
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.put(str(docs / "part-0.jsonl"), f"{BUCKET}/jsonl/part-0.jsonl")
    fs.put(str(tmp_path / "a.parquet"), f"{BUCKET}/pq/a.parquet")
    fs.put(str(tmp_path / "b.parquet"), f"{BUCKET}/pq/b.parquet")

    local = DataSource(CONFIG, DataSpec(text=TextData(path=str(docs))), seed=3)
    for uri in (f"s3://{BUCKET}/jsonl/", f"s3://{BUCKET}/pq/*.parquet"):
        remote = DataSource(CONFIG, DataSpec(text=TextData(uri=uri)), seed=3)
        assert np.array_equal(np.asarray(remote.tokens), np.asarray(local.tokens)), uri
        assert torch.equal(remote.batch(2, 0, 4)[0], local.batch(2, 0, 4)[0])
    with pytest.raises(CorpusError, match="no such file or folder"):
        DataSource(CONFIG, DataSpec(text=TextData(uri=f"s3://{BUCKET}/missing/")), 0)

    # A token file on object storage (with its sidecar): downloaded once, then the same
    # windows as the local file.
    ref = tmp_path / "ref.bin"
    tokenize_corpus(open_corpus(str(docs)), byte_tokenizer(), ref)
    fs.put(str(ref), f"{BUCKET}/tokens/train.bin")
    fs.put(str(tmp_path / "ref.bin.json"), f"{BUCKET}/tokens/train.bin.json")
    remote = DataSource(CONFIG, DataSpec(token_file=TokenFileData(
        path=f"s3://{BUCKET}/tokens/train.bin")), seed=3)
    assert torch.equal(remote.batch(1, 0, 4)[0], local.batch(1, 0, 4)[0])
    with pytest.raises(ValueError, match=r"s3://corpora/tokens/train.bin holds uint16 ids .* "
                                         r"data\.tokenFile\.dtype is uint32"):
        DataSource(CONFIG, DataSpec(token_file=TokenFileData(
            path=f"s3://{BUCKET}/tokens/train.bin", dtype="uint32")), seed=3)
    with pytest.raises(ValueError, match="does not exist"):
        DataSource(CONFIG, DataSpec(token_file=TokenFileData(path=f"s3://{BUCKET}/no.bin")), 0)
    # what `cephalo run` checks before any rank starts
    check_remote_file(f"s3://{BUCKET}/tokens/train.bin", "data.tokenFile.path")
    with pytest.raises(CorpusError, match=f"data.tokenFile.path s3://{BUCKET}/no.bin does not"):
        check_remote_file(f"s3://{BUCKET}/no.bin", "data.tokenFile.path")


def test_a_token_file_that_disagrees_with_its_sidecar_is_refused(tmp_path: Path) -> None:
    """`cephalo tokenize` records dtype and vocabulary: reading uint32 ids as uint16 (twice
    as many, garbage) or ids beyond vocabSize fails at once instead of training on it."""
    docs = _write_docs(tmp_path / "docs")
    out = tmp_path / "t.bin"
    tokenize_corpus(open_corpus(str(docs)), byte_tokenizer(), out)
    ok = DataSource(CONFIG, DataSpec(token_file=TokenFileData(path=str(out))), 0)
    assert ok.tokens is not None and ok.tokens.dtype == np.uint16
    with pytest.raises(ValueError, match=r"holds uint16 ids .* data\.tokenFile\.dtype is uint32"):
        DataSource(CONFIG, DataSpec(token_file=TokenFileData(path=str(out), dtype="uint32")), 0)
    meta = json.loads((tmp_path / "t.bin.json").read_text())
    (tmp_path / "t.bin.json").write_text(json.dumps({**meta, "vocab_size": 50_257}))
    with pytest.raises(ValueError, match=r"tokenizer of 50,257 ids, more than model\.vocabSize"):
        DataSource(CONFIG, DataSpec(token_file=TokenFileData(path=str(out))), 0)
