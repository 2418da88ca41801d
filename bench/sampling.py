"""Structured output and the sampler chain on the bundled model: generation speed with a JSON schema against
unconstrained, and what llama.cpp's sampler chain costs per token against the numpy sampler it replaced.

Run from the repository root: `python -m bench.sampling` (under a minute on two cores). It prints its
tables and writes them as the `sampling` section of bench/RESULTS.md, leaving the rest of the file alone.

1. The engine in this process (no cache store), one model: the same JSON-asking chat prompts generated with
   the reply constrained by a JSON schema (llama.cpp's grammar sampler) and unconstrained, alternating, at
   temperature 0. Generation speed is (completion tokens - 1) / (total - time to first token), so prefill
   does not count; the ratio of medians is the figure.
2. Real logits of the model (one prompt's last position), sampled many times: the numpy sampler Barrel used
   before (softmax and a seeded draw; argmax at temperature 0), against the chain at the same settings and
   with the usual cuts and penalties. The difference is what the chain adds per token.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from rich.console import Console

from bench.harness import machine, median, progress
from bench.report import Table, put_section, verdict

TARGET_RATIO = 0.7
TARGET_ADDED_MS = 0.3
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]}, "minItems": 1,
                   "maxItems": 3},
        "review": {"type": "string", "maxLength": 200},
    },
    "required": ["title", "year", "stars", "genres", "review"],
    "additionalProperties": False,
}
TOPICS = ("a film about the sea", "a comedy set in Paris", "an old war film", "a film about robots",
          "a horror film in a castle", "a drama about a family")
console = Console()


class OldSampler:
    """The sampler the chain replaced, kept here as the baseline: argmax, or softmax and a seeded draw."""

    def __init__(self, temperature: float, seed: int | None) -> None:
        self.temperature = temperature
        self._rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray) -> int:
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.temperature
        scaled -= scaled.max()
        probs = np.exp(scaled)
        probs /= probs.sum()
        return int(self._rng.choice(probs.shape[0], p=probs))


def generate(worker, params) -> tuple[float, int]:
    """(generation tokens/s, completion tokens) of one request."""
    from barreld.engine.request import Done, Failed

    req = worker.submit(params)
    while True:
        ev = req.events.get()
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, Done):
            seconds = (ev.timings.total - ev.timings.ttft) / 1000
            return (ev.completion_tokens - 1) / seconds if seconds > 0 else float("nan"), ev.completion_tokens


def constrained_section(reps: int) -> Table:
    from barreld.engine.chat import Message
    from barreld.engine.grammar import schema_grammar
    from barreld.engine.policy import Policy
    from barreld.engine.registry import ModelRegistry
    from barreld.engine.request import CompletionParams
    from barreld.engine.sampling import SamplingParams

    grammar = schema_grammar(SCHEMA)
    rates: dict[str, list[float]] = {"unconstrained": [], "JSON schema": []}
    tokens: dict[str, list[int]] = {"unconstrained": [], "JSON schema": []}
    reg = ModelRegistry(None, Policy())
    try:
        worker = reg.get("").worker
        for i in range(reps + 1):  # the first round warms up and is not counted
            topic = TOPICS[i % len(TOPICS)]
            messages = (Message("user", f"Review {topic} as JSON with title, year, stars, genres and review."),)
            for name, g in (("unconstrained", ""), ("JSON schema", grammar)):
                rate, n = generate(worker, CompletionParams(b"", messages=messages, max_tokens=96,
                                                            sampling=SamplingParams(grammar=g)))
                if i:
                    rates[name].append(rate)
                    tokens[name].append(n)
    finally:
        reg.close()
    free, schema = median(rates["unconstrained"]), median(rates["JSON schema"])
    t = Table("Generation with a JSON schema against unconstrained (bundled model, temperature 0)",
              ["reply", "tokens/s (median)", "completion tokens (median)", "ratio", "target"])
    t.add("unconstrained", f"{free:.1f}", f"{median(tokens['unconstrained']):.0f}", "1.00", "")
    t.add("JSON schema", f"{schema:.1f}", f"{median(tokens['JSON schema']):.0f}", f"{schema / free:.2f}",
          f">= {TARGET_RATIO}: {verdict(schema / free >= TARGET_RATIO)}")
    t.note = (f"{reps} chat prompts asking for a film review as JSON, each generated both ways (at most 96 tokens); "
              "tokens/s excludes the prefill. The schema: an object of a bounded string, two bounded integers, an "
              "array of 1 to 3 enum values and a bounded string, all required.")
    progress(f"  unconstrained {free:.1f} tokens/s, with the schema {schema:.1f} ({schema / free:.2f}x)")
    return t


def per_token_us(sampler, logits: np.ndarray, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        sampler.sample(logits)
    return (time.perf_counter() - t0) / n * 1e6


def model_logits() -> tuple[np.ndarray, int]:
    from barreld.engine.backend import BatchItem, ContextSettings
    from barreld.engine.llama_backend import LlamaBackend
    from barreld.engine.registry import bundled_model_path

    be = LlamaBackend(Path(bundled_model_path("smollm2")), ContextSettings(n_ctx=512, n_batch=128))
    try:
        toks = be.tokenize(b"Once upon a time, in a small village by the sea, there lived")
        be.decode([BatchItem(t, i, 0, i == len(toks) - 1) for i, t in enumerate(toks)])
        return be.logits(len(toks) - 1), be.n_vocab
    finally:
        be.close()


def chain_section(n: int) -> Table:
    from barreld.engine.sampler import Sampler
    from barreld.engine.sampling import SamplingParams

    logits, n_vocab = model_logits()
    cuts = {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1}
    rows = [
        ("greedy (temperature 0)", OldSampler(0.0, None), SamplingParams()),
        ("temperature 0.8, seeded", OldSampler(0.8, 1), SamplingParams(temperature=0.8, seed=1)),
        ("temperature 0.8 + top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.1", None,
         SamplingParams(temperature=0.8, seed=1, **cuts)),
    ]
    t = Table(f"The sampler per token, on the bundled model's logits ({n_vocab} tokens)",
              ["settings", "old numpy sampler", "llama.cpp chain", "chain adds", "target"])
    for name, old, params in rows:
        chain = Sampler(params, n_vocab)
        chain.history(list(range(64)))
        new_us = per_token_us(chain, logits, n)
        old_us = per_token_us(old, logits, n) if old is not None else float("nan")
        added = (new_us - old_us) / 1000
        t.add(name, f"{old_us:.0f} µs" if old else "(had none)", f"{new_us:.0f} µs",
              f"{added:+.3f} ms" if old else "", f"<= {TARGET_ADDED_MS} ms: {verdict(added <= TARGET_ADDED_MS)}"
              if old else "")
        progress(f"  {name}: old {old_us:.0f} µs, chain {new_us:.0f} µs")
    t.note = (f"Each figure: {n} draws from the same logits, in this process. The chain includes copying the logits "
              "into llama.cpp's token array; the old sampler had no cuts or penalties to compare the last row with.")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=6, help="prompts generated both ways (default 6)")
    p.add_argument("--draws", type=int, default=2000, help="draws per sampler setting (default 2000)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    m = machine()
    t0 = time.monotonic()
    progress(f"1/2 {args.reps} prompts with a JSON schema and without")
    tables = [constrained_section(args.reps)]
    progress(f"2/2 the sampler per token, {args.draws} draws per setting")
    tables.append(chain_section(args.draws))
    for tb in tables:
        console.print(tb.rich())
    body = ["## Structured output and the sampler chain", "",
            f"Generated by `python -m bench.sampling` on {m['date']}, in {(time.monotonic() - t0) / 60:.1f} min "
            f"(load average at start: {m['load']}).", ""]
    put_section(args.out, "sampling", "\n".join(body + [tb.markdown() for tb in tables]))
    progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
