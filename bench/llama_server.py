"""Barrel against llama-server, side by side in one run: an 8-turn chat and the agent trace, live, then both
again after restarting both servers.

    python -m bench.llama_server [--quick] [--turns 8] [--reply-tokens 48] [--results bench/RESULTS.md]

Writes (or replaces) the section "Barrel vs llama-server" of the results file, and its plot llama_server.png
beside that file, leaving the rest as it is. Progress goes to stderr. --quick: 3 turns and the short agent trace.

Build. llama-server is built once from the llama.cpp that the installed llama-cpp-python vendors, into
$XDG_CACHE_HOME/barrel/llama-server (default ~/.cache/barrel/llama-server), and reused from there: the binary
if it is there; else the source distribution llama_cpp_python-VERSION.tar.gz found there is untarred and built
with cmake (-DLLAMA_CURL=OFF, tests and examples off, Release; the llama-server target with every core); else
that file is first fetched with `python -m pip download --no-deps --no-binary :all:
llama-cpp-python==VERSION`: an install step like `pip install`, through pip's own configuration, and the only
network access here. The build keeps CMake's defaults for the CPU (GGML_NATIVE: the instructions of this
machine), as pip's build of llama-cpp-python does, unless the CPU advertises AMX, which some VMs trap (then
the native build dies at its first decode, and tests/portable-llama installs llama-cpp-python built with
barreld's portable flags for this CPU, `decodecheck.cmake_args`): then llama-server is built with those same
flags, into build-portable/. It took about 15 minutes on two cores.

Method. Both servers get the same requests, Barrel first, one at a time, streamed over HTTP on loopback; TTFT is
client-side wall time to the first chunk that carries text. Barrel: barreld's HTTP listener (default policy, disk
tier, one sequence). llama-server: run plain (`-m MODEL -c 4096 -b 512 -np 1 -t N -tb N`, all else its defaults,
`cache_prompt` on, as by default); those defaults include its prompt cache in RAM (`--cache-ram`, 8 GiB), which
gives a slot an earlier prompt back, and flash attention `auto`, which the CPU build turns on (as Barrel's default
does for this full-attention model). Same model file (the bundled SmolLM2), n_ctx 4096, n_batch 512, every core.
The chat is section 2's (a 700-token system message, user messages of 50 to 119 tokens, 48-token greedy replies),
resent in full each turn as messages to `/v1/chat/completions`; each side renders them with the model's chat
template. The agent trace is section 3's (agents sharing a 900-token system prompt take turns; their histories
grow, get a note inserted in the middle, and drop old exchanges), sent as raw ChatML prompts to `/v1/completions`,
24-token greedy replies. The replies that build the histories are Barrel's (both are greedy), so both sides get
identical requests. Then both are stopped (barreld with SIGTERM, so its shutdown saves run), started again (barreld
on the same data dir), and the same requests are sent again. llama-server keeps its prompt cache in memory only
(its `--slot-save-path` is not automatic), so it starts the second pass empty. Tokens restored are each side's own
report: `usage.prompt_tokens_details.cached_tokens` for both, llama-server's `timings.cache_n` beside it (the same
figure); tokens prefilled are Barrel's `barrel.cache.prefilled_tokens` and llama-server's `timings.prompt_n`. After
each reply the client pauses 1 s, as a reader would: Barrel settles its reply in that time (prefills it again as a
prompt, with the template's opening of the next user message, so that the next turn reuses both), and the pause
keeps that work out of the other side's request on these shared cores. """

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from barreld.engine.decodecheck import cmake_args
from barreld.engine.memo import cpu_identity
from bench.harness import MODEL, Daemon, ServerProcess, Tokenizer, machine, median, model_path, progress, sse_events
from bench.http import HTTP_CONFIG, http_port
from bench.report import Table, ms, put_section, ratio, verdict
from bench.suite import Settings
from bench.traces import Agent, agent_system, chat_system, chat_user

