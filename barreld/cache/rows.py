"""How the index encodes what it stores: rows (formats 1 to 4, the older ones read for the upgrade), the lru and
prefix entries a row implies, and block entries.

A row's lru entry is u8 tier rank || u64 BE last_used_ns || key(32), so the least recently used rows of a
tier are the first entries of its range; a prefix entry's value is u8 tier rank || u32 BE tokens || row
key(32) || u32 BE n_tokens, so the best row for a prefix (fastest tier, then fewest tokens) sorts first.
"""

from __future__ import annotations

import heapq
import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import lmdb

from barreld.names import TIER_NAMES, TIER_RANK

INDEX_FORMAT = 4
_ROW_STRINGS = {2: 6, 3: 6, INDEX_FORMAT: 8}

RESERVED = "reserved"
AVAILABLE = "available"
STATUS_CODES = {RESERVED: 0, AVAILABLE: 1}
STATUSES = {code: name for name, code in STATUS_CODES.items()}

_ROW_HEAD_2 = struct.Struct("<BBqIqqQdqIII")
_ROW_HEAD = struct.Struct("<BBqIqqQdqIIIIQ")
BLOCK_ENTRY = struct.Struct("<IQB")
"""A block entry: refs, size, written."""
_ROW_ALIAS = struct.Struct("<32sI")
_LRU = struct.Struct(">BQ32s")
RANKED = struct.Struct(">BI32sI")
"""A prefix entry's value: tier rank, tokens, row key, n_tokens."""
U32 = struct.Struct("<I")
TIERS = ",".join(TIER_NAMES).encode()
"""The tier names in the rank order the keys use, as the meta table records them."""
_NO_RANK = 255  # a tier this version does not know sorts after every known one


class RowFormatError(ValueError):
    """A stored row that this code cannot read: it is dropped, never guessed at."""


@dataclass(slots=True)
class Row:
    """One checkpoint's index entry. `owner`/`token` identify the writer holding a reservation."""

    key: bytes
    model: str
    tier: str
    size: int
    tokens: int
    text_bytes: int
    save_reason: str
    status: str
    hits: int = 0
    last_used_ns: int = 0
    created: float = 0.0
    location: str | None = None
    owner: int = 0
    token: str = ""
    aliases: tuple[tuple[bytes, int], ...] = ()
    memory: str = "full"  # the model's memory kind
    frontier: int = 0  # leading tokens the state holds reusably (the key covers all `tokens`)
    blocks: tuple[bytes, ...] = ()  # keys of the blocks its payload names, in order (none: a whole state)
    block_size: int = 0  # bytes each of them holds in the tier
    tenant: str = ""  # who wrote it ("": the default tenant)
    namespace: bytes = b""  # the namespace digest its key was derived in (none: the default namespace)

    @property
    def stored_bytes(self) -> int:
        """Bytes the row's payload and blocks take, as if none of its blocks were shared."""
        return self.size + len(self.blocks) * self.block_size

    def encode(self) -> bytes:
        """Format 4: `_ROW_HEAD` (format, status, numbers, string, alias and block counts, frontier, block
        size), then model, tier, save_reason, location ('' for none), token, memory kind, tenant and namespace
        (hex) joined by NUL, which none of them can hold, then the (alias key, n_tokens) pairs, then the block
        keys. Binary, so open decodes a large index quickly. (Format 3 is the same without the last two
        strings.)"""
        strings = "\0".join(
            (self.model, self.tier, self.save_reason, self.location or "", self.token, self.memory, self.tenant,
             self.namespace.hex())
        ).encode()
        head = _ROW_HEAD.pack(
            INDEX_FORMAT,
            STATUS_CODES[self.status],
            self.size,
            self.tokens,
            self.text_bytes,
            self.hits,
            self.last_used_ns,
            self.created,
            self.owner,
            len(strings),
            len(self.aliases),
            self.frontier,
            len(self.blocks),
            self.block_size,
        )
        return b"".join((head, strings, *(_ROW_ALIAS.pack(a, n) for a, n in self.aliases), *self.blocks))

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> Row:
        """The row stored under `key`; RowFormatError for anything but a well-formed format 2, 3 or 4 row."""
        head, fields, end = unpack(key, raw)
        model, tier, save_reason, location, token, memory, tenant, namespace = (*fields, "", "")[:8]
        try:
            digest = bytes.fromhex(namespace)
        except ValueError:
            digest = b"-"
        if len(digest) not in (0, 32):
            raise RowFormatError(f"index row {bytes(key).hex()} names a malformed namespace")
        blocks_at = end + head[10] * _ROW_ALIAS.size
        return cls(
            key=bytes(key),
            model=model,
            tier=tier,
            size=head[2],
            tokens=head[3],
            text_bytes=head[4],
            save_reason=save_reason,
            status=STATUSES[head[1]],
            hits=head[5],
            last_used_ns=head[6],
            created=head[7],
            location=location or None,
            owner=head[8],
            token=token,
            aliases=tuple(_ROW_ALIAS.iter_unpack(raw[end:blocks_at])),
            memory=memory,
            frontier=head[11],
            blocks=tuple(bytes(raw[i : i + 32]) for i in range(blocks_at, len(raw), 32)),
            block_size=head[13],
            tenant=tenant,
            namespace=digest,
        )



