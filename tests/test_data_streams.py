"""Sequence sources and streams: order, BOS convention, rank sharding, exact resume."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from killed_runs import host_name, run_killed

from fot.data.loaders import build_sources, open_token_path
from fot.data.streams import (
    EOT_ID,
    HFSource,
    PackedSource,
    PaddedSource,
    SequenceStream,
    ZarrRowsSource,
    iterate_eval_batches,
    make_batch,
)
from fot.data.tokens import TokenDocuments, write_token_documents


def _zarr_rows(path, rows: int, row_len: int) -> np.ndarray:
    import zarr

    data = (np.arange(rows * row_len, dtype=np.int64) % 50000).reshape(rows, row_len)
    data = data.astype(np.uint16)
    arr = zarr.open(str(path), mode="w", shape=data.shape, dtype="uint16", chunks=(2, row_len))
    arr[:] = data
    return data


def _docs(rng: np.random.Generator, n: int, lo: int = 1, hi: int = 40) -> list[np.ndarray]:
    return [
        rng.integers(0, 50000, size=int(rng.integers(lo, hi))).astype(np.uint16) for _ in range(n)
    ]


# ------------------------------------------------------------------ LongCrawl64 (zarr rows)


def test_zarr_rows_order_bos_and_epoch(tmp_path) -> None:
    data = _zarr_rows(tmp_path / "train.zarr", rows=5, row_len=32)
    import zarr

    src = ZarrRowsSource(zarr.open(str(tmp_path / "train.zarr"), mode="r"), seq_len=8)
    assert src.num_sequences == 5 * 4
    inputs, labels = src.read(0, 2 * src.num_sequences)  # two epochs
    for g in range(2 * src.num_sequences):
        col, row = divmod(g % src.num_sequences, 5)  # column-major: chunk col of every row first
        chunk = data[row, col * 8 : col * 8 + 8].astype(np.int64)
        np.testing.assert_array_equal(labels[g], chunk)
        assert inputs[g, 0] == EOT_ID  # every chunk starts with BOS
        np.testing.assert_array_equal(inputs[g, 1:], chunk[:-1])


def test_zarr_rows_rank_slicing_and_resume(tmp_path) -> None:
    import zarr

    _zarr_rows(tmp_path / "train.zarr", rows=6, row_len=16)
    arr = zarr.open(str(tmp_path / "train.zarr"), mode="r")
    src = ZarrRowsSource(arr, seq_len=4)
    _, ref_lab = src.read(0, 12 * 5)  # oracle: the global sequence order

    world, S, m = 3, 6, 1
    streams = [
        SequenceStream(src, global_batch_size=S, micro_batch_size=m, rank=r, world_size=world)
        for r in range(world)
    ]
    for step in range(5):
        got = [torch.cat([b.labels for b in s.next_step()]) for s in streams]
        # rank r holds the contiguous block r of the step's global batch
        for r in range(world):
            lo = step * S + r * (S // world)
            np.testing.assert_array_equal(got[r].numpy(), ref_lab[lo : lo + S // world])
        if step == 2:
            saved = streams[1].state_dict()
    resumed = SequenceStream(src, global_batch_size=S, micro_batch_size=m, rank=1, world_size=3)
    resumed.load_state_dict(json.loads(json.dumps(saved)))  # survives JSON (checkpoints)
    after = torch.cat([b.labels for b in resumed.next_step()]).numpy()
    np.testing.assert_array_equal(after, ref_lab[3 * S + 2 : 3 * S + 4])


def test_zarr_seq_len_longer_than_row_is_explained(tmp_path) -> None:
    import zarr

    _zarr_rows(tmp_path / "a.zarr", rows=2, row_len=16)
    with pytest.raises(ValueError, match="longer than a row"):
        ZarrRowsSource(zarr.open(str(tmp_path / "a.zarr"), mode="r"), seq_len=32)


def test_longcrawl64_loader_and_missing_data_message(tmp_path) -> None:
    from omegaconf import OmegaConf

    from fot.training.config import DataConfig

    cfg = OmegaConf.structured(DataConfig(kind="longcrawl64", seq_len=8, val_tokens=16))
    with pytest.raises(ValueError, match=r"manifestai\.com"):
        build_sources(cfg)
    cfg.path = str(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"train\.zarr"):
        build_sources(cfg)
    train = _zarr_rows(tmp_path / "train.zarr", rows=3, row_len=16)
    held = _zarr_rows(tmp_path / "heldout.zarr", rows=2, row_len=16)[::-1]
    import zarr

    zarr.open(str(tmp_path / "heldout.zarr"), mode="r+")[:] = held
    tr, va = build_sources(cfg)
    np.testing.assert_array_equal(tr.read(1, 1)[1][0], train[1, :8])
    np.testing.assert_array_equal(va.read(0, 1)[1][0], held[0, :8])


# ------------------------------------------------------------------ packed / padded documents


def test_packed_documents_bos_order_and_wrap() -> None:
    rng = np.random.default_rng(0)
    docs = _docs(rng, 7)
    stream = np.concatenate([np.concatenate([[EOT_ID], d]) for d in docs]).astype(np.int64)
    T = 5
    src = PackedSource.from_documents(docs, T)
    n = 3 * len(stream) // T  # three passes: sequences that wrap continue at the start
    inputs, labels = src.read(0, n)
    cyc = np.concatenate([stream] * 5)
    for g in range(n):
        s = (g * T) % len(stream)
        np.testing.assert_array_equal(inputs[g], cyc[s : s + T])
        np.testing.assert_array_equal(labels[g], cyc[s + 1 : s + T + 1])


def _packed_stream(docs: list[np.ndarray]) -> np.ndarray:
    """One epoch of the packed stream, built whole: ``[EOT] + doc`` for every non-empty
    document, joined."""
    return np.concatenate([np.concatenate([[EOT_ID], d]) for d in docs if len(d)]).astype(np.int64)


def _random_folders(rng: np.random.Generator) -> Iterator[tuple[list[np.ndarray], int]]:
    """Documents and a T whose stream holds at least T + 1 tokens: by hand (one document;
    empty documents first, last and in a row; one-token documents; documents of T - 1, T and
    T + 1 tokens; one of several sequences), then random ones, a third of their documents
    empty, some longer than T."""

    def doc(n: int) -> np.ndarray:
        return rng.integers(0, 50000, n).astype(np.uint16)

    yield [doc(20)], 4
    yield [doc(n) for n in (0, 0, 7, 0, 0, 0, 5, 0, 0)], 3
    yield [doc(1) for _ in range(9)], 2
    yield [doc(n) for n in (4, 5, 6, 0, 5, 4, 6)], 5
    yield [doc(40), doc(0), doc(1)], 7
    while True:
        T = int(rng.integers(2, 9))
        lengths = [
            0 if rng.random() < 1 / 3 else int(rng.integers(1, 4 if rng.random() < 0.5 else 3 * T))
            for _ in range(int(rng.integers(1, 12)))
        ]
        if sum(n + 1 for n in lengths if n) >= T + 1:
            yield [doc(n) for n in lengths], T


def test_packed_read_equals_the_stream_built_whole(tmp_path, monkeypatch) -> None:
    """Packed reads of documents (in memory, and from a token folder's tokens.bin) and of the
    same stream as a flat array equal sequences cut from the whole stream (the oracle), on 85
    folders: empty documents anywhere, one document, documents longer than a sequence; reads
    from every sequence of two epochs on, far into later epochs, and batches that wrap around
    the stream up to three times; and every window ``[s, s + n)`` of the stream a read asks
    its documents for. A read now finds its documents with one ``searchsorted`` and fills the
    window with a few NumPy operations from the folder's tokens.bin (it took a Python step per
    document, indexing each)."""

    def no_document_indexed(docs: TokenDocuments, i: int) -> np.ndarray:
        raise AssertionError(f"the read indexed document {i}")

    monkeypatch.setattr(TokenDocuments, "__getitem__", no_document_indexed)
    rng = np.random.default_rng(5)
    for case, (docs, T) in enumerate(itertools.islice(_random_folders(rng), 85)):
        stream = _packed_stream(docs)
        L = len(stream)
        folder = write_token_documents(tmp_path / str(case), docs)
        sources = [PackedSource.from_documents(d, T) for d in (docs, folder)]
        for src in sources:
            assert (src.length, src.empty_documents) == (L, sum(len(d) == 0 for d in docs))
        sources.append(PackedSource.from_flat(stream, T))
        epoch = -(-L // T)  # sequences until one starts in the next epoch
        for start in [*range(2 * epoch + 1), int(rng.integers(0, 10**6)), 10**12 + 1]:
            count = int(rng.integers(1, 3 * epoch + 2))
            # sequence g: the T + 1 tokens from g * T of the stream repeated
            g = np.arange(start, start + count)[:, None]
            want = stream[(g * T + np.arange(T + 1)) % L]
            for src in sources:
                inputs, labels = src.read(start, count)
                assert inputs.dtype == labels.dtype == np.int64
                np.testing.assert_array_equal(inputs, want[:, :-1], err_msg=f"case {case}")
                np.testing.assert_array_equal(labels, want[:, 1:], err_msg=f"case {case}")
        for src in sources[:2]:
            for s in range(L):
                for n in {1, 2, L - s, int(rng.integers(1, L - s + 1))}:
                    if s + n <= L:
                        got = src._read_tokens(s, n)
                        np.testing.assert_array_equal(
                            got, stream[s : s + n], err_msg=f"case {case}"
                        )


def test_token_folder_equals_in_memory_docs(tmp_path) -> None:
    docs = _docs(np.random.default_rng(1), 9)
    write_token_documents(tmp_path / "tok", docs)
    a = open_token_path(tmp_path / "tok", 6, "varlen").read(0, 20)
    b = PackedSource.from_documents(docs, 6).read(0, 20)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_flat_npy_and_bin_files(tmp_path) -> None:
    flat = np.random.default_rng(2).integers(0, 50257, size=500).astype(np.uint16)
    np.save(tmp_path / "t.npy", flat)
    flat.tofile(tmp_path / "t.bin")
    for name in ("t.npy", "t.bin"):
        inputs, labels = open_token_path(tmp_path / name, 16, "causal").read(3, 2)
        np.testing.assert_array_equal(inputs[0], flat[48:64])
        np.testing.assert_array_equal(labels[1], flat[65:81])
    with pytest.raises(ValueError, match="document boundaries"):
        open_token_path(tmp_path / "t.npy", 16, "padded")
    with pytest.raises(FileNotFoundError, match=r"fot\.data\.prepare"):
        open_token_path(tmp_path / "missing", 16, "varlen")


def test_bin_files_of_llmc_shards_are_read_and_other_widths_refused(tmp_path) -> None:
    """An llm.c / modded-nanogpt shard (1024-byte int32 header: 20240520, version, count) had
    its header read as tokens; 32- and 64-bit ids were read as uint16, every other token a 0."""
    from fot.tokenizer import get_encoding

    ids = np.random.default_rng(3).integers(1, 50257, size=700)
    for version, dtype in ((1, np.uint16), (2, np.uint32)):
        header = np.zeros(256, dtype="<i4")
        header[:3] = 20240520, version, ids.size
        (tmp_path / f"v{version}.bin").write_bytes(header.tobytes() + ids.astype(dtype).tobytes())
        inputs, labels = open_token_path(tmp_path / f"v{version}.bin", 16, "causal").read(0, 3)
        np.testing.assert_array_equal(inputs[0], ids[:16])
        np.testing.assert_array_equal(labels[2], ids[33:49])
    cut = tmp_path / "cut.bin"
    cut.write_bytes((tmp_path / "v1.bin").read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"cut\.bin starts with an llm\.c token shard's header"):
        open_token_path(cut, 16, "causal")
    for dtype in (np.int32, np.int64):
        ids.astype(dtype).tofile(tmp_path / "wide.bin")
        with pytest.raises(ValueError, match=r"every second uint16 of its first \d+ is 0"):
            open_token_path(tmp_path / "wide.bin", 16, "causal", key="data.path")
        # behind a few nonzero header bytes (one stray word defeated the check)
        wide = tmp_path / "wide_header.bin"
        wide.write_bytes(b"HEADER!!" + ids.astype(dtype).tobytes())
        with pytest.raises(ValueError, match=r"every second uint16 of its first \d+ is 0"):
            open_token_path(wide, 16, "causal", key="data.path")
    # ids of a vocabulary over 65,536 (Llama 3's 128,256), 32 or 64 bits: the high halves are
    # 0 or 1, not all 0, and were read as tokens
    big = np.random.default_rng(4).integers(1, 128256, size=700)
    for dtype in (np.int32, np.int64, np.uint32):
        big.astype(dtype).tofile(tmp_path / "wide.bin")
        with pytest.raises(ValueError, match=r"every second uint16 of its first \d+ is 0 to 3"):
            open_token_path(tmp_path / "wide.bin", 16, "causal", key="data.path")
    # uint16 symbols each followed by a space of id 1: every second id small, read as they are
    spaced = np.stack([np.random.default_rng(6).integers(4, 14, size=350), np.ones(350)], 1)
    spaced.astype(np.uint16).tofile(tmp_path / "spaced.bin")
    inputs, _ = open_token_path(tmp_path / "spaced.bin", 16, "causal").read(0, 1)
    np.testing.assert_array_equal(inputs[0], spaced.reshape(-1)[:16])
    # uint16 ids of a vocabulary of four (DNA bases): small everywhere, read as they are
    bases = np.random.default_rng(5).integers(0, 4, size=700).astype(np.uint16)
    bases.tofile(tmp_path / "bases.bin")
    inputs, _ = open_token_path(tmp_path / "bases.bin", 16, "causal").read(0, 1)
    np.testing.assert_array_equal(inputs[0], bases[:16])
    # a .npy saved under a .bin name: its 128-byte header was read as 64 tokens
    for dtype in (np.uint16, np.int64):
        with open(tmp_path / "saved.bin", "wb") as f:
            np.save(f, ids.astype(dtype))
        with pytest.raises(ValueError, match=r"saved\.bin is a \.npy file .*Rename it to \.npy"):
            open_token_path(tmp_path / "saved.bin", 16, "causal", key="data.path")
    # text, or 1-byte ids, read as uint16 pairs of printable bytes
    (tmp_path / "text.bin").write_bytes(b"Plain English text, not token ids.\n" * 40)
    np.frombuffer(b"some text as bytes!" * 40, np.uint8).tofile(tmp_path / "bytes.bin")
    for name in ("text.bin", "bytes.bin"):
        with pytest.raises(ValueError, match=r"nearly all printable ASCII.*fot\.data\.prepare"):
            open_token_path(tmp_path / name, 16, "causal", key="data.path")
    # real GPT-2 ids of English text pass both checks
    text = "The forget gate decays the attention logits of old tokens. " * 30
    real = np.array(get_encoding().encode_ordinary(text), np.uint16)
    real.tofile(tmp_path / "real.bin")
    inputs, _ = open_token_path(tmp_path / "real.bin", 16, "causal").read(0, 1)
    np.testing.assert_array_equal(inputs[0], real[:16])


def test_varlen_batch_cu_seqlens_mark_documents_and_rows() -> None:
    inputs = np.array([[EOT_ID, 1, 2, EOT_ID, 3], [4, 5, EOT_ID, 6, 7]])
    b = make_batch(inputs, inputs + 1, varlen=True)
    assert b.input_ids.shape == (1, 10)
    assert b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 3, 5, 7, 10]
    assert make_batch(inputs, inputs, varlen=False).cu_seqlens is None
    # against a per-token walk: a segment starts at every row start and every EOT
    rng = np.random.default_rng(0)
    for B, T in [(1, 1), (3, 1), (2, 7), (4, 33)]:
        rows = np.where(rng.random((B, T)) < 0.3, EOT_ID, rng.integers(0, 100, (B, T)))
        rows = rows.astype(np.uint16)
        walk = [i for i, t in enumerate(rows.reshape(-1)) if i % T == 0 or t == EOT_ID]
        got = make_batch(rows, rows, varlen=True).cu_seqlens.tolist()
        assert got == [*walk, B * T], (B, T)


def test_padded_documents() -> None:
    docs = [np.array([5, 6, 7], np.uint16), np.arange(10, 30, dtype=np.uint16)]
    src = PaddedSource(docs, seq_len=6)
    inputs, labels = src.read(0, 3)
    np.testing.assert_array_equal(inputs[0], [EOT_ID, 5, 6, 7, EOT_ID, EOT_ID])
    np.testing.assert_array_equal(labels[0], [5, 6, 7, EOT_ID, -100, -100])  # the end is learned
    np.testing.assert_array_equal(inputs[1], [EOT_ID, 10, 11, 12, 13, 14])  # truncated
    np.testing.assert_array_equal(labels[1], [10, 11, 12, 13, 14, 15])
    np.testing.assert_array_equal(labels[2], labels[0])  # wraps to the first document


def _padded_oracle(docs: list[np.ndarray], T: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences ``0 .. n-1`` of padded packing, built from the packed stream: row ``g`` is
    the window of the stream (every non-empty document with its BOS, concatenated, and a BOS
    after the last) that starts at the BOS of non-empty document ``g mod N``, up to the next
    BOS, cut to T + 1 tokens, padded with EOT and labels -100."""
    kept = [d for d in docs if len(d)]
    stream = np.concatenate([*[np.concatenate([[EOT_ID], d]) for d in kept], [EOT_ID]])
    starts = np.cumsum([0] + [len(d) + 1 for d in kept])
    inputs = np.full((n, T), EOT_ID, dtype=np.int64)
    labels = np.full((n, T), -100, dtype=np.int64)
    for g in range(n):
        i = g % len(kept)
        window = stream[starts[i] : min(starts[i + 1] + 1, starts[i] + T + 1)]
        inputs[g, : len(window) - 1] = window[:-1]
        labels[g, : len(window) - 1] = window[1:]
    return inputs, labels


