"""Checkpoints stored as chains of content-addressed token blocks, so a prefix shared by many is stored once.

A checkpoint's full-attention cells below its frontier are cut into blocks of `block_tokens` cells; each block
is keyed by the model, its context parameters, its parent block's key and its tokens (`KeyScheme.block_key`),
so equal keys mean equal KV and one stored block serves every checkpoint that starts with those tokens. The
checkpoint itself (its row value) keeps the block keys, the tail (cells after the last whole block), the
sections that cannot be cut (a sliding window, a recurrent state) whole, its logits and metadata.

Block file layout (little-endian):

    0   8  magic b"BRLBLK\\r\\n"
    8   4  u32 format version (BLOCK_FORMAT)
    12  4  zero
    16 32  the block's key
    48  8  u64 payload length P
    56  P  payload: the cells' bytes as `statecut.chunk` writes them
    end-16 16  xxh3_128 of every byte before it

Row value and block values are independent content-addressed values: a reader assembles a row only once
every block it names has been read and verified, so a row whose parts are missing is never assembled.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from concurrent.futures import Executor, wait
from dataclasses import replace
from functools import partial

import xxhash

from . import statecut, stateformat
from .checkpoint import Buffer, Chain, Checkpoint
from .errors import CorruptCheckpoint
from .tiers import thread_buffer

DEFAULT_BLOCK_TOKENS = 128
"""Tokens per block when the operator sets none: the smallest block the default prefill chunk (n_batch 512)
allows. A row's tail (up to block_tokens - 1 tokens after its last whole block) is its own; with superseded
rows dropped only each conversation's latest tail is kept (bench/RESULTS.md, section 8, has the bytes stored
per distinct token for 128 and 256)."""
BLOCK_MAGIC = b"BRLBLK\r\n"
BLOCK_FORMAT = 1
_HEAD = struct.Struct("<8sII32sQ")
_TRAILER = 16

_assembly = threading.local()


def block_file_size(payload: int) -> int:
    """Bytes of a block file holding `payload` bytes of cells."""
    return _HEAD.size + payload + _TRAILER


def encode_block(key: bytes, payload: Buffer) -> list[Buffer]:
    """A block file as buffers to write; the payload is not copied."""
    head = _HEAD.pack(BLOCK_MAGIC, BLOCK_FORMAT, 0, key, memoryview(payload).nbytes)
    h = xxhash.xxh3_128(head)
    h.update(payload)
    return [head, payload, h.digest()]


def decode_block(buf: Buffer, key: bytes, *, verify: bool = True) -> memoryview:
    """The payload of a verified block file of `key` (a view into buf); CorruptCheckpoint otherwise. Without
    `verify` its checksum is not computed again (its header still is checked): only for a block that has stayed
    in this process's memory since its checksum was computed."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _HEAD.size + _TRAILER:
        raise CorruptCheckpoint(f"block {key.hex()} is too short ({len(mv)} bytes)")
    if verify and xxhash.xxh3_128(mv[:-_TRAILER]).digest() != mv[-_TRAILER:]:
        raise CorruptCheckpoint(f"block {key.hex()}: checksum mismatch")
    magic, version, zero, stored_key, length = _HEAD.unpack_from(mv)
    if magic != BLOCK_MAGIC or version != BLOCK_FORMAT or zero or stored_key != key:
        raise CorruptCheckpoint(f"block {key.hex()}: not a format {BLOCK_FORMAT} block of this key")
    if _HEAD.size + length + _TRAILER != len(mv):
        raise CorruptCheckpoint(f"block {key.hex()}: length field disagrees with the file")
    return mv[_HEAD.size : _HEAD.size + length]