SECTION = "llama_server"
AGENT_REPLY_TOKENS = 24  # as section 3
# A reply is read before the next request (a person, or an agent's tool): each side is idle for this long after
# its reply, so neither's idle work (Barrel settles its reply) runs while the other serves.
READ_PAUSE_S = 1.0
TARGET_LIVE = 1.0  # Barrel / llama-server, median TTFT of turns 2+
TARGET_AGENT = 1.0  # Barrel / llama-server, sum of TTFT
TARGET_RESTART = 5.0  # llama-server / Barrel, turn 1 after the restart


# ---- the build ------------------------------------------------------------------------------------------


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "barrel" / "llama-server"


def _run_logged(cmd: list[str], cwd: Path, log: Path) -> None:
    """Runs `cmd`, everything it prints into `log`, its progress lines ("[ 42%] ...") to stderr."""
    progress(" ".join(cmd))
    with open(log, "a") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            out.write(line)
            if line.startswith("["):
                progress("  " + line.rstrip())
        if proc.wait() != 0:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"bench.llama_server: {cmd[0]} failed (exit {proc.returncode}); {log} ends:\n{tail}")


def build() -> Path:
    """The llama-server binary of the installed llama-cpp-python's vendored llama.cpp, built once (see the
    module's docstring); one build at a time, under a lock in the cache directory."""
    version = importlib.metadata.version("llama-cpp-python")
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    src = root / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    flags = cpu_identity()[1]
    portable = cmake_args(flags).split() if any(f.startswith("amx") for f in flags) else []
    out = "build-portable" if portable else "build"
    binary = src / out / "bin" / "llama-server"
    with open(root / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if binary.exists():
            return binary
        sdist = root / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.exists():
            progress(f"fetching the source distribution of llama-cpp-python {version} (an install step)")
            _run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                         f"llama-cpp-python=={version}", "-d", str(root)], root, root / "pip.log")
        if not src.exists():
            progress(f"untarring {sdist.name}")
            with tarfile.open(sdist) as tar:
                tar.extractall(root, filter="data")
        jobs = str(len(os.sched_getaffinity(0)))
        log = root / "cmake.log"
        _run_logged(["cmake", "-S", ".", "-B", out, "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release", *portable], src, log)
        _run_logged(["cmake", "--build", out, "--target", "llama-server", "-j", jobs], src, log)
    return binary


class LlamaServer(ServerProcess):
    """llama-server, run plain: one slot, the model, n_ctx and n_batch of the Barrel side, every core."""

    name = "llama-server"
    ready_path = "/health"

    def __init__(self, workdir: Path, binary: Path, slots: int = 1) -> None:
        super().__init__(workdir)
        self.binary = binary
        self.slots = slots  # -np: each slot gets 4096 cells, as each of Barrel's sequences does

    def command(self, port: int) -> list[str]:
        threads = str(len(os.sched_getaffinity(0)))
        return [str(self.binary), "-m", str(model_path()), "-c", str(4096 * self.slots), "-b", "512",
                "-np", str(self.slots), "-t", threads, "-tb", threads, "--host", "127.0.0.1", "--port", str(port)]


# ---- one request to each side ------------------------------------------------------------------------


@dataclass
class Reply:
    """One streamed reply, with what its server reported about reuse."""

    ttft_ms: float
    text: str
    prompt_tokens: int
    restored: int  # usage.prompt_tokens_details.cached_tokens
    prefilled: int  # Barrel: barrel.cache.prefilled_tokens; llama-server: timings.prompt_n
    detail: str  # Barrel: its lookup route and tier; llama-server: timings.cache_n
    divergence: dict | None = None  # Barrel: barrel.cache.divergence, where it compared the prompt with a text


def stream(port: int, path: str, body: dict, who: str, headers: dict[str, str] | None = None) -> Reply:
    t0 = time.perf_counter()
    first, text, usage, timings, barrel = None, [], {}, {}, {}
    for chunk in sse_events(port, path, body, who, headers):
        choice = chunk["choices"][0] if chunk.get("choices") else {}
        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if piece:
            first = first or time.perf_counter()
            text.append(piece)
        usage = chunk.get("usage") or usage
        timings = chunk.get("timings") or timings
        barrel = chunk.get("barrel") or barrel
    ttft = ((first or time.perf_counter()) - t0) * 1000
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if barrel:
        cache = barrel["cache"]
        return Reply(ttft, "".join(text), usage.get("prompt_tokens", 0), cache["restored_tokens"],
                     cache["prefilled_tokens"], cache["path"] + (f" from {cache['tier']}" if cache.get("tier") else ""),
                     cache.get("divergence"))
    restored = timings.get("cache_n", 0)
    return Reply(ttft, "".join(text), usage.get("prompt_tokens", restored + timings.get("prompt_n", 0)),
                 restored if cached is None else cached, timings.get("prompt_n", 0), f"cache_n {restored}")


