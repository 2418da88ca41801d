"""The prefill chunk size, and settling replies while idle: what each costs and what it buys.

    python -m bench.settle [--quick] [--results bench/RESULTS.md]

Writes (or replaces) the section "Chunk size and settling" of RESULTS.md, leaving the rest as it is.

Method, all in one process on the bundled model (n_ctx 4096, n_batch 512, every core):
1. Cold prefill of a 1,500-token prompt split at multiples of 64, 128, 256 and 512 (llama_decode with
   those batches; median of 3): tokens per second, and one chunk's time, which bounds how long a request
   that arrives during a settle waits.
2. Reuse per turn of the 8-turn chat of bench.conversation (its system message, user turns and 48-token
   replies, rendered with ChatML and counted with the model's tokenizer), by the engine's own rule
   (`Memory.aligned`) at each chunk size: under the chunk rule, and at the grain the load's probe measured,
   without settling (the reply is prefilled again) and with it (the reply is reused).
3. Preemption: the engine (ModelWorker over the real backend) finishes a 300-token reply, whose settling
   then takes three chunks; a new, unrelated request is submitted at once and after delays spread over the
   settle. Its wait is the time from submission until its own prefill starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from barreld.engine.backend import BatchItem, ContextSettings
from barreld.engine.exactness import ReuseProbe
from barreld.engine.llama_backend import LlamaBackend
from barreld.engine.memory import Memory
from barreld.engine.policy import Policy
from barreld.engine.registry import LoadOptions, ModelRegistry
from barreld.engine.request import CompletionParams, Done, Failed, Request
from barreld.names import MemoryKind
from bench.harness import Tokenizer, machine, median, model_path, progress
from bench.report import Table, ms, pct, put_section
from bench.traces import chat_system, chat_user, chatml

SECTION = "settle"
CHUNKS = (64, 128, 256, 512)
PROMPT_TOKENS = 1500
REPLY_TOKENS = 48
SETTINGS = ContextSettings(n_ctx=4096, n_batch=512)


def prefill_speed(tok: Tokenizer, reps: int) -> dict[int, tuple[float, float]]:
    """Per chunk size: median seconds for the whole prompt, and for one full chunk."""
    be = LlamaBackend(model_path(), SETTINGS)
    tokens = be.tokenize(tok.text(PROMPT_TOKENS, "settle-prompt").encode())
    out = {}
    for chunk in CHUNKS:
        whole, one = [], []
        for _ in range(reps):
            be.seq_rm(0, 0, -1)
            t0 = time.perf_counter()
            for start in range(0, len(tokens), chunk):
                end = min(start + chunk, len(tokens))
                t1 = time.perf_counter()
                be.decode([BatchItem(tokens[p], p, 0, p == end - 1) for p in range(start, end)])
                if end - start == chunk:
                    one.append(time.perf_counter() - t1)
            whole.append(time.perf_counter() - t0)
        out[chunk] = (median(whole), median(one))
        progress(f"  chunk {chunk}: {len(tokens) / median(whole):.0f} tokens/s, one chunk {median(one) * 1000:.0f} ms")
    be.close()
    return out


def chat_lengths(tok: Tokenizer, turns: int) -> list[tuple[int, int]]:
    """Per turn: the prompt's tokens, and the tokens of the prompt plus its reply (what the next extends)."""
    messages = [("system", chat_system(tok))]
    out = []
    for turn in range(turns):
        messages.append(("user", chat_user(tok, turn)))
        prompt = tok.count(chatml(messages))
        reply = tok.text(REPLY_TOKENS, f"reply-{turn}")
        messages.append(("assistant", reply))
        out.append((prompt, prompt + tok.count(reply) - 1))  # the reply's tokens, less the count's BOS
    return out


