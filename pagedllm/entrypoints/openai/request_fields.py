"""Request fields beyond plain sampling: structured-output constraints, logit_bias, refused fields.

Every field of OpenAI's request schemas is either implemented or refused here with a 400 naming
it; a refused field is accepted only at a value that asks for nothing (null, false, "auto", ...).
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.serving_base import bad_request
from pagedllm.sampling_params import StructuredOutputsParams

# Chat fields this server does not implement: (accepted values besides null, why it is refused).
_REFUSED_CHAT_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "audio": ((), "audio output is not supported: this server generates text only"),
    "functions": ((), "the deprecated functions field is not supported; send tools instead"),
    "function_call": ((), "the deprecated function_call field is not supported; send tool_choice instead"),
    "metadata": (({},), "metadata is stored with the completion, and this server stores nothing (store)"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "service_tier": (("auto", "default"), "this server has one service tier: 'auto' or 'default'"),
    "store": ((False,), "this server stores no completions; store must be false"),
    "verbosity": ((), "verbosity is not supported"),
    "web_search_options": ((), "web search is not supported"),
}
# Completion fields this server does not implement.
_REFUSED_COMPLETION_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "suffix": (("",), "this server has no fill-in-the-middle models"),
}
# Fields of both chat and completion requests (vLLM's extras) this server does not implement.
_REFUSED_SAMPLING_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "guided_whitespace_pattern": ((), "not supported; use structured_outputs.disable_any_whitespace for compact "
                                      "JSON"),
}


def _refuse(request: Any, table: dict[str, tuple[tuple[Any, ...], str]]) -> None:
    for name, (accepted, reason) in table.items():
        value = getattr(request, name)
        if value is not None and value not in accepted:
            raise bad_request(f"{name}: {reason}.", name)


def refuse_unsupported_chat_fields(request: Any) -> None:
    _refuse(request, _REFUSED_CHAT_FIELDS)
    for i, message in enumerate(request.messages):
        if message.function_call is not None:
            raise bad_request(f"messages[{i}].function_call: the deprecated function_call is not supported; "
                              "send tool_calls instead.", f"messages.{i}.function_call")


def refuse_unsupported_completion_fields(request: Any) -> None:
    _refuse(request, _REFUSED_COMPLETION_FIELDS)


# OpenAI's reasoning_effort values that vLLM (and GPT-OSS's chat template) take.
REASONING_EFFORTS = ("low", "medium", "high")


def chat_template_kwargs(request: Any) -> dict[str, Any] | None:
    """The request's chat_template_kwargs, with reasoning_effort added for templates that read it
    (GPT-OSS's); a bad reasoning_effort or enable_thinking is a 400."""
    kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    effort = getattr(request, "reasoning_effort", None)
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}.",
                              "reasoning_effort")
        kwargs.setdefault("reasoning_effort", effort)
    if not isinstance(kwargs.get("enable_thinking", False), bool):
        raise bad_request(f"chat_template_kwargs.enable_thinking must be true or false, got "
                          f"{kwargs['enable_thinking']!r}.", "chat_template_kwargs")
    return kwargs or None


def structured_outputs(request: Any) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from; more than one is a 400."""
    found: list[tuple[str, dict[str, Any]]] = []
    response_format = request.response_format
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            schema = response_format.json_schema.json_schema if response_format.json_schema else None
            if schema is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema.", "response_format")
            found.append(("response_format", {"json": schema}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(request, name)
        if value is not None:
            found.append((name, {key: value}))
    _refuse(request, _REFUSED_SAMPLING_FIELDS)
    if request.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise bad_request("guided_decoding_backend: this server's only backend is 'xgrammar'.",
                          "guided_decoding_backend")
    spec = request.structured_outputs
    if spec is not None:
        if spec.structural_tag is not None:
            raise bad_request("structured_outputs.structural_tag is not supported.", "structured_outputs")
        if spec.whitespace_pattern is not None:
            raise bad_request("structured_outputs.whitespace_pattern is not supported; use disable_any_whitespace.",
                              "structured_outputs")
        fields = {"json": spec.json_, "regex": spec.regex, "choice": spec.choice, "grammar": spec.grammar,
                  "json_object": spec.json_object}
        found.append(("structured_outputs", {k: v for k, v in fields.items() if v is not None}))
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"Give one output constraint, not several ({names}).", found[1][0])
    name, kwargs = found[0]
    compact = bool(spec.disable_any_whitespace) if spec is not None else False
    try:
        return StructuredOutputsParams(**kwargs, disable_any_whitespace=compact), name
    except ValueError as exc:
        raise bad_request(str(exc).replace("structured_outputs", name, 1), name) from exc
