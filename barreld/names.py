"""The domain's names, defined once: tiers, fingerprint modes, save reasons, lookup routes, memory kinds,
and the rule for model names. Every layer (cache core, engine, config, server, CLI) imports them from here.

Plain Python with no third-party imports, so `barrelctl --help` and the cache core can import it cheaply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class TierName(StrEnum):
    """The local tiers, fastest first: a lookup that finds one checkpoint in two tiers prefers the earlier."""

    RAM = "ram"
    RAM_FILE = "ram_file"
    DISK = "disk"


TIER_NAMES: tuple[str, ...] = tuple(TierName)

TIER_RANK: dict[str, int] = {name: rank for rank, name in enumerate(TIER_NAMES)}

MEMORY_TIERS: tuple[str, ...] = TIER_NAMES[:2]
"""The tiers held in memory (the daemon's RAM and /dev/shm files): what memory pressure evicts by default."""

REDIS_TIER = "redis"
"""The shared tier on a Redis server, beneath the local ones; not in TIER_NAMES, which holds this host's own."""

class FingerprintMode(StrEnum):
    """How a model file is fingerprinted for its keys (see `barreld.cache.key.fingerprint_gguf`)."""

    SAFE = "safe"
    GGUF_CHUNKED = "gguf_chunked"
    FAST_UNSAFE = "fast_unsafe"


FINGERPRINT_MODES: tuple[str, ...] = tuple(FingerprintMode)
MAX_DIGEST = 256  # characters of an operator's fast_unsafe digest


@dataclass(frozen=True)
class Fingerprint:
    """A model's fingerprint setting, parsed once: a mode, and for fast_unsafe the operator's digest. Written
    as the mode, or `fast_unsafe:DIGEST` (the gRPC field and `barrelctl load --fingerprint`)."""

    mode: FingerprintMode = FingerprintMode.GGUF_CHUNKED
    digest: str | None = None

    def __post_init__(self) -> None:
        if (self.mode is FingerprintMode.FAST_UNSAFE) != (self.digest is not None):
            raise ValueError("a digest goes with fast_unsafe, and fast_unsafe needs one")
        if self.digest is not None and not 0 < len(self.digest) <= MAX_DIGEST:
            raise ValueError(f"the digest must be 1..{MAX_DIGEST} characters")

    @classmethod
    def parse(cls, text: str) -> Fingerprint:
        """From its written form; ValueError says what is wrong."""
        mode, sep, digest = text.partition(":")
        if mode not in FINGERPRINT_MODES or (mode == FingerprintMode.FAST_UNSAFE) != bool(sep):
            raise ValueError("expected safe, gguf_chunked or fast_unsafe:DIGEST")
        return cls(FingerprintMode(mode), digest if sep else None)

    def __str__(self) -> str:
        return self.mode.value if self.digest is None else f"{self.mode.value}:{self.digest}"

class SaveReason(StrEnum):
    """The five moments a checkpoint is saved; each has its `saves_<reason>` counter."""

    COLD = "cold"
    CONTINUED = "continued"
    FINISH = "finish"
    EVICT = "evict"
    SHUTDOWN = "shutdown"

    @property
    def counter(self) -> str:
        return f"saves_{self.value}"


SAVE_REASONS: tuple[str, ...] = tuple(SaveReason)


class FinishReason(StrEnum):
    """Why a reply ended, as every route reports it (OpenAI's routes say `tool_calls` for a reply that called
    tools, Anthropic's its own stop reasons)."""

    STOP = "stop"  # the model ended its turn, or a stop string
    LENGTH = "length"  # max_tokens, or the context is full
    TOOL_CALLS = "tool_calls"  # the reply called tools (the engine's reading of it; the worker says stop)
    CANCELLED = "cancelled"  # the client went away
    EXPLAIN = "explain"  # a look-up-only request: nothing was generated


class Route(StrEnum):
    """How a request's prompt was warm-started; the value is the wire name (`cache.path` in replies)."""

    LIVE = "live"
    EXACT = "exact"
    RESUME = "resume"
    LONGEST_PREFIX = "longest_prefix"
    MISS = "miss"

    @property
    def counter(self) -> str:
        """The `cache stats` counter that counts requests served by this route."""
        return "misses" if self is Route.MISS else f"hits_{self.value}"


KV_CACHE_TYPES: dict[str, int] = {
    "f16": 1,
    "f32": 0,
    "bf16": 30,
    "q8_0": 8,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "iq4_nl": 20,
}
"""The K and V cache types a model can be loaded with (`type_k`, `type_v`), by name, with their ggml type ids."""

PLAIN_KV_TYPES: frozenset[str] = frozenset({"f16", "f32", "bf16"})
"""The cache types that are not quantised: llama.cpp stores a quantised V only with flash attention on."""


class MemoryKind(StrEnum):
    """What a model keeps per token, which decides where its state can be cut (`barreld.engine.memory`)."""

    FULL = "full"
    SWA = "swa"
    RECURRENT = "recurrent"
    HYBRID = "hybrid"


MODEL_NAME_MAX = 64
MODEL_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MODEL_NAME_MAX - 1}}}", re.ASCII)
MODEL_NAME_RULE = f"letters, digits, '.', '_' and '-', starting with a letter or digit, {MODEL_NAME_MAX} at most"


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot name a model, or None when it can."""
    if MODEL_NAME.fullmatch(name):
        return None
    return f"use {MODEL_NAME_RULE}"


# A model's aliases are glob patterns (fnmatch: * ? [...]) over the names clients send, such as
# "claude-*" for an agent that asks for its own model: those names hold '/', ':' and '@' too.
ALIAS_MAX = 128
ALIAS = re.compile(rf"[A-Za-z0-9._:/@*?\[\]-]{{1,{ALIAS_MAX}}}", re.ASCII)
ALIAS_RULE = f"a glob pattern of letters, digits and . _ : / @ - * ? [ ], {ALIAS_MAX} characters at most"


MAX_STOPS = 16
MAX_STOP_BYTES = 256


def stops_problem(stops: tuple[str, ...] | list[str]) -> str | None:
    """Why these cannot be stop strings (a request's, or a model's turn ends), or None when they can."""
    if len(stops) > MAX_STOPS:
        return f"too many stop strings ({len(stops)}); at most {MAX_STOPS}"
    if any(not 1 <= len(s.encode()) <= MAX_STOP_BYTES for s in stops):
        return f"each stop string must be 1..{MAX_STOP_BYTES} bytes"
    return None


def alias_problem(pattern: str) -> str | None:
    """Why `pattern` cannot be a model's alias, or None when it can."""
    return None if ALIAS.fullmatch(pattern) else f"use {ALIAS_RULE}"


DEFAULT_TENANT = ""  # the daemon's own user, and an HTTP listener without keys
DEFAULT_TENANT_LABEL = "default"  # how the default tenant is shown to people


def tenant_label(tenant: str) -> str:
    """A tenant as a table or a message shows it."""
    return tenant or DEFAULT_TENANT_LABEL
