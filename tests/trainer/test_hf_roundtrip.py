"""Hugging Face -> Cephalo (uneven 3-rank plan, a few steps) -> Hugging Face: training starts
from the pretrained weights (first loss = transformers' loss on the same batch), a resume
keeps its checkpoint over the pretrained weights, and `cephalo export --format hf` writes a
checkpoint `transformers` loads with Cephalo's logits (single file and sharded), with the
tokenizer files of the model the job started from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from test_hf_parity import SEQ, gpt2_config, llama_config, relative_error, save_random
from tokenizers import Tokenizer, models, pre_tokenizers

from cephalo.api.hf_config import PretrainedError, to_hf_config
from cephalo.api.job import CephaloJobSpec
from cephalo.api.models import preset
from cephalo.cli import main as cli_main
from cephalo.trainer import checkpoint
from cephalo.trainer.data import DataSource
from cephalo.trainer.engine import Layout
from cephalo.trainer.models import build_model
from cephalo.trainer.spawn import spawn_ranks
from tests.rank_workers import train_job  # imports no transformers: ranks import it

pytestmark = pytest.mark.slow
UNEVEN = Layout([5, 2, 1], [1, 2, 1], [0.5, 0.3, 0.2])
BATCH = 8


def _job(pretrained: str, steps: int) -> CephaloJobSpec:
    return CephaloJobSpec.model_validate({
        "model": {"pretrained": pretrained, "sequenceLength": SEQ}, "globalBatchSize": BATCH,
        "training": {"steps": steps, "learningRate": 1e-3, "warmupSteps": 0},
        "checkpoint": {"intervalSteps": 2}})


def _write_tokenizer(folder: Path) -> None:
    vocab = {f"w{i}": i for i in range(95)} | {"[UNK]": 95}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"unk_token": "[UNK]"}))


def _first_batch_loss(model: torch.nn.Module, job: CephaloJobSpec, step: int = 0) -> float:
    data = DataSource(job.model.resolve(), job.data, job.training.seed)
    (inputs, targets), = list(data.micro_batches(step, 0, BATCH, BATCH))
    with torch.no_grad():
        logits = model(inputs).logits
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


def _export_and_compare(ckpt: Path, out: Path, *extra: str) -> transformers.PreTrainedModel:
    assert cli_main(["export", str(ckpt), "--format", "hf", "--output", str(out), *extra]) == 0
    info = checkpoint.find_latest(ckpt)
    assert info is not None
    ours = build_model(info.config)
    ours.load_state_dict(checkpoint.full_state_dict(info))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    tokens = torch.randint(0, 96, (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert relative_error(ours.logits(tokens), theirs(tokens).logits) <= 1e-5
    return theirs


def test_llama_round_trip_on_three_uneven_ranks(tmp_path: Path) -> None:
    source, ckpt = tmp_path / "hf-in", tmp_path / "ckpt"
    reference = save_random(llama_config(), source, shard_size="20KB")  # sharded input
    _write_tokenizer(source)
    first = spawn_ranks(train_job, 3, _job(str(source), 3), str(ckpt), UNEVEN, 2)  # to step 2
    # step 1's loss is the pretrained model's loss on step 1's batch (not ln(96) = 4.56)
    expected = _first_batch_loss(reference, _job(str(source), 3))
    assert abs(first[0]["losses"][0] - expected) <= 1e-5 * expected
    # the resume takes precedence over the pretrained weights: step 3 starts from step 2's
    # checkpoint, whose loss on step 3's batch differs from the pretrained model's
    resumed = spawn_ranks(train_job, 3, _job(str(source), 3), str(ckpt), UNEVEN)
    assert resumed[0]["first"] == 2
    assert abs(resumed[0]["losses"][0] - _first_batch_loss(reference, _job(str(source), 3),
                                                           step=2)) > 1e-3

    single, sharded = tmp_path / "hf-out", tmp_path / "hf-out-sharded"
    exported = _export_and_compare(ckpt, single)
    assert exported.config.num_key_value_heads == 2 and exported.config.model_type == "llama"
    assert (single / "model.safetensors").is_file()
    assert (single / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert (single / "tokenizer_config.json").is_file()
    _export_and_compare(ckpt, sharded, "--max-shard-size", "20KB")
    one_step = tmp_path / "hf-out-step"  # one step folder given directly finds them too
    assert cli_main(["export", str(ckpt / "step-00000003"), "--format", "hf", "--output",
                     str(one_step)]) == 0
    assert (one_step / "tokenizer.json").is_file()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_gpt2_round_trip_and_unexportable_family(tmp_path: Path, capsys) -> None:
    source, ckpt = tmp_path / "hf-in", tmp_path / "ckpt"
    reference = save_random(gpt2_config(), source)
    results = spawn_ranks(train_job, 1, _job(str(source), 2), str(ckpt),
                          Layout([BATCH], [4], [1.0]))
    expected = _first_batch_loss(reference, _job(str(source), 2))
    assert abs(results[0]["losses"][0] - expected) <= 1e-5 * expected
    exported = _export_and_compare(ckpt, tmp_path / "hf-out")
    assert exported.config.model_type == "gpt2" and exported.config.n_positions == SEQ

    (tmp_path / "a-file").write_text("")
    for args, message in ((["--max-shard-size", "lots"], "is not a size such as 5GB"),
                          (["--output", str(tmp_path / "a-file")], "is a file; --format hf")):
        argv = ["export", str(ckpt), "--format", "hf", "--output", str(tmp_path / "o"), *args]
        capsys.readouterr()  # drop transformers' progress bars above
        assert cli_main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    with pytest.raises(PretrainedError, match="a vit model has no Hugging Face export"):
        to_hf_config(preset("vit-tiny"))


def test_a_model_trained_from_scratch_takes_its_special_ids_from_the_exported_tokenizer(
        tmp_path: Path) -> None:
    """No pretrained config names bos/eos/pad: the tokenizer exported with the model does
    (`--tokenizer`), so `generate` stops at its eos. Tokens the tokenizer lacks stay null (a
    tokenizer with ids outside the model's vocabulary is refused: test_export_trust.py)."""
    ckpt, tok = tmp_path / "ckpt", tmp_path / "tok"
    job = CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-tiny"}, "globalBatchSize": 2, "training": {"steps": 1}})
    spawn_ranks(train_job, 1, job, str(ckpt), Layout([2], [2], [1.0]))
    tok.mkdir()
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "[UNK]": 3} | {f"w{i}": 4 + i for i in range(252)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>",
        "pad_token": "w999"}))  # not a token of this tokenizer
    out = tmp_path / "hf"
    assert cli_main(["export", str(ckpt), "--format", "hf", "--output", str(out),
                     "--tokenizer", str(tok)]) == 0
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, None)
    assert cli_main(["export", str(ckpt), "--format", "hf", "--output", str(tmp_path / "bare")
                     ]) == 0  # no tokenizer: nothing names them
    bare = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert (bare["bos_token_id"], bare["eos_token_id"], bare["pad_token_id"]) == (None,) * 3
