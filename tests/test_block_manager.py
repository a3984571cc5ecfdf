"""Block manager and allocator: allocation, growth, fork / copy-on-write, swap, prefix caching.

A FakeKV plays the worker: it executes the returned copies and swaps on a simulated cache in
which the "K/V" of position p is the tuple of tokens [0, p] (what real K/V depend on). Reading a
sequence back through its block table must give exactly its own prefixes, so any wrong sharing,
missed copy-on-write, bad swap or false prefix hit shows up as a content mismatch.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedllm.core import GPU, AllocStatus, BlockAllocator, BlockSpaceManager, NoFreeBlocksError
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup, SequenceStatus

BS = 4


def make_group(request_id: str, tokens: list[int], n: int = 1, first_seq_id: int = 0, bs: int = BS) -> SequenceGroup:
    seqs = [Sequence(first_seq_id + i, tokens, bs) for i in range(n)]
    return SequenceGroup(request_id, seqs, SamplingParams(n=n, max_tokens=1000), arrival_time=0.0)


class FakeKV:
    """Simulated device and CPU caches: slot contents are token prefixes."""

    def __init__(self, bm: BlockSpaceManager) -> None:
        self.bm = bm
        self.memory: dict[str, dict[int, list]] = {"gpu": {}, "cpu": {}}

    def _block(self, device: str, block_id: int) -> list:
        return self.memory[device].setdefault(block_id, [None] * self.bm.block_size)

    def apply(self, swap_out=(), swap_in=(), copies=()) -> None:
        # The worker's order: swap out, swap in, copy; then the forward pass writes.
        for gpu_id, cpu_id in swap_out:
            self.memory["cpu"][cpu_id] = list(self._block("gpu", gpu_id))
        for cpu_id, gpu_id in swap_in:
            self.memory["gpu"][gpu_id] = list(self._block("cpu", cpu_id))
        for src, dst in copies:
            self.memory["gpu"][dst] = list(self._block("gpu", src))

    def write(self, seq: Sequence) -> None:
        """The forward pass: writes K/V of tokens [num_computed_tokens, len)."""
        table = self.bm.block_tables[seq.seq_id]
        tokens = seq.get_token_ids()
        bs = self.bm.block_size
        for pos in range(seq.num_computed_tokens, seq.get_len()):
            block = table[pos // bs]
            assert block.device == GPU
            self._block(GPU, block.block_id)[pos % bs] = tuple(tokens[: pos + 1])

    def check(self, seq: Sequence, upto: int | None = None) -> None:
        """Every cached position of the sequence holds its own prefix."""
        table = self.bm.block_tables[seq.seq_id]
        tokens = seq.get_token_ids()
        bs = self.bm.block_size
        upto = seq.num_computed_tokens if upto is None else upto
        assert len(table) * bs >= upto
        for pos in range(upto):
            block = table[pos // bs]
            got = self._block(block.device, block.block_id)[pos % bs]
            assert got == tuple(tokens[: pos + 1]), f"seq {seq.seq_id} pos {pos}: wrong K/V in {block}"


def run_step(bm: BlockSpaceManager, kv: FakeKV, seq: Sequence, next_token: int, copies=()) -> None:
    """What worker + engine do for one scheduled sequence."""
    kv.apply(copies=copies)
    kv.write(seq)
    seq.num_computed_tokens = seq.get_len()
    bm.mark_computed(seq)
    kv.check(seq)
    seq.append_token(next_token, 0.0)


def prefill(bm: BlockSpaceManager, kv: FakeKV, group: SequenceGroup, next_token: int = 99) -> None:
    assert bm.can_allocate(group) == AllocStatus.OK
    bm.allocate(group)
    for seq in group.get_seqs(SequenceStatus.WAITING):
        seq.status = SequenceStatus.RUNNING
        run_step(bm, kv, seq, next_token)


def decode(bm: BlockSpaceManager, kv: FakeKV, seq: Sequence, next_token: int) -> list[tuple[int, int]]:
    copies = bm.append_slots(seq)
    run_step(bm, kv, seq, next_token, copies)
    return copies


def free_group(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        bm.free(seq)


# ------------------------------------------------------------------------------------- purity


# --------------------------------------------------------------------------------- allocator


def test_allocator_free_list_and_double_free() -> None:
    alloc = BlockAllocator(GPU, 3)
    blocks = [alloc.allocate() for _ in range(3)]
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert alloc.get_num_free_blocks() == 0
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate()
    alloc.free(blocks[1])
    with pytest.raises(ValueError):
        alloc.free(blocks[1])
    assert alloc.allocate() is blocks[1]
    alloc.check_invariants()


# ------------------------------------------------------------------------- allocate / append


def test_allocate_maps_prompt_to_blocks() -> None:
    bm = BlockSpaceManager(BS, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0, enable_prefix_caching=False)
    group = make_group("a", list(range(10)))
    assert bm.can_allocate(group) == AllocStatus.OK
    bm.allocate(group)
    seq = group.seqs[0]
    assert bm.get_block_table(seq) == [0, 1, 2]  # 10 tokens -> 3 blocks of 4
    assert seq.num_computed_tokens == 0
    assert bm.get_num_free_gpu_blocks() == 5
    bm.check_invariants()


def test_new_block_only_when_last_is_full() -> None:
    bm = BlockSpaceManager(BS, 8, 0, watermark=0.0, enable_prefix_caching=False)
    kv = FakeKV(bm)
    group = make_group("a", list(range(6)))
    prefill(bm, kv, group, next_token=100)  # 7 tokens: 2 blocks, room for 1 more
    seq = group.seqs[0]
    assert len(bm.get_block_table(seq)) == 2
    decode(bm, kv, seq, 101)  # writes position 6, still block 1
    assert len(bm.get_block_table(seq)) == 2
    decode(bm, kv, seq, 102)  # writes position 7: block 1 now full
    assert len(bm.get_block_table(seq)) == 2
    decode(bm, kv, seq, 103)  # position 8: new block
    assert len(bm.get_block_table(seq)) == 3
    kv.check(seq)
    bm.free(seq)
    assert bm.all_free()


def test_can_allocate_never_later_and_watermark() -> None:
    bm = BlockSpaceManager(BS, num_gpu_blocks=10, num_cpu_blocks=0, watermark=0.2, enable_prefix_caching=False)
    assert bm.watermark_blocks == 2
    assert bm.can_allocate(make_group("big", list(range(41)))) == AllocStatus.NEVER  # 11 blocks > 10
    # The whole pool is allowed when nothing else runs (the watermark protects running seqs only).
    whole = make_group("whole", list(range(40)))
    assert bm.can_allocate(whole) == AllocStatus.OK
    first = make_group("first", list(range(20)), first_seq_id=10)  # 5 blocks
    bm.allocate(first)
    # 5 free; a 4-block prompt would leave 1 < watermark 2.
    assert bm.can_allocate(make_group("b", list(range(16)), first_seq_id=20)) == AllocStatus.LATER
    assert bm.can_allocate(make_group("c", list(range(12)), first_seq_id=30)) == AllocStatus.OK
    free_group(bm, first)
    assert bm.all_free()


# ------------------------------------------------------------------------ fork / copy-on-write


def test_fork_shares_blocks_and_copy_on_write() -> None:
    bm = BlockSpaceManager(BS, 8, 0, watermark=0.0, enable_prefix_caching=False)
    kv = FakeKV(bm)
    group = make_group("a", list(range(6)))
    bm.allocate(group)
    parent = group.seqs[0]
    parent.status = SequenceStatus.RUNNING
    kv.write(parent)
    parent.num_computed_tokens = parent.get_len()
    child = parent.fork(1)
    bm.fork(parent, child)
    group.seqs.append(child)
    parent.append_token(7, 0.0)
    child.append_token(8, 0.0)  # the two samples diverge at position 6, inside shared block 1
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert all(bm.block_tables[parent.seq_id][i].ref_count == 2 for i in range(2))
    assert bm.get_stats()["blocks_saved_by_sharing"] == 2
    assert bm.can_append_slots(group)

    copies = decode(bm, kv, parent, 9)
    assert copies == [(1, 2)]  # the shared partial block is copied for the first writer
    assert bm.get_block_table(parent) == [0, 2]
    copies = decode(bm, kv, child, 10)
    assert copies == []  # the child is now the only holder of block 1: writes in place
    assert bm.get_block_table(child) == [0, 1]
    assert bm.block_tables[parent.seq_id][0].ref_count == 2  # the full prompt block stays shared
    assert bm.get_stats()["num_cow_copies"] == 1
    kv.check(parent)
    kv.check(child)
    free_group(bm, group)
    assert bm.all_free()


def test_can_append_counts_copy_on_write_exactly() -> None:
    bm = BlockSpaceManager(BS, 3, 0, watermark=0.0, enable_prefix_caching=False)
    group = make_group("a", list(range(3)), n=3)  # 3 identical seqs share one partial block
    bm.allocate(group)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = 3
        seq.append_token(10 + seq.seq_id, 0.0)
    assert bm.block_tables[0][0].ref_count == 3
    # 3 writers, 3 holders: 2 copies; the last writes in place. 2 free blocks suffice.
    assert bm.get_num_free_gpu_blocks() == 2
    assert bm.can_append_slots(group)
    copies = [pair for seq in group.seqs for pair in bm.append_slots(seq)]
    assert len(copies) == 2
    assert bm.get_num_free_gpu_blocks() == 0
    free_group(bm, group)
    assert bm.all_free()


def test_parallel_sampling_group_shares_prompt() -> None:
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0, enable_prefix_caching=False)
    group = make_group("a", list(range(10)), n=4)
    bm.allocate(group)
    tables = [bm.get_block_table(seq) for seq in group.seqs]
    assert all(t == tables[0] for t in tables)
    stats = bm.get_stats()
    assert stats["gpu_blocks_used"] == 3
    assert stats["gpu_blocks_shared"] == 3
    assert stats["blocks_saved_by_sharing"] == 9  # 4 tables x 3 blocks - 3 distinct
    free_group(bm, group)
    assert bm.all_free()


# ------------------------------------------------------------------------------------ swapping


def test_swap_out_and_in_round_trip_moves_shared_blocks_once() -> None:
    bm = BlockSpaceManager(BS, 8, 8, watermark=0.0, enable_prefix_caching=False)
    kv = FakeKV(bm)
    group = make_group("a", list(range(6)))
    prefill(bm, kv, group, next_token=50)
    parent = group.seqs[0]
    child = parent.fork(1)
    bm.fork(parent, child)
    group.seqs.append(child)
    child.output_token_ids[-1] = 51  # the two samples differ in their last token
    for seq in group.seqs:
        decode(bm, kv, seq, 60 + seq.seq_id)
    used_before = bm.get_stats()["gpu_blocks_used"]
    assert used_before == 3  # block 0 shared, one private block 1 each

    assert bm.can_swap_out(group)
    swap_out = bm.swap_out(group)
    assert len(swap_out) == 3  # shared block 0 moved once
    kv.apply(swap_out=swap_out)
    for seq in group.seqs:
        seq.status = SequenceStatus.SWAPPED
    assert bm.get_num_free_gpu_blocks() == 8
    assert bm.get_stats()["cpu_blocks_used"] == 3
    assert bm.block_tables[0][0] is bm.block_tables[1][0]  # still shared, now on the CPU
    # Scribble over the device pool: the swapped copy must survive.
    other = make_group("b", list(range(100, 132)), first_seq_id=10)
    prefill(bm, kv, other)
    free_group(bm, other)

    assert bm.can_swap_in(group) == AllocStatus.OK
    swap_in = bm.swap_in(group)
    assert len(swap_in) == 3
    kv.apply(swap_in=swap_in)
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
        kv.check(seq)
    assert bm.block_tables[0][0] is bm.block_tables[1][0]
    stats = bm.get_stats()
    assert stats["num_blocks_swapped_out"] == 3 and stats["num_blocks_swapped_in"] == 3
    assert stats["cpu_blocks_used"] == 0
    for seq in group.seqs:
        decode(bm, kv, seq, 70)
    free_group(bm, group)
    assert bm.all_free()


def test_swap_space_bounded_by_cpu_pool_and_device_pool() -> None:
    bm = BlockSpaceManager(BS, 4, 2, watermark=0.0, enable_prefix_caching=False)
    group = make_group("a", list(range(12)))  # 3 blocks > 2 CPU blocks
    bm.allocate(group)
    group.seqs[0].status = SequenceStatus.RUNNING
    assert not bm.can_swap_out(group)
    bm2 = BlockSpaceManager(BS, 2, 100, watermark=0.0, enable_prefix_caching=False)
    assert bm2.swap_capacity == 2  # never more swapped blocks than the device pool holds
    free_group(bm, group)


# -------------------------------------------------------------------------------- prefix cache


def test_prefix_hit_after_compute_and_cap_keeps_last_token() -> None:
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0)
    kv = FakeKV(bm)
    prompt = list(range(10))
    a = make_group("a", prompt)
    bm.allocate(a)
    # Not computed yet: no hit for an identical prompt.
    b = make_group("b", prompt, first_seq_id=1)
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0
    free_group(bm, b)
    a.seqs[0].status = SequenceStatus.RUNNING
    run_step(bm, kv, a.seqs[0], 42)

    c = make_group("c", prompt + [5, 6], first_seq_id=2)
    plan = bm.check_allocation(c)
    status, num_blocks, num_tokens = plan.status, plan.num_blocks, plan.num_tokens
    assert (status, num_blocks, num_tokens) == (AllocStatus.OK, 3, 12 - 8)
    bm.allocate(c)
    seq_c = c.seqs[0]
    assert seq_c.num_computed_tokens == 8  # two full blocks of the 10-token prompt
    assert bm.get_block_table(seq_c)[:2] == bm.get_block_table(a.seqs[0])[:2]
    assert bm.block_tables[seq_c.seq_id][0].ref_count == 2
    seq_c.status = SequenceStatus.RUNNING
    kv.check(seq_c, upto=8)  # the mapped blocks hold exactly c's prefix
    run_step(bm, kv, seq_c, 43)

    # An 8-token prompt entirely in cache still computes its last block (its last token).
    d = make_group("d", prompt[:8], first_seq_id=3)
    bm.allocate(d)
    assert d.seqs[0].num_computed_tokens == 4
    stats = bm.get_stats()
    assert stats["prefix_cache_hit_tokens"] == 12
    assert stats["prefix_cache_queried_tokens"] == 10 + 10 + 12 + 8
    for g in (a, c, d):
        free_group(bm, g)
    assert bm.all_free()
    bm.check_invariants()


def test_prefix_cache_survives_free_and_is_evicted_lru() -> None:
    bm = BlockSpaceManager(BS, 6, 0, watermark=0.0)
    kv = FakeKV(bm)
    a = make_group("a", list(range(9)))  # 3 blocks, 2 full and cacheable
    prefill(bm, kv, a)
    b = make_group("b", list(range(100, 109)), first_seq_id=1)
    prefill(bm, kv, b)
    free_group(bm, a)  # a's cached blocks are freed first: least recently used
    free_group(bm, b)
    assert bm.all_free()
    stats = bm.get_stats()
    assert stats["gpu_blocks_free"] == 6 and stats["gpu_blocks_cached"] == 4 and stats["gpu_blocks_evictable"] == 4

    # 4 fresh blocks: 2 never-cached ones first, then the 2 least recently used cached ones (a's).
    filler = make_group("f", list(range(200, 216)), first_seq_id=2)
    bm.allocate(filler)
    assert bm.get_stats()["prefix_cache_evictions"] == 2
    free_group(bm, filler)
    a2 = make_group("a2", list(range(9)), first_seq_id=3)
    bm.allocate(a2)
    assert a2.seqs[0].num_computed_tokens == 0  # a's prefix was evicted
    b2 = make_group("b2", list(range(100, 109)), first_seq_id=4)
    bm.allocate(b2)
    assert b2.seqs[0].num_computed_tokens == 8  # b's survived
    b2.seqs[0].status = SequenceStatus.RUNNING
    kv.check(b2.seqs[0], upto=8)
    free_group(bm, a2)
    free_group(bm, b2)
    assert bm.all_free()
    bm.check_invariants()


def test_tail_blocks_evicted_before_prefix_blocks() -> None:
    bm = BlockSpaceManager(BS, 4, 0, watermark=0.0)
    kv = FakeKV(bm)
    a = make_group("a", list(range(13)))  # 4 blocks, 3 full
    prefill(bm, kv, a)
    free_group(bm, a)
    one = make_group("x", [1000, 1001], first_seq_id=1)
    bm.allocate(one)  # takes the uncached block, no eviction yet
    two = make_group("y", [2000, 2001], first_seq_id=2)
    bm.allocate(two)  # evicts the least useful cached block: a's last full block, not its first
    a2 = make_group("a2", list(range(13)), first_seq_id=3)
    assert bm.check_allocation(a2).num_tokens == 13 - 8
    for g in (one, two):
        free_group(bm, g)
    assert bm.all_free()


def test_hash_collision_never_gives_wrong_blocks() -> None:
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0)
    bm.gpu_allocator.hash_fn = lambda parent_hash, token_ids: 7  # every block collides
    kv = FakeKV(bm)
    a = make_group("a", list(range(12)))
    prefill(bm, kv, a)
    assert bm.get_stats()["prefix_cache_hash_collisions"] >= 1  # a's block 1 could not be cached
    other = make_group("o", list(range(50, 62)), first_seq_id=1)
    bm.allocate(other)
    assert other.seqs[0].num_computed_tokens == 0  # same hash, different tokens: a miss
    same = make_group("s", list(range(12)), first_seq_id=2)
    bm.allocate(same)
    assert same.seqs[0].num_computed_tokens == 4  # block 0 verified; block 1 was never cached
    same.seqs[0].status = SequenceStatus.RUNNING
    kv.check(same.seqs[0], upto=4)
    for g in (a, other, same):
        free_group(bm, g)
    assert bm.all_free()


def test_hit_verifies_the_parent_chain_not_just_tokens() -> None:
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0)
    # A hash that ignores the parent: block [4..7] of "a" looks like block 0 of "b".
    bm.gpu_allocator.hash_fn = lambda parent_hash, token_ids: hash(token_ids)
    kv = FakeKV(bm)
    a = make_group("a", [0, 1, 2, 3, 4, 5, 6, 7, 8])
    prefill(bm, kv, a)
    b = make_group("b", [4, 5, 6, 7, 9], first_seq_id=1)
    bm.allocate(b)
    assert b.seqs[0].num_computed_tokens == 0
    free_group(bm, a)
    free_group(bm, b)
    assert bm.all_free()


def test_recomputed_group_shares_only_common_prefix_blocks() -> None:
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0, enable_prefix_caching=False)
    prompt = list(range(6))
    s0, s1 = Sequence(0, prompt, BS), Sequence(1, prompt, BS)
    s0.output_token_ids = [10, 11, 12]
    s1.output_token_ids = [20, 21, 22]
    group = SequenceGroup("r", [s0, s1], SamplingParams(n=2), arrival_time=0.0)
    assert bm.check_allocation(group).num_blocks == 1 + 2 + 2  # prompt block 0 shared; blocks 1-2 diverge
    bm.allocate(group)
    t0, t1 = bm.get_block_table(s0), bm.get_block_table(s1)
    assert t0[0] == t1[0] and t0[1] != t1[1]
    free_group(bm, group)
    assert bm.all_free()


def test_prefix_hits_on_own_blocks_after_recompute() -> None:
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0)
    kv = FakeKV(bm)
    group = make_group("a", list(range(7)))
    prefill(bm, kv, group, 100)
    seq = group.seqs[0]
    for tok in (101, 102, 103):
        decode(bm, kv, seq, tok)
    bm.free(seq)
    seq.reset_for_recompute()
    bm.allocate(group)
    assert seq.num_computed_tokens == 8  # 11 tokens: 2 full computed blocks come back from the cache
    seq.status = SequenceStatus.RUNNING
    kv.check(seq, upto=8)
    bm.free(seq)
    assert bm.all_free()


def test_cached_blocks_count_as_free_and_a_hit_on_evictable_block_costs_one() -> None:
    bm = BlockSpaceManager(BS, 4, 0, watermark=0.0)
    kv = FakeKV(bm)
    a = make_group("a", list(range(9)))
    prefill(bm, kv, a)
    free_group(bm, a)
    assert bm.get_num_free_gpu_blocks() == 4
    again = make_group("a2", list(range(9)), first_seq_id=1)
    bm.allocate(again)
    assert bm.get_num_free_gpu_blocks() == 1  # 2 revived cached blocks + 1 fresh
    free_group(bm, again)
    assert bm.all_free()


# ---------------------------------------------------------------------- property-based testing


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / decode / fork / free / swap / recompute; contents always checked."""

    @initialize(
        num_gpu=st.integers(4, 24),
        num_cpu=st.integers(0, 16),
        caching=st.booleans(),
        collide=st.booleans(),
    )
    def setup(self, num_gpu: int, num_cpu: int, caching: bool, collide: bool) -> None:
        self.bm = BlockSpaceManager(BS, num_gpu, num_cpu, watermark=0.0, enable_prefix_caching=caching)
        if collide:  # a tiny hash space: collisions all the time
            self.bm.gpu_allocator.hash_fn = lambda parent_hash, token_ids: hash((parent_hash, token_ids)) % 3
        self.kv = FakeKV(self.bm)
        self.groups: list[SequenceGroup] = []
        self.next_seq_id = 0
        self.next_request = 0

    def _live(self, status: SequenceStatus) -> list[SequenceGroup]:
        return [g for g in self.groups if g.get_seqs(status)]

    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]),
        suffix=st.lists(st.integers(0, 3), min_size=0, max_size=9),
        n=st.integers(1, 3),
    )
    def add(self, prefix: list[int], suffix: list[int], n: int) -> None:
        tokens = prefix + suffix or [0]
        group = make_group(f"r{self.next_request}", tokens, n=n, first_seq_id=self.next_seq_id)
        self.next_request += 1
        self.next_seq_id += n
        if self.bm.can_allocate(group) != AllocStatus.OK:
            return
        self.bm.allocate(group)
        self.groups.append(group)
        for seq in group.seqs:
            seq.status = SequenceStatus.RUNNING
            run_step(self.bm, self.kv, seq, 7)

    @precondition(lambda self: self._live(SequenceStatus.RUNNING))
    @rule(data=st.data())
    def decode(self, data) -> None:
        group = data.draw(st.sampled_from(self._live(SequenceStatus.RUNNING)))
        if not self.bm.can_append_slots(group):
            return
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            decode(self.bm, self.kv, seq, data.draw(st.integers(0, 3)))

    @precondition(lambda self: self._live(SequenceStatus.RUNNING))
    @rule(data=st.data())
    def fork(self, data) -> None:
        group = data.draw(st.sampled_from(self._live(SequenceStatus.RUNNING)))
        parent = data.draw(st.sampled_from(group.get_seqs(SequenceStatus.RUNNING)))
        child = parent.fork(self.next_seq_id)
        self.next_seq_id += 1
        self.bm.fork(parent, child)
        group.seqs.append(child)
        # A fork right after sampling: parent and child got different last tokens.
        child.output_token_ids[-1:] = [data.draw(st.integers(0, 3))]

    @precondition(lambda self: self.groups)
    @rule(data=st.data())
    def finish_seq(self, data) -> None:
        group = data.draw(st.sampled_from(self.groups))
        seq = data.draw(st.sampled_from(group.get_unfinished_seqs()))
        seq.status = SequenceStatus.FINISHED_STOPPED
        self.bm.free(seq)
        if group.is_finished():
            self.groups.remove(group)

    @precondition(lambda self: self._live(SequenceStatus.RUNNING))
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        group = data.draw(st.sampled_from(self._live(SequenceStatus.RUNNING)))
        if not self.bm.can_swap_out(group):
            return
        self.kv.apply(swap_out=self.bm.swap_out(group))
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            seq.status = SequenceStatus.SWAPPED

    @precondition(lambda self: self._live(SequenceStatus.SWAPPED))
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        group = data.draw(st.sampled_from(self._live(SequenceStatus.SWAPPED)))
        if self.bm.can_swap_in(group) != AllocStatus.OK:
            return
        self.kv.apply(swap_in=self.bm.swap_in(group))
        for seq in group.get_seqs(SequenceStatus.SWAPPED):
            seq.status = SequenceStatus.RUNNING

    @precondition(lambda self: self._live(SequenceStatus.RUNNING))
    @rule(data=st.data())
    def recompute(self, data) -> None:
        group = data.draw(st.sampled_from(self._live(SequenceStatus.RUNNING)))
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            self.bm.free(seq)
            seq.reset_for_recompute()
        if self.bm.can_allocate(group) == AllocStatus.OK:
            self.bm.allocate(group)
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.RUNNING
                self.kv.check(seq)  # prefix-cache hits hold the right K/V
                run_step(self.bm, self.kv, seq, 5)
        else:
            for seq in group.get_seqs(SequenceStatus.WAITING):
                seq.status = SequenceStatus.FINISHED_ABORTED
            self.groups.remove(group)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        gpu = self.bm.gpu_allocator
        assert gpu.num_used + gpu.get_num_free_blocks() == gpu.num_blocks
        assert self.bm.cpu_allocator.num_used <= self.bm.swap_capacity
        for group in self.groups:
            for seq in group.get_unfinished_seqs():
                self.kv.check(seq)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for group in self.groups:
            free_group(self.bm, group)
        assert self.bm.all_free()
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
