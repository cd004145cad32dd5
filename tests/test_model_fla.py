"""Recurrent baselines from flash-linear-attention (seconds).

Tests that run FLA's Triton kernels take the ``device`` fixture (conftest): CUDA tensors where
there is a GPU (the kernels compiled, float32 without TF32), CPU tensors under TRITON_INTERPRET
otherwise. FLA's compiled kernels cannot read CPU tensors, so every model and input of such a
test is on ``device``.

Oracle: FLA's own forward (its logits) for our ``shift_labels`` loss; separate sequences for
packed ``cu_seqlens`` batches.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fot import presets

ROOT = Path(__file__).resolve().parents[1]

VOCAB = 300
# Overrides of the tiny preset for the tests whose checks hold at any width. On the CPU FLA's
# kernels run under Triton's interpreter, whose time grows with the width (DeltaNet's recurrent
# kernel runs a program per 8 value channels, each stepping through every token): there they
# take width 32, ~4x less time than the preset's 128 (its layers kept: HGRN2's lower bounds
# need two). On a GPU the preset as it is.
SMALL = {} if torch.cuda.is_available() else {"hidden_size": 32}


def tiny(name: str, **overrides):
    torch.manual_seed(0)
    return presets.build_model(presets.config(name, "tiny", vocab_size=VOCAB, **overrides))


@pytest.mark.parametrize("name", ["deltanet", "hgrn2", "mamba2"])
def test_fla_baseline_loss_matches_its_own_logits_and_trains(name: str, device) -> None:
    m = tiny(name, **SMALL).to(device)
    x = torch.randint(0, VOCAB, (1, 16)).to(device)
    y = torch.randint(0, VOCAB, (1, 16)).to(device)
    y[0, :3] = -100
    logits = m(x).logits  # FLA's own forward
    assert logits.shape == (1, 16, VOCAB)
    want = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1), ignore_index=-100)
    out = m(x, shift_labels=y)
    assert abs(out.loss.item() - want.item()) < 1e-4
    out.loss.backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert m.get_input_embeddings().weight.grad.abs().sum() > 0
    ptl = m.per_token_loss(x, y)
    assert ptl.shape == (1, 16) and torch.all(ptl[0, :3] == 0)
    assert abs(ptl.sum().item() / 13 - want.item()) < 1e-4


def test_fla_baseline_loss_runs_a_hooked_lm_head(device) -> None:
    """Our loss calls a hooked (or adapter-wrapped) LM head as a module, as FLA's forward does."""
    m = tiny("deltanet", **SMALL).to(device)
    m.lm_head.register_forward_hook(lambda module, args, out: 2 * out)
    x, y = (torch.randint(0, VOCAB, (1, 16)).to(device) for _ in range(2))
    logits = m(x).logits  # FLA's own forward, through the hook
    want = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
    assert abs(m(x, shift_labels=y).loss.item() - want.item()) < 1e-4


@pytest.mark.parametrize("name", ["deltanet"])
def test_fla_baseline_packed_equals_separate(name: str, device) -> None:
    m = tiny(name, **SMALL).to(device)
    docs = [torch.randint(0, VOCAB, (1, n)).to(device) for n in (8, 8)]
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device=device)
    y = torch.randint(0, VOCAB, (1, 16)).to(device)
    got = m.per_token_loss(torch.cat(docs, dim=1), y, cu_seqlens=cu)
    want = torch.cat([m.per_token_loss(d, y[:, s : s + 8]) for d, s in zip(docs, (0, 8))], 1)
    assert (got - want).abs().max() < 1e-3


@pytest.mark.parametrize("name", ["deltanet", "hgrn2"])
def test_fla_baseline_runs_float32_inputs_longer_than_one_chunk(name: str, device) -> None:
    """FLA's chunked DeltaNet kernel refuses float32, and under Triton's interpreter the chunked
    DeltaNet and HGRN2 kernels fail beyond 64 tokens: the wrapper runs their recurrent kernel
    then. Oracle: causality (the first 64 positions' logits are those of the first 64 tokens,
    which FLA always runs on its recurrent kernel) and fot's loss of FLA's own logits. (One
    layer: the wrapper chooses the kernel of every layer alike.)"""
    m = tiny(name, **SMALL, num_hidden_layers=1).to(device).eval()
    x = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        logits = m(x).logits.float()
        head = m(x[:, :64]).logits.float()
        losses = m.per_token_loss(x[:, :-1], x[:, 1:])
    assert (logits[:, :64] - head).abs().max() < 1e-4
    want = F.cross_entropy(logits[0, :-1], x[0, 1:], reduction="none")
    assert (losses[0] - want).abs().max() < 1e-4
    assert m.config.attn_mode == "chunk"  # the config is left as it was


