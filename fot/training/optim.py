"""AdamW with the paper's weight-decay rule, and the learning-rate schedule in tokens."""

from __future__ import annotations

import math

import torch
from torch import nn

from fot.training.config import OptimConfig, ScheduleConfig
from fot.training.parallel import unwrap

OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")
SCHEDULES = ("warmup_cosine", "warmup_linear", "constant", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


def param_groups(
    model: nn.Module, weight_decay: float, *, skip: set[str] | frozenset[str] = frozenset()
) -> list[dict]:
    """Split trainable parameters into decayed and non-decayed groups.

    No weight decay on biases, norm weights and gate biases: every parameter with fewer than two
    dimensions (all of those are vectors), and any parameter whose name contains ``bias`` or
    ``norm``. Matrices (projections, embeddings) are decayed.

    Args:
        model: the (possibly wrapped) model.
        weight_decay: decay for the decayed group.
        skip: names of parameters another optimizer takes (Muon's).

    Returns:
        Two parameter groups for ``torch.optim.AdamW``.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad or name in skip:
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
    if cfg.name not in OPTIMIZERS:
        raise ValueError(
            f"optim.name={cfg.name!r} is not one of {list(OPTIMIZERS)} (or pick the group: "
            "optim=muon)"
        )
    check_muon(cfg)
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


def _option_fields(
    group: str, name: str, owner: str, fields: dict[str, object], preset: str
) -> bool:
    """Whether ``group.name`` is ``owner``, the one option that reads ``fields``.

    Raises:
        ValueError: a field is set while another option is chosen (it would be ignored), or
            one is missing while ``owner`` is (``group.name=owner`` given without its group
            file, whose values ``preset`` lists).
    """
    if name != owner:
        given = [f"{group}.{k}={v}" for k, v in fields.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: only {group}={owner} reads "
                f"{'it' if len(given) == 1 else 'them'}, not {group}.name={name!r}; use "
                f"{group}={owner}, or drop the override"
            )
        return False
    missing = [f"{group}.{k}" for k, v in fields.items() if v is None]
    if missing:
        listed = " and ".join(
            [", ".join(missing[:-1]), missing[-1]] if len(missing) > 1 else missing
        )
        raise ValueError(
            f"{group}.name={owner!r} needs {listed}; pick the group ({group}={owner}: "
            f"{preset}) rather than {group}.name"
        )
    return True


def check_wsd(cfg: ScheduleConfig) -> None:
    """Refuse ``decay_fraction`` / ``decay_shape`` outside ``wsd`` (they would be ignored) and
    missing or bad ones in it.

    Raises:
        ValueError: naming the field and the fix.
    """
    fields = {"decay_fraction": cfg.decay_fraction, "decay_shape": cfg.decay_shape}
    if not _option_fields(
        "schedule", cfg.name, "wsd", fields, "decay_fraction 0.2, decay_shape 1-sqrt"
    ):
        return
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


def check_muon(cfg: OptimConfig) -> None:
    """Refuse Muon's fields outside ``optim.name=muon`` (they would be ignored), missing or
    bad ones in it, and a torch without ``torch.optim.Muon``.

    Raises:
        ValueError: naming the field and the fix.
    """
    fields = {"momentum": cfg.momentum, "ns_steps": cfg.ns_steps, "adjust_lr": cfg.adjust_lr}
    preset = "momentum 0.95, ns_steps 5, adjust_lr match_rms_adamw"
    if not _option_fields("optim", cfg.name, "muon", fields, preset):
        return
    if not hasattr(torch.optim, "Muon"):
        raise ValueError(
            f"optim=muon needs torch.optim.Muon (torch >= 2.9); this is torch "
            f"{torch.__version__}: upgrade torch or use optim=adamw"
        )
    if not 0.0 <= cfg.momentum < 1.0:
        raise ValueError(f"optim.momentum={cfg.momentum} must be in [0, 1) (Muon's: 0.95)")
    if not 1 <= int(cfg.ns_steps) < 100:  # torch.optim.Muon refuses 100 and more
        raise ValueError(f"optim.ns_steps={cfg.ns_steps} must be in [1, 99] (Muon's: 5)")
    if cfg.adjust_lr not in MUON_ADJUST_LR:
        raise ValueError(f"optim.adjust_lr={cfg.adjust_lr!r} is not one of {list(MUON_ADJUST_LR)}")


def check_muon_strategy(cfg: OptimConfig, *, strategy: str, cuda_graphs: bool) -> None:
    """Refuse ``optim=muon`` where its step would be wrong or cannot run.

    Args:
        cfg: the ``optim`` config.
        strategy: the resolved strategy (``single``, ``ddp`` or ``fsdp``).
        cuda_graphs: ``parallel.cuda_graphs``.

    Raises:
        ValueError: FSDP2 (Muon orthogonalises whole matrices, FSDP2 gives each rank a shard
            of them) or CUDA graphs (the graphed step replays a capturable AdamW only).
    """
    if cfg.name != "muon":
        return
    if strategy == "fsdp":
        raise ValueError(
            "optim=muon orthogonalises each weight matrix whole, and parallel=fsdp gives every "
            "rank only a shard of it (each would orthogonalise its own rows): use parallel=ddp "
            "or single, or optim=adamw with fsdp"
        )
    if cuda_graphs:
        raise ValueError(
            "parallel.cuda_graphs=true replays a capturable AdamW step, and optim=muon is not "
            "one: set parallel.cuda_graphs=false, or use optim=adamw"
        )


def muon_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters ``optim=muon`` gives to Muon: the 2-D weights inside the
    decoder layers (``.layers.`` in the name) with more rows and columns than the model has
    attention heads, norms excepted, i.e. the attention and MLP projections. Embeddings, the
    LM head, norms, biases and the projections with one row per head (forget gate, KV-shift)
    stay with AdamW, as do tensors of other ranks (>2), e.g. convolutions of FLA baselines.

    Raises:
        ValueError: no parameter qualifies (a model without such projections).
    """
    config = getattr(unwrap(model), "config", None)
    heads = next(
        (
            int(v)
            for key in ("num_heads", "num_attention_heads", "n_head")
            if isinstance(v := getattr(config, key, None), int)
        ),
        1,
    )
    names = {
        name
        for name, p in model.named_parameters()
        if p.requires_grad
        and p.ndim == 2
        and ".layers." in f".{name}"
        and "norm" not in name.lower()
        and min(p.shape) > heads
    }
    if not names:
        raise ValueError(
            f"optim=muon found no projection matrix for Muon in this model (2-D weights of its "
            f"layers with more rows and columns than its {heads} heads): use optim=adamw"
        )
    return names


class MuonAdamW:
    """Muon and AdamW stepped as one optimizer (``optim=muon``).

    ``param_groups`` lists both optimizers' groups (the learning-rate schedule sets them all);
    ``optimizers`` are the two torch optimizers, which checkpoints save and load together
    (``torch.distributed.checkpoint.state_dict`` takes a list of optimizers).
    """

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.optimizers = (muon, adamw)

    @property
    def param_groups(self) -> list[dict]:
        """Muon's groups, then AdamW's (the same dicts: setting ``lr`` sets theirs)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def step(self) -> None:
        """One step of each."""
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter of both."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, device: torch.device, capturable: bool = False
) -> torch.optim.Optimizer | MuonAdamW:
    """AdamW over ``model``'s parameters (see :func:`param_groups`), or with ``optim=muon`` a
    :class:`MuonAdamW`: Muon over :func:`muon_parameter_names` (weight decay
    ``cfg.weight_decay``) and AdamW over the rest.

    Args:
        model: the model after :func:`fot.training.parallel.parallelize`.
        cfg: ``optim`` config. ``lr`` is the peak; the schedule sets each step's LR.
        device: where the parameters live (the fused kernel is used on CUDA by default).
        capturable: whether a CUDA graph may capture ``step()`` (for ``parallel.cuda_graphs``).
    """
    check_optim(cfg)
    fused = cfg.fused if cfg.fused is not None else device.type == "cuda"
    muon_names = muon_parameter_names(model) if cfg.name == "muon" else set()
    adamw_groups = param_groups(model, cfg.weight_decay, skip=muon_names)
    adamw = torch.optim.AdamW(
        adamw_groups,
        lr=cfg.lr,
        betas=(float(cfg.betas[0]), float(cfg.betas[1])),
        eps=cfg.eps,
        fused=fused or None,
        capturable=capturable,
    )
    if cfg.name != "muon":
        return adamw
    muon = torch.optim.Muon(
        [p for name, p in model.named_parameters() if name in muon_names],
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=float(cfg.momentum),
        nesterov=True,
        ns_steps=int(cfg.ns_steps),
        adjust_lr_fn=cfg.adjust_lr,
    )
    return MuonAdamW(muon, adamw)


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
