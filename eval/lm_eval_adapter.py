"""LM-evaluation-harness on an exported checkpoint, through lm-eval's own machinery.

:class:`FoTLM` implements lm-eval's ``TemplateLM`` for any Hugging Face causal LM (tasks,
prompts, metrics and aggregation are lm-eval's own), with fot's tokenisation rules:

* exactly one BOS (``<|endoftext|>``) in front of every scored sequence: the context of
  ``loglikelihood`` requests gets it from :meth:`FoTLM.tok_encode`, rolling log-likelihood
  (wikitext) gets it only from lm-eval's window prefix token (lm-eval's own
  ``HFLM(add_bos_token=True)`` puts two BOS there, and HFLM needs ``accelerate``);
* an explicit ``max_length`` (default: the model's configured length) for truncation and
  rolling windows.

It is registered with lm-eval as model type ``fot`` once :mod:`fot.eval.lm_eval_adapter` is
imported: ``lm_eval.simple_evaluate(model="fot", model_args="pretrained=DIR", tasks=[...])``
in the same process (the ``lm_eval`` shell command does not import it).

Offline use. Every standard lm-eval task loads its data from the Hugging Face hub. Either

1. fill the datasets cache once on a machine with internet (``python -m fot.eval lm-eval CKPT
   --out o`` there, or ``datasets.load_dataset`` of each task's ``dataset_path``), copy
   ``~/.cache/huggingface`` over and run with ``HF_DATASETS_OFFLINE=1``; or
2. download each task's dataset repository (``hf download ORG/NAME --repo-type dataset
   --local-dir ROOT/ORG/NAME``; the repository names are the ``dataset_path`` in
   lm-eval's task YAMLs, printed by ``--list-datasets``) and pass ``--dataset-root ROOT``:
   every task with a hub ``dataset_path`` reads it from ``ROOT/<dataset_path>``, and a missing
   folder is an error before anything runs; or
3. write your own task YAMLs (``dataset_path: json`` + ``dataset_kwargs.data_files``) and pass
   their folder with ``--include-path``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import sqlite3
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models, registered before "fot": see below)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from fot.progress import progress_bar
from fot.training.checkpoint import write_text_atomic, written_whole

from . import program_name
from .common import (
    CHECKPOINT_HELP,
    CONTEXT_LENGTH_HELP,
    JsonlLog,
    add_run_arguments,
    check_positions,
    claim_results,
    decode_text,
    encode_text,
    greedy_generate,
    hidden_and_head,
    load_checkpoint,
    model_dtype,
    model_logits,
    model_max_length,
    path_setting,
    pick_device,
    positive_int,
    refuse_empty_folder,
    write_run_config,
)

PAPER_TASKS = (
    "wikitext",
    "lambada_openai",
    "piqa",
    "hellaswag",
    "winogrande",
    "arc_easy",
    "arc_challenge",
    "copa",
    "openbookqa",
    "sciq",
    "boolq",
)
"""The FoX paper's zero-shot suite (Table 1)."""

# (column title, task, metric key in lm-eval results, scale) in the paper's Table 1 order.
TABLE1_COLUMNS = (
    ("Wiki. ppl↓", "wikitext", "word_perplexity,none", 1.0),
    ("LMB. ppl↓", "lambada_openai", "perplexity,none", 1.0),
    ("LMB. acc↑", "lambada_openai", "acc,none", 100.0),
    ("PIQA acc↑", "piqa", "acc,none", 100.0),
    ("Hella. acc-n↑", "hellaswag", "acc_norm,none", 100.0),
    ("Wino. acc↑", "winogrande", "acc,none", 100.0),
    ("ARC-e acc↑", "arc_easy", "acc,none", 100.0),
    ("ARC-c acc-n↑", "arc_challenge", "acc_norm,none", 100.0),
    ("COPA acc↑", "copa", "acc,none", 100.0),
    ("OBQA acc-n↑", "openbookqa", "acc_norm,none", 100.0),
    ("SciQA acc↑", "sciq", "acc,none", 100.0),
    ("BoolQ acc↑", "boolq", "acc,none", 100.0),
)


def make_fot_lm(
    model: torch.nn.Module | str,
    tokenizer: Any = None,
    *,
    max_length: int | None = None,
    batch_size: int = 1,
    bos: bool = True,
    **kwargs: Any,
) -> FoTLM:
    """Build a :class:`FoTLM` around a loaded model or an exported checkpoint folder.

    Args:
        model: a loaded causal LM, or an exported checkpoint folder.
        tokenizer: the model's tokenizer (loaded from the folder if ``model`` is a path).
        max_length: context length for truncation and rolling windows (default: the model's).
        batch_size: requests per forward pass.
        bos: put one BOS in front of every scored sequence.

    Returns:
        An lm-eval ``LM`` ready for ``lm_eval.simple_evaluate``.
    """
    return FoTLM(model, tokenizer, max_length=max_length, batch_size=batch_size, bos=bos, **kwargs)


