"""Tenants with the real model through a real barreld: two keys of one HTTP listener are two tenants, and
nothing of one's prompts reaches the other's replies (the OpenAI, Anthropic and gRPC routes, streamed and
not, every byte of status line, headers and body), nor can the other read it back through the cache. Each
tenant's own resend is as warm as before: from RAM, after a restart from disk, and on a second host from a
real Redis. Salts part requests within a tenant; tenants an operator names as shared share.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest

from tests.support.redis_sandbox import RedisServer
from tests.support.sandbox import Sandbox
from tests.test_cache_paths import CHUNK, POLICY, doc

pytestmark = pytest.mark.model

KEYS = "alice: sk-alice-1\nbob: sk-bob-1\ncarol: sk-carol-1\ndave: sk-dave-1\nerin: sk-erin-1\n"
MODEL = '\n[[models]]\nname = "smollm2"\n'
PUBLIC = "You are the front desk assistant of a small office. Answer in one short sentence."
SECRET = " Confidential: the door code is 4711-Zephyr and our client is Quokkabrook Holdings. "
ALICE_SYSTEM = PUBLIC + SECRET + doc(3, 180)
MARKERS = (b"4711", b"Zephyr", b"Quokkabrook", doc(3, 180)[20:60].encode())


@dataclass
class Host:
    box: Sandbox
    port: int

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def raw(self, key: str, path: str, body: dict) -> tuple[bytes, dict]:
        """The whole answer as bytes (status line, headers, body), and the body's JSON when it is one."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                     "Authorization": f"Bearer {key}", "x-api-key": key})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        head = f"{resp.status} {resp.reason}\n".encode() + str(resp.headers).encode()
        is_json = resp.getheader("content-type") == "application/json"
        return head + data, json.loads(data) if is_json else {}

    def chat(self, key: str, system: str, user: str, **extra: object) -> dict:
        body = {"model": "smollm2", "max_tokens": 8, "temperature": 0, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": user}], **extra}
        return self.raw(key, "/v1/chat/completions", body)[1]


def cached(doc_: dict) -> int:
    """What the cache restored, as OpenAI's usage says it, or Anthropic's."""
    usage = doc_["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"] if "prompt_tokens_details" in usage else \
        usage["cache_read_input_tokens"]


def start(box: Sandbox) -> Host:
    box.start_daemon("--http", "127.0.0.1:0")
    return Host(box, box.http_port())


def sandbox(redis: RedisServer, label: str) -> Sandbox:
    box = Sandbox.new(POLICY + MODEL + f'\n[tiers.redis]\nurl = "{redis.url()}"\ntimeout_ms = 500\n', label=label)
    keys = box.base / "keys"
    keys.write_text(KEYS)
    keys.chmod(0o600)
    box.write_config(box.extra_config + f'\n[http]\napi_keys_file = "{keys}"\nshared = ["carol", "dave"]\n')
    return box


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with RedisServer.start() as server:
        yield server


@pytest.fixture(scope="module")
def host(redis: RedisServer) -> Iterator[Host]:
    with sandbox(redis, "tenants-a") as box:
        yield start(box)


def test_bobs_replies_hold_no_byte_of_alices_prompts_on_any_route(host: Host) -> None:
    question = "Who are you?"
    assert cached(host.chat("sk-alice-1", ALICE_SYSTEM, question)) == 0
    host.raw("sk-alice-1", "/v1/messages", {"model": "smollm2", "max_tokens": 8, "system": ALICE_SYSTEM,
                                            "messages": [{"role": "user", "content": question}]})
    assert cached(host.chat("sk-alice-1", ALICE_SYSTEM, question)) > 0  # Alice's own resend is warm
    bob_system = PUBLIC + " Be polite. " + doc(4, 180)
    answers = []
    for stream in (False, True):
        chat = {"model": "smollm2", "max_tokens": 8, "temperature": 0, "stream": stream, "messages": [
            {"role": "system", "content": bob_system}, {"role": "user", "content": question}]}
        if stream:
            chat["stream_options"] = {"include_usage": True}
        answers.append(host.raw("sk-bob-1", "/v1/chat/completions", chat))
        answers.append(host.raw("sk-bob-1", "/v1/completions", {"model": "smollm2", "max_tokens": 8,
                                                                "stream": stream, "prompt": bob_system}))
        answers.append(host.raw("sk-bob-1", "/v1/messages", {"model": "smollm2", "max_tokens": 8, "stream": stream,
                                                             "system": bob_system,
                                                             "messages": [{"role": "user", "content": question}]}))
    for raw, _ in answers:
        assert not [m for m in MARKERS if m in raw], raw[:2000]
    assert cached(answers[0][1]) == 0  # Bob's first request; his later ones may restore what he sent himself
    # gRPC, as the operator acting as Bob (a socket's own tenants are its Unix users: tests/faults)
    with host.box.client() as c:
        r = c.complete(PUBLIC.encode() + b" Bob here.", max_tokens=8, tenant="bob").result()
    seen = r.text + (r.divergence.cached if r.divergence else b"")
    assert r.restored == 0 and not [m for m in MARKERS if m in seen]


def test_the_operator_explains_as_a_tenant_and_sees_every_tenants_rows(host: Host) -> None:
    host.chat("sk-alice-1", ALICE_SYSTEM, "Who are you?")
    prompt = host.box.base / "prompt.json"
    prompt.write_text(json.dumps([{"role": "system", "content": ALICE_SYSTEM}, {"role": "user", "content": "Hi"}]))
    as_alice = host.box.ctl("--json", "cache", "explain", "--messages", str(prompt), "--tenant", "alice").json()
    assert as_alice["cache"]["restored_tokens"] > 0
    as_bob = host.box.ctl("--json", "cache", "explain", "--messages", str(prompt), "--tenant", "bob").json()
    held = (as_bob["cache"].get("divergence") or {}).get("cached", "")  # what Bob's own texts hold there
    assert as_bob["cache"]["restored_tokens"] == 0 and "4711" not in held
    unknown = host.box.ctl("cache", "explain", "--messages", str(prompt), "--tenant", "mallory")
    assert unknown.rc == 2 and "no tenant 'mallory'" in unknown.err and "sk-" not in unknown.err
    rows = host.box.ctl("--json", "cache", "dump", "--tenant", "alice").json()["rows"]
    assert rows and {r["tenant"] for r in rows} == {"alice"}


def test_guessing_the_next_token_of_alices_prompt_recovers_nothing(host: Host) -> None:
    host.chat("sk-alice-1", ALICE_SYSTEM, "Who are you?")
    words = (PUBLIC + SECRET).split(" ")
    seen = []
    for n in range(len(PUBLIC.split(" ")), len(words) + 1, 2):
        guess = " ".join(words[:n])  # the true continuation: the best guess there is
        seen.append(cached(host.chat("sk-bob-1", guess, "Who are you?", cache_salt=f"guess-{n}")))
    assert seen and set(seen) == {0}, seen
    assert cached(host.chat("sk-alice-1", ALICE_SYSTEM, "Who are you?")) > 0


def test_two_salts_share_nothing_and_one_salt_shares(host: Host) -> None:
    system = PUBLIC + " " + doc(5, 200)
    assert cached(host.chat("sk-erin-1", system, "Hello?", cache_salt="end-user-1")) == 0
    assert cached(host.chat("sk-erin-1", system, "Hello?", cache_salt="end-user-2")) == 0
    assert cached(host.chat("sk-erin-1", system, "Hello?")) == 0
    assert cached(host.chat("sk-erin-1", system, "Hello?", cache_salt="end-user-1")) > 0


def test_tenants_named_shared_share_and_no_other_does(host: Host) -> None:
    system = PUBLIC + " Company-wide handbook: " + doc(6, 220)
    assert cached(host.chat("sk-carol-1", system, "Hi")) == 0
    assert cached(host.chat("sk-dave-1", system, "Hi")) > 0
    assert cached(host.chat("sk-erin-1", system, "Hi")) == 0
    rows = host.box.ctl("--json", "cache", "dump").json()["rows"]
    group = {r["namespace"] for r in rows if r["tenant"] in ("carol", "dave")}
    erin = {r["namespace"] for r in rows if r["tenant"] == "erin"}
    assert len(group) == 1 and erin and not group & erin  # one namespace for the group (a row may supersede)


def test_alice_stays_warm_after_a_restart_from_disk_and_on_another_host_from_redis(redis: RedisServer) -> None:
    system = PUBLIC + SECRET + doc(7, 200)
    with sandbox(redis, "tenants-b") as box:
        first = start(box)
        assert cached(first.chat("sk-alice-1", system, "Who are you?")) == 0
        box.ctl("daemon", "stop")
        box.stop_all()
        again = start(box)
        warm = again.chat("sk-alice-1", system, "Who are you?")
        assert cached(warm) > 0 and warm["barrel"]["cache"]["tier"] in ("disk", "ram_file", "ram")
        assert cached(again.chat("sk-bob-1", system, "Who are you?", cache_salt="host b")) == 0
        with sandbox(redis, "tenants-c") as other_box:
            other = start(other_box)
            remote = other.chat("sk-alice-1", system, "Who are you?")
            assert cached(remote) > 0 and remote["barrel"]["cache"]["tier"] == "redis"
            assert cached(other.chat("sk-bob-1", system, "Who are you?", cache_salt="host c")) == 0


def test_the_sdks_see_the_same_isolation(host: Host) -> None:
    system = PUBLIC + " Secret project Quokkabrook. " + doc(8, 200)
    alice = host.openai("sk-alice-1")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    alice.chat.completions.create(model="smollm2", messages=messages, max_tokens=4, temperature=0)
    bob = host.openai("sk-bob-1").chat.completions.create(model="smollm2", messages=messages, max_tokens=4,
                                                           temperature=0)
    assert bob.usage.prompt_tokens_details.cached_tokens == 0
    def claude(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=f"http://127.0.0.1:{host.port}", api_key=key, max_retries=0)

    other = PUBLIC + " Another secret project, Wombatfield. " + doc(9, 200)
    claude("sk-alice-1").messages.create(model="smollm2", max_tokens=4, system=other,
                                         messages=[{"role": "user", "content": "Hi"}])
    reply = claude("sk-bob-1").messages.create(model="smollm2", max_tokens=4, system=other,
                                               messages=[{"role": "user", "content": "Hi"}])
    assert reply.usage.cache_read_input_tokens == 0


def test_stored_responses_belong_to_their_tenant(host: Host) -> None:
    """Responses API through the real SDK: Bob can neither read, continue nor delete Alice's stored response, and
    the same request restores nothing of hers; Alice's continuation is warm."""
    alice, bob = host.openai("sk-alice-1"), host.openai("sk-bob-1")
    ask = {"model": "smollm2", "instructions": ALICE_SYSTEM, "input": "Who are you?", "max_output_tokens": 8,
           "temperature": 0}
    first = alice.responses.create(**ask)
    for steal in (lambda: bob.responses.retrieve(first.id), lambda: bob.responses.delete(first.id),
                  lambda: bob.responses.create(**{**ask, "input": "And?", "previous_response_id": first.id})):
        with pytest.raises(openai.NotFoundError):
            steal()
    theirs = bob.responses.create(**ask)  # the very same request: none of Alice's state reaches it
    assert theirs.usage.input_tokens_details.cached_tokens == 0 and theirs.id != first.id
    more = alice.responses.create(**{**ask, "input": "And?", "previous_response_id": first.id})
    assert more.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - CHUNK, more.usage


def test_metrics_count_per_tenant_need_a_key_and_hold_no_prompt_bytes(host: Host) -> None:
    host.chat("sk-alice-1", ALICE_SYSTEM, "Who are you?")
    conn = http.client.HTTPConnection("127.0.0.1", host.port, timeout=60)
    conn.request("GET", "/metrics")
    assert conn.getresponse().status == 401
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", host.port, timeout=60)
    conn.request("GET", "/metrics", headers={"Authorization": "Bearer sk-bob-1"})
    text = conn.getresponse().read()
    conn.close()
    assert b'barrel_tenant_requests_total{tenant="alice"}' in text and b'tenant="bob"' in text
    assert not [m for m in MARKERS if m in text]
    log = host.box.log_text()
    assert not [k for k in ("sk-alice-1", "sk-bob-1", "sk-carol-1") if k in log]  # keys are never logged


def test_a_bad_keys_file_stops_barreld_with_one_line(tmp_path: Path) -> None:
    with Sandbox.new(label="tenants-bad") as box:
        keys = box.base / "keys"
        keys.write_text("alice: sk-alice-1\nnot a word: sk-x\n")
        keys.chmod(0o600)
        box.write_config(f'[http]\napi_keys_file = "{keys}"\n')
        proc = box.start_daemon("--http", "127.0.0.1:0", wait=False)
        assert proc.wait(60) == 1
        lines = [line for line in box.log_text().splitlines() if line.strip()]
        assert len(lines) == 1 and f"{keys}:2:" in lines[0] and "not a plain word" in lines[0], lines
        assert "sk-x" not in lines[0]
