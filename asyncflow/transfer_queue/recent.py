"""A set that remembers only its newest entries.

Cleared partition names are kept so that a late read says "was cleared" instead of
"unknown"; a run makes one partition per step, so the memory of them is bounded.
"""
from __future__ import annotations


class RecentSet:
    def __init__(self, maxlen: int = 10_000):
        self.maxlen = maxlen
        self._items: dict[str, None] = {}

    def add(self, item: str) -> None:
        self._items.pop(item, None)
        self._items[item] = None
        while len(self._items) > self.maxlen:
            del self._items[next(iter(self._items))]

    def discard(self, item: str) -> None:
        self._items.pop(item, None)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)
