"""The block manager with a sliding window: blocks wholly before the window go back to the pool,
the table keeps its logical numbering (released entries read as block 0), and forks, swaps and
frees handle tables with released entries."""

from __future__ import annotations

from test_block_manager import make_group

from pagedllm.core import BlockSpaceManager
from pagedllm.sequence import SequenceStatus

BS = 4
WINDOW = 6


def _decode_step(bm: BlockSpaceManager, seq, token: int) -> None:
    """What the engine does around one step: the step computed every token, one token appended."""
    seq.num_computed_tokens = seq.get_len()
    seq.append_token(token, 0.0)
    bm.append_slots(seq)


def test_blocks_before_the_window_are_released() -> None:
    bm = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=8, enable_prefix_caching=False,
                           sliding_window=WINDOW)
    group = make_group("a", list(range(10, 23)), bs=BS)  # 13 tokens: 4 blocks
    bm.allocate(group)
    seq = group.get_seqs()[0]
    seq.status = SequenceStatus.RUNNING
    assert len(bm.get_block_table(seq)) == 4 and bm.get_num_free_gpu_blocks() == 12
    _decode_step(bm, seq, 1)
    # The query at position 13 reads positions 8..13: blocks 0 and 1 (positions 0..7) are released.
    table = bm.get_block_table(seq)
    assert table[:2] == [0, 0] and len(table) == 4 and bm.get_num_free_gpu_blocks() == 14
    for token in range(2, 12):
        _decode_step(bm, seq, token)
        held = bm.block_tables[seq.seq_id].blocks
        assert len(held) <= -(-WINDOW // BS) + 1
        bm.check_invariants()
    # A fork shares the held blocks only; a swap moves them and brings them back.
    child = seq.fork(99)
    bm.fork(seq, child)
    group.seqs.append(child)
    bm.check_invariants()
    assert bm.get_block_table(child) == bm.get_block_table(seq)
    moved = bm.swap_out(group)
    assert len(moved) == len(bm.block_tables[seq.seq_id].blocks)
    for s in group.get_seqs():
        s.status = SequenceStatus.SWAPPED
    bm.swap_in(group)
    bm.check_invariants()
    for s in group.get_seqs():
        bm.free(s)
    assert bm.all_free()


def test_no_window_keeps_every_block() -> None:
    bm = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=0, enable_prefix_caching=False)
    group = make_group("a", list(range(10, 23)), bs=BS)
    bm.allocate(group)
    seq = group.get_seqs()[0]
    for token in range(8):
        _decode_step(bm, seq, token)
    table = bm.block_tables[seq.seq_id]
    assert table.num_dropped == 0 and len(table.blocks) == len(table) == 6
