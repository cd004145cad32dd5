"""Benchmark scripts (``benchmarks/train_throughput.py``, ``decode.py``, ``flops.py``, ``fused_ops.py``,
``pruning.py``, ``attention.py``) on CPU.

Oracles: FLOPs against a hand count of the weights of a tiny config and a brute-force count of
the causal (query, key) pairs; the scripts' reported numbers against their own timings; greedy
decoding with the cache against argmax of a full forward without cache (teacher forcing).

Where a script's own start-up matters (which device it may use, whether Triton's interpreter is
on), it runs as a user runs it: a fresh ``python benchmarks/...`` process without the
``TRITON_INTERPRET=1`` that conftest sets for this process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """The benchmark modules (``benchmarks/`` is a folder of scripts, not a package)."""
    names = ("flops", "train_throughput", "decode", "scaling", "pruning", "fused_ops", "attention",
             "data_read", "optimizer_step")  # fmt: skip
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name) for name in names}
    finally:
        sys.path.remove(str(BENCH))
        for name in names:  # generic top-level names: do not leak them to other tests
            sys.modules.pop(name, None)


def _run_script(args: list[str], **env: str) -> subprocess.CompletedProcess:
    """``python ARGS`` in a fresh process, without ``TRITON_INTERPRET`` (plus ``env``)."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**base, **env},
        cwd=BENCH.parent,
        timeout=300,
    )


def _causal_pairs(T: int) -> int:
    return int(torch.tril(torch.ones(T, T)).sum())


# ---------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 5, 64, 100])
@pytest.mark.parametrize("window", [None, 1, 7, 64, 200])
def test_attention_pairs_count_the_mask(length, window):
    """Pairs the trainer's FLOP count uses, against the mask itself: causal, and a sliding
    window of ``window`` keys (``i - window < j <= i``)."""
    from fot.training.metrics import attention_pairs

    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    assert attention_pairs(length, window) == int(mask.sum())


def test_flop_counter_of_a_varlen_batch_sums_its_documents():
    """A varlen micro batch counts each document's causal pairs; a [B, T] batch B full rows."""
    from fot.data.streams import Batch
    from fot.training.metrics import FlopCounter

    counter = FlopCounter(params=1000, attn_layers=2, d_attn=8, window=None)
    ids = torch.zeros(1, 20, dtype=torch.long)
    docs = Batch(ids, ids, torch.tensor([0, 3, 10, 20], dtype=torch.int32), seq_len=10)
    pairs = 3 * 4 / 2 + 7 * 8 / 2 + 10 * 11 / 2
    assert counter.of_batch(docs) == 6 * 1000 * 20 + 12 * 2 * 8 * pairs
    rows = Batch(ids.reshape(2, 10), ids.reshape(2, 10), None, seq_len=10)
    assert counter.of_batch(rows) == 6 * 1000 * 20 + 12 * 2 * 8 * (2 * 55)


def test_flops_hand_count_fot_llama_tiny(bench):
    from fot import presets

    cfg = presets.config("fot_llama", "tiny")  # hidden 128, 2 layers, 4 heads, MLP 512
    with torch.device("meta"):
        model = presets.build_model(cfg)
    d, L, H, mlp, T = 128, 2, 4, 512, 128
    v_padded = 50304  # 50257 rounded up to a multiple of 64
    per_layer = (
        4 * d * d  # q, k, v, o projections
        + d * H
        + H  # forget-gate projection and bias
        + 3 * d * mlp  # SwiGLU gate, up, down
        + 2 * d  # two RMSNorm weights
    )
    n = L * per_layer + d + v_padded * d  # + final norm + untied LM head (no input embedding)
    # q k^T and p v: 2 * 2 * d FLOPs per causal (query, key) pair, x3 with backward
    attn = 3 * 2 * 2 * d * L * _causal_pairs(T) / T
    expected = 6 * n + attn
    got = bench["flops"].train_flops_per_token(model, cfg, T)
    assert got == pytest.approx(expected, rel=1e-12)
    parts = bench["flops"].flops_breakdown(model, cfg, T)
    assert parts["lm_head"] == 6 * v_padded * d
    assert parts["attention"] == pytest.approx(attn, rel=1e-12)
    assert parts["blocks"] + parts["lm_head"] + parts["attention"] == pytest.approx(got)


def test_flops_count_samba_attention_layers_as_the_trainer(bench):
    """A hybrid (FLA's Samba) names its sliding-window attention layers in ``config.attn``:
    counted by hand, 12 d per (query, key) pair within the window, in those layers only."""
    from types import SimpleNamespace

    from torch import nn

    class Hybrid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.body = nn.Linear(32, 32, bias=False)
            self.head = nn.Linear(32, 64, bias=False)

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

        def get_output_embeddings(self) -> nn.Module:
            return self.head

    d, W, T = 32, 16, 100
    cfg = SimpleNamespace(
        model_type="samba",
        hidden_size=d,
        num_hidden_layers=4,
        attn={"layers": [1, 3], "num_heads": 4, "window_size": W},
    )
    pairs = W * (W + 1) / 2 + (T - W) * W  # causal pairs with a window of W keys
    expected = 6 * (32 * 32 + 64 * 32) + 12 * 2 * d * pairs / T
    got = bench["flops"].train_flops_per_token(Hybrid(), cfg, T)
    assert got == pytest.approx(expected, rel=1e-12)


def test_flops_hand_count_hf_llama_and_fla_spec(bench):
    from transformers import LlamaForCausalLM

    cfg = bench["train_throughput"].hf_llama_config("tiny")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    d, L, mlp, V, T = 128, 2, 512, 50257, 256
    n = L * (4 * d * d + 3 * d * mlp + 2 * d) + d + V * d
    expected = 6 * n + 3 * 2 * 2 * d * L * _causal_pairs(T) / T
    assert bench["flops"].train_flops_per_token(model, cfg, T) == pytest.approx(expected, rel=1e-12)
    # heads x head_dim, not hidden, is the attention width
    cfg8 = bench["train_throughput"].hf_llama_config("tiny", num_heads=8)
    assert bench["flops"].attention_spec(cfg8) == (2, 128, None)
    fla_cfg = bench["train_throughput"].fla_fot_config("tiny", on_cuda=False)
    assert bench["flops"].attention_spec(fla_cfg) == (2, 128, None)
    assert (fla_cfg.hidden_size, fla_cfg.num_heads, fla_cfg.intermediate_size) == (128, 4, 512)


def test_flops_hand_count_pro_transformer_and_fla(bench):
    """The other benchmarked models, counted by hand from the tiny dimensions (d 128, 2 layers,
    4 heads of 32, MLP 512). Convention: 2 FLOPs per weight and token forward, 4 backward; norm
    weights and biases are counted as weights too (6 per token each: elementwise, ~0.1% of the
    tiny model); the SwiGLU product, softmax, gate cumsum and RoPE count nothing."""
    d, L, H, mlp, T, V, v_padded = 128, 2, 4, 512, 96, 50257, 50304
    attn = 3 * 2 * 2 * d * L * _causal_pairs(T) / T  # q k^T and p v, x3 with backward
    llama = 4 * d * d + 3 * d * mlp + 2 * d  # q, k, v, o; SwiGLU gate, up, down; two norms
    gate = d * H + H  # forget-gate projection and bias
    pro = 2 * d * H + 3 * d + d * d  # k/v-shift projections; q, k, o norms per head; W_g
    per_layer = {
        "fot_pro": llama + gate + pro,
        "transformer_llama": llama,
        "transformer_pro": llama + pro,
        "fla_fot": llama + gate,
    }
    for name, layer in per_layer.items():
        model, cfg, _ = bench["train_throughput"].build(
            name, "tiny", device=torch.device("meta"), seq_len=T
        )
        head = (V if name == "fla_fot" else v_padded) * d  # FLA does not pad the vocabulary
        n = L * layer + d + head  # + final norm + untied LM head (no input embedding)
        got = bench["flops"].flops_breakdown(model, cfg, T)
        want = {"blocks": 6 * (n - head), "lm_head": 6 * head, "attention": attn}
        assert got == pytest.approx({**want, "total": sum(want.values())}, rel=1e-12), name


@pytest.mark.parametrize(
    "name", ["fot_pro", "fot_llama", "transformer_pro", "transformer_llama", "hf_llama"]
)
def test_flops_match_torch_flop_counter(bench, monkeypatch, name):
    """The formula against ``torch.utils.flop_counter.FlopCounterMode`` over one forward +
    backward of the tiny model on the CPU (reference attention, HF Llama's eager attention):
    its matmul FLOPs plus the formula's stated conventions give the formula's count exactly.

    Conventions: the recomputation in backward (the reference attention's and the chunked
    loss's activation checkpoints) is not model FLOPs, so checkpoints run as plain calls here;
    the reference attention multiplies the whole T x T square, the formula the causal half with
    the diagonal (``(T + 1) / (2 T)`` of it); norm weights and biases count 6 FLOPs per token
    each; our LM head counts its rows padded to a multiple of 64 (the CUDA loss multiplies them;
    the CPU loss slices them off)."""
    from torch.utils.flop_counter import FlopCounterMode

    import fot.kernels.reference
    import fot.models.modeling_fot

    def plain_call(fn, *args, use_reentrant=None, **kwargs):
        return fn(*args, **kwargs)

    monkeypatch.setattr(fot.kernels.reference, "checkpoint", plain_call)
    monkeypatch.setattr(fot.models.modeling_fot, "checkpoint", plain_call)
    T = 48
    model, cfg, loss_fn = bench["train_throughput"].build(
        name, "tiny", device=torch.device("cpu"), seq_len=T
    )
    if name == "hf_llama":
        model.config._attn_implementation = "eager"  # matmuls FlopCounterMode sees
    ids = torch.randint(0, 50257, (1, T), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter:
        loss_fn(model, ids, ids.roll(-1, 1)).backward()
    ops = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    assert set(ops) <= {"aten.mm", "aten.addmm", "aten.bmm"}, ops
    weights = ops["aten.mm"] + ops.get("aten.addmm", 0)
    not_matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() < 2 or "norm" in n)
    pad_rows = model.get_output_embeddings().weight.shape[0] - 50257
    expected = (
        weights / T
        + 6 * not_matmul
        + 6 * pad_rows * cfg.hidden_size
        + ops["aten.bmm"] / T * (T + 1) / (2 * T)
    )
    assert bench["flops"].train_flops_per_token(model, cfg, T) == pytest.approx(expected, rel=1e-12)


