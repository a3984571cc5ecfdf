"""``qwen3_coder`` (Qwen3-Coder): XML calls whose parameter values are typed by the tool's JSON schema.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is kept as text for string parameters and read as a number, boolean, object or array
when the schema says so (as vLLM's ``qwen3_coder``); "null" is null for any type. The text before
the first call is the content. Streamed, a call opens once ``<function=NAME>`` is complete and
its arguments grow one complete parameter at a time.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from typing import Any

from pagedllm.entrypoints.openai.tool_formats.base import (
    ParsedToolCall,
    PartialToolCall,
    StreamView,
    ToolParser,
    content_end_before,
)

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
_FUNCTION = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
# A parameter ends at its end tag, or (the model forgot it) where the next parameter or the function ends.
_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
_COMPLETE_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>))", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")


def _schema_type(schema: Any) -> str:
    kind = schema.get("type", "string") if isinstance(schema, dict) else "string"
    if isinstance(kind, list):  # ["integer", "null"]: the non-null one decides
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower()


def convert_parameter(value: str, schema: dict[str, Any] | None) -> Any:
    """A parameter's text as the value its schema types it to; what does not convert stays text."""
    if value.lower() == "null":
        return None
    if schema is None:  # a parameter the tool does not declare
        return value
    kind = _schema_type(schema)
    if kind in _STRING_TYPES:
        return value
    if kind.startswith(_INTEGER_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"
    if kind in ("object", "array", "arr") or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    markers = ("<tool_call>", "<function=")

    def new_call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _argument(self, function_name: str, name: str, raw: str) -> tuple[str, Any]:
        properties = self.tool_schema(function_name).get("properties")
        schema = properties.get(name) if isinstance(properties, dict) else None
        return name, convert_parameter(_strip_one_newline(raw), schema)

    def _function_bodies(self, text: str) -> list[str]:
        blocks = [a or b for a, b in _CALL.findall(text)] or [text]
        return [a or b for block in blocks for a, b in _FUNCTION.findall(block)]

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        if "<function=" not in text:
            return text, []
        calls = []
        for body in self._function_bodies(text):
            if ">" not in body:
                return text, []
            name, parameters = body.split(">", 1)
            arguments = {}
            for match in _PARAMETER.findall(parameters):
                if ">" not in match:
                    continue
                key, raw = match.split(">", 1)
                key, value = self._argument(name, key, raw)
                arguments[key] = value
            calls.append(ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False), self.new_call_id()))
        if not calls:
            return text, []
        start = text.find("<tool_call>")
        content = text[: start if start >= 0 else text.find("<function=")]
        return content or None, calls

    def content_end(self, text: str) -> int:
        return content_end_before(text, self.markers)

    def stream_view(self, text: str) -> StreamView:
        view = StreamView(self.content_end(text))
        for match in re.finditer(r"<function=([^>]*)>", text[view.content_end :]):
            start = view.content_end + match.end()
            end = text.find("</function>", start)
            body = text[start : end + len("</function>") if end >= 0 else len(text)]
            pieces = []
            for key, raw in _COMPLETE_PARAMETER.findall(body):
                key, value = self._argument(match.group(1), key, raw)
                pieces.append(f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}")
            arguments = "{" + ", ".join(pieces) + ("}" if end >= 0 else "")
            view.calls.append(PartialToolCall(match.group(1), arguments))
        return view
