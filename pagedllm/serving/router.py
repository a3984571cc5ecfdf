"""Which data-parallel replica serves a request: prefix-aware, load-aware routing.

Each replica is a whole engine with its own KV pool and prefix cache, so a request whose leading
blocks a replica already holds skips their prefill there and nowhere else. The router cannot see
the replicas' caches; like sgl-router's approximate tree it keeps, per replica, the block hashes
of the prompts it recently *sent* there, and assumes those are still cached.

Policies (``make_router``):

- ``prefix`` (default). Hash the prompt's full blocks with the engine's own chained block hash
  (``allocator.hash_block_tokens(parent_hash, token_ids)``, ``block_size`` tokens per block).
  For every live replica, count the run of the prompt's *leading* blocks found in its index; the
  candidate is the replica with the longest run (ties: the least loaded of them). The candidate
  is taken (reason ``prefix_hit``) unless

  * no replica holds even the first block (reason ``cold``), or
  * it is overloaded (reason ``overloaded``): its load exceeds the lowest load by more than
    ``balance_abs_threshold`` requests (default 8) AND is more than ``balance_rel_threshold``
    times the lowest load (default 1.5).

  Then the least-loaded replica is taken, ties broken round robin so that an idle cluster
  spreads cold requests. The two thresholds together keep a hot prefix on its replica while the
  imbalance is small in absolute terms (a few extra requests cost less than re-prefilling the
  prefix elsewhere) and small relative to the work already queued everywhere (at high load, 8
  extra requests on top of 100 barely change the wait). The rule is sgl-router's cache-aware
  one; 8 is small against the tens of requests a replica batches at the paper's rates
  (Figure 13), so a hot prefix costs its replica a little queueing, not a backlog.

  A request's ``cache_key`` (OpenAI's ``prompt_cache_key``: the client's word that requests share
  a prefix) comes first: a key routed before goes back to the replica it went to (reason
  ``cache_key``), unless that replica is down or overloaded by the same rule, and only then do the
  block hashes decide. The key moves with the request when the load check sends it elsewhere. The
  router keeps the ``max_cache_keys`` most recently used keys (default 65536).
- ``round_robin``: live replicas in turn, ignoring load and content.
- ``least_loaded``: the fewest requests in flight, ties round robin.

The index of a replica is an LRU of at most ``max_blocks_per_replica`` hashes (default 65536,
i.e. ~1M tokens at block size 16, more than one replica's pool holds); a prompt's blocks are
touched deepest first, so eviction takes a prefix's tail before its head, as a radix cache's
leaf-first eviction does. Hashes are Python's ``hash`` of tuples: stable within a process, which
is all the router needs (it only ever compares them with its own records).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Protocol

from pagedllm.core.allocator import hash_block_tokens

ROUTER_POLICIES = ("prefix", "round_robin", "least_loaded")


class Router(Protocol):
    def choose(self, token_ids: list[int], loads: dict[int, int], cache_key: str | None = None) -> int:
        """A replica id from ``loads`` (live replica id -> requests in flight: waiting + running);
        ``cache_key``: the request's prompt_cache_key, if it has one."""
        ...

    def record(self, replica: int, token_ids: list[int], cache_key: str | None = None) -> None:
        """The request was sent to ``replica`` (its blocks will be cached there)."""
        ...

    def remove_replica(self, replica: int) -> None:
        """The replica died: forget what it held."""
        ...

    def stats(self) -> dict:
        """Routing decisions by reason, prefix-hit blocks per replica, requests per replica."""
        ...


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """The chained hashes of the prompt's full blocks, exactly as the block manager computes them."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tuple(token_ids[start:start + block_size]))
        hashes.append(parent)
    return hashes


class _BaseRouter:
    """Round-robin tie breaking and the counters every policy reports."""

    policy = ""

    def __init__(self) -> None:
        self._cursor = 0  # the next replica id a round-robin pick prefers
        self.decisions: Counter[str] = Counter()
        self.requests: Counter[int] = Counter()

    def _round_robin(self, candidates: list[int]) -> int:
        """The first candidate at or after the cursor (wrapping), then move the cursor past it."""
        ordered = sorted(candidates)
        chosen = next((r for r in ordered if r >= self._cursor), ordered[0])
        self._cursor = chosen + 1
        return chosen

    def _least_loaded(self, loads: dict[int, int]) -> int:
        lowest = min(loads.values())
        return self._round_robin([r for r, load in loads.items() if load == lowest])

    @staticmethod
    def _check(loads: dict[int, int]) -> None:
        if not loads:
            raise ValueError("no live replica to route to")

    def record(self, replica: int, token_ids: list[int], cache_key: str | None = None) -> None:
        self.requests[replica] += 1

    def remove_replica(self, replica: int) -> None:
        pass  # nothing per replica but history

    def stats(self) -> dict:
        return {
            "policy": self.policy,
            "decisions": dict(self.decisions),
            "prefix_hit_blocks": {},
            "requests": dict(sorted(self.requests.items())),
        }


class RoundRobinRouter(_BaseRouter):
    policy = "round_robin"

    def choose(self, token_ids: list[int], loads: dict[int, int], cache_key: str | None = None) -> int:
        self._check(loads)
        self.decisions["round_robin"] += 1
        return self._round_robin(list(loads))


class LeastLoadedRouter(_BaseRouter):
    policy = "least_loaded"

    def choose(self, token_ids: list[int], loads: dict[int, int], cache_key: str | None = None) -> int:
        self._check(loads)
        self.decisions["least_loaded"] += 1
        return self._least_loaded(loads)


class PrefixRouter(_BaseRouter):
    """Longest cached run of leading blocks, unless that replica is overloaded (module docstring)."""

    policy = "prefix"

    def __init__(self, block_size: int, max_blocks_per_replica: int = 65536, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5, max_cache_keys: int = 65536) -> None:
        super().__init__()
        if block_size < 1 or max_blocks_per_replica < 1 or max_cache_keys < 1:
            raise ValueError("block_size, max_blocks_per_replica and max_cache_keys must be >= 1")
        self.block_size = block_size
        self.max_blocks_per_replica = max_blocks_per_replica
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        # replica -> its recently routed block hashes, least recently used first.
        self._index: dict[int, OrderedDict[int, None]] = {}
        self.prefix_hit_blocks: Counter[int] = Counter()
        # prompt_cache_key -> the replica its last request went to, least recently used first.
        self._cache_keys: OrderedDict[str, int] = OrderedDict()
        self.max_cache_keys = max_cache_keys
        # choose() and record() usually see the same prompt back to back: hash it once.
        self._last_tokens: list[int] | None = None
        self._last_hashes: list[int] = []

    def _hashes(self, token_ids: list[int]) -> list[int]:
        if token_ids != self._last_tokens:
            self._last_tokens = list(token_ids)
            self._last_hashes = prompt_block_hashes(token_ids, self.block_size)
        return self._last_hashes

    def _matched_blocks(self, replica: int, hashes: list[int]) -> int:
        index = self._index.get(replica)
        if not index:
            return 0
        matched = 0
        for block_hash in hashes:
            if block_hash not in index:
                break
            matched += 1
        return matched

    def _overloaded(self, replica: int, loads: dict[int, int]) -> bool:
        lowest = min(loads.values())
        load = loads[replica]
        return load - lowest > self.balance_abs_threshold and load > self.balance_rel_threshold * lowest

    def choose(self, token_ids: list[int], loads: dict[int, int], cache_key: str | None = None) -> int:
        self._check(loads)
        keyed = self._cache_keys.get(cache_key) if cache_key is not None else None
        if keyed is not None and keyed in loads:
            if self._overloaded(keyed, loads):
                self.decisions["overloaded"] += 1
                return self._least_loaded(loads)
            self.decisions["cache_key"] += 1
            return keyed
        hashes = self._hashes(token_ids)
        matched = {replica: self._matched_blocks(replica, hashes) for replica in loads}
        longest = max(matched.values())
        if longest == 0:
            self.decisions["cold"] += 1
            return self._least_loaded(loads)
        holders = {r: loads[r] for r, m in matched.items() if m == longest}
        candidate = self._least_loaded(holders) if len(holders) > 1 else next(iter(holders))
        if self._overloaded(candidate, loads):
            self.decisions["overloaded"] += 1
            return self._least_loaded(loads)
        self.decisions["prefix_hit"] += 1
        return candidate

    def record(self, replica: int, token_ids: list[int], cache_key: str | None = None) -> None:
        super().record(replica, token_ids)
        if cache_key is not None:
            self._cache_keys[cache_key] = replica
            self._cache_keys.move_to_end(cache_key)
            while len(self._cache_keys) > self.max_cache_keys:
                self._cache_keys.popitem(last=False)
        hashes = self._hashes(token_ids)
        self.prefix_hit_blocks[replica] += self._matched_blocks(replica, hashes)
        index = self._index.setdefault(replica, OrderedDict())
        # Deepest block first, so the head of the prefix is the most recently used and is evicted last.
        for block_hash in reversed(hashes):
            index[block_hash] = None
            index.move_to_end(block_hash)
        while len(index) > self.max_blocks_per_replica:
            index.popitem(last=False)

    def remove_replica(self, replica: int) -> None:
        self._index.pop(replica, None)
        for key in [key for key, holder in self._cache_keys.items() if holder == replica]:
            del self._cache_keys[key]

    def stats(self) -> dict:
        stats = super().stats()
        stats["prefix_hit_blocks"] = dict(sorted(self.prefix_hit_blocks.items()))
        stats["indexed_blocks"] = {r: len(index) for r, index in sorted(self._index.items())}
        stats["cache_keys"] = len(self._cache_keys)
        return stats


def make_router(policy: str = "prefix", block_size: int = 16, **options) -> Router:
    """``prefix`` (default; options: max_blocks_per_replica, balance_abs_threshold,
    balance_rel_threshold, max_cache_keys), ``round_robin`` or ``least_loaded`` (these two ignore
    the cache key as they ignore the prompt)."""
    if policy == "prefix":
        return PrefixRouter(block_size, **options)
    if options:
        raise TypeError(f"router {policy!r} takes no options, got {sorted(options)}")
    if policy == "round_robin":
        return RoundRobinRouter()
    if policy == "least_loaded":
        return LeastLoadedRouter()
    raise ValueError(f"unknown router policy {policy!r}: use one of {', '.join(ROUTER_POLICIES)}")
