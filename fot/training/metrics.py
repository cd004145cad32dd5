"""Run logging: JSONL metrics, wandb (online/offline/disabled, never fatal), run info, MFU."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fot.errors import cannot_write, not_one_of, retry_when
from fot.provenance import sweep_folder, sweep_job_label
from fot.training.checkpoint import write_text_atomic

if TYPE_CHECKING:
    from fot.data.streams import Batch

logger = logging.getLogger("fot.train")

WANDB_MODES = ("auto", "online", "offline", "disabled")

# Dense bf16 peak FLOP/s per device (no sparsity), by substring of the device name; the first
# match counts, so the PCIe and NVL cards (and GH200) come before the SXM ones whose names
# they contain.
_PEAK_FLOPS = {
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H800 PCIe": 756e12,
    "H200 NVL": 835e12,
    "GH200": 989e12,
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A6000": 155e12,
    "4090": 165e12,
}


def peak_flops_per_device(device: torch.device) -> float | None:
    """bf16 dense peak FLOP/s of a known GPU, else ``None`` (CPU, unknown GPUs)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in _PEAK_FLOPS.items():
        if key in name:
            return value
    return None


def attention_pairs(lengths: int | Sequence[int] | np.ndarray, window: int | None = None) -> int:
    """The (query, key) pairs causal attention scores in documents of these lengths, summed.

    ``n (n + 1) / 2`` per document of ``n`` tokens; with a sliding window of ``window`` keys
    (``i - window < j <= i``) each query from the ``window``-th on sees ``window`` keys.

    Args:
        lengths: one length, or the lengths of several documents.
        window: sliding window in keys, ``None`` for full causal attention.
    """
    n = np.asarray(lengths, dtype=np.int64)
    pairs = n * (n + 1) // 2
    if window is not None:
        pairs = np.where(n > window, window * (window + 1) // 2 + (n - window) * window, pairs)
    return int(pairs.sum())


@dataclass(frozen=True)
class FlopCounter:
    """Training FLOPs (forward + backward) of a model: ``6 N`` per token plus ``12 d_attn``
    per (query, key) pair in each softmax-attention layer.

    ``N`` counts every parameter except the input embedding (the LM head included, also when
    it is tied to the input embedding; the embedding lookup costs no matmul FLOPs). ``q k^T``
    and ``p v`` are ``2 * 2 * d_attn`` FLOPs per pair, times 3 with the backward. Models
    without softmax attention (Mamba-2, DeltaNet, HGRN-2) get no attention term; Samba counts
    its attention layers only if the config says which.

    Attributes:
        params: ``N``.
        attn_layers: softmax-attention layers.
        d_attn: attention width (``hidden_size``).
        window: sliding window in keys, ``None`` for full causal attention.
    """

    params: int
    attn_layers: int
    d_attn: int
    window: int | None = None

    @classmethod
    def of(cls, model: nn.Module, config: Any) -> FlopCounter:
        """The counter of ``model`` (unwrapped) with HF config ``config``."""
        emb = model.get_input_embeddings().weight
        n = sum(p.numel() for p in model.parameters()) - emb.numel()
        head = getattr(model, "get_output_embeddings", lambda: None)()
        if head is not None and head.weight is emb:  # tied: the head's matmul costs the same
            n += emb.numel()
        if getattr(config, "model_type", None) == "fot":
            return cls(
                params=n,
                attn_layers=int(config.num_hidden_layers),
                d_attn=int(config.hidden_size),
                window=getattr(config, "window_size", None),
            )
        # FLA hybrids (Samba) name their softmax-attention layers in ``config.attn``; heads
        # of ``hidden_size // num_heads``, sliding window of ``window_size`` keys
        attn = getattr(config, "attn", None)
        if isinstance(attn, dict) and attn.get("layers"):
            heads = int(attn["num_heads"])
            return cls(
                params=n,
                attn_layers=len(attn["layers"]),
                d_attn=heads * (int(config.hidden_size) // heads),
                window=attn.get("window_size"),
            )
        return cls(params=n, attn_layers=0, d_attn=int(getattr(config, "hidden_size", 0)))

    def of_documents(self, lengths: Sequence[int] | np.ndarray) -> float:
        """Training FLOPs of documents of these lengths (attention restarts in each)."""
        tokens = int(np.sum(lengths, dtype=np.int64))
        pairs = attention_pairs(lengths, self.window)
        return 6.0 * self.params * tokens + 12.0 * self.attn_layers * self.d_attn * pairs

    def of_batch(self, batch: Batch) -> float:
        """Training FLOPs of one micro batch (on the CPU): its documents (``cu_seqlens``,
        varlen packing) or else its ``B`` rows of ``T`` tokens. Host arithmetic only."""
        return self.of_documents(batch.document_lengths())


def flops_per_token(model: nn.Module, config: Any, seq_len: int) -> float:
    """Training FLOPs per token of one full causal sequence of ``seq_len`` tokens:
    ``6 N + 6 L d_attn (T + 1)``, i.e. ``12 L d_attn`` per (query, key) pair over the average
    causal context ``(T + 1) / 2`` (less with a sliding window). See :class:`FlopCounter`.

    Args:
        model: the unwrapped model.
        config: its HF config.
        seq_len: training sequence length T.
    """
    return FlopCounter.of(model, config).of_documents([seq_len]) / seq_len


def resolve_wandb_mode(mode: str) -> str:
    """The wandb mode of a run: ``wandb.mode`` when set (``online``/``offline``/``disabled``,
    also over a ``WANDB_MODE`` in the environment, e.g. a cluster profile's); for ``auto``
    the environment's ``WANDB_MODE``, else ``online`` with an API key (env or netrc), else
    ``offline``."""
    if mode not in WANDB_MODES:
        raise ValueError(not_one_of("wandb.mode", mode, WANDB_MODES))
    if mode != "auto":
        return mode
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled", "dryrun"):
        return "offline" if env == "dryrun" else env
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path.home() / ".netrc"
    try:
        if netrc.is_file() and "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


def read_records(path: str | os.PathLike) -> list[str]:
    """The lines of a run's ``metrics.jsonl`` (none where there is no such file).

    Raises:
        ValueError: it cannot be read (a folder in its place, no permission, an I/O error, or
            bytes that are not text), naming the file and the fix.
    """
    p = Path(path)
    try:
        return p.read_text().splitlines()
    except FileNotFoundError:
        return []
    except OSError as err:
        why = err.strerror or str(err)
    except UnicodeDecodeError as err:
        why = f"byte {err.start} is not UTF-8 text ({err.reason})"
    raise ValueError(
        f"cannot read {p}: {why}. It holds a run's training and validation records: make it a "
        "readable file again, or move it aside to go on without them"
    )


def abandon_newer_records(path: str | os.PathLike, step: int) -> int:
    """Move the records of steps after ``step`` out of a ``metrics.jsonl`` (rank 0, at start).

    A run that starts at ``step`` (0 for a new run in a used folder, ``resume=<earlier
    checkpoint>``, or ``resume=auto`` after a crash past the last checkpoint) logs those steps
    again; left in place, the file would hold two runs' records for the same steps. They are
    appended to ``metrics.abandoned.jsonl`` next to it (kept, like ``.abandoned-step_*``
    checkpoints), as is any line that is not a JSON record with a ``step`` (a line cut short
    by a crash).

    Returns:
        The number of lines moved.
    """
    p = Path(path)
    keep: list[str] = []
    moved: list[str] = []
    for line in read_records(p):
        if not line.strip():
            continue
        try:
            rec_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            rec_step = None
        (keep if rec_step is not None and rec_step <= step else moved).append(line + "\n")
    if not moved:
        return 0
    with open(p.with_name(f"{p.stem}.abandoned.jsonl"), "a") as f:  # first: nothing is lost
        f.writelines(moved)
    write_text_atomic(p, "".join(keep))
    return len(moved)


class MetricsLogger:
    """Rank-0 sink for metrics: a JSONL file and, if it starts, a wandb run.

    Every record gets ``step`` and ``tokens``. In wandb, ``step`` is a logged value and the
    x-axis of every chart, so the steps a resumed run logs again (those after its checkpoint)
    are kept, beside the first try's. wandb failures (no key, no network, no package) become a
    warning and the run continues with JSONL only.

    Args:
        out_dir: the run folder (``metrics.jsonl`` is appended to).
        enabled: False on ranks other than 0 (then every call is a no-op).
        wandb_cfg: ``wandb`` config (mode, project, entity, name).
        config: the resolved config, sent to wandb.
        resume_id: wandb run id to resume (kept in checkpoints).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        enabled: bool,
        wandb_cfg: Any,
        config: dict[str, Any],
        resume_id: str | None = None,
    ) -> None:
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.wandb_run = None
        self.wandb_id: str | None = resume_id
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # unbuffered bytes: a write that fails (a full disk) is cut back off the file in log()
        try:
            self._file = open(self.path, "ab", buffering=0)  # noqa: SIM115 - closed in close()
        except OSError as err:
            why = err.strerror or str(err)
            if self.path.is_symlink():
                why += f" (it is a symbolic link to {os.readlink(self.path)})"
            raise ValueError(
                f"cannot write {self.path}: {why}. It holds the run's training and validation "
                "records: make it a writable file (or a link to one) again, or move it aside"
            ) from None
        mode = resolve_wandb_mode(wandb_cfg.mode)
        if mode == "disabled":
            return
        if os.environ.get("WANDB_MODE") == "":
            os.environ.pop("WANDB_MODE")  # wandb rejects an empty mode; ours is passed below
        try:
            import wandb

            self.wandb_run = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name or sweep_job_label(out_dir) or Path(out_dir).name,
                group=wandb_cfg.group or getattr(sweep_folder(out_dir), "name", None),
                dir=str(out_dir),
                config=config,
                mode=mode,
                id=resume_id,
                resume="allow" if resume_id else None,
            )
            self.wandb_id = self.wandb_run.id
            # Charts plot against the logged "step", not wandb's own counter: a resumed run
            # logs again the steps after its checkpoint, which wandb drops when they are
            # given as its counter ("steps must be monotonically increasing").
            self.wandb_run.define_metric("step")
            self.wandb_run.define_metric("*", step_metric="step")
        except Exception as err:  # wandb must never stop training
            offline = (
                "wandb.mode=offline to keep a local wandb run (`wandb sync` uploads it later), or "
                if mode == "online"
                else ""
            )
            warnings.warn(
                f"wandb ({mode}) did not start ({type(err).__name__}: {err}); logging to "
                f"{self.path} only. Set {offline}wandb.mode=disabled to silence this.",
                stacklevel=2,
            )
            self.wandb_run = None

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (must include ``step``)."""
        if not self.enabled:
            return
        data = memoryview((json.dumps(record) + "\n").encode())
        size = os.fstat(self._file.fileno()).st_size
        try:
            while data:
                data = data[self._file.write(data) :]
        except OSError as err:
            with contextlib.suppress(OSError):  # no cut-short line that a later one follows
                os.ftruncate(self._file.fileno(), size)
            when, elsewhere = retry_when(err)
            go_on = (
                "rerun with out_dir=<a folder you can write> resume=<its latest checkpoint> to "
                f"go on from it there, or, {when}, with resume=auto"
                if elsewhere
                else f"{when}, rerun with resume=auto to go on from its latest checkpoint"
            )
            error = cannot_write(
                self.path,
                err,
                f"Its earlier records are kept. The run stopped at step {record.get('step')}; "
                + go_on,
            )
            if error is None:
                raise
            raise error from err
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(record)
            except Exception as err:
                warnings.warn(f"wandb.log failed ({err}); continuing", stacklevel=2)

    def close(self) -> None:
        """Flush and close the file and the wandb run."""
        if not self.enabled:
            return
        self._file.close()
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as err:
                warnings.warn(f"wandb.finish failed ({err})", stacklevel=2)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocated on GPU, max RSS on CPU (GiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / 2**20 if sys.platform != "darwin" else rss / 2**30
    except ImportError:  # pragma: no cover - Windows
        return float("nan")
