"""Tool calling on /v1/chat/completions: tool_choice none / auto / required / named, the hermes and
llama3_json parsers, streamed tool_call deltas, and a round trip with a tool message."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_server import MODEL, ServerThread, assert_error, build_tiny_model, engine_args, serving, wait_idle

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.chat_tools import ToolCallStream, ToolPlan
from pagedllm.entrypoints.openai.tool_parsers import HermesToolParser, Llama3JsonToolParser

# A Hermes-style template (short: the tiny model's context is 256 tokens): the tools' names in a
# system turn, calls as <tool_call> blocks, results as <tool_response> turns (what HermesToolParser reads).
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-tools"))
    build_tiny_model(path)
    (tmp_path_factory.getbasetemp() / "hermes.jinja").write_text(HERMES_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    template = str(tmp_path_factory.getbasetemp() / "hermes.jinja")
    app = build_app(engine_args(model_dir), served_model_name=MODEL, chat_template=template,
                    tool_call_parser="hermes", enable_auto_tool_choice=True)
    with serving(app) as running:
        yield running


def check_weather_call(call) -> dict:
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    return arguments


def collect_stream(stream) -> tuple[str, list[dict], str | None]:
    """(content, tool calls merged from their deltas, finish_reason) of a streamed choice 0."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_required_round_trip_with_a_tool_message(client, http):
    # (A random model would go on adding calls to the array: one call at most keeps it short.)
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    call = choice.message.tool_calls[0]
    check_weather_call(call)
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    stream = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=12, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    content, calls, finish = collect_stream(stream)
    assert content and not calls and finish == "length"
    # The template rendered the call and the tool's answer into the prompt.
    rendered = http.post("/tokenize", json={"model": MODEL, "messages": [
        {**m, "tool_calls": [call.model_dump(exclude_none=True)]} if m["role"] == "assistant" else m
        for m in messages]}).json()["tokens"]
    text = http.post("/detokenize", json={"model": MODEL, "tokens": rendered}).json()["prompt"]
    assert "<tool_response>" in text and "temperature_c" in text and "get_weather" in text
    wait_idle(http)


def test_required_with_parallel_calls_and_streaming(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                           temperature=1.0, seed=3, n=3)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        assert choice.message.tool_calls[0].function.name in ("get_weather", "get_time")
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True)
    content, calls, finish = collect_stream(stream)
    assert finish == "tool_calls" and not content and calls and calls[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_named_function_streams_its_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named,
                                           max_tokens=60, temperature=0)
    whole = check_weather_call(reply.choices[0].message.tool_calls[0])
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], tool_choice=named,
                                            max_tokens=60, temperature=0, stream=True)
    chunks = list(stream)
    argument_deltas = [c.choices[0].delta.tool_calls[0].function.arguments for c in chunks
                       if c.choices and c.choices[0].delta.tool_calls]
    assert len(argument_deltas) > 2  # the arguments arrive piece by piece
    content, calls, finish = collect_stream(iter(chunks))
    assert finish == "tool_calls" and calls[0]["name"] == "get_weather" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == whole


def test_auto_reads_hermes_calls_from_the_reply(client):
    forced = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    regex = "Sure[.] " + forced.replace("{", r"\{").replace("}", r"\}")
    kwargs = dict(model=MODEL, messages=QUESTION, tools=[WEATHER, TIME], max_tokens=150, temperature=0,
                  extra_body={"guided_regex": regex})  # makes the random model write a call
    reply = client.chat.completions.create(**kwargs)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content == "Sure."
    assert message.tool_calls[0].function.name == "get_time"
    assert json.loads(message.tool_calls[0].function.arguments) == {"zone": "CET"}
    content, calls, finish = collect_stream(client.chat.completions.create(**kwargs, stream=True))
    assert content == "Sure. " and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_time", {"zone": "CET"})]
    # No call in the reply: all of it is content.
    plain = client.chat.completions.create(**{**kwargs, "extra_body": {"guided_regex": "No <tools> today"}})
    assert plain.choices[0].message.content == "No <tools> today" and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def test_llama3_json_server(model_dir, tmp_path_factory):
    template = str(tmp_path_factory.getbasetemp() / "hermes.jinja")
    app = build_app(engine_args(model_dir, num_kv_blocks=32), served_model_name=MODEL, chat_template=template,
                    tool_call_parser="llama3_json", enable_auto_tool_choice=True)
    with ServerThread(app) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="none", max_retries=0, timeout=120)
        regex = r'\{"name": "get_time", "parameters": \{"zone": "UTC"\}\}'
        reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[TIME], max_tokens=120,
                                               temperature=0, extra_body={"guided_regex": regex})
        message = reply.choices[0].message
        assert message.content is None and message.tool_calls[0].function.name == "get_time"
        content, calls, finish = collect_stream(client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[TIME], max_tokens=120, temperature=0, stream=True,
            extra_body={"guided_regex": regex}))
        assert not content and finish == "tool_calls" and json.loads(calls[0]["arguments"]) == {"zone": "UTC"}


