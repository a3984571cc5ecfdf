"""The qwen3_coder, mistral, pythonic and deepseek_v3 tool-call parsers alone: parse, stream (split
every way), tool_choice required / named streamed for any parser, and the models' own chat templates
rendering our tool_calls messages (the rendered call parses back)."""

from __future__ import annotations

import json
import re

import pytest
from tool_parser_cases import (
    CALLS,
    DS_CALL_BEGIN,
    DS_CALLS_BEGIN,
    DS_SEP,
    MISTRAL_NAMED,
    NEW_PARSERS,
    QUESTION,
    REPLIES,
    TEMPLATE_FILES,
    TEMPLATES,
    TOOLS,
    build_tool_model,
)

from pagedllm.entrypoints.chat_utils import render_chat
from pagedllm.entrypoints.openai.chat_tools import ToolCallStream, ToolPlan, parse_reply, tool_plan
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagedllm.entrypoints.openai.serving_chat import conversation
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.entrypoints.serve_cli import add_server_args


def parser_for(name: str):
    return TOOL_PARSERS[name]().for_request(TOOLS)


def parsed(parser, text):
    content, calls = parser.parse(text)
    return content, [(call.name, json.loads(call.arguments)) for call in calls]


def stream(plan: ToolPlan, text: str, step: int) -> tuple[str, list[dict], list[dict]]:
    """(content, calls merged from their deltas, the tool_call deltas) of ``text`` sent ``step`` characters at once."""
    state = ToolCallStream(plan)
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    deltas = [d for piece in pieces for d in state.delta(piece, finished=False)] + state.delta("", finished=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    tool_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    for delta in tool_deltas:
        entry = calls.setdefault(delta["index"], {"id": None, "name": "", "arguments": ""})
        if "id" in delta:
            assert entry["id"] is None, "a call opens once"
            assert delta["type"] == "function" and "arguments" not in delta["function"]
            entry["id"], entry["name"] = delta["id"], delta["function"]["name"]
        else:
            assert set(delta["function"]) == {"arguments"} and entry["id"] is not None
            entry["arguments"] += delta["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)], tool_deltas


# ----------------------------------------------------------------------------- parse


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_parse_the_models_reply(name):
    reply, content = REPLIES[name]
    assert parsed(parser_for(name), reply) == (content, CALLS)


@pytest.mark.parametrize("name", NEW_PARSERS)
@pytest.mark.parametrize("text", ["Just an answer.", "x < y and [1, 2] {a}", "", "[TOOL_CALLS]", "<function=f"])
def test_text_without_calls_is_content(name, text):
    assert parser_for(name).parse(text) == (text, [])


def test_call_ids_in_each_models_style():
    _, calls = parser_for("mistral").parse(REPLIES["mistral"][0])
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in calls) and calls[0].id != calls[1].id
    _, calls = parser_for("qwen3_coder").parse(REPLIES["qwen3_coder"][0])
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    _, calls = parser_for("deepseek_v3").parse(REPLIES["deepseek_v3"][0])
    assert all(call.id.startswith("chatcmpl-tool-") for call in calls)


def test_qwen3_coder_types_values_by_the_schema():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": "number"}, "y": {"type": "number"}, "flag": {"type": "boolean"},
        "obj": {"type": "object"}, "items": {"type": "array"}, "text": {"type": "string"},
        "maybe": {"type": ["integer", "null"]}, "bad": {"type": "integer"}}}}}
    parser = TOOL_PARSERS["qwen3_coder"]().for_request([tool])
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in [
        ("n", "42"), ("x", "2.5"), ("y", "3.0"), ("flag", "False"), ("obj", '{"a": [1, null]}'), ("items", "[1, 2]"),
        ("text", "two\nlines, 007"), ("maybe", "null"), ("bad", "seven"), ("undeclared", "5")])
    content, calls = parsed(parser, f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>")
    assert content is None and calls == [("f", {
        "n": 42, "x": 2.5, "y": 3, "flag": False, "obj": {"a": [1, None]}, "items": [1, 2],
        "text": "two\nlines, 007", "maybe": None, "bad": "seven", "undeclared": "5"})]
    # A tool the request does not have: every value stays text. Without <tool_call>, <function= still counts.
    assert parsed(parser, "<function=g>\n<parameter=n>\n1\n</parameter>\n</function>") == (None, [("g", {"n": "1"})])


def test_mistral_newer_spelling_and_a_reply_cut_short():
    parser = parser_for("mistral")
    assert parsed(parser, MISTRAL_NAMED) == (None, CALLS)
    cut = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": '
    assert parser.parse(cut) == (cut, [])
    assert parsed(parser, '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "CET"}}] trailing')[1] == CALLS[1:]


def test_pythonic_literals_only():
    parser = parser_for("pythonic")
    text = '<|python_start|>[f(a=-1.5, b=[1, (2, 3)], c={"k": None}, d="é"), g()]<|python_end|>'
    assert parsed(parser, text) == (None, [("f", {"a": -1.5, "b": [1, [2, 3]], "c": {"k": None}, "d": "é"}),
                                           ("g", {})])
    for not_calls in ["[f(x=y)]", "[f(1)]", "[f(x=open('a'))]", "[f(**k)]", "[1, 2]", "[f(x=1)] and more", "[]"]:
        assert parser.parse(not_calls) == (not_calls, [])


def test_deepseek_v3_keeps_the_arguments_as_written():
    text = f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}f\n```json\n{{"a":1}}\n```<｜tool▁call▁end｜>'
    content, calls = parser_for("deepseek_v3").parse(text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a":1}')]


# ----------------------------------------------------------------------------- stream


@pytest.mark.parametrize("name", NEW_PARSERS + ["mistral_named"])
@pytest.mark.parametrize("step", [1, 2, 5, 10_000])
def test_stream_opens_each_call_then_streams_its_arguments(name, step):
    parser_name, (reply, content) = name, REPLIES.get(name, (MISTRAL_NAMED, None))
    if name == "mistral_named":
        parser_name = "mistral"
    parser = parser_for(parser_name)
    streamed_content, calls, tool_deltas = stream(ToolPlan("auto", parser=parser), reply, step)
    assert streamed_content == (content or "")  # nothing of a call marker leaks into the content
    _, finals = parser.parse(reply)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in finals]
    if step == 1:  # arguments arrive in pieces, after the call opened
        for index in range(len(CALLS)):
            pieces = [d for d in tool_deltas if d["index"] == index]
            assert "id" in pieces[0] and len(pieces) > 2


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_stream_of_plain_text_is_all_content(name):
    for text in ["Hello there, no tools today.", "[1, 2] is a list", "a [TOOL_CALLS b"]:
        content, calls, _ = stream(ToolPlan("auto", parser=parser_for(name)), text, 1)
        assert content == text and not calls


