"""The lm-eval adapter on local toy tasks equals a direct log-likelihood computation."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
from eval_helpers import QUESTIONS, make_fot_checkpoint, make_llama_checkpoint

from fot.eval.common import load_checkpoint, token_losses

pytest.importorskip("lm_eval")

TEXTS = [
    {"text": "It was a bright cold day in April, and the clocks were striking thirteen."},
    {"text": "Call me Ishmael. Some years ago, never mind how long precisely."},
]


def _write_tasks(root):
    mc_file, text_file = root / "mc.jsonl", root / "text.jsonl"
    (root / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (root / "text.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    (root / "fot_toy_mc.yaml").write_text(f"""task: fot_toy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc_file}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
""")
    (root / "fot_toy_rolling.yaml").write_text(f"""task: fot_toy_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {text_file}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval")
    ckpt = make_llama_checkpoint(root / "ckpt")
    (root / "tasks").mkdir()
    _write_tasks(root / "tasks")
    model, tok = load_checkpoint(ckpt, device="cpu", dtype="float32")
    return root, model, tok


def _logprob(model, context_ids, target_ids):
    ids = torch.tensor([context_ids + target_ids])
    losses = token_losses(model, ids[:, :-1], ids[:, 1:])[0, len(context_ids) - 1 :]
    return -float(losses.sum())