# lm-eval registers its own models (``hf``, ``vllm``, ...) at its first model lookup only if
# its registry is still empty then: registered alone, "fot" hid them all for the rest of the
# process (``simple_evaluate(model="hf")`` failed: "no model for this name found! Supported
# model names: fot"). Importing ``lm_eval.models`` above registers them first.
@register_model("fot")
class FoTLM(TemplateLM):
    """An lm-eval language model for any Hugging Face causal LM, fot's tokenisation rules.

    Implements lm-eval's ``TemplateLM`` (requests, tasks, metrics and aggregation stay
    lm-eval's) without lm-eval's ``HFLM``, so neither ``accelerate`` nor HFLM's BOS handling
    is involved:

    * ``loglikelihood``: ``[BOS] context continuation``, left-truncated to ``max_length + 1``
      tokens; the continuation's log-probabilities are summed.
    * ``loglikelihood_rolling``: the text's tokens, split by lm-eval's rolling windows of
      ``max_length`` tokens with BOS as the prefix token: exactly one BOS.
    * ``generate_until``: greedy decoding (``max_gen_toks``, default 256), cut at ``until``.

    Args:
        pretrained: a loaded causal LM or an exported checkpoint folder.
        tokenizer: the tokenizer (loaded from the folder when ``pretrained`` is a path).
        max_length: context length (default: the model's configured length, else 2048): the
            longest input fed to the model, so at most a learned position table's size.
        batch_size: sequences per forward pass.
        bos: put one BOS in front of every scored sequence (rolling windows always start with
            BOS, the first token needs a context).
        device, dtype: used when loading from a folder.
    """

    def __init__(
        self,
        pretrained: Any,
        tokenizer: Any = None,
        max_length: int | str | None = None,
        batch_size: int | str = 1,
        bos: bool | str = True,
        device: str | None = None,
        dtype: str | None = "auto",
        **_: Any,
    ) -> None:
        super().__init__()
        if isinstance(bos, str):
            bos = bos.lower() in ("1", "true", "yes")
        if isinstance(pretrained, (str, Path)):
            pretrained, tokenizer = load_checkpoint(
                pretrained, device=pick_device(device), dtype=dtype
            )
        if tokenizer is None:
            raise ValueError("pass the tokenizer together with a loaded model")
        self.model = pretrained
        self.tokenizer = tokenizer
        self.max_length = int(max_length) if max_length else (model_max_length(pretrained) or 2048)
        self.batch_size = int(batch_size) if str(batch_size) != "auto" else 1
        if self.max_length < 2 or self.batch_size < 1:
            raise ValueError(
                f"max_length ({self.max_length}) must be >= 2 and batch_size "
                f"({self.batch_size}) >= 1"
            )
        # a learned position table (GPT-2's wpe) bounds the inputs: said now, not as an
        # IndexError from inside torch in the middle of a task
        if max_length:
            source = "--max-length"
        elif model_max_length(pretrained):
            source = "--max-length not given: the model config's context length"
        else:
            source = "--max-length not given: 2048, as the model config names no context length"
        given = f"max_length={self.max_length} ({source})"
        check_positions(pretrained, self.max_length, given)
        self.bos = bool(bos)
        self._device = next(pretrained.parameters()).device

    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-text id (``<|endoftext|>`` for GPT-2)."""
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """The id put before a context (BOS, else end-of-text, as in pretraining)."""
        bos = self.tokenizer.bos_token_id
        return int(bos if bos is not None else self.tokenizer.eos_token_id)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters are."""
        return self._device

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's path with ``/`` replaced (lm-eval names its request cache by it)."""
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    def tok_encode(
        self,
        string: str,
        add_special_tokens: bool | None = None,
        left_truncate_len: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of ``string``, with the prefix id first when ``bos`` is set (unless
        ``add_special_tokens=False``), cut to the last ``left_truncate_len`` ids."""
        ids = encode_text(self.tokenizer, string)  # rolling windows cut long texts
        if self.bos and add_special_tokens is not False:
            ids = [self.prefix_token_id, *ids]
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, ids: list[int]) -> str:
        """Text of token ``ids``."""
        return decode_text(self.tokenizer, ids)

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum log p(continuation | context) and greedy-match flag for each pair (one batch)."""
        rows, spans = [], []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("empty continuation")
            full = (ctx + cont)[-(self.max_length + 1) :]
            inp = full[:-1]
            n = min(len(cont), len(inp))
            rows.append(inp)
            spans.append((len(inp) - n, len(inp), full[-n:]))
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.eot_token_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)  # right padding never affects earlier positions
        ids = ids.to(self.device)
        split = hidden_and_head(self.model, ids)
        logits_all = model_logits(self.model, ids) if split is None else None
        out = []
        for i, (s, e, target) in enumerate(spans):
            if split is None:
                logits = logits_all[i, s:e].float()
            else:
                hidden, head = split
                logits = head(hidden[i, s:e]).float()
            logp = torch.log_softmax(logits, -1)  # (n, V)
            tgt = torch.tensor(target, device=logp.device)
            total = float(logp.gather(-1, tgt[:, None]).sum())
            greedy = bool((logp.argmax(-1) == tgt).all())
            out.append((total, greedy))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any):
        order = sorted(
            range(len(requests)), key=lambda i: -len(requests[i][1]) - len(requests[i][2])
        )
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = progress_bar(total=len(requests), disable=disable_tqdm, desc="loglikelihood")
        for s in range(0, len(order), self.batch_size):
            idx = order[s : s + self.batch_size]
            scored = self._score([(list(requests[i][1]), list(requests[i][2])) for i in idx])
            for i, res in zip(idx, scored):
                results[i] = res
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], res)
            bar.update(len(idx))
        bar.close()
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Total log-likelihood of each request's whole text (lm-eval ``Instance``s with
        ``args = (text,)``), scored in disjoint windows of at most ``max_length`` tokens."""
        from lm_eval import utils

        windows, owners = [], []
        for j, (text,) in enumerate(req.args for req in requests):
            tokens = self.tok_encode(text, add_special_tokens=False)  # BOS comes from windows
            for ctx, cont in map(
                utils.make_disjoint_window,
                utils.get_rolling_token_windows(
                    token_list=tokens,
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owners.append(j)
        scored = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for j, (ll, _) in zip(owners, scored):
            totals[j] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuation of each request's context (``args = (context, gen_kwargs)``)
        up to its ``until`` strings or ``max_gen_toks``."""
        outs = []
        for req in progress_bar(requests, disable=disable_tqdm, desc="generate"):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.get("max_gen_toks", 256))
            if max_gen >= self.max_length:  # no room left for the prompt
                raise ValueError(
                    f"a generation request asks for max_gen_toks={max_gen} new tokens, which "
                    f"leaves no room for its prompt in max_length={self.max_length} (--max-length)"
                    "; pass a larger --max-length or lower the task's "
                    "generation_kwargs.max_gen_toks"
                )
            ids = self.tok_encode(context, left_truncate_len=self.max_length - max_gen)
            gen = greedy_generate(
                self.model,
                torch.tensor([ids], device=self.device),
                max_new_tokens=max_gen,
                eos_token_id=self.eot_token_id,
            )
            text = self.tok_decode([t for t in gen if t != self.eot_token_id])
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            outs.append(text)
        return outs


