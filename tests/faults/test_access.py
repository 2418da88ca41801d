"""Part 6: access. Another user can neither connect to the socket nor read the index or the checkpoint
files, and every directory barreld makes is 0700 and every file 0600, whatever the umask it starts with.

The other user is `nobody` (uid 65534), a child process that drops root's privileges. The test's own
directories are opened to traversal (0711), so what keeps that user out is barreld's modes alone; then
barreld's directories are opened to traversal too, so the files' own modes are tested as well."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from barreld.engine.registry import bundled_model_path
from tests.support.sandbox import Sandbox

from . import util
from .util import complete, doc

NOBODY = 65534
PROBE = r"""
import json, os, socket, sys
out = {}
for kind, path in json.loads(sys.argv[1]):
    try:
        if kind == "connect":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(path)
            s.close()
        elif kind == "list":
            os.listdir(path)
        else:
            os.close(os.open(path, os.O_RDONLY if kind == "read" else os.O_WRONLY))
        out[kind + " " + path] = "ok"
    except OSError as e:
        out[kind + " " + path] = e.errno
print(json.dumps(out))
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="switching to another user needs root")


def as_nobody(ops: list[tuple[str, str]]) -> dict[str, object]:
    def drop() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    p = subprocess.run(
        [python, "-I", "-c", PROBE, json.dumps(ops)],
        preexec_fn=drop,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def modes(paths: list[Path], mode: int) -> Iterator[None]:
    old = {p: stat.S_IMODE(p.stat().st_mode) for p in paths}
    try:
        for p in paths:
            os.chmod(p, mode)
        yield
    finally:
        for p, m in old.items():
            os.chmod(p, m)


def daemon_paths(w: Sandbox, rf_root: Path) -> tuple[list[Path], list[Path]]:
    """Every directory and file barreld made: socket dir, data dir (index, locks, kvc), ram_file root."""
    dirs, files = [], []
    for top in (w.socket.parent, w.data_dir, rf_root):
        dirs.append(top)
        for root, ds, fs in os.walk(top):
            dirs += [Path(root) / d for d in ds]
            files += [Path(root) / f for f in fs]
    return dirs, files


def test_another_user_can_neither_connect_nor_read_and_modes_are_private() -> None:
    with Sandbox.new() as w:
        rf_root = w.shm / "rf"  # barreld creates it
        model = bundled_model_path("smollm2")
        models = "".join(
            f'\n[[models]]\nname = "{n}"\npath = "{model}"\ntier = "{t}"\n'
            for n, t in (("d", "disk"), ("f", "ram_file"))
        )
        body = f'[tiers.ram_file]\nroot = "{rf_root}"\n' + util.ONE_SAVE_POLICY + models
        (w.base / "config" / "barrel" / "barreld.toml").write_text(body)
        with umask(0):  # a careless umask must not open anything
            proc = util.start(w)
        s = w.client()
        for name in ("d", "f"):
            r = complete(s, doc(ord(name), 190), 6, model=name)
            util.wait_for(
                lambda r=r: r.key in {x.key for x in util.rows(s) if x.status == "available"}, what="the save"
            )
        dirs, files = daemon_paths(w, rf_root)
        kvcs = [f for f in files if f.suffix == ".kvc"]
        index = [f for f in files if f.parent.name == "index.lmdb"]
        assert len(kvcs) == 2 and {f.parent for f in kvcs} == {w.data_dir / "kvc", rf_root}
        assert {f.name for f in index} >= {"data.mdb", "lock.mdb"}
        wrong = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs if stat.S_IMODE(p.stat().st_mode) != 0o700}
        wrong |= {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != 0o600}
        assert wrong == {}, "not private"
        assert stat.S_ISSOCK(w.socket.stat().st_mode)

        ops = [("connect", str(w.socket))] + [("read", str(f)) for f in files if f != w.socket]
        ops += [("write", str(f)) for f in kvcs + index] + [("list", str(d)) for d in dirs]
        ancestors = [w.base, w.base / "run", w.base / "data", w.shm]
        with modes(ancestors, 0o711):
            denied = as_nobody(ops)
            with modes(dirs, 0o711):  # only the files' own modes stand in the way now
                files_denied = as_nobody([op for op in ops if op[0] != "list"])
            with modes(dirs, 0o711), modes(kvcs[:1], 0o644):  # the control: an open mode does let it in
                control = as_nobody([("read", str(kvcs[0]))])
        allowed = {k: v for k, v in {**denied, **files_denied}.items() if v != 13}  # 13: EACCES
        assert allowed == {}, "another user got further than EACCES"
        assert list(control.values()) == ["ok"]
        assert complete(s, b"The owner still gets in.", 2).completion_tokens == 2
        util.stop(w, proc)
        print(
            f"\naccess: {len(denied) + len(files_denied)} attempts by uid {NOBODY} denied "
            f"({len(dirs)} dirs 0700, {len(files)} files 0600)"
        )


def test_files_an_autostart_leaves_are_private() -> None:
    with Sandbox.new(util.model_config()) as w, umask(0o022):
        r = w.ctl("complete", "hello", "--max-tokens", "2")
        assert r.rc == 0, r.err
        dirs, files = daemon_paths(w, w.shm)
        assert {f.name for f in files} >= {"barreld.sock", "barreld.log", "autostart.lock"}
        wrong = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if stat.S_IMODE(p.stat().st_mode) != 0o600}
        wrong |= {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs if stat.S_IMODE(p.stat().st_mode) != 0o700}
        assert wrong == {}
