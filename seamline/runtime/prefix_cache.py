"""Caches of finished sequences, kept for new prompts that begin as they did (a system prompt,
the earlier turns of a chat): the scheduler copies the common positions instead of computing
them. Least recently used first out, within a byte capacity counted in the buffers the caches
hold (their capacity grows in steps, so a short prompt's cache holds more than its tokens)."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

from seamline.model.cache import SequenceCache

PREFIX_CACHE_BYTES = (
    256 << 20
)  # a server's default: finished requests' KV kept for prompts that begin alike


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return len(os.path.commonprefix([a, b]))


class PrefixCache:
    def __init__(
        self, capacity_bytes: int, bytes_per_token: int, release: Callable[[SequenceCache], None]
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_per_token = bytes_per_token
        self._release = release
        self._entries: OrderedDict[int, tuple[list[int], SequenceCache, int]] = OrderedDict()
        self._next = 0

    def held_bytes(self) -> int:
        return sum(size for _, _, size in self._entries.values())

    def put(self, tokens: list[int], cache: SequenceCache, length: int) -> None:
        """Keep ``cache`` (valid for the first ``length`` of ``tokens``) if there is room for it."""
        size = max(cache.nbytes(), length * self.bytes_per_token)
        if size > self.capacity_bytes:
            self._release(cache)
            return
        self._entries[self._next] = (tokens[:length], cache, size)
        self._next += 1
        while self.held_bytes() > self.capacity_bytes:
            self.evict_oldest()

    def caches(self) -> list[SequenceCache]:
        return [cache for _, cache, _ in list(self._entries.values())]

    def evict_oldest(self) -> bool:
        """Free the least recently used entry; False when there is none."""
        if not self._entries:
            return False
        _, (_, cache, _) = self._entries.popitem(last=False)
        self._release(cache)
        return True

    def best(self, tokens: list[int]) -> tuple[SequenceCache | None, int]:
        """The entry sharing the longest prefix with ``tokens``, and that length (0: none)."""
        found: tuple[SequenceCache | None, int, int] = (None, 0, -1)
        for key, (held, cache, _) in self._entries.items():
            shared = common_prefix(held, tokens)
            if shared > found[1]:
                found = (cache, shared, key)
        if found[2] >= 0:
            self._entries.move_to_end(found[2])  # used: the last to go
        return found[0], found[1]
