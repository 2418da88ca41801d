"""The Responses route against the chat route: warm time to first token for the same conversation, the same hit,
in the same run.

Run from the repository root: `python -m bench.responses [--pairs N]` (about a minute on two cores). It prints its
table and writes it as the `responses` section of bench/RESULTS.md, leaving the rest of the file alone.

One daemon (one sequence), one conversation of about 1,000 tokens: a system prompt and a user message, sent to
/v1/chat/completions as `messages` and to /v1/responses as `instructions` and `input`, which render to the same
prompt. Each pair sends it once through each route, back to back, in alternating order, so both are served from
the live sequence (or, with an unrelated prompt before each, from the disk tier). TTFT is the client's, from
sending the request to the first text of the reply, over one kept-alive connection read by hand.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

from rich.console import Console

from bench.harness import Daemon, Tokenizer, machine, median, progress
from bench.http import HTTP_CONFIG, RawHttp, http_port
from bench.report import Table, ms, put_section, verdict

BUDGET_MS = 2.0
CHAT_TEXT = re.compile(rb'"content":"[^"]')
RESPONSES_TEXT = re.compile(rb"event: response\.output_text\.delta")
LAST_CHAT = re.compile(rb'data: (\{[^\n]*"barrel"[^\n]*\})\n')
LAST_RESPONSE = re.compile(rb"event: response\.(?:completed|incomplete)\ndata: (\{[^\n]*\})\n")
console = Console()


def ask(raw: RawHttp, route: str, system: str, user: str) -> tuple[float, str, int]:
    """(client TTFT in ms, the cache route, tokens restored) of one streamed request through `route`."""
    if route == "chat":
        doc = {"model": "smollm2", "messages": [{"role": "system", "content": system},
                                                {"role": "user", "content": user}],
               "max_tokens": 4, "temperature": 0, "stream": True}
        first, buf = raw.post("/v1/chat/completions", doc, CHAT_TEXT)
        barrel = json.loads(LAST_CHAT.findall(buf)[-1])["barrel"]
    else:
        doc = {"model": "smollm2", "instructions": system, "input": user, "max_output_tokens": 4,
               "temperature": 0, "stream": True, "store": False}
        first, buf = raw.post("/v1/responses", doc, RESPONSES_TEXT)
        barrel = json.loads(LAST_RESPONSE.findall(buf)[-1])["response"]["barrel"]
    return first, barrel["cache"]["path"], barrel["cache"]["restored_tokens"]


def section(tok: Tokenizer, pairs: int) -> Table:
    system, user = tok.text(950, "responses-bench"), "Summarise the notes in one line."
    t = Table("Warm time to first token: the Responses route against the chat route, same conversation, same run",
              ["hit", "chat", "Responses", "Responses - chat", "tokens restored", f"within {BUDGET_MS:g} ms"])
    with Daemon("responses-ttft", config=HTTP_CONFIG) as d:
        raw = RawHttp(http_port(d))
        ask(raw, "chat", system, user)  # the cold prefill; every later request is warm
        for hit, flush in (("live", False), ("exact", True)):
            got: list[dict[str, tuple[float, str, int]]] = []
            for i in range(pairs):
                pair = {}
                for route in ("chat", "responses") if i % 2 == 0 else ("responses", "chat"):
                    if flush:
                        d.flush_live(i)
                    pair[route] = ask(raw, route, system, user)
                got.append(pair)
            routes = {p[r][1] for p in got for r in p}
            if routes != {hit}:
                raise SystemExit(f"bench.responses: expected only {hit} hits, got {sorted(routes)}")
            c, r = (median([p[w][0] for p in got]) for w in ("chat", "responses"))
            diff = median([p["responses"][0] - p["chat"][0] for p in got])
            restored = {p[w][2] for p in got for w in p}
            t.add(hit, ms(c), ms(r), f"{diff:+.2f} ms", "/".join(map(str, sorted(restored))),
                  verdict(abs(diff) <= BUDGET_MS))
            progress(f"{hit}: chat {c:.2f} ms, Responses {r:.2f} ms, paired difference {diff:+.2f} ms")
        raw.close()
    t.note = (f"{pairs} pairs, the two of a pair back to back, the order alternating; medians, and the median of "
              "the pairs' differences. Both routes stream; the chat route's first text is its first content "
              "delta, the Responses route's its first response.output_text.delta event (after response.created, "
              "response.in_progress, response.output_item.added and response.content_part.added). 'exact' sends "
              "an unrelated prompt before each request, so that the conversation comes back from the disk tier.")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.responses", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20, help="chat/Responses pairs per hit (default 20)")
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    m = machine()
    t0 = time.monotonic()
    table = section(Tokenizer(), args.pairs)
    console.print(table.rich())
    body = ["## The Responses API against chat completions", "",
            f"Generated by `python -m bench.responses` on {m['date']}, in {(time.monotonic() - t0) / 60:.1f} min "
            f"(load average at start: {m['load']}).", ""]
    put_section(args.results, "responses", "\n".join(body) + table.markdown())
    progress(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
