"""HF export: config + safetensors + tokenizer + auto_map remote-code shims."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from killed_runs import host_name, run_killed

import fot
from fot import presets
from fot.export import export_hf

VOCAB = 300


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[fot.FoTForCausalLM, Path]:
    torch.manual_seed(0)
    cfg = presets.config("fot_pro", "tiny", vocab_size=VOCAB, attn_backend="reference")
    model = presets.build_model(cfg).eval()
    out = export_hf(model, tmp_path_factory.mktemp("ckpt") / "fot_pro")
    return model, out


def test_export_folder_contents(exported) -> None:
    model, out = exported
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "configuration_fot.py",
        "modeling_fot.py",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
    } <= names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "fot"
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_fot.FoTConfig",
        "AutoModelForCausalLM": "modeling_fot.FoTForCausalLM",
    }
    assert not hasattr(model.config, "auto_map") or not model.config.auto_map  # not left behind


def test_export_round_trip_auto_classes(exported) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, out = exported
    x = torch.randint(0, VOCAB, (2, 17))
    want = model(x).logits
    for kwargs in ({}, {"trust_remote_code": True}):
        loaded = AutoModelForCausalLM.from_pretrained(out, **kwargs).eval()
        assert isinstance(loaded, fot.FoTForCausalLM)
        assert torch.equal(loaded(x).logits, want)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token_id == 50256 and tok("Hello world")["input_ids"] == [50256, 15496, 995]


def test_trust_remote_code_in_fresh_process_without_importing_fot(exported) -> None:
    model, out = exported
    x = torch.arange(11)[None] * 7 % VOCAB
    want = model(x).logits[0, -1, :5].tolist()
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()\n"
        "x = torch.arange(11)[None] * 7 % 300\n"
        "print(type(m).__name__, m(x).logits[0, -1, :5].tolist())\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(out.parent / "modules"),
    }
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=out.parent,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    name, values = res.stdout.strip().splitlines()[-1].split(" ", 1)
    assert name == "FoTForCausalLM"
    got = json.loads(values)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5


def _fresh_python(code: str, out: Path) -> subprocess.Popen:
    """Start ``code`` in a new interpreter (offline; nothing imported from fot beforehand)."""
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(out.parent / "modules"),
    }
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=out.parent,
    )


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    stdout, stderr = proc.communicate(timeout=300)
    return proc.returncode, stdout, stderr


_LOAD_AND_PRINT = (
    "import sys, torch\n"
    "from transformers import AutoModelForCausalLM\n"
    "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()\n"
    "if len(sys.argv) > 2:\n"
    "    m.save_pretrained(sys.argv[2])\n"
    "x = torch.arange(11)[None] * 7 % 300\n"
    "print(type(m).__name__, m(x).logits[0, -1, :5].tolist())\n"
)


def test_resaved_trust_remote_code_model_loads_the_same_way(exported, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model, out = exported
    x = torch.arange(11)[None] * 7 % VOCAB
    want = model(x).logits[0, -1, :5].tolist()
    # (a) loaded and re-saved in a process that has imported fot
    loaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    loaded.save_pretrained(tmp_path / "a")
    # (b) loaded and re-saved in a fresh process, where the remote code imports fot
    code = f"import sys; sys.argv = ['-', {str(out)!r}, {str(tmp_path / 'b')!r}]\n"
    rc, _, stderr = _finish(_fresh_python(code + _LOAD_AND_PRINT, out))
    assert rc == 0, stderr[-2000:]
    for name in ("a", "b"):
        folder = tmp_path / name
        for shim in ("configuration_fot.py", "modeling_fot.py"):  # the shims, not fot's modules
            assert (folder / shim).read_text() == (out / shim).read_text(), (name, shim)
    # each re-saved folder loads with trust_remote_code in a fresh process, same logits
    procs = {
        name: _fresh_python(
            f"import sys; sys.argv = ['-', {str(tmp_path / name)!r}]\n" + _LOAD_AND_PRINT, out
        )
        for name in ("a", "b")
    }
    for name, proc in procs.items():
        rc, stdout, stderr = _finish(proc)
        assert rc == 0, (name, stderr[-2000:])
        cls, values = stdout.strip().splitlines()[-1].split(" ", 1)
        assert cls == "FoTForCausalLM"
        got = json.loads(values)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, name
        # and the weights are the exported ones exactly
        again = AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert torch.equal(again(x).logits, model(x).logits), name


def test_remote_code_without_fot_names_the_true_install(exported) -> None:
    _, out = exported
    for shim in ("configuration_fot.py", "modeling_fot.py"):
        assert "pip install fot" not in (out / shim).read_text()
    # A fresh process in which `fot` is not importable (as on a machine without it).
    code = (
        "import sys\n"
        "class NoFot:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'fot' or name.startswith('fot.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoFot())\n"
        "from transformers import AutoModelForCausalLM\n"
        f"AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
    )
    rc, _, stderr = _finish(_fresh_python(code, out))
    assert rc != 0
    error = stderr.strip().splitlines()[-1]
    assert error.startswith("ImportError"), stderr[-2000:]
    assert "pip install fot" not in error
    assert "pip install -e <clone>" in error

    from fot.export import INSTALL_HINT

    assert INSTALL_HINT in error


def test_model_from_pretrained_overrides_are_checked(exported) -> None:
    from transformers import AutoModelForCausalLM

    _, out = exported
    with pytest.raises(ValueError, match=r"attention_dropout=0\.1: FoT models have no dropout"):
        AutoModelForCausalLM.from_pretrained(out, attention_dropout=0.1)
    with pytest.raises(ValueError, match=r"divisible by num_heads \(3\)"):
        fot.FoTForCausalLM.from_pretrained(out, num_attention_heads=3)


def test_a_config_json_setting_this_fot_lacks_is_named_on_load(exported, tmp_path, caplog) -> None:
    """A folder written by a newer fot, with a setting this one lacks (here `attn_sink`),
    loaded without a word: transformers stores the key on the config and no model code reads
    it, so the model computed other outputs than the one saved. Now the load warns, naming the
    file, the keys and the fix; an export of this fot (with the trainer's train_length, and
    LLaMA-named fields) loads without it."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    _, out = exported
    saved = json.loads((out / "config.json").read_text())
    plain, newer = tmp_path / "plain", tmp_path / "newer"
    for folder, extra in (
        (plain, {"train_length": 64, "num_attention_heads": saved["num_heads"]}),
        (newer, {"attn_sink": True, "sink_size": 4}),
    ):
        shutil.copytree(out, folder)
        (folder / "config.json").write_text(json.dumps({**saved, **extra}))
    loads = (
        AutoModelForCausalLM.from_pretrained,
        lambda p: AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True),
        AutoConfig.from_pretrained,
        fot.FoTConfig.from_pretrained,
    )
    hf_logging.enable_propagation()  # transformers' records reach caplog
    try:
        for load in loads:
            for folder in (plain, newer):
                caplog.clear()
                with caplog.at_level(logging.WARNING):
                    load(folder)
                warned = [r.getMessage() for r in caplog.records if "no setting" in r.getMessage()]
                if folder == plain:
                    assert warned == []
                else:
                    assert warned == [
                        f"{folder / 'config.json'}: attn_sink=True, sink_size=4 are no setting "
                        "of this fot's FoTConfig, stored but not used: the model may compute "
                        "other outputs than the one saved. A folder written by a newer fot or "
                        "transformers (with settings these lack): update them (fot: git pull in "
                        "its clone) to load it as it was saved"
                    ]
    finally:
        hf_logging.disable_propagation()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        fot.FoTConfig.from_dict({**saved, "attn_sink": True})  # in code: as transformers does
        fot.FoTConfig(attn_sink=True)
    assert "no setting" not in caplog.text


