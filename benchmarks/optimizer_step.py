"""Optimizer step time: `optim=adamw` against `optim=muon`, and fot's Muon against torch's.

For each optimizer (``--optims``): the model of ``--model``/``--size`` in float32 (the trainer's
master weights) on one device, built as ``train.py`` builds its optimizer
(:func:`fot.training.optim.build_optimizer`), random gradients drawn before each step (the same
ones for every optimizer), and ``--steps`` calls of ``optimizer.step()`` after ``--warmup``,
each timed alone between device synchronisations. Reported: the median step time, the
optimizers' state size, the Newton–Schulz FLOPs per step by hand count (5 iterations × (4m²n +
2m³) per m × n matrix, m ≤ n) and the rate they ran at.

* ``adamw``: AdamW over every parameter (fused on CUDA).
* ``muon``: fot's Muon over the projection matrices, AdamW over the rest (``optim=muon``).
* ``torch_muon``: the same with ``torch.optim.Muon`` (torch >= 2.9) in fot's Muon's place. Its
  weights after the last step are compared with ``muon``'s, bit for bit (``same_as_muon``).

    python benchmarks/optimizer_step.py --out results/optimizer_step.json     # 760m, one GPU
    python benchmarks/optimizer_step.py --device cpu --size tiny --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # sibling modules when imported from elsewhere
    sys.path.insert(0, str(_HERE))

from train_throughput import (  # noqa: E402
    check_out_file,
    interrupted_note,
    log,
    no_gpu_message,
    resolve_device,
    run_meta,
    write_json,
)

from fot import presets  # noqa: E402
from fot.training.config import OptimConfig  # noqa: E402
from fot.training.optim import MuonAdamW, build_optimizer, muon_parameter_names  # noqa: E402

OPTIMIZERS = ("adamw", "muon", "torch_muon")


def newton_schulz_flops(shapes: list[tuple[int, int]], steps: int = 5) -> int:
    """FLOPs of one orthogonalisation of each ``(rows, cols)`` matrix: per iteration on the
    wide orientation (m ≤ n), X Xᵀ (2m²n), the quintic's A·A (2m³) and its product with X
    (2m²n)."""
    total = 0
    for rows, cols in shapes:
        m, n = min(rows, cols), max(rows, cols)
        total += steps * (4 * m * m * n + 2 * m**3)
    return total


def _optimizer(name: str, model: torch.nn.Module, device: torch.device) -> Any:
    muon = name != "adamw"
    cfg = OptimConfig(
        name="muon" if muon else "adamw",
        momentum=0.95 if muon else None,
        ns_steps=5 if muon else None,
        adjust_lr="match_rms_adamw" if muon else None,
    )
    opt = build_optimizer(model, cfg, device=device)
    if name == "torch_muon":
        ours, adamw = opt.optimizers
        (group,) = ours.param_groups
        theirs = torch.optim.Muon(
            group["params"],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            ns_steps=group["ns_steps"],
            adjust_lr_fn=group["adjust_lr_fn"],
        )
        opt = MuonAdamW(theirs, adamw)
    return opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(opt: Any) -> int:
    optimizers = opt.optimizers if isinstance(opt, MuonAdamW) else (opt,)
    return sum(
        t.numel() * t.element_size()
        for o in optimizers
        for state in o.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )


def measure(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One optimizer's row; its model's final weights go into ``row["_weights"]`` (CPU)."""
    torch.manual_seed(0)
    model = presets.build_model(presets.config(args.model, args.size)).to(device)
    opt = _optimizer(name, model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    muon_names = muon_parameter_names(model) if name != "adamw" else set()
    shapes = [tuple(p.shape) for n, p in model.named_parameters() if n in muon_names]
    times = []
    for step in range(args.warmup + args.steps):
        gen = torch.Generator(device).manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, device=device).mul_(1e-3)
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    flops = newton_schulz_flops(shapes)
    row = {
        "optimizer": name,
        "step_ms": step_s * 1e3,
        "step_ms_all": [t * 1e3 for t in times],
        "state_gib": _state_bytes(opt) / 2**30,
        "muon_matrices": len(shapes),
        "newton_schulz_gflop": flops / 1e9,
        "newton_schulz_tflops_per_s": flops / step_s / 1e12 if flops else None,
        "_weights": [p.detach().cpu() for p in params],
    }
    del model, opt, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    """The result rows as a markdown table."""
    lines = [
        "| optimizer | step (ms, median) | state (GiB) | Muon matrices | NS GFLOP/step | "
        "NS TFLOP/s | same as muon |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = r["newton_schulz_tflops_per_s"]
        same = r.get("same_as_muon")
        lines.append(
            f"| {r['optimizer']} | {r['step_ms']:.1f} | {r['state_gib']:.2f} | "
            f"{r['muon_matrices']} | {r['newton_schulz_gflop']:,.1f} | "
            f"{'—' if rate is None else f'{rate:.3g}'} | {'—' if same is None else same} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (``argv`` None: ``sys.argv``)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="fot_pro", help="configs/model name (default fot_pro)")
    p.add_argument("--size", default="760m", help="configs/size name (default 760m)")
    p.add_argument(
        "--optims",
        default=",".join(OPTIMIZERS),
        help=f"comma-separated subset of {','.join(OPTIMIZERS)} (default: all)",
    )
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--device", default="auto", help="auto (default: CUDA), cuda or cpu")
    p.add_argument("--out", default=None, help="JSON file for the results (a new path)")
    args = p.parse_args(argv)
    args.optims = [o for o in args.optims.split(",") if o]
    bad = [o for o in args.optims if o not in OPTIMIZERS]
    if bad or not args.optims or len(set(args.optims)) < len(args.optims):
        p.error(f"--optims {bad or args.optims}: choose each of {','.join(OPTIMIZERS)} once")
    if "torch_muon" in args.optims and not hasattr(torch.optim, "Muon"):
        p.error(
            f"--optims torch_muon needs torch.optim.Muon (torch >= 2.9), not {torch.__version__}"
        )
    if args.steps < 1 or args.warmup < 0:
        p.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if args.model not in presets.MODELS or args.size not in presets.SIZES:
        p.error(
            f"--model {args.model!r} / --size {args.size!r}: choose from "
            f"{', '.join(presets.MODELS)} / {', '.join(presets.SIZES)}"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON it writes (device, settings, rows)."""
    args = parse_args(argv)
    check_out_file(args.out)
    device = resolve_device(
        args.device,
        cpu_refused=no_gpu_message(
            "optimizer_step.py", "optimizer steps", "--size tiny --steps 2 --warmup 1"
        ),
    )
    rows = []
    try:
        for name in args.optims:
            log(f"[{name}] {args.model} {args.size} on {device}")
            rows.append(measure(name, args, device))
    except KeyboardInterrupt:
        log(interrupted_note("the optimizer steps", len(rows), args.out))
    if not rows:
        raise SystemExit(130)
    weights = {r["optimizer"]: r.pop("_weights") for r in rows}
    if "muon" in weights and "torch_muon" in weights:
        pairs = zip(weights["muon"], weights["torch_muon"], strict=True)
        next(r for r in rows if r["optimizer"] == "torch_muon")["same_as_muon"] = all(
            torch.equal(a, b) for a, b in pairs
        )
    payload = {"meta": run_meta(device, args), "results": rows}
    if args.out:
        write_json(args.out, payload)
    print(markdown(rows))
    return payload


if __name__ == "__main__":
    main()
