"""barrelctl: the command-line client of barreld. One module per noun under barrelctl.commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from barrelctl import state
from barrelctl.commands import cache, chat, complete, daemon, models, scheduler
from barrelctl.errors import EXIT_USAGE, CliError

try:  # recent typer vendors its own click; older releases use the click package
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - depends on the installed typer
    from click import exceptions as click_exc

app = typer.Typer(
    name="barrelctl",
    help="Talk to barreld, the Barrel inference daemon: completions, models, and its KV cache.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@app.callback()
def main_options(
    socket: Annotated[
        Path | None,
        typer.Option(
            "--socket",
            envvar="BARREL_SOCKET",
            help="barreld's Unix socket "
            "(default: $XDG_RUNTIME_DIR/barrel/barreld.sock, else /tmp/barrel-$UID/barreld.sock).",
        ),
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Machine output: one JSON document on stdout.")] = False,
    no_autostart: Annotated[
        bool, typer.Option("--no-autostart", help="Fail (exit 3) instead of starting barreld when none answers.")
    ] = False,
) -> None:
    state.options.socket = socket
    state.options.json = json_out
    state.options.autostart = not no_autostart


complete.register(app)
chat.register(app)
models.register(app)
app.add_typer(cache.app, name="cache")
app.add_typer(scheduler.app, name="scheduler")
app.add_typer(daemon.app, name="daemon")


def main() -> None:
    """Runs the CLI: expected errors become one stderr line and the contract's exit code."""
    try:
        rv = app(standalone_mode=False, prog_name="barrelctl")
    except CliError as exc:
        print(f"barrelctl: {exc}", file=sys.stderr)
        sys.exit(exc.code)
    except click_exc.NoArgsIsHelpError as exc:
        print(exc.ctx.get_help() if exc.ctx else exc.format_message(), file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except click_exc.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx else ""
        print(f"barrelctl: {exc.format_message()}{hint}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except typer.Abort:
        print("barrelctl: interrupted", file=sys.stderr)
        sys.exit(130)
    except KeyboardInterrupt:
        print("barrelctl: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        state.close()
    sys.exit(rv if isinstance(rv, int) else 0)