def test_a_config_json_in_transformers_4_form_loads_without_the_unknown_key_warning(
    exported, tmp_path, caplog
) -> None:
    """transformers 4.x saved generation settings (max_length, num_beams, ...) and fields of
    every model (torchscript, is_decoder, ...) in config.json. A FoT config.json written in
    that form (by hand, or copied from such a folder) was said to hold settings this fot
    lacks, though generate reads the generation ones from there (no generation_config.json)
    and the others set nothing a decoder-only model computes. Now it loads without the
    warning, and the generation setting still reaches generate."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    _, out = exported
    folder = tmp_path / "v4"
    shutil.copytree(out, folder)
    (folder / "generation_config.json").unlink()
    saved = json.loads((folder / "config.json").read_text())
    v4 = {"max_length": 7, "num_beams": 1, "do_sample": False, "torchscript": False}
    v4 |= {"is_decoder": False, "task_specific_params": None, "tokenizer_class": None}
    (folder / "config.json").write_text(json.dumps({**saved, **v4}))
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING):
            model = AutoModelForCausalLM.from_pretrained(folder)
    finally:
        hf_logging.disable_propagation()
    assert "no setting" not in caplog.text
    assert model.generation_config.max_length == 7
    assert model.generate(torch.tensor([[1, 2, 3]]), do_sample=False).shape == (1, 7)


def test_export_rejects_non_hf_modules_and_unknown_text_escapings(tmp_path) -> None:
    with pytest.raises(TypeError, match="PreTrainedModel, got Linear; unwrap DDP"):
        export_hf(torch.nn.Linear(2, 2), tmp_path)
    model = fot.presets.build_model(fot.presets.config("fot_pro", "tiny"))
    with pytest.raises(TypeError, match=r"got OptimizedModule; pass model\._orig_mod"):
        export_hf(torch.compile(model), tmp_path)  # it said model.module, which it lacks
    with pytest.raises(ValueError, match=r"text_escaping='JSON' is not one of \['none', 'json'\]"):
        export_hf(torch.nn.Linear(2, 2), tmp_path, text_escaping="JSON")
    assert not any(tmp_path.iterdir())


def test_generate_stop_strings_with_the_exported_tokenizer(exported) -> None:
    # generate(stop_strings=..., tokenizer=tok) leaves `tokenizer` among the model kwargs;
    # FoT's forward refused it. Oracle: the unstopped greedy output cut at the stop string.
    from transformers import AutoTokenizer

    model, out = exported
    tok = AutoTokenizer.from_pretrained(out)
    x = torch.arange(5, 12)[None]
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    full = model.generate(x, **kw)
    # a later new token that is one printable ASCII character (ids 0-93 in GPT-2's BPE)
    stop = tok.decode(next(t for t in full[0, 9:].tolist() if t < 94))
    end = next(t for t in range(8, 20) if tok.decode(full[0, :t]).endswith(stop))
    got = model.generate(x, stop_strings=[stop], tokenizer=tok, **kw)
    assert torch.equal(got, full[:, :end]), (stop, got, full)
    assert torch.equal(model.generate(x, tokenizer=tok, **kw), full)  # tokenizer alone: no-op


def test_hf_attention_names_are_refused_with_attn_backend(exported) -> None:
    # HF's own error for attn_implementation="sdpa" asks to request support from transformers
    # and to use "eager"; FoT picks its attention by config.attn_backend instead.
    from transformers import AutoModelForCausalLM

    model, out = exported
    for impl in ("sdpa", "flash_attention_2"):
        with pytest.raises(ValueError, match=rf"attn_implementation='{impl}' is not used .*attn_"):
            AutoModelForCausalLM.from_pretrained(out, attn_implementation=impl)
    x = torch.arange(9)[None] * 5 % VOCAB
    eager = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert torch.equal(eager(x).logits, model(x).logits)  # HF's default name still loads


def test_set_attn_implementation_is_refused_like_from_pretrained(exported) -> None:
    # model.set_attn_implementation("sdpa") only logged that the model "does not follow the
    # functional approach based on AttentionInterface" and changed nothing, without naming
    # config.attn_backend. Oracle: the logits before the call (nothing may change either way).
    from transformers import AutoModelForCausalLM

    out = exported[1]
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.arange(9)[None] * 5 % VOCAB
    want = loaded(x).logits
    fix = r"is not used by FoT models.*set model\.config\.attn_backend \(e\.g\. 'sdpa'\)"
    for impl in ("sdpa", "flash_attention_2", {"": "sdpa"}):
        with pytest.raises(
            ValueError, match=r"attn_implementation='(sdpa|flash_attention_2)' " + fix
        ):
            loaded.set_attn_implementation(impl)
        with pytest.raises(ValueError, match=fix):
            loaded.model.set_attn_implementation(impl)  # the base model (AutoModel) too
    loaded.set_attn_implementation("eager")  # HF's default name is accepted
    assert loaded.config.attn_backend == "reference" and torch.equal(loaded(x).logits, want)
    loaded.config.attn_backend = "sdpa"  # the named fix (on the CPU, FoT's 'sdpa' is 'auto')
    assert torch.allclose(loaded(x).logits, want, atol=1e-5)


def test_batched_generate_with_the_exported_tokenizer_as_it_is(tmp_path) -> None:
    # The exported tokenizer had no pad token: tok(prompts, padding=True) and
    # generate(token_healing=True) failed until the user set one. Oracle: each prompt alone.
    from transformers import AutoTokenizer

    torch.manual_seed(0)
    cfg = presets.config("fot_pro", "tiny", attn_backend="reference")
    model = presets.build_model(cfg).eval()
    with torch.no_grad():  # varied greedy tokens instead of an untrained model's few
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    tok = AutoTokenizer.from_pretrained(export_hf(model, tmp_path / "m"))
    prompts = ["The quick brown fox jumps over", "Hello"]
    kw = {"max_new_tokens": 5, "do_sample": False}
    batch = tok(prompts, padding=True, return_tensors="pt")
    got = model.generate(**batch, **kw)[:, batch.input_ids.shape[1] :]
    for row, prompt in zip(got, prompts, strict=True):
        alone = tok(prompt, return_tensors="pt")
        want = model.generate(**alone, **kw)[0, alone.input_ids.shape[1] :]
        assert torch.equal(row, want), (prompt, row, want)
    healed = model.generate(**tok(["Hello wor"], return_tensors="pt"), token_healing=True,
                            tokenizer=tok, **kw)  # fmt: skip
    text = tok.decode(healed[0], skip_special_tokens=True)  # after the BOS the tokenizer adds
    assert healed[0, 0] == tok.bos_token_id and text.startswith("Hello wor"), text


@pytest.mark.parametrize("name", ["fot_pro", "transformer_llama"])
def test_generate_without_a_mask_conditions_on_the_bos_whatever_the_eos(tmp_path, name) -> None:
    """generate(input_ids, eos_token_id=198) without an attention_mask: transformers inferred
    the mask from the pad id (50256, which is also the BOS the tokenizer puts first) because
    eos differed from it, masked the BOS, and the output was that of the prompt without it
    (helper-175). Oracle: a forward pass over the whole generated sequence, BOS included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    cfg = presets.config(name, "tiny", attn_backend="reference", hidden_size=64, num_heads=2,
                         num_hidden_layers=2)  # fmt: skip
    folder = export_hf(presets.build_model(cfg), tmp_path / "m")
    tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    ids = tok("The quick brown fox jumps over the lazy dog and", return_tensors="pt").input_ids
    assert ids[0, 0] == tok.bos_token_id == model.generation_config.pad_token_id
    n = ids.shape[1]
    for eos in (None, 198):
        out = model.eval().generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=eos,
                                    return_dict_in_generate=True, output_logits=True)  # fmt: skip
        with torch.no_grad():
            whole = model(out.sequences).logits[0, n - 1 : -1]
        torch.testing.assert_close(torch.stack(out.logits, 1)[0], whole, rtol=0, atol=1e-5)


