"""Request and response bodies of the OpenAI-compatible API (OpenAI's names plus vLLM's extras)."""

from __future__ import annotations

import logging
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
    model_validator,
)

from pagedllm.engine.inputs import MAX_PRIORITY, MIN_PRIORITY, unencodable_char

logger = logging.getLogger("pagedllm.api")

# torch.manual_seed takes a signed or unsigned 64-bit seed; refuse what it cannot take up front.
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 63) - 1


def priority_field() -> Any:
    """vLLM's priority (lower first), in the engine's int64 range: a 400 before any work is done."""
    return Field(default=0, ge=MIN_PRIORITY, le=MAX_PRIORITY)


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
    response could echo it, so it is a 400 here, naming the field. A field neither OpenAI nor vLLM
    defines is ignored with a logged warning (as vLLM does); every field they define is declared
    here, and either implemented or refused with a 400 naming it.
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _warn_unknown_fields(self) -> RequestModel:
        if self.model_extra:
            names = ", ".join(sorted(self.model_extra)[:20])
            logger.warning("%s: ignoring unknown field(s): %s", type(self).__name__, names)
        return self

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


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    description: str | None = None
    # "schema" would shadow a BaseModel attribute.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's structured_outputs object: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None
    disable_any_whitespace: Bool = False
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None


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
    user: str | None = None  # written to the request's log line
    logit_bias: dict[str, Number] | None = None
    response_format: ResponseFormat | None = None
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
    prompt_logprobs: Int | None = None
    priority: Int = priority_field()
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = 16
    logprobs: Int | None = None
    echo: Bool | None = False
    suffix: str | None = None


class FunctionCall(RequestModel):
    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # An earlier reply's reasoning (vLLM's fields), handed to the chat template.
    reasoning_content: str | None = None
    reasoning: str | None = None
    # OpenAI's older assistant field, refused (see serving_chat).
    function_call: dict[str, Any] | None = None


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class ChatTool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: Bool | None = False
    top_logprobs: Int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = True
    # OpenAI fields this server refuses unless left at a value that asks for nothing (serving_chat).
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    store: Bool | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # Requests with one prompt_cache_key go to one data-parallel replica (serving/router.py); one
    # engine's automatic prefix caching needs no key. safety_identifier is written to the log line
    # as user is.
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's chat extras
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    echo: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


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
    # vLLM's: per prompt token {token id (as text): {logprob, rank, decoded_token}}, None for the first.
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


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
    # With --reasoning-parser: the reply's reasoning, apart from its content (vLLM's reasoning_content;
    # reasoning is vLLM's newer name for the same text).
    reasoning_content: str | None = None
    reasoning: str | None = None


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
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


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


# ---------------------------------------------------------------------------- embeddings


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings request plus vLLM's extras (add_special_tokens, normalize, truncate_prompt_tokens,
    priority)."""

    model: str | None = None
    input: str | list[str] | list[Int] | list[list[Int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = None
    user: str | None = None  # written to the request's log line
    add_special_tokens: Bool = True
    normalize: Bool | None = None
    # Keep only the last k tokens of each input (-1: the last max_model_len); None: refuse a longer input.
    truncate_prompt_tokens: Int | None = None
    priority: Int = priority_field()


class EmbeddingResponseData(OpenAIModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingResponse(OpenAIModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingResponseData]
    usage: UsageInfo


# ---------------------------------------------------------------------------- models, tokenizer


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    # What the model serves here: ["generate"] (completions, chat) or ["embed"] (embeddings), as the
    # engine's runner decides (vLLM's task names); a client picks its endpoint without trial and error.
    supported_tasks: list[str] | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    continue_final_message: Bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[Int]


class DetokenizeResponse(OpenAIModel):
    prompt: str
