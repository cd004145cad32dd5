"""Typed Hydra configs for training: one dataclass per config group, registered as schemas.

The YAML files under ``configs/`` fill these dataclasses; a misspelt key or a wrong type is
rejected by OmegaConf at compose time. The model group only *names* a preset (plus optional
overrides) and the size group names a size: the HF model config itself always comes from
:func:`fot.presets.config`, the single source of truth for model fields.

Everything that counts data is in tokens (``*_tokens``).

train.py loads this file without ``import fot`` for its command-line checks (a typo is refused
in half a second, not after torch and transformers load): at module level it imports only the
standard library and omegaconf; fot's modules are imported inside the functions that need them.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

Mi = 1 << 20


@dataclass
class ModelConfig:
    """``model`` group: which architecture (a :data:`fot.presets.MODELS` name)."""

    name: str = MISSING
    overrides: dict[str, Any] = field(default_factory=dict)
    """Extra HF config fields passed to ``fot.presets.config(name, size, **overrides)``; a key
    that is no field of the model's config class is refused with the closest names."""


@dataclass
class SizeConfig:
    """``size`` group: which model size (a :data:`fot.presets.SIZES` name)."""

    name: str = MISSING


@dataclass
class DataConfig:
    """``data`` group. See :mod:`fot.data.streams` for the BOS and packing conventions."""

    kind: str = MISSING
    """``sample`` (offline Shakespeare), ``longcrawl64``, ``tokens`` or ``hf``."""
    seq_len: int = 16384
    packing: str = "varlen"
    """``varlen`` (pack, no attention across documents), ``causal`` (pack, plain causal) or
    ``padded`` (one document per sequence). LongCrawl64 rows are always chunked."""
    path: str | None = None
    """longcrawl64: folder or URL (``gs://<bucket>/longcrawl64``) with ``train.zarr``/``heldout.zarr``;
    tokens: a token folder, a flat ``.npy``/``.bin`` (uint16) file or a 2-D ``.zarr`` (also a
    URL); hf: dataset name or local path."""
    val_path: str | None = None
    """Held-out data of the same kind (longcrawl64 default: ``<path>/heldout.zarr``)."""
    doc_start_id: int | None = None
    """tokens, a flat ``.npy``/``.bin`` file packed ``varlen``: the id that starts each of its
    documents, where ``cu_seqlens`` puts a boundary (``null``: GPT-2's ``<|endoftext|>``,
    50256). Set it for ids of another tokenizer: its BOS (128000 for Llama 3)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Options of the filesystem of a URL ``path``/``val_path`` (a zarr array at ``gs://``,
    ``s3://``, ``https://``), passed to fsspec: credentials (gcsfs ``{token: anon}``, a key
    file), HTTP ``{headers: {...}}``. Set with ``++data.storage_options={token:anon}``."""
    cache_mib: int | None = None
    """Host memory (MiB) for whole chunks of a 2-D zarr array (LongCrawl64), per process and
    for training and validation each. ``null``: room for four chunk rows across a sequence's
    columns, at least 256 and at most 4096 MiB (LongCrawl64 at ``seq_len=65536``: 1024 MiB).
    A smaller cache than four chunk rows reads every step's chunks again (a warning says so);
    0 turns the cache off."""
    val_tokens: int = 0
    """Held-out tokens per validation (0: no validation)."""
    hf_name: str | None = None
    """hf: dataset configuration name (``load_dataset(path, name)``)."""
    hf_data_files: Any = None
    """hf: ``data_files`` of ``load_dataset``: one file or pattern (``data.hf_data_files=
    /data/a.jsonl``), a list (``[/data/a.jsonl,/data/b.jsonl]``) or a split mapping
    (``{train: a.jsonl}``)."""
    hf_split: str = "train"
    hf_val_split: str | None = None
    streaming: bool = False
    text_field: str = "text"
    text_escaping: str | None = None
    """How the text was written before it was tokenized, recorded in the run's export for
    ``fot.eval`` (:data:`fot.tokenizer.TEXT_ESCAPINGS`): ``json`` for LongCrawl64's token ids
    (JSON-escaped text), also when read through ``data=tokens``; ``null``: ``json`` for
    ``data=longcrawl64``, ``none`` otherwise. ``data=sample`` escapes its corpus so."""


@dataclass
class OptimConfig:
    """``optim`` group: AdamW, or Muon for the blocks' projection matrices with AdamW for the
    rest. Weight decay skips biases, norms, gate biases and what FLA marks ``_no_weight_decay``
    (see :func:`fot.training.optim.param_groups`)."""

    name: str = "adamw"
    """``adamw`` or ``muon`` (see :func:`fot.training.optim.muon_parameter_names`)."""
    lr: float = 1e-3
    """Peak learning rate (of both parts with ``muon``: ``adjust_lr`` scales Muon's)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""
    fused: bool | None = None
    """Fused AdamW kernel (default: on CUDA)."""
    momentum: float | None = None
    """``muon`` only: Muon's (Nesterov) momentum (``optim=muon`` sets 0.95)."""
    ns_steps: int | None = None
    """``muon`` only: Newton-Schulz iterations per step (``optim=muon`` sets 5)."""
    adjust_lr: str | None = None
    """``muon`` only: ``match_rms_adamw`` (update RMS of AdamW's, so ``lr`` and
    ``weight_decay`` carry over from AdamW; ``optim=muon`` sets it) or ``original``
    (``sqrt(max(1, rows / cols))``, as in Keller Jordan's Muon)."""