@pytest.mark.parametrize("name", ["deltanet", "hgrn2", "mamba2"])
def test_fla_baseline_generate_decodes_with_its_state(name: str, device) -> None:
    """generate() with the cache: each step's logits are the full forward's on the sequence so
    far. transformers >= 5.24 passes the cache as ``cache``, which FLA's models do not read:
    each step then ran on its one new token without state (logits off by 1.7-4.4)."""
    m = tiny(name, **SMALL).to(device).eval()
    with torch.no_grad():
        for p in m.parameters():  # peaked logits, so that a stateless step shows
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)).to(p) * 0.05)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        out = m.generate(
            ids, max_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        full = m(out.sequences).logits.float()
    for step, scores in enumerate(out.scores):
        want = full[:, ids.shape[1] - 1 + step]
        assert (scores.float() - want).abs().max() < 1e-3, step


def test_fla_baseline_generate_without_a_mask_keeps_the_bos(device) -> None:
    """generate(ids, eos_token_id=...) without an attention_mask, the pad id being the BOS id
    (as in fot's exports: 50256 is both): transformers inferred the mask from the pad id,
    masked the BOS, and the scores were off by 1.35 from the full forward."""
    m = tiny("deltanet", **SMALL).to(device).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)).to(p) * 0.05)
    m.config.bos_token_id = m.generation_config.bos_token_id = 7
    m.generation_config.pad_token_id = 7
    ids = torch.tensor([[7, 11, 23, 5, 99, 14]], device=device)
    with torch.no_grad():
        out = m.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=9,
                         output_scores=True, return_dict_in_generate=True)  # fmt: skip
        full = m(out.sequences).logits.float()
    for step, scores in enumerate(out.scores):
        assert (scores.float() - full[:, ids.shape[1] - 1 + step]).abs().max() < 1e-3, step


def test_fla_model_types_are_those_of_the_classes() -> None:
    from fot.models.fla_baselines import (
        _FLA_CLASSES,
        FLA_MODEL_TYPES,
        FLA_MODELS,
        _fla_models_module,
        fla_config_class,
    )

    fla = {getattr(_fla_models_module(), _FLA_CLASSES[n][0]).model_type for n in FLA_MODELS}
    assert fla | {fla_config_class(n).model_type for n in FLA_MODELS} == FLA_MODEL_TYPES


def test_fot_eval_runs_a_16_bit_fla_baseline_under_autocast_over_float32_weights(tmp_path):
    """load_checkpoint(dtype=bfloat16) keeps an FLA baseline's weights in float32 and runs it
    under autocast (FLA computes some gates in the weights' dtype). Oracle: the float32 model
    called inside torch.autocast, bit for bit."""
    from fot.eval.common import load_checkpoint, model_dtype
    from fot.export import export_hf

    m = tiny("mamba2").eval()
    export_hf(m, tmp_path / "hf")
    loaded, _ = load_checkpoint(tmp_path / "hf", device="cpu", dtype="bfloat16")
    assert loaded.compute_dtype == torch.bfloat16
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert model_dtype(loaded) == "bfloat16-autocast"
    x = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = loaded(x).logits
        losses = loaded.per_token_loss(x[:, :-1], x[:, 1:])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = m(x).logits
            want_losses = m.per_token_loss(x[:, :-1], x[:, 1:])
        plain = m(x).logits
    assert torch.equal(got, want) and torch.equal(losses, want_losses)
    assert not torch.equal(got.float(), plain)  # autocast did take effect
    float32, _ = load_checkpoint(tmp_path / "hf", device="cpu", dtype="float32")
    assert float32.compute_dtype is None and model_dtype(float32) == "float32"


@pytest.mark.gpu
def test_hgrn2_under_autocast_keeps_gates_that_bf16_weights_round_away() -> None:
    """FLA's HGRN2 computes its input gate 1 - exp(log_sigmoid(f)) in the weights' dtype: with
    bf16 weights the gates near 1 (long memory) round to no input at all; under autocast over
    float32 weights (what fot.eval runs, compute_dtype) exp runs in float32. Oracle: the
    float32 model, with forget-gate logits widened (x6) so that many gates are near 1."""
    from fot.convert import from_paper

    paper = Path(__file__).resolve().parent / "paper_checkpoints" / "hgrn2"
    model = from_paper(paper).cuda().eval()  # the paper's HGRN2: no lower bounds
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attn.f_proj.weight.mul_(6.0)
    x = torch.randint(0, 96, (2, 200), generator=torch.Generator().manual_seed(0)).cuda()
    autocast = copy.deepcopy(model)
    autocast.compute_dtype = torch.bfloat16
    weights16 = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x).logits.float()
        errors = [
            float((m(x).logits.float() - want).norm() / want.norm()) for m in (autocast, weights16)
        ]
    print(f"relative error: autocast {errors[0]:.2e}, bf16 weights {errors[1]:.2e}")
    assert errors[0] < errors[1]


