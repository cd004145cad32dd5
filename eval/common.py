"""Pieces shared by every evaluation command.

Checkpoint loading, device/dtype choice, per-token cross-entropy for any Hugging Face causal
LM, greedy generation, resumable JSONL result logs, the record that ties resumable results to
the checkpoint and settings that made them (:func:`claim_results`) and the ``run_config.json``
written next to every result.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import datetime as _dt
import fnmatch
import hashlib
import json
import math
import os
import platform
import sys
import weakref
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fot.data.zarr_store import is_url
from fot.errors import FotError, MissingPackageError, cannot_write
from fot.export import not_exported_message
from fot.interrupt import check_stop
from fot.provenance import git_sha, library_versions, sweep_job_label
from fot.tokenizer import (
    TEXT_ESCAPING_KEY,
    escape_text,
    replace_lone_surrogates,
    text_escaping_of,
    unescape_text,
)
from fot.training.checkpoint import RunFolderLock, written_whole

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


CONTEXT_LENGTH_KEYS = (
    "train_length",
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
)
"""Config fields read, in this order, as a model's context length (:func:`model_max_length`).

fot's trainer writes ``train_length`` (the training sequence length) into exported configs;
``max_position_embeddings`` of a FoT config is only the RoPE table size (65536 by default).
"""

CONTEXT_LENGTH_HELP = (
    "the model's context length: the first of "
    + ", ".join(CONTEXT_LENGTH_KEYS)
    + " in its config.json"
)
"""How ``--help`` texts describe a default taken from :func:`model_max_length`."""

DEVICE_HELP = (
    "torch device, e.g. cuda, cuda:1 or cpu (default: CUDA when present, cuda:LOCAL_RANK "
    "under torchrun, else CPU)"
)
DTYPE_HELP = (
    "float32, bfloat16, float16 or auto (default: %(default)s; auto: bfloat16 on CUDA, float32 "
    "on CPU)"
)
RESTART_HELP = (
    "start over: move this command's earlier results in --out to --out/superseded/ (default: "
    "resume results of the same checkpoint and settings, refuse those of others)"
)
OUT_HELP = (
    "results folder; rerunning with the same checkpoint and settings resumes from it, other "
    "checkpoints or settings are refused (see --restart)"
)


STORAGE_OPTIONS_HELP = (
    "options of the filesystem of a URL --data, as a JSON object: credentials, e.g. "
    '{"token": "anon"} or {"token": "/path/key.json"} for gs://, {"key": ..., "secret": ...} '
    'for s3://, {"headers": {...}} for https:// (default: none; gcsfs then signs in as gcloud '
    "does). run_config.json records their names, not their values"
)


def json_object(text: str) -> dict[str, Any]:
    """An ``argparse`` type for a JSON object (``--storage-options``).

    Raises:
        argparse.ArgumentTypeError: not JSON, or JSON that is not an object.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object such as \'{{"token": "anon"}}\', got {text!r} ({err})'
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f'expected a JSON object such as \'{{"token": "anon"}}\', got {text!r}'
        )
    return value


def add_label_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--label``: the name of the checkpoint in ``what`` (a plot's title or legend);
    :func:`plot_label` reads it."""
    p.add_argument(
        "--label",
        default=None,
        help=f"name of the checkpoint in {what} (default: the checkpoint folder's name; RUN "
        "for a trainer export RUN/hf, the swept overrides for a sweep job's export)",
    )


def add_train_length_argument(p: argparse.ArgumentParser, what: str) -> None:
    """``--train-length``: ``what`` (the training length a plot marks), by default the
    model's context length; :func:`train_length_option` reads it."""
    p.add_argument(
        "--train-length",
        type=str,
        default=None,
        help=f"{what} (default: {CONTEXT_LENGTH_HELP})",
    )


def train_length_option(args: argparse.Namespace) -> int | None:
    """``--train-length`` in tokens (:func:`length_option`), or None where it is not given.

    Raises:
        ValueError: not one length of at least 1 token (naming the option).
    """
    given = args.train_length is not None  # an empty value is refused, not the default
    return length_option(args.train_length, "--train-length") if given else None


def plot_label(args: argparse.Namespace) -> str:
    """``--label`` if given, else :func:`checkpoint_label` of ``args.checkpoint``."""
    return args.label or checkpoint_label(args.checkpoint)


def add_storage_options_argument(p: argparse.ArgumentParser) -> None:
    """``--storage-options JSON``: the filesystem options of a URL ``--data``."""
    p.add_argument(
        "--storage-options",
        type=json_object,
        default=None,
        metavar="JSON",
        help=STORAGE_OPTIONS_HELP,
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """The options every resumable command shares: ``--out``, ``--restart``, ``--device`` and
    ``--dtype``."""
    p.add_argument("--out", required=True, help=OUT_HELP)
    p.add_argument("--restart", action="store_true", help=RESTART_HELP)
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)


def pick_device(name: str | None = None) -> torch.device:
    """The device to evaluate on: ``name`` if given, else CUDA when present, else CPU.

    Under ``torchrun`` (``LOCAL_RANK`` set) the default is ``cuda:LOCAL_RANK``.
    """
    if name:
        try:
            device = torch.device(name)
        except RuntimeError:
            raise ValueError(
                f"--device {name!r} is not a torch device; use e.g. cuda, cuda:1 or cpu"
            ) from None
        backend = getattr(torch, device.type, None) if device.type != "cpu" else None
        if device.type not in ("cpu", "cuda") and not (
            backend is not None and hasattr(backend, "is_available") and backend.is_available()
        ):
            raise ValueError(
                f"--device {name!r}: models cannot be evaluated on {device.type!r} here; use "
                "cuda, cuda:N or cpu (or leave --device out)"
            )
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"--device {name!r} but this machine has no usable CUDA device (or torch "
                    "is a CPU build); pass --device cpu or leave --device out"
                )
            count = torch.cuda.device_count()
            if device.index is not None and device.index >= count:
                raise ValueError(
                    f"--device {name!r} but this machine has {count} CUDA device(s); pass "
                    f"cuda:0 ... cuda:{count - 1}"
                )
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def parse_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """Parse ``--dtype``; the default is bfloat16 on CUDA and float32 on CPU."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name!r} is not one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[name]


def check_checkpoint_dir(path: str | os.PathLike) -> Path:
    """Raise a clear error unless ``path`` is an exported Hugging Face checkpoint folder."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(
            f"checkpoint {str(p)!r} is not a folder; pass a folder written by fot.export.export_hf "
            "(or any save_pretrained folder) holding config.json, weights and a tokenizer"
        )
    if not (p / "config.json").is_file():
        raise FileNotFoundError(not_exported_message(p))
    return p


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _is_tokenizer_file(f: Path) -> bool:
    """Whether ``f`` is a file a tokenizer can be read from: ``tokenizer.json``,
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``vocab.json`` / ``vocab.txt`` /
    ``merges.txt``, a sentencepiece ``*.model`` or a ``*.tiktoken`` file."""
    name = f.name
    return f.is_file() and (
        "token" in name or "vocab" in name or name == "merges.txt" or f.suffix == ".model"
    )


def _no_tokenizer_message(p: Path, model_type: Any) -> str:
    """Why folder ``p`` (config and weights, no tokenizer file) cannot be evaluated, and how
    to add the tokenizer: fot's GPT-2 tokenizer for a fot model, the model's own otherwise."""
    from fot.models.fla_baselines import FLA_MODEL_TYPES

    head = (
        f"checkpoint {str(p)!r} holds no tokenizer (no tokenizer_config.json, tokenizer.json or "
        "vocab files; model.save_pretrained writes none)"
    )
    if model_type == "fot" or model_type in FLA_MODEL_TYPES:
        return (
            f"{head}: write fot's GPT-2 tokenizer into it with `python -c \"from fot.tokenizer "
            f'import save_hf_tokenizer; save_hf_tokenizer({str(p)!r})"` (add '
            "text_escaping='json' for a model trained on JSON-escaped text such as "
            "LongCrawl64), or export the model with fot.export.export_hf(model, dir), which "
            "writes it"
        )
    return (
        f"{head}: save the model's tokenizer into it (tokenizer.save_pretrained({str(p)!r})) "
        "or copy its tokenizer files there"
    )


def _damaged_tokenizer_error(p: Path, err: BaseException) -> ValueError:
    """The error for tokenizer files in ``p`` that ``AutoTokenizer`` cannot read: a GPT-2
    ``vocab.json`` without its ``merges.txt`` (or the reverse), or a cut-short copy of a file,
    named (:func:`fot.tokenizer.unreadable_tokenizer_file`). transformers says only "`vocab` and `merges`
    must be both be from memory or both filenames", or the tokenizers library raises a bare
    ``Exception`` (a traceback) that names no file."""
    files = sorted(f.name for f in p.iterdir() if _is_tokenizer_file(f))
    pair = [name for name in ("vocab.json", "merges.txt") if (p / name).is_file()]
    from fot.tokenizer import unreadable_tokenizer_file

    unreadable = unreadable_tokenizer_file(p)
    if len(pair) == 1 and not (p / "tokenizer.json").is_file():
        missing = ({"vocab.json", "merges.txt"} - set(pair)).pop()
        what = f"{pair[0]} is there but {missing} is missing"
        fix = f"copy {missing} from the export"
    elif unreadable is not None:
        name, reason = unreadable
        what = f"{name} cannot be read ({reason}): the copy is cut short or damaged"
        fix = f"copy {name} from the export again"
    else:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        what = f"its files cannot be read ({reason})"
        fix = (
            "copy the tokenizer files (vocab.json and merges.txt, or tokenizer.json) from the "
            "export again"
        )
    return ValueError(
        f"the tokenizer in {str(p)!r} cannot be loaded: {what} (tokenizer files there: "
        f"{files}); {fix}, or export the checkpoint again"
    )


