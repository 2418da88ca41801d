"""Part 7: tenants of a shared socket. With `[daemon] socket_group`, two members of that group are tenants of
their own (`uid:N`, learned through SO_PEERCRED on SOCKET.peer): the same prompt that one made warm is cold
for the other, each dumps only its own rows while the daemon's user dumps both, neither may gc, verify, load or
stop the daemon, no token names another uid, and a call without a token (any call) is refused.

The daemon runs as root (its owner); the two users and their group are made for the module with useradd and
groupadd (unique names, removed at the end), and run barrelctl of this checkout."""

from __future__ import annotations

import grp
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from barreld.names import Route
from barreld.paths import peer_socket
from barreld.rpc import barrel_pb2 as pb
from barreld.rpc import barrel_pb2_grpc as pb_grpc
from tests.support.sandbox import SOURCE_ROOT, Run, Sandbox

from . import util
from .test_access import modes

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="making users and switching to them needs root"),
    pytest.mark.skipif(
        not all(shutil.which(c) for c in ("useradd", "userdel", "groupadd", "groupdel")),
        reason="useradd, userdel, groupadd or groupdel is missing",
    ),
]

PROMPT = util.doc(71, 260).decode()  # ~270 tokens, the same text for both users
FORGE = r"""
import json, sys
from pathlib import Path
import grpc
from barreld.paths import peer_token
from barreld.rpc import barrel_pb2 as pb, barrel_pb2_grpc as pb_grpc
sock, other = sys.argv[1], sys.argv[2]
own = peer_token(Path(sock))
token = own.partition(":")[2]
stub = pb_grpc.BarrelStub(grpc.insecure_channel("unix:" + sock))
out = {}
for name, given in (("own", own), ("other", f"{other}:{token}"), ("root", f"0:{token}"), ("bad", f"{other}:00")):
    try:
        stub.CacheDump(pb.CacheDumpRequest(), metadata=(("barrel-peer", given),), timeout=30)
        out[name] = "OK"
    except grpc.RpcError as e:
        out[name] = e.code().name
print(json.dumps(out))
"""


def _open_to_all(path: Path) -> bool:
    """Every directory down to `path`, and `path` itself, has its x bit for others."""
    return all(p.stat().st_mode & 0o001 for p in (path, *path.parents))


def user_python() -> tuple[str, list[str]]:
    """An interpreter another user can run, with the PYTHONPATH that gives it this checkout and its packages:
    this venv's own, or (where it lives in a private home, as pyenv's in /root) the system's of the same
    version, with the venv's site-packages on the path."""
    if not _open_to_all(SOURCE_ROOT):
        pytest.skip(f"other users cannot reach the checkout {SOURCE_ROOT}")
    here = Path(sys.executable)
    if _open_to_all(here) and _open_to_all(here.resolve()) and _open_to_all(Path(sys.base_prefix) / "lib"):
        return sys.executable, [str(SOURCE_ROOT)]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/local/bin:/usr/bin:/bin")
    if system is None or not _open_to_all(Path(system).resolve()):
        pytest.skip(f"other users cannot run {sys.executable}, and there is no {version} they can")
    return system, [str(SOURCE_ROOT), sysconfig.get_paths()["purelib"]]


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int  # its own group
    home: Path

    @property
    def tenant(self) -> str:
        return f"uid:{self.uid}"


