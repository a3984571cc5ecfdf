"""Tool calls read out of generated text (``--tool-call-parser NAME``, vLLM's names): the registry.

Each format lives in its own module under ``tool_formats/`` (``base.py`` says what a parser
provides). ``--tool-call-parser``'s choices are this registry's names.
"""

from __future__ import annotations

from pagedllm.entrypoints.openai.openai_tool_parser import OpenAIToolParser
from pagedllm.entrypoints.openai.tool_formats.base import (
    ParsedToolCall,
    PartialToolCall,
    StreamView,
    ToolParser,
    partial_prefix_len,
    tool_call_from_json,
)
from pagedllm.entrypoints.openai.tool_formats.deepseek_v3 import DeepSeekV3ToolParser
from pagedllm.entrypoints.openai.tool_formats.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_formats.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_formats.mistral import MistralToolParser
from pagedllm.entrypoints.openai.tool_formats.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_formats.qwen3_coder import Qwen3CoderToolParser

_partial_prefix_len = partial_prefix_len  # the name parsers written before tool_formats/ import

__all__ = [
    "TOOL_PARSERS",
    "DeepSeekV3ToolParser",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedToolCall",
    "PartialToolCall",
    "PythonicToolParser",
    "Qwen3CoderToolParser",
    "StreamView",
    "ToolParser",
    "tool_call_from_json",
]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    Qwen3CoderToolParser.name: Qwen3CoderToolParser,
    MistralToolParser.name: MistralToolParser,
    PythonicToolParser.name: PythonicToolParser,
    DeepSeekV3ToolParser.name: DeepSeekV3ToolParser,
    OpenAIToolParser.name: OpenAIToolParser,
}
