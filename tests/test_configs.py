"""Hydra configs: every group option and experiment composes; one source of truth for models."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException

from fot import presets
from fot.training.config import register_configs
from fot.training.trainer import check_sizes, model_config_from_train_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
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
    want = {
        f"{m}_{s}"
        for m in ("fot_pro", "fot_llama", "transformer_pro", "transformer_llama")
        for s in ("125m_2b", "360m_7b", "760m_16b", "760m_48b")
    }
    assert want <= set(EXPERIMENTS)


def test_every_model_and_size_matches_presets(hydra_ctx) -> None:
    for model in _options("model"):
        for size in _options("size"):
            cfg = compose("train", overrides=[f"model={model}", f"size={size}"])
            built = model_config_from_train_config(cfg)
            assert built.to_dict() == presets.config(model, size).to_dict(), (model, size)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_with_paper_defaults(hydra_ctx, name: str) -> None:
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
    tokens = {"125m_2b": 2.5, "360m_7b": 7, "760m_16b": 15, "760m_48b": 45}[scale]
    assert cfg.total_tokens == int(tokens * 2**30)
    # sizes work for the usual GPU counts
    for world in (1, 2, 4, 8):
        check_sizes(cfg, world)
    model_config_from_train_config(cfg)  # the preset exists


def test_peak_learning_rates_from_the_paper(hydra_ctx) -> None:
    lr = {n: compose("train", overrides=[f"experiment={n}"]).optim.lr for n in EXPERIMENTS}
    assert lr["fot_pro_125m_2b"] == lr["transformer_llama_360m_7b"] == 2e-3
    assert lr["fot_llama_760m_16b"] == lr["transformer_pro_760m_48b"] == 1e-3
    assert lr["fot_pro_760m_48b"] == 2e-3
    assert lr["transformer_llama_760m_48b"] == 5e-4


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