def _task_config(task_manager: Any, task: str, *, resolve_func: bool) -> dict[str, Any] | None:
    """A task's full YAML config (``include:`` resolved), or None for non-YAML tasks.

    ``task`` is a registered task name or the path of a task YAML file.
    """
    from lm_eval.tasks._yaml_loader import load_yaml

    if Path(task).is_file():
        return dict(load_yaml(task, resolve_func=resolve_func))
    entry = task_manager.task_index.get(task)
    if entry is None:
        raise KeyError(f"lm-eval knows no task {task!r}; check --tasks and --include-path")
    if not getattr(entry, "yaml_path", None):
        return None
    return dict(load_yaml(entry.yaml_path, resolve_func=resolve_func))


def task_name(task: str) -> str:
    """The name lm-eval reports a task's results under.

    A registered task is its own name; a task YAML file (``--tasks path/to/task.yaml``) is
    the file's ``task:`` (or, for a group file, ``group:``) entry.

    Raises:
        ValueError: the file names no task, or several (a list), so results could not be found.
    """
    if not Path(task).is_file():
        return task
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(task, resolve_func=False)
    except Exception as err:  # YAML syntax, a broken include: named in the message
        raise ValueError(f"--tasks {task!r}: cannot read the task YAML ({err})") from err
    name = cfg.get("task", cfg.get("group")) if isinstance(cfg, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"--tasks {task!r}: the YAML file needs a `task: NAME` entry (or `group: NAME` "
            f"for a group) naming the task, got {name!r}; a file listing several tasks belongs "
            "in a folder passed with --include-path, its tasks named in --tasks"
        )
    return name


