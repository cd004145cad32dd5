"""Hydra configs: every group option and experiment composes; one source of truth for models."""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING
from unittest import mock

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from zarr_arrays import new_array

from fot import presets
from fot.training.config import (
    chdir_problem,
    check_config,
    claim_default_folder,
    mistyped_override,
    non_dict_override,
    register_configs,
    unparsable_override,
)
from fot.training.trainer import check_sizes, model_config_from_train_config

if TYPE_CHECKING:
    import torch

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _train_py_refuses(tmp_path: Path, *overrides: str) -> str:
    """The stderr of ``python train.py *overrides`` run in ``tmp_path``, which must exit with
    status 2 before Hydra makes a run folder (``tmp_path`` stays empty)."""
    res = subprocess.run(
        [sys.executable, str(CONFIGS.parent / "train.py"), *overrides, f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert not any(tmp_path.iterdir())  # refused before Hydra made a run folder
    return res.stderr


EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*_*_*b.yaml"))  # paper runs

register_configs()


@pytest.fixture(scope="module")
def hydra_ctx():
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        yield


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def test_groups_cover_presets() -> None:
    assert set(_options("model")) == set(presets.MODELS)
    assert set(_options("size")) == set(presets.SIZES)
    assert set(_options("data")) == {"sample", "longcrawl64", "tokens", "hf"}
    # one experiment per run of the paper, no more (PAPER_RUNS below)
    scales = list(PAPER_RUNS["dims"])
    want = {
        f"{model}_{scale}"
        for model, lrs in PAPER_RUNS["lr"].items()
        for scale, lr in zip(scales, lrs, strict=True)
        if lr is not None
    }
    assert set(EXPERIMENTS) == want


def test_every_model_and_size_matches_presets(hydra_ctx) -> None:
    for model in _options("model"):
        for size in _options("size"):
            cfg = compose("train", overrides=[f"model={model}", f"size={size}"])
            built = model_config_from_train_config(cfg)
            assert built.to_dict() == presets.config(model, size).to_dict(), (model, size)


def test_the_size_table_and_shape_fields_of_docs_models_md_are_the_presets() -> None:
    """docs/models.md's size table gives every size's width, depth and heads as
    fot.presets.config builds them, and the shape fields it quotes are fot_pro's at every
    size."""
    text = (CONFIGS.parent / "docs/models.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", text, re.M)
    assert sorted(size for size, *_ in rows) == sorted(presets.SIZES)
    for size, hidden, layers, fot_heads, transformer_heads in rows:
        for model, heads in (
            ("fot_pro", fot_heads),
            ("fot_llama", fot_heads),
            ("transformer_pro", transformer_heads),
            ("transformer_llama", transformer_heads),
        ):
            cfg = presets.config(model, size)
            shape = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_heads)
            assert shape == (int(hidden), int(layers), int(heads)), (model, size)
    prose = text[text.index("Their other shape fields") :]
    quoted = dict(re.findall(r"`(\w+)`\s+\(`([^`]+)`", prose[: prose.index("\n\n")]))
    assert len(quoted) == 7, quoted
    for size in presets.SIZES:
        cfg = presets.config("fot_pro", size)
        for name, value in quoted.items():
            assert getattr(cfg, name) == _yaml_value(value), (name, size)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_with_paper_defaults(hydra_ctx, monkeypatch, name: str) -> None:
    # samba's flash-attn, missing on this machine, is the machine's concern, not the config's
    monkeypatch.setattr("fot.models.fla_baselines.missing_package", lambda config: None)
    cfg = compose("train", overrides=[f"experiment={name}"])
    model, scale = name.rsplit("_", 2)[0], "_".join(name.rsplit("_", 2)[1:])
    assert cfg.model.name == model
    assert cfg.size.name == scale.split("_")[0]
    assert cfg.data.kind == "longcrawl64" and cfg.data.seq_len == 16384
    assert cfg.global_batch_tokens == 512 * 1024  # 0.5Mi tokens
    assert cfg.global_batch_tokens // cfg.data.seq_len == 32
    assert list(cfg.optim.betas) == [0.9, 0.95]
    assert cfg.optim.weight_decay == 0.1 and cfg.optim.grad_clip == 1.0
    assert cfg.schedule.name == "warmup_cosine"
    assert cfg.schedule.warmup_tokens == 256 * 2**20
    assert cfg.schedule.min_lr_ratio == 0.1
    assert cfg.parallel.strategy == "fsdp"
    # FLA's baselines compute some gates in the parameters' dtype: fp32 ones, as the paper's runs
    assert cfg.parallel.param_precision == ("fp32" if model in PAPER_BASELINES else "bf16")
    tokens = {"125m_2b": 2.5, "360m_7b": 7, "760m_16b": 15, "760m_48b": 45}[scale]
    assert cfg.total_tokens == int(tokens * 2**30)
    # sizes work for the usual GPU counts
    for world in (1, 2, 4, 8):
        check_sizes(cfg, world)
    model_config_from_train_config(cfg)  # the preset exists
    assert check_config(cfg) == []  # refused values or warnings would greet every user


def test_peak_learning_rates_from_the_paper(hydra_ctx) -> None:
    names = ["fot_pro_125m_2b", "transformer_llama_360m_7b", "fot_llama_760m_16b",
             "transformer_pro_760m_48b", "fot_pro_760m_48b", "transformer_llama_760m_48b",
             "deltanet_760m_48b", "hgrn2_760m_48b", "samba_760m_16b"]  # fmt: skip
    lr = {n: compose("train", overrides=[f"experiment={n}"]).optim.lr for n in names}
    assert lr["fot_pro_125m_2b"] == lr["transformer_llama_360m_7b"] == 2e-3
    assert lr["fot_llama_760m_16b"] == lr["transformer_pro_760m_48b"] == 1e-3
    assert lr["fot_pro_760m_48b"] == 2e-3
    assert lr["transformer_llama_760m_48b"] == 5e-4
    # a baseline's own peak LR, not FoT (Pro)'s at that scale
    assert lr["deltanet_760m_48b"] == lr["samba_760m_16b"] == 1e-3
    assert lr["hgrn2_760m_48b"] == 2e-3


# The paper's released configs (zhixuan-lin/forgetting-transformer,
# configs/experiment/longcrawl64/{forgetting_transformer,transformer}/<variant>_<scale>.yaml):
# optimizer.lr and model.config.{hidden_size, num_hidden_layers, num_heads}. Pro variants set
# hidden_ratio 3.5, LLaMA variants keep the default 4; Transformers use RoPE and no forget gate.
PAPER_RUNS = {
    # scale: (hidden, layers, FoX heads, Transformer heads)
    "dims": {
        "125m_2b": (768, 12, 12, 12),
        "360m_7b": (1024, 24, 16, 16),
        "760m_16b": (1536, 24, 24, 12),
        "760m_48b": (1536, 24, 24, 12),
    },
    # model: peak LR at 125m_2b, 360m_7b, 760m_16b, 760m_48b (None: the paper has no such run;
    # its baselines are in configs/experiment/longcrawl64/{delta_net,hgrn2,mamba2,samba,
    # transformer_swa}/<scale>.yaml)
    "lr": {
        "fot_llama": (2e-3, 2e-3, 1e-3, 1e-3),
        "fot_pro": (2e-3, 2e-3, 1e-3, 2e-3),
        "transformer_llama": (2e-3, 2e-3, 1e-3, 5e-4),
        "transformer_pro": (2e-3, 2e-3, 1e-3, 1e-3),
        "transformer_swa": (None, None, 1e-3, None),
        "deltanet": (2e-3, 2e-3, 1e-3, 1e-3),
        "hgrn2": (2e-3, 2e-3, 1e-3, 2e-3),
        "mamba2": (2e-3, 2e-3, 1e-3, 2e-3),
        "samba": (None, None, 1e-3, None),
    },
}

# The paper's recurrent baselines, from the same files: model.config fields besides hidden_size
# and num_hidden_layers of PAPER_RUNS["dims"]. Mamba-2 blocks have no MLP: twice the layers.
# Samba: attn.layers null means attention in every odd layer and attn.num_kv_heads null means
# num_heads (its modeling_samba.py); rope_base 500000. The paper's HGRN2 never applied its
# lower bounds (its code drops them; test_convert.py).
PAPER_BASELINES = {
    "deltanet": {
        "125m_2b": {"num_heads": 6},
        "360m_7b": {"num_heads": 8},
        "760m_16b": {"num_heads": 12},
        "760m_48b": {"num_heads": 12},
    },
    "hgrn2": {
        scale: {"expand_ratio": 128, "use_lower_bound": False}
        for scale in ("125m_2b", "360m_7b", "760m_16b", "760m_48b")
    },
    "mamba2": {
        "125m_2b": {"num_hidden_layers": 24, "num_heads": 24, "head_dim": 64, "state_size": 128},
        "360m_7b": {"num_hidden_layers": 48, "num_heads": 32, "head_dim": 64, "state_size": 128},
        "760m_16b": {"num_hidden_layers": 48, "num_heads": 48, "head_dim": 64, "state_size": 128},
        "760m_48b": {"num_hidden_layers": 48, "num_heads": 48, "head_dim": 64, "state_size": 128},
    },
    "samba": {
        "760m_16b": {
            "attn": {
                "num_heads": 12,
                "num_kv_heads": 12,
                "window_size": 2048,
                "rope_theta": 500000,
                "layers": [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23],
            }
        },
    },
}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_model_and_lr_match_the_paper_configs(hydra_ctx, name: str) -> None:
    model, scale = name.rsplit("_", 2)[0], "_".join(name.rsplit("_", 2)[1:])
    cfg = compose("train", overrides=[f"experiment={name}"])
    scales = list(PAPER_RUNS["dims"])
    assert cfg.optim.lr == PAPER_RUNS["lr"][model][scales.index(scale)]
    assert cfg.optim.eps == 1e-8  # torch.optim.AdamW default; the paper's config sets none
    hidden, layers, fox_heads, tf_heads = PAPER_RUNS["dims"][scale]
    built = model_config_from_train_config(cfg)  # (Samba's config needs no flash-attn)
    if model in PAPER_BASELINES:  # FLA's config classes
        want = {"hidden_size": hidden, "num_hidden_layers": layers, **PAPER_BASELINES[model][scale]}
        for field, value in want.items():
            got = getattr(built, field)
            if isinstance(value, dict):  # Samba's attn: the keys above
                got = {key: got[key] for key in value}
            assert got == value, field
        assert (built.vocab_size, built.tie_word_embeddings) == (50257, False)
        assert built.initializer_range == 0.02
        return
    transformer = model.startswith("transformer")
    assert (built.hidden_size, built.num_hidden_layers) == (hidden, layers)
    assert built.num_heads == (tf_heads if transformer else fox_heads)
    assert built.hidden_ratio == (3.5 if model.endswith("pro") else 4)
    assert built.use_rope == transformer and built.rope_theta == 500000
    assert built.window_size == (2048 if model == "transformer_swa" else None)
    assert built.fgate_type == ("none" if transformer else "full") and built.fgate_bias_init == 0
    pro = model.endswith("pro")
    assert (built.qk_norm, built.use_k_shift, built.use_v_shift) == (pro, pro, pro)
    assert (built.use_output_norm, built.use_output_gate) == (pro, pro)
    # paper model config defaults (configs/model/forgetting_transformer.py, transformer.py);
    # QK-norm eps: its q/k norms take their class default 1e-5 (model/.../layernorm.py)
    assert (built.vocab_size, built.norm_eps, built.qk_norm_eps) == (50257, 1e-6, 1e-5)
    assert built.initializer_range == 0.02 and not built.tie_word_embeddings


def test_default_is_tiny_fot_pro_on_sample(hydra_ctx) -> None:
    cfg = compose("train")
    assert (cfg.model.name, cfg.size.name, cfg.data.kind) == ("fot_pro", "tiny", "sample")
    check_sizes(cfg, 1)


def test_unknown_option_lists_valid_ones(hydra_ctx) -> None:
    with pytest.raises(MissingConfigException) as err:
        compose("train", overrides=["model=fot_prp"])
    assert "fot_pro" in str(err.value) and "transformer_llama" in str(err.value)
    with pytest.raises(ConfigCompositionException, match="lrr"):
        compose("train", overrides=["optim.lrr=1"])


def test_model_overrides_reach_the_hf_config(hydra_ctx) -> None:
    cfg = compose("train", overrides=["++model.overrides={hidden_size:64,num_heads:2}"])
    built = model_config_from_train_config(cfg)
    assert (
        built.to_dict() == presets.config("fot_pro", "tiny", hidden_size=64, num_heads=2).to_dict()
    )


@pytest.mark.parametrize(
    ("overrides", "world", "match"),
    [
        (["global_batch_tokens=1000"], 1, "multiple of data.seq_len"),
        (["micro_batch_size=3"], 1, "world_size \\* micro_batch_size"),
        (["micro_batch_size=8"], 3, "3 process"),
        (["total_tokens=1024"], 1, "less than one global batch"),
    ],
)
def test_bad_sizes_are_explained(hydra_ctx, overrides, world, match) -> None:
    cfg = compose("train", overrides=overrides)
    with pytest.raises(ValueError, match=match):
        check_sizes(cfg, world)


@pytest.mark.parametrize(
    ("overrides", "world"),
    [(["micro_batch_size=3"], 1), (["micro_batch_size=8"], 3), (["micro_batch_size=8"], 2),
     (["global_batch_tokens=3072", "micro_batch_size=4"], 2), (["global_batch_tokens=3000"], 1),
     (["global_batch_tokens=3000"], 2)],
)  # fmt: skip
def test_batch_size_errors_suggest_sizes_that_work(hydra_ctx, overrides, world) -> None:
    """Every ``key=value`` a batch-size error suggests, applied alone, passes the check."""
    cfg = compose("train", overrides=overrides)
    with pytest.raises(ValueError, match=r"cannot be split|multiple of data\.seq_len") as err:
        check_sizes(cfg, world)
    fixes = re.findall(r"(\w+)=(\d+)", str(err.value).split("(e.g. ")[1])
    assert fixes
    for key, value in fixes:
        check_sizes(compose("train", overrides=[*overrides, f"{key}={value}"]), world)


@pytest.mark.parametrize(
    ("overrides", "world", "suggested"),
    [(["global_batch_tokens=1536", "micro_batch_size=2"], 4, "3 processes"),
     (["global_batch_tokens=1536", "micro_batch_size=1"], 4, "3 processes or 6 processes"),
     (["global_batch_tokens=3072", "micro_batch_size=2"], 4,
      "micro_batch_size=1 or 3 processes or 6 processes"),
     (["global_batch_tokens=4096", "micro_batch_size=3"], 1, "micro_batch_size=2")],
)  # fmt: skip
def test_resumed_batch_size_errors_keep_the_batch(hydra_ctx, overrides, world, suggested) -> None:
    """Resuming, the batch must stay: the error suggests process counts and micro batches, each
    of which splits it, and never another ``global_batch_tokens``."""
    cfg = compose("train", overrides=overrides)
    with pytest.raises(ValueError, match="cannot be split") as err:
        check_sizes(cfg, world, resuming=Path("run/checkpoints/step_00000010"))
    message = str(err.value)
    assert "resumes from run/checkpoints/step_00000010, whose global_batch_tokens=" in message
    assert message.endswith(f"e.g. {suggested})")
    for fix in suggested.split(" or "):
        if fix.startswith("micro_batch_size="):
            check_sizes(compose("train", overrides=[*overrides, fix]), world)
        else:
            check_sizes(cfg, int(fix.split()[0]))


# -- model overrides: unknown keys are refused ---------------------------------------------------


def test_misspelt_model_override_is_refused_with_the_closest_name(hydra_ctx) -> None:
    """A misspelt key is named with the closest fields and the fix, in two lines; the
    config class's whole field list (34 names) only where no field is close (it followed
    every refusal, after a line per key and one of advice)."""
    import inspect

    from fot.models.configuration_fot import FoTConfig

    cfg = compose("train", overrides=["+model.overrides.hidden_sise=512"])
    with pytest.raises(ValueError, match="hidden_sise") as err:
        model_config_from_train_config(cfg)
    assert str(err.value).endswith(
        "unknown model override hidden_sise=512 for model 'fot_pro' (FoTConfig would store it "
        "and ignore it): did you mean 'hidden_size' or 'hidden_ratio'?\n"
        "Fix: `python train.py +model.overrides.hidden_size=512` or "
        "`fot.presets.config('fot_pro', size, hidden_size=512)`"
    ), str(err.value)
    # The Python API goes through the same check, for FLA baselines as well.
    with pytest.raises(
        ValueError, match=r"qk_nrom=True for model 'fot_pro' .*did you mean 'qk_norm'"
    ):
        presets.config("fot_pro", "tiny", qk_nrom=True)
    with pytest.raises(
        ValueError, match=r"num_head=2 for model 'deltanet' .*did you mean 'num_heads'"
    ):
        presets.config("deltanet", "tiny", num_head=2)
    with pytest.raises(ValueError) as err:
        presets.config("fot_pro", "tiny", hidden_sise=64, num_hedas=2)
    assert str(err.value).splitlines()[1] == (
        "Fix: `python train.py +model.overrides.hidden_size=64 +model.overrides.num_heads=2` or "
        "`fot.presets.config('fot_pro', size, hidden_size=64, num_heads=2)`"
    )
    # nothing close: the fields to choose from
    with pytest.raises(ValueError) as err:
        presets.config("fot_pro", "tiny", xyzzy=1)
    first, fields = str(err.value).splitlines()
    assert first.endswith(
        "xyzzy=1 for model 'fot_pro' (FoTConfig would store it and ignore it): no field is close"
    )
    params = inspect.signature(FoTConfig.__init__).parameters.values()
    named = sorted(p.name for p in params if p.name not in ("self", "kwargs"))
    assert fields == f"FoTConfig fields: {', '.join(named)}"
    # fot's FLA wrappers take **kwargs: the list was empty, and suggestions came from
    # transformers' classification fields (num_layer -> num_labels, with a Fix setting it)
    with pytest.raises(ValueError) as err:
        presets.config("samba", "tiny", num_layer=2)
    assert "did you mean 'num_hidden_layers'?" in str(err.value), err.value
    with pytest.raises(ValueError) as err:
        presets.config("mamba2", "tiny", num_heads=4)  # derived from expand and head_dim
    first, fields = str(err.value).splitlines()
    assert first.endswith("no field is close") and "num_labels" not in str(err.value)
    mamba2 = type(presets.build_model(presets.config("mamba2", "tiny")).config)
    base = inspect.signature(mamba2.__mro__[1].__init__).parameters
    want = sorted(n for n, p in base.items() if n != "self" and p.kind is not p.VAR_KEYWORD)
    assert fields == f"{mamba2.__name__} fields: {', '.join(want)}"


def test_an_fla_model_override_of_the_wrong_type_is_refused(hydra_ctx) -> None:
    """FLA's config classes store what they are given: ``use_short_conv="no"`` (a word from a
    YAML) trained *with* the short convolution, ``num_hidden_layers=2.5`` and ``norm_eps="abc"``
    failed with a traceback deep inside the model. Refused now, naming the field, the type it
    takes and an override that works; values of the right type pass (an int for a float, None
    where the field takes it, a float width factor that fot checks itself)."""
    from fot.models.fla_baselines import fla_config

    # the trap, shown on FLA's config itself: the word is stored and counts as true
    assert fla_config("deltanet", "tiny", use_short_conv="no").use_short_conv == "no"
    for model, fields, pattern in (
        ("deltanet", {"use_short_conv": "no"}, r"use_short_conv='no' for model 'deltanet': "
         r"FoTDeltaNetConfig\.use_short_conv takes true or false; e\.g\. "
         r"\+model\.overrides\.use_short_conv=true \(the preset's value\)$"),
        ("hgrn2", {"num_hidden_layers": 2.5}, r"num_hidden_layers=2\.5 for model 'hgrn2': "
         r"FoTHGRN2Config\.num_hidden_layers takes an int; e\.g\. .*num_hidden_layers=2 "),
        ("mamba2", {"norm_eps": "abc"}, r"norm_eps='abc' for model 'mamba2': .*takes a number"),
        ("samba", {"hidden_size": True}, r"hidden_size=True for model 'samba': .*takes an int"),
        ("hgrn2", {"use_lower_bound": 0}, r"use_lower_bound=0 .*takes true or false"),
        ("deltanet", {"num_heads": None}, r"num_heads=None .*takes an int;"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^model override {pattern}"):
            presets.config(model, "tiny", **fields)
    cfg = compose("train", overrides=["model=hgrn2", "+model.overrides.use_lower_bound=no"])
    with pytest.raises(ValueError, match=r"use_lower_bound='no' .*takes true or false"):
        model_config_from_train_config(cfg)
    # the right types pass
    assert presets.config("mamba2", "tiny", norm_eps=1).norm_eps == 1
    hgrn2 = presets.config("hgrn2", "tiny", num_heads=None, use_lower_bound=False)
    assert hgrn2.use_lower_bound is False and hgrn2.num_heads == 4  # None: FLA derives it
    assert presets.config("deltanet", "tiny", hidden_ratio=3.5, bos_token_id=None).hidden_ratio
    assert presets.config("samba", "tiny", mamba_hidden_ratio=None).mamba_hidden_ratio is None
    # every field of each preset given its preset's value, as an override
    for model in ("mamba2", "deltanet", "hgrn2", "samba"):
        base = presets.config(model, "tiny")
        same = {k: getattr(base, k) for k in presets._plain_field_types(type(base))}
        assert presets.config(model, "tiny", **same).to_dict() == base.to_dict(), model


def test_every_valid_model_override_is_still_accepted(hydra_ctx) -> None:
    import inspect

    from fot.models.configuration_fot import FoTConfig

    base = presets.config("fot_pro", "tiny")
    params = inspect.signature(FoTConfig.__init__).parameters
    same = {name: getattr(base, name) for name in params if name not in ("self", "kwargs")}
    assert presets.config("fot_pro", "tiny", **same).to_dict() == base.to_dict()
    # LLaMA names, zero dropouts and keys every transformers config takes pass through (the
    # RoPE base on a model with RoPE: test_an_override_the_model_does_not_read_is_refused).
    cfg = presets.config(
        "transformer_llama",
        "tiny",
        num_attention_heads=2,
        num_key_value_heads=1,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        attention_dropout=0.0,
        hidden_act="silu",
        output_hidden_states=True,
        dtype="float32",
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.norm_eps, cfg.rope_theta) == (2, 1, 1e-5, 1e4)
    assert cfg.output_hidden_states is True
    built = model_config_from_train_config(
        compose("train", overrides=["+model.overrides.fgate_bias_init=5"])
    )
    assert built.fgate_bias_init == 5
    assert presets.config("deltanet", "tiny", num_heads=2, expand_v=1.0).expand_v == 1.0


# -- from_pretrained / from_dict keyword overrides are checked like the constructor ---------------


def _saved_config(tmp_path: Path) -> Path:
    presets.config(
        "fot_pro", "tiny", vocab_size=300, bos_token_id=None, eos_token_id=None
    ).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("loader", ["FoTConfig", "AutoConfig"])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attention_dropout": 0.1}, "attention_dropout=0.1: FoT models have no dropout"),
        ({"num_heads": 3}, r"divisible by num_heads \(3\)"),
        ({"num_attention_heads": 3}, r"divisible by num_heads \(3\)"),
        ({"kv_heads": 3}, r"multiple of num_kv_heads \(3\)"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"fgate_type": "ful"}, "unknown fgate_type 'ful'"),
    ],
)
def test_from_pretrained_overrides_are_checked_like_the_constructor(
    tmp_path, loader: str, kwargs: dict, match: str
) -> None:
    import transformers

    import fot

    cls = fot.FoTConfig if loader == "FoTConfig" else transformers.AutoConfig
    path = _saved_config(tmp_path)
    with pytest.raises(ValueError, match=match):
        cls.from_pretrained(path, **kwargs)