def split(ckpt: Checkpoint, block_tokens: int) -> tuple[Checkpoint, list[tuple[bytes, bytearray]]] | None:
    """The checkpoint as a row (format 2) and its blocks (key, payload), or None when it is better stored
    whole: no shape given, no full-attention cells, not one whole block, or a state whose attention cells are
    not exactly its frontier (only cells computed by the canonical prefill may be shared)."""
    shape = ckpt.layout
    if block_tokens < 1 or not isinstance(shape, stateformat.StateShape) or shape.kv is None:
        return None
    layout = stateformat.parse(ckpt.state, shape)
    stream = layout.attention.cells if layout.attention is not None else None
    cells = stream.cell_count if stream is not None else 0
    if cells != ckpt.frontier_tokens or cells < block_tokens:
        return None
    pieces = statecut.split(layout, block_tokens)
    keys = ckpt.key_scheme().block_keys(ckpt.tokens, block_tokens, len(pieces.blocks))
    opaque = [bytes(p) for p in pieces.opaque]
    chain = Chain(block_tokens, block_file_size(len(pieces.blocks[0])), tuple(keys),
                  stateformat.shape_to_json(shape), layout.seq_id, len(pieces.tail), tuple(len(p) for p in opaque))
    row = replace(ckpt, state=b"".join([pieces.tail, *opaque]), chain=chain, layout=None)
    return row, list(zip(keys, pieces.blocks, strict=True))


def assemble(row: Checkpoint, load: Callable[[int], memoryview], pool: Executor | None = None,
             helpers: int = 0, out: Callable[[int], bytearray] | None = None) -> Checkpoint:
    """The whole checkpoint from its row and its blocks, where `load(i)` reads block i and returns its verified
    payload.

    The state is assembled once into this thread's reused buffer (valid until the thread's next assembly), or
    into `out(size)` when given.
    Each block is loaded and placed straight into it as a task run by this thread and `helpers` threads of
    `pool`: reading, checksumming and copying all release the GIL, so a row of many blocks restores on several
    cores, with several reads in flight, where a whole state is one read and one checksum on one. Every task
    has ended when this returns or raises."""
    chain = row.chain
    if chain is None:
        raise CorruptCheckpoint("a row assembled without its chain of blocks")
    try:
        shape = stateformat.shape_from_json(chain.shape)
        own = memoryview(row.state).cast("B")
        cuts = [chain.tail, *chain.opaque]
        parts, off = [], 0
        for n in cuts:
            parts.append(own[off : off + n])
            off += n
        cell = shape.kv.cell_bytes if shape.kv is not None else 0
        counts = [chain.block_tokens] * len(chain.keys) + [chain.tail // cell if cell else 0]
        into = out or partial(thread_buffer, _assembly)
        assembly = statecut.Assembly(shape, chain.seq_id, counts, parts[1:], out=into)
        assembly.place(len(chain.keys), parts[0])
        _run_all([partial(_place, assembly, load, i) for i in range(len(chain.keys))], pool, helpers)
    except stateformat.StateFormatError as e:
        raise CorruptCheckpoint(f"the blocks do not assemble into a state: {e}") from e
    return replace(row, state=assembly.state, chain=None)


def _place(assembly: statecut.Assembly, load: Callable[[int], memoryview], i: int) -> None:
    assembly.place(i, load(i))


def _run_all(tasks: list[Callable[[], None]], pool: Executor | None, helpers: int) -> None:
    """Runs the tasks on this thread and on the pool's threads together (this thread starts at once, where a
    pool thread may take milliseconds to wake), waits until none is running, then raises the first failure: no
    task may still be writing into the buffer once the caller has it back. A failure stops the rest."""
    todo = iter(tasks)
    lock = threading.Lock()
    failures: list[BaseException] = []

    def drain() -> None:
        while True:
            with lock:
                task = None if failures else next(todo, None)
            if task is None:
                return
            try:
                task()
            except BaseException as e:
                with lock:
                    failures.append(e)

    running = [] if pool is None else [pool.submit(drain) for _ in range(min(helpers, len(tasks) - 1))]
    try:
        drain()
    finally:
        wait(running)
    if failures:
        try:
            raise failures[0]
        finally:  # the failure's traceback holds this frame: a cycle that would keep the buffer until a gc
            failures = []

