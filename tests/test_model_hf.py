"""Hugging Face compatibility of the FoT models (CPU, reference attention backend).

What HF tooling passes a causal LM must either work or fail loudly: padding-free collators'
packing keys, ``Trainer``'s gradient accumulation (``num_items_in_batch``) and label names,
``resize_token_embeddings``, LLaMA-named config fields, ``output_hidden_states`` /
``return_dict`` / ``output_attentions``, assisted decoding, ``from_pretrained(dtype=bf16)``,
HF cache objects, prompt caches reused for beam search and ``generate(inputs_embeds=...)``.

Oracles: separate per-document forwards (packing), the full batch without accumulation
(gradient accumulation), the model's own mean loss (evaluation), save/load round trips and the
model before resizing, a model built with the FoT field names, HF's ``LlamaModel`` with copied
weights (hidden states), the float32 checkpoint (bf16 load).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_model import TOL, VOCAB, count_fused_add_norm, ids, llama_config_like, max_err, tiny

import fot
from fot import presets
from fot.models.modeling_fot import CACHE_FIELD


def _docs(lengths: list[int]) -> list[torch.Tensor]:
    return [ids(1, n, seed=30 + i)[0] for i, n in enumerate(lengths)]


# ---------------------------------------------------------------------------------------
# 1. Packing keys of HF's padding-free collator
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["fot_pro", "transformer_pro"])
def test_flattening_collator_keys_pack_documents_like_cu_seqlens(model: str) -> None:
    from transformers import DataCollatorWithFlattening

    m = tiny(model)
    docs = _docs([5, 1, 9, 4])
    want = torch.cat([m(d[None]).logits for d in docs], dim=1)  # documents run separately
    features = [{"input_ids": d.tolist()} for d in docs]
    batches = [
        DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features),
        DataCollatorWithFlattening()(features),  # position_ids only
    ]
    # positions restarting at 2 (the collator's position_ids_start=2, from transformers 5.15)
    batches.append({**batches[1], "position_ids": batches[1]["position_ids"] + 2})
    for batch in batches:
        labels = batch.pop("labels")
        assert max_err(m(**batch).logits, want) < TOL, sorted(batch)
        # the loss of the packed batch is the mean over all documents' next-token losses
        loss = m(**batch, labels=labels).loss
        sep = [m(d[None], labels=d[None]).loss * (len(d) - 1) for d in docs]
        assert abs(loss.item() - (sum(sep) / sum(len(d) - 1 for d in docs)).item()) < 1e-5
    # cu_seq_lens_q alone is the same as cu_seqlens, in any integer dtype
    x = torch.cat(docs)[None]
    cu = torch.tensor([0, 5, 6, 15, 19])
    assert torch.equal(m(x, cu_seq_lens_q=cu).logits, m(x, cu_seqlens=cu.int()).logits)


def test_position_ids_that_never_restart_change_nothing() -> None:
    m = tiny("transformer_pro")  # RoPE: positions would matter if they were read as absolute
    x = ids(2, 12)
    want = m(x).logits
    assert torch.equal(m(x, position_ids=torch.arange(12)[None].expand(2, 12)).logits, want)
    assert max_err(m(x, position_ids=torch.arange(12)[None] + 7).logits, want) < TOL
    # HF's left-padding position ids (cumsum of the mask, padding at 0) are no documents
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(
        m(x, attention_mask=mask, position_ids=pos).logits, m(x, attention_mask=mask).logits
    )


def test_packing_keys_errors_and_unknown_kwargs_are_refused() -> None:
    m = tiny("fot_llama")
    x = ids(1, 10)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q .* and cu_seq_lens_k .* differ"):
        m(x, cu_seq_lens_q=torch.tensor([0, 4, 10]), cu_seq_lens_k=torch.tensor([0, 5, 10]))
    with pytest.raises(ValueError, match="either cu_seqlens or cu_seq_lens_q"):
        m(x, cu_seqlens=torch.tensor([0, 10]), cu_seq_lens_q=torch.tensor([0, 10]))
    restart = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6]] * 2)
    with pytest.raises(ValueError, match=r"restart within a row .*positions \[3\].*batch size 1"):
        m(ids(2, 10), position_ids=restart)
    with pytest.raises(ValueError, match="position_ids must be"):
        m(x, position_ids=torch.arange(9)[None])
    with pytest.raises(TypeError, match=r"\['seq_idx', 'token_type_ids'\]"):
        m(x, token_type_ids=torch.zeros_like(x), seq_idx=torch.zeros_like(x))
    # None values and generate()'s bookkeeping keys are harmless
    want = m(x).logits
    got = m(x, token_type_ids=None, cache_position=torch.arange(10), max_length_q=10).logits
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------
# 2, 3. HF Trainer: gradient accumulation and evaluation
# ---------------------------------------------------------------------------------------


def _lm_samples() -> list[dict[str, torch.Tensor]]:
    """Four sequences with different numbers of ignored labels (so that a mean of per-batch
    means differs from the mean over all tokens)."""
    samples = []
    for i, ignored in enumerate([0, 9, 3, 13]):
        x = ids(1, 16, seed=40 + i)[0]
        y = x.clone()
        y[:ignored] = -100
        samples.append({"input_ids": x, "labels": y})
    return samples


def _eval_trainer(model, tmp_path, compute_metrics=None, **args):
    """HF ``Trainer`` on the CPU for evaluation and loss checks (``args``: more
    ``TrainingArguments``)."""
    from transformers import Trainer, TrainingArguments

    settings = {"use_cpu": True, "report_to": [], "save_strategy": "no", "disable_tqdm": True}
    training_args = TrainingArguments(output_dir=str(tmp_path), **{**settings, **args})
    return Trainer(model=model, args=training_args, compute_metrics=compute_metrics)


def _train_one_step(tmp_path, batch_size: int, accumulation: int):
    from transformers import Trainer, TrainingArguments

    m = tiny("fot_pro").train()
    args = TrainingArguments(
        output_dir=str(tmp_path / f"bs{batch_size}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        learning_rate=0.5,
        optim="sgd",
        max_grad_norm=0.0,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = Trainer(model=m, args=args, train_dataset=_lm_samples())
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return m, logged


def test_trainer_gradient_accumulation_equals_full_batch(tmp_path) -> None:
    start = tiny("fot_pro")
    full, loss_full = _train_one_step(tmp_path, batch_size=4, accumulation=1)
    accum, loss_accum = _train_one_step(tmp_path, batch_size=2, accumulation=2)
    # the reference: the mean next-token loss over all four sequences
    batch = {k: torch.stack([s[k] for s in _lm_samples()]) for k in ("input_ids", "labels")}
    mean_loss = start.eval()(**batch).loss.item()
    assert len(loss_full) == len(loss_accum) == 1
    assert abs(loss_full[0] - mean_loss) < 1e-4
    assert abs(loss_accum[0] - mean_loss) < 1e-4
    deltas = []
    for (name, p0), p1, p2 in zip(
        start.named_parameters(), full.parameters(), accum.parameters(), strict=True
    ):
        d_full, d_accum = p1.detach() - p0.detach(), p2.detach() - p0.detach()
        assert (d_full - d_accum).abs().max() <= 1e-5 + 1e-4 * d_full.abs().max(), name
        deltas.append(d_full.abs().max().item())
    assert max(deltas) > 1e-3  # the step did move the weights


def test_num_items_in_batch_divides_the_summed_loss() -> None:
    m = tiny("fot_llama")
    x, y = ids(2, 9), ids(2, 9, seed=3)
    y[0, :4] = -100
    tokens = (y[:, 1:] != -100).sum()
    mean = m(x, labels=y).loss
    for n in (tokens.item(), tokens, 100):
        got = m(x, labels=y, num_items_in_batch=n).loss
        assert abs(got.item() - mean.item() * tokens.item() / int(n)) < 1e-5


def test_trainer_evaluate_reports_the_mean_loss(tmp_path) -> None:
    m = tiny("fot_pro")
    trainer = _eval_trainer(m, tmp_path, per_device_eval_batch_size=4)
    assert trainer.label_names == ["labels"]
    metrics = trainer.evaluate(eval_dataset=_lm_samples())
    batch = {k: torch.stack([s[k] for s in _lm_samples()]) for k in ("input_ids", "labels")}
    assert abs(metrics["eval_loss"] - m(**batch).loss.item()) < 1e-5


def test_shift_labels_keyword_still_selects_the_loss() -> None:
    m = tiny("fot_llama")
    x, y = ids(2, 9), ids(2, 9, seed=3)
    shifted = torch.nn.functional.pad(y[:, 1:], (0, 1), value=-100)
    assert torch.equal(m(x, shift_labels=shifted).loss, m(x, labels=y).loss)
    assert m(x, shift_labels=shifted).logits is None


# ---------------------------------------------------------------------------------------
# 4. resize_token_embeddings
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("new,multiple", [(VOCAB, None), (330, None), (250, None), (330, 128)])
def test_resize_token_embeddings_round_trips_and_keeps_old_tokens(
    new: int, multiple: int | None, tmp_path
) -> None:
    m = tiny("fot_pro")
    x = ids(2, 11) % min(new, VOCAB)
    before = m(x).logits
    old_embed = m.model.embed_tokens.weight.detach().clone()
    old_head = m.lm_head.weight.detach().clone()
    m.resize_token_embeddings(new, pad_to_multiple_of=multiple)
    rows = -(-new // (multiple or 64)) * (multiple or 64)
    assert m.config.vocab_size == new and m.config.padded_vocab_size == rows
    assert m.model.embed_tokens.weight.shape[0] == m.lm_head.weight.shape[0] == rows
    after = m(x).logits
    assert after.shape == (2, 11, new)
    keep = min(new, VOCAB)
    assert torch.equal(after[..., :keep], before[..., :keep])  # old tokens' logits unchanged
    if new > VOCAB:  # new tokens (also the old padding rows 300..319) get the mean row
        for w, old in ((m.model.embed_tokens.weight, old_embed), (m.lm_head.weight, old_head)):
            mean = old[:VOCAB].mean(0)
            assert torch.allclose(w[VOCAB:new], mean.expand(new - VOCAB, -1), atol=1e-7)
    m.save_pretrained(tmp_path)
    loaded = fot.FoTForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.vocab_size == new
    assert torch.equal(loaded(x).logits, after)


def test_resize_token_embeddings_without_mean_and_bad_values() -> None:
    m = tiny("fot_llama")
    m.resize_token_embeddings(400, mean_resizing=False)
    new_rows = m.model.embed_tokens.weight[VOCAB:400]
    assert 0.01 < new_rows.std().item() < 0.03  # N(0, initializer_range = 0.02)
    with pytest.raises(ValueError, match="new_num_tokens must be a positive int"):
        m.resize_token_embeddings(0)
    assert m.resize_token_embeddings() is m.model.embed_tokens  # no arguments: nothing changes


# ---------------------------------------------------------------------------------------
# 5. LLaMA-named config fields
# ---------------------------------------------------------------------------------------


def test_llama_named_config_fields_map_to_fot_fields() -> None:
    base = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "attn_backend": "reference",
    }
    cfg = fot.FoTConfig(num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-3, **base)
    ref = fot.FoTConfig(num_heads=4, num_kv_heads=2, norm_eps=1e-3, **base)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.norm_eps) == (4, 2, 1e-3)
    assert cfg.num_key_value_heads == 2 and cfg.rms_norm_eps == 1e-3  # read back by HF name
    assert "num_key_value_heads" not in cfg.to_dict() and "rms_norm_eps" not in cfg.to_dict()
    torch.manual_seed(0)
    m = fot.FoTForCausalLM(cfg).eval()
    torch.manual_seed(0)
    r = fot.FoTForCausalLM(ref).eval()
    assert m.model.layers[0].self_attn.k_proj.out_features == 2 * 16  # GQA: 2 KV heads
    assert m.model.norm.eps == 1e-3
    x = ids(1, 9)
    assert torch.equal(m(x).logits, r(x).logits)
    # default RoPE parameters map to rope_theta; zero dropout and silu are what FoT does
    base = {**base, "num_heads": 4, "use_rope": True}
    c = fot.FoTConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **base)
    assert c.rope_theta == 1e4 and "rope_parameters" not in c.to_dict()
    assert fot.FoTConfig(rope_theta=1e4, **base).to_dict() == c.to_dict()
    assert fot.FoTConfig(attention_dropout=0.0, hidden_act="silu", **base).to_dict() == (
        fot.FoTConfig(**base).to_dict()
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"attention_dropout": 0.1}, "attention_dropout=0.1: FoT models have no dropout"),
        ({"hidden_dropout": 0.1}, "hidden_dropout=0.1"),
        ({"dropout": 0.2}, "dropout=0.2"),
        ({"resid_pdrop": 0.1}, "resid_pdrop=0.1"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling=.*not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters=.*yarn"),
        ({"num_key_value_heads": 2, "num_kv_heads": 4}, "pass only num_kv_heads"),
        ({"attention_bias": True}, "attention_bias=True"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_llama_fields_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fot.FoTConfig(hidden_size=64, num_heads=4, **kwargs)


def test_a_misspelt_field_is_refused_and_other_unknown_keywords_are_stored() -> None:
    """FoTConfig(hidden_sise=...) used to store the typo and build the default width."""
    for typo, field in (("hidden_sise", "hidden_size"), ("use_k_shfit", "use_k_shift")):
        with pytest.raises(ValueError, match=rf"FoTConfig got {typo}=.*did you mean {field}="):
            fot.FoTConfig(hidden_size=64, num_heads=4, **{typo: 32})
    c = fot.FoTConfig(hidden_size=64, num_heads=4, my_experiment_tag="a", num_labels=3)
    assert c.my_experiment_tag == "a" and c.num_labels == 3


@pytest.mark.parametrize(
    "kwargs,match",
    [
        # the FoT name at its default value: was dropped silently for the LLaMA name's value
        ({"num_heads": 12, "num_attention_heads": 8}, "num_heads=12 and num_attention_heads=8"),
        ({"norm_eps": 1e-6, "rms_norm_eps": 1e-5}, "norm_eps=1e-06 and rms_norm_eps=1e-05"),
        ({"num_kv_heads": None, "num_key_value_heads": 4}, "num_kv_heads=None and num_key_va"),
        (
            {
                "rope_theta": 500000.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
            },
            r"rope_parameters\['rope_theta'\]=10000.0 and rope_theta=500000.0",
        ),
    ],
)
def test_a_setting_under_two_names_with_different_values_is_refused(
    kwargs: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match + ".*pass only"):
        fot.FoTConfig(hidden_size=768, **kwargs)


def test_a_setting_under_two_names_with_equal_values_loads(tmp_path) -> None:
    """A config.json (written by other tooling, say) may carry both names of a setting; where
    the values agree it loads, and the config saves and loads as the one with FoT names."""
    import json

    from transformers import AutoConfig

    both = {
        "num_heads": 12,
        "num_attention_heads": 12,
        "num_kv_heads": None,  # as many as num_heads
        "num_key_value_heads": 12,
        "norm_eps": 1e-6,
        "rms_norm_eps": 1e-6,
        "rope_theta": 500000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    }
    plain = fot.FoTConfig(hidden_size=768).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**plain, **both}))
    loads = (fot.FoTConfig.from_pretrained, AutoConfig.from_pretrained)
    for cfg in (fot.FoTConfig(hidden_size=768, **both), *(load(tmp_path) for load in loads)):
        assert (cfg.num_heads, cfg.kv_heads, cfg.norm_eps, cfg.rope_theta) == (12, 12, 1e-6, 5e5)
    assert fot.FoTConfig.from_dict(cfg.to_dict()).to_dict() == cfg.to_dict()
    # an override under one name replaces the saved values under both
    assert fot.FoTConfig.from_pretrained(tmp_path, rms_norm_eps=1e-5).norm_eps == 1e-5
    (tmp_path / "config.json").write_text(json.dumps({**plain, "num_attention_heads": 8}))
    with pytest.raises(ValueError, match="num_heads=12 and num_attention_heads=8"):
        fot.FoTConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "load", ["FoTConfig", "AutoConfig", "AutoModelForCausalLM", "FoTForCausalLM", "json_file"]
)
def test_a_config_json_refused_names_the_file(tmp_path, load: str) -> None:
    """A model folder's config.json with a setting under two names that disagree, or a gate
    initialisation its gate does not read, was refused without naming the file: the error
    now begins with its path. A keyword override's error names no file (the file is fine),
    and a config built in code keeps its message."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM

    loader = {
        "FoTConfig": fot.FoTConfig.from_pretrained,
        "AutoConfig": AutoConfig.from_pretrained,
        "AutoModelForCausalLM": AutoModelForCausalLM.from_pretrained,
        "FoTForCausalLM": fot.FoTForCausalLM.from_pretrained,
        "json_file": lambda folder, **kw: fot.FoTConfig.from_json_file(folder / "config.json"),
    }[load]
    folder = tmp_path / "model"
    folder.mkdir()
    plain = fot.FoTConfig(hidden_size=64, num_heads=4, num_hidden_layers=1).to_dict()
    refused = [
        ({"num_attention_heads": 8}, "num_heads=4 and num_attention_heads=8 name the same "
         "setting with different values; pass only num_heads"),
        ({"fgate_type": "fixed", "fgate_bias_init": 5.0}, "FoTConfig has fgate_type='fixed', "
         "whose forget gate does not read fgate_bias_init=5.0: "),
    ]  # fmt: skip
    for bad, says in refused:
        (folder / "config.json").write_text(json.dumps({**plain, **bad}))
        with pytest.raises(ValueError) as info:
            loader(folder)
        assert str(info.value).startswith(f"{folder / 'config.json'}: {says}"), str(info.value)
        with pytest.raises(ValueError) as info:  # in code: as before
            fot.FoTConfig(**{**plain, **bad})
        assert str(info.value).startswith(says)
    if load != "json_file":  # an override's error: the saved file is fine
        (folder / "config.json").write_text(json.dumps(plain))
        with pytest.raises(ValueError) as info:
            loader(folder, num_attention_heads=8, num_heads=2)
        assert str(info.value).startswith("num_heads=2 and num_attention_heads=8 name")


