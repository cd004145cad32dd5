"""Fused kernels against the PyTorch compositions they replace, on one GPU.

    python benchmarks/fused_ops.py [--tokens 16384] [--preset 760m] [--sweep] [--out ops.md]
    python benchmarks/fused_ops.py --decode-projections [--preset 760m] [--out tiles.md]
    python benchmarks/fused_ops.py --decode-attention [--tokens 16384] [--batch-sizes 1 8]

Per op, forward + backward (gradients into every input) of:

* ``add_rms_norm``: the pre-norm step of a block under bf16 autocast, ``h = residual + x``
  (float32 stream, bf16 branch output), ``y = RMSNorm(h)`` cast to bf16 for the next GEMM,
  with gradients arriving at ``y`` (bf16) and ``h`` (float32), against ``fot.kernels.add_rms_norm``.
* ``swiglu``: ``silu(gate) * up`` on the two halves of one ``[T, 2I]`` bf16 GEMM output, against
  ``fot.kernels.swiglu``.
* ``linear_cross_entropy``: the LM head and the loss under bf16 autocast (bf16 hidden states,
  float32 head padded to a multiple of 64 rows), against the model's PyTorch chunked loss and
  against FLA's fused linear cross-entropy (when installed), ``fot.kernels.loss_ops``.

Shapes from the FoT (Pro) preset (hidden size, MLP width) at ``--tokens`` rows; the 760M model
has two norms per block and 24 blocks, so the per-step effect is ``48 x`` the ``add_rms_norm``
row. Times are medians of ``triton.testing.do_bench``; GB/s counts the bytes each fused
elementwise kernel must move (inputs read once, outputs written once), TFLOP/s the loss's three
GEMMs (``6 * T * hidden * V``).

``--decode-projections`` times, instead, the decode step's projections (1 and 8 rows, bf16, no
autograd) as ``fused_linear`` runs them: cuBLAS against ``few_rows_linear`` at each candidate
of :data:`FEW_ROWS_TILES`. Each setting is captured in one CUDA graph that runs that projection
for every layer of the model with the layer's own weights, so the weights stream from memory
as in a decode step (one layer's weights alone would stay in L2). Microseconds per layer: best
of 7 timings of 20 replays, over the layers.

``--decode-attention`` times the split-K decode attention of a cached step
(``forgetting_attention_decode`` with the output norm and gate, as a FoT (Pro) step calls it)
at each of ``--batch-sizes`` (1 and 8) over a cache of ``--tokens`` keys, one cache per layer, in a CUDA graph as
above. Settings: :data:`DECODE_ATTENTION_SETTINGS` (key spans as multiples of the launcher's
own count, keys per tile, warps, stages), each checked against the launcher's default first.
It prints the default and the fastest settings in microseconds per layer and TB/s of the
cache read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # sibling modules when imported from elsewhere
    sys.path.insert(0, str(_HERE))

from train_throughput import check_out_file  # noqa: E402

FEW_ROWS_TILES = {
    "wide": ((16, 256), (32, 128), (32, 256), (64, 256)),
    "narrow": ((16, 256), (16, 512), (16, 1024), (32, 256)),
}
"""``--decode-projections``' candidates of ``linear_ops.GPU_TILES_FEW_ROWS`` (output columns
and K per tile): ``"wide"`` for weights with at least twice as many rows in all as columns (the
fused input projections), ``"narrow"`` for the rest (the output and down projections, which a
step runs through cuBLAS)."""


DECODE_ATTENTION_SETTINGS = tuple(
    (spans, block_n, warps, stages)
    for spans in (0.5, 1, 2, 3, 4)
    for block_n in (32, 64, 128)
    for warps in (2, 4)
    for stages in (2, 3, 4)
)
"""``--decode-attention``'s candidates of ``decode._CONFIG_OVERRIDE``: key spans (a multiple
of the count the launcher picks, at least 1), keys per tile, warps, pipeline stages."""


def _norm_case(tokens: int, hidden: int, dev: str = "cuda"):
    """``(pytorch, fused, bytes)``: two closures that run forward + backward and return the
    input gradients (x, residual, weight), and the bytes the fused kernels move."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    residual = torch.randn(tokens, hidden, device=dev, generator=g)
    weight = 1 + 0.1 * torch.randn(hidden, device=dev, generator=g)
    dy = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    dh = torch.randn(tokens, hidden, device=dev, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (x, residual, weight)]

    def pytorch():
        xl, rl, wl = leaves
        h = rl + xl
        y = F.rms_norm(h, (hidden,), wl, 1e-6).to(torch.bfloat16)
        return torch.autograd.grad([y, h], leaves, [dy, dh])

    def fused():
        from fot.kernels import add_rms_norm

        y, h = add_rms_norm(*leaves, eps=1e-6, out_dtype=torch.bfloat16)
        return torch.autograd.grad([y, h], leaves, [dy, dh])

    # fwd: x (2) + residual (4) in, h (4) + y (2) out; bwd: h, dh (4 + 4), dy (2) in,
    # d residual (4) + dx (2) out: 28 bytes per element.
    return pytorch, fused, 28 * tokens * hidden


