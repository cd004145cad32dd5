"""The optimizers (AdamW with the paper's weight-decay rule, Muon) and the learning-rate schedule
in tokens."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from fot.errors import not_one_of
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
    dimensions (all of those are vectors), any parameter whose name contains ``bias`` or
    ``norm``, and any that its model marks ``_no_weight_decay`` (FLA's flag, as in the paper's
    code: e.g. the (channels, state) ``A_log`` of Samba's Mamba layers). Matrices
    (projections, embeddings) are decayed.

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
        if p.ndim < 2 or "bias" in lowered or "norm" in lowered or _no_weight_decay(p):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _no_weight_decay(p: torch.Tensor) -> bool:
    """Whether ``p`` is marked ``_no_weight_decay`` (by FLA's layers: a decay rate, a skip
    weight, not a projection)."""
    return bool(getattr(p, "_no_weight_decay", False))


def check_optim(cfg: OptimConfig, schedule: ScheduleConfig | None = None) -> None:
    """Refuse optimizer and schedule values that AdamW or the schedule would misuse.

    Called by :func:`fot.training.config.check_config` before anything is built, and by
    :func:`build_optimizer`.

    Raises:
        ValueError: naming the bad value and the valid range.
    """
    if cfg.name not in OPTIMIZERS:
        raise ValueError(
            not_one_of("optim.name", cfg.name, OPTIMIZERS) + " (or pick the group: optim=muon)"
        )
    check_muon(cfg)
    if len(cfg.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.betas):
        raise ValueError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.betas)}")
    # `not x > 0` rather than `x <= 0`: nan (which Hydra parses) fails every comparison, and
    # would pass on to a run that turns the weights to nan at its first step
    if not 0 < cfg.lr < math.inf:
        raise ValueError(f"optim.lr must be > 0 and finite, got {cfg.lr}")
    if not 0 < cfg.eps < math.inf:
        raise ValueError(f"optim.eps must be > 0 and finite (e.g. 1e-8), got {cfg.eps}")
    if not 0 <= cfg.weight_decay < math.inf:
        raise ValueError(
            f"optim.weight_decay must be >= 0 and finite (0: none), got {cfg.weight_decay}"
        )
    if not cfg.grad_clip >= 0:  # inf: no clipping, as 0
        raise ValueError(
            f"optim.grad_clip={cfg.grad_clip} is not a number >= 0; use optim.grad_clip=0 for "
            "no clipping, or the largest global gradient norm to allow"
        )
    if schedule is not None:
        if schedule.name not in SCHEDULES:
            raise ValueError(
                not_one_of("schedule.name", schedule.name, SCHEDULES)
                + " (or pick the group: schedule=warmup_linear)"
            )
        if not 0.0 <= schedule.min_lr_ratio <= 1.0:
            raise ValueError(
                f"schedule.min_lr_ratio={schedule.min_lr_ratio} must be in [0, 1]: the final "
                "learning rate as a fraction of optim.lr"
            )
        if schedule.name == "constant" and schedule.min_lr_ratio != 1.0:
            raise ValueError(
                f"schedule.min_lr_ratio={schedule.min_lr_ratio}: schedule=constant keeps "
                "optim.lr to the end and does not read it; for a decay to that fraction use "
                "schedule=warmup_cosine, warmup_linear or wsd, or drop the override (pick "
                "schedule=constant rather than schedule.name=constant; after an experiment "
                "file that sets it, add schedule.min_lr_ratio=1)"
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
        raise ValueError(not_one_of("schedule.decay_shape", cfg.decay_shape, DECAY_SHAPES))


def check_muon(cfg: OptimConfig) -> None:
    """Refuse Muon's fields outside ``optim.name=muon`` (they would be ignored), and missing or
    bad ones in it.

    Raises:
        ValueError: naming the field and the fix.
    """
    fields = {"momentum": cfg.momentum, "ns_steps": cfg.ns_steps, "adjust_lr": cfg.adjust_lr}
    preset = "momentum 0.95, ns_steps 5, adjust_lr match_rms_adamw"
    if not _option_fields("optim", cfg.name, "muon", fields, preset):
        return
    if not 0.0 <= cfg.momentum < 1.0:
        raise ValueError(f"optim.momentum={cfg.momentum} must be in [0, 1) (Muon's: 0.95)")
    if not 1 <= int(cfg.ns_steps) < 100:  # torch.optim.Muon refuses 100 and more
        raise ValueError(f"optim.ns_steps={cfg.ns_steps} must be in [1, 99] (Muon's: 5)")
    if cfg.adjust_lr not in MUON_ADJUST_LR:
        raise ValueError(not_one_of("optim.adjust_lr", cfg.adjust_lr, MUON_ADJUST_LR))


def muon_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters ``optim=muon`` gives to Muon: the 2-D weights inside the
    decoder layers (``.layers.`` in the name) with more rows and columns than the model has
    attention heads, norms and parameters marked ``_no_weight_decay`` (Samba's Mamba ``A_log``)
    excepted, i.e. the attention and MLP projections. Embeddings, the LM head, norms, biases
    and the projections with one row per head (forget gate, KV-shift) stay with AdamW, as do
    tensors of other ranks (>2), e.g. convolutions of FLA baselines.

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
        and not _no_weight_decay(p)
        and min(p.shape) > heads
    }
    if not names:
        raise ValueError(
            f"optim=muon found no projection matrix for Muon in this model (2-D weights of its "
            f"layers with more rows and columns than its {heads} heads): use optim=adamw"
        )
    return names


def newton_schulz(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """Muon's orthogonalisation, in bf16 as ``torch.optim.Muon`` runs it: scale the matrix to
    Frobenius norm 1, then ``steps`` quintic iterations X ← aX + (bA + cA²)X with A = XXᵀ, on
    the wide orientation (rows ≤ columns).

    Args:
        update: (rows, cols) matrix, any float dtype.
        coefficients: (a, b, c).
        steps: number of iterations.
        eps: floor of the norm the matrix is divided by.

    Returns:
        (rows, cols) bf16 matrix with singular values near 1.
    """
    a, b, c = coefficients
    # a copy also of a bf16 input (torch's Muon normalises that one in place: with bf16
    # parameters and no Nesterov, the momentum buffer itself)
    x = update.to(torch.bfloat16, copy=True)
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_lr_scale(shape: torch.Size, rule: str | None) -> float:
    """Factor on ``lr`` for a (rows, cols) matrix: ``match_rms_adamw`` 0.2·√max(rows, cols)
    (the update's RMS then matches AdamW's), ``original`` √max(1, rows/cols)."""
    rows, cols = shape[:2]
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1.0, rows / cols))


class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024): SGD with Nesterov momentum whose update matrices are
    orthogonalised by :func:`newton_schulz`, with decoupled weight decay; the step of
    ``torch.optim.Muon`` (torch >= 2.9: the same arguments, defaults, checks and state, bit for
    bit the same results for float32 parameters, fot's master weights; tested against it), for
    2-D parameters only, on any torch fot supports, with the orthogonalisations split over the
    ranks. (With bf16 parameters and ``nesterov=False`` torch's step also normalises the
    momentum buffer in place, its iteration starting on the buffer itself; fot's does not.)

    With ``process_group`` (``ddp``: every rank holds the same parameters and averaged
    gradients), every rank updates the momentum of all matrices, orthogonalises those dealt to
    it (:func:`_deal`: by cost, largest first, each to the least loaded rank) and broadcasts the
    results, one broadcast per rank. Where the parameters are DTensors (``fsdp``: rows sharded
    over a 1-D mesh), the momentum buffers stay sharded and update on each rank's rows; one
    all-to-all brings every matrix's update, in bf16, whole to its rank, which orthogonalises
    it, and a second sends every rank its rows of the results (each rank sends and receives
    about its share of the matrices twice per step, in bf16).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``torch.optim.Muon``'s arguments (``adjust_lr_fn``: see :func:`muon_lr_scale`);
        ``process_group``: the ranks that hold the same (replicated) parameters and share the
        orthogonalisations of a step (DDP's group)."""
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"Muon's lr must be a number or a 1-element tensor, got {lr.numel()}")
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not float(value) >= 0:
                raise ValueError(f"Muon's {name} must be >= 0, got {float(value)}")
        if adjust_lr_fn not in (None, *MUON_ADJUST_LR):
            raise ValueError(
                not_one_of("Muon's adjust_lr_fn", adjust_lr_fn, [None, *MUON_ADJUST_LR])
            )
        if len(ns_coefficients) != 3 or not 1 <= int(ns_steps) < 100:
            raise ValueError(
                f"Muon takes 3 ns_coefficients and 1 to 99 ns_steps, got {len(ns_coefficients)} "
                f"and {ns_steps}"
            )
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2 or torch.is_complex(p):
                    raise ValueError(
                        f"Muon takes real 2-D parameters only, got one of {tuple(p.shape)} "
                        f"({p.dtype})"
                    )
        self.process_group = process_group

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step (``closure`` as in ``torch.optim.Optimizer.step``)."""
        sharded = [isinstance(p, DTensor) for g in self.param_groups for p in g["params"]]
        if any(sharded) and not all(sharded):
            raise ValueError(
                f"optim=muon got {sharded.count(False)} plain tensors among FSDP2's sharded "
                "parameters: shard the whole model (fully_shard on its root) or none of it"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        todo = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if todo and any(sharded):
            self._sharded_step(todo)
        elif todo:
            self._replicated_step(todo, self.process_group)
        return loss

    def _momentum(self, p: torch.Tensor, hyper: dict) -> torch.Tensor:
        """Update ``p``'s momentum buffer with its gradient and return the step's update (the
        Nesterov look-ahead, or the buffer); of a DTensor, on this rank's shards (DTensor ops
        would cost ~1 ms of Python per matrix)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        grad, buf = p.grad, state["momentum_buffer"]
        if isinstance(p, DTensor):
            grad, buf = grad.to_local(), buf.to_local()
        buf.lerp_(grad, 1 - hyper["momentum"])
        return grad.lerp(buf, hyper["momentum"]) if hyper["nesterov"] else buf

    def _replicated_step(
        self, todo: list[tuple[torch.Tensor, dict]], group: dist.ProcessGroup | None
    ) -> None:
        world = dist.get_world_size(group) if group is not None else 1
        me = dist.get_rank(group) if group is not None else 0
        owned = _deal([tuple(p.shape) for p, _ in todo], world)
        mine = set(owned[me])
        results: dict[int, torch.Tensor] = {}
        for i, (p, hyper) in enumerate(todo):  # every rank: the momentum of every matrix
            update = self._momentum(p, hyper)
            if i not in mine:
                continue
            ortho = newton_schulz(update, hyper["ns_coefficients"], hyper["ns_steps"], hyper["eps"])
            if world == 1:  # applied at once, matrix by matrix (as torch's step: less memory)
                _apply(p, ortho, hyper)
            else:
                results[i] = ortho
        if world == 1:
            return
        for k, indices in enumerate(owned):  # from rank k to all, as one flat buffer
            if not indices:
                continue
            # a tall matrix's result travels in the iteration's (wide, contiguous) orientation
            # and is applied as its transpose: a strided view, as torch's step applies it
            # (a low-precision add_ can round a strided input differently)
            wide = [_wide(todo[i][0].shape) for i in indices]
            if k == me:
                flat = torch.cat([_as_wide(results.pop(i)).reshape(-1) for i in indices])
            else:
                numel = sum(todo[i][0].numel() for i in indices)
                device = todo[indices[0]][0].device
                flat = torch.empty(numel, dtype=torch.bfloat16, device=device)
            dist.broadcast(flat, src=dist.get_global_rank(group, k), group=group)
            sizes = [todo[i][0].numel() for i in indices]
            for i, part, shape in zip(indices, flat.split(sizes), wide, strict=True):
                p = todo[i][0]
                ortho = part.view(shape) if shape == tuple(p.shape) else part.view(shape).T
                _apply(p, ortho, todo[i][1])

    def _sharded_step(self, todo: list[tuple[DTensor, dict]]) -> None:
        mesh = todo[0][0].device_mesh
        for p, _ in todo:
            if p.device_mesh != mesh or mesh.ndim != 1 or p.placements != (Shard(0),):
                raise ValueError(
                    f"optim=muon steps parameters sharded by rows over one 1-D device mesh "
                    f"(parallel=fsdp), not this {tuple(p.shape)} parameter's {p.placements}"
                )
        group, world, me = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        shapes = [(p.shape[0], p.shape[1]) for p, _ in todo]
        chunk = [-(-rows // world) for rows, _ in shapes]  # torch.chunk's rule, FSDP2's
        size = [c * cols for c, (_, cols) in zip(chunk, shapes, strict=True)]
        owned = _deal(shapes, world)
        device = todo[0][0].to_local().device
        # 1. momentum on the local rows; each update's rows (bf16, where the iteration starts:
        # the same bits in half the bytes), padded to a whole chunk, go to the matrix's owner
        send = []
        for indices in owned:
            for i in indices:
                p, hyper = todo[i]
                update = self._momentum(p, hyper)
                rows = torch.zeros((chunk[i], shapes[i][1]), dtype=torch.bfloat16, device=device)
                rows[: update.shape[0]] = update
                send.append(rows.flatten())
        splits = [sum(size[i] for i in indices) for indices in owned]
        mine = splits[me]
        received = _all_to_all(send, splits, [mine] * world, group, device).view(world, mine)
        # 2. the owner orthogonalises each of its matrices whole; row chunk r goes to rank r
        results, offset = [], 0
        for i in owned[me]:
            (rows, cols), hyper = shapes[i], todo[i][1]
            whole = received[:, offset : offset + size[i]].reshape(world * chunk[i], cols)
            offset += size[i]
            ortho = newton_schulz(
                whole[:rows], hyper["ns_coefficients"], hyper["ns_steps"], hyper["eps"]
            )
            padded = ortho.new_zeros((world * chunk[i], cols))
            padded[:rows] = ortho
            results.append(padded.view(world, size[i]))
        back = torch.cat(results, dim=1) if results else received.new_empty((world, 0))
        mine_rows = _all_to_all([back.flatten()], [mine] * world, splits, group, device)
        # 3. each rank applies its rows, which arrive in the order they were sent
        offset = 0
        for indices in owned:
            for i in indices:
                p, hyper = todo[i]
                local = p.to_local()
                ortho = mine_rows[offset : offset + size[i]].view(chunk[i], shapes[i][1])
                offset += size[i]
                _apply(local, ortho[: local.shape[0]], hyper, p.shape)


def _apply(
    p: torch.Tensor, ortho: torch.Tensor, hyper: dict, shape: torch.Size | None = None
) -> None:
    """Decoupled weight decay, then the orthogonalised update at the LR scaled for the whole
    matrix's ``shape`` (``p``'s own unless ``p`` is a shard of it)."""
    lr = float(hyper["lr"])
    p.mul_(1 - lr * hyper["weight_decay"])
    p.add_(ortho, alpha=-lr * muon_lr_scale(shape or p.shape, hyper["adjust_lr_fn"]))


def _wide(shape: torch.Size) -> tuple[int, int]:
    """``(rows, cols)`` with rows ≤ cols: the orientation :func:`newton_schulz` iterates in."""
    rows, cols = shape
    return (rows, cols) if rows <= cols else (cols, rows)


def _as_wide(ortho: torch.Tensor) -> torch.Tensor:
    """:func:`newton_schulz`'s result in the wide orientation (contiguous: no copy)."""
    return ortho if ortho.size(0) <= ortho.size(1) else ortho.T


def _deal(shapes: list[tuple[int, int]], world: int) -> list[list[int]]:
    """Indices of the matrices each rank orthogonalises, in order: by Newton-Schulz cost
    (rows · cols · min(rows, cols)), largest first, each to the rank with the least so far."""
    cost = [rows * cols * min(rows, cols) for rows, cols in shapes]
    load, owned = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(shapes)), key=lambda i: -cost[i]):
        k = load.index(min(load))
        load[k] += cost[i]
        owned[k].append(i)
    return [sorted(indices) for indices in owned]


