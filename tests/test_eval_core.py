"""fot.eval common pieces and per-token loss: checked against direct cross-entropy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from eval_helpers import make_fot_checkpoint, make_llama_checkpoint

from fot.eval.common import (
    JsonlLog,
    ResumeMismatchError,
    checkpoint_fingerprint,
    claim_results,
    encode_text,
    hidden_and_head,
    load_checkpoint,
    next_token_argmax,
    parse_int_list,
    token_losses,
)
from fot.eval.per_token_loss import (
    PerTokenLossAccumulator,
    evaluate_per_token_loss,
    moving_average,
    plot_per_token_loss,
    write_results,
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_llama_checkpoint(tmp_path_factory.mktemp("llama") / "ckpt")
    return load_checkpoint(path, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def fot_model(tmp_path_factory):
    path = make_fot_checkpoint(tmp_path_factory.mktemp("fot") / "ckpt")
    return load_checkpoint(path, device="cpu", dtype="float32")


@torch.no_grad()
def _direct_ce(model, ids):
    logits = model(input_ids=ids[:, :-1]).logits.float()
    return F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")


@pytest.mark.parametrize("which", ["llama", "fot_model"])
def test_token_losses_equal_direct_cross_entropy(which, request):
    model, _ = request.getfixturevalue(which)
    ids = torch.randint(0, 50257, (2, 37), generator=torch.Generator().manual_seed(1))
    got = token_losses(model, ids[:, :-1], ids[:, 1:], chunk_size=8)  # chunked head path
    want = _direct_ce(model, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.shape == (2, 36)
    # ignore_index positions give 0
    labels = ids[:, 1:].clone()
    labels[:, 5] = -100
    assert torch.all(token_losses(model, ids[:, :-1], labels)[:, 5] == 0)


@pytest.mark.parametrize("which", ["llama", "fot_model"])
def test_next_token_argmax_matches_logits(which, request):
    model, _ = request.getfixturevalue(which)
    ids = torch.randint(0, 50257, (1, 20), generator=torch.Generator().manual_seed(2))
    want = model(input_ids=ids).logits[:, 4:15].argmax(-1)
    assert torch.equal(next_token_argmax(model, ids, 4, 15, chunk_size=3), want)
    with pytest.raises(ValueError, match="start < end"):
        next_token_argmax(model, ids, 5, 5)


def _scaled_logits_models():
    """Tiny random HF models whose logits are not ``lm_head(decoder(x))``."""
    from transformers import (
        FalconH1Config,
        FalconH1ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        RecurrentGemmaConfig,
        RecurrentGemmaForCausalLM,
    )

    class HalvedLogits(LlamaForCausalLM):  # no config field says so: the probe finds it
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits / 2
            return out

    small = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    torch.manual_seed(0)
    yield "halved", HalvedLogits(LlamaConfig(**small, num_hidden_layers=1))
    yield (
        "granite",
        GraniteForCausalLM(
            GraniteConfig(**small, num_hidden_layers=1, num_key_value_heads=2, logits_scaling=8.0)
        ),
    )
    yield (
        "recurrent_gemma",
        RecurrentGemmaForCausalLM(
            RecurrentGemmaConfig(
                **small,
                num_hidden_layers=3,  # the cache needs an attention layer (the 3rd)
                num_key_value_heads=2,
                lru_width=32,
                logits_soft_cap=2.0,
            )
        ),
    )
    yield (
        "falcon_h1",
        FalconH1ForCausalLM(
            FalconH1Config(
                **small,
                num_hidden_layers=1,
                num_key_value_heads=2,
                head_dim=16,
                mamba_d_ssm=32,
                mamba_n_heads=2,
                mamba_d_head=16,
                mamba_d_state=8,
                mamba_chunk_size=16,
                lm_head_multiplier=0.1,
            )
        ),
    )


def test_models_that_scale_or_cap_their_logits_are_scored_by_their_own_forward():
    """Granite divides its logits, RecurrentGemma soft-caps them, Falcon-H1 multiplies them
    (config fields), a subclass halves them (found by comparing with the forward):
    the losses, argmaxes and lm-eval scores of fot.eval are those of the model's own logits
    (before, its head of the decoder's states: Granite's loss read 19.7 instead of 11.1)."""
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    for name, model in _scaled_logits_models():
        model.eval()
        assert hidden_and_head(model, ids) is None, name
        want = _direct_ce(model, ids)
        got = token_losses(model, ids[:, :-1], ids[:, 1:], chunk_size=8)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=name)
        with torch.no_grad():
            argmax = model(input_ids=ids).logits[:, 3:20].argmax(-1)
        assert torch.equal(next_token_argmax(model, ids, 3, 20), argmax), name


def test_models_whose_logits_are_their_head_of_the_decoder_are_split(llama, fot_model):
    ids = torch.randint(0, 50257, (1, 20), generator=torch.Generator().manual_seed(4))
    for model, _ in (llama, fot_model):
        hidden, head = hidden_and_head(model, ids)
        with torch.no_grad():
            want = model(input_ids=ids).logits
        torch.testing.assert_close(head(hidden), want, rtol=1e-5, atol=1e-5)


def test_states_of_another_process_count_fold_and_resume(llama, tmp_path):
    """Sums saved by three processes (one interrupted) continue in one process, and then in two:
    every document is counted once, and a fold that a crash cut short is not counted twice."""
    import shutil

    from fot.eval.per_token_loss import fold_foreign_states, share_of_documents, state_file

    model, _ = llama
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 50257, size=24) for _ in range(7)]
    ids, length = list(range(7)), 24
    whole, _ = evaluate_per_token_loss(model, docs, ids, length=length, progress=False)
    # three torchrun processes, rank 0 interrupted after one of its three documents
    for rank, share in ((0, [0]), (1, ids[1::3]), (2, ids[2::3])):
        evaluate_per_token_loss(
            model, docs, share, length=length, state_path=state_file(tmp_path, rank, 3),
            save_every=1, progress=False,
        )  # fmt: skip
    # a crash after the fold's write but before it deleted the folded files: they come back
    kept = tmp_path / "kept"
    kept.mkdir()
    shutil.copy2(tmp_path / "state_rank2.npz", kept / "state_rank2.npz")  # same mtime
    # two processes now: rank 2's file is folded into rank 0's, rank 1 continues its own
    assert fold_foreign_states(tmp_path, 2) == ["state_rank2.npz"]
    shutil.copy2(kept / "state_rank2.npz", tmp_path / "state_rank2.npz")
    assert fold_foreign_states(tmp_path, 2) == []  # recognised as folded and deleted
    assert sorted(p.name for p in tmp_path.glob("state*.npz")) == [
        "state_rank0.npz",
        "state_rank1.npz",
    ]
    shares = [share_of_documents(tmp_path, ids, r, 2) for r in range(2)]
    # each keeps what its state holds (rank 0: 0, and 2, 5 folded; rank 1: 1, 4); 3 and 6,
    # which no state has, are shared out
    assert shares == [[0, 2, 3, 5], [1, 4, 6]]
    # rank 1 finishes its document; rank 0 is stopped before its; one process resumes
    evaluate_per_token_loss(
        model, docs, shares[1], length=length, state_path=state_file(tmp_path, 1, 2),
        progress=False,
    )  # fmt: skip
    assert fold_foreign_states(tmp_path, 1) == ["state_rank0.npz", "state_rank1.npz"]
    share = share_of_documents(tmp_path, ids, 0, 1)
    assert share == ids
    acc, done = evaluate_per_token_loss(
        model, docs, share, length=length, state_path=state_file(tmp_path, 0, 1), progress=False
    )
    assert sorted(done) == ids
    np.testing.assert_array_equal(acc.count, np.full(length - 1, 7))
    np.testing.assert_allclose(acc.loss_sum, whole.loss_sum, rtol=1e-12)


def test_a_fold_cut_short_and_rerun_in_the_earlier_layout_counts_each_document_once(
    llama, tmp_path, monkeypatch
):
    """A one-process run's state.npz folded into state_rank0.npz by a two-process rerun that
    is killed before it deletes state.npz, then resumed in one process again: state.npz is
    recognised from state_rank0.npz's record, and the sums equal an uninterrupted run's."""
    from pathlib import Path

    from fot.eval.per_token_loss import fold_foreign_states, share_of_documents, state_file

    model, _ = llama
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 50257, size=16) for _ in range(4)]
    ids, length = list(range(4)), 16
    whole, _ = evaluate_per_token_loss(model, docs, ids, length=length, progress=False)
    # one process finished documents 0 and 1
    evaluate_per_token_loss(
        model, docs, [0, 1], length=length, state_path=state_file(tmp_path, 0, 1),
        progress=False,
    )  # fmt: skip

    def killed(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:  # two processes: killed after the fold's write
        m.setattr(Path, "unlink", killed)
        with pytest.raises(KeyboardInterrupt):
            fold_foreign_states(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.glob("state*.npz")) == [
        "state.npz",
        "state_rank0.npz",
    ]
    # one process again
    assert fold_foreign_states(tmp_path, 1) == ["state_rank0.npz"]
    share = share_of_documents(tmp_path, ids, 0, 1)
    acc, done = evaluate_per_token_loss(
        model, docs, share, length=length, state_path=state_file(tmp_path, 0, 1), progress=False
    )
    assert sorted(done) == ids
    np.testing.assert_array_equal(acc.count, whole.count)
    np.testing.assert_allclose(acc.loss_sum, whole.loss_sum, rtol=1e-12)


def test_accumulator_equals_direct_mean_and_resumes(llama, tmp_path, monkeypatch):
    model, _ = llama
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50257, size=n) for n in (40, 33, 50, 32, 64)]
    length = 32
    acc, done = evaluate_per_token_loss(
        model, docs, [0, 1, 2, 3, 4], length=length, batch_size=2, progress=False
    )
    assert sorted(done) == [0, 1, 2, 3, 4]
    ids = torch.tensor(np.stack([d[:length] for d in docs]), dtype=torch.long)
    want = _direct_ce(model, ids).double().mean(0).numpy()
    np.testing.assert_allclose(acc.mean(), want, rtol=1e-5)
    hz = acc.horizon_average([1, 10, 31])
    assert hz[31] == pytest.approx(want.mean(), rel=1e-6)
    assert hz[10] == pytest.approx(want[:10].mean(), rel=1e-6)

    # Interrupted run: first two documents, then the rest from the saved state.
    state = tmp_path / "state.npz"
    evaluate_per_token_loss(
        model, docs, [0, 1], length=length, state_path=state, save_every=1, progress=False
    )
    acc2, done2 = evaluate_per_token_loss(
        model, docs, [0, 1, 2, 3, 4], length=length, state_path=state, progress=False
    )
    assert sorted(done2) == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(acc2.mean(), acc.mean(), rtol=1e-6)
    np.testing.assert_array_equal(acc2.count, np.full(length - 1, 5))

    # Ctrl-C after three documents with save_every=8: the three finished ones are saved (they
    # used to be lost until the next multiple of save_every), then the rest resumes from them.
    import fot.eval.per_token_loss as ptl

    calls = {"n": 0}
    real_losses = ptl.token_losses

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real_losses(*args, **kwargs)

    state = tmp_path / "state_ctrl_c.npz"
    monkeypatch.setattr(ptl, "token_losses", interrupted)
    with pytest.raises(KeyboardInterrupt):
        evaluate_per_token_loss(
            model, docs, [0, 1, 2, 3, 4], length=length, state_path=state, progress=False
        )
    monkeypatch.setattr(ptl, "token_losses", real_losses)
    assert sorted(np.load(state)["done"].tolist()) == [0, 1, 2]
    acc4, done4 = evaluate_per_token_loss(
        model, docs, [0, 1, 2, 3, 4], length=length, state_path=state, progress=False
    )
    assert sorted(done4) == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(acc4.mean(), acc.mean(), rtol=1e-6)

    # With BOS: `length` positions, position 0 predicts the first token from BOS alone.
    acc3, _ = evaluate_per_token_loss(model, docs, [0], length=8, bos_id=50256, progress=False)
    with_bos = torch.tensor([[50256, *docs[0][:8]]])
    np.testing.assert_allclose(
        acc3.mean(), _direct_ce(model, with_bos)[0].double().numpy(), rtol=1e-5
    )

    out = tmp_path / "res"
    out.mkdir()
    summary = write_results(acc, out, length=length, bos=False, num_docs=5, horizons=[16, 31])
    assert summary["perplexity"]["31"] == pytest.approx(np.exp(want.mean()), rel=1e-6)
    png = plot_per_token_loss(
        {"a": out, "b": out / "per_token_loss.npz"}, out / "p.png", train_length=16, smooth=3
    )
    assert png.stat().st_size > 1000


def test_accumulator_mask_and_bad_input():
    acc = PerTokenLossAccumulator(3)
    acc.update(
        torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]),
        mask=torch.tensor([[True, True, False], [True, False, True]]),
    )
    np.testing.assert_allclose(acc.mean(), [2.0, 2.0, 5.0])
    with pytest.raises(ValueError, match=r"\[B, 3\]"):
        acc.update(torch.zeros(2, 4))
    with pytest.raises(ValueError, match="NaN"):
        acc.update(torch.tensor([[float("nan"), 0.0, 0.0]]))


def test_moving_average_and_parsers():
    x = np.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(moving_average(x, 2), [1.0, 1.5, 2.5, 3.5])
    assert parse_int_list("1k, 2048,16k,0.5k") == [1024, 2048, 16384, 512]
    with pytest.raises(ValueError, match="'abc'"):
        parse_int_list("1k,abc")


def test_jsonl_log_skips_done_and_torn_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    log = JsonlLog(path)
    log.append({"key": "a", "v": 1})
    log.append({"key": "b", "v": 2})
    with path.open("a") as f:
        f.write('{"key": "c", "v"')  # killed mid-write
    log2 = JsonlLog(path)
    assert log2.done("a") and log2.done("b") and not log2.done("c")
    log2.append({"key": "c", "v": 3})
    assert log2.done("c") and len(log2) == 3  # known at once, not only after a reopen
    assert [json.loads(x)["key"] for x in path.read_text().splitlines()] == ["a", "b", "c"]


def _fake_checkpoint(path, weights: bytes):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_checkpoint_fingerprint_follows_content_not_location(tmp_path):
    import shutil

    a = _fake_checkpoint(tmp_path / "a", b"w" * 1000)
    copy = shutil.copytree(a, tmp_path / "copy")
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(a)
    (copy / "model.safetensors").write_bytes(b"v" * 1000)
    assert checkpoint_fingerprint(copy) != checkpoint_fingerprint(a)
    (tmp_path / "copy" / "README.md").write_text("notes")  # not a model file
    b = _fake_checkpoint(tmp_path / "b", b"v" * 1000)
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(b)
    # Large weight files are sampled: a change at a sampled block (the last one) counts.
    big = bytearray(9 << 20)
    c = _fake_checkpoint(tmp_path / "c", bytes(big))
    before = checkpoint_fingerprint(c)
    big[-1] = 1
    (c / "model.safetensors").write_bytes(bytes(big))
    assert checkpoint_fingerprint(c) != before


def test_claim_results_resumes_refuses_and_restarts(tmp_path):
    a = _fake_checkpoint(tmp_path / "a", b"a" * 100)
    b = _fake_checkpoint(tmp_path / "b", b"b" * 100)
    out = tmp_path / "out"
    out.mkdir()

    def claim(ckpt, restart=False, **settings):
        return claim_results(
            out,
            "toy",
            checkpoint=ckpt,
            settings={"--length": 64, **settings},
            state=["toy.jsonl"],
            outputs=["toy.csv"],
            restart=restart,
        )

    claim(a)  # nothing saved yet: the record is written
    record = json.loads((out / "toy.resume.json").read_text())
    assert record["checkpoint"] == str(a.resolve()) and record["settings"] == {"--length": 64}
    (out / "toy.jsonl").write_text('{"key": 1}\n')
    (out / "toy.csv").write_text("x\n")
    claim(a)  # same checkpoint and settings: resume
    claim(tmp_path / "a" / ".." / "a")  # the same folder, spelled differently
    with pytest.raises(ResumeMismatchError) as err:
        claim(b, **{"--length": 128})
    msg = str(err.value)
    assert f"saved results are of {str(a.resolve())!r}" in msg and str(b.resolve()) in msg
    assert "--length: saved 64, this run 128" in msg
    assert "another --out" in msg and "--restart" in msg
    assert (out / "toy.jsonl").read_text() == '{"key": 1}\n'  # nothing touched
    # Results without a record (an older fot) are refused too: they cannot be verified.
    (out / "toy.resume.json").unlink()
    with pytest.raises(ResumeMismatchError, match="without a record"):
        claim(a)
    # --restart moves the saved results away (never deletes them) and starts over, twice.
    claim(b, restart=True)
    (out / "toy.jsonl").write_text('{"key": 2}\n')
    claim(a, restart=True)
    moved = sorted((out / "superseded").iterdir())
    assert len(moved) == 2
    assert (moved[0] / "toy.jsonl").read_text() == '{"key": 1}\n'
    assert (moved[0] / "toy.csv").read_text() == "x\n"
    assert (moved[1] / "toy.jsonl").read_text() == '{"key": 2}\n'
    assert json.loads((moved[1] / "toy.resume.json").read_text())["checkpoint"] == str(b.resolve())
    assert not (out / "toy.jsonl").exists()
    assert json.loads((out / "toy.resume.json").read_text())["checkpoint"] == str(a.resolve())


def _claim_data(out, ckpt, data, files=None):
    """claim_results of a run reading ``files`` of the folder ``data`` (None: the whole folder,
    as fot recorded data folders before ``data_files``)."""
    return claim_results(
        out,
        "toy",
        checkpoint=ckpt,
        settings={"--data-dir": str(data.resolve())},
        state=["toy.jsonl"],
        data_files=None if files is None else {"--data-dir": files},
    )


def test_claim_results_fingerprints_only_the_data_files_the_run_reads(tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "c", b"w" * 100)
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    (data / "a.jsonl").write_text("a1\n")
    (data / "b.jsonl").write_text("b1\n")
    _claim_data(out, ckpt, data, ["a.jsonl"])
    (out / "toy.jsonl").write_text('{"key": 1}\n')
    (data / "a_e.jsonl").write_text("added later\n")  # a file no run of this --out reads
    (data / "b.jsonl").write_text("b2, rewritten\n")
    _claim_data(out, ckpt, data, ["a.jsonl"])  # resumed
    (data / "a.jsonl").write_text("a2, rewritten\n")  # the file this run reads
    with pytest.raises(ResumeMismatchError, match=r"--data-dir: a\.jsonl in '.*data' changed"):
        _claim_data(out, ckpt, data, ["a.jsonl"])
    (data / "a.jsonl").write_text("a1\n")
    _claim_data(out, ckpt, data, ["a.jsonl"])
    # a run of another file adds its fingerprint and keeps a's (toy.jsonl may hold a's results)
    _claim_data(out, ckpt, data, ["b.jsonl"])
    saved = json.loads((out / "toy.resume.json").read_text())["data_fingerprints"]["--data-dir"]
    assert sorted(saved) == ["a.jsonl", "b.jsonl"]
    (data / "a.jsonl").write_text("a3\n")
    _claim_data(out, ckpt, data, ["b.jsonl"])  # a is not read by this run
    with pytest.raises(ResumeMismatchError, match=r"a\.jsonl in '.*data' changed"):
        _claim_data(out, ckpt, data, ["a.jsonl", "b.jsonl"])


def test_claim_results_resumes_a_whole_folder_record_when_the_files_read_are_unchanged(tmp_path):
    """A record written before data_files holds one fingerprint of the whole folder: it is
    resumed (and noted per file from then on) when the folder is unchanged, or changed only by
    files written after the record; else the difference says that it cannot be told."""
    import os

    ckpt = _fake_checkpoint(tmp_path / "c", b"w" * 100)
    data, out = tmp_path / "data", tmp_path / "out"
    data.mkdir()
    (data / "a.jsonl").write_text("a1\n")
    (data / "b.jsonl").write_text("b1\n")
    _claim_data(out, ckpt, data)  # the record of an older fot: one fingerprint of the folder
    assert isinstance(json.loads((out / "toy.resume.json").read_text())["data_fingerprints"]["--data-dir"], list)  # fmt: skip
    (out / "toy.jsonl").write_text('{"key": 1}\n')
    record_time = (out / "toy.resume.json").stat().st_mtime_ns
    old = (record_time - 10**9, record_time - 10**9)  # ns: a second before the record

    # a file written before the record (e.g. unzipped with its archive time): cannot be told
    (data / "c_e.jsonl").write_text("c\n")
    os.utime(data / "c_e.jsonl", ns=old)
    with pytest.raises(ResumeMismatchError, match=r"one fingerprint of the whole folder") as err:
        _claim_data(out, ckpt, data, ["a.jsonl"])
    assert "(a.jsonl)" in str(err.value) and "move them out of the folder" in str(err.value)
    # moved out for one run, as the message says: resumed, noted per file
    os.replace(data / "c_e.jsonl", tmp_path / "c_e.jsonl")
    _claim_data(out, ckpt, data, ["a.jsonl"])
    saved = json.loads((out / "toy.resume.json").read_text())["data_fingerprints"]["--data-dir"]
    assert sorted(saved) == ["a.jsonl", "b.jsonl"]  # every file of the old folder
    os.replace(tmp_path / "c_e.jsonl", data / "c_e.jsonl")
    _claim_data(out, ckpt, data, ["a.jsonl"])  # back in: files this run does not read

    # an older record again, and a file added after it (a new mtime): resumed at once
    (out / "toy.resume.json").unlink()
    (out / "toy.jsonl").unlink()
    (data / "c_e.jsonl").unlink()
    _claim_data(out, ckpt, data)
    (out / "toy.jsonl").write_text('{"key": 1}\n')
    record_time = (out / "toy.resume.json").stat().st_mtime_ns
    (data / "c_e.jsonl").write_text("c\n")
    os.utime(data / "c_e.jsonl", ns=(record_time + 10**9, record_time + 10**9))
    _claim_data(out, ckpt, data, ["a.jsonl"])
    saved = json.loads((out / "toy.resume.json").read_text())["data_fingerprints"]["--data-dir"]
    assert sorted(saved) == ["a.jsonl", "b.jsonl"]
    # a file this run reads changed after an older record: refused, never resumed
    (out / "toy.resume.json").unlink()
    (data / "c_e.jsonl").unlink()
    (out / "toy.jsonl").unlink()
    _claim_data(out, ckpt, data)
    (out / "toy.jsonl").write_text('{"key": 1}\n')
    (data / "a.jsonl").write_text("a2, rewritten\n")
    with pytest.raises(ResumeMismatchError, match=r"one fingerprint of the whole folder"):
        _claim_data(out, ckpt, data, ["a.jsonl"])


def test_texts_are_escaped_as_the_checkpoint_was_trained_and_generations_unescaped(tmp_path):
    """A LongCrawl64-trained model read JSON-escaped text: a newline was the two tokens of
    ``\\n``, never GPT-2's newline token (198). The eval commands encode their texts (needle
    haystacks, LongBench contexts, lm-eval requests) the same way and decode generations back.
    Oracle: tiktoken's GPT-2 encoding of ``json.dumps(text)`` without its quotes."""
    from transformers import AutoTokenizer

    from fot.eval.common import decode_text, encode_text, write_run_config
    from fot.tokenizer import get_encoding, save_hf_tokenizer

    enc = get_encoding()
    text = 'The key is "7".\nÜber 😀\tdone'
    plain = AutoTokenizer.from_pretrained(save_hf_tokenizer(tmp_path / "plain"))
    escaped = AutoTokenizer.from_pretrained(
        save_hf_tokenizer(tmp_path / "json", text_escaping="json")
    )
    assert encode_text(plain, text) == enc.encode(text)
    ids = encode_text(escaped, text)
    assert ids == enc.encode(json.dumps(text)[1:-1])
    assert 198 in enc.encode(text) and 198 not in ids  # no raw newline token
    assert decode_text(escaped, [*ids, 50256]) == text  # <|endoftext|> left out
    assert decode_text(plain, enc.encode(text)) == text
    # run_config.json says which escaping the results were made with
    (tmp_path / "json" / "config.json").write_text("{}")
    record = json.loads(
        write_run_config(tmp_path / "out", "needle", {}, tmp_path / "json").read_text()
    )
    assert record["text_escaping"] == "json"


