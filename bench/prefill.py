"""Cold prefill of a long agent head against llama-server, side by side in one run, with each barreld setting the
issue names as a suspect: what each costs per token.

    python -m bench.prefill [--tokens 12000] [--rounds 3] [--results bench/RESULTS.md]

Writes (or replaces) the section "prefill" of the results file. Progress goes to stderr.

Method. The head is Codex CLI's first request as tests/data/codex-request.json holds it (its instructions, its
tools as JSON, the user's turn), written out as plain text and cut to `--tokens` tokens of the model's own
tokenizer (repeated first where it is shorter; SmolLM2, whose context is 8k, at most 8,000), so every server reads
the same tokens. Each server gets it as a raw prompt, one token to generate, nothing cached (another first line
each round; llama-server also gets `cache_prompt: false`), `--rounds` times: every server is started once and
asked in an order that rotates. Prefill tokens/s is the prompt's tokens over the server's own prefill time:
barreld's timings_ms.prefill, llama-server's timings.prompt_ms. Models: Gemma 3 270M (sliding-window attention,
a 32k context) and SmolLM2 (full attention, 8k). barreld variants: its defaults (swa_full off, the window layers
a ring put back in order after every prefill call; flash attention on for full attention, off for a window
in a ring; prefill chunks of 128 = n_batch / 4, a prefill alone taking as many chunks a llama.cpp call
as n_batch holds where the load-time probe proves that exact), then one knob set at a time: swa_full on,
flash attention on, off, one chunk a call (`reuse_grain = 128`: no probe, so nothing proven).
llama-server: `-c N -b 512` and its defaults (flash attention `auto`, which is on here), every core. Beside them
the floor (bench.prefill_floor, a child process): the same prompt through barreld's backend in a loop, in the
calls barreld's defaults make, with no server around it; barreld's defaults over the floor are what the daemon
adds to llama.cpp's own work. Medians of the rounds, in one run: read the ratios, not the seconds.
"""

from __future__ import annotations

import functools
import http.client
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.harness import begin, median, model_path, progress
from bench.llama_server import LlamaServer, build
from bench.report import Table, bench_parser, ratio, show_and_put
from tests.support.sandbox import Sandbox
from tests.support.sandbox_models import gemma_path

SECTION = "prefill"
HEAD = Path(__file__).resolve().parents[1] / "tests" / "data" / "codex-request.json"
VARIANTS = {  # name: (model knobs, policy knobs)
    "barreld defaults": ("", ""),
    "swa_full on": ("swa_full = true\n", ""),
    "flash attention on": ("flash_attn = true\n", ""),
    "flash attention off": ("flash_attn = false\n", ""),
    "one chunk a call": ("", "reuse_grain = 128\n"),
}
LLAMA = "llama-server"
FLOOR = "llama.cpp alone, barreld's backend in a loop (its defaults)"
SMOLLM2_TOKENS = 8000  # its context is 8k


@dataclass(frozen=True)
class Model:
    name: str
    path: Path
    n_ctx: int
    sliding: bool


def head_text() -> str:
    doc = json.loads(HEAD.read_text())
    parts = [doc.get("instructions") or ""]
    parts += [c["text"] for item in doc["input"] for c in item.get("content", []) if "text" in c]
    parts.append(json.dumps(doc["tools"], indent=2))
    return "\n\n".join(p for p in parts if p)


def prompt_of(model: Model, tokens: int) -> tuple[str, int]:
    """The head cut to `tokens` of this model's tokens, as text, and its length in tokens as llama.cpp reads it."""
    from barreld.engine.backend import ContextSettings
    from barreld.engine.llama_backend import LlamaBackend

    backend = LlamaBackend(model.path, ContextSettings(n_ctx=256))
    text = head_text()
    ids = backend.tokenize(text.encode())
    while len(ids) < tokens:
        text += "\n\n" + head_text()
        ids = backend.tokenize(text.encode())
    cut = b"".join(backend.piece(t) for t in ids[1:tokens]).decode("utf-8", "ignore")  # ids[0] is BOS
    n = len(backend.tokenize(cut.encode()))
    backend.close()
    return cut, n


def round_prompt(prompt: str, r: int) -> str:
    """The head for round r: another first line each round, so no server finds anything of it cached."""
    return f"Request {r + 1}.\n{prompt}"