@pytest.mark.parametrize("load", ["FoTConfig", "AutoConfig", "AutoModelForCausalLM"])
def test_a_run_folder_loads_with_subfolder_hf_and_a_refused_config_names_its_file(
    tmp_path, load: str
) -> None:
    """A training run's folder holds its export in hf/: from_pretrained(run, subfolder="hf")
    loads it (the same logits as the folder itself). A setting refused there was named as
    <run>/config.json, a file that does not exist, through AutoConfig and
    AutoModelForCausalLM (transformers tells the config the folder, not the subfolder): the
    error now begins with <run>/hf/config.json."""
    import json

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from fot.export import export_hf

    loader = {
        "FoTConfig": fot.FoTConfig.from_pretrained,
        "AutoConfig": AutoConfig.from_pretrained,
        "AutoModelForCausalLM": AutoModelForCausalLM.from_pretrained,
    }[load]
    run = tmp_path / "run"
    model = tiny("fot_pro").eval()
    export_hf(model, run / "hf")
    (run / "checkpoints").mkdir()  # beside it, as in a run's folder
    loaded = loader(run, subfolder="hf")
    config = loaded if load != "AutoModelForCausalLM" else loaded.config
    direct = fot.FoTConfig.from_pretrained(run / "hf").to_dict()
    assert {**config.to_dict(), "_name_or_path": ""} == {**direct, "_name_or_path": ""}
    if load == "AutoModelForCausalLM":
        x = ids(2, 9)
        assert torch.equal(loaded.eval()(x).logits, model(x).logits)
        tok = AutoTokenizer.from_pretrained(run, subfolder="hf")
        assert tok("Hi")["input_ids"] == [50256, 17250]  # <|endoftext|> Hi, GPT-2's ids
    file = run / "hf" / "config.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "num_attention_heads": 3}))
    with pytest.raises(ValueError) as info:
        loader(run, subfolder="hf")
    assert str(info.value).startswith(f"{file}: num_heads="), str(info.value)


