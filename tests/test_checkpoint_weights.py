"""Weights outside the run that trained them: ``init_from=PATH`` starts a new run from a
training checkpoint's, an export's or a paper checkpoint's weights (fot.training.init_weights),
and ``python -m fot.export`` writes a training checkpoint as an HF folder.

Oracles: the source's own weights (a first step at a learning rate of 1e-12 moves no weight by
more than ~1e-12, so the new run's first checkpoint must hold them), the same weights reached
through a checkpoint and through its HF export (equal losses), and for the paper's checkpoints
the logits its own code computed (tests/paper_checkpoints/). An export of the last checkpoint
must equal the run's own final export.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import ROOT, SMALL, _cfg, _losses, _run_script

from fot import presets
from fot.training import train
from fot.training.init_weights import (
    InitFromError,
    check_init_source,
    load_init_weights,
    read_init_source,
)

PAPER = Path(__file__).resolve().parent / "paper_checkpoints"
# the run config of test_train's SMALL model
SMALL_MODEL = dict(hidden_size=32, num_hidden_layers=1, num_heads=2)
ONE_STEP = ("total_tokens=256", "optim.lr=1e-12", "schedule.warmup_tokens=0")


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    """Four steps of test_train's small fot_pro, with its HF export."""
    out = tmp_path_factory.mktemp("source")
    train(_cfg(out, "total_tokens=1024", "export_hf=true"))
    return out


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / f"step_{step:08d}" / "model.pt", weights_only=True)


def test_a_new_run_starts_from_a_checkpoints_weights_or_its_exports(tmp_path, source_run) -> None:
    ckpt = source_run / "checkpoints" / "step_00000004"
    from_ckpt, from_hf, fresh = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "fresh"
    train(_cfg(from_ckpt, *ONE_STEP, f"init_from={ckpt}"))
    train(_cfg(from_hf, *ONE_STEP, f"init_from={source_run / 'hf'}"))
    train(_cfg(fresh, *ONE_STEP))
    want = _weights(source_run, 4)
    for run in (from_ckpt, from_hf):
        got = _weights(run, 1)
        assert got.keys() == want.keys()
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=key)
    # the export holds the checkpoint's float32 weights: the same first step to the bit
    assert _losses(from_ckpt) == _losses(from_hf)
    # and the step trains those weights, not a random model's (10.83 = ln(50257) for the latter)
    assert _losses(from_ckpt)[1] < _losses(fresh)[1] - 0.3, (_losses(from_ckpt), _losses(fresh))
    info = json.loads((from_ckpt / "run_info.json").read_text())[0]
    assert info["initialized_from"] == str(ckpt)
    assert json.loads((fresh / "run_info.json").read_text())[0]["initialized_from"] is None
    # the step count, optimizer and data start from zero: one step, a checkpoint of step 1
    assert sorted(_losses(from_ckpt)) == [1]


def test_a_run_that_resumes_takes_its_own_checkpoint_not_init_from(tmp_path, source_run) -> None:
    out = tmp_path / "run"
    train(_cfg(out, *ONE_STEP, f"init_from={source_run / 'hf'}"))
    step1 = _weights(out, 1)
    # the same command, longer: resumes from its step 1 (init_from is neither read nor checked)
    train(_cfg(out, "total_tokens=512", "optim.lr=1e-12", "init_from=/no/such/folder"))
    assert sorted(_losses(out)) == [1, 2]
    info = json.loads((out / "run_info.json").read_text())
    assert info[-1]["resumed_from"].endswith("step_00000001")
    assert info[-1]["initialized_from"] is None
    for key, value in _weights(out, 2).items():
        torch.testing.assert_close(value, step1[key], rtol=0, atol=1e-9, msg=key)


def test_resuming_a_run_that_did_not_start_from_init_from_warns(
    tmp_path, source_run, caplog
) -> None:
    """An out_dir reused: resume=auto takes its run's checkpoint, not init_from's weights; a
    warning says so (the same command resumed only notes it)."""
    out, again = tmp_path / "run", tmp_path / "again"
    init = f"init_from={source_run / 'hf'}"
    train(_cfg(out, *ONE_STEP))  # from random weights
    train(_cfg(again, *ONE_STEP, init))
    with caplog.at_level(logging.INFO, logger="fot.train"):
        train(_cfg(out, "total_tokens=512", "optim.lr=1e-12", init))
        train(_cfg(again, "total_tokens=512", "optim.lr=1e-12", init))
    notes = [(r.levelno, r.getMessage()) for r in caplog.records if "is not used" in r.getMessage()]
    assert [level for level, _ in notes] == [logging.WARNING, logging.INFO], notes
    assert "did not start from init_from (its init_from=None)" in notes[0][1]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("model=fot_llama",),
         r"qk_norm=True \(init_from\) vs False \(this run\);.*To start from its weights, train "
         r"with the settings it was trained with: model=fot_pro size=tiny "
         r"\+\+model.overrides.hidden_size=32"),
        (("++model.overrides={hidden_size:32,num_hidden_layers:2,num_heads:2}",),
         r"num_hidden_layers=1 \(init_from\) vs 2 \(this run\)"),
    ],
)  # fmt: skip
def test_a_checkpoint_of_another_model_is_refused_before_the_run_folder_exists(
    tmp_path, source_run, overrides, message
) -> None:
    out = tmp_path / "run"
    init = f"init_from={source_run / 'checkpoints' / 'step_00000004'}"
    with pytest.raises(InitFromError, match=message):
        train(_cfg(out, *ONE_STEP, init, *overrides))
    assert not out.exists()


