"""Block pruning on a trained model: how many attention tiles exact pruning skips, and what it buys.

Runs a trained FoT checkpoint (an HF folder from ``train.py``) over held-out text, records each
layer's real ``q, k, log f`` (``fot.eval.gates.capture_attention_inputs``), then calls
``fot.kernels.forgetting_attention`` on them with pruning off, exact pruning (the default) and
optionally approximate pruning (``--threshold``), and reports per layer and in total:

* the fraction of (query tile, key tile) pairs skipped (``PruneStats``, forward kernel);
* forward and forward+backward kernel time (CUDA only; medians of ``triton.testing.do_bench``)
  and the speed-up over ``prune=False``;
* for approximate pruning, the largest relative error of the output against exact attention.

``v`` is random (pruning decisions depend only on ``q, k, log f``; time does not depend on the
values). The text is ``--docs`` held-out windows of ``--length`` tokens (documents shorter than
that are concatenated, as in training without document masking).

On CPU (``--device cpu``, or ``auto`` without a GPU) the Triton kernel runs in Triton's
interpreter: the script turns it on itself (``TRITON_INTERPRET=1``, set before Triton is
imported; setting it by hand works too). The interpreter is slow and uses its own 32x32 tiles,
so a CPU run gives tile counts for those tiles and no times: a smoke run for short windows.

    python benchmarks/pruning.py out/repro/runs/fot_pro/hf --data data/repro/heldout \\
        --length 8192 --out results/pruning.json
    python benchmarks/pruning.py CKPT --data DATA --device cpu --length 64 --docs 1   # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # sibling modules when imported from elsewhere
    sys.path.insert(0, str(_HERE))

# Nothing above imports Triton (``import torch`` does not): ``main`` decides on
# ``TRITON_INTERPRET`` first, then imports ``train_throughput`` and ``fot`` (which do).


def _triton_compiled_here() -> bool:
    """Whether this process already holds Triton functions made for a GPU (``@triton.jit``
    read ``TRITON_INTERPRET`` as unset when their module was imported)."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return False
    for name in ("triton.language.standard", "fot.kernels._triton_kernels"):
        mod = sys.modules.get(name)
        if mod is not None and any(isinstance(v, jit.JITFunction) for v in vars(mod).values()):
            return True
    return False


def use_triton_interpreter() -> None:
    """Run the Triton kernels on CPU tensors: turn on Triton's interpreter.

    ``@triton.jit`` reads ``TRITON_INTERPRET`` when a module of kernels (Triton's own
    ``triton.language`` included) is imported, so the variable only works if it is set before
    Triton is imported; the script does that itself (``main`` before its other imports). Where
    this process already imported Triton for a GPU (``main`` called from a program that did),
    the kernels cannot run on CPU tensors, and that is refused with the fix instead of failing
    deep inside Triton.

    Raises:
        SystemExit: Triton was already imported without the interpreter.
    """
    if _triton_compiled_here():
        raise SystemExit(
            "--device cpu runs the Triton kernels in Triton's interpreter, which must be on "
            "before Triton is imported, but this process imported Triton without it (compiled "
            "kernels, for a GPU): run `TRITON_INTERPRET=1 python benchmarks/pruning.py ... "
            "--device cpu` in a fresh process, or use --device cuda on a GPU"
        )
    if os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "CPU: the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1)", flush=True
        )
        os.environ["TRITON_INTERPRET"] = "1"


def heldout_windows(path: str | Path, length: int, docs: int) -> torch.Tensor:
    """``[docs, length]`` int64 windows cut from the concatenated documents of a token folder."""
    from fot.data.tokens import TokenDocuments

    tokens = TokenDocuments(path)
    need = length * docs
    if tokens.num_tokens < need:
        raise SystemExit(
            f"--data {path} has {tokens.num_tokens} tokens, fewer than --docs x --length = {need}; "
            "lower --docs or --length"
        )
    stream = np.asarray(tokens.tokens[:need], dtype=np.int64)
    return torch.from_numpy(stream.reshape(docs, length))


@torch.no_grad()
def capture(model: torch.nn.Module, ids: torch.Tensor) -> list[dict[str, Any]]:
    """Run ``model`` on ``ids`` ``[B, T]``; return one record per attention layer."""
    from fot.eval.gates import capture_attention_inputs

    with capture_attention_inputs(model) as records:
        model(input_ids=ids)
    return list(records)


