"""Bad data, damaged result files and meaningless values given to ``python -m fot.eval``.

Each must stop with one error naming the bad value and the fix: not a traceback from inside
zarr, numpy or torch (a KeyError, a BadZipFile, an IndexError in the embedding), not a process
killed for memory, and not a silently wrong result (float data read as token 0, an overlap of
S and I in the forgetting curve, an empty --text replaced by the sample corpus).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from eval_helpers import VOCAB, make_llama_checkpoint
from zarr_arrays import new_array

from fot.eval.__main__ import main
from fot.eval.forgetting_curve import sample_pair

PTL = ["--length", "64", "--max-docs", "1", "--device", "cpu"]
FC = ["--lengths", "64", "--repeats", "1", "--device", "cpu"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")


def _zarr(path, values):
    """A 2-D zarr array of ``values`` (documents x tokens), as LongCrawl64's heldout.zarr."""
    values = np.asarray(values)
    arr = new_array(str(path), shape=values.shape, dtype=values.dtype)
    arr[:] = values
    return path


@pytest.mark.parametrize("command", ["per-token-loss", "forgetting-curve"])
def test_a_folder_zarr_cannot_read_is_named(tmp_path, command):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / ".zarray").write_text("{}")  # was: KeyError 'zarr_format' from inside zarr
    args = PTL if command == "per-token-loss" else FC
    with pytest.raises(ValueError, match=rf"--data '{re.escape(str(fake))}'.*not a readable zarr"):
        main([command, str(tmp_path / "missing"), *args, "--data", str(fake),
              "--out", str(tmp_path / "o")])  # fmt: skip


@pytest.mark.parametrize("command", ["per-token-loss", "forgetting-curve"])
def test_text_files_as_data_are_named_with_the_command_that_tokenizes_them(
    tmp_path, monkeypatch, command
):
    """A folder of .txt files was refused as "neither a token folder nor a zarr array", with no
    fix; the error now gives the fot.data.prepare command, whose folder the next run takes."""
    from fot.data.prepare import main as prepare

    monkeypatch.chdir(tmp_path)
    Path("texts").mkdir()
    Path("texts/a.txt").write_text("It was a bright cold day in April. " * 20)
    args = PTL if command == "per-token-loss" else FC
    argv = [command, str(tmp_path / "missing"), *args, "--out", str(tmp_path / "o")]
    with pytest.raises(ValueError) as err:
        main([*argv, "--data", "texts"])
    fix = "python -m fot.data.prepare texts --out texts_tokens, then pass --data texts_tokens"
    assert str(err.value).endswith(fix), err.value
    assert prepare(["texts", "--out", "texts_tokens"]) == 0
    with pytest.raises(FileNotFoundError, match="missing"):  # past the data: the checkpoint
        main([*argv, "--data", "texts_tokens"])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["per-token-loss", "forgetting-curve"])