def _swiglu_case(tokens: int, width: int, dev: str = "cuda"):
    """As :func:`_norm_case`, for SwiGLU (the gradient of the ``[tokens, 2 * width]`` input)."""
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, 2 * width, device=dev, generator=g).to(torch.bfloat16)
    dy = torch.randn(tokens, width, device=dev, generator=g).to(torch.bfloat16)
    leaf = x.clone().requires_grad_(True)

    def pytorch():
        gate, up = leaf.split(width, dim=-1)
        return torch.autograd.grad(F.silu(gate) * up, leaf, dy)

    def fused():
        from fot.kernels import swiglu

        return torch.autograd.grad(swiglu(leaf), leaf, dy)

    # fwd: x (4) in, y (2) out; bwd: x (4), dy (2) in, dx (4) out: 16 bytes per output element.
    return pytorch, fused, 16 * tokens * width


def _loss_case(tokens: int, hidden: int, vocab: int, dev: str = "cuda", chunk_rows: int = 4096):
    """``(pytorch, fused, fla, flops)`` for the LM head + loss under bf16 autocast: closures that
    run forward + backward of the summed loss and return the gradients (hidden, head weight);
    ``fla`` is None without FLA (or off CUDA)."""
    from fot.kernels import linear_cross_entropy
    from fot.models.modeling_fot import PADDING_LOGIT_BIAS, _chunked_cross_entropy

    padded = -(-vocab // 64) * 64
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, hidden, device=dev, generator=g).to(torch.bfloat16)
    weight = 0.02 * torch.randn(padded, hidden, device=dev, generator=g)
    labels = torch.randint(0, vocab, (tokens,), device=dev, generator=g)
    leaves = [t.clone().requires_grad_(True) for t in (x, weight)]

    def run(loss_fn):
        def closure():
            with torch.autocast(dev, dtype=torch.bfloat16):
                loss = loss_fn(*leaves)
            return torch.autograd.grad(loss, leaves)

        return closure

    def pytorch(xl, wl):
        return _chunked_cross_entropy(xl, wl[:vocab], labels, chunk_rows).sum()

    def fused(xl, wl):
        return linear_cross_entropy(xl, wl, labels, n_classes=vocab, chunk_rows=chunk_rows)

    fla = None
    try:
        from fla.modules import FusedLinearCrossEntropyLoss
    except ImportError:
        FusedLinearCrossEntropyLoss = None
    if FusedLinearCrossEntropyLoss is not None and dev == "cuda":
        bias = torch.zeros(padded, device=dev)
        bias[vocab:] = PADDING_LOGIT_BIAS
        fla_loss = FusedLinearCrossEntropyLoss(reduction="sum")

        def fla_fn(xl, wl):
            torch.backends.cuda.matmul.allow_tf32 = True  # as the model runs it
            try:
                return fla_loss(xl, labels, wl, bias)
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False

        fla = run(fla_fn)
    return run(pytorch), run(fused), fla, 6 * tokens * hidden * padded


