"""Processes, devices and the one place where the model is distributed: :func:`parallelize`."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from fot.errors import USER_ERRORS, FotError, not_one_of
from fot.training.config import ParallelConfig

logger = logging.getLogger("fot.train")

STRATEGIES = ("auto", "single", "ddp", "fsdp")
PRECISIONS = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")  # parallel.backend; auto: nccl on CUDA, gloo on the CPU
REDUCE_PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
PARAM_PRECISIONS = ("bf16", "fp32")
"""``parallel.param_precision``: FSDP2's parameters under bf16 precision (see
:class:`fot.training.config.ParallelConfig`)."""
# FSDP2 in torch < 2.9 sums the gradients over gloo where it should average them
# (pytorch/pytorch#162338): seen here as a gradient norm twice the one-process run's on 2 ranks.
FSDP_GLOO_MIN_TORCH = (2, 9)
TORCH_DEFAULT_TIMEOUTS = "600 s over nccl, 1800 s over gloo"
"""torch's process group timeouts, ``parallel.timeout_s=null``, in words for messages."""

_made_group: dict[str, float | None] = {}
"""``{"timeout_s": ...}`` once :func:`init_distributed` makes this process's group: the
``parallel.timeout_s`` it is made with, which a later job of a multirun must ask for too."""
# gloo's words for a collective that waited out the timeout, and the store's at the start
_TIMED_OUT = re.compile(
    r"Timed out waiting \d+ms|wait timeout after \d+ms|Timed out after \d+ seconds waiting"
    r"|client socket has timed out after \d+ms"
)
# the store client's words when rank 0's store never answered at the start
_NO_STORE = re.compile(r"while trying to connect to \(([^,()]+), (\d+)\)")
# gloo's (and the store's) words when the process at the other end of a connection has exited
_PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe")


@dataclass
class DistInfo:
    """Where this process sits: rank, world size, local rank and device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Whether this process is rank 0 (the one that logs and writes shared files)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether more than one process trains (a process group exists)."""
        return self.world_size > 1


def adopt_slurm_tasks(prog: str) -> dict[str, str]:
    """Under ``srun`` with several tasks and no torchrun: set torchrun's variables in
    ``os.environ`` from Slurm's (:func:`fot.slurm.torchrun_variables`), so that the tasks join
    one process group; rank 0 says so on stderr, naming ``prog``. Returns the variables set
    (empty when there was nothing to do)."""
    from fot.slurm import torchrun_variables

    found = torchrun_variables(os.environ, torch.cuda.device_count())
    os.environ.update(found)
    if found and int(os.environ["RANK"]) == 0:
        print(
            f"{prog}: srun started {os.environ['WORLD_SIZE']} tasks without torchrun; they "
            f"form one process group (MASTER_ADDR={os.environ['MASTER_ADDR']}, "
            f"MASTER_PORT={os.environ['MASTER_PORT']})",
            file=sys.stderr,
        )
    return found


def init_distributed(
    device: str = "auto", backend: str = "auto", timeout_s: float | None = None
) -> DistInfo:
    """Set up the process group under torchrun (``WORLD_SIZE`` > 1), or a single process.

    Several nodes work through torchrun's own rendezvous (``--nnodes``, ``--rdzv_endpoint``);
    this function only reads the environment torchrun sets (or :func:`adopt_slurm_tasks`).

    Args:
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        backend: ``auto`` (nccl on CUDA, gloo on CPU), ``nccl`` or ``gloo``.
        timeout_s: ``parallel.timeout_s``, the process group's timeout in seconds (checked by
            :func:`fot.training.config.check_config`); ``None``: torch's defaults.

    Raises:
        ValueError: the group exists already (made by an earlier job of a Hydra multirun in
            this process) with another ``timeout_s``, which it cannot change.
    """
    if device not in DEVICES:
        raise ValueError(not_one_of("device", device, DEVICES))
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible; use device=cpu or auto")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices are "
                "visible; start at most one process per GPU (torchrun --nproc_per_node, srun "
                "--ntasks-per-node)"
            )
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    made = _made_group.get("timeout_s", timeout_s)
    if world_size > 1 and dist.is_initialized() and made != timeout_s:
        raise ValueError(
            f"parallel.timeout_s={_seconds(timeout_s)}, but an earlier job of this multirun made "
            f"this process's group with parallel.timeout_s={_seconds(made)}, and a process "
            "group keeps the timeout it was made with: give every job of the sweep the same "
            "parallel.timeout_s, or run the jobs as separate torchrun commands"
        )
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if use_cuda else "gloo"
        if backend not in ("nccl", "gloo"):
            raise ValueError(not_one_of("parallel.backend", backend, BACKENDS))
        kwargs: dict = {"device_id": dev} if use_cuda else {}
        if timeout_s is not None:  # (NCCL's watchdog and the start-up's store use it too)
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        _made_group["timeout_s"] = timeout_s  # (set first: a timeout at the start names it)
        dist.init_process_group(backend=backend, **kwargs)
        # Kept for the life of the process: Hydra multirun under torchrun runs several jobs in
        # the same processes, and a process group cannot be re-created after destruction.
        atexit.register(_destroy)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev)


