"""Needle in a haystack and passkey retrieval, scored objectively (paper Fig. 6, App. B.3).

Modes:

* ``easy`` -- the needle holds both the question and its answer ("Question: ... Answer: ...");
  the prompt ends with the same question, so the model only has to find and copy (the design
  of the paper's easy mode, which suits base models that were never instruction-tuned).
* ``standard`` -- the needle is the answer sentence alone; the prompt ends with the question.
* ``passkey`` -- a random 5-digit key hidden in filler text; the prompt asks for it.

The easy and standard prompts are in fot's own wording. The paper's end with an instruction
and an answer stem the model continues ("... Answer: The best thing to do in San Francisco
is"); ``--prompt-template`` (:class:`Wording`) takes any wording, e.g. the paper's.

A prompt of exactly ``context_length`` tokens is built in token space: prefix, haystack cut to
fit, needle inserted at ``depth`` percent of the haystack (moved back to the closest sentence or
line end nearby), then the question. Generation is greedy.

Scoring (no judge model), of the first non-empty line of the answer: key-phrase recall
(case-insensitive substring match of the needle's key phrases) and ROUGE-L recall of the
reference answer, mapped to 1--10 like the paper's GPT-4o rubric: 10 when every key phrase is
present, else ``1 + 9 * (kp + rouge) / 2``. Passkey: 10 if the key appears there as a whole
number, else 1.

Haystack text: the offline sample corpus by default; ``--haystack`` takes text files or folders
of ``.txt`` files (e.g. PG19 books: point it at a folder of PG19 ``.txt`` files).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fot.progress import progress_bar
from fot.tokenizer import text_escaping_of
from fot.training.checkpoint import write_text_atomic

from .common import (
    CHECKPOINT_HELP,
    JsonlLog,
    add_label_argument,
    add_run_arguments,
    add_train_length_argument,
    check_fits_memory,
    check_grid,
    check_positions,
    claim_results,
    decode_text,
    encode_text,
    eot_id,
    greedy_generate,
    list_option,
    load_checkpoint,
    model_dtype,
    model_max_length,
    parse_float_list,
    parse_int_list,
    path_setting,
    pick_device,
    plot_label,
    positive_int,
    read_text_file,
    save_figure,
    train_length_option,
    use_agg_backend,
    write_run_config,
)

MODES = ("easy", "standard", "passkey")


def _normalize(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass(frozen=True)
class Wording:
    """A prompt's wording for the easy and standard modes (``--prompt-template``), in place of
    fot's: texts in which ``{question}`` and ``{answer}`` are the needle's (``{{`` and ``}}``
    are braces).

    Attributes:
        needle: the text hidden in the haystack; it holds ``{answer}``.
        suffix: the text after the haystack, which asks for the answer (it may end with the
            start of the answer, for the model to continue).
        prefix: the text before the haystack (after BOS).
    """

    needle: str
    suffix: str
    prefix: str = ""

    def __post_init__(self) -> None:
        for name in ("prefix", "needle", "suffix"):
            text = getattr(self, name)
            if not isinstance(text, str):
                raise ValueError(f"the {name} template must be a string, got {text!r}")
            try:
                parts = [(f, spec, c) for _, f, spec, c in string.Formatter().parse(text)]
            except ValueError as err:
                raise ValueError(
                    f"the {name} template {text!r} is not a format string ({err}): write "
                    "literal braces as {{ and }}"
                ) from None
            fields = {f for f, _, _ in parts if f is not None}
            if fields - {"question", "answer"}:
                raise ValueError(
                    f"the {name} template {text!r} names {sorted(fields - {'question', 'answer'})}"
                    ": only {question} and {answer} are filled in"
                )
            dressed = [
                "{" + f + ("!" + c if c else "") + (":" + spec if spec else "") + "}"
                for f, spec, c in parts
                if f is not None and (spec or c)
            ]
            if dressed:
                raise ValueError(
                    f"the {name} template {text!r} has {dressed}: write {{question}} and "
                    "{answer} without a conversion or format spec (they are inserted as they are)"
                )
            if name == "needle" and "answer" not in fields:
                raise ValueError(
                    f"the needle template {text!r} has no {{answer}}: the needle is the text to "
                    "find"
                )

    def texts(self, question: str, answer: str) -> tuple[str, str, str]:
        """``(prefix, needle, suffix)`` filled with the needle's question and answer."""
        return tuple(  # type: ignore[return-value]
            t.format(question=question, answer=answer)
            for t in (self.prefix, self.needle, self.suffix)
        )