@pytest.mark.parametrize("escaping", ["none", "json"])
def test_prompts_encode_the_text_endoftext_as_training_data_does(tmp_path, escaping):
    """The characters ``<|endoftext|>`` in a prompt (a needle haystack, a LongBench context, an
    lm-eval request) are ordinary text, as ``fot.data.prepare`` and ``data=hf`` tokenize them,
    also with the tokenizer of an export made before it said so (no ``split_special_tokens``):
    they were the id 50256, a document boundary in the middle of the prompt. Oracle: tiktoken's
    ``encode_ordinary`` of the text escaped as ``json.dumps`` writes it (or as it is)."""
    from transformers import AutoTokenizer

    from fot.eval.common import decode_text, encode_text
    from fot.tokenizer import get_encoding, save_hf_tokenizer

    folder = save_hf_tokenizer(tmp_path, text_escaping=escaping)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["split_special_tokens"]  # as fot wrote it before
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = AutoTokenizer.from_pretrained(folder)
    text = 'Doc one.<|endoftext|>Doc "two"\n😀 <|endoftext|>'
    escaped = json.dumps(text)[1:-1] if escaping == "json" else text
    ids = encode_text(tok, text)
    assert ids == get_encoding().encode_ordinary(escaped) and 50256 not in ids
    assert decode_text(tok, ids) == text


