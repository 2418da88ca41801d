"""ModelRegistry over FakeBackend: load, get, unload, the default model, keys, and every bad option."""

from __future__ import annotations

import hashlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from barreld.cache.key import DEFAULT_NAMESPACE as DEFAULT
from barreld.cache.key import fingerprint_gguf
from barreld.engine.registry import LoadOptions, ModelRegistry
from barreld.errors import FailedPrecondition, InvalidArgument, NotFound
from barreld.names import Fingerprint, MemoryKind
from tests.fakes.backend import FakeBackend, write_gguf

from .conftest import EVENT_TIMEOUT, POLICY, Engine, plain


@pytest.fixture
def registry(tmp_path: Path, store) -> ModelRegistry:
    reg = ModelRegistry(store, POLICY, backend_factory=FakeBackend)
    yield reg
    reg.close()


def opts(path: Path, **kw: object) -> LoadOptions:
    return LoadOptions(path=path, **{"n_ctx": 256, "n_batch": 64, **kw})


def test_load_names_the_quantisation_and_fingerprints_the_file(registry: ModelRegistry, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf")
    model = registry.load("a", opts(path, policy={"min_tokens": "64"}))
    assert model.quant == "Q8_0" and model.path == path and model.policy.min_tokens == 64
    assert model.fingerprint == fingerprint_gguf(path, "gguf_chunked")
    assert registry.load("a", opts(path, policy={"min_tokens": "64"})) is model
    with pytest.raises(FailedPrecondition, match="already loaded with other settings"):
        registry.load("a", opts(path, n_ctx=512))
    assert registry.models() == [model]


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("safe", lambda p: hashlib.sha256(p.read_bytes()).digest()),
        ("fast_unsafe:my-model-v1", lambda p: hashlib.sha256(b"my-model-v1").digest()),
    ],
)
def test_fingerprint_modes(registry: ModelRegistry, tmp_path: Path, mode: str, expected) -> None:
    path = write_gguf(tmp_path / "a.gguf")
    assert registry.load("a", opts(path, fingerprint=Fingerprint.parse(mode))).fingerprint == expected(path)


def test_a_name_no_model_has_goes_to_the_first_model_whose_alias_matches(
    registry: ModelRegistry, tmp_path: Path
) -> None:
    a = registry.load("a", opts(write_gguf(tmp_path / "a.gguf", "a"), aliases=("claude-*", "gpt-4o")))
    b = registry.load("b", opts(write_gguf(tmp_path / "b.gguf", "b"), aliases=("*",)))
    assert registry.get("claude-opus-5-5") is a and registry.get("gpt-4o") is a
    assert registry.get("b") is b and registry.get("gpt-4o-mini") is b  # a's patterns match whole names only
    registry.unload("b")
    with pytest.raises(NotFound, match="unknown model 'gpt-4'"):
        registry.get("gpt-4")
    with pytest.raises(InvalidArgument, match="bad alias 'claude opus'"):
        registry.load("c", opts(write_gguf(tmp_path / "c.gguf", "c"), aliases=("claude opus",)))


def test_the_first_model_is_the_default_until_it_is_unloaded(registry: ModelRegistry, tmp_path: Path) -> None:
    a = registry.load("a", opts(write_gguf(tmp_path / "a.gguf", "a")))
    b = registry.load("b", opts(write_gguf(tmp_path / "b.gguf", "b")))
    assert registry.get("") is a and registry.get("b") is b and registry.default_name == "a"
    assert registry.unload("a") == 0
    assert registry.get("") is b and registry.default_name == "b"
    with pytest.raises(NotFound, match="not loaded"):
        registry.get("a")
    with pytest.raises(NotFound):
        registry.unload("a")
    assert a.worker.backend.closed
    registry.unload("b")
    assert registry.default_name is None and registry.models() == []


