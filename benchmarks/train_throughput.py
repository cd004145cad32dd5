"""Training throughput of FoT models and their baselines, side by side in one process.

For each model: build it as the trainer does (fp32 weights on the device, bf16 autocast,
fused AdamW from :func:`fot.training.optim.build_optimizer`), run ``--warmup`` untimed steps,
then ``--steps`` timed steps of forward + backward + gradient clipping + AdamW step on random
tokens, and report step time, tokens/s, MFU and peak memory.

The AdamW step runs at learning rate ``--lr``, by default 0: the same kernels and bytes as at
any learning rate, but the parameters stay as built, so every timed step costs what the model
at its initialisation costs. Training on the benchmark's one repeated batch would otherwise
change the step time as it goes: the FoT gates learn to decay faster and exact pruning then
skips more (760M FoT (Pro), weak gates, H200: 396 ms falling to 366-371 ms over 10 steps at
LR 1e-3, against a flat 408-413 ms at LR 0).

Models:

* ``fot_pro``, ``fot_llama``, ``transformer_pro``, ``transformer_llama``: ours, from
  :func:`fot.presets.config` (``attn_backend="auto"`` on CUDA: the Triton kernel for gated
  attention, PyTorch SDPA for the Transformer baselines; ``"reference"`` on CPU).
  ``--fot-backend triton`` runs the baselines through our kernel with ``log f = 0`` instead.
  ``--fgate-bias-init B`` sets the forget-gate bias of the FoT models. The default init (0, so
  ``f ~ 0.5``, ``log f ~ -0.69`` per token) decays so fast that exact pruning (margin ~111
  nats) skips every key tile more than ~200 tokens back: attention costs almost nothing.
  ``B = 5`` (``f ~ 0.993``) reaches the margin only after ~16k tokens, i.e. next to no pruning
  at T=16k (the cost of long-range heads); ``B = 3`` (``f ~ 0.95``) prunes beyond ~2k tokens.
* ``hf_llama``: ``transformers.LlamaForCausalLM`` with SDPA, the width, depth, heads (head dim 64
  at 760m), MLP width and vocabulary of the ``fot_llama`` preset, RoPE theta 500000.
* ``fla_fot``: FLA's ``ForgettingTransformerForCausalLM`` of the same size (FLA's defaults:
  fused norm, SwiGLU and cross-entropy on CUDA). Its Triton kernels need a GPU: on CPU the
  default ``--models`` leaves it out, except under Triton's interpreter (``TRITON_INTERPRET=1``,
  slow; its times mean nothing), where it runs.

MFU = FLOPs/token * tokens/s / peak, with FLOPs/token from ``benchmarks/flops.py`` (one formula
for all models, attention included: ``6 N + 12 L d_attn (T + 1) / 2``) and the peak dense bf16
FLOP/s from ``--peak-tflops`` (default by device name: 989 TFLOP/s for H100/H200; an unknown
GPU, or ``--precision fp32``, whose matmuls do not run at the bf16 peak, gets no MFU unless
``--peak-tflops`` gives the peak).

    python benchmarks/train_throughput.py --out results/train_760m.json        # 760m, T=16384
    python benchmarks/train_throughput.py --models fot_pro,hf_llama --compile --act-ckpt
    python benchmarks/train_throughput.py --device cpu --size tiny --seq-len 128 --steps 2

Each model runs inside its own ``try``: an out-of-memory error or any other failure is reported
in its row and the next model runs. The JSON file (``--out``) is rewritten after every model;
the markdown table is printed last. An existing ``--out`` file is refused (it holds an earlier
run's results).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # sibling modules (flops.py) when imported from elsewhere
    sys.path.insert(0, str(_HERE))

from flops import flops_breakdown  # noqa: E402

OUR_MODELS = ("fot_pro", "fot_llama", "transformer_pro", "transformer_llama")
BASELINES = ("hf_llama", "fla_fot")
ALL_MODELS = OUR_MODELS + BASELINES
PRECISIONS = ("auto", "autocast", "bf16", "fp32")
ROPE_THETA = 500000.0

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def log(msg: str) -> None:
    """Print a progress line at once (stdout, flushed: readable under a pipe)."""
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------
# Model construction
# ---------------------------------------------------------------------------------------


def hf_llama_config(size: str, *, max_positions: int = 65536, num_heads: int | None = None) -> Any:
    """HF ``LlamaConfig`` of the same size as the ``fot_llama`` preset.

    Args:
        size: a :data:`fot.presets.SIZES` name.
        max_positions: ``max_position_embeddings`` (at least the sequence length).
        num_heads: attention heads (default: the FoT preset's, i.e. head dim 64 at 760m).

    Returns:
        A ``LlamaConfig`` with SDPA attention, untied embeddings and GPT-2's vocabulary.
    """
    from transformers import LlamaConfig

    from fot import presets

    base = presets.config("fot_llama", size)
    heads = num_heads or base.num_heads
    if base.hidden_size % heads:
        raise ValueError(
            f"--hf-llama-heads {heads} does not divide hidden_size {base.hidden_size}; pick a "
            "divisor"
        )
    fields = {
        "vocab_size": base.vocab_size,
        "hidden_size": base.hidden_size,
        "intermediate_size": base.mlp_size,
        "num_hidden_layers": base.num_hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "max_position_embeddings": max_positions,
        "rms_norm_eps": base.norm_eps,
        "initializer_range": base.initializer_range,
        "tie_word_embeddings": False,
        "bos_token_id": base.bos_token_id,
        "eos_token_id": base.eos_token_id,
        "use_cache": False,
    }
    try:  # transformers 5: rope_parameters; older releases: rope_theta
        config = LlamaConfig(
            **fields, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}
        )
    except TypeError:
        config = LlamaConfig(**fields, rope_theta=ROPE_THETA)
    config._attn_implementation = "sdpa"
    return config


def fla_fot_config(size: str, *, on_cuda: bool, fused_linear_ce: bool = False) -> Any:
    """FLA ``ForgettingTransformerConfig`` of the same size as the ``fot_llama`` preset.

    Args:
        size: a :data:`fot.presets.SIZES` name.
        on_cuda: keep FLA's fused cross-entropy (it asserts CUDA, so off on CPU).
        fused_linear_ce: use FLA's fused linear cross-entropy instead of fused cross-entropy.
    """
    from fla.models import ForgettingTransformerConfig

    from fot import presets

    base = presets.config("fot_llama", size)
    return ForgettingTransformerConfig(
        hidden_size=base.hidden_size,
        num_hidden_layers=base.num_hidden_layers,
        num_heads=base.num_heads,
        intermediate_size=base.mlp_size,
        vocab_size=base.vocab_size,
        norm_eps=base.norm_eps,
        initializer_range=base.initializer_range,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        tie_word_embeddings=False,
        use_cache=False,
        fuse_cross_entropy=on_cuda and not fused_linear_ce,
        fuse_linear_cross_entropy=on_cuda and fused_linear_ce,
    )


def _our_loss(model: nn.Module, input_ids: torch.Tensor, shift_labels: torch.Tensor):
    return model(input_ids=input_ids, shift_labels=shift_labels).loss


def _hf_loss(model: nn.Module, input_ids: torch.Tensor, shift_labels: torch.Tensor):
    # HF / FLA shift the labels themselves: position t predicts input_ids[t + 1]
    return model(input_ids=input_ids, labels=input_ids).loss


def build(
    name: str,
    size: str,
    *,
    device: torch.device,
    seq_len: int,
    fot_backend: str = "auto",
    fot_overrides: dict[str, Any] | None = None,
    hf_llama_heads: int | None = None,
    fla_fused_linear_ce: bool = False,
    fgate_bias_init: float | None = None,
) -> tuple[nn.Module, Any, LossFn]:
    """Build one benchmarked model in fp32 on ``device``.

    Args:
        name: one of :data:`ALL_MODELS`.
        size: a :data:`fot.presets.SIZES` name.
        device: where to build it.
        seq_len: sequence length (sizes the position tables).
        fot_backend: ``attn_backend`` of our models; ``auto`` = the model's ``auto`` on CUDA
            (Triton kernel, SDPA without a gate), ``reference`` elsewhere.
        fot_overrides: further ``FoTConfig`` fields of our models (e.g. ``loss_impl``).
        hf_llama_heads: heads of ``hf_llama`` (default: as the FoT preset).
        fla_fused_linear_ce: ``fla_fot`` with fused linear cross-entropy.
        fgate_bias_init: if set, our models' ``FoTConfig.fgate_bias_init`` (the initial bias
            of every data-dependent forget gate: the decay strength at init).

    Returns:
        ``(model, config, loss_fn)``; ``loss_fn(model, input_ids, shift_labels)`` is the mean
        next-token loss, ``input_ids``/``shift_labels`` ``[B, T]`` int64.
    """
    from fot import presets

    max_positions = max(65536, seq_len)
    if name in OUR_MODELS:
        backend = fot_backend
        if backend == "auto" and device.type != "cuda":
            backend = "reference"
        fields: dict[str, Any] = {"attn_backend": backend, "max_position_embeddings": max_positions}
        if fgate_bias_init is not None and presets.config(name, size).fgate_type == "full":
            fields["fgate_bias_init"] = fgate_bias_init  # the data-dependent gates only
        config = presets.config(name, size, **{**fields, **(fot_overrides or {})})
        with torch.device(device):
            model = presets.build_model(config)
        return model, config, _our_loss
    if name == "hf_llama":
        from transformers import LlamaForCausalLM

        config = hf_llama_config(size, max_positions=max_positions, num_heads=hf_llama_heads)
        with torch.device(device):
            model = LlamaForCausalLM(config)
        return model, config, _hf_loss
    if name == "fla_fot":
        from fla.models import ForgettingTransformerForCausalLM

        from fot.models.fla_baselines import untimed_autotune_in_interpreter

        untimed_autotune_in_interpreter()  # on CPU, FLA's autotuner would time on a GPU driver
        config = fla_fot_config(
            size, on_cuda=device.type == "cuda", fused_linear_ce=fla_fused_linear_ce
        )
        with torch.device(device):
            model = ForgettingTransformerForCausalLM(config)
        return model, config, _hf_loss
    raise ValueError(f"unknown model {name!r}; valid: {list(ALL_MODELS)}")


# ---------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------


@dataclass
class Settings:
    """What every model in one run shares."""

    size: str
    seq_len: int
    batch_size: int
    steps: int
    warmup: int
    device: torch.device
    precision: str  # autocast | bf16 | fp32 (resolved)
    compile: bool
    act_ckpt: bool
    peak_flops: float | None
    fot_backend: str = "auto"
    fot_overrides: dict[str, Any] | None = None
    hf_llama_heads: int | None = None
    fla_fused_linear_ce: bool = False
    fgate_bias_init: float | None = None
    profile_steps: int = 0
    lr: float = 0.0
    cuda_graphs: bool = False


# Kernel-name patterns -> category, first match wins (lower-case substrings), after our own
# attention kernels (exact names). Heuristic: `top_kernels` shows what the categories hold.
OUR_ATTENTION_KERNELS = frozenset(
    {"_fwd_kernel", "_bwd_dq_kernel", "_bwd_dkdv_kernel", "_kmax_kernel", "_gate_cumsum_kernel",
     "_dlogf_kernel", "_doc_bounds_kernel"}
)  # fmt: skip
# The fused FoT (Pro) component kernels of fot.kernels.pro_ops (their names contain "norm").
OUR_PRO_KERNELS = frozenset(
    {"_shift_norm_fwd_kernel", "_shift_norm_bwd_kernel", "_norm_gate_fwd_kernel",
     "_norm_gate_bwd_kernel"}
)  # fmt: skip
PROFILE_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention: other", ("flash", "fmha", "cudnn", "attn", "attention")),
    ("loss (cross-entropy)", ("cross_entropy", "crossentropy", "linear_cross", "logsumexp")),
    # torch._foreach_copy_ (multi_tensor_apply_kernel<..., CopyFunctor<...>>) is the forward's
    # cast of split projections' weights (fot.kernels.linear_ops), not the optimizer's
    ("elementwise and other", ("copyfunctor",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    (
        "matmul",
        (
            "gemm",
            "xmma",
            "cutlass",
            "nvjet",
            "matmul",
            "sm90",
            "sm80",
            "cublas",
            "::mm",
            "::bmm",
            "::addmm",
        ),
    ),
    ("norms", ("rms", "norm")),
)


def profile_categories(events: list[tuple[str, float]], steps: int) -> dict[str, Any]:
    """Per-step device time by kernel category from ``(kernel name, total ms)`` pairs.

    Returns:
        ``{"ms_per_step": {category: ms}, "total_ms_per_step": float, "top_kernels":
        [(name, ms per step), ...]}`` (the 30 largest kernels).
    """
    cats: dict[str, float] = {"attention: ours (Triton)": 0.0, "Pro components (fused)": 0.0}
    cats.update({name: 0.0 for name, _ in PROFILE_CATEGORIES if name != "elementwise and other"})
    cats["elementwise and other"] = 0.0  # last in the table
    for name, ms in events:
        low = name.lower()
        if name in OUR_ATTENTION_KERNELS:  # Triton names kernels after their functions
            cat = "attention: ours (Triton)"
        elif name in OUR_PRO_KERNELS:
            cat = "Pro components (fused)"
        else:
            cat = next(
                (c for c, pats in PROFILE_CATEGORIES if any(p in low for p in pats)),
                "elementwise and other",
            )
        cats[cat] += ms / steps
    top = sorted(events, key=lambda e: -e[1])[:30]
    return {
        "ms_per_step": cats,
        "total_ms_per_step": sum(cats.values()),
        "top_kernels": [(name[:160], ms / steps) for name, ms in top],
    }


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` -> ``autocast`` (bf16 autocast, fp32 weights, as the trainer) on CUDA, else fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision {precision!r} is not one of {list(PRECISIONS)}")
    if precision == "auto":
        return "autocast" if device.type == "cuda" else "fp32"
    return precision


class _Timer:
    """Per-step wall time: CUDA events on GPU (no host sync between steps), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _apply_compile_and_ckpt(model: nn.Module, s: Settings) -> None:
    """Per-block activation checkpointing / torch.compile through the trainer's parallelize."""
    if not (s.compile or s.act_ckpt):
        return
    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, parallelize

    cfg = ParallelConfig(strategy="single", compile=s.compile, activation_checkpointing=s.act_ckpt)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=s.device)
    parallelize(model, cfg, info, strategy="single")