@dataclass
class Pair:
    barrel: Reply
    server: Reply


class Sides:
    """Barrel's HTTP listener and llama-server, sent the same requests, Barrel first."""

    def __init__(self, daemon: Daemon, server: LlamaServer) -> None:
        self.daemon, self.server = daemon, server
        self.port = http_port(daemon)

    def restart(self) -> None:
        progress("restarting both: barreld with SIGTERM (shutdown saves), then llama-server")
        self.daemon.restart()
        self.port = http_port(self.daemon)
        self.server.stop()
        self.server.start()

    def send(self, path: str, body: dict) -> Pair:
        body = {"model": MODEL, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                **body}
        b = stream(self.port, path, body, "barreld")
        time.sleep(READ_PAUSE_S)
        s = stream(self.server.port, path, {**body, "cache_prompt": True}, self.server.name)
        time.sleep(READ_PAUSE_S)
        return Pair(b, s)


def _show(label: str, p: Pair) -> None:
    b, s = p.barrel, p.server
    progress(f"  {label}: {b.prompt_tokens} tokens; Barrel {b.detail} restored {b.restored} prefilled "
             f"{b.prefilled} ttft {b.ttft_ms:.0f} ms; llama-server restored {s.restored} prefilled {s.prefilled} "
             f"ttft {s.ttft_ms:.0f} ms")


# ---- the run ----------------------------------------------------------------------------------------------


@dataclass
class Pass:
    chat: list[Pair] = field(default_factory=list)
    agent: list[Pair] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # agent:step per agent request


@dataclass
class Workload:
    """The requests of the first pass, for the second: chat bodies, then agent bodies, with their labels."""

    chat: list[dict] = field(default_factory=list)
    agent: list[dict] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)


def first_pass(sides: Sides, tok: Tokenizer, turns: int, reply_tokens: int, s: Settings) -> tuple[Pass, Workload]:
    """The chat and the agent trace as they happen, grown by Barrel's replies."""
    out, work = Pass(), Workload()
    messages = [{"role": "system", "content": chat_system(tok)}]
    for i in range(turns):
        messages.append({"role": "user", "content": chat_user(tok, i)})
        work.chat.append({"messages": list(messages), "max_tokens": reply_tokens})
        out.chat.append(sides.send("/v1/chat/completions", work.chat[-1]))
        _show(f"chat turn {i + 1}", out.chat[-1])
        messages.append({"role": "assistant", "content": out.chat[-1].barrel.text})
    system = agent_system(tok)
    agents = [Agent(chr(ord("A") + i), tok, system) for i in range(s.agents)]
    for op in s.agent_steps:
        for a in agents:
            work.agent.append({"prompt": a.step(op), "max_tokens": AGENT_REPLY_TOKENS})
            work.labels.append(f"{a.name}:{op}")
            out.agent.append(sides.send("/v1/completions", work.agent[-1]))
            _show(f"agent request {len(out.agent)} ({work.labels[-1]})", out.agent[-1])
            a.answered(out.agent[-1].barrel.text)
    out.labels = work.labels
    return out, work


def replay(sides: Sides, work: Workload) -> Pass:
    out = Pass(labels=work.labels)
    for i, body in enumerate(work.chat):
        out.chat.append(sides.send("/v1/chat/completions", body))
        _show(f"after restart, chat turn {i + 1}", out.chat[-1])
    for i, body in enumerate(work.agent):
        out.agent.append(sides.send("/v1/completions", body))
        _show(f"after restart, agent request {i + 1} ({work.labels[i]})", out.agent[-1])
    return out


