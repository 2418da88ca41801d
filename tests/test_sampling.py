"""The sampler chain with the real model through a real barreld: each parameter takes effect (over gRPC, whose
log probabilities name each token by id), a warm start samples exactly what a cold one does at a temperature
above 0, and log probabilities (HTTP, streamed or not, and `barrelctl --json complete --logprobs`) are real
ones that a cold run reproduces.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import pytest

from barrelctl.client import Completion
from tests.support.sandbox import Sandbox
from tests.test_cache_paths import NO_SAVES, POLICY, doc
from tests.test_http import MODEL, Daemon

pytestmark = pytest.mark.model

STORY = "Once upon a time, in a small village by the sea, there lived"
CHANT = "la la la la la la la la la la la la la la la la"
LONG = "Notes: " + doc(3, 300) + "\nSummarise the notes in one sentence:"


@pytest.fixture(scope="module")
def warm() -> Iterator[Daemon]:
    with Sandbox.new(POLICY + MODEL, label="sampling-warm") as box:
        yield Daemon(box)


@pytest.fixture(scope="module")
def cold() -> Iterator[Daemon]:
    with Sandbox.new(NO_SAVES + MODEL, label="sampling-cold") as box:
        yield Daemon(box)


def run(d: Daemon, prompt: str, max_tokens: int = 16, **kw: object) -> Completion:
    """A completion over gRPC with each token's id (logprobs 0 unless asked for more)."""
    kw.setdefault("logprobs", 0)
    with d.box.client() as c:
        return c.complete(prompt.encode(), max_tokens=max_tokens, **kw).result()


def ids(done: Completion) -> list[int]:
    return [e.chosen.token for e in done.logprobs]


@pytest.mark.parametrize("cut", [{"top_k": 1}, {"top_p": 0.001}, {"min_p": 1.0}], ids=lambda c: next(iter(c)))
def test_a_cut_to_one_token_samples_the_greedy_reply(warm: Daemon, cut: dict) -> None:
    greedy = ids(run(warm, STORY))
    free = [ids(run(warm, STORY, temperature=1.5, seed=seed)) for seed in range(3)]
    assert any(f != greedy for f in free)  # without the cut these seeds sample something else
    for seed in range(3):
        assert ids(run(warm, STORY, temperature=1.5, seed=seed, sampling=cut)) == greedy


def test_typical_p_changes_what_a_seed_samples(warm: Daemon) -> None:
    free = [ids(run(warm, STORY, temperature=1.0, seed=seed)) for seed in range(4)]
    typical = [ids(run(warm, STORY, temperature=1.0, seed=seed, sampling={"typical_p": 0.2})) for seed in range(4)]
    assert free != typical
    assert typical == [ids(run(warm, STORY, temperature=1.0, seed=s, sampling={"typical_p": 0.2})) for s in range(4)]


def test_logit_bias_keeps_a_token_out_and_forces_another_in(warm: Daemon) -> None:
    greedy = ids(run(warm, STORY))
    banned = greedy[0]
    without = ids(run(warm, STORY, sampling={"logit_bias": {banned: -100}}))
    assert banned not in without and without != greedy
    sampled = [ids(run(warm, STORY, temperature=1.0, seed=s, sampling={"logit_bias": {banned: -100}}))
               for s in range(3)]
    assert all(banned not in s for s in sampled)
    forced = ids(run(warm, STORY, max_tokens=5, sampling={"logit_bias": {greedy[1]: 100}}))
    assert forced == [greedy[1]] * 5


@pytest.mark.parametrize(
    "penalty", [{"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repeat_penalty": 1.8}],
    ids=lambda p: next(iter(p)),
)
def test_a_penalty_changes_a_repetitive_reply(warm: Daemon, penalty: dict) -> None:
    greedy = ids(run(warm, CHANT, max_tokens=24))
    assert len(set(greedy)) <= 4  # the model goes on chanting
    penalised = ids(run(warm, CHANT, max_tokens=24, sampling=penalty))
    assert penalised != greedy and len(set(penalised)) > len(set(greedy))
    assert ids(run(warm, CHANT, max_tokens=24, sampling={**penalty, "repeat_last_n": 0})) == greedy