def load_wording(path: str | Path) -> Wording:
    """``--prompt-template``: a JSON object with ``needle`` and ``suffix`` (and optionally
    ``prefix``) templates (:class:`Wording`)."""
    where = f"--prompt-template {str(path)!r}"
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as err:
        raise ValueError(f"{where} cannot be read ({err.strerror or err})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{where} is not JSON ({err})") from None
    example = '{"needle": "\\n{answer}\\n", "suffix": "\\n\\nQuestion: {question} Answer:"}'
    if not isinstance(value, dict) or not {"needle", "suffix"} <= set(value):
        raise ValueError(f"{where} must be a JSON object with needle and suffix, e.g. {example}")
    unknown = sorted(set(value) - {"prefix", "needle", "suffix"})
    if unknown:
        raise ValueError(f"{where} has {unknown}: its keys are prefix, needle and suffix")
    try:
        return Wording(**value)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


@dataclass(frozen=True)
class Needle:
    """A fact to hide and how to ask for it.

    Attributes:
        answer: the fact, as one sentence (also the reference answer for ROUGE-L).
        question: the question whose answer is the fact.
        key_phrases: phrases a correct answer must contain.
        wording: the prompt's wording, or None for fot's (per mode, :func:`needle_texts`).
    """

    answer: str
    question: str
    key_phrases: tuple[str, ...] = field(default_factory=tuple)
    wording: Wording | None = None

    def __post_init__(self) -> None:
        # Without key phrases no answer could score 10 or count as correct; a phrase that is
        # not in the answer could never be recalled from the needle.
        if not self.key_phrases:
            raise ValueError(
                f"needle {self.answer!r} has no key phrases: name the words a correct answer "
                "must contain (--key-phrases 'phrase one,phrase two')"
            )
        absent = [k for k in self.key_phrases if _normalize(k) not in _normalize(self.answer)]
        if absent:
            raise ValueError(
                f"key phrases {absent} do not appear in the needle {self.answer!r}; take them "
                "from the needle's own words"
            )


DEFAULT_NEEDLE = Needle(
    answer="The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on "
    "a sunny day.",
    question="What is the best thing to do in San Francisco?",
    key_phrases=("sandwich", "Dolores Park"),
)

_PASSKEY_FILLER = (
    "The river runs past the old mill. The hills are quiet in the evening. Birds circle over "
    "the fields and come back again. "
)


@dataclass
class NeedlePrompt:
    """A built prompt and where its needle sits.

    Attributes:
        input_ids: the prompt token ids (length == context length).
        needle_start, needle_end: token span of the needle in ``input_ids``.
        haystack_start, haystack_len: token span of the haystack (needle excluded).
        depth: requested depth in percent; ``actual_depth``: realised depth in percent.
        reference: expected answer text; ``key_phrases``: phrases that must appear.
    """

    input_ids: list[int]
    needle_start: int
    needle_end: int
    haystack_start: int
    haystack_len: int
    depth: float
    actual_depth: float
    reference: str
    key_phrases: tuple[str, ...]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return encode_text(tokenizer, text)


def _boundary_ids(tokenizer: Any) -> set[int]:
    """Token ids whose text ends a sentence or line (where a needle may be inserted after)."""
    cache = getattr(tokenizer, "_fot_boundary_ids", None)
    if cache is not None:
        return cache
    ids = set()
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for tok, i in vocab.items():
        text = tokenizer.convert_tokens_to_string([tok])
        if text.rstrip(" ").endswith((".", "!", "?", "\n")):
            ids.add(i)
    with contextlib.suppress(AttributeError):  # some tokenizers refuse new attributes
        tokenizer._fot_boundary_ids = ids
    return ids


