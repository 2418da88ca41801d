"""Part 1: SIGKILL a daemon at random moments while it serves completions that save (cold, continued,
finish), 50 times. After every restart the cache must be whole: the index reconciled with the files,
`cache verify` clean, no temp file left, nothing published before the kill lost, and a prompt whose
checkpoint was published before the kill starts warm (with the reply it had, when one was seen)."""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections import Counter

from barrelctl.errors import ClientError
from barreld.rpc import barrel_pb2 as pb
from tests.support.sandbox import Sandbox

from . import util
from .util import POLICY, complete, rows

KILLS = int(os.environ.get("FAULTS_KILLS", "40"))
MAX_TOKENS = 12
# Small quotas keep `cache verify` quick (checkpoints are ~4.6 MB); each life starts with half free, more
# than one life's saves take, so no save has to evict a row published before the kill.
QUOTAS = '\n[tiers.disk]\nquota = "120M"\n'
HEADROOM = 60 << 20


def available(s) -> dict[str, pb.CacheRow]:
    return {r.key: r for r in rows(s) if r.status == "available"}


def superseded(row: pb.CacheRow, present: list[pb.CacheRow]) -> bool:
    """Whether a longer row of the same blocks may have taken `row`'s place: a row of blocks is dropped, its key
    kept as an alias, once a later save of its sequence that extends it is published in the same tier. The
    probe of each candidate prompt then shows the text still restores."""
    return row.blocks > 0 and any(
        r.model == row.model and r.tier == row.tier and r.tokens > row.tokens and r.blocks >= row.blocks
        and r.frontier >= row.frontier for r in present
    )


def unlisted(published: dict[str, pb.CacheRow], found: set[str]) -> list[tuple[str, int, str]]:
    """(save reason, tokens, tier) of the published rows not in `found`, for a failure to show."""
    return [(r.save_reason, r.tokens, r.tier) for k, r in published.items() if k not in found]


def quiet(s, seconds: float = 0.5, timeout: float = 60) -> None:
    """Until the available rows stay the same for `seconds`: the saves a request queued have landed."""
    deadline = time.monotonic() + timeout
    last = set(available(s))
    while time.monotonic() < deadline:
        time.sleep(seconds)
        now = set(available(s))
        if now == last:
            return
        last = now
    raise AssertionError(f"the rows kept changing for {timeout} s")


