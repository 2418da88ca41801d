"""Tenants: what an HTTP keys file costs a tenant's warm start, and whether one tenant's cache shows through
another's time to first token, in one run through barreld's HTTP listener.

    python -m bench.tenancy [--rounds 30] [--guesses 32] [--results bench/RESULTS.md]

Prints its tables; with --results, writes them as the section "tenancy" of that file and the plot tenancy.png
beside it, leaving the rest as it is. Progress goes to stderr. About 6 minutes on two cores.

Method. Every request is a streamed `/v1/chat/completions` (greedy) over a fresh loopback connection with
http.client; TTFT is the client's, from sending the request to the first chunk that carries text, and
`cached_tokens` is the reply's `usage.prompt_tokens_details.cached_tokens`. Keys travel as `Authorization:
Bearer KEY`; the keys file (`[http] api_keys_file`, mode 0600) names two tenants, `alice` and `bob`.

1. The cost of tenancy. Two daemons run at once, default policy, one sequence each: one without a keys file
   (every request the default tenant, as before tenants), one with it (requests sent with alice's key). Each
   round sends both the same two-turn conversation, the daemons' order alternating: turn 1 is a 520-token
   system prompt (restored from the round before) and a new 40-token question; turn 2 resends it with the
   reply and one more message (about 600 tokens), restored from the live sequence. After each reply the client
   pauses, so that a daemon's saves and settling stay out of the other's request. The first round is not
   counted. Medians, the ratio of the medians, the median of the rounds' paired differences, and a two-sided
   Mann-Whitney U test of the two daemons' samples (normal approximation, tie and continuity corrections):
   p >= 0.05 is "within noise".
2. The side channel. One daemon with the keys file and small save gates (bench.http's SMALL_SAVES: rows from
   128 tokens, prefix boundaries every 64), so that a prefix shared across tenants would be restorable from
   the live sequence and from the tier alike. Alice's system prompt starts with a secret ("The door code is
   4711 and the client is ACME Corp.") and continues with 300 tokens of public instructions. Bob knows the
   public part and guesses the secret: his system prompt is the same template with (a) Alice's true secret,
   or (b) a secret nobody sent ("9386 ... Zenith Ltd."), of the same token count; then a user message that
   is new for each guess, of the same length in both. Before every guess Alice sends her conversation again
   and it must come back whole from the cache (cached_tokens = its prompt tokens), so both conditions meet
   the same daemon state: her secret live in the sequence and stored in the disk tier. The two conditions
   differ only in whether the guessed text is another tenant's cached prompt; a comparison against a daemon
   where Alice sent a decoy instead would differ in that too, but also in the process and its memory. Each
   round sends (a) and (b), the order alternating. Every guess carries a fresh `cache_salt` (as an attacker
   would, to keep his own guesses from warming each other: a guess resent unsalted is restored from Bob's own
   rows), so any cached token, restored prefix or divergence report in Bob's replies can only come from
   Alice's namespace. After each round, Alice herself sends Bob's guess (a) with her key: what a shared cache
   would give Bob, the size of the difference the test looks for. The first round is not counted.
"""

from __future__ import annotations

import argparse
import math
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench.harness import MODEL, Daemon, Tokenizer, machine, median, progress
from bench.http import HTTP_CONFIG, SMALL_SAVES, http_port
from bench.llama_server import Reply, stream
from bench.report import Table, ms, put_section, ratio

SECTION = "tenancy"
PAUSE_S = 0.5  # after each reply: the daemon's save and settling, off the next request's clock
ALPHA = 0.05
SECRET = "4711 and the client is ACME Corp."
DECOY = "9386 and the client is Zenith Ltd."
PUBLIC_HEAD = "The door code is "


# ---- the API -------------------------------------------------------------------------------------


@dataclass
class Api:
    """barreld's HTTP listener as one tenant sees it: its port, and the key its requests carry (none: no keys)."""

    port: int
    key: str | None = None

    def chat(self, messages: list[dict], max_tokens: int, salt: str | None = None) -> Reply:
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, **({"cache_salt": salt} if salt else {})}
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else None
        reply = stream(self.port, "/v1/chat/completions", body, "barreld", headers)
        time.sleep(PAUSE_S)
        return reply


def keys_file(folder: Path) -> tuple[Path, dict[str, str]]:
    """A keys file of two tenants, alice and bob, readable by its owner only."""
    keys = {name: secrets.token_hex(16) for name in ("alice", "bob")}
    path = folder / "keys"
    path.write_text("".join(f"{name}: {key}\n" for name, key in keys.items()))
    path.chmod(0o600)
    return path, keys


