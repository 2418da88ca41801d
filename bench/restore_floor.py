"""An exact ram-tier hit against its floor: llama.cpp's own `llama_state_seq_set_data` of the same state and the
first sample, in-process, in the same run.

    python -m bench.restore_floor [--tokens 1390] [--reps 20]

Floor (this process, the bundled model through barreld's own LlamaBackend, so the context has the daemon's
settings: n_ctx 4096, n_batch 512, n_seq_max 1, every core): the prompt is prefilled once, its sequence state
taken (`llama_state_seq_get_data`) with its last logits; then, per repetition, the sequence is cleared
(untimed) and the floor is timed: `llama_state_seq_set_data` of those bytes (a pointer to them, no copy) and the
first sample (greedy, over a copy of the stored logits, as a restored exact hit samples without a decode).
`set_data + decode` is given beside it: the last token evaluated again instead of sampling stored logits.

Barrel: one barreld with the ram tier (n_seq_max 1, default policy and block size). The prompt, and a second
one of the same length that shares no prefix with it, are sent once cold and their finish checkpoints
awaited; then, per repetition, before each request an unrelated short prompt takes the only sequence, so the
prompt must come back from its stored row: its route must be `exact` from tier `ram`. Each repetition sends
the prompt (`again`: the worker's last restore was of this same row), the second prompt, then the prompt
(`after another row`: the last restore was of the other row, so nothing of the previous assembly is reused).
Client TTFT (from the call to its first token event, over the socket) and the daemon's own timings (lookup, restore =
finding to the state in the sequence, ttft from arrival at the worker).

Floor and Barrel samples alternate, so background load on a shared machine falls on both alike; medians are
reported, after one uncounted repetition of each. The ratio is the median, over Barrel's samples, of each
client TTFT over the floor sample taken just before it (the floor itself moves with the machine's load); the
target is held against the `again` case, the issue's method (the same prompt sent again after the live
sequence was taken), and `after another row` is reported beside it. Progress goes to stderr, the table to
stdout.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import sys
import time
from pathlib import Path

import numpy as np

from barrelctl.client import ReplyToken
from bench.harness import MODEL, Daemon, Tokenizer, machine, median, model_path, progress, quiet_stderr
from bench.report import put_section

SECTION = "restore_floor"
TARGET = 2.5  # Barrel's exact ram-tier TTFT at most this many times the floor


class Floor:
    """The prompt's state and logits in an in-process llama.cpp context, and the timed put-back."""

    def __init__(self, prompt: str) -> None:
        from barreld.engine.backend import BatchItem, ContextSettings
        from barreld.engine.llama_backend import LlamaBackend

        with quiet_stderr():
            self.b = LlamaBackend(model_path(), ContextSettings(n_ctx=4096, n_batch=512, n_seq_max=1))
        b, self._item = self.b, BatchItem
        self.tokens = b.tokenize(prompt.encode())
        n = len(self.tokens)
        for start in range(0, n, b.n_batch):
            chunk = self.tokens[start : start + b.n_batch]
            b.decode([BatchItem(t, start + i, 0, start + i == n - 1) for i, t in enumerate(chunk)])
        self.logits = b.logits(len(chunk) - 1)
        self.state = b.state_get(0)
        self._src = (ctypes.c_uint8 * len(self.state)).from_buffer(self.state)
        self.first = int(np.argmax(self.logits))

    def set_data(self) -> float:
        """ms of set_data of the state into the cleared sequence and the first sample from the stored logits."""
        b, L = self.b, self.b._L
        b.seq_rm(0, 0, -1)
        t0 = time.perf_counter_ns()
        got = L.llama_state_seq_set_data(b._ctx, self._src, len(self.state), 0)
        token = int(np.argmax(self.logits.copy()))
        t1 = time.perf_counter_ns()
        if got != len(self.state) or token != self.first:
            raise RuntimeError(f"floor: set_data took {got} of {len(self.state)} bytes, sampled {token}")
        return (t1 - t0) / 1e6

    def set_data_decode(self) -> float:
        """ms of set_data, then the last token evaluated again and sampled."""
        b, L, n = self.b, self.b._L, len(self.tokens)
        b.seq_rm(0, 0, -1)
        t0 = time.perf_counter_ns()
        L.llama_state_seq_set_data(b._ctx, self._src, len(self.state), 0)
        b.seq_rm(0, n - 1, -1)
        b.decode([self._item(self.tokens[-1], n - 1, 0, True)])
        token = int(np.argmax(b.logits(0)))
        t1 = time.perf_counter_ns()
        if token != self.first:
            raise RuntimeError(f"floor: the re-evaluated last token sampled {token}, not {self.first}")
        return (t1 - t0) / 1e6

    def close(self) -> None:
        del self._src
        self.b.close()