def test_a_file_of_a_token_folder_as_data_names_the_folder(tmp_path, monkeypatch, command):
    """--data <token folder>/tokens.bin was told to tokenize it with fot.data.prepare, which
    refuses a binary file; the folder itself is what --data takes."""
    from fot.data.prepare import main as prepare

    monkeypatch.chdir(tmp_path)
    Path("texts").mkdir()
    Path("texts/a.txt").write_text("It was a bright cold day in April. " * 20)
    assert prepare(["texts", "--out", "mine"]) == 0
    args = PTL if command == "per-token-loss" else FC
    argv = [command, str(tmp_path / "missing"), *args, "--out", str(tmp_path / "o")]
    for name in ("tokens.bin", "doc_offsets.npy", "meta.json"):
        with pytest.raises(ValueError) as err:
            main([*argv, "--data", f"mine/{name}"])
        assert str(err.value) == (
            f"--data 'mine/{name}' is a file of the token folder mine, which is read whole: "
            "pass --data mine"
        )
    with pytest.raises(FileNotFoundError, match="missing"):  # past the data: the checkpoint
        main([*argv, "--data", "mine"])
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("bad", [99_999, -1])
@pytest.mark.parametrize("command", ["per-token-loss", "forgetting-curve"])
def test_token_ids_outside_the_vocabulary_are_named(llama, tmp_path, command, bad):
    rows = np.random.default_rng(0).integers(0, 1000, size=(2, 100))
    rows[0, 10] = bad  # was: IndexError inside torch.embedding
    data = _zarr(tmp_path / "z.zarr", rows)
    args = PTL if command == "per-token-loss" else FC
    with pytest.raises(ValueError, match=rf"--data .*z\.zarr.* token id {bad}, .*of {VOCAB} ids"):
        main([command, str(llama), *args, "--data", str(data), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()  # nor its run_config.json and resume record
    # the failed run left no results, so it does not keep the other command out of its --out
    # (a failed per-token-loss used to make forgetting-curve refuse the folder)
    other = "forgetting-curve" if command == "per-token-loss" else "per-token-loss"
    assert main([other, str(llama), *(FC if other == "forgetting-curve" else PTL),
                 "--out", str(tmp_path / "o")])  # fmt: skip


@pytest.mark.parametrize("command", ["per-token-loss", "forgetting-curve"])
def test_float_data_is_refused_not_read_as_token_ids(tmp_path, command):
    data = _zarr(tmp_path / "f.zarr", np.full((2, 100), 0.5, dtype=np.float32))
    args = PTL if command == "per-token-loss" else FC
    with pytest.raises(ValueError, match=r"f\.zarr' holds float32 values, not token ids"):
        main([command, str(tmp_path / "missing"), *args, "--data", str(data),
              "--out", str(tmp_path / "o")])  # fmt: skip


def test_a_damaged_resume_state_is_named_with_the_fix(llama, tmp_path):
    out = tmp_path / "o"
    main(["per-token-loss", str(llama), *PTL, "--out", str(out)])
    state = out / "state.npz"
    state.write_bytes(state.read_bytes()[:100])  # cut short, e.g. by a full disk
    with pytest.raises(ValueError, match=r"state\.npz' is damaged .*--restart.*another --out"):
        main(["per-token-loss", str(llama), *PTL, "--out", str(out)])  # was: BadZipFile
    main(["per-token-loss", str(llama), *PTL, "--out", str(out), "--restart"])  # the way out
    assert (out / "summary.json").is_file()


def test_a_damaged_overlay_is_named_before_the_evaluation(llama, tmp_path):
    old = tmp_path / "old"
    main(["per-token-loss", str(llama), *PTL, "--out", str(old)])
    npz = old / "per_token_loss.npz"
    npz.write_bytes(npz.read_bytes()[:200])
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"per_token_loss\.npz' is damaged.*re-run that"):
        main(["per-token-loss", str(llama), *PTL, "--overlay", f"a={old}", "--out", str(out)])
    assert not (out / "state.npz").exists()  # refused before, not after, the evaluation


def test_overlays_each_after_its_own_flag_are_all_drawn(llama, tmp_path, monkeypatch):
    """`--overlay a=DIR1 --overlay b=DIR2` (two models compared in one plot) drew only the last
    one, without a word: argparse kept the last flag's list. Each flag now adds its items, as
    one flag listing both does. Oracle: the label=folder pairs given."""
    import fot.eval.per_token_loss as ptl

    runs = {name: tmp_path / name for name in ("one", "two")}
    for folder in runs.values():
        main(["per-token-loss", str(llama), *PTL, "--out", str(folder)])
    drawn = []
    real = ptl.plot_per_token_loss
    monkeypatch.setattr(
        ptl, "plot_per_token_loss", lambda r, *a, **k: drawn.append(r) or real(r, *a, **k)
    )
    want = {"this": tmp_path / "o", "a": runs["one"], "b": runs["two"]}
    for overlays in (["--overlay", f"a={runs['one']}", "--overlay", f"b={runs['two']}"],
                     ["--overlay", f"a={runs['one']}", f"b={runs['two']}"]):  # fmt: skip
        main(["per-token-loss", str(llama), *PTL, "--label", "this", *overlays,
              "--out", str(tmp_path / "o")])  # fmt: skip
        assert {k: Path(v) for k, v in drawn.pop().items()} == want
    # one run under two labels, or this run's own --out as an overlay, drew it twice as if two
    # runs: refused before the evaluation, naming the overlay
    twice = ["--overlay", f"a={runs['one']}", f"b={runs['one']}/../one"]
    with pytest.raises(ValueError, match=r"^--overlay 'b=.*' is the run of --overlay label 'a'"):
        main(["per-token-loss", str(llama), *PTL, *twice, "--out", str(tmp_path / "o")])
    with pytest.raises(ValueError, match=r"^--overlay mine=.* is this run's own --out"):
        main(["per-token-loss", str(llama), *PTL, "--overlay", f"mine={tmp_path / 'o'}",
              "--out", str(tmp_path / "o")])  # fmt: skip
    assert drawn == []


def test_an_overlay_that_is_a_file_is_called_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x\n")
    with pytest.raises(NotADirectoryError, match=r"'a=.*afile'.*is a file, not a folder"):
        main(["per-token-loss", str(tmp_path / "missing"), *PTL, "--overlay", f"a={afile}",
              "--out", str(tmp_path / "o")])  # fmt: skip


def test_an_overlay_folder_or_label_holding_an_equals_sign_is_kept_whole(tmp_path):
    """A sweep's folder `ov/lr=3e-4` was cut at its last '=' (label 'ov/lr', folder '3e-4');
    the item is now split where it names an existing folder, so either side may hold '='."""
    from fot.eval.per_token_loss import parse_overlays

    swept, plain = tmp_path / "ov" / "lr=3e-4", tmp_path / "plain"
    for folder in (swept, plain):
        folder.mkdir(parents=True)
        np.savez(folder / "per_token_loss.npz", position=np.arange(1, 3), loss=np.ones(2),
                 p_length=np.array([2]), perplexity=np.array([np.e]))  # fmt: skip
    assert parse_overlays([str(swept)]) == {"lr=3e-4": swept}  # bare DIR
    assert parse_overlays([f"fot={swept}"]) == {"fot": swept}
    assert parse_overlays([f"model=fot_pro,seed=1={plain}"]) == {"model=fot_pro,seed=1": plain}
    assert parse_overlays([f"lr=3e-4={swept}"]) == {"lr=3e-4": swept}
    # nothing there: split at the first '=', the folder named in full
    missing = tmp_path / "ov" / "lr=1e-3"
    with pytest.raises(FileNotFoundError, match=re.escape(f": '{missing}' does not exist")):
        parse_overlays([f"fot={missing}"])


def test_forgetting_curve_lengths_beyond_the_data_are_refused(tmp_path):
    out = tmp_path / "o"  # was: killed for memory, tiling the corpus to 4e9 tokens
    with pytest.raises(
        ValueError, match=r"--lengths up to 1000000000 .* --data 'sample' holds \d+"
    ):
        main(["forgetting-curve", str(tmp_path / "missing"), "--lengths", "1000000000",
              "--out", str(out)])  # fmt: skip
    assert not out.exists()


def test_forgetting_curve_spans_of_a_short_stream_never_overlap():
    n = 50
    stream = np.arange(2 * n + 7)  # every token distinct: shared text shows as shared ids
    for seed in range(200):
        s, i = sample_pair(stream, n, np.random.default_rng(seed))
        assert len(s) == len(i) == n and not set(s.tolist()) & set(i.tolist())
    with pytest.raises(ValueError, match=r"need 100 tokens of text, the data holds 99"):
        sample_pair(stream[:99], n, np.random.default_rng(0))


def test_needle_lengths_beyond_the_haystack_are_refused(llama, tmp_path):
    hay = tmp_path / "hay.txt"
    hay.write_text("The river runs past the old mill. " * 20)  # ~160 tokens: was repeated
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"needs \d+ haystack tokens, but --haystack .* holds \d+"):
        main(["needle", str(llama), "--lengths", "128,1k", "--haystack", str(hay),
              "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert not out.exists()


def test_haystack_files_each_after_its_own_flag_are_all_read(llama, tmp_path):
    """`--haystack a.txt --haystack b.txt` read only b.txt, without a word (argparse kept the
    last flag's list): here too short alone. Each flag now adds its files, as one flag listing
    both does. Oracle: the files given, in the resume record."""
    hay = [tmp_path / "a.txt", tmp_path / "b.txt"]
    hay[0].write_text("The heron waits by the weir. " * 20)  # ~160 tokens each: 256 needs both
    hay[1].write_text("The river runs past the old mill. " * 20)
    out = tmp_path / "o"
    main(["needle", str(llama), "--lengths", "256", "--depths", "50", "--max-new-tokens", "1",
          "--haystack", str(hay[0]), "--haystack", str(hay[1]), "--device", "cpu",
          "--out", str(out)])  # fmt: skip
    record = json.loads((out / "needle_easy.resume.json").read_text())
    assert record["settings"]["--haystack"] == [str(h.resolve()) for h in hay]


def test_needle_lengths_no_memory_can_hold_are_refused(llama, tmp_path):
    out = tmp_path / "o"  # was: killed for memory building the prompt
    with pytest.raises(ValueError, match=r"1000000000007 tokens: .* GiB, more than the .* GiB"):
        main(["needle", str(llama), "--mode", "passkey", "--lengths", "1000000000000",
              "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gates", "--text", ""], "--text '' holds no text"),  # was: the sample corpus
        (["gates", "--text", "  \n"], r"--text '  \\n' holds no text"),
        (["gates", "--layers", "0,,1"], "--layers '0,,1' has an empty item"),
        (["per-token-loss", "--train-length", "0"], "--train-length must be >= 1 tokens, got 0"),
        (["per-token-loss", "--train-length=-4"], "--train-length must be >= 1 tokens, got -4"),
        (["per-token-loss", "--length", "64,128"], "--length '64,128': expected one length"),
        (["needle", "--train-length", "0"], "--train-length must be >= 1 tokens, got 0"),
        (["forgetting-curve", "--train-length=-4"], "--train-length must be >= 1 tokens, got -4"),
        (["needle", "--lengths", "256,,512"], "--lengths '256,,512' has an empty item"),
        (["needle", "--depths", "0,,50"], "--depths '0,,50' has an empty item"),
        (["forgetting-curve", "--lengths", "256,,512"], "--lengths '256,,512' has an empty item"),
        (["forgetting-curve", "--seed", "-1"], "--seed must be >= 0, got -1"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_meaningless_values_are_refused_before_the_model_loads(tmp_path, argv, message):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=message):
        main([argv[0], str(tmp_path / "missing"), *argv[1:], "--out", str(out)])
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "holds no text"),
        (b" \n\t\n", "holds no text"),
        # read with replacement characters before, and analysed without a word
        ("Le caf\u00e9 \u00e9tait bon.".encode("latin-1"), r"is not UTF-8 text \(byte 6\)"),
        (b"\x00\x01tokens", "holds NUL bytes: it is binary"),
    ],
    ids=["empty", "whitespace", "latin-1", "binary"],
)
def test_gates_text_file_without_text_is_refused(tmp_path, content, message):
    text = tmp_path / "story.txt"
    text.write_bytes(content)
    with pytest.raises(ValueError, match=rf"--text-file '.*story\.txt' {message}"):
        main(["gates", str(tmp_path / "missing"), "--text-file", str(text),
              "--out", str(tmp_path / "o")])  # fmt: skip


