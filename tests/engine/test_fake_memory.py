"""FakeBackend's memory kinds behave as llama.cpp was measured to (tests/test_model_kinds.py pins the same
facts on Gemma 3, a tiny Mamba and a tiny LFM2), so the engine's rules can be tested in milliseconds.

Every prefill here splits at multiples of CHUNK on split-sensitive models, as the engine's do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from barreld.engine.backend import BackendError, BatchItem, ContextSettings
from barreld.names import MemoryKind
from tests.fakes.backend import FakeBackend, write_gguf

CHUNK = 8
WINDOW = 16
N_BATCH = 16  # without swa_full the SWA ring holds WINDOW + N_BATCH = 32 cells


def backend(tmp_path: Path, kind: MemoryKind, swa_full: bool = False) -> FakeBackend:
    model = write_gguf(
        tmp_path / f"{kind}.gguf", memory=kind, window=WINDOW if kind is MemoryKind.SWA else 0, split=True
    )
    return FakeBackend(model, ContextSettings(n_ctx=128, n_batch=N_BATCH, swa_full=swa_full))


def prefill(be: FakeBackend, start: int, end: int) -> np.ndarray:
    """Tokens start..end-1 of a fixed prompt, split at multiples of CHUNK; the last one's logits."""
    pos = start
    while pos < end:
        stop = min((pos // CHUNK + 1) * CHUNK, end)
        be.decode([BatchItem(200 + p % 7, p, 0, p == stop - 1) for p in range(pos, stop)])
        last, pos = stop - pos - 1, stop
    return be.logits(last)


def cold(tmp_path: Path, kind: MemoryKind, end: int, swa_full: bool = False) -> np.ndarray:
    return prefill(backend(tmp_path, kind, swa_full), 0, end)


@pytest.mark.parametrize("kind", list(MemoryKind))
def test_a_state_restored_at_its_own_length_continues_exactly(tmp_path: Path, kind: MemoryKind) -> None:
    be = backend(tmp_path, kind, swa_full=True)
    prefill(be, 0, 24)
    state = be.state_get(0)
    be.seq_rm(0, 0, -1)
    be.state_set(0, memoryview(state))
    low = {MemoryKind.FULL: 0, MemoryKind.SWA: 24 - WINDOW}.get(kind, 23)
    assert be.seq_pos_range(0) == (low, 23)
    assert np.array_equal(prefill(be, 24, 40), cold(tmp_path, kind, 40, swa_full=True))


@pytest.mark.parametrize("kind", [MemoryKind.RECURRENT, MemoryKind.HYBRID])
def test_a_recurrent_state_cannot_be_cut(tmp_path: Path, kind: MemoryKind) -> None:
    be = backend(tmp_path, kind)
    prefill(be, 0, 24)
    before = bytes(be.state_get(0))
    with pytest.raises(BackendError, match="refuses"):
        be.seq_rm(0, 8, -1)
    assert bytes(be.state_get(0)) == before and be.seq_pos_range(0) == (23, 23)
    be.seq_rm(0, 0, -1)
    assert be.seq_pos_range(0) == (-1, -1)


def test_a_cut_of_a_restored_window_loses_cells_though_seq_rm_says_yes(tmp_path: Path) -> None:
    be = backend(tmp_path, MemoryKind.SWA, swa_full=True)
    prefill(be, 0, 40)
    state = be.state_get(0)
    be.state_set(0, memoryview(state))
    be.seq_rm(0, 32, -1)
    assert be.seq_pos_range(0) == (40 - WINDOW, 31)  # pos_min > 32 - WINDOW: positions 17..23 are gone
    assert not np.array_equal(prefill(be, 32, 48), cold(tmp_path, MemoryKind.SWA, 48, swa_full=True))


def test_with_swa_full_a_live_sequence_cuts_exactly(tmp_path: Path) -> None:
    be = backend(tmp_path, MemoryKind.SWA, swa_full=True)
    prefill(be, 0, 64)
    be.seq_rm(0, 24, -1)
    assert be.seq_pos_range(0) == (0, 23)
    assert np.array_equal(prefill(be, 24, 48), cold(tmp_path, MemoryKind.SWA, 48, swa_full=True))


def test_a_ring_puts_its_window_in_order_after_a_prefill_call_so_a_wrapped_state_restores_exactly(
    tmp_path: Path,
) -> None:
    be = backend(tmp_path, MemoryKind.SWA)
    prefill(be, 0, 40)  # past the ring of 32 cells
    state = be.state_get(0)
    be.seq_rm(0, 0, -1)
    be.state_set(0, memoryview(state))
    assert be.seq_pos_range(0) == (40 - WINDOW, 39)
    assert np.array_equal(prefill(be, 40, 56), cold(tmp_path, MemoryKind.SWA, 56))


def test_tokens_decoded_alone_wrap_a_ring_out_of_the_order_a_restore_gives(tmp_path: Path) -> None:
    def decoded(restore: bool) -> np.ndarray:
        be = backend(tmp_path, MemoryKind.SWA)
        prefill(be, 0, 24)
        for p in range(24, 40):  # generated one at a time: the ring wraps at 32
            be.decode([BatchItem(250, p, 0, True)])
        if restore:
            be.state_set(0, memoryview(be.state_get(0)))
        return prefill(be, 40, 56)

    assert not np.array_equal(decoded(False), decoded(True))


def test_a_ring_past_its_window_holds_only_the_window(tmp_path: Path) -> None:
    """So a live cut would lose cells: a ring's live sequence is never cut (barreld.engine.memory)."""
    be = backend(tmp_path, MemoryKind.SWA)
    prefill(be, 0, 30)
    assert be.seq_pos_range(0) == (30 - WINDOW, 29)
    be.seq_rm(0, 16, -1)
    assert be.seq_pos_range(0) == (30 - WINDOW, 15)
