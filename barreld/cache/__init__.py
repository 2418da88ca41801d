"""Barrel's cache core: content-addressed KV checkpoints in three tiers behind an LMDB index.

Plain Python (no gRPC, no llama): the engine builds `Checkpoint`s and calls a `CacheStore`.
"""

from .checkpoint import FORMAT_VERSION, Checkpoint, decode, encode_parts, encoded_size
from .counters import COUNTER_NAMES, Counters
from .errors import CacheError, CorruptCheckpoint, IndexWriteError, StoreLocked, TierWriteError, WriterQueueFull
from .index import Hit
from .key import CtxParams, KeyScheme, fingerprint_gguf
from .store import CacheStore, ReconcileReport, SaveOutcome, TierConfig

__all__ = [
    "COUNTER_NAMES",
    "FORMAT_VERSION",
    "CacheError",
    "CacheStore",
    "Checkpoint",
    "CorruptCheckpoint",
    "Counters",
    "CtxParams",
    "Hit",
    "IndexWriteError",
    "KeyScheme",
    "ReconcileReport",
    "SaveOutcome",
    "StoreLocked",
    "TierConfig",
    "TierWriteError",
    "WriterQueueFull",
    "decode",
    "encode_parts",
    "encoded_size",
    "fingerprint_gguf",
]
