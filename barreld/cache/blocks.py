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
    56  P  payload: the cells' bytes as `stateformat.chunk` writes them
    end-16 16  xxh3_128 of every byte before it

Row value and block values are independent content-addressed values: a reader assembles a row only once
every block it names has been read and verified, so a row whose parts are missing is never assembled.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import replace

import xxhash

from . import stateformat
from .checkpoint import Buffer, Chain, Checkpoint
from .errors import CorruptCheckpoint
from .tiers import thread_buffer

DEFAULT_BLOCK_TOKENS = 128
"""Tokens per block when the operator sets none: the smallest block the default prefill chunk (n_batch 512)
allows. Each checkpoint's tail (up to block_tokens - 1 tokens after its last whole block) is its own, so on
a chat whose turns add a hundred tokens each, 128 stores 1.4 times one state per distinct token where 256
stores 1.7 times (bench/RESULTS.md, section 7)."""
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


def decode_block(buf: Buffer, key: bytes) -> memoryview:
    """The payload of a verified block file of `key` (a view into buf); CorruptCheckpoint otherwise."""
    mv = memoryview(buf).cast("B")
    if len(mv) < _HEAD.size + _TRAILER:
        raise CorruptCheckpoint(f"block {key.hex()} is too short ({len(mv)} bytes)")
    if xxhash.xxh3_128(mv[:-_TRAILER]).digest() != mv[-_TRAILER:]:
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
    pieces = stateformat.split(layout, block_tokens)
    keys = ckpt.key_scheme().block_keys(ckpt.tokens, block_tokens, len(pieces.blocks))
    opaque = [bytes(p) for p in pieces.opaque]
    chain = Chain(block_tokens, block_file_size(len(pieces.blocks[0])), tuple(keys),
                  stateformat.shape_to_json(shape), layout.seq_id, len(pieces.tail), tuple(len(p) for p in opaque))
    row = replace(ckpt, state=b"".join([pieces.tail, *opaque]), chain=chain, layout=None)
    return row, list(zip(keys, pieces.blocks, strict=True))


def assemble(row: Checkpoint, payloads: list[memoryview]) -> Checkpoint:
    """The whole checkpoint from its row and its blocks' verified payloads, in order: the state is assembled
    once into this thread's reused buffer (valid until the thread's next assembly)."""
    chain = row.chain
    if chain is None or len(payloads) != len(chain.keys):
        raise CorruptCheckpoint("a row assembled without exactly the blocks it names")
    try:
        shape = stateformat.shape_from_json(chain.shape)
        own = memoryview(row.state).cast("B")
        cuts = [chain.tail, *chain.opaque]
        parts, off = [], 0
        for n in cuts:
            parts.append(own[off : off + n])
            off += n
        size = _assembled_size(shape, payloads, parts)
        out = thread_buffer(_assembly, size)
        state = stateformat.assemble(shape, chain.seq_id, [*payloads, parts[0]], parts[1:], out=out)
    except stateformat.StateFormatError as e:
        raise CorruptCheckpoint(f"the blocks do not assemble into a state: {e}") from e
    return replace(row, state=state, chain=None)


def _assembled_size(shape: stateformat.StateShape, payloads: list[memoryview], parts: list[memoryview]) -> int:
    """An upper bound of the assembled state's size: the buffer is sized by it, assemble checks exactly."""
    kv = shape.kv
    cells = sum(len(p) for p in payloads) + len(parts[0])
    n = cells // kv.cell_bytes if kv is not None and kv.cell_bytes else 0
    att = kv.section_size(n) if kv is not None else 0
    return stateformat.HEADER.size + att + sum(len(p) for p in parts[1:])

