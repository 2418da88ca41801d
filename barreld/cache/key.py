"""Cache keys: a fixed byte layout hashed with SHA-256, identical across processes and restarts.

key = sha256(fingerprint(32) || quant(16, NUL-padded ASCII) || u32 len(ctx_params) || ctx_params || rendered)

A block of a checkpoint's KV (its cells for tokens i*B .. i*B+n-1) has a key of its own, chained to the
block before it, so that equal keys mean the same tokens after the same prefix under the same model:

block key = sha256(b"BRLBLK\0\1" || fingerprint(32) || quant(16) || u32 len(ctx_params) || ctx_params
                   || parent block key (32; zeros for the first block) || u32 n || n tokens as int32)

Every field before the rendered prompt bytes has a fixed width or an explicit length, so no two
different field tuples can produce the same hashed byte string.

A tenant's keys (see `Namespace`) start with b"BRLNS\0\1" || namespace digest(32) before the fields above, in
both layouts: a lookup of one namespace can never find another's rows, prefixes or blocks. The default
namespace adds nothing, so the keys a single-tenant daemon stored stay as they were; no key of it can equal a
namespaced one, which would need a model fingerprint (a SHA-256 digest) that starts with that tag.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from barreld.names import FINGERPRINT_MODES

_READ_CHUNK = 8 * 1024 * 1024
BLOCK_TAG = b"BRLBLK\0\1"
NO_PARENT = bytes(32)
_QUANT_WIDTH = 16
NAMESPACE_TAG = b"BRLNS\0\1"
_SCHEMES_KEPT = 256  # namespaced schemes a model keeps ready (one per tenant and salt in use)


def fingerprint_gguf(path: Path, mode: str, supplied: str | None = None) -> bytes:
    """The 32-byte model fingerprint that starts every key for this model.

    safe: SHA-256 of every byte of the file (slow on big files, always right).
    gguf_chunked: see `gguf_chunked_digest` (reads megabytes, not gigabytes).
    fast_unsafe: SHA-256 of the operator-supplied string, trusted blindly: two different models given the
    same string share keys and would restore each other's state.
    """
    if mode == "safe":
        return _sha256_file(Path(path))
    if mode == "gguf_chunked":
        return gguf_chunked_digest(Path(path))
    if mode == "fast_unsafe":
        if not supplied:
            raise ValueError("fingerprint mode fast_unsafe needs a non-empty supplied digest string")
        return hashlib.sha256(supplied.encode("utf-8")).digest()
    raise ValueError(f"unknown fingerprint mode {mode!r}; expected one of {', '.join(FINGERPRINT_MODES)}")


def _sha256_file(path: Path) -> bytes:
    h = hashlib.sha256()
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.digest()


# GGUF value types (gguf.h): fixed widths; 8 = string, 9 = array.
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING = 8
_GGUF_ARRAY = 9
_GGUF_UINT32 = 4


class _GGUFReader:
    """Bounds-checked little-endian reads over a mapped file; any overrun is a ValueError."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: truncated or corrupt GGUF (read past end at byte {self.pos})")
        start = self.pos
        self.pos += n
        return start

    def u32(self) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8))[0]

    def string(self) -> bytes:
        n = self.u64()
        start = self.take(n)
        return bytes(self.buf[start : start + n])

    def skip_string(self) -> None:
        self.take(self.u64())

    def value(self, vtype: int) -> object:
        """Read one value; only scalars are returned, arrays and strings are skipped (None)."""
        if vtype in _GGUF_FIXED:
            start = self.take(_GGUF_FIXED[vtype])
            return self.buf[start : start + _GGUF_FIXED[vtype]]
        if vtype == _GGUF_STRING:
            self.skip_string()
            return None
        if vtype == _GGUF_ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _GGUF_FIXED:
                self.take(_GGUF_FIXED[etype] * count)
            elif etype in (_GGUF_STRING, _GGUF_ARRAY):
                for _ in range(count):
                    self.value(etype)
            else:
                raise ValueError(f"{self.path}: corrupt GGUF (array of unknown type {etype})")
            return None
        raise ValueError(f"{self.path}: corrupt GGUF (value of unknown type {vtype} at byte {self.pos})")


