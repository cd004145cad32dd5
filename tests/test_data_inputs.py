"""Data inputs the readers must not misread: HF held-out splits, text files, empty, null and
undecodable rows, held-out data that is the training data, and zarr arrays of every kind."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
from omegaconf import OmegaConf
from zarr_arrays import new_array

from fot.data.hf import hydra_string, train_py_loader_hint
from fot.data.loaders import build_sources, check_data_paths, open_token_path
from fot.data.streams import EOT_ID, HFSource, PackedSource, ZarrRowsSource, iterate_eval_batches
from fot.errors import error_line
from fot.tokenizer import get_encoding
from fot.training.config import DataConfig


def _cfg(**kw):
    return OmegaConf.structured(DataConfig(**kw))


def _jsonl(path, rows: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _packed(texts: list[str], seq_len: int) -> PackedSource:
    """The oracle: the non-empty texts, GPT-2 tokenized, packed with a BOS each."""
    enc = get_encoding()
    docs = [np.array(enc.encode_ordinary(t), np.uint16) for t in texts if t]
    return PackedSource.from_documents(docs, seq_len)


def _data_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fot.data"]


# ------------------------------------------------------------------ data=hf held-out split


def test_hf_validation_split_is_read_once_never_wrapped(tmp_path, caplog) -> None:
    """A held-out split smaller than data.val_tokens used to be read again and again (about
    97 times for the reviewer's 21-token split): its sequences are now counted when the
    sources are built, and validation reads each at most once, with the same warning as a
    small held-out token folder."""
    from fot.training.trainer import validation_sequences

    T = 8
    val_texts = [f"held-out document {i}: " + "more words " * i for i in range(5)]
    files = {
        "train": _jsonl(
            tmp_path / "train.jsonl",
            [{"text": f"training doc {i}" + " word" * 9} for i in range(9)],
        ),
        "validation": _jsonl(tmp_path / "val.jsonl", [{"text": t} for t in val_texts]),
    }
    oracle = _packed(val_texts, T)
    held = (oracle.length - 1) // T  # sequences with every label inside the split
    cfg = _cfg(kind="hf", path="json", seq_len=T, val_tokens=T * (held + 50))
    cfg.hf_data_files = files
    cfg.hf_val_split = "validation"
    _, val = build_sources(cfg)
    assert val.num_sequences == held
    with caplog.at_level(logging.WARNING):
        num = validation_sequences(cfg, val, unit=1, warn=True)
    assert num == held
    assert any(f"holds only {held} sequences" in r.getMessage() for r in caplog.records)
    for _ in range(2):  # every validation reads the same sequences, from the start
        batches = list(iterate_eval_batches(val, num_sequences=num, micro_batch_size=3))
        got = np.concatenate([b.input_ids.numpy().reshape(-1, T) for b in batches])
        labels = np.concatenate([b.labels.numpy().reshape(-1, T) for b in batches])
        want = oracle.read(0, held)
        np.testing.assert_array_equal(got, want[0])
        np.testing.assert_array_equal(labels, want[1])
        assert val.docs_per_epoch is None  # the end of the split was never passed
    # a split shorter than one sequence is refused, as a short held-out token folder is
    cfg.seq_len = oracle.length
    with pytest.raises(ValueError, match=r"split 'validation': the split holds \d+ tokens"):
        build_sources(cfg)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("packing", "varlength", r"data.packing='varlength' is not one of \['varlen', 'causal', "
         r"'padded'\]; did you mean 'varlen'\?$"),
        ("kind", "tokns", r"data.kind='tokns' is not one of \[.*\]; did you mean 'tokens'\?$"),
        ("packing", "zip", r"data.packing='zip' is not one of \['varlen', 'causal', 'padded'\]$"),
    ],
)  # fmt: skip
def test_a_data_setting_outside_its_choices_names_the_closest(field, value, message) -> None:
    """A typo in data.packing or data.kind gets the closest choice (none where none is close),
    as a typo in a config key does."""
    cfg = _cfg(kind="sample")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=message):
        build_sources(cfg)


def test_hf_validation_split_counted_far_enough_for_a_large_micro_batch(tmp_path, caplog) -> None:
    """A held-out split was counted only 64 sequences per process past data.val_tokens: with a
    validation micro batch of 100 the trainer saw "holds only 65 sequences" for a split of
    300 and warned that validation counts some twice. Counted to the validation unit now."""
    from fot.training.trainer import validation_sequences

    T = 4
    texts = ["abc def ghi jkl mno"] * 300  # > 300 sequences of 4 tokens
    cfg = _cfg(kind="hf", path="json", seq_len=T, val_tokens=T)
    cfg.hf_data_files = {
        "train": _jsonl(tmp_path / "train.jsonl", [{"text": "training text " * 4}] * 4),
        "validation": _jsonl(tmp_path / "val.jsonl", [{"text": t} for t in texts]),
    }
    cfg.hf_val_split = "validation"
    _, val = build_sources(cfg, val_unit=100)
    with caplog.at_level(logging.WARNING):
        assert validation_sequences(cfg, val, unit=100, warn=True) == 100
    assert not [r.getMessage() for r in caplog.records if "held-out" in r.getMessage()]


def test_hf_counting_stops_at_its_limit() -> None:
    """Counting a large held-out split reads only as far as validation could need."""
    seen = []

    def rows():
        for i in range(1000):
            seen.append(i)
            yield {"text": "abcd"}  # 4 tokens + BOS = 5 stream tokens per row

    src = HFSource(rows, lambda s: [ord(c) for c in s], 4)
    assert src.count_sequences(10) == 10
    assert len(seen) == 9  # 9 rows: 45 stream tokens, (45 - 1) // 4 = 11 >= 10
    seen.clear()
    assert src.count_sequences(10_000) == (5 * 1000 - 1) // 4
    assert len(seen) == 1000


# ------------------------------------------------------------------ data=hf documents


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_text_files_are_one_document_each(tmp_path, streaming: bool) -> None:
    """A folder of .txt files (or data.path=text) used to make every line a document, newlines
    dropped and a blank line an empty BOS-only document."""
    folder = tmp_path / "ml"
    folder.mkdir()
    a = "Line one of file A.\n\nLine three of file A.\n"
    b = "File B first line.\nFile B second line.\n"
    (folder / "a.txt").write_text(a)
    (folder / "b.txt").write_text(b)
    (folder / "c.txt").write_text("")  # an empty document: skipped
    T = 8
    oracle = _packed([a, b], T)
    n = oracle.num_sequences + 2  # into the second epoch
    want = oracle.read(0, n)
    for kw in ({"path": str(folder)}, {"path": "text", "hf_data_files": str(folder / "*.txt")}):
        cfg = _cfg(kind="hf", seq_len=T, val_tokens=0, streaming=streaming, **kw)
        train, _ = build_sources(cfg)
        inputs, labels = train.read(0, n)
        np.testing.assert_array_equal(inputs, want[0])
        np.testing.assert_array_equal(labels, want[1])
        text = get_encoding().decode([int(t) for t in inputs.reshape(-1)])
        assert text.startswith(f"<|endoftext|>{a}<|endoftext|>{b}<|endoftext|>")


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_text_files_drop_a_byte_order_mark_as_prepare_does(tmp_path, streaming: bool) -> None:
    """A UTF-8 file that starts with a byte-order mark (Windows editors write one): prepare
    drops it, but data=hf and prepare --hf kept it as the text U+FEFF (three byte tokens in
    front of the document). Oracle: tiktoken's ids of the text without it, as prepare reads it."""
    from fot.data.prepare import iter_texts, tokenize

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "bom.txt").write_bytes(b"\xef\xbb\xbfA note saved on Windows.\n")
    (folder / "plain.txt").write_text("Another note.\n")
    T = 4
    texts = ["A note saved on Windows.\n", "Another note.\n"]
    want = _packed(texts, T)
    prepared = [d.tolist() for d in tokenize(iter_texts([str(folder)]))]
    assert prepared == [get_encoding().encode_ordinary(t) for t in texts]
    for kw in ({"path": str(folder)}, {"path": "text", "hf_data_files": str(folder / "*.txt")}):
        cfg = _cfg(kind="hf", seq_len=T, val_tokens=0, streaming=streaming, **kw)
        train, _ = build_sources(cfg)
        n = want.num_sequences
        np.testing.assert_array_equal(train.read(0, n)[0], want.read(0, n)[0])


def test_hf_training_data_shorter_than_one_sequence_is_refused(tmp_path) -> None:
    """A training split of fewer than data.seq_len + 1 tokens used to train on sequences of
    its documents repeated over and over (a token folder that short is refused)."""
    texts = ["one short document", "", "and another"]
    files = _jsonl(tmp_path / "train.jsonl", [{"text": t} for t in texts])
    length = _packed(texts, 2).length  # every document with its BOS
    cfg = _cfg(kind="hf", path="json", seq_len=length, val_tokens=0, hf_data_files=files)
    with pytest.raises(ValueError, match=rf"split 'train': the split holds {length} tokens"):
        build_sources(cfg)
    cfg.seq_len = length - 1  # exactly seq_len + 1 tokens: one sequence, every label inside
    train, _ = build_sources(cfg)
    np.testing.assert_array_equal(train.read(0, 1)[1], _packed(texts, length - 1).read(0, 1)[1])
    cfg.packing = "padded"  # one document per sequence, padded: any length will do
    cfg.seq_len = 4 * length
    assert build_sources(cfg)[0].read(0, 1)[0].shape == (1, 4 * length)