def test_from_pretrained_overrides_map_llama_names_and_keep_the_rest(tmp_path) -> None:
    from transformers import AutoConfig

    from fot import FoTConfig

    path = _saved_config(tmp_path)
    for load in (FoTConfig.from_pretrained, AutoConfig.from_pretrained):
        cfg, unused = load(
            path,
            num_attention_heads=8,  # replaces the saved num_heads=4
            use_rope=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},  # the saved rope_theta
            attention_dropout=0.0,  # consumed (not passed on to the model's __init__)
            output_hidden_states=True,
            not_a_field=1,
            return_unused_kwargs=True,
        )
        assert (cfg.num_heads, cfg.kv_heads, cfg.rope_theta) == (8, 8, 1e4)
        assert cfg.output_hidden_states is True
        assert unused == {"not_a_field": 1}
        assert not hasattr(cfg, "attention_dropout")
    cfg = FoTConfig.from_dict(FoTConfig.from_pretrained(path).to_dict(), num_kv_heads=2)
    assert cfg.kv_heads == 2


# -- the default global batch fits every data group -----------------------------------------------


def _readme_tokens_command() -> list[str]:
    import shlex

    readme = (CONFIGS.parent / "README.md").read_text()
    lines = [ln.strip() for ln in readme.splitlines() if ln.strip().startswith("python train.py")]
    commands = [shlex.split(ln)[2:] for ln in lines if "data=tokens" in ln]
    assert commands, "README.md shows no `python train.py data=tokens ...` command"
    return commands[0]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(None, id="readme-example"),
        pytest.param(["data=tokens", "data.path=data/mine"], id="tokens"),
        pytest.param(["data.seq_len=512"], id="sample-512"),
        pytest.param(["data=hf", "data.path=x", "data.seq_len=1024"], id="hf-1024"),
    ],
)
def test_default_batch_splits_for_every_data_group(hydra_ctx, overrides) -> None:
    cfg = compose("train", overrides=overrides or _readme_tokens_command())
    seqs, steps = check_sizes(cfg, 1)
    assert seqs == 8 and cfg.global_batch_tokens == 8 * cfg.data.seq_len
    assert steps == cfg.total_tokens // cfg.global_batch_tokens >= 1
    # the default run on the sample corpus is unchanged: 48 steps of 8 x 256 tokens
    default = compose("train")
    assert (default.global_batch_tokens, check_sizes(default, 1)) == (2048, (8, 48))


