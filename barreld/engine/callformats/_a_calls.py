"""What group A's families share: a reply is reasoning, then content, then call blocks one after another from
the first place a call starts. A family says where its calls start and how to read one block; the text around
the calls is treated here, alike for all of them."""

from __future__ import annotations

from collections.abc import Collection

from barreld.engine.callformats.base import Family, Parsed, ParsedCall, split_reasoning

Calls = tuple[tuple[ParsedCall, ...], int]  # the calls of a block and where the block ends


def offered(name: str, tools: Collection[str]) -> bool:
    """Whether a call may name `name`: any name when no tool is named, so a reply is read the same either way."""
    return not tools or name in tools


class CallFamily(Family):
    """A family whose calls follow its content in blocks, each opened by one of `markers`. The calls read are
    kept; text left after them that is not whitespace stays content, and a first block that does not read
    (an unknown name, broken JSON) leaves the whole reply content, as the model may only have been writing
    about calls."""

    def parse(self, text: str, tools: Collection[str] = (), *, reasoning_open: bool = False) -> Parsed:
        reasoning, rest = self.split(text, reasoning_open)
        start = self.call_start(rest)
        if start is None:
            return Parsed(rest, reasoning)
        calls: list[ParsedCall] = []
        pos = start
        while (found := self.read(rest, pos, tools)) is not None:
            more, pos = found
            calls.extend(more)
        if not calls:
            return Parsed(rest, reasoning)
        leftover = rest[pos:]
        return Parsed(rest[:start] + (leftover if leftover.strip() else ""), reasoning, tuple(calls))

    def split(self, text: str, reasoning_open: bool) -> tuple[str, str]:
        """(reasoning, the rest) of a reply."""
        return split_reasoning(text, self.think, reasoning_open)

    def call_start(self, text: str) -> int | None:
        """Where the first call starts in the text after the reasoning: the earliest of the markers."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def read(self, text: str, pos: int, tools: Collection[str]) -> Calls | None:
        """The calls of the block at `pos` (after whitespace) and where it ends; None when no block of
        calls to offered tools is there. Never an empty tuple of calls."""
        raise NotImplementedError