def test_content_before_a_marker_streams_before_the_reply_ends():
    for name, text, sure in [("qwen3_coder", "Hi <tool_c", "Hi "), ("deepseek_v3", "Hi <｜tool▁", "Hi "),
                             ("mistral", "Hi [TOOL_", "Hi "), ("pythonic", "Hi [x", "Hi [x"), ("pythonic", "[x", "")]:
        assert text[: parser_for(name).stream_view(text).content_end] == sure, name


def test_required_and_named_stream_for_every_parser():
    for name in [None, *TOOL_PARSERS]:
        parser = TOOL_PARSERS[name]().for_request(TOOLS) if name else None
        text = '[{"name":"get_weather","parameters":{"city":"Paris","days":3}},{"name":"get_time","parameters":{}}]'
        plan = ToolPlan("required", parser=parser)
        content, calls, _ = stream(plan, text, 1)
        _, finals = parse_reply(plan, text)
        assert not content and [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in finals]
        assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
        plan = ToolPlan("named", named="get_time", parser=parser)
        content, calls, _ = stream(plan, '{"zone":"UTC"}', 3)
        assert not content and calls[0]["name"] == "get_time" and calls[0]["arguments"] == '{"zone":"UTC"}'
        if name == "mistral":  # ids a Mistral template takes back, whatever the tool_choice
            assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0]["id"])
            assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id) for c in finals)


def test_tool_plan_keeps_special_tokens_for_mistral():
    request = ChatCompletionRequest(model="m", messages=QUESTION, tools=TOOLS)
    plan = tool_plan(request, TOOL_PARSERS["mistral"](), auto_enabled=True)
    assert plan.mode == "auto" and request.skip_special_tokens is False and plan.parser.tools[0]["function"]
    request = ChatCompletionRequest(model="m", messages=QUESTION, tools=TOOLS)
    tool_plan(request, TOOL_PARSERS["qwen3_coder"](), auto_enabled=True)
    assert request.skip_special_tokens is True


