"""/v1/responses (OpenAI's Responses API) over the chat path, driven by the official openai client:
text, streamed events, instructions, function calls (a tool parser and constraints), continuations
with previous_response_id, the store, structured outputs, errors; reasoning items through the
translators alone (no reasoning model in the tiny fixtures)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import jsonschema
import pytest
from test_server import MODEL, assert_error, build_tiny_model, engine_args, serving, wait_idle
from test_tool_calls import HERMES_TEMPLATE, QUESTION

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.response_store import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.responses_input import chat_messages
from pagedllm.entrypoints.openai.responses_output import output_items
from pagedllm.entrypoints.openai.responses_protocol import ResponsesRequest
from pagedllm.entrypoints.openai.serving_responses import OpenAIServingResponses

# Function tools in the Responses' flat form.
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False},
}
TIME = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}
GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-responses"))
    build_tiny_model(path)
    template = tmp_path_factory.getbasetemp() / "hermes-responses.jinja"
    template.write_text(HERMES_TEMPLATE)
    app = build_app(engine_args(path), served_model_name=MODEL, chat_template=str(template),
                    tool_call_parser="hermes", enable_auto_tool_choice=True)
    with serving(app) as running:
        yield running


def chat_text(client, messages, **kwargs) -> tuple[str, str]:
    reply = client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def test_text_equals_the_chat_reply(client, http):
    response = client.responses.create(model=MODEL, input="Hello world", max_output_tokens=8, **GREEDY,
                                       extra_body=NO_EOS)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == MODEL
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text"
    text, finish = chat_text(client, [{"role": "user", "content": "Hello world"}], max_tokens=8, **GREEDY,
                             extra_body=NO_EOS)
    assert response.output_text == text and finish == "length"
    usage = response.usage
    assert usage.output_tokens == 8 and usage.total_tokens == usage.input_tokens + 8
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.store is True and response.temperature == 0.0 and response.max_output_tokens == 8
    # Without a limit the reply ends at the end-of-sequence token or the context: completed either way.
    done = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Hi"}], max_output_tokens=30,
                                   **GREEDY)
    assert done.status in ("completed", "incomplete")
    if done.status == "completed":
        assert done.incomplete_details is None and done.completed_at
    wait_idle(http)


def test_stream_events(client, http):
    kwargs = dict(model=MODEL, input="Once upon a time", max_output_tokens=10, **GREEDY, extra_body=NO_EOS)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == text and final.output[0].id == item_id
    assert final.usage.output_tokens == 10
    # A streamed response is stored as the non-streamed one is.
    assert client.responses.retrieve(final.id).output_text == text
    wait_idle(http)


def test_instructions_are_a_system_message(client):
    response = client.responses.create(model=MODEL, input="Hello", instructions="Answer briefly.",
                                       max_output_tokens=6, **GREEDY, extra_body=NO_EOS)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello"}]
    text, _ = chat_text(client, messages, max_tokens=6, **GREEDY, extra_body=NO_EOS)
    assert response.output_text == text and response.instructions == "Answer briefly."
    # Message items of every role and part kind read as the chat messages they are.
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be kind."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "you"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Bye"}]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=6, **GREEDY, extra_body=NO_EOS)
    text, _ = chat_text(client, [{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi\nyou"},
                                 {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
                        max_tokens=6, **GREEDY, extra_body=NO_EOS)
    assert response.output_text == text


def test_function_call_read_by_the_tool_parser(client):
    forced = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    regex = "Sure[.] " + forced.replace("{", r"\{").replace("}", r"\}")
    kwargs = dict(model=MODEL, input=QUESTION, tools=[WEATHER, TIME], max_output_tokens=150, **GREEDY,
                  extra_body={"structured_outputs": {"regex": regex}})  # makes the random model write a call
    response = client.responses.create(**kwargs)
    assert response.status == "completed" and [item.type for item in response.output] == ["message", "function_call"]
    assert response.output[0].content[0].text == "Sure."
    call = response.output[1]
    assert call.name == "get_time" and json.loads(call.arguments) == {"zone": "CET"}
    assert call.call_id and call.id.startswith("fc_") and call.status == "completed"
    assert response.tools[0].name == "get_weather" and response.tool_choice == "auto"
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds.count("response.output_item.added") == 2 and kinds[-1] == "response.completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"zone": "CET"} and done.output_index == 1
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert added[1].type == "function_call" and added[1].name == "get_time" and added[1].id == done.item_id
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text.strip() == "Sure."


def test_named_function_streams_arguments_and_continues_with_its_output(client, http):
    named = {"type": "function", "name": "get_weather"}
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER, TIME], tool_choice=named,
                                    max_output_tokens=60, **GREEDY)
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = list(client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER, TIME], tool_choice=named,
                                          max_output_tokens=60, **GREEDY, stream=True))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 2 and "".join(pieces) == call.arguments
    # The tool's answer continues the stored conversation; the chat request it stands for gives the same reply.
    output = json.dumps({"temperature_c": 21})
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER, TIME], tool_choice="none", max_output_tokens=8,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": output}], **GREEDY,
        extra_body=NO_EOS)
    assert second.previous_response_id == first.id
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": output},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (WEATHER, TIME)]
    text, _ = chat_text(client, messages, tools=tools, tool_choice="none", max_tokens=8, **GREEDY, extra_body=NO_EOS)
    assert second.output_text == text
    # The same conversation sent whole, as items, gives the same reply too.
    items = QUESTION + [call.model_dump(exclude_none=True),
                        {"type": "function_call_output", "call_id": call.call_id, "output": output}]
    whole = client.responses.create(model=MODEL, input=items, tools=[WEATHER, TIME], tool_choice="none",
                                    max_output_tokens=8, **GREEDY, extra_body=NO_EOS)
    assert whole.output_text == text
    # A chain of three: the second's reply is in the third's prompt (usage counts it).
    third = client.responses.create(model=MODEL, previous_response_id=second.id, input="Thanks", max_output_tokens=4,
                                    tools=[WEATHER, TIME], tool_choice="none", **GREEDY, extra_body=NO_EOS)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
    wait_idle(http)


def test_required_tool_choice(client):
    response = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=80, **GREEDY)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and response.parallel_tool_calls is False
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_store_get_delete(client, http):
    stored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=3, metadata={"k": "v"})
    again = client.responses.retrieve(stored.id)
    assert again.model_dump() == stored.model_dump() and again.metadata == {"k": "v"}
    assert http.delete(f"/v1/responses/{stored.id}").json() == {"id": stored.id, "object": "response",
                                                                 "deleted": True}
    assert_error(http.get(f"/v1/responses/{stored.id}"), 404)
    assert_error(http.delete(f"/v1/responses/{stored.id}"), 404)
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=3, store=False)
    assert unstored.store is False
    assert_error(http.get(f"/v1/responses/{unstored.id}"), 404, None, "not found")
    assert_error(http.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": unstored.id}),
                 404, "previous_response_id", "not found")
    kept = client.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    assert_error(http.post(f"/v1/responses/{kept.id}/cancel"), 400, None, "background")
    assert_error(http.post("/v1/responses/resp_nope/cancel"), 404)


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input="The weather as JSON", max_output_tokens=120, **GREEDY,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_logprobs(client):
    response = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, top_logprobs=2, **GREEDY,
                                       extra_body=NO_EOS)
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == 4 and all(len(entry.top_logprobs) == 2 for entry in logprobs)
    assert "".join(entry.token for entry in logprobs) == response.output_text


@pytest.mark.parametrize("body, param, contains", [
    ({"frobnicate": 1}, "frobnicate", "Unknown field"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search'"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "flat"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input", "role"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "item_reference"),
    ({"input": []}, "input", "at least one"),
    ({"input": 5}, "input", ""),
    ({"text": {"format": {"type": "xml"}}}, "text", "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"reasoning": {"summary": "auto"}}, "reasoning", "summaries"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning", "reasoning.effort must be one of"),
    ({"background": True}, "background", "background"),
    ({"truncation": "auto"}, "truncation", ""),
    ({"include": ["reasoning.encrypted_content"]}, "include", "encrypted_content"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "file_search"),
    ({"max_output_tokens": 10_000}, "max_output_tokens", "maximum context length"),
    ({"top_logprobs": 50}, "top_logprobs", "top_logprobs"),
    ({"temperature": -1}, "temperature", ""),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options", "stream"),
    ({"model": "other"}, "model", "does not exist"),
])
def test_bad_requests(http, body, param, contains):
    response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 4, **body})
    error = assert_error(response, 404 if param == "model" else 400, param, contains)
    assert error["type"] == "invalid_request_error"


def test_reasoning_items_with_a_reasoning_parser(server, tmp_path_factory):
    # deepseek_r1: the reply is reasoning until </think>, which the random model never writes.
    path = server.app.state.serving_context.model_path
    app = build_app(engine_args(path, num_kv_blocks=32), served_model_name=MODEL, reasoning_parser="deepseek_r1",
                    responses_store_size=1)
    with serving(app) as running:
        client = running.client
        kwargs = dict(model=MODEL, input="Think", max_output_tokens=6, **GREEDY, extra_body=NO_EOS)
        response = client.responses.create(**kwargs, reasoning={"effort": "low"})
        assert response.reasoning.effort == "low"
        [item] = response.output
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Think"}],
                                              max_tokens=6, **GREEDY, extra_body=NO_EOS).choices[0].message
        assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
        assert item.content[0].type == "reasoning_text" and item.content[0].text == chat.reasoning_content
        assert response.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens == 6
        events = list(client.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in events]
        assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
        assert "response.output_text.delta" not in kinds and "response.reasoning_text.done" in kinds
        deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert deltas == item.content[0].text == events[-1].response.output[0].content[0].text
        # The reasoning goes back as the next assistant turn's reasoning; a store of one keeps the latest only.
        second = client.responses.create(model=MODEL, previous_response_id=events[-1].response.id, input="More",
                                         max_output_tokens=2)
        assert second.status == "incomplete" or second.status == "completed"
        assert running.http.get(f"/v1/responses/{response.id}").status_code == 404
        assert running.http.get(f"/v1/responses/{second.id}").status_code == 200


def test_store_is_a_bounded_lru():
    store = ResponseStore(2)
    for name in "abc":
        store.put(name, StoredResponse({"id": name}, []))
    assert store.get("a") is None and len(store) == 2
    store.get("b")  # b is now the most recently used: c goes first
    store.put("d", StoredResponse({"id": "d"}, []))
    assert store.get("c") is None and store.get("b") is not None
    empty = ResponseStore(0)
    empty.put("a", StoredResponse({}, []))
    assert empty.get("a") is None
    with pytest.raises(ValueError, match="at least 0"):
        ResponseStore(-1)


# ----------------------------------------------------------------------------- reasoning, translators alone


def test_reasoning_items_from_a_chat_reply():
    message = {"role": "assistant", "content": "42", "reasoning_content": "Think: 6 x 7.",
               "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    items = output_items(message, None, incomplete=False)
    assert [item["type"] for item in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Think: 6 x 7."}] and items[0]["summary"] == []
    assert items[2]["call_id"] == "call_1"
    # Fed back as input, they are one assistant turn: its text, its calls (and reasoning where chat carries it).
    messages = chat_messages(items, "Be brief.")
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert len(messages) == 2 and messages[1]["content"] == "42" and messages[1]["tool_calls"][0]["id"] == "call_1"


def _chat_chunk(delta: dict, finish: str | None = None) -> str:
    return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"


def _served(chunks: list[str]) -> list[dict]:
    """The events the stream translator makes of these chat chunks (no engine: a stub context)."""
    words = SimpleNamespace(encode=lambda text, add_special_tokens: text.split())
    ctx = SimpleNamespace(model_name="m", tokenizer=words)

    async def run_in_tokenizer_thread(fn, *args):
        return fn(*args)

    ctx.run_in_tokenizer_thread = run_in_tokenizer_thread
    serving = OpenAIServingResponses(SimpleNamespace(ctx=ctx), ResponseStore(4))

    async def chat_stream():
        for chunk in chunks:
            yield chunk

    async def collect() -> list[str]:
        request = ResponsesRequest(input="hi", store=False)
        return [event async for event in serving._events(request, "resp_1", 0, chat_stream(), [])]

    events = []
    for raw in asyncio.run(collect()):
        kind, data = raw.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    return events


def test_stream_reasoning_then_text_then_call():
    usage = {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}
    events = _served([
        _chat_chunk({"role": "assistant", "content": ""}),
        _chat_chunk({"reasoning_content": "Six "}), _chat_chunk({"reasoning_content": "times seven."}),
        _chat_chunk({"content": "It is 42."}),
        _chat_chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                                     "function": {"name": "f", "arguments": '{"x": 1}'}}]}, "tool_calls"),
        "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n", "data: [DONE]\n\n",
    ])
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[6]["text"] == "Six times seven." and events[8]["item"]["type"] == "reasoning"
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call"]
    assert [item["status"] for item in final["output"]] == ["completed"] * 3
    assert final["output"][2]["arguments"] == '{"x": 1}' and final["output"][2]["call_id"] == "call_9"
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3  # the stub tokenizer splits words
    assert final["usage"]["input_tokens"] == 3 and final["usage"]["total_tokens"] == 12


def test_stream_error_becomes_an_error_event():
    error = {"error": {"message": "The engine failed.", "type": "server_error", "param": None, "code": "engine_dead"}}
    events = _served([_chat_chunk({"content": "Hi"}), "data: " + json.dumps(error) + "\n\n", "data: [DONE]\n\n"])
    assert events[-1] == {"type": "error", "sequence_number": len(events) - 1, "code": "engine_dead",
                          "message": "The engine failed.", "param": None}
    assert not any(e["type"] == "response.completed" for e in events)