def test_keys_follow_the_file_and_the_context_not_the_name(engine: Engine, tmp_path: Path) -> None:
    engine.load("same", n_seq_max=1)
    engine.load("streams", n_seq_max=2)
    other = write_gguf(tmp_path / "other.gguf", "other")
    engine.registry.load("other", opts(other))
    key = {name: engine.registry.get(name).worker.cache.key(b"x", DEFAULT)
           for name in ("m", "same", "streams", "other")}
    assert key["m"] == key["same"] and len(set(key.values())) == 3
    a = plain(40, 1)
    first = engine.run(a)
    engine.store.settle()
    assert engine.run(a, name="same").route == "exact"
    assert engine.run(a, name="same").text == first.text
    assert engine.run(a, name="streams").route == "miss"


@pytest.mark.parametrize(
    ("name", "kw", "error", "message"),
    [
        ("bad name!", {}, InvalidArgument, "bad model name"),
        ("a", {"tier": "tape"}, InvalidArgument, "unknown tier 'tape'"),
        ("a", {"n_ctx": 8}, InvalidArgument, "bad n_ctx 8"),
        ("a", {"n_batch": 1 << 17}, InvalidArgument, "bad n_batch"),
        ("a", {"n_seq_max": 0}, InvalidArgument, "bad n_seq_max 0"),
        ("a", {"n_seq_max": 8, "n_batch": 15}, InvalidArgument, "at least 16"),
        ("a", {"policy": {"min_tokens": "lots"}}, InvalidArgument, "bad --policy: min_tokens"),
        ("a", {"policy": {"nope": "1"}}, InvalidArgument, "unknown policy key"),
        ("a", {"path": "missing.gguf"}, NotFound, "model file not found"),
        ("a", {"path": "junk.gguf"}, FailedPrecondition, "not a GGUF file"),
        ("nobody", {"path": None}, NotFound, "unknown model 'nobody'"),
        ("a", {"n_threads": 0}, InvalidArgument, "bad n_threads 0"),
        ("a", {"n_gpu_layers": -2}, InvalidArgument, "bad n_gpu_layers -2"),
        ("a", {"type_k": "q3_k"}, InvalidArgument, "bad type_k 'q3_k': expected one of f16"),
        ("a", {"type_v": "q4_0", "flash_attn": False}, InvalidArgument,
         "bad type_v 'q4_0': a quantised V cache needs flash_attn"),
    ],
)
def test_bad_options_are_refused_and_nothing_is_loaded(
    registry: ModelRegistry, tmp_path: Path, name: str, kw: dict, error: type, message: str
) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"\0" * 64)
    path = kw.pop("path", write_gguf(tmp_path / "a.gguf"))
    path = tmp_path / path if isinstance(path, str) else path
    with pytest.raises(error, match=message):
        registry.load(name, LoadOptions(path=path, **{"n_ctx": 256, "n_batch": 64, **kw}))
    assert registry.models() == []


KNOBS = [  # (option, value, whether it changes the bytes of a state, so the key)
    ("n_threads", 1, False),
    ("n_gpu_layers", 0, False),  # this build offloads nothing, whatever is asked
    ("n_gpu_layers", 12, False),
    ("type_k", "q8_0", True),
    ("type_v", "f32", True),
    ("flash_attn", False, True),  # unset: on for a model without a sliding window
    ("policy", {"prefill_chunk_size": "16"}, True),  # where prefills split changes floats on some models
    ("policy", {"min_tokens": "64"}, False),
    ("swa_full", False, False),  # a model without a sliding window
]


def test_flash_attention_unset_is_on_for_full_attention_and_swa_full_and_wherever_a_quantised_v_needs_it(
    registry: ModelRegistry, tmp_path: Path
) -> None:
    full, swa = write_gguf(tmp_path / "full.gguf"), write_gguf(tmp_path / "swa.gguf", memory=MemoryKind.SWA, window=16)
    recurrent = write_gguf(tmp_path / "recurrent.gguf", memory=MemoryKind.RECURRENT)
    assert registry.load("full", opts(full)).worker.backend.flash_attn
    assert not registry.load("recurrent", opts(recurrent)).worker.backend.flash_attn
    assert not registry.load("ring", opts(swa)).worker.backend.flash_attn
    assert registry.load("swa", opts(swa, swa_full=True)).worker.backend.flash_attn
    assert registry.load("q", opts(swa, type_v="q8_0")).worker.backend.flash_attn
    assert not registry.load("off", opts(swa, flash_attn=False)).worker.backend.flash_attn


