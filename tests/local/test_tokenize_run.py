"""`cephalo run` on a tiny text dataset (jsonl + a tokenizer folder built here): the ranks
tokenize it once into the cache and train; what would fail only inside the ranks (a missing
dataset or tokenizer, a vocabulary larger than the model's) is one line, exit 2, no run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .cli_helpers import run_cephalo
from .test_tokenize import DOCS, build_bpe

JOB = """\
apiVersion: cephalo.dev/v1alpha1
kind: CephaloJob
metadata: {{name: text}}
spec:
  model: {{family: gpt, numLayers: 1, hiddenSize: 32, numHeads: 2, vocabSize: {vocab},
          sequenceLength: 16}}
  globalBatchSize: 4
  training: {{steps: 4, learningRate: 1.0e-2}}
  data:
    text: {{path: {path}, tokenizer: {tokenizer}}}
  planner: {{profileMicroBatchSizes: [1, 2]}}
  checkpoint: {{intervalSteps: 2}}
"""


def _setup(tmp_path: Path, vocab: int = 320, path: str = "corpus/",
           tokenizer: str = "tok") -> Path:
    build_bpe(tmp_path / "tok", {"eos_token": "</s>"})
    (tmp_path / "corpus").mkdir(exist_ok=True)
    (tmp_path / "corpus" / "a.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in DOCS * 4))
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(vocab=vocab, path=path, tokenizer=tokenizer))
    return job


@pytest.mark.slow
def test_run_tokenizes_once_and_trains(tmp_path: Path) -> None:
    job = _setup(tmp_path)
    # A given plan: the data path is tested, not the profiler (which reads synthetic data
    # and would add a process of its own; tests/local/test_run.py profiles).
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"global_batch_size": 4, "world_size": 1, "ranks": [
        {"rank": 0, "gpu": "cpu", "batch_size": 4, "micro_batch_size": 2,
         "num_micro_batches": 2, "shard_ratio": 1.0}]}))
    done = run_cephalo(tmp_path, "run", str(job), "--plan", str(plan), "--devices", "cpu:1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Profiling" not in done.stdout
    (run_dir,) = (tmp_path / "runs" / "text").iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    (cached,) = (tmp_path / ".cache" / "cephalo" / "tokens").glob("*.bin")
    meta = json.loads(cached.with_name(cached.name + ".json").read_text())
    assert meta["vocab_size"] == 320 and meta["num_documents"] == 4 * len(DOCS)
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("rank-*.log"))
    assert logs.count("cephalo trainer: tokenized") == 1


@pytest.mark.parametrize("setup,message", [
    ({"path": "missing/"}, "data.text: text data missing/: no such file or folder"),
    ({"tokenizer": "nope"}, "data.text: tokenizer nope: no such file"),
    ({"vocab": 256}, "tokenizer tok has 320 ids, more than model.vocabSize 256"),
])
def test_bad_text_data_is_refused_before_any_rank_starts(tmp_path: Path, setup: dict,
                                                         message: str) -> None:
    job = _setup(tmp_path, **setup)
    done = run_cephalo(tmp_path, "run", str(job), "--devices", "cpu:1")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "runs").exists()