def run_table(tokens: int, preset: str, rows_out: list[str]) -> None:
    """Time each fused op against its eager form at ``tokens`` rows of the ``preset``
    size; the markdown rows go to ``rows_out`` and stdout."""
    from fot import presets

    cfg = presets.config("fot_pro", preset)
    cases = {
        f"add_rms_norm ({tokens} x {cfg.hidden_size})": _norm_case(tokens, cfg.hidden_size),
        f"swiglu ({tokens} x 2 x {cfg.mlp_size})": _swiglu_case(tokens, cfg.mlp_size),
    }
    rows_out += [
        "| op (fwd + bwd) | baseline | baseline (ms) | fused (ms) | speed-up | fused rate |",
        "|---|---|---|---|---|---|",
    ]

    def row(name: str, baseline: str, base_fn, fused_fn, rate) -> None:
        t_b = triton.testing.do_bench(base_fn, warmup=25, rep=200, return_mode="median")
        t_f = triton.testing.do_bench(fused_fn, warmup=25, rep=200, return_mode="median")
        rows_out.append(
            f"| {name} | {baseline} | {t_b:.3f} | {t_f:.3f} | {t_b / t_f:.2f}x | "
            + rate(t_f)
            + " |"
        )
        print(rows_out[-1], flush=True)

    for name, (pytorch, fused, nbytes) in cases.items():
        row(name, "PyTorch", pytorch, fused, lambda ms, n=nbytes: f"{n / ms / 1e6:.0f} GB/s")
    for chunk in (2048, 4096, 8192):
        pytorch, fused, fla, flops = _loss_case(
            tokens, cfg.hidden_size, cfg.vocab_size, chunk_rows=chunk
        )
        name = (
            f"linear_cross_entropy ({tokens} x {cfg.hidden_size} -> {cfg.vocab_size}, "
            f"chunks of {chunk})"
        )

        def tflops(ms: float, n: int = flops) -> str:
            return f"{n / ms / 1e9:.0f} TFLOP/s"

        row(name, "PyTorch chunked", pytorch, fused, tflops)
        if fla is not None:
            row(name, "FLA fused linear CE", fla, fused, tflops)


def sweep(tokens: int, preset: str, rows_out: list[str]) -> None:
    """Launch settings of the add + norm kernels (``norm_ops._CONFIG_OVERRIDE``)."""
    from fot import presets
    from fot.kernels import norm_ops

    hidden = presets.config("fot_pro", preset).hidden_size
    _, fused, _ = _norm_case(tokens, hidden)
    rows_out += [
        "",
        "| fwd elems / warps | bwd elems / warps / programs per SM | ms |",
        "|---|---|---|",
    ]
    for fwd in ((2048, 4), (4096, 4), (4096, 8), (8192, 8)):
        for bwd in ((2048, 4, 2), (4096, 8, 2), (4096, 8, 4), (8192, 8, 2), (8192, 16, 1)):
            norm_ops._CONFIG_OVERRIDE.clear()
            norm_ops._CONFIG_OVERRIDE.update({
                "fwd_elems": fwd[0], "fwd_warps": fwd[1], "bwd_elems": bwd[0],
                "bwd_warps": bwd[1], "bwd_programs_per_sm": bwd[2],
            })  # fmt: skip
            ms = triton.testing.do_bench(fused, warmup=25, rep=100, return_mode="median")
            rows_out.append(f"| {fwd[0]} / {fwd[1]} | {bwd[0]} / {bwd[1]} / {bwd[2]} | {ms:.3f} |")
            print(rows_out[-1], flush=True)
    norm_ops._CONFIG_OVERRIDE.clear()