@pytest.mark.parametrize(("option", "value", "changes"), KNOBS)
def test_a_knob_changes_the_key_exactly_when_it_changes_the_state(
    registry: ModelRegistry, tmp_path: Path, option: str, value: object, changes: bool
) -> None:
    path = write_gguf(tmp_path / "a.gguf")
    base = registry.load("base", opts(path)).worker.cache
    other = registry.load("other", opts(path, **{option: value})).worker.cache
    assert (base.key(b"x", DEFAULT) != other.key(b"x", DEFAULT)) is changes


def test_swa_full_is_off_by_default_and_in_the_key_of_a_sliding_window_model(
    registry: ModelRegistry, tmp_path: Path
) -> None:
    path = write_gguf(tmp_path / "swa.gguf", memory=MemoryKind.SWA, window=16)
    default = registry.load("default", opts(path))
    on, off = registry.load("on", opts(path, swa_full=True)), registry.load("off", opts(path, swa_full=False))
    assert on.memory.swa_full and not default.memory.swa_full and default.memory.window == 16
    keys = [m.worker.cache.key(b"x", DEFAULT) for m in (default, on, off)]
    assert keys[0] == keys[2] != keys[1]


def test_close_unloads_every_model_and_counts_its_shutdown_saves(engine: Engine) -> None:
    engine.load("b")
    engine.run(plain(40, 2))
    engine.run(plain(40, 3), name="b")
    engine.rows()
    engine.store.gc()
    assert engine.registry.close() == 2
    assert engine.registry.models() == [] and {r["save_reason"] for r in engine.rows()} == {"shutdown"}


def test_a_load_in_progress_holds_up_only_a_second_load_of_its_name(tmp_path: Path, store) -> None:
    """A first load can take minutes (decode check, reuse probe): status calls, requests to loaded models and
    other loads go on meanwhile (CI: `barrelctl daemon status` timed out while configured models loaded)."""
    opening, release = threading.Event(), threading.Event()

    def slow(path: Path, settings):
        if path.name == "slow.gguf":
            opening.set()
            assert release.wait(EVENT_TIMEOUT)
        return FakeBackend(path, settings)

    registry = ModelRegistry(store, POLICY, backend_factory=slow)
    try:
        fast = registry.load("fast", opts(write_gguf(tmp_path / "fast.gguf", "fast")))
        slow_path = write_gguf(tmp_path / "slow.gguf", "slow")
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(registry.load, "slow", opts(slow_path))
            assert opening.wait(EVENT_TIMEOUT)
            second = pool.submit(registry.load, "slow", opts(slow_path))
            assert registry.models() == [fast] and registry.get("fast") is fast
            other = registry.load("other", opts(write_gguf(tmp_path / "other.gguf", "other")))
            assert registry.unload("other") == 0
            assert not first.done() and not second.done()
            release.set()
            assert second.result(EVENT_TIMEOUT) is first.result(EVENT_TIMEOUT)
        assert {m.name for m in registry.models()} == {"fast", "slow"} and other.name == "other"
    finally:
        release.set()
        registry.close()


def test_while_configured_models_load_a_request_for_one_waits_for_it(tmp_path: Path, store) -> None:
    """The daemon serves while it loads its configured models: a request naming one (or none, for the
    default) gets it once loaded, not an unknown-model error or the bundled file under its name."""
    registry = ModelRegistry(store, POLICY, backend_factory=FakeBackend, configuring=True)
    try:
        with ThreadPoolExecutor(2) as pool:
            named, default = pool.submit(registry.get, "smollm2"), pool.submit(registry.get, "")
            time.sleep(0.2)  # time enough to fail at once, as they did before they waited
            assert not named.done() and not default.done()
            model = registry.load("smollm2", opts(write_gguf(tmp_path / "a.gguf")))
            assert not named.done() and not default.done()
            registry.configured()
            assert named.result(EVENT_TIMEOUT) is model and default.result(EVENT_TIMEOUT) is model
        with pytest.raises(NotFound, match="unknown model 'b'"):
            registry.get("b")
    finally:
        registry.close()
