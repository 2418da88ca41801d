"""`barrelctl load | unload | models`: the daemon's loaded models."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from barrelctl import render, state
from barrelctl.errors import EXIT_USAGE, CliError
from barrelctl.state import JsonOpt
from barreld.names import KV_CACHE_TYPES, PLAIN_KV_TYPES, TIER_NAMES, alias_problem, stops_problem

NThreads = Annotated[int | None, typer.Option("--n-threads", help="CPU threads (default: the usable cores).")]
NGpuLayers = Annotated[
    int | None,
    typer.Option("--n-gpu-layers", help="Layers to offload to the GPU: -1 all the build can (default), 0 none."),
]
FlashAttn = Annotated[
    bool | None,
    typer.Option(
        "--flash-attn/--no-flash-attn",
        help="Flash attention (default: on, but for a sliding-window model without --swa-full and for recurrent "
        "and hybrid models). Needed for a quantised V cache.",
    ),
]
TypeK = Annotated[str | None, typer.Option("--type-k", help=f"K cache type: {', '.join(KV_CACHE_TYPES)}.")]
TypeV = Annotated[str | None, typer.Option("--type-v", help="V cache type (quantised ones need --flash-attn).")]
SwaFull = Annotated[
    bool | None,
    typer.Option(
        "--swa-full/--no-swa-full",
        help="Keep every sliding-window cell in the live context, so live cuts stay exact (default: on).",
    ),
]


Aliases = Annotated[
    list[str] | None,
    typer.Option("--alias", help="Another name clients may ask for it by, a glob pattern such as 'claude-*' "
                 "(repeatable)."),
]
TurnEnds = Annotated[
    list[str] | None,
    typer.Option("--stop", help="A string that ends its turn in a chat, for a base model that never ends it "
                 "by itself, such as '\\nUser:' (repeatable)."),
]


def _check_aliases(patterns: list[str], stops: list[str]) -> None:
    for pattern in patterns:
        problem = alias_problem(pattern)
        if problem:
            raise CliError(f"bad --alias {pattern[:40]!r}: {problem}", EXIT_USAGE)
    problem = stops_problem(stops)
    if problem:
        raise CliError(f"bad --stop: {problem}", EXIT_USAGE)


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
        "settling": m.settling,
        "default": m.is_default,
        "policy": dict(m.policy),
        "memory": m.memory,
        "swa_window": m.swa_window,
        "reuse": m.reuse,
        "n_threads": m.n_threads,
        "n_gpu_layers": m.n_gpu_layers,
        "gpu_layers": m.gpu_layers,
        "flash_attn": m.flash_attn,
        "type_k": m.type_k,
        "type_v": m.type_v,
        "swa_full": m.swa_full,
        "prefill_chunk": m.prefill_chunk,
        "error": m.error,
        "aliases": list(m.aliases),
        "stop": list(m.stop),
        "tool_format": m.tool_format,
        "exact_reuse": {"grain": m.exact_reuse.grain, "min_batch": m.exact_reuse.min_batch,
                        "generated": m.exact_reuse.generated, "merged": m.exact_reuse.merged,
                        "spans": m.exact_reuse.spans, "shared": m.exact_reuse.shared,
                        "source": m.exact_reuse.source, "probe_ms": m.exact_reuse.probe_ms,
                        "rule": m.exact_reuse.rule},
    }


def _check_context(tier: str | None, n_ctx: int | None, n_batch: int | None, n_seq_max: int | None) -> None:
    if tier is not None and tier not in TIER_NAMES:
        raise CliError(f"bad --tier {tier!r}: use one of {', '.join(TIER_NAMES)}", EXIT_USAGE)
    for flag, value in (("--n-ctx", n_ctx), ("--n-batch", n_batch), ("--n-seq-max", n_seq_max)):
        if value is not None and value < 1:
            raise CliError(f"bad {flag} {value}: must be at least 1", EXIT_USAGE)


def _check_knobs(
    n_threads: int | None, n_gpu_layers: int | None, flash_attn: bool | None, type_k: str | None, type_v: str | None
) -> None:
    if n_threads is not None and n_threads < 1:
        raise CliError(f"bad --n-threads {n_threads}: must be at least 1", EXIT_USAGE)
    if n_gpu_layers is not None and n_gpu_layers < -1:
        raise CliError(f"bad --n-gpu-layers {n_gpu_layers}: -1 (all), 0 (none) or a layer count", EXIT_USAGE)
    for flag, value in (("--type-k", type_k), ("--type-v", type_v)):
        if value is not None and value not in KV_CACHE_TYPES:
            raise CliError(f"bad {flag} {value!r}: use one of {', '.join(KV_CACHE_TYPES)}", EXIT_USAGE)
    if type_v is not None and type_v not in PLAIN_KV_TYPES and flash_attn is False:
        raise CliError(f"bad --type-v {type_v!r}: a quantised V cache needs --flash-attn", EXIT_USAGE)


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
    n_threads: NThreads = None,
    n_gpu_layers: NGpuLayers = None,
    flash_attn: FlashAttn = None,
    type_k: TypeK = None,
    type_v: TypeV = None,
    swa_full: SwaFull = None,
    alias: Aliases = None,
    stop: TurnEnds = None,
    json_out: JsonOpt = False,
) -> None:
    """Load a model under NAME."""
    _check_context(tier, n_ctx, n_batch, n_seq_max)
    _check_knobs(n_threads, n_gpu_layers, flash_attn, type_k, type_v)
    _check_aliases(alias or [], stop or [])
    resolved = str(path.expanduser().resolve()) if path else ""
    info = state.client().load(
        name,
        path=resolved,
        tier=tier or "",
        n_ctx=n_ctx or 0,
        n_batch=n_batch or 0,
        n_seq_max=n_seq_max or 0,
        policy=_policy(policy or []),
        n_threads=n_threads,
        n_gpu_layers=n_gpu_layers,
        flash_attn=flash_attn,
        type_k=type_k or "",
        type_v=type_v or "",
        swa_full=swa_full,
        aliases=alias or (),
        stop=stop or (),
    )
    _print_loaded(info, json_out)


def _print_loaded(info, json_out: bool) -> None:
    if state.want_json(json_out):
        render.print_json(model_json(info))
    else:
        render.out.print(
            f"loaded [bold]{info.name}[/bold] ({info.quant}, n_ctx {info.n_ctx}, tier {info.tier}, "
            f"{_memory(info)} memory) from {info.path}"
        )


def _memory(m) -> str:
    """The memory kind as the table shows it: swa with its window."""
    return f"{m.memory}({m.swa_window})" if m.swa_window else m.memory


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
        ("name", "path", "fingerprint", "tier", "n_ctx", "memory", "reuse", "state", "running", "queued", "live"),
        (
            (
                m.name + (" *" if m.is_default else ""),
                m.path,
                m.fingerprint[:12],
                m.tier,
                m.n_ctx,
                _memory(m),
                m.reuse,
                m.state,
                m.running,
                m.queued,
                m.live,
            )
            for m in models
        ),
        right=("n_ctx", "running", "queued", "live"),
    )
    for m in models:
        if m.error:
            render.out.print(f"{m.name} failed to load: {m.error}", markup=False)


def register(app: typer.Typer) -> None:
    app.command("load")(model_load)
    app.command("unload")(model_unload)
    app.command("models")(models_list)
