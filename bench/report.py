"""Tables rendered twice from the same data: rich for the terminal, Markdown for RESULTS.md."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    note: str = ""

    def add(self, *cells: object) -> None:
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        out = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |",
               "|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns))) + "|"]
        out += ["| " + " | ".join(r) + " |" for r in self.rows]
        if self.note:
            out += ["", self.note]
        return "\n".join(out) + "\n"

    def rich(self):
        from rich.table import Table as RichTable

        t = RichTable(title=self.title, title_justify="left", caption=self.note or None, caption_justify="left")
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for r in self.rows:
            t.add_row(*r)
        return t


def ms(x: float) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if x >= 1000:
        return f"{x / 1000:.2f} s"
    if x >= 100:
        return f"{x:.0f} ms"
    return f"{x:.1f} ms"


def frac(num: float, den: float) -> str:
    """num/den as '1/N' (how many times smaller num is)."""
    if not num or not den or math.isnan(num) or math.isnan(den):
        return "n/a"
    return f"1/{den / num:.0f}" if den >= num else f"{num / den:.1f}x"


def times(slow: float, fast: float) -> str:
    """How many times faster `fast` is than `slow`."""
    if not slow or not fast or math.isnan(slow) or math.isnan(fast):
        return "n/a"
    return f"{slow / fast:.1f}x"


def pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


# ---- sections of RESULTS.md that other commands write --------------------------------------------------

_MARK = "<!-- section {name}: written by python -m bench.{name}; python -m bench keeps it -->"
_END = "<!-- end of section {name} -->"


def _sections(text: str) -> dict[str, str]:
    """Marked sections found in `text`, by name, marks included."""
    found = {}
    for match in re.finditer(r"<!-- section (\w+): .*? -->\n.*?<!-- end of section \1 -->\n", text, re.S):
        found[match.group(1)] = match.group(0)
    return found


def put_section(path: Path, name: str, markdown: str) -> None:
    """Writes `markdown` as the section `name` of `path`, replacing the one there, else at the end; the rest of
    the file stays as it is."""
    block = f"{_MARK.format(name=name)}\n{markdown.rstrip()}\n{_END.format(name=name)}\n"
    text = path.read_text() if path.exists() else ""
    old = _sections(text).get(name)
    text = text.replace(old, block) if old else text.rstrip("\n") + ("\n\n" if text else "") + block
    path.write_text(text)


def kept_sections(path: Path) -> list[str]:
    """The marked sections of an existing file, for a regenerated file to carry over."""
    return list(_sections(path.read_text()).values()) if path.exists() else []
