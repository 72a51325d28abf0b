"""A mapping that keeps only its most recently used entries: the layer tables per input
size (capture/table.py) and the compiled graphs' bookkeeping of keys and layer sets
(engine/compiled.py), all of which clients choose."""

from __future__ import annotations

import collections


class Recent:
    """A mapping of at most `limit` entries: reading or writing one makes it the most
    recent, and the least recent is forgotten when a new one would exceed the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._d: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, default=None):
        if key not in self._d:
            return default
        self._d.move_to_end(key)
        return self._d[key]

    def __setitem__(self, key, value) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.limit:
            self._d.popitem(last=False)

    def pop(self, key, default=None):
        return self._d.pop(key, default)

    def __len__(self) -> int:
        return len(self._d)
