"""Small-scale reproduction of the FoX paper's qualitative findings, with a generated report.

One command trains six models on identical data, token budget and schedule
(``configs/experiment/repro_small.yaml``), evaluates each, and writes ``docs/results.md``::

    python benchmarks/make_corpus.py --out data/repro --download      # once, on a CPU machine
    python benchmarks/reproduce_small.py --data data/repro --out out/repro

Models: FoT (Pro), Transformer (Pro), FoT (LLaMA), Transformer (LLaMA), Transformer (LLaMA)
without RoPE, and DeltaNet (FLA; it has varlen kernels, Mamba-2 in fla 0.6.0 does not).
Each is trained by ``python train.py experiment=repro_small model=<name> data.path=...`` in a
subprocess; then, in this process, ``fot.eval`` runs per-token loss to 4x the training length,
the easy needle grid and the forgetting curve on the exported checkpoint. The report states
the device, tokens and wall times, shows the plots and tables, and marks each of the paper's
claims reproduced / not reproduced / inconclusive by the numeric rules in :func:`judge_claims`.
Rerunning with the same ``--out`` skips finished trainings and evaluations (``--report-only``
rebuilds the report alone), so the work can be split over several calls where one command
may run only so long (e.g. ``--models fot_pro,transformer_pro``, then the next pair, then
``--report-only``); a call whose settings differ from those already in ``--out`` is refused.

Budget estimate (one H200, from docs/benchmarks.md): 125M models at T=2048 cost
6N + 12·L·d·(T+1)/2 ≈ 0.74 + 0.11 = 0.86 GFLOP/token (``python benchmarks/flops.py --size
125m --seq-len 2048``; N includes the untied LM head, 0.23 of the 0.74). The 760M runs reached
230-330 TFLOP/s; assuming a small model reaches only ~100 TFLOP/s (eager, small matrices) gives
~117k tokens/s, so 16Mi tokens take ~145 s per model, ~14.5 min for six, plus ~30 s start-up
(imports, Triton compilation, HF export) per training (~3 min). Evaluation per model:
per-token loss on 16 documents of 8192 tokens (~5 s, cf. 9.6 s for 3 x 16k at 125M), 4 x 5
easy-needle cells (~15 s; 44 cells up to 16k took 28 s) and the forgetting curve (5 lengths x
2, ~5 s): ~2.5 min for six. Total ≈ 20 min, the whole 20-minute budget; docs/results.md
measured 883 s of training (105-242 s per model) and 92 s of evaluation, start-ups not counted.
``--budget-minutes B`` scales the token budget linearly (128 steps of 128Ki tokens at B = 20).

``--toy`` runs the same pipeline on CPU in well under a minute (two tiny models, T=64, a few
steps, tiny grids); its numbers mean nothing and the report says so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

MODELS: dict[str, str] = {
    "fot_pro": "FoT (Pro)",
    "transformer_pro": "Transformer (Pro)",
    "fot_llama": "FoT (LLaMA)",
    "transformer_llama": "Transformer (LLaMA)",
    "transformer_llama_nope": "Transformer (LLaMA, no RoPE)",
    "deltanet": "DeltaNet",
}
LABELS: dict[str, str] = {**MODELS, "mamba2": "Mamba-2"}
TOY_MODELS = ("fot_llama", "transformer_llama")
RECURRENT = ("deltanet", "mamba2")
STEPS_AT_20_MIN = 128
BATCH_TOKENS = 131072


@dataclass
class Settings:
    """Everything that defines a reproduction run (written to ``OUT/settings.json``)."""

    models: list[str]
    train_length: int = 2048
    total_tokens: int = STEPS_AT_20_MIN * BATCH_TOKENS
    train_overrides: list[str] = field(default_factory=list)
    ptl_docs: int = 16
    needle_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    needle_depths: list[int] = field(default_factory=lambda: [0, 25, 50, 75, 100])
    fc_lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048, 4096, 8192])
    fc_repeats: int = 2
    toy: bool = False

    @property
    def eval_length(self) -> int:
        """Per-token loss length: 4x the training length."""
        return 4 * self.train_length


def settings_for(args: argparse.Namespace) -> Settings:
    """Build the run settings from the command line (``--toy`` gives the CPU smoke settings)."""
    if args.toy:
        models = args.models or list(TOY_MODELS)
        return Settings(
            models=models,
            train_length=64,
            total_tokens=1024,
            train_overrides=[
                "size=tiny",
                "++model.overrides={hidden_size:32,num_hidden_layers:1,num_heads:2}",
                "data.seq_len=64",
                "global_batch_tokens=256",
                "micro_batch_size=4",
                "data.val_tokens=256",
                "log_every_tokens=256",
                "schedule.warmup_tokens=256",
                "device=cpu",
            ],
            ptl_docs=2,
            needle_lengths=[64, 128],
            needle_depths=[0, 100],
            fc_lengths=[64, 128],
            fc_repeats=1,
            toy=True,
        )
    steps = max(1, int(STEPS_AT_20_MIN * args.budget_minutes / 20))
    return Settings(models=args.models or list(MODELS), total_tokens=steps * BATCH_TOKENS)


# ----------------------------------------------------------------------------------------
# Training and evaluation
# ----------------------------------------------------------------------------------------


def train_model(
    model: str, s: Settings, data: Path, run_dir: Path, log: Callable[[str], None]
) -> dict:
    """Train one model with ``train.py experiment=repro_small`` in a subprocess.

    Returns:
        ``{"wall_s", "returncode"}`` (also stored in ``run_dir/repro_train.json``; a finished
        run with an HF export is not retrained).
    """
    record = run_dir / "repro_train.json"
    if record.exists() and (run_dir / "hf" / "config.json").exists():
        return json.loads(record.read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "experiment=repro_small",
        f"model={model}",
        f"data.path={data / 'train'}",
        f"data.val_path={data / 'heldout'}",
        f"total_tokens={s.total_tokens}",
        f"out_dir={run_dir}",
        f"hydra.run.dir={run_dir}",
        *s.train_overrides,
    ]
    env = {**os.environ, "WANDB_MODE": os.environ.get("WANDB_MODE", "disabled")}
    log(f"[train] {model}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    with open(run_dir / "repro_train.log", "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    rec = {"wall_s": time.perf_counter() - t0, "returncode": proc.returncode, "command": cmd}
    if proc.returncode != 0:
        lines = (run_dir / "repro_train.log").read_text().splitlines()
        errs = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
        why = errs[-1] if errs else (lines[-1] if lines else "no output")
        raise RuntimeError(
            f"training {model} failed (exit {proc.returncode}): {why} "
            f"(log: {run_dir / 'repro_train.log'})"
        )
    record.write_text(json.dumps(rec, indent=2))
    return rec


def evaluate_model(
    model: str, s: Settings, data: Path, hf: Path, out: Path, log: Callable[[str], None]
) -> dict:
    """Per-token loss, easy needle grid and forgetting curve of one checkpoint (``fot.eval``).

    Returns:
        ``{"wall_s"}``; results are in ``out/{ptl,needle,fc}`` (each resumes if rerun).
    """
    from fot.eval.__main__ import main as fot_eval

    t0 = time.perf_counter()
    T = str(s.train_length)
    common = ["--train-length", T]
    steps = {
        "per-token loss": ["per-token-loss", str(hf), "--data", str(data / "heldout"),
                           "--length", str(s.eval_length), "--max-docs", str(s.ptl_docs),
                           "--batch-size", "1", "--label", LABELS.get(model, model),
                           "--out", str(out / "ptl"), *common],
        "needle (easy)": ["needle", str(hf), "--mode", "easy",
                          "--lengths", ",".join(map(str, s.needle_lengths)),
                          "--depths", ",".join(map(str, s.needle_depths)),
                          "--out", str(out / "needle"), *common],
        "forgetting curve": ["forgetting-curve", str(hf), "--data", str(data / "heldout"),
                             "--lengths", ",".join(map(str, s.fc_lengths)),
                             "--repeats", str(s.fc_repeats), "--out", str(out / "fc"), *common],
    }  # fmt: skip
    errors = []
    for name, argv in steps.items():
        log(f"[eval] {model}: {name}")
        try:  # one failing evaluation must not lose the others
            fot_eval(argv)
        except Exception as e:
            log(f"[error] {model} {name}: {type(e).__name__}: {e}")
            errors.append(f"{name}: {type(e).__name__}: {e}")
    if errors:
        raise RuntimeError("; ".join(errors))
    return {"wall_s": time.perf_counter() - t0}


# ----------------------------------------------------------------------------------------
# Reading results
# ----------------------------------------------------------------------------------------


def _read_csv(path: Path) -> list[dict[str, float]]:
    lines = path.read_text().splitlines()
    head = lines[0].split(",")
    return [dict(zip(head, map(float, ln.split(",")), strict=True)) for ln in lines[1:] if ln]


def _train_record(run: Path) -> dict:
    final = json.loads((run / "final.json").read_text())
    info = json.loads((run / "run_info.json").read_text())
    info = info[-1] if isinstance(info, list) else info
    rec = json.loads((run / "repro_train.json").read_text())
    return {**final, "wall_s": rec["wall_s"], "params": info.get("params_without_embedding")}


def load_results(out: Path, s: Settings) -> dict[str, dict]:
    """Collect every model's training record and evaluation outputs from ``out``.

    Returns:
        model -> dict with ``train`` (final.json + wall time + params), ``loss`` (L(i) array
        from ``per_token_loss.npz``), ``p_length``/``perplexity`` (the eval's P(l)),
        ``needle`` (rows of needle_easy.csv), ``fc`` (rows of forgetting_curve.csv),
        ``fc_summary``, ``eval_wall_s`` and ``error`` (a failure message, or None).
    """
    res: dict[str, dict] = {}
    for m in s.models:
        run, ev = out / "runs" / m, out / "eval" / m
        r: dict = {"error": None}
        err = out / "errors" / f"{m}.txt"
        if err.exists():
            r["error"] = err.read_text().strip().splitlines()[0][:300]
        parts = {
            "train": lambda run=run: _train_record(run),
            "ptl": lambda ev=ev: dict(np.load(ev / "ptl" / "per_token_loss.npz")),
            "needle": lambda ev=ev: _read_csv(ev / "needle" / "needle_easy.csv"),
            "fc": lambda ev=ev: _read_csv(ev / "fc" / "forgetting_curve.csv"),
            "fc_summary": lambda ev=ev: json.loads((ev / "fc" / "summary.json").read_text()),
            "eval_wall_s": lambda ev=ev: json.loads((ev / "repro_eval.json").read_text())["wall_s"],
        }
        missing = []
        for key, read in parts.items():
            try:  # each part on its own: a failed needle run keeps the loss curve usable
                r[key] = read()
            except (FileNotFoundError, KeyError) as e:
                missing.append(f"{key} ({e})")
        if "ptl" in r:
            ptl = r.pop("ptl")
            r["loss"], r["p_length"], r["perplexity"] = (
                ptl["loss"],
                ptl["p_length"],
                ptl["perplexity"],
            )
        if missing and r["error"] is None:
            r["error"] = "missing results: " + ", ".join(missing)
        res[m] = r
    return res


# ----------------------------------------------------------------------------------------
# Claims
# ----------------------------------------------------------------------------------------


def window_mean(loss: np.ndarray, lo: int, hi: int) -> float:
    """Mean of L(i) over positions ``lo <= i < hi`` (0-based, clipped to the array)."""
    seg = loss[max(0, lo) : min(len(loss), hi)]
    if seg.size == 0:
        raise ValueError(f"empty window [{lo}, {hi}) of a {len(loss)}-position loss")
    return float(seg.mean())


def needle_mean(rows: list[dict[str, float]], max_length: int) -> float:
    """Mean easy-needle score (1-10) over cells with context length <= ``max_length``."""
    sc = [r["score"] for r in rows if r["context_length"] <= max_length]
    return float(np.mean(sc)) if sc else float("nan")


def judge_claims(res: dict[str, dict], T: int) -> list[dict]:
    """Mark each of the paper's claims by an explicit numeric rule.

    Positions are 0-based, T is the training length; "long positions" are ``[T/2, T)``,
    "beyond training" is ``[2T, 4T)``. Each claim is ``reproduced``, ``not reproduced`` or
    ``inconclusive`` (also when a model it needs is missing), with its rule and numbers.

    Returns:
        ``[{"claim", "rule", "numbers", "verdict"}, ...]``.
    """
    ok = {m: r for m, r in res.items() if "loss" in r}

    def L(m: str, lo: int, hi: int) -> float:
        return window_mean(ok[m]["loss"], lo, hi)

    def need(*ms: str) -> list[str]:
        return [m for m in ms if m not in ok]

    claims: list[dict] = []

    def add(claim: str, rule: str, numbers: str, verdict: str) -> None:
        claims.append(dict(claim=claim, rule=rule, numbers=numbers, verdict=verdict))

    # 1. FoT at or below the Transformer at long positions (Pro vs Pro, LLaMA vs LLaMA).
    rule = (
        "mean L(i) over [T/2, T): reproduced if FoT <= Transformer + 0.01 nats for every "
        "available pair (Pro, LLaMA); not reproduced if FoT > Transformer + 0.05 for any pair"
    )
    pairs = [
        (f, t)
        for f, t in (("fot_pro", "transformer_pro"), ("fot_llama", "transformer_llama"))
        if not need(f, t)
    ]
    if not pairs:
        add("FoT L(i) <= Transformer at long positions", rule, "missing models", "inconclusive")
    else:
        diffs = {f"{f} - {t}": L(f, T // 2, T) - L(t, T // 2, T) for f, t in pairs}
        nums = "; ".join(
            f"{f}: {L(f, T // 2, T):.4f} vs {t}: {L(t, T // 2, T):.4f} (diff {L(f, T // 2, T) - L(t, T // 2, T):+.4f})"
            for f, t in pairs
        )
        v = (
            "reproduced"
            if all(d <= 0.01 for d in diffs.values())
            else "not reproduced"
            if any(d > 0.05 for d in diffs.values())
            else "inconclusive"
        )
        add("FoT L(i) <= Transformer at long positions", rule, nums, v)

    # 2. FoT extrapolates past T where Transformer (LLaMA) degrades.
    rule = (
        "degradation d = mean L over [2T, 4T) - mean L over [T/2, T). Reproduced if "
        "d(transformer_llama) >= 0.1 and d(FoT) <= d(transformer_llama)/2 for every FoT model; "
        "not reproduced if d(transformer_llama) < 0.05 or some FoT d >= d(transformer_llama)"
    )
    fots = [f for f in ("fot_pro", "fot_llama") if f in ok]
    if need("transformer_llama") or not fots or len(ok["transformer_llama"]["loss"]) < 4 * T:
        add(
            "FoT extrapolates where Transformer (LLaMA) degrades",
            rule,
            "missing models or positions",
            "inconclusive",
        )
    else:
        d = {m: L(m, 2 * T, 4 * T) - L(m, T // 2, T) for m in ["transformer_llama", *fots]}
        dt = d["transformer_llama"]
        if dt >= 0.1 and all(d[f] <= dt / 2 for f in fots):
            v = "reproduced"
        elif dt < 0.05 or any(d[f] >= dt for f in fots):
            v = "not reproduced"
        else:
            v = "inconclusive"
        # Extra evidence, not part of the rule: the held-out text itself is harder at some
        # positions, which moves every model's d alike; the gap to Transformer (LLaMA) cancels it.
        gaps = "; ".join(
            f"{f} - transformer_llama: {L(f, T // 2, T) - L('transformer_llama', T // 2, T):+.4f} "
            f"over [T/2, T), {L(f, 2 * T, 4 * T) - L('transformer_llama', 2 * T, 4 * T):+.4f} "
            "over [2T, 4T)"
            for f in fots
        )
        add(
            "FoT extrapolates where Transformer (LLaMA) degrades",
            rule,
            "; ".join(f"d({m}) = {x:+.4f}" for m, x in d.items())
            + f" (gaps, outside the rule: {gaps})",
            v,
        )

    # 3. Transformer without RoPE much worse.
    rule = (
        "mean L(i) over [0, T): reproduced if transformer_llama_nope - transformer_llama >= 0.05 "
        "nats; not reproduced if <= 0; inconclusive in between"
    )
    if need("transformer_llama_nope", "transformer_llama"):
        add("Transformer without RoPE is much worse", rule, "missing models", "inconclusive")
    else:
        a, b = L("transformer_llama_nope", 0, T), L("transformer_llama", 0, T)
        v = "reproduced" if a - b >= 0.05 else "not reproduced" if a - b <= 0 else "inconclusive"
        add(
            "Transformer without RoPE is much worse",
            rule,
            f"no RoPE {a:.4f} vs RoPE {b:.4f} (diff {a - b:+.4f})",
            v,
        )

    # 4. Recurrent baseline's L(i) flattens early.
    rule = (
        "late gain g = mean L over [T/8, T/4) - mean L over [T/2, T). Reproduced if g(recurrent) "
        "<= g(fot_pro)/2 and g(fot_pro) >= 0.02; not reproduced if g(recurrent) >= g(fot_pro)"
    )
    rec = next((m for m in RECURRENT if m in ok), None)
    if rec is None or need("fot_pro"):
        add("Recurrent baseline's L(i) flattens early", rule, "missing models", "inconclusive")
    else:
        g = {m: L(m, T // 8, T // 4) - L(m, T // 2, T) for m in (rec, "fot_pro")}
        if g[rec] <= g["fot_pro"] / 2 and g["fot_pro"] >= 0.02:
            v = "reproduced"
        elif g[rec] >= g["fot_pro"]:
            v = "not reproduced"
        else:
            v = "inconclusive"
        add(
            "Recurrent baseline's L(i) flattens early",
            rule,
            "; ".join(f"g({m}) = {x:+.4f}" for m, x in g.items()),
            v,
        )

    # 5. Easy needle near perfect within the training length for FoT.
    rule = (
        "mean easy-needle score (1-10) over cells with length <= T: reproduced if >= 9 for every "
        "FoT model; not reproduced if < 5 for any; inconclusive in between"
    )
    fots = [f for f in ("fot_pro", "fot_llama") if f in ok and "needle" in ok[f]]
    if not fots:
        add("Easy needle near perfect within T for FoT", rule, "missing models", "inconclusive")
    else:
        sc = {f: needle_mean(ok[f]["needle"], T) for f in fots}
        v = (
            "reproduced"
            if all(x >= 9 for x in sc.values())
            else "not reproduced"
            if any(x < 5 for x in sc.values())
            else "inconclusive"
        )
        add(
            "Easy needle near perfect within T for FoT",
            rule,
            "; ".join(f"{f}: {x:.2f}" for f, x in sc.items()),
            v,
        )
    return claims


# ----------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------


def log_binned(loss: np.ndarray, bins: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """Mean of L(i) in log-spaced position bins (for a log-x plot without smearing early i).

    Args:
        loss: ``[N]`` per-position loss (position i is index i - 1).
        bins: number of log-spaced bins over positions 1..N.

    Returns:
        ``(x, y)``: geometric bin centres (1-based positions) and bin means, empty bins dropped.
    """
    n = len(loss)
    edges = np.unique(np.round(np.geomspace(1, n + 1, bins + 1)).astype(int))
    x = np.sqrt(edges[:-1] * (edges[1:] - 1).clip(min=1))
    y = np.array([loss[a - 1 : b - 1].mean() for a, b in itertools.pairwise(edges)])
    return x, y


def make_plots(res: dict[str, dict], s: Settings, assets: Path) -> dict[str, str]:
    """Write the per-token-loss overlay, needle heatmaps and forgetting curves (small PNGs).

    Returns:
        plot kind -> file name inside ``assets``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    assets.mkdir(parents=True, exist_ok=True)
    ok = {m: r for m, r in res.items() if "loss" in r}
    files: dict[str, str] = {}
    T = s.train_length
    if ok:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=90)
        for m, r in ok.items():
            x, y = log_binned(r["loss"])
            ax.plot(x, y, label=LABELS.get(m, m), lw=1.2)
        ax.axvline(T, color="k", ls="--", lw=0.8, label=f"training length {T}")
        ax.set(xscale="log", xlabel="token position i (1-based)", ylabel="L(i), log-binned mean")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(assets / "per_token_loss.png")
        plt.close(fig)
        files["ptl"] = "per_token_loss.png"

    nd = {m: r for m, r in res.items() if "needle" in r}
    if nd:
        fig, axes = plt.subplots(1, len(nd), figsize=(2.2 * len(nd), 2.6), dpi=80, squeeze=False)
        for ax, (m, r) in zip(axes[0], nd.items(), strict=True):
            cells: dict[tuple[int, int], list[float]] = {}
            for row in r["needle"]:
                key = (int(row["depth"]), int(row["context_length"]))
                cells.setdefault(key, []).append(row["score"])
            grid = np.full((len(s.needle_depths), len(s.needle_lengths)), np.nan)
            for i, dep in enumerate(s.needle_depths):
                for j, n in enumerate(s.needle_lengths):
                    if (dep, n) in cells:
                        grid[i, j] = np.mean(cells[(dep, n)])
            ax.imshow(grid, vmin=1, vmax=10, cmap="RdYlGn", aspect="auto")
            ax.set_title(LABELS.get(m, m), fontsize=7)
            ax.set_xticks(
                range(len(s.needle_lengths)),
                [str(x) for x in s.needle_lengths],
                fontsize=6,
                rotation=45,
            )
            ax.set_yticks(
                range(len(s.needle_depths)), [str(x) for x in s.needle_depths], fontsize=6
            )
        axes[0][0].set_ylabel("depth %", fontsize=7)
        fig.supxlabel("context length (tokens); colour: score 1 (red) to 10 (green)", fontsize=7)
        fig.tight_layout()
        fig.savefig(assets / "needle_easy.png")
        plt.close(fig)
        files["needle"] = "needle_easy.png"

    fc = {m: r for m, r in res.items() if "fc" in r}
    if fc:
        fig, ax = plt.subplots(figsize=(6, 3.2), dpi=90)
        for k, (m, r) in enumerate(fc.items()):
            x = [row["length"] for row in r["fc"]]
            ax.plot(
                x,
                [row["copy_mean"] for row in r["fc"]],
                f"C{k}-o",
                ms=3,
                label=f"{LABELS.get(m, m)} copy",
            )
            ax.plot(x, [row["lm_mean"] for row in r["fc"]], f"C{k}:", lw=1)
        ax.axvline(T, color="k", ls="--", lw=0.8)
        ax.set(
            xscale="log",
            xlabel="sequence length (solid: copy, dotted: LM)",
            ylabel="accuracy",
            ylim=(0, 1.02),
        )
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(assets / "forgetting_curve.png")
        plt.close(fig)
        files["fc"] = "forgetting_curve.png"
    return files


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"CPU: {platform.processor() or platform.machine()} (torch {torch.__version__})"