# The end of a JSON-escaped line: a backslash and n (``\n``), not preceded by an odd number of
# backslashes (``\\n`` is an escaped backslash and a letter n), then perhaps spaces.
_ESCAPED_LINE_END = re.compile(r"(?<!\\)(?:\\\\)*\\n *$")


def _ends_sentence_or_line(
    tokenizer: Any, hay: Sequence[int], j: int, bounds: set[int], escaping: str
) -> bool:
    """Whether ``hay[:j]`` ends with a sentence or line end (the needle may go at ``j``).

    JSON-escaped text holds no newline token: a line ends with the two characters ``\\n``,
    which are tokens of their own (``\\``, then ``n``), so the text of the last tokens is read.
    """
    if hay[j - 1] in bounds:
        return True
    if escaping != "json":
        return False
    tail = tokenizer.decode(list(hay[max(0, j - 8) : j]))
    return _ESCAPED_LINE_END.search(tail) is not None


def needle_texts(
    mode: str, needle: Needle, passkey: str | None = None
) -> tuple[str, str, str, str, tuple[str, ...]]:
    """The text pieces of a prompt: ``(prefix, needle, suffix, reference, key_phrases)``; in
    the easy and standard modes from ``needle.wording`` where it is set."""
    if mode in ("easy", "standard") and needle.wording is not None:
        return (
            *needle.wording.texts(needle.question, needle.answer),
            needle.answer,
            needle.key_phrases,
        )
    if mode == "easy":
        return (
            "",
            f" Question: {needle.question} Answer: {needle.answer}\n",
            f"\n\nQuestion: {needle.question} Answer:",
            needle.answer,
            needle.key_phrases,
        )
    if mode == "standard":
        return (
            "",
            f" {needle.answer}\n",
            f"\n\nRead the text above and answer the question.\nQuestion: {needle.question}"
            "\nAnswer:",
            needle.answer,
            needle.key_phrases,
        )
    if mode == "passkey":
        if passkey is None:
            raise ValueError("passkey mode needs a passkey")
        return (
            "Somewhere in the long text below is a pass key. Find it and remember it: you "
            "will be asked for it at the end.\n",
            f" The pass key is {passkey}. Remember it: {passkey} is the pass key.\n",
            "\n\nWhat is the pass key? The pass key is",
            passkey,
            (passkey,),
        )
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def build_prompt(
    tokenizer: Any,
    haystack_ids: Sequence[int],
    *,
    context_length: int,
    depth: float,
    mode: str = "easy",
    needle: Needle = DEFAULT_NEEDLE,
    passkey: str | None = None,
    bos_id: int | None = None,
    snap_tokens: int | None = None,
) -> NeedlePrompt:
    """Build one needle prompt of exactly ``context_length`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.
        haystack_ids: haystack token ids (repeated if shorter than needed).
        context_length: total prompt length in tokens (BOS included).
        depth: needle position in percent of the haystack (0 = start, 100 = end).
        mode: ``easy``, ``standard`` or ``passkey``.
        needle: the fact for ``easy``/``standard``.
        passkey: the key for ``passkey`` mode.
        bos_id: token put first (e.g. ``<|endoftext|>``), or None.
        snap_tokens: how far back the needle may move to land after a sentence/line end
            (default ``max(16, 1% of the haystack)``).

    Returns:
        The prompt with the needle's token span.
    """
    if not 0.0 <= depth <= 100.0:
        raise ValueError(f"depth must be a percentage in [0, 100], got {depth}")
    prefix, needle_text, suffix, reference, keys = needle_texts(mode, needle, passkey)
    prefix_ids = ([bos_id] if bos_id is not None else []) + _encode(tokenizer, prefix)
    needle_ids, suffix_ids = _encode(tokenizer, needle_text), _encode(tokenizer, suffix)
    budget = context_length - len(prefix_ids) - len(needle_ids) - len(suffix_ids)
    if budget < 1:
        pieces = context_length - budget
        raise ValueError(
            f"a prompt of {context_length} tokens leaves no room for a haystack: its other "
            f"pieces (BOS, wording, needle, question) take {pieces} tokens; use a length of at "
            f"least {pieces + 1}"
        )
    if len(haystack_ids) == 0:
        raise ValueError("haystack is empty")
    reps = -(-budget // len(haystack_ids))
    hay = (list(haystack_ids) * reps)[:budget]
    # floor: the needle never lands past the depth (depth * budget first: 29 / 100 * 100 is
    # 28.999... in floats, 29 * 100 / 100 is exactly 29)
    point = math.floor(depth * budget / 100.0)
    snap = snap_tokens if snap_tokens is not None else max(16, budget // 100)
    if 0 < point < budget:
        bounds, escaping = _boundary_ids(tokenizer), text_escaping_of(tokenizer)
        for j in range(point, max(point - snap, 0), -1):
            if _ends_sentence_or_line(tokenizer, hay, j, bounds, escaping):
                point = j
                break
    ids = prefix_ids + hay[:point] + needle_ids + hay[point:] + suffix_ids
    start = len(prefix_ids) + point
    return NeedlePrompt(
        input_ids=ids,
        needle_start=start,
        needle_end=start + len(needle_ids),
        haystack_start=len(prefix_ids),
        haystack_len=budget,
        depth=depth,
        actual_depth=100.0 * point / budget,
        reference=reference,
        key_phrases=keys,
    )


def score_response(
    response: str, reference: str, key_phrases: Sequence[str], *, mode: str = "easy"
) -> dict[str, float]:
    """Objective 1--10 score of a needle answer.

    Args:
        response: the generated text (only its first non-empty line is scored).
        reference: the expected answer.
        key_phrases: phrases that a correct answer contains.
        mode: ``passkey`` scores exact key presence only.

    Returns:
        ``{"score": 1..10, "keyphrase_recall": 0..1, "rouge_l_recall": 0..1, "correct": 0/1}``.
    """
    from rouge_score import rouge_scorer

    lines = [ln for ln in response.strip().split("\n") if ln.strip()]
    answer = lines[0] if lines else ""
    norm = _normalize(answer)
    if mode == "passkey":
        # the key as a whole number: 12345678 does not contain the key 45678
        found = float(
            bool(key_phrases)
            and all(re.search(rf"(?<!\d){re.escape(k)}(?!\d)", answer) for k in key_phrases)
        )
        return {
            "score": 1.0 + 9.0 * found,
            "keyphrase_recall": found,
            "rouge_l_recall": found,
            "correct": found,
        }
    if not key_phrases:
        raise ValueError("scoring a needle answer needs at least one key phrase")
    kp = sum(_normalize(k) in norm for k in key_phrases) / len(key_phrases)
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)
    rouge = scorer.score(reference, answer)["rougeL"].recall if answer else 0.0
    good = 1.0 if kp == 1.0 else 0.5 * kp + 0.5 * rouge
    return {
        "score": round(1.0 + 9.0 * good, 3),
        "keyphrase_recall": kp,
        "rouge_l_recall": rouge,
        "correct": float(kp == 1.0),
    }


def load_haystack_text(paths: Sequence[str] | None, max_chars: int) -> str:
    """Haystack text: files/folders of ``.txt`` (e.g. PG19 books) or the sample corpus."""
    pieces: list[str] = []
    total = 0
    if paths:
        files: list[Path] = []
        for p in map(Path, paths):
            if p.is_dir():
                files.extend(sorted(p.rglob("*.txt")))
            elif p.is_file():
                files.append(p)
            else:
                raise FileNotFoundError(f"--haystack {str(p)!r} is neither a file nor a folder")
        if not files:
            raise ValueError(f"--haystack {list(paths)} holds no .txt files")
        texts = (read_text_file(f, "--haystack file") for f in files)
    else:
        from fot.data.sample import sample_texts

        texts = iter(sample_texts())
    for t in texts:
        pieces.append(t)
        total += len(t)
        if total >= max_chars:
            break
    text = "\n\n".join(pieces)[:max_chars]
    if paths and not text.strip():
        raise ValueError(f"--haystack {list(paths)} holds no text (only whitespace)")
    return text


def plot_heatmap(
    records: Sequence[dict[str, Any]],
    out_file: Path,
    *,
    train_length: int | None = None,
    title: str = "",
) -> Path:
    """Heatmap of the mean score over (context length x depth), training length marked."""
    use_agg_backend(out_file)
    import matplotlib.pyplot as plt
    from matplotlib.colors import LinearSegmentedColormap

    lengths = sorted({int(r["context_length"]) for r in records})
    depths = sorted({float(r["depth"]) for r in records})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, L in enumerate(lengths):
            s = [
                r["score"]
                for r in records
                if int(r["context_length"]) == L and float(r["depth"]) == d
            ]
            if s:
                grid[i, j] = float(np.mean(s))
    cmap = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
    fig, ax = plt.subplots(
        figsize=(max(5, 0.7 * len(lengths) + 2), max(3, 0.35 * len(depths) + 1.5))
    )
    im = ax.imshow(grid, cmap=cmap, vmin=1, vmax=10, aspect="auto")
    ax.set_xticks(
        range(len(lengths)),
        [f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in lengths],  # as --lengths reads
        rotation=45,
    )
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    if train_length and lengths[0] <= train_length < lengths[-1]:
        # between the last length <= training length and the next one
        x = np.searchsorted(np.asarray(lengths), train_length, side="right") - 0.5
        ax.axvline(x, color="white", lw=2, ls="--")
        ax.set_xlabel(f"context length (tokens); dashed line: training length {train_length}")
    fig.colorbar(im, ax=ax, label="score (1-10)")
    if title:
        ax.set_title(title, pad=14)
    return save_figure(fig, out_file)


def check_depth_keys(depths: Sequence[float]) -> None:
    """Refuse depths that the saved cells' keys (``f"{L}:{depth:g}:{repeat}"``, 6 significant
    digits) cannot tell apart: the second would be skipped as already done. The key format
    stays, so that saved results resume.

    Raises:
        ValueError: naming the depths and their shared key.
    """
    shared: dict[str, list[float]] = {}
    for d in depths:
        shared.setdefault(f"{d:g}", []).append(d)
    clashes = {key: ds for key, ds in shared.items() if len(ds) > 1}
    if clashes:
        named = "; ".join(
            f"{' and '.join(repr(d) for d in ds)} are both saved as {key}"
            for key, ds in clashes.items()
        )
        raise ValueError(
            f"--depths: {named} (results are keyed by a depth's 6 significant digits, so one "
            "would be skipped as done); list depths that differ within 6 significant digits"
        )


def check_saved_depths(log: JsonlLog, depths: Sequence[float]) -> None:
    """Refuse a depth whose key (6 significant digits) names cells that ``log`` saved for
    another depth: a rerun into the same ``--out`` would skip them as done and report the
    other depth's results.

    Raises:
        ValueError: naming the depth, the saved one and the log.
    """
    saved = {f"{float(r['depth']):g}": float(r["depth"]) for r in log if "depth" in r}
    for d in depths:
        other = saved.get(f"{d:g}")
        if other is not None and other != d:
            raise ValueError(
                f"--depths: {d!r} is saved as {d:g}, the key of the cells saved in {log.path} "
                f"for depth {other!r} (results are keyed by a depth's 6 significant digits); "
                f"pass {other!r} to resume those cells, or give {d!r} its own --out"
            )


def run_grid(
    model: torch.nn.Module,
    tokenizer: Any,
    *,
    lengths: Sequence[int],
    depths: Sequence[float],
    mode: str,
    log: JsonlLog,
    haystack_ids: Sequence[int],
    repeats: int = 1,
    max_new_tokens: int = 32,
    needle: Needle = DEFAULT_NEEDLE,
    bos_id: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Run every (length, depth, repeat) cell not yet in ``log``; return all records."""
    check_depth_keys(depths)
    check_saved_depths(log, depths)
    device = next(model.parameters()).device
    cells = [(L, d, r) for L in lengths for d in depths for r in range(repeats)]
    todo = [c for c in cells if not log.done(f"{c[0]}:{c[1]:g}:{c[2]}")]
    eos = tokenizer.eos_token_id
    for L, d, r in progress_bar(
        todo,
        disable=not progress,
        desc=f"needle ({mode})",
        unit="cell",
        initial=len(cells) - len(todo),
        total=len(cells),
    ):
        rng = random.Random(f"{seed}:{L}:{d}:{r}")
        passkey = str(rng.randint(10000, 99999)) if mode == "passkey" else None
        # Different repeats read the haystack from a different offset, within its first L
        # tokens (more than a prompt of L tokens holds): a cell's prompt does not depend on
        # the grid's other lengths, which set how much haystack text is read.
        pool = list(haystack_ids[:L])
        off = rng.randrange(len(pool)) if r else 0
        hay = pool[off:] + pool[:off]
        prompt = build_prompt(
            tokenizer,
            hay,
            context_length=L,
            depth=d,
            mode=mode,
            needle=needle,
            passkey=passkey,
            bos_id=bos_id,
        )
        ids = torch.tensor([prompt.input_ids], dtype=torch.long, device=device)
        gen = greedy_generate(model, ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
        response = decode_text(tokenizer, [t for t in gen if t != eos])
        scores = score_response(response, prompt.reference, prompt.key_phrases, mode=mode)
        log.append(
            {
                "key": f"{L}:{d:g}:{r}",
                "mode": mode,
                "context_length": L,
                "depth": d,
                "repeat": r,
                "actual_depth": prompt.actual_depth,
                "needle_start": prompt.needle_start,
                "response": response,
                "reference": prompt.reference,
                **scores,
            }
        )
    keys = {f"{c[0]}:{c[1]:g}:{c[2]}" for c in cells}
    return [rec for rec in log if rec["key"] in keys]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``needle`` command's options."""
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument(
        "--mode",
        choices=MODES,
        default="easy",
        help="easy: the needle holds question and answer; standard: the answer only; passkey: "
        "a random 5-digit key in filler text (default: %(default)s)",
    )
    p.add_argument(
        "--lengths",
        default="1k,2k,4k,8k,16k,32k",
        help="context lengths in tokens, comma separated, k = 1024 (default: %(default)s)",
    )
    p.add_argument(
        "--depths",
        default="0,10,20,30,40,50,60,70,80,90,100",
        help="needle depths in percent, comma separated (default: %(default)s)",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="prompts per cell, at different haystack offsets (default: %(default)s)",
    )
    p.add_argument(
        "--haystack",
        nargs="*",
        action="extend",  # --haystack A --haystack B reads both, as --haystack A B does
        default=None,
        help="text files or folders of .txt (e.g. PG19 books), listed after one --haystack or "
        "each after its own (default: the offline sample corpus; passkey mode: a repeated "
        "filler paragraph)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=None,
        help="generated tokens (default: 32, passkey mode 8)",
    )
    p.add_argument(
        "--needle",
        default=None,
        help="custom needle sentence, with --question and --key-phrases (default: the San "
        "Francisco needle: "
        f"{DEFAULT_NEEDLE.answer!r})",
    )
    p.add_argument(
        "--question",
        default=None,
        help=f"the question the needle answers (default: {DEFAULT_NEEDLE.question!r})",
    )
    p.add_argument(
        "--key-phrases",
        default=None,
        help="comma-separated phrases of the needle that a correct answer must contain; "
        "required with --needle (default needle: "
        f"{','.join(DEFAULT_NEEDLE.key_phrases)})",
    )
    p.add_argument(
        "--prompt-template",
        default=None,
        metavar="FILE",
        help="JSON file of the easy/standard prompt's wording, in place of fot's: "
        '{"prefix": ..., "needle": ..., "suffix": ...} with {question} and {answer} filled from '
        "the needle (e.g. the FoX paper's instruction and answer stem; it replaces both modes' "
        "wording, the mode then names the output files; default: fot's wording)",
    )
    p.add_argument("--no-bos", action="store_true", help="do not start prompts with BOS")
    add_train_length_argument(p, "training length marked on the heatmap")
    p.add_argument(
        "--seed", type=int, default=0, help="seed of passkeys and offsets (default: %(default)s)"
    )
    add_label_argument(p, "the plot's title")
    add_run_arguments(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``needle``; returns the summary (mean score and accuracy, per length)."""
    out = Path(args.out)
    lengths = parse_int_list(list_option(args.lengths, "--lengths"), "--lengths")
    depths = parse_float_list(list_option(args.depths, "--depths"))
    # Everything that can be checked without the model is checked before it loads.
    check_grid(lengths, "--lengths", minimum=2)
    check_grid(depths, "--depths", minimum=0.0)
    check_depth_keys(depths)
    bad = [d for d in depths if d > 100.0]
    if bad:
        raise ValueError(f"--depths {args.depths!r}: {bad} outside [0, 100] (percent of haystack)")
    needle = DEFAULT_NEEDLE
    if args.needle or args.question or args.key_phrases:
        if args.mode == "passkey":
            raise ValueError(
                "--needle, --question and --key-phrases are for the easy and standard modes; "
                "passkey mode hides a random key"
            )
        if not (args.needle and args.question and args.key_phrases):
            raise ValueError(
                "a custom needle takes --needle, --question and --key-phrases together (the "
                "key phrases are what a correct answer must contain, e.g. --key-phrases "
                "'sandwich,Dolores Park' for the default needle)"
            )
        keys = tuple(k.strip() for k in args.key_phrases.split(",") if k.strip())
        needle = Needle(args.needle, args.question, keys)
    if args.prompt_template is not None and not args.prompt_template.strip():
        raise ValueError(
            "--prompt-template '' names no file (an unset variable?); pass the JSON file of "
            "the wording, or leave --prompt-template out for fot's own"
        )
    if args.prompt_template:
        if args.mode == "passkey":
            raise ValueError(
                "--prompt-template is for the easy and standard modes; passkey mode has its own "
                "prompt"
            )
        needle = dataclasses.replace(needle, wording=load_wording(args.prompt_template))
    # `--haystack $BOOKS` with BOOKS unset names nothing, `--haystack "$BOOKS"` names '' (read
    # as the current folder): neither is the default haystack, nor the folder it is run in
    if args.haystack is not None and not (args.haystack and all(h.strip() for h in args.haystack)):
        given = " ".join(repr(h) for h in args.haystack)
        raise ValueError(
            f"--haystack {given + ' ' if given else ''}names no file or folder (an unset "
            "variable?); pass the text files or folders of the haystack (e.g. --haystack "
            "pg19/test), or leave --haystack out for the default (the offline sample corpus; "
            "passkey mode: a repeated filler paragraph)"
        )
    train_length = train_length_option(args)
    max_chars = 8 * max(lengths) + 10_000
    filler = args.mode == "passkey" and not args.haystack  # repeated by design
    text = "" if filler else load_haystack_text(args.haystack, max_chars)
    model, tokenizer = load_checkpoint(
        args.checkpoint, device=pick_device(args.device), dtype=args.dtype
    )
    max_new_tokens = args.max_new_tokens or (8 if args.mode == "passkey" else 32)
    what = f"--lengths up to {max(lengths)} with --max-new-tokens {max_new_tokens}"
    check_positions(model, max(lengths) + max_new_tokens - 1, what)
    check_fits_memory(model, max(lengths) + max_new_tokens - 1, what)
    if filler:
        text = (_PASSKEY_FILLER * (max_chars // len(_PASSKEY_FILLER) + 1))[:max_chars]
    haystack_ids = _encode(tokenizer, text)
    if not haystack_ids:
        raise ValueError(f"--haystack {args.haystack} holds no text")
    bos_id = None if args.no_bos else eot_id(tokenizer)
    # The shortest length must leave room for a haystack: said before --out is written.
    try:
        shortest = build_prompt(
            tokenizer,
            haystack_ids,
            context_length=min(lengths),
            depth=0.0,
            mode=args.mode,
            needle=needle,
            passkey="00000" if args.mode == "passkey" else None,
            bos_id=bos_id,
            snap_tokens=0,
        )
    except ValueError as err:  # the length is too short: named as the option the user typed
        raise ValueError(f"--lengths {min(lengths)}: {err}") from None
    # A haystack of real text is cut to fit, never repeated (the model could copy the repeat).
    need = max(lengths) - (min(lengths) - shortest.haystack_len)
    if not filler and len(haystack_ids) < need:
        source = f"--haystack {args.haystack}" if args.haystack else "the sample corpus"
        raise ValueError(
            f"--lengths up to {max(lengths)} needs {need} haystack tokens, but {source} holds "
            f"{len(haystack_ids)} tokens (of {len(text)} characters read); pass more text "
            "with --haystack (e.g. a folder of PG19 books) or lower --lengths"
        )
    # Cells are keyed by (length, depth, repeat): a larger grid extends the saved one, but
    # saved cells resume only a run of the same checkpoint, haystack, needle and generation.
    claim_results(
        out,
        f"needle_{args.mode}",
        checkpoint=args.checkpoint,
        settings={
            "--haystack": [path_setting(h) for h in args.haystack] if args.haystack else None,
            "--needle": needle.answer,
            "--question": needle.question,
            "--key-phrases": list(needle.key_phrases),
            # only when given: results of earlier versions (fot's wording) resume
            **(
                {"--prompt-template": dataclasses.asdict(needle.wording)}
                if needle.wording is not None
                else {}
            ),
            "--no-bos": args.no_bos,
            "--max-new-tokens": max_new_tokens,
            "--seed": args.seed,
            "--dtype": model_dtype(model),
        },
        state=[f"needle_{args.mode}.jsonl"],
        outputs=[f"needle_{args.mode}.csv", f"summary_{args.mode}.json", f"needle_{args.mode}.png"],
        restart=args.restart,
        defaults={"--prompt-template": "fot's own wording"},
    )
    write_run_config(out, "needle", vars(args), args.checkpoint)
    log = JsonlLog(out / f"needle_{args.mode}.jsonl")
    records = run_grid(
        model,
        tokenizer,
        lengths=lengths,
        depths=depths,
        mode=args.mode,
        log=log,
        haystack_ids=haystack_ids,
        repeats=args.repeats,
        max_new_tokens=max_new_tokens,
        needle=needle,
        bos_id=bos_id,
        seed=args.seed,
    )
    train_length = train_length or model_max_length(model)
    rows = [
        f"{r['context_length']},{r['depth']:g},{r['repeat']},{r['score']},{r['correct']}\n"
        for r in records
    ]
    write_text_atomic(
        out / f"needle_{args.mode}.csv",
        "context_length,depth,repeat,score,correct\n" + "".join(rows),
    )
    summary = {
        "mode": args.mode,
        "cells": len(records),
        "mean_score": float(np.mean([r["score"] for r in records])),
        "accuracy": float(np.mean([r["correct"] for r in records])),
        "mean_score_by_length": {
            str(L): float(np.mean([r["score"] for r in records if r["context_length"] == L]))
            for L in lengths
        },
    }
    write_text_atomic(out / f"summary_{args.mode}.json", json.dumps(summary, indent=2) + "\n")
    plot_heatmap(
        records,
        out / f"needle_{args.mode}.png",
        train_length=train_length,
        title=f"{plot_label(args)}: needle ({args.mode})",
    )
    print(json.dumps({k: summary[k] for k in ("mode", "cells", "mean_score", "accuracy")}))
    return summary
