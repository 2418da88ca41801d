"""An 8-turn conversation sent as messages, then again after a restart, to barreld and, side by side in the
same run, to llama-cpp-python's own OpenAI-compatible server (`llama_cpp.server`) with its disk cache on.

    python -m bench.conversation [--turns 8] [--reply-tokens 48] [--results bench/RESULTS.md]

Writes (or replaces) the section "Conversation over messages" of RESULTS.md, leaving the rest as it is.

Method. The conversation is section 2's (a 700-token system message, then user messages of 50 to 119
tokens), so every prompt is over the default policy's min_tokens. Each turn resends the whole conversation
as a list of messages: to barreld through its client (`CompleteRequest.messages`, rendered by the model's
chat template in the daemon), and as the same list to the server's `/v1/chat/completions` (rendered by its
own Jinja formatter from the same GGUF template), turn by turn, Barrel first. The replies are Barrel's (both
are greedy), so both get identical messages. Both stream; TTFT is client-side wall time to the first token
of text (Barrel: over its Unix socket; the server: over HTTP on loopback, to the first chunk with content).
Both use the bundled model with n_ctx 4096, n_batch 512 and every core. Then both are stopped (barreld
with SIGTERM, so its shutdown saves run; the server too), started again on the same data dir and cache
directory, and the same message lists are sent again. Neither side gets a warm-up request: barreld warms its
context itself when it loads a model, the server does not; and any request to the server would go through
its cache, which hands its longest-prefix entry even to an unrelated prompt and drops that entry on use.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from barrelctl.client import Completion
from barreld.engine.chat import Message
from bench.harness import MODEL, Daemon, ServerProcess, Tokenizer, machine, median, model_path, progress
from bench.report import Table, ms, put_section, times
from bench.traces import chat_system, chat_user, reply_text

SECTION = "conversation"


@dataclass
class Run:
    """One pass over the conversation: per turn, Barrel's completion and the server's TTFT."""

    barrel: list[Completion] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)


class LlamaServer(ServerProcess):
    """`python -m llama_cpp.server`, its working directory (where LlamaDiskCache keeps `.cache/llama_cache`)
    kept across restarts."""

    name = "llama_cpp.server"

    def command(self, port: int) -> list[str]:
        threads = str(len(os.sched_getaffinity(0)))
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(model_path()), "--n_ctx", "4096",
                "--n_batch", "512", "--n_threads", threads, "--n_threads_batch", threads, "--cache", "True",
                "--cache_type", "disk", "--host", "127.0.0.1", "--port", str(port), "--verbose", "False"]

    def chat(self, messages: list[Message], max_tokens: int) -> float:
        """Streams one chat completion; milliseconds to the first chunk that carries text."""
        body = {"messages": [{"role": m.role, "content": m.content} for m in messages], "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True}
        t0 = time.perf_counter()
        first = None
        for chunk in self.events("/v1/chat/completions", body):
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
        return ((first or time.perf_counter()) - t0) * 1000


def _turn(label: str, daemon: Daemon, server: LlamaServer, run: Run, messages: list[Message],
          reply_tokens: int) -> Completion:
    """One turn on both sides, Barrel first; both get `messages`."""
    c = daemon.client.complete(b"", model=MODEL, messages=messages, max_tokens=reply_tokens, timeout=600).result()
    run.barrel.append(c)
    run.server_ms.append(server.chat(messages, reply_tokens))
    progress(f"  {label} turn {len(run.barrel)}: {c.prompt_tokens} tokens; Barrel {c.route} restored {c.restored}, "
             f"ttft {c.client_ttft_ms:.0f} ms; llama_cpp.server ttft {run.server_ms[-1]:.0f} ms")
    return c


def first_pass(daemon: Daemon, server: LlamaServer, n_turns: int, reply_tokens: int) -> tuple[Run, list]:
    """The conversation as it happens, grown by Barrel's replies; and each turn's message list."""
    tok = Tokenizer()
    messages = [Message("system", chat_system(tok))]
    run, turns = Run(), []
    for i in range(n_turns):
        messages.append(Message("user", chat_user(tok, i)))
        turns.append(list(messages))
        c = _turn("first", daemon, server, run, turns[-1], reply_tokens)
        messages.append(Message("assistant", reply_text(c.text)))
    return run, turns


def measure(n_turns: int, reply_tokens: int) -> tuple[Run, Run]:
    """The first pass, then the same message lists after restarting both."""
    with tempfile.TemporaryDirectory(prefix="bench-llama-server-") as work, Daemon("conversation") as daemon:
        server = LlamaServer(Path(work))
        try:
            progress(f"barreld up; llama_cpp.server starting in {work}")
            server.start()
            first, turns = first_pass(daemon, server, n_turns, reply_tokens)
            progress("restarting both: barreld with SIGTERM (shutdown saves), the server on the same cache dir")
            daemon.restart()
            server.stop()
            server.start()
            again = Run()
            for messages in turns:
                _turn("after restart", daemon, server, again, messages, reply_tokens)
        finally:
            server.stop()
    return first, again


def table(first: Run, again: Run) -> Table:
    t = Table("Time to first token per turn: Barrel vs llama-cpp-python's server (disk cache), same messages",
              ["turn", "prompt tokens", "Barrel path (restored)", "Barrel", "llama_cpp.server", "faster",
               "after restart: Barrel path (restored)", "Barrel", "llama_cpp.server", "faster"])
    for i, (a, b) in enumerate(zip(first.barrel, again.barrel, strict=True)):
        t.add(i + 1, a.prompt_tokens, _path(a), ms(a.client_ttft_ms), ms(first.server_ms[i]),
              times(first.server_ms[i], a.client_ttft_ms), _path(b), ms(b.client_ttft_ms), ms(again.server_ms[i]),
              times(again.server_ms[i], b.client_ttft_ms))
    (a, b), (c, d) = medians(first), medians(again)
    t.add("median", "", "", ms(a), ms(b), times(b, a), "", ms(c), ms(d), times(d, c))
    t.note = (f"Medians: turns 2 to {len(first.barrel)} as the conversation happens (turn 1 is a cold prefill on "
              "both sides), every turn after the restart. Path: Barrel's lookup route, the tier a state came "
              "from, and the tokens restored.")
    return t


def medians(run: Run) -> tuple[float, float]:
    """Barrel's and the server's median TTFT over the warm turns: all but a first pass's cold turn 1."""
    warm = slice(1, None) if run.barrel[0].route == "miss" else slice(None)
    return median([c.client_ttft_ms for c in run.barrel[warm]]), median(run.server_ms[warm])


