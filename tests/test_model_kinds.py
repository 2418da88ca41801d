"""What each llama.cpp memory kind lets a cache do, measured on one model of each kind.

full (SmolLM2, llama), swa (Gemma 3 270M, window 512), recurrent (tiny Mamba) and hybrid (tiny LFM2). These
pin the facts the reuse rules of barreld.engine.memory rest on: which cuts give the cold logits, what
llama.cpp reports after a cut or a restore (the backend's seq_pos_range), and what a partial (SWA-only or
recurrent-only) snapshot repairs. Where the backend has no call for it (seq_rm's own answer, partial
snapshots), the tests reach llama.cpp through the backend's handles.

Every prefill is split at absolute multiples of CHUNK, in batches of two tokens or more: Gemma's logits
depend on the batch split even with flash attention off, so warm and cold runs are compared only where
their batches fall at the same positions.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from barreld.engine.backend import BatchItem
from barreld.engine.llama_backend import ContextSettings, LlamaBackend
from barreld.engine.registry import bundled_model_path
from tests.support.sandbox_models import gemma_path, tiny_hybrid_path, tiny_recurrent_path

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.model

CHUNK = 64
N_CTX = 1024
PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (alias SWA_ONLY): only the SWA or recurrent part
WORDS = (
    "time river stone light garden number window paper music winter signal forest engine yellow market "
    "silver planet morning bridge letter harbour castle pocket circle island"
).split()


@dataclass(frozen=True)
class Case:
    """A model, and a prompt of n tokens whose state is captured at `cut` and at `saved` (both chunk multiples)."""

    path: Callable[[], Path]
    kind: tuple[int, bool, bool, int]  # n_swa, is_recurrent, is_hybrid, n_layer
    bytes_per_token: int  # growth of a saved state per token, past the sliding window if any
    n: int
    saved: int
    cut: int
    restored_pos_min: int  # llama_memory_seq_pos_min after restoring the state saved at `saved`
    swa_full: bool = False


CASES = {
    "full": Case(lambda: bundled_model_path("smollm2"), (0, False, False, 30), 23_052, 200, 192, 64, 0),
    # swa_full, so the live sequence can be cut (a ring's cannot, see the tests below); a saved state still
    # holds the last 512 SWA cells only
    "swa": Case(gemma_path, (512, False, False, 18), 3_084, 900, 832, 512, 832 - 512, swa_full=True),
    # recurrent memory exists at the last position only; a hybrid reports its recurrent part
    "recurrent": Case(tiny_recurrent_path, (0, True, False, 4), 0, 300, 256, 128, 255),
    "hybrid": Case(tiny_hybrid_path, (0, False, True, 4), 268, 300, 256, 128, 255),
}


def prompt(b: LlamaBackend, n: int) -> list[int]:
    rng = np.random.default_rng(7)
    tokens = b.tokenize(" ".join(WORDS[i] for i in rng.integers(0, len(WORDS), 2 * n)).encode())
    assert len(tokens) >= n
    return tokens[:n]


def prefill(b: LlamaBackend, tokens: list[int], start: int, end: int, chunk: int = CHUNK) -> np.ndarray:
    """Evaluates tokens[start:end] in batches split at absolute multiples of chunk; last-token logits."""
    pos = start
    while pos < end:
        stop = min((pos // chunk + 1) * chunk, end)
        assert stop - pos >= 2, "a one-token batch takes another kernel path"
        batch = [BatchItem(tokens[p], p, 0, p == end - 1) for p in range(pos, stop)]
        b.decode(batch)
        pos = stop
    return b.logits(len(batch) - 1)


def pos_range(b: LlamaBackend) -> tuple[int, int]:
    return b.seq_pos_range(0)


def seq_rm(b: LlamaBackend, p0: int) -> bool:
    """llama_memory_seq_rm's own answer (LlamaBackend.seq_rm turns False into an error)."""
    return bool(b._L.llama_memory_seq_rm(b._mem, 0, p0, -1))


def partial_get(b: LlamaBackend) -> bytes:
    size = b._L.llama_state_seq_get_size_ext(b._ctx, 0, PARTIAL_ONLY)
    buf = (ctypes.c_uint8 * size)()
    assert b._L.llama_state_seq_get_data_ext(b._ctx, buf, size, 0, PARTIAL_ONLY) == size
    return bytes(buf)


def partial_set(b: LlamaBackend, data: bytes) -> None:
    buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
    assert b._L.llama_state_seq_set_data_ext(b._ctx, buf, len(data), 0, PARTIAL_ONLY) == len(data)


@dataclass
class Run:
    """One model loaded, one cold prefill of its prompt with states captured on the way, and then the live
    sequence cut back to `cut` and prefilled again (None where llama.cpp refuses the cut)."""

    case: Case
    b: LlamaBackend
    tokens: list[int]
    full: dict[int, bytes] = field(default_factory=dict)
    partial: dict[int, bytes] = field(default_factory=dict)
    cold: np.ndarray | None = None
    live_cut: np.ndarray | None = None

    def warm(self, start: int) -> np.ndarray:
        return prefill(self.b, self.tokens, start, self.case.n)

    def restore(self, length: int) -> None:
        self.b.state_set(0, memoryview(self.full[length]))


