"""Reading a row back for a restore: its file read and verified against its row, and a row of blocks assembled,
its blocks read and verified by a few helper threads beside the restoring one.

A restore is held to llama.cpp's own `llama_state_seq_set_data` of the same state (bench/restore_floor.py), so
the ram tier's path does no work that cannot change its answer:

- A ram-tier block is not hashed again on a restore: it lies in this process's private anonymous memory,
  written there from the buffers its checksum was computed over, and no other process can touch it. Its header
  (magic, format, key, length) is still checked. A file tier's block is always hashed (the file may have
  changed), and `cache verify` (audit) hashes every block of every tier.
- Each restoring thread assembles into one reused buffer, and remembers which row file it last assembled there
  (its verified xxh3-128 checksum, which covers the block keys, the tail and the sequence). A ram-tier restore
  of the same row file again, while nothing else has been assembled there, hands that buffer back instead of
  copying every block into it again: blocks are content-addressed, so the same row file assembles to the same
  bytes. The state is handed out read-only, so nothing can change the buffer while it is remembered; the row
  file itself is read and verified every time. `cache verify` never takes this shortcut.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

from . import blocks
from .checkpoint import Checkpoint, decode
from .counters import Counters
from .errors import CorruptCheckpoint, IndexWriteError
from .index import Index, Row
from .tiers import FileTier, RamTier, Tier, thread_buffer

log = logging.getLogger("barreld.cache")

_read_buffers = threading.local()
_assembly = threading.local()
"""The restoring thread's assembly buffer (`buf`) and what it holds: `done` = (row file checksum, state size)
of the last assembly there that completed, None while one is under way or failed."""
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

    def read_verified(self, row: Row, *, reuse: bool = False) -> Checkpoint | None:
        """The row's checkpoint, checksum and key verified; on any failure the row is dropped. With `reuse`
        (a restore, not an audit), a ram-tier row of blocks that this thread assembled last is handed back
        as it lies in the assembly buffer (see the module's doc)."""
        index = self._index
        try:
            assert row.location is not None
            tier = self._tiers[row.tier]
            raw = tier.read(row.location)
            ckpt = decode(raw)
            ckpt.check_key()
            chain = ckpt.chain
            if ckpt.key != row.key or len(ckpt.tokens) != row.tokens or (chain.keys if chain else ()) != row.blocks:
                raise CorruptCheckpoint("checkpoint does not match its index row")
            if chain is not None:
                reuse = reuse and isinstance(tier, RamTier)
                ckpt = self._assemble(ckpt, row, bytes(memoryview(raw)[-16:]) if reuse else None)
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

    def _assemble(self, ckpt: Checkpoint, row: Row, digest: bytes | None) -> Checkpoint:
        """The row's state assembled in this thread's buffer, handed out read-only; the last assembly's when
        `digest` (the verified checksum of the row file) is the one it was made from."""
        done = getattr(_assembly, "done", None)
        if digest is not None and done is not None and done[0] == digest:
            return replace(ckpt, state=memoryview(_assembly.buf)[: done[1]].toreadonly(), chain=None)
        _assembly.done = None  # the buffer is about to change; a failure below leaves it unknown
        load = self._block_loader(row, trust_ram=digest is not None)
        whole = blocks.assemble(ckpt, load, self._assemblers, ASSEMBLY_HELPERS, out=partial(thread_buffer, _assembly))
        state = memoryview(whole.state)
        if digest is not None and state.obj is getattr(_assembly, "buf", None):
            _assembly.done = (digest, state.nbytes)
        return replace(whole, state=state.toreadonly())

    def _block_loader(self, row: Row, trust_ram: bool = False) -> Callable[[int], memoryview]:
        """load(i): row's block i read and verified, its payload returned. A file block is read into slot i of
        this thread's reused buffer, a ram block in place, its checksum not computed again with `trust_ram`
        (a restore; the module's doc says why). A block that is missing or fails verification is counted and
        marked for the next save that names it to write again; the row is not assembled (CorruptCheckpoint)."""
        tier = self._tiers[row.tier]
        size = len(row.blocks) * row.block_size if isinstance(tier, FileTier) else 0
        trusted = trust_ram and isinstance(tier, RamTier)
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
                return blocks.decode_block(view, key, verify=not trusted)
            except (CorruptCheckpoint, OSError, KeyError) as e:
                self._counters.count("corrupt_blocks")
                with contextlib.suppress(IndexWriteError):
                    self._index.block_corrupt(row.tier, key)
                raise CorruptCheckpoint(f"block {i} of {len(row.blocks)}: {e}") from e

        return load
