"""Suffix decoding proposer: matches, adaptive length, global cache, eviction, resets, speed."""

from __future__ import annotations

import random
import time

import pytest

from pagedllm.core.suffix_proposer import SuffixProposer, _Node

# A real code file and an edited copy, tokenized by character: an "edit this file" conversation.
CODE = '''def order_of(size: int) -> int:
    """The smallest k with 2**k >= size (size >= 1)."""
    return max(0, (size - 1).bit_length())


def can_allocate(free_lists: list[set[int]], size: int) -> bool:
    order = order_of(size)
    return any(free_lists[k] for k in range(order, len(free_lists)))
'''


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def count_nodes(node: _Node) -> int:
    children = node.children or {}
    return 1 + sum(count_nodes(c) for c in children.values())


def test_repeated_code_continues_the_earlier_copy() -> None:
    edited = CODE.replace("free_lists", "pools")
    prompt = chars("Rename free_lists to pools:\n" + CODE + "\nAnswer:\n")
    # The answer so far: the file up to just past the first renamed spot, then some more common text.
    cut = edited.index("pools") + len("pools: list[set[int]], si")
    output = chars(edited[:cut])
    proposer = SuffixProposer()
    draft = proposer.propose("r", prompt + output, max_tokens=16)
    assert len(draft) == 16
    assert draft == chars(edited[cut : cut + 16])  # "ze: int) -> bool" copied from the original
    # Before the answer diverges from the prompt's copy, it is copied too: the first line.
    draft = proposer.propose("r", prompt + chars(edited[:20]), max_tokens=10)
    assert draft == chars(CODE[20:30])


def test_longer_match_gives_longer_proposal() -> None:
    span = list(range(100, 140))  # 40 distinct tokens
    proposer = SuffixProposer(max_tree_depth=24, max_spec_factor=1.0)
    base = span + [1, 2, 3]
    short = proposer.propose("short", base + span[:3], max_tokens=30)
    long = proposer.propose("long", base + span[:12], max_tokens=30)
    assert short == span[3:6]  # a 3-token match earns 3 tokens
    assert long == span[12:24]  # a 12-token match earns 12
    # The factor scales it; the caller's max_tokens caps it.
    assert SuffixProposer(max_spec_factor=2.0).propose("r", base + span[:5], max_tokens=30) == span[5:15]
    assert proposer.propose("long", base + span[:12], max_tokens=4) == span[12:16]
    assert proposer.propose("long", base + span[:12], max_tokens=0) == []


def test_proposal_runs_past_the_tree_depth() -> None:
    # A match as long as the trie allows: the walk continues with a shorter context after the
    # deepest stored node instead of stopping there.
    span = list(range(100, 200))
    proposer = SuffixProposer(max_tree_depth=8, max_spec_factor=4.0)
    draft = proposer.propose("r", span + [1] + span[:10], max_tokens=25)
    assert draft == span[10:35]


def test_low_probability_branch_stops_the_proposal() -> None:
    # "7 8 9" is followed by 12 different tokens: each continuation has probability 1/12 < 0.1.
    prefix = [7, 8, 9]
    seq: list[int] = []
    for k in range(12):
        seq += [1, 2, 3, 4, 5, 6] + prefix + [50 + k, 60 + k]
    seq += [1, 2, 3, 4, 5, 6] + prefix[:1]
    proposer = SuffixProposer(max_spec_factor=4.0)
    assert proposer.propose("r", seq, max_tokens=20) == [8, 9]  # stops where the branches fan out
    # With a permissive threshold it goes on along the first most frequent branch.
    lax = SuffixProposer(max_spec_factor=4.0, min_token_prob=0.05)
    assert lax.propose("r", seq, max_tokens=3) == [8, 9, 50]


def test_most_frequent_continuation_wins() -> None:
    seq = [1, 2, 3, 9] + [1, 2, 3, 4] * 3 + [0, 1, 2, 3]
    assert SuffixProposer().propose("r", seq, max_tokens=1) == [4]


def test_global_cache_helps_a_request_repeating_an_earlier_output() -> None:
    rng = random.Random(1)
    output = [rng.randrange(1000, 2000) for _ in range(60)]
    first_prompt = list(range(10, 20))
    second = [6] * 10 + output[:15]
    fresh = SuffixProposer()
    assert fresh.propose("b", second, max_tokens=10) == []  # nothing of it in its own text
    proposer = SuffixProposer()
    proposer.propose("a", first_prompt + output, max_tokens=5)
    proposer.request_finished("a", first_prompt + output, prompt_len=len(first_prompt))
    assert "a" not in proposer._requests
    assert proposer.propose("b", second, max_tokens=10) == output[15:25]
    # Only the output is cached, not the prompt.
    assert proposer.propose("c", [7] + first_prompt[:5], max_tokens=5) == []


def test_own_text_is_preferred_on_equal_evidence() -> None:
    shared = [10, 11, 12, 13]
    proposer = SuffixProposer(max_spec_factor=2.0)
    proposer.request_finished("old", [0] + shared + [20, 21, 22, 23], prompt_len=1)
    seq = shared + [30, 31, 32, 33] + [99] + shared
    assert proposer.propose("r", seq, max_tokens=4) == [30, 31, 32, 33]


