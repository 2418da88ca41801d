"""RemoteTier: the cache's shared tier, beneath the local ones, on a RedisStore that is trusted for nothing.

Objects of one checkpoint row (every value also carries RedisStore's header and checksum, bound to its name):
  row    key = row key, tag = row key: a small JSON description of the row (its metadata, its parts, in
         order, with their lengths, and its prefix aliases), enough to list rows without reading payloads
  ckpt   key = row key, tag = row key: the row's own checkpoint file. With blocks, this is the local
         tiers' format 2 row (tail, carried sections, logits, the chain of block keys); else a whole state
  blk    key = block key, tag = block key: one content-addressed block file (`barreld.cache.blocks`), shared
         by every row whose prompt starts with its tokens. Its own tag spreads blocks over a cluster's slots
  alias  key = prefix key, tag = prefix key: {"n": tokens of the prefix, "row": the row's description},
         so a host finds another host's checkpoint by a prefix of its prompt, in the same round trip
         as the exact key. An alias is tagged with its own key, since a reader knows only that key; the
         row and its ckpt part share the row's hash slot.

A mirror asks Redis which of a row's objects it holds (one pipelined TOUCH: a block another row still uses
is kept recent under Redis's LRU) and writes only the missing ones: blocks first, then the ckpt part and
the row, then the aliases. A restore fetches the ckpt part and only the blocks the local tiers lack, in one
round trip; a local block that is gone by the time it is read costs one more. Whatever a reader finds
missing, cut short or damaged is a miss, counted and logged once a minute per kind: the request is served
from a cold prefill instead.

Eviction. Redis may evict any value at any moment (maxmemory with an LRU policy), whatever Barrel counts, and
hosts cannot count references to a block together without a transaction spanning slots, which a cluster
refuses. So a missing block is a miss, never a wrong reply, and `evict` deletes the rows it picks and then
the blocks no remaining row names; a row another host publishes meanwhile that names such a block is a miss
until it is mirrored again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from barreld.names import REDIS_TIER, MemoryKind

from .. import blocks, stateformat
from ..checkpoint import Buffer, Checkpoint, decode, encode_parts, encoded_size
from ..errors import CorruptCheckpoint
from ..index import Hit, valid_aliases
from .redis import ROW_KIND, OncePerPeriod, RedisStore, Ref, RemoteObject

log = logging.getLogger("barreld.cache.redis")

ROW_FORMATS: tuple[int, ...] = (1, 2)
"""Row descriptions this host reads: 1 names one ckpt part, 2 (written now) may name blocks after it."""
CKPT_KIND = "ckpt"
BLOCK_KIND = "blk"
ALIAS_KIND = "alias"
PART_KINDS: tuple[str, ...] = (CKPT_KIND, BLOCK_KIND)
REQUEST_MISSES: tuple[str, ...] = ("absent", "missing", "corrupt", "unreachable")
"""Why a request that asked the remote got nothing: no probe found a row; a part had vanished; a value
or the assembled checkpoint failed verification; Redis could not be asked."""
BATCH = 500
"""Objects per round trip when listing or deleting many rows."""

Part = tuple[str, bytes, int]


class LocalBlocks(Protocol):
    """The blocks this host's own tiers hold, offered to a remote restore so that it fetches only the rest."""

    def has(self, key: bytes) -> bool:
        """Whether a local tier names the block (cheap: the index only)."""

    def read(self, key: bytes) -> memoryview:
        """The block's verified payload; CorruptCheckpoint, OSError or KeyError when it cannot be had."""


class _BlockMissing(CorruptCheckpoint):
    """A block the row names is in neither Redis nor a local tier."""


def part_ref(kind: str, key: bytes, row_key: bytes) -> Ref:
    """Where a row's part lives: its ckpt under the row's hash tag, a block under its own (shared by rows)."""
    return Ref(kind, key, None if kind == BLOCK_KIND else row_key)