def test_hf_empty_and_none_texts_are_skipped(tmp_path) -> None:
    """Empty texts and None cells (an empty CSV cell) are empty documents, skipped as prepare
    skips them; they used to become BOS-only documents, or stop the run (None)."""
    import pandas as pd

    texts = ["first document", "", "second one", None, "third and last", ""]
    csv = tmp_path / "d.csv"
    pd.DataFrame({"text": texts, "id": range(len(texts))}).to_csv(csv, index=False)
    jsonl = _jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    T = 4
    oracle = _packed([t for t in texts if t], T)
    n = oracle.num_sequences + 3  # into a second epoch
    for loader, files in (("csv", str(csv)), ("json", jsonl)):
        train, _ = build_sources(_cfg(kind="hf", path=loader, hf_data_files=files, seq_len=T))
        got, want = train.read(0, n), oracle.read(0, n)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    # a dataset of nothing but empty texts is refused before training
    empty = _jsonl(tmp_path / "e.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(ValueError, match="no documents: all 2 rows have empty text"):
        build_sources(_cfg(kind="hf", path="json", hf_data_files=empty, seq_len=T))


def test_prepare_skips_hidden_folders_and_files_of_a_folder(tmp_path, capsys) -> None:
    """prepare <folder> read Jupyter's .ipynb_checkpoints/ copies and .git/ files as documents
    (helper-176): a notebook's checkpoint copy landed in the held-out folder while its
    original trained. They are skipped with a warning, as data=hf skips them; named as
    inputs, they are read. Oracle: the documents of the visible files alone."""
    from fot.data.prepare import main as prepare
    from fot.data.tokens import TokenDocuments
    from fot.tokenizer import get_encoding

    def encode_document(text: str) -> list[int]:
        return get_encoding().encode_ordinary(text)

    folder = tmp_path / "nb"
    for name, text in (("notes.txt", "notes one\n"), (".ipynb_checkpoints/notes-checkpoint.txt",
                       "notes one\n"), (".git/MSG.txt", "old draft\n"), ("z.txt", "second doc\n"),
                       ("sub/.hidden.txt", "a hidden file\n")):  # fmt: skip
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    assert prepare([str(folder), "--out", str(tmp_path / "t")]) == 0
    got = [list(map(int, d)) for d in TokenDocuments(tmp_path / "t")]
    assert got == [list(encode_document(t)) for t in ("notes one\n", "second doc\n")]
    err = capsys.readouterr().err
    assert f"3 file(s) in hidden folders or with hidden names under {folder} skipped" in err
    named = folder / ".git" / "MSG.txt"
    assert prepare([str(named), "--out", str(tmp_path / "u")]) == 0
    assert [list(map(int, d)) for d in TokenDocuments(tmp_path / "u")] == [
        list(encode_document("old draft\n"))
    ]


def test_prepare_counts_empty_files_and_texts_it_skips(tmp_path, capsys) -> None:
    """Empty input files and "" texts of a .jsonl were skipped without a word (helper-176);
    only nulls were counted. Oracle: the non-empty documents alone are written."""
    from fot.data.prepare import main as prepare
    from fot.data.tokens import TokenDocuments
    from fot.tokenizer import get_encoding

    enc = get_encoding()
    folder = tmp_path / "texts"
    folder.mkdir()
    for name, text in (("a.txt", "one text"), ("b.txt", ""), ("c.txt", "")):
        (folder / name).write_text(text)
    rows = _jsonl(tmp_path / "r.jsonl", [{"text": "kept"}, {"text": ""}, {"text": " \n\n"}])
    assert prepare([str(folder), rows, "--out", str(tmp_path / "t")]) == 0
    # a text of white space alone is not empty: it has tokens of its own, and is kept
    docs = TokenDocuments(tmp_path / "t")
    assert [d.tolist() for d in docs][1:] == [enc.encode_ordinary(t) for t in ("kept", " \n\n")]
    err = capsys.readouterr().err
    assert "3 empty text(s) (an empty file, or an empty text field) skipped" in err, err


def test_csv_cells_that_read_like_missing_values_are_text(tmp_path) -> None:
    """pandas reads "NA", "null", "None", "nan", "#N/A", ... as missing values: such documents
    were dropped as empty CSV cells (helper-176), by data=hf and prepare --hf csv alike.
    Oracle: the same texts packed as given, the empty cell left out."""
    import csv

    from fot.data.prepare import main as prepare
    from fot.data.tokens import TokenDocuments

    texts = ["real document one", "NA", "N/A", "null", "None", "NaN", "nan", "#N/A", "<NA>", "",
             "real document two"]  # fmt: skip
    path = tmp_path / "na.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        writer.writerows([t] for t in texts)
    T = 4
    oracle = _packed([t for t in texts if t], T)
    train, _ = build_sources(_cfg(kind="hf", path="csv", hf_data_files=str(path), seq_len=T))
    n = oracle.num_sequences
    np.testing.assert_array_equal(train.read(0, n)[0], oracle.read(0, n)[0])
    assert prepare(["--hf", "csv", "--data-files", str(path), "--out", str(tmp_path / "t")]) == 0
    assert len(TokenDocuments(tmp_path / "t")) == len(texts) - 1


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_empty_or_undecodable_files_get_one_clear_error(tmp_path, streaming: bool) -> None:
    """An empty data file gave a bare StopIteration from inside datasets; a latin-1 text file
    a DatasetGenerationError whose cause (file, byte) only a full traceback showed."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("Hello world.\n")
    (corpus / "sub" / "d.txt").write_bytes("café latin1\n".encode("latin-1"))
    bad = corpus / "sub" / "d.txt"
    cases = [
        (dict(path="json", hf_data_files=str(empty)), rf"split 'train': the data files hold no rows \({empty}\)"),
        (dict(path=str(corpus)), rf"split 'train': {bad} is not valid UTF-8 \(byte 0xe9 at offset 3\).*iconv"),
    ]  # fmt: skip
    for kw, want in cases:
        with pytest.raises(ValueError, match=want) as info:
            train, _ = build_sources(
                _cfg(kind="hf", seq_len=8, val_tokens=0, streaming=streaming, **kw)
            )
            train.read(0, 4)  # streaming meets a bad file only when it reads that far
        assert str(info.value).startswith(f"data.path={kw['path']} split 'train': ")
        line = error_line("train.py", info.value, traceback_variable="HYDRA_FULL_ERROR")
        assert "raised by" not in line and line.count("\n") == 1  # fot's own one-line error


def test_a_folder_written_by_save_to_disk_is_read_with_load_from_disk(tmp_path, capsys) -> None:
    """A `Dataset.save_to_disk` folder as data.path (or `prepare --hf`) stopped with datasets'
    "Please use `load_from_disk` instead", which no fot option does; a `DatasetDict` one of
    splits named `mine` and `heldout` was read by load_dataset as one `train` split of both
    (the held-out rows trained on) and neither of its own names was found. Both are read with
    load_from_disk now: a Dataset as the split `train`, sliced as load_dataset slices one."""
    import datasets

    from fot.data.prepare import main
    from fot.data.tokens import TokenDocuments

    texts = [f"document {i}: " + "words of text " * (i % 5) for i in range(40)]
    single = tmp_path / "single"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(single))
    both = tmp_path / "both"
    datasets.DatasetDict(
        {
            "mine": datasets.Dataset.from_dict({"text": texts[:30]}),
            "heldout": datasets.Dataset.from_dict({"text": texts[30:]}),
        }
    ).save_to_disk(str(both))
    capsys.readouterr()  # datasets' progress bars
    T = 8
    cases = [
        (single, "train[5:]", "train[:5]", texts[5:], texts[:5]),
        (both, "mine", "heldout", texts[:30], texts[30:]),
    ]
    for folder, split, val_split, train_texts, val_texts in cases:
        cfg = _cfg(kind="hf", path=str(folder), seq_len=T, val_tokens=10 * T)
        cfg.hf_split, cfg.hf_val_split = split, val_split
        train, val = build_sources(cfg)
        oracle = _packed(train_texts, T)
        n = oracle.num_sequences + 2  # into the second epoch
        got, want = train.read(0, n), oracle.read(0, n)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert val.num_sequences == (_packed(val_texts, T).length - 1) // T
        out = tmp_path / f"tok_{folder.name}"
        assert main(["--hf", str(folder), "--split", split, "--out", str(out)]) == 0
        docs = TokenDocuments(out)
        assert len(docs) == len(train_texts)
        assert get_encoding().decode([int(t) for t in docs[0]]) == train_texts[0]
    # the default split `train` of splits named otherwise, and a split of no name in it
    for split, key in (("train", "hf_split"), ("held", "hf_val_split")):
        cfg = _cfg(kind="hf", path=str(both), seq_len=T, val_tokens=10 * T)
        cfg.hf_split, cfg.hf_val_split = "mine", "heldout"
        setattr(cfg, key, split)
        with pytest.raises(ValueError) as info:
            build_sources(cfg)
        assert error_line("train.py", info.value, traceback_variable="HYDRA_FULL_ERROR") == (
            f"train.py: error: data.path={both} (written by DatasetDict.save_to_disk) has no "
            f"split '{split}': the DatasetDict holds the splits 'mine', 'heldout'. Set "
            f"data.{key} to one of them, or to a slice of one\n"
            "(set HYDRA_FULL_ERROR=1 for the traceback)"
        )
    assert main(["--hf", str(both), "--out", str(tmp_path / "tok")]) == 2
    assert capsys.readouterr().err == (
        f"python -m fot.data.prepare: error: dataset {both} (written by DatasetDict.save_to_disk) has no split 'train': "
        "the DatasetDict holds the splits 'mine', 'heldout'. Set --split to one of them, or "
        "to a slice of one\n"
    )
    with pytest.raises(ValueError, match=r"save_to_disk, .* which takes no data.hf_data_files"):
        build_sources(_cfg(kind="hf", path=str(single), hf_data_files="a.jsonl", seq_len=T))


def test_a_folder_given_to_the_other_data_kind_names_the_kind_that_reads_it(
    tmp_path, capsys
) -> None:
    """A token folder given to data=hf (prepare's output, the data group left as it was) was
    read by datasets as its meta.json, a dataset of one row, and refused with "set
    data.text_field to the text column", which no column fixes; a save_to_disk folder given to
    data=tokens was told only to make a token folder. Each now names the data kind that
    reads it, and that kind does."""
    import datasets

    from fot.data.prepare import main
    from fot.data.tokens import write_token_documents

    texts = ["The first document.", "A second one, a little longer than the first.", "Third."]
    enc = get_encoding()
    T = 4
    oracle = _packed(texts, T)
    n = oracle.num_sequences
    tok = tmp_path / "tok"
    write_token_documents(tok, [enc.encode_ordinary(t) for t in texts])
    with pytest.raises(ValueError) as info:
        build_sources(_cfg(kind="hf", path=str(tok), seq_len=T))
    assert str(info.value) == (
        f"data.path={tok} is a token folder (written by `python -m fot.data.prepare`), already "
        f"tokenized: train on it with data=tokens data.path={tok}"
    )
    np.testing.assert_array_equal(
        build_sources(_cfg(kind="tokens", path=str(tok), seq_len=T))[0].read(0, n)[0],
        oracle.read(0, n)[0],
    )
    assert main(["--hf", str(tok), "--out", str(tmp_path / "again")]) == 2
    assert capsys.readouterr().err == (
        f"python -m fot.data.prepare: error: dataset {tok} is a token folder (written by `python -m fot.data.prepare`), "
        f"already tokenized: train on it with data=tokens data.path={tok}\n"
    )
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(saved))
    with pytest.raises(FileNotFoundError) as info:
        build_sources(_cfg(kind="tokens", path=str(saved), seq_len=T))
    assert str(info.value).endswith(
        f"It holds a Dataset written by save_to_disk: train on it with data=hf data.path={saved}."
    )
    np.testing.assert_array_equal(
        build_sources(_cfg(kind="hf", path=str(saved), seq_len=T))[0].read(0, n)[0],
        oracle.read(0, n)[0],
    )


def test_hf_loader_without_data_files_is_refused(tmp_path, monkeypatch, capsys) -> None:
    """`data=hf data.path=text` without data.hf_data_files (and `prepare --hf text` without
    --data-files) trained on whatever datasets found under the working directory: run from
    the repository root, fot/training/*.py became the training split (found by running
    `python train.py data=hf data.path=text`, the README's loader name, without files)."""
    from fot.data.prepare import main

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "code.txt").write_text("not meant to be trained on\n" * 200)
    monkeypatch.chdir(tmp_path)
    for loader in ("text", "json"):
        with pytest.raises(ValueError) as info:
            build_sources(_cfg(kind="hf", path=loader, seq_len=8, val_tokens=0))
        assert str(info.value).startswith(
            f"data.path={loader} is datasets' {loader} loader, which needs "
            "data.hf_data_files=<file, pattern or list>"
        )
        assert str(tmp_path) in str(info.value)
        out = tmp_path / "tok"
        assert main(["--hf", loader, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"python -m fot.data.prepare: error: dataset {loader} is datasets' {loader} loader, which "
        )
        assert "--data-files FILE" in err and not out.exists()
    # with the files named, the same loader reads them (one document per text file)
    train, _ = build_sources(
        _cfg(kind="hf", path="text", hf_data_files="train/*.txt", seq_len=8, val_tokens=0)
    )
    want = _packed([(tmp_path / "train" / "code.txt").read_text()], 8)
    np.testing.assert_array_equal(train.read(0, 2)[0], want.read(0, 2)[0])


def test_interpolations_in_a_list_or_mapping_of_hf_data_files_are_resolved(
    tmp_path, monkeypatch
) -> None:
    """`data.hf_data_files=[${oc.env:DATA}/a.jsonl]` (or a split mapping) handed datasets the
    unresolved string ("Unable to find '<cwd>/${oc.env:DATA}/a.jsonl'"), where a single file
    was resolved. Every form is resolved now, as Hydra sets it from an override, and
    OmegaConf's escape `\\${` still reaches datasets as a literal `${`."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    data = tmp_path / "data"
    data.mkdir()
    a = ["first file, first document", "first file, the second document"]
    b = ["a file named with a literal dollar and brace"]
    _jsonl(data / "a.jsonl", [{"text": t} for t in a])
    _jsonl(data / "b${x}.jsonl", [{"text": t} for t in b])
    monkeypatch.setenv("FOT_TEST_DATA", str(data))
    a_file = "${oc.env:FOT_TEST_DATA}/a.jsonl"
    b_file = hydra_string(str(data / "b${x}.jsonl"))  # "<data>/b\${x}.jsonl": no interpolation
    assert "\\${x}" in b_file
    cases = [
        (a_file, a),
        (b_file, b),
        (f"[{a_file}]", a),
        (f"[{a_file},{b_file}]", a + b),
        (f"{{train:[{a_file}]}}", a),
        (f"{{train:{b_file}}}", b),
    ]
    T = 4
    for value, texts in cases:
        cfg = OmegaConf.create({"data": _cfg(kind="hf", path="json", seq_len=T, val_tokens=0)})
        (parsed,) = OverridesParser.create().parse_overrides([f"data.hf_data_files={value}"])
        OmegaConf.update(cfg, parsed.key_or_group, parsed.value(), merge=True)
        train, _ = build_sources(cfg.data)
        oracle = _packed(texts, T)
        n = oracle.num_sequences
        np.testing.assert_array_equal(train.read(0, n)[0], oracle.read(0, n)[0], err_msg=value)


def test_prepare_hf_empty_or_undecodable_files_get_one_clear_error(tmp_path, capsys) -> None:
    from fot.data.prepare import main

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Hello world.\n")
    (corpus / "d.txt").write_bytes("café\n".encode("latin-1"))
    out = str(tmp_path / "tok")
    assert main(["--hf", "json", "--data-files", str(empty), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"python -m fot.data.prepare: error: dataset json split 'train': the data files hold no rows ({empty})"
    )
    assert "Traceback" not in err
    for streaming in ([], ["--streaming"]):
        assert main(["--hf", str(corpus), *streaming, "--out", out]) == 2
        err = capsys.readouterr().err
        assert (
            f"python -m fot.data.prepare: error: dataset {corpus} split 'train': {corpus / 'd.txt'} is not valid UTF-8"
            in err
        )
        assert "Traceback" not in err
    # a folder that does not exist, or holds no data file: datasets' own text named no fix
    (tmp_path / "bare").mkdir()
    for folder, problem in (("missing", "does not exist"), ("bare", "holds no data files")):
        assert main(["--hf", str(tmp_path / folder), "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(
            f"python -m fot.data.prepare: error: dataset {tmp_path / folder}: {tmp_path / folder} {problem}"
        )
        assert "Give a data file or a folder of them (.txt, .json," in err
    assert not (tmp_path / "tok").exists()


def test_a_relative_path_with_a_typo_is_named_not_looked_up_on_the_hub(
    tmp_path, capsys, monkeypatch
) -> None:
    """`data/my_textz` beside a folder `data` went to datasets as a hub id: offline, a minute
    of retries and 22 lines, then "Couldn't reach 'data/my_textz' on the Hub". It is a local
    path, as fot.hub reads one (init_from=, fot.eval), named at once; `owner/name` without a
    folder `owner` is still a hub id."""
    import datasets

    from fot.data.prepare import main

    asked = []

    def load_dataset(path, *args, **kwargs):
        asked.append(path)
        raise ConnectionError(f"Couldn't reach {path!r} on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(datasets, "load_dataset_builder", load_dataset)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert main(["--hf", "data/my_textz", "--out", "tok"]) == 2
    assert capsys.readouterr().err.startswith(
        "python -m fot.data.prepare: error: dataset data/my_textz: data/my_textz does not exist. Its folder data exists, "
        "so it is read as a local path, not a hub dataset id. Give a data file or a folder"
    )
    assert asked == [] and not (tmp_path / "tok").exists()
    assert main(["--hf", "someone/corpus", "--out", "tok"]) == 2
    assert asked == ["someone/corpus"]
    assert (
        "python -m fot.data.prepare: error: Couldn't reach 'someone/corpus' on the Hub"
        in capsys.readouterr().err
    )


def test_a_folder_datasets_reads_with_another_loader_names_the_text_loader(
    tmp_path, capsys
) -> None:
    """datasets reads a folder of .md files with its `harbor` loader, whose own failure ("No
    task.toml or instruction.md files found") named neither the loader nor a fix. The error
    now gives the text loader and a pattern; following it reads what the folder input reads."""
    import shlex

    from fot.data.prepare import main
    from fot.data.tokens import TokenDocuments

    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "a.md").write_text("# One\nThe first note.\n")
    (notes / "sub" / "b.md").write_text("# Two\nThe second, in a subfolder.\n")
    out = tmp_path / "tok"
    assert main(["--hf", str(notes), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    head = f"python -m fot.data.prepare: error: dataset {notes} split 'train': datasets chose its "
    assert err.startswith(head) and "(by their extension: .md), and it failed: " in err, err
    assert "Traceback" not in err and not out.exists()
    hint = err.split("name datasets' text loader and the files: ")[1]
    assert hint == f"--hf text --data-files '{notes}/**/*.md'"
    with pytest.raises(ValueError) as info:  # the same for training on data=hf
        build_sources(_cfg(kind="hf", path=str(notes), seq_len=8, val_tokens=0))
    assert str(info.value).endswith(f"data.path=text data.hf_data_files='{notes}/**/*.md'")
    # the hint works: the same documents as the folder given as input
    assert main([*shlex.split(hint), "--out", str(out)]) == 0
    assert "\r" not in capsys.readouterr().err  # datasets' bar, off a terminal
    assert main([str(notes), "--glob", "*.md", "--out", str(tmp_path / "want")]) == 0
    got, want = TokenDocuments(out), TokenDocuments(tmp_path / "want")
    assert sorted(map(tuple, got)) == sorted(map(tuple, want)) and len(want) == 2
    # one file: datasets takes no file as the dataset; it said "... does not exist"
    one = notes / "a.md"
    capsys.readouterr()
    assert main(["--hf", str(one), "--out", str(tmp_path / "one")]) == 2
    err = capsys.readouterr().err.strip()
    hint = f"--hf text --data-files {one}"  # a plain path needs no quotes
    assert (
        err
        == f"python -m fot.data.prepare: error: dataset {one} is a file; datasets reads a file through a loader: {hint}"
    )
    assert main([*shlex.split(hint), "--out", str(tmp_path / "one")]) == 0
    assert [list(d) for d in TokenDocuments(tmp_path / "one")] == [list(want[0])]
    # the loader named by the file's type, a compressed or upper-case one included
    for name, loader in (("a.jsonl.gz", "json"), ("b.JSONL", "json"), ("c.csv.gz", "csv"),
                         ("d.parquet", "parquet"), ("e.txt.xz", "text")):  # fmt: skip
        (tmp_path / name).write_bytes(b"")
        with pytest.raises(ValueError) as info:
            build_sources(_cfg(kind="hf", path=str(tmp_path / name), seq_len=8, val_tokens=0))
        assert str(info.value).endswith(f"data.path={loader} data.hf_data_files={tmp_path / name}")


def test_the_commands_advised_for_a_tsv_file_read_its_text_column(tmp_path, capsys) -> None:
    """A .tsv file is refused as text, and the advice (as for .csv) was `--hf csv --data-files
    <file>`, whose loader split every line at commas: the file became one column named by the
    whole tab-separated header, and the command stopped with "has no field 'text'". The csv
    loader now splits .tsv files at tabs, as datasets does for a folder of them; each command
    advised reads the text column (commas in it included), for prepare and data=hf alike."""
    import csv
    import shlex

    from fot.data.prepare import main
    from fot.data.tokens import TokenDocuments

    texts = ["A first document, with commas, in it.", "The second; no tab.", "Third, last."]
    folder = tmp_path / "mixed"
    folder.mkdir()
    tsv = folder / "rows.tsv"
    with open(tsv, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow(["id", "text", "label"])
        writer.writerows([i, t, i % 2] for i, t in enumerate(texts))
    (folder / "notes.txt").write_text("A note.\n")
    enc = get_encoding()
    want = [enc.encode_ordinary(t) for t in texts]
    hints = []
    assert main([str(tsv), "--out", str(tmp_path / "no")]) == 2  # the file as text: refused
    hints.append(re.search(r"`(--hf [^`]*)`", capsys.readouterr().err)[1])
    assert main(["--hf", str(tsv), "--out", str(tmp_path / "no")]) == 2  # as the dataset
    hints.append(capsys.readouterr().err.strip().split("through a loader: ")[1])
    assert main([str(folder), "--out", str(tmp_path / "notes")]) == 0  # left out of a folder
    hints.append(
        re.search(r"`python -m fot.data.prepare (--hf [^`]*) --out", capsys.readouterr().err)[1]
    )
    assert hints[0] == hints[1] == f"--hf csv --data-files {tsv}", hints
    for n, hint in enumerate(hints):
        out = tmp_path / f"tok{n}"
        assert main([*shlex.split(hint), "--out", str(out)]) == 0, capsys.readouterr().err
        assert [list(d) for d in TokenDocuments(out)] == want, hint
    # data=hf with the same loader and file trains on the same documents
    train, _ = build_sources(
        _cfg(kind="hf", path="csv", hf_data_files=str(tsv), seq_len=4, val_tokens=0)
    )
    oracle = _packed(texts, 4)
    got, expected = train.read(0, oracle.num_sequences), oracle.read(0, oracle.num_sequences)
    np.testing.assert_array_equal(got[1], expected[1])
    # a .tsv and a .csv file together: one separator for both would make one of them a single
    # column (the .csv's rows at tabs), so the pair is refused, naming one file of each kind
    comma = folder / "rows.csv"
    comma.write_text("id,text\n0,Fourth.\n")
    assert (
        main(["--hf", "csv", "--data-files", str(tsv), str(comma), "--out", str(tmp_path / "no")])
        == 2
    )
    err = capsys.readouterr().err
    assert f"gives datasets' csv loader .tsv files ({tsv}) and others ({comma})" in err, err
    assert not (tmp_path / "no").exists()


# ------------------------------------------------------------------ validating on training data


def test_a_missing_held_out_path_names_data_val_path(tmp_path) -> None:
    # the hint said "then set data.path=<folder>" for a missing data.val_path too
    from fot.data.tokens import write_token_documents

    write_token_documents(tmp_path / "tok", [np.arange(30, dtype=np.uint16)] * 3)
    cfg = _cfg(
        kind="tokens",
        path=str(tmp_path / "tok"),
        val_path=str(tmp_path / "nope"),
        seq_len=8,
        val_tokens=16,
    )
    with pytest.raises(FileNotFoundError) as err:
        build_sources(cfg)
    msg = str(err.value)
    assert msg.startswith(f"data.val_path={tmp_path / 'nope'} does not exist")
    assert msg.endswith("then set data.val_path=<folder>.") and "data.path" not in msg
    cfg = _cfg(kind="tokens", path=str(tmp_path / "gone"))
    with pytest.raises(FileNotFoundError, match=r"then set data\.path=<folder>\.$"):
        build_sources(cfg)


def test_a_missing_relative_path_is_shown_with_the_absolute_one(tmp_path, monkeypatch) -> None:
    # a relative path is resolved against the working folder, easy to mistake for another
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for kind, want in (
        ("tokens", f"data.path=data/tok (= {tmp_path / 'data' / 'tok'}) does not exist"),
        ("longcrawl64", f"no LongCrawl64 train.zarr under data/tok (= {tmp_path / 'data/tok'})"),
    ):
        with pytest.raises(FileNotFoundError) as err:
            build_sources(_cfg(kind=kind, path="data/tok", seq_len=8))
        assert str(err.value).startswith(want), str(err.value)
    with pytest.raises(FileNotFoundError) as err:
        build_sources(_cfg(kind="tokens", path=str(tmp_path / "data" / "tok"), seq_len=8))
    assert "(=" not in str(err.value)  # an absolute path is shown once


def test_check_data_paths_refuses_what_build_sources_refuses_for_a_path(tmp_path) -> None:
    """The sweep's up-front check (``check_data_paths``, run for every job before the first
    trains) refuses every path that reading the data refuses, with the same error, and passes
    the configs whose paths are there (or a held-out path that is not read)."""
    rows = (np.arange(4 * 64) % 50000).astype(np.uint16).reshape(4, 64)
    (tmp_path / "lc").mkdir()
    _zarr(tmp_path / "lc" / "train.zarr", rows)
    _zarr(tmp_path / "lc" / "heldout.zarr", rows[:2])
    (tmp_path / "lc_no_heldout").mkdir()
    _zarr(tmp_path / "lc_no_heldout" / "train.zarr", rows)
    np.save(tmp_path / "t.npy", rows.ravel())
    gone = str(tmp_path / "gone")
    refused = [
        dict(kind="tokens"),
        dict(kind="tokens", path=gone),
        dict(kind="tokens", path=str(tmp_path / "t.npy"), val_path=gone, val_tokens=16),
        dict(kind="longcrawl64"),
        dict(kind="longcrawl64", path=gone),
        dict(kind="longcrawl64", path=str(tmp_path / "lc"), val_path=gone, val_tokens=16),
        dict(kind="longcrawl64", path=str(tmp_path / "lc_no_heldout"), val_tokens=16),
        dict(
            kind="longcrawl64", path=str(tmp_path / "lc_no_heldout" / "train.zarr"), val_tokens=16
        ),
        dict(kind="sample", path=gone),
    ]
    for kw in refused:
        with pytest.raises((ValueError, FileNotFoundError)) as loader:
            build_sources(_cfg(seq_len=8, packing="causal", **kw))
        with pytest.raises(type(loader.value)) as check:
            check_data_paths(_cfg(seq_len=8, packing="causal", **kw))
        assert str(check.value) == str(loader.value), kw
    passed = [
        dict(kind="tokens", path=str(tmp_path / "t.npy"), val_path=gone, val_tokens=0),
        dict(kind="longcrawl64", path=str(tmp_path / "lc"), val_tokens=16),
        dict(kind="longcrawl64", path=str(tmp_path / "lc_no_heldout"), val_tokens=0),
        dict(kind="sample"),
    ]
    for kw in passed:
        build_sources(_cfg(seq_len=8, packing="causal", **kw))  # the oracle: it reads them
        check_data_paths(_cfg(seq_len=8, packing="causal", **kw))


def test_a_file_of_a_token_folder_as_data_path_names_the_folder(tmp_path) -> None:
    """data.path=<token folder>/tokens.bin (llm.c's habit: the .bin is the data) trained on the
    folder's documents run together without a BOS between them, and its doc_offsets.npy on
    document offsets taken for token ids, until one above the vocabulary stopped the run with
    the advice to enlarge the vocabulary. Both are refused now, naming the folder to give."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fot.data.tokens import write_token_documents

    texts = ["The first document.", "A second one, a little longer than the first.", "Third."]
    enc = get_encoding()
    folder = tmp_path / "tok"
    write_token_documents(folder, [enc.encode_ordinary(t) for t in texts])
    T = 4
    for name, why in (
        ("tokens.bin", "it holds the documents back to back with no BOS between them (their "
         "boundaries are in doc_offsets.npy)"),
        ("doc_offsets.npy", "it holds where the documents start, not token ids"),
        ("meta.json", "a token folder is read whole"),
    ):  # fmt: skip
        for key in ("path", "val_path"):
            paths = {"path": str(folder), key: str(folder / name)}
            with pytest.raises(ValueError) as info:
                build_sources(_cfg(kind="tokens", seq_len=T, val_tokens=T, **paths))
            assert str(info.value) == (
                f"data.{key}={folder / name} is a file of the token folder {folder}, not token "
                f"data of its own: {why}. Set data.{key}={folder}"
            )
    held = tmp_path / "held"
    write_token_documents(held, [enc.encode_ordinary(t) for t in texts])
    cfg = _cfg(kind="tokens", seq_len=T, val_tokens=T, path=str(folder), val_path=str(held))
    oracle = _packed(texts, T)
    n = oracle.num_sequences
    for source in build_sources(cfg):  # the fix reads the documents with their boundaries
        np.testing.assert_array_equal(source.read(0, n)[0], oracle.read(0, n)[0])
    # train.py: one line, exit status 2, for a path relative to the working folder too
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "train.py"), "data=tokens", "data.path=tok/tokens.bin",
         f"out_dir={tmp_path / 'run'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "WANDB_MODE": "disabled", "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-2:] == [
        "train.py: error: data.path=tok/tokens.bin is a file of the token folder tok, not token "
        "data of its own: it holds the documents back to back with no BOS between them (their "
        "boundaries are in doc_offsets.npy). Set data.path=tok",
        "(set HYDRA_FULL_ERROR=1 for the traceback)",
    ]
    assert not (tmp_path / "run").exists()


def test_a_slice_of_a_streamed_split_and_a_longcrawl64_folder_as_tokens_name_the_fix(
    tmp_path, capsys
) -> None:
    """A sliced split with data.streaming=true failed with datasets' "Bad split: train[10%:].
    Available splits: ['train']"; data=tokens on a LongCrawl64 folder named only prepare."""
    from fot.data.prepare import main

    jsonl = _jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i} " * 5} for i in range(9)])
    cfg = _cfg(kind="hf", path="json", hf_data_files=jsonl, hf_split="train[10%:]",
               hf_val_split="train[:10%]", streaming=True, seq_len=8, val_tokens=16)  # fmt: skip
    with pytest.raises(ValueError, match=r"split 'train\[10%:\]': a streamed dataset \(data\."
                       r"streaming=true\) is read in order and cannot be sliced: read it "
                       r"without data\.streaming=true"):  # fmt: skip
        build_sources(cfg)
    cfg.streaming = False
    assert build_sources(cfg)[1] is not None  # the same slices, not streamed
    out = tmp_path / "tok"
    assert main(["--hf", "json", "--data-files", jsonl, "--split", "train[:50%]", "--streaming",
                 "--out", str(out)]) == 2  # fmt: skip
    assert "cannot be sliced: read it without --streaming" in capsys.readouterr().err
    assert not out.exists()
    lc = tmp_path / "lc"
    _zarr(lc / "train.zarr", np.zeros((2, 64), np.uint16))
    _zarr(lc / "heldout.zarr", np.zeros((2, 64), np.uint16))
    with pytest.raises(FileNotFoundError) as err:
        build_sources(_cfg(kind="tokens", path=str(lc), seq_len=8, val_tokens=0))
    assert str(err.value).endswith(
        f"It holds heldout.zarr and train.zarr: for LongCrawl64 use data=longcrawl64 "
        f"data.path={lc}, or name an array itself (data.path={lc / 'train.zarr'} "
        "data.text_escaping=json: LongCrawl64's ids are of JSON-escaped text)."
    )


def test_validating_on_the_training_data_warns(tmp_path, caplog) -> None:
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fot.data.tokens import write_token_documents

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50000, size=30).astype(np.uint16) for _ in range(6)]
    write_token_documents(tmp_path / "tok", docs)
    write_token_documents(tmp_path / "held", docs[:2])
    (tmp_path / "link").symlink_to(tmp_path / "tok")
    train_jsonl = _jsonl(tmp_path / "t.jsonl", [{"text": f"doc {i} " * 5} for i in range(9)])
    val_jsonl = _jsonl(tmp_path / "v.jsonl", [{"text": f"held {i} " * 5} for i in range(9)])
    same = [
        _cfg(kind="tokens", path=str(tmp_path / "tok"), val_path=str(tmp_path / "link")),
        _cfg(kind="tokens", path=str(tmp_path / "tok"), val_path=f"{tmp_path}/./tok/"),
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_val_split="train"),
        _cfg(kind="hf", path="json", hf_val_split="validation",
             hf_data_files={"train": train_jsonl, "validation": train_jsonl}),
        # a slice of the training split, or of a split that is part of it, or ranges that
        # overlap (these were taken for held-out data without a word)
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_val_split="train[:10%]"),
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_split="train[:50%]",
             hf_val_split="train[:10%]"),
        _cfg(kind="hf", path="json", hf_split="train+validation", hf_val_split="validation",
             hf_data_files={"train": train_jsonl, "validation": val_jsonl}),
        # the last rows of the split it trains on whole; slices in other units from row 0
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_val_split="train[-2:]"),
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_split="train[:5]",
             hf_val_split="train[:20%]"),
    ]  # fmt: skip
    other = [
        _cfg(kind="tokens", path=str(tmp_path / "tok"), val_path=str(tmp_path / "held")),
        _cfg(kind="hf", path="json", hf_val_split="validation",
             hf_data_files={"train": train_jsonl, "validation": val_jsonl}),
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_split="train[2:]",
             hf_val_split="train[:2]"),
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_split="train[-90%:]",
             hf_val_split="train[:10%]"),
        _cfg(kind="hf", path="json", hf_data_files=train_jsonl, hf_split="train[:-2]",
             hf_val_split="train[-2:]"),
        _cfg(kind="hf", path="json", hf_split="train+validation", hf_val_split="test",
             hf_data_files={"train": train_jsonl, "validation": train_jsonl, "test": val_jsonl}),
    ]  # fmt: skip
    for cfg in same + other:
        cfg.seq_len, cfg.val_tokens = 8, 16
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            build_sources(cfg)
        warned = [w for w in _data_warnings(caplog) if "validation measures the training data" in w]
        assert len(warned) == (1 if cfg in same else 0), (cfg.kind, cfg.get("val_path"), warned)
        if warned and cfg.kind == "hf":  # its example works as written on a command line
            example = warned[0].split("(e.g. ", 1)[1].split("), or map", 1)[0]
            parsed = OverridesParser.create().parse_overrides(shlex.split(example))
            base = str(cfg.hf_split).split("[")[0].split("+")[0]
            assert {o.key_or_group: o.value() for o in parsed} == {
                "data.hf_split": f"{base}[1%:]",
                "data.hf_val_split": f"{base}[:1%]",
            }, example