def _seconds(timeout_s: float | None) -> str:
    """``timeout_s`` as it is written on the command line (``null`` for ``None``)."""
    return "null" if timeout_s is None else f"{timeout_s:g}"


def group_timeout() -> datetime.timedelta | None:
    """The timeout this process's group was made with (``parallel.timeout_s``), for the other
    groups of the run (:class:`fot.training.signals.StopOnSigterm`'s); ``None``: torch's
    default, or no group made by :func:`init_distributed`."""
    timeout_s = _made_group.get("timeout_s")
    return None if timeout_s is None else datetime.timedelta(seconds=timeout_s)


class CollectiveTimeoutError(FotError, RuntimeError):
    """This process waited longer than the process group's timeout (``parallel.timeout_s``)
    for the other ranks, in a collective or at the start: one of them stalled or died."""


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` is gloo's (or the store's) timeout of a collective, which torch raises
    as a ``RuntimeError`` of its C++ source location."""
    return (
        isinstance(err, RuntimeError)
        and not isinstance(err, FotError)
        and _TIMED_OUT.search(str(err)) is not None
    )


def collective_timeout(err: BaseException, what: str = "") -> CollectiveTimeoutError | None:
    """The one-line :class:`CollectiveTimeoutError` for ``err`` when it is gloo's (or the
    store's) timeout, which torch raises as a ``RuntimeError`` of its C++ source location;
    ``None`` for any other error.

    Args:
        err: the error a collective raised.
        what: where the other ranks were, if known (e.g. ``"while writing the checkpoint of
            step 4"``, from :func:`stop_together`).
    """
    if not is_collective_timeout(err):
        return None
    timeout_s = _made_group.get("timeout_s")
    if timeout_s is None:
        limit = f"torch's default timeout (parallel.timeout_s=null: {TORCH_DEFAULT_TIMEOUTS})"
    else:
        limit = f"parallel.timeout_s={_seconds(timeout_s)} seconds"
    if store := _NO_STORE.search(str(err)):
        host, port = store.groups()
        return CollectiveTimeoutError(
            f"waited longer than {limit} to reach rank 0 at {host}:{port} (MASTER_ADDR, "
            "MASTER_PORT), where the processes of the run meet at the start: rank 0 did not "
            "start, or stopped before the others came (see its output), or that address is "
            "not rank 0's host"
        )
    return CollectiveTimeoutError(
        f"waited longer than {limit} for the other ranks{f' {what}' if what else ''}, "
        "and one of them did not come: it stalled or died (see its output). If a rank was "
        "busy that long on its own (rank 0 writing a checkpoint to a slow file system or "
        "exporting a big model), raise parallel.timeout_s"
    )


class OtherRankGoneError(FotError, RuntimeError):
    """Another process of the run exited (an error, Ctrl-C or a signal to it alone) while
    this one waited for it in a collective; its own output says why."""


_INTERRUPTED = "fot/interrupted/{rank}"
"""The key in the process group's store where a rank stopped by Ctrl-C (SIGINT) says so
(:func:`record_interrupted`), for the ranks it leaves waiting (:func:`other_rank_gone`)."""
_STORE_TIMEOUT_S = 2.0
"""How long a rank that stops waits for the store's answer. A store whose process has exited
fails at once; one whose process is alive but does not answer (stopped, as under a debugger, or
on a host cut off) never does, and a call to it cannot be interrupted, not even by Ctrl-C."""


@contextlib.contextmanager
def _quiet_cpp_warnings() -> Iterator[None]:
    """File descriptor 2 goes to /dev/null inside the block. A call to a store whose process
    has exited fails at once, but c10d first writes a warning with a 20-frame C++ trace to
    it, which no Python setting silences (only ``TORCH_CPP_LOG_LEVEL`` at the start)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _ask_group_store(ask: Callable[[dist.Store], Any]) -> tuple[str, Any]:
    """``ask(store)`` on the store of this process's group (its rendezvous), waited for at most
    :data:`_STORE_TIMEOUT_S`: ``("answer", its value)``, ``("gone", None)`` where the store's
    process has exited, ``("silent", None)`` where no answer came in time (the call goes on,
    blocked, in a daemon thread), ``("none", None)`` without a group of several processes."""
    # (torch has no public accessor: a torch without this one names no rank, as before)
    default_store = getattr(dist.distributed_c10d, "_get_default_store", None)
    if default_store is None or not (dist.is_initialized() and dist.get_world_size() > 1):
        return "none", None
    store = default_store()
    answers: list[tuple[str, Any]] = []

    def call() -> None:
        try:
            answers.append(("answer", ask(store)))
        except RuntimeError:  # DistNetworkError: the store's process has exited
            answers.append(("gone", None))

    with _quiet_cpp_warnings():
        thread = threading.Thread(target=call, name="fot-store", daemon=True)
        thread.start()
        thread.join(_STORE_TIMEOUT_S)
    return answers[0] if answers else ("silent", None)


def record_interrupted() -> None:
    """Note in the process group's store that this rank stops on Ctrl-C (SIGINT), so that a
    rank it leaves waiting in a collective names it (:func:`other_rank_gone`): Ctrl-C in a
    terminal interrupts every rank and only rank 0 speaks, so a rank interrupted alone
    (``kill -INT``, a scheduler signalling one task) is otherwise silent. Nothing happens
    without a group or where the store has gone (its process exited first); a store that
    does not answer is waited for :data:`_STORE_TIMEOUT_S` at most."""
    # add, not set: it waits for the store's answer, so the key is there before this process
    # exits and the others see their connections to it close
    _ask_group_store(lambda store: store.add(_INTERRUPTED.format(rank=dist.get_rank()), 1))


def _interrupted_ranks() -> list[int] | None:
    """The other ranks that said in the store that Ctrl-C stopped them
    (:func:`record_interrupted`); ``None`` where the store's process has exited, ``[]`` where
    it does not answer in time (unknown)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = {r: _INTERRUPTED.format(rank=r) for r in range(world) if r != rank}
    how, found = _ask_group_store(lambda store: [r for r, k in keys.items() if store.check([k])])
    return None if how == "gone" else found or []


def other_rank_gone(err: BaseException, what: str = "") -> OtherRankGoneError | None:
    """The one-line :class:`OtherRankGoneError` for ``err`` when it is gloo's error for a
    collective whose peer process has exited ("Connection closed by peer", raised as a
    ``RuntimeError`` of its C++ source location with a ~100-line traceback); ``None`` for
    any other error.

    The message names the rank that exited where that is known: one that Ctrl-C stopped says
    so in the store first (:func:`record_interrupted`). The store lives in rank 0's process
    (the ``env://`` rendezvous of srun's tasks, or of torchrun with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) or in torchrun's agent
    (``TORCHELASTIC_USE_AGENT_STORE=True``): where it is rank 0's and a call to it fails,
    rank 0 has exited, and says why itself; a store that does not answer within
    :data:`_STORE_TIMEOUT_S` (its process stopped, or its host cut off) names no rank.

    Args:
        err: the error a collective raised.
        what: where the ranks were, if known (see :func:`collective_timeout`).
    """
    if (
        not isinstance(err, RuntimeError)
        or isinstance(err, FotError)
        or _PEER_GONE.search(str(err)) is None
    ):
        return None
    where = f" {what}" if what else ""
    waited = f"{where} while this one waited for it in a collective, and this one stops too"
    interrupted = _interrupted_ranks() if dist.is_initialized() else []
    if interrupted:
        ranks = ", ".join(map(str, interrupted))
        was = "ranks {} were" if len(interrupted) > 1 else "rank {} was"
        return OtherRankGoneError(
            f"{was.format(ranks)} interrupted (Ctrl-C or SIGINT to it){waited}"
        )
    codes = "the launcher's summary of exit codes (130: Ctrl-C or SIGINT to it)"
    if (
        interrupted is None
        and dist.get_rank() != 0
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True)
    ):
        return OtherRankGoneError(f"rank 0 exited{waited}: its output, or {codes}, says why")
    return OtherRankGoneError(
        f"another process of the run exited{waited}: that process's output, or {codes}, "
        "says which one and why"
    )


@contextlib.contextmanager
def naming_timeouts(what: str = "") -> Iterator[None]:
    """Raise a collective's timeout inside the block as :func:`collective_timeout`'s one-line
    error, and gloo's error for a peer process that has exited as :func:`other_rank_gone`'s
    (the C++ message as the cause); any other error as it is.

    Args:
        what: where the other ranks were, for the message (see :func:`collective_timeout`).
    """
    try:
        yield
    except RuntimeError as err:
        named = collective_timeout(err, what) or other_rank_gone(err, what)
        if named is None:
            raise
        raise named from err


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def resolve_strategy(cfg: ParallelConfig, info: DistInfo) -> str:
    """The strategy to use: ``single``, ``ddp`` or ``fsdp`` (``auto`` resolved)."""
    if cfg.strategy not in STRATEGIES:
        raise ValueError(not_one_of("parallel.strategy", cfg.strategy, STRATEGIES))
    if cfg.strategy == "auto":
        return "ddp" if info.distributed else "single"
    if cfg.strategy == "single" and info.distributed:
        raise ValueError(
            f"parallel.strategy=single but torchrun started {info.world_size} processes; use "
            "parallel=ddp or parallel=fsdp, or run without torchrun"
        )
    if cfg.strategy == "ddp" and not dist.is_initialized() and not info.distributed:
        if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:
            # torchrun --nproc_per_node=1 (a launcher with a variable process count): DDP of
            # one process is one process
            logger.warning("parallel.strategy=ddp with one process: training as parallel=single")
            return "single"
        # refused here, before the trainer makes the run folder and builds the model
        raise ValueError(
            "parallel.strategy=ddp needs torchrun (e.g. `torchrun --nproc_per_node=2 "
            "train.py ...`); for one process use parallel=single"
        )
    if cfg.strategy == "fsdp" and info.distributed and dist.is_initialized():
        check_fsdp_backend(dist.get_backend(), torch.__version__)
    return cfg.strategy