@pytest.mark.parametrize("name", ["hgrn2", pytest.param("deltanet", marks=pytest.mark.gpu)])
def test_eval_logits_of_chosen_positions_run_the_models_own_path(name: str, device) -> None:
    """fot.eval's forgetting curve and lm-eval take the final hidden states and the head
    (``hidden_and_head``): for these models through the wrapper, with its kernel choice and
    its autocast. FLA's decoder called directly ran the chunked kernel, which fails beyond 64
    tokens in the interpreter (and refuses float32 DeltaNet on a GPU), and ran float32 where
    fot.eval runs bf16 autocast. Oracle: the model's own forward (called last: it sets the
    kernels)."""
    from fot.eval.common import hidden_and_head, next_token_argmax

    m = tiny(name, **SMALL).to(device).eval()
    m.compute_dtype = torch.bfloat16
    x = torch.randint(0, VOCAB, (1, 72), generator=torch.Generator().manual_seed(5)).to(device)
    with torch.no_grad():
        hidden, head = hidden_and_head(m, x)
        got = head(hidden).float()
        argmax = next_token_argmax(m, x, 60, 72)
        want = m(x).logits.float()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(argmax, want[:, 60:72].argmax(-1))


def test_fla_presets_are_fla_classes_at_paper_sizes() -> None:
    for name, cls in [
        ("mamba2", "Mamba2Config"),
        ("deltanet", "DeltaNetConfig"),
        ("hgrn2", "HGRN2Config"),
        ("samba", "SambaConfig"),
    ]:
        c = presets.config(name, "760m")
        base = type(c).__mro__[1]  # FLA's class, under fot's model type (fla_config_class)
        assert type(c).__name__ == f"FoT{cls}" and base.__name__ == cls
        assert base.__module__.startswith("fla.") and c.model_type == f"fot_{base.model_type}"
        assert c.vocab_size == 50257 and not c.tie_word_embeddings
    assert presets.config("deltanet", "760m").num_heads == 12
    assert presets.config("samba", "760m").attn["window_size"] == 2048
    for name in ("mamba2", "deltanet", "hgrn2"):
        with torch.device("meta"):
            m = presets.build_model(presets.config(name, "760m"))
        n = presets.count_params(m)
        assert 0.74e9 < n < 0.80e9, (name, n)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn present")
def test_samba_without_flash_attn_says_what_to_install(tmp_path) -> None:
    """train.py model=samba (under TRITON_INTERPRET=1, as the CPU refusal suggests) printed
    Hydra's traceback of the ImportError with status 1, after making the run folder: it is
    now refused with the config checks, in one line, and nothing is made."""
    with pytest.raises(ImportError, match="flash-attn"):
        presets.build_model(presets.config("samba", "tiny"))
    out = tmp_path / "run"
    res = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "model=samba", "data.seq_len=64",
         "total_tokens=1024", "data.val_tokens=128", f"out_dir={out}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1", "WANDB_MODE": "disabled"},
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.startswith(
        "train.py: error: model=samba: FLA's Samba uses flash-attn for its sliding-window "
        "attention layers: install it on the GPU machine (pip install flash-attn "
        "--no-build-isolation) to build 'samba'\n"
    )
    assert "Traceback" not in res.stderr, res.stderr
    assert not out.exists()


# Initialisation as the paper's code draws it (transformers 4.44, FLA at 1c5937e). Oracles:
# the distributions read off that code, with bounds and standard deviations computed here by
# hand: PyTorch's default init of nn.Linear / nn.Conv1d is U(+-1/sqrt(fan_in)), Xavier-uniform
# with gain g is U(+-g sqrt(6 / (fan_in + fan_out))), and U(+-b) has std b / sqrt(3).


def _is_uniform(w: torch.Tensor, bound: float) -> bool:
    """``w`` looks drawn from U(-bound, bound): inside it, reaching near its edge, and of std
    bound / sqrt(3) within 5 standard errors (the sample std's is sqrt(0.2 / n) relative)."""
    w = w.detach().float()
    tol = 5 * math.sqrt(0.2 / w.numel())
    return bool(
        w.abs().max() <= bound * (1 + 1e-6)
        and w.abs().max() > 0.9 * bound
        and abs(w.std().item() / (bound / math.sqrt(3)) - 1) < tol
    )


def _is_normal(w: torch.Tensor, std: float) -> bool:
    """``w`` looks drawn from N(0, std): its std within 5 standard errors (sqrt(0.5 / n)
    relative), and tails beyond the sqrt(3) std that bounds a uniform of that std."""
    w = w.detach().float()
    tol = 5 * math.sqrt(0.5 / w.numel())
    return bool(abs(w.std().item() / std - 1) < tol and w.abs().max() > 2.5 * std)


def _paper_sized(name: str, **overrides):
    """A small baseline with enough weights per matrix for the statistics (seeded)."""
    torch.manual_seed(0)
    fields = {"vocab_size": VOCAB, "hidden_size": 256, "num_hidden_layers": 4, **overrides}
    return presets.build_model(presets.config(name, "tiny", **fields))


