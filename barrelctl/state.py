"""The global options of one barrelctl run, and the lazily opened client they configure."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from barrelctl.client import Client


@dataclass
class Options:
    socket: Path | None = None
    json: bool = False
    autostart: bool = True
    client: Client | None = None


options = Options()

# Every command takes --json too, so it works after the command as well as before it.
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine output: one JSON document on stdout.")]


def client() -> Client:
    if options.client is None:
        options.client = Client(options.socket, autostart=options.autostart)
    return options.client


def want_json(local: bool) -> bool:
    """--json may come before the command (global) or after it (on the command itself)."""
    return options.json or local


def close() -> None:
    if options.client is not None:
        options.client.close()
        options.client = None
