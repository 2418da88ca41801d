"""The HTTP API against gRPC: warm time to first token for the same cache hit in the same run, and eight
concurrent streaming clients of the real `openai` SDK.

Run from the repository root: `python -m bench.http [--pairs N]` (about four minutes on two cores). It prints
its tables and writes them as the `http` section of bench/RESULTS.md, leaving the rest of the file alone
(`python -m bench` keeps the section when it rewrites the rest).

1. One daemon (one sequence), one ~1,000-token prompt. Each pair sends it once through gRPC (barrelctl's
   client) and once through HTTP (a kept-alive connection, /v1/completions, streamed), in alternating order:
   the same prompt resent is served from the live sequence; with an unrelated prompt sent before each, it is
   an exact hit from the disk tier. TTFT is the client's: from sending the request to the first text.
2. Eight threads, each with its own openai.OpenAI client, stream a chat turn at once (four sequences, so half
   of them queue), then their second turns at once.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from bench.harness import Daemon, Tokenizer, machine, median, progress
from bench.report import Table, ms, put_section, verdict

HTTP_CONFIG = '[http]\nlisten = "127.0.0.1:0"\n'
BUDGET_MS = 2.0
CLIENTS = 8
# Saves and prefix boundaries small enough for 150-token turns, so second turns can start warm.
SMALL_SAVES = {"min_tokens": 128, "cold_min_tokens": 128, "boundary_trim_tokens": 16, "boundary_align_tokens": 64}
console = Console()


@dataclass
class Sample:
    ttft_ms: float
    route: str
    server_ttft_ms: float


def http_port(d: Daemon) -> int:
    return int(d.client.daemon_status(timeout=10).http.rpartition(":")[2])


class RawHttp:
    """One kept-alive HTTP/1.1 connection, read by hand, so that the client's own parsing (http.client's
    header and chunk parsing costs about as much as the server's work) stays out of the figure."""

    FIRST_TEXT = re.compile(rb'"text":"[^"]')
    CHUNK = re.compile(rb"data: (\{[^\n]*\})\n")

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=600)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def completion(self, prompt: str) -> Sample:
        first, buf = self.post("/v1/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 4,
                                                   "temperature": 0, "stream": True}, self.FIRST_TEXT)
        barrel = json.loads(self.CHUNK.findall(buf)[-1])["barrel"]
        return Sample(first, barrel["cache"]["path"], barrel["timings_ms"]["ttft"])

    def post(self, path: str, doc: dict, first_text: re.Pattern[bytes]) -> tuple[float, bytes]:
        """(ms from sending to the first bytes `first_text` matches, the whole chunked body) of a streamed POST."""
        body = json.dumps(doc).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        self.sock.sendall(head + body)
        buf, first = b"", None
        while not buf.endswith(b"\r\n0\r\n\r\n"):
            data = self.sock.recv(65536)
            if not data:
                raise SystemExit("bench: the daemon closed the connection")
            buf += data
            if first is None and first_text.search(buf):
                first = time.perf_counter()
        return ((first or time.perf_counter()) - t0) * 1000, buf

    def close(self) -> None:
        self.sock.close()


def via_grpc(d: Daemon, prompt: str) -> Sample:
    c = d.client.complete(prompt.encode(), model="smollm2", max_tokens=4, timeout=600).result()
    return Sample(c.client_ttft_ms, c.route, c.timings_ms["ttft"])


def pairs_of(d: Daemon, raw: RawHttp, prompt: str, pairs: int, flush: bool) -> list[tuple[Sample, Sample]]:
    """(gRPC, HTTP) samples, the two of a pair sent back to back in alternating order, so that a slow spell
    of a shared machine falls on both."""
    out = []
    for i in range(pairs):
        got = {}
        for way in ("grpc", "http") if i % 2 == 0 else ("http", "grpc"):
            if flush:
                d.flush_live(i)
            got[way] = via_grpc(d, prompt) if way == "grpc" else raw.completion(prompt)
        out.append((got["grpc"], got["http"]))
    return out


def ttft_section(tok: Tokenizer, pairs: int) -> Table:
    prompt = tok.text(1000, "http-bench")
    t = Table("Warm time to first token: HTTP against gRPC, same prompt, same hit, same run",
              ["hit", "gRPC", "HTTP", "HTTP - gRPC", "outside the engine (gRPC / HTTP)",
               f"HTTP within {BUDGET_MS:g} ms"])
    with Daemon("http-ttft", config=HTTP_CONFIG) as d:
        raw = RawHttp(http_port(d))
        d.complete(prompt, max_tokens=4)  # the cold prefill; every later request is warm
        for hit, flush in (("live", False), ("exact", True)):
            got = pairs_of(d, raw, prompt, pairs, flush)
            routes = {s.route for pair in got for s in pair}
            if routes != {hit}:
                raise SystemExit(f"bench.http: expected only {hit} hits, got {sorted(routes)}")
            g, h = (median([pair[w].ttft_ms for pair in got]) for w in (0, 1))
            diff = median([hs.ttft_ms - gs.ttft_ms for gs, hs in got])
            og, oh = (median([pair[w].ttft_ms - pair[w].server_ttft_ms for pair in got]) for w in (0, 1))
            t.add(f"{hit} (1,000 tokens)", ms(g), ms(h), f"{diff:+.2f} ms", f"{og:.2f} / {oh:.2f} ms",
                  verdict(diff <= BUDGET_MS))
            progress(f"{hit}: gRPC {g:.2f} ms, HTTP {h:.2f} ms, paired difference {diff:+.2f} ms")
        raw.close()
    t.note = (f"{pairs} pairs, the two of a pair back to back, the order alternating. gRPC: barrelctl's client over "
              "the Unix socket. HTTP: one kept-alive loopback connection read by hand, /v1/completions streamed. "
              "TTFT is the client's, from sending the request to the first text; gRPC and HTTP are its medians, "
              "HTTP - gRPC the median of the pairs' differences. 'Outside the engine' is the median of each "
              "request's client TTFT less the daemon's own `timings_ms.ttft` (from the request reaching the "
              "worker to its first token): the front end's and the transport's share. The worker hands HTTP's events "
              "straight to the event loop that writes the socket, and the connections run with TCP_NODELAY (without "
              "it, back-to-back requests on one connection waited about 40 ms for delayed ACKs). 'exact' sends an "
              "unrelated prompt before each request, so that the prompt comes back from the disk tier rather "
              "than from the live sequence.")
    return t


