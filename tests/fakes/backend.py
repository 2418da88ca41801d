"""A deterministic stand-in for llama.cpp behind the Backend protocol, so the engine is tested in milliseconds.

What it keeps from llama.cpp, because the engine's correctness depends on it:
- the logits at a position are a function of the KV it was computed from (a digest of the sequence's
  history, see tests/fakes/memory.py), so a wrong restore or a wrong cut changes the logits and the reply;
- a token that is the only one of its sequence in a batch gets other KV and logits than inside a prefill;
  on a split-sensitive model (the GGUF says so) every batch boundary counts; so do the bounds of a batch of
  fewer tokens than a minimum (64 with flash attention, as llama.cpp's CPU kernel is tiled from 64 rows;
  else what the GGUF names as `fake.min_batch`, 2 by default);
- the four memory kinds (full, swa with swa_full on or off, recurrent, hybrid), chosen by the GGUF's
  metadata (`write_gguf`): what a cut keeps or refuses, what a saved state holds, what positions it reports;
- states in llama.cpp's sequence-state layout (one layer: K rows are the digests, V rows the tokens), so the
  cache core's parser and cut run on them; `state_set` refuses foreign or malformed bytes;
- a batch holding several sequences is cut as llama.cpp cuts it (see `decode`);
- `decode` refuses a batch larger than n_batch, a position that is not its sequence's next one, or one past
  the context;
- a tokenizer with multi-byte pieces, so text can retokenise differently from the tokens that produced it.

Everything it is asked is recorded in `calls`, so tests can assert on batches, restores and cuts.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from barreld.engine.backend import BackendError, BatchItem, ContextSettings, ModelLoadError, resolve_flash_attn
from barreld.names import MemoryKind
from tests.fakes.memory import Cell, SeqMemory

STATE_MAGIC = 0xAF143CD8
_U32 = struct.Struct("<I")
_HEADER = struct.Struct("<Ii")  # magic, seq_id
_META = struct.Struct("<iIi")  # pos, n_seq_id, seq_id
_ROWS = struct.Struct("<iQ")  # ggml type, row size
_F32 = 0
_DIGEST = 16
_TOKEN = struct.Struct("<i")
_SECTIONS = {
    MemoryKind.FULL: ("kv",),
    MemoryKind.SWA: ("kv", "window"),
    MemoryKind.RECURRENT: ("recurrent",),
    MemoryKind.HYBRID: ("kv", "recurrent"),
}

PIECES = [
    b"the", b" the", b"The", b"ing", b" a", b"an", b"and", b" and", b"er", b"in", b"on", b"re", b"ed", b"to",
    b" to", b" of", b"is", b" is", b"it", b"at", b"or", b"en", b"th", b"he", b"hello", b" world", b"Hello",
    b"you", b" you", b"ab", b"abc", b"bc", b"cd", b"  ", b"\n\n", b". ", b", ", b"the ", b"ion", b"tion",
]
SPECIALS = [b"<s>", b"</s>", b"<|user|>", b"<|assistant|>", b"<|end|>"]
VOCAB = [bytes([b]) for b in range(256)] + PIECES + SPECIALS
BOS, EOS, USER, ASSISTANT, END = (VOCAB.index(s) for s in SPECIALS)
EOG = frozenset({EOS, END})
N_VOCAB = len(VOCAB)
FTYPE = 7  # Q8_0

_IDS = {p: i for i, p in enumerate(VOCAB)}
_LONGEST = max(len(p) for p in VOCAB)


def tokenize(data: bytes, bos: bool) -> list[int]:
    """Longest match first over the vocabulary, special tokens included, every byte a fallback."""
    out = [BOS] if bos else []
    i = 0
    while i < len(data):
        for n in range(min(_LONGEST, len(data) - i), 0, -1):
            token = _IDS.get(data[i : i + n])
            if token is not None:
                out.append(token)
                i += n
                break
    return out


def logits_of(digest: bytes) -> np.ndarray:
    """The logits a history digest stands for: pseudo-random values in [-4, 4), the same in every process."""
    raw = np.frombuffer(hashlib.shake_256(digest).digest(4 * N_VOCAB), dtype="<u4")
    return (raw / np.float32(2**29) - np.float32(4.0)).astype(np.float32)


@dataclass(frozen=True)
class Call:
    """One recorded backend operation: `decode` (items), `seq_rm` (seq, span), `state_get`, `state_set`."""

    op: str
    seq: int = -1
    items: tuple[BatchItem, ...] = ()
    span: tuple[int, int] = (0, 0)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def render_user_turn(text: bytes) -> bytes:
    """What CHAT_TEMPLATE makes of one user turn, written out by hand to check the renderer against."""
    return b"<|user|>" + text + b"<|end|>\n<|assistant|>"


class FakeBackend:
    """A model file stands in for weights: its bytes seed every logit, so two files are two models; its
    metadata says the memory kind (`write_gguf`)."""

    GATE_TIMEOUT = 30.0
    chat_template: str | None = CHAT_TEMPLATE
    bos_text = "<s>"
    eos_text = "</s>"
    mrope = False
    gpu_layers = 0

    def __init__(self, path: Path, settings: ContextSettings) -> None:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
        if data[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
        meta = read_meta(data)
        self.path = Path(path)
        self.n_ctx = settings.n_ctx
        self.n_batch = settings.n_batch
        self.n_seq_max = settings.n_seq_max
        self.n_vocab = N_VOCAB
        self.vocab = None  # no llama.cpp vocabulary: a grammar is refused
        self.ftype = FTYPE
        self.rope_freq_base = 10000.0
        self.rope_freq_scale = 1.0
        self.memory = MemoryKind(meta.get("fake.memory", "full"))
        self.swa_window = int(meta.get("fake.window", "0"))
        self.swa_full = settings.swa_full and self.swa_window > 0
        self.split_sensitive = meta.get("fake.split") == "1"
        self.beside_sensitive = meta.get("fake.beside") == "1"
        self.flash_attn = resolve_flash_attn(settings.flash_attn, self.memory, settings.swa_full)
        self.min_batch = max(int(meta.get("fake.min_batch", "2")), 64 if self.flash_attn else 2)
        slots = settings.n_ctx if self.swa_full else min(settings.n_ctx, self.swa_window + settings.n_batch)
        root = hashlib.sha256(data).digest()[:16]
        self.seqs = [SeqMemory(self.memory, root, self.swa_window, slots) for _ in range(settings.n_seq_max)]
        self.calls: list[Call] = []
        self.closed = False
        self._last: dict[int, np.ndarray] = {}
        self._failing: set[str] = set()
        self._gate = threading.Event()
        self._gate.set()
        self._waiting = threading.Event()

    # ---- tokens ---------------------------------------------------------------------------

    def tokenize(self, data: bytes, scope: bytes = b"") -> list[int]:
        return tokenize(data, bos=True)

    def tokenize_tail(self, data: bytes) -> list[int]:
        return tokenize(data, bos=False)

    def piece(self, token: int) -> bytes:
        if not 0 <= token < N_VOCAB:
            raise BackendError(f"token {token} is not in the vocabulary")
        return VOCAB[token]

    def is_eog(self, token: int) -> bool:
        return token in EOG

    # ---- evaluation -----------------------------------------------------------------------

    def decode(self, items: list[BatchItem]) -> None:
        self._pass_gate()
        self._check("decode")
        self._check_batch(items)
        self.calls.append(Call("decode", items=tuple(items)))
        runs: dict[int, list[int]] = {}
        for it in items:
            runs.setdefault(it.seq, []).append(it.pos)
        self._last = {}
        cut = len({len(run) for run in runs.values()}) > 1
        for i, it in enumerate(items):
            run = runs[it.seq]
            # llama.cpp cuts a batch of several sequences into micro-batches with equally many tokens of each:
            # beside one token of another sequence, a run's first token is in a micro-batch of its own. Runs of
            # equal length stay whole, each with its own floats, unless the model says otherwise.
            if cut and it.pos == run[0] and len(run) > 1:
                split = b"alone"
            else:
                split = self._split(run) + (b"beside" if self.beside_sensitive and len(runs) > 1 < len(run) else b"")
            digest = self.seqs[it.seq].add(it.pos, it.token, split)
            if it.logits:
                self._last[i] = logits_of(digest)
        if self.swa_window and not self.swa_full and len(runs) == 1 and len(items) > 1:
            self.seqs[items[0].seq].order_window()

    def _split(self, run: list[int]) -> bytes:
        """What of its batch a token's KV depends on: being alone, or on a split-sensitive model the run."""
        if self.split_sensitive:
            return struct.pack("<ii", run[0], len(run))
        if len(run) == 1:
            return b"alone"
        return struct.pack("<ii", run[0], len(run)) if len(run) < self.min_batch else b""

    def _check_batch(self, items: list[BatchItem]) -> None:
        """All of a batch is checked before any of it is applied: a refused batch changes nothing."""
        if not items or len(items) > self.n_batch:
            raise BackendError(f"batch of {len(items)} tokens (n_batch {self.n_batch})")
        expected: dict[int, int] = {}
        for it in items:
            self._seq(it.seq)
            if not 0 <= it.token < N_VOCAB:
                raise BackendError(f"token {it.token} is not in the vocabulary")
            want = expected.get(it.seq, self.seqs[it.seq].next_pos())
            if it.pos != want:
                raise BackendError(f"sequence {it.seq}: position {it.pos} given, {want} is next")
            if it.pos >= self.n_ctx:
                raise BackendError(f"sequence {it.seq}: position {it.pos} is past the context ({self.n_ctx})")
            expected[it.seq] = want + 1

    def logits(self, index: int) -> np.ndarray:
        row = self._last.get(index)
        if row is None:
            raise BackendError(f"no logits for batch position {index}")
        return row.copy()

    def row(self, index: int) -> np.ndarray:
        return self.logits(index)

    # ---- sequence state -------------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        self._check("seq_rm")
        memory = self._seq(seq)
        self.calls.append(Call("seq_rm", seq, span=(p0, p1)))
        memory.remove(max(p0, 0), p1)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        return self._seq(seq).pos_range()

    def state_get(self, seq: int) -> bytearray:
        memory = self._seq(seq)
        self.calls.append(Call("state_get", seq))
        out = bytearray(_HEADER.pack(STATE_MAGIC, seq))
        for section in _SECTIONS[self.memory]:
            if section == "recurrent":
                out += _recurrent_section(memory.tip)
            else:
                cells = memory.cells if section == "kv" else memory.saved_window()
                out += _kv_section(cells, self.n_seq_max, seq)
        return out

    def state_set(self, seq: int, data: memoryview) -> None:
        """Replaces the sequence's memory; bytes that are not a state of this model leave it empty."""
        target = self._seq(seq)
        self.calls.append(Call("state_set", seq))
        target.clear()
        self._check("state_set")
        parsed = _StateReader(bytes(data), self).read()
        target.load(parsed.get("kv", []), parsed.get("window", []), (parsed.get("recurrent") or [None])[-1])

    def close(self) -> None:
        self.closed = True

    # ---- for tests ------------------------------------------------------------------------

    def tokens(self, seq: int) -> list[int]:
        """The tokens in a sequence's attention cells, in position order."""
        return [c.token for c in self.seqs[seq].cells]

    def batches(self, seq: int | None = None) -> list[list[BatchItem]]:
        """Every decoded batch, in order, reduced to the items of `seq` (batches without it left out)."""
        out = []
        for call in self.calls:
            items = [it for it in call.items if seq is None or it.seq == seq]
            if call.op == "decode" and items:
                out.append(items)
        return out

    def ops(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    def fail_next(self, op: str) -> None:
        """The next `op` ("decode", "seq_rm" or "state_set") raises BackendError, as a refusal would."""
        self._failing.add(op)

    def hold(self) -> None:
        """Decodes wait until `release`: a request stays running, or queued behind one, while a test looks."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def wait_held(self, timeout: float = 10.0) -> bool:
        """Whether a decode reached the closed gate within `timeout` seconds."""
        return self._waiting.wait(timeout)

    def _pass_gate(self) -> None:
        if not self._gate.is_set():
            self._waiting.set()
            opened = self._gate.wait(self.GATE_TIMEOUT)
            self._waiting.clear()
            if not opened:
                raise BackendError(f"held for more than {self.GATE_TIMEOUT} s; a test forgot to release")

    def _check(self, op: str) -> None:
        if self.closed:
            raise BackendError("the backend is closed")
        if op in self._failing:
            self._failing.discard(op)
            raise BackendError(f"{op} failed (injected)")

    def _seq(self, seq: int) -> SeqMemory:
        if not 0 <= seq < self.n_seq_max:
            raise BackendError(f"sequence {seq} outside 0..{self.n_seq_max - 1}")
        return self.seqs[seq]


def _kv_section(cells: list[Cell], n_stream: int, seq: int) -> bytes:
    """A KV section as llama.cpp writes one: a count per stream, the cells in the sequence's own stream."""
    home = seq if n_stream > 1 else 0
    out = bytearray(_U32.pack(n_stream))
    for stream in range(n_stream):
        count = len(cells) if stream == home else 0
        out += _U32.pack(count)
        if count:
            out += b"".join(_META.pack(c.pos, 1, seq) for c in cells)
            out += struct.pack("<II", 0, 1)  # V not transposed, one layer
            out += _ROWS.pack(_F32, _DIGEST) + b"".join(c.digest for c in cells)
            out += _ROWS.pack(_F32, _TOKEN.size) + b"".join(_TOKEN.pack(c.token) for c in cells)
    return bytes(out)


def _recurrent_section(tip: Cell | None) -> bytes:
    cells = [tip] if tip is not None else []
    out = _U32.pack(len(cells)) + b"".join(struct.pack("<iI", c.pos, 0) for c in cells)
    out += struct.pack("<II", 0, 1)  # s_trans 0, one layer
    out += _ROWS.pack(_F32, _DIGEST) + b"".join(c.digest for c in cells)
    return out + _ROWS.pack(_F32, _TOKEN.size) + b"".join(_TOKEN.pack(c.token) for c in cells)


class _StateReader:
    """Reads a state `FakeBackend.state_get` could have written for this model; BackendError for anything else."""

    def __init__(self, raw: bytes, be: FakeBackend) -> None:
        self.raw, self.off, self.be = raw, 0, be

    def take(self, fmt: struct.Struct) -> tuple:
        if self.off + fmt.size > len(self.raw):
            raise BackendError(f"state of {len(self.raw)} bytes ends inside a field at byte {self.off}")
        values = fmt.unpack_from(self.raw, self.off)
        self.off += fmt.size
        return values

    def bytes(self, n: int) -> bytes:
        if self.off + n > len(self.raw):
            raise BackendError(f"state of {len(self.raw)} bytes ends inside its rows")
        self.off += n
        return self.raw[self.off - n : self.off]

    def read(self) -> dict[str, list[Cell]]:
        magic, _ = self.take(_HEADER)
        if magic != STATE_MAGIC:
            raise BackendError("not a sequence state (bad magic)")
        out = {name: self.section(name) for name in _SECTIONS[self.be.memory]}
        if self.off != len(self.raw):
            raise BackendError(f"{len(self.raw) - self.off} bytes after the state")
        return out

    def section(self, name: str) -> list[Cell]:
        if name == "recurrent":
            (count,) = self.take(_U32)
            if count > 1:
                raise BackendError(f"{count} recurrent cells for one sequence")
            positions = [self.take(struct.Struct("<iI"))[0] for _ in range(count)]
            self.rows_head(struct.Struct("<II"), (0, 1))
            return self.cells(positions)
        (n_stream,) = self.take(_U32)
        if n_stream != self.be.n_seq_max:
            raise BackendError(f"{n_stream} KV streams, the context has {self.be.n_seq_max}")
        cells: list[Cell] = []
        for _ in range(n_stream):
            (count,) = self.take(_U32)
            if count and cells:
                raise BackendError("cells in two streams")
            if count:
                positions = [self.take(_META)[0] for _ in range(count)]
                self.rows_head(struct.Struct("<II"), (0, 1))
                cells = self.cells(positions)
        return cells

    def rows_head(self, fmt: struct.Struct, want: tuple) -> None:
        if self.take(fmt) != want:
            raise BackendError("a state of another layout")

    def cells(self, positions: list[int]) -> list[Cell]:
        self.rows_head(_ROWS, (_F32, _DIGEST))
        digests = [self.bytes(_DIGEST) for _ in positions]
        self.rows_head(_ROWS, (_F32, _TOKEN.size))
        tokens = [self.take(_TOKEN)[0] for _ in positions]
        inside = not positions or 0 <= positions[0] <= positions[-1] < self.be.n_ctx
        if positions != sorted(set(positions)) or not inside:
            raise BackendError("state cells are out of order or outside the context")
        if any(not 0 <= t < N_VOCAB for t in tokens):
            raise BackendError("state holds a token outside the vocabulary")
        return [Cell(p, t, d) for p, t, d in zip(positions, tokens, digests, strict=True)]


def read_meta(data: bytes) -> dict[str, str]:
    """The string metadata of a GGUF that `write_gguf` wrote (other value types end the reading)."""
    out: dict[str, str] = {}
    off = 24
    (n_kv,) = struct.unpack_from("<Q", data, 16)
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, off)
        key = data[off + 8 : off + 8 + n].decode()
        off += 8 + n
        (vtype,) = struct.unpack_from("<I", data, off)
        if vtype != 8:
            break
        (n,) = struct.unpack_from("<Q", data, off + 4)
        out[key] = data[off + 12 : off + 12 + n].decode()
        off += 12 + n
    return out


