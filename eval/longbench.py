"""LongBench: the FoX paper's 14 English tasks (paper Table 2), the two English synthetic tasks
and LongBench-E, from local jsonl files.

Input: a folder with one ``<task>.jsonl`` per task in LongBench's own format (the files of
LongBench's ``data.zip``; each line has ``input``, ``context``, ``answers`` (list),
``all_classes``, ``length`` and ``_id``). Fetch them once on a machine with internet, e.g.
``datasets.load_dataset("THUDM/LongBench", task, split="test").to_json(f"{task}.jsonl")``
or unzip LongBench's ``data.zip``, then copy the folder.

LongBench-E (task ``<task>_e``, file ``<task>_e.jsonl``) is LongBench's subset of 13 English
tasks with examples spread evenly over lengths; it is run like its task and also scored per
length range of the examples' ``length`` field (words): under 4k, 4k to 8k, 8k and more. The
same ranges are reported for every task whose rows all carry ``length``.

Per example: the task's prompt template is filled, the tokenized prompt is truncated in the
middle (first and last halves kept) to ``--max-length`` tokens, the model decodes greedily for
the task's generation length, and the official metric scores the prediction against every
reference (max). Few-shot tasks (TREC, TriviaQA, SAMSum) are scored on the first line of the
prediction, as in LongBench. Prompt templates are written for fot from each task's definition
(instruction wording is ours; the few-shot and code layouts follow the data format).

Scores comparable with LongBench's and the FoX paper's need their prompts and their scoring:
``--prompts`` reads templates from a file of LongBench's ``config/dataset2prompt.json``
format (task name -> template with ``{context}`` and ``{input}``; fot ships none of that text),
and ``--first-line all`` scores the first line of every prediction, as the FoX paper's
``eval/longbench/eval.py`` does (``few-shot``, the default, as LongBench's).
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import hashlib
import json
import string
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fot.progress import progress_bar
from fot.training.checkpoint import write_text_atomic

from . import program_name
from .common import (
    CHECKPOINT_HELP,
    CONTEXT_LENGTH_HELP,
    CONTEXT_LENGTH_KEYS,
    JsonlLog,
    add_run_arguments,
    check_positions,
    claim_results,
    decode_text,
    encode_text,
    eot_id,
    greedy_generate,
    load_checkpoint,
    model_dtype,
    model_max_length,
    path_setting,
    pick_device,
    position_table,
    positive_int,
    refuse_empty_folder,
    write_run_config,
)
from .metrics import PARAGRAPH, best_score


@dataclasses.dataclass(frozen=True)
class Task:
    """One LongBench task: display name, group, prompt template, generation length, metric."""

    name: str
    group: str
    template: str
    max_new_tokens: int
    metric: str
    first_line: bool = False


_QA_TAIL = "Answer with as few words as possible, a single phrase if you can, and no explanation."

TASKS: dict[str, Task] = {
    "narrativeqa": Task(
        "NarrativeQA",
        "Single-Document QA",
        "Below is a story (from a novel or a film script), followed by a question about it. "
        f"{_QA_TAIL}\n\nStory: {{context}}\n\nAnswer the question about the story above. "
        f"{_QA_TAIL}\n\nQuestion: {{input}}\n\nAnswer:",
        128,
        "qa_f1",
    ),
    "qasper": Task(
        "Qasper",
        "Single-Document QA",
        "Below is a scientific paper, followed by a question about it. Answer in as few words "
        "as possible, a single phrase or sentence if you can. If the paper does not answer the "
        'question, reply "unanswerable". For a yes/no question, reply "yes", "no" or '
        '"unanswerable". Give no explanation.\n\nPaper: {context}\n\nUsing the paper above, '
        'answer the question with the same rules: as briefly as possible, "unanswerable" if '
        'the paper does not say, "yes"/"no" for yes/no questions, no explanation.\n\n'
        "Question: {input}\n\nAnswer:",
        128,
        "qa_f1",
    ),
    "multifieldqa_en": Task(
        "MultiFieldQA-en",
        "Single-Document QA",
        "Read the text below and answer the question that follows it.\n\n{context}\n\nAnswer "
        "the question using the text above. Reply with the answer only and nothing else.\n\n"
        "Question: {input}\nAnswer:",
        64,
        "qa_f1",
    ),
    "hotpotqa": Task(
        "HotpotQA",
        "Multi-Document QA",
        "Answer the question using the passages below. Reply with the answer only and nothing "
        "else.\n\nThe passages:\n{context}\n\nAnswer the question using the passages above. "
        "Reply with the answer only and nothing else.\n\nQuestion: {input}\nAnswer:",
        32,
        "qa_f1",
    ),
    "2wikimqa": Task(
        "2WikiMQA",
        "Multi-Document QA",
        "Answer the question using the passages below. Reply with the answer only and nothing "
        "else.\n\nThe passages:\n{context}\n\nAnswer the question using the passages above. "
        "Reply with the answer only and nothing else.\n\nQuestion: {input}\nAnswer:",
        32,
        "qa_f1",
    ),
    "musique": Task(
        "MuSiQue",
        "Multi-Document QA",
        "Answer the question using the passages below. Reply with the answer only and nothing "
        "else.\n\nThe passages:\n{context}\n\nAnswer the question using the passages above. "
        "Reply with the answer only and nothing else.\n\nQuestion: {input}\nAnswer:",
        32,
        "qa_f1",
    ),
    "gov_report": Task(
        "GovReport",
        "Summarization",
        "Below is a report written by a government agency. Summarize the whole report.\n\n"
        "Report:\n{context}\n\nSummary of the report:",
        512,
        "rouge_l",
    ),
    "qmsum": Task(
        "QMSum",
        "Summarization",
        "Below is the transcript of a meeting, followed by a request. Answer the request in one "
        "or more sentences.\n\nTranscript:\n{context}\n\nAnswer the request about the meeting "
        "above in one or more sentences.\n\nRequest: {input}\nAnswer:",
        512,
        "rouge_l",
    ),
    "multi_news": Task(
        "MultiNews",
        "Summarization",
        "Below are several news articles on the same story. Summarize all of them together.\n\n"
        "{context}\n\nSummary of all the articles:",
        512,
        "rouge_l",
    ),
    "trec": Task(
        "TREC",
        "Few-shot Learning",
        "Classify the question below into its question type. Examples of questions with their "
        "types come first.\n\n{context}\n{input}",
        64,
        "classification",
        first_line=True,
    ),
    "triviaqa": Task(
        "TriviaQA",
        "Few-shot Learning",
        "Answer the question from the passage. Reply with the answer only. Examples come "
        "first.\n\n{context}\n\n{input}",
        32,
        "qa_f1",
        first_line=True,
    ),
    "samsum": Task(
        "SAMSum",
        "Few-shot Learning",
        "Summarize the dialogue in a few short sentences. Examples come first.\n\n{context}\n\n"
        "{input}",
        128,
        "rouge_l",
        first_line=True,
    ),
    "lcc": Task(
        "LCC",
        "Code Completion",
        "Complete the code below.\n{context}Next line of code:\n",
        64,
        "code_sim",
    ),
    "repobench-p": Task(
        "RepoBench-P",
        "Code Completion",
        "Complete the code below.\n{context}{input}Next line of code:\n",
        64,
        "code_sim",
    ),
    "passage_count": Task(
        "PassageCount",
        "Synthetic Task",
        "Below are numbered paragraphs from Wikipedia; some paragraphs appear more than once. "
        "Count how many different paragraphs there are.\n\n{context}\n\nHow many different "
        "paragraphs are there above, counting each repeated paragraph once? Reply with the "
        "number only.\n\nThe number of different paragraphs is:",
        32,
        "count",
    ),
    "passage_retrieval_en": Task(
        "PassageRetrieval-en",
        "Synthetic Task",
        "Below are numbered paragraphs from Wikipedia, then the summary of one of them. Find "
        "the paragraph the summary is of.\n\n{context}\n\nSummary:\n{input}\n\nWhich "
        'paragraph above is this the summary of? Reply in the form "Paragraph 1", '
        '"Paragraph 2", and so on.\n\nThe summary is of',
        32,
        "retrieval",
    ),
}
"""Every task: the paper's 14 English tasks in Table 2 order, then the two English synthetic
tasks."""

PAPER_TASKS: tuple[str, ...] = tuple(TASKS)[:14]
"""The FoX paper's 14 English tasks (its Table 2); the default ``--tasks``."""