def reuse(lengths: list[tuple[int, int]], chunk: int, grain: int, settled: bool) -> tuple[int, int]:
    """Tokens reused and tokens the chat's turns 2.. held before them, by the engine's rule."""
    memory = Memory(MemoryKind.FULL, chunk=chunk, grain=grain)
    reused = held = 0
    for (prompt, text), (nxt, _) in zip(lengths, lengths[1:], strict=False):
        frontier = text if settled else prompt
        reused += memory.aligned(frontier, text, nxt, None)
        held += text
    return reused, held


def preemption(tok: Tokenizer, trials: int) -> tuple[list[float], int]:
    """Waits of requests submitted while a reply settles, and the grain the worker runs at."""
    registry = ModelRegistry(None, Policy(), backend_factory=LlamaBackend, reuse_probe=ReuseProbe())
    loaded = registry.load("smollm2", LoadOptions(path=model_path(), n_ctx=4096, n_batch=512))
    worker, waits = loaded.worker, []
    for trial in range(trials):
        finish(worker.submit(CompletionParams(tok.text(300, f"long-{trial}").encode(), max_tokens=300)))
        time.sleep(trial * 0.8 / max(1, trials - 1))  # spread over the settle of about three chunks
        probe = worker.submit(CompletionParams(tok.text(60, f"short-{trial}").encode(), max_tokens=1))
        finish(probe)
        waits.append(probe.prefill_started - probe.submitted)
    registry.close()
    return waits, loaded.memory.grain


def finish(req: Request) -> Done:
    while True:
        ev = req.events.get(timeout=600)
        if isinstance(ev, Failed):
            raise ev.error
        if isinstance(ev, Done):
            return ev


def section(speed: dict, lengths: list, grain: int, waits: list[float], m: dict, argv: list[str],
            minutes: float) -> str:
    head = (f"## Chunk size and settling\n\nGenerated by `python -m bench.settle {' '.join(argv)}` on "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {minutes:.1f} min (load {m['load']}); the "
            f"method is in bench/settle.py's docstring. Measured reuse grain of the bundled model: {grain}.\n")
    t = Table("Cold prefill of 1,500 tokens, and reuse per chat turn (turns 2-8)",
              ["chunk", "tokens/s", "one chunk", "reused: chunk rule", f"grain {grain}, reply prefilled again",
               f"grain {grain}, reply settled"])
    for chunk in CHUNKS:
        whole, one = speed[chunk]
        cells = []
        for g, settled in ((chunk, False), (grain, False), (grain, True)):
            reused, held = reuse(lengths, chunk, g, settled)
            cells.append(f"{pct(reused / held)} ({(held - reused) / (len(lengths) - 1):.0f} lost/turn)")
        t.add(chunk, f"{PROMPT_TOKENS / whole:.0f}", ms(one * 1000), *cells)
    t.note = ("'lost/turn': tokens of the previous prompt and reply that the next turn prefills again. The "
              "default chunk is max(64, n_batch // 4) = 128 at n_batch 512.")
    w = Table("A request that arrives while a reply settles",
              ["requests", "median wait", "longest wait", "one 128-token chunk", "longest / chunk"])
    chunk_s = speed[128][1]
    w.add(len(waits), ms(median(waits) * 1000), ms(max(waits) * 1000), ms(chunk_s * 1000),
          f"{max(waits) / chunk_s:.2f}")
    w.note = "The wait runs from submission until the request's own prefill starts (its lookup included)."
    return "\n".join([head, t.markdown(), w.markdown()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.settle", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="one repetition, four preemption trials")
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    t0, m, tok = time.monotonic(), machine(), Tokenizer()
    progress("1/3 cold prefill per chunk size")
    speed = prefill_speed(tok, 1 if args.quick else 3)
    progress("2/3 reuse per chat turn")
    lengths = chat_lengths(tok, 8)
    progress("3/3 requests arriving during a settle")
    waits, grain = preemption(tok, 4 if args.quick else 10)
    put_section(args.results, SECTION, section(speed, lengths, grain, waits, m, argv, (time.monotonic() - t0) / 60))
    progress(f"wrote the section {SECTION!r} of {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
