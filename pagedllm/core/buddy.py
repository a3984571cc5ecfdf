"""A binary buddy allocator over the block pool, for the contiguous baselines (core/policies.py).

The contiguous systems the paper compares against (Orca, FasterTransformer) give each request
one contiguous run of KV slots. A buddy allocator is the classic way to hand out contiguous
runs of a fixed pool: free memory is kept as aligned power-of-two chunks, a request takes the
smallest chunk that fits (splitting larger ones), and a freed chunk merges with its free buddy.

Runs are allocated *exactly* (Linux's ``alloc_pages_exact``): the power-of-two chunk is taken,
then its unused tail is given back at once as smaller aligned chunks. So the allocator itself
adds no internal fragmentation (a contiguous-oracle reservation stays exact), while the pool
still fragments externally as real contiguous allocators do: free slots scattered in chunks too
small for the next request.
"""

from __future__ import annotations


def order_of(size: int) -> int:
    """The smallest k with 2**k >= size (size >= 1)."""
    return max(0, (size - 1).bit_length())


class BuddyAllocator:
    """Contiguous runs of ``[0, num_units)``; units are KV blocks here."""

    def __init__(self, num_units: int) -> None:
        if num_units < 0:
            raise ValueError(f"num_units must be >= 0, got {num_units}.")
        self.num_units = num_units
        self.max_order = max(0, num_units.bit_length())
        # order -> start units of free chunks of that order (sets: O(1) buddy lookup on merge).
        self.free_lists: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self.num_free = 0
        self._free_range(0, num_units)

    # ------------------------------------------------------------------------------- queries

    def largest_free_order(self) -> int:
        for order in range(self.max_order, -1, -1):
            if self.free_lists[order]:
                return order
        return -1

    def can_allocate(self, size: int) -> bool:
        return size <= self.num_units and self.largest_free_order() >= order_of(size)

    def free_chunks(self) -> list[tuple[int, int]]:
        """Every free chunk as (start, size), sorted by start."""
        return sorted((start, 1 << order) for order, starts in enumerate(self.free_lists) for start in starts)

    def num_free_units_in_chunks_below(self, size: int) -> int:
        """Free units lying in chunks too small to hold a run of ``size`` units."""
        order = order_of(size)
        return sum(len(self.free_lists[k]) << k for k in range(min(order, self.max_order + 1)))

    # ---------------------------------------------------------------------------- allocation

    def allocate(self, size: int) -> int | None:
        """Start of a free run of exactly ``size`` units, or None when no chunk is large enough."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}.")
        order = order_of(size)
        if order > self.max_order:
            return None
        found = next((k for k in range(order, self.max_order + 1) if self.free_lists[k]), None)
        if found is None:
            return None
        start = min(self.free_lists[found])  # lowest address first: deterministic, packs the pool
        self.free_lists[found].remove(start)
        self.num_free -= 1 << found
        # Split down: the upper halves stay free.
        while found > order:
            found -= 1
            self._push(start + (1 << found), found)
        # Exact allocation: give back the tail of the power-of-two chunk.
        self._free_range(start + size, start + (1 << order))
        return start

    def free(self, start: int, size: int) -> None:
        if size < 1 or start < 0 or start + size > self.num_units:
            raise ValueError(f"bad run ({start}, {size}) for a pool of {self.num_units} units")
        self._free_range(start, start + size)

    def _free_range(self, begin: int, end: int) -> None:
        """Free [begin, end) as maximal aligned power-of-two chunks, each merged with its buddies."""
        while begin < end:
            order = (begin & -begin).bit_length() - 1 if begin else self.max_order
            while (1 << order) > end - begin:
                order -= 1
            self._free_chunk(begin, order)
            begin += 1 << order

    def _free_chunk(self, start: int, order: int) -> None:
        while order < self.max_order:
            buddy = start ^ (1 << order)
            if buddy not in self.free_lists[order]:
                break
            self.free_lists[order].remove(buddy)
            self.num_free -= 1 << order
            start = min(start, buddy)
            order += 1
        self._push(start, order)

    def _push(self, start: int, order: int) -> None:
        self.free_lists[order].add(start)
        self.num_free += 1 << order

    # ----------------------------------------------------------------------------- invariants

    def snapshot(self) -> list[set[int]]:
        """A copy of the free lists, for dry runs (restore with ``restore``)."""
        return [set(starts) for starts in self.free_lists]

    def restore(self, free_lists: list[set[int]]) -> None:
        self.free_lists = free_lists
        self.num_free = sum(len(starts) << k for k, starts in enumerate(free_lists))

    def check_invariants(self, allocated: list[tuple[int, int]]) -> None:
        """Free chunks and the given allocated runs tile the pool exactly (for tests)."""
        runs = self.free_chunks() + sorted(allocated)
        covered = [0] * self.num_units
        for start, size in runs:
            for unit in range(start, start + size):
                covered[unit] += 1
        assert all(count == 1 for count in covered), "free chunks and allocated runs overlap or leave gaps"
        for order, starts in enumerate(self.free_lists):
            assert all(start % (1 << order) == 0 for start in starts), "misaligned free chunk"