def test_a_weight_file_cut_short_is_refused_before_the_run_folder_exists(
    tmp_path, source_run, monkeypatch
) -> None:
    """A truncated model.pt was found only after the run folder was made, and its message said
    to resume (the advice for the run's own checkpoint): "resume=<path>" or "rerun with
    resume=auto"."""
    from fot.export import WeightFilesError
    from fot.training import checkpoint as ckpt

    copy = tmp_path / "source"
    shutil.copytree(source_run / "checkpoints", copy / "checkpoints")
    shutil.copytree(source_run / "hf", copy / "hf")
    for name in ("checkpoints/step_00000004/model.pt", "hf/model.safetensors"):
        with open(copy / name, "r+b") as f:
            f.truncate((copy / name).stat().st_size // 2)
    out = tmp_path / "run"
    earlier = copy / "checkpoints" / "step_00000002"
    assert (earlier / "model.pt").is_file()  # the way out the message names
    init = f"init_from={copy / 'checkpoints' / 'step_00000004'}"
    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        train(_cfg(out, *ONE_STEP, init))
    message = str(info.value)
    assert message.startswith("init_from: checkpoint ") and "cannot read model.pt" in message
    assert message.endswith(f"Start from another checkpoint of that run, e.g. init_from={earlier} "
                            "(its readable ones: step_00000002)")  # fmt: skip
    assert "resume" not in message
    assert not out.exists()
    with pytest.raises(WeightFilesError, match=r"model\.safetensors cannot be read"):
        train(_cfg(out, *ONE_STEP, f"init_from={copy / 'hf'}"))
    assert not out.exists()
    # damage that opening the file does not see is named the same way when the weights are read
    monkeypatch.setattr(ckpt, "check_model_file", lambda path: None)
    with pytest.raises(ckpt.CorruptCheckpointError) as info:
        train(_cfg(out, *ONE_STEP, init))
    assert str(info.value) == message


@pytest.mark.parametrize("source", ["checkpoints/step_00000004", "hf"])
def test_the_settings_a_refusal_names_are_train_py_overrides_that_build_its_model(
    tmp_path, source_run, source
) -> None:
    """Composed by Hydra as train.py composes them, the settings the message gives make a run
    that starts from the weights."""
    init = f"init_from={source_run / source}"
    tail = (
        "train with the settings it was trained with: " if "step" in source else "set its values: "
    )
    with pytest.raises(InitFromError, match=tail) as err:
        train(_cfg(tmp_path / "refused", *ONE_STEP, init, "model=fot_llama", "size=125m"))
    suggested = str(err.value).split(tail)[1].split()
    out = tmp_path / "run"
    train(_cfg(out, *ONE_STEP, init, "model=fot_llama", "size=125m", *suggested))
    want = _weights(source_run, 4)
    for key, value in _weights(out, 1).items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-9, msg=key)


def test_a_suggested_value_of_none_is_written_as_hydra_reads_it(tmp_path) -> None:
    """A transformer_llama (no window) into a transformer_swa run: the message sets
    window_size=null (Hydra reads window_size=None as the string "None", which the config
    refuses), and the run so composed starts from the weights."""
    source = tmp_path / "llama"
    model = presets.build_model(presets.config("transformer_llama", "tiny", **SMALL_MODEL))
    model.save_pretrained(source)
    init = f"init_from={source}"
    with pytest.raises(InitFromError, match="set its values: ") as err:
        train(_cfg(tmp_path / "refused", *ONE_STEP, init, "model=transformer_swa"))
    suggested = shlex.split(str(err.value).split("set its values: ")[1])
    assert suggested == ["++model.overrides.window_size=null"]
    out = tmp_path / "run"
    train(_cfg(out, *ONE_STEP, init, "model=transformer_swa", *suggested))
    for key, value in _weights(out, 1).items():
        torch.testing.assert_close(value, model.state_dict()[key], rtol=0, atol=1e-9, msg=key)


@pytest.mark.parametrize(
    ("theirs", "ours"),
    [(("fot_llama", "tiny"), ("mamba2", "tiny")), (("mamba2", "125m"), ("mamba2", "tiny"))],
)
def test_a_refusal_names_the_preset_of_another_model_class_or_an_fla_baseline(
    tmp_path, theirs, ours
) -> None:
    """An export of a preset (a FoT into an FLA baseline's run, an FLA baseline of another
    size) is named by its model= and size=, not by a vague "pick the model" or a list of FLA
    fields."""
    presets.config(*theirs).save_pretrained(tmp_path)
    with pytest.raises(InitFromError, match=rf"train with model={theirs[0]} size={theirs[1]}$"):
        check_init_source(read_init_source(tmp_path), presets.config(*ours))


