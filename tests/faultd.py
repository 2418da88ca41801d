"""barreld with test hooks installed: `python -m tests.faultd [HOOKS] [barreld options]`.

    --fault-write TIER[:ERRNO]  every write to TIER (ram, ram_file, disk) fails with ERRNO (a name such as
                                ENOSPC; default EIO) after its first part is written, as a full or failing
                                device would (repeatable)
    --drop-async-saves          every background save is dropped, as a full writer queue would drop it, so
                                the synchronous evict and shutdown saves that recover such states are tested
    --die-in-decode N:SIGNAL    the Nth llama.cpp decode (1 is the warm-up at load) sends SIGNAL (a name such
                                as SIGILL) to the daemon, as a crash inside llama.cpp would, half a second
                                after it was called (so what was streamed before it reaches the client)
    --decode-check-dies SIGNAL:GLOB
                                the load-time decode check of a model file whose name matches GLOB runs a
                                stand-in child that reads nothing, says it loaded, and dies of SIGNAL

The hooks go in through barreld's seams (`tiers.fault_hook`, `ModelCache.drop_async_saves`,
`LlamaBackend.decode`, `decodecheck.child_command`), then barreld's own main runs with the remaining
arguments; the daemon itself reads no test switch.
"""

from __future__ import annotations

import argparse
import errno
import fnmatch
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from barreld.names import TIER_NAMES


def parse_fault(spec: str) -> tuple[str, int]:
    """`disk:ENOSPC` -> ("disk", errno.ENOSPC); argparse reports a ValueError as a usage error."""
    tier, _, name = spec.partition(":")
    num = getattr(errno, name or "EIO", None)
    if tier not in TIER_NAMES or not isinstance(num, int):
        raise ValueError(spec)
    return tier, num


def write_fault(faults: dict[str, int]) -> Callable[[str], None]:
    """The tiers' fault hook: a write to a tier in `faults` fails with its errno."""

    def fail(tier: str) -> None:
        num = faults.get(tier)
        if num is not None:
            raise OSError(num, f"injected fault (--fault-write): {os.strerror(num)}")

    return fail


def parse_signal(name: str) -> signal.Signals:
    """`SIGILL` -> signal.SIGILL; a ValueError (a usage error) for anything else."""
    try:
        return signal.Signals[name]
    except KeyError:
        raise ValueError(name) from None


def parse_nth_decode(spec: str) -> tuple[int, signal.Signals]:
    """`4:SIGILL` -> (4, SIGILL)."""
    n, _, name = spec.partition(":")
    if not n.isdigit() or int(n) < 1:
        raise ValueError(spec)
    return int(n), parse_signal(name)


def parse_check_death(spec: str) -> tuple[signal.Signals, str]:
    """`SIGILL:doomed*.gguf` -> (SIGILL, "doomed*.gguf")."""
    name, _, glob = spec.partition(":")
    if not glob:
        raise ValueError(spec)
    return parse_signal(name), glob


def die_in_decode(n: int, signum: signal.Signals) -> None:
    """Wraps the real backend's decode: its nth call kills the process with a real signal instead."""
    from barreld.engine.llama_backend import LlamaBackend

    decode, calls = LlamaBackend.decode, [0]

    def dying(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            time.sleep(0.5)  # the tokens sampled before it reach the client first, however busy the machine
            os.kill(os.getpid(), signum)
        return decode(self, *args, **kwargs)

    LlamaBackend.decode = dying


def stand_in_check(signum: signal.Signals, glob: str) -> None:
    """The decode check's child, for files matching glob: one that says it loaded and dies of signum."""
    from barreld.engine import decodecheck

    real = decodecheck.child_command
    code = f"import os, sys; sys.stdout.write('loaded\\n'); sys.stdout.flush(); os.kill(os.getpid(), {int(signum)})"

    def command(model: Path) -> list[str]:
        return [sys.executable, "-c", code] if fnmatch.fnmatch(model.name, glob) else real(model)

    decodecheck.child_command = command


def install(argv: list[str]) -> list[str]:
    """Installs the hooks named in argv; the arguments left for barreld."""
    from barreld.cache import tiers
    from barreld.engine.model_cache import ModelCache

    p = argparse.ArgumentParser(prog="python -m tests.faultd", add_help=False, allow_abbrev=False)
    p.add_argument("--fault-write", type=parse_fault, action="append", default=[], metavar="TIER[:ERRNO]")
    p.add_argument("--drop-async-saves", action="store_true")
    p.add_argument("--die-in-decode", type=parse_nth_decode, metavar="N:SIGNAL")
    p.add_argument("--decode-check-dies", type=parse_check_death, metavar="SIGNAL:GLOB")
    args, rest = p.parse_known_args(argv)
    if args.fault_write:
        tiers.fault_hook = write_fault(dict(args.fault_write))
    ModelCache.drop_async_saves = args.drop_async_saves
    if args.die_in_decode:
        die_in_decode(*args.die_in_decode)
    if args.decode_check_dies:
        stand_in_check(*args.decode_check_dies)
    return rest


def main(argv: list[str] | None = None) -> int:
    from barreld.main import main as barreld_main

    return barreld_main(install(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