def test_mul_resolver_refuses_non_integers() -> None:
    from fot.training.config import mul

    assert mul(8, 2048) == 16384
    with pytest.raises(ValueError, match=r"fot.mul multiplies integers, got 2.5"):
        mul(8, 2.5)


# -- every train.py command of the README and the reference pages --------------------------------


def _doc_train_commands() -> list[tuple[str, int, list[str]]]:
    """The ``train.py`` commands a user copies from the README, docs/training.md and
    docs/models.md (bash blocks, and inline code of whole commands), also those run by
    torchrun or srun: ``(page, processes, train.py's arguments)``. Commands with placeholders
    (``...``, ``<dir>``) are left out."""
    import shlex

    commands = []
    for page in ("README.md", "docs/training.md", "docs/models.md"):
        text = (CONFIGS.parent / page).read_text()
        blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
        lines = [ln for block in blocks for ln in block.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`((?:python|torchrun|srun) [^`]*)`", text)
        for line in lines:
            words = shlex.split(line, comments=True)
            if "train.py" not in words or any("..." in w or "<" in w for w in words):
                continue
            at = words.index("train.py")
            launcher = dict(w[2:].split("=", 1) for w in words[:at] if w[:2] == "--" and "=" in w)
            per_node = launcher.get("nproc_per_node", launcher.get("ntasks-per-node", 1))
            nodes = launcher.get("nnodes", launcher.get("nodes", 1))
            commands.append((page, int(per_node) * int(nodes), words[at + 1 :]))
    return commands


DOC_TRAIN_COMMANDS = _doc_train_commands()


def test_the_docs_show_train_commands() -> None:
    """The parser above finds the pages' commands (the test below would pass on none)."""
    pages = {page for page, _, _ in DOC_TRAIN_COMMANDS}
    assert {"README.md", "docs/training.md"} <= pages and len(DOC_TRAIN_COMMANDS) >= 12
    assert (8 * 4, ["experiment=fot_pro_760m_48b", "data.path=/data/longcrawl64"]) in [
        (n, args[:2]) for page, n, args in DOC_TRAIN_COMMANDS if page == "docs/training.md"
    ]  # the four-node torchrun and srun commands, their lines joined


@pytest.mark.parametrize(
    ("page", "processes", "args"),
    DOC_TRAIN_COMMANDS,
    ids=[f"{page}:{' '.join(args)[:60]}" for page, _, args in DOC_TRAIN_COMMANDS],
)
def test_every_train_command_of_the_docs_starts_without_a_warning(
    hydra_ctx, page: str, processes: int, args: list[str]
) -> None:
    """A command copied from the docs passes the checks train.py makes before it trains (its
    command-line checks, check_config, the batch split over the command's processes) with no
    warning, for every job of a sweep. The init_from example's total_tokens=1000000000 is no
    whole number of its 0.5Mi-token batches: the run warned that it trains 999817216 tokens
    and to use that value instead."""
    import importlib.util

    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    spec = importlib.util.spec_from_file_location("_fot_train_py", CONFIGS.parent / "train.py")
    assert spec is not None and spec.loader is not None
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)  # only its definitions: the run is under __main__
    assert entry.argv_problem(args) is None
    if "--help" in args:
        return
    overrides = [a for a in args if a not in ("-m", "--multirun") and not a.startswith("hydra.")]
    [jobs] = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(overrides), None)
    for job in jobs:
        cfg = compose("train", overrides=job)
        assert check_config(cfg) == [], job
        check_sizes(cfg, processes)  # the batch splits over the command's processes


# -- the config key table of docs/training.md ----------------------------------------------------


def _config_leaves(node: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """``(dotted key, value)`` of every key of a resolved config; the free-form mappings
    (``model.overrides``, ``data.storage_options``) are one key each."""
    for key, value in node.items():
        if isinstance(value, dict) and key not in ("overrides", "storage_options"):
            yield from _config_leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _composed_leaves(*overrides: str) -> dict[str, object]:
    return dict(
        _config_leaves(OmegaConf.to_container(compose("train", list(overrides)), resolve=True))
    )


def _yaml_value(text: str) -> object:
    return OmegaConf.to_container(OmegaConf.create(f"v: {text}"))["v"]


def test_the_docs_table_names_every_config_key_with_its_defaults(hydra_ctx) -> None:
    """docs/training.md's table has a row for every key the composed config has, and no other;
    its default is what ``python train.py`` composes, and each value it gives for a group
    option or preset (`` `data=tokens`, `data=hf`: `2048` ``) is what that option composes."""
    text = (CONFIGS.parent / "docs/training.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \| (.*) \|$", text, re.M)
    table = {key: (shown, what) for key, shown, what in rows}
    default = _composed_leaves()
    assert len(table) == len(rows) and sorted(table) == sorted(default)
    checked = 0
    for key, (shown, what) in table.items():
        assert _yaml_value(shown) == default[key], key
        for options, value in re.findall(r"((?:`\w+=\w+`(?:, )?)+): `([^`]+)`", what):
            for option in re.findall(r"`(\w+=\w+)`", options):
                assert _composed_leaves(option)[key] == _yaml_value(value), (key, option)
                checked += 1
    assert checked >= 30  # the rows' group and preset values were found and compared


# -- check_config: values refused before any run folder is made ---------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["seed=-1"], "seed=-1 is negative"),
        (["data.val_tokens=-5"], "data.val_tokens=0 for no validation"),
        (["schedule.warmup_tokens=-1"], "schedule.warmup_tokens=0 for no warmup"),
        (["val_micro_batch_size=0"], "val_micro_batch_size=0 must be >= 1"),
        (["val_micro_batch_size=-2"], "val_micro_batch_size=-2 must be >= 1"),
        (["resume=/no/such/path"], "resume=/no/such/path does not exist.*resume=never"),
        (["model=mamba2", "device=cpu"], "model=mamba2 .* need a CUDA GPU"),
        (["optim.lr=-1"], r"optim.lr must be > 0 and finite, got -1"),
        # nan fails every comparison: these ran, to a nan loss at step 2 (a nan grad_clip to
        # no clipping at all)
        (["optim.lr=nan"], r"optim.lr must be > 0 and finite, got nan"),
        (["optim.lr=inf"], r"optim.lr must be > 0 and finite, got inf"),
        (["optim.betas=[0.9]"], r"optim.betas must be two numbers in \[0, 1\)"),
        (["optim.eps=0"], "optim.eps must be > 0"),
        (["optim.eps=nan"], r"optim.eps must be > 0 and finite \(e.g. 1e-8\), got nan"),
        (["optim.weight_decay=-0.1"], "optim.weight_decay must be >= 0"),
        (["optim.weight_decay=nan"], r"optim.weight_decay must be >= 0 and finite .* got nan"),
        (["optim.weight_decay=inf"], r"optim.weight_decay must be >= 0 and finite .* got inf"),
        (["optim.grad_clip=-1"], "optim.grad_clip=0 for no clipping"),
        (["optim.grad_clip=nan"], r"^optim.grad_clip=nan is not a number >= 0; use optim.grad_"),
        (["schedule.min_lr_ratio=2"], r"schedule.min_lr_ratio=2.0 must be in \[0, 1\]"),
        (
            ["schedule.name=cosine"],
            r"^schedule.name='cosine' is not one of \[.*\]; did you mean 'warmup_cosine'\? \(or "
            r"pick the group: schedule=warmup_linear\)$",
        ),
        (
            ["schedule.decay_fraction=0.3"],
            r"schedule.decay_fraction=0.3: only schedule=wsd reads it, not "
            r"schedule.name='warmup_cosine'",
        ),
        (["schedule.name=wsd"], r"needs schedule.decay_fraction and schedule.decay_shape; pick"),
        # constant keeps the peak: a floor for its decay was ignored
        (
            ["schedule=constant", "schedule.min_lr_ratio=0.5"],
            r"^schedule.min_lr_ratio=0.5: schedule=constant keeps optim.lr to the end and does "
            r"not read it; for a decay to that fraction use schedule=warmup_cosine",
        ),
        (
            ["schedule.name=constant"],
            r"schedule.min_lr_ratio=0.1: schedule=constant keeps .* rather than "
            r"schedule.name=constant; after an experiment file that sets it, add "
            r"schedule.min_lr_ratio=1\)$",
        ),
        (["branch_from=/no/such/ckpt"], r"branch_from=/no/such/ckpt does not exist; pass a"),
        (["optim.momentum=0.9"], r"optim.momentum=0.9: only optim=muon reads it"),
        (["optim.name=muon"], r"needs optim.momentum, optim.ns_steps and optim.adjust_lr; pick"),
        (["optim=muon", "optim.momentum=1"], r"optim.momentum=1.0 must be in \[0, 1\)"),
        (["optim=muon", "optim.ns_steps=0"], r"optim.ns_steps=0 must be in \[1, 99\]"),
        (["optim=muon", "optim.ns_steps=100"], r"optim.ns_steps=100 must be in \[1, 99\]"),
        (["optim=muon", "optim.adjust_lr=moon"], r"optim.adjust_lr='moon' is not one of"),
        (["optim.name=sgd"], r"^optim.name='sgd' is not one of \['adamw', 'muon'\] \(or pick "),
        (
            ["optim=muon", "parallel.cuda_graphs=true"],
            r"optim=muon is not one: set parallel.cuda_graphs=false, or use optim=adamw",
        ),
        (["branch_from=/tmp", "resume=never"], r"which needs resume=auto, not resume=never"),
        (["branch_from=/tmp", "init_from=/tmp"], r"both say where the run starts"),
        (["schedule=wsd", "schedule.decay_fraction=0"], r"decay_fraction=0.0 must be in \(0, 1\]"),
        (["schedule=wsd", "schedule.decay_shape=sqrt"], r"decay_shape='sqrt' is not one of"),
        (["+model.overrides.qk_norm=no"], "qk_norm must be true or false, got 'no'"),
        (["+model.overrides.intermediate_size=-5"], "intermediate_size must be a positive int"),
        (["+model.overrides.attn_backend=triton", "device=cpu"], "attn_backend=auto"),
        (
            ["+model.overrides.max_position_embeddings=128", "data.seq_len=256"],
            "raise model.overrides.max_position_embeddings to at least 256",
        ),
        (["+model.overrides.vocab_size=1000"], r"vocab_size=1000 leaves out <\|endoftext\|>"),
        (["model=fot_llama", "+model.overrides.vocab_size=50256"], r"at least 50257 \(the presets"),
        (["peak_flops=-5"], "peak_flops=-5.0 must be > 0"),
        (
            ["data.text_escaping=yaml"],
            r"data.text_escaping='yaml' is not one of \['none', 'json'\]",
        ),
        (["parallel.reduce_precision=bf8"], "parallel.reduce_precision='bf8' is not one of"),
        (
            ["parallel.backend=ncl"],
            r"^parallel.backend='ncl' is not one of \['auto', 'nccl', 'gloo'\]; did you mean "
            r"'nccl'\?$",
        ),
        (["parallel.backend=nccl", "device=cpu"], r"nccl needs CUDA GPUs.*parallel.backend=gloo"),
        (
            ["wandb.mode=onlin"],
            r"wandb.mode='onlin' is not one of \['auto', 'online'.*did you mean 'online' or "
            r"'offline'\?$",
        ),
        (["parallel.timeout_s=0"], r"parallel.timeout_s=0.0 is not a positive number of "),
        (["parallel.timeout_s=-5"], r"parallel.timeout_s=-5.0 is not a positive number of "),
        (["parallel.timeout_s=inf"], r"parallel.timeout_s=inf is not a positive number of "),
        (["parallel.timeout_s=0.0001"], r"timeout_s=0.0001 is not .* seconds \(0.001 or more"),
        (
            ["parallel.timeout_s=nan"],
            r"parallel.timeout_s=nan is not a positive number of seconds \(0.001 or more, torch's "
            r"unit\): set how long a rank "
            r"waits .* \(e.g. parallel.timeout_s=3600\), or null for torch's defaults",
        ),
    ],
)
def test_check_config_refuses_bad_values_with_the_fix(
    hydra_ctx, monkeypatch, overrides, match
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # conftest sets it on CPU
    cfg = compose("train", overrides=overrides)
    with pytest.raises(ValueError, match=match):
        check_config(cfg)


def test_schedule_constant_passes_with_its_own_floor_which_lr_at_does_not_read(
    hydra_ctx,
) -> None:
    """The oracle of the schedule=constant cases above: its learning rate at the end of the
    run is the peak whatever schedule.min_lr_ratio says; the group as written passes."""
    from fot.training.config import ScheduleConfig
    from fot.training.optim import lr_at

    for ratio in (0.0, 0.5, 1.0):
        sched = ScheduleConfig(name="constant", warmup_tokens=10, min_lr_ratio=ratio)
        assert lr_at(1000, peak_lr=0.5, total_tokens=1000, cfg=sched) == 0.5
    assert check_config(compose("train", overrides=["schedule=constant"])) == []


@pytest.mark.parametrize("name", [*EXPERIMENTS, "repro_small"])
def test_a_schedule_picked_after_an_experiment_keeps_its_own_floor(
    hydra_ctx, monkeypatch, name
) -> None:
    """``experiment=<preset> schedule=constant`` was refused (the presets set
    schedule.min_lr_ratio=0.1, which constant does not read, and the message said to pick
    schedule=constant), and ``schedule=wsd`` decayed to 0.1 x the peak, not to 0 as its group
    says. The learning rate of the last step, by hand: the peak, 0, and the paper's 0.1 x the
    peak without a schedule override; the preset's warmup stays."""
    from fot.training.config import ScheduleConfig
    from fot.training.optim import lr_at

    monkeypatch.setattr("fot.models.fla_baselines.missing_package", lambda config: None)

    def last_lr(*overrides: str) -> tuple[float, float, ScheduleConfig]:
        cfg = compose("train", overrides=[f"experiment={name}", *overrides])
        assert check_config(cfg) == []
        sched = ScheduleConfig(**OmegaConf.to_container(cfg.schedule))
        end = int(cfg.total_tokens)
        return lr_at(end, peak_lr=cfg.optim.lr, total_tokens=end, cfg=sched), cfg.optim.lr, sched

    got, peak, sched = last_lr()
    assert got == pytest.approx(0.1 * peak, rel=1e-12)
    warmup = sched.warmup_tokens
    assert warmup == (2 * 2**20 if name == "repro_small" else 256 * 2**20)
    got, peak, sched = last_lr("schedule=constant")
    assert got == peak and sched.warmup_tokens == warmup
    got, peak, sched = last_lr("schedule=wsd")
    assert got == 0.0 and sched.warmup_tokens == warmup


def test_check_config_refuses_a_timeout_that_is_no_number(hydra_ctx) -> None:
    """A config built without the schema (``train(cfg)`` from Python) may hold any type: a
    string or a bool is no timeout (``True`` would be one second)."""
    for bad, shown in (("600", "'600'"), (True, "True")):
        cfg = OmegaConf.create(OmegaConf.to_container(compose("train")))
        cfg.parallel.timeout_s = bad
        with pytest.raises(ValueError, match=rf"^parallel.timeout_s={shown} is not a positive"):
            check_config(cfg)
    cfg.parallel.timeout_s = 0.5  # half a second is a timeout
    assert check_config(cfg) == []


def test_check_config_accepts_the_defaults_and_a_real_resume_folder(hydra_ctx, tmp_path) -> None:
    assert check_config(compose("train")) == []
    cfg = compose("train", overrides=[f"resume={tmp_path}", "val_micro_batch_size=2", "seed=7"])
    assert check_config(cfg) == []


def test_check_config_warns_when_warmup_outlasts_the_run(hydra_ctx) -> None:
    cfg = compose("train", overrides=["total_tokens=4096", "schedule.warmup_tokens=100000"])
    (warning,) = check_config(cfg)
    assert "schedule.warmup_tokens=100000" in warning and "never reaches optim.lr" in warning
    # 3e-3 * 4096 / 100000, by hand
    assert f"optim.lr={cfg.optim.lr}" in warning and "last step's is 0.000123)" in warning


def test_check_config_warns_when_the_wsd_decay_starts_inside_the_warmup(hydra_ctx) -> None:
    # 2 steps of 2048 tokens; the decay takes the last half (2048 tokens), the warmup 3000
    overrides = ["total_tokens=4096", "schedule=wsd", "schedule.decay_fraction=0.5"]
    cfg = compose("train", overrides=[*overrides, "schedule.warmup_tokens=3000"])
    (warning,) = check_config(cfg)
    assert "starts the decay at 2048 tokens, before the warmup ends" in warning
    assert "schedule.warmup_tokens=3000" in warning and "no stable phase" in warning
    cfg = compose("train", overrides=[*overrides, "schedule.warmup_tokens=2048"])
    (warning,) = check_config(cfg)  # a stable step, then a decay of the last step alone
    assert "no stable phase" not in warning and "falls from 0.003 to 0 " in warning


@pytest.mark.parametrize(
    "overrides,decay_steps",
    [
        (["total_tokens=16384"], 0),  # the default warmup of 16384 tokens: the whole run
        (["total_tokens=16384", "schedule.warmup_tokens=14336"], 1),
        (["total_tokens=16384", "schedule.warmup_tokens=16383"], 1),
        (["total_tokens=16384", "schedule=warmup_linear"], 0),
        (["total_tokens=16384", "schedule.warmup_tokens=12288"], 2),
        (["total_tokens=1048576", "schedule=wsd", "schedule.decay_fraction=0.001"], 1),
        (["total_tokens=1048576", "schedule=wsd", "schedule.decay_fraction=0.004"], 3),
        (["total_tokens=16384", "schedule=constant"], 0),  # no decay to miss
        (["total_tokens=16384", "schedule.min_lr_ratio=1.0"], 0),
    ],
)
def test_check_config_warns_when_the_lr_decay_takes_no_step_or_one(
    hydra_ctx, overrides: list[str], decay_steps: int
) -> None:
    """total_tokens=16384 with the default 16384-token warmup never decayed the learning rate,
    and a wsd decay_fraction shorter than a step decayed it in the last step alone, without a
    word. The oracle: each step's rate from lr_at, as the training loop computes it."""
    from fot.training.optim import lr_at

    cfg = compose("train", overrides=overrides)
    gbt, total, peak = int(cfg.global_batch_tokens), int(cfg.total_tokens), cfg.optim.lr
    lrs = [
        lr_at(t, peak_lr=peak, total_tokens=total, cfg=cfg.schedule)
        for t in range(gbt, total + 1, gbt)
    ]
    falling = sum(1 for a, b in itertools.pairwise(lrs) if b < a)  # steps that lower it
    assert falling == decay_steps
    warnings = check_config(cfg)
    declines = cfg.schedule.name != "constant" and cfg.schedule.min_lr_ratio < 1
    if not declines or decay_steps > 1:
        assert warnings == []
        return
    (warning,) = warnings
    if decay_steps == 0:
        assert max(lrs) == lrs[-1] == peak  # the warmup's last step reaches the peak, no more
        assert "lasts the whole run (total_tokens=16384)" in warning and "never decays" in warning
    else:
        floor = peak * cfg.schedule.min_lr_ratio
        assert lrs[-2] == max(lrs) and lrs[-1] == pytest.approx(floor)  # one step down
        assert f"falls from {lrs[-2]:.3g} to {floor:.3g} (schedule.min_lr_ratio" in warning
        assert "in the last step alone" in warning
        fix = "schedule.decay_fraction to at least" if "wsd" in str(overrides) else "lower sch"
        assert fix in warning


def test_check_config_warns_when_the_run_is_not_whole_steps(hydra_ctx) -> None:
    # batches of 2048 tokens: 2 steps (4096 tokens) of the 5000 asked
    cfg = compose("train", overrides=["total_tokens=5000", "schedule.warmup_tokens=4500"])
    assert int(cfg.global_batch_tokens) == 2048 and cfg.optim.lr == 3e-3
    steps, warmup = check_config(cfg)
    assert "total_tokens=5000 is not a multiple of global_batch_tokens=2048" in steps
    assert "trains 2 steps (4096 tokens; its learning-rate schedule ends there)" in steps
    assert "use total_tokens=4096" in steps
    assert check_sizes(cfg, 1) == (8, 2)  # the loop trains the 2 steps the warning names
    # the warm-up outlasts the 4096 tokens trained, though not the 5000 asked;
    # its last step's rate: 3e-3 * 4096 / 4500 = 0.0027306...
    assert "more than the 4096 tokens the run trains" in warmup
    assert "last step's is 0.00273)" in warmup


def test_check_config_warns_on_intervals_that_are_not_whole_steps(hydra_ctx) -> None:
    cfg = compose("train", overrides=["log_every_tokens=3000"])  # batches of 2048 tokens
    (warning,) = check_config(cfg)
    assert "log_every_tokens=3000" in warning and "log_every_tokens=2048" in warning
    # an interval below one step acts at every step: even, nothing to warn about
    for data in ("sample", "tokens", "hf"):  # the defaults, also with 16Ki-token steps
        assert check_config(compose("train", overrides=[f"data={data}"])) == []
    # steps of 2000 tokens: 49152 is uneven, but only an interval that acts twice has a
    # rhythm to break, and validation every 49152 tokens without held-out data never acts
    uneven = ["data.seq_len=250", "log_every_tokens=2000", "val_every_tokens=49152",
              "ckpt_every_tokens=49152"]  # fmt: skip
    long_run = check_config(compose("train", overrides=[*uneven, "total_tokens=200000"]))
    assert [w.split("=")[0] for w in long_run] == ["val_every_tokens", "ckpt_every_tokens"]
    short_run = [*uneven, "total_tokens=98000"]  # 49 steps: 98000 < 2 x 49152
    assert check_config(compose("train", overrides=short_run)) == []
    no_val = [*uneven, "total_tokens=200000", "data.val_tokens=0"]
    assert [w.split("=")[0] for w in check_config(compose("train", overrides=no_val))] == [
        "ckpt_every_tokens"
    ]


def test_multirun_with_one_fixed_out_dir_is_refused(hydra_ctx) -> None:
    from fot.training.config import check_multirun_out_dir

    fixed = compose("train", overrides=["out_dir=/runs/sweep"])
    with pytest.raises(ValueError, match=r"out_dir=/runs/sweep with -m.*hydra\.sweep\.dir"):
        check_multirun_out_dir(fixed, multirun=True)
    check_multirun_out_dir(fixed, multirun=False)  # one job: its folder as asked
    check_multirun_out_dir(compose("train"), multirun=True)  # Hydra's folder per job
    per_job = compose("train", overrides=["out_dir=/runs/sweep/${hydra:job.num}"])
    check_multirun_out_dir(per_job, multirun=True)


@pytest.mark.parametrize(
    ("argv", "refused"),
    [
        (["-m", "optim.lr=1,2", "out_dir=/runs/sweep"], True),
        (["--multirun", "+out_dir=/runs/sweep"], True),
        (["optim.lr=1", "out_dir=/runs/sweep"], False),  # one job
        (["-m", "out_dir=/runs/sweep/${hydra:job.num}"], False),  # one folder per job
        (["-m", "out_dir=null", "optim.lr=1,2"], False),  # Hydra's folder per job
        (["-m", "optim.lr=1,2"], False),
    ],
)
def test_multirun_out_dir_is_checked_on_the_command_line(argv, refused) -> None:
    """The command-line check agrees with the config check above, before Hydra makes its
    sweep folder."""
    from fot.training.config import multirun_out_dir_problem

    problem = multirun_out_dir_problem(argv)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith("out_dir=/runs/sweep with -m") and "hydra.sweep.dir" in problem


def test_out_dir_that_is_or_lies_under_a_file_is_refused_on_the_command_line(tmp_path) -> None:
    from fot.training.config import out_dir_problem

    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    assert out_dir_problem([f"out_dir={f}"]).startswith(f"out_dir={f} is a file")
    problem = out_dir_problem(["optim.lr=1", f"hydra.run.dir={f}/run"])
    assert problem.startswith(f"hydra.run.dir={f}/run lies under the file {f}")
    for ok in ([f"out_dir={tmp_path}"], [f"out_dir={tmp_path}/new/run"], ["out_dir=null"], []):
        assert out_dir_problem(ok) is None


def test_out_dir_that_cannot_be_written_is_refused_on_the_command_line(
    tmp_path, monkeypatch
) -> None:
    """Hydra made the run folder before fot read the config: a read-only file system was a
    traceback of its OSError. Tests run as root, whom permissions do not stop, so the folder's
    access is what os.access answers for a read-only mount."""
    import os

    from fot.training.config import out_dir_problem

    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != ro and real(p, mode))
    assert out_dir_problem([f"out_dir={ro}"]) == (
        f"out_dir={ro} cannot be written: a read-only file system or no permission; choose a "
        "folder you can write"
    )
    assert out_dir_problem([f"hydra.run.dir={ro}/a/b"]).startswith(
        f"hydra.run.dir={ro}/a/b (its folder {ro}) cannot be written"
    )
    assert out_dir_problem([f"out_dir={tmp_path}/rw/run"]) is None