def test_padded_rows_learn_each_documents_end_and_skip_empty_documents(tmp_path, caplog) -> None:
    """Padded packing never had EOT as a label, so a model trained on it never learned to end
    a document (generation never stops); an empty document took a whole row of -100 labels.
    Now a document shorter than T ends with an EOT label, as in the packed stream, and
    empty documents are skipped with one warning."""
    T = 8
    docs = _hf_docs([3, 0, 7, 8, 9, 0, 0, 1, 40, 6, 0])  # BOS + tokens of T-1, T, T+1 around T
    write_token_documents(tmp_path / "tok", docs)
    with caplog.at_level(logging.WARNING, logger="fot.data"):
        src = open_token_path(tmp_path / "tok", T, "padded")
    warned = [r.getMessage() for r in caplog.records if "empty document" in r.getMessage()]
    assert len(warned) == 1 and "skips its 4 empty document(s) (of 11)" in warned[0], warned
    assert src.num_sequences == 7
    n = 2 * 7 + 3  # into a third epoch
    inputs, labels = src.read(0, n)
    want = _padded_oracle(docs, T, n)
    np.testing.assert_array_equal(inputs, want[0])
    np.testing.assert_array_equal(labels, want[1])
    # an EOT label for each row of a document shorter than T (of 3, 7, 1, 6 tokens: four a
    # pass, and the 3 and 7 again in the third pass), none for those of 8, 9, 40 tokens
    assert int((labels == EOT_ID).sum()) == 4 + 4 + 2
    assert (labels != -100).sum(axis=1).min() >= 2  # no row without a token to learn
    # resuming is exact: the stream's position is all the state there is
    stream = SequenceStream(src, global_batch_size=4, micro_batch_size=2)
    for _ in range(3):
        stream.next_step()
    resumed = SequenceStream(open_token_path(tmp_path / "tok", T, "padded"),
                             global_batch_size=4, micro_batch_size=2)  # fmt: skip
    resumed.load_state_dict(json.loads(json.dumps(stream.state_dict())))
    got = np.concatenate([b.labels.numpy() for b in resumed.next_step()])
    np.testing.assert_array_equal(got, want[1][12:16])
    write_token_documents(tmp_path / "empty", [[], []])
    with pytest.raises(ValueError, match=r"data.path=.*empty: no documents to train on: all 2"):
        open_token_path(tmp_path / "empty", T, "padded")


@pytest.mark.parametrize("packing", ["varlen", "causal"])
def test_packed_token_folder_skips_empty_documents(tmp_path, caplog, packing: str) -> None:
    """An empty document of a token folder was a lone BOS in the packed stream, its label the
    next document's BOS (and a varlen segment of one token). Now it is skipped, with one
    warning that counts them, as padded packing skips them; a folder of only empty documents
    is refused as such (it was refused as a stream of too few tokens)."""
    EOT = EOT_ID
    docs = [[], [1, 2, 3], [], [], [4, 5], [6, 7, 8, 9, 10], []]
    write_token_documents(tmp_path / "tok", docs)
    with caplog.at_level(logging.WARNING, logger="fot.data"):
        src = open_token_path(tmp_path / "tok", 4, packing)
    warned = [r.getMessage() for r in caplog.records if "empty document" in r.getMessage()]
    assert len(warned) == 1, warned
    assert f"data.packing={packing} skips its 4 empty document(s) (of 7)" in warned[0]
    epoch = [EOT, 1, 2, 3, EOT, 4, 5, EOT, 6, 7, 8, 9, 10]  # written out by hand
    assert src.length == len(epoch)
    stream = epoch * 3
    inputs, labels = src.read(0, 8)  # into the third epoch
    np.testing.assert_array_equal(inputs, [stream[4 * g : 4 * g + 4] for g in range(8)])
    np.testing.assert_array_equal(labels, [stream[4 * g + 1 : 4 * g + 5] for g in range(8)])
    batch = make_batch(inputs[:2], labels[:2], varlen=True)  # [EOT 1 2 3 | EOT 4 5 EOT]
    assert batch.cu_seqlens.tolist() == [0, 4, 7, 8]
    write_token_documents(tmp_path / "empty", [[], []])
    with pytest.raises(ValueError, match=r"data.path=.*empty: no documents to train on: all 2"):
        open_token_path(tmp_path / "empty", 4, packing)


# ------------------------------------------------------------------ HF datasets


def _jsonl(path, texts: list[str]) -> str:
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_source_packs_like_documents_and_resumes(tmp_path, streaming: bool) -> None:
    import datasets

    texts = [f"document number {i} " + "word " * (i % 7) for i in range(30)]
    files = _jsonl(tmp_path / "d.jsonl", texts)

    def make():
        return datasets.load_dataset("json", data_files=files, split="train", streaming=streaming)

    def encode(s: str) -> list[int]:  # a toy tokenizer: one id per character
        return [ord(c) for c in s]

    T = 16
    oracle = PackedSource.from_documents([np.array(encode(t), np.uint16) for t in texts], T)
    n = oracle.num_sequences + 5  # runs into a second epoch
    want = oracle.read(0, n)
    src = HFSource(make, encode, T)
    first = src.read(0, 7)
    state = json.loads(json.dumps(src.state_dict()))
    resumed = HFSource(make, encode, T)
    resumed.load_state_dict(state)
    rest = resumed.read(7, n - 7)
    np.testing.assert_array_equal(np.concatenate([first[0], rest[0]]), want[0])
    np.testing.assert_array_equal(np.concatenate([first[1], rest[1]]), want[1])
    with pytest.raises(RuntimeError, match="sequential"):
        resumed.read(0, 1)


# HF rows of token ids for the packed reader: a document far longer than T, documents shorter
# than T, ones whose BOS + tokens are T, T + 1 or T + 2 (T = 8), and empty rows (skipped)
_HF_LENGTHS = [700, 2, 0, 7, 8, 9, 1, 0, 40, 3, 150, 0]


def _hf_docs(lengths: list[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 50000, size=n, dtype=np.int64) for n in lengths]


