"""Cold versus warm time to first token: Barrel per tier, next to llama-cpp-python's caches, interleaved.

Every contender (a `System`) gets the same prompts. The machine is small and shared, so measurements are
taken round-robin: each cold prompt goes to every system in turn, then each warm repetition does, so
background load falls on all of them alike. Medians are reported.

Barrel's method, per tier: one barreld (default policy, n_seq_max 1, the model loaded with `tier = T`):
- cold: a never-seen prompt (path `miss`: a full prefill), after an unrelated short prompt.
- warm: once the first prompt's finish checkpoint is published, an unrelated short prompt takes the only
  sequence (so the live path cannot serve), then the first prompt again: path `exact`, restored from the tier.
- disk only, variant "page cache dropped": the same, after `posix_fadvise(DONTNEED)` on the checkpoint
  file, so the restore reads the device instead of the page cache.
TTFT is measured by the client (submit to the first token event, over the socket); the daemon's own
`timings_ms.ttft` (from the request's arrival at the model's worker) is kept too.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from bench.harness import Daemon, Tokenizer, median, progress


@dataclass
class Sample:
    ttft_ms: float  # client-side time to the first token
    call_ms: float  # client-side time to the end of the call
    daemon_ttft_ms: float = float("nan")
    restore_ms: float = float("nan")
    prefill_ms: float = float("nan")  # the daemon's: for a warm start, re-evaluating the prompt's last tokens
    path: str = ""
    tier: str = ""
    prompt_tokens: int = 0


class System(Protocol):
    name: str
    variants: tuple[str, ...]

    def cold(self, prompt: str) -> Sample: ...
    def ready(self, prompt: str) -> None: ...
    def warm(self, prompt: str, variant: str) -> Sample: ...
    def done(self, prompt: str) -> None: ...


@dataclass
class Results:
    cold: dict[tuple[str, int], list[Sample]] = field(default_factory=lambda: defaultdict(list))
    warm: dict[tuple[str, str, int], list[Sample]] = field(default_factory=lambda: defaultdict(list))

    def cold_ms(self, system: str, size: int, what: str = "ttft_ms") -> float:
        return median([getattr(s, what) for s in self.cold[(system, size)]])

    def warm_ms(self, system: str, variant: str, size: int, what: str = "ttft_ms") -> float:
        return median([getattr(s, what) for s in self.warm[(system, variant, size)]])

    def prompt_tokens(self, size: int) -> int:
        for (_, n), samples in self.cold.items():
            if n == size and samples and samples[0].prompt_tokens:
                return samples[0].prompt_tokens
        return size


def prompts_for(tok: Tokenizer, tokens: int, n: int, seed: str = "ttft") -> list[str]:
    """Prompts that share no leading token: a lookup by longest prefix never confuses two of them."""
    heads = ("Report", "Letter", "Summary", "Minutes", "Notes", "Memo", "Review", "Digest")
    return [tok.text(tokens, f"{seed}-{tokens}-{i}", head=f"{heads[i % len(heads)]} {i} of {tokens} tokens: ")
            for i in range(n)]


def compare(systems: list[System], prompts: dict[int, list[str]], reps: int) -> Results:
    """Cold runs of every prompt, then `reps` warm runs of each size's first prompt, round-robin. One more
    warm run per system comes first and is not counted (first-use costs: page faults, lazy allocations)."""
    res = Results()
    for size, texts in prompts.items():
        for text in texts:
            for s in systems:
                res.cold[(s.name, size)].append(s.cold(text))
        for s in systems:
            s.ready(texts[0])
            for v in s.variants:
                s.warm(texts[0], v)
        for _ in range(reps):
            for s in systems:
                for v in s.variants:
                    res.warm[(s.name, v, size)].append(s.warm(texts[0], v))
        for s in systems:
            s.done(texts[0])
            warm = ", ".join(f"{res.warm_ms(s.name, v, size):.1f} ms {v}" for v in s.variants)
            progress(f"  {size:5d} tokens  {s.name:<16} cold {res.cold_ms(s.name, size):7.0f} ms   warm {warm}")
    return res


# ---- Barrel ---------------------------------------------------------------------------------------


def drop_page_cache(path: str) -> None:
    """Evicts one file's pages (it was fdatasync'ed, so they are clean): the next read goes to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@dataclass
class TierCost:
    tier: str
    rows: int = 0
    bytes: int = 0
    tokens: int = 0
    bytes_per_token: float = float("nan")
    saves: int = 0
    save_s: float = 0.0

    @property
    def save_mb_s(self) -> float:
        return self.bytes / self.save_s / 1e6 if self.save_s else float("nan")

    @property
    def save_ms_each(self) -> float:
        return 1000 * self.save_s / self.saves if self.saves else float("nan")


class BarrelSystem:
    WARM = "page cache warm"
    DROPPED = "page cache dropped"

    def __init__(self, tier: str, *, drop_variant: bool = False) -> None:
        self.tier = tier
        self.name = f"Barrel {tier}"
        self.variants = (self.WARM, self.DROPPED) if drop_variant and tier == "disk" else (self.WARM,)
        self.daemon = Daemon(f"ttft-{tier}", tier=tier)
        self._keys: dict[str, str] = {}
        self._rows: dict[str, str] = {}
        self._flushes = 0

    def __enter__(self) -> BarrelSystem:
        self.daemon.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.daemon.__exit__(*exc)

    def _flush(self) -> None:
        self._flushes += 1
        self.daemon.flush_live(self._flushes)

    @staticmethod
    def _sample(c) -> Sample:
        t = c.timings_ms
        return Sample(c.client_ttft_ms, c.client_total_ms, t["ttft"], t["restore"], t["prefill"], c.route, c.tier,
                      c.prompt_tokens)

    def cold(self, prompt: str) -> Sample:
        self._flush()  # the live sequence must not hold anything this prompt starts with
        c = self.daemon.complete(prompt)
        if c.route != "miss":
            raise RuntimeError(f"{self.name}: a never-seen prompt took path {c.route}, not miss")
        self._keys[prompt] = c.key
        return self._sample(c)

    def ready(self, prompt: str) -> None:
        row = self.daemon.wait_stored(self._keys[prompt])
        if row is None:
            raise RuntimeError(f"{self.name}: the finish checkpoint was never stored")
        self._rows[prompt] = row.location

    def warm(self, prompt: str, variant: str) -> Sample:
        self._flush()
        if variant == self.DROPPED:
            drop_page_cache(self._rows[prompt])
        c = self.daemon.complete(prompt)
        if c.route != "exact" or c.tier != self.tier:
            raise RuntimeError(f"{self.name}: warm start took path {c.route} from {c.tier!r}, not exact")
        return self._sample(c)

    def done(self, prompt: str) -> None:
        pass

    def cost(self) -> TierCost:
        """Bytes per token of what the tier holds, and save throughput from the daemon's counters."""
        d = self.daemon
        rows = [r for r in d.rows() if r.tier == self.tier]
        counters = d.counters()
        saves = sum(v for k, v in counters.items()
                    if k.startswith("saves_") and k not in ("saves_dropped", "saves_duplicate", "saves_failed"))
        cost = TierCost(self.tier, rows=len(rows), bytes=sum(r.size for r in rows),
                        tokens=sum(r.tokens for r in rows), saves=saves, save_s=counters.get("save_ns", 0) / 1e9)
        if rows:
            cost.bytes_per_token = median([r.size / r.tokens for r in rows])
        return cost