@dataclass
class ClientRun:
    ttft_ms: float = float("nan")
    total_ms: float = float("nan")
    tokens: int = 0
    cached: int = 0
    finish: str = "none"
    error: str = ""


def one_client(base: str, messages: list[dict], start: threading.Barrier, out: ClientRun) -> None:
    import openai

    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    start.wait()
    t0 = time.perf_counter()
    try:
        text = []
        for chunk in client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32,
                                                    temperature=0, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                if not text:
                    out.ttft_ms = (time.perf_counter() - t0) * 1000
                text.append(chunk.choices[0].delta.content)
            elif chunk.choices and chunk.choices[0].finish_reason:
                out.finish = chunk.choices[0].finish_reason
            elif chunk.usage:
                out.tokens, out.cached = chunk.usage.completion_tokens, chunk.usage.prompt_tokens_details.cached_tokens
        out.total_ms = (time.perf_counter() - t0) * 1000
        messages.append({"role": "assistant", "content": "".join(text)})
    except Exception as exc:  # noqa: BLE001 - reported in the table
        out.error = f"{type(exc).__name__}: {exc}"


def round_of(base: str, histories: list[list[dict]]) -> tuple[list[ClientRun], float]:
    runs = [ClientRun() for _ in histories]
    start = threading.Barrier(len(histories))
    threads = [threading.Thread(target=one_client, args=(base, h, start, r)) for h, r in zip(histories, runs,
                                                                                            strict=True)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return runs, time.perf_counter() - t0


def concurrency_section(tok: Tokenizer) -> Table:
    t = Table(f"{CLIENTS} concurrent streaming openai SDK clients (4 sequences)",
              ["round", "completed", "median TTFT", "max TTFT", "median total", "tokens/s (all)",
               "cached tokens (median)"])
    with Daemon("http-conc", config=HTTP_CONFIG, n_seq_max=4, policy=SMALL_SAVES) as d:
        base = f"http://127.0.0.1:{http_port(d)}/v1"
        histories = [[{"role": "user", "content": tok.text(150, f"client {i}") + " Summarise."}]
                     for i in range(CLIENTS)]
        for name in ("first turns", "second turns"):
            runs, wall = round_of(base, histories)
            done = [r for r in runs if not r.error and r.finish in ("stop", "length")]
            for r in runs:
                if r.error:
                    progress(f"a client failed: {r.error}")
            t.add(name, f"{len(done)}/{CLIENTS}", ms(median([r.ttft_ms for r in done])),
                  ms(max((r.ttft_ms for r in done), default=float("nan"))), ms(median([r.total_ms for r in done])),
                  f"{sum(r.tokens for r in done) / wall:.0f}", f"{median([r.cached for r in done]):.0f}")
            progress(f"{name}: {len(done)}/{CLIENTS} completed in {wall:.1f} s")
            for h in histories:
                h.append({"role": "user", "content": "Now in one sentence."})
    t.note = ("Each client streams a chat turn of about 150 prompt tokens (32 generated) with stream_options."
              "include_usage, all released at once; the second round resends each conversation with the reply "
              "and one more message. Four clients run at a time, the others wait in the model's queue. Policy: "
              + ", ".join(f"{k} = {v}" for k, v in SMALL_SAVES.items()) + ".")
    return t


def write_section(path: Path, tables: list[Table], m: dict, elapsed: float) -> None:
    """The tables as RESULTS.md's `http` section, which `python -m bench` keeps when it rewrites the rest."""
    body = ["## HTTP API", "",
            f"Generated by `python -m bench.http` on {m['date']}, in {elapsed / 60:.1f} min (load average at "
            f"start: {m['load']}).", ""]
    put_section(path, "http", "\n".join(body + [tb.markdown() for tb in tables]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=20, help="gRPC/HTTP pairs per hit (default 20)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    m = machine()
    t0 = time.monotonic()
    tok = Tokenizer()
    progress(f"1/2 warm TTFT, HTTP against gRPC, {args.pairs} pairs per hit")
    tables = [ttft_section(tok, args.pairs)]
    progress(f"2/2 {CLIENTS} concurrent streaming SDK clients")
    tables.append(concurrency_section(tok))
    for tb in tables:
        console.print(tb.rich())
    write_section(args.out, tables, m, time.monotonic() - t0)
    progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