def test_smooth_below_one_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["per-token-loss", str(tmp_path / "missing"), "--smooth", "-3", "--out", "o"])
    assert exit_.value.code == 2
    assert "argument --smooth: expected an integer >= 1, got '-3'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"  \n\n \t\n", r"holds no text \(only whitespace\)"),
        (b"text\x00\x01\x02 more", r"hay\.txt' holds NUL bytes: it is binary"),
        (b"caf\xe9 au lait\n", r"hay\.txt' is not UTF-8 text \(byte 3\)"),
    ],
    ids=["whitespace", "nul-bytes", "not-utf8"],
)
def test_needle_haystack_that_is_not_text_is_refused(tmp_path, content, message):
    hay = tmp_path / "hay.txt"
    hay.write_bytes(content)
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=message):
        main(["needle", str(tmp_path / "missing"), "--haystack", str(hay), "--out", str(out)])
    assert not out.exists()


def test_eval_text_files_drop_a_byte_order_mark_as_prepare_does(tmp_path):
    """Windows editors start UTF-8 files with a byte-order mark: ``fot.data.prepare`` drops it
    from training text, but a needle haystack or gates ``--text-file`` kept it (U+FEFF: three
    byte tokens in front of the text). Oracle: prepare's tokens of the same file."""
    from fot.data.prepare import iter_texts, tokenize
    from fot.eval.common import read_text_file
    from fot.tokenizer import get_encoding

    hay = tmp_path / "hay.txt"
    hay.write_bytes(b"\xef\xbb\xbfThe grass is green.\r\n")
    text = read_text_file(hay, "--haystack file")
    assert text == "The grass is green.\r\n"
    trained = [d.tolist() for d in tokenize(iter_texts([str(hay)]))]
    assert trained == [get_encoding().encode_ordinary(text)]


