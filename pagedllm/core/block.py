"""Physical blocks and block tables: the page frames and page tables of the KV cache.

A sequence sees *logical* blocks, filled left to right; its BlockTable maps logical block i to a
PhysicalBlock anywhere in the pool. Blocks are reference-counted so that sequences can share
them (parallel sampling, beam search, shared prefixes); a write into a shared block is preceded
by a copy (copy-on-write), which the block manager arranges.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GPU = "gpu"  # the device pool (the accelerator, or plain memory on a CPU-only machine)
CPU = "cpu"  # the swap pool in host memory


@dataclass(slots=True, eq=False)
class PhysicalBlock:
    """One block of ``block_size`` token slots in one pool.

    The prefix-cache fields are set only on device blocks that are full and whose K/V have been
    computed: such a block may be handed to any later sequence with the same token prefix.
    ``eq=False``: blocks compare by identity, two blocks are never "equal".
    """

    block_id: int
    device: str = GPU
    ref_count: int = 0
    # Chained content hash hash((parent_hash, token_ids)); None while the block is not cached.
    block_hash: int | None = None
    # The block's own tokens, kept so that a hash hit is verified exactly (hashes can collide).
    token_ids: tuple[int, ...] | None = None
    # A unique id of this cache entry (never reused) and the one of its parent block. Checking
    # the parent's entry id on a hit verifies the whole prefix chain, not just this block's tokens:
    # a recycled parent block gets a new entry id, so stale children can never match.
    content_id: int | None = None
    parent_content_id: int | None = None

    @property
    def is_cached(self) -> bool:
        return self.content_id is not None

    def clear_cache_info(self) -> None:
        self.block_hash = None
        self.token_ids = None
        self.content_id = None
        self.parent_content_id = None

    def __repr__(self) -> str:
        cached = f", cached={self.content_id}" if self.content_id is not None else ""
        return f"PhysicalBlock({self.device}:{self.block_id}, ref={self.ref_count}{cached})"


@dataclass(slots=True)
class BlockTable:
    """The blocks of one sequence, in logical order, plus its prefix-cache progress.

    ``num_dropped`` counts leading logical blocks released because no attention layer reads them
    any more (sliding windows): they hold no physical block, and their ids read as 0.
    ``num_promoted`` counts leading blocks already considered for the prefix cache, so that
    ``mark_computed`` is O(new blocks) per step rather than O(sequence length).
    ``chain_content_id`` is the cache entry of the last promoted block: the parent of the next
    block to promote (the blocks' hashes are kept on the sequence). ``chain_broken`` stops
    promotion after a block could not be cached (a hash collision), because every later
    block's identity depends on it.
    """

    blocks: list[PhysicalBlock] = field(default_factory=list)  # the held blocks, from logical num_dropped on
    num_dropped: int = 0
    num_promoted: int = 0
    chain_content_id: int | None = None
    chain_broken: bool = False

    def __len__(self) -> int:
        """The number of logical blocks, released ones included."""
        return self.num_dropped + len(self.blocks)

    def _held_index(self, index: int) -> int:
        if index < 0:
            index += len(self)
        if index < self.num_dropped:
            raise IndexError(f"logical block {index} was released (outside every sliding window)")
        return index - self.num_dropped

    def __getitem__(self, index: int) -> PhysicalBlock:
        return self.blocks[self._held_index(index)]

    def __setitem__(self, index: int, block: PhysicalBlock) -> None:
        self.blocks[self._held_index(index)] = block

    def __iter__(self):
        return iter(self.blocks)

    def append(self, block: PhysicalBlock) -> None:
        self.blocks.append(block)

    def block_ids(self) -> list[int]:
        return [0] * self.num_dropped + [block.block_id for block in self.blocks]

    def drop_front(self, num_logical: int) -> list[PhysicalBlock]:
        """Release the logical blocks before ``num_logical``; returns the blocks to free."""
        count = max(0, num_logical - self.num_dropped)
        released, self.blocks = self.blocks[:count], self.blocks[count:]
        self.num_dropped += len(released)
        return released

    def copy(self) -> BlockTable:
        """Same physical blocks (the caller takes the extra references), own list."""
        return BlockTable(
            blocks=list(self.blocks),
            num_dropped=self.num_dropped,
            num_promoted=self.num_promoted,
            chain_content_id=self.chain_content_id,
            chain_broken=self.chain_broken,
        )