def check_fsdp_backend(backend: str, torch_version: str) -> None:
    """Refuse FSDP2 over gloo (the CPU's backend) with a torch older than 2.9, whose FSDP2
    sums the gradients there instead of averaging them: the gradient norm, its clipping and
    the logged norm would be ``world_size`` times too large, without any error.

    Args:
        backend: the process group's backend (``dist.get_backend()``).
        torch_version: ``torch.__version__``, e.g. ``"2.8.0+cu128"``.

    Raises:
        ValueError: gloo with a torch older than :data:`FSDP_GLOO_MIN_TORCH`.
    """
    release = tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2])
    if backend == "gloo" and release < FSDP_GLOO_MIN_TORCH:
        need = ".".join(map(str, FSDP_GLOO_MIN_TORCH))
        raise ValueError(
            f"parallel=fsdp over gloo needs torch >= {need}: torch {torch_version}'s FSDP2 sums "
            "the gradients over gloo instead of averaging them (pytorch/pytorch#162338): they, "
            "their clipping and the logged grad_norm would be world-size times too large. "
            f"Upgrade torch (pip install 'torch>={need}'), use parallel=ddp, "
            "or run FSDP on GPUs (nccl)"
        )


def autocast_dtype(cfg: ParallelConfig, device: torch.device) -> torch.dtype | None:
    """bf16 when asked (or ``auto`` on CUDA); ``None`` for fp32."""
    if cfg.precision not in PRECISIONS:
        raise ValueError(not_one_of("parallel.precision", cfg.precision, PRECISIONS))
    if cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def autocasts(cfg: ParallelConfig, strategy: str) -> bool:
    """Whether training runs under autocast (when :func:`autocast_dtype` gives one): always,
    except FSDP2 with bf16 parameters (``parallel.param_precision=bf16``), which casts them
    itself."""
    return strategy != "fsdp" or getattr(cfg, "param_precision", "bf16") == "fp32"


