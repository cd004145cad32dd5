"""Forget-gate visualisation: gate matrix F and attention maps of chosen heads (paper Fig. 3/21).

For layer l and head h with forget gates f_t (per token), ``F_ij = prod_{j < t <= i} f_t =
exp(c_i - c_j)`` for ``j <= i`` (0 above the diagonal), ``c`` the cumulative sum of log f. The
attention map is ``A_ij = softmax_j(q_i . k_j * scale + c_i - c_j)`` over the keys the layer
attends to (``i - window_size < j <= i`` with a sliding window).

How the values are obtained: during one forward pass the attention function that every
``FoTAttention`` layer calls (looked up through ``fot.models.modeling_fot.get_attention_functions``)
is wrapped, and the wrapper records the layer's final q, k (after KV-shift, QK-norm, RoPE) and
log f exactly as the layer passes them; nothing is recomputed from weights. Only FoT models
(``model_type == "fot"``) have these layers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fot.training.checkpoint import write_text_atomic, written_whole

from . import program_name
from .common import (
    CHECKPOINT_HELP,
    DEVICE_HELP,
    DTYPE_HELP,
    add_label_argument,
    check_out_shared,
    encode_text,
    eot_id,
    load_checkpoint,
    pick_device,
    plot_label,
    positive_int,
    read_text_file,
    save_figure,
    use_agg_backend,
    write_run_config,
)


def require_fot(model: torch.nn.Module) -> int:
    """The number of FoT attention layers of ``model``.

    Raises:
        ValueError: the model has none (not a FoT checkpoint).
    """
    from fot.models import modeling_fot

    n = sum(isinstance(m, modeling_fot.FoTAttention) for m in model.modules())
    if not n:
        raise ValueError(
            f"{type(model).__name__} has no FoTAttention layers: the gates command needs a FoT "
            "checkpoint (model_type 'fot')"
        )
    return n


def chosen_maps(
    layers: Sequence[int], heads: Sequence[int], n_layers: int, n_heads: int
) -> list[tuple[int, int]]:
    """The (layer, query head) pairs to draw, negative indices resolved.

    Raises:
        ValueError: a layer or head out of range (the message names the valid range).
    """
    bad_layers = [li for li in layers if not -n_layers <= li < n_layers]
    bad_heads = [h for h in heads if not -n_heads <= h < n_heads]
    if bad_layers or bad_heads:
        # only the options that hold a bad value, as typed (`--heads []` read as "no heads")
        named = [
            f"--{option} {','.join(map(str, bad))}"
            for option, bad in (("layers", bad_layers), ("heads", bad_heads))
            if bad
        ]
        raise ValueError(
            f"{' and '.join(named)} out of range: this model has "
            f"{n_layers} layers (-{n_layers}..{n_layers - 1}) and {n_heads} query heads "
            f"(-{n_heads}..{n_heads - 1})"
        )
    return [(li % n_layers, h % n_heads) for li in layers for h in heads]


@contextlib.contextmanager
def capture_attention_inputs(model: torch.nn.Module) -> Iterator[list[dict[str, torch.Tensor]]]:
    """Record ``q, k, log_fgate, scale`` of every attention call, in layer order.

    Layers without a forget gate (Transformer baselines) would run PyTorch SDPA instead of the
    attention function where SDPA is chosen (``attn_backend`` ``sdpa``, or ``auto`` on CUDA);
    while recording they run the attention function too, so that every layer is recorded.

    Yields:
        A list that fills with one dict per attention call: ``q`` ``[B, T, HQ, D]``, ``k``
        ``[B, T, H, D]``, ``log_fgate`` ``[B, T, HQ]`` float32, ``scale`` and ``window_size``.
    """
    from fot.models import modeling_fot

    require_fot(model)
    records: list[dict[str, Any]] = []
    original = modeling_fot.get_attention_functions
    original_use_sdpa = modeling_fot.FoTAttention._use_sdpa

    def patched(backend: str, device: torch.device):
        attn, decode = original(backend, device)

        def recording_attn(q, k, v, log_fgate, *, scale=None, **kwargs):
            records.append(
                {
                    "q": q.detach().float().cpu(),
                    "k": k.detach().float().cpu(),
                    "log_fgate": log_fgate.detach().float().cpu(),
                    "scale": scale if scale is not None else q.shape[-1] ** -0.5,
                    "window_size": kwargs.get("window_size"),
                }
            )
            return attn(q, k, v, log_fgate, scale=scale, **kwargs)

        return recording_attn, decode

    def never_sdpa(self: Any, *args: Any, **kwargs: Any) -> bool:
        return False

    modeling_fot.get_attention_functions = patched
    modeling_fot.FoTAttention._use_sdpa = never_sdpa
    try:
        yield records
    finally:
        modeling_fot.get_attention_functions = original
        modeling_fot.FoTAttention._use_sdpa = original_use_sdpa


def gate_matrix(log_fgate: torch.Tensor) -> torch.Tensor:
    """``F`` ``[T, T]`` float64 from one head's log gates ``[T]``: ``exp(c_i - c_j)``, j <= i."""
    c = torch.cumsum(log_fgate.double(), 0)
    diff = c[:, None] - c[None, :]
    causal = torch.ones_like(diff, dtype=torch.bool).tril()
    return torch.where(causal, diff.clamp(max=0).exp(), torch.zeros_like(diff))