def measure(name: str, s: Settings) -> dict[str, Any]:
    """Build ``name``, train ``warmup + steps`` steps on random tokens and measure.

    Returns:
        The result row (see :func:`main` for the keys). Raises on any failure (the caller
        catches it).
    """
    from fot.training.config import OptimConfig
    from fot.training.optim import build_optimizer, clip_grad_norm

    dev = s.device
    mem_before = 0.0
    if dev.type == "cuda":
        mem_before = torch.cuda.memory_allocated(dev) / 2**30  # > 0: the last model leaked
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(0)
    model, config, loss_fn = build(
        name,
        s.size,
        device=dev,
        seq_len=s.seq_len,
        fot_backend=s.fot_backend,
        fot_overrides=s.fot_overrides,
        hf_llama_heads=s.hf_llama_heads,
        fla_fused_linear_ce=s.fla_fused_linear_ce,
        fgate_bias_init=s.fgate_bias_init,
    )
    flops = flops_breakdown(model, config, s.seq_len)
    n_params = sum(p.numel() for p in model.parameters())
    n_non_emb = n_params - model.get_input_embeddings().weight.numel()
    if s.precision == "bf16":
        model.to(torch.bfloat16)  # bf16 weights and AdamW states, no fp32 master copy
    model.train()
    _apply_compile_and_ckpt(model, s)
    optimizer = build_optimizer(model, OptimConfig(), device=dev, capturable=s.cuda_graphs)
    for group in optimizer.param_groups:  # as the trainer's schedule sets each step's LR
        group["lr"] = s.lr
    amp = (
        (lambda: torch.autocast(dev.type, dtype=torch.bfloat16))
        if s.precision == "autocast"
        else contextlib.nullcontext
    )

    gen = torch.Generator(device="cpu").manual_seed(1)
    vocab = int(config.vocab_size)
    tokens = torch.randint(0, vocab, (s.batch_size, s.seq_len + 1), generator=gen)
    input_ids = tokens[:, :-1].contiguous().to(dev)  # (B, T)
    shift_labels = tokens[:, 1:].contiguous().to(dev)  # (B, T)

    def step() -> torch.Tensor:
        with amp():
            loss = loss_fn(model, input_ids, shift_labels)
        loss.backward()
        clip_grad_norm(model.parameters(), 1.0)  # the trainer's
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    if s.cuda_graphs:
        # The trainer's parallel.cuda_graphs: two eager steps, then one captured step replayed;
        # each step copies its tokens from pinned host memory into the graph's buffers.
        from fot.data.streams import Batch
        from fot.training.cuda_graph import GraphedStep

        host_batch = Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), None, s.seq_len)

        def body(
            batches: Sequence[Batch], n_tokens: Sequence[Any], scales: Sequence[Any]
        ) -> tuple[torch.Tensor, torch.Tensor]:
            b = batches[0]
            with amp():
                loss = loss_fn(model, b.input_ids, b.labels)
            loss.backward()
            norm = clip_grad_norm(model.parameters(), 1.0)  # the trainer's
            optimizer.step()
            return loss.detach().double(), norm

        graphed = GraphedStep(body, optimizer, device=dev)

        def graph_step() -> torch.Tensor:
            loss, _ = graphed([host_batch], [host_batch.num_label_tokens()], [1.0])
            optimizer.zero_grad(set_to_none=True)
            return loss.clone()  # the graph's output is overwritten by the next replay

        step = graph_step

    t0 = time.perf_counter()
    first = None
    for _ in range(s.warmup):
        loss = step()
        first = loss if first is None else first
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    warmup_s = time.perf_counter() - t0

    timer = _Timer(dev)
    timer.mark()
    for _ in range(s.steps):
        loss = step()
        first = loss if first is None else first
        timer.mark()
    times = timer.step_seconds()
    total = sum(times)
    profile = None
    if s.profile_steps > 0:
        profile = _profile(step, s.profile_steps, dev)
    loss_first, loss_last = float(first), float(loss)
    tokens_per_step = s.batch_size * s.seq_len
    tps = tokens_per_step * len(times) / total if total > 0 else float("nan")
    peak_mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
    row = {
        "model": name,
        "status": "ok" if math.isfinite(loss_last) else "non-finite loss",
        "params": n_params,
        "params_non_embedding": n_non_emb,
        "flops_per_token": flops["total"],
        "flops_breakdown": flops,
        "tokens_per_step": tokens_per_step,
        "step_time_ms_mean": 1e3 * total / len(times),
        "step_time_ms_median": 1e3 * statistics.median(times),
        "step_time_ms_min": 1e3 * min(times),
        "tokens_per_s": tps,
        "mfu": flops["total"] * tps / s.peak_flops if s.peak_flops else None,
        "achieved_tflops": flops["total"] * tps / 1e12,
        "peak_mem_gib": peak_mem,
        "mem_before_gib": mem_before,
        "step_times_ms": [round(1e3 * t, 3) for t in times],
        "warmup_s": warmup_s,
        "loss_first": loss_first,
        "loss_last": loss_last,
    }
    if profile is not None:
        row["profile"] = profile
    try:
        row.update(_implementation(name, config, dev))
    except Exception as err:  # a renamed helper must not cost the measurement
        row.update(attn_impl="unknown", loss_impl=f"unknown ({type(err).__name__})")
    return row


