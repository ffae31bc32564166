"""`cephalo export` does not trust meta.json (issue 26 items 8 and 9): a checkpoint whose
sizes and hashes match but whose recorded model, unit sizes, bounds or shard contents do not
fit is one clean line (exit 2), never a traceback or an assert, and writes nothing."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from cephalo.api.job import CephaloJobSpec
from cephalo.cli import main as cli_main
from cephalo.trainer.engine import Layout
from cephalo.trainer.run import train
from cephalo.trainer.spawn import spawn_ranks


def _train_worker(rank: int, world_size: int, ckpt: str) -> int:
    spec = CephaloJobSpec.model_validate({
        "model": {"preset": "gpt-tiny"}, "globalBatchSize": 4,
        "training": {"steps": 1, "learningRate": 1e-3}, "checkpoint": {"intervalSteps": 1}})
    return train(spec, Layout([2, 2], [2, 2], [0.5, 0.5]), Path(ckpt), verbose=False).last_step


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("export") / "ckpt"
    assert spawn_ranks(_train_worker, 2, str(root)) == [1, 1]
    return root / "step-00000001"


class _NotAShard:  # unpicklable under weights_only=True
    pass


def _meta(folder: Path) -> dict:
    return json.loads((folder / "meta.json").read_text())


def _rewrite(folder: Path, change: Callable[[dict], None]) -> None:
    meta = _meta(folder)
    change(meta)
    (folder / "meta.json").write_text(json.dumps(meta))


def _other_model(meta: dict) -> None:
    meta["model"]["num_layers"] += 1  # a valid config, but not the one whose units are here


def _unit_numels(meta: dict) -> None:
    meta["unit_numels"][0] += 8


def _bounds_gap(meta: dict) -> None:
    (s, e), (s2, e2) = meta["bounds"][1]
    meta["bounds"][1] = [[s, e - 4], [s2, e2]]


def _bounds_moved(meta: dict) -> None:  # covers the unit, but not where the shards hold it
    (s, e), (s2, e2) = meta["bounds"][1]
    meta["bounds"][1] = [[s, e + 4], [s2 + 4, e2]]


def _model_out_of_range(meta: dict) -> None:
    meta["model"]["num_heads"] = 10**9


def _shard_pickle(folder: Path) -> None:
    shard = folder / "rank-00001.pt"
    shard.write_bytes(pickle.dumps(_NotAShard()))
    data = shard.read_bytes()
    _rewrite(folder, lambda m: m["files"]["rank-00001.pt"].update(
        size_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))


CASES: list[tuple[Callable[[Path], None], str]] = [
    (lambda f: _rewrite(f, _other_model), "does not match its unit sizes"),
    (lambda f: _rewrite(f, _unit_numels), "unit_numels"),
    (lambda f: _rewrite(f, _bounds_gap), "bounds of unit 1"),
    (lambda f: _rewrite(f, _bounds_moved), "rank-00000.pt holds unit 1 at"),
    (lambda f: _rewrite(f, _model_out_of_range), "num_heads: Input should be less than"),
    (_shard_pickle, "rank-00001.pt is not a Cephalo checkpoint shard"),
]


@pytest.mark.parametrize(("tamper", "phrase"), CASES,
                         ids=["other_model", "unit_numels", "bounds_gap", "bounds_moved",
                              "model_out_of_range", "shard_pickle"])
def test_a_checkpoint_that_does_not_fit_its_meta_is_one_line(
        tmp_path, two_rank_checkpoint, capsys, tamper, phrase) -> None:
    folder = tmp_path / "step-00000001"
    shutil.copytree(two_rank_checkpoint, folder)
    tamper(folder)
    out = tmp_path / "out" / "model.pt"
    assert cli_main(["export", str(folder), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cephalo export: error: "), err
    assert phrase in err[0], err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("config_output", ["is-a-folder", "ckpt/config.json"])
def test_every_output_is_checked_before_any_is_written(tmp_path, two_rank_checkpoint,
                                                       capsys, config_output) -> None:
    """A --config-output that cannot be written is refused before model.pt is written (into
    a missing folder it wrote model.pt, then failed with a traceback and left it behind)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_rank_checkpoint, ckpt)
    (tmp_path / "is-a-folder").mkdir()
    before = sorted(tmp_path.rglob("*"))
    code = cli_main(["export", str(ckpt), "--output", str(tmp_path / "model.pt"),
                     "--config-output", str(tmp_path / config_output)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--config-output" in err[0], err
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(("fmt", "output", "config_output", "phrase"), [
    ("pt", "model.pt", "nodir/config.json", "--config-output nodir/config.json: nodir is a "
     "file, where a folder must be"),
    ("pt", "model.pt", "nodir/deeper/config.json", "--config-output nodir/deeper/config.json: "
     "nodir is a file, where a folder must be"),
    ("pt", "nodir/model.pt", None, "--output nodir/model.pt: nodir is a file, where a folder "
     "must be"),
    ("hf", "nodir/hf", None, "--output nodir/hf: nodir is a file, where a folder must be"),
    ("pt", "model.pt", "model.pt", "--config-output model.pt is --output too"),
    ("hf", "hf", "hf/config.json", "--config-output hf/config.json is the config.json "
     "--format hf writes"),
])
def test_a_file_where_a_folder_must_be_is_named_and_nothing_is_written(
        tmp_path, two_rank_checkpoint, capsys, monkeypatch, fmt, output, config_output,
        phrase) -> None:
    """Issue 39 item 7: a file `nodir` under --config-output nodir/config.json wrote model.pt,
    then failed with "File exists" (an OSError of mkdir) and left model.pt behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nodir").write_text("a file, not a folder\n")
    before = sorted(tmp_path.rglob("*"))
    args = ["export", str(two_rank_checkpoint), "--format", fmt, "--output", output]
    code = cli_main(args + (["--config-output", config_output] if config_output else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and phrase in err[0], err
    assert sorted(tmp_path.rglob("*")) == before


def test_both_outputs_go_into_new_folders(tmp_path, two_rank_checkpoint, capsys) -> None:
    model, config = tmp_path / "a" / "model.pt", tmp_path / "b" / "config.json"
    assert cli_main(["export", str(two_rank_checkpoint), "--output", str(model),
                     "--config-output", str(config)]) == 0, capsys.readouterr().err
    assert model.is_file() and json.loads(config.read_text())["family"] == "gpt"


def _word_tokenizer(folder: Path, vocab_size: int) -> Path:
    from tests.local.test_tokenize import build_wide

    folder.mkdir()
    build_wide(folder / "tokenizer.json", vocab_size)
    return folder


@pytest.mark.parametrize(("setup", "phrase"), [
    (lambda d: (d / "tok").mkdir(), "--tokenizer tok holds no tokenizer files"),
    (lambda d: _word_tokenizer(d / "tok", 600), "600 token ids, more than the model's "
     "vocabulary of 256"),
])
def test_an_unusable_tokenizer_is_refused(tmp_path, two_rank_checkpoint, capsys, monkeypatch,
                                          setup, phrase) -> None:
    """Issue 26 item 10: an empty --tokenizer folder exported and copied nothing; a
    600-token tokenizer went beside a 256-token model without a word."""
    monkeypatch.chdir(tmp_path)
    setup(tmp_path)
    code = cli_main(["export", str(two_rank_checkpoint), "--format", "hf", "--output", "hf",
                     "--tokenizer", "tok"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and phrase in err[0], err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(("fmt", "output"), [("hf", "hf"), ("pt", "model.pt")])
def test_an_existing_output_needs_force(tmp_path, two_rank_checkpoint, capsys, monkeypatch,
                                        fmt, output) -> None:
    """As `cephalo tokenize` does: an existing export is overwritten only with --force."""
    monkeypatch.chdir(tmp_path)
    args = ["export", str(two_rank_checkpoint), "--format", fmt, "--output", output]
    assert cli_main(args) == 0
    first = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert cli_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"cephalo export: error: --output {output} exists; pass --force to "
                   "overwrite it"], err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == first
    assert cli_main([*args, "--force"]) == 0