@pytest.mark.skipif(os.name != "posix", reason="file mode bits are POSIX")
@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_saved_weights_get_the_umask_mode(tmp_path, umask) -> None:
    # safetensors >= 0.8 writes weights 0600 whatever the umask; the oracle is the mode of
    # config.json, written by a plain open() in the same save.
    cfg = presets.config("fot_pro", "tiny", vocab_size=VOCAB, attn_backend="reference")
    model = presets.build_model(cfg)
    old = os.umask(umask)
    try:
        exported = export_hf(model, tmp_path / "export", tokenizer=False)
        model.save_pretrained(tmp_path / "saved")
    finally:
        os.umask(old)
    for folder in (exported, tmp_path / "saved"):
        want = (folder / "config.json").stat().st_mode & 0o777
        assert want == 0o666 & ~umask
        assert (folder / "model.safetensors").stat().st_mode & 0o777 == want, folder


def test_exported_generation_config_pads_with_the_tokenizers_pad(tmp_path, caplog) -> None:
    # generate() warned on every call that it set pad_token_id to eos_token_id: the exported
    # generation config had none while the tokenizer pads with <|endoftext|>. Its config.json
    # had none either, so HF's Trainer given the tokenizer warned that it "aligned" the config.
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_utils import align_special_tokens
    from transformers.utils import logging as hf_logging

    cfg = presets.config("fot_pro", "tiny", attn_backend="reference")
    model = presets.build_model(cfg).eval()
    assert model.generation_config.pad_token_id is None
    out = export_hf(model, tmp_path / "m")
    assert model.generation_config.pad_token_id is None  # the model itself is left as it was
    assert model.config.pad_token_id is None
    saved = json.loads((out / "generation_config.json").read_text())
    tok = AutoTokenizer.from_pretrained(out)
    assert saved["pad_token_id"] == tok.pad_token_id == 50256
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 50256
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    caplog.clear()
    hf_logging.enable_propagation()  # transformers' records reach caplog
    try:
        with caplog.at_level(logging.WARNING):
            align_special_tokens(loaded, tok)  # what Trainer(processing_class=tok).train() does
    finally:
        hf_logging.disable_propagation()
    assert "PAD/BOS/EOS" not in caplog.text  # the config is the tokenizer's already
    batch = tok(["Hello there", "Hi"], padding=True, return_tensors="pt")
    kw = {"max_new_tokens": 3, "do_sample": False}
    assert torch.equal(
        loaded.generate(**batch, **kw), model.generate(**batch, pad_token_id=50256, **kw)
    )