def _task_dataset_paths(task_manager: Any, tasks: list[str]) -> dict[str, str | None]:
    """``dataset_path`` of each task's YAML (read without building the task: no download)."""
    out: dict[str, str | None] = {}
    for t in tasks:
        cfg = _task_config(task_manager, t, resolve_func=False)
        out[t] = cfg.get("dataset_path") if cfg else None
    return out


# `datasets` builders that read the local files a task config names (dataset_kwargs), not a
# hub repository; used when `datasets` does not expose its list.
_LOCAL_BUILDERS = frozenset({"arrow", "csv", "json", "pandas", "parquet", "text", "xml"})


def _is_hub_dataset(dataset_path: str) -> bool:
    """Whether a task's ``dataset_path`` names a hub repository (not a builder or a path)."""
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES as builders
    except ImportError:
        builders = _LOCAL_BUILDERS
    return dataset_path not in builders and not Path(dataset_path).is_absolute()


def check_local_data_files(task_manager: Any, tasks: list[str]) -> None:
    """Refuse tasks whose local data files (``dataset_kwargs.data_files``) are empty.

    ``datasets`` fails on an empty JSON file with a bare ``StopIteration`` from deep inside;
    this names the task and the file instead, before the model is loaded. Missing files are
    left to ``datasets``, whose error names them.

    Raises:
        ValueError: some task's data file exists but holds nothing.
    """
    for task in tasks:
        cfg = _task_config(task_manager, task, resolve_func=False) or {}
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        if isinstance(files, dict):
            files = list(files.values())
        stack, paths = [files], []
        while stack:
            item = stack.pop()
            if isinstance(item, (list, tuple)):
                stack.extend(item)
            elif isinstance(item, str):
                paths.append(Path(item))
        for path in paths:
            if path.is_file() and not path.read_bytes().strip():
                raise ValueError(
                    f"lm-eval task {task!r}: its data file {str(path)!r} is empty; fill it "
                    "(one JSON record per line for `dataset_path: json`) or point the task's "
                    "dataset_kwargs.data_files at the right file"
                )


def local_dataset_dirs(task_manager: Any, tasks: list[str], dataset_root: str) -> dict[str, Path]:
    """The folder under ``dataset_root`` that each task reads its hub dataset from, checked.

    Tasks whose ``dataset_path`` is a hub repository ``ORG/NAME`` read ``ROOT/ORG/NAME``;
    tasks reading local files (``dataset_path: json`` etc.) or without a YAML are left alone.

    Raises:
        FileNotFoundError: ``dataset_root`` is not a folder, or some task's folder is missing;
            the message names the paths and the download commands that fill them.
    """
    root = Path(dataset_root)
    if not root.is_dir():
        raise FileNotFoundError(_missing_root_message(root))
    dirs: dict[str, Path] = {}
    missing: dict[str, str] = {}
    for task, dataset_path in _task_dataset_paths(task_manager, tasks).items():
        if not dataset_path or not _is_hub_dataset(dataset_path):
            continue
        local = root / dataset_path
        if local.is_dir():
            dirs[task] = local.resolve()
        else:
            missing[task] = dataset_path
    if missing:
        lines = [
            f"  {task}: {str(root / path)!r} is missing; download it with: hf download "
            f"{path} --repo-type dataset --local-dir {shlex.quote(str(root / path))}"
            for task, path in missing.items()
        ]
        raise FileNotFoundError(
            f"--dataset-root {str(root)!r} lacks the dataset folders of "
            f"{len(missing)} task(s):\n" + "\n".join(lines) + "\nDownload them on a machine with "
            f"internet and copy them there (`{program_name()} lm-eval CKPT --tasks ... "
            "--list-datasets --out x` prints every task's dataset), or leave these tasks out of "
            "--tasks and run them without --dataset-root (Hugging Face datasets cache)."
        )
    return dirs


def _missing_root_message(root: Path) -> str:
    what = "is a file, not a folder" if root.exists() else "does not exist"
    return (
        f"--dataset-root {str(root)!r} {what}; pass the folder holding the downloaded dataset "
        f"repositories as ROOT/<dataset_path> (`{program_name()} lm-eval CKPT --list-datasets "
        "--out x` prints what to download: hf download ORG/NAME --repo-type dataset "
        "--local-dir ROOT/ORG/NAME), or leave --dataset-root out to read the Hugging "
        "Face datasets cache"
    )


