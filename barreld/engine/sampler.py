"""llama.cpp's own sampler chain, applied to logits Barrel holds (a stored checkpoint's or the last decode's).

The chain is logit bias, penalties, then greedy at temperature 0, else top-k, typical, top-p, min-p,
temperature and a seeded draw: llama.cpp's order. Its only state is the penalties' recent tokens and the
draw's generator, both fed from the token list alone, so a warm start samples what a cold one does.

A grammar is a separate sampler, checked the way llama.cpp's own server does it: the chain picks a token
from the unconstrained logits, and only when the grammar refuses it are the logits masked by the grammar and
the chain asked again. The grammar is only ever told a token it allows: llama.cpp aborts the process when
it is told one it refuses.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from typing import Any

import numpy as np

from barreld.engine.sampling import SamplingParams
from barreld.errors import InvalidArgument

SEEDS = 0xFFFFFFFF  # llama.cpp's seeds are 32-bit, and this one value means "pick a random seed"
GRAMMAR_ROOT = b"root"


def _llama() -> Any:
    import llama_cpp

    return llama_cpp


def logprobs(logits: np.ndarray, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """`token`'s log probability and the `n` likeliest tokens' (most likely first): the log-softmax of the
    raw logits, what the model gives each token before any cut, as OpenAI reports it."""
    x = logits.astype(np.float64)
    x -= x.max()
    x -= math.log(np.exp(x).sum())
    n = min(n, x.shape[0])
    top = np.argpartition(-x, n - 1)[:n] if n else np.arange(0)
    top = top[np.argsort(-x[top], kind="stable")]
    return float(x[token]), [(int(t), float(x[t])) for t in top]


class Sampler:
    """One request's chain (and grammar); freed with the object."""

    def __init__(self, params: SamplingParams, n_vocab: int, vocab: Any = None) -> None:
        L = self._L = _llama()
        self.params = params
        self._chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        weakref.finalize(self, L.llama_sampler_free, self._chain)
        for stage in self._stages(params, n_vocab):
            L.llama_sampler_chain_add(self._chain, stage)
        self._grammar = self._grammar_sampler(params.grammar, vocab) if params.grammar else None
        self._data = np.zeros(n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
        self._ids = np.arange(n_vocab, dtype=np.int32)
        self._ptr = self._data.ctypes.data_as(ctypes.POINTER(L.llama_token_data))
        self._one = (L.llama_token_data * 1)()
        self._arr = L.llama_token_data_array(self._ptr, n_vocab, -1, False)
        # Plain greedy, the default: the chain's greedy stage takes the first largest logit, as argmax does,
        # without copying the vocabulary into llama.cpp's array for every token.
        self._argmax = params.temperature == 0 and not (params.logit_bias or params.penalised or params.grammar)

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    def _stages(self, p: SamplingParams, n_vocab: int) -> list[Any]:
        L = self._L
        stages = []
        if p.logit_bias:
            stages.append(self._bias(p, n_vocab))
        if p.penalised:
            stages.append(L.llama_sampler_init_penalties(n_vocab, p.repeat_last_n, p.repeat_penalty,
                                                         p.frequency_penalty, p.presence_penalty))
        if p.temperature == 0:
            return [*stages, L.llama_sampler_init_greedy()]
        if p.top_k > 0:
            stages.append(L.llama_sampler_init_top_k(p.top_k))
        if p.typical_p < 1:
            stages.append(L.llama_sampler_init_typical(p.typical_p, 1))
        if p.top_p < 1:
            stages.append(L.llama_sampler_init_top_p(p.top_p, 1))
        if p.min_p > 0:
            stages.append(L.llama_sampler_init_min_p(p.min_p, 1))
        seed = SEEDS if p.seed is None else p.seed % SEEDS
        return [*stages, L.llama_sampler_init_temp(p.temperature), L.llama_sampler_init_dist(seed)]

    def _bias(self, p: SamplingParams, n_vocab: int) -> Any:
        L = self._L
        for token, _ in p.logit_bias:
            if token >= n_vocab:
                raise InvalidArgument(f"bad logit_bias key {token}: the model's token ids are 0..{n_vocab - 1}")
        entries = (L.llama_logit_bias * len(p.logit_bias))(*(L.llama_logit_bias(t, b) for t, b in p.logit_bias))
        return L.llama_sampler_init_logit_bias(n_vocab, len(entries), entries)

    def _grammar_sampler(self, gbnf: str, vocab: Any) -> Any:
        """llama.cpp parses the grammar and answers NULL (it logs why) when it does not parse."""
        if vocab is None:
            raise InvalidArgument("this model's backend has no vocabulary for a grammar")
        L = self._L
        grammar = L.llama_sampler_init_grammar(vocab, gbnf.encode(), GRAMMAR_ROOT)
        if not grammar:
            raise InvalidArgument("bad grammar: llama.cpp could not parse it as GBNF with a `root` rule")
        weakref.finalize(self, L.llama_sampler_free, grammar)
        return grammar

    def history(self, tokens: list[int]) -> None:
        """Tells the penalties the tokens before the first sampled one (the prompt's tail)."""
        if self.params.penalised:
            for t in tokens[-self.params.repeat_last_n :]:
                self._L.llama_sampler_accept(self._chain, t)

    def sample(self, logits: np.ndarray) -> int:
        """The next token; the chain and the grammar are told of it. InvalidArgument when the grammar
        allows no token at all here."""
        if self._argmax:
            return int(np.argmax(logits))
        token = self._draw(logits, grammar_first=False)
        if self._grammar is not None:
            if not self._allows(token):
                token = self._draw(logits, grammar_first=True)
                if not self._allows(token):
                    raise InvalidArgument("the grammar allows no token here; check that it can be completed")
            self._L.llama_sampler_accept(self._grammar, token)
        self._L.llama_sampler_accept(self._chain, token)
        return token

    def _draw(self, logits: np.ndarray, grammar_first: bool) -> int:
        L, arr = self._L, self._arr
        self._data["id"] = self._ids  # the stages sort the array in place: every draw starts afresh
        self._data["logit"] = logits
        arr.data, arr.size, arr.selected, arr.sorted = self._ptr, logits.shape[0], -1, False
        if grammar_first:
            L.llama_sampler_apply(self._grammar, ctypes.byref(arr))
        L.llama_sampler_apply(self._chain, ctypes.byref(arr))
        return int(arr.data[arr.selected].id)

    def _allows(self, token: int) -> bool:
        one = self._one
        one[0].id, one[0].logit, one[0].p = token, 0.0, 0.0
        single = self._L.llama_token_data_array(one, 1, -1, False)
        self._L.llama_sampler_apply(self._grammar, ctypes.byref(single))
        return math.isfinite(one[0].logit)
