"""SamplingParams: how one request is decoded, validated before anything is scheduled.

Every setting is checked for its type (an int setting takes an int, never a bool; a float setting
a finite real number) and its range, so that nothing a client sends can reach the sampler, the
beam scorer or the stop checker as a value they cannot compute with. The ranges:

==========================  ===============================================================
temperature                 finite, >= 0 (0 = greedy; 0 < t < 0.01 is raised to 0.01, as vLLM)
top_p                       (0, 1]
top_k                       -1 (off) or an integer in [1, 2**31 - 1] (above the vocabulary: all of it)
min_p                       [0, 1]
presence/frequency_penalty  [-2, 2]
repetition_penalty          (0, 100]
length_penalty              [-10, 10] (beam search; ``len ** length_penalty`` stays finite)
n, best_of                  integers >= 1, best_of >= n
max_tokens                  None or an integer >= 1;  min_tokens: integer in [0, max_tokens]
logprobs, prompt_logprobs   None or an integer in [0, 20]
seed                        None or an integer in [-2**63, 2**64 - 1] (what torch can seed)
stop                        at most MAX_STOP_STRINGS non-empty strings of at most
                            MAX_STOP_STRING_CHARS characters each
stop_token_ids              at most MAX_STOP_TOKEN_IDS integers >= 0
structured_outputs          None or StructuredOutputsParams with exactly one constraint
                            (``guided_decoding`` is vLLM's older name for the same setting)
==========================  ===============================================================
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

_SAMPLING_EPS = 1e-5
# top_k travels as an int32 in the samplers' tensors; any k past the vocabulary means all of it anyway.
MAX_TOP_K = 2**31 - 1
# Below this a temperature turns logits into infinities; vLLM raises it to this value.
MIN_POSITIVE_TEMPERATURE = 1e-2
# Stop strings are searched after every token and held back from streams: cap their number and size
# so that one request cannot make those searches expensive for everyone.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_REPETITION_PENALTY = 100.0
MAX_ABS_LENGTH_PENALTY = 10.0
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 64) - 1


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text, enforced token by token (vLLM's names).

    Exactly one of: ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any
    JSON object), ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF in the GBNF
    dialect of llama.cpp / xgrammar), ``structural_tag`` (xgrammar's structural tag as JSON text:
    free text in which, e.g., a tool call opened by a trigger follows its schema; the chat server
    makes one for strict tools). ``disable_any_whitespace`` makes JSON output compact.
    Whether the schema, regex or grammar compiles is checked when the request is added.

    ``start_after_token_ids`` (a reasoning model's end-of-reasoning tokens, set by the chat server's
    reasoning parser): the constraint applies only once the output has generated this token
    sequence; the text before it, and the sequence itself, are free (vLLM's structured outputs
    after ``is_reasoning_end``). None: the constraint applies from the first token.
    ``optional_open_token_id`` makes that free part optional (a model that may open ``<think>`` or
    answer at once): an output that begins with this token waits for ``start_after_token_ids``;
    any other output is constrained from its first token.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    start_after_token_ids: list[int] | None = None
    optional_open_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, name) not in (None, False)]
        _check(len(given) == 1, "structured_outputs needs exactly one of json, json_object, regex, choice, grammar, "
               f"structural_tag; got {', '.join(given) or 'none'}.")
        _check(self.json is None or isinstance(self.json, (str, dict)),
               f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got {_short(self.json)}.")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != ""),
                   f"structured_outputs.{name} must be a non-empty string, got {_short(value)}.")
        _check(
            self.choice is None or (isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                                    and all(isinstance(c, str) for c in self.choice)),
            f"structured_outputs.choice must be a non-empty list of strings, got {_short(self.choice)}.",
        )
        _check(self.json_object in (None, True, False), "structured_outputs.json_object must be true or false.")
        _check(isinstance(self.disable_any_whitespace, bool),
               "structured_outputs.disable_any_whitespace must be true or false.")
        start = self.start_after_token_ids
        _check(start is None or (isinstance(start, (list, tuple)) and len(start) > 0 and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in start)),
            f"structured_outputs.start_after_token_ids must be a non-empty list of token ids, got {_short(start)}.")
        if start is not None:
            self.start_after_token_ids = list(start)
        opening = self.optional_open_token_id
        _check(opening is None or (isinstance(opening, int) and not isinstance(opening, bool) and opening >= 0),
               f"structured_outputs.optional_open_token_id must be a token id, got {_short(opening)}.")
        _check(opening is None or start is not None,
               "structured_outputs.optional_open_token_id needs start_after_token_ids.")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice", "grammar" or "structural_tag"."""
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