def test_tool_request_errors(model_dir, http):
    base = {"model": MODEL, "messages": QUESTION, "max_tokens": 4}
    assert_error(http.post("/v1/chat/completions", json={**base, "tool_choice": "required"}), 400, "tool_choice")
    named = {"type": "function", "function": {"name": "nope"}}
    assert_error(http.post("/v1/chat/completions", json={**base, "tools": [WEATHER], "tool_choice": named}), 400,
                 "tool_choice", "not among the tools")
    assert_error(http.post("/v1/chat/completions", json={**base, "tools": [WEATHER, WEATHER]}), 400, "tools")
    assert_error(http.post("/v1/chat/completions", json={
        **base, "tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}), 400, "guided_regex")
    tool_without_id = QUESTION + [{"role": "tool", "content": "21"}]
    assert_error(http.post("/v1/chat/completions", json={**base, "messages": tool_without_id}), 400,
                 "messages.1.tool_call_id")
    # "auto" needs the server flags: a server without them refuses it.
    app = build_app(engine_args(model_dir, num_kv_blocks=16), served_model_name=MODEL)
    with ServerThread(app) as running:
        response = httpx.post(running.url + "/v1/chat/completions", json={**base, "tools": [WEATHER]}, timeout=30)
        assert_error(response, 400, "tool_choice", "--enable-auto-tool-choice")
        ok = httpx.post(running.url + "/v1/chat/completions",
                        json={**base, "tools": [WEATHER], "tool_choice": "none"}, timeout=30)
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"] == []
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        build_app(engine_args(model_dir), enable_auto_tool_choice=True)


# ----------------------------------------------------------------------------- parsers alone


def test_hermes_parser():
    parser = HermesToolParser()
    text = 'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n' \
           '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {"y": [2]})]
    assert parser.parse("no calls here") == ("no calls here", [])
    assert parser.parse("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parser.parse('<tool_call>{"name": "c", "arguments": {}}')[1][0].name == "c"  # cut before the end tag
    assert parser.content_end("Hello <tool_") == len("Hello ")
    assert parser.content_end("Hello <tool_call>{") == len("Hello ")
    assert parser.content_end("x < y") == len("x < y")


def test_llama3_json_parser():
    parser = Llama3JsonToolParser()
    content, calls = parser.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", '
                                  '"parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert parser.parse("Just text {not a call}") == ("Just text {not a call}", [])
    assert parser.parse('{"name": "a", "parameters": {"x": 1}} and more') == (
        '{"name": "a", "parameters": {"x": 1}} and more', [])
    assert parser.content_end("  {") == 0 and parser.content_end("<|py") == 0
    assert parser.content_end("Hi there") == len("Hi there")


def test_tool_call_stream_sends_content_then_each_call_once():
    stream = ToolCallStream(ToolPlan("auto", parser=HermesToolParser()))
    pieces = ["Hi", " <tool", '_call>{"name": "a", "arguments": {}}</tool_call>', "<tool_call>",
              '{"name": "b", "arguments": {"k": true}}</tool_call>']
    deltas = [stream.delta(piece, finished=False) for piece in pieces] + [stream.delta("", finished=True)]
    flat = [d for step in deltas for d in step]
    assert "".join(d.get("content", "") for d in flat) == "Hi "
    names = [d["tool_calls"][0]["function"]["name"] for d in flat if "id" in d.get("tool_calls", [{}])[0]]
    assert names == ["a", "b"] and stream.sent_calls == 2


# ----------------------------------------------------------------------------- strict tools under auto


@pytest.fixture(scope="module")
def marker_model_dir(tmp_path_factory) -> str:
    """The tiny model with <tool_call> and </tool_call> as one token each, so a logit bias can open a call."""
    path = str(tmp_path_factory.mktemp("tiny-tool-markers"))
    build_tiny_model(path, extra_tokens=("<tool_call>", "</tool_call>"))
    return path


def test_a_strict_tool_holds_auto_calls_to_its_schema(model_dir, marker_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    template = str(tmp_path_factory.getbasetemp() / "hermes.jinja")
    opener = AutoTokenizer.from_pretrained(marker_model_dir).convert_tokens_to_ids("<tool_call>")
    app = build_app(engine_args(marker_model_dir, num_kv_blocks=32), served_model_name=MODEL, chat_template=template,
                    tool_call_parser="hermes", enable_auto_tool_choice=True)
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    # The bias makes the random model open a call at once; what follows the marker is up to the model.
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 120, "temperature": 0,
            "logit_bias": {str(opener): 100}, "parallel_tool_calls": False}
    with ServerThread(app) as running, httpx.Client(base_url=running.url, timeout=120) as http:
        strict = http.post("/v1/chat/completions", json={**body, "tools": [strict_weather]}).json()
        choice = strict["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        # The same request without strict: the model writes what it likes after the marker, no valid call.
        loose = http.post("/v1/chat/completions", json={**body, "tools": [WEATHER]}).json()["choices"][0]
        assert loose["finish_reason"] != "tool_calls" and not loose["message"]["tool_calls"], loose
        wait_idle(http)


def test_strict_tools_under_auto_need_a_format_that_marks_its_calls(model_dir, tmp_path_factory):
    template = str(tmp_path_factory.getbasetemp() / "hermes.jinja")
    app = build_app(engine_args(model_dir, num_kv_blocks=16), served_model_name=MODEL, chat_template=template,
                    tool_call_parser="llama3_json", enable_auto_tool_choice=True)
    strict_weather = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    with ServerThread(app) as running:
        response = httpx.post(running.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 4, "tools": [TIME, strict_weather]})
        assert_error(response, 400, "tools.1.function.strict", "hermes")
        # Named and required calls are always held to the schema: strict changes nothing there.
        named = httpx.post(running.url + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": QUESTION, "max_tokens": 60, "tools": [strict_weather],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
        assert named.status_code == 200, named.text
