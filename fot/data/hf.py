"""Hugging Face datasets for ``data=hf`` and ``python -m fot.data.prepare --hf``.

What differs from a plain ``datasets.load_dataset`` call:

* Where the dataset resolves to datasets' ``text`` loader (``text`` with data files, or a local
  folder of ``.txt`` files that datasets reads as text), every file is one document
  (``sample_by="document"``), as with ``python -m fot.data.prepare <folder>``; datasets'
  default would make every line a document and drop the newlines. A leading byte-order mark
  is dropped, as prepare drops it; unlike prepare, datasets reads a ``\\r\\n`` or lone
  ``\\r`` line end as ``\\n`` (Python's universal newlines).
* Where datasets reads a local folder's files of one kind only, that of its most common
  extension (of ``.txt`` and ``.md`` notes the ``.txt``, of ``.txt`` files and a ``.jsonl`` the
  ``.txt``), :meth:`HFDataset.left_out_files` names the others and how to read them all, for a
  warning.
* Where a local folder's path holds glob characters, datasets globs it (``d[1]`` reads the
  files of ``d1/``, ``no*tes`` those of ``notes/`` too): a folder it reads files outside of,
  or none of, is refused with the loader and the folder's escaped patterns that read it.
* ``.tsv`` files read with the ``csv`` loader (``csv`` with data files) are split at tabs, as
  datasets splits them when it picks that loader for a folder of ``.tsv`` files; named, its
  ``csv`` loader splits every file at commas (a ``.tsv`` file would be one column, named by
  its whole header line).
* datasets' failures on bad input files (a bare ``StopIteration`` for empty files, a
  ``DatasetGenerationError`` around a ``UnicodeDecodeError``) become one :class:`HFDataError` that
  names the file and the fix.
* A local folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` is read
  with ``datasets.load_from_disk`` (``load_dataset`` refuses the first, and reads the second's
  folders as data files: of splits not named ``train``/``test``/``validation`` it made one
  ``train`` split of all their rows, held-out ones included). A ``Dataset`` is the split
  ``train``; split expressions slice both as ``load_dataset`` would (``train[1%:]``).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fot.data.tokens import is_token_folder
from fot.errors import FotError
from fot.hub import is_hub_repo_id

_T = TypeVar("_T")


class HFDataError(FotError, ValueError):
    """datasets failed on an input file; the message names the dataset, split, file and fix."""


_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4", ".tar")

SAVED_DATASET_SPLIT = "train"
"""The split name of a single ``Dataset`` written by ``save_to_disk`` (it holds no splits)."""


def saved_to_disk(folder: Path) -> str | None:
    """``"Dataset"`` or ``"DatasetDict"`` where ``folder`` was written by that class's
    ``save_to_disk`` (the files ``datasets.load_from_disk`` looks for), else ``None``."""
    from datasets import config

    if (folder / config.DATASET_STATE_JSON_FILENAME).is_file() and (
        folder / config.DATASET_INFO_FILENAME
    ).is_file():
        return "Dataset"
    if (folder / config.DATASETDICT_JSON_FILENAME).is_file():
        return "DatasetDict"
    return None


class HFDataset:
    """One HF dataset (hub name, local folder or loader with data files), resolved once.

    Args:
        path: dataset name, local folder, or loader (``json``, ``csv``, ``text``, ...); a
            leading ``~`` is expanded (datasets would take ``~/notes`` for a hub id).
        name: dataset configuration name.
        data_files: ``data_files`` for the loader (file, pattern, list, or split mapping),
            a leading ``~`` expanded in each.
        streaming: load as an ``IterableDataset``.
        where: how messages name the dataset (``"data.path=json"``, ``"dataset json"``).
        files_option: how messages name the option that sets ``data_files``
            (``"data.hf_data_files=<file, pattern or list>"``, ``"--data-files FILE ..."``).
        streaming_option: how messages name the option that sets ``streaming``
            (``"data.streaming=true"``, ``"--streaming"``).
        loader_hint: how messages name a datasets loader reading files: ``loader_hint(loader,
            patterns)`` (default :func:`train_py_loader_hint`: ``data.path=text
            data.hf_data_files='notes/**/*.md'``).

    Raises:
        HFDataError: datasets failed on an input file, named with the fix (:meth:`explain`),
            or ``path`` is one of datasets' loaders (``text``, ``json``, ...) and no
            ``data_files`` were given, or ``path`` is a local folder whose glob characters
            datasets matches to files outside it (or to none of its own).
    """

    def __init__(
        self,
        path: str,
        *,
        name: str | None = None,
        data_files: Any = None,
        streaming: bool = False,
        where: str,
        files_option: str,
        streaming_option: str = "data.streaming=true",
        loader_hint: Callable[[str, list[str]], str] | None = None,
    ) -> None:
        import datasets

        path = os.path.expanduser(path)  # datasets takes `~/notes` for a hub id
        self.path = path
        self.name = name
        self.data_files = _expand_user(data_files) or None
        self.streaming = streaming
        self.where = where
        self.files_option = files_option
        self.streaming_option = streaming_option
        self.loader_hint = loader_hint or train_py_loader_hint
        self.loader: str | None = None
        """The datasets loader that reads the files (``text``, ``json``, ..., or one that
        datasets chose from a local folder's file extensions)."""
        local = Path(path)
        if is_token_folder(local):  # datasets would read its meta.json as a one-row dataset
            raise HFDataError(
                f"{where} is a token folder (written by `python -m fot.data.prepare`), already "
                f"tokenized: train on it with data=tokens data.path={path}"
            )
        if (
            "/" in path
            and not local.exists()
            and local.parent.is_dir()
            and not glob.has_magic(path)
            and not is_hub_repo_id(path)
        ):
            # `runs/notez` beside a folder `runs`: a local path with a typo, which datasets
            # would look up on the hub (a minute of retries offline, then a hub error)
            local_not_hub = (
                ""
                if local.is_absolute()
                else f" Its folder {local.parent} exists, so it is read as a local path, not a "
                "hub dataset id."
            )
            raise HFDataError(
                f"{where}: {path} does not exist.{local_not_hub} Give a data file or a folder of "
                f"them (.txt, .json, .jsonl, .csv, .parquet, ...), or a loader name with "
                f"{files_option}"
            )
        self.saved = saved_to_disk(local) if local.is_dir() else None
        """``"Dataset"``/``"DatasetDict"``: a folder written by ``save_to_disk``, read with
        ``datasets.load_from_disk``; ``None`` otherwise."""
        self.text_files = False
        """True when datasets reads the files as plain text: loaded one document per file."""
        self.tab_separated = False
        """True when the ``csv`` loader reads ``.tsv`` files only: loaded split at tabs."""
        self._data_files: Any = None
        self._num_rows: dict[str, int] = {}
        if self.saved is not None:
            given = [
                what
                for what, value in ((files_option, self.data_files), (f"name={name}", name))
                if value is not None
            ]
            if given:
                raise HFDataError(
                    f"{where} is a folder written by {self.saved}.save_to_disk, read whole with "
                    f"datasets.load_from_disk, which takes no {' or '.join(given)}: leave "
                    f"{'it' if len(given) == 1 else 'them'} out, and choose rows by split "
                    "(e.g. train[1%:])"
                )
            return
        if local.is_file():
            suffixes = [x.lower() for x in local.suffixes]
            while suffixes and suffixes[-1] in _COMPRESSED:  # a.jsonl.gz: a json file
                suffixes.pop()
            loader = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".arrow": "arrow"}
            loader.update(dict.fromkeys((".json", ".jsonl", ".ndjson", ".jsonlines"), "json"))
            guess = loader.get(suffixes[-1] if suffixes else "", "text")
            raise HFDataError(
                f"{where} is a file; datasets reads a file through a loader: "
                + self.loader_hint(guess, [glob.escape(path)])
            )
        if self.data_files is None and path in _loader_names():
            # datasets then reads the files of the working directory, whatever they hold (a
            # `tests/` folder becomes the "test" split): the run would train on source code
            raise HFDataError(
                f"{where} is datasets' {path} loader, which needs {files_option} (without "
                f"them datasets reads the files under the working directory, {Path.cwd()}); "
                f"or name the folder that holds the files instead of {path}"
            )
        builder = self.guard(
            lambda: datasets.load_dataset_builder(path, name=name, data_files=self.data_files),
            None,
        )
        self.loader = builder.name
        self.text_files = builder.name == "text"
        self._data_files = getattr(builder.config, "data_files", None)
        tsv, other = _tsv_and_other_files(self._data_files) if builder.name == "csv" else ([], [])
        if tsv and other:  # one separator for all: the other kind would be read as one column
            raise HFDataError(
                f"{where} gives datasets' csv loader .tsv files ({tsv[0]}) and others "
                f"({other[0]}), which it reads with one separator: one kind would become a "
                "single column named by its whole header line. Convert one kind to the other's "
                "separator, or train on one kind"
            )
        self.tab_separated = bool(tsv)
        if self.data_files is None and local.is_dir() and glob.has_magic(path):
            # datasets globs a folder's path: for a folder `d[1]` it reads `d1/` ([1] a
            # character class), for `no*tes` the files of `notes/` too
            # (datasets lists the files under the folder's real path; under the path as
            # given counts too, in case a release lists them so)
            folders = (local.resolve(), Path(os.path.abspath(local)))
            outside = [
                str(f)
                for split in (self._data_files or {}).values()
                for f in split
                if not any(
                    Path(os.path.abspath(str(f).removeprefix("file://"))).is_relative_to(d)
                    for d in folders
                )
            ]
            if outside:
                raise self._glob_error(outside)

    def left_out_files(self) -> str | None:
        """A warning where datasets, given a local folder, leaves out some of its data files:
        it reads the files of one loader, that of the extension most files have (of ``.txt``
        and ``.md`` notes the ``.txt``, of ``.jsonl`` files and ``.txt`` files the more
        numerous). It names them and how to read them all: text files left out of a folder
        read as text, with the text loader's hint; files of other kinds, into one token folder
        with ``fot.data.prepare`` (which reads ``.jsonl`` and text files together). ``None``
        where none are left out, or data files or a ``save_to_disk`` folder were given. Files
        of an extension it reads are never named: a dataset card's configs leave them out."""
        folder = Path(self.path)
        if self.data_files is not None or self.saved is not None or not folder.is_dir():
            return None
        read = {Path(f).resolve() for split in (self._data_files or {}).values() for f in split}
        texts = _text_files(folder)
        found = _text_files(folder, TEXT_SUFFIXES | _TABLE_SUFFIXES)
        # files of a kind it reads are left out on purpose (a dataset card's configs)
        kinds_read = {f.suffix.lower() for f in read}
        left = [f for f in found if f.suffix.lower() not in kinds_read]
        if not left:
            return None
        shown = ", ".join(str(f) for f in left[:3]) + (
            f" and {len(left) - 3} more" if len(left) > 3 else ""
        )
        read_kinds = ", ".join(sorted({f.suffix or f.name for f in read}))
        if self.text_files and all(f.suffix.lower() in TEXT_SUFFIXES for f in left):
            patterns = _folder_patterns(self.path, sorted({f.suffix for f in texts}))
            return (
                f"{self.where}: datasets reads the {len(read)} {read_kinds} file(s) of "
                f"this folder as text and leaves out {len(left)} other text file(s) ({shown}). "
                f"To read them too: {self.loader_hint('text', patterns)}"
            )
        kinds = sorted({f.suffix for f in found})
        if all(k.lower() in TEXT_SUFFIXES | _JSONL_SUFFIXES for k in kinds):
            globs = " ".join(f"--glob '*{k}'" for k in kinds)
            fix = (
                f"write them all into one token folder, `python -m fot.data.prepare "
                f"{shlex.quote(self.path)} {globs} --out <folder>`, and train on that "
                "(data=tokens data.path=<folder>)"
            )
        else:
            fix = "convert them to one format, or move the files not meant for training out"
        return (
            f"{self.where}: datasets reads the {len(read)} {read_kinds} file(s) of this folder "
            f"with its {self.loader} loader and leaves out {len(left)} file(s) of other kinds "
            f"({shown}): it reads a folder with one loader. To train on them too, {fix}"
        )

    def _glob_error(self, outside: list[str]) -> HFDataError:
        """The error for a local folder whose path datasets globs to files outside it
        (``outside``), or to no files where the folder holds some (``outside`` empty)."""
        shown = ", ".join(outside[:2]) + (
            f" and {len(outside) - 2} more" if len(outside) > 2 else ""
        )
        found = (
            f"matches files outside the folder, which datasets would read: {shown}"
            if outside
            else "matches none of the folder's files"
        )
        own = _own_data_files(self.path)
        fix = "rename the folder without the glob characters *, ? and ["
        if own is not None:
            loader, files = own
            suffixes = sorted({Path(f).suffix for f in files}) or [""]
            if loader == "text" or (
                loader not in _DATA_LOADERS and _text_suffixes(Path(self.path))
            ):
                loader, suffixes = "text", _text_suffixes(Path(self.path)) or suffixes
            hint = self.loader_hint(loader, _folder_patterns(self.path, suffixes))
            fix = (
                "to read the folder's files alone, name the loader and the folder's files "
                f"(its glob characters escaped): {hint}; or {fix}"
            )
        return HFDataError(
            f"{self.where}: datasets reads a folder's path as a glob pattern, and {self.path} "
            f"{found}. {fix[0].upper()}{fix[1:]}"
        )

    def files(self, split: str) -> list[str]:
        """The data files behind a split expression (``train``, ``train[:1%]``,
        ``train+test``), as datasets resolved them; ``[]`` where it did not list them."""
        if not self._data_files:
            return []
        out: list[str] = []
        for part in str(split).split("+"):
            out += [str(f) for f in self._data_files.get(part.split("[")[0].strip(), [])]
        return out

    def num_rows(self, split: str) -> int | None:
        """Rows of the split named ``split`` (a name, no slice), as datasets counted them when
        :meth:`load` prepared the dataset; ``None`` where unknown (streamed, or not loaded)."""
        return self._num_rows.get(split)

    def load(self, split: str, option: str = "the split") -> Any:
        """``datasets.load_dataset`` of one split (a text loader reads one document per file),
        or of a folder written by ``save_to_disk``, ``datasets.load_from_disk``.

        Args:
            split: a split expression (``train``, ``train[:1%]``, ``train+test``).
            option: how messages name the option that set ``split`` (``data.hf_split``).
        """
        import datasets

        if self.streaming and "[" in str(split):
            raise HFDataError(
                f"{self.where} split {split!r}: a streamed dataset ({self.streaming_option}) "
                f"is read in order and cannot be sliced: read it without {self.streaming_option}"
                " to take a slice of a split, or read a split of its own (e.g. validation)"
            )

        if self.saved is not None:
            return self._load_saved(split, option)
        extra: dict[str, str] = {}
        if self.text_files:  # a file a document, without a leading byte-order mark (as prepare)
            extra = {"sample_by": "document", "encoding": "utf-8-sig"}
        if self.tab_separated:
            extra["sep"] = "\t"
        if self.loader == "csv":  # a cell reading "NA", "null", "None", "nan", ... is text
            extra["keep_default_na"] = False
        loaded = self.guard(
            lambda: datasets.load_dataset(
                self.path,
                name=self.name,
                data_files=self.data_files,
                split=split,
                streaming=self.streaming,
                **extra,
            ),
            split,
        )
        if not self.streaming:  # a prepared dataset: its info counts every split's rows
            splits = getattr(getattr(loaded, "info", None), "splits", None) or {}
            self._num_rows.update({str(k): int(v.num_examples) for k, v in splits.items()})
        return loaded

    def _load_saved(self, split: str, option: str) -> Any:
        """The rows of ``split`` (a split expression, sliced as ``load_dataset`` slices one) of
        the folder :attr:`saved` names, memory-mapped; an ``IterableDataset`` of them with
        :attr:`streaming`. ``option`` names the option that set ``split``, for errors."""
        import datasets

        saved = self.guard(lambda: datasets.load_from_disk(self.path), split)
        splits = (
            {str(k): v for k, v in saved.items()}
            if isinstance(saved, datasets.DatasetDict)
            else {SAVED_DATASET_SPLIT: saved}
        )
        self._num_rows.update({k: len(v) for k, v in splits.items()})
        try:
            parts = datasets.ReadInstruction.from_spec(split).to_absolute(
                {k: len(v) for k, v in splits.items()}
            )
        except (ValueError, AssertionError) as err:
            held = (
                f"the DatasetDict holds the splits {', '.join(map(repr, splits))}. Set {option} "
                "to one of them, or to a slice of one"
                if self.saved == "DatasetDict"
                else f"a saved Dataset is the one split {SAVED_DATASET_SPLIT!r}. Set {option} "
                f"to {SAVED_DATASET_SPLIT}, or to a slice of it"
            )
            why = "" if "Unknown split" in str(err) else f" ({err})"
            raise HFDataError(
                f"{self.where} (written by {self.saved}.save_to_disk) has no split {split!r}"
                f"{why}: {held}"
            ) from None
        pieces = [splits[p.splitname].select(range(p.from_, p.to)) for p in parts]
        rows = pieces[0] if len(pieces) == 1 else datasets.concatenate_datasets(pieces)
        return rows.to_iterable_dataset() if self.streaming else rows

    def guard(self, call: Callable[[], _T], split: str | None) -> _T:
        """``call()``, with datasets' failures on input files raised as :meth:`explain` says."""
        try:
            return call()
        except Exception as err:  # StopIteration included: datasets' error for empty files
            new = self.explain(err, split)
            if new is None:
                raise
            raise new from err

    def explain(self, err: BaseException, split: str | None) -> HFDataError | None:
        """One clear error for a datasets failure caused by the input files, else ``None``.

        Args:
            err: what datasets raised while loading or iterating ``split``.
            split: the split being read (``None``: while resolving the dataset).
        """
        from datasets.exceptions import DatasetGenerationError

        if isinstance(err, HFDataError):  # explained already (a guarded call inside a guard)
            return None
        files = self.files(split) if split is not None else []
        what = self.where + (f" split {split!r}" if split is not None else "")
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        if isinstance(err, StopIteration):  # the json/csv loaders, when no file holds a row
            return HFDataError(
                f"{what}: the data files hold no rows ({shown or 'none found'}): they are "
                "empty. Give files that hold data, or leave the empty ones out"
            )
        local = self.path.startswith((".", "/", "~")) or Path(self.path).exists()
        if split is None and local and isinstance(err, FileNotFoundError) and not self.data_files:
            folder = Path(self.path)
            if folder.is_dir() and glob.has_magic(self.path) and _own_data_files(self.path):
                return self._glob_error([])  # `d[1]` globbed to a `d1` that holds no files
            problem = (
                "holds no data files that datasets reads" if folder.is_dir() else "does not exist"
            )
            return HFDataError(
                f"{what}: {self.path} {problem}. Give a data file or a folder of them (.txt, "
                f".json, .jsonl, .csv, .parquet, ...), a loader name with {self.files_option}, "
                "or a hub dataset id (online)"
            )
        cause: BaseException = err
        if isinstance(err, DatasetGenerationError):
            cause = err.__cause__ or err.__context__ or err
        if isinstance(cause, UnicodeDecodeError):
            bad = _first_non_utf8(files)
            named = (
                f"{bad[0]} is not valid UTF-8 (byte {bad[1]:#04x} at offset {bad[2]})"
                if bad
                else f"a data file is not valid UTF-8 ({cause})"
            )
            return HFDataError(
                f"{what}: {named}; datasets reads text files as UTF-8. Convert it (e.g. `iconv "
                "-f latin1 -t utf-8`) or remove it from the data files (`python -m "
                "fot.data.prepare <folder>` reads it with U+FFFD for the bad bytes)"
            )
        if isinstance(err, DatasetGenerationError):
            return HFDataError(
                f"{what}: datasets could not read the data files ({shown or 'unknown'}): "
                f"{type(cause).__name__}: {cause}; fix or remove the file it names"
            )
        if local and self.loader is not None and self.loader not in _DATA_LOADERS:
            # a folder of .md files goes to datasets' `harbor` loader ("No task.toml or
            # instruction.md files found"), images to `imagefolder`, ...: none reads text
            suffixes = sorted({Path(f).suffix or Path(f).name for f in files})
            patterns = [glob.escape(self.path)]
            if not Path(self.path).is_file():
                # every kind of text file the folder holds, not only those datasets picked
                kinds = _text_suffixes(Path(self.path)) or suffixes[:1] or [""]
                patterns = _folder_patterns(self.path, kinds)
            return HFDataError(
                f"{what}: datasets chose its {self.loader!r} loader for these files (by their "
                f"extension{'s' if len(suffixes) > 1 else ''}: {', '.join(suffixes) or '?'}), "
                f"and it failed: {type(cause).__name__}: {cause}. To read text files one "
                "document per file, name datasets' text loader and the files: "
                + self.loader_hint("text", patterns)
            )
        return None