def compute_precision(cfg: ParallelConfig, strategy: str, device: torch.device) -> str:
    """How a run computes, in words (recorded in its checkpoints; a resume that computes
    otherwise is named): ``fp32``, ``bf16 autocast over fp32 weights`` or, for FSDP2 with
    ``parallel.param_precision=bf16``, ``bf16 parameters``."""
    if autocast_dtype(cfg, device) is None:
        return "fp32"
    return "bf16 autocast over fp32 weights" if autocasts(cfg, strategy) else "bf16 parameters"


def _blocks(model: nn.Module) -> nn.ModuleList:
    # The decoder is `model` (ours, HF LLaMA, FLA's DeltaNet/HGRN2) or `backbone` (FLA's
    # Mamba-2 and Samba).
    for name in ("model", "backbone"):
        layers = getattr(getattr(model, name, None), "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise TypeError(
        f"{type(model).__name__} has no `model.layers` or `backbone.layers` ModuleList; "
        "parallelize needs the blocks to shard, compile and checkpoint them one by one"
    )


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def parallelize(
    model: nn.Module, cfg: ParallelConfig, info: DistInfo, *, strategy: str
) -> nn.Module:
    """Apply activation checkpointing, per-block compile and DDP/FSDP2 to ``model``.

    The order follows torchtitan: checkpoint each block, compile each block, then shard each
    block and the root (FSDP2) or wrap the whole model (DDP). Checkpointing and compile act on
    each block in place, so parameter names (and checkpoints) do not change.

    Args:
        model: the model on ``info.device`` in fp32; its blocks are ``model.model.layers``.
        cfg: ``parallel`` config.
        info: from :func:`init_distributed`.
        strategy: from :func:`resolve_strategy`.

    Returns:
        The model to train: a DDP wrapper for ``ddp``, the same object otherwise (``single``,
        ``fsdp``, and ``ddp`` with ``cfg.cuda_graphs``, whose training step then averages the
        gradients with :func:`all_reduce_gradients`).
    """
    blocks = _blocks(model)
    if cfg.activation_checkpointing:
        for block in blocks:
            block.forward = functools.partial(_checkpointed, block.forward)
    if cfg.compile:
        for block in blocks:
            block.compile()
    if cfg.reduce_precision not in REDUCE_PRECISIONS:
        raise ValueError(
            not_one_of("parallel.reduce_precision", cfg.reduce_precision, REDUCE_PRECISIONS)
        )
    fsdp_only = [f"parallel.{k}=true" for k in ("reshard_after_forward", "reshard_after_backward")
                 if getattr(cfg, k)]  # fmt: skip
    if strategy != "fsdp" and fsdp_only:
        logger.warning(
            "%s: no effect with parallel=%s; it sets how FSDP2 frees gathered parameters "
            "(parallel=fsdp)",
            " and ".join(fsdp_only),
            strategy,
        )
    if strategy != "fsdp" and getattr(cfg, "param_precision", "bf16") != "bf16":
        logger.warning(
            "parallel.param_precision=%s has no effect with parallel=%s (it keeps fp32 "
            "weights under autocast); it sets FSDP2's parameters (parallel=fsdp)",
            cfg.param_precision,
            strategy,
        )
    if strategy == "single":
        if cfg.reduce_precision != "fp32":
            logger.warning(
                "parallel.reduce_precision=%s has no effect in a single process (no gradients "
                "are reduced); it sets FSDP2's gradient reduction (parallel=fsdp)",
                cfg.reduce_precision,
            )
        return model
    if strategy == "ddp" and cfg.reduce_precision != "fp32":
        raise ValueError(
            f"parallel.reduce_precision={cfg.reduce_precision} needs parallel=fsdp; DDP reduces "
            "in fp32 (set parallel.reduce_precision=fp32)"
        )
    if strategy == "fsdp" and not dist.is_initialized():
        # One process (no torchrun, or torchrun with one): FSDP2 needs a process group, so
        # make one of size 1 (same numerics as N processes: parameters cast by the policy).
        backend = "nccl" if info.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        atexit.register(_destroy)
    if not dist.is_initialized():
        raise ValueError(
            f"parallel.strategy={strategy} needs torchrun (e.g. `torchrun "
            "--nproc_per_node=2 train.py ...`); for one process use parallel=single"
        )
    if strategy == "ddp" and cfg.cuda_graphs:
        # A CUDA graph replays kernels, not DDP's autograd hooks: the step averages the
        # gradients itself (all_reduce_gradients); the ranks start from rank 0's weights.
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
        return model
    if strategy == "ddp":
        return wrap_ddp(model, info.device)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if getattr(cfg, "param_precision", "bf16") not in PARAM_PRECISIONS:
            raise ValueError(
                not_one_of("parallel.param_precision", cfg.param_precision, PARAM_PRECISIONS)
            )
        dtype = autocast_dtype(cfg, info.device) if not autocasts(cfg, strategy) else None
        mp = MixedPrecisionPolicy(
            param_dtype=dtype or torch.float32,
            reduce_dtype=REDUCE_PRECISIONS[cfg.reduce_precision],
        )
        # fully_shard replaces every parameter with a sharded one, without its attributes:
        # the `_no_weight_decay` flag (FLA's, e.g. on Mamba's A_log) is set again on its
        # successor, for the optimizer's parameter groups
        flagged = {n for n, p in model.named_parameters() if getattr(p, "_no_weight_decay", False)}
        for block in blocks:
            fully_shard(block, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        fully_shard(model, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
        for name, p in model.named_parameters():
            if name in flagged:
                p._no_weight_decay = True
        if hasattr(model, "per_token_loss"):
            from torch.distributed.fsdp import register_fsdp_forward_method

            # evaluation calls per_token_loss, not forward: it must all-gather too
            register_fsdp_forward_method(model, "per_token_loss")
        return model
    raise ValueError(f"unknown strategy {strategy!r}")


def accumulation(
    model: nn.Module, strategy: str, *, last: bool, cfg: ParallelConfig
) -> contextlib.AbstractContextManager:
    """The context for one micro batch's forward and backward when a step accumulates
    gradients over several: only the step's ``last`` micro batch reduces gradients over the
    ranks (DDP ``no_sync`` before it; FSDP2 ``set_requires_gradient_sync``), and unless
    ``cfg.reshard_after_backward`` FSDP2 keeps the gathered parameters from one micro batch to
    the next (``set_reshard_after_backward``), so each block is all-gathered once per step.
    With one micro batch per step (``last`` always true) nothing changes. ``single``: no-op.
    """
    if strategy == "ddp" and not last and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if strategy == "fsdp":
        model.set_requires_gradient_sync(last)
        if not cfg.reshard_after_backward:
            model.set_reshard_after_backward(last)
    return contextlib.nullcontext()


def wrap_ddp(model: nn.Module, device: torch.device) -> DistributedDataParallel:
    """``model`` in DDP on ``device`` (its CUDA device or the CPU), with gradients that are
    views of DDP's all-reduce buckets (``gradient_as_bucket_view``): no second copy of the
    gradients (3 GiB in float32 at 760M) and no copies into and out of the buckets each step.
    Zero the gradients with ``zero_grad(set_to_none=False)``: set to None, the micro batches
    that accumulate without syncing (``no_sync``) allocate new gradients until the syncing
    one points them at the buckets again, and the copy is back."""
    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, gradient_as_bucket_view=True)


def settle_ddp_buckets(model: DistributedDataParallel, loss: Callable[[], torch.Tensor]) -> None:
    """Let DDP rebuild its gradient buckets before this process's first training step.

    DDP all-reduces its first backward in one bucket and then rebuilds the buckets in the
    order the gradients became ready. Over 3 or more ranks the all-reduce's sum of an entry
    rounds according to where the entry lies in its bucket (2 ranks add in either order
    alike), so the first step of each process rounded its gradients otherwise than the same
    step after the rebuild: a resumed run left the uninterrupted one's weights in the last
    bit. Here one backward of ``loss() * 0`` (gradients discarded, torch's RNG state kept)
    records that order, so every training step of every start uses the rebuilt buckets.

    Args:
        model: the DDP-wrapped model, before its first backward.
        loss: one micro batch's forward through ``model``, returning its loss (a scalar).
    """
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        (loss() * 0).backward()
    model.zero_grad(set_to_none=False)


def unwrap(model: nn.Module) -> nn.Module:
    """The model under a DDP wrapper (the model itself otherwise)."""
    return getattr(model, "module", model)


def all_reduce_gradients(params: Sequence[nn.Parameter], world_size: int) -> None:
    """Average the gradients of ``params`` over the ranks, as DDP does, with one all-reduce per
    gradient dtype: each gradient divided by ``world_size``, then summed (DDP's order).

    What ``parallel=ddp parallel.cuda_graphs=true`` runs after a step's last backward: a CUDA
    graph captures this all-reduce, where DDP's reduction hooks would not replay. Costs one
    flat copy of the gradients.

    Args:
        params: the model's trainable parameters, in the same order on every rank; each must
            have a gradient (any shape; gradients of one dtype share an all-reduce).
        world_size: the number of ranks.

    Raises:
        ValueError: a parameter has no gradient (every rank must reduce the same tensors).
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for i, p in enumerate(params):
        if p.grad is None:
            raise ValueError(
                f"parameter {i} {tuple(p.shape)} got no gradient in this step: with "
                "parallel.cuda_graphs=true every trainable parameter must take part in the loss"
            )
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
        flat.div_(world_size)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        parts = flat.split([g.numel() for g in grads])
        torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(parts, grads, strict=True)])


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (no-op in a single process).

    NCCL reduces CUDA tensors only: a CPU tensor (a token count, say) goes through the current
    CUDA device and back.
    """
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_backend() == "nccl" and not t.is_cuda:
            buf = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
            t.copy_(buf)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier() -> None:
    """Wait for all ranks (no-op in a single process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class OtherRankError(FotError, RuntimeError):
    """Another process of the run stopped it with an error, which the message repeats; this
    process stops with it (:func:`stop_together`)."""


@contextlib.contextmanager
def stop_together(what: str) -> Iterator[None]:
    """Every rank enters the block, around work that some ranks do alone (rank 0 writes a
    checkpoint, a metrics record, the HF export); at its end the ranks agree: if the block
    raised on some rank, that rank raises its own error and every other rank raises
    :class:`OtherRankError`, which names it. Without this the others went on into the next
    collective and waited there for the rank that had stopped: over gloo until its process
    had exited (then with a traceback of "Connection closed by peer"), over NCCL until the
    process group's timeout (10 minutes or more of idle GPUs; under srun no launcher stops
    them). A no-op in a single process. Ctrl-C (``KeyboardInterrupt``) is not caught.

    Args:
        what: what the block does, for the other ranks' message (e.g. ``"while writing the
            checkpoint of step 4"``).
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    failure: Exception | None = None
    try:
        yield
    except Exception as err:
        failure = err
    own = None
    if failure is not None:
        own = str(failure) or type(failure).__name__
        if not isinstance(failure, USER_ERRORS):  # a bug: its traceback is that rank's
            own = f"{type(failure).__name__}: {own} (its traceback is in that rank's output)"
    # one small all-reduce when all went well: the first rank that failed, or world_size
    world = dist.get_world_size()
    first = torch.tensor([world if failure is None else dist.get_rank()])
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        first = first.to(torch.device("cuda", torch.cuda.current_device()))
    with naming_timeouts(what):  # a rank that stays in the block too long (or dies there)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        rank = int(first.item())
        if rank == world:
            return
        box = [own]
        dist.broadcast_object_list(box, src=rank)  # its message
    if failure is not None:
        raise failure
    raise OtherRankError(f"rank {rank} stopped the run {what}: {box[0]}")