def _merges_cut_short(p: Path, tokenizer: Any) -> str | None:
    """The error of a GPT-2 style ``merges.txt`` in ``p`` cut short at a line end: it loads,
    but the tokens of the lost merges are never produced, so texts tokenize into other, more
    pieces than the model was trained on (no error from transformers). Every token of
    ``vocab.json`` longer than one character that is no added or special token is the result of
    a merge; None where each is (or where the folder's tokenizer is not read from these files)."""
    if (p / "tokenizer.json").is_file() or not (p / "merges.txt").is_file():
        return None
    try:
        vocab = json.loads((p / "vocab.json").read_text(encoding="utf-8"))
        lines = (p / "merges.txt").read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError):
        return None  # the tokenizer read them: nothing to say here
    if not isinstance(vocab, dict):
        return None
    merged = {"".join(line.split(" ")) for line in lines if not line.startswith("#version")}
    added = set(tokenizer.get_added_vocab())
    unmade = [t for t in vocab if len(t) > 1 and t not in merged and t not in added]
    if not unmade:
        return None
    return (
        f"the tokenizer in {str(p)!r} cannot be used: merges.txt has {len(merged)} merges, and "
        f"{len(unmade)} tokens of vocab.json (e.g. {unmade[-1]!r}) are made by none of them: "
        "merges.txt is cut short, and texts would tokenize into other tokens than the model "
        "was trained on; copy merges.txt from the export again, or export the checkpoint again"
    )


def checkpoint_label(path: str | os.PathLike) -> str:
    """A short name of a checkpoint for legends and titles: the folder name, for fot's
    trainer export ``<run>/hf`` the run folder's name (every such export is called ``hf``), and
    for a hub download (``.../models--OWNER--NAME/snapshots/<commit>``) the repository's name."""
    p = Path(path).resolve()
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.split("--", 2)[-1]
    if p.name == "hf" and p.parent.name:
        return sweep_job_label(p.parent) or p.parent.name
    return p.name


CHECKPOINT_HELP = (
    "exported HF checkpoint folder (<run>/hf, python -m fot.export or fot.convert output, any "
    "causal LM AutoModelForCausalLM loads), a checkpoint folder of the paper's code (FoX, "
    "Transformer, DeltaNet, HGRN2, Mamba-2; converted on the fly), or a hub repository id "
    "(owner/name; downloaded)"
)
"""The help of every command's CHECKPOINT argument (what :func:`load_checkpoint` takes)."""


def load_checkpoint(
    path: str | os.PathLike,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
) -> tuple[torch.nn.Module, Any]:
    """Load an exported checkpoint folder with ``AutoModelForCausalLM``/``AutoTokenizer``.

    ``import fot`` runs first so that FoT model types are registered with the Auto classes. A
    checkpoint folder of the paper's code (zhixuan-lin/forgetting-transformer, which loads only
    with its package: FoX, Transformer, DeltaNet, HGRN2, Mamba-2) is converted on the fly, as
    ``python -m fot.convert`` converts it (GPT-2 tokenizer, JSON text escaping as
    LongCrawl64's), with a note on stderr; so is a FoX folder of flash-linear-attention
    (``forgetting_transformer``), with its own tokenizer files.

    Args:
        path: folder with ``config.json``, weights and a tokenizer (a paper checkpoint: no
            tokenizer needed; a folder without tokenizer files, as ``save_pretrained`` writes
            it, is refused with the command that adds fot's).
        device: where to put the model (default: :func:`pick_device`).
        dtype: torch dtype or its name (default: bf16 on CUDA, fp32 on CPU). The FLA
            baselines (DeltaNet, HGRN2, Mamba-2, Samba) keep float32 weights and run under
            autocast to a 16-bit dtype instead (``model.compute_dtype``): FLA's layers compute
            some gates in the weights' dtype.

    Returns:
        ``(model, tokenizer)``; the model is in eval mode on ``device``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import fot  # noqa: F401 - registers the FoT model types with the Auto classes

    p = check_checkpoint_dir(path)
    try:
        config = json.loads((p / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(
            f"{str(p / 'config.json')!r} is not valid JSON ({err}); the export is damaged: "
            "export the checkpoint again (fot.export.export_hf or save_pretrained)"
        ) from None
    weights = [f.name for f in p.iterdir() if f.suffix in _WEIGHT_SUFFIXES and f.is_file()]
    if not weights:
        raise FileNotFoundError(
            f"checkpoint {str(p)!r} holds no weights (no *.safetensors or *.bin file); copy "
            "the whole exported folder, or export it again"
        )
    dev = torch.device(device) if device is not None else pick_device()
    dt = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype, dev)
    from fot.convert import PAPER_MODEL_TYPES

    if isinstance(config, dict) and config.get("model_type") in PAPER_MODEL_TYPES:
        return _load_paper_checkpoint(p, config["model_type"], dev, dt)
    from fot.models.fla_baselines import FLA_MODEL_TYPES

    # FLA's layers compute some gates in the weights' dtype: 16-bit FLA baselines run under
    # autocast over float32 weights, as fot trains them (FoTMamba2ForCausalLM.compute_dtype)
    fla = config.get("model_type") in FLA_MODEL_TYPES
    autocast = fla and dt in (torch.bfloat16, torch.float16)
    if config.get("model_type") != "fot":
        # Exported FLA baselines (mamba2, deltanet, ...) load through fot's wrappers, which
        # are registered on demand (importing fla is slow and needs triton).
        from fot.models.fla_baselines import register_auto_classes

        with contextlib.suppress(ImportError):
            register_auto_classes()
    if not any(_is_tokenizer_file(f) for f in p.iterdir()):
        # transformers' own error blames a missing sentencepiece / tiktoken package
        raise FileNotFoundError(_no_tokenizer_message(p, config.get("model_type")))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p))
    except ImportError:
        raise  # a tokenizer package the checkpoint's tokenizer needs: its own message
    except Exception as err:  # the tokenizers library raises a plain Exception
        raise _damaged_tokenizer_error(p, err) from err
    text_escaping_of(tokenizer)  # a bad fot_text_escaping is named before the model loads
    cut_short = _merges_cut_short(p, tokenizer)
    if cut_short:
        raise ValueError(cut_short)
    vocab = config.get("vocab_size")
    if len(tokenizer) < 2 or (isinstance(vocab, int) and len(tokenizer) < vocab // 2):
        # e.g. a GPT-2 tokenizer without vocab.json / merges.txt loads with one token and
        # encodes every text to nothing
        files = sorted(f.name for f in p.iterdir() if "token" in f.name or f.suffix == ".txt")
        raise ValueError(
            f"the tokenizer in {str(p)!r} has {len(tokenizer)} token(s) for a model of "
            f"{vocab} (tokenizer files there: {files}): its vocabulary files are missing or "
            "damaged; copy them from the export (vocab.json and merges.txt, or tokenizer.json) "
            "or export the checkpoint again"
        )
    _record_model_vocab(tokenizer, vocab)
    from safetensors import SafetensorError

    from fot.convert import FLA_MODEL_TYPE

    try:
        if config.get("model_type") == FLA_MODEL_TYPE:
            model = _load_fla_checkpoint(p, dt)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                str(p), dtype=torch.float32 if autocast else dt
            )
    except torch.OutOfMemoryError:
        raise
    except (OSError, RuntimeError, SafetensorError) as err:
        # a truncated or damaged weight file, a missing shard, tensors of another shape
        raise ValueError(
            f"the weights in {str(p)!r} ({', '.join(sorted(weights))}) cannot be loaded "
            f"({str(err)[:300]}): the copy is incomplete or damaged; copy or export the "
            "checkpoint again"
        ) from err
    if autocast:
        model.compute_dtype = dt
    if (
        type(model).__module__.startswith("fla.")
        and dev.type == "cpu"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):  # its first forward pass would stop with Triton's "0 active drivers" traceback
        raise ValueError(
            f"checkpoint {str(p)!r} is a model of flash-linear-attention "
            f"({type(model).__name__}), whose layers run Triton kernels: run it on a CUDA "
            "GPU, or on the CPU set TRITON_INTERPRET=1 for the command (Triton's interpreter, "
            "slow)"
        )
    model.to(dev).eval()
    return model, tokenizer


MODEL_VOCAB_ATTR = "fot_model_vocab"
"""Attribute :func:`load_checkpoint` sets on the tokenizer: the model's vocabulary size, which
:func:`encode_text` checks its ids against."""


def _record_model_vocab(tokenizer: Any, vocab: Any) -> None:
    """Let :func:`encode_text` refuse ids the model cannot embed (a tokenizer with more tokens
    than the model: an IndexError deep in the embedding otherwise)."""
    if isinstance(vocab, int) and not isinstance(vocab, bool) and len(tokenizer) > vocab:
        setattr(tokenizer, MODEL_VOCAB_ATTR, vocab)


def _load_paper_checkpoint(
    p: Path, model_type: str, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, Any]:
    """A checkpoint folder of the paper's code as ``python -m fot.convert`` converts it."""
    import tempfile

    from transformers import AutoTokenizer

    from fot.convert import PAPER_BASELINE_MODEL_TYPES, from_paper, pruning_note, read_config
    from fot.tokenizer import save_hf_tokenizer

    baseline = model_type in PAPER_BASELINE_MODEL_TYPES
    autocast = baseline and dtype in (torch.bfloat16, torch.float16)
    model = from_paper(p, dtype=None if autocast else dtype)
    if autocast:  # as load_checkpoint runs exported FLA baselines
        model.compute_dtype = dtype
    with tempfile.TemporaryDirectory() as tmp:
        max_len = getattr(model.config, "max_position_embeddings", None)  # Mamba-2 has none
        save_hf_tokenizer(tmp, model_max_length=max_len, text_escaping="json")
        tokenizer = AutoTokenizer.from_pretrained(tmp)
    _record_model_vocab(tokenizer, model.config.vocab_size)
    print(
        f"{p} is a checkpoint of the paper's code (model_type {model_type}): converted on the "
        "fly as python -m fot.convert converts it, with JSON text escaping as in LongCrawl64; "
        "for a model trained on unescaped text, run python -m fot.convert SRC OUT "
        "--text-escaping none and evaluate OUT",
        file=sys.stderr,
    )
    note = pruning_note(read_config(p))
    if note:
        print(note, file=sys.stderr)
    return model.to(device).eval(), tokenizer