def attention_map(
    q: torch.Tensor,
    k: torch.Tensor,
    log_fgate: torch.Tensor,
    scale: float,
    window_size: int | None = None,
) -> torch.Tensor:
    """Attention probabilities ``[T, T]`` of one head: q ``[T, D]``, k ``[T, D]``, log f ``[T]``.

    With ``window_size`` only keys ``i - window_size < j <= i`` are attended to.
    """
    c = torch.cumsum(log_fgate.double(), 0)
    s = (q.double() @ k.double().T) * scale + c[:, None] - c[None, :]
    keep = torch.ones_like(s, dtype=torch.bool).tril()
    if window_size is not None:
        keep = keep.triu(-(window_size - 1))
    s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1)


@torch.no_grad()
def gate_data(
    model: torch.nn.Module, input_ids: torch.Tensor, layers: Sequence[int], heads: Sequence[int]
) -> dict[str, Any]:
    """Gates of every layer/head and F/attention maps of the chosen ones for one text.

    Args:
        input_ids: ``[1, T]`` int64 on the model's device.
        layers, heads: which layers and query heads to keep maps for (negative = from the end).

    Returns:
        ``{"log_fgate": [L, T, HQ] float32, "F": {(l, h): [T, T]}, "attention": {(l, h): [T, T]}}``.
    """
    with capture_attention_inputs(model) as rec:
        model(input_ids=input_ids)
    F_maps, A_maps = {}, {}
    for li, h in chosen_maps(layers, heads, len(rec), rec[0]["log_fgate"].shape[-1]):
        r = rec[li]
        n_rep = r["q"].shape[2] // r["k"].shape[2]
        q, k, lf = r["q"][0, :, h], r["k"][0, :, h // n_rep], r["log_fgate"][0, :, h]
        F_maps[(li, h)] = gate_matrix(lf).float()
        A_maps[(li, h)] = attention_map(q, k, lf, r["scale"], r["window_size"]).float()
    return {
        "log_fgate": torch.stack([r["log_fgate"][0] for r in rec]),
        "F": F_maps,
        "attention": A_maps,
    }


def plot_gates(
    data: dict[str, Any], tokens: Sequence[str], out_file: Path, *, title: str = ""
) -> Path:
    """One row per chosen (layer, head): gate matrix F and attention map side by side."""
    use_agg_backend(out_file)
    import matplotlib.pyplot as plt

    keys = list(data["F"])
    fig, axes = plt.subplots(len(keys), 2, figsize=(9, 4.2 * len(keys)), squeeze=False)
    T = len(tokens)
    for row, key in enumerate(keys):
        for col, (name, mat, cmap) in enumerate(
            (
                ("forget gate matrix F", data["F"][key], "viridis"),
                ("attention", data["attention"][key], "magma"),
            )
        ):
            ax = axes[row, col]
            im = ax.imshow(
                mat.numpy(),
                cmap=cmap,
                vmin=0,
                vmax=1 if col == 0 else None,
                interpolation="nearest",
            )
            ax.set_title(f"layer {key[0]} head {key[1]}: {name}", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
            if T <= 48:
                ax.set_xticks(range(T), tokens, rotation=90, fontsize=6)
                ax.set_yticks(range(T), tokens, fontsize=6)
            else:
                ax.set_xlabel("key position j")
                ax.set_ylabel("query position i")
    if title:
        fig.suptitle(title)
    return save_figure(fig, out_file, dpi=130, format="png")


def plot_gate_values(log_fgate: torch.Tensor, out_file: Path) -> Path:
    """Forget-gate values f_t of every head, one panel per layer (mean over time in legend)."""
    use_agg_backend(out_file)
    import matplotlib.pyplot as plt

    L = log_fgate.shape[0]
    cols = min(4, L)
    rows = math.ceil(L / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.4 * rows), squeeze=False)
    f = log_fgate.exp().numpy()
    for i in range(rows * cols):
        ax = axes[i // cols, i % cols]
        if i >= L:
            ax.axis("off")
            continue
        ax.plot(f[i], lw=0.8)
        ax.set_ylim(0, 1.02)
        ax.set_title(f"layer {i}", fontsize=9)
        ax.set_xlabel("position", fontsize=8)
    return save_figure(fig, out_file, dpi=120, format="png")


# What a gates run writes besides run_config.json; a rerun replaces all of them.
_OUTPUTS = ("gates.npz", "gates.png", "gate_values.png", "summary.json")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``gates`` command's options."""
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument(
        "--text",
        default=None,
        help="text to analyse (default: the start of the offline sample corpus)",
    )
    p.add_argument(
        "--text-file",
        default=None,
        help="read the text from this file instead (default: use --text)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        help="truncate the text to this many tokens, the leading BOS included "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--layers",
        default="0,-1",
        help="layers to show, negative from the end (default: %(default)s)",
    )
    p.add_argument("--heads", default="0", help="query heads to show (default: %(default)s)")
    p.add_argument("--out", required=True, help="results folder (overwritten, no resume)")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--dtype", default="float32", help=DTYPE_HELP)
    add_label_argument(p, "the plot's title")


def _int_list(text: str, option: str) -> list[int]:
    parts = text.split(",")
    if len(parts) > 1 and any(not x.strip() for x in parts):
        raise ValueError(f"{option} {text!r} has an empty item; separate indices by single commas")
    try:
        values = [int(x) for x in parts if x.strip()]
    except ValueError:
        raise ValueError(
            f"{option} {text!r}: expected comma-separated integers like '0,-1'"
        ) from None
    if not values:
        raise ValueError(f"{option} must list at least one index")
    return values


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``gates``; returns the summary (tokens, mean gate per layer and head, maps)."""
    out = Path(args.out)
    check_out_shared(out, "gates")
    if args.text is not None and args.text_file is not None:
        raise ValueError("give --text or --text-file, not both")
    layers, heads = _int_list(args.layers, "--layers"), _int_list(args.heads, "--heads")
    if args.text_file is not None:
        path = Path(args.text_file)
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"--text-file {str(path)!r} {what}; pass a text file")
        text = read_text_file(path, "--text-file")
        if not text.strip():
            raise ValueError(f"--text-file {str(path)!r} holds no text; pass a file with text")
    elif args.text is not None:
        if not args.text.strip():
            raise ValueError(
                f"--text {args.text!r} holds no text; pass some text, or leave --text out to "
                "analyse the sample corpus"
            )
        text = args.text
    else:
        from fot.data.sample import sample_texts

        text = sample_texts()[0][:20_000]
    model, tokenizer = load_checkpoint(
        args.checkpoint, device=pick_device(args.device), dtype=args.dtype
    )
    chosen_maps(layers, heads, require_fot(model), model.config.num_attention_heads)
    if model.config.fgate_type == "none":
        print(
            f"{program_name()} gates: warning: {args.checkpoint} has no forget gate (fgate_type "
            "'none': a Transformer baseline); its gates all read 1: gates.png shows its "
            "attention maps, gate_values.png is flat",
            file=sys.stderr,
        )
    write_run_config(out, "gates", vars(args), args.checkpoint)
    ids = [eot_id(tokenizer), *encode_text(tokenizer, text)]
    ids = ids[: args.max_tokens]
    x = torch.tensor([ids], device=next(model.parameters()).device)
    data = gate_data(model, x, layers, heads)
    tokens = [tokenizer.decode([t]) for t in ids]
    # The previous run's results go before the first of this run's is written: a run stopped
    # (Ctrl-C, SIGTERM, an error) while writing leaves only files of its own, never some of
    # each run (its summary.json beside another text's or checkpoint's gates.npz).
    for name in _OUTPUTS:
        (out / name).unlink(missing_ok=True)
    with written_whole(out / "gates.npz") as tmp, tmp.open("wb") as f:
        np.savez(
            f,
            tokens=np.asarray(ids),
            log_fgate=data["log_fgate"].numpy(),
            **{f"F_l{li}_h{h}": m.numpy() for (li, h), m in data["F"].items()},
            **{f"attn_l{li}_h{h}": m.numpy() for (li, h), m in data["attention"].items()},
        )
    summary = {
        "tokens": len(ids),
        "mean_gate_per_layer_head": data["log_fgate"].exp().mean(1).tolist(),
        "maps": [f"layer {li} head {h}" for li, h in data["F"]],
    }
    # the results before the plots, which need matplotlib (a missing one says they are saved)
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    plot_gates(data, tokens, out / "gates.png", title=plot_label(args))
    plot_gate_values(data["log_fgate"], out / "gate_values.png")
    print(json.dumps({"tokens": len(ids), "maps": summary["maps"]}))
    return summary
