"""A private, real redis-server for tests and benchmarks: a free loopback port and a Unix socket in its own
temp dir, no persistence, stopped at the end. A missing redis-server raises RedisMissing, which the tests
turn into a failure (never a skip): the README's test set-up and .ci/run install it.

    with RedisServer.start() as server:
        store = RedisStore(RedisSettings(server.url()))
        server.admin().flushall()
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

INSTALL_HINT = "install it as root with `apt-get install -y redis-server`"


class RedisMissing(RuntimeError):
    """redis-server is not on PATH."""


def free_port() -> int:
    """A loopback port nobody listens on right now (the server retries if another process takes it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; `restart` brings a fresh, empty one back on the same port and socket."""

    def __init__(self, workdir: Path, password: str | None = None, tls: bool = False) -> None:
        self.workdir = workdir
        self.password = password
        self.tls = tls
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, password: str | None = None, tls: bool = False) -> RedisServer:
        """A running server; with `tls`, its TCP port speaks only TLS, with a self-signed certificate for
        127.0.0.1 (`cert`), made here by openssl."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisMissing(f"redis-server is not installed: {INSTALL_HINT}")
        # A short path of its own: a Unix socket path holds about 107 bytes.
        server = cls(Path(tempfile.mkdtemp(prefix="barrel-redis-", dir="/tmp")), password, tls)
        if tls:
            server._make_certificate()
        for _ in range(5):
            server.port = free_port()
            if server._spawn(binary):
                return server
        server.close()
        raise RuntimeError(f"redis-server would not start:\n{server.log_text()}")

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def socket_path(self) -> Path:
        return self.workdir / "redis.sock"

    @property
    def cert(self) -> Path:
        return self.workdir / "cert.pem"

    def url(self, password: str | None = None, db: int = 0) -> str:
        """A URL of this server's port, with `password` (default: the server's own) in its user-info."""
        password = self.password if password is None else password
        auth = f":{password}@" if password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/{db}?ssl_ca_certs={self.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def unix_url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"unix://{auth}{self.socket_path}"

    def admin(self) -> redis.Redis:
        """A plain client for the test's own commands (FLUSHALL, CONFIG SET, overwriting values)."""
        tls = {"ssl": True, "ssl_ca_certs": str(self.cert)} if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=10,
                           retry=Retry(NoBackoff(), 0), **tls)

    def _make_certificate(self) -> None:
        key = self.workdir / "key.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                        "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(self.cert)], check=True, capture_output=True)

    def _spawn(self, binary: str) -> bool:
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                "--daemonize", "no", "--loglevel", "warning", "--logfile", str(self.workdir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", str(self.cert), "--tls-key-file", str(self.workdir / "key.pem"),
                     "--tls-ca-cert-file", str(self.cert), "--tls-auth-clients", "no"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            with contextlib.suppress(redis.ConnectionError), self.admin() as client:
                if client.ping():
                    return True
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        """SIGKILL, as a crash or an OOM kill would: no goodbye to the clients, nothing kept."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> None:
        """Kill this server if it runs, and start an empty one on the same port and socket."""
        self.kill()
        if not self._spawn(shutil.which("redis-server") or "redis-server"):
            raise RuntimeError(f"redis-server would not restart:\n{self.log_text()}")

    def pause(self) -> None:
        """SIGSTOP: the kernel still accepts connections, but nothing answers them."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def log_text(self) -> str:
        log = self.workdir / "redis.log"
        return log.read_text(errors="replace") if log.exists() else "(no log)"

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