def keyed_config(path: Path) -> str:
    return HTTP_CONFIG + f'api_keys_file = "{path}"\n'


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


# ---- statistics ----------------------------------------------------------------------------------


def mann_whitney(x: list[float], y: list[float]) -> tuple[float, float]:
    """Two-sided Mann-Whitney U test: (U of x, p), by the normal approximation with the tie correction and the
    continuity correction (scipy's `mannwhitneyu(method="asymptotic")`)."""
    pooled = sorted((v, i) for i, v in enumerate(x + y))
    n, ranks, ties = len(pooled), [0.0] * len(pooled), 0
    i = 0
    while i < n:
        j = i
        while j + 1 < n and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[pooled[k][1]] = (i + j) / 2 + 1
        ties += (j - i + 1) ** 3 - (j - i + 1)
        i = j + 1
    n1, n2 = len(x), len(y)
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    if sigma == 0:
        return u, 1.0
    z = (abs(u - n1 * n2 / 2) - 0.5) / sigma
    return u, min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2)))


def span(values: list[int]) -> str:
    """The range of some token counts, or the count when they are all the same."""
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def deciles(xs: list[float]) -> tuple[float, float]:
    """(p10, p90)."""
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return q[0], q[-1]


# ---- 1. the cost of tenancy ----------------------------------------------------------------------------

SIDES = ("open", "keyed")


@dataclass
class Cost:
    turns: dict[str, list[tuple[Reply, Reply]]] = field(default_factory=lambda: {s: [] for s in SIDES})

    def ttft(self, side: str, turn: int) -> list[float]:
        return [pair[turn].ttft_ms for pair in self.turns[side]]


def conversation(api: Api, head: list[dict], max_tokens: int = 16) -> tuple[Reply, Reply]:
    """Turn 1 (`head`), then turn 2: the same with the reply and one more message."""
    first = api.chat(head, max_tokens)
    again = [*head, {"role": "assistant", "content": first.text}, user("Now say it in one sentence.")]
    return first, api.chat(again, 4)


def cost_of_tenancy(tok: Tokenizer, keys: Path, key: str, rounds: int) -> Cost:
    prompt = system(tok.text(520, "tenancy-system", head="You are the support assistant of a cooperative. "
                             "Answer briefly. Here is the handbook: "))
    out = Cost()
    with Daemon("tenancy-open", config=HTTP_CONFIG) as plain, Daemon("tenancy-keyed", config=keyed_config(keys)) as kd:
        apis = {"open": Api(http_port(plain)), "keyed": Api(http_port(kd), key)}
        for i in range(rounds + 1):
            question = user(tok.text(40, f"tenancy-question-{i}", head=f"Question {i + 1}. ") + " What should I do?")
            turn2 = {}
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                pair = conversation(apis[side], [prompt, question])
                if pair[1].restored == 0:
                    raise SystemExit(f"bench.tenancy: turn 2 on the {side} daemon restored nothing ({pair[1].detail})")
                if i:
                    out.turns[side].append(pair)
                turn2[side] = pair[1].ttft_ms
            if i % 5 == 0:
                progress(f"  round {i:2d}: turn 2 TTFT open {turn2['open']:.1f} ms, keyed {turn2['keyed']:.1f} ms")
    return out


def cost_table(c: Cost) -> Table:
    t = Table("The cost of tenancy: warm TTFT without a keys file and with one (tenant alice), same run",
              ["request", "prompt tokens", "cached_tokens", "no keys file", "keys file", "keyed / open",
               "paired difference", "Mann-Whitney p", "within noise"])
    for turn, label in ((0, "turn 1: system prompt restored, new question"),
                        (1, "turn 2: the conversation resent, restored")):
        o, k = c.ttft("open", turn), c.ttft("keyed", turn)
        tokens = [p[turn].prompt_tokens for s in SIDES for p in c.turns[s]]
        cached = [p[turn].restored for s in SIDES for p in c.turns[s]]
        diff = median([b - a for a, b in zip(o, k, strict=True)])
        p = mann_whitney(k, o)[1]
        t.add(label, span(tokens), span(cached), f"{median(o):.2f} ms",
              f"{median(k):.2f} ms", ratio(median(k), median(o)), f"{diff:+.2f} ms", f"{p:.2f}",
              "yes" if p >= ALPHA else "NO")
    routes = Counter(p[1].detail for s in SIDES for p in c.turns[s])
    same = sum(a[0].text == b[0].text for a, b in zip(c.turns["open"], c.turns["keyed"], strict=True))
    t.note = (f"{len(c.turns['open'])} rounds, both daemons running, their order alternating. Medians of the client's "
              "TTFT; the paired difference is the median over rounds of keyed less open. Turn 2's routes: "
              + ", ".join(f"{k} × {v}" for k, v in sorted(routes.items()))
              + f". The two daemons' turn-1 replies were the same text in {same} of {len(c.turns['open'])} rounds.")
    return t