def gguf_chunked_digest(path: Path) -> bytes:
    """SHA-256 over the parts of a GGUF (v2 or v3, little-endian) that identify the model cheaply.

    Exactly these bytes are hashed, in this order:
      1. file[0 : E], where E is the end of the tensor-info section: the header (magic 'GGUF', u32 version,
         u64 n_tensors, u64 n_kv), every metadata key/value pair, and every tensor info (name, n_dims,
         dims, ggml type, offset), byte for byte as stored;
      2. the first tensor's data: file[D + o0 : D + o1], where D is E rounded up to general.alignment (a
         u32 key, default 32), o0 is the offset of the first tensor info in file order, and o1 the
         smallest tensor offset greater than o0 (or, when there is none, the end of the file). The
         alignment padding after that tensor is therefore part of the hash.
    A GGUF with no tensors hashes part 1 only. Anything that is not a well-formed GGUF v2/v3 raises
    ValueError. Two files differing only in tensors after the first collide: that is the price of speed.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # an empty file cannot be mapped
            raise ValueError(f"{path}: not a GGUF file (empty)") from e
    with buf:
        r = _GGUFReader(buf, path)
        n_tensors, alignment = _gguf_metadata(r)
        offsets = _gguf_tensor_offsets(r, n_tensors)
        info_end = r.pos
        h = hashlib.sha256(buf[:info_end])
        if offsets:
            data_start = -(-info_end // alignment) * alignment
            first = offsets[0]
            later = [o for o in offsets if o > first]
            start = data_start + first
            end = data_start + min(later) if later else len(buf)
            if end > len(buf) or start > end:
                raise ValueError(f"{path}: truncated GGUF (first tensor's data lies past the end)")
            h.update(buf[start:end])
        return h.digest()


def _gguf_metadata(r: _GGUFReader) -> tuple[int, int]:
    """Read the header and every metadata pair: (tensor count, general.alignment or its default 32)."""
    if len(r.buf) < 24 or r.buf[:4] != b"GGUF":
        raise ValueError(f"{r.path}: not a GGUF file (bad magic)")
    r.pos = 4
    version = r.u32()
    if version not in (2, 3):
        raise ValueError(f"{r.path}: unsupported GGUF version {version} (only v2 and v3, little-endian)")
    n_tensors, n_kv = r.u64(), r.u64()
    alignment = 32
    for _ in range(n_kv):
        name = r.string()
        vtype = r.u32()
        value = r.value(vtype)
        if name == b"general.alignment" and vtype == _GGUF_UINT32:
            alignment = struct.unpack("<I", value)[0]
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{r.path}: corrupt GGUF (general.alignment {alignment} is not a power of two)")
    return n_tensors, alignment


def _gguf_tensor_offsets(r: _GGUFReader, n_tensors: int) -> list[int]:
    """Read every tensor info; their data offsets in file order."""
    offsets = []
    for _ in range(n_tensors):
        r.skip_string()
        n_dims = r.u32()
        if n_dims > 8:
            raise ValueError(f"{r.path}: corrupt GGUF (tensor with {n_dims} dimensions)")
        r.take(8 * n_dims + 4)
        offsets.append(r.u64())
    return offsets


_CTX_LAYOUT_VERSION = 3
_CTX_STRUCT = struct.Struct("<BIIIBBBddII")


@dataclass(frozen=True)
class CtxParams:
    """The context parameters that change the bytes or layout of a sequence's KV state, and no others.

    Measured with the real models (tests/test_ctx_params.py): the same prompt's state is byte-identical
    across n_batch, n_threads and n_ctx, and differs with the K and V types, flash attention, the number of
    KV streams, and (on models whose kernels depend on the batch split) the prefill chunk size; llama.cpp
    refuses a state whose stream count differs from the context's.

    kv_streams: one KV stream per sequence (n_seq_max, when the cache is not unified), else 1: the
      state header records it and a restore into another stream count is refused.
    type_k, type_v: ggml type ids of the K and V caches (f16, q8_0, ...): the element encoding.
    flash_attn: with flash attention V is stored untransposed, and the floats depend on the batch split.
    rope_freq_base, rope_freq_scale: RoPE is applied to K before it is cached, so they change K's values.
    kv_unified: one unified cell buffer versus one stream per sequence: a different state layout.
    swa_full: whether sliding-window layers keep every cell or only a ring: another cell order, other floats.
    prefill_chunk: every prefill splits at multiples of it; where batches split changes the floats on some
      models (flash attention on, repacked quantised kernels).
    gpu_layers: layers actually offloaded (0 on a CPU-only build whatever was asked): GPU kernels compute
      other floats than the CPU's.
    reuse_grain: the reuse grain measured at load when finer than the chunk (0: the chunk rule). A state
      whose tokens were prefilled from a point off the chunk boundaries is exact only where that grain
      holds, so daemons that measured another grain do not share it.
    reuse_min_batch: the fewest tokens of a batch off a chunk boundary measured with that grain (2: a token
      alone is the only batch whose kernels differ), for the same reason.
    merged_calls: a prefill alone puts several chunks in one call (proven at load), keeping a prompt's last
      chunk a call of its own when it holds fewer tokens than a batch needs for the full chunks' kernels
      (reuse_min_batch; 2: one token). Older daemons merged that chunk too, so their states' last tokens
      have other floats; the marker keeps them apart.
    spanned_calls: every prefill call holds reuse_min_batch tokens at least (proven at load): a short last
      chunk joins the call before it, so its tokens have the floats of a full batch, not of a short one.

    Deliberately NOT included, because they change how work is scheduled or how much fits, not the
    bytes of a prompt's state: n_ctx, n_batch, n_ubatch, n_threads, and the sampling seed. (A state too
    large for a smaller context is refused by llama.cpp at restore, and the request prefills instead.)
    """

    kv_streams: int
    type_k: int
    type_v: int
    flash_attn: bool
    rope_freq_base: float
    rope_freq_scale: float
    kv_unified: bool
    swa_full: bool
    prefill_chunk: int = 0
    gpu_layers: int = 0
    reuse_grain: int = 0
    reuse_min_batch: int = 2
    merged_calls: bool = False
    spanned_calls: bool = False

    def encode(self) -> bytes:
        """40 bytes, little-endian: u8 layout version (3), u32 kv_streams, u32 type_k, u32 type_v,
        u8 flash_attn, u8 kv_unified, u8 swa_full, f64 rope_freq_base, f64 rope_freq_scale,
        u32 prefill_chunk, u32 gpu_layers; then a u32 reuse_grain only when it is set, and after it a u32
        reuse_min_batch only when it is over 2, so the states made under the older rules keep their keys; last the
        four bytes b"tail" when merged_calls is set, and b"span" when spanned_calls is."""
        try:
            grain = struct.pack("<I", self.reuse_grain) if self.reuse_grain else b""
            if self.reuse_grain and self.reuse_min_batch > 2:
                grain += struct.pack("<I", self.reuse_min_batch)
            grain += b"tail" if self.merged_calls else b""
            grain += b"span" if self.spanned_calls else b""
            return _CTX_STRUCT.pack(
                _CTX_LAYOUT_VERSION,
                self.kv_streams,
                self.type_k,
                self.type_v,
                bool(self.flash_attn),
                bool(self.kv_unified),
                bool(self.swa_full),
                float(self.rope_freq_base),
                float(self.rope_freq_scale),
                self.prefill_chunk,
                self.gpu_layers,
            ) + grain
        except struct.error as e:
            raise ValueError(f"context parameter out of range: {e}") from e


@dataclass(frozen=True)
class Namespace:
    """Whose rows a lookup may find: a tenant (a key's name, a Unix user) and, within it, an optional salt (an
    application's end user, vLLM's `cache_salt`). Requests of two namespaces share nothing the cache holds.

    `tenant` is the name operators see on the rows; `digest` is folded into every key (empty: the default
    namespace, the one tenant of a daemon without keys). Tenants that an operator lets share name the same
    `group`, so their digests agree while each row still names the tenant that wrote it."""

    tenant: str = ""
    digest: bytes = b""

    @classmethod
    def of(cls, tenant: str, salt: str = "", group: str | None = None) -> Namespace:
        """The namespace of a tenant's requests with this salt; the default tenant's without a salt is the
        default namespace."""
        label = tenant if group is None else group
        if not label and not salt:
            return cls(tenant)
        fields = (b"\0" if group is None else b"\1", label.encode(), salt.encode())
        h = hashlib.sha256(NAMESPACE_TAG)
        for f in fields:
            h.update(struct.pack("<I", len(f)))
            h.update(f)
        return cls(tenant, h.digest())

    @property
    def short(self) -> str:
        """The digest's first 8 bytes in hex ("" for the default namespace): tells namespaces apart in a dump
        without showing a salt."""
        return self.digest[:8].hex()


DEFAULT_NAMESPACE = Namespace()


@dataclass(frozen=True)
class KeyScheme:
    """Everything except the prompt that goes into a key: one per loaded model and context."""

    fingerprint: bytes
    quant: str
    ctx_params: bytes
    namespace: bytes = b""
    _prefix: Any = field(init=False, repr=False, compare=False)
    _block_prefix: Any = field(init=False, repr=False, compare=False)
    _within: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.fingerprint) != 32:
            raise ValueError(f"fingerprint must be 32 bytes, got {len(self.fingerprint)}")
        try:
            quant = self.quant.encode("ascii")
        except UnicodeEncodeError as e:
            raise ValueError(f"quant {self.quant!r} is not ASCII") from e
        if len(quant) > _QUANT_WIDTH or b"\0" in quant:
            raise ValueError(f"quant {self.quant!r} must be at most {_QUANT_WIDTH} ASCII bytes without NUL")
        if len(self.namespace) not in (0, 32):
            raise ValueError(f"a namespace digest is 32 bytes (or none), got {len(self.namespace)}")
        # The fixed prefix of every key's hash input, computed once per scheme.
        prefix = (
            (NAMESPACE_TAG + bytes(self.namespace) if self.namespace else b"")
            + bytes(self.fingerprint)
            + quant.ljust(_QUANT_WIDTH, b"\0")
            + struct.pack("<I", len(self.ctx_params))
            + bytes(self.ctx_params)
        )
        object.__setattr__(self, "_prefix", hashlib.sha256(prefix))
        object.__setattr__(self, "_block_prefix", hashlib.sha256(BLOCK_TAG + prefix))
        object.__setattr__(self, "_within", {})

    def within(self, namespace: bytes) -> KeyScheme:
        """This scheme for a namespace's keys (its digest; empty: the default namespace, this scheme itself)."""
        if namespace == self.namespace:
            return self
        kept = self._within
        scheme = kept.get(namespace)
        if scheme is None:
            if len(kept) >= _SCHEMES_KEPT:
                kept.clear()
            scheme = kept[namespace] = KeyScheme(self.fingerprint, self.quant, self.ctx_params, namespace)
        return scheme

    def key(self, rendered: bytes) -> bytes:
        """The 32-byte cache key of these rendered prompt bytes."""
        h = self._prefix.copy()
        h.update(rendered)
        return h.digest()

    def block_key(self, parent: bytes, tokens: Sequence[int]) -> bytes:
        """The 32-byte key of a block of KV holding `tokens`, after the block whose key is `parent`."""
        if len(parent) != 32:
            raise ValueError(f"a parent block key is 32 bytes, got {len(parent)}")
        h = self._block_prefix.copy()
        h.update(parent)
        h.update(struct.pack("<I", len(tokens)))
        h.update(array("i", tokens).tobytes())
        return h.digest()

    def block_keys(self, tokens: Sequence[int], block_tokens: int, count: int) -> list[bytes]:
        """The chained keys of the first `count` blocks of `block_tokens` tokens each."""
        keys, parent = [], NO_PARENT
        for i in range(count):
            parent = self.block_key(parent, tokens[i * block_tokens : (i + 1) * block_tokens])
            keys.append(parent)
        return keys

    def key_hex(self, rendered: bytes) -> str:
        """The key as 64 lowercase hex digits, as `cache dump` prints it."""
        return self.key(rendered).hex()
