"""FakeBackend's own rules, beyond the contract it shares with llama.cpp (test_backend_contract.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from barreld.cache.key import fingerprint_gguf
from barreld.engine.backend import BackendError, BatchItem, ContextSettings, ModelLoadError
from tests.fakes.backend import BOS, END, ONE_TOKEN_SHIFT, FakeBackend, write_gguf

SETTINGS = ContextSettings(n_ctx=32, n_batch=8, n_seq_max=2)


@pytest.fixture
def be(tmp_path: Path) -> FakeBackend:
    return FakeBackend(write_gguf(tmp_path / "m.gguf"), SETTINGS)


def items(tokens: list[int], seq: int = 0, start: int = 0) -> list[BatchItem]:
    return [BatchItem(t, start + i, seq, True) for i, t in enumerate(tokens)]


def test_a_batch_holding_one_token_of_a_sequence_shifts_its_logits(be: FakeBackend) -> None:
    be.decode(items([1, 2, 3]))
    batched = be.logits(2)
    be.decode(items([1, 2], seq=1))
    be.decode(items([3], seq=1, start=2) + items([4, 4], start=3))  # one token of seq 1, two of seq 0
    assert np.array_equal(be.logits(0), batched + ONE_TOKEN_SHIFT)
    other = FakeBackend(be.path, SETTINGS)
    other.decode(items([1, 2, 3, 4, 4]))
    assert np.array_equal(be.logits(2), other.logits(4))


def test_each_model_file_is_another_model(tmp_path: Path) -> None:
    a = FakeBackend(write_gguf(tmp_path / "a.gguf", "a"), SETTINGS)
    b = FakeBackend(write_gguf(tmp_path / "b.gguf", "b"), SETTINGS)
    again = FakeBackend(write_gguf(tmp_path / "a2.gguf", "a"), SETTINGS)
    for be in (a, b, again):
        be.decode(items([5, 6]))
    assert np.array_equal(a.logits(1), again.logits(1)) and not np.array_equal(a.logits(1), b.logits(1))
    fingerprints = {fingerprint_gguf(tmp_path / f, "gguf_chunked") for f in ("a.gguf", "b.gguf", "a2.gguf")}
    assert len(fingerprints) == 2


def test_files_that_are_not_gguf_are_refused(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF"):
        FakeBackend(tmp_path / "junk.gguf", SETTINGS)
    with pytest.raises(ModelLoadError, match="cannot read"):
        FakeBackend(tmp_path / "missing.gguf", SETTINGS)


def test_state_holds_exactly_the_cells_and_a_cut_drops_positions(be: FakeBackend) -> None:
    be.decode(items([10, 11, 12, 13, 14]))
    be.seq_rm(0, 1, 3)  # full attention: a middle range can go
    assert [c for c in be.seqs[0].cells] == [(0, 10), (3, 13), (4, 14)]
    be.state_set(1, memoryview(be.state_get(0)))
    assert be.seqs[1].cells == be.seqs[0].cells and be.seqs[1].digests == be.seqs[0].digests
    be.decode(items([15], start=5) + items([15], seq=1, start=5))
    assert np.array_equal(be.logits(0), be.logits(1))


def test_malformed_states_are_refused(be: FakeBackend) -> None:
    be.decode(items([7, 8, 9]))
    good = bytes(be.state_get(0))
    out_of_order = good[:16] + good[24:32] + good[16:24] + good[32:]
    beyond = bytearray(good)
    beyond[-8:-4] = (40).to_bytes(4, "little")  # position 40 > n_ctx
    bad_token = bytearray(good)
    bad_token[-4:] = (10**6).to_bytes(4, "little")
    for bad in (good[:10], good[:-1], out_of_order, bytes(beyond), bytes(bad_token), b"\0" * len(good)):
        with pytest.raises(BackendError):
            be.state_set(1, memoryview(bad))
        assert be.tokens(1) == []
    be.state_set(1, memoryview(good))
    assert be.tokens(1) == [7, 8, 9]


def test_decode_refuses_bad_batches_whole(be: FakeBackend) -> None:
    be.decode(items([1, 2]))
    for bad in (
        [],
        items(list(range(9)), seq=1),  # larger than n_batch
        items([3, 4]) + items([5], seq=2),  # no such sequence
        items([3, 10**6], start=2),  # no such token
        items([3], start=2) + items([4], start=4),  # a gap inside the batch
    ):
        with pytest.raises(BackendError):
            be.decode(bad)
    assert be.tokens(0) == [1, 2] and be.tokens(1) == []
    be.seq_rm(0, 0, -1)
    be.decode(items(list(range(8))))
    be.decode(items(list(range(8)), start=8))
    be.decode(items(list(range(8)), start=16))
    be.decode(items(list(range(8)), start=24))
    with pytest.raises(BackendError, match="past the context"):
        be.decode(items([1], start=32))


def test_only_requested_logits_exist(be: FakeBackend) -> None:
    be.decode([BatchItem(1, 0, 0, False), BatchItem(2, 1, 0, True)])
    be.logits(1)
    with pytest.raises(BackendError):
        be.logits(0)


def test_tokenizer_pieces_specials_and_bos(be: FakeBackend) -> None:
    assert be.tokenize(b"") == [BOS] and be.tokenize_tail(b"") == []
    tokens = be.tokenize_tail(b"hello<|end|>\xff")
    assert [be.piece(t) for t in tokens] == [b"hello", b"<|end|>", b"\xff"]
    assert tokens[1] == END and be.is_eog(END) and not be.is_eog(tokens[0])
    with pytest.raises(BackendError):
        be.piece(be.n_vocab)


def test_the_call_log_and_injected_failures(be: FakeBackend) -> None:
    be.decode(items([1, 2]) + items([3, 4], seq=1))
    be.state_get(1)
    be.seq_rm(1, 1)
    be.fail_next("decode")
    with pytest.raises(BackendError, match="injected"):
        be.decode(items([5], start=2))
    be.decode(items([5], start=2))
    assert [c.op for c in be.calls] == ["decode", "state_get", "seq_rm", "decode"]
    assert be.batches(seq=1) == [items([3, 4], seq=1)] and len(be.batches()) == 2
    assert be.ops("seq_rm")[0].span == (1, -1)
    be.close()
    with pytest.raises(BackendError, match="closed"):
        be.decode(items([6], start=3))


def test_hold_keeps_a_decode_waiting_until_release(be: FakeBackend) -> None:
    be.hold()
    t = threading.Thread(target=be.decode, args=(items([1, 2]),))
    t.start()
    assert be.wait_held()
    assert be.tokens(0) == []
    be.release()
    t.join(5)
    assert be.tokens(0) == [1, 2]