def _expand_user(files: Any) -> Any:
    """``data_files`` (a file or pattern, a list of them, or a split mapping) with a leading
    ``~`` expanded to the home folder, as a shell would: datasets reads ``~/a.jsonl`` as a
    path under the working directory."""
    if isinstance(files, str):
        return os.path.expanduser(files)
    if isinstance(files, (list, tuple)):
        return [_expand_user(f) for f in files]
    if isinstance(files, dict):
        return {split: _expand_user(f) for split, f in files.items()}
    return files


def train_py_loader_hint(loader: str, patterns: list[str]) -> str:
    """``data.path=<loader> data.hf_data_files=...`` for ``train.py``: one pattern, or a list,
    each written so that Hydra reads it back as it is (:func:`hydra_string`), in one shell word.

    Args:
        loader: a datasets loader (``text``, ``json``, ...).
        patterns: the files to read with it (files or glob patterns).
    """
    values = [hydra_string(p) for p in patterns]
    files = values[0] if len(values) == 1 else f"[{','.join(values)}]"
    return f"data.path={loader} data.hf_data_files={shlex.quote(files)}"


_HYDRA_BARE = re.compile(r"[\w.*+%@?/-]*/[\w.*+%@?/-]*", re.ASCII)
"""Strings a Hydra override reads back as themselves unquoted: of letters, digits and
``_.*+%@?/-`` (no character its grammar reads specially), with a ``/`` (never a number,
boolean or null)."""