@pytest.mark.parametrize("name", ["deltanet", "hgrn2"])
def test_deltanet_and_hgrn2_initialise_as_the_papers_code(name: str) -> None:
    """The paper's token mixer draws its linear layers from Xavier-uniform (gain 2^-2.5) and
    marks itself initialised, so transformers leaves it alone: o_proj is not rescaled and the
    short convolutions keep PyTorch's default. Its _init_weights then divides each MLP's
    down_proj, drawn from N(0, 0.02), by sqrt(2 x layers). FLA draws all of these from
    N(0, 0.02)."""
    m = _paper_sized(name)
    layers = 4
    for layer in m.model.layers:
        linears = {n: mod for n, mod in layer.attn.named_modules() if isinstance(mod, nn.Linear)}
        assert "o_proj" in linears and len(linears) >= 4, sorted(linears)
        for n, mod in linears.items():
            fan_out, fan_in = mod.weight.shape
            assert _is_uniform(mod.weight, 2**-2.5 * math.sqrt(6 / (fan_in + fan_out))), n
        convs = {n: mod for n, mod in layer.attn.named_modules() if isinstance(mod, nn.Conv1d)}
        assert len(convs) == (3 if name == "deltanet" else 0)  # the paper's configs
        for n, mod in convs.items():  # short convolutions: kernel 4, one channel per group
            assert _is_uniform(mod.weight, 1 / math.sqrt(4)), n
        assert _is_normal(layer.mlp.down_proj.weight, 0.02 / math.sqrt(2 * layers))
        assert _is_normal(layer.mlp.gate_proj.weight, 0.02)  # as FLA's
    assert _is_normal(m.lm_head.weight, 0.02) and _is_normal(m.model.embeddings.weight, 0.02)
    again = _paper_sized(name)  # seeded: the same weights
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), again.parameters()))


def test_mamba2_initialises_as_the_papers_code() -> None:
    """The paper's Mamba-2 sets A = 1, 2, ..., heads (FLA: U[1, 16]) and leaves in_proj,
    conv1d (weight and bias) and the LM head at PyTorch's default (FLA: N(0, 0.02), bias 0);
    its out_proj is U(+-1/sqrt(fan_in)) / sqrt(layers), as FLA's already."""
    m = _paper_sized("mamba2")
    hidden, layers = 256, 4  # num_hidden_layers as overridden (_paper_sized)
    for layer in m.backbone.layers:
        mixer = layer.mixer
        heads = mixer.A_log.numel()
        assert heads == 2 * hidden // 32  # expand 2, head_dim 32 (tiny)
        assert torch.equal(mixer.A_log.float(), torch.log(torch.arange(1.0, heads + 1)))
        assert _is_uniform(mixer.conv1d.weight, 1 / math.sqrt(4))  # kernel 4, one group each
        assert _is_uniform(mixer.conv1d.bias, 1 / math.sqrt(4))
        assert _is_uniform(mixer.in_proj.weight, 1 / math.sqrt(hidden))
        inner = mixer.out_proj.weight.shape[1]
        assert _is_uniform(mixer.out_proj.weight, 1 / math.sqrt(inner) / math.sqrt(layers))
    assert _is_uniform(m.lm_head.weight, 1 / math.sqrt(hidden))
    assert _is_normal(m.backbone.embeddings.weight, 0.02)


def test_mamba2s_note_on_its_conv1d_backend_is_logged_once_not_per_layer(caplog) -> None:
    """FLA's Mamba2 layer logs "Mamba2 does not recommend using Triton's conv1d backend" as
    it is built, where causal-conv1d is not installed: 24 identical lines for a 760M model,
    and again for every model built in the process."""
    with caplog.at_level(logging.WARNING):
        _paper_sized("mamba2")  # 4 layers
        _paper_sized("mamba2")
    notes = [r for r in caplog.records if "does not recommend using Triton" in r.getMessage()]
    assert len(notes) <= 1, [r.getMessage() for r in notes]


