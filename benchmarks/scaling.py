"""Multi-GPU scaling: tokens/s per GPU on 1, 2, 4, ... GPUs, and the loss against one GPU.

Every run trains the same model on the same data with the same **global** batch
(``--global-sequences``, by default ``--nprocs``' largest entry x ``--per-gpu-batch``, sequences
of ``--seq-len`` tokens), so the losses of the
first steps must agree between world sizes up to floating-point reduction order; fewer
processes accumulate gradients over more micro batches. Each run is ``train.py`` under
``torchrun --standalone`` (a plain process for one GPU, ``parallel=single``; FSDP2 also on one
process, as the loss reference of its multi-GPU rows), logging every step to ``metrics.jsonl``;
checkpoints of the benchmark runs are deleted and no HF export is written.

Reported per (strategy, processes): median tokens/s and tokens/s per GPU over the steps after
``--warmup``, scaling efficiency (per-GPU tokens/s over the one-GPU run's), the same over all
timed steps (all tokens over all time: a stalled step counts in full, which the median hides),
MFU, peak memory, and the largest |loss difference| to the one-GPU run (of the same strategy,
else the plain one) over the common steps. ``--override profile.steps=2 --override
profile.start_step=...`` adds per-rank profiles (``<work-dir>/<run>/profile/``).

    python benchmarks/scaling.py --nprocs 1,2,4 --strategies fsdp,ddp --out results/scaling
    python benchmarks/scaling.py --size tiny --seq-len 64 --steps 3 --nprocs 1,2 \\
        --strategies ddp --device cpu                       # CPU (gloo) smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
ROOT = _HERE.parent
if str(_HERE) not in sys.path:  # sibling modules when imported from elsewhere
    sys.path.insert(0, str(_HERE))

import torch  # noqa: E402
from train_throughput import (  # noqa: E402
    check_out_file,
    fmt,
    interrupted_note,
    log,
    no_gpu_message,
    run_meta,
    write_json,
)

from fot.training.config import unknown_group_option, unknown_override_key  # noqa: E402

STRATEGIES = ("ddp", "fsdp")


def train_command(nproc: int, strategy: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The ``train.py`` command line of one run (``torchrun`` when ``nproc > 1``)."""
    gbt = args.global_sequences * args.seq_len
    overrides = [
        f"model={args.model}",
        f"size={args.size}",
        "data=sample",
        f"data.seq_len={args.seq_len}",
        "data.val_tokens=0",
        f"global_batch_tokens={gbt}",
        f"micro_batch_size={args.per_gpu_batch}",
        f"total_tokens={gbt * args.steps}",
        f"log_every_tokens={gbt}",
        "val_every_tokens=0",
        "ckpt_every_tokens=0",
        "export_hf=false",
        "resume=never",
        "progress=false",
        f"parallel={strategy}",
        f"parallel.compile={str(args.compile).lower()}",
        f"parallel.activation_checkpointing={str(args.activation_checkpointing).lower()}",
        f"out_dir={run_dir}",
        f"hydra.run.dir={run_dir}",
        *args.override,
    ]
    if strategy == "single":
        return [sys.executable, str(ROOT / "train.py"), *overrides]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / "train.py"),
        *overrides,
    ]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """Training records (those with ``tokens_per_s``) of ``run_dir/metrics.jsonl``, by step."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_step = {r["step"]: r for r in recs if "tokens_per_s" in r}  # later records win
    return [by_step[s] for s in sorted(by_step)]


def all_steps_rate(rates: list[float]) -> float:
    """Tokens/s over several steps of equal tokens, from each step's tokens/s: all tokens over
    all time, i.e. the harmonic mean. Unlike the median it counts a stalled step in full."""
    return len(rates) / sum(1.0 / r for r in rates)


def run_one(nproc: int, strategy: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one configuration; return its throughput summary and per-step losses."""
    name = f"{strategy}_x{nproc}"
    run_dir = Path(args.work_dir) / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = train_command(nproc, strategy, args, run_dir)
    env = {**os.environ, "WANDB_MODE": "disabled"}
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    log(f"[{name}] {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    with open(run_dir / "train.out", "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    recs = read_metrics(run_dir)
    row: dict[str, Any] = {
        "name": name,
        "strategy": strategy,
        "nproc": nproc,
        "wall_s": wall,
        "returncode": proc.returncode,
        "losses": [r["loss"] for r in recs],
        "error": None,
    }
    if proc.returncode != 0 or not recs:
        lines = (run_dir / "train.out").read_text(errors="replace").splitlines()
        # train.py's own one-line message first, else the last line naming an exception
        errs = [
            ln for ln in lines if re.match(r"train\.py( \(rank \d+ of \d+\))?: error:", ln)
        ] or [ln for ln in lines if re.search(r"(Error|Exception)\b", ln)]
        row["error"] = (errs[-1] if errs else (lines[-1] if lines else "no output"))[:300]
        log(f"[{name}] FAILED (exit {proc.returncode}): {row['error']}")
    timed = recs[args.warmup :] or recs[-1:]
    if timed:
        rates = [r["tokens_per_s"] for r in timed]
        tps = statistics.median(rates)
        mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
        row.update(
            tokens_per_s=tps,
            tokens_per_s_per_gpu=tps / nproc,
            tokens_per_s_per_gpu_all=all_steps_rate(rates) / nproc,
            mfu=statistics.median(mfu) if mfu else None,
            peak_mem_gib=max(r.get("peak_mem_gib") or 0.0 for r in recs),
        )
    if not args.keep_runs:  # checkpoints of a 760M model are ~9 GB each
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return row


def compare(rows: list[dict[str, Any]]) -> None:
    """Add scaling efficiency (per-GPU tokens/s over the plain one-GPU run's, and over the
    one-GPU run of the same strategy when there is one) and the largest
    loss difference to the one-GPU run of the same strategy (``fsdp_x1``: FSDP2's bf16
    parameters round differently from autocast over fp32 weights) or else the plain one, in
    place."""
    one = {r["strategy"]: r for r in rows if r["nproc"] == 1 and r["losses"]}
    base = one.get("single")
    for r in rows:
        per_gpu = r.get("tokens_per_s_per_gpu")
        r["efficiency"] = (
            per_gpu / base["tokens_per_s_per_gpu"]
            if per_gpu and base and base.get("tokens_per_s_per_gpu")
            else None
        )
        ref = one.get(r["strategy"], base)
        r["efficiency_same_strategy"] = (
            per_gpu / ref["tokens_per_s_per_gpu"]
            if per_gpu and ref and ref.get("tokens_per_s_per_gpu")
            else None
        )
        all_gpu = r.get("tokens_per_s_per_gpu_all")
        r["efficiency_same_strategy_all"] = (
            all_gpu / ref["tokens_per_s_per_gpu_all"]
            if all_gpu and ref and ref.get("tokens_per_s_per_gpu_all")
            else None
        )
        r["loss_reference"] = ref["name"] if ref else None
        n = min(len(r["losses"]), len(ref["losses"])) if ref else 0
        r["max_abs_loss_diff"] = (
            max(abs(a - b) for a, b in zip(r["losses"][:n], ref["losses"][:n])) if n else None
        )


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """A markdown table of the rows."""
    lines = [
        f"Device: {meta['device_name']} x {max(r['nproc'] for r in rows)}; command: "
        f"`{meta['command']}`",
        "",
        "| strategy | GPUs | tokens/s | tokens/s per GPU | efficiency vs single | "
        "efficiency vs same strategy on 1 GPU | tokens/s per GPU, all timed steps | "
        "efficiency vs same strategy, all timed steps | MFU | peak mem (GiB) | "
        "max abs loss diff (vs) | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['strategy']} | {r['nproc']} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{fmt(r.get('tokens_per_s_per_gpu'), ',.0f')} | {fmt(r.get('efficiency'), '.1%')} | "
            f"{fmt(r.get('efficiency_same_strategy'), '.1%')} | "
            f"{fmt(r.get('tokens_per_s_per_gpu_all'), ',.0f')} | "
            f"{fmt(r.get('efficiency_same_strategy_all'), '.1%')} | "
            f"{fmt(r.get('mfu'), '.1%')} | {fmt(r.get('peak_mem_gib'), '.1f')} | "
            f"{fmt(r.get('max_abs_loss_diff'), '.2e')} ({r.get('loss_reference') or '-'}) | "
            f"{'ok' if r['error'] is None else 'FAILED: ' + r['error'].replace('|', '/')} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options (``argv`` None: ``sys.argv``)."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nprocs", default="1,2,4", help="comma-separated process counts")
    p.add_argument("--strategies", default="fsdp,ddp", help=f"subset of {','.join(STRATEGIES)}")
    p.add_argument("--model", default="fot_pro", help="configs/model name")
    p.add_argument("--size", default="760m", help="configs/size name")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--per-gpu-batch", type=int, default=1, help="sequences per GPU per micro batch")
    p.add_argument(
        "--global-sequences",
        type=int,
        default=None,
        help="sequences per optimizer step (default: largest --nprocs x --per-gpu-batch); set "
        "it to compare with runs made with other --nprocs",
    )
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    p.add_argument("--compile", action="store_true", help="parallel.compile=true")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--override", action="append", default=[], help="extra train.py override")
    p.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu"),
        help="auto (default): CUDA, stopping where there is none; cpu: run on the CPU (toy sizes)",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="run folders (default: a new temporary folder, named in the log; a folder given "
        "here has its earlier runs of the same names replaced)",
    )
    p.add_argument("--keep-runs", action="store_true", help="keep checkpoints")
    p.add_argument(
        "--out",
        default=None,
        help="folder for scaling.json and scaling.md (not those of an earlier run)",
    )
    args = p.parse_args(argv)
    try:
        args.nprocs = sorted({int(x) for x in args.nprocs.split(",") if x})
    except ValueError:
        p.error(f"--nprocs {args.nprocs!r}: expected comma-separated integers, e.g. 1,2,4")
    args.strategies = list(dict.fromkeys(s for s in args.strategies.split(",") if s))
    bad = [s for s in args.strategies if s not in STRATEGIES]
    if bad or not args.strategies:
        p.error(f"--strategies {bad or args.strategies}: choose from {','.join(STRATEGIES)}")
    if not args.nprocs or args.nprocs[0] < 1:
        p.error(f"--nprocs must be positive, got {args.nprocs}")
    for flag, override in (
        ("--model", f"model={args.model}"),
        ("--size", f"size={args.size}"),
        *(("--override", o) for o in args.override),
    ):
        problem = unknown_override_key(override) or unknown_group_option(override, ROOT / "configs")
        if problem:  # else every run fails in turn, each after starting torchrun
            p.error(f"{flag}: {problem}")
    for flag in ("seq_len", "per_gpu_batch", "steps", "global_sequences"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    if any(max(args.nprocs) % n for n in args.nprocs):
        p.error(
            f"--nprocs {args.nprocs}: every count must divide the largest, so that one global "
            "batch serves all runs (e.g. 1,2,4)"
        )
    if args.global_sequences is None:
        args.global_sequences = max(args.nprocs) * args.per_gpu_batch
    bad = [n for n in args.nprocs if args.global_sequences % (n * args.per_gpu_batch)]
    if bad:
        p.error(
            f"--global-sequences {args.global_sequences} is not a multiple of nprocs x "
            f"--per-gpu-batch for nprocs {bad}"
        )
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """CLI entry point (see the module docstring)."""
    args = parse_args(argv)
    if args.device == "auto" and not torch.cuda.is_available():
        work = f"training {args.model} at --size {args.size}, --seq-len {args.seq_len}"
        toy = "--device cpu --size tiny --seq-len 64 --steps 3 --warmup 1 --nprocs 1,2"
        raise SystemExit(no_gpu_message("scaling.py", work, toy))
    device = torch.device("cuda" if args.device == "auto" else "cpu")
    if device.type == "cuda" and torch.cuda.device_count() < max(args.nprocs):
        raise SystemExit(
            f"--nprocs {args.nprocs} needs {max(args.nprocs)} GPUs, "
            f"{torch.cuda.device_count()} visible; lower --nprocs"
        )
    out = Path(args.out) if args.out else None
    if out is not None:
        check_out_file(out / "scaling.json")
    if args.work_dir is None:  # a folder of this run's own: never another run's or user's
        args.work_dir = tempfile.mkdtemp(prefix="fot_scaling-")
        log(f"run folders in {args.work_dir}")
    meta = run_meta(device, args)
    plan = [(1, "single")] if 1 in args.nprocs else []
    # largest world size first: a run cut short by a time limit keeps the most telling rows;
    # FSDP2 also on one process (under torchrun), the loss reference for its other rows
    plan += [
        (n, s)
        for s in args.strategies
        for n in sorted(args.nprocs, reverse=True)
        if n > 1 or s == "fsdp"
    ]
    rows: list[dict[str, Any]] = []
    for n, strategy in plan:
        try:
            rows.append(run_one(n, strategy, args))
        except KeyboardInterrupt:  # the runs' processes got the same SIGINT and stop too
            log(interrupted_note(f"{strategy} x{n}", len(rows), str(out) if out else None))
            if rows:
                log(markdown(rows, meta))
            raise SystemExit(130) from None
        compare(rows)
        if out is not None:  # after every run, so that partial results survive
            write_json(out / "scaling.json", {"meta": meta, "rows": rows})
            (out / "scaling.md").write_text(markdown(rows, meta))
    for r in rows:
        log(
            f"{r['strategy']:>6} x{r['nproc']}: {fmt(r.get('tokens_per_s_per_gpu'), ',.0f')} "
            f"tokens/s per GPU, efficiency {fmt(r.get('efficiency'), '.1%')}, max |loss diff| "
            f"{fmt(r.get('max_abs_loss_diff'), '.2e')}"
        )
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