def table1(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table in the paper's Table 1 columns; missing tasks show as ``-``.

    The average is over the accuracy columns present (perplexities excluded), as in the paper.
    """
    titles, values, accs = [], [], []
    for title, task, key, scale in TABLE1_COLUMNS:
        titles.append(title)
        v = results.get(task, {}).get(key)
        if isinstance(v, (int, float)):
            values.append(f"{scale * v:.2f}")
            if "acc" in key:
                accs.append(scale * v)
        else:
            values.append("-")
    titles.append("Avg↑")
    values.append(f"{sum(accs) / len(accs):.2f}" if accs else "-")
    return "\n".join(
        [
            "| " + " | ".join(titles) + " |",
            "|" + "---|" * len(titles),
            "| " + " | ".join(values) + " |",
        ]
    )


def other_tasks_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown table (task, metric, value) of the tasks that are not Table 1 columns.

    Returns an empty string when every task is one of Table 1's.
    """
    paper = {task for _, task, _, _ in TABLE1_COLUMNS}
    rows = [
        f"| {task} | {key} | {value:.4f} |"
        for task, metrics in results.items()
        if task not in paper
        for key, value in metrics.items()
        if key != "sample_len"
    ]
    if not rows:
        return ""
    return "\n".join(["| task | metric | value |", "|---|---|---|", *rows])


def limit_note(limit: int, n_samples: dict[str, Any]) -> str:
    """The line under ``table1.md`` of a ``--limit`` run: that it is a smoke run and how many
    examples each task scored, of how many it has.

    Args:
        limit: the ``--limit`` given.
        n_samples: task name -> lm-eval's ``n-samples`` entry of the task (``{"original": N,
            "effective": M}``), or None where lm-eval reported none.
    """

    def count(entry: Any) -> str:
        if not isinstance(entry, dict) or "effective" not in entry:
            return "not reported"
        return f"{entry['effective']} of {entry.get('original', '?')}"

    return (
        f"--limit {limit}: a smoke run, not comparable with full results; examples scored per "
        "task: " + ", ".join(f"{name} {count(entry)}" for name, entry in n_samples.items())
    )


@contextmanager
def quiet_git_hash() -> Iterator[None]:
    """While active, lm-eval looks up the working directory's git commit without printing git's
    complaint outside a repository.

    ``lm_eval.simple_evaluate`` records ``git describe --always`` of the current directory with
    git's stderr on the terminal, so every task run outside a git repository (where users
    evaluate) printed ``fatal: not a git repository`` into a successful run's output. The
    same lookup runs here with git's stderr captured, with lm-eval's own fallback (reading
    ``.git`` in the working directory), so the recorded hash is unchanged.
    """
    import lm_eval.evaluator as evaluator
    import lm_eval.loggers.utils as lm_eval_utils

    original = getattr(evaluator, "get_git_commit_hash", None)
    if original is None:  # another lm-eval version: nothing to quiet
        yield
        return
    fallback = getattr(lm_eval_utils, "get_commit_from_path", lambda path: None)

    def git_hash() -> str | None:
        try:
            res = subprocess.run(
                ["git", "describe", "--always"], capture_output=True, text=True, check=False
            )
        except OSError:  # git is not installed
            return fallback(os.getcwd())
        if res.returncode != 0:  # no repository here
            return fallback(os.getcwd())
        return res.stdout.strip()

    evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def evaluate(
    lm: Any,
    tasks: list[str],
    *,
    out: Path,
    include_path: str | None = None,
    dataset_root: str | None = None,
    limit: int | None = None,
    log_samples: bool = False,
    task_manager: Any = None,
) -> dict[str, dict[str, Any]]:
    """Run lm-eval task by task (zero-shot), resumable.

    Finished tasks are recorded in ``results.jsonl`` and skipped on restart (run again, from
    the request cache, where ``log_samples`` asks for samples they lack); inside a task,
    finished requests are kept in lm-eval's request cache (``lm_cache_rank0.db``). Neither knows
    which model produced it: use a separate ``out`` per model and settings (the CLI checks this
    with :func:`fot.eval.common.claim_results`).

    Args:
        lm: an lm-eval ``LM`` (e.g. :func:`make_fot_lm`).
        tasks: lm-eval task names, or paths of task YAML files (reported under the file's
            ``task:`` name, :func:`task_name`).
        out: results folder (``results.jsonl`` per finished task, ``samples_<task>.jsonl``).
        include_path: extra folder of task YAMLs (local copies).
        dataset_root: folder of downloaded dataset repositories, ``ROOT/<dataset_path>``;
            every task's folder must exist (:func:`local_dataset_dirs`).
        limit: examples per task (smoke runs only: results are not comparable).
        log_samples: also write per-example outputs.
        task_manager: an lm-eval ``TaskManager`` to reuse (default: a new one with
            ``include_path``, indexing only that folder when it defines every task).

    Returns:
        ``{task name: {metric: value}}`` for every requested task.
    """
    import lm_eval

    tm = task_manager or _task_manager(include_path, tasks)
    local_dirs = local_dataset_dirs(tm, tasks, dataset_root) if dataset_root else {}
    log = JsonlLog(out / "results.jsonl")
    names = {task: task_name(task) for task in tasks}
    for task in progress_bar(tasks, desc="lm-eval tasks", unit="task"):
        name = names[task]
        samples = out / f"samples_{name}.jsonl"
        if log.done(name) and not (log_samples and not samples.is_file()):
            continue
        # a finished task without its samples (an earlier run without --log-samples) runs
        # again for them, its requests answered from the request cache
        spec: str | dict[str, Any] = task
        if task in local_dirs:
            # The task's whole config with only the dataset location changed (an inline
            # config replaces the registered one, so it must be complete).
            spec = _task_config(tm, task, resolve_func=True) or {"task": task}
            spec["dataset_path"] = str(local_dirs[task])
        try:
            with quiet_git_hash():
                res = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=[spec],
                    num_fewshot=0,
                    limit=limit,
                    task_manager=tm,
                    log_samples=log_samples,
                    bootstrap_iters=0,
                    # Request-level resume inside a task: lm-eval's sqlite cache of finished
                    # requests.
                    use_cache=str(out / "lm_cache"),
                )
        except Exception as err:
            error = _task_error(tm, task, err)
            if error is None:
                raise
            raise error from err
        if name not in res["results"]:  # recorded as done, it would be skipped forever
            raise ValueError(
                f"lm-eval task {task!r}: lm-eval reported no results under {name!r} but under "
                f"{sorted(res['results'])}; nothing was recorded for this task. A group YAML "
                "without aggregate metrics reports only its subtasks: name those in --tasks"
            )
        metrics = {
            k: v
            for k, v in res["results"][name].items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if log_samples and "samples" in res:
            with written_whole(samples) as tmp, tmp.open("w") as f:
                for s in res["samples"].get(name, []):
                    f.write(json.dumps(s, default=str) + "\n")
        if not log.done(name):
            log.append(
                {"key": name, "metrics": metrics, "n_samples": res.get("n-samples", {}).get(name)}
            )
    wanted = set(names.values())
    return {r["key"]: r["metrics"] for r in log if r["key"] in wanted}


def _task_error(task_manager: Any, task: str, err: Exception) -> Exception | None:
    """The one-line error for ``err``, raised by lm-eval while it ran ``task``, where it is
    one of the task's data or config (not reachable offline, a file ``datasets`` cannot parse,
    a template naming a field the documents lack); ``None`` for any other error."""
    if isinstance(err, ConnectionError):  # datasets could not reach the hub (offline machine)
        return ConnectionError(
            f"lm-eval task {task!r}: its dataset is neither in the Hugging Face datasets "
            f"cache nor reachable on the hub ({err}). Offline, download it elsewhere and "
            "pass --dataset-root ROOT (--list-datasets prints what to download), or "
            "--include-path with local task YAMLs (eval/README.md, section Data)"
        )
    from datasets.exceptions import DatasetGenerationError
    from jinja2.exceptions import UndefinedError

    if isinstance(err, DatasetGenerationError):
        cause = err.__cause__ or err.__context__ or err
        cfg = _task_config(task_manager, task, resolve_func=False) or {}
        files = (cfg.get("dataset_kwargs") or {}).get("data_files")
        where = f" from {files}" if files else f" ({cfg.get('dataset_path', 'its dataset_path')})"
        return ValueError(
            f"lm-eval task {task!r}: the datasets library could not read its data{where}: "
            f"{str(cause).strip() or type(cause).__name__}; fix the file, "
            "or the task YAML's dataset_path / dataset_kwargs"
        )
    if isinstance(err, UndefinedError):
        return ValueError(
            f"lm-eval task {task!r}: a template in its YAML (doc_to_text, doc_to_target, "
            f"doc_to_choice, ...) uses a field its documents do not have ({err}); name the "
            "documents' own fields there, or fix the data"
        )
    return None


def drop_empty_request_caches(out: Path) -> list[Path]:
    """Delete lm-eval request caches in ``out`` that hold no finished request.

    lm-eval creates its cache (``lm_cache_rank<r>.db``, sqlite) before it loads a task's
    dataset, so a run that failed there (offline, a wrong ``--dataset-root``) leaves an empty
    one; as saved state it would tie the next run to the failed run's settings. An empty cache
    holds nothing to resume, so deleting it loses nothing. Files that are not readable sqlite
    databases are left alone.

    Returns:
        The deleted files.
    """
    dropped = []
    for db in sorted(out.glob("lm_cache_rank*.db")):
        try:
            with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                tables = [
                    name
                    for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
                ]
                rows = sum(
                    con.execute(f'SELECT COUNT(*) FROM "{name}"').fetchone()[0] for name in tables
                )
        except sqlite3.Error:
            continue
        if rows == 0:
            db.unlink(missing_ok=True)
            dropped.append(db)
    return dropped


def _plain_task_file(task: str) -> bool:
    """``task`` is the path of a YAML file that defines one plain task (not a group or tag),
    which lm-eval builds from the file alone."""
    if not Path(task).is_file():
        return False
    try:
        from lm_eval.tasks._index import Kind, TaskIndex

        entry = TaskIndex.entry_from_path(Path(task))
    except Exception:  # a broken file (lm-eval names it as it loads it), another lm-eval
        return False
    return entry is not None and entry.kind in (Kind.TASK, Kind.PY_TASK)


def include_path_files(include_path: str | os.PathLike, tasks: set[str]) -> list[str]:
    """The files of ``--include-path`` whose content the results of ``tasks`` depend on,
    relative to it: all but the YAML files of other tasks (a file whose ``task:`` names one
    task, not in ``tasks``, and not included by a file that counts). Templates, groups,
    Python helpers and data files count whatever they serve, so that a task file added to
    the folder later lets the results of the others resume, and a change to any file they
    may read does not."""
    import yaml

    class _Loader(yaml.SafeLoader):
        """Reads lm-eval's ``!function`` tags (and any other) as nothing."""

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    root = Path(include_path).resolve()
    files = sorted(f for f in root.rglob("*") if f.is_file())
    configs: dict[Path, Any] = {}
    for f in files:
        if f.suffix in (".yaml", ".yml"):
            try:
                configs[f] = yaml.load(f.read_text(encoding="utf-8"), Loader=_Loader)
            except (OSError, ValueError, yaml.YAMLError):
                configs[f] = None  # unreadable: counted
    other_task = {
        f
        for f, cfg in configs.items()
        if isinstance(cfg, dict) and isinstance(cfg.get("task"), str) and cfg["task"] not in tasks
    }
    counted, todo = set(), [f for f in configs if f not in other_task]
    while todo:
        f = todo.pop()
        if f in counted:
            continue
        counted.add(f)
        cfg = configs[f]
        included = cfg.get("include") if isinstance(cfg, dict) else None
        for name in included if isinstance(included, list) else [included]:
            if isinstance(name, str):
                todo.append((f.parent / name).resolve())
    return [str(f.relative_to(root)) for f in files if f not in other_task or f in counted]


def _task_manager(include_path: str | None, tasks: Sequence[str] = ()) -> Any:
    """An lm-eval ``TaskManager``; when every task in ``tasks`` is a plain task (not a group or
    tag) defined under ``include_path`` or in a YAML file given by its path, one that indexes
    only ``include_path`` (or nothing): indexing lm-eval's own ~15k task files takes ~14 s per
    run, a task of ``include_path`` overrides a built-in one of the same name in the full index
    anyway, and a task file is loaded from its path."""
    from lm_eval.tasks import TaskManager

    if tasks:
        own = TaskManager(include_path=include_path or None, include_defaults=False)
        plain = set(getattr(own, "all_subtasks", ()))
        if all(t in plain or _plain_task_file(t) for t in tasks):
            return own
    if not include_path:
        return TaskManager()
    return TaskManager(include_path=include_path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``lm-eval`` command's options."""
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument(
        "--tasks",
        default=",".join(PAPER_TASKS),
        help="comma-separated lm-eval task names or task YAML files (default: the paper's "
        "zero-shot suite: %(default)s)",
    )
    p.add_argument(
        "--max-length",
        type=positive_int,
        default=None,
        help="context length for truncation/rolling windows (default: "
        f"{CONTEXT_LENGTH_HELP}, else 2048)",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        default=8,
        help="requests per forward pass (default: %(default)s)",
    )
    p.add_argument("--no-bos", action="store_true", help="score sequences without a BOS token")
    p.add_argument(
        "--include-path",
        default=None,
        help="folder of extra/local task YAMLs (default: lm-eval's own tasks only)",
    )
    p.add_argument(
        "--dataset-root",
        default=None,
        help="folder of downloaded HF dataset repos, ROOT/<dataset_path>, for offline runs; "
        "every task's folder must exist, --list-datasets prints them (default: the Hugging "
        "Face datasets cache or hub)",
    )
    p.add_argument(
        "--list-datasets",
        action="store_true",
        help="print each task's dataset_path (what to download) and exit",
    )
    p.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help="examples per task, for smoke runs (default: all)",
    )
    p.add_argument("--log-samples", action="store_true", help="also write samples_<task>.jsonl")
    add_run_arguments(p)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``lm-eval``; returns ``{task: {metric: value}}`` (``--list-datasets``: the paths)."""
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    refuse_empty_folder("--include-path", args.include_path, "that holds your task YAML files")
    refuse_empty_folder(
        "--dataset-root", args.dataset_root, "of downloaded dataset repositories, or leave it out"
    )
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise FileNotFoundError(
            f"--include-path {args.include_path!r} is not a folder; pass the folder that holds "
            "your task YAML files"
        )
    if args.include_path is not None:
        folder = Path(args.include_path).resolve()
        if folder == Path(args.out).resolve() or folder in Path(args.out).resolve().parents:
            # lm-eval would index the results as task files, and they would change the files
            # the resume record fingerprints
            raise ValueError(
                f"--out {args.out!r} is inside --include-path {str(folder)!r}; choose a folder "
                f"outside it, e.g. {str(folder.parent / (folder.name + '_eval'))!r}"
            )
    tm = _task_manager(args.include_path, tasks)
    unknown = [t for t in tasks if t not in tm.task_index and not Path(t).is_file()]
    if unknown or not tasks:  # before the model is loaded
        raise ValueError(
            f"--tasks {args.tasks!r}: lm-eval knows no task {unknown or '(empty list)'}; check "
            "the spelling (`lm_eval ls tasks` lists them) or pass the folder of your task YAMLs "
            "with --include-path"
        )
    names = [task_name(t) for t in tasks]  # a YAML file without a usable name: said now
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:  # one would be skipped as already done
        raise ValueError(
            f"--tasks {args.tasks!r} names the task(s) {repeated} more than once (a YAML file "
            "counts under its `task:` name); list each task once"
        )
    check_local_data_files(tm, tasks)
    if args.list_datasets:  # what to download: works before --dataset-root exists
        paths = _task_dataset_paths(tm, tasks)
        print(json.dumps(paths, indent=2))
        return paths
    if args.dataset_root:  # a missing root or task folder: fail before loading the model
        local_dataset_dirs(tm, tasks, args.dataset_root)
    out = Path(args.out)
    model, tokenizer = load_checkpoint(
        args.checkpoint, device=pick_device(args.device), dtype=args.dtype
    )
    lm = make_fot_lm(
        model,
        tokenizer,
        max_length=args.max_length,
        batch_size=args.batch_size,
        bos=not args.no_bos,
    )
    if out.is_dir():
        drop_empty_request_caches(out)
    # Finished tasks and lm-eval's request cache (keyed by request text only, not by model)
    # resume only a run of the same checkpoint and settings; other tasks extend it.
    claim_results(
        out,
        "lm_eval",
        checkpoint=args.checkpoint,
        settings={
            "--max-length": lm.max_length,
            "--no-bos": args.no_bos,
            "--limit": args.limit,
            "--include-path": path_setting(args.include_path),
            "--dataset-root": path_setting(args.dataset_root),
            "--dtype": model_dtype(model),
        },
        state=["results.jsonl", "lm_cache_rank*.db"],
        outputs=["results.json", "results.csv", "table1.md", "samples_*.jsonl"],
        restart=args.restart,
        data_files=(
            {"--include-path": include_path_files(args.include_path, set(names))}
            if args.include_path
            else None
        ),
    )
    write_run_config(out, "lm-eval", vars(args), args.checkpoint)
    try:
        results = evaluate(
            lm,
            tasks,
            out=out,
            include_path=args.include_path,
            dataset_root=args.dataset_root,
            limit=args.limit,
            log_samples=args.log_samples,
            task_manager=tm,
        )
    except BaseException:
        drop_empty_request_caches(out)  # lm-eval made them before the failure; none resumes
        raise
    write_text_atomic(out / "results.json", json.dumps(results, indent=2) + "\n")
    with written_whole(out / "results.csv") as tmp, tmp.open("w", newline="") as f:
        rows = csv.writer(f)  # quotes lm-eval's metric keys, which hold a comma ("acc,none")
        rows.writerow(["task", "metric", "value"])
        for task, metrics in results.items():
            for key, value in metrics.items():
                rows.writerow([task, key, value])
    table = table1(results)
    others = other_tasks_table(results)
    if others:  # tasks outside the paper's suite: their own table under Table 1's columns
        table += "\n\n" + others
    if args.limit is not None:  # a subset (or, past a task's size, all of it): said with it
        counts = {r["key"]: r.get("n_samples") for r in JsonlLog(out / "results.jsonl")}
        table += "\n\n" + limit_note(args.limit, {name: counts.get(name) for name in results})
    write_text_atomic(out / "table1.md", table + "\n")
    print(table)
    return results
