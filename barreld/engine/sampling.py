"""Token sampling from one position's logits: greedy at temperature 0, else seeded softmax sampling."""

from __future__ import annotations

import numpy as np


class Sampler:
    """Deterministic for a given seed: the same logits and seed give the same token sequence."""

    def __init__(self, temperature: float, seed: int | None) -> None:
        if not np.isfinite(temperature) or temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature}")
        self.temperature = float(temperature)
        self._rng = np.random.default_rng(seed)

    def sample(self, logits: np.ndarray) -> int:
        if self.temperature == 0.0:
            return int(np.argmax(logits))
        scaled = logits.astype(np.float64) / self.temperature
        scaled -= scaled.max()
        probs = np.exp(scaled)
        probs /= probs.sum()
        return int(self._rng.choice(probs.shape[0], p=probs))