def test_sigkill_at_random_moments_loses_nothing_published() -> None:
    rng = random.Random(20261129)
    candidates: list[tuple[bytes, bytes | None]] = []  # (prompt, its reply if seen) with a published checkpoint
    origins: dict[bytes, str] = {}  # a candidate's life and the rows that made it one, for a failure to show
    published: dict[str, pb.CacheRow] = {}  # rows available just before the last kill
    tally: Counter[str] = Counter()
    spent: Counter[str] = Counter()
    t_start = time.monotonic()
    with Sandbox.new() as w:
        for life in range(KILLS + 1):
            tier = ("disk", "ram_file")[life % 2]  # both file tiers must survive a crash
            util.configure(w, POLICY + QUOTAS + util.model_config(tier=tier), ram_file_quota="120M")
            log_before = len(w.log_text())
            t0 = time.monotonic()
            if life % 10 == 5:  # now and then a kill in start-up, maybe in the middle of reconciling
                early = w.start_daemon(wait=False)
                time.sleep(rng.uniform(0, 0.6))
                early.kill()
                early.wait(30)
                tally["kills_in_startup"] += 1
            proc = util.start(w)
            s = w.client()
            t1 = time.monotonic()
            spent["start"] += t1 - t0
            assert util.counters(s)["corrupt_files"] == 0, f"life {life}: a published file was found damaged"
            present = util.assert_consistent(w, s)
            found = {r.key for r in present}
            lost = [(k, r.tier, r.save_reason, r.tokens) for k, r in published.items()
                    if k not in found and not superseded(r, present)]
            assert not lost, f"life {life}: rows available before the kill are gone: {lost}"
            tally["superseded_before_the_kill"] += sum(k not in found for k in published)
            excused = unlisted(published, found)
            if life % 10 == 0:  # the operator's command, too
                v = w.ctl("--no-autostart", "--json", "cache", "verify")
                assert v.rc == 0 and v.json()["bad"] == [], v.err
            for line in re.findall(r"reconciled the cache at open: (.*)", w.log_text()[log_before:]):
                tally.update({k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)})
            t2 = time.monotonic()
            spent["checks"] += t2 - t1
            if life == KILLS:
                break
            # Headroom, made while the daemon is quiet: a save that must evict to fit could drop a row
            # published before the kill, which is no loss; with room no save evicts, so none may go missing.
            for name, usage in s.cache_stats().tiers.items():
                if usage.bytes > HEADROOM:
                    s.cache_evict_bytes(usage.bytes - HEADROOM, tiers=[name])
            found = {r.key for r in rows(s)}

            if life == 0:  # one prompt published before any kill, so every life has one to probe
                seed = util.doc(10_000, 190)
                first = complete(s, seed, MAX_TOKENS)
                util.wait_for(lambda s=s, key=first.key: key in available(s), what="the first save")
                candidates.append((seed, first.text))
                origins[seed] = "in life 0, as the seed"
            if candidates:  # published before a kill: it must start warm, and reply as it did
                prompt, text = candidates[-1]
                again = complete(s, prompt, MAX_TOKENS)
                if again.route == "miss":
                    wanted = ("reuse_refused", "corrupt_files", "corrupt_blocks", "evictions", "superseded")
                    seen = {k: v for k, v in util.counters(s).items() if k in wanted}
                    raise AssertionError(
                        f"life {life}: a checkpoint published before the kill was not found. The prompt "
                        f"({again.prompt_tokens} tokens) became a candidate {origins[prompt]}; gone at this "
                        f"start as superseded: {excused}; rows now: "
                        f"{[(r.save_reason, r.tokens, r.tier, r.frontier) for r in rows(s)]}; counters: {seen}; "
                        f"divergence: {again.divergence}. The daemon's log since it started:\n"
                        f"{w.log_text()[log_before:][-12000:]}"
                    )
                assert text is None or again.text == text, f"life {life}: the warm reply differs from the first"
                candidates[-1] = (prompt, again.text)  # warm replies equal cold ones: later probes compare
                tally["warm_probes"] += 1
                # Let its saves land first, so every row new at the kill is the fresh prompt's: its finish, then
                # no new row for half a second. A finish already stored is not published again, and its continued
                # save (stored or not) came after it: a continued row of the probe published after the rows were
                # listed once made the next prompt a candidate.
                util.wait_for(lambda s=s, key=again.key: key in available(s), what="the probe's finish save")
                quiet(s)
                found = {r.key for r in rows(s)}
            spent["probe"] += time.monotonic() - t2

            # A fresh prompt (it saves cold at 128 tokens, continued every 8 generated, finish), killed at a
            # random moment 0-1.5 s after it starts: in its prefill, a save, its reply, or after it; every
            # third kill is aimed at a save in flight, a window of milliseconds that chance seldom hits.
            prompt = util.doc(life, rng.randint(170, 210))
            result: list = []

            def run(s=s, prompt: bytes = prompt, result: list = result) -> None:
                try:
                    result.append(complete(s, prompt, MAX_TOKENS, timeout=60))
                except ClientError as e:
                    result.append(e)

            t = threading.Thread(target=run)
            t.start()
            if life % 3 == 2:  # aimed: the moment a save's temp file appears, i.e. while it writes the file
                root = util.tier_roots(w)[tier]
                published, refreshed = available(s), time.monotonic()
                deadline = refreshed + 1.5
                while time.monotonic() < deadline:
                    if util.temp_files(root):
                        tally["kills_while_a_temp_file_was_written"] += 1
                        break
                    if time.monotonic() - refreshed > 0.05:  # what is published so far (a dump takes a while)
                        published, refreshed = available(s), time.monotonic()
                    time.sleep(0.0005)
                else:
                    published = available(s)
            else:
                time.sleep(rng.uniform(0, 1.5))
                published = available(s)
            proc.kill()
            proc.wait(30)
            t.join(60)
            assert len(result) == 1
            reply = result[0]
            tally["kills"] += 1
            if isinstance(reply, ClientError):
                assert reply.status == "UNAVAILABLE", reply  # the daemon died under it
                reply = None
            else:
                tally["replies_before_kill"] += 1
            if published.keys() - found:  # some checkpoint of the fresh prompt was published before the kill
                candidates.append((prompt, reply.text if reply is not None and reply.key in published else None))
                origins[prompt] = f"in life {life}, by rows {unlisted(published, found)}"
                tally["fresh_prompts_with_a_published_checkpoint"] += 1
        proc.terminate()
        assert proc.wait(60) == 0
    print(
        f"\ncrash: {dict(tally)}; {len(published)} rows at the end; {time.monotonic() - t_start:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in spent.items())})"
    )
    assert tally["kills"] == KILLS
    assert tally["warm_probes"] == KILLS
