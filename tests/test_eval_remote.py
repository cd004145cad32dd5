"""``per-token-loss`` and ``forgetting-curve`` reading held-out rows from a URL (a local HTTP
server, no network): the same results as the folder itself, each chunk fetched once, resumes
tied to the array at the URL, and one-line errors for a wrong URL or a missing package."""

from __future__ import annotations

import json
import sys
from collections import Counter

import numpy as np
import pytest
from eval_helpers import make_llama_checkpoint
from http_files import Served, serve
from zarr_arrays import new_array

from fot.eval.__main__ import cli, main
from fot.eval.common import ResumeMismatchError

ROWS, ROW_LEN, CHUNKS = 12, 64, (4, 32)  # 3 x 2 chunk files
CHUNK_FILES = {2: {f"{r}.{c}" for r in range(3) for c in range(2)},
               3: {f"c/{r}/{c}" for r in range(3) for c in range(2)}}  # fmt: skip


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_llama_checkpoint(tmp_path_factory.mktemp("ckpt") / "llama")


def _heldout(path, *, fmt=2, seed=0, value=None, row_len=ROW_LEN):
    """A LongCrawl64-like heldout.zarr (uint16 token rows, several rows per chunk): random
    tokens, or ``value`` everywhere."""

    shape = (ROWS, row_len)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 50000, shape) if value is None else np.full(shape, value)
    arr = new_array(str(path), shape=shape, chunks=CHUNKS, dtype="uint16",
                    zarr_format=fmt)  # fmt: skip
    arr[:] = data
    return path


def _ptl(ckpt, data, out, *extra):
    return main(["per-token-loss", str(ckpt), "--data", str(data), "--length", "48",
                 "--batch-size", "2", "--device", "cpu", "--out", str(out), *extra])  # fmt: skip


def _chunk_gets(served, fmt):
    """GET requests of chunk files, counted per file."""
    gets = Counter(path.removeprefix("/heldout.zarr/") for method, path in served.requests
                   if method == "GET" and path.startswith("/heldout.zarr/"))  # fmt: skip
    return Counter({k: n for k, n in gets.items() if k in CHUNK_FILES[fmt]})


@pytest.mark.parametrize("fmt", [2, 3])
def test_per_token_loss_over_a_url_equals_the_folder_and_fetches_each_chunk_once(
    llama, tmp_path, fmt
):
    """Oracle: the same command on the folder the server serves. A pass over the 12 rows
    fetches each of the 6 chunk files once (read row by row from the zarr array, each chunk
    would be fetched once per row it holds: 4 times)."""
    _heldout(tmp_path / "d" / "heldout.zarr", fmt=fmt)
    local = _ptl(llama, tmp_path / "d" / "heldout.zarr", tmp_path / "local")
    with serve(tmp_path / "d") as served:
        remote = _ptl(llama, f"{served.url}/heldout.zarr", tmp_path / "url")
        gets = _chunk_gets(served, fmt)
    assert set(gets) == CHUNK_FILES[fmt] and max(gets.values()) == 1, gets
    assert remote["num_documents"] == local["num_documents"] == ROWS
    a = np.load(tmp_path / "local" / "per_token_loss.npz")
    b = np.load(tmp_path / "url" / "per_token_loss.npz")
    for key in ("loss", "count", "perplexity"):
        np.testing.assert_array_equal(b[key], a[key])
    assert remote["mean_loss"] == local["mean_loss"]
    assert (tmp_path / "url" / "horizons.csv").read_text() == (
        tmp_path / "local" / "horizons.csv"
    ).read_text()