def test_a_folder_without_config_json_is_refused_naming_the_folder_to_pass(tmp_path) -> None:
    """transformers reads a local folder without config.json as the default config:
    FoTConfig.from_pretrained gave a 12-layer, 768-wide config for a run folder, a training
    checkpoint or a folder holding only the weights, and FoTForCausalLM.from_pretrained then
    said it found no model.safetensors (in a run folder) or built that default model around
    the weights it found. Now each is a FileNotFoundError naming the folder to pass."""
    import shutil

    from fot.export import export_hf

    run = tmp_path / "run"
    export_hf(tiny("fot_pro"), run / "hf")
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    for name in ("model.pt", "trainer.json"):
        (step / name).write_text("")
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    shutil.copy(run / "hf" / "model.safetensors", weights_only)
    says = {
        run: f"is a training run folder, not an exported checkpoint; pass its Hugging Face "
        f"export {str(run / 'hf')!r}",
        step: f"`python -m fot.export {step} {run / 'hf_step_00000004'}`",
        weights_only: f"checkpoint folder {str(weights_only)!r} has no config.json",
    }
    for folder, message in says.items():
        for load in (fot.FoTConfig.from_pretrained, fot.FoTForCausalLM.from_pretrained):
            with pytest.raises(FileNotFoundError) as info:
                load(folder)
            assert message in str(info.value), (load, str(info.value))
    with pytest.raises(FileNotFoundError, match="is a training run folder"):
        fot.FoTForCausalLM.from_pretrained(tmp_path, subfolder="run")
    # the folders that hold a config.json load as before
    assert fot.FoTConfig.from_pretrained(run, subfolder="hf").hidden_size == 128
    assert fot.FoTConfig.from_pretrained(run / "hf" / "config.json").hidden_size == 128