@dataclass
class Shared:
    """The sandbox whose socket the group shares, its daemon, the group and its two members."""

    w: Sandbox
    proc: subprocess.Popen
    group: str
    gid: int
    users: tuple[User, User]
    python: str
    pythonpath: list[str]

    def run(self, user: User, *argv: str, timeout: float = 300) -> Run:
        """`python argv...` as `user`, a member of the group as after a login, in its own home."""
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(user.home),
            "PYTHONPATH": os.pathsep.join(self.pythonpath),
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        p = subprocess.run([self.python, *argv], user=user.uid, group=user.gid, extra_groups=[self.gid], env=env,
                           cwd=user.home, capture_output=True, timeout=timeout)
        return Run(p.returncode, p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace"))

    def ctl(self, user: User, *args: str) -> Run:
        return self.run(user, "-m", "barrelctl", "--socket", str(self.w.socket), "--no-autostart", *args)

    def complete(self, user: User) -> dict:
        r = self.ctl(user, "--json", "complete", PROMPT, "--max-tokens", "4")
        assert r.rc == 0, r.err
        done = r.json()
        util.wait_for(lambda: done["key"] in self.available(), timeout=60, what=f"{user.name}'s finish save")
        return done

    def available(self) -> set[str]:
        with self.w.client() as c:
            return {x.key for x in util.rows(c) if x.status == "available"}

    def dump(self, user: User | None) -> list[dict]:
        r = self.w.ctl("--json", "cache", "dump") if user is None else self.ctl(user, "--json", "cache", "dump")
        assert r.rc == 0, r.err
        return r.json()["rows"]


def _make(*argv: str) -> None:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{' '.join(argv)}: {p.stderr}"


@pytest.fixture(scope="module")
def shared() -> Iterator[Shared]:
    python, pythonpath = user_python()
    tag = secrets.token_hex(3)
    group, names = f"barrel-t{tag}", (f"barrel-t{tag}-a", f"barrel-t{tag}-b")
    made: list[tuple[str, str]] = []
    try:
        _make("groupadd", group)
        made.append(("groupdel", group))
        for name in names:
            _make("useradd", "--no-create-home", "--user-group", "--groups", group, "--shell", "/usr/sbin/nologin",
                  name)
            made.append(("userdel", name))
        with Sandbox.new(label="tenants") as w:
            users = []
            for name in names:
                home = w.base / name
                home.mkdir(mode=0o700)
                entry = pwd.getpwnam(name)
                os.chown(home, entry.pw_uid, entry.pw_gid)
                users.append(User(name, entry.pw_uid, entry.pw_gid, home))
            w.write_config(f'\n[daemon]\nsocket_group = "{group}"\n' + util.ONE_SAVE_POLICY + util.model_config())
            proc = util.start(w)
            # The sandbox's own directories are the test's: open them to traversal, so that what stands between
            # the users and the socket is barreld's modes (its socket directory 0750 in the group) alone.
            with modes([w.base, w.base / "run"], 0o711):
                yield Shared(w, proc, group, grp.getgrnam(group).gr_gid, (users[0], users[1]), python, pythonpath)
            util.stop(w, proc)
    finally:
        for argv in reversed(made):  # userdel also removes each user's own group
            subprocess.run(argv, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def served(shared: Shared) -> dict[str, list[dict]]:
    """Each user sends the same prompt twice, the first user's pair first (its checkpoint saved before the
    second user's first request); then the first user once more, when the one sequence holds the second's."""
    one, two = shared.users
    got = {u.name: [shared.complete(u), shared.complete(u)] for u in (one, two)}
    got[one.name].append(shared.complete(one))
    return got


def test_the_socket_and_its_identity_socket_are_open_to_the_group_only(shared: Shared) -> None:
    w = shared.w
    for path in (w.socket, peer_socket(w.socket)):
        st = path.stat()
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == shared.gid, path
    st = w.socket.parent.stat()
    assert stat.S_IMODE(st.st_mode) == 0o750 and st.st_gid == shared.gid


def test_a_users_prompt_is_warm_for_that_user_and_cold_for_another(served: dict[str, list[dict]],
                                                                    shared: Shared) -> None:
    one, two = shared.users
    for user in (one, two):
        second = served[user.name][1]
        assert second["cache"]["path"] != Route.MISS and second["cache"]["restored_tokens"] > 0, (user.name, second)
        assert second["tokens"]["prompt"] >= 200
    first_of_two = served[two.name][0]["cache"]
    assert first_of_two["path"] == Route.MISS and first_of_two["restored_tokens"] == 0, (
        f"{two.name}'s first request found {one.name}'s identical prompt: {first_of_two}"
    )
    assert served[one.name][0]["cache"]["restored_tokens"] == 0
    # The live sequence is the second user's now: the first user's own checkpoint serves it, not that.
    again = served[one.name][2]["cache"]
    assert again["path"] not in (Route.MISS, Route.LIVE) and again["restored_tokens"] > 0, again
    assert served[one.name][0]["key"] != served[two.name][0]["key"]


def test_each_user_dumps_its_own_rows_and_the_owner_both(served: dict[str, list[dict]], shared: Shared) -> None:
    one, two = shared.users
    tenants = {}
    for user in (one, two):
        got = shared.dump(user)
        tenants[user.name] = {r["tenant"] for r in got}
        assert tenants[user.name] == {user.tenant}, (user.name, tenants[user.name])
        assert {d["key"] for d in served[user.name]} & {r["key"] for r in got}, f"{user.name} misses its own rows"
        assert all(r["namespace"] for r in got)
    owner = {r["tenant"] for r in shared.dump(None)}
    assert owner >= {one.tenant, two.tenant}
    # Asking for the other's rows by name is refused, not answered with them.
    r = shared.ctl(one, "--json", "cache", "dump", "--tenant", two.tenant)
    assert r.rc == 1 and two.tenant not in r.out, (r.rc, r.out, r.err)


def test_a_group_member_may_neither_gc_verify_load_nor_stop_the_daemon(served: dict[str, list[dict]],
                                                                       shared: Shared) -> None:
    before = shared.available()
    user = shared.users[0]
    for args in (("cache", "gc"), ("cache", "evict-bytes", "1G"), ("daemon", "stop"), ("cache", "verify"),
                 ("load", "smollm2")):
        r = shared.ctl(user, *args)
        assert r.rc == 1 and "daemon's user" in r.err, (args, r.rc, r.err)
    assert shared.proc.poll() is None, "the daemon stopped"
    with shared.w.client() as c:
        assert c.daemon_status(timeout=10).pid == shared.proc.pid
    assert shared.available() == before, "a refused gc or evict-bytes evicted rows"


def test_no_token_names_another_uid(shared: Shared) -> None:
    one, two = shared.users
    r = shared.run(one, "-c", FORGE, str(shared.w.socket), str(two.uid))
    assert r.rc == 0, r.err
    assert r.json() == {"own": "OK", "other": "UNAUTHENTICATED", "root": "UNAUTHENTICATED", "bad": "UNAUTHENTICATED"}


def test_a_call_without_a_token_on_a_shared_socket_is_refused(served: dict[str, list[dict]], shared: Shared) -> None:
    before = shared.available()
    with grpc.insecure_channel(f"unix:{shared.w.socket}") as channel:
        stub = pb_grpc.BarrelStub(channel)
        for call, request in ((stub.CacheDump, pb.CacheDumpRequest()), (stub.CacheGc, pb.CacheGcRequest()),
                              (stub.Shutdown, pb.ShutdownRequest()), (stub.DaemonStatus, pb.DaemonStatusRequest()),
                              (stub.CacheStats, pb.CacheStatsRequest()), (stub.ListModels, pb.ListModelsRequest()),
                              (stub.LoadModel, pb.LoadModelRequest(name="x", path="/etc/shadow"))):
            with pytest.raises(grpc.RpcError) as caught:
                call(request, timeout=30)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, (call, caught.value)
            assert "socket_group" in (caught.value.details() or "")
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Complete(pb.CompleteRequest(prompt=PROMPT.encode(), max_tokens=1), timeout=60))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert shared.proc.poll() is None
    assert shared.available() == before
