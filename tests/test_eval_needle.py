"""Needle/passkey prompt builders and the objective scorer; forgetting-curve oracles."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from eval_helpers import CopyOracle, RandomLogits

from fot.eval.common import JsonlLog
from fot.eval.forgetting_curve import build_pair, memory_lengths, run_curve, summarize
from fot.eval.needle import (
    DEFAULT_NEEDLE,
    build_prompt,
    load_wording,
    plot_heatmap,
    score_response,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from fot.tokenizer import save_hf_tokenizer

    return AutoTokenizer.from_pretrained(save_hf_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def haystack(tokenizer):
    from fot.data.sample import sample_texts

    return tokenizer.encode(sample_texts()[0][:30_000], add_special_tokens=False)


@pytest.mark.parametrize("mode", ["easy", "standard", "passkey"])
@pytest.mark.parametrize("length", [300, 1000])
def test_needle_at_requested_depth_and_length(tokenizer, haystack, mode, length):
    for depth in (0.0, 25.0, 50.0, 75.0, 100.0):
        p = build_prompt(
            tokenizer,
            haystack,
            context_length=length,
            depth=depth,
            mode=mode,
            passkey="48213",
            bos_id=50256,
        )
        assert len(p.input_ids) == length
        assert p.input_ids[0] == 50256
        needle_text = tokenizer.decode(p.input_ids[p.needle_start : p.needle_end])
        assert ("48213" if mode == "passkey" else "Dolores Park") in needle_text
        # Realised depth: position of the needle inside the haystack tokens.
        realised = 100.0 * (p.needle_start - p.haystack_start) / p.haystack_len
        assert realised == pytest.approx(p.actual_depth)
        assert abs(realised - depth) <= 100.0 * max(16, p.haystack_len // 100) / p.haystack_len
        assert realised <= depth + 1e-9  # moved back to a sentence end, never forward
        # The needle sits after a sentence/line end unless at the very start.
        if 0 < p.needle_start - p.haystack_start < p.haystack_len and depth not in (0.0, 100.0):
            before = tokenizer.decode(p.input_ids[p.needle_start - 1 : p.needle_start])
            assert before.rstrip(" ").endswith((".", "!", "?", "\n"))
        # Question at the end.
        tail = tokenizer.decode(p.input_ids[p.needle_end :])
        assert tail.endswith("The pass key is" if mode == "passkey" else "Answer:")
    with pytest.raises(ValueError, match="no room"):
        build_prompt(tokenizer, haystack, context_length=20, depth=50, mode=mode, passkey="1")
    with pytest.raises(ValueError, match="depth"):
        build_prompt(tokenizer, haystack, context_length=500, depth=150, mode=mode, passkey="1")


def test_a_prompt_template_gives_the_prompts_wording(tokenizer, haystack, tmp_path):
    """--prompt-template: the text before the haystack, the needle and the text after it are
    the template's, filled with the needle's question and answer (here an answer stem for the
    model to continue, as the FoX paper's prompts end)."""
    stem = "The best thing to do in San Francisco is"
    template = tmp_path / "wording.json"
    template.write_text(
        json.dumps(
            {
                "prefix": "A long text {{with braces}} follows.\n",
                "needle": "\n{question} Answer: {answer}\n",
                "suffix": f"\n\nRecall the hidden fact. {{question}} Answer: {stem}",
            }
        )
    )
    needle = dataclasses.replace(DEFAULT_NEEDLE, wording=load_wording(template))
    q, a = DEFAULT_NEEDLE.question, DEFAULT_NEEDLE.answer

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    suffix = enc(f"\n\nRecall the hidden fact. {q} Answer: {stem}")
    for mode in ("easy", "standard"):
        p = build_prompt(
            tokenizer, haystack, context_length=400, depth=50.0, mode=mode, needle=needle,
            bos_id=50256,
        )  # fmt: skip
        assert len(p.input_ids) == 400
        assert p.input_ids[: p.haystack_start] == [
            50256,
            *enc("A long text {with braces} follows.\n"),
        ]
        assert p.input_ids[p.needle_start : p.needle_end] == enc(f"\n{q} Answer: {a}\n")
        assert p.input_ids[len(p.input_ids) - len(suffix) :] == suffix
        assert p.haystack_start + p.haystack_len + len(enc(f"\n{q} Answer: {a}\n")) == 400 - len(
            suffix
        )
        assert p.reference == a and p.key_phrases == DEFAULT_NEEDLE.key_phrases


@pytest.mark.parametrize(
    ("content", "error"),
    [
        ("not json", "is not JSON"),
        ('["needle"]', "must be a JSON object with needle and suffix, e.g."),
        ('{"needle": "{answer}"}', "must be a JSON object with needle and suffix"),
        ('{"needle": "{answer}", "suffix": "?", "question": "?"}', r"has \['question'\]: its keys"),
        ('{"needle": "{answer}", "suffix": "{query}"}', r"names \['query'\]: only \{question\}"),
        ('{"needle": "{question}", "suffix": "?"}', r"has no \{answer\}: the needle is the text"),
        ('{"needle": "{answer}", "suffix": "a } b"}', "is not a format string .* as {{ and }}"),
        ('{"needle": "{answer}", "suffix": "{0}"}', r"names \['0'\]"),
        # the needle would be hidden cut, quoted or padded (a cut one cannot score 10)
        ('{"needle": "{answer:.5}", "suffix": "?"}', r"has \['\{answer:.5\}'\]: write"),
        ('{"needle": "{answer!r}", "suffix": "?"}', r"has \['\{answer!r\}'\]"),
        ('{"needle": "{answer}", "suffix": "{question:{answer}}"}', "without a conversion"),
        ('{"needle": "{answer}", "suffix": 3}', "the suffix template must be a string, got 3"),
    ],
)
def test_bad_prompt_templates_are_named(tmp_path, content, error):
    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=rf"^--prompt-template '{path}'.*{error}"):
        load_wording(path)
    with pytest.raises(ValueError, match="cannot be read"):
        load_wording(tmp_path / "missing.json")