# ---------------------------------------------------------------------------------------
# 6. output_hidden_states / return_dict / output_attentions
# ---------------------------------------------------------------------------------------


def test_hidden_states_follow_hf_llama() -> None:
    from transformers import LlamaModel

    m = tiny("transformer_llama")
    c = m.config
    llama = LlamaModel(llama_config_like(c)).eval()
    missing, unexpected = llama.load_state_dict(m.model.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    x = ids(2, 13)
    want = llama(x, output_hidden_states=True).hidden_states
    out = m(x, output_hidden_states=True)
    assert len(out.hidden_states) == len(want) == c.num_hidden_layers + 1
    for i, (a, b) in enumerate(zip(out.hidden_states, want)):
        assert max_err(a, b) < 1e-4, i
    base = m.model(x, output_hidden_states=True)
    assert torch.equal(base.hidden_states[-1], base.last_hidden_state)
    assert torch.equal(out.logits, m(x).logits) and m(x).hidden_states is None


def test_return_dict_false_gives_tuples_and_attentions_are_refused() -> None:
    m = tiny("fot_pro")
    x, y = ids(2, 7), ids(2, 7, seed=4)
    out = m(x, return_dict=False)
    assert isinstance(out, tuple) and len(out) == 1 and torch.equal(out[0], m(x).logits)
    loss, logits = m(x, labels=y, return_dict=False)[0], m(x).logits
    assert torch.equal(loss, m(x, labels=y).loss) and logits is not None
    cached = m(x, use_cache=True, return_dict=False)
    assert len(cached) == 2 and isinstance(cached[1], fot.models.FoTCache)
    base = m.model(x, return_dict=False)
    assert isinstance(base, tuple) and torch.equal(base[0], m.model(x).last_hidden_state)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        m(x, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        m.generate(x, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True)
    gen = m.generate(
        x,
        max_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
        output_hidden_states=True,
        return_dict_in_generate=True,
    )
    assert len(gen.hidden_states) == 3  # one tuple per step
    prefill = gen.hidden_states[0]
    assert len(prefill) == m.config.num_hidden_layers + 1 and prefill[0].shape[1] == 7
    full = m(x, output_hidden_states=True).hidden_states
    assert all(max_err(a, b) < TOL for a, b in zip(prefill, full))


# ---------------------------------------------------------------------------------------
# 7. Assisted / prompt-lookup decoding
# ---------------------------------------------------------------------------------------


def test_assisted_and_prompt_lookup_decoding_are_refused_clearly() -> None:
    m = tiny("fot_pro")
    x = ids(1, 8)
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    with pytest.raises(ValueError, match=r"assisted / speculative decoding .* cannot be cropped"):
        m.generate(x, prompt_lookup_num_tokens=2, **kw)
    with pytest.raises(ValueError, match="assisted / speculative decoding"):
        m.generate(x, assistant_model=tiny("fot_llama"), **kw)
    assert m.generate(x, **kw).shape == (1, 11)  # plain decoding unaffected


# ---------------------------------------------------------------------------------------
# 8. from_pretrained(dtype=bf16) and 16-bit casts keep the forget gate in float32
# ---------------------------------------------------------------------------------------


def test_16_bit_models_keep_forget_gate_projection_fp32(tmp_path) -> None:
    # from_pretrained(dtype=bf16) and a cast (model.to(torch.bfloat16), .half()) keep the
    # gate's projection fp32: the cast used to round it (6.3 -> 6.3125: 0.36 nats of decay
    # over 16k tokens). Oracle: the fp32 model's gate weights, and the bf16 load's logits.
    m = tiny("fot_pro").eval()
    with torch.no_grad():  # biases that bf16 cannot hold exactly
        for layer in m.model.layers:
            layer.self_attn.fgate_proj.bias.fill_(6.3)
    m.save_pretrained(tmp_path)
    loaded = fot.FoTForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    x = ids(2, 12)
    assert max_err(loaded(x).logits, m(x).logits) < 0.1  # a bf16 model, close to fp32
    assert torch.isfinite(loaded(x, labels=x).loss)
    fp32 = [layer.self_attn.fgate_proj for layer in m.model.layers]
    fp32 = [(g.weight.clone(), g.bias.clone()) for g in fp32]
    m.to(torch.bfloat16)
    for model in (loaded, m):
        for layer, (weight, bias) in zip(model.model.layers, fp32):
            gate = layer.self_attn.fgate_proj
            assert gate.weight.dtype == gate.bias.dtype == torch.float32
            assert torch.equal(gate.weight, weight) and torch.equal(gate.bias, bias)
            assert layer.self_attn.q_proj.weight.dtype == torch.bfloat16
    assert torch.equal(m(x).logits, loaded(x).logits)
    gate = m.model.layers[0].self_attn.fgate_proj
    m.half()
    assert gate.weight.dtype == torch.float32 and m.lm_head.weight.dtype == torch.float16
    m.double()  # other casts apply as usual
    assert gate.weight.dtype == torch.float64 == m.lm_head.weight.dtype


def _per_head_log_f(model: fot.FoTForCausalLM, batch: int, length: int) -> torch.Tensor:
    """``[L, B, T, HQ]`` log forget gates of a data-independent gate (its input's values do
    not matter; its dtype is the model's)."""
    dtype = model.model.embed_tokens.weight.dtype
    x = torch.zeros(batch, length, model.config.hidden_size, dtype=dtype)
    return torch.stack([layer.self_attn.log_fgate(x) for layer in model.model.layers])


@pytest.mark.parametrize("model", ["fot_pro_bias_only", "fot_llama_fixed"])
def test_16_bit_models_keep_the_data_independent_forget_gate_fp32(model: str, tmp_path) -> None:
    # The bias_only gate's Parameter and the fixed gate's buffer (fgate_bias) were rounded by
    # model.to(torch.bfloat16) and .half(): bf16 moved log f of a head by up to 1.7%, 5 nats
    # of decay over 16k tokens. Oracle: log sigmoid of the float32 biases, computed here.
    m = tiny(model)
    m.save_pretrained(tmp_path)
    biases = torch.stack([layer.self_attn.fgate_bias.detach() for layer in m.model.layers])
    assert not torch.equal(biases.bfloat16().float(), biases)  # bf16 would round them
    want = F.logsigmoid(biases.double()).float()[:, None, None, :].expand(-1, 2, 5, -1)
    fp32 = _per_head_log_f(m, 2, 5)
    assert torch.allclose(fp32, want, rtol=1e-6, atol=0)
    casts = {
        "from_pretrained(dtype=bf16)": lambda: fot.FoTForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16
        ),
        "to(bf16)": lambda: fot.FoTForCausalLM.from_pretrained(tmp_path).to(torch.bfloat16),
        "half()": lambda: fot.FoTForCausalLM.from_pretrained(tmp_path).half(),
    }
    for how, cast in casts.items():
        cast_model = cast().eval()
        assert cast_model.model.layers[0].self_attn.q_proj.weight.dtype != torch.float32, how
        for layer in cast_model.model.layers:
            assert layer.self_attn.fgate_bias.dtype == torch.float32, how
        got = _per_head_log_f(cast_model, 2, 5)
        assert got.dtype == torch.float32 and torch.equal(got, fp32), how
        assert torch.isfinite(cast_model(ids(2, 12)).logits).all(), how
    m.double()  # other casts apply as usual
    assert m.model.layers[0].self_attn.fgate_bias.dtype == torch.float64


@pytest.mark.parametrize("model", ["fot_pro", "fot_llama_bias_only"])
def test_offloaded_device_map_computes_what_the_plain_load_does(model: str, tmp_path) -> None:
    # from_pretrained(device_map=...) with offloaded modules keeps their weights on the meta
    # device except inside accelerate's hooks, which replace module.forward: the LM head read
    # directly gave garbage logits, the final norm's and forget gate's fused paths raised.
    # Oracle: the same checkpoint loaded without a device map.
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    tiny(model).save_pretrained(tmp_path / "ckpt")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.norm": "disk",
        "lm_head": "disk",
    }
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=device_map, offload_folder=tmp_path / "offload"
    ).eval()
    assert offloaded.lm_head.weight.device.type == "meta"  # really offloaded
    x = ids(2, 11)
    with torch.no_grad():
        assert max_err(offloaded(x).logits, plain(x).logits) < TOL
        assert abs(offloaded(x, labels=x).loss.item() - plain(x, labels=x).loss.item()) < 1e-5
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(offloaded.generate(x, **kw), plain.generate(x, **kw))