def measure(binary: Path, turns: int, reply_tokens: int, s: Settings) -> tuple[Pass, Pass]:
    tok = Tokenizer()
    with tempfile.TemporaryDirectory(prefix="bench-llama-server-") as work, \
            Daemon(SECTION, config=HTTP_CONFIG) as daemon:
        server = LlamaServer(Path(work), binary)
        try:
            server.start()
            sides = Sides(daemon, server)
            progress(f"barreld (HTTP port {sides.port}) and llama-server (port {server.port}) up")
            live, requests = first_pass(sides, tok, turns, reply_tokens, s)
            sides.restart()
            again = replay(sides, requests)
        finally:
            server.stop()
    return live, again


# ---- the section --------------------------------------------------------------------------------------------


@dataclass
class Summary:
    live_barrel: float
    live_server: float
    live_per_turn: float  # the median of each live turn's own ratio: two medians of bimodal turns can flip
    agent_barrel: float
    agent_server: float
    restart_barrel: float
    restart_server: float
    slower_after_restart: list[str]

    @classmethod
    def of(cls, live: Pass, again: Pass) -> Summary:
        slower = [f"turn {i + 1}" for i, p in enumerate(again.chat) if p.barrel.ttft_ms > p.server.ttft_ms]
        slower += [f"agent {i + 1}" for i, p in enumerate(again.agent) if p.barrel.ttft_ms > p.server.ttft_ms]
        return cls(median([p.barrel.ttft_ms for p in live.chat[1:]]), median([p.server.ttft_ms for p in live.chat[1:]]),
                   median([p.barrel.ttft_ms / p.server.ttft_ms for p in live.chat[1:]]),
                   sum(p.barrel.ttft_ms for p in live.agent), sum(p.server.ttft_ms for p in live.agent),
                   again.chat[0].barrel.ttft_ms, again.chat[0].server.ttft_ms, slower)


def summary_table(sm: Summary, again: Pass, turns: int) -> Table:
    t = Table("Barrel against llama-server, same requests, same run",
              ["", "Barrel", "llama-server", "Barrel / llama-server", "target", ""])
    t.add(f"live chat, median TTFT of turns 2-{turns}", ms(sm.live_barrel), ms(sm.live_server),
          ratio(sm.live_barrel, sm.live_server), f"≤ {TARGET_LIVE:.1f}x",
          verdict(sm.live_barrel <= TARGET_LIVE * sm.live_server))
    t.add(f"live chat, median of each turn's own ratio, turns 2-{turns}", "", "", ratio(sm.live_per_turn, 1.0), "", "")
    t.add(f"agent trace, sum of TTFT ({len(again.agent)} requests)", ms(sm.agent_barrel), ms(sm.agent_server),
          ratio(sm.agent_barrel, sm.agent_server), f"≤ {TARGET_AGENT:.1f}x",
          verdict(sm.agent_barrel <= TARGET_AGENT * sm.agent_server))
    t.add("after the restart, chat turn 1", ms(sm.restart_barrel), ms(sm.restart_server),
          ratio(sm.restart_barrel, sm.restart_server), f"Barrel ≥ {TARGET_RESTART:.0f}x faster",
          verdict(sm.restart_server >= TARGET_RESTART * sm.restart_barrel))
    agent_b, agent_s = (sum(getattr(p, w).ttft_ms for p in again.agent) for w in ("barrel", "server"))
    t.add("after the restart, agent trace, sum of TTFT", ms(agent_b), ms(agent_s), ratio(agent_b, agent_s), "", "")
    t.add("after the restart, requests where Barrel is slower", "", "",
          ", ".join(sm.slower_after_restart) or "none", "none", verdict(not sm.slower_after_restart))
    t.note = ("Ratios are Barrel's time over llama-server's (below 1: Barrel is faster), measured in this one run; "
              "absolute times are this machine's.")
    return t