def _paper_samba_mlp_width(hidden: int, ratio: float) -> int:
    """The paper's SambaMLP width: 2/3 x ratio x hidden, rounded up to a multiple of 256."""
    width = int(hidden * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def test_samba_mamba_layers_have_the_papers_mlps_and_init() -> None:
    """A Samba without attention layers (attn=None: no flash-attn needed): every MLP is a Mamba
    layer's, of the paper's mamba_hidden_ratio 3 (FLA: 4). The paper draws every linear weight with
    PyTorch's default, o_proj/down_proj/out_proj divided by sqrt(2 x layers), and keeps the
    time-step projection's own init (FLA: all N(0, 0.02), no rescale)."""
    hidden, layers = 256, 4
    m = _paper_sized("samba", attn=None)
    assert m.config.mamba_hidden_ratio == 3 and m.config.hidden_ratio == 4
    width = _paper_samba_mlp_width(hidden, 3)
    scale = 1 / math.sqrt(2 * layers)
    for layer in m.backbone.layers:
        mlp, mixer = layer.mlp, layer.mixer
        assert mlp.down_proj.weight.shape == (hidden, width)
        assert mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape == (width, hidden)
        assert _is_uniform(mlp.gate_proj.weight, 1 / math.sqrt(hidden))
        assert _is_uniform(mlp.up_proj.weight, 1 / math.sqrt(hidden))
        assert _is_uniform(mlp.down_proj.weight, scale / math.sqrt(width))
        inner = 2 * hidden
        assert _is_uniform(mixer.in_proj.weight, 1 / math.sqrt(hidden))
        assert _is_uniform(mixer.x_proj.weight, 1 / math.sqrt(inner))
        assert _is_uniform(mixer.out_proj.weight, scale / math.sqrt(inner))
        rank = math.ceil(hidden / 16)  # dt_proj: U(+-rank^-0.5) (time_step_init_scheme random)
        assert _is_uniform(mixer.dt_proj.weight, rank**-0.5)
        assert torch.equal(mixer.A_log, torch.log(torch.arange(1.0, 17)).expand(inner, 16))
    assert _is_uniform(m.lm_head.weight, 1 / math.sqrt(hidden))


@pytest.mark.parametrize("value", [0, -3, 0.0, float("nan"), float("inf"), "3", True])
def test_a_samba_mamba_hidden_ratio_that_builds_no_mlp_is_refused_with_the_fix(
    value, tmp_path
) -> None:
    """mamba_hidden_ratio is fot's field, not FLA's: a value that gives no MLP width was taken
    by the config and failed while the model was built (0: IndexError in the init; "3": a
    TypeError; NaN: a ValueError of int()) or, for true, built MLPs of ratio 1. The config
    refuses it, naming the value and the fix, also when config.json holds it."""
    from transformers import AutoConfig

    from fot.models.fla_baselines import register_auto_classes

    message = rf"^mamba_hidden_ratio={re.escape(repr(value))}: it must be a positive number .*null"
    with pytest.raises(ValueError, match=message):
        presets.config("samba", "tiny", attn=None, mamba_hidden_ratio=value)
    register_auto_classes()
    good = presets.config("samba", "tiny", attn=None)
    good.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["mamba_hidden_ratio"] == 3
    saved["mamba_hidden_ratio"] = value
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path)
    # the ones that build: a ratio, a fractional one, and null (FLA's widths)
    for ok in (2, 2.5, None):
        assert (
            presets.config("samba", "tiny", attn=None, mamba_hidden_ratio=ok).mamba_hidden_ratio
            == ok
        )


@pytest.mark.parametrize(
    ("value", "hidden", "width"),
    [
        (1e-6, 128, 0),
        (0.01, 128, 0),
        (0.001, 768, 0),
        (1e300, 128, "8.53e+301"),
        (1e308, 128, "inf"),
    ],
)
def test_a_samba_mamba_hidden_ratio_whose_mlp_width_is_0_or_past_a_tensor_is_refused(
    value: float, hidden: int, width: int | str
) -> None:
    """FLA's GatedMLP is int(2/3 x ratio x hidden_size) wide, rounded up to a multiple of 256:
    a positive ratio below 1.5 / hidden_size gives width 0, which the config took and the
    model's init failed on (IndexError); one past a tensor dimension failed in the build
    (TypeError, or OverflowError of int(inf)). The config refuses both, naming the width at
    this hidden_size and, for a small one, the least ratio, which builds MLPs of width 256."""
    prefix = rf"^mamba_hidden_ratio={re.escape(repr(value))} gives the MLPs after Mamba layers "
    at = rf"a width of {re.escape(str(width))} at hidden_size={hidden} "
    if width == 0:
        least = 1.5 / hidden  # 0.01171875 at 128, 0.001953125 at 768: binary fractions, exact
        tail = rf".*: no MLP; it must be at least {re.escape(repr(least))} at this hidden_size"
    else:
        tail = r".*: more than a tensor dimension holds"
    with pytest.raises(ValueError, match=prefix + at + tail + r".*mamba_hidden_ratio=3$"):
        presets.config("samba", "tiny", attn=None, hidden_size=hidden, mamba_hidden_ratio=value)
    if width == 0:
        m = _paper_sized("samba", attn=None, hidden_size=hidden, mamba_hidden_ratio=least)
        assert m.backbone.layers[0].mlp.down_proj.weight.shape == (hidden, 256)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        ("deltanet", {"hidden_ratio": 0.001}, r"^hidden_ratio=0\.001 gives the MLPs a width of 0"),
        ("hgrn2", {"hidden_ratio": 0}, r"^hidden_ratio=0: it must be a positive number"),
        ("samba", {"hidden_ratio": 1e-6}, r"^hidden_ratio=1e-06 gives the MLPs after attention"),
        ("deltanet", {"intermediate_size": 0}, r"^intermediate_size=0: it must be a positive int"),
    ],
)
def test_an_fla_mlp_width_setting_that_builds_no_mlp_is_refused_by_the_config(
    name: str, overrides: dict, message: str
) -> None:
    """FLA's own MLP settings of the baselines with MLPs: a hidden_ratio giving width 0 (or an
    intermediate_size of 0) was taken by the config and failed in the model's init
    (IndexError); the config refuses it with the setting that works. An intermediate_size,
    which sizes DeltaNet's and HGRN2's MLPs, makes their hidden_ratio unused: not checked."""
    with pytest.raises(ValueError, match=message + r".*=(4|null)$"):
        presets.config(name, "tiny", **overrides)
    m = _paper_sized("deltanet", intermediate_size=512, hidden_ratio=0.001)
    assert m.model.layers[0].mlp.down_proj.weight.shape == (256, 512)
    # a Samba without attention layers, whose MLPs all take mamba_hidden_ratio: unused too
    m = _paper_sized("samba", attn=None, hidden_ratio=0.001, mamba_hidden_ratio=3)
    assert m.backbone.layers[0].mlp.down_proj.weight.shape == (256, 512)