def test_flops_count_a_tied_lm_head(bench):
    """An LM head tied to the input embedding (``tie_word_embeddings=True``, e.g. an FLA
    baseline's override) still multiplies every token by the [V, d] weight: its count was
    dropped with the input embedding (mamba2 tiny: 2.5 instead of 41.1 MFLOP per token, MFU
    16x too low). Against ``FlopCounterMode`` over a forward + backward of a tiny tied model,
    and against the same model untied."""
    from types import SimpleNamespace

    from torch import nn
    from torch.utils.flop_counter import FlopCounterMode

    from fot.training.metrics import FlopCounter

    V, d, T = 96, 16, 8

    class Tiny(nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.embed = nn.Embedding(V, d)
            self.body = nn.Linear(d, d, bias=False)
            self.head = nn.Linear(d, V, bias=False)
            if tied:
                self.head.weight = self.embed.weight

        def get_input_embeddings(self) -> nn.Module:
            return self.embed

        def get_output_embeddings(self) -> nn.Module:
            return self.head

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(self.embed(ids)))

    cfg = SimpleNamespace(model_type="mamba2", hidden_size=d)
    tied, untied = Tiny(tied=True), Tiny(tied=False)
    counter = FlopCounterMode(display=False)
    with counter:
        tied(torch.arange(T)[None]).sum().backward()
    assert counter.get_total_flops() / T == 6 * (d * d + V * d)
    for model in (tied, untied):
        assert FlopCounter.of(model, cfg).of_documents([T]) / T == 6 * (d * d + V * d)
        parts = bench["flops"].flops_breakdown(model, cfg, T)
        assert parts == {
            "blocks": 6 * d * d,
            "lm_head": 6 * V * d,
            "attention": 0,
            "total": 6 * (d * d + V * d),
        }


def test_flops_script_prints_the_hand_count(bench, capsys):
    """``python benchmarks/flops.py`` printed nothing (a module with no entry point); it now
    prints the split of the hand count of the tiny FoT LLaMA (the test above)."""
    d, L, H, mlp, T, v_padded = 128, 2, 4, 512, 64, 50304
    blocks = 6 * L * (4 * d * d + d * H + H + 3 * d * mlp + 2 * d) + 6 * d  # + final norm
    attn = 3 * 2 * 2 * d * L * _causal_pairs(T) / T
    parts = bench["flops"].main(["--size", "tiny", "--seq-len", str(T), "--models", "fot_llama"])
    want = {"blocks": blocks, "lm_head": 6 * v_padded * d, "attention": attn}
    assert parts["fot_llama"] == pytest.approx({**want, "total": sum(want.values())}, rel=1e-12)
    row = f"| fot_llama | {(blocks / 6 + v_padded * d) / 1e6:.1f}M | {blocks / 1e9:.3f} |"
    assert row in capsys.readouterr().out
    res = _run_script([str(BENCH / "flops.py"), "--help"])
    assert res.returncode == 0 and "--seq-len" in res.stdout, res.stderr[-2000:]


def test_hf_llama_matches_fot_llama_size(bench):
    from transformers import LlamaForCausalLM

    from fot import presets

    cfg = bench["train_throughput"].hf_llama_config("760m")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (
        1536,
        24,
        24,
        64,
    )
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
        ours = presets.build_model(presets.config("fot_llama", "760m"))
    # same up to the forget gate (24 x (1536 x 24 + 24)) and our vocab padding (47 rows)
    diff = presets.count_params(ours) - presets.count_params(hf)
    assert diff == 24 * (1536 * 24 + 24) + 47 * 1536


# ---------------------------------------------------------------------------------------
# Training throughput
# ---------------------------------------------------------------------------------------

TOY = ["--device", "cpu", "--size", "tiny", "--seq-len", "64", "--steps", "2", "--warmup", "1"]


def test_train_throughput_cpu(bench, tmp_path, capsys):
    tt = bench["train_throughput"]
    out = tmp_path / "res.json"
    models = "fot_pro,transformer_llama,hf_llama"
    args = [*TOY, "--models", models, "--peak-tflops", "0.5", "--lr", "1e-3", "--out", str(out)]
    payload = tt.main(args)
    rows = {r["model"]: r for r in payload["results"]}
    assert list(rows) == models.split(",")
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(payload["results"]))
    for name, r in rows.items():
        assert r["status"] == "ok", r
        assert r["tokens_per_step"] == 64
        # tokens/s is the timed tokens over the timed time
        assert r["tokens_per_s"] * r["step_time_ms_mean"] / 1e3 == pytest.approx(64, rel=1e-6)
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / 0.5e12)
        # random init: loss near ln(V); AdamW steps at LR 1e-3 on the same batch lower it
        assert abs(r["loss_first"] - math.log(50257)) < 0.5, name
        assert r["loss_last"] < r["loss_first"] - 1e-3, name
        assert r["vs_hf_llama"] == pytest.approx(
            r["tokens_per_s"] / rows["hf_llama"]["tokens_per_s"]
        )
        assert r["vs_fla_fot"] is None  # FLA FoT not in this run
    assert rows["fot_pro"]["attn_impl"] == "reference"  # CPU falls back automatically
    assert rows["fot_pro"]["loss_impl"] == "chunked"
    assert rows["hf_llama"]["attn_impl"] == "sdpa"
    table = capsys.readouterr().out.rstrip().splitlines()
    assert table[-5].startswith("| model | status |")
    assert table[-1].startswith("| hf_llama | ok |") and "1.00×" in table[-1]


def test_train_throughput_reports_oom_and_errors(bench, monkeypatch, capsys):
    tt = bench["train_throughput"]
    real_build = tt.build

    def fake_build(name, *args, **kwargs):
        if name == "fot_llama":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")
        if name == "transformer_pro":
            raise ValueError("broken on purpose")
        return real_build(name, *args, **kwargs)

    monkeypatch.setattr(tt, "build", fake_build)
    payload = tt.main([*TOY, "--steps", "1", "--models", "fot_llama,transformer_pro,hf_llama"])
    status = {r["model"]: r["status"] for r in payload["results"]}
    assert status == {"fot_llama": "OOM", "transformer_pro": "error", "hf_llama": "ok"}
    assert "9.00 GiB" in payload["results"][0]["error"]
    assert "broken on purpose" in payload["results"][1]["error"]
    out = capsys.readouterr().out
    assert "| fot_llama | OOM: CUDA out of memory" in out


def test_train_throughput_fla_fot(bench, device):
    """FLA's model runs on ``device`` (conftest: CUDA on a GPU machine, where FLA's compiled
    kernels cannot read CPU tensors; else CPU under the Triton interpreter) and is counted like
    ours."""
    payload = bench["train_throughput"].main(
        [*TOY, "--device", device.type, "--steps", "1", "--warmup", "0",
         "--models", "fla_fot,fot_llama"]
    )  # fmt: skip
    fla, ours = payload["results"]
    assert fla["status"] == "ok", fla
    assert fla["flops_breakdown"]["attention"] == ours["flops_breakdown"]["attention"] > 0
    assert ours["vs_fla_fot"] == pytest.approx(ours["tokens_per_s"] / fla["tokens_per_s"])


def test_train_throughput_fot_override(bench):
    over = ["--fot-override", "loss_impl=chunked", "--fot-override", "loss_chunk_size=16"]
    payload = bench["train_throughput"].main([*TOY, "--steps", "1", "--models", "fot_llama", *over])
    (row,) = payload["results"]
    assert row["status"] == "ok" and row["loss_impl"] == "chunked"
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        bench["train_throughput"].main([*TOY, "--fot-override", "loss_impl"])


def test_train_throughput_default_lr_freezes_the_model(bench):
    """By default the AdamW step runs at LR 0: every step sees the model as built, so the loss
    of the repeated batch is the same at the first and the last step (it falls at LR 1e-3,
    test above)."""
    payload = bench["train_throughput"].main([*TOY, "--models", "fot_pro"])
    r = payload["results"][0]
    assert r["status"] == "ok" and r["loss_last"] == r["loss_first"]
    assert payload["meta"]["args"]["lr"] == 0.0


def test_train_throughput_bad_args(bench):
    with pytest.raises(SystemExit, match="valid: fot_pro"):
        bench["train_throughput"].main([*TOY, "--models", "fot_pro,gpt5"])
    with pytest.raises(SystemExit, match="--models names fot_llama more than once; list each"):
        bench["train_throughput"].main([*TOY, "--models", "fot_llama,hf_llama,fot_llama"])
    with pytest.raises(SystemExit, match="--seq-len must be >= 1"):
        bench["train_throughput"].main([*TOY, "--seq-len", "0"])
    with pytest.raises(SystemExit, match="--lr must be a finite number >= 0"):
        bench["train_throughput"].main([*TOY, "--lr", "-1"])
    with pytest.raises(SystemExit, match="--cuda-graphs needs a CUDA device"):
        bench["train_throughput"].main([*TOY, "--cuda-graphs"])


