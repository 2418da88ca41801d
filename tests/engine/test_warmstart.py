"""The warm-start plan as a value: what a request reports once it was applied (the routes themselves run
through the worker in test_routes.py and test_memory_kinds.py)."""

from __future__ import annotations

from barreld.engine.sequence import Sequence
from barreld.engine.warmstart import WarmStart
from barreld.names import Route


def test_a_plan_that_kept_nothing_is_a_miss_with_no_tier() -> None:
    assert WarmStart().served(0) == (Route.MISS, None)
    assert WarmStart(Route.EXACT, 64, tier="disk").served(0) == (Route.MISS, None)  # read, then refused


def test_a_stored_plan_reports_its_tier_and_a_live_one_none() -> None:
    assert WarmStart(Route.LONGEST_PREFIX, 64, tier="ram").served(32) == (Route.LONGEST_PREFIX, "ram")
    assert WarmStart(Route.LIVE, 64, seq=Sequence(0), tier="ram").served(64) == (Route.LIVE, None)