def test_longbench_row_without_answers_names_file_and_line(tmp_path):
    data = tmp_path / "lb"
    data.mkdir()
    classes = ["Abbreviation", "Entity"]
    good = {"_id": "t0", "input": "q", "context": "c", "answers": ["a"], "all_classes": classes}
    bad = {"_id": "t1", "input": "q", "context": "c", "all_classes": classes}
    (data / "trec.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    out = tmp_path / "o"  # was: "trec example None has no answers" after the generation
    with pytest.raises(ValueError, match=re.escape(f"{data / 'trec.jsonl'}:2 has no answers")):
        main(["longbench", str(tmp_path / "missing"), "--data-dir", str(data), "--tasks", "trec",
              "--out", str(out)])  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize(
    ("task", "row", "field"),
    [
        ("hotpotqa", {"question": "q", "context": "c"}, "input"),  # renamed field
        ("gov_report", {"input": "", "contexts": ["c"]}, "context"),
        ("qasper", {"input": "q", "context": ["c1", "c2"]}, "context"),  # not a string
    ],
)
def test_longbench_row_without_its_prompt_text_names_file_line_and_field(
    tmp_path, task, row, field
):
    """A row without the text its prompt is built from was read as an empty string: the
    model was asked the question without the document (or the reverse) and scored."""
    data = tmp_path / "lb"
    data.mkdir()
    good = {"_id": "t0", "input": "q", "context": "c", "answers": ["a"]}
    (data / f"{task}.jsonl").write_text(
        json.dumps(good) + "\n" + json.dumps({"_id": "t1", "answers": ["a"], **row}) + "\n"
    )
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=re.escape(f"{data / f'{task}.jsonl'}:2 has no {field}")):
        main(["longbench", str(tmp_path / "missing"), "--data-dir", str(data), "--tasks", task,
              "--out", str(out)])  # fmt: skip
    assert not out.exists()