def test_the_text_loader_hint_for_a_mixed_folder_names_all_its_text_files(tmp_path, capsys) -> None:
    """A folder of .md and .txt notes: datasets picks its loader by the most common extension
    (.md: `harbor`) and lists only those files, and the hint named only them: following it
    left the .txt notes out. The hint now names every kind of text file in the folder (not
    hidden ones, which datasets does not list, nor other files)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fot.data.prepare import iter_hf_texts, main
    from fot.data.tokens import TokenDocuments

    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / ".trash").mkdir()
    for i, name in enumerate(["a.md", "b.md", "sub/c.md", "d.txt", "sub/e.txt"]):
        (notes / name).write_text(f"Note {i}: {name}.\n")
    (notes / ".trash" / "old.rst").write_text("hidden: datasets does not list it\n")
    (notes / "picture.png").write_bytes(b"\x89PNG\r\n")
    out = tmp_path / "tok"
    assert main(["--hf", str(notes), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "datasets chose its 'harbor' loader for these files (by their extension: .md)" in err
    hint = err.split("name datasets' text loader and the files: ")[1]
    assert hint == f"--hf text --data-files '{notes}/**/*.md' '{notes}/**/*.txt'"
    assert main([*shlex.split(hint), "--out", str(out)]) == 0
    capsys.readouterr()
    assert (
        main([str(notes), "--glob", "*.md", "--glob", "*.txt", "--out", str(tmp_path / "want")])
        == 0
    )
    got, want = TokenDocuments(out), TokenDocuments(tmp_path / "want")
    assert sorted(map(tuple, got)) == sorted(map(tuple, want)) and len(want) == 5
    # the same for training on data=hf: a list of patterns, which Hydra reads as one
    with pytest.raises(ValueError) as info:
        build_sources(_cfg(kind="hf", path=str(notes), seq_len=8, val_tokens=0))
    files = f"[{notes}/**/*.md,{notes}/**/*.txt]"
    assert str(info.value).endswith(f"data.path=text data.hf_data_files='{files}'")
    (override,) = OverridesParser.create().parse_overrides([f"data.hf_data_files={files}"])
    texts = list(iter_hf_texts("text", data_files=override.value()))
    assert sorted(texts) == sorted(f"Note {i}: {n}.\n" for i, n in enumerate(
        ["a.md", "b.md", "sub/c.md", "d.txt", "sub/e.txt"]))  # fmt: skip


def test_a_folder_read_as_text_warns_of_the_text_files_datasets_leaves_out(
    tmp_path, capsys, caplog
) -> None:
    """A folder of as many .txt as .md notes (or more): datasets picks its text loader by the
    most common extension and reads the .txt files alone, without a word: half the notes never
    trained. Now a warning names the files left out and the hint that reads them all; a folder
    of one kind of text file gets none."""
    import shlex

    from fot.data.prepare import iter_hf_texts, main

    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    names = ["a.md", "sub/b.md", "c.txt", "sub/d.txt", "e.txt"]
    for i, name in enumerate(names):
        (notes / name).write_text(f"Note {i}: {name}.\n")
    (notes / ".hidden.md").write_text("datasets does not list hidden files\n")
    (notes / "README.md").write_text("datasets takes this for the dataset card, never data\n")
    every = sorted(f"Note {i}: {n}.\n" for i, n in enumerate(names))
    assert sorted(iter_hf_texts(str(notes))) == [t for t in every if ".txt" in t]  # as datasets
    err = capsys.readouterr().err
    assert f"datasets reads the 3 .txt file(s) of this folder as text and leaves out 2 other " \
        f"text file(s) ({notes}/a.md, {notes}/sub/b.md)" in err  # fmt: skip
    # the hint's line alone: datasets' "Generating train split" bars may follow it (they are
    # on until a fot command line, as main below, turns them off for the process)
    hint = err.split("To read them too: ")[1].splitlines()[0]
    assert hint == f"--hf text --data-files '{notes}/**/*.md' '{notes}/**/*.txt'"
    assert main([*shlex.split(hint), "--out", str(tmp_path / "tok")]) == 0
    assert sorted(iter_hf_texts("text", data_files=shlex.split(hint)[3:])) == every
    assert "leaves out" not in capsys.readouterr().err  # the hint's files: all read
    # data=hf in train.py: the same warning, with train.py's hint
    caplog.set_level(logging.WARNING, logger="fot.data")
    build_sources(_cfg(kind="hf", path=str(notes), seq_len=4, val_tokens=0))
    (warning,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert warning.endswith(
        f"data.path=text data.hf_data_files='[{notes}/**/*.md,{notes}/**/*.txt]'"
    )
    # one kind of text file: nothing left out, no warning
    for name in ("a.md", "sub/b.md"):
        (notes / name).unlink()
    caplog.clear()
    assert sorted(iter_hf_texts(str(notes))) == [t for t in every if ".txt" in t]
    build_sources(_cfg(kind="hf", path=str(notes), seq_len=4, val_tokens=0))
    assert "leaves out" not in capsys.readouterr().err + caplog.text


def test_a_folder_of_several_file_kinds_warns_of_the_files_datasets_leaves_out(
    tmp_path, capsys, caplog
) -> None:
    """datasets reads a folder with the one loader of its most numerous kind of file: of two
    .txt files and a .jsonl, the .txt alone (of two .jsonl files and a .txt, the .jsonl),
    without a word, so the other file's documents never trained. A warning now names the
    files left out and a prepare command that reads them all, which does."""
    import shlex

    from fot.data.prepare import iter_hf_texts, main
    from fot.data.tokens import TokenDocuments

    enc = get_encoding()
    caplog.set_level(logging.WARNING, logger="fot.data")
    texts = {"a.txt": ["First text file.\n"], "b.txt": ["Second text file.\n"]}
    texts["c.jsonl"] = [f"row {i} of the JSON Lines file" for i in range(3)]
    for more, kind in (("a.txt", ".jsonl"), ("c.jsonl", ".txt")):
        folder = tmp_path / f"without_{kind[1:]}"
        (folder / "sub").mkdir(parents=True)
        files = dict(texts, **{f"sub/more_{more}": texts[more]})
        for name, docs in files.items():
            if name.endswith(".jsonl"):
                _jsonl(folder / name, [{"text": t} for t in docs])
            else:
                (folder / name).write_text(docs[0])
        every = sorted(t for docs in files.values() for t in docs)
        read = sorted(iter_hf_texts(str(folder)))
        left = sorted(n for n in files if n.endswith(kind))
        assert read == sorted(t for n, d in files.items() if n not in left for t in d)
        shown = ", ".join(f"{folder}/{n}" for n in left)
        told = (
            f"and leaves out {len(left)} file(s) of other kinds ({shown}): it reads a folder "
            "with one loader. To train on them too, write them all into one token folder, "
        )
        assert told in capsys.readouterr().err
        caplog.clear()
        build_sources(_cfg(kind="hf", path=str(folder), seq_len=4, val_tokens=0))
        (warning,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
        assert warning.startswith(
            f"data.path={folder}: datasets reads the {len(files) - len(left)} "
        )
        command = warning.split("`")[1].replace("<folder>", str(tmp_path / "tok"))
        assert command.startswith("python -m fot.data.prepare ")
        assert main(shlex.split(command)[3:]) == 0
        docs = TokenDocuments(tmp_path / "tok")
        assert sorted(enc.decode([int(t) for t in d]) for d in docs) == every
    # kinds prepare does not read from a folder: no command, the other fixes
    tables = tmp_path / "tables"
    tables.mkdir()
    for name in ("a.csv", "b.csv"):
        (tables / name).write_text("text\nA row of a CSV file.\n")
    _jsonl(tables / "c.jsonl", [{"text": "a JSON row"}])
    caplog.clear()
    build_sources(_cfg(kind="hf", path=str(tables), seq_len=4, val_tokens=0))
    (warning,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert warning.endswith(
        f"({tables}/c.jsonl): it reads a folder with one loader. To train on them too, convert "
        "them to one format, or move the files not meant for training out"
    )
    # one kind of file: nothing left out, no warning
    (tables / "c.jsonl").unlink()
    caplog.clear()
    build_sources(_cfg(kind="hf", path=str(tables), seq_len=4, val_tokens=0))
    assert "leaves out" not in capsys.readouterr().err + caplog.text
    # files of the kind read that a dataset card's configs leave out: no warning either
    card = tmp_path / "card"
    for lang in ("en", "fr"):
        (card / lang).mkdir(parents=True)
        _jsonl(card / lang / "a.jsonl", [{"text": f"a document in {lang}"}])
    (card / "README.md").write_text(
        "---\nconfigs:\n- config_name: en\n  data_files: en/*.jsonl\n  default: true\n"
        "- config_name: fr\n  data_files: fr/*.jsonl\n---\n"
    )
    for name in (None, "fr"):
        assert list(iter_hf_texts(str(card), name=name)) == [f"a document in {name or 'en'}"]
        build_sources(_cfg(kind="hf", path=str(card), hf_name=name, seq_len=4, val_tokens=0))
    assert "leaves out" not in capsys.readouterr().err + caplog.text


# Folder names with characters Hydra's override grammar reads specially (in a list, or at all),
# quotes and backslashes (Hydra's quoting), `$` and `${` (an OmegaConf interpolation), and
# characters a shell reads specially. `[` and `]` alone: a `[1]`, `*` or `?` (glob characters)
# in test_the_text_loader_hints_read_the_folder_alone_whatever_glob_characters_it_holds.
HINT_FOLDERS = [
    "a,b", "a(b", "a)b", "a[b", "a]b", "a{b", "a}b", "a=b", "a b", "a  b", "a'b", 'a"b',
    "a$b", "a${b}", "a\\${b}", "a\\b", "a\\", "a\\,b", "a:b", "a~b", "a#b", "a;b", "a&b", "a`b",
    "a!b", "a\tb", "é", "true", "1.5", "null",
]  # fmt: skip


@pytest.mark.parametrize("name", HINT_FOLDERS)
def test_the_text_loader_hints_read_back_for_any_folder_name(tmp_path, caplog, capsys, name):
    """The hints to read a folder with the text loader gave the folder's patterns bare: in
    train.py's list (`data.hf_data_files='[<folder>/**/*.md,<folder>/**/*.txt]'`) a `,` split
    a pattern in two, a `(`, `=`, quote, `~` or `#` was a parse error, and in prepare's
    `--data-files '<pattern>'` a `'` ended the shell word. Each now reads back as the patterns
    (quoted where Hydra or the shell needs it) and datasets reads every file through them."""
    import glob
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fot.data.prepare import iter_hf_texts

    notes = tmp_path / name / "notes"
    (notes / "sub").mkdir(parents=True)
    names = ["a.md", "sub/b.md", "c.txt", "sub/d.txt", "e.txt"]
    for i, n in enumerate(names):
        (notes / n).write_text(f"Note {i}: {n}.\n")
    every = sorted(f"Note {i}: {n}.\n" for i, n in enumerate(names))
    patterns = [f"{glob.escape(str(notes))}/**/*{kind}" for kind in (".md", ".txt")]  # a[[]b
    # prepare's hint: shell words
    assert sorted(iter_hf_texts(str(notes))) != every
    hint = capsys.readouterr().err.split("To read them too: ")[1].splitlines()[0]
    assert shlex.split(hint) == ["--hf", "text", "--data-files", *patterns]

    # train.py's: shell words, then Hydra overrides, which set the config as Hydra does
    def override(cfg, word: str):
        (parsed,) = OverridesParser.create().parse_overrides([word])
        OmegaConf.update(cfg, parsed.key_or_group, parsed.value(), merge=True)
        return parsed.value()

    caplog.set_level(logging.WARNING, logger="fot.data")
    cfg = OmegaConf.create({"data": _cfg(kind="hf", seq_len=4, val_tokens=0)})
    override(cfg, f"data.path={hydra_string(str(notes))}")  # (a path Hydra reads as is)
    assert OmegaConf.to_container(cfg, resolve=True)["data"]["path"] == str(notes)
    build_sources(cfg.data)
    (warning,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    words = shlex.split(warning.split("To read them too: ")[1])
    assert words[0] == "data.path=text" and len(words) == 2
    for files in (patterns[:1], patterns):  # the one-pattern form (of a file), and a list
        want = files if len(files) > 1 else files[0]
        (word,) = shlex.split(train_py_loader_hint("text", files).split(" ", 1)[1])
        cfg = OmegaConf.create({"data": _cfg(kind="hf", path="text")})
        value = override(cfg, word)
        if "${" not in name:  # (OmegaConf's escape of an interpolation stays in the value)
            assert value == want
        got = OmegaConf.to_container(cfg, resolve=True)["data"]["hf_data_files"]
        assert got == want
    assert word == words[1]
    assert sorted(iter_hf_texts("text", data_files=got)) == every


@pytest.mark.parametrize(("name", "sibling"), [("no*tes", "notes"), ("no?tes", "noXtes")])
def test_the_text_loader_hints_read_the_folder_alone_whatever_glob_characters_it_holds(
    tmp_path, caplog, capsys, name, sibling
) -> None:
    """The text-loader hints gave a folder's path as is in their patterns, which datasets
    globs: the hint for a folder `d[1]` read `d1/` instead (`[1]` a character class), and for
    `no*tes` or `no?tes` the files of `notes/` or `noXtes/` too. The folder's part of each
    pattern is escaped now (`d[[]1]/**/*.md`, as datasets' fsspec glob reads it), and the
    hints (files left out, another loader chosen, a file given) read its files alone. (The
    sibling holds a note that datasets leaves out, as it reads the .txt files: one it would
    read is refused, test_a_folder_whose_path_datasets_globs_to_other_files_is_refused.)"""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fot.data.prepare import iter_hf_texts, main

    notes = tmp_path / name
    names = ["a.md", "sub/b.md", "c.txt", "sub/d.txt", "e.txt", "f.txt"]
    (notes / "sub").mkdir(parents=True)
    for i, n in enumerate(names):
        (notes / n).write_text(f"{name} {i}: {n}.\n")
    (tmp_path / sibling).mkdir()
    (tmp_path / sibling / "a.md").write_text("another folder's note\n")
    every = sorted(f"{name} {i}: {n}.\n" for i, n in enumerate(names))
    # the files datasets leaves out: prepare's hint, then train.py's through Hydra
    assert sorted(iter_hf_texts(str(notes))) == every[2:]
    hint = capsys.readouterr().err.split("To read them too: ")[1].splitlines()[0]
    assert sorted(iter_hf_texts("text", data_files=shlex.split(hint)[3:])) == every
    caplog.set_level(logging.WARNING, logger="fot.data")
    build_sources(_cfg(kind="hf", path=str(notes), seq_len=4, val_tokens=0))
    (warning,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    word = shlex.split(warning.split("To read them too: ")[1])[1]
    (override,) = OverridesParser.create().parse_overrides([word])
    assert sorted(iter_hf_texts("text", data_files=override.value())) == every
    # .md files alone: datasets' `harbor` loader fails, and the error names the text loader
    for n in names[2:]:
        (notes / n).unlink()
    (tmp_path / sibling / "a.md").unlink()  # (else datasets would read it: refused)
    capsys.readouterr()
    assert main(["--hf", str(notes), "--out", str(tmp_path / "tok")]) == 2
    hint = capsys.readouterr().err.split("name datasets' text loader and the files: ")[1]
    assert sorted(iter_hf_texts("text", data_files=shlex.split(hint)[3:])) == every[:2]
    # a file given as the dataset
    (tmp_path / sibling / "a.md").write_text("another folder's note\n")
    assert main(["--hf", str(notes / "a.md"), "--out", str(tmp_path / "tok")]) == 2
    hint = capsys.readouterr().err.split("through a loader: ")[1]
    assert list(iter_hf_texts("text", data_files=shlex.split(hint)[3:])) == every[:1]


def test_a_folder_whose_dataset_card_names_files_outside_it_is_read(tmp_path) -> None:
    """A dataset card (README.md ``configs:``) may name data files outside its folder
    (``../shared/*.txt``); the check for a folder path that datasets globs to other folders'
    files refused such a folder, which holds no glob characters, with a wrong diagnosis."""
    from fot.data.prepare import iter_hf_texts

    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "a.txt").write_text("a note kept beside the card\n")
    card = tmp_path / "card"
    card.mkdir()
    (card / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: ../shared/*.txt\n---\n"
    )
    assert list(iter_hf_texts(str(card))) == ["a note kept beside the card\n"]


@pytest.mark.parametrize(("name", "sibling"), [("d[1]", "d1"), ("no*tes", "notes"), ("d[1]", None)])  # fmt: skip
def test_a_folder_whose_path_datasets_globs_to_other_files_is_refused(
    tmp_path, capsys, name, sibling
) -> None:
    """datasets globs the path of a local folder: `data.path=<dir>/d[1]` (or `--hf`) read the
    files of a folder `d1/` beside it instead, and `no*tes` those of `notes/` too, silently
    (fot's left-out warning even called them "the .txt file(s) of this folder"); a `d[1]`
    with no `d1` beside it read nothing, and fot said it "holds no data files" though it
    does. Both are refused now, naming the folder, the files outside it, and the loader with
    the folder's escaped patterns, which reads the folder's files alone; a folder whose path
    matches only itself is read as before (a symlink in it to a file outside included)."""
    import shlex
    import shutil

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fot.data.hf import HFDataError
    from fot.data.prepare import iter_hf_texts, main

    notes = tmp_path / name
    names = ["a.md", "sub/b.md", "c.txt", "sub/d.txt", "e.txt"]
    for folder in [notes] + ([tmp_path / sibling] if sibling else []):
        (folder / "sub").mkdir(parents=True)
        for i, n in enumerate(names):
            (folder / n).write_text(f"{folder.name} {i}: {n}.\n")
    every = sorted(f"{name} {i}: {n}.\n" for i, n in enumerate(names))
    found = (
        f"matches files outside the folder, which datasets would read: {tmp_path / sibling}/"
        if sibling
        else "matches none of the folder's files"
    )
    way_out = re.compile(r"\(its glob characters escaped\): (.*); or rename the folder")
    # prepare: one line, nothing written, and its hint reads the folder's files alone
    assert main(["--hf", str(notes), "--out", str(tmp_path / "tok")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"python -m fot.data.prepare: error: dataset {notes}: datasets reads a folder's path as a glob pattern, and "
        f"{notes} {found}"
    )
    assert err.count("\n") == 1 and not (tmp_path / "tok").exists()
    hint = shlex.split(way_out.search(err)[1])
    assert hint[:3] == ["--hf", "text", "--data-files"]
    assert sorted(iter_hf_texts("text", data_files=hint[3:])) == every
    # train.py: the same, its hint read back through Hydra
    with pytest.raises(HFDataError, match=re.escape(f"data.path={notes}: datasets reads")) as info:
        build_sources(_cfg(kind="hf", path=str(notes), seq_len=4, val_tokens=0))
    assert found in str(info.value)
    line = error_line("train.py", info.value, traceback_variable="HYDRA_FULL_ERROR")
    assert "raised by" not in line and line.count("\n") == 1  # fot's own one-line error
    path, files = shlex.split(way_out.search(str(info.value))[1])
    assert path == "data.path=text"
    (override,) = OverridesParser.create().parse_overrides([files])
    assert sorted(iter_hf_texts("text", data_files=override.value())) == every
    # a file of the folder, given as the dataset: its hint reads that file alone
    assert main(["--hf", str(notes / "a.md"), "--out", str(tmp_path / "tok")]) == 2
    hint = capsys.readouterr().err.split("through a loader: ")[1]
    assert list(iter_hf_texts("text", data_files=shlex.split(hint)[3:])) == every[:1]
    # without the other folder, `no*tes` matches itself alone: read as before
    if name == "no*tes":
        shutil.rmtree(tmp_path / sibling)
        (tmp_path / "elsewhere.txt").write_text("linked in.\n")
        (notes / "f.txt").symlink_to(tmp_path / "elsewhere.txt")
        got = sorted(iter_hf_texts(str(notes)))
        assert got == sorted([*every[2:], "linked in.\n"])
        assert "datasets reads the 4 .txt file(s) of this folder" in capsys.readouterr().err


def test_a_home_folder_path_is_expanded_for_datasets(tmp_path, monkeypatch, caplog, capsys):
    """datasets does not expand `~`: `data.path=~/notes` (or `--hf ~/notes`) was taken for a
    hub id ("Repo id must use alphanumeric chars ... '~/notes'"), a data file `~/a.jsonl` for
    one under the working directory ("Unable to find '<cwd>/~/a.jsonl'"), and the hints built
    from `~/notes` named such patterns. `~` is now expanded for datasets, as for fot's checks;
    messages still name the path as given."""
    import shlex

    from fot.data.prepare import iter_hf_texts, main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path.parent)  # (no ~ folder under it)
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    names = ["a.md", "sub/b.md", "c.txt", "sub/d.txt", "e.txt"]
    for i, n in enumerate(names):
        (notes / n).write_text(f"Note {i}: {n}.\n")
    every = sorted(f"Note {i}: {n}.\n" for i, n in enumerate(names))
    texts = ["the first document", "and a second, longer document"]
    _jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    T = 4
    # the dataset path: datasets reads the .txt notes, and the warning's hint reads them all
    txt = [t for t in every if ".txt" in t]
    assert sorted(iter_hf_texts("~/notes")) == txt
    err = capsys.readouterr().err
    assert "dataset ~/notes: datasets reads the 3 .txt file(s)" in err
    hint = err.split("To read them too: ")[1].splitlines()[0]
    assert hint == f"--hf text --data-files '{notes}/**/*.md' '{notes}/**/*.txt'"
    assert sorted(iter_hf_texts("text", data_files=shlex.split(hint)[3:])) == every
    assert main(["--hf", "~/notes", "--out", str(tmp_path / "tok")]) == 0
    caplog.set_level(logging.WARNING, logger="fot.data")
    build_sources(_cfg(kind="hf", path="~/notes", seq_len=T, val_tokens=0))
    (warning,) = [r.getMessage() for r in caplog.records if "leaves out" in r.getMessage()]
    assert warning.startswith("data.path=~/notes: datasets reads the 3 .txt file(s)")
    assert warning.endswith(f"data.hf_data_files='[{notes}/**/*.md,{notes}/**/*.txt]'")
    # data files: one, a list, a split mapping
    oracle = _packed(texts, T)
    n = oracle.num_sequences
    for files in ("~/a.jsonl", ["~/a.jsonl"], {"train": "~/a.jsonl"}, {"train": ["~/*.jsonl"]}):
        assert list(iter_hf_texts("json", data_files=files)) == texts
        train, _ = build_sources(
            _cfg(kind="hf", path="json", hf_data_files=files, seq_len=T, val_tokens=0)
        )
        np.testing.assert_array_equal(train.read(0, n)[0], oracle.read(0, n)[0])


# Pairs of (training split, held-out split) of one split "train": slices from its start, from
# its end, in rows and in percents, disjoint at every length, at some or whenever non-empty.
SPLIT_PAIRS = [
    ("train[:-100]", "train[-200:]"),  # share rows of more than 100 rows
    ("train[:-100]", "train[-100:]"),  # never
    ("train[:100]", "train[-100:]"),  # of fewer than 200 rows
    ("train[:-5]", "train[-5:]"),
    ("train[:-5]", "train[-6:-2]"),
    ("train[-10:-5]", "train[-5:]"),
    ("train[5:]", "train[2:8]"),
    ("train[:90%]", "train[-10%:]"),  # 13.5 and 1.5 both round up: row 13 of 15
    ("train[-90%:]", "train[:10%]"),  # 1.5 and 13.5: row 1 of 15
    ("train[:50%]", "train[-50%:]"),
    ("train[:10%]", "train[-80%:]"),  # never
    ("train[1%:]", "train[:1%]"),
    ("train[10%:]", "train[:-90%]"),
    ("train[:90%]", "train[-5:]"),
    ("train[10:]", "train[:10%]"),
    ("train[2:]", "train[:2]"),
    ("train[:0]", "train"),
    ("train[-3:]", "train"),
]


@pytest.fixture(scope="module")
def split_rows(tmp_path_factory):
    """The oracle: the row ids datasets reads for ``(split expression, split length)``."""
    import datasets

    folder = tmp_path_factory.mktemp("split_rows")
    seen: dict[tuple[str, int], set[int]] = {}

    def rows(expr: str, n: int) -> set[int]:
        if (expr, n) not in seen:
            files = _jsonl(folder / f"{n}.jsonl", [{"i": i} for i in range(n)])
            try:
                ds = datasets.load_dataset(
                    "json", data_files=files, split=expr, cache_dir=str(folder / "cache")
                )
            except ValueError as err:  # datasets refuses a slice that reads no row
                assert "corresponds to no data" in str(err)
                seen[expr, n] = set()
            else:
                seen[expr, n] = set(ds["i"])
        return seen[expr, n]

    return rows


@pytest.mark.parametrize(("split", "val_split"), SPLIT_PAIRS)
def test_split_overlap_is_told_as_datasets_reads_the_rows(split_rows, split, val_split) -> None:
    """Negative and percent slices were taken as disjoint or not told apart (train[:-100] and
    train[-200:] read rows of one split without a warning). Checked against the rows datasets
    reads, at lengths where rounding and counting from the end matter: with the split's length
    known, exactly the rows both read; without it, rows shared for certain only where they are
    at every length at which neither is empty, rows that may be shared only at a length where
    they are (the one the message names), and silence only where none are."""
    from fot.data.loaders import _shared_rows

    lengths = (1, 9, 15, 101, 150, 250)
    for n in lengths:
        both = split_rows(split, n) & split_rows(val_split, n)
        told = _shared_rows(split, val_split, lambda name: [], lambda name, n=n: n)
        if both:
            assert told == (f"both read rows {min(both)}-{max(both)} of split train", True), n
        else:
            assert told is None, (n, told)
    told = _shared_rows(split, val_split, lambda name: [])
    shared = [n for n in lengths if split_rows(split, n) & split_rows(val_split, n)]
    if told is None:
        assert not shared
    elif told[1]:  # certain: at every length where neither is empty
        for n in lengths:
            if split_rows(split, n) and split_rows(val_split, n):
                assert n in shared, (n, told)
    else:
        m = re.search(r"of (\d+) rows, both would read rows (\d+)-(\d+)$", told[0])
        n, lo, hi = map(int, m.groups())
        assert n <= 1000, told  # a length the oracle can write out
        assert split_rows(split, n) & split_rows(val_split, n) == set(range(lo, hi + 1)), told


def test_split_overlap_warning_knows_the_length_of_the_loaded_split(tmp_path, caplog) -> None:
    """build_sources compares slices at the length of the split it loaded: train[:90%] and
    train[-10%:] share a row of 15 rows, none of 9."""
    warned = {}
    for n in (9, 15):
        rows = _jsonl(tmp_path / f"{n}.jsonl", [{"text": f"doc {i} " * 5} for i in range(n)])
        cfg = _cfg(kind="hf", path="json", hf_data_files=rows, hf_split="train[:90%]",
                   hf_val_split="train[-10%:]", seq_len=8, val_tokens=16)  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            build_sources(cfg)
        warned[n] = [w for w in _data_warnings(caplog) if "the training data" in w]
    assert warned[9] == []
    assert len(warned[15]) == 1
    assert (
        "reads rows of data.hf_split=train[:90%] (both read rows 13-13 of split train)"
        in (warned[15][0])
    )


def test_split_overlap_warning_sees_two_split_names_over_the_same_files(tmp_path, caplog) -> None:
    """data.hf_data_files mapping two split names to the same file: training on all of it and
    validating on a slice under the other name (train and validation[:10%]), or on slices of
    both that overlap, was taken for held-out data without a word. The same files in the same
    order are the same rows under both names; a whole split reads every row of its files."""
    a = _jsonl(tmp_path / "a.jsonl", [{"text": f"doc a{i} " * 5} for i in range(20)])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": f"doc b{i} " * 5} for i in range(20)])
    same, two = {"train": a, "validation": a}, {"train": [a, b], "validation": [b]}
    cases = [
        (same, "train", "validation[:10%]", "(the same files: "),
        (same, "train[:90%]", "validation[:10%]",
         "(both read rows 0-1 of splits train and validation, which read the same files)"),
        (same, "train[:-3]", "validation[-5:]", "both read rows 15-16 of splits train and"),
        (two, "train", "validation[:50%]", f"(the same files: {b})"),
        (same, "train[:90%]", "validation[90%:]", None),  # disjoint rows of the one file
        (two, "train[:50%]", "validation[:50%]", None),  # rows of a, rows of b
        ({"train": a, "validation": b}, "train", "validation[:10%]", None),
    ]  # fmt: skip
    for files, split, val_split, warning in cases:
        cfg = _cfg(kind="hf", path="json", hf_data_files=files, hf_split=split,
                   hf_val_split=val_split, seq_len=8, val_tokens=16)  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            build_sources(cfg)
        warned = [w for w in _data_warnings(caplog) if "the training data" in w]
        if warning is None:
            assert warned == [], (split, val_split, warned)
        else:
            assert len(warned) == 1 and warning in warned[0], (split, val_split, warned)


# ------------------------------------------------------------------ zarr arrays


def _zarr(path, values: np.ndarray, zarr_format: int = 3) -> np.ndarray:

    arr = new_array(str(path), shape=values.shape, dtype=values.dtype, zarr_format=zarr_format)
    arr[:] = values
    return values


def test_float_zarr_is_refused_like_a_float_npy(tmp_path) -> None:
    """A float zarr array was read with its values truncated to token ids (1.5 -> 1)."""
    _zarr(tmp_path / "f.zarr", np.full((4, 64), 1.5, dtype=np.float32))
    with pytest.raises(ValueError, match=r"f\.zarr holds float32 values, not integer token ids"):
        open_token_path(tmp_path / "f.zarr", 8, "causal")
    (tmp_path / "lc").mkdir()
    _zarr(tmp_path / "lc" / "train.zarr", np.full((4, 64), 1.5, dtype=np.float32))
    with pytest.raises(ValueError, match=r"train\.zarr holds float32 values, not integer"):
        build_sources(_cfg(kind="longcrawl64", path=str(tmp_path / "lc"), seq_len=8, val_tokens=0))
    np.save(tmp_path / "f.npy", np.full(64, 1.5, dtype=np.float32))  # the message it mirrors
    with pytest.raises(ValueError, match=r"f\.npy holds float32 values, not integer token ids"):
        open_token_path(tmp_path / "f.npy", 8, "causal")


@pytest.mark.parametrize("zarr_format", [2, 3])
def test_zarr_array_folder_without_suffix_is_read_as_zarr(tmp_path, zarr_format: int) -> None:
    """A zarr v2 array folder (.zarray) without the .zarr suffix was called "not a token
    folder (no meta.json)"; a v3 one (zarr.json) was already detected."""
    rows = (np.arange(4 * 64) % 50000).astype(np.uint16).reshape(4, 64)
    _zarr(tmp_path / "arr", rows, zarr_format)
    src = open_token_path(tmp_path / "arr", 8, "causal")
    assert isinstance(src, ZarrRowsSource)
    inputs, labels = src.read(0, 5)  # column-major: chunk 0 of rows 0..3, then chunk 1 of row 0
    np.testing.assert_array_equal(labels[:4], rows[:, :8])
    np.testing.assert_array_equal(labels[4], rows[0, 8:16])
    np.testing.assert_array_equal(inputs[:, 0], [EOT_ID] * 5)


def test_zarr_packing_padded_is_refused_and_varlen_warns(tmp_path, caplog) -> None:
    """data.packing was ignored for zarr sources: padded read unpadded chunks, silently."""
    rows = (np.arange(4 * 64) % 50000).astype(np.uint16).reshape(4, 64)
    (tmp_path / "lc").mkdir()
    _zarr(tmp_path / "lc" / "train.zarr", rows)
    _zarr(tmp_path / "lc" / "heldout.zarr", rows[:2])
    tokens = dict(kind="tokens", path=str(tmp_path / "lc" / "train.zarr"))
    lc = dict(kind="longcrawl64", path=str(tmp_path / "lc"))
    for kw in (tokens, lc):
        with pytest.raises(ValueError, match=r"packing=padded needs document boundaries.*causal"):
            build_sources(_cfg(seq_len=8, val_tokens=16, packing="padded", **kw))
        for packing, warnings in (("varlen", 1), ("causal", 0)):
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                train, _ = build_sources(_cfg(seq_len=8, val_tokens=0, packing=packing, **kw))
            warned = [
                w for w in _data_warnings(caplog) if "packed as with data.packing=causal" in w
            ]
            assert len(warned) == warnings, (kw, packing)
            assert not getattr(train, "varlen", False)  # no cu_seqlens: causal packing
            np.testing.assert_array_equal(train.read(0, 1)[1][0], rows[0, :8])
