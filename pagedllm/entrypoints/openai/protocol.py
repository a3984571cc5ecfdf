"""Request and response bodies of the OpenAI-compatible API (OpenAI's names plus vLLM's extras)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from pagedllm.engine.inputs import unencodable_char

# torch.manual_seed takes a signed or unsigned 64-bit seed; refuse what it cannot take up front.
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 63) - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    # Unknown fields are ignored (as OpenAI and vLLM do); NaN and infinity are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


def _real_number(value: Any) -> Any:
    """A JSON number as a float; refuses true/false and strings ("0.5"), which lax parsing would take."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    try:
        return float(value)
    except OverflowError:  # an integer literal too large for a float
        raise ValueError("must be a finite number") from None


# Request fields take exactly their JSON type: no true for 1, no "5" for 5, no 2.0 for 2.
Number = Annotated[float, BeforeValidator(_real_number)]
Int = StrictInt
Bool = StrictBool


def _first_unencodable(value: Any) -> tuple[int, str] | None:
    """(index, character) of the first lone surrogate in any string inside value (lists, dict keys and values)."""
    if isinstance(value, str):
        index = unencodable_char(value)
        return None if index is None else (index, value[index])
    if isinstance(value, list):
        if value and isinstance(value[0], int):
            return None  # token ids (validated lists are homogeneous)
        items: Any = value
    elif isinstance(value, dict):
        items = [item for pair in value.items() for item in pair]
    else:
        return None
    for item in items:
        found = _first_unencodable(item)
        if found is not None:
            return found
    return None


class RequestModel(OpenAIModel):
    """A request body: every string in it must be valid Unicode (no lone UTF-16 surrogates).

    JSON can carry an unpaired surrogate as a "\\ud800" escape; no tokenizer can encode it and no
    response could echo it, so it is a 400 here, naming the field.
    """

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any, info: ValidationInfo) -> Any:
        found = _first_unencodable(value)
        if found is not None:
            index, char = found
            raise ValueError(
                f"the text holds an unpaired UTF-16 surrogate (U+{ord(char):04X}) at character {index}, which is "
                "not valid Unicode; send valid UTF-8 text (or pair the surrogate)"
            )
        return value


# ---------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------- shared pieces


class StreamOptions(RequestModel):
    include_usage: Bool | None = False
    continuous_usage_stats: Bool | None = False


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class SamplingFields(RequestModel):
    """Fields both endpoints share; they map onto SamplingParams (which checks their ranges)."""

    model: str | None = None
    n: Int = 1
    best_of: Int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stop: str | list[str] | None = None
    seed: Int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: Number | None = 0.0
    frequency_penalty: Number | None = 0.0
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: Bool = False
    use_beam_search: Bool = False
    length_penalty: Number = 1.0
    skip_special_tokens: Bool = True
    spaces_between_special_tokens: Bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool | None = False
    suffix: str | None = None
    logit_bias: dict[str, Number] | None = None


class ChatMessage(RequestModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    logit_bias: dict[str, Number] | None = None
    # vLLM's chat extras
    add_generation_prompt: Bool = True
    echo: Bool = False


# ---------------------------------------------------------------------------- completions


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    pass


# ---------------------------------------------------------------------------- chat


class ChatTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------------- models, tokenizer


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
