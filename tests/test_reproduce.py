"""The small-scale reproduction pipeline (benchmarks/make_corpus.py, reproduce_small.py) at toy
scale on CPU: corpus building, two tiny trainings, every evaluation, the report and its claims."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


make_corpus = _load("make_corpus")
repro = _load("reproduce_small")

PY_DOCS = {
    "library/a.rst.txt": "The quick brown fox jumps over the lazy dog.\n" * 20,
    "library/b.rst.txt": "Python is a programming language that lets you work quickly.\n" * 30,
    "tutorial/c.rst.txt": "An informal introduction to Python, with many examples.\n" * 25,
}
LINUX_DOCS = {
    "admin-guide/x.rst.gz": "The kernel schedules tasks on every processor.\n" * 40,
    "process/y.rst.gz": "Submitting patches: the essential guide to getting your code in.\n" * 15,
}


def _debian_tree(root: Path) -> Path:
    for rel, text in PY_DOCS.items():
        f = root / make_corpus.PYTHON_DOCS / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    for rel, text in LINUX_DOCS.items():
        f = root / make_corpus.LINUX_DOCS / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(gzip.compress(text.encode()))
    (root / "usr/share/doc/python3.11/html/_sources/ignored.html").write_text("<p>not rst</p>")
    return root


@pytest.fixture
def few_plays(monkeypatch):
    """Replace the Shakespeare plays by three short named texts (fast, exact oracle)."""
    import fot.data.sample as sample

    plays = [("p0", "To be, or not to be. " * 10), ("p1", "All the world's a stage. " * 12),
             ("p2", "Now is the winter of our discontent. " * 8)]  # fmt: skip
    monkeypatch.setattr(sample, "sample_named_texts", lambda: plays)
    monkeypatch.setattr(sample, "sample_source", lambda: "plays")
    return plays


def test_corpus_split_counts_and_round_trip(tmp_path, few_plays):
    from fot.data.tokens import TokenDocuments
    from fot.tokenizer import get_encoding

    enc = get_encoding()
    src = _debian_tree(tmp_path / "deb")
    s = make_corpus.build_corpus(tmp_path / "c", [src], heldout_every=2)
    # Oracle: sorted per source, every 2nd document (index 1, 3, ...) held out.
    expect: dict[str, tuple[list[str], list[str]]] = {}
    for source, docs in (
        ("plays", [t for _, t in few_plays]),
        ("python-docs", [PY_DOCS[k] for k in sorted(PY_DOCS)]),
        ("linux-docs", [LINUX_DOCS[k] for k in sorted(LINUX_DOCS)]),
    ):
        expect[source] = ([d for i, d in enumerate(docs) if i % 2 == 0], docs[1::2])
    train_texts = [t for tr, _ in expect.values() for t in tr]
    held_texts = [t for _, h in expect.values() for t in h]
    tr, hv = TokenDocuments(tmp_path / "c" / "train"), TokenDocuments(tmp_path / "c" / "heldout")
    assert [enc.decode(d.tolist()) for d in tr] == train_texts
    assert [enc.decode(d.tolist()) for d in hv] == held_texts
    assert tr[0].dtype == np.uint16
    assert s["train_tokens"] == sum(len(enc.encode_ordinary(t)) for t in train_texts)
    assert s["heldout_tokens"] == sum(len(enc.encode_ordinary(t)) for t in held_texts)
    assert s["sources"]["linux-docs"] == {
        "train_docs": 1,
        "train_tokens": len(enc.encode_ordinary(LINUX_DOCS["admin-guide/x.rst.gz"])),
        "heldout_docs": 1,
        "heldout_tokens": len(enc.encode_ordinary(LINUX_DOCS["process/y.rst.gz"])),
    }
    assert not s["subsampled"] and s["fits_transfer_limit"]
    assert json.loads((tmp_path / "c" / "corpus.json").read_text()) == s
    # the size is the two token folders', the same on a rerun into the folder (it counted the
    # earlier run's corpus.json too)
    folders = [tmp_path / "c" / d for d in ("train", "heldout")]
    assert s["bytes_on_disk"] == sum(f.stat().st_size for d in folders for f in d.iterdir())
    assert make_corpus.build_corpus(tmp_path / "c", [src], heldout_every=2) == s


def test_corpus_cap_subsamples_training_documents_only(tmp_path, few_plays):
    src = _debian_tree(tmp_path / "deb")
    full = make_corpus.build_corpus(tmp_path / "full", [src], heldout_every=2)
    cap = full["heldout_tokens"] + full["train_tokens"] // 2
    s = make_corpus.build_corpus(tmp_path / "cap", [src], heldout_every=2, max_tokens=cap)
    assert (
        s["subsampled"] and s["tokens_before_cap"] == full["train_tokens"] + full["heldout_tokens"]
    )
    assert s["train_tokens"] + s["heldout_tokens"] <= cap
    assert 0 < s["train_docs"] < full["train_docs"]
    assert s["heldout_tokens"] == full["heldout_tokens"]  # held-out documents never dropped
    again = make_corpus.build_corpus(tmp_path / "cap2", [src], heldout_every=2, max_tokens=cap)
    assert again["sources"] == s["sources"]  # deterministic


def test_corpus_cap_below_heldout_is_refused(tmp_path, few_plays, capsys):
    """A cap that the held-out documents alone fill would leave an empty training set (it was
    written with exit status 0): refused with the numbers, before anything is written."""
    src = _debian_tree(tmp_path / "deb")
    full = make_corpus.build_corpus(tmp_path / "full", [src], heldout_every=2)
    held = full["heldout_tokens"]
    with pytest.raises(ValueError, match=f"held-out documents alone have {held} tokens"):
        make_corpus.build_corpus(tmp_path / "cap", [src], heldout_every=2, max_tokens=held)
    assert not (tmp_path / "cap").exists()
    with pytest.raises(SystemExit) as exc:
        make_corpus.main(["--out", str(tmp_path / "zero"), "--max-tokens", "0"])
    assert exc.value.code == 2 and "--max-tokens must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "zero").exists()


def test_corpus_bad_source_dir_is_named(tmp_path, few_plays):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \*\.rst\.txt"):
        make_corpus.build_corpus(tmp_path / "c", [tmp_path / "empty"])
    assert (
        make_corpus.main(["--out", str(tmp_path / "c"), "--source-dir", str(tmp_path / "no")]) == 2
    )


def _res(**losses):
    return {m: {"error": None, "loss": np.asarray(v, dtype=float)} for m, v in losses.items()}


def test_claim_rules_on_hand_made_curves():
    T = 8
    flat = [3.0] * (4 * T)
    degrade = [3.0] * (2 * T) + [4.0] * (2 * T)  # d = +1.0 beyond 2T
    res = _res(fot_llama=flat, fot_pro=flat, transformer_llama=degrade, transformer_pro=flat)
    c = {x["claim"]: x for x in repro.judge_claims(res, T)}
    assert c["FoT extrapolates where Transformer (LLaMA) degrades"]["verdict"] == "reproduced"
    assert (
        "d(transformer_llama) = +1.0000"
        in c["FoT extrapolates where Transformer (LLaMA) degrades"]["numbers"]
    )
    assert c["FoT L(i) <= Transformer at long positions"]["verdict"] == "reproduced"
    assert c["Transformer without RoPE is much worse"]["verdict"] == "inconclusive"  # missing
    # FoT worse than the Transformer at long positions by 0.1 nats: not reproduced.
    worse = [3.1] * (4 * T)
    res = _res(fot_llama=worse, transformer_llama=flat, transformer_llama_nope=[3.2] * (4 * T))
    c = {x["claim"]: x for x in repro.judge_claims(res, T)}
    assert c["FoT L(i) <= Transformer at long positions"]["verdict"] == "not reproduced"
    assert c["FoT extrapolates where Transformer (LLaMA) degrades"]["verdict"] == "not reproduced"
    assert c["Transformer without RoPE is much worse"]["verdict"] == "reproduced"
    # Recurrent: FoT keeps improving between T/8 and T, DeltaNet does not.
    improving = np.linspace(4.0, 3.0, 4 * T)
    res = _res(fot_pro=improving, deltanet=flat)
    c = {x["claim"]: x for x in repro.judge_claims(res, T)}
    assert c["Recurrent baseline's L(i) flattens early"]["verdict"] == "reproduced"
    res = _res(fot_pro=flat, deltanet=improving)
    c = {x["claim"]: x for x in repro.judge_claims(res, T)}
    assert c["Recurrent baseline's L(i) flattens early"]["verdict"] == "not reproduced"
    # Needle: scores over cells with length <= T only.
    res = _res(fot_llama=flat)
    res["fot_llama"]["needle"] = [
        {"context_length": 8, "depth": 0, "score": 10.0},
        {"context_length": 8, "depth": 50, "score": 9.0},
        {"context_length": 16, "depth": 0, "score": 1.0},  # beyond T: not counted
    ]
    c = {x["claim"]: x for x in repro.judge_claims(res, T)}
    assert c["Easy needle near perfect within T for FoT"]["verdict"] == "reproduced"
    assert "fot_llama: 9.50" in c["Easy needle near perfect within T for FoT"]["numbers"]


def _table(md: str, header_start: str) -> dict[str, list[str]]:
    lines = md.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(header_start))
    rows = {}
    for ln in lines[i + 2 :]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_toy_pipeline_report_matches_eval_outputs(tmp_path, monkeypatch):
    # A real (small) corpus: the plays plus two Debian-style documents.
    data = tmp_path / "data"
    make_corpus.build_corpus(data, [_debian_tree(tmp_path / "deb")], heldout_every=20)
    out, report = tmp_path / "out", tmp_path / "docs" / "results.md"
    argv = ["--data", str(data), "--out", str(out), "--report", str(report), "--toy"]
    assert repro.main(argv) == 0
    md = report.read_text()
    assert "Toy run" in md
    for png in ("per_token_loss.png", "needle_easy.png", "forgetting_curve.png"):
        assert (tmp_path / "docs" / "results_files" / png).stat().st_size > 1000
        assert f"results_files/{png}" in md
    labels = {m: repro.MODELS[m] for m in repro.TOY_MODELS}
    runs = _table(md, "| model | params")
    ptab = _table(md, "| model | l=")
    wtab = _table(md, "| model | [0,")
    ntab = _table(md, "| model | 64 | 128 |")
    ftab = _table(md, "| model | 64 | 128 | fine")
    for m, label in labels.items():
        final = json.loads((out / "runs" / m / "final.json").read_text())
        assert runs[label][1] == f"{final['tokens']:,}" and runs[label][-1] == "ok"
        assert float(runs[label][5]) == pytest.approx(final["val/loss"], abs=5e-5)
        npz = np.load(out / "eval" / m / "ptl" / "per_token_loss.npz")
        assert npz["loss"].shape == (256,)
        # P(l) table = the eval's perplexities; its l = exp of the mean of L over the first l.
        assert [float(x) for x in ptab[label]] == pytest.approx(npz["perplexity"], abs=6e-4)
        assert np.exp(npz["loss"].mean()) == pytest.approx(npz["perplexity"][-1], rel=1e-6)
        T = 64
        for cell, (a, b) in zip(wtab[label], [(0, 16), (16, 32), (32, 64), (64, 128), (128, 256)]):
            assert float(cell) == pytest.approx(npz["loss"][a:b].mean(), abs=6e-5)
        rows = (out / "eval" / m / "needle" / "needle_easy.csv").read_text().splitlines()[1:]
        for j, n in enumerate((64, 128)):
            sc = [float(r.split(",")[3]) for r in rows if r.split(",")[0] == str(n)]
            assert float(ntab[label][j]) == pytest.approx(np.mean(sc), abs=6e-3)
        fc = json.loads((out / "eval" / m / "fc" / "summary.json").read_text())
        assert ftab[label][-2:] == [
            str(fc["fine_grained_length"]),
            str(fc["coarse_grained_length"]),
        ]
        assert repro.settings_for(repro_args(argv)).train_length == T
    # The claims in the report are the script's verdicts on these very numbers.
    claims = json.loads((out / "claims.json").read_text())
    res = repro.load_results(out, repro.settings_for(repro_args(argv)))
    assert claims == repro.judge_claims(res, 64)
    for c in claims:
        assert f"**{c['claim']}: {c['verdict']}.** {c['numbers']}" in md
    # Degradation numbers recomputed from the npz files.
    d = {m: res[m]["loss"][128:256].mean() - res[m]["loss"][32:64].mean() for m in labels}
    for m, x in d.items():
        assert re.search(rf"d\({m}\) = {x:+.4f}", md)
    # Rerun: nothing retrained, same report.
    before = (out / "runs" / "fot_llama" / "repro_train.json").read_text()
    assert repro.main([*argv, "--report-only"]) == 0
    assert (out / "runs" / "fot_llama" / "repro_train.json").read_text() == before
    assert report.read_text() == md
    assert f"python benchmarks/reproduce_small.py {' '.join(argv)}" in md
    # Resuming the same --out with other settings (not --toy here) is refused.
    with pytest.raises(SystemExit):
        repro.main(["--data", str(data), "--out", str(out), "--report", str(report)])
    assert report.read_text() == md
    # A missing evaluation shows as a failure; the model's other results stay in the report.
    import shutil

    shutil.rmtree(out / "eval" / "transformer_llama" / "needle")
    assert repro.main([*argv, "--report-only"]) == 0
    md2 = report.read_text()
    label = labels["transformer_llama"]
    assert "FAILED: missing results: needle" in _table(md2, "| model | params")[label][-1]
    assert label in _table(md2, "| model | l=") and label not in _table(md2, "| model | 64 | 128 |")
    # A call at another commit, on another machine: each call keeps its own (the report named
    # the last call's commit and device for all models)
    first = f"# git {repro._git_sha()}, {repro._device()}"
    monkeypatch.setattr(repro, "_git_sha", lambda: "f" * 40)
    monkeypatch.setattr(repro, "_device", lambda: "another machine")
    assert repro.main([*argv, "--models", "fot_llama"]) == 0
    md3 = report.read_text()
    assert "at several commits (per call below)" in md3 and "**Device:** several" in md3
    assert first in md3 and f"# git {'f' * 40}, another machine" in md3


def repro_args(argv):
    import argparse

    ns = argparse.Namespace(toy="--toy" in argv, models=None, budget_minutes=20.0)
    return ns


def test_bad_data_folder_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        repro.main(["--data", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert "make_corpus.py" in capsys.readouterr().err


def test_report_only_without_an_earlier_run_is_refused(tmp_path, capsys):
    """``--report-only`` with a mistyped ``--out`` wrote a report of nothing (every model
    "missing") over the real one (docs/results.md by default) and exited 0."""
    from fot.data.tokens import write_token_documents

    data = tmp_path / "data"
    for sub in ("train", "heldout"):
        write_token_documents(data / sub, [np.arange(50, dtype=np.uint16)], source="test")
    report = tmp_path / "results.md"
    report.write_text("the real report")
    with pytest.raises(SystemExit) as exc:
        repro.main(["--data", str(data), "--out", str(tmp_path / "typo"), "--report-only",
                    "--report", str(report)])  # fmt: skip
    assert exc.value.code == 2 and "holds no earlier run" in capsys.readouterr().err
    assert report.read_text() == "the real report" and not (tmp_path / "typo").exists()


def test_budget_scales_tokens():
    a = repro.settings_for(repro_args([]))
    b = repro.settings_for(type(repro_args([]))(toy=False, models=None, budget_minutes=10.0))
    assert a.total_tokens == 128 * 131072 and b.total_tokens == 64 * 131072
    assert a.models == list(repro.MODELS) and a.eval_length == 8192


def test_repro_small_preset_is_identical_for_every_model():
    from hydra import compose, initialize_config_dir

    from fot.training.config import register_configs, to_container
    from fot.training.trainer import check_sizes, model_config_from_train_config

    register_configs()
    seen = {}
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        for m in repro.MODELS:
            cfg = compose(
                "train", overrides=["experiment=repro_small", f"model={m}", "data.path=x"]
            )
            check_sizes(cfg, 1)
            assert model_config_from_train_config(cfg) is not None
            c = to_container(cfg)
            assert c.pop("model")["name"] == m
            seen[m] = c
    first = seen["fot_pro"]
    assert all(c == first for c in seen.values())  # same data, budget, schedule, seed
    assert first["size"]["name"] == "125m" and first["data"]["seq_len"] == 2048
    assert first["data"]["kind"] == "tokens" and first["total_tokens"] == 128 * 131072
    assert first["global_batch_tokens"] == repro.BATCH_TOKENS