def test_a_quoted_out_dir_is_checked_as_hydra_reads_it(tmp_path, monkeypatch) -> None:
    """The command-line check read ``out_dir='/runs/a'`` with its quotes, as the relative path
    ``'/runs/a'`` under the current folder: a quoted file was let through (then Hydra's
    traceback), and a quoted good folder refused where the current folder is read-only. It now
    takes the value Hydra's override parser gives."""
    import os

    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fot.training.config import out_dir_problem

    here = tmp_path / "read-only checkout"
    here.mkdir()
    monkeypatch.chdir(here)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p).resolve() != here and real(p, mode))
    f = tmp_path / "my runs" / "notes.txt"
    f.parent.mkdir()
    f.write_text("keep me")
    good = tmp_path / "my runs" / "run 1"
    parser = OverridesParser.create()
    for arg, problem in [
        (f"out_dir='{f}'", f"out_dir={f} is a file"),
        (f'out_dir="{f}"', f"out_dir={f} is a file"),
        (f"++hydra.run.dir='{f}/run'", f"hydra.run.dir={f}/run lies under the file {f}"),
        (f"out_dir='{here}/run'", f"out_dir={here}/run (its folder {here}) cannot be written"),
        (f"out_dir='{good}'", None),
        (f'hydra.run.dir="{good}"', None),
        (f"out_dir={str(good).replace(' ', chr(92) + ' ')}", None),  # escaped space
    ]:
        # the oracle: the path Hydra itself sets
        value = parser.parse_overrides([arg])[0].value()
        assert value in (str(f), f"{f}/run", f"{here}/run", str(good)), (arg, value)
        got = out_dir_problem([arg])
        assert (got is None) if problem is None else got.startswith(problem), (arg, got)
    # quoted, null is the folder ./null (Hydra's string), in the read-only current folder
    assert out_dir_problem(["out_dir='null'"]).startswith("out_dir=null (its folder .) cannot")
    assert out_dir_problem(["out_dir=null", "~out_dir", "-m", "out_dir='a',b"]) is None


