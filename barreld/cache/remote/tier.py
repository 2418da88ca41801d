"""RemoteTier: the cache's shared tier, beneath the local ones, on a RedisStore that is trusted for nothing.

Objects of one checkpoint row (every value also carries RedisStore's header and checksum):
  row    key = row key, tag = row key: a small JSON description of the row (its metadata, its parts, in
         order, with their lengths, and its prefix aliases), enough to list rows without reading payloads
  ckpt   key = row key, tag = row key: a part, today the one part of a row, the whole checkpoint file
  alias  key = prefix key, tag = prefix key: {"n": tokens of the prefix, "row": the row's description},
         so a host finds another host's checkpoint by a prefix of its prompt, in the same round trip
         as the exact key. An alias is tagged with its own key, since a reader knows only that key; the
         row and its parts share the row's hash slot.

A row's parts are a list so that a later format can split the payload into shared block values (their own
kind and keys) without changing how rows, aliases and lookups work; the row is written only after all its
parts, the aliases after the row. Whatever a reader finds missing, cut short or damaged is a miss, counted
and logged once a minute per kind: the request is served from a cold prefill instead.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from barreld.names import REDIS_TIER

from ..checkpoint import Checkpoint, decode, encode_parts, encoded_size
from ..errors import CorruptCheckpoint
from ..index import Hit, valid_aliases
from .redis import ROW_KIND, OncePerPeriod, RedisStore, Ref, RemoteObject

log = logging.getLogger("barreld.cache.redis")

ROW_FORMAT = 1
CKPT_KIND = "ckpt"
ALIAS_KIND = "alias"
PART_KINDS: tuple[str, ...] = (CKPT_KIND,)
REQUEST_MISSES: tuple[str, ...] = ("absent", "missing", "corrupt", "unreachable")
"""Why a request that asked the remote got nothing: no probe found a row; a part had vanished; a value
or the assembled checkpoint failed verification; Redis could not be asked."""
BATCH = 500
"""Objects per round trip when listing or deleting many rows."""

Part = tuple[str, bytes, int]


@dataclass(frozen=True)
class RemoteHit(Hit):
    """A lookup's find in the remote tier: also the parts (kind, key, length) to fetch for it."""

    parts: tuple[Part, ...] = ()


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

    @classmethod
    def of(cls, ckpt: Checkpoint) -> RowInfo:
        return cls(ckpt.key, ckpt.model, ckpt.fingerprint, len(ckpt.tokens), len(ckpt.rendered),
                   ckpt.save_reason, ckpt.created, ((CKPT_KIND, ckpt.key, encoded_size(ckpt)),), ckpt.frontier_tokens)

    def as_json(self) -> dict[str, Any]:
        return {"v": ROW_FORMAT, "key": self.key.hex(), "model": self.model, "fingerprint": self.fingerprint.hex(),
                "tokens": self.tokens, "text_bytes": self.text_bytes, "save_reason": self.save_reason,
                "created": self.created, "parts": [[k, key.hex(), n] for k, key, n in self.parts],
                "frontier": self.frontier}

    @classmethod
    def from_json(cls, d: Any) -> RowInfo:
        """Raises ValueError (or KeyError, TypeError) for anything but a well-formed description."""
        if d["v"] != ROW_FORMAT:
            raise ValueError(f"row format {d['v']!r}")
        parts = tuple((str(k), bytes.fromhex(key), int(n)) for k, key, n in d["parts"])
        info = cls(bytes.fromhex(d["key"]), str(d["model"]), bytes.fromhex(d["fingerprint"]), int(d["tokens"]),
                   int(d["text_bytes"]), str(d["save_reason"]), float(d["created"]), parts, int(d.get("frontier", 0)))
        if (len(info.key) != 32 or not parts or info.tokens < 1
                or any(k not in PART_KINDS or len(key) != 32 or n < 1 for k, key, n in parts)):
            raise ValueError("malformed row description")
        return info

    @property
    def size(self) -> int:
        return sum(n for _, _, n in self.parts)

    def hit(self, n_tokens: int) -> RemoteHit:
        return RemoteHit(self.key, n_tokens, REDIS_TIER, self.tokens, self.text_bytes, self.frontier, self.parts)


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
        return ([Ref(ROW_KIND, self.info.key), *(Ref(k, key, self.info.key) for k, key, _ in self.info.parts)]
                + [Ref(ALIAS_KIND, a) for a in self.aliases])


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
            ("probes", "hits", "mirrors", "mirrors_present", "mirrors_failed", "mirrors_dropped"), 0)
        self._counts["misses"] = dict.fromkeys(REQUEST_MISSES, 0)

    def __repr__(self) -> str:
        return f"RemoteTier({self.store!r})"

    @property
    def writes(self) -> bool:
        return self.store.settings.write

    def close(self) -> None:
        self.store.close()

    # ---- writing ------------------------------------------------------------------------------

    def mirror(self, ckpt: Checkpoint) -> bool:
        """Write a published checkpoint's parts that Redis lacks, then its row, then its aliases (run on a
        writer thread); True when Redis holds all of them now."""
        if not self.writes:
            return False
        info = RowInfo.of(ckpt)
        parts = [Ref(k, key, ckpt.key) for k, key, _ in info.parts]
        present = self.store.exists_refs([Ref(ROW_KIND, ckpt.key), *parts])
        if all(present):
            self._count("mirrors_present")
            return True
        aliases = valid_aliases(ckpt.key, len(ckpt.tokens), ckpt.prefixes)
        row = {**info.as_json(), "aliases": [[a.hex(), n] for a, n in aliases]}
        missing = [(ref.kind, ref.key, encode_parts(ckpt)) for ref, there in zip(parts, present[1:], strict=True)
                   if not there]
        description = info.as_json()
        done = self.store.publish_row(ckpt.key, missing, _json(row)) and self.store.put_many(
            [(ALIAS_KIND, a, _json({"n": n, "row": description})) for a, n in aliases])
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

    def fetch(self, hit: RemoteHit) -> Checkpoint | None:
        """The hit's checkpoint, every part's and the whole file's checksum and its key verified; None
        (counted, and the row dropped from Redis when it is damaged or incomplete) for a miss."""
        fetched = self.store.fetch_refs([Ref(k, key, hit.row_key) for k, key, _ in hit.parts])
        why = next((w for _, w in fetched if w is not None), None)
        if why is None and any(len(p) != n for (p, _), (_, _, n) in zip(fetched, hit.parts, strict=True)):
            why = "corrupt"
        if why is not None:
            self._miss(why, f"a part of row {hit.row_key.hex()} is {why}")
            if why != "unreachable":
                self._drop(hit)
            return None
        pieces = [p for p, _ in fetched]
        try:
            ckpt = decode(pieces[0] if len(pieces) == 1 else b"".join(pieces))
            ckpt.check_key()
            if ckpt.key != hit.row_key or len(ckpt.tokens) != hit.total_tokens:
                raise CorruptCheckpoint("the checkpoint does not match its row")
        except CorruptCheckpoint as e:
            self._miss("corrupt", f"row {hit.row_key.hex()}: {e}")
            self._drop(hit)
            return None
        self._count("hits")
        return ckpt

    def _drop(self, hit: RemoteHit) -> None:
        """Delete a row found broken, so no host probes it again until one mirrors it anew."""
        self.store.delete_refs([Ref(ROW_KIND, hit.row_key), *(Ref(k, key, hit.row_key) for k, key, _ in hit.parts)])

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
        """Delete the least recently used rows (parts and aliases too) until `need` bytes are freed or no
        row is left: (rows, bytes). None when Redis could not be read or told."""
        listed = self._list()
        if listed is None:
            return None
        listed.sort(key=lambda r: (r.idle_s is not None, -(r.idle_s or 0), r.info.created))
        chosen, freed = [], 0
        for r in listed:
            if freed >= need:
                break
            chosen.append(r)
            freed += r.size
        for batch in _batches(chosen, BATCH // 4):
            if self.store.delete_refs([ref for r in batch for ref in r.refs()]) is None:
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
            idle = self.store.idle_seconds(refs)
            for obj, (raw, _), idle_s in zip(batch, values, idle, strict=True):
                try:
                    info, aliases = _decode_row(raw, obj.key) if raw is not None else (None, [])
                except (ValueError, KeyError, TypeError):
                    info = None  # a damaged value; gc removes it
                if info is not None:
                    listed.append(_Listed(obj, info, aliases, idle_s))
        return listed

    # ---- counters -----------------------------------------------------------------------------

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

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


def _json(d: dict) -> bytes:
    return json.dumps(d, separators=(",", ":")).encode()


def _batches(items: Sequence, n: int) -> Iterable[Sequence]:
    return (items[i : i + n] for i in range(0, len(items), n))