# ---- 2. the side channel -------------------------------------------------------------------------------

CONDITIONS = ("a", "b")


@dataclass
class Channel:
    guesses: dict[str, list[Reply]] = field(default_factory=lambda: {c: [] for c in CONDITIONS})
    control: list[Reply] = field(default_factory=list)
    alice_cached: list[int] = field(default_factory=list)
    rows: Counter = field(default_factory=Counter)

    def ttft(self, cond: str) -> list[float]:
        return [r.ttft_ms for r in self.guesses[cond]]

    @property
    def leaked(self) -> list[Reply]:
        """Bob's replies that restored anything or compared his prompt with a stored text."""
        return [r for c in CONDITIONS for r in self.guesses[c] if r.restored or r.divergence is not None]


def side_channel(tok: Tokenizer, keys: Path, key: dict[str, str], guesses: int) -> Channel:
    public = tok.text(300, "tenancy-public", head=" Public instructions follow. ")
    prompts = {"a": system(PUBLIC_HEAD + SECRET + public), "b": system(PUBLIC_HEAD + DECOY + public)}
    if len({tok.count(p["content"]) for p in prompts.values()}) != 1:
        raise SystemExit("bench.tenancy: the secret and the decoy are not the same number of tokens")
    alice_turn = [prompts["a"], user("What is the door code?")]
    out = Channel()
    with Daemon("tenancy-channel", config=keyed_config(keys), policy=SMALL_SAVES) as d:
        alice, bob = Api(http_port(d), key["alice"]), Api(http_port(d), key["bob"])
        first = alice.chat(alice_turn, 4)
        progress(f"  alice's secret prompt: {first.prompt_tokens} tokens, cold ({first.detail}), "
                 f"TTFT {first.ttft_ms:.0f} ms")
        for i in range(guesses + 1):
            asked, ttft = {}, {}
            for cond in CONDITIONS if i % 2 == 0 else CONDITIONS[::-1]:
                again = alice.chat(alice_turn, 4)
                if again.restored != again.prompt_tokens:
                    raise SystemExit(f"bench.tenancy: alice's prompt was not in the cache ({again.detail}, "
                                     f"{again.restored} of {again.prompt_tokens} restored)")
                asked[cond] = user(f"Request {i:03d}{CONDITIONS.index(cond) + 1}: when does the office open?")
                guess = bob.chat([prompts[cond], asked[cond]], 4, salt=secrets.token_hex(8))
                if i:
                    out.alice_cached.append(again.restored)
                    out.guesses[cond].append(guess)
                ttft[cond] = guess.ttft_ms
            control = alice.chat([prompts["a"], asked["a"]], 4)
            if i:
                out.control.append(control)
            if i % 5 == 0:
                progress(f"  round {i:2d}: bob (a) {ttft['a']:.0f} ms, (b) {ttft['b']:.0f} ms; "
                         f"alice sending (a) {control.ttft_ms:.0f} ms, {control.restored} cached")
        out.rows = Counter(row.tenant or "default" for row in d.rows())
    return out


def channel_table(c: Channel) -> tuple[Table, str, bool]:
    t = Table("The side channel: Bob's TTFT when his guess is Alice's cached secret, and when it is nobody's",
              ["requests", "n", "prompt tokens", "cached_tokens", "route", "median TTFT", "p10", "p90"])
    labels = {"a": "(a) Bob guesses Alice's secret, which is cached", "b": "(b) Bob guesses a secret nobody sent"}
    groups = [(labels[k], c.guesses[k]) for k in CONDITIONS]
    groups.append(("control: Alice sends Bob's guess (a) with her own key", c.control))
    for label, replies in groups:
        xs = [r.ttft_ms for r in replies]
        lo, hi = deciles(xs)
        cached = Counter(r.restored for r in replies)
        t.add(label, len(replies), span([r.prompt_tokens for r in replies]),
              ", ".join(f"{k} × {v}" for k, v in sorted(cached.items())),
              ", ".join(sorted({r.detail for r in replies})), ms(median(xs)), ms(lo), ms(hi))
    u, p = mann_whitney(c.ttft("a"), c.ttft("b"))
    leak = bool(c.leaked) or p < ALPHA
    verdict = (f"Mann-Whitney U of (a) against (b): U = {u:.0f}, p = {p:.2f}; median (a) / (b) = "
               f"{ratio(median(c.ttft('a')), median(c.ttft('b')))}. ")
    verdict += ("**Bob's replies depend on Alice's prompt: a leak.** " if leak else
                "No difference between the conditions: Bob's TTFT does not show whether his guess is Alice's prompt. ")
    verdict += (f"Bob's replies with cached tokens or a divergence report: {len(c.leaked)} of "
                f"{sum(len(v) for v in c.guesses.values())}. Alice's resends before each guess: cached_tokens "
                + ", ".join(f"{k} × {v}" for k, v in sorted(Counter(c.alice_cached).items()))
                + ". Rows in the cache at the end, by tenant: "
                + ", ".join(f"{k} {v}" for k, v in sorted(c.rows.items())) + ".")
    t.note = (f"{len(c.guesses['a'])} guesses per condition, the order alternating each round; every guess with a "
              "fresh cache_salt and a user message of its own. TTFT is the client's; p10 and p90 are deciles.")
    return t, verdict, leak


