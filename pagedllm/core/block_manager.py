"""The block space manager: block tables, sharing, copy-on-write, swapping, prefix caching.

It knows blocks, not policy (the scheduler decides who runs). Its vocabulary is the paper's:
a sequence's logical blocks map to physical blocks through its block table; a physical block
is allocated only when the last one is full; sequences of one request share blocks by reference
count (fork), and the first write into a shared block copies it (copy-on-write); a preempted
group's blocks can move to the CPU pool and back (swap). With prefix caching, full blocks whose
K/V are computed are kept under a chained content hash so later requests with the same prefix
map them instead of recomputing them.

What moves data is returned, never done here: ``append_slots`` returns (src, dst) copies,
``swap_out`` / ``swap_in`` return (from, to) block-id pairs; the worker executes them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedllm.core.allocator import BlockAllocator
from pagedllm.core.block import CPU, GPU, BlockTable, PhysicalBlock
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    """Whether a group's blocks can be allocated: now, after others finish, or never."""

    OK = enum.auto()
    LATER = enum.auto()
    NEVER = enum.auto()


@dataclass(slots=True)
class AllocationPlan:
    """How a group's waiting sequences would be laid out, computed without side effects.

    ``check_allocation`` returns it and ``allocate`` carries it out, so an admission is planned
    once. ``entries[s][i]`` is a cached PhysicalBlock (a prefix-cache hit) or an int: the index
    of a fresh block, shared by every sequence whose prefix up to that block is the same.
    """

    status: AllocStatus
    num_blocks: int  # distinct blocks the group's waiting sequences need (cache hits included)
    num_tokens: int  # tokens their prefill computes: all minus prefix-cache hits
    seqs: list[Sequence]
    entries: list[list[PhysicalBlock | int]]
    num_hit_blocks: list[int]
    num_new_blocks: int
    hit_blocks: dict[int, PhysicalBlock]  # distinct hits by block id

    @property
    def num_blocks_from_free_pool(self) -> int:
        # A hit on a block nobody uses takes it out of the evictable (= free) set.
        return self.num_new_blocks + sum(block.ref_count == 0 for block in self.hit_blocks.values())


