"""LongBench metrics on hand-computed pairs, prompt building and truncation."""

from __future__ import annotations

import codecs
import json

import pytest

from fot.eval.longbench import (
    PAPER_TASKS,
    TASKS,
    format_prompt,
    length_table,
    load_prompts,
    parse_tasks,
    postprocess,
    read_jsonl,
    score_example,
    scores_by_length,
    summary_table,
    task_spec,
    truncate_middle,
)
from fot.eval.metrics import (
    best_score,
    classification_score,
    code_similarity,
    count_score,
    fuzzy_ratio,
    normalize_answer,
    qa_f1,
    retrieval_score,
    rouge_l,
)


def test_qa_f1_hand_computed():
    assert normalize_answer("The  Eiffel-Tower, an icon!") == "eiffeltower icon"
    # each of the three articles goes, as whole words only ("a" inside "banana" stays)
    assert normalize_answer("A banana, an apple and THE pear") == "banana apple and pear"
    assert qa_f1("The Eiffel Tower!", "eiffel tower") == 1.0
    # pred {dog} after "a" is dropped, ref {dog}: F1 = 1 (with "a" kept: P = 1/2, F1 = 2/3)
    assert qa_f1("a dog", "dog") == 1.0
    # pred {in, paris, france}, ref {paris}: P = 1/3, R = 1, F1 = 2 * (1/3) / (4/3) = 0.5
    assert qa_f1("in Paris France", "Paris") == pytest.approx(0.5)
    # counts matter: pred {a-less: "x x y"} vs ref "x y y" -> overlap x1 y1 = 2, P = R = 2/3
    assert qa_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert qa_f1("no", "yes") == 0.0
    assert qa_f1("", "yes") == 0.0
    assert best_score("qa_f1", "Paris", ["London", "paris"]) == 1.0


def test_rouge_l_hand_computed():
    """LongBench's ROUGE-L (the ``rouge`` package's summary-level ROUGE-L): sentences split at
    ".", words at spaces, case kept; P and R count the distinct words of the union of the
    LCSs of every (reference sentence, prediction sentence) pair over the distinct words of
    each side; F = 2PR / (P + R + 1e-8)."""

    def f(p, r):
        return 2 * p * r / (p + r + 1e-8)

    # LCS words {the, cat, on, mat} = 4; distinct words: pred 5, ref 5 -> P = R = 4/5
    assert rouge_l("the cat sat on the mat", "the cat is on the mat") == pytest.approx(f(0.8, 0.8))
    # case kept: "The" != "the"; pred has 6 distinct words (The, the), LCS "cat on the mat"
    assert rouge_l("The cat sat on the mat.", "the cat is on the mat.") == pytest.approx(
        f(4 / 6, 4 / 5)
    )
    # LCS(a b c d, b d) = 2: P = 2/4, R = 2/2
    assert rouge_l("a b c d", "b d") == pytest.approx(f(0.5, 1.0))
    # sentences in another order: each reference sentence is matched by one prediction sentence
    assert rouge_l("Paris is nice. Paris is big.", "Paris is big. Paris is nice.") == (
        pytest.approx(f(1.0, 1.0))
    )
    # punctuation other than "." stays on the word: "mat," != "mat"
    assert rouge_l("cat, mat", "cat mat") == pytest.approx(f(1 / 2, 1 / 2))
    assert rouge_l("", "b d") == 0.0
    assert rouge_l("...", "b d") == 0.0  # no sentence left: LongBench scores 0
    assert rouge_l("b d", "") == 0.0


def test_classification_hand_computed():
    classes = ["Location", "Location city", "Human"]
    assert classification_score("Location city", "Location city", all_classes=classes) == 1.0
    # "Location" is a strict substring of the truth and is dropped; two matches remain.
    assert (
        classification_score("Human or Location city", "Location city", all_classes=classes) == 0.5
    )
    assert classification_score("Location", "Location city", all_classes=classes) == 0.0
    assert classification_score("Human", "Location city", all_classes=classes) == 0.0
    # Two substrings of the truth in a row are both dropped (LongBench's loop keeps "city").
    nested = ["Location", "city", "Location city"]
    assert classification_score("Location city", "Location city", all_classes=nested) == 1.0
    with pytest.raises(ValueError, match="all_classes"):
        classification_score("x", "y", all_classes=[])


