"""Forgetting-attention speed, side by side, on one GPU.

Compares ``fot.kernels.forgetting_attention`` with FLA's ``parallel_forgetting_attn``,
PyTorch SDPA without a gate (FlashAttention and cuDNN backends) and, when ``--fox-path``
points at a local copy of the paper's ``forgetting_attention.py``, the paper's kernel.

    python benchmarks/attention.py [--fox-path PATH] [--out results.md] [--sweep]
    python benchmarks/attention.py --documents 6   # packed documents (cu_seqlens)

Times are medians of ``triton.testing.do_bench`` (CUDA events) after warm-up. FLOPs count
the causal half: fwd = 2 * 2 * B * H * T * T * D / 2, bwd = 2.5 * fwd. With ``--documents N``
each shape's B * T tokens become one row of N packed documents of uneven (seeded) lengths,
FLOPs count each document's causal half, and only the kernels that take ``cu_seqlens`` run
(ours and FLA's).

Needs a CUDA GPU; without one it stops at once and says so. On CPU, ``python -m pytest
tests/test_kernels.py`` checks the kernel against the PyTorch reference under Triton's
interpreter, and ``benchmarks/pruning.py --device cpu`` counts the tiles that pruning skips.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # sibling modules when imported from elsewhere
    sys.path.insert(0, str(_HERE))

from train_throughput import check_out_file  # noqa: E402

SHAPES = [(1, 16384, 12, 128), (4, 4096, 12, 128), (1, 16384, 16, 64), (2, 8192, 16, 128)]
WEAK, STRONG = 4.0, -2.0


def _flops_fwd(B: int, T: int, H: int, D: int) -> float:
    return 2 * 2 * B * H * T * T * D / 2


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"1,16384,12,128"`` -> ``(B, T, H, D)``, four integers >= 1.

    Raises:
        SystemExit: anything else, with the expected form.
    """
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise SystemExit(
            f"--shapes {text!r}: expected B,T,H,D, four integers >= 1 without spaces, "
            "e.g. 1,16384,12,128"
        )
    return shape


def document_bounds(T: int, n: int) -> list[int]:
    """Boundaries ``[0, ..., T]`` (``cu_seqlens``) of ``n`` documents packed in ``T`` tokens,
    cut at ``n - 1`` distinct positions drawn with a fixed seed (uneven lengths, same every run).

    Raises:
        SystemExit: ``n`` outside ``1..T``.
    """
    if not 1 <= n <= T:
        raise SystemExit(
            f"--documents {n}: expected 1 to {T} documents (one row of {T} tokens); "
            "pass a smaller number or a longer shape"
        )
    gen = torch.Generator().manual_seed(0)
    cuts = (torch.randperm(T - 1, generator=gen)[: n - 1] + 1).sort().values.tolist()
    return [0, *cuts, T]


def check_fox_path(path: str) -> None:
    """Refuse a ``--fox-path`` that is not a Python file defining ``forgetting_attention``.

    Raises:
        SystemExit: the file is missing, not a ``.py`` file, or lacks the function.
    """
    file = Path(path)
    if not file.is_file() or file.suffix != ".py":
        raise SystemExit(
            f"--fox-path {path}: no such Python file; point it at a local copy of the paper's "
            "src/forgetting_transformer/ops/forgetting_attention.py (or leave it out)"
        )
    if "def forgetting_attention" not in file.read_text(errors="replace"):
        raise SystemExit(
            f"--fox-path {path} defines no forgetting_attention(); point it at the paper's "
            "src/forgetting_transformer/ops/forgetting_attention.py"
        )


def _load_fox(path: str):
    spec = importlib.util.spec_from_file_location("fox_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.forgetting_attention


def _make(B: int, T: int, H: int, D: int, gate_mean: float):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    )
    log_f = F.logsigmoid(torch.randn(B, T, H, device="cuda", generator=gen) + gate_mean)
    return q, k, v, log_f, do


