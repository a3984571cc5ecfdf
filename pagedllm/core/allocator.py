"""Block allocators: a free list per pool, and the prefix cache of the device pool.

Every operation is O(1) per block: the free list is a stack, the evictable cached blocks sit in
an OrderedDict used as an LRU queue, and the cache is a dict keyed by the chained block hash.

Prefix caching (vLLM v1's block pool, in small): a full block whose K/V are computed is
identified by ``hash((parent_hash, token_ids))``, so one hash names the whole prefix up to and
including that block. When its last user frees it, the block is *not* wiped: it stays in the
cache with ref_count 0, in LRU order, and is only evicted when a fresh block is needed and the
plain free list is empty. A hash hit is always verified (the block's own tokens and the identity
of its parent's cache entry), so a hash collision can cost a cache miss but never wrong output.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pagedllm.core.block import PhysicalBlock

HashFn = Callable[[int | None, tuple[int, ...]], int]


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block: it depends on every token before it, via the parent."""
    return hash((parent_hash, token_ids))


class NoFreeBlocksError(RuntimeError):
    """Raised when a block is requested from an exhausted pool (a scheduler bug: it must check first)."""


class BlockAllocator:
    """The blocks of one pool (device or CPU swap space)."""

    def __init__(self, device: str, num_blocks: int, enable_prefix_caching: bool = False) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}.")
        self.device = device
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [PhysicalBlock(block_id=i, device=device) for i in range(num_blocks)]
        # Reversed so that pop() hands out low ids first: easier to read in tests and logs.
        self._free: list[PhysicalBlock] = list(reversed(self.blocks))
        # Cached blocks nobody references, least recently used first. They count as free.
        self._evictable: OrderedDict[int, PhysicalBlock] = OrderedDict()
        # Chained hash -> the cached block holding that content.
        self._cached: dict[int, PhysicalBlock] = {}
        self.hash_fn: HashFn = hash_block_tokens  # replaceable, so tests can force collisions
        self._next_content_id = 0
        # Kept up to date on every reference change so statistics are O(1).
        self.num_used = 0  # blocks with ref_count > 0
        self.num_shared = 0  # blocks with ref_count > 1
        self.total_refs = 0  # sum of ref counts = sum of block-table lengths that point here
        self.num_evictions = 0
        self.num_hash_collisions = 0

    # ---------------------------------------------------------------- allocation and references

    def get_num_free_blocks(self) -> int:
        """Blocks a fresh allocation can get: never-used ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def get_num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def allocate(self) -> PhysicalBlock:
        """A fresh, private block (ref_count 1), evicting the least recently used cached one if needed."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            # Lazy eviction: cached content is kept until its slot is really needed.
            _, block = self._evictable.popitem(last=False)
            self._uncache(block)
            self.num_evictions += 1
        else:
            raise NoFreeBlocksError(f"out of {self.device} blocks ({self.num_blocks} in the pool)")
        self._incref(block)
        return block

    def incref(self, block: PhysicalBlock) -> None:
        """One more user of ``block``; a cached block with no users stops being evictable."""
        if block.ref_count == 0:
            if block.block_id not in self._evictable:
                raise ValueError(f"{block} is free: only cached blocks can be revived by incref")
            del self._evictable[block.block_id]
        self._incref(block)

    def free(self, block: PhysicalBlock) -> None:
        """One user fewer; at zero the block returns to the pool (cached ones stay reusable)."""
        if block.ref_count <= 0:
            raise ValueError(f"double free of {block}")
        block.ref_count -= 1
        self.total_refs -= 1
        if block.ref_count == 1:
            self.num_shared -= 1
        elif block.ref_count == 0:
            self.num_used -= 1
            if block.is_cached:
                self._evictable[block.block_id] = block  # newest at the end: evicted last
            else:
                self._free.append(block)

    def _incref(self, block: PhysicalBlock) -> None:
        block.ref_count += 1
        self.total_refs += 1
        if block.ref_count == 1:
            self.num_used += 1
        elif block.ref_count == 2:
            self.num_shared += 1

    # ---------------------------------------------------------------------------- prefix cache

    def lookup(
        self, block_hash: int, parent_content_id: int | None, token_ids: tuple[int, ...]
    ) -> PhysicalBlock | None:
        """The cached block holding exactly this prefix, or None.

        ``block_hash`` is the block's chained hash; ``parent_content_id`` the cache entry of the
        previous block of the prefix (None for the first block). Does not take a reference: the
        caller does, with incref.
        """
        block = self._cached.get(block_hash)
        if block is None:
            return None
        if block.token_ids != token_ids or block.parent_content_id != parent_content_id:
            return None  # a collision (or a stale chain): a miss, never a wrong hit
        return block

    def promote(
        self,
        block: PhysicalBlock,
        block_hash: int,
        parent_content_id: int | None,
        token_ids: tuple[int, ...],
    ) -> int | None:
        """Offer a full, computed block to the cache under its chained hash.

        Returns the content_id of the cache entry that now stands for this prefix (this block's
        new entry, or an existing block with the same content computed by another sequence), or
        None when a *different* prefix already owns the hash (a collision): the block then stays
        uncached, and so must every later block of the sequence.
        """
        existing = self._cached.get(block_hash)
        if existing is not None:
            if existing.token_ids == token_ids and existing.parent_content_id == parent_content_id:
                return existing.content_id  # a duplicate: same content, first one wins
            self.num_hash_collisions += 1
            return None
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_content_id = parent_content_id
        block.content_id = self._next_content_id
        self._next_content_id += 1
        self._cached[block_hash] = block
        return block.content_id

    def _uncache(self, block: PhysicalBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.clear_cache_info()

    def get_num_cached_blocks(self) -> int:
        return len(self._cached)

    # ------------------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests; O(num_blocks))."""
        free_ids = {block.block_id for block in self._free}
        assert len(free_ids) == len(self._free), "a block is twice in the free list"
        assert not free_ids & self._evictable.keys(), "a block is both free and evictable"
        for block in self._free:
            assert block.ref_count == 0 and not block.is_cached, f"bad free block {block}"
        for block in self._evictable.values():
            assert block.ref_count == 0 and block.is_cached, f"bad evictable block {block}"
        used = [block for block in self.blocks if block.ref_count > 0]
        assert all(block.ref_count >= 0 for block in self.blocks), "negative ref count"
        assert len(used) == self.num_used, "num_used out of sync"
        assert len(used) + self.get_num_free_blocks() == self.num_blocks, "free + used != total"
        assert sum(block.ref_count for block in used) == self.total_refs, "total_refs out of sync"
        assert sum(block.ref_count > 1 for block in used) == self.num_shared, "num_shared out of sync"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash and block.is_cached, f"stale cache entry {block}"
        cached_blocks = sum(block.is_cached for block in self.blocks)
        assert cached_blocks == len(self._cached), "a cached block is missing from the index"

    def all_free(self) -> bool:
        """True when nothing references any block (cached content may remain, evictable)."""
        return self.num_used == 0 and self.total_refs == 0 and self.get_num_free_blocks() == self.num_blocks
