"""`cephalo tokenize`: txt / jsonl / parquet (through Hugging Face `datasets`) / arrow into the
token file `data.tokenFile` reads, with tokenizers built here by the `tokenizers` library (no
download). The ids are checked against that library's own encoding of each document, EOS
between documents, uint16 vs uint32, workers, and one-line errors that leave nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cephalo.cli import main

datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

DOCS = ["The quick brown fox jumps over the lazy dog.",
        "Héllo wörld: UTF-8 text, with\nnewlines and\ttabs.",
        "A third document, a little longer than the others " * 3]


def build_bpe(folder: Path, config: dict | None = None) -> Path:
    """A byte-level BPE trained here on DOCS, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<pad>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(DOCS * 10, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def build_wide(path: Path, vocab_size: int = 70_000) -> Path:
    """A word-level tokenizer whose ids do not fit uint16."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"<unk>": vocab_size - 2,
                                                              "<|endoftext|>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def expected(tokenizer_json: Path, docs: list[str], eos: int) -> list[int]:
    """What the `tokenizers` library itself gives, EOS after every document."""
    tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
    out: list[int] = []
    for doc in docs:
        out += [*tok.encode(doc, add_special_tokens=False).ids, eos]
    return out


@pytest.fixture(autouse=True)
def _restore_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command sets USE_TORCH=0 for `datasets` when torch is not loaded; undo it."""
    monkeypatch.setenv("USE_TORCH", os.environ.get("USE_TORCH", "AUTO"))


def run(*args: str | Path) -> int:
    return main(["tokenize", *map(str, args)])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_bpe(tmp_path_factory.mktemp("tok"), {"eos_token": "</s>"})


def _read(path: Path) -> tuple[np.ndarray, dict]:
    meta = json.loads(path.with_name(path.name + ".json").read_text())
    return np.fromfile(path, dtype=meta["dtype"]), meta


def test_jsonl_with_a_tokenizer_folder(tmp_path: Path, bpe: Path, capsys) -> None:
    data = tmp_path / "docs.jsonl"
    rows = [{"text": DOCS[0], "id": 1}, {"text": ""}, {"text": None}, {"text": DOCS[1]},
            {"text": DOCS[2]}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert run(data, "--tokenizer", bpe, "--output", tmp_path / "out" / "train.bin") == 0
    ids, meta = _read(tmp_path / "out" / "train.bin")
    eos = tokenizers.Tokenizer.from_file(str(bpe / "tokenizer.json")).token_to_id("</s>")
    assert ids.dtype == np.uint16 and meta["eos_id"] == eos == 1
    assert ids.tolist() == expected(bpe / "tokenizer.json", DOCS, eos)
    assert meta["num_documents"] == 3 and meta["num_tokens"] == ids.size
    assert meta["vocab_size"] == 320
    assert "uint16" in capsys.readouterr().out


def test_txt_files_are_documents_and_parquet_and_arrow_match_jsonl(tmp_path: Path,
                                                                    bpe: Path) -> None:
    tok_json = bpe / "tokenizer.json"
    want = expected(tok_json, DOCS, 1)
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, doc in enumerate(DOCS):  # a folder of .txt files, read in sorted order
        (folder / f"doc-{i}.txt").write_text(doc)
    assert run(folder, "-t", bpe, "-o", tmp_path / "txt.bin") == 0
    assert _read(tmp_path / "txt.bin")[0].tolist() == want
    table = datasets.Dataset.from_dict({"body": DOCS, "n": [1, 2, 3]})
    table.to_parquet(str(tmp_path / "docs.parquet"))
    assert run(tmp_path / "docs.parquet", "-t", bpe, "-o", tmp_path / "pq.bin",
               "--field", "body") == 0
    assert _read(tmp_path / "pq.bin")[0].tolist() == want
    table.save_to_disk(str(tmp_path / "saved"))  # .arrow shards + state/info .json
    assert run(tmp_path / "saved", "-t", bpe, "-o", tmp_path / "arrow.bin",
               "--field", "body") == 0
    assert _read(tmp_path / "arrow.bin")[0].tolist() == want


def test_byte_level_matches_the_quickstart_script(tmp_path: Path, monkeypatch) -> None:
    import cephalo.corpus as corpus

    monkeypatch.setattr(corpus, "PIECE_CHARS", 16)  # a file is read in pieces at line ends
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("first file\n" + "".join(f"line {i}\n" for i in range(50)))
    b.write_text("zweite Datei: äöü")
    assert run(a, b, "-t", "byte-level", "-o", tmp_path / "bytes.bin") == 0
    ids, meta = _read(tmp_path / "bytes.bin")
    data = a.read_bytes() + b"\n" + b.read_bytes() + b"\n"  # newline byte after each file
    assert ids.tolist() == list(data) and meta["vocab_size"] == 256


def test_uint32_when_the_vocabulary_does_not_fit_uint16(tmp_path: Path) -> None:
    tok = build_wide(tmp_path / "wide.json")
    (tmp_path / "d.jsonl").write_text('{"text": "w69997 w1 w65536"}\n{"text": "w2"}\n')
    assert run(tmp_path / "d.jsonl", "-t", tok, "-o", tmp_path / "w.bin") == 0
    ids, meta = _read(tmp_path / "w.bin")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_000
    assert ids.dtype == np.uint32 and ids.tolist() == [69_997, 1, 65_536, 69_999, 2, 69_999]


@pytest.mark.slow
def test_workers_write_the_same_bytes(tmp_path: Path, bpe: Path, monkeypatch) -> None:
    import cephalo.corpus as corpus

    monkeypatch.setattr(corpus, "BATCH_PIECES", 7)  # many batches from a small input
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "quick", "brown", "fox", "lazy", "dog"]
    rows = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(300)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    assert run(tmp_path / "d.jsonl", "-t", bpe, "-o", tmp_path / "one.bin") == 0
    assert run(tmp_path / "d.jsonl", "-t", bpe, "-o", tmp_path / "three.bin", "-j", "3") == 0
    one = (tmp_path / "one.bin").read_bytes()
    assert one == (tmp_path / "three.bin").read_bytes()
    assert _read(tmp_path / "one.bin")[1]["num_documents"] == 300


@pytest.mark.parametrize("setup,args,message", [
    (None, ("missing.jsonl",), "no such file or folder"),
    ("{not json}\n", ("d.jsonl",), "d.jsonl line 1 is not JSON"),
    ('{"body": "x"}\n', ("d.jsonl",), "line 1 has no field 'text'"),
    ('{"text": 3}\n', ("d.jsonl",), "field 'text' holds int, not text"),
    ("\n\n", ("d.jsonl",), "holds no text"),
    ('{"text": "x"}\n', ("d.jsonl", "--eos-id", "5000"), "outside the vocabulary"),
    ('{"text": "x"}\n', ("d.jsonl", "--workers", "0"), "--workers 0"),
    ('{"text": "x"}\n', ("d.csv",), "cannot tell the format"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, bpe: Path, capsys, setup,
                                                  args, message) -> None:
    if setup is not None:
        (tmp_path / args[0]).write_text(setup)
    out = tmp_path / "new" / "train.bin"
    assert run(tmp_path / args[0], *args[1:], "-t", bpe, "-o", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "new").exists()


def test_tokenizer_problems(tmp_path: Path, capsys) -> None:
    (tmp_path / "d.txt").write_text("text")
    no_eos = build_bpe(tmp_path / "noeos")  # "</s>" is in the vocabulary: found by name
    assert run(tmp_path / "d.txt", "-t", no_eos, "-o", tmp_path / "a.bin") == 0
    wrong = build_bpe(tmp_path / "wrong", {"eos_token": {"content": "<|im_end|>"}})
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"model": 1}')
    for tok, message in ((tmp_path / "nope", "no such file"),
                         (tmp_path / "empty", "has no tokenizer.json"),
                         (tmp_path / "bad.json", "is not a tokenizers tokenizer.json"),
                         (wrong, "names eos_token '<|im_end|>'")):
        assert run(tmp_path / "d.txt", "-t", tok, "-o", tmp_path / "b.bin") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "b.bin").exists()
    assert run(tmp_path / "d.txt", "-t", "byte-level", "-o", tmp_path / "a.bin") == 2
    assert "exists; pass --force" in capsys.readouterr().err
