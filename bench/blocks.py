"""Checkpoints as chains of shared blocks: bytes stored per distinct prompt token, and warm TTFT of an exact
hit next to whole-state checkpoints, through the real daemon and the bundled model.

Storage: the agent trace (2 agents x start, append, append, insert, append, drop: 12 prompts) and a 12-turn
chat go, request by request, to one daemon per block_tokens setting (0 = whole states), disk tier, stride
(boundary_align_tokens) 256; the replies that build the history come from the first daemon. After each
request (and its saves) the disk tier's stored bytes are read, and set against the distinct prompt tokens
sent so far (the nodes of the trie of every prompt's tokens) times one state's bytes per token.

TTFT: a 1,500-token prompt is sent once (a miss, whose saves are awaited), then, after an unrelated prompt
takes the live sequence, again: an exact hit restored from the tier. Whole states and blocks run side by
side in one run, alternating, per tier (ram, ram_file, disk with its page cache warm, and dropped: every file
of the tier is evicted from the page cache with posix_fadvise DONTNEED before the request).

    python -m bench.blocks [--quick] [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from barrelctl.client import Client  # noqa: E402
from bench.harness import Daemon, Tokenizer, machine, median, progress  # noqa: E402
from bench.report import Table, put_section  # noqa: E402
from bench.traces import Agent, agent_system, chat_system, chat_user, chatml, reply_text  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "blocks"
HEADING = "## 8. Shared prefixes stored once: blocks"
PLOT = Path(__file__).resolve().parent / "blocks.png"
STATE_BYTES_PER_TOKEN = 23_052  # SmolLM2's sequence state per token (744 bytes of header besides)
AGENT_STEPS = ("start", "append", "append", "insert", "append", "drop")
STRIDE = 256


def daemon(block_tokens: int, tier: str = "disk") -> Daemon:
    return Daemon(f"blocks-{block_tokens}", tier=tier, policy={"boundary_align_tokens": STRIDE},
                  config=f"\n[cache]\nblock_tokens = {block_tokens}\n")


def settled_bytes(client: Client) -> int:
    """The disk tier's stored bytes once the daemon's async saves have landed (no change for 0.5 s)."""
    last, since = -1, time.monotonic()
    while time.monotonic() - since < 0.5:
        stats = client.cache_stats(timeout=30)
        now = stats.tiers["disk"].bytes
        if now != last:
            last, since = now, time.monotonic()
        time.sleep(0.1)
    return last


class Trie:
    """Distinct prompt tokens: the nodes of the trie of every prompt's token ids."""

    def __init__(self) -> None:
        self.root: dict = {}
        self.nodes = 0

    def add(self, ids: list[int]) -> None:
        node = self.root
        for t in ids:
            if t not in node:
                node[t] = {}
                self.nodes += 1
            node = node[t]


def drive(prompts, tok: Tokenizer, trie: Trie, serve) -> None:
    """Feeds each prompt of the `prompts` generator to `serve(prompt) -> reply text` and the reply back to the
    generator; each prompt's tokens go into `trie` first."""
    reply = None
    while True:
        try:
            prompt = prompts.send(reply)
        except StopIteration:
            return
        trie.add(tok._llm.tokenize(prompt.encode(), add_bos=True, special=True))
        reply = serve(prompt)


def run_trace(name: str, prompts, configs: tuple[int, ...], tok: Tokenizer) -> dict:
    """Sends each prompt (from the `prompts` generator, which is told each reply) to every daemon."""
    out = {"name": name, "configs": list(configs), "stored": {str(b): [] for b in configs}, "distinct": [],
           "tokens": []}
    trie = Trie()
    with_daemons = [daemon(b) for b in configs]
    for d in with_daemons:
        d.start()

    def serve(prompt: str) -> str:
        reply = None
        for b, d in zip(configs, with_daemons, strict=True):
            c = d.complete(prompt, max_tokens=24)
            reply = reply if reply is not None else reply_text(c.text)
            out["stored"][str(b)].append(settled_bytes(d.client))
        out["distinct"].append(trie.nodes)
        out["tokens"].append(c.prompt_tokens)
        progress(f"  {name} request {len(out['distinct']):2d}: {c.prompt_tokens} tokens, distinct {trie.nodes}, "
                 + ", ".join(f"B={b}: {out['stored'][str(b)][-1] / 1e6:.1f} MB" for b in configs))
        return reply

    try:
        drive(prompts, tok, trie, serve)
    finally:
        for d in with_daemons:
            d.stop()
            d.box.close()
    return out


def agent_prompts(tok: Tokenizer, agents: int, steps: tuple[str, ...]):
    team = [Agent(chr(ord("A") + i), tok, agent_system(tok)) for i in range(agents)]
    for op in steps:
        for a in team:
            reply = yield a.step(op)
            a.answered(reply)