def _load_fla_checkpoint(p: Path, dtype: torch.dtype) -> torch.nn.Module:
    """A FoX folder of flash-linear-attention as ``python -m fot.convert`` converts it: FLA's
    own class runs Triton kernels only (on the CPU a traceback: "0 active drivers")."""
    from fot.convert import FLA_MODEL_TYPE, from_fla

    model = from_fla(p, dtype=dtype)
    print(
        f"{p} is a FoX checkpoint of flash-linear-attention (model_type {FLA_MODEL_TYPE}): "
        "converted on the fly as python -m fot.convert converts it, to run on fot's kernels "
        "(its own tokenizer files)",
        file=sys.stderr,
    )
    return model


def context_length_key(model: torch.nn.Module) -> str | None:
    """The first key of :data:`CONTEXT_LENGTH_KEYS` whose value in the model's config is a
    positive int (``train_length`` before ``max_position_embeddings``), else ``None``."""
    cfg = getattr(model, "config", None)
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return key
    return None


def model_max_length(model: torch.nn.Module, default: int | None = None) -> int | None:
    """The model's context length: the config value :func:`context_length_key` names, else
    ``default``."""
    key = context_length_key(model)
    return getattr(model.config, key) if key else default


def position_table(model: torch.nn.Module) -> tuple[int, str] | None:
    """The longest input a model with a learned position table takes, and the table's name.

    Models with absolute learned positions (GPT-2's ``wpe``, OPT's ``embed_positions``, BERT-
    style ``position_embeddings``) fail with an index error past their table; rotary models
    (FoT, Llama) have no such table and return ``None``.
    """
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Embedding) and (leaf == "wpe" or "position" in leaf):
            return module.num_embeddings - int(getattr(module, "offset", 0)), name
    return None


def check_positions(model: torch.nn.Module, positions: int, what: str) -> None:
    """Refuse inputs longer than the model's learned position table (before any work starts).

    Args:
        positions: the longest input (prompt and generated tokens) the command will feed.
        what: the options that set it, for the message (e.g. ``"--length 4096"``).

    Raises:
        ValueError: ``positions`` exceeds the table; the message names its size.
    """
    table = position_table(model)
    if table is not None and positions > table[0]:
        raise ValueError(
            f"{what} needs inputs of {positions} tokens, but this model has a learned position "
            f"table ({table[1]}) of {table[0]} positions and cannot read past it; choose values "
            f"that keep inputs within {table[0]} tokens"
        )