def hydra_string(s: str) -> str:
    """``s`` as a Hydra override value (alone or in a list) that sets the string ``s``: bare
    where Hydra reads it so (``notes/**/*.md``), else in double quotes, with ``"`` and the
    backslashes before a quote escaped as Hydra unescapes them, and ``${`` escaped as
    OmegaConf reads a literal one (``"my (notes)/**/*.md"``)."""
    if _HYDRA_BARE.fullmatch(s):
        return s
    s = re.sub(r"(\\*)\$\{", lambda m: 2 * m[1] + "\\${", s)  # OmegaConf's \${
    s = re.sub(r'(\\*)"', lambda m: 2 * m[1] + '\\"', s)  # Hydra's \"
    s = re.sub(r"(\\+)\Z", lambda m: 2 * m[1], s)  # before the closing quote
    return f'"{s}"'


TEXT_SUFFIXES = frozenset((".txt", ".text", ".md", ".markdown", ".rst"))
"""Extensions of plain text files, covered by a hint to read a folder with the text loader
(and named by ``fot.data.prepare`` where a folder's ``--glob`` leaves them out)."""
_JSONL_SUFFIXES = frozenset((".jsonl", ".ndjson"))
"""Extensions of JSON Lines files, which ``fot.data.prepare`` reads from a folder too."""
_TABLE_SUFFIXES = _JSONL_SUFFIXES | {".json", ".csv", ".tsv", ".parquet", ".arrow"}
"""Extensions of the other files datasets' json, csv, parquet and arrow loaders read."""