def _tiny(seed: int) -> fot.FoTForCausalLM:
    torch.manual_seed(seed)
    cfg = presets.config("fot_pro", "tiny", vocab_size=VOCAB, attn_backend="reference",
                         hidden_size=32, num_heads=2)  # fmt: skip
    return presets.build_model(cfg).eval()


@pytest.mark.parametrize("shards", [("5GB", "20KB"), ("20KB", "5GB")])
def test_export_over_a_previous_export_loads_the_new_weights(tmp_path, shards) -> None:
    # A single-file export left model.safetensors behind a sharded re-export (and the reverse
    # left the shards' index): from_pretrained then loaded the previous model's weights.
    from transformers import AutoModelForCausalLM

    old, new = _tiny(0), _tiny(1)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "NOTES.md").write_text("mine")
    export_hf(old, tmp_path / "m", max_shard_size=shards[0])
    out = export_hf(new, tmp_path / "m", max_shard_size=shards[1])
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(x).logits
        assert torch.equal(got, new(x).logits)
    assert (out / "NOTES.md").read_text() == "mine"  # files of the user's stay


def test_export_refuses_to_overwrite_files_it_did_not_write(tmp_path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "config.json").write_text('{"my": "settings"}')
    (folder / "vocab.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"config\.json, vocab\.json.*empty or new folder"):
        export_hf(_tiny(0), folder)
    assert (folder / "config.json").read_text() == '{"my": "settings"}'
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "vocab.json"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is a file"):
        export_hf(_tiny(0), tmp_path / "file")


def test_export_hf_refuses_a_training_runs_own_export_unless_told(tmp_path) -> None:
    """export_hf(model, "<run>/hf") replaced a finished run's final weights (with a model of
    another size, too) without a word, which `python -m fot.export` and fot.convert refuse."""
    from transformers import AutoModelForCausalLM

    run = tmp_path / "run"
    export_hf(_tiny(0), run / "hf")
    (run / "run_info.json").write_text("[]\n")  # what makes a folder a training run's
    before = {p.name: p.read_bytes() for p in (run / "hf").iterdir() if p.is_file()}
    with pytest.raises(FileExistsError) as err:
        export_hf(_tiny(1), run / "hf")
    assert str(err.value) == (
        f"export_hf: {run / 'hf'} holds the final weights of the training run {run} (it may be "
        "their only copy) and is not replaced: write to a folder of its own, e.g. "
        f"<run>/hf_step_<n>, or move {run / 'hf'} away first; or pass replace_run_export=True "
        "to replace it"
    )
    assert before == {p.name: p.read_bytes() for p in (run / "hf").iterdir() if p.is_file()}
    new = _tiny(1)
    export_hf(new, run / "hf", replace_run_export=True)  # as the run itself does at its end
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(run / "hf").eval()(x).logits
        assert torch.equal(got, new(x).logits)


@pytest.mark.parametrize("fails_in", ["weights", "tokenizer"])
def test_an_export_that_fails_part_way_leaves_the_earlier_export_whole(
    tmp_path, monkeypatch, fails_in
) -> None:
    # A re-export deleted the earlier export's weights before writing its own: a full disk
    # then left a folder of no weights, and one failing after the weights left new weights
    # beside the old tokenizer, or (a first export) a folder that loaded without a tokenizer.
    import errno

    import transformers.modeling_utils
    from transformers import AutoModelForCausalLM

    import fot.tokenizer
    from fot.errors import WriteError

    old = _tiny(0)
    out = export_hf(old, tmp_path / "m")
    (out / "NOTES.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if fails_in == "weights":
        monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)
    else:
        monkeypatch.setattr(fot.tokenizer, "save_hf_tokenizer", full_disk)
    for folder in (out, tmp_path / "new"):
        with pytest.raises(WriteError, match=f"cannot write {folder}: No space left on device"):
            export_hf(_tiny(1), folder)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing half-written beside
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(x).logits
        assert torch.equal(got, old(x).logits)


@pytest.mark.parametrize("fails", ["first_export", "re_export", "and_putting_back"])
def test_a_failed_rename_of_the_export_is_one_line_and_loses_nothing(
    tmp_path, monkeypatch, fails
) -> None:
    # The renames that move the complete export into place raised a bare OSError (a traceback
    # naming two paths, e.g. the staged folder). Now one WriteError names the folder and what
    # is kept: the earlier export as it was, or where its files wait if one could not go back.
    import errno

    from transformers import AutoModelForCausalLM

    from fot.errors import WriteError

    old = _tiny(0)
    out = tmp_path / "m"
    before = {}
    if fails != "first_export":
        export_hf(old, out)
        (out / "NOTES.md").write_text("mine")
        before = {p.name: p.read_bytes() for p in out.iterdir()}
    real_rename = os.rename

    def rename(src, dst, *args, **kwargs):
        src, dst = Path(src), Path(dst)
        if fails == "first_export":  # the staged folder beside it, renamed as a whole
            into_place = dst == out and src.name.startswith(".m.new-")
        else:  # the staged files, inside it
            into_place = dst == out / "config.json" and src.parent.name.startswith(".m.new-")
        back = fails == "and_putting_back" and dst == out / "model.safetensors"
        if into_place or (back and src.parent.name.startswith(".m.old-")):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(src), None, str(dst))
        return real_rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(WriteError) as err:
        export_hf(_tiny(1), out)
    monkeypatch.setattr(os, "rename", real_rename)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"cannot write {out}: Permission denied (no permission"), msg
    if fails == "first_export":
        assert msg.endswith("The export was not written"), msg
        assert list(tmp_path.iterdir()) == []  # nothing half-written beside it
        return
    if fails == "and_putting_back":
        # the message names the file and where it is; moved back as it says, nothing is lost
        (aside,) = [p for p in out.iterdir() if p.name.startswith(".m.old-")]
        assert msg.endswith(
            f"the earlier export's model.safetensors could not be put back: move them from "
            f"{aside} into {out}"
        ), msg
        assert [p.name for p in aside.iterdir()] == ["model.safetensors"]
        shutil.move(aside / "model.safetensors", out / "model.safetensors")
        aside.rmdir()
    else:
        assert msg.endswith(f"The export was not written; {out} is as it was"), msg
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(x).logits
        assert torch.equal(got, old(x).logits)