LONGBENCH_E: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
"""The English tasks LongBench-E has (run as ``<task>_e``)."""

TASK_SETS: dict[str, tuple[str, ...]] = {
    "paper": PAPER_TASKS,
    "all": tuple(TASKS),
    "e": tuple(f"{t}_e" for t in LONGBENCH_E),
}
"""Names ``--tasks`` accepts for a set of tasks."""

LENGTH_RANGES: tuple[tuple[str, int, float], ...] = (
    ("0-4k", 0, 4000),
    ("4-8k", 4000, 8000),
    ("8k+", 8000, float("inf")),
)
"""LongBench-E's length ranges of an example's ``length`` (words): name, low (in), high (out)."""


def known_tasks() -> list[str]:
    """Every task name ``--tasks`` accepts one by one: the tasks and their LongBench-E runs."""
    return [*TASKS, *TASK_SETS["e"]]


def base_task(task: str) -> str:
    """The task a name runs: ``<task>`` for LongBench-E's ``<task>_e``, else the name."""
    return task[: -len("_e")] if task.endswith("_e") and task[: -len("_e")] in LONGBENCH_E else task


def task_spec(task: str) -> Task:
    """The :class:`Task` of a task name; ``<task>_e`` (LongBench-E) is run as ``<task>``."""
    base = base_task(task)
    if base not in TASKS:
        raise ValueError(
            f"unknown LongBench task {task!r}; choose from {known_tasks()} or a set: "
            f"{', '.join(TASK_SETS)}"
        )
    spec = TASKS[base]
    if base != task:
        return dataclasses.replace(spec, name=f"{spec.name} (E)")
    return spec