def _stub_row(name: str, *args, **kwargs) -> dict:
    return {"model": name, "status": "error", "error": "stub"}


def test_train_throughput_fla_fot_on_cpu_without_interpreter(bench, monkeypatch):
    """FLA's (and our) Triton kernels cannot read CPU tensors without Triton's interpreter: the
    default model list leaves fla_fot out on CPU (the docstring's CPU example printed a Triton
    traceback for it), and asking for it, or for --fot-backend triton, stops with the fix
    before anything is built. Under the interpreter (conftest) the default keeps it."""
    tt = bench["train_throughput"]
    monkeypatch.setattr(tt, "run_one", _stub_row)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # as conftest sets it on a machine without GPU
    with_interp = [r["model"] for r in tt.main([*TOY])["results"]]
    assert with_interp == list(tt.ALL_MODELS)
    monkeypatch.delenv("TRITON_INTERPRET")
    rows = [r["model"] for r in tt.main([*TOY])["results"]]
    assert rows == [m for m in tt.ALL_MODELS if m != "fla_fot"]
    with pytest.raises(SystemExit, match="drop fla_fot from --models"):
        tt.main([*TOY, "--models", "hf_llama,fla_fot"])
    with pytest.raises(SystemExit, match="use --fot-backend auto or reference"):
        tt.main([*TOY, "--models", "fot_pro", "--fot-backend", "triton"])


def test_train_throughput_fla_fot_under_the_interpreter_as_a_user_runs_it(tmp_path):
    """``TRITON_INTERPRET=1 python benchmarks/train_throughput.py --device cpu ...`` keeps
    fla_fot in the default list (test above), but its row was ``error: RuntimeError: 0 active
    drivers`` (FLA's autotuner timed its configs on a GPU driver; only the test suite's
    conftest turned that off). The script now turns it off itself: the row is measured, with
    the same parameters as FLA's model has by hand (as fot_llama's, without the forget gate's
    and the vocabulary padding)."""
    out = tmp_path / "res.json"
    res = _run_script(
        [str(BENCH / "train_throughput.py"), *TOY, "--steps", "1", "--warmup", "0",
         "--models", "fla_fot", "--out", str(out)],
        TRITON_INTERPRET="1",
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (row,) = json.loads(out.read_text())["results"]
    assert row["status"] == "ok", row.get("error")
    d, L, mlp, V = 128, 2, 512, 50257
    assert (
        row["params_non_embedding"] == L * (4 * d * d + 3 * d * mlp + 2 * d + 4 * d + 4) + d + V * d
    )


def test_train_throughput_more_bad_args(bench, monkeypatch):
    """Counts that were accepted and then ignored or turned into nonsense (MFU of a peak of
    0 TFLOP/s, a negative profile length, 0 heads read as "the default")."""
    tt = bench["train_throughput"]
    monkeypatch.setattr(tt, "run_one", _stub_row)
    for flag, value, msg in (
        ("--peak-tflops", "0", "--peak-tflops must be a number > 0, got 0.0"),
        ("--peak-tflops", "-5", "--peak-tflops must be a number > 0, got -5.0"),
        ("--profile", "-1", "--profile must be >= 0"),
        ("--hf-llama-heads", "0", "--hf-llama-heads must be >= 1, got 0"),
    ):
        with pytest.raises(SystemExit, match=msg):
            tt.main([*TOY, "--models", "hf_llama", flag, value])


def test_train_throughput_peak_matches_the_precision(bench, monkeypatch, capsys):
    """MFU's peak is the device's bf16 one (H100: 989 TFLOP/s, NVIDIA's dense figure) for the
    bf16 runs only. ``--precision fp32`` divided fp32 matmul FLOP/s by it too (MFU ~15x too low
    on an H100, whose fp32 peak is 67): now no MFU unless ``--peak-tflops`` says the peak; an
    unknown GPU gets none either, and says so. (A faked CUDA device, measurement stubbed.)"""
    tt = bench["train_throughput"]
    monkeypatch.setattr(tt, "run_one", lambda name, s: _stub_row(name) | {"peak": s.peak_flops})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # main() sets it where it is unset
    gpu = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)

    def peak(*flags: str) -> float | None:
        return tt.main(["--device", "cuda", "--models", "hf_llama", *flags])["results"][0]["peak"]

    assert peak() == peak("--precision", "bf16") == peak("--precision", "autocast") == 989e12
    assert peak("--precision", "fp32") is None
    assert "989 TFLOP/s is this device's bf16 peak" in capsys.readouterr().out
    assert peak("--precision", "fp32", "--peak-tflops", "67") == 67e12
    gpu = "NVIDIA Future GPU"
    assert peak() is None
    assert "no peak FLOP/s known for this device" in capsys.readouterr().out


DECODE_TOY = ["--device", "cpu", "--size", "tiny", "--models", "hf_llama", "--context", "8",
              "--new-tokens", "1"]  # fmt: skip


# pruning.py runs in-process here: on CPU only under the interpreter conftest turns on without
# a GPU; on a GPU machine this process compiled Triton for the GPU, so the GPU it is
PRUNING_DEVICE = [
    "--device",
    "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda",
]


def test_out_file_of_an_earlier_run_is_kept(bench, tmp_path, monkeypatch):
    """``--out`` naming an existing file (an earlier run's results) or a folder is refused
    before anything is measured or loaded; the file is untouched. Before, train_throughput and
    decode overwrote it after the first model, pruning after the run, and a folder failed
    after the first measurement."""
    old = tmp_path / "old.json"
    old.write_text('{"results": ["measured on a GPU"]}')
    tt = bench["train_throughput"]
    monkeypatch.setattr(tt, "run_one", _stub_row)
    calls = {
        "train_throughput": lambda out: tt.main([*TOY, "--models", "hf_llama", "--out", out]),
        "decode": lambda out: bench["decode"].main([*DECODE_TOY, "--out", out]),
        "pruning": lambda out: bench["pruning"].main(
            ["no-such-checkpoint", "--data", "no-such-data", *PRUNING_DEVICE, "--out", out]
        ),
        "attention": lambda out: bench["attention"].main(["--out", out]),
        "fused_ops": lambda out: bench["fused_ops"].main(["--out", out]),
    }
    for script, call in calls.items():
        with pytest.raises(SystemExit, match=f"--out {old} exists"):
            call(str(old))
        with pytest.raises(SystemExit, match=f"--out {tmp_path} is a folder"):
            call(str(tmp_path))
        assert old.read_text() == '{"results": ["measured on a GPU"]}', script


def test_results_files_are_standard_json(bench, tmp_path):
    """``--out`` files held ``"peak_mem_gib": NaN`` on CPU (and a NaN loss where training
    diverged): not JSON, which strict parsers (JavaScript's, Go's, serde) refuse. Memory that
    is not measured is now ``null``, and so is any non-finite number."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")

    train, dec = tmp_path / "train.json", tmp_path / "decode.json"
    bench["train_throughput"].main(
        [*TOY, "--steps", "1", "--models", "hf_llama", "--out", str(train)]
    )
    bench["decode"].main([*DECODE_TOY, "--batch-sizes", "1", "--out", str(dec)])
    for path in (train, dec):
        (row,) = json.loads(path.read_text(), parse_constant=refuse)["results"]
        assert row["status"] == "ok" and row["peak_mem_gib"] is None, row
    diverged = tmp_path / "diverged.json"
    row = {"model": "x", "loss_last": float("nan"), "steps": [1.0, float("inf")]}
    bench["train_throughput"].write_json(diverged, {"results": [row]})
    got = json.loads(diverged.read_text(), parse_constant=refuse)["results"]
    assert got == [{"model": "x", "loss_last": None, "steps": [1.0, None]}]


def test_train_throughput_ctrl_c_keeps_finished_rows(bench, tmp_path, monkeypatch, capsys):
    """Ctrl-C during a model: the rows finished before it stay in ``--out``, the table of them
    is printed, and the exit status is 130 (before: a traceback from inside the model)."""
    tt = bench["train_throughput"]

    def run_one(name, s):
        if name == "fot_llama":
            raise KeyboardInterrupt
        return _stub_row(name)

    monkeypatch.setattr(tt, "run_one", run_one)
    out = tmp_path / "res.json"
    with pytest.raises(SystemExit) as exit_:  # a KeyboardInterrupt escaping main() fails too
        tt.main([*TOY, "--models", "hf_llama,fot_llama,fot_pro", "--out", str(out)])
    assert exit_.value.code == 130
    assert [r["model"] for r in json.loads(out.read_text())["results"]] == ["hf_llama"]
    text = capsys.readouterr().out
    assert f"interrupted (Ctrl-C) during fot_llama: 1 finished result(s) kept (in {out})" in text
    assert "| hf_llama | error: stub |" in text and "| fot_pro |" not in text


# ---------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fot_pro", "hf_llama"])
def test_greedy_decode_matches_full_forward(bench, name):
    torch.manual_seed(0)
    model, _, _ = bench["train_throughput"].build(
        name, "tiny", device=torch.device("cpu"), seq_len=64
    )
    model.eval()
    prompt = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(0))
    res = bench["decode"].greedy_decode(model, prompt, 5)
    tokens = res["tokens"]
    assert tokens.shape == (2, 6)
    seq = torch.cat([prompt, tokens[:, :-1]], dim=1)  # teacher forcing, no cache
    with torch.no_grad():
        logits = model(input_ids=seq).logits  # (2, 25, V)
    assert torch.equal(logits[:, 19:].argmax(-1), tokens)
    assert res["prefill_s"] > 0 and res["decode_s"] > 0


def test_decode_cpu(bench, tmp_path):
    out = tmp_path / "decode.json"
    payload = bench["decode"].main(
        [
            "--device",
            "cpu",
            "--size",
            "tiny",
            "--context",
            "32",
            "--new-tokens",
            "3",
            "--batch-sizes",
            "1",
            "2",
            "1",  # a repeat is measured once (helper-179: twice, and HF at "0.70x HF Llama")
            "--fot-cache",
            "graphs,eager,graphs",
            "--out",
            str(out),
        ]
    )
    rows = payload["results"]
    assert [(r["model"], r["cache"], r["batch_size"]) for r in rows] == [
        ("fot_pro", "fixed", 1),  # --fot-cache graphs: no CUDA graphs on the CPU
        ("fot_pro", "eager", 1),
        ("fot_pro", "fixed", 2),
        ("fot_pro", "eager", 2),
        ("hf_llama", "default", 1),
        ("hf_llama", "default", 2),
    ]
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(rows))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch_size"] * 3 / r["decode_s"])
        assert r["ms_per_step"] == pytest.approx(1e3 * r["decode_s"] / 3)
        assert 0 < r["first_step_s"] < r["decode_s"]
        assert r["ms_per_later_step"] == pytest.approx(
            1e3 * (r["decode_s"] - r["first_step_s"]) / 2
        )
        hf = next(
            x for x in rows if x["model"] == "hf_llama" and x["batch_size"] == r["batch_size"]
        )
        assert r["vs_hf_llama"] == pytest.approx(
            r["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
        )
        # the fixed-capacity steps predict what the growing cache predicts
        same = [x for x in rows if x["model"] == r["model"] and x["batch_size"] == r["batch_size"]]
        assert all(x["first_tokens"] == r["first_tokens"] for x in same)


def test_decode_triton_backend_on_cpu_says_the_fix(bench, monkeypatch):
    """Our Triton kernels cannot run on CPU tensors (no interpreter): the script stops before
    building anything and names the CPU backends, instead of an error row per measurement."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit, match="use --fot-backend auto or reference"):
        bench["decode"].main(["--device", "cpu", "--size", "tiny", "--fot-backend", "triton",
                              "--context", "8", "--new-tokens", "1", "--batch-sizes", "1"])  # fmt: skip


