"""FakeBackend's own rules, beyond the contract it shares with llama.cpp (test_backend_contract.py)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from barreld.cache import statecut, stateformat
from barreld.cache.key import fingerprint_gguf
from barreld.engine.backend import BackendError, BatchItem, ContextSettings, ModelLoadError
from barreld.names import MemoryKind
from tests.fakes.backend import BOS, END, FakeBackend, write_gguf

SETTINGS = ContextSettings(n_ctx=32, n_batch=8, n_seq_max=2)


@pytest.fixture
def be(tmp_path: Path) -> FakeBackend:
    return FakeBackend(write_gguf(tmp_path / "m.gguf"), SETTINGS)


def items(tokens: list[int], seq: int = 0, start: int = 0) -> list[BatchItem]:
    return [BatchItem(t, start + i, seq, True) for i, t in enumerate(tokens)]


def test_a_token_alone_in_its_batch_gets_other_kv_and_logits(be: FakeBackend) -> None:
    """As llama.cpp's one-token kernel path: the logits differ, and so does the KV later tokens see."""
    be.decode(items([1, 2, 3, 4, 4]))
    batched = be.logits(4)
    be.decode(items([1, 2], seq=1))
    be.decode(items([3], seq=1, start=2) + items([5, 5], start=5))  # one token of seq 1, two of seq 0
    alone = be.logits(0)
    be.decode(items([4, 4], seq=1, start=3))
    assert not np.array_equal(be.logits(1), batched)
    other = FakeBackend(be.path, SETTINGS)
    other.decode(items([1, 2, 3]))
    assert not np.array_equal(alone, other.logits(2))
    other.decode(items([4, 4], start=3))
    assert np.array_equal(other.logits(1), batched)  # a split into runs of two or more does not matter


def test_a_split_sensitive_model_depends_on_every_batch_boundary(tmp_path: Path) -> None:
    be = FakeBackend(write_gguf(tmp_path / "s.gguf", split=True), SETTINGS)
    be.decode(items([1, 2, 3, 4]))
    whole = be.logits(3)
    be.decode(items([1, 2], seq=1))
    be.decode(items([3, 4], seq=1, start=2))
    assert not np.array_equal(be.logits(1), whole)
    flash = FakeBackend(write_gguf(tmp_path / "f.gguf"), ContextSettings(n_ctx=32, n_batch=8, flash_attn=True))
    assert flash.min_batch == 64 and not flash.split_sensitive


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
    assert be.tokens(0) == [10, 13, 14] and be.seq_pos_range(0) == (0, 4)
    be.state_set(1, memoryview(be.state_get(0)))
    assert be.seqs[1].cells == be.seqs[0].cells
    be.decode(items([15], start=5) + items([15], seq=1, start=5))
    assert np.array_equal(be.logits(0), be.logits(1))
    be.seq_rm(1, 0, -1)
    assert be.seq_pos_range(1) == (-1, -1)


def test_states_are_in_llama_cpps_layout_and_cut_as_llama_cpp_writes_a_prefix(be: FakeBackend) -> None:
    be.decode(items([10, 11, 12, 13, 14]))
    shape = statecut.self_check(be.state_get(0), stateformat.StateSpec.for_memory(MemoryKind.FULL))
    cut = statecut.cut(stateformat.parse(be.state_get(0), shape), 3)
    be.seq_rm(0, 3, -1)
    assert bytes(cut) == bytes(be.state_get(0))


def test_malformed_states_are_refused(be: FakeBackend) -> None:
    be.decode(items([7, 8, 9]))
    good = bytes(be.state_get(0))
    cells = 8 + 4 + 4  # header, n_stream, stream 0's count: the cells' metadata follows
    swapped = good[:cells] + good[cells + 12 : cells + 24] + good[cells : cells + 12] + good[cells + 24 :]
    beyond = bytearray(good)
    beyond[cells : cells + 4] = (40).to_bytes(4, "little")  # position 40 > n_ctx
    bad_token = bytearray(good)
    bad_token[-4:] = (10**6).to_bytes(4, "little")
    one_stream = good[:8] + (1).to_bytes(4, "little") + good[12:]  # the context has two streams
    for bad in (
        good[:10],
        good[:-1],
        good + b"\0",
        swapped,
        bytes(beyond),
        bytes(bad_token),
        one_stream,
        b"\0" * len(good),
    ):
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
