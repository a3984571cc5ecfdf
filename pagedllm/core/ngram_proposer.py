"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the last n tokens.

Output that copies its input (an edited file, a quoted passage, an extracted field) repeats spans of
the prompt or of itself; the tokens after the previous occurrence of the current n-gram are then a
good guess for what comes next. n goes from ``max_n`` down to ``min_n``: the longest match wins, and
the latest occurrence of it (the most recent context) is used.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens to follow ``token_ids`` ([] when no n-gram of min_n recurs)."""
        if max_tokens < 1 or len(token_ids) <= self.min_n:
            return []
        start = _longest_latest_match(token_ids, self.min_n, self.max_n)
        return [] if start is None else list(token_ids[start : start + max_tokens])

    def request_finished(self, request_id: str, token_ids: Sequence[int], prompt_len: int) -> None:
        """Prompt lookup keeps no state between steps."""


def _longest_latest_match(token_ids: Sequence[int], min_n: int, max_n: int) -> int | None:
    """Where the tokens after the best earlier match of the sequence's tail start, or None.

    One backward scan: at each earlier position holding the last token, count how many tokens
    before it agree with the tail (up to ``max_n``); the longest count of at least ``min_n`` wins,
    the latest position among equals, and a full ``max_n`` match ends the scan.
    """
    length = len(token_ids)
    last = token_ids[-1]
    best_len, best_follow = min_n - 1, None
    for end in range(length - 2, min_n - 2, -1):
        if token_ids[end] != last:
            continue
        n = 1
        while n < max_n and end - n >= 0 and token_ids[end - n] == token_ids[length - 1 - n]:
            n += 1
        if n > best_len:
            best_len, best_follow = n, end + 1
            if n == max_n:
                break
    return best_follow