def test_needle_lands_at_the_exact_depth_token(tokenizer, haystack):
    """The insertion point is floor(depth% of the haystack); depth / 100 * budget in floats
    put it one token early where the product is an integer (29 / 100 * 100 = 28.999...)."""
    probe = build_prompt(tokenizer, haystack, context_length=300, depth=0.0, snap_tokens=0)
    overhead = 300 - probe.haystack_len
    for budget, depth, point in [(100, 29.0, 29), (100, 57.0, 57), (100, 58.0, 58),
                                 (1000, 70.0, 700), (200, 12.5, 25), (7, 50.0, 3)]:  # fmt: skip
        p = build_prompt(
            tokenizer, haystack, context_length=overhead + budget, depth=depth, snap_tokens=0
        )
        assert p.haystack_len == budget
        assert p.needle_start - p.haystack_start == point
        assert p.actual_depth == pytest.approx(100.0 * point / budget)


def test_a_cell_prompt_does_not_depend_on_the_other_lengths(
    tokenizer, haystack, monkeypatch, tmp_path
):
    """More --lengths read more haystack text; a repeated cell's haystack offset used to be
    drawn over all of it, so cell (256, 50%, repeat 1) got another prompt when 2k was added."""
    import fot.eval.needle as needle_mod

    prompts: dict[tuple[int, int], list[int]] = {}
    real = needle_mod.build_prompt

    def recording(tok, hay, *, context_length, **kw):
        p = real(tok, hay, context_length=context_length, **kw)
        prompts[(len(grid), context_length)] = p.input_ids
        return p

    monkeypatch.setattr(needle_mod, "build_prompt", recording)
    monkeypatch.setattr(needle_mod, "greedy_generate", lambda *a, **k: [])
    model = torch.nn.Linear(1, 1)
    for grid, n_hay in (([256], 2_000), ([256, 2048], len(haystack))):
        log = JsonlLog(tmp_path / f"{len(grid)}.jsonl")
        needle_mod.run_grid(model, tokenizer, lengths=grid, depths=[50.0], mode="standard",
                            log=log, haystack_ids=haystack[:n_hay], repeats=2, progress=False)  # fmt: skip
    assert len(haystack) > 5_000
    assert prompts[(1, 256)] == prompts[(2, 256)]
    assert len(prompts[(1, 256)]) == 256