def _calls(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The calls ``meta.json`` records, each ``{"argv", "git_sha", "device"}`` (a file of an
    older version kept one commit and device for all: given to each of its calls)."""
    return [
        c
        if isinstance(c, dict)
        else {
            "argv": c,
            "git_sha": meta.get("git_sha", "unknown"),
            "device": meta.get("device", "unknown"),
        }
        for c in meta.get("calls", [])
    ]


def _git_sha() -> str:
    from fot.provenance import git_sha  # the GPU machine's copy of the tree may have no git

    return git_sha() or "unknown"


PAPER_SCALE = (760e6, 48e9)  # the paper's main setting: parameters, training tokens


def scale_notes(res: dict[str, dict], s: Settings) -> list[str]:
    """Bullet lines that put the run's scale next to the paper's, from the numbers in ``res``."""
    notes = []
    params = [r["train"]["params"] for r in res.values() if r.get("train", {}).get("params")]
    if params:
        ratio = s.total_tokens / float(np.mean(params))
        paper = PAPER_SCALE[1] / PAPER_SCALE[0]
        notes.append(
            f"- {s.total_tokens / 1e6:.1f}M tokens for ~{np.mean(params) / 1e6:.0f}M-parameter "
            f"models is {ratio:.2f} tokens per parameter; the paper's main runs use "
            f"{PAPER_SCALE[1] / 1e9:.0f}B tokens for {PAPER_SCALE[0] / 1e6:.0f}M parameters "
            f"({paper:.0f} tokens per parameter), so these models are far from converged."
        )
    val = [r["train"]["val/loss"] for r in res.values() if "val/loss" in r.get("train", {})]
    if val:
        notes.append(f"- Held-out losses are {min(val):.2f}-{max(val):.2f} nats.")
    fc = [r["fc_summary"] for r in res.values() if "fc_summary" in r]
    if fc:
        copying = sum(1 for x in fc if (x.get("coarse_grained_length") or 0) > 0)
        notes.append(
            f"- {copying} of {len(fc)} models copy a repeated span better than a language model "
            "would (forgetting-curve coarse memory length > 0)."
        )
    nd = [np.mean([row["score"] for row in r["needle"]]) for r in res.values() if "needle" in r]
    if nd:
        notes.append(
            f"- Mean easy-needle scores are {min(nd):.2f}-{max(nd):.2f} of 10: "
            + ("no model retrieves the needle." if max(nd) < 2 else "some models retrieve it.")
        )
    docs = [len(r["loss"]) for r in res.values() if "loss" in r]
    if docs:
        notes.append(
            f"- L(i) is averaged over at most {s.ptl_docs} held-out documents of at least "
            f"{s.eval_length} tokens, so single positions are noisy; the claims use window means."
        )
    return notes


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when inside it (reports stay machine-independent)."""
    try:
        return str(path.relative_to(ROOT))
    except ValueError:
        return str(path)


def write_report(out: Path, s: Settings, data: Path, report: Path, meta: dict) -> dict:
    """Write the markdown report (and its PNGs in ``<report stem>_files/``) from ``out``.

    Returns:
        ``{"claims": [...], "results": <load_results output>}``.
    """
    res = load_results(out, s)
    T = s.train_length
    assets = report.parent / f"{report.stem}_files"
    files = make_plots(res, s, assets)
    claims = judge_claims(res, T)
    corpus = {}
    if (data / "corpus.json").exists():
        corpus = json.loads((data / "corpus.json").read_text())
    rel = assets.name
    L = []
    L.append("# Small-scale reproduction of the Forgetting Transformer paper\n")
    if s.toy:
        L.append(
            "> **Toy run** (`--toy`): tiny models, a few steps on CPU. It only checks the "
            "pipeline; none of these numbers mean anything about the models.\n"
        )
    calls = _calls(meta)
    shas = sorted({c["git_sha"] for c in calls}) or [_git_sha()]
    devices = sorted({c["device"] for c in calls}) or [_device()]
    where = f"at git `{shas[0]}`" if len(shas) == 1 else "at several commits (per call below)"
    L.append(f"Generated by `benchmarks/reproduce_small.py` {where} from these calls:\n")
    for c in calls:
        L.append(f"    python benchmarks/reproduce_small.py {' '.join(c['argv'])}")
        if len(shas) > 1 or len(devices) > 1:
            L.append(f"        # git {c['git_sha']}, {c['device']}")
    L.append("")
    L.append(f"- **Device:** {devices[0] if len(devices) == 1 else 'several (per call above)'}")
    L.append(
        f"- **Data:** `{_shown(data)}`: {corpus.get('train_tokens', '?')} training tokens in "
        f"{corpus.get('train_docs', '?')} documents, {corpus.get('heldout_tokens', '?')} "
        f"held-out tokens in {corpus.get('heldout_docs', '?')} documents (sources: "
        f"{', '.join(corpus.get('sources', {})) or '?'}; `benchmarks/make_corpus.py`)"
    )
    L.append(
        f"- **Training:** `experiment=repro_small`, training length T = {T}, "
        f"{s.total_tokens} tokens per model (identical data order, schedule and seed)"
        + (f", extra overrides `{' '.join(s.train_overrides)}`" if s.train_overrides else "")
    )
    L.append(
        f"- **Evaluation:** per-token loss at {s.eval_length} = 4T on up to {s.ptl_docs} "
        f"held-out documents; easy needle at lengths {s.needle_lengths} x depths "
        f"{s.needle_depths}; forgetting curve at {s.fc_lengths} x {s.fc_repeats}"
    )
    train_s = sum(r.get("train", {}).get("wall_s", 0.0) for r in res.values())
    eval_s = sum(r.get("eval_wall_s", 0.0) for r in res.values())
    L.append(
        f"- **Wall time:** {train_s:.0f} s training + {eval_s:.0f} s evaluation = "
        f"{train_s + eval_s:.0f} s ({(train_s + eval_s) / 60:.1f} min), summed over the models "
        "(package installs and Python start-up of each call not included)\n"
    )

    L.append("## Runs\n")
    L.append(
        "| model | params (no emb.) | tokens | train wall (s) | tokens/s | final train loss | val loss | eval wall (s) | status |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for m, r in res.items():
        t = r.get("train", {})

        def f(x, fmt):
            return format(x, fmt) if isinstance(x, (int, float)) and x is not None else "-"

        L.append(
            f"| {LABELS.get(m, m)} | {f(t.get('params'), ',')} | {f(t.get('tokens'), ',')} | "
            f"{f(t.get('wall_s'), '.0f')} | {f(t.get('tokens_per_s'), ',.0f')} | {f(t.get('loss'), '.4f')} | "
            f"{f(t.get('val/loss'), '.4f')} | {f(r.get('eval_wall_s'), '.0f')} | "
            f"{'ok' if r['error'] is None else 'FAILED: ' + r['error'].replace('|', '/')} |"
        )
    L.append("")

    L.append("## Per-token loss\n")
    if "ptl" in files:
        L.append(f"![per-token loss]({rel}/{files['ptl']})\n")
    ok = {m: r for m, r in res.items() if "loss" in r}
    if ok:
        pl = next(iter(ok.values()))["p_length"]
        L.append("P(l) = exp(mean L(i) over the first l positions) (from `per_token_loss.npz`):\n")
        L.append("| model | " + " | ".join(f"l={int(x)}" for x in pl) + " |")
        L.append("|---|" + "---|" * len(pl))
        for m, r in ok.items():
            L.append(
                f"| {LABELS.get(m, m)} | " + " | ".join(f"{x:.3f}" for x in r["perplexity"]) + " |"
            )
        L.append("")
        wins = [(0, T // 4), (T // 4, T // 2), (T // 2, T), (T, 2 * T), (2 * T, 4 * T)]
        L.append("Mean L(i) over position windows (nats):\n")
        L.append("| model | " + " | ".join(f"[{a}, {b})" for a, b in wins) + " |")
        L.append("|---|" + "---|" * len(wins))
        for m, r in ok.items():
            L.append(
                f"| {LABELS.get(m, m)} | "
                + " | ".join(f"{window_mean(r['loss'], a, b):.4f}" for a, b in wins)
                + " |"
            )
        L.append("")

    L.append("## Needle in a haystack (easy mode)\n")
    if "needle" in files:
        L.append(f"![needle heatmaps]({rel}/{files['needle']})\n")
    nd = {m: r for m, r in res.items() if "needle" in r}
    if nd:
        L.append("Mean score (1-10) per context length:\n")
        L.append("| model | " + " | ".join(str(x) for x in s.needle_lengths) + " |")
        L.append("|---|" + "---|" * len(s.needle_lengths))
        for m, r in nd.items():
            cells = []
            for n in s.needle_lengths:
                sc = [row["score"] for row in r["needle"] if int(row["context_length"]) == n]
                cells.append(f"{np.mean(sc):.2f}" if sc else "-")
            L.append(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
        L.append("")

    L.append("## Forgetting curve\n")
    if "fc" in files:
        L.append(f"![forgetting curves]({rel}/{files['fc']})\n")
    fc = {m: r for m, r in res.items() if "fc" in r and "fc_summary" in r}
    if fc:
        L.append(
            "Copy accuracy / LM accuracy per sequence length, and memory lengths "
            "(fine: copy >= 99%; coarse: copy > LM + 1 point):\n"
        )
        L.append("| model | " + " | ".join(str(x) for x in s.fc_lengths) + " | fine | coarse |")
        L.append("|---|" + "---|" * (len(s.fc_lengths) + 2))
        for m, r in fc.items():
            by = {int(row["length"]): row for row in r["fc"]}
            cells = [
                f"{by[n]['copy_mean']:.3f} / {by[n]['lm_mean']:.3f}" if n in by else "-"
                for n in s.fc_lengths
            ]
            L.append(
                f"| {LABELS.get(m, m)} | "
                + " | ".join(cells)
                + f" | {r['fc_summary'].get('fine_grained_length')} | {r['fc_summary'].get('coarse_grained_length')} |"
            )
        L.append("")

    L.append("## Scale and caveats\n")
    L.extend(scale_notes(res, s))
    L.append("")
    L.append("## The paper's claims\n")
    L.append(
        "Positions are 0-based; T is the training length. Each verdict follows the rule "
        "written next to it (`judge_claims` in the script).\n"
    )
    for i, c in enumerate(claims, 1):
        L.append(f"{i}. **{c['claim']}: {c['verdict']}.** {c['numbers']}.  \n   Rule: {c['rule']}.")
    L.append("")
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text("\n".join(L))
    (out / "claims.json").write_text(json.dumps(claims, indent=2))
    return {"claims": claims, "results": res}


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """CLI entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="folder from make_corpus.py (train/, heldout/)")
    ap.add_argument("--out", required=True, help="run folder (resumes if it exists)")
    ap.add_argument(
        "--report",
        help="markdown report to write (default: docs/results.md; --toy: OUT/results.md)",
    )
    ap.add_argument("--budget-minutes", type=float, default=20.0, help="scales the token budget")
    ap.add_argument("--models", type=lambda x: x.split(","), help=f"subset of {list(MODELS)}")
    ap.add_argument("--toy", action="store_true", help="CPU smoke run of the whole pipeline")
    ap.add_argument("--report-only", action="store_true", help="rebuild the report from --out")
    args = ap.parse_args(argv)
    data, out = Path(args.data).resolve(), Path(args.out).resolve()
    if args.report:
        report = Path(args.report).resolve()
    else:  # a toy report must never overwrite the real one
        report = out / "results.md" if args.toy else ROOT / "docs" / "results.md"
    for sub in ("train", "heldout"):
        if not (data / sub / "tokens.bin").exists():
            ap.error(
                f"--data {data} has no {sub}/ token folder; run benchmarks/make_corpus.py --out {data}"
            )
    if args.budget_minutes <= 0:
        ap.error(f"--budget-minutes must be > 0, got {args.budget_minutes}")
    unknown = [m for m in (args.models or []) if m not in MODELS and m not in RECURRENT]
    if unknown:
        ap.error(f"unknown --models {unknown}; choose from {list(MODELS)} (or mamba2)")
    if args.report_only and not (out / "settings.json").exists():
        ap.error(
            f"--report-only: --out {out} holds no earlier run (no settings.json), so the report "
            f"would list every model as missing and overwrite {report}; check the --out path"
        )
    s = settings_for(args)
    out.mkdir(parents=True, exist_ok=True)
    meta_path = out / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    if (out / "settings.json").exists():  # identical budget and grids across resumed calls
        old = json.loads((out / "settings.json").read_text())
        new = asdict(s)
        diff = sorted(k for k in new if k != "models" and old.get(k) != new[k])
        if diff:
            ap.error(
                f"--out {out} was made with different settings ({', '.join(diff)}: "
                f"{[old.get(k) for k in diff]} vs {[new[k] for k in diff]}); use a fresh --out "
                "or the same --toy/--budget-minutes"
            )

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    if not args.report_only:
        # Recorded before the work, so that a call cut off by a time limit is still listed.
        # each call with its own commit and device: the models of one --out may come from
        # several calls, on several machines
        call = {
            "argv": sys.argv[1:] if argv is None else list(argv),
            "git_sha": _git_sha(),
            "device": _device(),
        }
        meta = {"calls": [*_calls(meta), call]}
        meta_path.write_text(json.dumps(meta, indent=2))
        (out / "settings.json").write_text(json.dumps(asdict(s), indent=2))
        (out / "errors").mkdir(exist_ok=True)
        for m in s.models:
            err = out / "errors" / f"{m}.txt"
            err.unlink(missing_ok=True)
            try:
                run_dir = out / "runs" / m
                train_model(m, s, data, run_dir, log)
                rec = out / "eval" / m / "repro_eval.json"
                if not rec.exists():
                    ev = evaluate_model(m, s, data, run_dir / "hf", out / "eval" / m, log)
                    rec.write_text(json.dumps(ev))
            except Exception as e:  # one failing model must not lose the others' results
                log(f"[error] {m}: {e}")
                err.write_text(f"{type(e).__name__}: {e}")
    result = write_report(out, s, data, report, meta)
    for c in result["claims"]:
        log(f"{c['verdict']:>15}: {c['claim']} ({c['numbers']})")
    log(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