def unpack(key: bytes, raw: bytes) -> tuple[tuple, list[str], int]:
    """A format 3 or 4 row's `_ROW_HEAD` fields (a format 2 row's, with no blocks), its strings (six, eight in
    format 4) and where its aliases start; RowFormatError for anything else."""
    try:
        fmt = _ROW_HEAD if raw[:1] in (b"\3", bytes((INDEX_FORMAT,))) else _ROW_HEAD_2
        head = fmt.unpack_from(raw)
        if fmt is _ROW_HEAD_2:
            head += (0, 0)
        end = fmt.size + head[9]
        fields = raw[fmt.size : end].decode().split("\0")
    except (struct.error, UnicodeDecodeError) as e:
        raise RowFormatError(f"unreadable index row {bytes(key).hex()}: {e}") from None
    if head[1] not in STATUSES or len(fields) != _ROW_STRINGS.get(head[0]):
        raise RowFormatError(f"index row {bytes(key).hex()} is not a format 2 to {INDEX_FORMAT} row")
    if len(raw) != end + head[10] * _ROW_ALIAS.size + head[12] * 32:
        raise RowFormatError(f"index row {bytes(key).hex()} has a torn alias or block list")
    return head, fields, end


def _decode_v1(key: bytes, raw: bytes) -> Row:
    """A row as format 1 stored it (JSON, aliases as [hex, n] pairs), checked by a format 2 round trip."""
    try:
        d = json.loads(raw)
        d["aliases"] = tuple((bytes.fromhex(k), int(n)) for k, n in d["aliases"])
        return Row.decode(key, Row(key=bytes(key), **d).encode())
    except (ValueError, TypeError, KeyError, AttributeError, struct.error) as e:
        raise RowFormatError(f"unreadable format 1 index row {bytes(key).hex()}: {e}") from None


def decode_any(key: bytes, raw: bytes) -> Row:
    """A row of any known format: format 1 rows are JSON objects, format 2 and 3 rows start with that byte."""
    return _decode_v1(key, raw) if raw[:1] == b"{" else Row.decode(key, raw)


def rank(tier: str) -> int:
    """A tier's place in the keys of the lru, prefixes and blocks tables: the faster, the lower."""
    return TIER_RANK.get(tier, _NO_RANK)


def lru_key(row: Row | None) -> bytes | None:
    """A row's lru entry; reserved rows have none (they are never victims)."""
    if row is None or row.status != AVAILABLE:
        return None
    return _LRU.pack(rank(row.tier), row.last_used_ns, row.key)


def prefix_entries(row: Row | None) -> set[tuple[bytes, bytes]]:
    """A row's (prefix key, ranked value) entries; reserved rows have none (they cannot be served)."""
    if row is None or row.status != AVAILABLE:
        return set()
    tier_rank = rank(row.tier)
    return {(alias, RANKED.pack(tier_rank, row.tokens, row.key, n)) for alias, n in row.aliases}


def block_id(tier: str, key: bytes) -> bytes:
    """A block's id: its entry key in the blocks table and its gone mark, tier rank then block key. The
    same block stored in two tiers has two ids."""
    return bytes((rank(tier),)) + key


def valid_aliases(key: bytes, tokens: int, aliases: Iterable[tuple[bytes, int]]) -> tuple[tuple[bytes, int], ...]:
    """The aliases worth indexing for a row of `tokens` tokens: proper prefixes, no self-alias, sorted."""
    return tuple(sorted({(bytes(a), int(n)) for a, n in aliases if bytes(a) != key and 0 < int(n) <= tokens}))


@dataclass
class LruWalk:
    """An eviction's place in LRU order across `tiers`: rows used after `until` are left alone, and a
    batch resumes after `after` (last_used_ns BE || key of the last entry looked at)."""

    tiers: tuple[str, ...]
    until: int = (1 << 64) - 1
    after: bytes = b""

    def entries(self, txn: lmdb.Transaction, db: lmdb._Database) -> Iterator[bytes]:
        """(last_used_ns BE || key) of the lru entries past `after`, least recently used first."""
        return heapq.merge(*(self._range(txn, db, rank) for rank in sorted({rank(t) for t in self.tiers})))

    def _range(self, txn: lmdb.Transaction, db: lmdb._Database, rank: int) -> Iterator[bytes]:
        prefix = bytes((rank,))
        cur = txn.cursor(db=db)
        if not cur.set_range(prefix + self.after):
            return
        for entry in cur.iternext(values=False):
            if entry[:1] != prefix:
                return
            if entry[1:] != self.after:
                yield entry[1:]