def test_hydra_job_chdir_is_refused_before_the_run_starts(tmp_path) -> None:
    """With it the run's files went to <out_dir>/<out_dir> and relative data paths were not
    found (Hydra changes into the run folder before fot reads them)."""
    stderr = _train_py_refuses(tmp_path, "hydra.job.chdir=true", "out_dir=runs/x")
    assert stderr.startswith("train.py: error: hydra.job.chdir=true: fot reads out_dir")
    assert chdir_problem(["hydra.job.chdir=false"]) is None and chdir_problem([]) is None


def test_ddp_without_torchrun_is_refused_before_the_run_starts() -> None:
    import torch

    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, resolve_strategy

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"needs torchrun.*parallel=single"):
        resolve_strategy(ParallelConfig(strategy="ddp"), info)
    assert resolve_strategy(ParallelConfig(strategy="fsdp"), info) == "fsdp"  # FSDP2 of one


def test_ddp_of_one_process_under_torchrun_trains_as_one_process(monkeypatch, caplog) -> None:
    """`torchrun --nproc_per_node=1 train.py parallel=ddp` (a launcher with a variable process
    count) was refused as "needs torchrun", under torchrun; fsdp ran."""
    import logging

    import torch

    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, resolve_strategy

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with caplog.at_level(logging.WARNING, logger="fot.train"):
        assert resolve_strategy(ParallelConfig(strategy="ddp"), info) == "single"
    assert "parallel.strategy=ddp with one process: training as parallel=single" in caplog.text


def test_fsdp_over_gloo_is_refused_with_a_torch_whose_fsdp2_sums_the_gradients(monkeypatch):
    """torch 2.8's FSDP2 summed the gradients over gloo (a grad_norm twice the one-process
    run's in test_two_processes_equal_one[fsdp], run under torch 2.8.0 and 2.7.1); 2.9 on
    averages them."""
    import torch
    import torch.distributed as dist

    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, check_fsdp_backend, resolve_strategy

    with pytest.raises(ValueError, match=r"torch >= 2\.9.*2\.8\.0\+cu128.*parallel=ddp"):
        check_fsdp_backend("gloo", "2.8.0+cu128")
    with pytest.raises(ValueError, match=r"torch 2\.7\.1's FSDP2"):
        check_fsdp_backend("gloo", "2.7.1")
    for backend, version in [("gloo", "2.9.1"), ("gloo", "2.10.0a0+git1234"), ("nccl", "2.8.0")]:
        check_fsdp_backend(backend, version)  # no error

    # through resolve_strategy, with this process as a gloo group
    info = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        monkeypatch.setattr(torch, "__version__", "2.9.0")
        assert resolve_strategy(ParallelConfig(strategy="fsdp"), info) == "fsdp"
        monkeypatch.setattr(torch, "__version__", "2.8.0")
        with pytest.raises(ValueError, match=r"parallel=fsdp over gloo needs torch >= 2\.9"):
            resolve_strategy(ParallelConfig(strategy="fsdp"), info)
        assert resolve_strategy(ParallelConfig(strategy="ddp"), info) == "ddp"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("lr=1e-3", "optim.lr"),
        ("total_token=1000", "total_tokens"),
        ("optim.lrr=1", "optim.lr"),
        ("parallel.compil=true", "parallel.compile"),
        ("model.num_heads=3", "+model.overrides.<field>"),
        ("modle=fot_pro", "did you mean model?"),
        # added with + or ++: Hydra added the key, nothing read it, the run went on without it
        ("+optim.lrr=1", "did you mean optim.lr or"),
        ("++total_token=5", "did you mean total_tokens or"),
        ("+modle=x", "did you mean model?"),
    ],
)
def test_misspelt_top_level_key_names_the_field_meant(override: str, suggestion: str) -> None:
    from fot.training.config import unknown_override_key

    message = unknown_override_key(override)
    assert message is not None and suggestion in message and override in message
    if override.startswith("+"):
        assert message.endswith(f"({override.split(override.lstrip('+'))[0]} adds a key to the "
                                "config, where nothing would read this one)")  # fmt: skip


@pytest.mark.parametrize(
    "override",
    ["optim.lr=1e-3,2e-3", "total_tokens=4096", "size=tiny", "experiment=fot_pro_125m_2b",
     "hydra.run.dir=x", "+model.overrides.num_heads=2", "model.overrides.num_heads=2", "++seed=1", "~wandb.name",
     "++data.storage_options.token=x", "+hydra.job.env_set.A=1", "++model=fot_llama",
     "data.seq_len=3", "parallel=fsdp", "-m", "--help"],
)  # fmt: skip
def test_known_keys_and_hydra_syntax_are_left_to_hydra(hydra_ctx, override: str) -> None:
    from fot.training.config import unknown_override_key

    assert unknown_override_key(override) is None
    if override in (
        "total_tokens=4096",
        "size=tiny",
        "experiment=fot_pro_125m_2b",
        "data.seq_len=3",
        "parallel=fsdp",
    ):
        compose("train", overrides=[override])  # and Hydra accepts it


@pytest.mark.parametrize(
    ("override", "bad", "suggestion"),
    [
        ("size=huge", "'huge'", "125m, 360m, 760m, tiny"),
        ("model=fot-pro", "'fot-pro'", "did you mean fot_pro"),
        ("model=fot_pro,transformr_pro", "'transformr_pro'", "did you mean transformer_pro"),
        ("experiment=fot_pro_125m", "'fot_pro_125m'", "did you mean fot_pro_125m_2b"),
    ],
)
def test_unknown_group_option_lists_the_options(
    hydra_ctx, override: str, bad: str, suggestion: str
) -> None:
    from fot.training.config import unknown_group_option

    message = unknown_group_option(override, CONFIGS)
    assert message is not None and bad in message and suggestion in message
    with pytest.raises((MissingConfigException, ConfigCompositionException)):
        compose("train", overrides=[override])  # Hydra refuses it too (without the options)


@pytest.mark.parametrize(
    "override",
    ["size=tiny", "model=fot_pro,transformer_pro", "experiment=null", "parallel=fsdp",
     "model=glob(fot_*)", "total_tokens=4096", "seed=3", "+model.overrides.num_heads=2"],
)  # fmt: skip
def test_known_group_options_and_sweeps_pass(override: str) -> None:
    from fot.training.config import unknown_group_option

    assert unknown_group_option(override, CONFIGS) is None


def test_train_py_names_a_bad_key_or_option_in_one_line_with_status_2(tmp_path) -> None:
    for arg, expected in (
        ("total_token=5", "train.py: error: unknown config key 'total_token'"),
        ("size=huge", "train.py: error: unknown size option 'huge'"),
        ("+optim.lrr=1", "train.py: error: unknown config key 'optim.lrr'"),  # trained at lr
    ):
        stderr = _train_py_refuses(tmp_path, arg)
        assert stderr.startswith(expected), stderr