def test_fuzzy_ratio_and_code_similarity_hand_computed():
    assert fuzzy_ratio("abcd", "abed") == 75  # LCS abd = 3: 200 * 3 / 8
    assert fuzzy_ratio("kitten", "sitting") == 62  # LCS ittn = 4: 800 / 13 = 61.5
    assert fuzzy_ratio("same", "same") == 100
    assert fuzzy_ratio("", "") == 100
    assert fuzzy_ratio("", "x") == 0
    # exact halves round as fuzzywuzzy's float steps put them (values fuzz.ratio gave with
    # python-Levenshtein): 1 - 74/80 is just below 0.075, 1 - 46/80 just above 0.425
    assert fuzzy_ratio("abc", "abc" + "x" * 74) == 7  # exactly 7.5: round() alone gives 8
    assert fuzzy_ratio("a" * 17, "a" * 17 + "x" * 46) == 43  # exactly 42.5: round() gives 42
    # first line without a comment or fence: "    return x + 1" (16 chars) vs 12 chars,
    # LCS 12 -> round(2400 / 28) = 86
    assert code_similarity("# comment\n    return x + 1\n", "return x + 1") == 0.86
    assert code_similarity("```python\nfoo()\n```", "foo()") == 1.0
    assert code_similarity("// only comments", "foo()") == 0.0


def test_prompts_truncation_and_postprocessing():
    assert len(TASKS) == 16 and len(PAPER_TASKS) == 14 and PAPER_TASKS[-1] == "repobench-p"
    assert {TASKS[t].metric for t in PAPER_TASKS} == {
        "qa_f1",
        "rouge_l",
        "classification",
        "code_sim",
    }
    assert TASKS["gov_report"].max_new_tokens == 512 and TASKS["hotpotqa"].max_new_tokens == 32
    ex = {"context": "CTX-TEXT", "input": "QUESTION?", "answers": ["yes"], "_id": "1"}
    for name in TASKS:
        prompt = format_prompt(name, ex)
        assert "CTX-TEXT" in prompt
        if "{input}" in TASKS[name].template:
            assert "QUESTION?" in prompt
            assert prompt.index("CTX-TEXT") < prompt.index("QUESTION?")
    with pytest.raises(ValueError, match="unknown LongBench task"):
        format_prompt("nope", ex)
    assert truncate_middle(list(range(10)), 4) == [0, 1, 8, 9]
    assert truncate_middle(list(range(10)), 5) == [0, 1, 7, 8, 9]
    assert truncate_middle([1, 2], 4) == [1, 2]
    assert postprocess("triviaqa", "\nParis\nQuestion: next") == "Paris"
    assert postprocess("narrativeqa", "a\nb") == "a\nb"
    assert score_example("triviaqa", "\nParis\nLondon", {"answers": ["Paris"]}) == 1.0
    assert (
        score_example(
            "trec",
            "Human being",
            {"answers": ["Human being"], "all_classes": ["Human being", "Location"]},
        )
        == 1.0
    )


