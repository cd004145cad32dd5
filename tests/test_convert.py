"""Checkpoints of the paper's code converted to fot models (fot.convert).

Oracle: the paper's own implementation. tests/paper_checkpoints/ holds tiny FoX and
Transformer models built, run and saved by the paper's package on a GPU
(tests/paper_checkpoints/make.py says how), with the logits it computed (float16 autocast,
which its attention kernel needs), and tiny DeltaNet, HGRN2 and Mamba-2 models of its recurrent
baselines, run on flash-linear-attention at the commit the paper pins. Their weights are large
enough that each component moves the logits: a wrong mapping (the shift gates flipped, gate and
up projections swapped, a norm weight dropped) gave relative errors of 0.33-0.88 on fox_pro,
the right one 1.4e-3.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fot.convert import ConversionError, from_paper, main

PAPER = Path(__file__).resolve().parent / "paper_checkpoints"
VARIANTS = [
    "fox_pro",
    "fox_pro_shared_qk_norm",
    "fox_llama",
    "transformer_pro",  # FoX type, fgate_type none
    "fox_llama_bias_only",
    "fox_pro_fixed",
    "transformer_llama",  # the paper's TransformerForCausalLM
    "transformer_swa",
    "transformer_gqa",
]


BASELINES = {  # the paper's recurrent baselines: relative tolerance against its logits
    "delta_net": 1e-2,  # measured 2.3e-3 (its reference comes from float16 autocast)
    "hgrn2": 1e-3,  # measured 2.4e-5 (float32, TF32 inside FLA's kernels)
    "mamba2": 1e-5,  # measured 4.8e-7 (float32 PyTorch scan)
}


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("variant", list(BASELINES))
def test_a_converted_paper_baseline_computes_the_papers_logits(variant: str) -> None:
    """DeltaNet, HGRN2 and Mamba-2 of the paper's code become fot's FLA baselines of the same
    function."""
    ref = np.load(PAPER / variant / "reference.npz")
    ids, want = torch.from_numpy(ref["input_ids"]), torch.from_numpy(ref["logits"])
    model = from_paper(PAPER / variant)
    assert model.config.model_type == "fot_" + json.loads(
        (PAPER / variant / "config.json").read_text()
    )["model_type"].removesuffix("-project_fox")
    got = _logits(model, ids)
    assert got.shape == want.shape
    assert (got - want).norm() / want.norm() < BASELINES[variant]


# The paper's 760M baseline configs: the defaults of its configs/model/{delta_net,hgrn2,mamba2}.py
# with its configs/experiment/longcrawl64/*/760m_48b.yaml on top, as its run wrote config.json
PAPER_760M = {
    "deltanet": {
        "model_type": "delta_net-project_fox", "vocab_size": 50257, "hidden_size": 1536,
        "num_hidden_layers": 24, "num_heads": 12, "expand_k": 1, "expand_v": 1,
        "use_gate": False, "use_short_conv": True, "conv_size": 4, "use_beta": True,
        "use_output_norm": True, "hidden_ratio": 4, "intermediate_size": None,
        "attn_mode": "chunk", "qk_norm": "l2", "qk_activation": "silu", "hidden_act": "swish",
        "max_position_embeddings": None, "norm_first": False, "norm_eps": 1e-6,
    },
    "hgrn2": {
        "model_type": "hgrn2-project_fox", "vocab_size": 50257, "hidden_size": 1536,
        "num_hidden_layers": 24, "attn_mode": "chunk", "num_heads": None, "expand_ratio": 128,
        "use_short_conv": False, "conv_size": 4, "use_lower_bound": True, "hidden_ratio": 4,
        "intermediate_size": None, "hidden_act": "swish", "max_position_embeddings": None,
        "elementwise_affine": True, "norm_eps": 1e-6,
    },
    "mamba2": {
        "model_type": "mamba2-project_fox", "vocab_size": 50257, "hidden_size": 1536,
        "num_hidden_layers": 48, "num_heads": 48, "head_dim": 64, "state_size": 128,
        "layer_norm_epsilon": 1e-5, "expand": 2, "conv_kernel": 4, "n_groups": 1,
        "use_bias": False, "use_conv_bias": True, "hidden_act": "silu",
        "residual_in_fp32": True, "time_step_limit": [0.0, float("inf")], "rms_norm": True,
        "chunk_size": 256,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(PAPER_760M))
def test_the_760m_baseline_presets_are_the_papers_760m_runs(name: str) -> None:
    """model=<baseline> size=760m builds the model of the paper's 760M run, field by field as
    init_from compares them, but for HGRN2's lower bounds, which the paper's code never
    applied (README)."""
    from fot import presets
    from fot.convert import fla_config_from_paper
    from fot.training.init_weights import _comparable

    paper = _comparable(fla_config_from_paper(PAPER_760M[name]))
    ours = _comparable(presets.config(name, "760m"))
    differ = {k: (paper.get(k), ours.get(k)) for k in paper.keys() | ours.keys()
              if paper.get(k) != ours.get(k)}  # fmt: skip
    assert differ == ({"use_lower_bound": (False, True)} if name == "hgrn2" else {})
    assert len(paper) > 10  # the fields compared


def test_the_papers_hgrn2_applies_no_lower_bounds_and_converts_without_them() -> None:
    """The paper's HGRN2 block drops the lower bound it is given (HGRN2Block.forward_attn), so
    its lower_bounds weight has no effect: the converted model has none. Applying them (FLA's
    HGRN2 with the paper's lower_bounds) computes something else (0.27 relative), which is how
    this was found."""
    from fot.convert import fla_config_from_paper
    from fot.models.fla_baselines import build_fla_model

    ref = np.load(PAPER / "hgrn2" / "reference.npz")
    ids, want = torch.from_numpy(ref["input_ids"]), torch.from_numpy(ref["logits"])
    cfg = json.loads((PAPER / "hgrn2" / "config.json").read_text())
    assert cfg["use_lower_bound"] is True
    converted = from_paper(PAPER / "hgrn2")
    assert converted.config.use_lower_bound is False
    assert "model.lower_bounds" not in converted.state_dict()
    config = fla_config_from_paper(cfg)
    config.use_lower_bound = True
    with_bounds = build_fla_model(config)
    bounds = load_file(PAPER / "hgrn2" / "model.safetensors")["model.lower_bounds"]
    with_bounds.load_state_dict({**converted.state_dict(), "model.lower_bounds": bounds})
    got = _logits(with_bounds, ids)
    assert (got - want).norm() / want.norm() > 0.1


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_converted_paper_checkpoint_computes_the_papers_logits(variant: str) -> None:
    ref = np.load(PAPER / variant / "reference.npz")
    ids, want = torch.from_numpy(ref["input_ids"]), torch.from_numpy(ref["logits"])
    got = _logits(from_paper(PAPER / variant), ids)
    assert got.shape == want.shape  # fot's padded vocabulary rows are cut off
    assert (got - want).norm() / want.norm() < 1e-2  # measured 1.25e-3 to 1.55e-3
    assert (got - want).abs().max() < 0.05  # measured 0.0080 to 0.0098; logits up to 4.65


@pytest.mark.parametrize("variant", ["fox_llama_bias_only", "fox_pro_fixed"])
def test_a_16_bit_conversion_keeps_the_data_independent_forget_gate_fp32(variant: str) -> None:
    """from_paper(dtype=bf16) (what fot.eval does with a paper checkpoint on CUDA) rounded
    the bias_only / fixed gates' per-head bias to bf16. Oracle: log sigmoid of the paper's
    float32 biases, read from its weight file."""
    paper = load_file(PAPER / variant / "model.safetensors")
    model = from_paper(PAPER / variant, dtype=torch.bfloat16)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    x = torch.zeros(1, 3, model.config.hidden_size, dtype=torch.bfloat16)
    for i, layer in enumerate(model.model.layers):
        bias = paper[f"model.layers.{i}.attn.fgate_bias"]
        assert not torch.equal(bias.bfloat16().float(), bias)  # bf16 would round it
        assert layer.self_attn.fgate_bias.dtype == torch.float32
        want = torch.nn.functional.logsigmoid(bias.double()).float().expand(1, 3, -1)
        torch.testing.assert_close(layer.self_attn.log_fgate(x), want, rtol=1e-6, atol=0)
    # the dtype by name, as --dtype and from_pretrained take it (was refused as no torch.dtype)
    named = from_paper(PAPER / variant, dtype="bfloat16")
    assert all(
        torch.equal(a, b) for a, b in zip(named.state_dict().values(), model.state_dict().values())
    )
    for bad in ("bf16", torch.int8):  # int8: was nn.Module.to's TypeError
        with pytest.raises(ValueError, match=r"is not a floating torch dtype \(torch.bfloat16"):
            from_paper(PAPER / variant, dtype=bad)


def test_the_command_writes_a_fot_export_that_loads_and_records_json_escaping(tmp_path, capsys):
    """The default JSON escaping is said with the flag for a model trained on plain text (it
    was recorded without a word)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fot.tokenizer import text_escaping_of

    src = PAPER / "fox_pro"
    capsys.readouterr()
    assert main([str(src), str(tmp_path / "fot")]) == 0
    # a checkpoint of the paper's code trained on plain text is told how to record that
    fix = f"--text-escaping none (python -m fot.convert {src} {tmp_path / 'fot'} --text-escaping"
    assert fix in capsys.readouterr().out
    ids = torch.from_numpy(np.load(src / "reference.npz")["input_ids"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fot")
    assert loaded.config.model_type == "fot"
    assert torch.equal(_logits(loaded, ids), _logits(from_paper(src), ids))
    # the paper's models were trained on LongCrawl64: JSON-escaped text
    assert text_escaping_of(AutoTokenizer.from_pretrained(tmp_path / "fot")) == "json"
    assert main([str(src), str(tmp_path / "plain"), "--text-escaping", "none"]) == 0
    assert text_escaping_of(AutoTokenizer.from_pretrained(tmp_path / "plain")) == "none"
    assert "--text-escaping" not in capsys.readouterr().out  # chosen: no note


def test_a_bf16_checkpoint_converts_to_a_bf16_export_unless_dtype_says_otherwise(tmp_path):
    """A bf16 source was written as float32, twice its size. Now the export keeps the source's
    dtype (as save_pretrained keeps a model's) and from_pretrained loads it so: the weights,
    read back as float32, are the source's bf16 values exactly, the forget gate float32.
    --dtype float32 writes float32."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bf16"
    src.mkdir()
    shutil.copyfile(PAPER / "fox_pro" / "config.json", src / "config.json")
    state = load_file(PAPER / "fox_pro" / "model.safetensors")
    save_file({k: v.bfloat16() for k, v in state.items()}, src / "model.safetensors")
    want = from_paper(src).state_dict()  # float32 of the bf16 values: exact
    assert main([str(src), str(tmp_path / "out")]) == 0
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert {d for k, d in dtypes.items() if "fgate" not in k} == {"BF16"}
    assert {d for k, d in dtypes.items() if "fgate" in k} == {"F32"}
    size = (tmp_path / "out" / "model.safetensors").stat().st_size
    assert size < 1.2 * (src / "model.safetensors").stat().st_size
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.layers[0].self_attn.fgate_proj.weight.dtype == torch.float32
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k].float(), want[k]) for k in want)
    assert main([str(src), str(tmp_path / "f32"), "--dtype", "float32"]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "f32")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_a_bf16_paper_baseline_converts_to_float32_unless_dtype_says_otherwise(tmp_path):
    """A bf16 Mamba-2 written as bf16 would load in bf16 and compute its A/dt and residual
    stream in bf16 (FLA's layers use the weights' dtype): by default it is written in float32,
    the source's bf16 values exactly; --dtype bfloat16 writes bf16."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from fot.models.fla_baselines import register_auto_classes

    register_auto_classes()
    src = tmp_path / "bf16"
    src.mkdir()
    shutil.copyfile(PAPER / "mamba2" / "config.json", src / "config.json")
    state = load_file(PAPER / "mamba2" / "model.safetensors")
    save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in state.items()},
              src / "model.safetensors")  # fmt: skip
    want = from_paper(src).state_dict()
    for flag, written in (([], {"F32"}), (["--dtype", "bfloat16"], {"BF16"})):
        out = tmp_path / f"out{len(flag)}"
        assert main([str(src), str(out), *flag]) == 0
        with safe_open(out / "model.safetensors", framework="pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == written  # noqa: SIM118
        loaded = AutoModelForCausalLM.from_pretrained(out)
        assert loaded.dtype == (torch.float32 if not flag else torch.bfloat16)
        got = loaded.state_dict()
        assert all(torch.equal(got[k].float(), want[k].float()) for k in want)


def test_tied_embeddings_convert_as_an_untied_copy_does(tmp_path) -> None:
    """A tied checkpoint stores no LM head (the embedding serves; fot's models are untied):
    converting it equals converting the same model written untied, with the embedding copied
    as the head."""
    src = PAPER / "fox_llama"
    state = load_file(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    untied, tied = tmp_path / "untied", tmp_path / "tied"
    for folder, tie in ((untied, False), (tied, True)):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": tie}))
        weights = dict(state, **{"lm_head.weight": state["model.embeddings.weight"].clone()})
        if tie:
            del weights["lm_head.weight"]
        save_file(weights, folder / "model.safetensors")
    ids = torch.from_numpy(np.load(src / "reference.npz")["input_ids"])
    assert torch.equal(_logits(from_paper(tied), ids), _logits(from_paper(untied), ids))


def _copy(
    tmp_path: Path,
    config: dict | None = None,
    drop: str | None = None,
    add: str | None = None,
    unset: str | None = None,
    source: str = "fox_pro",
) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(PAPER / source, folder)
    if config or unset:
        cfg = {**json.loads((folder / "config.json").read_text()), **(config or {})}
        cfg.pop(unset, None)
        (folder / "config.json").write_text(json.dumps(cfg))
    if drop or add:
        state = load_file(folder / "model.safetensors")
        if drop:
            del state[drop]
        if add:
            state[add] = torch.zeros(3)
        save_file(state, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(config={"model_type": "rwkv6-project_fox"}),
         r"model_type 'rwkv6-project_fox', not one of the paper's models: "),
        (dict(config={"model_type": "samba-project_fox"}),
         r"the paper's Samba, which fot does not convert: fot's samba is FLA's, whose "
         r"attention layers need the flash-attn package"),
        # the paper's baselines: settings the conversion is not checked for, bad sizes
        (dict(source="delta_net", config={"use_gate": True}),
         r"use_gate=True: fot converts the paper's delta_net-project_fox with use_gate=False"),
        (dict(source="delta_net", config={"use_short_conv": False}),
         r"use_short_conv=False: fot converts"),
        (dict(source="hgrn2", config={"num_heads": 4}),
         r"expand_ratio=32 and num_heads=4 with hidden_size=64: fot converts HGRN2 models"),
        (dict(source="mamba2", config={"head_dim": 16}),
         r"num_heads=4 and head_dim=16 with expand=2 and hidden_size=64: Mamba-2's heads"),
        (dict(source="mamba2", config={"n_groups": 2}), r"n_groups=2: fot converts"),
        # hand-edited values of the carried-over keys: named, not a failure at the first forward
        (dict(source="mamba2", config={"chunk_size": "32"}),
         r"chunk_size='32': it must be a positive integer"),
        (dict(source="mamba2", config={"layer_norm_epsilon": "1e-5"}),
         r"layer_norm_epsilon='1e-5': it must be a positive number"),
        (dict(source="mamba2", config={"residual_in_fp32": "true"}),
         r"residual_in_fp32='true': it must be true or false"),
        (dict(source="delta_net", config={"hidden_ratio": "4"}),
         r"hidden_ratio='4': it must be a positive integer"),
        (dict(source="hgrn2", config={"max_position_embeddings": 0}),
         r"max_position_embeddings=0: it must be a positive integer or null"),
        (dict(source="mamba2", config={"time_step_limit": [0.0, "x"]}),
         r"time_step_limit=\[0.0, 'x'\]: it must be two numbers"),
        (dict(source="mamba2", unset="state_size"),
         r"lacks the weight 'backbone.layers.0.mixer.A_log'|implies"),
        (dict(source="hgrn2", drop="model.layers.1.attn.g_norm.weight"),
         r"lacks the weight 'model.layers.1.attn.g_norm.weight'"),
        (dict(source="delta_net", config={"intermediate_size": 128}),
         r"'model.layers.0.mlp.gate_proj.weight' has shape \(512, 64\), where its "
         r"config.json implies \(256, 64\)"),
        (dict(config={"hidden_act": "sigmoid"}), r"hidden_act='sigmoid'; fot's FoT models have"),
        (dict(config={"num_kv_heads": 1}), r"num_kv_heads=1 with num_heads=2"),
        (dict(drop="model.layers.1.attn.k_proj.shift_proj.weight"),
         r"lacks the weight 'model.layers.1.attn.k_proj.shift_proj.weight'"),
        (dict(add="model.layers.0.attn.extra.weight"),
         r"does not use: \['model.layers.0.attn.extra.weight'\]"),
        # a config.json of another size: named, not a size-mismatch traceback of torch's
        (dict(config={"intermediate_size": 96}),
         r"'model.layers.0.mlp.gate_proj.weight' has shape \(160, 64\), where its "
         r"config.json implies \(192, 64\)"),
        # fewer vocabulary rows than the config says: before, padded with zeros unnoticed
        (dict(config={"vocab_size": 100}),
         r"'model.embeddings.weight' has shape \(96, 64\), where its config.json implies "
         r"\(100, 64\)"),
        # a hand-edited config.json: named, not a KeyError or int() traceback
        (dict(unset="num_heads"), r"config.json lacks it: num_heads must be a positive integer"),
        (dict(config={"hidden_size": "64"}),
         r"config.json sets hidden_size='64': hidden_size must be a positive integer"),
        (dict(config={"num_heads": 3}),
         r"hidden_size=64 with num_heads=3: the hidden size must be a multiple"),
        (dict(config={"qk_norm_share_param_across_head": True}),
         r"'model.layers.0.attn.q_norm.weight' has shape \(64,\), where its config.json "
         r"implies \(32,\)"),
        # the Transformer type's own settings
        (dict(source="transformer_gqa", config={"num_kv_heads": 2}),
         r"'model.layers.0.attn.k_proj.weight' has shape \(32, 64\), where its config.json "
         r"implies \(64, 64\)"),
        (dict(source="transformer_llama", config={"num_kv_heads": 3}),
         r"num_kv_heads=3 with num_heads=2: the key/value heads must be a positive integer "
         r"that divides the heads"),
        (dict(source="transformer_swa", config={"window_size": 0}),
         r"window_size=0: a sliding window is a positive number of tokens, or null"),
        (dict(source="transformer_swa", config={"window_size": "16"}),
         r"window_size='16': a sliding window"),
    ],
)  # fmt: skip
def test_what_fot_cannot_express_is_refused_by_name(tmp_path, change, message) -> None:
    with pytest.raises(ConversionError, match=message):
        from_paper(_copy(tmp_path, **change))


def test_the_command_names_a_bad_folder_in_one_line_with_status_2(tmp_path, capsys) -> None:
    assert main([str(tmp_path / "missing"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m fot.convert: error: ") and "' is no folder: pass" in err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m fot.convert: error: ") and "has no config.json" in err
    assert not (tmp_path / "out").exists()
    # a folder with other files (here the source itself) is no place for the export
    (tmp_path / "empty" / "notes.txt").write_text("mine")
    assert main([str(PAPER / "fox_pro"), str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "/empty is not empty (notes.txt) and holds no earlier export" in err, err
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["notes.txt"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_converted_paper_checkpoint_on_the_gpu_computes_the_papers_logits(variant, dtype):
    """The same oracle through fot's Triton kernels: float32 weights, and bf16 autocast (the
    paper's evaluation setting; bf16 keeps 3 mantissa bits fewer than the float16 reference).
    Measured on an H100: float32 1.4e-3 to 1.5e-3 relative, bf16 1.0e-2 to 1.1e-2; with the
    Transformer and gate-ablation checkpoints on an H200: float32 1.25e-3 to 1.55e-3, bf16
    1.0e-2 to 1.26e-2."""
    ref = np.load(PAPER / variant / "reference.npz")
    ids, want = torch.from_numpy(ref["input_ids"]).cuda(), torch.from_numpy(ref["logits"])
    model = from_paper(PAPER / variant).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        got = _logits(model, ids).cpu()
    tol = 1e-2 if dtype == torch.float32 else 3e-2
    assert (got - want).norm() / want.norm() < tol


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("variant", "dtype"),
    [("delta_net", torch.float32), ("delta_net", torch.bfloat16), ("hgrn2", torch.float32),
     ("hgrn2", torch.bfloat16), ("mamba2", torch.float32), ("mamba2", torch.bfloat16)],
)  # fmt: skip
def test_a_converted_paper_baseline_on_the_gpu_computes_the_papers_logits(variant, dtype):
    """The baselines through FLA's GPU kernels, in float32 and under bf16 autocast (float32
    DeltaNet on FLA's recurrent kernel: its chunked one refuses float32). Measured on an H200:
    DeltaNet bf16 1.6e-2; HGRN2 float32 4.6e-4, bf16 8.9e-3; Mamba-2 float32 3.0e-7, bf16
    8.4e-3."""
    ref = np.load(PAPER / variant / "reference.npz")
    ids, want = torch.from_numpy(ref["input_ids"]).cuda(), torch.from_numpy(ref["logits"])
    model = from_paper(PAPER / variant).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        got = _logits(model, ids).cpu()
    error = float((got - want).norm() / want.norm())
    print(f"{variant} {dtype}: {error:.2e}")
    assert error < (BASELINES[variant] if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("setting", [{"attention_bias": True}, {"elementwise_affine": False}])
def test_settings_the_papers_fox_ignores_convert_as_their_defaults_do(tmp_path, setting) -> None:
    """The paper's FoX builds its projections without bias and its norms with weights whatever
    attention_bias and elementwise_affine say (they are read by none of its modules): such a
    checkpoint holds the same weights and computes the same logits (before, it was refused as
    a setting fot cannot express)."""
    ids = torch.from_numpy(np.load(PAPER / "fox_pro" / "reference.npz")["input_ids"])
    got = _logits(from_paper(_copy(tmp_path, config=setting)), ids)
    assert torch.equal(got, _logits(from_paper(PAPER / "fox_pro"), ids))


def test_a_config_json_without_norm_eps_or_rope_base_converts_with_the_papers_defaults() -> None:
    """A FoX config.json that leaves out norm_eps and rope_base is the paper's model with its
    config class's defaults (ForgettingTransformerConfig: norm_eps=1e-6, rope_base=500000.0),
    which fot's config then holds."""
    from fot.convert import fot_config_from_paper

    cfg = json.loads((PAPER / "fox_pro" / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("norm_eps", "rope_base")}
    got = fot_config_from_paper({**cfg, "use_rope": True})
    assert (got.norm_eps, got.use_rope, got.rope_theta) == (1e-6, True, 500000.0)


def test_the_papers_pruning_tolerance_is_named_and_the_full_attention_converted(
    tmp_path, capsys
) -> None:
    """The paper's adaptive pruning (log_pruning_tolerance) drops small attention weights;
    fot prunes exactly: the conversion says so, and the model is the same as without it."""
    ids = torch.from_numpy(np.load(PAPER / "fox_pro" / "reference.npz")["input_ids"])
    folder = _copy(tmp_path, config={"log_pruning_tolerance": -10.0})
    assert main([str(folder), str(tmp_path / "fot")]) == 0
    assert "log_pruning_tolerance=-10.0, the paper's adaptive pruning" in capsys.readouterr().out
    assert torch.equal(
        _logits(from_paper(folder), ids), _logits(from_paper(PAPER / "fox_pro"), ids)
    )
    assert main([str(PAPER / "fox_pro"), str(tmp_path / "plain")]) == 0
    assert "log_pruning_tolerance" not in capsys.readouterr().out


def test_settings_the_papers_transformer_ignores_convert_as_their_defaults_do(tmp_path) -> None:
    """The paper's TransformerConfig keeps unknown keys, but its modules have no forget gate or
    Pro component and read none of them, and its MLP is SwiGLU whatever hidden_act names: such
    settings in its config.json change nothing."""
    ids = torch.from_numpy(np.load(PAPER / "transformer_llama" / "reference.npz")["input_ids"])
    fox_settings = {"fgate_type": "full", "qk_norm": True, "use_k_shift": True,
                    "use_output_gate": True, "ogate_act": "silu", "use_output_norm": True,
                    "hidden_act": "gelu"}  # fmt: skip
    folder = _copy(tmp_path, source="transformer_llama", config=fox_settings)
    got = _logits(from_paper(folder), ids)
    assert torch.equal(got, _logits(from_paper(PAPER / "transformer_llama"), ids))


@pytest.mark.parametrize(("variant", "setting"), [("transformer_swa", {"window_size": None}),
                                                  ("transformer_llama", {"use_rope": False})])  # fmt: skip
def test_the_transformers_window_and_rope_are_read_from_its_config(tmp_path, variant, setting):
    """The oracle test above can tell: the same weights without the window (16 of 77 tokens)
    or without RoPE compute logits far from the paper's."""
    ref = np.load(PAPER / variant / "reference.npz")
    ids, want = torch.from_numpy(ref["input_ids"]), torch.from_numpy(ref["logits"])
    got = _logits(from_paper(_copy(tmp_path, source=variant, config=setting)), ids)
    assert (got - want).norm() / want.norm() > 0.1


def test_a_config_json_that_is_not_an_object_is_named(tmp_path) -> None:
    folder = _copy(tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ConversionError, match=r"config.json holds a list, not an object"):
        from_paper(folder)


# flash-linear-attention's FoX (model_type forgetting_transformer). Oracle: FLA's own forward,
# run here (its Triton kernels: compiled on a GPU, the interpreter on the CPU).
FLA_VARIANTS = {
    "plain": {},
    "qk_norm_and_output_gate": {"qk_norm": True, "use_output_gate": True},
    "gqa_tied": {"num_kv_heads": 1, "qk_norm": True, "tie_word_embeddings": True},
}


def _fla_checkpoint(folder: Path, **settings) -> torch.nn.Module:
    """A tiny FLA FoX saved by FLA's save_pretrained into ``folder``; weights of unit-scale
    effect (as tests/paper_checkpoints/make.py draws them), so that every component shows."""
    from fla.models import ForgettingTransformerConfig, ForgettingTransformerForCausalLM

    config = ForgettingTransformerConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_heads=2,
        fuse_cross_entropy=False, **settings,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    model = ForgettingTransformerForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
            elif "f_proj" in name:
                p.copy_(2.0 + torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
    model.save_pretrained(folder)
    return model.eval()


def _fla_tolerance(device: torch.device) -> float:
    """Relative logits difference allowed against FLA's forward. Float32 both: 6e-7 to 7e-7
    measured on the CPU (wrong mappings: gate and up projections swapped 0.76-0.94, the q
    norm's weights left out 0.34-0.38). On a GPU FLA's compiled kernels multiply in TF32:
    0.89e-3 to 1.28e-3 on an H200, where fot's model on the GPU matched its CPU logits to
    7e-7."""
    return 1e-5 if device.type == "cpu" else 5e-3


@pytest.mark.parametrize("variant", list(FLA_VARIANTS))
def test_a_converted_fla_fox_checkpoint_computes_flas_logits(variant, tmp_path, device) -> None:
    from fot.convert import from_fla

    fla = _fla_checkpoint(tmp_path / "fla", **FLA_VARIANTS[variant]).to(device)
    ids = torch.randint(0, 96, (2, 77), generator=torch.Generator().manual_seed(1))
    want = _logits(fla, ids.to(device)).cpu()
    got = _logits(from_fla(tmp_path / "fla"), ids)
    assert got.shape == want.shape
    assert (got - want).norm() / want.norm() < _fla_tolerance(device)


def test_the_command_converts_an_fla_folder_with_its_own_tokenizer(tmp_path, device) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fot.tokenizer import save_hf_tokenizer, text_escaping_of

    fla = _fla_checkpoint(tmp_path / "fla", qk_norm=True).to(device)
    save_hf_tokenizer(tmp_path / "fla")  # stands in for the tokenizer FLA's model was trained with
    assert main([str(tmp_path / "fla"), str(tmp_path / "fot")]) == 0
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        assert (tmp_path / "fot" / name).read_bytes() == (tmp_path / "fla" / name).read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fot")
    assert loaded.config.model_type == "fot"
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    want = _logits(fla, ids.to(device)).cpu()
    assert (_logits(loaded, ids) - want).norm() / want.norm() < _fla_tolerance(device)
    assert text_escaping_of(AutoTokenizer.from_pretrained(tmp_path / "fot")) == "none"
    assert main([str(tmp_path / "fla"), str(tmp_path / "json"), "--text-escaping", "json"]) == 0
    assert text_escaping_of(AutoTokenizer.from_pretrained(tmp_path / "json")) == "json"


# the files of a Hugging Face tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")  # fmt: skip


def save_own_tokenizer(folder: Path) -> None:
    """Save a tokenizer that is not GPT-2's into ``folder`` (letters, ``<s>`` and ``</s>`` as
    ids 1 and 2, as Llama's, which FLA's flame trains with): ``tokenizer.json`` and
    ``tokenizer_config.json``, as ``save_pretrained`` of a fast tokenizer writes them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(97 + i): 3 + i for i in range(26)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=words, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)


def test_converting_into_an_earlier_export_leaves_only_the_new_models_tokenizer(
    tmp_path, capsys
) -> None:
    """An FLA FoX converted into the folder of an earlier export of the paper's model (the
    command takes an earlier export as its output) kept that export's GPT-2 vocab.json and
    merges.txt beside the FLA model's own tokenizer.json, and, where the FLA folder had no
    tokenizer, all of GPT-2's files (with its JSON escaping recorded) while it said to copy
    the model's tokenizer there: a tokenizer that was not the model's. The folder now holds
    exactly the FLA folder's tokenizer files, or none."""
    out = tmp_path / "out"
    assert main([str(PAPER / "fox_llama"), str(out)]) == 0
    assert (out / "vocab.json").is_file()
    fla = tmp_path / "fla"
    _fla_checkpoint(fla)
    assert main([str(fla), str(out)]) == 0
    assert not any((out / name).exists() for name in TOKENIZER_FILES)
    assert "holds no tokenizer files: copy the tokenizer" in capsys.readouterr().err
    assert main([str(PAPER / "fox_llama"), str(out)]) == 0
    save_own_tokenizer(fla)
    assert main([str(fla), str(out)]) == 0
    present = sorted(name for name in TOKENIZER_FILES if (out / name).exists())
    assert present == ["tokenizer.json", "tokenizer_config.json"]
    for name in present:
        assert (out / name).read_bytes() == (fla / name).read_bytes(), name


def test_converting_into_an_earlier_export_says_so_and_a_runs_final_export_is_refused(
    tmp_path, capsys
) -> None:
    """The command replaced any fot export without a word, a training run's ``hf/`` (its final
    weights) too. It now says where it replaces an earlier export, as fot.export does, and
    refuses a run's own export, leaving it as it was."""
    out = tmp_path / "out"
    assert main([str(PAPER / "fox_llama"), str(out)]) == 0
    assert ", replacing" not in capsys.readouterr().out
    assert main([str(PAPER / "fox_pro"), str(out)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"wrote {out} (") and first.endswith(
        ", replacing the earlier export there"
    ), first
    run = tmp_path / "run"
    assert main([str(PAPER / "fox_llama"), str(run / "hf")]) == 0
    (run / "run_info.json").write_text("[]\n")  # what makes a folder a training run's
    before = {p.name: p.read_bytes() for p in (run / "hf").iterdir()}
    capsys.readouterr()
    assert main([str(PAPER / "fox_pro"), str(run / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"python -m fot.convert: error: {run / 'hf'} holds the final weights of the training "
        f"run {run} (it may be their only copy) and is not replaced: write to a folder of its "
        f"own, e.g. checkpoints/fox_pro_760m, or move {run / 'hf'} away first"
    ), err
    assert before == {p.name: p.read_bytes() for p in (run / "hf").iterdir()}


@pytest.mark.parametrize(
    ("setting", "message"),
    [({"qkv_bias": True}, r"qkv_bias=true: fot's q/k/v projections have no bias"),
     ({"window_size": 16}, r"window_size=16, which FLA's FoX forward ignores"),
     ({"attnres_block_size": 2}, r"attnres_block_size=2: FLA's attention residuals"),
     ({"hidden_act": "powlu"}, r"hidden_act='powlu'; fot's MLP is SwiGLU")],
)  # fmt: skip
def test_fla_settings_fot_cannot_express_are_refused_by_name(tmp_path, setting, message) -> None:
    from fot.convert import fot_config_from_fla

    cfg = {"model_type": "forgetting_transformer", "vocab_size": 96, "hidden_size": 64,
           "num_hidden_layers": 2, "num_heads": 2, **setting}  # fmt: skip
    with pytest.raises(ConversionError, match=message):
        fot_config_from_fla(cfg)


def test_train_py_init_from_an_fla_folder_starts_from_flas_model(tmp_path, device) -> None:
    """init_from=<FLA FoX folder>: refused for fot_llama (RoPE) with the settings that build
    FLA's model, which then computes FLA's logits."""
    from fot import presets
    from fot.training.init_weights import (
        InitFromError,
        check_init_source,
        load_init_weights,
        read_init_source,
    )

    fla = _fla_checkpoint(tmp_path / "fla", qk_norm=True, use_output_gate=True).to(device)
    source = read_init_source(tmp_path / "fla")
    assert source.kind == "fla"
    with pytest.raises(InitFromError, match="set its values: ") as err:
        check_init_source(source, presets.config("fot_llama", "tiny"))
    overrides = {}
    for item in str(err.value).split("set its values: ")[1].split():
        key, value = item.removeprefix("++model.overrides.").split("=")
        overrides[key] = json.loads(value.lower()) if value in ("True", "False") else (
            float(value) if "." in value or "e-" in value else int(value))  # fmt: skip
    config = presets.config("fot_llama", "tiny", **overrides)
    check_init_source(source, config)
    model = presets.build_model(config)
    load_init_weights(source, model)
    ids = torch.randint(0, 96, (1, 50), generator=torch.Generator().manual_seed(3))
    want = _logits(fla, ids.to(device)).cpu()
    assert (_logits(model.eval(), ids) - want).norm() / want.norm() < _fla_tolerance(device)


def test_an_fla_folder_without_tokenizer_files_converts_and_says_what_to_copy(
    tmp_path, capsys
) -> None:
    _fla_checkpoint(tmp_path / "fla")
    assert main([str(tmp_path / "fla"), str(tmp_path / "fot")]) == 0
    err = capsys.readouterr().err
    assert "holds no tokenizer files: copy the tokenizer the model was trained with" in err
    assert (tmp_path / "fot" / "config.json").is_file()
    assert not (tmp_path / "fot" / "tokenizer_config.json").exists()


def test_the_command_takes_a_hub_repository_id_and_downloads_it(tmp_path, monkeypatch) -> None:
    """`python -m fot.convert owner/name OUT` downloads the repository (the hub's own
    snapshot_download, replaced here by the local folder it would return) and converts it."""
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append((repo_id, kwargs))
        return str(PAPER / "fox_llama")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert main(["zhixuan-lin/fox-llama-760m-longcrawl64-48b", str(tmp_path / "fot")]) == 0
    assert [repo for repo, _ in asked] == ["zhixuan-lin/fox-llama-760m-longcrawl64-48b"]
    assert "*.safetensors" in asked[0][1]["allow_patterns"]  # one download: it has them
    from transformers import AutoModelForCausalLM

    ids = torch.from_numpy(np.load(PAPER / "fox_llama" / "reference.npz")["input_ids"])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fot")
    assert torch.equal(_logits(loaded, ids), _logits(from_paper(PAPER / "fox_llama"), ids))


def test_a_hub_id_that_cannot_be_downloaded_is_one_error_line(tmp_path, capsys) -> None:
    """Offline (HF_HUB_OFFLINE=1 in the tests): the hub's own error, in one line with status 2,
    and nothing written."""
    assert main(["zhixuan-lin/no-such-model", str(tmp_path / "fot")]) == 2
    line, *rest = capsys.readouterr().err.strip().splitlines()
    assert rest == ["(set FOT_TRACEBACK=1 for the traceback)"]
    assert line.startswith(
        "python -m fot.convert: error: 'zhixuan-lin/no-such-model' is no local folder, and "
        "downloading it as a hub repository failed (LocalEntryNotFoundError: "
    ), line
    assert not (tmp_path / "fot").exists()


def test_a_local_folder_named_like_a_hub_id_is_the_folder(tmp_path, monkeypatch) -> None:
    import huggingface_hub

    from fot.hub import local_folder

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: 1 / 0)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(PAPER / "fox_pro", tmp_path / "owner" / "name")
    assert local_folder("owner/name") == Path("owner/name")
    assert main(["owner/name", str(tmp_path / "fot")]) == 0


def test_a_missing_folder_under_a_local_folder_is_no_hub_id(tmp_path, monkeypatch, capsys):
    """``runs/hf`` with a folder ``runs`` here is a typo'd local path: named as such, never
    downloaded (which would append the hub's offline error to the message)."""
    import huggingface_hub

    from fot.hub import is_hub_repo_id

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: 1 / 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert not is_hub_repo_id("runs/hf")
    assert is_hub_repo_id("owner/name") and not is_hub_repo_id("runs/hf/x")
    assert main(["runs/hf", str(tmp_path / "fot")]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert line == (
        "python -m fot.convert: error: 'runs/hf' is no folder: pass the folder of a checkpoint "
        "(downloaded or copied whole), or a hub repository id (owner/name)"
    ), line


def test_a_hub_repository_without_safetensors_downloads_its_bin_weights(tmp_path, monkeypatch):
    import huggingface_hub

    from fot.hub import local_folder

    first = tmp_path / "first"
    first.mkdir()
    (first / "config.json").write_text("{}")
    asked = []

    def snapshot_download(repo_id, allow_patterns):
        asked.append(allow_patterns)
        return str(first if len(asked) == 1 else PAPER / "fox_pro")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert local_folder("owner/name") == PAPER / "fox_pro"
    assert "*.bin" not in asked[0] and asked[1] == ["*.bin"]


def test_the_command_names_a_model_type_it_does_not_convert(tmp_path, capsys) -> None:
    folder = _copy(tmp_path, config={"model_type": "gla-project_fox"})
    assert main([str(folder), str(tmp_path / "out")]) == 2
    assert "model_type 'gla-project_fox': fot converts the paper's models (" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()
    folder = _copy(tmp_path / "samba", config={"model_type": "samba-project_fox"})
    assert main([str(folder), str(tmp_path / "out")]) == 2
    assert "the paper's Samba, which fot does not convert" in capsys.readouterr().err


def test_the_command_writes_a_paper_baseline_as_an_export_that_loads(tmp_path, capsys) -> None:
    """python -m fot.convert on the paper's Mamba-2: a fot_mamba2 folder that transformers loads
    (remote code) and fot.eval loads, with the converted logits; fot.eval also takes the
    paper's folder itself, converting on the fly."""
    from transformers import AutoModelForCausalLM

    from fot.eval.common import load_checkpoint
    from fot.tokenizer import text_escaping_of

    src = PAPER / "mamba2"
    assert main([str(src), str(tmp_path / "fot")]) == 0
    assert "model_type fot_mamba2" in capsys.readouterr().out
    ids = torch.from_numpy(np.load(src / "reference.npz")["input_ids"])
    want = _logits(from_paper(src), ids)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fot", trust_remote_code=True)
    assert loaded.config.model_type == "fot_mamba2"
    assert torch.equal(_logits(loaded, ids), want)
    for folder in (tmp_path / "fot", src):
        model, tokenizer = load_checkpoint(folder, device="cpu", dtype="float32")
        assert torch.equal(_logits(model, ids), want)
        assert text_escaping_of(tokenizer) == "json"
    assert "converted on the fly" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["hgrn2", "mamba2"])
def test_train_py_init_from_a_paper_baseline_names_its_settings_and_starts_from_it(name) -> None:
    """init_from=<the paper's HGRN2 or Mamba-2>: refused for the preset with the settings that
    build the paper's model (HGRN2: use_lower_bound=False among them), which then computes its
    logits. (Mamba-2's named hidden_size once failed to build: the preset fixed the head
    count.)"""
    from fot import presets
    from fot.training.init_weights import (
        InitFromError,
        check_init_source,
        load_init_weights,
        read_init_source,
    )

    source = read_init_source(PAPER / name)
    assert source.kind == "paper"
    with pytest.raises(InitFromError, match="set its values: ") as err:
        check_init_source(source, presets.config(name, "tiny"))
    assert "hidden_size=64" in str(err.value)
    if name == "hgrn2":
        assert "++model.overrides.use_lower_bound=False" in str(err.value)
    overrides = {}
    for item in str(err.value).split("set its values: ")[1].split():
        key, value = item.removeprefix("++model.overrides.").split("=")
        overrides[key] = value == "True" if value in ("True", "False") else int(value)
    config = presets.config(name, "tiny", **overrides)
    check_init_source(source, config)
    model = presets.build_model(config)
    load_init_weights(source, model)
    ref = np.load(PAPER / name / "reference.npz")
    want = torch.from_numpy(ref["logits"])
    got = _logits(model.eval(), torch.from_numpy(ref["input_ids"]))
    assert (got - want).norm() / want.norm() < BASELINES[name]


def test_a_fixed_gate_checkpoint_converts_with_the_decay_times_its_biases_come_from() -> None:
    """The paper's fixed forget gate is a buffer of per-head biases set from decay_time_min and
    decay_time_max (2 and 64 in fox_pro_fixed): the converted config keeps them (it took
    fot's defaults, 2 and 16384, which init_from then compared and asked a run to set), so a
    fresh model of that config holds the checkpoint's buffer. Oracle: the paper's values,
    b = logit(exp(-1/T)) for T log-uniform over [2, 64] across the heads."""
    import math

    from fot import presets
    from fot.convert import fot_config_from_paper

    cfg = json.loads((PAPER / "fox_pro_fixed" / "config.json").read_text())
    config = fot_config_from_paper(cfg)
    assert (config.fgate_type, config.decay_time_min, config.decay_time_max) == ("fixed", 2, 64)
    heads = config.num_heads
    times = torch.exp(torch.linspace(math.log(2.0), math.log(64.0), heads, dtype=torch.float64))
    want = torch.logit(torch.exp(-1.0 / times)).float()
    converted, fresh = from_paper(PAPER / "fox_pro_fixed"), presets.build_model(config)
    for i in range(config.num_hidden_layers):
        key = f"model.layers.{i}.self_attn.fgate_bias"
        torch.testing.assert_close(converted.state_dict()[key], want)
        torch.testing.assert_close(fresh.state_dict()[key], want)
