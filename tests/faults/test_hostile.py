"""Part 5: hostile input. A hypothesis fuzz of every RPC with malformed fields, sent through the client's
typed methods (the raw bytes no client can build go over its channel): each call is answered OK
(when the request happens to be valid), INVALID_ARGUMENT or NOT_FOUND (FAILED_PRECONDITION for a load of
a bad file), always with a message, never INTERNAL or UNKNOWN; and the daemon keeps serving after each.
Prompt bytes that are not UTF-8 cache like any others: keys are over bytes."""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from barrelctl.client import Client
from barrelctl.errors import ClientError
from barreld.rpc import barrel_pb2 as pb
from tests.support.sandbox import Sandbox

from . import util
from .util import complete, doc

EXAMPLES = int(os.environ.get("FAULTS_FUZZ_EXAMPLES", "150"))
RANDOM = os.environ.get("FAULTS_FUZZ_RANDOM") == "1"  # explore new examples instead of the fixed set
ANSWERS = {"INVALID_ARGUMENT", "NOT_FOUND"}
PROTECTED = "smollm2"  # the loaded model: unloading it would let a fuzzed load allocate a huge context


@pytest.fixture(scope="module")
def hostile() -> Iterator[tuple[Sandbox, dict[str, str]]]:
    with Sandbox.new(util.model_config()) as w:
        junk = w.base / "junk.gguf"
        junk.write_bytes(random.Random(1).randbytes(4096))
        fake = w.base / "fake.gguf"
        fake.write_bytes(b"GGUF" + b"\xff" * 4096)
        empty = w.base / "empty.gguf"
        empty.write_bytes(b"")
        (w.base / "adir").mkdir()
        paths = {"junk": str(junk), "fake": str(fake), "empty": str(empty), "dir": str(w.base / "adir")}
        proc = util.start(w)
        yield w, paths
        util.stop(w, proc)


# ---- strategies ------------------------------------------------------------------------------------


def huge_text(min_size: int = 10_000) -> st.SearchStrategy[str]:
    return st.integers(min_size, 200_000).map(lambda n: ("é\U0001f600x" * n)[:n])


strings = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.sampled_from(["smollm2", "nosuch", "../etc/passwd", "a b", "-", ".", "\x00", "ram", "RAM", "x" * 129]),
    huge_text(),
)
int32 = st.one_of(st.sampled_from([0, -1, 1, 2, 2**31 - 1, -(2**31), 4097, 1 << 20]), st.integers(-(2**31), 2**31 - 1))
int64 = st.one_of(st.sampled_from([0, -1, 1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
float32 = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 0.7, 100.0, 100.5, 3.4e38]),
    st.floats(width=32),
)
tier_names = st.one_of(
    st.sampled_from(["", "ram", "ram_file", "disk", "floppy", "Disk", "ram,disk", " ram"]), st.text(max_size=12)
)
hex_keys = st.one_of(
    st.just(""),
    st.text(max_size=70),
    st.binary(min_size=32, max_size=32).map(bytes.hex),  # well formed, unknown
    st.binary(min_size=32, max_size=32).map(lambda b: b.hex().upper()),
    st.sampled_from(["g" * 64, "0" * 63, "0" * 65, " " + "0" * 63, "0x" + "0" * 62]),
)
prompts = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"\xff\xfe\xfd",
            b"\xc3\x28",
            b"\xe2\x82",
            b"\xed\xa0\x80",
            b"\x00\x00",
            b"\x80" * 40,
            b"\xf4\x90\x80\x80",  # above U+10FFFF: these two once aborted barreld inside llama_tokenize
            b"a\xf7\xbf\xbf\xbfb",
        ]
    ),
    # tens of kilobytes of random bytes: many more tokens than the context holds
    st.integers(0, 2**32).map(lambda seed: random.Random(seed).randbytes(random.Random(seed).randint(20_000, 60_000))),
)
stops = st.one_of(
    st.lists(st.text(min_size=1, max_size=8), max_size=4),
    st.lists(st.text(max_size=8), min_size=1, max_size=4),  # may hold an empty stop string
    st.lists(st.text(max_size=4), min_size=17, max_size=64),  # too many
    st.lists(huge_text(300), min_size=1, max_size=2),  # too long
)