# An export of _tiny(1) into sys.argv[1], SIGKILLed at sys.argv[2]: "writing" (the staged
# folder has the weights, not the tokenizer), "setting_aside" (the earlier export's config.json
# is set aside, its other files are not) or "moving_in" (the earlier export is all set aside,
# the new config.json moved in, the rest of the new export still staged).
_KILLED_EXPORT = """
import os, signal, sys, torch
import fot.tokenizer
from fot import presets
from fot.export import export_hf

out, point = sys.argv[1], sys.argv[2]
real_rename = os.rename


def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def rename(src, dst):
    src, dst = str(src), str(dst)
    if point == "setting_aside" and ".old-" in dst:
        real_rename(os.path.join(out, "config.json"), os.path.join(os.path.dirname(dst), "config.json"))
        kill()
    real_rename(src, dst)
    if point == "moving_in" and ".new-" in src and ".new-" not in dst:
        kill()


os.rename = rename
if point == "writing":
    fot.tokenizer.save_hf_tokenizer = kill
torch.manual_seed(1)
cfg = presets.config("fot_pro", "tiny", vocab_size=300, attn_backend="reference", hidden_size=32,
                     num_heads=2)
export_hf(presets.build_model(cfg).eval(), out)
"""


def _loads_as(out: Path, model: fot.FoTForCausalLM) -> bool:
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, VOCAB, (1, 9))
    with torch.no_grad():
        got = AutoModelForCausalLM.from_pretrained(out).eval()(x).logits
        return torch.equal(got, model(x).logits)


