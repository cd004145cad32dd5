"""LongBench's metrics, written from their definitions (no GPL dependency).

* :func:`qa_f1` -- token-level F1 after SQuAD-style normalisation (lower case, no punctuation,
  no articles, single spaces).
* :func:`rouge_l` -- ROUGE-L F-measure as LongBench computes it (through the ``rouge``
  package): summary-level ROUGE-L over sentences split at ".", words split at spaces with
  case and other punctuation kept, and distinct words counted (see :func:`rouge_l`).
* :func:`classification_score` -- which class names appear in the prediction; a class that is
  a strict substring of the true class does not count; score ``1 / #matches`` if the true
  class is among the matches.
* :func:`code_similarity` -- first line of the prediction that is not a comment/fence, compared
  to the reference with :func:`fuzzy_ratio`.
* :func:`fuzzy_ratio` -- ``round(100 * 2 * LCS / (len(a) + len(b)))`` with LCS the longest common
  character subsequence: the normalised Indel similarity that ``fuzz.ratio`` computes.
* :func:`count_score` / :func:`retrieval_score` (the synthetic tasks) -- of the numbers written
  in the prediction, the share that equals the answer (the count, or the paragraph number).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation and the articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction_tokens: Sequence[str], reference_tokens: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists (0 when nothing overlaps)."""
    common = Counter(prediction_tokens) & Counter(reference_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction_tokens)
    recall = same / len(reference_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str, **_: object) -> float:
    """Token F1 between normalised prediction and reference (LongBench ``qa_f1_score``)."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def _rouge_sentences(text: str) -> list[list[str]]:
    """Sentences of ``text`` as word lists, split the way LongBench's ROUGE splits them.

    Pieces between "." that are not empty, whitespace runs collapsed to one space, words split
    at single spaces (a blank piece is thus one empty word). No lower-casing.
    """
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """The words of one longest common subsequence of ``ref`` and ``hyp``.

    Which LCS (when there are several) matters, since the words of several are united: walking
    back from the ends, a match is taken, else the step that keeps the longer LCS, and on a tie
    the step back in ``hyp`` (the choice of the ``rouge`` package that LongBench uses).
    """
    table = [[0] * (len(hyp) + 1) for _ in range(len(ref) + 1)]
    for i, r in enumerate(ref, 1):
        row, prev = table[i], table[i - 1]
        for j, h in enumerate(hyp, 1):
            row[j] = prev[j - 1] + 1 if r == h else max(prev[j], row[j - 1])
    words = set()
    i, j = len(ref), len(hyp)
    while i and j:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l(prediction: str, reference: str, **_: object) -> float:
    """LongBench's ROUGE-L F-measure in [0, 1]: summary-level ROUGE-L of the ``rouge`` package.

    Both texts are split into sentences at "." (:func:`_rouge_sentences`). The overlap is the
    number of distinct words in the union of the LCSs of every (reference sentence, prediction
    sentence) pair; precision and recall divide it by the number of distinct words of the
    prediction and of the reference; ``F = 2 P R / (P + R + 1e-8)``. A text without a sentence
    (empty, or only dots) scores 0, as LongBench scores the ``rouge`` package's error there.
    """
    hyp, ref = _rouge_sentences(prediction), _rouge_sentences(reference)
    if not hyp or not ref:
        return 0.0
    overlap: set[str] = set()
    for r in ref:
        for h in hyp:
            overlap |= _lcs_words(r, h)
    precision = len(overlap) / len({w for s in hyp for w in s})
    recall = len(overlap) / len({w for s in ref for w in s})
    return 2.0 * (precision * recall / (precision + recall + 1e-8))


def classification_score(
    prediction: str, reference: str, *, all_classes: Sequence[str], **_: object
) -> float:
    """LongBench's classification score (e.g. TREC question types).

    Every class name found in the prediction that is a strict substring of the true class is
    dropped. LongBench's own loop removes them from the list it is iterating over, so it keeps
    such a name when it directly follows another one it removed; fot drops them all. The two
    agree wherever no class name lies inside another: none of TREC's 50 does, and TREC is the
    only task of fot's LongBench suite scored this way.

    Args:
        prediction: generated text.
        reference: the true class name.
        all_classes: every class name of the task.
    """
    if not all_classes:
        raise ValueError("classification_score needs the task's class names (all_classes)")
    matches = [c for c in all_classes if c in prediction]
    matches = [c for c in matches if not (c in reference and c != reference)]
    return 1.0 / len(matches) if reference in matches else 0.0


def _lcs_length(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ch in a:
        cur = [0]
        for j, bj in enumerate(b):
            cur.append(prev[j] + 1 if ch == bj else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def fuzzy_ratio(a: str, b: str) -> int:
    """Similarity 0--100: ``100 * 2 * LCS(a, b) / (len(a) + len(b))``, rounded.

    Identical strings give 100 (two empty strings included); one empty string gives 0. The
    floating-point steps are those of ``fuzzywuzzy.fuzz.ratio`` over python-Levenshtein
    (LongBench's code similarity): one minus the insert/delete distance over the total length,
    times 100, rounded half to even; an exact tie such as 7.5 then lands on the side that float
    arithmetic puts it (7 there).
    """
    if a == b:
        return 100
    if not a or not b:
        return 0
    total = len(a) + len(b)
    similarity = 1.0 - (total - 2 * _lcs_length(a, b)) / total
    return round(100 * similarity)


def code_similarity(prediction: str, reference: str, **_: object) -> float:
    """LongBench ``code_sim_score``: fuzzy ratio of the first non-comment line, in [0, 1]."""
    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return fuzzy_ratio(line, reference) / 100.0


_NUMBER = re.compile(r"\d+")
PARAGRAPH = re.compile(r"Paragraph (\d+)")
"""How a PassageRetrieval answer names its paragraph (``Paragraph 12``)."""


def _share_equal_to(prediction: str, answer: str) -> float:
    numbers = _NUMBER.findall(prediction)
    return sum(n == answer for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, reference: str, **_: object) -> float:
    """LongBench ``count_score`` (PassageCount): the share of the numbers (digit runs) in the
    prediction that equal the reference count; 0 when the prediction holds none."""
    return _share_equal_to(prediction, reference)


def retrieval_score(prediction: str, reference: str, **_: object) -> float:
    """LongBench ``retrieval_score`` (PassageRetrieval): the reference names a paragraph
    (``"Paragraph 12"``); the share of the numbers in the prediction that equal its number."""
    named = PARAGRAPH.search(reference)
    if named is None:
        raise ValueError(
            f"retrieval answer {reference!r} names no paragraph; LongBench's passage "
            "retrieval answers read 'Paragraph <number>'"
        )
    return _share_equal_to(prediction, named.group(1))


METRICS = {
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "classification": classification_score,
    "code_sim": code_similarity,
    "count": count_score,
    "retrieval": retrieval_score,
}


def best_score(
    metric: str,
    prediction: str,
    references: Sequence[str],
    all_classes: Sequence[str] | None = None,
) -> float:
    """Max of ``metric`` over the references (LongBench scores against every answer)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {sorted(METRICS)}")
    if not references:
        raise ValueError("no reference answers")
    fn = METRICS[metric]
    return max(fn(prediction, ref, all_classes=all_classes or ()) for ref in references)
