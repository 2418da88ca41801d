"""`barrelctl scheduler status`: the memory-pressure scheduler."""

from __future__ import annotations

import typer

from barrelctl import render, state
from barrelctl.state import JsonOpt

app = typer.Typer(help="The memory-pressure scheduler.", no_args_is_help=True)


def _ratio(sample: dict | None) -> str:
    if not sample:
        return "-"
    return f"{sample['ratio']:.3f} ({render.size(sample['used'])} of {render.size(sample['total'])})"


@app.command("status")
def scheduler_status(json_out: JsonOpt = False) -> None:
    """Show whether it is enabled, its source, watermarks, last sample and last eviction."""
    doc = state.client().scheduler_status()
    if state.want_json(json_out):
        render.print_json(doc)
        return
    last = doc.get("last_eviction") or {}
    rows = [
        ("enabled", doc.get("enabled")),
        ("source", doc.get("source")),
        ("available", doc.get("available", "-") if doc.get("enabled") else "-"),
        ("watermarks", f"high {doc.get('high_watermark')} / low {doc.get('low_watermark')}"),
        ("interval", f"{doc.get('interval_ms')} ms"),
        ("evict tiers", ", ".join(doc.get("evict_tiers", []))),
        ("last sample", _ratio(doc.get("last_sample"))),
        (
            "last eviction",
            f"{last.get('evicted', 0)} rows, {render.size(last.get('bytes_freed', 0))}, {render.ago(last.get('at', 0))}"
            if last
            else "never",
        ),
        ("evicted in all", f"{doc.get('evictions_total', 0)} rows, {render.size(doc.get('bytes_freed_total', 0))}"),
    ]
    if doc.get("unavailable_reason"):
        rows.append(("unavailable", doc["unavailable_reason"]))
    for e in doc.get("errors", [])[-3:]:
        rows.append(("error", e))
    render.pairs("scheduler", rows)