def test_every_registered_parser_is_a_cli_choice():
    import argparse

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    for name in TOOL_PARSERS:
        assert parser.parse_args(["--tool-call-parser", name]).tool_call_parser == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])


# ----------------------------------------------------------------------------- the models' chat templates


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tool-model"))
    build_tool_model(path)
    return AutoTokenizer.from_pretrained(path)


def _between(text: str, start: str, end: str) -> str:
    """From the first ``start`` up to the ``end`` after it (the templates' instructions come earlier)."""
    first = text.index(start)
    return text[first : text.index(end, first)]


@pytest.mark.parametrize("name", NEW_PARSERS)
def test_the_models_template_renders_our_tool_calls(name, tokenizer):
    parser = parser_for(name)
    _, calls = parser.parse(REPLIES[name][0])
    messages = [ChatMessage(**m) for m in [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.to_openai() for call in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temperature_c": 21})},
        {"role": "tool", "tool_call_id": calls[1].id, "content": json.dumps({"time": "12:00"})},
    ]]
    template = (TEMPLATES / TEMPLATE_FILES[name]).read_text()
    text, token_ids = render_chat(tokenizer, conversation(messages), template, add_generation_prompt=True,
                                  tools=TOOLS)
    assert token_ids and "get_weather" in text and "temperature_c" in text and "12:00" in text
    # The call as the template wrote it into the prompt reads back as the same call.
    written = {
        "qwen3_coder": lambda t: _between(t[t.index("<|im_start|>assistant") :], "<tool_call>", "<|im_end|>"),
        "mistral": lambda t: _between(t, "[TOOL_CALLS]", "</s>"),
        "deepseek_v3": lambda t: _between(t[t.index("<｜User｜>") :], DS_CALLS_BEGIN, "<｜end▁of▁sentence｜>"),
        # Llama 3.2's template writes strings unquoted (city=Paris): only the shape can be checked.
        "pythonic": None,
    }[name]
    if written is None:
        assert "[get_weather(city=Paris, days=3, detailed=True), get_time(zone=CET)]" in text
    else:
        assert parsed(parser, written(text))[1] == CALLS
    if name == "mistral":  # its template takes back only 9-character ids: what the parser makes
        assert f'"id": "{calls[0].id}"' in text and f'"call_id": "{calls[1].id}"' in text
    if name == "deepseek_v3":
        assert DS_CALL_BEGIN in text


def test_hermes_and_llama3_json_stream_their_arguments_too():
    cases = [
        ("hermes", 'Hi <tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
                   '<tool_call>{"arguments": {"city": "Paris", "days": 3}, "name": "get_weather"}</tool_call>', "Hi "),
        ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                        '{"name": "get_weather", "parameters": {"city":"Paris","days":3}}', ""),
    ]
    for name, text, content in cases:
        parser = parser_for(name)
        for step in (1, 4):
            streamed, calls, tool_deltas = stream(ToolPlan("auto", parser=parser), text, step)
            _, finals = parser.parse(text)
            assert streamed == content and len(finals) == 2
            assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in finals]
            assert len([d for d in tool_deltas if d["index"] == 0]) > 2 or step > 1


def test_a_reply_cut_short_inside_a_call_leaks_no_markup():
    reply = REPLIES["qwen3_coder"][0]
    cut = reply[: reply.index("<parameter=days>") + len("<parameter=days>\n3")]
    content, calls, _ = stream(ToolPlan("auto", parser=parser_for("qwen3_coder")), cut, 1)
    # As vLLM, a parameter the reply ended in counts once the reply is over.
    assert content == "I will check.\n" and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris", "days": 3}')]
    reply = REPLIES["deepseek_v3"][0]
    cut = reply[: reply.index('"days"')]
    content, calls, _ = stream(ToolPlan("auto", parser=parser_for("deepseek_v3")), cut, 1)
    assert parser_for("deepseek_v3").parse(cut) == (cut, [])
    assert content == "Let me look." and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris", ')]
    # Only the text before a marker that never became a call is held back until the end.
    content, calls, _ = stream(ToolPlan("auto", parser=parser_for("deepseek_v3")), f"Hi {DS_CALL_BEGIN}oops", 1)
    assert content == f"Hi {DS_CALL_BEGIN}oops" and not calls