def test_prompts_file_and_first_line_scoring(tmp_path):
    """--prompts: LongBench's dataset2prompt.json format, checked before anything runs;
    --first-line all: the FoX paper's scoring, the first line of every task's prediction."""
    path = tmp_path / "dataset2prompt.json"
    path.write_text(json.dumps({"hotpotqa": "C={context};Q={input};", "trec": "{context}{{x}}"}))
    templates = load_prompts(path, ["hotpotqa", "hotpotqa_e", "trec"])
    assert templates["hotpotqa_e"] == templates["hotpotqa"]  # LongBench-E: the task's template
    ex = {"context": "ctx", "input": "q?"}
    assert format_prompt("hotpotqa", ex, templates["hotpotqa"]) == "C=ctx;Q=q?;"
    assert format_prompt("trec", ex, templates["trec"]) == "ctx{x}"
    with pytest.raises(ValueError, match=r"has no template for \['narrativeqa'\]; add them"):
        load_prompts(path, ["narrativeqa", "hotpotqa"])
    for text, match in (
        ('{"hotpotqa": "{question}"}', r"reads \['question'\]; a template reads"),
        ('{"hotpotqa": "no fields"}', "reads no field"),
        ('{"hotpotqa": "{context"}', "is not a str.format template"),
        ('["hotpotqa"]', "is not a JSON object of strings"),
        ("{", "cannot be read as JSON"),
    ):
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            load_prompts(path, ["hotpotqa"])
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(tmp_path / "none.json", ["hotpotqa"])
    # "Paris\nLondon" vs "Paris": tokens {paris, london}, P = 1/2, R = 1, F1 = 2/3 on the
    # whole text (LongBench's hotpotqa); the first line alone is exact (the FoX paper)
    ex = {"answers": ["Paris"]}
    assert score_example("hotpotqa", "Paris\nLondon", ex) == pytest.approx(2 / 3)
    assert score_example("hotpotqa", "Paris\nLondon", ex, "all") == 1.0
    assert postprocess("narrativeqa", "\na\nb", "all") == "a"
    with pytest.raises(ValueError, match="--first-line 'some' is not one of"):
        postprocess("narrativeqa", "a", "some")


def test_table2_layout():
    scores = {t: float(i) for i, t in enumerate(PAPER_TASKS)}
    lines = summary_table(scores).splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    # Valid Markdown: a header, the separator, rows of as many cells as the header.
    assert all(len(r) == 16 for r in rows) and set(rows[1]) == {"---"}
    assert rows[0][:2] == ["Task", "NarrativeQA"] and rows[0][-1] == "Avg"
    assert rows[2][1:4] == ["Single-Document QA"] * 3 and rows[2][-2] == "Code Completion"
    assert rows[3][1:3] == ["0.00", "1.00"] and rows[3][-1] == f"{sum(range(14)) / 14:.2f}"


def test_synthetic_task_scores_hand_computed():
    # the share of the numbers written that equal the answer
    assert count_score("There are 17 different paragraphs.", "17") == 1.0
    assert count_score("12 or 17, maybe 170", "17") == pytest.approx(1 / 3)
    assert count_score("I cannot tell.", "17") == 0.0
    assert retrieval_score("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 3, or Paragraph 12", "Paragraph 12") == 0.5
    assert retrieval_score("the first one", "Paragraph 12") == 0.0
    with pytest.raises(ValueError, match="names no paragraph"):
        retrieval_score("Paragraph 1", "12")
    assert score_example("passage_count", "7", {"answers": ["7"]}) == 1.0
    assert score_example("passage_retrieval_en_e", " Paragraph 4.", {"answers": ["Paragraph 4"]})
    assert "{input}" in TASKS["passage_retrieval_en"].template


def test_task_sets_and_longbench_e_names():
    assert parse_tasks("paper") == list(PAPER_TASKS)
    assert parse_tasks("all") == [*PAPER_TASKS, "passage_count", "passage_retrieval_en"]
    e = parse_tasks("e")
    assert len(e) == 13 and e[0] == "qasper_e" and "narrativeqa_e" not in e
    # in the order given, each task once
    assert parse_tasks("trec_e, trec,paper,trec")[:3] == ["trec_e", "trec", "narrativeqa"]
    assert len(parse_tasks("trec_e,trec,paper,trec")) == 15
    for bad in ("narrativeqa_e", "hotpot", ",", "e_e"):
        with pytest.raises(ValueError, match=r"choose from .*or a set: paper \(14 tasks\)"):
            parse_tasks(bad)
    spec = task_spec("hotpotqa_e")
    assert spec.name == "HotpotQA (E)" and spec.template == TASKS["hotpotqa"].template
    assert spec.max_new_tokens == 32 and spec.metric == "qa_f1"
    assert format_prompt("hotpotqa_e", {"context": "C", "input": "Q"}) == format_prompt(
        "hotpotqa", {"context": "C", "input": "Q"}
    )