def _paper_samba_params(hidden: int, layers: int, attn_layers: int, vocab: int = 50257) -> int:
    """Parameters of the paper's Samba without the input embedding, from its code: Mamba
    mixers (FLA's MambaMixer at 1c5937e: expand 2, state 16, conv 4 with bias, dt rank
    ceil(hidden / 16)), attention (q, k, v, o; as many k/v heads as q heads), SwiGLU MLPs of
    ratio 4 after attention and 3 after Mamba, two RMSNorms per layer, a final one, the LM
    head."""
    inner, state, rank, kernel = 2 * hidden, 16, math.ceil(hidden / 16), 4
    mamba = (
        hidden * 2 * inner  # in_proj
        + inner * kernel + inner  # conv1d
        + inner * (rank + 2 * state)  # x_proj
        + rank * inner + inner  # dt_proj
        + inner * state + inner  # A_log, D
        + inner * hidden  # out_proj
    )  # fmt: skip
    attention = 4 * hidden * hidden

    def mlp(ratio: float) -> int:
        return 3 * hidden * _paper_samba_mlp_width(hidden, ratio)

    mamba_layers = layers - attn_layers
    return (
        mamba_layers * (mamba + mlp(3))
        + attn_layers * (attention + mlp(4))
        + layers * 2 * hidden
        + hidden  # final norm
        + vocab * hidden  # LM head
    )


def test_samba_760m_without_attention_layers_has_the_papers_parameter_count() -> None:
    """At 760m (hidden 1536, 24 layers) with the attention layers left out (attn=None, which
    builds without flash-attn): the paper's formula for 24 Mamba layers. FLA's MLPs of ratio 4
    had 113M more here. The paper's 760m itself (12 Mamba, 12 attention layers) counts
    765,852,672 by the same formula."""
    assert _paper_samba_params(1536, 24, attn_layers=12) == 765_852_672
    with torch.device("meta"):
        m = presets.build_model(presets.config("samba", "760m", attn=None))
    assert presets.count_params(m) == _paper_samba_params(1536, 24, attn_layers=0)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="needs flash-attn")
def test_samba_760m_has_the_papers_parameter_count() -> None:
    """The paper's 760m Samba: 12 Mamba and 12 sliding-window attention layers, 765.9M
    parameters without the input embedding (FLA's Samba: 822.5M, MLPs of ratio 4 throughout)."""
    with torch.device("meta"):
        m = presets.build_model(presets.config("samba", "760m"))
    assert presets.count_params(m) == _paper_samba_params(1536, 24, attn_layers=12)


