"""[tiers.redis] and $BARREL_REDIS_URL: read, validated with one line naming the key, and never a password
in an error, a repr or a log line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from barreld.cache.remote.settings import RedisSettings, redact_url, url_problem
from barreld.config import Config, ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-Secret"


@pytest.fixture(autouse=True)
def no_env_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BARREL_REDIS_URL", raising=False)


def load(tmp_path: Path, text: str) -> Config:
    path = tmp_path / "barreld.toml"
    path.write_text(f"[tiers.ram_file]\nroot = '{tmp_path / 'shm'}'\n{text}")
    return load_config(path, tmp_path / "data")


def test_no_table_and_no_variable_is_no_redis_tier(tmp_path: Path) -> None:
    assert load(tmp_path, "").redis is None
    assert load_config(None, tmp_path / "data").redis is None


def test_defaults(tmp_path: Path) -> None:
    redis = load(tmp_path, "[tiers.redis]\nurl = 'redis://cache.example:6379/2'\n").redis
    assert redis == RedisSettings("redis://cache.example:6379/2", None, "barrel:", 1000, True)


def test_every_key(tmp_path: Path) -> None:
    redis = load(tmp_path, "[tiers.redis]\nurl = 'unix:///run/redis/redis.sock?db=3'\nquota = '1G'\n"
                           "prefix = 'team-a:barrel:'\ntimeout_ms = 250\nwrite = false\n").redis
    assert redis == RedisSettings("unix:///run/redis/redis.sock?db=3", 1 << 30, "team-a:barrel:", 250, False)


def test_the_variable_wins_over_the_file_and_configures_the_tier_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BARREL_REDIS_URL", f"rediss://barrel:{SECRET}@cache.example:6380/0")
    redis = load(tmp_path, "[tiers.redis]\nurl = 'redis://other:6379/0'\ntimeout_ms = 50\n").redis
    assert redis is not None and redis.url.endswith("@cache.example:6380/0") and redis.timeout_ms == 50
    alone = load(tmp_path, "").redis
    assert alone is not None and alone.redacted_url == "rediss://***@cache.example:6380/0"
    monkeypatch.setenv("BARREL_REDIS_URL", "")  # empty: unset
    assert load(tmp_path, "").redis is None


BAD = [
    ("url = 'http://cache:6379/0'", "tiers.redis.url", "unsupported scheme"),
    ("url = 'cache:6379'", "tiers.redis.url", "unsupported scheme"),
    ("url = 5", "tiers.redis.url", "expected a string"),
    ("quota = '1G'", "tiers.redis.url", "missing"),
    ("url = 'redis:///0'", "tiers.redis.url", "names no host"),
    ("url = 'redis://cache:99999/0'", "tiers.redis.url", "port must be a number"),
    ("url = 'redis://cache:0/0'", "tiers.redis.url", "port 0"),
    ("url = 'redis://cache:6379/zero'", "tiers.redis.url", "whole number"),
    ("url = 'unix://relative.sock'", "tiers.redis.url", "names no socket"),
    ("url = 'unix:///r.sock?db=x'", "tiers.redis.url", "whole number"),
    ("url = 'redis://cache/0?socket_timeout=60'", "tiers.redis.url", "unsupported URL option"),
    ("url = 'redis://cache/0?password=x'", "tiers.redis.url", "unsupported URL option"),
    ("url = 'redis://c/0'\nquota = '12Q'", "tiers.redis.quota", "bad size"),
    ("url = 'redis://c/0'\nprefix = 'a{b}:'", "tiers.redis.prefix", "no braces"),
    ("url = 'redis://c/0'\nprefix = 'barrel*'", "tiers.redis.prefix", "no glob"),
    ("url = 'redis://c/0'\nprefix = ''", "tiers.redis.prefix", "1 to 64"),
    ("url = 'redis://c/0'\ntimeout_ms = 0", "tiers.redis.timeout_ms", "whole number >= 1"),
    ("url = 'redis://c/0'\nwrite = 'yes'", "tiers.redis.write", "true or false"),
    ("url = 'redis://c/0'\nroot = '/tmp'", "tiers.redis.root", "unknown key"),
    ("url = 'redis+cluster://c:7000/1'", "tiers.redis.url", "only database 0"),
]


@pytest.mark.parametrize(("text", "key", "fragment"), BAD, ids=[f"{c[1]}:{c[2]}" for c in BAD])
def test_bad_table_is_one_line_naming_the_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, f"[tiers.redis]\n{text}\n")
    assert info.value.key == key and fragment in info.value.reason and "\n" not in str(info.value)


@pytest.mark.parametrize("url", [
    f"http://user:{SECRET}@cache:6379/0",
    f"redis://:{SECRET}@cache:6379/nope",
    f"redis://:{SECRET}@cache:70000/0",
    f"redis://:{SECRET}@[::1/0",
    f"redis://:{SECRET}@cache/0?ssl_keyfile=/k&{SECRET}",
])
def test_errors_never_repeat_the_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    with pytest.raises(ConfigError) as in_file:
        load(tmp_path, f"[tiers.redis]\nurl = '{url}'\n")
    monkeypatch.setenv("BARREL_REDIS_URL", url)
    with pytest.raises(ConfigError) as in_env:
        load(tmp_path, "")
    assert "$BARREL_REDIS_URL" in str(in_env.value)
    for message in (str(in_file.value), str(in_env.value)):
        assert SECRET not in message and message.startswith(f"{tmp_path / 'barreld.toml'}: tiers.redis.url: ")


def test_barreld_exits_1_on_a_bad_url_before_listening(tmp_path: Path) -> None:
    config = tmp_path / "barreld.toml"
    config.write_text(f"[tiers.ram_file]\nroot = '{tmp_path / 'shm'}'\n"
                      f"[tiers.redis]\nurl = 'memcached://admin:{SECRET}@cache:11211'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BARREL_")} | {"PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "barreld", "--config", str(config), "--socket",
                        str(tmp_path / "s.sock"), "--data-dir", str(tmp_path / "data")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        f"barreld: {config}: tiers.redis.url: unsupported scheme in memcached://***@cache:11211: "
        "expected redis://, rediss://, unix://, redis+cluster:// or rediss+cluster://"]
    assert not (tmp_path / "s.sock").exists()


def test_redaction() -> None:
    assert redact_url(f"redis://user:{SECRET}@h:1/0") == "redis://***@h:1/0"
    assert redact_url(f"unix://:{SECRET}@/run/r.sock?db=1") == "unix://***@/run/r.sock?…"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
    assert SECRET not in repr(RedisSettings(f"redis://:{SECRET}@h:1/0"))
    assert url_problem("rediss://h:6380/0?ssl_ca_certs=/etc/ca.pem&ssl_cert_reqs=required") is None
    with pytest.raises(ValueError, match="unsupported scheme"):
        RedisSettings("tcp://h:1")


def test_a_cluster_is_named_by_its_scheme() -> None:
    single, cluster = RedisSettings("redis://c:7000/0"), RedisSettings("rediss+cluster://:pw@c:7000")
    assert not single.cluster and cluster.cluster
    assert cluster.client_url == "rediss://:pw@c:7000" and cluster.address == "c:7000"
