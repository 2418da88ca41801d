"""Errors raised by the cache core; the engine maps them to its own replies."""

from __future__ import annotations


class CacheError(Exception):
    """Base of every error the cache core raises on purpose."""


class CorruptCheckpoint(CacheError):
    """A checkpoint's bytes failed verification; it must never be served."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TierWriteError(CacheError):
    """Writing a payload into a tier failed; nothing partial was published."""

    def __init__(self, tier: str, errno: int | None, message: str) -> None:
        super().__init__(f"{tier}: {message}")
        self.tier = tier
        self.errno = errno


class IndexWriteError(CacheError):
    """The LMDB index could not commit a change (its disk is full, say); the index is as it was."""


class WriterQueueFull(CacheError):
    """The writer pool's queue is full; the caller drops the save instead of waiting."""


class StoreLocked(CacheError):
    """Another process owns this data dir (or tier root): one cache per directory."""