def _impls(fox_path: str | None, cu: torch.Tensor | None = None) -> dict[str, Callable]:
    """name -> fn(q, k, v, log_f) taking [B, T, H, D] tensors (layout work outside timing).

    With ``cu`` (packed documents) only the kernels that take ``cu_seqlens``."""
    from fot.kernels import forgetting_attention

    impls: dict[str, Callable] = {
        "fot": lambda q, k, v, g: forgetting_attention(q, k, v, g, cu_seqlens=cu),
        "fot (prune off)": lambda q, k, v, g: forgetting_attention(
            q, k, v, g, cu_seqlens=cu, prune=False
        ),
    }
    try:
        from fla.ops.forgetting_attn import parallel_forgetting_attn

        impls["fla"] = lambda q, k, v, g: parallel_forgetting_attn(q, k, v, g, cu_seqlens=cu)
    except Exception as exc:
        print(f"FLA unavailable: {exc!r}", file=sys.stderr)
    if cu is not None:
        return impls
    if fox_path:
        fox = _load_fox(fox_path)
        impls["fox (paper)"] = lambda q, k, v, g: fox(q, k, v, g, head_first=True)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run(q, k, v, g):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return run

    impls["sdpa flash (no gate)"] = sdpa(SDPBackend.FLASH_ATTENTION)
    impls["sdpa cudnn (no gate)"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    return impls


_HEAD_FIRST = {"fox (paper)", "sdpa flash (no gate)", "sdpa cudnn (no gate)"}


def _time(fn, q, k, v, g, do) -> tuple[float, float]:
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
    fwd = triton.testing.do_bench(lambda: fn(q, k, v, g), warmup=50, rep=200, return_mode="median")

    def fwd_bwd():
        o = fn(*leaves)
        # SDPA ignores the gate: allow_unused lets its log_f gradient be None.
        torch.autograd.grad(o, leaves, do, allow_unused=True)

    both = triton.testing.do_bench(fwd_bwd, warmup=50, rep=300, return_mode="median")
    return fwd, both


def run_table(
    fox_path: str | None,
    shapes: list[tuple[int, int, int, int]],
    rows_out: list[str],
    documents: int | None = None,
) -> None:
    """Time every implementation on each ``(B, T, H, D)`` shape and gate setting (forward,
    forward + backward); the markdown rows go to ``rows_out`` and stdout. With ``documents``
    each shape's ``B * T`` tokens are one row of that many packed documents."""
    header = (
        "| shape (B,T,H,D) | gates | kernel | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
        "fwd+bwd TFLOP/s | vs FLA | vs cuDNN | vs paper |"
    )
    rows_out += [header, "|" + "---|" * 10]
    cases = [(s, WEAK) for s in shapes] + [(shapes[0], STRONG)]
    impls = None if documents else _impls(fox_path)  # loaded once (the paper's module too)
    for (B, T, H, D), gate_mean in cases:
        cu = None
        fl = _flops_fwd(B, T, H, D)
        if documents:
            bounds = document_bounds(B * T, documents)
            shown = bounds if len(bounds) <= 16 else [*bounds[:8], "...", *bounds[-4:]]
            shown = ", ".join(map(str, shown))
            rows_out.append(f"documents in {(B, T, H, D)} packed as one row: cu_seqlens [{shown}]")
            print(rows_out[-1], flush=True)
            cu = torch.tensor(bounds, device="cuda", dtype=torch.int32)
            lengths = [b - a for a, b in itertools.pairwise(bounds)]
            fl = sum(_flops_fwd(1, n, H, D) for n in lengths)
            B, T = 1, B * T
            impls = _impls(fox_path, cu)
        q, k, v, g, do = _make(B, T, H, D, gate_mean)
        qh, kh, vh, doh = (t.transpose(1, 2).contiguous() for t in (q, k, v, do))
        gh = g.transpose(1, 2).contiguous()
        res: dict[str, tuple[float, float]] = {}
        for name, fn in impls.items():
            if gate_mean == STRONG and "sdpa" in name:
                continue
            args = (qh, kh, vh, gh, doh) if name in _HEAD_FIRST else (q, k, v, g, do)
            try:
                res[name] = _time(fn, *args)
            except Exception as exc:
                print(f"{name} failed on {(B, T, H, D)}: {exc!r}", file=sys.stderr)
        skipped = ""
        try:
            from fot.kernels import PruneStats, forgetting_attention

            st = PruneStats()
            forgetting_attention(q, k, v, g, cu_seqlens=cu, stats=st)
            skipped = f" (fot skips {st.skipped_fraction:.0%} of tiles)"
        except Exception as exc:
            print(f"stats failed: {exc!r}", file=sys.stderr)
        gates = ("weak N(4,1)" if gate_mean == WEAK else "strong N(-2,1)") + skipped
        if documents:
            gates = f"{documents} docs, {gates}"
        for name, (f_ms, b_ms) in res.items():
            tf_f = fl / f_ms / 1e9
            tf_b = 3.5 * fl / b_ms / 1e9

            def ratio(other: str, b_ms=b_ms, res=res) -> str:
                return f"{res[other][1] / b_ms:.2f}x" if other in res else "-"

            rows_out.append(
                f"| {(B, T, H, D)} | {gates} | {name} | {f_ms:.2f} | {tf_f:.0f} | {b_ms:.2f} | "
                f"{tf_b:.0f} | {ratio('fla')} | {ratio('sdpa cudnn (no gate)')} | "
                f"{ratio('fox (paper)')} |"
            )
            print(rows_out[-1], flush=True)
        del q, k, v, g, do, qh, kh, vh, gh, doh
        torch.cuda.empty_cache()


def sweep(shape: tuple[int, int, int, int], rows_out: list[str]) -> None:
    """Time our kernel under several tile configs (fwd alone, bwd alone)."""
    import importlib

    from fot.kernels import forgetting_attention

    mod = importlib.import_module("fot.kernels.forgetting_attention")
    B, T, H, D = shape
    q, k, v, g, do = _make(B, T, H, D, WEAK)
    fl = _flops_fwd(B, T, H, D)
    # forward: (bm, bn, warps, stages, register cap; 0 = none)
    fwd_opts = [(128, 128, 8, 3, 0), (128, 64, 8, 3, 0), (128, 64, 4, 3, 0), (64, 64, 4, 3, 0)]
    fwd_opts.append((128, 128, 8, 2, 0))
    if D <= 64:  # smaller tiles or register caps: 3 or 4 programs per SM instead of 2
        fwd_opts += [(64, 64, 4, 3, 128), (64, 64, 4, 2, 128), (64, 32, 4, 3, 0), (64, 32, 4, 4, 0)]
        fwd_opts += [(64, 32, 4, 3, 96), (128, 32, 4, 3, 168), (256, 64, 8, 3, 0)]
    fwd_cfgs = [
        {"fwd_bm": bm, "fwd_bn": bn, "fwd_warps": w, "fwd_stages": s, "fwd_maxnreg": r}
        for bm, bn, w, s, r in fwd_opts
    ]
    # dQ and dK/dV: (bm, bn, warps, stages, register cap; 0 = none)
    dq_opts = {
        "A": (128, 64, 8, 3, 0),
        "B": (64, 64, 4, 3, 0),
        "C": (64, 64, 4, 2, 0),
        "D": (128, 64, 8, 2, 0),
        "H": (64, 64, 4, 4, 0),
        "I": (128, 64, 8, 4, 0),
        "E": (128, 128, 8, 2, 0),
    }
    kv_opts = {
        "a": (64, 128, 8, 3, 0),
        "b": (64, 64, 4, 3, 0),
        "c": (64, 64, 4, 2, 0),
        "d": (64, 128, 8, 2, 0),
    }
    combos = ["Aa", "Bb", "Cc", "Ac", "Ca", "Ab", "Ba", "Ad", "Dd", "Hb", "Ic", "Hc", "Ea", "Ia"]
    if D <= 64:  # small heads leave room for larger tiles
        dq_opts |= {
            "F": (128, 64, 4, 3, 0),
            "G": (128, 128, 8, 3, 0),
            "J": (64, 64, 4, 3, 168),
            "K": (64, 64, 4, 3, 128),
            "L": (64, 32, 4, 3, 128),
            "M": (64, 64, 4, 3, 152),
        }
        kv_opts |= {
            "e": (128, 128, 8, 2, 0),
            "f": (64, 128, 4, 3, 0),
            "g": (128, 64, 4, 3, 0),
            "h": (32, 128, 4, 3, 0),
            "i": (64, 128, 8, 4, 0),
            "j": (64, 64, 4, 3, 168),
            "k": (64, 64, 4, 3, 160),
            "l": (64, 64, 4, 2, 168),
            "m": (32, 64, 4, 3, 168),
            "n": (32, 64, 4, 3, 128),
            "o": (64, 64, 4, 3, 128),
            "p": (64, 64, 4, 3, 152),
        }
        combos += ["Ae", "Af", "Ag", "Ah", "Ai", "Fa", "Ga", "Ef", "Ff", "Bf",
                   "Hj", "Hk", "Hl", "Jb", "Jj", "Kj", "Jo", "Jm", "Jn", "Lj", "Mp"]  # fmt: skip
    bwd_cfgs = []
    for dq_key, kv_key in combos:
        dbm, dbn, dw, ds, dr = dq_opts[dq_key]
        kbm, kbn, kw, ks, kr = kv_opts[kv_key]
        bwd_cfgs.append(
            {
                "dq_bm": dbm,
                "dq_bn": dbn,
                "dq_warps": dw,
                "dq_stages": ds,
                "dq_maxnreg": dr,
                "kv_bm": kbm,
                "kv_bn": kbn,
                "kv_warps": kw,
                "kv_stages": ks,
                "kv_maxnreg": kr,
            }
        )
    rows_out.append(f"sweep {shape}")
    for cfg in fwd_cfgs:
        mod._CONFIG_OVERRIDE.clear()
        mod._CONFIG_OVERRIDE.update(cfg)
        try:
            ms = triton.testing.do_bench(
                lambda: forgetting_attention(q, k, v, g, prune=False),
                warmup=30,
                rep=150,
                return_mode="median",
            )
            rows_out.append(f"fwd {cfg}: {ms:.3f} ms {fl / ms / 1e9:.0f} TFLOP/s")
        except Exception as exc:
            rows_out.append(f"fwd {cfg}: failed {exc!r:.200}")
        print(rows_out[-1], flush=True)
    for cfg in bwd_cfgs:
        mod._CONFIG_OVERRIDE.clear()
        mod._CONFIG_OVERRIDE.update(cfg)
        try:
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
            o = forgetting_attention(*leaves, prune=False)
            ms = triton.testing.do_bench(
                lambda o=o, leaves=leaves: torch.autograd.grad(o, leaves, do, retain_graph=True),
                warmup=30,
                rep=150,
                return_mode="median",
            )
            rows_out.append(f"bwd {cfg}: {ms:.3f} ms {2.5 * fl / ms / 1e9:.0f} TFLOP/s")
        except Exception as exc:
            rows_out.append(f"bwd {cfg}: failed {exc!r:.200}")
        print(rows_out[-1], flush=True)
    mod._CONFIG_OVERRIDE.clear()


NO_GPU = (
    "benchmarks/attention.py times the attention kernels on a CUDA GPU (CUDA events, bf16 "
    "inputs of up to 16k tokens), and torch sees none (torch.cuda.is_available() is False): run "
    "it on a machine with an NVIDIA GPU and a CUDA build of PyTorch. On CPU, `python -m pytest "
    "tests/test_kernels.py` checks the kernel against the PyTorch reference under Triton's "
    "interpreter, and `python benchmarks/pruning.py CKPT --data DATA --device cpu` counts the "
    "tiles that pruning skips (no times)"
)


def main(argv: list[str] | None = None) -> None:
    """Command line: the kernel table (default) or the tile sweep (``--sweep``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fox-path", help="local copy of the paper's ops/forgetting_attention.py")
    ap.add_argument("--out", help="write the markdown table to this (new) file")
    ap.add_argument("--sweep", action="store_true", help="also sweep our tile configs")
    ap.add_argument("--no-table", action="store_true")
    ap.add_argument("--shapes", nargs="*", help="B,T,H,D ... (default: the four bar shapes)")
    ap.add_argument(
        "--documents",
        type=int,
        metavar="N",
        help="pack each shape's B*T tokens as one row of N documents (cu_seqlens)",
    )
    args = ap.parse_args(argv)
    shapes = [parse_shape(s) for s in args.shapes] if args.shapes else SHAPES
    if args.documents is not None:
        for B, T, _, _ in shapes:
            document_bounds(B * T, args.documents)
    if args.fox_path:
        check_fox_path(args.fox_path)
    check_out_file(args.out)
    if not torch.cuda.is_available():
        raise SystemExit(NO_GPU)
    props = torch.cuda.get_device_properties(0)
    rows = [
        f"device: {props.name}, torch {torch.__version__}, triton {triton.__version__}",
        f"fot kernels from: {Path(importlib.import_module('fot.kernels').__file__).parent}",
        f"command: python benchmarks/attention.py {' '.join(sys.argv[1:])}",
        "",
    ]
    print("\n".join(rows), flush=True)
    if args.sweep:
        # the first shape and the first one with D=64, each once
        for shape in dict.fromkeys(shapes[:1] + [s for s in shapes if s[3] == 64][:1]):
            sweep(shape, rows)
    if not args.no_table:
        run_table(args.fox_path, shapes, rows, args.documents)
    text = "\n".join(rows) + "\n"
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