@dataclass
class ScheduleConfig:
    """``schedule`` group: learning rate as a function of tokens seen."""

    name: str = "warmup_cosine"
    """``warmup_cosine``, ``warmup_linear``, ``constant`` (after warmup) or ``wsd``
    (warmup, stable at the peak, decay over the last ``decay_fraction`` of the run)."""
    warmup_tokens: int = 256 * Mi
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak (the decay's end point)."""
    decay_fraction: float | None = None
    """``wsd`` only: the fraction of ``total_tokens`` at the end of the run over which the LR
    decays from the peak to ``min_lr_ratio`` × peak (``schedule=wsd`` sets 0.2)."""
    decay_shape: str | None = None
    """``wsd`` only: ``linear``, ``cosine`` or ``1-sqrt`` (``schedule=wsd`` sets ``1-sqrt``)."""


@dataclass
class ParallelConfig:
    """``parallel`` group: how the model is distributed and run."""

    strategy: str = "auto"
    """``auto`` (DDP under torchrun with >1 process, else single), ``single``, ``ddp``, ``fsdp``
    (FSDP2: ``fully_shard`` per block)."""
    precision: str = "auto"
    """``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16`` or ``fp32``."""
    reshard_after_forward: bool = False
    """FSDP2: free each block's gathered parameters after its forward and all-gather them again
    in backward (``true``, least memory), or keep them until the backward (``false``: one
    all-gather per block and step fewer, for one 16-bit copy of the model per GPU more
    memory, 1.5 GB at 760M)."""
    reshard_after_backward: bool = False
    """FSDP2 with more than one micro batch per step: free the gathered parameters after every
    micro batch's backward and all-gather them again for the next (``true``), or keep them
    gathered until the step's last micro batch (``false``: one all-gather per block and step
    instead of one per micro batch; the memory of ``reshard_after_forward=false``)."""
    reduce_precision: str = "fp32"
    """FSDP2's gradient reduce-scatter: ``fp32`` or ``bf16`` (half the bytes and shorter
    collectives; each rank's gradients are rounded to bf16 before they are summed). DDP
    reduces in fp32 only."""
    param_precision: str = "bf16"
    """FSDP2 under bf16 precision: ``bf16`` all-gathers bf16 parameters (the forget gate's
    included) and runs each block in bf16, its inputs cast to bf16 (the residual stream
    between blocks included); ``fp32``
    all-gathers fp32 parameters and computes under autocast, as ``single`` and ``ddp`` do and
    as the paper's runs did (Lightning's ``bf16-mixed``): twice the all-gather bytes, and the
    residual stream stays fp32. ``single`` and ``ddp`` always keep fp32 weights."""
    compile: bool = False
    """``torch.compile`` each block."""
    cuda_graphs: bool = False
    """Replay each training step as one CUDA graph after two eager steps (``parallel=single``
    or ``ddp``, not ``fsdp``; batches of one shape, ``data.packing=varlen`` included; not with
    ``compile``). Removes the host's launch time from the step: worth it where the GPU work
    per step is short (small models; FoT heads whose pruning skips most attention). With
    ``ddp`` the step averages the gradients itself, inside the graph, instead of DDP."""
    activation_checkpointing: bool = False
    backend: str = "auto"
    """Process group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``nccl`` or ``gloo``."""
    timeout_s: float | None = None
    """Seconds a rank waits for the others in a collective before it stops the run (under
    torchrun, also for the others to start): ``null`` for torch's defaults (600 s over nccl,
    1800 s over gloo). Raise it when rank 0 alone takes longer between two collectives (a
    checkpoint on a slow file system, the HF export of a big model) while the others wait;
    lower it to find a stalled or dead rank sooner. Over nccl the watchdog ends the process.
    Fixed when the process group is made: the jobs of a multirun under torchrun share one."""


@dataclass
class WandbConfig:
    """``wandb.*``: Weights & Biases logging (rank 0 only)."""

    mode: str = "auto"
    """``auto`` (online with an API key, offline without), ``online``, ``offline``, ``disabled``."""
    project: str = "fot"
    entity: str | None = None
    name: str | None = None
    """Run name (default: the output folder's name; for a job of a Hydra multirun its swept
    overrides, e.g. ``model=fot_pro,seed=1``)."""
    group: str | None = None
    """Run group (default: none; for the jobs of a Hydra multirun the sweep folder's name)."""


@dataclass
class ProfileConfig:
    """``profile``: ``torch.profiler`` over a few steps (see :mod:`fot.training.profiling`)."""

    steps: int = 0
    """Steps to profile (0: off). Each rank writes ``<out_dir>/profile/rank<r>.json``."""
    start_step: int = 2
    """Steps of this run before the profiled ones (warm-up)."""
    trace: bool = True
    """Also write a Chrome trace per rank (``rank<r>.trace.json``)."""


@dataclass
class TrainConfig:
    """The root config (``configs/train.yaml`` extends it)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    size: SizeConfig = field(default_factory=SizeConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    total_tokens: int = MISSING
    """Training length in tokens (rounded down to whole global batches)."""
    global_batch_tokens: int = 512 * 1024
    """Tokens per optimizer step over all ranks (a multiple of ``data.seq_len``).
    ``configs/train.yaml`` sets it to 8 sequences of ``data.seq_len``
    (``${fot.mul:8,${data.seq_len}}``), so that it fits any data group's sequence length."""
    micro_batch_size: int = 1
    """Sequences per forward pass per rank; gradient accumulation fills the global batch."""
    seed: int = 0
    device: str = "auto"
    """``auto`` (CUDA if available), ``cpu`` or ``cuda``."""
    out_dir: str | None = None
    """Run folder (default: Hydra's job output folder)."""
    log_every_tokens: int = 32 * Mi
    val_every_tokens: int = 0
    """Validate every this many tokens (0: only at the end, if ``data.val_tokens > 0``)."""
    val_micro_batch_size: int | None = None
    ckpt_every_tokens: int = 256 * Mi
    """Checkpoint every this many tokens (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept (older ones are deleted after a new one is complete)."""
    resume: str = "auto"
    """``auto`` (latest checkpoint in ``<out_dir>/checkpoints`` if any), ``never``, or a
    checkpoint folder."""
    init_from: str | None = None
    """Start a new run from these weights instead of a random initialisation: a training
    checkpoint (``<run>/checkpoints/step_<n>``), an exported model (``<run>/hf``, the output of
    ``python -m fot.convert``), a checkpoint folder of the paper's code (FoX, Transformer, or a
    recurrent baseline) or an FLA FoX folder (converted on the fly), or a hub repository id of
    one (``owner/name``). Only the weights are taken (step, optimizer, schedule and data start
    from zero), and the config
    must build the same model (:mod:`fot.training.init_weights`). A run that resumes takes its
    own checkpoint's weights and ignores it."""
    branch_from: str | None = None
    """Start a new run from this training checkpoint's whole state (weights, optimizer moments,
    step, position in the learning-rate schedule and in the data, RNG), as
    ``resume=<checkpoint>`` does, but only while ``out_dir`` holds no checkpoint of its own:
    from the first one on, ``resume=auto`` takes those, so the same command continues the
    branch after a preemption or requeue. For ablations and warmup-stable-decay decays
    branched from a shared run; needs ``resume=auto``."""
    export_hf: bool = True
    """Write an HF folder (weights, config, tokenizer) to ``<out_dir>/hf`` at the end."""
    progress: bool = True
    """tqdm progress bar on rank 0 (when stderr is not a terminal, e.g. a Slurm log: a plain
    line every 30 s instead of a bar redrawn in place)."""
    checkpoint_on_sigterm: bool = True
    """On SIGTERM (Slurm's time limit or ``--signal=TERM@<seconds>``, ``timeout``, Docker,
    Kubernetes, torchrun passing its own on), finish the current step, checkpoint it on every
    rank and exit with status 143 (see :mod:`fot.training.signals`); false: die at once, as
    Python does by default, losing the steps since the last checkpoint."""
    gc_every_steps: int = 50
    """Python's automatic garbage collection is off during training: a quick collection of
    the young generations runs every this many steps, and a full one at each validation and
    checkpoint, on every rank at the same step (0: automatic collection). An automatic
    collection stalls one rank's host at its own moment (~0.2 s per stall measured with FSDP2
    at 760M), and every other rank then waits for it in the next collective. The objects that
    live when training starts are frozen (``gc.freeze``) until it ends: no collection walks
    them again."""
    peak_flops: float | None = None
    """Per-device peak FLOP/s for MFU (default: looked up for known GPUs; none on CPU)."""


def mul(*factors: int) -> int:
    """The ``fot.mul`` resolver: the product of integers (``${fot.mul:8,${data.seq_len}}``).

    Raises:
        ValueError: a factor that is not an integer.
    """
    product = 1
    for factor in factors:
        if isinstance(factor, bool) or not isinstance(factor, int):
            raise ValueError(f"fot.mul multiplies integers, got {factor!r} in {factors!r}")
        product *= factor
    return product


def first_set(value: Any, default: Any) -> Any:
    """The ``fot.first_set`` resolver: ``value`` unless it is ``None``, else ``default``
    (``hydra.run.dir: ${fot.first_set:${out_dir},outputs/...}``)."""
    return default if value is None else value


def register_configs() -> None:
    """Register the root schema with Hydra's ConfigStore as ``train_schema`` and the
    ``fot.mul`` and ``fot.first_set`` resolvers that ``configs/train.yaml`` uses.

    Group YAMLs merge into its typed fields, so they need no schema of their own.
    """
    from hydra.core.config_store import ConfigStore

    OmegaConf.register_new_resolver("fot.mul", mul, replace=True)
    OmegaConf.register_new_resolver("fot.first_set", first_set, replace=True)
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_container(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain Python objects (for logging and checkpoints)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def reads_ids_as_they_are(data: Any) -> bool:
    """Whether the data config ``data`` trains on token ids as they are, of any tokenizer:
    ``data=tokens`` from a flat ``.npy`` or ``.bin`` file (and held-out data of one, where the
    run validates). Every other reader tokenizes with GPT-2 or puts GPT-2's ``<|endoftext|>``
    before each document."""

    def is_flat(path: object) -> bool:
        return str(path).endswith((".npy", ".bin"))  # (the loader's test: case-sensitive)

    validates = int(data.val_tokens) > 0 and data.val_path is not None
    flat = data.kind == "tokens" and is_flat(data.path)
    return flat and not (validates and not is_flat(data.val_path))


def check_config(cfg: DictConfig) -> list[str]:
    """Refuse values that no part of training would reject before it has run (or would
    silently reinterpret), and return warnings for values that run but likely not as meant.

    Called first by :func:`fot.training.train`, so a refused run leaves no run folder behind. Sizes that depend on the world size are checked later, by
    ``fot.training.trainer.check_sizes``.

    Args:
        cfg: the composed root config (:class:`TrainConfig`).

    Returns:
        Warnings (one sentence each, with the value and the fix) for the caller to log.

    Raises:
        ValueError: a bad value, named with the fix.
    """
    import os
    from pathlib import Path

    from fot.training.optim import check_optim

    try:
        check_optim(cfg.optim, cfg.schedule)
    except ValueError:
        ratio = cfg.schedule.min_lr_ratio
        start = _started_from(cfg)
        was = (start[1].get("schedule") or {}) if start else {}
        unread = was.get("name") == "constant" and was.get("min_lr_ratio", 1) != 1
        if cfg.schedule.name == "constant" and ratio != 1.0 and unread:
            raise ValueError(
                f"schedule.min_lr_ratio={ratio}: schedule=constant does not read it. The "
                f"checkpoint this run resumes ({start[0]}) was trained with it by an older fot, "
                f"which took it unread: drop schedule.min_lr_ratio={ratio}, and the run resumes "
                "unchanged"
            ) from None
        raise
    if cfg.optim.name == "muon" and cfg.parallel.cuda_graphs:
        raise ValueError(
            "parallel.cuda_graphs=true replays a capturable AdamW step, and optim=muon is not "
            "one: set parallel.cuda_graphs=false, or use optim=adamw"
        )
    if int(cfg.seed) < 0:
        raise ValueError(
            f"seed={cfg.seed} is negative; use a seed >= 0 (there is no 'random seed' value: "
            "pick a different number for a different run)"
        )
    if int(cfg.data.val_tokens) < 0:
        raise ValueError(
            f"data.val_tokens={cfg.data.val_tokens} is negative; use data.val_tokens=0 for no "
            "validation, or a positive number of held-out tokens"
        )
    if int(cfg.schedule.warmup_tokens) < 0:
        raise ValueError(
            f"schedule.warmup_tokens={cfg.schedule.warmup_tokens} is negative; use "
            "schedule.warmup_tokens=0 for no warmup"
        )
    if cfg.val_micro_batch_size is not None and int(cfg.val_micro_batch_size) < 1:
        raise ValueError(
            f"val_micro_batch_size={cfg.val_micro_batch_size} must be >= 1 (or null: the "
            f"training micro_batch_size={cfg.micro_batch_size})"
        )
    resume = cfg.resume
    if resume not in ("auto", "never", "", None) and not Path(resume).is_dir():
        from fot.training.checkpoint import not_a_checkpoint

        raise ValueError(
            f"resume={not_a_checkpoint(resume)}; or resume=auto (the latest checkpoint in "
            "out_dir, if any) or resume=never (start from scratch)"
        )
    branch = cfg.get("branch_from")
    if branch not in (None, ""):
        if resume != "auto":
            raise ValueError(
                f"branch_from={branch} is read while out_dir holds no checkpoint of its own, "
                f"which needs resume=auto, not resume={resume}: drop one of the two"
            )
        if cfg.init_from not in (None, ""):
            raise ValueError(
                f"branch_from={branch} and init_from={cfg.init_from} both say where the run "
                "starts: branch_from takes a training checkpoint's whole state (step, optimizer, "
                "data position), init_from only weights (from step 0); drop one of the two"
            )
        from fot.training.checkpoint import latest_checkpoint, not_a_checkpoint

        own = cfg.get("out_dir")
        continues = own not in (None, "") and latest_checkpoint(Path(own) / "checkpoints")
        # a branch that has a checkpoint of its own continues from it after a requeue:
        # branch_from is not read then, and may be gone (the parent's keep_last rotated it)
        if not continues and not (Path(branch) / "trainer.json").is_file():
            raise ValueError(f"branch_from={not_a_checkpoint(branch)}")
    from fot.models.fla_baselines import FLA_MODELS  # no CPU path (only TRITON_INTERPRET=1)

    device = str(cfg.device)
    if os.environ.get("TRITON_INTERPRET") != "1" and device in ("cpu", "auto"):
        import torch

        on_cpu = device == "cpu" or not torch.cuda.is_available()
    else:
        on_cpu = False
    if on_cpu and cfg.model.name in FLA_MODELS:
        raise ValueError(
            f"model={cfg.model.name} runs FLA's Triton kernels, which need a CUDA GPU (this "
            f"run is on the CPU with device={device}): run it on a GPU (or under "
            "TRITON_INTERPRET=1, very slowly); fot's own models (fot_pro, fot_llama, "
            "transformer_*) train on the CPU"
        )
    model_config = _model_config(cfg)
    if cfg.model.name in FLA_MODELS:
        from fot.errors import MissingPackageError
        from fot.models.fla_baselines import missing_package

        missing = missing_package(model_config)
        if missing is not None:
            raise MissingPackageError(f"model={cfg.model.name}: {missing}")
    if on_cpu and getattr(model_config, "attn_backend", None) == "triton":
        raise ValueError(
            f"model.overrides.attn_backend=triton runs the Triton kernels, which need a CUDA GPU "
            f"(this run is on the CPU with device={device}): use attn_backend=auto (Triton on "
            "a GPU, the PyTorch reference on the CPU) or reference"
        )
    from fot.data.loaders import feeds_varlen
    from fot.models import FoTConfig
    from fot.models.configuration_fot import triton_head_dim_problem

    if isinstance(model_config, FoTConfig) and not on_cpu:
        backend = model_config.attn_backend
        # on a GPU only an ungated model's whole causal sequences skip the kernels (SDPA);
        # packed documents (cu_seqlens) go to them, but a zarr array packs varlen as causal
        kernel = backend == "triton" or (
            backend in ("auto", "sdpa")
            and (
                model_config.fgate_type != "none"
                or model_config.window_size is not None
                or feeds_varlen(cfg.data)
            )
        )
        if kernel and (problem := triton_head_dim_problem(model_config)):
            raise ValueError(f"model={cfg.model.name} size={cfg.size.name}: {problem}")

    # (FLA's configs carry a max_position_embeddings of 2048 that their models do not use)
    max_len = model_config.max_position_embeddings if isinstance(model_config, FoTConfig) else None
    if max_len is not None and max_len < int(cfg.data.seq_len):
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is longer than the model's "
            f"max_position_embeddings={max_len}; raise "
            f"model.overrides.max_position_embeddings to at least {cfg.data.seq_len} (or "
            "shorten data.seq_len)"
        )
    from fot.data.streams import EOT_ID

    vocab_size = int(model_config.vocab_size)

    # every reader but that of a flat .npy/.bin file (ids as they are) puts <|endoftext|>
    # before each document; the batch check blamed the data, after the run folder was made
    if vocab_size <= EOT_ID and not reads_ids_as_they_are(cfg.data):
        raise ValueError(
            f"model.overrides.vocab_size={vocab_size} leaves out <|endoftext|> (GPT-2 id "
            f"{EOT_ID}), which data={cfg.data.kind} puts before every document: use a "
            f"vocab_size of at least {EOT_ID + 1} (the presets' GPT-2 vocabulary), or leave it "
            "out; ids of another tokenizer train as they are from a flat .npy or .bin file"
        )
    start = cfg.data.get("doc_start_id")
    if start is not None:
        if not reads_ids_as_they_are(cfg.data):
            raise ValueError(
                f"data.doc_start_id={start} is read from flat .npy/.bin token files only (data="
                f"{cfg.data.kind} here puts <|endoftext|>, {EOT_ID}, before every document "
                "itself): leave it out"
            )
        if not 0 <= int(start) < vocab_size:
            raise ValueError(
                f"data.doc_start_id={start} is no id of the model's vocabulary (0 to "
                f"{vocab_size - 1}): set the id that starts each document in the files"
            )
    elif (
        vocab_size != EOT_ID + 1
        and cfg.data.packing == "varlen"
        and reads_ids_as_they_are(cfg.data)
    ):
        raise ValueError(
            f"data.packing=varlen starts a document at every <|endoftext|> (GPT-2's id "
            f"{EOT_ID}) of a flat token file, but the model's vocab_size={vocab_size} is not "
            "GPT-2's (50257): in another tokenizer's ids that id is an ordinary token, and the "
            "documents' own starts would go unseen. Set data.doc_start_id=<the id that starts "
            "each document in the files> (the tokenizer's BOS), or data.packing=causal "
            "(documents packed end to end, attending across their boundaries)"
        )
    if cfg.peak_flops is not None and not float(cfg.peak_flops) > 0:
        raise ValueError(
            f"peak_flops={cfg.peak_flops} must be > 0 (the device's peak FLOP/s for MFU, e.g. "
            "989e12 for an H100/H200 in bf16), or null to look it up"
        )
    from fot.errors import not_one_of
    from fot.training.metrics import WANDB_MODES
    from fot.training.parallel import BACKENDS, PARAM_PRECISIONS, REDUCE_PRECISIONS

    if cfg.parallel.backend not in BACKENDS:  # (else checked under torchrun only)
        raise ValueError(not_one_of("parallel.backend", cfg.parallel.backend, BACKENDS))
    if cfg.parallel.backend == "nccl":
        import torch

        if device == "cpu" or not torch.cuda.is_available():  # else a RuntimeError from c10d
            raise ValueError(
                f"parallel.backend=nccl needs CUDA GPUs, but this run is on the CPU "
                f"(device={device}): use parallel.backend=gloo (or auto: nccl on CUDA, gloo on "
                "the CPU)"
            )
    timeout = cfg.parallel.timeout_s
    if timeout is not None and not _positive_seconds(timeout):
        raise ValueError(
            f"parallel.timeout_s={timeout!r} is not a positive number of seconds (0.001 or "
            "more, torch's unit): set how long a rank waits for the others in a collective "
            "(e.g. parallel.timeout_s=3600), or null for torch's defaults (600 s over nccl, "
            "1800 s over gloo)"
        )
    if cfg.wandb.mode not in WANDB_MODES:
        raise ValueError(not_one_of("wandb.mode", cfg.wandb.mode, WANDB_MODES))

    if cfg.parallel.reduce_precision not in REDUCE_PRECISIONS:
        raise ValueError(
            not_one_of(
                "parallel.reduce_precision", cfg.parallel.reduce_precision, REDUCE_PRECISIONS
            )
        )
    from fot.tokenizer import TEXT_ESCAPINGS

    if cfg.data.text_escaping not in (None, *TEXT_ESCAPINGS):
        raise ValueError(
            not_one_of("data.text_escaping", cfg.data.text_escaping, TEXT_ESCAPINGS)
            + " (or null: json for data=longcrawl64, none otherwise)"
        )
    if cfg.parallel.param_precision not in PARAM_PRECISIONS:
        raise ValueError(
            not_one_of("parallel.param_precision", cfg.parallel.param_precision, PARAM_PRECISIONS)
        )

    warnings = []
    total, warmup = int(cfg.total_tokens), int(cfg.schedule.warmup_tokens)
    gbt = int(cfg.global_batch_tokens)
    # the last step's tokens: the run trains whole global batches only
    trained = total // gbt * gbt if 0 < gbt <= total else total
    if trained != total:
        warnings.append(
            f"total_tokens={total} is not a multiple of global_batch_tokens={gbt}: the run "
            f"trains {total // gbt} steps ({trained} tokens; its learning-rate schedule ends "
            f"there); use total_tokens={max(1, round(total / gbt)) * gbt}"
        )
    if warmup > trained:
        warnings.append(
            f"schedule.warmup_tokens={warmup} is more than the {trained} tokens the run trains "
            f"(total_tokens={total}): the learning rate never reaches optim.lr={cfg.optim.lr} "
            f"(its last step's is {cfg.optim.lr * trained / warmup:.3g}); lower "
            "schedule.warmup_tokens or raise total_tokens"
        )
    decay_start = warmup  # tokens after which the steps' rates fall (lr_at)
    if cfg.schedule.name == "wsd":
        span = max(round(float(cfg.schedule.decay_fraction) * trained), 1)
        decay_start = trained - span
        if trained - span < warmup:
            warnings.append(
                f"schedule.decay_fraction={cfg.schedule.decay_fraction} starts the decay at "
                f"{trained - span} tokens, before the warmup ends "
                f"(schedule.warmup_tokens={warmup}): the run has no stable phase, and its "
                "learning rate drops where the warmup ends; lower schedule.decay_fraction "
                "or schedule.warmup_tokens, or raise total_tokens"
            )
    if warning := _empty_decay(cfg, trained, gbt, decay_start):
        warnings.append(warning)
    for key in ("log_every_tokens", "val_every_tokens", "ckpt_every_tokens"):
        every = int(cfg[key])
        if key == "val_every_tokens" and int(cfg.data.val_tokens) == 0:
            continue  # no validation
        # (every <= gbt: at every step; 2 * every > trained: once at most, no intervals)
        if gbt > 0 and every > gbt and every % gbt and 2 * every <= trained:
            warnings.append(
                f"{key}={every} is not a multiple of global_batch_tokens={gbt}: it acts at the "
                f"first step that crosses each multiple of {every}, so the intervals are uneven; "
                f"use a multiple such as {key}={max(1, round(every / gbt)) * gbt}"
            )
    return warnings


def _empty_decay(cfg: DictConfig, trained: int, gbt: int, decay_start: int) -> str | None:
    """Why the schedule's decay takes no step or one of the ``trained`` tokens (each step's
    rate is that after its last token, :func:`fot.training.optim.lr_at`): the learning rate
    never leaves the peak, or leaves it at the last step alone, falling to the floor at once.
    None for a decay of two steps or more, for ``constant``, a ``min_lr_ratio`` of 1 and a
    run of one step, and where another warning covers it (a warmup longer than the run, a
    wsd decay that starts inside the warmup)."""
    sched = cfg.schedule
    warmup = int(sched.warmup_tokens)
    if sched.name == "constant" or float(sched.min_lr_ratio) >= 1 or not 0 < 2 * gbt <= trained:
        return None  # (a run of one step, a smoke test, has no schedule to speak of)
    if warmup > trained or decay_start < warmup:
        return None
    steps = trained // gbt - decay_start // gbt  # steps that end after the decay starts
    lr, floor = cfg.optim.lr, cfg.optim.lr * float(sched.min_lr_ratio)
    if steps == 0:
        return (
            f"schedule.warmup_tokens={warmup} lasts the whole run (total_tokens="
            f"{cfg.total_tokens}): the learning rate rises to optim.lr={lr} at the last step "
            f"and never decays (to {floor:.3g}, schedule.min_lr_ratio × optim.lr); lower "
            "schedule.warmup_tokens or raise total_tokens"
        )
    if steps > 1:
        return None
    if sched.name == "wsd":
        fix = (
            f"raise schedule.decay_fraction to at least {2 * gbt / trained:.3g} (two steps of "
            f"global_batch_tokens={gbt}) or raise total_tokens"
        )
        cause = f"schedule.decay_fraction={sched.decay_fraction} decays over"
    else:
        fix = "lower schedule.warmup_tokens or raise total_tokens"
        cause = f"schedule.warmup_tokens={warmup} leaves the decay"
    from fot.training.optim import lr_at

    before = lr_at(trained - gbt, peak_lr=lr, total_tokens=trained, cfg=sched)
    return (
        f"{cause} {trained - decay_start} of the {trained} tokens the run trains, within one "
        f"step of global_batch_tokens={gbt}: the learning rate (peak optim.lr={lr}) falls "
        f"from {before:.3g} to {floor:.3g} (schedule.min_lr_ratio × optim.lr) in the last step "
        f"alone; {fix}"
    )


def _positive_seconds(value: Any) -> bool:
    """Whether ``value`` is a number of seconds that a ``datetime.timedelta`` holds, of at
    least a millisecond (torch's unit for a process group's timeout); not a bool, a string,
    NaN or infinity."""
    from datetime import timedelta

    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return timedelta(seconds=value) >= timedelta(milliseconds=1)
    except (OverflowError, ValueError):  # infinity, NaN
        return False


def _model_config(cfg: DictConfig) -> Any:
    """The model's HF config (``fot.presets.config``); a refused field is named as the
    ``model.overrides`` key that sets it. A field the model does not read that the checkpoint
    the run resumes holds (an older fot took it) is refused with the way out: drop it."""
    from fot import presets

    overrides = cfg.model.overrides or {}
    if isinstance(overrides, DictConfig):
        overrides = OmegaConf.to_container(overrides, resolve=True)
    try:
        return presets.config(cfg.model.name, cfg.size.name, **overrides)
    except ValueError as err:
        problem = f"model={cfg.model.name} size={cfg.size.name}, model.overrides={overrides}: {err}"
    try:  # refused for fields it does not read only?
        read = presets.read_overrides(cfg.model.name, cfg.size.name, overrides)
        presets.config(cfg.model.name, cfg.size.name, **read)
    except ValueError:
        raise ValueError(problem) from None
    unread = {key: value for key, value in overrides.items() if key not in read}
    start = _started_from(cfg)
    was = (start[1].get("model") or {}).get("overrides") or {} if start else {}
    if unread and all(key in was for key in unread):
        given = " ".join(f"model.overrides.{key}={value}" for key, value in unread.items())
        it = "it" if len(unread) == 1 else "them"
        problem = (
            f"{given}: model={cfg.model.name} does not read {it}. The checkpoint this run "
            f"resumes ({start[0]}) was trained with {it} by an older fot, which took {it} "
            f"unread: drop {given}, and the run resumes unchanged"
        )
    raise ValueError(problem)


def _started_from(cfg: DictConfig) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint the run goes on from (``resume=auto``: out_dir's latest, else
    ``branch_from``; ``resume=<checkpoint>``) and the config it records; None if none."""
    from fot.training.checkpoint import latest_checkpoint, read_trainer_state

    start = None
    if cfg.resume == "auto":
        own = cfg.get("out_dir")
        start = latest_checkpoint(Path(own) / "checkpoints") if own not in (None, "") else None
        if start is None and cfg.get("branch_from") not in (None, ""):
            start = Path(cfg.branch_from)
    elif cfg.resume not in ("never", "", None):
        start = Path(cfg.resume)
    try:
        config = read_trainer_state(start).get("config") if start is not None else None
    except Exception:  # unreadable: the resume names it
        return None
    return (start, config) if isinstance(config, dict) else None


def check_multirun_out_dir(cfg: DictConfig, *, multirun: bool) -> None:
    """Refuse one fixed ``out_dir`` for every job of a Hydra multirun (``-m``).

    All jobs would share the run folder: the second job would resume (``resume=auto``) from
    the first job's last checkpoint, train nothing more and report the first job's metrics.

    Args:
        cfg: the composed root config.
        multirun: whether Hydra runs this job as part of a sweep.

    Raises:
        ValueError: ``multirun`` with an ``out_dir`` that is no interpolation (an
            interpolation such as ``out_dir=/runs/${hydra:job.num}`` can differ per job).
    """
    if not multirun or OmegaConf.is_interpolation(cfg, "out_dir") or cfg.out_dir is None:
        return
    raise ValueError(_shared_out_dir_message(cfg.out_dir))


def multirun_out_dir_problem(argv: list[str]) -> str | None:
    """The refusal of :func:`check_multirun_out_dir` for a command line, before Hydra starts
    (which would first make the sweep folder and its ``multirun.yaml``); ``None`` when
    ``argv`` has no ``-m``/``--multirun`` or no fixed ``out_dir=`` override.

    Args:
        argv: the command-line arguments after the script name.
    """
    if not any(a in ("-m", "--multirun") for a in argv):
        return None
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "out_dir" and value not in ("", "null") and "${" not in value:
            return _shared_out_dir_message(value)
    return None


def sweep_job_problem(argv: list[str], config_dir: str | os.PathLike) -> str | None:
    """The refusal of the first job of a multirun (``-m``) whose values training would refuse
    before it starts (:func:`check_config`, ``fot.training.trainer.check_sizes``, a local data
    path that does not exist: ``fot.data.loaders.check_data_paths``), checked
    for every job before the first one trains: Hydra checks only that each job's config
    composes, so a value refused for one job only (``model.overrides.x=...`` that one of the
    swept models does not have, a ``micro_batch_size`` that does not split one of the swept
    batches, a ``data.path`` swept over a folder that is not there) stopped the sweep when it
    reached that job, after the jobs before it had trained, and left that job's folder behind.

    ``None`` when ``argv`` has no ``-m``/``--multirun``, no swept value, a flag that prints
    or chooses another config (the configs checked would not be the run's), another sweeper,
    or jobs that do not compose (Hydra names those itself); also when every job passes.

    Args:
        argv: the command-line arguments after the script name (Hydra's resolvers and
            ``fot``'s config schemas registered: :func:`register_configs`).
        config_dir: the folder of ``train.yaml``.
    """
    if not any(a in ("-m", "--multirun") for a in argv):
        return None
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return None  # --config-dir, --cfg job, -c, --info, ...: not the run's configs
    overrides = [a for a in argv if a not in ("-m", "--multirun")]
    if any(a.lstrip("+~").startswith(("hydra/sweeper=", "hydra.sweeper.")) for a in overrides):
        return None  # another sweeper (or its parameters) makes the jobs
    from hydra import compose, initialize_config_dir
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fot.data.loaders import check_data_paths
    from fot.errors import USER_ERRORS
    from fot.training.trainer import check_sizes

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        if not any(o.is_sweep_override() for o in parsed):
            return None  # one job: it checks itself before anything is written
        [jobs] = BasicSweeper.split_arguments(parsed, None)
    except Exception:  # an unparsable sweep or a range/interval: Hydra says what is wrong
        return None
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    saved_hydra = HydraConfig.instance().cfg
    folders: dict[Path, int] = {}  # each job's run folder, and the first job to run there

    def label(num: int) -> str:
        return " ".join(o for o in jobs[num] if o.split("=", 1)[0] in swept)

    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            for num, job in enumerate(jobs):
                try:
                    cfg = compose("train", overrides=job, return_hydra_config=True)
                except Exception:  # Hydra's own check of every job names it
                    return None
                cfg.hydra.job.num = num
                HydraConfig.instance().set_config(cfg)  # ${hydra:job.num} in out_dir=...
                if cfg.out_dir is None:  # the job's folder, as train.py gives it
                    cfg.out_dir = str(Path(cfg.hydra.sweep.dir) / str(cfg.hydra.sweep.subdir))
                try:
                    check_config(cfg)
                    check_sizes(cfg, world_size)
                    check_data_paths(cfg.data)
                except USER_ERRORS as err:
                    refusal = str(err).rstrip(".")  # most end in a full stop, as this does
                    return (
                        f"job #{num} of the sweep ({label(num)}) would be refused: {refusal}. "
                        "No job has started: change that value or leave it out of the sweep"
                    )
                try:
                    folder = Path(str(cfg.out_dir)).expanduser().resolve()
                except Exception:  # an interpolation that does not resolve: Hydra names it
                    return None
                first = folders.setdefault(folder, num)
                if first != num:  # the later job would resume (or find finished) the first's run
                    return (
                        f"jobs #{first} ({label(first)}) and #{num} ({label(num)}) of the sweep "
                        f"would both run in out_dir={folder}: the later one would go on from "
                        "the earlier one's run instead of training its own. No job has started: "
                        "put a swept value in out_dir (e.g. out_dir=runs/${hydra:job.num}) or "
                        "leave out_dir out (each job then gets its own folder)"
                    )
    finally:
        HydraConfig.instance().cfg = saved_hydra
    return None


_KEEPS_HYDRA_FOLDERS = {
    # Hydra prints and exits: no run folder
    "-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "-p", "--package", "-i",
    "--info", "--resolve", "-sc", "--shell-completion",
    # another primary config may choose the folders itself
    "-cp", "--config-path", "-cn", "--config-name", "-cd", "--config-dir",
}  # fmt: skip


def default_date_folder(argv: list[str], now: Any) -> Path:
    """``outputs/<date>`` (``multirun/<date>`` with ``-m``): the parent of the default run
    folders of a run started at ``now`` (a ``datetime``) with these arguments."""
    multirun = any(a in ("-m", "--multirun") for a in argv)
    return Path("multirun" if multirun else "outputs") / now.strftime("%Y-%m-%d")


def claim_default_folder(
    argv: list[str], now: Any = None, world_size: int | None = None, rank: int | None = None
) -> tuple[str, str, bool] | None:
    """Make the run's default folder now, so that runs started in the same second each get one.

    Hydra names a run ``outputs/<date>/<time>`` (a multirun ``multirun/<date>/<time>``) to the
    second, so two runs started in the same second (a loop of ``python train.py ... &``) would
    share it: the second would write its ``.hydra/`` over the first's and then be refused by
    the run-folder lock. This makes the folder (``mkdir``, atomic: one process wins) and, if
    another run made it first, ``<time>-1``, ``<time>-2``, ...

    Of several processes (torchrun, srun) only rank 0 does; the trainer gives every rank rank
    0's folder. The other ranks' Hydra gets a temporary folder (for its ``train.log``), to be
    removed when the process ends: Hydra's own, named by the second at which each process
    started, left an empty ``outputs/<time>`` behind whenever a rank started a second later.

    Args:
        argv: the command-line arguments after the script name.
        now: the time to name the folder by (``datetime.now()`` if None).
        world_size: processes of the run (``WORLD_SIZE`` if None).
        rank: this process's rank (``RANK`` if None).

    Returns:
        ``(override, folder, temporary)``: the Hydra override that names the folder (for a
        run, an ``out_dir`` set in a config file still wins), the folder made, and whether it
        is a rank's temporary folder; None where Hydra or the command line chooses:
        ``out_dir=``, ``hydra.run.dir=`` (``hydra.sweep.dir=`` for ``-m``) given, or a flag
        that prints and exits or chooses another config.
    """
    import datetime
    import tempfile

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if rank is None:
        rank = int(os.environ.get("RANK", "0") or 0)
    if any(a.split("=")[0] in _KEEPS_HYDRA_FOLDERS for a in argv):
        return None
    multirun = any(a in ("-m", "--multirun") for a in argv)
    keys = {a.lstrip("+").split("=")[0] for a in argv if "=" in a}
    if keys & ({"hydra.sweep.dir"} if multirun else {"out_dir", "hydra.run.dir"}):
        return None
    if world_size > 1 and rank > 0:
        folder = Path(tempfile.mkdtemp(prefix=f"fot-train-rank{rank}-"))
    else:
        now = now or datetime.datetime.now()
        base = default_date_folder(argv, now) / now.strftime("%H-%M-%S")
        base.parent.mkdir(parents=True, exist_ok=True)
        folder, n = base, 0
        while True:
            try:
                folder.mkdir()
                break
            except FileExistsError:
                n += 1
                folder = base.with_name(f"{base.name}-{n}")
            except FileNotFoundError:  # a refused run removed the empty date folder meanwhile
                base.parent.mkdir(parents=True, exist_ok=True)
    temporary = world_size > 1 and rank > 0
    if multirun:
        return f"hydra.sweep.dir={folder}", str(folder), temporary
    return f'hydra.run.dir="${{fot.first_set:${{out_dir}},{folder}}}"', str(folder), temporary


def out_dir_problem(argv: list[str]) -> str | None:
    """The refusal of an ``out_dir=`` (or ``hydra.run.dir=``) that is, or lies under, a file, or
    that cannot be written (a read-only file system, no permission), before Hydra tries to make
    it its run folder (a ``FileExistsError`` or ``OSError`` traceback otherwise); ``None`` when
    there is no such override or it can be a folder.

    Args:
        argv: the command-line arguments after the script name.
    """
    from pathlib import Path

    for key, value in _set_values(argv, ("out_dir", "hydra.run.dir")):
        if value == "" or "${" in value:
            continue
        path = Path(value).expanduser()
        blocker = next((p for p in (path, *path.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            where = "is a file" if blocker == path else f"lies under the file {blocker}"
            return (
                f"{key}={value} {where}, not a folder; choose a new folder for the run (or an "
                "earlier run's folder, to resume it)"
            )
        if blocker is not None and not os.access(blocker, os.W_OK | os.X_OK):
            where = "" if blocker == path else f" (its folder {blocker})"
            return (
                f"{key}={value}{where} cannot be written: a read-only file system or no "
                "permission; choose a folder you can write"
            )
        problem = _not_a_run_folder(path)
        if problem:
            return f"{key}={value} {problem}"
    return None


def folder_kind(path: Path) -> str | None:
    """What the existing folder ``path`` holds where it is no training run's and no
    results folder of its own: ``"checkpoint"`` (a training checkpoint: ``trainer.json``),
    ``"export"`` (a model: ``config.json`` and weights), ``"tokens"`` (a token folder) or
    ``"eval"`` (``python -m fot.eval`` results: ``run_config.json``, no ``run_info.json``);
    ``None`` otherwise. Standard library only: train.py's checks run before fot is imported."""
    if (path / "trainer.json").is_file():
        return "checkpoint"
    weights = [*path.glob("*.safetensors"), *path.glob("pytorch_model*.bin")]
    if (path / "config.json").is_file() and weights:
        return "export"
    if (path / "run_config.json").is_file() and not (path / "run_info.json").is_file():
        return "eval"
    try:  # fot.data.tokens.is_token_folder, without importing fot here (start-up time)
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if isinstance(meta, dict) and meta.get("format") == "fot-tokens":
        return "tokens"
    return None


def _not_a_run_folder(path: Path) -> str | None:
    """What the existing folder ``path`` is where it is a model export, a training checkpoint,
    a token folder (a slip for ``init_from=``, ``resume=`` or ``data.path=``) or a folder of
    fot.eval results, which a run would fill with its own files; ``None`` otherwise."""
    kind = folder_kind(path)
    if kind == "checkpoint":
        return (
            "is a training checkpoint, not a run folder: to go on with its run, pass that run's "
            f"folder (out_dir={path.parent.parent}); to start a new run from its weights, "
            f"init_from={path} with a new out_dir"
        )
    if kind == "export":
        return (
            "is an exported model (config.json and weights), not a run folder: to start a run "
            f"from its weights, pass init_from={path} with a new out_dir"
        )
    if kind == "tokens":
        return "is a token folder (data), not a run folder: choose a new folder for the run"
    if kind == "eval":
        return (
            "holds results of python -m fot.eval (run_config.json), not a training run: "
            "choose a new folder for the run"
        )
    return None


def _set_values(argv: list[str], keys: tuple[str, ...]) -> list[tuple[str, str]]:
    """``(key, value)`` of each override in ``argv`` that sets one of ``keys`` to one value, as
    Hydra reads it: its quotes taken off (``out_dir='/runs/a b'`` sets ``/runs/a b``), escapes
    resolved, a number or bool as the string the field gets. ``null``, deletions (``~key``),
    sweeps, lists and overrides Hydra cannot parse (:func:`unparsable_override` names those)
    are left out.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    found = []
    after_flag = False
    for arg in argv:
        if after_flag or arg.startswith("-") or "=" not in arg:
            after_flag = arg in _FLAGS_WITH_VALUE
            continue
        if arg.lstrip("+~").partition("=")[0] not in keys:
            continue  # parse only the few overrides asked about
        try:
            override = parser.parse_overrides([arg])[0]
        except OverrideParseException:
            continue
        if override.is_delete() or override.is_sweep_override() or override.package is not None:
            continue
        value = override.value()
        if isinstance(value, str | int | float):  # bool too: OmegaConf's string of it
            found.append((override.key_or_group, str(value)))
    return found


def chdir_problem(argv: list[str]) -> str | None:
    """The refusal of ``hydra.job.chdir=true``: Hydra would change into the run folder before
    fot reads ``out_dir``, ``data.path`` and the other paths, which are relative to where the
    command runs (the run's files would land in ``<out_dir>/<out_dir>``, and a relative data
    path would not be found); ``None`` without it.

    Args:
        argv: the command-line arguments after the script name.
    """
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "hydra.job.chdir" and value.strip().lower() in ("true", "yes", "on", "1"):
            return (
                f"{arg}: fot reads out_dir, data.path and the other paths relative to the "
                "folder the command runs in, and Hydra would change into the run folder first "
                "(the run's files would land in <out_dir>/<out_dir>); leave it out: the run "
                "folder is out_dir (or Hydra's outputs/<date>/<time>/) either way"
            )
    return None


def _shared_out_dir_message(out_dir: object) -> str:
    return (
        f"out_dir={out_dir} with -m (multirun): every job would share that folder, and each "
        "job after the first would resume from the previous job's checkpoint instead of "
        "training; drop out_dir (jobs go to hydra.sweep.dir/<job number>), set "
        f"hydra.sweep.dir={out_dir}, or give each job its own folder with "
        "'out_dir=<folder>/${hydra:job.num}'"
    )


def _config_nodes(node: Any, prefix: str = "") -> dict[str, Any]:
    """The node of every field by dotted key: a group's fields, not the group; a free-form
    dict (``model.overrides``) and a list are one field each."""
    nodes: dict[str, Any] = {}
    for key in node:
        path = f"{prefix}{key}"
        child = node._get_node(key)
        if isinstance(child, DictConfig) and OmegaConf.get_type(child) is not dict:
            nodes |= _config_nodes(child, f"{path}.")
        else:
            nodes[path] = child
    return nodes


def unknown_override_key(override: str, *, added: bool = True) -> str | None:
    """A message for a command-line ``key=value`` whose key is no field of :class:`TrainConfig`
    (``lr=1e-3``, ``total_token=1000``, ``modle=fot_pro``), naming the closest fields or
    groups; ``None`` for a known key.

    A key added with ``+`` or ``++`` (``+optim.lrr=1``) is checked too: Hydra adds it to the
    config, where nothing reads it, and the run went on without the setting. Overrides that
    Hydra handles itself are never flagged: ``~``, ``hydra.*``, ``experiment=`` and keys under
    a free-form dict such as ``model.overrides``.

    Args:
        override: one command-line argument.
        added: check ``+``/``++`` keys (off where config folders added on the command line
            may hold groups of their own, which ``+group=option`` chooses).
    """
    import difflib
    import re

    match = re.match(r"^(\+{0,2})([A-Za-z_][\w.]*)=", override)
    if match is None or (match.group(1) and not added):
        return None
    key = match.group(2)
    if key.split(".")[0] in ("hydra", "experiment"):
        return None
    schema: Any = OmegaConf.structured(TrainConfig)
    node = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig) or OmegaConf.get_type(node) is dict:
            return None  # a free-form dict (model.overrides) or a leaf: Hydra decides
        if part not in set(node.keys()):  # (`in` is false for a MISSING field)
            break
        node = node._get_node(part)
    else:
        return None
    keys = list(_config_nodes(schema))
    if "." not in key:  # the groups too: model, size, data, ...
        keys += [k for k in schema if k not in keys]
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.6)
    close += [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k not in close]
    hint = f"did you mean {' or '.join(close)}?" if close else "see `python train.py --help`"
    if key.startswith("model."):
        hint += " (a model field goes in +model.overrides.<field>=<value>)"
    if match.group(1):
        hint += f" ({match.group(1)} adds a key to the config, where nothing would read this one)"
    return f"unknown config key {key!r} in {override!r}: {hint}"


def misprefixed_override(args: list[str], configs: Path | None = None) -> str | None:
    """A message for the first command-line override whose ``+`` prefix does not fit its key,
    naming the form that does; ``None`` when every prefix fits.

    Hydra refuses these in its own form (exit status 1), which for a group says to write
    ``override experiment: ...`` in a defaults list:

    * ``+key=value`` for a field the config has (``+total_tokens=5``): ``+`` only adds a key;
    * ``+group=option`` for a group that ``train.yaml``'s defaults list already chooses from
      (``+experiment=fot_pro_125m_2b``, as where ``experiment`` is no default);
    * ``model.overrides.<field>=value`` or ``model.overrides={...}`` without ``+``: a free-form
      dict (``model.overrides``, ``data.storage_options``) starts empty, so its keys are added
      with ``+`` (unless the same command line sets that dict too, or a config file it chooses
      does: an experiment of the user's that sets ``model.overrides.<field>``).

    Args:
        args: the command line after ``train.py``.
        configs: the ``configs/`` folder, whose ``train.yaml`` lists the groups (``None``, as
            for config folders added on the command line, whose files may set any key: only
            ``+`` on a field of the schema is checked).
    """
    groups: set[str] = set()
    if configs is not None and (configs / "train.yaml").is_file():
        defaults = OmegaConf.load(configs / "train.yaml").get("defaults", [])
        groups = {k for d in defaults if isinstance(d, DictConfig) for k in d}
    leaves = _config_nodes(OmegaConf.structured(TrainConfig))
    free = [k for k, node in leaves.items() if isinstance(node, DictConfig)]
    fields = set(leaves) - set(free)  # `+model.overrides={...}`: Hydra merges it into the dict
    keys = [a.split("=", 1)[0].lstrip("+") for a in args if "=" in a and not a.startswith("-")]
    in_files = _keys_set_by_chosen_files(args, configs) if configs is not None else set()
    for arg in args:
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        if "@" in key:  # a package override: Hydra's
            continue
        if key.startswith("+") and not key.startswith("++") and key[1:] in fields:
            bare = key[1:]
            return (
                f"{arg!r}: {bare} is already in the config and + only adds a key that is not: "
                f"write {bare}={value} (or ++{bare}={value}, which adds or replaces)"
            )
        if key.startswith("+") and not key.startswith("++") and key[1:] in groups:
            bare = key[1:]
            return (
                f"{arg!r}: {bare} is a config group that train.yaml already chooses from, and + "
                f"would add a second choice: write {bare}={value}"
            )
        if key.startswith("+") or configs is None or (key in in_files and key not in free):
            continue
        for name in free:
            others = [k for k in keys if (k == name or k.startswith(f"{name}.")) and k != key]
            others += [k for k in in_files if k.startswith(f"{name}.")] if key == name else []
            empty = key == name and value.replace(" ", "") == "{}"
            if (key == name or key.startswith(f"{name}.")) and not others and not empty:
                what = "its keys are" if key == name else f"{key} is"
                return (
                    f"{arg!r}: {name} holds only the keys added to it, so {what} added with "
                    f"+: write +{arg} (or ++{arg}, which adds or replaces)"
                )
    return None


def _keys_set_by_chosen_files(args: list[str], configs: Path) -> set[str]:
    """Every dotted key that the config files chosen for ``args`` set: the options of
    ``train.yaml``'s defaults list, replaced by the command line's ``group=option`` (each option
    of a sweep), and the files their own defaults lists choose."""
    chosen = dict(_group_choices(_config_file(configs / "train.yaml")[0]))
    for arg in args:
        if "=" not in arg or arg.startswith(("-", "~")):
            continue
        key, value = arg.split("=", 1)
        if (configs / key.lstrip("+")).is_dir():
            chosen[key.lstrip("+")] = value
    found: set[str] = set()
    seen: set[Path] = set()
    todo = [(g, o.strip()) for g, options in chosen.items() for o in options.split(",")]
    while todo:
        group, option = todo.pop()
        path = configs / group / f"{option}.yaml"
        if path in seen:
            continue
        seen.add(path)
        node, text = _config_file(path)
        if node is None:
            continue
        lines = text.splitlines()
        header = itertools.takewhile(lambda ln: ln.startswith("#") or not ln.strip(), lines)
        is_global = any("@package _global_" in ln for ln in header)  # Hydra's header comments
        prefix = "" if is_global else f"{group}."
        found |= {prefix + k for k in _dotted_keys(node) if k.split(".")[0] != "defaults"}
        todo += _group_choices(node)
    return found


def _config_file(path: Path) -> tuple[DictConfig | None, str]:
    """Config file ``path`` as a DictConfig, and its text; ``(None, "")`` if it is missing or
    holds no mapping (Hydra names a broken file when it composes)."""
    try:
        text = path.read_text()
        node = OmegaConf.create(text)
    except Exception:
        return None, ""
    return (node, text) if isinstance(node, DictConfig) else (None, "")


def _group_choices(node: DictConfig | None) -> list[tuple[str, str]]:
    """``(group, option)`` for each group entry of config ``node``'s defaults list
    (``override /model: fot_pro`` gives ``("model", "fot_pro")``)."""
    entries = []
    for entry in (node.get("defaults") or []) if node is not None else []:
        if isinstance(entry, DictConfig):
            for group, option in entry.items():
                if isinstance(option, str):
                    entries.append(
                        (str(group).removeprefix("override ").strip().lstrip("/"), option)
                    )
    return entries


def _dotted_keys(node: DictConfig, prefix: str = "") -> set[str]:
    """Every key of ``node`` and of the dicts in it, dotted (``model``, ``model.overrides``,
    ``model.overrides.qk_norm``)."""
    keys: set[str] = set()
    for key in node:
        keys.add(f"{prefix}{key}")
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            keys |= _dotted_keys(child, f"{prefix}{key}.")
    return keys


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
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

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


def _quoted_override(parser: Any, key: str, value: str) -> str | None:
    """``key=value`` with the value quoted for Hydra (in quotes it does not hold, else with
    its double quotes escaped), then for the shell: what to type so that Hydra reads
    ``value``; ``None`` where even that does not parse."""
    import shlex

    from hydra.errors import OverrideParseException

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
    from hydra.core.override_parser.types import ChoiceSweep
    from omegaconf.errors import OmegaConfBaseException

    leaves = _config_nodes(OmegaConf.structured(TrainConfig))
    for arg, override in _parsed_overrides(args):
        # ++ sets an existing field as = does; + (a new key) is Hydra's
        if arg.startswith("+") != arg.startswith("++"):
            continue
        key = override.key_or_group
        node = leaves.get(key)
        if override.package is not None or node is None or isinstance(node, DictConfig):
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
                return f"{arg!r}: {reason}; {key} takes {_kind(node)}"
    return None


def _parsed_overrides(args: list[str]) -> Iterator[tuple[str, Any]]:
    """``(arg, Hydra's parsed override)`` of each ``key=value`` of ``args``; flags, deletions
    (``~key``) and overrides Hydra cannot parse (:func:`unparsable_override` names those) are
    left out."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    for arg in args:
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        try:
            yield arg, parser.parse_overrides([arg])[0]
        except OverrideParseException:
            continue


def non_dict_override(args: list[str]) -> str | None:
    """A message for the first command-line override that sets a free-form dict field
    (``model.overrides``, ``data.storage_options``) to something other than a dict, e.g.
    ``++model.overrides=use_output_gate:false``, or the two words the shell makes of an unquoted
    ``++model.overrides={a:1,b:2}`` (brace expansion); ``None`` when there is none. Hydra
    refuses them in its own four-line form ("Cannot assign str to Dict[str, Any]") with exit
    status 1.

    Args:
        args: the command line after ``train.py``.
    """
    dicts = {
        key
        for key, node in _config_nodes(OmegaConf.structured(TrainConfig)).items()
        if isinstance(node, DictConfig)
    }
    found: dict[str, list[str]] = {}
    for arg, override in _parsed_overrides(args):
        key = override.key_or_group
        if key not in dicts or override.package is not None or override.is_sweep_override():
            continue
        value = override.value()
        if isinstance(value, dict) or (isinstance(value, str) and "${" in value):
            continue
        found.setdefault(key, []).append(arg)
    for key, bad in found.items():
        plus = bad[0][: len(bad[0]) - len(bad[0].lstrip("+"))] or "++"
        pairs = [a.split("=", 1)[1] for a in bad]
        if all(":" in pair for pair in pairs):
            quoted = f"'{plus}{key}={{{','.join(pairs)}}}'"
            split = (
                "the shell splits an unquoted {a:1,b:2} into one word per setting (brace "
                "expansion), so quote it: "
                if len(bad) > 1
                else ""
            )
            k, v = pairs[0].split(":", 1)
            return (
                f"{' '.join(bad)}: {key} takes a dict of settings; {split}write {quoted}, "
                f"or one setting per override, {plus}{key}.{k}={v}"
            )
        return (
            f"{bad[0]!r}: {key} takes a dict of settings, e.g. '{plus}{key}={{name:value}}' "
            f"(quoted) or {plus}{key}.name=value; {{}} for none"
        )
    return None


def _kind(node: Any) -> str:
    """What a leaf field takes, in words, for the message of :func:`mistyped_override`."""
    from omegaconf import BooleanNode, FloatNode, IntegerNode, ListConfig, StringNode

    kinds = {
        IntegerNode: "a whole number",
        FloatNode: "a number",
        BooleanNode: "true or false",
        StringNode: "a string",
        ListConfig: "a list such as [0.9,0.95]",
    }
    kind = next((words for cls, words in kinds.items() if isinstance(node, cls)), "another value")
    return kind if node._is_optional() else f"{kind} (not null)"


def unknown_group_option(override: str, config_dir: str | os.PathLike) -> str | None:
    """A message for a command-line ``group=option`` whose option has no YAML file in
    ``config_dir/<group>/`` (``size=huge``, ``model=fot-pro``), listing the group's options and
    the closest; ``None`` when every option exists or ``group`` is no config group.

    Comma-separated options (a ``-m`` sweep) are checked one by one; ``null`` and Hydra's
    sweep functions and interpolations (``glob(...)``, ``${...}``) are left to Hydra.
    """
    import difflib
    import re

    match = re.match(r"^\+?([A-Za-z_]\w*)=(.+)$", override)
    if match is None:
        return None
    group, value = match.groups()
    folder = Path(config_dir) / group
    if not folder.is_dir() or any(c in value for c in "()${}[]"):
        return None
    options = sorted(p.stem for p in folder.glob("*.yaml"))
    bad = [v.strip() for v in value.split(",") if v.strip() not in (*options, "null")]
    if not bad:
        return None
    close = difflib.get_close_matches(bad[0], options, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return (
        f"unknown {group} option {bad[0]!r} in {override!r}: {hint}the {group} options are "
        f"{', '.join(options)} (files in {folder})"
    )
