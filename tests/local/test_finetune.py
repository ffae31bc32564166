"""examples/finetune-local.yaml end to end: a tiny Llama pre-trained here with `transformers`
(scripts/make_tiny_hf_model.py), fine-tuned by `cephalo run`, starts at the pre-trained
model's loss on the first batch (computed by transformers), far below ln(vocab), and the
run's checkpoint exports back to a folder transformers loads."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
import yaml

from cephalo.api.job import CephaloJobSpec
from cephalo.trainer.data import DataSource

from .cli_helpers import REPO, run_cephalo, run_cephalo_in_process

pytestmark = pytest.mark.slow


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_example_starts_from_the_pretrained_loss(tmp_path: Path) -> None:
    data = tmp_path / "data"
    tokens = _script("text_to_tokens")
    assert tokens.main([str(REPO / "docs" / "readme-walk.md"), "--output",
                        str(data / "pretrain.bin")]) == 0
    assert tokens.main([str(REPO / "docs" / "concepts" / "operator.md"), "--output",
                        str(data / "finetune.bin")]) == 0
    # 40 steps reach a loss of ~3.0 nats (100: ~2.8), far below the 0.8 ln(256) = 4.4 the
    # test needs to tell a pre-trained start from a random one; each step is ~90 ms.
    assert _script("make_tiny_hf_model").main([
        "--tokens", str(data / "pretrain.bin"), "--output", str(data / "tiny-llama"),
        "--steps", "40", "--batch-size", "8"]) == 0
    shutil.copy(REPO / "examples" / "finetune-local.yaml", tmp_path / "finetune-local.yaml")

    # A given uneven plan skips the profiler (speed); each rank loads only its shard.
    plan = {"global_batch_size": 16, "world_size": 2, "ranks": [
        {"rank": 0, "batch_size": 10, "micro_batch_size": 5, "num_micro_batches": 2,
         "shard_ratio": 0.6},
        {"rank": 1, "batch_size": 6, "micro_batch_size": 6, "num_micro_batches": 1,
         "shard_ratio": 0.4}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    done = run_cephalo(tmp_path, "run", "finetune-local.yaml", "--devices", "cpu:2",
                       "--plan", "plan.json", "--steps", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    (run_dir,) = (tmp_path / "runs" / "finetune-local").iterdir()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    pretrained = transformers.AutoModelForCausalLM.from_pretrained(data / "tiny-llama").eval()
    raw = yaml.safe_load((tmp_path / "finetune-local.yaml").read_text())["spec"]
    raw["model"]["pretrained"] = str(data / "tiny-llama")
    raw["data"]["tokenFile"]["path"] = str(data / "finetune.bin")
    spec = CephaloJobSpec.model_validate(raw)
    config = spec.model.resolve()
    batch = spec.global_batch_size
    (inputs, targets), = list(DataSource(config, spec.data, spec.training.seed)
                              .micro_batches(0, 0, batch, batch))
    with torch.no_grad():
        logits = pretrained(inputs).logits
    expected = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    assert expected < 0.8 * math.log(256)  # the pre-training worked
    assert abs(records[0]["loss"] - expected) <= 1e-4 * expected

    # The export in this process (which already holds torch and transformers): its process
    # is not what is tested, and one would import both again (~3 s of CPU).
    out = tmp_path / "exported"
    done = run_cephalo_in_process(tmp_path, "export", str(run_dir / "checkpoints"),
                                  "--format", "hf", "--output", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    transformers.AutoModelForCausalLM.from_pretrained(out)