def test_an_export_killed_while_writing_leaves_a_folder_that_the_next_export_removes(
    tmp_path, caplog
) -> None:
    # A first export killed while writing left its staged folder beside the destination for
    # good (.m.new-<pid>), and each rerun added one. Now the next export removes those of ended
    # processes of this host, and only those: a live process' and another host's are kept.
    out = tmp_path / "m"
    pid = run_killed(_KILLED_EXPORT, out, "writing")
    host = host_name()
    staged = tmp_path / f".m.new-{host}.{pid}"
    assert [p.name for p in tmp_path.iterdir()] == [staged.name]  # the host is recorded
    assert (staged / "config.json").is_file() and not (staged / "vocab.json").exists()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        kept = [f".m.new-{host}.{sleeper.pid}", f".m.new-elsewhere.{pid}"]
        for name in kept:
            (tmp_path / name).mkdir()
            (tmp_path / name / "model.safetensors").write_bytes(b"x")
        new = _tiny(2)
        with caplog.at_level(logging.WARNING):
            export_hf(new, out)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "m"])
    assert [r.getMessage() for r in caplog.records if r.name == "fot.export"] == [
        f"removed {staged}: left by exports into {out} that did not finish (process {pid} of "
        "this host)"
    ]
    assert _loads_as(out, new)


