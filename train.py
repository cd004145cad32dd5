"""Train a FoT (or baseline) language model: ``python train.py`` (tiny run on the sample
corpus), ``torchrun --nproc_per_node=8 train.py experiment=fot_pro_760m_48b data.path=...``,
``python train.py -m model=fot_pro,transformer_pro`` (one folder per job).

Configs live in ``configs/`` (Hydra); the training loop is :func:`fot.training.train`.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from fot.training.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    from fot.training import train

    if cfg.out_dir is None:
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    train(cfg)


if __name__ == "__main__":
    main()