def _path(c: Completion) -> str:
    where = f"{c.route} from {c.tier}" if c.tier else c.route
    return f"{where}: {c.restored}" if c.restored else where


def section(first: Run, again: Run, m: dict, argv: list[str], elapsed: float) -> str:
    command = " ".join(["python -m bench.conversation", *argv])
    (a, b), (c, d) = medians(first), medians(again)
    head = [
        "## Conversation over messages",
        "",
        f"Generated by `{command}` on {m['date']}, in {elapsed / 60:.1f} min (load average at start: "
        f"{m['load']}); the machine is described at the top. Each turn resends the whole conversation as "
        "messages; the left half is the conversation as it happens, the right half the same message lists "
        "after both were stopped and started again on their caches.",
        "",
        f"- **Warm turns** (median TTFT): Barrel {ms(a)} against llama-cpp-python's server {ms(b)} "
        f"({times(b, a)} faster); **after a restart**: {ms(c)} against {ms(d)} ({times(d, c)}).",
        "",
    ]
    method = (__doc__ or "").split("Method. ", 1)[1].replace("\n", " ").strip()
    return "\n".join([*head, table(first, again).markdown(), "Method: " + method, ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.conversation", description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    m = machine()
    t0 = time.monotonic()
    first, again = measure(args.turns, args.reply_tokens)
    text = section(first, again, m, argv, time.monotonic() - t0)
    put_section(args.results, SECTION, text)
    from rich.console import Console

    Console(width=200).print(table(first, again).rich())
    progress(f"wrote the section '{SECTION}' of {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
