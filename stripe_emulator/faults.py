"""Seeded fault draws and the count of every fault injected."""

from __future__ import annotations

import random

DROP_AFTER_COMMIT = "drop_after_commit"
ERROR_BEFORE_COMMIT = "error_before_commit"
ERROR_SAVED_BEFORE_COMMIT = "error_saved_before_commit"
ERROR_AFTER_COMMIT = "error_after_commit"
RATE_LIMITED = "rate_limited"

KINDS = (
    DROP_AFTER_COMMIT,
    ERROR_BEFORE_COMMIT,
    ERROR_SAVED_BEFORE_COMMIT,
    ERROR_AFTER_COMMIT,
    RATE_LIMITED,
)


class Faults:
    def __init__(self, seed: int | None) -> None:
        self.counts = dict.fromkeys(KINDS, 0)
        self.reseed(seed)

    def reseed(self, seed: int | None) -> None:
        # One generator for every draw, so a seed reproduces a run's faults.
        self._rng = random.Random(seed)

    def draw(self, kind: str, probability: float) -> bool:
        # No draw at 0: a fault left off takes nothing from the sequence, so a seed draws the
        # same faults whatever kinds are added later at 0.
        if probability <= 0:
            return False
        hit = self._rng.random() < probability
        if hit:
            self.counts[kind] += 1
        return hit