def test_train_py_refuses_a_typo_without_importing_torch_or_the_fot_package(tmp_path) -> None:
    """The command-line checks run before ``import fot`` (torch and transformers, ~7 s): Python's
    own import log (``-X importtime``) must name neither, nor the fot package."""
    res = subprocess.run(
        [sys.executable, "-X", "importtime", str(CONFIGS.parent / "train.py"), "total_token=5",
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert "train.py: error: unknown config key 'total_token'" in res.stderr
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in res.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "omegaconf" in imported  # the log is read right: the checks' own imports are in it
    assert not imported & {"torch", "transformers", "fot", "fot.training"}


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("+total_tokens=4096", "total_tokens", 4096),
        ("+data.seq_len=128", "data.seq_len", 128),
        ("model.overrides.hidden_size=256", "model.overrides.hidden_size", 256),
        ("model.overrides={hidden_size:256}", "model.overrides", {"hidden_size": 256}),
        ("data.storage_options.token=anon", "data.storage_options.token", "anon"),
        ("+experiment=fot_pro_125m_2b", "data.kind", "longcrawl64"),
        ("+model=fot_llama", "model.name", "fot_llama"),
    ],
)
def test_a_misprefixed_override_is_named_with_the_form_hydra_takes(
    hydra_ctx, override: str, key: str, value: object
) -> None:
    """`+total_tokens=...` (a plus on a field the config has) and `model.overrides.<field>=...`
    (no plus on a key of an empty dict) stopped with Hydra's several-line message and exit
    status 1 (found writing the README's `+model.overrides.fgate_bias_init=5` without its +).
    The oracle is Hydra: it refuses the override as given and takes each form named."""
    from omegaconf import OmegaConf

    from fot.training.config import misprefixed_override

    with pytest.raises(ConfigCompositionException):
        compose("train", overrides=[override])
    message = misprefixed_override(["size=tiny", override, "total_tokens=8192"], CONFIGS)
    assert message is not None and message.startswith(f"{override!r}: ")
    suggested = re.findall(r"write (\S+)(?: \(or (\S+),)?", message)
    assert len(suggested) == 1, message
    for form in filter(None, suggested[0]):
        cfg = compose("train", overrides=[form])
        assert OmegaConf.select(cfg, key) == value, form
        assert misprefixed_override([form], CONFIGS) is None


def test_prefixes_that_fit_are_left_alone(hydra_ctx) -> None:
    from fot.training.config import misprefixed_override

    fitting = ["+model.overrides.fgate_bias_init=5", "++total_tokens=4096", "total_tokens=4096",
               "+model.overrides={hidden_size:256}",  # Hydra merges it into the empty dict
               "model.overrides={}", "++data.storage_options={token:anon}",
               "~wandb.name", "-m", "model=fot_llama", "experiment=fot_pro_125m_2b"]  # fmt: skip
    assert misprefixed_override(fitting, CONFIGS) is None
    for override in fitting:
        if not override.startswith(("-", "~")):  # (~ of a null field: Hydra refuses it)
            compose("train", overrides=[override])  # and Hydra takes each
    # a key of model.overrides set by another override of the same command line exists
    assert misprefixed_override(["++model.overrides={a:1}", "model.overrides.a=2"]) is None