class Barrel:
    """One barreld with the ram tier; `warm()` is one exact hit restored from a stored row."""

    def __init__(self, *prompts: str) -> None:
        self.prompts = prompts
        self.daemon = Daemon("restore-floor", tier="ram", n_seq_max=1)
        self._flushes = 0

    def __enter__(self) -> Barrel:
        self.daemon.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.daemon.__exit__(*exc)

    def _flush(self) -> None:
        self._flushes += 1
        self.daemon.flush_live(self._flushes)

    def cold(self, which: int = 0) -> dict[str, float]:
        self._flush()
        c = self.daemon.complete(self.prompts[which])
        if c.route != "miss":
            raise RuntimeError(f"a never-seen prompt took route {c.route}, not miss")
        if self.daemon.wait_stored(c.key) is None:
            raise RuntimeError("the finish checkpoint was never stored")
        if which == 0:
            self.prompt_tokens = c.prompt_tokens
        return {"ttft": c.client_ttft_ms, **{f"d_{k}": v for k, v in c.timings_ms.items()}}

    def warm(self, which: int = 0) -> dict[str, float]:
        self._flush()
        t0 = time.perf_counter()  # the client's own TTFT starts after the call is under way: timed here
        stream = self.daemon.client.complete(self.prompts[which].encode(), model=MODEL, max_tokens=1, timeout=600)
        first = None
        for ev in stream:
            if first is None and isinstance(ev, ReplyToken):
                first = time.perf_counter()
        c = stream.result()
        if c.route != "exact" or c.tier != "ram" or c.restored != c.prompt_tokens:
            raise RuntimeError(f"the repeat took route {c.route} from {c.tier!r} ({c.restored} of "
                               f"{c.prompt_tokens} tokens restored), not an exact hit from ram")
        return {"ttft": ((first or time.perf_counter()) - t0) * 1000,
                **{f"d_{k}": v for k, v in c.timings_ms.items()}}


