"""Host-side bookkeeping of the device pools: KV pages and GDN slots. Index 0 of each pool is the dummy that
padding rows point at, so it is never handed out."""

from __future__ import annotations

import collections


class IndexPool:
    """A free list over indices 1..size-1. Lowest indices are handed out first, so a lone request always lands
    on the same slot and pages (handy when reading traces; exactness does not depend on it).

    An index may have several holders (`share`: a kept prompt prefix and the streams resumed from it read the same
    KV pages); it is free again when the last of them gives it back."""

    def __init__(self, size: int, what: str):
        if size < 2:
            raise ValueError(f"{what}: need at least 2 (index 0 is the dummy), got {size}")
        self.what = what
        self.total = size - 1
        self._free = list(range(size - 1, 0, -1))
        self._held: dict[int, int] = {}  # index -> holders

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int] | None:
        """n indices, or None (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        got = [self._free.pop() for _ in range(n)]
        for i in got:
            self._held[i] = 1
        return got

    def share(self, indices: list[int]) -> None:
        """One more holder for each of `indices` (each already held)."""
        for i in indices:
            if i not in self._held:
                raise AssertionError(f"{self.what}: index {i} shared but not held")
        for i in indices:
            self._held[i] += 1

    def holders(self, i: int) -> int:
        return self._held.get(i, 0)

    def give_back(self, indices: list[int]) -> None:
        for i, n in collections.Counter(indices).items():
            if self._held.get(i, 0) < n:
                raise AssertionError(f"{self.what}: index {i} returned twice or never taken")
        freed = []
        for i in indices:
            self._held[i] -= 1
            if not self._held[i]:
                del self._held[i]
                freed.append(i)
        self._free.extend(freed)
        self._free.sort(reverse=True)
