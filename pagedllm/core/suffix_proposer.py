"""Suffix decoding: draft tokens from repeated spans of a request's own text and of recent outputs.

As Arctic Inference's suffix decoding: agent loops and code edits repeat long spans of what is
already in the context (or of what earlier requests wrote), so the continuation of the longest
matching suffix is a cheap, often long, draft.

Structure: a depth-limited suffix trie with counts. Every position j of a sequence inserts the path
``tokens[j:j + max_tree_depth]``; a node's ``count`` is how many positions' paths pass through it,
i.e. how often that token string occurs (occurrences longer than the depth are cut). Each new token
extends the at most ``max_tree_depth`` paths that end at the current position, so adding a token
costs O(depth) however long the sequence is. Suffix links (node for ``p`` -> node for ``p[1:]``)
let matching and proposing drop the oldest context token in O(1).

Pure Python on purpose: the scheduler in ``pagedllm.core`` uses it and never imports torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class _Node:
    # children: token -> node, created on first child (most deep nodes are leaves; saves a dict each).
    # count: occurrences of this node's path. followed: occurrences followed by a further token
    # (= sum of the children's counts); the denominator of a continuation's probability, because an
    # occurrence at the very end of a sequence (the request's current position, above all) says
    # nothing about what follows. best: the child with the highest count (ties: the first to reach it),
    # so a proposal step costs O(1) even below a node with hundreds of continuations.
    __slots__ = ("token", "children", "count", "followed", "link", "best")

    def __init__(self, token: int, link: _Node | None) -> None:
        self.token = token
        self.children: dict[int, _Node] | None = None
        self.count = 0
        self.followed = 0
        self.link = link
        self.best: _Node | None = None


class _SuffixTrie:
    """Depth-limited suffix trie over one or more token sequences, with occurrence counts."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node(-1, None)

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append ``token`` to a sequence whose extendable suffix nodes are ``active``.

        ``active[i]`` is the node of the sequence's suffix of length i + 1, for lengths below
        max_depth (a max-depth node is never extended). Returns the new list, same meaning.
        """
        new: list[_Node] = []
        prev = self.root  # node of the new sequence's suffix one shorter: the child's suffix link
        for parent in (self.root, *active):
            children = parent.children
            if children is None:
                children = parent.children = {}
            child = children.get(token)
            if child is None:
                child = children[token] = _Node(token, prev)
            child.count += 1
            parent.followed += 1
            best = parent.best
            if best is None or child.count > best.count:
                parent.best = child
            new.append(child)
            prev = child
        del new[self.max_depth - 1 :]
        return new

    def insert(self, tokens: Sequence[int]) -> list[_Node]:
        active: list[_Node] = []
        for token in tokens:
            active = self.extend(active, token)
        return active

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``insert(tokens)``: replay the same paths, decrementing, and drop nodes that reach 0."""
        active: list[_Node] = []
        for token in tokens:
            new: list[_Node] = []
            for parent in (self.root, *active):
                children = parent.children
                assert children is not None, "removing a sequence that was not inserted"
                child = children[token]
                child.count -= 1
                parent.followed -= 1
                if child.count == 0:
                    # Its descendants are this sequence's alone: they reach 0 in later iterations,
                    # detached already, and go with it.
                    del children[token]
                # The root's best child is never used (a proposal needs a match of at least one token),
                # and rescanning its many children per removed token would cost O(vocabulary).
                if parent.best is child and parent is not self.root:
                    parent.best = max(children.values(), key=lambda c: c.count) if children else None
                new.append(child)
            active = new[: self.max_depth - 1]

    def match(self, context: Sequence[int]) -> tuple[_Node, int]:
        """Node and length of the longest suffix of ``context`` (at most max_depth - 1 tokens) in
        the trie that is followed by something somewhere; (root, 0) when there is none.

        At most max_depth - 1 because a max-depth node is never given children: a longer match
        could not say what comes next."""
        cap = self.max_depth - 1
        node, length = self.root, 0
        # Matching statistics along suffix links: the trie is closed under suffixes, so the longest
        # suffix after a token is the longest earlier suffix that has that token as a child.
        for token in context[-cap:]:
            if length == cap:
                node, length = node.link, length - 1  # type: ignore[assignment]
            while True:
                child = node.children.get(token) if node.children is not None else None
                if child is not None:
                    node, length = child, length + 1
                    break
                if node is self.root:
                    break
                node, length = node.link, length - 1  # type: ignore[assignment]
        return self.longest_followed(node, length)

    @staticmethod
    def longest_followed(node: _Node, length: int) -> tuple[_Node, int]:
        # A path seen only at sequence ends (e.g. the request's current tail) has nothing to propose;
        # its shorter suffixes may.
        while length > 0 and node.followed == 0:
            node, length = node.link, length - 1  # type: ignore[assignment]
        return node, length

    def walk(self, node: _Node, length: int, limit: int, min_prob: float) -> tuple[list[int], float]:
        """Greedy most-frequent continuation from ``node``: up to ``limit`` tokens, stopping at the
        first continuation with empirical probability below ``min_prob``.

        Returns the tokens and their expected number accepted under the counts' own model
        (sum over prefixes of the product of the step probabilities), used to rank proposals.
        """
        out: list[int] = []
        expected, prob = 0.0, 1.0
        while len(out) < limit:
            if length >= self.max_depth:
                # The trie stores no deeper paths; keep going with the context one token shorter.
                node, length = node.link, length - 1  # type: ignore[assignment]
            best = node.best
            if best is None or node.followed == 0:
                break
            step = best.count / node.followed
            if step < min_prob:
                break
            out.append(best.token)
            prob *= step
            expected += prob
            node, length = best, length + 1
        return out, expected