def test_scores_by_length_ranges_hand_computed():
    # ranges [0, 4000), [4000, 8000), [8000, inf) of the length field
    lengths = [0, 3999, 4000, 7999, 8000, 20000]
    scores = [1.0, 0.5, 0.0, 0.25, 1.0, 1.0]
    assert scores_by_length(scores, lengths) == {"0-4k": 75.0, "4-8k": 12.5, "8k+": 100.0}
    assert scores_by_length([0.5], [9000]) == {"0-4k": None, "4-8k": None, "8k+": 50.0}
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in length_table(
            {
                "qasper_e": {"0-4k": 10.0, "4-8k": None, "8k+": 30.0},
                "trec_e": {"0-4k": 20.0, "4-8k": 40.0, "8k+": None},
            }
        ).splitlines()
    ]
    assert rows[0] == ["Task", "0-4k", "4-8k", "8k+"]
    assert rows[2] == ["Qasper (E)", "10.00", "-", "30.00"]
    assert rows[4] == ["Avg", "15.00", "40.00", "30.00"]  # over the tasks with examples there


def test_longbench_e_row_without_length_names_file_and_line(tmp_path):
    path = tmp_path / "trec_e.jsonl"
    row = {"_id": "a", "input": "q", "context": "c", "answers": ["x"], "length": 5}
    path.write_text(
        json.dumps(row) + "\n" + json.dumps({**row, "_id": "b", "length": "long"}) + "\n"
    )
    assert len(read_jsonl(path)) == 2  # not asked for: read as it is
    for bad in (-1, 4000.0, True, None):  # an integer >= 0 only
        path.write_text(json.dumps({**row, "length": bad}) + "\n")
        with pytest.raises(ValueError, match=r"trec_e\.jsonl:1 has no valid length"):
            read_jsonl(path, needs_length=True)
    path.write_text(
        json.dumps(row) + "\n" + json.dumps({**row, "_id": "b", "length": "long"}) + "\n"
    )
    with pytest.raises(
        ValueError, match=r"trec_e\.jsonl:2 has no valid length \(length: \"long\"\)"
    ):
        read_jsonl(path, needs_length=True)


def test_a_byte_order_mark_opening_a_task_or_prompts_file_is_read_as_without(tmp_path):
    """Files saved by some Windows editors open with a UTF-8 byte-order mark: it is dropped at
    the start of the file (the rows and templates equal those of the same file without it)
    and still refused inside a line, where it is no JSON."""
    rows = [{"_id": i, "input": "q", "context": "c", "answers": ["x"]} for i in "ab"]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    plain, marked = tmp_path / "trec.jsonl", tmp_path / "marked" / "trec.jsonl"
    marked.parent.mkdir()
    plain.write_text(text, encoding="utf-8")
    marked.write_bytes(codecs.BOM_UTF8 + text.encode())
    assert read_jsonl(marked) == read_jsonl(plain) == rows
    inside = text.splitlines()[0] + "\n" + "\ufeff" + text.splitlines()[1] + "\n"
    marked.write_text(inside, encoding="utf-8")
    with pytest.raises(ValueError, match=r"trec\.jsonl:2 is not valid JSON"):
        read_jsonl(marked)
    prompts = tmp_path / "dataset2prompt.json"
    prompts.write_bytes(codecs.BOM_UTF8 + json.dumps({"trec": "{context}|{input}"}).encode())
    assert load_prompts(prompts, ["trec"]) == {"trec": "{context}|{input}"}


def test_longbench_and_longbench_e_are_averaged_apart():
    # with --tasks paper,e the tasks both sets have would count twice in one average
    scores = {"hotpotqa": 10.0, "trec": 30.0, "hotpotqa_e": 50.0, "passage_count_e": 0.0}
    first, second = summary_table(scores).split("\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in first.splitlines()]
    assert rows[0] == ["Task", "HotpotQA", "TREC", "Avg"] and rows[3][-1] == "20.00"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in second.splitlines()]
    # LongBench-E's Avg too is of the paper's tasks, the synthetic ones after it
    assert rows[0] == ["Task", "HotpotQA (E)", "Avg", "PassageCount (E)", "Avg (with synthetic)"]
    assert rows[3] == ["Score", "50.00", "50.00", "0.00", "25.00"]
    assert "\n\n" not in summary_table({"trec_e": 1.0})  # one set: one table