class Barreld:
    """One barreld variant, started once and asked each round."""

    def __init__(self, model: Model, knobs: str, policy: str) -> None:
        config = (f"{policy}\n[[models]]\nname = \"{model.name}\"\npath = \"{model.path}\"\n"
                  f"n_ctx = {model.n_ctx}\n{knobs}")
        self.model = model
        self.box = Sandbox.new(config, label="bench-prefill")
        self.box.start_daemon("--log-level", "warning", timeout=180)
        self.client = self.box.client()

    def rate(self, prompt: str) -> float:
        done = self.client.complete(prompt.encode(), model=self.model.name, max_tokens=1, timeout=900).result()
        assert done.restored == 0, done.route
        return done.prefilled / (done.timings_ms["prefill"] / 1000)

    def close(self) -> None:
        self.client.close()
        self.box.close()


class GemmaServer(LlamaServer):
    def __init__(self, workdir: Path, binary: Path, model: Model) -> None:
        super().__init__(workdir, binary)
        self.model = model

    def command(self, port: int) -> list[str]:
        cmd = super().command(port)
        cmd[cmd.index("-m") + 1] = str(self.model.path)
        cmd[cmd.index("-c") + 1] = str(self.model.n_ctx)
        return cmd

    def rate(self, prompt: str) -> float:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=900)
        body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_prompt": False}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        timings = json.loads(conn.getresponse().read())["timings"]
        conn.close()
        return timings["prompt_n"] / (timings["prompt_ms"] / 1000)


def floor_rate(model: Model, work: Path, prompt: str) -> float:
    """bench.prefill_floor's tokens/s for this prompt on barreld's default settings, in a child process."""
    text = work / "prompt.txt"
    text.write_text(prompt)
    flags = ["--no-flash-attn"] if model.sliding else []  # barreld's default: off for a window in a ring
    out = subprocess.run([sys.executable, "-m", "bench.prefill_floor", str(model.path), str(text), str(model.n_ctx),
                          *flags], capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout)["rate"]


def measure(tokens: int, rounds: int) -> Table:
    binary = build()
    models = [Model("gemma", gemma_path(), 32768, True), Model("smollm2", model_path(), 8192, False)]
    t = Table(f"Cold prefill of Codex CLI's head, about {tokens:,} tokens (SmolLM2: {SMOLLM2_TOKENS:,}), tokens/s",
              ["model", "server", "prompt tokens", "prefill tokens/s", "vs llama-server"])
    for model in models:
        prompt, n = prompt_of(model, tokens if model.sliding else min(tokens, SMOLLM2_TOKENS))
        names = [v for v in VARIANTS if model.sliding or v != "swa_full on"]
        rates: dict[str, list[float]] = {LLAMA: [], FLOOR: [], **{v: [] for v in names}}
        with tempfile.TemporaryDirectory(prefix="barrel-bench-prefill-") as work:
            progress(f"{model.name}: starting llama-server and {len(names)} barreld")
            server = GemmaServer(Path(work), binary, model)
            server.start()
            daemons: dict[str, Barreld] = {}
            try:
                for v in names:
                    knobs, policy = VARIANTS[v]
                    daemons[v] = Barreld(model, knobs, f"[policy]\n{policy}" if policy else "")
                sides = {LLAMA: server.rate, FLOOR: functools.partial(floor_rate, model, Path(work)),
                         **{v: d.rate for v, d in daemons.items()}}
                order = list(sides)
                for r in range(rounds):
                    for name in order[r % len(order):] + order[: r % len(order)]:
                        progress(f"{model.name}, round {r + 1}/{rounds}: {name}")
                        rates[name].append(sides[name](round_prompt(prompt, r)))
            finally:
                server.stop()
                for d in daemons.values():
                    d.close()
        ls = median(rates[LLAMA])
        t.add(model.name, LLAMA, f"{n:,}", f"{ls:.0f}", "1.00x")
        for v in names:
            t.add(model.name, f"barreld, {v}", f"{n:,}", f"{median(rates[v]):.0f}", ratio(median(rates[v]), ls))
        t.add(model.name, FLOOR, f"{n:,}", f"{median(rates[FLOOR]):.0f}", ratio(median(rates[FLOOR]), ls))
    t.note = (f"Medians of {rounds} rounds, the servers' order rotating; each request cold (another first line "
              "each round), one token generated; prefill time as each server reports it. barreld's defaults are "
              "swa_full off and flash attention on for SmolLM2 (full attention), off for Gemma's ring (on with "
              "swa_full, as the 'swa_full on' row runs), "
              "chunks of n_batch / 4 = 128 and, for a prefill alone, as many chunks a call as n_batch (512) holds "
              "where the probe proves it exact; each other row sets one of them. llama-server's flash attention "
              "`auto` is on here.")
    return t


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = bench_parser("bench.prefill", __doc__, SECTION)
    p.add_argument("--tokens", type=int, default=12000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    m, t0 = begin()
    tb = measure(args.tokens, args.rounds)
    show_and_put(tb, args.results, SECTION, "Cold prefill of an agent head against llama-server", "bench.prefill", argv,
                 t0, m["load"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