class _RequestState:
    __slots__ = ("active", "last_token", "seen", "trie")

    def __init__(self, max_depth: int) -> None:
        self.trie = _SuffixTrie(max_depth)
        self.active: list[_Node] = []
        self.seen = 0
        self.last_token = -1


class SuffixProposer:
    """Draft tokens by suffix matching against the request's own text and recent finished outputs.

    Which structure drafts: each one proposes from its own longest match, and the proposal with the
    larger expected number of accepted tokens (under the structure's own counts) wins; ties go to
    the request's own structure, whose counts describe this very request. In practice the global
    cache wins when it holds a longer or more consistent match, e.g. a second request repeating a
    first request's output.
    """

    def __init__(
        self,
        max_tree_depth: int = 24,
        max_cached_requests: int = 1000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        if max_tree_depth < 2:
            raise ValueError(f"max_tree_depth must be at least 2, got {max_tree_depth}.")
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}.")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor}.")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}.")
        self.max_tree_depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestState] = {}
        self._global = _SuffixTrie(max_tree_depth)
        # Finished outputs in the global trie, oldest first; kept to remove them on eviction.
        self._cached: OrderedDict[str, tuple[int, ...]] = OrderedDict()

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens to follow token_ids (may be []); token_ids is prompt + output so far."""
        state = self._sync(request_id, token_ids)
        if max_tokens <= 0 or not token_ids:
            return []
        own_node, own_len = self._own_match(state)
        best, best_expected = self._draft(state.trie, own_node, own_len, max_tokens)
        if self._cached:
            node, length = self._global.match(token_ids)
            if length > 0:
                draft, expected = self._draft(self._global, node, length, max_tokens)
                if expected > best_expected:
                    best = draft
        return best

    def request_finished(self, request_id: str, token_ids: Sequence[int], prompt_len: int) -> None:
        """The request ended: drop its own state; add its output (token_ids[prompt_len:]) to the global cache."""
        self._requests.pop(request_id, None)
        if self.max_cached_requests == 0:
            return
        old = self._cached.pop(request_id, None)
        if old is not None:  # a reused id: its previous output is replaced, not counted twice
            self._global.remove(old)
        output = tuple(token_ids[prompt_len:])
        if not output:
            return
        self._global.insert(output)
        self._cached[request_id] = output
        while len(self._cached) > self.max_cached_requests:
            _, evicted = self._cached.popitem(last=False)
            self._global.remove(evicted)

    def _sync(self, request_id: str, token_ids: Sequence[int]) -> _RequestState:
        """Bring the request's trie up to token_ids, adding only the tokens it has not seen."""
        state = self._requests.get(request_id)
        seen = state.seen if state is not None else 0
        # Shorter than seen, or a different token where the last seen one was: the request was reset
        # (preempted and recomputed, or the id reused); its old counts would be wrong, so rebuild.
        if state is None or len(token_ids) < seen or (seen and token_ids[seen - 1] != state.last_token):
            state = self._requests[request_id] = _RequestState(self.max_tree_depth)
            seen = 0
        trie, active = state.trie, state.active
        for i in range(seen, len(token_ids)):
            active = trie.extend(active, token_ids[i])
        state.active = active
        state.seen = len(token_ids)
        if token_ids:
            state.last_token = token_ids[-1]
        return state

    @staticmethod
    def _own_match(state: _RequestState) -> tuple[_Node, int]:
        # The request's suffixes are all in its own trie (the active nodes), so no search is needed:
        # the longest one that also occurs earlier, followed by something, is the match.
        for i in range(len(state.active) - 1, -1, -1):
            if state.active[i].followed > 0:
                return state.active[i], i + 1
        return state.trie.root, 0

    def _draft(self, trie: _SuffixTrie, node: _Node, length: int, max_tokens: int) -> tuple[list[int], float]:
        # Adaptive length: a match of L tokens earns at most max_spec_factor * L draft tokens.
        limit = min(max_tokens, int(self.max_spec_factor * length))
        if length == 0 or limit <= 0:
            return [], 0.0
        return trie.walk(node, length, limit, self.min_token_prob)