def test_a_resume_from_the_same_url_is_kept_and_another_array_there_refused(
    llama, tmp_path, monkeypatch
):
    """A run stopped by a failing server resumes from its saved sums once the server answers
    again (the oracle: a run on the folder); another array at the same URL is refused, the
    same shape and dtype with other tokens too (their chunks' sizes differ)."""
    heldout = _heldout(tmp_path / "d" / "heldout.zarr")
    local = _ptl(llama, heldout, tmp_path / "local")
    down = {"on": True}

    def third_chunk_row_fails(method, path):
        return (
            503 if down["on"] and method == "GET" and path.startswith("/heldout.zarr/2.") else None
        )

    monkeypatch.setattr("fot.data.loaders.URL_READ_RETRIES", 1)  # one retry (1 s), not six
    out = tmp_path / "url"
    with serve(tmp_path / "d", status=third_chunk_row_fails) as served:
        url = f"{served.url}/heldout.zarr"
        with pytest.raises(ConnectionError, match=r"could not read document 8 of .*heldout\.zarr after 2 attempts .*rerun the same command"):  # fmt: skip
            _ptl(llama, url, out)
        saved = np.load(out / "state.npz")["done"].tolist()
        assert saved == list(range(8))  # the first two chunk rows' documents are kept
        down["on"] = False
        before = len(served.requests)
        resumed = _ptl(llama, url + "/", out)  # the same URL (a trailing / is the same)
        assert resumed["mean_loss"] == pytest.approx(local["mean_loss"], rel=1e-12)
        fetched = {p for m, p in served.requests[before:] if m == "GET"}
        assert "/heldout.zarr/0.0" not in fetched and "/heldout.zarr/2.0" in fetched
        # finished: a rerun reads no chunk and gives the same numbers
        before = len(served.requests)
        assert _ptl(llama, url, out)["mean_loss"] == resumed["mean_loss"]
        assert not _chunk_gets(Served(url, served.requests[before:]), 2)
        state = (out / "state.npz").read_bytes()
        # another array at the URL: the same shape, chunks and dtype, other tokens ...
        _heldout(heldout, value=7)
        with pytest.raises(ResumeMismatchError, match=r"--data: the zarr array at '.*/heldout\.zarr' has changed since"):  # fmt: skip
            _ptl(llama, url, out)
        # ... or another shape
        _heldout(heldout, row_len=96)
        with pytest.raises(ResumeMismatchError, match="has changed since"):
            _ptl(llama, url, out)
        assert (out / "state.npz").read_bytes() == state  # nothing mixed in
        _ptl(llama, url, out, "--restart")  # the way out
        assert (out / "superseded").is_dir()


def test_forgetting_curve_over_a_url_equals_the_folder(llama, tmp_path):
    _heldout(tmp_path / "d" / "heldout.zarr", seed=2)
    args = ["--lengths", "32,48", "--repeats", "2", "--device", "cpu"]
    local = main(["forgetting-curve", str(llama), "--data", str(tmp_path / "d" / "heldout.zarr"),
                  *args, "--out", str(tmp_path / "local")])  # fmt: skip
    with serve(tmp_path / "d") as served:
        url = f"{served.url}/heldout.zarr"
        remote = main(["forgetting-curve", str(llama), "--data", url, *args,
                       "--out", str(tmp_path / "url")])  # fmt: skip
        assert max(_chunk_gets(served, 2).values()) == 1
        again = main(["forgetting-curve", str(llama), "--data", url, *args,
                      "--out", str(tmp_path / "url")])  # fmt: skip
    assert remote == local == again
    record = json.loads((tmp_path / "url" / "forgetting_curve.resume.json").read_text())
    assert record["settings"]["--data"] == url and record["data_fingerprints"]["--data"]


@pytest.mark.parametrize("command", ["per-token-loss", "forgetting-curve"])
def test_a_wrong_url_and_a_missing_filesystem_package_are_one_line_errors(
    tmp_path, monkeypatch, capsys, command
):
    """Said before the checkpoint is loaded (it does not exist here), as one ``error:`` line
    with the URL and the fix, not a traceback."""
    _heldout(tmp_path / "d" / "heldout.zarr")
    argv = [command, str(tmp_path / "missing-checkpoint"), "--out", str(tmp_path / "o")]
    with serve(tmp_path / "d") as served:
        assert cli([*argv, "--data", f"{served.url}/held-out.zarr"]) == 2
        err = capsys.readouterr().err
        assert f"error: --data '{served.url}/held-out.zarr' holds no zarr array" in err
        assert "URL>/heldout.zarr" in err and "--storage-options" in err
        assert cli([*argv, "--data", served.url]) == 2  # the folder that holds it
        assert f"pass --data {served.url}/heldout.zarr" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # not installed
    assert cli([*argv, "--data", "gs://longcrawl64/heldout.zarr"]) == 2
    err = capsys.readouterr().err
    assert "error: --data 'gs://longcrawl64/heldout.zarr': reading" in err
    assert "needs gcsfs: `pip install gcsfs`" in err
    assert "Traceback" not in err and len([x for x in err.splitlines() if "error:" in x]) == 1
    assert not (tmp_path / "o").exists()