def write_gguf(
    path: Path, name: str = "fake", memory: MemoryKind = MemoryKind.FULL, window: int = 0, split: bool = False,
    min_batch: int = 0, beside: bool = False,
) -> Path:
    """A minimal valid GGUF v3 (string metadata, one small tensor), so the real fingerprint code reads it; the
    metadata names the memory kind, its sliding window, whether logits depend on the batch split, the fewest
    tokens a batch needs for a token's usual floats, and whether a prefill's floats depend on other sequences
    beside it in the call."""

    def string(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s

    kv = [(b"general.architecture", b"fake"), (b"general.name", name.encode())]
    if memory is not MemoryKind.FULL or window or split:
        kv += [(b"fake.memory", str(memory).encode()), (b"fake.window", str(window).encode()),
               (b"fake.split", b"1" if split else b"0")]
    if min_batch:
        kv += [(b"fake.min_batch", str(min_batch).encode())]
    if beside:
        kv += [(b"fake.beside", b"1")]
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv))
    head += b"".join(string(k) + struct.pack("<I", 8) + string(v) for k, v in kv)
    head += string(b"token_embd.weight") + struct.pack("<IQIQ", 1, 8, 0, 0)  # 1 dim of 8, F32, offset 0
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + np.arange(8, dtype=np.float32).tobytes())
    return path
