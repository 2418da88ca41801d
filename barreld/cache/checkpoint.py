"""The checkpoint file format: one sequence's KV state plus everything that rebuilds its key.

Layout (all integers little-endian; offsets derive from the header's lengths):

    0   8  magic b"BRLKV\\r\\n\\x1a"
    8   4  u32 format version (FORMAT_VERSION)
    12  4  u32 flags (bit 0: logits present; bit 1: earlier prompts' logits follow them)
    16  8  u64 file length, trailer included
    24  4  u32 metadata length M
    28  4  u32 token count N
    32  8  u64 rendered length R
    40  8  u64 state length S
    48  8  u64 logits length L (a multiple of 4: float32)
    56  8  zero (reserved)
    64  M  metadata: UTF-8 JSON {key, model, fingerprint, quant, ctx_params, save_reason, created, prefixes,
                                    memory, frontier, logits_at (when the logits do not follow every token),
                                    prompt_logits (bit 1: after how many tokens each further row was taken),
                                    chain (format 2 only, see `Chain`), tenant and namespace (a
                                    tenant's row only, see `key.Namespace`)}
        ..  zero padding to 8
        4N tokens, int32
        R  rendered prompt bytes
        ..  zero padding to 64
        S  state
        ..  zero padding to 64
        L  logits: rows of float32 of one length, its own (bit 0) first, then one per prompt_logits entry
    end-16  16  xxh3_128 of every byte before it

The state starts 64-byte aligned within the file so the engine can hand it to ctypes as is.

Format 1 holds the whole state. Format 2 is a checkpoint stored as blocks: its state section holds only the
tail (attention cells after the last whole block) and the sections that cannot be cut, and `chain` names the
blocks, stored apart, that complete it. A reader of format 1 refuses format 2, so no older build ever takes
a row's remainder for a whole state.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash

from barreld.names import SAVE_REASONS, MemoryKind

from .errors import CorruptCheckpoint
from .key import KeyScheme

FORMAT_VERSION = 1
CHAIN_FORMAT = 2
MAGIC = b"BRLKV\r\n\x1a"

_HEADER = struct.Struct("<8sIIQIIQQQQ")
_TRAILER_LEN = 16
_FLAG_LOGITS = 1
_FLAG_PROMPT_LOGITS = 2
MIN_FILE_LEN = _HEADER.size + _TRAILER_LEN
HEADER_BYTES = _HEADER.size

Buffer = bytes | bytearray | memoryview

# Tokens are written as the host's array('i'), and state and logits as the engine hands them over:
# the file format is little-endian, so a big-endian host must not write it.
if sys.byteorder != "little" or array("i").itemsize != 4:
    raise ImportError("barreld.cache needs a little-endian host with a 32-bit C int")


@dataclass(frozen=True)
class Chain:
    """Where a format 2 checkpoint's KV is: `keys` of its whole blocks of `block_tokens` cells (`block_size`
    bytes each, stored apart, shared by every checkpoint with the same prefix), the state's shape and sequence
    to assemble them with, and how its own state section splits into the tail and the carried sections."""

    block_tokens: int
    block_size: int
    keys: tuple[bytes, ...]
    shape: dict
    seq_id: int
    tail: int
    opaque: tuple[int, ...]

    def to_json(self) -> dict:
        return {"block_tokens": self.block_tokens, "block_size": self.block_size,
                "keys": [k.hex() for k in self.keys], "shape": self.shape, "seq_id": self.seq_id,
                "tail": self.tail, "opaque": list(self.opaque)}

    @classmethod
    def from_json(cls, d: dict) -> Chain:
        keys = tuple(bytes.fromhex(k) for k in d["keys"])
        if any(len(k) != 32 for k in keys) or int(d["block_tokens"]) < 1 or int(d["block_size"]) < 1:
            raise ValueError("a chain of malformed block keys or sizes")
        return cls(int(d["block_tokens"]), int(d["block_size"]), keys, dict(d["shape"]), int(d["seq_id"]),
                   int(d["tail"]), tuple(int(n) for n in d["opaque"]))


@dataclass
class Checkpoint:
    """One sequence's KV state and the metadata that proves which prompt it belongs to.

    `state` and `logits` may be large; the format never copies them on encode, and `decode` returns them
    as memoryviews into the buffer it was given. `prefixes` are (prefix key, token count) aliases under
    which this checkpoint is also findable; they travel in the file so a restart can rebuild them.
    `logits_at` says after how many tokens the logits were taken (None: after all of them); a finish
    checkpoint keeps its prompt's, so resending that prompt samples without evaluating anything.
    `prompt_logits` are (token count, logits) of earlier prompts its text holds, taken when each was prefilled:
    a conversation's rows supersede each other, and its earlier prompts, resent (an agent's session replayed
    after a restart), sample from them.
    `frontier` says how many leading tokens the state holds reusably (None: all of them): the key covers the
    whole text (a finish checkpoint's generated reply too), the state only what was prefilled. `memory` is
    the model's memory kind, which decides whether the state can serve a shorter prefix. `chain`, on a
    checkpoint stored as blocks, names them (then `state` is only its own part); `layout` is the model's state
    shape, handed to the store so that it can cut the state into blocks (never written). `tenant` wrote it, and
    `namespace` (a digest, empty for the default namespace) is part of its key and its blocks' keys.
    """

    key: bytes
    model: str
    fingerprint: bytes
    quant: str
    ctx_params: bytes
    rendered: bytes
    tokens: array | Sequence[int]
    save_reason: str
    created: float
    state: Buffer
    logits: Buffer | None = None
    prefixes: Sequence[tuple[bytes, int]] = field(default_factory=tuple)
    logits_at: int | None = None
    prompt_logits: Sequence[tuple[int, Buffer]] = ()
    frontier: int | None = None
    memory: str = MemoryKind.FULL.value
    chain: Chain | None = None
    layout: object = None
    tenant: str = ""
    namespace: bytes = b""

    @property
    def logits_tokens(self) -> int:
        """How many leading tokens the stored logits follow."""
        return len(self.tokens) if self.logits_at is None else self.logits_at

    def logits_after(self, n: int) -> Buffer | None:
        """The stored logits that follow the first n tokens; None when none were kept there."""
        if self.logits is not None and self.logits_tokens == n:
            return self.logits
        return next((row for at, row in self.prompt_logits if at == n), None)

    @property
    def frontier_tokens(self) -> int:
        """How many leading tokens the state holds reusably."""
        return len(self.tokens) if self.frontier is None else self.frontier

    @classmethod
    def build(
        cls,
        scheme: KeyScheme,
        model: str,
        rendered: bytes,
        tokens: array | Sequence[int],
        save_reason: str,
        state: Buffer,
        logits: Buffer | None = None,
        prefixes: Sequence[tuple[bytes, int]] = (),
        tenant: str = "",
    ) -> Checkpoint:
        """A checkpoint whose key is computed from the scheme (and its namespace), stamped with the current time."""
        return cls(
            key=scheme.key(rendered),
            model=model,
            fingerprint=scheme.fingerprint,
            quant=scheme.quant,
            ctx_params=scheme.ctx_params,
            rendered=bytes(rendered),
            tokens=tokens,
            save_reason=save_reason,
            created=time.time(),
            state=state,
            logits=logits,
            prefixes=tuple(prefixes),
            tenant=tenant,
            namespace=scheme.namespace,
        )

    def key_scheme(self) -> KeyScheme:
        """The scheme recorded in this checkpoint."""
        return KeyScheme(self.fingerprint, self.quant, self.ctx_params, self.namespace)

    def check_key(self) -> None:
        """Raise CorruptCheckpoint unless `key` is what the recorded metadata and prompt hash to."""
        try:
            expected = self.key_scheme().key(self.rendered)
        except ValueError as e:
            raise CorruptCheckpoint(f"metadata does not form a key scheme: {e}") from e
        if expected != self.key:
            raise CorruptCheckpoint("stored key does not match the key recomputed from the contents")
        chain = self.chain
        if chain is not None:
            whole = len(chain.keys) * chain.block_tokens
            if whole > self.frontier_tokens or self.key_scheme().block_keys(
                self.tokens, chain.block_tokens, len(chain.keys)
            ) != list(chain.keys):
                raise CorruptCheckpoint("the block keys are not the chain of the checkpoint's tokens")


def _pad(n: int, align: int) -> int:
    return -n % align


@dataclass
class _Plan:
    head: bytes
    tokens: bytes
    rendered: memoryview
    state: memoryview
    logits: list[memoryview]
    length: int


def _check(ckpt: Checkpoint, n_tokens: int) -> None:
    """Refuses fields that would write a file `decode` rejects."""
    if ckpt.save_reason not in SAVE_REASONS:
        raise ValueError(f"save_reason {ckpt.save_reason!r} is not one of {', '.join(SAVE_REASONS)}")
    if len(ckpt.key) != 32 or len(ckpt.fingerprint) != 32 or len(ckpt.namespace) not in (0, 32):
        raise ValueError("key and fingerprint must be 32 bytes each, and a namespace 32 bytes or none")
    if ckpt.memory not in set(MemoryKind) or not 0 <= ckpt.frontier_tokens <= n_tokens:
        raise ValueError(f"memory {ckpt.memory!r} and frontier {ckpt.frontier} do not describe the state")


def _logits_of(ckpt: Checkpoint, n_tokens: int) -> tuple[list[memoryview], list[int]]:
    """The logits rows to write, the checkpoint's own first, and the token counts of its earlier prompts'."""
    own = [] if ckpt.logits is None else [ckpt.logits]
    rows = [memoryview(row).cast("B") for row in [*own, *(row for _, row in ckpt.prompt_logits)]]
    if any(len(row) % 4 or len(row) != len(rows[0]) for row in rows):
        raise ValueError("logits must be rows of float32 (a multiple of 4 bytes), all of one length")
    points = [int(at) for at, _ in ckpt.prompt_logits]
    if not all(0 < at <= n_tokens for at in points):
        raise ValueError(f"prompt logits after {points} tokens, outside the {n_tokens} tokens")
    return rows, points


def _plan(ckpt: Checkpoint) -> _Plan:
    """Validate a checkpoint and lay it out; cheap (no payload bytes are touched)."""
    tokens = ckpt.tokens if isinstance(ckpt.tokens, array) and ckpt.tokens.typecode == "i" else None
    if tokens is None:
        tokens = array("i", ckpt.tokens)
    _check(ckpt, len(tokens))
    rendered = memoryview(ckpt.rendered).cast("B")
    state = memoryview(ckpt.state).cast("B")
    logits, points = _logits_of(ckpt, len(tokens))
    extra = {} if ckpt.logits_at is None else {"logits_at": int(ckpt.logits_at)}
    if points:
        extra["prompt_logits"] = points
    if ckpt.namespace or ckpt.tenant:
        extra |= {"tenant": ckpt.tenant, "namespace": bytes(ckpt.namespace).hex()}
    meta = json.dumps(
        {
            **extra,
            "key": ckpt.key.hex(),
            "model": ckpt.model,
            "fingerprint": ckpt.fingerprint.hex(),
            "quant": ckpt.quant,
            "ctx_params": bytes(ckpt.ctx_params).hex(),
            "save_reason": ckpt.save_reason,
            "created": float(ckpt.created),
            "prefixes": [[bytes(k).hex(), int(n)] for k, n in ckpt.prefixes],
            "memory": ckpt.memory,
            "frontier": ckpt.frontier_tokens,
            **({"chain": ckpt.chain.to_json()} if ckpt.chain is not None else {}),
        },
        separators=(",", ":"),
    ).encode()
    l_len = sum(len(row) for row in logits)
    offsets = _offsets(len(meta), len(tokens), len(rendered), len(state), l_len)
    length = offsets[-1] + _TRAILER_LEN
    flags = (_FLAG_LOGITS if ckpt.logits is not None else 0) | (_FLAG_PROMPT_LOGITS if points else 0)
    header = _HEADER.pack(
        MAGIC,
        FORMAT_VERSION if ckpt.chain is None else CHAIN_FORMAT,
        flags,
        length,
        len(meta),
        len(tokens),
        len(rendered),
        len(state),
        l_len,
        0,
    )
    head = header + meta + bytes(_pad(len(meta), 8))
    tokens_part = tokens.tobytes()
    return _Plan(head, tokens_part, rendered, state, logits, length)


def _offsets(meta: int, n_tokens: int, rendered: int, state: int, logits: int) -> tuple[int, ...]:
    """Start of tokens, rendered, state, logits, and of the trailer."""
    tokens_at = _HEADER.size + meta + _pad(meta, 8)
    rendered_at = tokens_at + 4 * n_tokens
    state_at = rendered_at + rendered + _pad(rendered_at + rendered, 64)
    logits_at = state_at + state + _pad(state_at + state, 64)
    return tokens_at, rendered_at, state_at, logits_at, logits_at + logits


def encoded_size(ckpt: Checkpoint) -> int:
    """The file size `encode_parts` will produce, without hashing anything."""
    return _plan(ckpt).length


def encode_parts(ckpt: Checkpoint) -> list[Buffer]:
    """The file as a list of buffers for `writelines`/`os.writev`: the 35 MB state is never copied."""
    p = _plan(ckpt)
    parts: list[Buffer] = [p.head, p.tokens, p.rendered]
    end = len(p.head) + len(p.tokens) + len(p.rendered)
    for payload in (p.state, p.logits[0] if p.logits else b""):
        if _pad(end, 64):
            parts.append(bytes(_pad(end, 64)))
            end += _pad(end, 64)
        parts.append(payload)
        end += len(payload)
    parts += p.logits[1:]
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    parts.append(h.digest())
    return parts


def _chain_of(meta: dict, version: int, state_len: int) -> Chain | None:
    """A format 2 file's chain, which its state section (tail and carried sections) must fit exactly."""
    chain = Chain.from_json(meta["chain"]) if version == CHAIN_FORMAT else None
    if ("chain" in meta) != (chain is not None) or (chain and chain.tail + sum(chain.opaque) != state_len):
        raise ValueError(f"a format {version} file with a chain that does not fit it")
    return chain


def rendered_span(head: Buffer) -> tuple[int, int]:
    """Where the rendered text lies in a checkpoint file, from its first HEADER_BYTES bytes: (start, end).
    Unverified (the checksum covers the whole file): for showing a stored text, never for a restore."""
    mv = memoryview(head).cast("B")
    if len(mv) < _HEADER.size:
        raise CorruptCheckpoint(f"file too short ({len(mv)} bytes)")
    magic, version, _flags, _length, meta_len, n_tokens, r_len, s_len, l_len, _zero = _HEADER.unpack_from(mv)
    if magic != MAGIC or version not in (FORMAT_VERSION, CHAIN_FORMAT):
        raise CorruptCheckpoint("not a checkpoint file")
    _tokens_at, rendered_at, *_ = _offsets(meta_len, n_tokens, r_len, s_len, l_len)
    return rendered_at, rendered_at + r_len


def _logit_rows(section: memoryview, flags: int, meta: dict, n_tokens: int
                ) -> tuple[memoryview | None, tuple[tuple[int, memoryview], ...]]:
    """The logits section split into the checkpoint's own row (flag bit 0) and earlier prompts' rows (bit 1,
    one per `prompt_logits` entry), every row of one length."""
    points = list(meta["prompt_logits"]) if flags & _FLAG_PROMPT_LOGITS else []
    if not all(type(at) is int for at in points):
        raise ValueError(f"prompt logits after {points} tokens: not token counts")
    if (flags & _FLAG_PROMPT_LOGITS) != ("prompt_logits" in meta and _FLAG_PROMPT_LOGITS) or (
            flags & _FLAG_PROMPT_LOGITS and not points) or not all(0 < at <= n_tokens for at in points):
        raise ValueError(f"prompt logits after {points} tokens do not fit the flags or the {n_tokens} tokens")
    rows = bool(flags & _FLAG_LOGITS) + len(points)
    size = len(section) // rows if rows else 0
    if rows and (len(section) % rows or size % 4):
        raise ValueError(f"{len(section)} bytes of logits do not make {rows} rows of float32")
    cut = [section[i * size : (i + 1) * size] for i in range(rows)]
    own = cut.pop(0) if flags & _FLAG_LOGITS else None
    return own, tuple(zip(points, cut, strict=True))


def _verified_header(mv: memoryview) -> tuple[int, int, int, int, int, int, int]:
    """A whole file's checksum and header checked: (version, flags, metadata, token, rendered, state and
    logits lengths)."""
    if len(mv) < MIN_FILE_LEN:
        raise CorruptCheckpoint(f"file too short ({len(mv)} bytes)")
    if xxhash.xxh3_128(mv[:-_TRAILER_LEN]).digest() != mv[-_TRAILER_LEN:]:
        raise CorruptCheckpoint("checksum mismatch")
    magic, version, flags, length, meta_len, n_tokens, r_len, s_len, l_len, zero = _HEADER.unpack_from(mv)
    if magic != MAGIC:
        raise CorruptCheckpoint("bad magic")
    if version not in (FORMAT_VERSION, CHAIN_FORMAT):
        raise CorruptCheckpoint(f"unsupported format version {version}")
    if length != len(mv) or zero != 0 or flags & ~(_FLAG_LOGITS | _FLAG_PROMPT_LOGITS) or l_len % 4:
        raise CorruptCheckpoint("header fields inconsistent with the file")
    return version, flags, meta_len, n_tokens, r_len, s_len, l_len


def decode(buf: Buffer) -> Checkpoint:
    """Verify a whole checkpoint file and decode it; state and logits are zero-copy views into `buf`.

    The checksum and every length field are checked before anything is interpreted, so a file that
    fails in any byte raises CorruptCheckpoint and no part of it is ever used.
    """
    mv = memoryview(buf).cast("B")
    version, flags, meta_len, n_tokens, r_len, s_len, l_len = _verified_header(mv)
    tokens_at, rendered_at, state_at, logits_at, end = _offsets(meta_len, n_tokens, r_len, s_len, l_len)
    if end + _TRAILER_LEN != len(mv) or (l_len and not flags & (_FLAG_LOGITS | _FLAG_PROMPT_LOGITS)):
        raise CorruptCheckpoint("section lengths do not add up to the file length")
    try:
        meta = json.loads(bytes(mv[_HEADER.size : _HEADER.size + meta_len]))
        tokens = array("i")
        tokens.frombytes(mv[tokens_at:rendered_at])
        frontier, memory = int(meta.get("frontier", n_tokens)), MemoryKind(meta.get("memory", MemoryKind.FULL))
        if not 0 <= frontier <= n_tokens:
            raise ValueError(f"frontier {frontier} outside the {n_tokens} tokens")
        chain = _chain_of(meta, version, s_len)
        own, earlier = _logit_rows(mv[logits_at : logits_at + l_len], flags, meta, n_tokens)
        return Checkpoint(
            key=bytes.fromhex(meta["key"]),
            model=meta["model"],
            fingerprint=bytes.fromhex(meta["fingerprint"]),
            quant=meta["quant"],
            ctx_params=bytes.fromhex(meta["ctx_params"]),
            rendered=bytes(mv[rendered_at : rendered_at + r_len]),
            tokens=tokens,
            save_reason=meta["save_reason"],
            created=float(meta["created"]),
            state=mv[state_at : state_at + s_len],
            logits=own,
            prefixes=tuple((bytes.fromhex(k), int(n)) for k, n in meta["prefixes"]),
            logits_at=int(meta["logits_at"]) if "logits_at" in meta else None,
            prompt_logits=earlier,
            frontier=frontier,
            memory=memory.value,
            chain=chain,
            tenant=str(meta.get("tenant", "")), namespace=bytes.fromhex(meta.get("namespace", "")),
        )
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise CorruptCheckpoint(f"bad metadata: {e}") from e