def eot_id(tokenizer: Any) -> int:
    """The end-of-text id used as BOS/separator (GPT-2: 50256)."""
    for attr in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            return int(value)
    raise ValueError(
        "the checkpoint's tokenizer has neither bos_token_id nor eos_token_id; set one in its "
        "tokenizer_config.json"
    )


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens, however long, escaped as the model's
    training text was (``fot_text_escaping`` in the checkpoint's ``tokenizer_config.json``:
    LongCrawl64-trained models read JSON-escaped text; see ``fot.tokenizer.escape_text``).
    A special token's text in ``text`` (``<|endoftext|>``) is ordinary text, as in training
    data (``python -m fot.data.prepare`` and ``data=hf`` tokenize it so), not the special id;
    a lone UTF-16 surrogate (from a JSON file's ``\\ud800`` escape) is U+FFFD, as there.

    The commands cut what they encode to fit (a haystack, a middle-truncated LongBench
    context, lm-eval's rolling windows): transformers' warning that a text longer than the tokenizer's
    ``model_max_length`` "will result in indexing errors" would be false, so it is not asked for.
    """
    text, _ = replace_lone_surrogates(escape_text(text, text_escaping_of(tokenizer)))
    ids = list(
        tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True, verbose=False)
    )
    vocab = getattr(tokenizer, MODEL_VOCAB_ATTR, None)
    if vocab is not None and ids and max(ids) >= vocab:
        bad = max(ids)
        raise ValueError(
            f"the checkpoint's tokenizer ({len(tokenizer)} tokens) encodes this text with token "
            f"id {bad} ({tokenizer.decode([bad])!r}), outside its model's vocabulary of {vocab} "
            "ids: the tokenizer is not the model's; put the tokenizer the model was trained "
            "with in the checkpoint folder"
        )
    return ids


def read_text_file(path: Path, what: str) -> str:
    """The text of UTF-8 file ``path``, without a leading byte-order mark (as
    ``python -m fot.data.prepare`` reads training text); a binary or non-UTF-8 file is refused,
    not read as replacement characters. ``what`` names the option in the message
    (``"--text-file"``)."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    if b"\0" in data:
        raise ValueError(
            f"{what} {str(path)!r} holds NUL bytes: it is binary, not text; pass UTF-8 text files"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{what} {str(path)!r} is not UTF-8 text (byte {err.start}); convert it "
            "(e.g. iconv -f latin1 -t utf-8) or leave it out"
        ) from None


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """The plain text of generated token ids: special tokens left out, escapes of the model's
    training text decoded (the inverse of :func:`encode_text`)."""
    text = tokenizer.decode(list(ids), skip_special_tokens=True)
    return unescape_text(text, text_escaping_of(tokenizer))


def model_logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` of any causal LM (objects returning ``.logits`` or a tensor)."""
    out = model(input_ids=input_ids)
    return out.logits if hasattr(out, "logits") else out


_SPLIT_MATCHES_FORWARD: weakref.WeakKeyDictionary[torch.nn.Module, bool] = (
    weakref.WeakKeyDictionary()
)


def hidden_and_head(
    model: torch.nn.Module, input_ids: torch.Tensor
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] | None:
    """Final hidden states and the LM head of a causal LM, for logits of chosen positions only.

    fot's FLA baselines give them through ``final_hidden_states`` / ``head_logits`` (their own
    kernels and autocast). Other models are split into ``get_decoder()`` and
    ``get_output_embeddings()``; the split is used only if, on the first 16 tokens of the first
    row, it gives the model's own logits (checked once per model): models that scale or cap
    their logits after the head (Granite's ``logits_scaling``, RecurrentGemma's soft cap,
    Falcon-H1's ``lm_head_multiplier``, ...) get ``None``.

    Args:
        input_ids: ``[B, T]`` int64.

    Returns:
        ``(hidden [B, T, H], head)`` with ``head(hidden[..., s:e, :])`` equal to the model's
        logits there (vocab padding cut off), or ``None`` when the model does not split this
        way: use the full logits.
    """
    cfg = getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)

    def cut(head: Any, out_features: int) -> Any:
        if isinstance(vocab, int) and 0 < vocab < out_features:
            # A vocab-padded head (FoT): padding rows are never predicted.
            return lambda h: head(h)[..., :vocab]
        return head

    final, head_logits = (getattr(model, n, None) for n in ("final_hidden_states", "head_logits"))
    get_head = getattr(model, "get_output_embeddings", None)
    if callable(final) and callable(head_logits) and callable(get_head):
        return final(input_ids), cut(head_logits, get_head().out_features)
    get_decoder = getattr(model, "get_decoder", None)
    if get_decoder is None or get_head is None:
        return None
    try:
        decoder, head = get_decoder(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or decoder is model or not isinstance(head, torch.nn.Linear):
        return None
    capped = ("final_logit_softcapping", "logit_scale", "logits_soft_cap", "output_logit_soft_cap")
    scaled = ("logits_scaling", "lm_head_multiplier")
    if any(getattr(cfg, k, None) for k in capped) or any(
        getattr(cfg, k, None) not in (None, 1) for k in scaled
    ):
        return None  # logits are not head(hidden): use the full forward instead (the probe
        # below finds the transforms of other models)
    head = cut(head, head.out_features)

    def last_hidden(x: torch.Tensor) -> torch.Tensor:
        out = decoder(input_ids=x, use_cache=False)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    try:
        matches = _SPLIT_MATCHES_FORWARD.get(model)
    except TypeError:  # not weak-referenceable or hashable: probed on every call
        matches = None
    if matches is None:
        probe = input_ids[:1, :16]
        want = model_logits(model, probe).float()
        got = head(last_hidden(probe)).float()
        matches = got.shape == want.shape and bool(
            (got - want).abs().max() <= 1e-3 * (1 + want.abs().max())
        )
        with contextlib.suppress(TypeError):
            _SPLIT_MATCHES_FORWARD[model] = matches
    if not matches:
        return None
    return last_hidden(input_ids), head


@torch.no_grad()
def token_losses(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """Per-token cross-entropy of any Hugging Face causal LM.

    Uses ``model.per_token_loss`` when the model has it (fot's models), else the decoder's
    final hidden states and the LM head in chunks of ``chunk_size`` positions (no ``[B, T, V]``
    logits in memory) where they give the model's logits (:func:`hidden_and_head`), else the
    full logits.

    Args:
        input_ids: ``[B, T]`` int64.
        labels: ``[B, T]`` int64, ``labels[:, t]`` is the token that follows ``input_ids[:, t]``;
            ``-100`` marks positions to ignore (their loss is 0).

    Returns:
        ``[B, T]`` float32 losses in nats.
    """
    if input_ids.shape != labels.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} must both be "
            "[B, T]"
        )
    if hasattr(model, "per_token_loss"):
        return model.per_token_loss(input_ids, labels).float()
    split = hidden_and_head(model, input_ids)
    if split is None:
        logits = model_logits(model, input_ids).float()
        return F.cross_entropy(
            logits.transpose(1, 2), labels, ignore_index=-100, reduction="none"
        ).float()
    hidden, head = split
    losses = []
    for s in range(0, hidden.shape[1], chunk_size):
        logits = head(hidden[:, s : s + chunk_size]).float()  # (B, c, V)
        losses.append(
            F.cross_entropy(
                logits.transpose(1, 2),
                labels[:, s : s + chunk_size],
                ignore_index=-100,
                reduction="none",
            )
        )
    return torch.cat(losses, dim=1)


@torch.no_grad()
def next_token_argmax(
    model: torch.nn.Module, input_ids: torch.Tensor, start: int, end: int, *, chunk_size: int = 4096
) -> torch.Tensor:
    """Greedy next-token predictions at positions ``start..end-1`` (teacher forcing).

    Only the requested positions go through the LM head when the model splits into decoder and
    head, so long inputs never hold ``[B, T, V]`` logits.

    Args:
        input_ids: ``[B, T]`` int64.
        start, end: position range, ``0 <= start < end <= T``.

    Returns:
        ``[B, end - start]`` int64: argmax of the logits at each position (the prediction of
        the token at the next position).
    """
    if not 0 <= start < end <= input_ids.shape[1]:
        raise ValueError(f"need 0 <= start < end <= T={input_ids.shape[1]}, got {start}, {end}")
    split = hidden_and_head(model, input_ids)
    if split is None:
        return model_logits(model, input_ids)[:, start:end].argmax(-1)
    hidden, head = split
    preds = [
        head(hidden[:, s : min(s + chunk_size, end)]).argmax(-1)
        for s in range(start, end, chunk_size)
    ]
    return torch.cat(preds, dim=1)


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> list[int]:
    """Greedy continuation of one prompt with the model's own ``generate`` (KV cache).

    Args:
        input_ids: ``[1, T]`` int64 prompt on the model's device.
        max_new_tokens: tokens to generate at most.
        eos_token_id: stop ids (generation stops after emitting one).

    Returns:
        The generated token ids (prompt excluded), eos included if emitted.
    """
    pad = eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        eos_token_id=eos_token_id,
        pad_token_id=pad if pad is not None else 0,
        temperature=None,
        top_p=None,
        top_k=None,
    )
    return out[0, input_ids.shape[1] :].tolist()


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


_SECRET_ARGUMENTS = ("storage_options",)
"""Arguments that may hold credentials: run_config.json records their names, not their values."""


def _hide_secrets(args: dict[str, Any], argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``args`` and ``argv`` with the values of :data:`_SECRET_ARGUMENTS` (JSON objects)
    replaced by ``"(hidden)"``."""
    secrets = [args[k] for k in _SECRET_ARGUMENTS if isinstance(args.get(k), dict)]
    if not secrets:
        return args, list(argv)
    args = {
        k: {name: "(hidden)" for name in v} if k in _SECRET_ARGUMENTS and isinstance(v, dict) else v
        for k, v in args.items()
    }
    hidden = []
    for item in argv:
        # the value alone (``--storage-options JSON``) or after the option (``--opt=JSON``)
        head, eq, text = item.partition("=") if item.startswith("--") else ("", "", item)
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        hidden.append(f"{head}{eq}(hidden)" if value in secrets else item)
    return args, hidden


_OUT_LOCKS: dict[Path, RunFolderLock] = {}
"""The ``--out`` folders this process has locked (:func:`lock_out`), by their real path."""

_OUT_MADE: dict[Path, Path] = {}
"""Of those, the ones :func:`lock_out` made: the topmost folder it made for each."""


def lock_out(out_dir: str | os.PathLike, *, resumes: bool = True) -> None:
    """Lock ``out_dir`` (an ``--out``) for this process as fot's trainer locks its run folder
    (:class:`fot.training.checkpoint.RunFolderLock`: ``flock`` on its ``.run.lock``, which
    records the process id, host and start time; a run that dies lets it go), until
    :func:`release_out_locks`. A folder that does not exist yet is made (with its missing
    parents), so that of two runs started at once into a new ``--out`` the second is refused
    before its model loads too; :func:`release_out_locks` removes what it made again where
    the command failed or wrote nothing there. A no-op where this process holds the lock
    already. Call it on one process of a ``torchrun`` run only (rank 0).

    Args:
        resumes: the command resumes from the results of the run that holds the lock (all but
            ``gates``): the error says to rerun it once that run has ended.

    Raises:
        RunFolderInUseError: another run holds the lock (a job submitted twice); the message
            names it (pid, host, start) and the fix.
        WriteError: the folder or its lock file cannot be made.
    """
    out = Path(out_dir).resolve()
    if out in _OUT_LOCKS:
        return
    top = next((p for p in (*reversed(out.parents), out) if not p.exists()), None)
    lock = RunFolderLock(
        out,
        option="--out",
        why="two runs into one --out (a job submitted twice) would both do all of its work",
        after="wait for that run to end"
        + (" (rerun this command then: it resumes from that run's results)" if resumes else ""),
    )
    try:
        if top is not None:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise cannot_write(out, err) or err from err
        lock.take()
    except BaseException:
        if top is not None:
            _remove_empty(out, top)
        raise
    _OUT_LOCKS[out] = lock
    if top is not None:
        _OUT_MADE[out] = top


def _remove_empty(out: Path, top: Path) -> None:
    """Remove ``out`` and its parents up to ``top`` while they are empty."""
    for folder in (out, *out.parents):
        try:
            folder.rmdir()
        except OSError:  # not empty (another run's lock file, results), or gone
            return
        if folder == top:
            return


def _holds_only(folder: Path, name: str) -> bool:
    """Whether ``folder`` holds the file ``name`` and nothing else."""
    try:
        return [p.name for p in folder.iterdir()] == [name]
    except OSError:
        return False


RECORD_FILES = ("run_config.json", "run_config.history.jsonl", "*.resume.json")
"""Files a command writes about its run, not results: ``run_config.json`` (and its history)
and the resume records of :func:`claim_results`."""


def _remove_records(out: Path, lock_name: str) -> None:
    """Delete the :data:`RECORD_FILES` in ``out`` where it holds nothing else (but its lock
    file ``lock_name``): the records of a run that failed before it saved any result."""
    try:
        names = [p.name for p in out.iterdir() if p.name != lock_name]
    except OSError:
        return
    records = [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in RECORD_FILES)]
    if records and len(records) == len(names):
        for name in records:
            with contextlib.suppress(OSError):
                (out / name).unlink()


def release_out_locks(*, failed: bool = False) -> None:
    """Let go of every ``--out`` lock of this process (:func:`lock_out`); where the command
    ``failed``, lock files it made go too, so that a refused run leaves ``--out`` as it was,
    and so do the folders :func:`lock_out` made where nothing else was written into them, nor
    anything but the records of a failed run (:data:`RECORD_FILES`)."""
    for out, lock in _OUT_LOCKS.items():
        top = _OUT_MADE.get(out)
        if failed and top is not None:
            _remove_records(out, lock.path.name)
        if failed or (top is not None and _holds_only(out, lock.path.name)):
            lock.discard()
        else:
            lock.release()
        if top is not None:
            _remove_empty(out, top)
    _OUT_LOCKS.clear()
    _OUT_MADE.clear()


def write_run_config(
    out_dir: str | os.PathLike,
    command: str,
    args: dict[str, Any],
    checkpoint: str | os.PathLike | None,
) -> Path:
    """Write ``run_config.json``: command, arguments, checkpoint, git SHA, versions, time.
    Makes ``out_dir`` and locks it first (:func:`lock_out`; ``gates`` makes it here)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lock_out(out, resumes=command != "gates")
    ckpt_cfg, escaping = None, None
    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file():
        ckpt_cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    tok_cfg = Path(checkpoint) / "tokenizer_config.json" if checkpoint is not None else None
    if tok_cfg is not None and tok_cfg.is_file():
        with contextlib.suppress(ValueError, AttributeError):
            escaping = json.loads(tok_cfg.read_text()).get(TEXT_ESCAPING_KEY, "none")
    args, argv = _hide_secrets(args, sys.argv)
    record = {
        "command": command,
        "argv": argv,
        "arguments": _jsonable(args),
        "checkpoint": str(Path(checkpoint).resolve()) if checkpoint is not None else None,
        "checkpoint_config": ckpt_cfg,
        # how texts were escaped before tokenizing (fot.tokenizer.TEXT_ESCAPINGS)
        "text_escaping": escaping,
        "git_sha": git_sha(),
        "versions": library_versions(extra=("lm_eval", "rouge-score")),
        "host": platform.node(),
        "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "started_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    path = out / "run_config.json"
    if path.is_file():
        # Several commands (or needle modes) may share one --out: keep the earlier record.
        # (A torn record of a killed run is not worth keeping.)
        with (
            (out / "run_config.history.jsonl").open("a") as f,
            contextlib.suppress(json.JSONDecodeError),
        ):
            f.write(json.dumps(json.loads(path.read_text())) + "\n")
    _write_json_atomic(path, record)
    return path


# Commands that write the same file name into --out, and the files (glob patterns) that show
# their results: finished or saved partial results, not the record a run writes when it starts
# (a run that failed before its first result leaves no results to protect).
_SUMMARY_WRITERS = {
    "per-token-loss": ("per_token_loss.npz", "state*.npz"),
    "forgetting-curve": ("forgetting_curve.jsonl",),
    "gates": ("gates.npz",),
}


def check_out_dir(out_dir: str, checkpoint: str) -> None:
    """Refuse an ``--out`` that is empty, an existing file, a training run's folder, the
    checkpoint folder or a folder inside it, a token folder, or another model's folder (a
    training checkpoint or an export).

    Results written into the checkpoint folder would change its content fingerprint (every other
    results folder of that checkpoint would then refuse to resume, naming a changed checkpoint)
    and mix with the files ``from_pretrained`` reads.

    Raises:
        ValueError: naming ``--out`` and a folder to use instead.
    """
    refuse_empty_folder("--out", out_dir, "for the results, e.g. --out out/eval")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"--out {str(out_dir)!r} is a file, not a folder; name a new or existing folder"
        )
    # What would stop the folder's making (when it is locked) or the first write into it is
    # said now, naming the folder in the way, not as an error of mkdir or after the model load.
    existing = next(p for p in (out.absolute(), *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(
            f"--out {str(out_dir)!r} is under {str(existing)!r}, which is a file, not a folder; "
            "name an --out outside it"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"--out {str(out_dir)!r}: {str(existing)!r} cannot be written (no write permission "
            "or a read-only file system); name an --out in a folder you can write"
        )
    if (out / "run_info.json").is_file():  # train.py's record of each start in its folder
        raise ValueError(
            f"--out {str(out_dir)!r} is a training run's folder: results written there would mix "
            "with the run's files (and its lock); choose a folder of their own, e.g. "
            f"{str(out / 'eval')!r}"
        )
    ckpt = Path(checkpoint).resolve()
    resolved = out.resolve()
    if resolved == ckpt or ckpt in resolved.parents:
        raise ValueError(
            f"--out {str(out_dir)!r} is inside the checkpoint folder {str(ckpt)!r}: results "
            "written there would change the checkpoint (its fingerprint, which every results "
            "folder checks before resuming); choose a folder outside it, e.g. "
            f"{str(ckpt.parent / (ckpt.name + '_eval'))!r}"
        )
    from fot.training.config import folder_kind

    kind = folder_kind(out)
    if kind == "tokens":
        raise ValueError(
            f"--out {str(out_dir)!r} is a token folder (data): results written there would mix "
            "with its files, and fot.data.prepare would then refuse to rewrite it; choose a "
            f"folder of their own, e.g. {str(out.parent / (out.name + '_eval'))!r}"
        )
    if kind in ("checkpoint", "export"):
        raise ValueError(
            f"--out {str(out_dir)!r} holds a model (a training checkpoint or an export): "
            "results written there would mix with the files from_pretrained reads; choose a "
            f"folder of their own, e.g. {str(out.parent / (out.name + '_eval'))!r}"
        )


def check_out_shared(out_dir: str | os.PathLike, command: str) -> None:
    """Refuse an ``--out`` that holds another command's results which ``command`` would overwrite.

    ``per-token-loss``, ``forgetting-curve`` and ``gates`` each write ``summary.json``; running
    one into a folder holding another's results would silently replace that summary.

    Args:
        out_dir: the ``--out`` folder.
        command: the command about to write there (a key of ``_SUMMARY_WRITERS``).

    Raises:
        FileExistsError: naming the other command, its files and the fix.
    """
    out = Path(out_dir)
    for other, markers in _SUMMARY_WRITERS.items():
        found = sorted(
            f.name for m in markers if other != command for f in out.glob(m) if f.is_file()
        )
        if found:
            raise FileExistsError(
                f"--out {str(out)!r} holds {other} results ({', '.join(found)}); {command} "
                f"would overwrite their summary.json. Give each command its own --out, e.g. "
                f"{str(out / command.replace('-', '_'))!r}"
            )


# Checkpoint files whose content decides results: weights, configs, tokenizer files.
_FINGERPRINT_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt")
_FINGERPRINT_WHOLE = 8 << 20  # files up to this size are hashed whole
_FINGERPRINT_BLOCK = 64 << 10  # larger ones: this many bytes at ...
_FINGERPRINT_BLOCKS = 64  # ... this many evenly spaced offsets (first and last included)


def checkpoint_fingerprint(path: str | os.PathLike) -> str:
    """A content fingerprint of a checkpoint folder, for telling checkpoints apart cheaply.

    SHA-256 over the name and size of every weight, config and tokenizer file in the folder
    (``*.json``, ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.model``, ``*.txt``),
    the whole content of files up to 8 MiB and 64 evenly spaced 64 KiB blocks of larger ones
    (4 MiB read per weight file, whatever its size). Copies and moves of a folder keep the
    fingerprint; another config or tokenizer changes it, and so do other weights (a training
    step changes every block), unless they differ only between the sampled blocks of a file
    larger than 8 MiB (e.g. one fine-tuned bias): such variants need separate ``--out`` folders.
    """
    digest = hashlib.sha256()
    files = sorted(
        f
        for f in check_checkpoint_dir(path).iterdir()
        if f.is_file() and f.suffix in _FINGERPRINT_SUFFIXES and not f.name.startswith(".")
    )
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            if size <= _FINGERPRINT_WHOLE:
                digest.update(fh.read())
                continue
            last = size - _FINGERPRINT_BLOCK
            for i in range(_FINGERPRINT_BLOCKS):
                fh.seek(last * i // (_FINGERPRINT_BLOCKS - 1))
                digest.update(fh.read(_FINGERPRINT_BLOCK))
    return digest.hexdigest()


_DATA_SAMPLED_FILES = 256  # files whose bytes are sampled by data_fingerprint
_DATA_BLOCK = 16 << 10  # bytes read at each of ...
_DATA_BLOCKS = 4  # ... this many evenly spaced offsets of a sampled file


def data_fingerprint(path: str | os.PathLike, files: Iterable[str] | None = None) -> str:
    """A cheap content fingerprint of a data file or folder (a zarr array, a token folder, a
    haystack or dataset folder), for telling resumed results of other data apart.

    SHA-256 over the relative name and size of every file, and 4 evenly spaced 16 KiB blocks
    of up to 256 files spread over the sorted list (at most 16 MiB read, whatever the size):
    rewritten data almost always changes a size or a sampled block. Copies and moves keep it.

    Args:
        path: a data file or folder.
        files: only these files of the folder ``path`` (names relative to it); the same
            fingerprint as the whole folder's when they are all of its files.
    """
    root = Path(path)
    if files is not None:
        files = sorted(root / name for name in files)
    else:
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.is_file())
    digest = hashlib.sha256()
    sizes = []
    for f in files:
        size = f.stat().st_size
        sizes.append(size)
        digest.update(f"{f.relative_to(root) if f != root else f.name}\0{size}\0".encode())
    step = max(1, len(files) // _DATA_SAMPLED_FILES)
    for f, size in list(zip(files, sizes))[::step]:
        with f.open("rb") as fh:
            last = max(size - _DATA_BLOCK, 0)
            for i in range(_DATA_BLOCKS):
                fh.seek(last * i // (_DATA_BLOCKS - 1))
                digest.update(fh.read(_DATA_BLOCK))
    return digest.hexdigest()


_URL_CHECKSUMS = ("md5Hash", "crc32c", "ContentMD5", "Content-MD5", "ETag", "etag", "Digest")
"""Fields of an fsspec ``info`` that name a stored object's content, in the order preferred:
GCS's md5 and crc32c, S3's and HTTP's ETag (not times nor generations: a copy of the same
bytes keeps them)."""


def zarr_url_fingerprint(
    url: str, array: Any, storage_options: Mapping[str, Any] | None = None
) -> str:
    """A cheap fingerprint of the zarr array at ``url``, for telling resumed results of other
    data apart (hashing the files, as :func:`data_fingerprint` does on a disk, would read the
    whole array over the network).

    SHA-256 over the array's shape, chunk shape and dtype, its metadata file as stored
    (``.zarray`` or ``zarr.json``: also the compressor and fill value), and the size and
    content checksum, where the store gives one (``info``: GCS md5/crc32c, S3 or HTTP ETag), of
    three chunk files: the first, the middle and the last (a missing one counts as missing).
    Five small requests. The URL itself is compared as a setting.

    It detects another array at the URL (other shape, chunks, dtype or encoding) and a sampled
    chunk that was rewritten, gone or added; it does not detect rows rewritten only in other
    chunks (an array rewritten in place with the same metadata), nor, on a server that gives
    no checksum (a plain HTTP server without ETag), a sampled chunk rewritten at the same
    compressed size.

    Args:
        url: the array's fsspec URL (``gs://<bucket>/heldout.zarr``).
        array: the zarr array opened from it.
        storage_options: the options it was opened with.
    """
    import fsspec

    from fot.data.zarr_store import chunk_key_encoder

    fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
    root = root.rstrip("/")
    metadata = getattr(array, "metadata", None)  # zarr 3's (zarr 2's arrays have none)
    v3 = getattr(metadata, "zarr_format", 2) == 3
    encode = chunk_key_encoder(array)
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            [list(map(int, array.shape)), list(map(int, array.chunks)), str(array.dtype)]
        ).encode()
    )
    name = "zarr.json" if v3 else ".zarray"
    try:
        digest.update(f"{name}\0".encode() + fs.cat_file(f"{root}/{name}"))
        # the grid of stored chunk files (of shards, in a sharded zarr v3 array)
        grid_chunk = getattr(getattr(metadata, "chunk_grid", None), "chunk_shape", None)
        stored = grid_chunk or array.chunks
        grid = [-(-int(n) // int(c)) for n, c in zip(array.shape, stored)]
        coords = (
            {tuple(0 for _ in grid), tuple(g // 2 for g in grid), tuple(g - 1 for g in grid)}
            if min(grid, default=0) > 0
            else set()
        )
        for coord in sorted(coords):
            key = encode(coord)
            try:
                info = fs.info(f"{root}/{key}")
            except FileNotFoundError:
                digest.update(f"{key}\0missing\0".encode())
                continue
            checksum = next((str(info[f]) for f in _URL_CHECKSUMS if info.get(f)), "")
            digest.update(f"{key}\0{info.get('size')}\0{checksum}\0".encode())
    except (OSError, ValueError) as err:
        raise ConnectionError(
            f"could not read the metadata of {url} for the resume record ({type(err).__name__}: "
            f"{err}); check the network and the credentials (--storage-options), then rerun "
            "the same command"
        ) from None
    return digest.hexdigest()


def _data_paths(settings: dict[str, Any]) -> dict[str, list[str]]:
    """The settings that name existing files or folders (as :func:`path_setting` records them:
    absolute), option -> paths."""
    found = {}
    for key, value in settings.items():
        values = value if isinstance(value, list) else [value]
        paths = [v for v in values if isinstance(v, str) and os.path.isabs(v) and os.path.exists(v)]
        if paths:
            found[key] = paths
    return found


def path_setting(value: str | os.PathLike | None) -> str | None:
    """A data/folder argument as recorded for resuming: absolute if it names an existing path
    (so that ``data`` and ``./data`` compare equal), a URL without a trailing ``/``, else
    unchanged (e.g. ``sample``)."""
    if value is None:
        return None
    if is_url(value):  # gs://bucket/x.zarr/ is gs://bucket/x.zarr
        return str(value).rstrip("/")
    p = Path(value)
    return str(p.resolve()) if p.exists() else str(value)


def model_dtype(model: torch.nn.Module) -> str:
    """The dtype the model computes in as a short name: its parameters' (``float32``,
    ``bfloat16``), or ``bfloat16-autocast`` for an FLA baseline run under autocast over float32
    weights (:func:`load_checkpoint`)."""
    compute = getattr(model, "compute_dtype", None)
    if compute is not None:
        return str(compute).removeprefix("torch.") + "-autocast"
    return str(next(model.parameters()).dtype).removeprefix("torch.")


class ResumeMismatchError(FotError, ValueError):
    """``--out`` holds saved results of another checkpoint or other settings than this run."""


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def claim_results(
    out_dir: str | os.PathLike,
    name: str,
    *,
    checkpoint: str | os.PathLike,
    settings: dict[str, Any],
    state: Sequence[str],
    outputs: Sequence[str] = (),
    restart: bool = False,
    write: bool = True,
    data_files: Mapping[str, Sequence[str]] | None = None,
    url_fingerprints: Mapping[str, str] | None = None,
    may_grow: Sequence[str] = (),
    defaults: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Tie the resumable results ``name`` in ``out_dir`` to the checkpoint and settings of this run.

    Every resumable command calls this before it reads saved results, so that reusing a results
    folder never mixes the results of one checkpoint (or setting) into those of another. It
    makes ``out_dir``: commands call it once their arguments and checkpoint have checked out,
    so that bad ones leave no folder behind. The
    record ``out_dir/<name>.resume.json`` holds the checkpoint (path and
    :func:`checkpoint_fingerprint`) and ``settings`` (the result-changing arguments, resolved):

    * no saved results (no file matches ``state``): the record is (re)written, the run starts;
    * saved results and the same checkpoint content and settings: resume (the checkpoint folder
      may have moved: its fingerprint is compared, not its path; the record notes the new path);
    * saved results of another checkpoint or other settings, or without a record:
      :class:`ResumeMismatchError` naming every difference (saved and new value) and the ways
      out;
    * ``restart``: saved results (``state`` and ``outputs``) and their record are moved, not
      deleted, to ``out_dir/superseded/<name>-<UTC time>/`` and the run starts over.

    Args:
        out_dir: the command's ``--out`` folder.
        name: the result set (one record each), e.g. ``per_token_loss`` or ``needle_easy``.
        checkpoint: the evaluated checkpoint folder.
        settings: option name -> value of every argument that changes results (JSON-able).
        state: glob patterns (relative to ``out_dir``) of the files a resumed run reads.
        outputs: glob patterns of the final result files, moved away with ``state`` on restart.
        restart: start over: move saved results away instead of resuming or refusing them.
        write: whether this process may write (False on torchrun ranks other than 0: they only
            check, and with ``restart`` they leave everything to rank 0).
        data_files: option -> the files this run reads from the folder that option names
            (names relative to it). Only they are fingerprinted, each by itself, instead of the
            whole folder: files added to the folder later, or read by other runs only, do not
            refuse a resume; one of them that changed does. The record keeps the fingerprints
            saved of the folder's other files (results of other runs may come from them). A
            record of an older fot, with one fingerprint of the whole folder, is resumed when
            that folder is unchanged, or unchanged but for files written after the record; else
            the difference says so (it cannot tell which files changed).
        url_fingerprints: option -> fingerprint of the data behind the URL that option names
            (:func:`zarr_url_fingerprint`), which this function cannot fingerprint itself:
            compared as the fingerprints of local data are.
        may_grow: settings (a whole number, or ``None`` for no limit) that a rerun may raise:
            the saved results are resumed and extended (the caller's items for a value are
            the first of those for a larger one), and the record notes the new value. A lower
            value is a difference, as any other setting's change is.
        defaults: settings that ``settings`` holds only where they are not at their default
            (so that records written before the option existed resume): option -> how to
            name its default where a saved record lacks the option.

    Returns:
        The record of this run.

    Raises:
        ResumeMismatchError: saved results do not match and ``restart`` is off.
        ValueError: ``out_dir`` lies in a data folder that is fingerprinted whole (its results
            would change the fingerprint).
    """
    out = Path(out_dir)
    data_files = data_files or {}
    for key, paths in _data_paths(settings).items():
        for folder in (
            Path(v).resolve() for v in paths if key not in data_files and os.path.isdir(v)
        ):
            if folder == out.resolve() or folder in out.resolve().parents:
                raise ValueError(
                    f"--out {str(out_dir)!r} is inside {key} {str(folder)!r}: results written "
                    "there would change the data's fingerprint, so that every rerun would be "
                    "refused as one of other data instead of resuming; choose a folder outside "
                    f"it, e.g. {str(folder.parent / (folder.name + '_eval'))!r}"
                )
    out.mkdir(parents=True, exist_ok=True)  # where no lock_out made it before the model load
    if write:  # before saved results are read: no other run is writing them
        lock_out(out)
    record_path = out / f"{name}.resume.json"
    record = {
        "command": name,
        "checkpoint": str(Path(checkpoint).resolve()),
        "checkpoint_fingerprint": checkpoint_fingerprint(checkpoint),
        "settings": json.loads(json.dumps(_jsonable(settings))),
    }
    record["data_fingerprints"] = {
        key: (
            {name: data_fingerprint(paths[0], [name]) for name in data_files[key]}
            if key in data_files and len(paths) == 1 and os.path.isdir(paths[0])
            else [data_fingerprint(v) for v in paths]
        )
        for key, paths in _data_paths(record["settings"]).items()
    }
    for key, fingerprint in (url_fingerprints or {}).items():
        record["data_fingerprints"][key] = [fingerprint]
    saved_files = sorted({f for pattern in state for f in out.glob(pattern) if f.is_file()})
    if not saved_files:
        if write:
            _write_json_atomic(record_path, record)
        return record
    if restart:
        if write:
            stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
            moved = out / "superseded" / f"{name}-{stamp}"
            n = 1
            while moved.exists():  # never overwrite results moved away before
                n += 1
                moved = out / "superseded" / f"{name}-{stamp}-{n}"
            moved.mkdir(parents=True)
            extra = {f for pattern in outputs for f in out.glob(pattern) if f.is_file()}
            for f in sorted(set(saved_files) | extra | {record_path}):
                if f.is_file():
                    os.replace(f, moved / f.name)
            print(f"--restart: moved the earlier {name} results to {moved}", file=sys.stderr)
            _write_json_atomic(record_path, record)
        return record
    saved = damaged = None
    if record_path.is_file():
        try:
            saved = json.loads(record_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            damaged = err
        if saved is not None and not isinstance(saved, dict):
            saved, damaged = None, "not a JSON object"
    if saved is not None:
        written = saved
        saved = _per_file_fingerprints(saved, record, record_path.stat().st_mtime_ns)
    problems = (
        _record_differences(saved, record, may_grow, out, defaults or {})
        if saved is not None
        else []
    )
    if saved is not None and not problems:
        for key, fingerprints in record["data_fingerprints"].items():
            earlier = (saved.get("data_fingerprints") or {}).get(key)
            if isinstance(fingerprints, dict) and isinstance(earlier, dict):
                record["data_fingerprints"][key] = {**earlier, **fingerprints}
        if write and written != record:
            # the checkpoint moved (note where it is), or files of a data folder were noted
            _write_json_atomic(record_path, record)
        return record
    names = ", ".join(f.name for f in saved_files)
    if damaged is not None:
        why = (
            f"--out {str(out)!r} holds {name} results ({names}) but their record of the "
            f"checkpoint and settings, {record_path.name}, is damaged ({damaged}), so they "
            "cannot be resumed safely."
        )
    elif saved is None:
        why = (
            f"--out {str(out)!r} holds {name} results ({names}) without a record of the "
            f"checkpoint and settings that made them ({record_path.name}, written since fot "
            "checks resumed results), so they cannot be resumed safely."
        )
    else:
        why = (
            f"--out {str(out)!r} holds {name} results ({names}) of another checkpoint or other "
            "settings; resuming would mix them into this run:\n  " + "\n  ".join(problems)
        )
    raise ResumeMismatchError(
        f"{why}\nChoose another --out for this run, or pass --restart to move the saved results "
        f"to {str(out / 'superseded')!r} and start over (or delete them yourself)."
    )


_RETIRED_SETTINGS = {"torchrun processes"}
"""Settings that records of an older fot hold and that no longer decide whether results resume
(per-token-loss resumes with any number of processes)."""


def _limit(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _record_differences(
    saved: dict[str, Any],
    new: dict[str, Any],
    may_grow: Sequence[str] = (),
    out: Path | None = None,
    defaults: Mapping[str, str] | None = None,
) -> list[str]:
    """Human-readable differences between a saved and a new :func:`claim_results` record;
    settings in ``may_grow`` differ only where the new value is lower (``None``: no limit):
    that line names a new folder next to ``out`` (the ``--out``) for the lower value. A setting
    of ``defaults`` missing from a record is shown as its default."""
    defaults = defaults or {}
    problems = []
    if saved.get("command") != new["command"]:
        problems.append(f"results: saved {saved.get('command')!r}, this run {new['command']!r}")
    if saved.get("checkpoint_fingerprint") != new["checkpoint_fingerprint"]:
        old_path = saved.get("checkpoint")
        if old_path == new["checkpoint"]:
            problems.append(
                f"checkpoint: the folder {old_path!r} has changed since (other weights, config "
                "or tokenizer)"
            )
        else:
            problems.append(
                f"checkpoint: saved results are of {old_path!r}, this run evaluates "
                f"{new['checkpoint']!r} (other content)"
            )
    old_settings, new_settings = saved.get("settings") or {}, new["settings"]
    old_settings = {k: v for k, v in old_settings.items() if k not in _RETIRED_SETTINGS}
    for key in [*new_settings, *(k for k in old_settings if k not in new_settings)]:
        old, now = old_settings.get(key, "(not recorded)"), new_settings.get(key, "(not set)")
        if old != now and key in may_grow and _limit(old) and _limit(now):
            if now is None or (old is not None and now > old):
                continue  # raised: the saved results are extended
            fix = f"leave {key} out" if old is None else f"pass {key} {old} or more"
            fresh = "run this command with a new --out, "
            if out is not None:  # e.g. results -> results-max-docs-2, next to it
                here = out.resolve()
                new_out = here.parent / f"{here.name}{key[1:]}-{now}"
                fresh += f"e.g. --out {str(new_out)!r} (the saved results stay), "
            problems.append(
                f"{key}: saved {'no limit' if old is None else old}, this run {now}: a rerun may "
                "raise it (the saved results are extended), not lower it (they hold what the "
                f"saved value asked for, and cannot be taken apart); for {key} {now}, {fresh}"
                f"or {fix} to resume them"
            )
        elif old != now:
            default = f"{defaults[key]} (the default)" if key in defaults else None
            was = default if default and key not in old_settings else _show(old)
            now_shown = default if default and key not in new_settings else _show(now)
            problems.append(f"{key}: saved {was}, this run {now_shown}")
        elif key in (saved.get("data_fingerprints") or {}):
            # same path, other content (records written before fot fingerprinted data: skipped)
            problem = _data_difference(
                key, now, saved["data_fingerprints"][key], new["data_fingerprints"].get(key)
            )
            if problem:
                problems.append(problem)
    return problems


def _data_difference(key: str, path: Any, saved: Any, new: Any) -> str | None:
    """How the data that option ``key`` names (``path``) differs from the saved fingerprints,
    or None: per file (a dict, ``data_files`` of :func:`claim_results`) the files this run
    reads that changed, else the whole file or folder."""
    if not isinstance(new, dict):
        if saved == new:
            return None
        if isinstance(path, str) and is_url(path):
            return (
                f"{key}: the zarr array at {_show(path)} has changed since (other shape, chunks, "
                "dtype or encoding, or other sizes or checksums of the chunks sampled)"
            )
        return (
            f"{key}: the content of {_show(path)} has changed since (other files, sizes or bytes)"
        )
    if isinstance(saved, dict):
        changed = [
            name for name, fingerprint in new.items() if saved.get(name, fingerprint) != fingerprint
        ]
        if not changed:
            return None
        return f"{key}: {', '.join(changed)} in {_show(path)} changed since (other size or bytes)"
    # one fingerprint of the whole folder (an older fot), which has changed since
    return (
        f"{key}: the saved record (of an older fot) has one fingerprint of the whole folder "
        f"{_show(path)}, which has changed since (files added, removed or rewritten), so it "
        f"cannot tell whether the files this run reads ({', '.join(new)}) changed. If only "
        "files were added, move them out of the folder for one run: the record then notes "
        "each file this run reads by itself, and later runs are not refused for other files"
    )


def _per_file_fingerprints(
    saved: dict[str, Any], new: dict[str, Any], since: int
) -> dict[str, Any]:
    """``saved``, where it holds one fingerprint of a whole folder (fot before ``data_files``)
    that ``new`` fingerprints per file: per-file fingerprints of the folder's files when the
    folder is unchanged, or unchanged but for files modified after ``since`` (the record's
    time, ns) that this run does not read. Else ``saved`` as it is: the difference is named.
    """
    upgraded = dict(saved.get("data_fingerprints") or {})
    for key, fingerprints in new["data_fingerprints"].items():
        old = upgraded.get(key)
        folder = new["settings"].get(key)
        if not (
            isinstance(fingerprints, dict)
            and isinstance(old, list)
            and len(old) == 1
            and (saved.get("settings") or {}).get(key) == folder
        ):
            continue
        root = Path(folder)
        everything = sorted(str(f.relative_to(root)) for f in root.rglob("*") if f.is_file())
        unchanged = [
            name
            for name in everything
            if name in fingerprints or (root / name).stat().st_mtime_ns <= since
        ]
        for files in (everything, unchanged):
            if set(fingerprints) <= set(files) and data_fingerprint(root, files) == old[0]:
                upgraded[key] = {name: data_fingerprint(root, [name]) for name in files}
                break
    return {**saved, "data_fingerprints": upgraded}


def _write_json_atomic(path: Path, value: Any) -> None:
    from fot.training.checkpoint import write_text_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(value, indent=2) + "\n")


class JsonlLog:
    """An append-only JSONL results file keyed by ``record[key]``: the resume mechanism.

    Every finished item is appended (and flushed) at once; on restart, items whose key is
    already in the file are skipped. A partly written last line (killed mid-write, or a full
    disk) is cut off the file, which is never rewritten: an interruption or a full disk while it
    is opened leaves every saved item in it. The file does not know which checkpoint and
    settings produced it: commands call :func:`claim_results` before opening it. An item saved
    twice (two runs started at once with the same ``--out`` both finish it) is read once, as
    first saved: a summary counts each item of its grid once.
    """

    def __init__(self, path: str | os.PathLike, key: str = "key") -> None:
        self.path = Path(path)
        self.key = key
        self.records: list[dict[str, Any]] = []
        if self.path.is_file():
            data = self.path.read_bytes()
            seen = set()
            for line in data.splitlines():
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    continue  # torn last line of an interrupted run
                if isinstance(record, dict) and self.key in record:
                    if str(record[self.key]) in seen:
                        continue  # saved again by a second run into the same --out
                    seen.add(str(record[self.key]))
                self.records.append(record)
            self._end_on_a_fresh_line(data)
        self._done = {str(r[self.key]) for r in self.records if self.key in r}

    def _end_on_a_fresh_line(self, data: bytes) -> None:
        """Make appends start on a fresh line: cut a torn last line (file content ``data``) off
        the file, or end a whole last record that lacks only its newline with one. Neither
        rewrites the file (a rewrite cut short would lose every item in it) nor needs space."""
        if not data or data.endswith(b"\n"):
            return
        start = data.rfind(b"\n") + 1
        try:
            whole = isinstance(json.loads(data[start:]), dict)
        except (json.JSONDecodeError, UnicodeDecodeError):
            whole = False
        if whole:
            with self.path.open("ab") as f:
                f.write(b"\n")
        else:
            os.truncate(self.path, start)

    def done(self, key: Any) -> bool:
        """Whether an item with this key is already recorded."""
        return str(key) in self._done

    def append(self, record: dict[str, Any]) -> None:
        """Record one finished item (flushed to disk immediately)."""
        if self.key not in record:
            raise KeyError(f"record has no {self.key!r} field: {record}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as f:
            f.write(json.dumps(_jsonable(record)) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records.append(record)
        self._done.add(str(record[self.key]))
        check_stop()  # a SIGTERM whose first raise was lost (inside a __del__) stops here

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


def vocab_size(model: torch.nn.Module) -> int | None:
    """Number of token ids the model reads: ``config.vocab_size``, else its embedding's rows."""
    value = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(value, int) and value > 0:
        return value
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    return int(emb.num_embeddings) if isinstance(emb, torch.nn.Embedding) else None


def check_token_ids(tokens: np.ndarray, vocab: int | None, what: str) -> None:
    """Refuse token ids outside ``[0, vocab)`` before they reach the model's embedding.

    Args:
        tokens: the ids read from the data (any shape).
        vocab: the model's vocabulary size (:func:`vocab_size`); None checks the sign only.
        what: where they come from, for the message (e.g. ``"--data 'x.zarr' document 3"``).

    Raises:
        ValueError: naming ``what``, the bad id and the vocabulary size.
    """
    if tokens.size == 0:
        return
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        raise ValueError(
            f"{what} holds token id {bad}, outside this model's vocabulary of {vocab} ids "
            f"(0..{vocab - 1 if vocab else '?'}): the data was tokenized with another "
            "tokenizer or is not token ids; pass data tokenized for this checkpoint"
        )


def check_fits_memory(model: torch.nn.Module, tokens: int, what: str) -> None:
    """Refuse inputs whose hidden states alone cannot fit in the device's memory.

    One layer's hidden states of a ``tokens``-long input take ``tokens * hidden_size`` values
    of the model's dtype: the least a forward pass holds at once. An input past that would be
    killed for memory (or fail deep inside torch) after minutes of preparation.

    Raises:
        ValueError: naming ``what``, the estimate and the device's memory.
    """
    param = next(model.parameters())
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    width = getattr(emb, "embedding_dim", None) or getattr(model.config, "hidden_size", None)
    if not isinstance(width, int):
        return
    if param.device.type == "cuda":
        memory = torch.cuda.get_device_properties(param.device).total_memory
    else:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return
    need = tokens * width * param.element_size()
    if need > memory:
        raise ValueError(
            f"{what} needs inputs of {tokens} tokens: one layer's hidden states alone take "
            f"{need / 2**30:.1f} GiB, more than the {memory / 2**30:.1f} GiB of {param.device}; "
            "choose shorter lengths"
        )


def length_option(text: str, option: str, *, minimum: int = 1) -> int:
    """Parse a one-value length option such as ``--train-length 16k``.

    Raises:
        ValueError: not exactly one integer, or one below ``minimum`` (naming the option).
    """
    values = parse_int_list(text, option)
    if len(values) != 1:
        raise ValueError(f"{option} {text!r}: expected one length in tokens, e.g. 16k or 16384")
    if values[0] < minimum:
        raise ValueError(f"{option} must be >= {minimum} tokens, got {values[0]}")
    return values[0]


def list_option(text: str, option: str) -> str:
    """``text`` unchanged when no item of the comma-separated list is empty.

    (:func:`fot.eval.common.parse_int_list` skips empty items: ``256,,512`` is a typo.)

    Raises:
        ValueError: naming the option and the list.
    """
    if any(not part.strip() for part in text.split(",")):
        raise ValueError(
            f"{option} {text!r} has an empty item; separate values by single commas, e.g. "
            "'1k,2k,4k'"
        )
    return text


def load_npz(path: Path, keys: Sequence[str], fix: str) -> dict[str, np.ndarray]:
    """Arrays ``keys`` of the ``.npz`` file ``path``, or an error naming the file and ``fix``.

    Raises:
        ValueError: the file is damaged (cut short by a crash or a full disk, not an npz) or
            lacks one of ``keys``.
    """
    try:
        data = np.load(path)
        if not isinstance(data, np.lib.npyio.NpzFile):
            why = "is not an .npz archive"
        else:
            with data:
                missing = [k for k in keys if k not in data.files]
                if not missing:
                    return {k: data[k] for k in keys}
            why = f"lacks the arrays {missing}"
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as err:
        why = f"is damaged ({type(err).__name__}: {err})"
    raise ValueError(f"{str(path)!r} {why}; {fix}")


def parse_int_list(text: str | Iterable[int], option: str | None = None) -> list[int]:
    """Parse ``"1024,2048,4k,16k"`` (``k`` = 1024; ``0.5k`` = 512) into ints.

    Args:
        text: the list (or the ints themselves).
        option: the command-line option it came from, for the error (e.g. ``--lengths``).

    Raises:
        ValueError: a value that is not a whole number (``100.7``, ``1.1k``, ``nan``).
    """
    if not isinstance(text, str):
        return [int(x) for x in text]
    values = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        try:
            value = float(part.rstrip("k")) * mult
            if value != int(value):  # e.g. 100.7: not silently cut to 100
                raise ValueError
            values.append(int(value))
        except (ValueError, OverflowError):  # not a whole number, nan, inf
            where = f"{option} {text!r}" if option else repr(text)
            raise ValueError(
                f"cannot parse {part!r} in {where}: expected whole numbers of tokens like "
                "'1024,2k,16k'"
            ) from None
    return values


def check_grid(values: Sequence[float], option: str, *, minimum: float) -> None:
    """Refuse an empty grid, repeated values or values below ``minimum`` (e.g. ``--lengths``).

    Raises:
        ValueError: naming the option and the bad values.
    """
    if not values:
        raise ValueError(f"{option} must list at least one value")
    repeated = sorted({v for v in values if list(values).count(v) > 1})
    if repeated:
        raise ValueError(
            f"{option} lists {', '.join(f'{v:g}' for v in repeated)} more than once (note "
            "1k = 1024); list each value once"
        )
    small = [v for v in values if v < minimum]
    if small:
        raise ValueError(
            f"{option}: {', '.join(f'{v:g}' for v in small)} below the smallest allowed value "
            f"{minimum:g}"
        )


def positive_int(text: str) -> int:
    """An ``argparse`` type for counts and sizes: an integer >= 1.

    Raises:
        argparse.ArgumentTypeError: naming the value (argparse prints it as a usage error).
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_float_list(text: str | Iterable[float]) -> list[float]:
    """Parse ``"0,25,50"`` into floats."""
    if not isinstance(text, str):
        return [float(x) for x in text]
    values = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):  # nan would pass every range check
            raise ValueError(
                f"cannot parse {part!r} in {text!r}: expected numbers like '0,25,50,75,100'"
            )
        values.append(value)
    return values


def refuse_empty_folder(option: str, value: str | os.PathLike | None, what: str) -> None:
    """Refuse a folder option given as an empty string (``--data-dir "$DIR"`` with ``DIR``
    unset), which ``Path`` would read as the current folder; ``None`` (left out) passes.

    Raises:
        ValueError: naming ``option`` and ``what`` it takes.
    """
    if value is not None and not str(value).strip():
        raise ValueError(f"{option} is empty (an unset variable?); name the folder {what}")


def use_agg_backend(plot: Path) -> None:
    """Select matplotlib's file-only Agg backend (no display needed).

    Args:
        plot: the image about to be drawn, named when matplotlib is missing. Every command
            draws after its results are saved, so the error says that they are, and where.

    Raises:
        MissingPackageError: matplotlib is not installed.
    """
    try:
        import matplotlib
    except ModuleNotFoundError as err:
        if err.name != "matplotlib":
            raise
        raise MissingPackageError(
            f"drawing {plot} needs matplotlib, which is not installed: `pip install "
            f"matplotlib`, then rerun the same command to draw it (the results are saved in "
            f"{str(Path(plot).parent)!r})"
        ) from None

    matplotlib.use("Agg", force=True)


def save_figure(fig: Any, out_file: Path, *, dpi: int = 130, format: str | None = None) -> Path:
    """Lay out ``fig`` (``tight_layout``), write it to ``out_file`` whole
    (:func:`fot.training.checkpoint.written_whole`, its folder made first), and close it.

    Args:
        fig: a matplotlib figure.
        out_file: the image path; its suffix picks the format unless ``format`` is given.
        dpi: resolution passed to ``savefig``.
        format: the image format passed to ``savefig`` (e.g. ``"png"``), or None.

    Returns:
        ``out_file``.
    """
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    with written_whole(out_file) as tmp:
        fig.savefig(tmp, dpi=dpi, format=format)
    plt.close(fig)
    return out_file
