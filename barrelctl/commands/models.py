"""`barrelctl load | unload | models`: the daemon's loaded models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from barrelctl import render, state
from barrelctl.errors import EXIT_USAGE, CliError
from barrelctl.state import JsonOpt
from barreld.names import TIER_NAMES


def model_json(m) -> dict:
    return {
        "name": m.name,
        "path": m.path,
        "fingerprint": m.fingerprint,
        "quant": m.quant,
        "tier": m.tier,
        "n_ctx": m.n_ctx,
        "n_batch": m.n_batch,
        "n_seq_max": m.n_seq_max,
        "state": m.state,
        "running": m.running,
        "queued": m.queued,
        "live": m.live,
        "default": m.is_default,
        "policy": dict(m.policy),
    }


def _policy(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise CliError(f"bad --policy {item!r}: expected KEY=VALUE", EXIT_USAGE)
        out[key.strip()] = value.strip()
    return out


def model_load(
    name: Annotated[str, typer.Argument(help="Name to load the model under ('smollm2' is the bundled default).")],
    path: Annotated[
        Path | None, typer.Option("--path", help="GGUF file (default: the bundled model for NAME).")
    ] = None,
    tier: Annotated[
        str | None, typer.Option("--tier", help="Where its checkpoints are saved: ram, ram_file or disk.")
    ] = None,
    n_ctx: Annotated[int | None, typer.Option("--n-ctx", help="Context length per sequence, in tokens.")] = None,
    n_batch: Annotated[int | None, typer.Option("--n-batch", help="Most tokens evaluated per batch.")] = None,
    n_seq_max: Annotated[
        int | None, typer.Option("--n-seq-max", help="Sequences (concurrent requests) in one context.")
    ] = None,
    policy: Annotated[
        list[str] | None, typer.Option("--policy", help="Override a save policy gate, KEY=VALUE (repeatable).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    """Load a model under NAME."""
    if tier is not None and tier not in TIER_NAMES:
        raise CliError(f"bad --tier {tier!r}: use one of {', '.join(TIER_NAMES)}", EXIT_USAGE)
    for flag, value in (("--n-ctx", n_ctx), ("--n-batch", n_batch), ("--n-seq-max", n_seq_max)):
        if value is not None and value < 1:
            raise CliError(f"bad {flag} {value}: must be at least 1", EXIT_USAGE)
    resolved = str(path.expanduser().resolve()) if path else ""
    info = state.client().load(
        name,
        path=resolved,
        tier=tier or "",
        n_ctx=n_ctx or 0,
        n_batch=n_batch or 0,
        n_seq_max=n_seq_max or 0,
        policy=_policy(policy or []),
    )
    if state.want_json(json_out):
        render.print_json(model_json(info))
    else:
        render.out.print(
            f"loaded [bold]{info.name}[/bold] ({info.quant}, n_ctx {info.n_ctx}, tier {info.tier}) from {info.path}"
        )


def model_unload(
    name: Annotated[str, typer.Argument(help="The loaded model to free.")],
    json_out: JsonOpt = False,
) -> None:
    """Run the model's shutdown saves, then free it."""
    saved = state.client().unload(name)
    if state.want_json(json_out):
        render.print_json({"name": name, "saved": saved})
    else:
        render.out.print(f"unloaded {name} ({saved} shutdown saves)")


def models_list(json_out: JsonOpt = False) -> None:
    """List loaded models."""
    models = state.client().models()
    if state.want_json(json_out):
        render.print_json({"models": [model_json(m) for m in models]})
        return
    render.table(
        None,
        ("name", "path", "fingerprint", "tier", "n_ctx", "state", "running", "queued", "live"),
        (
            (
                m.name + (" *" if m.is_default else ""),
                m.path,
                m.fingerprint[:12],
                m.tier,
                m.n_ctx,
                m.state,
                m.running,
                m.queued,
                m.live,
            )
            for m in models
        ),
        right=("n_ctx", "running", "queued", "live"),
    )


def register(app: typer.Typer) -> None:
    app.command("load")(model_load)
    app.command("unload")(model_unload)
    app.command("models")(models_list)