def test_a_config_of_no_model_fot_trains_is_refused_without_building_fla_presets(
    tmp_path, monkeypatch
) -> None:
    """A LLaMA config: no preset of an FLA baseline is tried (FLA may be missing here).
    (read_init_source refuses a LLaMA folder before this; the check itself stays safe.)"""
    from transformers import LlamaConfig

    from fot.training.init_weights import InitSource

    real = presets.config
    monkeypatch.setattr(
        presets,
        "config",
        lambda name, *a, **k: (
            (_ for _ in ()).throw(ImportError("no fla"))
            if name in presets.FLA_MODELS
            else real(name, *a, **k)
        ),
    )
    llama = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=2)
    with pytest.raises(InitFromError, match=r"model class=LlamaConfig .*pick the model="):
        check_init_source(InitSource(tmp_path, "hf", llama), real("fot_pro", "tiny"))


def test_settings_of_how_the_model_is_computed_or_initialised_may_differ(source_run) -> None:
    source = read_init_source(source_run / "hf")
    for setting in ({"loss_impl": "chunked"}, {"attn_backend": "reference"},
                    {"fgate_bias_init": 5.0}, {"initializer_range": 0.1}):  # fmt: skip
        check_init_source(source, presets.config("fot_pro", "tiny", **SMALL_MODEL, **setting))
    with pytest.raises(InitFromError, match=r"norm_eps=1e-06 \(init_from\) vs 1e-05"):
        check_init_source(source, presets.config("fot_pro", "tiny", **SMALL_MODEL, norm_eps=1e-5))


@pytest.mark.parametrize(
    ("variant", "model_name"),
    [("fox_pro", "fot_pro"), ("fox_llama", "fot_llama"), ("fox_pro_fixed", "fot_pro"),
     ("transformer_pro", "transformer_pro"), ("transformer_llama", "transformer_llama")],
)  # fmt: skip
def test_a_paper_checkpoint_loads_into_the_model_the_run_builds(variant, model_name) -> None:
    """The paper's model, built from fot's preset with the overrides the refusal names, computes
    the paper's logits (fox_pro_fixed: a fixed gate, whose decay times the refusal names)."""
    source = read_init_source(PAPER / variant)
    assert source.kind == "paper"
    run_config = presets.config(model_name, "tiny")
    with pytest.raises(InitFromError, match="To start from its weights, set its values: ") as err:
        check_init_source(source, run_config)
    # the overrides the message gives, applied as train.py would
    suggested = str(err.value).split("set its values: ")[1].split()
    overrides = {}
    for item in suggested:
        key, value = item.removeprefix("++model.overrides.").split("=")
        overrides[key] = (
            json.loads(value.lower())
            if value in ("True", "False")
            else float(value)
            if "." in value
            else int(value)
            if value.isdigit()
            else value  # fgate_type=fixed
        )
    run_config = presets.config(model_name, "tiny", **overrides)
    check_init_source(source, run_config)
    model = presets.build_model(run_config)
    load_init_weights(source, model)
    ref = np.load(PAPER / variant / "reference.npz")
    with torch.no_grad():
        got = model.eval()(input_ids=torch.from_numpy(ref["input_ids"])).logits.float()
    want = torch.from_numpy(ref["logits"])
    assert (got - want).norm() / want.norm() < 1e-2  # as fot.convert's test: 1.4e-3 measured


def _bad_folder(tmp_path: Path, kind: str, source_run: Path) -> Path:
    if kind == "missing":
        return tmp_path / "missing"
    if kind == "run folder":
        return source_run
    if kind == "empty":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    folder = tmp_path / kind.replace(" ", "_")
    shutil.copytree(source_run / "hf", folder)
    if kind == "no weights":
        (folder / "model.safetensors").unlink()
    elif kind == "truncated weights":
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "weights of another model":
        from safetensors.torch import load_file, save_file

        state = load_file(folder / "model.safetensors")
        state["model.extra.weight"] = torch.zeros(2)
        del state["model.norm.weight"]
        save_file(state, folder / "model.safetensors")
    elif kind == "llama":
        from eval_helpers import make_llama_checkpoint

        shutil.rmtree(folder)
        make_llama_checkpoint(folder)
    elif kind == "unknown model type":
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt9"}))
    return folder


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", r"is no folder; pass a training checkpoint"),
        ("run folder", r"is a run folder, not a checkpoint: pass .*/hf or .*/checkpoints/step_"),
        ("empty", r"holds neither a training checkpoint .* nor a model's config.json"),
        ("no weights", r"holds no weights \(model.safetensors, its shards"),
        ("truncated weights", r"model.safetensors cannot be read .*incomplete or damaged"),
        ("weights of another model",
         r"do not fit the model of its own config \(missing: \['model.norm.weight'\]; not in "
         r"this model: \['model.extra.weight'\]\)"),
        ("unknown model type", r"model_type 'gpt9'\) is not of a model fot trains"),
        ("llama", r"is a LlamaConfig \(model_type 'llama'\), not a model fot trains"),
    ],
)  # fmt: skip
def test_a_folder_that_is_no_usable_checkpoint_is_named_with_the_fix(
    tmp_path, source_run, kind, message
) -> None:
    folder = _bad_folder(tmp_path, kind, source_run)
    config = presets.config("fot_pro", "tiny", **SMALL_MODEL)
    with pytest.raises(ValueError, match=message):
        source = read_init_source(folder)
        check_init_source(source, config)
        load_init_weights(source, presets.build_model(config))


