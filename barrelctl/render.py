"""Human output: rich tables, human sizes and times, streamed replies and the chat's footer lines."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence

from rich.console import Console
from rich.table import Table

from barrelctl.client import Completion, CompletionStream, ReplyToken

# A terminal (or $COLUMNS) sets the width; piped output is not wrapped by anyone, so give tables room there.
out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
err = Console(stderr=True, highlight=False)


def print_json(doc: object) -> None:
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    sys.stdout.flush()


def size(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def ago(ts: float, now: float | None = None) -> str:
    if not ts:
        return "-"
    d = (now or time.time()) - ts
    if d < 0:
        return "just now"
    for limit, div, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if d < limit:
            return f"{d / div:.0f}{unit} ago"
    return f"{d / 86400:.1f}d ago"


def duration(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


def table(
    title: str | None, columns: Sequence[str], rows: Iterable[Sequence[object]], right: Iterable[str] = ()
) -> None:
    t = Table(title=title, title_justify="left", header_style="bold")
    right = set(right)
    for c in columns:
        t.add_column(c, justify="right" if c in right else "left", no_wrap=True, overflow="ellipsis")
    for r in rows:
        t.add_row(*(str(x) for x in r))
    out.print(t)


def pairs(title: str | None, items: Iterable[tuple[str, object]]) -> None:
    table(title, ("field", "value"), items)


def stream(start: Callable[[], CompletionStream], as_json: bool) -> Completion:
    """Runs the call, writing tokens to stdout as they come (unless JSON), a spinner on a terminal until the
    first token; Ctrl-C cancels the request in the daemon too, and ends the reply's line either way."""
    status = None
    if not as_json and sys.stderr.isatty():
        status = err.status("waiting for the model…")
        status.start()
    call = None
    ended = True
    try:
        call = start()
        for ev in call:
            if isinstance(ev, ReplyToken) and not as_json:
                if status is not None:
                    status.stop()
                    status = None
                sys.stdout.buffer.write(ev.text)
                sys.stdout.buffer.flush()
                ended = ev.text.endswith(b"\n")
        return call.result()
    except KeyboardInterrupt:
        if call is not None:
            call.cancel()
        raise
    finally:
        if status is not None:
            status.stop()
        if not ended:
            sys.stdout.write("\n")
            sys.stdout.flush()


def millis(ms: float) -> str:
    return f"{ms / 1000:.2f} s" if ms >= 1000 else f"{ms:.0f} ms"


def chat_footer(done: Completion) -> None:
    """One dim line after a reply: how much of the conversation came warm, and how soon the reply began."""
    where = f"{done.route} from {done.tier}" if done.tier else done.route
    cut = ", cut at --max-tokens" if done.finish_reason == "length" else ""
    note(f"{where} · {done.restored} restored · {done.prefilled} prefilled · first token "
         f"{millis(done.client_ttft_ms)} · {done.completion_tokens} tokens{cut}")


def note(text: str) -> None:
    """A dim line on stderr, beside the conversation on stdout: a pipe of replies stays only replies."""
    err.print(text, style="dim", markup=False, highlight=False, soft_wrap=True)
