"""A Claude Code session replayed against llama-server and barreld: every call as Claude Code sent it, live, then
the whole session again after restarting both servers.

    python -m bench.claude_session [--capture] [--results bench/RESULTS.md]

Writes (or replaces) the section "claude_session" of the results file, and its plot claude_session.png beside
that file. Progress goes to stderr.

Capture (`--capture`, once; its file is committed). Claude Code (the npm package tests/run installs under
.cache/) runs `claude -p TASK` in a fresh home holding two small files, against a stand-in for the Messages API
on loopback that records every request and answers with a script: for each request that carries tools, the
next of SCRIPT's tool calls (list, read, search, count: Claude Code runs each and sends its result back in the
next request), then a closing text; a request without tools (Claude Code's own side calls) gets a short text.
The requests go to tests/data/claude-code-session.json, as Claude Code sent them.

Replay. Both servers serve Gemma 3 270M with a 32k context and the plain dialogue template the coding-agent
tests use (tests/support/coding_agents.py; llama-server gets the same file as --chat-template-file, and its
defaults otherwise: prompt cache on, flash attention `auto`, one slot). Each recorded request goes to each
server's `/v1/messages` as it is, but not streamed and with `max_tokens` 1, so a call's time is its prompt's:
barreld first, then llama-server, each call's wall time measured by the client, then a 1 s pause, as an agent's
tool would take (barreld settles its reply meanwhile). Tokens prefilled are each server's own count: barreld's
`barrel.cache.prefilled_tokens`, llama-server's `usage.input_tokens` (its prompt less `cache_read_input_tokens`).
On a template that does not mention tools llama-server leaves them out of the prompt, and barreld writes them in
its generic format, so the prompts differ in length (about three times) and so does the cost of a token. A
second llama-server therefore gets barreld's own prompt: each request rendered as barreld renders it (its
chat module, the model's BOS and EOS texts) and sent as text to `/completion` (`cache_prompt` on, one token),
which tokenises it as barreld does (special tokens parsed): the same tokens, as the tables' prompt counts show.
Per prefilled token, barreld is compared with that one; the plain llama-server's figures stand beside. Then
all are stopped (barreld with SIGTERM, so its shutdown saves run) and started again (barreld on its data dir),
and the whole session is sent again, without pauses: its total wall time on each.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from barreld.engine import chat
from barreld.http.anthropic import parse_messages
from bench.harness import begin, progress
from bench.llama_server import build
from bench.prefill import GemmaServer, Model
from bench.report import Table, bench_parser, ratio, show_and_put
from tests.support.coding_agents import agent_bin, agent_run
from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path
from tests.test_http import Daemon
from tests.unit.test_tool_formats import dialogue_template

SECTION = "claude_session"
SESSION = Path(__file__).resolve().parents[1] / "tests" / "data" / "claude-code-session.json"
CLAUDE = agent_bin("claude-code", "claude")
TASK = "Look at the files here: list them, read both, find the TODO lines, count the lines of each, then sum up."
FILES = {
    "notes.md": "# Notes\n\n- The barrel holds the cache.\n- TODO: measure the replay.\n- Restores are exact.\n",
    "plan.txt": "step 1: capture a session\nstep 2: replay it\nTODO: compare per prefilled token\nstep 3: restart\n",
}
SCRIPT = [  # (tool, input): Claude Code's own tools, each run by Claude Code in the session's home
    ("Bash", {"command": "ls -la", "description": "List the files"}),
    ("Read", {"file_path": "{home}/notes.md"}),
    ("Read", {"file_path": "{home}/plan.txt"}),
    ("Grep", {"pattern": "TODO", "path": "{home}", "output_mode": "content"}),
    ("Bash", {"command": "wc -l notes.md", "description": "Count the lines of notes.md"}),
    ("Bash", {"command": "wc -l plan.txt", "description": "Count the lines of plan.txt"}),
    ("Glob", {"pattern": "*.md", "path": "{home}"}),
    ("Bash", {"command": "cat notes.md plan.txt | wc -w", "description": "Count the words of both"}),
]
CLOSING = "Two files, notes.md and plan.txt, each with one TODO line."
PAUSE_S = 1.0
N_CTX = 32768


# ---- capture ------------------------------------------------------------------------------------------


class StandIn(http.server.ThreadingHTTPServer):
    """The Messages API as a script: records each request, answers with the next scripted tool call."""

    def __init__(self, home: Path) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.home = home
        self.requests: list[dict] = []
        self.calls = 0  # scripted answers given to requests that carry tools
        self.lock = threading.Lock()

    def answer(self, body: dict) -> list[dict]:
        """The content blocks of the reply to `body`."""
        with self.lock:
            self.requests.append(body)
            if not body.get("tools"):
                return [{"type": "text", "text": "Files."}]
            step, self.calls = self.calls, self.calls + 1
        if step >= len(SCRIPT):
            return [{"type": "text", "text": CLOSING}]
        name, args = SCRIPT[step]
        filled = {k: v.replace("{home}", str(self.home)) for k, v in args.items()}
        return [{"type": "tool_use", "id": f"toolu_{step:02d}", "name": name, "input": filled}]


class _Handler(http.server.BaseHTTPRequestHandler):
    server: StandIn

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path.split("?")[0].endswith("/count_tokens"):
            return self._json({"input_tokens": 1000})
        blocks = self.server.answer(body)
        stop = "tool_use" if blocks[0]["type"] == "tool_use" else "end_turn"
        message = {"id": f"msg_{len(self.server.requests)}", "type": "message", "role": "assistant",
                   "model": body.get("model", "claude"), "content": blocks, "stop_reason": stop,
                   "stop_sequence": None, "usage": {"input_tokens": 1000, "output_tokens": 20}}
        if body.get("stream"):
            return self._stream(message)
        return self._json(message)

    def _json(self, doc: dict) -> None:
        raw = json.dumps(doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _stream(self, message: dict) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        blocks = message["content"]
        events = [("message_start", {"type": "message_start",
                                     "message": {**message, "content": [], "stop_reason": None}})]
        for i, block in enumerate(blocks):
            if block["type"] == "text":
                start, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
            else:
                start = {**block, "input": {}}
                delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            events += [("content_block_start", {"type": "content_block_start", "index": i, "content_block": start}),
                       ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
                       ("content_block_stop", {"type": "content_block_stop", "index": i})]
        events += [("message_delta", {"type": "message_delta", "delta": {"stop_reason": message["stop_reason"],
                                                                         "stop_sequence": None},
                                      "usage": {"output_tokens": 20}}),
                   ("message_stop", {"type": "message_stop"})]
        for name, data in events:
            self.wfile.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()


def capture() -> Path:
    """Runs Claude Code against the stand-in and writes the requests it sent to SESSION."""
    if not CLAUDE.exists():
        raise SystemExit(f"Claude Code is not installed at {CLAUDE}: run tests/run, which installs it with npm")
    home = Path(f"/tmp/barrel-claude-session-{os.getuid()}")
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(mode=0o700)
    for name, text in FILES.items():
        (home / name).write_text(text)
    server = StandIn(home)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = agent_run(CLAUDE, ["-p", TASK, "--allowedTools", "Bash Read Glob Grep"], home,
                         ("ANTHROPIC_", "CLAUDE_"), ANTHROPIC_BASE_URL=f"http://127.0.0.1:{server.server_address[1]}",
                         ANTHROPIC_API_KEY="unused", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
                         CLAUDE_CODE_MAX_OUTPUT_TOKENS="256", DISABLE_AUTOUPDATER="1")
    finally:
        server.shutdown()
    if done.returncode != 0 or server.calls <= len(SCRIPT):
        raise SystemExit(f"Claude Code exited {done.returncode} after {server.calls} scripted calls:\n"
                         f"{done.stdout[-500:]}\n{done.stderr[-1500:]}")
    version = subprocess.run([str(CLAUDE), "--version"], capture_output=True, text=True).stdout.strip()
    doc = {"claude_code": version, "task": TASK, "requests": server.requests}
    SESSION.write_text(json.dumps(doc, indent=1) + "\n")
    progress(f"captured {len(server.requests)} requests ({server.calls} with tools) from Claude Code {version}")
    return SESSION


# ---- replay -------------------------------------------------------------------------------------------


@dataclass
class Call:
    wall_s: float
    prompt: int  # the prompt's tokens, as the server counted them
    prefilled: int
    timings_ms: dict[str, float] = field(default_factory=dict)  # barreld's own: lookup, restore, prefill, ...


def post(port: int, path: str, sent: dict, headers: dict[str, str] | None = None) -> tuple[float, dict]:
    """One JSON request to a server on loopback: (wall seconds, the reply)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(sent), {"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    raw = resp.read()
    wall = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{path} answered {resp.status}: {raw[:300]!r}")
    return wall, json.loads(raw)


def messages(port: int, body: dict) -> tuple[float, dict]:
    """A recorded request to /v1/messages, not streamed, one token."""
    return post(port, "/v1/messages", {**body, "stream": False, "max_tokens": 1}, {"anthropic-version": "2023-06-01"})


def barreld_call(port: int, body: dict) -> Call:
    wall, doc = messages(port, body)
    cache = doc["barrel"]["cache"]
    return Call(wall, cache["restored_tokens"] + cache["prefilled_tokens"], cache["prefilled_tokens"],
                doc["barrel"]["timings_ms"])


def llama_call(port: int, body: dict) -> Call:
    wall, doc = messages(port, body)
    usage = doc["usage"]
    return Call(wall, usage["input_tokens"] + usage.get("cache_read_input_tokens", 0), usage["input_tokens"])


@dataclass(frozen=True)
class Renderer:
    """A Messages request as the prompt barreld makes of it: its chat module, this model's BOS and EOS."""

    template: str
    bos: str
    eos: str

    @classmethod
    def of(cls, template: str, model: Path) -> Renderer:
        from llama_cpp import Llama

        vocab = Llama(str(model), vocab_only=True, verbose=False)
        special = [vocab.detokenize([t], special=True).decode() for t in (vocab.token_bos(), vocab.token_eos())]
        return cls(template, *special)

    def prompt(self, body: dict) -> str:
        req = parse_messages({**body, "max_tokens": 1})
        return chat.render(self.template, req.messages, bos=self.bos, eos=self.eos, model="gemma", tools=req.tools,
                           options=dict(req.template_options)).decode()


def same_prompt_call(port: int, prompt: str) -> Call:
    """barreld's prompt, as text, to llama-server's /completion: its own count of tokens cached and prefilled."""
    wall, doc = post(port, "/completion", {"prompt": prompt, "n_predict": 1, "cache_prompt": True, "temperature": 0})
    timings = doc["timings"]
    return Call(wall, timings["cache_n"] + timings["prompt_n"], timings["prompt_n"])


class TemplatedServer(GemmaServer):
    def __init__(self, workdir: Path, binary: Path, model: Model, template: Path) -> None:
        super().__init__(workdir, binary, model)
        self.template = template

    def command(self, port: int) -> list[str]:
        return [*super().command(port), "--jinja", "--chat-template-file", str(self.template)]


def barreld_config(template: Path) -> str:
    return (f'\n[[models]]\nname = "gemma"\npath = "{gemma_path()}"\nn_ctx = {N_CTX}\naliases = ["claude-*"]\n'
            f'chat_template = "{template}"\nstop = ["\\n"]\n')


@dataclass
class Side:
    """One server of the replay: how a recorded request goes to it."""

    name: str
    send: Callable[[int], Call]  # the recorded request of this index


def measure() -> tuple[list[tuple[Call, ...]], tuple[float, ...], int, str]:
    """The live calls, (barreld, llama-server given barreld's prompt, llama-server as it is) each, the whole
    session's time on each after the restart, and barreld's reuse rule for the model (its probe's verdict)."""
    requests = json.loads(SESSION.read_text())["requests"]
    binary = build()
    with tempfile.TemporaryDirectory(prefix="barrel-bench-claude-") as work:
        template = Path(work) / "dialogue.jinja"
        template.write_text(dialogue_template())
        renderer = Renderer.of(template.read_text(), gemma_path())
        prompts = [renderer.prompt(body) for body in requests]
        model = Model("gemma", gemma_path(), N_CTX, True)
        for name in ("ls", "same"):
            (Path(work) / name).mkdir()
        plain = TemplatedServer(Path(work) / "ls", binary, model, template)
        same = GemmaServer(Path(work) / "same", binary, model)
        with Sandbox.new(barreld_config(template), label="bench-claude") as box:
            progress("starting barreld and two llama-servers")
            barreld = Daemon(box)
            rule = box.ctl("--json", "models").json()["models"][0]["exact_reuse"]["rule"]
            servers = (same, plain)
            for server in servers:
                server.start()
            try:
                sides = [Side("barreld", lambda i: barreld_call(barreld.port, requests[i])),
                         Side("llama-server, barreld's prompt", lambda i: same_prompt_call(same.port, prompts[i])),
                         Side("llama-server", lambda i: llama_call(plain.port, requests[i]))]
                live = []
                for i in range(len(requests)):
                    progress(f"live, call {i + 1}/{len(requests)}")
                    calls = []
                    for side in sides:
                        calls.append(side.send(i))
                        time.sleep(PAUSE_S)
                    live.append(tuple(calls))
                progress("restarting all three")
                proc = box.procs[-1]
                proc.send_signal(signal.SIGTERM)
                proc.wait(120)
                for server in servers:
                    server.stop()
                barreld = Daemon(box)
                for server in servers:
                    server.start()
                totals = []
                for side in sides:
                    progress(f"after the restart: the whole session on {side.name}")
                    totals.append(sum(side.send(i).wall_s for i in range(len(requests))))
            finally:
                for server in servers:
                    server.stop()
    return live, tuple(totals), len(requests), rule


def split(call: Call) -> str:
    """Where a barreld call's wall time went: finding and restoring its prefix, the prefill, and the rest
    (rendering the template, tokenising, sampling, HTTP)."""
    t = call.timings_ms
    found, prefill = t["lookup"] + t["restore"], t["prefill"]
    return f"{found:.0f}, {prefill:.0f}, {call.wall_s * 1000 - found - prefill:.0f}"


def rate(call: Call) -> float:
    return call.prefilled / call.wall_s


def tables(live: list[tuple[Call, ...]], totals: tuple[float, ...], n: int, rule: str) -> list[Table]:
    per_call = Table("A Claude Code session, call by call, live: barreld against llama-server given barreld's prompt",
                     ["call", "prompt: barreld", "llama-server", "prefilled: barreld", "llama-server", "s: barreld",
                      "llama-server", "time: barreld / llama-server", "tokens/s prefilled: barreld", "llama-server",
                      "barreld / llama-server", "barreld: lookup + restore, prefill, rest (ms)"])
    for i, (ours, theirs, _) in enumerate(live, 1):
        per_call.add(str(i), f"{ours.prompt:,}", f"{theirs.prompt:,}", f"{ours.prefilled:,}", f"{theirs.prefilled:,}",
                     f"{ours.wall_s:.2f}", f"{theirs.wall_s:.2f}", ratio(ours.wall_s, theirs.wall_s),
                     f"{rate(ours):.0f}", f"{rate(theirs):.0f}", ratio(rate(ours), rate(theirs)), split(ours))
    later = [sum(c.wall_s for c in side) for side in zip(*live[1:], strict=True)] if len(live) > 1 else [0.0] * 3
    per_call.note = (f"Calls 2-{len(live)}: barreld {later[0]:.1f} s, llama-server {later[1]:.1f} s. Wall time per "
                     "call at the client, one token generated; tokens prefilled as each server counts them. "
                     "llama-server gets the text barreld's template makes of each request at /completion. Each "
                     "prompt extends the one before; llama-server resumes at that prompt's end, barreld where "
                     f"its reuse probe proves Gemma's ring exact before it ({rule}).")
    plain = Table("The same calls to llama-server's /v1/messages, which leaves the tools out of its prompt",
                  ["call", "prompt", "prefilled", "s", "tokens/s prefilled", "barreld / llama-server, per token"])
    for i, (ours, _, theirs) in enumerate(live, 1):
        plain.add(str(i), f"{theirs.prompt:,}", f"{theirs.prefilled:,}", f"{theirs.wall_s:.2f}", f"{rate(theirs):.0f}",
                  ratio(rate(ours), rate(theirs)))
    plain.note = (f"Calls 2-{len(live)}: {later[2]:.1f} s. Its template does not mention tools, so its model could "
                  "not call them: a shorter prompt, where a token costs less.")
    restart = Table("The whole session after restarting all three",
                    ["server", "calls", "total s", "vs llama-server, barreld's prompt", "vs llama-server"])
    for name, total in zip(("barreld", "llama-server, barreld's prompt", "llama-server"), totals, strict=True):
        restart.add(name, str(n), f"{total:.1f}", ratio(total, totals[1]), ratio(total, totals[2]))
    restart.note = ("barreld restores from its disk tier what its shutdown saved; llama-server keeps its prompt "
                    "cache in memory only and starts empty.")
    return [per_call, plain, restart]


def plot(live: list[tuple[Call, ...]], totals: tuple[float, ...], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    x = list(range(1, len(live) + 1))
    names = ("barreld", "llama-server, barreld's prompt", "llama-server, tools left out")
    colors = ("tab:green", "tab:red", "tab:orange")
    for side, (name, color) in enumerate(zip(names, colors, strict=True)):
        a.bar([i + (side - 1) * 0.27 for i in x], [calls[side].wall_s for calls in live], 0.27, color=color,
              label=name)
    a.set_yscale("log")
    a.set_xticks(x)
    a.set_xlabel("Claude Code's call")
    a.set_ylabel("wall time of the call (s, log)")
    a.set_title("Live: each call as Claude Code sent it")
    a.legend(fontsize=8)
    a.grid(True, axis="y", which="both", alpha=0.3)
    b.bar(["barreld", "same prompt", "tools out"], totals, color=colors)
    b.set_ylabel("the whole session (s)")
    b.set_title("After restarting all three")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = bench_parser("bench.claude_session", __doc__, SECTION)
    p.add_argument("--capture", action="store_true", help="run Claude Code against the stand-in first")
    args = p.parse_args(argv)
    m, t0 = begin()
    if args.capture or not SESSION.exists():
        capture()
    live, totals, n, rule = measure()
    heading = "A Claude Code session against llama-server"
    if args.results is not None:
        png = args.results.parent / f"{SECTION}.png"
        plot(live, totals, png)
        heading += f"\n\n![{heading}]({png.name})"
    show_and_put(tables(live, totals, n, rule), args.results, SECTION, heading, "bench.claude_session", argv, t0,
                 m["load"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
