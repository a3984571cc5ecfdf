"""A Responses request as the chat request the server already serves.

Input items (messages, ``function_call`` / ``function_call_output`` items, ``reasoning`` items)
become chat messages, flat function tools the chat form, ``text.format`` a ``response_format``,
``reasoning.effort`` the chat's ``reasoning_effort``. Each item is checked once, when it arrives,
and stored checked, so a continuation's earlier turns convert without another check.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_base import bad_request

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
_FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
# include values this server can fill in.
SUPPORTED_INCLUDES = ("message.output_text.logprobs",)

# OpenAI fields this server does not implement: (accepted values besides null, why it is refused).
_REFUSED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "background": ((False,), "background responses are not supported; leave out background or set it to false"),
    "max_tool_calls": ((), "max_tool_calls limits built-in tool calls, and this server runs function tools only"),
    "conversation": ((), "conversation objects are not supported; chain responses with previous_response_id"),
    "prompt": ((), "stored prompt templates are not supported; send input and instructions"),
    "prompt_cache_retention": (("in_memory",), "the prefix cache lives in memory only: 'in_memory'"),
    "truncation": (("disabled",), "the server never drops earlier input to fit the context; 'disabled' only"),
}


def refuse_unsupported_fields(request: ResponsesRequest) -> None:
    """A 400 naming the first field this server does not implement, or does not know."""
    if request.model_extra:
        names = sorted(request.model_extra)
        raise bad_request(f"Unknown field(s) for /v1/responses: {', '.join(names[:10])}.", names[0])
    for name, (accepted, reason) in _REFUSED_FIELDS.items():
        value = getattr(request, name)
        if value is not None and value not in accepted:
            raise bad_request(f"{name}: {reason}.", name)
    for value in request.include or []:
        if value not in SUPPORTED_INCLUDES:
            raise bad_request(
                f"include: {value!r} is not supported; this server can include {list(SUPPORTED_INCLUDES)}.", "include"
            )
    if request.stream_options is not None:
        if not request.stream:
            raise bad_request("stream_options is only allowed with stream set to true.", "stream_options")
        unknown = sorted(set(request.stream_options) - {"include_obfuscation"})
        if unknown:
            raise bad_request(f"stream_options: unknown field(s) {unknown}.", "stream_options")
        if request.stream_options.get("include_obfuscation"):
            raise bad_request(
                "stream_options.include_obfuscation: this server adds no obfuscation padding to "
                "stream events; set it to false.",
                "stream_options",
            )
    if request.reasoning is not None:
        for name in ("summary", "generate_summary"):
            if getattr(request.reasoning, name) is not None:
                raise bad_request(
                    f"reasoning.{name}: this server writes no reasoning summaries; a reasoning "
                    "model's reasoning comes in full as reasoning_text content.",
                    "reasoning",
                )
        if request.reasoning.model_extra:
            raise bad_request(f"reasoning: unknown field(s) {sorted(request.reasoning.model_extra)}.", "reasoning")
    if request.text is not None and request.text.model_extra:
        raise bad_request(f"text: unknown field(s) {sorted(request.text.model_extra)}.", "text")
    if request.metadata is not None:
        if len(request.metadata) > 16:
            raise bad_request("metadata holds at most 16 keys.", "metadata")
        for key, value in request.metadata.items():
            if len(key) > 64 or len(value) > 512:
                raise bad_request("metadata keys are at most 64 characters long, values at most 512.", "metadata")


# ---------------------------------------------------------------------------- input items


def _text_of_parts(parts: Any, allowed: tuple[str, ...], where: str) -> str:
    """The text of a content list (parts joined by newlines, as the chat path joins them)."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad_request(f"{where} must be a string or a list of {'/'.join(allowed)} parts.", "input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in allowed or not isinstance(part.get("text"), str):
            raise bad_request(
                f"{where}[{j}]: only {'/'.join(allowed)} parts with text are supported (this server "
                f"reads text only), got {kind!r}.",
                "input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string.", "input")
    return value


def _checked_item(item: Any, where: str) -> dict[str, Any]:
    """The item in its canonical form (what is stored and later converted), or a 400 saying what is wrong."""
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object (an input item).", "input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _MESSAGE_ROLES:
            raise bad_request(f"{where}.role must be one of {list(_MESSAGE_ROLES)}, got {role!r}.", "input")
        content = item.get("content")
        part_type = "output_text" if role == "assistant" else "input_text"
        if isinstance(content, str):
            parts = [{"type": part_type, "text": content}]
        else:
            allowed = (*_TEXT_PARTS, "refusal") if role == "assistant" else _TEXT_PARTS
            if not isinstance(content, list):
                raise bad_request(f"{where}.content must be a string or a list of content parts.", "input")
            for j, part in enumerate(content):
                kind_j = part.get("type") if isinstance(part, dict) else None
                text_key = "refusal" if kind_j == "refusal" else "text"
                if kind_j not in allowed or not isinstance(part.get(text_key), str):
                    raise bad_request(
                        f"{where}.content[{j}]: only {'/'.join(allowed)} parts are supported (this "
                        f"server reads text only), got {kind_j!r}.",
                        "input",
                    )
            parts = [
                {"type": "refusal", "refusal": p["refusal"]}
                if p["type"] == "refusal"
                else {"type": p["type"], "text": p["text"]}
                for p in content
            ]
        return {"type": "message", "role": role, "content": parts}
    if kind == "function_call":
        return {
            "type": "function_call",
            "call_id": _string(item, "call_id", where),
            "name": _string(item, "name", where),
            "arguments": _string(item, "arguments", where),
        }
    if kind == "function_call_output":
        output = _text_of_parts(item.get("output"), ("input_text",), f"{where}.output")
        return {"type": "function_call_output", "call_id": _string(item, "call_id", where), "output": output}
    if kind == "reasoning":
        if item.get("encrypted_content") is not None:
            raise bad_request(
                f"{where}.encrypted_content: this server writes no encrypted reasoning and cannot "
                "read any; send the reasoning as content.",
                "input",
            )
        text = _text_of_parts(item.get("content") or [], ("reasoning_text",), f"{where}.content")
        if not text:
            text = _text_of_parts(item.get("summary") or [], ("summary_text",), f"{where}.summary")
        return {"type": "reasoning", "content": [{"type": "reasoning_text", "text": text}]}
    raise bad_request(
        f"{where}.type {kind!r} is not supported; this server takes message, function_call, "
        "function_call_output and reasoning items.",
        "input",
    )