def test_a_default_length_too_long_for_the_data_says_where_it_came_from(tmp_path):
    """Without --length the run takes the checkpoint's context length; data shorter than that
    used to be told to "lower --length", which the user never gave."""
    short = make_llama_checkpoint(tmp_path / "short", max_len=96)
    data = _zarr(tmp_path / "z.zarr", np.random.default_rng(0).integers(0, 1000, size=(2, 50)))
    with pytest.raises(ValueError, match=r"at least 96 tokens \(--length was not given: 96 is "
                                         r"the checkpoint's max_position_embeddings: the most "
                                         r"positions it takes, not a length it was"):  # fmt: skip
        main(["per-token-loss", str(short), "--data", str(data), "--device", "cpu",
              "--out", str(tmp_path / "o")])  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "bad"),
    [
        (["needle", "--lengths", "1k,inf"], "inf"),  # was an OverflowError traceback
        (["forgetting-curve", "--lengths", "1e400"], "1e400"),
        (["needle", "--depths", "0,nan"], "nan"),  # passed every check before the model
        (["needle", "--depths=-inf,50"], "-inf"),
        (["needle", "--lengths", "1k,100.7"], "100.7"),  # was cut to 100 silently
        (["forgetting-curve", "--lengths", "1.1k"], "1.1k"),  # 1126.4 tokens
    ],
)
def test_non_finite_numbers_in_a_list_option_are_named(tmp_path, argv, bad):
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        main([argv[0], str(tmp_path / "missing"), *argv[1:], "--out", str(out)])
    assert not out.exists()


def test_forgetting_curve_odd_lengths_are_refused(tmp_path):
    # [bos] S [bos] S has 2n + 2 tokens with n = (L - 2) // 2: an odd L was scored at L - 1
    # tokens and recorded as L
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"--lengths must be even .* got 65, 129; use e.g. 66"):
        main(["forgetting-curve", str(tmp_path / "missing"), "--lengths", "64,65,129",
              "--out", str(out)])  # fmt: skip
    assert not out.exists()


def test_longbench_file_that_is_not_utf8_names_the_file(tmp_path):
    """LongBench files are UTF-8; another encoding failed with a bare codec error naming no
    file (or, under a non-UTF-8 locale, was read as other characters)."""
    data = tmp_path / "lb"
    data.mkdir()
    row = {"_id": "t0", "input": "Où?", "context": "café", "answers": ["café"]}
    (data / "hotpotqa.jsonl").write_bytes(
        (json.dumps(row, ensure_ascii=False) + "\n").encode("latin-1")
    )
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=re.escape(f"{data / 'hotpotqa.jsonl'}:1 is not UTF-8")):
        main(["longbench", str(tmp_path / "missing"), "--data-dir", str(data), "--tasks",
              "hotpotqa", "--out", str(out)])  # fmt: skip
    assert not out.exists()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_longbench_data_dir_that_is_no_folder_is_named(tmp_path, kind):
    data = tmp_path / "lbx"  # a mistyped --data-dir: was "lbx lacks ['trec.jsonl']"
    if kind == "file":
        data.write_text("not a folder")
    out = tmp_path / "o"
    what = "is a file, not a folder" if kind == "file" else "does not exist"
    with pytest.raises(FileNotFoundError, match=re.escape(f"--data-dir '{data}' {what}")):
        main(["longbench", str(tmp_path / "missing"), "--data-dir", str(data), "--tasks", "trec",
              "--out", str(out)])  # fmt: skip
    assert not out.exists()
    if kind == "file":
        assert data.read_text() == "not a folder"


