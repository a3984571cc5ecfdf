"""The data-parallel router (pagedllm/serving/router.py): prefix stickiness, load balance, failures."""

from __future__ import annotations

import pytest

from pagedllm.core import BlockSpaceManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.sequence import Sequence, SequenceGroup
from pagedllm.serving.router import PrefixRouter, make_router, prompt_block_hashes

BS = 4
SYSTEM_PROMPT = list(range(1000, 1016))  # 4 full blocks shared by a conversation's turns


def route(router, token_ids: list[int], loads: dict[int, int]) -> int:
    """What a front end does: choose, then record the send."""
    replica = router.choose(token_ids, loads)
    assert replica in loads
    router.record(replica, token_ids)
    return replica


def test_hashes_equal_the_block_managers() -> None:
    tokens = list(range(50, 61))  # 2 full blocks and 3 tokens of a partial one
    manager = BlockSpaceManager(BS, num_gpu_blocks=16, num_cpu_blocks=0, enable_prefix_caching=True)
    seq = Sequence(0, tokens, BS)
    manager.check_allocation(SequenceGroup("r", [seq], SamplingParams(), arrival_time=0.0))
    assert len(seq.block_hashes) == 2
    assert prompt_block_hashes(tokens, BS) == seq.block_hashes
    assert prompt_block_hashes(tokens[:3], BS) == []  # no full block: nothing to match


def test_cold_requests_spread_round_robin() -> None:
    router = make_router("prefix", BS)
    idle = {0: 0, 1: 0, 2: 0, 3: 0}
    chosen = [route(router, [7 * i + j for j in range(8)], idle) for i in range(8)]
    assert chosen == [0, 1, 2, 3, 0, 1, 2, 3]
    assert router.stats()["decisions"] == {"cold": 8}
    # Ties among the least loaded only: the idle replica wins.
    assert router.choose([9999] * 8, {0: 3, 1: 0, 2: 3}) == 1


def test_shared_prefix_sticks_to_one_replica() -> None:
    router = make_router("prefix", BS)
    loads = {0: 0, 1: 0, 2: 0}
    first = route(router, SYSTEM_PROMPT + [1, 2, 3, 4], loads)
    loads[first] += 1
    for turn in range(5):
        replica = route(router, SYSTEM_PROMPT + [100 + turn] * 6, loads)
        assert replica == first  # a few more requests in flight do not move it
        loads[replica] += 1
    stats = router.stats()
    assert stats["decisions"] == {"cold": 1, "prefix_hit": 5}
    assert stats["prefix_hit_blocks"] == {first: 5 * 4}  # the 4 system-prompt blocks, 5 times
    assert stats["requests"] == {first: 6}


def test_longest_leading_run_wins() -> None:
    router = make_router("prefix", BS)
    router.record(0, SYSTEM_PROMPT[:8])  # 2 leading blocks
    router.record(1, SYSTEM_PROMPT)  # all 4
    router.record(2, [5] * 4 + SYSTEM_PROMPT[4:])  # later blocks only: chained hashes differ
    assert router.choose(SYSTEM_PROMPT + [1] * 4, {0: 0, 1: 2, 2: 0}) == 1


def test_overload_falls_back_to_least_loaded() -> None:
    router = make_router("prefix", BS)  # thresholds 8 requests and 1.5x
    router.record(0, SYSTEM_PROMPT)
    prompt = SYSTEM_PROMPT + [42] * 4
    assert router.choose(prompt, {0: 13, 1: 5, 2: 6}) == 0  # 8 more: not more than 8
    assert router.choose(prompt, {0: 40, 1: 30, 2: 31}) == 0  # 10 more but only 1.33x
    assert router.choose(prompt, {0: 14, 1: 5, 2: 6}) == 1  # 9 more and 2.8x: the least loaded
    assert router.choose(prompt, {0: 9, 1: 0}) == 1  # idle replica: 9 > 8 and 9 > 1.5 * 0
    assert router.stats()["decisions"] == {"prefix_hit": 2, "overloaded": 2}
    strict = make_router("prefix", BS, balance_abs_threshold=0, balance_rel_threshold=1.0)
    strict.record(0, SYSTEM_PROMPT)
    assert strict.choose(prompt, {0: 1, 1: 0}) == 1


def test_removed_replica_is_never_chosen_and_forgotten() -> None:
    router = make_router("prefix", BS)
    route(router, SYSTEM_PROMPT, {0: 0, 1: 0, 2: 0})  # cold: replica 0
    assert router.stats()["indexed_blocks"] == {0: 4}
    router.remove_replica(0)
    assert 0 not in router.stats()["indexed_blocks"]
    survivors = {1: 0, 2: 0}
    assert {route(router, SYSTEM_PROMPT + [i] * 4, survivors) for i in range(4)} <= {1, 2}
    # A replica restarted under the old id starts cold: what id 0 held is not assumed cached.
    fresh = make_router("prefix", BS)
    fresh.record(0, SYSTEM_PROMPT)
    fresh.remove_replica(0)
    assert fresh.choose(SYSTEM_PROMPT, {0: 0, 1: 0}) == 0
    assert fresh.stats()["decisions"] == {"cold": 1}
    with pytest.raises(ValueError, match="no live replica"):
        fresh.choose(SYSTEM_PROMPT, {})


def test_index_is_a_bounded_lru_that_keeps_prefix_heads() -> None:
    router = PrefixRouter(BS, max_blocks_per_replica=6)
    router.record(0, SYSTEM_PROMPT)
    router.record(0, [77] * 12)  # 3 more blocks: one of the system prompt's must go
    assert router.stats()["indexed_blocks"] == {0: 6}
    hashes = prompt_block_hashes(SYSTEM_PROMPT, BS)
    index = router._index[0]
    assert hashes[:3] == [h for h in hashes if h in index]  # the tail went first, the head stayed
    assert router.choose(SYSTEM_PROMPT, {0: 0, 1: 0}) == 0


def test_round_robin_and_least_loaded() -> None:
    rr = make_router("round_robin", BS)
    assert [route(rr, [1] * 8, {0: 9, 1: 0, 2: 0}) for _ in range(4)] == [0, 1, 2, 0]
    assert route(rr, [1] * 8, {0: 0, 2: 0}) == 2  # replica 1 gone: the next live one
    ll = make_router("least_loaded", BS)
    assert route(ll, [1] * 8, {0: 9, 1: 2, 2: 2}) == 1
    assert route(ll, [1] * 8, {0: 9, 1: 2, 2: 2}) == 2  # tie: in turn
    assert rr.stats() == {"policy": "round_robin", "decisions": {"round_robin": 5}, "prefix_hit_blocks": {},
                          "requests": {0: 2, 1: 1, 2: 2}}
    assert ll.stats()["requests"] == {1: 1, 2: 1}
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random", BS)
    with pytest.raises(TypeError):
        make_router("round_robin", BS, balance_abs_threshold=3)


def test_router_module_imports_no_torch() -> None:
    import ast
    import pathlib

    import pagedllm.serving.router as module

    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert not imported & {"torch", "ray", "numpy"}