def test_decode_refuses_a_head_count_below_one(bench):
    with pytest.raises(SystemExit, match=r"--hf-llama-heads must be >= 1 .*got 0"):
        bench["decode"].main([*DECODE_TOY, "--hf-llama-heads", "0"])


def test_decode_ctrl_c_keeps_finished_rows(bench, tmp_path, monkeypatch, capsys):
    """As for train_throughput: Ctrl-C in the second measurement keeps the first in ``--out``
    and exits with 130."""
    decode = bench["decode"]
    calls = []

    def measure(model, name, **kwargs):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return _stub_row(name)

    monkeypatch.setattr(decode, "measure", measure)
    out = tmp_path / "d.json"
    with pytest.raises(SystemExit) as exit_:  # a KeyboardInterrupt escaping main() fails too
        decode.main([*DECODE_TOY, "--batch-sizes", "1", "2", "--out", str(out)])
    assert exit_.value.code == 130
    rows = json.loads(out.read_text())["results"]
    assert [(r["model"], r["batch_size"]) for r in rows] == [("hf_llama", 1)]
    assert (
        "interrupted (Ctrl-C) during hf_llama: 1 finished result(s) kept" in capsys.readouterr().out
    )


# ---------------------------------------------------------------------------------------
# Attention kernels (a GPU benchmark)
# ---------------------------------------------------------------------------------------


def test_attention_benchmark_without_gpu_says_what_it_needs():
    """Without a visible GPU, ``benchmarks/attention.py`` stops at once with what it needs and
    what runs on CPU instead (no traceback from ``torch.cuda``)."""
    res = _run_script([str(BENCH / "attention.py")], CUDA_VISIBLE_DEVICES="")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "on a CUDA GPU" in res.stderr and "torch.cuda.is_available() is False" in res.stderr
    assert "python -m pytest tests/test_kernels.py" in res.stderr
    assert "benchmarks/pruning.py CKPT --data DATA --device cpu" in res.stderr


def test_the_readme_cpu_toy_modes_give_every_argument_their_scripts_require(
    bench, monkeypatch, capsys
):
    """Each command of the README's "CPU toy modes" names every argument its script's own usage
    line requires (the options outside brackets, and a value for each positional one):
    `pruning.py --device cpu --length 512` left out the model and --data, which argparse
    refused ("the following arguments are required: checkpoint, --data"). The usage is the
    script's ``main(["--help"])``, as ``python SCRIPT --help`` prints it."""
    readme = (BENCH.parent / "README.md").read_text()
    bullet = readme[readme.index("- CPU toy modes:") :]
    bullet = bullet[: bullet.index("\n\n")].replace("\n", " ")
    commands = re.findall(r"`(\w+\.py [^`]*)`", bullet)
    assert len(commands) == 5, commands
    for command in commands:
        script, *args = command.split()
        monkeypatch.setattr(sys, "argv", [str(BENCH / script)])  # argparse's prog
        with pytest.raises(SystemExit) as info:
            bench[script.removesuffix(".py")].main(["--help"])
        assert info.value.code == 0, command
        usage = capsys.readouterr().out
        usage = " ".join(usage[: usage.index("\n\n")].split()[2:])  # after "usage: x.py"
        while re.search(r"\[[^\[\]]*\]", usage):
            usage = re.sub(r"\[[^\[\]]*\]", " ", usage)  # the optional parts, inner first
        words = usage.split()
        options = [w for w in words if w.startswith("--")]
        valued = {
            w for w, nxt in zip(words, [*words[1:], ""]) if w.startswith("--") and nxt.isupper()
        }
        positional = [w for i, w in enumerate(words) if not w.startswith("-") and
                      not (i and words[i - 1] in valued)]  # fmt: skip
        given = [a for i, a in enumerate(args) if not a.startswith("-") and
                 not (i and args[i - 1].startswith("--"))]  # fmt: skip
        assert all(option in args for option in options), (command, usage)
        assert len(given) >= len(positional), (command, usage)