def parse_tasks(text: str) -> list[str]:
    """``--tasks``: comma-separated task names and sets (``paper``, ``all``, ``e``), in
    order, each task once.

    Raises:
        ValueError: an unknown name (the known ones are listed), or no task at all.
    """
    tasks: list[str] = []
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASK_SETS and t not in known_tasks()]
    if unknown or not names:
        raise ValueError(
            f"--tasks {text!r}: unknown LongBench tasks {unknown or '(empty list)'}; choose "
            f"from {known_tasks()} or a set: "
            + ", ".join(f"{k} ({len(v)} tasks)" for k, v in TASK_SETS.items())
        )
    for name in names:
        for t in TASK_SETS.get(name, (name,)):
            if t not in tasks:
                tasks.append(t)
    return tasks


def valid_length(value: Any) -> bool:
    """Whether a row's ``length`` can be scored in a length range: an integer >= 0."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def scores_by_length(scores: list[float], lengths: list[int]) -> dict[str, float | None]:
    """Mean score (0--100) per length range; ``None`` for a range without examples.

    Args:
        scores: each example's score in [0, 1].
        lengths: each example's ``length`` field, in the same order.
    """
    out: dict[str, float | None] = {}
    for name, lo, hi in LENGTH_RANGES:
        inside = [s for s, n in zip(scores, lengths, strict=True) if lo <= n < hi]
        out[name] = 100.0 * float(np.mean(inside)) if inside else None
    return out


FIRST_LINE = ("few-shot", "all")
"""``--first-line``: score the first line of the few-shot tasks' predictions (LongBench's
``eval.py``) or of every task's (the FoX paper's copy of it)."""


def format_prompt(task: str, example: dict[str, Any], template: str | None = None) -> str:
    """Fill the task's template (or ``template``, e.g. from ``--prompts``) with an example's
    ``context`` and ``input``."""
    return (template or task_spec(task).template).format(
        context=example.get("context", ""), input=example.get("input", "")
    )


def prompt_fields(task: str, template: str | None = None) -> tuple[str, ...]:
    """The example fields the task's prompt template (or ``template``) reads (``context``
    and/or ``input``)."""
    text = template or task_spec(task).template
    return tuple(f for f in ("context", "input") if f"{{{f}}}" in text)


def load_prompts(path: str | Path, tasks: list[str]) -> dict[str, str]:
    """``--prompts``: the template of each of ``tasks`` from a JSON object of LongBench's
    ``config/dataset2prompt.json`` format (task name -> template; ``<task>_e`` uses
    ``<task>``'s).

    Raises:
        ValueError: the file is missing, not a JSON object of strings, lacks a template for a
            task, or a template reads fields other than ``{context}`` and ``{input}`` or is not
            a valid ``str.format`` template; the message names the file, the task and the fix.
    """
    where = f"--prompts {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except FileNotFoundError:
        raise ValueError(
            f"{where} does not exist; pass a JSON file of task templates, such as LongBench's "
            "config/dataset2prompt.json"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{where} cannot be read as JSON ({err}); it holds one object mapping task names "
            "to templates, as LongBench's config/dataset2prompt.json does"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ValueError(
            f"{where} is not a JSON object of strings (task name -> template), as LongBench's "
            "config/dataset2prompt.json is"
        )
    missing = sorted({base_task(t) for t in tasks} - set(data))
    if missing:
        raise ValueError(
            f"{where} has no template for {missing}; add them or leave those tasks out of --tasks"
        )
    out = {}
    for task in tasks:
        template = data[base_task(task)]
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        except ValueError as err:
            raise ValueError(
                f"{where}: the template of {base_task(task)} is not a str.format template "
                f"({err}); write literal braces as {{{{ and }}}}"
            ) from None
        if not fields or not fields <= {"context", "input"}:
            raise ValueError(
                f"{where}: the template of {base_task(task)} reads "
                f"{sorted(fields) or 'no field'}; a template reads {{context}} and/or {{input}}"
            )
        out[task] = template
    return out


def truncate_middle(ids: list[int], max_length: int) -> list[int]:
    """Keep the first ``max_length // 2`` and last ``max_length - max_length // 2`` tokens."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    if len(ids) <= max_length:
        return list(ids)
    half = max_length // 2
    return list(ids[:half]) + list(ids[len(ids) - (max_length - half) :])


def postprocess(task: str, prediction: str, first_line: str = "few-shot") -> str:
    """First line for few-shot tasks (LongBench), or for every task with ``first_line="all"``
    (the FoX paper), the text unchanged otherwise."""
    if first_line not in FIRST_LINE:
        raise ValueError(f"--first-line {first_line!r} is not one of {list(FIRST_LINE)}")
    if first_line == "all" or task_spec(task).first_line:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def score_example(
    task: str, prediction: str, example: dict[str, Any], first_line: str = "few-shot"
) -> float:
    """Score in [0, 1]: the task's metric, max over ``example["answers"]``, of the prediction
    :func:`postprocess` keeps."""
    answers = example.get("answers")
    if isinstance(answers, str):
        answers = [answers]
    if not answers:
        raise ValueError(f"{task} example {example.get('_id')} has no answers")
    return best_score(
        task_spec(task).metric,
        postprocess(task, prediction, first_line),
        answers,
        example.get("all_classes") or (),
    )


def read_jsonl(
    path: Path,
    limit: int | None = None,
    *,
    needs_classes: bool = False,
    text_fields: tuple[str, ...] = (),
    needs_length: bool = False,
    needs_paragraph: bool = False,
) -> list[dict[str, Any]]:
    """Examples of one task file (first ``limit`` only if given).

    Args:
        path: the task's ``<task>.jsonl``.
        limit: read only the first ``limit`` examples.
        needs_classes: the task is scored by classification (TREC): every row must list its
            class names in ``all_classes``.
        text_fields: the fields the task's prompt is built from (``context``, ``input``):
            every row must hold each as a string (it may be empty).
        needs_length: the task is scored per length range (LongBench-E): every row must hold
            its ``length`` (words) as an integer >= 0.
        needs_paragraph: the task is scored by retrieval (PassageRetrieval): every answer
            must name its paragraph (``Paragraph 12``).

    Raises:
        ValueError: a line is not UTF-8 text or not a JSON object, has no ``answers``, lacks
            ``all_classes`` where ``needs_classes``, a string in one of ``text_fields``, a
            ``length`` where ``needs_length`` or a paragraph in an answer where
            ``needs_paragraph``, or repeats another line's ``_id`` (results are keyed by it);
            the message names the file and line. Also when the file holds no example.
    """
    rows = []
    seen_ids: dict[str, int] = {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                # A byte-order mark, as some Windows editors write, opens the file only.
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{number} is not UTF-8 text (byte {err.start} of the line); "
                    "LongBench files are UTF-8: convert it (e.g. iconv -f latin1 -t utf-8) or "
                    "fetch it again"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"{path}:{number} is not valid JSON ({err.msg}); LongBench files hold one "
                    "JSON object per line"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}:{number} is a JSON {type(row).__name__}, not an object with "
                    "input, context and answers"
                )
            answers = row.get("answers")
            if isinstance(answers, str):
                answers = [answers]
            if not (
                isinstance(answers, list) and answers and all(isinstance(a, str) for a in answers)
            ):
                raise ValueError(
                    f"{path}:{number} has no answers to score against (answers: "
                    f"{json.dumps(row.get('answers'))}); LongBench rows hold a list of reference "
                    "answer strings"
                )
            unnamed = [a for a in answers if not PARAGRAPH.search(a)]
            if needs_paragraph and unnamed:
                raise ValueError(
                    f"{path}:{number} has an answer that names no paragraph ({unnamed[0]!r}); "
                    "this task is scored by retrieval, so every answer reads 'Paragraph "
                    "<number>' as in LongBench's passage_retrieval_en files"
                )
            for name in text_fields:
                if not isinstance(row.get(name), str):
                    raise ValueError(
                        f"{path}:{number} has no {name} text for the prompt ({name}: "
                        f"{json.dumps(row.get(name))[:80]}); LongBench rows hold the strings "
                        f"{' and '.join(text_fields)} (fields of this row: {sorted(row)})"
                    )
            classes = row.get("all_classes")
            if needs_classes and not (
                isinstance(classes, list) and classes and all(isinstance(c, str) for c in classes)
            ):
                raise ValueError(
                    f"{path}:{number} has no class names to score against (all_classes: "
                    f"{json.dumps(classes)}); this task is scored by classification, so every "
                    "row lists its classes as LongBench's files do"
                )
            length = row.get("length")
            if needs_length and not valid_length(length):
                raise ValueError(
                    f"{path}:{number} has no valid length (length: {json.dumps(length)}); "
                    "LongBench-E scores each example in the range of its length, so every row "
                    "holds its length in words, an integer >= 0, as LongBench's files do"
                )
            if "_id" in row:
                key = str(row["_id"])
                if key in seen_ids:
                    raise ValueError(
                        f"{path}:{number} repeats the _id {key!r} of line {seen_ids[key]}; "
                        "predictions are kept per _id, so give every example its own"
                    )
                seen_ids[key] = number
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path} holds no examples; fill it or leave its task out of --tasks")
    return rows