def chat_prompts(tok: Tokenizer, turns: int):
    messages = [("system", chat_system(tok))]
    for turn in range(turns):
        messages.append(("user", chat_user(tok, turn)))
        reply = yield chatml(messages)
        messages.append(("assistant", reply))


def drop_page_cache(root: Path) -> None:
    for path in root.glob("*.kv?"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ttft(tok: Tokenizer, configs: tuple[int, ...], reps: int) -> dict[tuple[str, int], list[float]]:
    """Client TTFT (ms) of an exact 1,500-token hit per (tier case, block_tokens), alternating configs."""
    out: dict[tuple[str, int], list[float]] = {}
    prompt = tok.text(1500, "blocks-ttft", head="Summarise the following report. ")
    for tier in ("ram", "ram_file", "disk"):
        ds = {b: daemon(b, tier) for b in configs}
        for d in ds.values():
            d.start()
        try:
            for d in ds.values():
                first = d.complete(prompt, max_tokens=1)
                if d.wait_stored(first.key) is None:
                    raise RuntimeError("the finish checkpoint was never stored")
            cases = ("disk", "disk_dropped") if tier == "disk" else (tier,)
            for rep in range(reps):
                for case in cases:
                    for b, d in ds.items():
                        d.flush_live(rep)
                        if case == "disk_dropped":
                            drop_page_cache(d.box.data_dir / "kvc")
                        c = d.complete(prompt, max_tokens=1)
                        if c.route != "exact":
                            raise RuntimeError(f"expected an exact hit, got {c.route}")
                        out.setdefault((case, b), []).append(c.client_ttft_ms)
                        out.setdefault((f"{case} (daemon's restore)", b), []).append(c.timings_ms["restore"])
            progress(f"  ttft {tier}: " + ", ".join(f"{k[0]} B={k[1]}: {median(v):.1f} ms" for k, v in out.items()
                                                    if k[0].startswith(tier)))
        finally:
            for d in ds.values():
                d.stop()
                d.box.close()
    return out


def evict_256m() -> dict:
    """`evict-bytes 256M` on a store of rows sharing a prefix (a ram_file tier, SmolLM2-sized cells): 30 rows
    of 512..4,224 tokens that share their first 2,048 tokens (as a system prompt and documents) and go their
    own way after. What the store frees, in stored bytes, and that it is consistent after (no shared block
    went before its last row)."""
    import random

    from barreld.cache import CacheStore, Checkpoint, TierConfig, statecut, stateformat
    from bench.cache_core import SCHEME

    kv = stateformat.KvShape(1, False, 0, (stateformat.LayerShape(1, 11_520, 1, 11_520),))  # 23,040 B a cell
    shape = stateformat.StateShape(stateformat.StateSpec.for_memory("full"), (kv,))
    cells = 128  # KV is made per 128 cells: the same for the shared head, each row's own after it
    root = Path(tempfile.mkdtemp(prefix="barrel-blocks-", dir="/dev/shm"))
    store = CacheStore(root / "data", {"ram_file": TierConfig(4 << 30, root / "rf")}, block_tokens=256).open()
    try:
        for i in range(30):
            n = 512 + 128 * i
            tokens = list(range(min(n, 2048))) + [10_000 + i] * max(0, n - 2048)
            chunks = [random.Random(f"{f}" if f < 2048 else f"{i}:{f}").randbytes(cells * kv.cell_bytes)
                      for f in range(0, n, cells)]
            ckpt = Checkpoint.build(SCHEME, "bench", f"row {i}".encode(), tokens, "cold",
                                    statecut.assemble(shape, 0, chunks, []))
            ckpt.layout = shape
            store.save(ckpt, "ram_file", sync=True)
        before = store.stats()["tiers"]["ram_file"]
        rows, freed = store.evict_bytes(256 << 20)
        after = store.stats()["tiers"]["ram_file"]
        problems = store.check()
        return {"rows_before": before["rows"], "stored_before": before["bytes"], "logical_before":
                before["logical_bytes"], "evicted": rows, "freed": freed, "stored_after": after["bytes"],
                "consistent": not problems}
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def plot(traces: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4))
    for ax, t in zip(axes, traces, strict=True):
        x = range(1, len(t["distinct"]) + 1)
        for b in t["configs"]:
            ax.plot(x, [v / 1e6 for v in t["stored"][str(b)]], marker="o",
                    label="whole states (block_tokens 0)" if b == 0 else f"block_tokens {b}")
        ax.plot(x, [n * STATE_BYTES_PER_TOKEN / 1e6 for n in t["distinct"]], "k--",
                label="one state of the distinct prompt tokens")
        ax.set_title(f"{t['name']}: disk tier bytes after each request")
        ax.set_xlabel("request")
        ax.set_ylabel("MB stored")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(PLOT, dpi=100)