def test_an_export_killed_while_moving_in_keeps_the_earlier_export_it_set_aside(
    tmp_path, caplog
) -> None:
    # Killed after setting the earlier export aside (.m.old-<pid>) and moving part of the new
    # one in, an export left the earlier one's only whole copy in that folder: the next export
    # removed neither it nor the staged rest of the new one. Now the staged folder goes, and the
    # folder set aside is kept and named, with what to do.
    out = tmp_path / "m"
    export_hf(_tiny(0), out)
    (out / "NOTES.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != "NOTES.md"}
    pid = run_killed(_KILLED_EXPORT, out, "moving_in")
    host = host_name()
    aside, staged = out / f".m.old-{host}.{pid}", out / f".m.new-{host}.{pid}"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [aside.name, staged.name, "NOTES.md", "config.json"]
    )
    new = _tiny(2)
    with caplog.at_level(logging.WARNING, logger="fot.export"):
        export_hf(new, out)
    assert [r.getMessage() for r in caplog.records if r.name == "fot.export"] == [
        f"removed {staged}: left by exports into {out} that did not finish (process {pid} of "
        "this host)",
        f"kept {aside}: it holds files of an earlier export of {out} that process {pid} of this "
        "host set aside while replacing them and did not finish (it ended; killed?), and may be "
        "their only copy. To keep that export, move its files into a folder of their own; else "
        f"delete it (rm -r '{aside}')",
    ]
    assert {p.name: p.read_bytes() for p in aside.iterdir()} == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [aside.name]
    assert (out / "NOTES.md").read_text() == "mine"
    assert _loads_as(out, new)
    # as the message says, the earlier export loads from a folder of its own
    shutil.move(aside, tmp_path / "earlier")
    assert _loads_as(tmp_path / "earlier", _tiny(0))