def _all_to_all(
    send: list[torch.Tensor],
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor:
    """``all_to_all_single`` of flat bf16 data: ``send`` concatenated, its first
    ``send_splits[0]`` elements to rank 0 and so on; returns what the ranks sent here, in
    rank order (``recv_splits`` elements from each)."""
    out = torch.empty(sum(recv_splits), dtype=torch.bfloat16, device=device)
    source = torch.cat(send) if send else out.new_empty(0)
    dist.all_to_all_single(out, source, recv_splits, send_splits, group=group)
    return out


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
    muon = Muon(
        [p for name, p in model.named_parameters() if name in muon_names],
        process_group=model.process_group if isinstance(model, DistributedDataParallel) else None,
        lr=cfg.lr,
        weight_decay=cfg.weight_decay,
        momentum=float(cfg.momentum),
        nesterov=True,
        ns_steps=int(cfg.ns_steps),
        adjust_lr_fn=cfg.adjust_lr,
    )
    return MuonAdamW(muon, adamw)


def _read_like_a_fresh_allocation(t: torch.Tensor) -> bool:
    """Whether ``t``'s address lets every kernel read it as it reads a fresh allocation (which
    the caching allocator aligns to 512 bytes): a multiple of the widest vector load (16
    bytes) and of 4 elements (foreach kernels load 4 at a time: 32 bytes of float64)."""
    return t.data_ptr() % max(16, 4 * t.element_size()) == 0


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` (2-norm), with a total norm that does
    not depend on where the gradients lie in memory.

    torch sums each gradient's squares with kernels whose order of additions follows the
    gradient's address: a gradient that is a view into DDP's buckets at an address not
    divisible by 16 bytes (after a parameter of, e.g., 2 floats; 32 bytes for float64) gets
    a norm that can differ in the last bit from that of the same values in their own
    allocation, and the clip scales every gradient by it. So eager DDP (gradients as bucket
    views) and DDP in a CUDA graph (own gradients) took different steps from equal
    gradients, as can a run resumed before DDP rebuilt its buckets. Here such a gradient is
    copied to a fresh allocation (one at a time) for its norm; the others are read in place,
    and the result equals torch's where no gradient needs the copy (gradients of one device
    and dtype). Gradients that are DTensors (FSDP2) go to torch's function as they are.

    Args:
        params: the parameters; those without a gradient are skipped (any shape, float dtype).
        max_norm: the largest total norm kept (``inf``: none clipped).

    Returns:
        The total 2-norm of the gradients before clipping (0-dim, float32 for float32
        gradients), on the device of the first gradient.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.tensor(0.0)
    if any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:  # torch's order: by device and dtype, each group in the given order
        groups.setdefault((g.device, g.dtype), []).append(g)
    norms: list[torch.Tensor] = []
    for group in groups.values():
        aligned = [g for g in group if _read_like_a_fresh_allocation(g)]
        in_place = iter(torch._foreach_norm(aligned, 2.0) if aligned else [])
        for g in group:
            if _read_like_a_fresh_allocation(g):
                norms.append(next(in_place))
            else:
                norms.append(torch._foreach_norm([g.clone()], 2.0)[0])
    first = grads[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


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
        raise ValueError(not_one_of("schedule.name", cfg.name, SCHEDULES))
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