@pytest.mark.parametrize("name", ["deltanet", "hgrn2", "mamba2", "samba"])
def test_fla_baseline_from_pretrained_keeps_the_loaded_weights(name: str, tmp_path) -> None:
    """from_pretrained runs the paper's init only for weights it did not load: a saved model
    (weights moved off their init) loads bit for bit, Samba with its MLP widths (the config's
    mamba_hidden_ratio, saved in config.json). A folder saved before that field (FLA's widths)
    loads with FLA's widths."""
    from transformers import AutoModelForCausalLM

    from fot.models.fla_baselines import register_auto_classes

    register_auto_classes()
    overrides = {"attn": None} if name == "samba" else {}
    m = tiny(name) if name != "samba" else _paper_sized(name, **overrides)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    m.save_pretrained(tmp_path / "m")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert type(loaded) is type(m)
    for (key, a), b in zip(m.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), key
    if name == "samba":
        saved = json.loads((tmp_path / "m" / "config.json").read_text())
        assert saved["mamba_hidden_ratio"] == 3 == loaded.config.mamba_hidden_ratio
        fla_widths = _paper_sized(name, mamba_hidden_ratio=None, **overrides)
        fla_widths.save_pretrained(tmp_path / "old")
        saved = json.loads((tmp_path / "old" / "config.json").read_text())
        del saved["mamba_hidden_ratio"]  # as exported before the field
        (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
        old = AutoModelForCausalLM.from_pretrained(tmp_path / "old")
        width = _paper_samba_mlp_width(256, 4)
        assert {layer.mlp.down_proj.weight.shape[1] for layer in old.backbone.layers} == {width}
        for (key, a), b in zip(fla_widths.state_dict().items(), old.state_dict().values()):
            assert torch.equal(a, b), key


def test_fla_export_loads_fot_wrapper_with_trust_remote_code(tmp_path) -> None:
    import os
    import subprocess
    import sys

    from fot.export import export_hf

    m = tiny("hgrn2").eval()
    out = export_hf(m, tmp_path / "hgrn2", tokenizer=False)
    want = sum(p.double().sum().item() for p in m.parameters())
    resaved = tmp_path / "resaved"

    def load(folder: Path, save_to: Path | None = None) -> None:
        """In a fresh process: load ``folder`` with trust_remote_code (and save it again)."""
        code = (
            "import torch\n"
            "from transformers import AutoModelForCausalLM\n"
            f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)\n"
            "assert callable(m.per_token_loss)\n"
            + (f"m.save_pretrained({str(save_to)!r})\n" if save_to else "")
            + "print(type(m).__name__, sum(p.double().sum().item() for p in m.parameters()))\n"
        )
        # loading only (no forward: a fresh process has no conftest to tame Triton's autotuner)
        env = {**os.environ, "TRITON_INTERPRET": "1", "HF_MODULES_CACHE": str(tmp_path / "mods")}
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
        )
        assert res.returncode == 0, res.stderr[-2000:]
        name, value = res.stdout.strip().splitlines()[-1].split()
        assert name == "FoTHGRN2ForCausalLM" and abs(float(value) - want) < 1e-6

    load(out, save_to=resaved)
    # the re-saved folder loads the same way (its remote code is fot's again, not FLA's)
    load(resaved)
    # the weights are as readable as the config (safetensors alone would leave them 0600)
    for folder in (out, resaved):
        modes = {
            f: (folder / f).stat().st_mode & 0o777 for f in ("config.json", "model.safetensors")
        }
        assert len(set(modes.values())) == 1, modes
    assert (
        json.loads((resaved / "config.json").read_text())["auto_map"]
        == json.loads((out / "config.json").read_text())["auto_map"]
    )