def test_scores_by_length_of_longbench_and_longbench_e_are_averaged_apart():
    """With --tasks paper,e a task both sets have counted twice in by_length.md's one Avg row;
    now each set has its table and Avg, as in table2.md."""
    by_length = {
        "trec": {"0-4k": 10.0, "4-8k": None, "8k+": 30.0},
        "hotpotqa": {"0-4k": 20.0, "4-8k": 40.0, "8k+": None},
        "trec_e": {"0-4k": 50.0, "4-8k": 60.0, "8k+": 70.0},
        "qasper_e": {"0-4k": 0.0, "4-8k": None, "8k+": 10.0},
    }
    first, second = length_table(by_length).split("\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in first.splitlines()]
    assert [r[0] for r in rows[2:]] == ["HotpotQA", "TREC", "Avg"]
    assert rows[-1] == ["Avg", "15.00", "40.00", "30.00"]  # by hand: (20+10)/2, 40, 30
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in second.splitlines()]
    assert rows[0] == ["Task", "0-4k", "4-8k", "8k+"] and set(rows[1]) == {"---"}
    assert [r[0] for r in rows[2:]] == ["Qasper (E)", "TREC (E)", "Avg"]
    assert rows[-1] == ["Avg", "25.00", "60.00", "40.00"]  # by hand: (0+50)/2, 60, (10+70)/2
    assert "\n\n" not in length_table({"trec_e": by_length["trec_e"]})  # one set: one table
    # synthetic tasks come after the paper's Avg, with an Avg of all in each table
    for paper, synthetic, e in (
        ("trec", "passage_count", ""),
        ("trec_e", "passage_count_e", " (E)"),
    ):
        table = length_table(
            {paper: by_length["trec"], synthetic: {"0-4k": 0.0, "4-8k": 20.0, "8k+": None}}
        )
        rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
        names = ["TREC" + e, "Avg", "PassageCount" + e, "Avg (with synthetic)"]
        assert [r[0] for r in rows[2:]] == names
        assert rows[3] == ["Avg", "10.00", "-", "30.00"]
        assert rows[5] == ["Avg (with synthetic)", "5.00", "20.00", "30.00"]  # by hand


def test_table2_avg_of_tasks_all_is_the_papers_14_task_average():
    """With --tasks all the synthetic tasks were averaged in with the paper's 14: Avg is now
    the 14 tasks' average (the paper's), right after them; the synthetic tasks follow with an
    average of all 16 labelled as such."""
    scores = {t: float(i) for i, t in enumerate(TASKS)}  # 0..13 the paper's, 14 and 15 synthetic
    (table,) = summary_table(scores).split("\n\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()]
    assert all(len(r) == 19 for r in rows) and set(rows[1]) == {"---"}
    assert rows[0][14:] == ["RepoBench-P", "Avg", "PassageCount", "PassageRetrieval-en",
                            "Avg (with synthetic)"]  # fmt: skip
    assert rows[3][15] == f"{sum(range(14)) / 14:.2f}" == "6.50"
    assert rows[3][18] == f"{sum(range(16)) / 16:.2f}" == "7.50"
    assert rows[2][15] == rows[2][18] == ""
    # the synthetic tasks alone: one Avg, of them
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in summary_table(
            {"passage_count": 30.0, "passage_retrieval_en": 10.0}
        ).splitlines()
    ]
    assert rows[0][-1] == "Avg" and rows[3][-1] == "20.00"


def test_a_byte_order_mark_on_a_line_of_its_own_is_no_example_in_the_count(tmp_path):
    """A task file saved with a byte-order mark and a blank first line (a Windows editor)
    holds the examples read_jsonl reads; count_examples, the total under a --limit run's
    table, counted the mark's line as one more."""
    from fot.eval.longbench import count_examples

    rows = [{"_id": i, "input": "q", "context": "c", "answers": ["x"]} for i in "ab"]
    path = tmp_path / "trec.jsonl"
    text = "\r\n" + "".join(json.dumps(r) + "\r\n" for r in rows)
    path.write_bytes(codecs.BOM_UTF8 + text.encode())
    assert read_jsonl(path) == rows
    assert count_examples(path) == 2
