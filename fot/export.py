"""Export a model as a Hugging Face checkpoint folder.

The folder holds ``config.json`` (with ``auto_map``), safetensors weights, a GPT-2 tokenizer and
two tiny remote-code modules that re-export the classes from the installed ``fot`` package, so
both of these work (with fot installed)::

    AutoModelForCausalLM.from_pretrained(dir)                          # after `import fot`
    AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)  # without importing fot
    lm_eval --model hf --model_args pretrained=dir,trust_remote_code=True ...

The first works for FoT and Transformer models; FLA baselines (``mamba2``, ``deltanet``, ...) are
registered only by :func:`fot.models.fla_baselines.register_auto_classes` (``import fot`` does
not import FLA), so load their folders with ``trust_remote_code=True`` or call it first:
otherwise transformers asks to run the folder's code. Their ``model_type`` is fot's
(``fot_mamba2``, ...; :func:`fot.models.fla_baselines.fla_config_class`), so transformers never
takes one for its own model of FLA's type name.

Without ``import fot``, pass ``trust_remote_code=True`` to ``AutoTokenizer.from_pretrained(dir)``
as well: transformers reads ``config.json`` (whose ``auto_map`` names the shims) before the
tokenizer files, and otherwise stops to ask "Do you wish to run the custom code? [y/N]".
Attention is chosen by ``attn_backend`` (e.g. ``from_pretrained(dir, attn_backend="reference")``),
not by HF's ``attn_implementation``.

A FoT model loaded from such a folder (either way) and saved again with ``save_pretrained``
gets the same shims (``FoTConfig.save_pretrained``), so the new folder loads the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from fot.errors import FotError, cannot_write, not_one_of
from fot.progress import on_terminal
from fot.staging import ended_writers, remove_and_log, set_aside_name, writer_tag

logger = logging.getLogger(__name__)
_CONFIG_MODULE = "configuration_fot"
_MODEL_MODULE = "modeling_fot"

# Weight files of a saved HF model (single file, shards, their index; safetensors or pickle).
# from_pretrained prefers model.safetensors to shards: one left by an earlier export would be
# loaded instead of the new weights.
_WEIGHT_FILE = re.compile(
    r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)$"
    r"|^(model\.safetensors|pytorch_model\.bin)\.index\.json$"
)
# The other files export_hf writes (the tokenizer's only with tokenizer=True).
_WRITTEN = ("config.json", "generation_config.json", f"{_CONFIG_MODULE}.py", f"{_MODEL_MODULE}.py")
_TOKENIZER_FILES = (
    "vocab.json",
    "merges.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)

# Where the remote-code modules tell users to get fot: it is installed from its source tree
# (README), not from a package index.
INSTALL_HINT = (
    "fot is installed from a clone of its repository: `pip install -e <clone>` (the clone's "
    "README.md gives the full install); it is not on a package index, so installing it by "
    "name does not work"
)

_SHIM_HEADER = '''"""Remote-code entry point written by fot.export: re-exports classes of the `fot` package
for `trust_remote_code=True`. fot must be installed: it is installed from a clone of its
repository (`pip install -e <clone>`, see the clone's README.md), not from a package index."""

'''

# The import sits in a try block: transformers then does not pre-check it (its own message
# would be "Run `pip install fot`"), and a missing fot is reported with the right install.
_SHIM_IMPORT = """try:
{imports}
except ModuleNotFoundError as err:
    if err.name not in ("fot", "fot.models"):
        raise
    raise ImportError(
        "this checkpoint's code is in the fot package, which is not installed. "
        {hint!r}
    ) from err
"""


class WeightFilesError(FotError, ValueError):
    """A checkpoint folder's weight files are missing or cannot be read."""


def read_weight_files(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of the weight files of an HF-style folder, as ``from_pretrained`` picks them:
    ``model.safetensors``, else its shards ``model-*-of-*.safetensors``, else
    ``pytorch_model*.bin`` (read with ``weights_only=True``). Tensors keep their dtype, on the CPU.

    Raises:
        WeightFilesError: no weight file, or one that cannot be read (names it).
    """
    from safetensors.torch import load_file

    p = Path(folder)
    state: dict[str, torch.Tensor] = {}
    for name in _weight_file_names(p):
        with _naming_unreadable(p / name):
            if name.endswith(".safetensors"):
                state.update(load_file(p / name))
            else:
                state.update(torch.load(p / name, map_location="cpu", weights_only=True))
    return state


def check_weight_files(folder: str | os.PathLike) -> None:
    """Open the weight files :func:`read_weight_files` reads without reading their tensors (a
    safetensors header, a zip's directory): a file cut short is refused in moments. A
    ``pytorch_model.bin`` of torch's legacy (non-zip) format is read whole.

    Raises:
        WeightFilesError: no weight file, or one that cannot be opened (names it).
    """
    from safetensors import safe_open

    p = Path(folder)
    for name in _weight_file_names(p):
        with _naming_unreadable(p / name):
            if name.endswith(".safetensors"):
                with safe_open(p / name, framework="pt"):
                    pass
            else:
                # torch's legacy (non-zip) format, as torch < 1.6 wrote pytorch_model.bin,
                # cannot be memory-mapped: read whole (a zip cut short fails either way)
                mmap = zipfile.is_zipfile(p / name)
                torch.load(p / name, map_location="cpu", weights_only=True, mmap=mmap)


def _weight_file_names(p: Path) -> list[str]:
    """The weight files of folder ``p`` that ``from_pretrained`` reads (see
    :func:`read_weight_files`); :class:`WeightFilesError` where there is none."""
    names = sorted(f.name for f in p.iterdir() if f.is_file() and _WEIGHT_FILE.match(f.name))
    names = [n for n in names if not n.endswith(".index.json")]
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if "model.safetensors" in safetensors:
        names = ["model.safetensors"]
    elif safetensors:
        names = safetensors
    if not names:
        raise WeightFilesError(
            f"{p} holds no weights (model.safetensors, its shards or pytorch_model*.bin): copy "
            "or download the whole checkpoint folder"
        )
    return names


@contextlib.contextmanager
def _naming_unreadable(path: Path) -> Iterator[None]:
    """Turn a failed read of the weight file ``path`` into a :class:`WeightFilesError`."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, RuntimeError, OSError, EOFError, ValueError) as err:
        raise WeightFilesError(
            f"{path} cannot be read ({type(err).__name__}: {str(err)[:200]}): the copy "
            "is incomplete or damaged; copy or download the checkpoint folder again"
        ) from None


def _class_path(cls: type) -> tuple[str, str]:
    """``(module, name)`` under which ``cls`` can be imported again."""
    module = cls.__module__
    if module.startswith("fot.models.fla_baselines"):
        module = "fot.models.fla_baselines"  # lazily created wrapper classes live here
    return module, cls.__name__


def export_hf(
    model: PreTrainedModel,
    path: str | os.PathLike,
    *,
    tokenizer: bool = True,
    max_shard_size: str = "5GB",
    text_escaping: str = "none",
    replace_run_export: bool = False,
) -> Path:
    """Write ``model`` as an HF checkpoint folder loadable by ``AutoModelForCausalLM``.

    What an export killed part way (SIGKILL, the OOM killer) left of its staged folders is
    removed first, with a line in the log; a folder of an earlier export's files that it had
    set aside is kept and named with what to do (:mod:`fot.staging`).

    Args:
        model: a :class:`fot.FoTForCausalLM` (or a baseline from :func:`fot.presets.build_model`).
        path: output folder (created if missing).
        tokenizer: also write the GPT-2 tokenizer (``fot.tokenizer.save_hf_tokenizer``).
        max_shard_size: passed to ``save_pretrained``.
        text_escaping: how the training text was escaped before tokenization
            (``fot.tokenizer.TEXT_ESCAPINGS``; ``"json"`` for LongCrawl64), recorded with the
            tokenizer for ``fot.eval``.
        replace_run_export: replace a training run's own export, ``<run>/hf``, as the run
            does when it ends; without it that folder is refused (it holds the run's final
            weights, their only copy once the checkpoints are deleted).

    Returns:
        The folder path.

    Raises:
        NotADirectoryError: ``path`` is a file.
        FileExistsError: ``path`` is a training run's own export and ``replace_run_export`` is
            not set; nothing is written.
        FileExistsError: ``path`` holds files that the export would overwrite (config,
            weights, tokenizer) and is not a folder of an earlier export of a fot model; nothing
            is written. An earlier export is replaced once the new one is complete (written
            into a folder inside it first; its weight files go, so none of them is loaded
            instead of the new ones); other files are kept.
        fot.errors.WriteError: the export could not be written (a full disk, a read-only
            folder): nothing in ``path`` was changed.
    """
    from fot.tokenizer import TEXT_ESCAPINGS

    if text_escaping not in TEXT_ESCAPINGS:
        raise ValueError(not_one_of("export_hf: text_escaping", text_escaping, TEXT_ESCAPINGS))
    if not isinstance(model, PreTrainedModel):
        inner = next(
            (
                f"model.{name}"
                for name in ("_orig_mod", "module")  # torch.compile, DDP
                if isinstance(getattr(model, name, None), PreTrainedModel)
            ),
            None,
        )
        fix = (
            f"pass {inner}, the model it wraps"
            if inner
            else "unwrap DDP or torch.compile wrappers first (model.module, model._orig_mod)"
        )
        raise TypeError(
            f"export_hf needs a transformers PreTrainedModel, got {type(model).__name__}; {fix}"
        )
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(
            f"export_hf: {out} is a file, not a folder; pass the path of a new or empty folder "
            "(created if missing)"
        )
    run = None if replace_run_export else _run_of_final_export(out)
    if run is not None:
        raise FileExistsError(
            f"export_hf: {_final_export_refusal(out, run, '<run>/hf_step_<n>')}; or pass "
            "replace_run_export=True to replace it"
        )
    target = Path(os.path.abspath(out))
    _clean_ended_exports(target)
    if out.is_dir():
        stale = sorted(
            p.name
            for p in out.iterdir()
            if _WEIGHT_FILE.match(p.name)
            or p.name in _WRITTEN
            or (tokenizer and p.name in _TOKENIZER_FILES)
        )
        if stale and not is_fot_export(out):
            raise FileExistsError(
                f"export_hf: {out} already holds {', '.join(stale)}, which the export would "
                "overwrite, and is not a folder exported from a fot model (its config.json has "
                "no fot model_type or auto_map); nothing was written. "
                + (_set_aside_hint(out) or "Pass an empty or new folder, or move those files away")
            )
    # Written into a new folder and moved into `out` once complete: a full disk or an error
    # part way leaves an earlier export whole, and no folder with weights but without its
    # tokenizer (or the other way round) that would load as if complete. The new folder is
    # inside an existing `out` (the renames stay on its file system, which a symlink or a
    # mount point may put elsewhere than its parent, and its parent need not be writable),
    # else beside it.
    staged = (target if target.is_dir() else target.parent) / f".{target.name}.new-{writer_tag()}"
    try:
        _write_export(model, staged, tokenizer, max_shard_size, text_escaping)
    except BaseException as err:  # also Ctrl-C: no half-written folder is left
        shutil.rmtree(staged, ignore_errors=True)
        kept = "The export was not written" + (f"; {out} is as it was" if target.exists() else "")
        error = cannot_write(out, err, kept) if isinstance(err, Exception) else None
        if error is None:
            raise
        raise error from err
    try:
        _move_export(staged, target, tokenizer)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out


def _clean_ended_exports(target: Path) -> None:
    """Remove the staged exports into ``target`` (``.{name}.new-{host}.{pid}``, inside it or
    beside it) of processes that have ended (killed while writing or moving one in,
    :mod:`fot.staging`); name the folders of an earlier export's files that such a process set
    aside while replacing it (``.{name}.old-{host}.{pid}``, inside it): those are kept (unless
    empty), as a kill between moving them aside and moving the new files in leaves them the
    only copy of the earlier export (the new one is then split between ``target`` and its
    staged folder, which is removed: this export writes it again)."""
    asides = ended_writers(target, f".{target.name}.old-")
    empty = [left for left in asides if _is_empty_folder(left.path)]
    new = f".{target.name}.new-"
    leftovers = [*ended_writers(target, new), *ended_writers(target.parent, new), *empty]
    remove_and_log(leftovers, logger, f"exports into {target}")
    for left in asides:
        if left not in empty:
            logger.warning(
                "kept %s: it holds files of an earlier export of %s that %s set aside while "
                "replacing them and did not finish (it ended; killed?), and may be their only "
                "copy. To keep that export, move its files into a folder of their own; else "
                "delete it (rm -r '%s')",
                left.path,
                target,
                left.writer(),
                left.path,
            )


def _set_aside_hint(out: Path) -> str:
    """How to make ``out`` whole again where an export killed while replacing the one in it
    left files of it set aside (:func:`_clean_ended_exports`); ``""`` where none did."""
    target = Path(os.path.abspath(out))
    kept = [str(left.path) for left in ended_writers(target, f".{target.name}.old-")]
    if not kept:
        return ""
    return (
        f"{', '.join(kept)} holds files of the export in {out} that an export killed while "
        f"replacing it set aside: move them back into {out}, then export again"
    )


def _is_empty_folder(path: Path) -> bool:
    try:
        return next(path.iterdir(), None) is None
    except OSError:  # not a folder, or not readable: kept
        return False


def _write_export(
    model: PreTrainedModel,
    out: Path,
    tokenizer: bool,
    max_shard_size: str,
    text_escaping: str,
) -> None:
    """:func:`export_hf`'s files, written into the new folder ``out``."""
    out.mkdir(parents=True)
    previous = getattr(model.config, "auto_map", None)
    model.config.auto_map = remote_code_auto_map(type(model.config), type(model))
    # The tokenizer pads with <|endoftext|>: generate() pads finished rows with it too, instead
    # of warning on every call that it picked eos_token_id for want of a pad_token_id, and the
    # config says so too, or HF's Trainer given the tokenizer warns that it "aligned" the config.
    from fot.tokenizer import EOT_ID, save_hf_tokenizer

    gen = getattr(model, "generation_config", None)
    pads_with_eot = (
        tokenizer
        and getattr(gen, "eos_token_id", None) == EOT_ID
        and getattr(model.config, "vocab_size", 0) > EOT_ID
    )
    from fot.models.configuration_fot import FoTConfig

    # config.json only for fot's own models: FLA's DeltaNet and HGRN2 build their embedding with
    # padding_idx=config.pad_token_id, whose row (here <|endoftext|>, their BOS) never trains
    configs = (gen, model.config) if isinstance(model.config, FoTConfig) else (gen,)
    set_pad = [
        c
        for c in configs
        if pads_with_eot and c is not None and getattr(c, "pad_token_id", EOT_ID) is None
    ]
    for c in set_pad:
        c.pad_token_id = EOT_ID
    from transformers.utils import logging as hf_logging

    # its "Writing model shards" bar would be one line of carriage returns in a log file
    quiet = not on_terminal() and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, max_shard_size=max_shard_size)
        make_weights_readable(out)
        # after save_pretrained: it may copy module files of registered classes over these
        write_remote_code(out, type(model.config), type(model))
    finally:
        if quiet:
            hf_logging.enable_progress_bar()
        for c in set_pad:
            c.pad_token_id = None
        if previous is None:
            del model.config.auto_map
        else:
            model.config.auto_map = previous
    if tokenizer:
        max_len = getattr(model.config, "max_position_embeddings", None)
        save_hf_tokenizer(out, model_max_length=max_len, text_escaping=text_escaping)


def _move_export(staged: Path, out: Path, tokenizer: bool) -> None:
    """Move the complete export ``staged`` to ``out``: renamed as a whole where ``out`` does not
    exist; else (``staged`` is then inside ``out``) the files of an earlier export there (its
    weights, config, shims and, with ``tokenizer``, tokenizer files) are renamed aside (into a
    folder inside ``out``), the new ones moved in and the old ones
    deleted; other files in ``out`` are kept. Renames need no room on the disk; one that fails
    puts the earlier export back.

    Raises:
        fot.errors.WriteError: a rename failed (no permission, a read-only file system, ...):
            one line naming ``out`` and what was kept (the earlier export, or the folder where
            its files wait when one could not be put back).
    """
    if not out.exists():
        try:
            os.rename(staged, out)
        except OSError as err:
            raise _move_error(out, err, "The export was not written") from err
        return
    new = sorted(p.name for p in staged.iterdir())
    old = [
        p.name
        for p in out.iterdir()
        if p.name in new
        or _WEIGHT_FILE.match(p.name)
        or p.name in _WRITTEN
        or (tokenizer and p.name in _TOKENIZER_FILES)
    ]
    aside = set_aside_name(out, f".{out.name}.old-")  # not an earlier one: export_hf named it
    try:
        aside.mkdir()
    except OSError as err:
        raise _move_error(out, err, f"The export was not written; {out} is as it was") from err
    moved_old: list[str] = []
    moved_new: list[str] = []
    try:
        for name in old:
            os.rename(out / name, aside / name)
            moved_old.append(name)
        for name in new:
            os.rename(staged / name, out / name)
            moved_new.append(name)
    except BaseException as err:
        for name in moved_new:
            with contextlib.suppress(OSError):
                os.rename(out / name, staged / name)
        stuck = []
        for name in moved_old:
            try:
                os.rename(aside / name, out / name)
            except OSError:
                stuck.append(name)
        if stuck:
            kept = (
                f"The export was not written, and the earlier export's {', '.join(stuck)} "
                f"could not be put back: move them from {aside} into {out}"
            )
        else:
            with contextlib.suppress(OSError):
                aside.rmdir()
            kept = f"The export was not written; {out} is as it was"
        if not isinstance(err, OSError):
            raise
        raise _move_error(out, err, kept) from err
    shutil.rmtree(aside, ignore_errors=True)


def _move_error(out: Path, err: OSError, kept: str) -> OSError:
    """The one-line :class:`fot.errors.WriteError` of a failed rename into ``out`` (a rename's
    own error names two paths and no fix); ``err`` itself where it has no errno."""
    return cannot_write(out, err, kept) or err


def check_export_folder(path: str | os.PathLike, example: str) -> None:
    """Refuse ``path`` as the output of an export command unless it is new, empty or an
    earlier export of a fot model: a run folder or a project's root would get a model's files
    mixed into its own (``export_hf`` itself keeps other files beside an export). A training
    run's own export, ``<run>/hf``, is refused too: it holds the run's final weights, whose
    only copy it is once the run's checkpoints are deleted.

    Args:
        path: the folder the command would write.
        example: a folder to suggest instead, e.g. ``"<run>/hf_step_<n>"``.

    Raises:
        FileExistsError: ``path`` holds other files, or is a run's final export; the message
            names some of the files, or the run.
    """
    out = Path(path)
    if not out.is_dir():
        return
    if is_fot_export(out):
        run = _run_of_final_export(out)
        if run is not None:
            raise FileExistsError(_final_export_refusal(out, run, example))
        return
    names = sorted((p.name for p in out.iterdir()), key=lambda n: (n.startswith("."), n))
    if names:
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        fix = _set_aside_hint(out) or (
            "the export goes into a folder of its own (new, empty or an earlier export), "
            f"e.g. {example}"
        )
        raise FileExistsError(f"{out} is not empty ({shown}) and holds no earlier export: {fix}")


def _run_of_final_export(out: Path) -> Path | None:
    """The training run whose own final export ``out`` is (``<run>/hf``, beside the run's
    ``run_info.json``), or None."""
    run = out.parent
    if out.name == "hf" and (run / "run_info.json").is_file() and is_fot_export(out):
        return run
    return None


def _final_export_refusal(out: Path, run: Path, example: str) -> str:
    return (
        f"{out} holds the final weights of the training run {run} (it may be their only copy) "
        f"and is not replaced: write to a folder of its own, e.g. {example}, or move {out} "
        "away first"
    )


def not_exported_message(p: Path) -> str:
    """Why folder ``p`` (no ``config.json``) is not an exported checkpoint, and which folder to
    pass instead: a run's export, a training checkpoint to export first, ... (``fot.eval`` and
    :meth:`fot.FoTConfig.from_pretrained` raise it as a ``FileNotFoundError``)."""
    if (p / "hf" / "config.json").is_file():
        # A fot training run folder: its final weights are exported to <run>/hf.
        return (
            f"checkpoint {str(p)!r} is a training run folder, not an exported checkpoint; "
            f"pass its Hugging Face export {str(p / 'hf')!r}"
        )
    if (p / "model.pt").is_file() and (p / "trainer.json").is_file():
        # A fot training checkpoint <run>/checkpoints/step_*: resume state, not an HF folder.
        run_hf = p.parent.parent / "hf"
        final = (
            f" (the run's final weights are exported in {str(run_hf)!r})"
            if (run_hf / "config.json").is_file()
            else ""
        )
        return (
            f"checkpoint {str(p)!r} is a training checkpoint (model.pt, trainer.json) for "
            "resuming training, not an exported checkpoint: export it with `python -m "
            f"fot.export {p} {p.parent.parent / ('hf_' + p.name)}` and pass that folder{final}"
        )
    steps = sorted(q.name for q in p.glob("step_*") if (q / "model.pt").is_file())
    if steps:
        # <run>/checkpoints: the training checkpoints of a run
        final = p.parent / "hf"
        pick = (
            f"pass the run's final export {str(final)!r}, or export"
            if (final / "config.json").is_file()
            else "export"
        )
        return (
            f"checkpoint {str(p)!r} is a folder of training checkpoints ({', '.join(steps)}), "
            f"not an exported checkpoint: {pick} one with `python -m fot.export "
            f"{p / steps[-1]} {p.parent / ('hf_' + steps[-1])}` and pass that folder"
        )
    jobs = sorted(q.parent.parent for q in p.glob("*/hf/config.json"))
    if jobs:
        # a multirun sweep folder (multirun/<date>/<time>) or a folder of runs
        shown = ", ".join(repr(str(j / "hf")) for j in jobs[:4]) + (
            ", ..." if len(jobs) > 4 else ""
        )
        return (
            f"checkpoint {str(p)!r} holds {len(jobs)} training run{'s' * (len(jobs) > 1)}, "
            "not an exported "
            f"checkpoint: pass the export of one of them ({shown})"
        )
    return (
        f"checkpoint folder {str(p)!r} has no config.json; export the model with "
        "fot.export.export_hf(model, dir) (weights and tokenizer), or model.save_pretrained(dir) "
        "and tokenizer.save_pretrained(dir), first"
    )


def is_fot_export(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a model saved from fot (its ``config.json`` names the fot model
    type or the remote-code shims of :func:`remote_code_auto_map`)."""
    try:
        config = json.loads(Path(folder, "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(config, dict):
        return False
    auto_map = config.get("auto_map")
    shim = isinstance(auto_map, dict) and str(auto_map.get("AutoConfig", "")).startswith(
        f"{_CONFIG_MODULE}."
    )
    return shim or config.get("model_type") == "fot"


def make_weights_readable(folder: str | os.PathLike) -> list[Path]:
    """Give the ``*.safetensors`` files in ``folder`` the mode a new file gets under the umask.

    safetensors >= 0.8 writes through a temporary file created with mode 0600 and renames it
    into place, so weights saved by ``save_pretrained`` are readable by their owner only (the
    other files of the folder are not): another user, a container running as non-root or a
    shared cluster folder then cannot load the checkpoint. Only files at exactly 0600 (the
    temporary file's mode) are changed; with a umask of 077 nothing changes.

    Returns:
        The files whose mode was changed.
    """
    mask = os.umask(0)
    os.umask(mask)
    mode = 0o666 & ~mask
    changed = []
    for f in sorted(Path(folder).glob("*.safetensors")):
        if f.is_symlink() or not f.is_file():
            continue
        if (f.stat().st_mode & 0o777) == 0o600 and mode != 0o600:
            f.chmod(mode)
            changed.append(f)
    return changed


def remote_code_auto_map(config_cls: type, model_cls: type) -> dict[str, str]:
    """The ``auto_map`` of an exported folder: the classes in the two shim modules."""
    return {
        "AutoConfig": f"{_CONFIG_MODULE}.{config_cls.__name__}",
        "AutoModelForCausalLM": f"{_MODEL_MODULE}.{model_cls.__name__}",
    }


def _shim(module: str, name: str, *, register_fla: bool = False) -> str:
    """Source of a shim module that re-exports ``module.name``."""
    imports = [f"from {module} import {name}"]
    tail = ""
    if register_fla:
        # FLA registers its own classes with the Auto classes; put the fot wrappers first.
        imports.append("from fot.models.fla_baselines import register_auto_classes")
        tail = "\nregister_auto_classes()\n"
    body = "\n".join(f"    {line}" for line in imports)
    return (
        _SHIM_HEADER
        + _SHIM_IMPORT.format(imports=body, hint=INSTALL_HINT)
        + tail
        + f'\n__all__ = ["{name}"]\n'
    )


def write_remote_code(
    path: str | os.PathLike, config_cls: type | None, model_cls: type | None
) -> list[Path]:
    """Write the remote-code shim modules that :func:`remote_code_auto_map` points to.

    Args:
        path: the checkpoint folder.
        config_cls: the config class (``configuration_fot.py``), or None to skip it.
        model_cls: the model class (``modeling_fot.py``), or None to skip it.

    Returns:
        The files written.
    """
    out = Path(path)
    written = []
    if config_cls is not None:
        module, name = _class_path(config_cls)
        fla = model_cls is not None and _class_path(model_cls)[0] == "fot.models.fla_baselines"
        file = out / f"{_CONFIG_MODULE}.py"
        file.write_text(_shim(module, name, register_fla=fla))
        written.append(file)
    if model_cls is not None:
        module, name = _class_path(model_cls)
        file = out / f"{_MODEL_MODULE}.py"
        file.write_text(_shim(module, name))
        written.append(file)
    return written


def write_remote_code_for_config(config: PretrainedConfig, path: str | os.PathLike) -> list[Path]:
    """Write the shims that a saved FoT config's ``auto_map`` names (``FoTConfig.save_pretrained``).

    A model loaded from an exported folder keeps the folder's ``auto_map``; saving it again must
    write the modules that ``auto_map`` points to, or ``trust_remote_code=True`` cannot load the
    new folder. Entries that do not name the shim modules (or classes fot does not have) are
    left alone.

    Args:
        config: the config being saved.
        path: the folder it is saved to.

    Returns:
        The files written (none when ``auto_map`` names no shim).
    """
    auto_map = getattr(config, "auto_map", None) or {}
    config_cls = model_cls = None
    if auto_map.get("AutoConfig") == f"{_CONFIG_MODULE}.{type(config).__name__}":
        config_cls = type(config)
    ref = auto_map.get("AutoModelForCausalLM")
    if isinstance(ref, str) and ref.startswith(f"{_MODEL_MODULE}."):
        from fot.models import modeling_fot

        model_cls = getattr(modeling_fot, ref.split(".", 1)[1], None)
    return write_remote_code(path, config_cls, model_cls)


__all__ = [
    "INSTALL_HINT",
    "export_hf",
    "not_exported_message",
    "remote_code_auto_map",
    "write_remote_code",
    "write_remote_code_for_config",
]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fot.export CHECKPOINT OUT``: write a training checkpoint as an HF folder."""
    from fot.errors import USER_ERRORS, error_line, parse_args_naming_typos

    parser = argparse.ArgumentParser(
        prog="python -m fot.export",
        description="Write a training checkpoint (<run>/checkpoints/step_<n>) as a Hugging Face "
        "folder, as a run writes its final weights to <run>/hf: fot.eval, generate and "
        "AutoModelForCausalLM (after `import fot`) load it.",
    )
    parser.add_argument(
        "checkpoint", help="a training checkpoint folder (<run>/checkpoints/step_<n>)"
    )
    parser.add_argument(
        "out", help="the folder to write (new, empty, or an earlier export, which it replaces)"
    )
    args = parse_args_naming_typos(parser, argv)
    replaces = is_fot_export(Path(args.out))
    try:
        from fot.training.trainer import export_checkpoint

        out = export_checkpoint(args.checkpoint, args.out)
    except USER_ERRORS as err:
        if os.environ.get("FOT_TRACEBACK") == "1":
            raise
        print(error_line(parser.prog, err, traceback_variable="FOT_TRACEBACK"), file=sys.stderr)
        return 2
    # An earlier export there is replaced (as the help says), which the line names: it may
    # have been another checkpoint's.
    print(f"wrote {out}" + (", replacing the earlier export there" if replaces else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