def open_run(case: Case, **settings: bool) -> Run:
    settings = {"swa_full": case.swa_full, **settings}
    b = LlamaBackend(case.path(), ContextSettings(n_ctx=N_CTX, n_batch=CHUNK, **settings))
    run = Run(case, b, prompt(b, case.n))
    pos = 0
    for stop in (case.cut, case.saved - CHUNK, case.saved):
        prefill(b, run.tokens, pos, stop)
        run.full[stop], run.partial[stop] = bytes(b.state_get(0)), partial_get(b)
        pos = stop
    run.cold = prefill(b, run.tokens, pos, case.n)
    if seq_rm(b, case.cut):
        run.live_cut = run.warm(case.cut)
    return run


@pytest.fixture(scope="module")
def runs() -> Iterator[Callable[[str], Run]]:
    opened: dict[str, Run] = {}

    def get(kind: str) -> Run:
        if kind not in opened:
            opened[kind] = open_run(CASES[kind])
        run = opened[kind]
        run.b.seq_rm(0, 0, -1)
        return run

    yield get
    for run in opened.values():
        run.b.close()


@pytest.mark.parametrize("kind", CASES)
def test_llama_cpp_reports_the_memory_kind(runs: Callable[[str], Run], kind: str) -> None:
    run = runs(kind)
    L, m = run.b._L, run.b._model
    got = (L.llama_model_n_swa(m), L.llama_model_is_recurrent(m), L.llama_model_is_hybrid(m), L.llama_model_n_layer(m))
    assert got == run.case.kind
    assert (run.b.memory, run.b.swa_window) == (kind, run.case.kind[0])


@pytest.mark.parametrize("kind", CASES)
def test_the_logits_depend_on_the_prefix(runs: Callable[[str], Run], kind: str) -> None:
    """Without this the exactness tests below would prove nothing on random weights."""
    run = runs(kind)
    assert np.isfinite(run.cold).all() and np.ptp(run.cold) > 1
    assert not np.array_equal(run.warm(run.case.cut), run.cold)  # the same tokens without their prefix


@pytest.mark.parametrize("kind", CASES)
def test_state_bytes_per_token(runs: Callable[[str], Run], kind: str) -> None:
    """Past the window a Gemma state grows by its 3 full-attention layers only; a recurrent one not at all."""
    run = runs(kind)
    saved = run.case.saved
    assert len(run.full[saved]) - len(run.full[saved - CHUNK]) == CHUNK * run.case.bytes_per_token


@pytest.mark.parametrize("kind", CASES)
def test_a_state_restored_at_its_own_length_continues_exactly(runs: Callable[[str], Run], kind: str) -> None:
    run = runs(kind)
    run.restore(run.case.saved)
    assert pos_range(run.b) == (run.case.restored_pos_min, run.case.saved - 1)
    assert np.array_equal(run.warm(run.case.saved), run.cold)


@pytest.mark.parametrize("kind", CASES)
def test_cutting_the_live_sequence(runs: Callable[[str], Run], kind: str) -> None:
    """Full attention, and SWA with swa_full on, cut anywhere; recurrent memory cannot be cut at all."""
    run = runs(kind)
    if run.case.kind[1] or run.case.kind[2]:
        assert run.live_cut is None
    else:
        assert np.array_equal(run.live_cut, run.cold)


@pytest.mark.parametrize(
    ("kind", "removed", "exact"),
    [("full", True, True), ("swa", True, False), ("recurrent", False, None), ("hybrid", False, None)],
)
def test_cutting_a_restored_state(runs: Callable[[str], Run], kind: str, removed: bool, exact: bool | None) -> None:
    """seq_rm cuts full and SWA caches (and says True even where the SWA layers lack cells the cut needs);
    it refuses a recurrent or hybrid state and leaves it whole. pos_min after the cut shows the SWA loss:
    continuing at K is exact only while pos_min <= max(0, K - n_swa)."""
    run = runs(kind)
    case = run.case
    run.restore(case.saved)
    before = pos_range(run.b)
    assert seq_rm(run.b, case.cut) is removed
    if not removed:
        assert pos_range(run.b) == before == (case.saved - 1, case.saved - 1)
        return
    assert pos_range(run.b) == (before[0], case.cut - 1)
    assert (pos_range(run.b)[0] <= max(0, case.cut - case.kind[0])) is exact
    assert np.array_equal(run.warm(case.cut), run.cold) is exact