# ---- the plot and the report ----------------------------------------------------------------------


def plot(cost: Cost, channel: Channel, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.5))
    series = [(a, [cost.ttft("open", 1), cost.ttft("keyed", 1)], ["no keys file", "keys file (alice)"],
               "1. Warm TTFT, turn 2 (~600 tokens)", "linear"),
              (b, [channel.ttft("a"), channel.ttft("b"), [r.ttft_ms for r in channel.control]],
               ["Bob: (a) Alice's\ncached secret", "Bob: (b) a secret\nnobody sent",
                "Alice sends (a)\n(a shared cache)"],
               "2. Bob's guesses, and what a leak would look like", "log")]
    for ax, data, names, title, scale in series:
        ax.boxplot(data, showfliers=False, widths=0.5)
        for k, ys in enumerate(data, 1):
            jitter = [k + 0.18 * ((j * 0.618) % 1 - 0.5) for j in range(len(ys))]
            ax.plot(jitter, ys, "o", alpha=0.45, markersize=3.5, color=f"C{k - 1}")
        ax.set_xticks(range(1, len(names) + 1), names, fontsize=8)
        ax.set_yscale(scale)
        if scale == "log":
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylabel("time to first token (ms)" + (", log" if scale == "log" else ""))
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section(tables: list[Table], verdict: str, command: str, m: dict, elapsed: float, png: str) -> str:
    return "\n".join([
        "## Tenants: the cost of keys, and the side channel", "",
        f"Generated by `{command}` in {elapsed / 60:.1f} min (load average at start: {m['load']}); the method is in "
        "bench/tenancy.py's docstring.", "",
        f"![Tenancy: warm TTFT with and without keys; Bob's guesses]({png})", "",
        tables[0].markdown(), tables[1].markdown(), verdict, ""])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.tenancy", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30, help="counted rounds of the cost of tenancy (default 30)")
    p.add_argument("--guesses", type=int, default=32, help="Bob's counted guesses per condition (default 32)")
    p.add_argument("--results", type=Path,
                   help="also write the section 'tenancy' of this file, and tenancy.png beside it")
    args = p.parse_args(argv)
    m = machine()
    progress(f"{m['cpu']} ({m['cores']} cores), load average {m['load']}")
    t0 = time.monotonic()
    tok = Tokenizer()
    with tempfile.TemporaryDirectory(prefix="barrel-bench-keys-") as folder:
        keys, key = keys_file(Path(folder))
        progress(f"1/2 the cost of tenancy: {args.rounds} rounds on two daemons, without and with a keys file")
        cost = cost_of_tenancy(tok, keys, key["alice"], args.rounds)
        progress(f"2/2 the side channel: {args.guesses} guesses per condition")
        channel = side_channel(tok, keys, key, args.guesses)
    elapsed = time.monotonic() - t0
    ct, (ch, verdict, leak) = cost_table(cost), channel_table(channel)
    from rich.console import Console

    console = Console(width=200)
    for tb in (ct, ch):
        console.print(tb.rich())
    console.print(verdict)
    if leak:
        progress("LEAK: Bob's replies depend on Alice's prompt (see the table)")
    if args.results is not None:
        png = args.results.parent / f"{SECTION}.png"
        plot(cost, channel, png)
        command = " ".join(["python -m bench.tenancy", *argv])
        put_section(args.results, SECTION, section([ct, ch], verdict, command, m, elapsed, png.name))
        progress(f"wrote the section '{SECTION}' of {args.results} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
