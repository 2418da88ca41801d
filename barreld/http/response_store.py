"""Stored responses of the Responses API (`store: true`): each response's document, the conversation it ends (so
that `previous_response_id` can continue it) and the cache key of its state (the continuation's parent key).

One SQLite file in the data directory, so a response outlives a restart; each row belongs to one tenant, and
another tenant's id reads as unknown. Past the quota the oldest responses go first.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from barreld.engine.chat import Message
from barreld.engine.tools import ToolCall

DEFAULT_QUOTA = 256 << 20  # bytes of stored responses, all tenants together
SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    id TEXT NOT NULL, tenant TEXT NOT NULL, created REAL NOT NULL, size INTEGER NOT NULL,
    doc TEXT NOT NULL, history TEXT NOT NULL, key TEXT NOT NULL, PRIMARY KEY (tenant, id))"""


@dataclass(frozen=True)
class Stored:
    doc: dict[str, Any]  # the response as GET returns it
    history: tuple[Message, ...]  # the conversation, its instructions left out, ending with this response's reply
    key: str  # the state after the reply, as hex: a parent key


class ResponseStore:
    """`path` None keeps responses in memory only (a daemon without a data directory, in tests)."""

    def __init__(self, path: Path | None, quota: int = DEFAULT_QUOTA) -> None:
        self.quota = quota
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(SCHEMA)

    def put(self, tenant: str, stored: Stored) -> None:
        doc, history = json.dumps(stored.doc), json.dumps([_message_doc(m) for m in stored.history])
        size = len(doc) + len(history)
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (stored.doc["id"], tenant, time.time(), size, doc, history, stored.key))
            self._trim()

    def get(self, tenant: str, response_id: str) -> Stored | None:
        with self._lock:
            row = self._db.execute("SELECT doc, history, key FROM responses WHERE tenant = ? AND id = ?",
                                   (tenant, response_id)).fetchone()
        if row is None:
            return None
        return Stored(json.loads(row[0]), tuple(_message(d) for d in json.loads(row[1])), row[2])

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, response_id))
        return cur.rowcount > 0

    def _trim(self) -> None:
        """Drops the oldest responses until the rest fit the quota."""
        total = self._db.execute("SELECT COALESCE(SUM(size), 0) FROM responses").fetchone()[0]
        for tenant, rid, size in self._db.execute(
                "SELECT tenant, id, size FROM responses ORDER BY created").fetchall():
            if total <= self.quota:
                break
            self._db.execute("DELETE FROM responses WHERE tenant = ? AND id = ?", (tenant, rid))
            total -= size

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _message_doc(m: Message) -> dict[str, Any]:
    return {"role": m.role, "content": m.content, "tool_call_id": m.tool_call_id,
            "tool_calls": [[c.id, c.name, c.arguments] for c in m.tool_calls]}


def _message(d: dict[str, Any]) -> Message:
    return Message(d["role"], d["content"], tuple(ToolCall(*c) for c in d["tool_calls"]), d["tool_call_id"])