def test_depths_whose_saved_keys_collide_are_refused(tokenizer, haystack, monkeypatch, tmp_path):
    """Cells are keyed f"{L}:{depth:g}:{repeat}" (6 significant digits): 33.3333331 and
    33.3333332 passed as two depths, and the second was skipped as done. They are refused,
    naming both, before the model loads; depths apart within 6 digits each get their cell."""
    import fot.eval.needle as needle_mod
    from fot.eval.__main__ import main

    out = tmp_path / "o"
    with pytest.raises(
        ValueError, match=r"--depths: 33\.3333331 and 33\.3333332 are both saved as 33\.3333 "
    ):
        main(["needle", str(tmp_path / "no_ckpt"), "--depths", "33.3333331,50,33.3333332",
              "--out", str(out)])  # fmt: skip
    assert not out.exists()
    monkeypatch.setattr(needle_mod, "greedy_generate", lambda *a, **k: [])
    model = torch.nn.Linear(1, 1)
    with pytest.raises(ValueError, match=r"both saved as 33\.3333"):
        needle_mod.run_grid(model, tokenizer, lengths=[256], depths=[33.3333331, 33.3333332],
                            mode="standard", log=JsonlLog(tmp_path / "a.jsonl"),
                            haystack_ids=haystack, progress=False)  # fmt: skip
    records = needle_mod.run_grid(model, tokenizer, lengths=[256], depths=[33.3333, 33.3334],
                                  mode="standard", log=JsonlLog(tmp_path / "b.jsonl"),
                                  haystack_ids=haystack, progress=False)  # fmt: skip
    assert [r["depth"] for r in records] == [33.3333, 33.3334]
    # a rerun into the same results with a depth of the same key as a saved one: refused,
    # where it returned the saved depth's records as its own
    with pytest.raises(ValueError, match=r"33\.33333 is saved as 33\.3333.*for depth 33\.3333 "):
        needle_mod.run_grid(model, tokenizer, lengths=[256], depths=[33.33333],
                            mode="standard", log=JsonlLog(tmp_path / "b.jsonl"),
                            haystack_ids=haystack, progress=False)  # fmt: skip


def test_scorer_rates_known_answers():
    ref, keys = DEFAULT_NEEDLE.answer, DEFAULT_NEEDLE.key_phrases
    perfect = score_response(" " + ref + "\nmore text", ref, keys)
    assert perfect["score"] == 10.0 and perfect["correct"] == 1.0
    assert perfect["rouge_l_recall"] == pytest.approx(1.0)
    paraphrase = score_response(" Eat a sandwich in dolores park.", ref, keys)
    assert paraphrase["score"] == 10.0  # every key phrase, case-insensitive
    partial = score_response(" Have a sandwich at the beach.", ref, keys)
    assert 1.0 < partial["score"] < 10.0 and partial["keyphrase_recall"] == 0.5
    wrong = score_response(" Purple elephants dance quietly.", ref, keys)
    assert wrong["score"] == 1.0 and wrong["correct"] == 0.0
    assert score_response("", ref, keys)["score"] == 1.0
    # Only the first non-empty line counts.
    assert score_response("\n\nno idea\nsandwich Dolores Park", ref, keys)["score"] < 10.0
    assert score_response(" 48213. Done", "48213", ("48213",), mode="passkey")["score"] == 10.0
    assert score_response(" 48231", "48213", ("48213",), mode="passkey")["score"] == 1.0
    # the key as a whole number, not a substring of a longer one
    assert score_response(" 12345678", "45678", ("45678",), mode="passkey")["score"] == 1.0
    assert score_response(" key 45678.", "45678", ("45678",), mode="passkey")["score"] == 10.0


def test_custom_needle_scores_by_its_key_phrases():
    from fot.eval.needle import Needle

    needle = Needle(
        "The vault code is kept under the blue lamp.", "Where is the code?", ("blue lamp",)
    )
    perfect = score_response(" Under the blue lamp.", needle.answer, needle.key_phrases)
    assert perfect["score"] == 10.0 and perfect["correct"] == 1.0
    with pytest.raises(ValueError, match="no key phrases"):
        Needle("The vault code is kept under the blue lamp.", "Where is the code?")
    with pytest.raises(ValueError, match=r"\['red lamp'\] do not appear"):
        Needle("The vault code is kept under the blue lamp.", "Where?", ("red lamp",))
    with pytest.raises(ValueError, match="at least one key phrase"):
        score_response(" Under the blue lamp.", needle.answer, ())