def test_eviction_bounds_the_cache_and_removes_entries() -> None:
    rng = random.Random(2)
    outputs = [[rng.randrange(1000, 5000) for _ in range(40)] for _ in range(4)]
    proposer = SuffixProposer(max_cached_requests=2)
    for i, out in enumerate(outputs):
        proposer.request_finished(f"r{i}", [1, 2] + out, prompt_len=2)
    assert list(proposer._cached) == ["r2", "r3"]
    assert proposer.propose("q0", [9] + outputs[0][:10], max_tokens=5) == []  # evicted
    assert proposer.propose("q1", [9] + outputs[1][:10], max_tokens=5) == []
    assert proposer.propose("q3", [9] + outputs[3][:10], max_tokens=5) == outputs[3][10:15]
    # The evicted outputs left no node behind: same trie as one that only ever saw the last two.
    only_last = SuffixProposer(max_cached_requests=2)
    for i in (2, 3):
        only_last.request_finished(f"r{i}", [1, 2] + outputs[i], prompt_len=2)
    assert count_nodes(proposer._global.root) == count_nodes(only_last._global.root)
    # A reused id replaces its old output rather than adding to it.
    proposer.request_finished("r3", [1, 2] + outputs[3], prompt_len=2)
    assert count_nodes(proposer._global.root) == count_nodes(only_last._global.root)


def test_eviction_restores_the_most_frequent_child() -> None:
    proposer = SuffixProposer(max_cached_requests=3)
    proposer.request_finished("a", [1, 2, 3, 4] * 2, prompt_len=0)  # 1 2 3 -> 4, twice
    proposer.request_finished("b", [1, 2, 3, 5], prompt_len=0)
    assert proposer.propose("q", [0, 1, 2, 3], max_tokens=1) == [4]
    proposer.request_finished("c", [1, 2, 3, 5], prompt_len=0)
    proposer.request_finished("d", [1, 2, 3, 5], prompt_len=0)  # evicts "a"
    assert proposer.propose("q2", [0, 1, 2, 3], max_tokens=1) == [5]


def test_reset_request_is_rebuilt() -> None:
    rng = random.Random(3)
    long = [rng.randrange(50) for _ in range(300)]
    other = [rng.randrange(50) for _ in range(200)]
    proposer = SuffixProposer()
    proposer.propose("r", long, max_tokens=8)
    # Shorter than what was seen: preempted and recomputed (here with other content).
    assert proposer.propose("r", other, max_tokens=8) == SuffixProposer().propose("x", other, max_tokens=8)
    assert proposer._requests["r"].seen == len(other)
    # Longer, but the already-seen part changed: rebuilt too.
    changed = other[:-1] + [other[-1] + 1] + long[:50]
    assert proposer.propose("r", changed, max_tokens=8) == SuffixProposer().propose("x", changed, max_tokens=8)


@pytest.mark.parametrize("chunk", [1, 3, 17])
def test_incremental_equals_from_scratch(chunk: int) -> None:
    rng = random.Random(chunk)
    # A small vocabulary and copied spans: many matches and branch points.
    seq = [rng.randrange(8) for _ in range(60)]
    while len(seq) < 400:
        start = rng.randrange(len(seq) - 30)
        seq += seq[start : start + rng.randrange(5, 30)] + [rng.randrange(8)]
    proposer = SuffixProposer(max_tree_depth=10, min_token_prob=0.2)
    proposer.request_finished("done", seq[:150], prompt_len=40)
    for n in range(chunk, len(seq), chunk):
        got = proposer.propose("inc", seq[:n], max_tokens=12)
        scratch = SuffixProposer(max_tree_depth=10, min_token_prob=0.2)
        scratch.request_finished("done", seq[:150], prompt_len=40)
        assert got == scratch.propose("once", seq[:n], max_tokens=12), n


def test_per_step_cost_does_not_grow_with_length() -> None:
    rng = random.Random(4)
    seq = [rng.randrange(200) for _ in range(500)]
    while len(seq) < 4000:  # repetitive, like generated code: long matches and walks
        start = rng.randrange(len(seq) - 100)
        seq += seq[start : start + rng.randrange(10, 100)]
    seq = seq[:4000]
    proposer = SuffixProposer()
    proposer.request_finished("prev", seq[:1000], prompt_len=0)
    proposer.propose("r", seq[:2000], max_tokens=8)
    start = time.perf_counter()
    for n in range(2001, 4001):
        proposer.propose("r", seq[:n], max_tokens=8)
    per_step = (time.perf_counter() - start) / 2000
    # Slicing seq[:n] is the caller's cost here and is included; still far below a millisecond.
    assert per_step < 1e-3, f"{per_step * 1e6:.0f} us per step"


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        SuffixProposer(max_tree_depth=1)
    with pytest.raises(ValueError):
        SuffixProposer(min_token_prob=1.5)
    with pytest.raises(ValueError):
        SuffixProposer(max_cached_requests=-1)
    assert SuffixProposer().propose("r", [], max_tokens=4) == []
