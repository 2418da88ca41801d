"""Barrel's cache core: content-addressed KV checkpoints in three tiers behind an LMDB index.

Plain Python (no gRPC, no llama): the engine builds `Checkpoint`s and calls a `CacheStore`.
"""

from .checkpoint import FORMAT_VERSION, SAVE_REASONS, Checkpoint, decode, encode_parts, encoded_size
from .counters import COUNTER_NAMES, Counters
from .errors import CacheError, CorruptCheckpoint, IndexWriteError, StoreLocked, TierWriteError, WriterQueueFull
from .index import Hit
from .key import FINGERPRINT_MODES, CtxParams, KeyScheme, fingerprint_gguf
from .store import TIER_NAMES, CacheStore, ReconcileReport, SaveOutcome, TierConfig

__all__ = [
    "COUNTER_NAMES",
    "FINGERPRINT_MODES",
    "FORMAT_VERSION",
    "SAVE_REASONS",
    "TIER_NAMES",
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
