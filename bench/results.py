"""RESULTS.md and the plots, generated from one run's data; nothing here is edited by hand."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from barreld.names import TIER_NAMES
from bench.harness import median
from bench.llama_ref import CACHES, METHODS
from bench.report import Table, frac, generated_at, kept_sections, ms, pct, times
from bench.suite import AgentSection, ChatSection, OverheadSection, Settings, TTFTSection
from bench.ttft import BarrelSystem

WARM = BarrelSystem.WARM
DROPPED = BarrelSystem.DROPPED
ACCEPT_SIZE = 1500  # a long agent turn: the prompt length the warm-vs-cold targets are stated for


def best_llama(r, cache: str, n: int, what: str = "ttft_ms") -> float:
    return min(r.warm_ms(cache, m, n, what) for m in METHODS)


# ---- tables ---------------------------------------------------------------------------------------


def ttft_tables(sec: TTFTSection) -> list[Table]:
    r = sec.results
    absolute = Table("Time to first token (medians)",
                     ["prompt tokens", *(f"Barrel {t} cold" for t in TIER_NAMES[:1]),
                      *(f"{t} warm" for t in TIER_NAMES), "disk warm, page cache dropped",
                      *(f"{c} cold" for c in CACHES), *(f"{c} warm" for c in CACHES)])
    for n in sec.sizes:
        absolute.add(
            r.prompt_tokens(n), ms(r.cold_ms("Barrel ram", n)),
            *(ms(r.warm_ms(f"Barrel {t}", WARM, n)) for t in TIER_NAMES), ms(r.warm_ms("Barrel disk", DROPPED, n)),
            *(ms(r.cold_ms(c, n)) for c in CACHES), *(ms(best_llama(r, c, n)) for c in CACHES),
        )
    absolute.note = ("Barrel cold is shown for the ram daemon; every tier's cold is in the ratio table's "
                     "denominators. llama-cpp-python warm is the faster of its two methods (fresh instance, or "
                     "the same instance after an unrelated prompt), to the first streamed token.")
    ratios = Table("Ratios (same run): warm / cold per tier, and how many times faster Barrel's warm start is",
                   ["prompt tokens", *(f"{t} warm/cold" for t in TIER_NAMES),
                    "ram vs LlamaRAMCache (TTFT)", "ram vs LlamaRAMCache (whole call)",
                    "disk vs LlamaDiskCache (TTFT)", "disk vs LlamaDiskCache (whole call)"])
    for n in sec.sizes:
        ram, disk = r.warm_ms("Barrel ram", WARM, n), r.warm_ms("Barrel disk", WARM, n)
        ratios.add(
            r.prompt_tokens(n),
            *(frac(r.warm_ms(f"Barrel {t}", WARM, n), r.cold_ms(f"Barrel {t}", n)) for t in TIER_NAMES),
            times(best_llama(r, "LlamaRAMCache", n), ram), times(best_llama(r, "LlamaRAMCache", n, "call_ms"), ram),
            times(best_llama(r, "LlamaDiskCache", n), disk),
            times(best_llama(r, "LlamaDiskCache", n, "call_ms"), disk),
        )
    ratios.note = ("Targets: warm ≤ 1/50 of cold from ram, ≤ 1/30 from disk with the page cache warm; "
                   "Barrel ≥ 10x faster than llama-cpp-python's caches. 'TTFT' compares first streamed tokens; "
                   "'whole call' compares Barrel's first token with the return of llama-cpp-python's "
                   "`llm(prompt, max_tokens=1)`, which writes the state back to its cache before returning.")
    detail = Table("Barrel warm starts in detail (medians): where the time goes",
                   ["prompt tokens", "tier", "client TTFT", "daemon's ttft", "restore", "re-evaluate last tokens",
                    "cold (this tier)"])
    for n in sec.sizes:
        for t in TIER_NAMES:
            for v in (WARM, DROPPED):
                if not r.warm[(f"Barrel {t}", v, n)]:
                    continue
                name = f"Barrel {t}"
                detail.add(r.prompt_tokens(n), t + (f" ({v})" if t == "disk" else ""), ms(r.warm_ms(name, v, n)),
                           ms(r.warm_ms(name, v, n, "daemon_ttft_ms")), ms(r.warm_ms(name, v, n, "restore_ms")),
                           ms(r.warm_ms(name, v, n, "prefill_ms")), ms(r.cold_ms(name, n)))
    detail.note = ("'restore' and 're-evaluate last tokens' are the daemon's timings_ms.restore and .prefill. A "
                   "finish checkpoint keeps the logits of its prompt's last position, so an exact hit samples "
                   "without any decode; a checkpoint without them needs the prompt's last two tokens re-evaluated "
                   "(a one-token batch is not bit-identical to a batched prefill).")
    return [absolute, ratios, detail]


def chat_tables(sec: ChatSection) -> list[Table]:
    t = Table("Per turn: the conversation resent in full, no parent_key",
              ["turn", "prompt tokens", "path", "restored", "prefilled", "TTFT with cache", "TTFT no cache",
               "after restart: path", "TTFT after restart"])
    for c, k, a in zip(sec.cached, sec.cold, sec.restarted, strict=True):
        t.add(c.turn, c.prompt_tokens, c.path, c.restored, c.prefilled, ms(c.ttft_ms), ms(k.ttft_ms),
              f"{a.path} ({a.tier})" if a.tier else a.path, ms(a.ttft_ms))
    s = Table("Whole conversation", ["", "with cache", "no cache", "speedup", "after restart"])
    s.add("prompt tokens restored", pct(sec.restored_fraction(sec.cached)), pct(sec.restored_fraction(sec.cold)),
          "", pct(sec.restored_fraction(sec.restarted)))
    s.add("sum of TTFT", ms(sec.total(sec.cached, "ttft_ms")), ms(sec.total(sec.cold, "ttft_ms")),
          times(sec.total(sec.cold, "ttft_ms"), sec.total(sec.cached, "ttft_ms")),
          ms(sec.total(sec.restarted, "ttft_ms")))
    s.add("total time (all turns, replies included)", ms(sec.total(sec.cached)), ms(sec.total(sec.cold)),
          times(sec.total(sec.cold), sec.total(sec.cached)), ms(sec.total(sec.restarted)))
    s.note = (f"Replies are at most {sec.reply_tokens} tokens, greedy. 'No cache': a daemon with "
              "`min_tokens = \"infinity\"` that gets an unrelated prompt before each turn, so its live sequence never "
              "holds the conversation; every turn there is a full cold prefill (path miss, checked). 'With cache': "
              "default policy, disk tier; after the first turn each turn extends the previous prompt and reply, "
              "which the live sequence still holds.")
    return [t, s]


def restart_table(sec: ChatSection) -> Table:
    first_cold, first_after = sec.cached[0], sec.restarted[0]
    t = Table("After a daemon restart (disk tier): the first turn",
              ["", "path", "restored", "prefilled", "TTFT"])
    t.add("turn 1, first time (cold)", first_cold.path, first_cold.restored, first_cold.prefilled,
          ms(first_cold.ttft_ms))
    t.add("turn 1 after restart", f"{first_after.path} ({first_after.tier or '-'})", first_after.restored,
          first_after.prefilled, ms(first_after.ttft_ms))
    paths = Counter(f"{a.path}" + (f" ({a.tier})" if a.tier else "") for a in sec.restarted)
    t.note = ("The daemon was stopped with SIGTERM (shutdown saves) and a new process started on the same data "
              "dir; the recorded turns were then sent again. Paths over all turns after the restart: "
              + ", ".join(f"{k} × {v}" for k, v in sorted(paths.items())) + ".")
    return t


def agent_tables(sec: AgentSection) -> list[Table]:
    t = Table("Reuse ratio (restored / prompt tokens) and TTFT per stride",
              ["boundary_align_tokens", "requests", "prompt tokens", "restored", "reuse ratio", "median TTFT",
               "sum of TTFT", "paths"])
    for st in sec.strides:
        reqs = sec.requests[st]
        paths = Counter(r.turn.path for r in reqs)
        t.add(st, len(reqs), sum(r.turn.prompt_tokens for r in reqs), sum(r.turn.restored for r in reqs),
              pct(sec.reuse(st)), ms(median(sec.ttft(st))), ms(sum(sec.ttft(st))),
              ", ".join(f"{k} {v}" for k, v in sorted(paths.items())))
    t.note = (f"{sec.agents} agents share one daemon (n_seq_max 1) and a 900-token system prompt, taking turns; "
              f"each runs the steps {', '.join(sec.steps)}. 'insert' puts a tool result in the middle of the "
              "history (after the task); 'drop' removes old exchanges. The same prompts go to both daemons.")
    ops = Table("Reuse ratio by step", ["step", *(f"stride {st}" for st in sec.strides)])
    for op in dict.fromkeys(sec.steps):
        ops.add(op, *(pct(sec.reuse(st, op)) for st in sec.strides))
    per = Table("Every request", ["#", "agent", "step", "prompt tokens",
                                  *(f"stride {st}: path, restored, TTFT" for st in sec.strides)])
    for i, r in enumerate(sec.requests[sec.strides[0]]):
        per.add(r.index, r.agent, r.op, r.turn.prompt_tokens,
                *(f"{q.turn.path}, {q.turn.restored}, {ms(q.turn.ttft_ms)}"
                  for q in (sec.requests[st][i] for st in sec.strides)))
    return [t, ops, per]


def cost_tables(costs: dict, ov: OverheadSection) -> list[Table]:
    t = Table("What the tiers hold, and what saving costs",
              ["tier", "checkpoints", "bytes per prompt token", "saves", "mean save", "save throughput"])
    for tier, c in costs.items():
        t.add(tier, c.rows, f"{c.bytes_per_token:,.0f}", c.saves, ms(c.save_ms_each), f"{c.save_mb_s:,.0f} MB/s")
    t.note = ("From the section 1 daemons: `cache dump` rows (size / tokens; a checkpoint holds the KV state, the "
              "tokens, the rendered text and the last logits) and the counters `save_ns` and `saves_*` (time on a "
              "writer thread from reservation to publish, fdatasync included for the file tiers). Saves are "
              "asynchronous: they do not delay the reply.")
    o = Table("The daemon's overhead: one completion through the socket vs the same engine call in-process",
              ["", "in-process", "through the socket", "overhead"])
    o.add("time to first token", ms(median(ov.in_process_ttft_ms)), ms(median(ov.socket_ttft_ms)),
          ms(median(ov.socket_ttft_ms) - median(ov.in_process_ttft_ms)))
    o.add("whole completion", ms(median(ov.in_process_ms)), ms(median(ov.socket_ms)),
          ms(median(ov.socket_ms) - median(ov.in_process_ms)))
    o.add("the daemon's own total vs the client's", "", ms(median(ov.daemon_total_ms)),
          ms(median(ov.socket_ms) - median(ov.daemon_total_ms)))
    o.add("a unary RPC round trip (DaemonStatus)", "", ms(median(ov.rpc_roundtrip_ms)), "")
    o.note = (f"Medians of {len(ov.socket_ms)} pairs, alternating; each a never-seen {ov.prompt_tokens}-token "
              f"prompt, {ov.completion_tokens} tokens generated, no cache on either side. In-process: "
              "`ModelRegistry(None, Policy())` and `worker.submit(CompletionParams(...))` in the bench's own "
              "process. Differences within the noise of a shared machine can come out negative.")
    return [t, o]


# ---- plots ---------------------------------------------------------------------------------------


def plot_ttft(sec: TTFTSection, path: Path) -> None:
    import matplotlib.pyplot as plt

    r = sec.results
    x = [r.prompt_tokens(n) for n in sec.sizes]
    fig, ax = plt.subplots(figsize=(8, 5))
    lines = [("Barrel cold (ram daemon)", [r.cold_ms("Barrel ram", n) for n in sec.sizes], "k", "-", "o")]
    for t, color in zip(TIER_NAMES, ("tab:blue", "tab:cyan", "tab:green"), strict=True):
        lines.append((f"Barrel warm, {t}", [r.warm_ms(f"Barrel {t}", WARM, n) for n in sec.sizes], color, "-", "o"))
    for c, color in zip(CACHES, ("tab:red", "tab:orange"), strict=True):
        lines.append((f"{c} cold", [r.cold_ms(c, n) for n in sec.sizes], color, ":", "s"))
        lines.append((f"{c} warm", [best_llama(r, c, n) for n in sec.sizes], color, "--", "s"))
    for label, ys, color, style, marker in lines:
        ax.plot(x, [y / 1000 for y in ys], style, color=color, marker=marker, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s, log scale)")
    ax.set_title("Cold vs warm time to first token (medians)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_chat(sec: ChatSection, path: Path) -> None:
    import matplotlib.pyplot as plt

    turns = [t.turn for t in sec.cached]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    a.bar(turns, [t.restored for t in sec.cached], color="tab:green", label="restored (live or tier)")
    a.bar(turns, [t.prefilled for t in sec.cached], bottom=[t.restored for t in sec.cached], color="tab:red",
          label="prefilled")
    a.set_ylabel("prompt tokens")
    a.set_title("Multi-turn chat, resent in full each turn")
    a.legend(fontsize=8)
    b.plot(turns, [t.ttft_ms / 1000 for t in sec.cold], "o:", color="tab:red", label="no cache")
    b.plot(turns, [t.ttft_ms / 1000 for t in sec.cached], "o-", color="tab:green", label="with cache")
    b.plot(turns, [t.ttft_ms / 1000 for t in sec.restarted], "s--", color="tab:blue", label="after a restart")
    b.set_yscale("log")
    b.set_xlabel("turn")
    b.set_xticks(turns)
    b.set_ylabel("time to first token (s, log)")
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_agent(sec: AgentSection, path: Path) -> None:
    import matplotlib.pyplot as plt

    first = sec.requests[sec.strides[0]]
    x = list(range(len(first)))
    labels = [f"{r.agent}:{r.op}" for r in first]
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(8, len(x) * 0.45), 7), sharex=True)
    width = 0.8 / len(sec.strides)
    colors = ("tab:green", "tab:purple", "tab:orange")
    for k, st in enumerate(sec.strides):
        reqs = sec.requests[st]
        offs = [i + (k - (len(sec.strides) - 1) / 2) * width for i in x]
        a.bar(offs, [r.turn.restored / r.turn.prompt_tokens for r in reqs], width, color=colors[k],
              label=f"boundary_align_tokens {st}: {pct(sec.reuse(st))} overall")
        b.plot(x, [r.turn.ttft_ms / 1000 for r in reqs], "o-", color=colors[k], label=f"stride {st}")
    a.set_ylabel("reuse ratio (restored / prompt)")
    a.set_ylim(0, 1)
    a.set_title("Agent trace: prompts that share only a head")
    a.legend(fontsize=8)
    b.set_yscale("log")
    b.set_ylabel("time to first token (s, log)")
    b.set_xticks(x, labels, rotation=60, fontsize=7)
    b.grid(True, which="both", alpha=0.3)
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the document -----------------------------------------------------------------------------------


def headline(s: Settings, ttft: TTFTSection, chat: ChatSection, agent: AgentSection) -> list[str]:
    r = ttft.results
    n = ACCEPT_SIZE if ACCEPT_SIZE in ttft.sizes else ttft.sizes[-1]
    tokens = r.prompt_tokens(n)
    ram, disk = r.warm_ms("Barrel ram", WARM, n), r.warm_ms("Barrel disk", WARM, n)
    warm_cold = ", ".join(f"{t} {frac(r.warm_ms(f'Barrel {t}', WARM, n), r.cold_ms(f'Barrel {t}', n))}"
                          for t in TIER_NAMES)
    after = chat.restarted[0]
    return [
        f"- **Warm / cold TTFT at {tokens} tokens**: {warm_cold} (targets: ram ≤ 1/50, disk ≤ 1/30).",
        f"- **Barrel vs llama-cpp-python at {tokens} tokens**: ram {ms(ram)} vs LlamaRAMCache "
        f"{ms(best_llama(r, 'LlamaRAMCache', n))}: **{times(best_llama(r, 'LlamaRAMCache', n), ram)}** faster to "
        f"the first token ({times(best_llama(r, 'LlamaRAMCache', n, 'call_ms'), ram)} against its whole call); "
        f"disk {ms(disk)} vs LlamaDiskCache {ms(best_llama(r, 'LlamaDiskCache', n))}: "
        f"**{times(best_llama(r, 'LlamaDiskCache', n), disk)}** "
        f"({times(best_llama(r, 'LlamaDiskCache', n, 'call_ms'), disk)} against its whole call). Target ≥ 10x.",
        f"- **Chat ({len(chat.cached)} turns)**: {pct(chat.restored_fraction(chat.cached))} of prompt tokens "
        f"restored; total time {times(chat.total(chat.cold), chat.total(chat.cached))} faster than with no cache "
        f"(sum of TTFT {times(chat.total(chat.cold, 'ttft_ms'), chat.total(chat.cached, 'ttft_ms'))} faster).",
        "- **Agent trace, reuse ratio**: " + ", ".join(
            f"boundary_align_tokens {st}: {pct(agent.reuse(st))}" for st in agent.strides) + ".",
        f"- **Restart**: turn 1 after a restart took path `{after.path}` from `{after.tier or '-'}` "
        f"({after.restored} tokens restored), TTFT {ms(after.ttft_ms)} against {ms(chat.cached[0].ttft_ms)} "
        "the first time.",
    ]


def write(out_dir: Path, s: Settings, m: dict, elapsed: float, ttft: TTFTSection, chat: ChatSection,
          agent: AgentSection, ov: OverheadSection, argv: list[str]) -> Path:
    plot_ttft(ttft, out_dir / "ttft.png")
    plot_chat(chat, out_dir / "chat.png")
    plot_agent(agent, out_dir / "agent.png")
    mode = "quick" if s.quick else "full"
    date, commit = generated_at()
    doc = [
        "# Barrel benchmark results",
        "",
        f"Generated by `python -m bench {' '.join(argv)}`".rstrip() + f" ({mode} mode) on {date} at commit "
        f"`{commit}`, in {elapsed / 60:.1f} min. Do not edit by hand: run the command again.",
        "",
        "Ratios are measured in the same run, on the same prompts; absolute times are for this machine, which "
        "was shared with other jobs while the bench ran (load average at start: "
        f"{m['load']}). Medians throughout.",
        "",
        "| machine | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in m.items() if k not in ("date",)),
        "",
        "## Headline",
        "",
        *headline(s, ttft, chat, agent),
        "",
        "See also [warm_vs_cold.md](warm_vs_cold.md), the single-prompt comparison "
        "(`python -m bench.warm_vs_cold`).",
        "",
        "## 1. Cold vs warm time to first token",
        "",
        "![TTFT by prompt length](ttft.png)",
        "",
    ]
    doc += [t.markdown() for t in ttft_tables(ttft)]
    doc += [
        "Method: one barreld per tier (default policy, n_seq_max 1). Cold: a never-seen prompt. Warm: the same "
        "prompt again after an unrelated request took the only sequence, so it is an `exact` hit restored from "
        "the tier, not the live sequence. llama-cpp-python (n_ctx 4096, n_batch 512, same thread count): cold "
        "on a fresh `Llama` with an empty cache; warm on a new `Llama` sharing the cache, and on the first "
        "instance after an unrelated prompt; time to the first streamed chunk. All systems get the same prompts, "
        "round-robin; each system's first warm run is not counted. TTFT is client-side wall time over the socket. "
        "`GOMP_SPINCOUNT=10000` for every process: with libgomp's default spin-wait, llama-cpp-python ran 3-4x "
        "slower than barreld on this shared machine (see bench/harness.py).",
        "",
        "## 2. Multi-turn chat",
        "",
        "![Chat](chat.png)",
        "",
    ]
    doc += [t.markdown() for t in chat_tables(chat)]
    doc += ["## 3. Agent-style trace", "", "![Agent trace](agent.png)", ""]
    tables = agent_tables(agent)
    doc += [t.markdown() for t in tables[:2]]
    doc += ["<details><summary>Every request</summary>", "", tables[2].markdown(), "</details>", ""]
    doc += ["## 4. Restart", "", restart_table(chat).markdown()]
    doc += ["## 5. Cost", ""]
    doc += [t.markdown() for t in cost_tables(ttft.costs, ov)]
    path = out_dir / "RESULTS.md"
    doc += kept_sections(path)
    path.write_text("\n".join(doc))
    return path