@pytest.mark.parametrize("escaping", ["none", "json"])
def test_prompts_with_a_lone_surrogate_encode_as_training_data_does(tmp_path, escaping):
    """A LongBench or lm-eval text read from JSON may hold a lone surrogate (``"\\ud800"``):
    the HF tokenizer stopped the run with ``TypeError: TextEncodeInput must be ...``; it is now
    U+FFFD, as ``fot.data.prepare`` reads it. Oracle: tiktoken, which replaces it so."""
    from transformers import AutoTokenizer

    from fot.eval.common import encode_text
    from fot.tokenizer import get_encoding, save_hf_tokenizer

    tok = AutoTokenizer.from_pretrained(save_hf_tokenizer(tmp_path, text_escaping=escaping))
    text = json.loads('"a \\ud800 b \\udfff\\ud83d\\ude00 c"')  # two lone ones, a pair
    escaped = json.dumps(text)[1:-1] if escaping == "json" else text
    assert encode_text(tok, text) == get_encoding().encode_ordinary(escaped)
    if escaping == "none":
        assert tok.decode(encode_text(tok, text)) == "a \ufffd b \ufffd😀 c"


@pytest.mark.parametrize("variant", ["fox_pro", "transformer_llama"])
def test_a_checkpoint_of_the_papers_code_is_converted_on_the_fly(variant, tmp_path, capsys):
    """fot.eval takes the paper's checkpoint folder (no tokenizer fot can read, model types of
    the paper's package) as it takes fot.convert's output: the paper's logits (oracle: its own
    code, tests/paper_checkpoints/), GPT-2 with <|endoftext|> in front, JSON text escaping."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from fot.tokenizer import EOT_ID, get_encoding, text_escaping_of

    tiny = Path(__file__).resolve().parent / "paper_checkpoints" / variant
    _, tokenizer = load_checkpoint(tiny, device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=(
        r"tokenizer \(50257 tokens\) encodes this text with token id 1[0-9]{4} \(' needle'\), "
        r"outside its model's vocabulary of 96 ids: the tokenizer is not the model's"
    )):  # fmt: skip
        encode_text(tokenizer, "a needle")  # GPT-2 ids the tiny model cannot embed
    # the tiny model with GPT-2's vocabulary: zero rows appended, whose logits are 0
    folder = tmp_path / variant
    folder.mkdir()
    config = json.loads((tiny / "config.json").read_text())
    config = {**config, "vocab_size": EOT_ID + 1, "log_pruning_tolerance": -10.0}
    (folder / "config.json").write_text(json.dumps(config))
    state = load_file(tiny / "model.safetensors")
    for name in ("model.embeddings.weight", "lm_head.weight"):
        state[name] = F.pad(state[name], (0, 0, 0, EOT_ID + 1 - state[name].shape[0]))
    save_file(state, folder / "model.safetensors")
    model, tokenizer = load_checkpoint(folder, device="cpu", dtype="float32")
    err = capsys.readouterr().err
    assert "converted on the fly" in err and "log_pruning_tolerance=-10.0" in err
    ref = np.load(tiny / "reference.npz")
    with torch.no_grad():
        got = model(input_ids=torch.from_numpy(ref["input_ids"])).logits.float()[..., :96]
    want = torch.from_numpy(ref["logits"])
    assert (got - want).norm() / want.norm() < 1e-2  # as tests/test_convert.py
    assert text_escaping_of(tokenizer) == "json"
    assert tokenizer("fot, eval").input_ids == [EOT_ID, *get_encoding().encode("fot, eval")]


def test_a_fox_checkpoint_of_fla_is_converted_on_the_fly(tmp_path):
    """A FoX folder of flash-linear-attention loaded as FLA's own class, whose Triton kernels
    stopped a CPU run with a traceback ("0 active drivers"); it is now converted as
    fot.convert converts it. Oracle: FLA's own forward (under the tests' Triton interpreter)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fla.models import ForgettingTransformerConfig, ForgettingTransformerForCausalLM

    from fot.data.sample import sample_documents
    from fot.tokenizer import EOT_ID, save_hf_tokenizer

    torch.manual_seed(0)
    config = ForgettingTransformerConfig(
        vocab_size=EOT_ID + 1, hidden_size=32, num_hidden_layers=1, num_heads=2,
        fuse_cross_entropy=False,
    )  # fmt: skip
    fla = ForgettingTransformerForCausalLM(config).eval()
    fla.save_pretrained(tmp_path / "fla")
    save_hf_tokenizer(tmp_path / "fla")
    docs = [d for d in sample_documents("heldout") if len(d) >= 64][:2]
    ids = torch.tensor([[EOT_ID, *d[:64].tolist()] for d in docs])
    with torch.no_grad():
        logits = fla(input_ids=ids[:, :-1]).logits.float()
    want = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).item()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's shell
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "fot.eval", "per-token-loss", str(tmp_path / "fla"), "--data",
         "sample", "--length", "64", "--max-docs", "2", "--out", str(out), "--device", "cpu"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "FoX checkpoint of flash-linear-attention" in run.stderr
    got = json.loads((out / "summary.json").read_text())
    assert got["num_documents"] == 2
    assert got["mean_loss"] == pytest.approx(want, rel=1e-5)