def run(tokens: int, reps: int) -> dict:
    progress(f"building a prompt of about {tokens} tokens")
    tok = Tokenizer()
    prompt = tok.text(tokens, "restore-floor", head="Report of the restore floor: ")
    other = tok.text(tokens, "restore-floor-other", head="Letter about another row: ")
    progress("floor: prefilling in-process and taking the state")
    floor = Floor(prompt)
    progress(f"floor: {len(floor.tokens)} tokens, state {len(floor.state) / 2**20:.1f} MiB")
    fl, fd, again, after = [], [], [], []
    try:
        progress("starting barreld (ram tier)")
        with Barrel(prompt, other) as barrel:
            cold = barrel.cold(0)
            barrel.cold(1)
            progress(f"barrel cold: {cold['ttft']:.0f} ms; {reps} repetitions (+1 uncounted), alternating")
            for i in range(reps + 1):
                gc.collect()
                a = floor.set_data()  # each Barrel sample is paired with the floor taken just before it
                w = {**barrel.warm(0), "floor": a}
                floors = [a, floor.set_data()]
                barrel.warm(1)
                floors.append(floor.set_data())
                o = {**barrel.warm(0), "floor": floors[-1]}
                d = floor.set_data_decode()
                if i:
                    fl += floors
                    fd.append(d)
                    again.append({**w, "ratio": w["ttft"] / w["floor"]})
                    after.append({**o, "ratio": o["ttft"] / o["floor"]})
                if i % 5 == 0:
                    progress(f"  rep {i:2d}: floor {a:.2f} ms, barrel ttft {w['ttft']:.2f} ms again "
                             f"(restore {w['d_restore']:.2f} ms), {o['ttft']:.2f} ms after another row "
                             f"(restore {o['d_restore']:.2f} ms)")
            n_barrel = barrel.prompt_tokens
    finally:
        floor.close()

    def medians(ws: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
        return {k: median([w[k] for w in ws]) for k in ws[0]}, {k: min(w[k] for w in ws) for k in ws[0]}

    return {"tokens": len(floor.tokens), "barrel_tokens": n_barrel, "state_mib": len(floor.state) / 2**20,
            "floor": median(fl), "floor_decode": median(fd), "cold": cold, "again": medians(again),
            "after": medians(after), "reps": reps}


def report(r: dict) -> str:
    floor = r["floor"]
    lines = [
        f"Exact ram-tier hit vs in-process floor: {r['tokens']} tokens ({r['barrel_tokens']} in barreld), "
        f"state {r['state_mib']:.1f} MiB, medians of {r['reps']} (min in brackets)",
        "",
        f"  {'floor: set_data + first sample':<46} {floor:8.2f} ms",
        f"  {'floor: set_data + decode last token + sample':<46} {r['floor_decode']:8.2f} ms",
        f"  {'barrel: cold client TTFT':<46} {r['cold']['ttft']:8.2f} ms",
    ]
    for case, label in (("again", "again"), ("after", "after another row")):
        w, wm = r[case]
        lines += [
            "",
            f"  barrel, exact ram hit, {label}:",
            f"  {'  client TTFT':<46} {w['ttft']:8.2f} ms  ({wm['ttft']:.2f})",
            f"  {'  daemon ttft':<46} {w['d_ttft']:8.2f} ms  ({wm['d_ttft']:.2f})",
            f"  {'  daemon lookup':<46} {w['d_lookup']:8.2f} ms  ({wm['d_lookup']:.2f})",
            f"  {'  daemon restore':<46} {w['d_restore']:8.2f} ms  ({wm['d_restore']:.2f})",
            f"  {'  daemon prefill (sample wait)':<46} {w['d_prefill']:8.2f} ms  ({wm['d_prefill']:.2f})",
        ]
    ratio = r["again"][0]["ratio"]
    lines += ["", "  TTFT / floor (median of each sample over the floor taken just before it):",
              f"    again: {ratio:.2f}x (target at most {TARGET}x: {'met' if ratio <= TARGET else 'NOT met'});"
              f" after another row: {r['after'][0]['ratio']:.2f}x",
              f"  TTFT median / floor median: again {r['again'][0]['ttft'] / floor:.2f}x;"
              f" after another row {r['after'][0]['ttft'] / floor:.2f}x"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.restore_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1390, help="prompt length in tokens (default 1390)")
    p.add_argument("--reps", type=int, default=20, help="counted repetitions (default 20)")
    p.add_argument("--results", type=Path, help="also write the section 'restore_floor' of this results file")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    m = machine()
    progress(f"{m['cpu']} ({m['cores']} cores), load average {m['load']}")
    text = report(run(args.tokens, args.reps))
    print(text)
    if args.results is not None:
        head = ("## An exact ram-tier hit against its floor\n\n"
                f"`python -m bench.restore_floor {' '.join(sys.argv[1:] if argv is None else argv)}` (load "
                f"{m['load']}); the method is in bench/restore_floor.py's docstring.\n")
        put_section(args.results, SECTION, f"{head}\n```\n{text}\n```\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
