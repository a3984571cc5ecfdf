"""Tool calling on /v1/chat/completions: what ``tool_choice`` asks for, and reading calls out of replies.

- ``none``: plain text (the template still sees the tools, as vLLM does);
- ``auto``: free text; the server's ``--tool-call-parser`` reads tool calls out of it in the model's
  own format (needs ``--enable-auto-tool-choice``). With a ``strict: true`` tool, every call the
  model opens is constrained to its tool's schema (an xgrammar structural tag triggered by the
  format's call marker: hermes' ``<tool_call>``); a format without such a marker refuses strict
  tools under ``auto`` with a 400;
- ``required``: the reply is constrained (structured outputs) to a JSON array of
  ``{"name", "parameters"}`` objects, one of the given tools each (at most one without
  ``parallel_tool_calls``), so the arguments always parse and match their schema;
- a named function: the reply is constrained to that function's arguments.
As in vLLM, ``required`` and named calls do not depend on the parser's format: whatever the model,
they come back as ``tool_calls`` (with the parser's style of call ids where a server has one).

Streamed, a call opens with its id, type and name, then its arguments text follows piece by piece.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_base import bad_request
from pagedllm.entrypoints.openai.tool_formats.base import random_tool_call_id
from pagedllm.entrypoints.openai.tool_formats.json_text import scan_call_array
from pagedllm.entrypoints.openai.tool_parsers import (
    ParsedToolCall,
    PartialToolCall,
    StreamView,
    ToolParser,
    tool_call_from_json,
)
from pagedllm.sampling_params import StructuredOutputsParams

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]] | None = None  # for the chat template
    named: str | None = None
    constraint: StructuredOutputsParams | None = None
    parser: ToolParser | None = None  # reads "auto" replies; in every mode, the style of call ids

    @property
    def makes_calls(self) -> bool:
        return self.mode in ("required", "named") or (self.mode == "auto" and self.parser is not None)

    def new_call_id(self) -> str:
        return self.parser.new_call_id() if self.parser is not None else random_tool_call_id()


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
    request_parser = parser.for_request(template_tools) if parser is not None else None
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", template_tools)
    if choice == "auto":
        if not auto_enabled or request_parser is None:
            raise bad_request('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                              "--tool-call-parser; use \"required\" or a named function instead.", "tool_choice")
        if request_parser.needs_special_tokens:
            request.skip_special_tokens = False  # the call marker is a special token: keep it in the text
        return ToolPlan("auto", template_tools, parser=request_parser,
                        constraint=_strict_auto_constraint(request, request_parser))
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
        return ToolPlan("required", template_tools, constraint=compact, parser=request_parser)
    name = choice.function.name
    if name not in schemas:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools.", "tool_choice")
    return ToolPlan("named", template_tools, named=name, parser=request_parser,
                    constraint=StructuredOutputsParams(json=schemas[name], disable_any_whitespace=True))


def _strict_auto_constraint(request: ChatCompletionRequest, parser: ToolParser) -> StructuredOutputsParams | None:
    """Under "auto", strict tools constrain the calls (all tools' calls: a strict one's to its schema, the
    others' to an object), never the free text around them; None without strict tools."""
    tools = request.tools or []
    strict = [i for i, tool in enumerate(tools) if tool.function.strict]
    if not strict:
        return None
    schemas = {tool.function.name: (tool.function.parameters or _ANY_OBJECT) if tool.function.strict else _ANY_OBJECT
               for tool in tools}
    tag = parser.structural_tag(schemas, single_call=request.parallel_tool_calls is False)
    if tag is None:
        raise bad_request(
            f'tools[{strict[0]}].function.strict: strict tools under tool_choice "auto" are honoured only with '
            f"--tool-call-parser hermes (whose <tool_call> opens a call the server can constrain), not "
            f'{parser.name}; use tool_choice "required" or a named function (always held to the schema), or '
            "leave strict out.",
            f"tools.{strict[0]}.function.strict",
        )
    return StructuredOutputsParams(structural_tag=json.dumps(tag, ensure_ascii=False))


def parse_reply(plan: ToolPlan, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """(content, tool calls) of a finished reply."""
    if plan.mode == "named":
        return None, [ParsedToolCall(plan.named or "", text, plan.new_call_id())]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []  # cut short (max_tokens): no complete call to report
        calls = [tool_call_from_json(item, "parameters", call_id=plan.new_call_id()) for item in items] \
            if isinstance(items, list) else []
        return None, [call for call in calls if call is not None]
    if plan.mode == "auto" and plan.parser is not None:
        return plan.parser.parse(text)
    return text, []


def _required_view(text: str) -> StreamView:
    return StreamView(0, scan_call_array(text, 0, False, ("parameters",)))


@dataclass
class ToolCallStream:
    """One streamed choice's tool-call state: how much content went out, and each call's arguments sent."""

    plan: ToolPlan
    text: str = ""
    sent_content: int = 0
    sent_arguments: list[str] = field(default_factory=list)  # per opened call

    @property
    def sent_calls(self) -> int:
        return len(self.sent_arguments)

    def delta(self, new_text: str, finished: bool) -> list[dict[str, Any]]:
        """The message deltas (``content`` and/or ``tool_calls``) the new text makes sendable."""
        self.text += new_text
        plan = self.plan
        if plan.mode == "named":
            # The reply is the arguments: the call opens at once and the text streams as they come.
            calls = [PartialToolCall(plan.named or "", self.text)]
            return self._call_deltas(calls, [])
        if plan.mode == "required" or (plan.mode == "auto" and plan.parser is not None):
            return self._parsed_delta(finished)
        return [{"content": new_text}] if new_text else []

    def _parsed_delta(self, finished: bool) -> list[dict[str, Any]]:
        finals: list[ParsedToolCall] = []
        if finished:
            _, finals = parse_reply(self.plan, self.text)
            # Content before the calls went out as it came; without calls the whole reply is content,
            # unless calls went out already (a reply cut short inside a call: the call stays as sent).
            whole_is_content = not finals and not self.sent_arguments
            view = StreamView(len(self.text) if whole_is_content else self.sent_content,
                              [PartialToolCall(call.name, call.arguments) for call in finals])
        elif self.plan.mode == "required":
            view = _required_view(self.text)
        else:
            assert self.plan.parser is not None
            view = self.plan.parser.stream_view(self.text)
        deltas: list[dict[str, Any]] = []
        if view.content_end > self.sent_content:
            deltas.append({"content": self.text[self.sent_content : view.content_end]})
            self.sent_content = view.content_end
        return deltas + self._call_deltas(view.calls, finals)

    def _call_deltas(self, calls: list[PartialToolCall], finals: list[ParsedToolCall]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(calls):
            if index == len(self.sent_arguments):
                call_id = finals[index].id if index < len(finals) else self.plan.new_call_id()
                deltas.append({"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                               "function": {"name": call.name}}]})
                self.sent_arguments.append("")
            sent = self.sent_arguments[index]
            # Arguments only grow; a view that disagrees with what went out (a malformed reply) adds nothing.
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append({"tool_calls": [{"index": index,
                                               "function": {"arguments": call.arguments[len(sent) :]}}]})
                self.sent_arguments[index] = call.arguments
        return deltas
