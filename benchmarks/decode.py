"""Decode speed at a long context: FoT (Pro) with its cache vs HF Llama (SDPA, with cache).

For each model and batch size: prefill a random prompt of ``--context`` tokens in one forward
(``use_cache=True``, logits of the last position only), then ``--new-tokens`` greedy decode
steps, one token per sequence per forward, feeding the cache back. Reported: prefill time,
decode tokens/s (``batch * new_tokens / decode time``), time per decode step and peak memory.
A warm-up pass with the same shapes (prefill + 2 steps) runs first so that Triton compilation
and autotuning are not timed.

* ``fot_pro`` (or any of our models): :class:`fot.models.cache.FoTCache` and the decode path of
  ``attn_backend`` (``triton`` on CUDA: ``fot.kernels.forgetting_attention_decode``;
  ``reference`` on CPU), in two cache modes (``--fot-cache``): ``graphs``, what ``generate()``
  uses on CUDA (a fixed-capacity cache whose one-token steps are captured as CUDA graphs and
  replayed; the capture of each bucket of 1024 positions is part of the timed decode), and
  ``eager`` (a growing cache, every step launched op by op from Python). On CPU ``graphs`` runs
  the same fixed-capacity steps eagerly, and its rows say ``fixed``.
* ``hf_llama``: ``LlamaForCausalLM`` (SDPA) of the same size, HF's default ``DynamicCache``.

Weights are bf16 on CUDA (inference), fp32 on CPU. On CPU our models decode with the PyTorch
reference attention (``--fot-backend auto`` or ``reference``); ``--fot-backend triton`` needs a
CUDA GPU (or Triton's interpreter, ``TRITON_INTERPRET=1``, whose times mean nothing).

    python benchmarks/decode.py --out results/decode_760m.json          # 760m, 16k, B=1 and 8
    python benchmarks/decode.py --device cpu --size tiny --context 128 --new-tokens 4
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fot.models.modeling_fot import CACHE_FIELD

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # sibling modules when imported from elsewhere
    sys.path.insert(0, str(_HERE))

from train_throughput import (  # noqa: E402
    OUR_MODELS,
    build,
    check_out_file,
    fmt,
    interrupted_note,
    log,
    no_gpu_message,
    parse_models,
    resolve_device,
    run_meta,
    status_cell,
    write_json,
)

DECODE_MODELS = (*OUR_MODELS, "hf_llama")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_decode(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int, cache: Any = None
) -> dict[str, Any]:
    """Prefill ``prompt`` with a cache, then ``new_tokens`` greedy one-token steps.

    Args:
        model: a causal LM whose forward takes ``input_ids``, the cache (``past_key_values``,
            or ``cache`` from transformers 5.24 on: :data:`~fot.models.modeling_fot.CACHE_FIELD`),
            ``use_cache`` and ``logits_to_keep`` and returns ``logits`` and the cache.
        prompt: ``[B, T]`` int64 on the model's device.
        new_tokens: decode steps (forwards of one token per sequence) after the prefill.
        cache: an empty cache to fill (e.g. a fixed-capacity ``FoTCache``); None = the model's
            default.

    Returns:
        ``tokens`` ``[B, new_tokens + 1]`` int64 (the prefill's prediction, then one per step),
        ``prefill_s`` and ``decode_s`` wall times (device synchronised), and ``first_step_s``,
        the first step's share of ``decode_s`` (with CUDA graphs it runs eagerly and captures
        the graph of its bucket; the steps after it replay).
    """
    device = prompt.device
    _sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{CACHE_FIELD: cache})
    cache = getattr(out, CACHE_FIELD)
    nxt = out.logits[:, -1].argmax(-1)  # (B,)
    _sync(device)
    t1 = time.perf_counter()
    tokens = [nxt]
    t_first = t1
    for i in range(new_tokens):
        out = model(input_ids=nxt[:, None], use_cache=True, **{CACHE_FIELD: cache})
        cache = getattr(out, CACHE_FIELD)
        nxt = out.logits[:, -1].argmax(-1)  # (B,)
        tokens.append(nxt)
        if i == 0:
            _sync(device)
            t_first = time.perf_counter()
    _sync(device)
    t2 = time.perf_counter()
    return {
        "tokens": torch.stack(tokens, dim=1),
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "first_step_s": t_first - t1,
    }


def measure(
    model: nn.Module,
    name: str,
    *,
    batch_size: int,
    context: int,
    new_tokens: int,
    vocab_size: int,
    device: torch.device,
    fot_cache: str | None = None,
) -> dict[str, Any]:
    """One (model, batch size) measurement: warm-up pass, then the timed pass.

    ``fot_cache`` (our models): ``"graphs"`` = a fixed-capacity :class:`FoTCache` with CUDA
    graphs, ``"eager"`` = the growing cache; None for other models.
    """
    from fot.models import FoTCache

    def new_cache() -> Any:
        if fot_cache != "graphs":
            return None
        layers = model.config.num_hidden_layers
        return FoTCache(layers, capacity=context + new_tokens + 1, cuda_graphs=True)

    gen = torch.Generator(device="cpu").manual_seed(batch_size)
    prompt = torch.randint(0, vocab_size, (batch_size, context), generator=gen).to(device)
    greedy_decode(model, prompt, min(2, new_tokens), new_cache())  # compile / autotune
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    res = greedy_decode(model, prompt, new_tokens, new_cache())
    decode_s = res["decode_s"]
    return {
        "model": name,
        "cache": fot_cache or "default",
        "status": "ok",
        "batch_size": batch_size,
        "context": context,
        "new_tokens": new_tokens,
        "prefill_s": res["prefill_s"],
        "prefill_tokens_per_s": batch_size * context / res["prefill_s"],
        "decode_s": decode_s,
        "decode_tokens_per_s": batch_size * new_tokens / decode_s if decode_s > 0 else None,
        "ms_per_step": 1e3 * decode_s / new_tokens,
        "first_step_s": res["first_step_s"],
        "ms_per_later_step": (
            1e3 * (decode_s - res["first_step_s"]) / (new_tokens - 1) if new_tokens > 1 else None
        ),
        "peak_mem_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        ),
        "first_tokens": res["tokens"][0, :8].tolist(),
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``vs_hf_llama``: decode tokens/s over HF Llama's at the same batch size (in place)."""
    ref = {
        r["batch_size"]: r["decode_tokens_per_s"]
        for r in rows
        if r["model"] == "hf_llama" and r["status"] == "ok" and r.get("decode_tokens_per_s")
    }
    for r in rows:
        good = r["status"] == "ok" and r.get("decode_tokens_per_s") and r["batch_size"] in ref
        r["vs_hf_llama"] = r["decode_tokens_per_s"] / ref[r["batch_size"]] if good else None


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The decode results as a markdown table (one row per model and batch size)."""
    lines = [
        "| model | cache | batch | context | status | prefill (s) | decode tokens/s | ms/step | "
        "ms/step after the first | peak mem (GiB) | vs HF Llama |",
        "|" + "---|" * 11,
    ]
    for r in rows:
        ratio = r.get("vs_hf_llama")
        lines.append(
            "| "
            + " | ".join(
                [
                    r["model"],
                    r.get("cache", "—"),
                    str(r["batch_size"]),
                    str(r["context"]),
                    status_cell(r),
                    fmt(r.get("prefill_s"), ".3f"),
                    fmt(r.get("decode_tokens_per_s"), ",.1f"),
                    fmt(r.get("ms_per_step"), ".2f"),
                    fmt(r.get("ms_per_later_step"), ".2f"),
                    fmt(r.get("peak_mem_gib"), ".1f"),
                    fmt(ratio, ".2f") + ("×" if ratio else ""),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (its ``--help`` lists the options)."""
    from fot import presets

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="fot_pro,hf_llama", help="comma-separated names")
    p.add_argument("--size", default="760m", choices=presets.SIZES)
    p.add_argument("--context", "--seq-len", dest="context", type=int, default=16384)
    p.add_argument("--new-tokens", "--steps", dest="new_tokens", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument(
        "--device",
        default="auto",
        help="auto (default): CUDA, stopping where there is none; cpu: run on the CPU (toy sizes)",
    )
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"))
    p.add_argument("--fot-backend", default="auto", choices=("auto", "triton", "reference"))
    p.add_argument(
        "--fot-cache",
        default="graphs,eager",
        help="our models' cache modes, comma-separated: graphs (fixed capacity, CUDA graphs: "
        "what generate() uses on CUDA), eager (growing cache, steps launched op by op)",
    )
    p.add_argument("--hf-llama-heads", type=int, default=None, help="default: as FoT (hd 64)")
    p.add_argument("--out", default=None, help="JSON file, new (rewritten after every measurement)")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the decode benchmark; returns ``{"meta": ..., "results": [row, ...]}``.

    Row keys: ``model``, ``cache`` (``graphs``/``eager`` for our models, ``fixed`` for
    ``graphs`` without CUDA, else ``default``),
    ``status`` (``ok``, ``OOM``, ``error``), ``error``, ``batch_size``,
    ``context``, ``new_tokens``, ``prefill_s``, ``prefill_tokens_per_s``, ``decode_s``,
    ``decode_tokens_per_s``, ``ms_per_step``, ``first_step_s`` (the first decode step: with CUDA
    graphs it also captures), ``ms_per_later_step`` (the steps after it: replayed graphs),
    ``peak_mem_gib``, ``first_tokens``, ``vs_hf_llama``.
    """
    args = build_parser().parse_args(argv)
    models = parse_models(args.models, DECODE_MODELS)
    if args.context < 1 or args.new_tokens < 1 or min(args.batch_sizes) < 1:
        raise SystemExit(
            f"--context, --new-tokens and --batch-sizes must be >= 1, got {args.context}, "
            f"{args.new_tokens}, {args.batch_sizes}"
        )
    if args.hf_llama_heads is not None and args.hf_llama_heads < 1:
        raise SystemExit(f"--hf-llama-heads must be >= 1 (or left out: as FoT), got "
                         f"{args.hf_llama_heads}")  # fmt: skip
    # each measured once: a repeat would be timed twice, and the ratios taken to either row
    args.batch_sizes = list(dict.fromkeys(args.batch_sizes))
    fot_caches = list(dict.fromkeys(c.strip() for c in args.fot_cache.split(",") if c.strip()))
    if not fot_caches or any(c not in ("graphs", "eager") for c in fot_caches):
        raise SystemExit(f"--fot-cache takes graphs and/or eager, got {args.fot_cache!r}")
    check_out_file(args.out)
    work = f"decoding at --size {args.size} after a --context {args.context} prefill"
    toy = "--device cpu --size tiny --context 128 --new-tokens 4"
    device = resolve_device(args.device, cpu_refused=no_gpu_message("decode.py", work, toy))
    if (
        device.type != "cuda"
        and args.fot_backend == "triton"
        and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        raise SystemExit(
            f"--fot-backend triton runs fot's Triton kernels, which need a CUDA GPU, and the "
            f"device is {device}: on CPU use --fot-backend auto or reference (the PyTorch "
            "reference attention), or run on a GPU"
        )
    dtype_name = (
        args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    )
    dtype = torch.bfloat16 if dtype_name == "bf16" else torch.float32
    meta = run_meta(device, args)
    meta["dtype"] = dtype_name
    log(f"# decode: {json.dumps(meta, default=str)}")
    payload: dict[str, Any] = {"meta": meta, "results": []}

    def record(row: dict[str, Any]) -> None:
        payload["results"].append(row)
        add_ratios(payload["results"])
        log("RESULT " + json.dumps(row, default=str))
        if args.out:
            write_json(args.out, payload)

    label = models[0]  # what runs when Ctrl-C comes
    try:
        for name in models:
            model, label = None, name
            try:
                torch.manual_seed(0)
                model, config, _ = build(
                    name,
                    args.size,
                    device=device,
                    seq_len=args.context + args.new_tokens,
                    fot_backend=args.fot_backend,
                    hf_llama_heads=args.hf_llama_heads,
                )
                model.to(dtype).eval()
            except Exception as err:
                traceback.print_exc(limit=-8)
                for b in args.batch_sizes:
                    record(
                        {
                            "model": name,
                            "status": "OOM" if isinstance(err, torch.OutOfMemoryError) else "error",
                            "error": f"{type(err).__name__}: {err}"[:500],
                            "batch_size": b,
                            "context": args.context,
                        }
                    )
                continue
            modes = fot_caches if name in OUR_MODELS else [None]
            for b, mode in itertools.product(args.batch_sizes, modes):
                # without CUDA the fixed-capacity cache's steps run eagerly: no graphs
                shown = "fixed" if mode == "graphs" and device.type != "cuda" else mode
                label = f"{name} ({shown} cache)" if mode else name
                log(
                    f"## {label}: size {args.size}, B={b}, context {args.context}, {dtype_name} ..."
                )
                try:
                    row = measure(
                        model,
                        name,
                        batch_size=b,
                        context=args.context,
                        new_tokens=args.new_tokens,
                        vocab_size=int(config.vocab_size),
                        device=device,
                        fot_cache=mode,
                    )
                except torch.OutOfMemoryError as err:
                    msg = str(err).strip().splitlines()[0] if str(err).strip() else ""
                    row = {"model": name, "status": "OOM", "error": msg[:300]}
                except Exception as err:
                    traceback.print_exc(limit=-8)
                    row = {
                        "model": name,
                        "status": "error",
                        "error": f"{type(err).__name__}: {err}",
                    }
                    row["error"] = row["error"][:500]
                row.update(
                    cache=shown or "default",
                    batch_size=b,
                    context=args.context,
                    dtype=dtype_name,
                    size=args.size,
                )
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                record(row)
            del model
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except KeyboardInterrupt:
        log(interrupted_note(label, len(payload["results"]), args.out))
        log(markdown_table(payload["results"]))
        raise SystemExit(130) from None
    log("")
    log(f"Device: {meta['device_name']}; command: {meta['command']}")
    log(markdown_table(payload["results"]))
    return payload


if __name__ == "__main__":
    main()