def decode_projection_groups(model: torch.nn.Module) -> dict[str, list[list[torch.Tensor]]]:
    """Per projection of a FoT decode step, the weights ``fused_linear`` gets in each layer.

    Returns:
        ``{name: [[weight, ...] per layer]}`` in the step's order: ``"q/k/v/..."`` (the
        attention's input projections, as many as the config has), ``"o"``, ``"gate/up"``
        and ``"down"``.
    """
    groups: dict[str, list[list[torch.Tensor]]] = {"o": [], "gate/up": [], "down": []}
    names = ("q_proj", "k_proj", "v_proj", "g_proj", "k_shift_proj", "v_shift_proj")
    inputs = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        inputs.append([getattr(attn, n).weight for n in names if hasattr(attn, n)])
        groups["gate/up"].append([mlp.gate_proj.weight, mlp.up_proj.weight])
        groups["o"].append([attn.o_proj.weight])
        groups["down"].append([mlp.down_proj.weight])
    return {"q/k/v/" + "/".join(n[:-5] for n in names[3:] if hasattr(attn, n)): inputs, **groups}


def graph_us(fn, repeats: int = 20, trials: int = 7) -> float:
    """Microseconds of one call of ``fn`` (CUDA launches only) captured in a CUDA graph: the
    best of ``trials`` timings of ``repeats`` replays."""
    fn()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(trials):
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / repeats)
    return best


def _projection_row(
    name: str, weights: list[list[torch.Tensor]], m: int, shipped: tuple[int, int], timer, g
) -> str:
    """One ``--decode-projections`` row: ``weights`` (per layer, the weights of one fused
    projection) at ``m`` rows, cuBLAS then every candidate tile of its kind."""
    from fot.kernels import linear_ops

    n, k = sum(w.shape[0] for w in weights[0]), weights[0][0].shape[1]
    x = torch.randn(m, k, device=weights[0][0].device, generator=g).to(torch.bfloat16)
    cat = [torch.cat(ws) for ws in weights]
    want = F.linear(x.float(), cat[0].float())
    cells = [f"{timer(lambda: [F.linear(x, w) for w in cat]) / len(weights):.2f}"]
    kind = "wide" if n >= 2 * k else "narrow"
    for tiles in FEW_ROWS_TILES[kind]:
        linear_ops.GPU_TILES_FEW_ROWS = tiles
        err = (linear_ops.few_rows_linear(x, weights[0]).float() - want).abs().max().item()
        if err > 0.02 * want.abs().max().item():
            raise AssertionError(f"few_rows_linear at tiles {tiles} of {name}: error {err:.3g}")
        us = timer(lambda: [linear_ops.few_rows_linear(x, ws) for ws in weights])
        mark = "*" if tiles == shipped else ""
        cells.append(f"{tiles[0]} x {tiles[1]}{mark}: {us / len(weights):.2f}")
    return f"| {name} | {m} | {n} x {k} | {cells[0]} | {'; '.join(cells[1:])} |"


def decode_projections(
    preset: str, rows_out: list[str], *, rows: tuple[int, ...] = (1, 8), timer=graph_us
) -> None:
    """``--decode-projections``: per layer, each projection of the ``preset`` FoT (Pro) decode
    step at ``rows`` rows, cuBLAS against ``few_rows_linear`` at every :data:`FEW_ROWS_TILES`
    candidate of its kind (``*`` marks the tiles a step uses, ``GPU_TILES_FEW_ROWS``). Each
    candidate's output is checked against cuBLAS's first. ``timer(fn)`` gives microseconds of
    ``fn`` (every layer's launch)."""
    from fot import presets
    from fot.kernels import linear_ops

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = presets.build_model(presets.config("fot_pro", preset)).to(torch.bfloat16)
    shipped = linear_ops.GPU_TILES_FEW_ROWS
    rows_out += [
        "",
        "| projection | rows | N x K | cuBLAS (us/layer) | few_rows_linear at BN x BK, 4 warps (us/layer) |",
        "|---|---|---|---|---|",
    ]  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    try:
        with torch.no_grad():
            for m in rows:
                for name, weights in decode_projection_groups(model).items():
                    rows_out.append(_projection_row(name, weights, m, shipped, timer, g))
                    print(rows_out[-1], flush=True)
    finally:
        linear_ops.GPU_TILES_FEW_ROWS = shipped