# vLLM's earlier name.
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """Decoding settings of one request (names and meaning follow vLLM).

    temperature 0 means greedy. ``max_tokens`` counts generated tokens only.
    ``stop`` strings end the output and are not included in the text.
    ``logprobs=k`` returns the chosen token's log-probability and the top ``k``.
    Bad settings raise ValueError naming the setting and its range (see the module docstring).
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
    # False: token ids only, the output text stays empty (vLLM's setting; stop strings need the text).
    detokenize: bool = True
    # Beam search lives in the engine, as in the paper (used by the sharing work).
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    # Constrained decoding (pagedllm/structured); guided_decoding is vLLM's older name for it.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None
    # {token id: bias added to its logit} (OpenAI's logit_bias; each bias in [-100, 100]).
    logit_bias: dict[int, float] | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Types first: the conversions below must not fail with a TypeError on odd input.
        if self.stop is None:
            self.stop_strings = []
        elif isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop_strings = list(self.stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}.")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        else:
            raise ValueError(
                f"stop_token_ids must be a list of integers, got {type(self.stop_token_ids).__name__}."
            )
        if self.guided_decoding is not None:
            _check(self.structured_outputs is None or self.structured_outputs == self.guided_decoding,
                   "structured_outputs and guided_decoding disagree; give one of them.")
            self.structured_outputs = self.guided_decoding
        self.guided_decoding = self.structured_outputs
        if self.use_beam_search is True and self.beam_width is not None and self.best_of is None:
            self.best_of = self.beam_width
        if self.best_of is None:
            self.best_of = self.n
        if _is_real(self.temperature) and 0.0 < self.temperature < MIN_POSITIVE_TEMPERATURE:
            logger.warning("temperature %s is below %s: raised to %s", self.temperature,
                           MIN_POSITIVE_TEMPERATURE, MIN_POSITIVE_TEMPERATURE)
            self.temperature = MIN_POSITIVE_TEMPERATURE
        self.verify()

    def verify(self) -> None:
        """Raise ValueError naming the field and the accepted range for any bad setting."""
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {_short(self.n)}.")
        _check(
            _is_int(self.best_of) and self.best_of >= self.n,
            f"best_of must be an integer >= n ({_short(self.n)}), got {_short(self.best_of)}.",
        )
        _check_real(self, "temperature", 0.0, math.inf, "must be >= 0 (0 means greedy)")
        _check_real(self, "top_p", 0.0, 1.0, "must be in (0, 1]", low_open=True)
        _check(
            _is_int(self.top_k) and (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K),
            f"top_k must be -1 (disabled) or an integer in [1, {MAX_TOP_K}], got {_short(self.top_k)}.",
        )
        _check_real(self, "min_p", 0.0, 1.0, "must be in [0, 1]")
        _check_real(self, "presence_penalty", -2.0, 2.0, "must be in [-2, 2]")
        _check_real(self, "frequency_penalty", -2.0, 2.0, "must be in [-2, 2]")
        _check_real(
            self, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY,
            f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = no penalty)", low_open=True,
        )
        _check_real(
            self, "length_penalty", -MAX_ABS_LENGTH_PENALTY, MAX_ABS_LENGTH_PENALTY,
            f"must be in [-{MAX_ABS_LENGTH_PENALTY:g}, {MAX_ABS_LENGTH_PENALTY:g}]",
        )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1, got {_short(self.max_tokens)}.",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {_short(self.min_tokens)}.",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens ({_short(self.min_tokens)}) must be <= max_tokens ({_short(self.max_tokens)}).",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {_short(value)}.",
            )
        _check(
            self.seed is None or (_is_int(self.seed) and _SEED_MIN <= self.seed <= _SEED_MAX),
            f"seed must be None or an integer in [-2**63, 2**64 - 1], got {_short(self.seed)}.",
        )
        self._verify_stops()
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            f"structured_outputs must be a StructuredOutputsParams, got {_short(self.structured_outputs)}.",
        )
        self._verify_logit_bias()
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                     "spaces_between_special_tokens", "use_beam_search", "detokenize"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be true or false, got {_short(value)}.")
        _check(self.detokenize or not self.stop_strings,
               "stop strings need detokenize=True: they are matched in the output text.")
        _check(
            self.beam_width is None or (_is_int(self.beam_width) and self.beam_width >= 1),
            f"beam_width must be None or an integer >= 1, got {_short(self.beam_width)}.",
        )
        _check(
            self.early_stopping is True or self.early_stopping is False or self.early_stopping == "never",
            f"early_stopping must be True, False or 'never', got {_short(self.early_stopping)}.",
        )
        if self.use_beam_search:
            # Beam search is deterministic (HF's do_sample=False): temperature, top_p, top_k, min_p
            # and seed are ignored. Beams end on EOS and stop_token_ids only, as HF's eos list does.
            _check(self.best_of > 1 or self.n == 1, "beam search needs best_of (the beam width) > 1.")
            _check(
                self.beam_width is None or self.beam_width == self.best_of,
                f"beam_width ({_short(self.beam_width)}) and best_of ({_short(self.best_of)}) disagree; "
                "give one of them.",
            )
            _check(not self.stop_strings, "stop strings are not supported with beam search; use stop_token_ids.")

    def _verify_stops(self) -> None:
        _check(
            len(self.stop_strings) <= MAX_STOP_STRINGS,
            f"stop holds {len(self.stop_strings)} strings; at most {MAX_STOP_STRINGS} are allowed.",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop_strings),
            "stop must be a non-empty string or a list of them.",
        )
        longest = max((len(s) for s in self.stop_strings), default=0)
        _check(
            longest <= MAX_STOP_STRING_CHARS,
            f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters long, got one of {longest}.",
        )
        token_ids = self.stop_token_ids or []
        _check(
            len(token_ids) <= MAX_STOP_TOKEN_IDS,
            f"stop_token_ids holds {len(token_ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed.",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in token_ids),
            f"stop_token_ids must be non-negative integers, got {_short(token_ids)}.",
        )

    def _verify_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        _check(isinstance(bias, dict), f"logit_bias must map token ids to numbers, got {_short(bias)}.")
        _check(len(bias) <= MAX_LOGIT_BIAS_ENTRIES,
               f"logit_bias holds {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed.")
        for token_id, value in bias.items():
            _check(_is_int(token_id) and token_id >= 0,
                   f"logit_bias keys must be token ids (integers >= 0), got {_short(token_id)}.")
            _check(_is_real(value) and math.isfinite(value) and -100 <= value <= 100,
                   f"logit_bias values must be numbers in [-100, 100], got {_short(value)} for token {token_id}.")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS


def _is_int(value: Any) -> bool:
    # bool is an int subclass: True must not pass for n=1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_real(
    params: SamplingParams, name: str, low: float, high: float, rule: str, low_open: bool = False
) -> None:
    """A finite real number within [low, high] ((low, high] with low_open)."""
    value = getattr(params, name)
    ok = _is_real(value)
    if ok:
        try:
            number = float(value)
        except OverflowError:  # an int too large for a float
            ok = False
        else:
            ok = math.isfinite(number) and (low < number if low_open else low <= number) and number <= high
    _check(ok, f"{name} {rule}, got {_short(value)}.")


def _short(value: Any) -> str:
    """repr() of a value, cut short: messages must stay readable whatever was sent."""
    if _is_int(value) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"  # repr() of a huge int is slow or refused
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
