"""The training loop: read it top to bottom in :func:`train`.

One optimizer step consumes one global batch of ``global_batch_tokens`` tokens: each rank
takes its share of the batch's sequences and accumulates gradients over micro batches. The
loss of every micro batch is weighted by its share of the global number of label tokens, so
the gradient is that of the mean loss over the whole global batch, whatever the world size and
micro-batch size.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fot.data.streams import (
    Batch,
    SequenceStream,
    ZarrRowsSource,
    check_token_ids,
    clamp_token_ids,
    first_bad_token_id,
    iterate_eval_batches,
    make_batch,
    token_id_error,
)
from fot.errors import FotError, cannot_write
from fot.progress import on_terminal, progress_bar
from fot.provenance import git_sha, library_versions, sweep_folder
from fot.training import checkpoint as ckpt
from fot.training.config import ScheduleConfig, check_config, to_container
from fot.training.cuda_graph import GraphedStep, check_cuda_graphs
from fot.training.init_weights import TOKENIZER_FOLDER, run_tokenizer
from fot.training.metrics import (
    FlopCounter,
    MetricsLogger,
    abandon_newer_records,
    peak_flops_per_device,
    peak_memory_gib,
    read_records,
)
from fot.training.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from fot.training.parallel import (
    DistInfo,
    accumulation,
    all_reduce_gradients,
    all_reduce_sum,
    autocast_dtype,
    autocasts,
    barrier,
    compute_precision,
    init_distributed,
    naming_timeouts,
    parallelize,
    resolve_strategy,
    settle_ddp_buckets,
    stop_together,
    unwrap,
)
from fot.training.profiling import StepProfiler
from fot.training.signals import StopOnSigterm, TrainingStopped

logger = logging.getLogger("fot.train")


class TrainingDivergedError(FotError, FloatingPointError):
    """The loss or gradient norm became NaN/inf; the last checkpoint was left untouched."""


class TrainingOutOfMemoryError(FotError, RuntimeError):
    """The GPU ran out of memory in a training step or in validation; the message says which
    settings to change. Checkpoints already written are untouched."""


def _out_of_memory_error(
    err: BaseException,
    cfg: Any,
    *,
    phase: str,
    step: int,
    strategy: str,
    device: torch.device,
) -> TrainingOutOfMemoryError:
    """Turn torch's out-of-memory error into one that names the settings that use less memory.

    Args:
        err: the ``torch.OutOfMemoryError``.
        cfg: the training config.
        phase: ``"training"`` (a forward/backward/optimizer step) or ``"validation"``.
        step: the step that ran out (1-based; for validation, the step after which it ran).
        strategy: the resolved parallel strategy (``single``, ``ddp``, ``fsdp``).
        device: this rank's device.
    """
    T = int(cfg.data.seq_len)
    # torch's message: its first two sentences say how much was asked for (the rest is tips)
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else "out of memory"
    first_line = ". ".join(first_line.split(". ")[:2]).rstrip(".")
    usage = ""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        usage = f"; {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB of {total:.1f} GiB"
        usage += " allocated at the peak"
    if phase == "validation":
        micro = int(cfg.val_micro_batch_size or cfg.micro_batch_size)
        fixes = []
        if micro > 1:
            fixes.append(
                f"lower val_micro_batch_size (now {micro}; it changes validation only, not the "
                "training)"
            )
        fixes.append("set data.val_tokens=0 to train without validation")
        what = f"validation after step {step}: {micro} × {T}-token sequences per forward pass"
    else:
        micro = int(cfg.micro_batch_size)
        fixes = []
        if micro > 1:
            fixes.append(
                f"lower micro_batch_size (now {micro}; global_batch_tokens stays, so each step "
                "runs more micro batches and trains the same)"
            )
        if not cfg.parallel.activation_checkpointing:
            fixes.append(
                "set parallel.activation_checkpointing=true (each block's activations are "
                "recomputed in the backward: less memory, more compute)"
            )
        if strategy != "fsdp":
            fixes.append(
                "shard the parameters, gradients and optimizer state over several GPUs with "
                "parallel=fsdp (torchrun --nproc_per_node=N)"
            )
        else:
            fixes.append("run parallel=fsdp on more GPUs")
        if micro == 1:
            fixes.append("shorten data.seq_len or use a smaller model")
        what = f"training step {step}: micro batches of {micro} × {T} tokens ({strategy})"
    return TrainingOutOfMemoryError(
        f"{device} ran out of memory in {what}{usage} ({first_line}). To fit: "
        + "; or ".join(fixes)
        + ". Checkpoints already written are untouched (resume=auto continues from the latest)"
    )


def check_sizes(cfg: Any, world_size: int, *, resuming: Path | None = None) -> tuple[int, int]:
    """Validate batch/sequence/world sizes; return ``(global_sequences, total_steps)``.

    Args:
        cfg: the training config.
        world_size: processes in the run.
        resuming: the checkpoint the run resumes from, whose ``global_batch_tokens`` this run
            has: a batch that does not split over the processes is then fixed by another
            process count or micro batch, not by another batch (the resume would refuse it).

    Raises:
        ValueError: with the sizes involved and what to change.
    """
    T = int(cfg.data.seq_len)
    gbt = int(cfg.global_batch_tokens)
    if T < 2:
        raise ValueError(f"data.seq_len must be >= 2, got {T}")
    m = int(cfg.micro_batch_size)
    if m < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {m}")
    if gbt < T or gbt % T:
        unit = T * world_size * m  # also splits over the processes and micro batches
        raise ValueError(
            f"global_batch_tokens={gbt} must be a positive multiple of data.seq_len={T} "
            f"(e.g. global_batch_tokens={max(1, round(gbt / unit)) * unit})"
        )
    seqs = gbt // T
    if seqs % (world_size * m):
        split = world_size * m
        fixes = [] if resuming else [f"global_batch_tokens={-(-seqs // split) * split * T}"]
        if seqs % world_size == 0:
            per_rank = seqs // world_size
            fixes.append(f"micro_batch_size={max(d for d in range(1, m) if per_rank % d == 0)}")
        if resuming:
            # the process counts nearest this one that split the batch with this micro batch
            fit = [w for w in range(1, seqs // m + 1) if seqs % (w * m) == 0]
            below = [w for w in fit if w < world_size][-1:]
            above = [w for w in fit if w > world_size][:1]
            fixes += [f"{w} processes" if w > 1 else "1 process" for w in below + above]
        raise ValueError(
            f"a global batch of {seqs} sequences (global_batch_tokens={gbt} / seq_len={T}) "
            f"cannot be split over {world_size} process(es) x micro_batch_size={m}; the number "
            f"of sequences must be a multiple of world_size * micro_batch_size = {split} "
            + (
                f"(the run resumes from {resuming}, whose global_batch_tokens={gbt} must stay: "
                if resuming
                else "("
            )
            + f"e.g. {' or '.join(fixes)})"
        )
    total = int(cfg.total_tokens)
    if total < gbt:
        raise ValueError(
            f"total_tokens={total} is less than one global batch ({gbt} tokens); raise "
            "total_tokens or lower global_batch_tokens"
        )
    for key in ("log_every_tokens", "val_every_tokens", "ckpt_every_tokens"):
        if int(cfg[key]) < 0:
            raise ValueError(f"{key} must be >= 0, got {cfg[key]}")
    if int(cfg.keep_last) < 1:
        raise ValueError(f"keep_last must be >= 1, got {cfg.keep_last}")
    return seqs, total // gbt


def _crossed(before: int, after: int, every: int) -> bool:
    return every > 0 and after // every > before // every


def _clamp1(n: int | torch.Tensor) -> int | torch.Tensor:
    return n.clamp(min=1) if isinstance(n, torch.Tensor) else max(n, 1)


def _diverged_message(
    *,
    bad_step: int,
    loss: float,
    grad_norm: float,
    tokens: int,
    lr: float,
    detected_step: int,
    last_ckpt: Path | None,
) -> str:
    where = (
        f"the last checkpoint ({last_ckpt}) is untouched"
        if last_ckpt
        else "no checkpoint was written"
    )
    lost = (
        f" (found at step {detected_step}, the next log/validation/checkpoint boundary; the "
        f"optimizer steps {bad_step}-{detected_step} are lost)"
        if detected_step != bad_step
        else ""
    )
    return (
        f"loss={loss}, grad_norm={grad_norm} at step {bad_step} (tokens {tokens}, lr {lr:.3g})"
        f"{lost}; {where}. Hints: lower optim.lr, lengthen schedule.warmup_tokens, use "
        "parallel.precision=fp32 to rule out bf16 overflow, then resume=auto"
    )


def model_config_from_train_config(cfg: Any) -> Any:
    """The HF model config a training config selects: ``fot.presets.config(model, size, **ov)``.

    Args:
        cfg: the training config (``cfg.model.name``, ``cfg.model.overrides``, ``cfg.size.name``).
    """
    from fot import presets

    overrides = (
        OmegaConf.to_container(cfg.model.overrides, resolve=True)
        if isinstance(cfg.model.overrides, DictConfig)
        else dict(cfg.model.overrides)
    )
    return presets.config(cfg.model.name, cfg.size.name, **overrides)


def _data_size_note(source: Any, global_seqs: int, total_steps: int) -> tuple[int, str] | None:
    """``(logging level, message)``: a warning when the training data holds fewer sequences
    than one global batch (every step reads some of them twice or more), a note of how many
    times the run reads it when more than once; ``None`` otherwise and for a source of
    unknown size (a streamed HF split)."""
    held = getattr(source, "num_sequences", None)
    if not isinstance(held, int) or held <= 0:
        return None
    seq_len = int(source.seq_len)
    if held < global_seqs:
        return logging.WARNING, (
            f"the training data holds {held} sequences of data.seq_len={seq_len} tokens, fewer "
            f"than one global batch ({global_seqs} sequences): every step reads some of them "
            "more than once. Use more data, or a smaller global_batch_tokens"
        )
    passes = total_steps * global_seqs / held
    if passes <= 1:
        return None
    return logging.INFO, (
        f"the training data holds {held} sequences of data.seq_len={seq_len} tokens and the "
        f"run reads {total_steps * global_seqs}: it reads the data {passes:.3g} times"
    )


def _screen_token_ids(
    batches: Sequence[Batch], vocab_size: int, *, what: str, world_size: int
) -> tuple[list[Batch], int | None]:
    """:func:`check_token_ids` in one process. With several, one rank raising alone would
    leave the others waiting in the step's collectives (a peer's connection error on gloo,
    NCCL's timeout under srun): a rank's batches with an id outside ``[0, vocab_size)`` are
    computed with their ids clamped into it, and the bad id is returned, for every rank to
    raise together at the next sync (:func:`_token_ids_error_of_ranks`; no checkpoint or
    validation comes before it)."""
    if world_size == 1:
        check_token_ids(batches, vocab_size, what=what)
        return list(batches), None
    bad = first_bad_token_id(batches, vocab_size)
    if bad is None:
        return list(batches), None
    return [clamp_token_ids(b, vocab_size) for b in batches], bad


def _token_ids_error_of_ranks(own: int | None, vocab_size: int, *, what: str) -> ValueError:
    """The error every rank raises when some rank's ``what`` held a token id outside the
    vocabulary: that rank names its id (``own``), the others point to it."""
    if own is not None:
        return token_id_error(own, vocab_size, what=what)
    return ValueError(
        f"the {what} of another rank holds token ids outside the model's vocabulary [0, "
        f"{vocab_size}) (that rank's error names one): it was tokenized with another "
        "tokenizer, or is not a token file. Re-tokenize it with `python -m fot.data.prepare` "
        "(GPT-2 BPE)"
    )


@torch.no_grad()
def evaluate(
    model: nn.Module,
    source: Any,
    *,
    num_sequences: int,
    micro_batch_size: int,
    info: DistInfo,
    amp_dtype: torch.dtype | None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, float] | None:
    """Held-out loss, overall and over the last 512/1k/.../T positions of each sequence.

    Args:
        model: the (possibly wrapped) model; ``per_token_loss`` is called on it.
        source: held-out sequence source.
        num_sequences: sequences to evaluate (a multiple of ``world_size * micro_batch_size``
            so every rank runs the same number of forward passes).
        micro_batch_size: sequences per forward pass.
        info: distributed info.
        amp_dtype: autocast dtype or ``None``.
        should_stop: asked before every forward pass, on every rank (it may be a collective,
            as :meth:`StopOnSigterm.agreed` is); once it says yes the validation ends early.

    Returns:
        ``{"val/loss": ..., "val/loss_last_512": ..., ..., "val/loss_last_<T>": ...}``, or
        ``None`` if ``should_stop`` ended it early.
    """
    T = source.seq_len
    sums = torch.zeros(T, dtype=torch.float64, device=info.device)
    counts = torch.zeros(T, dtype=torch.float64, device=info.device)
    inner = unwrap(model)
    was_training = inner.training
    vocab_size = int(inner.config.vocab_size)
    own_bad: int | None = None  # a token id outside the vocabulary in this rank's share
    inner.eval()
    amp = (
        torch.autocast(info.device.type, dtype=amp_dtype)
        if amp_dtype is not None
        else contextlib.nullcontext()
    )
    for batch in iterate_eval_batches(
        source,
        num_sequences=num_sequences,
        micro_batch_size=micro_batch_size,
        rank=info.rank,
        world_size=info.world_size,
    ):
        if should_stop is not None and should_stop():
            inner.train(was_training)
            return None
        [batch], bad = _screen_token_ids(
            [batch], vocab_size, what="held-out data", world_size=info.world_size
        )
        if bad is not None and own_bad is None:
            own_bad = bad
        b = batch.to(info.device)
        with amp:
            losses = inner.per_token_loss(b.input_ids, b.labels, cu_seqlens=b.cu_seqlens)
        valid = (b.labels != -100).reshape(-1, T)
        sums += (losses.float().reshape(-1, T) * valid).sum(0).double()
        counts += valid.sum(0).double()
    inner.train(was_training)
    all_reduce_sum(sums)
    all_reduce_sum(counts)
    if info.world_size > 1:  # every rank raises, not only the one whose share held the id
        bad_ranks = torch.tensor([float(own_bad is not None)], device=info.device)
        if all_reduce_sum(bad_ranks).item():
            raise _token_ids_error_of_ranks(own_bad, vocab_size, what="held-out data")
    out = {"val/loss": float(sums.sum() / counts.sum().clamp(min=1))}
    k = 512
    lasts = []
    while k < T:
        lasts.append(k)
        k *= 2
    lasts.append(T)
    for k in lasts:
        out[f"val/loss_last_{k}"] = float(sums[T - k :].sum() / counts[T - k :].sum().clamp(min=1))
    return out


def export_hf_folder(
    model: nn.Module,
    hf_config: Any,
    out: Path,
    *,
    is_main: bool,
    text_escaping: str = "none",
    tokenizer: Path | None = None,
) -> Path | None:
    """Gather the full weights and write an HF folder (weights, config, tokenizer) on rank 0;
    ``text_escaping`` (``fot.tokenizer.TEXT_ESCAPINGS``) is recorded with the tokenizer, which
    is GPT-2's, or that of the folder ``tokenizer`` (:func:`export_with_tokenizer`)."""
    state = ckpt.gather_model_state(model)
    with stop_together(f"while exporting to {out}"):  # rank 0's failure stops every rank
        if is_main:
            export_with_tokenizer(
                _cpu_model(hf_config, state), out, text_escaping, tokenizer, run_export=True
            )
    return out if is_main else None