def _profile(step: Callable[[], torch.Tensor], steps: int, dev: torch.device) -> dict[str, Any]:
    """Run ``steps`` more training steps under ``torch.profiler``; kernel time by category
    (device time on CUDA, self CPU time of each op on CPU) and, on CUDA, the GPU timeline
    (:func:`fot.training.profiling.gpu_timeline`)."""
    from torch.profiler import ProfilerActivity, profile

    from fot.training.profiling import gpu_timeline

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
    timeline = None
    if dev.type == "cuda":
        # Kernels and copies only: user annotations such as "Optimizer.step#AdamW.step" are
        # device-side ranges around kernels that are also listed (counting them twice).
        kernels = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and e.device_time_total > 0
            and not getattr(e, "is_user_annotation", False)
        ]
        events = [(e.name, e.device_time_total / 1e3) for e in kernels]
        timeline = gpu_timeline(
            [(e.time_range.start, e.time_range.end, e.name) for e in kernels], steps
        )
    else:
        events = [
            (a.key, a.self_cpu_time_total / 1e3)
            for a in prof.key_averages()
            if a.self_cpu_time_total > 0
        ]
    merged: dict[str, float] = {}
    for name, ms in events:
        merged[name] = merged.get(name, 0.0) + ms
    result = profile_categories(list(merged.items()), steps)
    if timeline is not None:
        result["timeline"] = timeline
    return result