def _samples(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_multiple_choice_matches_direct_loglikelihood(setup):
    from fot.eval.lm_eval_adapter import evaluate, make_fot_lm, table1

    root, model, tok = setup
    lm = make_fot_lm(model, tok, max_length=64, batch_size=3)
    out = root / "out_mc"
    out.mkdir()
    res = evaluate(lm, ["fot_toy_mc"], out=out, include_path=str(root / "tasks"), log_samples=True)
    samples = sorted(_samples(out / "samples_fot_toy_mc.jsonl"), key=lambda s: s["doc_id"])
    assert len(samples) == 2
    n_correct = 0
    for s, q in zip(samples, QUESTIONS):
        ctx = tok.encode(q["question"], add_special_tokens=False)
        direct = []
        for choice in q["choices"]:
            whole = tok.encode(q["question"] + " " + choice, add_special_tokens=False)
            direct.append(_logprob(model, [50256, *ctx], whole[len(ctx) :]))
        got = [float(r[0]) for r in s["filtered_resps"]]
        assert got == pytest.approx(direct, rel=1e-4, abs=1e-4)
        n_correct += int(max(range(len(direct)), key=direct.__getitem__) == q["label"])
    assert res["fot_toy_mc"]["acc,none"] == pytest.approx(n_correct / 2)
    # Resume: the finished task is read back, not recomputed.
    assert evaluate(None, ["fot_toy_mc"], out=out, include_path=str(root / "tasks")) == res
    assert table1({"piqa": {"acc,none": 0.5}}).splitlines()[2].startswith("| - | - | - | 50.00")


def test_a_continuation_is_greedy_only_if_each_of_its_tokens_is_the_argmax(setup):
    """lm-eval's is_greedy (LAMBADA's accuracy): true only where every continuation token is
    the model's most likely next token. Oracle: the argmax of the model's logits, token by
    token; a continuation whose first token is the argmax and second is not is not greedy."""
    from fot.eval.common import model_logits
    from fot.eval.lm_eval_adapter import make_fot_lm

    _, model, tok = setup
    lm = make_fot_lm(model, tok, max_length=64, batch_size=2)
    ctx = [50256, *tok.encode("It was a bright cold day in", add_special_tokens=False)]
    with torch.no_grad():
        first = int(model_logits(model, torch.tensor([ctx]))[0, -1].argmax())
        second = int(model_logits(model, torch.tensor([[*ctx, first]]))[0, -1].argmax())
    other = (second + 1) % model.config.vocab_size  # not the argmax after `first`
    requests = [(None, ctx, [first, second]), (None, ctx, [first, other])]
    assert [greedy for _, greedy in lm._loglikelihood_tokens(requests)] == [True, False]


def test_log_samples_on_a_rerun_writes_the_samples_of_finished_tasks(setup):
    """A rerun with --log-samples after a run without it skipped the finished task and wrote no
    samples_<task>.jsonl, without a word. The task now runs again for them (its requests come
    from the request cache), recorded once. Oracle: a direct log-likelihood of each choice."""
    from fot.eval.lm_eval_adapter import evaluate, make_fot_lm

    root, model, tok = setup
    lm = make_fot_lm(model, tok, max_length=64, batch_size=3)
    out = root / "out_samples_later"
    out.mkdir()
    res = evaluate(lm, ["fot_toy_mc"], out=out, include_path=str(root / "tasks"))
    assert not (out / "samples_fot_toy_mc.jsonl").exists()
    again = evaluate(
        lm, ["fot_toy_mc"], out=out, include_path=str(root / "tasks"), log_samples=True
    )
    assert again == res and len(_lines_of(out / "results.jsonl")) == 1
    samples = sorted(_samples(out / "samples_fot_toy_mc.jsonl"), key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    for s, q in zip(samples, QUESTIONS):
        ctx = tok.encode(q["question"], add_special_tokens=False)
        for choice, resp in zip(q["choices"], s["filtered_resps"]):
            whole = tok.encode(q["question"] + " " + choice, add_special_tokens=False)
            direct = _logprob(model, [50256, *ctx], whole[len(ctx) :])
            assert float(resp[0]) == pytest.approx(direct, rel=1e-4, abs=1e-4)


def _lines_of(path):
    return path.read_text().splitlines()


def test_rolling_loglikelihood_has_one_bos_and_respects_max_length(setup):
    max_length = 8  # the ~17-token texts span three windows
    from fot.eval.lm_eval_adapter import evaluate, make_fot_lm

    root, model, tok = setup
    lm = make_fot_lm(model, tok, max_length=max_length, batch_size=2)
    out = root / f"out_roll{max_length}"
    out.mkdir()
    evaluate(lm, ["fot_toy_rolling"], out=out, include_path=str(root / "tasks"), log_samples=True)
    samples = sorted(_samples(out / "samples_fot_toy_rolling.jsonl"), key=lambda s: s["doc_id"])
    for s, t in zip(samples, TEXTS):
        tokens = tok.encode(t["text"], add_special_tokens=False)
        stream = [50256, *tokens]  # exactly one BOS
        # Independent oracle: consecutive windows of max_length inputs, each predicting the
        # next max_length tokens with only its own window as context.
        direct = 0.0
        for start in range(0, len(tokens), max_length):
            window = stream[start : start + max_length + 1]
            ids = torch.tensor([window])
            direct -= float(token_losses(model, ids[:, :-1], ids[:, 1:]).sum())
        got = s["filtered_resps"][0]
        got = float(got[0] if isinstance(got, list) else got)
        assert got == pytest.approx(direct, rel=1e-4)


def test_task_yaml_file_is_reported_under_its_task_name(setup):
    """`--tasks path/to/task.yaml`: results under the YAML's `task:` name, as by name."""
    from fot.eval.lm_eval_adapter import evaluate, make_fot_lm, other_tasks_table, task_name

    root, model, tok = setup
    lm = make_fot_lm(model, tok, max_length=64, batch_size=3)
    by_name = evaluate(
        lm, ["fot_toy_mc"], out=root / "out_by_name", include_path=str(root / "tasks")
    )
    yaml_file = str(root / "tasks" / "fot_toy_mc.yaml")
    by_file = evaluate(lm, [yaml_file], out=root / "out_by_file")
    assert by_file == by_name and set(by_file) == {"fot_toy_mc"}
    assert by_file["fot_toy_mc"]["acc,none"] in (0.0, 0.5, 1.0)
    keys = [r["key"] for r in _samples(root / "out_by_file" / "results.jsonl")]
    assert keys == ["fot_toy_mc"]
    acc = by_file["fot_toy_mc"]["acc,none"]
    assert f"| fot_toy_mc | acc,none | {acc:.4f} |" in other_tasks_table(by_file).splitlines()
    assert other_tasks_table({"piqa": {"acc,none": 0.5}}) == ""
    nameless = root / "nameless.yaml"
    nameless.write_text("dataset_path: json\n")
    with pytest.raises(ValueError, match="needs a `task: NAME` entry"):
        task_name(str(nameless))


def test_no_git_complaint_outside_a_repository_and_the_hash_still_recorded(
    setup, tmp_path, monkeypatch, capfd
):
    """lm-eval runs `git describe` in the working directory with git's stderr on the terminal:
    evaluating outside a git repository printed `fatal: not a git repository` per task."""
    import subprocess

    import lm_eval.evaluator

    from fot.eval.lm_eval_adapter import evaluate, make_fot_lm, quiet_git_hash

    root, model, tok = setup
    outside = tmp_path / "outside"
    outside.mkdir()
    monkeypatch.chdir(outside)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above either
    lm = make_fot_lm(model, tok, max_length=64, batch_size=3)
    capfd.readouterr()
    res = evaluate(lm, ["fot_toy_mc"], out=tmp_path / "out", include_path=str(root / "tasks"))
    assert set(res) == {"fot_toy_mc"}
    assert "not a git repository" not in capfd.readouterr().err
    with quiet_git_hash():
        assert lm_eval.evaluator.get_git_commit_hash() is None
    # inside a repository the hash is recorded as before: git's own abbreviated commit
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.chdir(repo)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    with quiet_git_hash():
        got = lm_eval.evaluator.get_git_commit_hash()
    assert got and head.startswith(got)


def test_generation_keeps_room_for_the_prompt(setup):
    """generate_until left-truncates the prompt to max_length - max_gen_toks tokens (greedy
    decoding by hand as the oracle) and refuses a max_gen_toks that leaves no room."""
    from types import SimpleNamespace

    from fot.eval.lm_eval_adapter import make_fot_lm

    _, model, tok = setup
    lm = make_fot_lm(model, tok, max_length=12, batch_size=1)
    context = "It was a bright cold day in April, and the clocks were striking"
    request = SimpleNamespace(args=(context, {"max_gen_toks": 4, "until": []}))
    (text,) = lm.generate_until([request], disable_tqdm=True)
    ids = [50256, *tok.encode(context, add_special_tokens=False)][-(12 - 4) :]
    new = []
    with torch.no_grad():
        for _ in range(4):
            logits = model(torch.tensor([ids + new])).logits[0, -1]
            new.append(int(logits.argmax()))
    assert text == tok.decode([t for t in new if t != 50256], skip_special_tokens=True)
    request = SimpleNamespace(args=(context, {"max_gen_toks": 12}))
    with pytest.raises(ValueError, match=r"max_gen_toks=12 .* no room for its prompt"):
        lm.generate_until([request], disable_tqdm=True)


def test_empty_task_data_file_is_named_before_the_model_loads(setup, tmp_path):
    from fot.eval.__main__ import main

    root, _, _ = setup
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    task = tmp_path / "fot_empty.yaml"
    cfg = (root / "tasks" / "fot_toy_mc.yaml").read_text().replace("fot_toy_mc", "fot_empty")
    task.write_text(cfg.replace(str(root / "tasks" / "mc.jsonl"), str(empty)))
    # The checkpoint does not exist: the data file is checked before the model is loaded.
    with pytest.raises(ValueError, match=re.escape(f"data file '{empty}' is empty")):
        main(
            [
                "lm-eval",
                str(tmp_path / "no_ckpt"),
                "--tasks",
                str(task),
                "--out",
                str(tmp_path / "o"),
            ]
        )
    assert not (tmp_path / "o").exists()
    twice = f"fot_toy_mc,{root / 'tasks' / 'fot_toy_mc.yaml'}"
    with pytest.raises(ValueError, match=r"names the task\(s\) \['fot_toy_mc'\] more than once"):
        main(["lm-eval", str(tmp_path / "no_ckpt"), "--tasks", twice, "--include-path",
              str(root / "tasks"), "--out", str(tmp_path / "o")])  # fmt: skip
    assert not (tmp_path / "o").exists()
    # `--include-path "$TASKS"` with TASKS unset: '' was read as the current folder (indexed)
    for option in ("--include-path", "--dataset-root"):
        with pytest.raises(
            ValueError, match=f"^{option} is empty \\(an unset variable\\?\\); name"
        ):
            main(["lm-eval", str(tmp_path / "no_ckpt"), "--tasks", "fot_toy_mc", option, "",
                  "--out", str(tmp_path / "o")])  # fmt: skip
        assert not (tmp_path / "o").exists()


def test_a_task_whose_data_or_template_is_broken_is_named_and_leaves_no_new_out(setup, tmp_path):
    """A data file that ``datasets`` cannot parse and a template naming a field the documents
    lack ended in lm-eval's tracebacks (exit status 1), and left the new --out holding
    run_config.json, the resume record and an empty request cache. Each is now one error
    naming the task and what to fix; a new --out goes again, one with results keeps them."""
    from fot.eval.__main__ import main

    root, _, _ = setup
    ckpt = str(root / "ckpt")
    mc = (root / "tasks" / "fot_toy_mc.yaml").read_text()
    bad = tmp_path / "bad.jsonl"
    bad.write_text((root / "tasks" / "mc.jsonl").read_text() + "{bad\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "fot_bad_data.yaml").write_text(
        mc.replace("fot_toy_mc", "fot_bad_data").replace(str(root / "tasks" / "mc.jsonl"), str(bad))
    )
    (broken / "fot_bad_field.yaml").write_text(
        mc.replace("fot_toy_mc", "fot_bad_field").replace("{{question}}", "{{query}}")
    )
    cases = {
        "fot_bad_data": re.escape(
            f"lm-eval task 'fot_bad_data': the datasets library could not read its data from "
            f"{{'test': '{bad}'}}: JSON parse error"
        ),
        "fot_bad_field": re.escape(
            "lm-eval task 'fot_bad_field': a template in its YAML (doc_to_text, doc_to_target, "
            "doc_to_choice, ...) uses a field its documents do not have ('query' is undefined)"
        ),
    }
    out = tmp_path / "o"
    for task, message in cases.items():
        args = ["lm-eval", ckpt, "--tasks", task, "--include-path", str(broken),
                "--out", str(out), "--device", "cpu"]  # fmt: skip
        with pytest.raises(ValueError, match=message):
            main(args)
        assert not out.exists(), task
    # an --out with a finished task: the failed one adds nothing, and nothing goes
    both = tmp_path / "both"
    for name in ("fot_toy_mc.yaml", "mc.jsonl"):
        (both / name).parent.mkdir(exist_ok=True)
        (both / name).write_text((root / "tasks" / name).read_text())
    (both / "fot_bad_field.yaml").write_text((broken / "fot_bad_field.yaml").read_text())
    args = ["lm-eval", ckpt, "--include-path", str(both), "--out", str(out), "--device", "cpu"]
    main([*args, "--tasks", "fot_toy_mc"])
    # the records: the resume record notes the fingerprint of the added task's file
    records = ("run_config.json", "run_config.history.jsonl", ".run.lock", "lm_eval.resume.json")

    def saved() -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in out.iterdir() if p.name not in records}

    kept = saved()
    assert {"results.jsonl", "lm_cache_rank0.db"} <= set(kept)
    with pytest.raises(ValueError, match=cases["fot_bad_field"]):
        main([*args, "--tasks", "fot_toy_mc,fot_bad_field"])
    assert saved() == kept
    assert all((out / name).is_file() for name in ("run_config.json", "lm_eval.resume.json"))


def test_a_task_file_added_to_the_include_path_lets_the_saved_results_extend(setup, tmp_path):
    """The resume record fingerprinted the whole --include-path folder: a task YAML added
    there for the next run refused the saved results ("the content ... has changed since").
    Only the files the run's tasks may read count now: other tasks' YAML files are left out,
    and a change to a counted file is still named."""
    from fot.eval.__main__ import main
    from fot.eval.common import ResumeMismatchError
    from fot.eval.lm_eval_adapter import include_path_files

    root, _, _ = setup
    tasks = tmp_path / "tasks"
    shutil.copytree(root / "tasks", tasks)
    (tasks / "fot_toy_mc.yaml").write_text(
        (tasks / "fot_toy_mc.yaml").read_text().replace(str(root / "tasks"), str(tasks))
    )
    rolling = (tasks / "fot_toy_rolling.yaml").read_text().replace(str(root / "tasks"), str(tasks))
    (tasks / "fot_toy_rolling.yaml").unlink()
    out = tmp_path / "out"
    args = ["lm-eval", str(root / "ckpt"), "--include-path", str(tasks), "--out", str(out),
            "--device", "cpu"]  # fmt: skip
    first = main([*args, "--tasks", "fot_toy_mc"])
    (tasks / "fot_toy_rolling.yaml").write_text(rolling)  # a task added for the next run
    both = main([*args, "--tasks", "fot_toy_mc,fot_toy_rolling"])
    assert both["fot_toy_mc"] == first["fot_toy_mc"] and "fot_toy_rolling" in both
    # what counts: the run's task files and the data (a template without `task:` too), not
    # the YAML file of a task it does not run, unless a counted file includes it
    (tasks / "_template.yaml").write_text("output_type: multiple_choice\n")
    (tasks / "helper.py").write_text("def f(doc):\n    return doc\n")
    counted = include_path_files(tasks, {"fot_toy_mc"})
    assert counted == ["_template.yaml", "fot_toy_mc.yaml", "helper.py", "mc.jsonl", "text.jsonl"]
    with (tasks / "_template.yaml").open("a") as f:
        f.write("include: fot_toy_rolling.yaml\n")
    assert "fot_toy_rolling.yaml" in include_path_files(tasks, {"fot_toy_mc"})
    (tasks / "_template.yaml").unlink()
    with (tasks / "fot_toy_mc.yaml").open("a") as f:  # a counted file changed: refused
        f.write("num_fewshot: 0\n")
    with pytest.raises(
        ResumeMismatchError, match=r"--include-path: fot_toy_mc\.yaml in .* changed"
    ):
        main([*args, "--tasks", "fot_toy_mc"])
    # results inside the folder would be indexed and fingerprinted: refused before the model
    with pytest.raises(ValueError, match=r"--out '.*tasks/o' is inside --include-path"):
        main(["lm-eval", str(tmp_path / "no_ckpt"), "--include-path", str(tasks),
              "--tasks", "fot_toy_mc", "--out", str(tasks / "o")])  # fmt: skip
    assert not (tasks / "o").exists()


def test_tasks_all_in_the_include_path_skip_indexing_lm_evals_own(setup, tmp_path):
    """Indexing lm-eval's ~15k built-in task files took ~14 s on every `lm-eval` run; tasks all
    defined under --include-path now index that folder only. A task of the folder overrides a
    built-in one of the same name (lm-eval's rule), so both indexes resolve it to that file."""
    from fot.eval.lm_eval_adapter import _plain_task_file, _task_manager

    root, _, _ = setup
    own = _task_manager(str(root / "tasks"), ["fot_toy_mc", "fot_toy_rolling"])
    assert set(own.all_tasks) == {"fot_toy_mc", "fot_toy_rolling"}
    # a built-in task among them: the full index, with the folder's tasks on top
    (tmp_path / "arc_easy.yaml").write_text(
        (root / "tasks" / "fot_toy_mc.yaml").read_text().replace("fot_toy_mc", "arc_easy")
    )
    full = _task_manager(str(tmp_path), ["arc_easy", "hellaswag"])
    assert "hellaswag" in full.all_tasks and len(full.all_tasks) > 1000
    mine = _task_manager(str(tmp_path), ["arc_easy"])
    assert mine.all_tasks == ["arc_easy"]
    assert str(mine.task_index["arc_easy"].yaml_path) == str(full.task_index["arc_easy"].yaml_path)
    assert str(full.task_index["arc_easy"].yaml_path) == str(tmp_path / "arc_easy.yaml")
    # tasks given as YAML files index nothing more (lm-eval loads a file from its path); a
    # group file among them needs the full index, where its tasks are looked up
    yaml_file = str(root / "tasks" / "fot_toy_mc.yaml")
    assert _task_manager(None, [yaml_file]).all_tasks == []
    assert _task_manager(str(root / "tasks"), ["fot_toy_rolling", yaml_file]).all_tasks == [
        "fot_toy_mc",
        "fot_toy_rolling",
    ]
    group = tmp_path / "my_group.yaml"  # (the full index costs seconds: checked by its rule)
    group.write_text("group: my_group\ntask:\n  - hellaswag\n")
    assert _plain_task_file(yaml_file) and not _plain_task_file(str(group))


def test_max_length_past_a_learned_position_table_is_refused_before_the_tasks(
    setup, tmp_path, capsys
):
    """GPT-2's table of n_positions ends the inputs it reads: a --max-length past it was an
    IndexError from inside torch in the middle of a task; now the command stops first (status
    2, naming --max-length and the table's size), and the Python API refuses it too."""
    from types import SimpleNamespace

    from eval_helpers import make_gpt2_checkpoint

    from fot.eval.__main__ import cli
    from fot.eval.lm_eval_adapter import FoTLM

    root, _, _ = setup
    ckpt = make_gpt2_checkpoint(tmp_path / "gpt2", n_positions=8)
    out = tmp_path / "o"
    argv = ["lm-eval", str(ckpt), "--tasks", "fot_toy_rolling", "--include-path",
            str(root / "tasks"), "--device", "cpu", "--out", str(out)]  # fmt: skip
    assert cli([*argv, "--max-length", "9"]) == 2
    err = capsys.readouterr().err
    assert "error: max_length=9 (--max-length) needs inputs of 9 tokens" in err
    assert "learned position table (transformer.wpe) of 8 positions" in err
    assert not out.exists()
    model, tok = load_checkpoint(ckpt, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"max_length=9 .* of 8 positions"):
        FoTLM(model, tok, max_length=9)
    # the whole table is usable: rolling windows of 8 inputs run
    lm = FoTLM(model, tok, max_length=8)
    (total,) = lm.loglikelihood_rolling([SimpleNamespace(args=(TEXTS[0]["text"],))], True)
    assert total < 0


def test_lm_evals_own_models_stay_known_after_the_adapter_is_imported():
    """lm-eval registers its own models (hf, vllm, ...) at its first model lookup only while
    its registry is empty: `import fot.eval.lm_eval_adapter` registered "fot" first, and
    `simple_evaluate(model="hf")` in that process failed ("Supported model names: fot")."""
    code = (
        "import fot.eval.lm_eval_adapter\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('hf').__name__, get_model('fot').__name__)"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["HFLM", "FoTLM"]


def test_fot_and_lm_evals_hf_model_agree_on_an_exported_fot_folder(setup, tmp_path):
    """lm-eval's own `hf` model (HFLM, an independent oracle) on a fot export, as users run it
    (`pretrained=DIR,trust_remote_code=True`): with `add_bos_token=True` (the exported
    tokenizer's default) every loglikelihood request scores as fot's adapter scores it (one
    BOS in front of the context). Rolling log-likelihood differs by design (eval/README.md):
    HFLM scores the text's tokens with a BOS in front and a second BOS as the window prefix,
    `[BOS] [BOS] text`, counting log p(BOS | BOS) too; fot scores `[BOS] text`."""
    import lm_eval

    from fot.eval.lm_eval_adapter import _task_manager

    root, _, _ = setup
    ckpt = make_fot_checkpoint(tmp_path / "fot")
    model, tok = load_checkpoint(ckpt, device="cpu", dtype="float32")
    tasks = ["fot_toy_mc", "fot_toy_rolling"]
    tm = _task_manager(str(root / "tasks"), tasks)
    common = f"pretrained={ckpt},dtype=float32,device=cpu,batch_size=3,max_length=64"
    runs = {
        name: lm_eval.simple_evaluate(model=name, model_args=f"{common}{extra}", tasks=tasks,
                                      task_manager=tm, log_samples=True, bootstrap_iters=0)
        for name, extra in (("fot", ""), ("hf", ",trust_remote_code=True,add_bos_token=True"))
    }  # fmt: skip
    fot, hf = ({t: sorted(r["samples"][t], key=lambda s: s["doc_id"]) for t in tasks}
               for r in runs.values())  # fmt: skip
    got = [float(r[0]) for s in fot["fot_toy_mc"] for r in s["filtered_resps"]]
    want = [float(r[0]) for s in hf["fot_toy_mc"] for r in s["filtered_resps"]]
    assert len(got) == sum(len(q["choices"]) for q in QUESTIONS)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-5)
    for f, h, t in zip(fot["fot_toy_rolling"], hf["fot_toy_rolling"], TEXTS):
        tokens = tok.encode(t["text"], add_special_tokens=False)  # ~17 tokens: one window
        assert float(f["filtered_resps"][0]) == pytest.approx(
            _logprob(model, [50256], tokens), rel=1e-5
        )
        assert float(h["filtered_resps"][0]) == pytest.approx(
            _logprob(model, [50256], [50256, *tokens]), rel=1e-5
        )