def test_init_from_a_hub_repository_id_reads_the_downloaded_copy(monkeypatch) -> None:
    """init_from=owner/name downloads it (the hub's snapshot_download, replaced here by the
    local folder it returns) and reads that copy; offline, one error names the hub's error."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download",
        lambda repo_id, **kw: asked.append(repo_id) or str(PAPER / "fox_pro"),
    )  # fmt: skip
    source = read_init_source("zhixuan-lin/fox-pro-760m-longcrawl64-48b")
    assert asked == ["zhixuan-lin/fox-pro-760m-longcrawl64-48b"]
    assert source.kind == "paper" and source.path == PAPER / "fox_pro"
    monkeypatch.undo()  # the real hub client, offline in the tests
    with pytest.raises(InitFromError, match=(
        r"^init_from=owner/missing: 'owner/missing' is no local folder, and downloading it as a "
        r"hub repository failed \(LocalEntryNotFoundError"
    )):  # fmt: skip
        read_init_source("owner/missing")


@pytest.mark.gpu
@pytest.mark.parametrize("parallel", [("parallel.compile=true",), ("parallel=fsdp",)])
def test_init_from_on_the_gpu_with_compiled_blocks_or_fsdp(tmp_path, parallel) -> None:
    """The weights are loaded before the model is compiled or sharded: a checkpoint trained
    on the GPU starts the new run there, under either."""
    _check_init_from_loads_before_wrapping(tmp_path, "device=cuda", *parallel)


def test_init_from_under_fsdp_on_the_cpu(tmp_path) -> None:
    """CPU counterpart of test_init_from_on_the_gpu_with_compiled_blocks_or_fsdp (FSDP in one
    gloo process): the weights are loaded before the model is sharded."""
    _check_init_from_loads_before_wrapping(tmp_path, "parallel=fsdp")


def _check_init_from_loads_before_wrapping(tmp_path: Path, *settings: str) -> None:
    """Train 2 steps with ``settings``, start a new run from that checkpoint with them, and
    check the new run's first checkpoint holds exactly the source's weights."""
    import torch.distributed as dist

    source, out = tmp_path / "source", tmp_path / "run"
    try:
        train(_cfg(source, *settings, "total_tokens=512", "ckpt_every_tokens=0"))
        ckpt = source / "checkpoints" / "step_00000002"
        train(_cfg(out, *settings, *ONE_STEP, f"init_from={ckpt}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    want = _weights(source, 2)
    for key, value in _weights(out, 1).items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=1e-9, msg=key)


def test_the_settings_a_refusal_repeats_leave_out_how_the_model_was_computed(
    tmp_path, source_run
) -> None:
    """A checkpoint trained with a GPU kernel backend: the suggestion names the model, not the
    backend (attn_backend=triton would stop a CPU run)."""
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(source_run / "checkpoints" / "step_00000004", ckpt)
    state = json.loads((ckpt / "trainer.json").read_text())
    state["config"]["model"]["overrides"]["attn_backend"] = "triton"
    (ckpt / "trainer.json").write_text(json.dumps(state))
    source = read_init_source(ckpt)
    with pytest.raises(InitFromError, match="trained with: model=fot_pro size=tiny") as err:
        check_init_source(source, presets.config("fot_llama", "tiny", **SMALL_MODEL))
    assert "attn_backend" not in str(err.value)
    check_init_source(source, presets.config("fot_pro", "tiny", **SMALL_MODEL))


def test_fixed_gates_are_refused_with_other_decay_times(tmp_path) -> None:
    """A fixed gate is a buffer of the weights: decay times that differ from those it was made
    with would be recorded in the new run's export although its gate keeps the loaded ones."""
    config = presets.config("fot_llama_fixed", "tiny", **SMALL_MODEL)
    source = read_init_source(_export(tmp_path / "fixed", "fot_llama_fixed"))
    check_init_source(source, config)
    other = presets.config("fot_llama_fixed", "tiny", **SMALL_MODEL, decay_time_max=100.0)
    with pytest.raises(InitFromError, match=r"decay_time_max=16384.0 \(init_from\) vs 100.0"):
        check_init_source(source, other)
    # a learned gate's decay times only shape its initialisation: they may differ
    learned = read_init_source(_export(tmp_path / "learned", "fot_llama_bias_only"))
    check_init_source(
        learned, presets.config("fot_llama_bias_only", "tiny", **SMALL_MODEL, decay_time_min=4.0)
    )


def _export(folder: Path, model: str) -> Path:
    from fot.export import export_hf

    model = presets.build_model(presets.config(model, "tiny", **SMALL_MODEL))
    return export_hf(model, folder, tokenizer=False)


