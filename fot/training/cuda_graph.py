"""The training step as one CUDA graph (``parallel.cuda_graphs=true``, one GPU or DDP).

An eager step spends host time on every kernel launch: Python, autograd and Triton's
launcher. When the GPU work per step is short (small models, or FoT heads whose exact pruning
skips most attention tiles) the GPU waits for the host. :class:`GraphedStep` runs the first
steps eagerly (they compile and tune every kernel and create the optimizer state), then
captures one whole step (every micro batch's forward and backward, the gradient clip and
AdamW) as a CUDA graph and replays it for each later step, after copying the step's tokens,
label counts and learning rate into the graph's fixed input buffers. A replay launches the
same kernels on the same memory as the eager step, so the losses and weights equal those of
an eager run.

Packed documents (``data.packing=varlen``) work too: a step's ``cu_seqlens`` has as many
entries as its batch has documents, so the graph reads a fixed buffer of ``tokens + 1``
entries, the step's boundaries followed by copies of the last one (empty documents at the
end, which the kernels and the model never visit).

Several GPUs (``parallel=ddp``): the graph holds the step's collectives too. The model is
not wrapped in DDP, whose gradient hooks a replay would skip: the step averages the gradients
itself after its last backward (:func:`fot.training.parallel.all_reduce_gradients`, one
all-reduce as NCCL captures it), and every rank replays its own copy of the same graph.

What a graph needs, and :func:`check_cuda_graphs` / :class:`GraphedStep` check: CUDA devices
(``parallel=single`` or ``ddp``; FSDP2's own streams and events do not replay), no
``torch.compile`` (it makes its own graphs), batches of one shape, and a model whose step
never waits for the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from fot.data.streams import Batch
from fot.training.config import ParallelConfig

logger = logging.getLogger("fot.train")

StepFn = Callable[
    [Sequence[Batch], Sequence[int | torch.Tensor], Sequence[float | torch.Tensor]],
    tuple[torch.Tensor, torch.Tensor],
]


def check_cuda_graphs(cfg: ParallelConfig, *, strategy: str, device: torch.device) -> None:
    """Raise ``ValueError`` if ``parallel.cuda_graphs=true`` cannot work for this run.

    Args:
        cfg: the ``parallel`` config.
        strategy: the resolved strategy (``single``, ``ddp`` or ``fsdp``).
        device: this process's device.
    """
    if not cfg.cuda_graphs:
        return
    off = "or set parallel.cuda_graphs=false"
    if device.type != "cuda":
        raise ValueError(
            f"parallel.cuda_graphs=true needs a CUDA device, this run is on {device} ({off})"
        )
    if strategy == "fsdp":
        raise ValueError(
            "parallel.cuda_graphs=true runs parallel=single or parallel=ddp, this run is "
            "parallel=fsdp: FSDP2 gathers and reduces parameters with its own streams and "
            f"events, which a graph does not replay (use parallel=ddp or single, {off})"
        )
    if cfg.compile:
        raise ValueError(
            "parallel.cuda_graphs=true and parallel.compile=true do not go together: "
            f"torch.compile makes and replays its own graphs (set parallel.compile=false, {off})"
        )


class GraphedStep:
    """Run ``step_fn`` eagerly for ``eager_steps`` calls, then as one CUDA graph.

    ``step_fn(batches, n_tokens, scales) -> (loss_sum, grad_norm)`` does one optimizer step on
    device batches: ``batches[i]`` is micro batch ``i`` (``input_ids``/``labels`` ``[B, T]``
    int64, optional ``cu_seqlens`` ``[N + 1]``), ``n_tokens[i]`` its number of label tokens
    and ``scales[i]`` the factor of its mean loss in the backward; it returns the float64 sum of token losses and the gradient
    norm. Eager calls get Python numbers, the captured call 0-dim CUDA tensors (float64 token
    counts, float32 scales) holding the same values. ``step_fn`` must not zero the gradients:
    the graph's first backward writes them and the later ones add to them.

    The optimizer must be ``capturable``. Its learning rate stays a float in
    ``param_groups`` (what schedules set and checkpoints store); each replay copies it into
    the tensor the captured AdamW reads.

    Args:
        step_fn: the step, as above.
        optimizer: the optimizer ``step_fn`` steps.
        device: the CUDA device.
        eager_steps: calls run eagerly before the capture (at least 1: the first call
            compiles the Triton kernels and creates the AdamW state).
    """

    def __init__(
        self,
        step_fn: StepFn,
        optimizer: torch.optim.Optimizer,
        *,
        device: torch.device,
        eager_steps: int = 2,
    ) -> None:
        if eager_steps < 1:
            raise ValueError(f"eager_steps must be >= 1, got {eager_steps}")
        if not all(g.get("capturable", False) for g in optimizer.param_groups):
            raise ValueError("GraphedStep needs an optimizer built with capturable=True")
        self.step_fn = step_fn
        self.optimizer = optimizer
        self.device = device
        self.eager_left = eager_steps
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(
        self,
        batches: Sequence[Batch],
        n_tokens: Sequence[int],
        scales: Sequence[float | torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step on CPU (or device) ``batches``; returns ``(loss_sum, grad_norm)``.

        ``scales`` are Python floats, or (several processes) 0-dim CUDA tensors computed from
        the all-reduced token count; they are copied into the graph on the GPU.

        After the capture the two tensors are the graph's outputs, overwritten by the next
        call: copy them (or add them to something) before calling again.
        """
        if self.eager_left > 0:
            self.eager_left -= 1
            return self.step_fn([b.to(self.device) for b in batches], n_tokens, scales)
        if self.graph is None:
            self._capture(batches)
        self._load(batches, n_tokens, scales)
        assert self.graph is not None
        self.graph.replay()
        return self.loss_sum, self.grad_norm

    def _load(
        self,
        batches: Sequence[Batch],
        n_tokens: Sequence[int],
        scales: Sequence[float | torch.Tensor],
    ) -> None:
        """Copy one step's inputs into the graph's buffers (asynchronously, from pinned memory)."""
        if len(batches) != len(self.input_ids):
            raise ValueError(
                f"this step has {len(batches)} micro batches, the captured step "
                f"{len(self.input_ids)}: a CUDA-graph step needs the same number every step"
            )
        for b, ids, labels, cu in zip(
            batches, self.input_ids, self.labels, self.cu_seqlens, strict=True
        ):
            if b.input_ids.shape != ids.shape or (b.cu_seqlens is None) != (cu is None):
                raise ValueError(
                    f"micro batch of shape {tuple(b.input_ids.shape)} "
                    f"({'with' if b.cu_seqlens is not None else 'without'} cu_seqlens), the "
                    f"captured step's is {tuple(ids.shape)} "
                    f"({'with' if cu is not None else 'without'}): a CUDA-graph step needs one "
                    "batch shape"
                )
            ids.copy_(b.input_ids.pin_memory(), non_blocking=True)
            labels.copy_(b.labels.pin_memory(), non_blocking=True)
            if cu is not None:
                n = b.cu_seqlens.numel()
                if n > cu.numel():
                    raise ValueError(
                        f"cu_seqlens has {n} entries, more than tokens + 1 = {cu.numel()}: "
                        "document boundaries must be distinct positions"
                    )
                padded = torch.full((cu.numel(),), ids.numel(), dtype=cu.dtype).pin_memory()
                padded[:n] = b.cu_seqlens
                cu.copy_(padded, non_blocking=True)
        k = len(batches)
        if any(isinstance(x, torch.Tensor) for x in scales):
            # several processes: the scales come from the all-reduced token count, on the GPU
            host = torch.tensor(n_tokens, dtype=torch.float64).pin_memory()
            self.numbers[:k].copy_(host, non_blocking=True)
            self.numbers[k:].copy_(torch.stack([torch.as_tensor(x) for x in scales]))
        else:
            host = torch.tensor([*n_tokens, *scales], dtype=torch.float64).pin_memory()
            self.numbers.copy_(host, non_blocking=True)
        for lr, group in zip(self.lrs, self.optimizer.param_groups, strict=True):
            lr.fill_(group["lr"])

    def _capture(self, batches: Sequence[Batch]) -> None:
        dev = self.device
        k = len(batches)
        self.input_ids = [torch.empty_like(b.input_ids, device=dev) for b in batches]
        self.labels = [torch.empty_like(b.labels, device=dev) for b in batches]
        # Packed documents: a fixed buffer of tokens + 1 boundaries (the step's, then copies
        # of the last), filled by _load like the tokens.
        self.cu_seqlens = [
            None
            if b.cu_seqlens is None
            else torch.empty(b.input_ids.numel() + 1, dtype=b.cu_seqlens.dtype, device=dev)
            for b in batches
        ]
        self.numbers = torch.zeros(2 * k, dtype=torch.float64, device=dev)
        statics = [
            Batch(ids, labels, cu, b.seq_len)
            for ids, labels, cu, b in zip(
                self.input_ids, self.labels, self.cu_seqlens, batches, strict=True
            )
        ]
        groups = self.optimizer.param_groups
        self.lrs = [torch.tensor(float(g["lr"]), device=dev) for g in groups]
        lr_floats = [g["lr"] for g in groups]
        self.optimizer.zero_grad(set_to_none=True)  # the graph's backward allocates them
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # the eager steps' cached blocks, before the graph's pool
        graph = torch.cuda.CUDAGraph()
        try:
            for g, lr in zip(groups, self.lrs, strict=True):
                g["lr"] = lr
            with torch.cuda.graph(graph):
                n_tokens = [self.numbers[i] for i in range(k)]  # (,) float64
                scales = [self.numbers[k + i].float() for i in range(k)]  # (,) float32
                self.loss_sum, self.grad_norm = self.step_fn(statics, n_tokens, scales)
        except RuntimeError as e:
            raise RuntimeError(
                f"capturing the training step as a CUDA graph failed ({e}). Something in "
                "this model's step waits for the host or cannot be captured; set "
                "parallel.cuda_graphs=false"
            ) from e
        finally:
            for g, lr in zip(groups, lr_floats, strict=True):
                g["lr"] = lr
        self.graph = graph
        logger.info(
            "training step captured as a CUDA graph (%d micro batches of %s); replaying it",
            k,
            tuple(self.input_ids[0].shape),
        )