def _implementation(name: str, config: Any, device: torch.device) -> dict[str, Any]:
    """Which attention / loss implementation a model ran with (to read the numbers right)."""
    if name in OUR_MODELS:
        loss = config.loss_impl
        if loss == "auto":
            loss = "fused" if device.type == "cuda" else "chunked"
        loss = {"fused": "fused linear CE (ours)", "fla": "fla fused linear CE"}.get(loss, loss)
        attn = config.attn_backend
        if attn in ("auto", "sdpa") and (device.type == "cuda" or attn == "sdpa"):
            ungated = config.fgate_type == "none" and config.window_size is None
            attn = "sdpa" if ungated else ("triton" if device.type == "cuda" else "reference")
        return {"attn_impl": attn, "loss_impl": loss}
    if name == "hf_llama":
        return {"attn_impl": config._attn_implementation, "loss_impl": "full logits (HF)"}
    if config.fuse_linear_cross_entropy:
        loss = "fla fused linear CE"
    else:
        loss = "fla fused CE" if config.fuse_cross_entropy else "full logits"
    return {"attn_impl": "fla parallel_forgetting_attn", "loss_impl": loss}


def _free(device: torch.device, compiled: bool) -> None:
    gc.collect()
    if compiled:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_one(name: str, s: Settings) -> dict[str, Any]:
    """:func:`measure` one model; an OOM or any error becomes the row's ``status``."""
    row: dict[str, Any]
    try:
        row = measure(name, s)
    except torch.OutOfMemoryError as err:
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        row = {"model": name, "status": "OOM", "error": first_line[:300]}
    except Exception as err:  # one model's failure must not end the benchmark
        traceback.print_exc(limit=-8)
        msg = f"{type(err).__name__}: {err}"
        row = {"model": name, "status": "error", "error": msg[:500]}
    if s.device.type == "cuda" and row["status"] != "ok":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated(s.device) / 2**30
    _free(s.device, s.compile)
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Add ``vs_hf_llama`` / ``vs_fla_fot`` (tokens/s ratios) and ``mem_vs_hf_llama`` in place."""
    ok = {r["model"]: r for r in rows if r.get("status") == "ok"}
    for row in rows:
        for ref, key in (("hf_llama", "vs_hf_llama"), ("fla_fot", "vs_fla_fot")):
            good = row.get("status") == "ok" and ref in ok
            row[key] = row["tokens_per_s"] / ok[ref]["tokens_per_s"] if good else None
        ref_mem = ok["hf_llama"].get("peak_mem_gib") if "hf_llama" in ok else None
        good = row.get("status") == "ok" and row.get("peak_mem_gib") is not None
        row["mem_vs_hf_llama"] = row["peak_mem_gib"] / ref_mem if good and ref_mem else None


def fmt(value: Any, spec: str) -> str:
    """``format(value, spec)``, or an em dash for a missing or non-finite value."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return format(value, spec)