def _tsv_and_other_files(data_files: Any) -> tuple[list[str], list[str]]:
    """The resolved ``data_files`` (a split mapping of file lists) split into the ``.tsv``
    files (compressed or not) and the others."""
    tsv, other = [], []
    for name in (str(f) for files in (data_files or {}).values() for f in files):
        parts = [x.lower() for x in Path(name).suffixes]
        while parts and parts[-1] in _COMPRESSED:
            parts.pop()
        (tsv if parts and parts[-1] == ".tsv" else other).append(name)
    return tsv, other


def _text_files(folder: Path, suffixes: frozenset[str] = TEXT_SUFFIXES) -> list[Path]:
    """The files under ``folder`` (sorted) of the extensions ``suffixes`` (plain text files by
    default) that a pattern ``folder/**/*<ext>`` gives datasets: none hidden, none in a ``__``
    folder, none of the names it never lists from a pattern (a dataset card ``README.md``)."""
    from datasets.data_files import FILES_TO_IGNORE

    def seen(f: Path) -> bool:
        parts = f.relative_to(folder).parts
        return (
            f.name not in FILES_TO_IGNORE
            and not any(part.startswith(".") for part in parts)
            and not any(part.startswith("__") for part in parts[:-1])
        )

    return sorted(
        f for f in folder.rglob("*") if f.suffix.lower() in suffixes and seen(f) and f.is_file()
    )


