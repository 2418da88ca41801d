"""python -m bench [--quick] [--out-dir DIR]: the whole benchmark suite, then RESULTS.md and the plots.

Sections: 1. cold vs warm TTFT per tier next to llama-cpp-python's caches; 2. a multi-turn chat
resent in full; 3. an agent trace at two strides; 4. the chat again after a restart; 5. cost. Progress goes
to stderr while it runs; the headline is printed at the end. Full mode took 12 minutes on two cores,
--quick 4.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import results, suite
from bench.harness import Tokenizer, machine, progress


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes, turns and repetitions (under 5 minutes)")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent,
                   help="where RESULTS.md and the PNGs go (default: bench/)")
    args = p.parse_args(argv)
    s = suite.Settings.make(args.quick)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    m = machine()
    progress(f"{'quick' if s.quick else 'full'} run on {m['cpu']} ({m['cores']} cores, {m['ram']}); "
             f"load average {m['load']}")
    t0 = time.monotonic()
    tok = Tokenizer()
    progress(f"1/5 cold vs warm TTFT at {', '.join(map(str, s.sizes))} tokens")
    ttft = suite.section_ttft(tok, s)
    progress(f"2/5 multi-turn chat, {s.chat_turns} turns (4/5, the restart, runs at its end)")
    chat = suite.section_chat(tok, s)
    progress(f"3/5 agent trace, {s.agents} agents x {len(s.agent_steps)} steps, strides {s.strides}")
    agent = suite.section_agent(tok, s)
    progress("5/5 cost: the daemon's overhead")
    ov = suite.section_overhead(tok, s)
    elapsed = time.monotonic() - t0
    path = results.write(args.out_dir, s, m, elapsed, ttft, chat, agent, ov, argv)
    progress(f"wrote {path} and ttft.png, chat.png, agent.png in {args.out_dir} ({elapsed / 60:.1f} min)")
    print("\n".join(results.headline(s, ttft, chat, agent)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
