"""The tool-call and reasoning formats of the model families agents run, one module per family.

Each public module defines `FAMILY`, an instance of a `Family` subclass; this package finds them all, and a chat
template is read as the first family (by priority) that detects it, else the generic format. A family's
module holds its parser only: the bytes of a forced call come from the template itself (calllayout). A module
whose name starts with `_` holds what several families share."""

from __future__ import annotations

import functools
import importlib
import pkgutil

from barreld.engine.callformats import generic
from barreld.engine.callformats.base import Family, Parsed, ParsedCall

GENERIC = generic.FAMILY

__all__ = ["GENERIC", "Family", "Parsed", "ParsedCall", "families", "family_of"]


@functools.cache
def families() -> tuple[Family, ...]:
    """Every family's format, in the order detection tries them."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name != "base":
            module = importlib.import_module(f"{__name__}.{info.name}")
            found.append(module.FAMILY)
    return tuple(sorted(found, key=lambda f: (f.priority, f.name)))


def family_of(template: str | None) -> Family:
    """The family whose format `template` writes; the generic one when none claims it."""
    if template:
        for family in families():
            if family.detects(template):
                return family
    return GENERIC