def _bench(fn, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    import triton

    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def measure_layer(
    rec: dict[str, Any], device: torch.device, dtype: torch.dtype, threshold: float | None
) -> dict[str, Any]:
    """Tile counts and kernel times of one layer's attention with pruning off / exact / approx."""
    from fot.kernels import PruneStats, forgetting_attention

    q = rec["q"].to(device, dtype)
    k = rec["k"].to(device, dtype)
    g = rec["log_fgate"].to(device, torch.float32)
    v = torch.randn_like(k)
    scale = rec["scale"]
    modes: dict[str, dict[str, Any]] = {"off": {"prune": False}, "exact": {"prune": True}}
    if threshold is not None:
        modes["approx"] = {"prune": True, "prune_threshold": threshold}
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, g)]
    do = torch.randn_like(q)
    out: dict[str, Any] = {}
    ref = None
    for name, kw in modes.items():
        stats = PruneStats()
        with torch.no_grad():
            o = forgetting_attention(q, k, v, g, scale=scale, stats=stats, **kw)
        if ref is None:
            ref = o.float()
        row: dict[str, Any] = {
            "tiles_total": stats.tiles_total,
            "tiles_skipped": stats.tiles_skipped,
            "skipped_fraction": stats.skipped_fraction,
            "max_rel_err": float((o.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)),
        }

        def fwd(kw=kw):
            with torch.no_grad():
                forgetting_attention(q, k, v, g, scale=scale, **kw)

        def fwd_bwd(kw=kw):
            o = forgetting_attention(*leaves, scale=scale, **kw)
            torch.autograd.grad(o, leaves, do)

        row["fwd_ms"] = _bench(fwd, device)
        row["fwd_bwd_ms"] = _bench(fwd_bwd, device)
        out[name] = row
    return out


def summarize(layers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Totals over layers per mode: skipped fraction, summed times, speed-up over ``off``."""
    total: dict[str, dict[str, Any]] = {}
    for mode in layers[0]:
        rows = [layer[mode] for layer in layers]
        t = sum(r["tiles_total"] for r in rows)
        s = sum(r["tiles_skipped"] for r in rows)
        entry: dict[str, Any] = {
            "tiles_total": t,
            "tiles_skipped": s,
            "skipped_fraction": s / t if t else 0.0,
            "max_rel_err": max(r["max_rel_err"] for r in rows),
        }
        for key in ("fwd_ms", "fwd_bwd_ms"):
            times = [r[key] for r in rows]
            entry[key] = sum(times) if all(x is not None for x in times) else None
        total[mode] = entry
    for entry in total.values():
        for key in ("fwd_ms", "fwd_bwd_ms"):
            base, ms = total["off"][key], entry[key]
            entry[key.replace("_ms", "_speedup")] = base / ms if base and ms else None
    return total


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI entry point (see the module docstring)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", help="HF folder of a trained FoT model (model_type 'fot')")
    p.add_argument("--data", required=True, help="held-out token folder (fot.data.prepare)")
    p.add_argument("--length", type=int, default=8192, help="tokens per window")
    p.add_argument("--docs", type=int, default=1, help="windows (batch size)")
    p.add_argument("--threshold", type=float, default=None,
                   help="also measure approximate pruning with this log-threshold (e.g. -20)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"),
                   help="auto = cuda if available, else cpu (cpu: tile counts only, the kernels "
                   "in Triton's interpreter, which the script turns on: TRITON_INTERPRET=1)")  # fmt: skip
    p.add_argument("--out", default=None, help="JSON file for the results (a new one)")
    args = p.parse_args(argv)
    if args.length < 1 or args.docs < 1:
        p.error(f"--length and --docs must be >= 1, got {args.length} and {args.docs}")
    if args.threshold is not None and not args.threshold < 0:  # NaN too
        p.error(
            f"--threshold must be a negative log-weight (natural log, e.g. -20: also skip tiles "
            f"whose every weight is below e^-20 times the row's largest in the query tile's span "
            f"of keys), got {args.threshold}"
        )
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        use_triton_interpreter()  # before anything imports Triton
    from train_throughput import check_out_file, fmt, log, resolve_device, run_meta, write_json

    check_out_file(args.out)
    device = resolve_device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    from fot.eval.common import load_checkpoint

    try:  # a mistyped path: the loaders' messages name the fix, no traceback needed
        ids = heldout_windows(args.data, args.length, args.docs).to(device)
        model, _ = load_checkpoint(args.checkpoint, device=device, dtype=dtype)
    except FileNotFoundError as err:
        raise SystemExit(f"error: {err}") from None
    records = capture(model, ids)
    if not records:
        raise SystemExit(f"{args.checkpoint}: no attention call was recorded")
    del model
    layers = []
    for i, rec in enumerate(records):
        layers.append(measure_layer(rec, device, dtype, args.threshold))
        ex = layers[-1]["exact"]
        log(
            f"layer {i:2d}: exact pruning skips {ex['skipped_fraction']:6.1%} of tiles, "
            f"fwd+bwd {fmt(layers[-1]['off']['fwd_bwd_ms'], '.3f')} -> "
            f"{fmt(ex['fwd_bwd_ms'], '.3f')} ms"
        )
    total = summarize(layers)
    for mode, t in total.items():
        log(
            f"{mode:>6}: skipped {t['skipped_fraction']:6.1%}  fwd {fmt(t['fwd_ms'], '.2f')} ms "
            f"(x{fmt(t['fwd_speedup'], '.2f')})  fwd+bwd {fmt(t['fwd_bwd_ms'], '.2f')} ms "
            f"(x{fmt(t['fwd_bwd_speedup'], '.2f')})  max rel err {t['max_rel_err']:.1e}"
        )
    meta = run_meta(device, args)
    meta["triton_interpret"] = os.environ.get("TRITON_INTERPRET") == "1"  # CPU: 32x32 tiles
    result = {"meta": meta, "layers": layers, "total": total}
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