def test_gpu_benchmarks_without_gpu_stop_before_any_work(bench, tmp_path, monkeypatch):
    """`python benchmarks/train_throughput.py --out r.json` (the README's command) on a machine
    without CUDA went on to build the 760M model and train it at 16k tokens on the CPU (hours,
    tens of GiB), and so did decode.py and scaling.py, where attention.py and fused_ops.py stop
    with what they need (found running the README's benchmark commands on a CPU machine).
    --device auto now stops too, naming --device cpu and the toy mode."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_work(*args, **kwargs):
        raise AssertionError("the benchmark started working on the CPU")

    monkeypatch.setattr(bench["train_throughput"], "build", no_work)
    monkeypatch.setattr(bench["decode"], "build", no_work)
    monkeypatch.setattr(bench["scaling"], "run_one", no_work)
    for name, argv, toy in (
        ("train_throughput", ["--out", str(tmp_path / "r.json")], "--device cpu --size tiny"),
        ("decode", ["--out", str(tmp_path / "d.json")], "--device cpu --size tiny"),
        ("scaling", ["--out", str(tmp_path / "s")], "--device cpu --size tiny"),
    ):
        with pytest.raises(SystemExit) as exit_:
            bench[name].main(argv)
        message = str(exit_.value.code)
        assert message.startswith(f"benchmarks/{name}.py measures "), message
        assert "torch.cuda.is_available() is False" in message and toy in message, message
        assert not any(tmp_path.iterdir())  # nothing written


def test_attention_bad_args_are_named_before_the_gpu_check(bench, tmp_path):
    """Shapes and ``--fox-path`` are checked first, so a mistake is named on any machine
    (before: ``ValueError: not enough values to unpack`` or ``FileNotFoundError`` from inside
    the run, after the GPU was set up; on CPU only the no-GPU message)."""
    attention = bench["attention"]
    assert attention.parse_shape("2,8192,16,128") == (2, 8192, 16, 128)
    for bad in ("1,2,3", "1,16384,12,128,5", "1, 16384", "0,16384,12,128", "a,b,c,d"):
        with pytest.raises(SystemExit, match="expected B,T,H,D, four integers >= 1"):
            attention.main(["--shapes", "1,16384,12,128", bad])
    with pytest.raises(SystemExit, match="no such Python file"):
        attention.main(["--fox-path", str(tmp_path / "forgetting_attention.py")])
    wrong = tmp_path / "ops.py"
    wrong.write_text("def parallel_attention(q, k, v):\n    return q\n")
    with pytest.raises(SystemExit, match="defines no forgetting_attention"):
        attention.main(["--fox-path", str(wrong)])


def test_attention_packed_documents_cover_the_row_with_seeded_uneven_lengths(bench):
    """``--documents N`` cuts each row at N - 1 distinct positions: the boundaries start at 0,
    end at T, rise strictly, are the same on every call, and a count outside 1..T is named
    before the GPU check (the message says what to pass)."""
    attention = bench["attention"]
    bounds = attention.document_bounds(16384, 6)
    assert len(bounds) == 7 and bounds[0] == 0 and bounds[-1] == 16384
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert len({b - a for a, b in itertools.pairwise(bounds)}) > 1  # uneven
    assert attention.document_bounds(16384, 6) == bounds
    assert attention.document_bounds(5, 1) == [0, 5]
    assert attention.document_bounds(5, 5) == [0, 1, 2, 3, 4, 5]
    for bad in ("0", "6"):
        with pytest.raises(SystemExit, match=f"--documents {bad}: expected 1 to 5 documents"):
            attention.main(["--shapes", "1,5,1,16", "--documents", bad])


def test_attention_and_fused_ops_write_out_into_a_new_folder(bench, tmp_path, monkeypatch):
    """``--out`` in a folder that does not exist yet is created (before: ``FileNotFoundError``
    after the whole GPU run). The GPU is faked and nothing is timed."""
    attention = bench["attention"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: type("P", (), {"name": "FakeGPU"})
    )
    out = tmp_path / "results" / "new" / "attention.md"
    attention.main(["--no-table", "--out", str(out)])
    assert out.read_text().startswith("device: FakeGPU, torch ")
    fused_ops = bench["fused_ops"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "FakeGPU")
    monkeypatch.setattr(fused_ops, "run_table", lambda tokens, preset, rows: rows.append("| r |"))
    out = tmp_path / "results" / "other" / "ops.md"
    fused_ops.main(["--out", str(out)])
    assert out.read_text() == "device: FakeGPU\n\n| r |\n"


def test_fused_ops_bad_args(bench, tmp_path, capsys):
    """``--tokens``, ``--preset`` and ``--sweep`` with ``--decode-projections`` are checked
    before the GPU check (before: the no-GPU message on CPU, a ``ValueError`` traceback of
    ``presets.config`` on a GPU)."""
    fused_ops = bench["fused_ops"]
    for args, msg in (
        (["--tokens", "0"], "--tokens must be >= 1, got 0"),
        (["--preset", "76m"], "invalid choice: '76m'"),
        (["--decode-projections", "--sweep"], "run it without --decode-projections"),
        (["--decode-attention", "--sweep"], "run it without --decode-attention"),
        (["--decode-attention", "--decode-projections"], "separate runs: give one"),
        (["--decode-attention", "--batch-sizes", "1", "0"], "--batch-sizes must be >= 1, got 0"),
    ):
        with pytest.raises(SystemExit) as exc:
            fused_ops.main(args)
        assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_fused_ops_decode_projections_time_every_layer_and_restore_the_tiles(bench, monkeypatch):
    """``--decode-projections`` on the tiny preset (the interpreter; the timer is faked):
    one row per projection and row count with the widths of the config, each timer call
    launches the projection of every layer, and a candidate whose output is wrong stops the
    sweep with its tiles named; the shipped tiles are back afterwards either way."""
    from fot import presets
    from fot.kernels import linear_ops

    fused_ops = bench["fused_ops"]
    cfg = presets.config("fot_pro", "tiny")
    hidden, heads = cfg.hidden_size, cfg.num_heads
    shipped = linear_ops.GPU_TILES_FEW_ROWS
    launches: list[int] = []
    real = linear_ops.few_rows_linear

    def counting(x, weights):
        launches.append(1)
        return real(x, weights)

    def timer(fn):
        launches.clear()
        fn()
        return 10.0 * len(launches)

    monkeypatch.setattr(linear_ops, "few_rows_linear", counting)
    rows: list[str] = []
    fused_ops.decode_projections("tiny", rows, rows=(1, 3), timer=timer)
    table = [r.split(" | ") for r in rows if r.startswith("| ") and r[2:3] != "p"]
    widths = {"q/k/v/g/k_shift/v_shift": f"{4 * hidden + 2 * heads} x {hidden}",
              "o": f"{hidden} x {hidden}", "gate/up": f"{2 * cfg.mlp_size} x {hidden}",
              "down": f"{hidden} x {cfg.mlp_size}"}  # the step's order  # fmt: skip
    assert [(r[0][2:], r[1], r[2]) for r in table] == [
        (name, m, nk) for m in ("1", "3") for name, nk in widths.items()
    ]
    per_layer = "10.00"  # the timer's 10 us per launch: one launch per layer, over the layers
    for r in table:
        cells = r[4].rstrip(" |").split("; ")
        kind = "wide" if r[0][2:] in ("gate/up", "q/k/v/g/k_shift/v_shift") else "narrow"
        assert len(cells) == len(fused_ops.FEW_ROWS_TILES[kind])
        assert all(c.endswith(f": {per_layer}") for c in cells), cells
        assert sum(c.split(":")[0].endswith("*") for c in cells) == (
            shipped in fused_ops.FEW_ROWS_TILES[kind]
        )
    assert shipped == linear_ops.GPU_TILES_FEW_ROWS

    def wrong_at_wide_64(x, weights):
        y = real(x, weights)
        return y + 1 if linear_ops.GPU_TILES_FEW_ROWS[0] == 64 else y

    monkeypatch.setattr(linear_ops, "few_rows_linear", wrong_at_wide_64)
    with pytest.raises(AssertionError, match=r"tiles \(64, 256\) of q/k/v"):
        fused_ops.decode_projections("tiny", [], rows=(1,), timer=timer)
    assert shipped == linear_ops.GPU_TILES_FEW_ROWS


def test_fused_ops_decode_attention_times_each_setting_over_every_layer(bench, monkeypatch):
    """``--decode-attention`` on the tiny preset (the interpreter; the timer is faked): each
    timer call runs the decode attention once per layer under the setting of its row, the
    default row is the launcher's own launch (hand-computed: 8 SMs on the interpreter), the
    others come fastest first with their spans as multiples of its spans, TB/s is the bf16
    cache's bytes over the time, and a setting whose output is wrong stops the sweep; a
    caller's tuning dict is as it was afterwards either way."""
    from fot import presets
    from fot.kernels import decode

    fused_ops = bench["fused_ops"]
    cfg = presets.config("fot_pro", "tiny")
    heads, dim, layers = cfg.kv_heads, cfg.hidden_size // cfg.num_heads, cfg.num_hidden_layers
    keys = 100
    real = decode.forgetting_attention_decode
    seen: list[tuple[int, dict]] = []

    def us_per_layer(o: dict) -> float:  # the fake time of a setting, default included
        return (100 + 10 * o.get("splits", 2) - o.get("block_n", 64)) / 1000

    def timer(fn):
        calls = []
        monkeypatch.setattr(decode, "forgetting_attention_decode",
                            lambda **kw: calls.append(1) or real(**kw))  # fmt: skip
        fn()
        monkeypatch.setattr(decode, "forgetting_attention_decode", real)
        seen.append((len(calls), dict(decode._CONFIG_OVERRIDE)))
        return layers * us_per_layer(decode._CONFIG_OVERRIDE)

    decode._CONFIG_OVERRIDE["warps"] = 8  # a caller's own setting: not timed, kept
    settings = ((1, 32, 4, 3), (2, 16, 2, 2), (0.5, 16, 4, 2))
    rows: list[str] = []
    fused_ops.decode_attention("tiny", keys, rows, batches=(1, 2), settings=settings, best=2,
                               timer=timer)  # fmt: skip
    assert decode._CONFIG_OVERRIDE == {"warps": 8}
    assert [n for n, _ in seen] == [layers] * 8
    # the default: min(ceil(100 / 64), 4 * 8 // (batch * heads)) spans of 64 keys
    default = {b: max(1, min(2, 32 // (b * heads))) for b in (1, 2)}
    assert default == {1: 2, 2: 2}
    want = [{"splits": 2, "block_n": 32, "warps": 4, "stages": 3},
            {"splits": 4, "block_n": 16, "warps": 2, "stages": 2},
            {"splits": 1, "block_n": 16, "warps": 4, "stages": 2}]  # fmt: skip
    assert [o for _, o in seen] == [{}, *want] * 2
    table = [r.strip("| ").split(" | ") for r in rows if r[2:3].isdigit()]
    assert len(table) == 6
    for b, chunk in ((1, table[:3]), (2, table[3:])):
        shown = [{"splits": default[b], "block_n": 64}, want[0], want[2]]  # fastest first
        assert [r[:6] for r in chunk] == [
            [str(b), str(keys), f"{default[b]}*", "64", "4", "3"],
            [str(b), str(keys), "2", "32", "4", "3"],  # 0.088 us
            [str(b), str(keys), "1", "16", "4", "2"],  # 0.094 us; 4 spans (0.124) left out
        ]
        cache_bytes = b * keys * heads * dim * 2 * 2
        for r, o in zip(chunk, shown):
            assert r[6:] == [f"{us_per_layer(o):.2f}", f"{cache_bytes / us_per_layer(o) / 1e6:.2f}"]

    def wrong_at_16_keys(**kw):
        out = real(**kw)
        return out + 1 if decode._CONFIG_OVERRIDE.get("block_n") == 16 else out

    monkeypatch.setattr(decode, "forgetting_attention_decode", wrong_at_16_keys)
    with pytest.raises(AssertionError, match="at 4 spans, block_n 16, 2 warps, 2 stages"):
        fused_ops.decode_attention("tiny", keys, [], batches=(1,), settings=settings,
                                   timer=lambda fn: 1.0)  # fmt: skip
    assert decode._CONFIG_OVERRIDE == {"warps": 8}
    decode._CONFIG_OVERRIDE.clear()


# ---------------------------------------------------------------------------------------
# Pruning on a trained checkpoint
# ---------------------------------------------------------------------------------------


TRITON_VERSION = tuple(int(x) for x in importlib.metadata.version("triton").split(".")[:2])


@pytest.mark.skipif(
    TRITON_VERSION < (3, 7),
    reason="Triton < 3.7's interpreter stops at our kernels' loops over runtime bounds "
    "(seen with Triton 3.6: 'only 0-dimensional arrays can be converted to Python scalars')",
)
@pytest.mark.parametrize(("decay_time", "expect_skips"), [(0.1, True), (1e9, False)])
def test_pruning_cpu_tile_counts(tmp_path, decay_time, expect_skips):
    """``python benchmarks/pruning.py ... --device cpu`` in a fresh process without
    ``TRITON_INTERPRET`` (as a user runs it, on a GPU machine too): the script turns Triton's
    interpreter on itself. Tile counts from the interpreter kernel on a tiny fixed-gate model:
    the total equals the hand count of causal 32x32 tile pairs; with a decay time of 0.1 token
    (log f = -10 per token) exact pruning must skip every pair of tiles two or more apart (the
    gate bias alone is below -320 there), with 1e9 it skips none; the output is unchanged
    either way."""
    from fot import presets
    from fot.data.tokens import write_token_documents
    from fot.export import export_hf

    torch.manual_seed(0)
    over = {"decay_time_min": decay_time, "decay_time_max": decay_time}
    model = presets.build_model(presets.config("fot_llama_fixed", "tiny", **over))
    export_hf(model, tmp_path / "ckpt")
    rng = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 50257, (100,), generator=rng).tolist() for _ in range(3)]
    write_token_documents(tmp_path / "data", docs)
    T = 128
    run = _run_script([str(BENCH / "pruning.py"), str(tmp_path / "ckpt"),
                       "--data", str(tmp_path / "data"), "--length", str(T), "--device", "cpu",
                       "--out", str(tmp_path / "p.json")])  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Triton's interpreter (TRITON_INTERPRET=1)" in run.stdout
    res = json.loads((tmp_path / "p.json").read_text())
    assert res["meta"]["triton_interpret"] is True
    cfg = model.config
    n_tiles = T // 32
    pairs = n_tiles * (n_tiles + 1) // 2
    assert len(res["layers"]) == cfg.num_hidden_layers
    for layer in res["layers"]:
        assert layer["off"]["tiles_total"] == pairs * cfg.num_attention_heads
        assert layer["off"]["tiles_skipped"] == 0
        assert layer["exact"]["tiles_total"] == pairs * cfg.num_attention_heads
        assert layer["exact"]["max_rel_err"] == 0.0
    frac = res["total"]["exact"]["skipped_fraction"]
    if expect_skips:
        assert frac >= 3 / pairs
    else:
        assert frac == 0.0
    assert f"exact: skipped {frac:6.1%}" in run.stdout


def test_pruning_missing_paths_are_named_without_traceback(bench, tmp_path):
    """A mistyped ``--data`` or checkpoint path ends with the loader's message (which names the
    fix) instead of a ``FileNotFoundError`` traceback; the data is read before the model."""
    from fot.data.tokens import write_token_documents

    pruning = bench["pruning"]
    write_token_documents(tmp_path / "data", [list(range(100))])
    base = [*PRUNING_DEVICE, "--length", "64"]
    nodata = re.escape(f"error: {tmp_path / 'nodata'} is not a token folder")
    with pytest.raises(SystemExit, match=nodata):
        pruning.main([str(tmp_path / "no-ckpt"), "--data", str(tmp_path / "nodata"), *base])
    nockpt = re.escape(f"error: checkpoint '{tmp_path / 'no-ckpt'}' is not a folder")
    with pytest.raises(SystemExit, match=nockpt):
        pruning.main([str(tmp_path / "no-ckpt"), "--data", str(tmp_path / "data"), *base])


@pytest.mark.parametrize("threshold", ["5", "0", "nan"])
def test_pruning_threshold_not_negative_is_refused_first(bench, capsys, threshold):
    """``--threshold 5`` (a log-weight must be < 0) was a ValueError traceback from the kernel,
    after the checkpoint and data were loaded and the attention inputs captured; now a one-line
    usage error before anything is read (the paths here do not exist)."""
    with pytest.raises(SystemExit) as exit_:
        bench["pruning"].main(
            [
                "no-such-checkpoint",
                "--data",
                "no-such-data",
                *PRUNING_DEVICE,
                "--threshold",
                threshold,
            ]
        )
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--threshold must be a negative log-weight (natural log, e.g. -20" in err
    assert "Traceback" not in err and "no-such" not in err


def test_pruning_cpu_after_triton_was_imported_without_interpreter_says_the_fix():
    """``pruning.main(--device cpu)`` in a process that imported Triton without the interpreter
    (its kernels compiled, for a GPU) cannot turn it on any more: it stops with the command to
    run instead of failing inside Triton (or, before, of loading the checkpoint first)."""
    code = (
        "import sys, triton\n"
        f"sys.path.insert(0, {str(BENCH)!r})\n"
        "import pruning\n"
        "pruning.main(['no-such-checkpoint', '--data', 'no-such-data', '--device', 'cpu'])\n"
    )
    res = _run_script(["-c", code])
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "imported Triton without it" in res.stderr
    assert "`TRITON_INTERPRET=1 python benchmarks/pruning.py ... --device cpu`" in res.stderr


# ---------------------------------------------------------------------------------------
# Multi-process scaling
# ---------------------------------------------------------------------------------------


class _StopRun(Exception):
    """Raised by a stand-in for scaling.run_one once it has recorded what it was given."""


def test_scaling_without_work_dir_takes_a_new_folder_per_invocation(tmp_path, bench, monkeypatch):
    """--work-dir was /tmp/fot_scaling by default: two invocations (two users of a machine, or
    two jobs) replaced each other's run folders. Each now gets a new temporary folder."""
    scaling = bench["scaling"]
    dirs = []

    def record(nproc, strategy, args):
        dirs.append(Path(args.work_dir))
        raise _StopRun  # the folder is all this test needs

    monkeypatch.setattr(scaling, "run_one", record)
    argv = ["--size", "tiny", "--seq-len", "64", "--steps", "3", "--warmup", "1", "--nprocs", "1",
            "--device", "cpu"]  # fmt: skip
    for _ in range(2):
        with pytest.raises(_StopRun):
            scaling.main(argv)
    assert len(dirs) == 2 and dirs[0] != dirs[1] and all(d.is_dir() for d in dirs)
    for d in dirs:
        d.rmdir()  # empty: nothing ran


def test_scaling_runs_a_strategy_named_twice_once(tmp_path, bench, monkeypatch):
    """--strategies ddp,ddp ran (and reported) every process count twice (helper-179)."""
    scaling = bench["scaling"]
    runs = []

    def record(nproc, strategy, args):
        runs.append((nproc, strategy, tuple(args.strategies)))
        raise _StopRun

    monkeypatch.setattr(scaling, "run_one", record)
    with pytest.raises(_StopRun):
        scaling.main(["--size", "tiny", "--seq-len", "64", "--steps", "3", "--warmup", "1",
                      "--nprocs", "2", "--strategies", "ddp,fsdp,ddp", "--device", "cpu",
                      "--work-dir", str(tmp_path)])  # fmt: skip
    assert runs == [(2, "ddp", ("ddp", "fsdp"))]


def test_scaling_cpu_two_processes_match_one(tmp_path, bench):
    """benchmarks/scaling.py on CPU (gloo): with one global batch, the 2-process DDP run's
    per-step losses equal the 1-process run's (the oracle), and every step is reported."""
    scaling = bench["scaling"]
    res = scaling.main(["--size", "tiny", "--seq-len", "64", "--steps", "3", "--warmup", "1",
                        "--nprocs", "1,2", "--strategies", "ddp", "--device", "cpu",
                        "--work-dir", str(tmp_path / "runs"), "--out", str(tmp_path)])  # fmt: skip
    rows = {r["name"]: r for r in res["rows"]}
    assert set(rows) == {"single_x1", "ddp_x2"}  # fsdp_x1 only when fsdp is asked for
    one, two = rows["single_x1"], rows["ddp_x2"]
    assert one["error"] is None and two["error"] is None
    assert len(one["losses"]) == len(two["losses"]) == 3
    assert max(abs(a - b) for a, b in zip(one["losses"], two["losses"])) < 1e-5
    assert two["max_abs_loss_diff"] < 1e-5 and two["tokens_per_s_per_gpu"] > 0
    assert two["tokens_per_s_per_gpu_all"] > 0 and two["efficiency_same_strategy_all"] > 0
    assert "| ddp | 2 |" in (tmp_path / "scaling.md").read_text()
    with pytest.raises(SystemExit):
        scaling.parse_args(["--nprocs", "2,3"])  # 3 does not divide into one global batch


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--per-gpu-batch", "0"], "--per-gpu-batch must be >= 1, got 0"),  # ZeroDivisionError
        (["--per-gpu-batch", "-1"], "--per-gpu-batch must be >= 1, got -1"),
        (["--seq-len", "0"], "--seq-len must be >= 1, got 0"),
        (["--global-sequences", "0"], "--global-sequences must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),  # silently timed the last step
        (
            ["--model", "fot_prO"],
            "--model: unknown model option 'fot_prO' in 'model=fot_prO': did you mean fot_pro",
        ),
        (
            ["--size", "1b"],
            "--size: unknown size option '1b' in 'size=1b': the size options "
            "are 125m, 360m, 760m, tiny",
        ),
    ],
)
def test_scaling_bad_args_are_named(bench, capsys, args, msg):
    """Counts and names that train.py would reject only in each run (as a useless last log
    line, "Set the environment variable HYDRA_FULL_ERROR=1 ...") or never, refused first."""
    with pytest.raises(SystemExit) as exc:
        bench["scaling"].parse_args(args)
    assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_scaling_keeps_an_earlier_runs_results(bench, tmp_path, monkeypatch):
    """An ``--out`` folder that holds ``scaling.json`` is refused before any run (the first run
    rewrote it)."""
    scaling = bench["scaling"]
    (tmp_path / "scaling.json").write_text("{}")

    def run_one(*args):
        raise AssertionError("a run started")

    monkeypatch.setattr(scaling, "run_one", run_one)
    with pytest.raises(SystemExit, match=f"--out {tmp_path / 'scaling.json'} exists"):
        scaling.main(["--size", "tiny", "--nprocs", "1", "--strategies", "ddp", "--steps", "3",
                      "--device", "cpu", "--out", str(tmp_path)])  # fmt: skip
    assert (tmp_path / "scaling.json").read_text() == "{}"


def test_scaling_interrupted_keeps_finished_rows(bench, tmp_path, monkeypatch, capsys):
    """Ctrl-C during the second run: the first run's row stays in ``--out``, the table of it
    is printed and the exit status is 130 (before: a traceback, and the runs' table lost)."""
    scaling = bench["scaling"]
    row = {"name": "single_x1", "strategy": "single", "nproc": 1, "losses": [2.0],
           "error": None, "tokens_per_s": 100.0, "tokens_per_s_per_gpu": 100.0}  # fmt: skip

    def run_one(nproc, strategy, args):
        if strategy != "single":
            raise KeyboardInterrupt
        return dict(row)

    monkeypatch.setattr(scaling, "run_one", run_one)
    with pytest.raises(SystemExit) as exit_:  # a KeyboardInterrupt escaping main() fails too
        scaling.main(["--size", "tiny", "--nprocs", "1,2", "--strategies", "ddp", "--steps",
                      "3", "--device", "cpu", "--out", str(tmp_path),
                      "--work-dir", str(tmp_path / "runs")])  # fmt: skip
    assert exit_.value.code == 130
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["name"] for r in saved["rows"]] == ["single_x1"]
    out = capsys.readouterr().out
    assert f"interrupted (Ctrl-C) during ddp x2: 1 finished result(s) kept (in {tmp_path})" in out
    assert "| single | 1 | 100 |" in out