def test_device_map_without_offloading_keeps_the_fused_kernels(tmp_path, monkeypatch) -> None:
    """accelerate hooks every submodule of a dispatched model. Without offloading its hooks
    only move inputs, so the fused paths that read weights may run; they were skipped for
    every hooked module, so a model split over GPUs ran unfused (slower). Offloaded modules
    (weights on the meta device outside the call) must still run as modules.

    Oracles: the fused add + norm's calls counted in the plain model, and logits bit-equal to
    the plain model whose offloaded layer is made to run unfused by a no-op hook."""
    pytest.importorskip("accelerate")
    import copy

    from accelerate import dispatch_model

    calls = count_fused_add_norm(monkeypatch)
    plain = tiny("fot_pro", attn_backend="triton")  # the fused paths, also on the CPU
    x = ids(2, 12)
    with torch.no_grad():
        plain(x)
    per_forward = len(calls)
    assert per_forward == 2 * plain.config.num_hidden_layers + 1  # two per layer, final norm
    device_map = {
        "model.embed_tokens": "cpu",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",  # offloaded: weights on the meta device outside the call
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    split = dispatch_model(
        copy.deepcopy(plain), device_map=device_map, offload_dir=tmp_path, force_hooks=True
    )
    assert split.model.layers[0].self_attn.q_proj._hf_hook is not None  # hooked, not offloaded
    assert split.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    oracle = copy.deepcopy(plain)
    for module in oracle.model.layers[1].modules():  # runs as modules, like the offloaded layer
        module.register_forward_pre_hook(lambda *_: None)
    calls.clear()
    with torch.no_grad():
        got = split(x).logits
    assert len(calls) == per_forward - 2  # all but the offloaded layer's two
    with torch.no_grad():
        assert torch.equal(got, oracle(x).logits)
        assert torch.equal(split(x, labels=x).loss, oracle(x, labels=x).loss)


def test_layer_context_moves_with_accelerate_hooks() -> None:
    # A device_map over several GPUs: accelerate's hook on each layer moves the layer's
    # arguments to its device with send_to_device, which moves what has a .to(). The per-forward
    # context (RoPE tables, masks, document starts) had none, so a layer on the second GPU got
    # tensors on the first. Oracle: the same fields, moved one by one ("meta" stands in for a
    # second device on this machine).
    pytest.importorskip("accelerate")
    from accelerate.utils import send_to_device

    m = tiny("transformer_llama")  # with RoPE
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # padding: key and query masks are set
    ctx = m.model._context(2, 8, torch.device("cpu"), mask, None, 0)
    moved = send_to_device((ctx, None), "meta")[0]
    fields = ("cu_seqlens", "doc_starts", "key_mask", "query_mask")
    for name in fields:
        before, after = getattr(ctx, name), getattr(moved, name)
        assert (before is None) == (after is None)
        if after is not None:
            assert after.device.type == "meta" and after.shape == before.shape
            assert before.device.type == "cpu"  # the original is left alone
    assert ctx.key_mask is not None and ctx.rope is not None
    assert all(t.device.type == "meta" for t in moved.rope)
    packed = m.model._context(1, 8, torch.device("cpu"), None, torch.tensor([0, 3, 8]), 0)
    moved = send_to_device(packed, "meta")
    assert moved.cu_seqlens.device.type == moved.doc_starts.device.type == "meta"


@pytest.mark.parametrize(
    "device_map,one_device",
    [
        (None, True),
        ({"": 0}, True),
        ({"model": 0, "lm_head": "cuda:0"}, True),
        ({"model": "cuda", "lm_head": 0}, True),
        ({"model": 0, "lm_head": 1}, False),
        ({"model": 0, "lm_head": "cpu"}, False),
        ({"model": 0, "lm_head": "disk"}, False),
        ({"": "cpu"}, False),
    ],
)
def test_decode_cuda_graphs_only_on_one_device(device_map, one_device: bool) -> None:
    # A CUDA graph records one device's stream and cannot copy offloaded weights in: generate()
    # captures only when the device map keeps every module on one GPU.
    from fot.models.modeling_fot import _on_one_device

    m = tiny("fot_pro")
    if device_map is not None:
        m.hf_device_map = device_map
    assert _on_one_device(m) is one_device


# ---------------------------------------------------------------------------------------
# FLA baselines: the same contract (shift_labels keyword, num_items_in_batch, packing keys)
# ---------------------------------------------------------------------------------------


def test_fla_baseline_num_items_and_packing_keys(device) -> None:
    """FLA's Triton kernels: on ``device`` (conftest: CUDA if there is one, else CPU under the
    interpreter); every tensor goes there, compiled kernels cannot read CPU tensors."""
    torch.manual_seed(0)
    cfg = presets.config("deltanet", "tiny", vocab_size=VOCAB, num_hidden_layers=1)
    m = presets.build_model(cfg).to(device)
    x, y = ids(1, 16).to(device), ids(1, 16, seed=3).to(device)
    y[0, :5] = -100
    mean = m(x, shift_labels=y).loss
    assert (
        abs(m(x, shift_labels=y, num_items_in_batch=22).loss.item() - mean.item() * 11 / 22) < 1e-5
    )
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device=device)
    want = m(x, shift_labels=y, cu_seqlens=cu).loss
    got = m(x, shift_labels=y, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=8).loss
    assert abs(got.item() - want.item()) < 1e-6
    pos = torch.cat([torch.arange(8), torch.arange(8)])[None].to(device)
    assert abs(m(x, shift_labels=y, position_ids=pos).loss.item() - want.item()) < 1e-6
    from transformers.utils.generic import find_labels

    assert find_labels(type(m)) == ["labels"]


