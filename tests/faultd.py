"""barreld with test hooks installed: `python -m tests.faultd [HOOKS] [barreld options]`.

    --fault-write TIER[:ERRNO]  every write to TIER (ram, ram_file, disk) fails with ERRNO (a name such as
                                ENOSPC; default EIO) after its first part is written, as a full or failing
                                device would (repeatable)
    --drop-async-saves          every background save is dropped, as a full writer queue would drop it, so
                                the synchronous evict and shutdown saves that recover such states are tested

The hooks go in through barreld's seams (`tiers.fault_hook`, `ModelCache.drop_async_saves`), then barreld's
own main runs with the remaining arguments; the daemon itself reads no test switch.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable

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


def install(argv: list[str]) -> list[str]:
    """Installs the hooks named in argv; the arguments left for barreld."""
    from barreld.cache import tiers
    from barreld.engine.model_cache import ModelCache

    p = argparse.ArgumentParser(prog="python -m tests.faultd", add_help=False, allow_abbrev=False)
    p.add_argument("--fault-write", type=parse_fault, action="append", default=[], metavar="TIER[:ERRNO]")
    p.add_argument("--drop-async-saves", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.fault_write:
        tiers.fault_hook = write_fault(dict(args.fault_write))
    ModelCache.drop_async_saves = args.drop_async_saves
    return rest


def main(argv: list[str] | None = None) -> int:
    from barreld.main import main as barreld_main

    return barreld_main(install(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