def test_heatmap_is_written(tmp_path):
    recs = [
        {"context_length": L, "depth": d, "score": s}
        for L, s in ((1024, 10.0), (2048, 5.0))
        for d in (0.0, 50.0)
    ]
    out = plot_heatmap(recs, tmp_path / "h.png", train_length=1024, title="t")
    assert out.stat().st_size > 1000


def test_heatmap_labels_each_length_as_given(tmp_path, monkeypatch):
    """1024 and 1500 both read "1k" and 3000 read "2k" (floored): "k" only for multiples of
    1024 (what ``--lengths 2k`` means), else the number of tokens."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    lengths = (1000, 1024, 1500, 3000, 8192)
    recs = [{"context_length": L, "depth": 0.0, "score": 5.0} for L in lengths]
    plot_heatmap(recs, tmp_path / "h.png")
    labels = [t.get_text() for t in figures[0].axes[0].get_xticklabels()]
    assert labels == ["1000", "1k", "1500", "3000", "8k"]


def test_forgetting_pair_layout():
    copy_ids, lm_ids, start, end = build_pair([5, 6, 7, 8, 9], [1, 2, 3, 4, 0], bos_id=99)
    assert copy_ids == [99, 5, 6, 7, 8, 9, 99, 5, 6, 7, 8, 9]
    assert lm_ids == [99, 1, 2, 3, 4, 0, 99, 5, 6, 7, 8, 9]
    assert (start, end) == (10, 12)  # second half (5 // 2 = 2 tokens) of the second S


def test_copy_oracle_gets_one_and_random_model_gets_chance(tmp_path):
    vocab = 10
    stream = np.random.default_rng(0).integers(0, vocab - 1, size=5000)  # bos = vocab - 1
    oracle = CopyOracle(bos=vocab - 1, vocab=vocab)
    recs = run_curve(
        oracle,
        stream,
        lengths=[34, 130],
        repeats=2,
        bos_id=vocab - 1,
        log=JsonlLog(tmp_path / "o.jsonl"),
        progress=False,
    )
    assert all(r["copy_accuracy"] == 1.0 for r in recs)
    # The oracle copies from one period back: on [bos] I [bos] S it predicts I, i.e. chance.
    s = summarize(recs)
    assert s["fine_grained_length"] == 130 and s["coarse_grained_length"] == 130

    rand = RandomLogits(vocab - 1, seed=0)
    recs = run_curve(
        rand,
        stream,
        lengths=[802],
        repeats=3,
        bos_id=vocab - 1,
        log=JsonlLog(tmp_path / "r.jsonl"),
        progress=False,
    )
    copy = np.mean([r["copy_accuracy"] for r in recs])
    lm = np.mean([r["lm_accuracy"] for r in recs])
    chance = 1.0 / (vocab - 1)  # 600 scored tokens: std ~ 0.012
    assert abs(copy - chance) < 0.05 and abs(lm - chance) < 0.05
    assert summarize(recs)["fine_grained_length"] == 0

    # Resume: a second call reuses the log instead of recomputing.
    log = JsonlLog(tmp_path / "r.jsonl")
    assert (
        len(
            run_curve(
                torch.nn.Identity(),
                stream,
                lengths=[802],
                repeats=3,
                bos_id=vocab - 1,
                log=log,
                progress=False,
            )
        )
        == 3
    )


def test_a_forgetting_curve_cell_does_not_depend_on_the_other_lengths(tmp_path, monkeypatch):
    """S and I were drawn from the data's first max(20 * longest --lengths, 200k) tokens, so
    cell (256, r) changed when 16k joined the grid, and a grid extended on a rerun kept cells a
    fresh run of the final command would not make. A fresh run is the oracle now; records of
    the older rule are refused where it mattered (data of 200k tokens or more)."""
    from eval_helpers import VOCAB, make_llama_checkpoint
    from zarr_arrays import new_array

    import fot.eval.forgetting_curve as fc
    from fot.eval.__main__ import main
    from fot.eval.common import ResumeMismatchError

    # the cell's text as its accuracies: copy sees S (then half of S), LM sees I
    monkeypatch.setattr(fc, "teacher_forced_accuracy", lambda m, ids, s, e: float(sum(ids[:s])))
    monkeypatch.setattr(fc, "plot_curve", lambda *a, **k: None)  # most of a run's time
    ckpt = make_llama_checkpoint(tmp_path / "llama")
    tokens = np.random.default_rng(0).integers(0, VOCAB - 1, size=(3, 150_000))
    data = new_array(str(tmp_path / "heldout.zarr"), shape=tokens.shape, dtype=np.int32)
    data[:] = tokens  # 450k tokens: 300k read for --lengths 256, all for 16k (20 * 16k > 300k)

    def run(lengths, out, *more):
        main(["forgetting-curve", str(ckpt), "--data", str(tmp_path / "heldout.zarr"),
              "--lengths", lengths, "--repeats", "2", "--device", "cpu", "--out", str(out),
              *more])  # fmt: skip
        return {r["key"]: r for r in JsonlLog(out / "forgetting_curve.jsonl")}

    fresh = run("256,16k", tmp_path / "fresh")
    small = run("256", tmp_path / "grown")
    assert small == {k: fresh[k] for k in ("256:0", "256:1")}
    assert run("256,16k", tmp_path / "grown") == fresh  # extended on a rerun
    # a record of the older rule (no entry for it) is refused, naming the rule
    record = tmp_path / "grown" / "forgetting_curve.resume.json"
    saved = json.loads(record.read_text())
    assert saved["settings"].pop(fc.SPANS_SETTING[0]) == fc.SPANS_SETTING[1]
    record.write_text(json.dumps(saved))
    with pytest.raises(ResumeMismatchError, match=r"S and I of a cell of length L: saved"):
        run("256", tmp_path / "grown")
    # the sample (128k tokens, under every window): the rule changes nothing, not recorded
    run("64", tmp_path / "sample", "--data", "sample")
    saved = json.loads((tmp_path / "sample" / "forgetting_curve.resume.json").read_text())
    assert fc.SPANS_SETTING[0] not in saved["settings"]


def test_forgetting_curve_spans_read_documents_as_the_trainer_packs_them(tmp_path, monkeypatch):
    """S and I were spans of the data's documents joined end to end without the BOS that fot's
    trainer puts before every document: a span over two documents glued them (..., 1039,
    2000, ...), a layout the model never trained on. Oracle: the trainer's own packing
    (PackedSource.from_documents): every S and I is a window of that stream, BOS between
    documents included, that neither starts nor ends with a BOS (no [bos] [bos]). Records
    saved before (without the rule's entry) are refused for data of several documents and
    resumed for data of one, whose cells did not change."""
    from eval_helpers import make_llama_checkpoint

    import fot.eval.forgetting_curve as fc
    from fot.data.streams import EOT_ID, PackedSource
    from fot.data.tokens import TokenDocuments, write_token_documents
    from fot.eval.__main__ import main
    from fot.eval.common import ResumeMismatchError

    seen: list[list[int]] = []
    monkeypatch.setattr(
        fc, "teacher_forced_accuracy", lambda m, ids, s, e: seen.append(list(ids)) or 0.5
    )
    monkeypatch.setattr(fc, "plot_curve", lambda *a, **k: None)
    ckpt = make_llama_checkpoint(tmp_path / "llama")
    sizes = [40, 3, 70, 1, 25, 90, 12, 60]  # every token id distinct: a span shows where it is
    starts = np.cumsum([100, *sizes[:-1]])
    docs = [np.arange(a, a + k, dtype=np.uint16) for a, k in zip(starts, sizes, strict=True)]
    write_token_documents(tmp_path / "tok", docs)
    total = sum(sizes) + len(sizes)
    x, y = PackedSource.from_documents(TokenDocuments(tmp_path / "tok"), total - 1).read(0, 1)
    packed = np.concatenate([x[0], y[0][-1:]]).tolist()  # [BOS] doc 0 [BOS] doc 1 ...

    def run(data, out, *more):
        main(["forgetting-curve", str(ckpt), "--data", str(data), "--lengths", "34,66",
              "--repeats", "8", "--device", "cpu", "--out", str(out), *more])  # fmt: skip

    run(tmp_path / "tok", tmp_path / "fc")
    assert len(seen) == 2 * 16
    crossing = 0
    for ids in seen:
        n = (len(ids) - 2) // 2
        assert ids[0] == ids[n + 1] == EOT_ID
        for span in (ids[1 : n + 1], ids[n + 2 :]):
            at = packed.index(span[0])
            assert packed[at : at + n] == span  # a window of the trainer's stream
            assert EOT_ID not in (span[0], span[-1])
            crossing += EOT_ID in span
    assert crossing > 8  # the documents are short: many spans hold a boundary

    # a record of the older rule (no entry for it) is refused, naming the rule
    record = tmp_path / "fc" / "forgetting_curve.resume.json"
    saved = json.loads(record.read_text())
    assert saved["settings"].pop(fc.BOS_SETTING[0]) == fc.BOS_SETTING[1]
    record.write_text(json.dumps(saved))
    with pytest.raises(ResumeMismatchError, match=r"documents in S and I: saved '\(not record"):
        run(tmp_path / "tok", tmp_path / "fc")
    # data of one document: nothing changed, nothing recorded
    write_token_documents(tmp_path / "one", [np.arange(100, 400, dtype=np.uint16)])
    run(tmp_path / "one", tmp_path / "one_fc")
    saved = json.loads((tmp_path / "one_fc" / "forgetting_curve.resume.json").read_text())
    assert fc.BOS_SETTING[0] not in saved["settings"]


def test_forgetting_curve_of_one_document_holding_the_bos_id_reads_it_as_a_boundary(
    tmp_path, monkeypatch
):
    """Data of one document whose token ids hold <|endoftext|> (50256) inside it: the trainer
    starts a document at that id (its packing of the two documents on either side is the same
    stream), and so does the curve (no span starts or ends with it, cells equal those of the
    two documents). fot before the rule drew such spans too, yet its records of one document
    resumed without the rule's entry, mixing those cells in; they are now refused."""
    from eval_helpers import make_llama_checkpoint

    import fot.eval.forgetting_curve as fc
    from fot.data.streams import EOT_ID, PackedSource
    from fot.data.tokens import write_token_documents
    from fot.eval.__main__ import main
    from fot.eval.common import ResumeMismatchError

    seen: list[list[int]] = []
    monkeypatch.setattr(
        fc, "teacher_forced_accuracy", lambda m, ids, s, e: seen.append(list(ids)) or 0.5
    )
    monkeypatch.setattr(fc, "plot_curve", lambda *a, **k: None)
    ckpt = make_llama_checkpoint(tmp_path / "llama")
    a, b = np.arange(100, 140), np.arange(200, 290)
    one = np.concatenate([a, [EOT_ID], b]).astype(np.uint16)
    write_token_documents(tmp_path / "one", [one])
    write_token_documents(tmp_path / "two", [a.astype(np.uint16), b.astype(np.uint16)])
    x, y = PackedSource.from_documents([a, b], len(one)).read(0, 1)
    assert np.concatenate([x[0], y[0][-1:]]).tolist() == [EOT_ID, *one.tolist()]

    def run(data, out):
        seen.clear()
        main(["forgetting-curve", str(ckpt), "--data", str(tmp_path / data), "--lengths", "34,66",
              "--repeats", "8", "--device", "cpu", "--out", str(tmp_path / out)])  # fmt: skip
        return list(seen)

    cells = run("one", "fc_one")
    assert cells == run("two", "fc_two") and len(cells) == 32
    for ids in cells:
        n = (len(ids) - 2) // 2
        for span in (ids[1 : n + 1], ids[n + 2 :]):
            assert EOT_ID not in (span[0], span[-1])
    assert any(EOT_ID in ids[1:-1] and ids.count(EOT_ID) > 2 for ids in cells)  # inside spans
    record = tmp_path / "fc_one" / "forgetting_curve.resume.json"
    saved = json.loads(record.read_text())
    assert saved["settings"].pop(fc.BOS_SETTING[0]) == fc.BOS_SETTING[1]
    record.write_text(json.dumps(saved))  # as fot before the rule wrote it
    with pytest.raises(ResumeMismatchError, match=r"documents in S and I: saved '\(not record"):
        run("one", "fc_one")


def test_memory_lengths_hand_computed():
    lengths = [512, 128, 256, 1024]
    copy = [0.995, 1.0, 0.999, 0.5]
    lm = [0.3, 0.3, 0.3, 0.485]  # 0.5 > 0.485 + 0.01 at 1024
    assert memory_lengths(lengths, copy, lm) == {
        "fine_grained_length": 512,
        "coarse_grained_length": 1024,
    }
    assert memory_lengths([128, 256], [0.98, 1.0], [0.99, 0.2]) == {
        "fine_grained_length": 0,
        "coarse_grained_length": 0,
    }
    # 0.5 is not > 0.495 + 0.01: the coarse length stops before 1024.
    assert memory_lengths(lengths, copy, [0.3, 0.3, 0.3, 0.495])["coarse_grained_length"] == 512


def test_long_texts_encode_without_a_false_length_warning(tmp_path):
    """The needle command printed transformers' "Token indices sequence length is longer than
    the specified maximum sequence length for this model (85604 > 65536). Running this
    sequence through the model will result in indexing errors" for the haystack it then cuts
    to fit (found running eval/README.md's needle example); LongBench contexts, lm-eval's
    rolling texts and a long gates text met the same warning."""
    import logging

    from transformers import AutoTokenizer

    import fot.eval.needle as needle_mod
    from fot.eval.common import encode_text
    from fot.tokenizer import save_hf_tokenizer

    class Record(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    folder = save_hf_tokenizer(tmp_path / "tok", model_max_length=16)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    logger = logging.getLogger("transformers")  # transformers' loggers do not propagate
    record, level = Record(), logger.level
    logger.addHandler(record)
    logger.setLevel(logging.WARNING)
    try:
        want = AutoTokenizer.from_pretrained(folder).encode(text, add_special_tokens=False)
        # (the check can see the warning: a plain encode of the same text logs it)
        assert any("Token indices sequence length" in m for m in record.messages)
        assert len(want) > 16
        for encode in (needle_mod._encode, encode_text):
            record.messages.clear()
            tokenizer = AutoTokenizer.from_pretrained(folder)  # it warns once per tokenizer
            assert encode(tokenizer, text) == want
            assert not any("Token indices sequence length" in m for m in record.messages)
    finally:
        logger.removeHandler(record)
        logger.setLevel(level)


def test_a_json_escaped_model_gets_an_escaped_prompt(tmp_path):
    """A LongCrawl64-trained model never saw a raw newline: the prompt (haystack, needle and
    question) holds none of GPT-2's newline tokens and decodes back to the plain text."""
    from transformers import AutoTokenizer

    from fot.eval.common import decode_text, encode_text
    from fot.tokenizer import save_hf_tokenizer

    tok = AutoTokenizer.from_pretrained(save_hf_tokenizer(tmp_path, text_escaping="json"))
    lines = "\n".join(f"Line {i} of the story has no full stop" for i in range(200))
    hay = encode_text(tok, lines)
    p = build_prompt(tok, hay, context_length=800, depth=50.0, mode="standard", bos_id=50256)
    assert len(p.input_ids) == 800 and 198 not in p.input_ids
    assert "Dolores Park" in decode_text(tok, p.input_ids[p.needle_start : p.needle_end])
    assert "stop\nLine" in decode_text(tok, p.input_ids[p.haystack_start : p.needle_start])
    assert decode_text(tok, p.input_ids[p.needle_end :]).endswith("Answer:")


def test_a_json_escaped_needle_snaps_to_line_ends_and_never_splits_an_escape(tmp_path):
    """In JSON-escaped text a line ends with the two characters ``\\n``, tokens of their own
    (``\\``, then ``n``): the needle snaps to the end of the line as it does in plain text
    (before, no line end was found, and at some depths the needle went between the ``\\`` and
    the ``n``, writing an escape the model never saw)."""
    from transformers import AutoTokenizer

    from fot.eval.common import encode_text
    from fot.tokenizer import save_hf_tokenizer

    lines = "\n".join(f"Line {i} of the story has no full stop" for i in range(200))
    for escaping in ("none", "json"):
        tok = AutoTokenizer.from_pretrained(
            save_hf_tokenizer(tmp_path / escaping, text_escaping=escaping)
        )
        hay = encode_text(tok, lines)
        for depth in range(5, 100, 5):
            p = build_prompt(
                tok, hay, context_length=800, depth=float(depth), mode="standard", bos_id=50256
            )
            before = tok.decode(p.input_ids[p.haystack_start : p.needle_start])
            assert before.endswith("\\n" if escaping == "json" else "\n"), (escaping, depth)