def _table_sets(present: Collection[str]) -> list[tuple[list[str], list[str], list[str]]]:
    """``(tasks, paper, rest)`` of each table: LongBench's tasks in ``present``, then
    LongBench-E's (a set without any has no table), with ``paper`` the paper's tasks among them
    (a LongBench-E task by the task it runs) and ``rest`` the synthetic ones; tasks that are
    all synthetic count as ``paper``."""
    tables = []
    for tasks in ([t for t in TASKS if t in present], [t for t in TASK_SETS["e"] if t in present]):
        paper = [t for t in tasks if base_task(t) in PAPER_TASKS] or tasks
        if tasks:
            tables.append((tasks, paper, [t for t in tasks if t not in paper]))
    return tables


def summary_table(scores: dict[str, float]) -> str:
    """Markdown table in the paper's Table 2 order (then the synthetic tasks): task columns,
    their group, the average. LongBench-E runs get a table and an average of their own
    below it (averaged together, the tasks both sets have would count twice).

    In each table ``Avg`` follows the paper's tasks and is their average (with all 14 of
    LongBench, the paper's Table 2 average); the synthetic tasks (``--tasks all``, ``e``) come
    after it, then ``Avg (with synthetic)``, the average of every task of the table. A table of
    synthetic tasks alone has one ``Avg``, of them."""
    tables = []
    for tasks, paper, rest in _table_sets(scores):

        def mean(names: list[str]) -> float:
            return float(np.mean([scores[t] for t in names]))

        # (task, group, score) of each column
        columns = [(task_spec(t).name, task_spec(t).group, scores[t]) for t in paper]
        columns.append(("Avg", "", mean(paper)))
        if rest:
            columns += [(task_spec(t).name, task_spec(t).group, scores[t]) for t in rest]
            columns.append(("Avg (with synthetic)", "", mean(tasks)))
        rows = [
            ["Task", *(name for name, _, _ in columns)],
            ["Group", *(group for _, group, _ in columns)],
            ["Score", *(f"{score:.2f}" for _, _, score in columns)],
        ]
        lines = ["| " + " | ".join(cells) + " |" for cells in rows]
        lines.insert(1, "|" + "---|" * len(rows[0]))
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def count_examples(path: Path) -> int:
    """The number of examples (non-blank lines) in a task file, read in binary (a byte-order
    mark opening it is no example, as in :func:`read_jsonl`)."""
    with path.open("rb") as f:
        return sum(
            1
            for number, line in enumerate(f, 1)
            if (line.removeprefix(codecs.BOM_UTF8) if number == 1 else line).strip()
        )