def test_storage_options_reach_the_server_and_stay_out_of_run_config(llama, tmp_path, monkeypatch):
    _heldout(tmp_path / "d" / "heldout.zarr")
    local = _ptl(llama, tmp_path / "d" / "heldout.zarr", tmp_path / "local")
    options = '{"headers": {"X-Token": "s3cret"}}'
    with serve(tmp_path / "d", header=("X-Token", "s3cret")) as served:
        url = f"{served.url}/heldout.zarr"
        with pytest.raises(FileNotFoundError, match="--storage-options"):
            _ptl(llama, url, tmp_path / "url")
        argv = ["per-token-loss", str(llama), "--data", url, "--storage-options", options]
        monkeypatch.setattr(sys, "argv", ["fot-eval", *argv, f"--storage-options={options}"])
        remote = _ptl(llama, url, tmp_path / "url", "--storage-options", options)
    assert remote["mean_loss"] == local["mean_loss"]
    run_config = (tmp_path / "url" / "run_config.json").read_text()
    assert "s3cret" not in run_config
    recorded = json.loads(run_config)
    assert recorded["arguments"]["storage_options"] == {"headers": "(hidden)"}
    assert recorded["argv"][-2:] == ["(hidden)", "--storage-options=(hidden)"]
    assert "s3cret" not in (tmp_path / "url" / "per_token_loss.resume.json").read_text()
    with pytest.raises(ValueError, match="not a URL; leave --storage-options out"):
        _ptl(llama, tmp_path / "d" / "heldout.zarr", tmp_path / "o", "--storage-options", options)
    with pytest.raises(SystemExit):  # argparse: not a JSON object
        _ptl(llama, "sample", tmp_path / "o", "--storage-options", "token=anon")


def test_the_url_fingerprint_samples_stored_chunk_files_of_a_sharded_array(tmp_path):
    """zarr v3 shards: the files sampled are the shards (first, middle, last), not inner
    chunks (which are no files); rewriting the last shard changes the fingerprint."""
    import zarr

    from fot.eval.common import zarr_url_fingerprint

    arr = new_array(str(tmp_path / "s.zarr"), shape=(24, 64), chunks=(2, 16),
                    shards=(8, 32), dtype="uint16", zarr_format=3)  # fmt: skip
    arr[:] = np.random.default_rng(0).integers(0, 50000, (24, 64))
    with serve(tmp_path) as served:
        url = f"{served.url}/s.zarr"
        before = zarr_url_fingerprint(url, zarr.open(url, mode="r"))
        heads = {p for m, p in served.requests if m == "HEAD"}
        assert heads == {"/s.zarr/c/0/0", "/s.zarr/c/1/1", "/s.zarr/c/2/1"}
        arr[16:, 32:] = 7  # the last shard only
        assert zarr_url_fingerprint(url, zarr.open(url, mode="r")) != before
        arr[16:, 32:] = np.random.default_rng(0).integers(0, 50000, (24, 64))[16:, 32:]
        assert zarr_url_fingerprint(url, zarr.open(url, mode="r")) == before


def test_a_document_in_a_chunk_missing_behind_the_url_is_an_error(tmp_path) -> None:
    """Held-out rows in a chunk that the URL does not hold read as token 0 in zarr: the
    documents refuse them instead of scoring zeros."""

    from fot.eval.per_token_loss import open_documents

    data = np.random.default_rng(0).integers(1, 50000, (8, 64)).astype(np.uint16)
    arr = new_array(str(tmp_path / "h.zarr"), shape=data.shape, chunks=(4, 64),
                    dtype="uint16", zarr_format=2)  # fmt: skip
    arr[:] = data
    (tmp_path / "h.zarr" / "1.0").unlink()  # rows 4..7
    with serve(tmp_path) as server:
        docs, kind = open_documents(f"{server.url}/h.zarr")
        assert kind == "zarr"
        np.testing.assert_array_equal(docs[1], data[1])
        with pytest.raises(FileNotFoundError, match=r"chunk \(1, 0\) of .* is not there"):
            docs[5]
