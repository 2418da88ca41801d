"""Backend over llama.cpp's C API (through llama-cpp-python's ctypes bindings).

The high-level `Llama` class is avoided on purpose: the cache needs direct control of sequences,
batches and per-sequence KV state, and `Llama.save_state()` copies the whole context through Python.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

import numpy as np

from barreld.engine.backend import BackendError, BatchItem, ContextSettings, ModelLoadError, resolve_flash_attn
from barreld.engine.memory import memory_kind
from barreld.engine.state_buffers import StateBuffers
from barreld.engine.token_prefix import Specials, extend
from barreld.names import KV_CACHE_TYPES, PLAIN_KV_TYPES

log = logging.getLogger(__name__)

_init_lock = threading.Lock()
_initialised = False
GGUF_MAGIC = b"GGUF"
_BEYOND_UNICODE = re.compile(rb"[\xf5-\xf7]|\xf4(?=[\x90-\xbf])")
TOKENIZED_MEMO_TOKENS = 1 << 20
"""Tokens of the most recently tokenised prompts kept (4 bytes each, with their text), so a prompt sent again (an
exact hit is one) skips the tokenizer, and one that extends a kept prompt tokenises only its new part: 2.5 ms of
a 1,390-token prompt's time to first token on the bench machine, 54 ms of a 13,000-token Claude Code call's."""
EXTENDED_CANDIDATES = 16
"""The latest kept prompts a new one is compared with for the longest shared start."""


def _llama():
    """Import llama_cpp once, silence its C logging (barreld has its own log) and init the backend."""
    global _initialised
    import llama_cpp
    from llama_cpp import _logger

    with _init_lock:
        if not _initialised:
            _logger.set_verbose(False)
            llama_cpp.llama_backend_init()
            _initialised = True
    return llama_cpp


def _context_hint(settings: ContextSettings) -> str:
    """Why llama.cpp most likely refused the context: its own log, which says so, is silenced."""
    plain = {KV_CACHE_TYPES[name] for name in PLAIN_KV_TYPES}
    if settings.type_k in plain and settings.type_v in plain:
        return ""
    return (
        ": a quantised K or V cache needs the model's attention head size to be a multiple of the type's"
        " block size (32); try f16"
    )


def probe_load(path: Path) -> None:
    """Reads the model file as a load would, then frees it: ModelLoadError when llama.cpp refuses it."""
    L = _llama()
    params = L.llama_model_default_params()
    params.n_gpu_layers = 0
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelLoadError(f"llama.cpp could not load {path}: corrupt or unsupported GGUF")
    L.llama_model_free(model)


class LlamaBackend:
    """One model and one context holding n_seq_max sequences of n_ctx cells each."""

    def __init__(self, path: Path, settings: ContextSettings) -> None:
        if not path.is_file():
            raise ModelLoadError(f"model file not found: {path}")
        with path.open("rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ModelLoadError(f"{path} is not a GGUF file (bad magic bytes)")
        L = _llama()
        self._L = L
        self.path = path
        self.settings = settings
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = settings.n_gpu_layers
        self._model = L.llama_model_load_from_file(str(path).encode(), mparams)
        if not self._model:
            raise ModelLoadError(f"llama.cpp could not load {path}: corrupt or unsupported GGUF")
        self._vocab = self.vocab = L.llama_model_get_vocab(self._model)
        n_ctx_train = L.llama_model_n_ctx_train(self._model)
        if settings.n_ctx > n_ctx_train:
            L.llama_model_free(self._model)
            raise ModelLoadError(f"n_ctx {settings.n_ctx} exceeds the model's training context {n_ctx_train}")
        self._describe_memory(settings)
        self.flash_attn = resolve_flash_attn(settings.flash_attn, self.memory, settings.swa_full)
        settings = self.settings = dataclasses.replace(settings, flash_attn=self.flash_attn)
        cparams = self._context_params(settings)
        self._ctx = L.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            L.llama_model_free(self._model)
            raise ModelLoadError(f"llama.cpp could not create a context for {path}{_context_hint(settings)}")
        self._mem = L.llama_get_memory(self._ctx)
        self.n_ctx = settings.n_ctx
        self.n_batch = settings.n_batch
        self.n_seq_max = settings.n_seq_max
        self.n_vocab = L.llama_vocab_n_tokens(self._vocab)
        self._row_type = ctypes.c_float * self.n_vocab  # made once: numpy's as_array builds one a call
        self.ftype = L.llama_model_ftype(self._model)
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._piece_buf = ctypes.create_string_buffer(512)
        self._pieces: dict[int, bytes] = {}
        self._eog = bytearray(self.n_vocab)  # llama.cpp asked once a token: 0 not yet, 1 no, 2 yes
        self._tokenized: OrderedDict[tuple[bytes, bytes], array] = OrderedDict()  # (scope, text) -> tokens
        self._tokenized_count = 0
        self._tokenized_lock = threading.Lock()  # count_tokens tokenises on server threads
        self._specials = self._find_specials()
        template = L.llama_model_chat_template(self._model, None)
        self.chat_template = template.decode("utf-8", "replace") if template else None
        self.bos_text = self._special_text(L.llama_vocab_bos(self._vocab))
        self.eos_text = self._special_text(L.llama_vocab_eos(self._vocab))
        self._warm_up()

    def _context_params(self, settings: ContextSettings):
        """llama.cpp's context parameters for these settings; records the RoPE values the key needs."""
        L = self._L
        threads = settings.n_threads or len(os.sched_getaffinity(0))
        cparams = L.llama_context_default_params()
        cparams.n_ctx = settings.n_ctx * settings.n_seq_max
        cparams.n_batch = settings.n_batch
        cparams.n_ubatch = min(settings.n_ubatch or settings.n_batch, settings.n_batch)
        cparams.n_seq_max = settings.n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.type_k = settings.type_k
        cparams.type_v = settings.type_v
        cparams.flash_attn_type = 1 if settings.flash_attn else 0
        cparams.swa_full = settings.swa_full
        cparams.kv_unified = False
        cparams.no_perf = True
        self.rope_freq_base = float(cparams.rope_freq_base)
        self.rope_freq_scale = float(cparams.rope_freq_scale)
        return cparams

    def _describe_memory(self, settings: ContextSettings) -> None:
        """The memory kind from llama.cpp's own model flags, and what changes the floats it computes."""
        L, m = self._L, self._model
        self.swa_window = max(0, L.llama_model_n_swa(m))
        self.memory = memory_kind(self.swa_window, L.llama_model_is_recurrent(m), L.llama_model_is_hybrid(m))
        self.swa_full = bool(settings.swa_full) and self.swa_window > 0
        self.ring = self.swa_window > 0 and not self.swa_full
        self._window_buf = bytearray()
        self._state_buffers = StateBuffers()
        self.mrope = L.llama_model_rope_type(m) in (L.LLAMA_ROPE_TYPE_MROPE, L.LLAMA_ROPE_TYPE_IMROPE)
        # llama.cpp offloads the repeating layers and the output layer: n_layer + 1 in all.
        offloadable = L.llama_model_n_layer(m) + 1 if L.llama_supports_gpu_offload() else 0
        asked = settings.n_gpu_layers
        self.gpu_layers = offloadable if asked < 0 else min(asked, offloadable)

    def _warm_up(self) -> None:
        """One small decode at load, so the first request does not pay for llama.cpp's lazy allocations."""
        bos = self._L.llama_vocab_bos(self._vocab)
        self.decode([BatchItem(max(bos, 0), 0, 0, False), BatchItem(max(bos, 0), 1, 0, True)])
        self.seq_rm(0, 0, -1)

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = self._L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.raw[:n].decode("utf-8", "replace") if n >= 0 else None

    def tokenize(self, data: bytes, scope: bytes = b"") -> list[int]:
        """Special tokens in the text are parsed, so a rendered chat template round-trips exactly. The tokens
        of the latest prompts (TOKENIZED_MEMO_TOKENS in all) are kept by scope, a tenant's namespace digest: the
        same bytes tokenise the same, and a prompt that extends a kept one of its scope tokenises only what
        follows the last special token they share. How fast a prompt tokenises never depends on another
        tenant's prompts."""
        key = (scope, bytes(data))
        with self._tokenized_lock:
            kept = self._tokenized.get(key)
            if kept is not None:
                self._tokenized.move_to_end(key)
                return list(kept)
            latest = list(islice(((text, tokens) for (owner, text), tokens in reversed(self._tokenized.items())
                                  if owner == scope), EXTENDED_CANDIDATES))
        extended = extend(latest, key[1], self._specials, self.tokenize_tail) if self._specials else None
        tokens = extended or self._tokenize(key[1], True)
        if len(tokens) <= TOKENIZED_MEMO_TOKENS // 4:
            with self._tokenized_lock:
                if key not in self._tokenized:
                    self._tokenized[key] = array("i", tokens)
                    self._tokenized_count += len(tokens)
                while self._tokenized_count > TOKENIZED_MEMO_TOKENS:
                    self._tokenized_count -= len(self._tokenized.popitem(last=False)[1])
        return tokens

    def _find_specials(self) -> Specials | None:
        """The vocabulary's special tokens as token_prefix needs them, found at load (113 ms over Gemma 3's
        262,144 tokens); None for a vocabulary whose texts it does not show exact to cut: one that adds EOS or SEP
        at a text's end, or whose tokenizer keeps state across special tokens (only SPM's and BPE's are known not
        to)."""
        L, v = self._L, self._vocab
        fits = L.llama_vocab_type(v) in (L.LLAMA_VOCAB_TYPE_SPM, L.LLAMA_VOCAB_TYPE_BPE) \
            and not L.llama_vocab_get_add_eos(v) and not L.llama_vocab_get_add_sep(v)
        return Specials.of(self._special_tokens()) if fits else None

    def _special_tokens(self) -> Iterator[tuple[int, bytes, bool]]:
        """Each special token's id, text, and whether cutting after it is not shown exact: it strips the
        whitespace beside it, or its text holds a NUL byte (the C API's text stops there)."""
        L, v = self._L, self._vocab
        special = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED | L.LLAMA_TOKEN_ATTR_UNKNOWN
        strips = L.LLAMA_TOKEN_ATTR_LSTRIP | L.LLAMA_TOKEN_ATTR_RSTRIP
        for token in range(self.n_vocab):
            attr = L.llama_vocab_get_attr(v, token)
            if attr & special:
                yield token, L.llama_vocab_get_text(v, token), bool(attr & strips) or b"\0" in self.piece(token)

    def tokenize_tail(self, data: bytes) -> list[int]:
        """Tokenises text that continues a sequence: no BOS or other added special tokens."""
        return self._tokenize(data, False)

    def _tokenize(self, data: bytes, add_special: bool) -> list[int]:
        # llama.cpp reads undecodable bytes as U+FFFD, except 4-byte sequences above U+10FFFF, where it
        # throws a C++ exception that aborts the process; such lead bytes become 0xFF, another U+FFFD.
        data = _BEYOND_UNICODE.sub(b"\xff", data)
        L = self._L
        cap = len(data) + 8
        arr = (L.llama_token * cap)()
        n = L.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, True)
        if n < 0:
            cap = -n
            arr = (L.llama_token * cap)()
            n = L.llama_tokenize(self._vocab, data, len(data), arr, cap, add_special, True)
        return list(arr[:n])

    def piece(self, token: int) -> bytes:
        cached = self._pieces.get(token)
        if cached is None:
            n = self._L.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, True)
            if n < 0:
                raise BackendError(f"token {token} renders to more than {len(self._piece_buf)} bytes")
            cached = self._pieces[token] = self._piece_buf.raw[:n]
        return cached

    def is_eog(self, token: int) -> bool:
        known = self._eog[token]
        if not known:
            known = self._eog[token] = 2 if self._L.llama_vocab_is_eog(self._vocab, token) else 1
        return known == 2

    def decode(self, items: list[BatchItem]) -> None:
        if not items or len(items) > self.n_batch:
            raise BackendError(f"batch of {len(items)} tokens (n_batch {self.n_batch})")
        b = self._batch
        b.n_tokens = len(items)
        for i, it in enumerate(items):
            b.token[i] = it.token
            b.pos[i] = it.pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = it.seq
            b.logits[i] = it.logits
        rc = self._L.llama_decode(self._ctx, b)
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc}")
        if self.ring and len(items) > 1 and all(it.seq == items[0].seq for it in items):
            self._order_window(items[0].seq)

    def _order_window(self, seq: int) -> None:
        """Puts a ring's window cells back in position order from its first cell: its SWA part written and
        read back (`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`), as a restore lays them out (barreld.engine.memory)."""
        L, partial = self._L, 1
        size = L.llama_state_seq_get_size_ext(self._ctx, seq, partial)
        if len(self._window_buf) < size:
            self._window_buf = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(self._window_buf)
        ok = L.llama_state_seq_get_data_ext(self._ctx, buf, size, seq, partial) == size
        ok = ok and L.llama_state_seq_set_data_ext(self._ctx, buf, size, seq, partial) == size
        del buf
        if not ok:
            raise BackendError(f"could not put the sliding window of sequence {seq} back in order")

    def logits(self, index: int) -> np.ndarray:
        return self.row(index).copy()

    def row(self, index: int) -> np.ndarray:
        ptr = self._L.llama_get_logits_ith(self._ctx, index)
        if not ptr:
            raise BackendError(f"no logits for batch position {index}")
        return np.frombuffer(self._row_type.from_address(ctypes.addressof(ptr.contents)), dtype=np.float32)

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        if not self._L.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise BackendError(f"could not remove positions {p0}..{p1} of sequence {seq}")

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        L = self._L
        return L.llama_memory_seq_pos_min(self._mem, seq), L.llama_memory_seq_pos_max(self._mem, seq)

    def state_get(self, seq: int) -> bytearray:
        size = self._L.llama_state_seq_get_size(self._ctx, seq)
        out = self._state_buffers.take(size)
        dst = (ctypes.c_uint8 * size).from_buffer(out)
        got = self._L.llama_state_seq_get_data(self._ctx, dst, size, seq)
        del dst
        if got != size:
            raise BackendError(f"state of sequence {seq}: got {got} of {size} bytes")
        return out

    def state_set(self, seq: int, data: memoryview) -> None:
        """Loads a sequence's KV state; `data` may be read-only (mmap), so ctypes gets a pointer, not a copy."""
        self.seq_rm(seq, 0, -1)
        size = data.nbytes
        holder = np.frombuffer(data, dtype=np.uint8)
        src = holder.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        got = self._L.llama_state_seq_set_data(self._ctx, src, size, seq)
        if got != size:
            self.seq_rm(seq, 0, -1)
            raise BackendError(f"llama.cpp rejected a state of {size} bytes for sequence {seq}")

    def _special_text(self, token: int) -> str:
        return self.piece(token).decode("utf-8", "replace") if token >= 0 else ""

    def close(self) -> None:
        L = self._L
        if self._ctx:
            L.llama_batch_free(self._batch)
            L.llama_free(self._ctx)
            L.llama_model_free(self._model)
            self._ctx = None
