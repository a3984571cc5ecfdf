"""SamplingParams: how one request is decoded, validated before anything is scheduled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

_SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    """Decoding settings of one request (names and meaning follow vLLM).

    temperature 0 means greedy. ``max_tokens`` counts generated tokens only.
    ``stop`` strings end the output and are not included in the text.
    ``logprobs=k`` returns the chosen token's log-probability and the top ``k``.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Beam search lives in the engine, as in the paper (used by the sharing work).
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.use_beam_search and self.beam_width is not None and self.best_of is None:
            self.best_of = self.beam_width
        if self.best_of is None:
            self.best_of = self.n
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the field and the accepted range for any bad setting."""
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}.")
        _check(
            isinstance(self.best_of, int) and self.best_of >= self.n,
            f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}.",
        )
        _check(self.temperature >= 0.0, f"temperature must be >= 0 (0 means greedy), got {self.temperature}.")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
            f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}.",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        _check(
            -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}."
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
        )
        _check(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}.")
        _check(
            self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.",
        )
        _check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens}).",
            )
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
            f"logprobs must be an integer in [0, 20], got {self.logprobs!r}.",
        )
        _check(
            self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
            f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs!r}.",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop_strings),
            "stop must be a non-empty string or a list of them.",
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.",
        )
        _check(
            self.seed is None or isinstance(self.seed, int), f"seed must be an integer or None, got {self.seed!r}."
        )
        if self.use_beam_search:
            # Beam search is deterministic (HF's do_sample=False): temperature, top_p, top_k, min_p
            # and seed are ignored. Beams end on EOS and stop_token_ids only, as HF's eos list does.
            _check(self.best_of > 1 or self.n == 1, "beam search needs best_of (the beam width) > 1.")
            _check(
                self.beam_width is None or self.beam_width == self.best_of,
                f"beam_width ({self.beam_width}) and best_of ({self.best_of}) disagree; give one of them.",
            )
            _check(not self.stop_strings, "stop strings are not supported with beam search; use stop_token_ids.")
            _check(
                self.early_stopping in (True, False, "never"),
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}.",
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
