"""Reading a row back for a restore: its file read and verified against its row, and a row of blocks assembled,
its blocks read and verified by a few helper threads beside the restoring one."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import blocks
from .checkpoint import Checkpoint, decode
from .counters import Counters
from .errors import CorruptCheckpoint, IndexWriteError
from .index import Index, Row
from .tiers import FileTier, Tier, thread_buffer

log = logging.getLogger("barreld.cache")

_read_buffers = threading.local()
ASSEMBLY_HELPERS = 3
"""Threads that read, verify and place a row's blocks beside the restoring thread (bench/RESULTS.md has the
measurements that chose three)."""


class LocalBlocks:
    """This host's blocks for a remote restore, read without a row's reference: a block deleted meanwhile
    reads as missing (and is fetched from Redis instead), a damaged one is marked as in `Reader.read_verified`."""

    def __init__(self, index: Index, tiers: dict[str, Tier], counters: Counters) -> None:
        self._index, self._tiers, self._counters = index, tiers, counters

    def _tier(self, key: bytes) -> Tier | None:
        return next((self._tiers[t] for t in self._tiers if self._index.block_refs(t, [key])[0]), None)

    def has(self, key: bytes) -> bool:
        return self._tier(key) is not None

    def read(self, key: bytes) -> memoryview:
        tier = self._tier(key)
        if tier is None:
            raise KeyError(key.hex())
        try:
            return blocks.decode_block(tier.read(tier.block_location(key.hex())), key)
        except CorruptCheckpoint:
            self._counters.count("corrupt_blocks")
            with contextlib.suppress(IndexWriteError):
                self._index.block_corrupt(tier.name, key)
            raise


class Reader:
    """Reads rows of an open index back from its tiers; a row that fails verification is dropped."""

    def __init__(self, index: Index, tiers: dict[str, Tier], counters: Counters) -> None:
        self._index, self._tiers, self._counters = index, tiers, counters
        self._assemblers = ThreadPoolExecutor(ASSEMBLY_HELPERS, thread_name_prefix="barrel-assemble")

    def close(self) -> None:
        self._assemblers.shutdown()

    def local_blocks(self) -> LocalBlocks:
        """This host's blocks, for a remote restore."""
        return LocalBlocks(self._index, self._tiers, self._counters)

    def read_verified(self, row: Row) -> Checkpoint | None:
        """The row's checkpoint, checksum and key verified; on any failure the row is dropped."""
        index = self._index
        try:
            assert row.location is not None
            ckpt = decode(self._tiers[row.tier].read(row.location))
            ckpt.check_key()
            chain = ckpt.chain
            if ckpt.key != row.key or len(ckpt.tokens) != row.tokens or (chain.keys if chain else ()) != row.blocks:
                raise CorruptCheckpoint("checkpoint does not match its index row")
            if chain is not None:
                ckpt = blocks.assemble(ckpt, self._block_loader(row), self._assemblers, ASSEMBLY_HELPERS)
        except (CorruptCheckpoint, OSError, KeyError, ValueError) as e:
            log.warning("dropping cache row %s (%s): %s", row.key.hex(), row.tier, e)
            try:
                dropped = index.remove(row.key, row.token) is not None
            except IndexWriteError as ie:  # not restored all the same; the next restore tries again
                log.warning("could not drop cache row %s: %s", row.key.hex(), ie)
                dropped = True
            if dropped:
                self._counters.count("corrupt_files")
            return None
        return ckpt

    def _block_loader(self, row: Row) -> Callable[[int], memoryview]:
        """load(i): row's block i read and verified, its payload returned. A file block is read into slot i of
        this thread's reused buffer, a ram block in place. A block that is missing or fails verification is
        counted and marked for the next save that names it to write again; the row is not assembled
        (CorruptCheckpoint)."""
        tier = self._tiers[row.tier]
        size = len(row.blocks) * row.block_size if isinstance(tier, FileTier) else 0
        buf = memoryview(thread_buffer(_read_buffers, size))

        def load(i: int) -> memoryview:
            key = row.blocks[i]
            location = tier.block_location(key.hex())
            try:
                if isinstance(tier, FileTier):
                    view = buf[i * row.block_size : (i + 1) * row.block_size]
                    view = view[: tier.read_into(location, view)]
                else:
                    view = tier.read(location)
                return blocks.decode_block(view, key)
            except (CorruptCheckpoint, OSError, KeyError) as e:
                self._counters.count("corrupt_blocks")
                with contextlib.suppress(IndexWriteError):
                    self._index.block_corrupt(row.tier, key)
                raise CorruptCheckpoint(f"block {i} of {len(row.blocks)}: {e}") from e

        return load