texts = st.text(max_size=40).map(str.encode)


@st.composite
def complete_requests(draw) -> dict:
    """Mostly-valid fields with a few bad ones, so each check is reached past the ones before it."""
    return dict(
        model=draw(st.one_of(st.just(""), st.just(PROTECTED), strings)),
        prompt=draw(st.one_of(texts.filter(bool), prompts)),
        temperature=draw(st.one_of(st.just(0.0), st.floats(0, 2, width=32), float32)),
        stop=draw(st.one_of(st.just([]), stops)),
        parent_key=draw(st.one_of(st.just(""), hex_keys)),
        chat=draw(st.booleans()),
        max_tokens=draw(st.one_of(st.integers(1, 3), st.none(), int32)),  # None: unset
        seed=draw(st.one_of(st.none(), st.integers(0, 2**32 - 1))),
        sampling=draw(st.one_of(st.just({}), sampling_fields())),
        logprobs=draw(st.one_of(st.none(), st.integers(-5, 30), int32)),
    )


GRAMMARS = ['root ::= "a"', 'root ::= "b"{3,1}', "root ::= (", 'x ::= "a"', "root ::= root", 'root ::= [a-z]{1,9}']
SCHEMAS = ['{"type": "object"}', '{"type": "integer", "minimum": 3, "maximum": 1}', '{"not": {}}', "[", "{}",
           '{"type": "string", "pattern": "^a{99999}$"}', '{"$ref": "#/nowhere"}', '{"anyOf": []}']


@st.composite
def sampling_fields(draw) -> dict:
    """The Sampling message: each field absent, sensible, out of range or non-finite; constraints that parse,
    that do not, and one that makes llama.cpp's own parser abort."""
    def maybe(values: st.SearchStrategy) -> object:
        return draw(st.one_of(st.none(), values))

    fields = {
        "top_k": maybe(int32), "top_p": maybe(float32), "min_p": maybe(float32), "typical_p": maybe(float32),
        "repeat_penalty": maybe(float32), "repeat_last_n": maybe(int32), "presence_penalty": maybe(float32),
        "frequency_penalty": maybe(float32),
        "logit_bias": maybe(st.dictionaries(st.one_of(st.integers(-5, 60_000), int64), float32, max_size=3)),
        "grammar": maybe(st.one_of(st.sampled_from(GRAMMARS), st.text(max_size=30))),
        "json_schema": maybe(st.one_of(st.sampled_from(SCHEMAS), st.text(max_size=30))),
        "json_object": maybe(st.booleans()),
    }
    return {k: v for k, v in fields.items() if v is not None}


policy_keys = st.one_of(
    st.sampled_from(
        [
            "min_tokens",
            "cold_min_tokens",
            "continued_interval",
            "prefill_chunk_size",
            "evict_save_timeout_ms",
            "boundary_align_tokens",
        ]
    ),
    st.text(max_size=20),
    huge_text(100),
)
policy_values = st.one_of(
    st.sampled_from(["", "infinity", "auto", "-1", "0", "1", "1e9", "nan", "9" * 40, "0x10"]),
    st.text(max_size=20),
    huge_text(100),
)
sizes = st.one_of(st.just(0), st.integers(16, 8192), int32)