def test_fla_export_loads_through_fot_eval_without_remote_code(tmp_path) -> None:
    from fot.eval.common import load_checkpoint
    from fot.export import export_hf

    m = tiny("hgrn2").eval()
    out = export_hf(m, tmp_path / "hgrn2")
    loaded, tok = load_checkpoint(out, device="cpu", dtype="float32")
    assert type(loaded).__name__ == "FoTHGRN2ForCausalLM"
    for (name, a), b in zip(m.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    assert tok("Hello world").input_ids == [50256, 15496, 995]  # BOS first, as in training


def test_exported_mamba2_never_loads_as_transformers_own_mamba2(tmp_path) -> None:
    """Under FLA's model type "mamba2" a folder loaded after ``import fot`` alone (or by
    ``lm_eval --model hf`` without trust_remote_code) silently became transformers' own
    Mamba2ForCausalLM, which computes other logits from the same weights (max |diff| 0.6 on
    logits of size ~1 measured here). Exported under "fot_mamba2", it is refused with the fix
    instead; folders exported before still load through fot.eval as fot's wrapper."""
    import os
    import subprocess
    import sys

    from fot.eval.common import load_checkpoint
    from fot.export import export_hf

    m = tiny("mamba2").eval()
    out = export_hf(m, tmp_path / "mamba2")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "fot_mamba2"
    code = (
        "import fot\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r})\n"
        "print(type(m).__name__)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_MODULES_CACHE": str(tmp_path / "mods")}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert res.returncode != 0 and "Mamba2ForCausalLM" not in res.stdout
    assert "trust_remote_code=True" in res.stderr
    # a folder of the earlier exports: FLA's model type, remote code naming FLA's config class
    config["model_type"] = "mamba2"
    config["auto_map"]["AutoConfig"] = "configuration_fot.Mamba2Config"
    (out / "config.json").write_text(json.dumps(config))
    loaded, _ = load_checkpoint(out, device="cpu", dtype="float32")
    assert type(loaded).__name__ == "FoTMamba2ForCausalLM"
    for (name, a), b in zip(m.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_mamba2_blocks_are_found_for_activation_checkpointing(device) -> None:
    """FLA's Mamba-2 keeps its blocks under ``backbone``, not ``model``: parallelize finds them,
    checkpoints each, and the checkpointed model gives the plain model's loss and gradients."""
    from fot.training.config import ParallelConfig
    from fot.training.parallel import DistInfo, parallelize

    model = tiny("mamba2").to(device)
    plain = copy.deepcopy(model)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    cfg = ParallelConfig(strategy="single", activation_checkpointing=True)
    assert parallelize(model, cfg, info, strategy="single") is model
    assert all(isinstance(b.forward, functools.partial) for b in model.backbone.layers)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0)).to(device)
    losses = []
    for m in (model, plain):
        loss = m(input_ids=ids, shift_labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_fla_baseline_on_cpu_is_refused_with_the_fix(tmp_path, monkeypatch) -> None:
    """Without CUDA (and without Triton's interpreter) FLA's kernels cannot run: the trainer
    says so before training, instead of Triton's '0 active drivers'."""
    from hydra import compose, initialize_config_dir

    from fot.training import register_configs, train

    register_configs()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    root = Path(__file__).resolve().parents[1]
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=["model=mamba2", "device=cpu", f"out_dir={tmp_path}", "wandb.mode=disabled"],
        )
    with pytest.raises(
        ValueError, match="model=mamba2 runs FLA's Triton kernels, which need a CUDA"
    ):
        train(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter path; GPU tests above")
def test_fla_baseline_runs_under_the_interpreter_outside_the_test_suite(tmp_path) -> None:
    """A user's ``TRITON_INTERPRET=1`` run (which the trainer's CPU message offers) without the
    test suite's autotuner patch: Triton's autotuner found no GPU driver to time on."""
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from fot import presets\n"
        f"config = presets.config('deltanet', 'tiny', vocab_size={VOCAB}, **{SMALL})\n"
        "m = presets.build_model(config)\n"
        f"x = torch.randint(0, {VOCAB}, (1, 16))\n"
        "loss = m(x, labels=x).loss\n"
        "loss.backward()\n"
        "print('loss', float(loss))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loss = float(done.stdout.split("loss")[-1])
    assert abs(loss - torch.log(torch.tensor(float(VOCAB))).item()) < 1.0  # near-uniform init


def test_trainer_label_smoothing_shifts_labels_for_fla_baselines(tmp_path, device) -> None:
    """HF's Trainer shifts labels for label smoothing only for class names it knows as causal
    LMs; the wrappers are added without displacing transformers' own Mamba2ForCausalLM."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    m = tiny("deltanet", **SMALL).to(device)
    names = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    assert {"FoTDeltaNetForCausalLM", "FoTMamba2ForCausalLM", "Mamba2ForCausalLM"} <= names
    from transformers import Mamba2Config

    hf_mamba2 = AutoModelForCausalLM.from_config(
        Mamba2Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_heads=2, head_dim=64
        )
    )
    assert type(hf_mamba2).__name__ == "Mamba2ForCausalLM"
    args = TrainingArguments(
        output_dir=str(tmp_path), label_smoothing_factor=0.1, use_cpu=device == "cpu",
        report_to=[], save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=m, args=args)
    x = torch.randint(0, VOCAB, (2, 12)).to(device)
    labels = x.clone()
    labels[0, :4] = -100
    with torch.no_grad():
        got = trainer.compute_loss(m, {"input_ids": x, "labels": labels.clone()})
        logp = torch.log_softmax(m(x).logits[:, :-1].double(), -1)
    target = labels[:, 1:]
    keep = target != -100
    nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].mean()
    expected = 0.9 * nll + 0.1 * (-logp.mean(-1))[keep].mean()
    assert abs(got.item() - expected.item()) < 1e-4


def test_loading_the_baselines_prints_no_fla_platform_note() -> None:
    """fot.eval on a GPT-2 or Llama folder registers the baselines (``import fla``), which on a
    machine without a GPU printed FLA's "Triton is not supported on current platform" warning
    before every command's output."""
    import subprocess
    import sys

    code = "from fot.models.fla_baselines import register_auto_classes; register_auto_classes()"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "Triton is not supported" not in res.stderr, res.stderr


@pytest.mark.parametrize("name", ["deltanet", "hgrn2"])
def test_an_exported_baseline_keeps_learning_its_bos_embedding(tmp_path, name: str) -> None:
    """FLA's DeltaNet and HGRN2 make ``config.pad_token_id`` their embedding's ``padding_idx``,
    whose row gets no gradient: an export whose config.json named the tokenizer's pad,
    <|endoftext|> (the models' BOS), would load into a model that never trains that row."""
    from transformers import AutoModelForCausalLM

    from fot.export import export_hf
    from fot.models.fla_baselines import register_auto_classes

    torch.manual_seed(0)
    m = presets.build_model(presets.config(name, "tiny", **SMALL))  # GPT-2's vocabulary: 50256
    out = export_hf(m, tmp_path / name)
    register_auto_classes()
    loaded = AutoModelForCausalLM.from_pretrained(out).train()
    ids = torch.tensor([[50256, 15496, 995, 50256, 15496]])
    loaded(ids, shift_labels=torch.tensor([[15496, 995, 50256, 15496, 995]])).loss.backward()
    grad = loaded.get_input_embeddings().weight.grad
    assert grad[50256].abs().sum() > 0 and grad[15496].abs().sum() > 0