def limit_note(limit: int, scored: dict[str, int], totals: dict[str, int]) -> str:
    """The line under ``table2.md`` of a ``--limit`` run: that it is a smoke run and how many
    examples each task scored (``scored``), of how many its file holds (``totals``)."""
    return (
        f"--limit {limit}: a smoke run, not comparable with full results; examples scored per "
        "task: " + ", ".join(f"{t} {n} of {totals[t]}" for t, n in scored.items())
    )


def protocol_note(prompts: str | None, first_line: str) -> str:
    """The line under ``table2.md`` that says which prompts and scoring made the scores."""
    wording = (
        f"prompts from {prompts}"
        if prompts
        else "prompts in fot's own wording (not comparable with published LongBench scores: "
        "pass --prompts <LongBench's config/dataset2prompt.json>)"
    )
    lines = (
        "the first line of every prediction scored (the FoX paper's eval.py)"
        if first_line == "all"
        else "the first line scored for the few-shot tasks (LongBench's eval.py; the FoX "
        "paper scores it for every task: --first-line all)"
    )
    return f"Protocol: {wording}; {lines}."


def length_table(by_length: dict[str, dict[str, float | None]]) -> str:
    """Markdown table of the scores per length range: a row per task, a column per range
    (``-`` where a task has no example in the range), then their average over the tasks that
    have one. As in :func:`summary_table`, LongBench-E runs get a table of their own below the
    LongBench tasks' (averaged together, the tasks both sets have would count twice), and in
    each table ``Avg`` averages the paper's tasks, ``Avg (with synthetic)`` all of them."""
    names = [name for name, _, _ in LENGTH_RANGES]

    def cell(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    tables = []
    for tasks, paper, rest in _table_sets(by_length):

        def avg_row(label: str, rows: list[str]) -> str:
            means = []
            for n in names:
                have = [by_length[t][n] for t in rows if by_length[t][n] is not None]
                means.append(float(np.mean(have)) if have else None)
            return f"| {label} | " + " | ".join(cell(m) for m in means) + " |"

        def task_row(t: str) -> str:
            return (
                f"| {task_spec(t).name} | "
                + " | ".join(cell(by_length[t][n]) for n in names)
                + " |"
            )

        lines = ["| Task | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [task_row(t) for t in paper] + [avg_row("Avg", paper)]
        if rest:
            lines += [task_row(t) for t in rest] + [avg_row("Avg (with synthetic)", tasks)]
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``longbench`` command's options."""
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument(
        "--data-dir",
        required=True,
        help="folder with <task>.jsonl files in LongBench's format: unzip LongBench's data.zip, "
        "or on a machine with internet datasets.load_dataset('THUDM/LongBench', task, "
        "split='test').to_json(f'{task}.jsonl') for each task",
    )
    p.add_argument(
        "--tasks",
        default="paper",
        help="comma-separated tasks and sets of tasks (default: %(default)s). Sets: paper (the "
        f"14 of the paper: {', '.join(PAPER_TASKS)}), all (those and "
        f"{', '.join(t for t in TASKS if t not in PAPER_TASKS)}), e (LongBench-E: "
        f"{', '.join(TASK_SETS['e'])}, read from <task>_e.jsonl and also scored per length "
        "range)",
    )
    p.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="prompt token budget without BOS, middle-truncated (default: "
        f"{CONTEXT_LENGTH_HELP}, minus the task's generation length and the BOS token)",
    )
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="first examples per task, for smoke runs (default: all)",
    )
    p.add_argument("--no-bos", action="store_true", help="do not start prompts with BOS")
    p.add_argument(
        "--prompts",
        default=None,
        help="JSON file of prompt templates in the format of LongBench's "
        "config/dataset2prompt.json (task -> template with {context} and {input}), used instead "
        "of fot's own wording (default: fot's, not comparable with published scores): "
        "LongBench's file gives prompts comparable with LongBench's and the FoX paper's",
    )
    p.add_argument(
        "--first-line",
        choices=FIRST_LINE,
        default="few-shot",
        help="score the first line of the predictions of the few-shot tasks (TREC, TriviaQA, "
        "SAMSum; LongBench's eval.py) or of every task (all: the FoX paper's eval.py) "
        "(default: %(default)s)",
    )
    add_run_arguments(p)