@contextlib.contextmanager
def _hydra_on(configs: Path) -> Iterator[None]:
    """Hydra's compose on the config folder ``configs``, also inside ``hydra_ctx`` (a module
    fixture on ``CONFIGS``, which is restored afterwards)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    outer = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
            yield
    finally:
        restore_gh_from_backup(outer)


@pytest.mark.parametrize("where", ["experiment", "model"])
def test_a_key_that_a_chosen_config_file_sets_takes_no_plus(tmp_path, where: str) -> None:
    """A user's experiment (or model file) that sets ``model.overrides.qk_norm``: a plain
    ``model.overrides.qk_norm=...`` then replaces it, and Hydra takes it (it refuses ``+``); a
    key no chosen file sets still needs ``+``. The oracle is Hydra composing each."""
    import shutil

    from fot.training.config import misprefixed_override

    configs = tmp_path / "configs"
    shutil.copytree(CONFIGS, configs)
    if where == "experiment":  # its defaults list chooses the model
        (configs / "experiment" / "mine.yaml").write_text(
            "# @package _global_\ndefaults:\n  - override /model: fot_llama\n"
            "model:\n  overrides:\n    qk_norm: true\n"
        )
        choice = "experiment=mine"
    else:
        (configs / "model" / "mine.yaml").write_text(
            "name: fot_llama\noverrides:\n  qk_norm: true\n"
        )
        choice = "model=mine"
    valid = [choice, "model.overrides.qk_norm=false"]
    invalid = [choice, "model.overrides.num_heads=2"]
    assert misprefixed_override(valid, configs) is None
    assert "write +model.overrides.num_heads=2" in misprefixed_override(invalid, configs)
    # not chosen: the key is not there, and the plain form is refused as before
    assert misprefixed_override(valid[1:], configs) is not None
    with _hydra_on(configs):
        cfg = compose("train", overrides=valid)
        assert cfg.model.name == "fot_llama" and cfg.model.overrides.qk_norm is False
        with pytest.raises(ConfigCompositionException):
            compose("train", overrides=invalid)
        with pytest.raises(ConfigCompositionException):
            compose("train", overrides=[choice, "+model.overrides.qk_norm=false"])
        with pytest.raises(ConfigCompositionException):
            compose("train", overrides=valid[1:])


def test_train_py_names_a_misprefixed_override_in_one_line(tmp_path) -> None:
    assert _train_py_refuses(tmp_path, "model.overrides.num_heads=2") == (
        "train.py: error: 'model.overrides.num_heads=2': model.overrides holds only the keys "
        "added to it, so model.overrides.num_heads is added with +: write "
        "+model.overrides.num_heads=2 (or ++model.overrides.num_heads=2, which adds or "
        "replaces)\n"
    )


def test_train_py_names_an_unparsable_override_and_its_quoted_form(hydra_ctx, tmp_path) -> None:
    """A split slice as the trainer's no-validation warning suggests it (``train[:1%]``) is no
    valid Hydra override unquoted: Hydra alone says only ``mismatched input '['``."""
    stderr = _train_py_refuses(tmp_path, "data=hf", "data.hf_val_split=train[:1%]")
    assert stderr.startswith(
        "train.py: error: cannot read the override 'data.hf_val_split=train[:1%]'"
    ), stderr
    assert len(stderr.strip().splitlines()) == 1, stderr  # no traceback
    suggested = re.search(r"e\.g\. '([^']+)'", stderr).group(1)
    assert suggested == 'data.hf_val_split="train[:1%]"'
    # the suggested form is what Hydra reads as the intended value
    cfg = compose("train", overrides=["data=hf", suggested])
    assert cfg.data.hf_val_split == "train[:1%]"


@pytest.mark.parametrize(
    "value", ["train[1%:]", "it's", "bob's[run]", 'a"b[', """it's "x"[""", "a b=(c)"]
)
def test_unparsable_override_suggests_what_the_shell_and_hydra_read_as_the_value(value) -> None:
    """The suggested form, typed at a shell, reaches Hydra as one argument that it reads as the
    value meant: quotes in the value (an apostrophe) no longer break the suggestion's shell
    quoting or stand in for it with '...'."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    message = unparsable_override([f"wandb.name={value}"])
    assert message is not None
    typed = re.search(r"e\.g\. (.+) \(https://hydra", message).group(1)
    (arg,) = shlex.split(typed)  # one argument, as the shell passes it
    assert OverridesParser.create().parse_overrides([arg])[0].value() == value


@pytest.mark.parametrize(
    ("override", "kind"),
    [("total_tokens=1k", "a whole number"), ("parallel.compile=maybe", "true or false"),
     ("micro_batch_size=2.5", "a whole number"), ("optim.betas=0.9", "a list"),
     ("data.seq_len=null", "a whole number (not null)"), ("peak_flops=fast", "a number"),
     ("parallel.timeout_s=soon", "a number"), ("parallel.timeout_s=true", "a number")],
)  # fmt: skip
def test_mistyped_value_is_named_with_the_type_it_needs(hydra_ctx, override, kind) -> None:
    message = mistyped_override([override])
    assert message is not None and message.startswith(f"{override!r}: "), message
    key = override.split("=")[0]
    assert f"; {key} takes {kind}" in message
    with pytest.raises(ConfigCompositionException):  # Hydra refuses it too (exit status 1)
        compose("train", overrides=[override])


@pytest.mark.parametrize(
    "override",
    ["total_tokens=4096", "optim.betas=[0.9,0.99]", "peak_flops=1e15", "data.path=123",
     "model=fot_pro", "data=tokens", "++model.overrides={hidden_size:32}", "seed=1,2",
     "+model.overrides.fgate_bias_init=5", "global_batch_tokens=${data.seq_len}",
     "out_dir=null", "data.hf_split=\"train[1%:]\""],
)  # fmt: skip
def test_well_typed_values_pass_the_type_check(hydra_ctx, override) -> None:
    assert mistyped_override([override]) is None
    if override != "seed=1,2":  # a sweep needs -m
        compose("train", overrides=[override])  # and Hydra accepts it


@pytest.mark.parametrize(
    ("override", "bad"),
    [("++total_tokens=1k", "total_tokens=1k"), ("total_tokens=4096,1k", "total_tokens=1k"),
     ("parallel.compile=choice(true,maybe)", "parallel.compile=maybe")],
)  # fmt: skip
def test_mistyped_value_of_a_forced_override_or_a_sweep_is_named(hydra_ctx, override, bad):
    """``++key=value`` sets an existing field as ``key=value`` does, and each value of a
    choice sweep (``-m``) becomes one job's: a value of the wrong type there is named too
    (it was Hydra's four-line error, for a sweep only once its job started)."""
    message = mistyped_override([override])
    key = bad.split("=")[0]
    assert message is not None and message.startswith(f"{override!r}: "), message
    assert f"; {key} takes " in message
    with pytest.raises(ConfigCompositionException):  # Hydra refuses it (or that job's value)
        compose("train", overrides=[override if override.startswith("++") else bad])


@pytest.mark.parametrize(
    "override",
    ["++total_tokens=4096", "total_tokens=4096,8192", "optim.lr=choice(1e-3,${optim.eps})",
     "total_tokens=range(4096,16384,4096)", "optim.betas=[0.9,0.95],[0.8,0.9]"],
)  # fmt: skip
def test_well_typed_forced_overrides_and_sweeps_pass_the_type_check(hydra_ctx, override):
    assert mistyped_override([override]) is None
    if override.startswith("++"):
        compose("train", overrides=[override])  # Hydra accepts it


def test_a_dict_field_set_to_something_else_is_named_with_the_quoted_form(
    hydra_ctx, tmp_path
) -> None:
    """``++model.overrides=use_output_gate:false`` (no braces) and the two words the shell
    makes of an unquoted ``++model.overrides={a:1,b:2}`` were Hydra's four-line "Cannot assign
    str to Dict[str, Any]" with status 1. The suggested forms compose to the settings meant."""
    message = non_dict_override(["++model.overrides=use_output_gate:false"])
    assert message == (
        "++model.overrides=use_output_gate:false: model.overrides takes a dict of settings; "
        "write '++model.overrides={use_output_gate:false}', or one setting per override, "
        "++model.overrides.use_output_gate=false"
    )
    split = ["++model.overrides=decay_time_min:64", "++model.overrides=decay_time_max:128"]
    assert non_dict_override(["model=fot_pro_fixed", *split]) == (
        f"{' '.join(split)}: model.overrides takes a dict of settings; the shell splits an "
        "unquoted {a:1,b:2} into one word per setting (brace expansion), so quote it: write "
        "'++model.overrides={decay_time_min:64,decay_time_max:128}', or one setting per "
        "override, ++model.overrides.decay_time_min=64"
    )
    assert non_dict_override(["data.storage_options=5"]) == (
        "'data.storage_options=5': data.storage_options takes a dict of settings, e.g. "
        "'++data.storage_options={name:value}' (quoted) or ++data.storage_options.name=value; "
        "{} for none"
    )
    assert non_dict_override(["model.overrides=null"]).startswith(
        "'model.overrides=null': model.overrides takes a dict of settings"
    )
    for bad in (["++model.overrides=use_output_gate:false"], split, ["model.overrides=null"]):
        with pytest.raises(ConfigCompositionException):  # Hydra refuses them (exit status 1)
            compose("train", overrides=bad)
    for good in (["++model.overrides={decay_time_min:64,decay_time_max:128}"],
                 ["++model.overrides.use_output_gate=false"], ["++model.overrides={}"],
                 ["model=fot_pro"]):  # fmt: skip
        assert non_dict_override(good) is None, good
        compose("train", overrides=good)
    cfg = compose("train", overrides=["++model.overrides={decay_time_min:64,decay_time_max:128}"])
    assert dict(cfg.model.overrides) == {"decay_time_min": 64, "decay_time_max": 128}
    assert _train_py_refuses(tmp_path, "++model.overrides=use_output_gate:false") == (
        f"train.py: error: {message}\n"
    )


def test_train_py_names_a_mistyped_value_in_one_line_with_status_2(tmp_path) -> None:
    assert _train_py_refuses(tmp_path, "total_tokens=1k").strip().splitlines() == [
        "train.py: error: 'total_tokens=1k': Value '1k' of type 'str' could not be converted "
        "to Integer; total_tokens takes a whole number (not null)"
    ]


def test_hydra_run_dir_follows_out_dir(hydra_ctx, tmp_path) -> None:
    """With out_dir=..., Hydra's own files (.hydra/, train.log) go into the run folder, not into
    a second timestamped folder under the current directory."""
    cfg = compose("train", overrides=[f"out_dir={tmp_path}"], return_hydra_config=True)
    assert cfg.hydra.run.dir == str(tmp_path)
    cfg = compose("train", return_hydra_config=True)
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d", cfg.hydra.run.dir)


def test_runs_started_in_the_same_second_get_a_folder_each(hydra_ctx, tmp_path, monkeypatch):
    """Hydra names the default folder to the second: train.py makes it before Hydra starts,
    and the next run of that second gets ``<time>-1`` (it used to share the folder, write its
    .hydra/ over the first run's and be refused by the run-folder lock)."""
    import datetime

    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    now = datetime.datetime(2026, 11, 28, 9, 5, 7)
    folders = [claim_default_folder(["seed=1"], now, world_size=1) for _ in range(3)]
    want = ["outputs/2026-11-28/09-05-07", *(f"outputs/2026-11-28/09-05-07-{n}" for n in (1, 2))]
    assert [f[1] for f in folders] == want and all(Path(w).is_dir() for w in want)
    # Hydra takes the override; an out_dir (given in a config file, say) still wins
    for out_dir, run_dir in ((None, want[1]), (str(tmp_path / "mine"), str(tmp_path / "mine"))):
        extra = [f"out_dir={out_dir}"] if out_dir else []
        cfg = compose("train", overrides=[folders[1][0], *extra], return_hydra_config=True)
        assert OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"] == run_dir
    assert not any(f[2] for f in folders)  # not temporary
    claimed = claim_default_folder(["-m", "seed=1,2"], now, world_size=1)
    assert claimed == ("hydra.sweep.dir=multirun/2026-11-28/09-05-07", claimed[1], False)
    # where the command line or Hydra chooses: nothing is made
    for argv in (["out_dir=x"], ["hydra.run.dir=x"], ["-m", "hydra.sweep.dir=x"],
                 ["--cfg", "job"], ["--help"], ["--config-dir", "mine"]):  # fmt: skip
        for world, rank in ((1, 0), (2, 0), (2, 1)):
            assert claim_default_folder(argv, now, world_size=world, rank=rank) is None, argv
    # of several processes, rank 0 claims the folder (the trainer gives it to every rank); the
    # others' Hydra writes into a temporary folder, which train.py removes at the end (Hydra's
    # own, named by each process's start, left an empty one when a rank started a second later)
    rank0 = claim_default_folder(["seed=1"], now, world_size=2, rank=0)
    assert rank0[1:] == ("outputs/2026-11-28/09-05-07-3", False)
    for argv, key in ((["seed=1"], "run"), (["-m", "seed=1,2"], "sweep")):
        override, folder, temporary = claim_default_folder(argv, now, world_size=2, rank=1)
        assert temporary and Path(folder).is_dir() and not Path(folder).is_relative_to(tmp_path)
        cfg = compose("train", overrides=[override], return_hydra_config=True)
        assert OmegaConf.select(cfg, f"hydra.{key}.dir") == folder
        Path(folder).rmdir()
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/*/*"))
    assert made == ["multirun/2026-11-28/09-05-07", *want, f"{want[0]}-3"]


def test_a_default_folder_is_made_when_its_date_folder_goes_meanwhile(tmp_path, monkeypatch):
    """A refused run removes the empty ``outputs/<date>/`` it made (train.py): where that
    happened between this run's making the date folder and its time folder, the run stopped
    with a FileNotFoundError. It makes the date folder again."""
    import datetime

    monkeypatch.chdir(tmp_path)
    date = Path("outputs/2026-11-28")
    mkdir = Path.mkdir

    def racing_mkdir(self, *args, **kwargs):
        mkdir(self, *args, **kwargs)
        if self == date and not removed:  # the other run's cleanup, right after
            removed.append(self)
            self.rmdir()

    removed: list[Path] = []
    monkeypatch.setattr(Path, "mkdir", racing_mkdir)
    now = datetime.datetime(2026, 11, 28, 9, 5, 7)
    claimed = claim_default_folder(["seed=1"], now, world_size=1)
    assert removed and claimed[1] == "outputs/2026-11-28/09-05-07" and Path(claimed[1]).is_dir()


def test_a_gate_initialisation_the_model_does_not_read_is_refused() -> None:
    """``+model.overrides.fgate_bias_init=5`` on a fixed or bias-only gate (in an ablation sweep
    over the gate types, say) was stored in config.json and ignored: the gates kept their
    long-init biases."""
    for model, field, value in (
        ("fot_pro_fixed", "fgate_bias_init", 5.0),
        ("fot_llama_bias_only", "fgate_bias_init", 5.0),
        ("fot_pro", "decay_time_min", 4.0),
        ("transformer_llama", "fgate_bias_init", 5.0),
    ):
        with pytest.raises(
            ValueError, match=rf"^model '{model}' has .*{field}={value}: .*leave it"
        ):
            presets.config(model, "tiny", **{field: value})
    # where the gate reads it, the field takes effect
    assert presets.config("fot_pro", "tiny", fgate_bias_init=5.0).fgate_bias_init == 5.0
    fixed = presets.config("fot_pro_fixed", "tiny", decay_time_max=100.0)
    assert fixed.decay_time_max == 100.0
    # also when the override itself switches the gate type
    assert presets.config("fot_pro", "tiny", fgate_type="fixed", decay_time_min=4.0).fgate_type


def _unchecked_logits(preset: str, **fields: object) -> torch.Tensor:
    """Logits of the tiny ``preset`` model with ``fields`` set on its config, built without
    FoTConfig's check of fields the model does not read (the model that would be trained)."""
    import torch

    from fot import FoTConfig, FoTForCausalLM

    torch.manual_seed(0)
    # FoTConfig refuses them too: unchecked here, to build the model that would be trained
    with mock.patch("fot.models.configuration_fot.unread_switch_field", lambda c: None):
        cfg = FoTConfig(**presets.config(preset, "tiny").to_dict() | fields)
        model = FoTForCausalLM(cfg)
    return model(torch.arange(16).view(1, 16)).logits


def test_an_override_the_model_does_not_read_is_refused() -> None:
    """``+model.overrides.rope_theta=...`` on a model without RoPE (fot_pro in a sweep over
    model=fot_pro,transformer_pro, say), or hidden_ratio given with intermediate_size, was
    stored in config.json and ignored: the model is the one built without it. Refused now,
    naming the field and the fix; where the model reads the field it takes effect."""
    import torch

    from fot import FoTConfig

    logits = functools.partial(_unchecked_logits, "fot_pro")

    # the oracle: built directly, the field changes nothing
    assert torch.equal(logits(rope_theta=10_000.0), logits())
    assert FoTConfig(intermediate_size=300, hidden_ratio=3.0).mlp_size == 300
    for model, fields, pattern in (
        ("fot_pro", {"rope_theta": 10_000.0}, r"has no RoPE \(use_rope=False\), so it does not "
         r"read rope_theta=10000\.0: leave it out for this model, or set use_rope=true"),
        ("transformer_llama", {"use_rope": False, "rope_theta": 10_000.0}, r"has no RoPE"),
        ("fot_pro", {"intermediate_size": 300, "hidden_ratio": 3.0}, r"gets intermediate_size="
         r"300, which sets the MLP width, so it does not read hidden_ratio=3\.0: give only one"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=rf"^model '{model}' {pattern}"):
            presets.config(model, "tiny", **fields)
    # where the model reads it, the field takes effect
    assert presets.config("transformer_llama", "tiny", rope_theta=10_000.0).rope_theta == 10_000
    assert presets.config("fot_pro", "tiny", use_rope=True, rope_theta=10_000.0).use_rope
    assert presets.config("fot_pro", "tiny", rope_theta=500_000.0)  # the default: no change
    assert presets.config("fot_pro", "tiny", intermediate_size=300).mlp_size == 300
    assert presets.config("fot_pro", "tiny", hidden_ratio=3.0).mlp_size == 256


def test_a_qk_norm_eps_on_a_model_without_qk_norm_is_refused() -> None:
    """``+model.overrides.qk_norm_eps=...`` on a model without QK-norm (fot_llama in a sweep
    over model=fot_pro,fot_llama, say) trained the model built without it, the field stored in
    config.json and ignored. Refused now, as a RoPE base without RoPE is; where the model has
    a QK-norm the field takes effect, and its default passes (every config.json has it)."""
    import torch

    logits = functools.partial(_unchecked_logits, "fot_llama")

    # the oracle: built directly, the field changes nothing without QK-norm, and does with it
    assert torch.equal(logits(qk_norm_eps=10.0), logits())
    assert not torch.equal(logits(qk_norm=True, qk_norm_eps=10.0), logits(qk_norm=True))
    for model, fields in (
        ("fot_llama", {"qk_norm_eps": 1e-3}),
        ("transformer_llama", {"qk_norm_eps": 1e-3}),
        ("fot_pro", {"qk_norm": False, "qk_norm_eps": 1e-3}),
    ):
        with pytest.raises(
            ValueError,
            match=rf"^model '{model}' has no QK-norm \(qk_norm=False\), so it does not read "
            r"qk_norm_eps=0\.001: leave it out for this model, or set qk_norm=true",
        ):
            presets.config(model, "tiny", **fields)
    assert presets.config("fot_pro", "tiny", qk_norm_eps=1e-3).qk_norm_eps == 1e-3
    assert presets.config("fot_llama", "tiny", qk_norm=True, qk_norm_eps=1e-3).qk_norm
    assert presets.config("fot_llama", "tiny", qk_norm_eps=1e-5)  # the default: no change
    # a run an older fot started with it reads its checkpoints without it
    assert presets.read_overrides("fot_llama", "tiny", {"qk_norm_eps": 1e-3}) == {}


def test_fotconfig_refuses_a_gate_initialisation_its_gate_does_not_read(tmp_path) -> None:
    """FoTConfig itself (the Python API, a config.json) refuses what presets.config refuses; a
    saved config, which carries every gate field at its default, loads for each gate type."""
    import json

    from fot import FoTConfig

    for gate, field, value in (
        ("fixed", "fgate_bias_init", 5.0),
        ("bias_only", "fgate_bias_init", -1.0),
        ("full", "decay_time_min", 4.0),
        ("none", "decay_time_max", 100.0),
    ):
        with pytest.raises(ValueError, match=rf"^FoTConfig has .*{field}={value}: .*leave it"):
            FoTConfig(fgate_type=gate, **{field: value})
    for gate in ("full", "bias_only", "fixed", "none"):
        saved = FoTConfig(fgate_type=gate, use_rope=gate == "none").to_dict()
        assert {"fgate_bias_init", "decay_time_min", "decay_time_max"} <= saved.keys()
        (tmp_path / "config.json").write_text(json.dumps(saved))
        assert FoTConfig.from_pretrained(tmp_path).to_dict() == saved
    # a config.json (edited by hand, say) with such a field, or an override switching the gate
    (tmp_path / "config.json").write_text(json.dumps({**saved, "fgate_bias_init": 5.0}))
    with pytest.raises(ValueError, match=r"fgate_type='none'.*fgate_bias_init=5\.0"):
        FoTConfig.from_pretrained(tmp_path)
    full = FoTConfig(fgate_bias_init=5.0)
    with pytest.raises(ValueError, match=r"fgate_type='fixed'.*fgate_bias_init=5\.0"):
        FoTConfig.from_dict(full.to_dict(), fgate_type="fixed")
    assert FoTConfig(fgate_type="fixed", decay_time_min=4.0).decay_time_min == 4.0


def test_fotconfig_refuses_a_rope_theta_or_qk_norm_eps_its_model_does_not_read(tmp_path) -> None:
    """FoTConfig(rope_theta=...) without RoPE and FoTConfig(qk_norm_eps=...) without QK-norm
    were stored and ignored (train.py refused them); FoTConfig refuses them now, naming the
    switch. A folder an older fot exported still loads as the same model: its config.json may
    lack qk_norm_eps (before the field) or hold a RoPE base without RoPE (a run started with
    one before train.py refused it); so does a paper FoX config with a rope_base."""
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fot import FoTConfig
    from fot.convert import fot_config_from_paper

    for fields, switch in (
        ({"rope_theta": 10_000.0}, "use_rope"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "use_rope"),
        ({"qk_norm_eps": 1e-3}, "qk_norm"),
    ):
        with pytest.raises(ValueError, match=rf"^FoTConfig has no .*\({switch}=False\), so it "
                           rf"does not read .*set {switch}=True as well"):  # fmt: skip
            FoTConfig(hidden_size=64, num_heads=4, **fields)
    both = {"use_rope": True, "rope_theta": 1e4, "qk_norm": True, "qk_norm_eps": 1e-3}
    assert FoTConfig(**both).rope_theta == 1e4 and FoTConfig(**both).qk_norm_eps == 1e-3
    assert FoTConfig(rope_theta=500_000.0, qk_norm_eps=1e-5)  # the defaults: as saved

    torch.manual_seed(0)
    cfg = presets.config("fot_llama", "tiny", vocab_size=300, bos_token_id=None, eos_token_id=None)
    model = presets.build_model(cfg).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["use_rope"] is False and saved["qk_norm"] is False
    old = {k: v for k, v in saved.items() if k != "qk_norm_eps"} | {"rope_theta": 10_000.0}
    (tmp_path / "config.json").write_text(json.dumps(old))
    x = torch.arange(12).view(1, 12)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded(x).logits, model(x).logits)
    for load in (FoTConfig.from_pretrained, AutoConfig.from_pretrained):
        got = load(tmp_path).to_dict()
        assert (got["rope_theta"], got["qk_norm_eps"]) == (500_000.0, 1e-5)  # as saved now
        assert {k: got.get(k) for k in saved} == saved
        assert load(tmp_path, use_rope=True).rope_theta == 10_000.0  # read now: kept
        with pytest.raises(ValueError, match=r"does not read qk_norm_eps=0\.001"):
            load(tmp_path, qk_norm_eps=1e-3)  # given now, not an older fot's
    paper = json.loads((CONFIGS.parent / "tests/paper_checkpoints/fox_pro/config.json").read_text())
    paper |= {"use_rope": False, "rope_base": 10_000.0}
    assert fot_config_from_paper(paper).rope_theta == 500_000.0
    assert fot_config_from_paper({**paper, "use_rope": True}).rope_theta == 10_000.0


def test_the_export_records_the_text_escaping_of_the_data(hydra_ctx) -> None:
    """LongCrawl64 read through data=tokens (as the token-folder error suggests for one of its
    arrays) was exported as plain text: fot.eval then fed the model unescaped prompts."""
    from fot.training.trainer import export_settings

    cases = [
        (["data=longcrawl64"], "json"),
        (["data=tokens", "data.path=lc/train.zarr"], "none"),
        (["data=tokens", "data.path=lc/train.zarr", "data.text_escaping=json"], "json"),
        (["data=longcrawl64", "data.text_escaping=none"], "none"),
        (["data=sample"], "none"),
    ]
    for overrides, escaping in cases:
        cfg = compose("train", overrides=overrides)
        assert export_settings(cfg) == (cfg.data.seq_len, escaping), overrides
    # the saved config of a run from before data.text_escaping existed
    old = OmegaConf.to_container(compose("train", overrides=["data=longcrawl64"]))
    del old["data"]["text_escaping"]
    assert export_settings(OmegaConf.create(old))[1] == "json"


def test_a_gated_model_with_a_head_width_the_kernels_lack_is_refused_before_the_run(
    hydra_ctx, monkeypatch
) -> None:
    """Where the Triton kernels serve the attention (a GPU; the interpreter here), hidden 1536
    with 16 heads trained until the first forward failed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    bad = ["model=fot_pro", "size=760m", "+model.overrides.num_heads=16"]
    with pytest.raises(ValueError, match=r"^model=fot_pro size=760m: head_dim 96 \(hidden"):
        check_config(compose("train", overrides=bad))
    check_config(compose("train", overrides=[*bad, "+model.overrides.attn_backend=reference"]))
    # an ungated model's whole causal sequences go to SDPA, which runs any width; packed
    # documents (varlen) and windows go to the kernels
    plain = ["model=transformer_llama", "size=760m", "+model.overrides.num_heads=16"]
    check_config(compose("train", overrides=[*plain, "data.packing=causal"]))
    for more in (
        ["data.packing=varlen"],
        ["data.packing=causal", "+model.overrides.window_size=64"],
    ):
        with pytest.raises(ValueError, match=r"^model=transformer_llama size=760m: head_dim 96"):
            check_config(compose("train", overrides=[*plain, *more]))
    monkeypatch.delenv("TRITON_INTERPRET")  # the CPU path: PyTorch's attention runs any width
    check_config(compose("train", overrides=[*bad, "device=cpu"]))


def test_the_head_width_check_follows_the_batches_the_data_feeds(
    hydra_ctx, monkeypatch, tmp_path
) -> None:
    """An ungated model with a width the kernels lack trains through SDPA on whole causal
    sequences. data.packing=varlen (the default of data=tokens) on a zarr array yields none
    (its rows hold no documents): that run was refused as if it fed the kernels packed
    documents. Oracle: whether the sources built from the config yield cu_seqlens."""
    from fot.data.loaders import build_sources
    from fot.data.streams import iterate_eval_batches
    from fot.data.tokens import write_token_documents

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # not on_cpu: as on a GPU
    rows = np.arange(4 * 64, dtype=np.uint16).reshape(4, 64)
    for name in ("rows.zarr", "lc/train.zarr", "lc/heldout.zarr"):
        new_array(str(tmp_path / name), shape=rows.shape, dtype=rows.dtype)[:] = rows
    write_token_documents(tmp_path / "folder", [np.arange(40), np.arange(30)])
    plain = ["model=transformer_llama", "size=760m", "+model.overrides.num_heads=16"]
    cases = {
        "zarr": ["data=tokens", f"data.path={tmp_path / 'rows.zarr'}"],
        "longcrawl64": ["data=longcrawl64", f"data.path={tmp_path / 'lc'}", "data.packing=varlen"],
        "folder": ["data=tokens", f"data.path={tmp_path / 'folder'}"],
        "zarr, folder held out": [
            "data=tokens",
            f"data.path={tmp_path / 'rows.zarr'}",
            f"data.val_path={tmp_path / 'folder'}",
        ],
        "sample": ["data=sample"],
    }
    refused = {}
    for case, data in cases.items():
        cfg = compose("train", overrides=[*plain, *data, "data.seq_len=16", "data.val_tokens=32"])
        assert cfg.data.packing == "varlen", case
        try:
            check_config(cfg)
            refused[case] = False
        except ValueError as err:
            assert re.match(r"model=transformer_llama size=760m: head_dim 96 \(hidden", str(err))
            refused[case] = True
        batches = [
            next(iterate_eval_batches(s, num_sequences=1, micro_batch_size=1))
            for s in build_sources(cfg.data)
            if s is not None
        ]
        assert refused[case] == any(b.cu_seqlens is not None for b in batches), case
    assert refused == {
        "zarr": False,
        "longcrawl64": False,
        "folder": True,
        "zarr, folder held out": True,
        "sample": True,
    }


def test_a_small_vocabulary_trains_from_a_flat_file_of_its_own_ids(hydra_ctx, tmp_path) -> None:
    """A flat .npy/.bin file is read as it is (no <|endoftext|> inserted): another
    tokenizer's ids train there with its vocab_size; other data kinds insert id 50256."""
    small = ["+model.overrides.vocab_size=32000", "data=tokens", "data.doc_start_id=1"]
    for name in ("ids.npy", "ids.bin"):
        path = f"data.path={tmp_path / name}"
        check_config(compose("train", overrides=[*small, path]))
        check_config(compose("train", overrides=[*small, path, f"data.val_path={tmp_path / name}"]))
        held_out = [*small, path, f"data.val_path={tmp_path / 'folder'}", "data.val_tokens=64"]
        with pytest.raises(ValueError, match=r"vocab_size=32000 leaves out .* data=tokens puts"):
            check_config(compose("train", overrides=held_out))  # a token folder's inserted
    with pytest.raises(ValueError, match=r"vocab_size=32000 leaves out .* data=tokens puts"):
        check_config(compose("train", overrides=[*small, f"data.path={tmp_path / 'folder'}"]))


def test_flat_files_of_another_tokenizer_put_document_boundaries_at_its_doc_start_id(
    hydra_ctx, tmp_path
) -> None:
    """varlen packing of a flat file put a boundary at every 50256 whatever the tokenizer
    (helper-176): in Llama 3's ids, whose documents start with 128000, the documents attended
    to each other and one was cut at its ordinary token 50256. data.doc_start_id names the id;
    without it such a vocabulary is refused with varlen packing. Oracle: the positions of the
    BOS written before each document, and the row starts."""
    from fot.data.loaders import build_sources
    from fot.data.streams import iterate_eval_batches

    bos = 128000
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 128000, size=n) for n in (20, 7, 33, 12, 25)]
    docs[2][5] = 50256  # an ordinary token of this vocabulary
    flat = np.concatenate([np.concatenate([[bos], d]) for d in docs]).astype(np.uint32)
    np.save(tmp_path / "ids.npy", flat)
    base = ["data=tokens", f"data.path={tmp_path / 'ids.npy'}", "data.seq_len=16",
            "+model.overrides.vocab_size=128256"]  # fmt: skip
    with pytest.raises(ValueError) as err:
        check_config(compose("train", overrides=base))
    assert str(err.value).startswith(
        "data.packing=varlen starts a document at every <|endoftext|> (GPT-2's id 50256) of a "
        "flat token file, but the model's vocab_size=128256 is not GPT-2's (50257)"
    ), err.value
    check_config(compose("train", overrides=[*base, "data.packing=causal"]))
    cfg = compose("train", overrides=[*base, f"data.doc_start_id={bos}"])
    check_config(cfg)
    source, _ = build_sources(cfg.data)
    (batch,) = iterate_eval_batches(source, num_sequences=6, micro_batch_size=6)
    ids = batch.input_ids.reshape(-1).numpy()
    starts = sorted(set(np.flatnonzero(ids == bos)) | set(range(0, ids.size, 16)))
    assert batch.cu_seqlens.tolist() == [*starts, ids.size]
    assert 50256 in ids and bos in ids
    for bad, message in (
        ("data.doc_start_id=128256", r"data.doc_start_id=128256 is no id of the model's vocab"),
        ("data.doc_start_id=-1", r"data.doc_start_id=-1 is no id"),
    ):
        with pytest.raises(ValueError, match=message):
            check_config(compose("train", overrides=[*base, bad]))
    with pytest.raises(ValueError, match=r"data.doc_start_id=5 is read from flat .*: leave it out"):
        check_config(compose("train", overrides=["data.doc_start_id=5"]))  # the sample corpus


def test_from_json_file_reads_an_older_config_json_as_from_pretrained_does(tmp_path) -> None:
    """A config.json an older fot wrote may hold a RoPE base without RoPE or a qk_norm_eps
    without QK-norm (stored unread): from_pretrained loads it as the same model, but
    FoTConfig.from_json_file refused it. Both read it alike now; a value the model reads stays
    (use_rope=True with its rope_theta)."""
    import json

    from fot import FoTConfig

    saved = FoTConfig(hidden_size=64, num_heads=4, num_hidden_layers=1).to_dict()
    for extra, kept in (
        ({"rope_theta": 10_000.0, "qk_norm_eps": 1e-3}, (500_000.0, 1e-5)),
        ({"use_rope": True, "rope_theta": 10_000.0}, (10_000.0, 1e-5)),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**saved, **extra}))
        from_file = FoTConfig.from_json_file(tmp_path / "config.json")
        assert (from_file.rope_theta, from_file.qk_norm_eps) == kept
        assert from_file.to_dict() == FoTConfig.from_pretrained(tmp_path).to_dict()