def test_an_export_killed_while_setting_the_earlier_one_aside_says_how_to_make_it_whole(
    tmp_path, caplog
) -> None:
    # Killed while setting the earlier export's files aside, an export left them split between
    # the folder and .m.old-<pid>; without its config.json the folder was refused as "not an
    # export" (moving the files away). Now the refusal says where the rest is and to move it
    # back; done so, the next export goes through and removes the emptied folder.
    from fot.export import check_export_folder

    out = tmp_path / "m"
    export_hf(_tiny(0), out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    pid = run_killed(_KILLED_EXPORT, out, "setting_aside")
    host = host_name()
    aside = out / f".m.old-{host}.{pid}"
    assert [p.name for p in aside.iterdir()] == ["config.json"]
    hint = (
        f"{aside} holds files of the export in {out} that an export killed while replacing it "
        f"set aside: move them back into {out}, then export again"
    )
    with pytest.raises(FileExistsError) as err:
        check_export_folder(out, example="x")
    assert str(err.value).endswith(f"and holds no earlier export: {hint}"), err.value
    with pytest.raises(FileExistsError) as err:
        export_hf(_tiny(2), out)
    assert str(err.value).endswith(f"nothing was written. {hint}"), err.value
    for p in aside.iterdir():
        p.rename(out / p.name)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p != aside} == before
    assert _loads_as(out, _tiny(0))
    new = _tiny(2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fot.export"):
        export_hf(new, out)
    assert [r.getMessage() for r in caplog.records if r.name == "fot.export"] == [
        f"removed {aside}: left by exports into {out} that did not finish (process {pid} of "
        "this host)"
    ]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
    assert _loads_as(out, new)


def test_a_re_export_into_a_folder_on_another_file_system_than_its_parent(tmp_path) -> None:
    # The export was staged beside the destination, in its parent: a destination reached
    # through a symlink (or a mount point) on another file system could not take the staged
    # files (EXDEV), and a folder of one's own inside a folder one cannot write was refused.
    from transformers import AutoModelForCausalLM

    other = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else None
    if other is None or other.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another file system than the tests' temporary folder")
    try:
        (other / "m").mkdir()
        link = tmp_path / "m"
        link.symlink_to(other / "m", target_is_directory=True)
        for seed in (0, 1):  # into the empty folder, then over the earlier export
            new = _tiny(seed)
            export_hf(new, link)
            x = torch.randint(0, VOCAB, (1, 9))
            with torch.no_grad():
                got = AutoModelForCausalLM.from_pretrained(link).eval()(x).logits
                assert torch.equal(got, new(x).logits)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]
        assert not [p.name for p in link.iterdir() if p.name.startswith(".")]
    finally:
        shutil.rmtree(other, ignore_errors=True)


@pytest.mark.parametrize("zip_format", [True, False])
def test_check_weight_files_opens_every_bin_that_read_weight_files_reads(
    tmp_path, zip_format
) -> None:
    # init_from's early check memory-mapped every pytorch_model.bin, which torch refuses for
    # its legacy (non-zip) format ("mmap can only be used with files saved with ..."): a
    # folder that read_weight_files reads was refused as damaged. Oracle: read_weight_files.
    from safetensors.torch import load_file

    from fot.export import WeightFilesError, check_weight_files, read_weight_files

    folder = export_hf(_tiny(0), tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    path = folder / "pytorch_model.bin"
    torch.save(state, path, _use_new_zipfile_serialization=zip_format)
    assert read_weight_files(folder).keys() == state.keys()
    check_weight_files(folder)
    with open(path, "r+b") as f:  # cut short: both refuse it
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(WeightFilesError, match=r"pytorch_model\.bin cannot be read"):
        read_weight_files(folder)
    with pytest.raises(WeightFilesError, match=r"pytorch_model\.bin cannot be read"):
        check_weight_files(folder)


def test_read_weight_files_takes_the_safetensors_shards_over_bin_files_as_from_pretrained(
    tmp_path,
) -> None:
    # A hub folder may hold both formats (e.g. model-*-of-*.safetensors and pytorch_model.bin):
    # from_pretrained loads the safetensors and never opens the .bin, so neither does
    # read_weight_files (nor check_weight_files). Oracle: from_pretrained of the same folder.
    from safetensors.torch import load_file

    from fot.export import check_weight_files, read_weight_files

    folder = export_hf(_tiny(0), tmp_path / "m", tokenizer=False, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and not (folder / "model.safetensors").exists()
    state = {k: v for shard in shards for k, v in load_file(shard).items()}
    (folder / "pytorch_model.bin").write_bytes(b"an unrelated, unreadable file")
    got = read_weight_files(folder)
    check_weight_files(folder)
    loaded = type(_tiny(0)).from_pretrained(folder).state_dict()
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], loaded[k]) for k in got)