def test_fla_baseline_labels_in_eval_mode_give_trainer_metrics_the_logits(device, tmp_path) -> None:
    # A labels forward of a baseline returned logits=None in eval mode too, so HF Trainer's
    # evaluate / predict handed compute_metrics an empty tuple for predictions, silently; and
    # return_dict=False gave the ModelOutput, which `loss, logits = ...` unpacked into its
    # key names. Oracle: the model's own logits forward and loss (as for FoT models).
    torch.manual_seed(0)
    cfg = presets.config("hgrn2", "tiny", vocab_size=VOCAB, num_hidden_layers=1)
    m = presets.build_model(cfg).to(device).eval()
    samples = _lm_samples()[:2]
    batch = {k: torch.stack([s[k] for s in samples]).to(device) for k in ("input_ids", "labels")}
    want = m(batch["input_ids"]).logits.float()
    loss = m(**batch).loss
    seen = {}

    def metrics(pred) -> dict:
        seen["logits"] = pred.predictions
        return {}

    use_cpu = device.type == "cpu"
    trainer = _eval_trainer(m, tmp_path, metrics, per_device_eval_batch_size=2, use_cpu=use_cpu)
    result = trainer.evaluate(eval_dataset=samples)
    assert torch.allclose(torch.as_tensor(seen["logits"]).to(device), want, atol=1e-5)
    assert abs(result["eval_loss"] - loss.item()) < 1e-5
    got_loss, got_logits = m(**batch, return_dict=False)
    assert torch.equal(got_loss, loss) and torch.allclose(got_logits, want, atol=1e-6)
    # the memory contract stays: training mode and shift_labels never form the logits
    assert m.train()(**batch).logits is None
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    assert m.eval()(batch["input_ids"], shift_labels=shifted).logits is None


# ---------------------------------------------------------------------------------------
# 10. HF cache objects: refused with the fix; the suggested FoTCache works in generate()
# ---------------------------------------------------------------------------------------


def test_hf_cache_is_refused_with_a_fix_that_works() -> None:
    from transformers import DynamicCache

    m = tiny("fot_pro")
    x = ids(1, 6)
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    fix = r"got DynamicCache: .*Omit past_key_values.*fot\.models\.FoTCache\(config\.num_hidden_layers\)"
    with pytest.raises(TypeError, match=fix):
        m.generate(x, **{CACHE_FIELD: DynamicCache()}, **kw)
    with pytest.raises(TypeError, match=fix):
        m(x, past_key_values=DynamicCache(), use_cache=True)
    cache = fot.models.FoTCache(m.config.num_hidden_layers)  # what the message suggests
    got = m.generate(x, **{CACHE_FIELD: cache}, **kw)
    assert torch.equal(got, m.generate(x, use_cache=False, **kw))
    assert cache.get_seq_length() == 9  # filled in place: prompt + 3 fed-back tokens


def test_logits_to_keep_as_a_count_or_as_positions() -> None:
    # HF's logits_to_keep is an int (the last n positions) or a 1-D tensor of positions; the
    # tensor failed with "Boolean value of Tensor with more than one value is ambiguous".
    m = tiny("fot_llama")
    x = ids(2, 9)
    full = m(x).logits
    assert max_err(m(x, logits_to_keep=3).logits, full[:, -3:]) < TOL
    assert max_err(m(x, logits_to_keep=torch.tensor([0, 4, 8])).logits, full[:, [0, 4, 8]]) < TOL


def test_generate_from_inputs_embeds_equals_generate_from_ids() -> None:
    # generate() inspects prepare_inputs_for_generation's signature for inputs_embeds; FoT
    # overrides that hook (to drop generate-only keys) and must keep the parameter visible.
    m = tiny("fot_pro")
    x = ids(2, 7)
    kw = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    from_ids = m.generate(x, **kw)
    from_embeds = m.generate(inputs_embeds=m.get_input_embeddings()(x), **kw)
    assert torch.equal(from_embeds, from_ids[:, 7:])


def test_prompt_cache_reused_for_beam_search() -> None:
    # A prompt cache of one sequence passed to generate(num_beams=2) failed deep inside the
    # KV-shift (generate expands the inputs, not the cache); now a clear error names the fix,
    # and the fix gives the uncached beams.
    import copy

    m = tiny("fot_pro")
    x = ids(1, 9)
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0, "num_beams": 2}
    with torch.no_grad():
        prompt = m(x[:, :5], use_cache=True).past_key_values
    with pytest.raises(ValueError, match=r"holds 1 sequences .* 2 rows.*batch_repeat_interleave"):
        m.generate(x, **{CACHE_FIELD: copy.deepcopy(prompt)}, **kw)
    cache = copy.deepcopy(prompt)
    cache.batch_repeat_interleave(2)
    assert torch.equal(
        m.generate(x, **{CACHE_FIELD: cache}, **kw), m.generate(x, use_cache=False, **kw)
    )


def test_continuing_from_a_beam_search_cache_is_refused_with_the_fix() -> None:
    # The cache of a beam search holds every beam's row (4 for 2 sequences x 2 beams); passed
    # back with the 2 returned sequences, the error told to repeat the cache (8 rows). Now it
    # says that cache cannot be continued from; its fix (no cache) gives the uncached decode.
    m = tiny("fot_pro")
    x = ids(2, 6)
    kw = {"do_sample": False, "pad_token_id": 0}
    out = m.generate(x, num_beams=2, max_new_tokens=3, return_dict_in_generate=True, **kw)
    cache = getattr(out, CACHE_FIELD)  # out.cache (transformers >= 5.24), as the README shows
    assert cache[0].keys.shape[0] == 4
    with pytest.raises(ValueError, match=r"holds 4 sequences .* 2 rows.*beam search.*no cache"):
        m.generate(out.sequences, **{CACHE_FIELD: cache}, max_new_tokens=2, **kw)
    got = m.generate(out.sequences, max_new_tokens=2, **kw)
    assert torch.equal(got, m.generate(out.sequences, max_new_tokens=2, use_cache=False, **kw))