@st.composite
def load_requests(draw, paths: dict[str, str]) -> dict:
    return dict(
        name=draw(st.one_of(st.sampled_from([PROTECTED, "m1", "fuzz-model.v2"]), strings)),
        # never the real model: a fuzzed valid load could ask for a context of 2**20 cells
        path=draw(
            st.one_of(
                st.sampled_from(
                    [
                        "",
                        "/nonexistent/m.gguf",
                        "/dev/null",
                        "/proc/self/status",
                        "relative.gguf",
                        "a\0b",
                        *paths.values(),
                    ]
                ),
                strings,
            )
        ),
        tier=draw(st.one_of(st.just(""), tier_names)),
        n_ctx=draw(sizes),
        n_batch=draw(sizes),
        n_seq_max=draw(st.one_of(st.just(0), st.integers(1, 8), int32)),
        policy=draw(
            st.one_of(
                st.just({}),
                st.dictionaries(policy_keys, policy_values, max_size=3),
                st.dictionaries(st.text(max_size=3), st.just("1"), min_size=33, max_size=40),
            )
        ),
        fingerprint=draw(
            st.one_of(
                st.sampled_from(
                    ["", "safe", "gguf_chunked", "fast_unsafe", "fast_unsafe:", "fast_unsafe:abc", "bogus"]
                ),
                strings,
            )
        ),
    )


def calls(paths: dict[str, str]) -> st.SearchStrategy[tuple[str, dict]]:
    """(a Client method, its keyword arguments)."""
    empty = st.sampled_from(
        ["models", "cache_stats", "cache_gc", "cache_verify", "scheduler_status", "daemon_status"]
    ).map(lambda m: (m, {}))
    return st.one_of(
        complete_requests().map(lambda r: ("complete", r)),
        complete_requests().map(lambda r: ("complete", r)),  # the richest request: drawn twice as often
        load_requests(paths).map(lambda r: ("load", r)),
        strings.filter(lambda n: n != PROTECTED).map(lambda n: ("unload", {"name": n})),
        st.builds(dict, model=strings, tier=tier_names).map(lambda r: ("cache_dump", r)),
        st.builds(lambda b, t: {"n": b, "tiers": t}, int64, st.lists(tier_names, max_size=4)).map(
            lambda r: ("cache_evict_bytes", r)
        ),
        empty,
    )


def invoke(c: Client, method: str, kwargs: dict) -> tuple[str, str]:
    """(status name, the daemon's message) of one call; a valid completion is cut short after a few events."""
    try:
        if method == "complete":
            stream = c.complete(**kwargs, timeout=120)
            for n, _ in enumerate(stream):
                if n >= 3:
                    stream.cancel()  # a valid request: enough is seen, and default max_tokens is long
                    return "OK", ""
            stream.result()
            return "OK", ""
        getattr(c, method)(**kwargs, timeout=120)
        return "OK", ""
    except ClientError as e:
        if e.status == "CANCELLED" and method == "complete":
            return "OK", ""
        return e.status, e.details


def test_every_rpc_with_malformed_fields_gets_a_clear_answer_and_the_daemon_serves_on(hostile) -> None:
    w, paths = hostile
    s = w.client()
    pid = s.daemon_status().pid
    seen: Counter[str] = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(calls(paths))
    def one(call: tuple[str, dict]) -> None:
        method, kwargs = call
        code, details = invoke(s, method, kwargs)
        seen[f"{method}:{code}"] += 1
        allowed = ANSWERS | {"OK"} | ({"FAILED_PRECONDITION"} if method == "load" else set())
        assert code in allowed, (method, code, details, str(kwargs)[:500])
        if code != "OK":
            assert details.strip() and "\n" not in details.strip(), (method, code, details)
        status = s.daemon_status(timeout=30)  # still serving, and the same daemon
        assert status.pid == pid

    one()
    total = sum(seen.values())
    print(f"\nfuzz: {total} examples: {dict(sorted(seen.items()))}")
    assert total >= EXAMPLES
    assert [m.name for m in s.models()] == [PROTECTED]
    assert "Traceback" not in w.log_text(), w.log_text()[-3000:]