@pytest.mark.parametrize("kind", ["swa", "recurrent", "hybrid"])
def test_a_partial_snapshot_repairs_a_cut(runs: Callable[[str], Run], kind: str) -> None:
    """Writing the SWA-only (or recurrent-only) snapshot taken at the cut over a longer restored state,
    then removing the tail, leaves exactly the bytes a cold prefill to the cut leaves: the SWA cells or the
    recurrent state can be captured per block during prefill and the rest cut from one long state."""
    run = runs(kind)
    case = run.case
    run.restore(case.saved)
    partial_set(run.b, run.partial[case.cut])
    assert seq_rm(run.b, case.cut)
    assert bytes(run.b.state_get(0)) == run.full[case.cut]
    assert np.array_equal(run.warm(case.cut), run.cold)


def test_partial_snapshot_sizes(runs: Callable[[str], Run]) -> None:
    """SWA-only holds the last window of the SWA layers, so it stops growing at 512 tokens; a recurrent
    model's partial state is its whole state; a hybrid's is its recurrent part, the same size at any length."""
    swa, rec, hyb = runs("swa"), runs("recurrent"), runs("hybrid")
    assert len({len(v) for v in swa.partial.values()}) == 1
    assert rec.partial == rec.full
    assert len({len(v) for v in hyb.partial.values()}) == 1
    assert all(len(hyb.partial[k]) < len(hyb.full[k]) for k in hyb.full)


def test_without_swa_full_each_prefill_call_orders_the_ring_so_a_restore_past_it_is_exact(
    runs: Callable[[str], Run],
) -> None:
    """Without swa_full the live SWA cache is a ring of pad(512 + n_batch, 256) = 768 cells here. Left to
    itself it wraps, its cells then sit in another order than a restored state's, and later logits differ
    (bench/RESULTS.md, "ring"); so the backend writes the window out and reads it back after every prefill
    call. Then a state saved past the ring holds the swa_full run's bytes, and restored, into a ring that held
    something else, it continues exactly as the ring's own cold run does."""
    swa = runs("swa")
    case = swa.case
    b = LlamaBackend(case.path(), ContextSettings(n_ctx=N_CTX, n_batch=CHUNK))
    try:
        assert b.ring and case.saved > 768
        prefill(b, swa.tokens, 0, case.saved)
        assert pos_range(b) == (case.saved - 512, case.saved - 1)
        ordered = bytes(b.state_get(0))
        assert ordered == swa.full[case.saved]
        cold = prefill(b, swa.tokens, case.saved, case.n)
        b.seq_rm(0, 0, -1)
        prefill(b, swa.tokens, 0, 640)
        b.state_set(0, memoryview(ordered))
        assert np.array_equal(prefill(b, swa.tokens, case.saved, case.n), cold)
    finally:
        b.close()


@pytest.mark.parametrize(("kind", "depends"), [("full", False), ("swa", True), ("recurrent", False), ("hybrid", False)])
def test_batch_split_with_flash_attention_off(runs: Callable[[str], Run], kind: str, depends: bool) -> None:
    """SmolLM2 (Q4_1) and the f32 tiny models give the same logits for any split into batches of two or
    more; Gemma (Q4_K_M) does not, so its warm prefill must split where the cold one did."""
    run = runs(kind)
    n = 2 * CHUNK + 6
    a = prefill(run.b, run.tokens, 0, n)
    run.b.seq_rm(0, 0, -1)
    assert np.array_equal(prefill(run.b, run.tokens, 0, n, chunk=CHUNK - 2), a) is not depends


@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_flash_attention_is_exact_only_at_the_same_split(kind: str) -> None:
    """With flash attention on, logits depend on the split; a state restored at a chunk boundary and then
    prefilled in chunk-aligned batches matches the chunk-aligned cold run."""
    run = open_run(CASES[kind], flash_attn=True)
    try:
        run.b.seq_rm(0, 0, -1)
        assert not np.array_equal(prefill(run.b, run.tokens, 0, run.case.n, chunk=CHUNK - 3), run.cold)
        run.b.seq_rm(0, 0, -1)
        run.restore(run.case.saved - CHUNK)
        assert np.array_equal(run.warm(run.case.saved - CHUNK), run.cold)
    finally:
        run.b.close()


def test_tiny_models_are_built_once_byte_for_byte_even_by_racing_processes(tmp_path: Path) -> None:
    build = (
        "from tests.support.sandbox_models import tiny_recurrent_path, tiny_hybrid_path as h;"
        " print(tiny_recurrent_path(), h())"
    )

    def start(cache: Path) -> subprocess.Popen:
        env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT)}
        return subprocess.Popen([sys.executable, "-c", build], env=env, stdout=subprocess.PIPE, cwd=tmp_path)

    racers = [start(tmp_path / "shared") for _ in range(2)]
    outs = {p.communicate(timeout=300)[0] for p in racers}
    assert all(p.returncode == 0 for p in racers) and len(outs) == 1
    other = start(tmp_path / "other")
    assert other.communicate(timeout=300)[0] and other.returncode == 0
    shared, alone = (sorted((tmp_path / d / "barrel-tests").glob("*.gguf")) for d in ("shared", "other"))
    assert [p.name for p in shared] == [p.name for p in alone] and len(shared) == 2
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(shared, alone, strict=True))
    assert not list((tmp_path / "shared" / "barrel-tests").glob(".*.tmp"))
