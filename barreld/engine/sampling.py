"""What a request asks of the sampler, checked once where it comes in: temperature and seed, llama.cpp's
cuts (top-k, top-p, min-p, typical), its penalties, a logit bias and a grammar. The chain that applies them
is barreld.engine.sampler; this module imports no llama.cpp, so the front ends and the CLI check alike.

Defaults leave every stage off: temperature 0 is greedy, and at a temperature above 0 the whole
distribution is sampled unless a cut is asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from barreld.errors import InvalidArgument

MAX_TEMPERATURE = 100
MAX_SEED = (1 << 64) - 1
MAX_PENALTY = 2.0  # presence and frequency, as OpenAI bounds them
MAX_REPEAT_PENALTY = 10.0
MAX_BIAS = 100.0
MAX_BIASED = 1024  # logit_bias entries
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
MAX_GRAMMAR = 256 << 10  # characters of GBNF (a large JSON schema converts to tens of KiB)
DEFAULT_REPEAT_LAST_N = 64
MAX_REPEAT_LAST_N = 1 << 20  # llama.cpp keeps a ring of this many tokens
MAX_TOP_K = (1 << 31) - 1  # llama.cpp's top-k is a C int


def _bad(name: str, value: object, expected: str) -> InvalidArgument:
    return InvalidArgument(f"bad {name} {value!r}: expected {expected}")


def _fraction(name: str, value: float, low_open: bool) -> None:
    """A probability mass or ratio: 0..1, or (0, 1] when 0 would leave nothing to sample."""
    ok = math.isfinite(value) and (0 < value <= 1 if low_open else 0 <= value <= 1)
    if not ok:
        raise _bad(name, value, "a number above 0, at most 1" if low_open else "a number from 0 to 1")


def _number(name: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise _bad(name, value, f"a number from {low:g} to {high:g}")


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampler settings; constructing one checks every field and names the first bad one."""

    temperature: float = 0.0  # 0: greedy
    seed: int | None = None  # None: a random seed
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    typical_p: float = 1.0  # 1: off
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = DEFAULT_REPEAT_LAST_N  # tokens the penalties look back over (prompt included)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit); -100 bans it
    grammar: str = ""  # GBNF the reply must match, root rule `root`; empty: unconstrained

    def __post_init__(self) -> None:
        _number("temperature", self.temperature, 0, MAX_TEMPERATURE)
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise _bad("seed", self.seed, "a whole number from 0 to 2**64 - 1")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise _bad("top_k", self.top_k, f"a whole number from 0 (off) to {MAX_TOP_K}")
        _fraction("top_p", self.top_p, low_open=True)
        _fraction("min_p", self.min_p, low_open=False)
        _fraction("typical_p", self.typical_p, low_open=True)
        _number("repeat_penalty", self.repeat_penalty, 0.01, MAX_REPEAT_PENALTY)
        if not 0 <= self.repeat_last_n <= MAX_REPEAT_LAST_N:
            raise _bad("repeat_last_n", self.repeat_last_n, f"a whole number from 0 to {MAX_REPEAT_LAST_N}")
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        self._check_bias()
        if len(self.grammar) > MAX_GRAMMAR:
            raise InvalidArgument(f"the grammar is {len(self.grammar)} characters; at most {MAX_GRAMMAR}")

    def _check_bias(self) -> None:
        if len(self.logit_bias) > MAX_BIASED:
            raise InvalidArgument(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_BIASED}")
        for token, bias in self.logit_bias:
            if token < 0:
                raise _bad("logit_bias key", token, "a token id (a whole number >= 0)")
            _number(f"logit_bias[{token}]", bias, -MAX_BIAS, MAX_BIAS)

    @property
    def penalised(self) -> bool:
        """Whether the penalty stage changes anything (it needs the recent tokens)."""
        neutral = self.repeat_penalty == 1.0 and self.presence_penalty == 0 and self.frequency_penalty == 0
        return self.repeat_last_n > 0 and not neutral


def check_logprobs(n: int | None) -> None:
    """None: no log probabilities; 0: the chosen token's only; N: N alternatives besides."""
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise _bad("logprobs", n, f"a whole number from 0 to {MAX_LOGPROBS}")


# The knobs every front end passes through by name, with their types: all of SamplingParams but the ones
# each front end spells its own way (OpenAI's defaults for temperature, seeds, bias maps, grammars).
KNOBS: dict[str, type] = {
    f.name: int if f.type == "int" else float
    for f in fields(SamplingParams)
    if f.name not in ("temperature", "seed", "logit_bias", "grammar")
}