def test_every_sampling_field_malformed_gets_a_clear_answer_and_the_daemon_serves_on(hostile) -> None:
    """The sampler's fields alone, on an otherwise valid request, so each reaches the sampler and the grammar
    parser: a bad one is INVALID_ARGUMENT with a message, a good one completes, and the daemon lives on."""
    w, _ = hostile
    s = w.client()
    pid = s.daemon_status().pid
    seen: Counter[str] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              suppress_health_check=list(HealthCheck))
    @given(sampling_fields(), st.one_of(st.just(0.0), float32), st.one_of(st.none(), st.integers(-2, 25)))
    def one(sampling: dict, temperature: float, logprobs: int | None) -> None:
        kwargs = {"prompt": b"Say something.", "max_tokens": 3, "temperature": temperature, "seed": 1,
                  "sampling": sampling, "logprobs": logprobs}
        code, details = invoke(s, "complete", kwargs)
        seen[code] += 1
        assert code in {"OK", "INVALID_ARGUMENT"}, (code, details, kwargs)
        if code != "OK":
            assert details.strip() and "\n" not in details.strip(), (code, details)
        assert s.daemon_status(timeout=30).pid == pid

    one()
    print(f"\nsampling fuzz: {dict(seen)}")
    assert seen["OK"] and seen["INVALID_ARGUMENT"]
    assert "Traceback" not in w.log_text(), w.log_text()[-3000:]


# ---- requests the stub cannot build: bytes that are not a message, strings that are not UTF-8 -------

RPCS = {  # method: (request type, response type, streams)
    "Complete": (pb.CompleteRequest, pb.CompleteEvent, True),
    "LoadModel": (pb.LoadModelRequest, pb.ModelInfo, False),
    "UnloadModel": (pb.UnloadModelRequest, pb.UnloadModelReply, False),
    "ListModels": (pb.ListModelsRequest, pb.ListModelsReply, False),
    "CacheDump": (pb.CacheDumpRequest, pb.CacheDumpReply, False),
    "CacheStats": (pb.CacheStatsRequest, pb.CacheStatsReply, False),
    "CacheGc": (pb.CacheGcRequest, pb.CacheGcReply, False),
    "CacheEvictBytes": (pb.CacheEvictBytesRequest, pb.CacheEvictBytesReply, False),
    "CacheVerify": (pb.CacheVerifyRequest, pb.CacheVerifyEvent, True),
    "SchedulerStatus": (pb.SchedulerStatusRequest, pb.SchedulerStatusReply, False),
    "DaemonStatus": (pb.DaemonStatusRequest, pb.DaemonStatusReply, False),
    "Shutdown": (pb.ShutdownRequest, pb.ShutdownReply, False),
}


def raw_cases() -> list[tuple[str, bytes]]:
    """A truncated varint for every method, and invalid UTF-8 in every string field of every request."""
    cases = [(m, b"\x08\xff\xff") for m in RPCS]
    for method, (req_type, _, _) in RPCS.items():
        for f in req_type.DESCRIPTOR.fields:
            if f.type == f.TYPE_STRING:
                tag = (f.number << 3) | 2
                body = bytes([tag]) + b"\x03\xff\xfe\xc3"
                if method == "Complete":
                    body += b"\x12\x02hi\x18\x02"  # a prompt and max_tokens 2, so only the bad field is bad
                cases.append((method, body))
    return cases


def raw_call(channel: grpc.Channel, method: str, body: bytes) -> tuple[str, str]:
    _, resp, streams = RPCS[method]
    path = f"/barrel.v1.Barrel/{method}"
    try:
        if streams:
            list(
                channel.unary_stream(path, request_serializer=bytes, response_deserializer=resp.FromString)(
                    body, timeout=30
                )
            )
        else:
            channel.unary_unary(path, request_serializer=bytes, response_deserializer=resp.FromString)(body, timeout=30)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


def test_undecodable_requests_leave_the_daemon_serving(hostile) -> None:
    w, _ = hostile
    with w.client() as s:
        pid = s.daemon_status().pid
        for method, body in raw_cases():
            code, _ = raw_call(s.channel, method, body)
            assert code != "OK", (method, body)  # nothing was done with it: Shutdown did not shut down
            assert s.daemon_status(timeout=30).pid == pid


