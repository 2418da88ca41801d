"""Where the HTTP API listens and who may use it: ADDR parsing, the keys file, the [http] table, and barreld
itself refusing an exposed address without keys (one line, exit 1) and enforcing keys it was given."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from barreld.address import ListenAddress, parse_listen
from barreld.config import ConfigError, load_config
from barreld.tenants import load_keys
from tests.support.sandbox import Sandbox

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("text", "host", "port", "loopback"),
    [
        ("127.0.0.1:8080", "127.0.0.1", 8080, True),
        ("localhost:0", "127.0.0.1", 0, True),
        ("[::1]:8080", "::1", 8080, True),
        ("0.0.0.0:80", "0.0.0.0", 80, False),
        ("[::]:8080", "::", 8080, False),
        ("192.168.1.5:8080", "192.168.1.5", 8080, False),
    ],
)
def test_tcp_addresses(text: str, host: str, port: int, loopback: bool) -> None:
    addr = parse_listen(text)
    assert (addr.host, addr.port, addr.path, addr.loopback) == (host, port, None, loopback)
    assert str(addr) == text.replace("localhost", "127.0.0.1")


def test_unix_addresses_are_absolute_and_loopback(tmp_path: Path) -> None:
    assert parse_listen("unix:/run/barrel/http.sock") == ListenAddress(path=Path("/run/barrel/http.sock"))
    relative = parse_listen("unix:api.sock", tmp_path)
    assert relative.path == tmp_path / "api.sock" and relative.loopback
    assert str(relative) == f"unix:{tmp_path / 'api.sock'}"


@pytest.mark.parametrize(
    "text",
    ["", "8080", "127.0.0.1", "127.0.0.1:", "127.0.0.1:65536", "127.0.0.1:-1", "127.0.0.1:８０", "::1:8080",
     "example.com:80", "[::1]", "unix:", "unix:/" + "x" * 200],
)
def test_bad_addresses_say_what_is_expected(text: str) -> None:
    with pytest.raises(ValueError, match="bad address"):
        parse_listen(text)


def keys_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "keys"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_keys_file_one_key_a_line(tmp_path: Path) -> None:
    path = keys_file(tmp_path, "# team keys\nsk-one\n\n  sk-two  \n")
    assert [k.key for k in load_keys(path)] == [b"sk-one", b"sk-two"]


@pytest.mark.parametrize(
    ("text", "mode", "words"),
    [
        ("sk-one\n", 0o644, "mode 0644"),
        ("sk-one\n", 0o640, "chmod 600"),
        ("# nothing\n\n", 0o600, "holds no keys"),
        ("sk one\n", 0o600, "keys:1: a key must not contain spaces"),
    ],
)
def test_bad_keys_files_are_refused(tmp_path: Path, text: str, mode: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        load_keys(keys_file(tmp_path, text, mode))


def test_a_missing_keys_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_keys(tmp_path / "nope")


def load(tmp_path: Path, text: str):
    cfg = tmp_path / "barreld.toml"
    cfg.write_text(f"[tiers.ram_file]\nroot = '{tmp_path / 'shm'}'\n{text}")
    return load_config(cfg, tmp_path / "data")


def test_http_table(tmp_path: Path) -> None:
    assert load(tmp_path, "").http.listen is None
    keys_file(tmp_path, "sk-one\n")
    http = load(tmp_path, "[http]\nlisten = '0.0.0.0:8080'\napi_keys_file = 'keys'\n").http
    assert http.listen == parse_listen("0.0.0.0:8080")
    assert http.api_keys_file == tmp_path / "keys" and [k.key for k in http.tenants.keys] == [b"sk-one"]
    assert "sk-one" not in repr(http)


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        ("[http]\nlisten = 8080\n", "http.listen", "expected a string"),
        ("[http]\nlisten = 'anywhere'\n", "http.listen", "bad address"),
        ("[http]\napi_keys_file = 'nope'\n", "http.api_keys_file", "cannot read"),
        ("[http]\nport = 1\n", "http.port", "unknown key"),
    ],
)
def test_bad_http_table_is_one_line(tmp_path: Path, text: str, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert info.value.key == key and words in info.value.reason and "\n" not in str(info.value)


@pytest.mark.slow
def test_a_world_readable_keys_file_stops_barreld(tmp_path: Path) -> None:
    with Sandbox.new() as w:
        keys_file(w.base, "sk-one\n", 0o644)
        w.write_config(f"[http]\nlisten = '127.0.0.1:0'\napi_keys_file = '{w.base / 'keys'}'\n")
        proc = w.start_daemon(wait=False)
        assert proc.wait(60) == 1
        lines = w.log_text().strip().splitlines()
        assert len(lines) == 1 and "http.api_keys_file" in lines[0] and "chmod 600" in lines[0], lines


@pytest.mark.slow
def test_an_exposed_address_without_keys_exits_1_with_one_line() -> None:
    with Sandbox.new() as w:
        proc = w.start_daemon("--http", "0.0.0.0:0", wait=False)
        assert proc.wait(60) == 1
        lines = w.log_text().strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("barreld: refusing to serve HTTP on 0.0.0.0:0") and "api_keys_file" in lines[0]
        assert not w.socket.exists()


def test_a_bad_http_option_is_a_usage_error() -> None:
    p = subprocess.run([sys.executable, "-m", "barreld", "--http", "somewhere"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert p.returncode == 2 and "argument --http: bad address 'somewhere'" in p.stderr


def get(url: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.slow
def test_an_exposed_address_with_keys_serves_only_bearers_of_a_key() -> None:
    """Bound to every interface (reached here through loopback); daemon status names the bound port."""
    with Sandbox.new() as w:
        keys_file(w.base, "sk-first\nsk-second\n")
        w.write_config(f"[http]\napi_keys_file = '{w.base / 'keys'}'\n")
        w.start_daemon("--http", "0.0.0.0:0")
        status = w.ctl("--json", "daemon", "status").json()
        host, _, port = status["http"].rpartition(":")
        assert host == "0.0.0.0" and int(port) > 0
        assert status["http"] in w.ctl("daemon", "status").out   # the human table too
        base = f"http://127.0.0.1:{port}"
        assert get(f"{base}/health") == (200, {"status": "ok"})
        code, doc = get(f"{base}/v1/models")
        assert code == 401 and doc["error"]["code"] == "invalid_api_key"
        assert get(f"{base}/v1/models", "sk-wrong")[0] == 401
        assert get(f"{base}/v1/models", "sk-second") == (200, {"object": "list", "data": []})


@pytest.mark.slow
def test_http_over_a_unix_socket_is_owner_only() -> None:
    with Sandbox.new() as w:
        path = w.base / "run" / "barrel" / "http.sock"
        w.start_daemon("--http", f"unix:{path}")
        assert w.ctl("--json", "daemon", "status").json()["http"] == f"unix:{path}"
        assert path.is_socket() and path.stat().st_mode & 0o777 == 0o600
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(30)
            s.connect(str(path))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: barrel\r\nConnection: close\r\n\r\n")
            answer = b"".join(iter(lambda: s.recv(65536), b""))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body) == {"status": "ok"}
        proc = w.procs[-1]
        assert w.stop(proc) == 0 and not path.exists()


def test_streamed_chunks_are_not_held_for_an_ack() -> None:
    """The server's connections run with TCP_NODELAY, as asyncio sets it on what a listening socket of the TCP
    protocol accepts: else a token's chunk waits up to 40 ms for the client's delayed ACK of the last one."""
    import asyncio

    from barreld.http.server import HttpServer

    server = HttpServer(parse_listen("127.0.0.1:0"))
    server.bind()
    sock = server._sock
    assert sock is not None

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listener = await asyncio.start_server(handle, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", server.address.port)
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            listener.close()

    assert asyncio.run(nodelay_of_an_accepted_connection()) == 1
