"""Barrel's own report beside every HTTP API's `usage`: the lookup route, tier and keys (pass `key` back as
`parent_key`), where the time went, and whether a reply that called tools keeps the prefix."""

from __future__ import annotations

import dataclasses
from typing import Any

import barreld
from barreld.engine.registry import LoadedModel
from barreld.engine.reply import Finish


def barrel_doc(finish: Finish) -> dict[str, Any]:
    done = finish.done
    c = done.cache
    return {
        "cache": {
            "path": c.route.value,
            "restored_tokens": c.restored_tokens,
            "prefilled_tokens": c.prefilled_tokens,
            "tier": c.tier,
            **({} if c.divergence is None else {"divergence": c.divergence.doc()}),
        },
        "key": done.key.hex(),
        "prompt_key": done.prompt_key.hex(),
        "timings_ms": dataclasses.asdict(done.timings),
        **({} if finish.prefix_kept is None else {"prefix_kept": finish.prefix_kept}),
    }


def system_fingerprint(model: LoadedModel) -> str:
    """OpenAI's name for what served a reply: Barrel's version and the model file's fingerprint."""
    return f"barrel-{barreld.__version__}-{model.fingerprint.hex()[:12]}"