def test_undecodable_requests_are_invalid_argument(hostile) -> None:
    w, _ = hostile
    wrong = []
    with w.client() as s:
        for method, body in raw_cases():
            code, details = raw_call(s.channel, method, body)
            if code != "INVALID_ARGUMENT" or not details:
                wrong.append((method, body.hex(), code, details))
    assert wrong == []


@pytest.mark.parametrize("bad", [b"\xf4\x90\x80\x80", b"\xf7\xbf\xbf\xbf"], ids=["U+110000", "U+1FFFFF"])
def test_a_prompt_llama_cpp_cannot_decode_does_not_kill_the_daemon(bad: bytes) -> None:
    with Sandbox.new(util.model_config()) as w:
        proc = util.start(w)
        s = w.client()
        code, details = invoke(s, "complete", {"prompt": b"hello " + bad + b" there", "max_tokens": 2})
        assert code in ANSWERS | {"OK"}, (code, details)
        assert proc.poll() is None, f"barreld died with {proc.poll()}"
        assert s.daemon_status(timeout=10).pid == proc.pid


# ---- keys are over bytes ---------------------------------------------------------------------------


def not_utf8(i: int, n_words: int) -> bytes:
    """About n_words tokens of text broken up by bytes that no UTF-8 decoder accepts."""
    r = random.Random(i)
    bad = [b"\xff", b"\xfe", b"\xc3", b"\x80\x80", b"\xe2\x82", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]
    words = doc(i, n_words).split(b" ")
    return b" ".join(wd + (r.choice(bad) if r.random() < 0.3 else b"") for wd in words)


def test_prompts_that_are_not_utf8_cache_by_their_bytes() -> None:
    """llama.cpp reads each byte it cannot decode as U+FFFD, so the rendered prompt (what keys are over, as
    the contract says) holds U+FFFD there: prompts that differ only in which undecodable bytes they carry
    are the same tokens, share a key, and a warm start of one is exactly a cold start of the other."""
    prompt = not_utf8(7, 360)
    with pytest.raises(UnicodeDecodeError):
        prompt.decode("utf-8")
    other_bad = prompt.replace(b"\xff", b"\xfe")  # other undecodable bytes in the same places
    other_text = prompt.replace(b"river", b"rivet")  # a decodable byte differs
    assert other_bad != prompt and other_text != prompt
    with Sandbox.new(util.NO_SAVES + util.model_config()) as w:
        util.start(w)
        cold = complete(w.client(), other_bad, 10)
        assert cold.route == "miss"
    with Sandbox.new(util.ONE_SAVE_POLICY + util.model_config()) as w:
        proc = util.start(w)
        s = w.client()
        first = complete(s, prompt, 10)
        assert first.route == "miss" and 550 <= first.prompt_tokens <= 900
        live = complete(s, prompt, 10)
        assert live.route == "live" and live.text == first.text and live.key == first.key
        util.wait_for(
            lambda: first.key in {r.key for r in util.rows(s) if r.status == "available"}, what="the finish save"
        )
        complete(s, b"Zebras flush the live sequence.", 2)
        exact = complete(s, prompt, 10)
        assert exact.route == "exact" and exact.text == first.text and exact.prompt_key == first.prompt_key
        assert exact.restored >= first.prompt_tokens - 2
        complete(s, b"Zebras flush the live sequence.", 2)
        same = complete(s, other_bad, 10)
        assert same.prompt_key == first.prompt_key and same.route == "exact"
        assert same.text == cold.text == first.text
        near = complete(s, other_text, 10)
        assert near.prompt_key != first.prompt_key and near.route != "exact"
        util.stop(w, proc)
        util.start(w)  # and from the disk tier after a restart
        s = w.client()
        again = complete(s, prompt, 10)
        assert again.route == "exact" and again.tier == "disk" and again.text == first.text