def turns_table(title: str, pairs: list[Pair], labels: list[str]) -> Table:
    t = Table(title, ["", "prompt tokens (Barrel / llama-server)", "Barrel path", "Barrel TTFT",
                      "llama-server TTFT", "Barrel / llama-server", "restored (Barrel / llama-server)",
                      "prefilled (Barrel / llama-server)"])
    for label, p in zip(labels, pairs, strict=True):
        b, s = p.barrel, p.server
        server = str(s.restored) if s.detail == f"cache_n {s.restored}" else f"{s.restored} ({s.detail})"
        t.add(label, f"{b.prompt_tokens} / {s.prompt_tokens}", b.detail, ms(b.ttft_ms), ms(s.ttft_ms),
              ratio(b.ttft_ms, s.ttft_ms), f"{b.restored} / {server}", f"{b.prefilled} / {s.prefilled}")
    return t


def tables(live: Pass, again: Pass) -> list[Table]:
    turns = [f"turn {i + 1}" for i in range(len(live.chat))]
    out = [summary_table(Summary.of(live, again), again, len(live.chat)),
           turns_table("Chat, live: per turn", live.chat, turns),
           turns_table("Chat, after restarting both: per turn", again.chat, turns),
           turns_table("Agent trace, live: per request", live.agent, live.labels),
           turns_table("Agent trace, after restarting both: per request", again.agent, again.labels)]
    out[1].note = ("Restored: each side's `cached_tokens` (llama-server's `timings.cache_n` is the same figure); "
                   "prefilled: Barrel's `prefilled_tokens`, llama-server's `timings.prompt_n`.")
    return out


def plot(live: Pass, again: Pass, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, len(live.agent) * 0.45), 8))
    for ax, what, xlabels in ((a, "chat", [str(i + 1) for i in range(len(live.chat))]), (b, "agent", live.labels)):
        x = list(range(len(xlabels)))
        for run, style, when in ((live, "-", "live"), (again, "--", "after restart")):
            pairs = getattr(run, what)
            ax.plot(x, [p.barrel.ttft_ms / 1000 for p in pairs], "o" + style, color="tab:green",
                    label=f"Barrel, {when}")
            ax.plot(x, [p.server.ttft_ms / 1000 for p in pairs], "s" + style, color="tab:red",
                    label=f"llama-server, {when}")
        ax.set_yscale("log")
        ax.set_ylabel("time to first token (s, log)")
        ax.set_xticks(x, xlabels, rotation=0 if what == "chat" else 60, fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    a.set_title("Barrel vs llama-server: chat turns (top), agent trace requests (bottom)")
    a.set_xlabel("chat turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(live: Pass, again: Pass, m: dict, argv: list[str], elapsed: float, png: str) -> str:
    command = " ".join(["python -m bench.llama_server", *argv])
    method = (__doc__ or "").split("Method. ", 1)[1].replace("\n", " ").strip()
    ts = tables(live, again)
    return "\n".join([
        "## Barrel vs llama-server", "",
        f"Generated by `{command}`, in {elapsed / 60:.1f} min (load average at start: {m['load']}); "
        f"llama-server built from the llama.cpp of llama-cpp-python {m['llama-cpp-python']}.", "",
        f"![Barrel vs llama-server]({png})", "",
        ts[0].markdown(), ts[1].markdown(), ts[2].markdown(),
        "<details><summary>Agent trace, every request</summary>", "", ts[3].markdown(), ts[4].markdown(),
        "</details>", "", "Method: " + method, ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.llama_server", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 chat turns and the short agent trace (a smoke run)")
    p.add_argument("--turns", type=int, help="chat turns (default 8, 3 with --quick)")
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    args = p.parse_args(argv)
    s = Settings.make(args.quick)
    turns = args.turns or (3 if args.quick else 8)
    binary = build()
    m = machine()
    progress(f"llama-server: {binary}; {turns} chat turns, {s.agents} agents x {len(s.agent_steps)} steps")
    t0 = time.monotonic()
    live, again = measure(binary, turns, args.reply_tokens, s)
    elapsed = time.monotonic() - t0
    png = args.results.parent / f"{SECTION}.png"
    plot(live, again, png)
    put_section(args.results, SECTION, section(live, again, m, argv, elapsed, png.name))
    from rich.console import Console

    console = Console(width=200)
    for t in tables(live, again)[:3]:
        console.print(t.rich())
    progress(f"wrote the section '{SECTION}' of {args.results} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