def _write_end(seq: Sequence) -> int:
    """One past the last position written this step: the tokens, then this step's draft tokens."""
    return seq.get_len() + len(seq.spec_token_ids)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockSpaceManager:
    """Maps sequences to physical blocks in the device pool and the CPU swap pool."""

    def __init__(
        self,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}.")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}.")
        self.block_size = block_size
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        # Every attention layer reads only the last sliding_window positions: blocks wholly before
        # that are released as a sequence grows.
        self.sliding_window = sliding_window
        # Admission keeps this many blocks free so running sequences can grow without an
        # immediate preemption (vLLM's watermark).
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        # The paper bounds swap space by the device pool: never hold more swapped blocks than that.
        self.swap_capacity = min(num_cpu_blocks, num_gpu_blocks)
        self.gpu_allocator = BlockAllocator(GPU, num_gpu_blocks, enable_prefix_caching=enable_prefix_caching)
        self.cpu_allocator = BlockAllocator(CPU, num_cpu_blocks)
        self.block_tables: dict[int, BlockTable] = {}
        # Statistics (cumulative).
        self.num_cow_copies = 0
        self.num_blocks_swapped_out = 0
        self.num_blocks_swapped_in = 0
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # ------------------------------------------------------------------------------ allocation

    def _allocator(self, block: PhysicalBlock) -> BlockAllocator:
        return self.gpu_allocator if block.device == GPU else self.cpu_allocator

    def _block_hashes(self, seq: Sequence) -> list[int]:
        """The chained hashes of the sequence's full blocks, extending ``seq.block_hashes`` with
        the blocks filled since the last call (each full block is hashed once in its life)."""
        hashes = seq.block_hashes
        num_full = seq.get_len() // self.block_size
        hash_fn = self.gpu_allocator.hash_fn
        while len(hashes) < num_full:
            parent = hashes[-1] if hashes else None
            hashes.append(hash_fn(parent, self._block_tokens(seq, len(hashes))))
        return hashes

    def check_allocation(self, seq_group: SequenceGroup) -> AllocationPlan:
        """Plan the group's waiting sequences: cache hits first, then shared fresh blocks.

        The plan's ``status`` is OK if they fit now (keeping the watermark), LATER if they will
        fit once others free blocks, NEVER if they need more blocks than the whole pool.

        A fresh request's sequences are identical, so they share every block (the last, partial
        one included; copy-on-write separates them at the first divergent write). After a
        recompute preemption the sequences differ, and they share exactly the blocks whose whole
        prefix is the same: the key of a block is (identity of the previous block, own tokens).
        """
        bs = self.block_size
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        entries: list[list[PhysicalBlock | int]] = []
        num_hit_blocks: list[int] = []
        hit_blocks: dict[int, PhysicalBlock] = {}
        fresh_by_key: dict[tuple, int] = {}
        num_new = 0
        num_tokens = 0
        for seq in seqs:
            seq_len = seq.get_len()
            num_blocks = _cdiv(seq_len, bs)
            seq_entries: list[PhysicalBlock | int] = []
            prev_key: tuple | None = None
            # prompt_logprobs (and mean or CLS pooling) need every prompt position: computed, never read
            # from the cache.
            if self.enable_prefix_caching and not seq_group.reads_every_prompt_position():
                hashes = self._block_hashes(seq)
                # At least the last token is always computed: its logits are needed to sample.
                max_hits = (seq_len - 1) // bs
                parent_content_id: int | None = None
                for i in range(max_hits):
                    block = self.gpu_allocator.lookup(hashes[i], parent_content_id, self._block_tokens(seq, i))
                    if block is None:
                        break
                    parent_content_id = block.content_id
                    seq_entries.append(block)
                    hit_blocks[block.block_id] = block
                    prev_key = ("hit", block.block_id)
            num_hit_blocks.append(len(seq_entries))
            num_tokens += seq_len - len(seq_entries) * bs
            for i in range(len(seq_entries), num_blocks):
                key = (prev_key, self._block_tokens(seq, i))
                index = fresh_by_key.get(key)
                if index is None:
                    index = fresh_by_key[key] = num_new
                    num_new += 1
                seq_entries.append(index)
                prev_key = ("new", index)
            entries.append(seq_entries)
        plan = AllocationPlan(AllocStatus.OK, num_new + len(hit_blocks), num_tokens, seqs, entries, num_hit_blocks,
                              num_new, hit_blocks)
        plan.status = self._status(plan.num_blocks_from_free_pool, plan.num_blocks)
        return plan

    def _status(self, num_required: int, num_distinct: int) -> AllocStatus:
        if num_distinct > self.num_gpu_blocks:
            return AllocStatus.NEVER
        num_free = self.gpu_allocator.get_num_free_blocks()
        if num_free - num_required >= self.watermark_blocks:
            return AllocStatus.OK
        # The watermark protects running sequences; with none running it would only block a
        # large request forever.
        if num_free == self.num_gpu_blocks and num_required <= num_free:
            return AllocStatus.OK
        return AllocStatus.LATER

    def can_allocate(self, seq_group: SequenceGroup) -> AllocStatus:
        return self.check_allocation(seq_group).status

    def allocate(self, seq_group: SequenceGroup, plan: AllocationPlan | None = None) -> None:
        """Give every waiting sequence of the group its blocks, as ``plan`` (from check_allocation,
        with nothing allocated or freed since) lays them out; sets num_computed_tokens to the
        number of tokens whose K/V came from the prefix cache (block-aligned, < its length)."""
        if plan is None:
            plan = self.check_allocation(seq_group)
        if plan.num_blocks_from_free_pool > self.gpu_allocator.get_num_free_blocks():
            raise RuntimeError(f"allocate({seq_group.request_id}) without room: check can_allocate first")
        for seq in plan.seqs:
            if seq.seq_id in self.block_tables:
                raise RuntimeError(f"sequence {seq.seq_id} already has blocks")
        # Claim the hits before taking fresh blocks, so fresh allocation cannot evict them.
        for seq_entries in plan.entries:
            for entry in seq_entries:
                if isinstance(entry, PhysicalBlock):
                    self.gpu_allocator.incref(entry)
        fresh = [self.gpu_allocator.allocate() for _ in range(plan.num_new_blocks)]
        taken = [False] * plan.num_new_blocks  # allocate() already gave each its first reference
        for seq, seq_entries, num_hits in zip(plan.seqs, plan.entries, plan.num_hit_blocks):
            table = BlockTable()
            for entry in seq_entries:
                if isinstance(entry, PhysicalBlock):
                    table.append(entry)
                    continue
                block = fresh[entry]
                if taken[entry]:
                    self.gpu_allocator.incref(block)
                taken[entry] = True
                table.append(block)
            if num_hits:
                table.num_promoted = num_hits
                table.chain_content_id = table[num_hits - 1].content_id
            self.block_tables[seq.seq_id] = table
            seq.num_computed_tokens = num_hits * self.block_size
            if self.enable_prefix_caching:
                self.prefix_cache_queried_tokens += seq.get_len()
                self.prefix_cache_hit_tokens += seq.num_computed_tokens

    # ------------------------------------------------------------------ growth and copy-on-write

    def _num_blocks_to_append(self, seqs: list[Sequence]) -> int:
        """Fresh blocks needed so each sequence can write tokens [num_computed_tokens, len).

        A new block when the table is too short, plus copy-on-write for shared blocks written
        to. A block shared by k writers among r holders needs min(k, r - 1) copies: the last
        holder writes in place.
        """
        bs = self.block_size
        num_needed = 0
        writers: dict[int, list] = {}
        for seq in seqs:
            table = self.block_tables[seq.seq_id]
            num_blocks = _cdiv(_write_end(seq), bs)
            num_needed += max(0, num_blocks - len(table))
            for i in range(seq.num_computed_tokens // bs, min(len(table), num_blocks)):
                block = table[i]
                if block.ref_count > 1:
                    entry = writers.setdefault(id(block), [block, 0])
                    entry[1] += 1
        for block, num_writers in writers.values():
            num_needed += min(num_writers, block.ref_count - 1)
        return num_needed

    def can_append_slots(self, seq_group: SequenceGroup) -> bool:
        """Whether every running sequence of the group can get slots for its new token(s)."""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return self._num_blocks_to_append(seqs) <= self.gpu_allocator.get_num_free_blocks()

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make room for tokens [num_computed_tokens, len) of ``seq``; returns (src, dst) copies.

        A new block is allocated only when the last one is full. A shared block about to be
        written is copied first (copy-on-write): the sequence gets a private copy, the others
        keep the original, and the worker must copy src to dst before this step's writes.
        """
        table = self.block_tables[seq.seq_id]
        bs = self.block_size
        if self.sliding_window is not None:
            # This step's first query sits at num_computed_tokens and reads keys from
            # num_computed_tokens - window + 1 on; later steps read later keys only.
            first_needed = max(0, seq.num_computed_tokens - self.sliding_window + 1)
            for block in table.drop_front(first_needed // bs):
                self.gpu_allocator.free(block)
        num_blocks = _cdiv(_write_end(seq), bs)
        copies: list[tuple[int, int]] = []
        for i in range(seq.num_computed_tokens // bs, min(len(table), num_blocks)):
            block = table[i]
            if block.ref_count > 1:
                # Full blocks are never written, so a block copied here is never a cached one.
                new_block = self.gpu_allocator.allocate()
                self.gpu_allocator.free(block)
                table[i] = new_block
                copies.append((block.block_id, new_block.block_id))
                self.num_cow_copies += 1
        while len(table) < num_blocks:
            table.append(self.gpu_allocator.allocate())
        return copies

    def release_lookahead(self, seq: Sequence) -> None:
        """Free the blocks past the sequence's tokens: those only rejected draft tokens were written
        to (speculative decoding). They were allocated fresh for this sequence (never shared, never
        hashed: only computed full blocks of real tokens are), so they simply return to the pool."""
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return
        keep = _cdiv(seq.get_len(), self.block_size)  # logical blocks, as len(table) counts them
        while len(table) > keep and table.blocks:
            self.gpu_allocator.free(table.blocks.pop())

    def fork(self, parent_seq: Sequence, child_seq: Sequence) -> None:
        """The child shares every block of the parent (one more reference each)."""
        if child_seq.seq_id in self.block_tables:
            raise RuntimeError(f"sequence {child_seq.seq_id} already has blocks")
        table = self.block_tables[parent_seq.seq_id].copy()
        for block in table:
            self._allocator(block).incref(block)
        self.block_tables[child_seq.seq_id] = table

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references (a no-op if it holds none)."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
        # Last block first: the prefix blocks, more likely to be shared again, become the most
        # recently used ones in the LRU queue and are evicted last.
        for block in reversed(table.blocks):
            self._allocator(block).free(block)

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def get_block_table(self, seq: Sequence) -> list[int]:
        return self.block_tables[seq.seq_id].block_ids()

    # ---------------------------------------------------------------------------- prefix cache

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        """Tokens of one full block, sliced without concatenating the whole sequence."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        prompt = seq.prompt_token_ids
        num_prompt = len(prompt)
        if end <= num_prompt:
            return tuple(prompt[start:end])
        output = seq.output_token_ids
        if start >= num_prompt:
            return tuple(output[start - num_prompt : end - num_prompt])
        return tuple(prompt[start:]) + tuple(output[: end - num_prompt])

    def mark_computed(self, seq: Sequence) -> None:
        """Offer the sequence's newly full, computed blocks to the prefix cache.

        Called after each step, once ``seq.num_computed_tokens`` covers what the step wrote
        (a prompt chunk's full blocks are offered as soon as they are computed). Only from then
        on can another request hit these blocks: a block must never be a hit before its K/V exist.
        """
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if table is None or table.chain_broken:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(table))
        if table.num_promoted < table.num_dropped:
            table.chain_broken = True  # released before being offered: later blocks cannot chain
            return
        if table.num_promoted >= num_full:
            return
        hashes = self._block_hashes(seq)
        for i in range(table.num_promoted, num_full):
            block = table[i]
            if block.device != GPU:
                return
            if block.is_cached:
                # A prefix hit, or promoted already through a sequence sharing it.
                content_id = block.content_id
            else:
                content_id = self.gpu_allocator.promote(
                    block, hashes[i], table.chain_content_id, self._block_tokens(seq, i)
                )
                if content_id is None:
                    table.chain_broken = True
                    return
            table.chain_content_id = content_id
            table.num_promoted = i + 1

    # ---------------------------------------------------------------------------------- swapping

    def _distinct_blocks(self, seqs: list[Sequence]) -> dict[int, PhysicalBlock]:
        blocks: dict[int, PhysicalBlock] = {}
        for seq in seqs:
            for block in self.block_tables[seq.seq_id]:
                blocks[block.block_id] = block
        return blocks

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        num_blocks = len(self._distinct_blocks(seq_group.get_seqs(SequenceStatus.RUNNING)))
        num_swapped = self.cpu_allocator.num_used
        return num_blocks <= self.cpu_allocator.get_num_free_blocks() and num_swapped + num_blocks <= self.swap_capacity

    def swap_out(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's running sequences to the CPU pool; returns (gpu, cpu) block pairs.

        A block shared by several sequences moves once and stays shared. The caller sets the
        sequences' status to SWAPPED. The worker must copy before the freed device blocks are
        written again (i.e. at the start of the step, before copies and the forward pass).
        """
        mapping: dict[int, PhysicalBlock] = {}
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            table = self.block_tables[seq.seq_id]
            moved: list[PhysicalBlock] = []
            for gpu_block in table.blocks:
                cpu_block = mapping.get(gpu_block.block_id)
                if cpu_block is None:
                    cpu_block = mapping[gpu_block.block_id] = self.cpu_allocator.allocate()
                else:
                    self.cpu_allocator.incref(cpu_block)
                # A cached block keeps its content on the device and stays a prefix-cache entry.
                self.gpu_allocator.free(gpu_block)
                moved.append(cpu_block)
            table.blocks = moved
        self.num_blocks_swapped_out += len(mapping)
        return [(gpu_id, cpu_block.block_id) for gpu_id, cpu_block in mapping.items()]

    def can_swap_in(self, seq_group: SequenceGroup) -> AllocStatus:
        """Room for the group's swapped blocks plus the blocks its next decode step appends."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        num_blocks = len(self._distinct_blocks(seqs))
        num_required = num_blocks + self._num_blocks_to_append(seqs)
        return self._status(num_required, num_required)

    def swap_in(self, seq_group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's swapped sequences back to the device pool; returns (cpu, gpu) pairs.

        The caller sets the sequences' status to RUNNING (and then appends slots as usual).
        """
        mapping: dict[int, PhysicalBlock] = {}
        for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
            table = self.block_tables[seq.seq_id]
            moved: list[PhysicalBlock] = []
            for cpu_block in table.blocks:
                gpu_block = mapping.get(cpu_block.block_id)
                if gpu_block is None:
                    gpu_block = mapping[cpu_block.block_id] = self.gpu_allocator.allocate()
                else:
                    self.gpu_allocator.incref(gpu_block)
                self.cpu_allocator.free(cpu_block)
                moved.append(gpu_block)
            table.blocks = moved
        self.num_blocks_swapped_in += len(mapping)
        return [(cpu_id, gpu_block.block_id) for cpu_id, gpu_block in mapping.items()]

    # ------------------------------------------------------------------------------- statistics

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    # --------------------------------------------------------- accounting (core/waste.py, Figure 2)

    def num_used_blocks(self) -> int:
        """Device blocks some sequence holds."""
        return self.gpu_allocator.num_used

    def slot_usage(self, seqs: list[Sequence]) -> list[tuple[int, int, int]]:
        """Per sequence that may hold empty slots: (seq_id, tokens now, slots allocated).

        Only the last block of a paged sequence can be partly empty; a last block shared by
        several sequences is listed once, for the first of them.
        """
        usage: list[tuple[int, int, int]] = []
        seen_last_blocks: set[int] = set()
        for seq in seqs:
            table = self.block_tables.get(seq.seq_id)
            if not table or table[-1].device != GPU or table[-1].block_id in seen_last_blocks:
                continue
            seen_last_blocks.add(table[-1].block_id)
            # Blocks released outside a sliding window hold neither tokens nor slots.
            slots = len(table.blocks) * self.block_size
            usage.append((seq.seq_id, min(seq.get_len() - table.num_dropped * self.block_size, slots), slots))
        return usage

    def num_spare_blocks(self) -> int:
        """Blocks held for sequences that do not exist yet: none, paging allocates on demand."""
        return 0

    def num_unusable_free_blocks(self, seq_group: SequenceGroup) -> int:
        """Free blocks ``seq_group`` could not use (external fragmentation): none, any block serves."""
        return 0

    def get_stats(self) -> dict:
        """Counters for logs and benchmarks.

        Prefix-cache queries and hits are in tokens: every token of every sequence allocated
        with prefix caching on is a query; a hit is a token whose K/V came from the cache.
        ``blocks_saved_by_sharing`` = sum of live block-table lengths - distinct blocks in use.
        """
        gpu, cpu = self.gpu_allocator, self.cpu_allocator
        queried = self.prefix_cache_queried_tokens
        return {
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": self.num_cpu_blocks,
            "gpu_blocks_used": gpu.num_used,
            "gpu_blocks_free": gpu.get_num_free_blocks(),
            "gpu_blocks_shared": gpu.num_shared,
            "gpu_blocks_cached": gpu.get_num_cached_blocks(),
            "gpu_blocks_evictable": gpu.get_num_evictable_blocks(),
            "cpu_blocks_used": cpu.num_used,
            "blocks_saved_by_sharing": (gpu.total_refs - gpu.num_used) + (cpu.total_refs - cpu.num_used),
            "num_cow_copies": self.num_cow_copies,
            "num_blocks_swapped_out": self.num_blocks_swapped_out,
            "num_blocks_swapped_in": self.num_blocks_swapped_in,
            "prefix_cache_queried_tokens": queried,
            "prefix_cache_hit_tokens": self.prefix_cache_hit_tokens,
            "prefix_cache_hit_rate": self.prefix_cache_hit_tokens / queried if queried else 0.0,
            "prefix_cache_evictions": gpu.num_evictions,
            "prefix_cache_hash_collisions": gpu.num_hash_collisions,
        }

    # ------------------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if tables and pools disagree (for tests)."""
        self.gpu_allocator.check_invariants()
        self.cpu_allocator.check_invariants()
        refs = {GPU: 0, CPU: 0}
        for seq_id, table in self.block_tables.items():
            devices = {block.device for block in table}
            assert len(devices) <= 1, f"sequence {seq_id} has blocks in both pools"
            assert len({id(block) for block in table}) == len(table.blocks), f"sequence {seq_id} maps a block twice"
            for block in table:
                assert block.ref_count > 0, f"sequence {seq_id} maps freed {block}"
                refs[block.device] += 1
            assert table.num_promoted <= len(table)
        assert refs[GPU] == self.gpu_allocator.total_refs, "device refs != device table entries"
        assert refs[CPU] == self.cpu_allocator.total_refs, "cpu refs != cpu table entries"

    def all_free(self) -> bool:
        """True when no sequence holds a block and every ref count is zero."""
        blocks = self.gpu_allocator.blocks + self.cpu_allocator.blocks
        return (
            not self.block_tables
            and self.gpu_allocator.all_free()
            and self.cpu_allocator.all_free()
            and all(block.ref_count == 0 for block in blocks)
        )
