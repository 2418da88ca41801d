"""Part 4: load. 16 concurrent clients send 200 mixed requests (short and long prompts, some cancelled
mid-stream or while queued, a few invalid) to a model with 4 sequences, while the operator forces
evictions (`cache evict-bytes` on the RAM tiers) and a `cache gc`. Every request ends with its reply or its
own clear error; afterwards the index is consistent, nothing is referenced, nothing is running or queued."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass

from barrelctl.client import Client
from barrelctl.errors import ClientError
from tests.support.sandbox import Sandbox

from . import util
from .util import counters, doc

CLIENTS = 16
REQUESTS = 200


@dataclass
class Job:
    n: int
    kind: str  # short | long | cancel | invalid
    request: dict  # Client.complete's arguments
    cancel_after_events: int = 0  # negative: on a timer, whatever has arrived (it may still be queued)


def jobs(rng: random.Random) -> list[Job]:
    longs = [doc(500 + i, 240) for i in range(6)]
    out = []
    for n in range(REQUESTS):
        roll = rng.random()
        if roll < 0.12:  # a long prompt: a few bases, some with another ending (exact, live, prefix hits)
            base = rng.choice(longs)
            prompt = base if rng.random() < 0.5 else base + f" and then part {n} began".encode()
            out.append(Job(n, "long", dict(prompt=prompt, max_tokens=8)))
        elif roll < 0.24:  # cancelled by its client: while queued, in its prefill or mid-stream
            prompt = rng.choice([*longs, f"Tell a long story number {n}.".encode()])
            out.append(
                Job(
                    n,
                    "cancel",
                    dict(prompt=prompt, max_tokens=400),
                    cancel_after_events=rng.randint(-2, 6),
                )
            )
        elif roll < 0.27:
            bad = rng.choice(
                [
                    dict(prompt=b"x", max_tokens=0),
                    dict(prompt=b"", max_tokens=4),
                    dict(prompt=b"x", max_tokens=4, temperature=float("nan")),
                    dict(prompt=b"x", max_tokens=4, parent_key="zz"),
                ]
            )
            out.append(Job(n, "invalid", bad))
        else:
            prompt = f"Question {n}: name a {rng.choice(['colour', 'river', 'tree', 'city'])}.".encode()
            out.append(Job(n, "short", dict(prompt=prompt, max_tokens=rng.randint(4, 8))))
    return out


def run_job(c: Client, job: Job) -> tuple[str, str]:
    """(outcome, detail): reply, cancelled, or the status of the error."""
    stream = c.complete(**job.request, timeout=600)
    if job.kind == "cancel" and job.cancel_after_events < 0:
        threading.Timer(0.1 * -job.cancel_after_events, stream.cancel).start()
    try:
        for seen, _ in enumerate(stream, 1):
            if job.kind == "cancel" and seen > job.cancel_after_events >= 0:
                stream.cancel()
        d = stream.result()
    except ClientError as e:
        if e.status == "CANCELLED" and job.kind == "cancel":
            return "cancelled", ""
        return e.status, e.details
    assert d.finish_reason in ("length", "stop"), d.finish_reason
    assert d.completion_tokens >= 1 and len(d.key) == 64
    return "reply", d.finish_reason


def test_sixteen_clients_two_hundred_requests_with_evictions_and_gc() -> None:
    rng = random.Random(4)
    todo: queue.Queue[Job] = queue.Queue()
    for job in jobs(rng):
        todo.put(job)
    # The model saves to ram_file so evictions delete files that restores may be reading.
    with Sandbox.new(util.POLICY + util.model_config(n_seq_max=4, tier="ram_file")) as w:
        proc = util.start(w)
        results: dict[int, tuple[str, str, Job]] = {}

        def client() -> None:
            s = w.client()
            while True:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                outcome, detail = run_job(s, job)
                results[job.n] = (outcome, detail, job)

        t0 = time.monotonic()
        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for t in threads:
            t.start()
        ops: Counter[str] = Counter()
        freed = 0
        while any(t.is_alive() for t in threads):
            time.sleep(2)
            r = w.ctl("--no-autostart", "--json", "cache", "evict-bytes", "16M", "--tier", "ram", "--tier", "ram_file")
            assert r.rc == 0, r.err
            freed += r.json()["bytes_freed"]
            ops["evict_bytes"] += 1
            if ops["evict_bytes"] == 2:  # verify under load: a row evicted or in use is no false alarm
                v = w.ctl("--no-autostart", "--json", "cache", "verify")
                assert v.rc == 0 and v.json()["bad"] == [], v.out + v.err
                ops["verify"] += 1
            if ops["evict_bytes"] == 3:
                g = w.ctl("--no-autostart", "--json", "cache", "gc")
                assert g.rc == 0, g.err
                ops["gc"] += 1
                ops["gc_evicted"] += g.json()["evicted"]
        for t in threads:
            t.join()
        elapsed = time.monotonic() - t0

        assert len(results) == REQUESTS
        tally = Counter(f"{job.kind}:{outcome}" for outcome, _, job in results.values())
        for outcome, detail, job in results.values():
            if job.kind in ("short", "long"):
                assert outcome == "reply", (job.n, outcome, detail)
            elif job.kind == "cancel":
                assert outcome in ("cancelled", "reply"), (job.n, outcome, detail)
            else:  # its own error: the message names what is wrong with this request
                assert outcome == "INVALID_ARGUMENT", (job.n, outcome, detail)
                assert any(w in detail for w in ("max_tokens", "prompt", "temperature", "parent key")), detail
        assert tally["cancel:cancelled"] >= 10
        s = w.client()
        util.wait_for(
            lambda: [m for m in s.models() if (m.running, m.queued) == (0, 0)],
            what="the model to go idle",
        )
        m = w.ctl("--no-autostart", "--json", "models").json()["models"][0]
        assert (m["running"], m["queued"]) == (0, 0)
        # Saves still queued at the end land; then the index and the files agree, nothing referenced.
        util.wait_for(lambda: all(r.status == "available" for r in util.rows(s)), what="in-flight saves")
        time.sleep(0.5)
        c = counters(s)
        util.assert_consistent(w, s)
        assert c["corrupt_files"] == 0 and c["evictions"] > 0 and freed > 0
        assert c["saves_cold"] + c["saves_finish"] > 0
        assert c["hits_live"] + c["hits_exact"] + c["hits_longest_prefix"] > 0
        util.stop(w, proc)
        log = w.log_text()
        assert "Traceback" not in log
        ops["cancelled_while_queued"] = log.count("cancelled by its client while queued")
        ops["cancelled_running"] = log.count("cancelled by its client after")
    hits = {k: v for k, v in c.items() if k.startswith(("hits_", "saves_", "miss", "evictions")) and v}
    print(
        f"\nload: {REQUESTS} requests in {elapsed:.0f} s: {dict(sorted(tally.items()))}; {dict(ops)}, "
        f"{freed >> 20} MiB freed by evict-bytes; {hits}"
    )