def test_a_training_checkpoint_exports_as_the_run_exports_its_final_weights(
    tmp_path, source_run, capsys
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from fot.export import main as export_main

    ckpt = source_run / "checkpoints" / "step_00000004"  # the last step: the run's hf/ holds it
    out = tmp_path / "hf_step_00000004"
    assert export_main([str(ckpt), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    got, want = (
        load_file(out / "model.safetensors"),
        load_file(source_run / "hf" / "model.safetensors"),
    )
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    for name in ("config.json", "tokenizer_config.json"):  # train_length, text escaping, ...
        assert json.loads((out / name).read_text()) == json.loads(
            (source_run / "hf" / name).read_text()
        )
    model = AutoModelForCausalLM.from_pretrained(out)  # loads as any export does
    assert model.config.train_length == 64
    # into the same folder again, from another step: replaced, and the line says so
    assert export_main([str(ckpt.parent / "step_00000002"), str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {out}, replacing the earlier export there"
    got = load_file(out / "model.safetensors")
    assert any(not torch.equal(got[k], want[k]) for k in want)  # step 2's weights, not 4's


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("{run}", "{tmp}/o"), r"is not a training checkpoint \(no trainer.json\): it is a run "
         r"folder; pass one of its checkpoints, e.g. .*step_00000004"),
        (("{run}/checkpoints/step_00000006", "{tmp}/o"), r"step_00000006 does not exist; that "
         r"run's checkpoints are step_00000002, step_00000004 \(only the last keep_last are"),
        (("{run}/checkpoints/step_00000004", "{run}/checkpoints/step_00000002"),
         r"step_00000002 is a training checkpoint: the export goes into a folder of its own"),
        (("{run}/checkpoints/step_00000004", "{run}"),
         r"is not empty \(checkpoints, final.json, hf, metrics.jsonl, run_info.json and 1 more\) "
         r"and holds no earlier export: the export goes into a folder of its own"),
        # the run's own export: its final weights, not replaced by another step's
        (("{run}/checkpoints/step_00000002", "{run}/hf"), r"/hf holds the final weights of the "
         r"training run .* \(it may be their only copy\) and is not replaced: write to a folder "
         r"of its own, e.g. <run>/hf_step_<n>, or move .*/hf away first"),
    ],
)  # fmt: skip
def test_export_names_a_folder_that_is_no_checkpoint_and_a_checkpoint_as_out(
    tmp_path, source_run, capsys, args, message
) -> None:
    from fot.export import main as export_main

    argv = [a.format(run=source_run, tmp=tmp_path) for a in args]
    final = {p.name: p.read_bytes() for p in (source_run / "hf").iterdir()}
    assert export_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m fot.export: error: ") and re.search(message, err), err
    assert not (source_run / "checkpoints" / "step_00000002" / "config.json").exists()
    assert not (source_run / "config.json").exists()
    assert final == {p.name: p.read_bytes() for p in (source_run / "hf").iterdir()}


def test_export_replaces_an_earlier_export_and_runs_without_warnings(tmp_path, source_run):
    """``python -m fot.export`` twice into one folder (the second replaces the first), with
    warnings as errors: runpy warns when ``import fot`` has imported fot.export already."""
    out = tmp_path / "hf_step"
    for step in ("00000002", "00000004"):
        cmd = [sys.executable, "-W", "error", "-m", "fot.export",
               str(source_run / "checkpoints" / f"step_{step}"), str(out)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and "Warning" not in res.stderr, res.stderr
    assert json.loads((out / "config.json").read_text())["model_type"] == "fot"


def test_export_names_a_checkpoint_whose_weights_are_of_another_model(
    tmp_path, source_run, capsys
) -> None:
    """trainer.json of one run beside model.pt of a wider model: named, nothing written."""
    ckpt = tmp_path / "step_00000004"
    shutil.copytree(source_run / "checkpoints" / "step_00000004", ckpt)
    wider = presets.build_model(presets.config("fot_pro", "tiny", hidden_size=64, num_heads=2))
    torch.save(wider.state_dict(), ckpt / "model.pt")
    from fot.export import main as export_main

    assert export_main([str(ckpt), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "model.pt does not fit the model its trainer.json describes" in err, err
    assert "the folder mixes files of different runs" in err
    assert not (tmp_path / "out").exists()


def _samba_checkpoint(folder: Path, source_run: Path, **fields) -> Path:
    """A training checkpoint of a Samba without attention layers (no flash-attn here; FLA's
    models do not train on the CPU): the source run's folder with its trainer.json naming
    model=samba and model.pt holding a Samba of ``fields``."""
    ckpt = folder / "step_00000004"
    shutil.copytree(source_run / "checkpoints" / "step_00000004", ckpt)
    state = json.loads((ckpt / "trainer.json").read_text())
    state["config"]["model"] = {"name": "samba", "overrides": {"attn": None}}
    (ckpt / "trainer.json").write_text(json.dumps(state))
    torch.manual_seed(0)
    samba = presets.build_model(presets.config("samba", "tiny", attn=None, **fields))
    torch.save(samba.state_dict(), ckpt / "model.pt")
    return ckpt


def test_a_samba_checkpoint_of_an_older_fot_is_named_by_export_and_init_from(
    tmp_path, source_run, capsys
) -> None:
    """Before mamba_hidden_ratio, fot's Samba had FLA's MLP width (hidden_ratio 4) after its
    Mamba layers too: such a checkpoint (trainer.json without the field) does not fit the
    model this fot builds. Resuming names that cause; python -m fot.export and init_from said
    the folder mixes files of different runs (and init_from: "export it again", which fails
    the same way). They name the older Samba and the way out; other shapes keep the old
    message."""
    from fot.export import main as export_main

    older = _samba_checkpoint(tmp_path / "older", source_run, mamba_hidden_ratio=None)
    assert export_main([str(older), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "holds a Samba of an older fot, whose MLPs after Mamba layers have FLA's width " in err
    assert "(hidden_ratio=4); this fot builds them with mamba_hidden_ratio=3" in err
    assert "with the fot version that wrote it (python -m fot.export CHECKPOINT OUT)" in err
    assert "mixes files" not in err and not (tmp_path / "out").exists()
    source = read_init_source(older)
    run = presets.config("samba", "tiny", attn=None)
    check_init_source(source, run)  # the same config: trainer.json says nothing of the widths
    with pytest.raises(InitFromError, match=(
        rf"^init_from={re.escape(str(older))} holds a Samba of an older fot, .*pass that export "
        r"as init_from, with \+\+model.overrides.mamba_hidden_ratio=null$"
    )):  # fmt: skip
        load_init_weights(source, presets.build_model(run))
    # a Samba of another size beside that trainer.json: files of two runs, as before
    wider = _samba_checkpoint(tmp_path / "wider", source_run, hidden_size=256)
    assert export_main([str(wider), str(tmp_path / "out")]) == 2
    assert "the folder mixes files of different runs" in capsys.readouterr().err
    with pytest.raises(InitFromError, match="the folder mixes files of different models"):
        load_init_weights(read_init_source(wider), presets.build_model(run))
    # and this fot's own Samba checkpoint exports, with its widths in config.json
    current = _samba_checkpoint(tmp_path / "current", source_run)
    assert export_main([str(current), str(tmp_path / "out")]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mamba_hidden_ratio"] == 3


def test_init_from_compares_a_sambas_mlp_widths_not_its_ratios(tmp_path) -> None:
    """A Samba's hidden_ratio and mamba_hidden_ratio give its MLP widths (2/3 x ratio x
    hidden_size rounded up to 256). init_from compared the raw values: an export of FLA's
    widths (mamba_hidden_ratio null, hidden_ratio 4) was refused by a run of
    mamba_hidden_ratio=4, the same model ("mamba_hidden_ratio=None (init_from) vs 4"). It
    compares the widths: ratios that build the same ones pass and load, others are refused."""
    torch.manual_seed(0)
    fla_widths = presets.build_model(
        presets.config("samba", "tiny", attn=None, mamba_hidden_ratio=None)
    )
    fla_widths.save_pretrained(tmp_path)
    source = read_init_source(tmp_path)
    # at hidden_size 128: 4 and 3.5 give width 512; without attention layers hidden_ratio
    # builds no MLP once mamba_hidden_ratio is set
    for same in ({"mamba_hidden_ratio": 4}, {"mamba_hidden_ratio": 3.5},
                 {"mamba_hidden_ratio": 4, "hidden_ratio": 2}):  # fmt: skip
        run = presets.config("samba", "tiny", attn=None, **same)
        check_init_source(source, run)
        model = presets.build_model(run)
        load_init_weights(source, model)
        for key, value in fla_widths.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), (same, key)
    with pytest.raises(InitFromError, match=r"mamba_hidden_ratio=None \(init_from\) vs 3 "):
        check_init_source(source, presets.config("samba", "tiny", attn=None))


def test_fot_eval_names_the_export_command_for_a_training_checkpoint(source_run) -> None:
    from fot.eval.common import load_checkpoint

    ckpt = source_run / "checkpoints" / "step_00000002"
    with pytest.raises(
        FileNotFoundError, match=r"export it with `python -m fot.export (\S+) (\S+)`"
    ) as e:
        load_checkpoint(ckpt)
    command = re.search(r"`python -m fot.export (\S+) (\S+)`", str(e.value))
    assert command.group(1) == str(ckpt)
    assert command.group(2) == str(source_run / "hf_step_00000002")


def _ids_of_its_tokenizer(folder: Path) -> list[str]:
    """The data overrides of training and held-out ids (``.npy`` in ``folder``) below the
    vocabulary of :func:`_fla_with_its_own_tokenizer`'s tokenizer."""
    rng = np.random.default_rng(0)
    for name in ("ids.npy", "heldout.npy"):
        np.save(folder / name, rng.integers(0, 29, 4096).astype(np.uint16))
    return [f"data.path={folder / 'ids.npy'}", f"data.val_path={folder / 'heldout.npy'}"]


def _fla_with_its_own_tokenizer(folder: Path) -> Path:
    """A tiny FLA FoX of test_train's small model size (GPT-2's vocabulary size) saved with a
    tokenizer of its own (test_convert's), where fot's trainer tokenizes with GPT-2."""
    from fla.models import ForgettingTransformerConfig, ForgettingTransformerForCausalLM
    from test_convert import save_own_tokenizer

    config = ForgettingTransformerConfig(vocab_size=50257, fuse_cross_entropy=False, **SMALL_MODEL)
    torch.manual_seed(0)
    ForgettingTransformerForCausalLM(config).save_pretrained(folder)
    save_own_tokenizer(folder)
    return folder


def test_a_run_from_a_model_with_its_own_tokenizer_exports_that_tokenizer(tmp_path) -> None:
    """init_from an FLA FoX with its own tokenizer, trained on ids of that tokenizer (a flat
    .npy): the run's export and python -m fot.export of its checkpoint wrote GPT-2's
    tokenizer and <|endoftext|> (50256) as bos and eos beside the model, so AutoTokenizer and
    generate() used another tokenizer than the model's. They now carry the source's tokenizer
    files, byte for byte, and its bos/eos ids; and a run that would tokenize text with GPT-2
    for it (data=sample) is refused before its folder is made, in one line, with status 2."""
    from test_convert import TOKENIZER_FILES
    from transformers import AutoConfig, AutoTokenizer

    from fot.export import main as export_main

    fla, data = _fla_with_its_own_tokenizer(tmp_path / "fla"), _ids_of_its_tokenizer(tmp_path)
    out = tmp_path / "run"
    settings = ["model=fot_llama", "data=tokens", *data, "data.seq_len=64", "export_hf=true"]
    train(_cfg(out, *ONE_STEP, f"init_from={fla}", *settings))
    step_1 = out / "checkpoints" / "step_00000001"
    assert export_main([str(step_1), str(tmp_path / "step")]) == 0
    # a branch from the run's checkpoint carries it on
    train(_cfg(tmp_path / "branch", "total_tokens=512", f"branch_from={step_1}", *settings))
    for folder in (out / "hf", tmp_path / "step", tmp_path / "branch" / "hf"):
        files = sorted(p.name for p in folder.iterdir() if p.name in TOKENIZER_FILES)
        assert files == ["tokenizer.json", "tokenizer_config.json"], (folder, files)
        for name in files:
            assert (folder / name).read_bytes() == (fla / name).read_bytes(), (folder, name)
        tok = AutoTokenizer.from_pretrained(folder)
        assert tok.get_vocab() == AutoTokenizer.from_pretrained(fla).get_vocab()
        config = AutoConfig.from_pretrained(folder)
        assert (config.bos_token_id, config.eos_token_id) == (1, 2), folder
        generation = json.loads((folder / "generation_config.json").read_text())
        assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2), folder
    refused = tmp_path / "refused"
    cmd = [sys.executable, str(ROOT / "train.py"), *SMALL, *ONE_STEP, f"out_dir={refused}",
           "model=fot_llama", f"init_from={fla}"]  # fmt: skip
    res = _run_script(cmd, cwd=tmp_path)
    lines = [line for line in res.stderr.splitlines() if "Warning" not in line]
    assert res.returncode == 2, res.stderr
    assert lines[-2] == (
        f"train.py: error: init_from={fla} was trained with its own tokenizer, not GPT-2's, "
        "which data=sample reads: tokenize the training and held-out text with that tokenizer "
        "into flat .npy or .bin files of ids and pass data=tokens data.path=<that file> "
        "data.val_path=<the held-out file>"
    ), res.stderr
    assert not refused.exists()


_KILLED_AT_TOKENIZER = """
import os, runpy, signal, sys
from pathlib import Path

real_rename = os.rename


def rename(src, dst, *args, **kwargs):
    # killed as the staged copy of the tokenizer is moved into place
    if Path(src).name.startswith(".tokenizer.new-") and Path(dst).name == "tokenizer":
        os.kill(os.getpid(), signal.SIGKILL)
    return real_rename(src, dst, *args, **kwargs)


os.rename = rename
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_start_killed_while_replacing_the_runs_tokenizer_leaves_it_for_the_resume(
    tmp_path, caplog
) -> None:
    """A run's first start (resume=never in a folder with checkpoints) removed the folder's
    tokenizer/ before moving its new copy in: killed between the two, the folder had none, and
    a resume from its checkpoints exported GPT-2's tokenizer beside a model trained with
    another. The earlier copy is now set aside until the new one is in place, and the resume
    puts it back; its export carries it, and nothing staged is left."""
    from test_convert import TOKENIZER_FILES

    fla, data = _fla_with_its_own_tokenizer(tmp_path / "fla"), _ids_of_its_tokenizer(tmp_path)
    out = tmp_path / "run"
    settings = ["model=fot_llama", "data=tokens", *data, "data.seq_len=64", f"init_from={fla}"]
    train(_cfg(out, *ONE_STEP, *settings))
    assert (out / "checkpoints" / "step_00000001").is_dir() and (out / "tokenizer").is_dir()
    cmd = [sys.executable, "-c", _KILLED_AT_TOKENIZER, str(ROOT / "train.py"), *SMALL,
           *ONE_STEP, f"out_dir={out}", *settings, "resume=never"]  # fmt: skip
    res = _run_script(cmd, cwd=tmp_path)
    assert res.returncode == -9, res.stderr[-3000:]
    assert not (out / "tokenizer").exists()
    # before the resume, python -m fot.export of a checkpoint reads the set-aside copy too
    # (it fell back to GPT-2's tokenizer)
    from fot.training.trainer import export_checkpoint

    with caplog.at_level(logging.WARNING, logger="fot.training.init_weights"):
        exported = export_checkpoint(out / "checkpoints" / "step_00000001", tmp_path / "exported")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (exported / name).read_bytes() == (fla / name).read_bytes(), name
    assert not (exported / "vocab.json").exists()
    assert f"the run's tokenizer {out / 'tokenizer'} is missing: reading the copy" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fot.train"):
        train(_cfg(out, "total_tokens=512", *ONE_STEP[1:], *settings, "export_hf=true"))
    files = sorted(p.name for p in (out / "hf").iterdir() if p.name in TOKENIZER_FILES)
    assert files == ["tokenizer.json", "tokenizer_config.json"], files
    for name in files:
        assert (out / "hf" / name).read_bytes() == (fla / name).read_bytes(), name
    assert any(
        r.getMessage().startswith(f"put back the run's tokenizer {out / 'tokenizer'} from ")
        for r in caplog.records
    ), caplog.text
    assert [p.name for p in out.iterdir() if p.name.startswith(".tokenizer")] == []


def test_a_fot_checkpoint_or_model_where_another_kind_is_read_names_the_option_that_takes_it(
    tmp_path, source_run, capsys
) -> None:
    """python -m fot.convert of a fot training checkpoint said it "has no config.json: pass the
    folder of a checkpoint (downloaded or copied whole)", which it was; of a fot export, that
    fot converts the paper's and FLA's models. branch_from= and resume= an export or converted
    folder said to pass <run>/checkpoints/step_..., of which a converted model has none. Each is
    now one line with status 2 naming what takes the folder, and that advice works. (fot.convert
    and fot.export run in this process, through the ``main`` their ``-m`` runs.)"""
    from transformers import AutoModelForCausalLM

    from fot.convert import main as convert_main
    from fot.export import main as export_main

    step, hf = source_run / "checkpoints" / "step_00000004", source_run / "hf"
    out = tmp_path / "out"

    def one_line(stderr: str) -> str:
        (line,) = [x for x in stderr.splitlines() if ": error: " in x]
        return line

    def error(*args: str) -> str:
        res = _run_script([sys.executable, *args], cwd=tmp_path)
        assert res.returncode == 2, res.stderr
        return one_line(res.stderr)

    def convert_error(*args: str) -> str:
        assert convert_main(list(args)) == 2
        return one_line(capsys.readouterr().err)

    assert convert_error(str(step), str(out)) == (
        f"python -m fot.convert: error: {step} is a training checkpoint of fot, which needs no "
        f"conversion: export it with python -m fot.export {step} {out}, or train on from its "
        f"weights with train.py init_from={step}"
    )
    assert convert_error(str(source_run), str(out)) == (  # was: "has no config.json"
        f"python -m fot.convert: error: {source_run} is a training run of fot, which needs no "
        f"conversion: its final weights are in {hf}; load that as it is (python -m fot.eval, "
        "train.py init_from=<that folder>, or AutoModelForCausalLM after import fot)"
    )
    assert convert_error(str(hf), str(out)) == (
        "python -m fot.convert: error: config.json has model_type 'fot': the folder holds a fot "
        "model already, which needs no conversion; load it as it is (python -m fot.eval, "
        "train.py init_from=<the folder>, or AutoModelForCausalLM after import fot)"
    )
    model_folder = (
        "is a model's folder (config.json and weights: an export, a converted or downloaded "
        "checkpoint), not a training checkpoint (no trainer.json: no optimizer state, step or "
        "data position); a new run starts from its weights with init_from=<that folder>"
    )
    run = [str(ROOT / "train.py"), *SMALL, *ONE_STEP, f"out_dir={tmp_path / 'run'}"]
    assert error(*run, f"branch_from={hf}") == f"train.py: error: branch_from={hf} {model_folder}"
    assert error(*run, f"resume={hf}") == f"train.py: error: {hf} {model_folder}"
    assert not out.exists() and not (tmp_path / "run").exists()
    # the advice: the export and init_from take them
    assert export_main([str(step), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for key, value in _weights(source_run, 4).items():
        assert torch.equal(exported[key], value), key
    train(_cfg(tmp_path / "run", *ONE_STEP, f"init_from={hf}"))
    for key, value in _weights(source_run, 4).items():
        torch.testing.assert_close(_weights(tmp_path / "run", 1)[key], value, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_init_from_a_folder_with_a_cut_short_tokenizer_file_names_the_file(tmp_path, name) -> None:
    """A cut-short tokenizer file beside an init_from model was refused with the tokenizers
    library's words ("its tokenizer files do not load (Expecting ',' delimiter: line ...)"),
    naming no file; the error now names the file and says to copy it again. Oracle: with the
    file copied again, the folder's tokenizer loads (GPT-2's vocabulary: the run exports
    GPT-2's own files)."""
    from transformers import AutoTokenizer

    from fot.tokenizer import save_hf_tokenizer
    from fot.training.init_weights import own_tokenizer

    folder = _export(tmp_path / "model", "fot_pro")
    save_hf_tokenizer(tmp_path / "gpt2")
    AutoTokenizer.from_pretrained(tmp_path / "gpt2").save_pretrained(folder)  # tokenizer.json
    whole = (folder / name).read_bytes()
    (folder / name).write_bytes(whole[: len(whole) // 2])
    with pytest.raises(InitFromError) as info:
        own_tokenizer(read_init_source(folder))
    assert str(info.value).startswith(
        f"init_from={folder}: its {name} cannot be read (not valid JSON: "
    ), str(info.value)
    assert str(info.value).endswith(f"; copy {name} from where the model came from again")
    (folder / name).write_bytes(whole)  # the fix it gives
    assert own_tokenizer(read_init_source(folder)) is None