def _decode_attention_inputs(cfg, batch: int, keys: int, layers: int, g) -> list[dict]:
    """Per layer, the keyword arguments of one ``forgetting_attention_decode`` call of a
    static decode step: one new query per sequence over a head-major bf16 cache of ``keys``
    positions (the last 64 masked out, as past the step's length in a cache bucket), the
    running gate cumsums, the output gate and norm weight."""
    h, hq, d = cfg.kv_heads, cfg.num_heads, cfg.hidden_size // cfg.num_heads
    dev = g.device

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=g).to(dtype)

    mask = torch.arange(keys, device=dev) < max(1, keys - 64)
    calls = []
    for _ in range(layers):
        log_f = -torch.rand(batch, keys, hq, device=dev, generator=g) * 0.05  # weak decay
        k_cumsum = torch.cumsum(log_f, dim=1)  # (B, Tk, HQ) float32
        calls.append({
            "q": randn(batch, 1, hq, d),
            "k_cache": randn(batch, h, keys, d).transpose(1, 2),  # (B, Tk, H, D), head-major
            "v_cache": randn(batch, h, keys, d).transpose(1, 2),
            "q_cumsum": k_cumsum[:, -1:].clone(), "k_cumsum": k_cumsum,
            "key_mask": mask.expand(batch, keys), "gate": randn(batch, 1, hq, d),
            "norm_weight": 1 + 0.1 * randn(hq, d, dtype=torch.float32), "norm_eps": cfg.rms_norm_eps,
        })  # fmt: skip
    return calls


def _default_launch(run) -> dict[str, int]:
    """The span kernel's launch settings the decode launcher picks for ``run()``'s calls
    (``_CONFIG_OVERRIDE`` cleared), as ``decode._span_launch`` returns them."""
    from fot.kernels import decode

    real, seen = decode._span_launch, []

    def recording(*args):
        seen.append(real(*args))
        return seen[-1]

    decode._CONFIG_OVERRIDE.clear()
    decode._span_launch = recording
    try:
        run()
    finally:
        decode._span_launch = real
    return seen[0]


def _decode_attention_rows(cfg, batch: int, keys: int, settings, best: int, timer, g) -> list[str]:
    """``--decode-attention``'s rows for one batch size: the default launch (``*``), then the
    ``best`` fastest of ``settings``, each checked against the default's output first."""
    from fot.kernels import decode

    calls = _decode_attention_inputs(cfg, batch, keys, cfg.num_hidden_layers, g)
    cache_bytes = calls[0]["k_cache"].nbytes + calls[0]["v_cache"].nbytes

    def run() -> list[torch.Tensor]:
        return [decode.forgetting_attention_decode(**c) for c in calls]

    default = _default_launch(run)
    want = run()[0].float()
    found = [(timer(run) / len(calls), ("*", *default.values()))]
    for mult, block_n, warps, stages in settings:
        spans = max(1, round(mult * default["splits"]))
        decode._CONFIG_OVERRIDE.clear()
        decode._CONFIG_OVERRIDE.update(
            {"splits": spans, "block_n": block_n, "warps": warps, "stages": stages}
        )
        err = (run()[0].float() - want).abs().max().item()
        if err > 0.02 * want.abs().max().item():
            raise AssertionError(
                f"decode attention at {spans} spans, block_n {block_n}, {warps} warps, "
                f"{stages} stages: error {err:.3g} against the default launch"
            )
        found.append((timer(run) / len(calls), ("", spans, block_n, warps, stages)))
    decode._CONFIG_OVERRIDE.clear()
    return [
        f"| {batch} | {keys} | {spans}{mark} | {block_n} | {warps} | {stages} | {us:.2f} | "
        f"{cache_bytes / us / 1e6:.2f} |"
        for us, (mark, spans, block_n, warps, stages) in [
            found[0],
            *sorted(found[1:], key=lambda f: f[0])[:best],
        ]
    ]