def prompt_budgets(
    tasks: list[str], model: torch.nn.Module, *, max_length: int | None, bos_tokens: int
) -> dict[str, int]:
    """Each task's prompt budget in tokens (BOS excluded), checked before any task runs.

    ``max_length`` when given, else the model's context length minus the task's generation
    length and the BOS tokens.

    Raises:
        ValueError: the model names no context length and ``max_length`` is None; a budget
            below 2 tokens; or prompt + generation past a learned position table.
    """
    model_len = model_max_length(model)
    if max_length is None and model_len is None:
        raise ValueError(
            f"the model config has none of {', '.join(CONTEXT_LENGTH_KEYS)}: pass "
            "--max-length (prompt tokens)"
        )
    if max_length is not None and max_length < 2:  # truncate_middle keeps a head and a tail
        raise ValueError(
            f"--max-length {max_length} leaves no room for a prompt: it counts the prompt's "
            "tokens (without BOS and the generated ones); pass 2 or more"
        )
    budgets = {t: max_length or model_len - task_spec(t).max_new_tokens - bos_tokens for t in tasks}
    short = {t: b for t, b in budgets.items() if b < 2}
    table = position_table(model)
    if short:
        # a learned position table as short holds no prompt at any --max-length
        room = table is None or any(
            table[0] - task_spec(t).max_new_tokens - bos_tokens >= 2 for t in short
        )
        fix = (
            "pass --max-length (prompt tokens) or"
            if room
            else f"the model takes at most {table[0]} positions (its learned position table), so"
        )
        raise ValueError(
            f"the model's context length {model_len} leaves no room for the prompts of "
            + ", ".join(f"{t} ({task_spec(t).max_new_tokens} generated tokens)" for t in short)
            + f"; {fix} leave these tasks out of --tasks"
        )
    generated = max(task_spec(t).max_new_tokens for t in tasks)
    longest = max(budgets[t] + task_spec(t).max_new_tokens for t in tasks) + bos_tokens
    if max_length is not None and table is not None and longest > table[0]:
        # --max-length counts the prompt only: name the value that fits the table
        longest_task = max(tasks, key=lambda t: task_spec(t).max_new_tokens)
        fits = table[0] - generated - bos_tokens
        default_fits = model_len is not None and model_len <= table[0]
        fix = (
            f"pass --max-length {fits} or less"
            + (" (or leave it out: the default fits the model)" if default_fits else "")
            if fits >= 2
            else f"leave {longest_task} out of --tasks"
        )
        raise ValueError(
            f"--max-length {max_length} counts the prompt's tokens only: with "
            f"{bos_tokens} BOS and the {generated} tokens {longest_task} generates, inputs are "
            f"{longest} tokens, but this model has a learned position table ({table[1]}) of "
            f"{table[0]} positions and cannot read past it; {fix}"
        )
    check_positions(model, longest, "--max-length with the tasks' generation lengths")
    return budgets


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``longbench``; returns ``{task: score}`` (0--100)."""
    out = Path(args.out)
    tasks = parse_tasks(args.tasks)
    refuse_empty_folder(
        "--data-dir",
        args.data_dir,
        f"that holds the <task>.jsonl files (`{program_name()} "
        "longbench --help` says how to get them)",
    )
    data_dir = Path(args.data_dir)
    if not data_dir.is_dir():  # a mistyped folder: not "lacks <every task>.jsonl"
        raise FileNotFoundError(
            f"--data-dir {args.data_dir!r} "
            f"{'is a file, not a folder' if data_dir.exists() else 'does not exist'}; pass the "
            f"folder that holds the <task>.jsonl files (`{program_name()} longbench --help` "
            "says how to get them)"
        )
    missing = [t for t in tasks if not (data_dir / f"{t}.jsonl").is_file()]
    if missing:
        present = [t for t in tasks if t not in missing]
        only = f", or run the tasks it has with --tasks {','.join(present)}" if present else ""
        raise FileNotFoundError(
            f"{data_dir} lacks {[f'{t}.jsonl' for t in missing]}; see "
            f"`{program_name()} longbench --help` for how to get them{only}"
        )
    if args.prompts is not None and not args.prompts.strip():
        raise ValueError(
            "--prompts '' names no file (an unset variable?); pass LongBench's "
            "config/dataset2prompt.json, or leave --prompts out for fot's own wording"
        )
    templates = load_prompts(args.prompts, tasks) if args.prompts else {}
    # Every task's examples are read (and checked) before the model loads.
    examples = {
        t: read_jsonl(
            data_dir / f"{t}.jsonl",
            args.limit,
            needs_classes=task_spec(t).metric == "classification",
            text_fields=prompt_fields(t, templates.get(t)),
            needs_length=t.endswith("_e"),
            needs_paragraph=task_spec(t).metric == "retrieval",
        )
        for t in tasks
    }
    model, tokenizer = load_checkpoint(
        args.checkpoint, device=pick_device(args.device), dtype=args.dtype
    )
    bos = [] if args.no_bos else [eot_id(tokenizer)]
    budgets = prompt_budgets(tasks, model, max_length=args.max_length, bos_tokens=len(bos))
    # Predictions are keyed by example id: they resume a run of the same checkpoint and
    # prompts only (other tasks or a larger --limit extend it). Only the task files are
    # fingerprinted: other files of --data-dir (e.g. LongBench-E's, added later) do not matter.
    claim_results(
        out,
        "longbench",
        checkpoint=args.checkpoint,
        settings={
            "--data-dir": path_setting(args.data_dir),
            "--max-length": args.max_length,
            "--no-bos": args.no_bos,
            "--dtype": model_dtype(model),
            # recorded when set (records of runs before these options match the defaults);
            # the templates' digest, as the same file name may hold other prompts later
            **(
                {
                    "--prompts": hashlib.sha256(
                        json.dumps(templates, sort_keys=True).encode()
                    ).hexdigest()[:16]
                }
                if templates
                else {}
            ),
            **({"--first-line": args.first_line} if args.first_line != "few-shot" else {}),
        },
        state=["pred_*.jsonl"],
        outputs=[
            "scores.json",
            "scores.csv",
            "table2.md",
            "scores_by_length.json",
            "by_length.md",
        ],
        restart=args.restart,
        data_files={"--data-dir": [f"{t}.jsonl" for t in tasks]},
        defaults={"--prompts": "fot's own wording", "--first-line": "'few-shot'"},
    )
    write_run_config(out, "longbench", vars(args), args.checkpoint)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    scores: dict[str, float] = {}
    by_length: dict[str, dict[str, float | None]] = {}
    for task in tasks:
        spec, budget = task_spec(task), budgets[task]
        log = JsonlLog(out / f"pred_{task}.jsonl")
        for i, ex in enumerate(progress_bar(examples[task], desc=f"longbench {task}", unit="ex")):
            key = ex.get("_id", i)
            if log.done(key):
                continue
            prompt = format_prompt(task, ex, templates.get(task))
            ids = bos + truncate_middle(encode_text(tokenizer, prompt), budget)
            gen = greedy_generate(
                model,
                torch.tensor([ids], device=device),
                max_new_tokens=spec.max_new_tokens,
                eos_token_id=eos,
            )
            pred = decode_text(tokenizer, [t for t in gen if t != eos])
            log.append(
                {
                    "key": key,
                    "prompt_tokens": len(ids),
                    "prediction": pred,
                    "answers": ex.get("answers"),
                    "score": score_example(task, pred, ex, args.first_line),
                }
            )
        # the score of each example asked for, in file order (a log may hold more: --limit)
        scored = {str(r["key"]): r["score"] for r in log}
        keys = [str(ex.get("_id", i)) for i, ex in enumerate(examples[task])]
        scores[task] = 100.0 * float(np.mean([scored[k] for k in keys]))
        lengths = [ex.get("length") for ex in examples[task]]
        if all(valid_length(n) for n in lengths):
            by_length[task] = scores_by_length([scored[k] for k in keys], lengths)
    table = summary_table(scores)
    protocol = protocol_note(args.prompts, args.first_line)
    limited = ""  # a subset (or, past a file's size, all of it): said under each table
    if args.limit is not None:
        totals = {t: count_examples(data_dir / f"{t}.jsonl") for t in scores}
        scored = {t: len(examples[t]) for t in scores}
        limited = "\n\n" + limit_note(args.limit, scored, totals)
        protocol += limited
    write_text_atomic(out / "scores.json", json.dumps(scores, indent=2) + "\n")
    write_text_atomic(out / "table2.md", table + "\n\n" + protocol + "\n")
    write_text_atomic(
        out / "scores.csv",
        "task,name,group,metric,score\n"
        + "".join(
            f"{t},{task_spec(t).name},{task_spec(t).group},{task_spec(t).metric},{s:.4f}\n"
            for t, s in scores.items()
        ),
    )
    print(table)
    print(protocol)
    if by_length:
        write_text_atomic(out / "scores_by_length.json", json.dumps(by_length, indent=2) + "\n")
        write_text_atomic(out / "by_length.md", length_table(by_length) + limited + "\n")
        print("\nScore per length range of the examples' length field (words):")
        print(length_table(by_length))
    else:  # an earlier run's in this folder would read as this run's
        for name in ("scores_by_length.json", "by_length.md"):
            (out / name).unlink(missing_ok=True)
    return scores
