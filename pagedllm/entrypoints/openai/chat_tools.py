"""Tool calling on /v1/chat/completions: what ``tool_choice`` asks for, and reading calls out of replies.

- ``none``: plain text (the template still sees the tools, as vLLM does);
- ``auto``: free text; the server's ``--tool-call-parser`` reads tool calls out of it (needs
  ``--enable-auto-tool-choice``);
- ``required``: the reply is constrained (structured outputs) to a JSON array of
  ``{"name", "parameters"}`` objects, one of the given tools each (at most one without
  ``parallel_tool_calls``), so the arguments always parse and match their schema;
- a named function: the reply is constrained to that function's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_base import bad_request
from pagedllm.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser, tool_call_from_json
from pagedllm.sampling_params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None = None  # for the chat template
    named: str | None = None
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None

    @property
    def makes_calls(self) -> bool:
        return self.mode in ("required", "named") or (self.mode == "auto" and self.parser is not None)


def tool_plan(request: ChatCompletionRequest, parser: ToolParser | None, auto_enabled: bool) -> ToolPlan:
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", "tool_choice")
        return ToolPlan("none")
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: every function needs its own name.", "tools")
    template_tools = [tool.model_dump(exclude_none=True, by_alias=True) for tool in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", template_tools)
    if choice == "auto":
        if not auto_enabled or parser is None:
            raise bad_request('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                              "--tool-call-parser; use \"required\" or a named function instead.", "tool_choice")
        return ToolPlan("auto", template_tools, parser=parser)
    schemas = {tool.function.name: tool.function.parameters or _ANY_OBJECT for tool in tools}
    if choice == "required":
        alternatives = [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"]}
            for name, schema in schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}
        if request.parallel_tool_calls is False:
            array["maxItems"] = 1
        compact = StructuredOutputsParams(json=array, disable_any_whitespace=True)
        return ToolPlan("required", template_tools, constraint=compact)
    name = choice.function.name
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools.", "tool_choice")
    return ToolPlan("named", template_tools, named=name, constraint=StructuredOutputsParams(json=schemas[name],
                                                                            disable_any_whitespace=True))


def parse_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, tool calls) of a finished reply."""
    if plan.mode == "named":
        return None, [ParsedToolCall(plan.named or "", text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens): no complete call to report
        calls = [tool_call_from_json(item, "parameters") for item in items] if isinstance(items, list) else []
        return None, [call for call in calls if call is not None]
    if plan.mode == "auto" and plan.parser is not None:
        return plan.parser.parse(text)
    return text, []


@dataclass
class ToolCallStream:
    """One streamed choice's tool-call state: which content and which calls were sent."""

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0
    sent_calls: int = 0
    named_call: ParsedToolCall | None = None

    def delta(self, new_text: str, finished: bool) -> list[dict[str, Any]]:
        """The message deltas (``content`` and/or ``tool_calls``) the new text makes sendable."""
        self.text += new_text
        plan = self.plan
        if plan.mode == "named":
            deltas = []
            if self.named_call is None:  # the call opens with its id and name, then the arguments stream
                self.named_call = ParsedToolCall(plan.named or "", "")
                self.sent_calls = 1
                opening = self.named_call.to_openai()
                deltas.append({"tool_calls": [{"index": 0, **opening}]})
            if new_text:
                self.named_call.arguments += new_text
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": new_text}}]})
            return deltas
        if plan.mode == "required" or (plan.mode == "auto" and plan.parser is not None):
            return self._parsed_delta(finished)
        return [{"content": new_text}] if new_text else []

    def _parsed_delta(self, finished: bool) -> list[dict[str, Any]]:
        parser = self.plan.parser
        if finished:
            _, calls = parse_reply(self.plan, self.text)
            # Content before the calls went out as it came; without calls the whole reply is content.
            content_end = self.sent_content if calls else len(self.text)
        else:
            calls = parser.complete_calls(self.text) if parser is not None else []
            content_end = parser.content_end(self.text) if parser is not None else 0
        deltas: list[dict[str, Any]] = []
        if content_end > self.sent_content:
            deltas.append({"content": self.text[self.sent_content : content_end]})
            self.sent_content = content_end
        for index in range(self.sent_calls, len(calls)):
            deltas.append({"tool_calls": [{"index": index, **calls[index].to_openai()}]})
        self.sent_calls = max(self.sent_calls, len(calls))
        return deltas
