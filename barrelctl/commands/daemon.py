"""`barrelctl daemon status | stop`."""

from __future__ import annotations

import time

import psutil
import typer

from barrelctl import render, state
from barrelctl.errors import EXIT_UNREACHABLE, CliError
from barrelctl.state import JsonOpt

app = typer.Typer(help="Is barreld up; stop it cleanly.", no_args_is_help=True)


@app.command("status")
def daemon_status(json_out: JsonOpt = False) -> None:
    """Show pid, uptime, socket, HTTP address, data dir and version (exit 3 when no daemon answers)."""
    state.options.autostart = False
    s = state.client().daemon_status(timeout=5.0)
    doc = {
        "running": True,
        "pid": s.pid,
        "uptime_s": round(s.uptime_s, 3),
        "socket": s.socket,
        "http": s.http or None,
        "data_dir": s.data_dir,
        "version": s.version,
        "models": s.models,
        "config": s.config or None,
    }
    if state.want_json(json_out):
        render.print_json(doc)
    else:
        render.pairs(
            "barreld",
            [
                ("pid", s.pid),
                ("uptime", render.duration(s.uptime_s)),
                ("socket", s.socket),
                ("http", s.http or "off"),
                ("data dir", s.data_dir),
                ("version", s.version),
                ("models", s.models),
                ("config", s.config or "(built-in defaults)"),
            ],
        )


@app.command("stop")
def daemon_stop(json_out: JsonOpt = False) -> None:
    """Ask barreld to shut down cleanly and wait until it has gone."""
    state.options.autostart = False
    client = state.client()
    pid = client.daemon_status(timeout=5.0).pid
    client.shutdown(timeout=5.0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.1)
    else:
        raise CliError(f"barreld pid {pid} did not stop within 60s", EXIT_UNREACHABLE)
    if state.want_json(json_out):
        render.print_json({"stopped": True, "pid": pid})
    else:
        render.out.print(f"barreld pid {pid} stopped")
