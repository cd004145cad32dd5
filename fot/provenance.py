"""What a result was made with: the source commit and the library versions.

Training runs (``run_info.json``), evaluations (``run_config.json``) and benchmarks record
both, so that a number can be traced to the code and the builds that produced it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

# The distributions whose versions shape a training run or an evaluation.
LIBRARIES = ("torch", "triton", "transformers", "flash-linear-attention", "hydra-core", "numpy")


def git_sha(repo: str | os.PathLike | None = None) -> str | None:
    """The commit checked out in ``repo`` (default: fot's own source tree), with
    ``+dirty.<hash>`` when tracked files differ from it, or ``None`` when ``repo`` is not the
    top folder of a git checkout (an installed wheel, a copy of the tree) or without git.

    ``<hash>`` is the first 8 hex digits of the SHA-256 of ``git diff HEAD --full-index``
    (its ``index`` lines name each changed file's content by its full blob id, a binary
    file's too): the same edits give the same value, other edits another one, so that a run
    resumed after the source was edited again says so. (Records of an older fot end in a
    plain ``+dirty``, as does one where git cannot give the diff.)

    A folder inside another checkout is not one: fot installed into a virtual environment
    that lies in the user's own repository would otherwise record that repository's commit.
    """
    cwd = Path(repo) if repo is not None else Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--show-toplevel", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
        if sha.returncode != 0:
            return None
        top, head = sha.stdout.splitlines()
        if Path(top).resolve() != cwd.resolve():
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if not dirty.stdout.strip():
        return head
    change = _diff_hash(cwd)
    return f"{head}+dirty" + (f".{change}" if change else "")


def _diff_hash(cwd: Path) -> str | None:
    """The first 8 hex digits of the SHA-256 of ``git diff HEAD --full-index`` in ``cwd``
    (the tracked files' changes), or None where git cannot say them."""
    try:
        diff = subprocess.run(  # without the user's diff drivers and textconv filters
            ["git", "diff", "HEAD", "--full-index", "--no-ext-diff", "--no-textconv", "--no-color"],
            cwd=cwd,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return hashlib.sha256(diff.stdout).hexdigest()[:8] if diff.returncode == 0 else None


def library_versions(extra: Iterable[str] = ()) -> dict[str, str | None]:
    """Versions of Python, fot, :data:`LIBRARIES` and the ``extra`` distributions (``None``
    for one that is not installed), and the CUDA version torch was built with (``cuda``).

    torch's is ``torch.__version__``, which names the build (``2.9.1+cu128``, ``2.13.0+cpu``):
    the metadata of a wheel from PyPI says only ``2.9.1``.
    """
    import torch

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in (*LIBRARIES, *extra):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = str(torch.__version__)
    try:
        out["fot"] = importlib.metadata.version("fot")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path
        import fot

        out["fot"] = getattr(fot, "__version__", None)
    out["cuda"] = torch.version.cuda
    return out


def sweep_folder(run: str | os.PathLike) -> Path | None:
    """The folder of the Hydra multirun that ``run`` is a job of (it holds ``multirun.yaml``),
    or None for a run of its own."""
    parent = Path(run).resolve().parent
    return parent if (parent / "multirun.yaml").is_file() else None


def swept_keys(sweep: str | os.PathLike) -> set[str] | None:
    """The keys that the Hydra multirun in folder ``sweep`` sweeps (``model``, ``optim.lr``;
    without ``+``/``~``), read from its ``multirun.yaml``; None where that cannot be read.
    Hydra's own parser tells a sweep (``a,b``, range, choice, glob, interval) from one value
    that holds a comma: a dict or list (``model.overrides={a:1,b:2}``), a quoted string."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        task = [str(o) for o in OmegaConf.load(Path(sweep) / "multirun.yaml").hydra.overrides.task]
        parsed = OverridesParser.create().parse_overrides(task)
    except Exception:
        return None
    return {o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()}


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def sweep_job_label(run: str | os.PathLike) -> str | None:
    """The swept overrides of a Hydra multirun job ``<sweep>/<n>`` (e.g.
    ``model=fot_pro,seed=1``), read from its ``.hydra/overrides.yaml`` and the sweep's
    ``multirun.yaml``, so that the jobs of a sweep are not named 0, 1, 2, ... in plots and
    wandb; None for any other folder (a job folder named otherwise,
    ``hydra.sweep.subdir=...``, names itself)."""
    run = Path(run).resolve()
    sweep = sweep_folder(run)
    if sweep is None or not run.name.isdigit():
        return None
    from omegaconf import OmegaConf

    swept = swept_keys(sweep)
    try:
        mine = [str(o) for o in OmegaConf.load(run / ".hydra" / "overrides.yaml")]
    except Exception:  # a name only: the folder name serves as well
        return None
    if swept is None:
        return None
    return ",".join(o.lstrip("+") for o in mine if _key(o) in swept) or None


def sweep_job_conflict(
    overrides: list[str],
    *,
    sweep: str | os.PathLike,
    job: str | os.PathLike,
    run: str | os.PathLike,
    hydra: Any = None,
    config: Any = None,
) -> str | None:
    """Why a job of a multirun must not continue the run in its folder, or None.

    Hydra numbers a sweep's jobs by their place in it. A sweep rerun in the same
    ``hydra.sweep.dir`` (to continue a stopped job) with its swept values in another order,
    or with other values, gives job N's folder another job's settings: with ``resume=auto``
    that job would continue the checkpoint trained with the first settings under the new
    ones (another learning rate or seed only warns), and its results would mix both.

    Args:
        overrides: this job's overrides (``hydra.overrides.task`` of the job).
        sweep: the sweep folder (its ``multirun.yaml`` names the swept keys).
        job: the job's Hydra folder, whose ``.hydra/overrides.yaml`` holds the overrides of
            the job that trained there (and ``config.yaml``/``hydra.yaml`` the values and
            group options it ran with: a key swept now that that job left at its default is
            compared with the default it ran with).
        run: the job's run folder (``out_dir``: ``job`` unless set per job), whose
            ``checkpoints/`` the job would continue; no checkpoint, no conflict.
        hydra: this job's Hydra config (``HydraConfig.instance().cfg``: its group options)
            and
        config: this job's composed config: the values of the keys that it leaves at their
            default. A key that an earlier sweep in ``sweep`` swept (its jobs' records differ
            in it: the rerun replaced its ``multirun.yaml``) is compared with them; without
            them, only where this job sets it.

    Returns:
        One sentence naming the job, the differing values and the fix; None when the folder
        holds no checkpoint or no record of its overrides, or every swept value is the same
        (numbers compare by value: ``1e-3`` is ``0.001``).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from fot.training.checkpoint import latest_checkpoint

    swept = swept_keys(sweep)
    recorded = Path(job) / ".hydra" / "overrides.yaml"
    if not swept or not recorded.is_file() or latest_checkpoint(Path(run) / "checkpoints") is None:
        return None
    try:
        before = [str(o) for o in OmegaConf.load(recorded)]
        parser = OverridesParser.create()
        was = {o.get_key_element().lstrip("+~"): o for o in parser.parse_overrides(before)}
        now = {o.get_key_element().lstrip("+~"): o for o in parser.parse_overrides(list(overrides))}
    except Exception:  # a hand-edited record: nothing to compare
        return None
    changed = []  # (key, value now, value then), as written
    defaults = _defaults_of(recorded.parent)
    current = _lookup(hydra, config) if config is not None else lambda key: None
    keys = swept | _swept_before(Path(sweep))
    for key in dict.fromkeys([*now, *was, *sorted(keys)]):
        if key not in keys:
            continue
        if key in now:
            value = (now[key].value(), now[key].get_value_element_as_str())
        elif (value := current(key)) is not None:  # left at its default now
            value = (value[0], f"{value[1]} (its default)")
        else:
            continue
        if key in was:
            ran = (was[key].value(), was[key].get_value_element_as_str())
        elif (ran := defaults(key)) is not None:
            ran = (ran[0], f"{ran[1]} (its default)")
        else:
            continue
        if value[0] != ran[0]:
            changed.append((key, value[1], ran[1]))
    if not changed:
        return None
    this = ", ".join(f"{key}={value}" for key, value, _ in changed)
    then = ", ".join(f"{key}={value}" for key, _, value in changed)
    # a default is read from the composed config beside the overrides
    record = recorded.parent if any(key not in was for key, _, _ in changed) else recorded
    return (
        f"job {Path(job).name} of this sweep has {this}, but its folder {Path(run)} holds the "
        f"checkpoints of a job with {then} ({record}): Hydra numbers a sweep's jobs by their "
        f"place in it, and this rerun in hydra.sweep.dir={Path(sweep)} lists the swept values "
        "in another order or others. To continue the sweep, list its values as before; for "
        "other values, pass a new hydra.sweep.dir (or leave it out)"
    )


def _swept_before(sweep: Path) -> set[str]:
    """The keys in which the overrides recorded by the jobs of sweep folder ``sweep``
    (``<n>/.hydra/overrides.yaml``) differ: swept there by an earlier sweep. The records of
    this sweep's jobs (newer than its ``multirun.yaml``) are left out: a rerun may change a
    value for every job (``total_tokens``, to train on)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    try:
        started = (sweep / "multirun.yaml").stat().st_mtime_ns
    except OSError:
        return set()
    parser, records = OverridesParser.create(), []
    for recorded in sweep.glob("*/.hydra/overrides.yaml"):
        try:
            if recorded.stat().st_mtime_ns >= started:
                continue
            parsed = parser.parse_overrides([str(o) for o in OmegaConf.load(recorded)])
        except Exception:  # a hand-edited record: nothing to compare
            continue
        records.append({o.get_key_element().lstrip("+~"): repr(o.value()) for o in parsed})
    keys = {key for record in records for key in record}
    return {key for key in keys if len({record.get(key) for record in records}) > 1}


def _defaults_of(hydra_folder: Path) -> Callable[[str], tuple[Any, str] | None]:
    """A lookup of the value that the job recorded in ``hydra_folder`` (its ``.hydra/``) ran
    with for a key it did not override (:func:`_lookup` of its ``hydra.yaml`` and
    ``config.yaml``); None where the record is missing."""
    from omegaconf import DictConfig, OmegaConf

    def load(name: str) -> DictConfig | None:
        try:
            loaded = OmegaConf.load(hydra_folder / name)
        except Exception:  # missing or hand-edited: nothing to compare
            return None
        return loaded if isinstance(loaded, DictConfig) else None

    return _lookup(load("hydra.yaml"), load("config.yaml"))


def _lookup(hydra: Any, config: Any) -> Callable[[str], tuple[Any, str] | None]:
    """A lookup of the value a job ran with for a key: the group option Hydra chose
    (``model`` -> ``fot_pro``, from ``hydra``, a job's Hydra config) or the composed value
    (``optim.lr`` -> ``0.003``, from ``config``). The lookup gives ``(value, as written in an
    override)``, or None where they do not say (an interpolation that does not resolve)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    choices = OmegaConf.select(hydra, "hydra.runtime.choices") if hydra is not None else None

    def default(key: str) -> tuple[Any, str] | None:
        if isinstance(choices, DictConfig) and key in choices:  # a config group
            option = choices[key]
            return option, "null" if option is None else str(option)
        if config is None:
            return None
        try:
            value = OmegaConf.select(config, key, throw_on_missing=True)
        except Exception:  # ??? or an interpolation that does not resolve here
            return None
        if isinstance(value, DictConfig | ListConfig):
            value = OmegaConf.to_container(value, resolve=True)
        shown = (
            "null"
            if value is None
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
        )
        return value, shown

    return default