def _hf_source(docs: list[np.ndarray], T: int, *, streaming: bool) -> HFSource:
    """An HFSource over rows of token ids, map-style (indexed) or streaming (``skip``)."""
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]})
    return HFSource(ds.to_iterable_dataset if streaming else lambda: ds, None, T, packing="causal")


def _packed_oracle(docs: list[np.ndarray], T: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Sequences ``0 .. n-1`` of the packed stream, built independently: every non-empty
    document with its BOS, concatenated, repeated for further epochs, cut into windows of
    T + 1 tokens that overlap by one (inputs the first T, labels the last T)."""
    epoch = np.concatenate([np.concatenate([[EOT_ID], d]) for d in docs if len(d)])
    stream = np.tile(epoch, (n * T + 1) // len(epoch) + 1)
    windows = np.stack([stream[g * T : g * T + T + 1] for g in range(n)])
    return windows[:, :-1], windows[:, 1:]


def test_hf_input_ids_that_start_with_the_bos_get_one_bos(tmp_path) -> None:
    """Rows of input_ids tokenized with fot's exported tokenizer (tok(text) puts
    <|endoftext|> first) got a second BOS from the reader: a one-token document before each
    (helper-176). Oracle: the stream of the same ids without their BOS."""
    from transformers import AutoTokenizer

    from fot.tokenizer import save_hf_tokenizer

    tok = AutoTokenizer.from_pretrained(save_hf_tokenizer(tmp_path / "tok"))
    texts = ["A first document of a few words.", "Another one.", "And a third, the last one."]
    with_bos = [np.asarray(tok(t).input_ids) for t in texts]
    assert all(ids[0] == EOT_ID for ids in with_bos)
    T, n = 8, 6
    got = _hf_source(with_bos, T, streaming=False).read(0, n)
    want = _packed_oracle([ids[1:] for ids in with_bos], T, n)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _old_format_state(docs: list[np.ndarray], T: int, position: int) -> dict:
    """The state the packed reader wrote before it kept an offset (``git show 7adef54``):
    after ``position`` sequences, the tokens carried over (``buffer``: the stream from token
    ``position * T`` to the end of the document holding it, BOS included), the rows consumed
    up to that document over all epochs, and ``docs_per_epoch`` once the first epoch ended."""
    if position == 0:
        return {"position": 0, "docs_consumed": 0, "docs_per_epoch": None, "buffer": []}
    rows = [np.concatenate([[EOT_ID], d]) if len(d) else d for d in docs]
    epoch, t = divmod(position * T, sum(map(len, rows)))
    for i, row in enumerate(rows):
        if t < len(row):
            return {
                "position": position,
                "docs_consumed": epoch * len(rows) + i + 1,
                "docs_per_epoch": len(rows) if epoch else None,
                "buffer": row[t:].tolist(),
            }
        t -= len(row)
    raise AssertionError("unreachable")


@pytest.mark.parametrize("T", [3, 8, 64])
@pytest.mark.parametrize("streaming", [False, True])
def test_hf_packed_reader_equals_a_numpy_oracle_across_epochs(T: int, streaming: bool) -> None:
    docs = _hf_docs(_HF_LENGTHS)
    tokens = sum(len(d) + 1 for d in docs if len(d))  # one epoch
    n = 2 * tokens // T + 5  # into the third epoch
    src = _hf_source(docs, T, streaming=streaming)
    counts = [1, 7, 2, 30, 1]
    parts, start = [], 0
    while start < n:  # reads of several sizes, each going on where the last one stopped
        count = min(counts[len(parts) % len(counts)], n - start)
        parts.append(src.read(start, count))
        start += count
    want = _packed_oracle(docs, T, n)
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), want[0])
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), want[1])


def test_hf_packed_sequence_costs_o_T_in_a_long_document() -> None:
    """Inside a long document a sequence copies its T + 1 tokens and nothing more: the reader
    used to concatenate the rest of the document with the next one and copy it back for every
    sequence (457k tokens/s at T=2048 on one 2M-token document)."""
    import tracemalloc

    T, N = 64, 400_000
    doc = np.arange(N, dtype=np.int64) % 50000
    src = HFSource(lambda: [{"input_ids": doc}], None, T, packing="causal")
    src.read(0, 1)  # reads the document (one copy of it)
    tracemalloc.start()
    try:
        for g in range(1, 200, 4):
            inputs, labels = src.read(g, 4)
            np.testing.assert_array_equal(inputs, doc[g * T - 1 : (g + 4) * T - 1].reshape(4, T))
            np.testing.assert_array_equal(labels, doc[g * T : (g + 4) * T].reshape(4, T))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, f"{peak} bytes allocated at once for 4 sequences of {T} tokens"


def test_hf_packed_state_stays_small_in_a_long_document() -> None:
    """The state is a few numbers, not the tokens carried over (10.8 MB of JSON in
    trainer.json for a 2M-token document); it resumes exactly."""
    T, N = 64, 200_000
    doc = np.arange(N, dtype=np.int64) % 50000
    rows = [{"input_ids": doc}, {"input_ids": doc[:100]}]
    src = HFSource(lambda: rows, None, T, packing="causal")
    src.read(0, 10)
    state = json.dumps(src.state_dict())
    assert len(state) < 200, f"{len(state)} bytes of JSON"  # the old state: ~1.2 MB
    resumed = HFSource(lambda: rows, None, T, packing="causal")
    resumed.load_state_dict(json.loads(state))
    np.testing.assert_array_equal(resumed.read(10, 3)[1], doc[640 : 640 + 3 * T].reshape(3, T))


@pytest.mark.parametrize("source", ["hf", "hf streaming", "token folder"])
def test_packed_resume_at_every_step_equals_the_uninterrupted_run(source: str, tmp_path) -> None:
    """Saved after every step (mid-document, at document boundaries, in the second epoch
    before and after the first one's end was seen), the state is small and resumes exactly,
    on one rank and on each of two; empty documents are skipped (a token folder's were lone
    BOS tokens)."""
    T, S, steps, after = 8, 4, 70, 3  # ~2.3 epochs; each resume reads 3 more steps
    docs = _hf_docs(_HF_LENGTHS)
    if source == "token folder":
        write_token_documents(tmp_path / "tok", [d.astype(np.uint16) for d in docs])
    want = _packed_oracle(docs, T, (steps + after) * S)[0]
    for world, micro in ((1, 4), (2, 1)):
        for rank in range(world):

            def stream(rank: int = rank, world: int = world, micro: int = micro) -> SequenceStream:
                if source == "token folder":
                    src = open_token_path(tmp_path / "tok", T, "causal")
                else:
                    src = _hf_source(docs, T, streaming=source == "hf streaming")
                return SequenceStream(src, global_batch_size=S, micro_batch_size=micro,
                                      rank=rank, world_size=world)  # fmt: skip

            def step_inputs(s: SequenceStream) -> np.ndarray:
                return np.concatenate([b.input_ids.numpy() for b in s.next_step()])

            share = slice(rank * S // world, (rank + 1) * S // world)
            run = stream()
            for k in range(steps):
                state = json.dumps(run.state_dict())
                assert len(state) < 200, state[:300]
                resumed = stream()
                resumed.load_state_dict(json.loads(state))
                for j in range(k, k + after):
                    np.testing.assert_array_equal(
                        step_inputs(resumed), want[j * S : j * S + S][share]
                    )
                np.testing.assert_array_equal(step_inputs(run), want[k * S : k * S + S][share])


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_padded_rows_learn_each_documents_end_and_resume_at_every_step(streaming) -> None:
    """Padded rows of an HF split had no EOT label (the model never learned to end a
    document); now they are the packed stream's, from each document's BOS to the next (empty
    rows skipped), and a state saved after any step resumes them exactly."""
    import datasets

    T, S, steps = 8, 4, 9  # ~4 epochs of the 9 non-empty rows
    docs = _hf_docs(_HF_LENGTHS)
    want = _padded_oracle(docs, T, (steps + 1) * S)
    assert int((want[1][:9] == EOT_ID).sum()) == 4  # rows of 2, 7, 1, 3 tokens

    def stream() -> SequenceStream:
        ds = datasets.Dataset.from_dict({"input_ids": [d.tolist() for d in docs]})
        src = HFSource(ds.to_iterable_dataset if streaming else lambda: ds, None, T,
                       packing="padded")  # fmt: skip
        return SequenceStream(src, global_batch_size=S, micro_batch_size=2)

    def step(s: SequenceStream) -> tuple[np.ndarray, np.ndarray]:
        batches = s.next_step()
        return (np.concatenate([b.input_ids.numpy() for b in batches]),
                np.concatenate([b.labels.numpy() for b in batches]))  # fmt: skip

    run = stream()
    for k in range(steps):
        resumed = stream()
        resumed.load_state_dict(json.loads(json.dumps(run.state_dict())))
        for s in (resumed, run):
            inputs, labels = step(s)
            np.testing.assert_array_equal(inputs, want[0][k * S : k * S + S])
            np.testing.assert_array_equal(labels, want[1][k * S : k * S + S])


@pytest.mark.parametrize("streaming", [False, True])
def test_hf_packed_resumes_a_state_of_the_old_format(streaming: bool) -> None:
    """A checkpoint written before the reader kept an offset holds the carried-over tokens
    (``buffer``); it resumes to the same sequences, and the next state is the small one."""
    T = 8
    docs = _hf_docs(_HF_LENGTHS)
    epoch = sum(len(d) + 1 for d in docs if len(d)) // T
    want = _packed_oracle(docs, T, 3 * epoch)
    for position in (0, 1, 40, 87, 88, epoch - 1, epoch + 1, epoch + 90, 2 * epoch + 3):
        state = _old_format_state(docs, T, position)
        src = _hf_source(docs, T, streaming=streaming)
        src.load_state_dict(json.loads(json.dumps(state)))
        inputs, labels = src.read(position, 20)
        np.testing.assert_array_equal(inputs, want[0][position : position + 20])
        np.testing.assert_array_equal(labels, want[1][position : position + 20])
        assert "buffer" not in src.state_dict() and len(json.dumps(src.state_dict())) < 200


def test_hf_packed_resume_from_data_that_changed() -> None:
    """An old-format carry that is not the end of its document (the data changed since) goes
    on from those tokens, as the old reader did; a new-format offset past its document's end
    cannot be resumed and says so."""
    T = 8
    docs = _hf_docs([20, 5, 30])
    src = _hf_source(docs, T, streaming=False)
    carry = [7, 7, 7]
    src.load_state_dict(
        {"position": 5, "docs_consumed": 1, "docs_per_epoch": None, "buffer": carry}
    )
    inputs, _ = src.read(5, 2)
    stream = np.concatenate([carry, [EOT_ID], docs[1], [EOT_ID], docs[2]])
    np.testing.assert_array_equal(inputs, np.stack([stream[:T], stream[T : 2 * T]]))
    src = _hf_source(docs, T, streaming=False)
    src.load_state_dict({"position": 5, "docs_consumed": 2, "docs_per_epoch": None, "offset": 6})
    with pytest.raises(
        ValueError, match=r"token 6 of row 1 .* holds 6 tokens: the dataset changed"
    ):
        src.read(5, 1)


def test_eval_batches_cover_each_sequence_once() -> None:
    docs = _docs(np.random.default_rng(3), 20)
    src = PackedSource.from_documents(docs, 8, varlen=False)
    want = src.read(0, 12)[1]
    got = [
        torch.cat(
            [
                b.labels
                for b in iterate_eval_batches(
                    src, num_sequences=12, micro_batch_size=2, rank=r, world_size=3
                )
            ]
        )
        for r in range(3)
    ]
    np.testing.assert_array_equal(torch.cat(got).numpy(), want)


def test_stream_rejects_indivisible_batches() -> None:
    src = PackedSource.from_documents(_docs(np.random.default_rng(4), 5), 4)
    with pytest.raises(ValueError, match="world_size \\* micro_batch_size"):
        SequenceStream(src, global_batch_size=6, micro_batch_size=4, rank=0, world_size=1)


# ------------------------------------------------------------------ prepare CLI


def test_prepare_takes_inputs_after_options(tmp_path) -> None:
    """`prepare a.txt --glob '*.md' folder/ b.jsonl --out x` (inputs after an option) refused
    b.jsonl as an unrecognized argument; it now writes the folder that inputs-first writes."""
    from fot.data.prepare import main
    from fot.data.tokens import TokenDocuments

    (tmp_path / "a.txt").write_text("The first file.")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "n.md").write_text("A note in markdown.")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "A line of JSON."}) + "\n")
    a, notes, b = (str(tmp_path / n) for n in ("a.txt", "notes", "b.jsonl"))
    main([a, notes, b, "--glob", "*.md", "--out", str(tmp_path / "first")])
    main([a, "--glob", "*.md", notes, "--out", str(tmp_path / "mixed"), b])
    first, mixed = TokenDocuments(tmp_path / "first"), TokenDocuments(tmp_path / "mixed")
    assert len(first) == 3
    assert [first[i].tolist() for i in range(3)] == [mixed[i].tolist() for i in range(3)]


def test_prepare_cli_round_trip(tmp_path, monkeypatch, capsys) -> None:
    import fot.data.prepare
    from fot import progress
    from fot.data.prepare import main
    from fot.data.tokens import TokenDocuments
    from fot.tokenizer import get_encoding

    texts = [f"The {i}th file says hello to the world." for i in range(6)]
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    for i, t in enumerate(texts):
        (folder / ("sub" if i % 2 else ".") / f"{i:02d}.txt").write_text(t)
    lines = tmp_path / "more.jsonl"
    lines.write_text("\n".join(json.dumps({"body": f"line {i}"}) for i in range(3)) + "\n")
    # the progress bar (shown after 2 s; here at once, a line per update) counts every document
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)
    bar = fot.data.prepare.progress_bar
    monkeypatch.setattr(fot.data.prepare, "progress_bar", lambda **kw: bar(**{**kw, "delay": 0}))
    rc = main(
        [
            str(folder),
            str(lines),
            "--text-field",
            "body",
            "--out",
            str(tmp_path / "tok"),
            "--heldout-every",
            "3",
            "--heldout-out",
            str(tmp_path / "held"),
        ]
    )
    assert rc == 0
    enc = get_encoding()
    files = sorted(folder.rglob("*.txt"))
    all_texts = [f.read_text() for f in files] + [f"line {i}" for i in range(3)]
    want = [enc.encode_ordinary(t) for t in all_texts]
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("tokenize: 9doc [") and f"tokens={sum(map(len, want))}]" in last
    tr, held = TokenDocuments(tmp_path / "tok"), TokenDocuments(tmp_path / "held")
    assert [list(map(int, d)) for d in held] == [want[i] for i in (2, 5, 8)]
    assert [list(map(int, d)) for d in tr] == [w for i, w in enumerate(want) if i % 3 != 2]
    # the folder trains: a packed source over it starts with BOS + the first document
    src = open_token_path(tmp_path / "tok", 4, "varlen")
    assert src.read(0, 1)[0][0].tolist() == [EOT_ID, *want[0][:3]]
    assert main([str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2


def test_prepare_names_the_option_a_typo_meant(tmp_path, capsys) -> None:
    """`--globs '*.md'` said only `unrecognized arguments: --globs *.md`."""
    from fot.data.prepare import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.md").write_text("Hello world, in markdown.\n")
    out = tmp_path / "tok"
    with pytest.raises(SystemExit) as exit_:
        main([str(corpus), "--out", str(out), "--globs", "*.md"])
    assert exit_.value.code == 2 and not out.exists()
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        "python -m fot.data.prepare: error: unrecognized arguments: --globs *.md "
        "(--globs: did you mean --glob?)"
    )
    assert main([str(corpus), "--out", str(out), "--glob", "*.md"]) == 0  # the option meant
    assert json.loads((out / "meta.json").read_text())["num_documents"] == 1


def test_prepare_refuses_a_symbolic_link_as_out(tmp_path, capsys) -> None:
    """--out <link to a token folder> replaced the link with a new folder, left the target's
    old tokens for runs that read it, and a stray link behind that later prepares warned of
    (helper-176). A link is refused, naming its target; both stay as they were."""
    from fot.data.prepare import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("a first text")
    target, link = tmp_path / "target", tmp_path / "link"
    assert main([str(corpus), "--out", str(target)]) == 0
    link.symlink_to(target)
    before = {q.name: q.read_bytes() for q in target.iterdir()}
    (corpus / "b.txt").write_text("a second text")
    capsys.readouterr()
    assert main([str(corpus), "--out", str(link)]) == 2
    err = capsys.readouterr().err
    assert (
        f"--out {link} is a symbolic link (to {target}): the new token folder would replace "
        f"the link, not the folder it points to. Pass the folder itself, --out {target}"
    ) in err, err
    assert link.is_symlink() and {q.name: q.read_bytes() for q in target.iterdir()} == before
    assert sorted(q.name for q in tmp_path.iterdir()) == ["corpus", "link", "target"]
    assert main([str(corpus), "--out", str(target)]) == 0  # the advice


def test_prepare_never_deletes_a_folder_that_is_not_a_token_folder(tmp_path, capsys) -> None:
    from fot.data.prepare import main
    from fot.data.tokens import TokenDocuments

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"text number {i}")
    other = tmp_path / "project"
    other.mkdir()
    (other / "notes.md").write_text("keep me")
    # --out naming the input folder, or any folder that is not a token folder: refused, kept
    for out in (corpus, other, corpus / "0.txt"):
        assert main([str(corpus), "--out", str(out)]) == 2
        assert str(out) in capsys.readouterr().err
    assert sorted(p.name for p in corpus.iterdir()) == [f"{i}.txt" for i in range(4)]
    assert (other / "notes.md").read_text() == "keep me"
    # a folder with a meta.json of another program (not format fot-tokens) is no token folder
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({"format": "other", "num_documents": 1}))
    assert main([str(corpus), "--out", str(foreign)]) == 2
    assert f"--out {foreign} exists and is not a token folder" in capsys.readouterr().err
    assert [p.name for p in foreign.iterdir()] == ["meta.json"]
    # --heldout-out that would replace --out, or that nothing would be written to: refused
    tok = tmp_path / "tok"
    args = [str(corpus), "--out", str(tok)]
    capsys.readouterr()
    assert main([*args, "--heldout-every", "2", "--heldout-out", str(tok)]) == 2
    assert "--heldout-out and --out are the same folder" in capsys.readouterr().err
    assert main([*args, "--heldout-out", str(tmp_path / "held")]) == 2
    assert not tok.exists() and not (tmp_path / "held").exists()
    # an existing token folder is replaced, as documented
    assert main(args) == 0
    assert main([str(corpus / "1.txt"), "--out", str(tok)]) == 0
    assert len(TokenDocuments(tok)) == 1
    # but not one that holds more than its tokens: a run trained in it, the input texts (it
    # was deleted whole, with them)
    before = {p.name: p.read_bytes() for p in tok.iterdir()}
    (tok / "run").mkdir()
    (tok / "run" / "notes.txt").write_text("keep me")
    shutil.copytree(corpus, tok / "texts")
    capsys.readouterr()
    for inputs in ([str(corpus)], [str(tok / "texts")]):
        assert main([*inputs, "--out", str(tok)]) == 2
        assert capsys.readouterr().err == (
            f"python -m fot.data.prepare: error: --out {tok} is a token folder that also holds run, texts, which replacing "
            "it would delete; move them out of it first, or choose a new folder for --out\n"
        )
    assert (tok / "run" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tok / "texts").iterdir()) == [f"{i}.txt" for i in range(4)]
    assert {p.name: p.read_bytes() for p in tok.iterdir() if p.is_file()} == before


@pytest.mark.parametrize("held_out", [False, True])
def test_prepare_over_the_file_size_limit_names_the_folder_and_keeps_the_old_one(
    tmp_path, held_out
) -> None:
    # a real write error: the file size limit (as `ulimit -f`, SIGXFSZ ignored) makes the new
    # tokens.bin fail part way; it was a traceback of a bare "OSError: [Errno 27] File too large"
    import subprocess
    import sys

    from fot.data.prepare import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(6):
        (corpus / f"{i}.txt").write_text(f"document {i} " * (1500 if i == 2 else 1))
    tok, held = tmp_path / "tok", tmp_path / "held"
    args = [str(corpus), "--out", str(tok)]
    if held_out:  # the big document (the 3rd) is held out: the held-out folder fails
        args += ["--heldout-every", "3", "--heldout-out", str(held)]
    assert main([str(corpus / "0.txt"), "--out", str(tok)]) == 0
    before = {p.name: p.read_bytes() for p in tok.iterdir()}
    code = (
        "import resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))\n"
        "from fot.data.prepare import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    failed = held if held_out else tok
    assert proc.stderr == (
        f"python -m fot.data.prepare: error: cannot write {failed}: File too large (the file would exceed the file size "
        "limit (`ulimit -f`) or the file system's). Nothing was replaced, and nothing "
        "half-written is left\n"
    )
    assert {p.name: p.read_bytes() for p in tok.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "tok"]


def test_data_paths_the_data_kind_would_ignore_are_refused(tmp_path) -> None:
    from omegaconf import OmegaConf

    from fot.training.config import DataConfig

    write_token_documents(tmp_path / "tok", [np.arange(1, 40, dtype=np.uint16)])
    for key in ("path", "val_path"):  # data=sample would train on the built-in corpus instead
        cfg = OmegaConf.structured(
            DataConfig(kind="sample", seq_len=8, **{key: str(tmp_path / "tok")})
        )
        with pytest.raises(ValueError, match=rf"data\.{key}=.*data=sample.*data=tokens"):
            build_sources(cfg)
    cfg = OmegaConf.structured(
        DataConfig(kind="hf", seq_len=8, path="json", val_path=str(tmp_path / "tok"))
    )
    with pytest.raises(ValueError, match=r"data\.val_path=.*data\.hf_val_split"):
        build_sources(cfg)
    # the same paths with data=tokens are read
    cfg = OmegaConf.structured(
        DataConfig(kind="tokens", seq_len=8, path=str(tmp_path / "tok"), val_tokens=8)
    )
    train, val = build_sources(cfg)
    assert train.read(0, 1)[0][0].tolist() == [EOT_ID, *range(1, 8)] and val is None


def test_hf_loader_tokenizes_with_gpt2(tmp_path) -> None:
    from omegaconf import OmegaConf

    from fot.tokenizer import get_encoding
    from fot.training.config import DataConfig

    texts = [f"Row {i}: the quick brown fox jumps over the lazy dog." for i in range(12)]
    files = _jsonl(tmp_path / "d.jsonl", texts)
    enc = get_encoding()
    oracle = PackedSource.from_documents(
        [np.array(enc.encode_ordinary(t), np.uint16) for t in texts], 16
    )
    want = oracle.read(0, 10)
    # one file as a string (the natural command line, data.hf_data_files=/data/d.jsonl), a
    # list, or a split mapping: the same documents
    for data_files in (files, [files], {"train": files}):
        cfg = OmegaConf.structured(DataConfig(kind="hf", path="json", seq_len=16, val_tokens=0))
        cfg.hf_data_files = data_files
        train_src, val_src = build_sources(cfg)
        assert val_src is None
        got = train_src.read(0, 10)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_hf_loader_checks_the_text_column_before_training(tmp_path) -> None:
    """A wrong data.text_field (or a number in the text column) used to fail at the first
    training step with a KeyError/TypeError traceback; a local file as data.path got
    datasets' "Couldn't find any data file" although the file is there."""
    from omegaconf import OmegaConf

    from fot.training.config import DataConfig

    def cfg(**kw):
        return OmegaConf.structured(DataConfig(kind="hf", seq_len=16, val_tokens=0, **kw))

    content = tmp_path / "content.jsonl"
    content.write_text(json.dumps({"content": "some text"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 has columns \['content'\], no 'text'.*text_field"):
        build_sources(cfg(path="json", hf_data_files=str(content)))
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text(json.dumps({"text": 5}) + "\n")
    with pytest.raises(ValueError, match=r"row 0: column 'text' holds 5 \(int\), not text"):
        build_sources(cfg(path="json", hf_data_files=str(numbers)))
    with pytest.raises(ValueError, match=r"is a file.*data.path=json data.hf_data_files="):
        build_sources(cfg(path=str(content)))
    # rows of token ids are read as they are; other values in input_ids are refused
    ids = tmp_path / "ids.jsonl"
    ids.write_text(
        "".join(json.dumps({"input_ids": list(range(i, i + 9))}) + "\n" for i in range(9))
    )
    train_src, _ = build_sources(cfg(path="json", hf_data_files=str(ids)))
    inputs, _ = train_src.read(0, 1)
    np.testing.assert_array_equal(inputs[0], [EOT_ID, *range(9), EOT_ID, *range(1, 6)])
    ids.write_text(json.dumps({"input_ids": ["a", "b"]}) + "\n")
    with pytest.raises(ValueError, match="column 'input_ids' is not a list of token ids"):
        build_sources(cfg(path="json", hf_data_files=str(ids)))


def _decoded(path) -> list[str]:
    from fot.data.tokens import TokenDocuments
    from fot.tokenizer import get_encoding

    enc = get_encoding()
    return [enc.decode([int(t) for t in d]) for d in TokenDocuments(path)]


def _hidden(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_prepare_bad_jsonl_lines_are_named_and_leave_nothing_behind(tmp_path, capsys) -> None:
    from fot.data.prepare import main

    good = '{"text": "fine"}\n\n   \n'
    cases = {
        "broken.jsonl": (good + '{"text": "no brace"\n', ":4 is not valid JSON"),
        "list.jsonl": (good + '["a", "b"]\n', ":4 is a JSON list, not an object"),
        "number.jsonl": (good + '{"text": 5}\n', ":4: field 'text' is 5 (int)"),
        "other.jsonl": (good + '{"body": "x"}\n', ":4 has no field 'text'"),
        "latin.jsonl": (b'{"text": "caf\xe9"}\n', None),
    }
    for name, (content, want) in cases.items():
        f = tmp_path / name
        f.write_bytes(content if isinstance(content, bytes) else content.encode())
        rc = main([str(f), "--out", str(tmp_path / "tok")])
        err = capsys.readouterr().err
        if want is None:  # not UTF-8: read with U+FFFD and a warning naming file and line
            assert rc == 0 and f"{f}:1 is not valid UTF-8" in err
            assert _decoded(tmp_path / "tok") == ["caf\ufffd"]
        else:
            assert rc == 2 and f"{f}{want}" in err, err
            assert not err.startswith('python -m fot.data.prepare: error: "')  # a KeyError's quotes
        assert _hidden(tmp_path) == []  # no half-written .tok.tmp-* folder


def test_prepare_reads_globs_several_patterns_and_refuses_structured_files(
    tmp_path, capsys
) -> None:
    from fot.data.prepare import main

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    texts = {"a.txt": "plain text one\n", "sub/b.md": "# Title\nmarkdown\n", "sub/c.txt": "two"}
    for name, t in texts.items():
        (corpus / name).write_text(t)
    (corpus / "latin.txt").write_bytes(b"na\xefve caf\xe9")
    out = str(tmp_path / "tok")
    # a quoted glob pattern as input (the shell did not expand it)
    assert main([str(corpus / "**" / "*.txt"), "--out", out]) == 0
    assert _decoded(out) == [texts["a.txt"], "na\ufffdve caf\ufffd", texts["sub/c.txt"]]
    assert "latin.txt is not valid UTF-8" in capsys.readouterr().err
    # several --glob patterns inside a folder, each file once
    assert (
        main([str(corpus), "--glob", "*.txt", "--glob", "*.md", "--glob", "b.*", "--out", out]) == 0
    )
    assert sorted(_decoded(out)) == sorted([*texts.values(), "na\ufffdve caf\ufffd"])
    assert main([str(tmp_path / "nope" / "*.txt"), "--out", out]) == 2
    assert "matches no file" in capsys.readouterr().err
    # a .csv given as a text file would become one document of raw CSV: refused with the fix
    csv = tmp_path / "d.csv"
    csv.write_text('text\n"csv doc, one"\ncsv doc two\n')
    assert main([str(csv), "--out", out]) == 2
    assert f"--hf csv --data-files {csv}" in capsys.readouterr().err
    assert main(["--hf", "csv", "--data-files", str(csv), "--out", out]) == 0
    assert _decoded(out) == ["csv doc, one", "csv doc two"]


def test_prepare_of_a_folder_warns_of_the_files_of_data_its_glob_leaves_out(
    tmp_path, capsys
) -> None:
    """The default --glob '*.txt' left out the .md, .jsonl, .json and .csv files beside the
    .txt files without a word; now a warning names them and the command that reads them. A
    folder of only what the glob reads (and files that are not data, and token folders) says
    nothing."""
    from fot.data.prepare import main

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "a.txt").write_text("text one")
    (plain / "script.py").write_text("print()")  # not data: never named
    for _ in range(2):  # the second time the folder holds a token folder (its meta.json)
        assert main([str(plain), "--out", str(plain / "tok")]) == 0
        assert "warning" not in capsys.readouterr().err
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("text one")
    out = str(tmp_path / "tok")
    (corpus / "b.md").write_text("# markdown")
    (corpus / "sub" / "c.jsonl").write_text('{"text": "json line"}\n')
    (corpus / "d.csv").write_text("text\ncsv row\n")
    (corpus / "e.json").write_text('[{"text": "json row"}]')
    assert main([str(corpus), "--out", out]) == 0
    assert capsys.readouterr().err == (
        f"warning: {corpus}: --glob '*.txt' leaves out 4 file(s) of data under it "
        f"({corpus / 'b.md'}, {corpus / 'd.csv'}, {corpus / 'e.json'} and 1 more). To read the "
        f".jsonl and .md files too: `python -m fot.data.prepare {corpus} --glob '*.txt' --glob "
        "'*.jsonl' --glob '*.md' --out <folder>`. The .csv and .json files are read as "
        "datasets, each kind into a token folder of its own (--text-field names their text "
        f"column): `python -m fot.data.prepare --hf csv --data-files '{corpus}/**/*.csv' --out "
        f"<folder>`; `python -m fot.data.prepare --hf json --data-files '{corpus}/**/*.json' "
        "--out <folder>`\n"
    )
    assert _decoded(out) == ["text one"]
    # the commands it names read them
    assert main([str(corpus), "--glob", "*.txt", "--glob", "*.jsonl", "--glob", "*.md",
                 "--out", out]) == 0  # fmt: skip
    assert sorted(_decoded(out)) == ["# markdown", "json line", "text one"]
    err = capsys.readouterr().err  # the tables only, now
    assert f"leaves out 2 file(s) of data under it ({corpus / 'd.csv'}, " in err
    assert "To read the" not in err
    assert main(["--hf", "csv", "--data-files", f"{corpus}/**/*.csv", "--out", out]) == 0
    assert _decoded(out) == ["csv row"]
    assert main(["--hf", "json", "--data-files", f"{corpus}/**/*.json", "--out", out]) == 0
    assert _decoded(out) == ["json row"]
    # a folder without one file the glob reads: the error named no file and no command
    (corpus / "a.txt").unlink()
    capsys.readouterr()
    assert main([str(corpus), "--glob", "*.txt", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"python -m fot.data.prepare: error: no files matching '*.txt' under {corpus}; {corpus}: --glob '*.txt' leaves out "
        f"4 file(s) of data under it ({corpus / 'b.md'}, "
    ), err
    assert f"`python -m fot.data.prepare {corpus} --glob '*.txt' --glob '*.jsonl' --glob" in err


def test_prepare_skips_rows_whose_text_is_none_as_empty_documents(tmp_path, capsys) -> None:
    """datasets reads a null (and a field missing from a JSON row) as None: an empty document,
    skipped with a warning counting it (it used to stop prepare with an error); an empty CSV
    cell is an empty text, counted as one."""
    import pandas as pd

    from fot.data.prepare import main

    f = tmp_path / "rows.jsonl"
    f.write_text('{"text": "a"}\n{"text": "b"}\n{"body": "c"}\n{"text": null}\n')
    assert main(["--hf", "json", "--data-files", str(f), "--out", str(tmp_path / "tok")]) == 0
    assert _decoded(tmp_path / "tok") == ["a", "b"]
    assert "2 row(s) of dataset json had no text" in capsys.readouterr().err
    csv = tmp_path / "d.csv"
    pd.DataFrame({"text": ["one", "", "three", ""], "id": [1, 2, 3, 4]}).to_csv(csv, index=False)
    assert main(["--hf", "csv", "--data-files", str(csv), "--out", str(tmp_path / "c")]) == 0
    assert _decoded(tmp_path / "c") == ["one", "three"]
    assert "2 empty text(s) (an empty file, or an empty text field) skipped" in (
        capsys.readouterr().err
    )
    # a null in a plain .jsonl input is an empty document too; a missing field stays an error
    j = tmp_path / "in.jsonl"
    j.write_text('{"text": "kept"}\n{"text": null}\n')
    assert main([str(j), "--out", str(tmp_path / "j")]) == 0
    assert _decoded(tmp_path / "j") == ["kept"]
    assert f"1 row(s) of {j} had no text (null)" in capsys.readouterr().err
    # no row holds the field: a wrong --text-field, named
    f.write_text('{"body": "c"}\n')
    assert main(["--hf", "json", "--data-files", str(f), "--out", str(tmp_path / "tok")]) == 2
    assert "row 0 (counting from 0) of dataset json has no field 'text'" in capsys.readouterr().err
    assert _hidden(tmp_path) == []


def test_prepare_without_documents_replaces_nothing(tmp_path, capsys) -> None:
    from fot.data.prepare import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"{i}.txt").write_text(f"document {i}")
    (tmp_path / "empty.txt").write_text("")
    tok, held = str(tmp_path / "tok"), str(tmp_path / "held")
    assert main([str(corpus), "--out", tok, "--heldout-every", "3", "--heldout-out", held]) == 0
    before = (_decoded(tok), _decoded(held))
    assert before == (["document 0", "document 1"], ["document 2"])
    # an empty input: an empty token folder would only fail later in train.py
    assert main([str(tmp_path / "empty.txt"), "--out", tok]) == 2
    assert "no training documents" in capsys.readouterr().err
    # --heldout-every larger than the number of documents: an empty held-out folder
    args = [str(corpus), "--out", tok, "--heldout-every", "4", "--heldout-out", held]
    assert main(args) == 2
    assert "holds out no document" in capsys.readouterr().err
    assert (_decoded(tok), _decoded(held)) == before
    assert _hidden(tmp_path) == []


def test_prepare_interrupted_or_failing_keeps_the_old_folders(tmp_path) -> None:
    from fot.data.prepare import prepare

    tok, held = tmp_path / "tok", tmp_path / "held"
    old = [np.arange(i + 1, dtype=np.uint16) for i in range(4)]
    prepare(iter(old), tok, heldout_every=2, heldout_out=held)
    before = ([d.tolist() for d in open_docs(tok)], [d.tolist() for d in open_docs(held)])

    def interrupted():
        yield np.array([7, 8], dtype=np.uint16)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(interrupted(), tok, heldout_every=2, heldout_out=held)
    # the held-out folder fails to write after the training documents were all read: the
    # training folder must not be replaced either (new training docs + old held-out ones)
    bad_held = [np.array([1]), np.array([70000]), np.array([2]), np.array([3])]
    with pytest.raises(ValueError, match="65535"):
        prepare(iter(bad_held), tok, heldout_every=2, heldout_out=held)
    assert ([d.tolist() for d in open_docs(tok)], [d.tolist() for d in open_docs(held)]) == before
    assert _hidden(tmp_path) == []


def test_a_failed_move_into_place_puts_both_old_folders_back(tmp_path, monkeypatch) -> None:
    """The held-out folder's move failing (a full disk) after the training folder's had
    succeeded left the new training folder, no held-out folder, and both old folders hidden."""
    from fot.data.prepare import prepare

    tok, held = tmp_path / "tok", tmp_path / "held"
    old = [np.arange(i + 1, dtype=np.uint16) for i in range(4)]
    prepare(iter(old), tok, heldout_every=2, heldout_out=held)
    before = ([d.tolist() for d in open_docs(tok)], [d.tolist() for d in open_docs(held)])
    rename = Path.rename

    def full_disk(self, target):
        if self.name.startswith(".held.tmp-"):
            raise OSError(28, "No space left on device")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", full_disk)
    new = [np.arange(i + 3, dtype=np.uint16) for i in range(6)]
    with pytest.raises(OSError, match="No space left"):
        prepare(iter(new), tok, heldout_every=2, heldout_out=held)
    assert ([d.tolist() for d in open_docs(tok)], [d.tolist() for d in open_docs(held)]) == before
    assert _hidden(tmp_path) == []


def test_a_signal_while_prepare_moves_the_folders_into_place_replaces_both(
    tmp_path, monkeypatch, capsys
) -> None:
    """Ctrl-C or SIGTERM while an old folder was deleted (seconds for a large tokens.bin) left
    the new held-out folder beside the old training folder, which holds half of its
    documents, and said that nothing was replaced; the old folder stayed hidden beside it."""
    import shutil

    import fot.data.tokens
    from fot.data.prepare import main

    corpus = tmp_path / "in"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"{i:02}.txt").write_text(f"document {i} " * 8)
    tok, held = str(tmp_path / "tok"), str(tmp_path / "held")
    assert main([str(corpus), "--out", tok, "--heldout-every", "3", "--heldout-out", held]) == 0
    real = shutil.rmtree
    signalled = []

    def rmtree_with_a_signal(path, *args, **kwargs):
        if ".old-" in str(path) and not signalled:
            signalled.append(path)
            # SIGTERM: a background job (CI) ignores SIGINT, and prepare then installs no handler
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs here
        real(path, *args, **kwargs)

    monkeypatch.setattr(fot.data.tokens.shutil, "rmtree", rmtree_with_a_signal)
    assert main([str(corpus), "--out", tok, "--heldout-every", "4", "--heldout-out", held]) == 0
    said = capsys.readouterr()
    assert signalled and json.loads(said.out.splitlines()[-1])["heldout_docs"] == 3
    assert (
        "SIGTERM came while the new folders were moved into place: the job had finished" in said.err
    )
    # the oracle: the same job run into fresh folders without a signal
    monkeypatch.setattr(fot.data.tokens.shutil, "rmtree", real)
    fresh = [str(tmp_path / "fresh_tok"), str(tmp_path / "fresh_held")]
    assert (
        main([str(corpus), "--out", fresh[0], "--heldout-every", "4", "--heldout-out", fresh[1]])
        == 0
    )
    for got, want in zip((tok, held), fresh):
        assert [d.tolist() for d in open_docs(got)] == [d.tolist() for d in open_docs(want)]
    assert _hidden(tmp_path) == []


# A prepare of documents 10.., 11.., ... into sys.argv[1], SIGKILLed at sys.argv[2]: "writing"
# (three documents of the staged folder written), "moving_in" (the earlier folder set aside,
# the new one not yet moved in) or "deleting" (the earlier folder set aside is half deleted).
_KILLED_PREPARE = """
import os, shutil, signal, sys
from pathlib import Path
import numpy as np
from fot.data.prepare import prepare

out, point = sys.argv[1], sys.argv[2]
real_rename, real_rmtree = Path.rename, shutil.rmtree


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


def docs():
    for i in range(6):
        if point == "writing" and i == 3:
            kill()
        yield np.arange(i + 10, dtype=np.uint16)


def rename(self, target):
    if point == "moving_in" and ".tmp-" in self.name:
        kill()
    return real_rename(self, target)


def rmtree(path, *args, **kwargs):
    if point == "deleting" and ".old-" in str(path):
        (Path(path) / "tokens.bin").unlink()
        kill()
    real_rmtree(path, *args, **kwargs)


Path.rename, shutil.rmtree = rename, rmtree
prepare(docs(), out)
"""


def _killed_over_old(tmp_path: Path, point: str) -> tuple[Path, list[np.ndarray], int]:
    """A token folder ``tmp_path / "tok"`` of four documents, then a prepare into it killed at
    ``point`` (:data:`_KILLED_PREPARE`): the folder, its documents and the killed process' id."""
    from fot.data.prepare import prepare

    tok = tmp_path / "tok"
    old = [np.arange(i + 1, dtype=np.uint16) for i in range(4)]
    prepare(iter(old), tok)
    return tok, old, run_killed(_KILLED_PREPARE, tok, point)


def _tag(pid: int) -> str:
    return f"{host_name()}.{pid}"


def test_a_prepare_killed_while_writing_leaves_a_folder_that_the_next_one_removes(
    tmp_path, caplog
) -> None:
    # A prepare killed while writing (SIGKILL, the OOM killer) left its staged folder
    # (.tok.new-<pid>, with ..tok.new-<pid>.tmp-<pid> inside it) beside the token folder for
    # good, and each rerun added one. Now the next write of the folder removes it, with a line.
    from fot.data.prepare import prepare

    tok, old, pid = _killed_over_old(tmp_path, "writing")
    staged = tmp_path / f".tok.tmp-{_tag(pid)}"
    assert _hidden(tmp_path) == [staged.name]  # the host is recorded
    assert [d.tolist() for d in open_docs(tok)] == [d.tolist() for d in old]
    new = [np.arange(i + 5, dtype=np.uint16) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="fot.data.tokens"):
        prepare(iter(new), tok)
    assert [r.getMessage() for r in caplog.records] == [
        f"removed {staged}: left by writes of {tok} that did not finish (process {pid} of this "
        "host)"
    ]
    assert [d.tolist() for d in open_docs(tok)] == [d.tolist() for d in new]
    assert _hidden(tmp_path) == []


def test_a_prepare_killed_while_replacing_keeps_the_earlier_folder_it_set_aside(
    tmp_path, caplog
) -> None:
    # Killed between setting the earlier token folder aside (.tok.old-<pid>) and moving the new
    # one in, a prepare left no token folder, that folder's only copy hidden beside it, and the
    # new one staged: reruns left both for good, without a word. Now the staged folder goes,
    # and the earlier folder is kept and named with what to do; one killed while it was
    # deleted (the new folder in place) holds nothing whole and goes too.
    from fot.data.prepare import prepare

    tok, old, pid = _killed_over_old(tmp_path, "moving_in")
    aside, staged = tmp_path / f".tok.old-{_tag(pid)}", tmp_path / f".tok.tmp-{_tag(pid)}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([aside.name, staged.name])
    new = [np.arange(i + 5, dtype=np.uint16) for i in range(3)]
    with caplog.at_level(logging.WARNING, logger="fot.data.tokens"):
        prepare(iter(new), tok)
    assert [r.getMessage() for r in caplog.records] == [
        f"removed {staged}: left by writes of {tok} that did not finish (process {pid} of this "
        "host)",
        f"kept {aside}: it holds the token folder {tok} as it was before process {pid} of this "
        "host set it aside to replace it and did not finish (it ended; killed?), and may be its "
        f"only copy. To keep it, move it to a folder of its own (mv '{aside}' <folder>); else "
        f"delete it (rm -r '{aside}')",
    ]
    assert [d.tolist() for d in open_docs(aside)] == [d.tolist() for d in old]
    assert [d.tolist() for d in open_docs(tok)] == [d.tolist() for d in new]
    aside.rename(tmp_path / "earlier")
    # killed while deleting the folder set aside: what is left of it is removed
    pid = run_killed(_KILLED_PREPARE, tok, "deleting")
    aside = tmp_path / f".tok.old-{_tag(pid)}"
    assert _hidden(tmp_path) == [aside.name]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fot.data.tokens"):
        prepare(iter(new), tok)
    assert [r.getMessage() for r in caplog.records] == [
        f"removed {aside}: left by writes of {tok} that did not finish (process {pid} of this host)"
    ]
    assert _hidden(tmp_path) == []
    assert [d.tolist() for d in open_docs(tmp_path / "earlier")] == [d.tolist() for d in old]


def test_a_token_folder_a_killed_prepare_left_set_aside_is_named_where_it_is_missing(
    tmp_path,
) -> None:
    # A prepare killed between setting the token folder aside and moving the new one in left
    # no folder; training on it said only that it does not exist, and to create one with
    # prepare. The folder set aside beside it (whole) is now named, with the mv that puts it
    # back; following that gives the folder as it was.
    import re
    import shlex
    import subprocess

    from fot.data.tokens import TokenDocuments

    tok, old, pid = _killed_over_old(tmp_path, "moving_in")
    aside = tmp_path / f".tok.old-{_tag(pid)}"
    assert not tok.exists() and aside.is_dir()
    hint = (
        f"{aside} holds it as it was before process {pid} of this host set it aside to replace "
        f"it and did not finish (killed?): put it back with `mv {aside} {tok}`."
    )
    for key in ("data.path", "data.val_path"):
        with pytest.raises(FileNotFoundError) as info:
            open_token_path(tok, 8, "varlen", key=key)
        assert str(info.value) == f"{key}={tok} does not exist. {hint}"
    with pytest.raises(FileNotFoundError) as info:
        TokenDocuments(tok)
    assert str(info.value) == f"token folder {tok} does not exist: {hint}"
    subprocess.run(shlex.split(re.search(r"`(.*)`", hint)[1]), check=True)
    assert [d.tolist() for d in open_docs(tok)] == [d.tolist() for d in old]
    # a copy that does not open whole (a delete cut short) is not named
    pid = run_killed(_KILLED_PREPARE, tok, "moving_in")
    (tmp_path / f".tok.old-{_tag(pid)}" / "tokens.bin").unlink()
    with pytest.raises(FileNotFoundError) as info:
        open_token_path(tok, 8, "varlen")
    assert str(info.value).startswith(f"data.path={tok} does not exist. Turn text files")


def test_a_folder_set_aside_under_this_process_id_earlier_is_kept_by_the_next_replace(
    tmp_path, caplog
) -> None:
    """A whole token folder that an earlier process with this process' id set aside and left
    (a restarted container reuses ids) may be the only copy of it: the next replace sets the
    old folder aside under another name (``+1``) and keeps that one as it was. Oracle: the
    documents written into each folder by hand."""
    from fot.data.prepare import prepare
    from fot.staging import writer_tag

    tok = tmp_path / "tok"
    write_token_documents(tok, [[1, 2, 3]])
    kept = tmp_path / f".tok.old-{writer_tag()}"
    write_token_documents(kept, [[7, 7]])
    with caplog.at_level(logging.WARNING):
        prepare(iter([np.array([4, 5], dtype=np.uint16)]), tok)
    assert [d.tolist() for d in TokenDocuments(tok)] == [[4, 5]]
    assert [d.tolist() for d in TokenDocuments(kept)] == [[7, 7]]
    assert f"kept {kept}" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == [kept.name, "tok"]


def test_folders_an_earlier_fot_staged_are_removed_once_a_day_unchanged(
    tmp_path, monkeypatch, caplog
) -> None:
    # An earlier fot staged prepare's folders as .tok.new-<pid> (written through
    # ..tok.new-<pid>.tmp-<pid>) and the sample cache as .<cache>.<pid> (through
    # ..<cache>.<pid>.tmp-<pid>); a kill left them for good, as no later write looked for
    # those names. The next write of the folder removes those of processes that have ended
    # (no process here has the id) once a day unchanged, in one line; others are kept.
    import subprocess
    import time

    from fot.data import sample
    from fot.data.prepare import prepare
    from fot.data.tokens import write_token_documents

    def ended_pid() -> int:
        proc = subprocess.Popen(["true"])
        proc.wait()
        return proc.pid

    day_ago = time.time() - 25 * 3600

    def leave(path: Path, *, age: float = day_ago) -> Path:
        path.mkdir()
        (path / "tokens.bin").write_bytes(b"\0\1")
        for p in (path / "tokens.bin", path):
            os.utime(p, (age, age))
        return path

    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        tok = tmp_path / "tok"
        prepare(iter([np.arange(3, dtype=np.uint16)]), tok)
        a, b = ended_pid(), ended_pid()
        gone = {
            leave(tmp_path / f".tok.new-{a}"): a,
            leave(tmp_path / f"..tok.new-{a}.tmp-{a}"): a,
            leave(tmp_path / f"..tok.new-{b}.old-{b}"): b,
        }
        gone = dict(sorted(gone.items()))  # logged by name
        kept = [
            leave(tmp_path / f".tok.new-{b}", age=time.time()),  # changed within a day
            leave(tmp_path / f".tok.new-{sleeper.pid}"),  # a process here has the id
            leave(tmp_path / f"..tok.new-{a}.tmp-{b}"),  # two ids: not a name fot wrote
        ]
        (tmp_path / f".tok.new-{b}0").write_bytes(b"")  # a file: fot wrote folders there
        os.utime(tmp_path / f".tok.new-{b}0", (day_ago, day_ago))
        kept.append(tmp_path / f".tok.new-{b}0")
        with caplog.at_level(logging.WARNING, logger="fot.data.tokens"):
            prepare(iter([np.arange(4, dtype=np.uint16)]), tok)
        writers = "; ".join(
            f"process {pid}, host not recorded, unchanged for over a day" for pid in gone.values()
        )
        assert [r.getMessage() for r in caplog.records] == [
            f"removed {', '.join(map(str, gone))}: left by writes of {tok} that did not "
            f"finish ({writers})"
        ]
        assert _hidden(tmp_path) == sorted(p.name for p in kept)
        assert [d.tolist() for d in open_docs(tok)] == [[0, 1, 2, 3]]

        # the sample cache's, when it is built
        cache = tmp_path / "cache"
        cache.mkdir()
        monkeypatch.setenv("FOT_CACHE_DIR", str(cache))
        monkeypatch.setattr(sample, "sample_named_texts", lambda: [("a", "A play.")])
        folder = cache / f"sample-{sample.sample_source()}-v1"
        gone = [leave(cache / f"..{folder.name}.{a}.tmp-{a}"), leave(cache / f".{folder.name}.{a}")]
        kept = [leave(cache / f".{folder.name}.{sleeper.pid}")]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fot.data.tokens"):
            assert sample.sample_token_documents().meta["names"] == ["a"]
        writers = "; ".join(
            f"process {pid}, host not recorded, unchanged for over a day" for pid in (a, a)
        )
        assert [r.getMessage() for r in caplog.records] == [
            f"removed {', '.join(map(str, gone))}: left by writes of {folder} that did "
            f"not finish ({writers})"
        ]
        assert sorted(p.name for p in cache.iterdir()) == sorted([folder.name, kept[0].name])
        write_token_documents(folder, [[1]])  # a write of the folder itself removes none either
        assert sorted(p.name for p in cache.iterdir()) == sorted([folder.name, kept[0].name])
    finally:
        sleeper.kill()
        sleeper.wait()


def open_docs(path):
    from fot.data.tokens import TokenDocuments

    return TokenDocuments(path)


def test_float_npy_and_missing_val_path_are_explained(tmp_path) -> None:
    np.save(tmp_path / "f.npy", np.arange(100, dtype=np.float32))
    with pytest.raises(ValueError, match="float32 values, not integer token ids"):
        open_token_path(tmp_path / "f.npy", 8, "varlen")
    with pytest.raises(FileNotFoundError, match=r"data\.val_path="):
        open_token_path(tmp_path / "nope", 8, "varlen", key="data.val_path")


def test_prepare_strips_a_utf8_byte_order_mark(tmp_path) -> None:
    from fot.data.prepare import main

    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfHello there")
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    out = str(tmp_path / "tok")
    assert main([str(tmp_path / "bom.txt"), str(tmp_path / "bom.jsonl"), "--out", out]) == 0
    assert _decoded(out) == ["Hello there", "first", "second"]


def test_prepare_reads_a_lone_surrogate_as_u_fffd_with_a_warning(tmp_path, capsys) -> None:
    """A JSON ``\\ud800`` escape without its pair is no character: it was tokenized as U+FFFD
    without a word; now a warning names the file and line. Oracle: tiktoken's ids of the text
    with U+FFFD for it; a pair of escapes is its character, without a warning."""
    from fot.data.prepare import main
    from fot.data.tokens import TokenDocuments
    from fot.tokenizer import get_encoding

    f = tmp_path / "rows.jsonl"
    f.write_text('{"text": "pair \\ud83d\\ude00"}\n{"text": "lone \\ud800 and \\udfff"}\n')
    out = tmp_path / "tok"
    assert main([str(f), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"{f}:2: field 'text' holds 2 lone UTF-16 surrogate(s)" in err, err
    assert f"{f}:1" not in err
    enc = get_encoding()
    want = [enc.encode_ordinary("pair 😀"), enc.encode_ordinary("lone \ufffd and \ufffd")]
    assert [d.tolist() for d in TokenDocuments(out)] == want


def test_sample_data_is_escaped_as_data_text_escaping_says() -> None:
    """``data=sample data.text_escaping=json`` (fine-tuning a LongCrawl64 model on the sample
    corpus) trained on plain text while the export recorded ``json``, so fot.eval escaped the
    prompts of a model that never saw escaped text. Oracle: tiktoken's ids of ``json.dumps``
    of the first play without its quotes."""
    import json

    from omegaconf import OmegaConf

    from fot.data.loaders import build_sources
    from fot.data.sample import sample_texts
    from fot.tokenizer import EOT_ID, get_encoding
    from fot.training.config import DataConfig

    cfg = OmegaConf.structured(DataConfig(kind="sample", seq_len=64, text_escaping="json"))
    train, _ = build_sources(cfg)
    escaped = json.dumps(sample_texts()[0])[1:-1]  # the first play is a training document
    assert train.read(0, 1)[0][0].tolist() == [
        EOT_ID,
        *get_encoding().encode_ordinary(escaped)[:63],
    ]
    assert 198 not in train.read(0, 4)[0]  # no newline token in JSON-escaped text


def test_prepare_refuses_binary_and_utf16_files(tmp_path, capsys) -> None:
    from fot.data.prepare import main

    (tmp_path / "ok.txt").write_text("fine text")
    (tmp_path / "wide.txt").write_bytes("Hello".encode("utf-16"))  # BOM, then H\0e\0...
    (tmp_path / "blob.txt").write_bytes(b"GIF89a\x01\x00\x00")
    out = tmp_path / "tok"
    for name, offset in (("wide.txt", 3), ("blob.txt", 7)):
        assert main([str(tmp_path / "ok.txt"), str(tmp_path / name), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"{name} holds NUL bytes (first at offset {offset})" in err, err
        assert not out.exists()  # nothing half-written
    assert main([str(tmp_path / "ok.txt"), "--out", str(out)]) == 0


def test_short_or_malformed_token_files_name_the_config_key(tmp_path) -> None:
    write_token_documents(tmp_path / "held", [np.arange(5, dtype=np.uint16)])
    with pytest.raises(ValueError, match=r"^data\.val_path=.*held: the token stream has 6 tokens"):
        open_token_path(tmp_path / "held", 64, "varlen", key="data.val_path")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match=r"odd.bin has 3 bytes, an odd number"):
        open_token_path(tmp_path / "odd.bin", 8, "varlen")
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty.bin: the token stream has 0 tokens"):
        open_token_path(tmp_path / "empty.bin", 8, "varlen")


def test_damaged_token_data_is_named_with_the_fix(tmp_path) -> None:
    """A damaged token folder, zarr or .npy used to give a bare library message without the
    path ('mmap length is greater than file size', 'No group found in store', JSON errors)."""
    docs = [np.arange(50, dtype=np.uint16), np.arange(70, dtype=np.uint16)]

    def damaged(name: str, change) -> Path:
        folder = tmp_path / name
        write_token_documents(folder, docs)
        change(folder)
        return folder

    cases = {
        "meta": (lambda f: (f / "meta.json").write_text("{bad"), r"meta.json is not readable JSON"),
        "short": (
            lambda f: (f / "tokens.bin").write_bytes((f / "tokens.bin").read_bytes()[:100]),
            r"tokens.bin has 100 bytes, but doc_offsets.npy counts 120 tokens \(240 bytes",
        ),
        "offsets": (
            lambda f: np.save(f / "doc_offsets.npy", np.array([0, 70, 50])),
            r"doc_offsets.npy does not hold document offsets",
        ),
        "no_offsets": (lambda f: (f / "doc_offsets.npy").unlink(), r"doc_offsets.npy is missing"),
        # tokens.bin and doc_offsets.npy of another write (they agree), meta.json left behind
        "two_writes": (
            lambda f: (
                np.save(f / "doc_offsets.npy", np.array([0, 40, 90, 120])),
                (f / "tokens.bin").write_bytes(bytes(240)),
            ),
            r"meta.json says num_documents=2, but doc_offsets.npy counts 3: the files are of two",
        ),
    }
    for name, (change, match) in cases.items():
        folder = damaged(name, change)
        with pytest.raises((ValueError, FileNotFoundError), match=match) as err:
            open_token_path(folder, 16, "varlen")
        assert "copy it again, or write it again" in str(err.value)
    # a folder of another writer says its dtype: named as such, not as a damaged copy
    other = damaged("uint32", lambda f: (f / "meta.json").write_text(
        json.dumps({**json.loads((f / "meta.json").read_text()), "dtype": "uint32"})))  # fmt: skip
    with pytest.raises(ValueError, match=r"meta.json says dtype 'uint32', but token folders hold"):
        open_token_path(other, 16, "varlen")
    (tmp_path / "empty.zarr").mkdir()
    (tmp_path / "file.zarr").write_text("not zarr")
    for name in ("empty.zarr", "file.zarr"):
        with pytest.raises(ValueError, match=rf"{name} is not a readable zarr array"):
            open_token_path(tmp_path / name, 16, "varlen")
    (tmp_path / "text.npy").write_text("1 2 3 4")
    with pytest.raises(ValueError, match=r"^data.path=.*text.npy is not a readable .npy array"):
        open_token_path(tmp_path / "text.npy", 16, "varlen")


def test_prepare_hf_text_files_are_one_document_each(tmp_path, capsys) -> None:
    """datasets' text loader makes every line a document (newlines dropped, a blank line an
    empty document); `--hf text` and `--hf <folder of .txt>` now read one document per file,
    as `prepare <folder>` does, and skip an empty file."""
    from fot.data.prepare import main

    folder = tmp_path / "texts"
    folder.mkdir()
    a = "Line one of file A.\n\nLine three of file A.\n"
    b = "File B first line.\nFile B second line.\n"
    (folder / "a.txt").write_text(a)
    (folder / "b.txt").write_text(b)
    (folder / "c.txt").write_text("")
    pattern = str(folder / "*.txt")
    for hf, more in (("text", ["--data-files", pattern]), (str(folder), [])):
        for streaming in ([], ["--streaming"]):
            out = tmp_path / "hf"
            assert main(["--hf", hf, *more, *streaming, "--out", str(out)]) == 0
            assert _decoded(out) == [a, b], (hf, streaming)
    assert "every line" not in capsys.readouterr().err
    assert main([str(folder), "--out", str(tmp_path / "tok")]) == 0
    assert _decoded(tmp_path / "tok") == [a, b]


def test_prepare_max_docs_counts_written_documents_and_reads_no_further(tmp_path, capsys) -> None:
    """--max-docs N writes the first N non-empty documents and never reads row N+1 (a bad row
    there is not an error); 0 is a usage error, not 'the inputs hold 0 documents'."""
    from fot.data.prepare import main

    f = tmp_path / "docs.jsonl"
    rows = [{"text": ""}, {"text": "one"}, {"text": "two"}, {"body": "not reached"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main([str(f), "--out", str(tmp_path / "tok"), "--max-docs", "2"]) == 0
    assert _decoded(tmp_path / "tok") == ["one", "two"]
    with pytest.raises(SystemExit) as exit_:
        main([str(f), "--out", str(tmp_path / "tok0"), "--max-docs", "0"])
    assert exit_.value.code == 2
    assert "argument --max-docs: expected an integer >= 1, got '0'" in capsys.readouterr().err
    assert not (tmp_path / "tok0").exists()
    # the Python API refuses it too (it wrote one document)
    from fot.data.prepare import tokenize

    with pytest.raises(ValueError, match="--max-docs must be >= 1"):
        list(tokenize(iter(["one", "two"]), max_docs=0))


def test_prepare_refuses_output_folders_that_would_delete_each_other(tmp_path, capsys) -> None:
    """One output inside the other (or inside any token folder, or under a file) is refused
    before anything is written: replacing the outer folder would delete the inner one."""
    from fot.data.prepare import main, prepare

    tok, held = tmp_path / "tok", tmp_path / "held"
    prepare(iter([np.arange(3, dtype=np.uint16)] * 4), tok, heldout_every=2, heldout_out=held)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    (tmp_path / "notes.txt").write_text("not a folder")
    src = tmp_path / "a.txt"
    src.write_text("one document")
    cases = [
        (["--out", str(tmp_path / "new"), "--heldout-every", "2", "--heldout-out",
          str(tmp_path / "new" / "h")], "lie one inside the other"),
        (["--out", str(held / "train"), "--heldout-every", "2", "--heldout-out", str(held)],
         f"lies inside the token folder {held}"),
        (["--out", str(tok / "nested")], f"lies inside the token folder {tok}"),
        (["--out", str(tmp_path / "notes.txt" / "x")], "lies under the file"),
    ]  # fmt: skip
    for args, want in cases:
        assert main([str(src), *args]) == 2
        assert want in capsys.readouterr().err
    src.unlink()
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == sorted([*before, Path("notes.txt")])
    assert _decoded(tok) == [_decoded(held)[0]] * 2  # both folders intact


def test_prepare_reads_a_file_named_twice_once(tmp_path, capsys) -> None:
    """A folder, a pattern over it and a symbolic link to one of its files: each file is one
    document, once (a copy would also leak between training and held-out documents)."""
    from fot.data.prepare import main

    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    texts = {"a.txt": "alpha", "b.txt": "beta", "sub/c.txt": "gamma"}
    for name, text in texts.items():
        (corpus / name).write_text(text)
    (corpus / "link.txt").symlink_to(corpus / "a.txt")
    (corpus / "dangling.txt").symlink_to(tmp_path / "missing.txt")
    args = [str(corpus), f"{corpus}/*.txt", str(corpus / "b.txt"), "--out", str(tmp_path / "tok")]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert sorted(_decoded(tmp_path / "tok")) == sorted(texts.values())
    assert "were named more than once" in err and "broken symbolic link(s)" in err
    with pytest.raises(SystemExit):
        main([str(corpus), "--out", str(tmp_path / "t2"), "--data-files", "x.csv"])
    assert "--data-files: for --hf datasets only" in capsys.readouterr().err
    assert not (tmp_path / "t2").exists()


def test_prepare_stopped_by_sigterm_leaves_no_temporary_folder(tmp_path) -> None:
    """`timeout`, Slurm and Docker stop a job with SIGTERM: handled like Ctrl-C."""
    import signal
    import subprocess
    import sys
    import time

    line = json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 200}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 10_000)  # ~90 MB of text: ~10 s to tokenize
    out = tmp_path / "tok"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fot.data.prepare", str(tmp_path / "big.jsonl"), "--out", str(out)],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not _hidden(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the temporary folder exists: the run is writing
    assert _hidden(tmp_path), "the run never started writing"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "was not replaced" in err, err[-2000:]
    assert _hidden(tmp_path) == [] and not out.exists()


def test_signal_whose_raise_python_swallows_still_stops_prepare(tmp_path) -> None:
    """A SIGTERM handled inside a ``__del__`` only prints its KeyboardInterrupt; the run stops
    at the next document all the same, and nothing is written (CI saw such a run finish)."""
    import os
    import signal

    from fot.data.prepare import prepare
    from fot.interrupt import StopOnSignal

    class SignalsInDel:
        def __del__(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler's raise is swallowed here

    def docs():
        for i in range(50):
            if i == 3:
                SignalsInDel()  # made and dropped at once: __del__ runs now
            yield np.arange(1, 20, dtype=np.uint16)

    out = tmp_path / "tok"
    cleaned = []
    stop = StopOnSignal((signal.SIGTERM, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt), stop:
        try:
            prepare(stop.checked(docs()), out)
        finally:  # a second signal does not cut into the clean-up
            os.kill(os.getpid(), signal.SIGTERM)
            cleaned.append(True)
    assert cleaned == [True]
    assert not out.exists() and _hidden(tmp_path) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers are put back


def test_last_step_digest_is_the_global_batch_for_any_world_and_micro_batch() -> None:
    """The checkpoint's data digest: SHA-256 of the last global batch's token ids (inputs, then
    labels), the same for every rank layout, recomputed here from the source's own read (the
    oracle)."""
    import hashlib

    rng = np.random.default_rng(3)
    docs = [rng.integers(0, 50000, n, dtype=np.uint16) for n in (40, 70, 25, 90) * 5]
    src = PackedSource.from_documents(docs, 16)
    inputs, labels = (a.astype(np.int64).tobytes() for a in src.read(8, 8))
    want = hashlib.sha256(inputs + labels).hexdigest()
    inputs, labels = (a.astype(np.int64).tobytes() for a in src.read(0, 8))
    first = hashlib.sha256(inputs + labels).hexdigest()  # a checkpoint of step 1 holds it too
    for world, rank, micro in ((1, 0, 8), (2, 1, 2), (4, 3, 1)):
        stream = SequenceStream(
            src, global_batch_size=8, micro_batch_size=micro, rank=rank, world_size=world
        )
        assert stream.last_step_digest() is None  # no step yet
        stream.next_step()
        assert stream.last_step_digest() == first
        stream.next_step()
        assert stream.last_step_digest() == want
    hf = SequenceStream(HFSource(lambda: [{"text": "a b"}] * 50, lambda t: [1, 2], 4),
                        global_batch_size=2, micro_batch_size=2)  # fmt: skip
    hf.next_step()
    assert hf.last_step_digest() is None  # sequential: it cannot read backwards


def test_packed_num_sequences_never_counts_a_sequence_whose_last_label_wraps(tmp_path) -> None:
    """Validation reads ``num_sequences`` held-out sequences "never wrapped around"; for a
    stream of a multiple of T tokens the last one's final label used to be the stream's first
    token (for a flat file: a wrong next token)."""
    T = 8
    flat = np.arange(1, 4 * T + 1, dtype=np.uint16)  # 32 tokens: 3 sequences have all labels
    np.save(tmp_path / "held.npy", flat)
    src = open_token_path(tmp_path / "held.npy", T, "causal", key="data.val_path")
    assert src.num_sequences == (len(flat) - 1) // T == 3
    got = np.concatenate(
        [b.labels.numpy() for b in iterate_eval_batches(src, num_sequences=3, micro_batch_size=2)]
    )
    np.testing.assert_array_equal(got.reshape(-1), flat[1 : 3 * T + 1])
    docs = [np.arange(1, T, dtype=np.uint16)] * 2  # 2 x (BOS + 7) = 16 tokens: 1 sequence
    assert PackedSource.from_documents(docs, T).num_sequences == 1
    assert PackedSource.from_flat(flat[: T + 1], T).num_sequences == 1


def test_prepare_unreachable_hub_or_unreadable_input_is_one_error_line(
    tmp_path, capsys, monkeypatch
) -> None:
    """Errors of the kinds train.py prints as one line (an unreachable hub, a file it may not
    read) used to end `prepare` with a traceback."""
    import datasets

    from fot.data.prepare import main

    def offline(path, **kw):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset_builder", offline)
    out = tmp_path / "tok"
    assert main(["--hf", "someone/corpus", "--out", str(out)]) == 2
    assert (
        "python -m fot.data.prepare: error: Couldn't reach 'someone/corpus' on the Hub"
        in capsys.readouterr().err
    )
    (tmp_path / "a.txt").write_text("hello")

    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", denied)
    assert main([str(tmp_path / "a.txt"), "--out", str(out)]) == 2
    assert "Permission denied" in capsys.readouterr().err
    assert not out.exists() and _hidden(tmp_path) == []


def test_sample_cache_written_by_another_rank_meanwhile_is_kept(tmp_path, monkeypatch) -> None:
    """Every rank of a first torchrun tokenizes the sample corpus; a rank that finished second
    used to replace (and delete) the cache the first one had written and opened: on a shared
    file system its memmap goes stale, and ranks racing through the two renames crashed with
    'no meta.json' or 'Directory not empty'. The first complete cache now wins."""
    import os

    from fot.data import sample
    from fot.tokenizer import get_encoding

    monkeypatch.setenv("FOT_CACHE_DIR", str(tmp_path))
    texts = [("a", "First play text."), ("b", "Second play, another text.")]
    folder = tmp_path / f"sample-{sample.sample_source()}-v1"
    held_open = []

    def texts_while_another_rank_finishes():
        # the other rank writes the whole cache and reads it while this one tokenizes
        enc = get_encoding()
        docs = [np.asarray(enc.encode_ordinary(t), np.uint16) for _, t in texts]
        write_token_documents(folder, docs, source="test", names=["a", "b"])
        held_open.append(os.open(folder / "tokens.bin", os.O_RDONLY))
        return texts

    monkeypatch.setattr(sample, "sample_named_texts", texts_while_another_rank_finishes)
    docs = sample.sample_token_documents()
    try:
        assert os.fstat(held_open[0]).st_nlink == 1  # the other rank's files were not deleted
        assert docs.meta["source"] == "test"  # its cache is the one used
    finally:
        os.close(held_open[0])
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # nothing else left behind
    # a damaged cache (an interrupted copy) is still replaced
    (folder / "meta.json").write_text("{bad")
    monkeypatch.setattr(sample, "sample_named_texts", lambda: texts)
    assert sample.sample_token_documents().meta["names"] == ["a", "b"]
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


def test_negative_token_id_seen_only_as_a_label_is_refused() -> None:
    """The last token of a zarr chunk (and of a rank's last packed sequence) is a label only;
    a negative id there (e.g. -1 padding in an int32 array) passed the check and failed in the
    loss (on CUDA: a device-side assert)."""
    from fot.data.streams import check_token_ids

    rows = np.arange(4 * 16, dtype=np.int32).reshape(4, 16)
    rows[2, 7] = -1  # the last token of chunk 0 of row 2 (seq_len 8)
    stream = SequenceStream(ZarrRowsSource(rows, 8), global_batch_size=8, micro_batch_size=4)
    batches = stream.next_step()
    assert -1 not in batches[0].input_ids  # the id reaches the labels only
    with pytest.raises(ValueError, match=r"the training data holds token id -1, outside"):
        check_token_ids(batches, 50257, what="training data")
    padded = PaddedSource([np.array([5, 6], np.uint16)], 8).read(0, 1)  # -100: ignored labels
    check_token_ids([make_batch(*padded, varlen=False)], 50257, what="training data")


def test_prepare_reads_ndjson_files_as_json_lines(tmp_path, capsys) -> None:
    """.ndjson and .jsonlines are JSON Lines files under other names; they used to be read as
    plain text: one document of JSON markup per file."""
    from fot.data.prepare import main

    rows = [{"text": "first document"}, {"text": "second document"}]
    names = ("a.ndjson", "b.jsonlines", "c.NDJSON")
    for name in names:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "tok"
    assert main([*(str(tmp_path / n) for n in names), "--out", str(out)]) == 0
    assert _decoded(out) == ["first document", "second document"] * 3
    (tmp_path / "d.ndjson").write_text('{"body": "x"}\n')
    assert main([str(tmp_path / "d.ndjson"), "--out", str(out)]) == 2
    assert "d.ndjson:1 has no field 'text'" in capsys.readouterr().err