def test_a_seed_decides_the_reply(warm: Daemon) -> None:
    a, b = (run(warm, STORY, temperature=0.8, seed=5).text for _ in range(2))
    assert a == b != run(warm, STORY, temperature=0.8, seed=6).text


def test_warm_and_cold_starts_sample_the_same_tokens_with_a_seed(warm: Daemon, cold: Daemon) -> None:
    params = {"temperature": 0.8, "seed": 11, "sampling": {"top_k": 40, "top_p": 0.95, "repeat_penalty": 1.1}}
    first = run(warm, LONG, max_tokens=32, **params)
    again = run(warm, LONG, max_tokens=32, **params)
    assert again.route != "miss" and again.restored > 0
    reference = run(cold, LONG, max_tokens=32, **params)
    assert reference.route == "miss"
    assert ids(first) == ids(again) == ids(reference)
    assert [e.chosen.logprob for e in again.logprobs] == [e.chosen.logprob for e in reference.logprobs]


def chat_logprobs(d: Daemon, stream: bool = False) -> tuple[str, list, int]:
    """(the reply, its logprobs entries, the prompt tokens the cache restored)."""
    messages = [{"role": "user", "content": LONG}]
    kw = {"model": "smollm2", "messages": messages, "max_tokens": 12, "temperature": 0, "logprobs": True,
          "top_logprobs": 5}
    if not stream:
        reply = d.sdk().chat.completions.create(**kw)
        cached = reply.usage.prompt_tokens_details.cached_tokens
        return reply.choices[0].message.content, reply.choices[0].logprobs.content, cached
    text, entries, cached = "", [], 0
    for chunk in d.sdk().chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            if chunk.choices[0].logprobs is not None:
                entries += chunk.choices[0].logprobs.content
        else:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return text, entries, cached


def test_top_logprobs_are_five_real_alternatives_a_cold_run_reproduces(warm: Daemon, cold: Daemon) -> None:
    chat_logprobs(warm)  # the second ask starts warm
    text, entries, cached = chat_logprobs(warm)
    assert cached > 0 and entries and "".join(e.token for e in entries) == text
    for e in entries:
        assert len(e.top_logprobs) == 5
        probs = [math.exp(a.logprob) for a in e.top_logprobs]
        assert all(a.logprob <= 0 for a in e.top_logprobs) and sum(probs) <= 1 + 1e-9
        assert probs == sorted(probs, reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob  # greedy
        assert bytes(e.bytes) == e.token.encode()
    _, reference, cold_cached = chat_logprobs(cold)
    assert cold_cached == 0
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in reference]
    streamed_text, streamed, _ = chat_logprobs(warm, stream=True)
    assert streamed_text == text and [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]


def test_completions_logprobs_are_openais_parallel_lists(warm: Daemon) -> None:
    reply = warm.sdk().completions.create(model="smollm2", prompt=STORY, max_tokens=8, temperature=0, logprobs=3)
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert all(len(top) == 3 and max(top.values()) == lp.token_logprobs[i] for i, top in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_barrelctl_complete_prints_logprobs_and_takes_the_sampling_options(warm: Daemon) -> None:
    box = warm.box
    r = box.ctl("--json", "complete", STORY, "-n", "6", "--logprobs", "3")
    assert r.rc == 0, r
    doc_ = json.loads(r.out)
    assert "".join(e["token"] for e in doc_["logprobs"]) == doc_["text"]
    assert all(len(e["top_logprobs"]) == 3 for e in doc_["logprobs"])
    greedy = doc_["text"]
    cut = box.ctl("--json", "complete", STORY, "-n", "6", "-t", "1.5", "--seed", "2", "--top-k", "1")
    assert cut.rc == 0 and json.loads(cut.out)["text"] == greedy
    first = run(warm, STORY, max_tokens=6).logprobs[0].chosen.token
    biased = box.ctl("--json", "complete", STORY, "-n", "6", "--logit-bias", f"{first}=-100")
    assert biased.rc == 0 and json.loads(biased.out)["text"] != greedy
