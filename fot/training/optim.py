"""AdamW with the paper's weight-decay rule, and the learning-rate schedule in tokens."""

from __future__ import annotations

import math

import torch
from torch import nn

from fot.training.config import OptimConfig, ScheduleConfig

SCHEDULES = ("warmup_cosine", "warmup_linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Split trainable parameters into decayed and non-decayed groups.

    No weight decay on biases, norm weights and gate biases: every parameter with fewer than two
    dimensions (all of those are vectors), and any parameter whose name contains ``bias`` or
    ``norm``. Matrices (projections, embeddings) are decayed.

    Args:
        model: the (possibly wrapped) model.
        weight_decay: decay for the decayed group.

    Returns:
        Two parameter groups for ``torch.optim.AdamW``.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        lowered = name.lower()
        if p.ndim < 2 or "bias" in lowered or "norm" in lowered:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def check_optim(cfg: OptimConfig, schedule: ScheduleConfig | None = None) -> None:
    """Refuse optimizer and schedule values that AdamW or the schedule would misuse.

    Called by :func:`fot.training.config.check_config` before anything is built, and by
    :func:`build_optimizer`.

    Raises:
        ValueError: naming the bad value and the valid range.
    """
    if cfg.name != "adamw":
        raise ValueError(f"optim.name={cfg.name!r} is not supported; valid: ['adamw']")
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ValueError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.betas)}")
    if cfg.lr <= 0:
        raise ValueError(f"optim.lr must be > 0, got {cfg.lr}")
    if cfg.eps <= 0:
        raise ValueError(f"optim.eps must be > 0 (e.g. 1e-8), got {cfg.eps}")
    if cfg.weight_decay < 0:
        raise ValueError(f"optim.weight_decay must be >= 0 (0: none), got {cfg.weight_decay}")
    if cfg.grad_clip < 0:
        raise ValueError(
            f"optim.grad_clip={cfg.grad_clip} is negative; use optim.grad_clip=0 for no "
            "clipping, or the largest global gradient norm to allow"
        )
    if schedule is not None:
        if schedule.name not in SCHEDULES:
            raise ValueError(
                f"schedule.name={schedule.name!r} is not one of {list(SCHEDULES)} (or pick "
                "the group: schedule=warmup_linear)"
            )
        if not 0.0 <= schedule.min_lr_ratio <= 1.0:
            raise ValueError(
                f"schedule.min_lr_ratio={schedule.min_lr_ratio} must be in [0, 1]: the final "
                "learning rate as a fraction of optim.lr"
            )
        check_wsd(schedule)


def check_wsd(cfg: ScheduleConfig) -> None:
    """Refuse ``decay_fraction`` / ``decay_shape`` outside ``wsd`` (they would be ignored) and
    missing or bad ones in it.

    Raises:
        ValueError: naming the field and the fix.
    """
    fields = {"decay_fraction": cfg.decay_fraction, "decay_shape": cfg.decay_shape}
    if cfg.name != "wsd":
        given = [f"schedule.{k}={v}" for k, v in fields.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: only schedule=wsd reads "
                f"{'it' if len(given) == 1 else 'them'}, not schedule.name={cfg.name!r}; "
                "use schedule=wsd, or drop the override"
            )
        return
    missing = [f"schedule.{k}" for k, v in fields.items() if v is None]
    if missing:
        raise ValueError(
            f"schedule.name='wsd' needs {' and '.join(missing)}; pick the group "
            "(schedule=wsd: decay_fraction 0.2, decay_shape 1-sqrt) rather than schedule.name"
        )
    if not 0.0 < cfg.decay_fraction <= 1.0:
        raise ValueError(
            f"schedule.decay_fraction={cfg.decay_fraction} must be in (0, 1]: the fraction of "
            "total_tokens at the end of the run over which the learning rate decays "
            "(0.2: the last fifth)"
        )
    if cfg.decay_shape not in DECAY_SHAPES:
        raise ValueError(
            f"schedule.decay_shape={cfg.decay_shape!r} is not one of {list(DECAY_SHAPES)}"
        )


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, device: torch.device, capturable: bool = False
) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters (see :func:`param_groups`).

    Args:
        model: the model after :func:`fot.training.parallel.parallelize`.
        cfg: ``optim`` config. ``lr`` is the peak; the schedule sets each step's LR.
        device: where the parameters live (the fused kernel is used on CUDA by default).
        capturable: whether a CUDA graph may capture ``step()`` (for ``parallel.cuda_graphs``).
    """
    check_optim(cfg)
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    return torch.optim.AdamW(
        param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(float(cfg.betas[0]), float(cfg.betas[1])),
        eps=cfg.eps,
        fused=fused or None,
        capturable=capturable,
    )


def lr_at(tokens: int, *, peak_lr: float, total_tokens: int, cfg: ScheduleConfig) -> float:
    """Learning rate of the step that brings the run to ``tokens`` training tokens.

    Linear warmup from 0 to ``peak_lr`` over ``cfg.warmup_tokens``, then (``warmup_cosine``)
    cosine decay or (``warmup_linear``) linear decay to ``cfg.min_lr_ratio * peak_lr`` at
    ``total_tokens``, or (``constant``) the peak, or (``wsd``) the peak until the last
    ``cfg.decay_fraction`` of ``total_tokens`` and then a decay of ``cfg.decay_shape`` to
    ``cfg.min_lr_ratio * peak_lr`` at ``total_tokens``: with progress p through the decay,
    the peak's share above the floor is 1 − p (``linear``), (1 + cos πp) / 2 (``cosine``)
    or 1 − √p (``1-sqrt``). The warmup comes first where the two overlap.

    Args:
        tokens: tokens seen including this step's batch (so the first step's LR is not 0).
        peak_lr: the peak learning rate (``optim.lr``).
        total_tokens: the run's length in tokens.
        cfg: ``schedule`` config.
    """
    if cfg.name not in SCHEDULES:
        raise ValueError(f"schedule.name={cfg.name!r} is not one of {list(SCHEDULES)}")
    warmup = cfg.warmup_tokens
    if warmup > 0 and tokens < warmup:
        return peak_lr * tokens / warmup
    if cfg.name == "constant":
        return peak_lr
    floor = cfg.min_lr_ratio * peak_lr
    if cfg.name == "wsd":
        check_wsd(cfg)
        span = max(round(cfg.decay_fraction * total_tokens), 1)
        progress = min(max((tokens - (total_tokens - span)) / span, 0.0), 1.0)
        share = {
            "linear": 1.0 - progress,
            "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
            "1-sqrt": 1.0 - math.sqrt(progress),
        }[cfg.decay_shape]
        return floor + (peak_lr - floor) * share
    span = max(total_tokens - warmup, 1)
    progress = min(max((tokens - warmup) / span, 0.0), 1.0)
    if cfg.name == "warmup_linear":
        return peak_lr - (peak_lr - floor) * progress
    return floor + 0.5 * (peak_lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate."""
    for group in optimizer.param_groups:
        group["lr"] = lr