@pytest.mark.parametrize(
    ("override", "msg"),
    [
        ("data=smaple", "--override: unknown data option 'smaple' in 'data=smaple': did you "
         "mean sample?"),
        ("optim.lrr=1e-3", "--override: unknown config key 'optim.lrr' in 'optim.lrr=1e-3': "
         "did you mean optim.lr"),
    ],
)  # fmt: skip
def test_scaling_refuses_a_bad_override_before_any_run(bench, capsys, override, msg):
    """A misspelt ``--override`` made every run fail in turn, each after starting torchrun."""
    with pytest.raises(SystemExit) as exc:
        bench["scaling"].parse_args(["--override", override])
    assert exc.value.code == 2 and msg in capsys.readouterr().err


def test_scaling_all_steps_rate_and_efficiency_hand_count(bench):
    """All-steps tokens/s is all tokens over all time; a stalled step lowers it, not the
    median. Efficiencies divide per-GPU rates by the same strategy's one-GPU run."""
    scaling = bench["scaling"]
    # 3 steps of 100 tokens at 100, 100 and 50 tokens/s: 300 tokens in 4 s
    assert scaling.all_steps_rate([100.0, 100.0, 50.0]) == pytest.approx(75.0)
    rows = [
        {"name": "fsdp_x1", "strategy": "fsdp", "nproc": 1, "losses": [2.0, 1.5],
         "tokens_per_s_per_gpu": 100.0, "tokens_per_s_per_gpu_all": 80.0},
        {"name": "fsdp_x2", "strategy": "fsdp", "nproc": 2, "losses": [2.0, 1.4],
         "tokens_per_s_per_gpu": 90.0, "tokens_per_s_per_gpu_all": 60.0},
    ]  # fmt: skip
    scaling.compare(rows)
    two = rows[1]
    assert two["efficiency_same_strategy"] == pytest.approx(0.9)
    assert two["efficiency_same_strategy_all"] == pytest.approx(0.75)
    assert two["max_abs_loss_diff"] == pytest.approx(0.1)
    assert two["loss_reference"] == "fsdp_x1" and two["efficiency"] is None  # no single run


