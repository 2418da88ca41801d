"""The benchmark suite, section by section; `python -m bench` runs it (see bench/__main__.py).

Each section returns plain data; bench/results.py turns it into RESULTS.md and the plots. Every section
starts its own barreld processes in private directories and stops them before the next one starts.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

from barrelctl.client import Completion
from barreld.names import TIER_NAMES
from bench.harness import Daemon, Tokenizer, median, progress
from bench.llama_ref import CACHES, LlamaSystem
from bench.traces import FULL_STEPS, QUICK_STEPS, Agent, agent_system, chat_system, chat_user, chatml, reply_text
from bench.ttft import BarrelSystem, Results, TierCost, compare, prompts_for


@dataclass(frozen=True)
class Settings:
    quick: bool
    sizes: tuple[int, ...]
    cold: int  # cold prompts per size and system
    reps: int  # warm runs per size and system
    chat_turns: int
    chat_reply_tokens: int
    agents: int
    agent_steps: tuple[str, ...]
    strides: tuple[int, ...] = (256, 2048)
    overhead_reps: int = 5

    @classmethod
    def make(cls, quick: bool) -> Settings:
        if quick:
            return cls(True, (512, 1500), 1, 3, 6, 32, 2, QUICK_STEPS, overhead_reps=3)
        return cls(False, (512, 1024, 1500, 2048, 3500), 1, 5, 12, 48, 3, FULL_STEPS)


# ---- 1. cold vs warm TTFT ---------------------------------------------------------------------------


@dataclass
class TTFTSection:
    results: Results
    costs: dict[str, TierCost]
    sizes: tuple[int, ...]


def section_ttft(tok: Tokenizer, s: Settings) -> TTFTSection:
    prompts = {n: prompts_for(tok, n, s.cold) for n in s.sizes}
    with contextlib.ExitStack() as stack:
        barrel = [stack.enter_context(BarrelSystem(t, drop_variant=True)) for t in TIER_NAMES]
        llama = [stack.enter_context(LlamaSystem(c)) for c in CACHES]
        progress(f"  {len(barrel)} daemons up; {s.cold} cold prompt(s) and {s.reps} warm runs per size, round-robin")
        results = compare([*barrel, *llama], prompts, s.reps)
        costs = {b.tier: b.cost() for b in barrel}
    return TTFTSection(results, costs, s.sizes)


# ---- 2 and 4. multi-turn chat, then the same after a restart --------------------------------------------


@dataclass
class Turn:
    turn: int
    prompt_tokens: int
    path: str
    tier: str
    restored: int
    prefilled: int
    ttft_ms: float
    daemon_ttft_ms: float
    total_ms: float

    @classmethod
    def of(cls, i: int, c: Completion) -> Turn:
        return cls(i, c.prompt_tokens, c.route, c.tier, c.restored, c.prefilled, c.client_ttft_ms, c.timings_ms["ttft"],
                   c.client_total_ms)


@dataclass
class ChatSection:
    cached: list[Turn] = field(default_factory=list)
    cold: list[Turn] = field(default_factory=list)
    restarted: list[Turn] = field(default_factory=list)
    reply_tokens: int = 0

    @staticmethod
    def total(turns: list[Turn], what: str = "total_ms") -> float:
        return sum(getattr(t, what) for t in turns)

    @staticmethod
    def restored_fraction(turns: list[Turn]) -> float:
        prompt = sum(t.prompt_tokens for t in turns)
        return sum(t.restored for t in turns) / prompt if prompt else float("nan")


def section_chat(tok: Tokenizer, s: Settings) -> ChatSection:
    """The conversation runs on a daemon with the cache (disk tier, default policy); each turn's prompt is
    also sent, right after, to a daemon with no cache at all (min_tokens = infinity, and an unrelated prompt
    before each turn so its live sequence never holds the conversation: every turn there is a full cold
    prefill). Then the cached daemon is restarted and the recorded turns are sent again (section 4)."""
    out = ChatSection(reply_tokens=s.chat_reply_tokens)
    system = chat_system(tok)
    messages = [("system", system)]
    prompts: list[str] = []
    with Daemon("chat", tier="disk") as cached, Daemon("chat-cold", tier="disk",
                                                         policy={"min_tokens": "infinity"}) as cold:
        for turn in range(s.chat_turns):
            messages.append(("user", chat_user(tok, turn)))
            prompt = chatml(messages)
            prompts.append(prompt)
            c = cached.complete(prompt, max_tokens=s.chat_reply_tokens)
            out.cached.append(Turn.of(turn + 1, c))
            cold.flush_live(turn)
            k = cold.complete(prompt, max_tokens=s.chat_reply_tokens)
            if k.route != "miss":
                raise RuntimeError(f"the no-cache daemon took path {k.route} on turn {turn + 1}")
            out.cold.append(Turn.of(turn + 1, k))
            messages.append(("assistant", reply_text(c.text)))
            progress(
                f"  turn {turn + 1:2d}: {c.prompt_tokens:5d} tokens, {c.route:<14} restored {c.restored:5d}, "
                f"prefilled {c.prefilled:5d}, ttft {c.client_ttft_ms:7.0f} ms (no cache: {k.client_ttft_ms:7.0f} ms)"
            )
        cold.stop()
        progress("  restarting the cached daemon (SIGTERM, then a new process on the same data dir)")
        cached.restart()
        for i, prompt in enumerate(prompts):
            c = cached.complete(prompt, max_tokens=s.chat_reply_tokens)
            out.restarted.append(Turn.of(i + 1, c))
            if i == 0:
                progress(f"  after restart, turn 1: {c.route} from {c.tier or '-'}, restored {c.restored}, "
                         f"ttft {c.client_ttft_ms:.0f} ms (it was {out.cached[0].ttft_ms:.0f} ms cold)")
    return out


# ---- 3. agent trace ----------------------------------------------------------------------------------


@dataclass
class AgentRequest:
    index: int
    agent: str
    op: str
    turn: Turn


@dataclass
class AgentSection:
    strides: tuple[int, ...]
    agents: int
    steps: tuple[str, ...]
    requests: dict[int, list[AgentRequest]] = field(default_factory=dict)

    def reuse(self, stride: int, op: str | None = None) -> float:
        reqs = [r for r in self.requests[stride] if op is None or r.op == op]
        prompt = sum(r.turn.prompt_tokens for r in reqs)
        return sum(r.turn.restored for r in reqs) / prompt if prompt else float("nan")

    def ttft(self, stride: int) -> list[float]:
        return [r.turn.ttft_ms for r in self.requests[stride]]


def section_agent(tok: Tokenizer, s: Settings) -> AgentSection:
    """Several agents share one daemon (n_seq_max 1) round-robin, as concurrent sessions do: each prompt can
    reuse the live sequence only as far as the shared system prompt, the rest must come from the tiers. The
    same prompts go to one daemon per stride (boundary_align_tokens), request by request; the replies that
    build the history come from the first."""
    out = AgentSection(s.strides, s.agents, s.agent_steps, {st: [] for st in s.strides})
    system = agent_system(tok)
    agents = [Agent(chr(ord("A") + i), tok, system) for i in range(s.agents)]
    with contextlib.ExitStack() as stack:
        daemons = {st: stack.enter_context(Daemon(f"agent-{st}", tier="disk",
                                                  policy={"boundary_align_tokens": st})) for st in s.strides}
        n = 0
        for op in s.agent_steps:
            for a in agents:
                prompt = a.step(op)
                n += 1
                line = []
                reply = None
                for st, d in daemons.items():
                    c = d.complete(prompt, max_tokens=24)
                    reply = reply if reply is not None else c.text
                    out.requests[st].append(AgentRequest(n, a.name, op, Turn.of(n, c)))
                    line.append(f"stride {st}: {c.route} {c.restored}/{c.prompt_tokens} ({c.client_ttft_ms:.0f} ms)")
                a.answered(reply_text(reply))
                progress(f"  request {n:2d} agent {a.name} {op:<6} " + ", ".join(line))
    return out


# ---- 5. cost: the daemon's overhead --------------------------------------------------------------------


@dataclass
class OverheadSection:
    in_process_ms: list[float] = field(default_factory=list)
    socket_ms: list[float] = field(default_factory=list)
    in_process_ttft_ms: list[float] = field(default_factory=list)
    socket_ttft_ms: list[float] = field(default_factory=list)
    daemon_total_ms: list[float] = field(default_factory=list)  # the daemon's own timings_ms.total
    rpc_roundtrip_ms: list[float] = field(default_factory=list)  # a unary DaemonStatus call
    prompt_tokens: int = 0
    completion_tokens: int = 0


def section_overhead(tok: Tokenizer, s: Settings) -> OverheadSection:
    """The same completion (a never-seen 200-token prompt, 32 tokens generated, no cache) through the socket
    and straight into the engine in this process, alternating."""
    from barreld.engine.policy import Policy
    from barreld.engine.registry import ModelRegistry
    from barreld.engine.request import CompletionParams, Done, Failed, Token

    out = OverheadSection()
    reg = ModelRegistry(None, Policy())
    try:
        worker = reg.get("").worker
        with Daemon("overhead", policy={"min_tokens": "infinity"}) as d:
            for i in range(s.overhead_reps + 1):  # the first pair warms both up and is not counted
                prompt = tok.text(200, f"overhead-{i}", head=f"Item {i}: ")
                t0 = time.perf_counter()
                req = worker.submit(CompletionParams(prompt=prompt.encode(), max_tokens=32))
                first = None
                while True:
                    ev = req.events.get()
                    if isinstance(ev, Token) and first is None:
                        first = time.perf_counter()
                    elif isinstance(ev, Done):
                        break
                    elif isinstance(ev, Failed):
                        raise ev.error
                t1 = time.perf_counter()
                c = d.complete(prompt, max_tokens=32)
                r0 = time.perf_counter()
                d.client.daemon_status(timeout=10)
                rt = (time.perf_counter() - r0) * 1000
                if ev.completion_tokens != c.completion_tokens:
                    raise RuntimeError("in-process and socket completions generated different token counts")
                if i == 0:
                    continue
                out.in_process_ms.append((t1 - t0) * 1000)
                out.in_process_ttft_ms.append(((first or t1) - t0) * 1000)
                out.socket_ms.append(c.client_total_ms)
                out.socket_ttft_ms.append(c.client_ttft_ms)
                out.daemon_total_ms.append(c.timings_ms["total"])
                out.rpc_roundtrip_ms.append(rt)
                out.prompt_tokens, out.completion_tokens = c.prompt_tokens, c.completion_tokens
    finally:
        reg.close()
    progress(f"  in-process {median(out.in_process_ms):.0f} ms, through the socket {median(out.socket_ms):.0f} ms "
             f"(medians of {len(out.socket_ms)})")
    return out


def spread(xs: list[float]) -> str:
    if len(xs) < 2:
        return ""
    return f"±{statistics.stdev(xs):.0f}"