def test_longbench_missing_task_files_suggest_the_tasks_the_folder_has(tmp_path):
    """With the default --tasks (the paper's 14) and a folder holding only some of the files,
    the error names the missing files and a --tasks value of the ones there, which parses to
    exactly the present tasks, in the set's order."""
    from fot.eval.longbench import PAPER_TASKS, parse_tasks

    data = tmp_path / "lb"
    data.mkdir()
    have = [PAPER_TASKS[5], PAPER_TASKS[1]]
    for t in have:
        (data / f"{t}.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match=r"run the tasks it has with --tasks (\S+)$") as e:
        main(["longbench", str(tmp_path / "ckpt"), "--data-dir", str(data), "--out",
              str(tmp_path / "o")])  # fmt: skip
    suggested = re.search(r"--tasks (\S+)$", str(e.value)).group(1)
    assert parse_tasks(suggested) == [PAPER_TASKS[1], PAPER_TASKS[5]]
    lacking = [f"{t}.jsonl" for t in PAPER_TASKS if t not in have]
    assert f"lacks {lacking}" in str(e.value)
    (data / f"{have[0]}.jsonl").unlink()
    (data / f"{have[1]}.jsonl").unlink()
    with pytest.raises(FileNotFoundError) as e:  # nothing there: nothing to suggest
        main(["longbench", str(tmp_path / "ckpt"), "--data-dir", str(data), "--out",
              str(tmp_path / "o")])  # fmt: skip
    assert "--tasks" not in str(e.value)


@pytest.mark.parametrize("command", ["per-token-loss", "forgetting-curve", "needle"])
def test_an_out_inside_the_data_folder_is_refused_before_anything_is_written(
    llama, tmp_path, command
):
    """Results written into the --data (or --haystack) folder changed its fingerprint: the run
    finished, and every rerun was refused as one of other data (`the content of ... has
    changed since`), --restart included. The folder it names instead resumes."""
    from fot.data.tokens import write_token_documents

    rng = np.random.default_rng(0)
    data = tmp_path / "tok"
    write_token_documents(data, [rng.integers(0, 1000, 200) for _ in range(3)])
    (tmp_path / "hay").mkdir()
    (tmp_path / "hay" / "book.txt").write_text("The river ran by the old mill. " * 200)
    option, folder, argv = {
        "per-token-loss": ("--data", data, ["--length", "64"]),
        "forgetting-curve": ("--data", data, ["--lengths", "32", "--repeats", "1"]),
        "needle": ("--haystack", tmp_path / "hay",
                   ["--lengths", "96", "--depths", "50", "--max-new-tokens", "1"]),
    }[command]  # fmt: skip
    argv = [command, str(llama), option, str(folder), *argv, "--device", "cpu"]
    inside = folder / "eval"
    with pytest.raises(ValueError, match=f"--out '{inside}' is inside {option} ") as info:
        main([*argv, "--out", str(inside)])
    assert not inside.exists()
    suggested = re.search(r"e\.g\. '(.+)'$", str(info.value)).group(1)
    assert suggested == f"{folder}_eval"
    first = main([*argv, "--out", suggested])
    assert main([*argv, "--out", suggested]) == first  # resumed, not refused


@pytest.mark.parametrize("command", ["per-token-loss", "needle", "forgetting-curve"])
def test_an_empty_train_length_is_refused_not_taken_as_the_default(tmp_path, command):
    """--train-length "" (a script's unset variable) was read as no --train-length at all,
    the model's context length marked on the plot; it is refused now, naming the option."""
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"--train-length '': expected one length in tokens"):
        main([command, str(tmp_path / "missing"), "--train-length", "", "--out", str(out)])
    assert not out.exists()


def test_an_empty_length_of_per_token_loss_is_refused_not_taken_as_the_default(tmp_path):
    """per-token-loss --length "" was read as no --length (the model's context length); it is
    refused as --train-length "" is, naming the option."""
    out = tmp_path / "o"
    with pytest.raises(ValueError, match=r"--length '': expected one length in tokens"):
        main(["per-token-loss", str(tmp_path / "missing"), "--length", "", "--out", str(out)])
    assert not out.exists()
