"""HF export: config + safetensors + tokenizer + auto_map remote-code shims."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    assert tok.eos_token_id == 50256 and tok("Hello world")["input_ids"] == [15496, 995]


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


def test_export_rejects_non_hf_modules(tmp_path) -> None:
    with pytest.raises(TypeError, match="PreTrainedModel"):
        export_hf(torch.nn.Linear(2, 2), tmp_path)