def status_cell(row: dict[str, Any]) -> str:
    """A result row's status for a markdown table: ``ok``, or the status and its error, with
    ``|`` as ``/`` (the table keeps its columns), cut to 120 characters."""
    status = row["status"] if row["status"] == "ok" else f"{row['status']}: {row.get('error', '')}"
    return status.replace("|", "/")[:120]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table (one row per model)."""
    head = (
        "| model | status | params (no emb.) | GFLOP/token | median step (ms) | tokens/s (mean) "
        "| MFU | peak mem (GiB) | vs HF Llama | vs FLA FoT |"
    )
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        mfu = r.get("mfu")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    status_cell(r),
                    fmt(r.get("params_non_embedding", 0) / 1e6, ".1f") + "M"
                    if r.get("params_non_embedding")
                    else "—",
                    fmt(r.get("flops_per_token", 0) / 1e9, ".2f")
                    if r.get("flops_per_token")
                    else "—",
                    fmt(r.get("step_time_ms_median"), ".1f"),
                    fmt(r.get("tokens_per_s"), ",.0f"),
                    fmt(100 * mfu, ".1f") + "%" if mfu is not None else "—",
                    fmt(r.get("peak_mem_gib"), ".1f"),
                    fmt(r.get("vs_hf_llama"), ".2f") + ("×" if r.get("vs_hf_llama") else ""),
                    fmt(r.get("vs_fla_fot"), ".2f") + ("×" if r.get("vs_fla_fot") else ""),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def profile_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: per-step kernel time by category (ms) for the profiled models."""
    rows = [r for r in rows if "profile" in r]
    cats = list(rows[0]["profile"]["ms_per_step"])
    lines = ["| category | " + " | ".join(r["model"] for r in rows) + " |"]
    lines.append("|---|" + "---|" * len(rows))
    for c in [*cats, "total"]:
        vals = [
            r["profile"]["total_ms_per_step"] if c == "total" else r["profile"]["ms_per_step"][c]
            for r in rows
        ]
        lines.append(f"| {c} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")
    if all("timeline" in r["profile"] for r in rows):
        vals = [r["profile"]["timeline"]["idle_ms_per_step"] for r in rows]
        lines.append(
            "| GPU idle (no kernel running) | " + " | ".join(f"{v:.1f}" for v in vals) + " |"
        )
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity in it (nested) replaced by ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str | os.PathLike, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically (a partial file never replaces a good one), as standard
    JSON: a NaN or infinity (a non-finite loss) becomes ``null``, which every parser reads."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_finite(payload), indent=2, default=str, allow_nan=False))
    os.replace(tmp, path)