@dataclass(frozen=True)
class RemoteHit(Hit):
    """A lookup's find in the remote tier: also the parts (kind, key, length) to fetch for it."""

    parts: tuple[Part, ...] = ()
    block_tokens: int = 0  # tokens per block of a row of blocks (0: a whole state)

    @property
    def blocks_needed(self) -> int:
        """The leading blocks that cover its first n_tokens: a prefix hit needs no more of a row's blocks."""
        named = len(self.parts) - 1
        return named if not self.block_tokens else min(named, -(-self.n_tokens // self.block_tokens))


@dataclass(frozen=True)
class RowInfo:
    """What a row's value says about its checkpoint (the alias values carry it too)."""

    key: bytes
    model: str
    fingerprint: bytes
    tokens: int
    text_bytes: int
    save_reason: str
    created: float
    parts: tuple[Part, ...]
    frontier: int = 0  # leading tokens its state holds reusably; 0 (a row that does not say): none
    block_tokens: int = 0

    @classmethod
    def of(cls, ckpt: Checkpoint) -> RowInfo:
        """A row as stored: its own file, then the blocks its chain names (none for a whole state)."""
        chain = ckpt.chain
        named = [(BLOCK_KIND, key, chain.block_size) for key in chain.keys] if chain is not None else []
        return cls(ckpt.key, ckpt.model, ckpt.fingerprint, len(ckpt.tokens), len(ckpt.rendered), ckpt.save_reason,
                   ckpt.created, ((CKPT_KIND, ckpt.key, encoded_size(ckpt)), *named), ckpt.frontier_tokens,
                   chain.block_tokens if chain is not None else 0)

    def as_json(self) -> dict[str, Any]:
        return {"v": ROW_FORMATS[-1], "key": self.key.hex(), "model": self.model, "fingerprint": self.fingerprint.hex(),
                "tokens": self.tokens, "text_bytes": self.text_bytes, "save_reason": self.save_reason,
                "created": self.created, "parts": [[k, key.hex(), n] for k, key, n in self.parts],
                "frontier": self.frontier, "block_tokens": self.block_tokens}

    @classmethod
    def from_json(cls, d: Any) -> RowInfo:
        """Raises ValueError (or KeyError, TypeError) for anything but a well-formed description."""
        if d["v"] not in ROW_FORMATS:
            raise ValueError(f"row format {d['v']!r}")
        parts = tuple((str(k), bytes.fromhex(key), int(n)) for k, key, n in d["parts"])
        info = cls(bytes.fromhex(d["key"]), str(d["model"]), bytes.fromhex(d["fingerprint"]), int(d["tokens"]),
                   int(d["text_bytes"]), str(d["save_reason"]), float(d["created"]), parts, int(d.get("frontier", 0)),
                   int(d.get("block_tokens", 0)))
        if (len(info.key) != 32 or not parts or parts[0][:2] != (CKPT_KIND, info.key) or info.tokens < 1
                or any(k != BLOCK_KIND or len(key) != 32 or n < 1 for k, key, n in parts[1:])):
            raise ValueError("malformed row description")
        return info

    @property
    def size(self) -> int:
        return sum(n for _, _, n in self.parts)

    @property
    def own_size(self) -> int:
        """Bytes of its ckpt part: what deleting the row frees, its shared blocks aside."""
        return self.parts[0][2]

    @property
    def block_keys(self) -> list[bytes]:
        return [key for _, key, _ in self.parts[1:]]

    def hit(self, n_tokens: int) -> RemoteHit:
        return RemoteHit(self.key, n_tokens, REDIS_TIER, self.tokens, self.text_bytes, self.frontier, self.parts,
                         self.block_tokens)


@dataclass
class _Listed:
    """One row as `dump` and `evict` see it: its value's size, description, aliases and idle time."""

    obj: RemoteObject
    info: RowInfo
    aliases: list[bytes]
    idle_s: int | None

    @property
    def size(self) -> int:
        return self.obj.size + self.info.size

    def refs(self) -> list[Ref]:
        """Its own objects (row, ckpt part, aliases): the blocks are shared, deleted only once no row names them."""
        return [Ref(ROW_KIND, self.info.key), Ref(CKPT_KIND, self.info.key, self.info.key),
                *(Ref(ALIAS_KIND, a) for a in self.aliases)]


def _decode_row(raw: memoryview, key: bytes) -> tuple[RowInfo, list[bytes]]:
    d = json.loads(bytes(raw))
    info = RowInfo.from_json(d)
    if info.key != key:
        raise ValueError("row value names another key")
    return info, [bytes.fromhex(a) for a, _ in d["aliases"]]


def _decode_alias(raw: memoryview) -> tuple[RowInfo, int]:
    d = json.loads(bytes(raw))
    info, n = RowInfo.from_json(d["row"]), int(d["n"])
    if not 0 < n <= info.tokens:
        raise ValueError(f"alias of {n} tokens into a row of {info.tokens}")
    return info, n


class RemoteTier:
    """Mirror published checkpoints, find and fetch other hosts' ones; every call is safe from any thread
    and returns a miss (never raises) when Redis is away or lies."""

    def __init__(self, store: RedisStore, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self._warn = OncePerPeriod(clock)
        self._lock = threading.Lock()
        self._counts: dict[str, Any] = dict.fromkeys(
            ("probes", "hits", "mirrors", "mirrors_present", "mirrors_failed", "mirrors_dropped", "blocks_written",
             "blocks_skipped", "bytes_skipped", "blocks_fetched", "blocks_local", "bytes_local"), 0)
        self._counts["misses"] = dict.fromkeys(REQUEST_MISSES, 0)

    def __repr__(self) -> str:
        return f"RemoteTier({self.store!r})"

    @property
    def writes(self) -> bool:
        return self.store.settings.write

    def close(self) -> None:
        self.store.close()

    # ---- writing ------------------------------------------------------------------------------

    def mirror(self, row: Checkpoint, payloads: Mapping[bytes, Buffer] | None = None) -> bool:
        """Write what Redis lacks of a published row (run on a writer thread): its blocks (`payloads`, by key,
        for a row of blocks), its ckpt part, the row, its aliases. True when Redis holds all of them now."""
        if not self.writes:
            return False
        info = RowInfo.of(row)
        refs = [part_ref(k, key, row.key) for k, key, _ in info.parts]
        present = self.store.exists_refs([Ref(ROW_KIND, row.key), *refs], touch=True)
        blocks_there = [(key, n) for (k, key, n), there in zip(info.parts, present[1:], strict=True)
                        if k == BLOCK_KIND and there]
        self._count("blocks_skipped", len(blocks_there), bytes_skipped=sum(n for _, n in blocks_there))
        if all(present):
            self._count("mirrors_present")
            return True
        missing = {key for (_, key, _), there in zip(info.parts[1:], present[2:], strict=True) if not there}
        new_blocks = [(BLOCK_KIND, key, blocks.encode_block(key, (payloads or {})[key])) for key in info.block_keys
                      if key in missing]
        done = self.store.put_many(new_blocks)
        if done:
            self._count("blocks_written", len(new_blocks))
        aliases = valid_aliases(row.key, len(row.tokens), row.prefixes)
        description = info.as_json()
        own = [] if present[1] else [(CKPT_KIND, row.key, encode_parts(row))]
        done = done and self.store.publish_row(
            row.key, own, _json({**description, "aliases": [[a.hex(), n] for a, n in aliases]})
        ) and self.store.put_many([(ALIAS_KIND, a, _json({"n": n, "row": description})) for a, n in aliases])
        self._count("mirrors" if done else "mirrors_failed")
        return done

    def dropped(self) -> None:
        """A mirror the writer pool had no room for."""
        self._count("mirrors_dropped")

    # ---- reading ------------------------------------------------------------------------------

    def probe(self, keys: Sequence[bytes]) -> list[RemoteHit | None]:
        """For each key, the row stored under it or the row its prefix alias names: one round trip."""
        refs = [ref for key in keys for ref in (Ref(ROW_KIND, key), Ref(ALIAS_KIND, key))]
        replies = self.store.fetch_refs(refs, probe=True)
        hits: list[RemoteHit | None] = []
        for i, key in enumerate(keys):
            (row, _), (alias, _) = replies[2 * i], replies[2 * i + 1]
            hits.append(self._row_hit(key, row) if row is not None else None)
            if hits[-1] is None and alias is not None:
                hits[-1] = self._alias_hit(key, alias)
        self._count("probes")
        if not any(hits):
            unreachable = any(why == "unreachable" for _, why in replies)
            self._miss("unreachable" if unreachable else "absent", None)
        return hits

    def _row_hit(self, key: bytes, raw: memoryview) -> RemoteHit | None:
        try:
            info, _ = _decode_row(raw, key)
        except (ValueError, KeyError, TypeError) as e:
            self._miss("corrupt", f"row {key.hex()} does not describe a row ({e})")
            return None
        return info.hit(info.tokens)

    def _alias_hit(self, key: bytes, raw: memoryview) -> RemoteHit | None:
        try:
            info, n = _decode_alias(raw)
        except (ValueError, KeyError, TypeError) as e:
            self._miss("corrupt", f"alias {key.hex()} does not name a row ({e})")
            return None
        return info.hit(n)

    def fetch(self, hit: RemoteHit, local: LocalBlocks | None = None) -> Checkpoint | None:
        """The hit's whole checkpoint, every value's checksum, the file's and its key verified; None (counted,
        and the row dropped from Redis when it is damaged or incomplete) for a miss. The blocks `local` holds
        are read from it; the ckpt part and every other block come in one round trip."""
        wanted = [key for key in _block_keys(hit)[: hit.blocks_needed] if local is None or not local.has(key)]
        fetched = self.store.fetch_refs([part_ref(CKPT_KIND, hit.row_key, hit.row_key),
                                         *(Ref(BLOCK_KIND, key) for key in wanted)])
        why = next((w for _, w in fetched if w is not None), None)
        if why is None and len(fetched[0][0]) != hit.parts[0][2]:
            why = "corrupt"
        if why is not None:
            return self._failed_fetch(hit, why, f"a part of row {hit.row_key.hex()} is {why}")
        got = {key: view for key, (view, _) in zip(wanted, fetched[1:], strict=True)}
        try:
            ckpt, used = self._assembled(hit, fetched[0][0], got, local)
        except CorruptCheckpoint as e:
            why = "missing" if isinstance(e, _BlockMissing) else "corrupt"
            return self._failed_fetch(hit, why, f"row {hit.row_key.hex()}: {e}")
        here = [key for key in used if key not in got]
        self._count("hits", blocks_fetched=len(got), blocks_local=len(here),
                    bytes_local=len(here) * (hit.parts[1][2] if here else 0))
        return ckpt

    def _assembled(self, hit: RemoteHit, own: memoryview, got: dict[bytes, memoryview],
                   local: LocalBlocks | None) -> tuple[Checkpoint, tuple[bytes, ...]]:
        """The checkpoint from its own file and its blocks (fetched, else local, else fetched now; `got` gains
        each one fetched), into a buffer of its own: a promotion's async save may still read it after the next
        restore. Also the keys of the blocks it was assembled from.

        For a prefix hit on full attention, only the blocks that cover the prefix: their cells alone are the
        prefix's state (causal attention), without the row's tail and its own logits (the logits after earlier
        prompts within the prefix stay)."""
        ckpt = decode(own)
        ckpt.check_key()
        chain = ckpt.chain
        if (ckpt.key != hit.row_key or len(ckpt.tokens) != hit.total_tokens
                or list(chain.keys if chain is not None else ()) != _block_keys(hit)):
            raise CorruptCheckpoint("the checkpoint does not match its row")
        if chain is None:
            return ckpt, ()
        if hit.blocks_needed < len(chain.keys) and not chain.opaque and ckpt.memory == MemoryKind.FULL.value:
            frontier = hit.blocks_needed * chain.block_tokens
            ckpt = replace(ckpt, state=b"", chain=replace(chain, keys=chain.keys[: hit.blocks_needed], tail=0),
                           logits=None, logits_at=None, frontier=frontier,
                           prompt_logits=tuple(row for row in ckpt.prompt_logits if row[0] <= frontier))
            chain = ckpt.chain
        rest = [key for key in chain.keys if key not in got and (local is None or not local.has(key))]
        for key, (view, _) in zip(rest, self.store.fetch_refs([Ref(BLOCK_KIND, key) for key in rest]), strict=True):
            if view is not None:
                got[key] = view

        def load(i: int) -> memoryview:
            key = chain.keys[i]
            view = got.get(key)
            if view is None and local is not None:
                try:
                    return local.read(key)
                except (CorruptCheckpoint, OSError, KeyError):
                    pass  # evicted or damaged here since `has`: Redis may still hold it
            if view is None:
                [(view, why)] = self.store.fetch_refs([Ref(BLOCK_KIND, key)])
                if view is None:
                    raise _BlockMissing(f"block {i} of {len(chain.keys)} is {why}")
                got[key] = view
            return blocks.decode_block(view, key)

        whole = blocks.assemble(ckpt, load, out=bytearray)
        return replace(whole, layout=stateformat.shape_from_json(chain.shape)), chain.keys

    def _failed_fetch(self, hit: RemoteHit, why: str, message: str) -> None:
        self._miss(why, message)
        if why != "unreachable":
            self._drop(hit)

    def _drop(self, hit: RemoteHit) -> None:
        """Delete a row found broken (its ckpt part too; its blocks are shared, and a damaged one was deleted
        when it was read), so no host probes it again until one mirrors it anew."""
        self.store.delete_refs([Ref(ROW_KIND, hit.row_key), part_ref(CKPT_KIND, hit.row_key, hit.row_key)])

    # ---- operations ---------------------------------------------------------------------------

    def dump(self, fingerprints: Mapping[bytes, str] | None = None) -> list[dict] | None:
        """Rows as `cache dump` shows them, most recently used first: all of Barrel's under the prefix, or
        those of the given fingerprints, named as given. None when Redis could not be read."""
        listed = self._list()
        if listed is None:
            return None
        now = time.time()
        out = []
        for r in sorted(listed, key=lambda r: (r.idle_s is None, r.idle_s or 0, -r.info.created)):
            if fingerprints is not None and r.info.fingerprint not in fingerprints:
                continue
            out.append({"key": r.info.key.hex(), "model": (fingerprints or {}).get(r.info.fingerprint, r.info.model),
                        "tier": REDIS_TIER, "size": r.size, "tokens": r.info.tokens, "text_bytes": r.info.text_bytes,
                        "save_reason": r.info.save_reason, "status": "available", "refcount": 0, "hits": 0,
                        "last_used": now - r.idle_s if r.idle_s is not None else r.info.created,
                        "created": r.info.created, "location": self.store.name(Ref(ROW_KIND, r.info.key)).decode()})
        return out

    def evict(self, need: float) -> tuple[int, int] | None:
        """Delete the least recently used rows (their ckpt parts and aliases too), and the blocks no remaining
        row names, until `need` bytes are freed or no row is left: (rows, bytes). None when Redis could not
        be read or told."""
        listed, stored = self._list(), self.store.scan(BLOCK_KIND)
        if listed is None or stored is None:
            return None
        listed.sort(key=lambda r: (r.idle_s is not None, -(r.idle_s or 0), r.info.created))
        chosen, doomed, freed = _pick(listed, {o.key: o.size for o in stored}, need)
        for batch in _batches(chosen, BATCH // 4):
            if self.store.delete_refs([ref for r in batch for ref in r.refs()]) is None:
                return None
        for keys in _batches(doomed, BATCH):
            if self.store.delete_refs([Ref(BLOCK_KIND, key) for key in keys]) is None:
                return None
        return len(chosen), freed

    def gc(self) -> int | None:
        """Delete every one of Barrel's objects under the prefix (every host's rows): the rows deleted, or
        None when Redis could not be read or told."""
        objects = self.store.scan()
        if objects is None:
            return None
        for batch in _batches(objects, BATCH):
            if self.store.delete_refs([Ref(o.kind, o.key, o.tag) for o in batch]) is None:
                return None
        return sum(o.kind == ROW_KIND for o in objects)

    def _list(self) -> list[_Listed] | None:
        rows = self.store.scan(ROW_KIND)
        if rows is None:
            return None
        listed = []
        for batch in _batches(rows, BATCH):
            refs = [Ref(ROW_KIND, o.key) for o in batch]
            values = self.store.fetch_refs(refs)
            for obj, (raw, _) in zip(batch, values, strict=True):
                try:
                    info, aliases = _decode_row(raw, obj.key) if raw is not None else (None, [])
                except (ValueError, KeyError, TypeError):
                    info = None  # a damaged value; gc removes it
                if info is not None:
                    listed.append(_Listed(obj, info, aliases, obj.idle_s))
        return listed

    # ---- counters -----------------------------------------------------------------------------

    def _count(self, name: str, n: int = 1, **more: int) -> None:
        with self._lock:
            self._counts[name] += n
            for other, m in more.items():
                self._counts[other] += m

    def _miss(self, kind: str, message: str | None) -> None:
        with self._lock:
            self._counts["misses"][kind] += 1
        if message is not None:
            self._warn.warn(f"miss:{kind}", f"redis {self.store.settings.redacted_url}: {message}; a miss")

    def stats(self) -> dict[str, Any]:
        """The tier's own counters over the store's (values, bytes, errors by kind), after one PING."""
        self.store.ping()
        store = self.store.stats()
        with self._lock:
            mine = {**self._counts, "misses": dict(self._counts["misses"])}
        return {"url": self.store.settings.redacted_url, "prefix": self.store.settings.prefix, "write": self.writes,
                **{k: v for k, v in store.items() if k not in ("hits", "misses")},
                "value_hits": store["hits"], "value_misses": store["misses"], **mine}


def _pick(listed: list[_Listed], block_sizes: dict[bytes, int], need: float) -> tuple[list[_Listed], list[bytes], int]:
    """Rows to delete, in `listed` order, and the blocks that leaves unnamed (those no row named to begin
    with first), until their bytes reach `need`: (rows, blocks, bytes)."""
    names = Counter(key for r in listed for key in r.info.block_keys)
    doomed = [key for key in block_sizes if not names[key]]
    freed = sum(block_sizes[key] for key in doomed)
    chosen: list[_Listed] = []
    for r in listed:
        if freed >= need:
            break
        chosen.append(r)
        freed += r.obj.size + r.info.own_size
        for key in r.info.block_keys:
            names[key] -= 1
            if not names[key] and key in block_sizes:
                doomed.append(key)
                freed += block_sizes[key]
    return chosen, doomed, freed


def _block_keys(hit: RemoteHit) -> list[bytes]:
    return [key for _, key, _ in hit.parts[1:]]


def _json(d: dict) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode()


def _batches(items: Sequence, n: int) -> Iterable[Sequence]:
    return (items[i : i + n] for i in range(0, len(items), n))
