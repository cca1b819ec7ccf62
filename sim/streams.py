"""Named random streams: one seeded `numpy.random.Generator` per random input.

A stream is derived from the root seed and its name (plus optional integer keys, e.g. a request
index), never from the order in which other streams were drawn. Adding a random input, or
changing how often another one draws, leaves every other stream's numbers unchanged, and two
configurations with the same seed see the same arrivals, sizes and acceptance outcomes for the
same request (common random numbers make study comparisons sharper).
"""

from __future__ import annotations

import zlib

import numpy as np


class RandomStreams:
    def __init__(self, seed: int):
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.seed = int(seed)

    def stream(self, name: str, *keys: int) -> np.random.Generator:
        """The Generator of random input `name` (and sub-stream `keys`), fresh each call."""
        # crc32 is a stable name hash (Python's hash() is salted per process).
        spawn_key = (zlib.crc32(name.encode("utf-8")),) + tuple(int(k) for k in keys)
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=spawn_key))