def check_out_file(path: str | os.PathLike | None, flag: str = "--out") -> None:
    """Refuse, before anything is measured, an output file that would lose data or fail late.

    An existing file holds an earlier run's results (the scripts rewrite ``--out`` as they go,
    so the first rewrite would erase them); a folder cannot be written as a file; nor can a
    path under a file, or in a folder where no file can be made (probed with a temporary file
    in the nearest existing folder, which is removed). A missing parent folder is fine (it is
    created when the results are written).

    Raises:
        SystemExit: ``path`` is an existing file or a folder, or cannot be written.
    """
    if path is None:
        return
    path = Path(path)
    if path.is_dir():
        raise SystemExit(f"{flag} {path} is a folder; give the path of a file (in it, say)")
    if path.exists():
        raise SystemExit(
            f"{flag} {path} exists (an earlier run's results, which this run would overwrite): "
            "give a new path, or move or delete the file first"
        )
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    try:
        if not folder.is_dir():
            raise NotADirectoryError(f"{folder} is a file")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise SystemExit(f"{flag} {path} cannot be written ({err}): give a writable path") from None


def interrupted_note(what: str, done: int, out: str | None) -> str:
    """What a Ctrl-C during ``what`` keeps: ``done`` finished rows, in ``out`` if given."""
    kept = f"in {out}" if out and done else "printed below" if done else "none"
    return f"# interrupted (Ctrl-C) during {what}: {done} finished result(s) kept ({kept})"


def run_meta(device: torch.device, args: argparse.Namespace | None = None) -> dict[str, Any]:
    """Device, library versions, git SHA and arguments of this run."""
    from fot.provenance import git_sha, library_versions

    meta: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "git_sha": git_sha(),
        "versions": library_versions(),
    }
    if args is not None:
        meta["args"] = vars(args)
    return meta


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------