def _tiny_or_fla(model: str) -> torch.nn.Module:
    """:func:`tiny` of a FoT preset; for the FLA baseline ``deltanet`` its tiny preset as built
    (tiny's overrides are FoT's), under the same seed."""
    torch.manual_seed(0)
    if model == "deltanet":
        return presets.build_model(presets.config(model, "tiny", vocab_size=VOCAB)).eval()
    return tiny(model)


@pytest.mark.parametrize("model", ["fot_pro", "deltanet"])
def test_right_padded_generate_is_refused_and_left_padding_is_the_fix(model: str) -> None:
    # A right-padded batch generated from its padding tokens: each padded row continued from
    # the last (padding) position, silently another text than its prompt alone gives
    # (transformers only logs a warning). It is refused before any forward; left padding,
    # which the message names, gives each prompt's own continuation.
    m = _tiny_or_fla(model)
    short, long = ids(1, 3, seed=5), ids(1, 6, seed=6)
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    right = torch.cat([torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], 1), long])
    right_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1] * 6])
    with pytest.raises(
        ValueError, match=r"0 at the last position of row\(s\) 0 \(right pad.*'left'"
    ):
        m.generate(right, attention_mask=right_mask, **kw)
    if model == "deltanet":
        return  # FLA's generate under Triton's interpreter: the refusal is what is checked
    left = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), long])
    got = m.generate(left, attention_mask=right_mask.flip(1), **kw)
    for row, prompt in ((0, short), (1, long)):
        assert torch.equal(got[row, -4:], m.generate(prompt, **kw)[0, -4:])


@pytest.mark.parametrize("model", ["fot_pro", "transformer_llama", "deltanet"])
def test_continuous_batching_is_refused_naming_generate(model: str) -> None:
    # transformers' generate_batch swaps in its paged attention and a paged K/V cache, which
    # these layers never read: a FoT model's request failed (an error logged, no tokens
    # returned), an FLA baseline stopped on "num_key_value_heads ... could not be found". It is
    # refused before any forward, naming generate(); generate() of the same prompt decodes it.
    from transformers import GenerationConfig

    m = _tiny_or_fla(model)
    forwards = []
    m.register_forward_pre_hook(lambda *_: forwards.append(1))
    gen = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=None, pad_token_id=0)
    with pytest.raises(NotImplementedError, match=r"continuous batching.*with generate\(\)"):
        m.generate_batch(inputs=[[1, 2, 3, 4]], generation_config=gen)
    with pytest.raises(NotImplementedError, match=r"continuous batching"):
        m.init_continuous_batching(generation_config=gen)
    assert not forwards
    if model == "deltanet":
        return  # FLA's generate under Triton's interpreter: the refusal is what is checked
    x = torch.tensor([[1, 2, 3, 4]])
    got = m.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(got, m.generate(x, max_new_tokens=3, do_sample=False, use_cache=False))


@pytest.mark.parametrize("model", ["fot_pro", "deltanet"])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_id(model: str) -> None:
    # An id >= vocab_size (a tokenizer of another model) failed deep in the embedding (an
    # IndexError on the CPU, a device-side assert on CUDA) or, among the padding rows
    # (vocab_size to padded_vocab_size), silently read an untrained row. generate() refuses
    # it once, before any forward (on a GPU no forward checks: that would be a host sync per
    # step); a forward on CPU tensors refuses it too.
    m = _tiny_or_fla(model)
    vocab = m.config.vocab_size
    kw = {"max_new_tokens": 2, "do_sample": False, "pad_token_id": 0}
    forwards = []
    m.register_forward_pre_hook(lambda *_: forwards.append(1))
    rows = getattr(m.config, "padded_vocab_size", vocab + 1)  # embedding rows
    for bad in sorted({vocab, rows - 1, rows + 7}):
        x = ids(2, 5)
        x[1, 3] = bad
        fix = rf"token id {bad}, but the model's vocab_size is {vocab} \(ids 0 to {vocab - 1}\)"
        with pytest.raises(ValueError, match=fix + ".*tokenizer does not match the model"):
            m.generate(x, **kw)
        with pytest.raises(ValueError, match=fix):
            m.generate(input_ids=x, **kw)  # the prompt as a keyword argument
        assert not forwards, "generate() must refuse before its first forward"
        with pytest.raises(ValueError, match=fix):
            m(x)
        forwards.clear()
    x = ids(2, 5)
    x[0, 1] = -3
    with pytest.raises(ValueError, match=r"negative token id -3: token ids run from 0 to"):
        m.generate(x, **kw)
    assert not forwards
    with pytest.raises(ValueError, match=r"negative token id -3"):
        m(x)
    x[0, 1], x[1, 2] = 0, vocab - 1  # the two ends of the vocabulary are tokens
    assert m(x).logits.shape == (2, 5, vocab)
    if model != "deltanet":  # FLA's generate under Triton's interpreter is not what is tested
        assert m.generate(x, **kw).shape == (2, 7)


@pytest.mark.parametrize("model", ["fot_pro", "fot_llama", "transformer_pro"])
def test_empty_input_is_refused_with_the_fix(model: str) -> None:
    # An empty prompt used to fail deep inside (the KV-shift cache's last token, or
    # torch.cat of no chunks); every entry point now names it.
    m = tiny(model)
    empty = torch.zeros(2, 0, dtype=torch.long)
    kw = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    fix = r"the input has no tokens \(shape \(2, 0\)\): pass at least one token per row"
    with pytest.raises(ValueError, match=fix):
        m(empty)
    with pytest.raises(ValueError, match=fix):
        m(empty, labels=empty)
    with pytest.raises(ValueError, match=fix):
        m(empty, use_cache=True)
    with pytest.raises(ValueError, match=fix):
        # without pad_token_id: with it, transformers' own right-padding check fails first
        m.generate(empty, max_new_tokens=3, do_sample=False)
    one = torch.zeros(2, 1, dtype=torch.long)  # what the message suggests: one start token
    assert m.generate(one, **kw).shape == (2, 4)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("fgate_type", "bias-only", "unknown fgate_type 'bias-only'"),
        ("num_heads", 3, r"hidden_size \(\d+\) must be divisible by num_heads \(3\)"),
        ("qk_norm", "no", "qk_norm must be true or false"),
    ],
)
def test_config_edited_after_construction_is_checked_when_the_model_is_built(
    field: str, value: object, match: str
) -> None:
    cfg = presets.config("fot_pro", "tiny", vocab_size=VOCAB, attn_backend="reference")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=match):
        presets.build_model(cfg)
    with pytest.raises(ValueError, match=match):
        fot.FoTForCausalLM(cfg)