def _folder_patterns(folder: str, suffixes: list[str]) -> list[str]:
    """Patterns ``<folder>/**/*<suffix>`` of the files of each suffix under ``folder``, the
    folder's glob characters escaped (``d[[]1]/**/*.md``): datasets globs a data file's whole
    path, and would read ``d1/`` for a folder ``d[1]``, or ``notes/`` too for ``no*tes``."""
    return [f"{glob.escape(folder.rstrip('/'))}/**/*{suffix}" for suffix in suffixes]


def _own_data_files(folder: str) -> tuple[str, list[str]] | None:
    """The loader datasets chooses for the local folder ``folder`` and the files it reads
    with it, as datasets resolves them for a folder whose path holds no glob characters (the
    path escaped); ``None`` where it finds no data files there."""
    try:
        from datasets.data_files import DataFilesDict, get_data_patterns
        from datasets.load import _ALL_ALLOWED_EXTENSIONS, infer_module_for_data_files
        from datasets.packaged_modules import _MODULE_TO_EXTENSIONS
    except ImportError:  # a datasets release that moved them: no hint
        return None
    base = glob.escape(Path(folder).expanduser().resolve().as_posix())
    try:
        files = DataFilesDict.from_patterns(
            get_data_patterns(base), base_path=base, allowed_extensions=_ALL_ALLOWED_EXTENSIONS
        )
        loader, _ = infer_module_for_data_files(files, path=folder)
    except (FileNotFoundError, ValueError):  # none there (EmptyDatasetError), or mixed
        return None
    except (TypeError, AttributeError):  # a datasets release that changed them: no hint
        return None
    files = files.filter(extensions=_MODULE_TO_EXTENSIONS.get(loader))
    return loader, [str(f) for split in files.values() for f in split]