def parse_models(text: str, valid: Sequence[str]) -> list[str]:
    """``"a,b c"`` -> ``["a", "b", "c"]``, every name checked against ``valid`` and named
    once (a model listed twice would be built and timed twice)."""
    names = [n for n in text.replace(",", " ").split() if n]
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise SystemExit(f"--models: unknown or empty {bad or text!r}; valid: {','.join(valid)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SystemExit(f"--models names {','.join(repeated)} more than once; list each once")
    return names


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``["loss_impl=chunked", "loss_chunk_size=4096"]`` -> dict (values parsed as JSON if
    they can be, else kept as strings)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--fot-override {item!r}: expected KEY=VALUE, e.g. loss_impl=chunked")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def resolve_device(name: str, *, cpu_refused: str | None = None) -> torch.device:
    """``auto`` -> CUDA if available, else CPU (or, with ``cpu_refused``, stop with that
    message: a GPU-sized default run would take hours on a CPU; ``--device cpu`` still runs)."""
    if name not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"--device {name!r} is not one of auto, cpu, cuda")
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA device is visible; use --device cpu")
    if name == "auto":
        if not torch.cuda.is_available() and cpu_refused:
            raise SystemExit(cpu_refused)
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def no_gpu_message(script: str, work: str, toy: str) -> str:
    """Why ``--device auto`` stops on a machine without CUDA, and the ``--device cpu`` run."""
    return (
        f"benchmarks/{script} measures {work} on a CUDA GPU, and torch sees none "
        "(torch.cuda.is_available() is False): run it on a machine with an NVIDIA GPU, or pass "
        f"--device cpu to run it on the CPU anyway (its toy mode: {toy})"
    )


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (its ``--help`` lists the options)."""
    from fot import presets

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--models",
        default=None,
        help=f"comma-separated names (default: {','.join(ALL_MODELS)}; on CPU without Triton's "
        "interpreter, all but fla_fot)",
    )
    p.add_argument("--size", default="760m", choices=presets.SIZES)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument(
        "--lr",
        type=float,
        default=0.0,
        help="AdamW learning rate (default 0: same work, parameters frozen, no drift)",
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (default): CUDA, stopping where there is none; cpu: run on the CPU (toy sizes)",
    )
    p.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
        help="auto: bf16 autocast with fp32 weights on CUDA (as the trainer), fp32 on CPU; "
        "bf16: bf16 weights and optimizer states (no fp32 master)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--act-ckpt", action="store_true", help="activation checkpointing per block")
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="as the trainer's parallel.cuda_graphs=true: after two eager warm-up steps, "
        "capture one step as a CUDA graph and time its replays (CUDA only, --warmup >= 3)",
    )
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak dense TFLOP/s of the run's matmul precision, for MFU (default by device "
        "name, bf16 only: H100/H200 989; none for --precision fp32)",
    )
    p.add_argument("--fot-backend", default="auto", choices=("auto", "triton", "reference", "sdpa"))
    p.add_argument(
        "--fgate-bias-init",
        type=float,
        default=None,
        metavar="B",
        help="fill the forget-gate bias of our FoT models with B after init (default: the "
        "model's init 0: f~0.5, nearly all tiles pruned; 5: f~0.993, next to no pruning at 16k)",
    )
    p.add_argument(
        "--fot-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="FoTConfig field of our models, repeatable (e.g. loss_impl=chunked)",
    )
    p.add_argument("--hf-llama-heads", type=int, default=None, help="default: as FoT (hd 64)")
    p.add_argument("--fla-fused-linear-ce", action="store_true")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, profile N more steps: kernel time per step by category",
    )
    p.add_argument("--out", default=None, help="JSON file, new (rewritten after every model)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns ``{"meta": ..., "results": [row, ...]}``.

    Row keys: ``model``, ``status`` (``ok``, ``OOM``, ``error``, ``non-finite loss``), ``error``,
    ``params``, ``params_non_embedding``, ``flops_per_token``, ``flops_breakdown``,
    ``tokens_per_step``, ``step_time_ms_{mean,median,min}``, ``tokens_per_s``, ``mfu``,
    ``achieved_tflops``, ``peak_mem_gib`` (CUDA only, else None), ``mem_before_gib`` (allocated before the model was
    built: > 0 means an earlier model leaked), ``step_times_ms``, ``warmup_s``, ``loss_first``,
    ``loss_last``, ``attn_impl``, ``loss_impl``, ``vs_hf_llama``, ``vs_fla_fot``,
    ``mem_vs_hf_llama``, and the run settings (``batch_size``, ``seq_len``, ``size``,
    ``precision``, ``compile``, ``act_ckpt``, ``cuda_graphs``).
    """
    args = build_parser().parse_args(argv)
    work = f"training at --size {args.size}, --seq-len {args.seq_len}"
    toy = "--device cpu --size tiny --seq-len 128 --steps 2"
    device = resolve_device(
        args.device, cpu_refused=no_gpu_message("train_throughput.py", work, toy)
    )
    # FLA's and our Triton kernels cannot read CPU tensors unless Triton's interpreter is on
    kernels_run = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if args.models is None:
        models = [m for m in ALL_MODELS if kernels_run or m != "fla_fot"]
        if not kernels_run:
            log(f"# {device}: fla_fot left out (FLA's Triton kernels need a CUDA GPU)")
    else:
        models = parse_models(args.models, ALL_MODELS)
    if not kernels_run and "fla_fot" in models:
        raise SystemExit(
            f"--models fla_fot runs FLA's Triton kernels, which need a CUDA GPU, and the device "
            f"is {device}: drop fla_fot from --models, or run on a GPU"
        )
    if not kernels_run and args.fot_backend == "triton":
        raise SystemExit(
            f"--fot-backend triton runs fot's Triton kernels, which need a CUDA GPU, and the "
            f"device is {device}: on CPU use --fot-backend auto or reference (the PyTorch "
            "reference attention), or run on a GPU"
        )
    for flag in ("seq_len", "batch_size", "steps"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise SystemExit(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.peak_tflops is not None and not (
        math.isfinite(args.peak_tflops) and args.peak_tflops > 0
    ):
        raise SystemExit(f"--peak-tflops must be a number > 0, got {args.peak_tflops}")
    if args.hf_llama_heads is not None and args.hf_llama_heads < 1:
        raise SystemExit(f"--hf-llama-heads must be >= 1, got {args.hf_llama_heads}")
    if args.profile < 0:
        raise SystemExit(f"--profile must be >= 0 (steps to profile), got {args.profile}")
    overrides = parse_overrides(args.fot_override)
    check_out_file(args.out)
    if args.cuda_graphs:
        if device.type != "cuda":
            raise SystemExit(f"--cuda-graphs needs a CUDA device, got {device}")
        if args.compile:
            raise SystemExit("--cuda-graphs and --compile do not go together (drop one)")
        if args.warmup < 3:
            raise SystemExit(
                f"--cuda-graphs needs --warmup >= 3 (two eager steps, then the capture), "
                f"got {args.warmup}"
            )
    if device.type == "cuda":
        # Many models in one process: expandable segments keep fragmentation from turning into
        # OOMs for the later ones (read at the first CUDA allocation; the user's setting wins).
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    precision = resolve_precision(args.precision, device)
    no_peak = "# no peak FLOP/s known for this device: MFU not computed (pass --peak-tflops)"
    if args.peak_tflops is not None:
        peak = args.peak_tflops * 1e12
    else:
        from fot.training.metrics import peak_flops_per_device

        peak = peak_flops_per_device(device)
        if peak and precision == "fp32":  # the table holds bf16 peaks only
            no_peak = (
                f"# MFU not computed: {peak / 1e12:g} TFLOP/s is this device's bf16 peak, and "
                "--precision fp32 runs fp32 matmuls; pass --peak-tflops with its fp32 (or, "
                "with TF32 on, TF32) peak"
            )
            peak = None
    s = Settings(
        size=args.size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        steps=args.steps,
        warmup=args.warmup,
        device=device,
        precision=precision,
        compile=args.compile,
        act_ckpt=args.act_ckpt,
        peak_flops=peak,
        fot_backend=args.fot_backend,
        fot_overrides=overrides,
        hf_llama_heads=args.hf_llama_heads,
        fla_fused_linear_ce=args.fla_fused_linear_ce,
        fgate_bias_init=args.fgate_bias_init,
        profile_steps=args.profile,
        lr=args.lr,
        cuda_graphs=args.cuda_graphs,
    )
    meta = run_meta(device, args)
    meta.update(
        precision=s.precision,
        peak_tflops=peak / 1e12 if peak else None,
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
    )
    log(f"# train throughput: {json.dumps(meta, default=str)}")
    if peak is None:
        log(no_peak)
    payload: dict[str, Any] = {"meta": meta, "results": []}
    for name in models:
        log(f"## {name}: size {s.size}, B={s.batch_size}, T={s.seq_len}, {s.precision} ...")
        try:
            row = run_one(name, s)
        except KeyboardInterrupt:
            log(interrupted_note(name, len(payload["results"]), args.out))
            log(markdown_table(payload["results"]))
            raise SystemExit(130) from None
        row.update(
            batch_size=s.batch_size,
            seq_len=s.seq_len,
            size=s.size,
            precision=s.precision,
            compile=s.compile,
            act_ckpt=s.act_ckpt,
            cuda_graphs=s.cuda_graphs,
            fgate_bias_init=s.fgate_bias_init,
        )
        payload["results"].append(row)
        add_ratios(payload["results"])
        log("RESULT " + json.dumps(row, default=str))
        if args.out:
            write_json(args.out, payload)
    log("")
    log(f"Device: {meta['device_name']}; command: {meta['command']}")
    log(markdown_table(payload["results"]))
    if any("profile" in r for r in payload["results"]):
        log("")
        log(profile_table(payload["results"]))
    return payload


if __name__ == "__main__":
    main()