def export_with_tokenizer(
    model: nn.Module,
    out: Path,
    text_escaping: str,
    tokenizer: Path | None,
    *,
    run_export: bool = False,
) -> Path:
    """:func:`fot.export.export_hf` with GPT-2's tokenizer, or, where ``tokenizer`` is a folder
    (a run's :data:`fot.training.init_weights.TOKENIZER_FOLDER`), with that folder's tokenizer
    files and its bos, eos and pad token ids in the model's config and generation config.
    ``run_export``: ``out`` is the run's own ``<run>/hf``, which this replaces."""
    from fot.export import export_hf

    if tokenizer is None or not tokenizer.is_dir():
        return export_hf(model, out, text_escaping=text_escaping, replace_run_export=run_export)
    from transformers import AutoTokenizer

    from fot.convert import copy_tokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(tok, key))
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, key, getattr(tok, key))
    export_hf(model, out, tokenizer=False, replace_run_export=run_export)
    copy_tokenizer(tokenizer, out, text_escaping)
    return out


def _carry_tokenizer(source: Path | None, folder: Path) -> None:
    """Make ``folder`` (a run's :data:`fot.training.init_weights.TOKENIZER_FOLDER`) a copy of
    the tokenizer folder ``source``, or remove it where ``source`` is None (a run started over
    in its folder exports GPT-2's tokenizer again).

    The earlier ``folder`` is set aside (``.tokenizer.old-{host}.{pid}``) until the new one is
    in place, never deleted before: a kill between the two leaves it whole beside the run, for
    a resume to put back (:func:`_recover_tokenizer`), which exports it with the checkpoints
    of the folder."""
    from fot.convert import copy_tokenizer

    if source is not None and source.resolve() == folder.resolve():
        return  # init_from a checkpoint of this folder's own earlier run
    from fot.staging import ended_writers, remove, set_aside_name, writer_tag

    # copies and earlier tokenizers a killed start left (its lock is this run's now: their
    # writers have ended); this start chooses the tokenizer
    new, old = f".{folder.name}.new-", f".{folder.name}.old-"
    remove([*ended_writers(folder.parent, new), *ended_writers(folder.parent, old)])
    staged = folder.with_name(f"{new}{writer_tag()}")
    if source is not None:  # copied whole, then renamed: a kill leaves no part of it
        staged.mkdir()
        copy_tokenizer(source, staged, "none")
    aside = None
    if os.path.lexists(folder):
        aside = set_aside_name(folder.parent, old)
        os.rename(folder, aside)
    if source is not None:
        os.rename(staged, folder)
    if aside is not None:  # deleted under the staged name: a set-aside one is always whole
        os.rename(aside, staged)
        shutil.rmtree(staged, ignore_errors=True)


def _recover_tokenizer(folder: Path) -> None:
    """At a resume, put back the run's tokenizer ``folder`` where a start killed while
    replacing it (:func:`_carry_tokenizer`) left it set aside and no ``folder``, with a
    warning; remove the staged copies and set-aside tokenizers of such starts otherwise."""
    from fot.staging import ended_writers, remove

    asides = ended_writers(folder.parent, f".{folder.name}.old-")
    if asides and not os.path.lexists(folder):
        back = asides.pop()
        os.rename(back.path, folder)
        logger.warning(
            "put back the run's tokenizer %s from %s, where a start of a run in this folder "
            "(%s) set it aside to replace it and did not finish (killed?)",
            folder,
            back.path,
            back.writer(),
        )
    remove([*ended_writers(folder.parent, f".{folder.name}.new-"), *asides])


