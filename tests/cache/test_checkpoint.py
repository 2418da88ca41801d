"""The checkpoint format: round trip, tamper detection (every single bit), zero-copy decode."""

from __future__ import annotations

import hashlib
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from barreld.cache import (
    Checkpoint,
    CorruptCheckpoint,
    KeyScheme,
    decode,
    encode_parts,
    encoded_size,
)
from barreld.cache.key import Namespace
from barreld.names import SAVE_REASONS

from .conftest import SCHEME


def encode(ckpt: Checkpoint) -> bytearray:
    return bytearray(b"".join(bytes(p) for p in encode_parts(ckpt)))


def small_ckpt() -> Checkpoint:
    return Checkpoint(
        key=SCHEME.key(b"hi"),
        model="m",
        fingerprint=SCHEME.fingerprint,
        quant="Q4_1",
        ctx_params=SCHEME.ctx_params,
        rendered=b"hi",
        tokens=[1, 2],
        save_reason="finish",
        created=1700000000.25,
        state=bytes(range(100)),
        logits=b"\0\0\x80?",
        prefixes=((SCHEME.key(b"h"), 1),),
    )


def test_format_is_pinned() -> None:
    data = encode(small_ckpt())
    assert len(data) == encoded_size(small_ckpt()) == 724
    golden = "f120c66e87cb48df442c79be08961381938b8c5d4166c82fc3ad940fe49e16cf"
    assert hashlib.sha256(data).hexdigest() == golden


def test_the_frontier_and_memory_kind_travel_with_the_state() -> None:
    """A finish checkpoint's key covers prompt and reply; its state, only the prefilled prompt."""
    ckpt = small_ckpt()
    assert decode(encode(ckpt)).frontier_tokens == 2 and decode(encode(ckpt)).memory == "full"
    ckpt.frontier, ckpt.memory = 1, "recurrent"
    got = decode(encode(ckpt))
    assert (got.frontier, got.frontier_tokens, got.memory) == (1, 1, "recurrent")
    for frontier, memory in ((3, "full"), (-1, "full"), (1, "paged")):
        ckpt.frontier, ckpt.memory = frontier, memory
        with pytest.raises(ValueError, match="do not describe the state"):
            encode(ckpt)


def test_every_single_bit_flip_is_detected() -> None:
    """Exhaustive over a whole file: header, metadata, tokens, prompt, state, logits, trailer."""
    data = encode(small_ckpt())
    for bit in range(len(data) * 8):
        data[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptCheckpoint):
            decode(data)
        data[bit // 8] ^= 1 << (bit % 8)
    decode(data)


def test_truncation_and_extension_are_detected() -> None:
    data = encode(small_ckpt())
    for cut in (0, 1, 63, 80, len(data) // 2, len(data) - 16, len(data) - 1):
        with pytest.raises(CorruptCheckpoint):
            decode(data[:cut])
    with pytest.raises(CorruptCheckpoint):
        decode(data + b"\0")


def test_decode_is_zero_copy_for_state_and_logits() -> None:
    data = encode(small_ckpt())
    ckpt = decode(data)
    assert isinstance(ckpt.state, memoryview) and isinstance(ckpt.logits, memoryview)
    assert ckpt.state.obj is data and ckpt.logits.obj is data
    assert bytes(ckpt.state) == bytes(range(100))
    assert ckpt.logits.cast("f").tolist() == [1.0]


def test_state_is_64_byte_aligned_in_the_file() -> None:
    data = encode(small_ckpt())
    offset = data.find(bytes(range(100)))
    assert offset % 64 == 0


def test_key_is_recomputed_from_contents() -> None:
    ckpt = small_ckpt()
    ckpt.check_key()
    ckpt.key = SCHEME.key(b"other")
    with pytest.raises(CorruptCheckpoint):
        ckpt.check_key()
    # A valid file (good checksum) whose claimed key does not match its prompt is caught too.
    with pytest.raises(CorruptCheckpoint):
        decode(encode(ckpt)).check_key()


def test_a_tenants_checkpoint_keeps_its_namespace_and_its_key_proves_it() -> None:
    ns = Namespace.of("alice", "end-user-7")
    scheme = SCHEME.within(ns.digest)
    ckpt = Checkpoint.build(scheme, "m", b"hi", [1, 2], "finish", bytes(100), tenant=ns.tenant)
    got = decode(encode(ckpt))
    assert (got.tenant, got.namespace, got.key) == ("alice", ns.digest, scheme.key(b"hi"))
    got.check_key()
    got.namespace = Namespace.of("bob").digest  # the same text under another tenant's namespace
    with pytest.raises(CorruptCheckpoint):
        got.check_key()
    assert decode(encode(small_ckpt())).namespace == b""  # a default-namespace file is written as before


def test_bad_inputs_are_refused_before_writing() -> None:
    with pytest.raises(ValueError):
        encoded_size(Checkpoint(**{**small_ckpt().__dict__, "save_reason": "whim"}))
    with pytest.raises(ValueError):
        encoded_size(Checkpoint(**{**small_ckpt().__dict__, "logits": b"\0\0\0"}))
    with pytest.raises(ValueError):
        encoded_size(Checkpoint(**{**small_ckpt().__dict__, "key": b"short"}))


int32 = st.integers(-(2**31), 2**31 - 1)
checkpoints = st.builds(
    lambda fp, quant, ctx, rendered, tokens, reason, created, state, logits, prefixes, model: Checkpoint(
        key=KeyScheme(fp, quant, ctx).key(rendered),
        model=model,
        fingerprint=fp,
        quant=quant,
        ctx_params=ctx,
        rendered=rendered,
        tokens=array("i", tokens),
        save_reason=reason,
        created=created,
        state=state,
        logits=logits,
        prefixes=tuple(prefixes),
    ),
    fp=st.binary(min_size=32, max_size=32),
    quant=st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=16),
    ctx=st.binary(max_size=40),
    rendered=st.binary(max_size=300),
    tokens=st.lists(int32, max_size=200),
    reason=st.sampled_from(SAVE_REASONS),
    created=st.floats(min_value=0, max_value=4e9, allow_nan=False),
    state=st.binary(max_size=3000),
    logits=st.none()
    | st.lists(st.floats(width=32, allow_nan=False), max_size=64).map(lambda xs: array("f", xs).tobytes()),
    prefixes=st.lists(st.tuples(st.binary(min_size=32, max_size=32), st.integers(1, 2**31)), max_size=4),
    model=st.text(max_size=40),
)


@given(checkpoints)
@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip(ckpt: Checkpoint) -> None:
    data = encode(ckpt)
    assert len(data) == encoded_size(ckpt)
    out = decode(data)
    out.check_key()
    assert out.key == ckpt.key
    assert (out.model, out.fingerprint, out.quant, out.ctx_params) == (
        ckpt.model,
        ckpt.fingerprint,
        ckpt.quant,
        ckpt.ctx_params,
    )
    assert out.rendered == ckpt.rendered
    assert out.tokens == ckpt.tokens
    assert (out.save_reason, out.created) == (ckpt.save_reason, ckpt.created)
    assert bytes(out.state) == bytes(ckpt.state)
    assert (None if out.logits is None else bytes(out.logits)) == ckpt.logits
    assert list(out.prefixes) == list(ckpt.prefixes)


@given(checkpoints, st.data())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_any_single_flipped_bit_is_detected(ckpt: Checkpoint, data: st.DataObject) -> None:
    raw = encode(ckpt)
    bit = data.draw(st.integers(0, len(raw) * 8 - 1), label="bit")
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptCheckpoint):
        decode(raw)