def _text_suffixes(folder: Path) -> list[str]:
    """The extensions (spelt as in the names) of the plain text files under ``folder`` that
    datasets lists (:func:`_text_files`)."""
    return sorted({f.suffix for f in _text_files(folder)})


_DATA_LOADERS = frozenset(("text", "json", "csv", "parquet", "arrow", "pandas"))
"""datasets loaders that read the text and tabular files fot documents; a failure in another
loader that datasets chose for a local folder is explained as a wrong guess."""


def _loader_names() -> frozenset[str]:
    """datasets' packaged loaders (``text``, ``json``, ``csv``, ``parquet``, ...): names that
    load the ``data_files`` given, never a hub dataset or local folder of that name."""
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
    except ImportError:  # a datasets release that moved it: the common ones
        return frozenset(("text", "json", "csv", "parquet", "arrow", "pandas"))
    return frozenset(_PACKAGED_DATASETS_MODULES)


def _first_non_utf8(files: list[str]) -> tuple[str, int, int] | None:
    """``(file, bad byte, offset)`` of the first local, uncompressed file that is not UTF-8."""
    for f in files:
        p = Path(f.removeprefix("file://"))
        if p.suffix.lower() in _COMPRESSED or not p.is_file():
            continue
        data = p.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            return str(p), data[err.start], err.start
    return None
