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
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

INSTALL_HINT = "install it as root with `apt-get install -y redis-server`"


class RedisMissing(RuntimeError):
    """redis-server is not on PATH."""


def free_port(bus: bool = False) -> int:
    """A loopback port nobody listens on right now (the server retries if another process takes it first); with
    `bus`, one whose cluster bus port (10,000 above it) is free too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port + 10000))
            return port


class RedisServer:
    """One redis-server process; `restart` brings a fresh, empty one back on the same port and socket."""

    def __init__(self, workdir: Path, password: str | None = None, tls: bool = False, cluster: bool = False) -> None:
        self.workdir = workdir
        self.password = password
        self.tls = tls
        self.cluster = cluster
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, password: str | None = None, tls: bool = False, cluster: bool = False) -> RedisServer:
        """A running server; with `tls`, its TCP port speaks only TLS, with a self-signed certificate for
        127.0.0.1 (`cert`), made here by openssl; with `cluster`, a node that a cluster can take in."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RedisMissing(f"redis-server is not installed: {INSTALL_HINT}")
        # A short path of its own: a Unix socket path holds about 107 bytes.
        server = cls(Path(tempfile.mkdtemp(prefix="barrel-redis-", dir="/tmp")), password, tls, cluster)
        if tls:
            server._make_certificate()
        for _ in range(5):
            server.port = free_port(bus=cluster)
            if server._spawn(binary):
                return server
            server.kill()  # one too slow to answer too: the next try reuses its directory and nodes.conf
            (server.workdir / "nodes.conf").unlink(missing_ok=True)
        log = server.log_text()
        server.close()
        raise RuntimeError(f"redis-server would not start:\n{log}")

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
        if self.cluster:  # a node that fails stops answering pings within a second; its replica takes over
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.workdir / "nodes.conf"),
                     "--cluster-node-timeout", "1000"]
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

    def terminate(self) -> None:
        """SIGTERM, without waiting: a primary then waits for its replicas, so a cluster signals every node first."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)


class ClusterSandbox:
    """A Redis Cluster of cluster-enabled RedisServers joined by `redis-cli --cluster create`: `primaries`
    primaries, each with `replicas` replicas, the slots spread evenly over the primaries."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @classmethod
    def start(cls, primaries: int = 3, replicas: int = 0) -> ClusterSandbox:
        cluster = cls([])
        try:
            for _ in range(primaries * (1 + replicas)):
                cluster.nodes.append(RedisServer.start(cluster=True))
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in cluster.nodes),
                            "--cluster-replicas", str(replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
            cluster.wait_ok()
        except BaseException:
            cluster.close()
            raise
        return cluster

    def __enter__(self) -> ClusterSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(self) -> str:
        """Barrel's URL for it: any one node; the client finds the others."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def admin(self) -> redis.RedisCluster:
        """A cluster client for the test's own commands."""
        node = self.live()[0]
        return redis.RedisCluster(host="127.0.0.1", port=node.port, socket_timeout=10)

    def node_id(self, node: RedisServer) -> str:
        with node.admin() as c:
            return c.execute_command("CLUSTER", "MYID").decode()

    def primary_of(self, key: bytes) -> RedisServer:
        """The node that serves `key`'s slot now."""
        with self.admin() as c:
            port = c.get_node_from_key(key).port
        return next(n for n in self.nodes if n.port == port)

    def replica_of(self, primary: RedisServer, timeout: float = 30) -> RedisServer:
        """`primary`'s replica, once the primary has heard of it: a cluster can say ok while the replicas'
        gossip is still on its way (CLUSTER REPLICAS then lists none)."""
        pid = self.node_id(primary)
        deadline = time.monotonic() + timeout
        while True:
            with primary.admin() as c:
                lines = c.execute_command("CLUSTER", "REPLICAS", pid)
            if lines or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert lines, f"the primary on port {primary.port} lists no replica after {timeout:.0f} s"
        line = lines[0].decode() if isinstance(lines[0], bytes) else lines[0]
        address = line.split()[1]  # id host:port@bus flags ...
        port = int(address.split("@")[0].rpartition(":")[2])
        return next(n for n in self.nodes if n.port == port)

    def wait_ok(self, timeout: float = 30) -> None:
        """Until every live node says the cluster is ok and agrees on who serves every slot."""
        deadline = time.monotonic() + timeout
        while True:
            states = []
            for node in self.live():
                with contextlib.suppress(redis.RedisError), node.admin() as c:
                    info = c.execute_command("CLUSTER", "INFO")
                    text = info.decode() if isinstance(info, bytes) else str(info)
                    states.append("cluster_state:ok" in text)
            if states and all(states):
                return
            if time.monotonic() > deadline:
                logs = " | ".join(n.log_text()[-300:] for n in self.nodes)
                raise RuntimeError(f"the cluster did not come up: {logs}")
            time.sleep(0.1)

    def migrate_slot_of(self, key: bytes, during: Callable[[], object]) -> RedisServer:
        """Move the slot of `key` to another primary as a resharding does: `key` first, then `during()` runs
        (a client asking for `key` gets ASK from the old primary; the slot's other keys are still there), then
        the slot's other keys, then the slot is the new primary's (MOVED from then). Returns the new primary."""
        source = self.primary_of(key)
        target = next(n for n in self.live() if n is not source and _role(n) == b"master")
        with self.admin() as admin:
            slot = admin.keyslot(key)
        self.begin_migration(slot, source, target)
        try:
            self.move_keys(slot, source, target, [key])
            during()
            self.move_keys(slot, source, target)
        finally:
            self.end_migration(slot, target)
        return target

    def begin_migration(self, slot: int, source: RedisServer, target: RedisServer) -> None:
        """Mark `slot` importing on `target` and migrating on `source`, as `redis-cli --cluster reshard` does
        first: from now on a key not found on the source is answered with ASK."""
        with source.admin() as s, target.admin() as t:
            t.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", self.node_id(source))
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", self.node_id(target))

    def move_keys(self, slot: int, source: RedisServer, target: RedisServer, keys: list[bytes] | None = None) -> None:
        """MIGRATE `keys` (every key of the slot still on the source when None) to the target."""
        with source.admin() as s:
            names = keys if keys is not None else s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10000)
            if names:
                s.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *names)

    def end_migration(self, slot: int, target: RedisServer) -> None:
        """Give the slot to `target` on every primary: clients asking elsewhere now get MOVED."""
        owner = self.node_id(target)
        for node in (n for n in self.live() if _role(n) == b"master"):
            with node.admin() as c:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner)

    def close(self) -> None:
        for node in self.nodes:
            node.terminate()
        for node in self.nodes:
            node.close()


def _role(node: RedisServer) -> bytes:
    with node.admin() as c:
        return c.execute_command("ROLE")[0]
