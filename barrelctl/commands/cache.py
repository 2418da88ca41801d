"""`barrelctl cache dump | stats | explain | gc | evict-bytes | verify`: look inside the KV cache and free space."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from barrelctl import render, state
from barrelctl.commands.complete import done_json
from barrelctl.conversation import read_messages
from barrelctl.errors import EXIT_USAGE, CliError
from barrelctl.state import JsonOpt
from barreld.names import DEFAULT_TENANT_LABEL, REDIS_TIER, TIER_NAMES, tenant_label
from barreld.sizes import parse_size

app = typer.Typer(help="Inspect the KV cache and free space.", no_args_is_help=True)


TIERS = (*TIER_NAMES, REDIS_TIER)
TIER_HELP = "ram, ram_file, disk, or redis (the shared tier: only when named)"
TierList = Annotated[
    list[str] | None, typer.Option("--tier", help=f"Only this tier (repeatable; default every local one): {TIER_HELP}.")
]


def _tier(value: str | None) -> str:
    if value is not None and value not in TIERS:
        raise CliError(f"bad tier {value!r}: use one of {', '.join(TIERS)}", EXIT_USAGE)
    return value or ""


def row_json(r) -> dict:
    """The contract's dump row: the proto's fields in order, with an empty location as null."""
    row = {f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}
    row["location"] = row["location"] or None
    return row


@app.command("dump")
def cache_dump(
    model: Annotated[str | None, typer.Option("--model", help="Only rows of this model.")] = None,
    tier: Annotated[str | None, typer.Option("--tier", help=f"Only rows in this tier: {TIER_HELP}.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="Only this tenant's rows: a keys file's name, "
                                                                "uid:N, or 'default' (the daemon's own user).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """List every index row you may see (with --tier redis, the shared tier's rows). The daemon's own user
    sees every tenant's; another user of a shared socket, only its own."""
    wanted = None if tenant is None else "" if tenant == DEFAULT_TENANT_LABEL else tenant
    rows = [row_json(r) for r in state.client().cache_dump(model=model or "", tier=_tier(tier), tenant=wanted)]
    if state.want_json(json_out):
        render.print_json({"rows": rows})
        return
    render.table(
        f"{len(rows)} rows ({render.size(sum(r['size'] for r in rows))})",
        ("key", "tenant", "model", "memory", "tier", "own", "shared", "tokens", "reason", "refs", "hits", "last used"),
        (
            (
                r["key"][:12],
                tenant_label(r["tenant"]) + (f" ({r['namespace'][:6]})" if r["namespace"] and r["tenant"] else ""),
                r["model"],
                r["memory"],
                r["tier"],
                render.size(r["own_bytes"]),
                render.size(r["shared_bytes"]) if r["blocks"] else "-",
                r["tokens"],
                r["save_reason"] + ("" if r["status"] == "available" else f" ({r['status']})"),
                r["refcount"],
                r["hits"],
                render.ago(r["last_used"]),
            )
            for r in rows
        ),
        right=("own", "shared", "tokens", "refs", "hits"),
    )


@app.command("stats")
def cache_stats(json_out: JsonOpt = False) -> None:
    """Show the counters and per-tier usage against quota."""
    reply = state.client().cache_stats()
    counters = dict(sorted(reply.counters.items()))
    tiers = {name: {f.name: getattr(t, f.name) for f in t.DESCRIPTOR.fields} for name, t in reply.tiers.items()}
    remote = json.loads(reply.redis_json) if reply.redis_json else None
    if state.want_json(json_out):
        render.print_json({"counters": counters, "tiers": tiers, REDIS_TIER: remote})
        return
    render.table(
        "tiers",
        ("tier", "rows", "used", "quota", "use", "logical", "dedup"),
        (
            (
                n,
                t["rows"],
                render.size(t["bytes"]),
                render.size(t["quota"]),
                f"{100 * t['bytes'] / t['quota']:.1f}%" if t["quota"] else "-",
                render.size(t["logical_bytes"]),
                f"{t['dedup_ratio']:.2f}x",
            )
            for n, t in sorted(tiers.items())
        ),
        right=("rows", "used", "quota", "use", "logical", "dedup"),
    )
    render.table(
        "counters",
        ("counter", "value"),
        ((k, f"{v / 1e6:.1f} ms" if k.endswith("_ns") else v) for k, v in counters.items()),
        right=("value",),
    )
    if remote is not None:
        _remote_table(remote)


def _remote_table(r: dict) -> None:
    """The shared tier: where, whether it answers, traffic, and what went wrong by kind."""
    rtt = "-" if r["rtt_ms"] is None else f"{r['rtt_ms']:.2f} ms"
    rows = [
        ("server", f"{r['url']} (prefix {r['prefix']}, {'read-write' if r['write'] else 'read-only'})"),
        ("reachable", f"{'yes' if r['reachable'] else 'no'}, last round trip {rtt}"),
        ("restores (hits)", r["hits"]),
        ("misses", _by_kind(r["misses"])),
        ("errors", _by_kind(r["errors"])),
        ("bytes read / written", f"{render.size(r['bytes_read'])} / {render.size(r['bytes_written'])}"),
        ("mirrors", f"{r['mirrors']} written, {r['mirrors_present']} already there, "
                    f"{r['mirrors_failed']} failed, {r['mirrors_dropped']} dropped"),
        ("blocks", f"{r['blocks_written']} written, {r['blocks_skipped']} skipped "
                   f"({render.size(r['bytes_skipped'])} not sent); {r['blocks_fetched']} fetched, "
                   f"{r['blocks_local']} from local tiers ({render.size(r['bytes_local'])} not fetched)"),
        *((f"errors at {node}", _by_kind(kinds)) for node, kinds in sorted(r["node_errors"].items())),
    ]
    if r["quota"] is not None:
        used = "-" if r["used_bytes"] is None else render.size(r["used_bytes"])
        rows.append(("used / quota", f"{used} / {render.size(r['quota'])}"))
    render.pairs(REDIS_TIER, rows)


def _by_kind(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in counts.items() if n) or "0"


@app.command("explain")
def cache_explain(
    file: Annotated[str, typer.Argument(help="The prompt, or with --messages a JSON array of {role, content} "
                                             "messages; '-' reads stdin.", show_default=False)],
    model: Annotated[str | None, typer.Option("--model", help="Model name (default: the default model).")] = None,
    messages: Annotated[bool, typer.Option("--messages", help="FILE is a conversation, rendered by the model's "
                                                              "chat template.")] = False,
    chat: Annotated[bool, typer.Option("--chat", help="Render the prompt as one user turn.")] = False,
    parent_key: Annotated[str | None, typer.Option("--parent-key", help="The previous turn's `key`.")] = None,
    tenant: Annotated[str | None, typer.Option("--tenant", help="As this tenant of the HTTP keys file (the "
                                                                "daemon's own user only).")] = None,
    cache_salt: Annotated[str | None, typer.Option("--cache-salt", help="With the requests' cache_salt.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Say what a completion of FILE would restore and, short of all of it, where it leaves the closest text
    your tenant holds (a live sequence or a stored row), without running it."""
    convo = read_messages(file) if messages else ()
    text = b"" if messages else _read_file(file)
    done = state.client().complete(text, model=model or "", chat=chat, messages=convo, parent_key=parent_key or "",
                                   explain=True, tenant=tenant or "", cache_salt=cache_salt or "").result()
    doc = {k: v for k, v in done_json(done).items() if k in ("model", "prompt_key", "cache", "tokens")}
    if state.want_json(json_out):
        render.print_json(doc)
        return
    c, n = doc["cache"], doc["tokens"]["prompt"]
    rows = [("prompt", f"{n:,} tokens"),
            ("would restore", f"{c['restored_tokens']:,} ({c['path']}{', ' + c['tier'] if c['tier'] else ''})"),
            ("would prefill", f"{c['prefilled_tokens']:,}")]
    d = c.get("divergence")
    if d:
        held = "a live sequence" if d["against"] == "live" else f"row {d['against'][:12]}"
        rows += [("closest text", f"{held}: the first {d['matched_tokens']:,} tokens ({d['matched_bytes']:,} bytes)"),
                 ("  then it holds", repr(d["cached"])), ("  the prompt has", repr(d["prompt"]))]
    elif c["prefilled_tokens"]:
        rows.append(("closest text", "none: the model holds no text to compare with"))
    render.pairs(f"{doc['model']}: {c['path']}", rows)


def _read_file(path: str) -> bytes:
    try:
        return sys.stdin.buffer.read() if path == "-" else Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror or exc}", EXIT_USAGE) from None


@app.command("gc")
def cache_gc(
    tier: TierList = None,
    json_out: JsonOpt = False,
) -> None:
    """Evict every unreferenced row; with --tier redis, delete Barrel's keys (its prefix) from Redis."""
    evicted = state.client().cache_gc(tiers=[_tier(t) for t in tier or []])
    if state.want_json(json_out):
        render.print_json({"evicted": evicted})
    else:
        render.out.print(f"evicted {evicted} rows")


@app.command("evict-bytes")
def cache_evict_bytes(
    size: Annotated[
        str, typer.Argument(help="Bytes to free: a whole number with optional K, M, G, T (powers of 1024).")
    ],
    tier: TierList = None,
    json_out: JsonOpt = False,
) -> None:
    """Free at least SIZE bytes, least recently used first."""
    try:
        n = parse_size(size)
    except ValueError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    tiers = [_tier(t) for t in tier or []]
    reply = state.client().cache_evict_bytes(n, tiers=tiers)
    if state.want_json(json_out):
        render.print_json({"evicted": reply.evicted, "bytes_freed": reply.bytes_freed})
    else:
        render.out.print(f"evicted {reply.evicted} rows, freed {render.size(reply.bytes_freed)}")


@app.command("verify")
def cache_verify(json_out: JsonOpt = False) -> None:
    """Re-read every row's file, check it, drop and report bad ones."""
    from rich.progress import Progress

    as_json = state.want_json(json_out)
    with Progress(console=render.err, transient=True, disable=as_json) as progress:
        task = progress.add_task("verifying", total=None)
        result = state.client().cache_verify(
            progress=lambda done, total: progress.update(task, completed=done, total=total)
        )
    if as_json:
        render.print_json({"checked": result.checked, "bad": list(result.bad)})
        return
    render.out.print(f"checked {result.checked} rows, {len(result.bad)} bad")
    for key in result.bad:
        render.out.print(f"  dropped {key}")