def test_logits_may_belong_to_a_prefix() -> None:
    """A finish checkpoint keeps its prompt's last logits: logits_at says after how many tokens."""
    from dataclasses import replace

    ckpt = replace(small_ckpt(), logits_at=2)
    back = decode(encode(ckpt))
    assert back.logits_at == 2 and back.logits_tokens == 2
    plain = decode(encode(small_ckpt()))
    assert plain.logits_at is None and plain.logits_tokens == len(plain.tokens)


@given(checkpoints, st.data())
@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow])
def test_earlier_prompts_logits_round_trip_beside_the_checkpoints_own(ckpt: Checkpoint, data: st.DataObject) -> None:
    """A conversation's row keeps the logits after its earlier prompts: each found by its token count, the
    checkpoint's own row still its own, and a flipped bit anywhere still refused."""
    from dataclasses import replace

    size = len(ckpt.logits) if ckpt.logits is not None else data.draw(st.integers(1, 16), label="floats") * 4
    points = data.draw(st.lists(st.integers(1, max(1, len(ckpt.tokens))), max_size=3, unique=True), label="at")
    if not ckpt.tokens or not size:
        points = []
    rows = [(at, bytes([at % 251]) * size) for at in sorted(points)]
    ckpt = replace(ckpt, prompt_logits=tuple(rows))
    raw = encode(ckpt)
    out = decode(raw)
    assert [(at, bytes(row)) for at, row in out.prompt_logits] == rows
    assert (None if out.logits is None else bytes(out.logits)) == ckpt.logits
    for at, row in rows:
        expected = ckpt.logits if ckpt.logits is not None and ckpt.logits_tokens == at else row
        assert bytes(out.logits_after(at)) == expected
    bit = data.draw(st.integers(0, len(raw) * 8 - 1), label="bit")
    raw[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptCheckpoint):
        decode(raw)


def test_earlier_prompts_logits_are_refused_unless_rows_of_one_length_within_the_tokens() -> None:
    from dataclasses import replace

    ckpt = small_ckpt()
    with pytest.raises(ValueError, match="one length"):
        encoded_size(replace(ckpt, prompt_logits=((1, b"\0" * 8),)))
    with pytest.raises(ValueError, match="outside"):
        encoded_size(replace(ckpt, prompt_logits=((3, b"\0" * 4),)))
    back = decode(encode(replace(ckpt, logits=None, prompt_logits=((1, b"\1" * 4),))))
    assert back.logits is None and bytes(back.logits_after(1)) == b"\1" * 4 and back.logits_after(2) is None


@pytest.mark.parametrize("bad", ['"1"', "1.5", "true", "1e999", "0"])
def test_malformed_prompt_logits_metadata_is_a_corrupt_file_not_a_crash(monkeypatch: pytest.MonkeyPatch,
                                                                        bad: str) -> None:
    """A file whose checksum holds but whose prompt_logits are not token counts within its tokens is refused
    as corrupt (dropped and counted), never read as some other count."""
    from dataclasses import replace

    import barreld.cache.checkpoint as fmt

    dumps = fmt.json.dumps
    monkeypatch.setattr(fmt.json, "dumps", lambda obj, **kw: dumps(obj, **kw).replace(
        '"prompt_logits":[1]', f'"prompt_logits":[{bad}]'))
    raw = encode(replace(small_ckpt(), prompt_logits=((1, b"\1" * 4),)))
    monkeypatch.undo()
    assert f'"prompt_logits":[{bad}]'.encode() in raw
    with pytest.raises(CorruptCheckpoint, match="bad metadata"):
        decode(raw)
