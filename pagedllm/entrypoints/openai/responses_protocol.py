"""The request body of ``POST /v1/responses`` (OpenAI's Responses API) and its item ids.

Items, tools and formats arrive as plain JSON objects: responses_input.py checks each and says
which one is wrong, in the request's own terms, rather than a union's validation noise.
"""

from __future__ import annotations

import uuid
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    Bool,
    Int,
    Number,
    RequestModel,
    StructuredOutputsRequest,
    priority_field,
)


def item_id(prefix: str) -> str:
    """An id as OpenAI writes them: ``resp_...``, ``msg_...``, ``fc_...``, ``rs_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


class ReasoningConfig(RequestModel):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None  # the older name of summary


class TextConfig(RequestModel):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(RequestModel):
    """Every field of OpenAI's ``responses.create`` is declared here; the handler implements it or
    refuses it with a 400 naming it, and refuses fields neither OpenAI nor vLLM defines."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: Bool | None = None
    max_output_tokens: Int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_logprobs: Int | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: Bool | None = False
    stream_options: dict[str, Any] | None = None
    store: Bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    # Implemented by the server's automatic prefix caching, which needs no key.
    prompt_cache_key: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    service_tier: str | None = None
    # OpenAI fields refused unless left at a value that asks for nothing (serving_responses).
    background: Bool | None = None
    max_tool_calls: Int | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    # vLLM's sampling extras, as on the chat endpoint.
    top_k: Int | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    ignore_eos: Bool = False
    priority: Int = priority_field()
    structured_outputs: StructuredOutputsRequest | None = None
