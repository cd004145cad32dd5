"""Train a FoT (or baseline) language model: ``python train.py`` (tiny run on the sample
corpus), ``torchrun --nproc_per_node=8 train.py experiment=fot_pro_760m_48b data.path=...``,
``python train.py -m model=fot_pro,transformer_pro`` (one folder per job).

Configs live in ``configs/`` (Hydra); the training loop is :func:`fot.training.train`.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep
from hydra.errors import OverrideParseException
from hydra.types import RunMode
from omegaconf import (
    BooleanNode,
    DictConfig,
    FloatNode,
    IntegerNode,
    ListConfig,
    OmegaConf,
    StringNode,
)
from omegaconf.errors import OmegaConfBaseException

from fot.errors import USER_ERRORS, error_line
from fot.training import train
from fot.training.checkpoint import interrupted_message
from fot.training.config import (
    TrainConfig,
    check_multirun_out_dir,
    multirun_out_dir_problem,
    out_dir_file_problem,
    register_configs,
    unknown_group_option,
    unknown_override_key,
)
from fot.training.signals import EXIT_STATUS as SIGTERM_EXIT_STATUS
from fot.training.signals import TrainingStopped

register_configs()

# Hydra's flags whose value is the next argument (a path or name, not an override)
_FLAGS_WITH_VALUE = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def unparsable_override(args: list[str]) -> str | None:
    """A message for the first command-line override that Hydra's grammar cannot read, naming
    it and the quoted form that it reads; ``None`` when every override parses.

    Hydra itself stops on such an override with only the parser's complaint (``mismatched
    input '[' expecting <EOF>``), not which argument it was nor how to write it: a value that
    holds brackets, ``=``, spaces or other special characters (``data.hf_split=train[1%:]``)
    must be quoted for Hydra, inside the shell's quotes: ``'data.hf_split="train[1%:]"'``.

    Args:
        args: the command line after ``train.py`` (flags such as ``-m`` and the values of
            ``--config-dir`` and friends are skipped).
    """
    parser = OverridesParser.create()
    after_flag = False
    for arg in args:
        if after_flag or arg.startswith("-") or "=" not in arg:
            after_flag = arg in _FLAGS_WITH_VALUE
            continue
        try:
            parser.parse_overrides([arg])
        except OverrideParseException as err:
            reason = str(err.message).splitlines()[0]
            key, value = arg.split("=", 1)
            quoted = _quoted_override(parser, key, value)
            example = f", e.g. {quoted}" if quoted else ""
            return (
                f"cannot read the override {arg!r} ({reason}): a value that holds brackets, '=', "
                f"spaces or other special characters needs quotes for Hydra{example} "
                "(https://hydra.cc/docs/advanced/override_grammar/basic/)"
            )
    return None


def _quoted_override(parser: OverridesParser, key: str, value: str) -> str | None:
    """``key=value`` with the value quoted for Hydra (in quotes it does not hold, else with
    its double quotes escaped), then for the shell: what to type so that Hydra reads
    ``value``; ``None`` where even that does not parse."""
    if '"' not in value:
        text = f'"{value}"'
    elif "'" not in value:
        text = f"'{value}'"
    else:
        text = '"' + value.replace('"', '\\"') + '"'
    try:
        parser.parse_overrides([f"{key}={text}"])
    except OverrideParseException:
        return None
    return shlex.quote(f"{key}={text}")


def mistyped_override(args: list[str]) -> str | None:
    """A message for the first command-line ``key=value`` whose value the field's type refuses
    (``total_tokens=1k``, ``parallel.compile=maybe``), naming the type the field takes;
    ``None`` when every value fits.

    Hydra refuses these too, but in its own four-line form with exit status 1. Overrides of
    leaf fields of :class:`~fot.training.config.TrainConfig` are checked, plain or forced
    (``++total_tokens=1k``), and so is every value of a choice sweep (``-m
    total_tokens=4096,1k``); group options (``model=fot_pro``), ``+``/``~`` overrides, range
    and interval sweeps, interpolations, unknown keys and unparsable overrides are left to the
    other checks and to Hydra.

    Args:
        args: the command line after ``train.py``.
    """
    parser = OverridesParser.create()
    leaves = _leaf_nodes(OmegaConf.structured(TrainConfig))
    for arg in args:
        # ++ sets an existing field as = does; + (a new key) and ~ (deletion) are Hydra's
        if arg.startswith(("-", "~")) or arg.startswith("+") != arg.startswith("++"):
            continue
        if "=" not in arg:
            continue
        try:
            override = parser.parse_overrides([arg])[0]
        except OverrideParseException:
            continue  # unparsable_override names it
        key = override.key_or_group
        if override.package is not None or key not in leaves:
            continue  # Hydra's; or a group, a free-form dict, an unknown key (checked apart)
        if not override.is_sweep_override():
            values = [override.value()]
        elif isinstance(override.value(), ChoiceSweep):  # -m key=a,b or choice(a,b)
            values = list(override.value().list)
        else:
            continue  # range() and interval(): numbers, for the sweeper to pick
        for value in values:
            if isinstance(value, str) and "${" in value:
                continue
            try:
                OmegaConf.update(OmegaConf.structured(TrainConfig), key, value, merge=True)
            except OmegaConfBaseException as err:
                reason = str(err).splitlines()[0].rstrip(".")
                return f"{arg!r}: {reason}; {key} takes {_kind(leaves[key])}"
    return None


def _leaf_nodes(cfg: DictConfig, prefix: str = "") -> dict[str, Any]:
    """The node of every leaf field of ``cfg`` by dotted key (lists are leaves)."""
    leaves: dict[str, Any] = {}
    for name in cfg:
        node = cfg._get_node(name)
        if isinstance(node, DictConfig):
            leaves |= _leaf_nodes(node, f"{prefix}{name}.")
        else:
            leaves[f"{prefix}{name}"] = node
    return leaves


def _kind(node: Any) -> str:
    """What a leaf field takes, in words, for the message of :func:`mistyped_override`."""
    kinds = {
        IntegerNode: "a whole number",
        FloatNode: "a number",
        BooleanNode: "true or false",
        StringNode: "a string",
        ListConfig: "a list such as [0.9,0.95]",
    }
    kind = next((words for cls, words in kinds.items() if isinstance(node, cls)), "another value")
    return kind if node._is_optional() else f"{kind} (not null)"


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    """Refuse one fixed out_dir for every job of a multirun, then train; errors that name the
    bad input and the fix print as one line (exit status 2), without a traceback, Ctrl-C
    says how to resume (exit status 130), and so does a stop on SIGTERM after its checkpoint
    (exit status 143)."""
    hydra_cfg = HydraConfig.get()
    try:
        check_multirun_out_dir(cfg, multirun=hydra_cfg.mode == RunMode.MULTIRUN)
        if cfg.out_dir is None:
            cfg.out_dir = hydra_cfg.runtime.output_dir
        train(cfg)
    except TrainingStopped as stopped:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"\ntrain.py: {stopped}", file=sys.stderr)
        sys.exit(SIGTERM_EXIT_STATUS)
    except KeyboardInterrupt:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        if int(os.environ.get("RANK", "0")) == 0:  # torchrun interrupts every rank
            out_dir = cfg.out_dir or hydra_cfg.runtime.output_dir
            print(f"\ntrain.py: {interrupted_message(out_dir)}", file=sys.stderr)
        sys.exit(130)
    except USER_ERRORS as err:
        # These name the bad value and the fix (fot.errors): the message is what the user needs,
        # and a traceback above it only hides it (HYDRA_FULL_ERROR=1 shows it, as for Hydra's).
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # under torchrun each rank prints its own error (another rank's may differ): say whose
        prog = (
            f"train.py (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else "train.py"
        )
        print(error_line(prog, err, traceback_variable="HYDRA_FULL_ERROR"), file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    # Hydra refuses an unknown key or group option without naming the right one: say which
    # field or option was meant, in the one-line form of the other errors (exit status 2)
    configs = Path(__file__).resolve().parent / "configs"
    # options may also come from config folders added on the command line: Hydra checks those
    more_configs = any(
        a.lstrip("+").split("=")[0]
        in ("--config-dir", "-cd", "--config-path", "-cp", "hydra.searchpath")
        for a in sys.argv[1:]
    )
    # an override Hydra cannot parse first: the checks below would misread it
    problems = [unparsable_override(sys.argv[1:])]
    problems += [unknown_override_key(arg) for arg in sys.argv[1:]]
    problems.append(mistyped_override(sys.argv[1:]))  # a known key with a value of another type
    if not more_configs:
        problems += [unknown_group_option(arg, configs) for arg in sys.argv[1:]]
    problems.append(multirun_out_dir_problem(sys.argv[1:]))  # before Hydra makes the sweep folder
    problems.append(out_dir_file_problem(sys.argv[1:]))  # before Hydra makes the run folder
    for problem in problems:
        if problem is not None:
            print(f"train.py: error: {problem}", file=sys.stderr)
            sys.exit(2)
    main()