def input_items(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as canonical items: a string is one user message."""
    if isinstance(request.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": request.input}]}]
    if not request.input:
        raise bad_request("input must hold at least one item.", "input")
    return [_checked_item(item, f"input[{i}]") for i, item in enumerate(request.input)]


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Canonical items (and the instructions, as a system message first) as chat messages.

    Consecutive function calls join the assistant turn before them; a reasoning item's text goes
    to the next assistant message as ``reasoning_content`` where the chat messages carry it.
    """
    carries_reasoning = "reasoning_content" in ChatMessage.model_fields
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    reasoning: str | None = None
    assistant_open = False  # the last message is an assistant turn a function call may join

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        nonlocal reasoning
        if reasoning is not None and carries_reasoning:
            message["reasoning_content"] = reasoning
        reasoning = None
        return message

    for item in items:
        kind = item["type"]
        if kind == "message":
            texts = [{"type": "text", "text": p["text"]} for p in item["content"] if p["type"] != "refusal"]
            message: dict[str, Any] = {"role": item["role"], "content": texts[0]["text"] if len(texts) == 1 else texts}
            refusals = [p["refusal"] for p in item["content"] if p["type"] == "refusal"]
            if refusals:
                message["refusal"] = "\n".join(refusals)
            messages.append(assistant(message) if item["role"] == "assistant" else message)
            assistant_open = item["role"] == "assistant"
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            reasoning = text if reasoning is None else reasoning + "\n" + text
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if not assistant_open:
                messages.append(assistant({"role": "assistant", "content": None}))
                assistant_open = True
            messages[-1].setdefault("tool_calls", []).append(call)
        else:  # function_call_output
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
            assistant_open = False
    return messages


# ---------------------------------------------------------------------------- tools, formats


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat form; any other tool type is a 400 naming it."""
    if tools is None:
        return None
    result = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(
                f"tools[{i}]: tool type {kind!r} is not supported; this server runs function tools only.", "tools"
            )
        if "function" in tool:
            raise bad_request(
                f"tools[{i}]: the Responses API takes a function tool flat ({{type, name, "
                "description, parameters, strict}}), not nested under function.",
                "tools",
            )
        unknown = sorted(set(tool) - _FUNCTION_TOOL_KEYS)
        if unknown:
            raise bad_request(f"tools[{i}]: unknown field(s) {unknown}.", "tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string.", "tools")
        function = {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None
        }
        result.append({"type": "function", "function": function})
    return result


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "none", "auto", "required"):
            raise bad_request(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}.", "tool_choice"
            )
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request(
            f"tool_choice of type {choice.get('type')!r} is not supported; name a function as "
            '{"type": "function", "name": ...}.',
            "tool_choice",
        )
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_response_format(text_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat's response_format (structured outputs)."""
    if text_format is None:
        return None
    kind = text_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(text_format.get("schema"), dict):
            raise bad_request("text.format of type json_schema needs a schema (a JSON Schema object).", "text")
        schema = {
            key: text_format[key]
            for key in ("name", "description", "schema", "strict")
            if text_format.get(key) is not None
        }
        return {"type": "json_schema", "json_schema": schema}
    raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.", "text")


def chat_request_body(request: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The body of the equivalent chat completion request."""
    logprobs = request.top_logprobs is not None or "message.output_text.logprobs" in (request.include or [])
    body: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "tools": chat_tools(request.tools),
        "tool_choice": chat_tool_choice(request.tool_choice),
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": chat_response_format(request.text.format if request.text else None),
        "verbosity": request.text.verbosity if request.text else None,
        "reasoning_effort": request.reasoning.effort if request.reasoning else None,
        "logprobs": logprobs or None,
        "top_logprobs": (request.top_logprobs or 0) if logprobs else None,
        "user": request.user,
        "safety_identifier": request.safety_identifier,
        "prompt_cache_key": request.prompt_cache_key,
        "service_tier": request.service_tier,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "seed": request.seed,
        "stop": request.stop,
        "ignore_eos": request.ignore_eos,
        "priority": request.priority,
        "stream": bool(request.stream),
        "stream_options": {"include_usage": True} if request.stream else None,
    }
    if request.structured_outputs is not None:
        body["structured_outputs"] = request.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    return {key: value for key, value in body.items() if value is not None}