def test_profile_categories_hand_count(bench):
    """Kernel names sort into categories by the first matching pattern; per-step times are the
    totals over the profiled steps divided by the step count."""
    tt = bench["train_throughput"]
    events = [
        ("_fwd_kernel", 10.0),
        ("_bwd_dkdv_kernel", 6.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 20.0),
        ("flash_fwd_kernel", 4.0),
        ("triton_red_fused__rms_norm_0", 5.0),
        ("_shift_norm_bwd_kernel", 0.5),
        ("multi_tensor_apply_kernel<FusedAdamW>", 2.0),
        ("vectorized_elementwise_kernel<add>", 3.0),
        ("_kmax_kernel", 0.5),  # the pruning bound: our attention's
        ("multi_tensor_apply_kernel<TensorListMetadata<2>, CopyFunctor<bf16>>", 1.0),  # a cast
    ]
    prof = tt.profile_categories(events, steps=2)
    ms = prof["ms_per_step"]
    assert ms["attention: ours (Triton)"] == 8.25
    assert ms["attention: other"] == 2.0
    assert ms["matmul"] == 10.0 and ms["norms"] == 2.5 and ms["optimizer"] == 1.0
    assert ms["Pro components (fused)"] == 0.25  # not "norms", although its name has "norm"
    assert ms["elementwise and other"] == 2.0 and ms["loss (cross-entropy)"] == 0.0
    assert prof["total_ms_per_step"] == 26.0
    assert prof["top_kernels"][0] == ("sm90_xmma_gemm_bf16bf16_bf16f32", 10.0)
    table = tt.profile_table([{"model": "m", "profile": prof}])
    assert "| matmul | 10.0 |" in table and "| total | 26.0 |" in table
    assert list(ms)[-1] == "elementwise and other"


def test_every_attention_kernel_is_counted_as_ours(bench):
    """Each Triton kernel of the attention (``*_kernel`` in fot.kernels._triton_kernels) is in
    the profile's "attention: ours" set: the packed documents' bounds kernel was counted as
    "elementwise and other"."""
    from fot.kernels import _triton_kernels as kern

    names = {name for name in vars(kern) if name.startswith("_") and name.endswith("_kernel")}
    assert "_doc_bounds_kernel" in names
    missing = names - bench["train_throughput"].OUR_ATTENTION_KERNELS
    assert not missing, missing


def test_profile_table_reports_gpu_idle(bench):
    """The profile table has a GPU-idle row from the timeline (fot.training.profiling)."""
    from fot.training.profiling import gpu_timeline

    tt = bench["train_throughput"]
    prof = tt.profile_categories([("a", 1.0)], steps=2)
    prof["timeline"] = gpu_timeline([(0.0, 400.0, "a"), (1000.0, 1600.0, "c")], steps=2)
    assert "| GPU idle (no kernel running) | 0.3 |" in tt.profile_table(
        [{"model": "m", "profile": prof}]
    )


# ---------------------------------------------------------------------------------------
# Fused elementwise ops
# ---------------------------------------------------------------------------------------