def decode_attention(
    preset: str,
    keys: int,
    rows_out: list[str],
    *,
    batches: tuple[int, ...] = (1, 8),
    settings: tuple[tuple[float, int, int, int], ...] = DECODE_ATTENTION_SETTINGS,
    best: int = 12,
    timer=graph_us,
) -> None:
    """``--decode-attention``: per layer, ``forgetting_attention_decode`` of the ``preset``
    FoT (Pro) model at each batch of ``batches`` over ``keys`` cached keys (bf16), for the
    launcher's default and each of ``settings``, checked against the default's output. Adds
    the default row (``*``) and the ``best`` fastest settings to ``rows_out``. ``timer(fn)``
    gives microseconds of ``fn`` (every layer's call)."""
    from fot import presets
    from fot.kernels import decode

    cfg = presets.config("fot_pro", preset)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out += [
        "",
        "| batch | keys | spans | keys per tile | warps | stages | us/layer | TB/s of the cache |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    saved = dict(decode._CONFIG_OVERRIDE)
    try:
        with torch.no_grad():
            for batch in batches:
                for row in _decode_attention_rows(cfg, batch, keys, settings, best, timer, g):
                    rows_out.append(row)
                    print(row, flush=True)
    finally:
        decode._CONFIG_OVERRIDE.clear()
        decode._CONFIG_OVERRIDE.update(saved)


def main(argv: list[str] | None = None) -> None:
    """CLI entry point (see the module docstring)."""
    from fot import presets

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tokens",
        type=int,
        default=16384,
        help="rows (batch x sequence length); --decode-attention: cached keys",
    )
    ap.add_argument(
        "--preset", default="760m", choices=presets.SIZES, help="FoT (Pro) size for the widths"
    )
    ap.add_argument("--sweep", action="store_true", help="also sweep add_rms_norm launches")
    ap.add_argument(
        "--decode-projections",
        action="store_true",
        help="instead: the decode step's projections, cuBLAS against few_rows_linear's tiles",
    )
    ap.add_argument(
        "--decode-attention",
        action="store_true",
        help="instead: the decode attention's launch settings over a cache of --tokens keys",
    )
    ap.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[1, 8],
        help="--decode-attention: the batch sizes (sequences) to time",
    )
    ap.add_argument("--out", help="write the markdown table to this (new) file")
    args = ap.parse_args(argv)
    if args.tokens < 1:
        ap.error(f"--tokens must be >= 1, got {args.tokens}")
    if min(args.batch_sizes) < 1:
        ap.error(f"--batch-sizes must be >= 1, got {min(args.batch_sizes)}")
    modes = [flag for flag, on in (("--decode-projections", args.decode_projections),
                                   ("--decode-attention", args.decode_attention)) if on]  # fmt: skip
    if len(modes) > 1:
        ap.error("--decode-projections and --decode-attention are separate runs: give one")
    if modes and args.sweep:
        ap.error("--sweep times the add + norm kernels of the fused-op table; run it without "
                 f"{modes[0]}")  # fmt: skip
    check_out_file(args.out)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fused_ops.py needs a CUDA GPU (the kernels are timed compiled)")
    rows: list[str] = [f"device: {torch.cuda.get_device_name()}", ""]
    if args.decode_projections:
        decode_projections(args.preset, rows)
    elif args.decode_attention:
        decode_attention(args.preset, args.tokens, rows, batches=tuple(args.batch_sizes))
    else:
        run_table(args.tokens, args.preset, rows)
    if args.sweep:
        sweep(args.tokens, args.preset, rows)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