def test_another_fla_model_on_the_cpu_is_named_with_the_interpreter_that_runs_it(tmp_path):
    """FLA's models (GLA here) load through AutoModelForCausalLM, and on the CPU their Triton
    kernels stopped the first forward pass with a traceback ("0 active drivers"); the command
    now says so before --out is written, and under TRITON_INTERPRET=1 (the tests') it runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from fla.models import GLAConfig, GLAForCausalLM

    from fot.tokenizer import EOT_ID, save_hf_tokenizer

    torch.manual_seed(0)
    config = GLAConfig(vocab_size=EOT_ID + 1, hidden_size=32, num_hidden_layers=1, num_heads=2)
    GLAForCausalLM(config).save_pretrained(tmp_path / "gla")
    save_hf_tokenizer(tmp_path / "gla")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a user's shell
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = tmp_path / "out"
    argv = ["per-token-loss", str(tmp_path / "gla"), "--data", "sample", "--length", "32",
            "--max-docs", "1", "--out", str(out), "--device", "cpu"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "fot.eval", *argv], capture_output=True, text=True, env=env
    )
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr and not out.exists()
    assert "flash-linear-attention (GLAForCausalLM)" in run.stderr
    assert "TRITON_INTERPRET=1" in run.stderr
    from fot.eval.__main__ import main

    assert main(argv)["num_documents"] == 1  # the fix the message names


def test_jsonl_log_opened_on_a_full_file_system_keeps_every_saved_item(tmp_path):
    """Opening a results file whose last line a kill or a full disk cut short rewrote the whole
    file (truncate, then write): a write failing there (the disk still full, a quota, a kill)
    left it cut short or empty, every saved item lost. Now only the torn line is cut off, which
    needs no space. The write error here is a real one: the file size limit (as `ulimit -f`),
    below the file's size. Oracle: the file holds exactly the whole records written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "r.jsonl"
    records = [{"key": str(i), "response": "x" * 200} for i in range(20)]
    whole = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(whole + '{"key": "20", "respon')  # the item being saved when stopped
    code = (
        "import resource, signal, sys\n"
        "from fot.eval.common import JsonlLog\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))\n"
        "print(len(JsonlLog(sys.argv[1])))\n"
    )
    root = Path(__file__).resolve().parents[1]  # this checkout's fot
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert path.read_text() == whole  # every saved item, the torn one cut off
    assert proc.returncode == 0 and proc.stdout.split() == ["20"], proc.stderr[-2000:]
    log = JsonlLog(path)
    assert [r["key"] for r in log] == [str(i) for i in range(20)] and not log.done("20")
    # a last record that lacks only its newline is whole: kept, and the next goes on a new line
    path.write_text(whole.rstrip("\n"))
    log = JsonlLog(path)
    log.append({"key": "20"})
    assert [json.loads(x)["key"] for x in path.read_text().splitlines()] == [
        str(i) for i in range(21)
    ]