def test_fused_ops_benchmark_times_equal_functions(bench) -> None:
    """benchmarks/fused_ops.py compares like with like: its PyTorch and fused closures return
    the same input gradients (CPU: the kernels under the Triton interpreter)."""
    fused_ops = bench["fused_ops"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for case, tol in (
        (fused_ops._norm_case(37, 96, dev), 2e-2),
        (fused_ops._swiglu_case(37, 40, dev), 2e-2),
    ):
        pytorch, fused, nbytes = case
        assert nbytes > 0
        for got, want in zip(fused(), pytorch(), strict=True):
            assert got.dtype == want.dtype
            err = (got.float() - want.float()).norm() / want.float().norm()
            assert err < tol
    # the LM head + loss (padded head: 100 classes in 128 rows), and FLA's where it runs
    pytorch, fused, fla, flops = fused_ops._loss_case(37, 24, 100, dev, chunk_rows=16)
    assert flops == 6 * 37 * 24 * 128
    want = pytorch()
    for other in (fused, fla) if fla is not None else (fused,):
        for got, ref in zip(other(), want, strict=True):
            assert got.dtype == ref.dtype
            n = min(got.shape[0], ref.shape[0])  # the chunked loss's head gradient: real rows
            err = (got[:n].float() - ref[:n].float()).norm() / ref[:n].float().norm()
            assert err < 2e-2


def test_data_read_benchmark_reads_the_same_tokens_every_way(bench, capsys, monkeypatch) -> None:
    """benchmarks/data_read.py on small arrays: one table row per chunk shape, and the three
    ways of reading (uncached, cached, fetched ahead) give the same tokens (it checks); a bad
    chunk shape is named. It writes its arrays without zarr 3's ``create_array``, which zarr 2
    (Python 3.10's) lacks: it raised AttributeError there."""
    import zarr

    monkeypatch.delattr(zarr, "create_array", raising=False)  # zarr 2 has none
    data_read = bench["data_read"]
    data_read.main(["--array-rows", "64", "--row-len", "256", "--seq-len", "64", "--rows", "4",
                    "--chunks", "8x64", "1x256", "--gpu-ms", "0", "--steps", "6"])  # fmt: skip
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| (64, 256)")]
    assert [r.split("|")[2].strip() for r in rows] == ["(8, 64)", "(1, 256)"]
    assert all(float(x) > 0 for r in rows for x in r.split("|")[3:6])
    with pytest.raises(SystemExit):
        data_read.main(["--chunks", "3y"])
    assert "'3y' is not ROWSxCOLUMNS" in capsys.readouterr().err
    # helper-179: tracebacks (a negative sleep; the missing array's FileNotFoundError)
    with pytest.raises(SystemExit):
        data_read.main(["--gpu-ms", "-5"])
    assert "--gpu-ms must be >= 0 (0: no GPU time between steps), got -5.0" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        data_read.main(["--zarr", "/nonexistent/x.zarr", "--seq-len", "64"])
    err = capsys.readouterr().err
    assert "error: --zarr: zarr array /nonexistent/x.zarr does not exist" in err


def _packed_digests(docs, T: int, rows: int) -> list[str]:
    """SHA-256 of each step's inputs and labels, packed here with NumPy: every document with
    its BOS (50256) back to back, sequence g the window ``[gT, gT + T + 1)`` (inputs its first
    T, labels its last T), ``rows`` sequences per step, as many steps as one pass holds."""
    import hashlib

    import numpy as np

    stream = np.concatenate([np.concatenate([[50256], d]).astype(np.int64) for d in docs])
    steps, out = (len(stream) - 1) // (rows * T), []
    for step in range(steps):
        g = np.arange(step * rows, (step + 1) * rows)
        windows = stream[g[:, None] * T + np.arange(T + 1)]  # (rows, T + 1)
        out.append(hashlib.sha256(windows[:, :-1].tobytes() + windows[:, 1:].tobytes()).hexdigest())
    return out


def test_data_read_benchmark_packs_documents_as_numpy_does(bench, capsys, monkeypatch) -> None:
    """benchmarks/data_read.py --reader packed on small corpora: a table row per corpus, T and
    reader; every reader (data=hf, the naive baseline, token folder, .npy) reads exactly the
    tokens of a NumPy packing of the documents done here; a reader that reads one wrong token
    stops the script; the naive baseline stops at its time budget; bad arguments are named with
    the fix."""
    from fot.data.streams import HFSource

    data_read = bench["data_read"]
    args = ["--reader", "packed", "--tokens", "3000", "--short-len", "40", "--rows", "3",
            "--repeats", "2"]  # fmt: skip
    results = data_read.main([*args, "--seq-len", "7", "64"])
    table = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| ")][1:]
    readers = list(data_read.PACKED_READERS)
    assert len(readers) == 6 and len(table) == len(results) == 2 * 2 * 6
    assert [r.split("|")[3].strip() for r in table] == readers * 4
    # measured (the table rounds to 0.01: a step of a few microseconds printed 0.00)
    assert all(r["ms_per_step"] > 0 and r["tokens_per_s"] > 0 for r in results)
    for line, r in zip(table, results):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        assert float(cells[5]) == round(r["ms_per_step"], 2)
        assert float(cells[6]) == round(r["tokens_per_s"] / 1e6, 2)
        assert cells[7].endswith("x") == cells[2].startswith("data=hf")
    for corpus in ("long", "short"):
        docs = data_read.documents(corpus, 3000, 40)
        assert sum(map(len, docs)) == 3000 and min(map(len, docs)) >= 1
        if corpus == "short":  # 20 .. 60 tokens, the last one cut
            assert len(docs) > 50 and all(20 <= len(d) <= 60 for d in docs[:-1])
        for T in (7, 64):
            want = _packed_digests(docs, T, 3)
            got = [r for r in results if r["corpus"] == corpus and r["seq_len"] == T]
            assert [r["reader"] for r in got] == readers
            for r in got:
                assert r["digests"] == want, (corpus, T, r["reader"])
                assert r["steps"] == r["of_steps"] == len(want) > 1
    # the naive baselines stop after their first step when the budget is spent
    results = data_read.main([*args, "--seq-len", "7", "--naive-s", "1e-9"])
    assert "| first 1 of " in capsys.readouterr().out
    naive = [r for r in results if r["reader"].startswith("naive")]
    assert len(naive) == 4 and all(r["steps"] == 1 < r["of_steps"] for r in naive)
    # one wrong token in data=hf's fifth step: the other readers disagree with it
    read = HFSource.read

    def wrong_read(self, start: int, count: int):
        inputs, labels = read(self, start, count)
        if start == 4 * count:
            labels[-1, -1] += 1
        return inputs, labels

    monkeypatch.setattr(HFSource, "read", wrong_read)
    with pytest.raises(
        RuntimeError, match="naive baseline read other tokens than data=hf at step 4"
    ):
        data_read.main([*args, "--seq-len", "7"])
    monkeypatch.undo()
    for bad, msg in (
        (["--reader", "packed", "--chunks", "8x64"],
         "--chunks applies to --reader zarr (the default) only; drop it, or pass --reader zarr"),
        (["--tokens", "9"], "--tokens applies to --reader packed or --reader trainer only"),
        (["--reader", "trainer", "--steps", "3"],
         "--steps applies to --reader zarr or --reader packed only; drop it, or pass --reader zarr"),
        (["--reader", "packed", "--doc-len", "9"], "--doc-len applies to --reader trainer only"),
        (["--reader", "trainer", "--rows", "6", "--micro-batch", "4"],
         "--rows 6 is not a multiple of --micro-batch 4"),
        (["--reader", "packed", "--tokens", "100", "--rows", "4", "--seq-len", "7", "32"],
         "--tokens 100 is less than one step of --rows 4 x --seq-len 32; give more --tokens"),
        (["--reader", "packed", "--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--seq-len", "64", "128"], "--reader zarr times one --seq-len at a time"),
        (["--reader", "parquet"], "invalid choice: 'parquet'"),
    ):  # fmt: skip
        with pytest.raises(SystemExit):
            data_read.main(bad)
        assert msg in capsys.readouterr().err, bad


def test_data_read_trainer_mode_times_the_trainers_step_data(bench, capsys, monkeypatch) -> None:
    """benchmarks/data_read.py --reader trainer on small folders: a row per folder, T and
    packing, each timing the trainer's own screen of each micro batch of next_step (counted
    here), and a row of open / resume / first-step times per folder."""
    import fot.training.trainer as trainer

    data_read = bench["data_read"]
    screened = []
    screen = trainer._screen_token_ids

    def counting(batches, *args, **kwargs):
        screened.append(len(batches))
        return screen(batches, *args, **kwargs)

    monkeypatch.setattr(trainer, "_screen_token_ids", counting)
    results = data_read.main(["--reader", "trainer", "--tokens", "20000", "--doc-len", "20", "300",
                              "--seq-len", "64", "16", "--rows", "8", "--micro-batch", "2",
                              "--budget-s", "0.01"])  # fmt: skip
    assert [(r["doc_len"], r["T"], r["packing"]) for r in results] == [
        (d, T, p) for d in (20, 300) for T in (64, 16) for p in ("varlen", "causal", "padded")
    ]
    assert all(r["tokens_per_s"] == pytest.approx(8 * r["T"] / r["ms_per_step"] * 1e3)
               for r in results)  # fmt: skip
    assert len(screened) >= 3 * len(results) and set(screened) == {4}  # 8 rows / micro batch 2
    out = capsys.readouterr().out
    assert "| documents | open (ms) | resume at step 100,000 (ms) |" in out
    n_docs = len(data_read.documents("short", 20000, 300))
    assert sum(line.startswith(f"| {n_docs} of ~300 tokens |") for line in out.splitlines()) == 7


def test_optimizer_step_benchmark_times_every_optimizer_and_compares_the_muons(
    bench, tmp_path, capsys
) -> None:
    """benchmarks/optimizer_step.py on the CPU: a row per optimizer; fot's Muon and
    torch.optim.Muon end at the same weights; the Newton-Schulz FLOPs by hand count."""
    from fot import presets
    from fot.training.optim import muon_parameter_names

    ob = bench["optimizer_step"]
    # by hand: a 2 x 3 matrix, 5 iterations of X Xt (2*4*3), A A (2*8) and (.) X (2*4*3)
    assert ob.newton_schulz_flops([(2, 3)]) == ob.newton_schulz_flops([(3, 2)]) == 5 * 64
    out = tmp_path / "res.json"
    args = ["--device", "cpu", "--size", "tiny", "--steps", "2", "--warmup", "1"]
    payload = ob.main([*args, "--out", str(out)])
    rows = {r["optimizer"]: r for r in payload["results"]}
    assert list(rows) == ["adamw", "muon", "torch_muon"]
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(payload["results"]))
    assert rows["torch_muon"]["same_as_muon"] is True
    model = presets.build_model(presets.config("fot_pro", "tiny"))
    shapes = [
        tuple(p.shape) for n, p in model.named_parameters() if n in muon_parameter_names(model)
    ]
    assert rows["muon"]["muon_matrices"] == len(shapes) > 0 and rows["adamw"]["muon_matrices"] == 0
    flops = ob.newton_schulz_flops(shapes)
    assert rows["muon"]["newton_schulz_gflop"] == pytest.approx(flops / 1e9)
    for r in rows.values():
        assert len(r["step_ms_all"]) == 2 and r["step_ms"] > 0 and "_weights" not in r
    # AdamW keeps two moments per parameter, Muon one buffer for its matrices
    assert rows["muon"]["state_gib"] < rows["adamw"]["state_gib"]
    assert capsys.readouterr().out.splitlines()[-1].startswith("| torch_muon |")
    with pytest.raises(SystemExit, match="exists"):
        ob.main([*args, "--out", str(out)])
    with pytest.raises(SystemExit):
        ob.main(["--optims", "sgd"])
    with pytest.raises(SystemExit):  # twice: its rows would be indistinguishable
        ob.main(["--optims", "muon,muon"])
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit, match="cannot be written"):  # before anything is measured
        ob.main([*args, "--optims", "adamw", "--out", str(blocker / "res.json")])
