"""Another user's socket is named with its owner, not reported as a missing daemon or a traceback. The
tests run as root, whom every permission lets through, so the denial is stood in for at os.access."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from barrelctl import client
from barrelctl.client import Client, forbidden
from barrelctl.errors import EXIT_UNREACHABLE, ClientError


def deny(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    real = os.access
    monkeypatch.setattr(client.os, "access", lambda p, mode: False if Path(p) == path else real(p, mode))


def test_a_socket_this_user_may_not_use_is_named_with_its_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sock = tmp_path / "barreld.sock"
    sock.touch()
    assert forbidden(sock) is None and forbidden(tmp_path / "none.sock") is None
    deny(monkeypatch, sock)
    owner = pwd.getpwuid(os.getuid()).pw_name
    err = forbidden(sock)
    assert err is not None and err.code == EXIT_UNREACHABLE
    assert f"cannot use barreld's socket {sock}: permission denied (it belongs to {owner})" in str(err)


def test_the_client_neither_autostarts_nor_tracebacks_on_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sock = tmp_path / "run" / "barreld.sock"
    sock.parent.mkdir()
    sock.touch()
    deny(monkeypatch, sock)
    with pytest.raises(ClientError, match="permission denied"), Client(sock, autostart=True) as c:
        c.daemon_status(timeout=2)
    assert list(sock.parent.iterdir()) == [sock]  # no autostart lock, no log: nothing was started