def _cpu_model(hf_config: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """The model of ``hf_config`` built on the CPU with the full weights ``state``.

    Raises:
        RuntimeError: ``state`` does not fit the model (``load_state_dict``).
    """
    from fot import presets

    with torch.device("cpu"):
        model = presets.build_model(hf_config)
    model.load_state_dict(state)
    return model


def export_settings(cfg: Any) -> tuple[int, str]:
    """``(train_length, text_escaping)`` that an export of a run of config ``cfg`` records:
    ``data.seq_len`` (fot.eval marks it on plots and takes it as its default length) and
    ``data.text_escaping``, by default ``"json"`` for LongCrawl64 (its token ids are of
    JSON-escaped text), else ``"none"``."""
    escaping = cfg.data.get("text_escaping")  # (absent from the configs of older runs)
    if escaping is None:
        escaping = "json" if cfg.data.kind == "longcrawl64" else "none"
    return int(cfg.data.seq_len), str(escaping)


def checkpoint_config(path: str | os.PathLike) -> DictConfig:
    """The resolved training config that checkpoint ``path`` records (its ``trainer.json``),
    less the ``model.overrides`` its model does not read (:func:`fot.presets.read_overrides`),
    which an older fot took and recorded and this one refuses.

    Raises:
        FileNotFoundError: ``path`` is no complete checkpoint (no ``trainer.json``).
        ckpt.CorruptCheckpointError: ``trainer.json`` cannot be read, or records no model.
    """
    from fot import presets

    saved = ckpt.read_trainer_state(path).get("config")
    if not isinstance(saved, dict) or "model" not in saved or "size" not in saved:
        raise ckpt.CorruptCheckpointError(
            f"checkpoint {path}: its trainer.json records no model config (a checkpoint of an "
            "early fot version): build the model with fot.presets and load its model.pt"
        )
    model = saved["model"]
    with contextlib.suppress(Exception):  # another refusal: named where the model is built
        overrides = model.get("overrides") or {}
        read = presets.read_overrides(model["name"], saved["size"]["name"], overrides)
        if read != overrides:
            model["overrides"] = read
    return OmegaConf.create(saved)


def export_checkpoint(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write training checkpoint ``path`` (``<run>/checkpoints/step_<n>``) as an HF folder
    ``out``, as the run writes its final weights to ``<run>/hf`` (``python -m fot.export``).

    Raises:
        FileNotFoundError, ckpt.CorruptCheckpointError: ``path`` is no readable checkpoint.
        FileExistsError, NotADirectoryError: ``out`` holds other files and no earlier
            export (:func:`fot.export.check_export_folder`), or is a file.
    """
    from fot.export import check_export_folder

    p, o = Path(path), Path(out)
    if not (p / "trainer.json").is_file():
        raise FileNotFoundError(ckpt.not_a_checkpoint(p))
    if (o / "trainer.json").is_file():
        raise FileExistsError(
            f"{o} is a training checkpoint: the export goes into a folder of its own (new, "
            "empty or an earlier export), e.g. <run>/hf_step_<n>"
        )
    check_export_folder(o, example="<run>/hf_step_<n>")
    cfg = checkpoint_config(path)
    hf_config = model_config_from_train_config(cfg)
    hf_config.train_length, escaping = export_settings(cfg)
    state = ckpt.read_model_state(path)
    try:
        model = _cpu_model(hf_config, state)
    except RuntimeError as err:  # trainer.json of one run beside model.pt of another
        from fot.models.fla_baselines import older_samba_widths

        if older_samba_widths(hf_config, {k: v.shape for k, v in state.items()}):
            raise ckpt.CorruptCheckpointError(
                f"checkpoint {path} holds a Samba of an older fot, whose MLPs after Mamba "
                f"layers have FLA's width (hidden_ratio={hf_config.hidden_ratio}); this fot "
                f"builds them with mamba_hidden_ratio={hf_config.mamba_hidden_ratio}. Export it "
                "with the fot version that wrote it (python -m fot.export CHECKPOINT OUT): "
                "that export loads here with its widths"
            ) from None
        raise ckpt.CorruptCheckpointError(
            f"checkpoint {path}: model.pt does not fit the model its trainer.json describes "
            f"({str(err)[:300]}); the folder mixes files of different runs"
        ) from None
    return export_with_tokenizer(model, o, escaping, run_tokenizer(p.parent.parent))


def _from_rank0(obj: Any) -> Any:
    """Rank 0's value of ``obj`` on every rank (``obj`` itself in a single process)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_rank0(read: Callable[[], Any], info: DistInfo, what: str) -> Any:
    """``read()``, called on rank 0 alone, on every rank; an error it raises stops every rank
    with it (:func:`stop_together`, ``what`` saying where), where the others would wait for
    rank 0 in the broadcast until its process had exited, or over NCCL until the timeout."""
    value = None
    with stop_together(what):
        if info.is_main:
            value = read()
    return _from_rank0(value)


def _records_at(path: Path, step: int) -> dict[str, dict[str, Any]]:
    """The records a run logged at ``step`` in its ``metrics.jsonl``: ``{"train": the training
    record (empty if none), "val": the validation values (``val/*`` keys; empty if none)}``;
    a file that cannot be read raises :func:`fot.training.metrics.read_records`'s error."""
    found: dict[str, dict[str, Any]] = {"train": {}, "val": {}}
    for line in read_records(path):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("step") != step:
            continue
        if "loss" in rec:
            found["train"] = rec
        found["val"].update({k: v for k, v in rec.items() if k.startswith("val/")})
    return found


def _logged_elapsed(path: Path, step: int) -> float:
    """The ``elapsed_s`` of the training record of ``step`` in ``metrics.jsonl`` (0 where there
    is none, or the file cannot be read): the run's time at a checkpoint that does not hold it."""
    try:
        return float(_records_at(path, step)["train"].get("elapsed_s") or 0.0)
    except (ValueError, TypeError):
        return 0.0


def validation_sequences(data_cfg: Any, source: Any | None, *, unit: int, warn: bool) -> int:
    """How many held-out sequences each validation reads (a multiple of ``unit``).

    ``data.val_tokens`` rounded up to whole sequences and to ``unit`` (world size x validation
    micro batch, so that every rank runs the same number of forward passes), but never more
    than the held-out source holds: reading past its end would wrap around and count the same
    tokens twice. Logs a warning (when ``warn``) where validation differs from what the config
    asks: no held-out data configured, or less of it than ``data.val_tokens``.
    """
    want = int(data_cfg.val_tokens)
    if source is None:
        if warn and want > 0:
            fix = {
                "tokens": "set data.val_path=<held-out token folder or file> (`python -m "
                "fot.data.prepare ... --heldout-out <folder> --heldout-every N` writes one)",
                "hf": "set data.hf_val_split=<split> (e.g. validation, or a slice of the "
                "training split, quoted for Hydra: 'data.hf_val_split=\"train[:1%]\"' with "
                "'data.hf_split=\"train[1%:]\"')",
            }.get(str(data_cfg.kind), "configure held-out data")
            logger.warning(
                "no validation: data.val_tokens=%d but data=%s has no held-out data; %s, or set "
                "data.val_tokens=0 to run without it",
                want,
                data_cfg.kind,
                fix,
            )
        return 0
    seq_len = int(data_cfg.seq_len)
    num = math.ceil(want / seq_len / unit) * unit
    held = getattr(source, "num_sequences", None)  # None: a stream of unknown length
    if held is None or num <= held:
        if warn and num != math.ceil(want / seq_len):
            logger.warning(
                "validation reads %d sequences (%d tokens), more than data.val_tokens=%d asks: "
                "a multiple of %d (processes x validation micro batch), so that all ranks run "
                "the same forward passes. Runs with another multiple validate on other "
                "sequences; for val/loss comparable across process counts set data.val_tokens "
                "to a multiple of their common multiple x %d tokens",
                num,
                num * seq_len,
                want,
                unit,
                seq_len,
            )
        return num
    fits = held // unit * unit
    if warn:
        if fits:
            logger.warning(
                "validation reads %d sequences (%d tokens), not the %d asked by "
                "data.val_tokens=%d: the held-out data holds only %d sequences of %d tokens, "
                "and every validation reads a multiple of %d (processes x validation micro "
                "batch) so that all ranks run the same forward passes",
                fits,
                fits * seq_len,
                num,
                want,
                held,
                seq_len,
                unit,
            )
        else:
            logger.warning(
                "the held-out data holds %d sequences of %d tokens, fewer than one per rank "
                "and validation micro batch (%d): validation reads %d and so counts some "
                "sequences twice; add held-out data or lower val_micro_batch_size",
                held,
                seq_len,
                unit,
                unit,
            )
    return fits or unit


# The training data's source besides its kind and packing: a run resumes with other values
# (a moved folder, a renamed file) with a warning; validation data may change freely.
DATA_SOURCE_FIELDS = ("path", "hf_name", "hf_data_files", "hf_split", "streaming", "text_field")
_SCHEDULE_FIELDS = ("name", "warmup_tokens", "min_lr_ratio", "decay_fraction", "decay_shape")


def _other_checkpoint_error(
    err: ckpt.CorruptCheckpointError, path: Path, option: str
) -> ckpt.CorruptCheckpointError:
    """``err`` of the checkpoint ``path`` given as ``option`` (``branch_from``, ``init_from``),
    with the way out of another run's checkpoint: not "move it away and rerun with
    resume=auto" (that is for this run's own) but another checkpoint of that run."""
    readable = []
    for other in ckpt.list_checkpoints(path.parent):
        if other.resolve() != path.resolve():
            with contextlib.suppress(Exception):
                ckpt.read_trainer_state(other)
                readable.append(other)
    start = "Branch from" if option == "branch_from" else "Start from"
    way_out = (
        f"{start} another checkpoint of that run, e.g. {option}={readable[-1]} (its "
        f"readable ones: {', '.join(c.name for c in readable)})"
        if readable
        else f"That run has no other readable checkpoint: start the run without {option}"
    )
    return ckpt.CorruptCheckpointError(f"{option}: {err.what}. {way_out}")


def check_resume(
    saved: dict[str, Any],
    cfg: Any,
    path: Path,
    *,
    branching: bool = False,
    compute: str | None = None,
    world_size: int | None = None,
    strategy: str | None = None,
) -> list[str]:
    """Refuse to resume a checkpoint of another model, batch shape or data kind, before any
    tensor loads.

    Args:
        saved: the checkpoint's trainer state (:func:`fot.training.checkpoint.read_trainer_state`).
        cfg: this run's config.
        path: the checkpoint folder (for the message).
        branching: ``path`` is ``branch_from``'s (the message suggests another branch, not
            ``resume=never``, which ``branch_from`` refuses).
        compute: how this run computes (:func:`fot.training.parallel.compute_precision`),
            compared with the checkpoint's record of its run; a checkpoint of an older
            version, which has none, is compared by ``parallel.precision`` and
            ``parallel.param_precision`` as written.
        world_size: this run's process count, compared with the checkpoint run's where the
            checkpoint records it.
        strategy: this run's resolved ``parallel.strategy`` (``single``, ``ddp``, ``fsdp``),
            compared likewise.

    Returns:
        Warnings for the caller to log, one per setting the run resumes with although it
        differs from the checkpoint's: a ``model.overrides`` field of
        :data:`fot.models.configuration_fot.IMPLEMENTATION_FIELDS` (kernel backend, loss
        implementation, chunk size, recomputation: how the same model is computed), the
        precision it is computed in (``compute``) or ``parallel.reduce_precision``, how a
        step's batch is summed (``micro_batch_size``, the process count, the resolved
        ``parallel.strategy``), or a field of
        :data:`DATA_SOURCE_FIELDS` (where the training data is read from; the data position
        is the checkpoint's), other AdamW settings (betas, eps, weight decay, clip),
        or a learning rate that differs from the checkpoint run's at any step left (at the
        next step for a branch; ``optim.lr``, ``schedule``, ``total_tokens``); the run goes on
        with this run's values. Another ``seed`` is named too: it changes nothing in a resumed
        run.

    Raises:
        ValueError: the checkpoint's model (``model.name``, ``size.name``, any other
            ``model.overrides`` field), ``global_batch_tokens``, ``data.seq_len``,
            ``data.kind``, ``data.packing`` or ``data.doc_start_id`` differ from this run's;
            the message names each difference and the ways out.
    """
    from fot.models.configuration_fot import IMPLEMENTATION_FIELDS

    differences, changed = [], []
    for key, value in (
        ("global_batch_tokens", int(cfg.global_batch_tokens)),
        ("data.seq_len", int(cfg.data.seq_len)),
    ):
        was = saved.get("sizes", {}).get(key.removeprefix("data."))
        if was is not None and was != value:
            differences.append(f"{key}={was} (checkpoint) vs {value} (this run)")
    config = saved.get("config")  # absent in checkpoints of older versions
    if isinstance(config, dict):
        now = to_container(cfg)
        was_optim = config.get("optim", {}).get("name", "adamw")
        if was_optim != cfg.optim.name:
            differences.append(
                f"optim.name={was_optim} (checkpoint) vs {cfg.optim.name} (this run): the "
                "optimizer state does not carry over (init_from=<checkpoint> takes only its "
                "weights)"
            )
        for group, key in (("model", "name"), ("size", "name"), ("model", "overrides")):
            was, value = config.get(group, {}).get(key), now[group][key]
            if key == "overrides":
                was, value = dict(was or {}), dict(value or {})
                for field in IMPLEMENTATION_FIELDS:
                    before, after = was.pop(field, "unset"), value.pop(field, "unset")
                    if before != after:
                        changed.append(f"model.overrides.{field}={before} (checkpoint) vs {after}")
            if was != value and not (key == "overrides" and _same_model(cfg, was, value)):
                differences.append(f"{group}.{key}={was} (checkpoint) vs {value} (this run)")
        was_data, data = config.get("data") or {}, now["data"]
        # the saved stream position means nothing in another kind or packing; other document
        # boundaries (doc_start_id) attend within other spans: another training
        for key in ("kind", "packing", "doc_start_id"):
            if key in was_data and was_data[key] != data[key]:
                differences.append(f"data.{key}={was_data[key]} (checkpoint) vs {data[key]}")
        if not differences:
            was_parallel = config.get("parallel") or {}
            keys = ["reduce_precision"]
            was_compute = saved.get("compute_precision")
            if was_compute is not None and compute is not None:
                if was_compute != compute:
                    changed.append(f"compute precision {was_compute} (checkpoint) vs {compute}")
            else:  # an older checkpoint: the settings as written
                keys.append("precision")
                if "fsdp" in (was_parallel.get("strategy"), now["parallel"]["strategy"]):
                    keys.append("param_precision")  # FSDP2's only
            for key in keys:
                if key in was_parallel and was_parallel[key] != now["parallel"].get(key):
                    changed.append(
                        f"parallel.{key}={was_parallel[key]} (checkpoint) vs "
                        f"{now['parallel'].get(key)}"
                    )
            # the same batch, summed in other parts: its gradients round differently
            was_micro = config.get("micro_batch_size")
            if was_micro is not None and was_micro != now["micro_batch_size"]:
                changed.append(
                    f"micro_batch_size={was_micro} (checkpoint) vs {now['micro_batch_size']}"
                )
            was_world = saved.get("sizes", {}).get("world_size")
            if was_world is not None and world_size is not None and was_world != world_size:
                changed.append(f"{was_world} processes (checkpoint) vs {world_size}")
            was_strategy = saved.get("sizes", {}).get("strategy")
            if was_strategy is not None and strategy is not None and was_strategy != strategy:
                changed.append(f"parallel.strategy={was_strategy} (checkpoint) vs {strategy}")
            for key in DATA_SOURCE_FIELDS:
                if key in was_data and was_data[key] != data[key]:
                    changed.append(f"data.{key}={was_data[key]} (checkpoint) vs {data[key]}")
            changed += _optim_changes(config, now, saved, cfg, branching=branching)
    seed_note = []
    if isinstance(config, dict) and config.get("seed", cfg.seed) != cfg.seed:
        seed_note.append(
            f"resuming from {path} with seed={cfg.seed}, but the checkpoint run's seed={config['seed']}"
            " stays: the seed only draws the initial weights, and the weights and random state are "
            "the checkpoint's; to train with another seed, start a new run "
            "(another out_dir, or resume=never)"
        )
    if differences:
        raise ValueError(
            f"cannot resume from checkpoint {path}: it was trained with other settings: "
            + "; ".join(differences)
            + (
                ". A branch needs the checkpoint's values: rerun with them, or branch from "
                "another run's checkpoint (branch_from=...)"
                if branching
                else ". Exact resume needs the checkpoint's values: rerun with them, or start a "
                "new run (another out_dir, or resume=never to train from scratch in this folder)"
            )
        )
    return [
        f"resuming from {path} with {line}"
        if line.startswith(("other optimizer", "another learning"))
        else f"resuming from {path} with another training data source: {line} (this run); the run "
        "goes on at the checkpoint's position in the data stream (if the data only moved, "
        "nothing changes; if it is other data, it is read from that position, not from its "
        "start)"
        if line.startswith("data.")
        else f"resuming from {path} with another implementation setting: {line} (this run); the "
        "model and training state are the checkpoint's, but losses may differ from an "
        "uninterrupted run in rounding"
        for line in changed
    ] + seed_note


def _same_model(cfg: Any, was: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether ``model.overrides`` ``was`` and ``now`` (implementation settings left out) give
    ``cfg``'s model and size the same config: an override set to the value it has anyway (a
    field's default, a LLaMA name for a FoT one) changes nothing, and neither does one that the
    model does not read (:func:`fot.presets.read_overrides`: a run started by an older fot,
    which took it, resumes without it). False where either is refused (the difference is then
    reported as it is)."""
    from fot import presets

    name, size = cfg.model.name, cfg.size.name
    try:
        built = [
            presets.config(name, size, **presets.read_overrides(name, size, o)).to_dict()
            for o in (was, now)
        ]
    except Exception:  # any refusal (ZeroDivisionError of hidden_size=0 too): a difference
        return False
    return built[0] == built[1]


def _optim_changes(
    was: dict[str, Any],
    now: dict[str, Any],
    saved: dict[str, Any],
    cfg: Any,
    *,
    branching: bool = False,
) -> list[str]:
    """What a resumed run changes of the optimizer and the learning rate, for a warning each:
    the run goes on with this config's values (the checkpoint gives only the optimizer state).

    The learning rates of every step left are compared, in either run's length; a branch
    (``branching``) is compared at its next step only: it is meant to end sooner (a WSD branch
    from the stable phase decays where its parent would not have yet)."""
    out: list[str] = []
    gbt = int(cfg.global_batch_tokens)
    if int(saved.get("tokens", 0)) >= int(now["total_tokens"]) // gbt * gbt:
        return out  # no step left to train (a finished run, rerun): nothing goes on with them
    was_optim, optim = was.get("optim") or {}, now["optim"]
    diffs = [
        f"optim.{key}={was_optim[key]} (checkpoint) vs {optim[key]} (this run)"
        for key in (
            "betas",
            "eps",
            "weight_decay",
            "grad_clip",
            "momentum",
            "ns_steps",
            "adjust_lr",
        )
        if key in was_optim and was_optim[key] != optim[key]
    ]
    if diffs:
        out.append(
            "other optimizer settings: " + "; ".join(diffs) + ". The run goes on with this "
            "run's values and the checkpoint's optimizer state (moments), so it differs from "
            "an uninterrupted run"
        )
    was_schedule = was.get("schedule")
    if not isinstance(was_schedule, dict) or "lr" not in was_optim or "total_tokens" not in was:
        return out  # a checkpoint of an older version
    runs = [
        (
            float(lr),
            int(total) // gbt * gbt,
            ScheduleConfig(**{k: v for k, v in sched.items() if k in _SCHEDULE_FIELDS}),
        )
        for lr, total, sched in (
            (was_optim["lr"], was["total_tokens"], was_schedule),
            (optim["lr"], now["total_tokens"], now["schedule"]),
        )
    ]
    if runs[0] == runs[1]:
        return out  # the same schedule (the loop below would take ~1 s for 100k steps)
    done = int(saved.get("tokens", 0))
    last = done + gbt if branching else max(runs[0][1], runs[1][1], done + gbt)
    for tokens in range(done + gbt, last + 1, gbt):  # each step's, as the loop computes it
        lrs = [lr_at(tokens, peak_lr=lr, total_tokens=total, cfg=c) for lr, total, c in runs]
        if not math.isclose(lrs[0], lrs[1], rel_tol=1e-9, abs_tol=0.0):
            break
    else:
        return out
    keys = [("optim", "lr"), *(("schedule", k) for k in _SCHEDULE_FIELDS)]
    keys.append(("", "total_tokens"))
    diffs = [
        f"{group + '.' if group else ''}{key}={before} (checkpoint) vs {after} (this run)"
        for group, key in keys
        for before, after in [
            ((was.get(group) or {}).get(key), now[group][key])
            if group
            else (was.get(key), now[key])
        ]
        if before != after
    ]
    when = "the next step's" if tokens == done + gbt else f"step {tokens // gbt}'s"
    out.append(
        f"another learning-rate schedule: {when} learning rate is {lrs[1]:.3g} (it was "
        f"{lrs[0]:.3g} in the checkpoint's run) as {'; '.join(diffs)}. The run goes on with "
        "this run's schedule"
    )
    return out


def _read_final(path: Path) -> dict[str, Any] | None:
    """A finished run's ``final.json``, or ``None`` where there is none or it cannot be read
    (cut short by a crash while an older version wrote it: the run then finishes again)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def _abandon_newer_results(out_dir: Path, step: int) -> list[tuple[str, Path]]:
    """Move ``final.json`` and ``hf/`` aside (rank 0, when a run starts at ``step``) if
    ``final.json`` is of a later step: they are the results of an abandoned run (``resume=never``,
    or ``resume=`` an earlier checkpoint), which would read as this run's until it finishes.
    They become ``final.abandoned.json`` and ``hf.abandoned`` (``.1``, ... if taken).

    Returns:
        ``(name, new path)`` of each moved.
    """
    final = _read_final(out_dir / "final.json")
    if final is None or not isinstance(final.get("step"), int) or final["step"] <= step:
        return []
    moved = []
    for name, aside in (("final.json", "final.abandoned.json"), ("hf", "hf.abandoned")):
        if (out_dir / name).exists():
            moved.append((name, ckpt.unused_path(out_dir / aside)))
            os.rename(out_dir / name, moved[-1][1])
    return moved


def _write_run_info(out_dir: Path, info: dict[str, Any]) -> dict[str, Any] | None:
    """Append this run's record to ``run_info.json`` (one per start in the folder), atomically:
    a kill while writing leaves the previous file. One that cannot be read (cut short by an
    older version) is moved to ``run_info.unreadable.json`` with a warning, not a traceback.
    Returns the folder's previous record (``None`` where there is none)."""
    path = out_dir / "run_info.json"
    runs: list[Any] = []
    if path.is_file():
        try:
            runs = json.loads(path.read_text())
            if not isinstance(runs, list):
                raise ValueError("not a list of run records")
        except ValueError as err:
            kept = path.with_name("run_info.unreadable.json")
            os.replace(path, kept)
            logger.warning("%s could not be read (%s): moved to %s", path, err, kept)
            runs = []
    previous = runs[-1] if runs and isinstance(runs[-1], dict) else None
    runs.append(info)
    ckpt.write_text_atomic(path, json.dumps(runs, indent=2, default=str) + "\n")
    return previous


def _changed_since(previous: dict[str, Any] | None, info: dict[str, Any]) -> list[str]:
    """What a resumed run's ``run_info`` record changes from the folder's previous start: the
    fot commit and the library versions, as ``"name old -> new"``."""
    if previous is None:
        return []
    changes = []
    if previous.get("git_sha") != info["git_sha"]:
        changes.append(f"git {previous.get('git_sha')} -> {info['git_sha']}")
    before = previous.get("versions")
    if isinstance(before, dict):
        for name, version in info["versions"].items():
            if name in before and before[name] != version:
                changes.append(f"{name} {before[name]} -> {version}")
    return changes


def train(cfg: DictConfig, *, on_folder: Callable[[Path], None] | None = None) -> dict[str, Any]:
    """Train with a composed config (see ``configs/train.yaml``); return the final metrics.

    Args:
        cfg: the Hydra config (root schema :class:`fot.training.config.TrainConfig`).
            ``cfg.out_dir`` is the run folder (``train.py`` sets it to Hydra's output folder).
        on_folder: called by rank 0 with the run folder once the run owns it (the folder lock
            is taken and the resume checks passed), before anything of the run is written
            there: what it writes, a refused run does not. ``train.py`` writes Hydra's
            ``.hydra/`` files.

    Returns:
        The last logged training record merged with the final validation metrics, plus
        ``checkpoint`` and ``hf_dir`` paths.

    A step that does not log, validate or checkpoint makes no host sync: the loss, token count
    and gradient norm are accumulated on the device and fetched with one transfer at the
    ``log_every_tokens`` / ``val_every_tokens`` / ``ckpt_every_tokens`` boundaries (and at the
    last step). A NaN/inf loss or gradient norm is therefore detected lazily, at the first such
    boundary after the bad step: the stop can come up to ``log_every_tokens`` later than the
    bad step (with ``log_every_tokens=0``, at the next validation/checkpoint or the end of the
    run), and the optimizer steps in between are lost. It is always detected before a
    checkpoint is saved and before validation, so no checkpoint holds weights updated by a
    non-finite step: the last checkpoint is untouched and ``resume=auto`` restarts from it.

    Raises:
        TrainingDivergedError: NaN/inf loss or gradient norm; the message names the first bad
            step (number, tokens, LR) and the step where it was found. No checkpoint is written.
        TrainingOutOfMemoryError: the GPU ran out of memory in a step or in validation; the
            message names the settings that need less memory.
        TrainingStopped: SIGTERM came during the run (``checkpoint_on_sigterm``): every rank
            finished the step it was in and checkpointed it (a validation due at that step, the
            final one included, is skipped or cut short; the resumed run runs it first);
            ``resume=auto`` goes on from it as if uninterrupted. A SIGTERM during the HF export
            or after it lets the run finish.
        ValueError / FileNotFoundError: bad sizes, options or missing data (with the fix).
        CollectiveTimeoutError: this rank waited longer than ``parallel.timeout_s`` for the
            others in a collective (gloo; over nccl the watchdog ends the process).
    """
    # logged once the run's other checks pass (_train): a refused run shows only its error
    config_warnings = check_config(cfg)
    every = int(cfg.gc_every_steps)
    if every < 0:
        raise ValueError(f"gc_every_steps must be >= 0 (0: automatic collection), got {every}")
    # a rank that waited out parallel.timeout_s in any collective stops with one line
    with naming_timeouts(), contextlib.ExitStack() as cleanup:
        _log_to_stderr_if_unconfigured(cleanup)
        if every == 0 or not gc.isenabled():
            return _train(cfg, config_warnings, cleanup, on_folder)
        # Python's automatic cyclic GC is off while training (see TrainConfig.gc_every_steps).
        gc.collect()
        gc.disable()
        # What lives now (the modules of torch and transformers, the caller's objects) is set
        # aside, so the full collections at checkpoints and validations do not walk it again
        # each time (~0.2 s each); a caller's own freeze is left to the caller
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        try:
            return _train(cfg, config_warnings, cleanup, on_folder)
        finally:
            if freeze:
                gc.unfreeze()
            gc.enable()


def _log_to_stderr_if_unconfigured(cleanup: contextlib.ExitStack) -> None:
    """Called from Python with no logging set up (``train.py``'s Hydra sets it up), the run's
    INFO lines (the config, validations, the export) would not show: Python prints only
    warnings then. For the run, ``fot.train`` logs INFO to stderr, as under ``train.py``."""
    if logging.root.handlers or logger.handlers:
        return
    handler = logging.StreamHandler()  # sys.stderr
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    cleanup.callback(logger.setLevel, level)
    cleanup.callback(logger.removeHandler, handler)


def _step_log(cleanup: contextlib.ExitStack) -> logging.Logger:
    """A logger of the training records for the run's log files only (``train.log`` of
    ``train.py``): one line per record there, none on the console, where the progress bar
    shows the loss. Without a log file (the Python API) it has no handler."""
    files = [
        h for h in (*logging.root.handlers, *logger.handlers) if isinstance(h, logging.FileHandler)
    ]
    steps = logging.getLogger("fot.train.steps")
    steps.propagate = False
    steps.setLevel(logging.INFO)
    for handler in files:
        steps.addHandler(handler)
        cleanup.callback(steps.removeHandler, handler)
    return steps


def _take_run_lock(lock: ckpt.RunFolderLock, info: DistInfo) -> None:
    """Rank 0 takes the run folder's lock; every rank raises if another run holds it, and
    stops with rank 0's error where it cannot take it (the lock file unwritable)."""

    def take() -> str | None:
        try:
            lock.take()
        except ckpt.RunFolderInUseError as err:
            return str(err)
        return None

    problem = _on_rank0(take, info, "while taking the run folder's lock")
    if problem is not None:
        raise ckpt.RunFolderInUseError(problem)


def _train(
    cfg: DictConfig,
    config_warnings: list[str],
    cleanup: contextlib.ExitStack,
    on_folder: Callable[[Path], None] | None,
) -> dict[str, Any]:
    t_start = time.time()
    info = init_distributed(cfg.device, cfg.parallel.backend, cfg.parallel.timeout_s)
    strategy = resolve_strategy(cfg.parallel, info)
    check_cuda_graphs(cfg.parallel, strategy=strategy, device=info.device)
    # rank 0's folder for every rank (Hydra's timestamped folders can differ by a second)
    out_dir = Path(_from_rank0(str(Path(cfg.out_dir or ".").resolve())))
    ckpt_dir = out_dir / "checkpoints"
    # no other run may train in this folder (before its checkpoints are read); a folder that
    # does not exist yet is locked once it is made, below
    run_lock = ckpt.RunFolderLock(out_dir)
    cleanup.callback(run_lock.release)
    owned, made_folder = False, False

    def leave_as_found() -> None:
        """A run refused before it owns its folder: what it made there goes (the lock file, and
        the folder where it made it and nothing else is in it)."""
        if not owned:
            run_lock.discard()
            if made_folder:
                with contextlib.suppress(OSError):
                    out_dir.rmdir()

    cleanup.callback(leave_as_found)
    _take_run_lock(run_lock, info)
    T = int(cfg.data.seq_len)
    gbt = int(cfg.global_batch_tokens)
    amp_dtype = autocast_dtype(cfg.parallel, info.device)

    # ---- data ----------------------------------------------------------------------------
    from fot.data.loaders import build_sources

    val_micro = int(cfg.val_micro_batch_size or cfg.micro_batch_size)
    # first: missing data explains itself
    train_source, val_source = build_sources(cfg.data, val_unit=info.world_size * val_micro)

    # ---- which checkpoint to resume from (checked before the model is built) -------------
    resume_from = branching = None
    if cfg.resume == "auto":
        resume_from = ckpt.latest_checkpoint(ckpt_dir)
        branch = cfg.get("branch_from")
        if branch not in (None, ""):
            if Path(branch).resolve().parent == ckpt_dir.resolve():
                raise ValueError(
                    f"branch_from={branch} is a checkpoint of this run's own folder, which "
                    f"resume=auto already continues; to go back to it, pass resume={branch} "
                    "(the newer checkpoints are moved aside)"
                )
            if resume_from is None:
                resume_from = branching = Path(branch)
    elif cfg.resume not in ("never", "", None):
        resume_from = Path(cfg.resume)
    resume_from = _from_rank0(resume_from)  # every rank resumes from the same checkpoint
    branching = _from_rank0(branching)  # resume_from, when it comes from branch_from
    # a checkpoint of another run folder (resume=<its path>): its records are in that folder
    elsewhere = resume_from is not None and resume_from.resolve().parent != ckpt_dir.resolve()
    try:
        saved = ckpt.read_trainer_state(resume_from) if resume_from is not None else {}
    except ckpt.CorruptCheckpointError as err:
        if branching is None:
            raise
        raise _other_checkpoint_error(err, branching, "branch_from") from err
    same_batch = saved.get("sizes", {}).get("global_batch_tokens") == gbt
    global_seqs, total_steps = check_sizes(
        cfg, info.world_size, resuming=resume_from if same_batch else None
    )
    data_note = _data_size_note(train_source, global_seqs, total_steps)
    for source in (train_source, val_source):  # the held-out rows' ends are never read either
        if isinstance(source, ZarrRowsSource) and (left := source.remainder_warning()):
            config_warnings = [*config_warnings, left]
    if data_note is not None and data_note[0] == logging.WARNING:
        config_warnings = [*config_warnings, data_note[1]]
    elif data_note is not None and info.is_main:
        logger.info(data_note[1])
    branch = cfg.get("branch_from")
    if branch not in (None, "") and branching is None and resume_from is not None and info.is_main:
        # the run goes on from its own checkpoint; branch_from is for its first start only
        own = (saved.get("config") or {}).get("branch_from")
        if own is not None and Path(own).resolve() == Path(branch).resolve():
            logger.info(  # the same command, after a preemption
                "branch_from=%s is not read: the run continues from its own checkpoint %s",
                branch,
                resume_from,
            )
        else:  # e.g. the folder of another branch, reused
            logger.warning(
                "branch_from=%s is not read: the run continues from its own checkpoint %s, and "
                "that run did not start from branch_from (its branch_from=%s). To branch from "
                "%s, pass another out_dir",
                branch,
                resume_from,
                own,
                branch,
            )
    if resume_from is not None:
        compute = compute_precision(cfg.parallel, strategy, info.device)
        for note in check_resume(
            saved,
            cfg,
            resume_from,
            branching=branching is not None,
            compute=compute,
            world_size=info.world_size,
            strategy=strategy,
        ):
            if info.is_main:
                logger.warning(note)
        final = out_dir / "final.json"
        if (
            saved["step"] >= total_steps
            and (done := _from_rank0(_read_final(final) if info.is_main else None)) is not None
        ):
            # a finished run: validating and exporting again would only log the same twice
            if info.is_main:
                # a job of a sweep (-m refuses out_dir=...) starts over in another sweep folder
                other = "another hydra.sweep.dir" if sweep_folder(out_dir) else "another out_dir"
                logger.warning(
                    "%s: the run already finished (its checkpoint %s is at step %d; "
                    "total_tokens=%d makes %d steps): nothing to do; its results are in %s. To "
                    "train on, raise total_tokens; to start over, pass "
                    + (other if cfg.get("branch_from") else f"resume=never or {other}"),
                    out_dir,
                    resume_from.name,
                    saved["step"],
                    int(cfg.total_tokens),
                    total_steps,
                    final,
                )
            return done
        if saved["step"] == total_steps and elsewhere and info.is_main:
            # another run's last checkpoint: validated and exported here, but not trained on
            logger.warning(
                ("branch_from" if branching is not None else "resume")
                + "=%s is its run's last step (step %d; total_tokens=%d makes %d steps): "
                "nothing to train. This run only validates it and exports it into %s, with no "
                "checkpoint of its own there. To train on from it, raise total_tokens",
                resume_from,
                saved["step"],
                int(cfg.total_tokens),
                total_steps,
                out_dir,
            )
        if saved["step"] > total_steps:
            # it would "finish" at the checkpoint's step, past the asked total, without a word
            raise ValueError(
                f"cannot resume from {resume_from}: it is at step {saved['step']} "
                f"({saved['step'] * int(cfg.global_batch_tokens)} tokens), past "
                f"total_tokens={int(cfg.total_tokens)} ({total_steps} steps). Raise "
                "total_tokens to train on from it, "
                + (
                    f"branch from an earlier checkpoint (branch_from={resume_from.parent}/"
                    "step_...), or pass another out_dir"
                    if branching is not None
                    else f"resume from an earlier checkpoint (resume={resume_from.parent}/"
                    "step_...), or start over (resume=never or another out_dir)"
                )
            )

    if branching is not None:  # another folder's checkpoint: refused before this folder is made
        missing = [n for n in ckpt.CHECKPOINT_FILES if not (branching / n).is_file()]
        if missing:
            raise ckpt.CorruptCheckpointError(
                f"branch_from={branching} is incomplete: it has no {', '.join(missing)}; branch "
                "from another checkpoint of that run (branch_from=...)"
            )

    # ---- weights to start from (a new run only; checked before the run folder is made) ---
    init_source = None
    # the tokenizer the run's exports carry instead of GPT-2's: that of the weights it starts
    # from, or of the run whose checkpoint it branches from
    carried_tokenizer = run_tokenizer(resume_from.parent.parent) if elsewhere else None
    if cfg.init_from not in (None, ""):
        if resume_from is not None:
            started_from = (saved.get("config") or {}).get("init_from")
            if info.is_main and started_from == cfg.init_from:  # the same command, resumed
                logger.info(
                    "init_from=%s is not used: the run resumes from %s, with its weights",
                    cfg.init_from,
                    resume_from,
                )
            elif info.is_main:  # e.g. an out_dir reused: the weights are not init_from's
                logger.warning(
                    "init_from=%s is not used: the run resumes from %s, with its weights, and "
                    "that run did not start from init_from (its init_from=%s). To start from "
                    "init_from's weights, pass another out_dir or resume=never",
                    cfg.init_from,
                    resume_from,
                    started_from,
                )
        else:
            from fot.training.config import reads_ids_as_they_are
            from fot.training.init_weights import (
                InitFromError,
                check_init_files,
                check_init_source,
                own_tokenizer,
                read_init_source,
            )

            init_source = read_init_source(cfg.init_from)
            check_init_source(init_source, model_config_from_train_config(cfg))
            try:  # a weight file cut short: refused before the run folder is made
                check_init_files(init_source)
            except ckpt.CorruptCheckpointError as err:
                raise _other_checkpoint_error(err, init_source.path, "init_from") from err
            carried_tokenizer = own_tokenizer(init_source)
            if carried_tokenizer is not None and not reads_ids_as_they_are(cfg.data):
                where = "" if carried_tokenizer == init_source.path else f" ({carried_tokenizer})"
                raise InitFromError(
                    f"init_from={cfg.init_from} was trained with its own tokenizer{where}, not "
                    f"GPT-2's, which data={cfg.data.kind} reads: tokenize the training and "
                    "held-out text with that tokenizer into flat .npy or .bin files of ids and "
                    "pass data=tokens data.path=<that file> data.val_path=<the held-out file>"
                )

    # what rank 0 alone does from here on is in `stop_together` blocks: an error there stops
    # every rank with it, where the others would wait for rank 0 in their next collective
    with stop_together("while making the run folder"):
        if info.is_main:  # only now: bad data, sizes or checkpoints leave no run folder behind
            for warning in config_warnings:
                logger.warning(warning)
            made_folder = not out_dir.exists()
            try:
                out_dir.mkdir(parents=True, exist_ok=True)
            except OSError as err:  # a read-only file system: one line, not a traceback
                environment = (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT)
                if err.errno not in environment:
                    raise
                raise cannot_write(out_dir, err, "Pass another out_dir=...") or err from err
    _take_run_lock(run_lock, info)
    with stop_together("while preparing the run folder"):
        if info.is_main:
            ckpt.clean_stale(ckpt_dir)
            if resume_from is None or elsewhere:  # a first start: this run's own tokenizer
                _carry_tokenizer(carried_tokenizer, out_dir / TOKENIZER_FOLDER)
            else:
                _recover_tokenizer(out_dir / TOKENIZER_FOLDER)
            if on_folder is not None:
                on_folder(out_dir)
    owned = True
    stream = SequenceStream(
        train_source,
        global_batch_size=global_seqs,
        micro_batch_size=int(cfg.micro_batch_size),
        rank=info.rank,
        world_size=info.world_size,
    )

    # before the model, the run's records and wandb: a refused profile leaves none of them
    steps_left = total_steps - (saved["step"] if resume_from is not None else 0)
    prof_cfg = cfg.profile
    prof_steps, prof_start = int(prof_cfg.steps), int(prof_cfg.start_step)
    if prof_steps > 0 and prof_start >= 0 and prof_start + prof_steps > steps_left:
        too_few = (
            f"profile.start_step + profile.steps = {prof_start + prof_steps} but this run has "
            f"{steps_left} steps left"
        )
        if resume_from is None or elsewhere:  # a first start (branch_from, resume=<path>)
            raise ValueError(f"{too_few}: lower them or raise total_tokens")
        # the same command after a stop near the end: the run goes on, unprofiled
        if info.is_main and steps_left > 0:
            logger.warning("%s after its checkpoint: these steps are not profiled", too_few)
        prof_steps = 0
    profiler = StepProfiler(  # checks that both counts are >= 0
        steps=prof_steps,
        start_step=prof_start,
        out_dir=out_dir,
        rank=info.rank,
        device=info.device,
        trace=bool(prof_cfg.trace),
        first_run_step=total_steps - steps_left + 1,
    )

    # ---- model and optimizer -------------------------------------------------------------
    from fot import presets

    hf_config = model_config_from_train_config(cfg)
    vocab_size = int(hf_config.vocab_size)
    torch.manual_seed(int(cfg.seed))
    with torch.device(info.device):
        model = presets.build_model(hf_config)
    if init_source is not None:
        from fot.training.init_weights import load_init_weights

        try:
            load_init_weights(init_source, model)
        except ckpt.CorruptCheckpointError as err:  # damaged where opening did not look
            raise _other_checkpoint_error(err, init_source.path, "init_from") from err
    model.train()
    n_params = presets.count_params(model)
    flop_counter = FlopCounter.of(model, hf_config)
    fpt = flop_counter.of_documents([T]) / T  # one full causal sequence: the nominal rate
    model = parallelize(model, cfg.parallel, info, strategy=strategy)
    optimizer = build_optimizer(
        model, cfg.optim, device=info.device, capturable=bool(cfg.parallel.cuda_graphs)
    )
    peak = cfg.peak_flops
    if peak is None and autocast_dtype(cfg.parallel, info.device) is not None:
        peak = peak_flops_per_device(info.device)  # the table's peaks are bf16 ones
    elif peak is None and peak_flops_per_device(info.device) and info.is_main:
        logger.info(
            "MFU is not logged: parallel.precision=fp32 computes in float32 and the known GPU "
            "peaks are bf16 ones; set peak_flops=<this GPU's float32 FLOP/s> for it"
        )

    # ---- resume --------------------------------------------------------------------------
    step, tokens, wandb_id = 0, 0, None
    # the open logging window's loss sum and label tokens, when a checkpoint fell inside one
    saved_window: dict[str, Any] = {}
    # wall seconds the run's earlier processes spent up to the checkpoint resumed from: the
    # records' elapsed_s goes on from it (the run's training time, not this process's)
    elapsed_before = 0.0
    if resume_from is not None:
        try:
            state = ckpt.load_checkpoint(
                resume_from, model=model, optimizer=optimizer, rank=info.rank
            )
        except ckpt.CorruptCheckpointError as err:
            if branching is None:
                raise
            raise _other_checkpoint_error(err, branching, "branch_from") from err
        step, tokens = state["step"], state["tokens"]
        # the wandb run of this folder's run goes on; another folder's run (a branch from its
        # checkpoint) is not written into: this run gets a wandb run of its own
        wandb_id = None if elsewhere else state.get("wandb_id")
        stream.load_state_dict(state["data"])
        saved_window = state.get("log_window") or {}
        elapsed_before = state.get("elapsed_s")
        if elapsed_before is None:  # an older fot's checkpoint: its step's record says it
            records = (resume_from.parent.parent if elsewhere else out_dir) / "metrics.jsonl"
            elapsed_before = _on_rank0(
                lambda: _logged_elapsed(records, step), info, f"while reading {records}"
            )
        # the last step's tokens; checkpoints of older versions hashed the inputs alone
        # ("data_digest"), or nothing
        digest = state.get("data_sha256")
        with_labels = digest is not None
        if not with_labels:
            digest = state.get("data_digest")
        if (
            info.is_main
            and digest
            and stream.last_step_digest(with_labels=with_labels) not in (None, digest)
        ):
            where = ", ".join(
                f"data.{k}={cfg.data[k]}" for k in ("kind", "path") if cfg.data.get(k) is not None
            )
            logger.warning(
                "the training data changed since %s was written: the sequences of its last step "
                "(step %d) read now from %s differ from those it trained on. The run goes on at "
                "the checkpoint's position in the data as it is now, so documents may be read "
                "twice or skipped; to resume exactly, put back the data the run started with (or "
                "start a new run: resume=never or another out_dir)",
                resume_from,
                step,
                where,
            )
    start_step = step
    with stop_together("while preparing its records"):
        if info.is_main:
            # checkpoints after the starting step are from an abandoned run: move them aside so
            # keep_last does not delete this run's instead and resume=auto does not pick them
            for moved in ckpt.abandon_newer(ckpt_dir, step, keep=resume_from):
                logger.warning(
                    "moved %s aside to %s: it is newer than the step this run starts at (%d), so "
                    "it belongs to an abandoned run (kept; delete it when no longer needed)",
                    moved.name.removeprefix(ckpt.ABANDONED_PREFIX).split(".")[0],
                    moved,
                    step,
                )
            n_moved = abandon_newer_records(out_dir / "metrics.jsonl", step)
            if n_moved:
                logger.warning(
                    "moved %d metrics.jsonl record(s) of steps after %d (an abandoned run's) to %s",
                    n_moved,
                    step,
                    out_dir / "metrics.abandoned.jsonl",
                )
            for name, moved in _abandon_newer_results(out_dir, step):
                logger.warning(
                    "moved %s aside to %s: the result of a run that went past step %d, where this "
                    "run starts (kept; delete it when no longer needed)",
                    name,
                    moved,
                    step,
                )

        # ---- logging -------------------------------------------------------------------------
        resolved = to_container(cfg)
        metrics = MetricsLogger(
            out_dir, enabled=info.is_main, wandb_cfg=cfg.wandb, config=resolved, resume_id=wandb_id
        )
        if info.is_main:
            run_info = {
                "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "git_sha": git_sha(),
                # wandb's where a wandb run started: it shapes what the wandb files hold (a
                # resume warns only about a library that both starts recorded)
                "versions": library_versions(
                    extra=("wandb",) if metrics.wandb_run is not None else ()
                ),
                "world_size": info.world_size,
                "strategy": strategy,
                "device": str(info.device),
                "params_without_embedding": n_params,
                "flops_per_token": fpt,
                "accum_steps": stream.accum_steps,
                "total_steps": total_steps,
                "resumed_from": str(resume_from.resolve()) if resume_from else None,
                "initialized_from": str(init_source.path.resolve()) if init_source else None,
                "config": resolved,
            }
            previous = _write_run_info(out_dir, run_info)
            changes = _changed_since(previous, run_info) if resume_from else []
            if changes:
                logger.warning(
                    "this run resumes with another fot or other libraries than its previous "
                    "start (%s; run_info.json keeps both): its steps from here may differ in "
                    "the last bits from a run that never stopped",
                    ", ".join(changes),
                )
            logger.info("config:\n%s", OmegaConf.to_yaml(cfg, resolve=True))
            logger.info(
                "git %s | %s | %s x %s | %.2fM params (no embedding) | %d step%s x %d tokens%s",
                run_info["git_sha"] or "none (fot is not a git checkout)",
                json.dumps(run_info["versions"]),
                info.world_size,
                strategy,
                n_params / 1e6,
                total_steps,
                "" if total_steps == 1 else "s",
                gbt,
                f" | resuming from {resume_from} at step {step}"
                if resume_from
                else f" | weights from {init_source.path}"
                if init_source
                else "",
            )
    if info.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(info.device)

    def elapsed() -> float:
        """Wall seconds of the run so far: this process's and its earlier processes' (up to
        the checkpoint this one resumed from)."""
        return elapsed_before + time.time() - t_start

    def log_record(record: dict[str, Any]) -> None:
        """``metrics.log`` (rank 0 writes): its failure (a full disk) stops every rank."""
        with stop_together(f"while logging a record of step {record['step']}"):
            metrics.log(record)

    def save(at_step: int, window: tuple[float, float] = (0.0, 0.0)) -> Path:
        """Checkpoint at ``at_step``; ``window``: the (loss sum, label tokens) of the logging
        window still open there, so that a resumed run logs the same loss at its end."""
        return ckpt.save_checkpoint(
            ckpt_dir,
            step=at_step,
            model=model,
            optimizer=optimizer,
            trainer_state={
                "step": at_step,
                "tokens": tokens,
                "data": stream.state_dict(),
                "sizes": {
                    "global_batch_tokens": gbt,
                    "seq_len": T,
                    "world_size": info.world_size,
                    "strategy": strategy,
                },
                "wandb_id": metrics.wandb_id,
                "log_window": {"loss_sum": float(window[0]), "label_tokens": int(window[1])},
                # what the last step read, for a resumed run to check (rank 0 writes the state)
                "data_sha256": stream.last_step_digest() if info.is_main else None,
                "config": resolved,
                "elapsed_s": elapsed(),
                "compute_precision": compute_precision(cfg.parallel, strategy, info.device),
            },
            keep_last=int(cfg.keep_last),
            is_main=info.is_main,
        )

    num_val = validation_sequences(
        cfg.data, val_source, unit=info.world_size * val_micro, warn=info.is_main
    )

    # SIGTERM only sets a flag, from here to the end of the run; after each step, and before
    # each micro batch of a validation, the ranks agree on it and stop with a checkpoint
    sigterm = StopOnSigterm(info.world_size) if cfg.checkpoint_on_sigterm else None
    if sigterm is not None:
        cleanup.enter_context(sigterm)

    def validate() -> dict[str, float] | None:
        """The held-out losses; ``None`` if SIGTERM ended the validation early (torchrun
        kills 30 s after passing it on): the run then stops with a checkpoint of this step."""
        if val_source is None:
            return {}
        ckpt._fault("sigterm_in_validation", step)
        try:
            return evaluate(
                model,
                val_source,
                num_sequences=num_val,
                micro_batch_size=val_micro,
                info=info,
                amp_dtype=amp_dtype,
                should_stop=sigterm.agreed if sigterm is not None else None,
            )
        except torch.OutOfMemoryError as err:
            raise _out_of_memory_error(
                err, cfg, phase="validation", step=step, strategy=strategy, device=info.device
            ) from err

    if resume_from is not None and val_source is not None and 0 < step < total_steps:
        # A validation due at the checkpoint's step runs after the save: a run stopped in it
        # (a crash, or SIGTERM, which skips it) never logged it. Run it now, as the
        # uninterrupted run did at this step (the weights are the same), unless it was logged.
        due = _crossed(tokens - gbt, tokens, int(cfg.val_every_tokens))
        logged = due and _on_rank0(
            lambda: bool(_records_at(out_dir / "metrics.jsonl", step)["val"]),
            info,
            "while reading metrics.jsonl",
        )
        if due and not logged:
            val = validate()
            if val is None:  # SIGTERM; the checkpoint resumed from is of this step
                metrics.close()
                raise TrainingStopped(step, resume_from, out_dir, cfg.resume)
            if val:
                log_record({"step": step, "tokens": tokens, **val})
                if info.is_main:
                    logger.info("validation of step %d, lost before the resume: %s", step, val)

    # ---- loop ----------------------------------------------------------------------------
    # No host sync in a step that does not log, validate or checkpoint: the loss, token count,
    # grad norm and the first non-finite step stay on the device and are fetched with one
    # transfer (`fetch`) at those boundaries, where the divergence check happens too.
    amp = (
        (lambda: torch.autocast(info.device.type, dtype=amp_dtype))
        if amp_dtype is not None and autocasts(cfg.parallel, strategy)
        else contextlib.nullcontext  # FSDP2 with bf16 parameters casts them itself
    )
    bar = progress_bar(
        total=total_steps,
        initial=step,
        disable=not (info.is_main and cfg.progress),
        desc="train",
        unit="step",
        dynamic_ncols=True,
    )
    if not bar.disable and on_terminal():
        from tqdm.contrib.logging import logging_redirect_tqdm

        # log lines on the console go above the bar; a log file (train.log) still gets them
        cleanup.enter_context(logging_redirect_tqdm(loggers=[logging.root, logger]))
    last_record: dict[str, Any] = {}
    step_log = _step_log(cleanup)  # the training records in train.log
    last_ckpt: Path | None = resume_from
    f64 = {"dtype": torch.float64, "device": info.device}
    # sum of the global loss sums of the window's steps (restored from the checkpoint when it
    # fell inside a window: the resumed run logs the uninterrupted run's loss bit for bit)
    window_loss = torch.tensor(float(saved_window.get("loss_sum", 0.0)), **f64)
    # global label tokens (a device tensor if > 1 rank)
    window_tokens: int | torch.Tensor = int(saved_window.get("label_tokens", 0))
    # global training FLOPs and steps since the window's clock started (this process only:
    # they make the rates, which a resume restarts)
    window_flops: float | torch.Tensor = 0.0
    window_steps = 0
    grad_norm = torch.zeros((), **f64)  # of the last step
    diverged = torch.zeros(3, **f64)  # first non-finite step: (step, loss, grad_norm); 0 = none
    # the first step at which some rank's training data held a token id outside the
    # vocabulary (0 = none), and this rank's (step, id): `fetch` raises on every rank
    bad_data = torch.zeros((), **f64)
    own_bad: tuple[int, int] | None = None
    t_window = time.time()
    clip = float(cfg.optim.grad_clip) if cfg.optim.grad_clip > 0 else float("inf")

    def fetch() -> tuple[float, float, float, float]:
        """One device->host transfer: ``(window loss, window tokens, grad norm, window FLOPs)``.

        Raises :class:`TrainingDivergedError` if a step since the last fetch was non-finite.
        """
        parts = [window_loss.reshape(1), grad_norm.reshape(1).double(), diverged]
        if isinstance(window_tokens, torch.Tensor):
            parts += [window_tokens.reshape(1).double(), window_flops.reshape(1).double()]
        host = torch.cat([*parts, bad_data.reshape(1)]).tolist()
        if host[-1]:  # some rank's training data held a token id outside the vocabulary
            bar.close()
            metrics.close()
            first = int(host[-1])
            raise _token_ids_error_of_ranks(
                None if own_bad is None else own_bad[1],
                vocab_size,
                what=f"training data of step {first if own_bad is None else own_bad[0]}",
            )
        n_tokens, flops = (
            (host[5], host[6])
            if isinstance(window_tokens, torch.Tensor)
            else (float(window_tokens), float(window_flops))
        )
        bad_step, bad_loss, bad_norm = int(host[2]), host[3], host[4]
        if bad_step:
            bar.close()
            metrics.close()
            raise TrainingDivergedError(
                _diverged_message(
                    bad_step=bad_step,
                    loss=bad_loss,
                    grad_norm=bad_norm,
                    tokens=bad_step * gbt,
                    lr=lr_at(
                        bad_step * gbt,
                        peak_lr=cfg.optim.lr,
                        total_tokens=total_steps * gbt,
                        cfg=cfg.schedule,
                    ),
                    detected_step=step,
                    last_ckpt=last_ckpt,
                )
            )
        return host[0], n_tokens, host[1], flops

    # parallel=ddp with CUDA graphs: no DDP wrapper (parallelize), the step reduces gradients
    reduce_gradients = strategy == "ddp" and not isinstance(model, DistributedDataParallel)
    # DDP's gradients are views of its buckets (wrap_ddp): zeroed in place, they stay views
    # through the micro batches that accumulate without syncing; set to None, those would
    # allocate a second copy of the gradients beside the buckets
    keep_grads = isinstance(model, DistributedDataParallel)
    trainable = [p for p in model.parameters() if p.requires_grad]

    def run_step(
        batches: Sequence[Batch],
        n_tokens: Sequence[int | torch.Tensor],
        scales: Sequence[float | torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on device ``batches`` (forward and backward of each micro batch,
        gradient clip, AdamW): returns the global sum of token losses and the gradient norm.
        Also the function :class:`GraphedStep` captures, so it waits for the host nowhere."""
        loss_sum = torch.zeros((), **f64)
        for i, (b, n_b, scale) in enumerate(zip(batches, n_tokens, scales, strict=True)):
            last = i == len(batches) - 1
            with accumulation(model, strategy, last=last, cfg=cfg.parallel):
                with amp():
                    out = model(
                        input_ids=b.input_ids, shift_labels=b.labels, cu_seqlens=b.cu_seqlens
                    )
                (out.loss * scale).backward()
            loss_sum += out.loss.detach().double() * n_b
        if reduce_gradients:
            all_reduce_gradients(trainable, info.world_size)
        all_reduce_sum(loss_sum.reshape(1))  # global sum of token losses (in place)
        norm = clip_grad_norm(model.parameters(), clip)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        optimizer.step()
        return loss_sum, norm

    graphed = None
    if cfg.parallel.cuda_graphs:
        graphed = GraphedStep(run_step, optimizer, device=info.device)

    if isinstance(model, DistributedDataParallel) and step < total_steps:
        # the buckets of every step, also a resumed run's first, are the rebuilt ones
        shape = (int(cfg.micro_batch_size), int(cfg.data.seq_len))
        warm = make_batch(
            np.zeros(shape, np.int64), np.zeros(shape, np.int64), varlen=stream.varlen
        )
        warm = warm.to(info.device)

        def warm_loss() -> torch.Tensor:
            with amp():
                ids, labels, cu = warm.input_ids, warm.labels, warm.cu_seqlens
                return model(input_ids=ids, shift_labels=labels, cu_seqlens=cu).loss

        settle_ddp_buckets(model, warm_loss)
        t_window = time.time()  # the rates leave it out

    gc_every = int(cfg.gc_every_steps)  # train() turned automatic GC off when this is > 0
    while step < total_steps:
        if gc_every and step % gc_every == 0:
            gc.collect(1)  # the young generations only: milliseconds
        profiler.step_begin()
        batches, bad = _screen_token_ids(
            stream.next_step(),
            vocab_size,
            what=f"training data of step {step + 1}",
            world_size=info.world_size,
        )
        if bad is not None and own_bad is None:
            own_bad = (step + 1, bad)
        n_micro = [b.num_label_tokens() for b in batches]  # host ints: batches are on the CPU
        n_local = sum(n_micro)
        # what the step computes: with varlen packing attention stops at document boundaries
        flops_local = sum(flop_counter.of_batch(b) for b in batches)
        n_global: int | torch.Tensor = n_local
        flops_global: float | torch.Tensor = flops_local
        if info.world_size > 1:
            # all-reduced on the device and left there; filling needs no host copy (a copy
            # from the host would wait for the GPU)
            both = torch.full((3,), n_local, **f64)
            both[1:2].fill_(flops_local)
            both[2:].fill_(float(bad is not None))  # ranks whose data held a bad token id
            n_global, flops_global, bad_ranks = all_reduce_sum(both).unbind()
            bad_data = torch.where((bad_ranks > 0) & (bad_data == 0), step + 1.0, bad_data)
        lr = lr_at(
            tokens + gbt, peak_lr=cfg.optim.lr, total_tokens=total_steps * gbt, cfg=cfg.schedule
        )
        set_lr(optimizer, lr)
        # weight each micro batch by its share of the global label tokens; DDP/FSDP average
        # gradients over ranks, hence the world size
        if isinstance(n_global, torch.Tensor):
            scales = [(n_b * info.world_size / n_global.clamp(min=1)).float() for n_b in n_micro]
        else:
            scales = [n_b * info.world_size / max(n_global, 1) for n_b in n_micro]
        try:
            if graphed is not None:
                loss_sum, norm = graphed(batches, n_micro, scales)
            else:
                loss_sum, norm = run_step([b.to(info.device) for b in batches], n_micro, scales)
        except torch.OutOfMemoryError as err:
            raise _out_of_memory_error(
                err, cfg, phase="training", step=step + 1, strategy=strategy, device=info.device
            ) from err
        grad_norm = norm.detach().double()
        # remember the first non-finite step on the device; `fetch` raises on it
        first = torch.stack(
            [torch.full((), step + 1, **f64), loss_sum / _clamp1(n_global), grad_norm]
        )
        bad = ~(torch.isfinite(loss_sum) & torch.isfinite(grad_norm)) & (diverged[0] == 0)
        diverged = torch.where(bad, first, diverged)
        optimizer.zero_grad(set_to_none=not keep_grads)
        prev_tokens = tokens
        step += 1
        tokens += gbt
        window_loss += loss_sum
        window_tokens = window_tokens + n_global
        window_flops = window_flops + flops_global
        window_steps += 1

        do_log = _crossed(prev_tokens, tokens, int(cfg.log_every_tokens)) or step == total_steps
        do_val = (
            val_source is not None
            and _crossed(prev_tokens, tokens, int(cfg.val_every_tokens))
            and step < total_steps
        )
        do_ckpt = _crossed(prev_tokens, tokens, int(cfg.ckpt_every_tokens)) and step < total_steps
        stop = sigterm is not None and sigterm.agreed()  # every rank, after every step
        if stop:
            do_val, do_ckpt = False, True  # checkpoint this step and end; no validation
        if do_log or do_val or do_ckpt:
            # the only sync; it also makes sure no checkpoint or validation sees NaN weights
            loss_total, n_tokens, last_norm, flops_total = fetch()
        if do_log:
            dt = max(time.time() - t_window, 1e-9)
            tps = window_steps * gbt / dt
            last_record = {
                "step": step,
                "tokens": tokens,
                "loss": loss_total / max(n_tokens, 1),
                "lr": lr,
                "grad_norm": last_norm,
                "tokens_per_s": tps,
                "tokens_per_s_per_device": tps / info.world_size,
                "mfu": flops_total / dt / (peak * info.world_size) if peak else None,
                "peak_mem_gib": peak_memory_gib(info.device),
                "elapsed_s": elapsed(),
            }
            log_record(last_record)
            if info.is_main:
                step_log.info(
                    "step %d: loss %.4f, lr %.3g, grad_norm %.3f, %s tokens/s%s",
                    step,
                    last_record["loss"],
                    lr,
                    last_norm,
                    f"{tps:,.0f}",
                    f", MFU {last_record['mfu']:.1%}" if last_record["mfu"] else "",
                )
            bar.set_postfix(loss=f"{last_record['loss']:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
            window_loss = torch.zeros((), **f64)
            window_tokens, window_flops, window_steps = 0, 0.0, 0
            t_window = time.time()
        bar.update(1)
        if profiler.finishing:  # every rank writes its own files: a failed write stops all
            first = profiler.first_run_step + profiler.start_step
            with stop_together(f"while writing the profile of steps {first}-{step}"):
                done = profiler.step_end()
        else:
            done = profiler.step_end()
        if done is not None:
            t_window += profiler.stop_s  # stopping the profiler and writing it: no training
        if done is not None and info.is_main:
            logger.info(
                "profile of steps %d-%d written to %s: %.1f ms per step%s",
                done["first_step"],  # the run's step numbers, also after a resume
                step,
                out_dir / "profile",
                done["wall_ms_per_step"],
                (
                    f", GPU idle {done['timeline']['idle_ms_per_step']:.1f} ms, exposed "
                    f"communication {done['comm']['exposed_comm_ms']:.1f} ms"
                    if "comm" in done
                    else ""
                ),
            )

        # checkpoint and validation time is left out of the window's clock (its steps stay
        # in), and so is the full collection that comes with them
        t_pause = time.time()
        if gc_every and (do_val or do_ckpt):
            gc.collect()  # a full collection where every rank stops anyway: no straggler
        if do_ckpt:
            # before validating: a validation that fails (bad held-out data, out of memory)
            # loses no training; a window that did not log at this step stays open across a
            # resume
            last_ckpt = save(step, (0.0, 0.0) if do_log else (loss_total, n_tokens))
        if do_val:
            val = validate()
            if val is None:  # SIGTERM: a resumed run validates this step first
                stop = True
                if not do_ckpt:
                    last_ckpt = save(step, (0.0, 0.0) if do_log else (loss_total, n_tokens))
            elif val:
                log_record({"step": step, "tokens": tokens, **val})
                if info.is_main:  # also into train.log (bar.write reached the console only)
                    shown = ", ".join(f"{k} {v:.4f}" for k, v in val.items())
                    logger.info("step %d: %s", step, shown)
        t_window += time.time() - t_pause
        if stop:
            bar.close()
            metrics.close()
            assert last_ckpt is not None  # saved above (do_ckpt)
            raise TrainingStopped(step, last_ckpt, out_dir, cfg.resume)
        if info.is_main:
            ckpt._fault("kill_after_step", step)
        ckpt._fault("sigterm_after_step", step)
        ckpt._fault("sigint_after_step", step)
    bar.close()

    # ---- end: validation, checkpoint, export ---------------------------------------------
    # the final checkpoint first: a final validation that fails loses no training
    if last_ckpt is None or not str(last_ckpt).endswith(f"step_{step:08d}"):
        last_ckpt = save(step)
    result: dict[str, Any] = dict(last_record)
    val: dict[str, float] = {}
    if step == start_step and resume_from is not None:
        # Resumed at the final step: the run stopped after its final checkpoint but before
        # final.json (in the final validation or the HF export). Its last training record is
        # in metrics.jsonl, and its validation record if that finished. Another folder's run
        # is validated again here (this run's held-out data may differ).
        records = (resume_from.parent.parent if elsewhere else out_dir) / "metrics.jsonl"
        logged = _on_rank0(lambda: _records_at(records, step), info, f"while reading {records}")
        result.update(logged["train"])
        if not elsewhere:
            val = logged["val"]
            result.update(val)
    result.update(step=step, tokens=tokens)  # also where no training record was found
    if not val:
        stopped = validate()
        if stopped is None:  # SIGTERM: the resumed run validates and exports
            metrics.close()
            raise TrainingStopped(step, last_ckpt, out_dir, cfg.resume)
        val = stopped
        if val:
            log_record({"step": step, "tokens": tokens, **val})
            result.update(val)
            if info.is_main:
                logger.info("final validation: %s", val)
    result["checkpoint"] = str(last_ckpt)
    if cfg.export_hf:
        hf_config.train_length, escaping = export_settings(cfg)
        hf_dir = export_hf_folder(
            model,
            hf_config,
            out_dir / "hf",
            is_main=info.is_main,
            text_escaping=escaping,
            tokenizer=out_dir / TOKENIZER_FOLDER,
        )
        result["hf_dir"] = str(hf_dir) if hf_dir else None
        if info.is_main:
            logger.info("HF export: %s", hf_dir)
    metrics.close()
    barrier()
    with stop_together("while writing final.json"):
        if info.is_main:
            # a kill while writing leaves no cut-short file
            ckpt.write_text_atomic(out_dir / "final.json", json.dumps(result, indent=2) + "\n")
    return result


__all__ = [
    "TrainingDivergedError",
    "TrainingOutOfMemoryError",
    "check_sizes",
    "checkpoint_config",
    "evaluate",
    "export_checkpoint",
    "export_hf_folder",
    "export_settings",
    "export_with_tokenizer",
    "model_config_from_train_config",
    "train",
]
