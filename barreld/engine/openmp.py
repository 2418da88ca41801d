"""How llama.cpp's OpenMP threads wait: set in barreld's environment before llama.cpp is loaded.

llama.cpp's CPU backend, built with OpenMP as pip builds it, meets its threads at a barrier after every
operation of a decode: hundreds of times a token. libgomp spins at a barrier for a while before it sleeps,
unless it counts more of its threads than cores. Then it spins 100 times only, and nearly every barrier
sleeps and wakes. Any second thread that ever decoded gives it that count, since each thread keeps its own
pool: the thread that loaded a model (its warm-up and exactness probe decode), or a second model's worker.
Measured here (two cores, SmolLM2): 35 ms a token that way, 10 ms with one pool or with these settings.

OMP_WAIT_POLICY=active raises that throttled spin to 1,000, which is enough for a barrier inside a decode;
GOMP_SPINCOUNT=10000 (about 0.1 ms) bounds the ordinary spin, so threads still sleep soon after a decode
ends and an idle daemon costs nothing. Neither changes a float. An operator's own setting of either wins.
"""

from __future__ import annotations

from collections.abc import MutableMapping

WAIT_DEFAULTS = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "10000"}


def set_wait_defaults(env: MutableMapping[str, str]) -> dict[str, str]:
    """Sets each of WAIT_DEFAULTS the environment lacks; returns those it set. libgomp reads them once, when
    it is loaded, so this must run before llama.cpp is imported."""
    added = {name: value for name, value in WAIT_DEFAULTS.items() if name not in env}
    env.update(added)
    return added