def test_a_foreign_config_is_refused_by_type() -> None:
    from transformers import LlamaConfig

    with pytest.raises(TypeError, match="needs a FoTConfig, got LlamaConfig"):
        fot.FoTForCausalLM(LlamaConfig())


def test_trainer_label_smoothing_scores_next_tokens(tmp_path) -> None:
    """HF's Trainer shifts labels for label smoothing only for models it knows as causal LMs."""
    m = tiny("fot_pro")
    trainer = _eval_trainer(m, tmp_path, label_smoothing_factor=0.1)
    batch = {k: torch.stack([s[k] for s in _lm_samples()]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        got = trainer.compute_loss(m, dict(batch))
        logp = torch.log_softmax(m(batch["input_ids"]).logits[:, :-1].double(), -1)
    target = batch["labels"][:, 1:]
    keep = target != -100
    nll = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].mean()
    uniform = -logp.mean(-1)[keep].mean()
    expected = 0.9 * nll + 0.1 * uniform
    assert abs(got.item() - expected.item()) < 1e-4


def test_triton_backend_on_cpu_names_the_model_level_fix(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    m = tiny("fot_pro", attn_backend="triton")
    with pytest.raises(RuntimeError, match=r"attn_backend='triton'.*on cpu.*attn_backend='auto'"):
        m(ids(1, 8))
    m.config.attn_backend = "auto"  # the fix the message names
    assert m(ids(1, 8)).logits.shape == (1, 8, VOCAB)


def test_cache_is_taken_under_either_name() -> None:
    """transformers 5.24 passes the cache as ``cache=``; earlier releases as ``past_key_values=``."""
    from fot.models import FoTCache

    m = tiny("fot_pro")
    x = ids(2, 10)
    full = m(x).logits
    for name in ("past_key_values", "cache"):
        cache = getattr(m(x[:, :6], use_cache=True), CACHE_FIELD)
        assert isinstance(cache, FoTCache) and cache.get_seq_length() == 6
        rest = m(x[:, 6:], use_cache=True, **{name: cache})
        assert max_err(rest.logits, full[:, 6:]) < TOL
        assert getattr(rest, CACHE_FIELD).get_seq_length() == 10
    layers = m.config.num_hidden_layers
    with pytest.raises(ValueError, match="passed twice"):
        m(x, past_key_values=FoTCache(layers), cache=FoTCache(layers))


def test_inputs_of_the_wrong_shape_are_named() -> None:
    m = tiny("fot_pro")
    width = m.config.hidden_size
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, time\], got shape \(8,\)"):
        m(ids(1, 8)[0])
    fixed = fot.models.FoTCache(m.config.num_hidden_layers, capacity=16)
    m(ids(1, 4), past_key_values=fixed, use_cache=True)  # filled: one-token steps go static
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, time\], got shape \(1,\)"):
        m(ids(1, 1)[0], past_key_values=fixed)
    with pytest.raises(
        ValueError, match=rf"hidden_size={width}\], got shape \(1, 8, {width + 1}\)"
    ):
        m(inputs_embeds=torch.randn(1, 8, width + 1))
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        m.model()
    embeds = m.get_input_embeddings()(ids(1, 8))  # the fix the message names
    assert torch.equal(m(inputs_embeds=embeds).logits, m(ids(1, 8)).logits)
    # a dtype named as no torch dtype: was AttributeError "module 'torch' has no attribute"
    for make in (lambda: fot.FoTConfig(dtype="bf16"), lambda: fot.presets.config("fot_pro", "tiny", dtype="bf16")):  # fmt: skip
        with pytest.raises(ValueError, match=r"dtype='bf16' is no torch dtype: .* 'bfloat16'"):
            make()
    assert fot.FoTConfig(dtype="bfloat16").dtype == torch.bfloat16
    # float ids: was torch's "Expected tensor for argument #1 'indices'" from the embedding
    with pytest.raises(ValueError, match=r"integer token ids, got dtype torch.float32; .*long"):
        m(ids(1, 8).float())
    assert torch.equal(m(ids(1, 8).float().long()).logits, m(ids(1, 8)).logits)


def test_trainer_compute_metrics_gets_the_logits(tmp_path) -> None:
    """HF's evaluate / predict hand the logits of a ``labels`` forward to compute_metrics."""
    m = tiny("fot_pro")
    seen = {}

    def metrics(pred) -> dict:
        seen["logits"], seen["labels"] = pred.predictions, pred.label_ids
        return {"n": float(len(pred.label_ids))}

    trainer = _eval_trainer(m, tmp_path, metrics, per_device_eval_batch_size=4)
    result = trainer.evaluate(eval_dataset=_lm_samples())
    batch = {k: torch.stack([s[k] for s in _lm_samples()]) for k in ("input_ids", "labels")}
    want = m(batch["input_ids"]).logits
    assert result["eval_n"] == 4.0
    assert torch.allclose(torch.as_tensor(seen["logits"]), want, atol=1e-5)
    assert torch.equal(torch.as_tensor(seen["labels"]), batch["labels"])
    assert abs(result["eval_loss"] - m(**batch).loss.item()) < 1e-5
    # the memory contract stays: training mode and shift_labels never form the logits
    assert m.train()(**batch).logits is None
    shifted = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
    assert m.eval()(batch["input_ids"], shift_labels=shifted).logits is None
    loss, logits = m(**batch, return_dict=False)
    assert torch.allclose(logits, want) and torch.equal(loss, m(**batch).loss)


def test_a_folder_of_another_fot_model_type_names_how_to_load_it(tmp_path) -> None:
    """fot.FoTForCausalLM.from_pretrained of an FLA baseline's export or of the paper's
    checkpoint failed on a field it read as a FoT setting ("head_dim is derived as ...: set
    num_heads = ...", "decay_time_min must be a finite number > 0, got None"): now the error
    names the model type and how that folder loads (trust_remote_code; python -m fot.convert)."""
    from pathlib import Path

    baseline = tmp_path / "mamba2"
    presets.config("mamba2", "tiny").save_pretrained(baseline)
    paper = Path(__file__).parent / "paper_checkpoints" / "fox_pro"
    says = {
        baseline: "model_type 'fot_mamba2' is one of fot's FLA baselines, not a FoT model: load "
        "its folder with AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)",
        paper: "model_type 'forgetting_transformer-project_fox' is a checkpoint of the paper, "
        "not a FoT model: convert its folder with `python -m fot.convert FOLDER OUT`",
    }
    for folder, message in says.items():
        for load in (fot.FoTConfig.from_pretrained, fot.FoTForCausalLM.from_pretrained):
            with pytest.raises(ValueError) as info:
                load(folder)
            assert str(info.value).startswith(f"{folder / 'config.json'}: {message}")
    converted = fot.convert.from_paper(paper)  # the route the message names works
    assert isinstance(converted, fot.FoTForCausalLM)