def report(traces: list[dict], times: dict, raw_evict: dict, wall: float) -> str:
    storage = Table("Bytes stored per distinct prompt token, against one state's bytes per token (23,052)",
                    ["trace", "requests", "prompt tokens", "distinct", "block_tokens", "stored", "per distinct token",
                     "x one state"])
    for t in traces:
        for b in t["configs"]:
            stored = t["stored"][str(b)][-1]
            per = stored / t["distinct"][-1]
            storage.add(t["name"], len(t["distinct"]), sum(t["tokens"]), t["distinct"][-1], b,
                        f"{stored / 1e6:.1f} MB", f"{per / 1e3:.1f} KB", f"{per / STATE_BYTES_PER_TOKEN:.2f}")
    configs = sorted({k[1] for k in times})
    warm = Table("Warm TTFT of an exact 1,500-token hit (client, median ms; and the daemon's restore step alone), "
                 "whole states and blocks side by side",
                 ["tier", *[f"block_tokens {b}" for b in configs], *[f"{b} / 0" for b in configs if b]])
    for case in dict.fromkeys(k[0] for k in times):
        meds = {b: median(times[(case, b)]) for b in configs}
        warm.add(case, *[f"{meds[b]:.1f}" for b in configs], *[f"{meds[b] / meds[0]:.2f}" for b in configs if b])
    e = raw_evict
    evict = (f"**evict-bytes 256M** on {e['rows_before']} rows sharing blocks ({e['stored_before'] / 2**20:.0f} MiB "
             f"stored, {e['logical_before'] / 2**20:.0f} MiB logical): {e['evicted']} rows evicted, "
             f"{e['freed'] / 2**20:.0f} MiB freed (stored bytes; the tier went from {e['stored_before'] / 2**20:.0f} "
             f"to {e['stored_after'] / 2**20:.0f} MiB), index and files consistent after: {e['consistent']}.\n")
    note = ("Distinct prompt tokens are the nodes of the trie of every prompt's token ids sent so far: what one "
            "state per distinct token would take. Whole states store a shared prefix again with every checkpoint "
            "(a cold capture, a finish save per request). With blocks a shared prefix is stored once, and a row that "
            "a later row of the same sequence extends (the cold capture its finish extends, the previous turn's "
            "finish) is superseded: dropped, its key and aliases moved to the later row. What is left above one "
            "state per token is the own file of each conversation's latest row (its tail of up to block_tokens - 1 "
            "cells after the last whole block, and its logits: 196 KB for SmolLM2's vocabulary) and blocks of "
            "prefixes that no later prompt repeated.\n")
    m = machine()
    return (f"{HEADING}\n![Stored bytes per request](blocks.png)\n\n{storage.markdown()}\n{note}\n"
            f"{warm.markdown()}\n{evict}\n"
            f"Run by `python -m bench.blocks` in {wall / 60:.1f} min on {m.get('cpu', '?')}; stride "
            f"(boundary_align_tokens) {STRIDE}, n_batch 512 (prefill chunk 128), disk tier for storage.\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--configs", default="0,128,256")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--only", choices=("storage", "ttft"), help="measure one part only (with --save, to --load later)")
    ap.add_argument("--save", type=Path, help="also write the raw figures to this JSON file")
    ap.add_argument("--load", type=Path, action="append", default=[],
                    help="take storage and/or TTFT figures from a --save file instead of measuring them")
    args = ap.parse_args()
    configs = tuple(int(b) for b in args.configs.split(","))
    t0 = time.monotonic()
    raw: dict = {}
    for path in args.load:
        part = json.loads(path.read_text())
        part["wall_s"] = part.get("wall_s", 0) + raw.get("wall_s", 0)
        raw.update(part)
    tok = Tokenizer()
    if "traces" not in raw and args.only != "ttft":
        raw["traces"] = [
            run_trace("agent", agent_prompts(tok, 2, AGENT_STEPS[:3] if args.quick else AGENT_STEPS), configs, tok),
            run_trace("chat", chat_prompts(tok, 4 if args.quick else 12), configs, tok),
        ]
    if "ttft" not in raw and args.only != "storage":
        raw["ttft"] = [[case, b, v] for (case, b), v in ttft(tok, configs, 2 if args.quick else 11).items()]
    raw["wall_s"] = raw.get("wall_s", 0) + time.monotonic() - t0
    if args.save:
        args.save.write_text(json.dumps(raw))
    if "evict" not in raw and args.only != "storage" and args.only != "ttft":
        raw["evict"] = evict_256m()
    if args.only:
        return
    times = {(case, b): v for case, b, v in raw["ttft"]}
    plot(raw["traces"])
    text = report(raw["traces"], times, raw["evict"], raw["wall_s"])
    print(text)
    if args.write_results:
        put_section(RESULTS, SECTION, text)


if __name__ == "__main__":
    main()
