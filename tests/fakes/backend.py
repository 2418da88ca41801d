"""A deterministic stand-in for llama.cpp behind the Backend protocol, so the engine is tested in milliseconds.

What it keeps from llama.cpp, because the engine's correctness depends on it:
- the logits at a position are a function of the sequence's whole token history up to it (held in its
  cells), so a wrong restore or a wrong cut changes the logits and the greedy reply;
- a sequence's logits from a batch holding exactly one of its tokens differ from the same position computed
  in a larger batch (llama.cpp evaluates one-token batches through another kernel path);
- `state_get` writes exactly the sequence's cells, `state_set` refuses foreign or malformed bytes, and
  `seq_rm` drops positions as full attention does;
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

from barreld.engine.backend import BackendError, BatchItem, ContextSettings, ModelLoadError

STATE_MAGIC = 0xFA4E5EC1
STATE_VERSION = 1
_HEADER = struct.Struct("<IIII")  # magic, version, n_vocab, cell count
_CELL = struct.Struct("<ii")  # pos, token

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


ONE_TOKEN_SHIFT = logits_of(b"one token per batch") / np.float32(4.0)
"""Added to a sequence's logits when the batch held only one of its tokens."""


class Cells:
    """One sequence's KV cells: position -> token, in position order, each with the digest of its history.

    The one place memory semantics live: which positions a removal drops and which cells a saved state
    holds. A sliding-window or recurrent memory overrides `remove` and `saved`.
    """

    def __init__(self, root: bytes) -> None:
        self.root = root
        self.cells: list[tuple[int, int]] = []
        self.digests: list[bytes] = []

    def next_pos(self) -> int:
        return self.cells[-1][0] + 1 if self.cells else 0

    def add(self, pos: int, token: int) -> bytes:
        """Appends a cell; returns the digest of the history up to and including it."""
        self.cells.append((pos, token))
        self.digests.append(self._digest(self.digests[-1] if self.digests else self.root, pos, token))
        return self.digests[-1]

    def remove(self, p0: int, p1: int) -> None:
        """Drops positions p0 <= pos < p1 (p1 < 0: to the end); the later cells' histories change."""
        end = p1 if p1 >= 0 else 1 << 62
        self.load([c for c in self.cells if not p0 <= c[0] < end])

    def saved(self) -> list[tuple[int, int]]:
        """The cells a saved state holds."""
        return list(self.cells)

    def load(self, cells: list[tuple[int, int]]) -> None:
        self.cells, self.digests = [], []
        for pos, token in cells:
            self.add(pos, token)

    @staticmethod
    def _digest(prev: bytes, pos: int, token: int) -> bytes:
        return hashlib.blake2b(prev + _CELL.pack(pos, token), digest_size=16).digest()


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
    """A model file stands in for weights: its bytes seed every logit, so two files are two models."""

    GATE_TIMEOUT = 30.0
    chat_template: str | None = CHAT_TEMPLATE
    bos_text = "<s>"
    eos_text = "</s>"

    def __init__(self, path: Path, settings: ContextSettings) -> None:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ModelLoadError(f"cannot read {path}: {exc.strerror}") from None
        if data[:4] != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
        self.path = Path(path)
        self.n_ctx = settings.n_ctx
        self.n_batch = settings.n_batch
        self.n_seq_max = settings.n_seq_max
        self.n_vocab = N_VOCAB
        self.ftype = FTYPE
        self.rope_freq_base = 10000.0
        self.rope_freq_scale = 1.0
        root = hashlib.sha256(data).digest()[:16]
        self.seqs = [Cells(root) for _ in range(settings.n_seq_max)]
        self.calls: list[Call] = []
        self.closed = False
        self._last: dict[int, np.ndarray] = {}
        self._failing: set[str] = set()
        self._gate = threading.Event()
        self._gate.set()
        self._waiting = threading.Event()

    # ---- tokens ---------------------------------------------------------------------------

    def tokenize(self, data: bytes) -> list[int]:
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
        per_seq: dict[int, int] = {}
        for it in items:
            per_seq[it.seq] = per_seq.get(it.seq, 0) + 1
        self._last = {}
        for i, it in enumerate(items):
            digest = self.seqs[it.seq].add(it.pos, it.token)
            if it.logits:
                row = logits_of(digest)
                self._last[i] = row + ONE_TOKEN_SHIFT if per_seq[it.seq] == 1 else row

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

    # ---- sequence state -------------------------------------------------------------------

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        self._check("seq_rm")
        cells = self._seq(seq)
        self.calls.append(Call("seq_rm", seq, span=(p0, p1)))
        cells.remove(max(p0, 0), p1)

    def state_get(self, seq: int) -> bytearray:
        cells = self._seq(seq).saved()
        self.calls.append(Call("state_get", seq))
        out = bytearray(_HEADER.pack(STATE_MAGIC, STATE_VERSION, N_VOCAB, len(cells)))
        for pos, token in cells:
            out += _CELL.pack(pos, token)
        return out

    def state_set(self, seq: int, data: memoryview) -> None:
        """Replaces the sequence's cells; bytes that are not a state of this vocabulary leave it empty."""
        target = self._seq(seq)
        self.calls.append(Call("state_set", seq))
        target.load([])
        self._check("state_set")
        target.load(self._parse(bytes(data)))

    def _parse(self, raw: bytes) -> list[tuple[int, int]]:
        if len(raw) < _HEADER.size:
            raise BackendError(f"state of {len(raw)} bytes is shorter than its header")
        magic, version, n_vocab, count = _HEADER.unpack_from(raw)
        if magic != STATE_MAGIC or version != STATE_VERSION or n_vocab != N_VOCAB:
            raise BackendError("not a state of this model (magic, version or vocabulary differ)")
        if len(raw) != _HEADER.size + count * _CELL.size:
            raise BackendError(f"state of {len(raw)} bytes does not hold its {count} cells")
        cells = [_CELL.unpack_from(raw, _HEADER.size + i * _CELL.size) for i in range(count)]
        positions = [p for p, _ in cells]
        if positions != sorted(set(positions)) or (cells and not 0 <= positions[0] <= positions[-1] < self.n_ctx):
            raise BackendError("state cells are out of order or outside the context")
        if any(not 0 <= t < N_VOCAB for _, t in cells):
            raise BackendError("state holds a token outside the vocabulary")
        return cells

    def close(self) -> None:
        self.closed = True

    # ---- for tests ------------------------------------------------------------------------

    def tokens(self, seq: int) -> list[int]:
        """The tokens in a sequence's cells, in position order."""
        return [t for _, t in self.seqs[seq].cells]

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

    def _seq(self, seq: int) -> Cells:
        if not 0 <= seq < self.n_seq_max:
            raise BackendError(f"sequence {seq} outside 0..{self.n_seq_max - 1}")
        return self.seqs[seq]


def write_gguf(path: Path, name: str = "fake") -> Path:
    """A minimal valid GGUF v3 (two metadata keys, one small tensor), so the real fingerprint code reads it."""

    def string(s: bytes) -> bytes:
        return struct.pack("<Q", len(s)) + s

    kv = [(b"general.architecture", b"fake"), (b"general.name", name.encode())]
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, len(kv))
    head += b"".join(string(k) + struct.pack("<I", 8) + string(v) for k, v in kv)
    head += string(b"token_embd.weight") + struct.pack("<IQIQ", 1, 8, 0, 0)  # 1 dim of 8, F32, offset 0
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + np.arange(8, dtype=np.float32).tobytes())
    return path
